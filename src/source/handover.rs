//! Switching `source.mode` from replication to polling: what replication mode leaves behind.
//!
//! Replication mode never changes the outbox: the rows it published stay in the table (until
//! their partitions are dropped), and so do the rows it dead-lettered. A polling relay that
//! claimed them with its usual read-back (only its own last batch) would publish every one again.
//! The switch is unfinished while a slot replication mode streamed from still exists in this
//! database: `replication.slot`, or another slot the relay made for this outbox table
//! (`outbox_relay_slots.outbox_table`; a slot of an earlier `replication.slot`). Until an
//! operator drops them, every polling session, once it holds the leader lock:
//! - waits as a standby while a replication relay still streams from the slot (looked at again
//!   every 2 s while it runs: a replication relay started later ends the session);
//! - refuses to start with `dedup.enabled = false` (nothing could tell it what was published);
//! - reads back every record of each topic, as a slot's first copy does, and releases unsent each
//!   row Kafka already holds (`Lookback::Everything`);
//! - releases unsent each row the dead-letter table already holds for this outbox (same id and
//!   content: an id handed out again is another event).
//!
//! A slot retains WAL while it exists: the sampler exports the lag of the one retaining the most
//! in polling mode too, and `check` and `status` name each (docs/operations.md, "Switching source modes").

use std::collections::HashSet;

use tokio_postgres::Client;

use crate::config::{PerOutbox, RelayConfig};
use crate::dead_letter::{DeadLetters, LetterKey};
use crate::error::{FatalReason, RelayError};

/// The slots of this outbox's replication mode in this database: the configured one, and any
/// the relay remembers making for this outbox table (under an earlier `replication.slot`).
const LEFTOVER_SLOTS_SQL: &str = "SELECT slot_name::text, active, (pg_current_wal_lsn() - restart_lsn)::bigint \
     FROM pg_replication_slots WHERE database = current_database() AND (slot_name = $1";
const OWNED_SQL: &str =
    " OR slot_name IN (SELECT slot_name FROM outbox_relay_slots WHERE outbox_table = $2::text)";
const ORDER_SQL: &str = ") ORDER BY 3 DESC NULLS LAST, slot_name <> $1, 1";
/// Whether this role may read which outbox each remembered slot serves (a polling-only install
/// may lack the table, its grant, or sql/008_relay_slots_owner.sql).
const OWNERS_READABLE_SQL: &str = "SELECT coalesce(has_table_privilege(t, 'SELECT'), false) AND EXISTS \
     (SELECT 1 FROM pg_attribute WHERE attrelid = t AND attname = 'outbox_table' AND NOT attisdropped) \
     FROM (SELECT to_regclass('outbox_relay_slots') AS t) s";

/// A slot replication mode left for this outbox, found by a polling relay.
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
             SELECT pg_drop_replication_slot('{}') (docs/operations.md, Switching source modes)",
            self.name
        )
    }
}

/// The slots replication mode left for this outbox, the one retaining the most WAL first:
/// `replication.slot`, and any other slot the relay made for this outbox table (remembered in
/// `outbox_relay_slots`, e.g. under an earlier `replication.slot`; a slot made before
/// sql/008_relay_slots_owner.sql, or another outbox's, is not this relay's to judge). While any
/// exists, the switch is unfinished ([`unfinished_switch`]); `check`, `status` and the sampler
/// report them.
pub(crate) async fn leftover_slots(
    config: &RelayConfig,
    client: &Client,
) -> Result<Vec<LeftoverSlot>, tokio_postgres::Error> {
    let owners: bool = client.query_one(OWNERS_READABLE_SQL, &[]).await?.get(0);
    let slot = &config.replication.slot;
    let rows = if owners {
        // (replication mode records the first outbox's table as the slot's owner)
        let table = config.outboxes()[0].config.display_name();
        client.query(&format!("{LEFTOVER_SLOTS_SQL}{OWNED_SQL}{ORDER_SQL}"), &[slot, &table]).await?
    } else {
        client.query(&format!("{LEFTOVER_SLOTS_SQL}{ORDER_SQL}"), &[slot]).await?
    };
    Ok(rows.iter().map(leftover).collect())
}

fn leftover(row: &tokio_postgres::Row) -> LeftoverSlot {
    LeftoverSlot {
        name: row.get(0),
        active: row.get(1),
        retained_bytes: row.get::<_, Option<i64>>(2).unwrap_or(0),
    }
}

/// A replication relay streams from a slot of this outbox: a polling session must not publish
/// beside it, so it waits as a standby.
fn refuse_active(slots: &[LeftoverSlot]) -> Result<(), RelayError> {
    match slots.iter().find(|slot| slot.active) {
        Some(slot) => Err(RelayError::Standby(format!(
            "a replication relay still streams from slot \"{}\": stop it to switch to polling",
            slot.name
        ))),
        None => Ok(()),
    }
}

/// During an unfinished switch, made again while the session runs: a replication relay started
/// after the session began ends it (standby).
pub(crate) async fn refuse_active_slot(config: &RelayConfig, client: &Client) -> Result<(), RelayError> {
    refuse_active(&leftover_slots(config, client).await?)
}

/// What a polling session must not publish again: `None` when no switch is under way, else the
/// events of each outbox the dead-letter tables hold. Errors when the session cannot
/// go on.
pub(crate) async fn unfinished_switch(
    config: &RelayConfig,
    client: &Client,
    dead_letters: &DeadLetters,
) -> Result<Option<PerOutbox<HashSet<LetterKey>>>, RelayError> {
    let slots = leftover_slots(config, client).await?;
    refuse_active(&slots)?;
    let Some(slot) = slots.first() else { return Ok(None) };
    if !config.dedup.enabled {
        return Err(RelayError::fatal(
            FatalReason::Config,
            format!(
                "slot \"{}\" of replication mode still exists and dedup.enabled = false: every row replication \
                 mode published would be sent again. Set dedup.enabled = true for the switch, or remove the rows \
                 Kafka holds yourself and then drop the slot (docs/operations.md, Switching source modes)",
                slot.name
            ),
        ));
    }
    let mut dead_lettered = Vec::new();
    for outbox in dead_letters.ids() {
        dead_lettered.push(dead_letters.dead_lettered(client, outbox).await?);
    }
    let dead_lettered: PerOutbox<_> = dead_lettered.into_iter().collect();
    tracing::warn!(
        slot = %slot.name,
        retained_bytes = slot.retained_bytes,
        dead_lettered = dead_lettered.values().map(HashSet::len).sum::<usize>(),
        "switching from replication mode: each topic is read back whole before this session publishes, so \
         rows replication mode published or dead-lettered are not sent again; {}",
        slot.remedy()
    );
    Ok(Some(dead_lettered))
}
