//! What this binary's librdkafka can do and take, asked of librdkafka itself.
//!
//! Invariants:
//! - a setting this binary's librdkafka was not built for (a compression codec, a TLS or SASL
//!   `security.protocol`, a SASL mechanism, OAUTHBEARER for `[kafka.auth]`) is refused naming the
//!   setting, with the features it has;
//! - each property is given to librdkafka alone, and a refusal names the key, never the value
//!   (librdkafka's own message quotes the value, which may be a password).

use rdkafka::error::KafkaError;
use rdkafka::types::RDKafkaConfRes;

use super::{ConfigError, KafkaConfig};

impl KafkaConfig {
    /// Gives each property to librdkafka alone; a refusal names the key, never the value.
    pub(super) fn validate_with_librdkafka(&self) -> Result<(), ConfigError> {
        let place = |key: &str| match self.properties.contains_key(key) {
            true => "kafka.properties",
            false => "kafka secret properties (file or OUTBOX_RELAY_KAFKA_*)",
        };
        for (key, value) in self.client_properties() {
            if let Some(problem) = librdkafka_refuses(key, value) {
                return Err(ConfigError::invalid(format!("{}.\"{key}\"", place(key)), problem));
            }
        }
        Ok(())
    }

    /// Refuses what this binary's librdkafka cannot do, naming the setting.
    pub(super) fn validate_built_in(&self) -> Result<(), ConfigError> {
        let features = built_in_features();
        let has = |feature: &str| features.iter().any(|f| f == feature);
        if self.compression != "none" && !has(&self.compression) {
            return Err(ConfigError::invalid(
                "kafka.compression",
                format!(
                    "\"{}\" is not built into this binary (librdkafka has: {})",
                    self.compression,
                    features.join(",")
                ),
            ));
        }
        self.validate_protocol_built_in(&features)?;
        if self.auth.is_some() && !has("sasl_oauthbearer") {
            return Err(ConfigError::invalid(
                "kafka.auth",
                format!("this binary's librdkafka has no OAUTHBEARER (it has: {})", features.join(",")),
            ));
        }
        self.validate_sasl_built_in(&features)
    }

    /// Refuses a `security.protocol` that needs what `features` lacks (TLS, SASL) or that
    /// librdkafka does not name.
    fn validate_protocol_built_in(&self, features: &[String]) -> Result<(), ConfigError> {
        let has = |feature: &str| features.iter().any(|f| f == feature);
        if let Some(protocol) = self.property("security.protocol").map(str::to_ascii_lowercase) {
            let ok = match protocol.as_str() {
                "plaintext" => true,
                "ssl" | "sasl_ssl" => has("ssl"),
                "sasl_plaintext" => has("sasl"),
                _ => false,
            };
            if !ok {
                return Err(ConfigError::invalid(
                    "kafka.properties.\"security.protocol\"",
                    format!(
                        "\"{protocol}\" is not supported by this binary (librdkafka has: {})",
                        features.join(",")
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Refuses librdkafka's own OIDC fetch, OAUTHBEARER without `[kafka.auth]`, and a SASL
    /// mechanism that `features` lacks.
    fn validate_sasl_built_in(&self, features: &[String]) -> Result<(), ConfigError> {
        let has = |feature: &str| features.iter().any(|f| f == feature);
        let property = |key: &str| self.property(key).map(str::to_ascii_lowercase);
        if let Some(method) = property("sasl.oauthbearer.method") {
            return Err(ConfigError::invalid(
                "kafka.properties.\"sasl.oauthbearer.method\"",
                format!("\"{method}\": {OAUTHBEARER_HOW}"),
            ));
        }
        if let Some(mechanisms) = property("sasl.mechanisms").or_else(|| property("sasl.mechanism")) {
            for mechanism in mechanisms.split(',').map(str::trim) {
                if mechanism == "oauthbearer" && self.auth.is_none() {
                    return Err(ConfigError::invalid(
                        "kafka.auth",
                        format!("must be set for sasl.mechanism = \"OAUTHBEARER\": {OAUTHBEARER_HOW}"),
                    ));
                }
                let needed = match mechanism {
                    "plain" => "sasl_plain",
                    "scram-sha-256" | "scram-sha-512" => "sasl_scram",
                    "oauthbearer" => "sasl_oauthbearer",
                    "gssapi" => "sasl_gssapi",
                    _ => "unknown mechanism",
                };
                if !has(needed) {
                    return Err(ConfigError::invalid(
                        "kafka.properties.\"sasl.mechanisms\"",
                        format!(
                            "\"{mechanism}\" is not supported by this binary (librdkafka has: {})",
                            features.join(",")
                        ),
                    ));
                }
            }
        }
        Ok(())
    }
}

/// How OAUTHBEARER works here (docs/security.md, "Kafka OAUTHBEARER"): librdkafka fetches OIDC
/// tokens itself only when built with libcurl, which this binary's is not; the relay fetches them
/// (`[kafka.auth]`, `crate::credentials`) and hands them over through the token callback.
const OAUTHBEARER_HOW: &str = "the relay obtains OAUTHBEARER tokens itself: set [kafka.auth] mechanism = \"oidc\" \
     (client credentials), \"token_file\" or \"msk_iam\" and leave sasl.mechanism and sasl.oauthbearer.method out \
     of kafka.properties (librdkafka's own OIDC fetch needs libcurl, which this binary's librdkafka is built without)";

/// Why librdkafka refuses `key = value`, without the value; `None` when it takes it.
fn librdkafka_refuses(key: &str, value: &str) -> Option<String> {
    let mut one = rdkafka::ClientConfig::new();
    one.set(key, value);
    match one.create_native_config() {
        Ok(_) => None,
        Err(KafkaError::ClientConfig(RDKafkaConfRes::RD_KAFKA_CONF_UNKNOWN, ..)) => Some(
            "librdkafka has no such property; fix its spelling (librdkafka's CONFIGURATION.md lists them)"
                .into(),
        ),
        Err(KafkaError::ClientConfig(..)) => Some(
            "librdkafka refuses the value (not shown: it may be a secret); see librdkafka's \
             CONFIGURATION.md for the values it takes"
                .into(),
        ),
        Err(_) => Some("librdkafka cannot take it (a NUL character in the key or the value)".into()),
    }
}

/// librdkafka's `builtin.features` (e.g. `gzip,snappy,ssl,sasl,...,zstd`).
pub fn built_in_features() -> Vec<String> {
    rdkafka::ClientConfig::new()
        .create_native_config()
        .and_then(|native| native.get("builtin.features"))
        .map(|features| features.split(',').map(String::from).collect())
        .unwrap_or_default()
}
