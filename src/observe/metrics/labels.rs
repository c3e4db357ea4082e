//! The label values of the relay's metrics, typed: a series is labelled with an enum's
//! [`label`](Mode::label), never a string literal, and initialized at zero from its `ALL`.
//!
//! Invariants:
//! - each enum's `ALL` and `label` are generated from one list by [`labels!`], so a new value
//!   cannot be missing from `ALL` (and from the series created at start-up);
//! - label values are distinct within an enum (a unit test checks every enum).

use crate::label::labels;

labels! {
    /// `mode`: the source mode a counter counts for.
    pub enum Mode {
        Polling = "polling",
        Replication = "replication",
    }
}

impl From<crate::config::SourceMode> for Mode {
    fn from(mode: crate::config::SourceMode) -> Mode {
        match mode {
            crate::config::SourceMode::Polling => Mode::Polling,
            crate::config::SourceMode::Replication => Mode::Replication,
        }
    }
}

labels! {
    /// `error_type` of `outbox_relay_publish_errors_total`: why Kafka did not acknowledge a record.
    pub enum ErrorType {
        /// The broker will never take the record (too large, not authorized, ...).
        Permanent = "permanent",
        /// `message.timeout.ms` passed, or polling's claim timed out waiting.
        Timeout = "timeout",
        /// The idempotent producer hit a fatal error and is made anew.
        FatalProducer = "fatal_producer",
        BrokerDown = "broker_down",
        NotEnoughReplicas = "not_enough_replicas",
        LeaderChange = "leader_change",
        /// librdkafka's queue was full: back-pressure.
        QueueFull = "queue_full",
        /// Nothing was acknowledged for `kafka.stall_warning_ms` with records waiting.
        Stalled = "stalled",
        Other = "other",
    }
}

labels! {
    /// `kind` of `outbox_relay_stream_messages_skipped_total`: a replication message not acted on.
    pub enum SkippedKind {
        OutboxUpdate = "outbox_update",
        OutboxDelete = "outbox_delete",
        OutboxTruncate = "outbox_truncate",
        OtherTable = "other_table",
        Type = "type",
        Origin = "origin",
        ForeignMessage = "foreign_message",
        UntrustedMessage = "untrusted_message",
        StoppedAt = "stopped_at",
        /// A message kind the relay does not know.
        Unknown = "unknown",
    }
}

labels! {
    /// `status` of `outbox_relay_slot_wal_status`: `pg_replication_slots.wal_status`.
    pub enum WalStatus {
        Reserved = "reserved",
        Extended = "extended",
        Unreserved = "unreserved",
        Lost = "lost",
    }
}

impl WalStatus {
    /// The value `pg_replication_slots.wal_status` holds, if it is one of these.
    pub fn parse(value: &str) -> Option<WalStatus> {
        WalStatus::ALL.iter().copied().find(|status| status.label() == value)
    }
}

labels! {
    /// `result` of `outbox_relay_dedup_scans_total`: how one topic's read-back ended.
    pub enum ScanResult {
        /// Every partition was read back as far as a replay can reach (or to its very start).
        Complete = "complete",
        /// The topic does not exist: there is nothing to skip.
        TopicMissing = "topic_missing",
        /// A partition's oldest records were removed (retention, deletion) before the read-back
        /// reached what a replay can repeat: replayed events older than what is left are sent again.
        Truncated = "truncated",
        /// `dedup.max_scan_records` was reached first: older replayed events are sent again.
        Limit = "limit",
        /// `dedup.scan_timeout_ms` ran out while records were still arriving (a topic full of
        /// other producers' records, say): older replayed events are sent again.
        Timeout = "timeout",
        /// With Kafka transactions, an open transaction held a partition below its end past a
        /// short wait: nothing was read back or sent; the session starts again after aborting
        /// the relay's own transaction there.
        Pinned = "pinned",
    }
}

labels! {
    /// `outcome` of `outbox_relay_kafka_transactions_total`: how a Kafka transaction ended.
    pub enum TransactionOutcome {
        Committed = "committed",
        /// Aborted (a record refused, an abortable error): its events are sent again.
        Aborted = "aborted",
        /// Another producer of the `transactional.id` took over: this instance stands by.
        Fenced = "fenced",
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;
    use crate::error::FatalReason;

    fn distinct<T: Copy>(all: &[T], label: impl Fn(T) -> &'static str) -> bool {
        all.iter().map(|v| label(*v)).collect::<BTreeSet<_>>().len() == all.len()
    }

    #[test]
    fn label_values_are_distinct_within_each_enum() {
        assert!(distinct(Mode::ALL, Mode::label));
        assert!(distinct(ErrorType::ALL, ErrorType::label));
        assert!(distinct(SkippedKind::ALL, SkippedKind::label));
        assert!(distinct(WalStatus::ALL, WalStatus::label));
        assert!(distinct(ScanResult::ALL, ScanResult::label));
        assert!(distinct(TransactionOutcome::ALL, TransactionOutcome::label));
        assert!(distinct(FatalReason::ALL, FatalReason::label));
    }

    #[test]
    fn all_lists_every_variant() {
        // an exhaustive match: a new variant fails to compile here until it is counted, and
        // `labels!` puts it in ALL by construction
        let position = |status: WalStatus| match status {
            WalStatus::Reserved => 0,
            WalStatus::Extended => 1,
            WalStatus::Unreserved => 2,
            WalStatus::Lost => 3,
        };
        assert_eq!(WalStatus::ALL.iter().map(|s| position(*s)).collect::<Vec<_>>(), [0, 1, 2, 3]);
        assert_eq!(WalStatus::parse("lost"), Some(WalStatus::Lost));
        assert_eq!(WalStatus::parse("unknown"), None);
    }
}

labels! {
    /// `reason` of `outbox_relay_trace_spans_dropped_total`: why a finished span was not exported.
    pub enum SpanDropReason {
        /// The export queue (`tracing.queue_size`) was full: the backend is slower than the spans.
        QueueFull = "queue_full",
        /// The backend refused the export request or did not answer within
        /// `tracing.export_timeout_ms`.
        ExportFailed = "export_failed",
    }
}
