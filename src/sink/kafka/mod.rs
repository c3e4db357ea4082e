//! The Kafka producer: `acks=all` and the idempotent producer, always.
//!
//! Invariants:
//! - records are enqueued in the order given; a full local queue is waited out, never skipped,
//!   so the idempotent producer keeps per-partition order;
//! - every record enqueued gets exactly one numbered report ([`KafkaSink::reports`]);
//! - each failure is classified where it happens: permanent (the record can never be accepted:
//!   it is poison) or transient (retry the batch);
//! - with `kafka.transactional`, the producer is transactional and initialized only by
//!   [`KafkaSink::activate`] (an active session's); a fenced one is never used again.
//!
//! Files by concern: [`client`] (librdkafka settings, log levels), [`producer`] (the producer,
//! its numbered reports, the relay's headers), [`classify`] (what a failed report means),
//! [`stall`] (the stall watch), [`transaction`] (the transactional calls and what their failures
//! mean); this file is the sink that uses them.

use std::collections::HashSet;
use std::io::Write;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{BaseRecord, Producer};
use tokio::sync::{Mutex, MutexGuard, mpsc};

use crate::config::KafkaConfig;
use crate::error::RelayError;
use crate::observe::metrics::{TransactionOutcome, metrics};
use crate::record::KafkaRecord;
use crate::sink::{Pinned, PublishError, Report, SendFailure};

mod classify;
mod client;
pub(crate) mod cluster;
mod producer;
mod stall;
mod transaction;

use classify::{error_type, topic_is_unknown};
pub(crate) use client::{ReaderContext, log_client_error, log_librdkafka, reader_config};
pub use client::{
    TokenContext, client_config, mark_stopping, oauth_token, producer_config, serve_token_request,
};
use producer::{Channel, RecordProducer, create_producer};
pub(crate) use producer::{POSITION_HEADER, REPLAYED_HEADER, REPUBLISHED_HEADER, SOURCE_HEADER};
pub(crate) use stall::StallWatch;

/// The headers of a record sent again as first written, exactly.
fn as_written(written: &crate::record::AsWritten) -> OwnedHeaders {
    let mut headers = OwnedHeaders::new_with_capacity(written.headers.len());
    for (key, value) in &written.headers {
        headers = headers.insert(Header { key, value: value.as_deref() });
    }
    headers
}

/// How long a metadata request may take when classifying a timed-out record.
const METADATA_TIMEOUT: Duration = Duration::from_secs(5);
/// How long shutdown waits for records handed to the producer.
const FLUSH_TIMEOUT: Duration = Duration::from_secs(5);
/// Pause before re-enqueueing after librdkafka's local queue was full.
const QUEUE_FULL_PAUSE: Duration = Duration::from_millis(5);
/// Topics a producer looks up on first sight, at most (a `topic` column with unbounded values
/// must not grow memory without bound); topics past it are not looked up.
const LOOKED_UP_TOPICS: usize = 10_000;

pub struct KafkaSink {
    config: KafkaConfig,
    producer: Arc<RecordProducer>,
    /// The reports of `producer`'s records. One session sends at a time and holds the lock
    /// while it does ([`KafkaSink::reports`]); a report numbered before the holder's first
    /// record is an earlier session's, and is passed over.
    reports: Mutex<mpsc::UnboundedReceiver<Report>>,
    /// A record refused at enqueue is reported on the same channel.
    refusals: mpsc::UnboundedSender<Report>,
    /// The number of the next record enqueued.
    next_seq: AtomicUsize,
    /// `outbox_relay_source` of the records of each outbox (by place), once the session knows
    /// its database; empty without `kafka.source_headers`.
    sources: Vec<Arc<str>>,
    /// The topics this producer was given a record for, each looked up in the metadata once
    /// ([`KafkaSink::look_up`]).
    looked_up: std::sync::Mutex<HashSet<String>>,
    /// The producer replaced by [`KafkaSink::reset`], being destroyed; a read-back waits for it,
    /// so none of its records lands after the relay looked.
    retiring: Option<tokio::task::JoinHandle<()>>,
    /// With `kafka.transactional`, once the source is known: the `transactional.id`.
    transactional_id: Option<Arc<str>>,
    /// `producer` is transactional and initialized ([`KafkaSink::activate`]); false after a
    /// failed session, so the next active one starts on a fresh producer.
    initialized: std::sync::atomic::AtomicBool,
    /// Partitions read-backs found held open by a transaction: unpinned at the next activation.
    pinned: Pinned,
}

impl KafkaSink {
    pub fn new(config: &KafkaConfig) -> Result<KafkaSink, KafkaError> {
        let Channel { producer, reports, refusals } = create_producer(config, None)?;
        Ok(KafkaSink {
            config: config.clone(),
            producer,
            reports: Mutex::new(reports),
            refusals,
            next_seq: AtomicUsize::new(0),
            sources: Vec::new(),
            looked_up: std::sync::Mutex::new(HashSet::new()),
            retiring: None,
            transactional_id: None,
            initialized: std::sync::atomic::AtomicBool::new(false),
            pinned: Pinned::default(),
        })
    }

    /// The delivery reports, for the one session that sends: hold the guard while sending.
    pub(crate) async fn reports(&self) -> MutexGuard<'_, mpsc::UnboundedReceiver<Report>> {
        self.reports.lock().await
    }

    /// The source identities written as `outbox_relay_source` (when `kafka.source_headers`),
    /// one per outbox; the first one's names the derived `transactional.id`.
    pub(crate) fn set_sources(&mut self, sources: &[String]) {
        if self.config.source_headers
            && !self.sources.iter().map(|s| &**s).eq(sources.iter().map(String::as_str))
        {
            self.sources = sources.iter().map(|s| Arc::from(s.as_str())).collect();
        }
        if self.config.transactional
            && let Some(source) = sources.first()
        {
            let id = match self.config.transactional_id.as_str() {
                "" => format!("outbox-relay:{source}"),
                id => id.to_string(),
            };
            if self.transactional_id.as_deref() != Some(id.as_str()) {
                self.transactional_id = Some(id.into());
                self.initialized.store(false, Ordering::SeqCst);
            }
        }
    }

    /// Whether records go in Kafka transactions.
    pub(crate) fn transactional(&self) -> bool {
        self.config.transactional
    }

    /// Once a session is active, before it reads topics back: with `kafka.transactional`,
    /// becomes the one producer of the source's `transactional.id` on a fresh producer, which
    /// fences the producers before it, then unpins what read-backs found [`Pinned`] (see
    /// [`transaction`]). Nothing without it.
    pub(crate) async fn activate(&mut self) -> Result<(), RelayError> {
        let Some(id) = self.transactional_id.clone() else { return Ok(()) };
        // (a producer fenced through a delivery report, its session ended as a standby with
        // `initialized` still set, has a fatal error: it is never used again)
        let unusable = self.producer.client().fatal_error().is_some();
        if self.initialized.load(Ordering::SeqCst) && !unusable {
            return Ok(());
        }
        self.reset().map_err(|e| RelayError::Kafka(format!("cannot create the Kafka producer: {e}")))?;
        self.retired(crate::sink::RETIRE_LIMIT).await;
        let (producer, timeout) = (self.producer.clone(), self.transaction_timeout());
        let init = tokio::task::spawn_blocking(move || transaction::init(&producer, &id, timeout));
        init.await.map_err(|e| RelayError::Kafka(format!("initializing transactions failed: {e}")))??;
        tracing::info!(transactional_id = %self.transactional_id.as_deref().unwrap_or(""), "Kafka transactions initialized: earlier producers of this id are fenced");
        let pinned = self.pinned.take();
        if !pinned.is_empty() {
            // (numbered before the session's first record: its reports are passed over)
            let first = self.next_seq.fetch_add(pinned.len(), Ordering::Relaxed);
            let (producer, id, timeout) =
                (self.producer.clone(), self.transactional_id.clone(), self.transaction_timeout());
            let id = id.unwrap_or_else(|| "".into());
            let unpin = tokio::task::spawn_blocking(move || {
                transaction::unpin(&producer, &id, &pinned, first, timeout)
            });
            unpin.await.map_err(|e| RelayError::Kafka(format!("unpinning partitions failed: {e}")))??;
        }
        self.initialized.store(true, Ordering::SeqCst);
        Ok(())
    }

    /// Where this sink's sessions' read-backs leave the partitions they found pinned.
    pub(crate) fn pinned(&self) -> Pinned {
        self.pinned.clone()
    }

    /// Begins a Kafka transaction.
    pub(crate) fn begin(&self) -> Result<(), RelayError> {
        transaction::begin(&self.producer, self.transactional_id.as_deref().unwrap_or(""))
    }

    /// Commits the open transaction (every record in it reported already); a failure leaves
    /// the producer to be replaced at the next activation.
    pub(crate) async fn commit(&self) -> Result<(), RelayError> {
        let (producer, timeout) = (self.producer.clone(), self.transaction_timeout());
        let id = self.transactional_id.clone().unwrap_or_else(|| "".into());
        let commit = tokio::task::spawn_blocking(move || transaction::commit(&producer, &id, timeout));
        let result = match commit.await {
            Ok(result) => result,
            Err(e) => Err(RelayError::Kafka(format!("committing the Kafka transaction failed: {e}"))),
        };
        let outcome = match &result {
            Ok(()) => TransactionOutcome::Committed,
            Err(RelayError::Standby(_)) => TransactionOutcome::Fenced,
            Err(_) => TransactionOutcome::Aborted,
        };
        metrics().kafka_transactions.with_label_values(&[outcome.label()]).inc();
        if result.is_err() {
            self.initialized.store(false, Ordering::SeqCst);
        }
        result
    }

    /// Why the producer was fenced, if it was.
    pub(crate) fn fenced(&self) -> Option<RelayError> {
        let id = self.transactional_id.as_deref()?;
        transaction::fenced(&self.producer, id)
    }

    fn transaction_timeout(&self) -> Duration {
        Duration::from_millis(self.config.transaction_timeout_ms)
    }

    pub(crate) fn sources(&self) -> &[Arc<str>] {
        &self.sources
    }

    /// Waits (at most `limit`) until the producer replaced after a failed session is gone: its
    /// records still queued or in flight are purged by then, so a read-back of the topic sees
    /// everything it will ever write.
    pub(crate) async fn retired(&mut self, limit: Duration) {
        if let Some(retiring) = self.retiring.take()
            && tokio::time::timeout(limit, retiring).await.is_err()
        {
            tracing::warn!(
                limit_ms = limit.as_millis() as u64,
                "the previous Kafka producer is still shutting down; a record of it landing later is a duplicate"
            );
        }
    }

    /// After a failed session: a fresh producer (see [`KafkaSink::reset`]); a failure to make
    /// one is logged, and the next session fails on the old one and tries again.
    pub(crate) fn recover(&mut self) {
        // with transactions the next active session initializes a fresh producer again (a
        // standby never does, see `activate`); the failed one stops sending now either way
        self.initialized.store(false, Ordering::SeqCst);
        if let Err(e) = self.reset() {
            tracing::warn!(error = %e, "cannot recreate the Kafka producer");
        }
    }

    /// Replaces the producer. A producer that hit a fatal idempotence error is unusable, and
    /// one that outlived a broker restart can retry forever with an unknown producer id; a
    /// fresh one starts clean. Records of the old one still in flight carry the same event ids,
    /// so at worst they are duplicates, never gaps.
    fn reset(&mut self) -> Result<(), KafkaError> {
        let Channel { producer, reports, refusals } =
            create_producer(&self.config, self.transactional_id.as_deref())?;
        let old = std::mem::replace(&mut self.producer, producer);
        self.reports = Mutex::new(reports);
        self.refusals = refusals;
        self.looked_up.get_mut().unwrap().clear();
        // destroying a producer waits for its threads, which a frozen broker can hold up: not
        // on a runtime thread
        self.retiring = Some(tokio::task::spawn_blocking(move || drop(old)));
        Ok(())
    }

    /// Enqueues one record, waiting out a full local queue, and returns its number: its report
    /// arrives on [`KafkaSink::reports`] (a record refused at once is reported there too).
    /// Callers that enqueue in order keep per-partition order.
    pub(crate) async fn enqueue(&self, event: &KafkaRecord) -> usize {
        self.look_up(&event.topic);
        let seq = self.next_seq.fetch_add(1, Ordering::Relaxed);
        if let Err(e) = self.send(event, seq).await {
            let _ = self.refusals.send(Report { seq, outcome: Err(SendFailure::kafka(e)) });
        }
        seq
    }

    /// Hands one record to the producer, waiting out a full local queue.
    async fn send(&self, event: &KafkaRecord, seq: usize) -> Result<(), KafkaError> {
        loop {
            let record =
                BaseRecord::with_opaque_to(&event.topic, seq).key(&event.key).payload(&event.payload);
            let record = match &event.as_written {
                // sent again as first written (`republish`): its partition, its headers alone
                Some(written) => record.partition(written.partition).headers(as_written(written)),
                None => record.headers(self.headers(event)),
            };
            match self.producer.send(record) {
                Ok(()) => return Ok(()),
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), _)) => {
                    tokio::time::sleep(QUEUE_FULL_PAUSE).await;
                }
                Err((e, _)) => return Err(e),
            }
        }
    }

    /// The headers of `event`: the relay's own, then the record's ([`KafkaRecord::headers`]).
    fn headers(&self, event: &KafkaRecord) -> OwnedHeaders {
        let mut headers = OwnedHeaders::new_with_capacity(event.row_headers.len() + 5);
        // the relay's own headers first: a row header of the same name does not shadow them
        // (a replayed dead letter has no position: `replay-dead-letters`)
        let source = self.sources.get(event.outbox.index());
        if let Some(source) = source {
            headers = headers.insert(Header { key: SOURCE_HEADER, value: Some(source.as_bytes()) });
        }
        if let (Some(_), Some(position)) = (source, &event.position) {
            let mut text = [0u8; 64];
            let mut cursor = &mut text[..];
            write!(cursor, "{position}").expect("a position fits in 64 bytes");
            let written = 64 - cursor.len();
            headers = headers.insert(Header { key: POSITION_HEADER, value: Some(&text[..written]) });
        }
        for (key, value) in event.headers() {
            headers = headers.insert(Header { key, value: Some(value.as_bytes()) });
        }
        headers
    }

    /// Classifies one failure. A timeout is checked against the topic's metadata: a topic the
    /// broker does not know (auto-create off) is permanent, anything else transient.
    pub(crate) async fn classify(&self, record: &KafkaRecord, failure: &SendFailure) -> PublishError {
        let Some(error) = failure.as_kafka() else { return failure.classified() };
        let topic = record.topic.as_str();
        let code = error.rdkafka_error_code();
        match code {
            Some(RDKafkaErrorCode::UnknownTopic | RDKafkaErrorCode::UnknownTopicOrPartition) => {
                PublishError::Permanent(format!(
                    "topic \"{topic}\" does not exist and the broker does not create topics automatically ({error})"
                ))
            }
            Some(RDKafkaErrorCode::TopicAuthorizationFailed) => PublishError::Permanent(format!(
                "Kafka refuses {} to write topic \"{topic}\" ({error}): grant it WRITE and DESCRIBE on the topic \
                 (and READ, for the read-back)",
                self.config.principal()
            )),
            Some(RDKafkaErrorCode::MessageSizeTooLarge | RDKafkaErrorCode::InvalidMessageSize) => {
                PublishError::Permanent(classify::too_large(&self.config, record, error))
            }
            Some(RDKafkaErrorCode::InvalidTopic | RDKafkaErrorCode::InvalidRecord) => {
                PublishError::Permanent(format!("{error}"))
            }
            Some(RDKafkaErrorCode::MessageTimedOut) if self.topic_is_unknown(topic).await => {
                PublishError::Permanent(format!(
                    "topic \"{topic}\" does not exist and the broker does not create topics automatically"
                ))
            }
            _ => PublishError::Transient { error_type: error_type(code), detail: format!("{error}") },
        }
    }

    /// The first time this producer is given a record for `topic`, asks the broker in the
    /// background whether the topic exists, and says at once when it does not: otherwise the
    /// first word would be the stall warning, which reads like a Kafka outage.
    fn look_up(&self, topic: &str) {
        let mut looked_up = self.looked_up.lock().unwrap();
        if looked_up.contains(topic) || looked_up.len() >= LOOKED_UP_TOPICS {
            return;
        }
        looked_up.insert(topic.to_string());
        let producer = self.producer.clone();
        let topic = topic.to_string();
        tokio::task::spawn_blocking(move || {
            if topic_is_unknown(&producer, &topic) {
                tracing::warn!(
                    topic,
                    "the broker's metadata has no such topic: create it (the relay does not create topics). \
                     Unless the broker creates topics on first use, its records wait for it and are then refused \
                     and dead-lettered (or held, under on_poison = block)"
                );
            }
        });
    }

    /// Asks the broker (off the runtime's threads: the request blocks) whether `topic` exists.
    async fn topic_is_unknown(&self, topic: &str) -> bool {
        let producer = self.producer.clone();
        let name = topic.to_string();
        let unknown = tokio::task::spawn_blocking(move || topic_is_unknown(&producer, &name));
        unknown.await.unwrap_or(false)
    }

    /// Asks the broker about `topics` (off the runtime's threads): librdkafka's answer updates
    /// what the producer knows of them, so a topic created since it last asked is written.
    pub(crate) async fn refresh_topics(&self, topics: &[String]) {
        for topic in topics {
            self.topic_is_unknown(topic).await;
        }
    }

    /// Waits up to [`FLUSH_TIMEOUT`] for everything enqueued to be delivered or to fail
    /// (shutdown), off the runtime's threads.
    pub(crate) async fn flush(&self) {
        let timeout = FLUSH_TIMEOUT;
        let producer = self.producer.clone();
        let flushed = tokio::task::spawn_blocking(move || producer.flush(timeout)).await;
        if let Ok(Err(e)) = flushed {
            tracing::warn!(error = %e, "records still unacknowledged at shutdown are published again at the next start");
        }
    }
}
