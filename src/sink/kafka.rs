//! The Kafka producer: `acks=all` and the idempotent producer, always.
//!
//! Settings the delivery guarantee depends on are set here last, after the user's pass-through
//! properties, and `config::RelayConfig::validate` refuses user overrides of them.

use std::time::Duration;

use rdkafka::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};

use crate::config::KafkaConfig;

/// The librdkafka client configuration for a producer built from `kafka`.
pub fn producer_config(kafka: &KafkaConfig) -> ClientConfig {
    let mut cc = ClientConfig::new();
    for (key, value) in &kafka.properties {
        cc.set(key, &value.0);
    }
    cc.set("bootstrap.servers", kafka.brokers.join(","))
        .set("client.id", &kafka.client_id)
        .set("message.timeout.ms", kafka.message_timeout_ms.to_string())
        .set("linger.ms", kafka.linger_ms.to_string())
        .set("compression.codec", &kafka.compression)
        .set("acks", "all")
        .set("enable.idempotence", "true");
    cc
}

/// Broker metadata, as the preflight reports it.
#[derive(Debug)]
pub struct ClusterInfo {
    pub brokers: usize,
    pub topics: usize,
}

/// Fetches cluster metadata through the bootstrap brokers; blocking, so run it off the runtime.
pub fn fetch_cluster_info(kafka: &KafkaConfig, timeout: Duration) -> Result<ClusterInfo, String> {
    let mut cc = ClientConfig::new();
    for (key, value) in &kafka.properties {
        cc.set(key, &value.0);
    }
    cc.set("bootstrap.servers", kafka.brokers.join(",")).set("client.id", &kafka.client_id);
    let consumer: BaseConsumer = cc.create().map_err(|e| format!("cannot create a Kafka client: {e}"))?;
    let metadata = consumer.fetch_metadata(None, timeout).map_err(|e| e.to_string())?;
    Ok(ClusterInfo { brokers: metadata.brokers().len(), topics: metadata.topics().len() })
}
