//! How an outbox row becomes a Kafka record. One mapping for both source modes.
//!
//! Both sources hand over the row's columns as PostgreSQL text output ([`OutboxRow`]): polling
//! selects them `::text`, pgoutput sends them in text format. So the two modes produce
//! byte-identical records for the same row.
//!
//! The record: topic from the template, key = aggregate id, value = the payload as stored,
//! headers `id`, `event_type`, `aggregate_type` and every string entry of the row's `headers`
//! JSON object.
//!
//! Invariants (row data must not choose where an event goes, nor speak for the relay):
//! - a row's own topic is used only with `outbox.row_topics = true`; otherwise a row naming any
//!   topic but the template's is unpublishable (naming the same one is how a dead letter's
//!   `row_data` comes back, and chooses nothing);
//! - with `outbox.allowed_topics` set, every topic must match it; with it empty, only the
//!   template's topic is published;
//! - a row header named like one of the relay's ([`RESERVED_HEADERS`], `outbox_relay_*`, in any
//!   case) makes the row unpublishable: a consumer reading the first `id` must get the relay's.

use std::borrow::Cow;
use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::time::SystemTime;

use crate::config::OutboxConfig;
use crate::error::RelayError;
use crate::lsn::Lsn;
use registry::Registry;

mod encode;
pub mod format;
pub mod registry;
mod topics;
use format::{Fields, Format, Formatted};
use topics::AllowedTopics;

/// Header names the relay writes itself; a row's `headers` may not use them (nor any name
/// starting with [`RESERVED_HEADER_PREFIX`]), in any case.
pub const RESERVED_HEADERS: [&str; 3] = ["id", "event_type", "aggregate_type"];
/// The prefix of the relay's own headers (`outbox_relay_source`, `outbox_relay_position`).
pub const RESERVED_HEADER_PREFIX: &str = "outbox_relay_";

/// An outbox row as text, before validation.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OutboxRow {
    pub id: Option<String>,
    pub aggregate_type: Option<String>,
    pub aggregate_id: Option<String>,
    pub event_type: Option<String>,
    pub payload: Option<String>,
    pub headers: Option<String>,
    pub topic: Option<String>,
    /// A column whose text could not be read as UTF-8 (e.g. in a SQL_ASCII database); its
    /// value above holds the text with the bad bytes replaced.
    pub unreadable: Option<String>,
}

impl OutboxRow {
    /// The bytes of its text, as the claim budget counts them.
    pub fn size(&self) -> usize {
        [
            &self.id,
            &self.aggregate_type,
            &self.aggregate_id,
            &self.event_type,
            &self.payload,
            &self.headers,
            &self.topic,
        ]
        .iter()
        .map(|f| f.as_ref().map_or(0, String::len))
        .sum()
    }

    /// The dead-letter table's `row_data` for this row.
    pub fn row_data(&self) -> RowData<'_> {
        RowData {
            id: self.id.as_deref(),
            aggregate_type: self.aggregate_type.as_deref(),
            aggregate_id: self.aggregate_id.as_deref(),
            event_type: self.event_type.as_deref(),
            payload: self.payload.as_deref().map(Cow::Borrowed),
            headers: self.headers.as_deref().map(Cow::Borrowed),
            topic: self.topic.as_deref(),
        }
    }

    /// A row from a JSON object of the [`RowData`] shape (the default column names, text values):
    /// how `outbox_emit()` messages carry an event, and what `row_data` reads back as.
    pub fn from_json(object: &serde_json::Map<String, serde_json::Value>) -> OutboxRow {
        let text = |key: &str| object.get(key).and_then(|v| v.as_str()).map(String::from);
        OutboxRow {
            id: text("id"),
            aggregate_type: text("aggregate_type"),
            aggregate_id: text("aggregate_id"),
            event_type: text("event_type"),
            payload: text("payload"),
            headers: text("headers"),
            topic: text("topic"),
            unreadable: None,
        }
    }
}

/// A row as the dead-letter table's `row_data` holds it: the event columns as text, keyed by the
/// default column names (the configured names are not known there). Borrowed, so a large payload
/// is not copied on its way to JSON.
#[derive(Debug, serde::Serialize)]
pub struct RowData<'a> {
    id: Option<&'a str>,
    aggregate_type: Option<&'a str>,
    aggregate_id: Option<&'a str>,
    event_type: Option<&'a str>,
    payload: Option<Cow<'a, str>>,
    headers: Option<Cow<'a, str>>,
    topic: Option<&'a str>,
}

/// A record ready for the sink.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KafkaRecord {
    pub id: String,
    pub topic: String,
    pub key: String,
    pub payload: Vec<u8>,
    pub event_type: String,
    pub aggregate_type: String,
    /// The string entries of the row's `headers` object; the record's headers are these after
    /// the built-in ones ([`KafkaRecord::headers`]).
    pub row_headers: Vec<(String, String)>,
    /// When the event was written (commit time in replication mode, `created_at` in polling
    /// mode), for end-to-end latency; `None` when the table has no such column.
    pub created_at: Option<SystemTime>,
    /// Where the source read it: the `outbox_relay_position` header, and what the relay matches
    /// replayed events by (see `readback`).
    pub position: Option<Position>,
    /// Which of the relay's outboxes (`RelayConfig::outboxes`, by place) it came from: its
    /// `outbox_relay_source` header, its dead-letter table and policy.
    pub outbox: usize,
    /// The record's leading headers when its outbox's format is not `raw` (then `key` and
    /// `payload` are the record's key and value as the format wrote them).
    pub formatted: Option<Box<Formatted>>,
}

/// Where an event was read, as the `outbox_relay_position` header carries it. Deterministic for
/// a replay: the same event read again gets the same position (streamed) or the same id (copy,
/// polling), which is what lets a restarted relay recognise what it already wrote.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Position {
    /// Streamed from the slot: the transaction's commit LSN and the event's place among the
    /// transaction's outbox events (0-based). `lsn:16/B374D848:3`
    Stream { commit: Lsn, index: u32 },
    /// The first copy of a slot created at `point`: the row's place in the copy.
    /// `copy:16/B3000000:41`
    Copy { point: Lsn, index: u64 },
    /// Polling: a claim batch (a random per-session number and the batch's sequence in the
    /// session) and the row's place in it. `batch:9f2c4e1a0b7d3c55-12:7`
    Batch { session: u64, batch: u64, index: u32 },
}

impl fmt::Display for Position {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Position::Stream { commit, index } => write!(f, "lsn:{commit}:{index}"),
            Position::Copy { point, index } => write!(f, "copy:{point}:{index}"),
            Position::Batch { session, batch, index } => write!(f, "batch:{session:016x}-{batch}:{index}"),
        }
    }
}

impl FromStr for Position {
    type Err = String;

    fn from_str(s: &str) -> Result<Position, String> {
        let bad = || format!("\"{s}\" is not an outbox_relay_position");
        let (kind, rest) = s.split_once(':').ok_or_else(bad)?;
        let (at, index) = rest.rsplit_once(':').ok_or_else(bad)?;
        match kind {
            "lsn" => Ok(Position::Stream { commit: at.parse()?, index: index.parse().map_err(|_| bad())? }),
            "copy" => Ok(Position::Copy { point: at.parse()?, index: index.parse().map_err(|_| bad())? }),
            "batch" => {
                let (session, batch) = at.split_once('-').ok_or_else(bad)?;
                Ok(Position::Batch {
                    session: u64::from_str_radix(session, 16).map_err(|_| bad())?,
                    batch: batch.parse().map_err(|_| bad())?,
                    index: index.parse().map_err(|_| bad())?,
                })
            }
            _ => Err(bad()),
        }
    }
}

impl KafkaRecord {
    /// The bytes this record holds (payload, key, topic, headers), for in-flight byte budgets.
    pub fn size(&self) -> usize {
        let headers: usize = self.headers().map(|(k, v)| k.len() + v.len()).sum();
        let kept = self.formatted.as_ref().and_then(|f| f.payload.as_ref()).map_or(0, String::len);
        self.payload.len() + self.key.len() + self.topic.len() + self.id.len() + headers + kept
    }

    /// The record's headers in order: the format's (`raw`: `id`, `event_type`,
    /// `aggregate_type`), then the row's own.
    pub fn headers(&self) -> impl Iterator<Item = (&str, &str)> {
        // (no allocation: the sink asks for them once per record)
        let raw = self.formatted.is_none().then(|| {
            [
                ("id", self.id.as_str()),
                ("event_type", &self.event_type),
                ("aggregate_type", &self.aggregate_type),
            ]
        });
        let formatted = self.formatted.iter().flat_map(|f| f.headers.iter().map(|(k, v)| (*k, v.as_str())));
        let built_in = raw.into_iter().flatten().chain(formatted);
        built_in.chain(self.row_headers.iter().map(|(k, v)| (k.as_str(), v.as_str())))
    }

    /// The event type as the record carries it (what the read-back compares): `raw`'s
    /// `event_type` header, CloudEvents' `type`, nothing in Debezium's records.
    pub fn written_type(&self) -> &str {
        self.formatted.as_ref().map_or(&self.event_type, |f| &f.written_type)
    }

    /// The payload as the record carries it (what the read-back compares): the value, or a
    /// structured CloudEvent's `data`, which is the row's payload.
    pub fn written_payload(&self) -> &[u8] {
        match &self.formatted {
            // (trimmed: the document's `data`, read back, has no surrounding whitespace)
            Some(f) if f.data_is_payload => {
                f.payload.as_ref().map_or(&self.payload[..], |p| p.trim().as_bytes())
            }
            _ => &self.payload,
        }
    }

    /// The `row_data` of the row this record was made from, as far as the record tells (for the
    /// dead-letter table when Kafka refuses it): the resolved topic, the key as aggregate id,
    /// and the row's own headers as a JSON object.
    pub fn row_data(&self) -> RowData<'_> {
        let own: serde_json::Map<String, serde_json::Value> =
            self.row_headers.iter().map(|(k, v)| (k.clone(), serde_json::Value::String(v.clone()))).collect();
        let formatted = self.formatted.as_deref();
        let payload = match formatted.and_then(|f| f.payload.as_deref()) {
            Some(payload) => Cow::Borrowed(payload),
            None => String::from_utf8_lossy(&self.payload),
        };
        RowData {
            id: Some(&self.id),
            aggregate_type: Some(&self.aggregate_type),
            aggregate_id: Some(formatted.and_then(|f| f.aggregate_id.as_deref()).unwrap_or(&self.key)),
            event_type: Some(&self.event_type),
            payload: Some(payload),
            headers: (!own.is_empty()).then(|| Cow::Owned(serde_json::Value::Object(own).to_string())),
            topic: Some(&self.topic),
        }
    }
}

/// A row that cannot become a record, with the row, so it can be dead-lettered as it was.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unpublishable {
    pub reason: PoisonReason,
    pub row: OutboxRow,
    /// The outbox it came from (see [`KafkaRecord::outbox`]).
    pub outbox: usize,
}

/// Row data quoted in a reason: escaped (a control character stays visible and harmless in a
/// log line) and cut at 64 characters (a reason is logged and stored, whatever the row holds).
fn excerpt(text: &str) -> String {
    const CHARS: usize = 64;
    let cut: String = text.chars().take(CHARS).collect();
    let more = if text.chars().nth(CHARS).is_some() { "..." } else { "" };
    format!("{cut:?}{more}")
}

/// Why a row cannot become a record. The row is dead-lettered or blocks, never dropped.
/// (Row data it quotes is an [`excerpt`].)
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PoisonReason {
    #[error("column {column} is NULL")]
    NullColumn { column: String },
    #[error("headers column is not a JSON object: {detail}")]
    BadHeaders { detail: String },
    #[error("topic {topic} is not a valid Kafka topic name ({detail})")]
    BadTopic { topic: String, detail: &'static str },
    #[error("column {column} is not valid UTF-8 text")]
    NotUtf8 { column: String },
    #[error(
        "topic {topic} from column {column} is refused: outbox.row_topics = false (rows may not \
         choose their topic); set outbox.row_topics = true and list the topic in \
         outbox.allowed_topics, or leave the column NULL"
    )]
    RowTopicOff { column: String, topic: String },
    #[error(
        "topic {topic} ({from}) is not in outbox.allowed_topics; add it, or a prefix of it \
         ending in *, to outbox.allowed_topics"
    )]
    TopicNotAllowed { topic: String, from: String },
    #[error(
        "header {name} in column {column} is reserved for the relay (id, event_type, \
         aggregate_type, outbox_relay_*, and with outbox.format = \"cloudevents\" ce_* and content-type); \
         rename it in the row's headers"
    )]
    ReservedHeader { name: String, column: String },
    #[error(
        "the CloudEvents attribute {attribute} would be empty (from {columns}); CloudEvents requires it: fill \
         the column, or change outbox.cloudevents.{attribute}"
    )]
    EmptyAttribute { attribute: String, columns: String },
    #[error(
        "the payload is not JSON, and a structured CloudEvent embeds it as {attribute}; store JSON, or set \
         outbox.cloudevents.mode = \"binary\""
    )]
    NotJson { attribute: String },
    #[error("{detail}; fix the payload (or the schema), then replay the dead letter")]
    SchemaMismatch { detail: String },
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
    /// `outbox.row_topics`: a row's own topic may differ from the template's.
    row_topics: bool,
    allowed_topics: AllowedTopics,
    /// The outbox's place among the relay's: what its records and refusals say they came from.
    outbox: usize,
    format: Format,
    /// `[outbox.registry]`: values encoded against the schema registry (or why it cannot be
    /// set up: every record then stops the relay with it).
    registry: Option<Result<Arc<Registry>, String>>,
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
    /// The mapping of a relay's only (or first) outbox.
    pub fn new(outbox: &OutboxConfig) -> Self {
        Mapping::of(outbox, 0)
    }

    /// The mapping of the relay's outbox at place `index`.
    pub fn of(outbox: &OutboxConfig, index: usize) -> Self {
        Mapping {
            topic_template: parse_template(&outbox.topic_template),
            columns: outbox.columns.clone(),
            row_topics: outbox.row_topics,
            allowed_topics: AllowedTopics::new(&outbox.allowed_topics),
            outbox: index,
            format: Format::of(outbox),
            registry: outbox.registry.as_ref().map(|r| Registry::new(r).map(Arc::new)),
        }
    }

    /// Turns a row into a record, or says which column is wrong (handing the row back). The
    /// outer error is the schema registry's: unavailable (retried) or refusing (fatal); the row
    /// is neither published nor dead-lettered.
    pub fn to_record(
        &self,
        raw: OutboxRow,
        created_at: Option<SystemTime>,
    ) -> Result<Result<KafkaRecord, Box<Unpublishable>>, RelayError> {
        let (topic, row_headers, built) = match self.check(&raw, created_at) {
            Ok(checked) => checked,
            Err(reason) => return Ok(Err(Box::new(Unpublishable { reason, row: raw, outbox: self.outbox }))),
        };
        let encoded =
            match encode::encode(self.registry.as_ref(), &topic, raw.payload.as_deref().unwrap_or_default())?
            {
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
        let (key, mut payload, mut formatted) = match built {
            None => (key, payload.into_bytes(), None),
            Some(b) => (
                b.key.unwrap_or(key),
                b.value.unwrap_or_else(|| payload.into_bytes()),
                Some(Box::new(b.formatted)),
            ),
        };
        if let Some(encoded) = encoded {
            let row_payload =
                String::from_utf8(std::mem::replace(&mut payload, encoded)).expect("a payload is text");
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
        Ok(Ok(KafkaRecord {
            id,
            topic,
            key,
            payload,
            event_type,
            aggregate_type,
            row_headers,
            created_at,
            position: None,
            outbox: self.outbox,
            formatted,
        }))
    }

    /// Everything that can make a row unpublishable, without taking it apart: the topic, the
    /// row's own headers and what the format built, when it is fine.
    fn check(&self, raw: &OutboxRow, created_at: Option<SystemTime>) -> Result<Checked, PoisonReason> {
        if let Some(column) = &raw.unreadable {
            return Err(PoisonReason::NotUtf8 { column: column.clone() });
        }
        let c = &self.columns;
        let id = required(&raw.id, &c.id)?;
        let aggregate_type = required(&raw.aggregate_type, &c.aggregate_type)?;
        let aggregate_id = required(&raw.aggregate_id, &c.aggregate_id)?;
        let event_type = required(&raw.event_type, &c.event_type)?;
        let payload = required(&raw.payload, &c.payload)?;
        let topic = self.allowed_topic(aggregate_type, event_type, raw.topic.as_deref())?;
        let headers = match &raw.headers {
            Some(text) => string_headers(text, &c.headers, &self.format)?,
            None => Vec::new(),
        };
        let fields = Fields { id, aggregate_type, aggregate_id, event_type, payload, created_at };
        Ok((topic, headers, self.format.build(&fields)?))
    }

    /// The topic of an event, if it may go there: the template's, or with `row_topics` its own;
    /// either one must be in `allowed_topics` when that is set.
    fn allowed_topic(
        &self,
        aggregate_type: &str,
        event_type: &str,
        own: Option<&str>,
    ) -> Result<String, PoisonReason> {
        let (topic, from_row) = match own.filter(|t| !t.is_empty()) {
            None => (self.render_topic(aggregate_type, event_type), false),
            Some(own) if self.row_topics => (own.to_string(), true),
            Some(own) => {
                let rendered = self.render_topic(aggregate_type, event_type);
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

/// A publishable row's topic, own headers and formatted record.
type Checked = (String, Vec<(String, String)>, Option<format::Built>);

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

/// One of the relay's header names ([`RESERVED_HEADERS`], `outbox_relay_*`), in any case: a
/// consumer may look headers up without regard to case.
fn is_reserved_header(name: &str) -> bool {
    let prefix = RESERVED_HEADER_PREFIX.len();
    RESERVED_HEADERS.iter().any(|reserved| reserved.eq_ignore_ascii_case(name))
        || name.get(..prefix).is_some_and(|start| start.eq_ignore_ascii_case(RESERVED_HEADER_PREFIX))
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
        Some(detail) => Err(PoisonReason::BadTopic { topic: excerpt(topic), detail }),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests;
