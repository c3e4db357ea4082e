//! Kafka transactions (`kafka.transactional`): the producer's transactional calls, blocking,
//! each run off the runtime's threads by the sink, and what their failures mean to the relay.
//!
//! Invariants:
//! - `init_transactions` runs only once a session is active (it holds the slot or the polling
//!   lock): it fences every earlier producer of the same `transactional.id` and aborts the
//!   transaction that one left open, so the read-back that follows sees every record the topics
//!   will ever show a `read_committed` reader of it. A standby never calls it: it would fence the
//!   active instance;
//! - a fenced producer is never used again, and its session ends as a standby
//!   ([`RelayError::Standby`]), naming the fencing: another instance took over;
//! - a transaction that must be aborted is aborted, and its session ends to be retried: nothing
//!   of it was released or confirmed, so the next session sends it again, read back first;
//! - a partition a read-back found held open below its end ([`crate::sink::Pinned`]) gets an
//!   abort marker of this producer's ([`unpin`]): records of an earlier transaction of the same
//!   `transactional.id` that the brokers took without ever ending it (a "hanging" transaction,
//!   seen after a killed instance's requests reached a broker frozen past the transaction
//!   timeout) are aborted with it, so the next read-back passes them, and their events, never
//!   confirmed, are sent again. A later commit of this producer in that partition would have
//!   made them visible, after the read-back had not seen them: duplicates.

use std::time::Duration;

use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{BaseRecord, Producer};

use super::producer::{RecordProducer, UNPIN_HEADER};
use crate::error::{FatalReason, RelayError};

/// How often a commit that failed with a retriable error is tried again.
const COMMIT_ATTEMPTS: u32 = 3;

/// How long [`init`] waits before asking a coordinator that was not ready again.
const COORDINATOR_PAUSE: Duration = Duration::from_millis(500);

/// Becomes the producer of `id` (see the module's invariants). A coordinator that is not ready
/// (a fresh cluster's `__transaction_state` still being created, "Not coordinator", a
/// coordinator moving) is asked again until `timeout` (`kafka.transaction_timeout_ms`) has
/// passed, saying what it waits for: `setup` gave up after about 5 s on a fresh cluster. Every
/// other failure is [`failed`]'s at once.
pub(super) fn init(producer: &RecordProducer, id: &str, timeout: Duration) -> Result<(), RelayError> {
    let deadline = std::time::Instant::now() + timeout;
    let mut said = false;
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        let error = match producer.init_transactions(left) {
            Ok(()) => return Ok(()),
            Err(error) => error,
        };
        if !waits_for_coordinator(&error) {
            return Err(failed(producer, id, "initialize transactions", error));
        }
        if std::time::Instant::now() + COORDINATOR_PAUSE >= deadline {
            return Err(RelayError::Kafka(coordinator_not_ready(id, timeout, &error)));
        }
        if !said {
            tracing::info!(
                transactional_id = id,
                %error,
                "waiting for the Kafka transaction coordinator (a new cluster creates it on first use); asking \
                 again until kafka.transaction_timeout_ms has passed"
            );
            said = true;
        }
        std::thread::sleep(COORDINATOR_PAUSE);
    }
}

/// A failure of `init_transactions` that says the transaction coordinator is not ready yet:
/// asking again later is the remedy (librdkafka marks it retriable).
fn waits_for_coordinator(error: &KafkaError) -> bool {
    matches!(error, KafkaError::Transaction(e) if e.is_retriable())
        || matches!(
            error.rdkafka_error_code(),
            Some(
                RDKafkaErrorCode::NotCoordinator
                    | RDKafkaErrorCode::CoordinatorNotAvailable
                    | RDKafkaErrorCode::CoordinatorLoadInProgress
                    | RDKafkaErrorCode::ConcurrentTransactions
            )
        )
}

/// What [`init`] says when the coordinator was still not ready at its deadline.
fn coordinator_not_ready(id: &str, timeout: Duration, error: &KafkaError) -> String {
    format!(
        "the Kafka transaction coordinator of transactional.id \"{id}\" was not ready within \
         kafka.transaction_timeout_ms ({} ms), last: {error}; check that every broker is up and that \
         __transaction_state can be created (transaction.state.log.replication.factor <= the brokers), then \
         try again",
        timeout.as_millis()
    )
}

/// Commits the open transaction: every record sent in it becomes visible to `read_committed`
/// readers, at once.
pub(super) fn commit(producer: &RecordProducer, id: &str, timeout: Duration) -> Result<(), RelayError> {
    outstanding_gone(producer, timeout);
    let mut attempts = 0;
    loop {
        attempts += 1;
        match producer.commit_transaction(timeout) {
            Ok(()) => return Ok(()),
            Err(KafkaError::Transaction(e)) if e.is_retriable() && attempts < COMMIT_ATTEMPTS => {
                tracing::info!(error = %e, "committing the Kafka transaction again");
            }
            Err(KafkaError::Transaction(e)) if e.txn_requires_abort() => {
                let aborted = producer.abort_transaction(timeout);
                // an instance frozen past kafka.transaction_timeout_ms comes back to a transaction
                // the brokers aborted and an epoch they bumped (or a newer producer's): its commit
                // fails "abortable" with a fencing code, and that is what it is told, not a retry
                if let Some(fenced) = fenced(producer, id) {
                    return Err(fenced);
                }
                if is_fencing(e.code()) {
                    return Err(fenced_error(id, &e.to_string()));
                }
                return Err(RelayError::Kafka(format!(
                    "the Kafka transaction could not commit ({e}) and was aborted{}: nothing of it is visible to \
                     read_committed consumers, and its events are sent again",
                    if aborted.is_ok() {
                        ""
                    } else {
                        " (the abort failed too: the brokers abort it at kafka.transaction_timeout_ms)"
                    }
                )));
            }
            Err(e) => return Err(failed(producer, id, "commit the transaction", e)),
        }
    }
}

/// How often [`outstanding_gone`] looks again.
const OUTSTANDING_PAUSE: Duration = Duration::from_micros(200);

/// Waits (at most `timeout`) until librdkafka counts no message outstanding. A message stays
/// outstanding for a moment after its delivery report reached the relay (the task serving the
/// producer's queue still holds the report's event), and rust-rdkafka's `commit_transaction`
/// flushes first, polling a fixed 100 ms whenever one is: measured, that made about one commit
/// in five take 100 ms (BENCHMARKS.md, "Kafka transactions").
fn outstanding_gone(producer: &RecordProducer, timeout: Duration) {
    let deadline = std::time::Instant::now() + timeout;
    while producer.in_flight_count() > 0 && std::time::Instant::now() < deadline {
        std::thread::sleep(OUTSTANDING_PAUSE);
    }
}

/// Aborts a transaction of this producer holding one record in each of `pinned` (numbered from
/// `first`): see the module's invariants. Runs right after [`init`], before the session sends.
pub(super) fn unpin(
    producer: &RecordProducer,
    id: &str,
    pinned: &[(String, i32)],
    first: usize,
    timeout: Duration,
) -> Result<(), RelayError> {
    begin(producer, id)?;
    for (n, (topic, partition)) in pinned.iter().enumerate() {
        let headers = OwnedHeaders::new().insert(Header { key: UNPIN_HEADER, value: Some(id) });
        let record =
            BaseRecord::with_opaque_to(topic, first + n).partition(*partition).key(UNPIN_HEADER).payload("");
        producer
            .send(record.headers(headers))
            .map_err(|(e, _)| failed(producer, id, "write to a pinned partition", e))?;
    }
    // (an abort purges what was not sent yet: the partitions must be in the transaction first)
    producer.flush(timeout).map_err(|e| failed(producer, id, "write to a pinned partition", e))?;
    producer
        .abort_transaction(timeout)
        .map_err(|e| failed(producer, id, "abort the unpinning transaction", e))?;
    tracing::warn!(
        transactional_id = id,
        partitions = ?pinned,
        "aborted a transaction in each partition found held open: an earlier transaction of this \
         transactional.id left there unended is aborted with it, and its events are sent again"
    );
    Ok(())
}

/// Begins a transaction (a local step: the brokers hear of it with its first record).
pub(super) fn begin(producer: &RecordProducer, id: &str) -> Result<(), RelayError> {
    producer.begin_transaction().map_err(|e| failed(producer, id, "begin a transaction", e))
}

/// Why the producer was fenced, if it was: another instance initialized the same
/// `transactional.id` after it.
pub(super) fn fenced(producer: &RecordProducer, id: &str) -> Option<RelayError> {
    let (code, reason) = producer.client().fatal_error()?;
    is_fencing(code).then(|| fenced_error(id, &reason))
}

/// A code that says a newer epoch of the transactional.id exists: another instance initialized
/// it, or the coordinator bumped it when it aborted this producer's transaction at
/// `kafka.transaction_timeout_ms` (KIP-360).
fn is_fencing(code: RDKafkaErrorCode) -> bool {
    matches!(
        code,
        RDKafkaErrorCode::Fenced | RDKafkaErrorCode::ProducerFenced | RDKafkaErrorCode::InvalidProducerEpoch
    )
}

fn fenced_error(id: &str, reason: &str) -> RelayError {
    tracing::warn!(
        transactional_id = id,
        reason,
        "fenced: a newer producer of this transactional.id exists; this one stops publishing at once and stands by"
    );
    RelayError::Standby(format!(
        "fenced: a newer producer of transactional.id \"{id}\" exists ({reason}): another instance took over, or \
         the brokers aborted this one's transaction after kafka.transaction_timeout_ms; this one no longer \
         publishes, stands by, and relays again only once it is the active instance"
    ))
}

/// What a failed transactional call means: fenced (standby), a setting or an ACL to fix
/// (fatal), or a Kafka outage (retried with a fresh producer).
fn failed(producer: &RecordProducer, id: &str, what: &str, error: KafkaError) -> RelayError {
    if let Some(fenced) = fenced(producer, id) {
        return fenced;
    }
    match error.rdkafka_error_code() {
        Some(code) if is_fencing(code) => fenced_error(id, &error.to_string()),
        Some(RDKafkaErrorCode::TransactionalIdAuthorizationFailed) => RelayError::fatal(
            FatalReason::Privilege,
            format!(
                "Kafka refuses to let the relay {what} as transactional.id \"{id}\" ({error}): grant its principal \
                 WRITE and DESCRIBE on TransactionalId \"{id}\" (kafka-acls --add --allow-principal ... --operation \
                 Write --operation Describe --transactional-id '{id}'), or set kafka.transactional = false"
            ),
        ),
        Some(RDKafkaErrorCode::ClusterAuthorizationFailed) => RelayError::fatal(
            FatalReason::Privilege,
            format!(
                "Kafka refuses to let the relay {what} ({error}): brokers before 2.8 also need IDEMPOTENT_WRITE on \
                 the cluster for the principal"
            ),
        ),
        Some(RDKafkaErrorCode::InvalidTransactionTimeout) => RelayError::fatal(
            FatalReason::Config,
            format!(
                "the brokers refuse kafka.transaction_timeout_ms ({error}): it must not exceed their \
                 transaction.max.timeout.ms (900000 by default)"
            ),
        ),
        _ => RelayError::Kafka(format!("cannot {what} as transactional.id \"{id}\": {error}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `setup` gave up after about 5 s on "Not coordinator" of a fresh cluster: a coordinator
    /// that is not ready is waited for, a refusal is not.
    #[test]
    fn a_coordinator_not_ready_is_waited_for_and_a_refusal_is_not() {
        for code in [
            RDKafkaErrorCode::NotCoordinator,
            RDKafkaErrorCode::CoordinatorNotAvailable,
            RDKafkaErrorCode::CoordinatorLoadInProgress,
            RDKafkaErrorCode::ConcurrentTransactions,
        ] {
            assert!(waits_for_coordinator(&KafkaError::Global(code)), "{code:?}");
        }
        for code in [
            RDKafkaErrorCode::TransactionalIdAuthorizationFailed,
            RDKafkaErrorCode::ClusterAuthorizationFailed,
            RDKafkaErrorCode::InvalidTransactionTimeout,
            RDKafkaErrorCode::ProducerFenced,
        ] {
            assert!(!waits_for_coordinator(&KafkaError::Global(code)), "{code:?}");
        }
        let error = KafkaError::Global(RDKafkaErrorCode::NotCoordinator);
        assert_eq!(
            coordinator_not_ready("relay-1", Duration::from_secs(60), &error),
            "the Kafka transaction coordinator of transactional.id \"relay-1\" was not ready within \
             kafka.transaction_timeout_ms (60000 ms), last: Global error: NotCoordinator (Broker: Not \
             coordinator); check that every broker is up and that __transaction_state can be created \
             (transaction.state.log.replication.factor <= the brokers), then try again"
        );
    }

    /// A frozen instance back after the transaction timeout fails its commit "abortable" with
    /// one of these codes: it is told it was fenced (it never said so, and retried).
    #[test]
    fn the_codes_of_a_bumped_epoch_are_fencing_and_an_outage_is_not() {
        for code in [
            RDKafkaErrorCode::ProducerFenced,
            RDKafkaErrorCode::InvalidProducerEpoch,
            RDKafkaErrorCode::Fenced,
        ] {
            assert!(is_fencing(code), "{code:?}");
        }
        for code in [
            RDKafkaErrorCode::NotCoordinator,
            RDKafkaErrorCode::CoordinatorLoadInProgress,
            RDKafkaErrorCode::RequestTimedOut,
            RDKafkaErrorCode::ConcurrentTransactions,
        ] {
            assert!(!is_fencing(code), "{code:?}");
        }
        let fenced =
            fenced_error("relay-1", "Broker: Producer attempted to produce with an old epoch").to_string();
        assert!(fenced.contains("fenced") && fenced.contains("kafka.transaction_timeout_ms"), "{fenced}");
    }
}
