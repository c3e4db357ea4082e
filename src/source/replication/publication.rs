//! Whether the publication delivers every insert of the outbox, now.
//!
//! pgoutput says nothing when the outbox leaves the stream: after `ALTER PUBLICATION ... DROP
//! TABLE`, `SET (publish = 'update')`, a row filter, or a column list without a column the relay
//! reads, its inserts are simply not sent, and a relay that kept confirming would confirm past
//! them: silent loss. So the stream confirms no position past the last one checked, and
//! verifies the publication again when a position waits (at most every [`CHECK_INTERVAL`]), and
//! every [`IDLE_CHECK_INTERVAL`] when none does.
//!
//! Invariant: [`verify`] reads the WAL position *before* it looks at the catalog, in a separate
//! statement. A publication change that committed before that position is therefore visible to
//! the check; when the check passes, every insert committed before the position was streamed.

use std::str::FromStr;
use std::time::Duration;

use tokio_postgres::Client;

use super::refusal::Refusal;
use crate::config::{ColumnsConfig, RelayConfig};
use crate::error::{FatalReason, RelayError};
use crate::lsn::Lsn;
use crate::table::OutboxTable;

/// Whether this role may create the publication: it must own the outbox table (or be a member
/// of its owner) and hold CREATE on the database.
const MAY_CREATE_SQL: &str = "SELECT coalesce((SELECT pg_has_role(current_user, c.relowner, 'USAGE') FROM pg_class c \
     WHERE c.oid = to_regclass($1)), false), has_database_privilege(current_database(), 'CREATE')";

/// How often the streaming session verifies the publication while a position waits for it;
/// confirmations wait for it.
pub const CHECK_INTERVAL: Duration = Duration::from_millis(200);

/// How often it verifies the publication while no position waits: a publication dropped while
/// nothing happens is found within this, and anything written after it within
/// [`CHECK_INTERVAL`].
pub const IDLE_CHECK_INTERVAL: Duration = Duration::from_secs(30);

/// Why the publication would not deliver every insert of the outbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Problem {
    /// It does not exist (dropped, or never created).
    Missing(String),
    /// It exists and leaves inserts out; the text says how to fix it.
    Narrowed(String),
    /// The outbox table itself does not exist (dropped or renamed away): no publication can
    /// take it, so the fix is the table (or `outbox.table`), not `ALTER PUBLICATION`.
    TableMissing(String),
    /// The table has no column the relay reads (dropped or renamed): no publication can send
    /// it, so the fix is the table (or `outbox.columns`), not the publication's column list.
    /// `missing` says which, `fix` what to do.
    ColumnMissing { missing: String, fix: String },
}

impl Problem {
    /// The fatal reason a relay stops with for it: a missing table is `schema` (the table is what
    /// to fix), the rest `publication`.
    pub fn reason(&self) -> FatalReason {
        match self {
            Problem::TableMissing(_) | Problem::ColumnMissing { .. } => FatalReason::Schema,
            Problem::Missing(_) | Problem::Narrowed(_) => FatalReason::Publication,
        }
    }
}

impl std::fmt::Display for Problem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Problem::Missing(text) | Problem::Narrowed(text) | Problem::TableMissing(text) => {
                f.write_str(text)
            }
            Problem::ColumnMissing { missing, fix } => write!(f, "{missing}: {fix}"),
        }
    }
}

/// What fixes a publication dropped while the slot existed (in the fatal error whichever way it
/// was noticed: the publication check, or the stream's error for a change decoded without it).
pub(crate) const DROPPED_REMEDY: &str = "creating the publication again is not enough (the slot reads the \
     catalog as it was at each change, and stays without it): run `outbox-relay setup --recreate-slot`, which \
     creates the publication and the slot again and re-publishes what the table holds (what Kafka already has \
     is not sent twice with dedup on), then start the relay";

/// The publication, and its entry for each table it holds, keyed `schema` U+001F `table`. Each
/// entry also has `table_columns`, the table's columns now: a column missing from `attnames`
/// (15+: the columns published) may be left out by a column list, or gone from the table.
/// (`to_regclass`, not a cast: the view's row and the name's lookup see the catalog at two
/// moments, and a table moved or dropped between them must not fail the check with a bare
/// "relation does not exist"; its `table_columns` is then null, and the next check says what
/// happened.)
const ENTRIES_SQL: &str = "SELECT p.pubinsert AS inserts, \
        (SELECT jsonb_object_agg(t.schemaname || chr(31) || t.tablename, to_jsonb(t) || jsonb_build_object( \
             'table_columns', (SELECT jsonb_agg(a.attname) FROM pg_attribute a \
                 WHERE a.attrelid = to_regclass(quote_ident(t.schemaname) || '.' || quote_ident(t.tablename)) \
                   AND a.attnum > 0 AND NOT a.attisdropped))) \
         FROM pg_publication_tables t WHERE t.pubname = p.pubname) AS entries \
     FROM pg_publication p WHERE p.pubname = $1";

/// Why the publication would not deliver every insert of the relay's outboxes, or `None` when
/// it does: the first outbox's problem, in the configured order. One query for every outbox
/// (it runs every [`CHECK_INTERVAL`]). Works on PostgreSQL 13 to 18 (row filters and column
/// lists exist from 15; the rows are read as JSON so the query does not depend on the
/// version's columns).
pub async fn problem(
    config: &RelayConfig,
    client: &Client,
) -> Result<Option<Problem>, tokio_postgres::Error> {
    let publication = &config.replication.publication;
    let Some(row) = client.query_opt(ENTRIES_SQL, &[publication]).await? else {
        return Ok(Some(Problem::Missing(format!("publication \"{publication}\" does not exist"))));
    };
    if !row.get::<_, bool>("inserts") {
        return Ok(Some(Problem::Narrowed(format!(
            "publication \"{publication}\" does not publish inserts: ALTER PUBLICATION {publication} SET (publish = 'insert')"
        ))));
    }
    let entries = row.get::<_, Option<serde_json::Value>>("entries").unwrap_or_default();
    for outbox in &config.outboxes() {
        let table = OutboxTable::of(&outbox.config, &config.polling);
        let entry = entries.get(format!("{}\u{1f}{}", table.schema, table.name));
        let problem = match entry {
            Some(entry) => entry_problem(publication, (&outbox.config.columns, &table), entry),
            None if !table.exists(client).await? => Some(Problem::TableMissing(table.missing_text())),
            None => Some(Problem::Narrowed(format!(
                "publication \"{publication}\" does not include {}: a table that left the publication, or an \
                 outbox added to the configuration of an existing slot. `{}` alone would never publish the rows \
                 written to it before then: run `outbox-relay setup --recreate-slot` (it adds the table to the \
                 publication, makes the slot again and re-publishes what the tables hold; what Kafka already has \
                 is not sent twice with dedup on), then start the relay",
                table.display_name(),
                table.add_to_publication_sql(publication)
            ))),
        };
        if problem.is_some() {
            return Ok(problem);
        }
    }
    Ok(None)
}

/// What `publication`'s `entry` for an outbox `table` (with its `columns`) leaves out: a row
/// filter, or a column list without a column the relay reads.
fn entry_problem(
    publication: &str,
    (columns, table): (&ColumnsConfig, &OutboxTable),
    entry: &serde_json::Value,
) -> Option<Problem> {
    if let Some(filter) = entry.get("rowfilter").and_then(|f| f.as_str()) {
        return Some(Problem::Narrowed(format!(
            "publication \"{publication}\" has a row filter on {} (WHERE {filter}): rows it excludes would never \
             be published; remove it (ALTER PUBLICATION {publication} SET TABLE {})",
            table.display_name(),
            table.qualified()
        )));
    }
    column_list_problem(publication, (columns, table), entry)
}

/// A column list (15+) on the publication's entry for the outbox that leaves out a column the
/// relay reads: those columns would arrive as NULL. A column the table no longer has is not
/// published either, and no column list is to blame: that is told apart (`table_columns`).
fn column_list_problem(
    publication: &str,
    (c, table): (&ColumnsConfig, &OutboxTable),
    entry: &serde_json::Value,
) -> Option<Problem> {
    let names = |key: &str| -> Option<Vec<String>> {
        let array = entry.get(key)?.as_array()?;
        Some(array.iter().filter_map(|c| c.as_str().map(str::to_string)).collect())
    };
    let listed = names("attnames")?;
    let others = table.others().iter().map(|name| ("transforms.headers", name.as_str()));
    let read = c
        .required()
        .into_iter()
        .chain(c.optional())
        .filter(|(_, name)| *name != c.created_at.as_str())
        .chain(others);
    let missing: Vec<(&str, &str)> = read.filter(|(_, name)| !listed.iter().any(|l| l == name)).collect();
    if missing.is_empty() {
        return None;
    }
    if let Some(in_table) = names("table_columns") {
        let gone: Vec<(&str, &str)> =
            missing.iter().copied().filter(|(_, name)| !in_table.iter().any(|t| t == name)).collect();
        if !gone.is_empty() {
            return Some(columns_gone(table, &gone));
        }
    }
    let missing: Vec<&str> = missing.into_iter().map(|(_, name)| name).collect();
    Some(Problem::Narrowed(format!(
        "publication \"{publication}\" publishes only some columns of {}, not {}: remove the column list \
         (ALTER PUBLICATION {publication} SET TABLE {})",
        table.display_name(),
        missing.join(", "),
        table.qualified()
    )))
}

/// What a table without columns the relay reads (`gone`: config key, column name) is told.
fn columns_gone(table: &OutboxTable, gone: &[(&str, &str)]) -> Problem {
    let fixes: Vec<String> = gone
        .iter()
        .map(|(key, name)| match *key {
            "headers" | "topic" => {
                format!("add \"{name}\" back, or set outbox.columns.{key} = \"\" if it is gone for good")
            }
            "transforms.headers" => {
                format!("add \"{name}\" back, or remove the header rule that reads column:{name}")
            }
            _ => format!("add \"{name}\" back, or name the column that holds it in outbox.columns.{key}"),
        })
        .collect();
    let names: Vec<&str> = gone.iter().map(|(_, name)| *name).collect();
    Problem::ColumnMissing {
        missing: format!(
            "{} has no column {} (dropped or renamed), which the relay reads",
            table.display_name(),
            names.join(", ")
        ),
        fix: fixes.join("; "),
    }
}

/// The WAL position through which the publication is known to deliver every insert of the
/// outbox (checked now), or the fatal error that stops the relay before it confirms past an
/// insert it was never sent.
pub async fn delivers_through(config: &RelayConfig, client: &Client) -> Result<Lsn, RelayError> {
    let lsn: String = client.query_one("SELECT pg_current_wal_lsn()::text", &[]).await?.get(0);
    let lsn =
        Lsn::from_str(&lsn).map_err(|_| RelayError::Protocol(format!("pg_current_wal_lsn() = {lsn}")))?;
    match problem(config, client).await? {
        None => Ok(lsn),
        Some(problem) => Err(went_away(problem)),
    }
}

/// The fatal error for a `problem` found while the relay ran: it confirms nothing past the last
/// check that found none, which is what each says.
fn went_away(problem: Problem) -> RelayError {
    match problem {
        // the slot decodes each change with the catalog as it was then: a publication created
        // again is still missing for every change before it, so recreating it is not a fix
        Problem::Missing(_) => RelayError::fatal(
            FatalReason::Publication,
            format!(
                "{problem}: it was dropped while the relay ran, so the outbox's inserts are no longer sent; the \
                 relay stops without confirming past them. {}",
                capitalized(DROPPED_REMEDY)
            ),
        ),
        Problem::TableMissing(_) => RelayError::fatal(
            problem.reason(),
            format!(
                "{problem}. It went away while the relay ran: the relay stops; every insert it confirmed is in \
                 Kafka, and the slot keeps the changes after them. Renamed or moved: rename it back (or point \
                 outbox.schema / outbox.table at it) and restart. Dropped: create it again and run `outbox-relay \
                 setup --recreate-slot`"
            ),
        ),
        Problem::ColumnMissing { .. } => RelayError::fatal(
            problem.reason(),
            format!(
                "{problem}. It went away while the relay ran; the relay stops without confirming past the \
                 inserts since, which the slot keeps: restart once the table or outbox.columns is fixed"
            ),
        ),
        Problem::Narrowed(_) => RelayError::fatal(
            FatalReason::Publication,
            format!(
                "{problem}. The outbox left the replication stream while the relay ran, so its inserts are no \
                 longer sent; the relay stops without confirming past them. Fix the publication, then restart \
                 (inserts committed while it was changed are not in the slot: run `outbox-relay setup \
                 --recreate-slot` to re-publish what the table holds)"
            ),
        ),
    }
}

/// `text` with its first letter capitalized (a sentence made of a clause kept once).
fn capitalized(text: &str) -> String {
    let mut chars = text.chars();
    chars.next().map_or_else(String::new, |first| first.to_uppercase().chain(chars).collect())
}

/// Why this role cannot create the publication `run` and `setup` would create (it is missing
/// and `replication.create_publication` is on), or `None` when it can. `setup` stops with it
/// before trying, and `check` FAILs with it, in the same words.
pub(crate) async fn creation_refusal(
    config: &RelayConfig,
    client: &Client,
) -> Result<Option<Refusal>, tokio_postgres::Error> {
    for outbox in config.outboxes() {
        let table = OutboxTable::of(&outbox.config, &config.polling);
        let row = client.query_one(MAY_CREATE_SQL, &[&table.qualified()]).await?;
        let (owner, create): (bool, bool) = (row.get(0), row.get(1));
        if let Some(refusal) = creation_refused(config, &table, owner, create) {
            return Ok(Some(refusal));
        }
    }
    Ok(None)
}

/// `CREATE PUBLICATION` of the relay's publication, for every outbox table.
pub(crate) fn create_sql(config: &RelayConfig) -> String {
    let tables: Vec<OutboxTable> =
        config.outboxes().iter().map(|o| OutboxTable::of(&o.config, &config.polling)).collect();
    OutboxTable::create_publication_sql(&config.replication.publication, &tables)
}

/// Why this role cannot create the publication of every outbox of `config`, `table` being one
/// of them: it is not `owner` of the table, or may not `create` in the database.
fn creation_refused(config: &RelayConfig, table: &OutboxTable, owner: bool, create: bool) -> Option<Refusal> {
    let publication = &config.replication.publication;
    let sql = create_sql(config);
    let role = &config.postgres.user;
    let problem = match (owner, create) {
        (true, true) => return None,
        (false, _) => format!(
            "cannot create publication \"{publication}\": only the owner of {} may, and role {role} is not it",
            table.display_name()
        ),
        (true, false) => format!(
            "cannot create publication \"{publication}\": role {role} lacks CREATE on database {}",
            config.postgres.database
        ),
    };
    Some(Refusal {
        reason: FatalReason::Privilege,
        problem,
        fix: format!("run `{sql}` as the owner (or `outbox-relay setup` with the owner's credentials)"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_role_that_may_not_create_the_publication_is_told_the_owners_command() {
        let config: RelayConfig =
            serde_json::from_value(serde_json::json!({ "kafka": { "brokers": ["127.0.0.1:9092"] } }))
                .unwrap();
        let table = OutboxTable::of(&config.outbox, &config.polling);
        assert!(creation_refused(&config, &table, true, true).is_none());
        let not_owner = creation_refused(&config, &table, false, true).unwrap();
        assert!(not_owner.problem.contains("only the owner of public.outbox_events may"), "{not_owner:?}");
        assert!(
            not_owner.fix.starts_with("run `CREATE PUBLICATION \"outbox_relay\" FOR TABLE"),
            "{not_owner:?}"
        );
        let no_create = creation_refused(&config, &table, true, false).unwrap();
        assert!(no_create.problem.contains("lacks CREATE on database postgres"), "{no_create:?}");
    }

    /// A renamed outbox was said to stop "without confirming past its last inserts", although
    /// Kafka had acknowledged them and the slot was confirmed past them: the relay confirms only
    /// through the last check that found the table, and never past an unacknowledged insert.
    #[test]
    fn a_table_gone_while_the_relay_ran_is_told_what_was_confirmed() {
        let gone = Problem::TableMissing("the outbox table public.outbox_events does not exist".into());
        assert_eq!(
            went_away(gone).to_string(),
            "the outbox table public.outbox_events does not exist. It went away while the relay ran: the relay \
             stops; every insert it confirmed is in Kafka, and the slot keeps the changes after them. Renamed or \
             moved: rename it back (or point outbox.schema / outbox.table at it) and restart. Dropped: create it \
             again and run `outbox-relay setup --recreate-slot`"
        );
    }

    /// A `headers` column dropped from the table was blamed on a publication column list
    /// ("publishes only some columns ... remove the column list"): without one, `attnames` lists
    /// every column the table has, and `headers` is not among them because it is gone.
    #[test]
    fn a_dropped_column_is_told_apart_from_a_column_list() {
        let config: RelayConfig =
            serde_json::from_value(serde_json::json!({ "kafka": { "brokers": ["127.0.0.1:9092"] } }))
                .unwrap();
        let table = OutboxTable::of(&config.outbox, &config.polling);
        let columns = ColumnsConfig::default();
        let all = [
            "id",
            "aggregate_type",
            "aggregate_id",
            "event_type",
            "payload",
            "headers",
            "topic",
            "created_at",
        ];
        let without = |name: &str| -> Vec<&str> { all.iter().copied().filter(|c| *c != name).collect() };

        // the column dropped from the table: no column list is to blame
        let dropped =
            serde_json::json!({ "attnames": without("headers"), "table_columns": without("headers") });
        let problem = column_list_problem("p", (&columns, &table), &dropped).unwrap();
        assert_eq!(problem.reason(), FatalReason::Schema);
        let text = problem.to_string();
        assert!(text.contains("has no column headers (dropped or renamed)"), "{text}");
        assert!(text.contains("outbox.columns.headers = \"\""), "{text}");
        assert!(!text.contains("column list"), "{text}");

        // the column in the table, left out of the publication's column list
        let listed = serde_json::json!({ "attnames": without("headers"), "table_columns": all });
        let problem = column_list_problem("p", (&columns, &table), &listed).unwrap();
        assert_eq!(problem.reason(), FatalReason::Publication);
        assert!(problem.to_string().contains("publishes only some columns"), "{problem}");

        // every column published
        let whole = serde_json::json!({ "attnames": all, "table_columns": all });
        assert_eq!(column_list_problem("p", (&columns, &table), &whole), None);
    }
}
