//! Surviving a primary failover. Each test has a primary and a physical standby of its own
//! (`deploy/local/services hold-pair`: a streaming standby with hot_standby_feedback and, from
//! 17, slot synchronization, the primary holding logical decoding back with
//! synchronized_standby_slots). The primary is stopped hard (immediate) under a committing
//! workload and the standby promoted; the relay is given both servers in `postgres.host`.

use crate::common;

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use common::workload::{assert_delivered, committed_counts, create_aggregates, try_write_txn, write_txn};
use common::*;
use rdkafka::consumer::StreamConsumer;

/// A primary and its standby, for one test.
struct Pair {
    env: HashMap<String, String>,
}

impl Pair {
    fn start() -> Pair {
        Pair { env: hold("hold-pair", &[]) }
    }

    fn var(&self, name: &str) -> &str {
        self.env.get(name).unwrap_or_else(|| panic!("services hold-pair did not print {name}"))
    }

    fn primary_url(&self) -> &str {
        self.var("OUTBOX_RELAY_TEST_PG_URL")
    }

    /// `url` (a database on the primary) on the standby.
    fn on_standby(&self, url: &str) -> String {
        url.replace(
            &format!(":{}/", self.var("OUTBOX_RELAY_TEST_PG_PORT")),
            &format!(":{}/", self.var("OUTBOX_RELAY_TEST_STANDBY_PORT")),
        )
    }

    /// `postgres.host` naming both servers, the standby first: the relay must pass over it to
    /// the server that accepts writes.
    fn hosts(&self) -> String {
        format!(
            "127.0.0.1:{},127.0.0.1:{}",
            self.var("OUTBOX_RELAY_TEST_STANDBY_PORT"),
            self.var("OUTBOX_RELAY_TEST_PG_PORT")
        )
    }

    fn pg_ctl(&self, args: &[&str]) {
        pg_ctl(self.var("OUTBOX_RELAY_TEST_PG_BIN"), args);
    }

    fn stop_primary_hard(&self) {
        self.pg_ctl(&["-D", self.var("OUTBOX_RELAY_TEST_PG_DATA"), "-m", "immediate", "-w", "stop"]);
    }

    fn promote(&self) {
        self.pg_ctl(&["-D", self.var("OUTBOX_RELAY_TEST_STANDBY_DATA"), "-w", "-t", "60", "promote"]);
    }

    /// Commits a workload on `s`'s database for 3 s, stops the primary hard under it, promotes
    /// the standby and writes 5 events of aggregate `agg-after` there. Returns the new primary,
    /// when the old one died, and how many events it had acknowledged.
    async fn fail_over_under_load(&self, s: &Setup) -> (tokio_postgres::Client, Instant, usize) {
        let writer = tokio::spawn(write_until_the_server_dies(s.db.url.clone(), s.aggregate_type.clone()));
        tokio::time::sleep(Duration::from_secs(3)).await;
        let died = Instant::now();
        self.stop_primary_hard();
        let acknowledged = writer.await.unwrap();
        self.promote();
        let mut new_primary = connect(&self.on_standby(&s.db.url)).await;
        new_primary.batch_execute("INSERT INTO test_aggregates (id) VALUES ('agg-after')").await.unwrap();
        for _ in 0..5 {
            write_txn(&mut new_primary, &s.aggregate_type, "agg-after", 1, true).await;
        }
        (new_primary, died, acknowledged)
    }
}

/// What reached Kafka after a failover, against the new primary's outbox.
struct Arrivals {
    /// The ids in the new primary's outbox: its history.
    expected: HashSet<String>,
    records: Vec<Consumed>,
    seen: HashSet<String>,
    /// From the old primary's death to the first `agg-after` record.
    first_from_new_primary: Duration,
}

impl Arrivals {
    /// Consumes until every id of `new_primary`'s outbox has arrived, and asserts none is lost.
    async fn collect(
        consumer: &StreamConsumer,
        new_primary: &tokio_postgres::Client,
        died: Instant,
        relay: &process::RelayProcess,
    ) -> Arrivals {
        let expected = outbox_ids(new_primary).await;
        let (records, first) = consume_until_all(consumer, &expected, "agg-after", died).await;
        let seen: HashSet<String> = records.iter().map(|r| r.header("id").unwrap().to_string()).collect();
        let lost = expected.difference(&seen).count();
        assert_eq!(lost, 0, "events of the new primary never arrived: {}", relay.log_text());
        Arrivals {
            expected,
            records,
            seen,
            first_from_new_primary: first.expect("the first event from the new primary"),
        }
    }

    /// Ids that arrived and that the new primary does not have.
    fn phantoms(&self) -> usize {
        self.seen.difference(&self.expected).count()
    }
}

/// A streaming relay on a fresh database of `pair`'s primary; `failover` sets
/// `replication.failover`.
async fn setup(pair: &Pair, failover: bool) -> Setup {
    let db = TestDb::create_at(pair.primary_url(), "", true).await;
    create_aggregates(&db.client().await, 8).await;
    Setup::create_on(db, &services().kafka, "", true, |slot| {
        RelayToml::replication(slot)
            .set("replication", "failover", failover)
            .set("retry", "initial_backoff_ms", 100)
            .set("retry", "max_backoff_ms", 500)
    })
    .await
}

/// Commits transactions of 1-3 events on random aggregates until the server dies.
async fn write_until_the_server_dies(url: String, aggregate_type: String) -> usize {
    let mut client = connect(&url).await;
    let mut committed = 0;
    loop {
        let aggregate = format!("agg-{}", rand::random_range(0..8));
        match try_write_txn(&mut client, &aggregate_type, &aggregate, rand::random_range(1..=3), true).await {
            Ok(seqs) => committed += seqs.len(),
            Err(_) => return committed,
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Waits until the standby has replayed everything the primary has written.
async fn wait_standby_caught_up(primary: &tokio_postgres::Client, standby: &tokio_postgres::Client) {
    let lsn: String = primary.query_one("SELECT pg_current_wal_lsn()::text", &[]).await.unwrap().get(0);
    wait_until_within(Duration::from_secs(60), "the standby to replay the primary's WAL", async || {
        let row =
            standby.query_one("SELECT pg_last_wal_replay_lsn() >= $1::text::pg_lsn", &[&lsn]).await.unwrap();
        row.get::<_, Option<bool>>(0) == Some(true)
    })
    .await;
}

async fn outbox_ids(client: &tokio_postgres::Client) -> HashSet<String> {
    client.query("SELECT id::text FROM outbox_events", &[]).await.unwrap().iter().map(|r| r.get(0)).collect()
}

/// Waits until the standby's copy of `slot` is one a promotion keeps. A copy stays temporary
/// until the primary's slot has moved past the standby's catalog horizon, and a promotion drops
/// it; a logged snapshot of running transactions lets the slot move on without waiting for the
/// next checkpoint.
async fn wait_sync_ready(primary: &tokio_postgres::Client, standby: &tokio_postgres::Client, slot: &str) {
    wait_until_within(Duration::from_secs(60), "the standby's copy of the slot to be sync-ready", async || {
        primary.execute("SELECT pg_log_standby_snapshot()", &[]).await.unwrap();
        let row = standby
            .query_opt(
                "SELECT synced AND NOT temporary AND NOT conflicting FROM pg_replication_slots WHERE slot_name = $1",
                &[&slot],
            )
            .await
            .unwrap();
        row.is_some_and(|r| r.get::<_, bool>(0))
    })
    .await;
}

/// The relay reports the standby's ready copy: in its metrics, and in `check`.
async fn assert_relay_sees_the_copy(
    pair: &Pair,
    s: &Setup,
    relay: &process::RelayProcess,
    env: &[(&str, &str)],
) {
    relay.wait_metric("outbox_relay_failover_standbys_ready", |v| v == 1.0).await;
    assert_eq!(relay.metric("outbox_relay_slot_failover"), Some(1.0));
    let config = s.config().display().to_string();
    let (code, out, _) = run_relay_with_env(&["check", "--config", &config], env, Duration::from_secs(60));
    let standby_port = pair.var("OUTBOX_RELAY_TEST_STANDBY_PORT");
    for line in [
        "OK   postgres.synchronized_standby_slots".to_string(),
        format!("127.0.0.1:{standby_port} has a synced copy a promotion keeps"),
    ] {
        assert!(out.contains(&line), "{line}: {out}");
    }
    assert_eq!(code, 0, "{out}");
}

/// Consumes until every id in `expected` has arrived (or two minutes pass); also returns when
/// the first record of `marker` arrived, counted from `since`.
async fn consume_until_all(
    consumer: &StreamConsumer,
    expected: &HashSet<String>,
    marker: &str,
    since: Instant,
) -> (Vec<Consumed>, Option<Duration>) {
    let (mut records, mut marker_at, mut seen) = (Vec::new(), None, HashSet::new());
    let deadline = Instant::now() + Duration::from_secs(120);
    while !expected.is_subset(&seen) && Instant::now() < deadline {
        for r in consume(consumer, 10_000, Duration::from_millis(500)).await {
            if r.key.as_deref() == Some(marker) && marker_at.is_none() {
                marker_at = Some(since.elapsed());
            }
            seen.insert(r.header("id").unwrap().to_string());
            records.push(r);
        }
    }
    (records, marker_at)
}

#[tokio::test(flavor = "multi_thread")]
async fn after_a_promotion_the_relay_goes_on_from_the_failover_slot_losing_and_inventing_nothing_since_pg17()
{
    // (before 17 there are no failover slots: check_says_what_failover_needs_on_each_version
    // covers what the relay says there)
    require_major(17).await;
    // given a relay streaming from a failover slot, whose copy the standby has synced
    let pair = Pair::start();
    let s = setup(&pair, true).await;
    let consumer = consumer(&[&s.topic]);
    let hosts = pair.hosts();
    let env = [
        ("OUTBOX_RELAY__POSTGRES__HOST", hosts.as_str()),
        ("OUTBOX_RELAY__METRICS__SAMPLE_INTERVAL_SECS", "1"),
    ];
    let mut relay = s.start_with_env("relay", &env);
    relay.wait_ready("active").await;
    let standby = connect(&pair.on_standby(&s.db.url)).await;
    wait_sync_ready(&s.db.client().await, &standby, &s.slot).await;
    drop(standby);
    assert_relay_sees_the_copy(&pair, &s, &relay, &env).await;

    // when the primary is stopped hard under a committing workload, and the standby promoted
    let (new_primary, died, acknowledged) = pair.fail_over_under_load(&s).await;

    // then every event of the new primary's history arrives, and nothing else, in order per
    // aggregate; the first event written on the new primary arrives once the relay found it
    let arrivals = Arrivals::collect(&consumer, &new_primary, died, &relay).await;
    assert_eq!(arrivals.phantoms(), 0, "events arrived that the new primary does not have");
    let records = &arrivals.records;
    let report = assert_delivered(records, &committed_counts(&new_primary).await);
    // and the duplicates are the replay of the copy's unconfirmed tail: old events only, once
    let after = records.iter().filter(|r| r.key.as_deref() == Some("agg-after")).count();
    assert_eq!(after, 5, "an event written after the promotion was published twice");
    let mut copies: HashMap<&str, usize> = HashMap::new();
    for r in records {
        *copies.entry(r.header("id").unwrap()).or_default() += 1;
    }
    assert!(copies.values().all(|n| *n <= 2), "an event was published more than twice");
    assert!(relay.exited().is_none(), "the relay stopped: {}", relay.log_text());
    relay.wait_ready("active").await;
    // and now no standby holds a copy (the old primary is gone): the alert's condition
    relay.wait_metric("outbox_relay_failover_standbys_ready", |v| v == 0.0).await;
    eprintln!(
        "failover: {acknowledged} events acknowledged by the old primary, {} on the new primary's history, \
         {} duplicates; first event from the new primary {:?} after the primary died",
        arrivals.expected.len(),
        report.duplicates,
        arrivals.first_from_new_primary
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_promotion_without_a_failover_slot_stops_the_relay_saying_so() {
    // given a relay streaming from a slot the standby has no copy of
    let pair = Pair::start();
    let s = setup(&pair, false).await;
    let client = s.db.client().await;
    let consumer = consumer(&[&s.topic]);
    let env = [
        ("OUTBOX_RELAY__POSTGRES__HOST", pair.hosts()),
        // (a fatal error is kept on /metrics for a while before the relay exits)
        ("OUTBOX_RELAY__METRICS__FATAL_EXIT_DELAY_SECS", "60".to_string()),
        ("OUTBOX_RELAY__METRICS__SAMPLE_INTERVAL_SECS", "1".to_string()),
    ];
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let mut relay = s.start_with_env("relay", &env);
    relay.wait_ready("active").await;
    workload::insert_event(&client, &s.aggregate_type, Some("before")).await;
    assert_eq!(consume(&consumer, 1, IDLE).await.len(), 1);
    let standby = connect(&pair.on_standby(&s.db.url)).await;
    wait_standby_caught_up(&client, &standby).await;
    drop((client, standby));

    // when the primary dies, the relay waits for a server that accepts writes, saying so
    pair.stop_primary_hard();
    wait_until(relay.context("/readyz to say no server accepts writes".into()), async || {
        relay.readyz().is_some_and(|(status, body)| {
            status == 503 && body.contains("no server of postgres.host accepts writes")
        })
    })
    .await;
    // and when the standby is promoted
    pair.promote();

    // then the relay finds the new primary, sees the slot lost to the failover, and stops with
    // a reason that says so and what to do
    relay.wait_metric("outbox_relay_fatal_error{reason=\"failover_without_slot\"}", |v| v == 1.0).await;
    let (_, body) = relay.readyz().unwrap_or_default();
    assert!(body.contains("failover without a failover slot") && body.contains("--recreate-slot"), "{body}");
    relay.kill9();
}

#[tokio::test(flavor = "multi_thread")]
async fn check_says_what_failover_needs_on_each_version() {
    // given a relay configured for failover slots against a lone server
    let s = Setup::create(&services().kafka, "", true, |slot| {
        RelayToml::replication(slot).set("replication", "failover", true)
    })
    .await;
    let version = server_version(&s.db.client().await).await;
    let config = s.config().display().to_string();

    // when it is checked
    let (code, out, _) = run_relay(&["check", "--config", &config], Duration::from_secs(60));

    // then before 17 it fails naming the setting; from 17 it warns of what a promotion would
    // cost: no synchronized_standby_slots (phantoms) and no standby to find or to hold a copy
    if version < 170_000 {
        assert_eq!(code, 1, "{out}");
        assert!(out.contains("FAIL replication.failover") && out.contains("from version 17"), "{out}");
        // and the relay refuses to start, naming the setting
        let mut relay = s.start_with_env("relay", &[("OUTBOX_RELAY__METRICS__FATAL_EXIT_DELAY_SECS", "60")]);
        relay.wait_metric("outbox_relay_fatal_error{reason=\"config\"}", |v| v == 1.0).await;
        let (_, body) = relay.readyz().unwrap_or_default();
        assert!(body.contains("set replication.failover = false"), "{body}");
        relay.kill9();
    } else {
        assert_eq!(code, 0, "{out}");
        for line in ["WARN postgres.synchronized_standby_slots", "WARN replication.failover.standby"] {
            assert!(out.contains(line), "{line}: {out}");
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn an_idle_slot_is_timed_and_its_invalidation_foreseen_since_pg17() {
    // (before 17 PostgreSQL does not say when a slot became inactive)
    require_major(17).await;
    // given a server of this test's own (the setting is server-wide), with on 18 a slot timeout
    let server = hold("hold-postgres", &[]);
    let db = TestDb::create_at(&server["OUTBOX_RELAY_TEST_PG_URL"], "", true).await;
    let s = Setup::create_on(db, &services().kafka, "", true, RelayToml::replication).await;
    let client = s.db.client().await;
    let version = server_version(&client).await;
    if version >= 180_000 {
        client.batch_execute("ALTER SYSTEM SET idle_replication_slot_timeout = '2h'").await.unwrap();
        client.batch_execute("SELECT pg_reload_conf()").await.unwrap();
    }
    let env = [("OUTBOX_RELAY__METRICS__SAMPLE_INTERVAL_SECS", "1")];
    let mut relay = s.start_with_env("relay", &env);
    relay.wait_ready("active").await;
    let full = if version >= 180_000 { 7200.0 } else { -1.0 };
    relay.wait_metric("outbox_relay_slot_idle_timeout_remaining_seconds", |v| v == full).await;
    // (awaited, not read once: the gauge is sampled every second, and a sample taken in the
    // moment between the slot's creation and the stream's start said 0.58 s on a loaded machine;
    // what the relay promises is 0 while it streams)
    relay.wait_metric("outbox_relay_slot_inactive_seconds", |v| v == 0.0).await;

    // when the relay dies and another instance waits as a standby (this test holds the lock)
    relay.kill9();
    client
        .execute("SELECT pg_advisory_lock(hashtext('outbox-relay slot ' || $1))", &[&s.slot])
        .await
        .unwrap();
    let waiting = s.start_with_env("waiting", &env);

    // then the idle time grows and, on 18, the time left shrinks; `check` warns of the timeout
    waiting.wait_metric("outbox_relay_slot_inactive_seconds", |v| v >= 2.0).await;
    let left = waiting.metric("outbox_relay_slot_idle_timeout_remaining_seconds").unwrap();
    if version >= 180_000 {
        assert!(left < 7199.0 && left > 7000.0, "{left}");
        let config = s.config().display().to_string();
        let (code, out, _) =
            run_relay_with_env(&["check", "--config", &config], &env, Duration::from_secs(60));
        assert!(
            out.contains(
                "WARN postgres.idle_replication_slot_timeout idle_replication_slot_timeout = 7200 s"
            ),
            "{out}"
        );
        assert_eq!(code, 0, "{out}");
    } else {
        assert_eq!(left, -1.0);
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn polling_follows_a_promotion_to_the_new_primary_losing_nothing() {
    // given a polling relay (rows marked, not deleted, so the new primary's table is the record
    // of its history) with the standby listed in postgres.host
    let pair = Pair::start();
    let db = TestDb::create_at(pair.primary_url(), "", true).await;
    create_aggregates(&db.client().await, 8).await;
    let s = Setup::create_on(db, &services().kafka, "", true, |_| {
        RelayToml::mode("polling")
            .set("polling", "poll_interval_ms", 100)
            .set("polling", "after_publish", "mark")
            .set("retry", "initial_backoff_ms", 100)
            .set("retry", "max_backoff_ms", 500)
    })
    .await;
    let consumer = consumer(&[&s.topic]);
    let hosts = pair.hosts();
    let mut relay = s.start_with_env("relay", &[("OUTBOX_RELAY__POSTGRES__HOST", hosts.as_str())]);
    relay.wait_ready("active").await;

    // when the primary is stopped hard under a committing workload, and the standby promoted
    let (new_primary, died, _) = pair.fail_over_under_load(&s).await;

    // then every row of the new primary arrives, in order per aggregate, and is marked there
    // (a row the old primary committed and the relay published but the standby never received
    // is a phantom polling cannot prevent without synchronous replication: counted, not failed)
    let arrivals = Arrivals::collect(&consumer, &new_primary, died, &relay).await;
    let ours: Vec<Consumed> = arrivals
        .records
        .iter()
        .filter(|r| arrivals.expected.contains(r.header("id").unwrap()))
        .cloned()
        .collect();
    let report = assert_delivered(&ours, &committed_counts(&new_primary).await);
    wait_until(relay.context("every row of the new primary to be marked".into()), async || {
        let unmarked: i64 = new_primary
            .query_one("SELECT count(*) FROM outbox_events WHERE published_at IS NULL", &[])
            .await
            .unwrap()
            .get(0);
        unmarked == 0
    })
    .await;
    assert!(relay.exited().is_none(), "the relay stopped: {}", relay.log_text());
    eprintln!(
        "polling failover: {} rows on the new primary, {} duplicates, {} phantoms; first row from the new \
         primary {:?} after the primary died",
        arrivals.expected.len(),
        report.duplicates,
        arrivals.phantoms(),
        arrivals.first_from_new_primary
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_planned_switchover_promoted_once_switchover_ready_says_yes_sends_nothing_twice_since_pg17() {
    require_major(17).await;
    // given a relay streaming from a failover slot with the read-back off (an event replayed
    // from a copy that trails would be published again, so any gap shows as a duplicate), and
    // 200 events published
    let pair = Pair::start();
    let db = TestDb::create_at(pair.primary_url(), "", true).await;
    create_aggregates(&db.client().await, 8).await;
    let s = Setup::create_on(db, &services().kafka, "", true, |slot| {
        RelayToml::replication(slot)
            .set("replication", "failover", true)
            .set("dedup", "enabled", false)
            .set("retry", "initial_backoff_ms", 100)
            .set("retry", "max_backoff_ms", 500)
    })
    .await;
    let consumer = consumer(&[&s.topic]);
    let hosts = pair.hosts();
    let env = [
        ("OUTBOX_RELAY__POSTGRES__HOST", hosts.as_str()),
        ("OUTBOX_RELAY__METRICS__SAMPLE_INTERVAL_SECS", "1"),
    ];
    let mut relay = s.start_with_env("relay", &env);
    relay.wait_ready("active").await;
    let primary = s.db.client().await;
    let standby = connect(&pair.on_standby(&s.db.url)).await;
    wait_sync_ready(&primary, &standby, &s.slot).await;
    drop(standby);
    let mut writer = s.db.client().await;
    for i in 0..40 {
        write_txn(&mut writer, &s.aggregate_type, &format!("agg-{}", i % 8), 5, true).await;
    }
    let (mut records, _) =
        consume_until_all(&consumer, &outbox_ids(&primary).await, "-", Instant::now()).await;

    // when the writers have stopped and switchover-ready is asked until it says yes
    let config = s.config().display().to_string();
    let target = format!("127.0.0.1:{}", pair.var("OUTBOX_RELAY_TEST_STANDBY_PORT"));
    let args = ["switchover-ready", "--config", &config, "--standby", &target];
    let mut answers = Vec::new();
    wait_until_within(Duration::from_secs(120), "switchover-ready to say yes", async || {
        primary.execute("SELECT pg_log_standby_snapshot()", &[]).await.unwrap();
        let (code, out, err) = run_relay_with_env(&args, &env, Duration::from_secs(60));
        answers.push(format!("{code}: {out}{err}"));
        code == 0
    })
    .await;
    let said = answers.last().unwrap();
    assert!(
        said.starts_with(&format!("0: ready: {target} has a synced copy a promotion keeps, at ")),
        "{answers:?}"
    );
    // and every answer was yes or a reason, never an error
    for answer in &answers {
        assert!(answer.starts_with("0: ready: ") || answer.starts_with("1: not ready: "), "{answers:?}");
    }
    // and the relay's gauge says so too
    relay.wait_metric("outbox_relay_switchover_ready_standbys", |v| v == 1.0).await;
    // and asking about the primary itself is no
    let primary_arg = format!("127.0.0.1:{}", pair.var("OUTBOX_RELAY_TEST_PG_PORT"));
    let (code, out, _) = run_relay_with_env(
        &["switchover-ready", "--config", &config, "--standby", &primary_arg],
        &env,
        Duration::from_secs(60),
    );
    assert_eq!((code, out.starts_with("not ready: ")), (1, true), "{out}");

    // and the primary is stopped (a clean shutdown, as a planned switchover does) and the
    // standby promoted, and 5 events are written on it
    pair.pg_ctl(&["-D", pair.var("OUTBOX_RELAY_TEST_PG_DATA"), "-m", "fast", "-w", "stop"]);
    pair.promote();
    let mut new_primary = connect(&pair.on_standby(&s.db.url)).await;
    new_primary.batch_execute("INSERT INTO test_aggregates (id) VALUES ('agg-after')").await.unwrap();
    for _ in 0..5 {
        write_txn(&mut new_primary, &s.aggregate_type, "agg-after", 1, true).await;
    }

    // then every event of the new primary arrives, in order per aggregate, and none twice
    let expected = outbox_ids(&new_primary).await;
    assert_eq!(expected.len(), 205);
    let (after, _) = consume_until_all(&consumer, &expected, "agg-after", Instant::now()).await;
    // (a little longer: a replay of the copy's tail would arrive after the relay reconnected)
    tokio::time::sleep(Duration::from_secs(3)).await;
    records.extend(after);
    records.extend(consume(&consumer, 10_000, Duration::from_secs(2)).await);
    let report = assert_delivered(&records, &committed_counts(&new_primary).await);
    assert_eq!(report.duplicates, 0, "a planned switchover sent events twice: {}", relay.log_text());
    assert!(relay.exited().is_none(), "the relay stopped: {}", relay.log_text());
    relay.wait_ready("active").await;
}
