//! The whole chain under faults: clients placing orders through the order service with retries
//! and lost answers, the relay streaming the outbox to Kafka, the ledger applying each order
//! once, while the relay and the ledger are killed with SIGKILL again and again. What a payments
//! team cares about is checked at the end: one order per key, one ledger row per applied order,
//! no balance below zero, every event applied once or dead-lettered with a reason.

use crate::common;

use std::collections::HashSet;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::service::{OrdersService, ServiceProcess, apply_examples, workspace_bin};
use common::*;

const ORDERS: i64 = 600;
const CUSTOMERS: i64 = 20;
const WALLET_CENTS: i64 = 40_000;
const KILLS: usize = 10;

struct Chain {
    relay: Setup,
    prefix: String,
}

impl Chain {
    async fn new() -> Chain {
        let prefix = format!("c{}", random_suffix());
        let template = format!("{prefix}.{{aggregate_type}}");
        let relay = Setup::create(&services().kafka, "", false, |slot| {
            RelayToml::replication(slot).set("outbox", "topic_template", template)
        })
        .await;
        for (topic, partitions) in [("order", 4), ("payment", 4), ("order.dlq", 1)] {
            create_topic(&format!("{prefix}.{topic}"), partitions).await;
        }
        let client = relay.db.client().await;
        apply_examples(&client, &["orders", "idempotency", "ledger", "roles"]).await;
        client
            .execute(
                "INSERT INTO wallets (customer_id, balance_cents) \
                 SELECT 'customer-' || n, $1 FROM generate_series(0, $2::bigint - 1) n",
                &[&WALLET_CENTS, &CUSTOMERS],
            )
            .await
            .unwrap();
        Chain { relay, prefix }
    }

    fn start_ledger(&self, n: usize) -> ServiceProcess {
        let (host, port, _) = self.relay.db.pg_parts();
        let user = "ledger_service";
        let toml = format!(
            "[postgres]\nhost = \"{host}\"\nport = {port}\nuser = \"{user}\"\ndatabase = \"{}\"\nsslmode = \"disable\"\n\
             [kafka]\nbrokers = [\"{}\"]\nclient_id = \"ledger\"\n\
             [kafka.properties]\n\"session.timeout.ms\" = \"6000\"\n\"heartbeat.interval.ms\" = \"500\"\n\
             [consumer]\ntopic = \"{p}.order\"\ngroup_id = \"{p}-ledger\"\ndead_letter_topic = \"{p}.order.dlq\"\n",
            self.relay.db.name,
            services().kafka,
            p = self.prefix
        );
        let dir = self.relay.dir.path();
        let config = dir.join("ledger.toml");
        std::fs::write(&config, toml).unwrap();
        let log = dir.join(format!("ledger-{n}.log"));
        ServiceProcess::spawn("ledger", &["run", "--config", config.to_str().unwrap()], &[], &log)
    }

    async fn count(&self, sql: &str) -> i64 {
        self.relay.db.client().await.query_one(sql, &[]).await.unwrap().get(0)
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn orders_with_lost_answers_through_relay_and_ledger_kills_are_charged_exactly_once() {
    // given the relay, the order service and the ledger running on one database, each service
    // as its least-privilege role (sql/examples/roles.sql)
    let chain = Chain::new().await;
    let mut relay = chain.relay.start("relay-0");
    relay.wait_ready("active").await;
    let orders = OrdersService::start_as(
        &chain.relay.db,
        chain.relay.dir.path(),
        "orders",
        Some("orders_service"),
        "",
    )
    .await;
    let mut ledger = chain.start_ledger(0);

    // when clients place 600 orders, a fifth of the answers lost on the way and retried with
    // the same key, while the relay and the ledger are each killed with SIGKILL 5 times
    let load = Command::new(workspace_bin("orders-load"))
        .args(["--url", &format!("http://127.0.0.1:{}", orders.port), "--orders", &ORDERS.to_string()])
        .args(["--customers", &CUSTOMERS.to_string(), "--concurrency", "4", "--rate", "60"])
        .args(["--lose-responses", "0.2", "--key-prefix", &chain.prefix])
        .arg("--hs256-secret-file")
        .arg(orders.hs256_secret_file())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    for kill in 0..KILLS {
        tokio::time::sleep(Duration::from_millis(900)).await;
        if kill % 2 == 0 {
            relay.kill9();
            relay = chain.relay.start(&format!("relay-{kill}"));
        } else {
            ledger.kill9();
            ledger = chain.start_ledger(kill);
        }
    }
    let output = load.wait_with_output().unwrap();
    let summary: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    eprintln!("orders-load: {summary}");

    // then every client got its order, the same one on every retry
    assert_eq!(summary["gave_up"], 0, "{summary}");
    assert_eq!(summary["inconsistent"], 0, "{summary}");
    assert!(summary["lost_injected"].as_u64().unwrap() > 0, "no answer was lost: the retries proved nothing");
    // and there is one order, one OrderPlaced event per key
    assert_eq!(chain.count("SELECT count(*) FROM orders").await, ORDERS);
    assert_eq!(chain.count("SELECT count(*) FROM idempotency_keys WHERE state = 'completed'").await, ORDERS);
    assert_eq!(
        chain.count("SELECT count(*) FROM outbox_events WHERE event_type = 'OrderPlaced'").await,
        ORDERS
    );

    // and the ledger processes every event once: a debit or a decline, or a dead letter
    let processed = "SELECT count(*) FROM processed_events";
    wait_until(format!("the ledger to process {ORDERS} events"), async || {
        chain.count(processed).await == ORDERS
    })
    .await;
    let debited = chain.count("SELECT count(*) FROM processed_events WHERE outcome = 'debited'").await;
    let declined = chain.count("SELECT count(*) FROM processed_events WHERE outcome = 'declined'").await;
    let dead = chain.count("SELECT count(*) FROM processed_events WHERE outcome = 'dead_lettered'").await;
    eprintln!("ledger: {debited} debited, {declined} declined, {dead} dead-lettered");
    assert_eq!(debited + declined + dead, ORDERS);
    assert_eq!(dead, 0, "a valid order was dead-lettered; ledger log:\n{}", ledger.log_text());
    assert_eq!(chain.count("SELECT count(*) FROM ledger_entries").await, debited);
    assert_eq!(chain.count("SELECT count(DISTINCT payment_id) FROM ledger_entries").await, debited);
    assert!(debited > 0 && declined > 0, "the load should both debit and exhaust wallets");

    // and no wallet is below zero, each debited by exactly its ledger rows
    assert_eq!(chain.count("SELECT count(*) FROM wallets WHERE balance_cents < 0").await, 0);
    let disagreeing = "SELECT count(*) FROM wallets w WHERE w.balance_cents <> $1 - \
         (SELECT coalesce(sum(amount_cents), 0) FROM ledger_entries l WHERE l.customer_id = w.customer_id)::bigint";
    let client = chain.relay.db.client().await;
    let wrong: i64 = client.query_one(disagreeing, &[&WALLET_CENTS]).await.unwrap().get(0);
    assert_eq!(wrong, 0, "a wallet's balance disagrees with its ledger rows");
    // and every order's outcome reaches Kafka as a payment event, once each
    let payments = consumer(&[&format!("{}.payment", chain.prefix)]);
    let records = workload::consume_unique(&payments, ORDERS as usize, IDLE, LINGER).await;
    let ids: HashSet<_> = records.iter().map(|r| r.header("id").unwrap().to_string()).collect();
    assert_eq!(ids.len() as i64, ORDERS);
    eprintln!("payment events: {} records for {} events", records.len(), ids.len());
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0), "{}", relay.log_text());
    assert_eq!(ledger.terminate(EXIT_LIMIT), Some(0), "{}", ledger.log_text());
}
