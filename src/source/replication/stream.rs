//! One streaming session: read the slot, publish, confirm what Kafka acknowledged.
//!
//! The loop is one biased `select!` with its branches numbered by priority: shutdown, then
//! acknowledgements (they free room and move the confirmed position), then the stream (only
//! while in-flight records are under the bound and nothing is held), then the timers.
//!
//! Records go to Kafka through the delivery stage ([`crate::delivery`]), each with its
//! transaction as its position. What the stream decides (the transactions, the bounds on what
//! is in flight, what may be confirmed) is [`feed`]'s, apart from the connections; this session
//! keeps the connections' part: reading, writing dead letters, the heartbeat, the publication
//! check, and telling PostgreSQL what it may confirm.
//!
//! Holding (`dead_letter.on_poison = "block"`): reading stops at the unpublishable event. Records
//! already handed to Kafka still settle and their transactions are confirmed; the held
//! transaction and everything after it are not. The stage sends a refused record again at
//! backoff until Kafka takes it, and reports a row that cannot map at backoff until the relay
//! is restarted with another policy. The session is never ended for it, so nothing acknowledged
//! is sent again.
//!
//! Paused ([`crate::observe::pause`]): reading stops as it does for a bound. What is in flight
//! settles and is confirmed; the transport keeps sending status updates, so the slot stays this
//! session's and the server keeps the connection.
//!
//! Serving a request ([`crate::delivery::live`]: a republish, a replay): reading stops as when
//! paused; once nothing is in flight the open Kafka transaction commits (its transactions are
//! confirmed) and the requester is told the session is quiet; its records go through the stage
//! aside from the stream's positions, and reading goes on once each has its answer.

use std::time::Duration;

use tokio::sync::watch;
use tokio_postgres::Client;

use super::transport::{WalEvent, WalStream};
use super::{HEARTBEAT_PREFIX, publication};
use crate::config::RelayConfig;
use crate::dead_letter::DeadLetters;
use crate::delivery::live::{Turn, Woken};
use crate::error::RelayError;
use crate::lsn::Lsn;
use crate::observe::metrics::metrics;
use crate::observe::pause::Paused;
use crate::outboxes::Outboxes;
use crate::sink::Sink;
pub(super) use feed::Feed;

mod feed;
mod traced;

/// Stream events handled in one turn of the loop, at most, before reports are looked at again:
/// one clock read and one `select!` for the run instead of one per event.
const READ_TURN: usize = 128;

/// The heartbeat, written only when the server's WAL is past `$2`, the position the relay may
/// confirm already (prepared once per session: a quiet relay sends this and nothing else).
const HEARTBEAT_SQL: &str =
    "SELECT pg_logical_emit_message(false, $1, '')::text WHERE pg_current_wal_lsn() > $2::text::pg_lsn";

/// The ids of what Kafka acknowledged are recorded at most this often (one statement each
/// time); a confirmation that needs a record waits for it.
const RECORD_INTERVAL: Duration = Duration::from_millis(200);

/// At shutdown, how long the last status update (sent at once) is given to leave before the
/// stream ends.
const STATUS_LEAVES: Duration = Duration::from_millis(200);

pub(super) struct StreamSession<'a, S: Sink> {
    /// For the publication check (`replication.*` for the timers).
    config: &'a RelayConfig,
    dead_letters: &'a DeadLetters,
    client: &'a Client,
    wal: WalStream,
    feed: Feed<'a, S>,
    /// The publication was checked to deliver every insert committed before this position.
    publication_ok_through: Lsn,
    /// The last position confirmed to PostgreSQL: never past `publication_ok_through`.
    confirmed: Lsn,
    /// Each outbox's record: the ids handed to Kafka are recorded before a position past them
    /// is confirmed.
    outboxes: &'a Outboxes,
    /// When ids were last recorded: at most once per [`RECORD_INTERVAL`].
    recorded_at: tokio::time::Instant,
    /// A confirmation put off until then, so that ids are recorded once per [`RECORD_INTERVAL`].
    record_due: Option<tokio::time::Instant>,
    /// Shutdown: what is settled is recorded and confirmed at once.
    draining: bool,
    /// The pause switch: nothing is read while it says paused.
    paused: watch::Receiver<Option<Paused>>,
    /// When the publication was last verified.
    checked_at: tokio::time::Instant,
    /// The request this session serves, if any: nothing is read meanwhile.
    turn: Turn<'a>,
}

impl<'a, S: Sink> StreamSession<'a, S> {
    /// A session streaming `wal` into `feed`, from `confirmed`.
    pub(super) fn new(
        config: &'a RelayConfig,
        dead_letters: &'a DeadLetters,
        outboxes: &'a Outboxes,
        client: &'a Client,
        (wal, paused, turn): (WalStream, watch::Receiver<Option<Paused>>, Turn<'a>),
        feed: Feed<'a, S>,
    ) -> StreamSession<'a, S> {
        let confirmed = feed.confirmed();
        StreamSession {
            config,
            dead_letters,
            client,
            wal,
            feed,
            publication_ok_through: confirmed,
            confirmed,
            outboxes,
            recorded_at: tokio::time::Instant::now(),
            record_due: None,
            draining: false,
            paused,
            checked_at: tokio::time::Instant::now(),
            turn,
        }
    }

    /// Streams until shutdown (`Ok`) or an error; ends the stream either way (and, with
    /// `[tracing]` on, the session's span).
    pub(super) async fn run(mut self, shutdown: &mut watch::Receiver<bool>) -> Result<(), RelayError> {
        let result = self.stream(shutdown).await;
        self.wal.stop().await;
        if let Some(spans) = self.feed.spans.take() {
            spans.ended(self.confirmed, result.as_ref().err().map(ToString::to_string));
        }
        result
    }

    async fn stream(&mut self, shutdown: &mut watch::Receiver<bool>) -> Result<(), RelayError> {
        self.check_publication().await?;
        let heartbeat_every = Duration::from_millis(self.config.replication.heartbeat_interval_ms);
        let heartbeat = self.client.prepare(HEARTBEAT_SQL).await?;
        let mut beat_at = tokio::time::Instant::now();
        loop {
            self.commit_if_ready().await?;
            self.serve_request().await?;
            let reading =
                self.feed.reading() && self.paused.borrow_and_update().is_none() && self.turn.reading();
            let quiet = !heartbeat_every.is_zero() && self.feed.in_flight() == 0;
            let check_due = self.check_due();
            let record_due = self.record_due;
            tokio::select! {
                biased;
                // 1. shutdown: stop reading, settle what is in flight, confirm it
                _ = shutdown.changed() => return self.drain().await,
                // 2. the delivery stage: acknowledgements, the stall watch, a held record sent
                //    again, the open Kafka transaction come due by its age
                settled = self.feed.settle_next() => {
                    settled?;
                    self.write_letters().await?;
                }
                // 3. the stream
                event = self.wal.recv(), if reading => {
                    let event = event?.ok_or_else(|| {
                        RelayError::Disconnected("the server ended the replication stream".into())
                    })?;
                    self.read_turn(event).await?;
                }
                // 4. heartbeat: with nothing in flight and the server's WAL past the position
                //    the relay may confirm, a WAL record of its own, so an idle outbox in a busy
                //    database still sees positions it may confirm (see `Feed::handle`); an idle
                //    database gets none
                _ = tokio::time::sleep_until(beat_at + heartbeat_every), if quiet => {
                    let past = self.feed.confirmed().to_string();
                    self.client.execute(&heartbeat, &[&HEARTBEAT_PREFIX, &past]).await?;
                    beat_at = tokio::time::Instant::now();
                }
                // 5. the publication still delivers every insert: confirmations may go that far
                _ = tokio::time::sleep_until(check_due) => {
                    self.check_publication().await?;
                    self.confirm(self.feed.confirmed()).await?;
                }
                // 6. a confirmation put off so that ids are recorded once per `RECORD_INTERVAL`
                _ = tokio::time::sleep_until(record_due.unwrap_or(check_due)), if record_due.is_some() => {
                    self.confirm(self.feed.confirmed()).await?;
                }
                // 7. paused or resumed: `reading` is looked at again
                _ = self.paused.changed() => {}
                // 8. a request (a republish, a replay), or its records to send now
                woken = self.turn.wake() => {
                    if let Woken::Records(records) = woken {
                        self.turn.send(self.feed.delivery(), records).await?;
                    }
                }
            }
            self.confirm_acknowledged().await?;
        }
    }

    /// Verifies the publication ([`publication::delivers_through`]): positions up to the WAL
    /// position it read may be confirmed.
    async fn check_publication(&mut self) -> Result<(), RelayError> {
        self.publication_ok_through = publication::delivers_through(self.config, self.client).await?;
        self.checked_at = tokio::time::Instant::now();
        Ok(())
    }

    /// When the publication is verified next: [`publication::CHECK_INTERVAL`] after the last
    /// check while a position waits for one, [`publication::IDLE_CHECK_INTERVAL`] after it
    /// otherwise (a quiet relay asks nothing of the server but that).
    fn check_due(&self) -> tokio::time::Instant {
        let waiting = self.feed.confirmed() > self.publication_ok_through.max(self.confirmed);
        let after = if waiting { publication::CHECK_INTERVAL } else { publication::IDLE_CHECK_INTERVAL };
        self.checked_at + after
    }

    /// Commits the open Kafka transaction when it is ready ([`Feed::commit_ready`]), and
    /// confirms what it settled.
    async fn commit_if_ready(&mut self) -> Result<(), RelayError> {
        if self.feed.commit_ready() {
            self.feed.commit().await?;
            self.confirm_acknowledged().await?;
        }
        Ok(())
    }

    /// Moves a request on: once nothing of the stream is in flight, its open Kafka transaction
    /// commits (and is confirmed) before the requester is told the session is quiet.
    async fn serve_request(&mut self) -> Result<(), RelayError> {
        if self.turn.quieting() && self.feed.in_flight() == 0 {
            self.feed.commit().await?;
            self.confirm_acknowledged().await?;
        }
        self.turn.advance(self.feed.delivery()).await
    }

    /// Handles `first` and the events the transport has read already, up to [`READ_TURN`], as
    /// long as the bounds allow.
    async fn read_turn(&mut self, first: WalEvent) -> Result<(), RelayError> {
        self.feed.begin_turn();
        self.feed.idle = false;
        self.handle(first).await?;
        for _ in 1..READ_TURN {
            if !self.feed.reading() {
                break;
            }
            match self.wal.try_recv() {
                Some(event) => self.handle(event?).await?,
                None => {
                    self.feed.idle = true;
                    break;
                }
            }
        }
        Ok(())
    }

    async fn handle(&mut self, event: WalEvent) -> Result<(), RelayError> {
        if let Some(idle) = self.feed.handle(event).await? {
            self.confirm(idle).await?;
        }
        self.write_letters().await
    }

    /// Writes the feed's dead letters (each statement commits), then lets it count them.
    async fn write_letters(&mut self) -> Result<(), RelayError> {
        if !self.feed.letters().is_empty() {
            self.dead_letters.write_committed(self.client, self.feed.letters()).await?;
            self.feed.letters_written();
        }
        Ok(())
    }

    /// Shutdown: settle what is in flight, confirm it, give the status update time to leave.
    async fn drain(&mut self) -> Result<(), RelayError> {
        self.draining = true;
        while self.feed.in_flight() > 0 {
            self.feed.settle_next().await?;
            self.write_letters().await?;
        }
        self.feed.commit().await?;
        self.check_publication().await?;
        // with nothing in flight the update is sent at once; the stream's end must not overtake it
        self.confirm_acknowledged().await?;
        let interval = Duration::from_millis(self.config.replication.status_interval_ms);
        tokio::time::sleep(interval.min(STATUS_LEAVES)).await;
        Ok(())
    }

    async fn confirm_acknowledged(&mut self) -> Result<(), RelayError> {
        if let Some(lsn) = self.feed.advance() {
            tracing::trace!(%lsn, "acknowledged");
        }
        // (a confirmation put off until the ids are recorded is made here too)
        self.confirm(self.feed.confirmed()).await?;
        self.feed.gauges();
        Ok(())
    }

    /// Confirms `lsn` to PostgreSQL, as far as the publication was checked, and records it.
    /// With nothing in flight the status update leaves at once: the end of a run of records (a
    /// drain's last one, a quiet outbox) is not held back by the status interval. While records
    /// are in flight, updates go once per `replication.status_interval_ms`.
    ///
    /// Every id of the transactions it covers (Kafka acknowledged them) is recorded as published
    /// first (one statement), at most once per [`RECORD_INTERVAL`] (outside a drain at
    /// shutdown): a confirmation that would record sooner waits for the interval's end
    /// ([`Self::record_due`]), so a low steady rate of small transactions costs five statements
    /// a second, not one a transaction.
    async fn confirm(&mut self, lsn: Lsn) -> Result<(), RelayError> {
        if lsn > self.confirmed
            && let Some(spans) = self.feed.spans.as_mut()
        {
            spans.confirmable();
        }
        let lsn = lsn.min(self.publication_ok_through);
        if lsn <= self.confirmed {
            return Ok(());
        }
        if self.feed.has_sent(lsn) {
            let next = self.recorded_at + RECORD_INTERVAL;
            if !self.draining && tokio::time::Instant::now() < next {
                self.record_due = Some(next);
                return Ok(());
            }
            for (outbox, sent) in self.feed.take_sent(lsn).iter() {
                self.outboxes[outbox].recorder(self.client).await?.record(self.client, sent).await?;
            }
            self.recorded_at = tokio::time::Instant::now();
            self.record_due = None;
        }
        let previous = std::mem::replace(&mut self.confirmed, lsn);
        if self.feed.in_flight() == 0 {
            self.wal.confirm_now(lsn);
        } else {
            self.wal.confirm(lsn);
        }
        metrics().confirmed(lsn);
        if let Some(spans) = self.feed.spans.as_mut() {
            spans.confirmed(previous, lsn);
        }
        Ok(())
    }
}
