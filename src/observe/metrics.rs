//! Every metric the relay exports, named once here and registered once.
//!
//! Names follow `outbox_relay_<name>_<unit>[_total]`; labels are low-cardinality only
//! (`mode`, `error_type`, `status`). Lag is in bytes. The dashboards and alert rules use these
//! names, and a test scrapes a real relay to check that every name they use exists.
//!
//! Every series also carries the deployment's labels ([`DEPLOYMENT_LABELS`]: `database`,
//! `outbox`, `slot`, from the configuration), added when rendered: two relays of two databases
//! scraped under one job stay apart, and the alert rules aggregate by them.

use std::sync::{Mutex, OnceLock};
use std::time::{Instant, SystemTime};

use prometheus::proto::LabelPair;
use prometheus::{
    Encoder, Gauge, GaugeVec, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, IntGaugeVec,
    Opts, Registry, TextEncoder,
};

use crate::lsn::Lsn;

mod labels;
pub use labels::{ErrorType, Mode, ScanResult, SkippedKind, SpanDropReason, TransactionOutcome, WalStatus};

pub const EVENTS_READ: &str = "outbox_relay_events_read_total";
pub const EVENTS_PUBLISHED: &str = "outbox_relay_events_published_total";
pub const EVENTS_DEAD_LETTERED: &str = "outbox_relay_events_dead_lettered_total";
pub const PUBLISH_ERRORS: &str = "outbox_relay_publish_errors_total";
pub const PUBLISH_LATENCY: &str = "outbox_relay_publish_latency_seconds";
pub const END_TO_END_LATENCY: &str = "outbox_relay_end_to_end_latency_seconds";
pub const EVENTS_IN_FLIGHT: &str = "outbox_relay_events_in_flight";
pub const BYTES_IN_FLIGHT: &str = "outbox_relay_bytes_in_flight";
pub const KAFKA_UNACKNOWLEDGED: &str = "outbox_relay_kafka_unacknowledged_seconds";
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
pub const SLOT_FAILOVER: &str = "outbox_relay_slot_failover";
pub const FAILOVER_STANDBYS_READY: &str = "outbox_relay_failover_standbys_ready";
pub const SWITCHOVER_READY_STANDBYS: &str = "outbox_relay_switchover_ready_standbys";
pub const SLOT_INACTIVE: &str = "outbox_relay_slot_inactive_seconds";
pub const SLOT_IDLE_TIMEOUT_REMAINING: &str = "outbox_relay_slot_idle_timeout_remaining_seconds";
pub const SLOT_LAG_WARNING: &str = "outbox_relay_slot_lag_warning_threshold_bytes";
pub const SLOT_LAG_CRITICAL: &str = "outbox_relay_slot_lag_critical_threshold_bytes";
pub const BACKLOG_EVENTS: &str = "outbox_relay_backlog_events";
pub const BACKLOG_OLDEST_AGE: &str = "outbox_relay_backlog_oldest_age_seconds";
pub const LEADER: &str = "outbox_relay_leader";
pub const BUILD_INFO: &str = "outbox_relay_build_info";
pub const FATAL: &str = "outbox_relay_fatal_error";
pub const EVENTS_BLOCKED: &str = "outbox_relay_events_blocked";
pub const PAUSED: &str = "outbox_relay_paused";
pub const PAUSED_BY: &str = "outbox_relay_paused_by";
pub const STREAM_MESSAGES_SKIPPED: &str = "outbox_relay_stream_messages_skipped_total";
pub const DEDUP_SKIPPED: &str = "outbox_relay_dedup_skipped_total";
pub const DEDUP_SCANS: &str = "outbox_relay_dedup_scans_total";
pub const DEDUP_SCANNED_RECORDS: &str = "outbox_relay_dedup_scanned_records_total";
pub const KAFKA_TRANSACTIONS: &str = "outbox_relay_kafka_transactions_total";
pub const DEAD_LETTERS_OUTSTANDING: &str = "outbox_relay_dead_letters_outstanding";
pub const DEAD_LETTERS_OLDEST_AGE: &str = "outbox_relay_dead_letters_oldest_age_seconds";
pub const DEFAULT_PARTITION_ROWS: &str = "outbox_relay_outbox_default_partition_rows";
pub const PARTITIONS_AHEAD: &str = "outbox_relay_outbox_partitions_ahead_seconds";
pub const OUTBOX_EVENTS_PUBLISHED: &str = "outbox_relay_outbox_events_published_total";
pub const OUTBOX_EVENTS_DEAD_LETTERED: &str = "outbox_relay_outbox_events_dead_lettered_total";
pub const OUTBOX_EVENTS_FILTERED: &str = "outbox_relay_outbox_events_filtered_total";
pub const OUTBOX_BACKLOG_EVENTS: &str = "outbox_relay_outbox_backlog_events";
pub const OUTBOX_DEAD_LETTERS_OUTSTANDING: &str = "outbox_relay_outbox_dead_letters_outstanding";
pub const CREDENTIAL_REFRESH_FAILURES: &str = "outbox_relay_credential_refresh_failures_total";
pub const CREDENTIAL_EXPIRY: &str = "outbox_relay_credential_expiry_timestamp_seconds";
pub const TRACE_SPANS_EXPORTED: &str = "outbox_relay_trace_spans_exported_total";
pub const TRACE_SPANS_DROPPED: &str = "outbox_relay_trace_spans_dropped_total";

/// The label of the per-outbox series: the outbox's name (`RelayConfig::outboxes`), so there are
/// as many series as configured outboxes.
pub const OUTBOX_NAME_LABEL: &str = "outbox_name";

/// The labels on every series, naming the deployment a relay belongs to: the replicas of one
/// deployment share them (they compete for one slot, or one polling lock), two deployments
/// differ in at least one.
pub const DEPLOYMENT_LABELS: [&str; 3] = ["database", "outbox", "slot"];

/// The values of [`DEPLOYMENT_LABELS`] for `config`: `postgres.database`, the outbox table as
/// `schema.table` (several: comma-separated, in the configured order), and `replication.slot`
/// (in polling mode too, so a mode switch keeps them).
pub fn deployment_labels(config: &crate::config::RelayConfig) -> [String; 3] {
    let tables: Vec<String> = config.outboxes().iter().map(|o| o.config.display_name()).collect();
    [config.postgres.database.clone(), tables.join(","), config.replication.slot.clone()]
}

/// The values of [`DEPLOYMENT_LABELS`] for one of `config`'s outboxes alone (`verify --watch`,
/// per outbox).
pub fn outbox_labels(
    config: &crate::config::RelayConfig,
    outbox: &crate::config::OutboxConfig,
) -> [String; 3] {
    [config.postgres.database.clone(), outbox.display_name(), config.replication.slot.clone()]
}

/// Every metric with its help text, in the order they are documented.
pub const ALL: &[(&str, &str)] = &[
    (EVENTS_READ, "Events read from the source"),
    (EVENTS_PUBLISHED, "Events acknowledged by Kafka (acks=all)"),
    (EVENTS_DEAD_LETTERED, "Events moved to the dead-letter table"),
    (EVENTS_BLOCKED, "1 while the relay holds at an unpublishable event (dead_letter.on_poison = block)"),
    (PAUSED, "1 while an operator has paused publishing (the admin API); /readyz says by whom"),
    (
        PAUSED_BY,
        "1 for who paused publishing (label by) while paused; a single series by=\"\" at 0 otherwise",
    ),
    (PUBLISH_ERRORS, "Records Kafka did not acknowledge, by error type"),
    (PUBLISH_LATENCY, "From handing a record to the producer to its acknowledgement"),
    (
        END_TO_END_LATENCY,
        "From the transaction's commit (replication) or created_at (polling) to the acknowledgement",
    ),
    (EVENTS_IN_FLIGHT, "Events sent to Kafka and not yet acknowledged"),
    (
        KAFKA_UNACKNOWLEDGED,
        "Seconds since Kafka last acknowledged a record while records wait for it; 0 when none wait",
    ),
    (
        BYTES_IN_FLIGHT,
        "Bytes of the records sent to Kafka and not yet acknowledged (bounded by replication.max_in_flight_bytes and polling.max_batch_bytes)",
    ),
    (TRANSACTIONS_IN_FLIGHT, "Transactions received and not yet confirmed"),
    (RECEIVED_LSN, "Last WAL position received from the slot, as a byte offset"),
    (CONFIRMED_LSN, "Last WAL position confirmed to PostgreSQL, as a byte offset"),
    (SERVER_WAL_LSN, "pg_current_wal_lsn() as a byte offset (sampled)"),
    (LAST_CONFIRM, "Unix time of the last confirmation that moved the position"),
    (SLOT_CONFIRMED_LAG, "pg_current_wal_lsn() - confirmed_flush_lsn of the slot"),
    (SLOT_RETAINED_WAL, "pg_current_wal_lsn() - restart_lsn: WAL the slot keeps"),
    (SLOT_WAL_STATUS, "1 for the slot's current wal_status (reserved, extended, unreserved, lost)"),
    (SLOT_SAFE_WAL_SIZE, "WAL that can still be written before the slot is lost"),
    (SLOT_ACTIVE, "1 when a walsender streams from the slot"),
    (SLOT_FAILOVER, "1 when the slot is a failover slot (PostgreSQL 17+)"),
    (
        FAILOVER_STANDBYS_READY,
        "Servers of postgres.host other than the primary whose copy of the slot a promotion keeps",
    ),
    (
        SWITCHOVER_READY_STANDBYS,
        "Of those, the ones whose copy has reached the relay's confirmed position: a planned switchover to one sends nothing twice",
    ),
    (SLOT_INACTIVE, "Seconds since the slot was last streamed from (0 while active; PostgreSQL 17+)"),
    (
        SLOT_IDLE_TIMEOUT_REMAINING,
        "Seconds before idle_replication_slot_timeout invalidates the idle slot (-1: no timeout; PostgreSQL 18+)",
    ),
    (SLOT_LAG_WARNING, "metrics.slot_lag_warning_bytes, for alert rules"),
    (SLOT_LAG_CRITICAL, "metrics.slot_lag_critical_bytes, for alert rules"),
    (BACKLOG_EVENTS, "Unpublished rows in the outbox table (polling; capped at 1e6)"),
    (BACKLOG_OLDEST_AGE, "Age of the oldest unpublished row (polling)"),
    (LEADER, "1 when this instance is the active relay, 0 when standby"),
    (BUILD_INFO, "Always 1; labels say the version and source mode"),
    (
        FATAL,
        "1 when the relay stopped on a fatal error (reason: slot_lost, slot_missing, failover_without_slot, publication, outbox_changed, schema, auth, tls, encoding, too_large, privilege, config, protocol, other)",
    ),
    (
        STREAM_MESSAGES_SKIPPED,
        "Replication stream messages the relay does not act on, by kind (unknown: a kind it does not know)",
    ),
    (DEDUP_SKIPPED, "Replayed events not sent again because the topic already holds them"),
    (
        DEDUP_SCANS,
        "Topics read back before a session's first record to them, by result (complete, topic_missing; truncated and limit may send older replayed events again)",
    ),
    (DEDUP_SCANNED_RECORDS, "Records read back from topics to find what they already hold"),
    (
        KAFKA_TRANSACTIONS,
        "Kafka transactions that ended (kafka.transactional), by outcome: committed, aborted (sent again), fenced (another producer of the transactional.id took over)",
    ),
    (
        DEAD_LETTERS_OUTSTANDING,
        "Rows of this outbox waiting in the dead-letter table (sampled; capped at 1e6; -1: the table cannot be read)",
    ),
    (
        DEAD_LETTERS_OLDEST_AGE,
        "Age of the oldest letter of this outbox in the dead-letter table (sampled; 0: none)",
    ),
    (
        DEFAULT_PARTITION_ROWS,
        "Rows in the outbox table's default partition, PostgreSQL's estimate (sampled; 0 without one)",
    ),
    (
        PARTITIONS_AHEAD,
        "Seconds from now to the end of the outbox table's last range partition (sampled; -1: not range-partitioned)",
    ),
    (OUTBOX_EVENTS_PUBLISHED, "Events of each outbox acknowledged by Kafka, by outbox name"),
    (OUTBOX_EVENTS_DEAD_LETTERED, "Events of each outbox moved to its dead-letter table, by outbox name"),
    (
        OUTBOX_EVENTS_FILTERED,
        "Events of each outbox its transforms filtered out (released unsent), by outbox name",
    ),
    (OUTBOX_BACKLOG_EVENTS, "Unpublished rows of each outbox table, by outbox name (polling; capped at 1e6)"),
    (
        OUTBOX_DEAD_LETTERS_OUTSTANDING,
        "Rows of each outbox waiting in its dead-letter table, by outbox name (sampled; -1: cannot be read)",
    ),
    (
        CREDENTIAL_REFRESH_FAILURES,
        "Failed requests for a Kafka OAUTHBEARER token ([kafka.auth]: an identity provider, a token file, AWS credentials)",
    ),
    (
        CREDENTIAL_EXPIRY,
        "Unix time at which the Kafka token the relay holds expires ([kafka.auth]; 0: none yet)",
    ),
    (TRACE_SPANS_EXPORTED, "Spans the tracing backend accepted ([tracing])"),
    (
        TRACE_SPANS_DROPPED,
        "Finished spans not exported, by reason (queue_full, export_failed); no event is ever held for a span",
    ),
];

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
    pub bytes_in_flight: IntGauge,
    pub kafka_unacknowledged: Gauge,
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
    pub slot_failover: IntGauge,
    pub failover_standbys_ready: IntGauge,
    pub switchover_ready_standbys: IntGauge,
    pub slot_inactive: Gauge,
    pub slot_idle_timeout_remaining: Gauge,
    pub slot_lag_warning: IntGauge,
    pub slot_lag_critical: IntGauge,
    pub backlog_events: IntGauge,
    pub backlog_oldest_age: Gauge,
    pub leader: IntGauge,
    pub build_info: GaugeVec,
    pub fatal: IntGaugeVec,
    pub events_blocked: IntGauge,
    pub paused: IntGauge,
    pub paused_by: IntGaugeVec,
    pub stream_messages_skipped: IntCounterVec,
    pub dedup_skipped: IntCounterVec,
    pub dedup_scans: IntCounterVec,
    pub dedup_scanned_records: IntCounter,
    pub kafka_transactions: IntCounterVec,
    pub dead_letters_outstanding: IntGauge,
    pub dead_letters_oldest_age: Gauge,
    pub default_partition_rows: IntGauge,
    pub partitions_ahead: Gauge,
    pub outbox_events_published: IntCounterVec,
    pub outbox_events_dead_lettered: IntCounterVec,
    pub outbox_events_filtered: IntCounterVec,
    pub outbox_backlog_events: IntGaugeVec,
    pub outbox_dead_letters_outstanding: IntGaugeVec,
    pub credential_refresh_failures: IntCounter,
    pub credential_expiry: Gauge,
    pub trace_spans_exported: IntCounter,
    pub trace_spans_dropped: IntCounterVec,
    /// [`DEPLOYMENT_LABELS`] with their values, once known.
    deployment: Mutex<Vec<LabelPair>>,
}

fn help(name: &str) -> &'static str {
    ALL.iter().find(|(n, _)| *n == name).map(|(_, h)| *h).expect("every metric is in ALL")
}

fn register<M: prometheus::core::Collector + Clone + 'static>(registry: &Registry, metric: M) -> M {
    registry.register(Box::new(metric.clone())).expect("registered once");
    metric
}

fn counter(r: &Registry, name: &str, labels: &[&str]) -> IntCounterVec {
    register(r, IntCounterVec::new(Opts::new(name, help(name)), labels).expect("valid metric"))
}

fn int_counter(r: &Registry, name: &str) -> IntCounter {
    register(r, IntCounter::new(name, help(name)).expect("valid metric"))
}

fn int_gauge(r: &Registry, name: &str) -> IntGauge {
    register(r, IntGauge::new(name, help(name)).expect("valid metric"))
}

fn int_gauge_vec(r: &Registry, name: &str, labels: &[&str]) -> IntGaugeVec {
    register(r, IntGaugeVec::new(Opts::new(name, help(name)), labels).expect("valid metric"))
}

fn gauge(r: &Registry, name: &str) -> Gauge {
    register(r, Gauge::new(name, help(name)).expect("valid metric"))
}

fn gauge_vec(r: &Registry, name: &str, labels: &[&str]) -> GaugeVec {
    register(r, GaugeVec::new(Opts::new(name, help(name)), labels).expect("valid metric"))
}

fn histogram(r: &Registry, name: &str) -> Histogram {
    let opts = HistogramOpts::new(name, help(name)).buckets(LATENCY_BUCKETS.to_vec());
    register(r, Histogram::with_opts(opts).expect("valid metric"))
}

impl Metrics {
    /// Creates every metric and registers it once, each through the helper of its type (its help
    /// text from [`ALL`]); one registry per process: [`metrics`].
    fn new() -> Metrics {
        let r = Registry::new();
        Metrics {
            events_read: counter(&r, EVENTS_READ, &["mode"]),
            events_published: counter(&r, EVENTS_PUBLISHED, &["mode"]),
            events_dead_lettered: counter(&r, EVENTS_DEAD_LETTERED, &["mode"]),
            events_blocked: int_gauge(&r, EVENTS_BLOCKED),
            paused: int_gauge(&r, PAUSED),
            paused_by: int_gauge_vec(&r, PAUSED_BY, &["by"]),
            publish_errors: counter(&r, PUBLISH_ERRORS, &["error_type"]),
            publish_latency: histogram(&r, PUBLISH_LATENCY),
            end_to_end_latency: histogram(&r, END_TO_END_LATENCY),
            events_in_flight: int_gauge(&r, EVENTS_IN_FLIGHT),
            bytes_in_flight: int_gauge(&r, BYTES_IN_FLIGHT),
            kafka_unacknowledged: gauge(&r, KAFKA_UNACKNOWLEDGED),
            transactions_in_flight: int_gauge(&r, TRANSACTIONS_IN_FLIGHT),
            received_lsn: gauge(&r, RECEIVED_LSN),
            confirmed_lsn: gauge(&r, CONFIRMED_LSN),
            server_wal_lsn: gauge(&r, SERVER_WAL_LSN),
            last_confirm: gauge(&r, LAST_CONFIRM),
            slot_confirmed_lag: int_gauge(&r, SLOT_CONFIRMED_LAG),
            slot_retained_wal: int_gauge(&r, SLOT_RETAINED_WAL),
            slot_wal_status: int_gauge_vec(&r, SLOT_WAL_STATUS, &["status"]),
            slot_safe_wal_size: int_gauge(&r, SLOT_SAFE_WAL_SIZE),
            slot_active: int_gauge(&r, SLOT_ACTIVE),
            slot_failover: int_gauge(&r, SLOT_FAILOVER),
            failover_standbys_ready: int_gauge(&r, FAILOVER_STANDBYS_READY),
            switchover_ready_standbys: int_gauge(&r, SWITCHOVER_READY_STANDBYS),
            slot_inactive: gauge(&r, SLOT_INACTIVE),
            slot_idle_timeout_remaining: gauge(&r, SLOT_IDLE_TIMEOUT_REMAINING),
            slot_lag_warning: int_gauge(&r, SLOT_LAG_WARNING),
            slot_lag_critical: int_gauge(&r, SLOT_LAG_CRITICAL),
            backlog_events: int_gauge(&r, BACKLOG_EVENTS),
            backlog_oldest_age: gauge(&r, BACKLOG_OLDEST_AGE),
            leader: int_gauge(&r, LEADER),
            build_info: gauge_vec(&r, BUILD_INFO, &["version", "mode"]),
            fatal: int_gauge_vec(&r, FATAL, &["reason"]),
            stream_messages_skipped: counter(&r, STREAM_MESSAGES_SKIPPED, &["kind"]),
            dedup_skipped: counter(&r, DEDUP_SKIPPED, &["mode"]),
            dedup_scans: counter(&r, DEDUP_SCANS, &["result"]),
            dedup_scanned_records: int_counter(&r, DEDUP_SCANNED_RECORDS),
            kafka_transactions: counter(&r, KAFKA_TRANSACTIONS, &["outcome"]),
            dead_letters_outstanding: int_gauge(&r, DEAD_LETTERS_OUTSTANDING),
            dead_letters_oldest_age: gauge(&r, DEAD_LETTERS_OLDEST_AGE),
            default_partition_rows: int_gauge(&r, DEFAULT_PARTITION_ROWS),
            partitions_ahead: gauge(&r, PARTITIONS_AHEAD),
            outbox_events_published: counter(&r, OUTBOX_EVENTS_PUBLISHED, &[OUTBOX_NAME_LABEL]),
            outbox_events_dead_lettered: counter(&r, OUTBOX_EVENTS_DEAD_LETTERED, &[OUTBOX_NAME_LABEL]),
            outbox_events_filtered: counter(&r, OUTBOX_EVENTS_FILTERED, &[OUTBOX_NAME_LABEL]),
            outbox_backlog_events: int_gauge_vec(&r, OUTBOX_BACKLOG_EVENTS, &[OUTBOX_NAME_LABEL]),
            outbox_dead_letters_outstanding: int_gauge_vec(
                &r,
                OUTBOX_DEAD_LETTERS_OUTSTANDING,
                &[OUTBOX_NAME_LABEL],
            ),
            credential_refresh_failures: int_counter(&r, CREDENTIAL_REFRESH_FAILURES),
            credential_expiry: gauge(&r, CREDENTIAL_EXPIRY),
            trace_spans_exported: int_counter(&r, TRACE_SPANS_EXPORTED),
            trace_spans_dropped: counter(&r, TRACE_SPANS_DROPPED, &["reason"]),
            deployment: Mutex::default(),
            registry: r,
        }
    }

    /// Labels every series with the deployment's [`DEPLOYMENT_LABELS`] from now on.
    pub fn label_deployment(&self, values: [String; 3]) {
        let pairs = DEPLOYMENT_LABELS
            .iter()
            .zip(values)
            .map(|(name, value)| {
                let mut pair = LabelPair::default();
                pair.set_name(name.to_string());
                pair.set_value(value);
                pair
            })
            .collect();
        *self.deployment.lock().unwrap() = pairs;
    }

    /// Creates the series of each outbox (by name) at zero, as [`Metrics::initialize`].
    pub fn initialize_outboxes<'n>(&self, names: impl IntoIterator<Item = &'n str>) {
        for name in names {
            self.outbox_events_published.with_label_values(&[name]);
            self.outbox_events_dead_lettered.with_label_values(&[name]);
            self.outbox_events_filtered.with_label_values(&[name]);
            self.outbox_backlog_events.with_label_values(&[name]);
            self.outbox_dead_letters_outstanding.with_label_values(&[name]);
        }
    }

    /// Creates every labelled series at zero, so a scrape lists each metric from the start and
    /// `rate()`/`increase()` see the first event.
    pub fn initialize(&self, mode: Mode, version: &str) {
        for counter in
            [&self.events_read, &self.events_published, &self.events_dead_lettered, &self.dedup_skipped]
        {
            counter.with_label_values(&[mode.label()]);
        }
        for error_type in ErrorType::ALL {
            self.publish_errors.with_label_values(&[error_type.label()]);
        }
        for status in WalStatus::ALL {
            self.slot_wal_status.with_label_values(&[status.label()]);
        }
        for reason in crate::error::FatalReason::ALL {
            self.fatal.with_label_values(&[reason.label()]);
        }
        for kind in SkippedKind::ALL {
            self.stream_messages_skipped.with_label_values(&[kind.label()]);
        }
        for result in ScanResult::ALL {
            self.dedup_scans.with_label_values(&[result.label()]);
        }
        for outcome in TransactionOutcome::ALL {
            self.kafka_transactions.with_label_values(&[outcome.label()]);
        }
        for reason in SpanDropReason::ALL {
            self.trace_spans_dropped.with_label_values(&[reason.label()]);
        }
        self.paused_by.with_label_values(&[""]);
        self.build_info.with_label_values(&[version, mode.label()]).set(1.0);
        self.slot_idle_timeout_remaining.set(-1.0);
        self.partitions_ahead.set(-1.0);
    }

    /// A record acknowledged, counted on `published` (the mode's `events_published`), with the
    /// clock read once for a run of acknowledgements rather than once per record.
    pub fn acknowledged_at(
        &self,
        published: &IntCounter,
        sent: Instant,
        created_at: Option<SystemTime>,
        at: &Clock,
    ) {
        published.inc();
        self.publish_latency.observe(at.now.saturating_duration_since(sent).as_secs_f64());
        if let Some(age) = created_at.and_then(|t| at.wall.duration_since(t).ok()) {
            self.end_to_end_latency.observe(age.as_secs_f64());
        }
    }

    pub fn confirmed(&self, lsn: Lsn) {
        self.confirmed_lsn.set(lsn.0 as f64);
        let now = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default();
        self.last_confirm.set(now.as_secs_f64());
    }

    /// The Prometheus text exposition of every metric, each series with the deployment's labels.
    pub fn render(&self) -> String {
        let mut families = self.registry.gather();
        let deployment = self.deployment.lock().unwrap().clone();
        for family in &mut families {
            for metric in family.mut_metric() {
                let mut labels = metric.take_label();
                labels.extend(deployment.iter().cloned());
                metric.set_label(labels);
            }
        }
        let mut out = Vec::new();
        TextEncoder::new().encode(&families, &mut out).expect("text encoding");
        String::from_utf8(out).expect("utf-8 exposition")
    }
}

/// The monotonic and the wall clock, read together once for a run of records.
#[derive(Debug, Clone, Copy)]
pub struct Clock {
    pub now: Instant,
    pub wall: SystemTime,
}

impl Clock {
    pub fn now() -> Clock {
        Clock { now: Instant::now(), wall: SystemTime::now() }
    }
}

/// The process's metrics.
pub fn metrics() -> &'static Metrics {
    static METRICS: OnceLock<Metrics> = OnceLock::new();
    METRICS.get_or_init(Metrics::new)
}

#[cfg(test)]
mod tests;
