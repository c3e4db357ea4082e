//! OTLP/HTTP export: batches of finished spans, JSON-encoded (the OTLP specification's JSON
//! mapping: ids in hex, times as decimal strings), posted to the traces endpoint.
//!
//! Invariants:
//! - one request at a time, at most [`MAX_BATCH`] spans, sent when the batch is full or
//!   [`BATCH_DELAY`] after its first span arrived;
//! - a batch the backend refuses, or does not answer within `tracing.export_timeout_ms`, is
//!   dropped and counted, never retried: the queue behind it keeps its bound;
//! - header values are sent, never logged.

use std::time::Duration;

use serde_json::{Value as Json, json};
use tokio::sync::mpsc;

use super::{SpanData, Value, to_hex, unix_nanos};
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
    resource: Json,
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

    /// Exports what arrives on `spans` until every sender is gone.
    pub(super) async fn run(self, mut spans: mpsc::Receiver<SpanData>) {
        let mut batch = Vec::with_capacity(MAX_BATCH);
        let mut warned = false;
        while spans.recv_many(&mut batch, MAX_BATCH).await > 0 {
            let deadline = tokio::time::Instant::now() + BATCH_DELAY;
            while batch.len() < MAX_BATCH {
                let more = MAX_BATCH - batch.len();
                match tokio::time::timeout_at(deadline, spans.recv_many(&mut batch, more)).await {
                    Ok(0) | Err(_) => break,
                    Ok(_) => {}
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
            batch.clear();
        }
    }

    async fn export(&self, batch: &[SpanData]) -> Result<(), String> {
        let body = serde_json::to_vec(&request(&self.resource, batch)).expect("JSON values encode");
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

/// The resource every span of the process belongs to.
fn resource(service_name: &str) -> Json {
    json!({ "attributes": [
        attribute("service.name", &Value::Str(service_name.to_string())),
        attribute("service.version", &Value::Str(env!("CARGO_PKG_VERSION").into())),
    ]})
}

/// One `ExportTraceServiceRequest`.
fn request(resource: &Json, batch: &[SpanData]) -> Json {
    let spans: Vec<Json> = batch.iter().map(span).collect();
    json!({ "resourceSpans": [{
        "resource": resource,
        "scopeSpans": [{
            "scope": { "name": "outbox-relay", "version": env!("CARGO_PKG_VERSION") },
            "spans": spans,
        }],
    }]})
}

fn span(span: &SpanData) -> Json {
    let mut encoded = json!({
        "traceId": span.context.trace_hex(),
        "spanId": span.context.span_hex(),
        "name": span.name,
        "kind": span.kind as i32,
        "startTimeUnixNano": unix_nanos(span.start).to_string(),
        "endTimeUnixNano": unix_nanos(span.end).to_string(),
        "attributes": span.attributes.iter().map(|(k, v)| attribute(k, v)).collect::<Vec<_>>(),
    });
    if let Some(parent) = &span.parent {
        encoded["parentSpanId"] = Json::String(to_hex(parent));
    }
    if !span.links.is_empty() {
        let links = span.links.iter().map(|l| json!({ "traceId": l.trace_hex(), "spanId": l.span_hex() }));
        encoded["links"] = Json::Array(links.collect());
    }
    if let Some(error) = &span.error {
        encoded["status"] = json!({ "code": 2, "message": error });
    }
    encoded
}

fn attribute(key: &str, value: &Value) -> Json {
    let value = match value {
        Value::Str(text) => json!({ "stringValue": text }),
        Value::Int(n) => json!({ "intValue": n.to_string() }),
    };
    json!({ "key": key, "value": value })
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
            error: None,
        };
        let body = request(&resource("relay-test"), &[data]);
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
        assert!(span.get("status").is_none());
    }
}
