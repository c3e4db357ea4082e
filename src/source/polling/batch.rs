//! One claim's rows through the delivery stage: what polling decides between claiming rows and
//! releasing them, apart from PostgreSQL (the claim's transaction is the caller's), so it is
//! unit-tested against the scripted sink.
//!
//! Invariants:
//! - a claim never mixes rows Kafka already holds (an earlier session's claim that did not
//!   commit) with records it sends: it releases those alone and leaves the rest to the next
//!   claim, so only the newest claim can hold rows still in the outbox (a later session reads
//!   back just that one). Mixed, a claim that did not commit either would leave the older rows'
//!   records behind it, unread: duplicates;
//! - records are sent in id order; the poison policy is the stage's. Under `on_poison =
//!   "block"` nothing after a row that cannot map is sent, and the row of a refused record stays
//!   claimed by nobody: while the stage holds, each claim is the held row alone, mapped again
//!   (an operator's fix included) and sent again at the hold's backoff;
//! - a claim is settled when every record it sent has its report, at the latest by its
//!   deadline (`polling.claim_timeout_ms`): past it the claim is rolled back rather than hold
//!   row locks and the xmin horizon;
//! - a transient failure ends the session, but only after what Kafka acknowledged in the same
//!   claim is released: rows Kafka holds are not sent again (with Kafka transactions nothing
//!   of the claim is committed then, so nothing of it is released but rows read back);
//! - with Kafka transactions a claim is one transaction, committed (within the deadline)
//!   before its rows are released.

use std::time::Instant;

use crate::config::OutboxId;
use crate::dead_letter::DeadLetter;
use crate::delivery::{Delivery, Settled};
use crate::error::RelayError;
use crate::observe::metrics::{Clock, ErrorType, metrics};
use crate::record::{KafkaRecord, Mapping, Position};
use crate::sink::Sink;
use crate::table::RowAt;

use super::claim::{Claimed, ClaimedRow};

/// A claimed row: where it lies, and its record or the letter of why it cannot become one.
pub(super) type Row = (RowAt, Result<KafkaRecord, Box<DeadLetter>>);

/// When a claim gives up waiting for Kafka.
#[derive(Debug, Clone, Copy)]
pub(super) struct Deadline {
    pub(super) at: tokio::time::Instant,
    /// `polling.claim_timeout_ms`, for the error that names it.
    pub(super) claim_timeout_ms: u64,
}

/// What a claim's rows became once every record it sent is settled.
#[derive(Debug, Default)]
pub(super) struct Settlement {
    /// The rows Kafka holds (acknowledged now, or written by an earlier session) or
    /// replication mode dead-lettered: release them.
    pub(super) release: Vec<RowAt>,
    /// Letters to write to the dead-letter table, in the claim's transaction...
    pub(super) letters: Vec<DeadLetter>,
    /// ...and their rows, to delete from the outbox.
    pub(super) lettered: Vec<RowAt>,
    /// Rows the outbox's transforms filter out: released unsent, not recorded as published.
    pub(super) filtered: Vec<RowAt>,
    /// The first transient failure: the session ends once the claim is released and committed.
    pub(super) failed: Option<RelayError>,
    /// Rows were left for the next claim (they came with rows Kafka holds): claim again at once.
    pub(super) again: bool,
}

impl Settlement {
    fn add(&mut self, settled: Settled<RowAt>) {
        match settled {
            Settled::Acked(at) => self.release.push(at),
            Settled::DeadLettered(at, letter) => {
                self.letters.push(*letter);
                self.lettered.push(at);
            }
            // the row stays: the stage holds at it
            Settled::Held(_) => {}
        }
    }
}

/// The claimed rows as records at their claim positions (`batch:<session>-<batch>:<index>`);
/// an unread row (over `polling.max_row_bytes`, `max_row_bytes`) is a letter of `outbox`. The
/// rows the outbox's transforms filter out come apart, second: they are released unsent.
pub(super) fn map(
    mapping: &Mapping,
    rows: Claimed,
    (session, batch): (u64, u64),
    (outbox, max_row_bytes): (OutboxId, usize),
) -> Result<(Vec<Row>, Vec<RowAt>), RelayError> {
    let (mut mapped, mut filtered) = (Vec::with_capacity(rows.len()), Vec::new());
    for (index, row) in rows.into_iter().enumerate() {
        let ClaimedRow { at, raw, created_at, unread } = row;
        if let Some(bytes) = unread {
            let letter = DeadLetter::unread(at.clone(), bytes, max_row_bytes).in_outbox(outbox);
            mapped.push((at, Err(Box::new(letter))));
            continue;
        }
        let record = match mapping.to_record(raw, created_at)? {
            Ok(mut record) => {
                record.position = Some(Position::Batch { session, batch, index: index as u32 });
                Ok(record)
            }
            Err(refused) if refused.filtered_by().is_some() => {
                filtered.push(at);
                continue;
            }
            Err(unpublishable) => Err(Box::new(DeadLetter::unmapped(*unpublishable))),
        };
        mapped.push((at, record));
    }
    Ok((mapped, filtered))
}

/// Hands the claimed `rows` to the stage and waits until every record sent is settled.
/// `settled`: rows released unsent whatever happens (replication mode dead-lettered them).
/// Every topic of `rows` was read back already.
pub(super) async fn deliver<S: Sink>(
    delivery: &mut Delivery<'_, S, RowAt>,
    rows: Vec<Row>,
    mut settled: Vec<RowAt>,
    deadline: Deadline,
) -> Result<Settlement, RelayError> {
    let mut to_send = Vec::with_capacity(rows.len());
    for (at, row) in rows {
        if let Ok(record) = &row
            && delivery.written(record).await?
        {
            settled.push(at);
        } else {
            to_send.push((at, row));
        }
    }
    let mut settlement = Settlement::default();
    if delivery.holding() {
        retry_held(delivery, to_send, !settled.is_empty()).await?;
    } else if !settled.is_empty() && to_send.iter().any(|(_, row)| row.is_ok()) {
        // (a row held at comes again with the rest: holding now would pass it over forever)
        return Ok(Settlement { release: settled, again: true, ..Settlement::default() });
    } else {
        send(delivery, to_send, &mut settlement).await?;
    }
    settlement.release.append(&mut settled);
    let m = metrics();
    m.events_in_flight.set(delivery.records() as i64);
    m.bytes_in_flight.set(delivery.bytes() as i64);
    let waited = settle(delivery, deadline, &mut settlement).await;
    m.events_in_flight.set(0);
    m.bytes_in_flight.set(0);
    waited?;
    if settlement.failed.is_none() {
        // with Kafka transactions, what Kafka acknowledged settles now, at the commit
        // (within the claim's deadline too: the claim holds row locks and the xmin horizon)
        let committed = tokio::time::timeout_at(deadline.at, delivery.commit(&Clock::now())).await;
        let committed = committed.map_err(|_| {
            RelayError::Kafka(format!(
                "the Kafka transaction did not commit within polling.claim_timeout_ms ({} ms): the claim was \
                 rolled back, and its rows are published again",
                deadline.claim_timeout_ms
            ))
        })?;
        for settled in committed? {
            settlement.add(settled);
        }
    }
    Ok(settlement)
}

/// Sends the records of `rows` in order; a row that cannot map is dead-lettered, or held at
/// (nothing after it is sent).
async fn send<S: Sink>(
    delivery: &mut Delivery<'_, S, RowAt>,
    rows: Vec<Row>,
    settlement: &mut Settlement,
) -> Result<(), RelayError> {
    let now = Instant::now();
    for (at, row) in rows {
        let settled = match row {
            Ok(record) => match delivery.send(at, record, now).await? {
                Some(settled) => settled,
                None => continue,
            },
            Err(letter) => delivery.unpublishable(at, *letter),
        };
        let held = matches!(settled, Settled::Held(_));
        settlement.add(settled);
        if held {
            break;
        }
    }
    Ok(())
}

/// While holding, the claim is the held row alone (the first in id order): sent again as it
/// maps now, or reported again when it still cannot map; `gone` when Kafka or the dead-letter
/// table turned out to hold it.
async fn retry_held<S: Sink>(
    delivery: &mut Delivery<'_, S, RowAt>,
    rows: Vec<Row>,
    gone: bool,
) -> Result<(), RelayError> {
    if gone {
        delivery.held_gone();
        return Ok(());
    }
    match rows.into_iter().next() {
        Some((at, Ok(record))) => delivery.retry_held_as(Some((at, record))).await,
        Some((_, Err(_))) => delivery.retry_held_as(None).await,
        None => Ok(()),
    }
}

/// Waits for the report of every record in flight, at most until `deadline`. A failure to
/// settle one (the first is kept) does not stop the others: what Kafka acknowledged is released.
async fn settle<S: Sink>(
    delivery: &mut Delivery<'_, S, RowAt>,
    deadline: Deadline,
    settlement: &mut Settlement,
) -> Result<(), RelayError> {
    while delivery.records() > 0 {
        tokio::select! {
            settled = delivery.next() => match settled {
                Ok(Some(settled)) => settlement.add(settled),
                Ok(None) => {}
                Err(e) => {
                    settlement.failed.get_or_insert(e);
                }
            },
            _ = tokio::time::sleep_until(deadline.at) => {
                let waiting = delivery.records();
                metrics().publish_errors.with_label_values(&[ErrorType::Timeout.label()]).inc_by(waiting as u64);
                return Err(RelayError::Kafka(format!(
                    "{waiting} record(s) not acknowledged within polling.claim_timeout_ms ({} ms): the claim was \
                     rolled back so it does not hold row locks and the xmin horizon; the batch is published again",
                    deadline.claim_timeout_ms
                )));
            }
        }
    }
    // nothing waits any more: a stall, if any, is over
    delivery.check_stall();
    Ok(())
}

#[cfg(test)]
mod tests;
