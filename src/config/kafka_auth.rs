//! `[kafka.auth]`: where the relay gets the SASL OAUTHBEARER tokens it hands librdkafka
//! (`crate::credentials` fetches and refreshes them).
//!
//! Invariants:
//! - with `[kafka.auth]` the relay sets `sasl.mechanism = OAUTHBEARER` itself, and
//!   `security.protocol = SASL_SSL` unless `kafka.properties` says `SASL_PLAINTEXT`; without it,
//!   OAUTHBEARER in `kafka.properties` is refused at load, naming `kafka.auth` (librdkafka here
//!   has no libcurl, so its own OIDC fetch, `sasl.oauthbearer.method = oidc`, stays refused);
//! - the client secret is a [`Secret`] (from `client_secret_file`, read at each token request
//!   so a rotated Secret is picked up, or `OUTBOX_RELAY__KAFKA__AUTH__CLIENT_SECRET`), never
//!   printed;
//! - every error names the `kafka.auth.*` key to fix.

use serde::{Deserialize, Serialize};

use super::{ConfigError, Secret};

/// How tokens are obtained.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AuthMechanism {
    /// OIDC client credentials grant against `token_endpoint_url` (Keycloak, Entra ID, Okta,
    /// Confluent Cloud identity pools, ...).
    Oidc,
    /// A token another process writes to `token_file` (a Kubernetes projected service-account
    /// token, a sidecar): read again when it changes.
    TokenFile,
    /// AWS MSK IAM: a SigV4-signed `kafka-cluster:Connect` token for `region`, with
    /// credentials from the standard chain (environment, web identity, container, instance).
    MskIam,
}

impl AuthMechanism {
    /// The name `check` and the logs use.
    pub fn label(self) -> &'static str {
        match self {
            AuthMechanism::Oidc => "oidc",
            AuthMechanism::TokenFile => "token_file",
            AuthMechanism::MskIam => "msk_iam",
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KafkaAuthConfig {
    /// `oidc`, `token_file` or `msk_iam`.
    pub mechanism: AuthMechanism,
    /// oidc: the identity provider's token endpoint (`https://idp/realms/x/protocol/openid-connect/token`).
    #[serde(default)]
    pub token_endpoint_url: String,
    /// oidc: the client id of the relay's confidential client.
    #[serde(default)]
    pub client_id: String,
    /// oidc: the client secret (prefer `client_secret_file` or the environment variable
    /// `OUTBOX_RELAY__KAFKA__AUTH__CLIENT_SECRET`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_secret: Option<Secret>,
    /// oidc: a file whose first line is the client secret (a mounted Kubernetes Secret); read at
    /// each token request.
    #[serde(default)]
    pub client_secret_file: String,
    /// oidc: the `scope` of the token request (space-separated; empty: none sent).
    #[serde(default)]
    pub scope: String,
    /// oidc: the `audience` of the token request, for providers that take one (Auth0, Confluent
    /// Cloud); empty: none sent.
    #[serde(default)]
    pub audience: String,
    /// oidc: PEM CA certificates to verify the token endpoint with; empty: the Mozilla roots.
    #[serde(default)]
    pub ca_file: String,
    /// token_file: the file holding the token (a JWT), re-read when it changes.
    #[serde(default)]
    pub token_file: String,
    /// msk_iam: the cluster's AWS region (`eu-west-1`); empty: `AWS_REGION`, then
    /// `AWS_DEFAULT_REGION`.
    #[serde(default)]
    pub region: String,
    /// A token is replaced once this share of its lifetime has passed (percent, 10..=90); a
    /// failed refresh is retried with backoff until the token expires.
    #[serde(default = "default_refresh_at_percent")]
    pub refresh_at_percent: u8,
    /// Longest wait for one token request.
    #[serde(default = "default_request_timeout_ms")]
    pub request_timeout_ms: u64,
}

fn default_refresh_at_percent() -> u8 {
    50
}
fn default_request_timeout_ms() -> u64 {
    10_000
}

impl KafkaAuthConfig {
    /// Checks that the mechanism has what it needs; each error names the key.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let need = |value: &str, key: &str| {
            if value.trim().is_empty() {
                Err(ConfigError::invalid(
                    format!("kafka.auth.{key}"),
                    format!("must be set with kafka.auth.mechanism = \"{}\"", self.mechanism.label()),
                ))
            } else {
                Ok(())
            }
        };
        match self.mechanism {
            AuthMechanism::Oidc => {
                need(&self.token_endpoint_url, "token_endpoint_url")?;
                let url = &self.token_endpoint_url;
                if !(url.starts_with("https://") || url.starts_with("http://")) {
                    return Err(ConfigError::invalid(
                        "kafka.auth.token_endpoint_url",
                        format!("\"{url}\" is not an http(s) URL"),
                    ));
                }
                need(&self.client_id, "client_id")?;
                match (&self.client_secret, self.client_secret_file.is_empty()) {
                    (Some(_), false) => {
                        return Err(ConfigError::invalid(
                            "kafka.auth.client_secret_file",
                            "set kafka.auth.client_secret or kafka.auth.client_secret_file, not both",
                        ));
                    }
                    (None, true) => {
                        return Err(ConfigError::invalid(
                            "kafka.auth.client_secret_file",
                            "must be set with kafka.auth.mechanism = \"oidc\" (or kafka.auth.client_secret, e.g. \
                             from OUTBOX_RELAY__KAFKA__AUTH__CLIENT_SECRET)",
                        ));
                    }
                    _ => {}
                }
            }
            AuthMechanism::TokenFile => need(&self.token_file, "token_file")?,
            AuthMechanism::MskIam => {
                if self.region.is_empty() && region_from_env().is_none() {
                    return Err(ConfigError::invalid(
                        "kafka.auth.region",
                        "must be set with kafka.auth.mechanism = \"msk_iam\" (or AWS_REGION)",
                    ));
                }
            }
        }
        if !(10..=90).contains(&self.refresh_at_percent) {
            return Err(ConfigError::invalid("kafka.auth.refresh_at_percent", "must be between 10 and 90"));
        }
        if !(100..=120_000).contains(&self.request_timeout_ms) {
            return Err(ConfigError::invalid(
                "kafka.auth.request_timeout_ms",
                "must be between 100 and 120000",
            ));
        }
        Ok(())
    }

    /// The AWS region: `region`, else `AWS_REGION`, else `AWS_DEFAULT_REGION`.
    pub fn aws_region(&self) -> Option<String> {
        if self.region.is_empty() { region_from_env() } else { Some(self.region.clone()) }
    }
}

fn region_from_env() -> Option<String> {
    ["AWS_REGION", "AWS_DEFAULT_REGION"]
        .iter()
        .find_map(|name| std::env::var(name).ok().filter(|v| !v.is_empty()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn oidc() -> KafkaAuthConfig {
        KafkaAuthConfig {
            mechanism: AuthMechanism::Oidc,
            token_endpoint_url: "https://idp.example/token".into(),
            client_id: "relay".into(),
            client_secret: Some(Secret::new("s")),
            client_secret_file: String::new(),
            scope: String::new(),
            audience: String::new(),
            ca_file: String::new(),
            token_file: String::new(),
            region: String::new(),
            refresh_at_percent: 50,
            request_timeout_ms: 10_000,
        }
    }

    #[test]
    fn incomplete_settings_are_refused_naming_the_key() {
        assert!(oidc().validate().is_ok());
        let err = |c: KafkaAuthConfig| c.validate().unwrap_err().to_string();
        assert!(
            err(KafkaAuthConfig { token_endpoint_url: String::new(), ..oidc() })
                .starts_with("kafka.auth.token_endpoint_url")
        );
        assert!(
            err(KafkaAuthConfig { client_id: String::new(), ..oidc() }).starts_with("kafka.auth.client_id")
        );
        assert!(
            err(KafkaAuthConfig { client_secret: None, ..oidc() })
                .starts_with("kafka.auth.client_secret_file")
        );
        assert!(err(KafkaAuthConfig { client_secret_file: "/x".into(), ..oidc() }).contains("not both"));
        assert!(
            err(KafkaAuthConfig { mechanism: AuthMechanism::TokenFile, ..oidc() })
                .starts_with("kafka.auth.token_file")
        );
        assert!(
            err(KafkaAuthConfig { refresh_at_percent: 95, ..oidc() })
                .starts_with("kafka.auth.refresh_at_percent")
        );
    }

    #[test]
    fn the_client_secret_is_never_printed() {
        let shown = format!("{:?} {}", oidc(), serde_json::to_string(&oidc()).unwrap());
        assert!(!shown.contains("\"s\""), "{shown}");
    }
}
