//! `outbox.format`: the shape of the records an outbox publishes (`record::format`
//! builds them). `raw` is the relay's own and the default; `cloudevents` is the CloudEvents 1.0
//! Kafka protocol binding; `debezium` is what Debezium's outbox event router writes.

use serde::{Deserialize, Serialize};

use super::ConfigError;

/// Placeholders a CloudEvents attribute template may use: the row's columns.
pub const ATTRIBUTE_PLACEHOLDERS: &[&str] = &["id", "aggregate_type", "aggregate_id", "event_type"];
pub const DEFAULT_CLOUDEVENTS_TYPE: &str = "{event_type}";
pub const DEFAULT_CLOUDEVENTS_SUBJECT: &str = "{aggregate_id}";
pub const DEFAULT_CLOUDEVENTS_DATA_CONTENT_TYPE: &str = "application/json";

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum RecordFormat {
    /// Key = aggregate id, value = the payload as stored, headers `id`, `event_type`,
    /// `aggregate_type` and the row's own.
    #[default]
    Raw,
    /// CloudEvents 1.0 over Kafka (`[outbox.cloudevents]`).
    Cloudevents,
    /// Debezium's outbox event router's records (`[outbox.debezium]`).
    Debezium,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum CloudEventsMode {
    /// The attributes as `ce_*` headers and `content-type`, the payload as the value.
    #[default]
    Binary,
    /// One JSON document (`application/cloudevents+json`) holding the attributes and the payload
    /// as `data`.
    Structured,
}

/// How events map onto CloudEvents attributes. `id` is always the event's id column, `specversion`
/// is `1.0`, and `time` (when on) is the event's time: the commit time in replication mode, the
/// `created_at` column in polling mode and in a slot's first copy.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CloudEventsConfig {
    /// `binary` (default): attributes as `ce_*` headers; `structured`: one JSON document.
    pub mode: CloudEventsMode,
    /// The `source` attribute (required): a URI-reference naming where events come from, e.g.
    /// `/orders-service` or `urn:shop:orders`; placeholders allowed.
    pub source: String,
    /// The `type` attribute (required, not empty); default `{event_type}`.
    #[serde(rename = "type")]
    pub event_type: String,
    /// The `subject` attribute; default `{aggregate_id}`; empty: no subject.
    pub subject: String,
    /// Whether to set the `time` attribute (when the event's time is known).
    pub time: bool,
    /// The `datacontenttype` attribute (in binary mode the `content-type` header). Structured mode
    /// embeds the payload as JSON, so there it must be `application/json` or end in `+json`.
    pub data_content_type: String,
}

impl Default for CloudEventsConfig {
    fn default() -> Self {
        CloudEventsConfig {
            mode: CloudEventsMode::Binary,
            source: String::new(),
            event_type: DEFAULT_CLOUDEVENTS_TYPE.into(),
            subject: DEFAULT_CLOUDEVENTS_SUBJECT.into(),
            time: true,
            data_content_type: DEFAULT_CLOUDEVENTS_DATA_CONTENT_TYPE.into(),
        }
    }
}

/// Which Kafka Connect converter Debezium's records went through.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Converter {
    /// `JsonConverter` with `schemas.enable = true`: Kafka Connect's default; the value is a
    /// `{"schema": ..., "payload": ...}` envelope.
    #[default]
    JsonWithSchemas,
    /// `JsonConverter` with `schemas.enable = false`.
    Json,
    /// `StringConverter`: the text as it is.
    String,
}

/// The Debezium outbox event router configuration the records must match: its default routing
/// (`outbox.topic_template` stays the topic's setting), the `id` header, the aggregate id as key.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct DebeziumConfig {
    /// Kafka Connect's `key.converter`.
    pub key_converter: Converter,
    /// Kafka Connect's `value.converter`.
    pub value_converter: Converter,
    /// The router's `table.expand.json.payload`: a JSON payload becomes a JSON document instead of
    /// a string (with `value_converter = "json"` only).
    pub expand_json_payload: bool,
}

impl CloudEventsConfig {
    pub(super) fn validate(&self, path: &str) -> Result<(), ConfigError> {
        let path = format!("{path}.cloudevents");
        for (key, template, required) in [
            ("source", &self.source, true),
            ("type", &self.event_type, true),
            ("subject", &self.subject, false),
        ] {
            if required && template.is_empty() {
                let hint = if key == "source" {
                    " (a URI-reference naming the producer, e.g. \"/orders-service\")"
                } else {
                    ""
                };
                return Err(ConfigError::invalid(
                    format!("{path}.{key}"),
                    format!("must not be empty{hint}"),
                ));
            }
            validate_template(&format!("{path}.{key}"), template)?;
        }
        if self.source.chars().any(char::is_whitespace) {
            return Err(ConfigError::invalid(
                format!("{path}.source"),
                "is not a URI-reference: it holds whitespace",
            ));
        }
        let json = self.data_content_type == "application/json" || self.data_content_type.ends_with("+json");
        if self.mode == CloudEventsMode::Structured && !json {
            return Err(ConfigError::invalid(
                format!("{path}.data_content_type"),
                format!(
                    "\"{}\" is not JSON, and structured mode embeds the payload as JSON data; use \
                     \"application/json\", or mode = \"binary\"",
                    self.data_content_type
                ),
            ));
        }
        if self.data_content_type.is_empty() || self.data_content_type.chars().any(|c| c.is_control()) {
            return Err(ConfigError::invalid(
                format!("{path}.data_content_type"),
                "must be a media type, e.g. \"application/json\"",
            ));
        }
        Ok(())
    }
}

impl DebeziumConfig {
    pub(super) fn validate(&self, path: &str) -> Result<(), ConfigError> {
        if self.expand_json_payload && self.value_converter != Converter::Json {
            return Err(ConfigError::invalid(
                format!("{path}.debezium.expand_json_payload"),
                "needs value_converter = \"json\" (the router expands the payload for JsonConverter without \
                 schemas; records expanded under a schema are not reproduced)",
            ));
        }
        Ok(())
    }
}

/// A template's placeholders are among [`ATTRIBUTE_PLACEHOLDERS`], each brace closed.
fn validate_template(path: &str, template: &str) -> Result<(), ConfigError> {
    let mut rest = template;
    while let Some(open) = rest.find('{') {
        let Some(close) = rest[open..].find('}') else {
            return Err(ConfigError::invalid(path, "has a '{' without a closing '}'"));
        };
        let name = &rest[open + 1..open + close];
        if !ATTRIBUTE_PLACEHOLDERS.contains(&name) {
            return Err(ConfigError::invalid(
                path,
                format!(
                    "unknown placeholder {{{name}}}; use {{id}}, {{aggregate_type}}, {{aggregate_id}} or {{event_type}}"
                ),
            ));
        }
        rest = &rest[open + close + 1..];
    }
    Ok(())
}

impl super::RelayConfig {
    /// Warnings about the formats as configured: Debezium's producer (Java's) partitions by
    /// murmur2, librdkafka's default by CRC32, so without `partitioner = "murmur2_random"` an
    /// aggregate's events after a cutover can land on another partition than before it.
    pub fn format_warnings(&self) -> Vec<String> {
        let debezium = self.outboxes().iter().any(|o| o.config.format == RecordFormat::Debezium);
        let murmur2 = self.kafka.properties.get("partitioner").is_some_and(|p| p.0.starts_with("murmur2"));
        if debezium && !murmur2 {
            vec![
                "outbox.format = \"debezium\": Debezium's producer puts a key on the partition murmur2 picks, librdkafka's \
                 default does not; set [kafka.properties] partitioner = \"murmur2_random\" so each aggregate stays on the \
                 partition its earlier events are on"
                    .into(),
            ]
        } else {
            Vec::new()
        }
    }
}
