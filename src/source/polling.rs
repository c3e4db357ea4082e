//! Polling mode: claim outbox rows in one transaction, publish them, release them, commit.
//!
//! Invariants:
//! - a row is deleted (or marked) only in the transaction that claimed it, and only after Kafka
//!   acknowledged its record with `acks=all`; a crash before COMMIT leaves the row to be
//!   published again (at-least-once, same `id` header);
//! - one instance is active at a time: the session that holds the advisory lock
//!   `polling.leader_lock_key`. It is the same session that claims rows, so losing it (crash,
//!   network) both releases the lock and rolls back the batch. Standbys retry the lock every
//!   [`STANDBY_RETRY`]. A single claimer reading in `id` order is what keeps one aggregate's
//!   events in order: `SKIP LOCKED` alone would let two claimers publish them concurrently;
//! - a row that cannot be published is moved to the dead-letter table with its reason in the
//!   same transaction (`on_poison = "dead_letter"`), or stops the relay at that row
//!   (`"block"`); it is never skipped silently.

use std::time::{Duration, Instant};

use futures::StreamExt;
use tokio::sync::{mpsc, watch};
use tokio_postgres::{AsyncMessage, Client, NoTls, Row};

use crate::config::{AfterPublish, OnPoison, RelayConfig};
use crate::error::RelayError;
use crate::event::{Mapping, OutboxEvent, PoisonReason};
use crate::http::{State, health};
use crate::metrics::metrics;
use crate::retry::{Backoff, OutageLog, STANDBY_RETRY, wait_or_shutdown};
use crate::sink::kafka::{KafkaSink, PublishError};
use crate::table::{OutboxTable, quote_ident, raw_event, select_events_sql};

/// The `mode` label of this source's metrics.
const MODE: &str = "polling";

/// The SQL of one configured outbox table.
struct Statements {
    claim: String,
    release: String,
    dead_letter: String,
}

impl Statements {
    fn new(config: &RelayConfig, id_type: &str) -> Statements {
        let c = &config.outbox.columns;
        let table = OutboxTable::new(&config.outbox).qualified();
        let id = quote_ident(&c.id);
        let unpublished = match config.polling.after_publish {
            AfterPublish::Delete => String::new(),
            AfterPublish::Mark => {
                format!("WHERE t.{} IS NULL", quote_ident(&config.polling.published_at_column))
            }
        };
        // ORDER BY names the table's column (t.id), not the output column "id", which is text
        // and would sort "10" before "9".
        let claim = select_events_sql(
            &config.outbox,
            &format!("{unpublished} ORDER BY t.{id} LIMIT $1 FOR UPDATE SKIP LOCKED"),
        );
        let matches_ids = format!("{id} = ANY($1::text[]::{id_type}[])");
        let release = match config.polling.after_publish {
            AfterPublish::Delete => format!("DELETE FROM {table} WHERE {matches_ids}"),
            AfterPublish::Mark => format!(
                "UPDATE {table} SET {} = now() WHERE {matches_ids}",
                quote_ident(&config.polling.published_at_column)
            ),
        };
        let dead_letter = format!(
            "WITH moved AS ( \
                DELETE FROM {table} t USING unnest($1::text[], $2::text[]) AS p(id, reason) \
                WHERE t.{id} = p.id::{id_type} \
                RETURNING t.{id}::text AS event_id, to_jsonb(t) AS row_data, p.reason) \
             INSERT INTO {} (source_table, event_id, row_data, reason) \
             SELECT $3, event_id, row_data, reason FROM moved",
            quote_ident(&config.polling.dead_letter_table)
        );
        Statements { claim, release, dead_letter }
    }
}

/// A leader session: the connection that holds the lock, claims, and LISTENs.
struct Session {
    client: Client,
    notified: mpsc::UnboundedReceiver<()>,
    leader: bool,
}

/// What one claim-publish-release cycle did.
#[derive(Debug, Default)]
struct BatchOutcome {
    claimed: usize,
    published: usize,
    dead_lettered: usize,
    /// Records that failed transiently; their rows stay and are retried after a backoff.
    failed: Vec<PublishError>,
    /// `on_poison = "block"`: the row the relay stopped at.
    blocked: Option<(String, String)>,
}

pub struct PollingSource {
    config: RelayConfig,
    table: OutboxTable,
    mapping: Mapping,
    sink: KafkaSink,
    statements: Option<Statements>,
}

impl PollingSource {
    pub fn new(config: RelayConfig, sink: KafkaSink) -> PollingSource {
        PollingSource {
            table: OutboxTable::new(&config.outbox),
            mapping: Mapping::new(&config.outbox),
            config,
            sink,
            statements: None,
        }
    }

    /// Relays until `shutdown` turns true, or a fatal error.
    pub async fn run(mut self, mut shutdown: watch::Receiver<bool>) -> Result<(), RelayError> {
        let mut backoff = Backoff::new(&self.config.retry);
        let mut outage = OutageLog::default();
        while !*shutdown.borrow() {
            let result = match self.connect().await {
                Ok(mut session) => self.serve(&mut session, &mut shutdown, &mut backoff, &mut outage).await,
                Err(e) => Err(e),
            };
            match result {
                Ok(()) => break,
                Err(e) if e.is_fatal() => return Err(e),
                Err(e) => {
                    let delay = backoff.next_delay();
                    outage.failed(e.kind(), &e, delay);
                    health().set(State::Degraded(e.to_string()));
                    wait_or_shutdown(delay, &mut shutdown).await;
                }
            }
        }
        tracing::info!("polling stopped; flushing the producer");
        let _ = self.sink.flush(Duration::from_secs(5));
        Ok(())
    }

    async fn connect(&mut self) -> Result<Session, RelayError> {
        let (client, mut connection) = self.config.postgres.client_config().connect(NoTls).await?;
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
            let id_type = self.id_type(&client).await?;
            self.statements = Some(Statements::new(&self.config, &id_type));
        }
        let channel = &self.config.polling.notify_channel;
        if !channel.is_empty() {
            client.batch_execute(&format!("LISTEN {}", quote_ident(channel))).await?;
        }
        Ok(Session { client, notified, leader: false })
    }

    /// The SQL type of the id column, so released ids compare with its index.
    async fn id_type(&self, client: &Client) -> Result<String, RelayError> {
        let row = client
            .query_opt(
                "SELECT format_type(atttypid, atttypmod) FROM pg_attribute \
                 WHERE attrelid = to_regclass($1) AND attname = $2 AND NOT attisdropped",
                &[&self.table.qualified(), &self.config.outbox.columns.id],
            )
            .await?;
        row.map(|r| r.get(0)).ok_or_else(|| {
            RelayError::Fatal(format!(
                "outbox table {} or its id column \"{}\" does not exist: apply sql/ or fix outbox.table / outbox.columns.id",
                self.table.display_name(),
                self.config.outbox.columns.id
            ))
        })
    }

    async fn serve(
        &mut self,
        session: &mut Session,
        shutdown: &mut watch::Receiver<bool>,
        backoff: &mut Backoff,
        outage: &mut OutageLog,
    ) -> Result<(), RelayError> {
        let mut standby_logged = false;
        while !*shutdown.borrow() {
            health().tick();
            if !session.leader {
                let row = session
                    .client
                    .query_one("SELECT pg_try_advisory_lock($1)", &[&self.config.polling.leader_lock_key])
                    .await?;
                session.leader = row.get(0);
                if !session.leader {
                    if !standby_logged {
                        tracing::info!(table = %self.table.display_name(), "standby: another instance is active");
                        standby_logged = true;
                    }
                    outage.recovered();
                    health().set(State::Standby);
                    wait_or_shutdown(STANDBY_RETRY, shutdown).await;
                    continue;
                }
                tracing::info!(table = %self.table.display_name(), "active: this instance now relays the outbox");
            }
            while session.notified.try_recv().is_ok() {}
            let outcome = self.relay_batch(&mut session.client).await?;
            if outcome.claimed > 0 {
                tracing::debug!(
                    claimed = outcome.claimed,
                    published = outcome.published,
                    dead_lettered = outcome.dead_lettered,
                    "batch committed"
                );
            }
            if let Some((id, reason)) = &outcome.blocked {
                let delay = backoff.next_delay();
                tracing::error!(
                    row_id = %id, %reason, table = %self.table.display_name(),
                    "blocked at an unpublishable row (on_poison = \"block\"): fix or delete the row, or set polling.on_poison = \"dead_letter\""
                );
                wait_or_shutdown(delay, shutdown).await;
                continue;
            }
            if let Some(first) = outcome.failed.first() {
                let delay = backoff.next_delay();
                let detail = match first {
                    PublishError::Transient { detail, .. } | PublishError::Permanent(detail) => {
                        detail.clone()
                    }
                };
                let error = RelayError::Kafka(format!(
                    "{} record(s) not acknowledged: {detail}",
                    outcome.failed.len()
                ));
                outage.failed(error.kind(), &error, delay);
                health().set(State::Degraded(error.to_string()));
                self.sink.reset().map_err(|e| RelayError::Kafka(e.to_string()))?;
                wait_or_shutdown(delay, shutdown).await;
                continue;
            }
            backoff.reset();
            outage.recovered();
            health().set(State::Active);
            if outcome.claimed < self.config.polling.batch_size as usize {
                self.wait_for_work(session, shutdown).await?;
            }
        }
        Ok(())
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
                    return Err(RelayError::ConnectionLost("the postgres session ended".into()));
                }
            }
            _ = tokio::time::sleep(interval) => {}
            _ = shutdown.changed() => {}
        }
        Ok(())
    }

    /// One cycle: claim, publish, release or dead-letter, commit.
    async fn relay_batch(&self, client: &mut Client) -> Result<BatchOutcome, RelayError> {
        let statements = self.statements.as_ref().expect("statements are prepared at connect");
        let tx = client.transaction().await?;
        let limit = i64::from(self.config.polling.batch_size);
        let rows = tx.query(&statements.claim, &[&limit]).await?;
        let mut outcome = BatchOutcome { claimed: rows.len(), ..Default::default() };
        if rows.is_empty() {
            tx.commit().await?;
            return Ok(outcome);
        }
        let block = self.config.polling.on_poison == OnPoison::Block;
        let mut ids = Vec::with_capacity(rows.len());
        let mut events = Vec::with_capacity(rows.len());
        let mut poison: Vec<(String, String)> = Vec::new();
        for row in &rows {
            let (id, mapped) = self.map_row(row);
            match mapped {
                Ok(event) => {
                    ids.push(id);
                    events.push(event);
                }
                Err(reason) if block => {
                    outcome.blocked = Some((id, reason.to_string()));
                    break;
                }
                Err(reason) => poison.push((id, reason.to_string())),
            }
        }
        let m = metrics();
        m.events_read.with_label_values(&[MODE]).inc_by(rows.len() as u64);
        m.events_in_flight.set(events.len() as i64);
        let sent = Instant::now();
        let results = self.sink.publish(&events).await;
        m.events_in_flight.set(0);
        // `events` holds only rows before a row that failed to map (block policy); a record the
        // broker refuses stops the release at that row too, so nothing after it leaves the table.
        let mut delivered = Vec::with_capacity(events.len());
        let mut refused_at: Option<(String, String)> = None;
        for ((id, event), result) in ids.into_iter().zip(&events).zip(results) {
            match &result {
                Ok(_) => m.acknowledged(MODE, sent, event.created_at),
                Err(e) => m.publish_errors.with_label_values(&[e.error_type()]).inc(),
            }
            match result {
                _ if refused_at.is_some() => {}
                Ok(_) => delivered.push(id),
                Err(PublishError::Permanent(reason)) if block => refused_at = Some((id, reason)),
                Err(PublishError::Permanent(reason)) => poison.push((id, reason)),
                Err(transient) => outcome.failed.push(transient),
            }
        }
        if refused_at.is_some() {
            outcome.blocked = refused_at;
        }
        if !delivered.is_empty() {
            tx.execute(&statements.release, &[&delivered]).await?;
        }
        if !poison.is_empty() {
            let (poison_ids, reasons): (Vec<String>, Vec<String>) = poison.iter().cloned().unzip();
            let moved = tx
                .execute(&statements.dead_letter, &[&poison_ids, &reasons, &self.table.display_name()])
                .await?;
            for (id, reason) in &poison {
                tracing::warn!(row_id = %id, %reason, table = %self.table.display_name(), "event moved to the dead-letter table");
            }
            outcome.dead_lettered = moved as usize;
            m.events_dead_lettered.with_label_values(&[MODE]).inc_by(moved);
        }
        tx.commit().await?;
        outcome.published = delivered.len();
        Ok(outcome)
    }

    fn map_row(&self, row: &Row) -> (String, Result<OutboxEvent, PoisonReason>) {
        let (raw, created_at) = raw_event(row);
        let id = raw.id.clone().unwrap_or_default();
        (id, self.mapping.to_event(raw, created_at))
    }
}
