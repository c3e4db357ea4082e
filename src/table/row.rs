//! A claimed or copied row as the relay reads it: where it lies, and its columns as the
//! mapping's input.

use std::time::SystemTime;

use tokio_postgres::Row;

use super::col;
use crate::config::HEADER_COLUMN_ALIAS;
use crate::record::OutboxRow;

/// Where a claimed row lies: its partition (`tableoid`) and the ctid of its version, with its id
/// for messages. The claim's row lock keeps that version in place until the claim ends, so
/// releasing by it touches that one row, even when another row carries the same id (which only
/// the table's owner can write: sql/009_outbox_event_ids.sql).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RowAt {
    pub id: String,
    pub tableoid: u32,
    pub ctid: String,
}

impl RowAt {
    /// The location columns of a [`OutboxTable::claim_sql`] row.
    pub fn of(row: &Row, id: Option<&str>) -> Result<RowAt, tokio_postgres::Error> {
        Ok(RowAt {
            id: id.unwrap_or_default().to_string(),
            tableoid: row.try_get(col::TABLEOID)?,
            ctid: row.try_get(col::CTID)?,
        })
    }

    /// `rows` as the parameters of [`OutboxTable::release_sql`] and [`OutboxTable::delete_sql`].
    pub fn params<'r>(rows: impl IntoIterator<Item = &'r RowAt>) -> (Vec<u32>, Vec<&'r str>) {
        rows.into_iter().map(|r| (r.tableoid, r.ctid.as_str())).unzip()
    }
}

/// A row of [`OutboxTable::claim_sql`] or [`OutboxTable::copy_sql`] as the mapping's input,
/// with its `created_at`. Text that is not UTF-8 (a SQL_ASCII database) never panics: the value
/// is kept with the bad bytes replaced, the column is marked unreadable, and the mapping makes
/// the row unpublishable. A column the query did not return as text is the relay's own bug, an
/// error: it is never mistaken for a NULL in the row.
pub fn outbox_row(row: &Row) -> Result<(OutboxRow, Option<SystemTime>), tokio_postgres::Error> {
    let mut unreadable = None;
    let mut columns = Vec::new();
    for column in row.columns() {
        if let Some(name) = column.name().strip_prefix(HEADER_COLUMN_ALIAS) {
            let value: Option<TextBytes<'_>> = row.try_get(column.name())?;
            let value = value.map(|b| match std::str::from_utf8(b.0) {
                Ok(text) => text.to_string(),
                Err(_) => {
                    unreadable.get_or_insert_with(|| name.to_string());
                    String::from_utf8_lossy(b.0).into_owned()
                }
            });
            columns.push((name.to_string(), value));
        }
    }
    let mut text = |column: &'static str| -> Result<Option<String>, tokio_postgres::Error> {
        let bytes: Option<TextBytes<'_>> = row.try_get(column)?;
        Ok(bytes.map(|b| match std::str::from_utf8(b.0) {
            Ok(text) => text.to_string(),
            Err(_) => {
                unreadable.get_or_insert_with(|| column.to_string());
                String::from_utf8_lossy(b.0).into_owned()
            }
        }))
    };
    let raw = OutboxRow {
        id: text(col::ID)?,
        aggregate_type: text(col::AGGREGATE_TYPE)?,
        aggregate_id: text(col::AGGREGATE_ID)?,
        event_type: text(col::EVENT_TYPE)?,
        payload: text(col::PAYLOAD)?,
        headers: text(col::HEADERS)?,
        topic: text(col::TOPIC)?,
        unreadable: None,
        columns,
    };
    let created_at = row.try_get(col::CREATED_AT)?;
    Ok((OutboxRow { unreadable, ..raw }, created_at))
}

/// A text (or `convert_to` bytea) value as its bytes, before any UTF-8 check.
struct TextBytes<'a>(&'a [u8]);

impl<'a> tokio_postgres::types::FromSql<'a> for TextBytes<'a> {
    fn from_sql(
        _: &tokio_postgres::types::Type,
        raw: &'a [u8],
    ) -> Result<Self, Box<dyn std::error::Error + Sync + Send>> {
        Ok(TextBytes(raw))
    }

    fn accepts(ty: &tokio_postgres::types::Type) -> bool {
        *ty == tokio_postgres::types::Type::BYTEA || <&str as tokio_postgres::types::FromSql>::accepts(ty)
    }
}
