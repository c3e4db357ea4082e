//! Sinks: where records go. [`Sink`] is the seam between the delivery stage
//! ([`crate::delivery`]) and Kafka; [`kafka::KafkaSink`] is the one real sink, and
//! `scripted::ScriptedSink` (tests only) a double whose faults a test scripts.
//!
//! Invariants every sink keeps:
//! - records are handed over in the order given, and a sink keeps that order per partition
//!   (key); back-pressure is waited out, never skipped;
//! - every record handed over gets exactly one [`Report`], under the number
//!   [`Sink::enqueue`] gave it; numbers only grow over a sink's life, across sessions;
//! - a report is `Ok` only when the record is durably written (`acks=all`); a failed report is
//!   classified by [`Sink::classify`]: permanent (poison) or transient (send again);
//! - a sink outlives the sessions of its source, and the supervisor owns it: [`Sink::recover`]
//!   after a failed session,
//!   [`Sink::retired`] before the next one reads topics back, [`Sink::flush`] at shutdown;
//! - a transactional sink (`kafka.transactional`) is activated by each active session before it
//!   reads topics back, and never by a standby; its records become visible to `read_committed`
//!   readers only at [`Sink::commit`], all of a transaction at once; a partition its read-back
//!   found held open by a transaction ([`Pinned`]) is unpinned at the next activation.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{MutexGuard, mpsc};

use crate::error::RelayError;
use crate::observe::metrics::ErrorType;
use crate::record::KafkaRecord;

pub mod kafka;
#[cfg(test)]
pub(crate) mod scripted;

/// Partitions, by topic, that a read-back found held below their end by an open Kafka
/// transaction (`kafka.transactional`): a `read_committed` reader stops at such a transaction's
/// first record, so what the partition holds after it cannot be read back. The session that
/// found them ends; the next activation of the sink aborts a transaction of its own with one
/// record in each (see `KafkaSink::activate`). Shared by a sink and its sessions' read-backs.
#[derive(Debug, Clone, Default)]
pub(crate) struct Pinned(Arc<std::sync::Mutex<Vec<(String, i32)>>>);

impl Pinned {
    /// Remembers `partitions` of `topic` for the next activation.
    pub(crate) fn add(&self, topic: &str, partitions: impl IntoIterator<Item = i32>) {
        let mut pinned = self.0.lock().unwrap();
        for partition in partitions {
            if !pinned.iter().any(|(t, p)| t == topic && *p == partition) {
                pinned.push((topic.to_string(), partition));
            }
        }
    }

    /// The partitions remembered, forgotten now.
    pub(crate) fn take(&self) -> Vec<(String, i32)> {
        std::mem::take(&mut *self.0.lock().unwrap())
    }
}

/// One record's report: the number [`Sink::enqueue`] gave it, and whether Kafka acknowledged it.
#[derive(Debug)]
pub(crate) struct Report {
    pub(crate) seq: usize,
    pub(crate) outcome: Result<Written, SendFailure>,
}

/// Where Kafka wrote an acknowledged record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Written {
    pub(crate) partition: i32,
    pub(crate) offset: i64,
}

/// Why a record was not acknowledged, as the sink that sent it saw it: opaque to the stage,
/// which asks that sink what it means ([`Sink::classify`]). No client library's type crosses
/// the seam.
#[derive(Debug)]
pub(crate) struct SendFailure(Failure);

#[derive(Debug)]
enum Failure {
    /// librdkafka's error, for the Kafka sink's classification.
    Kafka(rdkafka::error::KafkaError),
    /// A test double's outcome, classified when scripted.
    #[cfg(test)]
    Scripted(PublishError),
}

impl SendFailure {
    fn kafka(error: rdkafka::error::KafkaError) -> SendFailure {
        SendFailure(Failure::Kafka(error))
    }

    #[cfg(test)]
    fn scripted(classified: PublishError) -> SendFailure {
        SendFailure(Failure::Scripted(classified))
    }

    fn as_kafka(&self) -> Option<&rdkafka::error::KafkaError> {
        match &self.0 {
            Failure::Kafka(error) => Some(error),
            #[cfg(test)]
            Failure::Scripted(_) => None,
        }
    }

    /// What a failure that was classified when it was made means.
    fn classified(&self) -> PublishError {
        match &self.0 {
            Failure::Kafka(error) => {
                PublishError::Transient { error_type: ErrorType::Other, detail: error.to_string() }
            }
            #[cfg(test)]
            Failure::Scripted(classified) => classified.clone(),
        }
    }
}

impl std::fmt::Display for SendFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.0 {
            Failure::Kafka(error) => error.fmt(f),
            #[cfg(test)]
            Failure::Scripted(PublishError::Permanent(reason)) => f.write_str(reason),
            #[cfg(test)]
            Failure::Scripted(PublishError::Transient { detail, .. }) => f.write_str(detail),
        }
    }
}

/// Why one record was not acknowledged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum PublishError {
    /// The broker will never take this record (too large, topic missing, not authorized).
    Permanent(String),
    /// Worth retrying: broker down, timeout, leader change, back-pressure.
    Transient { error_type: ErrorType, detail: String },
}

impl PublishError {
    /// The `error_type` label of `outbox_relay_publish_errors_total`.
    pub(crate) fn error_type(&self) -> ErrorType {
        match self {
            PublishError::Permanent(_) => ErrorType::Permanent,
            PublishError::Transient { error_type, .. } => *error_type,
        }
    }
}

/// How long a session waits for the producer of a failed one to be destroyed (`Sink::retired`).
pub(crate) const RETIRE_LIMIT: Duration = Duration::from_secs(10);

/// Where a sink's reports arrive.
pub(crate) type Reports = mpsc::UnboundedReceiver<Report>;

/// Where records go, in order, each acknowledged or refused by one report; and the sink's life
/// across its source's sessions.
pub(crate) trait Sink: Send + Sync {
    /// Hands `record` over after every record handed over before it, waiting out back-pressure,
    /// and returns its number: its report arrives on [`Sink::reports`] (a record refused at once
    /// is reported there too).
    fn enqueue(&self, record: &KafkaRecord) -> impl Future<Output = usize> + Send;

    /// The delivery reports, for the one session that sends: hold the guard while sending. A
    /// report numbered before the holder's first record is an earlier session's: pass it over.
    fn reports(&self) -> impl Future<Output = MutexGuard<'_, Reports>> + Send;

    /// What the failed report `failure` of `record` means.
    fn classify(
        &self,
        record: &KafkaRecord,
        failure: &SendFailure,
    ) -> impl Future<Output = PublishError> + Send;

    /// The source identity the records of each outbox (by place) carry as
    /// `outbox_relay_source` (when `kafka.source_headers`): a session sets them once it knows
    /// its database.
    fn set_sources(&mut self, sources: &[String]);

    /// Those identities, once set (none without source headers): what the read-back
    /// recognises this relay's records by.
    fn sources(&self) -> &[Arc<str>];

    /// Waits (at most `limit`) until nothing handed over in a failed session can still be
    /// written, so a read-back sees everything the topics will ever hold of it.
    fn retired(&mut self, limit: Duration) -> impl Future<Output = ()> + Send;

    /// After a failed session: starts the next one clean.
    fn recover(&mut self);

    /// At shutdown: waits a little for what was handed over.
    fn flush(&self) -> impl Future<Output = ()> + Send;

    /// Whether records go in Kafka transactions ([`Sink::begin`], [`Sink::commit`]).
    fn transactional(&self) -> bool;

    /// Once a session is active, before it reads topics back: a transactional sink becomes the
    /// one producer of its source (fencing the ones before it), and unpins what its sessions'
    /// read-backs found [`Pinned`]. Nothing otherwise.
    fn activate(&mut self) -> impl Future<Output = Result<(), RelayError>> + Send;

    /// Begins a transaction, before the first record handed over in it.
    fn begin(&self) -> Result<(), RelayError>;

    /// Commits the transaction; every record handed over in it was reported already.
    fn commit(&self) -> impl Future<Output = Result<(), RelayError>> + Send;

    /// Why the sink may not send any more (another producer fenced it), if so.
    fn fenced(&self) -> Option<RelayError>;

    /// Where its sessions' read-backs leave the partitions they found [`Pinned`].
    fn pinned(&self) -> Pinned;

    /// Learns anew whether `topics` exist, before records a request sends aside
    /// ([`crate::delivery::live`]): a topic created since the sink last asked (a dead letter's,
    /// replayed) is then written, not refused as unknown.
    fn refresh_topics(&self, _topics: &[String]) -> impl Future<Output = ()> + Send {
        async {}
    }
}

/// The Kafka sink's own methods are the seam's: the trait forwards to them.
impl Sink for kafka::KafkaSink {
    fn enqueue(&self, record: &KafkaRecord) -> impl Future<Output = usize> + Send {
        kafka::KafkaSink::enqueue(self, record)
    }

    fn reports(&self) -> impl Future<Output = MutexGuard<'_, Reports>> + Send {
        kafka::KafkaSink::reports(self)
    }

    fn classify(
        &self,
        record: &KafkaRecord,
        failure: &SendFailure,
    ) -> impl Future<Output = PublishError> + Send {
        kafka::KafkaSink::classify(self, record, failure)
    }

    fn set_sources(&mut self, sources: &[String]) {
        kafka::KafkaSink::set_sources(self, sources)
    }

    fn sources(&self) -> &[Arc<str>] {
        kafka::KafkaSink::sources(self)
    }

    fn retired(&mut self, limit: Duration) -> impl Future<Output = ()> + Send {
        kafka::KafkaSink::retired(self, limit)
    }

    fn recover(&mut self) {
        kafka::KafkaSink::recover(self)
    }

    fn flush(&self) -> impl Future<Output = ()> + Send {
        kafka::KafkaSink::flush(self)
    }

    fn transactional(&self) -> bool {
        kafka::KafkaSink::transactional(self)
    }

    fn activate(&mut self) -> impl Future<Output = Result<(), RelayError>> + Send {
        kafka::KafkaSink::activate(self)
    }

    fn begin(&self) -> Result<(), RelayError> {
        kafka::KafkaSink::begin(self)
    }

    fn commit(&self) -> impl Future<Output = Result<(), RelayError>> + Send {
        kafka::KafkaSink::commit(self)
    }

    fn fenced(&self) -> Option<RelayError> {
        kafka::KafkaSink::fenced(self)
    }

    fn pinned(&self) -> Pinned {
        kafka::KafkaSink::pinned(self)
    }

    fn refresh_topics(&self, topics: &[String]) -> impl Future<Output = ()> + Send {
        kafka::KafkaSink::refresh_topics(self, topics)
    }
}
