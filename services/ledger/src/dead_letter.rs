//! Dead letters: where a record goes when it cannot be applied, and `replay-dlq`, which sends
//! them back.
//!
//! Invariants:
//! - a dead letter is the original record (key, value, every header but `dlq_*` ones, in
//!   order) plus `dlq_reason`, `dlq_attempts`, `dlq_topic`, `dlq_partition` and `dlq_offset`
//!   (so those are the ledger's own, once each, whatever the original carried), produced with
//!   `acks=all` and the idempotent producer; the consumer records the event as `dead_lettered`
//!   and commits its offset only after the broker acknowledged the dead letter, so a record is
//!   never skipped without a copy (the copy may be written twice if the process dies between
//!   the acknowledgement and the database commit: dead letters are at-least-once);
//! - a replay re-produces a dead letter only into `consumer.topic`, without any `dlq_*` header
//!   (every occurrence), i.e. as the relay first wrote it, and commits the dead-letter offset
//!   after the broker acknowledged it. A header never chooses where it goes: a dead letter whose
//!   (last, the ledger's) `dlq_topic` names another topic is skipped with a warning, counted
//!   and committed, left in the dead-letter topic. The inbox makes a replay of an event that
//!   was applied meanwhile harmless, and lets a dead-lettered event be applied once;
//! - a replay ends at the end of each partition as it was when the replay started: a replayed
//!   record that fails again comes back as a new dead letter, and chasing it would send it
//!   round and round while a ledger runs. It waits for the next replay.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use outbox_relay::config::KafkaConfig;
use outbox_relay::sink::kafka::TokenContext;
use rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use rdkafka::error::KafkaError;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::util::Timeout;
use rdkafka::{Offset, TopicPartitionList};
use tokio::sync::watch;

use crate::config::LedgerConfig;
use crate::error::LedgerError;
use crate::record::Inbound;

/// Headers a dead letter adds to the original record's.
pub const DLQ_REASON: &str = "dlq_reason";
pub const DLQ_ATTEMPTS: &str = "dlq_attempts";
pub const DLQ_TOPIC: &str = "dlq_topic";
pub const DLQ_PARTITION: &str = "dlq_partition";
pub const DLQ_OFFSET: &str = "dlq_offset";
/// What every dead-letter header starts with; a replay strips them all, known or not.
const DLQ_PREFIX: &str = "dlq_";

/// How long `replay-dlq` waits for a record before it decides the topic is drained.
const REPLAY_IDLE: Duration = Duration::from_secs(30);

type HeaderList = Vec<(String, Option<Vec<u8>>)>;

/// The producer of dead letters (and of replays).
pub struct DeadLetters {
    producer: FutureProducer<TokenContext>,
    topic: String,
}

impl DeadLetters {
    pub fn new(kafka: &KafkaConfig, topic: String) -> Result<DeadLetters, LedgerError> {
        let producer = outbox_relay::sink::kafka::producer_config(kafka)
            .create_with_context(TokenContext)
            .map_err(|source| LedgerError::KafkaClient { client: "dead-letter producer", source })?;
        Ok(DeadLetters { producer, topic })
    }

    /// Produces `record`'s dead letter and resolves when the broker acknowledged it.
    pub async fn send(&self, record: &Inbound, reason: &str, attempts: u32) -> Result<(), KafkaError> {
        let headers = dead_letter_headers(record, reason, attempts);
        self.produce(&self.topic, record, headers).await
    }

    async fn produce(&self, topic: &str, record: &Inbound, headers: HeaderList) -> Result<(), KafkaError> {
        let mut out = FutureRecord::<[u8], [u8]>::to(topic).headers(owned(&headers));
        if let Some(key) = &record.key {
            out = out.key(key.as_slice());
        }
        if let Some(payload) = &record.payload {
            out = out.payload(payload.as_slice());
        }
        self.producer.send(out, Timeout::Never).await.map(|_| ()).map_err(|(e, _)| e)
    }
}

/// The original headers but any `dlq_*` of its own, then the ledger's `dlq_*` ones.
pub fn dead_letter_headers(record: &Inbound, reason: &str, attempts: u32) -> HeaderList {
    let mut headers = replay_headers(record);
    let added = [
        (DLQ_REASON, reason.to_string()),
        (DLQ_ATTEMPTS, attempts.to_string()),
        (DLQ_TOPIC, record.topic.clone()),
        (DLQ_PARTITION, record.partition.to_string()),
        (DLQ_OFFSET, record.offset.to_string()),
    ];
    headers.extend(added.into_iter().map(|(key, value)| (key.to_string(), Some(value.into_bytes()))));
    headers
}

/// The headers a dead letter had before it was dead-lettered: every one but those starting
/// with `dlq_`, wherever they are.
pub fn replay_headers(dead_letter: &Inbound) -> HeaderList {
    dead_letter.headers.iter().filter(|(key, _)| !key.starts_with(DLQ_PREFIX)).cloned().collect()
}

/// The last `name` header as text: the ledger appends its `dlq_*` headers after the record's.
fn last_header<'a>(record: &'a Inbound, name: &str) -> Option<&'a str> {
    let value = record.headers.iter().rev().find(|(key, _)| key == name)?.1.as_deref()?;
    std::str::from_utf8(value).ok()
}

/// Why a dead letter is not replayed into `topic` (the consumer's): it came from another one.
pub fn replay_refusal(dead_letter: &Inbound, topic: &str) -> Option<String> {
    let from = last_header(dead_letter, DLQ_TOPIC)?;
    (from != topic).then(|| {
        format!(
            "its {DLQ_TOPIC} is \"{from}\", not consumer.topic \"{topic}\": a replay sends only into \
             consumer.topic; replay it with a ledger configured for {from}, or by hand"
        )
    })
}

fn owned(headers: &HeaderList) -> OwnedHeaders {
    headers.iter().fold(OwnedHeaders::new_with_capacity(headers.len()), |out, (key, value)| {
        out.insert(Header { key, value: value.as_deref() })
    })
}

/// `ledger replay-dlq`: sends up to `limit` dead letters back to their original topics, in
/// group `<group_id>-replay`, committing each after the broker acknowledged its copy. Stops at
/// the end every partition had when it started, after `limit`, or on shutdown. Returns how
/// many it sent.
pub async fn replay(
    config: &LedgerConfig,
    limit: Option<u64>,
    mut shutdown: watch::Receiver<bool>,
) -> Result<u64, LedgerError> {
    let dead_letter_topic = config.consumer.dead_letter_topic();
    let consumer = replay_consumer(config, &dead_letter_topic)?;
    let sender = DeadLetters::new(&config.kafka, dead_letter_topic.clone())?;
    let partitions = partition_count(&consumer, &dead_letter_topic)?;
    let ends = end_offsets(&consumer, &dead_letter_topic, partitions)?;
    let group = config.consumer.replay_group_id();
    tracing::info!(topic = %dead_letter_topic, partitions, %group, "replaying dead letters");
    // partitions replayed up to their end offset at the start
    let mut at_end = HashSet::new();
    let (mut replayed, mut skipped) = (0, 0_u64);
    while limit.is_none_or(|limit| replayed < limit) && at_end.len() < partitions {
        let next = tokio::select! {
            biased;
            _ = shutdown.wait_for(|stop| *stop) => break,
            next = tokio::time::timeout(REPLAY_IDLE, consumer.recv()) => next,
        };
        let record = match next {
            Err(_) => {
                tracing::info!(idle = ?REPLAY_IDLE, "no dead letter arrived for a while: done");
                break;
            }
            Ok(Err(KafkaError::PartitionEOF(partition))) => {
                at_end.insert(partition);
                continue;
            }
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "kafka consumer error");
                continue;
            }
            Ok(Ok(message)) => Inbound::from_message(&message),
        };
        let end = ends.get(&record.partition).copied().unwrap_or(0);
        if record.offset >= end {
            // dead-lettered since the replay started (perhaps a replayed record that failed
            // again): left, uncommitted, for the next replay
            at_end.insert(record.partition);
            continue;
        }
        if replay_one(&sender, &config.consumer.topic, &record).await? {
            replayed += 1;
        } else {
            skipped += 1;
        }
        commit_sync(&consumer, &record)?;
        if record.offset + 1 >= end {
            at_end.insert(record.partition);
        }
    }
    if skipped > 0 {
        tracing::warn!(
            skipped,
            topic = %config.consumer.topic,
            "dead letters of another topic were skipped (and committed): they are still in the dead-letter topic"
        );
    }
    Ok(replayed)
}

fn replay_consumer(config: &LedgerConfig, topic: &str) -> Result<StreamConsumer<TokenContext>, LedgerError> {
    let consumer: StreamConsumer<TokenContext> =
        crate::consumer::group_config(config, &config.consumer.replay_group_id())
            .set("enable.partition.eof", "true")
            .create_with_context(TokenContext)
            .map_err(|source| LedgerError::KafkaClient { client: "replay consumer", source })?;
    consumer
        .subscribe(&[topic])
        .map_err(|source| LedgerError::Kafka { what: format!("cannot subscribe to {topic}"), source })?;
    Ok(consumer)
}

fn partition_count(consumer: &StreamConsumer<TokenContext>, topic: &str) -> Result<usize, LedgerError> {
    let what = || format!("cannot read the metadata of {topic}");
    let metadata = consumer
        .fetch_metadata(Some(topic), Duration::from_secs(30))
        .map_err(|source| LedgerError::Kafka { what: what(), source })?;
    let partitions = metadata.topics().iter().find(|t| t.name() == topic).map_or(0, |t| t.partitions().len());
    if partitions == 0 {
        let source = KafkaError::MetadataFetch(rdkafka::types::RDKafkaErrorCode::UnknownTopicOrPartition);
        return Err(LedgerError::Kafka { what: format!("dead-letter topic {topic} does not exist"), source });
    }
    Ok(partitions)
}

/// Each partition's end offset (high watermark) now: where this replay stops.
fn end_offsets(
    consumer: &StreamConsumer<TokenContext>,
    topic: &str,
    partitions: usize,
) -> Result<HashMap<i32, i64>, LedgerError> {
    let mut ends = HashMap::new();
    for partition in 0..i32::try_from(partitions).unwrap_or(i32::MAX) {
        let (_, high) =
            consumer.fetch_watermarks(topic, partition, Duration::from_secs(30)).map_err(|source| {
                LedgerError::Kafka {
                    what: format!("cannot read the end offset of {topic}[{partition}]"),
                    source,
                }
            })?;
        ends.insert(partition, high);
    }
    Ok(ends)
}

/// Sends one dead letter back into `topic` (`consumer.topic`); `false` when it is skipped
/// ([`replay_refusal`]).
async fn replay_one(sender: &DeadLetters, topic: &str, dead_letter: &Inbound) -> Result<bool, LedgerError> {
    if let Some(refusal) = replay_refusal(dead_letter, topic) {
        tracing::warn!(
            event_id = %dead_letter.event_id(),
            from = %dead_letter.position(),
            "dead letter not replayed: {refusal}"
        );
        return Ok(false);
    }
    sender.produce(topic, dead_letter, replay_headers(dead_letter)).await.map_err(|source| {
        LedgerError::Kafka { what: format!("cannot replay {} to {topic}", dead_letter.position()), source }
    })?;
    tracing::info!(
        event_id = %dead_letter.event_id(),
        from = %dead_letter.position(),
        to = %topic,
        reason = last_header(dead_letter, DLQ_REASON).unwrap_or_default(),
        "dead letter replayed"
    );
    Ok(true)
}

/// Commits `record`'s offset + 1 and waits for the broker's answer.
fn commit_sync(consumer: &StreamConsumer<TokenContext>, record: &Inbound) -> Result<(), LedgerError> {
    let mut offsets = TopicPartitionList::new();
    offsets
        .add_partition_offset(&record.topic, record.partition, Offset::Offset(record.offset + 1))
        .map_err(|source| LedgerError::Kafka { what: "cannot build the offset list".into(), source })?;
    tokio::task::block_in_place(|| consumer.commit(&offsets, CommitMode::Sync)).map_err(|source| {
        LedgerError::Kafka { what: format!("cannot commit the replay of {}", record.position()), source }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record() -> Inbound {
        Inbound {
            topic: "outbox.event.order".into(),
            partition: 3,
            offset: 41,
            key: Some(b"9".to_vec()),
            payload: Some(b"{}".to_vec()),
            headers: vec![
                ("id".into(), Some(b"17".to_vec())),
                ("traceparent".into(), Some(b"00-t-s-01".to_vec())),
                ("empty".into(), None),
            ],
        }
    }

    fn text(headers: &HeaderList, name: &str) -> Option<String> {
        headers
            .iter()
            .find(|(k, _)| k == name)
            .and_then(|(_, v)| v.as_ref())
            .map(|v| String::from_utf8_lossy(v).into_owned())
    }

    #[test]
    fn a_dead_letter_keeps_every_header_and_says_where_it_came_from() {
        let headers = dead_letter_headers(&record(), "field payment_id: missing", 1);
        assert_eq!(&headers[..3], &record().headers[..]);
        assert_eq!(text(&headers, DLQ_REASON).as_deref(), Some("field payment_id: missing"));
        assert_eq!(text(&headers, DLQ_ATTEMPTS).as_deref(), Some("1"));
        assert_eq!(text(&headers, DLQ_TOPIC).as_deref(), Some("outbox.event.order"));
        assert_eq!(text(&headers, DLQ_PARTITION).as_deref(), Some("3"));
        assert_eq!(text(&headers, DLQ_OFFSET).as_deref(), Some("41"));
    }

    #[test]
    fn a_replay_drops_exactly_the_dead_letter_headers() {
        let mut dead_letter = record();
        dead_letter.headers = dead_letter_headers(&record(), "lock timeout after 3 attempts", 3);
        assert_eq!(replay_headers(&dead_letter), record().headers);
    }

    fn with_header(mut record: Inbound, name: &str, value: &str) -> Inbound {
        record.headers.push((name.into(), Some(value.as_bytes().to_vec())));
        record
    }

    #[test]
    fn a_records_own_dlq_headers_are_dropped_wherever_they_are() {
        // given a record that came with dlq_* headers of its own
        let forged = with_header(with_header(record(), DLQ_TOPIC, "payments"), "dlq_other", "x");
        let forged = with_header(forged, DLQ_TOPIC, "audit");

        // then its dead letter holds the ledger's once, and its replay none
        let mut dead_letter = forged.clone();
        dead_letter.headers = dead_letter_headers(&forged, "not JSON", 1);
        let topics: Vec<_> = dead_letter.headers.iter().filter(|(k, _)| k == DLQ_TOPIC).collect();
        assert_eq!(topics.len(), 1, "{:?}", dead_letter.headers);
        assert_eq!(text(&dead_letter.headers, DLQ_TOPIC).as_deref(), Some("outbox.event.order"));
        assert_eq!(replay_headers(&dead_letter), record().headers);
        assert_eq!(replay_headers(&forged), record().headers);
    }

    #[test]
    fn a_replay_goes_only_into_the_consumers_topic() {
        let mut dead_letter = record();
        dead_letter.headers = dead_letter_headers(&record(), "not JSON", 1);
        assert_eq!(replay_refusal(&dead_letter, "outbox.event.order"), None);
        // a dead letter of another topic is refused, naming both
        let refusal = replay_refusal(&dead_letter, "outbox.event.payment").unwrap();
        assert!(
            refusal.contains("\"outbox.event.order\"") && refusal.contains("consumer.topic"),
            "{refusal}"
        );
        // the ledger's own dlq_topic (the last) decides, not one the record brought first
        let forged = with_header(record(), DLQ_TOPIC, "payments");
        let mut dead_letter = forged.clone();
        dead_letter.headers = forged.headers.clone();
        dead_letter.headers.extend(dead_letter_headers(&record(), "not JSON", 1).split_off(3));
        assert_eq!(replay_refusal(&dead_letter, "outbox.event.order"), None);
        // one without a dlq_topic goes to the consumer's topic
        assert_eq!(replay_refusal(&record(), "outbox.event.order"), None);
    }
}
