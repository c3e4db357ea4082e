//! One claim-deliver-release cycle of one outbox (`relay_batch`): claim rows in a
//! transaction, hand their records to the delivery stage, and in the same transaction release
//! the rows Kafka holds and move the dead letters to their table, then commit.
//!
//! Invariants:
//! - a row leaves the outbox only in the transaction that claimed it, after Kafka acknowledged
//!   its record (or an earlier session's, found by the read-back) or its letter was written;
//! - nothing waits on Kafka or reads a topic back while the claim holds row locks longer than
//!   `polling.claim_timeout_ms`: a topic not read back yet is read with the claim rolled back;
//! - while the stage holds at a row, only that row is claimed, and nothing past it is released;
//! - with `[tracing]` on, a claim that committed makes a `polling claim` span from its
//!   transaction's begin to its commit, linked to the publish spans of the records it sent (the
//!   work-span sampling rule, [`crate::observe::trace::Work`]); a claim of no rows, or one rolled
//!   back, makes none.

use std::collections::BTreeSet;
use std::time::{Duration, Instant, SystemTime};

use tokio_postgres::Transaction;

use super::batch::{self, Deadline, Settlement};
use super::claim::{self, HeldRow, Prepared, already_dead_lettered};
use super::{MODE, PollingSource, Session};
use crate::config::OutboxId;
use crate::delivery::Delivery;
use crate::error::RelayError;
use crate::observe::metrics::metrics;
use crate::observe::trace::{Value, Work, tracer};
use crate::outboxes::Outbox;
use crate::published::Sent;
use crate::sink::Sink;
use crate::table::RowAt;

/// What one claim-deliver-release cycle did.
#[derive(Debug, Default)]
pub(super) struct BatchOutcome {
    pub(super) claimed: usize,
    /// The claim ended at `polling.batch_size` or `polling.max_batch_bytes`, or left rows for
    /// the next claim: more rows may wait.
    pub(super) full: bool,
    pub(super) released: usize,
    pub(super) dead_lettered: u64,
    /// The first record that failed transiently; its row (and every row not acknowledged)
    /// stays and is published by a later session.
    pub(super) failed: Option<RelayError>,
}

/// How a claim began: its rows, or why the batch ends before it begins.
enum Claim {
    /// The rows claimed, and whether the claim ended at the limit or the budget.
    Rows(claim::Claimed, bool),
    /// The held row is still unpublished, but another session locks it (while fixing it, say).
    HeldElsewhere,
    /// The held row left the outbox and the stage holds at the next one: claimed at the next retry.
    HeldNext,
}

/// A claim's rows, mapped, in the transaction that locks them.
struct Claimed<'t> {
    tx: Transaction<'t>,
    rows: Vec<batch::Row>,
    /// Rows released unsent (their events were dead-lettered by replication mode).
    dead_lettered: Vec<RowAt>,
    /// Rows the outbox's transforms filter out: released unsent, not recorded as published.
    filtered: Vec<RowAt>,
    /// How many rows were claimed.
    claimed: usize,
    /// When the claim's transaction began.
    began: Instant,
    /// The same, by the wall clock, with `[tracing]` on: the start of its span.
    span_start: Option<SystemTime>,
    /// When the claim gives up waiting for Kafka.
    deadline: Deadline,
}

impl PollingSource {
    /// One cycle of outbox `outbox`: claim, deliver, write the dead letters and release, commit.
    pub(super) async fn relay_batch<S: Sink>(
        &self,
        session: &mut Session,
        outbox: OutboxId,
        delivery: &mut Delivery<'_, S, RowAt>,
    ) -> Result<BatchOutcome, RelayError> {
        let batch = session.batches;
        session.batches += 1;
        // the claim transaction holds row locks and the database's xmin horizon: waiting for Kafka
        // takes at most polling.claim_timeout_ms, then it rolls back (dropping `tx`)
        let claim_timeout_ms = self.config.polling.claim_timeout_ms;
        let at = tokio::time::Instant::now() + Duration::from_millis(claim_timeout_ms);
        let deadline = Deadline { at, claim_timeout_ms };
        let began = Instant::now();
        let span_start = tracer().map(|_| {
            // (records of a claim that did not commit are not this one's)
            delivery.take_carried();
            SystemTime::now()
        });
        let tx = session.client.transaction().await?;
        let (rows, full) = match self.claim(&tx, &session.prepared[outbox], outbox, delivery).await? {
            Claim::Rows(rows, full) => (rows, full),
            Claim::HeldElsewhere => {
                // nothing past the held row is published while it waits
                tx.rollback().await?;
                delivery.retry_held_as(None).await?;
                return Ok(BatchOutcome::default());
            }
            Claim::HeldNext => {
                // the next held row is claimed at the next retry
                tx.rollback().await?;
                return Ok(BatchOutcome::default());
            }
        };
        if rows.is_empty() {
            tx.commit().await?;
            return Ok(BatchOutcome { full, ..BatchOutcome::default() });
        }
        let claimed = rows.len();
        let (rows, dead_lettered) = already_dead_lettered(&session.dead_lettered[outbox], rows);
        let row_bound = (outbox, self.config.polling.max_row_bytes);
        let (rows, filtered) =
            batch::map(&self.outboxes[outbox].mapping, rows, (session.nonce, batch), row_bound)?;
        let unread = delivery.unread(rows.iter().filter_map(|(_, row)| row.as_ref().ok()));
        let unread: Vec<String> = unread.into_iter().map(String::from).collect();
        if !unread.is_empty() {
            // a topic not read back yet is read outside the claim (it may take long: it must not
            // hold row locks and the xmin horizon), then the same rows are claimed again
            tx.rollback().await?;
            for topic in unread {
                delivery.read_back(&topic).await?;
            }
            return Ok(BatchOutcome { full: true, ..BatchOutcome::default() });
        }
        let claim = Claimed { tx, rows, dead_lettered, filtered, claimed, began, span_start, deadline };
        let (settlement, dead_lettered) =
            self.deliver(claim, &session.prepared[outbox], outbox, delivery).await?;
        Ok(BatchOutcome {
            claimed,
            full: full || settlement.again,
            released: settlement.release.len(),
            dead_lettered,
            failed: settlement.failed,
        })
    }

    /// Claims outbox `outbox`'s next rows in `tx` (while holding at a row, only that row: the
    /// first in id order), or says why the batch ends before it begins.
    async fn claim<S: Sink>(
        &self,
        tx: &Transaction<'_>,
        prepared: &Prepared,
        outbox: OutboxId,
        delivery: &mut Delivery<'_, S, RowAt>,
    ) -> Result<Claim, RelayError> {
        let statements = self.polled[outbox].statements.as_ref().expect("statements are prepared at connect");
        let polling = &self.config.polling;
        let limit = if delivery.holding() { 1 } else { polling.batch_size as usize };
        let bounds =
            claim::Bounds { limit, budget: polling.max_batch_bytes, max_row_bytes: polling.max_row_bytes };
        let (rows, full) = claim::claim(tx, prepared, bounds).await?;
        Ok(match claim::held_row(tx, statements, delivery.held_id(), &rows).await? {
            HeldRow::Claimed => Claim::Rows(rows, full),
            HeldRow::Skipped => Claim::HeldElsewhere,
            HeldRow::Gone => {
                delivery.held_gone();
                if delivery.holding() { Claim::HeldNext } else { Claim::Rows(rows, full) }
            }
        })
    }

    /// Delivers the claimed rows, releases what settled and writes the letters in the claim's
    /// transaction, and commits it; returns the settlement and how many letters were written.
    async fn deliver<S: Sink>(
        &self,
        claim: Claimed<'_>,
        prepared: &Prepared,
        outbox: OutboxId,
        delivery: &mut Delivery<'_, S, RowAt>,
    ) -> Result<(Settlement, u64), RelayError> {
        let Claimed { tx, rows, dead_lettered, filtered, claimed, began, span_start, deadline } = claim;
        // (one copy per distinct topic, not per row)
        let topics: BTreeSet<&str> =
            rows.iter().filter_map(|(_, row)| row.as_ref().ok()).map(|r| r.topic.as_str()).collect();
        let topics = topics.into_iter().map(String::from).collect();
        let claimed_at = began.elapsed();
        let mut settlement = batch::deliver(delivery, rows, dead_lettered, deadline).await?;
        // (never sent, whatever became of the claim's records: released with them)
        settlement.filtered = filtered;
        let delivered_at = began.elapsed();
        let read =
            if settlement.again { settlement.release.len() + settlement.filtered.len() } else { claimed };
        metrics().events_read.with_label_values(&[MODE.label()]).inc_by(read as u64);
        let written = self.release(&tx, &self.outboxes[outbox], prepared, &settlement, topics).await?;
        tx.commit().await?;
        if let Some(start) = span_start {
            self.claim_span(start, (outbox, claimed, written), &settlement, delivery);
        }
        if !settlement.filtered.is_empty() {
            let name = &self.outboxes[outbox].name;
            metrics()
                .outbox_events_filtered
                .with_label_values(&[name])
                .inc_by(settlement.filtered.len() as u64);
        }
        tracing::debug!(
            claimed,
            claim_ms = claimed_at.as_millis() as u64,
            deliver_ms = (delivered_at - claimed_at).as_millis() as u64,
            release_ms = (began.elapsed() - delivered_at).as_millis() as u64,
            "batch phases"
        );
        self.dead_letters.report(&settlement.letters);
        Ok((settlement, written))
    }

    /// The span of a committed claim of `claimed` rows of `outbox` (`letters` written), linked
    /// to the records it sent.
    fn claim_span<S: Sink>(
        &self,
        start: SystemTime,
        (outbox, claimed, letters): (OutboxId, usize, u64),
        settlement: &Settlement,
        delivery: &mut Delivery<'_, S, RowAt>,
    ) {
        let Some(tracer) = tracer() else { return };
        let attributes = vec![
            ("outbox_relay.mode", Value::from(MODE.label())),
            ("outbox_relay.outbox", self.outboxes[outbox].name.clone().into()),
            ("outbox_relay.batch_size", Value::Int(claimed as i64)),
            ("outbox_relay.released", Value::Int(settlement.release.len() as i64)),
            ("outbox_relay.dead_lettered", Value::Int(letters as i64)),
            ("outbox_relay.filtered", Value::Int(settlement.filtered.len() as i64)),
        ];
        let error = settlement.failed.as_ref().map(ToString::to_string);
        let links = delivery.take_carried();
        tracer.work(Work { name: "polling claim", start, links, attributes, error });
    }

    /// Releases the settled rows (recording them as published, to some of the claim's `topics`)
    /// and moves the dead letters to their table, in `tx`; returns how many letters were written.
    async fn release(
        &self,
        tx: &Transaction<'_>,
        outbox: &Outbox,
        statements: &Prepared,
        settlement: &Settlement,
        topics: BTreeSet<String>,
    ) -> Result<u64, RelayError> {
        let Settlement { release, letters, lettered, filtered, .. } = settlement;
        if !filtered.is_empty() {
            let (tableoids, ctids) = RowAt::params(filtered);
            tx.execute(&statements.release, &[&tableoids, &ctids]).await?;
        }
        if !release.is_empty() {
            let (tableoids, ctids) = RowAt::params(release);
            tx.execute(&statements.release, &[&tableoids, &ctids]).await?;
        }
        let sent = Sent::of(release.iter().map(|r| r.id.as_str()), topics)
            .with_filtered(filtered.iter().map(|r| r.id.as_str()));
        if !sent.is_empty() {
            outbox.recorder(tx).await?.record(tx, &sent).await?;
        }
        if letters.is_empty() {
            return Ok(0);
        }
        let written = self.dead_letters.write(tx, letters).await?;
        let (tableoids, ctids) = RowAt::params(lettered);
        tx.execute(&statements.delete, &[&tableoids, &ctids]).await?;
        Ok(written)
    }
}
