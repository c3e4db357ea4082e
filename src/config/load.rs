//! Loading the configuration: a TOML file, then `PREFIX__SECTION__FIELD` environment overrides,
//! then the deprecated settings moved, the secrets read, and the whole validated.
//!
//! Invariants:
//! - an error names the file and the field, and the environment variable when one set it;
//! - an error never quotes a line of the file, nor the value of a secret setting (it may be the
//!   secret itself).

use std::collections::BTreeMap;
use std::path::Path;

use super::{
    AfterPublish, ConfigError, ENV_PREFIX, OnPoison, RelayConfig, SourceMode, SslMode,
    is_secret_kafka_property, kafka,
};

impl RelayConfig {
    /// Loads `file`, applies `OUTBOX_RELAY__*` environment overrides, and validates.
    pub fn load(file: &Path) -> Result<RelayConfig, ConfigError> {
        let env = std::env::vars().collect();
        Self::load_with_env(file, env)
    }

    /// As [`RelayConfig::load`], with the environment given (tests do not touch the process's).
    pub fn load_with_env(file: &Path, env: config::Map<String, String>) -> Result<RelayConfig, ConfigError> {
        let secret_env: BTreeMap<String, String> = env
            .iter()
            .filter(|(name, _)| name.starts_with(kafka::SECRET_ENV_PREFIX))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let registry_password: BTreeMap<String, String> = env
            .get(super::registry::PASSWORD_ENV)
            .map(|p| (super::registry::PASSWORD_ENV.to_string(), p.clone()))
            .into_iter()
            .collect();
        let names: Vec<String> = env.keys().cloned().collect();
        let loaded: Result<RelayConfig, ConfigError> =
            load_layered(file, ENV_PREFIX, env, "see deploy/relay.example.toml for a documented example");
        // (before a load error: the misnamed variable may be its cause)
        let known = loaded.as_ref().ok().and_then(|relay| serde_json::to_value(relay).ok());
        refuse_single_underscores(names.iter(), known.as_ref())?;
        let mut relay = loaded?;
        relay.move_deprecated()?;
        relay.kafka.load_secrets(&secret_env)?;
        for outbox in std::iter::once(&mut relay.outbox).chain(relay.outboxes.iter_mut()) {
            if let Some(registry) = &mut outbox.registry {
                registry.load_secrets(&registry_password);
            }
        }
        relay.validate()?;
        let warnings = relay.secret_file_warnings();
        relay.deprecations.extend(warnings);
        let warnings = relay.format_warnings();
        relay.deprecations.extend(warnings);
        Ok(relay)
    }

    /// A warning for each secret file (`postgres.password_file`, `postgres.sslkey`,
    /// `kafka.secret_properties_file`, `replication.message_signing_key_file`, each outbox's
    /// `registry.password_file`, `dead_letter.signing_key_file` and `transforms.hash_key_file`,
    /// `admin.tls_key_file` and each
    /// `admin.tokens[i].token_file`) that users other than its owner can read.
    pub fn secret_file_warnings(&self) -> Vec<String> {
        let registries = self.outboxes().into_iter().filter_map(|outbox| {
            let file = outbox.config.registry?.password_file;
            Some((format!("{}.registry.password_file", outbox.path), file))
        });
        let letter_keys = self
            .outboxes()
            .into_iter()
            .map(|o| ("dead_letter.signing_key_file".to_string(), o.dead_letter.signing_key_file));
        let hash_keys = self
            .outboxes()
            .into_iter()
            .map(|o| (format!("{}.transforms.hash_key_file", o.path), o.config.transforms.hash_key_file));
        let admin = self
            .admin
            .tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (format!("admin.tokens[{i}].token_file"), t.token_file.clone()));
        let admin = admin.chain([("admin.tls_key_file".to_string(), self.admin.tls_key_file.clone())]);
        let mut warnings: Vec<String> = [
            ("postgres.password_file".to_string(), self.postgres.password_file.clone()),
            ("postgres.sslkey".to_string(), self.postgres.sslkey.clone()),
            ("kafka.secret_properties_file".to_string(), self.kafka.secret_properties_file.clone()),
            (
                "replication.message_signing_key_file".to_string(),
                self.replication.message_signing_key_file.clone(),
            ),
        ]
        .into_iter()
        .chain(registries)
        .chain(letter_keys)
        .chain(hash_keys)
        .chain(admin)
        .filter_map(|(setting, path)| super::file_mode_warning(&setting, &path))
        .collect();
        // (outboxes sharing [dead_letter] name its key file once)
        warnings.dedup();
        warnings
    }
}

/// The sections an `OUTBOX_RELAY__SECTION__KEY` variable may name, but `kafka` (whose
/// `OUTBOX_RELAY_KAFKA_<KEY>` form, single underscores, is a secret librdkafka property).
const SECTIONS: &[&str] = &[
    "source",
    "postgres",
    "outbox",
    "polling",
    "replication",
    "dead_letter",
    "dedup",
    "retry",
    "shutdown",
    "metrics",
    "admin",
];

/// A variable such as `OUTBOX_RELAY_POSTGRES_PASSWORD` looks like an override but is not one (the
/// separators are double underscores): an error naming the variable meant, instead of a setting
/// silently ignored. The value is never shown. Only a name whose rest is a setting of its section
/// (`known`: the loaded configuration; without it, any name but a Kubernetes service link's) is
/// refused: Kubernetes gives every pod `<SERVICE>_SERVICE_HOST` and the like for each Service of
/// the namespace, and a Service named `outbox-relay-polling` must not stop the relay.
fn refuse_single_underscores<'a>(
    names: impl Iterator<Item = &'a String>,
    known: Option<&serde_json::Value>,
) -> Result<(), ConfigError> {
    for name in names {
        let upper = name.to_ascii_uppercase();
        let Some(rest) = upper.strip_prefix(&format!("{ENV_PREFIX}_")) else { continue };
        if rest.starts_with('_') || service_link(rest) {
            continue;
        }
        let meant = SECTIONS.iter().find_map(|section| {
            let key = rest.strip_prefix(&format!("{}_", section.to_ascii_uppercase()))?;
            let setting = key.to_ascii_lowercase();
            let is_setting = match known.and_then(|k| k.get(section)).and_then(|s| s.as_object()) {
                Some(fields) => fields.keys().any(|f| setting == *f || setting.starts_with(&format!("{f}_"))),
                None => true,
            };
            (!key.is_empty() && !key.starts_with('_') && is_setting)
                .then(|| format!("{ENV_PREFIX}__{}__{key}", section.to_ascii_uppercase()))
        });
        if let Some(meant) = meant {
            return Err(ConfigError::Load(format!(
                "environment variable {name} is not read: an override has two underscores between the prefix, \
                 the section and the key; set {meant} instead (and unset {name})"
            )));
        }
    }
    Ok(())
}

/// The shape of a variable Kubernetes sets for a Service (`<NAME>_SERVICE_HOST`,
/// `<NAME>_SERVICE_PORT[_<PORT>]`, `<NAME>_PORT[_<N>_<PROTO>[_...]]`).
fn service_link(rest: &str) -> bool {
    rest.ends_with("_SERVICE_HOST")
        || rest.contains("_SERVICE_PORT")
        || rest.ends_with("_PORT")
        || (rest.contains("_PORT_") && ["_TCP", "_UDP", "_SCTP"].iter().any(|proto| rest.contains(proto)))
}

/// Loads `file` (TOML) with `PREFIX__SECTION__FIELD` overrides from `env` into `T`; errors name
/// the file and the field. `example` says where a documented example is, for a missing file.
/// The relay and the example services share it, so they read configuration alike.
pub fn load_layered<T: serde::de::DeserializeOwned>(
    file: &Path,
    prefix: &str,
    env: config::Map<String, String>,
    example: &str,
) -> Result<T, ConfigError> {
    if !file.is_file() {
        return Err(ConfigError::Load(format!("config file {}: not found ({example})", file.display())));
    }
    let env_keys: Vec<String> = env.keys().cloned().collect();
    let layered = config::Config::builder()
        .add_source(config::File::from(file).format(config::FileFormat::Toml))
        .add_source(
            config::Environment::with_prefix(prefix).prefix_separator("__").separator("__").source(Some(env)),
        )
        .build()
        .map_err(|e| {
            ConfigError::Load(format!(
                "config file {}: {}",
                file.display(),
                without_source_lines(&e.to_string())
            ))
        })?;
    let tree: config::Value = layered.try_deserialize().map_err(|e| {
        ConfigError::Load(format!("config file {}: {}", file.display(), without_source_lines(&e.to_string())))
    })?;
    serde_path_to_error::deserialize(tree).map_err(|e| {
        let path = e.path().to_string();
        let error = describe_serde_error(&path, &e.into_inner().to_string());
        match (error, env_override(&env_keys, prefix, &path)) {
            (ConfigError::Invalid { path, message }, Some(variable)) => ConfigError::invalid(
                path,
                format!("{message} (the value comes from the environment variable {variable})"),
            ),
            (error, _) => error,
        }
    })
}

/// The environment variable among `keys` that sets `path` (`postgres.port` is
/// `<PREFIX>__POSTGRES__PORT`, in any case), if one does.
fn env_override(keys: &[String], prefix: &str, path: &str) -> Option<String> {
    let wanted = format!("{prefix}__{}", path.replace('.', "__"));
    keys.iter().find(|k| k.eq_ignore_ascii_case(&wanted)).cloned()
}

/// The valid values of one of the configuration's enums, by its type name, as serde lists them
/// ("`replication` or `polling`"); `None` for a type this does not know.
fn enum_values(type_name: &str) -> Option<String> {
    let probe = || serde_json::Value::String(String::new());
    let error = match type_name {
        "SourceMode" => serde_json::from_value::<SourceMode>(probe()).err()?,
        "SslMode" => serde_json::from_value::<SslMode>(probe()).err()?,
        "AfterPublish" => serde_json::from_value::<AfterPublish>(probe()).err()?,
        "OnPoison" => serde_json::from_value::<OnPoison>(probe()).err()?,
        "RecordFormat" => serde_json::from_value::<super::RecordFormat>(probe()).err()?,
        "CloudEventsMode" => serde_json::from_value::<super::CloudEventsMode>(probe()).err()?,
        "Converter" => serde_json::from_value::<super::Converter>(probe()).err()?,
        _ => return None,
    };
    // serde says "expected `a` or `b`", or "expected one of `a`, `b`, `c`"
    let values = error.to_string().split_once("expected ").map(|(_, values)| values.to_string())?;
    Some(values.strip_prefix("one of ").map(str::to_string).unwrap_or(values))
}

/// A parse error without the lines of the file it quotes: the offending line may hold a secret
/// (`password = "...` with the closing quote missing). Line and column stay.
fn without_source_lines(message: &str) -> String {
    message
        .lines()
        .filter(|line| {
            let t = line.trim_start();
            let gutter = t.trim_start_matches(|c: char| c.is_ascii_digit()).trim_start();
            !(gutter.starts_with('|') || t.starts_with('^'))
        })
        .map(str::trim)
        .filter(|line| !line.is_empty())
        .collect::<Vec<_>>()
        .join(": ")
}

/// Paths whose values are secrets: their values never appear in an error.
fn is_secret_path(path: &str) -> bool {
    path == "postgres.password"
        || path
            .strip_prefix("kafka.properties.")
            .is_some_and(|k| is_secret_kafka_property(k.trim_matches('"')))
}

/// Turns serde's wording into a path and advice. serde_path_to_error puts an unknown field in
/// the path already; a missing one is reported at its parent, so its name is moved into the path.
fn describe_serde_error(path: &str, inner: &str) -> ConfigError {
    // (the config crate appends " for key `path`": the path is said once, first)
    let inner = inner.split(" for key `").next().unwrap_or(inner);
    if is_secret_path(path) {
        return ConfigError::invalid(path, "invalid value (not shown: it is a secret); it must be a string");
    }
    // the config crate's words for an unknown enum value: "enum SourceMode does not have variant
    // constructor logical"
    if let Some((head, value)) = inner.split_once(" does not have variant constructor ") {
        let type_name = head.trim_start_matches("enum ").trim();
        let valid =
            enum_values(type_name).map_or_else(String::new, |values| format!("; it must be one of {values}"));
        let value = value.trim();
        return ConfigError::invalid(path, format!("\"{value}\" is not a valid value{valid}"));
    }
    if inner.starts_with("unknown field") {
        let hint = did_you_mean(inner).map_or_else(String::new, |known| format!("did you mean `{known}`? "));
        return ConfigError::invalid(
            path,
            format!(
                "unknown setting; {hint}remove it or fix its spelling (deploy/relay.example.toml lists every option)"
            ),
        );
    }
    if inner.starts_with("missing") {
        let field = inner.split(['`', '"']).nth(1).unwrap_or_default();
        let child = match path {
            "" | "." => field.to_string(),
            parent => format!("{parent}.{field}"),
        };
        return ConfigError::invalid(child, "is required");
    }
    ConfigError::invalid(path, inner)
}

/// The known key closest to the unknown one in serde's "unknown field `lingr_ms`, expected one
/// of `brokers`, `linger_ms`, ...", when it is close enough to be a typo (at most a third of
/// its letters differ, and at least one is the same).
fn did_you_mean(inner: &str) -> Option<String> {
    let mut quoted = inner.split('`').skip(1).step_by(2);
    let unknown = quoted.next()?.to_ascii_lowercase();
    let (distance, known) =
        quoted.map(|known| (edit_distance(&unknown, &known.to_ascii_lowercase()), known)).min()?;
    (distance <= (unknown.len() / 3).max(1) && distance < unknown.len()).then(|| known.to_string())
}

/// Levenshtein distance, by characters.
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let above = row[j + 1];
            row[j + 1] = (above + 1).min(row[j] + 1).min(diagonal + usize::from(ca != *cb));
            diagonal = above;
        }
    }
    row[b.len()]
}
