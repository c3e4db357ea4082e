//! `deploy/local/bench --baseline PATH`: another build of the relay side by side with this one
//! on backlogs of the same size, each written afresh (`--events`, default 1,000,000), replication
//! and polling, `--runs` times with the order flipped each run, so a change's effect on CPU per
//! event, drain rate and peak RSS is read as a ratio from one run of the harness, not against
//! numbers from another day.
//! Copy the baseline aside first (`cp target/release/outbox-relay /tmp/outbox-relay.before`):
//! the next build overwrites it.

use std::path::Path;

use super::{Drain, Options, polling_drain, replication_drain, stat, use_relay_bin};

/// Each side's drains, one per run.
#[derive(Default)]
struct Side {
    replication: Vec<Drain>,
    polling: Vec<Drain>,
}

/// A row of the table: its name, what it reads of a drain of so many events, its digits.
type Measure = (&'static str, fn(&Drain, f64) -> f64, usize);

pub struct Runs {
    baseline: Side,
    this: Side,
}

pub async fn run(o: &Options) -> Runs {
    let baseline = o.baseline.clone().expect("--baseline PATH");
    assert!(Path::new(&baseline).is_file(), "--baseline {}: no such file", baseline.display());
    let mut runs = Runs { baseline: Side::default(), this: Side::default() };
    for run in 1..=o.runs {
        // (flipped each run: a drain that comes first on a freshly written backlog is not favoured)
        let order = if run % 2 == 1 { [true, false] } else { [false, true] };
        for is_baseline in order {
            let (side, name) = if is_baseline {
                (&mut runs.baseline, "the baseline")
            } else {
                (&mut runs.this, "this build")
            };
            use_relay_bin(is_baseline.then(|| baseline.clone()));
            eprintln!("[bench] run {run}/{}: {name}, replication drain of {} events", o.runs, o.events);
            let (d, _) = replication_drain(o.events, None, false).await;
            say(o, &d);
            side.replication.push(d);
            eprintln!("[bench] run {run}/{}: {name}, polling drain of {} events", o.runs, o.events);
            let d = polling_drain(o.events).await;
            say(o, &d);
            side.polling.push(d);
        }
        use_relay_bin(None);
    }
    runs
}

fn say(o: &Options, d: &Drain) {
    eprintln!(
        "[bench]   {:.0} events/s, {:.2} CPU s/100k, peak RSS {:.1} MiB",
        o.events as f64 / d.seconds,
        d.cpu_per_100k,
        d.rss_mib
    );
}

pub fn render(o: &Options, runs: &Runs) -> String {
    let baseline = o.baseline.as_ref().expect("--baseline PATH");
    let mut out = format!(
        "Baseline: `{}`.\n\n{}  \n\n\
         | measure ({} events, median of {} runs, min-max) | baseline | this build | this / baseline (each run's pair) |\n\
         |---|---|---|---|\n",
        baseline.display(),
        super::report::machine(),
        o.events,
        o.runs
    );
    let measures: [Measure; 4] = [
        ("drain, events/s", |d, events| events / d.seconds, 0),
        ("after the first event, events/s", |d, _| d.after_first, 0),
        ("relay CPU s per 100k events", |d, _| d.cpu_per_100k, 2),
        ("relay peak RSS, MiB", |d, _| d.rss_mib, 1),
    ];
    for (mode, base, this) in [
        ("replication", &runs.baseline.replication, &runs.this.replication),
        ("polling", &runs.baseline.polling, &runs.this.polling),
    ] {
        for (name, field, digits) in measures {
            let b: Vec<f64> = base.iter().map(|d| field(d, o.events as f64)).collect();
            let t: Vec<f64> = this.iter().map(|d| field(d, o.events as f64)).collect();
            let ratio: Vec<f64> = t.iter().zip(&b).map(|(t, b)| t / b).collect();
            out += &format!(
                "| {mode}: {name} | {} | {} | {} |\n",
                stat(&b, digits),
                stat(&t, digits),
                stat(&ratio, 3)
            );
        }
    }
    out
}
