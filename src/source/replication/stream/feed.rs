//! What the stream hands the delivery stage, and what it may confirm: the stream's decisions
//! apart from its connections (the WAL transport and the SQL session are [`super`]'s), so they
//! are unit-tested against the scripted sink.
//!
//! Invariants:
//! - each outbox event of a transaction goes to the stage with its transaction as its position;
//!   the transaction counts it once Kafka or the dead-letter table holds it ([`Tracker`]), and
//!   only the contiguous prefix of transactions so counted is confirmed;
//! - a dead letter is written before anything counts it: the session writes [`Feed::letters`],
//!   then calls [`Feed::letters_written`];
//! - reading stops while the stage holds, and while the records in flight reach either bound
//!   (`replication.max_in_flight_events`, `replication.max_in_flight_bytes`: a record may take
//!   the bytes over the budget; the next waits);
//! - events are numbered by their place among their outbox's events in their transaction,
//!   published or not, so a replay numbers them the same way, whatever other outboxes are
//!   listed (an outbox added to the configuration does not renumber the others' events);
//!   `outbox_emit()` messages are the first outbox's;
//! - with `replication.message_signing_key_file`, a transactional outbox message is published
//!   only when the key verifies its digest (`outbox_emit()` signed it); any other is
//!   dead-lettered unsigned in its transaction, never published;
//! - with Kafka transactions, a Kafka transaction commits between two PostgreSQL transactions
//!   once it is due (so a `read_committed` consumer sees each PostgreSQL transaction's events
//!   at once), and reading pauses there until it has; it commits inside one only when reading
//!   cannot go on anyway (a bound, a hold), so a PostgreSQL transaction larger than the bounds
//!   is split over Kafka transactions. Nothing is confirmed before its Kafka transaction
//!   commits; after a crash the read-back finds what committed, so no split loses or repeats.

use std::collections::BTreeMap;
use std::time::{Instant, SystemTime};

use prometheus::IntCounter;

use super::super::decode::{self, Change, Decoder, MessageKey};
use super::super::transport::WalEvent;
use super::super::{HEARTBEAT_PREFIX, MODE};
use crate::checkpoint::{Tracker, TxnId};
use crate::config::{OutboxId, PerOutbox, ReplicationConfig};
use crate::dead_letter::DeadLetter;
use crate::delivery::{Delivery, Settled};
use crate::error::{FatalReason, RelayError};
use crate::lsn::Lsn;
use crate::observe::metrics::{Clock, SkippedKind, metrics};
use crate::observe::trace::tracer;
use crate::outboxes::Outboxes;
use crate::published::Sent;
use crate::record::{OutboxRow, Position};
use crate::sink::Sink;

use super::traced::StreamSpans;

/// The transaction being read (between Begin and Commit).
#[derive(Debug, Clone, Copy)]
struct OpenTxn {
    id: TxnId,
    commit_lsn: Lsn,
    commit_time: SystemTime,
}

/// What a dead letter's transaction does once the letter is written.
enum Written {
    /// A refused record, or a row that cannot map: its transaction counts it as settled.
    Acked(TxnId),
    /// A non-transactional message: its own unit of the position, complete at `lsn`.
    Committed(TxnId, Lsn),
}

pub(in crate::source::replication) struct Feed<'a, S: Sink> {
    /// The path to Kafka: each record's position is its transaction.
    delivery: Delivery<'a, S, TxnId>,
    tracker: Tracker,
    decoder: Decoder,
    /// The key `outbox_emit()` signs with (`replication.message_signing_key_file`), or why it
    /// could not be read; `None`: messages are published unverified.
    message_key: Option<Result<MessageKey, String>>,
    /// Each outbox's mapping.
    outboxes: &'a Outboxes,
    replication: &'a ReplicationConfig,
    /// When the current turn of reading began: the send time of the records it hands over.
    turn_at: Instant,
    open: Option<OpenTxn>,
    /// Per outbox, the place of its next event in the open transaction (its position's index).
    next_index: PerOutbox<u32>,
    /// Dead letters to write before [`Feed::letters_written`], and what each then settles.
    letters: Vec<DeadLetter>,
    written: Vec<Written>,
    /// Ids handed to Kafka and not yet recorded as published (see [`crate::published`]), by
    /// their transaction's commit position: the session records those of the transactions it
    /// may confirm (so Kafka holds them), before it confirms a position past them.
    sent: PerOutbox<BTreeMap<Lsn, Sent>>,
    /// This mode's `events_read_total` (looked up once).
    read: IntCounter,
    /// The last turn of reading found nothing more to read: a Kafka transaction is due.
    pub(super) idle: bool,
    /// With `[tracing]` on: the session's spans, told of each event handed to Kafka.
    pub(super) spans: Option<StreamSpans>,
}

impl<'a, S: Sink> Feed<'a, S> {
    /// A feed that confirmed `confirmed` already.
    pub(in crate::source::replication) fn new(
        delivery: Delivery<'a, S, TxnId>,
        confirmed: Lsn,
        outboxes: &'a Outboxes,
        replication: &'a ReplicationConfig,
    ) -> Feed<'a, S> {
        Feed {
            delivery,
            tracker: Tracker::new(confirmed),
            decoder: Decoder::new(outboxes.iter().map(|o| &o.config)),
            message_key: Some(&replication.message_signing_key_file)
                .filter(|file| !file.is_empty())
                .map(|file| MessageKey::read(file)),
            outboxes,
            replication,
            turn_at: Instant::now(),
            open: None,
            next_index: outboxes.per(|_| 0),
            letters: Vec::new(),
            written: Vec::new(),
            sent: outboxes.per(|_| BTreeMap::new()),
            read: metrics().events_read.with_label_values(&[MODE.label()]),
            idle: false,
            spans: tracer().map(|tracer| StreamSpans::new(tracer, &replication.slot, outboxes, confirmed)),
        }
    }

    /// Whether to read on: nothing is held, the records in flight are under both bounds, and
    /// no Kafka transaction waits to commit here.
    pub(super) fn reading(&self) -> bool {
        let commit_waits = self.open.is_none() && self.delivery.commit_due(self.idle);
        !self.bounded() && !commit_waits
    }

    /// Reading cannot go on: the stage holds, or the records in flight reach a bound (the
    /// event bound counts, with Kafka transactions, those acknowledged and not committed yet;
    /// the byte bound only those unacknowledged).
    fn bounded(&self) -> bool {
        let r = self.replication;
        self.delivery.holding()
            || self.tracker.in_flight_events() >= r.max_in_flight_events
            || self.delivery.bytes() >= r.max_in_flight_bytes
    }

    /// Whether the open Kafka transaction commits now: nothing is in flight, and it is due
    /// between two PostgreSQL transactions, or reading cannot go on before it commits.
    pub(super) fn commit_ready(&self) -> bool {
        self.delivery.in_transaction()
            && self.delivery.records() == 0
            && ((self.open.is_none() && self.delivery.commit_due(self.idle)) || self.bounded())
    }

    /// Commits the open Kafka transaction: its transactions count what Kafka acknowledged.
    pub(super) async fn commit(&mut self) -> Result<(), RelayError> {
        for settled in self.delivery.commit(&Clock::now()).await? {
            self.settled(settled);
        }
        Ok(())
    }

    /// A turn of reading begins: the records it hands over were sent now.
    pub(super) fn begin_turn(&mut self) {
        self.turn_at = Instant::now();
    }

    /// Handles one stream event; returns a position that may be confirmed now that nothing is
    /// in flight (a keepalive's or a heartbeat's).
    pub(super) async fn handle(&mut self, event: WalEvent) -> Result<Option<Lsn>, RelayError> {
        match event {
            WalEvent::Begin { commit_lsn, commit_time } => {
                self.open = Some(OpenTxn { id: self.tracker.begin(), commit_lsn, commit_time });
                self.next_index.values_mut().for_each(|next| *next = 0);
            }
            WalEvent::Commit { end_lsn } => {
                let txn =
                    self.open.take().ok_or_else(|| RelayError::Protocol("Commit without Begin".into()))?;
                self.tracker.commit(txn.id, end_lsn);
                metrics().received_lsn.set(end_lsn.0 as f64);
            }
            WalEvent::Data(data) => {
                match self.decoder.decode(&data).map_err(|e| RelayError::Protocol(e.to_string()))? {
                    Change::Insert(outbox, raw) => {
                        let at = self.next_event(outbox, "Insert outside a transaction")?;
                        self.publish(raw, at).await?;
                    }
                    Change::Relation => {}
                    Change::Skipped(kind) => {
                        metrics().stream_messages_skipped.with_label_values(&[kind.label()]).inc()
                    }
                    Change::OutboxRenamed { was, now } => return Err(outbox_renamed(&was, &now)),
                }
            }
            WalEvent::Message { transactional, lsn, prefix, content } => {
                return self.message(transactional, lsn, &prefix, &content).await;
            }
            WalEvent::Oversized { lsn, head, bytes } => self.oversized(lsn, &head, bytes)?,
            WalEvent::KeepAlive { wal_end } => {
                metrics().received_lsn.set(wal_end.0 as f64);
                if self.open.is_none() {
                    return Ok(self.tracker.idle_advance(wal_end));
                }
            }
        }
        Ok(None)
    }

    /// A logical decoding message: the relay's heartbeat, an outbox event, or someone else's.
    async fn message(
        &mut self,
        transactional: bool,
        lsn: Lsn,
        prefix: &str,
        content: &[u8],
    ) -> Result<Option<Lsn>, RelayError> {
        if prefix == HEARTBEAT_PREFIX && !transactional && self.open.is_none() {
            // Every transaction that committed before this record was streamed before it; with
            // none in flight, nothing before `lsn` is left to publish.
            metrics().received_lsn.set(lsn.0 as f64);
            return Ok(self.tracker.idle_advance(lsn));
        }
        if prefix != self.replication.message_prefix {
            metrics().stream_messages_skipped.with_label_values(&[SkippedKind::ForeignMessage.label()]).inc();
            return Ok(None);
        }
        let (raw, digest) = decode::message_event(content).unwrap_or_else(|reason| {
            tracing::warn!(%lsn, %reason, "an outbox message is not an event object");
            (OutboxRow::default(), None)
        });
        if transactional && self.open.is_some() {
            let at = self.next_event(OutboxId::default(), "a message outside a transaction")?;
            match self.forged(&raw, digest.as_deref())? {
                None => self.publish(raw, at).await?,
                Some(reason) => {
                    metrics()
                        .stream_messages_skipped
                        .with_label_values(&[SkippedKind::UntrustedMessage.label()])
                        .inc();
                    tracing::warn!(%lsn, event_id = ?raw.id, "an outbox message outbox_emit() did not sign is not published");
                    self.read.inc();
                    self.unpublishable(at.txn.id, DeadLetter::row(raw, reason).unsigned());
                }
            }
        } else {
            self.untrusted(raw, lsn);
        }
        Ok(None)
    }

    /// Why the transactional outbox message `raw` (with `digest`) is not one `outbox_emit()`
    /// signed, when `replication.message_signing_key_file` is set; `None` when it is, or unset.
    fn forged(&self, raw: &OutboxRow, digest: Option<&str>) -> Result<Option<String>, RelayError> {
        let key = match &self.message_key {
            None => return Ok(None),
            Some(Ok(key)) => key,
            Some(Err(why)) => return Err(RelayError::fatal(FatalReason::Config, why.clone())),
        };
        Ok(key.check(raw, digest).err().map(|why| {
            format!(
                "outbox message not signed by outbox_emit(): {why} (replication.message_signing_key_file); not \
                 published: anyone who may call pg_logical_emit_message can write one, naming any event id. Emit \
                 events with outbox_emit(), with the key installed in outbox_emit_key (sql/012_outbox_emit_signed.sql)"
            )
        }))
    }

    /// A change over `replication.max_message_bytes`, read only in part: an outbox row or an
    /// outbox message is dead-lettered by reference (its id, or its position, and its size: its
    /// content was never read) in its transaction; anything else is skipped, as it would be whole.
    fn oversized(&mut self, lsn: Lsn, head: &[u8], bytes: usize) -> Result<(), RelayError> {
        let limit = self.replication.max_message_bytes;
        let what = match self.decoder.oversized(head) {
            decode::Oversized::OutboxInsert { outbox, id } => {
                let event = id
                    .as_deref()
                    .map_or_else(|| "an outbox row".to_string(), |id| format!("outbox row {id}"));
                (outbox, OutboxRow { id, ..OutboxRow::default() }, event)
            }
            decode::Oversized::Message { transactional, prefix }
                if prefix == self.replication.message_prefix =>
            {
                if !transactional || self.open.is_none() {
                    self.untrusted(OutboxRow::default(), lsn);
                    return Ok(());
                }
                (OutboxId::default(), OutboxRow::default(), format!("an outbox message at {lsn}"))
            }
            decode::Oversized::Message { .. } => {
                tracing::warn!(%lsn, bytes, "a logical decoding message over replication.max_message_bytes, not the outbox's: skipped");
                metrics()
                    .stream_messages_skipped
                    .with_label_values(&[SkippedKind::ForeignMessage.label()])
                    .inc();
                return Ok(());
            }
            decode::Oversized::Other(kind) => {
                tracing::warn!(%lsn, bytes, kind = kind.label(), "a change over replication.max_message_bytes, not an outbox insert: skipped");
                metrics().stream_messages_skipped.with_label_values(&[kind.label()]).inc();
                return Ok(());
            }
        };
        let (outbox, raw, event) = what;
        tracing::warn!(%lsn, bytes, limit, "{event} is over replication.max_message_bytes: dead-lettered by reference");
        let reason = format!(
            "{event} is {bytes} bytes in the WAL, more than replication.max_message_bytes ({limit}): it was not \
             read (the relay would hold it several times over); dead-lettered by reference. Its row, if any, is \
             still in the outbox table: publish it by hand, or raise replication.max_message_bytes and the \
             memory limit with it"
        );
        let at = self.next_event(outbox, "a change outside a transaction")?;
        self.read.inc();
        self.unpublishable(at.txn.id, DeadLetter::row(raw, reason).in_outbox(outbox));
        Ok(())
    }

    /// An event of transaction `txn` that cannot be published: dead-lettered, counted in its
    /// transaction like a record sent (so the transaction is not complete, nor confirmed, before
    /// the letter is written), or held.
    fn unpublishable(&mut self, txn: TxnId, letter: DeadLetter) {
        match self.delivery.unpublishable(txn, letter) {
            Settled::DeadLettered(_, letter) => {
                self.tracker.sent(txn);
                self.letter(*letter, Written::Acked(txn));
            }
            held => self.settled(held),
        }
    }

    /// A non-transactional message with the outbox prefix: written even when its transaction
    /// rolls back, and by anyone who may call `pg_logical_emit_message`, so never published.
    /// It takes the dead-letter path, as its own unit of the position.
    fn untrusted(&mut self, raw: OutboxRow, lsn: Lsn) {
        metrics().stream_messages_skipped.with_label_values(&[SkippedKind::UntrustedMessage.label()]).inc();
        tracing::warn!(%lsn, event_id = ?raw.id, "a non-transactional outbox message is not published");
        let letter = DeadLetter::row(
            raw,
            "non-transactional outbox message: not published (it is written even when its transaction \
                     rolls back); emit events with outbox_emit() or pg_logical_emit_message(true, ...)"
                .into(),
        )
        .unsigned();
        // its own unit of the position; held like a row that cannot map: nothing after it is
        // read, nothing past it confirmed
        let txn = self.tracker.begin();
        if let Settled::DeadLettered(_, letter) = self.delivery.unpublishable(txn, letter) {
            self.letter(*letter, Written::Committed(txn, lsn));
        }
    }

    /// The open transaction's next event of outbox `outbox`, numbered (every event read counts,
    /// published or not, so a replay numbers them the same way); `outside`: the protocol error
    /// when no transaction is open.
    fn next_event(&mut self, outbox: OutboxId, outside: &str) -> Result<EventAt, RelayError> {
        let txn = self.open.ok_or_else(|| RelayError::Protocol(outside.into()))?;
        let index = self.next_index[outbox];
        self.next_index[outbox] += 1;
        Ok(EventAt { txn, outbox, index })
    }

    /// Publishes the event read `at`.
    async fn publish(&mut self, raw: OutboxRow, at: EventAt) -> Result<(), RelayError> {
        self.read.inc();
        let txn = at.txn;
        match self.outboxes[at.outbox].mapping.to_record(raw, Some(txn.commit_time))? {
            Ok(mut event) => {
                event.position = Some(Position::Stream { commit: txn.commit_lsn, index: at.index });
                self.tracker.sent(txn.id);
                self.sent[at.outbox].entry(txn.commit_lsn).or_default().add(&event.id, &event.topic);
                let settled = self.delivery.send(txn.id, event, self.turn_at).await?;
                if let Some(spans) = self.spans.as_mut() {
                    spans.sent(txn.commit_lsn, at.outbox, self.delivery.take_carried());
                }
                if let Some(settled) = settled {
                    self.settled(settled);
                }
            }
            // filtered out: nothing is sent, so its transaction owes Kafka nothing for it
            Err(refused) if refused.filtered_by().is_some() => {
                if let Some(id) = &refused.row.id {
                    self.sent[at.outbox].entry(txn.commit_lsn).or_default().add_filtered(id);
                }
                let name = &self.outboxes[at.outbox].name;
                metrics().outbox_events_filtered.with_label_values(&[name]).inc();
            }
            Err(unpublishable) => self.unpublishable(txn.id, DeadLetter::unmapped(*unpublishable)),
        }
        Ok(())
    }

    /// Waits for the stage's next step (an acknowledgement, the stall watch, a held record sent
    /// again, the open Kafka transaction come due: [`Delivery::next`]) and counts what it settled.
    /// Cancel-safe as [`Delivery::next`] is: nothing follows its await but counting.
    pub(super) async fn settle_next(&mut self) -> Result<(), RelayError> {
        if let Some(settled) = self.delivery.next().await? {
            self.settled(settled);
        }
        Ok(())
    }

    /// The stage, for a request served beside the stream ([`crate::delivery::live`]): its
    /// records settle no position of the stream's.
    pub(super) fn delivery(&mut self) -> &mut Delivery<'a, S, TxnId> {
        &mut self.delivery
    }

    /// Records handed to Kafka and not settled yet.
    pub(super) fn in_flight(&self) -> usize {
        self.delivery.records()
    }

    /// What a settled record means to the stream: its transaction counts it as acknowledged
    /// once Kafka or the dead-letter table holds it; a held one keeps its transaction open.
    fn settled(&mut self, settled: Settled<TxnId>) {
        match settled {
            Settled::Acked(txn) => self.tracker.acked(txn),
            Settled::DeadLettered(txn, letter) => self.letter(*letter, Written::Acked(txn)),
            Settled::Held(_) => {}
        }
    }

    fn letter(&mut self, letter: DeadLetter, then: Written) {
        self.letters.push(letter);
        self.written.push(then);
    }

    /// The dead letters to write now (committed), before [`Feed::letters_written`].
    pub(super) fn letters(&self) -> &[DeadLetter] {
        &self.letters
    }

    /// [`Feed::letters`] are written: their transactions count them.
    pub(super) fn letters_written(&mut self) {
        self.letters.clear();
        for written in self.written.drain(..) {
            match written {
                Written::Acked(txn) => self.tracker.acked(txn),
                Written::Committed(txn, lsn) => self.tracker.commit(txn, lsn),
            }
        }
    }

    /// The end of the contiguous prefix of settled transactions, when it moved.
    pub(super) fn advance(&mut self) -> Option<Lsn> {
        self.tracker.advance()
    }

    /// Whether events of transactions before `confirmed` wait to be recorded.
    pub(super) fn has_sent(&self, confirmed: Lsn) -> bool {
        self.sent.values().any(|by_commit| by_commit.keys().next().is_some_and(|commit| *commit < confirmed))
    }

    /// The events of the transactions a confirmation of `confirmed` covers (each settled: Kafka
    /// holds its records), not taken before, for the record of what was published. (A
    /// transaction's commit record starts before its end, the position confirmed after it; the
    /// next transaction's starts at or after that end.)
    pub(super) fn take_sent(&mut self, confirmed: Lsn) -> PerOutbox<Sent> {
        let take = |by_commit: &mut BTreeMap<Lsn, Sent>| {
            let later = by_commit.split_off(&confirmed);
            let covered = std::mem::replace(by_commit, later);
            covered.into_values().fold(Sent::default(), Sent::and)
        };
        self.sent.values_mut().map(take).collect()
    }

    /// The position the tracker would confirm.
    pub(super) fn confirmed(&self) -> Lsn {
        self.tracker.confirmed()
    }

    /// The in-flight gauges.
    pub(super) fn gauges(&self) {
        let m = metrics();
        m.events_in_flight.set(self.tracker.in_flight_events() as i64);
        m.bytes_in_flight.set(self.delivery.bytes() as i64);
        m.transactions_in_flight.set(self.tracker.open_transactions() as i64);
    }
}

/// Where an event was read: its transaction, its outbox and its place among that outbox's
/// events in the transaction.
#[derive(Debug, Clone, Copy)]
struct EventAt {
    txn: OpenTxn,
    outbox: OutboxId,
    index: u32,
}

fn outbox_renamed(was: &str, now: &str) -> RelayError {
    RelayError::fatal(
        FatalReason::OutboxChanged,
        format!(
            "the outbox table {was} is now {now} (renamed or moved while the relay streamed): its inserts \
             would no longer be recognised, so the relay stops without confirming past them; rename it back, \
             or set outbox.schema / outbox.table (or its [[outboxes]] entry's) to the new name and restart"
        ),
    )
}

#[cfg(test)]
mod tests;
