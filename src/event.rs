//! How an outbox row becomes a Kafka record. One mapping for both source modes.
//!
//! Both sources hand over the row's columns as PostgreSQL text output ([`RawEvent`]): polling
//! selects them `::text`, pgoutput sends them in text format. So the two modes produce
//! byte-identical records for the same row.
//!
//! The record: topic from the template (a non-NULL per-row topic wins), key = aggregate id,
//! value = the payload as stored, headers `id`, `event_type`, `aggregate_type` and every string
//! entry of the row's `headers` JSON object.

use std::time::SystemTime;

use crate::config::OutboxConfig;

/// An outbox row as text, before validation.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RawEvent {
    pub id: Option<String>,
    pub aggregate_type: Option<String>,
    pub aggregate_id: Option<String>,
    pub event_type: Option<String>,
    pub payload: Option<String>,
    pub headers: Option<String>,
    pub topic: Option<String>,
}

impl RawEvent {
    /// The row as JSON, for the dead-letter table's `row_data` (column names as configured
    /// are not known here, so the fields are named as in the default layout).
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "id": self.id,
            "aggregate_type": self.aggregate_type,
            "aggregate_id": self.aggregate_id,
            "event_type": self.event_type,
            "payload": self.payload,
            "headers": self.headers,
            "topic": self.topic,
        })
    }
}

/// A record ready for the sink.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxEvent {
    pub id: String,
    pub topic: String,
    pub key: String,
    pub payload: Vec<u8>,
    pub headers: Vec<(String, String)>,
    /// When the event was written (commit time in replication mode, `created_at` in polling
    /// mode), for end-to-end latency; `None` when the table has no such column.
    pub created_at: Option<SystemTime>,
}

impl OutboxEvent {
    /// The record as JSON, for the dead-letter table's `row_data`.
    pub fn to_json(&self) -> serde_json::Value {
        let headers: serde_json::Map<String, serde_json::Value> =
            self.headers.iter().map(|(k, v)| (k.clone(), serde_json::Value::String(v.clone()))).collect();
        serde_json::json!({
            "id": self.id,
            "topic": self.topic,
            "aggregate_id": self.key,
            "payload": String::from_utf8_lossy(&self.payload),
            "headers": headers,
        })
    }
}

/// Why a row cannot become a record. The row is dead-lettered or blocks, never dropped.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PoisonReason {
    #[error("column {column} is NULL")]
    NullColumn { column: String },
    #[error("headers column is not a JSON object: {detail}")]
    BadHeaders { detail: String },
    #[error("topic \"{topic}\" is not a valid Kafka topic name ({detail})")]
    BadTopic { topic: String, detail: &'static str },
    #[error("broker refused the record permanently: {detail}")]
    Refused { detail: String },
}

/// A piece of the topic template, parsed once (the hot path only concatenates).
#[derive(Debug, Clone)]
enum TopicPart {
    Text(String),
    AggregateType,
    EventType,
}

/// The row-to-record mapping built from `[outbox]`.
#[derive(Debug, Clone)]
pub struct Mapping {
    topic_template: Vec<TopicPart>,
    columns: crate::config::ColumnsConfig,
}

/// Splits a (validated) template into text and placeholders.
fn parse_template(template: &str) -> Vec<TopicPart> {
    let mut parts = Vec::new();
    let mut rest = template;
    while let Some(open) = rest.find('{') {
        let close = rest[open..].find('}').map_or(rest.len(), |c| open + c);
        if open > 0 {
            parts.push(TopicPart::Text(rest[..open].to_string()));
        }
        parts.push(match &rest[open + 1..close.min(rest.len())] {
            "aggregate_type" => TopicPart::AggregateType,
            "event_type" => TopicPart::EventType,
            other => TopicPart::Text(format!("{{{other}}}")),
        });
        rest = &rest[(close + 1).min(rest.len())..];
    }
    if !rest.is_empty() {
        parts.push(TopicPart::Text(rest.to_string()));
    }
    parts
}

impl Mapping {
    pub fn new(outbox: &OutboxConfig) -> Self {
        Mapping { topic_template: parse_template(&outbox.topic_template), columns: outbox.columns.clone() }
    }

    /// Turns a row into a record, or says which column is wrong.
    pub fn to_event(
        &self,
        raw: RawEvent,
        created_at: Option<SystemTime>,
    ) -> Result<OutboxEvent, PoisonReason> {
        let c = &self.columns;
        let id = required(raw.id, &c.id)?;
        let aggregate_type = required(raw.aggregate_type, &c.aggregate_type)?;
        let key = required(raw.aggregate_id, &c.aggregate_id)?;
        let event_type = required(raw.event_type, &c.event_type)?;
        let payload = required(raw.payload, &c.payload)?.into_bytes();
        let topic = match raw.topic.filter(|t| !t.is_empty()) {
            Some(topic) => topic,
            None => self.render_topic(&aggregate_type, &event_type),
        };
        validate_topic(&topic)?;
        let mut headers = vec![
            ("id".to_string(), id.clone()),
            ("event_type".to_string(), event_type),
            ("aggregate_type".to_string(), aggregate_type),
        ];
        if let Some(text) = raw.headers {
            headers.extend(string_headers(&text)?);
        }
        Ok(OutboxEvent { id, topic, key, payload, headers, created_at })
    }

    fn render_topic(&self, aggregate_type: &str, event_type: &str) -> String {
        let mut topic = String::with_capacity(64);
        for part in &self.topic_template {
            topic.push_str(match part {
                TopicPart::Text(text) => text,
                TopicPart::AggregateType => aggregate_type,
                TopicPart::EventType => event_type,
            });
        }
        topic
    }
}

fn required(value: Option<String>, column: &str) -> Result<String, PoisonReason> {
    value.ok_or_else(|| PoisonReason::NullColumn { column: column.to_string() })
}

/// The string entries of a JSON object; other value types are not headers and are skipped
/// (they stay in the row, and the payload is untouched).
fn string_headers(text: &str) -> Result<Vec<(String, String)>, PoisonReason> {
    let value: serde_json::Value =
        serde_json::from_str(text).map_err(|e| PoisonReason::BadHeaders { detail: e.to_string() })?;
    match value {
        serde_json::Value::Object(map) => Ok(map
            .into_iter()
            .filter_map(|(k, v)| match v {
                serde_json::Value::String(s) => Some((k, s)),
                _ => None,
            })
            .collect()),
        serde_json::Value::Null => Ok(Vec::new()),
        other => Err(PoisonReason::BadHeaders { detail: format!("got {}", json_kind(&other)) }),
    }
}

fn json_kind(value: &serde_json::Value) -> &'static str {
    match value {
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::Bool(_) => "a boolean",
        _ => "something else",
    }
}

/// Kafka's topic rule: 1-249 characters of `[a-zA-Z0-9._-]`, not `.` or `..`.
fn validate_topic(topic: &str) -> Result<(), PoisonReason> {
    let detail = if topic.is_empty() {
        Some("empty")
    } else if topic.len() > 249 {
        Some("longer than 249 characters")
    } else if topic == "." || topic == ".." {
        Some("reserved name")
    } else if !topic.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')) {
        Some("only a-z, A-Z, 0-9, '.', '_' and '-' are allowed")
    } else {
        None
    };
    match detail {
        Some(detail) => Err(PoisonReason::BadTopic { topic: topic.to_string(), detail }),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw() -> RawEvent {
        RawEvent {
            id: Some("7".into()),
            aggregate_type: Some("order".into()),
            aggregate_id: Some("42".into()),
            event_type: Some("OrderPlaced".into()),
            payload: Some("{\"a\": 1}".into()),
            headers: Some("{\"traceparent\": \"00-abc-01\", \"n\": 3}".into()),
            topic: None,
        }
    }

    fn mapping() -> Mapping {
        Mapping::new(&OutboxConfig::default())
    }

    #[test]
    fn row_becomes_record() {
        let event = mapping().to_event(raw(), None).unwrap();
        assert_eq!(event.topic, "outbox.event.order");
        assert_eq!(event.key, "42");
        assert_eq!(event.payload, b"{\"a\": 1}");
        let names: Vec<&str> = event.headers.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(names, ["id", "event_type", "aggregate_type", "traceparent"]);
        assert_eq!(event.headers[3].1, "00-abc-01");
    }

    #[test]
    fn row_topic_overrides_template() {
        let event = mapping().to_event(RawEvent { topic: Some("billing".into()), ..raw() }, None).unwrap();
        assert_eq!(event.topic, "billing");
    }

    #[test]
    fn template_parts_render_in_order() {
        let outbox =
            OutboxConfig { topic_template: "x.{event_type}-{aggregate_type}.y".into(), ..Default::default() };
        assert_eq!(Mapping::new(&outbox).render_topic("order", "Placed"), "x.Placed-order.y");
        let outbox = OutboxConfig { topic_template: "plain".into(), ..Default::default() };
        assert_eq!(Mapping::new(&outbox).render_topic("order", "Placed"), "plain");
    }

    #[test]
    fn template_uses_event_type() {
        let outbox =
            OutboxConfig { topic_template: "{aggregate_type}.{event_type}".into(), ..Default::default() };
        let event = Mapping::new(&outbox).to_event(raw(), None).unwrap();
        assert_eq!(event.topic, "order.OrderPlaced");
    }

    #[test]
    fn null_aggregate_id_is_poison_naming_the_column() {
        let err = mapping().to_event(RawEvent { aggregate_id: None, ..raw() }, None).unwrap_err();
        assert_eq!(err.to_string(), "column aggregate_id is NULL");
    }

    #[test]
    fn bad_headers_and_topics_are_poison() {
        let err = mapping().to_event(RawEvent { headers: Some("[1]".into()), ..raw() }, None).unwrap_err();
        assert!(matches!(err, PoisonReason::BadHeaders { .. }), "{err}");
        let err = mapping().to_event(RawEvent { topic: Some("a b".into()), ..raw() }, None).unwrap_err();
        assert!(matches!(err, PoisonReason::BadTopic { .. }), "{err}");
        let err =
            mapping().to_event(RawEvent { aggregate_type: Some("ü".into()), ..raw() }, None).unwrap_err();
        assert!(matches!(err, PoisonReason::BadTopic { .. }), "{err}");
    }
}
