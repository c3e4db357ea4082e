//! The records the delivery stage handed to the sink and has no report for yet, found by the
//! number the sink gave each ([`crate::sink::Report::seq`]), each with the source's position. A ring in send order: a
//! report finds its record by index, not by search, and once the ring has grown to the
//! in-flight bound nothing is allocated per record.

use std::collections::VecDeque;
use std::time::Instant;

use crate::record::KafkaRecord;

/// One record waiting for its report.
pub(super) struct Sent<P> {
    /// Where the source read it.
    pub(super) position: P,
    pub(super) event: KafkaRecord,
    /// When it was handed to the producer (read once per turn of reading, not per record).
    pub(super) at: Instant,
    /// What it counts against the in-flight byte bound.
    pub(super) bytes: usize,
}

pub(super) struct InFlight<P> {
    /// The number of `slots[0]`.
    base: usize,
    /// `None`: reported already (or a number the sink gave to no record of this session).
    slots: VecDeque<Option<Sent<P>>>,
    records: usize,
    bytes: usize,
}

impl<P> Default for InFlight<P> {
    fn default() -> Self {
        InFlight { base: 0, slots: VecDeque::new(), records: 0, bytes: 0 }
    }
}

impl<P> InFlight<P> {
    pub(super) fn records(&self) -> usize {
        self.records
    }

    pub(super) fn bytes(&self) -> usize {
        self.bytes
    }

    /// Keeps `sent` under `seq`, a number higher than any kept before.
    pub(super) fn insert(&mut self, seq: usize, sent: Sent<P>) {
        if self.slots.is_empty() {
            self.base = seq;
        }
        let index = seq.checked_sub(self.base).filter(|i| *i >= self.slots.len());
        let index = index.unwrap_or_else(|| panic!("record number {seq} was given out twice"));
        self.slots.resize_with(index, || None);
        self.records += 1;
        self.bytes += sent.bytes;
        self.slots.push_back(Some(sent));
    }

    /// The record numbered `seq`, left in place.
    pub(super) fn get(&self, seq: usize) -> Option<&Sent<P>> {
        self.slots.get(seq.checked_sub(self.base)?)?.as_ref()
    }

    /// The record numbered `seq`, if it waits here (a report of an earlier session's record
    /// does not).
    pub(super) fn take(&mut self, seq: usize) -> Option<Sent<P>> {
        let index = seq.checked_sub(self.base)?;
        let sent = self.slots.get_mut(index)?.take()?;
        self.records -= 1;
        self.bytes -= sent.bytes;
        while matches!(self.slots.front(), Some(None)) {
            self.slots.pop_front();
            self.base += 1;
        }
        Some(sent)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sent(id: &str, bytes: usize) -> Sent<()> {
        Sent { position: (), event: crate::sink::scripted::record(id), at: Instant::now(), bytes }
    }

    #[test]
    fn reports_in_any_order_find_their_records() {
        let mut f = InFlight::default();
        for seq in 10..15 {
            f.insert(seq, sent(&seq.to_string(), 100));
        }
        assert_eq!((f.records(), f.bytes()), (5, 500));
        assert_eq!(f.take(12).unwrap().event.id, "12");
        assert!(f.take(12).is_none(), "a record is reported once");
        assert_eq!(f.take(10).unwrap().event.id, "10");
        assert_eq!(f.take(11).unwrap().event.id, "11");
        assert_eq!(f.base, 13, "the reported front is dropped");
        assert!(f.take(3).is_none() && f.take(99).is_none(), "numbers of no record here");
        f.insert(17, sent("17", 1)); // 15 and 16 went to no record of this session
        assert_eq!(f.take(14).unwrap().event.id, "14");
        assert_eq!(f.take(13).unwrap().event.id, "13");
        assert_eq!((f.records(), f.bytes()), (1, 1));
        assert_eq!(f.take(17).unwrap().event.id, "17");
        assert_eq!((f.records(), f.bytes(), f.slots.len()), (0, 0, 0));
        f.insert(40, sent("40", 1));
        assert_eq!(f.base, 40, "an empty ring starts at the next number");
    }

    #[test]
    #[should_panic(expected = "given out twice")]
    fn a_number_is_never_kept_twice() {
        let mut f = InFlight::default();
        f.insert(5, sent("a", 1));
        f.insert(5, sent("b", 1));
    }
}
