//! Broker faults on Apache Kafka, each on a broker or cluster of the test's own: a broker killed
//! with SIGKILL and restarted on its log directory, the leader of the relay's partitions killed
//! (with `kafka.transactional`: the broker that is both a partition leader and the transaction
//! coordinator of the relay's transactional.id, mid-transaction), two of three brokers stopped
//! (acks=all refused with NotEnoughReplicas), partitions added while the relay runs, records
//! deleted from a partition's start before a read-back. Each asserts no loss, no phantom (no
//! event of a rolled-back PostgreSQL transaction) and per-key order on what arrived, and counts
//! duplicates; with Kafka transactions a `read_committed` consumer must see no duplicate.

use crate::common;
use crate::transactions::isolated_consumer;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::broker::OwnBroker;
use common::process::RelayProcess;
use common::workload::*;
use common::*;
use rdkafka::admin::{AdminClient, AdminOptions, NewPartitions};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer, StreamConsumer};
use rdkafka::{ClientConfig, TopicPartitionList};

const AGGREGATES: usize = 20;

/// A replication relay on a broker (or cluster) of the test's own, with a topic of
/// `partitions` and `AGGREGATES` aggregates to write to.
async fn relay_on(broker: &OwnBroker, partitions: i32) -> (Setup, RelayProcess) {
    relay_on_brokers(&broker.brokers(), partitions).await
}

/// As [`relay_on`], on the brokers `brokers`.
async fn relay_on_brokers(brokers: &str, partitions: i32) -> (Setup, RelayProcess) {
    start_relay(brokers, partitions, "replication", "").await
}

/// A relay in `mode` on the brokers `brokers`, with `kafka` lines added to its `[kafka]`
/// section, a topic of `partitions` and `AGGREGATES` aggregates to write to; quick retries.
async fn start_relay(brokers: &str, partitions: i32, mode: &str, kafka: &str) -> (Setup, RelayProcess) {
    let kafka = format!("{kafka}\n{QUICK_KAFKA_SETTINGS}");
    let s = Setup::create(brokers, &kafka, false, |slot| {
        RelayToml::either(mode, slot).set("retry", "initial_backoff_ms", 100).set(
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

/// What the background writers left in the outbox.
struct Written {
    /// Events committed, per aggregate.
    committed: HashMap<String, i64>,
    /// The ids of the events whose PostgreSQL transactions rolled back: no consumer may see one.
    rolled_back: HashSet<String>,
}

/// Writes `total` events in the background, in transactions of 1-5 over the aggregates, and
/// beside them transactions of the same shape that roll back, until the last commit.
fn write_in_background(s: &Setup, total: usize) -> tokio::task::JoinHandle<Written> {
    let url = s.db.url.clone();
    let aggregate_type = s.aggregate_type.clone();
    tokio::spawn(async move {
        let done = Arc::new(AtomicBool::new(false));
        let rolling_back = tokio::spawn(roll_back_until(url.clone(), aggregate_type.clone(), done.clone()));
        let committed = write_concurrently(&url, &aggregate_type, AGGREGATES, total, 2).await;
        done.store(true, Ordering::SeqCst);
        Written { committed, rolled_back: rolling_back.await.unwrap() }
    })
}

/// Writes transactions of 1-3 events and rolls each back, until `done`; returns the ids their
/// rows had (a sequence value is not rolled back, so no committed row ever takes one).
async fn roll_back_until(url: String, aggregate_type: String, done: Arc<AtomicBool>) -> HashSet<String> {
    let mut client = connect(&url).await;
    let mut ids = HashSet::new();
    while !done.load(Ordering::SeqCst) {
        let aggregate = format!("agg-{}", rand::random_range(0..AGGREGATES));
        let tx = client.transaction().await.unwrap();
        for _ in 0..rand::random_range(1..=3) {
            let row = tx
                .query_one(
                    "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload) \
                     VALUES ($1, $2, 'SeqEvent', '{\"seq\": -1}') RETURNING id",
                    &[&aggregate_type, &aggregate],
                )
                .await
                .unwrap();
            ids.insert(row.get::<_, i64>(0).to_string());
        }
        tx.rollback().await.unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    ids
}

/// Asserts that no record of `records` is an event of a rolled-back PostgreSQL transaction.
fn assert_none_rolled_back(records: &[Consumed], rolled_back: &HashSet<String>) {
    assert!(!rolled_back.is_empty(), "the workload must roll transactions back");
    let phantoms: Vec<&str> =
        records.iter().filter_map(|r| r.header("id")).filter(|id| rolled_back.contains(*id)).collect();
    assert!(phantoms.is_empty(), "events of rolled-back transactions arrived: {phantoms:?}");
}

/// The `events_published_total` series of `mode`.
fn published(mode: &str) -> String {
    format!("outbox_relay_events_published_total{{mode=\"{mode}\"}}")
}

/// Waits until Kafka acknowledged (with `kafka.transactional`: committed) at least `n` events
/// of the relay's in `mode`.
async fn wait_acknowledged(relay: &RelayProcess, mode: &str, n: f64) {
    relay.wait_metric(&published(mode), |v| v >= n).await;
}

/// Consumes every committed event (and late duplicates) with librdkafka's default isolation
/// (`read_committed`), asserts no loss, no phantom and per-key order, and prints the
/// duplicates. Returns the records.
async fn assert_all_arrived(
    brokers: &str,
    s: &Setup,
    committed: &HashMap<String, i64>,
    relay: &RelayProcess,
) -> Vec<Consumed> {
    let total: i64 = committed.values().sum();
    let consumer = consumer_on(brokers, &[&s.topic]);
    let records = consume_while_relaying(&consumer, total as usize, relay).await;
    let ids = unique_ids(&records);
    assert_eq!(ids.len() as i64, total, "{} of {total} events arrived: {}", ids.len(), relay.log_text());
    let report = assert_delivered(&records, committed);
    eprintln!("{} events arrived once each, {} duplicates", report.unique, report.duplicates);
    records
}

/// The relay's (events read, events acknowledged) counters, all series summed; None once it
/// does not answer.
fn relay_progress(relay: &RelayProcess) -> Option<(f64, f64)> {
    let (_, body) = crate::common::http::get(relay.metrics_port(), "/metrics")?;
    let total = |counter: &str| -> f64 {
        body.lines()
            .filter(|l| l.starts_with(&format!("{counter}{{")) || l.starts_with(&format!("{counter} ")))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    Some((total("outbox_relay_events_read_total"), total("outbox_relay_events_published_total")))
}

/// As `consume_unique`: the records of `unique` distinct events, then whatever comes within
/// LINGER. But a quiet [`IDLE`] ends the read only when the relay made no progress in it either
/// (nothing read, nothing acknowledged): after a broker is killed, finding a new leader or
/// transaction coordinator took longer than IDLE on a loaded machine, and the relay delivered
/// every event after it. The tests assert that it does, not how soon.
async fn consume_while_relaying(
    consumer: &StreamConsumer,
    unique: usize,
    relay: &RelayProcess,
) -> Vec<Consumed> {
    let mut records = Vec::new();
    let mut ids = HashSet::new();
    let mut progress = relay_progress(relay);
    while ids.len() < unique {
        let batch = consume(consumer, 1, IDLE).await;
        if batch.is_empty() {
            let now = relay_progress(relay);
            if now.is_none() || now == progress {
                break;
            }
            progress = now;
        }
        for record in batch {
            ids.insert(record.header("id").unwrap_or_default().to_string());
            records.push(record);
        }
    }
    records.extend(consume(consumer, usize::MAX, LINGER).await);
    records
}

/// Partition -> the broker id leading it, for every partition of `topic`.
fn leaders(brokers: &str, topic: &str) -> HashMap<i32, i32> {
    let consumer: BaseConsumer = ClientConfig::new().set("bootstrap.servers", brokers).create().unwrap();
    let metadata = consumer.fetch_metadata(Some(topic), Duration::from_secs(10)).unwrap();
    metadata.topics()[0].partitions().iter().map(|p| (p.id(), p.leader())).collect()
}

/// The broker id leading `partition` of `topic`.
fn leader_of(brokers: &str, topic: &str, partition: i32) -> i32 {
    leaders(brokers, topic)[&partition]
}

/// The transaction coordinator of `transactional_id`: the leader of its partition of
/// `__transaction_state`, which Kafka picks as `abs(id.hashCode()) % partitions`
/// (`TransactionStateManager.partitionFor`), Java's `String.hashCode` over UTF-16 units.
fn coordinator_of(brokers: &str, transactional_id: &str) -> i32 {
    let hash =
        transactional_id.encode_utf16().fold(0i32, |h, unit| h.wrapping_mul(31).wrapping_add(unit.into()));
    let state = leaders(brokers, "__transaction_state");
    // Kafka's Utils.abs: Integer.MIN_VALUE maps to 0
    let partition = if hash == i32::MIN { 0 } else { hash.abs() } % state.len() as i32;
    state[&partition]
}

/// What [`kill_under_load`] leaves: the cluster with `broker` down, the relay, what was written.
struct Killed {
    cluster: OwnBroker,
    s: Setup,
    relay: RelayProcess,
    written: Written,
    broker: i32,
}

/// A relay in `mode` (`kafka` lines added) on a three-broker cluster of its own (replication
/// factor 3, min.insync.replicas 2), under steady writes, some rolled back; once Kafka took 300
/// events, the broker `victim(brokers, setup)` names is killed with SIGKILL while writes go on.
/// Returns once the writers are done, the killed broker still down.
async fn kill_under_load(mode: &str, kafka: &str, victim: impl FnOnce(&str, &Setup) -> i32) -> Killed {
    let cluster = OwnBroker::cluster();
    let (s, relay) = start_relay(&cluster.brokers(), 4, mode, kafka).await;
    let writer = write_in_background(&s, 3_000);
    wait_acknowledged(&relay, mode, 300.0).await;
    let broker = victim(&cluster.brokers(), &s);
    let in_flight = relay.metric("outbox_relay_events_in_flight").unwrap_or_default();
    let published = relay.metric(&published(mode)).unwrap_or_default();
    cluster.kill9(broker);
    eprintln!(
        "killed broker {broker} with {published} events published, {in_flight} sent and unacknowledged"
    );
    let written = writer.await.unwrap();
    Killed { cluster, s, relay, written, broker }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_broker_killed_under_load_and_restarted_on_its_log_loses_nothing() {
    // given a relay publishing to a single broker of its own, under a steady load
    let broker = OwnBroker::start();
    let (s, relay) = relay_on(&broker, 4).await;
    let writer = write_in_background(&s, 3_000);
    wait_acknowledged(&relay, "replication", 300.0).await;

    // when the broker is killed with SIGKILL mid-load and started again on its log directory
    broker.kill9(1);
    tokio::time::sleep(Duration::from_secs(2)).await;
    broker.restart(1);
    let written = writer.await.unwrap();

    // then every committed event is there, once acknowledged with acks=all, in order per key
    let records = assert_all_arrived(&broker.brokers(), &s, &written.committed, &relay).await;
    assert_none_rolled_back(&records, &written.rolled_back);
    let mut relay = relay;
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0), "{}", relay.log_text());
}

#[tokio::test(flavor = "multi_thread")]
async fn the_leader_of_the_relays_partitions_killed_under_load_loses_nothing() {
    // given a relay on three brokers (replication factor 3, min.insync.replicas 2), under load;
    // when the broker leading partition 0 is killed with SIGKILL
    let Killed { cluster, s, relay, written, broker } =
        kill_under_load("replication", "", |brokers, s| leader_of(brokers, &s.topic, 0)).await;

    // then the others take over its partitions and every committed event arrives, in order
    let records = assert_all_arrived(&cluster.brokers(), &s, &written.committed, &relay).await;
    assert_none_rolled_back(&records, &written.rolled_back);
    // and the killed broker rejoins
    cluster.restart(broker);
    let mut relay = relay;
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0), "{}", relay.log_text());
}

/// Which broker a transactional run kills.
#[derive(Clone, Copy, Debug)]
enum Victim {
    /// The transaction coordinator of the relay's transactional.id, which must also lead one of
    /// the relay's partitions: the open transaction loses both at once.
    Coordinator,
    /// A leader of the relay's partitions that is not the coordinator.
    LeaderOnly,
}

/// The broker `victim` names, for the relay's `topic` and `transactional_id`; it must lead at
/// least one of the topic's partitions.
fn pick(victim: Victim, brokers: &str, topic: &str, transactional_id: &str) -> i32 {
    let coordinator = coordinator_of(brokers, transactional_id);
    let leaders = leaders(brokers, topic);
    let broker = match victim {
        Victim::Coordinator => coordinator,
        Victim::LeaderOnly => {
            leaders.values().copied().filter(|l| *l != coordinator).min().unwrap_or(coordinator)
        }
    };
    let mut led: Vec<i32> = leaders.iter().filter(|(_, l)| **l == broker).map(|(p, _)| *p).collect();
    led.sort();
    assert!(!led.is_empty(), "broker {broker} ({victim:?}) leads none of {topic}'s partitions: {leaders:?}");
    assert_eq!(broker == coordinator, matches!(victim, Victim::Coordinator), "{victim:?}: {leaders:?}");
    eprintln!(
        "killing broker {broker}: {victim:?} (coordinator of {transactional_id}: {coordinator}), leading {led:?}"
    );
    broker
}

/// The leader-kill run of a relay with `kafka.transactional` (`kafka` lines added) in `mode`:
/// the broker `victim` names is killed mid-load. Asserts what a `read_committed` consumer sees
/// and prints what a `read_uncommitted` one sees; returns the run, its relay still running, and
/// how many records of aborted Kafka transactions the log holds.
async fn killed_mid_transaction(mode: &str, victim: Victim, kafka: &str) -> (Killed, usize) {
    // given a relay writing in Kafka transactions on three brokers, under load (some PostgreSQL
    // transactions rolled back); when the victim is killed with SIGKILL while records are in
    // flight
    let id = format!("relay-{}", random_suffix());
    let kafka = format!("transactional = true\ntransactional_id = \"{id}\"\n{kafka}");
    let killed = kill_under_load(mode, &kafka, |brokers, s| pick(victim, brokers, &s.topic, &id)).await;
    let Killed { cluster, s, relay, written, .. } = &killed;
    let (brokers, total) = (cluster.brokers(), written.committed.values().sum::<i64>() as usize);

    // then a read_committed consumer sees every committed event exactly once, in order per
    // key, and nothing of the rolled-back transactions
    let read = async |isolation| {
        consume_while_relaying(&isolated_consumer(&brokers, &s.topic, isolation), total, relay).await
    };
    let committed = read("read_committed").await;
    assert_eq!(unique_ids(&committed).len(), total, "events lost: {}", relay.log_text());
    let report = assert_delivered(&committed, &written.committed);
    assert_eq!(report.duplicates, 0, "duplicates in read_committed: {}", relay.log_text());
    assert_none_rolled_back(&committed, &written.rolled_back);
    // and a read_uncommitted consumer sees them all too, with the records of aborted Kafka
    // transactions besides (counted, not asserted: what an abort leaves in the log is timing)
    let uncommitted = read("read_uncommitted").await;
    assert_eq!(unique_ids(&uncommitted).len(), total, "read_uncommitted lost events");
    assert_none_rolled_back(&uncommitted, &written.rolled_back);
    let copies = uncommitted.len() - total;
    eprintln!(
        "{mode}, {victim:?} killed: {total} events committed; read_committed: {} records, {} duplicates; \
         read_uncommitted: {} records, {copies} of them copies (records of aborted Kafka transactions)",
        committed.len(),
        report.duplicates,
        uncommitted.len(),
    );
    (killed, copies)
}

/// Once the killed broker rejoins, the relay stops cleanly.
fn restart_and_stop(killed: Killed) {
    let Killed { cluster, mut relay, broker, .. } = killed;
    cluster.restart(broker);
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0), "{}", relay.log_text());
}

#[tokio::test(flavor = "multi_thread")]
async fn replication_transactions_with_their_coordinator_killed_show_read_committed_each_event_once() {
    restart_and_stop(killed_mid_transaction("replication", Victim::Coordinator, "").await.0);
}

#[tokio::test(flavor = "multi_thread")]
async fn polling_transactions_with_their_coordinator_killed_show_read_committed_each_event_once() {
    restart_and_stop(killed_mid_transaction("polling", Victim::Coordinator, "").await.0);
}

/// The sum of every series of `counter`.
fn counter_total(relay: &RelayProcess, counter: &str) -> f64 {
    let series = relay.scrape();
    let samples = series
        .lines()
        .filter(|l| l.starts_with(&format!("{counter}{{")) || l.starts_with(&format!("{counter} ")));
    samples.filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok()).sum()
}

#[tokio::test(flavor = "multi_thread")]
async fn replication_transactions_aborted_by_a_leader_kill_show_read_committed_each_event_once() {
    // (records time out after 3 s, while every write waits for about 6 s for the dead broker to
    // leave the in-sync replicas: the open transaction cannot commit, the relay's next session
    // aborts it (its fresh producer's init_transactions does) and sends its events again)
    let kafka = "transaction_timeout_ms = 3000\ntransaction_max_ms = 1000";
    let (killed, copies) = killed_mid_transaction("replication", Victim::LeaderOnly, kafka).await;
    // and the kill did fail a transaction: records of it were not acknowledged
    let errors = counter_total(&killed.relay, "outbox_relay_publish_errors_total");
    eprintln!("{errors} publish errors; {copies} aborted copies in the log");
    assert!(errors > 0.0, "no record failed: the kill aborted nothing: {}", killed.relay.log_text());
    restart_and_stop(killed);
}

#[tokio::test(flavor = "multi_thread")]
async fn two_of_three_brokers_stopped_hold_the_relay_without_dead_letters_until_they_return() {
    // given a relay on three brokers (min.insync.replicas 2) that has published
    let cluster = OwnBroker::cluster();
    let (s, relay) = relay_on(&cluster, 2).await;
    let client = s.db.client().await;
    let mut writer = connect(&s.db.url).await;
    write_events(&mut writer, &s.aggregate_type, "agg-0", 3, true).await;
    wait_acknowledged(&relay, "replication", 3.0).await;

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
    wait_acknowledged(&relay, "replication", 300.0).await;

    // when the topic grows to 4 partitions, and the relay is killed and started again (a new
    // producer learns the new count at once; a running one at its next metadata refresh)
    let grown =
        admin(&brokers).create_partitions([&NewPartitions::new(&s.topic, 4)], &AdminOptions::new()).await;
    grown.unwrap()[0].as_ref().unwrap();
    relay.kill9();
    let relay = s.start("relay-after");
    let Written { committed, rolled_back } = writer.await.unwrap();

    // then every committed event arrives exactly once (the restarted relay read back all four
    // partitions), each key's events in order, those of a key that moved all on its old
    // partition before all on its new one
    let total: i64 = committed.values().sum();
    let consumer = consumer_on(&brokers, &[&s.topic]);
    let records = consume_unique(&consumer, total as usize, IDLE, LINGER).await;
    let moved = assert_order_across_a_move(&records, &committed);
    assert_none_rolled_back(&records, &rolled_back);
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
