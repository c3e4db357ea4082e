//! The stage's own loop: [`Delivery::next`] waits on everything that settles a position or is
//! due while records wait (the sink's reports, the stall watch, the hold's retry, the Kafka
//! transaction's age), so no source pumps reports itself.
//!
//! Invariants:
//! - cancel-safe: a report is taken from [`Delivery::received`] and from the in-flight ring only
//!   after the last await of its settling, so a `next` dropped by its caller's `select!` loses
//!   nothing (the sink's `recv_many` receives nothing when it loses a race);
//! - one report settles at a time, in arrival order; an error settling one leaves the rest
//!   received, for the caller that goes on (polling settles its whole batch);
//! - the commit itself is the source's (it commits where its own transactions allow): the
//!   deadline only wakes it.

use crate::dead_letter::DeadLetter;
use crate::error::RelayError;
use crate::observe::metrics::{Clock, TransactionOutcome, metrics};
use crate::record::KafkaRecord;
use crate::sink::{PublishError, Report, Sink};

use super::in_flight::Sent;
use super::{Delivery, Refused, Settled};

/// The most reports taken from the sink at once.
const REPORT_TURN: usize = 256;

impl<S: Sink, P: Clone> Delivery<'_, S, P> {
    /// The next outcome: `Some` when a position settled; `None` when something else happened
    /// that the source may act on (the stall watch looked, a held record was sent again, the
    /// open Kafka transaction came due, a report of an earlier session's record was passed
    /// over). In this order (biased): reports received, the sink's reports (while records are
    /// in flight), the stall tick, the hold's retry, the commit deadline.
    pub(crate) async fn next(&mut self) -> Result<Option<Settled<P>>, RelayError> {
        if self.received.is_empty() {
            let records = self.in_flight.records() + self.aside.len();
            let retry_at = self.retry_at().filter(|_| self.resends_held);
            // armed only before the transaction is due: one due already is the source's to commit
            let deadline = self.transaction.as_ref().filter(|_| !self.commit_due(false));
            let deadline = deadline.and_then(|t| t.deadline());
            let mut batch = Vec::new();
            tokio::select! {
                biased;
                _ = self.reports.recv_many(&mut batch, REPORT_TURN), if records > 0 => {
                    self.received.extend(batch);
                    self.received_at = Clock::now();
                }
                _ = self.stall_tick.tick() => {
                    self.check_stall();
                    return Ok(None);
                }
                _ = sleep_until(retry_at) => {
                    self.retry_held().await?;
                    return Ok(None);
                }
                _ = sleep_until(deadline) => return Ok(None),
            }
        }
        let clock = self.received_at;
        self.settle_received(&clock).await
    }

    /// Settles the first received report (see the module's cancel-safety).
    async fn settle_received(&mut self, clock: &Clock) -> Result<Option<Settled<P>>, RelayError> {
        let Some(report) = self.received.front() else { return Ok(None) };
        let event = self.in_flight.get(report.seq).map(|sent| &sent.event);
        let event = event.or_else(|| self.aside.get(&report.seq).map(|(_, record)| record));
        let failure = match (&report.outcome, event) {
            (Err(e), Some(event)) if self.sink.fenced().is_none() => Some(self.sink.classify(event, e).await),
            _ => None,
        };
        let report = self.received.pop_front().expect("looked at");
        self.settle(report, failure, clock)
    }

    /// One report from the sink (with its failure classified): what its record's position
    /// became. `None`: a report of no record of this stage's (an earlier session's), or a
    /// refused resend (still held).
    fn settle(
        &mut self,
        report: Report,
        failure: Option<PublishError>,
        clock: &Clock,
    ) -> Result<Option<Settled<P>>, RelayError> {
        if let Some((key, event)) = self.aside.remove(&report.seq) {
            self.settle_aside(key, event, report, failure, clock)?;
            return Ok(None);
        }
        let Some(Sent { position, event, at, .. }) = self.in_flight.take(report.seq) else { return Ok(None) };
        let resent =
            self.held.as_ref().is_some_and(|h| h.resending.is_some_and(|(seq, _)| seq == report.seq));
        if let Ok(written) = report.outcome {
            self.stall.progressed(clock.now, self.pulse);
            let span = self.spans.as_ref().and_then(|spans| spans.acknowledged(&event, written));
            if let Some(transaction) = self.transaction.as_mut() {
                // settled by the commit
                transaction.acked(super::Acked {
                    position,
                    at,
                    created_at: event.created_at,
                    outbox: event.outbox,
                    span,
                });
                if resent {
                    self.resent_accepted();
                }
                return Ok(None);
            }
            self.pulse.progressed();
            metrics().acknowledged_at(&self.published, at, event.created_at, clock);
            self.published_by_outbox[event.outbox].inc();
            if let (Some(spans), Some(span)) = (&self.spans, span) {
                spans.finish(*span);
            }
            if resent {
                self.resent_accepted();
            }
            return Ok(Some(Settled::Acked(position)));
        }
        if let Some(fenced) = self.sink.fenced() {
            metrics().kafka_transactions.with_label_values(&[TransactionOutcome::Fenced.label()]).inc();
            return Err(fenced);
        }
        let failure = failure.expect("a failed report of a record in flight is classified");
        metrics().publish_errors.with_label_values(&[failure.error_type().label()]).inc();
        match failure {
            PublishError::Transient { detail, .. } => {
                Err(RelayError::Unacknowledged { event: event.id.to_string(), detail })
            }
            PublishError::Permanent(reason) if self.transaction.is_some() => {
                Err(self.refused_in_transaction(event, reason))
            }
            PublishError::Permanent(_) if resent => {
                self.held.as_mut().expect("held").resending = None;
                Ok(None)
            }
            PublishError::Permanent(reason) if self.dead_letters.blocks(event.outbox) => {
                let refused = Refused { seq: report.seq, position: position.clone(), record: event.clone() };
                self.hold(DeadLetter::refused(event, reason), Some(refused));
                Ok(Some(Settled::Held(position)))
            }
            PublishError::Permanent(reason) => {
                Ok(Some(Settled::DeadLettered(position, Box::new(DeadLetter::refused(event, reason)))))
            }
        }
    }

    /// The report of an aside record ([`super::live`]): noted under `key`, settling no position.
    /// With Kafka transactions an acknowledged one is done at the commit, and a refused one
    /// ends the session (the next producer aborts the transaction: none of it is visible).
    fn settle_aside(
        &mut self,
        key: usize,
        event: KafkaRecord,
        report: Report,
        failure: Option<PublishError>,
        clock: &Clock,
    ) -> Result<(), RelayError> {
        use super::once::Delivered;
        if report.outcome.is_ok() {
            self.stall.progressed(clock.now, self.pulse);
            match self.transaction.is_some() {
                true => self.aside_uncommitted.push(key),
                false => self.aside_done.push((key, Delivered::Acked)),
            }
            return Ok(());
        }
        if let Some(fenced) = self.sink.fenced() {
            return Err(fenced);
        }
        let failure = failure.expect("a failed report of an aside record is classified");
        metrics().publish_errors.with_label_values(&[failure.error_type().label()]).inc();
        let delivered = match failure {
            PublishError::Permanent(reason) if self.transaction.is_some() => {
                metrics().kafka_transactions.with_label_values(&[TransactionOutcome::Aborted.label()]).inc();
                return Err(RelayError::Kafka(format!(
                    "Kafka refused event {} sent aside from the stream inside a Kafka transaction ({reason}): the \
                     transaction is aborted, so nothing of it is visible to read_committed consumers",
                    event.id
                )));
            }
            PublishError::Permanent(reason) => Delivered::Refused(reason),
            PublishError::Transient { detail, .. } => Delivered::Unacknowledged(detail),
        };
        self.aside_done.push((key, delivered));
        Ok(())
    }

    /// Kafka refused `event` inside the open transaction, which must now be aborted: the session
    /// ends (a fresh producer aborts it), remembering the refusal for the next session under
    /// `on_poison = "dead_letter"`.
    fn refused_in_transaction(&self, event: KafkaRecord, reason: String) -> RelayError {
        let id = event.id.clone();
        let then = if self.dead_letters.blocks(event.outbox) {
            "under dead_letter.on_poison = \"block\" it is sent again after a backoff, and nothing after it commits \
             until Kafka takes it"
        } else {
            "the next session dead-letters it without sending it and commits the rest"
        };
        self.dead_letters.remember_refused(DeadLetter::refused(event, reason.clone()));
        metrics().kafka_transactions.with_label_values(&[TransactionOutcome::Aborted.label()]).inc();
        RelayError::Kafka(format!(
            "Kafka refused event {id} inside a Kafka transaction ({reason}): the transaction is aborted, so nothing of \
             it is visible to read_committed consumers; {then}"
        ))
    }
}

/// Resolves at `at`; never without one.
async fn sleep_until(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}
