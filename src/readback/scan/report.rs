//! How one topic's read-back is told: one log line, and the dedup counters.
//!
//! A complete read-back (and a missing topic) is logged at `info`; one that may let replayed
//! events be sent again (truncated, stopped at the limit or the deadline) is a warning saying
//! which setting to raise.

use std::time::Duration;

use super::ScanOutcome;
use crate::observe::metrics::{ScanResult, metrics};
use crate::readback::Lookback;

impl ScanOutcome {
    pub(in crate::readback) fn report(&self, topic: &str, lookback: Lookback, took: Duration) {
        let m = metrics();
        m.dedup_scans.with_label_values(&[self.result.label()]).inc();
        m.dedup_scanned_records.inc_by(self.records);
        let (result, keys, partitions, records, foreign) =
            (self.result.label(), self.keys.len(), self.partitions, self.records, self.foreign);
        let took_ms = took.as_millis() as u64;
        match self.result {
            // the producer says what happens to its records when it is first given one
            // (`KafkaSink::look_up`): one warning, not two
            ScanResult::TopicMissing => tracing::info!(
                topic,
                ?lookback,
                result,
                took_ms,
                "the topic does not exist (not created yet, or deleted): nothing to read back"
            ),
            ScanResult::Complete => tracing::info!(
                topic,
                ?lookback,
                result,
                partitions,
                records,
                foreign,
                already_written = keys,
                took_ms,
                "read the topic back: events it already holds are not sent again"
            ),
            // (the session's error says what holds which partition: `Dedup::read_back`)
            ScanResult::Pinned => {
                tracing::debug!(topic, result, pinned = ?self.pinned, took_ms, "read-back pinned")
            }
            ScanResult::Truncated | ScanResult::Limit | ScanResult::Timeout => {
                let why = match self.result {
                    ScanResult::Truncated => {
                        "read the topic back to the start of a partition whose older records are gone (retention \
                         or deletion): replayed events older than what the topic still holds are sent again"
                    }
                    ScanResult::Limit => {
                        "stopped reading the topic back at dedup.max_scan_records: older replayed events may be \
                         sent again (raise dedup.max_scan_records to look further)"
                    }
                    _ => {
                        "stopped reading the topic back at dedup.scan_timeout_ms, records still arriving: older \
                         replayed events may be sent again (raise dedup.scan_timeout_ms, or clear what other \
                         producers wrote to the topic)"
                    }
                };
                tracing::warn!(
                    topic,
                    ?lookback,
                    result,
                    partitions,
                    records,
                    already_written = keys,
                    took_ms,
                    "{why}"
                )
            }
        }
    }
}
