//! A one-off delivery session, for the operator commands that send (`replay-dead-letters`,
//! `republish`): the daemon's prologue and stage over records handed over at once, each waited
//! for.
//!
//! Invariants:
//! - the records go through [`prologue`] and [`Delivery`] as the daemon's do: the same headers,
//!   the same classification of Kafka's refusals, the same source identity and, with
//!   `kafka.transactional`, Kafka transactions;
//! - nothing is held or dead-lettered, whatever `on_poison` says: a record Kafka refuses is
//!   [`Delivered::Refused`] with the sink's reason, and the command keeps what it came from;
//! - with Kafka transactions the records are one transaction, committed only when Kafka
//!   acknowledged every one: one refused, and none is [`Delivered::Acked`] (the next producer of its
//!   `transactional.id` aborts it). That id is the daemon's with `:<command>` appended
//!   ([`one_off_kafka`]), so a command never fences the running relay;
//! - every record gets exactly one [`Delivered`], in the order handed over.

use std::collections::HashMap;
use std::hash::Hash;
use std::time::{Duration, Instant};

use tokio::sync::watch;

use super::{Delivery, Settled, prologue};
use crate::config::{KafkaConfig, OnPoison, RelayConfig};
use crate::dead_letter::DeadLetters;
use crate::error::RelayError;
use crate::observe::metrics::{Clock, Mode};
use crate::observe::pulse::Pulse;
use crate::outboxes::Outboxes;
use crate::readback::Lookback;
use crate::record::KafkaRecord;
use crate::sink::Sink;

/// What became of one record of a one-off session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Delivered {
    /// Kafka holds it (with Kafka transactions: its transaction committed).
    Acked,
    /// Kafka refuses it, and will until its cause is fixed: why.
    Refused(String),
    /// Not acknowledged: a transient failure, no report within the limit, or (with Kafka
    /// transactions) another record's refusal aborted the transaction: why.
    Unacknowledged(String),
}

/// The Kafka settings of a one-off session of `command` whose source identity is `source`: with
/// `kafka.transactional`, a `transactional.id` of its own (the daemon's with `:<command>`), so
/// activating it fences earlier runs of the command, never the relay.
pub(crate) fn one_off_kafka(kafka: &KafkaConfig, source: &str, command: &str) -> KafkaConfig {
    let mut kafka = kafka.clone();
    if kafka.transactional {
        kafka.transactional_id = match kafka.transactional_id.as_str() {
            "" => format!("outbox-relay:{source}:{command}"),
            id => format!("{id}:{command}"),
        };
    }
    kafka
}

/// Sends `records` through a session of their own on `sink` (whose source identities are
/// `identities`) and waits, at most `limit`, until each has its outcome; returns them in order.
/// An error: the session could not open (Kafka transactions could not be initialized).
pub(crate) async fn send_all<S: Sink, P: Clone + Eq + Hash>(
    sink: &mut S,
    config: &RelayConfig,
    identities: &[String],
    records: Vec<(P, KafkaRecord)>,
    limit: Duration,
) -> Result<Vec<(P, Delivered)>, RelayError> {
    // nothing held, nothing dead-lettered: the command keeps what Kafka refuses, and says so
    let mut config = config.clone();
    config.dead_letter.on_poison = OnPoison::DeadLetter;
    let own = config.outboxes.iter_mut().chain([&mut config.outbox]).filter_map(|o| o.dead_letter.as_mut());
    own.for_each(|letters| letters.on_poison = OnPoison::DeadLetter);
    let mode = Mode::from(config.source.mode);
    let (pulse, (_stop, shutdown)) = (Pulse::detached(), watch::channel(false));
    let opened = prologue(sink, identities, &config, (mode, Lookback::LastBatch), &pulse, &shutdown).await?;
    let dead_letters = DeadLetters::new(&Outboxes::new(&config), &config.retry, mode);
    let mut delivery = Delivery::open(&*sink, opened, (&dead_letters, &config.kafka), &pulse, mode).await;
    // (a held record is never sent again: it is refused)
    delivery.reclaims_held();
    let order: Vec<P> = records.iter().map(|(p, _)| p.clone()).collect();
    let mut outcomes = HashMap::new();
    let mut failures = Vec::new();
    for (position, record) in records {
        match delivery.send(position, record, Instant::now()).await {
            Ok(Some(settled)) => note(&mut outcomes, settled),
            Ok(None) => {}
            Err(e) => failures.push(e.to_string()),
        }
    }
    let waited = tokio::time::timeout(limit, settle(&mut delivery, &mut outcomes, &mut failures)).await;
    if waited.is_err() {
        failures.push(format!("no answer from Kafka within {} s", limit.as_secs()));
    } else if failures.is_empty() && delivery.in_transaction() {
        match delivery.commit(&Clock::now()).await {
            Ok(committed) => committed.into_iter().for_each(|settled| note(&mut outcomes, settled)),
            Err(e) => failures.push(format!("the Kafka transaction did not commit: {e}")),
        }
    }
    let why = if failures.is_empty() { "no answer from Kafka".to_string() } else { failures.join("; ") };
    let outcome = |p: P| {
        let sent = outcomes.remove(&p).unwrap_or_else(|| Delivered::Unacknowledged(why.clone()));
        (p, sent)
    };
    Ok(order.into_iter().map(outcome).collect())
}

/// Waits until nothing is in flight, noting each settled record, and each failure to settle one.
async fn settle<S: Sink, P: Clone + Eq + Hash>(
    delivery: &mut Delivery<'_, S, P>,
    outcomes: &mut HashMap<P, Delivered>,
    failures: &mut Vec<String>,
) {
    while delivery.records() > 0 {
        match delivery.next().await {
            Ok(Some(settled)) => note(outcomes, settled),
            Ok(None) => {}
            Err(e) => failures.push(e.to_string()),
        }
    }
}

/// What a settled position means here. With Kafka transactions an acknowledged record is
/// settled only by the commit, so `Acked` always means Kafka holds it for good.
fn note<P: Eq + Hash>(outcomes: &mut HashMap<P, Delivered>, settled: Settled<P>) {
    let (position, sent) = match settled {
        Settled::Acked(position) => (position, Delivered::Acked),
        Settled::DeadLettered(position, letter) => (position, Delivered::Refused(letter.reason)),
        Settled::Held(position) => (position, Delivered::Refused("Kafka refused it".into())),
    };
    outcomes.insert(position, sent);
}

#[cfg(test)]
mod tests;
