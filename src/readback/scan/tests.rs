use std::collections::HashSet;
use std::hash::RandomState;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Instant;

use super::{Partition, Scan, ScanOutcome, ScanResult};
use crate::readback::{Fingerprint, Lookback};

fn scan(lookback: Lookback) -> Scan {
    use crate::record::format::Format;
    Scan {
        cancelled: Arc::new(AtomicBool::new(false)),
        refused_login: Default::default(),
        topic: "t".into(),
        sources: vec![Arc::from("s")].into(),
        formats: vec![Format::Raw].into(),
        lookback,
        fingerprint: Fingerprint(RandomState::new(), RandomState::new()),
        max_records: 1_000,
        deadline: Instant::now(),
    }
}

/// A partition read back to `low`, its first offset still held.
fn read_to_start(low: i64) -> Partition {
    Partition {
        id: 0,
        low,
        start: low,
        end: None,
        window: 100,
        done: false,
        batch: None,
        written: Vec::new(),
        read: true,
        tail: low + 10,
    }
}

fn result(lookback: Lookback, low: i64) -> ScanResult {
    let mut outcome = ScanOutcome {
        keys: HashSet::new(),
        result: ScanResult::Complete,
        partitions: 1,
        records: 0,
        foreign: 0,
        last_record: None,
        pinned: Vec::new(),
    };
    let mut partition = read_to_start(low);
    scan(lookback).take_window(&mut partition, &mut outcome);
    assert!(partition.done);
    outcome.result
}

#[test]
fn a_read_back_to_a_partition_whose_oldest_records_are_gone_is_truncated_whatever_its_lookback() {
    for lookback in [Lookback::Everything, Lookback::LastBatch, Lookback::Since(crate::lsn::Lsn(1))] {
        assert_eq!(result(lookback, 5), ScanResult::Truncated, "{lookback:?}");
        assert_eq!(result(lookback, 0), ScanResult::Complete, "{lookback:?}");
    }
}
