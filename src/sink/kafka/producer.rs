//! The record producer: librdkafka's producer with the relay's context, whose delivery reports
//! arrive numbered on a channel, and the relay's own headers.
//!
//! Invariant: every record handed to a producer gets exactly one report on its channel: from
//! librdkafka's delivery callback, or (refused at once) from the sink's `enqueue`.

use std::sync::Arc;

use rdkafka::config::RDKafkaLogLevel;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::producer::{DeliveryResult, ProducerContext, ThreadedProducer};
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

pub(super) type RecordProducer = ThreadedProducer<Reporter>;

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
    Ok(Channel { producer: Arc::new(producer), reports, refusals })
}
