//! The librdkafka clients' settings (the relay's and the example services'), and librdkafka's
//! log lines at the relay's levels.
//!
//! Invariant: the settings the delivery guarantee depends on (`acks=all`, idempotence,
//! gapless) are set after the user's pass-through properties, and `RelayConfig::validate`
//! refuses user overrides of them.

use std::sync::atomic::{AtomicBool, Ordering};

use rdkafka::ClientConfig;
use rdkafka::ClientContext;
use rdkafka::client::OAuthToken;
use rdkafka::config::RDKafkaLogLevel;
use rdkafka::consumer::{BaseConsumer, ConsumerContext};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};

use crate::config::KafkaConfig;

/// The librdkafka settings every client built from `kafka` shares: the brokers, the client id,
/// and the pass-through and secret properties (TLS, SASL). The example services build their
/// consumers and producers on it.
pub fn client_config(kafka: &KafkaConfig) -> ClientConfig {
    let mut cc = ClientConfig::new();
    for (key, value) in kafka.client_properties() {
        cc.set(key, value);
    }
    // [kafka.auth]: OAUTHBEARER, with tokens from crate::credentials (see `oauth_token`)
    for (key, value) in crate::credentials::kafka_settings(kafka) {
        cc.set(key, value);
    }
    cc.set("bootstrap.servers", kafka.brokers.join(",")).set("client.id", &kafka.client_id);
    cc
}

/// The librdkafka settings of a client that reads topics without committing anything (the
/// read-back, `verify`): the user's (TLS, SASL), group `<client_id>-<purpose>` (librdkafka
/// assigns partitions only in a group, which is never joined, but it looks the group's
/// coordinator up: under an authorizer the principal needs DESCRIBE on that group, besides
/// READ and DESCRIBE on the topics), each partition's end reported, a
/// short fetch wait (every read ends at a partition's end), librdkafka's own log at errors only,
/// and `read_committed` (librdkafka's default, said here because the read-back depends on it):
/// with `kafka.transactional` a record of an aborted or still open transaction is not held by
/// the topic, and must be sent again.
pub(crate) fn reader_config(kafka: &KafkaConfig, purpose: &str, fetch_wait_ms: u32) -> ClientConfig {
    let mut cc = client_config(kafka);
    cc.set("group.id", format!("{}-{purpose}", kafka.client_id))
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("enable.partition.eof", "true")
        .set("auto.offset.reset", "earliest")
        .set("fetch.wait.max.ms", fetch_wait_ms.to_string())
        .set("isolation.level", "read_committed")
        .set("log_level", "3");
    cc
}

/// The context of a client that reads partitions to their end (`verify`): librdkafka's log at
/// the relay's levels, and a partition's end, which librdkafka also reports as a global error
/// (with `enable.partition.eof`), is how a read ends, not an error line. rdkafka's default
/// context logged three `ERROR ... PartitionEOF` lines for every successful `verify`.
pub(crate) struct ReaderContext;

impl ClientContext for ReaderContext {
    const ENABLE_REFRESH_OAUTH_TOKEN: bool = true;

    fn generate_oauth_token(&self, config: Option<&str>) -> Result<OAuthToken, Box<dyn std::error::Error>> {
        oauth_token(config)
    }

    fn log(&self, level: RDKafkaLogLevel, fac: &str, message: &str) {
        log_librdkafka(level, fac, message);
    }

    fn error(&self, error: KafkaError, reason: &str) {
        if !is_partition_end(&error) {
            log_client_error(tracing::Level::ERROR, &error, reason, "Kafka client error");
        }
    }
}

impl ConsumerContext for ReaderContext {}

/// Set once the process decided to stop (a signal, a fatal error): what librdkafka says after
/// that is about the clients being torn down (`Purged in flight`, a FATAL of a producer dropped
/// mid-transaction, connections to brokers that have since come back), not about the cause.
static STOPPING: AtomicBool = AtomicBool::new(false);

/// Marks the process as stopping: librdkafka's errors and warnings from now on are logged at
/// DEBUG ([`after_stop`]).
pub fn mark_stopping() {
    STOPPING.store(true, Ordering::Relaxed);
}

/// `level` once the process is `stopping`: errors and warnings become DEBUG, the rest stays.
fn after_stop(level: tracing::Level, stopping: bool) -> tracing::Level {
    match stopping && level <= tracing::Level::WARN {
        true => tracing::Level::DEBUG,
        false => level,
    }
}

/// Logs an error a librdkafka client reported through its error callback at `level` (DEBUG
/// once the process is stopping).
pub(crate) fn log_client_error(level: tracing::Level, error: &KafkaError, reason: &str, what: &str) {
    match after_stop(level, STOPPING.load(Ordering::Relaxed)) {
        tracing::Level::ERROR => tracing::error!(target: "librdkafka", %error, reason, "{what}"),
        tracing::Level::WARN => tracing::warn!(target: "librdkafka", %error, reason, "{what}"),
        tracing::Level::INFO => tracing::info!(target: "librdkafka", %error, reason, "{what}"),
        _ => tracing::debug!(target: "librdkafka", %error, reason, "{what}"),
    }
}

/// The token every `ClientContext` of the relay hands librdkafka for SASL OAUTHBEARER
/// (`[kafka.auth]`): each sets `ENABLE_REFRESH_OAUTH_TOKEN` and answers
/// `generate_oauth_token` with this, so every client gets its tokens from one place,
/// [`crate::credentials`].
pub fn oauth_token(config: Option<&str>) -> Result<OAuthToken, Box<dyn std::error::Error>> {
    crate::credentials::oauth_token(config)
}

/// Serves a new consumer's first OAUTHBEARER token request now: librdkafka asks for it through
/// the client's queue at creation, and a client that fetches metadata before it polls would
/// otherwise never connect. A no-op without `[kafka.auth]`.
pub fn serve_token_request<C: ConsumerContext>(consumer: &BaseConsumer<C>) {
    let _ = consumer.poll(std::time::Duration::ZERO);
}

/// The context of a client that needs nothing but the relay's log levels and its OAUTHBEARER
/// tokens (the example services' producers, `republish`).
#[derive(Clone, Copy, Default)]
pub struct TokenContext;

impl ClientContext for TokenContext {
    const ENABLE_REFRESH_OAUTH_TOKEN: bool = true;

    fn generate_oauth_token(&self, config: Option<&str>) -> Result<OAuthToken, Box<dyn std::error::Error>> {
        oauth_token(config)
    }

    fn log(&self, level: RDKafkaLogLevel, fac: &str, message: &str) {
        log_librdkafka(level, fac, message);
    }
}

impl ConsumerContext for TokenContext {}

/// A partition's end, reported as an error.
fn is_partition_end(error: &KafkaError) -> bool {
    matches!(error, KafkaError::Global(RDKafkaErrorCode::PartitionEOF) | KafkaError::PartitionEOF(_))
}

/// The librdkafka client configuration for a producer built from `kafka`: acks=all, idempotent,
/// gapless.
pub fn producer_config(kafka: &KafkaConfig) -> ClientConfig {
    let mut cc = client_config(kafka);
    cc.set("message.timeout.ms", kafka.message_timeout_ms.to_string())
        .set("linger.ms", kafka.linger_ms.to_string())
        .set("compression.codec", &kafka.compression)
        .set("acks", "all")
        .set("enable.idempotence", "true")
        // A record that fails permanently stops the producer instead of letting later records
        // of its partition through: a gap would reorder an aggregate's events on retry.
        .set("enable.gapless.guarantee", "true");
    cc
}

/// [`producer_config`] with Kafka transactions under `transactional_id`: a record may wait at
/// most as long as its transaction may stay open (librdkafka refuses a longer
/// `message.timeout.ms`; 0, "never", becomes the transaction timeout).
pub(crate) fn transactional_producer_config(kafka: &KafkaConfig, transactional_id: &str) -> ClientConfig {
    let mut cc = producer_config(kafka);
    let message_timeout_ms = match kafka.message_timeout_ms {
        0 => kafka.transaction_timeout_ms,
        ms => ms.min(kafka.transaction_timeout_ms),
    };
    cc.set("transactional.id", transactional_id)
        .set("transaction.timeout.ms", kafka.transaction_timeout_ms.to_string())
        .set("message.timeout.ms", message_timeout_ms.to_string());
    cc
}

/// The relay's level for one of librdkafka's log lines, or `None` to drop it.
///
/// - `CONFWARN ... gapless`: librdkafka calls enable.gapless.guarantee experimental at every
///   producer's creation; docs/guarantees.md says what it does and why it is always on, once.
/// - `FAIL` at error level: a broker connection that failed (a refused connect, a dropped
///   connection). librdkafka then also hands the same failure to [`ClientContext::error`]
///   (`rd_kafka_broker_set_error` pairs an error op with a FAIL line only from LOG_ERR up),
///   which logs it once at INFO or WARN, or at ERROR for what is not a plain transport failure
///   (TLS, authentication): an ERROR line per reconnect would page for what the stall watch
///   already reports. Its FAIL lines below error level have no such pair (a connection closed
///   during the ApiVersion request, which names a likely security.protocol or SASL mistake; a
///   connection setup timeout) and keep their level.
fn log_level(level: RDKafkaLogLevel, fac: &str, message: &str) -> Option<tracing::Level> {
    if fac == "CONFWARN" && message.contains("gapless") {
        return None;
    }
    let relay_level = match level {
        RDKafkaLogLevel::Emerg
        | RDKafkaLogLevel::Alert
        | RDKafkaLogLevel::Critical
        | RDKafkaLogLevel::Error => tracing::Level::ERROR,
        RDKafkaLogLevel::Warning => tracing::Level::WARN,
        RDKafkaLogLevel::Notice | RDKafkaLogLevel::Info => tracing::Level::INFO,
        RDKafkaLogLevel::Debug => tracing::Level::DEBUG,
    };
    if fac == "FAIL" && relay_level == tracing::Level::ERROR {
        return Some(tracing::Level::DEBUG);
    }
    Some(relay_level)
}

/// Logs one of librdkafka's log lines at the relay's level ([`log_level`]); every client of the
/// relay's (the producer, the read-back consumer) logs through this.
pub(crate) fn log_librdkafka(level: RDKafkaLogLevel, fac: &str, message: &str) {
    let stopping = STOPPING.load(Ordering::Relaxed);
    match log_level(level, fac, message).map(|level| after_stop(level, stopping)) {
        Some(tracing::Level::ERROR) => tracing::error!(target: "librdkafka", "{fac} {message}"),
        Some(tracing::Level::WARN) => tracing::warn!(target: "librdkafka", "{fac} {message}"),
        Some(tracing::Level::INFO) => tracing::info!(target: "librdkafka", "{fac} {message}"),
        Some(_) => tracing::debug!(target: "librdkafka", "{fac} {message}"),
        None => {}
    }
}

#[cfg(test)]
mod tests {
    use rdkafka::config::RDKafkaLogLevel;
    use tracing::Level;

    use super::log_level;

    #[test]
    fn a_transactional_producers_records_wait_at_most_the_transaction_timeout() {
        let kafka: crate::config::KafkaConfig =
            serde_json::from_value(serde_json::json!({"brokers": ["localhost:9092"], "transactional": true}))
                .unwrap();
        let producer = super::transactional_producer_config(&kafka, "id");
        assert_eq!(producer.get("message.timeout.ms"), Some("60000"));
        assert_eq!(producer.get("transactional.id"), Some("id"));
    }

    /// Every fatal exit added librdkafka's FATAL and "Purged in flight" lines, and a shutdown
    /// after broker restarts stale errors naming brokers that were up: once the process decided
    /// to stop, librdkafka's errors and warnings are DEBUG.
    #[test]
    fn what_librdkafka_says_after_the_decision_to_stop_is_debug() {
        use super::after_stop;
        assert_eq!(after_stop(Level::ERROR, true), Level::DEBUG);
        assert_eq!(after_stop(Level::WARN, true), Level::DEBUG);
        assert_eq!(after_stop(Level::INFO, true), Level::INFO);
        assert_eq!(after_stop(Level::ERROR, false), Level::ERROR);
        assert_eq!(after_stop(Level::WARN, false), Level::WARN);
    }

    #[test]
    fn a_partition_end_is_not_an_error() {
        use rdkafka::error::{KafkaError, RDKafkaErrorCode};
        assert!(super::is_partition_end(&KafkaError::Global(RDKafkaErrorCode::PartitionEOF)));
        assert!(super::is_partition_end(&KafkaError::PartitionEOF(0)));
        assert!(!super::is_partition_end(&KafkaError::Global(RDKafkaErrorCode::AllBrokersDown)));
    }

    #[test]
    fn a_failed_broker_connection_is_not_an_error_line() {
        // librdkafka's own words for a broker it cannot reach (rdkafka_broker.c)
        let refused = "127.0.0.1:9092/bootstrap: Connect to ipv4#127.0.0.1:9092 failed: Connection refused";
        assert_eq!(log_level(RDKafkaLogLevel::Error, "FAIL", refused), Some(Level::DEBUG));
        // a FAIL line below error level has no error-callback twin: it keeps its level
        let api_version = "Disconnected while requesting ApiVersion: might be caused by incorrect \
                           security.protocol configuration (connecting to a SSL listener?)";
        assert_eq!(log_level(RDKafkaLogLevel::Warning, "FAIL", api_version), Some(Level::WARN));
        assert_eq!(
            log_level(RDKafkaLogLevel::Info, "FAIL", "Disconnected (after 5000ms in state UP)"),
            Some(Level::INFO)
        );
        assert_eq!(log_level(RDKafkaLogLevel::Error, "SSL", "certificate verify failed"), Some(Level::ERROR));
        assert_eq!(
            log_level(RDKafkaLogLevel::Warning, "CONFWARN", "enable.gapless.guarantee is experimental"),
            None
        );
        assert_eq!(log_level(RDKafkaLogLevel::Warning, "CONFWARN", "some other setting"), Some(Level::WARN));
    }
}
