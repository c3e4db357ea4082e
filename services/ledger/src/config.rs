//! Configuration: one TOML file, then environment overrides `LEDGER__SECTION__KEY`
//! (`LEDGER__CONSUMER__GROUP_ID=ledger-eu`, `LEDGER__POSTGRES__PORT=5433`), loaded with the
//! relay's own loader so both read configuration alike.
//!
//! Invariants:
//! - `[postgres]` and `[kafka]` are the relay's sections, with the relay's validation; secret
//!   librdkafka properties come from `kafka.secret_properties_file` or `OUTBOX_RELAY_KAFKA_<KEY>`
//!   variables, as for the relay (the shared loader reads that prefix);
//! - every `[consumer]` field has a default, unknown fields are errors, and every error names
//!   the path to fix (`consumer.max_attempts: must be >= 1`);
//! - the consumer settings the delivery argument rests on (`group.id`, `enable.auto.commit`,
//!   `enable.auto.offset.store`, `auto.offset.reset`, `isolation.level`) cannot be overridden
//!   through `kafka.properties`;
//! - secrets are redacted by the relay's types, so [`LedgerConfig::summary`] may be logged.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::time::Duration;

use outbox_relay::config::{
    ConfigError, DEFAULT_KAFKA_CLIENT_ID, DEFAULT_PG_APPLICATION_NAME, KafkaConfig, PostgresConfig,
};
use serde::Deserialize;

use crate::retry::Backoff;
use outbox_relay::backoff::Jitter;

pub const ENV_PREFIX: &str = "LEDGER";
pub const DEFAULT_TOPIC: &str = "outbox.event.order";
pub const DEFAULT_GROUP_ID: &str = "ledger";
pub const DEFAULT_MAX_ATTEMPTS: u32 = 5;
pub const DEFAULT_INITIAL_BACKOFF_MS: u64 = 100;
pub const DEFAULT_MAX_BACKOFF_MS: u64 = 5_000;
pub const DEFAULT_LOCK_TIMEOUT_MS: u64 = 2_000;
pub const DEFAULT_OUTBOX_TABLE: &str = "outbox_events";
/// librdkafka's default (45 s) would keep a killed instance's partitions idle that long; this is
/// the ledger's, unless `kafka.properties` sets `session.timeout.ms`.
pub const DEFAULT_SESSION_TIMEOUT_MS: u64 = 10_000;
/// `kafka.client_id` and `postgres.application_name` when left at the relay's defaults.
pub const DEFAULT_CLIENT_NAME: &str = "ledger";
const EXAMPLE: &str = "see deploy/ledger.example.toml";

/// librdkafka consumer settings the ledger owns, with the reason.
const RESERVED_CONSUMER_PROPERTIES: &[(&str, &str)] = &[
    ("group.id", "set consumer.group_id instead"),
    ("enable.auto.commit", "the ledger commits an offset only after its transaction committed"),
    ("enable.auto.offset.store", "the ledger commits an offset only after its transaction committed"),
    ("auto.offset.reset", "a new group starts at the earliest offset, so no event is skipped"),
    (
        "isolation.level",
        "the ledger reads read_committed: the records of an aborted Kafka transaction stay in the log, and must \
         never be applied",
    ),
];

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LedgerConfig {
    #[serde(default)]
    pub postgres: PostgresConfig,
    pub kafka: KafkaConfig,
    #[serde(default)]
    pub consumer: ConsumerConfig,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ConsumerConfig {
    /// The topic of `OrderPlaced` events (the relay's `outbox.event.{aggregate_type}`).
    pub topic: String,
    /// The consumer group; `replay-dlq` uses `<group_id>-replay`.
    pub group_id: String,
    /// Where records that cannot be applied go; empty: `<topic>.dlq`. Create it ahead.
    pub dead_letter_topic: String,
    /// Tries of one record whose transaction hit a lock timeout, serialization failure or
    /// deadlock, before it is dead-lettered. An unreachable database is retried without limit.
    pub max_attempts: u32,
    /// First retry delay; each retry doubles the cap, and the delay is uniform in [0, cap].
    pub initial_backoff_ms: u64,
    /// The cap on one retry delay.
    pub max_backoff_ms: u64,
    /// `lock_timeout` of the ledger's session: how long one statement waits for a row lock.
    pub lock_timeout_ms: u64,
    /// The outboxes whose events are applied (their `outbox_relay_source`):
    /// `<system identifier>/<database>/<schema>.<table>`, or `*/<database>/<schema>.<table>`
    /// in any cluster. Empty: any outbox that publishes to the topic.
    pub sources: Vec<String>,
    /// The outbox table the follow-up events (`PaymentCompleted`, `PaymentDeclined`) are
    /// written to, `table` or `schema.table`: the relay's own, or one of the ledger's that the
    /// relay lists among its `[[outboxes]]`.
    pub outbox_table: String,
    /// The schema registry of values in the Confluent wire format (the relay's
    /// `[outbox.registry]`): Avro and JSON Schema values are decoded with the writer's schema.
    pub registry: RegistryConfig,
}

/// Where to read writer schemas; `url` empty (default): values are the relay's JSON as is. The
/// password comes from `password_file` or `OUTBOX_RELAY_REGISTRY_PASSWORD`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RegistryConfig {
    /// The Confluent-compatible API's base URL (Apicurio: `http://host:8080/apis/ccompat/v7`).
    pub url: String,
    /// Basic-auth user; empty: none.
    pub username: String,
    /// A PEM file of the CA that signs an `https://` registry's certificate.
    pub ca_file: String,
    /// A file whose first line is the password, read at each request; instead of
    /// `OUTBOX_RELAY_REGISTRY_PASSWORD`.
    pub password_file: String,
    /// Send `username` and the password over a plain `http://` url (in clear). Off (default):
    /// refused at start-up, naming this setting.
    pub allow_http_credentials: bool,
}

impl Default for ConsumerConfig {
    fn default() -> Self {
        ConsumerConfig {
            topic: DEFAULT_TOPIC.into(),
            group_id: DEFAULT_GROUP_ID.into(),
            dead_letter_topic: String::new(),
            max_attempts: DEFAULT_MAX_ATTEMPTS,
            initial_backoff_ms: DEFAULT_INITIAL_BACKOFF_MS,
            max_backoff_ms: DEFAULT_MAX_BACKOFF_MS,
            lock_timeout_ms: DEFAULT_LOCK_TIMEOUT_MS,
            sources: Vec::new(),
            outbox_table: DEFAULT_OUTBOX_TABLE.into(),
            registry: RegistryConfig::default(),
        }
    }
}

impl ConsumerConfig {
    /// (schema, table) of [`ConsumerConfig::outbox_table`]; schema `public` when not named.
    pub fn outbox_table(&self) -> (&str, &str) {
        self.outbox_table.split_once('.').unwrap_or(("public", &self.outbox_table))
    }

    /// The dead-letter topic in effect.
    pub fn dead_letter_topic(&self) -> String {
        if self.dead_letter_topic.is_empty() {
            format!("{}.dlq", self.topic)
        } else {
            self.dead_letter_topic.clone()
        }
    }

    /// The retry delays of one record (and of reconnecting), from the two backoff settings.
    pub fn backoff(&self) -> Backoff {
        Backoff::new(
            Duration::from_millis(self.initial_backoff_ms),
            Duration::from_millis(self.max_backoff_ms),
            Jitter::Full,
        )
    }

    /// The consumer group of `replay-dlq`.
    pub fn replay_group_id(&self) -> String {
        format!("{}-replay", self.group_id)
    }

    /// Checks what types alone cannot; each error names the `consumer.*` field to fix.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.topic.is_empty() {
            return Err(ConfigError::invalid("consumer.topic", "must not be empty"));
        }
        let (schema, table) = self.outbox_table();
        if schema.is_empty() || table.is_empty() || table.contains('.') {
            return Err(ConfigError::invalid(
                "consumer.outbox_table",
                format!("\"{}\" is not schema.table or table", self.outbox_table),
            ));
        }
        if self.group_id.is_empty() {
            return Err(ConfigError::invalid("consumer.group_id", "must not be empty"));
        }
        if self.dead_letter_topic() == self.topic {
            return Err(ConfigError::invalid(
                "consumer.dead_letter_topic",
                "must differ from consumer.topic",
            ));
        }
        if self.max_attempts == 0 {
            return Err(ConfigError::invalid("consumer.max_attempts", "must be >= 1"));
        }
        if self.initial_backoff_ms == 0 {
            return Err(ConfigError::invalid("consumer.initial_backoff_ms", "must be > 0"));
        }
        if self.max_backoff_ms < self.initial_backoff_ms {
            return Err(ConfigError::invalid(
                "consumer.max_backoff_ms",
                "must be >= consumer.initial_backoff_ms",
            ));
        }
        if self.lock_timeout_ms == 0 {
            // 0 means "wait forever" to PostgreSQL: a held lock would stall the consumer silently
            return Err(ConfigError::invalid(
                "consumer.lock_timeout_ms",
                "must be > 0 (0 would wait for a lock forever)",
            ));
        }
        for (i, source) in self.sources.iter().enumerate() {
            let parts: Vec<&str> = source.splitn(3, '/').collect();
            if parts.len() < 3 || parts.iter().any(|p| p.is_empty()) || !parts[2].contains('.') {
                return Err(ConfigError::invalid(
                    format!("consumer.sources[{i}]"),
                    format!(
                        "{source:?} is not <system identifier>/<database>/<schema>.<table> (or \
                         */<database>/<schema>.<table>): copy the outbox_relay_source header of a record"
                    ),
                ));
            }
        }
        Ok(())
    }
}

/// Refuses a `kafka.properties` key that would undo how the ledger consumes.
fn validate_consumer_properties(kafka: &KafkaConfig) -> Result<(), ConfigError> {
    for (key, _) in kafka.client_properties() {
        if let Some((_, why)) = RESERVED_CONSUMER_PROPERTIES.iter().find(|(reserved, _)| *reserved == key) {
            return Err(ConfigError::invalid(
                format!("kafka.properties.\"{key}\""),
                format!("may not be set: {why}"),
            ));
        }
    }
    Ok(())
}

impl LedgerConfig {
    /// Loads `file`, applies `LEDGER__*` overrides and secret properties from `env`, and
    /// validates.
    pub fn load(file: &Path, env: HashMap<String, String>) -> Result<LedgerConfig, ConfigError> {
        let secret_env: BTreeMap<String, String> = env.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        let mut config: LedgerConfig = outbox_relay::config::load_layered(file, ENV_PREFIX, env, EXAMPLE)?;
        // the relay's defaults name the relay; this process is the ledger
        if config.kafka.client_id == DEFAULT_KAFKA_CLIENT_ID {
            config.kafka.client_id = DEFAULT_CLIENT_NAME.into();
        }
        if config.postgres.application_name == DEFAULT_PG_APPLICATION_NAME {
            config.postgres.application_name = DEFAULT_CLIENT_NAME.into();
        }
        config.kafka.load_secrets(&secret_env)?;
        config.kafka.validate()?;
        validate_consumer_properties(&config.kafka)?;
        config.postgres.validate()?;
        config.consumer.validate()?;
        Ok(config)
    }

    /// One line for the start-up log; holds no secret.
    pub fn summary(&self) -> String {
        let pg = &self.postgres;
        format!(
            "topic {} in group {} (dead letters to {}) from Kafka {}, into {}/{} as {} (sslmode {})",
            self.consumer.topic,
            self.consumer.group_id,
            self.consumer.dead_letter_topic(),
            self.kafka.brokers.join(","),
            pg.host,
            pg.database,
            pg.user,
            pg.sslmode,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(toml: &str, env: &[(&str, &str)]) -> Result<LedgerConfig, ConfigError> {
        let dir = std::env::temp_dir().join(format!("ledger-config-{}", rand::random::<u64>()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("ledger.toml");
        std::fs::write(&file, toml).unwrap();
        let env = env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        let loaded = LedgerConfig::load(&file, env);
        std::fs::remove_dir_all(&dir).unwrap();
        loaded
    }

    const MINIMAL: &str = "[kafka]\nbrokers = [\"127.0.0.1:9092\"]\n";

    #[test]
    fn defaults_name_the_ledger() {
        let config = load(MINIMAL, &[]).unwrap();
        assert_eq!(config.consumer.topic, DEFAULT_TOPIC);
        assert_eq!(config.consumer.dead_letter_topic(), "outbox.event.order.dlq");
        assert_eq!(config.consumer.replay_group_id(), "ledger-replay");
        assert_eq!(config.kafka.client_id, "ledger");
        assert_eq!(config.postgres.application_name, "ledger");
        assert_eq!(config.consumer.max_attempts, 5);
    }

    #[test]
    fn environment_overrides_the_file() {
        let toml = format!("{MINIMAL}[consumer]\ngroup_id = \"from-file\"\n");
        let env = [("LEDGER__CONSUMER__GROUP_ID", "from-env"), ("LEDGER__POSTGRES__PORT", "5433")];
        let config = load(&toml, &env).unwrap();
        assert_eq!(config.consumer.group_id, "from-env");
        assert_eq!(config.postgres.port, 5433);
    }

    #[test]
    fn errors_name_the_field() {
        let cases = [
            ("max_attempts = 0", "consumer.max_attempts"),
            ("initial_backoff_ms = 0", "consumer.initial_backoff_ms"),
            ("initial_backoff_ms = 10\nmax_backoff_ms = 5", "consumer.max_backoff_ms"),
            ("lock_timeout_ms = 0", "consumer.lock_timeout_ms"),
            ("topic = \"\"", "consumer.topic"),
            ("dead_letter_topic = \"outbox.event.order\"", "consumer.dead_letter_topic"),
            ("max_atempts = 3", "max_atempts"),
        ];
        for (line, field) in cases {
            let error = load(&format!("{MINIMAL}[consumer]\n{line}\n"), &[]).unwrap_err().to_string();
            assert!(error.contains(field), "{line}: {error}");
        }
        let error = load("[consumer]\n", &[]).unwrap_err().to_string();
        assert!(error.contains("kafka"), "{error}");
        let toml = format!("{MINIMAL}[kafka.properties]\n\"enable.auto.commit\" = \"true\"\n");
        let error = load(&toml, &[]).unwrap_err().to_string();
        assert!(error.contains("kafka.properties.\"enable.auto.commit\": may not be set"), "{error}");
    }

    #[test]
    fn reading_records_of_aborted_kafka_transactions_is_refused_naming_the_setting() {
        let toml = format!("{MINIMAL}[kafka.properties]\n\"isolation.level\" = \"read_uncommitted\"\n");
        let error = load(&toml, &[]).unwrap_err().to_string();
        assert!(error.contains("kafka.properties.\"isolation.level\": may not be set"), "{error}");
        assert!(error.contains("read_committed"), "{error}");
    }

    #[test]
    fn the_example_file_loads_with_the_defaults() {
        let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/ledger.example.toml");
        let config = LedgerConfig::load(&example, HashMap::new()).unwrap();
        let defaults = ConsumerConfig::default();
        assert_eq!(config.consumer.topic, defaults.topic);
        assert_eq!(config.consumer.group_id, defaults.group_id);
        assert_eq!(config.consumer.max_attempts, defaults.max_attempts);
        assert_eq!(config.consumer.lock_timeout_ms, defaults.lock_timeout_ms);
        assert_eq!(config.consumer.max_backoff_ms, defaults.max_backoff_ms);
    }

    #[test]
    fn summary_holds_no_password() {
        let toml = format!("{MINIMAL}[postgres]\npassword = \"hunter2\"\n");
        let config = load(&toml, &[]).unwrap();
        assert!(!config.summary().contains("hunter2"));
        assert!(!format!("{config:?}").contains("hunter2"));
    }
}
