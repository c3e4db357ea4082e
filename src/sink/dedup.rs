//! Zero duplicates across restarts: read back what this relay already wrote, skip exactly that.
//!
//! After a crash, a PostgreSQL restart or a standby taking over, the source hands the relay
//! events again: replication replays every transaction after the slot's confirmed position,
//! polling reclaims the rows of the batch that never committed, and a recreated slot's first
//! copy republishes the table. Before a session sends its first record to a topic, it reads back
//! the records of that topic written by the same source (`outbox_relay_source` header) that such
//! a replay can repeat, and remembers their keys. An event whose key is among them is settled as
//! acknowledged without being sent; every other event is sent.
//!
//! Invariants:
//! - an event is skipped only if a record with its key was *read back from the topic*: a wrong
//!   guess about how far to look back, another producer's records, a truncated or recreated
//!   topic, a changed partition count can only make the relay look at fewer records and send
//!   more (a duplicate, said in the log and `outbox_relay_dedup_scans_total`), never skip one
//!   Kafka does not hold. So the relay needs no partitioner of its own: it reads every partition
//!   of the topic;
//! - the key of a streamed event is its position (commit LSN, place in the transaction) and id;
//!   a copied or polled row's key is its id (the table's primary key): the same event read again
//!   has the same key;
//! - the read-back happens before anything of the session is sent to the topic, after the
//!   producer of a failed session is destroyed (see `KafkaSink::retired`);
//! - it reads each partition backwards in growing windows from its end, forward inside each
//!   window to the true end (a broker may report the end offset low, as tansu 0.6 does), until
//!   it meets a record older than anything the source can replay, the start of the partition,
//!   or `dedup.max_scan_records`.

use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasher, RandomState};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use rdkafka::ClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Headers, Message};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};

use crate::config::{KafkaConfig, RelayConfig};
use crate::error::RelayError;
use crate::event::{OutboxEvent, Position};
use crate::metrics::metrics;
use crate::position::Lsn;
use crate::sink::kafka::{POSITION_HEADER, SOURCE_HEADER, StallWatch};
use crate::supervisor::Pulse;

/// The first window read back from each partition's end; each further one is twice as large.
const FIRST_WINDOW: i64 = 256;
/// One poll's wait while reading back.
const POLL: Duration = Duration::from_millis(100);
/// The longest one blocking request may take before the read checks its deadline again.
const STEP: Duration = Duration::from_secs(1);
/// A read-back that took this long met a slow or stalled broker: the relay looks at the ends
/// again [`SETTLE`] later, since such a broker may process the last requests of the relay that
/// came before (a killed process's, still in the broker's socket buffers) after it answered.
const SLOW: Duration = Duration::from_secs(1);
const SETTLE: Duration = Duration::from_secs(1);

/// `result` values of `outbox_relay_dedup_scans_total`.
pub const SCAN_RESULTS: &[&str] = &["complete", "topic_missing", "truncated", "limit"];

/// How far back a session's replay can reach, so how far back to read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Lookback {
    /// A streaming session from the slot's confirmed position: transactions committed at or
    /// after it may come again. Keys: positions.
    Since(Lsn),
    /// A slot's first copy: any row of the table may already be in the topic. Keys: ids.
    Everything,
    /// A polling session: only the last batch can have been published without committing (the
    /// rows of every committed batch are gone from the outbox). Keys: ids.
    LastBatch,
}

/// 128-bit keys from two independently keyed SipHashes: a collision (two different events with
/// one key, the only way a read-back could skip an event Kafka does not hold) has odds of about
/// n² / 2^129, under 10^-26 for a million records.
#[derive(Clone)]
struct Fingerprint(RandomState, RandomState);

impl Fingerprint {
    fn of<T: std::hash::Hash>(&self, value: T) -> u128 {
        (u128::from(self.0.hash_one(&value)) << 64) | u128::from(self.1.hash_one(&value))
    }

    /// The key of an event read at `position` with `id`, as both sides compute it.
    fn key(&self, position: &Position, id: &str) -> u128 {
        match position {
            Position::Stream { commit, index } => self.of((0u8, commit.0, *index, id)),
            Position::Copy { .. } | Position::Batch { .. } => self.id_key(id),
        }
    }

    fn id_key(&self, id: &str) -> u128 {
        self.of((1u8, id))
    }
}

/// Who wrote a record: the cluster (its system identifier, kept by physical standbys, so a
/// promoted one is the same source), the database and the outbox table.
const SOURCE_SQL: &str = "SELECT system_identifier::text, current_database()::text FROM pg_control_system()";

/// The `outbox_relay_source` of this relay's records:
/// `<system identifier>/<database>/<schema>.<table>`.
pub(crate) async fn source_identity(
    client: &tokio_postgres::Client,
    config: &RelayConfig,
) -> Result<String, RelayError> {
    let row = client.query_one(SOURCE_SQL, &[]).await?;
    let (system, database): (String, String) = (row.get(0), row.get(1));
    Ok(format!("{system}/{database}/{}.{}", config.outbox.schema, config.outbox.table))
}

/// How long a session waits for the producer of a failed one to be destroyed.
pub(crate) const RETIRE_LIMIT: Duration = Duration::from_secs(10);

/// One session's skip rule.
pub(crate) struct Dedup {
    enabled: bool,
    lookback: Lookback,
    mode: &'static str,
    client: ClientConfig,
    kafka: KafkaConfig,
    max_records: u64,
    timeout: Duration,
    fingerprint: Fingerprint,
    /// `outbox_relay_source` of this relay's records.
    source: Arc<str>,
    /// Per topic read back in this session: the keys still expected again.
    topics: HashMap<String, HashSet<u128>>,
    consumer: Option<Arc<BaseConsumer<ReadBackContext>>>,
}

/// The read-back client's context: reaching a partition's end is how a read-back ends, not an
/// error to log (librdkafka reports it as a global error too).
struct ReadBackContext;

impl ClientContext for ReadBackContext {
    fn error(&self, error: KafkaError, reason: &str) {
        if !matches!(error, KafkaError::Global(RDKafkaErrorCode::PartitionEOF)) {
            tracing::warn!(%error, reason, "reading topics back");
        }
    }
}

impl ConsumerContext for ReadBackContext {}

impl Dedup {
    /// The rule for a session of `mode` replaying from `lookback`; `source` is `None` when the
    /// records carry no source header (nothing can be recognised, so nothing is skipped).
    pub(crate) fn new(
        config: &RelayConfig,
        mode: &'static str,
        lookback: Lookback,
        source: Option<&str>,
    ) -> Dedup {
        Dedup {
            enabled: config.dedup.enabled && source.is_some(),
            lookback,
            mode,
            client: reader_config(config),
            kafka: config.kafka.clone(),
            max_records: config.dedup.max_scan_records,
            timeout: Duration::from_millis(config.dedup.scan_timeout_ms),
            fingerprint: Fingerprint(RandomState::new(), RandomState::new()),
            source: source.unwrap_or_default().into(),
            topics: HashMap::new(),
            consumer: None,
        }
    }

    /// True when Kafka already holds `event` from an earlier session: settle it without sending.
    /// The first call for a topic reads the topic back (an error ends the session: nothing is
    /// sent to a topic the relay could not read).
    /// A read-back that Kafka does not answer is a stall like any other (see [`StallWatch`]).
    pub(crate) async fn written(&mut self, event: &OutboxEvent, pulse: &Pulse) -> Result<bool, RelayError> {
        let Some(position) = (self.enabled).then_some(event.position).flatten() else { return Ok(false) };
        if !self.topics.contains_key(&event.topic) {
            let keys = self.read_back(&event.topic, pulse).await?;
            self.topics.insert(event.topic.clone(), keys);
        }
        let keys = self.topics.get_mut(&event.topic).expect("read back above");
        if keys.is_empty() || !keys.remove(&self.fingerprint.key(&position, &event.id)) {
            return Ok(false);
        }
        metrics().dedup_skipped.with_label_values(&[self.mode]).inc();
        tracing::debug!(event_id = %event.id, %position, topic = %event.topic, "already in Kafka: not sent again");
        Ok(true)
    }

    /// Reads `topic` back (off the runtime: the client blocks) and reports how it went.
    async fn read_back(&mut self, topic: &str, pulse: &Pulse) -> Result<HashSet<u128>, RelayError> {
        let consumer = match &self.consumer {
            Some(consumer) => consumer.clone(),
            None => {
                let consumer: BaseConsumer<ReadBackContext> =
                    self.client.create_with_context(ReadBackContext).map_err(|e| {
                        RelayError::Kafka(format!("cannot create the client that reads topics back: {e}"))
                    })?;
                self.consumer.insert(Arc::new(consumer)).clone()
            }
        };
        // the blocking read stops at its next step once this future is dropped (a claim's bound,
        // shutdown): a runtime shutting down waits for its blocking threads
        let cancelled = Arc::new(AtomicBool::new(false));
        let _cancel = CancelOnDrop(cancelled.clone());
        let scan = Scan {
            cancelled,
            topic: topic.to_string(),
            source: self.source.clone(),
            lookback: self.lookback,
            fingerprint: self.fingerprint.clone(),
            max_records: self.max_records,
            deadline: Instant::now() + self.timeout,
        };
        let started = Instant::now();
        let mut reading = tokio::task::spawn_blocking(move || scan.run(&consumer));
        let mut stall = StallWatch::new(&self.kafka);
        let mut check = tokio::time::interval(stall.period());
        let read = loop {
            tokio::select! {
                read = &mut reading => break read,
                _ = check.tick() => stall.check(1, pulse),
            }
        };
        let outcome = read
            .map_err(|e| RelayError::Kafka(format!("reading topic \"{topic}\" back failed: {e}")))?
            .map_err(|e| {
                RelayError::Kafka(format!(
                    "cannot read topic \"{topic}\" back to skip what it already holds (nothing is sent to it \
                     until it can be read; dedup.scan_timeout_ms bounds each try): {e}"
                ))
            })?;
        stall.progressed(pulse);
        outcome.report(topic, self.lookback, started.elapsed());
        Ok(outcome.keys)
    }
}

/// Sets its flag when dropped.
struct CancelOnDrop(Arc<AtomicBool>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// The librdkafka settings of the read-back client: the user's (TLS, SASL), then reading ones.
fn reader_config(config: &RelayConfig) -> ClientConfig {
    let kafka = &config.kafka;
    let mut cc = ClientConfig::new();
    for (key, value) in kafka.client_properties() {
        cc.set(key, value);
    }
    cc.set("bootstrap.servers", kafka.brokers.join(","))
        .set("client.id", &kafka.client_id)
        .set("group.id", format!("{}-read-back", kafka.client_id))
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("enable.partition.eof", "true")
        .set("auto.offset.reset", "earliest")
        .set("fetch.wait.max.ms", "50")
        .set("log_level", "3");
    cc
}

/// How one topic's read-back ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ScanResult {
    /// Every partition was read back as far as a replay can reach (or to its very start).
    Complete,
    /// The topic does not exist: there is nothing to skip.
    TopicMissing,
    /// A partition's oldest records were removed (retention, deletion) before the read-back
    /// reached what a replay can repeat: replayed events older than what is left are sent again.
    Truncated,
    /// `dedup.max_scan_records` was reached first: older replayed events are sent again.
    Limit,
}

impl ScanResult {
    fn label(self) -> &'static str {
        match self {
            ScanResult::Complete => "complete",
            ScanResult::TopicMissing => "topic_missing",
            ScanResult::Truncated => "truncated",
            ScanResult::Limit => "limit",
        }
    }
}

struct ScanOutcome {
    keys: HashSet<u128>,
    result: ScanResult,
    partitions: usize,
    records: u64,
    foreign: u64,
}

impl ScanOutcome {
    fn report(&self, topic: &str, lookback: Lookback, took: Duration) {
        let m = metrics();
        m.dedup_scans.with_label_values(&[self.result.label()]).inc();
        m.dedup_scanned_records.inc_by(self.records);
        let (result, keys, partitions, records, foreign) =
            (self.result.label(), self.keys.len(), self.partitions, self.records, self.foreign);
        let took_ms = took.as_millis() as u64;
        match self.result {
            ScanResult::TopicMissing => tracing::warn!(
                topic,
                ?lookback,
                result,
                took_ms,
                "the topic does not exist (not created yet, or deleted): there is nothing to compare with, so \
                 replayed events, if any, are sent again"
            ),
            ScanResult::Complete => tracing::info!(
                topic,
                ?lookback,
                result,
                partitions,
                records,
                foreign,
                already_written = keys,
                took_ms,
                "read the topic back: events it already holds are not sent again"
            ),
            ScanResult::Truncated => tracing::warn!(
                topic,
                ?lookback,
                partitions,
                records,
                already_written = keys,
                took_ms,
                "read the topic back to the start of a partition whose older records are gone (retention or \
                 deletion): replayed events older than what the topic still holds are sent again"
            ),
            ScanResult::Limit => tracing::warn!(
                topic,
                ?lookback,
                partitions,
                records,
                already_written = keys,
                took_ms,
                "stopped reading the topic back at dedup.max_scan_records: older replayed events may be sent \
                 again (raise dedup.max_scan_records to look further)"
            ),
        }
    }
}

/// One record of this relay, as read back.
struct Written {
    position: Position,
    id: String,
}

/// Reading one partition back, window by window.
struct Partition {
    id: i32,
    low: i64,
    /// The window being read: `[start, end)`, `end` `None` for the first (up to the true end).
    start: i64,
    end: Option<i64>,
    window: i64,
    done: bool,
    /// The polling batch of the newest record of this relay (`Lookback::LastBatch`).
    batch: Option<(u64, u64)>,
    /// Records of this relay in the window being read, oldest first.
    written: Vec<Written>,
    /// The window has been read to its end.
    read: bool,
    /// The offset after the last record read at the partition's end.
    tail: i64,
}

/// One topic's read-back; runs on a blocking thread.
struct Scan {
    cancelled: Arc<AtomicBool>,
    topic: String,
    source: Arc<str>,
    lookback: Lookback,
    fingerprint: Fingerprint,
    max_records: u64,
    deadline: Instant,
}

impl Scan {
    fn run(&self, consumer: &BaseConsumer<ReadBackContext>) -> Result<ScanOutcome, KafkaError> {
        let mut outcome = ScanOutcome {
            keys: HashSet::new(),
            result: ScanResult::Complete,
            partitions: 0,
            records: 0,
            foreign: 0,
        };
        let Some(mut partitions) = self.partitions(consumer)? else {
            outcome.result = ScanResult::TopicMissing;
            return Ok(outcome);
        };
        outcome.partitions = partitions.len();
        let started = Instant::now();
        while partitions.iter().any(|p| !p.done) {
            if outcome.records >= self.max_records {
                outcome.result = ScanResult::Limit;
                break;
            }
            self.read_windows(consumer, &mut partitions, &mut outcome)?;
            for partition in partitions.iter_mut().filter(|p| !p.done) {
                self.take_window(partition, &mut outcome);
            }
        }
        if started.elapsed() >= SLOW {
            self.settle(consumer, &mut partitions, &mut outcome)?;
        }
        consumer.unassign()?;
        Ok(outcome)
    }

    /// Looks at the partitions' ends again after [`SETTLE`], and takes the keys of any record
    /// of this relay that landed after the read-back had passed the end: they are newer than
    /// anything read, so all of them count (as their lookback allows).
    fn settle(
        &self,
        consumer: &BaseConsumer<ReadBackContext>,
        partitions: &mut [Partition],
        outcome: &mut ScanOutcome,
    ) -> Result<(), KafkaError> {
        std::thread::sleep(SETTLE);
        for p in partitions.iter_mut() {
            let (_, high) = self.patiently(|limit| consumer.fetch_watermarks(&self.topic, p.id, limit))?;
            // (a broker reporting the start of the last batch + 1 reports at most `tail` when
            // nothing was appended)
            (p.done, p.start, p.end) = (high <= p.tail, p.tail, None);
        }
        if partitions.iter().all(|p| p.done) {
            return Ok(());
        }
        tracing::debug!(topic = %self.topic, "records landed at the end after a slow read-back: reading them");
        self.read_windows(consumer, partitions, outcome)?;
        for p in partitions.iter_mut().filter(|p| !p.done) {
            for record in std::mem::take(&mut p.written) {
                match (self.lookback, record.position) {
                    (Lookback::Since(restart), Position::Stream { commit, .. }) if commit >= restart => {
                        outcome.keys.insert(self.fingerprint.key(&record.position, &record.id));
                    }
                    (Lookback::Since(_), _) => {}
                    (Lookback::Everything | Lookback::LastBatch, _) => {
                        outcome.keys.insert(self.fingerprint.id_key(&record.id));
                    }
                }
            }
            p.done = true;
        }
        Ok(())
    }

    /// Time left for the next step; an error once the deadline passed or the read was dropped.
    fn remaining(&self) -> Result<Duration, KafkaError> {
        if self.cancelled.load(Ordering::Relaxed) {
            return Err(KafkaError::Canceled);
        }
        self.deadline
            .checked_duration_since(Instant::now())
            .ok_or(KafkaError::MetadataFetch(RDKafkaErrorCode::OperationTimedOut))
    }

    /// `request` with at most a second per try, tried again (a broker restarting, a leader
    /// moving) until the deadline; the last error then.
    fn patiently<T>(
        &self,
        mut request: impl FnMut(Duration) -> Result<T, KafkaError>,
    ) -> Result<T, KafkaError> {
        loop {
            let limit = self.remaining()?.min(STEP);
            match request(limit) {
                Ok(answer) => return Ok(answer),
                Err(e) if self.remaining().is_err() => return Err(e),
                Err(e) => {
                    tracing::debug!(topic = %self.topic, error = %e, "reading back: trying again");
                    std::thread::sleep(POLL);
                }
            }
        }
    }

    /// The topic's partitions with their first windows; `None` when the topic does not exist.
    fn partitions(
        &self,
        consumer: &BaseConsumer<ReadBackContext>,
    ) -> Result<Option<Vec<Partition>>, KafkaError> {
        let metadata = self.patiently(|limit| consumer.fetch_metadata(Some(&self.topic), limit))?;
        let Some(topic) = metadata.topics().iter().find(|t| t.name() == self.topic) else { return Ok(None) };
        if topic.error().is_some() || topic.partitions().is_empty() {
            return Ok(None);
        }
        let mut partitions = Vec::with_capacity(topic.partitions().len());
        for p in topic.partitions() {
            let (low, high) =
                self.patiently(|limit| consumer.fetch_watermarks(&self.topic, p.id(), limit))?;
            partitions.push(Partition {
                id: p.id(),
                low,
                start: (high - FIRST_WINDOW).max(low),
                end: None,
                window: FIRST_WINDOW,
                done: high <= low,
                batch: None,
                written: Vec::new(),
                read: false,
                tail: high,
            });
        }
        Ok(Some(partitions))
    }

    /// Reads the current window of every partition not done, collecting this relay's records.
    fn read_windows(
        &self,
        consumer: &BaseConsumer<ReadBackContext>,
        partitions: &mut [Partition],
        outcome: &mut ScanOutcome,
    ) -> Result<(), KafkaError> {
        let mut assignment = TopicPartitionList::new();
        for p in partitions.iter_mut().filter(|p| !p.done) {
            assignment.add_partition_offset(&self.topic, p.id, Offset::Offset(p.start))?;
            p.read = false;
        }
        consumer.assign(&assignment)?;
        while partitions.iter().any(|p| !p.done && !p.read) {
            self.remaining()?;
            let message = match consumer.poll(POLL) {
                None => continue,
                Some(Err(KafkaError::PartitionEOF(id))) => {
                    if let Some(p) = partitions.iter_mut().find(|p| p.id == id) {
                        p.read = true;
                    }
                    continue;
                }
                Some(Err(e)) => return Err(e),
                Some(Ok(message)) => message,
            };
            let Some(p) = partitions.iter_mut().find(|p| p.id == message.partition() && !p.read) else {
                continue;
            };
            let offset = message.offset();
            if p.end.is_none() {
                p.tail = p.tail.max(offset + 1);
            }
            if p.end.is_some_and(|end| offset >= end) {
                p.read = true;
                continue;
            }
            outcome.records += 1;
            match self.written(&message) {
                Some((position, id)) => p.written.push(Written { position, id }),
                None => outcome.foreign += 1,
            }
            if p.end.is_some_and(|end| offset >= end - 1) {
                p.read = true;
            }
        }
        Ok(())
    }

    /// The position and id of a record this relay wrote; `None` for anyone else's.
    fn written(&self, message: &rdkafka::message::BorrowedMessage<'_>) -> Option<(Position, String)> {
        let headers = message.headers()?;
        let text = |name: &str| {
            headers
                .iter()
                .find(|h| h.key == name)
                .and_then(|h| h.value)
                .and_then(|v| std::str::from_utf8(v).ok())
        };
        if text(SOURCE_HEADER)? != &*self.source {
            return None;
        }
        let position = text(POSITION_HEADER)?.parse().ok()?;
        Some((position, text("id")?.to_string()))
    }

    /// Takes the keys of the window just read, newest first, until a record older than what the
    /// session can replay; then the partition is done, or its next (earlier) window is set.
    fn take_window(&self, p: &mut Partition, outcome: &mut ScanOutcome) {
        let written = std::mem::take(&mut p.written);
        for record in written.iter().rev() {
            if !self.take(p, record, &mut outcome.keys) {
                p.done = true;
                return;
            }
        }
        if p.start <= p.low {
            p.done = true;
            if p.low > 0 && self.lookback != Lookback::Everything && outcome.result == ScanResult::Complete {
                outcome.result = ScanResult::Truncated;
            }
            return;
        }
        p.window = p.window.saturating_mul(2);
        p.end = Some(p.start);
        p.start = (p.start - p.window).max(p.low);
    }

    /// Takes one record's key if the session can replay it; false when it is older than that.
    fn take(&self, p: &mut Partition, record: &Written, keys: &mut HashSet<u128>) -> bool {
        let fp = &self.fingerprint;
        match (self.lookback, record.position) {
            (Lookback::Since(restart), Position::Stream { commit, .. }) if commit >= restart => {
                keys.insert(fp.key(&record.position, &record.id));
                true
            }
            // a commit before the restart point, a copy (before the slot's consistent point) or
            // a polling batch (before a switch of mode): older than anything the slot replays
            (Lookback::Since(_), _) => false,
            (Lookback::Everything, _) => {
                keys.insert(fp.id_key(&record.id));
                true
            }
            (Lookback::LastBatch, Position::Batch { session, batch, .. }) => {
                let newest = *p.batch.get_or_insert((session, batch));
                if newest != (session, batch) {
                    return false;
                }
                keys.insert(fp.id_key(&record.id));
                true
            }
            (Lookback::LastBatch, _) => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_sides_compute_one_key_per_event() {
        let fp = Fingerprint(RandomState::new(), RandomState::new());
        let streamed = Position::Stream { commit: Lsn(100), index: 2 };
        assert_eq!(fp.key(&streamed, "7"), fp.key(&streamed, "7"));
        assert_ne!(fp.key(&streamed, "7"), fp.key(&Position::Stream { commit: Lsn(100), index: 3 }, "7"));
        assert_ne!(
            fp.key(&streamed, "7"),
            fp.key(&streamed, "8"),
            "an emitted message may reuse a position's id"
        );
        // a copied or polled row is known by its id wherever it was read
        let copied = Position::Copy { point: Lsn(5), index: 9 };
        let polled = Position::Batch { session: 1, batch: 2, index: 0 };
        assert_eq!(fp.key(&copied, "7"), fp.id_key("7"));
        assert_eq!(fp.key(&polled, "7"), fp.id_key("7"));
        assert_ne!(fp.key(&streamed, "7"), fp.id_key("7"));
    }
}
