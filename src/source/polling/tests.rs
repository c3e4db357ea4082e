//! The polling claim shell (`relay_batch`, run by [`Source::session`]) against the scripted
//! sink, on a real PostgreSQL (and, where the read-back is the point, a real Kafka): the servers
//! `deploy/local/test` starts and names in `OUTBOX_RELAY_TEST_PG_URL` and
//! `OUTBOX_RELAY_TEST_KAFKA`. Each test has a database of its own.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio_postgres::{Client, NoTls};

use super::PollingSource;
use crate::config::RelayConfig;
use crate::error::RelayError;
use crate::observe::health::Health;
use crate::observe::pulse::Pulse;
use crate::outboxes::Outboxes;
use crate::sink::scripted::{Lifecycle, ScriptedSink};
use crate::source::Source;

/// How long a test waits for what should happen (a hang guard, not a speed limit).
const PATIENCE: Duration = Duration::from_secs(60);

fn service(variable: &str) -> String {
    std::env::var(variable).unwrap_or_else(|_| {
        panic!("{variable} is not set: these tests need the servers `deploy/local/test` starts (run them with it)")
    })
}

async fn connect(url: &str) -> Client {
    let (client, connection) = tokio_postgres::connect(url, NoTls).await.expect("the test server answers");
    tokio::spawn(connection);
    client
}

/// A database of the test's own with `sql/`'s migrations applied; dropped with the test.
struct Db {
    admin_url: String,
    name: String,
    url: String,
    client: Client,
}

impl Db {
    async fn new() -> Db {
        let admin_url = service("OUTBOX_RELAY_TEST_PG_URL");
        let admin = connect(&admin_url).await;
        let name = format!("unit_{:016x}", rand::random::<u64>());
        admin.batch_execute(&format!("CREATE DATABASE {name}")).await.unwrap();
        let url = format!("{}/{name}", admin_url.rsplit_once('/').expect("a database in the URL").0);
        let client = connect(&url).await;
        let mut files: Vec<_> = std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/sql"))
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "sql"))
            .filter(|p| p.file_name().unwrap().to_string_lossy().starts_with(|c: char| c.is_ascii_digit()))
            .collect();
        files.sort();
        for file in files {
            let sql = std::fs::read_to_string(&file).unwrap();
            client.batch_execute(&sql).await.unwrap_or_else(|e| panic!("{}: {e:?}", file.display()));
        }
        Db { admin_url, name, url, client }
    }

    /// A polling relay's configuration for this database and `brokers`; `dedup`: whether it
    /// reads back what Kafka holds before it publishes.
    fn config(&self, brokers: &str, dedup: bool) -> RelayConfig {
        let url: tokio_postgres::Config = self.url.parse().unwrap();
        let tokio_postgres::config::Host::Tcp(host) = &url.get_hosts()[0] else { panic!("a TCP host") };
        serde_json::from_value(serde_json::json!({
            "source": {"mode": "polling"},
            "postgres": {"host": host, "port": url.get_ports()[0], "user": url.get_user().unwrap(),
                         "database": self.name, "sslmode": "disable"},
            "kafka": {"brokers": [brokers], "transactional": false},
            "polling": {"poll_interval_ms": 50},
            "dedup": {"enabled": dedup},
            "retry": {"initial_backoff_ms": 10, "max_backoff_ms": 20},
        }))
        .unwrap()
    }

    /// Writes an event of aggregate type `aggregate` (its topic is `outbox.event.<aggregate>`);
    /// returns its id.
    async fn write(&self, aggregate: &str) -> String {
        let sql = "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload) \
                   VALUES ($1, 'o-1', 'Placed', '{}') RETURNING id::text";
        self.client.query_one(sql, &[&aggregate]).await.unwrap().get(0)
    }

    async fn rows(&self) -> i64 {
        self.client.query_one("SELECT count(*) FROM outbox_events", &[]).await.unwrap().get(0)
    }

    /// Resolves once the outbox is empty (looked at every 20 ms).
    async fn drained(&self) {
        while self.rows().await > 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for Db {
    fn drop(&mut self) {
        let (admin_url, name) = (self.admin_url.clone(), self.name.clone());
        // (Drop is synchronous: a runtime of its own, on a thread of its own)
        let _ = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            runtime.block_on(async move {
                let admin = connect(&admin_url).await;
                let _ = admin.batch_execute(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)")).await;
            })
        })
        .join();
    }
}

fn pulse() -> Pulse {
    Pulse::new(Arc::new(Health::new(Duration::from_secs(1))))
}

/// A polling source of `config` over `sink`.
fn source(config: RelayConfig, sink: ScriptedSink) -> PollingSource<ScriptedSink> {
    let outboxes = Arc::new(Outboxes::new(&config));
    PollingSource::new(config, outboxes, sink)
}

/// One session of `source`: until it ends by itself (an error), or until `done` resolves and
/// a shutdown then ends it.
async fn session(
    source: &mut PollingSource<ScriptedSink>,
    done: impl Future<Output = ()>,
) -> Result<(), RelayError> {
    let (stop, mut shutdown) = watch::channel(false);
    let pulse = pulse();
    let session = source.session(&pulse, &mut shutdown);
    tokio::pin!(session);
    let done = tokio::time::timeout(PATIENCE, done);
    tokio::select! {
        ended = &mut session => return ended,
        waited = done => waited.expect("the session did what the test waits for in time"),
    }
    stop.send(true).unwrap();
    session.await
}

#[tokio::test]
async fn a_failed_activate_claims_nothing_and_the_next_session_publishes_every_row_once_in_order() {
    // given three rows, and a sink whose activation fails once (it could not fence the
    // producers before it)
    let db = Db::new().await;
    let mut ids = Vec::new();
    for _ in 0..3 {
        ids.push(db.write("order").await);
    }
    let sink = ScriptedSink::new();
    sink.fail(Lifecycle::Activate, 1);
    let mut source = source(db.config("127.0.0.1:1", false), sink);
    // when a session runs
    let failed = session(&mut source, std::future::pending()).await;
    // then it ends with the sink's error, having sent and released nothing
    let error = failed.expect_err("a failed activation ends the session");
    assert!(error.to_string().contains("Activate failed"), "{error}");
    assert!(source.sink.sent().is_empty());
    assert_eq!(db.rows().await, 3);
    // and after the supervisor's recovery, the next session publishes every row once, in order
    source.recover();
    session(&mut source, db.drained()).await.unwrap();
    assert_eq!(source.sink.sent(), ids);
}

#[tokio::test]
async fn a_failed_kafka_commit_releases_no_row_and_the_next_session_commits_the_batch_once() {
    // given two rows, and a transactional sink whose first commit fails
    let db = Db::new().await;
    let ids = vec![db.write("order").await, db.write("order").await];
    let sink = ScriptedSink::transactional();
    sink.fail(Lifecycle::Commit, 1);
    let mut source = source(db.config("127.0.0.1:1", false), sink);
    // when a session claims and sends them
    let failed = session(&mut source, std::future::pending()).await;
    // then it ends with the sink's error: nothing became visible and both rows are still there
    let error = failed.expect_err("a failed commit ends the session");
    assert!(error.to_string().contains("Commit failed"), "{error}");
    assert_eq!(source.sink.sent(), ids);
    assert!(source.sink.commits().is_empty());
    assert_eq!(db.rows().await, 2);
    // and the next session (a fresh producer aborted the open transaction) commits them once
    source.recover();
    session(&mut source, db.drained()).await.unwrap();
    assert_eq!(source.sink.commits(), [ids]);
}

#[tokio::test]
async fn a_row_whose_record_kafka_already_holds_is_released_unsent_and_the_rest_are_sent() {
    // given a row an earlier session published without committing its release (a crash after
    // Kafka's acknowledgement: the row stayed), and a row never published
    let db = Db::new().await;
    let config = db.config(&service("OUTBOX_RELAY_TEST_KAFKA"), true);
    let aggregate = format!("unit{:08x}", rand::random::<u32>());
    let published = db.write(&aggregate).await;
    publish(&db, &config, &aggregate, &published).await;
    let unpublished = db.write(&aggregate).await;
    // when a polling session runs (its sends go to the scripted sink, its read-back to Kafka)
    let mut source = source(config, ScriptedSink::new());
    session(&mut source, db.drained()).await.unwrap();
    // then the row Kafka holds was released without being sent again, and the other was sent
    assert_eq!(source.sink.sent(), [unpublished]);
}

/// Publishes row `id` (of aggregate type `aggregate`) as an earlier polling session's batch did:
/// through the Kafka sink, with this database's source identity.
async fn publish(db: &Db, config: &RelayConfig, aggregate: &str, id: &str) {
    use crate::record::{OutboxRow, Position};
    let row = OutboxRow {
        id: Some(id.into()),
        aggregate_type: Some(aggregate.into()),
        aggregate_id: Some("o-1".into()),
        event_type: Some("Placed".into()),
        payload: Some("{}".into()),
        ..OutboxRow::default()
    };
    let outboxes = Outboxes::new(config);
    let mut record = outboxes.first().mapping.to_record(row, None).unwrap().unwrap();
    record.position = Some(Position::Batch { session: 7, batch: 0, index: 0 });
    let mut kafka = crate::sink::kafka::KafkaSink::new(&config.kafka).unwrap();
    kafka.set_sources(&crate::readback::source_identities(&db.client, config).await.unwrap());
    let seq = kafka.enqueue(&record).await;
    let report = tokio::time::timeout(PATIENCE, async { kafka.reports().await.recv().await }).await;
    let report = report.expect("Kafka answers in time").expect("a report");
    assert_eq!(report.seq, seq);
    assert!(report.outcome.is_ok(), "Kafka acknowledged the earlier session's record");
}
