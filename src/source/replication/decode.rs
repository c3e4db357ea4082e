//! pgoutput decoding of what the relay needs: `Relation` and `Insert` for the outbox tables, and
//! the outbox's logical decoding messages.
//!
//! Message formats: PostgreSQL docs, "Logical Replication Message Formats" (protocol version 1).
//! Begin, Commit and Message framing are decoded by the transport; this module sees the raw
//! XLogData payload of everything else. Column values arrive in text format (the relay does not
//! ask for `binary`), which is what the polling source reads too, so both modes build
//! byte-identical records.

use std::collections::HashMap;

use crate::config::{ColumnsConfig, OutboxConfig, OutboxId, PerOutbox};
use crate::observe::metrics::SkippedKind;
use crate::record::OutboxRow;

/// A decoding failure: the stream is not what protocol version 1 says it is.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("pgoutput: {0}")]
pub struct DecodeError(String);

/// What one XLogData payload means to the relay.
#[derive(Debug, PartialEq, Eq)]
pub enum Change {
    /// A row was inserted into this outbox.
    Insert(OutboxId, OutboxRow),
    /// A relation description was (re)learnt; nothing to publish.
    Relation,
    /// Deliberately not an event, by kind (the `kind` label of
    /// `outbox_relay_stream_messages_skipped_total`): an update, delete or truncate of the
    /// outbox (an outbox row is an event when it is inserted, and only then), a change of
    /// another table, a type or an origin message.
    Skipped(SkippedKind),
    /// An outbox table (`was`) was renamed or moved to another schema: its inserts would no
    /// longer be recognised, so the relay must stop rather than confirm past them.
    OutboxRenamed { was: String, now: String },
}

/// Where the configured columns sit in an outbox relation's tuple.
#[derive(Debug, Clone, Default)]
struct Layout {
    outbox: OutboxId,
    id: Option<usize>,
    aggregate_type: Option<usize>,
    aggregate_id: Option<usize>,
    event_type: Option<usize>,
    payload: Option<usize>,
    headers: Option<usize>,
    topic: Option<usize>,
    /// The other columns header rules read: each name, and where it is (`None`: not in the table).
    others: Vec<(String, Option<usize>)>,
}

/// One outbox table as the decoder recognises it.
struct Table {
    schema: String,
    name: String,
    columns: ColumnsConfig,
    /// The other columns its header rules read, by name.
    others: Vec<String>,
}

/// Decodes pgoutput for the relay's outbox tables; remembers relation layouts by OID.
pub struct Decoder {
    tables: PerOutbox<Table>,
    relations: HashMap<u32, Layout>,
    /// Where each column's text is in the message being decoded (see [`tuple`]).
    spans: Vec<Option<(usize, usize)>>,
}

impl Decoder {
    /// A decoder of the outbox tables `outboxes` (in the relay's order).
    pub fn new<'o>(outboxes: impl IntoIterator<Item = &'o OutboxConfig>) -> Decoder {
        let table = |o: &OutboxConfig| Table {
            schema: o.schema.clone(),
            name: o.table.clone(),
            columns: o.columns.clone(),
            others: o.transforms.other_columns(&o.columns),
        };
        Decoder {
            tables: outboxes.into_iter().map(table).collect(),
            relations: HashMap::new(),
            spans: Vec::new(),
        }
    }

    pub fn decode(&mut self, data: &[u8]) -> Result<Change, DecodeError> {
        let mut r = Reader { data, pos: 0 };
        match r.u8()? {
            b'R' => self.relation(&mut r),
            b'I' => self.insert(&mut r),
            b'U' => Ok(self.skipped(r.u32()?, SkippedKind::OutboxUpdate)),
            b'D' => Ok(self.skipped(r.u32()?, SkippedKind::OutboxDelete)),
            b'T' => {
                let count = r.u32()?;
                let _options = r.u8()?;
                let mut kind = SkippedKind::OtherTable;
                for _ in 0..count {
                    if self.relations.contains_key(&r.u32()?) {
                        kind = SkippedKind::OutboxTruncate;
                    }
                }
                Ok(Change::Skipped(kind))
            }
            b'Y' => Ok(Change::Skipped(SkippedKind::Type)),
            b'O' => Ok(Change::Skipped(SkippedKind::Origin)),
            // streamed transactions and two-phase commit: the relay never asks for them
            kind @ (b'S' | b'E' | b'c' | b'A' | b'b' | b'P' | b'K' | b'r' | b'p') => {
                Err(DecodeError(format!(
                    "message type {:?} (streaming or two-phase commit), which the relay never asks for",
                    kind as char
                )))
            }
            other => {
                Err(DecodeError(format!("unknown message type {:?} in protocol version 1", other as char)))
            }
        }
    }

    /// What a change over `replication.max_message_bytes` is, from its first bytes `head`.
    pub fn oversized(&mut self, head: &[u8]) -> Oversized {
        let mut r = Reader { data: head, pos: 0 };
        match r.u8() {
            Ok(b'I') => self.oversized_insert(&mut r),
            Ok(b'M') => {
                let transactional = r.u8().is_ok_and(|flags| flags & 1 == 1);
                match r.bytes(8).and_then(|_| r.cstr()) {
                    Ok(prefix) => Oversized::Message { transactional, prefix: prefix.to_string() },
                    Err(_) => Oversized::Other(SkippedKind::ForeignMessage),
                }
            }
            Ok(b'U') => Oversized::Other(
                r.u32()
                    .map_or(SkippedKind::OtherTable, |oid| self.skipped_kind(oid, SkippedKind::OutboxUpdate)),
            ),
            _ => Oversized::Other(SkippedKind::OtherTable),
        }
    }

    /// An insert read in part: the outbox's, with its id when the part holds the id column
    /// whole, or another table's.
    fn oversized_insert(&mut self, r: &mut Reader<'_>) -> Oversized {
        let Ok(oid) = r.u32() else { return Oversized::Other(SkippedKind::OtherTable) };
        let Some(layout) = self.relations.get(&oid) else { return Oversized::Other(SkippedKind::OtherTable) };
        let outbox = layout.outbox;
        let Some(id_column) = layout.id else { return Oversized::OutboxInsert { outbox, id: None } };
        let data = r.data;
        // the tuple as far as the part goes: columns cut off have no span
        let _ = r.u8().and_then(|_| tuple(r, &mut self.spans));
        let id = self
            .spans
            .get(id_column)
            .copied()
            .flatten()
            .map(|(start, len)| String::from_utf8_lossy(&data[start..start + len]).into_owned());
        Oversized::OutboxInsert { outbox, id }
    }

    fn skipped_kind(&self, relation: u32, outbox_kind: SkippedKind) -> SkippedKind {
        if self.relations.contains_key(&relation) { outbox_kind } else { SkippedKind::OtherTable }
    }

    fn skipped(&self, relation: u32, outbox_kind: SkippedKind) -> Change {
        Change::Skipped(if self.relations.contains_key(&relation) {
            outbox_kind
        } else {
            SkippedKind::OtherTable
        })
    }

    fn relation(&mut self, r: &mut Reader<'_>) -> Result<Change, DecodeError> {
        let oid = r.u32()?;
        let namespace = r.cstr()?;
        let name = r.cstr()?;
        let _replica_identity = r.u8()?;
        let count = r.u16()? as usize;
        let mut names = Vec::with_capacity(count);
        for _ in 0..count {
            let _flags = r.u8()?;
            names.push(r.cstr()?.to_string());
            let _type_oid = r.u32()?;
            let _typmod = r.u32()?;
        }
        let Some((outbox, _)) = self.tables.iter().find(|(_, t)| t.schema == namespace && t.name == name)
        else {
            if let Some(layout) = self.relations.get(&oid) {
                let was = &self.tables[layout.outbox];
                return Ok(Change::OutboxRenamed {
                    was: format!("{}.{}", was.schema, was.name),
                    now: format!("{namespace}.{name}"),
                });
            }
            return Ok(Change::Relation);
        };
        let find =
            |column: &str| (!column.is_empty()).then(|| names.iter().position(|n| n == column)).flatten();
        let c = &self.tables[outbox].columns;
        let layout = Layout {
            outbox,
            id: find(&c.id),
            aggregate_type: find(&c.aggregate_type),
            aggregate_id: find(&c.aggregate_id),
            event_type: find(&c.event_type),
            payload: find(&c.payload),
            headers: find(&c.headers),
            topic: find(&c.topic),
            others: self.tables[outbox].others.iter().map(|name| (name.clone(), find(name))).collect(),
        };
        self.relations.insert(oid, layout);
        Ok(Change::Relation)
    }

    fn insert(&mut self, r: &mut Reader<'_>) -> Result<Change, DecodeError> {
        let oid = r.u32()?;
        let Some(layout) = self.relations.get(&oid) else {
            return Ok(Change::Skipped(SkippedKind::OtherTable));
        };
        if r.u8()? != b'N' {
            return Err(DecodeError(format!("insert into relation {oid} without a new tuple")));
        }
        let data = r.data;
        tuple(r, &mut self.spans)?;
        let c = &self.tables[layout.outbox].columns;
        // only the columns the relay reads become strings; text that is not UTF-8 (a SQL_ASCII
        // database) is kept with the bad bytes replaced and named, so the row becomes
        // unpublishable instead of stopping the stream (a column the relay does not read may
        // hold anything)
        let mut unreadable = None;
        let mut text = |index: Option<usize>, column: &str| {
            let (start, len) = (*self.spans.get(index?)?)?;
            let bytes = &data[start..start + len];
            Some(match std::str::from_utf8(bytes) {
                Ok(text) => text.to_owned(),
                Err(_) => {
                    unreadable.get_or_insert_with(|| column.to_string());
                    String::from_utf8_lossy(bytes).into_owned()
                }
            })
        };
        let raw = OutboxRow {
            id: text(layout.id, &c.id),
            aggregate_type: text(layout.aggregate_type, &c.aggregate_type),
            aggregate_id: text(layout.aggregate_id, &c.aggregate_id),
            event_type: text(layout.event_type, &c.event_type),
            payload: text(layout.payload, &c.payload),
            headers: text(layout.headers, &c.headers),
            topic: text(layout.topic, &c.topic),
            unreadable: None,
            columns: layout.others.iter().map(|(name, at)| (name.clone(), text(*at, name))).collect(),
        };
        Ok(Change::Insert(layout.outbox, OutboxRow { unreadable, ..raw }))
    }
}

/// A change over `replication.max_message_bytes`, as far as its first bytes tell.
#[derive(Debug, PartialEq, Eq)]
pub enum Oversized {
    /// An insert into `outbox`, with its id when the bytes read hold it.
    OutboxInsert { outbox: OutboxId, id: Option<String> },
    /// A logical decoding message with this prefix.
    Message { transactional: bool, prefix: String },
    /// Anything else (another table's change, an outbox update): nothing the relay publishes.
    Other(SkippedKind),
}

/// TupleData into `spans`, reused across rows: Int16 column count, then per column 'n' (NULL),
/// 'u' (unchanged TOAST, never in an insert) or 't' + Int32 length + text, whose place in the
/// message is kept (nothing is copied here).
fn tuple(r: &mut Reader<'_>, spans: &mut Vec<Option<(usize, usize)>>) -> Result<(), DecodeError> {
    spans.clear();
    let count = r.u16()? as usize;
    for _ in 0..count {
        spans.push(match r.u8()? {
            b'n' | b'u' => None,
            b't' => {
                let len = r.u32()? as usize;
                let start = r.pos;
                r.bytes(len)?;
                Some((start, len))
            }
            other => return Err(DecodeError(format!("unknown tuple value kind {:?}", other as char))),
        });
    }
    Ok(())
}

/// The outbox event carried by a logical decoding message emitted by `outbox_emit()` (see
/// `sql/005_outbox_emit.sql`): a JSON object whose `payload` is the payload's text, so the
/// record value is byte-identical to the same event written to the table; and its `digest`, when
/// `outbox_emit()` signed it (`sql/012_outbox_emit_signed.sql`, [`MessageKey`]).
pub fn message_event(content: &[u8]) -> Result<(OutboxRow, Option<String>), String> {
    let value: serde_json::Value =
        serde_json::from_slice(content).map_err(|e| format!("message content is not JSON: {e}"))?;
    let object = value.as_object().ok_or("message content is not a JSON object")?;
    let digest = object.get("digest").and_then(|d| d.as_str()).map(String::from);
    Ok((OutboxRow::from_json(object), digest))
}

struct Reader<'a> {
    data: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn bytes(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.data.len());
        let end = end.ok_or_else(|| DecodeError(format!("message truncated at byte {}", self.pos)))?;
        let slice = &self.data[self.pos..end];
        self.pos = end;
        Ok(slice)
    }
    fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.bytes(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, DecodeError> {
        Ok(u16::from_be_bytes(self.bytes(2)?.try_into().unwrap()))
    }
    fn u32(&mut self) -> Result<u32, DecodeError> {
        Ok(u32::from_be_bytes(self.bytes(4)?.try_into().unwrap()))
    }
    fn cstr(&mut self) -> Result<&'a str, DecodeError> {
        let rest = &self.data[self.pos..];
        let nul =
            rest.iter().position(|&b| b == 0).ok_or_else(|| DecodeError("unterminated string".into()))?;
        let s = std::str::from_utf8(&rest[..nul]).map_err(|_| DecodeError("a name is not UTF-8".into()))?;
        self.pos += nul + 1;
        Ok(s)
    }
}

mod signature;
pub use signature::MessageKey;

#[cfg(test)]
pub(super) mod tests;
