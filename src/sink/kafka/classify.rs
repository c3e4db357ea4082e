//! What a failed delivery report means, decided where it happens (the Kafka sink's `classify`):
//! permanent (the record can never be accepted: it is poison) or transient (send it again),
//! with the `error_type` label of `outbox_relay_publish_errors_total`.

use rdkafka::error::RDKafkaErrorCode;
use rdkafka::producer::Producer;
use rdkafka::types::RDKafkaRespErr;

use super::METADATA_TIMEOUT;
use super::producer::RecordProducer;
use crate::config::KafkaConfig;
use crate::observe::metrics::ErrorType;
use crate::record::KafkaRecord;
use rdkafka::error::KafkaError;

/// Whether the broker's metadata says `topic` does not exist (a blocking request; a failed
/// request says nothing).
pub(super) fn topic_is_unknown(producer: &RecordProducer, topic: &str) -> bool {
    producer.client().fetch_metadata(Some(topic), METADATA_TIMEOUT).is_ok_and(|md| {
        md.topics().iter().any(|t| {
            t.name() == topic && t.error() == Some(RDKafkaRespErr::RD_KAFKA_RESP_ERR_UNKNOWN_TOPIC_OR_PART)
        })
    })
}

/// librdkafka's default `message.max.bytes`, the producer's limit on a record.
const LIBRDKAFKA_MESSAGE_MAX_BYTES: &str = "1000000";

/// Why a record is too large, and the limits to raise: the producer's own (librdkafka refuses
/// the record before sending it), the topic's or the broker's (the broker refuses it), and the
/// consumers' fetch sizes, which must then take it too.
pub(crate) fn too_large(kafka: &KafkaConfig, record: &KafkaRecord, error: &KafkaError) -> String {
    let producer_limit = kafka.property("message.max.bytes").unwrap_or(LIBRDKAFKA_MESSAGE_MAX_BYTES);
    format!(
        "record of about {} bytes for topic \"{}\" is too large ({error}): raise the limit that refused it, \
         the producer's kafka.properties.\"message.max.bytes\" (now {producer_limit}), the topic's \
         max.message.bytes (kafka-configs --alter --entity-type topics --entity-name {} --add-config \
         max.message.bytes=...; the broker's message.max.bytes is its default), and the consumers' \
         max.partition.fetch.bytes; or make the event smaller",
        record.size(),
        record.topic,
        record.topic,
    )
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_too_large_names_each_limit_to_raise() {
        let kafka: KafkaConfig = serde_json::from_value(serde_json::json!({
            "brokers": ["127.0.0.1:9092"], "properties": { "message.max.bytes": "2000" }
        }))
        .unwrap();
        let record = crate::sink::scripted::record("7");
        let error = KafkaError::MessageProduction(RDKafkaErrorCode::MessageSizeTooLarge);
        let reason = too_large(&kafka, &record, &error);
        for limit in ["\"message.max.bytes\" (now 2000)", "max.message.bytes", "max.partition.fetch.bytes"] {
            assert!(reason.contains(limit), "{limit}: {reason}");
        }
        let size = format!("record of about {} bytes for topic \"t\"", record.size());
        assert!(reason.contains(&size), "{reason}");
    }
}
