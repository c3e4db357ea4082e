//! The benchmark harness: `deploy/local/bench` (services + `cargo bench --bench harness`).
//!
//! Measures, side by side on one machine, for both source modes:
//! - backlog drain: N outbox rows (default 1,000,000; also 200,000 for comparison with earlier
//!   reports; ~200-byte JSON payloads, 10 events per transaction, 1,000 aggregates) written
//!   while the relay is stopped, then the time until Kafka acknowledged all of them
//!   (replication: and the slot's confirmed_flush_lsn passed the last commit), whole and from
//!   the first acknowledged event;
//! - the limits on the same backlog: `pg_recvlogical` (pgoutput) draining the same WAL to a
//!   file, and a plain rdkafka producer (acks=all, idempotent) sending the same records;
//! - steady-state latency at fixed write rates: commit (as the writer sees COMMIT return) to the
//!   consumer receiving the record, an upper bound of commit-to-acknowledgement;
//! - the relay's peak RSS and CPU seconds, and peak RSS at a tenth of the backlog;
//! - with `--only scaling`, the drain by payload and transaction size (`harness/scaling.rs`);
//! - with `--only transactions`, all of the above that issue 30 asks for, with Kafka
//!   transactions and without, in both modes (`harness/transactions.rs`);
//! - with `--only outboxes`, one relay reading ten outbox tables from one slot against ten
//!   relays with one each (issue 31): drain, steady state, the relays' and the walsenders' CPU
//!   (`harness/outboxes.rs`);
//! - with `--only watch`, what continuous verification (`verify --watch`) costs beside a relay
//!   at 2,000 events/s (issue 34, `harness/watch.rs`);
//! - with `--only transforms`, the cost of a filter, a route and three redactions
//!   (`[outbox.transforms]`, issue 52) side by side with none, in both modes
//!   (`harness/transforms.rs`);
//! - with `--peer debezium`, the relay side by side with Debezium's PostgreSQL connector and
//!   outbox event router on the same database, broker and workload: drain, latency, memory and
//!   CPU (issue 33, `harness/peer.rs`);
//! - with `--baseline PATH`, another build of the relay (an earlier commit's
//!   `target/release/outbox-relay`, copied aside) drained side by side with this one, in both
//!   modes, their order flipped each run: what a change did to CPU, rate and memory
//!   (`harness/baseline.rs`).
//!
//! Each figure is the median of `--runs` runs (default 3) with min and max.
//! [`report::run`] measures, [`report::render`] turns the results into the tables (with issue
//! 16's targets, met or missed) that are printed and written to BENCHMARKS.md (`--out`). The
//! databases, topics and relay processes come from the test harness (`tests/common`).

#[path = "harness/baseline.rs"]
mod baseline;
#[path = "../tests/common/mod.rs"]
mod common;
#[path = "harness/dedup.rs"]
mod dedup;
#[path = "harness/floor.rs"]
mod floor;
#[path = "harness/formats.rs"]
mod formats;
#[path = "harness/idle.rs"]
mod idle;
#[path = "harness/latency.rs"]
mod latency;
#[path = "harness/outboxes.rs"]
mod outboxes;
#[path = "harness/peer.rs"]
mod peer;
#[path = "harness/profile.rs"]
mod profile;
#[path = "harness/record.rs"]
mod record;
#[path = "harness/report.rs"]
mod report;
#[path = "harness/scaling.rs"]
mod scaling;
#[path = "harness/tracing.rs"]
mod tracing;
#[path = "harness/transactions.rs"]
mod transactions;
#[path = "harness/transforms.rs"]
mod transforms;
#[path = "harness/verify.rs"]
mod verify;
#[path = "harness/watch.rs"]
mod watch;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::process::RelayProcess;
use common::{
    RelayToml, TestDb, create_topic, random_suffix, run_relay, services, use_relay_bin, wait_until_within,
};
use latency::{
    Latency, end_offsets, histogram_quantile, judge_window, latency_consumer, receive_ids, steady_latency,
    steady_latency_in, write_at_rate, write_warm_up,
};
use rdkafka::ClientConfig;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use tokio_postgres::Client;

/// Partitions of every topic the harness creates.
const PARTITIONS: i32 = 8;
/// How long one backlog drain may take before the harness gives up.
const DRAIN_LIMIT: Duration = Duration::from_secs(1800);

struct Options {
    events: usize,
    runs: usize,
    rates: Vec<usize>,
    duration: Duration,
    out: Option<String>,
    /// `--only dedup`: only the cost of exactly once (`harness/dedup.rs`); `--only verify`: only
    /// what `verify` costs (`harness/verify.rs`); `--only record`: what the record of what was
    /// published costs (`harness/record.rs`); `--only transactions`: what Kafka transactions
    /// cost (`harness/transactions.rs`); `--only outboxes`: one relay for ten outboxes against
    /// ten relays (`harness/outboxes.rs`); `--peer debezium` (or `--only peer`): the relay
    /// against Debezium (`harness/peer.rs`).
    only: Option<String>,
    /// `--events` was given (sections with a default of their own keep it otherwise).
    events_given: bool,
    /// `--kafka 'key = value; ...'`: `[kafka]` lines for every relay of `--only transactions`.
    kafka: String,
    /// `--transactional 'key = value; ...'`: `[kafka]` lines for its transactional relays only
    /// (their bounds).
    transactional: String,
    /// `--peer-worker 'key=value; ...'` and `--peer-connector 'key=value; ...'`: properties added
    /// to Debezium's Kafka Connect worker and to its connector (`--peer debezium`).
    peer_worker: Vec<String>,
    peer_connector: Vec<String>,
    /// `--baseline PATH`: another build of the relay, drained side by side with this one.
    baseline: Option<std::path::PathBuf>,
}

fn options() -> Options {
    let mut o = Options {
        events: 1_000_000,
        runs: 3,
        rates: vec![2_000, 10_000],
        duration: Duration::from_secs(60),
        out: Some("BENCHMARKS.md".into()),
        only: None,
        events_given: false,
        kafka: String::new(),
        transactional: String::new(),
        peer_worker: Vec::new(),
        peer_connector: Vec::new(),
        baseline: None,
    };
    let args: Vec<String> = std::env::args().skip(1).filter(|a| a != "--bench").collect();
    let mut i = 0;
    while i < args.len() {
        let value = args.get(i + 1).cloned().unwrap_or_default();
        match args[i].as_str() {
            "--events" => {
                o.events = value.parse().expect("--events N");
                o.events_given = true;
            }
            "--runs" => o.runs = value.parse().expect("--runs N"),
            "--rates" => {
                o.rates = value
                    .split(',')
                    .filter(|r| !r.is_empty())
                    .map(|r| r.parse().expect("--rates a,b,c"))
                    .collect()
            }
            "--duration-secs" => o.duration = Duration::from_secs(value.parse().expect("--duration-secs N")),
            "--out" => o.out = if value == "-" { None } else { Some(value) },
            "--only"
                if [
                    "dedup",
                    "verify",
                    "scaling",
                    "record",
                    "transactions",
                    "outboxes",
                    "formats",
                    "floor",
                    "peer",
                    "watch",
                    "tracing",
                    "idle",
                    "transforms",
                ]
                .contains(&value.as_str()) =>
            {
                o.only = Some(value)
            }
            "--peer" if value == "debezium" => o.only = Some("peer".into()),
            "--baseline" => {
                o.baseline = Some(value.into());
                // (`--only idle` measures the baseline its own way)
                if o.only.as_deref() != Some("idle") {
                    o.only = Some("baseline".into());
                }
            }
            "--kafka" => o.kafka = toml_lines(&value),
            "--transactional" => o.transactional = toml_lines(&value),
            "--peer-worker" => o.peer_worker = properties(&value),
            "--peer-connector" => o.peer_connector = properties(&value),
            other => panic!("unknown option {other}; see benches/harness.rs"),
        }
        i += 2;
    }
    o
}

/// `a=1; b=2` as properties, one an item.
fn properties(value: &str) -> Vec<String> {
    value.split(';').map(str::trim).filter(|l| !l.is_empty()).map(String::from).collect()
}

/// `a = 1; b = 2` as TOML lines (one option's value holds several settings).
fn toml_lines(value: &str) -> String {
    value.split(';').map(str::trim).filter(|l| !l.is_empty()).map(|l| format!("{l}\n")).collect()
}

/// `pg_recvlogical` from `$PG_BIN` (deploy/local/lib.sh sets it, deploy/local/bench exports
/// it), else from PATH.
fn pg_recvlogical() -> PathBuf {
    const HINT: &str = "set PG_BIN to PostgreSQL's bin directory (e.g. /usr/lib/postgresql/15/bin), \
                        as deploy/local/bench does, or put pg_recvlogical on PATH";
    if let Some(dir) = std::env::var_os("PG_BIN") {
        let path = Path::new(&dir).join("pg_recvlogical");
        assert!(path.is_file(), "{} does not exist: {HINT}", path.display());
        return path;
    }
    std::env::var_os("PATH")
        .and_then(|paths| {
            std::env::split_paths(&paths).map(|d| d.join("pg_recvlogical")).find(|p| p.is_file())
        })
        .unwrap_or_else(|| panic!("pg_recvlogical not found: {HINT}"))
}

/// A fresh database with the schema and a backlog writer procedure.
async fn backlog_db() -> TestDb {
    let db = TestDb::new().await;
    // 10 events per transaction over 1,000 aggregates, ~200-byte payloads; commits server-side
    db.client()
        .await
        .batch_execute(
            "CREATE PROCEDURE write_backlog(total int, aggregate_type text) LANGUAGE plpgsql AS $$
             BEGIN
               FOR t IN 0 .. total / 10 - 1 LOOP
                 INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload)
                 SELECT aggregate_type, ((t * 10 + i) % 1000)::text, 'OrderPlaced',
                        jsonb_build_object('order_id', t * 10 + i, 'customer', 'customer-' || ((t * 10 + i) % 977),
                          'total_cents', (t * 10 + i) % 100000, 'currency', 'EUR', 'status', 'placed',
                          'note', repeat('x', 60), 'written_at', clock_timestamp())
                 FROM generate_series(0, 9) i;
                 COMMIT;
               END LOOP;
             END $$;
             -- the scaling curve: `per_txn` events per transaction, payloads of `payload_bytes`
             CREATE PROCEDURE write_shaped(total int, aggregate_type text, per_txn int, payload_bytes int)
             LANGUAGE plpgsql AS $$
             BEGIN
               FOR t IN 0 .. total / per_txn - 1 LOOP
                 INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload)
                 SELECT aggregate_type, ((t * per_txn + i) % 1000)::text, 'OrderPlaced',
                        jsonb_build_object('order_id', t * per_txn + i, 'written_at', clock_timestamp(),
                          'note', repeat('x', greatest(payload_bytes - 80, 0)))
                 FROM generate_series(0, per_txn - 1) i;
                 COMMIT;
               END LOOP;
             END $$;",
        )
        .await
        .unwrap();
    db
}

/// A relay process on `db`, logging warnings only, with its configuration in a directory of
/// its own.
struct Relay {
    process: RelayProcess,
    mode: &'static str,
    _dir: tempfile::TempDir,
}

/// A relay configuration in a temporary directory; returns (dir, config path).
/// `kafka_extra` and `extra` are added to the `[kafka]` section and the end.
fn relay_config(
    db: &TestDb,
    mode: &str,
    slot: &str,
    kafka_extra: &str,
    extra: &str,
) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let config = common::write_config_with(
        dir.path(),
        db,
        &services().kafka,
        kafka_extra,
        format!(
            "{}{extra}",
            RelayToml::replication(slot).set("source", "mode", mode).set(
                "metrics",
                "sample_interval_secs",
                1
            )
        ),
    );
    (dir, config)
}

impl Relay {
    fn start(db: &TestDb, mode: &'static str, slot: &str) -> Relay {
        Self::start_with(db, mode, slot, "", "")
    }

    /// As [`Relay::start`], with lines added to the `[kafka]` section and the end.
    fn start_with(db: &TestDb, mode: &'static str, slot: &str, kafka_extra: &str, extra: &str) -> Relay {
        let (dir, config) = relay_config(db, mode, slot, kafka_extra, extra);
        let process = RelayProcess::spawn(&config, &dir.path().join("relay.log"), "warn", &[]);
        Relay { process, mode, _dir: dir }
    }

    /// `outbox-relay setup`: publication and slot, before the backlog is written.
    fn setup(db: &TestDb, slot: &str) {
        Self::setup_with(db, slot, "")
    }

    /// As [`Relay::setup`], with lines added to the end of the configuration (its outboxes).
    fn setup_with(db: &TestDb, slot: &str, extra: &str) {
        let (_dir, config) = relay_config(db, "replication", slot, "", extra);
        let (code, _, stderr) =
            run_relay(&["setup", "--config", config.to_str().unwrap()], Duration::from_secs(120));
        assert_eq!(code, 0, "setup: {stderr}");
    }

    fn published(&self) -> f64 {
        let series = format!("outbox_relay_events_published_total{{mode=\"{}\"}}", self.mode);
        self.process.metric(&series).unwrap_or(0.0)
    }

    /// (peak RSS in MiB, CPU seconds) from /proc.
    fn usage(&self) -> (f64, f64) {
        let pid = self.process.pid();
        (peak_rss_mib(pid), cpu_seconds(pid).unwrap_or(0.0))
    }
}

/// A process's peak RSS (`VmHWM` of /proc/PID/status) in MiB; 0 once it has exited.
fn peak_rss_mib(pid: u32) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let hwm_kb: f64 = status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0);
    hwm_kb / 1024.0
}

/// A process's CPU seconds (utime + stime of /proc/PID/stat, at 100 ticks a second); None once
/// it has exited.
fn cpu_seconds(pid: u32) -> Option<f64> {
    cpu_of_stat(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

/// The user and system CPU seconds of a `/proc/.../stat` line (a process's or a thread's).
fn cpu_of_stat(stat: &str) -> Option<f64> {
    // (the fields after the command name, which may hold spaces and parentheses)
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let ticks = |i: usize| fields.get(i).and_then(|v| v.parse::<f64>().ok());
    Some((ticks(11)? + ticks(12)?) / 100.0)
}

async fn wal_lsn(client: &Client) -> i64 {
    client.query_one("SELECT (pg_current_wal_lsn() - '0/0')::bigint", &[]).await.unwrap().get(0)
}

async fn confirmed(client: &Client, slot: &str) -> i64 {
    client
        .query_one("SELECT coalesce((confirmed_flush_lsn - '0/0')::bigint, 0) FROM pg_replication_slots WHERE slot_name = $1", &[&slot])
        .await
        .unwrap()
        .get(0)
}

/// The rows of a backlog: `per_txn` events per transaction with payloads of about
/// `payload_bytes` (`write_shaped`); `None` in [`slot_backlog`] is the classic backlog
/// (`write_backlog`: 10 per transaction, ~200-byte payloads).
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    pub per_txn: i32,
    pub payload_bytes: i32,
}

#[derive(Default, Clone)]
struct Drain {
    seconds: f64,
    /// The highest `outbox_relay_bytes_in_flight` seen while draining.
    max_bytes_in_flight: f64,
    /// Events/s from the first acknowledged event to the last: the steady rate, without the
    /// start-up and the first read-back.
    after_first: f64,
    rss_mib: f64,
    cpu_per_100k: f64,
    /// CPU seconds per 100k events from the first acknowledged event to the last.
    cpu_after_first_per_100k: f64,
    /// Offsets of the topic beyond the backlog's records: with Kafka transactions, one commit
    /// marker per transaction and partition it wrote to (counted by [`dedup::drain_with`] only).
    markers: f64,
}

/// Waits until `done` (checked with the relay's published count), noting when the first event
/// was acknowledged; returns (seconds since `started`, events/s after the first event).
async fn timed_drain(
    relay: &Relay,
    events: usize,
    started: Instant,
    what: &str,
    mut done: impl AsyncFnMut(f64) -> bool,
) -> Drain {
    let mut first: Option<(Instant, f64)> = None;
    let mut max_bytes_in_flight: f64 = 0.0;
    wait_until_within(DRAIN_LIMIT, what, async || {
        let published = relay.published();
        if first.is_none() && published >= 1.0 {
            first = Some((Instant::now(), relay.usage().1));
        }
        let in_flight = relay.process.metric("outbox_relay_bytes_in_flight").unwrap_or(0.0);
        max_bytes_in_flight = max_bytes_in_flight.max(in_flight);
        done(published).await
    })
    .await;
    let seconds = started.elapsed().as_secs_f64();
    let rest = events.saturating_sub(1).max(1) as f64;
    let after_first = first.map_or(0.0, |(f, _)| rest / f.elapsed().as_secs_f64().max(1e-3));
    let (rss_mib, cpu) = relay.usage();
    Drain {
        seconds,
        max_bytes_in_flight,
        after_first,
        rss_mib,
        cpu_per_100k: cpu * 100_000.0 / events as f64,
        cpu_after_first_per_100k: first.map_or(0.0, |(_, at)| (cpu - at) * 100_000.0 / rest),
        markers: 0.0,
    }
}

/// A fresh database with the relay's slot made before a backlog was written.
struct Backlog {
    db: TestDb,
    client: Client,
    slot: String,
    aggregate_type: String,
    /// The WAL position after the backlog.
    end: i64,
}

/// A [`Backlog`] of `events` events for a topic of `partitions`; `twin`, when given, is a plain
/// pgoutput slot made alongside the relay's.
async fn slot_backlog(partitions: i32, events: usize, twin: Option<&str>, shape: Option<Shape>) -> Backlog {
    let db = backlog_db().await;
    let client = db.client().await;
    let aggregate_type = format!("b{}", random_suffix());
    create_topic(&format!("outbox.event.{aggregate_type}"), partitions).await;
    let slot = format!("s_{}", random_suffix());
    Relay::setup(&db, &slot);
    if let Some(twin) = twin {
        client.execute("SELECT pg_create_logical_replication_slot($1, 'pgoutput')", &[&twin]).await.unwrap();
    }
    match shape {
        None => client.execute("CALL write_backlog($1, $2)", &[&(events as i32), &aggregate_type]).await,
        Some(Shape { per_txn, payload_bytes }) => {
            let args: [&(dyn tokio_postgres::types::ToSql + Sync); 4] =
                [&(events as i32), &aggregate_type, &per_txn, &payload_bytes];
            client.execute("CALL write_shaped($1, $2, $3, $4)", &args).await
        }
    }
    .unwrap();
    let end = wal_lsn(&client).await;
    Backlog { db, client, slot, aggregate_type, end }
}

/// A replication backlog drain of `events` events shaped as `shape` ([`slot_backlog`]); with
/// `twin`, first `pg_recvlogical` on a twin slot over the same WAL (its seconds).
async fn replication_drain(events: usize, shape: Option<Shape>, twin: bool) -> (Drain, Option<f64>) {
    let twin = twin.then(|| format!("t_{}", random_suffix()));
    let Backlog { db, client, slot, end, aggregate_type } =
        slot_backlog(PARTITIONS, events, twin.as_deref(), shape).await;
    let recvlogical = match twin {
        Some(twin) => Some(recvlogical_drain(&db, &client, &twin, &slot).await),
        None => None,
    };
    let started = Instant::now();
    let relay = Relay::start(&db, "replication", &slot);
    let profile = profile::Profile::attach(relay.process.pid(), &format!("replication-{events}"));
    let drain = timed_drain(&relay, events, started, "the replication drain", async |published| {
        published >= events as f64 && confirmed(&client, &slot).await >= end
    })
    .await;
    drop(profile);
    drop(relay);
    drop(db);
    drop_topic(&format!("outbox.event.{aggregate_type}")).await;
    (drain, recvlogical)
}

/// The limit: `pg_recvlogical` (pgoutput) drains the WAL up to now from the slot `twin` to a
/// file; returns its seconds.
async fn recvlogical_drain(db: &TestDb, client: &Client, twin: &str, slot: &str) -> f64 {
    let end_text: String = client.query_one("SELECT pg_current_wal_lsn()::text", &[]).await.unwrap().get(0);
    let (host, port, user) = db.pg_parts();
    let dir = tempfile::tempdir().unwrap();
    let started = Instant::now();
    let status = Command::new(pg_recvlogical())
        .args(["-h", &host, "-p", &port.to_string(), "-U", &user, "-d", &db.name])
        .args(["--slot", twin, "--start", "--endpos", &end_text, "--no-loop", "-f"])
        .arg(dir.path().join("wal.out"))
        .args(["-o", "proto_version=1", "-o", &format!("publication_names=p_{slot}")])
        .status()
        .expect("pg_recvlogical");
    let seconds = started.elapsed().as_secs_f64();
    assert!(status.success(), "pg_recvlogical failed");
    client.execute("SELECT pg_drop_replication_slot($1)", &[&twin]).await.unwrap();
    seconds
}

async fn polling_drain(events: usize) -> Drain {
    let db = backlog_db().await;
    let client = db.client().await;
    let aggregate_type = format!("p{}", random_suffix());
    create_topic(&format!("outbox.event.{aggregate_type}"), PARTITIONS).await;
    client.execute("CALL write_backlog($1, $2)", &[&(events as i32), &aggregate_type]).await.unwrap();
    let started = Instant::now();
    let relay = Relay::start(&db, "polling", "unused");
    let profile = profile::Profile::attach(relay.process.pid(), &format!("polling-{events}"));
    let drain = timed_drain(&relay, events, started, "the polling drain", async |published| {
        // the relay's count first: counting the rows of a large table (each poll, on the same two
        // cores) would slow the drain it measures; rows left unpublished, in either
        // after_publish mode (delete: none left; mark: none without published_at)
        published >= events as f64 && {
            let unpublished = "SELECT count(*) FROM outbox_events WHERE published_at IS NULL";
            let left: i64 = client.query_one(unpublished, &[]).await.unwrap().get(0);
            left == 0
        }
    })
    .await;
    drop(profile);
    drop(relay);
    drop(db);
    drop_topic(&format!("outbox.event.{aggregate_type}")).await;
    drain
}

/// Deletes a topic the harness is done with, so the in-memory broker does not carry every
/// earlier drain's records into the later measurements (the latency runs slowed as it grew).
async fn drop_topic(topic: &str) {
    use rdkafka::admin::{AdminClient, AdminOptions};
    let admin: AdminClient<rdkafka::client::DefaultClientContext> =
        ClientConfig::new().set("bootstrap.servers", &services().kafka).create().unwrap();
    let deleted = admin.delete_topics(&[topic], &AdminOptions::new()).await;
    if let Err(e) = deleted
        .map_err(|e| e.to_string())
        .and_then(|r| r.into_iter().next().unwrap().map_err(|(_, e)| e.to_string()))
    {
        eprintln!("[bench]   could not delete topic {topic}: {e}");
    }
}

/// A plain idempotent acks=all producer sending records shaped like the relay's (payloads of
/// `payload_bytes` when given): seconds to send `events` and have every one acknowledged.
async fn producer_limit(events: usize, payload_bytes: Option<usize>) -> f64 {
    let topic = format!("bench.producer.{}", random_suffix());
    create_topic(&topic, PARTITIONS).await;
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &services().kafka)
        .set("acks", "all")
        .set("enable.idempotence", "true")
        .set("linger.ms", "5")
        .create()
        .unwrap();
    let payload = match payload_bytes {
        // (the scaling curve's size: a JSON document of that many bytes)
        Some(bytes) => format!("{{\"note\": \"{}\"}}", "x".repeat(bytes.saturating_sub(12))),
        None => format!(
            "{{\"note\": \"{}\", \"status\": \"placed\", \"currency\": \"EUR\", \"customer\": \"customer-1\", \"order_id\": 1, \"written_at\": \"2026-11-29T10:00:00.000000+00:00\", \"total_cents\": 1}}",
            "x".repeat(60)
        ),
    };
    let started = Instant::now();
    let mut pending = Vec::with_capacity(events);
    for i in 0..events {
        let key = (i % 1000).to_string();
        let id = i.to_string();
        loop {
            let headers = OwnedHeaders::new()
                .insert(Header { key: "id", value: Some(id.as_str()) })
                .insert(Header { key: "event_type", value: Some("OrderPlaced") })
                .insert(Header { key: "aggregate_type", value: Some("order") });
            match producer.send_result(FutureRecord::to(&topic).key(&key).payload(&payload).headers(headers))
            {
                Ok(f) => {
                    pending.push(f);
                    break;
                }
                Err((
                    rdkafka::error::KafkaError::MessageProduction(
                        rdkafka::types::RDKafkaErrorCode::QueueFull,
                    ),
                    _,
                )) => {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                Err((e, _)) => panic!("produce: {e}"),
            }
        }
    }
    for f in pending {
        f.await.unwrap().map_err(|(e, _)| e).unwrap();
    }
    let seconds = started.elapsed().as_secs_f64();
    drop_topic(&topic).await;
    seconds
}

/// "median (min-max)"
fn stat(values: &[f64], digits: usize) -> String {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let median = v[v.len() / 2];
    format!("{median:.digits$} ({:.digits$}-{:.digits$})", v[0], v[v.len() - 1])
}

#[tokio::main]
async fn main() {
    let o = options();
    match o.only.as_deref() {
        Some("dedup") => {
            let cost = dedup::run(&o).await;
            let table = dedup::render(&o, &cost);
            println!("{table}");
            if let Some(out) = &o.out {
                dedup::write_section(out, "dedup-cost", &table);
            }
            return;
        }
        Some("record") => {
            let cost = record::run(&o).await;
            let table = record::render(&o, &cost);
            println!("{table}");
            if let Some(out) = &o.out {
                dedup::write_section(out, "record-cost", &table);
            }
            return;
        }
        Some("transactions") => {
            let cost = transactions::run(&o).await;
            let text = transactions::render(&o, &cost);
            println!("{text}");
            if let Some(out) = &o.out {
                dedup::write_section(out, "transaction-cost", &text);
            }
            return;
        }
        Some("floor") => {
            let cost = floor::run(&o).await;
            let text = floor::render(&o, &cost);
            println!("{text}");
            if let Some(out) = &o.out {
                dedup::write_section(out, "floor-cost", &text);
            }
            return;
        }
        Some("formats") => {
            let cost = formats::run(&o).await;
            let text = formats::render(&o, &cost);
            println!("{text}");
            if let Some(out) = &o.out {
                dedup::write_section(out, "formats-cost", &text);
            }
            return;
        }
        Some("peer") => {
            let cost = peer::run(&o).await;
            let text = peer::render(&o, &cost);
            println!("{text}");
            if let Some(out) = &o.out {
                dedup::write_section(out, "peer-cost", &text);
            }
            return;
        }
        Some("watch") => {
            let cost = watch::run(&o).await;
            let text = watch::render(&o, &cost);
            println!("{text}");
            if let Some(out) = &o.out {
                dedup::write_section(out, "watch-cost", &text);
            }
            return;
        }
        Some("outboxes") => {
            let cost = outboxes::run(&o).await;
            let text = outboxes::render(&o, &cost);
            println!("{text}");
            if let Some(out) = &o.out {
                dedup::write_section(out, "outboxes-cost", &text);
            }
            return;
        }
        Some("tracing") => {
            let runs = tracing::run(&o).await;
            let text = tracing::render(&o, &runs);
            println!("{text}");
            if let Some(out) = &o.out {
                dedup::write_section(out, "tracing", &text);
            }
            return;
        }
        Some("idle") => {
            let runs = idle::run(&o).await;
            let text = idle::render(&o, &runs);
            println!("{text}");
            if let Some(out) = &o.out {
                dedup::write_section(out, "idle", &text);
            }
            return;
        }
        Some("transforms") => {
            let cost = transforms::run(&o).await;
            let text = transforms::render(&o, &cost);
            println!("{text}");
            if let Some(out) = &o.out {
                dedup::write_section(out, "transforms-cost", &text);
            }
            return;
        }
        Some("baseline") => {
            let runs = baseline::run(&o).await;
            let text = baseline::render(&o, &runs);
            println!("{text}");
            if let Some(out) = &o.out {
                dedup::write_section(out, "baseline", &text);
            }
            return;
        }
        Some("scaling") => {
            let points = scaling::run(&o).await;
            let table = scaling::render(&o, &points);
            println!("{table}");
            if let Some(out) = &o.out {
                scaling::write_chart(&points);
                dedup::write_section(out, "scaling", &format!("{}  \n\n{table}", report::machine()));
            }
            return;
        }
        Some(_) => {
            let (events, runs) = verify::run(&o).await;
            let table = verify::render(&o, events, &runs);
            println!("{table}");
            if let Some(out) = &o.out {
                dedup::write_section(out, "verify-cost", &table);
            }
            return;
        }
        None => {}
    }
    let results = report::run(&o).await;
    let table = report::render(&o, &results);
    println!("{table}");
    if let Some(out) = &o.out {
        report::write_report(out, &table);
    }
}
