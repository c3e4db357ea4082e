//! The row-to-record mapping of one outbox ([`Mapping`]): the topic from the template (or the
//! row's own, where allowed), the key, the headers and the formatted value, or why the row is
//! unpublishable ([`PoisonReason`]). The module doc of `record` states its invariants.

use std::sync::Arc;
use std::time::SystemTime;

use super::encode;
use super::format::{self, Fields, Format, Formatted};
use super::registry::Registry;
use super::topics::AllowedTopics;
use super::transform::{Columns, Shaped, Transforms};
use super::{KafkaRecord, OutboxRow, PoisonReason, Unpublishable, excerpt};
use crate::config::{OutboxConfig, OutboxId};
use crate::error::RelayError;

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
    /// `outbox.row_topics`: a row's own topic may differ from the template's.
    row_topics: bool,
    allowed_topics: AllowedTopics,
    /// The outbox's place among the relay's: what its records and refusals say they came from.
    outbox: OutboxId,
    pub(super) format: Format,
    /// `[outbox.registry]`: values encoded against the schema registry (or why it cannot be
    /// set up: every record then stops the relay with it).
    registry: Option<Result<Arc<Registry>, String>>,
    /// `[outbox.transforms]`: filter, route, headers, redactions.
    transforms: Transforms,
}

/// Why `check` did not give a record's parts: the row's fault (unpublishable, or filtered), or
/// the relay's (an unreadable HMAC key).
enum Checking {
    Refused(PoisonReason),
    Failed(RelayError),
}

impl From<PoisonReason> for Checking {
    fn from(reason: PoisonReason) -> Checking {
        Checking::Refused(reason)
    }
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

/// The schema registry's encoding of the value replaces the `payload`; the row's own payload is
/// kept as `formatted`'s (made with the raw format's headers, from the `row`'s id, event type and
/// aggregate type, when the format built none).
fn put_encoded(
    encoded: Vec<u8>,
    payload: &mut Vec<u8>,
    formatted: &mut Option<Box<Formatted>>,
    (id, event_type, aggregate_type): (&String, &String, &String),
) {
    let row_payload = String::from_utf8(std::mem::replace(payload, encoded)).expect("a payload is text");
    let f = formatted.get_or_insert_with(|| {
        let headers = vec![
            ("id", id.clone()),
            ("event_type", event_type.clone()),
            ("aggregate_type", aggregate_type.clone()),
        ];
        let written_type = event_type.clone();
        Box::new(Formatted {
            headers,
            written_type,
            aggregate_id: None,
            payload: None,
            data_is_payload: false,
        })
    });
    f.payload = Some(row_payload);
}

impl Mapping {
    /// The mapping of a relay's only (or first) outbox.
    pub fn new(outbox: &OutboxConfig) -> Self {
        Mapping::of(outbox, OutboxId::default(), "outbox")
    }

    /// The mapping of the relay's outbox `id`, whose settings are at `path` (`outbox`,
    /// `outboxes[2]`: what its transforms' reasons name).
    pub fn of(outbox: &OutboxConfig, id: OutboxId, path: &str) -> Self {
        Mapping {
            topic_template: parse_template(&outbox.topic_template),
            columns: outbox.columns.clone(),
            row_topics: outbox.row_topics,
            allowed_topics: AllowedTopics::new(&outbox.allowed_topics),
            outbox: id,
            format: Format::of(outbox),
            registry: outbox.registry.as_ref().map(|r| Registry::new(r).map(Arc::new)),
            transforms: Transforms::of(outbox, path),
        }
    }

    /// Turns a row into a record, or says which column or transform rule is wrong (handing the
    /// row back; [`PoisonReason::Filtered`] when the outbox's transforms leave it out, which the
    /// sources settle unsent). The outer error is the schema registry's: unavailable (retried)
    /// or refusing (fatal), or an unreadable HMAC key (fatal); the row is neither published nor
    /// dead-lettered.
    pub fn to_record(
        &self,
        raw: OutboxRow,
        created_at: Option<SystemTime>,
    ) -> Result<Result<KafkaRecord, Box<Unpublishable>>, RelayError> {
        let (topic, row_headers, built, redacted) = match self.check(&raw, created_at) {
            Ok(checked) => checked,
            Err(Checking::Refused(reason)) => {
                return Ok(Err(Box::new(Unpublishable { reason, row: raw, outbox: self.outbox })));
            }
            Err(Checking::Failed(e)) => return Err(e),
        };
        let value = redacted.as_deref().or(raw.payload.as_deref()).unwrap_or_default();
        let encoded = match encode::encode(self.registry.as_ref(), &topic, value)? {
            Ok(encoded) => encoded,
            Err(reason) => {
                return Ok(Err(Box::new(Unpublishable { reason, row: raw, outbox: self.outbox })));
            }
        };
        // `check` proved every required column present
        let (Some(id), Some(aggregate_type), Some(key), Some(event_type), Some(payload)) =
            (raw.id, raw.aggregate_type, raw.aggregate_id, raw.event_type, raw.payload)
        else {
            unreachable!("checked above")
        };
        let payload = redacted.unwrap_or(payload);
        let (key, mut payload, mut formatted) = match built {
            None => (key, payload.into_bytes(), None),
            Some(b) => (
                b.key.unwrap_or(key),
                b.value.unwrap_or_else(|| payload.into_bytes()),
                Some(Box::new(b.formatted)),
            ),
        };
        if let Some(encoded) = encoded {
            let row = (&id, &event_type, &aggregate_type);
            put_encoded(encoded, &mut payload, &mut formatted, row);
        }
        Ok(Ok(KafkaRecord {
            id,
            topic,
            key,
            payload,
            event_type,
            aggregate_type,
            row_headers,
            row_columns: raw.columns,
            created_at,
            position: None,
            outbox: self.outbox,
            formatted,
            as_written: None,
            trace: None,
        }))
    }

    /// Everything that can make a row unpublishable (or filter it out), without taking it
    /// apart: the topic, the row's own headers and the rules', what the format built and the
    /// redacted payload, when it is fine.
    fn check(&self, raw: &OutboxRow, created_at: Option<SystemTime>) -> Result<Checked, Checking> {
        if let Some(column) = &raw.unreadable {
            return Err(PoisonReason::NotUtf8 { column: column.clone() }.into());
        }
        let c = &self.columns;
        let id = required(&raw.id, &c.id)?;
        let aggregate_type = required(&raw.aggregate_type, &c.aggregate_type)?;
        let aggregate_id = required(&raw.aggregate_id, &c.aggregate_id)?;
        let event_type = required(&raw.event_type, &c.event_type)?;
        let payload = required(&raw.payload, &c.payload)?;
        if let Some(filtered) = self.transforms.filtered(event_type, aggregate_type) {
            return Err(filtered.into());
        }
        let mut headers = match &raw.headers {
            Some(text) => string_headers(text, &c.headers, &self.format)?,
            None => Vec::new(),
        };
        let topic = raw.topic.as_deref();
        let columns =
            Columns { id, aggregate_type, aggregate_id, event_type, topic, payload, others: &raw.columns };
        let shaped = self.transforms.shape(&columns, &headers).map_err(Checking::Failed)??;
        let Shaped { topic: routed, headers: added, envelope, payload: redacted } = shaped;
        let topic = self.allowed_topic(aggregate_type, event_type, raw.topic.as_deref(), routed)?;
        headers.extend(added);
        let payload = redacted.as_deref().unwrap_or(payload);
        let fields =
            Fields { id, aggregate_type, aggregate_id, event_type, payload, created_at, envelope: &envelope };
        Ok((topic, headers, self.format.build(&fields)?, redacted))
    }

    /// The topic of an event, if it may go there: the template's (or the `routed` one), or with
    /// `row_topics` its own; either one must be in `allowed_topics` when that is set.
    fn allowed_topic(
        &self,
        aggregate_type: &str,
        event_type: &str,
        own: Option<&str>,
        routed: Option<String>,
    ) -> Result<String, PoisonReason> {
        let by_route = routed.is_some();
        let rendered = || routed.clone().unwrap_or_else(|| self.render_topic(aggregate_type, event_type));
        let (topic, from_row) = match own.filter(|t| !t.is_empty()) {
            None => (rendered(), false),
            Some(own) if self.row_topics => (own.to_string(), true),
            Some(own) => {
                let rendered = rendered();
                if own != rendered {
                    let column = self.topic_column().to_string();
                    return Err(PoisonReason::RowTopicOff { column, topic: excerpt(own) });
                }
                (rendered, false)
            }
        };
        validate_topic(&topic)?;
        if (from_row || !self.allowed_topics.is_empty()) && !self.allowed_topics.permits(&topic) {
            let from = if from_row {
                format!("from column {}", self.topic_column())
            } else if by_route {
                "routed by the payload field of transforms.route_by_field".to_string()
            } else {
                "rendered by outbox.topic_template".to_string()
            };
            return Err(PoisonReason::TopicNotAllowed { topic: excerpt(&topic), from });
        }
        Ok(topic)
    }

    /// The topic column's name for a reason (`outbox_emit()` messages carry `topic` whatever
    /// the table calls it).
    fn topic_column(&self) -> &str {
        if self.columns.topic.is_empty() { "topic" } else { &self.columns.topic }
    }

    /// The topic a row of these columns names: its own `topic` when set, else the template's.
    /// Whether it may go there is [`Mapping::to_record`]'s decision (`outbox.row_topics`,
    /// `outbox.allowed_topics`).
    pub fn topic_for(&self, aggregate_type: &str, event_type: &str, topic: Option<&str>) -> String {
        match topic.filter(|t| !t.is_empty()) {
            Some(topic) => topic.to_string(),
            None => self.render_topic(aggregate_type, event_type),
        }
    }

    /// Whether a payload field chooses the topic (`transforms.route_by_field`): the topics are
    /// then known only from the payloads.
    pub fn routes_by_payload(&self) -> bool {
        self.transforms.routes()
    }

    /// Whether the outbox's transforms filter out events of these types (never published).
    pub fn filters_out(&self, aggregate_type: &str, event_type: &str) -> bool {
        self.transforms.filtered(event_type, aggregate_type).is_some()
    }

    pub(super) fn render_topic(&self, aggregate_type: &str, event_type: &str) -> String {
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

/// A publishable row's topic, headers (its own, then the rules'), formatted record and
/// redacted payload (when a redaction changed it).
type Checked = (String, Vec<(String, String)>, Option<format::Built>, Option<String>);

fn required<'a>(value: &'a Option<String>, column: &str) -> Result<&'a str, PoisonReason> {
    value.as_deref().ok_or_else(|| PoisonReason::NullColumn { column: column.to_string() })
}

/// The string entries of a JSON object; other value types are not headers and are skipped
/// (they stay in the row, and the payload is untouched). A reserved name, of any value type, is
/// refused.
fn string_headers(text: &str, column: &str, format: &Format) -> Result<Vec<(String, String)>, PoisonReason> {
    let value: serde_json::Value =
        serde_json::from_str(text).map_err(|e| PoisonReason::BadHeaders { detail: e.to_string() })?;
    match value {
        serde_json::Value::Object(map) => {
            if let Some(name) = map.keys().find(|name| is_reserved_header(name) || format.reserves(name)) {
                let column = if column.is_empty() { "headers" } else { column };
                return Err(PoisonReason::ReservedHeader { name: excerpt(name), column: column.to_string() });
            }
            Ok(map
                .into_iter()
                .filter_map(|(k, v)| match v {
                    serde_json::Value::String(s) => Some((k, s)),
                    _ => None,
                })
                .collect())
        }
        serde_json::Value::Null => Ok(Vec::new()),
        other => Err(PoisonReason::BadHeaders { detail: format!("got {}", json_kind(&other)) }),
    }
}

/// One of the relay's header names ([`super::RESERVED_HEADERS`], `outbox_relay_*`), in any
/// case: a consumer may look headers up without regard to case.
fn is_reserved_header(name: &str) -> bool {
    crate::config::is_reserved_header(name)
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
pub(super) fn validate_topic(topic: &str) -> Result<(), PoisonReason> {
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
        Some(detail) => Err(PoisonReason::BadTopic { topic: excerpt(topic), detail }),
        None => Ok(()),
    }
}
