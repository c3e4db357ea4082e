//! The outboxes a relay reads: `[outbox]` or `[[outboxes]]`, their columns, and the typed id
//! that names one of them everywhere below (records, dead letters, metrics, per-outbox state).
//!
//! Invariants:
//! - an [`OutboxId`] is only made here, by [`RelayConfig::outboxes`], so it always names an entry
//!   of this relay's list; per-outbox state lives in a [`PerOutbox`], indexed by it, never by a
//!   bare number.

use std::ops::{Index, IndexMut};

use serde::{Deserialize, Serialize};

use super::{
    CloudEventsConfig, DEFAULT_OUTBOX_SCHEMA, DEFAULT_OUTBOX_TABLE, DEFAULT_TOPIC_TEMPLATE, DeadLetterConfig,
    DebeziumConfig, RecordFormat, RelayConfig, TransformsConfig, kafka, registry,
};

/// Which of the relay's outboxes: its place in [`RelayConfig::outboxes`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct OutboxId(usize);

impl OutboxId {
    /// The place in the list, for messages and logs (`0` for the one `[outbox]`).
    pub fn index(self) -> usize {
        self.0
    }
}

/// One `T` for each of the relay's outboxes, indexed by [`OutboxId`].
#[derive(Debug, Clone, PartialEq)]
pub struct PerOutbox<T>(Vec<T>);

impl<T> PerOutbox<T> {
    /// `make(id)` for every outbox in `outboxes`, in order.
    pub fn of<O>(outboxes: &[O], mut make: impl FnMut(OutboxId, &O) -> T) -> PerOutbox<T> {
        PerOutbox(outboxes.iter().enumerate().map(|(i, o)| make(OutboxId(i), o)).collect())
    }

    pub fn iter(&self) -> impl Iterator<Item = (OutboxId, &T)> {
        self.0.iter().enumerate().map(|(i, t)| (OutboxId(i), t))
    }

    pub fn values(&self) -> std::slice::Iter<'_, T> {
        self.0.iter()
    }

    pub fn iter_mut(&mut self) -> impl Iterator<Item = (OutboxId, &mut T)> {
        self.0.iter_mut().enumerate().map(|(i, t)| (OutboxId(i), t))
    }

    pub fn values_mut(&mut self) -> std::slice::IterMut<'_, T> {
        self.0.iter_mut()
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// Collected in the outboxes' order: the first item is the first outbox's.
impl<T> FromIterator<T> for PerOutbox<T> {
    fn from_iter<I: IntoIterator<Item = T>>(items: I) -> PerOutbox<T> {
        PerOutbox(items.into_iter().collect())
    }
}

impl<T> Index<OutboxId> for PerOutbox<T> {
    type Output = T;

    fn index(&self, id: OutboxId) -> &T {
        &self.0[id.0]
    }
}

impl<T> IndexMut<OutboxId> for PerOutbox<T> {
    fn index_mut(&mut self, id: OutboxId) -> &mut T {
        &mut self.0[id.0]
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OutboxConfig {
    /// What metrics, logs and errors call the outbox; empty (default): the table's name.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub name: String,
    pub schema: String,
    pub table: String,
    /// Topic for each event; `{aggregate_type}` and `{event_type}` are replaced from the row.
    pub topic_template: String,
    /// Whether a row's own topic (`columns.topic`, when set and not empty) chooses its topic
    /// instead of the template. Off (default): a row naming any other topic than the template's
    /// is unpublishable (`dead_letter.on_poison`). On: needs `allowed_topics`.
    pub row_topics: bool,
    /// The topics events may go to: exact names, or prefixes ending in `*` (`"billing.*"`).
    /// Empty (default): whatever the template renders. Set: every topic, the template's too,
    /// must match one, or the event is unpublishable.
    #[serde(deserialize_with = "kafka::string_or_list")]
    pub allowed_topics: Vec<String>,
    pub columns: ColumnsConfig,
    /// This outbox's dead-letter policy and table; unset (default): `[dead_letter]`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dead_letter: Option<DeadLetterConfig>,
    /// The records' shape: `raw` (default), `cloudevents` or `debezium`.
    pub format: RecordFormat,
    /// The attribute mapping of `format = "cloudevents"`.
    pub cloudevents: CloudEventsConfig,
    /// The converters of `format = "debezium"`.
    pub debezium: DebeziumConfig,
    /// Values encoded against a schema registry (Avro, JSON Schema, Protobuf in the Confluent
    /// wire format); unset (default): the payload as stored.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub registry: Option<registry::RegistryConfig>,
    /// `[outbox.transforms]`: filters, routing, headers and redactions (docs/transforms.md);
    /// empty (default): every event as its row says.
    #[serde(skip_serializing_if = "TransformsConfig::is_empty")]
    pub transforms: TransformsConfig,
}

impl OutboxConfig {
    /// `schema.table`, as messages and the `outbox` deployment label name the table.
    pub fn display_name(&self) -> String {
        format!("{}.{}", self.schema, self.table)
    }
}

impl Default for OutboxConfig {
    fn default() -> Self {
        OutboxConfig {
            name: String::new(),
            schema: DEFAULT_OUTBOX_SCHEMA.into(),
            table: DEFAULT_OUTBOX_TABLE.into(),
            topic_template: DEFAULT_TOPIC_TEMPLATE.into(),
            row_topics: false,
            allowed_topics: Vec::new(),
            columns: ColumnsConfig::default(),
            dead_letter: None,
            format: RecordFormat::Raw,
            cloudevents: CloudEventsConfig::default(),
            debezium: DebeziumConfig::default(),
            registry: None,
            transforms: TransformsConfig::default(),
        }
    }
}

/// One outbox as the relay reads it: `[outbox]` with `[dead_letter]`, or an `[[outboxes]]`
/// entry with its own `dead_letter` or the shared one ([`RelayConfig::outboxes`]).
#[derive(Debug, Clone, PartialEq)]
pub struct OutboxEntry {
    /// Its place in the list.
    pub id: OutboxId,
    /// Unique among the relay's outboxes: the `outbox` label of its metrics.
    pub name: String,
    /// Where its settings are, for errors: `outbox` or `outboxes[2]`.
    pub path: String,
    pub config: OutboxConfig,
    pub dead_letter: DeadLetterConfig,
}

/// Column names of the outbox table. Optional columns are switched off with an empty string,
/// which is how a Debezium-style table (`id, aggregatetype, aggregateid, type, payload`) is read.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ColumnsConfig {
    pub id: String,
    pub aggregate_type: String,
    pub aggregate_id: String,
    pub event_type: String,
    pub payload: String,
    pub headers: String,
    pub topic: String,
    pub created_at: String,
}

impl Default for ColumnsConfig {
    fn default() -> Self {
        ColumnsConfig {
            id: "id".into(),
            aggregate_type: "aggregate_type".into(),
            aggregate_id: "aggregate_id".into(),
            event_type: "event_type".into(),
            payload: "payload".into(),
            headers: "headers".into(),
            topic: "topic".into(),
            created_at: "created_at".into(),
        }
    }
}

impl ColumnsConfig {
    /// Required columns, as (config key, column name).
    pub fn required(&self) -> [(&'static str, &str); 5] {
        [
            ("id", &self.id),
            ("aggregate_type", &self.aggregate_type),
            ("aggregate_id", &self.aggregate_id),
            ("event_type", &self.event_type),
            ("payload", &self.payload),
        ]
    }

    /// Optional columns that are switched on, as (config key, column name).
    pub fn optional(&self) -> Vec<(&'static str, &str)> {
        [("headers", &self.headers), ("topic", &self.topic), ("created_at", &self.created_at)]
            .into_iter()
            .filter(|(_, name)| !name.is_empty())
            .map(|(key, name)| (key, name.as_str()))
            .collect()
    }
}

impl RelayConfig {
    /// The outboxes this relay reads, in configured order: the `[[outboxes]]` entries, or the
    /// one `[outbox]`. Each has its name and its dead-letter settings resolved.
    pub fn outboxes(&self) -> Vec<OutboxEntry> {
        let listed: Vec<(String, &OutboxConfig)> = if self.outboxes.is_empty() {
            vec![("outbox".to_string(), &self.outbox)]
        } else {
            self.outboxes.iter().enumerate().map(|(i, o)| (format!("outboxes[{i}]"), o)).collect()
        };
        listed
            .into_iter()
            .enumerate()
            .map(|(i, (path, o))| OutboxEntry {
                id: OutboxId(i),
                name: if o.name.is_empty() { o.table.clone() } else { o.name.clone() },
                path,
                config: o.clone(),
                dead_letter: o.dead_letter.clone().unwrap_or_else(|| self.dead_letter.clone()),
            })
            .collect()
    }
}
