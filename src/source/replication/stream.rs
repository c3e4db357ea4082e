//! One streaming session: read the slot, publish, confirm what Kafka acknowledged.
//!
//! The loop is one biased `select!` with its branches numbered by priority: shutdown, then
//! acknowledgements (they free room and move the confirmed position), then the stream (only
//! while in-flight records are under the bound and nothing is held), then the timers.
//!
//! Records go to Kafka through the delivery stage ([`crate::delivery`]), each with its
//! transaction as its position; what this session keeps is the stream's own: the transactions
//! ([`Tracker`]), the bounds on what is in flight, the publication check, the confirmations.
//!
//! Holding (`dead_letter.on_poison = "block"`): reading stops at the unpublishable event. Records
//! already handed to Kafka still settle and their transactions are confirmed; the held
//! transaction and everything after it are not. The stage sends a refused record again at
//! backoff until Kafka takes it, and reports a row that cannot map at backoff until the relay
//! is restarted with another policy. The session is never ended for it, so nothing acknowledged
//! is sent again.

use std::time::{Duration, Instant, SystemTime};

use prometheus::IntCounter;
use tokio::sync::watch;
use tokio_postgres::Client;

use super::decode::{self, Change, Decoder};
use super::transport::{WalEvent, WalStream};
use super::{HEARTBEAT_PREFIX, MODE, ReplicationSource, publication};
use crate::checkpoint::{Tracker, TxnId};
use crate::dead_letter::DeadLetter;
use crate::delivery::record::{OutboxRow, Position};
use crate::delivery::{Delivery, Settled};
use crate::error::{FatalReason, RelayError};
use crate::lsn::Lsn;
use crate::observe::metrics::{Clock, SkippedKind, metrics};
use crate::observe::pulse::Pulse;
use crate::sink::dedup::Dedup;
use crate::sink::kafka::KafkaSink;
use crate::sink::{Report, Reports};

/// Stream events handled in one turn of the loop, at most, before reports are looked at again:
/// one clock read and one `select!` for the run instead of one per event.
const READ_TURN: usize = 128;
/// Delivery reports taken in one turn, at most (one clock read for the run).
const REPORT_TURN: usize = 256;

/// At shutdown, how long the last status update (sent at once) is given to leave before the
/// stream ends.
const STATUS_LEAVES: Duration = Duration::from_millis(200);

/// The transaction being read (between Begin and Commit).
#[derive(Debug, Clone, Copy)]
struct OpenTxn {
    id: TxnId,
    commit_lsn: Lsn,
    commit_time: SystemTime,
    /// The place of the next outbox event in the transaction (its position's index).
    next_index: u32,
}

pub(super) struct StreamSession<'a> {
    source: &'a ReplicationSource,
    client: &'a Client,
    wal: WalStream,
    tracker: Tracker,
    decoder: Decoder,
    /// The path to Kafka: each record's position is its transaction.
    delivery: Delivery<'a, KafkaSink, TxnId>,
    /// When the current turn of reading began: the send time of the records it hands over.
    turn_at: Instant,
    open: Option<OpenTxn>,
    /// The publication was checked to deliver every insert committed before this position.
    publication_ok_through: Lsn,
    /// The last position confirmed to PostgreSQL: never past `publication_ok_through`.
    confirmed: Lsn,
    /// This mode's `events_read_total` (looked up once).
    read: IntCounter,
}

impl<'a> StreamSession<'a> {
    pub(super) fn new(
        source: &'a ReplicationSource,
        client: &'a Client,
        pulse: &'a Pulse,
        wal: WalStream,
        confirmed: Lsn,
        dedup: Dedup,
    ) -> StreamSession<'a> {
        StreamSession {
            source,
            client,
            wal,
            tracker: Tracker::new(confirmed),
            decoder: Decoder::new(&source.config.outbox),
            delivery: Delivery::new(
                &source.sink,
                &source.dead_letters,
                &source.config.kafka,
                dedup,
                pulse,
                MODE,
            ),
            turn_at: Instant::now(),
            open: None,
            publication_ok_through: confirmed,
            confirmed,
            read: metrics().events_read.with_label_values(&[MODE.label()]),
        }
    }

    /// Streams until shutdown (`Ok`) or an error; ends the stream either way.
    pub(super) async fn run(mut self, shutdown: &mut watch::Receiver<bool>) -> Result<(), RelayError> {
        let result = self.stream(shutdown).await;
        self.wal.stop().await;
        result
    }

    async fn stream(&mut self, shutdown: &mut watch::Receiver<bool>) -> Result<(), RelayError> {
        // this session is the one sending: reports of earlier sessions' records are passed over
        let mut reports = self.delivery.reports().await;
        let mut batch = Vec::with_capacity(REPORT_TURN);
        self.publication_ok_through = publication::delivers_through(&self.source.config, self.client).await?;
        let first = tokio::time::Instant::now() + publication::CHECK_INTERVAL;
        let mut verify = tokio::time::interval_at(first, publication::CHECK_INTERVAL);
        verify.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let heartbeat_ms = self.source.config.replication.heartbeat_interval_ms;
        let mut stall_check = tokio::time::interval(self.delivery.stall_period());
        let mut heartbeat = tokio::time::interval(Duration::from_millis(heartbeat_ms.max(1)));
        heartbeat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let reading = self.reading();
            tokio::select! {
                biased;
                // 1. shutdown: stop reading, settle what is in flight, confirm it
                _ = shutdown.changed() => return self.drain(&mut reports).await,
                // 2. acknowledgements
                _ = reports.recv_many(&mut batch, REPORT_TURN), if self.delivery.records() > 0 => {
                    let clock = Clock::now();
                    for report in batch.drain(..) {
                        self.settle(report, &clock).await?;
                    }
                }
                // 3. the stream
                event = self.wal.recv(), if reading => {
                    let event = event?.ok_or_else(|| {
                        RelayError::Disconnected("the server ended the replication stream".into())
                    })?;
                    self.read_turn(event).await?;
                }
                // 4. liveness and the stall watch, at most every stall period (not per event); what
                //    waits is the records sent, not held ones
                _ = stall_check.tick() => self.delivery.check_stall(),
                // 5. heartbeat: a WAL record of our own, so an idle outbox in a busy database
                //    still sees positions it may confirm (see `message` below)
                _ = heartbeat.tick(), if heartbeat_ms > 0 => {
                    self.client.execute("SELECT pg_logical_emit_message(false, $1, '')", &[&HEARTBEAT_PREFIX]).await?;
                }
                // 6. the publication still delivers every insert: confirmations may go that far
                _ = verify.tick() => {
                    self.publication_ok_through = publication::delivers_through(&self.source.config, self.client).await?;
                    self.confirm(self.tracker.confirmed());
                }
                // 7. held: try the refused record again, or report the held row again
                _ = self.delivery.retry_due() => {
                    self.delivery.retry_held().await;
                }
            }
            self.confirm_acknowledged();
        }
    }

    /// Whether to read on: nothing is held, and the records in flight are under both bounds (a
    /// record may take the bytes over the budget; the next waits).
    fn reading(&self) -> bool {
        let r = &self.source.config.replication;
        !self.delivery.holding()
            && self.tracker.in_flight_events() < r.max_in_flight_events
            && self.delivery.bytes() < r.max_in_flight_bytes
    }

    /// Handles `first` and the events the transport has read already, up to [`READ_TURN`], as
    /// long as the bounds allow.
    async fn read_turn(&mut self, first: WalEvent) -> Result<(), RelayError> {
        self.turn_at = Instant::now();
        self.handle(first).await?;
        for _ in 1..READ_TURN {
            if !self.reading() {
                break;
            }
            match self.wal.try_recv() {
                Some(event) => self.handle(event?).await?,
                None => break,
            }
        }
        Ok(())
    }

    /// Shutdown: settle what is in flight, confirm it, give the status update time to leave.
    async fn drain(&mut self, reports: &mut Reports) -> Result<(), RelayError> {
        while self.delivery.records() > 0 {
            let report = reports.recv().await.expect("the sink holds a sender");
            self.settle(report, &Clock::now()).await?;
        }
        self.publication_ok_through = publication::delivers_through(&self.source.config, self.client).await?;
        // with nothing in flight the update is sent at once; the stream's end must not overtake it
        self.confirm_acknowledged();
        let interval = Duration::from_millis(self.source.config.replication.status_interval_ms);
        tokio::time::sleep(interval.min(STATUS_LEAVES)).await;
        Ok(())
    }

    fn confirm_acknowledged(&mut self) {
        if let Some(lsn) = self.tracker.advance() {
            tracing::trace!(%lsn, "confirmed");
            self.confirm(lsn);
        }
        let m = metrics();
        m.events_in_flight.set(self.tracker.in_flight_events() as i64);
        m.bytes_in_flight.set(self.delivery.bytes() as i64);
        m.transactions_in_flight.set(self.tracker.open_transactions() as i64);
    }

    /// Confirms `lsn` to PostgreSQL, as far as the publication was checked, and records it.
    /// With nothing in flight the status update leaves at once: the end of a run of records (a
    /// drain's last one, a quiet outbox) is not held back by the status interval. While records
    /// are in flight, updates go once per `replication.status_interval_ms`.
    fn confirm(&mut self, lsn: Lsn) {
        let lsn = lsn.min(self.publication_ok_through);
        if lsn <= self.confirmed {
            return;
        }
        self.confirmed = lsn;
        if self.delivery.records() == 0 {
            self.wal.confirm_now(lsn);
        } else {
            self.wal.confirm(lsn);
        }
        metrics().confirmed(lsn);
    }

    async fn handle(&mut self, event: WalEvent) -> Result<(), RelayError> {
        match event {
            WalEvent::Begin { commit_lsn, commit_time } => {
                self.open =
                    Some(OpenTxn { id: self.tracker.begin(), commit_lsn, commit_time, next_index: 0 });
            }
            WalEvent::Commit { end_lsn } => {
                let txn =
                    self.open.take().ok_or_else(|| RelayError::Protocol("Commit without Begin".into()))?;
                self.tracker.commit(txn.id, end_lsn);
                metrics().received_lsn.set(end_lsn.0 as f64);
            }
            WalEvent::Data(data) => {
                match self.decoder.decode(&data).map_err(|e| RelayError::Protocol(e.to_string()))? {
                    Change::Insert(raw) => {
                        let txn = self
                            .open
                            .as_mut()
                            .ok_or_else(|| RelayError::Protocol("Insert outside a transaction".into()))?;
                        let txn = next_event(txn);
                        self.publish(raw, txn).await?;
                    }
                    Change::Relation => {}
                    Change::Skipped(kind) => {
                        metrics().stream_messages_skipped.with_label_values(&[kind.label()]).inc()
                    }
                    Change::OutboxRenamed { now } => return Err(self.outbox_renamed(&now)),
                }
            }
            WalEvent::Message { transactional, lsn, prefix, content } => {
                self.message(transactional, lsn, &prefix, &content).await?;
            }
            WalEvent::KeepAlive { wal_end } => {
                metrics().received_lsn.set(wal_end.0 as f64);
                if self.open.is_none()
                    && let Some(lsn) = self.tracker.idle_advance(wal_end)
                {
                    self.confirm(lsn);
                }
            }
        }
        Ok(())
    }

    fn outbox_renamed(&self, now: &str) -> RelayError {
        let table = self.source.table.display_name();
        RelayError::fatal(
            FatalReason::OutboxChanged,
            format!(
                "the outbox table {table} is now {now} (renamed or moved while the relay streamed): its inserts \
                 would no longer be recognised, so the relay stops without confirming past them; rename it back, \
                 or set outbox.schema / outbox.table to the new name and restart"
            ),
        )
    }

    /// A logical decoding message: the relay's heartbeat, an outbox event, or someone else's.
    async fn message(
        &mut self,
        transactional: bool,
        lsn: Lsn,
        prefix: &str,
        content: &[u8],
    ) -> Result<(), RelayError> {
        if prefix == HEARTBEAT_PREFIX && !transactional && self.open.is_none() {
            // Every transaction that committed before this record was streamed before it; with
            // none in flight, nothing before `lsn` is left to publish.
            metrics().received_lsn.set(lsn.0 as f64);
            if let Some(lsn) = self.tracker.idle_advance(lsn) {
                self.confirm(lsn);
            }
            return Ok(());
        }
        if prefix != self.source.config.replication.message_prefix {
            metrics().stream_messages_skipped.with_label_values(&[SkippedKind::ForeignMessage.label()]).inc();
            return Ok(());
        }
        let raw = decode::message_event(content).unwrap_or_else(|reason| {
            tracing::warn!(%lsn, %reason, "an outbox message is not an event object");
            OutboxRow::default()
        });
        match self.open.as_mut() {
            Some(txn) if transactional => {
                let txn = next_event(txn);
                self.publish(raw, txn).await
            }
            _ => self.untrusted(raw, lsn).await,
        }
    }

    /// A non-transactional message with the outbox prefix: written even when its transaction
    /// rolls back, and by anyone who may call `pg_logical_emit_message`, so never published.
    /// It takes the dead-letter path, as its own unit of the position.
    async fn untrusted(&mut self, raw: OutboxRow, lsn: Lsn) -> Result<(), RelayError> {
        metrics().stream_messages_skipped.with_label_values(&[SkippedKind::UntrustedMessage.label()]).inc();
        tracing::warn!(%lsn, event_id = ?raw.id, "a non-transactional outbox message is not published");
        let letter = DeadLetter::row(
            raw,
            "non-transactional outbox message: not published (it is written even when its transaction \
                     rolls back); emit events with outbox_emit() or pg_logical_emit_message(true, ...)"
                .into(),
        );
        // its own unit of the position; held like a row that cannot map: nothing after it is
        // read, nothing past it confirmed
        let txn = self.tracker.begin();
        if let Settled::DeadLettered(_, letter) = self.delivery.unpublishable(txn, letter) {
            self.source.dead_letters.write_committed(self.client, &[*letter]).await?;
            self.tracker.commit(txn, lsn);
        }
        Ok(())
    }

    /// Publishes the event at `txn`'s current index (see [`next_event`]).
    async fn publish(&mut self, raw: OutboxRow, txn: OpenTxn) -> Result<(), RelayError> {
        self.read.inc();
        let settled = match self.source.mapping.to_record(raw, Some(txn.commit_time)) {
            Ok(mut event) => {
                event.position = Some(Position::Stream { commit: txn.commit_lsn, index: txn.next_index });
                self.tracker.sent(txn.id);
                self.delivery.send(txn.id, event, self.turn_at).await?
            }
            // (never sent, so never counted in the transaction: dead-lettering it releases nothing)
            Err(unpublishable) => match self
                .delivery
                .unpublishable(txn.id, DeadLetter::unmapped(*unpublishable))
            {
                Settled::DeadLettered(_, letter) => {
                    return self.source.dead_letters.write_committed(self.client, &[*letter]).await.map(drop);
                }
                held => Some(held),
            },
        };
        match settled {
            Some(settled) => self.settled(settled).await,
            None => Ok(()),
        }
    }

    /// A report from the sink, settled by the delivery stage.
    async fn settle(&mut self, report: Report, clock: &Clock) -> Result<(), RelayError> {
        match self.delivery.settle(report, clock).await? {
            Some(settled) => self.settled(settled).await,
            None => Ok(()),
        }
    }

    /// What a settled record means to the stream: its transaction counts it as acknowledged
    /// once Kafka or the dead-letter table holds it; a held one keeps its transaction open.
    async fn settled(&mut self, settled: Settled<TxnId>) -> Result<(), RelayError> {
        match settled {
            Settled::Acked(txn) => self.tracker.acked(txn),
            Settled::DeadLettered(txn, letter) => {
                self.source.dead_letters.write_committed(self.client, &[*letter]).await?;
                self.tracker.acked(txn);
            }
            Settled::Held(_) => {}
        }
        Ok(())
    }
}

/// The open transaction as its next outbox event sees it, and the index moved past that event.
/// Every event read counts, published or not, so a replay numbers them the same way.
fn next_event(txn: &mut OpenTxn) -> OpenTxn {
    let current = *txn;
    txn.next_index += 1;
    current
}
