//! The relay side by side with Debezium (issue 33): Debezium's PostgreSQL connector with its
//! outbox event router on a Kafka Connect standalone worker (`deploy/local/debezium/run`), reading
//! the relay's own `outbox_events` table, against the same PostgreSQL and broker, with the same
//! workload and producer settings. Each run measures both, the order flipped each run so that the
//! machine's drift hits both alike:
//! - backlog drain (`--events`, 200,000 for this section unless given; `write_backlog`): written
//!   after each side's slot was made and while neither runs, then timed from the start (cold:
//!   the relay's start, Debezium's JVM start and its stream start) and from the first record in
//!   Kafka (warm). The relay's drain ends once Kafka acknowledged every event and its slot
//!   confirmed the last commit ([`drain_with`]); Debezium's once the topic's end offsets reach
//!   the backlog (its slot is confirmed later, at its offset flush).
//! - steady state at the first of `--rates` (2,000 events/s) for `--duration-secs`: commit (the
//!   writer's COMMIT returning) to a consumer receiving the record, matched by the `id` header
//!   both publish, and CPU per event;
//! - peak RSS (`VmHWM`) and CPU seconds (utime+stime) of the relay process and of the Connect JVM.
//!
//! Issue 33's goals, against the medians of the paired runs: the relay's drain from its start at
//! least 4x Debezium's from its first record; the relay's peak RSS at most 1/25 of Debezium's; the
//! relay's CPU per event over its whole drain at most 1/10 of Debezium's from its first record.
//!
//! `deploy/local/bench --peer debezium` (or `--only peer`) runs this alone and writes its section
//! of BENCHMARKS.md; `--peer-worker 'k=v; ...'` and `--peer-connector 'k=v; ...'` add properties
//! to Debezium's worker and connector (its settings are printed with the table).

use std::fs::File;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rdkafka::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use tokio_postgres::Client;

use super::common::{
    TestDb, connect, create_topic, http, random_suffix, repo_root, services, wait_until_within,
};
use super::dedup::drain_with;
use super::report::median;
use super::{
    DRAIN_LIMIT, Drain, Latency, Options, PARTITIONS, backlog_db, cpu_seconds, drop_topic, judge_window,
    latency_consumer, peak_rss_mib, receive_ids, stat, steady_latency, write_at_rate,
};

/// The two sides, in the columns' order.
const SIDES: [&str; 2] = ["relay", "Debezium"];
/// Issue 33's goals: the relay's drain over Debezium's warm drain, at least; the relay's peak RSS
/// and CPU per event over Debezium's, at most.
const DRAIN_GOAL: f64 = 4.0;
const MEMORY_GOAL: f64 = 1.0 / 25.0;
const CPU_GOAL: f64 = 1.0 / 10.0;

/// The router's fields on the relay's table (Debezium's defaults name the columns of
/// sql/examples/debezium_outbox.sql): the `id` header, the key, the topic by `aggregate_type`
/// (Debezium's default `outbox.event.${routedByValue}` is the relay's topic), the value as
/// stored, and the event and aggregate types as headers, as the relay sends them.
const ROUTER: [&str; 5] = [
    "table.field.event.id=id",
    "table.field.event.key=aggregate_id",
    "route.by.field=aggregate_type",
    "table.field.event.payload=payload",
    "table.fields.additional.placement=event_type:header:event_type,aggregate_type:header:aggregate_type",
];
/// The harness makes the publication as the relay's `setup` does: `outbox_events` is partitioned
/// by day, and only a publication via the partition root names it (not its partitions) in the
/// stream.
const CONNECTOR: [&str; 1] = ["publication.autocreate.mode=disabled"];
/// The worker's producer as the relay's (`src/sink/kafka/client.rs`): acks=all, idempotent,
/// linger 5 ms.
const WORKER: [&str; 3] = ["producer.acks=all", "producer.enable.idempotence=true", "producer.linger.ms=5"];
/// The key and the value as stored: the value is the payload's JSON text, as the relay's.
const CONVERTERS: &str = "string";

/// One side's runs.
#[derive(Default)]
struct Side {
    drains: Vec<Drain>,
    latencies: Vec<Latency>,
}

/// Per side, in [`SIDES`]' order.
#[derive(Default)]
pub struct PeerCost {
    sides: [Side; 2],
}

fn events(o: &Options) -> usize {
    if o.events_given { o.events } else { 200_000 }
}

fn rate(o: &Options) -> usize {
    o.rates.first().copied().unwrap_or(2_000)
}

/// Every measurement `o.runs` times: both drains, then both steady states.
pub async fn run(o: &Options) -> PeerCost {
    let mut cost = PeerCost::default();
    let (events, rate) = (events(o), rate(o));
    for run in 1..=o.runs {
        let order = if run % 2 == 1 { [0, 1] } else { [1, 0] };
        for side in order {
            eprintln!("[bench] peer run {run}/{}: {} drain of {events}", o.runs, SIDES[side]);
            let d = match side {
                0 => drain_with("replication", events, "", "", async |_| {}).await,
                _ => debezium_drain(events, o).await,
            };
            eprintln!(
                "[bench]   {:.0}/s, after the first event {:.0}/s, {} records, RSS {:.0} MiB, CPU {:.2} s/100k \
                 ({:.2} after the first)",
                events as f64 / d.seconds,
                d.after_first,
                events as f64 + d.markers,
                d.rss_mib,
                d.cpu_per_100k,
                d.cpu_after_first_per_100k
            );
            cost.sides[side].drains.push(d);
        }
        for side in order {
            eprintln!("[bench] peer run {run}/{}: {} at {rate}/s", o.runs, SIDES[side]);
            let l = match side {
                0 => steady_latency(rate, o.duration).await,
                _ => debezium_latency(rate, o.duration, o).await,
            };
            eprintln!(
                "[bench]   commit-to-consumer p50 {:.1} p99 {:.1} ms, CPU {:.2} s/100k, RSS {:.0} MiB, sustained {}",
                l.p50_ms, l.p99_ms, l.cpu_per_100k, l.rss_mib, l.sustained
            );
            cost.sides[side].latencies.push(l);
        }
    }
    cost
}

/// A Kafka Connect worker running Debezium on one database (`deploy/local/debezium/run`), with
/// its state directory (configuration, logs, source offsets) kept across restarts; stopped on
/// drop.
struct Worker {
    state: tempfile::TempDir,
    args: Vec<String>,
    /// `run start` while it waits for the connector to stream.
    starting: Option<Child>,
    running: bool,
    /// When the connector's status was last asked for (once a second: the drain polls the topic
    /// every 50 ms).
    status_asked: Option<Instant>,
}

/// `deploy/local/debezium/run`, told the database and broker by its arguments only.
fn debezium_run() -> Command {
    let mut command = Command::new(repo_root().join("deploy/local/debezium/run"));
    command.env_remove("OUTBOX_LOCAL_STATE").env_remove("DEBEZIUM_STATE");
    command
}

impl Worker {
    /// A worker (not started) for `db`'s `outbox_events`, with a publication like the relay's.
    async fn new(db: &TestDb, client: &Client, o: &Options) -> Worker {
        let slot = format!("dbz_{}", random_suffix());
        let publication = format!("p_{slot}");
        client
            .batch_execute(&format!(
                "CREATE PUBLICATION {publication} FOR TABLE outbox_events \
                 WITH (publish = 'insert', publish_via_partition_root = true)"
            ))
            .await
            .unwrap();
        let state = tempfile::tempdir().unwrap();
        let mut args: Vec<String> = ["--state", state.path().to_str().unwrap(), "--pg-url", &db.url]
            .into_iter()
            .chain(["--bootstrap", &services().kafka, "--table", "public.outbox_events"])
            .chain(["--slot", &slot, "--publication", &publication, "--converters", CONVERTERS])
            .map(String::from)
            .collect();
        let connector = CONNECTOR.iter().copied().chain(o.peer_connector.iter().map(String::as_str));
        let worker = WORKER.iter().copied().chain(o.peer_worker.iter().map(String::as_str));
        let flagged = ROUTER.iter().map(|v| ("--router", *v)).chain(connector.map(|v| ("--connector", v)));
        for (flag, value) in flagged.chain(worker.map(|v| ("--worker", v))) {
            args.extend([flag.to_string(), value.to_string()]);
        }
        Worker { state, args, starting: None, running: false, status_asked: None }
    }

    /// Starts the worker in the background: `run start` returns once the connector streams,
    /// while the worker may already publish; [`Worker::check`] reports a failed start.
    fn spawn(&mut self) {
        let log = |name: &str| File::create(self.state.path().join(name)).unwrap();
        let child = debezium_run()
            .arg("start")
            .args(&self.args)
            .stdout(Stdio::from(log("start.out")))
            .stderr(Stdio::from(log("start.err")))
            .spawn()
            .expect("run deploy/local/debezium/run");
        (self.starting, self.running) = (Some(child), true);
    }

    /// Starts the worker and waits until its connector streams.
    fn start(&mut self) {
        self.spawn();
        while self.starting.is_some() {
            self.check();
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Panics with the worker's logs when `run start` failed, the JVM exited, or the connector's
    /// task failed.
    fn check(&mut self) {
        if let Some(child) = &mut self.starting {
            match child.try_wait().unwrap() {
                None => return,
                Some(status) if status.success() => self.starting = None,
                Some(_) => panic!("Debezium did not start: {}", self.log_tail("start.err")),
            }
        }
        if self.status_asked.is_some_and(|at| at.elapsed() < Duration::from_secs(1)) {
            return;
        }
        self.status_asked = Some(Instant::now());
        if let Some(pid) = self.pid() {
            let tail = || format!("{}\n{}", self.log_tail("connect.log"), self.log_tail("stdout.log"));
            assert!(cpu_seconds(pid).is_some(), "Kafka Connect exited: {}", tail());
        }
        let Some(port) = self.rest_port() else { return };
        if let Some((_, body)) = http::get(port, "/connectors/outbox/status") {
            assert!(!body.contains("FAILED"), "Debezium's connector failed: {body}");
        }
    }

    fn log_tail(&self, name: &str) -> String {
        let text = std::fs::read_to_string(self.state.path().join(name)).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }

    /// The worker's REST port, from the state directory's `env` (DEBEZIUM_REST).
    fn rest_port(&self) -> Option<u16> {
        let env = std::fs::read_to_string(self.state.path().join("env")).ok()?;
        let url = env.lines().find_map(|l| l.strip_prefix("DEBEZIUM_REST="))?;
        url.rsplit_once(':')?.1.parse().ok()
    }

    /// The Connect JVM's process id (`run start` records it as it launches the JVM).
    fn pid(&self) -> Option<u32> {
        std::fs::read_to_string(self.state.path().join("pid")).ok()?.trim().parse().ok()
    }

    /// (peak RSS in MiB, CPU seconds) of the Connect JVM.
    fn usage(&self) -> (f64, f64) {
        self.pid().map_or((0.0, 0.0), |pid| (peak_rss_mib(pid), cpu_seconds(pid).unwrap_or(0.0)))
    }

    /// `run stop`: SIGTERM (the task flushes its producer and offsets); the slot stays.
    fn stop(&mut self) {
        if let Some(mut child) = self.starting.take() {
            let _ = child.wait();
        }
        if std::mem::take(&mut self.running) {
            let state = self.state.path().to_str().unwrap();
            let out = debezium_run().args(["stop", "--state", state]).output().expect("run stop");
            assert!(out.status.success(), "run stop: {}", String::from_utf8_lossy(&out.stderr));
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A topic `outbox.event.<prefix><random>` of [`PARTITIONS`]; returns (topic, aggregate type).
async fn new_topic(prefix: &str) -> (String, String) {
    let aggregate_type = format!("{prefix}{}", random_suffix());
    let topic = format!("outbox.event.{aggregate_type}");
    create_topic(&topic, PARTITIONS).await;
    (topic, aggregate_type)
}

/// The records in `topic`: its partitions' end offsets (no transactions: no markers).
fn records(consumer: &BaseConsumer, topic: &str) -> f64 {
    (0..PARTITIONS)
        .map(|p| consumer.fetch_watermarks(topic, p, Duration::from_secs(10)).map_or(0, |(_, high)| high))
        .sum::<i64>() as f64
}

fn watermarks() -> BaseConsumer {
    ClientConfig::new().set("bootstrap.servers", &services().kafka).create().unwrap()
}

/// Debezium drains a backlog of `events`: its slot made first (`snapshot.mode=no_data` streams
/// only what is committed after it), the backlog written while it is stopped, then timed from
/// its start until the topic holds every record.
async fn debezium_drain(events: usize, o: &Options) -> Drain {
    let db = backlog_db().await;
    let client = db.client().await;
    let (topic, aggregate_type) = new_topic("d").await;
    let mut worker = Worker::new(&db, &client, o).await;
    worker.start();
    worker.stop();
    client.execute("CALL write_backlog($1, $2)", &[&(events as i32), &aggregate_type]).await.unwrap();
    let started = Instant::now();
    worker.spawn();
    let consumer = watermarks();
    let mut first: Option<(Instant, f64)> = None;
    let mut count = 0.0;
    wait_until_within(DRAIN_LIMIT, "Debezium's drain", async || {
        worker.check();
        count = records(&consumer, &topic);
        if first.is_none() && count >= 1.0 {
            first = Some((Instant::now(), worker.usage().1));
        }
        count >= events as f64
    })
    .await;
    let seconds = started.elapsed().as_secs_f64();
    let (rss_mib, cpu) = worker.usage();
    let rest = events.saturating_sub(1).max(1) as f64;
    let (first_at, first_cpu) = first.unwrap();
    let after_first = rest / first_at.elapsed().as_secs_f64().max(1e-3);
    drop(worker);
    drop(db);
    drop_topic(&topic).await;
    Drain {
        seconds,
        after_first,
        rss_mib,
        cpu_per_100k: cpu * 100_000.0 / events as f64,
        cpu_after_first_per_100k: (cpu - first_cpu) * 100_000.0 / rest,
        markers: count - events as f64,
        ..Drain::default()
    }
}

/// Debezium at `rate` events/s for `duration`, as [`steady_latency`] measures the relay: the
/// same writer and consumer, after a warm-up; its JVM's CPU over the window.
async fn debezium_latency(rate: usize, duration: Duration, o: &Options) -> Latency {
    // start from a quiet server, as steady_latency does
    connect(&services().pg_url).await.batch_execute("CHECKPOINT").await.unwrap();
    let db = TestDb::new().await;
    let client = db.client().await;
    let (topic, aggregate_type) = new_topic("m").await;
    let mut worker = Worker::new(&db, &client, o).await;
    worker.start();
    let consumer = latency_consumer(&topic);
    let counter = watermarks();
    super::write_warm_up(&client, &aggregate_type).await;
    wait_until_within(Duration::from_secs(60), "Debezium's warm-up events", async || {
        worker.check();
        records(&counter, &topic) >= 10.0
    })
    .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let cpu_before = worker.usage().1;
    let received = tokio::spawn(receive_ids(consumer));
    let (committed, achieved) = write_at_rate(&client, &aggregate_type, rate, duration).await;
    let expected = committed.len() * 10;
    // the window's work, without the idle wait for late records after it
    let limit = Instant::now() + Duration::from_secs(30);
    while records(&counter, &topic) < (10 + expected) as f64 && Instant::now() < limit {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (rss_mib, cpu) = worker.usage();
    let at = received.await.unwrap();
    let markers = records(&counter, &topic) - (10 + expected) as f64;
    drop(worker);
    drop(db);
    drop_topic(&topic).await;
    let (received, sustained) = judge_window(&committed, &at, rate, achieved, duration);
    Latency {
        relay_p99_ms: f64::NAN,
        p50_ms: received.p50_ms,
        p99_ms: received.p99_ms,
        max_ms: received.max_ms,
        sustained,
        cpu_per_100k: (cpu - cpu_before) * 100_000.0 / expected.max(1) as f64,
        rss_mib,
        markers,
        threads: Default::default(),
    }
}

/// One row: the measure on both sides and, with `ratio`, relay / Debezium per run.
fn row(name: &str, values: [Vec<f64>; 2], digits: usize, ratio: bool) -> String {
    let [relay, debezium] = &values;
    let ratios = if ratio { stat(&paired(relay, debezium), 3) } else { String::new() };
    format!("| {name} | {} | {} | {ratios} |\n", stat(relay, digits), stat(debezium, digits))
}

/// Each run's relay value over Debezium's of the same run.
fn paired(relay: &[f64], debezium: &[f64]) -> Vec<f64> {
    relay.iter().zip(debezium).map(|(r, d)| r / d).collect()
}

fn drains(cost: &PeerCost, f: impl Fn(&Drain) -> f64) -> [Vec<f64>; 2] {
    cost.sides.each_ref().map(|s| s.drains.iter().map(&f).collect())
}

fn steady(cost: &PeerCost, f: impl Fn(&Latency) -> f64) -> [Vec<f64>; 2] {
    cost.sides.each_ref().map(|s| s.latencies.iter().map(&f).collect())
}

/// The table's rows.
fn rows(events: usize, rate: usize, cost: &PeerCost) -> String {
    let to_first = |d: &Drain| d.seconds - (events.saturating_sub(1)) as f64 / d.after_first;
    let sustained =
        |s: &Side| format!("{}/{}", s.latencies.iter().filter(|l| l.sustained).count(), s.latencies.len());
    let at = format!("at {rate} events/s");
    [
        row("drain from the start, events/s", drains(cost, |d| events as f64 / d.seconds), 0, true),
        row("drain after the first record in Kafka, events/s", drains(cost, |d| d.after_first), 0, true),
        row("drain, start to the first record in Kafka, s", drains(cost, to_first), 2, true),
        row("drain, records in the topic", drains(cost, |d| events as f64 + d.markers), 0, false),
        row("drain, peak RSS, MiB", drains(cost, |d| d.rss_mib), 1, true),
        row("drain, CPU s per 100k events, from the start", drains(cost, |d| d.cpu_per_100k), 2, true),
        row(
            "drain, CPU s per 100k events, after the first record",
            drains(cost, |d| d.cpu_after_first_per_100k),
            2,
            true,
        ),
        row(&format!("commit-to-consumer p50 {at}, ms"), steady(cost, |l| l.p50_ms), 1, true),
        row(&format!("commit-to-consumer p99 {at}, ms"), steady(cost, |l| l.p99_ms), 1, true),
        row(&format!("CPU s per 100k events {at}"), steady(cost, |l| l.cpu_per_100k), 2, true),
        row(&format!("peak RSS {at}, MiB"), steady(cost, |l| l.rss_mib), 1, true),
        format!(
            "| sustained {at} (runs) | {} | {} | |\n",
            sustained(&cost.sides[0]),
            sustained(&cost.sides[1])
        ),
    ]
    .concat()
}

/// Issue 33's goals against the medians of the paired runs: the relay's whole drain against
/// Debezium's from its first record (its JVM and stream start left out, in its favour).
fn goals(events: usize, cost: &PeerCost) -> String {
    let [relay, _] = drains(cost, |d| events as f64 / d.seconds);
    let [_, debezium] = drains(cost, |d| d.after_first);
    let drain = median(&paired(&relay, &debezium));
    let [relay, debezium] = drains(cost, |d| d.rss_mib);
    let memory = median(&paired(&relay, &debezium));
    let [relay, _] = drains(cost, |d| d.cpu_per_100k);
    let [_, debezium] = drains(cost, |d| d.cpu_after_first_per_100k);
    let cpu = median(&paired(&relay, &debezium));
    let goal = |what: &str, measured: String, met: bool| {
        format!("| {what} | {measured} | {} |\n", if met { "met" } else { "**missed**" })
    };
    "\n| goal (issue 33, median of the paired runs) | measured | |\n|---|---|---|\n".to_string()
        + &goal(
            &format!("relay drain from its start >= {DRAIN_GOAL}x Debezium's after its first record"),
            format!("{drain:.2}x"),
            drain >= DRAIN_GOAL,
        )
        + &goal(
            "relay peak RSS draining <= 1/25 of Debezium's",
            format!("1/{:.1}", 1.0 / memory),
            memory <= MEMORY_GOAL,
        )
        + &goal(
            "relay CPU per event draining (from its start) <= 1/10 of Debezium's (after its first record)",
            format!("1/{:.1}", 1.0 / cpu),
            cpu <= CPU_GOAL,
        )
}

/// Both sides' settings, enough to run it again.
fn settings(o: &Options) -> String {
    let heap = std::env::var("OUTBOX_DEBEZIUM_HEAP").unwrap_or_else(|_| "512m".into());
    let jvm = std::env::var("OUTBOX_DEBEZIUM_JVM_OPTS")
        .unwrap_or_else(|_| "-XX:+UseG1GC -XX:MaxGCPauseMillis=20".into());
    let with = |defaults: &[&str], added: &[String]| {
        defaults.iter().map(|s| s.to_string()).chain(added.iter().cloned()).collect::<Vec<_>>().join(", ")
    };
    format!(
        "Debezium: 3.6.1.Final PostgreSQL connector on a Kafka Connect 4.3.0 standalone worker \
         (`deploy/local/debezium/run`), plugin.name=pgoutput, snapshot.mode=no_data, tasks.max=1, {}; \
         the publication made as the relay's (inserts, via the partition root); Debezium's defaults \
         otherwise (max.batch.size=2048, max.queue.size=8192, poll.interval.ms=500 unless listed). \
         Router (io.debezium.transforms.outbox.EventRouter): {}. Worker: {}; otherwise Connect's \
         producer settings (max.in.flight.requests.per.connection=1) and the Java producer's defaults \
         (batch.size=16384) unless listed. Converters: `{CONVERTERS}` (StringConverter key and value). JVM: \
         -Xms128m -Xmx{heap} {jvm}. The relay: its defaults, replication mode (acks=all, idempotent, \
         kafka.linger_ms = 5). Topics of {PARTITIONS} partitions.  \n",
        with(&CONNECTOR, &o.peer_connector),
        ROUTER.join(", "),
        with(&WORKER, &o.peer_worker)
    )
}

/// The section's text (markdown): the machine and settings, the table, the goals.
pub fn render(o: &Options, cost: &PeerCost) -> String {
    let (events, rate) = (events(o), rate(o));
    let mut out = format!("{}  \n{}\n", super::report::machine(), settings(o));
    out += &format!(
        "| measure ({events} events; {rate} events/s for {} s; median of {} runs, min-max) | relay | Debezium | \
         relay / Debezium |\n|---|---|---|---|\n",
        o.duration.as_secs(),
        o.runs
    );
    out + &rows(events, rate, cost) + &goals(events, cost)
}
