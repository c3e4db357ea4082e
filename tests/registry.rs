//! Values in the Confluent wire format through a real schema registry: Apicurio Registry's
//! Confluent-compatible API (`deploy/local/registry`, started once per test binary, plain and
//! with TLS and basic auth). What the relay wrote is decoded by Confluent's own Python client
//! (`tests/support/registry_consume.py`: confluent-kafka, Avro through fastavro) and compared
//! field by field with the events written.

use std::collections::HashMap;
use std::sync::OnceLock;

use crate::common::{EXIT_LIMIT, RelayToml, Setup, repo_root, wait_until};

/// A registry started by `deploy/local/services hold-registry` (with `options`), its
/// `OUTBOX_RELAY_TEST_REGISTRY_*` settings.
fn registry(tls: bool) -> &'static HashMap<String, String> {
    static PLAIN: OnceLock<HashMap<String, String>> = OnceLock::new();
    static SECURED: OnceLock<HashMap<String, String>> = OnceLock::new();
    let (cell, env): (_, &[(&str, &str)]) = if tls {
        (&SECURED, &[("OUTBOX_REGISTRY_OPTIONS", "--tls --basic-auth relay:s3cret-registry")])
    } else {
        (&PLAIN, &[])
    };
    cell.get_or_init(|| crate::common::hold("hold-registry", env))
}

fn url(tls: bool) -> String {
    registry(tls)["OUTBOX_RELAY_TEST_REGISTRY_URL"].clone()
}

/// The Avro schema of the events: a record of every kind of field the tests write.
const ORDER_AVSC: &str = r#"{"type": "record", "name": "OrderPlaced", "namespace": "tests.registry", "fields": [
  {"name": "order_id", "type": "long"},
  {"name": "customer", "type": "string"},
  {"name": "total_cents", "type": "long"},
  {"name": "express", "type": "boolean"},
  {"name": "note", "type": ["null", "string"], "default": null},
  {"name": "tags", "type": {"type": "array", "items": "string"}}
]}"#;

/// Event `n`'s payload, as the test writes it and expects it back.
fn order(n: i64) -> serde_json::Value {
    let note = if n % 3 == 0 { serde_json::Value::Null } else { format!("note ü {n}").into() };
    serde_json::json!({
        "order_id": n, "customer": format!("c-{}", n % 4), "total_cents": n * 125,
        "express": n % 2 == 0, "note": note, "tags": (0..n % 3).map(|t| format!("t{t}")).collect::<Vec<_>>(),
    })
}

/// A relay configuration in `mode` whose values are Avro through the registry at `url`.
fn avro_toml(mode: &str, slot: &str, url: &str, schema_file: &str) -> RelayToml {
    RelayToml::either(mode, slot)
        .set("outbox.registry", "url", url)
        .set("outbox.registry", "schema_type", "avro")
        .set("outbox.registry", "auto_register", true)
        .set("outbox.registry", "schema_file", schema_file)
}

async fn insert(client: &tokio_postgres::Client, aggregate_type: &str, n: i64, payload: &serde_json::Value) {
    client
        .execute(
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload) \
             VALUES ($1, $2, 'OrderPlaced', $3)",
            &[&aggregate_type, &format!("o-{}", n % 5), payload],
        )
        .await
        .unwrap();
}

/// The records of `topic` decoded by Confluent's client: (id header, schema id, value) each.
fn decoded(topic: &str, url: &str, kind: &str, count: usize) -> Vec<serde_json::Value> {
    let script = repo_root().join("tests/support/registry_consume.py");
    let out = std::process::Command::new("python3")
        .arg(script)
        .args([&crate::common::services().kafka, topic, url, kind, &count.to_string()])
        .output()
        .expect("run registry_consume.py");
    assert!(out.status.success(), "registry_consume.py: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

/// A relay in `mode` whose values are `kind` (`avro`, `json`) of `schema`, registered at its
/// first record, active; and `good` events written, then one with `total_cents` set to `misfit`,
/// then `good` more, all published (the misfit dead-lettered). The schema file lives in `dir`.
async fn published_with_a_misfit(
    mode: &str,
    kind: &str,
    schema: &str,
    good: i64,
    misfit: serde_json::Value,
    dir: &std::path::Path,
) -> (Setup, tokio_postgres::Client, crate::common::process::RelayProcess) {
    let file = dir.join(format!("order.{kind}"));
    std::fs::write(&file, schema).unwrap();
    let url = url(false);
    let s = Setup::create(&crate::common::services().kafka, "", true, |slot| {
        avro_toml(mode, slot, &url, file.to_str().unwrap()).set("outbox.registry", "schema_type", kind)
    })
    .await;
    let client = s.db.client().await;
    let relay = s.start("relay");
    relay.wait_ready("active").await;
    for n in 1..=good {
        insert(&client, &s.aggregate_type, n, &order(n)).await;
    }
    let mut bad = order(99);
    bad["total_cents"] = misfit;
    insert(&client, &s.aggregate_type, 99, &bad).await;
    for n in good + 1..=2 * good {
        insert(&client, &s.aggregate_type, n, &order(n)).await;
    }
    let published = format!("outbox_relay_events_published_total{{mode=\"{mode}\"}}");
    relay.wait_metric(&published, |v| v >= 2.0 * good as f64).await;
    (s, client, relay)
}

/// A relay in `mode` with Avro values: Confluent's deserializer reads every event back equal,
/// field by field, to what was written; a payload that does not fit the schema is dead-lettered
/// with a reason naming the field, the subject and the schema id.
async fn avro_values_in(mode: &str) {
    // given a relay whose outbox registers an Avro schema and encodes its values with it,
    // when 20 events are written, and one whose total is not a number
    let dir = tempfile::tempdir().unwrap();
    let (s, client, mut relay) =
        published_with_a_misfit(mode, "avro", ORDER_AVSC, 10, "lots".into(), dir.path()).await;
    let url = url(false);

    // then Confluent's client decodes the 20, each equal to what was written, in order per key
    let records = decoded(&s.topic, &url, "avro", 20);
    assert_eq!(records.len(), 20, "{}", relay.log_text());
    let mut last: HashMap<String, i64> = HashMap::new();
    for r in &records {
        let n = r["value"]["order_id"].as_i64().unwrap();
        assert_eq!(r["value"], order(n), "event {n}, decoded by Confluent's AvroDeserializer");
        let key = r["key"].as_str().unwrap().to_string();
        assert!(last.insert(key, n).is_none_or(|before| before < n), "out of order: {r}");
        assert!(r["schema_id"].as_u64().unwrap() > 0);
    }
    // and the misfit is dead-lettered, naming the field, the subject and the schema id
    let reason: String = client.query_one("SELECT reason FROM outbox_dead_letter", &[]).await.unwrap().get(0);
    let subject = format!("{}-value", s.topic);
    assert!(
        reason.contains("field \"total_cents\"") && reason.contains(&subject) && reason.contains("(id "),
        "{reason}"
    );
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0), "{}", relay.log_text());
    // and `verify` compares the encoded values: nothing missing or mismatched, and fails on the
    // misfit while its row is still in the table (replication keeps it; polling moved it)
    crate::common::assert_verified(&s.config(), if mode == "replication" { 1 } else { 0 });
}

#[tokio::test(flavor = "multi_thread")]
async fn avro_values_decode_with_confluents_client_in_replication_mode() {
    avro_values_in("replication").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn avro_values_decode_with_confluents_client_in_polling_mode() {
    avro_values_in("polling").await;
}

/// The events' JSON Schema: the same fields as [`ORDER_AVSC`].
const ORDER_JSON_SCHEMA: &str = r#"{"$schema": "http://json-schema.org/draft-07/schema#", "title": "OrderPlaced",
  "type": "object", "additionalProperties": false,
  "required": ["order_id", "customer", "total_cents", "express", "tags"],
  "properties": {"order_id": {"type": "integer"}, "customer": {"type": "string"},
    "total_cents": {"type": "integer", "minimum": 0}, "express": {"type": "boolean"},
    "note": {"type": ["string", "null"]}, "tags": {"type": "array", "items": {"type": "string"}}}}"#;

#[tokio::test(flavor = "multi_thread")]
async fn json_schema_values_decode_with_confluents_client_and_a_misfit_names_its_path() {
    // given a polling relay whose values are validated against a JSON Schema it registers,
    // when 10 events are written, and one whose total is negative
    let dir = tempfile::tempdir().unwrap();
    let (s, client, mut relay) =
        published_with_a_misfit("polling", "json", ORDER_JSON_SCHEMA, 5, (-5).into(), dir.path()).await;
    let url = url(false);

    // then Confluent's JSONDeserializer reads the 10 back equal to what was written, and the
    // misfit is dead-lettered naming the field
    let records = decoded(&s.topic, &url, "json", 10);
    assert_eq!(records.len(), 10, "{}", relay.log_text());
    for r in &records {
        let n = r["value"]["order_id"].as_i64().unwrap();
        assert_eq!(r["value"], order(n), "event {n}, decoded by Confluent's JSONDeserializer");
    }
    let reason: String = client.query_one("SELECT reason FROM outbox_dead_letter", &[]).await.unwrap().get(0);
    assert!(reason.contains("total_cents") && reason.contains(&format!("{}-value", s.topic)), "{reason}");
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0), "{}", relay.log_text());
}

/// `curl` against the registry's API: (HTTP status, body).
fn registry_call(method: &str, url: &str, body: Option<&str>) -> (u16, String) {
    let mut curl = std::process::Command::new("curl");
    curl.args(["-sS", "-o", "-", "-w", "\n%{http_code}", "-X", method]);
    curl.args(["-H", "Content-Type: application/vnd.schemaregistry.v1+json"]);
    if let Some(body) = body {
        curl.args(["--data", body]);
    }
    let out = curl.arg(url).output().expect("curl");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, status) = text.rsplit_once('\n').unwrap_or(("", "0"));
    (status.trim().parse().unwrap_or(0), body.to_string())
}

#[tokio::test(flavor = "multi_thread")]
async fn record_name_subjects_are_looked_up_when_not_registering() {
    // given a relay that names subjects by the record (tests.registry.OrderPlaced) and does not
    // register, and a registry that does not hold that subject yet
    let url = url(false);
    let dir = tempfile::tempdir().unwrap();
    let schema = dir.path().join("order.avsc");
    // (a namespace of its own per run: the registry outlives the test)
    let namespace = format!("tests.registry.r{}", crate::common::random_suffix());
    let avsc = ORDER_AVSC.replace("\"tests.registry\"", &format!("\"{namespace}\""));
    std::fs::write(&schema, &avsc).unwrap();
    let subject = format!("{namespace}.OrderPlaced");
    let s = Setup::create(&crate::common::services().kafka, "", true, |slot| {
        avro_toml("polling", slot, &url, schema.to_str().unwrap())
            .set("outbox.registry", "auto_register", false)
            .set("outbox.registry", "subject_strategy", "record_name")
    })
    .await;
    let client = s.db.client().await;
    insert(&client, &s.aggregate_type, 1, &order(1)).await;

    // when it runs: it stops, naming the subject and what to do; the event waits
    let mut relay = s.start("unregistered");
    assert_ne!(relay.wait_exit(), 0);
    let log = relay.log_text();
    assert!(log.contains(&subject) && log.contains("register it or set auto_register = true"), "{log}");
    assert_eq!(s.outbox_rows().await, 1);

    // and once the schema is registered under the subject, the event goes out with its id
    let body = serde_json::json!({ "schema": avsc }).to_string();
    let (status, answer) = registry_call("POST", &format!("{url}/subjects/{subject}/versions"), Some(&body));
    assert_eq!(status, 200, "{answer}");
    let id = serde_json::from_str::<serde_json::Value>(&answer).unwrap()["id"].as_u64().unwrap();
    let mut relay = s.start("registered");
    relay.wait_metric("outbox_relay_events_published_total{mode=\"polling\"}", |v| v >= 1.0).await;
    let records = decoded(&s.topic, &url, "avro", 1);
    assert_eq!((records[0]["schema_id"].as_u64(), &records[0]["value"]), (Some(id), &order(1)));
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0), "{}", relay.log_text());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_row_whose_subject_the_registry_lacks_is_dead_lettered_and_the_rest_flow_on() {
    subject_lacking_in("polling").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_row_whose_subject_the_registry_lacks_is_dead_lettered_in_replication_mode_too() {
    subject_lacking_in("replication").await;
}

/// A relay in `mode`: a row whose topic names a subject the registry does not hold is
/// dead-lettered naming it, and the events around it are published (issue 46, N2).
async fn subject_lacking_in(mode: &str) {
    // given a relay encoding with each subject's latest schema (nothing registered by the
    // relay), and the events' subject registered; no subject for any other aggregate type
    let url = url(false);
    let s = Setup::create(&crate::common::services().kafka, "", true, |slot| {
        avro_toml(mode, slot, &url, "").set("outbox.registry", "auto_register", false)
    })
    .await;
    let subject = format!("{}-value", s.topic);
    let body = serde_json::json!({ "schema": ORDER_AVSC }).to_string();
    let (status, answer) = registry_call("POST", &format!("{url}/subjects/{subject}/versions"), Some(&body));
    assert_eq!(status, 200, "{answer}");
    let client = s.db.client().await;
    let mut relay = s.start("relay");
    relay.wait_ready("active").await;

    // when a writer's row names an aggregate type whose subject the registry does not hold,
    // between events of the registered one
    let stray = format!("{}_stray", s.aggregate_type);
    for n in 1..=3 {
        insert(&client, &s.aggregate_type, n, &order(n)).await;
    }
    insert(&client, &stray, 4, &order(4)).await;
    for n in 5..=7 {
        insert(&client, &s.aggregate_type, n, &order(n)).await;
    }

    // then the six are published and the stray row is dead-lettered naming its subject; the
    // relay keeps running (it was a fatal error, restarted on the same row for ever)
    let published = format!("outbox_relay_events_published_total{{mode=\"{mode}\"}}");
    relay.wait_metric(&published, |v| v >= 6.0).await;
    assert_eq!(decoded(&s.topic, &url, "avro", 6).len(), 6, "{}", relay.log_text());
    let reasons: Vec<String> = client
        .query("SELECT reason FROM outbox_dead_letter", &[])
        .await
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect();
    assert_eq!(reasons.len(), 1, "{reasons:?}");
    assert!(reasons[0].contains(&format!("outbox.event.{stray}-value")), "{reasons:?}");
    assert!(reasons[0].contains("register the subject's schema"), "{reasons:?}");
    if mode == "polling" {
        assert_eq!(s.outbox_rows().await, 0, "released: published or dead-lettered");
    }
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0), "{}", relay.log_text());
}

#[tokio::test(flavor = "multi_thread")]
async fn an_unreachable_registry_is_retried_and_nothing_is_dead_lettered() {
    // given a polling relay whose registry does not answer (nothing listens on its port)
    let url = url(false);
    let dir = tempfile::tempdir().unwrap();
    let schema = dir.path().join("order.avsc");
    std::fs::write(&schema, ORDER_AVSC).unwrap();
    let closed = "http://127.0.0.1:9/apis/ccompat/v7";
    let s = Setup::create(&crate::common::services().kafka, "", true, |slot| {
        avro_toml("polling", slot, closed, schema.to_str().unwrap())
    })
    .await;
    let client = s.db.client().await;
    for n in 1..=3 {
        insert(&client, &s.aggregate_type, n, &order(n)).await;
    }

    // when it runs a while
    let mut relay = s.start("unreachable");
    wait_until("the relay to say the registry is unavailable", async || {
        relay.log_text().matches("schema registry unavailable").count() >= 2
    })
    .await;

    // then it retried, sent nothing, dead-lettered nothing, and the rows wait in the outbox
    assert_eq!(relay.metric("outbox_relay_events_published_total{mode=\"polling\"}").unwrap_or(0.0), 0.0);
    let dead: i64 = client.query_one("SELECT count(*) FROM outbox_dead_letter", &[]).await.unwrap().get(0);
    assert_eq!((dead, s.outbox_rows().await), (0, 3), "{}", relay.log_text());
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0), "{}", relay.log_text());

    // and once the registry answers, the three are published
    let config = std::fs::read_to_string(s.config()).unwrap();
    std::fs::write(s.config(), config.replace(closed, &url)).unwrap();
    let mut relay = s.start("reachable");
    relay.wait_metric("outbox_relay_events_published_total{mode=\"polling\"}", |v| v >= 3.0).await;
    assert_eq!(decoded(&s.topic, &url, "avro", 3).len(), 3);
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0), "{}", relay.log_text());
}

#[tokio::test(flavor = "multi_thread")]
async fn an_incompatible_schema_stops_the_relay_naming_the_subject() {
    // given a subject holding the events' schema, under BACKWARD compatibility
    let url = url(false);
    let dir = tempfile::tempdir().unwrap();
    let (v1, v2) = (dir.path().join("v1.avsc"), dir.path().join("v2.avsc"));
    std::fs::write(&v1, ORDER_AVSC).unwrap();
    // (a new required field without a default: readers of v2 cannot read v1's records)
    std::fs::write(
        &v2,
        ORDER_AVSC.replace("\n]}", ",\n  {\"name\": \"currency\", \"type\": \"string\"}\n]}"),
    )
    .unwrap();
    let s = Setup::create(&crate::common::services().kafka, "", true, |slot| {
        avro_toml("polling", slot, &url, v1.to_str().unwrap())
    })
    .await;
    let client = s.db.client().await;
    insert(&client, &s.aggregate_type, 1, &order(1)).await;
    let mut relay = s.start("v1");
    relay.wait_metric("outbox_relay_events_published_total{mode=\"polling\"}", |v| v >= 1.0).await;
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0), "{}", relay.log_text());
    let subject = format!("{}-value", s.topic);
    let (status, answer) =
        registry_call("PUT", &format!("{url}/config/{subject}"), Some(r#"{"compatibility": "BACKWARD"}"#));
    assert_eq!(status, 200, "{answer}");

    // when a relay registers an incompatible schema for the next event
    let config = std::fs::read_to_string(s.config()).unwrap();
    std::fs::write(s.config(), config.replace(v1.to_str().unwrap(), v2.to_str().unwrap())).unwrap();
    let mut v2_order = order(2);
    v2_order["currency"] = "EUR".into();
    insert(&client, &s.aggregate_type, 2, &v2_order).await;
    let mut relay = s.start("v2");

    // then it stops, fatal schema_registry, naming the subject; the event stays in the outbox
    let code = relay.wait_exit();
    let log = relay.log_text();
    assert_ne!(code, 0, "{log}");
    assert!(log.contains(&subject) && log.contains("incompatible"), "{log}");
    assert!(log.contains("schema_registry"), "{log}");
    assert_eq!(s.outbox_rows().await, 1);
    let dead: i64 = client.query_one("SELECT count(*) FROM outbox_dead_letter", &[]).await.unwrap().get(0);
    assert_eq!(dead, 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_registry_behind_tls_and_basic_auth_takes_the_password_from_the_environment() {
    // given a registry serving TLS (a private CA) and asking for basic auth
    let registry = registry(true);
    let url = registry["OUTBOX_RELAY_TEST_REGISTRY_URL"].clone();
    let ca = registry["OUTBOX_RELAY_TEST_REGISTRY_CA"].clone();
    let dir = tempfile::tempdir().unwrap();
    let schema = dir.path().join("order.avsc");
    std::fs::write(&schema, ORDER_AVSC).unwrap();
    let s = Setup::create(&crate::common::services().kafka, "", true, |slot| {
        avro_toml("polling", slot, &url, schema.to_str().unwrap())
            .set("outbox.registry", "ca_file", ca.as_str())
            .set("outbox.registry", "username", "relay")
    })
    .await;
    let client = s.db.client().await;
    insert(&client, &s.aggregate_type, 1, &order(1)).await;

    // when the password is wrong, the relay stops naming the credentials, never the password
    let mut relay = s.start_with_env("wrong", &[("OUTBOX_RELAY_REGISTRY_PASSWORD", "not-it")]);
    assert_ne!(relay.wait_exit(), 0);
    let log = relay.log_text();
    assert!(log.contains("schema_registry") && log.contains("401"), "{log}");
    assert!(!log.contains("not-it"), "the password was printed: {log}");

    // and with the right one from the environment the event is published
    let mut relay = s.start_with_env("right", &[("OUTBOX_RELAY_REGISTRY_PASSWORD", "s3cret-registry")]);
    relay.wait_metric("outbox_relay_events_published_total{mode=\"polling\"}", |v| v >= 1.0).await;
    assert!(!relay.log_text().contains("s3cret-registry"));
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0), "{}", relay.log_text());
}
