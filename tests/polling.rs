//! Polling mode against the real PostgreSQL and broker, with the relay as a child process:
//! no loss, no phantom, per-aggregate order, across crashes, broker refusals and failover.

mod common;

use std::time::{Duration, Instant};

use common::process::RelayProcess;
use common::workload::*;
use common::*;

const IDLE: Duration = Duration::from_secs(60);
const LINGER: Duration = Duration::from_secs(3);
const EXIT_LIMIT: Duration = Duration::from_secs(40);

/// A test's database, topic and relay configuration.
struct Setup {
    db: TestDb,
    dir: tempfile::TempDir,
    aggregate_type: String,
    topic: String,
}

impl Setup {
    async fn new(extra_config: &str) -> Setup {
        let db = TestDb::new().await;
        let aggregate_type = format!("t{}", random_suffix());
        let topic = format!("outbox.event.{aggregate_type}");
        create_topic(&topic, 4).await;
        let dir = tempfile::tempdir().unwrap();
        let config = format!(
            "[source]\nmode = \"polling\"\n[polling]\npoll_interval_ms = 200\nbatch_size = 200\n{extra_config}"
        );
        write_config(dir.path(), &db, &config);
        Setup { db, dir, aggregate_type, topic }
    }

    fn config(&self) -> std::path::PathBuf {
        self.dir.path().join("relay.toml")
    }

    fn start(&self, name: &str) -> RelayProcess {
        RelayProcess::start(&self.config(), &self.dir.path().join(format!("{name}.log")))
    }

    async fn outbox_rows(&self) -> i64 {
        self.db.client().await.query_one("SELECT count(*) FROM outbox_events", &[]).await.unwrap().get(0)
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn ten_thousand_concurrent_events_arrive_once_in_order() {
    // given a running relay and 100 aggregates
    let s = Setup::new("").await;
    create_aggregates(&s.db.client().await, 100).await;
    let consumer = consumer(&[&s.topic]);
    let mut relay = s.start("relay");

    // when 8 concurrent writers commit 10,000 events
    let committed = write_concurrently(&s.db.url, &s.aggregate_type, 100, 10_000, 8).await;

    // then every event arrives exactly once, in per-aggregate order
    let records = consume_unique(&consumer, 10_000, IDLE, LINGER).await;
    let report = assert_delivered(&records, &committed);
    assert_eq!(report.unique, 10_000);
    assert_eq!(report.duplicates, 0, "steady state must not publish twice");
    assert_eq!(s.outbox_rows().await, 0, "published rows are deleted");

    // and SIGTERM stops it cleanly with exit status 0
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0), "{}", relay.log_text());
}

#[tokio::test(flavor = "multi_thread")]
async fn kill_9_mid_run_loses_nothing_and_keeps_order() {
    // given a relay publishing while writers write
    let s = Setup::new("").await;
    create_aggregates(&s.db.client().await, 100).await;
    let consumer = consumer(&[&s.topic]);
    let mut relay = s.start("first");
    let writer = tokio::spawn(write_concurrently_owned(s.db.url.clone(), s.aggregate_type.clone(), 6_000));

    // when the relay is killed with SIGKILL once events are flowing
    let early = consume(&consumer, 500, IDLE).await;
    assert_eq!(early.len(), 500, "events did not start flowing");
    relay.kill9();
    let committed = writer.await.unwrap();
    let backlog = s.outbox_rows().await;
    let mut relay = s.start("second");

    // then after a restart every committed event arrives, first arrivals in order, and the
    // only duplicates are from the one batch in flight at the kill
    let mut records = early;
    let unique_so_far = records
        .iter()
        .map(|r| r.header("id").unwrap().to_string())
        .collect::<std::collections::HashSet<_>>()
        .len();
    records.extend(consume_unique(&consumer, 6_000 - unique_so_far, IDLE, LINGER).await);
    let report = assert_delivered(&records, &committed);
    assert_eq!(report.unique, 6_000);
    assert!(report.duplicates <= 200, "{} duplicates, more than one batch (200)", report.duplicates);
    assert!(backlog > 0, "the kill happened after everything was published; the test proved nothing");
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0));
}

async fn write_concurrently_owned(
    url: String,
    aggregate_type: String,
    total: usize,
) -> std::collections::HashMap<String, i64> {
    write_concurrently(&url, &aggregate_type, 100, total, 4).await
}

#[tokio::test(flavor = "multi_thread")]
async fn rows_stay_until_the_broker_acknowledges() {
    use rdkafka::mocking::MockCluster;
    use rdkafka::types::{RDKafkaApiKey, RDKafkaRespErr};

    // given a relay whose broker (librdkafka's mock cluster) refuses every produce request
    let mock = MockCluster::new(1).unwrap();
    let db = TestDb::new().await;
    let aggregate_type = format!("t{}", random_suffix());
    let topic = format!("outbox.event.{aggregate_type}");
    mock.create_topic(&topic, 2, 1).unwrap();
    mock.request_errors(
        RDKafkaApiKey::Produce,
        &[RDKafkaRespErr::RD_KAFKA_RESP_ERR_NOT_ENOUGH_REPLICAS; 100_000],
    );
    let dir = tempfile::tempdir().unwrap();
    let config = write_config_with(
        dir.path(),
        &db,
        &mock.bootstrap_servers(),
        "message_timeout_ms = 2000\n[kafka.properties]\n\"reconnect.backoff.max.ms\" = \"500\"\n\"retry.backoff.ms\" = \"50\"",
        "[source]\nmode = \"polling\"\n",
    );
    let client = db.client().await;
    create_aggregates(&client, 10).await;
    let mut writer = db.client().await;
    for i in 0..50 {
        write_events(&mut writer, &aggregate_type, &format!("agg-{}", i % 10), 1, true).await;
    }
    let mut relay = RelayProcess::start(&config, &dir.path().join("relay.log"));

    // when the relay tries for several message timeouts
    tokio::time::sleep(Duration::from_secs(8)).await;

    // then no row was deleted, and the relay says why it is retrying
    let rows: i64 = client.query_one("SELECT count(*) FROM outbox_events", &[]).await.unwrap().get(0);
    assert_eq!(rows, 50, "rows were released without an acknowledgement");
    assert!(relay.log_text().contains("relay degraded, retrying"), "{}", relay.log_text());
    assert!(relay.exited().is_none(), "the relay gave up: {}", relay.log_text());

    // when the broker accepts again, then everything is published once acknowledged
    mock.clear_request_errors(RDKafkaApiKey::Produce);
    let committed = committed_counts(&client).await;
    let mock_consumer: rdkafka::consumer::StreamConsumer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", mock.bootstrap_servers())
        .set("group.id", "refusal-test")
        .set("auto.offset.reset", "earliest")
        .create()
        .unwrap();
    rdkafka::consumer::Consumer::subscribe(&mock_consumer, &[&topic]).unwrap();
    let records = consume_unique(&mock_consumer, 50, IDLE, LINGER).await;
    assert_delivered(&records, &committed);
    let deadline = Instant::now() + IDLE;
    while client.query_one("SELECT count(*) FROM outbox_events", &[]).await.unwrap().get::<_, i64>(0) > 0 {
        assert!(Instant::now() < deadline, "rows were never released after acknowledgement");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(relay.log_text().contains("relay recovered"), "{}", relay.log_text());
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0));
}
