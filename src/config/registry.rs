//! The schema registry's settings: `[outbox.registry]` (or `[outboxes.registry]`).
//!
//! Invariants:
//! - the password is a [`Secret`]: `Debug` and `Serialize` print a placeholder;
//! - [`RegistryConfig::validate`] names the setting by the path it is given
//!   (`outboxes[0].registry.url: ...`);
//! - credentials never go in `url` (a URL is logged); they go in `username` and `password`;
//! - credentials are not sent over plain `http://` unless `allow_http_credentials` says so.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::secret::Secret;

pub const DEFAULT_REGISTRY_TIMEOUT_MS: u64 = 10_000;
/// The longest `timeout_ms` accepted: a registry slower than this is down (and the first record
/// of a subject waits this long at most, in a polling claim or between replication keepalives).
pub const MAX_REGISTRY_TIMEOUT_MS: u64 = 30_000;
/// The environment variable that, when set and not empty, is the registry password (it wins
/// over `password` in the file, for every registry section).
pub const PASSWORD_ENV: &str = "OUTBOX_RELAY_REGISTRY_PASSWORD";

/// Which encoding a record value gets, and which kind of schema the registry holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SchemaType {
    /// Avro binary (the schema is an `.avsc` JSON document).
    Avro,
    /// The payload's JSON text, validated against a JSON Schema.
    Json,
    /// Protobuf binary of the schema's first message (the schema is `.proto` text).
    Protobuf,
}

impl SchemaType {
    /// The registry's `schemaType` value.
    pub fn registry_name(self) -> &'static str {
        match self {
            SchemaType::Avro => "AVRO",
            SchemaType::Json => "JSON",
            SchemaType::Protobuf => "PROTOBUF",
        }
    }
}

/// How a record's subject is named (Confluent's `value.subject.name.strategy`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SubjectStrategy {
    /// `<topic>-value`: one schema per topic.
    #[default]
    TopicName,
    /// The schema's fully-qualified name, whatever the topic: Avro `namespace.name`, Protobuf
    /// `package.Message` (the first message), JSON Schema `title`.
    RecordName,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RegistryConfig {
    /// The registry's base URL, `http://` or `https://`, with any path prefix
    /// (`https://registry:8081`, `http://apicurio:8080/apis/ccompat/v7`). No credentials in it.
    pub url: String,
    /// Basic-auth user; empty (default): no authentication.
    #[serde(default)]
    pub username: String,
    /// Basic-auth password, with `username`. Better kept out of the file: `password_file`, or the
    /// environment variable `OUTBOX_RELAY_REGISTRY_PASSWORD`, which when set is used instead
    /// ([`RegistryConfig::load_secrets`]). Never printed.
    #[serde(default)]
    pub password: Secret,
    /// A file whose first line is the password, read at each request (a rotated Kubernetes
    /// Secret is used without a restart); instead of `password` and `OUTBOX_RELAY_REGISTRY_PASSWORD`.
    #[serde(default)]
    pub password_file: String,
    /// Send `username`/`password` (basic auth: the password in clear) over a plain `http://`
    /// url. Off (default): refused at load, naming this setting; use `https://`, or turn it on
    /// only where no one else can read the network (loopback, a sidecar).
    #[serde(default)]
    pub allow_http_credentials: bool,
    /// A PEM file of the CA certificates that sign the registry's certificate (an `https://`
    /// registry with a private CA). Empty (default): the Mozilla roots (webpki-roots).
    #[serde(default)]
    pub ca_file: String,
    /// How long one request to the registry may take, connecting included.
    #[serde(default = "default_timeout_ms")]
    pub timeout_ms: u64,
    /// `avro`, `json` or `protobuf`: the encoding of record values.
    pub schema_type: SchemaType,
    /// `topic_name` (default; subject `<topic>-value`) or `record_name` (subject = the schema's
    /// fully-qualified name; needs `schema_file`).
    #[serde(default)]
    pub subject_strategy: SubjectStrategy,
    /// true: register `schema_file` under each subject at first use and use the id the registry
    /// returns. false (default): only look it up (by content with `schema_file`, else the
    /// subject's latest version); a schema the registry does not hold is an error.
    #[serde(default)]
    pub auto_register: bool,
    /// The schema text: an `.avsc` JSON document, a JSON Schema document, or `.proto` text.
    /// Required with `auto_register` or `subject_strategy = "record_name"`; without it each
    /// subject's latest version is used.
    #[serde(default)]
    pub schema_file: String,
}

fn default_timeout_ms() -> u64 {
    DEFAULT_REGISTRY_TIMEOUT_MS
}

impl RegistryConfig {
    /// A configuration with the defaults, for `url` and `schema_type`.
    pub fn new(url: impl Into<String>, schema_type: SchemaType) -> RegistryConfig {
        RegistryConfig {
            url: url.into(),
            username: String::new(),
            password: Secret::default(),
            password_file: String::new(),
            allow_http_credentials: false,
            ca_file: String::new(),
            timeout_ms: DEFAULT_REGISTRY_TIMEOUT_MS,
            schema_type,
            subject_strategy: SubjectStrategy::default(),
            auto_register: false,
            schema_file: String::new(),
        }
    }

    /// Takes the password from `OUTBOX_RELAY_REGISTRY_PASSWORD` in `env` when it is set and not
    /// empty. The configuration loader calls it after reading the file, before [`validate`].
    ///
    /// [`validate`]: RegistryConfig::validate
    pub fn load_secrets(&mut self, env: &BTreeMap<String, String>) {
        if let Some(password) = env.get(PASSWORD_ENV).filter(|p| !p.is_empty()) {
            self.password = Secret::new(password.as_str());
        }
    }

    /// Checks the settings; an error names `<path>.<setting>` and says what to do.
    pub fn validate(&self, path: &str) -> Result<(), String> {
        self.validate_url(path)?;
        let (inline, file) = (!self.password.expose().is_empty(), !self.password_file.is_empty());
        if inline && file {
            return Err(format!(
                "{path}.password_file: set either it or {path}.password (or {PASSWORD_ENV}), not both"
            ));
        }
        if self.username.is_empty() && (inline || file) {
            return Err(format!(
                "{path}.username: must be set with {path}.password (or {path}.password_file, or \
                 {PASSWORD_ENV}): the registry uses basic authentication"
            ));
        }
        let has_password = inline || file;
        if !self.username.is_empty() && !has_password {
            return Err(format!(
                "{path}.password: must be set with {path}.username; set {path}.password_file, \
                 {path}.password, or the environment variable {PASSWORD_ENV}"
            ));
        }
        if self.timeout_ms == 0 || self.timeout_ms > MAX_REGISTRY_TIMEOUT_MS {
            return Err(format!(
                "{path}.timeout_ms: must be between 1 and {MAX_REGISTRY_TIMEOUT_MS} (is {})",
                self.timeout_ms
            ));
        }
        self.validate_files(path)
    }

    fn validate_url(&self, path: &str) -> Result<(), String> {
        let url = reqwest::Url::parse(&self.url)
            .map_err(|e| format!("{path}.url: \"{}\" is not a URL ({e})", self.url))?;
        if !matches!(url.scheme(), "http" | "https") {
            return Err(format!("{path}.url: must start with http:// or https:// (is {}://)", url.scheme()));
        }
        if !url.username().is_empty() || url.password().is_some() {
            return Err(format!(
                "{path}.url: must not hold credentials (a URL is logged); set {path}.username and \
                 {path}.password instead"
            ));
        }
        if url.query().is_some() || url.fragment().is_some() {
            return Err(format!("{path}.url: must be the registry's base URL, without ?query or #fragment"));
        }
        if let Some(refused) = self.refuse_http_credentials(path) {
            return Err(refused);
        }
        if !self.ca_file.is_empty() && url.scheme() == "http" {
            return Err(format!(
                "{path}.ca_file: is only used with an https:// url; use https:// or remove ca_file"
            ));
        }
        Ok(())
    }

    /// The password to send: `password`, or the first line of `password_file`, read now (at
    /// each request, so a rotated file is used); the error names the setting, never the value.
    pub fn current_password(&self) -> Result<Secret, String> {
        if self.password_file.is_empty() {
            return Ok(self.password.clone());
        }
        let text = std::fs::read_to_string(&self.password_file)
            .map_err(|e| format!("registry.password_file {}: {e}", self.password_file))?;
        Ok(Secret::new(text.lines().next().unwrap_or_default()))
    }

    /// The error for credentials configured with a plain `http://` url, unless
    /// `allow_http_credentials` is on. (The registry client checks it again: the ledger builds
    /// its client without [`RegistryConfig::validate`].)
    pub fn refuse_http_credentials(&self, path: &str) -> Option<String> {
        let plain = reqwest::Url::parse(&self.url).is_ok_and(|url| url.scheme() == "http");
        (plain && !self.username.is_empty() && !self.allow_http_credentials).then(|| {
            format!(
                "{path}.url: is http://, and {path}.username/password would cross the network in \
                 clear (basic auth); use https://, or set {path}.allow_http_credentials = true where \
                 no one else can read the network (loopback)"
            )
        })
    }

    fn validate_files(&self, path: &str) -> Result<(), String> {
        if self.schema_file.is_empty() {
            if self.auto_register {
                return Err(format!(
                    "{path}.schema_file: required with auto_register = true (the schema to register)"
                ));
            }
            if self.subject_strategy == SubjectStrategy::RecordName {
                return Err(format!(
                    "{path}.schema_file: required with subject_strategy = \"record_name\" (the subject \
                     is the schema's name)"
                ));
            }
        }
        let files = [
            ("schema_file", &self.schema_file),
            ("ca_file", &self.ca_file),
            ("password_file", &self.password_file),
        ];
        for (setting, file) in files {
            if !file.is_empty() && !Path::new(file).is_file() {
                return Err(format!("{path}.{setting}: {file} is not a readable file"));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PATH: &str = "outboxes[0].format.registry";

    fn config() -> RegistryConfig {
        RegistryConfig::new("https://registry:8081", SchemaType::Avro)
    }

    fn error(config: &RegistryConfig) -> String {
        config.validate(PATH).unwrap_err()
    }

    #[test]
    fn the_defaults_fill_what_is_left_out_and_unknown_settings_are_refused() {
        let parsed: RegistryConfig =
            serde_json::from_str(r#"{"url": "http://apicurio:8080/apis/ccompat/v7", "schema_type": "json"}"#)
                .unwrap();
        assert_eq!(parsed.timeout_ms, DEFAULT_REGISTRY_TIMEOUT_MS);
        assert_eq!(parsed.subject_strategy, SubjectStrategy::TopicName);
        assert!(!parsed.auto_register);
        parsed.validate(PATH).unwrap();
        let unknown = serde_json::from_str::<RegistryConfig>(
            r#"{"url": "http://r", "schema_type": "avro", "subjects": "x"}"#,
        );
        assert!(unknown.unwrap_err().to_string().contains("unknown field `subjects`"));
        let bad_type = serde_json::from_str::<RegistryConfig>(r#"{"url": "http://r", "schema_type": "xml"}"#);
        assert!(bad_type.unwrap_err().to_string().contains("`avro`, `json`, `protobuf`"));
    }

    #[test]
    fn url_errors_name_the_setting() {
        let mut c = config();
        c.url = "registry:8081".into();
        assert!(
            error(&c).starts_with(&format!("{PATH}.url: must start with http:// or https://")),
            "{}",
            error(&c)
        );
        c.url = "not a url".into();
        assert!(error(&c).starts_with(&format!("{PATH}.url: \"not a url\" is not a URL")));
        c.url = "https://user:pw@registry".into();
        let message = error(&c);
        assert!(message.contains("must not hold credentials") && !message.contains("pw@"), "{message}");
        c.url = "http://registry".into();
        c.ca_file = "/etc/ssl/ca.pem".into();
        assert!(error(&c).starts_with(&format!("{PATH}.ca_file: is only used with an https:// url")));
    }

    #[test]
    fn credentials_come_in_pairs_and_the_password_may_come_from_the_environment() {
        let mut c = config();
        c.username = "relay".into();
        assert!(error(&c).starts_with(&format!("{PATH}.password: must be set with {PATH}.username")));
        let env = BTreeMap::from([(PASSWORD_ENV.to_string(), "SENTINEL".to_string())]);
        c.load_secrets(&env);
        c.validate(PATH).unwrap();
        assert_eq!(c.password.expose(), "SENTINEL");
        c.username.clear();
        assert!(error(&c).starts_with(&format!("{PATH}.username: must be set with {PATH}.password")));
    }

    #[test]
    fn credentials_over_plain_http_are_refused_unless_allowed() {
        let mut c = config();
        c.url = "http://registry:8081".into();
        c.username = "relay".into();
        c.password = Secret::new("SENTINEL");
        let message = error(&c);
        assert!(message.starts_with(&format!("{PATH}.url: is http://")), "{message}");
        assert!(message.contains(&format!("{PATH}.allow_http_credentials = true")), "{message}");
        assert!(!message.contains("SENTINEL"), "{message}");
        c.allow_http_credentials = true;
        c.validate(PATH).unwrap();
        c.allow_http_credentials = false;
        c.url = "HTTPS://registry:8081".into();
        c.validate(PATH).unwrap();
        c.url = "http://registry:8081".into();
        c.username.clear();
        c.password = Secret::default();
        c.validate(PATH).unwrap();
    }

    #[test]
    fn the_password_may_come_from_a_file_read_at_each_use_but_not_from_two_places() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("registry-password");
        std::fs::write(&file, "SENTINEL-1\nignored\n").unwrap();
        let mut c = config();
        c.username = "relay".into();
        c.password_file = file.display().to_string();
        c.validate(PATH).unwrap();
        assert_eq!(c.current_password().unwrap().expose(), "SENTINEL-1");
        std::fs::write(&file, "SENTINEL-2\n").unwrap();
        assert_eq!(c.current_password().unwrap().expose(), "SENTINEL-2", "a rotated file is read again");
        let debug = format!("{c:?}");
        assert!(!debug.contains("SENTINEL"), "{debug}");
        c.password = Secret::new("SENTINEL-3");
        let message = error(&c);
        assert!(message.starts_with(&format!("{PATH}.password_file: set either it")), "{message}");
        assert!(!message.contains("SENTINEL"), "{message}");
        c.password = Secret::default();
        std::fs::remove_file(&file).unwrap();
        assert!(error(&c).starts_with(&format!("{PATH}.password_file: ")), "{}", error(&c));
        let gone = c.current_password().unwrap_err();
        assert!(gone.starts_with("registry.password_file ") && !gone.contains("SENTINEL"), "{gone}");
    }

    #[test]
    fn the_password_never_shows() {
        let mut c = config();
        c.username = "relay".into();
        c.password = Secret::new("SENTINEL");
        let debug = format!("{c:?}");
        assert!(!debug.contains("SENTINEL") && debug.contains("redacted"), "{debug}");
        let json = serde_json::to_string(&c).unwrap();
        assert!(!json.contains("SENTINEL"), "{json}");
    }

    #[test]
    fn a_schema_file_is_required_to_register_or_to_name_the_subject_by_the_record() {
        let mut c = config();
        c.auto_register = true;
        assert!(error(&c).starts_with(&format!("{PATH}.schema_file: required with auto_register = true")));
        c.auto_register = false;
        c.subject_strategy = SubjectStrategy::RecordName;
        assert!(error(&c).contains("required with subject_strategy = \"record_name\""));
        c.schema_file = "/nonexistent/order.avsc".into();
        assert_eq!(error(&c), format!("{PATH}.schema_file: /nonexistent/order.avsc is not a readable file"));
    }

    #[test]
    fn timeout_is_bounded() {
        let mut c = config();
        c.timeout_ms = 0;
        assert!(error(&c).starts_with(&format!("{PATH}.timeout_ms: must be between 1 and 30000")));
    }
}
