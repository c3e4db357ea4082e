//! Polling leadership: which session may claim rows.
//!
//! The leader is the session holding a session-level advisory lock whose key is derived from the
//! outbox table: `hashtextextended('<schema>.<table>', polling.leader_lock_key)`. A session-level
//! lock holds no transaction open (a row or table lock would, and with it the database's xmin
//! horizon for as long as the relay runs), so losing the session releases it and nothing else.
//!
//! Invariants and limits:
//! - an advisory lock has no privileges: any role that can connect to the database can take the
//!   key and keep every relay a standby. The relay cannot prevent that; it names the holder
//!   (pid, role, application, client) in the log and on `/readyz`, and when the holder's role
//!   could not claim rows (no DELETE, or UPDATE in `mark` mode, on the outbox table) it says the
//!   holder is not a relay and reports itself degraded, not standby;
//! - the key is derived per table, so the fixed `polling.leader_lock_key` taken by hand (or by
//!   another program using the same number) no longer stalls polling;
//! - relays from before the derived key took `polling.leader_lock_key` itself. The leader takes
//!   that key too when it is free, so such a relay stays a standby, and a session holding it
//!   whose role could claim rows (an older relay, during a rolling upgrade) keeps this one a
//!   standby: two claimers would publish one aggregate's events out of order.

use tokio_postgres::Client;

use crate::config::{AfterPublish, RelayConfig};
use crate::table::OutboxTable;

/// Takes the table's lock; `key` is what it is in `pg_locks` (`classid`, `objid`: its high and
/// low 32 bits, `objsubid` 1).
const TAKE_SQL: &str =
    "SELECT k, pg_try_advisory_lock(k) FROM (SELECT hashtextextended($1::text, $2::bigint) AS k) s";

/// The sessions holding the advisory lock `$1` in this database, and whether each one's role
/// could claim rows from the outbox table `$2` (privilege `$3`).
const HOLDERS_SQL: &str = "SELECT l.pid, a.usename::text, coalesce(a.application_name, ''), host(a.client_addr), \
     coalesce(has_table_privilege(a.usesysid, $2::text, $3::text), false) \
     FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid \
     WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1 \
       AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
       AND l.classid = (($1::bigint >> 32) & 4294967295)::oid AND l.objid = ($1::bigint & 4294967295)::oid \
     ORDER BY l.pid";

/// A session holding a lock this relay wants.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Holder {
    pub pid: i32,
    pub role: Option<String>,
    pub application: String,
    /// Visible only to the holder's role and members of pg_read_all_stats.
    pub client: Option<String>,
    /// Its role could claim rows from the outbox table: taken for a relay.
    pub relay_grants: bool,
}

impl std::fmt::Display for Holder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let role = self.role.as_deref().unwrap_or("?");
        write!(f, "pid {} (role \"{role}\", application \"{}\"", self.pid, self.application)?;
        match &self.client {
            Some(client) => write!(f, ", client {client})"),
            None => write!(f, ")"),
        }
    }
}

/// Why this session is not the leader.
#[derive(Debug)]
pub(super) struct Refused {
    /// The session that holds the lock (None: it ended before it could be looked up).
    pub holder: Option<Holder>,
    /// The lock held is `polling.leader_lock_key` itself (a relay from before the derived key).
    pub legacy: bool,
    table: String,
    key: i64,
    privilege: &'static str,
}

impl Refused {
    /// The holder is no relay: nobody relays until an operator ends it.
    pub fn foreign(&self) -> bool {
        self.holder.as_ref().is_some_and(|holder| !holder.relay_grants)
    }
}

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (table, key) = (&self.table, self.key);
        match (&self.holder, self.legacy) {
            (None, _) => write!(f, "another instance holds the polling lock {key} of {table}"),
            (Some(holder), _) if !holder.relay_grants => write!(
                f,
                "the polling lock {key} of {table} is held by {holder}, which is not a relay (its role cannot {} \
                 {table}): no instance relays until it lets go; end it with SELECT pg_terminate_backend({})",
                self.privilege, holder.pid
            ),
            (Some(holder), false) => {
                write!(f, "another instance is active: {holder} holds the polling lock {key} of {table}")
            }
            (Some(holder), true) => write!(
                f,
                "{holder} holds polling.leader_lock_key {key} itself, as a relay from before the per-table lock does: \
                 waiting for it to stop (if it is no relay, end it with SELECT pg_terminate_backend({}))",
                holder.pid
            ),
        }
    }
}

/// Takes the leader lock of `table` on `client`'s session (`Ok(Ok(key))`), or says who holds
/// it (`Ok(Err(refused))`).
pub(super) async fn take(
    config: &RelayConfig,
    table: &OutboxTable,
    client: &Client,
) -> Result<Result<i64, Refused>, tokio_postgres::Error> {
    let seed = config.polling.leader_lock_key;
    let name = table.display_name();
    let privilege = match config.polling.after_publish {
        AfterPublish::Delete => "DELETE",
        AfterPublish::Mark => "UPDATE",
    };
    let refused = |key, holder, legacy| Refused { holder, legacy, table: name.clone(), key, privilege };
    let row = client.query_one(TAKE_SQL, &[&name, &seed]).await?;
    let (key, leader): (i64, bool) = (row.get(0), row.get(1));
    if !leader {
        let holder = holders(client, key, &table.qualified(), privilege).await.into_iter().next();
        return Ok(Err(refused(key, holder, false)));
    }
    let legacy: bool = client.query_one("SELECT pg_try_advisory_lock($1)", &[&seed]).await?.get(0);
    if !legacy {
        let holders = holders(client, seed, &table.qualified(), privilege).await;
        if let Some(relay) = holders.iter().find(|holder| holder.relay_grants) {
            client.query_one("SELECT pg_advisory_unlock($1)", &[&key]).await?;
            return Ok(Err(refused(seed, Some(relay.clone()), true)));
        }
        for holder in &holders {
            tracing::debug!(%holder, seed, "polling.leader_lock_key is held by a session that is no relay: ignored");
        }
    }
    Ok(Ok(key))
}

/// Who holds advisory lock `key`; empty when the lookup fails (the refusal is then plain).
async fn holders(client: &Client, key: i64, table: &str, privilege: &str) -> Vec<Holder> {
    match client.query(HOLDERS_SQL, &[&key, &table, &privilege]).await {
        Ok(rows) => rows
            .iter()
            .map(|row| Holder {
                pid: row.get(0),
                role: row.get(1),
                application: row.get(2),
                client: row.get(3),
                relay_grants: row.get(4),
            })
            .collect(),
        Err(e) => {
            tracing::debug!(error = %e, key, "polling lock: could not look up its holder");
            Vec::new()
        }
    }
}
