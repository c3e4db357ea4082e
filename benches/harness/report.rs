//! The main measurement ([`run`]) and its report ([`render`], [`write_report`]): the backlog
//! drains at three sizes against `pg_recvlogical`, the plain producer, the polling drain, the
//! steady-state latency, and issue 33's goals as met or missed with the measured ratio.

use std::collections::HashMap;
use std::path::Path;

use outbox_relay::config::{
    DEFAULT_KAFKA_COMPRESSION, DEFAULT_KAFKA_LINGER_MS, DEFAULT_MAX_BATCH_BYTES, DEFAULT_MAX_IN_FLIGHT_BYTES,
    DEFAULT_MAX_IN_FLIGHT_EVENTS, DEFAULT_POLL_BATCH_SIZE, DEFAULT_STATUS_INTERVAL_MS,
};

use super::{
    Drain, Latency, Options, PARTITIONS, polling_drain, producer_limit, replication_drain, stat,
    steady_latency,
};

/// The backlog earlier reports measured, drained again for comparison.
pub const HISTORY_EVENTS: usize = 200_000;

/// Every run's measurements.
#[derive(Default)]
pub struct Results {
    /// Replication drains of the whole backlog, with `pg_recvlogical`'s seconds on the same WAL.
    replication: Vec<(Drain, f64)>,
    /// The same at [`HISTORY_EVENTS`] (when the backlog is another size).
    history: Vec<(Drain, f64)>,
    /// The plain producer sending the same records, seconds.
    producer: Vec<f64>,
    polling: Vec<Drain>,
    /// Replication drains of a tenth of the backlog (for memory growth).
    small: Vec<Drain>,
    latency: HashMap<usize, Vec<Latency>>,
}

/// Runs every measurement `o.runs` times.
pub async fn run(o: &Options) -> Results {
    let mut results = Results::default();
    for run in 1..=o.runs {
        let mut sizes = vec![o.events];
        if o.events != HISTORY_EVENTS {
            sizes.push(HISTORY_EVENTS);
        }
        for events in sizes {
            eprintln!(
                "[bench] run {run}/{}: replication drain of {events} events (+ pg_recvlogical)",
                o.runs
            );
            let (d, r) = replication_drain(events, None, true).await;
            let r = r.expect("pg_recvlogical ran");
            eprintln!(
                "[bench]   relay {:.1}s ({:.0}/s after the first event), pg_recvlogical {r:.1}s, peak RSS {:.1} MiB, CPU {:.2} s/100k",
                d.seconds, d.after_first, d.rss_mib, d.cpu_per_100k
            );
            if events == o.events { &mut results.replication } else { &mut results.history }.push((d, r));
        }
        eprintln!("[bench] run {run}: plain producer");
        results.producer.push(producer_limit(o.events, None).await);
        eprintln!("[bench] run {run}: polling drain of {} events", o.events);
        let p = polling_drain(o.events).await;
        eprintln!(
            "[bench]   relay {:.1}s, peak RSS {:.1} MiB, CPU {:.2} s/100k",
            p.seconds, p.rss_mib, p.cpu_per_100k
        );
        results.polling.push(p);
        eprintln!(
            "[bench] run {run}: replication drain of {} events (memory at a tenth of the backlog)",
            o.events / 10
        );
        results.small.push(replication_drain(o.events / 10, None, false).await.0);
        for &rate in &o.rates {
            eprintln!("[bench] run {run}: steady state at {rate} events/s for {:?}", o.duration);
            let l = steady_latency(rate, o.duration).await;
            eprintln!(
                "[bench]   p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms, relay-side p99 {:.1} ms, sustained {}",
                l.p50_ms, l.p99_ms, l.max_ms, l.relay_p99_ms, l.sustained
            );
            results.latency.entry(rate).or_default().push(l);
        }
    }
    results
}

pub(super) fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

fn ratio(a: &[f64], b: &[f64]) -> Vec<f64> {
    a.iter().zip(b).map(|(x, y)| x / y).collect()
}

/// The drain table of one backlog size: the relay against `pg_recvlogical` on the same WAL.
fn drain_rows(events: usize, drains: &[(Drain, f64)]) -> String {
    let n = events as f64;
    let relay: Vec<f64> = drains.iter().map(|(d, _)| n / d.seconds).collect();
    let steady: Vec<f64> = drains.iter().map(|(d, _)| d.after_first).collect();
    let recv: Vec<f64> = drains.iter().map(|(_, r)| n / r).collect();
    let field = |f: fn(&Drain) -> f64| drains.iter().map(|(d, _)| f(d)).collect::<Vec<_>>();
    format!(
        "| replication drain of {events}, events/s | {} |\n\
         | replication drain of {events} after the first event, events/s | {} |\n\
         | pg_recvlogical on the same WAL, events/s | {} |\n\
         | replication / pg_recvlogical, {events} | {} |\n\
         | relay CPU s per 100k events, replication, {events} | {} |\n\
         | relay peak RSS, replication, {events}, MiB | {} |\n",
        stat(&relay, 0),
        stat(&steady, 0),
        stat(&recv, 0),
        stat(&ratio(&relay, &recv), 2),
        stat(&field(|d| d.cpu_per_100k), 2),
        stat(&field(|d| d.rss_mib), 1),
    )
}

/// One target: what, the measured median, and whether it was met.
fn target(what: &str, measured: f64, digits: usize, met: bool) -> String {
    format!("| {what} | {measured:.digits$} | {} |\n", if met { "met" } else { "**missed**" })
}

/// The results tables (markdown), as printed and written to BENCHMARKS.md.
pub fn render(o: &Options, r: &Results) -> String {
    let n = o.events as f64;
    let mut out = format!("| measure (median of {} runs, min-max) | value |\n|---|---|\n", o.runs);
    out += &drain_rows(o.events, &r.replication);
    if !r.history.is_empty() {
        out += &drain_rows(HISTORY_EVENTS, &r.history);
    }
    let repl_rate: Vec<f64> = r.replication.iter().map(|(d, _)| n / d.seconds).collect();
    let prod_rate: Vec<f64> = r.producer.iter().map(|s| n / s).collect();
    let poll_rate: Vec<f64> = r.polling.iter().map(|d| n / d.seconds).collect();
    let poll = |f: fn(&Drain) -> f64| r.polling.iter().map(f).collect::<Vec<_>>();
    let repl_rss: Vec<f64> = r.replication.iter().map(|(d, _)| d.rss_mib).collect();
    let small_rss: Vec<f64> = r.small.iter().map(|d| d.rss_mib).collect();
    out += &format!("| plain rdkafka producer, same records, events/s | {} |\n", stat(&prod_rate, 0));
    out += &format!("| replication / plain producer | {} |\n", stat(&ratio(&repl_rate, &prod_rate), 2));
    out += &format!("| polling drain of {}, events/s | {} |\n", o.events, stat(&poll_rate, 0));
    out += &format!(
        "| polling drain after the first event, events/s | {} |\n",
        stat(&poll(|d| d.after_first), 0)
    );
    out += &format!("| polling / replication | {} |\n", stat(&ratio(&poll_rate, &repl_rate), 2));
    out += &format!("| relay CPU s per 100k events, polling | {} |\n", stat(&poll(|d| d.cpu_per_100k), 2));
    out += &format!("| relay peak RSS, polling, MiB | {} |\n", stat(&poll(|d| d.rss_mib), 1));
    out += &format!("| relay peak RSS, replication, {}, MiB | {} |\n", o.events / 10, stat(&small_rss, 1));
    out += &format!(
        "| peak RSS growth, {} to {} | {} |\n",
        o.events / 10,
        o.events,
        stat(&ratio(&repl_rss, &small_rss), 2)
    );
    out += &latency_table(o, r);
    out += &targets(o, r);
    out
}

fn latency_table(o: &Options, r: &Results) -> String {
    let mut out = "\n| steady rate (events/s, replication) | p50 ms | p99 ms | max ms | relay-side p99 ms (histogram) | sustained (runs) |\n|---|---|---|---|---|---|\n".to_string();
    for &rate in &o.rates {
        let ls = &r.latency[&rate];
        let field = |f: fn(&Latency) -> f64| ls.iter().map(f).collect::<Vec<_>>();
        out += &format!(
            "| {rate} | {} | {} | {} | {} | {}/{} |\n",
            stat(&field(|l| l.p50_ms), 1),
            stat(&field(|l| l.p99_ms), 1),
            stat(&field(|l| l.max_ms), 1),
            stat(&field(|l| l.relay_p99_ms), 1),
            ls.iter().filter(|l| l.sustained).count(),
            ls.len()
        );
    }
    out
}

/// Issue 33's goals against the medians of this run (a goal whose measurement did not run is
/// left out). The floor's multiple (`--only floor`) and the peer's ratios (`--peer debezium`)
/// have their own sections.
fn targets(o: &Options, r: &Results) -> String {
    let n = o.events as f64;
    let repl = median(&r.replication.iter().map(|(d, _)| n / d.seconds).collect::<Vec<_>>());
    let repl_ratio = median(&ratio(
        &r.replication.iter().map(|(d, _)| n / d.seconds).collect::<Vec<_>>(),
        &r.replication.iter().map(|(_, s)| n / s).collect::<Vec<_>>(),
    ));
    let poll = median(&r.polling.iter().map(|d| n / d.seconds).collect::<Vec<_>>());
    let repl_cpu = median(&r.replication.iter().map(|(d, _)| d.cpu_per_100k).collect::<Vec<_>>());
    let poll_cpu = median(&r.polling.iter().map(|d| d.cpu_per_100k).collect::<Vec<_>>());
    let rss = median(&r.replication.iter().map(|(d, _)| d.rss_mib).collect::<Vec<_>>());
    let growth = median(&ratio(
        &r.replication.iter().map(|(d, _)| d.rss_mib).collect::<Vec<_>>(),
        &r.small.iter().map(|d| d.rss_mib).collect::<Vec<_>>(),
    ));
    let mut out = "\n| goal (issue 33, medians of this run) | measured | |\n|---|---|---|\n".to_string();
    out += &target(
        &format!("replication drain of {} >= 1.2x pg_recvlogical", o.events),
        repl_ratio,
        2,
        repl_ratio >= 1.2,
    );
    out += &target("relay CPU s per 100k events, replication <= 0.35", repl_cpu, 2, repl_cpu <= 0.35);
    out += &target("relay CPU s per 100k events, polling <= 0.35", poll_cpu, 2, poll_cpu <= 0.35);
    out += &target(
        &format!("polling drain of {} >= 0.6x replication", o.events),
        poll / repl,
        2,
        poll / repl >= 0.6,
    );
    for (rate, limit) in [(2_000, 25.0), (10_000, 50.0)] {
        if let Some(ls) = r.latency.get(&rate) {
            // commit-to-ack is the relay's own histogram (commit time to acknowledgement);
            // commit-to-consumer adds the consumer's fetch, an upper bound of it
            let relay = median(&ls.iter().map(|l| l.relay_p99_ms).collect::<Vec<_>>());
            out += &target(
                &format!("commit-to-ack p99 at {rate} events/s < {limit} ms"),
                relay,
                1,
                relay < limit,
            );
            let p99 = median(&ls.iter().map(|l| l.p99_ms).collect::<Vec<_>>());
            let what = format!("(stricter) commit-to-consumer p99 at {rate} events/s < {limit} ms");
            out += &target(&what, p99, 1, p99 < limit);
        }
    }
    out += &target(&format!("peak RSS at {} < 40 MiB (default settings)", o.events), rss, 1, rss < 40.0);
    out += &target(
        &format!("peak RSS growth {} to {} < 1.2x", o.events / 10, o.events),
        growth,
        2,
        growth < 1.2,
    );
    out
}

/// The settings every drain ran with: the relay's defaults, which the harness does not change.
fn settings() -> String {
    format!(
        "Relay settings: the defaults (replication.max_in_flight_events = {DEFAULT_MAX_IN_FLIGHT_EVENTS}, \
         replication.max_in_flight_bytes = {} MiB, replication.status_interval_ms = {DEFAULT_STATUS_INTERVAL_MS}, \
         polling.batch_size = {DEFAULT_POLL_BATCH_SIZE}, polling.max_batch_bytes = {} MiB, kafka.linger_ms = \
         {DEFAULT_KAFKA_LINGER_MS}, kafka.compression = {DEFAULT_KAFKA_COMPRESSION}, dedup on, source headers on), \
         logging at warn; topics of {PARTITIONS} partitions; the backlog: 10 events per transaction, ~200-byte \
         JSON payloads, 1,000 aggregates.",
        DEFAULT_MAX_IN_FLIGHT_BYTES >> 20,
        DEFAULT_MAX_BATCH_BYTES >> 20,
    )
}

/// The machine and the versions, for every report.
pub fn machine() -> String {
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0);
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_default();
    let (_, librdkafka) = rdkafka::util::get_rdkafka_version();
    let pg = std::env::var("PG_MAJOR").unwrap_or_else(|_| "?".into());
    format!(
        "Machine: {cores} cores, {cpu}; PostgreSQL {pg}, Apache Kafka 4.4.0 (one KRaft node, 512 MiB heap), librdkafka {librdkafka}, release build."
    )
}

/// Replaces the results section (from the `<!-- bench-results -->` marker to
/// `<!-- /bench-results -->`, or to the end without it) of the file
/// `out` with `table`, the command, the machine and the settings.
pub fn write_report(out: &str, table: &str) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(out);
    let previous = std::fs::read_to_string(&path).unwrap_or_default();
    let (marker, close) = ("<!-- bench-results -->", "<!-- /bench-results -->");
    let head = previous.split(marker).next().unwrap_or("").to_string();
    // (the sections after the results, written by --only runs, stay)
    let tail = previous.split_once(close).map_or(String::new(), |(_, tail)| format!("\n{close}{tail}"));
    let args: Vec<String> = std::env::args().skip(1).filter(|a| a != "--bench").collect();
    let stamp = format!(
        "{marker}\n## Latest results\n\nCommand: `deploy/local/bench {}`  \n{}  \n{}\n\n{table}",
        args.join(" "),
        machine(),
        settings(),
    );
    std::fs::write(&path, format!("{head}{stamp}{tail}")).unwrap();
    eprintln!("[bench] wrote {}", path.display());
}
