//! Polling mode: claim outbox rows in one transaction, hand them to the delivery stage, write
//! the dead letters, release what is settled, commit.
//!
//! Invariants:
//! - a row is deleted (or marked) only in the transaction that claimed it, and only after Kafka
//!   acknowledged its record with `acks=all`; a crash before COMMIT leaves the row to be
//!   published again (at-least-once, same `id` header);
//! - one instance is active at a time: the session that holds the advisory lock of every outbox
//!   table it reads ([`leader`]: each derived from the table's name and
//!   `polling.leader_lock_key`; so a relay reading a table alone and one reading it with others
//!   never both claim it). It is the same session that claims rows, so losing it (crash,
//!   network) both releases the locks and rolls back the batch. A single claimer reading in `id`
//!   order is what keeps one aggregate's events in order: `SKIP LOCKED` alone would let two
//!   claimers publish them concurrently;
//! - with several outboxes (`[[outboxes]]`), the session claims from each table in turn, one
//!   batch each, through one delivery stage; while the stage holds at an event, only that
//!   event's outbox is claimed from (the held row first), and the others wait;
//! - records go to Kafka through the delivery stage ([`crate::delivery`]), which applies the
//!   poison policy: a dead-lettered row is moved to the dead-letter table in the same
//!   transaction that removes it; a held one stays, and while the stage holds, the relay claims
//!   one row at a time (the held one comes first, in id order), so nothing after it is
//!   published and nothing acknowledged is published again. One claim-deliver-release cycle is
//!   [`cycle`]'s; what is decided between the claim and its release is [`batch`]'s; the claim's
//!   size is [`claim`]'s;
//! - paused ([`crate::observe::pause`]), the leader claims nothing from the end of its current
//!   cycle (whose rows are released or rolled back as usual) until resumed, and keeps its locks,
//!   so no standby takes over;
//! - a request served beside the stream ([`crate::delivery::live`]: a republish, a replay) is
//!   served between two cycles, where nothing is claimed or in flight (each cycle commits its
//!   Kafka transaction): the session is quiet at once, sends the request's records aside from
//!   its rows, and claims again once each has its answer.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use tokio::sync::{mpsc, watch};
use tokio_postgres::{AsyncMessage, Client};

use crate::config::{PerOutbox, RelayConfig};
use crate::dead_letter::{DeadLetters, LetterKey};
use crate::delivery::live::{Desk, Turn, Woken};
use crate::delivery::{self, Carried, Delivery};
use crate::error::RelayError;
use crate::observe::health::LockHolder;
use crate::observe::metrics::Mode;
use crate::observe::pause::{self, Paused};
use crate::observe::pulse::Pulse;
use crate::outboxes::Outboxes;
use crate::readback::{self, Lookback};
use crate::sink::Sink;
use crate::source::Source;
use crate::source::handover;
use crate::table::{OutboxTable, RowAt, quote_ident};
use claim::{Prepared, Statements};

mod batch;
mod claim;
mod cycle;
mod leader;
#[cfg(test)]
mod tests;

/// The `mode` label of this source's metrics.
const MODE: Mode = Mode::Polling;

/// A leader session: the connection that holds the lock, claims, and LISTENs.
struct Session {
    client: Client,
    notified: mpsc::UnboundedReceiver<()>,
    /// Switching from replication mode (see [`handover`]): the events each outbox dead-lettered
    /// (id and content), which are released unsent. Empty otherwise.
    dead_lettered: PerOutbox<HashSet<LetterKey>>,
    /// This session's batches are `batch:<nonce>-<n>` in their records' positions.
    nonce: u64,
    batches: u64,
    /// While the switch from replication mode is unfinished: when this session last made sure
    /// no replication relay streams from the slot ([`SWITCH_RECHECK`]).
    switch_checked: Option<Instant>,
    /// Each outbox's statements, prepared on this session's connection.
    prepared: PerOutbox<Prepared>,
}

/// While a switch from replication mode is unfinished, how often a polling session looks again
/// whether a replication relay streams from the slot (one started after the session began):
/// both would publish, so the session ends and waits as a standby.
const SWITCH_RECHECK: Duration = Duration::from_secs(2);

/// While paused, how often the session says it is alive (the liveness probe allows far more).
const PAUSED_TICK: Duration = Duration::from_secs(1);

/// One outbox table as polling reads it: adapted to the database's encoding, its statements made
/// by the first session.
struct Polled {
    table: OutboxTable,
    statements: Option<Statements>,
}

pub(crate) struct PollingSource {
    config: RelayConfig,
    outboxes: Arc<Outboxes>,
    polled: PerOutbox<Polled>,
    dead_letters: DeadLetters,
    /// The delivery stage's hold (its backoff keeps growing) and Kafka's silence, from one
    /// session to the next.
    carried: Option<Carried<RowAt>>,
    /// A standby's session, refused a leader lock last time: asked again next time.
    standing_by: Option<Session>,
    /// Requests the leader serves between its cycles ([`crate::delivery::live`]).
    desk: Desk,
}

impl<S: Sink> Source<S> for PollingSource {
    async fn session(
        &mut self,
        sink: &mut S,
        pulse: &Pulse,
        shutdown: &mut watch::Receiver<bool>,
    ) -> Result<(), RelayError> {
        // a standby keeps its session from one try to the next (`supervisor::STANDBY_RETRY`):
        // each try is then the lock's statements, not a connection and its set-up
        let mut session = match self.standing_by.take() {
            Some(kept) if !kept.client.is_closed() => kept,
            _ => self.connect().await?,
        };
        let lookback = match self.lead(&mut session, pulse).await {
            Err(e @ RelayError::Standby(_)) => {
                self.standing_by = Some(session);
                return Err(e);
            }
            other => other?,
        };
        // only the leader: it may fence earlier producers (kafka.transactional)
        let identities = readback::source_identities(&session.client, &self.config).await?;
        let prologue =
            delivery::prologue(sink, &identities, &self.config, (MODE, lookback), pulse, shutdown).await?;
        let stage = (&self.dead_letters, &self.config.kafka);
        let mut delivery = Delivery::open(&*sink, prologue, stage, pulse, MODE).await;
        // a held row is claimed again, by the claim's own turn (`relay_batch`)
        delivery.reclaims_held();
        delivery.resume(self.carried.take());
        let result = self.serve(&mut session, &mut delivery, pulse, shutdown).await;
        let carried = delivery.carry();
        self.carried = Some(carried);
        result
    }
}

impl PollingSource {
    pub(crate) fn new(config: RelayConfig, outboxes: Arc<Outboxes>) -> PollingSource {
        PollingSource {
            polled: outboxes.per(|o| Polled { table: o.table.clone(), statements: None }),
            dead_letters: DeadLetters::new(&outboxes, &config.retry, MODE),
            outboxes,
            config,
            carried: None,
            standing_by: None,
            desk: Desk::default(),
        }
    }

    /// Serves the requests of `desk` (the admin API's, the signal table's) while the leader.
    pub(crate) fn with_desk(mut self, desk: Desk) -> PollingSource {
        self.desk = desk;
        self
    }

    /// A leader session's connection; the sink learns its source identity.
    async fn connect(&mut self) -> Result<Session, RelayError> {
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
        let mut encoding: Option<String> = None;
        for (id, outbox) in self.polled.iter_mut().filter(|(_, o)| o.statements.is_none()) {
            // (the database's, so the same for every outbox: asked once)
            if encoding.is_none() {
                encoding = Some(client.query_one(OutboxTable::SERVER_ENCODING_SQL, &[]).await?.get(0));
            }
            let encoding = encoding.as_deref().expect("just read");
            let table = outbox.table.clone().for_server_encoding(encoding);
            let id_type = table.id_type(&client).await?;
            self.outboxes[id].recorder(&client).await?;
            outbox.statements = Some(Statements {
                claim: table.claim_sql(),
                unpublished_count: table.unpublished_count_sql(&id_type),
                release: table.release_sql(),
                delete: table.delete_sql(),
            });
            outbox.table = table;
        }
        let mut prepared = Vec::with_capacity(self.polled.len());
        for outbox in self.polled.values() {
            prepared.push(Prepared::on(&client, outbox.statements.as_ref().expect("just made")).await?);
        }
        Ok(Session {
            client,
            notified,
            dead_lettered: self.polled.values().map(|_| HashSet::new()).collect(),
            nonce: rand::random(),
            batches: 0,
            switch_checked: None,
            prepared: prepared.into_iter().collect(),
        })
    }

    /// Takes the leader lock of every outbox table, in the order of their names, so two relays
    /// listing the same tables in another order never hold one each (or returns
    /// [`RelayError::Standby`], naming the holder of the first one refused; the session's end
    /// releases those it took) and becomes active; returns how far back the read-back looks
    /// (see [`Dedup`]).
    async fn lead(&self, session: &mut Session, pulse: &Pulse) -> Result<Lookback, RelayError> {
        let health = pulse.health();
        let mut tables: Vec<&OutboxTable> = self.polled.values().map(|o| &o.table).collect();
        tables.sort_by_key(|t| (t.schema.as_str(), t.name.as_str()));
        let mut keys = Vec::with_capacity(tables.len());
        for table in tables {
            match self.lock(session, pulse, table).await {
                Ok(key) => keys.push(key),
                Err(e) => {
                    // a standby keeps its session: it holds none of the locks while it waits
                    if !keys.is_empty() {
                        session.client.execute("SELECT pg_advisory_unlock_all()", &[]).await?;
                    }
                    return Err(e);
                }
            }
        }
        health.set_lock_holder(None);
        let mut lookback = Lookback::LastBatch;
        // (only the leader looks: a standby would repeat the warning and the dead-letter read)
        if let Some(dead_lettered) =
            handover::unfinished_switch(&self.config, &session.client, &self.dead_letters).await?
        {
            lookback = Lookback::Everything;
            session.dead_lettered = dead_lettered;
            session.switch_checked = Some(Instant::now());
        }
        let channel = &self.config.polling.notify_channel;
        if !channel.is_empty() {
            session.client.batch_execute(&format!("LISTEN {}", quote_ident(channel))).await?;
        }
        let (tables, locks) = (self.outboxes.table_names(), format!("{keys:?}"));
        tracing::info!(%tables, %locks, "active: this instance now relays the outbox");
        pulse.active();
        Ok(lookback)
    }

    /// Takes `table`'s leader lock, or says who holds it.
    async fn lock(&self, session: &Session, pulse: &Pulse, table: &OutboxTable) -> Result<i64, RelayError> {
        let health = pulse.health();
        match leader::take(&self.config, table, &session.client).await? {
            Ok(key) => Ok(key),
            Err(refused) => {
                // a holder that is no relay stops polling until an operator ends it: said once per holder
                let said = refused.to_string();
                let holder = refused
                    .holder
                    .as_ref()
                    .map(|_| LockHolder { said: said.clone(), relay: !refused.foreign() });
                if health.set_lock_holder(holder) && refused.foreign() {
                    tracing::warn!(table = %table.display_name(), "{said}");
                }
                Err(RelayError::Standby(said))
            }
        }
    }

    /// Relays until shutdown.
    async fn serve<S: Sink>(
        &self,
        session: &mut Session,
        delivery: &mut Delivery<'_, S, RowAt>,
        pulse: &Pulse,
        shutdown: &mut watch::Receiver<bool>,
    ) -> Result<(), RelayError> {
        let mut paused = pulse.paused();
        let mut turn = self.desk.turn().await;
        while !*shutdown.borrow() {
            pulse.tick();
            if !turn.reading() {
                // between cycles nothing is claimed or in flight: serve the request, then claim again
                Self::serve_request(session, (delivery, pulse), &mut turn, shutdown).await?;
                continue;
            }
            if paused.borrow_and_update().is_some() {
                // between cycles nothing is claimed or in flight: hold the locks, claim nothing
                Self::wait_paused(session, &mut paused, shutdown).await?;
                continue;
            }
            if session.switch_checked.is_some_and(|checked| checked.elapsed() >= SWITCH_RECHECK) {
                handover::refuse_active_slot(&self.config, &session.client).await?;
                session.switch_checked = Some(Instant::now());
            }
            while session.notified.try_recv().is_ok() {}
            let mut full = false;
            for outbox in self.outboxes.iter().map(|o| o.id) {
                // while held, only the held event's outbox is claimed from
                if delivery.held_outbox().is_some_and(|held| held != outbox) {
                    continue;
                }
                let outcome = self.relay_batch(session, outbox, delivery).await?;
                if outcome.claimed > 0 {
                    tracing::debug!(
                        table = %self.polled[outbox].table.display_name(),
                        claimed = outcome.claimed,
                        released = outcome.released,
                        dead_lettered = outcome.dead_lettered,
                        "batch committed"
                    );
                }
                if let Some(failed) = outcome.failed {
                    return Err(failed);
                }
                if outcome.released > 0 {
                    pulse.progressed();
                }
                full |= outcome.full;
            }
            if delivery.holding() {
                // the stage paces the retries: each is a claim of the held row alone
                tokio::select! {
                    _ = delivery.retry_due() => {}
                    _ = shutdown.changed() => {}
                }
                continue;
            }
            if !full {
                self.wait_for_work(session, shutdown, &mut turn).await?;
            }
        }
        Ok(())
    }

    /// Serves the request `turn` took ([`crate::delivery::live`]), between two cycles: quiet at
    /// once, its records sent aside from the rows, until each has its answer, the requester
    /// gives up, or shutdown. The locks stay held meanwhile.
    async fn serve_request<S: Sink>(
        session: &mut Session,
        (delivery, pulse): (&mut Delivery<'_, S, RowAt>, &Pulse),
        turn: &mut Turn<'_>,
        shutdown: &mut watch::Receiver<bool>,
    ) -> Result<(), RelayError> {
        loop {
            pulse.tick();
            turn.advance(delivery).await?;
            if turn.reading() || *shutdown.borrow() {
                return Ok(());
            }
            let settling = delivery.aside_waiting() > 0;
            tokio::select! {
                woken = turn.wake() => {
                    if let Woken::Records(records) = woken {
                        turn.send(delivery, records).await?;
                    }
                }
                settled = delivery.next(), if settling => {
                    settled?;
                }
                _ = shutdown.changed() => {}
                _ = tokio::time::sleep(PAUSED_TICK) => {}
                notified = session.notified.recv() => {
                    if notified.is_none() {
                        return Err(RelayError::Disconnected("the postgres session ended".into()));
                    }
                }
            }
        }
    }

    /// Paused ([`crate::observe::pause`]): waits for the resume, shutdown, or the next liveness
    /// tick, keeping the session (and with it the leader locks) open; a session that ends
    /// meanwhile is an error, as while polling.
    async fn wait_paused(
        session: &mut Session,
        paused: &mut watch::Receiver<Option<Paused>>,
        shutdown: &mut watch::Receiver<bool>,
    ) -> Result<(), RelayError> {
        tokio::select! {
            _ = pause::while_paused(paused) => {}
            _ = shutdown.changed() => {}
            _ = tokio::time::sleep(PAUSED_TICK) => {}
            notified = session.notified.recv() => {
                if notified.is_none() {
                    return Err(RelayError::Disconnected("the postgres session ended".into()));
                }
            }
        }
        Ok(())
    }

    /// Sleeps until a NOTIFY, the poll interval, a request, or shutdown.
    async fn wait_for_work(
        &self,
        session: &mut Session,
        shutdown: &mut watch::Receiver<bool>,
        turn: &mut Turn<'_>,
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
            _ = turn.wake() => {}
        }
        Ok(())
    }
}
