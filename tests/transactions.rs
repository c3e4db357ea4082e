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
        .set("fetch.wait.max.ms", "10")
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
    let s =
        Setup::create(brokers, &kafka, true, |slot| RelayToml::replication(slot).set("source", "mode", mode))
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

/// The backends holding advisory locks in `client`'s database: the active polling relay's
/// leader session.
async fn terminate_lock_holders(client: &tokio_postgres::Client) -> i64 {
    let row = client
        .query_one(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_locks WHERE locktype = 'advisory' AND granted \
             AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
            &[],
        )
        .await
        .unwrap();
    row.get(0)
}

/// Waits until a relay's claim transaction is open (`idle in transaction`: it waits for Kafka).
async fn wait_claim_open(client: &tokio_postgres::Client) {
    wait_until("a claim to wait for Kafka", async || {
        let row = client
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'outbox-relay' \
                 AND datname = current_database() AND state = 'idle in transaction'",
                &[],
            )
            .await
            .unwrap();
        row.get::<_, i64>(0) > 0
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_frozen_relay_that_comes_back_is_fenced_and_nothing_it_sent_becomes_visible() {
    // given two polling relays with Kafka transactions on a broker of their own, the active one
    // having published 100 events
    let broker = common::broker::OwnBroker::start();
    let kafka = format!("transactional = true\n{QUICK_KAFKA_SETTINGS}");
    let s = Setup::create(&broker.brokers(), &kafka, false, |_| {
        RelayToml::mode("polling")
            .set("polling", "poll_interval_ms", 100)
            .set("polling", "claim_timeout_ms", 120_000)
            .set("retry", "initial_backoff_ms", 100)
            .set("retry", "max_backoff_ms", 500)
    })
    .await;
    create_topic_on(&broker.brokers(), &s.topic, 4).await;
    let client = s.db.client().await;
    create_aggregates(&client, AGGREGATES).await;
    write_concurrently(&s.db.url, &s.aggregate_type, AGGREGATES, 100, 1).await;
    let a = s.start("a");
    a.wait_ready("active").await;
    let b = s.start("b");
    wait_until("the outbox to empty", async || s.outbox_rows().await == 0).await;

    // when the broker stalls while 50 more are claimed and sent, the active relay is frozen
    // (SIGSTOP) with its Kafka transaction open, the broker comes back, the database ends the
    // frozen relay's session, and the standby takes over and publishes the 50
    broker.freeze();
    // (the events per aggregate committed so far, these 50 included)
    let committed = write_concurrently(&s.db.url, &s.aggregate_type, AGGREGATES, 50, 1).await;
    wait_claim_open(&client).await;
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    common::broker::signal(a.pid(), "-STOP");
    broker.thaw();
    assert!(terminate_lock_holders(&client).await > 0, "the frozen relay held the polling lock");
    b.wait_ready("active").await;
    wait_until("the standby to publish the 50", async || s.outbox_rows().await == 0).await;
    // and the frozen relay comes back (SIGCONT), its records acknowledged, its commit owed
    common::broker::signal(a.pid(), "-CONT");

    // then it is fenced: it says so, and stands by
    wait_until(a.context("the relay that came back to say it is fenced".into()), async || {
        a.log_text().contains("fenced")
    })
    .await;
    // and a read_committed consumer sees every event once, in order: nothing of the fenced
    // relay's transaction
    let consumer = isolated_consumer(&broker.brokers(), &s.topic, "read_committed");
    let records = consume_ids(&consumer, 150).await;
    let report = assert_delivered(&records, &committed);
    assert_eq!((report.unique, report.duplicates), (150, 0), "{}\n{}", a.log_text(), b.log_text());
    assert!(b.readyz().is_some_and(|(_, body)| body.starts_with("active")), "the standby stays active");
    let uncommitted = isolated_consumer(&broker.brokers(), &s.topic, "read_uncommitted");
    let seen = consume_ids(&uncommitted, 150).await;
    eprintln!(
        "a fenced zombie: read_committed sees {} records for 150 events, read_uncommitted {} (the zombie's aborted \
         transaction included)",
        records.len(),
        seen.len()
    );
}

/// The sessions of the replication relay active on slot `$1`: its walsender, and the session
/// holding the slot's advisory lock (a standby only tries it).
const ACTIVE_SESSIONS_SQL: &str = "SELECT active_pid AS pid FROM pg_replication_slots \
     WHERE slot_name = $1 AND active_pid IS NOT NULL \
     UNION SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted \
       AND database = (SELECT oid FROM pg_database WHERE datname = current_database())";

/// Writes `events` events of aggregate `aggregate` in ONE PostgreSQL transaction, in seq order.
async fn write_one_large_transaction(
    client: &tokio_postgres::Client,
    aggregate_type: &str,
    aggregate: &str,
    events: i64,
) {
    client
        .execute(
            "WITH s AS (UPDATE test_aggregates SET seq = seq + $3 WHERE id = $1 RETURNING seq - $3 AS base) \
             INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload) \
             SELECT $2, $1, 'SeqEvent', jsonb_build_object('seq', s.base + g) \
             FROM s, generate_series(1::bigint, $3) g ORDER BY g",
            &[&aggregate, &aggregate_type, &events],
        )
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn a_relay_frozen_mid_transaction_is_fenced_by_the_standby_and_its_records_stay_invisible() {
    // given two replication relays with Kafka transactions large enough for one PostgreSQL
    // transaction of 50,000 events, on a broker of their own
    const EVENTS: i64 = 50_000;
    let broker = common::broker::OwnBroker::start();
    let kafka = format!("transactional = true\ntransaction_max_events = 100000\n{QUICK_KAFKA_SETTINGS}");
    let s = Setup::create(&broker.brokers(), &kafka, false, |slot| {
        RelayToml::replication(slot)
            .set("replication", "max_in_flight_events", 100_000)
            .set("replication", "max_in_flight_bytes", 100_000_000)
            .set("retry", "initial_backoff_ms", 100)
            .set("retry", "max_backoff_ms", 500)
    })
    .await;
    create_topic_on(&broker.brokers(), &s.topic, 4).await;
    let client = s.db.client().await;
    create_aggregates(&client, 1).await;
    // (the relay to be frozen sends one record per request, one request at a time: its transaction
    // is still open when the test sees its first record and freezes it, however loaded the machine)
    let one_at_a_time = [
        ("OUTBOX_RELAY_KAFKA_BATCH_NUM_MESSAGES", "1"),
        ("OUTBOX_RELAY_KAFKA_MAX_IN_FLIGHT_REQUESTS_PER_CONNECTION", "1"),
    ];
    let a = s.start_with_env("a", &one_at_a_time);
    a.wait_ready("active").await;
    let b = s.start("b");

    // when the active relay is frozen (SIGSTOP) once the first of those events is in the log,
    // uncommitted, the database ends its sessions (as wal_sender_timeout and TCP keepalives
    // would), and the standby takes over and publishes them
    // (the active relay's sessions, looked up first: the SIGSTOP follows the first record at once)
    let frozen: Vec<i32> =
        client.query(ACTIVE_SESSIONS_SQL, &[&s.slot]).await.unwrap().iter().map(|r| r.get(0)).collect();
    assert_eq!(frozen.len(), 2, "the active relay's walsender and lock session: {frozen:?}");
    let uncommitted = isolated_consumer(&broker.brokers(), &s.topic, "read_uncommitted");
    write_one_large_transaction(&client, &s.aggregate_type, "agg-0", EVENTS).await;
    assert!(!consume(&uncommitted, 1, IDLE).await.is_empty(), "{}", a.log_text());
    common::broker::signal(a.pid(), "-STOP");
    // (ended again until the standby is active, should one outlive the first try; only the frozen
    // relay's sessions, so the standby's are never touched)
    wait_until(b.context("the standby to take over".into()), async || {
        client
            .execute("SELECT pg_terminate_backend(pid) FROM unnest($1::int[]) pid", &[&frozen])
            .await
            .unwrap();
        tokio::time::sleep(std::time::Duration::from_millis(1_500)).await;
        b.readyz().is_some_and(|(_, body)| body.starts_with("active"))
    })
    .await;
    let committed = isolated_consumer(&broker.brokers(), &s.topic, "read_committed");
    let records = consume_ids(&committed, EVENTS as usize).await;
    // and the frozen relay comes back (SIGCONT)
    common::broker::signal(a.pid(), "-CONT");

    // then it is fenced, says so, and sends nothing more
    wait_until(a.context("the relay that came back to say it is fenced".into()), async || {
        a.log_text().contains("fenced")
    })
    .await;
    // and a read_committed consumer saw each event once, in order; a read_uncommitted one also
    // sees the records of the fenced relay's aborted transaction
    let report = assert_delivered(&records, &committed_counts(&client).await);
    assert_eq!((report.unique, report.duplicates), (EVENTS as usize, 0), "{}", b.log_text());
    let late = consume(&committed, usize::MAX, LINGER).await;
    assert!(late.is_empty(), "{} records became visible after the fencing", late.len());
    let all =
        consume_ids(&isolated_consumer(&broker.brokers(), &s.topic, "read_uncommitted"), EVENTS as usize)
            .await;
    eprintln!(
        "a relay frozen mid-transaction: read_committed sees {} records for {EVENTS} events, read_uncommitted {} \
         ({} of the fenced relay's aborted transaction)",
        records.len(),
        all.len(),
        all.len() - records.len()
    );
    assert!(all.len() > records.len(), "the frozen relay's records were in the log before it was fenced");
}

/// A record Kafka refuses inside a transaction, in `mode`: see the test below.
async fn a_refused_record_is_dead_lettered_and_the_rest_of_its_transaction_commits(mode: &str) {
    // given a relay with Kafka transactions whose producer refuses records over 2,000 bytes
    let kafka = "transactional = true\n[kafka.properties]\n\"message.max.bytes\" = \"2000\"";
    let s = Setup::create(&services().kafka, kafka, true, |slot| {
        RelayToml::replication(slot).set("source", "mode", mode).set("retry", "initial_backoff_ms", 100).set(
            "retry",
            "max_backoff_ms",
            500,
        )
    })
    .await;
    let client = s.db.client().await;
    let relay = s.start("relay");
    relay.wait_ready("active").await;

    // when one PostgreSQL transaction writes three events of one aggregate, the second too large
    client
        .execute(
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload) VALUES \
             ($1, 'k', 'E', '{\"n\": 1}'), ($1, 'k', 'E', jsonb_build_object('n', 2, 'pad', repeat('x', 3000))), \
             ($1, 'k', 'E', '{\"n\": 3}')",
            &[&s.aggregate_type],
        )
        .await
        .unwrap();

    // then the transaction that held it is aborted, the next session dead-letters it unsent,
    // and the other two arrive once each, in order, to a read_committed consumer
    let consumer = isolated_consumer(&services().kafka, &s.topic, "read_committed");
    let records = consume_ids(&consumer, 2).await;
    let payloads: Vec<&str> = records.iter().filter_map(|r| r.payload.as_deref()).collect();
    assert_eq!(payloads, ["{\"n\": 1}", "{\"n\": 3}"], "{}", relay.log_text());
    let reason: String = client
        .query_one("SELECT reason FROM outbox_dead_letter WHERE row_data ->> 'payload' LIKE '%pad%'", &[])
        .await
        .unwrap()
        .get(0);
    assert!(reason.contains("too large"), "{reason}");
    let aborted = relay.metric("outbox_relay_kafka_transactions_total{outcome=\"aborted\"}");
    assert!(aborted.is_some_and(|n| n >= 1.0), "{}", relay.log_text());
    assert!(relay.log_text().contains("inside a Kafka transaction"), "{}", relay.log_text());
}

#[tokio::test(flavor = "multi_thread")]
async fn replication_dead_letters_a_record_kafka_refuses_in_a_transaction_and_commits_the_rest() {
    a_refused_record_is_dead_lettered_and_the_rest_of_its_transaction_commits("replication").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn polling_dead_letters_a_record_kafka_refuses_in_a_transaction_and_commits_the_rest() {
    a_refused_record_is_dead_lettered_and_the_rest_of_its_transaction_commits("polling").await;
}

/// A transaction of another producer, open in partition 0 of `topic` with one record.
fn open_stranger_transaction(brokers: &str, topic: &str) -> rdkafka::producer::BaseProducer {
    use rdkafka::producer::{BaseProducer, BaseRecord, Producer};
    let stranger: BaseProducer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("transactional.id", format!("stranger-{}", random_suffix()))
        .set("transaction.timeout.ms", "300000")
        .create()
        .unwrap();
    let wait = std::time::Duration::from_secs(30);
    stranger.init_transactions(wait).unwrap();
    stranger.begin_transaction().unwrap();
    stranger
        .send(BaseRecord::to(topic).partition(0).key("stranger").payload("{}"))
        .map_err(|(e, _)| e)
        .unwrap();
    stranger.flush(wait).unwrap();
    stranger
}

#[tokio::test(flavor = "multi_thread")]
async fn a_partition_held_open_by_a_transaction_is_not_read_past_and_nothing_is_sent_until_it_ends() {
    // given a topic whose partition 0 another producer holds open (a transaction with one
    // record, not committed), and 40 events in the outbox
    let kafka = format!("transactional = true\n{QUICK_KAFKA_SETTINGS}");
    let s = Setup::create(&services().kafka, &kafka, true, |slot| {
        RelayToml::replication(slot).set("retry", "initial_backoff_ms", 100).set(
            "retry",
            "max_backoff_ms",
            1_000,
        )
    })
    .await;
    create_aggregates(&s.db.client().await, AGGREGATES).await;
    let stranger = open_stranger_transaction(&services().kafka, &s.topic);
    let committed = write_concurrently(&s.db.url, &s.aggregate_type, AGGREGATES, 40, 1).await;

    // when the relay starts
    let relay = s.start("relay");

    // then it names the partition held open, aborts a transaction of its own there (which
    // cannot end another producer's), and sends nothing: a read_uncommitted consumer sees the
    // one record of each of those aborted transactions, and none of the relay's events
    wait_until(
        relay.context("the relay to abort a transaction of its own in partition 0".into()),
        async || relay.log_text().contains("aborted a transaction in each partition found held open"),
    )
    .await;
    let log = relay.log_text();
    assert!(
        log.contains(&format!("an open Kafka transaction holds topic \"{}\" partition 0", s.topic)),
        "{log}"
    );
    assert!(log.contains("kafka-transactions.sh"), "what to do about one that never ends: {log}");
    let uncommitted = isolated_consumer(&services().kafka, &s.topic, "read_uncommitted");
    let seen = consume(&uncommitted, usize::MAX, LINGER).await;
    assert!(seen.iter().any(|r| r.header("outbox_relay_unpin").is_some()), "{seen:?}");
    assert!(
        seen.iter().all(|r| r.header("id").is_none()),
        "the relay sent while the partition was held: {seen:?}"
    );

    // and once the other producer commits, a read_committed consumer sees every event once, in order
    rdkafka::producer::Producer::commit_transaction(&stranger, std::time::Duration::from_secs(30)).unwrap();
    let consumer = isolated_consumer(&services().kafka, &s.topic, "read_committed");
    let records: Vec<Consumed> =
        consume_ids(&consumer, 41).await.into_iter().filter(|r| r.header("id").is_some()).collect();
    let report = assert_delivered(&records, &committed);
    assert_eq!((report.unique, report.duplicates), (40, 0), "{}", relay.log_text());
    assert!(relay.metric("outbox_relay_dedup_scans_total{result=\"pinned\"}").is_some_and(|n| n >= 1.0));
}
