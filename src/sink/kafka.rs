//! The Kafka producer: `acks=all` and the idempotent producer, always.
//!
//! Settings the delivery guarantee depends on are set here last, after the user's pass-through
//! properties, and `config::RelayConfig::validate` refuses user overrides of them.
//!
//! Invariants:
//! - records are enqueued in the order given; a full local queue is waited out, never skipped,
//!   so the idempotent producer keeps per-partition order;
//! - [`KafkaSink::publish`] resolves only when every record has a delivery report;
//! - each failure is classified where it happens: permanent (the record can never be accepted:
//!   it is poison) or transient (retry the batch).

use std::collections::HashSet;
use std::io::Write;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use rdkafka::config::RDKafkaLogLevel;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{BaseRecord, DeliveryResult, Producer, ProducerContext, ThreadedProducer};
use rdkafka::types::RDKafkaRespErr;
use rdkafka::{ClientConfig, ClientContext};
use tokio::sync::{Mutex, MutexGuard, mpsc};

use crate::config::KafkaConfig;
use crate::delivery::record::KafkaRecord;
use crate::observe::metrics::{ErrorType, metrics};
use crate::observe::pulse::Pulse;

/// How long a metadata request may take when classifying a timed-out record.
const METADATA_TIMEOUT: Duration = Duration::from_secs(5);
/// How long shutdown waits for records handed to the producer.
const FLUSH_TIMEOUT: Duration = Duration::from_secs(5);
/// Delivery reports taken per wake-up, at most.
const REPORT_BATCH: usize = 256;
/// Pause before re-enqueueing after librdkafka's local queue was full.
const QUEUE_FULL_PAUSE: Duration = Duration::from_millis(5);
/// Topics a producer looks up on first sight, at most (a `topic` column with unbounded values
/// must not grow memory without bound); topics past it are not looked up.
const LOOKED_UP_TOPICS: usize = 10_000;

/// The librdkafka settings every client built from `kafka` shares: the brokers, the client id,
/// and the pass-through and secret properties (TLS, SASL). The example services build their
/// consumers and producers on it.
pub fn client_config(kafka: &KafkaConfig) -> ClientConfig {
    let mut cc = ClientConfig::new();
    for (key, value) in kafka.client_properties() {
        cc.set(key, value);
    }
    cc.set("bootstrap.servers", kafka.brokers.join(",")).set("client.id", &kafka.client_id);
    cc
}

/// The librdkafka settings of a client that reads topics without committing anything (the
/// read-back, `verify`): the user's (TLS, SASL), group `<client_id>-<purpose>` (librdkafka
/// assigns partitions only in a group, which is never joined, but it looks the group's
/// coordinator up: under an authorizer the principal needs DESCRIBE on that group, besides
/// READ and DESCRIBE on the topics), each partition's end reported, a
/// short fetch wait (every read ends at a partition's end), librdkafka's own log at errors only.
pub(crate) fn reader_config(kafka: &KafkaConfig, purpose: &str, fetch_wait_ms: u32) -> ClientConfig {
    let mut cc = client_config(kafka);
    cc.set("group.id", format!("{}-{purpose}", kafka.client_id))
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("enable.partition.eof", "true")
        .set("auto.offset.reset", "earliest")
        .set("fetch.wait.max.ms", fetch_wait_ms.to_string())
        .set("log_level", "3");
    cc
}

/// The librdkafka client configuration for a producer built from `kafka`: acks=all, idempotent,
/// gapless.
pub fn producer_config(kafka: &KafkaConfig) -> ClientConfig {
    let mut cc = client_config(kafka);
    cc.set("message.timeout.ms", kafka.message_timeout_ms.to_string())
        .set("linger.ms", kafka.linger_ms.to_string())
        .set("compression.codec", &kafka.compression)
        .set("acks", "all")
        .set("enable.idempotence", "true")
        // A record that fails permanently stops the producer instead of letting later records
        // of its partition through: a gap would reorder an aggregate's events on retry.
        .set("enable.gapless.guarantee", "true");
    cc
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

/// The header naming the database and table a record came from (see [`KafkaSink::set_source`]).
pub(crate) const SOURCE_HEADER: &str = "outbox_relay_source";
/// The header saying where the source read the record ([`crate::delivery::record::Position`]).
pub(crate) const POSITION_HEADER: &str = "outbox_relay_position";

/// One record's delivery report: the number [`KafkaSink::enqueue`] gave it, and whether Kafka
/// acknowledged it.
#[derive(Debug)]
pub(crate) struct Report {
    pub(crate) seq: usize,
    pub(crate) outcome: Result<(), KafkaError>,
}

/// Delivery reports from librdkafka's callback (on the producer's polling thread) into a
/// channel, numbered by the record's delivery opaque: no future, oneshot or box per record.
struct Reporter(mpsc::UnboundedSender<Report>);

/// The relay's level for one of librdkafka's log lines, or `None` to drop it.
///
/// - `CONFWARN ... gapless`: librdkafka calls enable.gapless.guarantee experimental at every
///   producer's creation; the README says what it does and why it is always on, once.
/// - `FAIL` at error level: a broker connection that failed (a refused connect, a dropped
///   connection). librdkafka then also hands the same failure to [`ClientContext::error`]
///   (`rd_kafka_broker_set_error` pairs an error op with a FAIL line only from LOG_ERR up),
///   which logs it once at INFO or WARN, or at ERROR for what is not a plain transport failure
///   (TLS, authentication): an ERROR line per reconnect would page for what the stall watch
///   already reports. Its FAIL lines below error level have no such pair (a connection closed
///   during the ApiVersion request, which names a likely security.protocol or SASL mistake; a
///   connection setup timeout) and keep their level.
fn log_level(level: RDKafkaLogLevel, fac: &str, message: &str) -> Option<tracing::Level> {
    if fac == "CONFWARN" && message.contains("gapless") {
        return None;
    }
    let relay_level = match level {
        RDKafkaLogLevel::Emerg
        | RDKafkaLogLevel::Alert
        | RDKafkaLogLevel::Critical
        | RDKafkaLogLevel::Error => tracing::Level::ERROR,
        RDKafkaLogLevel::Warning => tracing::Level::WARN,
        RDKafkaLogLevel::Notice | RDKafkaLogLevel::Info => tracing::Level::INFO,
        RDKafkaLogLevel::Debug => tracing::Level::DEBUG,
    };
    if fac == "FAIL" && relay_level == tracing::Level::ERROR {
        return Some(tracing::Level::DEBUG);
    }
    Some(relay_level)
}

/// Logs one of librdkafka's log lines at the relay's level ([`log_level`]); every client of the
/// relay's (the producer, the read-back consumer) logs through this.
pub(crate) fn log_librdkafka(level: RDKafkaLogLevel, fac: &str, message: &str) {
    match log_level(level, fac, message) {
        Some(tracing::Level::ERROR) => tracing::error!(target: "librdkafka", "{fac} {message}"),
        Some(tracing::Level::WARN) => tracing::warn!(target: "librdkafka", "{fac} {message}"),
        Some(tracing::Level::INFO) => tracing::info!(target: "librdkafka", "{fac} {message}"),
        Some(_) => tracing::debug!(target: "librdkafka", "{fac} {message}"),
        None => {}
    }
}

/// librdkafka's log lines and global errors, at the relay's levels.
impl ClientContext for Reporter {
    fn log(&self, level: RDKafkaLogLevel, fac: &str, message: &str) {
        log_librdkafka(level, fac, message);
    }

    fn error(&self, error: KafkaError, reason: &str) {
        match error.rdkafka_error_code() {
            // a broker connection that dropped (idle, restarted, a leader moved): librdkafka
            // reconnects by itself, and the stall watch says when Kafka stops acknowledging
            Some(RDKafkaErrorCode::BrokerTransportFailure) => {
                tracing::info!(%error, reason, "Kafka connection lost; reconnecting")
            }
            Some(RDKafkaErrorCode::AllBrokersDown) => {
                tracing::warn!(%error, reason, "no Kafka broker reachable; reconnecting")
            }
            _ => tracing::error!(%error, reason, "Kafka producer error"),
        }
    }
}

impl ProducerContext for Reporter {
    type DeliveryOpaque = usize;

    fn delivery(&self, result: &DeliveryResult<'_>, seq: usize) {
        let outcome = match result {
            Ok(_) => Ok(()),
            Err((e, _)) => Err(e.clone()),
        };
        // closed: the sink replaced this producer, and nobody waits for its reports any more
        let _ = self.0.send(Report { seq, outcome });
    }
}

type RecordProducer = ThreadedProducer<Reporter>;

/// A producer, and the channel its reports arrive on (with a sender for refusals at enqueue).
struct Channel {
    producer: Arc<RecordProducer>,
    reports: mpsc::UnboundedReceiver<Report>,
    refusals: mpsc::UnboundedSender<Report>,
}

fn create_producer(config: &KafkaConfig) -> Result<Channel, KafkaError> {
    let (refusals, reports) = mpsc::unbounded_channel();
    let producer = producer_config(config).create_with_context(Reporter(refusals.clone()))?;
    Ok(Channel { producer: Arc::new(producer), reports, refusals })
}

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
    /// Since when `publish` has waited with nothing acknowledged: a claim abandoned at its
    /// deadline and sent again does not restart the silence (`outbox_relay_kafka_unacknowledged_seconds`).
    silent_since: std::sync::Mutex<Option<Instant>>,
    /// `outbox_relay_source` of every record, once the session knows its database.
    source: Option<std::sync::Arc<str>>,
    /// The topics this producer was given a record for, each looked up in the metadata once
    /// ([`KafkaSink::look_up`]).
    looked_up: std::sync::Mutex<HashSet<String>>,
    /// The producer replaced by [`KafkaSink::reset`], being destroyed; a read-back waits for it,
    /// so none of its records lands after the relay looked.
    retiring: Option<tokio::task::JoinHandle<()>>,
}

/// Notices when records wait and Kafka acknowledges nothing for `kafka.stall_warning_ms`.
/// Records are never failed for it (see `kafka.message_timeout_ms`): the relay only says so,
/// once per stall, in the log, on `/readyz` (through the session's [`Pulse`]) and in
/// `publish_errors_total{error_type="stalled"}`. A stall ends when something is acknowledged
/// or nothing is waiting any more.
pub(crate) struct StallWatch {
    after: Duration,
    last_progress: Instant,
    stalled: bool,
    /// For the stall's diagnosis ([`super::cluster::unhealthy_partitions`]).
    kafka: KafkaConfig,
    /// Counts stalls: a diagnosis that returns after its stall ended is dropped.
    stall_number: Arc<AtomicUsize>,
}

impl StallWatch {
    pub(crate) fn new(kafka: &KafkaConfig) -> StallWatch {
        StallWatch::since(kafka, Instant::now())
    }

    /// A watch whose silence started at `since` (an earlier call's, still unanswered).
    fn since(kafka: &KafkaConfig, since: Instant) -> StallWatch {
        StallWatch {
            after: Duration::from_millis(kafka.stall_warning_ms),
            last_progress: since,
            stalled: false,
            kafka: kafka.clone(),
            stall_number: Arc::new(AtomicUsize::new(0)),
        }
    }

    /// How often [`StallWatch::check`] should run.
    pub(crate) fn period(&self) -> Duration {
        (self.after / 4).max(Duration::from_millis(25))
    }

    /// Something was acknowledged at `now`.
    pub(crate) fn progressed(&mut self, now: Instant, pulse: &Pulse) {
        self.last_progress = now;
        self.unstall(pulse);
    }

    /// Nothing waits any more: neither a stall nor a silence.
    fn settled(&mut self, pulse: &Pulse) {
        self.last_progress = Instant::now();
        metrics().kafka_unacknowledged.set(0.0);
        self.unstall(pulse);
    }

    fn unstall(&mut self, pulse: &Pulse) {
        if self.stalled {
            self.stalled = false;
            self.stall_number.fetch_add(1, Ordering::SeqCst);
            tracing::info!("Kafka acknowledges records again");
            pulse.stalled(None);
        }
    }

    /// Periodic check with the number of records waiting.
    pub(crate) fn check(&mut self, waiting: usize, pulse: &Pulse) {
        pulse.tick();
        if waiting == 0 {
            self.settled(pulse);
            return;
        }
        let quiet = self.last_progress.elapsed();
        metrics().kafka_unacknowledged.set(quiet.as_secs_f64());
        if !self.stalled && quiet >= self.after {
            self.stalled = true;
            tracing::warn!(
                waiting,
                quiet_ms = quiet.as_millis() as u64,
                "Kafka has acknowledged nothing; records are retried until acknowledged"
            );
            metrics().publish_errors.with_label_values(&[ErrorType::Stalled.label()]).inc();
            let stalled = format!("Kafka has acknowledged nothing for {} s", quiet.as_secs());
            pulse.stalled(Some(stalled.clone()));
            self.diagnose(stalled, pulse);
        }
    }

    /// Asks the brokers' metadata why nothing is acknowledged, off the runtime's threads; a
    /// finding is logged and added to the stall's `/readyz` text while the stall lasts.
    fn diagnose(&self, stalled: String, pulse: &Pulse) {
        let (kafka, health, number) = (self.kafka.clone(), pulse.health(), self.stall_number.clone());
        let this_stall = number.load(Ordering::SeqCst);
        tokio::task::spawn_blocking(move || {
            let Some(why) = super::cluster::unhealthy_partitions(&kafka, METADATA_TIMEOUT) else { return };
            if number.load(Ordering::SeqCst) == this_stall {
                tracing::warn!(diagnosis = %why, "why Kafka may acknowledge nothing");
                health.set_stalled(Some(format!("{stalled}; {why}")));
            }
        });
    }
}

impl KafkaSink {
    pub fn new(config: &KafkaConfig) -> Result<KafkaSink, KafkaError> {
        let Channel { producer, reports, refusals } = create_producer(config)?;
        Ok(KafkaSink {
            config: config.clone(),
            producer,
            reports: Mutex::new(reports),
            refusals,
            next_seq: AtomicUsize::new(0),
            silent_since: std::sync::Mutex::new(None),
            source: None,
            looked_up: std::sync::Mutex::new(HashSet::new()),
            retiring: None,
        })
    }

    /// The delivery reports, for the one session that sends: hold the guard while sending.
    pub(crate) async fn reports(&self) -> MutexGuard<'_, mpsc::UnboundedReceiver<Report>> {
        self.reports.lock().await
    }

    /// The source identity written as `outbox_relay_source` (when `kafka.source_headers`).
    pub(crate) fn set_source(&mut self, source: &str) {
        if self.config.source_headers && self.source.as_deref() != Some(source) {
            self.source = Some(source.into());
        }
    }

    pub(crate) fn source(&self) -> Option<&str> {
        self.source.as_deref()
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
        if let Err(e) = self.reset() {
            tracing::warn!(error = %e, "cannot recreate the Kafka producer");
        }
    }

    /// Replaces the producer. A producer that hit a fatal idempotence error is unusable, and
    /// one that outlived a broker restart can retry forever with an unknown producer id; a
    /// fresh one starts clean. Records of the old one still in flight carry the same event ids,
    /// so at worst they are duplicates, never gaps.
    fn reset(&mut self) -> Result<(), KafkaError> {
        let Channel { producer, reports, refusals } = create_producer(&self.config)?;
        let old = std::mem::replace(&mut self.producer, producer);
        self.reports = Mutex::new(reports);
        self.refusals = refusals;
        self.looked_up.get_mut().unwrap().clear();
        // destroying a producer waits for its threads, which a frozen broker can hold up: not
        // on a runtime thread
        self.retiring = Some(tokio::task::spawn_blocking(move || drop(old)));
        Ok(())
    }

    /// Publishes `events` in order and waits for every delivery report.
    pub(crate) async fn publish(
        &self,
        events: &[KafkaRecord],
        pulse: &Pulse,
    ) -> Vec<Result<(), PublishError>> {
        let mut reports = self.reports().await;
        let mut first = None;
        for event in events {
            let seq = self.enqueue(event).await;
            first.get_or_insert(seq);
        }
        let Some(first) = first else { return Vec::new() };
        let mut outcomes: Vec<Option<Result<(), KafkaError>>> = vec![None; events.len()];
        let mut waiting = events.len();
        let since = *self.silent_since.lock().unwrap().get_or_insert_with(Instant::now);
        let mut watch = StallWatch::since(&self.config, since);
        let mut check = tokio::time::interval(watch.period());
        let mut batch = Vec::with_capacity(REPORT_BATCH);
        while waiting > 0 {
            tokio::select! {
                _ = reports.recv_many(&mut batch, REPORT_BATCH) => {
                    let mut acknowledged = false;
                    for Report { seq, outcome } in batch.drain(..) {
                        // an earlier batch's report (one abandoned at its deadline) is passed over
                        if let Some(slot) = seq.checked_sub(first).and_then(|i| outcomes.get_mut(i))
                            && slot.is_none()
                        {
                            acknowledged |= outcome.is_ok();
                            *slot = Some(outcome);
                            waiting -= 1;
                        }
                    }
                    // (once per run of reports: one clock read and one lock)
                    if acknowledged {
                        let now = Instant::now();
                        *self.silent_since.lock().unwrap() = Some(now);
                        watch.progressed(now, pulse);
                    }
                }
                _ = check.tick() => watch.check(waiting, pulse),
            }
        }
        // every record has its report: nothing waits any more, whatever the reports say
        *self.silent_since.lock().unwrap() = None;
        watch.settled(pulse);
        let mut results = Vec::with_capacity(outcomes.len());
        for (event, outcome) in events.iter().zip(outcomes) {
            results.push(match outcome.expect("every record reported") {
                Ok(()) => Ok(()),
                Err(e) => Err(self.classify(&event.topic, &e).await),
            });
        }
        results
    }

    /// Enqueues one record, waiting out a full local queue, and returns its number: its report
    /// arrives on [`KafkaSink::reports`] (a record refused at once is reported there too).
    /// Callers that enqueue in order keep per-partition order.
    pub(crate) async fn enqueue(&self, event: &KafkaRecord) -> usize {
        self.look_up(&event.topic);
        let seq = self.next_seq.fetch_add(1, Ordering::Relaxed);
        if let Err(e) = self.send(event, seq).await {
            let _ = self.refusals.send(Report { seq, outcome: Err(e) });
        }
        seq
    }

    /// Hands one record to the producer, waiting out a full local queue.
    async fn send(&self, event: &KafkaRecord, seq: usize) -> Result<(), KafkaError> {
        loop {
            let mut headers = OwnedHeaders::new_with_capacity(event.row_headers.len() + 5);
            // the relay's own headers first: a row header of the same name does not shadow them
            if let (Some(source), Some(position)) = (&self.source, &event.position) {
                let mut text = [0u8; 64];
                let mut cursor = &mut text[..];
                write!(cursor, "{position}").expect("a position fits in 64 bytes");
                let written = 64 - cursor.len();
                headers = headers
                    .insert(Header { key: SOURCE_HEADER, value: Some(source.as_bytes()) })
                    .insert(Header { key: POSITION_HEADER, value: Some(&text[..written]) });
            }
            for (key, value) in event.headers() {
                headers = headers.insert(Header { key, value: Some(value.as_bytes()) });
            }
            let record = BaseRecord::with_opaque_to(&event.topic, seq)
                .key(&event.key)
                .payload(&event.payload)
                .headers(headers);
            match self.producer.send(record) {
                Ok(()) => return Ok(()),
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), _)) => {
                    tokio::time::sleep(QUEUE_FULL_PAUSE).await;
                }
                Err((e, _)) => return Err(e),
            }
        }
    }

    /// Classifies one failure. A timeout is checked against the topic's metadata: a topic the
    /// broker does not know (auto-create off) is permanent, anything else transient.
    pub(crate) async fn classify(&self, topic: &str, error: &KafkaError) -> PublishError {
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
            Some(
                RDKafkaErrorCode::MessageSizeTooLarge
                | RDKafkaErrorCode::InvalidTopic
                | RDKafkaErrorCode::InvalidRecord
                | RDKafkaErrorCode::InvalidMessageSize,
            ) => PublishError::Permanent(format!("{error}")),
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

/// Whether the broker's metadata says `topic` does not exist (a blocking request; a failed
/// request says nothing).
fn topic_is_unknown(producer: &RecordProducer, topic: &str) -> bool {
    producer.client().fetch_metadata(Some(topic), METADATA_TIMEOUT).is_ok_and(|md| {
        md.topics().iter().any(|t| {
            t.name() == topic && t.error() == Some(RDKafkaRespErr::RD_KAFKA_RESP_ERR_UNKNOWN_TOPIC_OR_PART)
        })
    })
}

/// A low-cardinality label for metrics and logs.
fn error_type(code: Option<RDKafkaErrorCode>) -> ErrorType {
    match code {
        Some(RDKafkaErrorCode::MessageTimedOut) => ErrorType::Timeout,
        Some(RDKafkaErrorCode::Fatal) => ErrorType::FatalProducer,
        Some(RDKafkaErrorCode::AllBrokersDown | RDKafkaErrorCode::BrokerTransportFailure) => {
            ErrorType::BrokerDown
        }
        Some(RDKafkaErrorCode::NotEnoughReplicas | RDKafkaErrorCode::NotEnoughReplicasAfterAppend) => {
            ErrorType::NotEnoughReplicas
        }
        Some(RDKafkaErrorCode::NotLeaderForPartition | RDKafkaErrorCode::LeaderNotAvailable) => {
            ErrorType::LeaderChange
        }
        Some(RDKafkaErrorCode::QueueFull) => ErrorType::QueueFull,
        _ => ErrorType::Other,
    }
}

#[cfg(test)]
mod tests {
    use rdkafka::config::RDKafkaLogLevel;
    use tracing::Level;

    use super::log_level;

    #[test]
    fn a_failed_broker_connection_is_not_an_error_line() {
        // librdkafka's own words for a broker it cannot reach (rdkafka_broker.c)
        let refused = "127.0.0.1:9092/bootstrap: Connect to ipv4#127.0.0.1:9092 failed: Connection refused";
        assert_eq!(log_level(RDKafkaLogLevel::Error, "FAIL", refused), Some(Level::DEBUG));
        // a FAIL line below error level has no error-callback twin: it keeps its level
        let api_version = "Disconnected while requesting ApiVersion: might be caused by incorrect \
                           security.protocol configuration (connecting to a SSL listener?)";
        assert_eq!(log_level(RDKafkaLogLevel::Warning, "FAIL", api_version), Some(Level::WARN));
        assert_eq!(
            log_level(RDKafkaLogLevel::Info, "FAIL", "Disconnected (after 5000ms in state UP)"),
            Some(Level::INFO)
        );
        assert_eq!(log_level(RDKafkaLogLevel::Error, "SSL", "certificate verify failed"), Some(Level::ERROR));
        assert_eq!(
            log_level(RDKafkaLogLevel::Warning, "CONFWARN", "enable.gapless.guarantee is experimental"),
            None
        );
        assert_eq!(log_level(RDKafkaLogLevel::Warning, "CONFWARN", "some other setting"), Some(Level::WARN));
    }
}
