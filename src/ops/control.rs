//! What the instances of one relay share in PostgreSQL (`sql/015_relay_control.sql`,
//! `outbox_relay_control`): the pause, so it outlives the instance that was paused, and the
//! active instance's admin URL, so a standby's refusal names where to go.
//!
//! Invariants:
//! - one row per relay, keyed by what makes one instance the active one: `slot <slot>` in
//!   replication mode, `lock <leader_lock_key> <tables>` in polling mode; every instance of one
//!   relay has the same configuration, so the same key;
//! - an instance that becomes the active one reads the row before it reads any event (the pause
//!   switch holds it meanwhile, [`crate::observe::pause::Pause::take_over`]), starts paused when
//!   the row says paused, and writes its own admin URL and name into the row in the same
//!   statement;
//! - a pause or resume by the API or the signal table is applied to this instance first (at
//!   once), then written to the row; the receipt says whether the row took it (`shared`);
//! - without the table, or without the privilege to use it, a take-over reads on unpaused and
//!   the relay warns once: the pause then holds only in the instance that was paused;
//! - a take-over that cannot reach PostgreSQL tries again every second, reading nothing
//!   meanwhile (its session cannot read either);
//! - it holds no session between uses: a take-over or an act opens one and closes it, so an
//!   instance keeps no more backends than before.

use std::sync::Arc;
use std::time::Duration;

use tokio_postgres::error::SqlState;

use crate::config::{AdminConfig, PostgresConfig, RelayConfig, SourceMode};
use crate::observe::pause::{Pause, Paused};
use crate::outboxes::Outboxes;

/// How soon a take-over that could not read the row tries again.
const RETRY: Duration = Duration::from_secs(1);

/// The take-over's statement: this instance leads now; what does the relay's pause say?
const TAKE_OVER_SQL: &str = "INSERT INTO outbox_relay_control AS c (relay, leader_admin_url, leader_instance, leader_since) \
     VALUES ($1, $2, $3, now()) \
     ON CONFLICT (relay) DO UPDATE SET leader_admin_url = EXCLUDED.leader_admin_url, \
         leader_instance = EXCLUDED.leader_instance, leader_since = now(), updated_at = now() \
     RETURNING paused_by, paused_reason, extract(epoch FROM paused_at)::bigint";

/// A pause (or a resume: every column `NULL`) the relay's instances share.
const PAUSE_SQL: &str = "INSERT INTO outbox_relay_control AS c (relay, paused_by, paused_reason, paused_at) \
     VALUES ($1, $2, $3, to_timestamp($4::bigint)) \
     ON CONFLICT (relay) DO UPDATE SET paused_by = EXCLUDED.paused_by, paused_reason = EXCLUDED.paused_reason, \
         paused_at = EXCLUDED.paused_at, updated_at = now()";

const LEADER_SQL: &str =
    "SELECT leader_admin_url, leader_instance FROM outbox_relay_control WHERE relay = $1";

/// The active instance, as it wrote itself into the row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct LeaderRecord {
    /// Its `admin.advertise_url`, when it has one.
    pub url: Option<String>,
    /// `application_name on host (pid N)`.
    pub instance: Option<String>,
}

/// The row of this relay, and how to reach it.
pub(crate) struct Control {
    postgres: PostgresConfig,
    /// The row's key.
    key: String,
    /// This instance: its advertised admin URL and its name.
    url: Option<String>,
    instance: String,
    pause: Pause,
}

impl Control {
    pub(crate) fn new(config: &RelayConfig, outboxes: &Outboxes, pause: Pause) -> Control {
        let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "?".into());
        let instance = format!("{} on {host} (pid {})", config.postgres.application_name, std::process::id());
        // its own name, so the relay's sessions (`status`, `check`) are told from its short visits
        let mut postgres = config.postgres.clone();
        postgres.application_name = format!("{} control", postgres.application_name);
        Control { postgres, key: key(config, outboxes), url: advertised(&config.admin), instance, pause }
    }

    /// Shares the pause from now on and serves every take-over, on a task of its own.
    pub(crate) fn spawn(self: &Arc<Control>) {
        self.pause.share();
        let control = self.clone();
        tokio::spawn(async move { control.serve_take_overs().await });
    }

    async fn serve_take_overs(&self) {
        let mut state = self.pause.watch();
        let mut warned = None;
        loop {
            if state.wait_for(|s| s.as_ref().is_some_and(|p| p.taking_over)).await.is_err() {
                return;
            }
            match self.take_over().await {
                Ok(shared) => {
                    if let Some(paused) = &shared {
                        tracing::warn!(by = %paused.by, reason = paused.reason.as_deref().unwrap_or(""), "this instance takes over a paused relay: it stays paused until resumed");
                    }
                    self.pause.settle(shared);
                    warned = None;
                }
                Err(Unshared(why)) => {
                    if warned.as_ref() != Some(&why) {
                        tracing::warn!(error = %why, "the relay's instances do not share the pause (outbox_relay_control): a pause holds only in the instance that was paused; apply sql/015_relay_control.sql and sql/100_relay_role.sql");
                    }
                    self.pause.settle(None);
                    warned = Some(why);
                }
                Err(Unreachable(why)) => {
                    if warned.as_ref() != Some(&why) {
                        tracing::warn!(error = %why, "cannot read the relay's pause (outbox_relay_control) while taking over; trying again");
                    }
                    warned = Some(why);
                    tokio::time::sleep(RETRY).await;
                }
            }
        }
    }

    /// Writes this instance into the row as the active one; what the row says of the pause.
    async fn take_over(&self) -> Result<Option<Paused>, Failed> {
        let url = self.url.as_deref();
        let row = self.query(TAKE_OVER_SQL, &[&self.key, &url, &self.instance]).await?;
        let row = row.first().ok_or_else(|| Unreachable("the take-over returned no row".into()))?;
        let by: Option<String> = row.get(0);
        Ok(by.map(|by| Paused {
            by,
            reason: row.get(1),
            since: row.get::<_, Option<i64>>(2).unwrap_or_default().max(0) as u64,
            taking_over: false,
        }))
    }

    /// Writes this instance's pause (`None`: resumed) into the row, for the instances to come.
    pub(crate) async fn share(&self, paused: Option<&Paused>) -> Result<(), String> {
        let by = paused.map(|p| p.by.as_str());
        let reason = paused.and_then(|p| p.reason.as_deref());
        let at = paused.map(|p| p.since as i64);
        match self.query(PAUSE_SQL, &[&self.key, &by, &reason, &at]).await {
            Ok(_) => Ok(()),
            Err(Unshared(why) | Unreachable(why)) => Err(why),
        }
    }

    /// The active instance, as the row names it.
    pub(crate) async fn leader(&self) -> Option<LeaderRecord> {
        let rows = self.query(LEADER_SQL, &[&self.key]).await.ok()?;
        let row = rows.first()?;
        Some(LeaderRecord { url: row.get(0), instance: row.get(1) })
    }

    async fn query(
        &self,
        sql: &str,
        params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
    ) -> Result<Vec<tokio_postgres::Row>, Failed> {
        // a session per use: a take-over or an act is rare, and an idle session would be one
        // more backend per instance for nothing
        let client =
            crate::postgres::connect(&self.postgres).await.map_err(|e| Unreachable(e.to_string()))?;
        client.query(sql, params).await.map_err(|e| match e.code() {
            Some(code) if *code == SqlState::UNDEFINED_TABLE || *code == SqlState::INSUFFICIENT_PRIVILEGE => {
                Unshared(e.as_db_error().map(|d| d.message().to_string()).unwrap_or_else(|| e.to_string()))
            }
            _ => Unreachable(e.to_string()),
        })
    }
}

/// Why the row could not be used.
enum Failed {
    /// No table, or no privilege on it: the pause is not shared.
    Unshared(String),
    /// PostgreSQL did not answer.
    Unreachable(String),
}
use Failed::{Unreachable, Unshared};

/// The row's key: what makes one instance of this relay the active one.
fn key(config: &RelayConfig, outboxes: &Outboxes) -> String {
    match config.source.mode {
        SourceMode::Replication => format!("slot {}", config.replication.slot),
        SourceMode::Polling => {
            let mut tables: Vec<String> = outboxes.iter().map(|o| o.table.display_name()).collect();
            tables.sort();
            format!("lock {} {}", config.polling.leader_lock_key, tables.join(","))
        }
    }
}

/// Where this instance's admin API answers others: `admin.advertise_url`.
fn advertised(admin: &AdminConfig) -> Option<String> {
    (admin.enabled() && !admin.advertise_url.is_empty())
        .then(|| admin.advertise_url.trim_end_matches('/').to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(toml: &str) -> RelayConfig {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("relay.toml");
        std::fs::write(&file, format!("[kafka]\nbrokers = [\"127.0.0.1:9092\"]\n{toml}")).unwrap();
        RelayConfig::load_with_env(&file, Default::default()).unwrap()
    }

    #[test]
    fn the_key_is_what_makes_an_instance_active_so_every_instance_of_a_relay_shares_it() {
        let replication = config("[replication]\nslot = \"billing_slot\"\n");
        assert_eq!(key(&replication, &Outboxes::new(&replication)), "slot billing_slot");
        let polling = config("[source]\nmode = \"polling\"\n[polling]\nleader_lock_key = 42\n");
        assert_eq!(key(&polling, &Outboxes::new(&polling)), "lock 42 public.outbox_events");
    }
}
