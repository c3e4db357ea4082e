//! The configured outbox table: quoted identifiers and the SQL built from them.
//!
//! Every identifier that comes from configuration reaches SQL only through [`quote_ident`], so a
//! column called `type` (Debezium's layout) or a mixed-case table name works as configured.

use crate::config::OutboxConfig;

/// Quotes a PostgreSQL identifier: `order` becomes `"order"`, `a"b` becomes `"a""b"`.
pub fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// Quotes a string literal for the rare statements that cannot take parameters.
pub fn quote_literal(value: &str) -> String {
    format!("'{}'", value.replace('\'', "''"))
}

/// The outbox table as the relay addresses it.
#[derive(Debug, Clone)]
pub struct OutboxTable {
    pub schema: String,
    pub name: String,
}

impl OutboxTable {
    pub fn new(outbox: &OutboxConfig) -> Self {
        OutboxTable { schema: outbox.schema.clone(), name: outbox.table.clone() }
    }

    /// `"schema"."table"`, ready to splice into SQL.
    pub fn qualified(&self) -> String {
        format!("{}.{}", quote_ident(&self.schema), quote_ident(&self.name))
    }

    /// `schema.table` for messages.
    pub fn display_name(&self) -> String {
        format!("{}.{}", self.schema, self.name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identifiers_are_quoted() {
        assert_eq!(quote_ident("type"), "\"type\"");
        assert_eq!(quote_ident("a\"b"), "\"a\"\"b\"");
        assert_eq!(quote_literal("it's"), "'it''s'");
    }
}

/// `SELECT <the event columns as text> FROM <table> t <tail>`: the rows as both modes read
/// them (polling claims with it; replication copies pre-existing rows with it). Columns:
/// id, aggregate_type, aggregate_id, event_type, payload, headers, topic (text), created_at.
pub fn select_events_sql(outbox: &OutboxConfig, tail: &str) -> String {
    let c = &outbox.columns;
    let optional = |name: &str, ty: &str| {
        if name.is_empty() { format!("NULL::{ty}") } else { format!("t.{}::{ty}", quote_ident(name)) }
    };
    format!(
        "SELECT t.{}::text, t.{}::text, t.{}::text, t.{}::text, t.{}::text, {}, {}, {} FROM {} t {tail}",
        quote_ident(&c.id),
        quote_ident(&c.aggregate_type),
        quote_ident(&c.aggregate_id),
        quote_ident(&c.event_type),
        quote_ident(&c.payload),
        optional(&c.headers, "text"),
        optional(&c.topic, "text"),
        optional(&c.created_at, "timestamptz"),
        OutboxTable::new(outbox).qualified(),
    )
}

/// A row of [`select_events_sql`] as the mapping's input, with its `created_at`.
pub fn raw_event(row: &tokio_postgres::Row) -> (crate::event::RawEvent, Option<std::time::SystemTime>) {
    let raw = crate::event::RawEvent {
        id: row.get(0),
        aggregate_type: row.get(1),
        aggregate_id: row.get(2),
        event_type: row.get(3),
        payload: row.get(4),
        headers: row.get(5),
        topic: row.get(6),
    };
    (raw, row.get(7))
}
