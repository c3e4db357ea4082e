//! The delivery stage's spans (`[tracing]`): a record's publish span, begun when the stage
//! first sends it and finished at Kafka's acknowledgement (with Kafka transactions: at the
//! commit that makes it visible), and a span per transaction commit linked to the events it
//! carried.
//!
//! Invariants:
//! - a span starts at the event's commit time (polling: its `created_at`; the time it was first
//!   sent when the table has neither), so its duration is the event's time in the outbox plus
//!   Kafka's: the `outbox_relay_end_to_end_latency_seconds` an SRE reads, per event;
//! - the record's `traceparent` header is rewritten to name the span before the record is first
//!   sent, and never again: a record sent again (held, refused and retried) keeps its span;
//! - a record sent again as Kafka first held it (`republish`) keeps its original headers and
//!   gets no span.

use std::time::SystemTime;

use crate::config::PerOutbox;
use crate::observe::trace::{Kind, SpanData, TRACEPARENT, TraceContext, Tracer, Value};
use crate::record::KafkaRecord;
use crate::sink::Written;

/// What the stage's spans say besides the record: the tracer, the mode, the outboxes' names.
pub(super) struct Spans {
    tracer: &'static Tracer,
    mode: &'static str,
    outboxes: PerOutbox<String>,
}

impl Spans {
    pub(super) fn new(tracer: &'static Tracer, mode: &'static str, outboxes: PerOutbox<String>) -> Spans {
        Spans { tracer, mode, outboxes }
    }

    /// Begins `record`'s publish span if the sampling rule takes it, and points its
    /// `traceparent` header at the span.
    pub(super) fn begin(&self, record: &mut KafkaRecord) {
        if record.trace.is_some() || record.as_written.is_some() {
            return;
        }
        let header = record.row_headers.iter().position(|(k, _)| k == TRACEPARENT);
        let parent = header.map(|i| record.row_headers[i].1.as_str());
        let start = record.created_at.unwrap_or_else(SystemTime::now);
        let Some(begun) = self.tracer.begin(parent, start) else { return };
        let value = begun.context.to_string();
        match header {
            Some(i) => record.row_headers[i].1 = value,
            None => record.row_headers.push((TRACEPARENT.to_string(), value)),
        }
        record.trace = Some(Box::new(begun));
    }

    /// `record`'s publish span, finished now (Kafka wrote it at `written`); `None` when it has
    /// none.
    pub(super) fn acknowledged(&self, record: &KafkaRecord, written: Written) -> Option<Box<SpanData>> {
        let begun = record.trace.as_ref()?;
        let attributes = vec![
            ("messaging.system", Value::from("kafka")),
            ("messaging.operation.type", "send".into()),
            ("messaging.operation.name", "send".into()),
            ("messaging.destination.name", record.topic.clone().into()),
            ("messaging.destination.partition.id", written.partition.to_string().into()),
            ("messaging.kafka.offset", Value::Int(written.offset)),
            ("messaging.kafka.message.key", record.key.clone().into()),
            ("messaging.message.id", record.id.clone().into()),
            ("outbox_relay.outbox", self.outboxes[record.outbox].clone().into()),
            ("outbox_relay.event_type", record.event_type.clone().into()),
            ("outbox_relay.aggregate_type", record.aggregate_type.clone().into()),
            ("outbox_relay.mode", self.mode.into()),
        ];
        Some(Box::new(begun.finish(format!("send {}", record.topic), Kind::Producer, attributes)))
    }

    /// Exports a finished publish span (with Kafka transactions, ended again at the commit).
    pub(super) fn finish(&self, span: SpanData) {
        self.tracer.finish(span);
    }

    /// A Kafka transaction committed at `end` after beginning its commit at `start`: its span,
    /// linked to the publish spans it made visible, which end with it.
    pub(super) fn committed(&self, start: SystemTime, spans: Vec<SpanData>) {
        if spans.is_empty() {
            return;
        }
        let end = SystemTime::now();
        let links: Vec<TraceContext> = spans.iter().map(|s| s.context).collect();
        let attributes = vec![
            ("messaging.system", Value::from("kafka")),
            ("outbox_relay.mode", self.mode.into()),
            ("outbox_relay.events", Value::Int(spans.len() as i64)),
        ];
        for mut span in spans {
            span.end = end.max(span.start);
            self.tracer.finish(span);
        }
        let commit = TraceContext::root();
        self.tracer.finish(SpanData {
            context: commit,
            parent: None,
            name: "kafka transaction commit".into(),
            kind: Kind::Client,
            start,
            end,
            attributes,
            links,
            error: None,
        });
    }
}
