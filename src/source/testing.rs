//! What the sources' unit tests share: a database of the test's own on the PostgreSQL
//! `deploy/local/test` starts (`OUTBOX_RELAY_TEST_PG_URL`), the Kafka it starts
//! (`OUTBOX_RELAY_TEST_KAFKA`) for a read-back, a relay configuration for them, one session
//! run until the test has seen what it waits for, and a record published as an earlier
//! session would have published it (through the Kafka sink, with the database's identity).

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio_postgres::{Client, NoTls};

use crate::config::RelayConfig;
use crate::error::RelayError;
use crate::observe::health::Health;
use crate::observe::pulse::Pulse;
use crate::outboxes::Outboxes;
use crate::record::{OutboxRow, Position};
use crate::sink::Sink;
use crate::sink::scripted::ScriptedSink;
use crate::source::Source;

/// How long a test waits for what should happen (a hang guard, not a speed limit).
pub(crate) const PATIENCE: Duration = Duration::from_secs(60);

/// A server `deploy/local/test` started, as its variable names it.
pub(crate) fn service(variable: &str) -> String {
    std::env::var(variable).unwrap_or_else(|_| {
        panic!("{variable} is not set: these tests need the servers `deploy/local/test` starts (run them with it)")
    })
}

async fn connect(url: &str) -> Client {
    let (client, connection) = tokio_postgres::connect(url, NoTls).await.expect("the test server answers");
    tokio::spawn(connection);
    client
}

/// A database of the test's own with `sql/`'s migrations applied; dropped (with its slots)
/// when the test ends.
pub(crate) struct Db {
    admin_url: String,
    pub(crate) name: String,
    url: String,
    pub(crate) client: Client,
}

impl Db {
    pub(crate) async fn new() -> Db {
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

    /// A relay's configuration for this database and `brokers`, in `mode` (`polling`, or
    /// `replication` from a slot of the test's own); `dedup`: whether it reads back what Kafka
    /// holds before it publishes.
    pub(crate) fn config(&self, mode: &str, brokers: &str, dedup: bool) -> RelayConfig {
        let url: tokio_postgres::Config = self.url.parse().unwrap();
        let tokio_postgres::config::Host::Tcp(host) = &url.get_hosts()[0] else { panic!("a TCP host") };
        serde_json::from_value(serde_json::json!({
            "source": {"mode": mode},
            "postgres": {"host": host, "port": url.get_ports()[0], "user": url.get_user().unwrap(),
                         "database": self.name, "sslmode": "disable"},
            "kafka": {"brokers": [brokers]},
            "polling": {"poll_interval_ms": 50},
            "replication": {"slot": self.name},
            "dedup": {"enabled": dedup},
            "retry": {"initial_backoff_ms": 10, "max_backoff_ms": 20},
        }))
        .unwrap()
    }

    /// Writes an event of aggregate type `aggregate` (its topic is `outbox.event.<aggregate>`);
    /// returns its id.
    pub(crate) async fn write(&self, aggregate: &str) -> String {
        let sql = "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload) \
                   VALUES ($1, 'o-1', 'Placed', '{}') RETURNING id::text";
        self.client.query_one(sql, &[&aggregate]).await.unwrap().get(0)
    }

    pub(crate) async fn rows(&self) -> i64 {
        self.client.query_one("SELECT count(*) FROM outbox_events", &[]).await.unwrap().get(0)
    }

    /// Resolves once the outbox is empty (looked at every 20 ms).
    pub(crate) async fn drained(&self) {
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
                // a slot pins its database: ended and dropped first
                let slots = "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots \
                             WHERE database = $1 AND active_pid IS NOT NULL";
                let _ = admin.execute(slots, &[&name]).await;
                let drop = "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE database = $1";
                let _ = admin.execute(drop, &[&name]).await;
                let _ = admin.batch_execute(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)")).await;
            })
        })
        .join();
    }
}

/// One session of `source`: until it ends by itself (an error), or until `done` resolves and
/// a shutdown then ends it.
pub(crate) async fn session<S: Source<ScriptedSink>>(
    driven: &mut Driven<S>,
    done: impl Future<Output = ()>,
) -> Result<(), RelayError> {
    let (stop, mut shutdown) = watch::channel(false);
    let pulse = Pulse::new(driven.health.clone());
    let session = driven.source.session(&mut driven.sink, &pulse, &mut shutdown);
    tokio::pin!(session);
    let done = tokio::time::timeout(PATIENCE, done);
    tokio::select! {
        ended = &mut session => return ended,
        waited = done => waited.expect("the session did what the test waits for in time"),
    }
    stop.send(true).unwrap();
    session.await
}

/// A source and the scripted sink it delivers to, held as the supervisor holds them.
pub(crate) struct Driven<S> {
    pub source: S,
    pub sink: ScriptedSink,
    /// The process's health, with its pause switch.
    pub health: Arc<Health>,
}

impl<S> Driven<S> {
    pub(crate) fn new(source: S, sink: ScriptedSink) -> Driven<S> {
        Driven { source, sink, health: Arc::new(Health::new(Duration::from_secs(1))) }
    }

    /// What the supervisor does after a failed session: a fresh sink.
    pub(crate) fn recover(&mut self) {
        self.sink.recover();
    }
}

/// Publishes row `id` (of aggregate type `aggregate`) through the Kafka sink as an earlier
/// session read it at `position`, with this database's source identity.
pub(crate) async fn publish(
    db: &Db,
    config: &RelayConfig,
    (aggregate, id): (&str, &str),
    position: Position,
) {
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
    record.position = Some(position);
    let mut kafka = crate::sink::kafka::KafkaSink::new(&config.kafka).unwrap();
    kafka.set_sources(&crate::readback::source_identities(&db.client, config).await.unwrap());
    let seq = kafka.enqueue(&record).await;
    let report = tokio::time::timeout(PATIENCE, async { kafka.reports().await.recv().await }).await;
    let report = report.expect("Kafka answers in time").expect("a report");
    assert_eq!(report.seq, seq);
    assert!(report.outcome.is_ok(), "Kafka acknowledged the earlier session's record");
}
