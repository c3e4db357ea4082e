//! `[tracing]`: the spans the relay exports over OTLP/HTTP, and where to.
//!
//! Invariants:
//! - off unless `enabled = true` (or `OTEL_TRACES_EXPORTER=otlp` with nothing in the file), and
//!   `OTEL_SDK_DISABLED=true` turns it off whatever the file says;
//! - a setting the file leaves out takes the standard `OTEL_*` environment variable's value, then
//!   the default: the file wins where both say something ([`TracingConfig::resolve`]);
//! - header values are [`Secret`]s: an exporter's API key never reaches a log line.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::{ConfigError, Secret};

pub const DEFAULT_TRACING_ENDPOINT: &str = "http://127.0.0.1:4318/v1/traces";
pub const DEFAULT_TRACING_SERVICE_NAME: &str = "outbox-relay";
pub const DEFAULT_TRACING_QUEUE_SIZE: usize = 2_048;
pub const DEFAULT_TRACING_EXPORT_TIMEOUT_MS: u64 = 10_000;

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TracingConfig {
    /// Export spans; off by default.
    pub enabled: bool,
    /// The OTLP/HTTP traces URL (spans are sent JSON-encoded); default
    /// `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, then `OTEL_EXPORTER_OTLP_ENDPOINT` + `/v1/traces`,
    /// then [`DEFAULT_TRACING_ENDPOINT`].
    pub endpoint: Option<String>,
    /// Extra request headers (an API key); default `OTEL_EXPORTER_OTLP_HEADERS` (`k=v,k2=v2`).
    pub headers: BTreeMap<String, Secret>,
    /// CA certificates (PEM) for an `https` endpoint; empty: the public web roots.
    pub ca_file: String,
    /// The `service.name` resource attribute; default `OTEL_SERVICE_NAME`, then "outbox-relay".
    pub service_name: Option<String>,
    /// The share of rows without a `traceparent` that start a trace of their own (0 to 1); a
    /// row with one follows its sampled flag. Default `OTEL_TRACES_SAMPLER_ARG`, then 0.
    pub sample_ratio: Option<f64>,
    /// Finished spans waiting for export; beyond it spans are dropped and counted
    /// (`outbox_relay_trace_spans_dropped_total`), never an event.
    pub queue_size: usize,
    /// One export request's limit.
    pub export_timeout_ms: u64,
}

impl Default for TracingConfig {
    fn default() -> Self {
        TracingConfig {
            enabled: false,
            endpoint: None,
            headers: BTreeMap::new(),
            ca_file: String::new(),
            service_name: None,
            sample_ratio: None,
            queue_size: DEFAULT_TRACING_QUEUE_SIZE,
            export_timeout_ms: DEFAULT_TRACING_EXPORT_TIMEOUT_MS,
        }
    }
}

/// `[tracing]` with the environment applied: what the exporter uses.
#[derive(Debug, Clone, PartialEq)]
pub struct TracingSettings {
    pub endpoint: String,
    pub headers: Vec<(String, Secret)>,
    pub ca_file: String,
    pub service_name: String,
    pub sample_ratio: f64,
    pub queue_size: usize,
    pub export_timeout_ms: u64,
}

impl TracingConfig {
    /// An example service's tracing: off unless the standard environment turns it on
    /// (`OTEL_TRACES_EXPORTER=otlp`, `OTEL_EXPORTER_OTLP_ENDPOINT`, ...), its spans named
    /// `OTEL_SERVICE_NAME` or `name`.
    pub fn for_service(name: &str) -> TracingConfig {
        let service_name = std::env::var("OTEL_SERVICE_NAME").unwrap_or_else(|_| name.to_string());
        TracingConfig { service_name: Some(service_name), ..TracingConfig::default() }
    }

    /// The settings in force, `env` read for what the file leaves out; `None` when tracing is
    /// off. An error names the setting (or variable) and what it must be.
    pub fn resolve(
        &self,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Option<TracingSettings>, ConfigError> {
        let disabled = env("OTEL_SDK_DISABLED").is_some_and(|v| v.trim().eq_ignore_ascii_case("true"));
        let exporter_named = env("OTEL_TRACES_EXPORTER").is_some_and(|v| v.trim() == "otlp");
        if disabled || !(self.enabled || exporter_named) {
            return Ok(None);
        }
        let endpoint = match (
            &self.endpoint,
            env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"),
            env("OTEL_EXPORTER_OTLP_ENDPOINT"),
        ) {
            (Some(endpoint), _, _) => endpoint.clone(),
            (None, Some(traces), _) => traces,
            (None, None, Some(base)) => format!("{}/v1/traces", base.trim_end_matches('/')),
            (None, None, None) => DEFAULT_TRACING_ENDPOINT.to_string(),
        };
        if !(endpoint.starts_with("http://") || endpoint.starts_with("https://")) {
            let message = format!(
                "\"{endpoint}\" is not an http:// or https:// URL (the OTLP/HTTP traces endpoint, e.g. {DEFAULT_TRACING_ENDPOINT})"
            );
            return Err(ConfigError::invalid("tracing.endpoint", message));
        }
        let headers = if self.headers.is_empty() {
            env_headers(env("OTEL_EXPORTER_OTLP_HEADERS").as_deref().unwrap_or_default())?
        } else {
            self.headers.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
        };
        let sample_ratio = match (self.sample_ratio, env("OTEL_TRACES_SAMPLER_ARG")) {
            (Some(ratio), _) => ratio,
            (None, Some(text)) => text.trim().parse().map_err(|_| {
                ConfigError::invalid(
                    "OTEL_TRACES_SAMPLER_ARG",
                    format!("\"{text}\" is not a number between 0 and 1"),
                )
            })?,
            (None, None) => 0.0,
        };
        if !(0.0..=1.0).contains(&sample_ratio) {
            return Err(ConfigError::invalid("tracing.sample_ratio", "must be between 0 and 1"));
        }
        if self.queue_size == 0 || self.export_timeout_ms == 0 {
            return Err(ConfigError::invalid(
                "tracing.queue_size",
                "tracing.queue_size and tracing.export_timeout_ms must be > 0",
            ));
        }
        let service_name = self.service_name.clone().or_else(|| env("OTEL_SERVICE_NAME"));
        Ok(Some(TracingSettings {
            endpoint,
            headers,
            ca_file: self.ca_file.clone(),
            service_name: service_name.unwrap_or_else(|| DEFAULT_TRACING_SERVICE_NAME.to_string()),
            sample_ratio,
            queue_size: self.queue_size,
            export_timeout_ms: self.export_timeout_ms,
        }))
    }
}

/// `OTEL_EXPORTER_OTLP_HEADERS`: `key=value` pairs separated by commas, values percent-encoded.
fn env_headers(text: &str) -> Result<Vec<(String, Secret)>, ConfigError> {
    let mut headers = Vec::new();
    for pair in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let Some((key, value)) = pair.split_once('=') else {
            let message = "each entry must be key=value (the value is not shown here)";
            return Err(ConfigError::invalid("OTEL_EXPORTER_OTLP_HEADERS", message));
        };
        let value: String =
            form_urlencoded::parse(format!("v={}", value.trim().replace('+', "%2B")).as_bytes())
                .map(|(_, v)| v.into_owned())
                .next()
                .unwrap_or_default();
        headers.push((key.trim().to_string(), Secret::new(value)));
    }
    Ok(headers)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |name| vars.iter().find(|(n, _)| *n == name).map(|(_, v)| v.to_string())
    }

    #[test]
    fn tracing_is_off_by_default_and_when_the_sdk_is_disabled() {
        assert_eq!(TracingConfig::default().resolve(env(&[])).unwrap(), None);
        let on = TracingConfig { enabled: true, ..TracingConfig::default() };
        assert_eq!(on.resolve(env(&[("OTEL_SDK_DISABLED", "true")])).unwrap(), None);
        let named = TracingConfig::default().resolve(env(&[("OTEL_TRACES_EXPORTER", "otlp")])).unwrap();
        assert_eq!(named.unwrap().endpoint, DEFAULT_TRACING_ENDPOINT);
    }

    #[test]
    fn the_file_wins_and_the_standard_variables_fill_in_what_it_leaves_out() {
        let vars = [
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318/"),
            ("OTEL_EXPORTER_OTLP_HEADERS", "api-key=a%3Db, x-tenant = ops"),
            ("OTEL_SERVICE_NAME", "relay-billing"),
            ("OTEL_TRACES_SAMPLER_ARG", "0.25"),
        ];
        let on = TracingConfig { enabled: true, ..TracingConfig::default() };
        let settings = on.resolve(env(&vars)).unwrap().unwrap();
        assert_eq!(settings.endpoint, "http://collector:4318/v1/traces");
        assert_eq!(settings.headers[0].0, "api-key");
        assert_eq!(settings.headers[0].1.expose(), "a=b");
        assert_eq!(settings.headers[1].1.expose(), "ops");
        assert_eq!((settings.service_name.as_str(), settings.sample_ratio), ("relay-billing", 0.25));
        let file = TracingConfig {
            endpoint: Some("https://traces.example:4318/v1/traces".into()),
            sample_ratio: Some(0.5),
            ..on
        };
        let settings = file.resolve(env(&vars)).unwrap().unwrap();
        assert_eq!(settings.endpoint, "https://traces.example:4318/v1/traces");
        assert_eq!(settings.sample_ratio, 0.5);
    }

    #[test]
    fn a_bad_tracing_setting_names_itself() {
        let on = TracingConfig { enabled: true, ..TracingConfig::default() };
        let bad_url = TracingConfig { endpoint: Some("collector:4318".into()), ..on.clone() };
        assert!(bad_url.resolve(env(&[])).unwrap_err().to_string().contains("tracing.endpoint"));
        let bad_ratio = TracingConfig { sample_ratio: Some(2.0), ..on.clone() };
        assert!(bad_ratio.resolve(env(&[])).unwrap_err().to_string().contains("tracing.sample_ratio"));
        let bad_env = on.resolve(env(&[("OTEL_TRACES_SAMPLER_ARG", "often")])).unwrap_err();
        assert!(bad_env.to_string().contains("OTEL_TRACES_SAMPLER_ARG"));
        let secret = on.resolve(env(&[("OTEL_EXPORTER_OTLP_HEADERS", "token")])).unwrap_err();
        assert!(!secret.to_string().contains("token"), "{secret}");
    }
}
