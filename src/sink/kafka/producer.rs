//! The record producer: librdkafka's producer with the relay's context, whose delivery reports
//! arrive numbered on a channel, and the relay's own headers.
//!
//! Invariant: every record handed to a producer gets exactly one report on its channel: from
//! librdkafka's delivery callback, or (refused at once) from the sink's `enqueue`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use rdkafka::config::RDKafkaLogLevel;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::producer::{BaseProducer, DeliveryResult, ProducerContext};
use rdkafka::{ClientContext, Message};
use tokio::sync::mpsc;

use super::client::{log_librdkafka, producer_config, transactional_producer_config};
use crate::config::KafkaConfig;
use crate::sink::{Report, SendFailure, Written};

/// The header naming the database and table a record came from (see [`super::KafkaSink::set_source`]).
pub(crate) const SOURCE_HEADER: &str = "outbox_relay_source";
/// The header saying where the source read the record ([`crate::record::Position`]).
pub(crate) const POSITION_HEADER: &str = "outbox_relay_position";
/// The header `outbox-relay replay-dead-letters` marks a replayed record with (the letter's id):
/// a replay comes after later events of its key and carries the letter's data as fixed, so
/// `verify` neither orders nor compares it.
pub(crate) const REPLAYED_HEADER: &str = "outbox_relay_replayed";
/// The header `outbox-relay republish` adds to a record it sends again as first written (when,
/// in Unix milliseconds): `verify` compares the copy without it.
pub(crate) const REPUBLISHED_HEADER: &str = "outbox_relay_republished";
/// The header of the one record the relay writes to a pinned partition in a transaction it
/// aborts at once (`transaction::unpin`): a `read_committed` reader never sees it, a
/// `read_uncommitted` one sees a record with this header, an empty value and key
/// [`UNPIN_HEADER`].
pub(crate) const UNPIN_HEADER: &str = "outbox_relay_unpin";

/// Delivery reports from librdkafka's callback (on the producer's polling thread) into a
/// channel, numbered by the record's delivery opaque: no future, oneshot or box per record.
pub(super) struct Reporter(mpsc::UnboundedSender<Report>);

/// librdkafka's log lines and global errors, at the relay's levels.
impl ClientContext for Reporter {
    const ENABLE_REFRESH_OAUTH_TOKEN: bool = true;

    fn generate_oauth_token(
        &self,
        config: Option<&str>,
    ) -> Result<rdkafka::client::OAuthToken, Box<dyn std::error::Error>> {
        super::client::oauth_token(config)
    }

    fn log(&self, level: RDKafkaLogLevel, fac: &str, message: &str) {
        log_librdkafka(level, fac, message);
    }

    fn error(&self, error: KafkaError, reason: &str) {
        let (level, what) = match error.rdkafka_error_code() {
            // a broker connection that dropped (idle, restarted, a leader moved): librdkafka
            // reconnects by itself, and the stall watch says when Kafka stops acknowledging
            Some(RDKafkaErrorCode::BrokerTransportFailure) => {
                (tracing::Level::INFO, "Kafka connection lost; reconnecting")
            }
            Some(RDKafkaErrorCode::AllBrokersDown) => {
                (tracing::Level::WARN, "no Kafka broker reachable; reconnecting")
            }
            _ => (tracing::Level::ERROR, "Kafka producer error"),
        };
        super::client::log_client_error(level, &error, reason, what);
    }
}

impl ProducerContext for Reporter {
    type DeliveryOpaque = usize;

    fn delivery(&self, result: &DeliveryResult<'_>, seq: usize) {
        let outcome = match result {
            Ok(message) => Ok(Written { partition: message.partition(), offset: message.offset() }),
            Err((e, _)) => Err(SendFailure::kafka(e.clone())),
        };
        // closed: the sink replaced this producer, and nobody waits for its reports any more
        let _ = self.0.send(Report { seq, outcome });
    }
}

/// How long the reports thread waits in one poll when nothing arrives: a report, a log line,
/// an error or a token refresh ends the wait at once, so this bounds only how long the thread
/// outlives its producer. (Each poll also spins through its last fraction of a millisecond:
/// rdkafka 0.39 rounds the remaining wait down to whole milliseconds, and polls without
/// waiting once under one. `ThreadedProducer`'s 100 ms polls spent about 8 ms of CPU a second
/// on that while idle; one poll a second spends under 1 ms.)
const POLL_WAIT: Duration = Duration::from_secs(1);

/// librdkafka's producer, with a thread of its own serving the producer's queue (delivery
/// reports into [`Reporter`], logs, errors, OAuth token refreshes). Dropped, it tells the
/// thread to stop and does not wait: the thread ends within [`POLL_WAIT`] and destroys the
/// producer (whatever is still queued is purged; the sink flushed what it needed before).
pub(super) struct RecordProducer {
    producer: Arc<BaseProducer<Reporter>>,
    stop: Arc<AtomicBool>,
}

impl RecordProducer {
    fn start(producer: BaseProducer<Reporter>) -> std::io::Result<RecordProducer> {
        let producer = Arc::new(producer);
        let stop = Arc::new(AtomicBool::new(false));
        let (serving, stopped) = (producer.clone(), stop.clone());
        std::thread::Builder::new().name("kafka reports".into()).spawn(move || {
            while !stopped.load(Ordering::Relaxed) {
                serving.poll(POLL_WAIT);
            }
        })?;
        Ok(RecordProducer { producer, stop })
    }
}

impl std::ops::Deref for RecordProducer {
    type Target = BaseProducer<Reporter>;

    fn deref(&self) -> &BaseProducer<Reporter> {
        &self.producer
    }
}

impl Drop for RecordProducer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// A producer, and the channel its reports arrive on (with a sender for refusals at enqueue).
pub(super) struct Channel {
    pub(super) producer: Arc<RecordProducer>,
    pub(super) reports: mpsc::UnboundedReceiver<Report>,
    pub(super) refusals: mpsc::UnboundedSender<Report>,
}

/// A producer for `config`, transactional under `transactional_id` when given.
pub(super) fn create_producer(
    config: &KafkaConfig,
    transactional_id: Option<&str>,
) -> Result<Channel, KafkaError> {
    let (refusals, reports) = mpsc::unbounded_channel();
    let settings = match transactional_id {
        Some(id) => transactional_producer_config(config, id),
        None => producer_config(config),
    };
    let producer = settings.create_with_context(Reporter(refusals.clone()))?;
    let producer = RecordProducer::start(producer).map_err(|e| {
        KafkaError::ClientCreation(format!("cannot start the producer's reports thread: {e}"))
    })?;
    Ok(Channel { producer: Arc::new(producer), reports, refusals })
}
