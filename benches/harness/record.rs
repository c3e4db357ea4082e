//! The cost of the record of what was published (`sql/010_published.sql`, docs/commands.md, "verify"),
//! measured side by side: backlog drain throughput with the table, and without it (dropped
//! before the relay starts: it records nothing), in both modes, alternating.
//!
//! `deploy/local/bench --only record` runs this alone and writes its section of BENCHMARKS.md.

use super::Options;

#[derive(Default)]
pub struct RecordCost {
    /// Drain rates, events/s: (with the record, without) per mode.
    replication: (Vec<f64>, Vec<f64>),
    polling: (Vec<f64>, Vec<f64>),
}

async fn drain(mode: &'static str, events: usize, record: bool) -> f64 {
    let drain = super::dedup::drain_with(mode, events, "", "", async |client| {
        if !record {
            client.batch_execute("DROP TABLE outbox_relay_published").await.unwrap();
        }
    })
    .await;
    events as f64 / drain.seconds
}

/// Every drain `o.runs` times, with and without the record alternating.
pub async fn run(o: &Options) -> RecordCost {
    let mut cost = RecordCost::default();
    for run in 1..=o.runs {
        for record in [true, false] {
            let label = if record { "with" } else { "without" };
            eprintln!("[bench] record run {run}/{}: {label} the record of what was published", o.runs);
            let (replication, polling) =
                (drain("replication", o.events, record).await, drain("polling", o.events, record).await);
            eprintln!("[bench]   replication {replication:.0}/s, polling {polling:.0}/s");
            let pick = |pair: &mut (Vec<f64>, Vec<f64>), value: f64| {
                if record { pair.0.push(value) } else { pair.1.push(value) }
            };
            pick(&mut cost.replication, replication);
            pick(&mut cost.polling, polling);
        }
    }
    cost
}

/// The section's table (markdown).
pub fn render(o: &Options, cost: &RecordCost) -> String {
    super::dedup::drain_rows(o, ("with the record", "without"), &cost.replication, &cost.polling)
}
