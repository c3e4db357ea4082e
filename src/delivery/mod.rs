//! The delivery stage: the one path from a source to a sink. A source hands it
//! `(position, record)`, or `(position, dead letter)` for a row that cannot become a record, and
//! gets back settled outcomes by position: [`Settled::Acked`], [`Settled::DeadLettered`],
//! [`Settled::Held`]. What the source then does with a position (confirm an LSN, release a
//! claimed row, count a copied row) is the source's; how a record gets to Kafka is this stage's.
//!
//! Invariants:
//! - every position handed over settles exactly once, in one of three ways: `Acked` (Kafka
//!   acknowledged its record, or the read-back found it written by an earlier session: it is
//!   not sent again), `DeadLettered` (unpublishable under `dead_letter.on_poison =
//!   "dead_letter"`: the source writes the letter where it releases the position), or `Held`
//!   (`on_poison = "block"`: nothing at or after the position may be released). A transient
//!   failure settles nothing: it ends the session with an error, and the source's unreleased
//!   positions are read again by the next one;
//! - `dead_letter.on_poison` is consulted here and nowhere else;
//! - records go to the sink in the order they are handed over; the stage keeps each in flight
//!   until its report, and says how many records and bytes are in flight, for the source's
//!   bounds;
//! - while held, the first refused record (in send order, among the refusals reported so far:
//!   one of another partition may still be to come, but a partition's reports come in the order
//!   its records were sent, so per key this is send order) is sent again at the hold's backoff
//!   until Kafka takes it (it then settles `Acked`), then the next; a row that cannot map is reported again at backoff and stays held until the relay
//!   restarts with another policy, unless the source reads it again fixed (polling:
//!   [`Delivery::retry_held_as`]);
//! - a hold and Kafka's silence outlive a session only when the source carries them over
//!   ([`Delivery::carry`], [`Delivery::resume`]);
//! - the stall watch sees exactly the records in flight.
//!
//! With Kafka transactions (`kafka.transactional`, [`transaction`]) a record Kafka acknowledged
//! settles only when its transaction commits ([`Delivery::commit`], which the source calls where
//! it may: between its own transactions, when [`Delivery::commit_due`]); a record Kafka refuses
//! aborts the transaction and ends the session instead of settling: under `on_poison =
//! "dead_letter"` the next session dead-letters it unsent and commits the rest, under "block"
//! it is sent again after the session's backoff, with nothing after it committed.
//!
//! The stage runs itself ([`Delivery::next`], `settle.rs`): a source `select!`s on it beside its
//! own input, and opens it once per session through the prologue (`open.rs`); the operator
//! commands that send (`replay-dead-letters`, `republish`) open a one-off session of it ([`once`])
//! offline, and beside a running relay hand their records to its active session, which sends
//! them aside from its positions ([`live`], [`Delivery::send_aside`]). Several outbox
//! tables are several mappings in front of one stage: a record says which outbox it came from.

use std::collections::VecDeque;
use std::time::Instant;

use prometheus::IntCounter;
use tokio::sync::MutexGuard;

use crate::config::{OutboxId, PerOutbox};
use crate::dead_letter::{DeadLetter, DeadLetters, Hold};
use crate::error::RelayError;
use crate::observe::metrics::{Clock, metrics};
use crate::observe::pulse::Pulse;
use crate::observe::trace::Links;
use crate::readback::Dedup;
use crate::record::KafkaRecord;
use crate::sink::kafka::StallWatch;
use crate::sink::{Report, Reports, Sink};

#[cfg(test)]
pub(crate) mod fixture;
mod in_flight;
pub(crate) mod live;
pub(crate) mod once;
mod open;
mod settle;
#[cfg(test)]
mod tests;
mod traced;
mod transaction;

use in_flight::{InFlight, Sent};
#[cfg(test)]
use open::Prologue;
pub(crate) use open::prologue;
use transaction::{Acked, Transaction};

/// What became of a position.
#[derive(Debug)]
pub(crate) enum Settled<P> {
    /// Kafka holds the record.
    Acked(P),
    /// Unpublishable, and the policy is to dead-letter: the source writes `DeadLetter`.
    DeadLettered(P, Box<DeadLetter>),
    /// Unpublishable, and the policy is to block: the stage holds at it.
    Held(P),
}

/// A record Kafka refused, held.
struct Refused<P> {
    /// Its number when first sent: the held records keep their send order.
    seq: usize,
    position: P,
    record: KafkaRecord,
}

/// Held at an unpublishable event.
struct Held<P> {
    /// Reports the first unpublishable event and paces the retries.
    hold: Hold,
    /// Records Kafka refused, in the order they were first sent (not the order of their
    /// reports); the first is sent again first.
    refused: VecDeque<Refused<P>>,
    /// The id of a row that cannot map, handed over after `refused`: in the stream and the copy
    /// only a restart with another policy moves on; polling reads the row again at each retry.
    unmapped: Option<String>,
    /// The resend in flight: its number, and the first number of the record it resends.
    resending: Option<(usize, usize)>,
    next_try: tokio::time::Instant,
}

/// What a stage leaves to its source's next session (polling's): the hold, whose backoff keeps
/// growing, and since when Kafka has acknowledged nothing, so a claim abandoned at its deadline
/// and sent again does not restart the silence.
pub(crate) struct Carried<P> {
    held: Option<Held<P>>,
    silent_since: Option<Instant>,
}

pub(crate) struct Delivery<'a, S: Sink, P> {
    sink: &'a S,
    dead_letters: &'a DeadLetters,
    pulse: &'a Pulse,
    /// Events an earlier session already wrote are settled without being sent.
    dedup: Dedup,
    in_flight: InFlight<P>,
    stall: StallWatch,
    held: Option<Held<P>>,
    /// With `kafka.transactional`: the open Kafka transaction.
    transaction: Option<Transaction<P>>,
    /// The mode's `events_published_total` (looked up once).
    published: IntCounter,
    /// Each outbox's `outbox_events_published_total`, by place (looked up once).
    published_by_outbox: PerOutbox<IntCounter>,
    /// The sink's reports: this stage is the one sending while it lives.
    reports: MutexGuard<'a, Reports>,
    /// Reports received and not settled yet, in arrival order ([`Delivery::next`]).
    received: VecDeque<Report>,
    /// When they were received: one clock read for the run.
    received_at: Clock,
    /// When the stall watch looks next.
    stall_tick: tokio::time::Interval,
    /// Whether [`Delivery::next`] sends a held record again when due; off for polling, which
    /// claims the held row again itself ([`Delivery::retry_held_as`]).
    resends_held: bool,
    /// With `[tracing]` on: the stage's spans.
    spans: Option<traced::Spans>,
    /// With `[tracing]` on: the publish spans of the records handed to the sink since the
    /// source last took them ([`Delivery::take_carried`]), for the spans of its own work.
    carried: Links,
    /// Records sent aside from the source's positions ([`live`]: a republish or a replay the
    /// active session carries out), by the sink's number: their request's key.
    aside: std::collections::HashMap<usize, (usize, KafkaRecord)>,
    /// Aside records Kafka acknowledged inside the open Kafka transaction: done at its commit.
    aside_uncommitted: Vec<usize>,
    /// What became of aside records, by key, not yet taken ([`Delivery::take_aside`]).
    aside_done: Vec<(usize, once::Delivered)>,
}

impl<'a, S: Sink, P: Clone> Delivery<'a, S, P> {
    /// The source claims a held row again itself ([`Delivery::retry_held_as`], polling):
    /// [`Delivery::next`] does not send it again.
    pub(crate) fn reclaims_held(&mut self) {
        self.resends_held = false;
    }

    /// Hands `record`, read at `position`, to the sink (`at`: when, as the caller's clock read
    /// it); settled at once when the topic already holds it (`Acked`), or, with Kafka
    /// transactions, when Kafka refused it in an aborted transaction (`DeadLettered`).
    pub(crate) async fn send(
        &mut self,
        position: P,
        record: KafkaRecord,
        at: Instant,
    ) -> Result<Option<Settled<P>>, RelayError> {
        if self.transaction.is_some()
            && let Some(letter) = self.dead_letters.refused_before(&record)
        {
            tracing::info!(event_id = %record.id, "Kafka refused this event in the transaction aborted before: dead-lettered unsent");
            return Ok(Some(Settled::DeadLettered(position, Box::new(letter))));
        }
        if self.dedup.written(&record, self.pulse).await? {
            return Ok(Some(Settled::Acked(position)));
        }
        self.enqueue(position, record, at).await?;
        Ok(None)
    }

    /// Hands `event` to the sink (in the open Kafka transaction, begun now if none is).
    async fn enqueue(
        &mut self,
        position: P,
        mut event: KafkaRecord,
        at: Instant,
    ) -> Result<usize, RelayError> {
        if let Some(spans) = &self.spans
            && event.trace.is_none()
        {
            // (a record sent again keeps its span, carried already by what first sent it)
            spans.begin(&mut event);
            if let Some(begun) = &event.trace {
                self.carried.push(begun.context);
            }
        }
        let bytes = event.size();
        self.in_transaction_sent(bytes)?;
        let seq = self.sink.enqueue(&event).await;
        self.in_flight.insert(seq, Sent { position, event, at, bytes });
        self.stall.waiting();
        Ok(seq)
    }

    /// With Kafka transactions: a record of `bytes` goes into the open one (begun now if none is).
    fn in_transaction_sent(&mut self, bytes: usize) -> Result<(), RelayError> {
        if let Some(transaction) = self.transaction.as_mut() {
            if !transaction.is_open() {
                self.sink.begin()?;
                transaction.begun();
            }
            transaction.sent(bytes);
        }
        Ok(())
    }

    /// Hands `record` to the sink aside from the source's positions ([`live`]): it settles no
    /// position; what became of it is [`Delivery::take_aside`]'s, under `key`. Not read back
    /// first (a republished record is a copy on purpose), never held or dead-lettered.
    pub(crate) async fn send_aside(&mut self, key: usize, record: KafkaRecord) -> Result<(), RelayError> {
        self.in_transaction_sent(record.size())?;
        let seq = self.sink.enqueue(&record).await;
        self.aside.insert(seq, (key, record));
        self.stall.waiting();
        Ok(())
    }

    /// The publish spans of the records handed to the sink since the last call (the first
    /// [`crate::observe::trace::MAX_LINKS`], and how many more): what the source's work carried.
    /// Always empty with `[tracing]` off.
    pub(crate) fn take_carried(&mut self) -> Links {
        std::mem::take(&mut self.carried)
    }

    /// Learns anew whether `topics` exist (see [`Sink::refresh_topics`]).
    pub(crate) async fn refresh_topics(&self, topics: &[String]) {
        self.sink.refresh_topics(topics).await
    }

    /// Aside records handed over and not done yet (with Kafka transactions: not committed).
    pub(crate) fn aside_waiting(&self) -> usize {
        self.aside.len() + self.aside_uncommitted.len()
    }

    /// Aside records handed over with no report yet.
    pub(crate) fn aside_in_flight(&self) -> usize {
        self.aside.len()
    }

    /// What became of the aside records done since the last call, by key.
    pub(crate) fn take_aside(&mut self) -> Vec<(usize, once::Delivered)> {
        std::mem::take(&mut self.aside_done)
    }

    /// A row read at `position` cannot become a record: `letter` says why.
    pub(crate) fn unpublishable(&mut self, position: P, letter: DeadLetter) -> Settled<P> {
        if self.dead_letters.blocks(letter.outbox) {
            self.hold(letter, None);
            Settled::Held(position)
        } else {
            Settled::DeadLettered(position, Box::new(letter))
        }
    }

    /// Whether the open Kafka transaction should commit (`idle`: the source has nothing more to
    /// read right now); never without `kafka.transactional` or an open transaction.
    pub(crate) fn commit_due(&self, idle: bool) -> bool {
        self.transaction.as_ref().is_some_and(|t| t.due(idle))
    }

    /// Whether a Kafka transaction is open.
    pub(crate) fn in_transaction(&self) -> bool {
        self.transaction.as_ref().is_some_and(Transaction::is_open)
    }

    /// Commits the open Kafka transaction, with nothing in flight, and returns what it settles:
    /// every record Kafka acknowledged in it, `Acked`, in order. Nothing without one.
    pub(crate) async fn commit(&mut self, clock: &Clock) -> Result<Vec<Settled<P>>, RelayError> {
        // (aside records in flight: their request commits once each has its report)
        if !self.in_transaction() || !self.aside.is_empty() {
            return Ok(Vec::new());
        }
        debug_assert_eq!(self.in_flight.records(), 0, "a commit with records in flight");
        // a commit Kafka does not answer is a stall like a record it does not acknowledge
        self.stall.waiting();
        let commit_began = std::time::SystemTime::now();
        let committed = {
            let (commit, pulse) = (self.sink.commit(), self.pulse);
            tokio::pin!(commit);
            let mut check = tokio::time::interval(self.stall.period());
            loop {
                tokio::select! {
                    done = &mut commit => break done,
                    _ = check.tick() => self.stall.check(1, pulse),
                }
            }
        };
        self.stall.check(0, self.pulse);
        committed?;
        let aside = std::mem::take(&mut self.aside_uncommitted);
        self.aside_done.extend(aside.into_iter().map(|key| (key, once::Delivered::Acked)));
        let mut acked = self.transaction.as_mut().expect("open").committed();
        if let Some(spans) = &self.spans {
            let finished = acked.iter_mut().filter_map(|a| a.span.take().map(|s| *s)).collect();
            spans.committed(commit_began, finished);
        }
        if !acked.is_empty() {
            self.pulse.progressed();
        }
        let m = metrics();
        let settle = |a: Acked<P>| {
            m.acknowledged_at(&self.published, a.at, a.created_at, clock);
            self.published_by_outbox[a.outbox].inc();
            Settled::Acked(a.position)
        };
        Ok(acked.into_iter().map(settle).collect())
    }

    /// Starts holding (or adds to the hold: a refused record in its send order, which says so
    /// when it is now the first held event).
    fn hold(&mut self, letter: DeadLetter, refused: Option<Refused<P>>) {
        let Some(held) = self.held.as_mut() else {
            let unmapped = refused.is_none().then(|| letter.id.clone());
            let mut hold = self.dead_letters.hold(letter, self.pulse);
            let next_try = tokio::time::Instant::now() + hold.next_delay();
            let refused = refused.into_iter().collect();
            self.held = Some(Held { hold, refused, unmapped, resending: None, next_try });
            return;
        };
        let Some(refused) = refused else {
            held.unmapped = Some(letter.id);
            return;
        };
        let place = held.refused.partition_point(|r| r.seq < refused.seq);
        held.refused.insert(place, refused);
        if place == 0 {
            held.hold.letter = letter;
            held.hold.report(self.pulse);
        }
    }

    /// When to call [`Delivery::retry_held`]: while held and no resend is in flight.
    pub(crate) fn retry_at(&self) -> Option<tokio::time::Instant> {
        self.held.as_ref().filter(|h| h.resending.is_none()).map(|h| h.next_try)
    }

    /// Resolves when [`Delivery::retry_held`] is due; never while nothing is held or a resend
    /// is in flight.
    pub(crate) async fn retry_due(&self) {
        match self.retry_at() {
            Some(at) => tokio::time::sleep_until(at).await,
            None => std::future::pending().await,
        }
    }

    /// Sends the first refused record again, or reports the held row again.
    pub(crate) async fn retry_held(&mut self) -> Result<(), RelayError> {
        let first = self.held.as_ref().expect("held").refused.front();
        let first = first.map(|r| (r.position.clone(), r.record.clone()));
        self.retry_held_as(first).await
    }

    /// Retries the hold with the first held event as the source read it again (polling claims
    /// its row anew: the operator may have fixed it): `Some` is sent in its place, `None` (the
    /// row still cannot map, or another session locks it) reports the hold again. An error
    /// (a Kafka transaction that cannot begin: the producer was fenced) ends the session.
    pub(crate) async fn retry_held_as(&mut self, first: Option<(P, KafkaRecord)>) -> Result<(), RelayError> {
        let held = self.held.as_mut().expect("held");
        held.next_try = tokio::time::Instant::now() + held.hold.next_delay();
        let Some((position, record)) = first else {
            held.hold.report(self.pulse);
            return Ok(());
        };
        tracing::info!(event_id = %record.id, "sending the held record again");
        let first_seq = match held.refused.front_mut() {
            Some(front) => {
                (front.position, front.record) = (position.clone(), record.clone());
                front.seq
            }
            None => {
                // the row that could not map maps now (polling read it again): it is sent
                held.unmapped = None;
                held.refused.push_back(Refused {
                    seq: 0,
                    position: position.clone(),
                    record: record.clone(),
                });
                0
            }
        };
        let seq = self.enqueue(position, record, Instant::now()).await?;
        self.held.as_mut().expect("held").resending = Some((seq, first_seq));
        Ok(())
    }

    /// The record being sent again was taken: move on to the next held event, or stop holding.
    fn resent_accepted(&mut self) {
        let held = self.held.as_mut().expect("held");
        let (_, first_seq) = held.resending.take().expect("a resend");
        held.refused.retain(|r| r.seq != first_seq);
        self.release_if_done();
    }

    /// The first held event left the source without being sent (polling: its row was deleted,
    /// or Kafka or the dead-letter table turned out to hold it): move on to the next, or stop
    /// holding.
    pub(crate) fn held_gone(&mut self) {
        let held = self.held.as_mut().expect("held");
        if held.refused.pop_front().is_none() {
            held.unmapped = None;
        }
        self.release_if_done();
    }

    fn release_if_done(&mut self) {
        if self.held.as_ref().is_some_and(|h| h.refused.is_empty() && h.unmapped.is_none()) {
            let held = self.held.take().expect("held");
            held.hold.release(self.pulse);
        }
    }

    /// The outbox of the first held event (see [`Delivery::held_id`]).
    pub(crate) fn held_outbox(&self) -> Option<OutboxId> {
        let held = self.held.as_ref()?;
        Some(held.refused.front().map_or(held.hold.letter.outbox, |r| r.record.outbox))
    }

    /// The id of the first held event: the one the source must read again first.
    pub(crate) fn held_id(&self) -> Option<&str> {
        let held = self.held.as_ref()?;
        held.refused.front().map(|r| r.record.id.as_str()).or(held.unmapped.as_deref())
    }

    /// Ends the session's stage, keeping what the next session carries on with.
    pub(crate) fn carry(self) -> Carried<P> {
        let silent_since = (self.in_flight.records() > 0).then(|| self.stall.quiet_since());
        let held = self.held.map(|held| Held { resending: None, ..held });
        Carried { held, silent_since }
    }

    /// Carries on from an earlier session's stage: a hold is reported again at once.
    pub(crate) fn resume(&mut self, carried: Option<Carried<P>>) {
        let Some(Carried { held, silent_since }) = carried else { return };
        if let Some(since) = silent_since {
            self.stall.silent_since(since);
        }
        if let Some(held) = &held {
            held.hold.report(self.pulse);
        }
        self.held = held;
    }

    /// The topics of `records` the read-back has not read yet (none when it is off).
    pub(crate) fn unread<'r>(&self, records: impl IntoIterator<Item = &'r KafkaRecord>) -> Vec<&'r str> {
        self.dedup.unread(records)
    }

    /// Reads `topic` back (polling does it outside its claim: it may take long).
    pub(crate) async fn read_back(&mut self, topic: &str) -> Result<(), RelayError> {
        self.dedup.read_back(topic, self.pulse).await
    }

    /// Whether Kafka holds `record` already, from an earlier session (polling asks before it
    /// sends: a claim never mixes rows Kafka holds with records it sends).
    pub(crate) async fn written(&mut self, record: &KafkaRecord) -> Result<bool, RelayError> {
        self.dedup.written(record, self.pulse).await
    }

    /// Whether the stage holds at an unpublishable event.
    pub(crate) fn holding(&self) -> bool {
        self.held.is_some()
    }

    /// Records handed to the sink and not yet reported.
    pub(crate) fn records(&self) -> usize {
        self.in_flight.records()
    }

    /// The bytes of those records.
    pub(crate) fn bytes(&self) -> usize {
        self.in_flight.bytes()
    }

    /// The periodic liveness tick and stall check, over the records in flight (not held ones).
    pub(crate) fn check_stall(&mut self) {
        self.stall.check(self.in_flight.records() + self.aside.len(), self.pulse);
    }
}
