//! What the brokers' metadata says: the preflight's view of the cluster (brokers, topics), and,
//! when Kafka stops acknowledging, why it might (partitions without a leader, or with fewer
//! replicas in sync than assigned: below `min.insync.replicas` an `acks=all` write is refused
//! with NotEnoughReplicas, which librdkafka retries without a word).
//!
//! Each function here is one blocking metadata request from a client of its own: run it off the
//! runtime's threads.

use std::collections::BTreeSet;
use std::time::Duration;

use rdkafka::ClientContext;
use rdkafka::config::RDKafkaLogLevel;
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::metadata::Metadata;

use super::client::{client_config, log_librdkafka};
use crate::config::KafkaConfig;

/// Partitions named in a stall's diagnosis, at most (the rest are counted).
const NAMED_PARTITIONS: usize = 3;

/// Broker metadata, as the preflight reports it.
#[derive(Debug)]
pub(crate) struct ClusterInfo {
    pub(crate) brokers: usize,
    /// The names of the topics the brokers know.
    pub(crate) topics: BTreeSet<String>,
}

/// The first error librdkafka reported through its error callback that says more than a
/// failed metadata request does: a refused SASL login or TLS handshake surfaces there, while
/// the request itself fails only with a transport error.
#[derive(Default)]
struct FirstError(std::sync::Mutex<Option<String>>);

impl ClientContext for FirstError {
    const ENABLE_REFRESH_OAUTH_TOKEN: bool = true;

    fn generate_oauth_token(
        &self,
        config: Option<&str>,
    ) -> Result<rdkafka::client::OAuthToken, Box<dyn std::error::Error>> {
        super::oauth_token(config)
    }

    fn log(&self, level: RDKafkaLogLevel, fac: &str, message: &str) {
        log_librdkafka(level, fac, message);
    }

    fn error(&self, error: KafkaError, reason: &str) {
        if let Some(
            RDKafkaErrorCode::Authentication
            | RDKafkaErrorCode::SaslAuthenticationFailed
            | RDKafkaErrorCode::SSL,
        ) = error.rdkafka_error_code()
        {
            self.0.lock().unwrap().get_or_insert_with(|| reason.to_string());
        }
    }
}

impl ConsumerContext for FirstError {}

/// The metadata of `topic` (every topic when `None`). A refused login or handshake is named in
/// the error (e.g. "SASL authentication error: Authentication failed during authentication due
/// to invalid credentials with SASL mechanism SCRAM-SHA-512"), not only the transport failure
/// it causes.
fn fetch_metadata(kafka: &KafkaConfig, topic: Option<&str>, timeout: Duration) -> Result<Metadata, String> {
    let client: BaseConsumer<FirstError> = client_config(kafka)
        .create_with_context(FirstError::default())
        .map_err(|e| format!("cannot create a Kafka client: {e}"))?;
    super::serve_token_request(&client);
    client.fetch_metadata(topic, timeout).map_err(|e| {
        // the error callback runs when the client's queue is served
        for _ in 0..10 {
            if client.poll(Duration::from_millis(20)).is_none() {
                break;
            }
        }
        match client.context().0.lock().unwrap().take() {
            Some(reason) => format!("{e}: {reason}"),
            None => e.to_string(),
        }
    })
}

/// Fetches cluster metadata through the bootstrap brokers.
pub(crate) fn fetch_cluster_info(kafka: &KafkaConfig, timeout: Duration) -> Result<ClusterInfo, String> {
    let metadata = fetch_metadata(kafka, None, timeout)?;
    let topics =
        metadata.topics().iter().filter(|t| t.error().is_none()).map(|t| t.name().to_string()).collect();
    Ok(ClusterInfo { brokers: metadata.brokers().len(), topics })
}

/// Why records may wait unacknowledged, from the brokers' metadata of the cluster's topics
/// (Kafka's own, `__*`, left out): `None` when every partition has a leader and all its replicas
/// in sync, or when the metadata cannot be fetched (the stall itself is reported either way).
pub(crate) fn unhealthy_partitions(kafka: &KafkaConfig, timeout: Duration) -> Option<String> {
    let metadata = fetch_metadata(kafka, None, timeout).ok()?;
    let mut problems = Vec::new();
    for topic in metadata.topics().iter().filter(|t| !t.name().starts_with("__")) {
        for partition in topic.partitions() {
            let (in_sync, assigned) = (partition.isr().len(), partition.replicas().len());
            if partition.leader() < 0 {
                problems.push(format!(
                    "topic \"{}\" partition {} has no leader",
                    topic.name(),
                    partition.id()
                ));
            } else if in_sync < assigned {
                problems.push(format!(
                    "topic \"{}\" partition {} has {in_sync} of {assigned} replicas in sync",
                    topic.name(),
                    partition.id()
                ));
            }
        }
    }
    if problems.is_empty() {
        return None;
    }
    let more = problems.len().saturating_sub(NAMED_PARTITIONS);
    problems.truncate(NAMED_PARTITIONS);
    let mut text = format!("the brokers report {}", problems.join(", "));
    if more > 0 {
        text.push_str(&format!(" (and {more} more)"));
    }
    text.push_str(
        "; an acks=all write to a partition with fewer in-sync replicas than its min.insync.replicas \
         is refused (NotEnoughReplicas) and retried until enough brokers are back",
    );
    Some(text)
}
