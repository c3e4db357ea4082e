//! Exactly once for a plain consumer, across everything that makes a source replay.
//!
//! Each test has a PostgreSQL and a broker of its own (the broker is frozen, the server
//! restarted). Two relays run at once, one active and one standby, so every SIGKILL of the
//! active one is a standby takeover; the killed one comes back as the new standby. Writers
//! commit and roll back transactions of 1-4 events over 40 aggregates throughout. At the end,
//! every committed event must have arrived exactly once, nothing of a rolled-back transaction,
//! each aggregate in order. With `dedup.enabled = false` the same run prints its duplicates.
//!
//! With Kafka transactions (`kafka.transactional`) the same run is read by a `read_committed`
//! consumer, under a `kafka.transaction_timeout_ms` (10 s) shorter than the broker's freeze
//! (20 s), and what a `read_uncommitted` consumer sees is counted beside it.

use crate::common;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use crate::transactions::isolated_consumer;
use common::broker::OwnBroker;
use common::process::RelayProcess;
use common::workload::{
    DeliveryReport, assert_delivered, committed_counts, create_aggregates, try_write_txn, write_concurrently,
};
use common::*;
use futures::StreamExt;
use rdkafka::ClientConfig;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};

const AGGREGATES: usize = 40;
const KILLS: usize = 10;
/// Kills after which PostgreSQL is fast-restarted, the broker frozen, strangers written.
const PG_RESTARTS: [usize; 2] = [3, 6];
const FREEZE_AFTER: usize = 4;
const FROZEN: Duration = Duration::from_secs(20);
const STRANGERS_AFTER: usize = 8;
/// With Kafka transactions: shorter than [`FROZEN`], so the brokers abort the transaction open
/// across the freeze.
const TRANSACTION_TIMEOUT_MS: u64 = 10_000;

/// A relay pair on a server and broker of their own.
struct Rig {
    pg: HashMap<String, String>,
    broker: OwnBroker,
    s: Setup,
    relays: Vec<RelayProcess>,
    started: usize,
}

impl Rig {
    async fn new(mode: &str, dedup: bool, transactional: bool) -> Rig {
        let pg = hold("hold-postgres", &[]);
        let broker = OwnBroker::start();
        let db = TestDb::create_at(&pg["OUTBOX_RELAY_TEST_PG_URL"], "", true).await;
        create_aggregates(&db.client().await, AGGREGATES).await;
        let kafka = match transactional {
            true => format!(
                "transactional = true\ntransaction_timeout_ms = {TRANSACTION_TIMEOUT_MS}\n{QUICK_KAFKA_SETTINGS}"
            ),
            false => QUICK_KAFKA_SETTINGS.to_string(),
        };
        let s = Setup::create_on(db, &broker.brokers(), &kafka, false, |slot| {
            let config = RelayToml::replication(slot)
                .set("source", "mode", mode)
                .set("dedup", "enabled", dedup)
                .set("retry", "initial_backoff_ms", 100)
                .set("retry", "max_backoff_ms", 500);
            match mode {
                "polling" => config.set("polling", "poll_interval_ms", 100).set("polling", "batch_size", 200),
                _ => config,
            }
        })
        .await;
        create_topic_on(&broker.brokers(), &s.topic, 4).await;
        let mut rig = Rig { pg, broker, s, relays: Vec::new(), started: 0 };
        rig.start_relay();
        rig.relays[0].wait_ready("active").await;
        rig.start_relay();
        rig
    }

    fn start_relay(&mut self) {
        self.relays.push(self.s.start(&format!("relay-{}", self.started)));
        self.started += 1;
    }

    /// SIGKILL for the relay that is active (or either, while neither is), and a new standby.
    fn kill_active(&mut self) {
        let active = self
            .relays
            .iter()
            .position(|r| r.readyz().is_some_and(|(_, body)| body.starts_with("active")))
            .unwrap_or(0);
        let mut killed = self.relays.remove(active);
        killed.kill9();
        self.start_relay();
    }

    fn restart_postgres(&self) {
        let data = &self.pg["OUTBOX_RELAY_TEST_PG_DATA"];
        pg_ctl(&self.pg["OUTBOX_RELAY_TEST_PG_BIN"], &["-D", data, "-m", "fast", "-w", "restart"]);
    }

    /// Every relay's log this rig started, killed ones too, without the per-batch lines.
    fn logs(&self) -> String {
        (0..self.started)
            .map(|n| {
                let log = std::fs::read_to_string(self.s.dir.path().join(format!("relay-{n}.log")))
                    .unwrap_or_default();
                let kept: Vec<&str> = log
                    .lines()
                    .filter(|l| !l.contains("batch committed") && !l.contains("effective configuration"))
                    .collect();
                format!("relay-{n}:\n{}", kept.join("\n"))
            })
            .collect::<Vec<_>>()
            .join("\n---\n")
    }
}

/// Writers committing (about 4 in 5) and rolling back transactions until `stop`, reconnecting
/// when the server restarts.
fn start_writers(url: &str, aggregate_type: &str, stop: Arc<AtomicBool>) -> Vec<tokio::task::JoinHandle<()>> {
    (0..3)
        .map(|_| {
            let (url, aggregate_type, stop) = (url.to_string(), aggregate_type.to_string(), stop.clone());
            tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    let Ok((mut client, connection)) =
                        tokio_postgres::connect(&url, tokio_postgres::NoTls).await
                    else {
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    };
                    tokio::spawn(connection);
                    while !stop.load(Ordering::Relaxed) {
                        let aggregate = format!("agg-{}", rand::random_range(0..AGGREGATES));
                        let (events, commit) = (rand::random_range(1..=4), rand::random_range(0..5) > 0);
                        if try_write_txn(&mut client, &aggregate_type, &aggregate, events, commit)
                            .await
                            .is_err()
                        {
                            break;
                        }
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                }
            })
        })
        .collect()
}

/// Records of other producers at the partitions' tails while no relay runs: 1,200 without the
/// relay's headers (more than the first read-back window of each partition), and 100 that
/// claim the ids the outbox will give next, under another source. A relay that took a stranger
/// for its own would skip those rows (polling) or stop looking too early (both modes).
async fn write_strangers(brokers: &str, topic: &str, client: &tokio_postgres::Client) {
    let producer: FutureProducer = ClientConfig::new().set("bootstrap.servers", brokers).create().unwrap();
    let next_id: i64 =
        client.query_one("SELECT coalesce(max(id), 0) + 1 FROM outbox_events", &[]).await.unwrap().get(0);
    for n in 0..1_300i64 {
        let key = format!("stranger-{}", n % 8);
        let id = (next_id + n % 100).to_string();
        let mut record = FutureRecord::to(topic).key(&key).payload("{\"seq\": 0}");
        if n >= 1_200 {
            let position = format!("batch:00000000000000aa-0:{}", n - 1_200);
            record = record.headers(
                OwnedHeaders::new()
                    .insert(Header {
                        key: "outbox_relay_source",
                        value: Some("someone/else/public.outbox_events"),
                    })
                    .insert(Header { key: "outbox_relay_position", value: Some(&position) })
                    .insert(Header { key: "id", value: Some(&id) }),
            );
        }
        producer.send(record, Duration::from_secs(30)).await.map_err(|(e, _)| e).unwrap();
    }
}

/// The relay's records (strangers set aside) until `unique` distinct ids arrived, then
/// [`LINGER`] more for late duplicates.
async fn consume_relay_records(consumer: &rdkafka::consumer::StreamConsumer, unique: usize) -> Vec<Consumed> {
    let mut records = Vec::new();
    let mut ids = std::collections::HashSet::new();
    while ids.len() < unique {
        let batch = consume(consumer, 1, IDLE).await;
        if batch.is_empty() {
            break;
        }
        for r in batch.into_iter().filter(|r| !r.key.as_deref().unwrap_or_default().starts_with("stranger-"))
        {
            ids.insert(r.header("id").unwrap_or_default().to_string());
            records.push(r);
        }
    }
    let late = consume(consumer, usize::MAX, LINGER).await;
    records
        .extend(late.into_iter().filter(|r| !r.key.as_deref().unwrap_or_default().starts_with("stranger-")));
    records
}

/// Runs the whole fault schedule under load; returns what arrived, checked.
async fn run_faults(mode: &str, dedup: bool, transactional: bool) -> DeliveryReport {
    // given two relays, one active, and writers committing and rolling back
    let mut rig = Rig::new(mode, dedup, transactional).await;
    let stop = Arc::new(AtomicBool::new(false));
    let writers = start_writers(&rig.s.db.url, &rig.s.aggregate_type, stop.clone());

    // when the active relay is killed 10 times, PostgreSQL restarted twice, the broker frozen
    // for 20 s, and strangers written to the topic while no relay runs
    for round in 1..=KILLS {
        tokio::time::sleep(Duration::from_millis(rand::random_range(700..1_500))).await;
        rig.kill_active();
        if PG_RESTARTS.contains(&round) {
            rig.restart_postgres();
        }
        if round == FREEZE_AFTER {
            rig.broker.freeze();
            tokio::time::sleep(FROZEN).await;
            rig.broker.thaw();
        }
        if round == STRANGERS_AFTER {
            for relay in &mut rig.relays {
                relay.kill9();
            }
            rig.relays.clear();
            write_strangers(&rig.broker.brokers(), &rig.s.topic, &rig.s.db.client().await).await;
            rig.start_relay();
            rig.start_relay();
        }
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    stop.store(true, Ordering::Relaxed);
    for writer in writers {
        writer.await.unwrap();
    }

    // then every committed event arrives; the relay's records are checked, strangers set aside
    let client = rig.s.db.client().await;
    let committed = committed_counts(&client).await;
    let total: i64 = committed.values().sum();
    // (a consumer made now, reading from the start: one that lived through the freeze was seen
    // to fetch nothing for more than IDLE while the relay's records were acknowledged and the
    // slot confirmed past them)
    let consumer = consumer_on(&rig.broker.brokers(), &[&rig.s.topic]);
    let records = consume_relay_records(&consumer, total as usize).await;
    let arrived: std::collections::HashSet<&str> = records.iter().filter_map(|r| r.header("id")).collect();
    if arrived.len() < total as usize {
        // (what the relays were doing when the records stopped coming: a loss, or a relay that
        // had not caught up within the consumer's IDLE guard)
        let unpublished = match mode {
            "polling" => format!("{} rows still in the outbox", rig.s.outbox_rows().await),
            _ => format!("slot confirmed up to {:?}", slot_confirmed_flush(&client, &rig.s.slot).await),
        };
        let ready: Vec<String> =
            rig.relays.iter().map(|r| r.readyz().map(|(_, body)| body).unwrap_or_default()).collect();
        panic!(
            "{} of {total} committed events arrived; {unpublished}; the relays' /readyz: {ready:?}\nrelay logs:\n{}",
            arrived.len(),
            rig.logs()
        );
    }
    let report = assert_delivered(&records, &committed);
    eprintln!(
        "{mode}, dedup {}{}: {} committed events arrived with {} duplicates after {KILLS} kills (each a standby \
         takeover), 2 PostgreSQL restarts and a {FROZEN:?} broker freeze",
        if dedup { "on" } else { "off" },
        if transactional { ", Kafka transactions (read_committed)" } else { "" },
        report.unique,
        report.duplicates,
    );
    if transactional {
        let uncommitted = isolated_consumer(&rig.broker.brokers(), &rig.s.topic, "read_uncommitted");
        let seen = consume_relay_records(&uncommitted, report.unique).await;
        eprintln!(
            "{mode}: a read_uncommitted consumer sees {} of the relay's records for the same {} events: {} from \
             aborted Kafka transactions",
            seen.len(),
            report.unique,
            seen.len() - records.len()
        );
    }
    assert!(report.unique > 1_000, "the workload committed too little to prove anything: {}", report.unique);
    if dedup {
        assert_eq!(
            report.duplicates,
            0,
            "duplicates with dedup on:\n{}\nrelay logs:\n{}",
            duplicated(&records),
            rig.logs()
        );
    }
    report
}

/// Each id that arrived more than once, with where each copy landed and the position it was
/// sent from (the first 20 ids).
fn duplicated(records: &[Consumed]) -> String {
    let mut copies: HashMap<&str, Vec<String>> = HashMap::new();
    for r in records {
        let at = format!("{}@{} {}", r.partition, r.offset, r.header("outbox_relay_position").unwrap_or("-"));
        copies.entry(r.header("id").unwrap_or_default()).or_default().push(at);
    }
    let mut lines: Vec<String> = copies
        .into_iter()
        .filter(|(_, c)| c.len() > 1)
        .map(|(id, c)| format!("id {id}: {}", c.join(", ")))
        .collect();
    lines.sort();
    lines.truncate(20);
    lines.join("\n")
}

#[tokio::test(flavor = "multi_thread")]
async fn replication_delivers_exactly_once_through_kills_restarts_and_a_frozen_broker() {
    run_faults("replication", true, false).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn replication_with_kafka_transactions_delivers_exactly_once_through_kills_restarts_and_a_frozen_broker()
 {
    run_faults("replication", true, true).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn polling_with_kafka_transactions_delivers_exactly_once_through_kills_restarts_and_a_frozen_broker() {
    run_faults("polling", true, true).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn polling_delivers_exactly_once_through_kills_restarts_and_a_frozen_broker() {
    run_faults("polling", true, false).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn replication_with_dedup_off_delivers_at_least_once_and_counts_duplicates() {
    run_faults("replication", false, false).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn polling_with_dedup_off_delivers_at_least_once_and_counts_duplicates() {
    run_faults("polling", false, false).await;
}

/// A replication setup on the shared services, with the test's aggregates.
async fn replication_setup() -> (Setup, tokio_postgres::Client) {
    let s = Setup::create(&services().kafka, "", true, RelayToml::replication).await;
    let client = s.db.client().await;
    create_aggregates(&client, AGGREGATES).await;
    (s, client)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_recreated_slot_publishes_only_what_the_topic_does_not_hold() {
    // given a relay that published 2,000 events and was killed, and 50 more written since
    let (s, _) = replication_setup().await;
    let consumer = consumer(&[&s.topic]);
    let mut relay = s.start("relay");
    relay.wait_ready("active").await;
    write_concurrently(&s.db.url, &s.aggregate_type, AGGREGATES, 2_000, 2).await;
    let mut records = consume_relay_records(&consumer, 2_000).await;
    relay.kill9();
    let committed = write_concurrently(&s.db.url, &s.aggregate_type, AGGREGATES, 50, 1).await;

    // when the slot is recreated, its first copy going over the whole table
    let config = s.config().display().to_string();
    let (code, stdout, stderr) = run_relay(&["setup", "--recreate-slot", "--config", &config], EXIT_LIMIT);
    assert_eq!(code, 0, "{stdout}{stderr}");

    // then only the 50 the topic lacked arrive, in order, and nothing twice
    records.extend(consume_relay_records(&consumer, 50).await);
    let report = assert_delivered(&records, &committed);
    assert_eq!((report.unique, report.duplicates), (2_050, 0), "{stderr}");
    assert!(stderr.contains("already_written=2000"), "{stderr}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_deleted_topic_is_said_so_and_everything_still_owed_is_sent() {
    // given a relay that published 100 events and was killed
    let (s, client) = replication_setup().await;
    let old = consumer(&[&s.topic]);
    let mut relay = s.start("first");
    relay.wait_ready("active").await;
    write_concurrently(&s.db.url, &s.aggregate_type, AGGREGATES, 100, 1).await;
    assert_eq!(consume_relay_records(&old, 100).await.len(), 100, "{}", relay.log_text());
    relay.kill9();
    drop(old);

    // when its topic is deleted and 100 more events are written
    delete_topic(&services().kafka, &s.topic).await;
    write_concurrently(&s.db.url, &s.aggregate_type, AGGREGATES, 100, 1).await;
    let owed: std::collections::HashSet<String> = client
        .query("SELECT e.id::text FROM outbox_events e ORDER BY e.id DESC LIMIT 100", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let relay = s.start("second");

    // then the relay says it had nothing to compare with, and the new topic holds every event
    // owed, each once
    relay.wait_metric("outbox_relay_dedup_scans_total{result=\"topic_missing\"}", |v| v == 1.0).await;
    relay.wait_metric("outbox_relay_events_published_total{mode=\"replication\"}", |v| v >= 100.0).await;
    let new = consumer(&[&s.topic]);
    let mut ids = std::collections::HashSet::new();
    while !owed.is_subset(&ids) {
        let records = consume(&new, 1, IDLE).await;
        assert!(
            !records.is_empty(),
            "{} of the events written after the deletion are missing: {}",
            owed.difference(&ids).count(),
            relay.log_text()
        );
        for r in records {
            assert!(ids.insert(r.header("id").unwrap().to_string()), "{r:?} arrived twice");
        }
    }
    for r in consume(&new, usize::MAX, LINGER).await {
        assert!(ids.insert(r.header("id").unwrap().to_string()), "{r:?} arrived twice");
    }
    assert!(relay.log_text().contains("the topic does not exist"), "{}", relay.log_text());
}

/// Deletes `topic` and waits until the broker no longer lists it.
async fn delete_topic(brokers: &str, topic: &str) {
    use rdkafka::admin::{AdminClient, AdminOptions};
    use rdkafka::client::DefaultClientContext;
    let admin: AdminClient<DefaultClientContext> =
        ClientConfig::new().set("bootstrap.servers", brokers).create().unwrap();
    for result in admin.delete_topics(&[topic], &AdminOptions::new()).await.unwrap() {
        result.unwrap_or_else(|(t, e)| panic!("delete topic {t}: {e}"));
    }
    wait_until(format!("topic {topic} to be gone"), async || {
        let metadata = admin.inner().fetch_metadata(None, Duration::from_secs(5)).unwrap();
        !metadata.topics().iter().any(|t| t.name() == topic)
    })
    .await;
}

/// A polling batch published and never committed: the relay is killed while the claim's DELETE
/// waits on a trigger, so the batch is in Kafka and its rows are still in the outbox. Returns
/// the report of what arrived after a new relay took the rows over.
async fn a_batch_published_but_never_committed(dedup: bool) -> DeliveryReport {
    // given a polling relay whose claim hangs in its DELETE, after Kafka acknowledged the batch
    let (s, client) = hanging_deletes(dedup).await;
    let committed = write_concurrently(&s.db.url, &s.aggregate_type, AGGREGATES, 100, 1).await;
    let consumer = consumer(&[&s.topic]);
    let mut relay = s.start("first");
    let mut records = consume_relay_records(&consumer, 100).await;
    assert_eq!(records.len(), 100, "{}", relay.log_text());

    // when the relay is killed before its claim commits, and another one takes the rows over
    kill_mid_claim(&client, &mut relay).await;
    client.batch_execute("DROP TRIGGER hang ON outbox_events").await.unwrap();
    let relay = s.start("second");
    wait_until("the outbox to empty", async || s.outbox_rows().await == 0).await;

    // then the batch is in Kafka once (with dedup) and in order, and nothing is left
    records.extend(consume(&consumer, usize::MAX, LINGER).await);
    let report = assert_delivered(&records, &committed);
    eprintln!("a polling batch published, never committed, dedup {dedup}: {} duplicates", report.duplicates);
    assert_eq!(report.unique, 100, "{}", relay.log_text());
    report
}

/// A polling setup (batches of 100) whose claims hang in the DELETE that releases their rows,
/// after Kafka acknowledged the batch; drop the trigger `hang` to let them through.
async fn hanging_deletes(dedup: bool) -> (Setup, tokio_postgres::Client) {
    let s = Setup::create(&services().kafka, "", true, |_| {
        RelayToml::mode("polling").set("polling", "batch_size", 100).set("dedup", "enabled", dedup)
    })
    .await;
    let client = s.db.client().await;
    create_aggregates(&client, AGGREGATES).await;
    client
        .batch_execute(
            "CREATE FUNCTION hang() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN PERFORM pg_sleep(600); RETURN NULL; END $$;
             CREATE TRIGGER hang BEFORE DELETE ON outbox_events FOR EACH STATEMENT EXECUTE FUNCTION hang();",
        )
        .await
        .unwrap();
    (s, client)
}

/// Waits until a relay's claim hangs in the DELETE that releases its rows (the `hang` trigger).
async fn wait_hanging_in_delete(client: &tokio_postgres::Client) {
    wait_until("a relay's DELETE to hang on the trigger", async || {
        let row = client
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'outbox-relay' \
                 AND datname = current_database() AND state = 'active' AND query LIKE 'DELETE%'",
                &[],
            )
            .await
            .unwrap();
        row.get::<_, i64>(0) > 0
    })
    .await;
}

/// Kills `relay`, ends its sessions, and so rolls its claim back.
async fn kill_mid_claim(client: &tokio_postgres::Client, relay: &mut RelayProcess) {
    relay.kill9();
    client
        .batch_execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = 'outbox-relay' \
             AND datname = current_database()",
        )
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn polling_does_not_send_again_a_batch_left_behind_by_two_claims_that_never_committed() {
    // given a relay killed after Kafka acknowledged its batch of 60, while the DELETE hangs
    let (s, client) = hanging_deletes(true).await;
    write_concurrently(&s.db.url, &s.aggregate_type, AGGREGATES, 60, 1).await;
    let consumer = consumer(&[&s.topic]);
    let mut first = s.start("first");
    wait_hanging_in_delete(&client).await;
    kill_mid_claim(&client, &mut first).await;

    // when 30 more rows come, and a second relay, whose claim takes all 90 rows, is killed the
    // same way (the 60 already in Kafka are not sent again; the 30 must not go out in a batch
    // that releases the 60, or a third relay reading back the newest batch misses theirs)
    let committed = write_concurrently(&s.db.url, &s.aggregate_type, AGGREGATES, 30, 1).await;
    let mut second = s.start("second");
    wait_hanging_in_delete(&client).await;
    kill_mid_claim(&client, &mut second).await;
    client.batch_execute("DROP TRIGGER hang ON outbox_events").await.unwrap();
    let third = s.start("third");
    wait_until("the outbox to empty", async || s.outbox_rows().await == 0).await;

    // then the 90 events arrived once each, in order
    let records = consume_relay_records(&consumer, 90).await;
    let report = assert_delivered(&records, &committed);
    assert_eq!((report.unique, report.duplicates), (90, 0), "{}\n{}", duplicated(&records), third.log_text());
}

#[tokio::test(flavor = "multi_thread")]
async fn polling_does_not_send_again_a_batch_that_never_committed() {
    assert_eq!(a_batch_published_but_never_committed(true).await.duplicates, 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn polling_with_dedup_off_sends_a_batch_that_never_committed_again() {
    assert_eq!(a_batch_published_but_never_committed(false).await.duplicates, 100);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_read_back_out_of_time_while_reading_falls_back_to_at_least_once_and_says_so() {
    // given a topic holding a million records of other producers, more than a read-back gets
    // through in dedup.scan_timeout_ms = 1000, and 20 events waiting
    let broker = OwnBroker::start();
    let s = Setup::create(&broker.brokers(), "", true, |slot| {
        RelayToml::replication(slot).set("dedup", "scan_timeout_ms", 1_000)
    })
    .await;
    create_topic_on(&broker.brokers(), &s.topic, 2).await;
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", broker.brokers())
        .set("linger.ms", "50")
        .set("compression.type", "none")
        .create()
        .unwrap();
    let (junk, topic) = ("x".repeat(100), &s.topic);
    let sends = (0..1_000_000).map(|n| {
        let key = format!("junk-{}", n % 16);
        let (producer, junk) = (&producer, &junk);
        async move {
            let record = FutureRecord::to(topic).key(&key).payload(junk);
            producer.send(record, Duration::from_secs(60)).await.map_err(|(e, _)| e).unwrap();
        }
    });
    futures::stream::iter(sends).buffer_unordered(10_000).collect::<Vec<()>>().await;
    let client = s.db.client().await;
    create_aggregates(&client, 4).await;
    write_concurrently(&s.db.url, &s.aggregate_type, 4, 20, 1).await;

    // when the relay starts and reads the topic back before it publishes
    let mut relay = s.start("relay");

    // then it stops reading at the timeout, says so, and Kafka acknowledges every event (it
    // failed the session, and every next one, before)
    let published = "outbox_relay_events_published_total{mode=\"replication\"}";
    wait_until(relay.context("20 events acknowledged".into()), async || {
        relay.metric(published).is_some_and(|n| n >= 20.0)
    })
    .await;
    let timeouts = relay.metric("outbox_relay_dedup_scans_total{result=\"timeout\"}");
    assert!(timeouts.is_some_and(|n| n >= 1.0), "{}", relay.log_text());
    assert!(relay.log_text().contains("stopped reading the topic back at dedup.scan_timeout_ms"));
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0));
}
