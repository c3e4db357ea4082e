//! The relay's spans in a real tracing backend: Jaeger (`deploy/local/jaeger`, started by
//! `deploy/local/services hold-jaeger`), queried through its HTTP API the way its UI does.
//! A span is found by the trace id of the row's `traceparent`, its parent and its times checked
//! against what the test wrote and what Kafka holds.

use std::collections::HashMap;
use std::process::Command;
use std::sync::OnceLock;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_json::Value;

use crate::common::http::sample;
use crate::common::{EXIT_LIMIT, RelayToml, Setup, consume, consumer, services, wait_until};

/// The tracing backend the tests share.
fn jaeger() -> &'static HashMap<String, String> {
    static HELD: OnceLock<HashMap<String, String>> = OnceLock::new();
    HELD.get_or_init(|| crate::common::hold("hold-jaeger", &[]))
}

/// `GET url` with curl: (status, body).
fn http_get(url: &str) -> (u16, String) {
    let out = Command::new("curl").args(["-sS", "-m", "10", "-w", "\n%{http_code}", url]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let (body, status) = text.rsplit_once('\n').unwrap_or(("", "0"));
    (status.trim().parse().unwrap_or(0), body.to_string())
}

/// The spans Jaeger holds of trace `trace_id` (none when it knows no such trace).
fn spans_of(base: &str, trace_id: &str) -> Vec<Value> {
    let (status, body) = http_get(&format!("{base}/api/traces/{trace_id}"));
    if status != 200 {
        return Vec::new();
    }
    let answer: Value = serde_json::from_str(&body).unwrap();
    answer["data"]
        .as_array()
        .and_then(|d| d.first())
        .map_or(Vec::new(), |t| t["spans"].as_array().unwrap().clone())
}

fn tag<'a>(span: &'a Value, key: &str) -> Option<&'a Value> {
    span["tags"].as_array()?.iter().find(|t| t["key"] == key).map(|t| &t["value"])
}

fn micros(at: SystemTime) -> i64 {
    at.duration_since(UNIX_EPOCH).unwrap().as_micros() as i64
}

fn traceparent(trace: &str, span: &str, sampled: bool) -> String {
    format!("00-{trace}-{span}-{}", if sampled { "01" } else { "00" })
}

fn random_hex(bytes: usize) -> String {
    (0..bytes).map(|_| format!("{:02x}", rand::random::<u8>() | 1)).collect()
}

async fn insert(client: &tokio_postgres::Client, aggregate_type: &str, n: i64, headers: Option<&str>) {
    let headers: Option<Value> = headers.map(|t| serde_json::json!({ "traceparent": t }));
    client
        .execute(
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload, headers) \
             VALUES ($1, $2, 'OrderPlaced', '{}', $3)",
            &[&aggregate_type, &format!("a{}", n % 3), &headers],
        )
        .await
        .unwrap();
}

/// Sampled rows get a publish span in Jaeger whose parent is the row's span, whose start is
/// the row's commit and whose end is Kafka's acknowledgement, and whose id the record's
/// `traceparent` carries; an unsampled row and a row without one get none.
async fn a_sampled_row_is_traced_from_its_commit_to_kafkas_acknowledgement(mode: &str) {
    // given a relay exporting spans to Jaeger, rows without a parent not sampled
    let base = jaeger()["OUTBOX_RELAY_TEST_JAEGER_URL"].clone();
    let otlp = jaeger()["OUTBOX_RELAY_TEST_OTLP_TRACES_URL"].clone();
    let s = Setup::create(&services().kafka, "", true, |slot| {
        RelayToml::either(mode, slot).set("tracing", "enabled", true).set(
            "tracing",
            "endpoint",
            otlp.as_str(),
        )
    })
    .await;
    let client = s.db.client().await;
    let mut relay = s.start("relay");
    relay.wait_ready("active").await;

    // when two rows without a sampled parent, then five sampled rows of one trace, are committed
    let unsampled_trace = random_hex(16);
    insert(&client, &s.aggregate_type, 0, Some(&traceparent(&unsampled_trace, &random_hex(8), false))).await;
    insert(&client, &s.aggregate_type, 1, None).await;
    let published = format!("outbox_relay_events_published_total{{mode=\"{mode}\"}}");
    relay.wait_metric(&published, |v| v == 2.0).await;
    let latency_before = sample(&relay.scrape(), "outbox_relay_end_to_end_latency_seconds_sum").unwrap();
    let trace = random_hex(16);
    let parents: Vec<String> = (0..5).map(|_| random_hex(8)).collect();
    let before = SystemTime::now();
    for (n, parent) in parents.iter().enumerate() {
        insert(&client, &s.aggregate_type, n as i64 + 2, Some(&traceparent(&trace, parent, true))).await;
    }
    let after = SystemTime::now();
    let records = consume(&consumer(&[&s.topic]), 7, Duration::from_secs(5)).await;
    assert_eq!(records.len(), 7, "{}", relay.log_text());

    // then Jaeger holds five publish spans, each the child of its row's span
    wait_until("five publish spans in Jaeger", async || spans_of(&base, &trace).len() == 5).await;
    let spans = spans_of(&base, &trace);
    let mut durations = 0;
    let of_trace = |r: &&crate::common::Consumed| r.header("traceparent").is_some_and(|h| h[3..35] == trace);
    let sampled: Vec<_> = records.iter().filter(of_trace).collect();
    assert_eq!(sampled.len(), 5, "{records:?}");
    for record in sampled {
        let header = record.header("traceparent").unwrap();
        let span_id = &header[36..52];
        let span =
            spans.iter().find(|s| s["spanID"] == span_id).unwrap_or_else(|| panic!("{header}: {spans:?}"));
        let reference = &span["references"][0];
        assert_eq!(reference["refType"], "CHILD_OF");
        assert!(parents.contains(&reference["spanID"].as_str().unwrap().to_string()), "{span}");
        assert_eq!(span["operationName"], format!("send {}", s.topic));
        assert_eq!(tag(span, "messaging.destination.name").unwrap(), s.topic.as_str());
        assert_eq!(tag(span, "messaging.kafka.offset").unwrap().as_i64(), Some(record.offset));
        assert_eq!(
            tag(span, "messaging.destination.partition.id").unwrap(),
            record.partition.to_string().as_str()
        );
        assert_eq!(tag(span, "outbox_relay.mode").unwrap(), mode);
        let start = span["startTime"].as_i64().unwrap();
        // commit time: replication's is the server's, at microseconds; polling's created_at
        assert!(start >= micros(before) - 2_000 && start <= micros(after) + 2_000, "{span}");
        durations += span["duration"].as_i64().unwrap();
    }

    // and their durations add up to the relay's end-to-end latency of those five, within 2 ms
    // each
    let scrape = relay.scrape();
    let latency = sample(&scrape, "outbox_relay_end_to_end_latency_seconds_sum").unwrap() - latency_before;
    let spanned = durations as f64 / 1e6;
    assert!((spanned - latency).abs() <= 0.010, "spans {spanned} s, histogram {latency} s");
    assert_eq!(sample(&scrape, "outbox_relay_trace_spans_exported_total"), Some(5.0), "{scrape}");

    // and the unsampled row's trace has no span of the relay's, its header unchanged
    assert!(spans_of(&base, &unsampled_trace).is_empty());
    let unsampled =
        records.iter().filter_map(|r| r.header("traceparent")).find(|h| h[3..35] == unsampled_trace);
    assert!(unsampled.unwrap().ends_with("-00"), "{records:?}");
    assert_eq!(records.iter().filter(|r| r.header("traceparent").is_none()).count(), 1, "{records:?}");
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0));
}

#[tokio::test(flavor = "multi_thread")]
async fn replication_traces_a_sampled_row_from_its_commit_to_kafkas_acknowledgement() {
    a_sampled_row_is_traced_from_its_commit_to_kafkas_acknowledgement("replication").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn polling_traces_a_sampled_row_from_its_commit_to_kafkas_acknowledgement() {
    a_sampled_row_is_traced_from_its_commit_to_kafkas_acknowledgement("polling").await;
}

/// A tracing backend that stops answering costs no event: spans are dropped and counted, the
/// queue stays at its bound, and spans flow again once it answers.
#[tokio::test(flavor = "multi_thread")]
async fn a_frozen_tracing_backend_costs_no_event_and_its_spans_are_dropped_and_counted() {
    // given a relay tracing every row into a Jaeger of its own, with a queue of 8 spans
    let (held, env) = crate::common::spawn_services("hold-jaeger", &[]);
    let pid: i32 = std::fs::read_to_string(format!("{}/pid", env["OUTBOX_RELAY_TEST_JAEGER_DIR"]))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let s = Setup::create(&services().kafka, "", true, |slot| {
        RelayToml::either("replication", slot)
            .set("tracing", "enabled", true)
            .set("tracing", "endpoint", env["OUTBOX_RELAY_TEST_OTLP_TRACES_URL"].as_str())
            .set_literal("tracing", "sample_ratio", "1.0")
            .set("tracing", "queue_size", 8)
            .set("tracing", "export_timeout_ms", 1_000)
    })
    .await;
    let client = s.db.client().await;
    let mut relay = s.start("relay");
    relay.wait_ready("active").await;

    // when the backend is frozen (SIGSTOP: it accepts connections and answers nothing) and 300
    // rows are committed
    assert!(Command::new("kill").args(["-STOP", "--", &format!("-{pid}")]).status().unwrap().success());
    for n in 0..300 {
        insert(&client, &s.aggregate_type, n, None).await;
    }

    // then all 300 reach Kafka, and the spans beyond the queue are dropped and counted
    let consumer = consumer(&[&s.topic]);
    let records = consume(&consumer, 300, Duration::from_secs(5)).await;
    assert_eq!(records.len(), 300, "{}", relay.log_text());
    let full = "outbox_relay_trace_spans_dropped_total{reason=\"queue_full\"}";
    relay.wait_metric(full, |v| v >= 200.0).await;
    relay.wait_metric("outbox_relay_trace_spans_dropped_total{reason=\"export_failed\"}", |v| v >= 1.0).await;

    // and once the backend answers again, a new row's span reaches it
    assert!(Command::new("kill").args(["-CONT", "--", &format!("-{pid}")]).status().unwrap().success());
    let trace = random_hex(16);
    insert(&client, &s.aggregate_type, 300, Some(&traceparent(&trace, &random_hex(8), true))).await;
    assert_eq!(consume(&consumer, 1, Duration::from_secs(5)).await.len(), 1);
    let base = env["OUTBOX_RELAY_TEST_JAEGER_URL"].clone();
    wait_until("the span of a row written after the backend came back", async || {
        spans_of(&base, &trace).len() == 1
    })
    .await;
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0));
    drop(held);
}

/// An order placed over HTTP with a sampled `traceparent` yields one trace: the order service's
/// request span, the relay's publish span as its child, the ledger's processing span as the
/// relay's child.
async fn an_order_is_one_trace_from_the_request_to_the_ledger(mode: &str) {
    use crate::common::service::{OrdersService, ServiceProcess, apply_examples};
    // given the order service, the relay and the ledger exporting spans to Jaeger
    let base = jaeger()["OUTBOX_RELAY_TEST_JAEGER_URL"].clone();
    let otlp = jaeger()["OUTBOX_RELAY_TEST_OTLP_TRACES_URL"].clone();
    let prefix = format!("tr{}", crate::common::random_suffix());
    let template = format!("{prefix}.{{aggregate_type}}");
    let s = Setup::create(&services().kafka, "", false, |slot| {
        RelayToml::either(mode, slot)
            .set("outbox", "topic_template", template)
            .set("tracing", "enabled", true)
            .set("tracing", "endpoint", otlp.as_str())
    })
    .await;
    crate::common::create_topic(&format!("{prefix}.order"), 2).await;
    crate::common::create_topic(&format!("{prefix}.order.dlq"), 1).await;
    let client = s.db.client().await;
    apply_examples(&client, &["orders", "idempotency", "ledger", "roles"]).await;
    client
        .execute("INSERT INTO wallets (customer_id, balance_cents) VALUES ('customer-1', 100000)", &[])
        .await
        .unwrap();
    let mut relay = s.start("relay");
    relay.wait_ready("active").await;
    let otel = [("OTEL_TRACES_EXPORTER", "otlp"), ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", otlp.as_str())];
    let (host, port, _) = s.db.pg_parts();
    let http_port = crate::common::http::free_port();
    let orders_toml = s.dir.path().join("orders.toml");
    std::fs::write(
        &orders_toml,
        format!(
            "[postgres]\nhost = \"{host}\"\nport = {port}\nuser = \"orders_service\"\ndatabase = \"{}\"\nsslmode = \"disable\"\n\n\
             [http]\nlisten = \"127.0.0.1:{http_port}\"\n",
            s.db.name
        ),
    )
    .unwrap();
    let orders =
        OrdersService::start_on_with_env(&orders_toml, http_port, &s.dir.path().join("orders.log"), &otel)
            .await;
    let ledger_toml = s.dir.path().join("ledger.toml");
    std::fs::write(
        &ledger_toml,
        format!(
            "[postgres]\nhost = \"{host}\"\nport = {port}\nuser = \"ledger_service\"\ndatabase = \"{}\"\nsslmode = \"disable\"\n\
             [kafka]\nbrokers = [\"{}\"]\nclient_id = \"ledger\"\n\
             [consumer]\ntopic = \"{prefix}.order\"\ngroup_id = \"{prefix}-ledger\"\ndead_letter_topic = \"{prefix}.order.dlq\"\n",
            s.db.name,
            services().kafka,
        ),
    )
    .unwrap();
    let args = ["run", "--config", ledger_toml.to_str().unwrap()];
    let mut ledger = ServiceProcess::spawn("ledger", &args, &otel, &s.dir.path().join("ledger.log"));

    // when a client whose own span is sampled places an order
    let (trace, client_span) = (random_hex(16), random_hex(8));
    let token = orders.token("customer-1", 3600);
    let bearer = format!("Bearer {token}");
    let parent = traceparent(&trace, &client_span, true);
    let headers = [
        ("Idempotency-Key", "trace-1"),
        ("Authorization", bearer.as_str()),
        ("traceparent", parent.as_str()),
    ];
    let body = r#"{"customer_id": "customer-1", "total_cents": 1999}"#;
    let answer = crate::common::http::post(orders.port, "/orders", &headers, body).unwrap();
    assert_eq!(answer.status, 201, "{answer:?}");

    // then Jaeger holds one trace of three spans, each the child of the one before
    // (each process exports on its own schedule; a redelivered record adds a second ledger span)
    let names = ["POST /orders", "send ", "process "];
    let found = async || {
        let spans = spans_of(&base, &trace);
        names.iter().all(|n| spans.iter().any(|s| s["operationName"].as_str().unwrap().starts_with(n)))
    };
    wait_until(format!("the order's trace in Jaeger; ledger log:\n{}", ledger.log_text()), found).await;
    let spans = spans_of(&base, &trace);
    let named = |prefix: &str| {
        let names: Vec<_> = spans.iter().map(|s| s["operationName"].as_str().unwrap()).collect();
        let found = spans.iter().find(|s| s["operationName"].as_str().unwrap().starts_with(prefix));
        found.unwrap_or_else(|| panic!("no span named {prefix}* among {names:?}"))
    };
    let (request, publish, process) = (named(names[0]), named(names[1]), named(names[2]));
    let parent_of = |span: &Value| span["references"][0]["spanID"].as_str().unwrap().to_string();
    assert_eq!(parent_of(request), client_span);
    assert_eq!(parent_of(publish), request["spanID"].as_str().unwrap());
    assert_eq!(parent_of(process), publish["spanID"].as_str().unwrap());
    assert_eq!(tag(process, "ledger.outcome").unwrap(), "debited");
    assert_eq!(tag(request, "http.response.status_code").unwrap().as_i64(), Some(201));
    ledger.terminate(EXIT_LIMIT);
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0));
}

#[tokio::test(flavor = "multi_thread")]
async fn replication_an_order_is_one_trace_from_the_request_to_the_ledger() {
    an_order_is_one_trace_from_the_request_to_the_ledger("replication").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn polling_an_order_is_one_trace_from_the_request_to_the_ledger() {
    an_order_is_one_trace_from_the_request_to_the_ledger("polling").await;
}
