//! Every metric the relay exports, named once here and registered once.
//!
//! Names follow `outbox_relay_<name>_<unit>[_total]`; labels are low-cardinality only
//! (`mode`, `error_type`, `status`). Lag is in bytes. The dashboards and alert rules use these
//! names, and a test scrapes a real relay to check that every name they use exists.

use std::sync::OnceLock;
use std::time::{Instant, SystemTime};

use prometheus::{
    Encoder, Gauge, GaugeVec, Histogram, HistogramOpts, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry,
    TextEncoder,
};

use crate::position::Lsn;

pub const EVENTS_READ: &str = "outbox_relay_events_read_total";
pub const EVENTS_PUBLISHED: &str = "outbox_relay_events_published_total";
pub const EVENTS_DEAD_LETTERED: &str = "outbox_relay_events_dead_lettered_total";
pub const PUBLISH_ERRORS: &str = "outbox_relay_publish_errors_total";
pub const PUBLISH_LATENCY: &str = "outbox_relay_publish_latency_seconds";
pub const END_TO_END_LATENCY: &str = "outbox_relay_end_to_end_latency_seconds";
pub const EVENTS_IN_FLIGHT: &str = "outbox_relay_events_in_flight";
pub const TRANSACTIONS_IN_FLIGHT: &str = "outbox_relay_transactions_in_flight";
pub const RECEIVED_LSN: &str = "outbox_relay_received_lsn_bytes";
pub const CONFIRMED_LSN: &str = "outbox_relay_confirmed_lsn_bytes";
pub const SERVER_WAL_LSN: &str = "outbox_relay_server_wal_lsn_bytes";
pub const LAST_CONFIRM: &str = "outbox_relay_last_confirm_timestamp_seconds";
pub const SLOT_CONFIRMED_LAG: &str = "outbox_relay_slot_confirmed_lag_bytes";
pub const SLOT_RETAINED_WAL: &str = "outbox_relay_slot_retained_wal_bytes";
pub const SLOT_WAL_STATUS: &str = "outbox_relay_slot_wal_status";
pub const SLOT_SAFE_WAL_SIZE: &str = "outbox_relay_slot_safe_wal_size_bytes";
pub const SLOT_ACTIVE: &str = "outbox_relay_slot_active";
pub const SLOT_LAG_WARNING: &str = "outbox_relay_slot_lag_warning_threshold_bytes";
pub const SLOT_LAG_CRITICAL: &str = "outbox_relay_slot_lag_critical_threshold_bytes";
pub const BACKLOG_EVENTS: &str = "outbox_relay_backlog_events";
pub const BACKLOG_OLDEST_AGE: &str = "outbox_relay_backlog_oldest_age_seconds";
pub const LEADER: &str = "outbox_relay_leader";
pub const BUILD_INFO: &str = "outbox_relay_build_info";
pub const FATAL: &str = "outbox_relay_fatal_error";

/// wal_status values of pg_replication_slots, exported one series each (1 = current).
pub const WAL_STATUSES: &[&str] = &["reserved", "extended", "unreserved", "lost"];

/// `error_type` values of the publish error counter.
pub const ERROR_TYPES: &[&str] = &[
    "permanent",
    "timeout",
    "fatal_producer",
    "broker_down",
    "not_enough_replicas",
    "leader_change",
    "queue_full",
    "stalled",
    "other",
];

/// `reason` values of the fatal error gauge.
pub const FATAL_REASONS: &[&str] = &["slot_lost", "slot_missing", "postgres", "other"];

/// Buckets from 1 ms to 60 s.
const LATENCY_BUCKETS: &[f64] =
    &[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];

pub struct Metrics {
    pub registry: Registry,
    pub events_read: IntCounterVec,
    pub events_published: IntCounterVec,
    pub events_dead_lettered: IntCounterVec,
    pub publish_errors: IntCounterVec,
    pub publish_latency: Histogram,
    pub end_to_end_latency: Histogram,
    pub events_in_flight: IntGauge,
    pub transactions_in_flight: IntGauge,
    pub received_lsn: Gauge,
    pub confirmed_lsn: Gauge,
    pub last_confirm: Gauge,
    pub server_wal_lsn: Gauge,
    pub slot_confirmed_lag: IntGauge,
    pub slot_retained_wal: IntGauge,
    pub slot_wal_status: IntGaugeVec,
    pub slot_safe_wal_size: IntGauge,
    pub slot_active: IntGauge,
    pub slot_lag_warning: IntGauge,
    pub slot_lag_critical: IntGauge,
    pub backlog_events: IntGauge,
    pub backlog_oldest_age: Gauge,
    pub leader: IntGauge,
    pub build_info: GaugeVec,
    pub fatal: IntGaugeVec,
}

fn counter(registry: &Registry, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    let c = IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric");
    registry.register(Box::new(c.clone())).expect("registered once");
    c
}

fn int_gauge(registry: &Registry, name: &str, help: &str) -> IntGauge {
    let g = IntGauge::new(name, help).expect("valid metric");
    registry.register(Box::new(g.clone())).expect("registered once");
    g
}

fn gauge(registry: &Registry, name: &str, help: &str) -> Gauge {
    let g = Gauge::new(name, help).expect("valid metric");
    registry.register(Box::new(g.clone())).expect("registered once");
    g
}

fn histogram(registry: &Registry, name: &str, help: &str) -> Histogram {
    let h = Histogram::with_opts(HistogramOpts::new(name, help).buckets(LATENCY_BUCKETS.to_vec()))
        .expect("valid metric");
    registry.register(Box::new(h.clone())).expect("registered once");
    h
}

impl Metrics {
    fn new() -> Metrics {
        let r = Registry::new();
        let slot_wal_status = IntGaugeVec::new(
            Opts::new(
                SLOT_WAL_STATUS,
                "1 for the slot's current wal_status (reserved, extended, unreserved, lost)",
            ),
            &["status"],
        )
        .expect("valid metric");
        r.register(Box::new(slot_wal_status.clone())).expect("registered once");
        let build_info = GaugeVec::new(
            Opts::new(BUILD_INFO, "Always 1; labels say the version and source mode"),
            &["version", "mode"],
        )
        .expect("valid metric");
        r.register(Box::new(build_info.clone())).expect("registered once");
        let fatal = IntGaugeVec::new(
            Opts::new(
                FATAL,
                "1 when the relay stopped on a fatal error (reason: slot_lost, slot_missing, config, other)",
            ),
            &["reason"],
        )
        .expect("valid metric");
        r.register(Box::new(fatal.clone())).expect("registered once");
        Metrics {
            events_read: counter(&r, EVENTS_READ, "Events read from the source", &["mode"]),
            events_published: counter(
                &r,
                EVENTS_PUBLISHED,
                "Events acknowledged by Kafka (acks=all)",
                &["mode"],
            ),
            events_dead_lettered: counter(
                &r,
                EVENTS_DEAD_LETTERED,
                "Events moved to the dead-letter table",
                &["mode"],
            ),
            publish_errors: counter(
                &r,
                PUBLISH_ERRORS,
                "Records Kafka did not acknowledge, by error type",
                &["error_type"],
            ),
            publish_latency: histogram(
                &r,
                PUBLISH_LATENCY,
                "From handing a record to the producer to its acknowledgement",
            ),
            end_to_end_latency: histogram(
                &r,
                END_TO_END_LATENCY,
                "From the transaction's commit (replication) or created_at (polling) to the acknowledgement",
            ),
            events_in_flight: int_gauge(
                &r,
                EVENTS_IN_FLIGHT,
                "Events sent to Kafka and not yet acknowledged",
            ),
            transactions_in_flight: int_gauge(
                &r,
                TRANSACTIONS_IN_FLIGHT,
                "Transactions received and not yet confirmed",
            ),
            received_lsn: gauge(
                &r,
                RECEIVED_LSN,
                "Last WAL position received from the slot, as a byte offset",
            ),
            confirmed_lsn: gauge(
                &r,
                CONFIRMED_LSN,
                "Last WAL position confirmed to PostgreSQL, as a byte offset",
            ),
            last_confirm: gauge(
                &r,
                LAST_CONFIRM,
                "Unix time of the last confirmation that moved the position",
            ),
            server_wal_lsn: gauge(&r, SERVER_WAL_LSN, "pg_current_wal_lsn() as a byte offset (sampled)"),
            slot_confirmed_lag: int_gauge(
                &r,
                SLOT_CONFIRMED_LAG,
                "pg_current_wal_lsn() - confirmed_flush_lsn of the slot",
            ),
            slot_retained_wal: int_gauge(
                &r,
                SLOT_RETAINED_WAL,
                "pg_current_wal_lsn() - restart_lsn: WAL the slot keeps",
            ),
            slot_wal_status,
            slot_safe_wal_size: int_gauge(
                &r,
                SLOT_SAFE_WAL_SIZE,
                "WAL that can still be written before the slot is lost",
            ),
            slot_active: int_gauge(&r, SLOT_ACTIVE, "1 when a walsender streams from the slot"),
            slot_lag_warning: int_gauge(
                &r,
                SLOT_LAG_WARNING,
                "metrics.slot_lag_warning_bytes, for alert rules",
            ),
            slot_lag_critical: int_gauge(
                &r,
                SLOT_LAG_CRITICAL,
                "metrics.slot_lag_critical_bytes, for alert rules",
            ),
            backlog_events: int_gauge(
                &r,
                BACKLOG_EVENTS,
                "Unpublished rows in the outbox table (polling; capped at 1e6)",
            ),
            backlog_oldest_age: gauge(&r, BACKLOG_OLDEST_AGE, "Age of the oldest unpublished row (polling)"),
            leader: int_gauge(&r, LEADER, "1 when this instance is the active relay, 0 when standby"),
            build_info,
            fatal,
            registry: r,
        }
    }

    /// Creates every labelled series at zero, so a scrape lists each metric from the start and
    /// `rate()`/`increase()` see the first event.
    pub fn initialize(&self, mode: &str, version: &str) {
        for counter in [&self.events_read, &self.events_published, &self.events_dead_lettered] {
            counter.with_label_values(&[mode]);
        }
        for error_type in ERROR_TYPES {
            self.publish_errors.with_label_values(&[error_type]);
        }
        for status in WAL_STATUSES {
            self.slot_wal_status.with_label_values(&[status]);
        }
        for reason in FATAL_REASONS {
            self.fatal.with_label_values(&[reason]);
        }
        self.build_info.with_label_values(&[version, mode]).set(1.0);
    }

    /// A record was acknowledged: count it and observe both latencies.
    pub fn acknowledged(&self, mode: &str, sent: Instant, created_at: Option<SystemTime>) {
        self.events_published.with_label_values(&[mode]).inc();
        self.publish_latency.observe(sent.elapsed().as_secs_f64());
        if let Some(age) = created_at.and_then(|t| t.elapsed().ok()) {
            self.end_to_end_latency.observe(age.as_secs_f64());
        }
    }

    pub fn confirmed(&self, lsn: Lsn) {
        self.confirmed_lsn.set(lsn.0 as f64);
        let now = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default();
        self.last_confirm.set(now.as_secs_f64());
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        let mut out = Vec::new();
        TextEncoder::new().encode(&self.registry.gather(), &mut out).expect("text encoding");
        String::from_utf8(out).expect("utf-8 exposition")
    }
}

/// The process's metrics.
pub fn metrics() -> &'static Metrics {
    static METRICS: OnceLock<Metrics> = OnceLock::new();
    METRICS.get_or_init(Metrics::new)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_metric_renders_with_its_name() {
        let m = metrics();
        m.events_read.with_label_values(&["polling"]).inc();
        m.events_published.with_label_values(&["polling"]).inc();
        m.events_dead_lettered.with_label_values(&["polling"]).inc();
        m.publish_errors.with_label_values(&["timeout"]).inc();
        m.slot_wal_status.with_label_values(&["reserved"]).set(1);
        m.build_info.with_label_values(&["0", "polling"]).set(1.0);
        m.fatal.with_label_values(&["other"]).set(0);
        m.acknowledged("polling", Instant::now(), Some(SystemTime::now()));
        let text = m.render();
        for name in
            [EVENTS_READ, PUBLISH_LATENCY, END_TO_END_LATENCY, SLOT_CONFIRMED_LAG, LEADER, BUILD_INFO, FATAL]
        {
            assert!(text.contains(&format!("# TYPE {name} ")), "{name} missing");
        }
        assert!(text.contains("outbox_relay_end_to_end_latency_seconds_bucket{le=\"0.001\"}"));
        assert!(text.contains("outbox_relay_end_to_end_latency_seconds_bucket{le=\"60\"}"));
    }
}
