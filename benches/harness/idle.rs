//! `deploy/local/bench --only idle`: what a relay costs when nothing happens, and at a low rate
//! (issue 51). Per mode, an active relay and its standby at the defaults (nothing set beyond the
//! connection and the mode), after ten warm-up events, left alone for `--duration-secs` (default
//! 60): their CPU seconds per minute, their threads' wake-ups per second (context switches, by
//! thread name), the CPU of the PostgreSQL backends serving them, and the WAL written meanwhile.
//! Then a writer at 2,000 events/s for 50 s against an active relay: CPU seconds per 100k
//! events. With `--baseline PATH` another build is measured the same way in the same run, the
//! order flipped each run.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use super::common::process::RelayProcess;
use super::common::{self, RelayToml, TestDb, connect, random_suffix, services};
use super::latency::{steady_latency_in, write_warm_up};
use super::{Options, cpu_seconds, stat, use_relay_bin, wal_lsn};

const MODES: [&str; 2] = ["replication", "polling"];
/// The low rate of the goal (2 CPU s per 100k events at most).
const LOW_RATE: usize = 2_000;
const LOW_RATE_WINDOW: Duration = Duration::from_secs(50);
/// The least CPU (s per 100k events) of a thread the low rate's table names.
const SHOWN_THREAD_CPU: f64 = 0.005;

/// One mode's quiet window.
#[derive(Clone, Default)]
struct Quiet {
    /// CPU seconds per minute: the active relay, the standby, the backends serving both.
    active: f64,
    standby: f64,
    backends: f64,
    /// WAL bytes written per minute while nothing was published.
    wal_per_min: f64,
    /// Wake-ups per second of the active relay, by thread name (digits dropped).
    wakeups: BTreeMap<String, f64>,
    /// CPU seconds per 100k events at [`LOW_RATE`].
    low_rate_cpu: f64,
    /// The same by thread name, with each thread's wake-ups per second.
    low_rate_threads: BTreeMap<String, (f64, f64)>,
}

/// Each build's windows: `[mode][run]`.
pub struct Runs {
    builds: Vec<(String, [Vec<Quiet>; 2])>,
    window: Duration,
}

pub async fn run(o: &Options) -> Runs {
    let window = o.duration;
    let mut builds: Vec<(String, Option<PathBuf>)> = vec![("this build".into(), None)];
    if let Some(baseline) = &o.baseline {
        assert!(baseline.is_file(), "--baseline {}: no such file", baseline.display());
        builds.insert(0, ("baseline".into(), Some(baseline.clone())));
    }
    let mut runs =
        Runs { builds: builds.iter().map(|(n, _)| (n.clone(), Default::default())).collect(), window };
    for run in 0..o.runs {
        for b in (0..builds.len()).map(|k| (k + run) % builds.len()) {
            use_relay_bin(builds[b].1.clone());
            for (m, mode) in MODES.iter().enumerate() {
                eprintln!(
                    "[bench] run {}/{}: {}, {mode}: idle for {} s",
                    run + 1,
                    o.runs,
                    builds[b].0,
                    window.as_secs()
                );
                let mut quiet = quiet_window(mode, window).await;
                eprintln!("[bench] run {}/{}: {}, {mode}: {LOW_RATE} events/s", run + 1, o.runs, builds[b].0);
                let low = steady_latency_in(mode, "", LOW_RATE, LOW_RATE_WINDOW).await;
                quiet.low_rate_cpu = low.cpu_per_100k;
                quiet.low_rate_threads = low.threads;
                eprintln!(
                    "[bench]   idle CPU s/min: active {:.3}, standby {:.3}, backends {:.3}; WAL {:.0} B/min; \
                     {LOW_RATE}/s: {:.2} CPU s/100k",
                    quiet.active, quiet.standby, quiet.backends, quiet.wal_per_min, quiet.low_rate_cpu
                );
                eprintln!("[bench]   {LOW_RATE}/s by thread: {}", by_cpu(&quiet.low_rate_threads, 0.0));
                runs.builds[b].1[m].push(quiet);
            }
        }
    }
    use_relay_bin(None);
    runs
}

/// An active relay and a standby in `mode` on a fresh database, at the defaults, measured over
/// `window` of nothing to publish.
async fn quiet_window(mode: &'static str, window: Duration) -> Quiet {
    let db = TestDb::new().await;
    let client = db.client().await;
    let slot = format!("s_{}", random_suffix());
    let aggregate_type = format!("i{}", random_suffix());
    let dir = tempfile::tempdir().unwrap();
    let toml = RelayToml::replication(&slot).set("source", "mode", mode);
    let config = common::write_config_with(dir.path(), &db, &services().kafka, "", toml);
    let active = RelayProcess::spawn(&config, &dir.path().join("active.log"), "warn", &[]);
    active.wait_ready("active").await;
    let standby = RelayProcess::spawn(&config, &dir.path().join("standby.log"), "warn", &[]);
    standby.wait_ready("standby").await;
    write_warm_up(&client, &aggregate_type).await;
    let series = format!("outbox_relay_events_published_total{{mode=\"{mode}\"}}");
    common::wait_until_within(Duration::from_secs(60), "the warm-up events", async || {
        active.metric(&series).unwrap_or(0.0) >= 10.0
    })
    .await;
    // settle: the warm-up's acknowledgement, its confirmation, the first samples
    tokio::time::sleep(Duration::from_secs(5)).await;
    let admin = connect(&services().pg_url).await;
    let backends = backend_pids(&admin).await;
    let before = (cpu(&active), cpu(&standby), backends_cpu(&backends), wal_lsn(&admin).await);
    let threads_before = threads(active.pid());
    tokio::time::sleep(window).await;
    let per_min = 60.0 / window.as_secs_f64();
    let wakeups = threads_since(active.pid(), &threads_before)
        .into_iter()
        .map(|(name, (_, switches))| (name, switches / window.as_secs_f64()))
        .collect();
    Quiet {
        active: (cpu(&active) - before.0) * per_min,
        standby: (cpu(&standby) - before.1) * per_min,
        backends: (backends_cpu(&backends) - before.2) * per_min,
        wal_per_min: (wal_lsn(&admin).await - before.3) as f64 * per_min,
        wakeups,
        ..Quiet::default()
    }
}

fn cpu(relay: &RelayProcess) -> f64 {
    cpu_seconds(relay.pid()).unwrap_or(0.0)
}

/// The PostgreSQL processes serving the relays (their `application_name`, walsenders included).
async fn backend_pids(admin: &tokio_postgres::Client) -> Vec<u32> {
    let rows = admin
        .query("SELECT pid FROM pg_stat_activity WHERE application_name = 'outbox-relay'", &[])
        .await
        .unwrap();
    rows.iter().map(|r| r.get::<_, i32>(0) as u32).collect()
}

fn backends_cpu(pids: &[u32]) -> f64 {
    pids.iter().filter_map(|pid| cpu_seconds(*pid)).sum()
}

/// Each thread of `pid`, summed by thread name with its digits dropped (`rdk:broker1` and
/// `rdk:broker2` are one line): (CPU seconds, context switches voluntary and not).
pub(super) fn threads(pid: u32) -> BTreeMap<String, (f64, f64)> {
    let mut by_name: BTreeMap<String, (f64, f64)> = BTreeMap::new();
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return by_name };
    for task in tasks.flatten() {
        let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
        let name: String = comm.trim().chars().filter(|c| !c.is_ascii_digit()).collect();
        let status = std::fs::read_to_string(task.path().join("status")).unwrap_or_default();
        let switches: f64 = status
            .lines()
            .filter(|l| {
                l.starts_with("voluntary_ctxt_switches") || l.starts_with("nonvoluntary_ctxt_switches")
            })
            .filter_map(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
            .sum();
        let stat = std::fs::read_to_string(task.path().join("stat")).unwrap_or_default();
        let cpu = super::cpu_of_stat(&stat).unwrap_or(0.0);
        let entry = by_name.entry(name).or_default();
        entry.0 += cpu;
        entry.1 += switches;
    }
    by_name
}

/// What `pid`'s threads did since `before` ([`threads`]): (CPU seconds, context switches) by
/// thread name.
pub(super) fn threads_since(pid: u32, before: &BTreeMap<String, (f64, f64)>) -> BTreeMap<String, (f64, f64)> {
    threads(pid)
        .into_iter()
        .map(|(name, (cpu, switches))| {
            let (cpu_was, switches_was) = before.get(&name).copied().unwrap_or_default();
            (name, (cpu - cpu_was, switches - switches_was))
        })
        .collect()
}

/// `threads` ([`threads`]' CPU per 100k events, wake-ups per second) from the busiest, those
/// with at least `least` CPU: "name cpu (n/s), ...".
fn by_cpu(threads: &BTreeMap<String, (f64, f64)>, least: f64) -> String {
    let mut busiest: Vec<_> = threads.iter().filter(|(_, t)| t.0 >= least).collect();
    busiest.sort_by(|a, b| b.1.0.total_cmp(&a.1.0));
    let list: Vec<String> = busiest.iter().map(|(t, (cpu, n))| format!("{t} {cpu:.2} ({n:.0}/s)")).collect();
    list.join(", ")
}

pub fn render(o: &Options, runs: &Runs) -> String {
    let mut out = format!(
        "{}  \n\nAn active relay and its standby at the defaults, {} s with nothing to publish after ten \
         warm-up events; then a writer at {LOW_RATE} events/s for {} s against an active relay. Median of {} \
         runs (min-max). \"Backends\" is the CPU of the PostgreSQL processes serving both relays (walsender \
         included); WAL is what the server wrote meanwhile (nothing else runs on it).\n\n\
         | build | mode | active, CPU s/min | standby, CPU s/min | backends, CPU s/min | WAL, bytes/min | \
         {LOW_RATE}/s: CPU s per 100k |\n|---|---|---|---|---|---|---|\n",
        super::report::machine(),
        runs.window.as_secs(),
        LOW_RATE_WINDOW.as_secs(),
        o.runs
    );
    for (name, modes) in &runs.builds {
        for (m, mode) in MODES.iter().enumerate() {
            let q = &modes[m];
            let col = |f: fn(&Quiet) -> f64, digits| stat(&q.iter().map(f).collect::<Vec<_>>(), digits);
            out += &format!(
                "| {name} | {mode} | {} | {} | {} | {} | {} |\n",
                col(|q| q.active, 3),
                col(|q| q.standby, 3),
                col(|q| q.backends, 3),
                col(|q| q.wal_per_min, 0),
                col(|q| q.low_rate_cpu, 2)
            );
        }
    }
    out += "\nWake-ups per second of the active relay's threads while idle (context switches, the first run):\n\n\
            | build | mode | threads |\n|---|---|---|\n";
    for (name, modes) in &runs.builds {
        for (m, mode) in MODES.iter().enumerate() {
            let Some(q) = modes[m].first() else { continue };
            let mut threads: Vec<(&String, &f64)> = q.wakeups.iter().filter(|(_, n)| **n >= 0.05).collect();
            threads.sort_by(|a, b| b.1.total_cmp(a.1));
            let list: Vec<String> = threads.iter().map(|(t, n)| format!("{t} {n:.1}")).collect();
            out += &format!("| {name} | {mode} | {} |\n", list.join(", "));
        }
    }
    out += &format!(
        "\nAt {LOW_RATE} events/s, where the relay's CPU goes: CPU s per 100k events by thread (wake-ups per \
         second), the first run:\n\n| build | mode | threads |\n|---|---|---|\n"
    );
    for (name, modes) in &runs.builds {
        for (m, mode) in MODES.iter().enumerate() {
            let Some(q) = modes[m].first() else { continue };
            let list = by_cpu(&q.low_rate_threads, SHOWN_THREAD_CPU);
            out += &format!("| {name} | {mode} | {list} |\n");
        }
    }
    out
}
