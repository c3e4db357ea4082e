//! The cost of exactly once (docs/guarantees.md, "Exactly once for plain consumers"), measured side by side:
//! - backlog drain throughput with the relay's headers and read-back on, and with both off
//!   (`kafka.source_headers = false`, `dedup.enabled = false`), in both modes, alternating;
//! - restart time to the first event when the read-back covers 100 partitions: a relay drains
//!   20,000 events over 1,000 aggregates into a 100-partition topic and is killed (SIGKILL);
//!   1,000 more events are written, and a new relay is started: the time from its start to the
//!   first acknowledged record, on and off (on: it first reads every partition back), once the
//!   killed relay's walsender has ended.
//!
//! `deploy/local/bench --only dedup` runs this alone and writes its section of BENCHMARKS.md.

use std::path::Path;
use std::time::Instant;

use super::common::{create_topic, random_suffix, wait_until_within};
use super::{
    Backlog, DRAIN_LIMIT, Drain, Options, PARTITIONS, Relay, backlog_db, confirmed, drop_topic, end_offsets,
    slot_backlog, stat, timed_drain, wal_lsn,
};

/// The `[kafka]` and other lines that turn headers and read-back off.
const OFF: (&str, &str) = ("source_headers = false", "[dedup]\nenabled = false\n");
const RESTART_PARTITIONS: i32 = 100;
const RESTART_BACKLOG: i32 = 20_000;

#[derive(Default)]
pub struct DedupCost {
    /// Drain rates, events/s: (on, off) per mode.
    replication: (Vec<f64>, Vec<f64>),
    polling: (Vec<f64>, Vec<f64>),
    /// Seconds from start to the first acknowledged record after a kill: (on, off).
    restart: (Vec<f64>, Vec<f64>),
    /// Records the restarted relay read back (on).
    read_back: Vec<f64>,
}

fn settings(on: bool) -> (&'static str, &'static str) {
    if on { ("", "") } else { OFF }
}

/// One backlog drain of `events` in `mode`; events/s.
async fn drain(mode: &'static str, events: usize, on: bool) -> f64 {
    let (kafka, extra) = settings(on);
    let drain = drain_with(mode, events, kafka, extra, async |_| {}).await;
    events as f64 / drain.seconds
}

/// One backlog drain of `events` in `mode` with `kafka`/`extra` settings, after `prepare` ran on
/// the backlog's database; its topic is deleted after it.
pub(super) async fn drain_with(
    mode: &'static str,
    events: usize,
    kafka: &str,
    extra: &str,
    prepare: impl AsyncFnOnce(&tokio_postgres::Client),
) -> Drain {
    let db = backlog_db().await;
    let client = db.client().await;
    prepare(&client).await;
    let aggregate_type = format!("c{}", random_suffix());
    let topic = format!("outbox.event.{aggregate_type}");
    create_topic(&topic, PARTITIONS).await;
    let slot = format!("s_{}", random_suffix());
    if mode == "replication" {
        Relay::setup(&db, &slot);
    }
    client.execute("CALL write_backlog($1, $2)", &[&(events as i32), &aggregate_type]).await.unwrap();
    let end = wal_lsn(&client).await;
    let started = Instant::now();
    let relay = Relay::start_with(&db, mode, &slot, kafka, extra);
    let mut drain = timed_drain(&relay, events, started, &format!("the {mode} drain"), async |published| {
        published >= events as f64 && (mode == "polling" || confirmed(&client, &slot).await >= end)
    })
    .await;
    drain.markers = end_offsets(&topic) - events as f64;
    drop(relay);
    drop(db);
    drop_topic(&topic).await;
    drain
}

/// Seconds from a restarted relay's start to its first acknowledged record, after a kill, with
/// 100 partitions to read back; and the records it read back.
async fn restart(on: bool) -> (f64, f64) {
    let Backlog { db, client, slot, aggregate_type, end } =
        slot_backlog(RESTART_PARTITIONS, RESTART_BACKLOG as usize, None, None).await;
    let (kafka, extra) = settings(on);
    let mut first = Relay::start_with(&db, "replication", &slot, kafka, extra);
    wait_until_within(DRAIN_LIMIT, "the first drain", async || {
        first.published() >= f64::from(RESTART_BACKLOG) && confirmed(&client, &slot).await >= end
    })
    .await;
    first.process.kill9();
    // (the restart is timed from a free slot: the server noticing the killed walsender is not
    // the relay's cost)
    let active = "SELECT active FROM pg_replication_slots WHERE slot_name = $1";
    wait_until_within(DRAIN_LIMIT, "the killed relay's walsender to end", async || {
        !client.query_one(active, &[&slot]).await.unwrap().get::<_, bool>(0)
    })
    .await;
    client.execute("CALL write_backlog($1, $2)", &[&1_000i32, &aggregate_type]).await.unwrap();
    let started = Instant::now();
    let second = Relay::start_with(&db, "replication", &slot, kafka, extra);
    wait_until_within(DRAIN_LIMIT, "the first event after the restart", async || second.published() >= 1.0)
        .await;
    let seconds = started.elapsed().as_secs_f64();
    let read_back = second.process.metric("outbox_relay_dedup_scanned_records_total").unwrap_or(0.0);
    (seconds, read_back)
}

/// Every measurement `o.runs` times, on and off alternating.
pub async fn run(o: &Options) -> DedupCost {
    let mut cost = DedupCost::default();
    for run in 1..=o.runs {
        for on in [true, false] {
            let label = if on { "on" } else { "off" };
            eprintln!("[bench] dedup run {run}/{}: headers and read-back {label}", o.runs);
            let (replication, polling) =
                (drain("replication", o.events, on).await, drain("polling", o.events, on).await);
            let (seconds, read_back) = restart(on).await;
            eprintln!(
                "[bench]   replication {replication:.0}/s, polling {polling:.0}/s, restart to first event {seconds:.2} s \
                 ({read_back} records read back)"
            );
            let pick = |pair: &mut (Vec<f64>, Vec<f64>), value: f64| {
                if on { pair.0.push(value) } else { pair.1.push(value) }
            };
            pick(&mut cost.replication, replication);
            pick(&mut cost.polling, polling);
            pick(&mut cost.restart, seconds);
            if on {
                cost.read_back.push(read_back);
            }
        }
    }
    cost
}

/// The section's table (markdown).
pub fn render(o: &Options, cost: &DedupCost) -> String {
    let mut table = drain_rows(o, ("on", "off"), &cost.replication, &cost.polling);
    table += &format!(
        "| restart to first event after SIGKILL, {RESTART_PARTITIONS} partitions, s | {} | {} | {} |\n",
        stat(&cost.restart.0, 2),
        stat(&cost.restart.1, 2),
        stat(&ratio(&cost.restart), 2)
    );
    table += &format!("| records read back at that restart | {} | 0 | |\n", stat(&cost.read_back, 0));
    table
}

/// The ratio of each pair of runs (on / off).
fn ratio((on, off): &(Vec<f64>, Vec<f64>)) -> Vec<f64> {
    on.iter().zip(off).map(|(a, b)| a / b).collect()
}

/// A table's header and its drain rows: events/s in both modes, each side of `labels` and
/// their ratio.
pub(super) fn drain_rows(
    o: &Options,
    (on, off): (&str, &str),
    replication: &(Vec<f64>, Vec<f64>),
    polling: &(Vec<f64>, Vec<f64>),
) -> String {
    let mut table = format!(
        "| measure ({} events, median of {} runs, min-max) | {on} | {off} | {on} / {off} |\n|---|---|---|---|\n",
        o.events, o.runs
    );
    for (name, pair) in [("replication drain, events/s", replication), ("polling drain, events/s", polling)] {
        table += &format!(
            "| {name} | {} | {} | {} |\n",
            stat(&pair.0, 0),
            stat(&pair.1, 0),
            stat(&ratio(pair), 3)
        );
    }
    table
}

/// Replaces the section between `<!-- NAME -->` and `<!-- /NAME -->` of `out`.
pub fn write_section(out: &str, name: &str, table: &str) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(out);
    let text = std::fs::read_to_string(&path).unwrap_or_default();
    let (open, close) = (format!("<!-- {name} -->"), format!("<!-- /{name} -->"));
    let (open, close) = (open.as_str(), close.as_str());
    let args: Vec<String> = std::env::args().skip(1).filter(|a| a != "--bench").collect();
    let section = format!("{open}\nCommand: `deploy/local/bench {}`\n\n{table}{close}", args.join(" "));
    let updated = match (text.find(open), text.find(close)) {
        (Some(start), Some(end)) => format!("{}{section}{}", &text[..start], &text[end + close.len()..]),
        _ => format!("{text}\n{section}\n"),
    };
    std::fs::write(&path, updated).unwrap();
    eprintln!("[bench] wrote the {name} section of {}", path.display());
}
