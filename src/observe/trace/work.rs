//! Spans of the relay's own work: a stream session, a first copy, a polling claim, an LSN
//! confirmation. Each is the root of a trace of its own, linked to the publish spans of the
//! events it carried.
//!
//! Invariants:
//! - sampling: a work span is kept when any event it carried has a publish span (that event
//!   was sampled), and otherwise at `tracing.sample_ratio`, like a row without a parent; with
//!   the ratio at 0, work that carried no sampled event makes no span;
//! - a span holds at most [`MAX_LINKS`] links (the first ones); the rest are counted in
//!   `outbox_relay.links_dropped`, so a session of millions of events holds a few kilobytes;
//! - whether work that carried no event at all gets a span is the caller's rule (a claim and a
//!   confirmation do not: an idle relay would make one every few hundred milliseconds).

use std::time::SystemTime;

use super::{Kind, SpanData, TraceContext, Tracer, Value};

/// The most links a span of the relay's work holds.
pub const MAX_LINKS: usize = 128;

/// The publish spans of the events a piece of work carried: the first [`MAX_LINKS`], and how
/// many more.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Links {
    first: Vec<TraceContext>,
    more: u64,
}

impl Links {
    /// One more event's publish span.
    pub fn push(&mut self, span: TraceContext) {
        if self.first.len() < MAX_LINKS {
            self.first.push(span);
        } else {
            self.more += 1;
        }
    }

    /// Adds `other`'s links after these.
    pub fn extend(&mut self, other: &Links) {
        let room = MAX_LINKS - self.first.len();
        let taken = other.first.len().min(room);
        self.first.extend_from_slice(&other.first[..taken]);
        self.more += (other.first.len() - taken) as u64 + other.more;
    }

    /// The spans linked (the first [`MAX_LINKS`]).
    pub fn linked(&self) -> &[TraceContext] {
        &self.first
    }

    /// Whether no event carried had a publish span.
    pub fn is_empty(&self) -> bool {
        self.first.is_empty()
    }

    /// How many publish spans in all (those linked and those only counted).
    pub fn len(&self) -> u64 {
        self.first.len() as u64 + self.more
    }
}

/// A piece of the relay's work, finished now: what [`Tracer::work`] makes a span of.
#[derive(Debug)]
pub struct Work {
    /// The span's name (`polling claim`, ...): a kind of work, never an id.
    pub name: &'static str,
    pub start: SystemTime,
    pub links: Links,
    pub attributes: Vec<(&'static str, Value)>,
    /// Set when the work failed: why.
    pub error: Option<String>,
}

impl Tracer {
    /// Exports `work` as a span (kind `INTERNAL`, ending now) when the sampling rule keeps it
    /// (see the module doc); returns whether it did.
    pub fn work(&self, work: Work) -> bool {
        if work.links.is_empty() && !self.root_sampled() {
            return false;
        }
        let Work { name, start, links, mut attributes, error } = work;
        if links.more > 0 {
            attributes.push(("outbox_relay.links_dropped", Value::Int(links.more as i64)));
        }
        self.finish(SpanData {
            context: TraceContext::root(),
            parent: None,
            name: name.to_string(),
            kind: Kind::Internal,
            start,
            end: SystemTime::now().max(start),
            attributes,
            links: links.first,
            error,
        });
        true
    }

    /// Whether a trace of its own is started, at `tracing.sample_ratio`.
    pub(super) fn root_sampled(&self) -> bool {
        self.sample_ratio > 0.0 && rand::random::<f64>() < self.sample_ratio
    }
}

#[cfg(test)]
mod tests {
    use tokio::sync::mpsc;

    use super::*;

    fn work(links: Links) -> Work {
        Work { name: "polling claim", start: SystemTime::now(), links, attributes: vec![], error: None }
    }

    #[test]
    fn links_keep_the_first_ones_and_count_the_rest() {
        let mut links = Links::default();
        let spans: Vec<TraceContext> = (0..MAX_LINKS + 5).map(|_| TraceContext::root()).collect();
        for span in &spans[..100] {
            links.push(*span);
        }
        let mut later = Links::default();
        for span in &spans[100..] {
            later.push(*span);
        }
        links.extend(&later);
        assert_eq!(links.first, spans[..MAX_LINKS]);
        assert_eq!((links.more, links.len()), (5, MAX_LINKS as u64 + 5));
        links.extend(&later);
        assert_eq!(links.more, 5 + spans.len() as u64 - 100);
    }

    #[test]
    fn work_that_carried_a_sampled_event_is_kept_and_other_work_only_at_the_ratio() {
        let (queue, mut spans) = mpsc::channel(4);
        let never = Tracer::with_queue(0.0, queue.clone());
        assert!(!never.work(work(Links::default())), "ratio 0 and no sampled event: no span");
        let event = TraceContext::root();
        let mut links = Links::default();
        for _ in 0..=MAX_LINKS {
            links.push(event);
        }
        assert!(never.work(work(links)));
        let span = spans.try_recv().unwrap();
        assert_eq!((span.name.as_str(), span.kind, span.parent), ("polling claim", Kind::Internal, None));
        assert_eq!(span.links.len(), MAX_LINKS);
        assert_ne!(span.context.trace_id, event.trace_id, "a trace of its own");
        assert_eq!(span.attributes, [("outbox_relay.links_dropped", Value::Int(1))]);
        let always = Tracer::with_queue(1.0, queue);
        assert!(always.work(work(Links::default())), "ratio 1: every piece of work");
        assert!(spans.try_recv().unwrap().links.is_empty());
    }
}
