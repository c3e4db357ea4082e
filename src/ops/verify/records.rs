//! Reading the topics for `verify`, on a blocking thread: every record of this source from the
//! window's start (or each partition's beginning) to the partition's end, with
//! `isolation.level=read_committed`, checked against the [`Expected`] rows as it streams by.
//!
//! A partition is read to its high watermark read when its topic's read begins (or its
//! PartitionEOF, whichever comes first): every record of a row verify read was acknowledged
//! before that, and waiting for an end while the relay keeps publishing may never finish (some
//! ends come as a global PartitionEOF that names no partition). Per aggregate key, the
//! last record's place in commit order is kept (its commit LSN for streamed records, else its
//! id) to see records of one key out of order.

use std::collections::HashMap;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::time::{Duration, Instant, SystemTime};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{BorrowedMessage, Headers, Message};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};

use super::expected::{Expected, fingerprint};
use super::report::Class;
use crate::config::KafkaConfig;
use crate::published::{IdBits, numeric_id};
use crate::record::Position;
use crate::record::format::{Format, Identity};
use crate::sink::kafka::{
    POSITION_HEADER, REPLAYED_HEADER, REPUBLISHED_HEADER, ReaderContext, SOURCE_HEADER,
};

/// How long one metadata or offsets request may take.
const REQUEST: Duration = Duration::from_secs(10);
/// One poll's wait.
const POLL: Duration = Duration::from_millis(200);
/// How far before `--since` reading starts: records carry their produce time, after the row's
/// `created_at`, but the relay's and the database's clocks may disagree a little.
pub const CLOCK_SLACK: Duration = Duration::from_secs(300);

/// A record whose id the window does not hold, and where it is.
#[derive(Debug, Clone)]
pub struct Located {
    pub id: String,
    pub at: String,
}

/// What reading the topics found, besides what it marked in [`Expected`].
#[derive(Debug, Default)]
pub struct Scan {
    pub records: u64,
    /// Records of other sources (or without the relay's headers), not looked at further.
    pub foreign: u64,
    pub partitions: usize,
    pub missing_topics: Vec<String>,
    /// This source's records whose id is not a row of the window and not recorded as
    /// published: looked up in the table later.
    pub outside: Vec<Located>,
    /// Records whose id is not a row of the window but was recorded as published (its row was
    /// deleted, or lies outside the window), and those ids.
    pub published_elsewhere: u64,
    pub seen_published: IdBits,
    /// Per partition read: where reading began and this source's smallest numeric id there.
    spans: HashMap<(String, i32), Span>,
    /// Partitions retention emptied (nothing read, the log starts after offset 0).
    emptied: Vec<String>,
    /// Records `replay-dead-letters` sent ([`REPLAYED_HEADER`]): neither compared nor ordered.
    pub replayed: u64,
    pub out_of_order: Class,
}

/// What one partition's read showed of what retention removed.
#[derive(Debug, Clone, Copy)]
struct Span {
    /// The first record's offset: above 0 when older records were removed (read from the start).
    first_offset: i64,
    lowest_id: Option<i64>,
}

impl Scan {
    /// The smallest id Kafka can be asked for: recorded ids below it may have been removed by
    /// retention. In each partition whose older records were removed, ids below its smallest
    /// one may be gone; the floor is the highest of those. `None` when a partition was emptied,
    /// or lost records and holds none of this source's: no recorded id can be asked for then.
    pub fn floor(&self) -> Option<i64> {
        if !self.emptied.is_empty() {
            return None;
        }
        let truncated = self.spans.values().filter(|span| span.first_offset > 0);
        truncated.map(|span| span.lowest_id).try_fold(0, |floor, lowest| Some(floor.max(lowest?)))
    }

    /// Why [`Scan::floor`] is `None`, for the report.
    pub fn emptied(&self) -> &[String] {
        &self.emptied
    }
}

/// Where one key's last record stands in commit order.
#[derive(Clone, Copy)]
struct Place {
    id: Option<i64>,
    stream: Option<(u64, u32)>,
}

impl Place {
    fn is_before(&self, last: &Place) -> bool {
        match (self.stream, last.stream) {
            (Some(this), Some(that)) => this < that,
            _ => matches!((self.id, last.id), (Some(this), Some(that)) if this < that),
        }
    }
}

pub struct Reader {
    consumer: BaseConsumer<ReaderContext>,
    since: Option<SystemTime>,
    idle_limit: Duration,
    checker: Checker,
}

/// Matches records against the rows as they stream by.
struct Checker {
    /// `None`: `kafka.source_headers = false`, every record counts.
    source: Option<String>,
    /// The outbox's record format: how a record says its event's id.
    format: Format,
    /// Records are compared whole (the relay's own format), or by their identity.
    whole: bool,
    /// Per key (hashed): the last record's place in commit order, and its id.
    last: HashMap<u64, (Place, String)>,
    /// The ids the relay recorded as published (`crate::published`).
    published: IdBits,
    keep: usize,
}

impl Reader {
    pub fn new(
        kafka: &KafkaConfig,
        source: Option<String>,
        (format, whole): (Format, bool),
        since: Option<SystemTime>,
        published: IdBits,
        keep: usize,
    ) -> Result<Reader, KafkaError> {
        let consumer = reader_config(kafka).create_with_context(ReaderContext)?;
        crate::sink::kafka::serve_token_request(&consumer);
        let idle_limit = Duration::from_millis(kafka.message_timeout_ms.max(30_000));
        let checker = Checker { source, format, whole, last: HashMap::new(), published, keep };
        Ok(Reader { consumer, since, idle_limit, checker })
    }

    /// Reads every topic the rows route to.
    pub fn scan(mut self, expected: &mut Expected) -> Result<Scan, String> {
        let mut scan = Scan::default();
        let topics: Vec<String> = expected.topics.iter().cloned().collect();
        for topic in topics {
            self.checker.last.clear();
            self.scan_topic(&topic, expected, &mut scan)
                .map_err(|e| format!("reading topic {topic}: {e}"))?;
        }
        Ok(scan)
    }

    /// Reads one topic: every record of it marked in `expected` or noted in `scan`, and the
    /// partitions retention emptied.
    fn scan_topic(
        &mut self,
        topic: &str,
        expected: &mut Expected,
        scan: &mut Scan,
    ) -> Result<(), KafkaError> {
        let Some(assignment) = self.assignment(topic)? else {
            scan.missing_topics.push(topic.to_string());
            return Ok(());
        };
        scan.partitions += assignment.count();
        let checker = &mut self.checker;
        let observe = |message: &BorrowedMessage<'_>| checker.observe(message, expected, scan);
        if read_to_end(&self.consumer, topic, &assignment, self.idle_limit, observe)? {
            self.note_emptied(topic, &assignment, scan)?;
        }
        Ok(())
    }

    /// Without a window, the partitions of `topic` where nothing of this source was read and
    /// retention removed records (the log starts after offset 0).
    fn note_emptied(
        &self,
        topic: &str,
        assignment: &TopicPartitionList,
        scan: &mut Scan,
    ) -> Result<(), KafkaError> {
        for element in assignment.elements() {
            let partition = element.partition();
            if self.since.is_none() && !scan.spans.contains_key(&(topic.to_string(), partition)) {
                let (low, _) = self.consumer.fetch_watermarks(topic, partition, REQUEST)?;
                if low > 0 {
                    scan.emptied.push(format!("{topic}[{partition}]"));
                }
            }
        }
        Ok(())
    }

    /// Every partition of `topic` from the window's start (or its beginning); `None` when the
    /// topic does not exist.
    fn assignment(&self, topic: &str) -> Result<Option<TopicPartitionList>, KafkaError> {
        let metadata = self.consumer.fetch_metadata(Some(topic), REQUEST)?;
        let Some(found) = metadata.topics().iter().find(|t| t.name() == topic) else { return Ok(None) };
        if found.error().is_some() || found.partitions().is_empty() {
            return Ok(None);
        }
        let start = match self.since {
            None => Offset::Beginning,
            Some(since) => {
                let at = since.checked_sub(CLOCK_SLACK).unwrap_or(SystemTime::UNIX_EPOCH);
                let millis = at.duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default().as_millis();
                Offset::Offset(millis as i64)
            }
        };
        let mut request = TopicPartitionList::new();
        for partition in found.partitions() {
            request.add_partition_offset(topic, partition.id(), start)?;
        }
        if self.since.is_none() {
            return Ok(Some(request));
        }
        // a timestamp with no record at or after it answers End: nothing to read there, but the
        // partition is still assigned so that its EOF counts it done
        Ok(Some(self.consumer.offsets_for_times(request, REQUEST)?))
    }
}

impl Checker {
    /// Marks `message` in `expected` (seen, mismatched) or notes it in `scan` (another source's,
    /// replayed, outside the window), and checks its key's order.
    fn observe(&mut self, message: &BorrowedMessage<'_>, expected: &mut Expected, scan: &mut Scan) {
        let span = scan
            .spans
            .entry((message.topic().to_string(), message.partition()))
            .or_insert(Span { first_offset: message.offset(), lowest_id: None });
        let Some(identity) = identity(message, &self.format, self.source.as_deref()) else {
            scan.foreign += 1;
            return;
        };
        let id: &str = &identity.id;
        scan.records += 1;
        let replayed = header(message, REPLAYED_HEADER).is_some();
        // (a replay is an old id sent late: it says nothing of what retention removed)
        if let Some(n) = numeric_id(id).filter(|_| !replayed) {
            span.lowest_id = Some(span.lowest_id.map_or(n, |lowest| lowest.min(n)));
        }
        let at = format!("{topic}[{}]@{}", message.partition(), message.offset(), topic = message.topic());
        let Some(slot) = expected.get_mut(id) else {
            if replayed {
                // its row went with its letter; `replay-dead-letters` sent it (and recorded it)
                scan.replayed += 1;
                if let Some(n) = numeric_id(id) {
                    scan.seen_published.insert(n);
                }
                return;
            }
            return self.outside(Located { id: id.to_string(), at }, scan);
        };
        slot.seen += 1;
        if replayed {
            // the letter's data as fixed, after later events of its key: neither compared nor ordered
            scan.replayed += 1;
            return;
        }
        if self.fingerprint(message, &identity) != slot.fingerprint {
            slot.mismatched += 1;
        }
        if slot.seen == 1 {
            let position = header(message, POSITION_HEADER)
                .and_then(|v| std::str::from_utf8(v).ok())
                .and_then(|v| v.parse::<Position>().ok());
            self.check_order(message.key().unwrap_or_default(), id, position, at, scan);
        }
    }

    /// What of `message` is compared with its row: all of it (the relay's own format), or its
    /// key, its payload and its event type as written.
    fn fingerprint(&self, message: &BorrowedMessage<'_>, identity: &Identity<'_>) -> u64 {
        let (topic, key, payload) = (message.topic(), message.key().unwrap_or_default(), message.payload());
        // the relay's two headers come first; a row's own header of the same name stays (a row's
        // header may not be named outbox_relay_*: a republished copy's mark is never the row's)
        let own = message
            .headers()
            .into_iter()
            .flat_map(|h| h.iter())
            .enumerate()
            .filter(|(i, h)| !(*i < 2 && (h.key == SOURCE_HEADER || h.key == POSITION_HEADER)))
            .filter(|(_, h)| h.key != REPUBLISHED_HEADER)
            .map(|(_, h)| (h.key, h.value.unwrap_or_default()));
        match self.whole {
            true => fingerprint(topic, key, payload.unwrap_or_default(), own),
            // (a format's headers hold CloudEvents' `time`, the commit time when streamed)
            false => fingerprint(
                topic,
                key,
                &identity.payload,
                std::iter::once(("type", identity.event_type.as_bytes())),
            ),
        }
    }

    /// A record whose id is no row of the window: a published id's (its row was deleted, or lies
    /// outside the window), or one to look up in the table.
    fn outside(&mut self, located: Located, scan: &mut Scan) {
        match numeric_id(&located.id).filter(|n| self.published.contains(*n)) {
            Some(n) => {
                scan.published_elsewhere += 1;
                scan.seen_published.insert(n);
            }
            None => scan.outside.push(located),
        }
    }

    /// Notes `id` out of order when its key's previous record comes later in commit order.
    fn check_order(&mut self, key: &[u8], id: &str, position: Option<Position>, at: String, scan: &mut Scan) {
        let stream = match position {
            Some(Position::Stream { commit, index }) => Some((commit.0, index)),
            _ => None,
        };
        let place = Place { id: id.parse().ok(), stream };
        let mut hash = DefaultHasher::new();
        key.hash(&mut hash);
        if let Some((last, last_id)) = self.last.get(&hash.finish())
            && place.is_before(last)
        {
            let key = String::from_utf8_lossy(key);
            scan.out_of_order.note(self.keep, || format!("key {key}: id {id} at {at} after id {last_id}"));
        }
        self.last.insert(hash.finish(), (place, id.to_string()));
    }
}

/// The value of `message`'s header `name`, if it has one.
fn header<'m>(message: &'m BorrowedMessage<'_>, name: &str) -> Option<&'m [u8]> {
    message.headers().and_then(|h| h.iter().find(|h| h.key == name)).and_then(|h| h.value)
}

/// The event `message` is of, as `format` reads it, when it is a record of this source
/// (`source`: its header; None, any record).
pub(crate) fn identity<'m>(
    message: &'m BorrowedMessage<'_>,
    format: &Format,
    source: Option<&str>,
) -> Option<Identity<'m>> {
    let ours = source.is_none_or(|s| header(message, SOURCE_HEADER) == Some(s.as_bytes()));
    let value = message.payload().unwrap_or_default();
    format.identity(|name| header(message, name), value).filter(|_| ours)
}

/// Reads each partition of `assignment` (of `topic`) from its assigned offset to its high
/// watermark as the read begins, or its PartitionEOF, whichever comes first, calling `seen` with
/// each record. Every record of a row read before was acknowledged by then (replication: the
/// slot confirmed past it; polling: it was released), and records landing meanwhile belong to
/// later rows. `false`, having assigned nothing, when no partition has anything to read.
pub(crate) fn read_to_end(
    consumer: &BaseConsumer<ReaderContext>,
    topic: &str,
    assignment: &TopicPartitionList,
    idle_limit: Duration,
    mut seen: impl FnMut(&BorrowedMessage<'_>),
) -> Result<bool, KafkaError> {
    let mut ends: HashMap<i32, i64> = HashMap::new();
    for element in assignment.elements() {
        let (low, high) = consumer.fetch_watermarks(topic, element.partition(), REQUEST)?;
        let empty = match element.offset() {
            Offset::Offset(start) => start >= high,
            Offset::End => true,
            _ => low >= high,
        };
        if !empty {
            ends.insert(element.partition(), high);
        }
    }
    if ends.is_empty() {
        return Ok(false);
    }
    consumer.assign(assignment)?;
    let mut idle_since = Instant::now();
    while !ends.is_empty() {
        match consumer.poll(POLL) {
            Some(Ok(message)) => {
                idle_since = Instant::now();
                seen(&message);
                if ends.get(&message.partition()).is_some_and(|end| message.offset() + 1 >= *end) {
                    ends.remove(&message.partition());
                }
            }
            Some(Err(KafkaError::PartitionEOF(partition))) => {
                ends.remove(&partition);
            }
            Some(Err(e)) => return Err(e),
            None if idle_since.elapsed() > idle_limit => {
                return Err(KafkaError::MessageConsumption(RDKafkaErrorCode::OperationTimedOut));
            }
            None => {}
        }
    }
    consumer.unassign()?;
    Ok(true)
}

/// The settings of verify's reader (see [`crate::sink::kafka::reader_config`]): committed records
/// only, prefetching at most 16 MB.
pub(crate) fn reader_config(kafka: &KafkaConfig) -> ClientConfig {
    let mut cc = crate::sink::kafka::reader_config(kafka, "verify", 100);
    cc.set("isolation.level", "read_committed")
        // librdkafka prefetches up to 64 MB by default; verify reads one topic at a time and
        // keeps up, so a smaller queue costs it nothing (a cap on the messages queued per
        // partition, `queued.min.messages` = 10,000, cut peak RSS at 1,000,000 events from 97 to
        // 51 MiB but made verify ten times slower)
        .set("queued.max.messages.kbytes", "16384");
    cc
}
