//! The publication, the slot, and the rows that predate the slot.
//!
//! Invariants:
//! - a slot is created only when it is missing and the relay never published from one of that
//!   name (`outbox_relay_slots` remembers): a slot that disappears or is invalidated after the
//!   relay published from it is a fatal error naming the fix, never a silent recreate;
//! - a new slot exports a snapshot; the rows visible in that snapshot are published (and
//!   acknowledged) before the stream starts at the slot's consistent point, so every row is
//!   published once across the handover: rows committed before the point come from the
//!   snapshot, rows committed after it from the stream;
//! - the copy is recorded as finished only after Kafka acknowledged it; an interrupted copy
//!   is redone from scratch with a new slot;
//! - an unpublishable row in the copy takes the one dead-letter path: dead-lettered, or held at
//!   (inside the copy, without giving up the slot, so nothing before it is published again).

use std::str::FromStr;

use tokio_postgres::Client;

use super::refusal::Refusal;
use super::transport::{self, Command};
use crate::config::RelayConfig;
use crate::error::{FatalReason, RelayError};
use crate::lsn::Lsn;
use crate::table::{OutboxTable, quote_ident};

mod create;

pub(super) use create::create_and_copy;

/// The relay's own memory of its slots (sql/006_relay_slots.sql, sql/007_relay_slots_timeline.sql,
/// sql/008_relay_slots_owner.sql).
const REMEMBERED_SQL: &str = "SELECT snapshot_completed_at IS NOT NULL AS copied, created_timeline, outbox_table \
                              FROM outbox_relay_slots WHERE slot_name = $1";
const FORGET_SQL: &str = "DELETE FROM outbox_relay_slots WHERE slot_name = $1";
/// The server's timeline, from the name of its current WAL file (pg_control_checkpoint() needs
/// more privilege than the relay has).
const CURRENT_TIMELINE_CTE: &str = "WITH current_timeline AS (SELECT ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::int AS timeline) ";
const DROP_SLOT_SQL: &str = "SELECT pg_drop_replication_slot($1)";

/// What the relay must do with the slot before streaming.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotPlan {
    /// The slot exists and is healthy: stream from its confirmed position (first making it a
    /// failover slot when `replication.failover` asks for it and it is not one).
    Stream { confirmed: Lsn, make_failover: bool },
    /// Create the slot and publish the rows already in the table first.
    Create,
}

/// The slot as `pg_replication_slots` shows it.
#[derive(Debug, Clone)]
pub struct SlotInfo {
    pub wal_status: Option<String>,
    pub confirmed_flush: Option<Lsn>,
    pub active_pid: Option<i32>,
    /// `failover` (PostgreSQL 17+; `None` before).
    pub failover: Option<bool>,
    /// `invalidation_reason` (PostgreSQL 17+): `wal_removed`, `idle_timeout`, ...
    pub invalidation_reason: Option<String>,
}

async fn slot_info(client: &Client, slot: &str) -> Result<Option<SlotInfo>, RelayError> {
    let row = client
        .query_opt(
            "SELECT wal_status, confirmed_flush_lsn::text AS confirmed_flush, active_pid, \
                    (to_jsonb(s) ->> 'failover')::boolean AS failover, \
                    to_jsonb(s) ->> 'invalidation_reason' AS invalidation_reason \
             FROM pg_replication_slots s WHERE slot_name = $1 AND database = current_database()",
            &[&slot],
        )
        .await?;
    Ok(row.map(|r| SlotInfo {
        wal_status: r.get("wal_status"),
        confirmed_flush: r.get::<_, Option<String>>("confirmed_flush").and_then(|s| Lsn::from_str(&s).ok()),
        active_pid: r.get("active_pid"),
        failover: r.get("failover"),
        invalidation_reason: r.get("invalidation_reason"),
    }))
}

/// Takes the slot's advisory lock for `client`'s session, or says another instance holds it
/// ([`RelayError::Standby`]). One instance at a time decides about, creates and copies the
/// slot: the lock is held for the whole replication session, so a standby can never drop a
/// slot whose first copy another instance is still making.
pub async fn lock(config: &RelayConfig, client: &Client) -> Result<(), RelayError> {
    let slot = &config.replication.slot;
    let locked: bool = client
        .query_one("SELECT pg_try_advisory_lock(hashtext('outbox-relay slot ' || $1))", &[slot])
        .await?
        .get(0);
    if !locked {
        return Err(RelayError::Standby(format!("slot \"{slot}\" is managed by another relay instance")));
    }
    Ok(())
}

/// With the slot's [`lock`] held: ensures the publication, inspects slot and memory, and
/// decides. With `recreate`, drops the slot and its memory first (the operator's explicit
/// choice after an invalidation).
pub async fn prepare(config: &RelayConfig, client: &Client, recreate: bool) -> Result<SlotPlan, RelayError> {
    let slot = &config.replication.slot;
    ensure_publication(config, client, recreate).await?;
    if config.replication.failover {
        failover_supported(client).await?;
    }
    if recreate {
        remembered(client, slot).await?;
        let info = slot_info(client, slot).await?;
        return recreate_slot(client, slot, info).await;
    }
    act(config, client, verdict(config, client).await?).await
}

async fn recreate_slot(client: &Client, slot: &str, info: Option<SlotInfo>) -> Result<SlotPlan, RelayError> {
    if let Some(info) = &info {
        if let Some(pid) = info.active_pid {
            return Err(RelayError::fatal(
                FatalReason::Other,
                format!(
                    "slot \"{slot}\" is in use by process {pid}: stop the other relay instances before --recreate-slot"
                ),
            ));
        }
        if lost_to_wal_removal(info) {
            keep_size_warning(client, slot).await;
        }
        client.execute(DROP_SLOT_SQL, &[&slot]).await?;
        tracing::warn!(%slot, "dropped the slot (--recreate-slot)");
    }
    client.execute(FORGET_SQL, &[&slot]).await?;
    Ok(SlotPlan::Create)
}

/// `max_slot_wal_keep_size` now, and whether it is certainly the value that lost the slot: the
/// configuration was not loaded again (a reload or a restart) since the slot was created, so the
/// value in force now was in force for the slot's whole life. `None` when it cannot be read.
const KEEP_SIZE_SQL: &str = "SELECT current_setting('max_slot_wal_keep_size'), \
     coalesce((SELECT created_at FROM outbox_relay_slots WHERE slot_name = $1) > pg_conf_load_time(), false)";

/// Before a slot lost to removed WAL is made again: warns when `max_slot_wal_keep_size` is
/// still the value that lost it (the new slot would be lost the same way), and says the value
/// otherwise.
async fn keep_size_warning(client: &Client, slot: &str) {
    let Ok(row) = client.query_one(KEEP_SIZE_SQL, &[&slot]).await else { return };
    let (size, unchanged): (String, bool) = (row.get(0), row.get(1));
    if size == "-1" {
        return;
    }
    if unchanged {
        tracing::warn!(
            %slot,
            max_slot_wal_keep_size = %size,
            "max_slot_wal_keep_size = {size} is still the value that lost the slot (the configuration was not \
             reloaded since the slot was created): the new slot will be lost the same way at the next outage that \
             long; raise it (ALTER SYSTEM SET max_slot_wal_keep_size = ...; SELECT pg_reload_conf()) to the WAL \
             rate times the longest relay outage to survive (docs/deployment.md, PostgreSQL: versions and settings)"
        );
    } else {
        tracing::info!(
            %slot,
            max_slot_wal_keep_size = %size,
            "the slot was lost to removed WAL; max_slot_wal_keep_size is now {size} (the configuration was \
             reloaded since the slot was created): if that is still the value that lost it, raise it"
        );
    }
}

/// What the relay makes of the slot and its memory of it, read without changing anything:
/// `run` and `setup` act on it ([`prepare`]), and `check` reports it, so `check` sees exactly
/// what they will do.
#[derive(Debug)]
pub(crate) enum Verdict {
    /// The slot is there and usable: stream from it.
    Stream(SlotInfo),
    /// The slot is there but its first copy never finished: it is dropped and made again.
    Recopy(SlotInfo),
    /// No slot, and none this relay published from: it is created (`forget`: the memory of a
    /// slot whose first copy never finished is removed first).
    Create { forget: bool },
    /// `run` and `setup` stop: the slot was lost, or is gone after the relay published from it,
    /// or may not be created.
    Refused(Refusal),
}

/// The slot and the relay's memory of it, judged (see [`Verdict`]).
pub(crate) async fn verdict(config: &RelayConfig, client: &Client) -> Result<Verdict, RelayError> {
    let slot = &config.replication.slot;
    let remembered = remembered(client, slot).await?;
    let info = slot_info(client, slot).await?;
    Ok(match (info, remembered) {
        (Some(info), _) if info.wal_status.as_deref() == Some("lost") => {
            Verdict::Refused(lost_slot(slot, &info))
        }
        (Some(info), Some(false)) => Verdict::Recopy(info),
        (Some(info), _) => Verdict::Stream(info),
        (None, Some(true)) => Verdict::Refused(match promoted_since(client, slot).await? {
            Some((created, now)) => failover_without_slot(slot, created, now),
            None => missing_slot(slot),
        }),
        (None, _) if !config.replication.create_slot => Verdict::Refused(Refusal {
            reason: FatalReason::SlotMissing,
            problem: format!("slot \"{slot}\" does not exist and replication.create_slot = false"),
            fix: "create it with `outbox-relay setup` or set replication.create_slot = true".into(),
        }),
        (None, remembered) => Verdict::Create { forget: remembered == Some(false) },
    })
}

/// Does what the verdict says.
async fn act(config: &RelayConfig, client: &Client, verdict: Verdict) -> Result<SlotPlan, RelayError> {
    let slot = &config.replication.slot;
    match verdict {
        Verdict::Refused(refusal) => Err(refusal.error()),
        Verdict::Recopy(info) => {
            tracing::warn!(%slot, "the first copy of pre-existing rows did not finish: recreating the slot and copying again");
            if let Some(pid) = info.active_pid {
                return Err(RelayError::Standby(format!("slot \"{slot}\" is active for PID {pid}")));
            }
            client.execute(DROP_SLOT_SQL, &[slot]).await?;
            client.execute(FORGET_SQL, &[slot]).await?;
            Ok(SlotPlan::Create)
        }
        Verdict::Stream(info) => Ok(SlotPlan::Stream {
            confirmed: info.confirmed_flush.unwrap_or_default(),
            make_failover: config.replication.failover && info.failover == Some(false),
        }),
        Verdict::Create { forget } => {
            if forget {
                client.execute(FORGET_SQL, &[slot]).await?;
            }
            Ok(SlotPlan::Create)
        }
    }
}

/// The slot this relay published from is gone, on the timeline it was created on.
fn missing_slot(slot: &str) -> Refusal {
    Refusal {
        reason: FatalReason::SlotMissing,
        problem: format!(
            "slot \"{slot}\" is missing, but this relay published from it before (outbox_relay_slots remembers \
             it): events committed since it disappeared may never have been published"
        ),
        fix: "run `outbox-relay setup --recreate-slot` to create it again and re-publish what the table still \
              holds (after a switch to polling mode and back, whose polling relay published them, this is the \
              step that starts replication mode again: docs/operations.md, \"Switching source modes\")"
            .into(),
    }
}

/// The slot is gone because the server is a standby promoted without a copy of it.
fn failover_without_slot(slot: &str, created: i32, now: i32) -> Refusal {
    Refusal {
        reason: FatalReason::FailoverWithoutSlot,
        problem: format!(
            "failover without a failover slot: slot \"{slot}\" is missing because this server is a promoted \
             standby (timeline {now}, the slot was created on timeline {created}) that had no copy of it; events \
             committed before the promotion may not all have been published, and events published may be \
             missing here"
        ),
        fix: "run `outbox-relay setup --recreate-slot` (it re-publishes what the table holds: consumers \
              deduplicate by id), and use failover slots (PostgreSQL 17+, replication.failover = true, docs/operations.md, \
              \"Failover\") so the next promotion keeps the slot"
            .into(),
    }
}

/// The slot was invalidated, with what PostgreSQL says caused it.
fn lost_slot(slot: &str, info: &SlotInfo) -> Refusal {
    let (cause, fix) = match info.invalidation_reason.as_deref() {
        Some("idle_timeout") => (
            "it was idle longer than idle_replication_slot_timeout",
            "raise idle_replication_slot_timeout (or set it to 0)",
        ),
        Some("rows_removed") => (
            "rows it needed were vacuumed away on the primary while this server was a standby",
            "set hot_standby_feedback = on and primary_slot_name on the standbys",
        ),
        _ => ("PostgreSQL removed WAL the relay had not read", "raise max_slot_wal_keep_size"),
    };
    Refusal {
        reason: FatalReason::SlotLost,
        problem: format!(
            "slot \"{slot}\" was invalidated (wal_status = lost, invalidation_reason = {}): {cause}, so events \
             written while it was behind are gone from the stream",
            info.invalidation_reason.as_deref().unwrap_or("not reported before PostgreSQL 17")
        ),
        fix: format!(
            "{fix}, then run `outbox-relay setup --recreate-slot` to recreate the slot and re-publish what the \
             table still holds"
        ),
    }
}

/// Whether a slot lost this way was lost to `max_slot_wal_keep_size` (PostgreSQL 17+ says
/// `wal_removed`; before, removed WAL is the cause on a primary).
fn lost_to_wal_removal(info: &SlotInfo) -> bool {
    info.wal_status.as_deref() == Some("lost")
        && matches!(info.invalidation_reason.as_deref(), None | Some("wal_removed"))
}

/// `Some((timeline the slot was created on, the server's timeline now))` when the server has
/// moved to a later timeline since: it was promoted (or restored) after the slot was made.
async fn promoted_since(client: &Client, slot: &str) -> Result<Option<(i32, i32)>, RelayError> {
    let row = client
        .query_opt(
            &format!(
                "{CURRENT_TIMELINE_CTE}SELECT created_timeline, (SELECT timeline FROM current_timeline) AS now \
                 FROM outbox_relay_slots WHERE slot_name = $1"
            ),
            &[&slot],
        )
        .await?;
    Ok(row.and_then(|r| match (r.get::<_, Option<i32>>(0), r.get::<_, i32>(1)) {
        (Some(created), now) if now > created => Some((created, now)),
        _ => None,
    }))
}

/// `replication.failover` needs failover slots: PostgreSQL 17 or newer.
async fn failover_supported(client: &Client) -> Result<(), RelayError> {
    match super::failover::unsupported(client).await? {
        Some(why) => Err(RelayError::fatal(
            FatalReason::Config,
            format!(
                "{why}: set replication.failover = false (docs/operations.md, Failover: what a promotion then means)"
            ),
        )),
        None => Ok(()),
    }
}

/// Makes an existing slot a failover slot, on the replication session before it streams.
pub(super) async fn make_failover(
    replication: &mut pgwire_replication::ReplicationClient,
    slot: &str,
) -> Result<(), RelayError> {
    replication
        .simple_query(&format!("ALTER_REPLICATION_SLOT {} (FAILOVER)", quote_ident(slot)))
        .await
        .map_err(|e| transport::in_context(transport::classify(e), Command::Alter, slot))?;
    tracing::info!(%slot, "made the slot a failover slot (replication.failover = true)");
    Ok(())
}

/// `Some(copy finished)` when the relay created this slot before, `None` when it never did.
async fn remembered(client: &Client, slot: &str) -> Result<Option<bool>, RelayError> {
    let row = client.query_opt(REMEMBERED_SQL, &[&slot]).await.map_err(|e| match e.code() {
        Some(&tokio_postgres::error::SqlState::UNDEFINED_COLUMN) => RelayError::fatal(
            FatalReason::Schema,
            "table outbox_relay_slots lacks a column the relay writes: apply sql/007_relay_slots_timeline.sql and \
             sql/008_relay_slots_owner.sql",
        ),
        Some(&tokio_postgres::error::SqlState::UNDEFINED_TABLE) => RelayError::fatal(
            FatalReason::Schema,
            "table outbox_relay_slots does not exist: apply sql/006_relay_slots.sql (and grant it, sql/100_relay_role.sql)",
        ),
        _ => RelayError::Postgres(e),
    })?;
    Ok(row.map(|r| r.get("copied")))
}

/// Creates the publication when it is missing; with `recreate` (the slot is made again, and its
/// first copy publishes what every table holds), adds the outbox tables it lacks: an outbox
/// added to the configuration.
async fn ensure_publication(config: &RelayConfig, client: &Client, recreate: bool) -> Result<(), RelayError> {
    let publication = &config.replication.publication;
    let create = super::publication::create_sql(config);
    // a publication cannot take a table that does not exist: say that, not how to add it
    for outbox in config.outboxes() {
        let table = OutboxTable::of(&outbox.config, &config.polling);
        if !table.exists(client).await? {
            return Err(RelayError::fatal(FatalReason::Schema, missing_outbox(&outbox, &table)));
        }
    }
    let exists = client.query_opt("SELECT 1 FROM pg_publication WHERE pubname = $1", &[publication]).await?;
    if exists.is_none() {
        if !config.replication.create_publication {
            return Err(RelayError::fatal(
                FatalReason::Publication,
                format!(
                    "publication \"{publication}\" does not exist and replication.create_publication = false: {create}"
                ),
            ));
        }
        if let Some(refusal) = super::publication::creation_refusal(config, client).await? {
            return Err(refusal.error());
        }
        client.batch_execute(&create).await?;
        tracing::info!(%publication, "created the publication: {create}");
    } else if recreate {
        add_missing_tables(config, client).await?;
    }
    match super::publication::problem(config, client).await? {
        None => Ok(()),
        Some(problem) => Err(RelayError::fatal(problem.reason(), problem.to_string())),
    }
}

/// Adds to the publication the outbox tables it lacks (before the slot is made again).
async fn add_missing_tables(config: &RelayConfig, client: &Client) -> Result<(), RelayError> {
    let publication = &config.replication.publication;
    for outbox in config.outboxes() {
        let table = OutboxTable::of(&outbox.config, &config.polling);
        let listed = client
            .query_opt(
                "SELECT 1 FROM pg_publication_tables WHERE pubname = $1 AND schemaname = $2 AND tablename = $3",
                &[publication, &table.schema, &table.name],
            )
            .await?;
        if listed.is_none() {
            client.batch_execute(&table.add_to_publication_sql(publication)).await?;
            tracing::info!(%publication, table = %table.display_name(), "added the outbox table to the publication");
        }
    }
    Ok(())
}

/// What to say when outbox `outbox`'s table does not exist: with several, which entry names it.
fn missing_outbox(outbox: &crate::config::OutboxEntry, table: &OutboxTable) -> String {
    match outbox.path.as_str() {
        "outbox" => table.missing_text(),
        path => format!(
            "{path} (\"{}\"): the outbox table {} does not exist: create it (sql/001_outbox_events.sql and the \
             migrations after it), or set {path}.schema / {path}.table to the table the application writes",
            outbox.name,
            table.display_name()
        ),
    }
}
