//! The configured outbox table: every SQL text about it, and how its rows are read.
//!
//! Invariants:
//! - every identifier that comes from configuration reaches SQL only through [`quote_ident`], so
//!   a column called `type` (Debezium's layout) or a mixed-case table name works as configured;
//! - the rows are read as PostgreSQL text output under fixed aliases ([`col`]), by name, so both
//!   modes see the same [`OutboxRow`](crate::record::OutboxRow) for the same row;
//! - "unpublished" is defined once ([`OutboxTable::unpublished`]): every row in `delete` mode,
//!   rows whose `published_at_column` is NULL in `mark` mode.

use crate::config::{AfterPublish, ColumnsConfig, HEADER_COLUMN_ALIAS, OutboxConfig, PollingConfig};
use crate::error::{FatalReason, RelayError};

mod row;

pub use row::{RowAt, outbox_row};

/// Quotes a PostgreSQL identifier: `order` becomes `"order"`, `a"b` becomes `"a""b"`.
pub fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// Quotes a string literal for the rare statements that cannot take parameters.
pub fn quote_literal(value: &str) -> String {
    format!("'{}'", value.replace('\'', "''"))
}

/// `"schema"."name"`, quoted for SQL.
pub fn qualified_name(schema: &str, name: &str) -> String {
    format!("{}.{}", quote_ident(schema), quote_ident(name))
}

/// The aliases the event columns are read under.
pub mod col {
    pub const ID: &str = "id";
    pub const AGGREGATE_TYPE: &str = "aggregate_type";
    pub const AGGREGATE_ID: &str = "aggregate_id";
    pub const EVENT_TYPE: &str = "event_type";
    pub const PAYLOAD: &str = "payload";
    pub const HEADERS: &str = "headers";
    pub const TOPIC: &str = "topic";
    pub const CREATED_AT: &str = "created_at";
    /// Polling's claim: the row's partition and its version's ctid (see [`super::RowAt`]).
    pub const TABLEOID: &str = "relay_tableoid";
    pub const CTID: &str = "relay_ctid";
    /// `locate`: the row is still unpublished (`mark` mode; always true in `delete` mode).
    pub const UNPUBLISHED: &str = "relay_unpublished";
    /// Polling's claim: the bytes of the row's event columns as text.
    pub const ROW_BYTES: &str = "relay_row_bytes";
}

/// The outbox table as the relay addresses it.
#[derive(Debug, Clone)]
pub struct OutboxTable {
    pub schema: String,
    pub name: String,
    columns: ColumnsConfig,
    /// `mark` mode: the column set when a row is published.
    published_at: Option<String>,
    /// The other columns the outbox's header rules read (`column:<name>`), by name.
    others: Vec<String>,
    /// The database's encoding is SQL_ASCII: text is read as its raw bytes (`convert_to(.., 'SQL_ASCII')`), since
    /// the server refuses to convert bytes that are not UTF-8 for a UTF-8 client.
    raw_text: bool,
}

impl OutboxTable {
    /// `outbox`'s table; `polling` says what publishing does to a row (delete or mark).
    pub fn of(outbox: &OutboxConfig, polling: &PollingConfig) -> Self {
        OutboxTable {
            schema: outbox.schema.clone(),
            name: outbox.table.clone(),
            columns: outbox.columns.clone(),
            published_at: match polling.after_publish {
                AfterPublish::Delete => None,
                AfterPublish::Mark => Some(polling.published_at_column.clone()),
            },
            others: outbox.transforms.other_columns(&outbox.columns),
            raw_text: false,
        }
    }

    /// Adapts the row-reading SQL to the database's `server_encoding`.
    pub fn for_server_encoding(mut self, encoding: &str) -> Self {
        self.raw_text = encoding.eq_ignore_ascii_case("SQL_ASCII");
        self
    }

    /// `SHOW server_encoding`, for [`OutboxTable::for_server_encoding`].
    pub const SERVER_ENCODING_SQL: &'static str = "SELECT current_setting('server_encoding')";

    /// `"schema"."table"`, ready to splice into SQL.
    pub fn qualified(&self) -> String {
        qualified_name(&self.schema, &self.name)
    }

    /// `schema.table` for messages.
    pub fn display_name(&self) -> String {
        format!("{}.{}", self.schema, self.name)
    }

    /// Whether the table exists (as `outbox.schema` / `outbox.table` name it).
    pub async fn exists(&self, client: &tokio_postgres::Client) -> Result<bool, tokio_postgres::Error> {
        Ok(client.query_one("SELECT to_regclass($1) IS NOT NULL", &[&self.qualified()]).await?.get(0))
    }

    /// What to say when the table does not exist: what to create, or which setting names it.
    pub fn missing_text(&self) -> String {
        format!(
            "the outbox table {} does not exist: create it (sql/001_outbox_events.sql and the migrations after it), or \
             set outbox.schema / outbox.table to the table the application writes",
            self.display_name()
        )
    }

    /// The condition on `t` that selects rows still to publish; `TRUE` in `delete` mode.
    pub fn unpublished(&self) -> String {
        match &self.published_at {
            None => "TRUE".into(),
            Some(column) => format!("t.{} IS NULL", quote_ident(column)),
        }
    }

    /// A column's value as the relay reads it: text, or its raw bytes in a SQL_ASCII database.
    fn text(&self, name: &str) -> String {
        match self.raw_text {
            true => format!("convert_to(t.{}::text, 'SQL_ASCII')", quote_ident(name)),
            false => format!("t.{}::text", quote_ident(name)),
        }
    }

    /// The event columns as [`OutboxTable::text`], each with its alias (a column not configured:
    /// NULL).
    fn event_columns(&self) -> [(String, &'static str); 7] {
        let c = &self.columns;
        let optional = |name: &str| match name.is_empty() {
            true => "NULL::text".to_string(),
            false => self.text(name),
        };
        [
            (self.text(&c.id), col::ID),
            (self.text(&c.aggregate_type), col::AGGREGATE_TYPE),
            (self.text(&c.aggregate_id), col::AGGREGATE_ID),
            (self.text(&c.event_type), col::EVENT_TYPE),
            (self.text(&c.payload), col::PAYLOAD),
            (optional(&c.headers), col::HEADERS),
            (optional(&c.topic), col::TOPIC),
        ]
    }

    /// The other columns header rules read, as [`OutboxTable::text`], each aliased
    /// `"relay_column:<name>"` (what [`outbox_row`] reads them back by).
    fn other_columns(&self) -> Vec<(String, String)> {
        self.others
            .iter()
            .map(|name| (self.text(name), quote_ident(&format!("{HEADER_COLUMN_ALIAS}{name}"))))
            .collect()
    }

    /// The other columns header rules read, by name.
    pub fn others(&self) -> &[String] {
        &self.others
    }

    /// `SELECT <the event columns as text, aliased by [`col`]><extra> FROM <table> t <tail>`.
    fn select_events(&self, extra: &str, tail: &str) -> String {
        let c = &self.columns;
        let text = |name: &str| self.text(name);
        let column = |name: &str, alias: &str| format!("{} AS {alias}", text(name));
        let optional = |name: &str, ty: &str, alias: &str| match (name.is_empty(), ty) {
            (true, _) => format!("NULL::{ty} AS {alias}"),
            (false, "text") => format!("{} AS {alias}", text(name)),
            (false, _) => format!("t.{}::{ty} AS {alias}", quote_ident(name)),
        };
        let others: String =
            self.other_columns().iter().map(|(text, alias)| format!(", {text} AS {alias}")).collect();
        format!(
            "SELECT {}, {}, {}, {}, {}, {}, {}, {}{others}{extra} FROM {} t {tail}",
            column(&c.id, col::ID),
            column(&c.aggregate_type, col::AGGREGATE_TYPE),
            column(&c.aggregate_id, col::AGGREGATE_ID),
            column(&c.event_type, col::EVENT_TYPE),
            column(&c.payload, col::PAYLOAD),
            optional(&c.headers, "text", col::HEADERS),
            optional(&c.topic, "text", col::TOPIC),
            optional(&c.created_at, "timestamptz", col::CREATED_AT),
            self.qualified(),
        )
    }

    /// Polling: claim the next `$1` unpublished rows in id order, skipping locked ones, with
    /// where each lies ([`RowAt`]) and the bytes of its event columns as text
    /// ([`col::ROW_BYTES`]). A row over `$2` bytes comes with its id alone (its other columns
    /// NULL): it is not read ([`OutboxTable::copy_to_letters_sql`] moves it). The columns' text
    /// is made once per row (`OFFSET 0` keeps the subquery from being folded into each use).
    /// ORDER BY names the table's column (t.id), not the text output column, which would sort
    /// "10" before "9".
    pub fn claim_sql(&self) -> String {
        let columns: Vec<(String, String)> = self
            .event_columns()
            .into_iter()
            .map(|(text, alias)| (text, alias.to_string()))
            .chain(self.other_columns())
            .collect();
        let values: Vec<String> = columns.iter().map(|(text, alias)| format!("{text} AS {alias}")).collect();
        let bytes: Vec<String> = columns
            .iter()
            .map(|(_, alias)| format!("coalesce(octet_length(v.{alias})::bigint, 0)"))
            .collect();
        let bytes = format!("({})", bytes.join(" + "));
        let fetched: Vec<String> = columns
            .iter()
            .map(|(_, alias)| match alias.as_str() {
                col::ID => format!("v.{alias}"),
                _ => format!("CASE WHEN {bytes} <= $2 THEN v.{alias} END AS {alias}"),
            })
            .collect();
        let created_at = match self.columns.created_at.as_str() {
            "" => format!("NULL::timestamptz AS {}", col::CREATED_AT),
            name => format!("t.{}::timestamptz AS {}", quote_ident(name), col::CREATED_AT),
        };
        format!(
            "SELECT {}, {created_at}, t.tableoid AS {}, t.ctid::text AS {}, {bytes} AS {} \
             FROM {} t CROSS JOIN LATERAL (SELECT {} OFFSET 0) v \
             WHERE {} ORDER BY t.{} LIMIT $1 FOR UPDATE OF t SKIP LOCKED",
            fetched.join(", "),
            col::TABLEOID,
            col::CTID,
            col::ROW_BYTES,
            self.qualified(),
            values.join(", "),
            self.unpublished(),
            quote_ident(&self.columns.id)
        )
    }

    /// Polling: dead-letter the rows at `$2`, `$3` ([`RowAt`]) into the dead-letter table
    /// `letters` (quoted), each with its reason in `$4` and `$1` the source table, by PostgreSQL
    /// alone: `row_data` (the shape [`OutboxRow::row_data`] gives) is made here from the row, which
    /// the relay did not read (over `polling.max_row_bytes`). No digest: the relay signs only what
    /// it read.
    pub fn copy_to_letters_sql(&self, letters: &str) -> String {
        let columns = self.event_columns();
        let mut row_data: Vec<String> =
            columns.iter().map(|(text, alias)| format!("'{alias}', {text}")).collect();
        if !self.others.is_empty() {
            let others: Vec<String> = self
                .others
                .iter()
                .map(|name| format!("{}, {}", quote_literal(name), self.text(name)))
                .collect();
            row_data.push(format!("'columns', jsonb_build_object({})", others.join(", ")));
        }
        format!(
            "INSERT INTO {letters} (source_table, event_id, row_data, reason) \
             SELECT $1, {}, jsonb_build_object({}), u.reason \
             FROM {} t, unnest($2::oid[], $3::text[]::tid[], $4::text[]) AS u(tableoid, ctid, reason) \
             WHERE t.ctid = ANY($3::text[]::tid[]) AND t.tableoid = u.tableoid AND t.ctid = u.ctid",
            columns[0].0,
            row_data.join(", "),
            self.qualified()
        )
    }

    /// The first copy of a new slot: every unpublished row, in id order. (Rows polling mode
    /// marked published are not copied: a switch from polling with `after_publish = "mark"`.)
    pub fn copy_sql(&self) -> String {
        self.select_events(
            "",
            &format!("WHERE {} ORDER BY t.{}", self.unpublished(), quote_ident(&self.columns.id)),
        )
    }

    /// `verify`: the rows whose `created_at` is in [`$1`, `$2`) (either NULL: unbounded), in id
    /// order; every row when the table has no created_at column (then both must be NULL).
    pub fn window_sql(&self) -> String {
        let created_at = &self.columns.created_at;
        let window = match created_at.is_empty() {
            true => "WHERE $1::timestamptz IS NULL AND $2::timestamptz IS NULL".to_string(),
            false => format!(
                "WHERE ($1::timestamptz IS NULL OR t.{c} >= $1) AND ($2::timestamptz IS NULL OR t.{c} < $2)",
                c = quote_ident(created_at)
            ),
        };
        self.select_events("", &format!("{window} ORDER BY t.{}", quote_ident(&self.columns.id)))
    }

    /// `verify`: which of the ids `$1` the table holds at all, and whether each is still
    /// unpublished (`mark` mode; always false otherwise).
    pub fn ids_present_sql(&self, id_type: &str) -> String {
        format!(
            "SELECT t.{}::text, {} FROM {} t WHERE t.{}",
            quote_ident(&self.columns.id),
            match &self.published_at {
                None => "false".to_string(),
                Some(_) => self.unpublished(),
            },
            self.qualified(),
            self.ids_match(id_type)
        )
    }

    /// `verify --watch`: the age in seconds (by `created_at`) of each of the ids `$1` the table
    /// holds; None without a created_at column.
    pub fn ages_sql(&self, id_type: &str) -> Option<String> {
        let created_at = &self.columns.created_at;
        (!created_at.is_empty()).then(|| {
            format!(
                "SELECT t.{}::text, extract(epoch FROM now() - t.{})::float8 FROM {} t WHERE t.{}",
                quote_ident(&self.columns.id),
                quote_ident(created_at),
                self.qualified(),
                self.ids_match(id_type)
            )
        })
    }

    /// `locate`: the row of id `$1[1]` (as text; `$1::text[]`), with whether it is unpublished
    /// ([`col::UNPUBLISHED`]).
    pub fn row_by_id_sql(&self, id_type: &str) -> String {
        self.select_events(
            &format!(", {} AS {}", self.unpublished(), col::UNPUBLISHED),
            &format!("WHERE t.{}", self.ids_match(id_type)),
        )
    }

    /// `republish`: the rows chosen by `$1` aggregate_type, `$2` aggregate_id, `$3` ids (text[]),
    /// `$4` and `$5` the created_at window (text as PostgreSQL reads a timestamptz), each NULL for
    /// any, in id order. Without a created_at column the window is ignored (refused before).
    pub fn chosen_sql(&self, id_type: &str) -> String {
        let c = &self.columns;
        let window = match c.created_at.is_empty() {
            true => "$4::text IS NULL AND $5::text IS NULL".to_string(),
            false => format!(
                "($4::text IS NULL OR t.{at} >= $4::text::timestamptz) AND ($5::text IS NULL OR t.{at} < $5::text::timestamptz)",
                at = quote_ident(&c.created_at)
            ),
        };
        self.select_events(
            "",
            &format!(
                "WHERE ($1::text IS NULL OR t.{}::text = $1) AND ($2::text IS NULL OR t.{}::text = $2) \
                 AND ($3::text[] IS NULL OR t.{}) AND {window} ORDER BY t.{}",
                quote_ident(&c.aggregate_type),
                quote_ident(&c.aggregate_id),
                self.ids_match(id_type).replace("$1", "$3"),
                quote_ident(&c.id)
            ),
        )
    }

    /// The configured created_at column, empty when the table has none.
    pub fn created_at_column(&self) -> &str {
        &self.columns.created_at
    }

    /// `$1::text[]` compared with the id column of type `id_type`, so its index is used.
    fn ids_match(&self, id_type: &str) -> String {
        format!("{} = ANY($1::text[]::{id_type}[])", quote_ident(&self.columns.id))
    }

    /// The row versions `$1::oid[]` (tableoid) and `$2::text[]` (ctid), paired: exactly the rows
    /// a claim holds, whatever their ids. (The first condition lets each partition look the
    /// versions up by ctid; the second pairs them with their partitions.)
    fn rows_at() -> &'static str {
        "t.ctid = ANY($2::text[]::tid[]) AND (t.tableoid, t.ctid) IN (SELECT * FROM unnest($1::oid[], $2::text[]::tid[]))"
    }

    /// Polling: release the published rows at `$1`, `$2` ([`RowAt`]): delete, or mark.
    pub fn release_sql(&self) -> String {
        match &self.published_at {
            None => self.delete_sql(),
            Some(column) => format!(
                "UPDATE {} t SET {} = now() WHERE {}",
                self.qualified(),
                quote_ident(column),
                Self::rows_at()
            ),
        }
    }

    /// Polling: how many of the rows `$1` are still unpublished, locked or not.
    pub fn unpublished_count_sql(&self, id_type: &str) -> String {
        format!(
            "SELECT count(*) FROM {} t WHERE {} AND {}",
            self.qualified(),
            self.ids_match(id_type),
            self.unpublished()
        )
    }

    /// Removes the rows whose ids are `$1` (text, of the id column's type `id_type`): a replayed
    /// dead letter's event.
    pub fn delete_ids_sql(&self, id_type: &str) -> String {
        format!("DELETE FROM {} WHERE {}", self.qualified(), self.ids_match(id_type))
    }

    /// Removes the rows at `$1`, `$2` ([`RowAt`]; polling: dead-lettered rows leave the outbox).
    pub fn delete_sql(&self) -> String {
        format!("DELETE FROM {} t WHERE {}", self.qualified(), Self::rows_at())
    }

    /// The SQL type of the id column: `$1` the qualified table, `$2` the column.
    pub const ID_TYPE_SQL: &'static str = "SELECT format_type(atttypid, atttypmod) FROM pg_attribute \
         WHERE attrelid = to_regclass($1) AND attname = $2 AND NOT attisdropped";

    /// The SQL type of the id column (for [`OutboxTable::unpublished_count_sql`] and the like); a fatal
    /// `schema` error when the table or the column does not exist.
    pub async fn id_type(&self, client: &tokio_postgres::Client) -> Result<String, RelayError> {
        let id = &self.columns.id;
        let row = client.query_opt(Self::ID_TYPE_SQL, &[&self.qualified(), id]).await?;
        row.map(|r| r.get(0)).ok_or_else(|| {
            RelayError::fatal(
                FatalReason::Schema,
                format!(
                    "outbox table {} or its id column \"{id}\" does not exist: apply sql/001_outbox_events.sql \
                     or fix outbox.table / outbox.columns.id",
                    self.display_name()
                ),
            )
        })
    }

    /// The unpublished rows, counted up to `cap` so a huge backlog stays cheap to sample.
    pub fn backlog_count_sql(&self, cap: i64) -> String {
        format!(
            "SELECT count(*) FROM (SELECT 1 FROM {} t WHERE {} LIMIT {cap}) s",
            self.qualified(),
            self.unpublished()
        )
    }

    /// The age in seconds of the oldest unpublished row; `None` without a created_at column.
    pub fn backlog_age_sql(&self) -> Option<String> {
        let created_at = &self.columns.created_at;
        (!created_at.is_empty()).then(|| {
            format!(
                "SELECT extract(epoch FROM now() - t.{})::float8 FROM {} t WHERE {} ORDER BY t.{} LIMIT 1",
                quote_ident(created_at),
                self.qualified(),
                self.unpublished(),
                quote_ident(&self.columns.id)
            )
        })
    }

    /// The newest `limit` rows' (aggregate type, event type, topic) as text, with how many rows
    /// have each (`rows`): what `check` renders the routed topics from.
    pub fn topic_sample_sql(&self, limit: i64) -> String {
        let newest = self
            .select_events("", &format!("ORDER BY t.{} DESC LIMIT {limit}", quote_ident(&self.columns.id)));
        format!(
            "SELECT {}, {}, {}, count(*) AS rows FROM ({newest}) newest GROUP BY 1, 2, 3",
            col::AGGREGATE_TYPE,
            col::EVENT_TYPE,
            col::TOPIC
        )
    }

    /// The publication replication mode reads, of the outbox tables `tables`.
    pub fn create_publication_sql(publication: &str, tables: &[OutboxTable]) -> String {
        let tables: Vec<String> = tables.iter().map(OutboxTable::qualified).collect();
        format!(
            "CREATE PUBLICATION {} FOR TABLE {} WITH (publish = 'insert', publish_via_partition_root = true)",
            quote_ident(publication),
            tables.join(", ")
        )
    }

    /// `ALTER PUBLICATION ... ADD TABLE`, for the message that says how to fix a publication.
    pub fn add_to_publication_sql(&self, publication: &str) -> String {
        format!("ALTER PUBLICATION {} ADD TABLE {}", quote_ident(publication), self.qualified())
    }
}

#[cfg(test)]
mod tests;
