//! `outbox-relay verify --watch`: `verify` again and again over a rolling window (`--since`,
//! the last 15 minutes unless given), as a companion process beside the relay, exporting what each
//! pass found as `outbox_relay_verify_*` metrics on a listener of its own (`--listen`).
//!
//! Why a companion and not a part of `run`: a pass maps every row of the window and reads every
//! record of its topics, work and memory that grow with the window, not with the rate the relay
//! keeps up with. Apart, it can neither slow the delivery nor take its memory; it runs with a
//! role that only reads; and either restarts without the other.
//!
//! Invariants:
//! - a pass changes nothing (it is `verify`: no offsets committed, no row touched);
//! - the gauges hold the last finished pass's findings. A failed pass leaves them as they were
//!   and counts `outbox_relay_verify_passes_total{result="failed"}`, so the last pass's
//!   timestamp ages and `OutboxRelayVerifyStale` fires;
//! - at most `--show` missing events per outbox are named (`outbox_relay_verify_missing_event`,
//!   one series per id): the series stay bounded whatever was lost.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant, SystemTime};

use prometheus::{Encoder, GaugeVec, IntCounterVec, Opts, Registry, TextEncoder};
use tokio::signal::unix::{SignalKind, signal};

use super::report::Report;
use super::{Options, VerifyError};
use crate::config::RelayConfig;
use crate::observe::health::{Health, Phase};
use crate::observe::http;
use crate::observe::metrics::{DEPLOYMENT_LABELS, outbox_labels};
use crate::outboxes::Outbox;

pub const MISSING: &str = "outbox_relay_verify_missing_events";
pub const MISSING_EVENT: &str = "outbox_relay_verify_missing_event";
pub const OLDEST_MISSING_AGE: &str = "outbox_relay_verify_oldest_missing_age_seconds";
pub const PENDING: &str = "outbox_relay_verify_pending_events";
pub const OLDEST_PENDING_AGE: &str = "outbox_relay_verify_oldest_pending_age_seconds";
pub const DUPLICATED: &str = "outbox_relay_verify_duplicated_events";
pub const DUPLICATE_RECORDS: &str = "outbox_relay_verify_duplicate_records";
pub const OUT_OF_ORDER: &str = "outbox_relay_verify_out_of_order_events";
pub const UNEXPECTED: &str = "outbox_relay_verify_unexpected_records";
pub const MISMATCHED: &str = "outbox_relay_verify_mismatched_events";
pub const FILTERED: &str = "outbox_relay_verify_filtered_events";
pub const ROWS: &str = "outbox_relay_verify_rows";
pub const RECORDS: &str = "outbox_relay_verify_records";
pub const LAST_PASS: &str = "outbox_relay_verify_last_pass_timestamp_seconds";
pub const PASS_DURATION: &str = "outbox_relay_verify_pass_duration_seconds";
pub const PASS_MEMORY: &str = "outbox_relay_verify_pass_memory_bytes";
pub const PASSES: &str = "outbox_relay_verify_passes_total";

/// Every metric `verify --watch` exports, with its help text.
pub const ALL: &[(&str, &str)] = &[
    (
        MISSING,
        "Events of the window in the table (or recorded as published) that Kafka lacks, at the last pass",
    ),
    (
        MISSING_EVENT,
        "One series per missing event named (at most --show), by id: seconds since it was created (or first found missing)",
    ),
    (OLDEST_MISSING_AGE, "Age of the oldest missing event named at the last pass; 0 when none is missing"),
    (
        PENDING,
        "Events not in Kafka yet and not owed yet (past the slot's confirmed position, or not yet marked)",
    ),
    (
        OLDEST_PENDING_AGE,
        "Age by created_at of the oldest pending event named at the last pass (at most --show); 0 when none \
         is, or the table has no created_at",
    ),
    (DUPLICATED, "Event ids Kafka holds more than once in the window (at-least-once allows it)"),
    (DUPLICATE_RECORDS, "Records beyond the first of each duplicated id"),
    (OUT_OF_ORDER, "Records of one key in another order than their commits"),
    (UNEXPECTED, "Records of this source with no row and no record of being published"),
    (MISMATCHED, "Events whose record differs from what the row maps to"),
    (FILTERED, "Rows of the window the outbox's transforms filter out (owed to no topic), at the last pass"),
    (ROWS, "Rows of the window compared at the last pass"),
    (RECORDS, "Records of this source read at the last pass"),
    (LAST_PASS, "When the last pass finished (Unix seconds)"),
    (PASS_DURATION, "How long the last pass took"),
    (PASS_MEMORY, "What the last pass held in memory (fingerprints and the record of what was published)"),
    (PASSES, "Passes by result: ok, found (something wrong), pending, failed (no answer)"),
];

/// The watch's metrics, in a registry of their own (the relay's are not this process's).
struct Watched {
    registry: Registry,
    gauges: HashMap<&'static str, GaugeVec>,
    missing_event: GaugeVec,
    passes: IntCounterVec,
}

fn help(name: &str) -> &'static str {
    ALL.iter().find(|(n, _)| *n == name).map(|(_, h)| *h).expect("every metric is in ALL")
}

impl Watched {
    fn new() -> Watched {
        let registry = Registry::new();
        let vec = |name: &'static str, extra: &[&str]| {
            let labels: Vec<&str> = DEPLOYMENT_LABELS.iter().copied().chain(extra.iter().copied()).collect();
            let gauge = GaugeVec::new(Opts::new(name, help(name)), &labels).expect("valid metric");
            registry.register(Box::new(gauge.clone())).expect("registered once");
            gauge
        };
        let gauges = ALL
            .iter()
            .map(|(name, _)| *name)
            .filter(|name| ![MISSING_EVENT, PASSES].contains(name))
            .map(|name| (name, vec(name, &[])))
            .collect();
        let missing_event = vec(MISSING_EVENT, &["id"]);
        let labels: Vec<&str> = DEPLOYMENT_LABELS.iter().copied().chain(["result"]).collect();
        let passes = IntCounterVec::new(Opts::new(PASSES, help(PASSES)), &labels).expect("valid metric");
        registry.register(Box::new(passes.clone())).expect("registered once");
        Watched { registry, gauges, missing_event, passes }
    }

    fn set(&self, name: &str, labels: &[String; 3], value: f64) {
        let labels: Vec<&str> = labels.iter().map(String::as_str).collect();
        self.gauges[name].with_label_values(&labels).set(value);
    }

    fn pass(&self, labels: &[String; 3], result: &str) {
        let labels: Vec<&str> = labels.iter().map(String::as_str).chain([result]).collect();
        self.passes.with_label_values(&labels).inc();
    }
}

fn watched() -> &'static Watched {
    static WATCHED: OnceLock<Watched> = OnceLock::new();
    WATCHED.get_or_init(Watched::new)
}

/// `/metrics` of `verify --watch`.
fn render() -> String {
    let mut out = Vec::new();
    TextEncoder::new().encode(&watched().registry.gather(), &mut out).expect("text encoding");
    String::from_utf8(out).expect("utf-8 exposition")
}

/// One outbox as the watch verifies it.
struct Watch<'a> {
    outbox: &'a Outbox,
    labels: [String; 3],
    /// Missing events named at the last pass, with when the watch first found each missing.
    missing_since: HashMap<String, SystemTime>,
}

/// Verifies every `every` until SIGTERM or SIGINT, serving the findings on `listen`.
pub async fn run(
    (config, outboxes): (&RelayConfig, &[&Outbox]),
    options: &Options,
    every: Duration,
    listen: SocketAddr,
) -> Result<(), VerifyError> {
    // liveness: a pass may take long, the loop ticks before and after each
    let health = Arc::new(Health::new(every.max(Duration::from_secs(300))));
    http::serve(listen, health.clone(), render)
        .await
        .map_err(|e| VerifyError::Usage(format!("--listen {listen}: cannot listen: {e}")))?;
    let watch =
        |o| Watch { outbox: o, labels: outbox_labels(config, &o.config), missing_since: HashMap::new() };
    let mut watches: Vec<Watch> = outboxes.iter().copied().map(watch).collect();
    // (registered before the first pass: a SIGTERM during it ends the watch, not the process)
    let mut term = signal(SignalKind::terminate())
        .map_err(|e| VerifyError::Failed(format!("cannot handle SIGTERM: {e}")))?;
    loop {
        let passes = async {
            let mut failed = None;
            for watch in &mut watches {
                health.tick();
                if let Err(e) = pass(config, watch, options).await {
                    failed = Some(e);
                }
            }
            failed
        };
        let failed = tokio::select! {
            failed = passes => failed,
            _ = term.recv() => return Ok(()),
            _ = tokio::signal::ctrl_c() => return Ok(()),
        };
        health.set_phase(match failed {
            None => Phase::Active,
            Some(e) => Phase::Retrying(e),
        });
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = term.recv() => return Ok(()),
            _ = tokio::signal::ctrl_c() => return Ok(()),
        }
    }
}

/// One pass over one outbox: the findings into the gauges, a warning naming what is missing or
/// out of order; `Err` says why the pass gave no answer.
async fn pass(config: &RelayConfig, watch: &mut Watch<'_>, options: &Options) -> Result<(), String> {
    let started = Instant::now();
    let labels = &watch.labels;
    let report = match super::run(config, watch.outbox, options).await {
        Ok(report) => report,
        Err(e) => {
            watched().pass(labels, "failed");
            tracing::warn!(outbox = %labels[1], error = %e, "verify pass failed; the last pass's findings stand");
            return Err(format!("verify pass failed: {e}"));
        }
    };
    let aged = async {
        let missing = ages((config, watch.outbox), &report.missing.first).await?;
        // (a pending record with no row of the window is named "record <id> (...)": no age)
        let rows: Vec<String> =
            report.pending.first.iter().filter(|n| !n.starts_with("record ")).cloned().collect();
        let pending = ages((config, watch.outbox), &rows).await?;
        Ok::<_, VerifyError>((missing, pending.iter().filter_map(|(_, age)| *age).fold(0.0, f64::max)))
    };
    let (missing, oldest_pending) = match aged.await {
        Ok(aged) => aged,
        Err(e) => {
            watched().pass(labels, "failed");
            return Err(format!("verify pass failed reading the events' ages: {e}"));
        }
    };
    watched().set(OLDEST_PENDING_AGE, labels, oldest_pending);
    publish(watch, &report, missing, started.elapsed());
    Ok(())
}

/// The events `named` in a class of `report` ("123", or "123 (published, row deleted)") with
/// their age in seconds by `created_at`, when their rows are still there and the table has the
/// column (others: None).
async fn ages(
    (config, outbox): (&RelayConfig, &Outbox),
    named: &[String],
) -> Result<Vec<(String, Option<f64>)>, VerifyError> {
    let ids: Vec<String> =
        named.iter().filter_map(|named| named.split_whitespace().next().map(String::from)).collect();
    if ids.is_empty() {
        return Ok(Vec::new());
    }
    let table = &outbox.table;
    let (client, _) = crate::postgres::connect_primary(&config.postgres).await?;
    let id_type = table.id_type(&client).await?;
    let mut ages = HashMap::new();
    if let Some(sql) = table.ages_sql(&id_type) {
        let integer = matches!(id_type.as_str(), "bigint" | "integer" | "smallint");
        let asked: Vec<&String> = ids.iter().filter(|id| !integer || id.parse::<i64>().is_ok()).collect();
        for row in client.query(&sql, &[&asked]).await? {
            ages.insert(row.get::<_, String>(0), row.get::<_, f64>(1));
        }
    }
    Ok(ids
        .into_iter()
        .map(|id| {
            let age = ages.get(&id).copied();
            (id, age)
        })
        .collect())
}

/// A finished pass's findings into the gauges, and a log line saying what it found.
fn publish(watch: &mut Watch<'_>, report: &Report, ages: Vec<(String, Option<f64>)>, took: Duration) {
    let w = watched();
    let now = SystemTime::now();
    let oldest = name_missing(watch, &ages, now);
    let labels = &watch.labels;
    let counts = [
        (MISSING, report.missing.count),
        (PENDING, report.pending.count),
        (DUPLICATED, report.duplicated.count),
        (DUPLICATE_RECORDS, report.duplicate_records),
        (OUT_OF_ORDER, report.out_of_order.count),
        (UNEXPECTED, report.unexpected.count),
        (MISMATCHED, report.mismatched.count),
        (FILTERED, report.filtered.count),
        (ROWS, report.rows),
        (RECORDS, report.records),
        (PASS_MEMORY, report.memory_bytes as u64),
    ];
    for (name, count) in counts {
        w.set(name, labels, count as f64);
    }
    w.set(OLDEST_MISSING_AGE, labels, oldest);
    w.set(PASS_DURATION, labels, took.as_secs_f64());
    w.set(LAST_PASS, labels, now.duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default().as_secs_f64());
    let result = match report.exit_code() {
        super::report::EXIT_OK => "ok",
        super::report::EXIT_PENDING => "pending",
        _ => "found",
    };
    w.pass(labels, result);
    log_pass(&labels[1], report, took);
}

/// The missing events named at this pass, each a series with its age (by `created_at`, else
/// since the watch first found it missing); the series of those no longer missing are removed.
/// Returns the oldest age, 0 when none is missing.
fn name_missing(watch: &mut Watch<'_>, ages: &[(String, Option<f64>)], now: SystemTime) -> f64 {
    let w = watched();
    let labels = &watch.labels;
    // the events named last time and no longer missing lose their series
    let named: Vec<&String> = ages.iter().map(|(id, _)| id).collect();
    for gone in watch.missing_since.keys().filter(|id| !named.contains(id)) {
        let series: Vec<&str> = labels.iter().map(String::as_str).chain([gone.as_str()]).collect();
        let _ = w.missing_event.remove_label_values(&series);
    }
    watch.missing_since.retain(|id, _| named.contains(&id));
    let mut oldest: f64 = 0.0;
    for (id, age) in ages {
        let since = *watch.missing_since.entry(id.clone()).or_insert(now);
        let age = age.unwrap_or_else(|| now.duration_since(since).unwrap_or_default().as_secs_f64());
        oldest = oldest.max(age);
        let series: Vec<&str> = labels.iter().map(String::as_str).chain([id.as_str()]).collect();
        w.missing_event.with_label_values(&series).set(age);
    }
    oldest
}

/// A warning naming what is missing or held wrongly, else a line with the pass's counts.
fn log_pass(outbox: &str, report: &Report, took: Duration) {
    if report.missing.count + report.out_of_order.count + report.unexpected.count + report.mismatched.count
        > 0
    {
        tracing::warn!(
            outbox = %outbox,
            missing = report.missing.count,
            first_missing = %report.missing.first.join(", "),
            out_of_order = report.out_of_order.count,
            unexpected = report.unexpected.count,
            mismatched = report.mismatched.count,
            "verify pass found events Kafka lacks or holds wrongly"
        );
    } else {
        tracing::info!(
            outbox = %outbox,
            rows = report.rows,
            records = report.records,
            pending = report.pending.count,
            duplicated = report.duplicated.count,
            filtered = report.filtered.count,
            seconds = took.as_secs_f64(),
            "verify pass"
        );
    }
}
