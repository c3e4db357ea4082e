//! What Kafka transactions (`kafka.transactional`) cost, issue 30, measured side by side in both
//! modes, plain and transactional in one run, their order flipped each run so that the machine's
//! drift hits both alike:
//! - backlog drain: the same backlog (`--events`, 200,000 for this section unless given), events/s
//!   and the relay's CPU per event;
//! - steady state at the first of `--rates` (2,000 events/s by default) for `--duration-secs`:
//!   commit-to-ack p99 (the relay's `outbox_relay_end_to_end_latency_seconds`, which with
//!   transactions ends at the transaction's commit), commit-to-consumer for a `read_committed`
//!   consumer (which sees a record only once its transaction committed), and CPU per event;
//! - the transaction markers in each topic: one per transaction and partition it wrote to, so
//!   between the number of transactions and 8 times it (0 without transactions).
//!
//! `--kafka 'key = value; ...'` adds `[kafka]` lines to every relay, `--transactional '...'` to the
//! transactional ones only (their bounds). Issue 30's goals: the drain at least 0.8x the plain
//! one, p99 commit-to-ack at 2,000 events/s at most 20 ms more.
//!
//! `deploy/local/bench --only transactions` runs this alone and writes its section of BENCHMARKS.md.

use outbox_relay::config::{
    DEFAULT_KAFKA_TRANSACTION_MAX_BYTES, DEFAULT_KAFKA_TRANSACTION_MAX_EVENTS,
    DEFAULT_KAFKA_TRANSACTION_MAX_MS, DEFAULT_KAFKA_TRANSACTION_TIMEOUT_MS,
};

use super::dedup::drain_with;
use super::report::median;
use super::{Drain, Latency, Options, stat, steady_latency_in};

const MODES: [&str; 2] = ["replication", "polling"];
/// Issue 30's goals: the transactional drain's rate over the plain one's, at least; the
/// transactional p99 commit-to-ack at the steady rate over the plain one's, in ms, at most.
const DRAIN_GOAL: f64 = 0.8;
const LATENCY_GOAL_MS: f64 = 20.0;

/// One mode's runs on one side (plain or transactional).
#[derive(Default)]
struct Side {
    drains: Vec<Drain>,
    latencies: Vec<Latency>,
}

/// Per mode, in [`MODES`]' order: (plain, transactional).
#[derive(Default)]
pub struct TransactionCost {
    modes: [(Side, Side); 2],
}

impl TransactionCost {
    fn side(&mut self, mode: usize, transactional: bool) -> &mut Side {
        let (plain, with) = &mut self.modes[mode];
        if transactional { with } else { plain }
    }
}

fn events(o: &Options) -> usize {
    if o.events_given { o.events } else { 200_000 }
}

fn rate(o: &Options) -> usize {
    o.rates.first().copied().unwrap_or(2_000)
}

/// The `[kafka]` lines of one side.
fn kafka_lines(o: &Options, transactional: bool) -> String {
    if transactional {
        format!("transactional = true\n{}{}", o.transactional, o.kafka)
    } else {
        o.kafka.clone()
    }
}

fn label(transactional: bool) -> &'static str {
    if transactional { "transactional" } else { "plain" }
}

/// Every measurement `o.runs` times: the drains of both modes, then the steady states, each
/// plain and transactional back to back.
pub async fn run(o: &Options) -> TransactionCost {
    let mut cost = TransactionCost::default();
    let (events, rate) = (events(o), rate(o));
    for run in 1..=o.runs {
        let order = if run % 2 == 1 { [false, true] } else { [true, false] };
        for (m, mode) in MODES.into_iter().enumerate() {
            for transactional in order {
                eprintln!(
                    "[bench] transactions run {run}/{}: {mode} drain of {events}, {}",
                    o.runs,
                    label(transactional)
                );
                let d = drain_with(mode, events, &kafka_lines(o, transactional), "", async |_| {}).await;
                eprintln!(
                    "[bench]   {:.0}/s, CPU {:.2} s/100k, {} transaction markers",
                    events as f64 / d.seconds,
                    d.cpu_per_100k,
                    d.markers
                );
                cost.side(m, transactional).drains.push(d);
            }
        }
        for (m, mode) in MODES.into_iter().enumerate() {
            for transactional in order {
                eprintln!(
                    "[bench] transactions run {run}/{}: {mode} at {rate}/s, {}",
                    o.runs,
                    label(transactional)
                );
                let l = steady_latency_in(mode, &kafka_lines(o, transactional), rate, o.duration).await;
                eprintln!(
                    "[bench]   commit-to-ack p99 {:.1} ms, commit-to-consumer p50 {:.1} p99 {:.1} ms, CPU {:.2} s/100k, \
                     {} transaction markers, sustained {}",
                    l.relay_p99_ms, l.p50_ms, l.p99_ms, l.cpu_per_100k, l.markers, l.sustained
                );
                cost.side(m, transactional).latencies.push(l);
            }
        }
    }
    cost
}

fn field<T>(runs: &[T], f: impl Fn(&T) -> f64) -> Vec<f64> {
    runs.iter().map(f).collect()
}

/// How a row compares the two sides of each run.
#[derive(Clone, Copy)]
enum Compare {
    /// transactional / plain
    Ratio,
    /// transactional - plain, ms
    Difference,
    /// not at all (a count that is 0 without transactions)
    Not,
}

impl Compare {
    /// Each run's pair (plain, transactional) compared.
    fn paired(self, plain: &[f64], with: &[f64]) -> Vec<f64> {
        let f = |(p, t): (&f64, &f64)| if let Compare::Ratio = self { t / p } else { t - p };
        plain.iter().zip(with).map(f).collect()
    }
}

/// One row: the measure on both sides, and how they compare.
fn row(name: &str, (plain, with): (Vec<f64>, Vec<f64>), digits: usize, compare: Compare) -> String {
    let pairs = compare.paired(&plain, &with);
    let compared = match compare {
        Compare::Ratio => stat(&pairs, 3),
        Compare::Difference => format!("{:+.1} ({:+.1} to {:+.1})", median(&pairs), min(&pairs), max(&pairs)),
        Compare::Not => String::new(),
    };
    format!("| {name} | {} | {} | {compared} |\n", stat(&plain, digits), stat(&with, digits))
}

fn min(values: &[f64]) -> f64 {
    values.iter().copied().fold(f64::INFINITY, f64::min)
}

fn max(values: &[f64]) -> f64 {
    values.iter().copied().fold(f64::NEG_INFINITY, f64::max)
}

/// The rows of one mode.
fn mode_rows(mode: &str, events: usize, rate: usize, (plain, with): &(Side, Side)) -> String {
    let drains = |f: &dyn Fn(&Drain) -> f64| (field(&plain.drains, f), field(&with.drains, f));
    let steady = |f: fn(&Latency) -> f64| (field(&plain.latencies, f), field(&with.latencies, f));
    let sustained = |side: &Side| {
        format!("{}/{}", side.latencies.iter().filter(|l| l.sustained).count(), side.latencies.len())
    };
    let at = format!("at {rate} events/s");
    [
        row(&format!("{mode} drain, events/s"), drains(&|d| events as f64 / d.seconds), 0, Compare::Ratio),
        row(
            &format!("{mode} drain after the first event, events/s"),
            drains(&|d| d.after_first),
            0,
            Compare::Ratio,
        ),
        row(
            &format!("{mode} drain, relay CPU s per 100k events"),
            drains(&|d| d.cpu_per_100k),
            2,
            Compare::Ratio,
        ),
        row(&format!("{mode} drain, transaction markers"), drains(&|d| d.markers), 0, Compare::Not),
        row(
            &format!("{mode} commit-to-ack p99 {at} (relay histogram), ms"),
            steady(|l| l.relay_p99_ms),
            1,
            Compare::Difference,
        ),
        row(&format!("{mode} commit-to-consumer p50 {at}, ms"), steady(|l| l.p50_ms), 1, Compare::Difference),
        row(&format!("{mode} commit-to-consumer p99 {at}, ms"), steady(|l| l.p99_ms), 1, Compare::Difference),
        row(
            &format!("{mode} relay CPU s per 100k events {at}"),
            steady(|l| l.cpu_per_100k),
            2,
            Compare::Ratio,
        ),
        row(&format!("{mode} transaction markers {at}"), steady(|l| l.markers), 0, Compare::Not),
        format!("| {mode} sustained {at} (runs) | {} | {} | |\n", sustained(plain), sustained(with)),
    ]
    .concat()
}

/// Issue 30's goals against the medians of the paired runs.
fn goals(rate: usize, cost: &TransactionCost) -> String {
    let mut out =
        "\n| goal (issue 30, median of the paired runs) | measured | |\n|---|---|---|\n".to_string();
    for (mode, (plain, with)) in MODES.into_iter().zip(&cost.modes) {
        let rates = |side: &Side| field(&side.drains, |d| 1.0 / d.seconds);
        let drain = median(&Compare::Ratio.paired(&rates(plain), &rates(with)));
        let p99 = |side: &Side| field(&side.latencies, |l| l.relay_p99_ms);
        let latency = median(&Compare::Difference.paired(&p99(plain), &p99(with)));
        out += &goal(
            &format!("{mode} drain, transactional >= {DRAIN_GOAL}x plain"),
            format!("{drain:.3}x"),
            drain >= DRAIN_GOAL,
        );
        out += &goal(
            &format!(
                "{mode} commit-to-ack p99 at {rate} events/s, transactional <= plain + {LATENCY_GOAL_MS} ms"
            ),
            format!("{latency:+.1} ms"),
            latency <= LATENCY_GOAL_MS,
        );
    }
    out
}

fn goal(what: &str, measured: String, met: bool) -> String {
    format!("| {what} | {measured} | {} |\n", if met { "met" } else { "**missed**" })
}

/// The settings of both sides: the transaction bounds, and what `--kafka` added.
fn settings(o: &Options) -> String {
    let inline = |lines: &str| lines.lines().collect::<Vec<_>>().join(", ");
    let mut out = format!(
        "Transaction bounds (the defaults): kafka.transaction_max_events = {DEFAULT_KAFKA_TRANSACTION_MAX_EVENTS}, \
         kafka.transaction_max_bytes = {} MiB, kafka.transaction_max_ms = {DEFAULT_KAFKA_TRANSACTION_MAX_MS}, \
         kafka.transaction_timeout_ms = {DEFAULT_KAFKA_TRANSACTION_TIMEOUT_MS}",
        DEFAULT_KAFKA_TRANSACTION_MAX_BYTES >> 20
    );
    if !o.transactional.is_empty() {
        out += &format!("; changed by `--transactional`: {}", inline(&o.transactional));
    }
    if !o.kafka.is_empty() {
        out += &format!(". Both sides: {}", inline(&o.kafka));
    }
    out + ". Otherwise the relay's defaults, as in the latest full results.  \n"
}

/// The section's text (markdown): the machine and settings, the table, the goals.
pub fn render(o: &Options, cost: &TransactionCost) -> String {
    let (events, rate) = (events(o), rate(o));
    let mut out = format!("{}  \n{}\n", super::report::machine(), settings(o));
    out += &format!(
        "| measure ({events} events; {rate} events/s for {} s; median of {} runs, min-max) | plain | transactional | \
         transactional vs plain (ratio, or difference in ms) |\n|---|---|---|---|\n",
        o.duration.as_secs(),
        o.runs
    );
    for (mode, sides) in MODES.into_iter().zip(&cost.modes) {
        out += &mode_rows(mode, events, rate, sides);
    }
    out + &goals(rate, cost)
}
