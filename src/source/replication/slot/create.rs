//! Creating the slot, and publishing the rows that predate it (the first copy).
//!
//! Invariants:
//! - the slot is remembered in `outbox_relay_slots`, copy unfinished, *before* it is created,
//!   so a slot that exists is never streamed from before the rows its copy owes are published;
//! - the copy reads the snapshot the slot exported, each outbox table in turn, so every row
//!   committed before the slot's consistent point is published by the copy and every later one
//!   by the stream;
//! - the copy is recorded as finished only after Kafka acknowledged every row of it.

use tokio::sync::watch;
use tokio_postgres::Client;

use super::super::copy::{CopyReport, FirstCopy};
use super::super::transport::{self, Command};
use super::super::{MODE, ReplicationSource};
use super::CURRENT_TIMELINE_CTE;
use crate::config::Endpoint;
use crate::delivery::{self, Delivery};
use crate::error::RelayError;
use crate::lsn::Lsn;
use crate::observe::pulse::Pulse;
use crate::readback::{self, Lookback};
use crate::sink::Sink;
use crate::table::quote_ident;

/// Written *before* the slot is created, copy unfinished: a slot that exists without its memory
/// would be streamed from its consistent point, and the rows the first copy owes never published.
const REMEMBER_SQL: &str = "INSERT INTO outbox_relay_slots (slot_name, created_lsn, created_timeline, outbox_table) \
     VALUES ($1, '0/0', (SELECT timeline FROM current_timeline), $2) \
     ON CONFLICT (slot_name) DO UPDATE SET created_lsn = '0/0', snapshot_completed_at = NULL, \
     created_timeline = EXCLUDED.created_timeline, outbox_table = EXCLUDED.outbox_table";
const CREATED_SQL: &str = "UPDATE outbox_relay_slots SET created_lsn = $2::text::pg_lsn WHERE slot_name = $1";
const COPIED_SQL: &str = "UPDATE outbox_relay_slots SET snapshot_completed_at = now() WHERE slot_name = $1";

/// Creates the slot on the (not yet streaming) replication session, remembers it, and
/// publishes the rows visible in its exported snapshot. Returns the slot's consistent point,
/// and what the copy did.
pub(in crate::source::replication) async fn create_and_copy<S: Sink>(
    source: (&ReplicationSource, &mut S),
    server: &Endpoint,
    replication: &mut pgwire_replication::ReplicationClient,
    client: &Client,
    pulse: &Pulse,
    shutdown: &mut watch::Receiver<bool>,
) -> Result<(Lsn, CopyReport), RelayError> {
    let slot = source.0.config.replication.slot.clone();
    let (consistent_point, snapshot) = create_slot(source.0, replication, client).await?;
    tracing::info!(%slot, %consistent_point, "created the slot; publishing the rows already in the table");
    let report =
        copy_outboxes(source, server, client, (consistent_point, &snapshot), pulse, shutdown).await?;
    client.execute(COPIED_SQL, &[&slot]).await?;
    let CopyReport { published, already_in_kafka, dead_lettered, filtered } = report;
    // `rows`: every row Kafka holds now (tests read this figure from the log)
    let rows = published + already_in_kafka;
    tracing::info!(%slot, rows, published, already_in_kafka, dead_lettered, filtered, "pre-existing rows published; streaming from the slot");
    Ok((consistent_point, report))
}

/// Remembers the slot, copy unfinished, then creates it exporting a snapshot, and records its
/// consistent point. Returns the consistent point and the exported snapshot's name.
async fn create_slot(
    source: &ReplicationSource,
    replication: &mut pgwire_replication::ReplicationClient,
    client: &Client,
) -> Result<(Lsn, String), RelayError> {
    let slot = &source.config.replication.slot;
    // (the first outbox's table: what polling mode's handover looks for)
    let owner = source.outboxes.first().table.display_name();
    client.execute(&format!("{CURRENT_TIMELINE_CTE}{REMEMBER_SQL}"), &[slot, &owner]).await?;
    // the option list is PostgreSQL 15+ syntax, FAILOVER 17+; the older form works everywhere
    let options =
        if source.config.replication.failover { "(SNAPSHOT 'export', FAILOVER)" } else { "EXPORT_SNAPSHOT" };
    let rows = replication
        .simple_query(&format!("CREATE_REPLICATION_SLOT {} LOGICAL pgoutput {options}", quote_ident(slot)))
        .await
        .map_err(|e| transport::in_context(transport::classify(e), Command::Create, slot))?;
    let row =
        rows.first().ok_or_else(|| RelayError::Protocol("CREATE_REPLICATION_SLOT returned no row".into()))?;
    let text = |i: usize| row.get(i).cloned().flatten().map(|b| String::from_utf8_lossy(&b).into_owned());
    let consistent_point: Lsn = text(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| RelayError::Protocol("CREATE_REPLICATION_SLOT returned no consistent point".into()))?;
    let snapshot =
        text(2).ok_or_else(|| RelayError::Protocol("CREATE_REPLICATION_SLOT exported no snapshot".into()))?;
    client.execute(CREATED_SQL, &[slot, &consistent_point.to_string()]).await?;
    Ok((consistent_point, snapshot))
}

/// Publishes the rows of every outbox table visible in the slot's exported `snapshot`, one
/// table after the other, each through a delivery session of its own that first reads back
/// everything the topics hold from this source.
async fn copy_outboxes<S: Sink>(
    (source, sink): (&ReplicationSource, &mut S),
    server: &Endpoint,
    client: &Client,
    (consistent_point, snapshot): (Lsn, &str),
    pulse: &Pulse,
    shutdown: &mut watch::Receiver<bool>,
) -> Result<CopyReport, RelayError> {
    // any row of the tables may be in the topics already (a copy that was interrupted, or the
    // slot recreated after it was lost): read back everything the topics hold from this source;
    // one outbox table after the other, each in the slot's snapshot
    let mut report = CopyReport::default();
    for outbox in source.outboxes.iter() {
        // the slot is this session's: it may fence earlier producers (kafka.transactional)
        let lookback = (MODE, Lookback::Everything);
        let identities = readback::source_identities(client, &source.config).await?;
        let prologue =
            delivery::prologue(sink, &identities, &source.config, lookback, pulse, shutdown).await?;
        let stage = (&source.dead_letters, &source.config.kafka);
        let delivery = Delivery::open(&*sink, prologue, stage, pulse, MODE).await;
        let copy = FirstCopy {
            slot: &source.config.replication.slot,
            outbox: &outbox.name,
            postgres: &source.config.postgres,
            server,
            table: &outbox.table,
            mapping: &outbox.mapping,
            dead_letters: &source.dead_letters,
            letters_to: client,
            recorder: outbox.recorder(client).await?,
            point: consistent_point,
            chunk_bytes: source.config.replication.max_in_flight_bytes,
        };
        report.add(copy.run(snapshot, delivery, shutdown).await?);
    }
    Ok(report)
}
