//! What the ledger tests share (tests/ledger.rs, tests/ledger_faults.rs): records as the relay
//! publishes them, and [`Ledger`], one test's database, topics, consumer group and
//! configuration file, with the ledger run as a process.
// each test binary uses a part of this module
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use serde_json::json;

use crate::common::service::ServiceProcess;
use crate::common::*;

/// A record as the relay publishes an outbox row.
#[derive(Debug, Clone)]
pub struct Record {
    pub partition: Option<i32>,
    pub key: String,
    pub payload: Option<String>,
    pub headers: Vec<(String, String)>,
}

impl Record {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }

    pub fn without_header(mut self, name: &str) -> Record {
        self.headers.retain(|(k, _)| k != name);
        self
    }

    pub fn with_header(mut self, name: &str, value: &str) -> Record {
        self.headers.retain(|(k, _)| k != name);
        self.headers.push((name.into(), value.into()));
        self
    }

    pub fn on_partition(mut self, partition: i32) -> Record {
        self.partition = Some(partition);
        self
    }
}

fn random_uuid() -> String {
    let hex = format!("{:032x}", rand::random::<u128>());
    format!("{}-{}-4{}-8{}-{}", &hex[..8], &hex[8..12], &hex[13..16], &hex[17..20], &hex[20..])
}

/// An `OrderPlaced` record of event `event_id` (the outbox row id) for a new order.
pub fn order_placed(event_id: i64, customer: &str, total_cents: i64) -> Record {
    let order_id = 500_000 + event_id;
    let payload = json!({
        "order_id": order_id,
        "customer_id": customer,
        "total_cents": total_cents,
        "payment_id": random_uuid(),
    });
    let headers = [
        ("id", event_id.to_string()),
        ("event_type", "OrderPlaced".into()),
        ("aggregate_type", "order".into()),
        ("outbox_relay_source", "test/ledger/public.outbox_events".into()),
        ("outbox_relay_position", format!("0/{event_id:X}")),
        ("traceparent", format!("00-{:032x}-{:016x}-01", rand::random::<u128>(), rand::random::<u64>())),
    ];
    Record {
        partition: None,
        key: order_id.to_string(),
        payload: Some(payload.to_string()),
        headers: headers.into_iter().map(|(k, v)| (k.to_string(), v)).collect(),
    }
}

/// One ledger test: a database with the relay's and the ledger's tables, a topic and its
/// dead-letter topic, a consumer group, and the ledger's configuration file.
pub struct Ledger {
    pub db: TestDb,
    pub dir: tempfile::TempDir,
    pub topic: String,
    pub dead_letter_topic: String,
    pub group: String,
    pub partitions: i32,
}

/// The `[consumer]` settings of every test unless it overrides them: quick retries.
const CONSUMER_DEFAULTS: [(&str, &str); 2] = [("initial_backoff_ms", "50"), ("max_backoff_ms", "500")];

impl Ledger {
    pub async fn new(partitions: i32, consumer: &[(&str, &str)]) -> Ledger {
        let db = TestDb::new().await;
        let sql = std::fs::read_to_string(repo_root().join("sql/examples/ledger.sql")).unwrap();
        db.client().await.batch_execute(&sql).await.unwrap();
        Self::on(db, partitions, consumer).await
    }

    /// As [`Ledger::new`], on `db` as it is.
    pub async fn on(db: TestDb, partitions: i32, consumer: &[(&str, &str)]) -> Ledger {
        let topic = random_topic("ledger");
        let dead_letter_topic = format!("{topic}.dlq");
        create_topic(&topic, partitions).await;
        create_topic(&dead_letter_topic, 2).await;
        let ledger = Ledger {
            db,
            dir: tempfile::tempdir().unwrap(),
            topic,
            dead_letter_topic,
            group: format!("ledger-{}", random_suffix()),
            partitions,
        };
        ledger.write_config(consumer);
        ledger
    }

    fn config(&self) -> PathBuf {
        self.dir.path().join("ledger.toml")
    }

    pub fn write_config(&self, consumer: &[(&str, &str)]) {
        let (host, port, user) = self.db.pg_parts();
        let mut settings: BTreeMap<&str, String> = BTreeMap::new();
        settings.insert("topic", format!("\"{}\"", self.topic));
        settings.insert("group_id", format!("\"{}\"", self.group));
        for (key, value) in CONSUMER_DEFAULTS.iter().chain(consumer) {
            settings.insert(key, value.to_string());
        }
        let consumer: String = settings.iter().map(|(k, v)| format!("{k} = {v}\n")).collect();
        // a short session timeout: a killed instance's partitions move on within seconds
        let toml = format!(
            "[postgres]\nhost = \"{host}\"\nport = {port}\nuser = \"{user}\"\ndatabase = \"{}\"\n\
             sslmode = \"disable\"\n\n[kafka]\nbrokers = [\"{}\"]\n\n\
             [kafka.properties]\n\"session.timeout.ms\" = \"6000\"\n\n[consumer]\n{consumer}",
            self.db.name,
            services().kafka
        );
        std::fs::write(self.config(), toml).unwrap();
    }

    /// How many members the ledger's consumer group has once it is stable (every member
    /// assigned its partitions), as the group coordinator describes it (what
    /// `kafka-consumer-groups --describe` shows an operator); 0 while it is rebalancing.
    pub fn stable_group_members(&self) -> usize {
        use rdkafka::consumer::{BaseConsumer, Consumer};
        let client: BaseConsumer =
            rdkafka::ClientConfig::new().set("bootstrap.servers", &services().kafka).create().unwrap();
        // (a coordinator still loading its partition answers with an error: not stable yet)
        let Ok(groups) = client.fetch_group_list(Some(&self.group), std::time::Duration::from_secs(10))
        else {
            return 0;
        };
        let group = groups.groups().iter().find(|g| g.name() == self.group);
        group.filter(|g| g.state() == "Stable").map_or(0, |g| g.members().len())
    }

    /// `ledger run`, logging to `NAME.log` (appended, so restarts share a log).
    pub fn start(&self, name: &str) -> ServiceProcess {
        let log = self.dir.path().join(format!("{name}.log"));
        let config = self.config();
        let env = [("RUST_LOG", "info,ledger=debug")];
        ServiceProcess::spawn("ledger", &["run", "--config", config.to_str().unwrap()], &env, &log)
    }

    /// Runs `ledger ARGS` to its exit; returns the exit code and its stderr.
    pub async fn run_to_exit(&self, args: &[&str], env: &[(&str, &str)]) -> (i32, String) {
        let log = self.dir.path().join(format!("{}.log", random_suffix()));
        let config = self.config();
        let mut args = args.to_vec();
        args.extend(["--config", config.to_str().unwrap()]);
        let mut process = ServiceProcess::spawn("ledger", &args, env, &log);
        let mut code = None;
        wait_until(format!("ledger {args:?} to exit"), async || {
            code = process.exited();
            code.is_some()
        })
        .await;
        (code.unwrap(), process.log_text())
    }

    pub async fn produce(&self, records: &[Record]) {
        self.produce_to(&self.topic, records).await
    }

    /// As [`Ledger::produce`], into `topic` (the dead-letter topic, say).
    pub async fn produce_to(&self, topic: &str, records: &[Record]) {
        let producer: FutureProducer = ClientConfig::new()
            .set("bootstrap.servers", &services().kafka)
            .set("enable.idempotence", "true")
            .set("linger.ms", "0")
            .create()
            .unwrap();
        send_all(&producer, topic, records).await;
    }

    /// As [`Ledger::produce`], in one Kafka transaction of a producer of its own, which then
    /// commits, or aborts (`commit` false): the records of an aborted one stay in the log,
    /// and only a `read_uncommitted` consumer sees them.
    pub async fn produce_in_transaction(&self, records: &[Record], commit: bool) {
        let producer: FutureProducer = ClientConfig::new()
            .set("bootstrap.servers", &services().kafka)
            .set("transactional.id", format!("ledger-test-{}", random_suffix()))
            .set("linger.ms", "0")
            .create()
            .unwrap();
        let timeout = Duration::from_secs(30);
        tokio::task::block_in_place(|| producer.init_transactions(timeout)).unwrap();
        producer.begin_transaction().unwrap();
        send_all(&producer, &self.topic, records).await;
        let ended = tokio::task::block_in_place(|| {
            if commit { producer.commit_transaction(timeout) } else { producer.abort_transaction(timeout) }
        });
        ended.unwrap();
    }

    pub async fn fund(&self, customer: &str, cents: i64) {
        self.db
            .client()
            .await
            .execute("INSERT INTO wallets (customer_id, balance_cents) VALUES ($1, $2)", &[&customer, &cents])
            .await
            .unwrap();
    }

    /// The one bigint `sql` returns.
    pub async fn scalar(&self, sql: &str) -> i64 {
        self.db.client().await.query_one(sql, &[]).await.unwrap_or_else(|e| panic!("{sql}: {e:?}")).get(0)
    }

    pub async fn balance(&self, customer: &str) -> i64 {
        let client = self.db.client().await;
        let sql = "SELECT balance_cents FROM wallets WHERE customer_id = $1";
        client.query_one(sql, &[&customer]).await.unwrap().get(0)
    }

    pub async fn outcome(&self, event_id: &str) -> Option<(String, Option<String>)> {
        let client = self.db.client().await;
        let sql = "SELECT outcome, detail FROM processed_events WHERE event_id = $1";
        client.query_opt(sql, &[&event_id]).await.unwrap().map(|row| (row.get(0), row.get(1)))
    }

    /// What the consumer group has committed, over all partitions: how many records it is done
    /// with (what `kafka-consumer-groups --describe` shows an operator).
    pub fn committed(&self) -> Committed {
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", &services().kafka)
            .set("group.id", &self.group)
            .create()
            .unwrap();
        Committed { consumer, topic: self.topic.clone(), partitions: self.partitions }
    }

    pub fn dead_letters(&self) -> rdkafka::consumer::StreamConsumer {
        consumer(&[&self.dead_letter_topic])
    }
}

/// Sends `records` to `topic` and waits for every acknowledgement.
async fn send_all(producer: &FutureProducer, topic: &str, records: &[Record]) {
    let sends = records.iter().map(|r| {
        let headers = r.headers.iter().fold(OwnedHeaders::new(), |h, (key, value)| {
            h.insert(Header { key, value: Some(value.as_str()) })
        });
        let mut out = FutureRecord::<String, String>::to(topic).key(&r.key).headers(headers);
        if let Some(payload) = &r.payload {
            out = out.payload(payload);
        }
        if let Some(partition) = r.partition {
            out = out.partition(partition);
        }
        producer.send(out, Duration::from_secs(30))
    });
    for result in futures::future::join_all(sends).await {
        result.unwrap_or_else(|(e, _)| panic!("produce: {e}"));
    }
}

pub struct Committed {
    consumer: BaseConsumer,
    topic: String,
    partitions: i32,
}

impl Committed {
    fn total(&self) -> i64 {
        let mut tpl = TopicPartitionList::new();
        for partition in 0..self.partitions {
            tpl.add_partition(&self.topic, partition);
        }
        match self.consumer.committed_offsets(tpl, Duration::from_secs(10)) {
            Ok(committed) => committed
                .elements()
                .iter()
                .map(|e| if let Offset::Offset(n) = e.offset() { n } else { 0 })
                .sum(),
            Err(_) => -1,
        }
    }

    pub async fn wait_for(&self, expected: i64) {
        wait_until(format!("the group to commit {expected} records"), async || self.total() == expected)
            .await;
    }
}

/// A test transaction holding `customer`'s wallet row lock until it ends.
pub async fn lock_wallet<'c>(
    client: &'c mut tokio_postgres::Client,
    customer: &str,
) -> tokio_postgres::Transaction<'c> {
    let tx = client.transaction().await.unwrap();
    tx.query_one("SELECT balance_cents FROM wallets WHERE customer_id = $1 FOR UPDATE", &[&customer])
        .await
        .unwrap();
    tx
}

/// The start of the transaction of a ledger session of `l` that is waiting for a lock, if one is.
pub async fn ledger_waiting_since(
    watcher: &tokio_postgres::Client,
    l: &Ledger,
) -> Option<std::time::SystemTime> {
    let sql = "SELECT xact_start FROM pg_stat_activity WHERE datname = $1 AND application_name = 'ledger' \
               AND wait_event_type = 'Lock'";
    watcher.query_opt(sql, &[&l.db.name]).await.unwrap().map(|row| row.get(0))
}
