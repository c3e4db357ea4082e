//! The first copy of a new slot: the rows of the slot's exported snapshot, published in id
//! order through the delivery stage, chunk by chunk, before the slot is streamed from.
//!
//! Invariants:
//! - the copy reads in the snapshot the slot was created with, so it and the stream together
//!   see every row exactly once: the rows committed before the slot's consistent point here,
//!   the later ones in the stream;
//! - each chunk (at most 2,000 rows, and at most `replication.max_in_flight_bytes` of records
//!   but for the row that reached it) is awaited whole (every record settled) before the next
//!   is read, and what
//!   precedes an unpublishable row settles before it; a held row or record (`on_poison =
//!   "block"`) holds the copy until Kafka takes it, or, for a row that cannot map, until
//!   shutdown (the copy is then done again by the next session);
//! - a row's position is its place in the copy (`copy:<point>:<index>`), so a copy done again
//!   numbers every row the same way;
//! - with `[tracing]` on, each table's copy makes a `first copy` span, from the start of the
//!   table's copy to its end (or failure), linked to the publish spans of the records it sent
//!   (the work-span sampling rule, [`crate::observe::trace::Work`]).

use std::time::{Instant, SystemTime};

use futures::{StreamExt, pin_mut};
use tokio::sync::watch;
use tokio_postgres::Client;

use crate::config::{Endpoint, PostgresConfig};
use crate::dead_letter::{DeadLetter, DeadLetters};
use crate::delivery::{Delivery, Settled};
use crate::error::RelayError;
use crate::lsn::Lsn;
use crate::observe::metrics::Clock;
use crate::observe::trace::{Value, Work, tracer};
use crate::published::{Recorder, Sent};
use crate::record::{Mapping, OutboxRow, Position};
use crate::sink::Sink;
use crate::table::{OutboxTable, outbox_row, quote_literal};

use super::MODE;

/// Rows of the initial copy published (and awaited) together.
const COPY_CHUNK: usize = 2_000;

/// When a chunk of the copy is full: at this many records, or bytes of them, in flight.
#[derive(Debug, Clone, Copy)]
struct Chunk {
    rows: usize,
    bytes: usize,
}

/// What a first copy did with the rows of its snapshot.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct CopyReport {
    /// Rows whose records Kafka acknowledged.
    pub published: u64,
    /// Rows the topics held already (an interrupted copy, the slot's previous life): not sent.
    pub already_in_kafka: u64,
    /// Rows that cannot be published, moved to the dead-letter table.
    pub dead_lettered: u64,
    /// Rows the outbox's transforms filter out: not sent.
    pub filtered: u64,
}

impl CopyReport {
    /// Adds what the copy of another table did.
    pub fn add(&mut self, other: CopyReport) {
        self.published += other.published;
        self.already_in_kafka += other.already_in_kafka;
        self.dead_lettered += other.dead_lettered;
        self.filtered += other.filtered;
    }
}

/// The first copy: the rows of the slot's snapshot, published in id order.
pub(super) struct FirstCopy<'a> {
    /// The slot and the outbox, for the copy's span.
    pub(super) slot: &'a str,
    pub(super) outbox: &'a str,
    pub(super) postgres: &'a PostgresConfig,
    /// The server whose replication session exported the snapshot: only it knows the snapshot.
    pub(super) server: &'a Endpoint,
    pub(super) table: &'a OutboxTable,
    pub(super) mapping: &'a Mapping,
    pub(super) dead_letters: &'a DeadLetters,
    /// Where dead letters and published ids are written (the copy's own session is read-only).
    pub(super) letters_to: &'a Client,
    pub(super) recorder: &'a Recorder,
    /// The slot's consistent point, in each record's position.
    pub(super) point: Lsn,
    /// `replication.max_in_flight_bytes`: a chunk ends at this many bytes of records.
    pub(super) chunk_bytes: usize,
}

impl FirstCopy<'_> {
    /// Publishes the rows of `snapshot` through `delivery`, whose read-back knows the rows the
    /// topics already hold (from an interrupted copy, or the slot's previous life).
    pub(super) async fn run<S: Sink>(
        &self,
        snapshot: &str,
        delivery: Delivery<'_, S, u64>,
        shutdown: &mut watch::Receiver<bool>,
    ) -> Result<CopyReport, RelayError> {
        let span_start = tracer().map(|_| SystemTime::now());
        let chunk = Chunk { rows: COPY_CHUNK, bytes: self.chunk_bytes };
        let mut copying = Copying::new(delivery, self.mapping, self.point, chunk);
        let copied = self.copy(snapshot, &mut copying, shutdown).await;
        if let Some(start) = span_start {
            self.span(start, &mut copying, copied.as_ref().err());
        }
        copied.map(|()| copying.report)
    }

    /// The copy's span (see the module doc), `failed` or not.
    fn span<S: Sink>(&self, start: SystemTime, copying: &mut Copying<'_, S>, failed: Option<&RelayError>) {
        let Some(tracer) = tracer() else { return };
        let report = copying.report;
        let count = |n: u64| Value::Int(n as i64);
        let attributes = vec![
            ("outbox_relay.mode", Value::from(MODE.label())),
            ("outbox_relay.slot", self.slot.into()),
            ("outbox_relay.outbox", self.outbox.into()),
            ("outbox_relay.table", self.table.display_name().into()),
            ("outbox_relay.lsn", self.point.to_string().into()),
            ("outbox_relay.rows", count(copying.index)),
            ("outbox_relay.published", count(report.published)),
            ("outbox_relay.already_in_kafka", count(report.already_in_kafka)),
            ("outbox_relay.dead_lettered", count(report.dead_lettered)),
            ("outbox_relay.filtered", count(report.filtered)),
        ];
        let links = copying.delivery.take_carried();
        let error = failed.map(ToString::to_string);
        tracer.work(Work { name: "first copy", start, links, attributes, error });
    }

    /// Publishes the rows of `snapshot` through `copying`.
    async fn copy<S: Sink>(
        &self,
        snapshot: &str,
        copying: &mut Copying<'_, S>,
        shutdown: &mut watch::Receiver<bool>,
    ) -> Result<(), RelayError> {
        let mut client = crate::postgres::connect_to(self.postgres, self.server).await?;
        let tx = client
            .build_transaction()
            .isolation_level(tokio_postgres::IsolationLevel::RepeatableRead)
            .read_only(true)
            .start()
            .await?;
        tx.batch_execute(&format!("SET TRANSACTION SNAPSHOT {}", quote_literal(snapshot))).await?;
        let encoding: String = tx.query_one(OutboxTable::SERVER_ENCODING_SQL, &[]).await?.get(0);
        let table = self.table.clone().for_server_encoding(&encoding);
        let rows = tx.query_raw(&table.copy_sql(), std::iter::empty::<i32>()).await?;
        pin_mut!(rows);
        loop {
            let next = rows.next().await.transpose()?;
            if let Some(row) = &next {
                let (raw, created_at) = outbox_row(row)?;
                copying.row(raw, created_at, shutdown).await?;
            }
            let chunk_done = next.is_none() || copying.sent.len() >= COPY_CHUNK;
            if chunk_done {
                copying.settle(shutdown).await?;
            }
            self.write(&mut copying.letters).await?;
            if chunk_done {
                // before the copy is marked done (the caller), every id Kafka acknowledged is recorded
                self.recorder.record(self.letters_to, &std::mem::take(&mut copying.sent)).await?;
            }
            if next.is_none() {
                break;
            }
        }
        tx.commit().await?;
        Ok(())
    }

    /// Writes `letters` to the dead-letter table (committed at once: the copy's own session is
    /// read-only), and empties it.
    async fn write(&self, letters: &mut Vec<DeadLetter>) -> Result<(), RelayError> {
        if !letters.is_empty() {
            self.dead_letters.write_committed(self.letters_to, letters).await?;
            letters.clear();
        }
        Ok(())
    }
}

/// The copy's rows through the delivery stage, apart from PostgreSQL (the snapshot's rows and
/// the dead-letter table are [`FirstCopy`]'s), so it is unit-tested against the scripted sink.
struct Copying<'a, S: Sink> {
    delivery: Delivery<'a, S, u64>,
    mapping: &'a Mapping,
    point: Lsn,
    /// Records in flight at most: a chunk is settled whole before the next row is read.
    chunk: Chunk,
    /// The place of the next row in the copy.
    index: u64,
    report: CopyReport,
    /// Dead letters to write, emptied by the caller.
    letters: Vec<DeadLetter>,
    /// Ids handed to Kafka (or found there), to record as published; emptied by the caller.
    sent: Sent,
}

impl<'a, S: Sink> Copying<'a, S> {
    fn new(delivery: Delivery<'a, S, u64>, mapping: &'a Mapping, point: Lsn, chunk: Chunk) -> Copying<'a, S> {
        let report = CopyReport::default();
        let (letters, sent) = (Vec::new(), Sent::default());
        Copying { delivery, mapping, point, chunk, index: 0, report, letters, sent }
    }

    /// Hands the next row over; settles the chunk when it is full, or held.
    async fn row(
        &mut self,
        raw: OutboxRow,
        created_at: Option<SystemTime>,
        shutdown: &mut watch::Receiver<bool>,
    ) -> Result<(), RelayError> {
        let index = self.index;
        self.index += 1;
        match self.mapping.to_record(raw, created_at)? {
            Ok(mut record) => {
                record.position = Some(Position::Copy { point: self.point, index });
                self.sent.add(&record.id, &record.topic);
                // settled at once when the topic holds it already, or (Kafka transactions) when
                // Kafka refused it in the transaction aborted before: dead-lettered
                match self.delivery.send(index, record, Instant::now()).await? {
                    Some(Settled::Acked(_)) => self.report.already_in_kafka += 1,
                    Some(settled) => count(settled, &mut self.report, &mut self.letters),
                    None => {}
                }
            }
            Err(refused) if refused.filtered_by().is_some() => {
                self.sent.add_filtered(refused.row.id.as_deref().unwrap_or_default());
                self.report.filtered += 1;
            }
            Err(unpublishable) => {
                // what precedes the row goes first
                self.settle(shutdown).await?;
                let settled = self.delivery.unpublishable(index, DeadLetter::unmapped(*unpublishable));
                count(settled, &mut self.report, &mut self.letters);
            }
        }
        let full = self.delivery.records() >= self.chunk.rows || self.delivery.bytes() >= self.chunk.bytes;
        if full || self.delivery.holding() {
            self.settle(shutdown).await?;
        }
        Ok(())
    }

    /// Settles everything handed over (see [`settle_all`]).
    async fn settle(&mut self, shutdown: &mut watch::Receiver<bool>) -> Result<(), RelayError> {
        settle_all(&mut self.delivery, &mut self.report, &mut self.letters, shutdown).await
    }
}

/// Waits until every record handed over is settled and nothing is held, counting in `report`
/// and collecting the dead letters to write in `letters`. Held at a row that cannot map, it
/// waits for shutdown: `Interrupted`.
async fn settle_all<S: Sink>(
    delivery: &mut Delivery<'_, S, u64>,
    report: &mut CopyReport,
    letters: &mut Vec<DeadLetter>,
    shutdown: &mut watch::Receiver<bool>,
) -> Result<(), RelayError> {
    while delivery.records() > 0 || delivery.holding() {
        if delivery.holding() && *shutdown.borrow() {
            return Err(RelayError::Interrupted);
        }
        tokio::select! {
            settled = delivery.next() => {
                if let Some(settled) = settled? {
                    count(settled, report, letters);
                }
            }
            _ = shutdown.changed(), if delivery.holding() => {}
        }
    }
    // with Kafka transactions, a chunk commits whole: what Kafka acknowledged settles now
    for settled in delivery.commit(&Clock::now()).await? {
        count(settled, report, letters);
    }
    Ok(())
}

/// Counts a settled row in `report`; its dead letter, if any, goes to `letters`.
fn count(settled: Settled<u64>, report: &mut CopyReport, letters: &mut Vec<DeadLetter>) {
    match settled {
        Settled::Acked(_) => report.published += 1,
        Settled::DeadLettered(_, letter) => {
            report.dead_lettered += 1;
            letters.push(*letter);
        }
        Settled::Held(_) => {}
    }
}

#[cfg(test)]
mod tests;
