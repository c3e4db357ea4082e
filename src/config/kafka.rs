//! `[kafka]`: the brokers, the settings the relay owns, librdkafka pass-through properties, and
//! secret properties kept out of the configuration file.
//!
//! Invariants:
//! - a secret librdkafka property (`sasl.password`, `ssl.key.password`, ...) can come from a file
//!   (`kafka.secret_properties_file`, e.g. a mounted Kubernetes Secret) or from an environment
//!   variable `OUTBOX_RELAY_KAFKA_<KEY>` (the key upper-cased, dots as underscores:
//!   `OUTBOX_RELAY_KAFKA_SASL_PASSWORD` is `sasl.password`), so it never has to be in a
//!   ConfigMap; those values are always redacted;
//! - a value the binary's librdkafka was not built for (`security.protocol = SASL_SSL` without
//!   SSL, `compression = zstd` without zstd) is refused at load, naming the setting;
//! - every property is given to librdkafka once at load, alone: a name it does not know or a
//!   value it refuses is a configuration error naming the key and never the value (librdkafka's
//!   own message quotes the value, which may be a password), so no client is ever created from
//!   properties librdkafka would refuse, and its error text never reaches a log, `check`,
//!   `/readyz` or the example services' logs.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::{
    ConfigError, DEFAULT_KAFKA_CLIENT_ID, DEFAULT_KAFKA_COMPRESSION, DEFAULT_KAFKA_LINGER_MS,
    DEFAULT_KAFKA_MESSAGE_TIMEOUT_MS, DEFAULT_KAFKA_STALL_WARNING_MS, DEFAULT_KAFKA_TRANSACTION_MAX_BYTES,
    DEFAULT_KAFKA_TRANSACTION_MAX_EVENTS, DEFAULT_KAFKA_TRANSACTION_MAX_MS,
    DEFAULT_KAFKA_TRANSACTION_TIMEOUT_MS, KafkaAuthConfig, Secret,
};

mod librdkafka;

pub use librdkafka::built_in_features;

/// Environment variables with this prefix are secret librdkafka properties.
pub const SECRET_ENV_PREFIX: &str = "OUTBOX_RELAY_KAFKA_";

/// librdkafka settings the relay owns: overriding them would break the delivery guarantee or
/// duplicate a first-class option.
const RESERVED_KAFKA_PROPERTIES: &[(&str, &str)] = &[
    ("acks", "the relay always uses acks=all"),
    ("request.required.acks", "the relay always uses acks=all"),
    ("enable.idempotence", "the relay always enables the idempotent producer"),
    ("enable.gapless.guarantee", "the relay always keeps per-partition order"),
    ("bootstrap.servers", "set kafka.brokers instead"),
    ("metadata.broker.list", "set kafka.brokers instead"),
    ("client.id", "set kafka.client_id instead"),
    ("message.timeout.ms", "set kafka.message_timeout_ms instead"),
    ("delivery.timeout.ms", "set kafka.message_timeout_ms instead"),
    ("linger.ms", "set kafka.linger_ms instead"),
    ("queue.buffering.max.ms", "set kafka.linger_ms instead"),
    ("compression.type", "set kafka.compression instead"),
    ("compression.codec", "set kafka.compression instead"),
    ("transactional.id", "set kafka.transactional = true (and kafka.transactional_id) instead"),
    ("transaction.timeout.ms", "set kafka.transaction_timeout_ms instead"),
];

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KafkaConfig {
    /// Bootstrap brokers, `host:port`. A comma-separated string is accepted too, which is what
    /// `OUTBOX_RELAY__KAFKA__BROKERS=a:9092,b:9092` gives.
    #[serde(deserialize_with = "string_or_list")]
    pub brokers: Vec<String>,
    #[serde(default = "default_client_id")]
    pub client_id: String,
    /// 0 (default): a record is retried until Kafka acknowledges it. A finite timeout fails
    /// records after it, and librdkafka may then have written later records of the same
    /// partition (a gap), so per-aggregate order is not kept across such a failure.
    #[serde(default = "default_message_timeout_ms")]
    pub message_timeout_ms: u64,
    /// Warn (log, `/readyz` degraded, `publish_errors_total{error_type="stalled"}`) when records
    /// are waiting and Kafka has acknowledged nothing for this long.
    #[serde(default = "default_stall_warning_ms")]
    pub stall_warning_ms: u64,
    #[serde(default = "default_linger_ms")]
    pub linger_ms: u64,
    #[serde(default = "default_compression")]
    pub compression: String,
    /// Every record carries `outbox_relay_source` and `outbox_relay_position` headers: which
    /// database and table it came from and where (see docs/guarantees.md, "Record format"). Needed by
    /// `dedup.enabled`.
    #[serde(default = "default_true")]
    pub source_headers: bool,
    /// Kafka transactions (docs/guarantees.md, "Kafka transactions"): records are written in
    /// transactions that commit before the source confirms or releases them, and a new active
    /// instance fences the old one. Exactly once for `read_committed` consumers, with no
    /// straggler window. Off by default: see docs/benchmarks.md for what it costs.
    #[serde(default)]
    pub transactional: bool,
    /// The producer's `transactional.id`. Empty (default): derived from the source,
    /// `outbox-relay:<system identifier>/<database>/<schema>.<table>`, the same across restarts,
    /// replicas and both modes, so whichever instance becomes active fences the one before it.
    #[serde(default)]
    pub transactional_id: String,
    /// librdkafka's `transaction.timeout.ms`: how long the brokers let a transaction stay open
    /// before aborting it (at most the brokers' `transaction.max.timeout.ms`).
    #[serde(default = "default_transaction_timeout_ms")]
    pub transaction_timeout_ms: u64,
    /// A transaction commits once it holds this many records (at the next source transaction's
    /// end)...
    #[serde(default = "default_transaction_max_events")]
    pub transaction_max_events: usize,
    /// ...or this many bytes of records...
    #[serde(default = "default_transaction_max_bytes")]
    pub transaction_max_bytes: usize,
    /// ...or has been open this long, or the source has nothing more to read right now.
    #[serde(default = "default_transaction_max_ms")]
    pub transaction_max_ms: u64,
    /// Further librdkafka settings, passed through as they are (SASL, TLS, batch sizes).
    #[serde(default)]
    pub properties: BTreeMap<String, KafkaProperty>,
    /// A file of secret librdkafka properties, one `key=value` per line (`#` comments).
    #[serde(default)]
    pub secret_properties_file: String,
    /// Secret properties from `secret_properties_file` and `OUTBOX_RELAY_KAFKA_*`, read at load.
    #[serde(skip_deserializing)]
    pub secret_properties: BTreeMap<String, Secret>,
    /// `[kafka.auth]`: SASL OAUTHBEARER tokens the relay obtains itself (OIDC, a token file,
    /// AWS MSK IAM); none: librdkafka's own SASL/TLS settings alone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auth: Option<KafkaAuthConfig>,
}

/// A librdkafka property value; printed redacted when its key looks like a secret.
#[derive(Clone, Deserialize)]
#[serde(transparent)]
pub struct KafkaProperty(pub String);

/// `Debug` cannot see the key, so it hides every value; `redacted()` shows the harmless ones.
impl fmt::Debug for KafkaProperty {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("\"<hidden>\"")
    }
}

impl Serialize for KafkaProperty {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0)
    }
}

impl KafkaConfig {
    /// Every librdkafka property to set: the pass-through ones, then the secret ones.
    pub fn client_properties(&self) -> impl Iterator<Item = (&str, &str)> {
        let plain = self.properties.iter().map(|(k, v)| (k.as_str(), v.0.as_str()));
        plain.chain(self.secret_properties.iter().map(|(k, v)| (k.as_str(), v.expose())))
    }

    /// The value librdkafka gets for `name`: the last of its settings, so a secret file's (or an
    /// `OUTBOX_RELAY_KAFKA_*` variable's) over `kafka.properties`.
    pub fn property(&self, name: &str) -> Option<&str> {
        self.client_properties().filter(|(k, _)| *k == name).last().map(|(_, v)| v)
    }

    /// The principal the brokers' authorizer sees, as an ACL names it: `User:<sasl.username>`
    /// with SASL, else what decides it (the TLS client certificate's subject, or ANONYMOUS on a
    /// listener without authentication).
    pub fn principal(&self) -> String {
        // (a secret file's `sasl.username`, e.g. `verify --watch`'s own principal, over the
        // configuration's)
        let property = |name: &str| self.property(name).map(str::to_string);
        let protocol =
            property("security.protocol").unwrap_or_else(|| "plaintext".into()).to_ascii_lowercase();
        match (property("sasl.username"), protocol.as_str()) {
            (Some(user), "sasl_ssl" | "sasl_plaintext") => format!("principal User:{user}"),
            (_, "ssl")
                if property("ssl.certificate.location").is_some()
                    || property("ssl.certificate.pem").is_some() =>
            {
                "the principal of the relay's TLS client certificate".into()
            }
            _ => format!("principal User:ANONYMOUS (security.protocol {protocol}, no authentication)"),
        }
    }

    /// Reads `secret_properties_file` and the `OUTBOX_RELAY_KAFKA_*` variables of `env`.
    pub fn load_secrets(&mut self, env: &BTreeMap<String, String>) -> Result<(), ConfigError> {
        if !self.secret_properties_file.is_empty() {
            let path = "kafka.secret_properties_file";
            let text = std::fs::read_to_string(&self.secret_properties_file)
                .map_err(|e| ConfigError::invalid(path, format!("{}: {e}", self.secret_properties_file)))?;
            for (n, line) in text.lines().enumerate() {
                let line = line.trim();
                if line.is_empty() || line.starts_with('#') {
                    continue;
                }
                let (key, value) = line.split_once('=').ok_or_else(|| {
                    ConfigError::invalid(
                        path,
                        format!("line {} is not key=value (the line is not shown)", n + 1),
                    )
                })?;
                self.secret_properties.insert(key.trim().to_string(), Secret::new(value.trim()));
            }
        }
        for (name, value) in env {
            if let Some(key) = name.strip_prefix(SECRET_ENV_PREFIX) {
                self.secret_properties
                    .insert(key.to_ascii_lowercase().replace('_', "."), Secret::new(value.as_str()));
            }
        }
        Ok(())
    }

    /// Checks what types alone cannot; each error names the `kafka.*` field to fix.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.brokers.is_empty() {
            return Err(ConfigError::invalid("kafka.brokers", "must not be empty"));
        }
        for (i, broker) in self.brokers.iter().enumerate() {
            let ok = broker
                .rsplit_once(':')
                .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok_and(|p| p > 0));
            if !ok {
                return Err(ConfigError::invalid(
                    format!("kafka.brokers[{i}]"),
                    format!("\"{broker}\" is not host:port"),
                ));
            }
        }
        if self.client_id.is_empty() {
            return Err(ConfigError::invalid("kafka.client_id", "must not be empty"));
        }
        if self.message_timeout_ms > 3_600_000 {
            return Err(ConfigError::invalid(
                "kafka.message_timeout_ms",
                "must be between 0 (never) and 3600000",
            ));
        }
        if !(100..=3_600_000).contains(&self.stall_warning_ms) {
            return Err(ConfigError::invalid("kafka.stall_warning_ms", "must be between 100 and 3600000"));
        }
        if self.linger_ms > 60_000 {
            return Err(ConfigError::invalid("kafka.linger_ms", "must be <= 60000"));
        }
        if !["none", "gzip", "snappy", "lz4", "zstd"].contains(&self.compression.as_str()) {
            return Err(ConfigError::invalid(
                "kafka.compression",
                format!("\"{}\" is not one of none, gzip, snappy, lz4, zstd", self.compression),
            ));
        }
        self.validate_transactions()?;
        if let Some(auth) = &self.auth {
            auth.validate()?;
        }
        self.validate_properties()?;
        self.validate_built_in()?;
        self.validate_with_librdkafka()
    }

    /// The transaction settings, checked whether or not `transactional` is on (turning it on
    /// must not reveal a mistake made long before).
    fn validate_transactions(&self) -> Result<(), ConfigError> {
        let id = &self.transactional_id;
        if id.len() > 255 || id.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err(ConfigError::invalid(
                "kafka.transactional_id",
                "must be at most 255 characters, without spaces or control characters (leave it empty to derive \
                 it from the source)",
            ));
        }
        if !(1_000..=3_600_000).contains(&self.transaction_timeout_ms) {
            return Err(ConfigError::invalid(
                "kafka.transaction_timeout_ms",
                "must be between 1000 and 3600000 (and at most the brokers' transaction.max.timeout.ms, 900000 \
                 by default)",
            ));
        }
        if self.transactional && self.message_timeout_ms > self.transaction_timeout_ms {
            return Err(ConfigError::invalid(
                "kafka.message_timeout_ms",
                format!(
                    "{} is longer than kafka.transaction_timeout_ms ({}): with kafka.transactional a record \
                     cannot wait longer than its transaction may stay open; lower it, or leave it 0 (it then \
                     follows the transaction timeout)",
                    self.message_timeout_ms, self.transaction_timeout_ms
                ),
            ));
        }
        if !(1..=1_000_000).contains(&self.transaction_max_events) {
            return Err(ConfigError::invalid(
                "kafka.transaction_max_events",
                "must be between 1 and 1000000",
            ));
        }
        if !(1_024..=1 << 30).contains(&self.transaction_max_bytes) {
            return Err(ConfigError::invalid(
                "kafka.transaction_max_bytes",
                "must be between 1024 and 1073741824",
            ));
        }
        if self.transaction_max_ms == 0
            || self.transaction_max_ms.saturating_mul(2) > self.transaction_timeout_ms
        {
            return Err(ConfigError::invalid(
                "kafka.transaction_max_ms",
                format!(
                    "must be at least 1 and at most half of kafka.transaction_timeout_ms ({}): a transaction \
                     open that long leaves too little time to commit it",
                    self.transaction_timeout_ms
                ),
            ));
        }
        Ok(())
    }

    fn validate_properties(&self) -> Result<(), ConfigError> {
        let keys = self.properties.keys().map(|k| (k, "kafka.properties")).chain(
            self.secret_properties
                .keys()
                .map(|k| (k, "kafka secret properties (file or OUTBOX_RELAY_KAFKA_*)")),
        );
        for (key, place) in keys {
            if let Some((_, why)) = RESERVED_KAFKA_PROPERTIES.iter().find(|(r, _)| *r == key.as_str()) {
                return Err(ConfigError::invalid(
                    format!("{place}.\"{key}\""),
                    format!("may not be set: {why}"),
                ));
            }
        }
        Ok(())
    }

    /// What turns off the brokers' certificate checks, as (property, value) lines for `check`:
    /// `enable.ssl.certificate.verification = false`, or `ssl.endpoint.identification.algorithm
    /// = none` (the name is not checked) on a TLS protocol.
    pub fn certificate_checks_off(&self) -> Vec<String> {
        let property = |key: &str| self.property(key).map(|v| v.trim().to_ascii_lowercase());
        let protocol = property("security.protocol").unwrap_or_default();
        if !matches!(protocol.as_str(), "ssl" | "sasl_ssl") {
            return Vec::new();
        }
        let mut off = Vec::new();
        // (librdkafka reads a boolean as true/t/1 or false/f/0, any case)
        if property("enable.ssl.certificate.verification")
            .is_some_and(|v| matches!(v.as_str(), "false" | "f" | "0"))
        {
            off.push("enable.ssl.certificate.verification = false (any certificate is accepted)".into());
        }
        if property("ssl.endpoint.identification.algorithm").is_some_and(|v| v == "none") {
            off.push(
                "ssl.endpoint.identification.algorithm = none (the broker's name is not checked)".into(),
            );
        }
        off
    }
}

fn default_client_id() -> String {
    DEFAULT_KAFKA_CLIENT_ID.into()
}
fn default_true() -> bool {
    true
}

fn default_message_timeout_ms() -> u64 {
    DEFAULT_KAFKA_MESSAGE_TIMEOUT_MS
}
fn default_transaction_timeout_ms() -> u64 {
    DEFAULT_KAFKA_TRANSACTION_TIMEOUT_MS
}
fn default_transaction_max_events() -> usize {
    DEFAULT_KAFKA_TRANSACTION_MAX_EVENTS
}
fn default_transaction_max_bytes() -> usize {
    DEFAULT_KAFKA_TRANSACTION_MAX_BYTES
}
fn default_transaction_max_ms() -> u64 {
    DEFAULT_KAFKA_TRANSACTION_MAX_MS
}
fn default_stall_warning_ms() -> u64 {
    DEFAULT_KAFKA_STALL_WARNING_MS
}
fn default_linger_ms() -> u64 {
    DEFAULT_KAFKA_LINGER_MS
}
fn default_compression() -> String {
    DEFAULT_KAFKA_COMPRESSION.into()
}

pub(super) fn string_or_list<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum OneOrMany {
        One(String),
        Many(Vec<String>),
    }
    Ok(match OneOrMany::deserialize(d)? {
        OneOrMany::One(s) => {
            s.split(',').map(str::trim).filter(|s| !s.is_empty()).map(String::from).collect()
        }
        OneOrMany::Many(v) => v,
    })
}

#[cfg(test)]
mod tests;
