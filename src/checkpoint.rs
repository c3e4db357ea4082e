//! The ordered in-flight tracker: which WAL position may be confirmed to PostgreSQL.
//!
//! Transactions are registered in commit order (the order pgoutput streams them). Each counts
//! its events not yet acknowledged by Kafka. The confirmable position is the commit `end_lsn`
//! of the longest prefix of transactions that are committed (their Commit was received) and
//! fully acknowledged. A transaction with thousands of events sharing nearby LSNs is confirmed
//! only after the last of them is acknowledged, and never before an earlier transaction.
//!
//! Invariants (unit-tested below):
//! - the confirmed position only moves forward;
//! - it never passes the commit of a transaction with an unacknowledged event;
//! - acknowledgements may arrive in any order.

use std::collections::VecDeque;

use crate::lsn::Lsn;

/// Identifies a transaction registered with [`Tracker::begin`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TxnId(u64);

#[derive(Debug)]
struct Txn {
    pending: usize,
    commit_end: Option<Lsn>,
}

#[derive(Debug, Default)]
pub struct Tracker {
    /// Transactions not yet confirmed, oldest first; `txns[0]` has id `first_id`.
    txns: VecDeque<Txn>,
    first_id: u64,
    confirmed: Lsn,
    in_flight_events: usize,
}

impl Tracker {
    /// A tracker whose confirmed position starts at `confirmed` (the slot's).
    pub fn new(confirmed: Lsn) -> Tracker {
        Tracker { confirmed, ..Default::default() }
    }

    /// Registers the next transaction in commit order.
    pub fn begin(&mut self) -> TxnId {
        self.txns.push_back(Txn { pending: 0, commit_end: None });
        TxnId(self.first_id + self.txns.len() as u64 - 1)
    }

    fn txn(&mut self, id: TxnId) -> &mut Txn {
        let index = id.0.checked_sub(self.first_id).expect("transaction already confirmed") as usize;
        &mut self.txns[index]
    }

    /// One more event of `id` is on its way to Kafka.
    pub fn sent(&mut self, id: TxnId) {
        self.txn(id).pending += 1;
        self.in_flight_events += 1;
    }

    /// Kafka acknowledged (or the relay otherwise settled, e.g. dead-lettered) one event of `id`.
    pub fn acked(&mut self, id: TxnId) {
        let txn = self.txn(id);
        txn.pending = txn.pending.checked_sub(1).expect("more acknowledgements than events");
        self.in_flight_events -= 1;
    }

    /// The Commit of `id` was received; its `end_lsn` is where a restart would resume after it.
    ///
    /// A transaction with nothing left in flight, behind a committed one still waiting, adds only
    /// its end: it is folded into that one (which is then confirmed through the later end), so
    /// a Kafka stall does not grow the queue by one entry per transaction that had no outbox
    /// event (PostgreSQL 14 streams such empty transactions to pgoutput).
    pub fn commit(&mut self, id: TxnId, end_lsn: Lsn) {
        self.txn(id).commit_end = Some(end_lsn);
        let last = self.txns.len() - 1;
        let is_last = id.0 - self.first_id == last as u64;
        if is_last && last > 0 && self.txns[last].pending == 0 && self.txns[last - 1].commit_end.is_some() {
            self.txns.pop_back();
            self.txns[last - 1].commit_end = Some(end_lsn);
        }
    }

    /// Pops the fully acknowledged committed prefix; returns the new confirmed position if it
    /// moved forward.
    pub fn advance(&mut self) -> Option<Lsn> {
        let before = self.confirmed;
        while let Some(front) = self.txns.front() {
            match front.commit_end {
                Some(end) if front.pending == 0 => {
                    debug_assert!(
                        end >= self.confirmed,
                        "commit end {end} behind confirmed {}",
                        self.confirmed
                    );
                    self.confirmed = self.confirmed.max(end);
                    self.txns.pop_front();
                    self.first_id += 1;
                }
                _ => break,
            }
        }
        (self.confirmed > before).then_some(self.confirmed)
    }

    /// Moves the confirmed position to `lsn` when nothing is in flight: a keepalive's WAL end
    /// is the last position the server sent, and with no open transaction everything before
    /// it was received and settled. PostgreSQL's protocol documentation ("Streaming Replication
    /// Protocol", Primary keepalive message) defines that field as "the current end of WAL on
    /// the server"; a logical walsender sends a keepalive only once it has sent (or skipped as
    /// not in the publication) every change before that end, so no event of ours lies behind
    /// it (Materialize's `replication.rs` reasons the same way).
    pub fn idle_advance(&mut self, lsn: Lsn) -> Option<Lsn> {
        if self.txns.is_empty() && lsn > self.confirmed {
            self.confirmed = lsn;
            Some(lsn)
        } else {
            None
        }
    }

    /// The position the tracker would confirm (what PostgreSQL was told may lag behind it).
    pub fn confirmed(&self) -> Lsn {
        self.confirmed
    }

    pub fn in_flight_events(&self) -> usize {
        self.in_flight_events
    }

    pub fn open_transactions(&self) -> usize {
        self.txns.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_transactions_behind_a_waiting_one_do_not_grow_the_queue() {
        let mut t = Tracker::new(Lsn(10));
        let waiting = t.begin();
        t.sent(waiting);
        t.commit(waiting, Lsn(100));
        // a Kafka stall: the first transaction's event is not acknowledged, while 100,000
        // transactions without outbox events stream by
        for n in 0..100_000u64 {
            let empty = t.begin();
            t.commit(empty, Lsn(200 + n));
            assert_eq!(t.advance(), None, "confirmed past an unacknowledged event");
        }
        assert_eq!(t.open_transactions(), 1);
        // and once it is acknowledged, everything they covered is confirmed
        t.acked(waiting);
        assert_eq!(t.advance(), Some(Lsn(200 + 99_999)));
        assert_eq!(t.open_transactions(), 0);
    }

    #[test]
    fn a_transaction_with_events_in_flight_is_not_folded() {
        let mut t = Tracker::new(Lsn(10));
        let a = t.begin();
        t.sent(a);
        t.commit(a, Lsn(100));
        let b = t.begin();
        t.sent(b);
        t.commit(b, Lsn(200));
        assert_eq!(t.open_transactions(), 2);
        t.acked(b);
        assert_eq!(t.advance(), None, "b acknowledged first must not confirm past a");
        t.acked(a);
        assert_eq!(t.advance(), Some(Lsn(200)));
    }

    #[test]
    fn confirms_only_the_acknowledged_committed_prefix() {
        let mut t = Tracker::new(Lsn(10));
        let a = t.begin();
        t.sent(a);
        t.sent(a);
        t.commit(a, Lsn(100));
        let b = t.begin();
        t.sent(b);
        t.commit(b, Lsn(200));
        // b is fully acknowledged first: nothing moves, a is still pending
        t.acked(b);
        assert_eq!(t.advance(), None);
        t.acked(a);
        assert_eq!(t.advance(), None, "one event of a is still unacknowledged");
        t.acked(a);
        assert_eq!(t.advance(), Some(Lsn(200)));
        assert_eq!(t.confirmed(), Lsn(200));
        assert_eq!(t.in_flight_events(), 0);
    }

    #[test]
    fn an_uncommitted_transaction_blocks_confirmation() {
        let mut t = Tracker::new(Lsn(0));
        let a = t.begin();
        t.sent(a);
        t.acked(a);
        assert_eq!(t.advance(), None, "Commit not received yet");
        t.commit(a, Lsn(50));
        assert_eq!(t.advance(), Some(Lsn(50)));
    }

    #[test]
    fn empty_transactions_confirm_at_once() {
        let mut t = Tracker::new(Lsn(0));
        let a = t.begin();
        t.commit(a, Lsn(70));
        assert_eq!(t.advance(), Some(Lsn(70)));
    }

    #[test]
    fn keepalive_advances_only_when_idle() {
        let mut t = Tracker::new(Lsn(5));
        let a = t.begin();
        t.sent(a);
        assert_eq!(t.idle_advance(Lsn(500)), None);
        t.acked(a);
        assert_eq!(t.idle_advance(Lsn(500)), None, "a is open: its Commit has not arrived");
        t.commit(a, Lsn(60));
        assert_eq!(t.advance(), Some(Lsn(60)));
        assert_eq!(t.idle_advance(Lsn(500)), Some(Lsn(500)));
        assert_eq!(t.idle_advance(Lsn(400)), None, "never backwards");
    }

    #[test]
    fn thousands_of_events_in_one_transaction_need_every_ack() {
        let mut t = Tracker::new(Lsn(0));
        let a = t.begin();
        for _ in 0..5_000 {
            t.sent(a);
        }
        t.commit(a, Lsn(9_000));
        for i in 0..5_000 {
            assert_eq!(t.advance(), None, "confirmed after {i} of 5000 acks");
            t.acked(a);
        }
        assert_eq!(t.advance(), Some(Lsn(9_000)));
    }

    #[test]
    fn randomized_acks_never_confirm_past_an_unacknowledged_event() {
        for seed in 0..200u64 {
            let mut rng = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let mut next = || {
                rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                (rng >> 33) as usize
            };
            let mut t = Tracker::new(Lsn(0));
            let mut outstanding: Vec<(TxnId, u64)> = Vec::new(); // (txn, its commit end)
            for i in 0..20u64 {
                let id = t.begin();
                for _ in 0..next() % 4 {
                    t.sent(id);
                    outstanding.push((id, (i + 1) * 100));
                }
                t.commit(id, Lsn((i + 1) * 100));
            }
            let mut last = Lsn(0);
            while !outstanding.is_empty() {
                let (id, _) = outstanding.swap_remove(next() % outstanding.len());
                t.acked(id);
                if let Some(c) = t.advance() {
                    assert!(c > last);
                    last = c;
                }
                let lowest_pending = outstanding.iter().map(|(_, end)| *end).min();
                if let Some(end) = lowest_pending {
                    assert!(
                        t.confirmed() < Lsn(end),
                        "seed {seed}: confirmed {} past pending commit {end}",
                        t.confirmed()
                    );
                }
            }
            t.advance();
            assert_eq!(t.confirmed(), Lsn(2_000));
        }
    }
}
