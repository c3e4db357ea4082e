//! Switching `source.mode` from replication to polling: what replication mode leaves behind.
//!
//! Replication mode never changes the outbox: the rows it published stay in the table (until
//! their partitions are dropped), and so do the rows it dead-lettered. A polling relay that
//! claimed them with its usual read-back (only its own last batch) would publish every one again.
//! The switch is unfinished while the slot replication mode streamed from (`replication.slot`)
//! still exists in this database. Until an operator drops it, every polling session, once it
//! holds the leader lock:
//! - waits as a standby while a replication relay still streams from the slot (looked at again
//!   every 2 s while it runs: a replication relay started later ends the session);
//! - refuses to start with `dedup.enabled = false` (nothing could tell it what was published);
//! - reads back every record of each topic, as a slot's first copy does, and releases unsent each
//!   row Kafka already holds (`Lookback::Everything`);
//! - releases unsent each row the dead-letter table already holds for this outbox (same id and
//!   content: an id handed out again is another event).
//!
//! The slot retains WAL while it exists: the sampler exports its lag in polling mode too, and
//! `check` and `status` name it (README, "Switching source modes").

use std::collections::HashSet;

use tokio_postgres::Client;

use crate::config::RelayConfig;
use crate::dead_letter::{DeadLetters, LetterKey};
use crate::error::{FatalReason, RelayError};

const LEFTOVER_SLOTS_SQL: &str = "SELECT slot_name::text, active, (pg_current_wal_lsn() - restart_lsn)::bigint \
     FROM pg_replication_slots WHERE database = current_database() AND (slot_name = $1";
/// Any other slot the relay created in this database, while no one streams from it.
const REMEMBERED_IDLE_SQL: &str =
    " OR (slot_type = 'logical' AND NOT active AND slot_name IN (SELECT slot_name FROM outbox_relay_slots))";
/// Whether this role may read the slots the relay remembers (a polling-only install may lack
/// the table, or the grant).
const REMEMBERED_READABLE_SQL: &str =
    "SELECT coalesce(has_table_privilege(to_regclass('outbox_relay_slots'), 'SELECT'), false)";

/// The replication slot of this configuration, found by a polling relay.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct LeftoverSlot {
    pub name: String,
    /// A replication relay streams from it now.
    pub active: bool,
    /// WAL the slot keeps PostgreSQL from removing.
    pub retained_bytes: i64,
}

impl LeftoverSlot {
    /// What to do about it, once polling has taken over.
    pub fn remedy(&self) -> String {
        format!(
            "once polling has published every row older than the switch (`outbox-relay status`: no \
             unpublished row that old), drop the slot as a role with REPLICATION: \
             SELECT pg_drop_replication_slot('{}') (README, Switching source modes)",
            self.name
        )
    }
}

/// The configured slot, when it exists in this database: the one whose existence makes the
/// switch unfinished ([`unfinished_switch`]).
pub(crate) async fn leftover_slot(
    config: &RelayConfig,
    client: &Client,
) -> Result<Option<LeftoverSlot>, tokio_postgres::Error> {
    let sql = format!("{LEFTOVER_SLOTS_SQL})");
    Ok(client.query_opt(&sql, &[&config.replication.slot]).await?.map(|row| leftover(&row)))
}

/// Every slot replication mode left in this database that keeps WAL, the configured one first,
/// then by WAL retained: `replication.slot` in any state, and any other slot the relay created
/// here (remembered in `outbox_relay_slots`: a slot of an earlier `replication.slot`) that no
/// one streams from. An active remembered slot is another relay's (another outbox's) and is
/// left out. `check`, `status` and the sampler report these; only the configured one changes
/// what a polling session does.
pub(crate) async fn leftover_slots(
    config: &RelayConfig,
    client: &Client,
) -> Result<Vec<LeftoverSlot>, tokio_postgres::Error> {
    let remembered: bool = client.query_one(REMEMBERED_READABLE_SQL, &[]).await?.get(0);
    let sql = format!(
        "{LEFTOVER_SLOTS_SQL}{}) ORDER BY slot_name <> $1, 3 DESC NULLS LAST, 1",
        if remembered { REMEMBERED_IDLE_SQL } else { "" }
    );
    Ok(client.query(&sql, &[&config.replication.slot]).await?.iter().map(leftover).collect())
}

fn leftover(row: &tokio_postgres::Row) -> LeftoverSlot {
    LeftoverSlot {
        name: row.get(0),
        active: row.get(1),
        retained_bytes: row.get::<_, Option<i64>>(2).unwrap_or(0),
    }
}

/// A replication relay streams from the configured slot: a polling session must not publish
/// beside it, so it waits as a standby.
fn active_slot(slot: &LeftoverSlot) -> RelayError {
    RelayError::Standby(format!(
        "a replication relay still streams from slot \"{}\": stop it to switch to polling",
        slot.name
    ))
}

/// During an unfinished switch, made again while the session runs: a replication relay started
/// after the session began ends it (standby).
pub(crate) async fn refuse_active_slot(config: &RelayConfig, client: &Client) -> Result<(), RelayError> {
    match leftover_slot(config, client).await? {
        Some(slot) if slot.active => Err(active_slot(&slot)),
        _ => Ok(()),
    }
}

/// What a polling session must not publish again: `None` when no switch is under way, else the
/// events of this outbox the dead-letter table holds. Errors when the session cannot go on.
pub(crate) async fn unfinished_switch(
    config: &RelayConfig,
    client: &Client,
    dead_letters: &DeadLetters,
) -> Result<Option<HashSet<LetterKey>>, RelayError> {
    let Some(slot) = leftover_slot(config, client).await? else { return Ok(None) };
    if slot.active {
        return Err(active_slot(&slot));
    }
    if !config.dedup.enabled {
        return Err(RelayError::fatal(
            FatalReason::Config,
            format!(
                "slot \"{}\" of replication mode still exists and dedup.enabled = false: every row replication \
                 mode published would be sent again. Set dedup.enabled = true for the switch, or remove the rows \
                 Kafka holds yourself and then drop the slot (README, Switching source modes)",
                slot.name
            ),
        ));
    }
    let lettered = dead_letters.lettered(client).await?;
    tracing::warn!(
        slot = %slot.name,
        retained_bytes = slot.retained_bytes,
        dead_lettered = lettered.len(),
        "switching from replication mode: each topic is read back whole before this session publishes, so \
         rows replication mode published or dead-lettered are not sent again; {}",
        slot.remedy()
    );
    Ok(Some(lettered))
}
