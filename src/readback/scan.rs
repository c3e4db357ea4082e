//! Reading one topic back, on a blocking thread: the records of this relay that a session's
//! replay can repeat, as keys (see the parent module for the rule and why it cannot lose).
//!
//! Each partition is read backwards in windows of [`FIRST_WINDOW`], then twice as many, from its
//! end, and forward inside each window until librdkafka reports the partition's end (records can
//! land while it reads, so a high watermark read before is never where reading stops).
//! Newest first, records are taken until one is older than anything the replay can repeat.
//!
//! With Kafka transactions a `read_committed` reader's end is a partition's last stable offset:
//! the first record of a transaction still open. Before reading, each partition's end as a
//! `read_uncommitted` reader sees it is taken, and the read waits (at most [`PIN_WAIT`]) until
//! the stable offset reaches it; a partition still short then is *pinned*, and nothing is read
//! back (the session ends, see [`crate::sink::Pinned`]): records after an open transaction may
//! be made visible later, by a commit of this very producer (a "hanging" transaction of an
//! earlier instance of its `transactional.id`), and a read-back that stopped before them would
//! send them again.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{BorrowedMessage, Headers, Message};
use rdkafka::{Offset, TopicPartitionList};

use super::{Content, Fingerprint, Lookback, ReadBackContext};
use crate::observe::metrics::ScanResult;
use crate::record::Position;
use crate::record::format::Format;
use crate::sink::kafka::{POSITION_HEADER, SOURCE_HEADER};

mod report;

/// The first window read back from each partition's end; each further one is twice as large.
const FIRST_WINDOW: i64 = 256;
/// One poll's wait while reading back.
const POLL: Duration = Duration::from_millis(100);
/// A read-back whose deadline passes while its last record arrived at most this long before
/// was still reading (not waiting on a broker that does not answer): it ends `timeout`, with
/// what it read, rather than fail.
const READING: Duration = Duration::from_secs(3);
/// The longest one blocking request may take before the read checks its deadline again.
const STEP: Duration = Duration::from_secs(1);
/// After reading back, the relay looks at the ends again this long later (longer after a slow
/// read-back, as long as it took, at most [`SETTLE_MAX`]): a broker may process the last
/// requests of the relay that came before (a killed process's, still in its socket buffers)
/// after it answered this one, above all after a stall.
const SETTLE_MIN: Duration = Duration::from_millis(500);
const SETTLE_MAX: Duration = Duration::from_secs(1);
/// How long a read-back waits for open transactions below a partition's end to end. The
/// activation before it has aborted whatever an earlier instance of the relay's
/// `transactional.id` left open, so what still holds a partition is another producer's, or
/// one the coordinator no longer knows of.
const PIN_WAIT: Duration = Duration::from_secs(3);

pub(super) struct ScanOutcome {
    pub(super) keys: HashSet<u128>,
    result: ScanResult,
    partitions: usize,
    records: u64,
    foreign: u64,
    /// When the last record arrived.
    last_record: Option<Instant>,
    /// The partitions an open transaction held below their end (`result` is `Pinned`).
    pub(super) pinned: Vec<PinnedAt>,
}

/// A partition held below its end by an open transaction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct PinnedAt {
    pub(super) partition: i32,
    /// Its last stable offset: where the open transaction's first record is.
    pub(super) stable: i64,
    /// Its end, as a `read_uncommitted` reader saw it.
    pub(super) end: i64,
}

/// One record of this relay, as read back, with its key for the session's lookback.
struct Written {
    position: Position,
    key: u128,
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
pub(super) struct Scan {
    /// Set when the read-back's future is dropped (shutdown): the read stops at its next step.
    pub(super) cancelled: Arc<AtomicBool>,
    /// Set when the brokers refused the client's login: retrying cannot help, the read stops.
    pub(super) refused_login: Arc<std::sync::Mutex<Option<String>>>,
    pub(super) topic: String,
    /// `outbox_relay_source` of each of the relay's outboxes, by place.
    pub(super) sources: Arc<[Arc<str>]>,
    /// The record format of each outbox, by place: how to read an event's identity back.
    pub(super) formats: Arc<[Format]>,
    pub(super) lookback: Lookback,
    pub(super) fingerprint: Fingerprint,
    pub(super) max_records: u64,
    pub(super) deadline: Instant,
}

impl Scan {
    /// Reads the topic back with `consumer` (`read_committed`); `ends`, with Kafka transactions,
    /// is a `read_uncommitted` client that tells where the partitions really end.
    pub(super) fn run(
        &self,
        consumer: &BaseConsumer<ReadBackContext>,
        ends: Option<&BaseConsumer<ReadBackContext>>,
    ) -> Result<ScanOutcome, KafkaError> {
        let mut outcome = ScanOutcome {
            keys: HashSet::new(),
            result: ScanResult::Complete,
            partitions: 0,
            records: 0,
            foreign: 0,
            last_record: None,
            pinned: Vec::new(),
        };
        let Some(mut partitions) = self.partitions(consumer)? else {
            outcome.result = ScanResult::TopicMissing;
            return Ok(outcome);
        };
        outcome.partitions = partitions.len();
        if let Some(ends) = ends {
            outcome.pinned = self.pinned(consumer, ends, &mut partitions)?;
            if !outcome.pinned.is_empty() {
                outcome.result = ScanResult::Pinned;
                return Ok(outcome);
            }
        }
        let started = Instant::now();
        while partitions.iter().any(|p| !p.done) {
            if outcome.records >= self.max_records {
                outcome.result = ScanResult::Limit;
                break;
            }
            if let Err(e) = self.read_windows(consumer, &mut partitions, &mut outcome) {
                // out of time while records still arrived: the windows read whole count (one read
                // in part may lack its newest records, which a polling lookback starts from), the
                // rest is sent again; anything else (a broker that does not answer) fails the read
                if !self.out_of_time_reading(&outcome) {
                    return Err(e);
                }
                for partition in partitions.iter_mut().filter(|p| !p.done && p.read) {
                    self.take_window(partition, &mut outcome);
                }
                outcome.result = ScanResult::Timeout;
                consumer.unassign()?;
                return Ok(outcome);
            }
            for partition in partitions.iter_mut().filter(|p| !p.done) {
                self.take_window(partition, &mut outcome);
            }
        }
        let took = started.elapsed();
        self.settle(consumer, &mut partitions, &mut outcome, took.clamp(SETTLE_MIN, SETTLE_MAX))?;
        consumer.unassign()?;
        Ok(outcome)
    }

    /// Looks at the partitions' ends again after `pause`, and takes the keys of any record of
    /// this relay that landed after the read-back had passed the end: they are newer than
    /// anything read, so all of them count (as their lookback allows).
    fn settle(
        &self,
        consumer: &BaseConsumer<ReadBackContext>,
        partitions: &mut [Partition],
        outcome: &mut ScanOutcome,
        pause: Duration,
    ) -> Result<(), KafkaError> {
        std::thread::sleep(pause);
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
            // what landed late is newer than the batch seen at the end: the newest now
            p.batch = None;
            for record in std::mem::take(&mut p.written) {
                if self.replayable(p, &record) {
                    outcome.keys.insert(record.key);
                }
            }
            p.done = true;
        }
        Ok(())
    }

    /// Whether the deadline passed while records were arriving (see [`READING`]).
    fn out_of_time_reading(&self, outcome: &ScanOutcome) -> bool {
        let now = Instant::now();
        now >= self.deadline
            && !self.cancelled.load(Ordering::Relaxed)
            && outcome.last_record.is_some_and(|at| now.duration_since(at) <= READING)
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
                Err(_) if self.refused_login.lock().unwrap().is_some() => {
                    return Err(KafkaError::Global(RDKafkaErrorCode::Authentication));
                }
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
        let metadata = self.patiently(|limit| {
            let answer = consumer.fetch_metadata(Some(&self.topic), limit);
            if answer.is_err() {
                // nothing is assigned yet: serving the queue delivers librdkafka's errors and
                // log lines (a refused login among them) to the context, and no record
                let _ = consumer.poll(Duration::ZERO);
            }
            answer
        })?;
        let Some(topic) = metadata.topics().iter().find(|t| t.name() == self.topic) else { return Ok(None) };
        if topic.error().is_some() || topic.partitions().is_empty() {
            return Ok(None);
        }
        let ids: Vec<i32> = topic.partitions().iter().map(|p| p.id()).collect();
        // one ListOffsets request per end for all partitions (not two round trips per partition)
        let lows = self.offsets(consumer, &ids, Offset::Beginning)?;
        let highs = self.offsets(consumer, &ids, Offset::End)?;
        let mut partitions = Vec::with_capacity(ids.len());
        for ((id, low), high) in ids.into_iter().zip(lows).zip(highs) {
            partitions.push(Partition {
                id,
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

    /// Waits (at most [`PIN_WAIT`]) until each partition's last stable offset reaches the end
    /// `ends` sees now, moving its first window up as it does; the partitions still short then.
    fn pinned(
        &self,
        consumer: &BaseConsumer<ReadBackContext>,
        ends: &BaseConsumer<ReadBackContext>,
        partitions: &mut [Partition],
    ) -> Result<Vec<PinnedAt>, KafkaError> {
        let ids: Vec<i32> = partitions.iter().map(|p| p.id).collect();
        let targets = self.offsets(ends, &ids, Offset::End)?;
        let until = Instant::now() + PIN_WAIT;
        loop {
            let short: Vec<PinnedAt> = (partitions.iter().zip(&targets))
                .filter(|(p, end)| p.tail < **end)
                .map(|(p, end)| PinnedAt { partition: p.id, stable: p.tail, end: *end })
                .collect();
            if short.is_empty() || Instant::now() >= until {
                return Ok(short);
            }
            tracing::debug!(topic = %self.topic, pinned = ?short, "reading back: waiting for open transactions to end");
            std::thread::sleep(POLL);
            let stable = self.offsets(consumer, &ids, Offset::End)?;
            for (p, high) in partitions.iter_mut().zip(stable) {
                if high > p.tail {
                    (p.tail, p.start, p.done) = (high, (high - FIRST_WINDOW).max(p.low), high <= p.low);
                }
            }
        }
    }

    /// The first (`Offset::Beginning`) or next (`Offset::End`) offset of each of `ids`, in order.
    fn offsets(
        &self,
        consumer: &BaseConsumer<ReadBackContext>,
        ids: &[i32],
        end: Offset,
    ) -> Result<Vec<i64>, KafkaError> {
        let mut request = TopicPartitionList::new();
        for id in ids {
            request.add_partition_offset(&self.topic, *id, end)?;
        }
        let answer = self.patiently(|limit| consumer.offsets_for_times(request.clone(), limit))?;
        ids.iter()
            .map(|id| {
                let element = answer
                    .find_partition(&self.topic, *id)
                    .ok_or(KafkaError::OffsetFetch(RDKafkaErrorCode::UnknownTopicOrPartition))?;
                element.error()?;
                match element.offset() {
                    Offset::Offset(offset) => Ok(offset),
                    _ => Err(KafkaError::OffsetFetch(RDKafkaErrorCode::OffsetNotAvailable)),
                }
            })
            .collect()
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
            // (a stale message of another topic the consumer read before is passed over)
            let Some(p) = partitions
                .iter_mut()
                .find(|p| p.id == message.partition() && !p.read && message.topic() == self.topic)
            else {
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
            outcome.last_record = Some(Instant::now());
            let written = self.written(&message);
            if written.is_empty() {
                outcome.foreign += 1;
            }
            p.written.extend(written);
            if p.end.is_some_and(|end| offset >= end - 1) {
                p.read = true;
            }
        }
        Ok(())
    }

    /// The records this relay wrote (or, for an outbox of the `debezium` format during a first
    /// copy, Debezium wrote), keyed for the session's lookback; empty for anyone else's.
    fn written(&self, message: &BorrowedMessage<'_>) -> Vec<Written> {
        let headers = message.headers();
        let header =
            |name: &str| headers.and_then(|h| h.iter().find(|h| h.key == name)).and_then(|h| h.value);
        let text = |name: &str| header(name).and_then(|v| std::str::from_utf8(v).ok());
        let (key, value) = (message.key().unwrap_or_default(), message.payload().unwrap_or_default());
        let Some(source) = text(SOURCE_HEADER) else {
            return self.debeziums(header, key, value);
        };
        let Some(outbox) = self.sources.iter().position(|s| &**s == source) else { return Vec::new() };
        let Some(position) = text(POSITION_HEADER).and_then(|p| p.parse::<Position>().ok()) else {
            return Vec::new();
        };
        let Some(identity) = self.formats[outbox].identity(header, value) else { return Vec::new() };
        let content = Content::read(outbox, &identity, key);
        let key = match self.lookback {
            Lookback::Since(_) => self.fingerprint.key(&position, &content),
            Lookback::Everything | Lookback::LastBatch => self.fingerprint.id_key(&content),
        };
        vec![Written { position, key }]
    }

    /// A record with no `outbox_relay_source`, read back for a first copy: Debezium's outbox
    /// router may have written it (a cutover), so when exactly one of the relay's outboxes has
    /// the `debezium` format it is keyed as that outbox's, by its `id` header and bytes; the
    /// relay's own record of the same row has that key only if it is the same bytes. (Debezium's
    /// records carry no event type, so an id used again for another event of the same key and
    /// value would be taken for it.) Other lookbacks key by position, which it has none of.
    fn debeziums<'m>(
        &self,
        header: impl Fn(&str) -> Option<&'m [u8]>,
        key: &[u8],
        value: &'m [u8],
    ) -> Vec<Written> {
        // (with two such outboxes a record could be credited to the wrong one: none is)
        let debeziums = self.formats.iter().filter(|f| matches!(f, Format::Debezium(_))).count();
        if self.lookback != Lookback::Everything || debeziums != 1 {
            return Vec::new();
        }
        let Some(identity) = Format::Debezium(Default::default()).identity(header, value) else {
            return Vec::new();
        };
        let position = Position::Copy { point: crate::lsn::Lsn(0), index: 0 };
        (self.formats.iter().enumerate())
            .filter(|(_, f)| matches!(f, Format::Debezium(_)))
            .map(|(outbox, _)| Written {
                position,
                key: self.fingerprint.id_key(&Content::read(outbox, &identity, key)),
            })
            .collect()
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
            // (a whole-topic read-back, a switch from replication mode, too: what retention
            // removed may be what the outbox still holds, and is sent again)
            if p.low > 0 && outcome.result == ScanResult::Complete {
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
        if let (Lookback::LastBatch, Position::Batch { session, batch, .. }) =
            (self.lookback, record.position)
        {
            p.batch.get_or_insert((session, batch));
        }
        let replayable = self.replayable(p, record);
        if replayable {
            keys.insert(record.key);
        }
        replayable
    }

    /// Whether the session's replay can repeat `record` (the one rule `take` and `settle` share):
    /// a stream record committed at or after the restart point; anything of the first copy's
    /// topic; a record of the partition's newest polling batch.
    fn replayable(&self, p: &Partition, record: &Written) -> bool {
        match (self.lookback, record.position) {
            (Lookback::Since(restart), Position::Stream { commit, .. }) => commit >= restart,
            // a copy (before the slot's consistent point) or a polling batch (before a switch of
            // mode): older than anything the slot replays
            (Lookback::Since(_), _) => false,
            (Lookback::Everything, _) => true,
            (Lookback::LastBatch, Position::Batch { session, batch, .. }) => {
                p.batch.is_none_or(|newest| newest == (session, batch))
            }
            (Lookback::LastBatch, _) => false,
        }
    }
}

#[cfg(test)]
mod tests;
