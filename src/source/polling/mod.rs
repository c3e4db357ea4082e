//! Polling mode: claim outbox rows in one transaction, publish them, release them, commit.
//!
//! Invariants:
//! - a row is deleted (or marked) only in the transaction that claimed it, and only after Kafka
//!   acknowledged its record with `acks=all`; a crash before COMMIT leaves the row to be
//!   published again (at-least-once, same `id` header);
//! - one instance is active at a time: the session that holds the advisory lock
//!   `polling.leader_lock_key`. It is the same session that claims rows, so losing it (crash,
//!   network) both releases the lock and rolls back the batch. A single claimer reading in `id`
//!   order is what keeps one aggregate's events in order: `SKIP LOCKED` alone would let two
//!   claimers publish them concurrently;
//! - an unpublishable row goes through the one dead-letter path ([`DeadLetters`]): moved to the
//!   dead-letter table in the same transaction that removes it, or held at. While holding, the
//!   relay claims one row at a time (the held one comes first, in id order), so nothing after
//!   it is published and nothing acknowledged is published again.

use std::collections::HashSet;
use std::future::Future;
use std::time::{Duration, Instant};

use futures::StreamExt;
use tokio::sync::{mpsc, watch};
use tokio_postgres::{AsyncMessage, Client, Transaction};

use crate::config::RelayConfig;
use crate::dead_letter::{DeadLetter, DeadLetters, Hold, LetterKey};
use crate::delivery::record::{KafkaRecord, Mapping, Position};
use crate::error::RelayError;
use crate::observe::metrics::{Clock, ErrorType, Mode, metrics};
use crate::observe::pulse::Pulse;
use crate::sink::dedup::{self, Dedup, Lookback};
use crate::sink::kafka::{KafkaSink, PublishError};
use crate::source::handover;
use crate::supervisor::Source;
use crate::table::{OutboxTable, quote_ident};
use claim::{Claimed, HeldRow, Statements, already_dead_lettered};

mod claim;

/// The `mode` label of this source's metrics.
const MODE: Mode = Mode::Polling;

/// A leader session: the connection that holds the lock, claims, and LISTENs.
struct Session {
    client: Client,
    notified: mpsc::UnboundedReceiver<()>,
    /// Rows of an earlier session's unfinished batch that Kafka already holds are not sent again.
    dedup: Dedup,
    /// Switching from replication mode (see [`handover`]): the events it dead-lettered (id and
    /// content), which are released unsent. Empty otherwise.
    dead_lettered: HashSet<LetterKey>,
    /// This session's batches are `batch:<nonce>-<n>` in their records' positions.
    nonce: u64,
    batches: u64,
    /// While the switch from replication mode is unfinished: when this session last made sure
    /// no replication relay streams from the slot ([`SWITCH_RECHECK`]).
    switch_checked: Option<Instant>,
}

/// While a switch from replication mode is unfinished, how often a polling session looks again
/// whether a replication relay streams from the slot (one started after the session began):
/// both would publish, so the session ends and waits as a standby.
const SWITCH_RECHECK: Duration = Duration::from_secs(2);

/// What one claim-publish-release cycle did.
#[derive(Debug, Default)]
struct BatchOutcome {
    claimed: usize,
    /// The claim ended at `polling.batch_size` or `polling.max_batch_bytes`: more rows may wait.
    full: bool,
    published: usize,
    dead_lettered: u64,
    /// The first record that failed transiently; its row (and every row not acknowledged)
    /// stays and is published by a later session.
    failed: Option<PublishError>,
    /// `on_poison = "block"`: the row the relay holds at.
    held: Option<DeadLetter>,
    /// The row held at before this batch left the outbox (fixed by deleting or marking it).
    held_row_gone: bool,
}

pub struct PollingSource {
    config: RelayConfig,
    table: OutboxTable,
    mapping: Mapping,
    sink: KafkaSink,
    dead_letters: DeadLetters,
    statements: Option<Statements>,
    /// Kept across sessions so its backoff keeps growing.
    hold: Option<Hold>,
}

impl Source for PollingSource {
    async fn session(
        &mut self,
        pulse: &Pulse,
        shutdown: &mut watch::Receiver<bool>,
    ) -> Result<(), RelayError> {
        let mut session = self.connect(shutdown).await?;
        self.serve(&mut session, pulse, shutdown).await
    }

    fn recover(&mut self) {
        self.sink.recover()
    }

    fn flush(&self) -> impl Future<Output = ()> + Send {
        self.sink.flush()
    }
}

impl PollingSource {
    pub fn new(config: RelayConfig, sink: KafkaSink) -> PollingSource {
        PollingSource {
            table: OutboxTable::new(&config),
            mapping: Mapping::new(&config.outbox),
            dead_letters: DeadLetters::new(&config, MODE),
            config,
            sink,
            statements: None,
            hold: None,
        }
    }

    /// A leader session's connection, and its skip rule (see [`Dedup`]).
    async fn connect(&mut self, shutdown: &watch::Receiver<bool>) -> Result<Session, RelayError> {
        let (client, mut connection, _) = crate::postgres::connect_raw(&self.config.postgres).await?;
        let (tx, notified) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            let mut messages = futures::stream::poll_fn(move |cx| connection.poll_message(cx));
            while let Some(message) = messages.next().await {
                match message {
                    Ok(AsyncMessage::Notification(_)) => {
                        let _ = tx.send(());
                    }
                    Ok(_) => {}
                    Err(e) => {
                        tracing::debug!(error = %e, "postgres connection ended");
                        break;
                    }
                }
            }
        });
        if self.statements.is_none() {
            let encoding: String = client.query_one(OutboxTable::SERVER_ENCODING_SQL, &[]).await?.get(0);
            self.table = self.table.clone().for_server_encoding(&encoding);
            let id_type = self.table.id_type(&client).await?;
            self.statements = Some(Statements {
                claim: self.table.claim_sql(),
                unpublished_count: self.table.unpublished_count_sql(&id_type),
                release: self.table.release_sql(&id_type),
                delete: self.table.delete_sql(&id_type),
            });
        }
        self.sink.set_source(&dedup::source_identity(&client, &self.config).await?);
        self.sink.retired(dedup::RETIRE_LIMIT).await;
        let dedup = Dedup::new(&self.config, MODE, Lookback::LastBatch, self.sink.source(), shutdown);
        Ok(Session {
            client,
            notified,
            dedup,
            dead_lettered: HashSet::new(),
            nonce: rand::random(),
            batches: 0,
            switch_checked: None,
        })
    }

    /// Takes the leader lock (or returns [`RelayError::Standby`]), then relays until shutdown.
    async fn serve(
        &mut self,
        session: &mut Session,
        pulse: &Pulse,
        shutdown: &mut watch::Receiver<bool>,
    ) -> Result<(), RelayError> {
        let leader: bool = session
            .client
            .query_one("SELECT pg_try_advisory_lock($1)", &[&self.config.polling.leader_lock_key])
            .await?
            .get(0);
        if !leader {
            return Err(RelayError::Standby(format!(
                "another instance holds the polling lock {} on {}",
                self.config.polling.leader_lock_key,
                self.table.display_name()
            )));
        }
        // (only the leader looks: a standby would repeat the warning and the dead-letter read)
        if let Some(dead_lettered) =
            handover::unfinished_switch(&self.config, &session.client, &self.dead_letters).await?
        {
            session.dedup =
                Dedup::new(&self.config, MODE, Lookback::Everything, self.sink.source(), shutdown);
            session.dead_lettered = dead_lettered;
            session.switch_checked = Some(Instant::now());
        }
        let channel = &self.config.polling.notify_channel;
        if !channel.is_empty() {
            session.client.batch_execute(&format!("LISTEN {}", quote_ident(channel))).await?;
        }
        tracing::info!(table = %self.table.display_name(), "active: this instance now relays the outbox");
        pulse.active();
        if let Some(hold) = &self.hold {
            hold.report(pulse); // still held from the last session
        }
        while !*shutdown.borrow() {
            pulse.tick();
            if session.switch_checked.is_some_and(|checked| checked.elapsed() >= SWITCH_RECHECK) {
                handover::refuse_active_slot(&self.config, &session.client).await?;
                session.switch_checked = Some(Instant::now());
            }
            while session.notified.try_recv().is_ok() {}
            let outcome = self.relay_batch(session, pulse).await?;
            if outcome.claimed > 0 {
                tracing::debug!(
                    claimed = outcome.claimed,
                    published = outcome.published,
                    dead_lettered = outcome.dead_lettered,
                    "batch committed"
                );
            }
            if let Some(failed) = outcome.failed {
                let detail = match failed {
                    PublishError::Transient { detail, .. } | PublishError::Permanent(detail) => detail,
                };
                return Err(RelayError::Kafka(format!("a record was not acknowledged: {detail}")));
            }
            if outcome.published > 0 {
                pulse.progressed();
            }
            if self.held(outcome.held, outcome.claimed > 0 || outcome.held_row_gone, pulse) {
                let hold = self.hold.as_mut().expect("held");
                hold.wait(pulse, shutdown).await;
                continue;
            }
            if !outcome.full {
                self.wait_for_work(session, shutdown).await?;
            }
        }
        Ok(())
    }

    /// Updates the hold after a batch (`moved_on`: the held row was published or is gone); true
    /// while holding.
    fn held(&mut self, held: Option<DeadLetter>, moved_on: bool, pulse: &Pulse) -> bool {
        match (held, self.hold.take()) {
            (Some(letter), None) => self.hold = Some(self.dead_letters.hold(letter, pulse)),
            (Some(_), Some(hold)) => self.hold = Some(hold),
            (None, Some(hold)) if moved_on => hold.release(pulse),
            (None, hold) => self.hold = hold,
        }
        self.hold.is_some()
    }

    /// Sleeps until a NOTIFY, the poll interval, or shutdown.
    async fn wait_for_work(
        &self,
        session: &mut Session,
        shutdown: &mut watch::Receiver<bool>,
    ) -> Result<(), RelayError> {
        let interval = Duration::from_millis(self.config.polling.poll_interval_ms);
        tokio::select! {
            notified = session.notified.recv() => {
                if notified.is_none() {
                    return Err(RelayError::Disconnected("the postgres session ended".into()));
                }
            }
            _ = tokio::time::sleep(interval) => {}
            _ = shutdown.changed() => {}
        }
        Ok(())
    }

    /// One cycle: claim, publish, release or dead-letter, commit.
    async fn relay_batch(&self, session: &mut Session, pulse: &Pulse) -> Result<BatchOutcome, RelayError> {
        let statements = self.statements.as_ref().expect("statements are prepared at connect");
        let batch = session.batches;
        session.batches += 1;
        // the claim transaction holds row locks and the database's xmin horizon: waiting for Kafka
        // takes at most polling.claim_timeout_ms, then it rolls back (dropping `tx`)
        let deadline =
            tokio::time::Instant::now() + Duration::from_millis(self.config.polling.claim_timeout_ms);
        let tx = session.client.transaction().await?;
        // while holding at a row, only that row (the first in id order) is claimed
        let limit = if self.hold.is_some() { 1 } else { self.config.polling.batch_size as usize };
        let (rows, full) = claim::claim(&tx, statements, limit, self.config.polling.max_batch_bytes).await?;
        let held_row = claim::held_row(&tx, statements, self.hold.as_ref(), &rows).await?;
        if held_row == HeldRow::Skipped {
            // nothing past the held row is published while it waits
            tx.rollback().await?;
            return Ok(BatchOutcome::default());
        }
        let held_row_gone = held_row == HeldRow::Gone;
        let mut outcome = BatchOutcome { claimed: rows.len(), full, held_row_gone, ..Default::default() };
        if rows.is_empty() {
            tx.commit().await?;
            return Ok(outcome);
        }
        let mut letters = Vec::new();
        let claimed = rows.len();
        let (rows, dead_lettered) = already_dead_lettered(&session.dead_lettered, rows);
        let events = self.map_rows(rows, (session.nonce, batch), &mut letters, &mut outcome);
        let unread: Vec<String> = session.dedup.unread(&events).into_iter().map(String::from).collect();
        if !unread.is_empty() {
            // a topic not read back yet is read outside the claim (it may take long: it must not
            // hold row locks and the xmin horizon), then the same rows are claimed again
            tx.rollback().await?;
            for topic in unread {
                session.dedup.read_back(&topic, pulse).await?;
            }
            return Ok(BatchOutcome { full: true, ..Default::default() });
        }
        let (events, mut settled) = self.already_written(&mut session.dedup, events, pulse).await?;
        settled.extend(dead_lettered);
        let delivered = self
            .settle_or_publish(events, settled, claimed, deadline, pulse, &mut letters, &mut outcome)
            .await?;
        self.release(&tx, statements, &delivered, &letters, &mut outcome).await?;
        tx.commit().await?;
        self.dead_letters.report(&letters);
        Ok(outcome)
    }

    /// The ids to release: `settled` (rows Kafka or the dead-letter table already holds) on
    /// their own when there are any besides new `events`, which are then claimed again; else
    /// `settled` and the `events` Kafka acknowledged.
    ///
    /// A batch never mixes settled rows with new records, so only the newest batch can hold rows
    /// still in the outbox (a later session reads back just that one). Mixed, a batch that did
    /// not commit either would leave the older rows' records behind it, unread: duplicates.
    #[allow(clippy::too_many_arguments)]
    async fn settle_or_publish(
        &self,
        events: Vec<KafkaRecord>,
        mut settled: Vec<String>,
        claimed: usize,
        deadline: tokio::time::Instant,
        pulse: &Pulse,
        letters: &mut Vec<DeadLetter>,
        outcome: &mut BatchOutcome,
    ) -> Result<Vec<String>, RelayError> {
        let read = metrics().events_read.with_label_values(&[MODE.label()]);
        if settled.is_empty() || events.is_empty() {
            read.inc_by(claimed as u64);
            let mut delivered = self.publish(events, deadline, pulse, letters, outcome).await?;
            delivered.append(&mut settled);
            return Ok(delivered);
        }
        read.inc_by(settled.len() as u64);
        // a row held at comes again with the rest (holding now would pass it over forever)
        outcome.held = None;
        outcome.full = true;
        Ok(settled)
    }

    /// The claimed rows as records at their batch positions; rows that cannot map become
    /// `letters`, or the held row (which ends the batch).
    fn map_rows(
        &self,
        rows: Claimed,
        (session, batch): (u64, u64),
        letters: &mut Vec<DeadLetter>,
        outcome: &mut BatchOutcome,
    ) -> Vec<KafkaRecord> {
        let mut events = Vec::with_capacity(rows.len());
        for (index, (raw, created_at)) in rows.into_iter().enumerate() {
            match self.mapping.to_record(raw, created_at) {
                Ok(mut event) => {
                    event.position = Some(Position::Batch { session, batch, index: index as u32 });
                    events.push(event);
                }
                Err(unpublishable) if self.dead_letters.blocks() => {
                    // nothing after a held row is published
                    outcome.held = Some(DeadLetter::unmapped(*unpublishable));
                    break;
                }
                Err(unpublishable) => letters.push(DeadLetter::unmapped(*unpublishable)),
            }
        }
        events
    }

    /// Splits `events` into those to publish and the ids of those Kafka already holds (from an
    /// earlier session's batch that did not commit): they are released as if published now.
    /// Every topic of `events` was read back already.
    async fn already_written(
        &self,
        dedup: &mut Dedup,
        events: Vec<KafkaRecord>,
        pulse: &Pulse,
    ) -> Result<(Vec<KafkaRecord>, Vec<String>), RelayError> {
        let mut to_publish = Vec::with_capacity(events.len());
        let mut written = Vec::new();
        for event in events {
            if dedup.written(&event, pulse).await? {
                written.push(event.id);
            } else {
                to_publish.push(event);
            }
        }
        Ok((to_publish, written))
    }

    /// Publishes `events`; returns the ids Kafka acknowledged. Refused records become
    /// `letters` (or the held row), transient failures `outcome.failed`. Kafka taking past
    /// `deadline` (the claim's `polling.claim_timeout_ms`) is an error: the claim is rolled back.
    /// Each event is dropped once its report is handled: a refused large record is not held
    /// twice while it is dead-lettered.
    async fn publish(
        &self,
        events: Vec<KafkaRecord>,
        deadline: tokio::time::Instant,
        pulse: &Pulse,
        letters: &mut Vec<DeadLetter>,
        outcome: &mut BatchOutcome,
    ) -> Result<Vec<String>, RelayError> {
        let m = metrics();
        m.events_in_flight.set(events.len() as i64);
        m.bytes_in_flight.set(events.iter().map(KafkaRecord::size).sum::<usize>() as i64);
        let sent = Instant::now();
        let results = tokio::time::timeout_at(deadline, self.sink.publish(&events, pulse)).await;
        m.events_in_flight.set(0);
        m.bytes_in_flight.set(0);
        let Ok(results) = results else {
            m.publish_errors.with_label_values(&[ErrorType::Timeout.label()]).inc_by(events.len() as u64);
            return Err(RelayError::Kafka(format!(
                "{} record(s) not acknowledged within polling.claim_timeout_ms ({} ms): the claim was rolled \
                 back so it does not hold row locks and the xmin horizon; the batch is published again",
                events.len(),
                self.config.polling.claim_timeout_ms
            )));
        };
        let mut delivered = Vec::with_capacity(events.len());
        let mut refused_held = false;
        let (clock, published) = (Clock::now(), m.events_published.with_label_values(&[MODE.label()]));
        for (event, result) in events.into_iter().zip(results) {
            match result {
                Ok(()) => {
                    m.acknowledged_at(&published, sent, event.created_at, &clock);
                    delivered.push(event.id);
                }
                Err(e) => {
                    m.publish_errors.with_label_values(&[e.error_type().label()]).inc();
                    match e {
                        // the first refused record comes before any row held for its mapping
                        // (that row ended the batch); later refused rows stay in the table
                        PublishError::Permanent(reason) if self.dead_letters.blocks() => {
                            if !refused_held {
                                outcome.held = Some(DeadLetter::refused(event, reason));
                                refused_held = true;
                            }
                        }
                        PublishError::Permanent(reason) => letters.push(DeadLetter::refused(event, reason)),
                        transient => {
                            outcome.failed.get_or_insert(transient);
                        }
                    }
                }
            }
        }
        Ok(delivered)
    }

    /// Releases the delivered rows and moves `letters` to the dead-letter table, in `tx`.
    async fn release(
        &self,
        tx: &Transaction<'_>,
        statements: &Statements,
        delivered: &[String],
        letters: &[DeadLetter],
        outcome: &mut BatchOutcome,
    ) -> Result<(), RelayError> {
        if !delivered.is_empty() {
            tx.execute(&statements.release, &[&delivered]).await?;
        }
        if !letters.is_empty() {
            outcome.dead_lettered = self.dead_letters.write(tx, letters).await?;
            let ids: Vec<&str> = letters.iter().map(|l| l.id.as_str()).collect();
            tx.execute(&statements.delete, &[&ids]).await?;
        }
        outcome.published = delivered.len();
        Ok(())
    }
}
