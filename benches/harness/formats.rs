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
/// Issue 32's goal: Avro's drain over raw's, at least.
const AVRO_GOAL: f64 = 0.7;

/// The formats measured: a name and the configuration lines that select it (the registry's
/// are [`registry_formats`]).
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

/// The backlog's payload (`write_backlog`) as an Avro record and a JSON Schema.
const BACKLOG_AVSC: &str = r#"{"type": "record", "name": "OrderPlaced", "namespace": "bench", "fields": [
  {"name": "order_id", "type": "long"}, {"name": "customer", "type": "string"},
  {"name": "total_cents", "type": "long"}, {"name": "currency", "type": "string"},
  {"name": "status", "type": "string"}, {"name": "note", "type": "string"},
  {"name": "written_at", "type": "string"}]}"#;
const BACKLOG_JSON_SCHEMA: &str = r#"{"type": "object", "properties": {
  "order_id": {"type": "integer"}, "customer": {"type": "string"}, "total_cents": {"type": "integer"},
  "currency": {"type": "string"}, "status": {"type": "string"}, "note": {"type": "string"},
  "written_at": {"type": "string"}}, "required": ["order_id", "customer", "total_cents"]}"#;

/// Avro and JSON Schema values through a local schema registry (Apicurio, started for this run).
fn registry_formats(dir: &std::path::Path) -> Vec<(String, String)> {
    let registry = super::common::hold("hold-registry", &[]);
    let url = &registry["OUTBOX_RELAY_TEST_REGISTRY_URL"];
    [("avro", "avro", BACKLOG_AVSC), ("json schema", "json", BACKLOG_JSON_SCHEMA)]
        .into_iter()
        .map(|(name, kind, schema)| {
            let file = dir.join(format!("{kind}.schema"));
            std::fs::write(&file, schema).unwrap();
            let lines = format!(
                "[outbox.registry]\nurl = \"{url}\"\nschema_type = \"{kind}\"\nauto_register = true\nschema_file = \"{}\"\n",
                file.display()
            );
            (format!("raw, {name} via the registry"), lines)
        })
        .collect()
}

/// Every format measured: [`FORMATS`], then [`registry_formats`].
fn formats(dir: &std::path::Path) -> Vec<(String, String)> {
    let mut all: Vec<(String, String)> =
        FORMATS.iter().map(|(n, l)| (n.to_string(), l.to_string())).collect();
    all.extend(registry_formats(dir));
    all
}

/// Per mode, per format (in [`formats`]' order): the drains of every run.
#[derive(Default)]
pub struct FormatCost {
    names: Vec<String>,
    drains: [Vec<Vec<Drain>>; MODES.len()],
}

fn events(o: &Options) -> usize {
    if o.events_given { o.events } else { 200_000 }
}

/// Every drain `o.runs` times, each run starting the rotation one format later.
pub async fn run(o: &Options) -> FormatCost {
    let dir = tempfile::tempdir().unwrap();
    let formats = formats(dir.path());
    let mut cost =
        FormatCost { names: formats.iter().map(|(n, _)| n.clone()).collect(), ..Default::default() };
    for drains in &mut cost.drains {
        drains.resize_with(formats.len(), Vec::new);
    }
    let events = events(o);
    for run in 0..o.runs {
        for (m, mode) in MODES.into_iter().enumerate() {
            for k in 0..formats.len() {
                let f = (k + run) % formats.len();
                let (name, lines) = (&formats[f].0, formats[f].1.as_str());
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
        for (f, name) in cost.names.iter().enumerate() {
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
    let ratio = |m: usize, f: usize| median(&ratios(&cost.drains[m], f, |d| 1.0 / d.seconds));
    let slowest = (0..MODES.len())
        .flat_map(|m| (1..cost.names.len()).map(move |f| (m, f)))
        .map(|(m, f)| ratio(m, f))
        .fold(f64::INFINITY, f64::min);
    let avro = cost.names.iter().position(|n| n.contains("avro")).expect("an avro row");
    let avro_worst = (0..MODES.len()).map(|m| ratio(m, avro)).fold(f64::INFINITY, f64::min);
    let met = if avro_worst >= AVRO_GOAL { "met" } else { "**missed**" };
    out + &format!(
        "\nThe slowest format's drain is {slowest:.3}x raw's (median of the paired runs). Goal (issue 32): Avro \
         encoding costs at most 30% of the raw drain rate, i.e. >= {AVRO_GOAL}x in both modes: {avro_worst:.3}x, {met}.\n"
    )
}
