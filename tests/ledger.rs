//! The ledger (services/ledger) as its users run it, against a real PostgreSQL and a real
//! Kafka-protocol broker: each OrderPlaced record is applied once whatever the delivery does
//! (duplicates, two consumers at once, kill -9), a record that cannot be applied goes to the
//! dead-letter topic with its reason and every header, lock contention is retried and then
//! dead-lettered, and `replay-dlq` sends dead letters back.
//!
//! The records are produced by the test as the relay would publish them (key = order id,
//! headers `id`, `event_type`, ...); tests/chain.rs runs the whole chain with the relay.

mod common;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use common::service::ServiceProcess;
use common::*;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use serde_json::json;

/// A record as the relay publishes an outbox row.
#[derive(Debug, Clone)]
struct Record {
    partition: Option<i32>,
    key: String,
    payload: Option<String>,
    headers: Vec<(String, String)>,
}

impl Record {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }

    fn without_header(mut self, name: &str) -> Record {
        self.headers.retain(|(k, _)| k != name);
        self
    }

    fn with_header(mut self, name: &str, value: &str) -> Record {
        self.headers.retain(|(k, _)| k != name);
        self.headers.push((name.into(), value.into()));
        self
    }

    fn on_partition(mut self, partition: i32) -> Record {
        self.partition = Some(partition);
        self
    }
}

fn random_uuid() -> String {
    let hex = format!("{:032x}", rand::random::<u128>());
    format!("{}-{}-4{}-8{}-{}", &hex[..8], &hex[8..12], &hex[13..16], &hex[17..20], &hex[20..])
}

/// An `OrderPlaced` record of event `event_id` (the outbox row id) for a new order.
fn order_placed(event_id: i64, customer: &str, total_cents: i64) -> Record {
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
struct Ledger {
    db: TestDb,
    dir: tempfile::TempDir,
    topic: String,
    dead_letter_topic: String,
    group: String,
    partitions: i32,
}

/// The `[consumer]` settings of every test unless it overrides them: quick retries.
const CONSUMER_DEFAULTS: [(&str, &str); 2] = [("initial_backoff_ms", "50"), ("max_backoff_ms", "500")];

impl Ledger {
    async fn new(partitions: i32, consumer: &[(&str, &str)]) -> Ledger {
        let db = TestDb::new().await;
        let sql = std::fs::read_to_string(repo_root().join("sql/examples/ledger.sql")).unwrap();
        db.client().await.batch_execute(&sql).await.unwrap();
        Self::on(db, partitions, consumer).await
    }

    /// As [`Ledger::new`], on `db` as it is.
    async fn on(db: TestDb, partitions: i32, consumer: &[(&str, &str)]) -> Ledger {
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

    fn write_config(&self, consumer: &[(&str, &str)]) {
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

    /// `ledger run`, logging to `NAME.log` (appended, so restarts share a log).
    fn start(&self, name: &str) -> ServiceProcess {
        let log = self.dir.path().join(format!("{name}.log"));
        let config = self.config();
        let env = [("RUST_LOG", "info,ledger=debug")];
        ServiceProcess::spawn("ledger", &["run", "--config", config.to_str().unwrap()], &env, &log)
    }

    /// Runs `ledger ARGS` to its exit; returns the exit code and its stderr.
    async fn run_to_exit(&self, args: &[&str], env: &[(&str, &str)]) -> (i32, String) {
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

    async fn produce(&self, records: &[Record]) {
        let producer: FutureProducer = ClientConfig::new()
            .set("bootstrap.servers", &services().kafka)
            .set("enable.idempotence", "true")
            .set("linger.ms", "0")
            .create()
            .unwrap();
        let sends = records.iter().map(|r| {
            let headers = r.headers.iter().fold(OwnedHeaders::new(), |h, (key, value)| {
                h.insert(Header { key, value: Some(value.as_str()) })
            });
            let mut out = FutureRecord::<String, String>::to(&self.topic).key(&r.key).headers(headers);
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

    async fn fund(&self, customer: &str, cents: i64) {
        self.db
            .client()
            .await
            .execute("INSERT INTO wallets (customer_id, balance_cents) VALUES ($1, $2)", &[&customer, &cents])
            .await
            .unwrap();
    }

    /// The one bigint `sql` returns.
    async fn scalar(&self, sql: &str) -> i64 {
        self.db.client().await.query_one(sql, &[]).await.unwrap_or_else(|e| panic!("{sql}: {e:?}")).get(0)
    }

    async fn balance(&self, customer: &str) -> i64 {
        let client = self.db.client().await;
        let sql = "SELECT balance_cents FROM wallets WHERE customer_id = $1";
        client.query_one(sql, &[&customer]).await.unwrap().get(0)
    }

    async fn outcome(&self, event_id: &str) -> Option<(String, Option<String>)> {
        let client = self.db.client().await;
        let sql = "SELECT outcome, detail FROM processed_events WHERE event_id = $1";
        client.query_opt(sql, &[&event_id]).await.unwrap().map(|row| (row.get(0), row.get(1)))
    }

    /// What the consumer group has committed, over all partitions: how many records it is done
    /// with (what `kafka-consumer-groups --describe` shows an operator).
    fn committed(&self) -> Committed {
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", &services().kafka)
            .set("group.id", &self.group)
            .create()
            .unwrap();
        Committed { consumer, topic: self.topic.clone(), partitions: self.partitions }
    }

    fn dead_letters(&self) -> rdkafka::consumer::StreamConsumer {
        consumer(&[&self.dead_letter_topic])
    }
}

struct Committed {
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

    async fn wait_for(&self, expected: i64) {
        wait_until(format!("the group to commit {expected} records"), async || self.total() == expected)
            .await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_duplicate_delivery_is_applied_once_across_a_restart() {
    // given a funded wallet and one OrderPlaced record delivered twice
    let l = Ledger::new(1, &[]).await;
    l.fund("alice", 1_000).await;
    let record = order_placed(1, "alice", 300);
    l.produce(&[record.clone(), record.clone()]).await;
    let committed = l.committed();

    // when the ledger consumes both copies
    let mut ledger = l.start("ledger");
    committed.wait_for(2).await;

    // then the event was applied once
    let applied_once = async || {
        assert_eq!(l.balance("alice").await, 700);
        assert_eq!(l.scalar("SELECT count(*) FROM ledger_entries").await, 1);
        assert_eq!(l.scalar("SELECT count(*) FROM processed_events").await, 1);
        let completed = "SELECT count(*) FROM outbox_events WHERE event_type = 'PaymentCompleted' \
                         AND aggregate_type = 'payment' AND aggregate_id = '500001'";
        assert_eq!(l.scalar(completed).await, 1);
        assert_eq!(l.scalar("SELECT count(*) FROM outbox_events").await, 1);
        assert_eq!(l.outcome("1").await, Some(("debited".into(), None)));
    };
    applied_once().await;

    // when it is stopped, the record is delivered a third time, and it starts again
    assert_eq!(ledger.terminate(EXIT_LIMIT), Some(0), "{}", ledger.log_text());
    l.produce(&[record]).await;
    let _ledger = l.start("ledger");
    committed.wait_for(3).await;

    // then nothing changed
    applied_once().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn two_consumers_debiting_one_wallet_at_once_never_overdraw_it() {
    // given one wallet of 10,000 cents and two ledger processes in one group on 4 partitions
    let l = Ledger::new(4, &[]).await;
    l.fund("bob", 10_000).await;
    let first = l.start("first");
    let second = l.start("second");
    // tansu 0.6 answers DescribeGroups without the group, so the membership an operator would
    // read with kafka-consumer-groups is not observable here: the ledgers' own report is
    wait_until("both ledgers to be assigned partitions", async || {
        first.log_text().contains("partitions assigned") && second.log_text().contains("partitions assigned")
    })
    .await;

    // when 100 orders of 300 cents each arrive, spread over the partitions
    let records: Vec<Record> =
        (1..=100).map(|i| order_placed(i, "bob", 300).on_partition(i as i32 % 4)).collect();
    l.produce(&records).await;
    wait_until("every event to be processed", async || {
        l.scalar("SELECT count(*) FROM processed_events").await == 100
    })
    .await;

    // then exactly what the balance allows was debited, and the rest declined
    let outcome = |o: &str| format!("SELECT count(*) FROM processed_events WHERE outcome = '{o}'");
    assert_eq!(l.scalar(&outcome("debited")).await, 33);
    assert_eq!(l.scalar(&outcome("declined")).await, 67);
    assert_eq!(l.balance("bob").await, 100);
    assert_eq!(l.scalar("SELECT coalesce(sum(amount_cents), 0)::bigint FROM ledger_entries").await, 9_900);
    let events = |t: &str| format!("SELECT count(*) FROM outbox_events WHERE event_type = '{t}'");
    assert_eq!(l.scalar(&events("PaymentCompleted")).await, 33);
    assert_eq!(l.scalar(&events("PaymentDeclined")).await, 67);
    let declined_for_funds = "SELECT count(*) FROM processed_events WHERE outcome = 'declined' \
                              AND detail LIKE 'insufficient balance%'";
    assert_eq!(l.scalar(declined_for_funds).await, 67);
    assert!(consume(&l.dead_letters(), 1, LINGER).await.is_empty(), "nothing may be dead-lettered");
    for ledger in [&first, &second] {
        let log = ledger.log_text();
        assert!(
            log.contains("debited") || log.contains("payment declined"),
            "both ledgers applied events:\n{log}"
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn poison_records_are_dead_lettered_with_their_reason_and_headers_and_the_consumer_moves_on() {
    // given four records that can never be applied, each followed by a valid one
    let l = Ledger::new(1, &[]).await;
    l.fund("carol", 10_000).await;
    let not_json = Record { payload: Some("{not json".into()), ..order_placed(1, "carol", 100) };
    let mut without_payment_id: serde_json::Value =
        serde_json::from_str(order_placed(3, "carol", 100).payload.as_deref().unwrap()).unwrap();
    without_payment_id.as_object_mut().unwrap().remove("payment_id");
    let without_payment_id =
        Record { payload: Some(without_payment_id.to_string()), ..order_placed(3, "carol", 100) };
    let unknown_type = order_placed(5, "carol", 100).with_header("event_type", "OrderShipped");
    let without_id = order_placed(7, "carol", 100).without_header("id");
    let poison = [
        (not_json, "not JSON"),
        (without_payment_id, "payment_id"),
        (unknown_type, "OrderShipped"),
        (without_id, "header id"),
    ];
    for (i, (record, _)) in poison.iter().enumerate() {
        let valid = order_placed(2 * i as i64 + 2, "carol", 100);
        l.produce(std::slice::from_ref(record)).await;
        l.produce(&[valid]).await;
    }

    // when the ledger consumes them
    let _ledger = l.start("ledger");
    l.committed().wait_for(8).await;

    // then each poison record is in the dead-letter topic as it was, with the reason
    let dead_letters = consume(&l.dead_letters(), 5, LINGER).await;
    assert_eq!(dead_letters.len(), 4, "{dead_letters:#?}");
    for (record, expected_reason) in &poison {
        let traceparent = record.header("traceparent").unwrap();
        let dead = dead_letters
            .iter()
            .find(|d| d.header("traceparent") == Some(traceparent))
            .unwrap_or_else(|| panic!("no dead letter for {record:?}"));
        let reason = dead.header("dlq_reason").unwrap();
        assert!(reason.contains(expected_reason), "dlq_reason {reason:?} should name {expected_reason:?}");
        assert_eq!(dead.key.as_deref(), Some(record.key.as_str()));
        assert_eq!(dead.payload, record.payload);
        for (name, value) in &record.headers {
            assert_eq!(dead.header(name), Some(value.as_str()), "original header {name}");
        }
        assert_eq!(dead.header("dlq_attempts"), Some("1"));
        assert_eq!(dead.header("dlq_topic"), Some(l.topic.as_str()));
        assert_eq!(dead.header("dlq_partition"), Some("0"));
        let offset: i64 = dead.header("dlq_offset").unwrap().parse().unwrap();
        let event_id = record.header("id").map_or(format!("{}/0/{offset}", l.topic), str::to_string);
        let (outcome, detail) = l.outcome(&event_id).await.expect("an inbox row for the dead letter");
        assert_eq!((outcome.as_str(), detail.as_deref()), ("dead_lettered", Some(reason)));
    }

    // and every valid record after them was applied
    assert_eq!(l.scalar("SELECT count(*) FROM ledger_entries").await, 4);
    assert_eq!(l.balance("carol").await, 10_000 - 4 * 100);
    assert_eq!(l.scalar("SELECT count(*) FROM processed_events WHERE outcome = 'debited'").await, 4);
}

/// A test transaction holding `customer`'s wallet row lock until it ends.
async fn lock_wallet<'c>(
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
async fn ledger_waiting_since(watcher: &tokio_postgres::Client, l: &Ledger) -> Option<std::time::SystemTime> {
    let sql = "SELECT xact_start FROM pg_stat_activity WHERE datname = $1 AND application_name = 'ledger' \
               AND wait_event_type = 'Lock'";
    watcher.query_opt(sql, &[&l.db.name]).await.unwrap().map(|row| row.get(0))
}

/// Lock timeouts of 200 ms, three attempts.
const LOCK_SETTINGS: [(&str, &str); 4] = [
    ("lock_timeout_ms", "200"),
    ("max_attempts", "3"),
    ("initial_backoff_ms", "50"),
    ("max_backoff_ms", "200"),
];

#[tokio::test(flavor = "multi_thread")]
async fn a_lock_held_past_max_attempts_dead_letters_and_a_lock_released_in_time_is_retried_and_applied() {
    // given a ledger with lock_timeout_ms = 200 and max_attempts = 3, and a wallet held locked
    let l = Ledger::new(1, &LOCK_SETTINGS).await;
    l.fund("dave", 1_000).await;
    let _ledger = l.start("ledger");
    let mut client = l.db.client().await;
    let lock = lock_wallet(&mut client, "dave").await;

    // when an order for it arrives and the lock is held through every attempt
    l.produce(&[order_placed(1, "dave", 300)]).await;
    let dead_letters = l.dead_letters();
    let dead = consume(&dead_letters, 1, IDLE).await;

    // then it is dead-lettered naming the lock, and nothing was debited
    assert_eq!(dead.len(), 1);
    let reason = dead[0].header("dlq_reason").unwrap();
    assert!(reason.starts_with("lock timeout after 3 attempts"), "{reason}");
    assert_eq!(dead[0].header("dlq_attempts"), Some("3"));
    lock.rollback().await.unwrap();
    l.committed().wait_for(1).await;
    assert_eq!(l.outcome("1").await.map(|o| o.0).as_deref(), Some("dead_lettered"));
    assert_eq!(l.balance("dave").await, 1_000);
    assert_eq!(l.scalar("SELECT count(*) FROM ledger_entries").await, 0);

    // when the next order finds the wallet locked, and the lock is released after one failed
    // attempt, while the second waits
    let lock = lock_wallet(&mut client, "dave").await;
    l.produce(&[order_placed(2, "dave", 300)]).await;
    let watcher = l.db.client().await;
    let mut first_attempt = None;
    wait_until("the ledger to wait for the lock", async || {
        first_attempt = ledger_waiting_since(&watcher, &l).await;
        first_attempt.is_some()
    })
    .await;
    wait_until("the ledger to wait for the lock in a second attempt", async || {
        ledger_waiting_since(&watcher, &l).await.is_some_and(|since| Some(since) > first_attempt)
    })
    .await;
    lock.commit().await.unwrap();

    // then it is applied, once, and not dead-lettered
    l.committed().wait_for(2).await;
    assert_eq!(l.outcome("2").await.map(|o| o.0).as_deref(), Some("debited"));
    assert_eq!(l.balance("dave").await, 700);
    assert_eq!(l.scalar("SELECT count(*) FROM ledger_entries").await, 1);
    assert!(consume(&dead_letters, 1, LINGER).await.is_empty(), "only the first order is dead-lettered");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_lost_database_session_is_reconnected_and_the_record_retried_without_using_up_an_attempt() {
    // given a ledger that dead-letters at the first lock timeout, waiting for a locked wallet
    let l = Ledger::new(1, &[("max_attempts", "1"), ("lock_timeout_ms", "10000")]).await;
    l.fund("frank", 1_000).await;
    let _ledger = l.start("ledger");
    let mut client = l.db.client().await;
    let watcher = l.db.client().await;
    let lock = lock_wallet(&mut client, "frank").await;
    l.produce(&[order_placed(1, "frank", 400)]).await;
    let waiting_pid = async || {
        let sql = "SELECT pid FROM pg_stat_activity WHERE datname = $1 AND application_name = 'ledger' \
                   AND wait_event_type = 'Lock'";
        watcher.query_opt(sql, &[&l.db.name]).await.unwrap().map(|row| row.get::<_, i32>(0))
    };
    let mut first = None;
    wait_until("the ledger to wait for the lock", async || {
        first = waiting_pid().await;
        first.is_some()
    })
    .await;

    // when its session is terminated mid-transaction
    let terminated: bool =
        watcher.query_one("SELECT pg_terminate_backend($1)", &[&first.unwrap()]).await.unwrap().get(0);
    assert!(terminated);

    // then it reconnects and tries the same record again, and it is applied once the lock is free
    wait_until("a new ledger session to wait for the lock", async || {
        waiting_pid().await.is_some_and(|pid| Some(pid) != first)
    })
    .await;
    lock.commit().await.unwrap();
    l.committed().wait_for(1).await;
    assert_eq!(l.outcome("1").await.map(|o| o.0).as_deref(), Some("debited"));
    assert_eq!(l.balance("frank").await, 600);
    assert!(consume(&l.dead_letters(), 1, LINGER).await.is_empty(), "an outage is not an attempt");
}

/// Asserts that each of `events` records was applied once, with `initial` cents in every wallet
/// at the start; returns how many were debited and declined.
async fn assert_each_applied_once(l: &Ledger, events: i64, initial: i64) -> (i64, i64) {
    let positions = "SELECT count(DISTINCT (\"partition\", \"offset\")) FROM processed_events";
    assert_eq!(l.scalar(positions).await, events, "one inbox row per record");
    let debited = l.scalar("SELECT count(*) FROM processed_events WHERE outcome = 'debited'").await;
    let declined = l.scalar("SELECT count(*) FROM processed_events WHERE outcome = 'declined'").await;
    assert_eq!(debited + declined, events, "nothing dead-lettered");
    assert_eq!(l.scalar("SELECT count(*) FROM ledger_entries").await, debited);
    let follow_ups = |t: &str| format!("SELECT count(*) FROM outbox_events WHERE event_type = '{t}'");
    assert_eq!(l.scalar(&follow_ups("PaymentCompleted")).await, debited);
    assert_eq!(l.scalar(&follow_ups("PaymentDeclined")).await, declined);
    // every wallet holds its initial balance less its own ledger entries
    let wrong_balances = format!(
        "SELECT count(*) FROM wallets w WHERE w.balance_cents <> {initial} - \
         (SELECT coalesce(sum(amount_cents), 0) FROM ledger_entries e WHERE e.customer_id = w.customer_id)"
    );
    assert_eq!(l.scalar(&wrong_balances).await, 0, "a wallet disagrees with its ledger entries");
    (debited, declined)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_consumer_killed_mid_stream_loses_nothing_and_applies_nothing_twice() {
    // given 100 wallets and 2,000 orders (some beyond the balance) over 4 partitions
    const CUSTOMERS: i64 = 100;
    const EVENTS: i64 = 2_000;
    const INITIAL: i64 = 5_000;
    let l = Ledger::new(4, &[]).await;
    let wallets = format!(
        "INSERT INTO wallets (customer_id, balance_cents) \
         SELECT 'c' || g, {INITIAL} FROM generate_series(0, {CUSTOMERS} - 1) g"
    );
    l.db.client().await.batch_execute(&wallets).await.unwrap();
    let records: Vec<Record> = (1..=EVENTS)
        .map(|i| {
            order_placed(i, &format!("c{}", i % CUSTOMERS), 50 + (i * 37) % 500).on_partition((i % 4) as i32)
        })
        .collect();
    l.produce(&records).await;

    // when the ledger is killed with SIGKILL while a record is in hand (blocked on a locked
    // wallet), and then four times more while it consumes, and restarted each time
    let mut client = l.db.client().await;
    let watcher = l.db.client().await;
    let lock = lock_wallet(&mut client, "c7").await;
    let mut ledger = l.start("ledger");
    wait_until("the ledger to wait for the locked wallet", async || {
        ledger_waiting_since(&watcher, &l).await.is_some()
    })
    .await;
    ledger.kill9();
    lock.rollback().await.unwrap();
    ledger = l.start("ledger");
    let processed = async || l.scalar("SELECT count(*) FROM processed_events").await;
    for kill in 1..=4 {
        let threshold = kill * EVENTS / 5;
        wait_until_within(Duration::from_secs(180), format!("{threshold} events processed"), async || {
            processed().await >= threshold
        })
        .await;
        ledger.kill9();
        ledger = l.start("ledger");
    }
    wait_until_within(Duration::from_secs(180), "every event processed", async || {
        processed().await == EVENTS
    })
    .await;
    l.committed().wait_for(EVENTS).await;

    // then every event was applied once: one inbox row, one effect, one follow-up event each
    let (debited, declined) = assert_each_applied_once(&l, EVENTS, INITIAL).await;
    assert!(declined > 0 && debited > 0, "the workload must exercise both outcomes");
    let log = std::fs::read_to_string(l.dir.path().join("ledger.log")).unwrap();
    let redelivered = log.matches("duplicate delivery skipped").count();
    eprintln!(
        "{redelivered} record(s) redelivered after the kills, skipped; {debited} debited, {declined} declined"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn replay_dlq_applies_a_dead_letter_once_and_a_replay_of_an_applied_event_changes_nothing() {
    // given an order dead-lettered because its wallet stayed locked
    let l = Ledger::new(1, &LOCK_SETTINGS).await;
    l.fund("erin", 1_000).await;
    let _ledger = l.start("ledger");
    let mut client = l.db.client().await;
    let lock = lock_wallet(&mut client, "erin").await;
    let order = order_placed(1, "erin", 250);
    l.produce(std::slice::from_ref(&order)).await;
    assert_eq!(consume(&l.dead_letters(), 1, IDLE).await.len(), 1);
    l.committed().wait_for(1).await;
    lock.rollback().await.unwrap();

    // when the dead letter is replayed
    let (code, log) = l.run_to_exit(&["replay-dlq"], &[]).await;
    assert_eq!(code, 0, "{log}");

    // then the order is applied once, from a copy without the dead-letter headers
    l.committed().wait_for(2).await;
    let applied_once = async || {
        assert_eq!(l.outcome("1").await.map(|o| o.0).as_deref(), Some("debited"));
        assert_eq!(l.balance("erin").await, 750);
        assert_eq!(l.scalar("SELECT count(*) FROM ledger_entries").await, 1);
        assert_eq!(
            l.scalar("SELECT count(*) FROM outbox_events WHERE event_type = 'PaymentCompleted'").await,
            1
        );
    };
    applied_once().await;
    let on_topic = consume(&consumer(&[&l.topic]), 2, IDLE).await;
    let replayed = &on_topic[1];
    assert!(replayed.headers.iter().all(|(k, _)| !k.starts_with("dlq_")), "{replayed:?}");
    for (name, value) in &order.headers {
        assert_eq!(replayed.header(name), Some(value.as_str()), "original header {name}");
    }
    assert_eq!(replayed.payload, order.payload);

    // when the same dead letter is replayed again (by a replay in another group)
    let other_group = format!("other-{}", random_suffix());
    let (code, log) = l.run_to_exit(&["replay-dlq"], &[("LEDGER__CONSUMER__GROUP_ID", &other_group)]).await;
    assert_eq!(code, 0, "{log}");
    l.committed().wait_for(3).await;

    // then nothing changed
    applied_once().await;

    // and a replay in the first group again finds nothing left to send: it committed
    let (code, log) = l.run_to_exit(&["replay-dlq"], &[]).await;
    assert_eq!(code, 0, "{log}");
    assert_eq!(consume(&consumer(&[&l.topic]), 4, LINGER).await.len(), 3);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_config_error_names_the_field_and_missing_tables_name_the_sql_file() {
    // given a configuration with max_attempts = 0, in the file or from the environment
    let l = Ledger::new(1, &[("max_attempts", "0")]).await;
    let (code, log) = l.run_to_exit(&["run"], &[]).await;
    assert_eq!(code, 2, "{log}");
    assert!(log.contains("error: invalid configuration: consumer.max_attempts: must be >= 1"), "{log}");
    l.write_config(&[]);
    let (code, log) = l.run_to_exit(&["run"], &[("LEDGER__CONSUMER__LOCK_TIMEOUT_MS", "0")]).await;
    assert_eq!(code, 2, "{log}");
    assert!(log.contains("consumer.lock_timeout_ms"), "{log}");

    // given a database with the relay's schema but not the ledger's tables
    let bare = Ledger::on(TestDb::new().await, 1, &[]).await;
    let (code, log) = bare.run_to_exit(&["run"], &[]).await;
    assert_eq!(code, 1, "{log}");
    assert!(log.contains("sql/examples/ledger.sql") && log.contains("wallets"), "{log}");
}
