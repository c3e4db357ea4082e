//! What each record format (`outbox.format`, issue 32) costs against `raw`, side by side in one
//! run: the same backlog (`--events`, 200,000 for this section unless given) drained in both
//! modes by a relay publishing each format, the formats' order rotated each run so that the
//! machine's drift hits them alike. Reported: events/s and the relay's CPU per 100k events, and
//! each as a ratio to `raw`'s drain of the same run.
//!
//! `deploy/local/bench --only formats` runs this alone and writes its section of BENCHMARKS.md.

use super::dedup::drain_with;
use super::report::median;
use super::{Drain, Options, stat};

const MODES: [&str; 2] = ["replication", "polling"];

/// The formats measured: a name and the configuration lines that select it.
const FORMATS: [(&str, &str); 5] = [
    ("raw", ""),
    ("cloudevents binary", "[outbox]\nformat = \"cloudevents\"\n[outbox.cloudevents]\nsource = \"/bench\"\n"),
    (
        "cloudevents structured",
        "[outbox]\nformat = \"cloudevents\"\n[outbox.cloudevents]\nsource = \"/bench\"\nmode = \"structured\"\n",
    ),
    ("debezium json_with_schemas", "[outbox]\nformat = \"debezium\"\n"),
    (
        "debezium json, expanded",
        "[outbox]\nformat = \"debezium\"\n[outbox.debezium]\nkey_converter = \"json\"\nvalue_converter = \"json\"\nexpand_json_payload = true\n",
    ),
];

/// Per mode, per format (in [`FORMATS`]' order): the drains of every run.
#[derive(Default)]
pub struct FormatCost {
    drains: [[Vec<Drain>; FORMATS.len()]; MODES.len()],
}

fn events(o: &Options) -> usize {
    if o.events_given { o.events } else { 200_000 }
}

/// Every drain `o.runs` times, each run starting the rotation one format later.
pub async fn run(o: &Options) -> FormatCost {
    let mut cost = FormatCost::default();
    let events = events(o);
    for run in 0..o.runs {
        for (m, mode) in MODES.into_iter().enumerate() {
            for k in 0..FORMATS.len() {
                let f = (k + run) % FORMATS.len();
                let (name, lines) = FORMATS[f];
                eprintln!("[bench] formats run {}/{}: {mode} drain of {events}, {name}", run + 1, o.runs);
                let d = drain_with(mode, events, &o.kafka, lines, async |_| {}).await;
                eprintln!("[bench]   {:.0}/s, CPU {:.2} s/100k", events as f64 / d.seconds, d.cpu_per_100k);
                cost.drains[m][f].push(d);
            }
        }
    }
    cost
}

/// Each run's value of `f` for format `f_index` over `raw`'s of the same run.
fn ratios(drains: &[Vec<Drain>], index: usize, f: impl Fn(&Drain) -> f64) -> Vec<f64> {
    drains[index].iter().zip(&drains[0]).map(|(d, raw)| f(d) / f(raw)).collect()
}

/// The section's text (markdown): the machine, the table, the goal.
pub fn render(o: &Options, cost: &FormatCost) -> String {
    let events = events(o);
    let mut out = format!(
        "{}  \nThe relay's defaults otherwise{}.\n\n| mode, format ({events} events; median of {} runs, min-max) | drain, events/s | vs raw | relay CPU s per 100k events | vs raw |\n|---|---|---|---|---|\n",
        super::report::machine(),
        if o.kafka.is_empty() {
            String::new()
        } else {
            format!("; `[kafka]` {}", o.kafka.replace('\n', ", "))
        },
        o.runs
    );
    for (m, mode) in MODES.into_iter().enumerate() {
        let drains = &cost.drains[m];
        for (f, (name, _)) in FORMATS.iter().enumerate() {
            let rate = |d: &Drain| events as f64 / d.seconds;
            let rates: Vec<f64> = drains[f].iter().map(rate).collect();
            let cpu: Vec<f64> = drains[f].iter().map(|d| d.cpu_per_100k).collect();
            out += &format!(
                "| {mode}, {name} | {} | {} | {} | {} |\n",
                stat(&rates, 0),
                stat(&ratios(drains, f, rate), 3),
                stat(&cpu, 2),
                stat(&ratios(drains, f, |d| d.cpu_per_100k), 3),
            );
        }
    }
    let slowest = (0..MODES.len())
        .flat_map(|m| (1..FORMATS.len()).map(move |f| (m, f)))
        .map(|(m, f)| median(&ratios(&cost.drains[m], f, |d| 1.0 / d.seconds)))
        .fold(f64::INFINITY, f64::min);
    out + &format!(
        "\nThe slowest format's drain is {slowest:.3}x raw's (median of the paired runs). Avro through a schema \
         registry is not in this table yet (docs/formats.md says why).\n"
    )
}
