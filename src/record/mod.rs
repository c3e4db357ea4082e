//! How an outbox row becomes a Kafka record. One mapping for both source modes.
//!
//! Both sources hand over the row's columns as PostgreSQL text output ([`OutboxRow`]): polling
//! selects them `::text`, pgoutput sends them in text format. So the two modes produce
//! byte-identical records for the same row.
//!
//! The record: topic from the template, key = aggregate id, value = the payload as stored,
//! headers `id`, `event_type`, `aggregate_type` and every string entry of the row's `headers`
//! JSON object. The outbox's transforms (`transform`, `[outbox.transforms]`) may filter the row
//! out, route it by a payload field, add headers after the row's own and redact the payload
//! before the format and the registry see it.
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
use std::time::SystemTime;

use crate::config::OutboxId;
use crate::lsn::Lsn;

mod encode;
pub mod format;
mod mapping;
pub mod registry;
mod topics;
mod transform;
use format::Formatted;
pub use mapping::Mapping;
#[cfg(test)]
use mapping::validate_topic;

/// Header names the relay writes itself (defined with the header rules that may not use them).
pub use crate::config::{RESERVED_HEADER_PREFIX, RESERVED_HEADERS};

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
    /// The other columns the outbox's header rules read (`column:<name>`), by name; a name
    /// missing here is a column the event did not come with (an `outbox_emit()` message).
    pub columns: Vec<(String, Option<String>)>,
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
            columns: self.columns.iter().map(|(name, value)| (name.as_str(), value.as_deref())).collect(),
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
            columns: object
                .get("columns")
                .and_then(|c| c.as_object())
                .into_iter()
                .flatten()
                .map(|(name, value)| (name.clone(), value.as_str().map(String::from)))
                .collect(),
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
    /// The other columns header rules read (absent when none: the shape dead letters always had).
    #[serde(skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    columns: std::collections::BTreeMap<&'a str, Option<&'a str>>,
}

impl RowData<'_> {
    /// The fields in their one order (`id`, `aggregate_type`, `aggregate_id`, `event_type`,
    /// `payload`, `headers`, `topic`), then each other column a header rule reads as its name
    /// and its value, by name: what a dead letter's digest covers (a letter without other
    /// columns has the digest it always had).
    pub fn fields(&self) -> Vec<Option<&str>> {
        let mut fields = vec![
            self.id,
            self.aggregate_type,
            self.aggregate_id,
            self.event_type,
            self.payload.as_deref(),
            self.headers.as_deref(),
            self.topic,
        ];
        for (name, value) in &self.columns {
            fields.extend([Some(*name), *value]);
        }
        fields
    }
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
    /// The other columns of its row the header rules read (for the dead letter, should Kafka
    /// refuse it).
    pub row_columns: Vec<(String, Option<String>)>,
    /// When the event was written (commit time in replication mode, `created_at` in polling
    /// mode), for end-to-end latency; `None` when the table has no such column.
    pub created_at: Option<SystemTime>,
    /// Where the source read it: the `outbox_relay_position` header, and what the relay matches
    /// replayed events by (see `readback`).
    pub position: Option<Position>,
    /// Which of the relay's outboxes it came from: its `outbox_relay_source` header, its
    /// dead-letter table and policy.
    pub outbox: OutboxId,
    /// The record's leading headers when its outbox's format is not `raw` (then `key` and
    /// `payload` are the record's key and value as the format wrote them).
    pub formatted: Option<Box<Formatted>>,
    /// Sent again as Kafka first held it (`republish`): see [`AsWritten`].
    pub as_written: Option<Box<AsWritten>>,
    /// The publish span begun when the record was first sent, while `[tracing]` samples it:
    /// its `traceparent` header names that span ([`crate::observe::trace`]).
    pub trace: Option<Box<crate::observe::trace::Begun>>,
}

/// A record sent again as Kafka first held it (`republish`): to the partition it lies in, with
/// exactly its headers (the sink adds none of its own: the original carries them already).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AsWritten {
    pub partition: i32,
    pub headers: Vec<(String, Option<Vec<u8>>)>,
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
            columns: self.row_columns.iter().map(|(name, value)| (name.as_str(), value.as_deref())).collect(),
        }
    }
}

/// A row that cannot become a record, with the row, so it can be dead-lettered as it was.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unpublishable {
    pub reason: PoisonReason,
    pub row: OutboxRow,
    /// The outbox it came from (see [`KafkaRecord::outbox`]).
    pub outbox: OutboxId,
}

impl Unpublishable {
    /// The rule that filtered the event out, when a filter did (it is then not unpublishable:
    /// see [`PoisonReason::Filtered`]).
    pub fn filtered_by(&self) -> Option<&str> {
        match &self.reason {
            PoisonReason::Filtered { rule, .. } => Some(rule),
            _ => None,
        }
    }
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
    #[error(
        "outbox {outbox}: {rule} cannot apply at {path}: {detail}; fix the payload (or the rule), then replay \
         the dead letter"
    )]
    Transform { outbox: String, rule: String, path: String, detail: String },
    /// Not unpublishable: the outbox's transforms leave the event out. The sources settle it
    /// unsent (released, confirmed, counted `filtered`); only a path that does not know of
    /// filters would dead-letter it.
    #[error("outbox {outbox}: filtered by {rule}")]
    Filtered { outbox: String, rule: String },
    #[error(
        "{detail} (the row's topic names the subject); register the subject's schema, or fix the \
         row's topic, then replay the dead letter"
    )]
    NoSchema { detail: String },
}

#[cfg(test)]
mod tests;
