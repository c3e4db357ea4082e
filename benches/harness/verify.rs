//! What `outbox-relay verify` costs on a day of events: a replication relay publishes a backlog
//! (`--events`, 1,000,000 for this section unless given) into a topic of 8 partitions and
//! stops; then `verify` (the release build the bench runs) compares the whole table with the
//! topic, `--runs` times. Reported: wall time, verify's own CPU and peak RSS (from `wait4`),
//! and its report's `memory_bytes` (the row entries it holds).
//!
//! `deploy/local/bench --only verify` runs this alone and writes its section of BENCHMARKS.md.

use std::process::{Command, Stdio};
use std::time::Instant;

use super::common::{relay_bin, wait_until_within};
use super::{Backlog, DRAIN_LIMIT, Options, PARTITIONS, Relay, confirmed, relay_config, slot_backlog, stat};

/// One verify run: seconds, CPU seconds, peak RSS in MiB, row-entry MiB, rows, records.
pub struct VerifyRun {
    seconds: f64,
    cpu: f64,
    peak_mib: f64,
    entries_mib: f64,
    rows: u64,
    records: u64,
}

pub async fn run(o: &Options) -> (usize, Vec<VerifyRun>) {
    let events = if o.events_given { o.events } else { 1_000_000 };
    eprintln!("[bench] verify: writing {events} events");
    let Backlog { db, client, slot, end, .. } = slot_backlog(PARTITIONS, events, None, None).await;
    let mut relay = Relay::start(&db, "replication", &slot);
    wait_until_within(DRAIN_LIMIT, "the drain", async || {
        relay.published() >= events as f64 && confirmed(&client, &slot).await >= end
    })
    .await;
    relay.process.terminate(std::time::Duration::from_secs(60));
    let (_dir, config) = relay_config(&db, "replication", &slot, "", "");
    let mut runs = Vec::new();
    for run in 1..=o.runs {
        let result = verify_once(config.to_str().unwrap());
        eprintln!(
            "[bench] verify run {run}/{}: {:.1} s, {:.1} s CPU, peak RSS {:.0} MiB, {} rows, {} records",
            o.runs, result.seconds, result.cpu, result.peak_mib, result.rows, result.records
        );
        assert_eq!(result.rows, events as u64, "verify saw another number of rows");
        runs.push(result);
    }
    (events, runs)
}

/// Runs `outbox-relay verify --format json` to the end, timing it and reading its rusage.
fn verify_once(config: &str) -> VerifyRun {
    let started = Instant::now();
    // waited for with wait4 below, for its rusage
    #[allow(clippy::zombie_processes)]
    let child = Command::new(relay_bin())
        .args(["--log-level", "warn", "verify", "--config", config, "--format", "json", "--wait-secs", "5"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id() as libc::pid_t;
    let reader = std::thread::spawn(move || {
        let mut out = String::new();
        std::io::Read::read_to_string(&mut child.stdout.unwrap(), &mut out).unwrap();
        out
    });
    let mut status = 0;
    // SAFETY: a plain wait4 on our own child with valid out-pointers
    let usage = unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        assert_eq!(libc::wait4(pid, &mut status, 0, &mut usage), pid);
        usage
    };
    let seconds = started.elapsed().as_secs_f64();
    let report: serde_json::Value = serde_json::from_str(&reader.join().unwrap()).unwrap();
    assert_eq!(libc::WEXITSTATUS(status), 0, "verify found something: {report}");
    let time = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    VerifyRun {
        seconds,
        cpu: time(usage.ru_utime) + time(usage.ru_stime),
        peak_mib: usage.ru_maxrss as f64 / 1024.0,
        entries_mib: report["memory_bytes"].as_f64().unwrap() / 1_048_576.0,
        rows: report["rows"].as_u64().unwrap(),
        records: report["records"].as_u64().unwrap(),
    }
}

/// The section's table (markdown).
pub fn render(o: &Options, events: usize, runs: &[VerifyRun]) -> String {
    let column = |f: fn(&VerifyRun) -> f64| runs.iter().map(f).collect::<Vec<_>>();
    let mut table = format!(
        "| `verify` over {events} events in {PARTITIONS} partitions (median of {} runs, min-max) | value |\n|---|---|\n",
        o.runs
    );
    for (name, values, digits) in [
        ("wall time, s", column(|r| r.seconds), 1),
        ("CPU, s", column(|r| r.cpu), 1),
        ("peak RSS, MiB", column(|r| r.peak_mib), 0),
        ("row entries held, MiB", column(|r| r.entries_mib), 1),
        ("events verified per second", column(|r| r.rows as f64 / r.seconds), 0),
    ] {
        table += &format!("| {name} | {} |\n", stat(&values, digits));
    }
    table
}
