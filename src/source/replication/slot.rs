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
//!   is redone from scratch with a new slot.

use std::str::FromStr;

use futures::{StreamExt, pin_mut};
use tokio_postgres::Client;

use crate::config::RelayConfig;
use crate::error::RelayError;
use crate::event::Mapping;
use crate::position::Lsn;
use crate::sink::kafka::{KafkaSink, PublishError};
use crate::table::{OutboxTable, quote_ident, quote_literal, raw_event, select_events_sql};

/// Rows of the initial copy published (and awaited) together.
const COPY_CHUNK: usize = 2_000;

/// What the relay must do with the slot before streaming.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotPlan {
    /// The slot exists and is healthy: stream from its confirmed position.
    Stream,
    /// Create the slot and publish the rows already in the table first.
    Create,
}

/// The slot as `pg_replication_slots` shows it.
#[derive(Debug, Clone)]
pub struct SlotInfo {
    pub wal_status: Option<String>,
    pub confirmed_flush: Option<Lsn>,
    pub active_pid: Option<i32>,
}

pub async fn slot_info(client: &Client, slot: &str) -> Result<Option<SlotInfo>, RelayError> {
    let row = client
        .query_opt(
            "SELECT wal_status, confirmed_flush_lsn::text, active_pid FROM pg_replication_slots \
             WHERE slot_name = $1 AND database = current_database()",
            &[&slot],
        )
        .await?;
    Ok(row.map(|r| SlotInfo {
        wal_status: r.get(0),
        confirmed_flush: r.get::<_, Option<String>>(1).and_then(|s| Lsn::from_str(&s).ok()),
        active_pid: r.get(2),
    }))
}

/// Ensures the publication, inspects slot and memory, and decides. With `recreate`, drops the
/// slot and its memory first (the operator's explicit choice after an invalidation).
pub async fn prepare(config: &RelayConfig, client: &Client, recreate: bool) -> Result<SlotPlan, RelayError> {
    let slot = &config.replication.slot;
    // One instance at a time decides about, creates and copies the slot: the session-level
    // advisory lock is held by `client` for the whole replication session, so a standby can
    // never drop a slot whose first copy another instance is still making.
    let locked: bool = client
        .query_one("SELECT pg_try_advisory_lock(hashtext('outbox-relay slot ' || $1))", &[slot])
        .await?
        .get(0);
    if !locked {
        return Err(RelayError::SlotInUse(format!("slot \"{slot}\" is managed by another relay instance")));
    }
    ensure_publication(config, client).await?;
    let remembered = remembered(client, slot).await?;
    let info = slot_info(client, slot).await?;
    if recreate {
        if let Some(info) = &info {
            if let Some(pid) = info.active_pid {
                return Err(RelayError::Fatal(format!(
                    "slot \"{slot}\" is in use by process {pid}: stop the other relay instances before --recreate-slot"
                )));
            }
            client.execute("SELECT pg_drop_replication_slot($1)", &[slot]).await?;
            tracing::warn!(%slot, "dropped the slot (--recreate-slot)");
        }
        client.execute("DELETE FROM outbox_relay_slots WHERE slot_name = $1", &[slot]).await?;
        return Ok(SlotPlan::Create);
    }
    match (info, remembered) {
        (Some(info), _) if info.wal_status.as_deref() == Some("lost") => Err(RelayError::Fatal(format!(
            "slot \"{slot}\" was invalidated (wal_status=lost): PostgreSQL removed WAL the relay had not \
             read, so events written while it was behind are gone from the stream; raise \
             max_slot_wal_keep_size, then run `outbox-relay setup --recreate-slot` to recreate the slot and \
             re-publish what the table still holds"
        ))),
        (Some(_), Some(false)) => {
            tracing::warn!(%slot, "the first copy of pre-existing rows did not finish: recreating the slot and copying again");
            if let Some(pid) = slot_info(client, slot).await?.and_then(|i| i.active_pid) {
                return Err(RelayError::SlotInUse(format!("slot \"{slot}\" is active for PID {pid}")));
            }
            client.execute("SELECT pg_drop_replication_slot($1)", &[slot]).await?;
            client.execute("DELETE FROM outbox_relay_slots WHERE slot_name = $1", &[slot]).await?;
            Ok(SlotPlan::Create)
        }
        (Some(_), _) => Ok(SlotPlan::Stream),
        (None, Some(true)) => Err(RelayError::Fatal(format!(
            "slot \"{slot}\" is missing, but this relay published from it before: events committed since it \
             disappeared may never have been published; run `outbox-relay setup --recreate-slot` to create it \
             again and re-publish what the table still holds"
        ))),
        (None, _) if !config.replication.create_slot => Err(RelayError::Fatal(format!(
            "slot \"{slot}\" does not exist and replication.create_slot = false: create it with \
             `outbox-relay setup` or set replication.create_slot = true"
        ))),
        (None, Some(false)) => {
            client.execute("DELETE FROM outbox_relay_slots WHERE slot_name = $1", &[slot]).await?;
            Ok(SlotPlan::Create)
        }
        (None, None) => Ok(SlotPlan::Create),
    }
}

/// `Some(copy finished)` when the relay created this slot before, `None` when it never did.
async fn remembered(client: &Client, slot: &str) -> Result<Option<bool>, RelayError> {
    let row = client
        .query_opt("SELECT snapshot_completed_at IS NOT NULL FROM outbox_relay_slots WHERE slot_name = $1", &[&slot])
        .await
        .map_err(|e| match e.code() {
            Some(&tokio_postgres::error::SqlState::UNDEFINED_TABLE) => RelayError::Fatal(
                "table outbox_relay_slots does not exist: apply sql/006_relay_slots.sql (and grant it, sql/100_relay_role.sql)"
                    .into(),
            ),
            _ => RelayError::Postgres(e),
        })?;
    Ok(row.map(|r| r.get(0)))
}

async fn ensure_publication(config: &RelayConfig, client: &Client) -> Result<(), RelayError> {
    let publication = &config.replication.publication;
    let table = OutboxTable::new(&config.outbox);
    let exists = client.query_opt("SELECT 1 FROM pg_publication WHERE pubname = $1", &[publication]).await?;
    if exists.is_none() {
        if !config.replication.create_publication {
            return Err(RelayError::Fatal(format!(
                "publication \"{publication}\" does not exist and replication.create_publication = false: \
                 CREATE PUBLICATION {} FOR TABLE {} WITH (publish = 'insert', publish_via_partition_root = true)",
                quote_ident(publication),
                table.qualified()
            )));
        }
        let sql = format!(
            "CREATE PUBLICATION {} FOR TABLE {} WITH (publish = 'insert', publish_via_partition_root = true)",
            quote_ident(publication),
            table.qualified()
        );
        client.batch_execute(&sql).await.map_err(|e| match e.code() {
            Some(&tokio_postgres::error::SqlState::INSUFFICIENT_PRIVILEGE) => RelayError::Fatal(format!(
                "cannot create publication \"{publication}\": only the owner of {} may; run `{sql}` as the owner \
                 (or `outbox-relay setup` with the owner's credentials)",
                table.display_name()
            )),
            _ => RelayError::Postgres(e),
        })?;
        tracing::info!(%publication, table = %table.display_name(), "created the publication");
    }
    let published = client
        .query_opt(
            "SELECT 1 FROM pg_publication_tables WHERE pubname = $1 AND schemaname = $2 AND tablename = $3",
            &[publication, &table.schema, &table.name],
        )
        .await?;
    if published.is_none() {
        return Err(RelayError::Fatal(format!(
            "publication \"{publication}\" does not include {}: ALTER PUBLICATION {} ADD TABLE {}",
            table.display_name(),
            quote_ident(publication),
            table.qualified()
        )));
    }
    Ok(())
}

/// Creates the slot on the (not yet streaming) replication session, remembers it, and
/// publishes the rows visible in its exported snapshot. Returns the slot's consistent point.
pub async fn create_and_copy(
    config: &RelayConfig,
    replication: &mut pgwire_replication::ReplicationClient,
    client: &Client,
    copy_client: &mut Client,
    sink: &KafkaSink,
    mapping: &Mapping,
) -> Result<Lsn, RelayError> {
    let slot = &config.replication.slot;
    let rows = replication
        .simple_query(&format!(
            "CREATE_REPLICATION_SLOT {} LOGICAL pgoutput EXPORT_SNAPSHOT",
            quote_ident(slot)
        ))
        .await
        .map_err(super::transport::classify)?;
    let row =
        rows.first().ok_or_else(|| RelayError::Fatal("CREATE_REPLICATION_SLOT returned no row".into()))?;
    let text = |i: usize| row.get(i).cloned().flatten().map(|b| String::from_utf8_lossy(&b).into_owned());
    let consistent_point: Lsn = text(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| RelayError::Fatal("CREATE_REPLICATION_SLOT returned no consistent point".into()))?;
    let snapshot =
        text(2).ok_or_else(|| RelayError::Fatal("CREATE_REPLICATION_SLOT exported no snapshot".into()))?;
    client
        .execute(
            "INSERT INTO outbox_relay_slots (slot_name, created_lsn) VALUES ($1, $2::text::pg_lsn)",
            &[slot, &consistent_point.to_string()],
        )
        .await?;
    tracing::info!(%slot, %consistent_point, "created the slot; publishing the rows already in the table");
    let copied = copy_snapshot(config, client, copy_client, &snapshot, sink, mapping).await?;
    client
        .execute("UPDATE outbox_relay_slots SET snapshot_completed_at = now() WHERE slot_name = $1", &[slot])
        .await?;
    tracing::info!(%slot, rows = copied, "pre-existing rows published; streaming from the slot");
    Ok(consistent_point)
}

async fn copy_snapshot(
    config: &RelayConfig,
    dead_letters: &Client,
    client: &mut Client,
    snapshot: &str,
    sink: &KafkaSink,
    mapping: &Mapping,
) -> Result<u64, RelayError> {
    let tx = client
        .build_transaction()
        .isolation_level(tokio_postgres::IsolationLevel::RepeatableRead)
        .read_only(true)
        .start()
        .await?;
    tx.batch_execute(&format!("SET TRANSACTION SNAPSHOT {}", quote_literal(snapshot))).await?;
    let order = format!("ORDER BY t.{}", quote_ident(&config.outbox.columns.id));
    let rows = tx.query_raw(&select_events_sql(&config.outbox, &order), std::iter::empty::<i32>()).await?;
    pin_mut!(rows);
    let mut copied = 0u64;
    let mut chunk = Vec::with_capacity(COPY_CHUNK);
    loop {
        let next = rows.next().await.transpose()?;
        if let Some(row) = &next {
            let (raw, created_at) = raw_event(row);
            let id = raw.id.clone().unwrap_or_default();
            match mapping.to_event(raw.clone(), created_at) {
                Ok(event) => chunk.push(event),
                Err(reason) => {
                    super::poison(config, dead_letters, &id, raw.to_json(), &reason.to_string()).await?
                }
            }
        }
        if chunk.len() == COPY_CHUNK || (next.is_none() && !chunk.is_empty()) {
            for (event, result) in chunk.iter().zip(sink.publish(&chunk).await) {
                match result {
                    Ok(_) => copied += 1,
                    Err(PublishError::Permanent(reason)) => {
                        super::poison(config, dead_letters, &event.id, event.to_json(), &reason).await?;
                    }
                    Err(PublishError::Transient { detail, .. }) => return Err(RelayError::Kafka(detail)),
                }
            }
            chunk.clear();
        }
        if next.is_none() {
            break;
        }
    }
    tx.commit().await?;
    Ok(copied)
}
