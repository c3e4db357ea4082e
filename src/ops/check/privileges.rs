//! Whether the relay's role holds exactly what its mode and settings need, column grants
//! included; each missing privilege is named with the GRANT that fixes it.

use tokio_postgres::Client;

use super::Finding;
use crate::config::{AfterPublish, OnPoison, RelayConfig, SourceMode};
use crate::outboxes::Outbox;
use crate::table::{qualified_name, quote_ident, quote_literal};

/// One privilege the relay needs.
struct Needed {
    /// `DELETE on public.outbox_events`.
    what: String,
    /// A query returning one boolean: whether the current role has it.
    test: String,
    /// The statement that grants it.
    grant: String,
}

fn table_privilege(privilege: &str, table: &str, display: &str, role: &str) -> Needed {
    Needed {
        what: format!("{privilege} on {display}"),
        test: format!("SELECT has_table_privilege({}, '{privilege}')", quote_literal(table)),
        grant: format!("GRANT {privilege} ON {table} TO {}", quote_ident(role)),
    }
}

/// What `config` needs of the role.
fn needed(config: &RelayConfig, outbox: &Outbox) -> Vec<Needed> {
    let role = &config.postgres.user;
    let (table, display) = (outbox.table.qualified(), outbox.table.display_name());
    let letters = &outbox.dead_letter;
    let dead_letter = qualified_name(letters.schema_and_table().0, letters.schema_and_table().1);
    let dead_letters = letters.on_poison == OnPoison::DeadLetter;
    let mut needed = vec![table_privilege("SELECT", &table, &display, role)];
    if dead_letters {
        needed.push(table_privilege("INSERT", &dead_letter, &letters.table, role));
    }
    match config.source.mode {
        SourceMode::Polling => {
            if config.polling.after_publish == AfterPublish::Delete || dead_letters {
                needed.push(table_privilege("DELETE", &table, &display, role));
            }
            if config.polling.after_publish == AfterPublish::Mark {
                let column = &config.polling.published_at_column;
                needed.push(Needed {
                    what: format!("UPDATE ({column}) on {display}"),
                    test: format!(
                        "SELECT has_column_privilege({}, {}, 'UPDATE')",
                        quote_literal(&table),
                        quote_literal(column)
                    ),
                    grant: format!(
                        "GRANT UPDATE ({}) ON {table} TO {}",
                        quote_ident(column),
                        quote_ident(role)
                    ),
                });
            }
        }
        SourceMode::Replication => {
            for privilege in ["SELECT", "INSERT", "UPDATE", "DELETE"] {
                needed.push(table_privilege(privilege, "outbox_relay_slots", "outbox_relay_slots", role));
            }
            if config.replication.heartbeat_interval_ms > 0 {
                needed.push(Needed {
                    what: "EXECUTE on pg_logical_emit_message (the heartbeat)".into(),
                    // the text overload, whose signature PostgreSQL 17 extended with `flush`
                    test: "SELECT coalesce(bool_and(has_function_privilege(oid, 'EXECUTE')), false) FROM pg_proc \
                           WHERE proname = 'pg_logical_emit_message' AND proargtypes[2] = 'text'::regtype"
                        .into(),
                    grant: format!(
                        "GRANT EXECUTE ON FUNCTION pg_logical_emit_message(boolean, text, text) TO {} (PostgreSQL \
                         17+: pg_logical_emit_message(boolean, text, text, boolean)), or set \
                         replication.heartbeat_interval_ms = 0",
                        quote_ident(role)
                    ),
                });
            }
        }
    }
    needed
}

pub(super) async fn check(config: &RelayConfig, outbox: &Outbox, client: &Client) -> Finding {
    let needed = needed(config, outbox);
    let mut lacking = Vec::new();
    for need in &needed {
        match client.query_one(&need.test, &[]).await {
            Ok(row) if row.get::<_, bool>(0) => {}
            Ok(_) => lacking.push(need),
            // a relation that does not exist: has_*_privilege errors (42P01)
            Err(e) => {
                let cause = e.as_db_error().map(|d| d.message().to_string()).unwrap_or_else(|| e.to_string());
                return Finding::fail(
                    "postgres.privileges",
                    format!("cannot check {}: {cause}", need.what),
                    "apply the migrations in sql/ (sql/004_dead_letter.sql, sql/006_relay_slots.sql) or fix the setting naming it",
                );
            }
        }
    }
    let role = &config.postgres.user;
    if lacking.is_empty() {
        let all: Vec<&str> = needed.iter().map(|n| n.what.as_str()).collect();
        return Finding::ok("postgres.privileges", format!("role {role} has {}", all.join(", ")));
    }
    let what: Vec<&str> = lacking.iter().map(|n| n.what.as_str()).collect();
    let grants: Vec<&str> = lacking.iter().map(|n| n.grant.as_str()).collect();
    Finding::fail(
        "postgres.privileges",
        format!("role {role} lacks {}", what.join(", ")),
        format!("{} (see sql/100_relay_role.sql)", grants.join("; ")),
    )
}
