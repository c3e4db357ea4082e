//! The order service (`services/orders`) over HTTP against a real PostgreSQL: the
//! Idempotency-Key rules, each as its own test, with the service as a process that is restarted,
//! crashed mid-request and run as two replicas.

use crate::common;

use std::thread;

use common::service::{OrdersService, apply_examples};
use common::*;
use tokio_postgres::Client;

const BODY: &str = r#"{"customer_id": "customer-1", "total_cents": 1999}"#;

/// One test's shop: a database with the service's tables, and a directory for its files
/// (tests/orders_security.rs shares it).
pub(crate) struct Shop {
    pub(crate) db: TestDb,
    pub(crate) client: Client,
    pub(crate) dir: tempfile::TempDir,
}

impl Shop {
    pub(crate) async fn new() -> Shop {
        let db = TestDb::new().await;
        let client = db.client().await;
        apply_examples(&client, &["orders", "idempotency"]).await;
        Shop { db, client, dir: tempfile::tempdir().unwrap() }
    }

    /// `extra` is appended inside `[http]` until its first table header.
    pub(crate) async fn start(&self, name: &str, extra: &str) -> OrdersService {
        OrdersService::start(&self.db, self.dir.path(), name, extra).await
    }

    pub(crate) async fn count(&self, sql: &str) -> i64 {
        self.client.query_one(sql, &[]).await.unwrap().get(0)
    }

    /// (orders, OrderPlaced events, idempotency keys)
    pub(crate) async fn written(&self) -> (i64, i64, i64) {
        let (orders, events) = self.orders_and_events().await;
        (orders, events, self.count("SELECT count(*) FROM idempotency_keys").await)
    }

    /// (orders, OrderPlaced events)
    async fn orders_and_events(&self) -> (i64, i64) {
        let orders = self.count("SELECT count(*) FROM orders").await;
        let events = self.count("SELECT count(*) FROM outbox_events WHERE event_type = 'OrderPlaced'").await;
        (orders, events)
    }

    /// The fingerprint the service stores for `body`: placed once under a throwaway key.
    async fn fingerprint_of(&self, body: &str, service: &OrdersService) -> Vec<u8> {
        assert_eq!(service.order(Some("k-fingerprint"), body).unwrap().status, 201);
        let row = self
            .client
            .query_one("SELECT fingerprint FROM idempotency_keys WHERE key = 'k-fingerprint'", &[])
            .await
            .unwrap();
        self.client.batch_execute("DELETE FROM orders; DELETE FROM outbox_events").await.unwrap();
        row.get(0)
    }

    /// The key's (state, lease_token).
    async fn key_state(&self, key: &str) -> Option<(String, i64)> {
        let row = self
            .client
            .query_opt("SELECT state, lease_token FROM idempotency_keys WHERE key = $1", &[&key])
            .await
            .unwrap();
        row.map(|r| (r.get(0), r.get(1)))
    }
}

/// POST /orders with BODY and `key` as customer-1, from a thread, so the test can act meanwhile.
fn post_in_thread(service: &OrdersService, key: &'static str) -> thread::JoinHandle<Option<http::Answer>> {
    let (port, bearer) = (service.port, format!("Bearer {}", service.token("customer-1", 3600)));
    thread::spawn(move || {
        http::post(port, "/orders", &[("Idempotency-Key", key), ("Authorization", &bearer)], BODY)
    })
}

#[tokio::test(flavor = "multi_thread")]
async fn a_request_without_a_key_or_with_a_bad_body_is_refused_and_writes_nothing() {
    // given the service
    let shop = Shop::new().await;
    let service = shop.start("orders", "").await;

    // when an order comes without an Idempotency-Key, then with a body missing a field
    let no_key = service.order(None, BODY).unwrap();
    let bad_body = service.order(Some("k-1"), r#"{"customer_id": "customer-1"}"#).unwrap();

    // then both are 400 saying what to send, and nothing is written
    assert_eq!(no_key.status, 400, "{no_key:?}");
    assert!(
        no_key.json()["error"].as_str().unwrap().contains("Idempotency-Key header is required"),
        "{no_key:?}"
    );
    assert_eq!(bad_body.status, 400, "{bad_body:?}");
    assert!(bad_body.json()["error"].as_str().unwrap().contains("total_cents"), "{bad_body:?}");
    assert_eq!(shop.orders_and_events().await, (0, 0));
}

#[tokio::test(flavor = "multi_thread")]
async fn the_same_key_and_body_get_the_same_answer_and_one_order() {
    // given the service and one placed order
    let shop = Shop::new().await;
    let service = shop.start("orders", "").await;
    let first = service.order(Some("k-same"), BODY).unwrap();
    assert_eq!(first.status, 201, "{first:?}");

    // when the client retries with the same key and the same request (spaced and ordered
    // differently)
    let again = service.order(Some("k-same"), r#"{"total_cents":1999,"customer_id":"customer-1"}"#).unwrap();

    // then it gets the same status and body, marked as a replay, and there is one order and one event
    assert_eq!((again.status, again.json()), (201, first.json()));
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(first.header("idempotent-replayed"), None);
    assert_eq!(shop.orders_and_events().await, (1, 1));
    let order_id = first.json()["order_id"].as_i64().unwrap();
    let event = shop
        .client
        .query_one("SELECT aggregate_type, aggregate_id, payload FROM outbox_events", &[])
        .await
        .unwrap();
    assert_eq!(
        (event.get::<_, String>(0), event.get::<_, String>(1)),
        ("order".into(), order_id.to_string())
    );
    assert_eq!(event.get::<_, serde_json::Value>(2), first.json());
    // and /metrics counts one creation and one replay
    let (_, scrape) = http::get(service.port, "/metrics").unwrap();
    assert_eq!(http::sample(&scrape, "orders_requests_total{outcome=\"created\"}"), Some(1.0), "{scrape}");
    assert_eq!(http::sample(&scrape, "orders_requests_total{outcome=\"replayed\"}"), Some(1.0), "{scrape}");
}

#[tokio::test(flavor = "multi_thread")]
async fn the_same_key_with_another_body_is_refused_with_422() {
    // given one placed order
    let shop = Shop::new().await;
    let service = shop.start("orders", "").await;
    assert_eq!(service.order(Some("k-reused"), BODY).unwrap().status, 201);

    // when the key comes back with another amount
    let other =
        service.order(Some("k-reused"), r#"{"customer_id": "customer-1", "total_cents": 2}"#).unwrap();

    // then 422 saying the key belongs to another request, and still one order
    assert_eq!(other.status, 422, "{other:?}");
    assert!(other.json()["error"].as_str().unwrap().contains("different request"), "{other:?}");
    assert_eq!(shop.orders_and_events().await, (1, 1));
}

#[tokio::test(flavor = "multi_thread")]
async fn ten_concurrent_requests_with_one_key_on_two_replicas_create_one_order_and_one_event() {
    // given two replicas of the service on one database
    let shop = Shop::new().await;
    let (a, b) = (shop.start("a", "").await, shop.start("b", "").await);
    let replicas = [a.port, b.port];
    let bearer = format!("Bearer {}", a.token("customer-1", 3600));

    // when 10 requests with one key arrive at once, 5 at each replica
    let answers: Vec<_> = (0..10)
        .map(|i| {
            let (port, bearer) = (replicas[i % 2], bearer.clone());
            thread::spawn(move || {
                http::post(
                    port,
                    "/orders",
                    &[("Idempotency-Key", "k-race"), ("Authorization", &bearer)],
                    BODY,
                )
            })
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(|t| t.join().unwrap())
        .collect();
    let logs = || format!("a:\n{}\nb:\n{}", a.process.log_text(), b.process.log_text());
    let answers: Vec<_> =
        answers.into_iter().map(|a| a.unwrap_or_else(|| panic!("no answer; {}", logs()))).collect();

    // then one order and one event; every 201 is the same answer; anything else is a 409 with
    // Retry-After (a request that waited longer than idempotency.wait_ms)
    assert_eq!(shop.orders_and_events().await, (1, 1));
    let created: Vec<_> = answers.iter().filter(|a| a.status == 201).collect();
    assert!(!created.is_empty(), "{answers:?}");
    assert!(created.iter().all(|a| a.json() == created[0].json()), "{answers:?}");
    assert_eq!(
        answers.iter().filter(|a| a.header("idempotent-replayed").is_none() && a.status == 201).count(),
        1
    );
    for busy in answers.iter().filter(|a| a.status != 201) {
        assert_eq!(busy.status, 409, "{busy:?}");
        assert!(busy.header("retry-after").is_some(), "{busy:?}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_restart_between_retries_replays_the_stored_answer() {
    // given an order placed, and the service then killed (SIGKILL) and started again
    let shop = Shop::new().await;
    let mut service = shop.start("first", "").await;
    let first = service.order(Some("k-restart"), BODY).unwrap();
    assert_eq!(first.status, 201);
    service.process.kill9();
    let service =
        OrdersService::start_on(&service.config, service.port, &shop.dir.path().join("second.log")).await;

    // when the client retries
    let again = service.order(Some("k-restart"), BODY).unwrap();

    // then the answer is the stored one, from the database, and there is still one order
    assert_eq!((again.status, again.json()), (201, first.json()));
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(shop.orders_and_events().await, (1, 1));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_crash_after_the_commit_before_the_answer_replays_the_order_to_the_retry() {
    // given a service that aborts right after the order's transaction commits, before answering
    let shop = Shop::new().await;
    let mut crashing = shop.start("crashing", "[faults]\nabort_after_write = true\n").await;

    // when a request reaches it: the order exists, the client hears nothing
    assert_eq!(crashing.order(Some("k-unanswered"), BODY), None, "the crashing service answered");
    wait_until("the service to die", async || crashing.process.exited().is_some()).await;
    assert_eq!(shop.orders_and_events().await, (1, 1));

    // then the client's retry, on a replica, gets that order, and no second one is made
    let healthy = shop.start("healthy", "").await;
    let retry = healthy.order(Some("k-unanswered"), BODY).unwrap();
    assert_eq!((retry.status, retry.header("idempotent-replayed")), (201, Some("true")), "{retry:?}");
    let order_id: i64 = shop.client.query_one("SELECT id FROM orders", &[]).await.unwrap().get(0);
    assert_eq!(retry.json()["order_id"], order_id);
    assert_eq!(shop.orders_and_events().await, (1, 1));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_crash_mid_request_is_taken_over_after_the_lease_and_charged_once() {
    // given a service that aborts right after claiming a key, before writing anything
    let shop = Shop::new().await;
    let mut crashing =
        shop.start("crashing", "[idempotency]\nlease_ms = 60000\n[faults]\nabort_after_claim = true\n").await;

    // when a request reaches it
    assert_eq!(crashing.order(Some("k-crash"), BODY), None, "the crashing service answered");
    wait_until("the service to die", async || crashing.process.exited().is_some()).await;

    // then the key is left in progress, nothing is written, and a retry on a healthy replica
    // is told to come back while the lease lasts
    let (state, crashed_token) = shop.key_state("k-crash").await.unwrap();
    assert_eq!(state, "in_progress");
    assert_eq!(shop.orders_and_events().await, (0, 0));
    let healthy = shop.start("healthy", "[idempotency]\nwait_ms = 0\n").await;
    let busy = healthy.order(Some("k-crash"), BODY).unwrap();
    assert_eq!(busy.status, 409, "{busy:?}");
    assert!(busy.header("retry-after").is_some(), "{busy:?}");

    // and once the lease is over (moved to the past here rather than waited for), the retry
    // takes the key over and places the order once
    shop.client
        .execute("UPDATE idempotency_keys SET lease_expires_at = now() - interval '1 second' WHERE key = 'k-crash'", &[])
        .await
        .unwrap();
    let placed = healthy.order(Some("k-crash"), BODY).unwrap();
    assert_eq!(placed.status, 201, "{placed:?}");
    let (state, token) = shop.key_state("k-crash").await.unwrap();
    assert_eq!(state, "completed");
    assert_ne!(token, crashed_token, "the takeover kept the crashed attempt's token");
    assert_eq!(healthy.order(Some("k-crash"), BODY).unwrap().json(), placed.json());
    assert_eq!(shop.orders_and_events().await, (1, 1));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_stalled_worker_whose_lease_was_taken_over_writes_nothing() {
    // given replica A, which stalls 15 s after claiming a key with a 1 s lease, and replica B
    let shop = Shop::new().await;
    let stalled = shop
        .start("stalled", "[idempotency]\nlease_ms = 1000\n[faults]\npause_after_claim_ms = 15000\n")
        .await;
    let other = shop.start("other", "").await;

    // when a request reaches A, its lease runs out, and the client's retry reaches B
    let at_a = post_in_thread(&stalled, "k-fence");
    wait_until("A to claim the key", async || shop.key_state("k-fence").await.is_some()).await;
    wait_until("A's lease to run out", async || {
        shop.count("SELECT count(*) FROM idempotency_keys WHERE lease_expires_at < now()").await == 1
    })
    .await;
    let at_b = other.order(Some("k-fence"), BODY).unwrap();

    // then B places the order; A, waking up, fails its fencing check and writes nothing
    assert_eq!(at_b.status, 201, "{at_b:?}");
    let at_a = at_a.join().unwrap().unwrap();
    assert_eq!((at_a.status, at_a.json()["code"].as_str()), (409, Some("fenced")), "{at_a:?}");
    assert_eq!(shop.orders_and_events().await, (1, 1));
    // and A's client, retrying, gets B's answer
    assert_eq!(stalled.order(Some("k-fence"), BODY).unwrap().json(), at_b.json());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_takeover_racing_a_completing_write_replays_it_instead_of_writing_again() {
    // given a worker (played by this test, with the service's own statements) whose lease has run
    // out while it is inside its final transaction: it holds the key's row lock (the fencing
    // check) and has not written yet
    let shop = Shop::new().await;
    let service = shop.start("orders", "").await;
    let fingerprint = shop.fingerprint_of(BODY, &service).await;
    shop.client
        .execute(
            "INSERT INTO idempotency_keys (caller, key, fingerprint, state, lease_token, lease_expires_at, expires_at) \
             VALUES ('customer-1', 'k-race-write', $1, 'in_progress', 1, now() - interval '1 second', now() + interval '1 day')",
            &[&fingerprint],
        )
        .await
        .unwrap();
    let mut worker = shop.db.client().await;
    let txn = worker.transaction().await.unwrap();
    txn.execute(
        "SELECT 1 FROM idempotency_keys WHERE key = 'k-race-write' AND lease_token = 1 FOR UPDATE",
        &[],
    )
    .await
    .unwrap();

    // when a retry reaches the service, sees the lapsed lease and tries to take the key over
    // (waiting on the row lock), and meanwhile the worker writes the order and its answer and
    // commits
    let retry = post_in_thread(&service, "k-race-write");
    let waiting = "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' \
         AND datname = current_database() AND query LIKE 'UPDATE idempotency_keys%'";
    wait_until("the retry to wait on the key's row lock", async || shop.count(waiting).await == 1).await;
    txn.execute("INSERT INTO orders (customer_id, total_cents) VALUES ('customer-1', 1999)", &[])
        .await
        .unwrap();
    txn.execute(
        "UPDATE idempotency_keys SET state = 'completed', response_status = 201, \
         response_body = '{\"order_id\": 1}' WHERE key = 'k-race-write'",
        &[],
    )
    .await
    .unwrap();
    txn.commit().await.unwrap();

    // then the retry gets the worker's answer, replayed, and no second order is written
    let retry = retry.join().unwrap().unwrap();
    assert_eq!((retry.status, retry.header("idempotent-replayed")), (201, Some("true")), "{retry:?}");
    assert_eq!(retry.json(), serde_json::json!({"order_id": 1}));
    assert_eq!(shop.count("SELECT count(*) FROM orders").await, 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn an_expired_key_is_cleaned_up_and_then_names_a_new_request() {
    // given keys kept 1 s and cleaned up every second
    let shop = Shop::new().await;
    let service = shop
        .start("orders", "[idempotency]\nlease_ms = 500\nkey_ttl_secs = 1\ncleanup_interval_secs = 1\n")
        .await;
    let first = service.order(Some("k-expiring"), BODY).unwrap();
    assert_eq!(first.status, 201);

    // when the key has expired and been deleted
    wait_until("the cleanup to delete the key", async || shop.key_state("k-expiring").await.is_none()).await;

    // then the same key places a new order
    let second = service.order(Some("k-expiring"), BODY).unwrap();
    assert_eq!(second.status, 201);
    assert_ne!(second.json()["order_id"], first.json()["order_id"]);
    assert_eq!(shop.orders_and_events().await, (2, 2));
}

#[tokio::test(flavor = "multi_thread")]
async fn an_expired_key_not_yet_cleaned_up_names_a_new_request_whatever_its_body() {
    // given keys kept 1 s and never cleaned up by the service
    let shop = Shop::new().await;
    let extra = "[idempotency]\nlease_ms = 500\nkey_ttl_secs = 1\ncleanup_interval_secs = 0\n";
    let service = shop.start("orders", extra).await;
    assert_eq!(service.order(Some("k-old"), BODY).unwrap().status, 201);

    // when the key has expired, and comes back with another body
    let expired = "SELECT count(*) FROM idempotency_keys WHERE key = 'k-old' AND expires_at < now()";
    wait_until("the key to expire", async || shop.count(expired).await == 1).await;
    let other = service.order(Some("k-old"), r#"{"customer_id": "customer-2", "total_cents": 5}"#).unwrap();

    // then it is a new order, not a 422
    assert_eq!(other.status, 201, "{other:?}");
    assert_eq!(other.json()["customer_id"], "customer-2");
    assert_eq!(shop.orders_and_events().await, (2, 2));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_session_lost_mid_request_answers_503_and_frees_the_key_for_the_retry() {
    // given a service whose request pauses 2 s after claiming its key
    let shop = Shop::new().await;
    let service = shop.start("orders", "[faults]\npause_after_claim_ms = 2000\n").await;

    // when its database session is terminated during the pause
    let first = post_in_thread(&service, "k-lost");
    wait_until("the key to be claimed", async || shop.key_state("k-lost").await.is_some()).await;
    let terminated = "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
         WHERE datname = current_database() AND application_name = 'orders'";
    assert!(shop.count(terminated).await >= 1);

    // then the client hears 503 with Retry-After, the key is freed at once (not held for the
    // 30 s lease), and the retry places the order
    let first = first.join().unwrap().unwrap();
    assert_eq!((first.status, first.header("retry-after")), (503, Some("1")), "{first:?}");
    assert_eq!(shop.key_state("k-lost").await.unwrap().0, "failed");
    assert_eq!(shop.orders_and_events().await, (0, 0));
    let retry = service.order(Some("k-lost"), BODY).unwrap();
    assert_eq!(retry.status, 201, "{retry:?}");
    assert_eq!(shop.orders_and_events().await, (1, 1));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_missing_table_or_a_bad_setting_stops_the_service_naming_the_fix() {
    // given a database without the service's tables, and a config with a bad setting
    let db = TestDb::new().await;
    let dir = tempfile::tempdir().unwrap();
    let (host, port, user) = db.pg_parts();
    let secret = service::orders_hs256_secret(dir.path());
    let base = format!(
        "[postgres]\nhost = \"{host}\"\nport = {port}\nuser = \"{user}\"\ndatabase = \"{}\"\n\
         sslmode = \"disable\"\n[auth]\nhs256_secret_file = {:?}\n",
        db.name, secret
    );
    let run = |name: &str, toml: String| {
        let path = dir.path().join(format!("{name}.toml"));
        std::fs::write(&path, toml).unwrap();
        let log = dir.path().join(format!("{name}.log"));
        let mut process =
            service::ServiceProcess::spawn("orders", &["run", "--config", path.to_str().unwrap()], &[], &log);
        (process.wait_exit(), process.log_text())
    };

    // then each stops at once with a message naming what to do
    let (code, log) = run("tables", format!("{base}[http]\nlisten = \"127.0.0.1:{}\"\n", http::free_port()));
    assert_eq!(code, 1, "{log}");
    assert!(log.contains("apply sql/examples/orders.sql"), "{log}");
    let (code, log) = run("setting", format!("{base}[idempotency]\nlease_ms = 5\n"));
    assert_eq!(code, 2, "{log}");
    assert!(log.contains("idempotency.lease_ms"), "{log}");
}
