//! OTLP/HTTP export: batches of finished spans, JSON-encoded (the OTLP specification's JSON
//! mapping: ids in hex, times as decimal strings), posted to the traces endpoint.
//!
//! Invariants:
//! - one request at a time, at most [`MAX_BATCH`] spans, sent when the batch is full or
//!   [`BATCH_DELAY`] after its first span arrived;
//! - a batch the backend refuses, or does not answer within `tracing.export_timeout_ms`, is
//!   dropped and counted, never retried: the queue behind it keeps its bound;
//! - header values are sent, never logged;
//! - once [`super::flush`] asks, a batch goes as soon as it holds what is queued (no batch
//!   delay), and each batch done is told to [`super::Progress`].

use std::io::Write;
use std::time::Duration;

use tokio::sync::mpsc;

use super::{Progress, SpanData, Value, to_hex, unix_nanos};
use crate::config::{Secret, TracingSettings};
use crate::observe::metrics::{SpanDropReason, metrics};

/// Spans per export request.
pub const MAX_BATCH: usize = 512;
/// How long a batch waits for more spans after its first.
pub const BATCH_DELAY: Duration = Duration::from_millis(500);

pub(super) struct Exporter {
    http: reqwest::Client,
    endpoint: String,
    headers: Vec<(String, Secret)>,
    timeout: Duration,
    resource: Vec<u8>,
}

impl Exporter {
    pub(super) fn new(settings: &TracingSettings, http: reqwest::Client) -> Exporter {
        Exporter {
            http,
            endpoint: settings.endpoint.clone(),
            headers: settings.headers.clone(),
            timeout: Duration::from_millis(settings.export_timeout_ms),
            resource: resource(&settings.service_name),
        }
    }

    /// Exports what arrives on `spans` until every sender is gone, telling `progress`.
    pub(super) async fn run(self, mut spans: mpsc::Receiver<SpanData>, progress: std::sync::Arc<Progress>) {
        let mut batch = Vec::with_capacity(MAX_BATCH);
        let mut warned = false;
        while spans.recv_many(&mut batch, MAX_BATCH).await > 0 {
            let deadline = tokio::time::Instant::now() + BATCH_DELAY;
            while batch.len() < MAX_BATCH {
                let more = MAX_BATCH - batch.len();
                tokio::select! {
                    biased;
                    _ = progress.hurried() => break,
                    got = tokio::time::timeout_at(deadline, spans.recv_many(&mut batch, more)) => match got {
                        Ok(0) | Err(_) => break,
                        Ok(_) => {}
                    },
                }
            }
            let m = metrics();
            match self.export(&batch).await {
                Ok(()) => {
                    m.trace_spans_exported.inc_by(batch.len() as u64);
                    if warned {
                        tracing::info!(endpoint = %self.endpoint, "the tracing backend takes spans again");
                        warned = false;
                    }
                }
                Err(why) => {
                    let dropped =
                        m.trace_spans_dropped.with_label_values(&[SpanDropReason::ExportFailed.label()]);
                    dropped.inc_by(batch.len() as u64);
                    if !warned {
                        tracing::warn!(endpoint = %self.endpoint, spans = batch.len(), "cannot export spans ({why}); dropping them until the backend answers (outbox_relay_trace_spans_dropped_total counts them; no event waits for a span)");
                        warned = true;
                    }
                }
            }
            progress.done(batch.len());
            batch.clear();
        }
    }

    async fn export(&self, batch: &[SpanData]) -> Result<(), String> {
        let body = request(&self.resource, batch);
        let mut request =
            self.http.post(&self.endpoint).timeout(self.timeout).header("content-type", "application/json");
        for (name, value) in &self.headers {
            request = request.header(name.as_str(), value.expose());
        }
        let response = request.body(body).send().await.map_err(|e| e.without_url().to_string())?;
        let status = response.status();
        if status.is_success() {
            return Ok(());
        }
        let text = response.text().await.unwrap_or_default();
        Err(format!("HTTP {status}: {}", text.chars().take(200).collect::<String>()))
    }
}

/// The resource every span of the process belongs to, encoded once.
fn resource(service_name: &str) -> Vec<u8> {
    let mut out = br#"{"attributes":["#.to_vec();
    attribute(&mut out, "service.name", &Value::Str(service_name.to_string()));
    out.push(b',');
    attribute(&mut out, "service.version", &Value::Str(env!("CARGO_PKG_VERSION").into()));
    out.extend_from_slice(b"]}");
    out
}

/// One `ExportTraceServiceRequest`, written straight into one buffer (no JSON tree per span: at
/// every event sampled, building `serde_json::Value`s was most of the exporter's cost).
fn request(resource: &[u8], batch: &[SpanData]) -> Vec<u8> {
    let mut out = Vec::with_capacity(256 + batch.len() * 1_200);
    out.extend_from_slice(br#"{"resourceSpans":[{"resource":"#);
    out.extend_from_slice(resource);
    out.extend_from_slice(br#","scopeSpans":[{"scope":{"name":"outbox-relay","version":""#);
    out.extend_from_slice(env!("CARGO_PKG_VERSION").as_bytes());
    out.extend_from_slice(br#""},"spans":["#);
    for (i, data) in batch.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        span(&mut out, data);
    }
    out.extend_from_slice(b"]}]}]}");
    out
}

fn span(out: &mut Vec<u8>, span: &SpanData) {
    let (trace, id) = (span.context.trace_hex(), span.context.span_hex());
    write!(out, r#"{{"traceId":"{trace}","spanId":"{id}","name":"#).expect("writing to a Vec");
    string(out, &span.name);
    let (start, end) = (unix_nanos(span.start), unix_nanos(span.end));
    write!(
        out,
        r#","kind":{},"startTimeUnixNano":"{start}","endTimeUnixNano":"{end}","attributes":["#,
        span.kind as i32
    )
    .expect("writing to a Vec");
    for (i, (key, value)) in span.attributes.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        attribute(out, key, value);
    }
    out.push(b']');
    if let Some(parent) = &span.parent {
        write!(out, r#","parentSpanId":"{}""#, to_hex(parent)).expect("writing to a Vec");
    }
    if !span.links.is_empty() {
        out.extend_from_slice(br#","links":["#);
        for (i, link) in span.links.iter().enumerate() {
            let comma = if i > 0 { "," } else { "" };
            write!(out, r#"{comma}{{"traceId":"{}","spanId":"{}"}}"#, link.trace_hex(), link.span_hex())
                .expect("writing to a Vec");
        }
        out.push(b']');
    }
    if let Some(error) = &span.error {
        out.extend_from_slice(br#","status":{"code":2,"message":"#);
        string(out, error);
        out.push(b'}');
    }
    out.push(b'}');
}

fn attribute(out: &mut Vec<u8>, key: &str, value: &Value) {
    out.extend_from_slice(br#"{"key":"#);
    string(out, key);
    match value {
        Value::Str(text) => {
            out.extend_from_slice(br#","value":{"stringValue":"#);
            string(out, text);
        }
        Value::Int(n) => write!(out, r#","value":{{"intValue":"{n}""#).expect("writing to a Vec"),
    }
    out.extend_from_slice(b"}}");
}

/// `text` as a JSON string, escaped.
fn string(out: &mut Vec<u8>, text: &str) {
    serde_json::to_writer(&mut *out, text).expect("a str encodes");
}

#[cfg(test)]
mod tests {
    use std::time::SystemTime;

    use super::*;
    use crate::observe::trace::{Kind, TraceContext};

    #[test]
    fn a_span_encodes_as_otlp_json() {
        let parent = TraceContext::parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01").unwrap();
        let start = SystemTime::UNIX_EPOCH + Duration::from_nanos(1_000_000_007);
        let data = SpanData {
            context: parent.child(),
            parent: Some(parent.span_id),
            name: "send orders".into(),
            kind: Kind::Producer,
            start,
            end: start + Duration::from_millis(3),
            attributes: vec![
                ("messaging.kafka.offset", Value::Int(42)),
                ("messaging.system", "kafka".into()),
            ],
            links: vec![parent],
            error: Some("a \"quoted\" reason".into()),
        };
        let body: serde_json::Value =
            serde_json::from_slice(&request(&resource("relay-test"), &[data])).unwrap();
        let resource = &body["resourceSpans"][0];
        assert_eq!(resource["resource"]["attributes"][0]["value"]["stringValue"], "relay-test");
        let span = &resource["scopeSpans"][0]["spans"][0];
        assert_eq!(span["traceId"], "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(span["parentSpanId"], "00f067aa0ba902b7");
        assert_eq!(span["kind"], 4);
        assert_eq!(span["startTimeUnixNano"], "1000000007");
        assert_eq!(span["endTimeUnixNano"], "1003000007");
        assert_eq!(span["attributes"][0]["value"]["intValue"], "42");
        assert_eq!(span["links"][0]["spanId"], "00f067aa0ba902b7");
        assert_eq!(span["status"]["message"], "a \"quoted\" reason");
        assert_eq!(span["status"]["code"], 2);
    }
}
