//! What a failed delivery report means, decided where it happens (the Kafka sink's `classify`):
//! permanent (the record can never be accepted: it is poison) or transient (send it again),
//! with the `error_type` label of `outbox_relay_publish_errors_total`.

use rdkafka::error::RDKafkaErrorCode;
use rdkafka::producer::Producer;
use rdkafka::types::RDKafkaRespErr;

use super::METADATA_TIMEOUT;
use super::producer::RecordProducer;
use crate::observe::metrics::ErrorType;

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

/// Whether the broker's metadata says `topic` does not exist (a blocking request; a failed
/// request says nothing).
pub(super) fn topic_is_unknown(producer: &RecordProducer, topic: &str) -> bool {
    producer.client().fetch_metadata(Some(topic), METADATA_TIMEOUT).is_ok_and(|md| {
        md.topics().iter().any(|t| {
            t.name() == topic && t.error() == Some(RDKafkaRespErr::RD_KAFKA_RESP_ERR_UNKNOWN_TOPIC_OR_PART)
        })
    })
}

/// A low-cardinality label for metrics and logs.
pub(super) fn error_type(code: Option<RDKafkaErrorCode>) -> ErrorType {
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
