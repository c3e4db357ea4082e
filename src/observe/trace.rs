//! The relay's spans (`[tracing]`): one per published event, parented to the row's
//! `traceparent`, from the event's commit (polling: `created_at`) to Kafka's acknowledgement;
//! spans of the relay's own work linked to the events it carried ([`work`]); exported over
//! OTLP/HTTP by a task of their own.
//!
//! Invariants:
//! - tracing never holds, delays or drops an event: a finished span is offered to a bounded
//!   queue ([`Tracer::finish`]) and dropped, counted, when the queue is full or the backend
//!   refuses it (`outbox_relay_trace_spans_dropped_total`); memory stays within
//!   `tracing.queue_size` spans and one export request;
//! - when `[tracing]` is off nothing is installed: the delivery stage's cost is one check of
//!   [`tracer`] per record;
//! - sampling: a row whose `traceparent` is sampled gets a span; one whose `traceparent` is not
//!   sampled gets none and its header goes out unchanged; a row without a valid one starts a trace
//!   of its own at `tracing.sample_ratio` ([`Tracer::begin`]);
//! - the record's `traceparent` header names the relay's span when there is one, so the
//!   consumer's span is its child;
//! - at shutdown, [`flush`] exports what is queued without the batch delay, waiting a bounded
//!   time (a session's span is made as the session ends).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime};

use tokio::sync::{Notify, mpsc};

use crate::config::TracingSettings;
use crate::observe::metrics::{SpanDropReason, metrics};

mod context;
mod otlp;
mod work;

pub use context::{TraceContext, new_span_id, to_hex};
pub use work::{Links, MAX_LINKS, Work};

/// The header that carries a trace's context, in a row's `headers` and a Kafka record's.
pub const TRACEPARENT: &str = "traceparent";

/// What kind of work a span is (OTLP's `SpanKind`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Internal = 1,
    Server = 2,
    Client = 3,
    Producer = 4,
    Consumer = 5,
}

/// An attribute's value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    Str(String),
    Int(i64),
}

impl From<&str> for Value {
    fn from(text: &str) -> Value {
        Value::Str(text.to_string())
    }
}

impl From<String> for Value {
    fn from(text: String) -> Value {
        Value::Str(text)
    }
}

impl From<i64> for Value {
    fn from(n: i64) -> Value {
        Value::Int(n)
    }
}

/// A finished span.
#[derive(Debug, Clone, PartialEq)]
pub struct SpanData {
    pub context: TraceContext,
    pub parent: Option<[u8; 8]>,
    pub name: String,
    pub kind: Kind,
    pub start: SystemTime,
    pub end: SystemTime,
    pub attributes: Vec<(&'static str, Value)>,
    /// Spans this one carried or relates to (a Kafka transaction's events, say).
    pub links: Vec<TraceContext>,
    /// Set when the work failed: why.
    pub error: Option<String>,
}

/// A span begun and not finished: the publish span a record carries until its acknowledgement.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Begun {
    pub context: TraceContext,
    pub parent: Option<[u8; 8]>,
    pub start: SystemTime,
}

impl Begun {
    /// The span, finished now.
    pub fn finish(&self, name: String, kind: Kind, attributes: Vec<(&'static str, Value)>) -> SpanData {
        SpanData {
            context: self.context,
            parent: self.parent,
            name,
            kind,
            start: self.start,
            end: SystemTime::now().max(self.start),
            attributes,
            links: Vec::new(),
            error: None,
        }
    }
}

/// The process's tracer: the sampling rule and the export queue.
#[derive(Debug)]
pub struct Tracer {
    sample_ratio: f64,
    queue: mpsc::Sender<SpanData>,
    progress: Arc<Progress>,
}

/// How far the exporter got with the spans queued, for [`flush`].
#[derive(Debug, Default)]
struct Progress {
    /// Spans taken into the queue.
    queued: AtomicU64,
    /// Spans the exporter is done with (exported, or dropped as refused).
    done: AtomicU64,
    /// [`flush`] asked the exporter not to wait for more spans before it sends a batch.
    hurrying: AtomicBool,
    hurry: Notify,
    /// The exporter is done with a batch.
    batch_done: Notify,
}

impl Progress {
    /// The exporter is done with `spans` more.
    fn done(&self, spans: usize) {
        self.done.fetch_add(spans as u64, Ordering::AcqRel);
        self.batch_done.notify_waiters();
    }

    /// Resolves when a batch should go without waiting for more spans.
    async fn hurried(&self) {
        let hurry = self.hurry.notified();
        if !self.hurrying.load(Ordering::Acquire) {
            hurry.await;
        }
    }
}

static TRACER: OnceLock<Tracer> = OnceLock::new();

/// The installed tracer; `None` when tracing is off.
pub fn tracer() -> Option<&'static Tracer> {
    TRACER.get()
}

/// Installs the process's tracer and spawns its exporter on the current runtime; `http` is the
/// client to send with (its TLS set up by the caller). A second call changes nothing.
pub fn install(settings: &TracingSettings, http: reqwest::Client) {
    let (queue, spans) = mpsc::channel(settings.queue_size);
    let progress = Arc::new(Progress::default());
    let tracer = Tracer { sample_ratio: settings.sample_ratio, queue, progress: progress.clone() };
    if TRACER.set(tracer).is_ok() {
        let exporter = otlp::Exporter::new(settings, http);
        tokio::spawn(exporter.run(spans, progress));
        tracing::info!(endpoint = %settings.endpoint, sample_ratio = settings.sample_ratio, "exporting spans over OTLP/HTTP");
    }
}

impl Tracer {
    /// A tracer whose spans go to `queue` (tests).
    pub fn with_queue(sample_ratio: f64, queue: mpsc::Sender<SpanData>) -> Tracer {
        Tracer { sample_ratio, queue, progress: Arc::default() }
    }

    /// Begins a span at `start` under `traceparent` (a row's header), by the sampling rule;
    /// `None`: no span, and the header (if any) goes out as it is.
    pub fn begin(&self, traceparent: Option<&str>, start: SystemTime) -> Option<Begun> {
        match traceparent.and_then(TraceContext::parse) {
            Some(parent) if parent.sampled => {
                Some(Begun { context: parent.child(), parent: Some(parent.span_id), start })
            }
            Some(_) => None,
            None if self.root_sampled() => Some(Begun { context: TraceContext::root(), parent: None, start }),
            None => None,
        }
    }

    /// Offers a finished span for export; dropped and counted when the queue is full.
    pub fn finish(&self, span: SpanData) {
        match self.queue.try_send(span) {
            Ok(()) => {
                self.progress.queued.fetch_add(1, Ordering::AcqRel);
            }
            Err(_) => {
                metrics().trace_spans_dropped.with_label_values(&[SpanDropReason::QueueFull.label()]).inc()
            }
        }
    }
}

/// Exports the spans queued so far without the batch delay, and waits until the exporter is
/// done with them (exported or dropped), at most `within`: at shutdown, before the process
/// ends. Nothing with tracing off.
pub async fn flush(within: Duration) {
    let Some(tracer) = tracer() else { return };
    let progress = &tracer.progress;
    let queued = progress.queued.load(Ordering::Acquire);
    progress.hurrying.store(true, Ordering::Release);
    progress.hurry.notify_one();
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let batch_done = progress.batch_done.notified();
        tokio::pin!(batch_done);
        batch_done.as_mut().enable();
        if progress.done.load(Ordering::Acquire) >= queued {
            return;
        }
        if tokio::time::timeout_at(deadline, batch_done).await.is_err() {
            let waiting = queued.saturating_sub(progress.done.load(Ordering::Acquire));
            tracing::warn!(spans = waiting, "spans not exported at shutdown within {within:?}: lost");
            return;
        }
    }
}

/// Nanoseconds since the Unix epoch.
fn unix_nanos(at: SystemTime) -> u128 {
    at.duration_since(SystemTime::UNIX_EPOCH).unwrap_or(Duration::ZERO).as_nanos()
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLED: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn a_sampled_parent_gets_a_child_span_and_an_unsampled_one_none() {
        let (queue, _spans) = mpsc::channel(1);
        let tracer = Tracer::with_queue(0.0, queue);
        let begun = tracer.begin(Some(SAMPLED), SystemTime::now()).unwrap();
        let parent = TraceContext::parse(SAMPLED).unwrap();
        assert_eq!(begun.context.trace_id, parent.trace_id);
        assert_eq!(begun.parent, Some(parent.span_id));
        assert_eq!(tracer.begin(Some(&SAMPLED.replace("-01", "-00")), SystemTime::now()), None);
        assert_eq!(tracer.begin(None, SystemTime::now()), None, "ratio 0: no trace of its own");
        assert_eq!(tracer.begin(Some("garbage"), SystemTime::now()), None);
    }

    #[test]
    fn a_row_without_a_parent_starts_a_trace_at_the_ratio() {
        let (queue, _spans) = mpsc::channel(1);
        let always = Tracer::with_queue(1.0, queue);
        let begun = always.begin(None, SystemTime::now()).unwrap();
        assert_eq!(begun.parent, None);
        assert!(begun.context.sampled);
    }

    #[test]
    fn a_full_queue_drops_the_span_and_counts_it() {
        let (queue, mut spans) = mpsc::channel(1);
        let tracer = Tracer::with_queue(1.0, queue);
        let span =
            tracer.begin(None, SystemTime::now()).unwrap().finish("send t".into(), Kind::Producer, vec![]);
        let dropped =
            || metrics().trace_spans_dropped.with_label_values(&[SpanDropReason::QueueFull.label()]).get();
        let before = dropped();
        tracer.finish(span.clone());
        tracer.finish(span.clone());
        assert_eq!(dropped(), before + 1);
        assert_eq!(spans.try_recv().unwrap(), span);
    }
}
