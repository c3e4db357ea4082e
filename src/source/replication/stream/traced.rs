//! The stream's spans (`[tracing]`): a `stream session` span from the session's start to its
//! end, and an `lsn confirmation` span per position confirmed to PostgreSQL that covered at
//! least one event, each linked to the publish spans of the events it carried.
//!
//! Invariants:
//! - a confirmation's events are those of the transactions it covers (their commit record lies
//!   before the confirmed position), the same ones whose ids it records as published: Kafka
//!   acknowledged each (or the dead-letter table holds it), which is what made it possible;
//! - a confirmation that covers no event (a keepalive's, a heartbeat's: an idle relay confirms
//!   one every few seconds) makes no span; one that does follows the work-span sampling rule
//!   ([`crate::observe::trace::Work`]);
//! - what is kept per transaction is bounded as a span's links are, and dropped at its
//!   confirmation; with `[tracing]` off none of this exists.

use std::collections::BTreeMap;
use std::time::SystemTime;

use super::super::MODE;
use crate::config::{OutboxId, PerOutbox};
use crate::lsn::Lsn;
use crate::observe::trace::{Links, Tracer, Value, Work};
use crate::outboxes::Outboxes;

/// What the events of one transaction carried.
#[derive(Debug, Default)]
struct Carried {
    events: u64,
    outboxes: Vec<OutboxId>,
    links: Links,
}

pub(super) struct StreamSpans {
    tracer: &'static Tracer,
    slot: String,
    names: PerOutbox<String>,
    /// The session's start, and the position it streamed from.
    start: SystemTime,
    start_lsn: Lsn,
    /// Every event the session handed to Kafka, and the first of their publish spans.
    session_events: u64,
    session_links: Links,
    /// What each transaction not confirmed yet carried, by its commit position.
    by_commit: BTreeMap<Lsn, Carried>,
    /// Since when a position past the confirmed one could be confirmed: the start of the next
    /// confirmation's span.
    confirmable_since: Option<SystemTime>,
}

impl StreamSpans {
    /// The spans of a session streaming from `start_lsn` of `slot`.
    pub(super) fn new(
        tracer: &'static Tracer,
        slot: &str,
        outboxes: &Outboxes,
        start_lsn: Lsn,
    ) -> StreamSpans {
        StreamSpans::named(tracer, slot, outboxes.per(|o| o.name.clone()), start_lsn)
    }

    /// As [`StreamSpans::new`], with the outboxes' names.
    fn named(tracer: &'static Tracer, slot: &str, names: PerOutbox<String>, start_lsn: Lsn) -> StreamSpans {
        StreamSpans {
            tracer,
            slot: slot.to_string(),
            names,
            start: SystemTime::now(),
            start_lsn,
            session_events: 0,
            session_links: Links::default(),
            by_commit: BTreeMap::new(),
            confirmable_since: None,
        }
    }

    /// An event of `outbox`, of the transaction committed at `commit`, was handed to Kafka,
    /// with the publish span(s) of `links` (none when it was not sampled).
    pub(super) fn sent(&mut self, commit: Lsn, outbox: OutboxId, links: Links) {
        self.session_events += 1;
        self.session_links.extend(&links);
        let carried = match self.by_commit.last_entry() {
            Some(last) if *last.key() == commit => last.into_mut(),
            _ => self.by_commit.entry(commit).or_default(),
        };
        carried.events += 1;
        if !carried.outboxes.contains(&outbox) {
            carried.outboxes.push(outbox);
        }
        carried.links.extend(&links);
    }

    /// A position past the confirmed one may be confirmed (Kafka acknowledged what it waited
    /// for): the next confirmation's span starts now, unless it started already.
    pub(super) fn confirmable(&mut self) {
        self.confirmable_since.get_or_insert_with(SystemTime::now);
    }

    /// `lsn` was confirmed to PostgreSQL after `previous`: the span of the confirmation, when it
    /// covered an event.
    pub(super) fn confirmed(&mut self, previous: Lsn, lsn: Lsn) {
        let start = self.confirmable_since.take().unwrap_or_else(SystemTime::now);
        let later = self.by_commit.split_off(&lsn);
        let covered = std::mem::replace(&mut self.by_commit, later);
        if covered.is_empty() {
            return;
        }
        let (transactions, mut all) = (covered.len(), Carried::default());
        for carried in covered.into_values() {
            all.events += carried.events;
            all.links.extend(&carried.links);
            for outbox in carried.outboxes {
                if !all.outboxes.contains(&outbox) {
                    all.outboxes.push(outbox);
                }
            }
        }
        let outboxes: Vec<&str> = all.outboxes.iter().map(|o| self.names[*o].as_str()).collect();
        let attributes = vec![
            ("outbox_relay.mode", Value::from(MODE.label())),
            ("outbox_relay.slot", self.slot.clone().into()),
            ("outbox_relay.lsn", lsn.to_string().into()),
            ("outbox_relay.previous_lsn", previous.to_string().into()),
            ("outbox_relay.events", Value::Int(all.events as i64)),
            ("outbox_relay.transactions", Value::Int(transactions as i64)),
            ("outbox_relay.outboxes", outboxes.join(",").into()),
        ];
        let work = Work { name: "lsn confirmation", start, links: all.links, attributes, error: None };
        self.tracer.work(work);
    }

    /// The session ended, having confirmed `confirmed` (`failed`: why it ended, when it failed).
    pub(super) fn ended(self, confirmed: Lsn, failed: Option<String>) {
        let attributes = vec![
            ("outbox_relay.mode", Value::from(MODE.label())),
            ("outbox_relay.slot", self.slot.into()),
            ("outbox_relay.start_lsn", self.start_lsn.to_string().into()),
            ("outbox_relay.lsn", confirmed.to_string().into()),
            ("outbox_relay.events", Value::Int(self.session_events as i64)),
        ];
        let links = self.session_links;
        self.tracer.work(Work {
            name: "stream session",
            start: self.start,
            links,
            attributes,
            error: failed,
        });
    }
}

#[cfg(test)]
mod tests {
    use tokio::sync::mpsc;

    use super::*;
    use crate::observe::trace::{SpanData, TraceContext};

    fn links(n: usize) -> (Links, Vec<TraceContext>) {
        let spans: Vec<TraceContext> = (0..n).map(|_| TraceContext::root()).collect();
        let mut links = Links::default();
        spans.iter().for_each(|s| links.push(*s));
        (links, spans)
    }

    fn attribute<'a>(span: &'a SpanData, key: &str) -> &'a Value {
        &span.attributes.iter().find(|(k, _)| *k == key).unwrap_or_else(|| panic!("{key}: {span:?}")).1
    }

    #[test]
    fn a_confirmation_links_the_events_of_the_transactions_it_covers_and_an_idle_one_makes_no_span() {
        // given a session whose first two transactions carried sampled events, and a third
        let (queue, mut spans) = mpsc::channel(8);
        let tracer: &'static Tracer = Box::leak(Box::new(Tracer::with_queue(0.0, queue)));
        let names: PerOutbox<String> = ["orders", "payments"].map(String::from).into_iter().collect();
        let ids: Vec<OutboxId> = names.iter().map(|(id, _)| id).collect();
        let (orders, payments) = (ids[0], ids[1]);
        let mut s = StreamSpans::named(tracer, "slot_a", names, Lsn(10));
        let (first, first_spans) = links(2);
        let (second, second_spans) = links(1);
        s.sent(Lsn(100), orders, first);
        s.sent(Lsn(100), orders, Links::default());
        s.sent(Lsn(200), payments, second);
        s.sent(Lsn(300), orders, Links::default());

        // when the position after the second transaction is confirmed, then after the third
        s.confirmable();
        s.confirmed(Lsn(10), Lsn(250));
        s.confirmed(Lsn(250), Lsn(350));
        s.confirmed(Lsn(350), Lsn(400));

        // then the first confirmation's span links the three sampled events of both
        let span = spans.try_recv().unwrap();
        assert_eq!(span.name, "lsn confirmation");
        assert_eq!(span.links, [first_spans, second_spans].concat());
        assert_eq!(attribute(&span, "outbox_relay.events"), &Value::Int(3));
        assert_eq!(attribute(&span, "outbox_relay.transactions"), &Value::Int(2));
        assert_eq!(attribute(&span, "outbox_relay.lsn"), &Value::Str(Lsn(250).to_string()));
        assert_eq!(attribute(&span, "outbox_relay.outboxes"), &Value::Str("orders,payments".into()));
        // and the second, which carried no sampled event, none at ratio 0; the idle third none
        assert!(spans.try_recv().is_err());

        // and the session's span links every sampled event of the session
        s.ended(Lsn(400), None);
        let session = spans.try_recv().unwrap();
        assert_eq!((session.name.as_str(), session.links.len()), ("stream session", 3));
        assert_eq!(attribute(&session, "outbox_relay.events"), &Value::Int(4));
        assert_eq!(attribute(&session, "outbox_relay.slot"), &Value::Str("slot_a".into()));
    }
}
