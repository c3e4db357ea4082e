//! Replication mode: stream pgoutput from a logical slot, confirm only what Kafka acknowledged.
//!
//! Invariants:
//! - events are produced in WAL (commit) order; the idempotent producer keeps that order per
//!   partition, so per-aggregate order holds;
//! - the position confirmed to PostgreSQL is the Commit `end_lsn` of the longest prefix of
//!   transactions whose every event Kafka acknowledged ([`Tracker`]); when nothing is in
//!   flight, a keepalive's WAL end (the last position sent) is confirmed, so a quiet outbox in
//!   a busy database does not pin WAL;
//! - any record that fails transiently ends the session: the stream restarts from the slot's
//!   confirmed position, re-sending the unconfirmed tail (at-least-once, same `id` header);
//! - at most `replication.max_in_flight_events` records are unacknowledged; reading pauses at
//!   the bound, so memory stays flat however large the backlog.

mod decode;
mod slot;
mod transport;

use std::time::{Duration, Instant};

use futures::StreamExt;
use futures::stream::FuturesUnordered;
use rdkafka::error::KafkaError;
use tokio::sync::watch;
use tokio_postgres::{Client, NoTls};

use crate::checkpoint::{Tracker, TxnId};
use crate::config::{OnPoison, RelayConfig};
use crate::error::RelayError;
use crate::event::{Mapping, OutboxEvent, RawEvent};
use crate::http::{State, health};
use crate::metrics::metrics;
use crate::position::Lsn;
use crate::retry::{Backoff, OutageLog, STANDBY_RETRY, wait_or_shutdown};
use crate::sink::kafka::{KafkaSink, PublishError, StallWatch};
use crate::table::{OutboxTable, quote_ident};
use decode::{Change, Decoder};
pub use slot::SlotPlan;
use transport::{WalEvent, WalStream};

/// Prefix of the relay's heartbeat messages (non-transactional, empty content).
pub const HEARTBEAT_PREFIX: &str = "outbox-relay-heartbeat";

/// The `mode` label of this source's metrics.
const MODE: &str = "replication";

type Delivered = (TxnId, OutboxEvent, Instant, Result<(), KafkaError>);
type Delivery = std::pin::Pin<Box<dyn Future<Output = Delivered> + Send>>;

pub struct ReplicationSource {
    config: RelayConfig,
    sink: KafkaSink,
    mapping: Mapping,
    table: OutboxTable,
}

/// What `outbox-relay setup` did.
#[derive(Debug)]
pub struct SetupReport {
    pub plan: SlotPlan,
    pub consistent_point: Option<Lsn>,
}

impl ReplicationSource {
    pub fn new(config: RelayConfig, sink: KafkaSink) -> ReplicationSource {
        ReplicationSource {
            mapping: Mapping::new(&config.outbox),
            table: OutboxTable::new(&config.outbox),
            config,
            sink,
        }
    }

    /// `outbox-relay setup`: the publication, and the slot with its first copy when missing.
    pub async fn setup(&self, recreate: bool) -> Result<SetupReport, RelayError> {
        let client = self.connect_client().await?;
        let plan = slot::prepare(&self.config, &client, recreate).await?;
        let mut consistent_point = None;
        if plan == SlotPlan::Create {
            let mut replication = transport::connect(&self.config, Lsn::ZERO).await?;
            consistent_point = Some(self.create_slot(&mut replication, &client).await?);
        }
        Ok(SetupReport { plan, consistent_point })
    }

    /// Relays until `shutdown` turns true, or a fatal error.
    pub async fn run(mut self, mut shutdown: watch::Receiver<bool>) -> Result<(), RelayError> {
        let mut backoff = Backoff::new(&self.config.retry);
        let mut outage = OutageLog::default();
        let mut standby_logged = false;
        while !*shutdown.borrow() {
            match self.session(&mut shutdown, &mut backoff, &mut outage).await {
                Ok(()) => break,
                Err(e) if e.is_fatal() => return Err(e),
                Err(RelayError::SlotInUse(message)) => {
                    if !standby_logged {
                        tracing::info!(slot = %self.config.replication.slot, %message, "standby: another instance streams from the slot");
                        standby_logged = true;
                    }
                    outage.recovered();
                    health().set(State::Standby);
                    wait_or_shutdown(STANDBY_RETRY, &mut shutdown).await;
                }
                Err(e) => {
                    standby_logged = false;
                    let delay = backoff.next_delay();
                    outage.failed(e.kind(), &e, delay);
                    health().set(State::Degraded(e.to_string()));
                    if let Err(e) = self.sink.reset() {
                        tracing::warn!(error = %e, "cannot recreate the Kafka producer");
                    }
                    wait_or_shutdown(delay, &mut shutdown).await;
                }
            }
        }
        tracing::info!("replication stopped; flushing the producer");
        let _ = self.sink.flush(Duration::from_secs(5));
        Ok(())
    }

    /// Creates the slot on `replication` (not yet streaming) and publishes the pre-existing
    /// rows on a connection of their own; returns the slot's consistent point.
    async fn create_slot(
        &self,
        replication: &mut pgwire_replication::ReplicationClient,
        client: &Client,
    ) -> Result<Lsn, RelayError> {
        let mut copy_client = self.connect_client().await?;
        slot::create_and_copy(&self.config, replication, client, &mut copy_client, &self.sink, &self.mapping)
            .await
    }

    async fn connect_client(&self) -> Result<Client, RelayError> {
        let (client, connection) = self.config.postgres.client_config().connect(NoTls).await?;
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(error = %e, "postgres connection ended");
            }
        });
        Ok(client)
    }

    /// One replication session: prepare the slot, (copy,) stream until shutdown or an error.
    async fn session(
        &mut self,
        shutdown: &mut watch::Receiver<bool>,
        backoff: &mut Backoff,
        outage: &mut OutageLog,
    ) -> Result<(), RelayError> {
        let client = self.connect_client().await?;
        let plan = slot::prepare(&self.config, &client, false).await?;
        let slot_name = &self.config.replication.slot;
        let confirmed = match plan {
            SlotPlan::Stream => {
                slot::slot_info(&client, slot_name).await?.and_then(|i| i.confirmed_flush).unwrap_or_default()
            }
            SlotPlan::Create => Lsn::ZERO,
        };
        let mut replication = transport::connect(&self.config, confirmed).await?;
        let confirmed = match plan {
            SlotPlan::Stream => confirmed,
            SlotPlan::Create => self.create_slot(&mut replication, &client).await?,
        };
        let mut stream = WalStream::start(replication).await?;
        tracing::info!(slot = %slot_name, %confirmed, table = %self.table.display_name(), "active: streaming from the slot");
        backoff.reset();
        outage.recovered();
        health().set(State::Active);
        let result = self.stream(&mut stream, &client, confirmed, shutdown).await;
        stream.stop().await;
        result
    }

    async fn stream(
        &self,
        stream: &mut WalStream,
        client: &Client,
        confirmed: Lsn,
        shutdown: &mut watch::Receiver<bool>,
    ) -> Result<(), RelayError> {
        let mut tracker = Tracker::new(confirmed);
        let mut decoder = Decoder::new(&self.config.outbox);
        let mut deliveries: FuturesUnordered<Delivery> = FuturesUnordered::new();
        let mut open: Option<(TxnId, std::time::SystemTime)> = None;
        let max_in_flight = self.config.replication.max_in_flight_events;
        let heartbeat_ms = self.config.replication.heartbeat_interval_ms;
        let mut watch = StallWatch::new(&self.config.kafka);
        let mut stall_check = tokio::time::interval(watch.period());
        let mut heartbeat = tokio::time::interval(Duration::from_millis(heartbeat_ms.max(1)));
        heartbeat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                biased;
                // 1. shutdown: stop reading, settle what is in flight, confirm it
                _ = shutdown.changed() => {
                    while let Some(done) = deliveries.next().await {
                        self.settle(done, &mut tracker, client).await?;
                    }
                    if let Some(lsn) = tracker.advance() {
                        confirm(stream, lsn);
                    }
                    tokio::time::sleep(Duration::from_millis(self.config.replication.status_interval_ms)).await;
                    return Ok(());
                }
                // 2. acknowledgements
                Some(done) = deliveries.next(), if !deliveries.is_empty() => {
                    if done.3.is_ok() {
                        watch.progressed();
                    }
                    self.settle(done, &mut tracker, client).await?;
                }
                // 3. the stream, while in-flight records are under the bound
                event = stream.recv(), if tracker.in_flight_events() < max_in_flight => {
                    let Some(event) = event? else {
                        return Err(RelayError::ConnectionLost("the server ended the replication stream".into()));
                    };
                    self.handle(event, &mut tracker, &mut decoder, &mut open, &mut deliveries, client, stream).await?;
                }
                // 4. heartbeat: a WAL record of our own, so an idle outbox in a busy database
                //    still sees positions it may confirm (see WalEvent::Message below)
                // (liveness is ticked here, at most every stall period, not once per event)
                _ = stall_check.tick() => {
                    health().tick();
                    watch.check(tracker.in_flight_events());
                }
                _ = heartbeat.tick(), if heartbeat_ms > 0 => {
                    client.execute("SELECT pg_logical_emit_message(false, $1, '')", &[&HEARTBEAT_PREFIX]).await?;
                }
            }
            if let Some(lsn) = tracker.advance() {
                tracing::trace!(%lsn, "confirmed");
                confirm(stream, lsn);
            }
            metrics().events_in_flight.set(tracker.in_flight_events() as i64);
            metrics().transactions_in_flight.set(tracker.open_transactions() as i64);
        }
    }

    #[allow(clippy::too_many_arguments)]
    async fn handle(
        &self,
        event: WalEvent,
        tracker: &mut Tracker,
        decoder: &mut Decoder,
        open: &mut Option<(TxnId, std::time::SystemTime)>,
        deliveries: &mut FuturesUnordered<Delivery>,
        client: &Client,
        stream: &WalStream,
    ) -> Result<(), RelayError> {
        match event {
            WalEvent::Begin { commit_time } => *open = Some((tracker.begin(), commit_time)),
            WalEvent::Commit { end_lsn } => {
                let (txn, _) =
                    open.take().ok_or_else(|| RelayError::ConnectionLost("Commit without Begin".into()))?;
                tracker.commit(txn, end_lsn);
                metrics().received_lsn.set(end_lsn.0 as f64);
            }
            WalEvent::Data(data) => {
                let change = decoder
                    .decode(&data)
                    .map_err(|e| RelayError::Fatal(format!("{e}; please report this as a bug")))?;
                if let Change::Insert(raw) = change {
                    let (txn, commit_time) = open
                        .ok_or_else(|| RelayError::ConnectionLost("Insert outside a transaction".into()))?;
                    self.publish(raw, txn, commit_time, tracker, deliveries, client).await?;
                }
            }
            WalEvent::Message { transactional, lsn, prefix, content } => {
                if prefix == HEARTBEAT_PREFIX && !transactional && open.is_none() {
                    // Every transaction that committed before this record was streamed before
                    // it; with none in flight, nothing before `lsn` is left to publish.
                    metrics().received_lsn.set(lsn.0 as f64);
                    if let Some(lsn) = tracker.idle_advance(lsn) {
                        confirm(stream, lsn);
                    }
                    return Ok(());
                }
                if prefix != self.config.replication.message_prefix {
                    return Ok(());
                }
                let raw = decode::message_event(&content).unwrap_or_else(|reason| {
                    tracing::warn!(%lsn, %reason, "an outbox message is not an event object");
                    RawEvent::default()
                });
                match (*open, transactional) {
                    (Some((txn, commit_time)), true) => {
                        self.publish(raw, txn, commit_time, tracker, deliveries, client).await?;
                    }
                    _ => {
                        // non-transactional: published at once, confirmed as its own unit
                        let txn = tracker.begin();
                        self.publish(raw, txn, std::time::SystemTime::now(), tracker, deliveries, client)
                            .await?;
                        tracker.commit(txn, lsn);
                    }
                }
            }
            WalEvent::KeepAlive { wal_end } => {
                metrics().received_lsn.set(wal_end.0 as f64);
                if open.is_none()
                    && let Some(lsn) = tracker.idle_advance(wal_end)
                {
                    confirm(stream, lsn);
                }
            }
        }
        Ok(())
    }

    async fn publish(
        &self,
        raw: RawEvent,
        txn: TxnId,
        commit_time: std::time::SystemTime,
        tracker: &mut Tracker,
        deliveries: &mut FuturesUnordered<Delivery>,
        client: &Client,
    ) -> Result<(), RelayError> {
        let id = raw.id.clone().unwrap_or_default();
        metrics().events_read.with_label_values(&[MODE]).inc();
        match self.mapping.to_event(raw.clone(), Some(commit_time)) {
            Ok(event) => {
                let sent = Instant::now();
                let future = self.sink.enqueue(&event).await;
                tracker.sent(txn);
                deliveries.push(Box::pin(async move {
                    let outcome = match future {
                        Ok(f) => match f.await {
                            Ok(Ok(_)) => Ok(()),
                            Ok(Err((e, _))) => Err(e),
                            Err(_) => Err(KafkaError::Canceled),
                        },
                        Err(e) => Err(e),
                    };
                    (txn, event, sent, outcome)
                }));
                Ok(())
            }
            Err(reason) => poison(&self.config, client, &id, raw.to_json(), &reason.to_string()).await,
        }
    }

    /// An acknowledgement, or a failure: permanent ones are poison, transient ones end the session.
    async fn settle(
        &self,
        (txn, event, sent, outcome): Delivered,
        tracker: &mut Tracker,
        client: &Client,
    ) -> Result<(), RelayError> {
        if outcome.is_ok() {
            metrics().acknowledged(MODE, sent, event.created_at);
        }
        if let Err(e) = outcome {
            let failure = self.sink.classify(&event.topic, &e).await;
            metrics().publish_errors.with_label_values(&[failure.error_type()]).inc();
            match failure {
                PublishError::Permanent(reason) => {
                    poison(&self.config, client, &event.id, event.to_json(), &reason).await?
                }
                PublishError::Transient { detail, .. } => {
                    return Err(RelayError::Kafka(format!("event {} not acknowledged: {detail}", event.id)));
                }
            }
        }
        tracker.acked(txn);
        Ok(())
    }
}

/// An event that cannot be published: written to the dead-letter table with its reason (and
/// then settled by the caller), or, with `on_poison = "block"`, an error that stops the relay
/// at it until an operator acts.
async fn poison(
    config: &RelayConfig,
    client: &Client,
    id: &str,
    row: serde_json::Value,
    reason: &str,
) -> Result<(), RelayError> {
    let table = OutboxTable::new(&config.outbox).display_name();
    if config.polling.on_poison == OnPoison::Block {
        tracing::error!(event_id = %id, %reason, %table, "blocked at an unpublishable event (on_poison = \"block\"): fix its cause (topic, size limit) or set polling.on_poison = \"dead_letter\"");
        return Err(RelayError::Kafka(format!("blocked at event {id}: {reason}")));
    }
    let sql = format!(
        "INSERT INTO {} (source_table, event_id, row_data, reason) VALUES ($1, $2, $3, $4)",
        quote_ident(&config.polling.dead_letter_table)
    );
    client.execute(&sql, &[&table, &id, &row, &reason]).await?;
    metrics().events_dead_lettered.with_label_values(&[MODE]).inc();
    tracing::warn!(event_id = %id, %reason, %table, "event moved to the dead-letter table");
    Ok(())
}

/// Confirms `lsn` to PostgreSQL and records it.
fn confirm(stream: &WalStream, lsn: Lsn) {
    stream.confirm(lsn);
    metrics().confirmed(lsn);
}
