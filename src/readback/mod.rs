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
//! - the key of a streamed event is its position (commit LSN, place in the transaction), id and
//!   content (record key, payload, event type); a copied or polled row's key is its id and
//!   content: the same event read again has the same key, and an id used again for another event
//!   (a sequence that restarted: a restore, `RESTART IDENTITY`, a promoted standby that had not
//!   received the sequence's last advance) has another;
//! - the read-back happens before anything of the session is sent to the topic, after the
//!   producer of a failed session is destroyed (see `KafkaSink::retired`);
//! - it reads each partition backwards from its end until a record older than anything the
//!   source can replay, the start of the partition, or `dedup.max_scan_records` ([`scan`]);
//! - with Kafka transactions, a partition held below its end by an open transaction is not
//!   read at all: the session ends, and the sink unpins it before the next one ([`Pinned`]).

use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasher, RandomState};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use rdkafka::ClientConfig;
use rdkafka::ClientContext;
use rdkafka::config::RDKafkaLogLevel;
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use tokio::sync::watch;

use crate::config::{KafkaConfig, OutboxConfig, RelayConfig};
use crate::error::{FatalReason, RelayError};
use crate::lsn::Lsn;
use crate::observe::metrics::{Mode, metrics};
use crate::observe::pulse::Pulse;
use crate::record::format::{Format, Identity};
use crate::record::{KafkaRecord, Position};
use crate::sink::Pinned;
use crate::sink::kafka::StallWatch;

mod scan;

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

/// What an event's key is made of besides its position: the same on both sides (the event about
/// to be sent, the record read back).
struct Content<'a> {
    /// The outbox's place: its `outbox_relay_source` on the record read back.
    outbox: usize,
    id: &'a str,
    key: &'a [u8],
    payload: &'a [u8],
    event_type: &'a str,
}

impl<'a> Content<'a> {
    /// An event about to be sent: its identity as its record carries it (`KafkaRecord::written_*`).
    fn of(event: &'a KafkaRecord) -> Content<'a> {
        Content {
            outbox: event.outbox.index(),
            id: &event.id,
            key: event.key.as_bytes(),
            payload: event.written_payload(),
            event_type: event.written_type(),
        }
    }

    /// A record read back, of outbox `outbox`.
    fn read(outbox: usize, identity: &'a Identity<'_>, key: &'a [u8]) -> Content<'a> {
        Content {
            outbox,
            id: &identity.id,
            key,
            payload: &identity.payload,
            event_type: &identity.event_type,
        }
    }
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

    /// The key of an event read at `position`, as both sides compute it.
    fn key(&self, position: &Position, content: &Content<'_>) -> u128 {
        match position {
            Position::Stream { commit, index } => {
                let Content { outbox, id, key, payload, event_type } = content;
                self.of((0u8, outbox, commit.0, *index, id, key, payload, event_type))
            }
            Position::Copy { .. } | Position::Batch { .. } => self.id_key(content),
        }
    }

    /// The key of a row wherever it was read: its id and content.
    fn id_key(&self, content: &Content<'_>) -> u128 {
        let Content { outbox, id, key, payload, event_type } = content;
        self.of((1u8, outbox, id, key, payload, event_type))
    }
}

/// Who wrote a record: the cluster (its system identifier, kept by physical standbys, so a
/// promoted one is the same source), the database and the outbox table.
const SOURCE_SQL: &str = "SELECT system_identifier::text, current_database()::text FROM pg_control_system()";

/// The `outbox_relay_source` of the records of a relay's outboxes (by place):
/// `<system identifier>/<database>/<schema>.<table>`.
pub(crate) async fn source_identities(
    client: &tokio_postgres::Client,
    config: &RelayConfig,
) -> Result<Vec<String>, RelayError> {
    let (system, database) = source_database(client).await?;
    let identity = |o: &crate::config::OutboxEntry| identity(&system, &database, &o.config);
    Ok(config.outboxes().iter().map(identity).collect())
}

/// The `outbox_relay_source` of the records of `outbox`.
pub(crate) async fn source_identity(
    client: &tokio_postgres::Client,
    outbox: &OutboxConfig,
) -> Result<String, RelayError> {
    let (system, database) = source_database(client).await?;
    Ok(identity(&system, &database, outbox))
}

/// The cluster's system identifier and the database's name.
async fn source_database(client: &tokio_postgres::Client) -> Result<(String, String), RelayError> {
    let row = client.query_one(SOURCE_SQL, &[]).await?;
    Ok((row.get(0), row.get(1)))
}

fn identity(system: &str, database: &str, outbox: &OutboxConfig) -> String {
    format!("{system}/{database}/{}.{}", outbox.schema, outbox.table)
}

/// One session's skip rule.
pub(crate) struct Dedup {
    enabled: bool,
    lookback: Lookback,
    mode: Mode,
    client: ClientConfig,
    kafka: KafkaConfig,
    max_records: u64,
    timeout: Duration,
    fingerprint: Fingerprint,
    /// `outbox_relay_source` of the records of each outbox (by place).
    sources: Arc<[Arc<str>]>,
    /// The record format of each outbox (by place).
    formats: Arc<[Format]>,
    /// Per topic read back in this session: the keys still expected again.
    topics: HashMap<String, HashSet<u128>>,
    consumer: Option<Arc<BaseConsumer<ReadBackContext>>>,
    /// With Kafka transactions, the `read_uncommitted` client that tells where partitions end.
    ends: Option<Arc<BaseConsumer<ReadBackContext>>>,
    /// Where a pinned read-back leaves its partitions for the sink's next activation.
    pinned: Pinned,
    /// A read-back gives up when the relay shuts down.
    shutdown: watch::Receiver<bool>,
}

/// The read-back client's context: reaching a partition's end is how a read-back ends, not an
/// error to log (librdkafka reports it as a global error too).
#[derive(Default)]
struct ReadBackContext {
    /// The brokers refused the relay's login (SASL): nothing the relay can retry its way out of.
    /// librdkafka reports it as an error and a log line, both when the client's queue is served
    /// (the scan serves it while a metadata request fails).
    refused_login: Arc<std::sync::Mutex<Option<String>>>,
}

impl ClientContext for ReadBackContext {
    const ENABLE_REFRESH_OAUTH_TOKEN: bool = true;

    fn generate_oauth_token(
        &self,
        config: Option<&str>,
    ) -> Result<rdkafka::client::OAuthToken, Box<dyn std::error::Error>> {
        crate::sink::kafka::oauth_token(config)
    }

    fn log(&self, level: RDKafkaLogLevel, fac: &str, message: &str) {
        if fac == "FAIL" && message.contains("SASL authentication error") {
            self.refused_login.lock().unwrap().get_or_insert_with(|| message.to_string());
        }
        crate::sink::kafka::log_librdkafka(level, fac, message);
    }

    fn error(&self, error: KafkaError, reason: &str) {
        if let Some(RDKafkaErrorCode::Authentication | RDKafkaErrorCode::SaslAuthenticationFailed) =
            error.rdkafka_error_code()
        {
            self.refused_login.lock().unwrap().get_or_insert_with(|| reason.to_string());
        }
        if !matches!(error, KafkaError::Global(RDKafkaErrorCode::PartitionEOF)) {
            crate::sink::kafka::log_client_error(tracing::Level::WARN, &error, reason, "reading topics back");
        }
    }
}

impl ConsumerContext for ReadBackContext {}

impl Dedup {
    /// The rule for a session of `mode` replaying from `lookback`; `sources` is empty when the
    /// records carry no source header (nothing can be recognised, so nothing is skipped);
    /// `pinned`: the sink's (see [`Pinned`]).
    pub(crate) fn new(
        config: &RelayConfig,
        (mode, lookback): (Mode, Lookback),
        (sources, pinned): (&[Arc<str>], Pinned),
        shutdown: &watch::Receiver<bool>,
    ) -> Dedup {
        Dedup {
            enabled: config.dedup.enabled && !sources.is_empty(),
            lookback,
            mode,
            client: reader_config(config),
            kafka: config.kafka.clone(),
            max_records: config.dedup.max_scan_records,
            timeout: Duration::from_millis(config.dedup.scan_timeout_ms),
            fingerprint: Fingerprint(RandomState::new(), RandomState::new()),
            sources: sources.into(),
            formats: config.outboxes().iter().map(|o| Format::of(&o.config)).collect(),
            topics: HashMap::new(),
            consumer: None,
            ends: None,
            pinned,
            shutdown: shutdown.clone(),
        }
    }

    /// The topics of `events` this session has not read back yet (none when off).
    pub(crate) fn unread<'e>(&self, events: impl IntoIterator<Item = &'e KafkaRecord>) -> Vec<&'e str> {
        let mut unread: Vec<&str> = Vec::new();
        for event in events.into_iter().filter(|e| self.enabled && e.position.is_some()) {
            if !self.topics.contains_key(&event.topic) && !unread.contains(&event.topic.as_str()) {
                unread.push(&event.topic);
            }
        }
        unread
    }

    /// True when Kafka already holds `event` from an earlier session: settle it without sending.
    /// The first call for a topic reads the topic back (an error ends the session: nothing is
    /// sent to a topic the relay could not read).
    pub(crate) async fn written(&mut self, event: &KafkaRecord, pulse: &Pulse) -> Result<bool, RelayError> {
        let Some(position) = (self.enabled).then_some(event.position).flatten() else { return Ok(false) };
        if !self.topics.contains_key(&event.topic) {
            self.read_back(&event.topic, pulse).await?;
        }
        // (one lookup per event in the common case: a topic read back whose replay is past)
        let Some(keys) = self.topics.get_mut(&event.topic).filter(|k| !k.is_empty()) else {
            return Ok(false);
        };
        if !keys.remove(&self.fingerprint.key(&position, &Content::of(event))) {
            return Ok(false);
        }
        metrics().dedup_skipped.with_label_values(&[self.mode.label()]).inc();
        tracing::debug!(event_id = %event.id, %position, topic = %event.topic, "already in Kafka: not sent again");
        Ok(true)
    }

    /// Reads `topic` back (off the runtime: the client blocks) and keeps its keys. Kafka not
    /// answering is a stall like any other (see [`StallWatch`]); shutdown ends it.
    pub(crate) async fn read_back(&mut self, topic: &str, pulse: &Pulse) -> Result<(), RelayError> {
        let (consumer, ends) = (self.consumer()?, self.ends()?);
        let cancelled = Arc::new(AtomicBool::new(false));
        let _cancel = CancelOnDrop(cancelled.clone());
        let scan = scan::Scan {
            cancelled,
            refused_login: consumer.context().refused_login.clone(),
            topic: topic.to_string(),
            sources: self.sources.clone(),
            formats: self.formats.clone(),
            lookback: self.lookback,
            fingerprint: self.fingerprint.clone(),
            max_records: self.max_records,
            deadline: Instant::now() + self.timeout,
        };
        let started = Instant::now();
        let reader = consumer.clone();
        let mut reading = tokio::task::spawn_blocking(move || scan.run(&reader, ends.as_deref()));
        let mut stall = StallWatch::new(&self.kafka);
        let mut check = tokio::time::interval(stall.period());
        let read = loop {
            if *self.shutdown.borrow() {
                return Err(RelayError::Interrupted);
            }
            tokio::select! {
                read = &mut reading => break read,
                _ = check.tick() => stall.check(1, pulse),
                // a closed channel (the sender gone) ends the read like a shutdown, rather than
                // waking this loop at once on every turn
                changed = self.shutdown.changed() => {
                    if changed.is_err() {
                        return Err(RelayError::Interrupted);
                    }
                }
            }
        };
        let read = read.map_err(|e| {
            RelayError::Kafka(format!("reading topic \"{topic}\" back stopped: {e}; retrying"))
        })?;
        if read.is_err()
            && let Some(reason) = consumer.context().refused_login.lock().unwrap().take()
        {
            return Err(RelayError::fatal(
                FatalReason::Auth,
                format!(
                    "Kafka refused the login of {} ({reason}): check kafka.properties.\"sasl.username\", \
                     \"sasl.mechanisms\" and the password (OUTBOX_RELAY_KAFKA_SASL_PASSWORD or \
                     kafka.secret_properties_file)",
                    self.kafka.principal()
                ),
            ));
        }
        let outcome = read.map_err(|e| read_back_error(&self.kafka, topic, e))?;
        stall.progressed(Instant::now(), pulse);
        outcome.report(topic, self.lookback, started.elapsed());
        if !outcome.pinned.is_empty() {
            self.pinned.add(topic, outcome.pinned.iter().map(|p| p.partition));
            return Err(pinned_error(&self.kafka, topic, &outcome.pinned));
        }
        self.topics.insert(topic.to_string(), outcome.keys);
        Ok(())
    }

    /// The read-back client, made at the first read-back of the session.
    fn consumer(&mut self) -> Result<Arc<BaseConsumer<ReadBackContext>>, RelayError> {
        if let Some(consumer) = &self.consumer {
            return Ok(consumer.clone());
        }
        let consumer = self.create(&self.client)?;
        Ok(self.consumer.insert(consumer).clone())
    }

    /// With Kafka transactions, the client that reads partitions' ends `read_uncommitted`,
    /// made at the first read-back of the session.
    fn ends(&mut self) -> Result<Option<Arc<BaseConsumer<ReadBackContext>>>, RelayError> {
        if !self.kafka.transactional || self.ends.is_some() {
            return Ok(self.ends.clone());
        }
        let mut client = self.client.clone();
        client.set("isolation.level", "read_uncommitted");
        let ends = self.create(&client)?;
        Ok(Some(self.ends.insert(ends).clone()))
    }

    fn create(&self, client: &ClientConfig) -> Result<Arc<BaseConsumer<ReadBackContext>>, RelayError> {
        let consumer: BaseConsumer<ReadBackContext> =
            client.create_with_context(ReadBackContext::default()).map_err(|e| {
                RelayError::fatal(
                    FatalReason::Config,
                    format!("cannot create the Kafka client that reads topics back (check kafka.*): {e}"),
                )
            })?;
        crate::sink::kafka::serve_token_request(&consumer);
        Ok(Arc::new(consumer))
    }
}

impl Drop for Dedup {
    /// Destroying a librdkafka client waits for its threads: not on a runtime thread.
    fn drop(&mut self) {
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            for consumer in [self.consumer.take(), self.ends.take()].into_iter().flatten() {
                runtime.spawn_blocking(move || drop(consumer));
            }
        }
    }
}

/// A read-back that failed: refused reads are an operator's to fix, the rest is retried.
fn read_back_error(kafka: &KafkaConfig, topic: &str, error: KafkaError) -> RelayError {
    let refused = match error.rdkafka_error_code() {
        Some(RDKafkaErrorCode::TopicAuthorizationFailed | RDKafkaErrorCode::ClusterAuthorizationFailed) => {
            Some(format!("to read topic \"{topic}\""))
        }
        Some(RDKafkaErrorCode::GroupAuthorizationFailed) => {
            Some(format!("to find the coordinator of group \"{}-read-back\"", kafka.client_id))
        }
        _ => None,
    };
    if let Some(what) = refused {
        return RelayError::fatal(
            FatalReason::Privilege,
            format!(
                "Kafka refuses {} {what} ({error}): with dedup.enabled the relay reads its topics back after \
                 every restart; grant it READ and DESCRIBE on its topics and DESCRIBE on group \
                 \"{}-read-back\", or set dedup.enabled = false (at-least-once)",
                kafka.principal(),
                kafka.client_id
            ),
        );
    }
    RelayError::Kafka(format!(
        "cannot read topic \"{topic}\" back to skip what it already holds (nothing is sent to it until it can be \
         read; each try takes at most dedup.scan_timeout_ms): {error}"
    ))
}

/// A read-back that found partitions held open below their end: the session ends, and the
/// next one unpins them first (see [`Pinned`]); what to do when it is not the relay's own.
fn pinned_error(kafka: &KafkaConfig, topic: &str, pinned: &[scan::PinnedAt]) -> RelayError {
    let partitions: Vec<String> = pinned
        .iter()
        .map(|p| format!("{} (last stable offset {}, end {})", p.partition, p.stable, p.end))
        .collect();
    let first = &pinned[0];
    RelayError::Kafka(format!(
        "an open Kafka transaction holds topic \"{topic}\" partition {} below its end, so the relay cannot read \
         back what the topic holds: nothing is sent to it; the next session aborts a transaction of the relay's \
         own there first (ending whatever an earlier instance of its transactional.id left open) and reads again. \
         If another producer's transaction holds it, it waits for that one to end; one that never ends (a hanging \
         transaction) is found and aborted with kafka-transactions.sh --bootstrap-server {} find-hanging \
         --broker-id <leader>, then abort --topic {topic} --partition {} --start-offset {}",
        partitions.join(", "),
        kafka.brokers.join(","),
        first.partition,
        first.stable
    ))
}

/// Sets its flag when dropped.
struct CancelOnDrop(Arc<AtomicBool>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// The read-back client's settings (see [`crate::sink::kafka::reader_config`]).
fn reader_config(config: &RelayConfig) -> ClientConfig {
    crate::sink::kafka::reader_config(&config.kafka, "read-back", 50)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn content<'a>(id: &'a str, payload: &'a str) -> Content<'a> {
        Content { outbox: 0, id, key: b"order-1", payload: payload.as_bytes(), event_type: "Placed" }
    }

    #[test]
    fn both_sides_compute_one_key_per_event() {
        let fp = Fingerprint(RandomState::new(), RandomState::new());
        let streamed = Position::Stream { commit: Lsn(100), index: 2 };
        let seven = content("7", "{}");
        assert_eq!(fp.key(&streamed, &seven), fp.key(&streamed, &content("7", "{}")));
        assert_ne!(
            fp.key(&streamed, &seven),
            fp.key(&Position::Stream { commit: Lsn(100), index: 3 }, &seven)
        );
        assert_ne!(
            fp.key(&streamed, &seven),
            fp.key(&streamed, &content("8", "{}")),
            "an emitted message may reuse a position's id"
        );
        // a copied or polled row is known by its id and content wherever it was read
        let copied = Position::Copy { point: Lsn(5), index: 9 };
        let polled = Position::Batch { session: 1, batch: 2, index: 0 };
        assert_eq!(fp.key(&copied, &seven), fp.id_key(&seven));
        assert_eq!(fp.key(&polled, &seven), fp.id_key(&seven));
        assert_ne!(fp.key(&streamed, &seven), fp.id_key(&seven));
        // an id used again for another event (a restarted sequence) is another key
        assert_ne!(fp.id_key(&seven), fp.id_key(&content("7", "{\"other\": 1}")));
    }
}
