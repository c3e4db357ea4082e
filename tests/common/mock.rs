//! librdkafka's mock cluster as the relay's broker, for faults the real broker cannot be made
//! to show: refused produce requests. (Not a broker that is down: librdkafka aborts the
//! process when it cannot re-bind the port it gave up; freeze a broker of the test's own.)

use rdkafka::mocking::MockCluster;
use rdkafka::producer::DefaultProducerContext;
use rdkafka::types::{RDKafkaApiKey, RDKafkaRespErr};

/// One mock broker (id 1). Topics must be created on it explicitly.
pub struct MockKafka {
    cluster: MockCluster<'static, DefaultProducerContext>,
}

impl MockKafka {
    pub fn start() -> MockKafka {
        MockKafka { cluster: MockCluster::new(1).expect("start librdkafka's mock cluster") }
    }

    pub fn brokers(&self) -> String {
        self.cluster.bootstrap_servers()
    }

    pub fn create_topic(&self, topic: &str, partitions: i32) {
        self.cluster.create_topic(topic, partitions, 1).unwrap_or_else(|e| panic!("create {topic}: {e}"));
    }

    /// Every produce request fails with NOT_ENOUGH_REPLICAS (a retriable error) until
    /// [`MockKafka::accept_produce`].
    pub fn refuse_produce(&self) {
        self.cluster.request_errors(
            RDKafkaApiKey::Produce,
            &[RDKafkaRespErr::RD_KAFKA_RESP_ERR_NOT_ENOUGH_REPLICAS; 100_000],
        );
    }

    pub fn accept_produce(&self) {
        self.cluster.clear_request_errors(RDKafkaApiKey::Produce);
    }

    /// A consumer of `topics` on the mock cluster, from the earliest offset.
    pub fn consumer(&self, topics: &[&str]) -> rdkafka::consumer::StreamConsumer {
        super::consumer_on(&self.brokers(), topics)
    }
}
