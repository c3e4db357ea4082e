//! The signal table (`admin.signal_table`, `sql/014_relay_signal.sql`): requests an operator
//! role inserts as rows, for estates where nothing may call into the pod. The active instance
//! executes them in id order, each once, through the admin API's acts
//! ([`super::admin::acts::perform`]: the same audit line, the same receipt), and writes the
//! result and the receipt into the row.
//!
//! Invariants:
//! - only the active instance executes a row (a standby looks at nothing), one row at a time,
//!   and not the next before the first unfinished one is finished;
//! - a row is marked started (`started_at`, `executor_pid`: this executor's backend) in a
//!   committed statement that only succeeds on an unstarted row, before it is executed; a
//!   started row is never executed again. One whose executor's backend is gone unfinished (the
//!   relay was killed, or lost its connection before writing the result) is finished as
//!   `interrupted`; one whose executor is alive (another instance that still executes it) is
//!   waited for;
//! - a row whose `requested_by` is not (or no longer) a member of `admin.signal_operator_role`
//!   is finished as `refused`, unexecuted (the table's trigger refuses such rows already; this
//!   holds against a row its owner wrote with the trigger disabled);
//! - every row finished writes one audit line, as an act of the admin API does.

use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value, json};
use tokio_postgres::Client;

use super::admin::Admin;
use super::admin::acts;
use super::admin::routes::Endpoint;
use crate::config::AdminConfig;
use crate::error::{FatalReason, RelayError};
use crate::observe::health::Phase;
use crate::table::quote_ident;

/// The table, its trigger and its role as `sql/014_relay_signal.sql` makes them (`setup` runs
/// it with the configured names).
const TABLE_SQL: &str = include_str!("../../sql/014_relay_signal.sql");
/// The names that file uses.
const FILE_TABLE: &str = "outbox_relay_signal";
const FILE_ROLE: &str = "outbox_relay_operator";

/// Starts the executor when `admin.signal_table` is set.
pub(crate) fn spawn(admin: Arc<Admin>) {
    if admin.config.admin.signal_table.is_empty() {
        return;
    }
    let executor = Executor::new(admin);
    tokio::spawn(executor.run());
}

/// One row as the executor reads it.
struct Row {
    id: i64,
    kind: String,
    args: String,
    requested_by: String,
    started: bool,
    executor_alive: bool,
    operator: bool,
}

struct Executor {
    admin: Arc<Admin>,
    client: Option<Client>,
    /// `admin.signal_table`, quoted.
    table: String,
    /// Who executes: `application_name` on the host, with the process id.
    instance: String,
    /// The last failure logged, not repeated at every poll.
    said: Option<String>,
}

impl Executor {
    fn new(admin: Arc<Admin>) -> Executor {
        let config = &admin.config;
        let table = qualified(&config.admin.signal_table);
        let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "?".into());
        let instance = format!("{} on {host} (pid {})", config.postgres.application_name, std::process::id());
        Executor { admin, client: None, table, instance, said: None }
    }

    async fn run(mut self) {
        let every = Duration::from_millis(self.admin.config.admin.signal_poll_interval_ms);
        loop {
            tokio::time::sleep(every).await;
            if self.admin.health.phase() != Phase::Active {
                continue;
            }
            match self.execute_waiting().await {
                Ok(()) => self.said = None,
                Err(e) => {
                    let said = e.to_string();
                    if self.said.as_ref() != Some(&said) {
                        tracing::warn!(table = %self.table, error = %said, "cannot execute the signal table's requests; trying again");
                        self.said = Some(said);
                    }
                    self.client = None;
                }
            }
        }
    }

    /// Executes the waiting rows in id order, while this instance stays active.
    async fn execute_waiting(&mut self) -> Result<(), RelayError> {
        if self.client.is_none() {
            self.client = Some(crate::postgres::connect(&self.admin.config.postgres).await?);
        }
        while self.admin.health.phase() == Phase::Active {
            let Some(row) = self.first_unfinished().await? else { return Ok(()) };
            let via = format!("signal {}", row.id);
            if row.started && row.executor_alive {
                // another executor has it (an instance that lost the lead mid-request): wait
                return Ok(());
            }
            if row.started {
                let error = "the relay executing it stopped before it finished (killed, or its connection lost): it \
                             is not executed again; part of it may have happened -- insert a new row to ask again";
                self.finish(&row, &via, ("interrupted", json!({ "error": error }))).await?;
                continue;
            }
            if !row.operator {
                let role = &self.admin.config.admin.signal_operator_role;
                let error = format!(
                    "role {} is not a member of {role}: only its members may ask the relay (GRANT {role} TO {})",
                    row.requested_by, row.requested_by
                );
                self.finish(&row, &via, ("refused", json!({ "error": error }))).await?;
                continue;
            }
            if !self.claim(row.id).await? {
                continue;
            }
            let (_, receipt) = match endpoint(&row.kind) {
                Some(endpoint) => {
                    acts::perform(&self.admin, endpoint, (&row.requested_by, &via), row.args.as_bytes()).await
                }
                None => (hyper::StatusCode::BAD_REQUEST, json!({ "result": "refused" })),
            };
            self.write(row.id, &receipt).await?;
        }
        Ok(())
    }

    fn client(&self) -> &Client {
        self.client.as_ref().expect("connected")
    }

    async fn first_unfinished(&self) -> Result<Option<Row>, RelayError> {
        let sql = format!(
            "SELECT id, kind, args::text, requested_by::text, started_at IS NOT NULL, \
                    coalesce(executor_pid IN (SELECT pid FROM pg_stat_activity), false), \
                    coalesce((SELECT pg_has_role(s.requested_by, r.oid, 'MEMBER') FROM pg_roles r WHERE r.rolname = $1), false) \
             FROM {} s WHERE finished_at IS NULL ORDER BY id LIMIT 1",
            self.table
        );
        let role = &self.admin.config.admin.signal_operator_role;
        let row = self.client().query_opt(&sql, &[role]).await?;
        Ok(row.map(|r| Row {
            id: r.get(0),
            kind: r.get(1),
            args: r.get(2),
            requested_by: r.get(3),
            started: r.get(4),
            executor_alive: r.get(5),
            operator: r.get(6),
        }))
    }

    /// Marks row `id` started by this executor; false when another took it first.
    async fn claim(&self, id: i64) -> Result<bool, RelayError> {
        let sql = format!(
            "UPDATE {} SET started_at = now(), started_by = $2, executor_pid = pg_backend_pid() \
             WHERE id = $1 AND started_at IS NULL",
            self.table
        );
        Ok(self.client().execute(&sql, &[&id, &self.instance]).await? == 1)
    }

    /// Finishes `row` unexecuted with `(result, detail)`, after its audit line.
    async fn finish(&self, row: &Row, via: &str, (result, detail): (&str, Value)) -> Result<(), RelayError> {
        let error = detail["error"].to_string();
        tracing::info!(target: "outbox_relay::audit", who = %row.requested_by, via, act = row.kind.as_str(), result, detail = error, "admin act");
        let receipt = json!({
            "act": row.kind, "by": row.requested_by, "result": result, "detail": detail,
            "at_unix_seconds": std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_secs(),
        });
        self.write(row.id, &receipt).await
    }

    /// Writes row `id`'s receipt and its result.
    async fn write(&self, id: i64, receipt: &Value) -> Result<(), RelayError> {
        let sql = format!(
            "UPDATE {} SET finished_at = now(), result = $2, receipt = $3::text::jsonb WHERE id = $1",
            self.table
        );
        let result = receipt["result"].as_str().unwrap_or("failed").to_string();
        self.client().execute(&sql, &[&id, &result, &receipt.to_string()]).await?;
        Ok(())
    }
}

/// The act a row's `kind` asks for.
fn endpoint(kind: &str) -> Option<Endpoint> {
    Some(match kind {
        "republish" => Endpoint::Republish,
        "replay" => Endpoint::Replay,
        "pause" => Endpoint::Pause,
        "resume" => Endpoint::Resume,
        "verify" => Endpoint::Verify,
        _ => return None,
    })
}

/// `schema.table` or `table`, each part quoted.
fn qualified(name: &str) -> String {
    name.split('.').map(quote_ident).collect::<Vec<_>>().join(".")
}

/// `setup`: creates the signal table, its trigger and its operator role when
/// `admin.signal_table` is set (`sql/014_relay_signal.sql`, with the configured names); says
/// what it did, or `None` when the table is off.
pub(crate) async fn setup(client: &Client, admin: &AdminConfig) -> Result<Option<String>, RelayError> {
    if admin.signal_table.is_empty() {
        return Ok(None);
    }
    let plain = |name: &str| {
        !name.is_empty() && name.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
    };
    let (table, role) = (&admin.signal_table, &admin.signal_operator_role);
    if !table.split('.').all(plain) || !plain(role) {
        return Err(RelayError::fatal(
            FatalReason::Config,
            "admin.signal_table and admin.signal_operator_role: setup creates them only with plain lowercase names \
             (letters, digits, '_'; the table optionally schema-qualified): apply sql/014_relay_signal.sql by hand \
             otherwise",
        ));
    }
    let sql = renamed(&renamed(TABLE_SQL, FILE_TABLE, table), FILE_ROLE, role);
    client.batch_execute(&sql).await?;
    Ok(Some(format!("signal table {table}: present (requests from members of {role})")))
}

/// `sql` with every whole word `from` (not part of a longer name) written `to`.
fn renamed(sql: &str, from: &str, to: &str) -> String {
    let mut out = String::with_capacity(sql.len());
    let mut rest = sql;
    while let Some(at) = rest.find(from) {
        let word = |c: Option<char>| c.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_');
        let before = if at > 0 { rest[..at].chars().last() } else { out.chars().last() };
        let after = rest[at + from.len()..].chars().next();
        out.push_str(&rest[..at]);
        out.push_str(if word(before) || word(after) { from } else { to });
        rest = &rest[at + from.len()..];
    }
    out + rest
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn setup_renames_the_table_and_the_role_but_not_the_names_made_from_them() {
        let sql = renamed(TABLE_SQL, FILE_TABLE, "ops.signals");
        assert!(sql.contains("CREATE TABLE IF NOT EXISTS ops.signals ("), "{sql}");
        assert!(sql.contains("outbox_relay_signal_unfinished ON ops.signals"), "{sql}");
        assert!(sql.contains("FUNCTION outbox_relay_signal_requested()"), "{sql}");
        let sql = renamed(&sql, FILE_ROLE, "ops_team");
        assert!(sql.contains("pg_has_role(session_user, 'ops_team', 'MEMBER')"), "{sql}");
        assert!(sql.contains("GRANT INSERT (kind, args) ON ops.signals TO ops_team;"), "{sql}");
        assert!(!sql.contains(FILE_ROLE), "every mention of the role is renamed");
    }

    #[test]
    fn every_kind_the_table_allows_is_an_act() {
        for kind in ["republish", "replay", "pause", "resume", "verify"] {
            assert!(endpoint(kind).is_some(), "{kind}");
            assert!(TABLE_SQL.contains(&format!("'{kind}'")), "{kind} is allowed by the table's CHECK");
        }
        assert_eq!(qualified("ops.Signals"), "\"ops\".\"Signals\"");
    }
}
