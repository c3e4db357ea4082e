//! Configuration: a TOML file, then environment variables `OUTBOX_RELAY__SECTION__KEY`.
//!
//! Invariants:
//! - every struct denies unknown fields, so a typo is an error, not a silently ignored setting;
//! - every error names the offending path (`kafka.brokers: must not be empty`);
//! - secrets are wrapped in [`Secret`], whose `Debug` and `Serialize` print a placeholder, so the
//!   effective configuration can be logged as it is; a `kafka.properties` value is redacted
//!   unless its key is known to hold no credential (`secrets`).

use std::fmt;

use serde::{Deserialize, Serialize};

mod admin;
mod format;
mod kafka;
mod kafka_auth;
mod load;
mod outbox;
mod postgres;
pub mod registry;
mod secrets;
mod spans;
mod transforms;
mod validate;
pub use crate::secret::Secret;
pub use admin::{
    AdminConfig, AdminScope, AdminToken, DEFAULT_SIGNAL_OPERATOR_ROLE, MIN_ADMIN_TOKEN_BYTES,
    SUGGESTED_ADMIN_LISTEN,
};
pub use format::{CloudEventsConfig, CloudEventsMode, Converter, DebeziumConfig, RecordFormat};
pub use kafka::{KafkaConfig, KafkaProperty, built_in_features};
pub use kafka_auth::{AuthMechanism, KafkaAuthConfig};
pub use load::load_layered;
pub use outbox::{ColumnsConfig, OutboxConfig, OutboxEntry, OutboxId, PerOutbox};
pub use postgres::{Endpoint, PgAuth, PostgresConfig, SslMode};
pub use secrets::{file_mode_warning, is_secret_kafka_property};
pub use spans::{TracingConfig, TracingSettings};
pub use transforms::{
    HEADER_COLUMN_ALIAS, HEADER_COLUMNS, HeaderRule, HeaderSource, Placement, RESERVED_HEADER_PREFIX,
    RESERVED_HEADERS, ROUTE_PLACEHOLDER, RedactAction, RedactRule, TransformsConfig, is_reserved_header,
    pointer_tokens,
};

pub const ENV_PREFIX: &str = "OUTBOX_RELAY";
pub const DEFAULT_PG_HOST: &str = "127.0.0.1";
pub const DEFAULT_PG_PORT: u16 = 5432;
pub const DEFAULT_PG_USER: &str = "outbox_relay";
pub const DEFAULT_PG_DATABASE: &str = "postgres";
pub const DEFAULT_PG_CONNECT_TIMEOUT_SECS: u64 = 10;
pub const DEFAULT_PG_APPLICATION_NAME: &str = "outbox-relay";
pub const DEFAULT_KAFKA_CLIENT_ID: &str = "outbox-relay";
pub const DEFAULT_KAFKA_MESSAGE_TIMEOUT_MS: u64 = 0;
pub const DEFAULT_KAFKA_STALL_WARNING_MS: u64 = 10_000;
pub const DEFAULT_KAFKA_LINGER_MS: u64 = 5;
pub const DEFAULT_KAFKA_COMPRESSION: &str = "none";
pub const DEFAULT_KAFKA_TRANSACTION_TIMEOUT_MS: u64 = 60_000;
pub const DEFAULT_KAFKA_TRANSACTION_MAX_EVENTS: usize = 10_000;
pub const DEFAULT_KAFKA_TRANSACTION_MAX_BYTES: usize = 16 << 20;
pub const DEFAULT_KAFKA_TRANSACTION_MAX_MS: u64 = 100;
pub const DEFAULT_OUTBOX_SCHEMA: &str = "public";
pub const DEFAULT_OUTBOX_TABLE: &str = "outbox_events";
pub const DEFAULT_TOPIC_TEMPLATE: &str = "outbox.event.{aggregate_type}";
pub const DEFAULT_POLL_BATCH_SIZE: u32 = 5_000;
pub const DEFAULT_POLL_INTERVAL_MS: u64 = 1_000;
pub const DEFAULT_NOTIFY_CHANNEL: &str = "outbox_events";
pub const DEFAULT_DEAD_LETTER_TABLE: &str = "public.outbox_dead_letter";
pub const DEFAULT_PUBLISHED_AT_COLUMN: &str = "published_at";
pub const DEFAULT_CLAIM_TIMEOUT_MS: u64 = 30_000;
pub const DEFAULT_MAX_BATCH_BYTES: usize = 16 << 20;
pub const DEFAULT_LEADER_LOCK_KEY: i64 = 0x6f75_7462_6f78; // "outbox" in ASCII
pub const DEFAULT_SLOT: &str = "outbox_relay";
pub const DEFAULT_PUBLICATION: &str = "outbox_relay";
pub const DEFAULT_STATUS_INTERVAL_MS: u64 = 200;
pub const DEFAULT_MESSAGE_PREFIX: &str = "outbox";
pub const DEFAULT_HEARTBEAT_INTERVAL_MS: u64 = 200;
pub const DEFAULT_MAX_IN_FLIGHT_EVENTS: usize = 20_000;
pub const DEFAULT_MAX_IN_FLIGHT_BYTES: usize = 32 << 20;
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 50 << 20;
pub const DEFAULT_RETRY_INITIAL_MS: u64 = 100;
pub const DEFAULT_RETRY_MAX_MS: u64 = 30_000;
pub const DEFAULT_SHUTDOWN_GRACE_SECS: u64 = 30;
pub const DEFAULT_METRICS_LISTEN: &str = "0.0.0.0:9187";
pub const DEFAULT_SAMPLE_INTERVAL_SECS: u64 = 5;
pub const DEFAULT_FATAL_EXIT_DELAY_SECS: u64 = 30;
pub const DEFAULT_SLOT_LAG_WARNING_BYTES: u64 = 1 << 30;
pub const DEFAULT_SLOT_LAG_CRITICAL_BYTES: u64 = 10 << 30;
pub const DEFAULT_DEDUP_MAX_SCAN_RECORDS: u64 = 1_000_000;
pub const DEFAULT_DEDUP_SCAN_TIMEOUT_MS: u64 = 60_000;

/// Placeholders a topic template may use.
pub const TOPIC_PLACEHOLDERS: &[&str] = &["aggregate_type", "event_type"];

/// A configuration problem, naming the setting it is about.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{path}: {message}")]
    Invalid { path: String, message: String },
    #[error("{0}")]
    Load(String),
}

impl ConfigError {
    pub fn invalid(path: impl Into<String>, message: impl Into<String>) -> Self {
        ConfigError::Invalid { path: path.into(), message: message.into() }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RelayConfig {
    #[serde(default)]
    pub source: SourceConfig,
    #[serde(default)]
    pub postgres: PostgresConfig,
    pub kafka: KafkaConfig,
    /// The one outbox table (the single-table form), unless `outboxes` lists several.
    #[serde(default)]
    pub outbox: OutboxConfig,
    /// Several outbox tables read by one relay (`[[outboxes]]`), each an [`OutboxConfig`] with
    /// its `name`; empty: the one `[outbox]`. Read through [`RelayConfig::outboxes`].
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub outboxes: Vec<OutboxConfig>,
    #[serde(default)]
    pub polling: PollingConfig,
    #[serde(default)]
    pub replication: ReplicationConfig,
    #[serde(default)]
    pub dead_letter: DeadLetterConfig,
    #[serde(default)]
    pub dedup: DedupConfig,
    #[serde(default)]
    pub retry: RetryConfig,
    #[serde(default)]
    pub shutdown: ShutdownConfig,
    #[serde(default)]
    pub metrics: MetricsConfig,
    /// The admin API and console (off unless `admin.listen` is set).
    #[serde(default)]
    pub admin: AdminConfig,
    #[serde(default)]
    pub tracing: TracingConfig,
    /// Warnings found while loading, logged at start-up: deprecated settings, and secret files
    /// other users can read ([`RelayConfig::secret_file_warnings`]).
    #[serde(skip)]
    pub deprecations: Vec<String>,
}

/// Which source feeds the relay. The mode-specific settings live in `[polling]` and
/// `[replication]`; a flat enum (not a serde-tagged one) keeps the `config` crate's
/// string-to-number coercion for environment overrides working inside those sections.
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct SourceConfig {
    /// `polling` or `replication`.
    #[serde(default)]
    pub mode: SourceMode,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum SourceMode {
    #[default]
    Replication,
    Polling,
}

impl fmt::Display for SourceMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            SourceMode::Replication => "replication",
            SourceMode::Polling => "polling",
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum AfterPublish {
    #[default]
    Delete,
    Mark,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum OnPoison {
    #[default]
    DeadLetter,
    Block,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PollingConfig {
    pub batch_size: u32,
    pub poll_interval_ms: u64,
    /// `delete` the published rows, or `mark` them by setting `published_at_column`.
    pub after_publish: AfterPublish,
    pub published_at_column: String,
    /// Deprecated: `dead_letter.on_poison` (still read, with a warning).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub on_poison: Option<OnPoison>,
    /// Deprecated: `dead_letter.table` (still read, with a warning).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dead_letter_table: Option<String>,
    /// Channel of the NOTIFY trigger shipped in `sql/`; empty disables LISTEN.
    pub notify_channel: String,
    /// The seed of the advisory lock that elects the single active polling instance: the key
    /// is worked out from it and the outbox table's name (`source::polling::leader`), so each
    /// table has its own.
    pub leader_lock_key: i64,
    /// How long the claim transaction waits for Kafka's acknowledgements before it rolls back:
    /// while it waits it holds the rows' locks and the database's xmin horizon (vacuum).
    pub claim_timeout_ms: u64,
    /// A claim ends once its rows hold this many bytes (of the event columns), so memory stays
    /// bounded whatever the rows' size; a row larger than this is claimed alone.
    pub max_batch_bytes: usize,
    /// The largest row (its event columns as text) a claim fetches; of a larger one only its id
    /// and size are fetched, and PostgreSQL copies it whole into the dead-letter table, unread by
    /// the relay (the counterpart of `replication.max_message_bytes`).
    pub max_row_bytes: usize,
}

impl Default for PollingConfig {
    fn default() -> Self {
        PollingConfig {
            batch_size: DEFAULT_POLL_BATCH_SIZE,
            poll_interval_ms: DEFAULT_POLL_INTERVAL_MS,
            after_publish: AfterPublish::default(),
            published_at_column: DEFAULT_PUBLISHED_AT_COLUMN.into(),
            on_poison: None,
            dead_letter_table: None,
            notify_channel: DEFAULT_NOTIFY_CHANNEL.into(),
            leader_lock_key: DEFAULT_LEADER_LOCK_KEY,
            claim_timeout_ms: DEFAULT_CLAIM_TIMEOUT_MS,
            max_batch_bytes: DEFAULT_MAX_BATCH_BYTES,
            max_row_bytes: DEFAULT_MAX_MESSAGE_BYTES,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ReplicationConfig {
    /// The slot's name. Polling mode looks for it too: while it exists, a switch from
    /// replication mode is unfinished (`source::handover`).
    pub slot: String,
    pub publication: String,
    /// Create the publication when it is missing (needs ownership of the outbox table).
    pub create_publication: bool,
    /// Create the slot when it is missing, publishing the rows already in the table first.
    pub create_slot: bool,
    /// Make the slot a failover slot (PostgreSQL 17+): standbys with `sync_replication_slots`
    /// keep a copy, so the relay goes on from it after a promotion. Set the primary's
    /// `synchronized_standby_slots` too, or a promoted standby may lack what was published.
    pub failover: bool,
    /// How often the confirmed position is reported to PostgreSQL (well inside
    /// `wal_sender_timeout`); the server's reply requests are answered at once.
    pub status_interval_ms: u64,
    /// Prefix of the logical decoding messages `outbox_emit()` writes.
    pub message_prefix: String,
    /// How often the relay writes a tiny non-transactional WAL message of its own; reading it
    /// back lets the slot advance while the outbox is idle and other tables fill the WAL.
    /// 0 disables it (the slot then advances only on the server's keepalives).
    pub heartbeat_interval_ms: u64,
    /// Events sent to Kafka but not yet acknowledged; reading the slot pauses at this bound.
    pub max_in_flight_events: usize,
    /// Bytes of those events (payload, key, topic, headers); reading pauses at this bound too,
    /// so memory stays bounded whatever the rows' size.
    pub max_in_flight_bytes: usize,
    /// The largest single change the stream reads whole (a row's Insert message); of a larger
    /// one only the start is read: an outbox event is dead-lettered by reference, anything else
    /// skipped, instead of exhausting memory.
    pub max_message_bytes: usize,
    /// A file holding the key (its bytes less trailing whitespace, at least
    /// [`MIN_SIGNING_KEY_BYTES`]) `outbox_emit()` signs its messages with: the key installed in
    /// the table `outbox_emit_key` (`sql/012_outbox_emit_signed.sql`). Set, only messages whose
    /// digest this key verifies are published; any other message with the prefix is
    /// dead-lettered (a login calling `pg_logical_emit_message` itself, where the REVOKE of
    /// `sql/005_outbox_emit.sql` could not run). Empty: messages are published unverified.
    pub message_signing_key_file: String,
}

impl Default for ReplicationConfig {
    fn default() -> Self {
        ReplicationConfig {
            slot: DEFAULT_SLOT.into(),
            publication: DEFAULT_PUBLICATION.into(),
            create_publication: true,
            create_slot: true,
            failover: false,
            status_interval_ms: DEFAULT_STATUS_INTERVAL_MS,
            message_prefix: DEFAULT_MESSAGE_PREFIX.into(),
            heartbeat_interval_ms: DEFAULT_HEARTBEAT_INTERVAL_MS,
            max_in_flight_events: DEFAULT_MAX_IN_FLIGHT_EVENTS,
            max_in_flight_bytes: DEFAULT_MAX_IN_FLIGHT_BYTES,
            max_message_bytes: DEFAULT_MAX_MESSAGE_BYTES,
            message_signing_key_file: String::new(),
        }
    }
}

/// What happens to an event that can never be published (a NULL required column, a topic
/// Kafka refuses, a record over the size limit), in both modes and in the first copy alike.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DeadLetterConfig {
    /// `dead_letter` moves the event with its reason to `table` and carries on; `block` holds
    /// at it, reporting it, until an operator fixes its cause or changes this setting.
    pub on_poison: OnPoison,
    /// The dead-letter table, `schema.table` (or `table`, in schema `public`).
    pub table: String,
    /// A file holding the key (its bytes less trailing whitespace, at least
    /// [`MIN_SIGNING_KEY_BYTES`]) each letter is signed with as the relay writes it (HMAC-SHA256,
    /// the table's `digest` column, `sql/011_dead_letter_digest.sql`), and `replay-dead-letters`
    /// checks: a letter without this key's digest is not replayed unless vouched for. Give the
    /// relay and the operator who replays the same file; no one else needs it. Empty: letters
    /// are not signed.
    pub signing_key_file: String,
}

/// The shortest `dead_letter.signing_key_file` (and `replication.message_signing_key_file`) key,
/// in bytes.
pub const MIN_SIGNING_KEY_BYTES: usize = 32;

impl Default for DeadLetterConfig {
    fn default() -> Self {
        DeadLetterConfig {
            on_poison: OnPoison::default(),
            table: DEFAULT_DEAD_LETTER_TABLE.into(),
            signing_key_file: String::new(),
        }
    }
}

impl DeadLetterConfig {
    /// (schema, table) of [`DeadLetterConfig::table`].
    pub fn schema_and_table(&self) -> (&str, &str) {
        self.table.split_once('.').unwrap_or(("public", &self.table))
    }
}

/// Zero duplicates across restarts: before a session's first record to a topic, the relay reads
/// back the records it wrote there that the source may replay, and skips exactly those events.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DedupConfig {
    /// On (default): read back and skip what Kafka already holds. Off: at-least-once, replays
    /// are published again.
    pub enabled: bool,
    /// Records read back per topic and session at most; past it the relay stops looking, says
    /// so (log, `outbox_relay_dedup_scans_total{result="limit"}`) and may publish older
    /// replayed events again. Never fewer: it only ever skips records it read.
    pub max_scan_records: u64,
    /// How long one topic's read-back may take before the session fails and is retried
    /// (Kafka unreachable). Nothing is published to the topic before it completes.
    pub scan_timeout_ms: u64,
}

impl Default for DedupConfig {
    fn default() -> Self {
        DedupConfig {
            enabled: true,
            max_scan_records: DEFAULT_DEDUP_MAX_SCAN_RECORDS,
            scan_timeout_ms: DEFAULT_DEDUP_SCAN_TIMEOUT_MS,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RetryConfig {
    pub initial_backoff_ms: u64,
    pub max_backoff_ms: u64,
}

impl Default for RetryConfig {
    fn default() -> Self {
        RetryConfig { initial_backoff_ms: DEFAULT_RETRY_INITIAL_MS, max_backoff_ms: DEFAULT_RETRY_MAX_MS }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ShutdownConfig {
    pub grace_period_secs: u64,
}

impl Default for ShutdownConfig {
    fn default() -> Self {
        ShutdownConfig { grace_period_secs: DEFAULT_SHUTDOWN_GRACE_SECS }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MetricsConfig {
    /// Address of the /metrics, /healthz and /readyz listener; empty disables it.
    pub listen: String,
    /// How often the slot (or the polling backlog) is sampled from PostgreSQL.
    pub sample_interval_secs: u64,
    /// Exported as gauges for the alert rules, so thresholds are set per relay, here.
    pub slot_lag_warning_bytes: u64,
    pub slot_lag_critical_bytes: u64,
    /// After a fatal error, keep serving /metrics this long before exiting non-zero, so
    /// Prometheus scrapes `outbox_relay_fatal_error = 1`.
    pub fatal_exit_delay_secs: u64,
}

impl Default for MetricsConfig {
    fn default() -> Self {
        MetricsConfig {
            listen: DEFAULT_METRICS_LISTEN.into(),
            sample_interval_secs: DEFAULT_SAMPLE_INTERVAL_SECS,
            slot_lag_warning_bytes: DEFAULT_SLOT_LAG_WARNING_BYTES,
            slot_lag_critical_bytes: DEFAULT_SLOT_LAG_CRITICAL_BYTES,
            fatal_exit_delay_secs: DEFAULT_FATAL_EXIT_DELAY_SECS,
        }
    }
}

impl RelayConfig {
    /// One readable line for the start-up log: what the relay reads, where it writes.
    pub fn summary(&self) -> String {
        let pg = &self.postgres;
        let source = match self.source.mode {
            SourceMode::Replication => format!(
                "replication from slot \"{}\" (publication \"{}\")",
                self.replication.slot, self.replication.publication
            ),
            SourceMode::Polling => format!("polling every {} ms", self.polling.poll_interval_ms),
        };
        let metrics =
            if self.metrics.listen.is_empty() { "off".to_string() } else { self.metrics.listen.clone() };
        let outboxes: Vec<String> = self
            .outboxes()
            .iter()
            .map(|o| format!("{}.{} (topics {})", o.config.schema, o.config.table, o.config.topic_template))
            .collect();
        format!(
            "{source} of {} on {}/{} as {} (sslmode {}), to Kafka {}, metrics {metrics}",
            outboxes.join(", "),
            pg.endpoints().iter().map(Endpoint::to_string).collect::<Vec<_>>().join(","),
            pg.database,
            pg.user,
            pg.sslmode,
            self.kafka.brokers.join(","),
        )
    }

    /// The configuration as JSON with every secret replaced: `validate` prints it, and the
    /// start-up log has it at debug level (the info line is [`RelayConfig::summary`]).
    pub fn redacted(&self) -> serde_json::Value {
        let mut value = serde_json::to_value(self).expect("config serializes");
        if let Some(props) = value.pointer_mut("/kafka/properties").and_then(|p| p.as_object_mut()) {
            for (key, v) in props.iter_mut() {
                if is_secret_kafka_property(key) {
                    *v = serde_json::Value::String("<redacted>".into());
                }
            }
        }
        value
    }
}

#[cfg(test)]
mod tests;
