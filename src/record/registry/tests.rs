//! The client against a tiny in-process HTTP server answering canned Confluent responses: the
//! subjects asked for, the cache, and how each answer is classified. (The real registry is
//! exercised by the integration tests.)

use std::convert::Infallible;
use std::sync::Mutex as StdMutex;
use std::time::Duration;

use http_body_util::{BodyExt, Full};
use hyper::body::{Bytes, Incoming};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use reqwest::StatusCode;
use tokio::net::TcpListener;

use super::client::{Call, classify};
use super::*;
use crate::config::Secret;

const ORDER_AVSC: &str = r#"{"type": "record", "name": "OrderPlaced", "namespace": "shop",
    "fields": [{"name": "id", "type": "string"}, {"name": "amount", "type": "long"}]}"#;

/// A request the fixture server saw.
#[derive(Debug, Clone)]
struct Seen {
    method: String,
    path: String,
    content_type: String,
    authorization: String,
    body: String,
}

type Answer = dyn Fn(&Seen) -> (u16, String) + Send + Sync;

/// A registry stand-in on 127.0.0.1 that answers every request with `answer`, after `delay`.
struct Fixture {
    url: String,
    seen: Arc<StdMutex<Vec<Seen>>>,
}

impl Fixture {
    async fn start(
        delay: Duration,
        answer: impl Fn(&Seen) -> (u16, String) + Send + Sync + 'static,
    ) -> Fixture {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/apis/ccompat/v7", listener.local_addr().unwrap());
        let seen = Arc::new(StdMutex::new(Vec::new()));
        let answer: Arc<Answer> = Arc::new(answer);
        let recorded = seen.clone();
        tokio::spawn(async move {
            while let Ok((socket, _)) = listener.accept().await {
                let (answer, recorded) = (answer.clone(), recorded.clone());
                let service =
                    service_fn(move |request| respond(request, delay, answer.clone(), recorded.clone()));
                tokio::spawn(http1::Builder::new().serve_connection(TokioIo::new(socket), service));
            }
        });
        Fixture { url, seen }
    }

    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }
}

async fn respond(
    request: Request<Incoming>,
    delay: Duration,
    answer: Arc<Answer>,
    recorded: Arc<StdMutex<Vec<Seen>>>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let header = |name| request.headers().get(name).and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
    let (content_type, authorization) = (header("content-type"), header("authorization"));
    let (method, path) = (request.method().to_string(), request.uri().path().to_string());
    let body = request.into_body().collect().await.map(|b| b.to_bytes()).unwrap_or_default();
    let seen =
        Seen { method, path, content_type, authorization, body: String::from_utf8_lossy(&body).into() };
    recorded.lock().unwrap().push(seen.clone());
    tokio::time::sleep(delay).await;
    let (status, body) = answer(&seen);
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = hyper::StatusCode::from_u16(status).unwrap();
    Ok(response)
}

/// A configuration for the fixture at `url`, with `schema` written to a file when given.
fn config(url: &str, kind: SchemaType, schema: Option<&str>, dir: &tempfile::TempDir) -> RegistryConfig {
    let mut config = RegistryConfig::new(url, kind);
    if let Some(schema) = schema {
        let file = dir.path().join("schema");
        std::fs::write(&file, schema).unwrap();
        config.schema_file = file.display().to_string();
    }
    config
}

#[tokio::test]
async fn registers_once_per_subject_and_writes_the_wire_format() {
    // given a registry that answers id 258 after a while, and eight records at once
    let registry_side = Fixture::start(Duration::from_millis(50), |_| (200, r#"{"id": 258}"#.into())).await;
    let dir = tempfile::tempdir().unwrap();
    let mut config = config(&registry_side.url, SchemaType::Avro, Some(ORDER_AVSC), &dir);
    config.auto_register = true;
    config.username = "relay".into();
    config.password = Secret::new("s3cret");
    config.allow_http_credentials = true; // (the fixture is plain http on loopback)
    let registry = Registry::new(&config).unwrap();

    // when they are encoded concurrently
    let payload = r#"{"id": "o-1", "amount": 1}"#;
    let values = futures::future::join_all((0..8).map(|_| registry.encode("orders", payload))).await;

    // then the subject was registered once, and every value has the header and the Avro body
    let expected = [&[0u8, 0, 0, 1, 2][..], b"\x06o-1\x02"].concat();
    for value in values {
        assert_eq!(value.unwrap(), expected);
    }
    let seen = registry_side.seen();
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert_eq!(
        (seen[0].method.as_str(), seen[0].path.as_str()),
        ("POST", "/apis/ccompat/v7/subjects/orders-value/versions")
    );
    assert_eq!(seen[0].content_type, "application/vnd.schemaregistry.v1+json");
    assert_eq!(seen[0].authorization, "Basic cmVsYXk6czNjcmV0"); // relay:s3cret
    let body: serde_json::Value = serde_json::from_str(&seen[0].body).unwrap();
    assert_eq!(body["schema"], ORDER_AVSC);
    assert_eq!(body.get("schemaType"), None, "AVRO is the default");

    // a second topic is a second subject
    registry.encode("refunds", payload).await.unwrap();
    assert_eq!(registry_side.seen()[1].path, "/apis/ccompat/v7/subjects/refunds-value/versions");
}

#[tokio::test]
async fn record_name_uses_the_schema_name_and_lookup_by_content() {
    let registry_side = Fixture::start(Duration::ZERO, |_| {
        (200, r#"{"subject": "x", "id": 7, "version": 1, "schema": "{}"}"#.into())
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let mut config = config(&registry_side.url, SchemaType::Avro, Some(ORDER_AVSC), &dir);
    config.subject_strategy = SubjectStrategy::RecordName;
    let registry = Registry::new(&config).unwrap();
    assert_eq!(registry.subject("orders"), "shop.OrderPlaced");
    let value = registry.encode("orders", r#"{"id": "o", "amount": 0}"#).await.unwrap();
    assert_eq!(value[..5], [0, 0, 0, 0, 7]);
    let seen = registry_side.seen();
    assert_eq!(
        (seen[0].method.as_str(), seen[0].path.as_str()),
        ("POST", "/apis/ccompat/v7/subjects/shop.OrderPlaced")
    );
    assert_eq!(seen[0].authorization, "", "no credentials configured, none sent");
}

#[tokio::test]
async fn a_subject_not_registered_is_this_rows_problem_and_asked_again_next_time() {
    let registry_side = Fixture::start(Duration::ZERO, |_| {
        (404, r#"{"error_code": 40403, "message": "Schema not found"}"#.into())
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let registry =
        Registry::new(&config(&registry_side.url, SchemaType::Avro, Some(ORDER_AVSC), &dir)).unwrap();
    let error = registry.encode("orders", "{}").await.unwrap_err();
    assert!(!error.is_retryable());
    assert_eq!(
        error.to_string(),
        "schema registry: schema not registered under subject orders-value; register it or set auto_register = true"
    );
    assert!(matches!(error, EncodeError::NoSchema { .. }), "the row's topic chose the subject: {error:?}");
    registry.encode("orders", "{}").await.unwrap_err();
    assert_eq!(registry_side.seen().len(), 2, "a failure is not cached");

    // under record_name the subject is every row's: the operator must act
    let mut by_name = config(&registry_side.url, SchemaType::Avro, Some(ORDER_AVSC), &dir);
    by_name.subject_strategy = SubjectStrategy::RecordName;
    let error = Registry::new(&by_name).unwrap().encode("orders", "{}").await.unwrap_err();
    assert!(matches!(error, EncodeError::Refused { .. }), "{error:?}");
}

#[tokio::test]
async fn the_latest_version_is_used_without_a_schema_file() {
    let latest = serde_json::json!({"subject": "orders-value", "version": 3, "id": 9, "schema": ORDER_AVSC});
    let registry_side = Fixture::start(Duration::ZERO, move |_| (200, latest.to_string())).await;
    let dir = tempfile::tempdir().unwrap();
    let registry = Registry::new(&config(&registry_side.url, SchemaType::Avro, None, &dir)).unwrap();

    let value = registry.encode("orders", r#"{"id": "o-1", "amount": -1}"#).await.unwrap();
    assert_eq!(value, [&[0u8, 0, 0, 0, 9][..], b"\x06o-1\x01"].concat());
    let seen = registry_side.seen();
    assert_eq!(
        (seen[0].method.as_str(), seen[0].path.as_str()),
        ("GET", "/apis/ccompat/v7/subjects/orders-value/versions/latest")
    );

    // a payload that does not fit is a mismatch naming the subject, the id and the field
    let error = registry.encode("orders", r#"{"id": "o-1", "amount": "x"}"#).await.unwrap_err();
    assert_eq!(
        error.to_string(),
        r#"payload does not fit the schema of subject orders-value (id 9): field "amount": expected long, got string "x""#
    );
    let error = registry.encode("orders", "{not json").await.unwrap_err();
    assert!(
        matches!(&error, EncodeError::Mismatch { detail, .. } if detail.starts_with("payload: not JSON")),
        "{error}"
    );
    assert_eq!(registry_side.seen().len(), 1, "cached");
}

#[tokio::test]
async fn a_latest_schema_of_another_type_is_refused() {
    let latest = serde_json::json!({"id": 4, "schema": "syntax = \"proto3\";", "schemaType": "PROTOBUF"});
    let registry_side = Fixture::start(Duration::ZERO, move |_| (200, latest.to_string())).await;
    let dir = tempfile::tempdir().unwrap();
    let registry = Registry::new(&config(&registry_side.url, SchemaType::Avro, None, &dir)).unwrap();
    let error = registry.encode("orders", "{}").await.unwrap_err().to_string();
    assert!(
        error.contains("its latest schema (id 4) is PROTOBUF, but registry.schema_type is avro"),
        "{error}"
    );
}

#[tokio::test]
async fn json_and_protobuf_values_carry_their_schema_type() {
    let registry_side = Fixture::start(Duration::ZERO, |_| (200, r#"{"id": 1}"#.into())).await;
    let dir = tempfile::tempdir().unwrap();
    let mut json = config(&registry_side.url, SchemaType::Json, Some(r#"{"type": "object"}"#), &dir);
    json.auto_register = true;
    let value = Registry::new(&json).unwrap().encode("t", r#"{ "a" : 1 }"#).await.unwrap();
    assert_eq!(value, [&[0u8, 0, 0, 0, 1][..], br#"{"a":1}"#].concat());
    let body: serde_json::Value = serde_json::from_str(&registry_side.seen()[0].body).unwrap();
    assert_eq!(body["schemaType"], "JSON");

    let dir = tempfile::tempdir().unwrap();
    let mut proto = config(
        &registry_side.url,
        SchemaType::Protobuf,
        Some("syntax = \"proto3\"; message M { int32 n = 1; }"),
        &dir,
    );
    proto.auto_register = true;
    let value = Registry::new(&proto).unwrap().encode("t", r#"{"n": 150}"#).await.unwrap();
    // header, message index [0], field 1 varint 150
    assert_eq!(value, [0, 0, 0, 0, 1, 0, 0x08, 0x96, 0x01]);
    let body: serde_json::Value = serde_json::from_str(&registry_side.seen()[1].body).unwrap();
    assert_eq!(body["schemaType"], "PROTOBUF");
}

#[tokio::test]
async fn an_unreachable_or_slow_registry_is_retried() {
    // a port nothing listens on (bound, then released)
    let port = TcpListener::bind("127.0.0.1:0").await.unwrap().local_addr().unwrap().port();
    let dir = tempfile::tempdir().unwrap();
    let registry =
        Registry::new(&config(&format!("http://127.0.0.1:{port}"), SchemaType::Avro, None, &dir)).unwrap();
    let error = registry.encode("orders", "{}").await.unwrap_err();
    assert!(error.is_retryable(), "{error}");
    assert!(error.to_string().contains("GET /subjects/orders-value/versions/latest failed"), "{error}");

    let registry_side = Fixture::start(Duration::from_secs(2), |_| (200, "{}".into())).await;
    let mut slow = config(&registry_side.url, SchemaType::Avro, None, &dir);
    slow.timeout_ms = 100;
    let error = Registry::new(&slow).unwrap().encode("orders", "{}").await.unwrap_err();
    assert!(error.is_retryable() && error.to_string().contains("timed out (registry.timeout_ms)"), "{error}");

    let registry_side = Fixture::start(Duration::ZERO, |_| (503, "upstream down".into())).await;
    let error = Registry::new(&config(&registry_side.url, SchemaType::Avro, None, &dir))
        .unwrap()
        .encode("orders", "{}")
        .await
        .unwrap_err();
    assert!(error.is_retryable() && error.to_string().contains("503 Service Unavailable"), "{error}");
}

fn classified(call: Call, status: u16, body: &str) -> EncodeError {
    classify(call, "orders-value", "relay", StatusCode::from_u16(status).unwrap(), body.as_bytes())
}

#[test]
fn statuses_are_classified_with_the_setting_to_change() {
    let confluent = |code: u32, message: &str| format!(r#"{{"error_code": {code}, "message": "{message}"}}"#);
    for status in [429, 500, 502, 503, 504] {
        assert!(classified(Call::Register, status, "").is_retryable(), "{status}");
    }
    let incompatible =
        classified(Call::Register, 409, &confluent(409, "Schema being registered is incompatible"));
    assert!(!incompatible.is_retryable());
    let text = incompatible.to_string();
    assert!(
        text.contains("subject orders-value")
            && text.contains("incompatible with the subject's compatibility level"),
        "{text}"
    );
    let text = classified(Call::Register, 401, &confluent(40101, "Unauthorized")).to_string();
    assert!(text.contains("credentials of user \"relay\"") && text.contains("registry.password"), "{text}");
    assert!(text.contains(PASSWORD_ENV), "{text}");
    let text = classified(Call::Lookup, 403, &confluent(40301, "Forbidden")).to_string();
    assert!(
        text.contains("not allowed looking up a schema (403") && text.contains("registry.username"),
        "{text}"
    );
    let text = classified(Call::Register, 422, &confluent(42201, "Invalid schema")).to_string();
    assert!(
        text.contains("as invalid (422, error code 42201: \"Invalid schema\")")
            && text.contains("registry.schema_file"),
        "{text}"
    );
    let text = classified(Call::Lookup, 404, &confluent(40401, "Subject not found")).to_string();
    assert!(text.contains("schema not registered under subject orders-value"), "{text}");
    let unknown = classified(Call::Latest, 404, &confluent(40401, "Subject not found"));
    assert!(matches!(unknown, EncodeError::NoSchema { .. }), "{unknown:?}");
    let text = unknown.to_string();
    assert!(text.contains("subject orders-value: it has no schema in the registry"), "{text}");
    let no_version = classified(Call::Latest, 404, &confluent(40402, "Version not found"));
    assert!(matches!(no_version, EncodeError::NoSchema { .. }), "{no_version:?}");
    // a 404 that is not the registry's: the URL is wrong, for every row alike
    let wrong_url = classified(Call::Lookup, 404, "<html>Not Found</html>");
    assert!(matches!(wrong_url, EncodeError::Refused { .. }), "{wrong_url:?}");
    assert!(wrong_url.to_string().contains("check registry.url"), "{wrong_url}");
    let anonymous = classify(Call::Latest, "s", "", StatusCode::UNAUTHORIZED, b"").to_string();
    assert!(anonymous.contains("requires authentication (401); set registry.username"), "{anonymous}");
}

/// A registry stand-in that answers any request with a chunked (no `Content-Length`) 200 of
/// `bytes` bytes of JSON text, then closes.
async fn endless_answer(bytes: usize) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/apis/ccompat/v7", listener.local_addr().unwrap());
    tokio::spawn(async move {
        let (mut socket, _) = listener.accept().await.unwrap();
        let _ = socket.read(&mut [0u8; 4096]).await;
        let head = "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n";
        socket.write_all(head.as_bytes()).await.unwrap();
        let chunk = [b' '; 64 * 1024];
        for _ in 0..bytes.div_ceil(chunk.len()) {
            let framed = [format!("{:x}\r\n", chunk.len()).as_bytes(), &chunk, b"\r\n"].concat();
            if socket.write_all(&framed).await.is_err() {
                return; // (the client stopped reading: what the bound is for)
            }
        }
        let _ = socket.write_all(b"0\r\n\r\n").await;
    });
    url
}

#[tokio::test]
async fn an_answer_longer_than_the_bound_is_refused_before_it_is_read_whole() {
    let dir = tempfile::tempdir().unwrap();
    // with a Content-Length that says so
    let big = Fixture::start(Duration::ZERO, |_| (200, " ".repeat(client::MAX_RESPONSE_BYTES + 1))).await;
    let error =
        Registry::new(&config(&big.url, SchemaType::Avro, None, &dir)).unwrap().encode("o", "{}").await;
    let error = error.unwrap_err();
    assert!(matches!(error, EncodeError::Refused { .. }), "{error:?}");
    assert!(
        error.to_string().contains("is longer than 8388608 bytes")
            && error.to_string().contains("registry.url")
    );
    // and chunked, without one: the reading stops at the bound
    let url = endless_answer(2 * client::MAX_RESPONSE_BYTES).await;
    let error = Registry::new(&config(&url, SchemaType::Avro, None, &dir)).unwrap().encode("o", "{}").await;
    let error = error.unwrap_err();
    assert!(error.to_string().contains("is longer than 8388608 bytes"), "{error:?}");
}

#[tokio::test]
async fn the_password_file_is_read_at_each_request() {
    let registry_side = Fixture::start(Duration::ZERO, |_| (200, r#"{"id": 1}"#.into())).await;
    let dir = tempfile::tempdir().unwrap();
    let mut config = config(&registry_side.url, SchemaType::Avro, Some(ORDER_AVSC), &dir);
    let file = dir.path().join("registry-password");
    std::fs::write(&file, "one\n").unwrap();
    (config.auto_register, config.username, config.allow_http_credentials) = (true, "relay".into(), true);
    config.password_file = file.display().to_string();
    let registry = Registry::new(&config).unwrap();
    registry.encode("a", r#"{"id": "o", "amount": 1}"#).await.unwrap();
    std::fs::write(&file, "two\n").unwrap();
    registry.encode("b", r#"{"id": "o", "amount": 1}"#).await.unwrap();
    let sent: Vec<String> = registry_side.seen().into_iter().map(|seen| seen.authorization).collect();
    assert_eq!(sent, ["Basic cmVsYXk6b25l", "Basic cmVsYXk6dHdv"]); // relay:one, relay:two
    std::fs::remove_file(&file).unwrap();
    let error = registry.encode("c", "{}").await.unwrap_err();
    assert!(
        matches!(&error, EncodeError::Refused { detail, .. } if detail.contains("registry.password_file")),
        "{error:?}"
    );
}

#[test]
fn credentials_over_plain_http_are_refused_by_the_client_too() {
    let dir = tempfile::tempdir().unwrap();
    let mut plain = config("http://registry:8081", SchemaType::Avro, None, &dir);
    plain.username = "relay".into();
    plain.password = Secret::new("SENTINEL");
    let error = Decoder::new(&plain).err().unwrap();
    assert!(
        error.contains("registry.allow_http_credentials = true") && !error.contains("SENTINEL"),
        "{error}"
    );
    assert!(Registry::new(&plain).err().unwrap().contains("registry.url: is http://"));
    plain.allow_http_credentials = true;
    Decoder::new(&plain).unwrap();
}

#[tokio::test]
async fn a_value_whose_schema_id_names_protobuf_is_a_mismatch_for_the_reader_not_a_retry() {
    let proto = serde_json::json!({"schema": "syntax = \"proto3\"; message M { string id = 1; }", "schemaType": "PROTOBUF"});
    let registry_side = Fixture::start(Duration::ZERO, move |_| (200, proto.to_string())).await;
    let dir = tempfile::tempdir().unwrap();
    let decoder = Decoder::new(&config(&registry_side.url, SchemaType::Avro, None, &dir)).unwrap();
    let error = decoder.decode(&[0, 0, 0, 0, 42, 0x0a, 0x01, b'x']).await.unwrap_err();
    assert!(matches!(&error, EncodeError::Mismatch { schema_id: 42, .. }), "{error:?}");
    assert!(error.to_string().contains("schema id 42 is PROTOBUF"), "{error}");
}

#[test]
fn a_schema_file_that_does_not_parse_or_has_no_name_is_a_start_up_error() {
    let dir = tempfile::tempdir().unwrap();
    let broken = config("http://r", SchemaType::Avro, Some("{"), &dir);
    let error = Registry::new(&broken).err().unwrap();
    assert!(
        error.starts_with("registry.schema_file ") && error.contains("not a valid Avro schema"),
        "{error}"
    );
    let mut unnamed = config("http://r", SchemaType::Json, Some(r#"{"type": "object"}"#), &dir);
    unnamed.subject_strategy = SubjectStrategy::RecordName;
    let error = Registry::new(&unnamed).err().unwrap();
    assert!(error.contains("has no name for subject_strategy = \"record_name\""), "{error}");
    let mut ca = config("https://r", SchemaType::Avro, None, &dir);
    ca.ca_file = dir.path().join("schema").display().to_string();
    let error = Registry::new(&ca).err().unwrap();
    assert!(error.starts_with("registry.ca_file"), "{error}");
}

#[test]
fn a_registry_is_shared_across_tasks() {
    fn send_sync<T: Send + Sync>(_: &T) {}
    fn send<T: Send>(_: &T) {}
    let dir = tempfile::tempdir().unwrap();
    let mut config = config("http://r", SchemaType::Avro, None, &dir);
    config.password = Secret::new("SENTINEL");
    let registry = Registry::new(&config).unwrap();
    send_sync(&registry);
    send(&registry.encode("t", "{}"));
    let debug = format!("{registry:?}");
    assert!(debug.contains("http://r/") && !debug.contains("SENTINEL"), "{debug}");
}

#[test]
fn the_header_is_the_magic_byte_and_the_id_big_endian() {
    let mut out = Vec::new();
    write_header(0x0102_0304, &mut out);
    assert_eq!(out, [0, 1, 2, 3, 4]);
}
