//! `deploy/local/bench --only transforms`: what `[outbox.transforms]` costs (issue 52), side by
//! side in one run: the same backlog (`--events`, 200,000 unless given; `write_backlog`'s
//! ~200-byte `OrderPlaced` payloads) drained in both modes with no transforms, a filter, a route
//! and three redactions, the settings' order rotated each run. Every event is still published
//! (the filter's globs are evaluated for each event and keep it; the route sends every event to
//! one topic of the same partitions), so the drains move the same records and differ only by
//! the transforms' work. Reported: events/s and the relay's CPU per 100k events, each also as a
//! ratio to the same run's drain without transforms.

use super::common::{create_topic, random_suffix};
use super::dedup::drain_with;
use super::{Drain, Options, PARTITIONS, drop_topic, stat};

const MODES: [&str; 2] = ["replication", "polling"];

/// The settings measured, by name; `{prefix}` is the routed topics' prefix, `{key}` the HMAC
/// key file.
const SETTINGS: [(&str, &str); 4] = [
    ("none", ""),
    (
        "filter (include + exclude globs)",
        "[outbox.transforms]\ninclude_event_types = [\"Order*\"]\nexclude_event_types = [\"*.internal\", \"Audit*\"]\n",
    ),
    (
        "route by /currency",
        "[outbox]\nallowed_topics = [\"outbox.event.*\", \"{prefix}.*\"]\n[outbox.transforms]\n\
         route_by_field = \"/currency\"\nroute_topic = \"{prefix}.{value}\"\n",
    ),
    (
        "three redactions (replace, drop, hash)",
        "[outbox.transforms]\nhash_key_file = \"{key}\"\n\
         [[outbox.transforms.redact]]\npointer = \"/customer\"\naction = \"replace\"\n\
         [[outbox.transforms.redact]]\npointer = \"/note\"\naction = \"drop\"\n\
         [[outbox.transforms.redact]]\npointer = \"/status\"\naction = \"hash\"\n",
    ),
];

/// Per mode, per setting: the drains of every run.
#[derive(Default)]
pub struct TransformCost {
    drains: [[Vec<Drain>; SETTINGS.len()]; MODES.len()],
}

fn events(o: &Options) -> usize {
    if o.events_given { o.events } else { 200_000 }
}

pub async fn run(o: &Options) -> TransformCost {
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("redact.key");
    std::fs::write(&key, "a-bench-hmac-key-of-more-than-32-bytes\n").unwrap();
    let events = events(o);
    let mut cost = TransformCost::default();
    for run in 0..o.runs {
        for (m, mode) in MODES.into_iter().enumerate() {
            for k in 0..SETTINGS.len() {
                let s = (k + run) % SETTINGS.len();
                let prefix = format!("route{}", random_suffix());
                // (write_backlog's currency is EUR: one routed topic, the template topic's partitions)
                let routed = format!("{prefix}.EUR");
                let lines =
                    SETTINGS[s].1.replace("{prefix}", &prefix).replace("{key}", &key.display().to_string());
                if s == 2 {
                    create_topic(&routed, PARTITIONS).await;
                }
                eprintln!(
                    "[bench] transforms run {}/{}: {mode} drain of {events}, {}",
                    run + 1,
                    o.runs,
                    SETTINGS[s].0
                );
                let d = drain_with(mode, events, &o.kafka, &lines, async |_| {}).await;
                eprintln!("[bench]   {:.0}/s, CPU {:.2} s/100k", events as f64 / d.seconds, d.cpu_per_100k);
                if s == 2 {
                    drop_topic(&routed).await;
                }
                cost.drains[m][s].push(d);
            }
        }
    }
    cost
}

/// Each run's value of `f` for setting `index` over the same run's drain without transforms.
fn ratios(drains: &[Vec<Drain>], index: usize, f: impl Fn(&Drain) -> f64) -> Vec<f64> {
    drains[index].iter().zip(&drains[0]).map(|(d, none)| f(d) / f(none)).collect()
}

pub fn render(o: &Options, cost: &TransformCost) -> String {
    let events = events(o);
    let mut out = format!(
        "{}  \nThe relay's defaults otherwise; every event published in every drain.\n\n\
         | mode, transforms ({events} events; median of {} runs, min-max) | drain, events/s | vs none | relay CPU s per 100k events | vs none |\n\
         |---|---|---|---|---|\n",
        super::report::machine(),
        o.runs
    );
    for (m, mode) in MODES.into_iter().enumerate() {
        let drains = &cost.drains[m];
        for (s, (name, _)) in SETTINGS.iter().enumerate() {
            let rate = |d: &Drain| events as f64 / d.seconds;
            let rates: Vec<f64> = drains[s].iter().map(rate).collect();
            let cpu: Vec<f64> = drains[s].iter().map(|d| d.cpu_per_100k).collect();
            out += &format!(
                "| {mode}, {name} | {} | {} | {} | {} |\n",
                stat(&rates, 0),
                stat(&ratios(drains, s, rate), 3),
                stat(&cpu, 2),
                stat(&ratios(drains, s, |d| d.cpu_per_100k), 3),
            );
        }
    }
    out
}
