//! Kafka transactions (`kafka.transactional`): exactly once for a `read_committed` consumer,
//! with no straggler window, in both modes; a frozen instance that comes back is fenced.
//!
//! What a `read_uncommitted` consumer sees is counted too: the records of aborted transactions
//! are in the log, only a `read_committed` reader skips them.

use crate::common;

use std::collections::HashSet;

use common::workload::*;
use common::*;
use rdkafka::ClientConfig;
use rdkafka::consumer::{Consumer, StreamConsumer};

const AGGREGATES: usize = 20;

/// A consumer of every partition of `topic` from the start, at `isolation` (`read_committed`
/// or `read_uncommitted`).
pub fn isolated_consumer(brokers: &str, topic: &str, isolation: &str) -> StreamConsumer {
    let consumer: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", format!("test-{}", random_suffix()))
        .set("auto.offset.reset", "earliest")
        .set("enable.auto.commit", "false")
        .set("isolation.level", isolation)
        .create()
        .unwrap();
    consumer.subscribe(&[topic]).unwrap();
    consumer
}

/// The relay's records a consumer sees until `unique` distinct ids arrived, then [`LINGER`]
/// more for late duplicates.
async fn consume_ids(consumer: &StreamConsumer, unique: usize) -> Vec<Consumed> {
    let mut records = Vec::new();
    let mut ids = HashSet::new();
    while ids.len() < unique {
        let batch = consume(consumer, 1, IDLE).await;
        if batch.is_empty() {
            break;
        }
        for r in batch {
            ids.insert(r.header("id").unwrap_or_default().to_string());
            records.push(r);
        }
    }
    records.extend(consume(consumer, usize::MAX, LINGER).await);
    records
}

/// A setup whose relay uses Kafka transactions, with `kafka` settings added to [`QUICK_KAFKA_SETTINGS`].
async fn transactional_setup(mode: &str, brokers: &str, kafka: &str) -> Setup {
    let kafka = format!("transactional = true\n{kafka}\n{QUICK_KAFKA_SETTINGS}");
    let s = Setup::create(brokers, &kafka, true, |slot| RelayToml::replication(slot).set("source", "mode", mode))
        .await;
    create_aggregates(&s.db.client().await, AGGREGATES).await;
    s
}

async fn publishes_each_event_once_in_transactions(mode: &str) {
    // given a relay with Kafka transactions, and 600 events written by 3 writers
    let s = transactional_setup(mode, &services().kafka, "").await;
    let relay = s.start("relay");
    relay.wait_ready("active").await;
    let committed = write_concurrently(&s.db.url, &s.aggregate_type, AGGREGATES, 600, 3).await;

    // then a read_committed consumer sees each once, in order
    let consumer = isolated_consumer(&services().kafka, &s.topic, "read_committed");
    let records = consume_ids(&consumer, 600).await;
    let report = assert_delivered(&records, &committed);
    assert_eq!((report.unique, report.duplicates), (600, 0), "{}", relay.log_text());
    let log = relay.log_text();
    assert!(log.contains("Kafka transactions initialized"), "{log}");
    let published = format!("outbox_relay_events_published_total{{mode=\"{mode}\"}}");
    assert_eq!(relay.metric(&published), Some(600.0), "each event counted once, at its commit");
}

#[tokio::test(flavor = "multi_thread")]
async fn replication_publishes_each_event_once_in_kafka_transactions() {
    publishes_each_event_once_in_transactions("replication").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn polling_publishes_each_event_once_in_kafka_transactions() {
    publishes_each_event_once_in_transactions("polling").await;
}
