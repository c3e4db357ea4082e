//! The relay's spans in a real tracing backend: Jaeger (`deploy/local/jaeger`, started by
//! `deploy/local/services hold-jaeger`), queried through its HTTP API the way its UI does.
//! A span is found by the trace id of the row's `traceparent`, its parent and its times checked
//! against what the test wrote and what Kafka holds.
//!
//! That Jaeger is built from its Go module, which holds no UI assets, so the order's trace is
//! shown in Zipkin's UI (`deploy/local/zipkin`): a Jaeger of that test's own also exports every
//! span to a Kafka topic in Zipkin's JSON, which Zipkin consumes; a headless Chromium opens the
//! trace's page, reads it, and takes the screenshot of docs/tracing.md (into docs/images/ with
//! `OUTBOX_REFRESH_DOC_IMAGES=1`, else into the test's temporary directory).

use std::collections::{BTreeSet, HashMap};
use std::path::Path;
use std::process::{Child, Command};
use std::sync::OnceLock;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_json::Value;

use crate::common::http::sample;
use crate::common::{
    EXIT_LIMIT, RelayToml, Setup, consume, consumer, random_suffix, services, slot_confirmed_flush,
    wait_until, wal_lsn,
};

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

/// Every span Jaeger holds of `service` (its traces of the last hour).
fn spans_of_service(base: &str, service: &str) -> Vec<Value> {
    let end = micros(SystemTime::now()) + 60_000_000;
    let start = end - 2 * 3_600_000_000;
    let url = format!("{base}/api/traces?service={service}&start={start}&end={end}&limit=1000");
    let (status, body) = http_get(&url);
    if status != 200 {
        return Vec::new();
    }
    let answer: Value = serde_json::from_str(&body).unwrap();
    let traces = answer["data"].as_array().cloned().unwrap_or_default();
    traces.iter().flat_map(|t| t["spans"].as_array().cloned().unwrap_or_default()).collect()
}

/// The spans named `name` Jaeger holds of `service`.
fn spans_named(base: &str, service: &str, name: &str) -> Vec<Value> {
    spans_of_service(base, service).into_iter().filter(|s| s["operationName"] == name).collect()
}

/// The span ids `span` links to (OTLP links are Jaeger's `FOLLOWS_FROM` references).
fn links(span: &Value) -> BTreeSet<String> {
    let references = span["references"].as_array().cloned().unwrap_or_default();
    let follows = references.iter().filter(|r| r["refType"] == "FOLLOWS_FROM");
    follows.map(|r| r["spanID"].as_str().unwrap().to_string()).collect()
}

/// A span's start and end, in microseconds since the epoch.
fn times(span: &Value) -> (i64, i64) {
    let start = span["startTime"].as_i64().unwrap();
    (start, start + span["duration"].as_i64().unwrap())
}

/// An LSN as PostgreSQL and the relay print it (`X/Y`), as a byte offset.
fn lsn(text: &str) -> i64 {
    let (high, low) = text.split_once('/').unwrap_or_else(|| panic!("not an LSN: {text}"));
    ((u64::from_str_radix(high, 16).unwrap() << 32) | u64::from_str_radix(low, 16).unwrap()) as i64
}

/// A relay configuration exporting spans to the shared Jaeger under a service name of its own,
/// rows without a sampled parent not sampled: (configuration, service name).
fn traced(mode: &str, slot: &str) -> (RelayToml, String) {
    let service = format!("relay-{}", random_suffix());
    let otlp = jaeger()["OUTBOX_RELAY_TEST_OTLP_TRACES_URL"].clone();
    let toml = RelayToml::either(mode, slot)
        .set("tracing", "enabled", true)
        .set("tracing", "endpoint", otlp.as_str())
        .set("tracing", "service_name", service.as_str());
    (toml, service)
}

/// Jaeger's query API, the relay's service name, and a setup of `mode` exporting to Jaeger.
async fn traced_setup(mode: &str) -> (String, String, Setup) {
    let base = jaeger()["OUTBOX_RELAY_TEST_JAEGER_URL"].clone();
    let mut service = String::new();
    let s = Setup::create(&services().kafka, "", true, |slot| {
        let (toml, name) = traced(mode, slot);
        service = name;
        toml
    })
    .await;
    (base, service, s)
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
    let (base, service, s) = traced_setup(mode).await;
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
    let mut send_ids = BTreeSet::new();
    let of_trace = |r: &&crate::common::Consumed| r.header("traceparent").is_some_and(|h| h[3..35] == trace);
    let sampled: Vec<_> = records.iter().filter(of_trace).collect();
    assert_eq!(sampled.len(), 5, "{records:?}");
    for record in sampled {
        let header = record.header("traceparent").unwrap();
        let span_id = &header[36..52];
        let span =
            spans.iter().find(|s| s["spanID"] == span_id).unwrap_or_else(|| panic!("{header}: {spans:?}"));
        send_ids.insert(span_id.to_string());
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

    // and every span the relay exported is one of those five, or a span of its own work (a
    // claim, a confirmation) linked to some of them only: none for the unsampled rows
    let exported = sample(&scrape, "outbox_relay_trace_spans_exported_total").unwrap();
    let all = async || spans_of_service(&base, &service).len() as f64 >= exported;
    wait_until(format!("the {exported} spans the relay exported, in Jaeger"), all).await;
    for span in &spans_of_service(&base, &service) {
        let id = span["spanID"].as_str().unwrap();
        let linked = links(span);
        assert!(
            send_ids.contains(id) || (!linked.is_empty() && linked.is_subset(&send_ids)),
            "a span of no sampled row: {span}"
        );
    }

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

/// Three rows, each a child of a span of its own in trace `trace`, in one transaction.
async fn insert_sampled_in_one_transaction(
    client: &tokio_postgres::Client,
    aggregate_type: &str,
    trace: &str,
) {
    let rows: Vec<String> = (0..3)
        .map(|n| {
            let headers = format!(r#"{{"traceparent": "{}"}}"#, traceparent(trace, &random_hex(8), true));
            format!("('{aggregate_type}', 'a{n}', 'OrderPlaced', '{{}}', '{headers}')")
        })
        .collect();
    let sql = format!(
        "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload, headers) VALUES {}",
        rows.join(", ")
    );
    client.batch_execute(&sql).await.unwrap();
}

/// The ids of the relay's publish spans of trace `trace`, from the records' `traceparent`.
fn send_span_ids(records: &[crate::common::Consumed], trace: &str) -> BTreeSet<String> {
    let headers = records.iter().filter_map(|r| r.header("traceparent"));
    headers.filter(|h| h[3..35] == *trace).map(|h| h[36..52].to_string()).collect()
}

/// The relay's spans of its own work: a polling claim or an LSN confirmation that carried
/// sampled events links exactly their publish spans; one that carried only unsampled events
/// makes no span at ratio 0; a stream session links every sampled event it carried.
async fn work_spans_link_the_sampled_events_they_carried(mode: &str) {
    // given a relay exporting spans to Jaeger under a service name of its own, ratio 0
    let (base, service, s) = traced_setup(mode).await;
    let client = s.db.client().await;
    let mut relay = s.start("relay");
    relay.wait_ready("active").await;
    let work = if mode == "polling" { "polling claim" } else { "lsn confirmation" };

    // when two rows without a sampled parent are published and released (polling: deleted;
    // replication: the slot confirmed past them)
    insert(&client, &s.aggregate_type, 0, Some(&traceparent(&random_hex(16), &random_hex(8), false))).await;
    insert(&client, &s.aggregate_type, 1, None).await;
    let end = wal_lsn(&client).await;
    let released = async || match mode {
        "polling" => s.outbox_rows().await == 0,
        _ => slot_confirmed_flush(&client, &s.slot).await >= end,
    };
    wait_until(relay.context("the unsampled rows released".into()), released).await;

    // and then three sampled rows of one trace, in one transaction
    let before = wal_lsn(&client).await;
    let trace = random_hex(16);
    insert_sampled_in_one_transaction(&client, &s.aggregate_type, &trace).await;
    let after = wal_lsn(&client).await;
    let records = consume(&consumer(&[&s.topic]), 5, Duration::from_secs(5)).await;
    assert_eq!(records.len(), 5, "{}", relay.log_text());
    let sends = send_span_ids(&records, &trace);
    assert_eq!(sends.len(), 3, "{records:?}");

    // then Jaeger holds a span of the relay's work linked to exactly the three publish spans
    let linked = async || spans_named(&base, &service, work).iter().any(|w| links(w) == sends);
    wait_until(relay.context(format!("a {work} span linked to the three publish spans")), linked).await;

    // and, once it holds every span the relay exported, that one and the three publish spans
    // only: the claim or confirmation of the unsampled rows made none
    let exported = relay.wait_metric("outbox_relay_trace_spans_exported_total", |v| v >= 4.0).await;
    let all = async || spans_of_service(&base, &service).len() as f64 >= exported;
    wait_until(format!("the {exported} spans the relay exported, in Jaeger"), all).await;
    let all = spans_of_service(&base, &service);
    let names: Vec<&str> = all.iter().map(|s| s["operationName"].as_str().unwrap()).collect();
    assert_eq!(all.len(), 4, "{names:?}");
    let work_span = all.iter().find(|s| s["operationName"] == work).unwrap();
    let publish: Vec<&Value> = all.iter().filter(|s| sends.contains(s["spanID"].as_str().unwrap())).collect();
    assert_eq!(publish.len(), 3, "{names:?}");

    // and it says what it carried, and it ended after Kafka acknowledged each event
    assert_eq!(tag(work_span, "outbox_relay.mode").unwrap(), mode);
    assert_eq!(work_span["references"].as_array().unwrap().len(), 3, "no parent: {work_span}");
    let (work_start, work_end) = times(work_span);
    for send in &publish {
        let (_, acknowledged) = times(send);
        assert!(acknowledged <= work_end + 1, "acknowledged after the work ended: {send} {work_span}");
    }
    if mode == "polling" {
        assert_eq!(tag(work_span, "outbox_relay.batch_size").unwrap().as_i64(), Some(3));
        assert_eq!(tag(work_span, "outbox_relay.released").unwrap().as_i64(), Some(3));
        assert_eq!(tag(work_span, "outbox_relay.outbox").unwrap(), "outbox_events");
        for send in &publish {
            assert!(
                work_start <= times(send).1 + 1,
                "acknowledged before the claim began: {send} {work_span}"
            );
        }
    } else {
        assert_eq!(tag(work_span, "outbox_relay.events").unwrap().as_i64(), Some(3));
        assert_eq!(tag(work_span, "outbox_relay.transactions").unwrap().as_i64(), Some(1));
        assert_eq!(tag(work_span, "outbox_relay.slot").unwrap(), s.slot.as_str());
        assert_eq!(tag(work_span, "outbox_relay.outboxes").unwrap(), "outbox_events");
        let confirmed = lsn(tag(work_span, "outbox_relay.lsn").unwrap().as_str().unwrap());
        let previous = lsn(tag(work_span, "outbox_relay.previous_lsn").unwrap().as_str().unwrap());
        // (the confirmation before it stopped short of the transaction's commit, this one past it)
        assert!(previous < after && before < confirmed, "{previous} < {after}, {before} < {confirmed}");
        assert!(confirmed <= slot_confirmed_flush(&client, &s.slot).await, "{work_span}");

        // and when the relay stops, its stream session's span links every sampled event
        assert_eq!(relay.terminate(EXIT_LIMIT), Some(0));
        let session = async || spans_named(&base, &service, "stream session").len() == 1;
        wait_until("the stream session's span", session).await;
        let session = spans_named(&base, &service, "stream session").remove(0);
        assert_eq!(links(&session), sends, "{session}");
        assert_eq!(tag(&session, "outbox_relay.events").unwrap().as_i64(), Some(5));
        assert_eq!(tag(&session, "outbox_relay.slot").unwrap(), s.slot.as_str());
        let ended = lsn(tag(&session, "outbox_relay.lsn").unwrap().as_str().unwrap());
        assert!(ended >= confirmed, "{session}");
        let (session_start, session_end) = times(&session);
        assert!(session_start <= work_start && work_end <= session_end + 1, "{session} {work_span}");
        return;
    }
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0));
}

#[tokio::test(flavor = "multi_thread")]
async fn replication_confirmations_and_the_session_link_the_sampled_events_they_carried() {
    work_spans_link_the_sampled_events_they_carried("replication").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn polling_claims_link_the_sampled_events_they_carried() {
    work_spans_link_the_sampled_events_they_carried("polling").await;
}

/// A slot created over rows already in the outbox: its first copy makes a span linked to the
/// publish spans of the sampled rows it published, naming the slot's consistent point.
#[tokio::test(flavor = "multi_thread")]
async fn replication_a_first_copy_over_existing_rows_links_the_sampled_rows_it_published() {
    // given three rows (two of them sampled) in the outbox before the slot exists
    let (base, service, s) = traced_setup("replication").await;
    let client = s.db.client().await;
    let trace = random_hex(16);
    insert(&client, &s.aggregate_type, 0, Some(&traceparent(&trace, &random_hex(8), true))).await;
    insert(&client, &s.aggregate_type, 1, None).await;
    insert(&client, &s.aggregate_type, 2, Some(&traceparent(&trace, &random_hex(8), true))).await;

    // when the relay creates the slot and copies them
    let mut relay = s.start("relay");
    let records = consume(&consumer(&[&s.topic]), 3, Duration::from_secs(10)).await;
    assert_eq!(records.len(), 3, "{}", relay.log_text());
    let sends = send_span_ids(&records, &trace);
    assert_eq!(sends.len(), 2, "{records:?}");

    // then Jaeger holds the copy's span, linked to exactly the two publish spans
    let copied = async || spans_named(&base, &service, "first copy").len() == 1;
    wait_until(relay.context("the first copy's span".into()), copied).await;
    let copy = spans_named(&base, &service, "first copy").remove(0);
    assert_eq!(links(&copy), sends, "{copy}");

    // and it names the slot, the table, its consistent point and what it did
    let created: String = client
        .query_one("SELECT created_lsn::text FROM outbox_relay_slots WHERE slot_name = $1", &[&s.slot])
        .await
        .unwrap()
        .get(0);
    assert_eq!(tag(&copy, "outbox_relay.lsn").unwrap(), created.as_str());
    assert_eq!(tag(&copy, "outbox_relay.slot").unwrap(), s.slot.as_str());
    assert_eq!(tag(&copy, "outbox_relay.table").unwrap(), "public.outbox_events");
    assert_eq!(tag(&copy, "outbox_relay.rows").unwrap().as_i64(), Some(3));
    assert_eq!(tag(&copy, "outbox_relay.published").unwrap().as_i64(), Some(3));
    assert_eq!(tag(&copy, "outbox_relay.already_in_kafka").unwrap().as_i64(), Some(0));
    let (copy_start, copy_end) = times(&copy);
    wait_until("the two publish spans", async || spans_of(&base, &trace).len() == 2).await;
    let publish = spans_of(&base, &trace);
    for send in &publish {
        let (_, acknowledged) = times(send);
        assert!(copy_start <= acknowledged + 1 && acknowledged <= copy_end + 1, "{send} {copy}");
    }
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0));
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
    // rows are committed in one transaction (their spans arrive at once: the exporter takes a
    // few from the queue into each export that fails, so rows committed one by one on a loaded
    // machine left fewer than 200 to drop as queue_full)
    assert!(Command::new("kill").args(["-STOP", "--", &format!("-{pid}")]).status().unwrap().success());
    client.batch_execute("BEGIN").await.unwrap();
    for n in 0..300 {
        insert(&client, &s.aggregate_type, n, None).await;
    }
    client.batch_execute("COMMIT").await.unwrap();

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

/// A span as a trace's page draws it: (span id, parent span id or "", service name, span name).
type Named = (String, String, String, String);

/// The spans Jaeger holds of trace `trace_id`, each with its process's service name.
fn jaeger_named(base: &str, trace_id: &str) -> BTreeSet<Named> {
    let (status, body) = http_get(&format!("{base}/api/traces/{trace_id}"));
    let answer: Value = if status == 200 { serde_json::from_str(&body).unwrap() } else { Value::Null };
    let Some(trace) = answer["data"].as_array().and_then(|d| d.first()) else {
        return BTreeSet::new();
    };
    let spans = trace["spans"].as_array().unwrap().iter();
    spans
        .map(|s| {
            let process = &trace["processes"][s["processID"].as_str().unwrap()];
            let text = |v: &Value| v.as_str().unwrap_or_default().to_string();
            let references = s["references"].as_array().cloned().unwrap_or_default();
            let parent = references
                .iter()
                .find(|r| r["refType"] == "CHILD_OF")
                .map_or(String::new(), |r| text(&r["spanID"]));
            (text(&s["spanID"]), parent, text(&process["serviceName"]), text(&s["operationName"]))
        })
        .collect()
}

/// The spans Zipkin holds of trace `trace_id` (`GET /api/v2/trace/{id}`, 404 while it has none).
fn zipkin_named(base: &str, trace_id: &str) -> BTreeSet<Named> {
    let (status, body) = http_get(&format!("{base}/api/v2/trace/{trace_id}"));
    if status != 200 {
        return BTreeSet::new();
    }
    let spans: Vec<Value> = serde_json::from_str(&body).unwrap();
    let text = |v: &Value| v.as_str().unwrap_or_default().to_string();
    spans
        .iter()
        .map(|s| {
            (text(&s["id"]), text(&s["parentId"]), text(&s["localEndpoint"]["serviceName"]), text(&s["name"]))
        })
        .collect()
}

/// Zipkin's model lowercases service and span names: Jaeger's spans as Zipkin holds them.
fn lowercased(spans: &BTreeSet<Named>) -> BTreeSet<Named> {
    spans
        .iter()
        .map(|(id, parent, service, name)| {
            (id.clone(), parent.clone(), service.to_lowercase(), name.to_lowercase())
        })
        .collect()
}

/// A Jaeger of the caller's own that also exports every span to a new Kafka topic in Zipkin's
/// JSON (its kafkaexporter), and a Zipkin consuming that topic: (the two `hold` processes, which
/// stop them when dropped; Jaeger's variables; Zipkin's). Zipkin is a JVM: started for the one test
/// that shows a trace in its UI, not with the shared Jaeger.
async fn jaeger_feeding_zipkin() -> (Vec<Child>, HashMap<String, String>, HashMap<String, String>) {
    let topic = format!("zipkin-{}", random_suffix());
    crate::common::create_topic(&topic, 1).await;
    let kafka = services().kafka.as_str();
    std::thread::scope(|scope| {
        let zipkin_env = [("OUTBOX_ZIPKIN_KAFKA", kafka), ("OUTBOX_ZIPKIN_KAFKA_TOPIC", topic.as_str())];
        let zipkin = scope.spawn(move || crate::common::spawn_services("hold-zipkin", &zipkin_env));
        let jaeger_env = [("OUTBOX_JAEGER_KAFKA", kafka), ("OUTBOX_JAEGER_KAFKA_TOPIC", topic.as_str())];
        let (jaeger, jaeger_vars) = crate::common::spawn_services("hold-jaeger", &jaeger_env);
        let (zipkin, zipkin_vars) = zipkin.join().unwrap();
        (vec![jaeger, zipkin], jaeger_vars, zipkin_vars)
    })
}

/// The first line that is not blank after the line `label`, on a page whose text is `text`
/// (Zipkin's page shows a label above its value).
fn labelled<'a>(text: &'a str, label: &str) -> Option<&'a str> {
    let mut lines = text.lines().map(str::trim).skip_while(|line| *line != label).skip(1);
    lines.find(|line| !line.is_empty())
}

/// Waits until Zipkin holds every span Jaeger holds of trace `trace` (ids, parents, services,
/// names), then opens the trace's page in Chromium, checks that it shows each of them and the
/// trace id, selects the relay's publish span `send`, and takes the screenshot (see the module
/// doc).
async fn zipkins_page_shows_the_trace(jaeger: &str, zipkin: &str, trace: &str, send: &str, dir: &Path) {
    use crate::common::browser::{self, Chromium, DESKTOP};
    let same = async || {
        let expected = lowercased(&jaeger_named(jaeger, trace));
        expected.len() >= 3 && zipkin_named(zipkin, trace) == expected
    };
    let what = format!("Zipkin to hold the spans Jaeger holds of {trace}");
    wait_until(what, same).await;
    let spans = zipkin_named(zipkin, trace);

    let chromium = Chromium::start().await;
    let page = chromium.open(&format!("{zipkin}/zipkin/traces/{trace}")).await;
    // the timeline names each span `<service>: <span name>` (a virtual list: every row is drawn
    // at this height)
    let rows: Vec<String> = spans.iter().map(|(_, _, service, name)| format!("{service}: {name}")).collect();
    let text = async || browser::read::<String>(&page, "document.body.innerText").await.unwrap_or_default();
    let shown = async || {
        let text = text().await;
        text.contains(trace) && rows.iter().all(|row| text.lines().any(|line| line.trim() == row))
    };
    wait_until(format!("Zipkin's page of {trace} to show {rows:?}"), shown).await;
    let page_text = text().await;
    let total = labelled(&page_text, "Total Spans").and_then(|t| t.parse::<usize>().ok());
    let total = total.unwrap_or_else(|| panic!("no span count: {page_text}"));
    assert!(total >= spans.len() && total <= zipkin_named(zipkin, trace).len(), "{total}: {page_text}");

    // and the relay's publish span, selected, shows its service and name in the detail panel
    let (_, parent, service, name) = spans.iter().find(|(id, _, _, _)| id == send).unwrap();
    let row = format!("{service}: {name}");
    let select = format!(
        "(() => {{ const row = [...document.querySelectorAll('div')].reverse()\
         .find(d => d.textContent.trim() === {row:?}); if (!row) return false; row.click(); return true; }})()"
    );
    assert_eq!(browser::read::<bool>(&page, &select).await, Some(true), "no row {row}");
    let detail = async || {
        let text = text().await;
        labelled(&text, "Span ID") == Some(send)
            && labelled(&text, "Parent ID") == Some(parent.as_str())
            && labelled(&text, "Span name") == Some(name.as_str())
            && labelled(&text, "Service name") == Some(service.as_str())
    };
    wait_until(format!("Zipkin's span detail of {send}"), detail).await;

    let images = match std::env::var("OUTBOX_REFRESH_DOC_IMAGES").as_deref() {
        Ok("1") => crate::common::repo_root().join("docs/images"),
        _ => dir.to_path_buf(),
    };
    let png = browser::screenshot(&page, DESKTOP, false).await;
    assert_eq!(&png[1..4], b"PNG");
    std::fs::write(images.join("trace-zipkin.png"), png).unwrap();
}

/// An order placed over HTTP with a sampled `traceparent` yields one trace: the order service's
/// request span, the relay's publish span as its child, the ledger's processing span as the
/// relay's child. With `zipkin`, the trace is also shown in Zipkin's UI, fed by Jaeger.
async fn an_order_is_one_trace_from_the_request_to_the_ledger(mode: &str, zipkin: bool) {
    use crate::common::service::{OrdersService, ServiceProcess, apply_examples};
    // given the order service, the relay and the ledger exporting spans to Jaeger (with
    // `zipkin`, one feeding a Zipkin)
    let fed = if zipkin { Some(jaeger_feeding_zipkin().await) } else { None };
    let backend = fed.as_ref().map_or(jaeger(), |(_, jaeger, _)| jaeger);
    let base = backend["OUTBOX_RELAY_TEST_JAEGER_URL"].clone();
    let otlp = backend["OUTBOX_RELAY_TEST_OTLP_TRACES_URL"].clone();
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
    let parent_of = |span: &Value| span["references"][0]["spanID"].as_str().unwrap_or_default().to_string();
    // the span named `prefix`* whose parent is `parent` (the ledger's own event, relayed in turn,
    // adds a second `send` span to the trace, the child of `process`)
    let named = |prefix: &str, parent: &str| {
        let names: Vec<_> = spans.iter().map(|s| s["operationName"].as_str().unwrap()).collect();
        let found = spans
            .iter()
            .find(|s| s["operationName"].as_str().unwrap().starts_with(prefix) && parent_of(s) == parent);
        found.unwrap_or_else(|| panic!("no span named {prefix}* with parent {parent} among {names:?}"))
    };
    let request = named(names[0], &client_span);
    let publish = named(names[1], request["spanID"].as_str().unwrap());
    let process = named(names[2], publish["spanID"].as_str().unwrap());
    assert_eq!(tag(process, "ledger.outcome").unwrap(), "debited");
    assert_eq!(tag(request, "http.response.status_code").unwrap().as_i64(), Some(201));
    ledger.terminate(EXIT_LIMIT);
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0));

    // and Zipkin, fed by Jaeger through Kafka, holds the same spans, and its page shows them
    if let Some((_, _, zipkin)) = &fed {
        let send = publish["spanID"].as_str().unwrap();
        let zipkin = &zipkin["OUTBOX_RELAY_TEST_ZIPKIN_URL"];
        zipkins_page_shows_the_trace(&base, zipkin, &trace, send, s.dir.path()).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn replication_an_order_is_one_trace_from_the_request_to_the_ledger_shown_in_zipkin() {
    an_order_is_one_trace_from_the_request_to_the_ledger("replication", true).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn polling_an_order_is_one_trace_from_the_request_to_the_ledger() {
    an_order_is_one_trace_from_the_request_to_the_ledger("polling", false).await;
}
