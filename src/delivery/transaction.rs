//! The delivery stage's Kafka transaction (`kafka.transactional`): which records are in it, when
//! it is due, and what its commit settles.
//!
//! Invariants:
//! - a record Kafka acknowledged inside a transaction is not settled before the transaction
//!   commits: its position waits here, and the commit settles every one of them `Acked`, in the
//!   order they were acknowledged. An aborted or abandoned transaction settles nothing, so the
//!   source confirms or releases nothing of it and the next session sends it again (read back
//!   first, `read_committed`, so what did commit is not sent twice);
//! - a transaction is begun before its first record and committed only with nothing in flight;
//! - it is due once it holds `kafka.transaction_max_events` records or
//!   `kafka.transaction_max_bytes` bytes, has been open `kafka.transaction_max_ms`, or the source
//!   has nothing more to read right now; where it may commit (between the source's own
//!   transactions) is the source's to say.

use std::time::{Duration, Instant, SystemTime};

use crate::config::{KafkaConfig, OutboxId};
use crate::observe::trace::SpanData;

/// A record acknowledged in the open transaction, settled at its commit.
pub(super) struct Acked<P> {
    pub(super) position: P,
    /// When it was handed to the sink, and when its event was written: the latencies are
    /// measured to the commit.
    pub(super) at: Instant,
    pub(super) created_at: Option<SystemTime>,
    /// Its outbox (see `KafkaRecord::outbox`).
    pub(super) outbox: OutboxId,
    /// Its publish span, ended at the commit (`[tracing]`).
    pub(super) span: Option<Box<SpanData>>,
}

/// The open transaction's size.
#[derive(Debug, Clone, Copy)]
struct Open {
    began: tokio::time::Instant,
    records: usize,
    bytes: usize,
}

pub(super) struct Transaction<P> {
    max_records: usize,
    max_bytes: usize,
    max_open: Duration,
    open: Option<Open>,
    acked: Vec<Acked<P>>,
}

impl<P> Transaction<P> {
    pub(super) fn new(kafka: &KafkaConfig) -> Transaction<P> {
        Transaction {
            max_records: kafka.transaction_max_events,
            max_bytes: kafka.transaction_max_bytes,
            max_open: Duration::from_millis(kafka.transaction_max_ms),
            open: None,
            acked: Vec::new(),
        }
    }

    pub(super) fn is_open(&self) -> bool {
        self.open.is_some()
    }

    /// The sink began a transaction.
    pub(super) fn begun(&mut self) {
        self.open = Some(Open { began: tokio::time::Instant::now(), records: 0, bytes: 0 });
    }

    /// A record of `bytes` was handed over in the open transaction.
    pub(super) fn sent(&mut self, bytes: usize) {
        let open = self.open.as_mut().expect("a record is sent in an open transaction");
        open.records += 1;
        open.bytes += bytes;
    }

    /// Kafka acknowledged a record of the open transaction.
    pub(super) fn acked(&mut self, acked: Acked<P>) {
        self.acked.push(acked);
    }

    /// Whether the open transaction should commit (`idle`: the source has nothing more to read
    /// right now).
    pub(super) fn due(&self, idle: bool) -> bool {
        self.open.is_some_and(|open| {
            idle || open.records >= self.max_records
                || open.bytes >= self.max_bytes
                || open.began.elapsed() >= self.max_open
        })
    }

    /// When the open transaction becomes due by its age.
    pub(super) fn deadline(&self) -> Option<tokio::time::Instant> {
        self.open.map(|open| open.began + self.max_open)
    }

    /// The transaction committed: what it settles.
    pub(super) fn committed(&mut self) -> Vec<Acked<P>> {
        self.open = None;
        std::mem::take(&mut self.acked)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bounds(records: usize, bytes: usize, ms: u64) -> Transaction<u32> {
        let kafka: KafkaConfig = serde_json::from_value(serde_json::json!({
            "brokers": ["127.0.0.1:9092"], "transactional": true, "transaction_max_events": records,
            "transaction_max_bytes": bytes, "transaction_max_ms": ms,
        }))
        .unwrap();
        Transaction::new(&kafka)
    }

    #[test]
    fn a_transaction_is_due_at_any_bound_or_when_the_source_is_idle() {
        let mut t = bounds(3, 2_000, 60_000);
        assert!(!t.due(true), "nothing open is never due");
        t.begun();
        t.sent(10);
        assert!(!t.due(false));
        assert!(t.due(true), "an idle source commits what it sent");
        t.sent(10);
        t.sent(10);
        assert!(t.due(false), "three records reach the bound");
        let mut t = bounds(100, 2_000, 60_000);
        t.begun();
        t.sent(1_500);
        assert!(!t.due(false));
        t.sent(600);
        assert!(t.due(false), "2,100 bytes pass the bound");
    }

    #[test]
    fn a_commit_settles_the_acknowledged_in_order_and_closes_the_transaction() {
        let mut t = bounds(10, 2_000, 60_000);
        t.begun();
        for position in [7, 8, 9] {
            t.sent(1);
            t.acked(Acked {
                position,
                at: Instant::now(),
                created_at: None,
                outbox: OutboxId::default(),
                span: None,
            });
        }
        let settled: Vec<u32> = t.committed().into_iter().map(|a| a.position).collect();
        assert_eq!(settled, [7, 8, 9]);
        assert!(!t.is_open() && t.committed().is_empty());
    }
}
