//! Broker faults on Apache Kafka, each on a broker or cluster of the test's own: a broker killed
//! with SIGKILL and restarted on its log directory, the leader of the relay's partitions killed,
//! two of three brokers stopped (acks=all refused with NotEnoughReplicas), partitions added
//! while the relay runs, records deleted from a partition's start before a read-back. Each
//! asserts no loss, no phantom and per-key order on what arrived, and counts duplicates.

use crate::common;

use std::collections::HashMap;
use std::time::Duration;

use common::broker::OwnBroker;
use common::process::RelayProcess;
use common::workload::*;
use common::*;
use rdkafka::admin::{AdminClient, AdminOptions, NewPartitions};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::{ClientConfig, TopicPartitionList};

const AGGREGATES: usize = 20;

/// A replication relay on a broker (or cluster) of the test's own, with a topic of
/// `partitions` and `AGGREGATES` aggregates to write to.
async fn relay_on(broker: &OwnBroker, partitions: i32) -> (Setup, RelayProcess) {
    relay_on_brokers(&broker.brokers(), partitions).await
}

/// As [`relay_on`], on the brokers `brokers`.
async fn relay_on_brokers(brokers: &str, partitions: i32) -> (Setup, RelayProcess) {
    let s = Setup::create(brokers, QUICK_KAFKA_SETTINGS, false, |slot| {
        RelayToml::replication(slot).set("retry", "initial_backoff_ms", 100).set(
            "retry",
            "max_backoff_ms",
            1000,
        )
    })
    .await;
    create_topic_on(brokers, &s.topic, partitions).await;
    create_aggregates(&s.db.client().await, AGGREGATES).await;
    let relay = s.start("relay");
    relay.wait_ready("active").await;
    (s, relay)
}

/// Writes `total` events in the background, in transactions of 1-5 over the aggregates.
fn write_in_background(s: &Setup, total: usize) -> tokio::task::JoinHandle<HashMap<String, i64>> {
    let url = s.db.url.clone();
    let aggregate_type = s.aggregate_type.clone();
    tokio::spawn(async move { write_concurrently(&url, &aggregate_type, AGGREGATES, total, 2).await })
}

/// Waits until Kafka acknowledged at least `n` events of the relay's.
async fn wait_acknowledged(relay: &RelayProcess, n: f64) {
    relay.wait_metric("outbox_relay_events_published_total{mode=\"replication\"}", |v| v >= n).await;
}

/// Consumes every committed event (and late duplicates), asserts no loss, no phantom and
/// per-key order, and prints the duplicates.
async fn assert_all_arrived(
    brokers: &str,
    s: &Setup,
    committed: &HashMap<String, i64>,
    relay: &RelayProcess,
) {
    let total: i64 = committed.values().sum();
    let consumer = consumer_on(brokers, &[&s.topic]);
    let records = consume_unique(&consumer, total as usize, IDLE, LINGER).await;
    let ids = unique_ids(&records);
    assert_eq!(ids.len() as i64, total, "{} of {total} events arrived: {}", ids.len(), relay.log_text());
    let report = assert_delivered(&records, committed);
    eprintln!("{} events arrived once each, {} duplicates", report.unique, report.duplicates);
}

/// The broker id leading `partition` of `topic`.
fn leader_of(brokers: &str, topic: &str, partition: i32) -> i32 {
    let consumer: BaseConsumer = ClientConfig::new().set("bootstrap.servers", brokers).create().unwrap();
    let metadata = consumer.fetch_metadata(Some(topic), Duration::from_secs(10)).unwrap();
    metadata.topics()[0].partitions().iter().find(|p| p.id() == partition).unwrap().leader()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_broker_killed_under_load_and_restarted_on_its_log_loses_nothing() {
    // given a relay publishing to a single broker of its own, under a steady load
    let broker = OwnBroker::start();
    let (s, relay) = relay_on(&broker, 4).await;
    let writer = write_in_background(&s, 3_000);
    wait_acknowledged(&relay, 300.0).await;

    // when the broker is killed with SIGKILL mid-load and started again on its log directory
    broker.kill9(1);
    tokio::time::sleep(Duration::from_secs(2)).await;
    broker.restart(1);
    let committed = writer.await.unwrap();

    // then every committed event is there, once acknowledged with acks=all, in order per key
    assert_all_arrived(&broker.brokers(), &s, &committed, &relay).await;
    let mut relay = relay;
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0), "{}", relay.log_text());
}

#[tokio::test(flavor = "multi_thread")]
async fn the_leader_of_the_relays_partitions_killed_under_load_loses_nothing() {
    // given a relay on three brokers (replication factor 3, min.insync.replicas 2), under load
    let cluster = OwnBroker::cluster();
    let (s, relay) = relay_on(&cluster, 4).await;
    let writer = write_in_background(&s, 3_000);
    wait_acknowledged(&relay, 300.0).await;

    // when the broker leading partition 0 is killed with SIGKILL
    let leader = leader_of(&cluster.brokers(), &s.topic, 0);
    cluster.kill9(leader);
    let committed = writer.await.unwrap();

    // then the others take over its partitions and every committed event arrives, in order
    assert_all_arrived(&cluster.brokers(), &s, &committed, &relay).await;
    // and the killed broker rejoins
    cluster.restart(leader);
    let mut relay = relay;
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0), "{}", relay.log_text());
}

#[tokio::test(flavor = "multi_thread")]
async fn two_of_three_brokers_stopped_hold_the_relay_without_dead_letters_until_they_return() {
    // given a relay on three brokers (min.insync.replicas 2) that has published
    let cluster = OwnBroker::cluster();
    let (s, relay) = relay_on(&cluster, 2).await;
    let client = s.db.client().await;
    let mut writer = connect(&s.db.url).await;
    write_events(&mut writer, &s.aggregate_type, "agg-0", 3, true).await;
    wait_acknowledged(&relay, 3.0).await;

    // when two brokers stop, and events are written
    cluster.stop(2);
    cluster.stop(3);
    for n in 0..10 {
        write_events(&mut writer, &s.aggregate_type, &format!("agg-{}", n % 4), 2, true).await;
    }

    // then the relay waits: /readyz says Kafka refuses for want of in-sync replicas, nothing is
    // dead-lettered, the slot is not confirmed past the refused events
    wait_until(relay.context("/readyz to name the missing replicas".into()), async || {
        relay.readyz().is_some_and(|(code, body)| code == 503 && body.contains("replicas in sync"))
    })
    .await;
    let (_, body) = relay.readyz().unwrap();
    assert!(body.contains(&s.topic), "{body}");
    let letters: i64 = client.query_one("SELECT count(*) FROM outbox_dead_letter", &[]).await.unwrap().get(0);
    assert_eq!(letters, 0, "{}", relay.log_text());
    assert_eq!(
        relay.metric("outbox_relay_events_published_total{mode=\"replication\"}"),
        Some(3.0),
        "{}",
        relay.log_text()
    );

    // when the brokers come back, then the relay carries on and everything arrives
    cluster.restart(2);
    cluster.restart(3);
    write_events(&mut writer, &s.aggregate_type, "agg-5", 1, true).await;
    let committed = committed_counts(&client).await;
    assert_all_arrived(&cluster.brokers(), &s, &committed, &relay).await;
    relay.wait_ready("active").await;
    let mut relay = relay;
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0), "{}", relay.log_text());
}

fn admin(brokers: &str) -> AdminClient<DefaultClientContext> {
    ClientConfig::new().set("bootstrap.servers", brokers).create().unwrap()
}

/// Per key, the partitions its first arrivals came on, each a run of consecutive seqs: a key
/// moves at most once (at the partition change), and every seq on its old partition precedes
/// every seq on its new one. Returns how many keys moved.
fn assert_order_across_a_move(records: &[Consumed], committed: &HashMap<String, i64>) -> usize {
    let mut first: HashMap<String, Vec<(i32, i64)>> = HashMap::new();
    let mut seen = std::collections::HashSet::new();
    for r in records {
        if seen.insert(r.header("id").unwrap().to_string()) {
            first.entry(r.key.clone().unwrap()).or_default().push((r.partition, seq_of(r)));
        }
    }
    let mut moved = 0;
    for (key, arrivals) in &first {
        let mut by_partition: Vec<(i32, Vec<i64>)> = Vec::new();
        for partition in arrivals.iter().map(|(p, _)| *p) {
            if !by_partition.iter().any(|(p, _)| *p == partition) {
                let seqs = arrivals.iter().filter(|(p, _)| *p == partition).map(|(_, s)| *s).collect();
                by_partition.push((partition, seqs));
            }
        }
        assert!(by_partition.len() <= 2, "aggregate {key} arrived on {} partitions", by_partition.len());
        for (partition, seqs) in &by_partition {
            assert!(
                seqs.windows(2).all(|w| w[1] == w[0] + 1),
                "aggregate {key} out of order on {partition}: {seqs:?}"
            );
        }
        let mut runs: Vec<&Vec<i64>> = by_partition.iter().map(|(_, s)| s).collect();
        runs.sort_by_key(|seqs| seqs[0]);
        let all: Vec<i64> = runs.into_iter().flatten().copied().collect();
        let expected: Vec<i64> = (1..=committed[key]).collect();
        assert_eq!(all, expected, "aggregate {key}: lost, phantom or reordered across its move");
        moved += usize::from(by_partition.len() == 2);
    }
    assert_eq!(first.len(), committed.len(), "every aggregate arrived");
    moved
}

#[tokio::test(flavor = "multi_thread")]
async fn partitions_added_while_the_relay_runs_lose_nothing_and_keys_move_once_in_order() {
    // given a relay publishing to a topic of 2 partitions under load
    let brokers = services().kafka.clone();
    let (s, mut relay) = relay_on_brokers(&brokers, 2).await;
    let writer = write_in_background(&s, 2_000);
    wait_acknowledged(&relay, 300.0).await;

    // when the topic grows to 4 partitions, and the relay is killed and started again (a new
    // producer learns the new count at once; a running one at its next metadata refresh)
    let grown =
        admin(&brokers).create_partitions([&NewPartitions::new(&s.topic, 4)], &AdminOptions::new()).await;
    grown.unwrap()[0].as_ref().unwrap();
    relay.kill9();
    let relay = s.start("relay-after");
    let committed = writer.await.unwrap();

    // then every committed event arrives exactly once (the restarted relay read back all four
    // partitions), each key's events in order, those of a key that moved all on its old
    // partition before all on its new one
    let total: i64 = committed.values().sum();
    let consumer = consumer_on(&brokers, &[&s.topic]);
    let records = consume_unique(&consumer, total as usize, IDLE, LINGER).await;
    let moved = assert_order_across_a_move(&records, &committed);
    let duplicates = records.len() - unique_ids(&records).len();
    eprintln!("{total} events, {moved} of {AGGREGATES} keys moved partition, {duplicates} duplicates");
    assert_eq!(duplicates, 0, "{}", relay.log_text());
    assert!(moved > 0, "no key moved: the test did not exercise a move");
}

#[tokio::test(flavor = "multi_thread")]
async fn records_deleted_from_the_partitions_start_are_reported_truncated_and_sent_again() {
    // given a relay that published 1,000 events and was killed, and 50 written since
    let brokers = services().kafka.clone();
    let (s, mut relay) = relay_on_brokers(&brokers, 4).await;
    let consumer = consumer_on(&brokers, &[&s.topic]);
    write_concurrently(&s.db.url, &s.aggregate_type, AGGREGATES, 1_000, 2).await;
    let mut records = consume_unique(&consumer, 1_000, IDLE, Duration::ZERO).await;
    relay.kill9();
    let committed = write_concurrently(&s.db.url, &s.aggregate_type, AGGREGATES, 50, 1).await;

    // when the first 100 records of every partition are deleted (DeleteRecords), then the slot
    // is recreated: its first copy reads the topic back to the partitions' new start
    let mut cut = TopicPartitionList::new();
    for partition in 0..4 {
        cut.add_partition_offset(&s.topic, partition, rdkafka::Offset::Offset(100)).unwrap();
    }
    let deleted = admin(&brokers).delete_records(&cut, &AdminOptions::new()).await.unwrap();
    for element in deleted.elements() {
        assert_eq!(element.offset(), rdkafka::Offset::Offset(100), "{element:?}");
    }
    let config = s.config().display().to_string();
    let (code, stdout, stderr) = run_relay(&["setup", "--recreate-slot", "--config", &config], EXIT_LIMIT);
    assert_eq!(code, 0, "{stdout}{stderr}");

    // then the read-back says it was truncated, and the 400 events whose records were deleted
    // are sent again besides the 50 new ones: nothing is lost
    assert!(stderr.contains("result=\"truncated\""), "{stderr}");
    records.extend(consume_unique(&consumer, 450, IDLE, LINGER).await);
    let report = assert_delivered(&records, &committed);
    assert_eq!((report.unique, report.duplicates), (1_050, 400), "{stderr}");
}
