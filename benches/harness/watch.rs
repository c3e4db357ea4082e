//! `deploy/local/bench --only watch`: what continuous verification (`verify --watch`) costs
//! while the relay streams at 2,000 events/s (the first `--rates`), issue 34. One relay
//! (replication), two windows of `--duration-secs` each at that rate per run, side by side, the
//! order flipped each run: without the watch, and with one beside it (`--every-secs 10
//! --since 15m`: each pass covers everything written in the run).
//!
//! Measured in each window: the machine's busy CPU seconds (every process: the relay,
//! PostgreSQL, the broker, the watch; `/proc/stat`), the difference being the watch's whole cost;
//! the broker's CPU (its JVM) and the rows PostgreSQL returned (`pg_stat_database.tup_returned`),
//! the load the watch puts on each; the relay's commit-to-ack p99. With the watch: its own CPU
//! seconds and peak RSS, its passes, the last pass's rows, records and duration.

use std::process::Command;
use std::time::Duration;

use super::common::process::RelayProcess;
use super::common::wait_until_within;
use super::common::{TestDb, create_topic, random_suffix};
use super::{
    Options, PARTITIONS, Relay, cpu_seconds, drop_topic, histogram_quantile, peak_rss_mib, relay_config,
    stat, write_at_rate, write_warm_up,
};

/// Seconds between passes and the window each pass covers.
const EVERY_SECS: &str = "10";
const WINDOW: &str = "15m";

#[derive(Default)]
struct Window {
    machine_cpu: f64,
    broker_cpu: f64,
    rows_returned: f64,
    relay_p99_ms: f64,
    events: f64,
}

#[derive(Default)]
struct Watched {
    cpu: f64,
    rss_mib: f64,
    passes: f64,
    rows: f64,
    records: f64,
    pass_seconds: f64,
}

#[derive(Default)]
pub struct WatchCost {
    rate: usize,
    without: Vec<Window>,
    with: Vec<Window>,
    watch: Vec<Watched>,
}

pub async fn run(o: &Options) -> WatchCost {
    let rate = o.rates.first().copied().unwrap_or(2_000);
    let mut cost = WatchCost { rate, ..WatchCost::default() };
    let db = TestDb::new().await;
    let client = db.client().await;
    let aggregate_type = format!("w{}", random_suffix());
    let topic = format!("outbox.event.{aggregate_type}");
    create_topic(&topic, PARTITIONS).await;
    let slot = format!("s_{}", random_suffix());
    let relay = Relay::start_with(&db, "replication", &slot, "", "");
    relay.process.wait_ready("active").await;
    write_warm_up(&client, &aggregate_type).await;
    wait_until_within(Duration::from_secs(60), "the warm-up events", async || relay.published() >= 10.0)
        .await;
    let (dir, config) = relay_config(&db, "replication", &slot, "", "");
    for run in 1..=o.runs {
        for with in if run % 2 == 1 { [false, true] } else { [true, false] } {
            eprintln!(
                "[bench] watch run {run}/{}: {rate} events/s, {} the watch",
                o.runs,
                if with { "with" } else { "without" }
            );
            let mut watch = with.then(|| {
                let log = dir.path().join("watch.log");
                RelayProcess::watch(
                    &config,
                    &log,
                    &["--every-secs", EVERY_SECS, "--since", WINDOW, "--wait-secs", "5"],
                )
            });
            if let Some(watch) = &watch {
                watch.wait_ready("active").await;
            }
            let before = Sample::take(&client, &relay).await;
            let watch_cpu = watch.as_ref().and_then(|w| cpu_seconds(w.pid())).unwrap_or(0.0);
            let passes_before = watch.as_ref().map_or(0.0, passes);
            let (committed, _) = write_at_rate(&client, &aggregate_type, rate, o.duration).await;
            let after = Sample::take(&client, &relay).await;
            let window = Window {
                machine_cpu: after.machine_cpu - before.machine_cpu,
                broker_cpu: after.broker_cpu - before.broker_cpu,
                rows_returned: after.rows_returned - before.rows_returned,
                relay_p99_ms: histogram_quantile(
                    &before.scrape,
                    &after.scrape,
                    "outbox_relay_end_to_end_latency_seconds",
                    0.99,
                ) * 1000.0,
                events: (committed.len() * 10) as f64,
            };
            eprintln!(
                "[bench]   machine CPU {:.1} s, broker {:.1} s, rows returned {:.0}, relay p99 {:.1} ms",
                window.machine_cpu, window.broker_cpu, window.rows_returned, window.relay_p99_ms
            );
            match watch.as_mut() {
                None => cost.without.push(window),
                Some(w) => {
                    let metric = |name: &str| w.metric(name).unwrap_or(0.0);
                    let watched = Watched {
                        cpu: cpu_seconds(w.pid()).unwrap_or(0.0) - watch_cpu,
                        rss_mib: peak_rss_mib(w.pid()),
                        passes: passes(w) - passes_before,
                        rows: metric("outbox_relay_verify_rows"),
                        records: metric("outbox_relay_verify_records"),
                        pass_seconds: metric("outbox_relay_verify_pass_duration_seconds"),
                    };
                    eprintln!(
                        "[bench]   the watch: {:.1} CPU s, peak RSS {:.1} MiB, {} passes, the last {:.0} rows, {:.0} records in {:.2} s",
                        watched.cpu,
                        watched.rss_mib,
                        watched.passes,
                        watched.rows,
                        watched.records,
                        watched.pass_seconds
                    );
                    assert_eq!(metric("outbox_relay_verify_missing_events"), 0.0, "{}", w.log_text());
                    w.terminate(Duration::from_secs(30));
                    cost.with.push(window);
                    cost.watch.push(watched);
                }
            }
        }
    }
    drop(relay);
    drop(db);
    drop_topic(&topic).await;
    cost
}

/// The watch's passes so far, whatever their result.
fn passes(watch: &RelayProcess) -> f64 {
    let scrape = watch.scrape();
    scrape
        .lines()
        .filter(|l| l.starts_with("outbox_relay_verify_passes_total{"))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum()
}

/// What is read before and after a window.
struct Sample {
    machine_cpu: f64,
    broker_cpu: f64,
    rows_returned: f64,
    scrape: String,
}

impl Sample {
    async fn take(client: &tokio_postgres::Client, relay: &Relay) -> Sample {
        let rows: f64 = client
            .query_one("SELECT sum(tup_returned)::float8 FROM pg_stat_database", &[])
            .await
            .unwrap()
            .get(0);
        let scrape = super::common::http::get(relay.process.metrics_port(), "/metrics").map(|(_, b)| b);
        Sample {
            machine_cpu: machine_busy_seconds(),
            broker_cpu: broker_pid().and_then(cpu_seconds).unwrap_or(0.0),
            rows_returned: rows,
            scrape: scrape.unwrap_or_default(),
        }
    }
}

/// Busy CPU seconds of the whole machine since boot (`/proc/stat`: all but idle and iowait, at
/// 100 ticks a second).
fn machine_busy_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let ticks: Vec<f64> = stat
        .lines()
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .skip(1)
        .filter_map(|t| t.parse().ok())
        .collect();
    let total: f64 = ticks.iter().take(8).sum();
    let idle = ticks.get(3).copied().unwrap_or(0.0) + ticks.get(4).copied().unwrap_or(0.0);
    (total - idle) / 100.0
}

/// The broker's JVM (the bench runs one).
fn broker_pid() -> Option<u32> {
    let out = Command::new("pgrep").args(["-f", "kafka.Kafka"]).output().ok()?;
    String::from_utf8_lossy(&out.stdout).lines().next()?.trim().parse().ok()
}

pub fn render(o: &Options, c: &WatchCost) -> String {
    let w = |f: fn(&Window) -> f64, v: &[Window]| v.iter().map(f).collect::<Vec<_>>();
    let watched = |f: fn(&Watched) -> f64| c.watch.iter().map(f).collect::<Vec<_>>();
    let per = |f: fn(&Window) -> f64, v: &[Window]| {
        v.iter().map(|x| f(x) / o.duration.as_secs_f64()).collect::<Vec<_>>()
    };
    let machine_extra: Vec<f64> = c
        .with
        .iter()
        .zip(&c.without)
        .map(|(a, b)| (a.machine_cpu - b.machine_cpu) / o.duration.as_secs_f64())
        .collect();
    let load_extra: Vec<f64> = c
        .with
        .iter()
        .zip(&c.without)
        .zip(&c.watch)
        .map(|((a, b), x)| (a.machine_cpu - b.machine_cpu - x.cpu) / o.duration.as_secs_f64())
        .collect();
    let mut out = format!(
        "Command: `deploy/local/bench --only watch --runs {} --duration-secs {}`\n\n{}  \n\
         The relay (replication, its defaults) at {} events/s (transactions of 10 events, ~200-byte payloads), \
         windows of {} s; the watch: `verify --watch --every-secs {EVERY_SECS} --since {WINDOW} --wait-secs 5`. \
         Median of {} runs (min-max); CPU in cores (CPU seconds per second of the window).\n\n\
         | measure | without the watch | with the watch |\n|---|---|---|\n",
        o.runs,
        o.duration.as_secs(),
        super::report::machine(),
        c.rate,
        o.duration.as_secs(),
        o.runs
    );
    out += &format!(
        "| machine CPU, cores (relay + PostgreSQL + broker + watch) | {} | {} |\n",
        stat(&per(|x| x.machine_cpu, &c.without), 3),
        stat(&per(|x| x.machine_cpu, &c.with), 3)
    );
    out += &format!(
        "| broker CPU, cores | {} | {} |\n",
        stat(&per(|x| x.broker_cpu, &c.without), 3),
        stat(&per(|x| x.broker_cpu, &c.with), 3)
    );
    out += &format!(
        "| PostgreSQL rows returned per second (all sessions) | {} | {} |\n",
        stat(&per(|x| x.rows_returned, &c.without), 0),
        stat(&per(|x| x.rows_returned, &c.with), 0)
    );
    out += &format!(
        "| relay commit-to-ack p99, ms | {} | {} |\n",
        stat(&w(|x| x.relay_p99_ms, &c.without), 1),
        stat(&w(|x| x.relay_p99_ms, &c.with), 1)
    );
    out += &format!(
        "| events written per window | {} | {} |\n",
        stat(&w(|x| x.events, &c.without), 0),
        stat(&w(|x| x.events, &c.with), 0)
    );
    out += "\n| the watch | value |\n|---|---|\n";
    let own: Vec<f64> = watched(|x| x.cpu).iter().map(|cpu| cpu / o.duration.as_secs_f64()).collect();
    out += &format!("| its own CPU, cores | {} |\n", stat(&own, 3));
    out += &format!("| its peak RSS, MiB | {} |\n", stat(&watched(|x| x.rss_mib), 1));
    out += &format!("| passes per window | {} |\n", stat(&watched(|x| x.passes), 0));
    out += &format!("| the last pass: rows compared | {} |\n", stat(&watched(|x| x.rows), 0));
    out += &format!("| the last pass: records read | {} |\n", stat(&watched(|x| x.records), 0));
    out += &format!("| the last pass: seconds | {} |\n", stat(&watched(|x| x.pass_seconds), 2));
    out += &format!("| the machine's extra CPU with the watch, cores | {} |\n", stat(&machine_extra, 3));
    out += &format!(
        "| of it, outside the watch's process (PostgreSQL, broker, relay), cores | {} |\n",
        stat(&load_extra, 3)
    );
    out
}
