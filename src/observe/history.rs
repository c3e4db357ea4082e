//! The last hour of a few gauges and counters, kept in the process for the console's chart: the
//! slot's lag and retained WAL (replication), each outbox's backlog (polling) and its published
//! events (throughput is their difference per interval).
//!
//! Invariants:
//! - every sample is read from the one metrics registry ([`metrics`]), so the chart and
//!   `/metrics` cannot disagree: a sample holds what `/metrics` exported at its time;
//! - the ring holds at most [`History::capacity`] samples (an hour of them), oldest first, and
//!   drops the oldest when full: memory is fixed at start;
//! - it starts empty with the process, and only [`History::spawn`] fills it: the admin API
//!   (`crate::ops::admin`) starts it when `admin.listen` is set, so a relay without the listener
//!   runs no sampler and keeps no samples.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::observe::metrics::metrics;

/// How far back the history reaches.
pub const SPAN: Duration = Duration::from_secs(3600);

/// The gauges and counters at one time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sample {
    /// Unix time of the sample, in milliseconds.
    pub at_unix_ms: u64,
    /// `outbox_relay_slot_confirmed_lag_bytes` (replication), else None.
    pub slot_lag_bytes: Option<i64>,
    /// `outbox_relay_slot_retained_wal_bytes` (replication), else None.
    pub retained_wal_bytes: Option<i64>,
    /// Per outbox, in [`History::outboxes`]' order: `outbox_relay_outbox_backlog_events`
    /// (polling, else None) and `outbox_relay_outbox_events_published_total`.
    pub outboxes: Vec<(Option<i64>, u64)>,
}

/// A fixed-size ring of [`Sample`]s, one every [`History::interval`].
#[derive(Debug)]
pub struct History {
    interval: Duration,
    capacity: usize,
    replication: bool,
    outboxes: Vec<String>,
    ring: Mutex<VecDeque<Sample>>,
}

impl History {
    /// An empty history of the outboxes named `outboxes`, sampled every `interval` (at least a
    /// second), holding [`SPAN`] of samples; `replication`: whether the slot's gauges are kept.
    pub fn new(interval: Duration, outboxes: Vec<String>, replication: bool) -> History {
        let interval = interval.max(Duration::from_secs(1));
        let capacity = SPAN.as_secs().div_ceil(interval.as_secs()).max(2) as usize;
        History {
            interval,
            capacity,
            replication,
            outboxes,
            ring: Mutex::new(VecDeque::with_capacity(capacity)),
        }
    }

    pub fn interval(&self) -> Duration {
        self.interval
    }

    /// The most samples kept.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn replication(&self) -> bool {
        self.replication
    }

    /// The outboxes' names, in the order of [`Sample::outboxes`].
    pub fn outboxes(&self) -> &[String] {
        &self.outboxes
    }

    /// Adds `sample` as the newest, dropping the oldest when full.
    pub fn record(&self, sample: Sample) {
        let mut ring = self.ring.lock().unwrap();
        debug_assert!(ring.back().is_none_or(|last| last.at_unix_ms <= sample.at_unix_ms));
        if ring.len() == self.capacity {
            ring.pop_front();
        }
        ring.push_back(sample);
    }

    /// The samples kept, oldest first.
    pub fn samples(&self) -> Vec<Sample> {
        self.ring.lock().unwrap().iter().cloned().collect()
    }

    /// What the registry says now.
    pub fn sample_now(&self) -> Sample {
        let m = metrics();
        let at_unix_ms = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default().as_millis() as u64;
        let outboxes = self
            .outboxes
            .iter()
            .map(|name| {
                let name = [name.as_str()];
                let backlog =
                    (!self.replication).then(|| m.outbox_backlog_events.with_label_values(&name).get());
                (backlog, m.outbox_events_published.with_label_values(&name).get())
            })
            .collect();
        Sample {
            at_unix_ms,
            slot_lag_bytes: self.replication.then(|| m.slot_confirmed_lag.get()),
            retained_wal_bytes: self.replication.then(|| m.slot_retained_wal.get()),
            outboxes,
        }
    }

    /// Samples the registry now and then every interval, on a task of its own, for as long as
    /// the process runs.
    pub fn spawn(self: &Arc<History>) {
        let history = self.clone();
        tokio::spawn(async move {
            let mut every = tokio::time::interval(history.interval);
            every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                every.tick().await;
                history.record(history.sample_now());
            }
        });
    }
}

/// Events per second of each interval between consecutive `samples` of one outbox's published
/// counter (`(unix ms, count)`, oldest first): None for the first, which has no interval.
pub fn rates(samples: &[(u64, u64)]) -> Vec<Option<f64>> {
    let mut rates = Vec::with_capacity(samples.len());
    rates.push(None);
    rates.extend(samples.windows(2).map(|pair| {
        let ((before_ms, before), (at_ms, count)) = (pair[0], pair[1]);
        let secs = at_ms.saturating_sub(before_ms) as f64 / 1000.0;
        (secs > 0.0).then(|| count.saturating_sub(before) as f64 / secs)
    }));
    rates.truncate(samples.len());
    rates
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(at_unix_ms: u64) -> Sample {
        Sample {
            at_unix_ms,
            slot_lag_bytes: Some(at_unix_ms as i64),
            retained_wal_bytes: None,
            outboxes: vec![(None, at_unix_ms)],
        }
    }

    #[test]
    fn an_hour_of_samples_whatever_the_interval() {
        let names = vec!["orders".to_string()];
        assert_eq!(History::new(Duration::from_secs(10), names.clone(), true).capacity(), 360);
        assert_eq!(History::new(Duration::from_secs(5), names.clone(), true).capacity(), 720);
        assert_eq!(History::new(Duration::from_secs(7), names.clone(), true).capacity(), 515);
        let subsecond = History::new(Duration::from_millis(10), names.clone(), true);
        assert_eq!((subsecond.interval(), subsecond.capacity()), (Duration::from_secs(1), 3600));
        assert_eq!(History::new(Duration::from_secs(3600), names, true).capacity(), 2, "a line needs two");
    }

    #[test]
    fn the_ring_keeps_the_newest_samples_oldest_first_and_no_more_than_its_capacity() {
        let history = History::new(Duration::from_secs(10), vec!["orders".into()], true);
        assert!(history.samples().is_empty(), "it starts empty");
        for at in 1..=1000 {
            history.record(sample(at));
            assert!(history.samples().len() <= 360);
        }
        let kept = history.samples();
        assert_eq!(kept.len(), 360);
        let times: Vec<u64> = kept.iter().map(|s| s.at_unix_ms).collect();
        assert_eq!(times, (641..=1000).collect::<Vec<_>>(), "the newest, oldest first");
    }

    #[test]
    fn a_sample_reads_the_registry() {
        let history = History::new(Duration::from_secs(5), vec!["history-test".into()], false);
        metrics().outbox_backlog_events.with_label_values(&["history-test"]).set(42);
        metrics().outbox_events_published.with_label_values(&["history-test"]).inc_by(7);
        let sample = history.sample_now();
        assert_eq!(sample.outboxes, vec![(Some(42), 7)]);
        assert_eq!((sample.slot_lag_bytes, sample.retained_wal_bytes), (None, None), "polling");
    }

    #[test]
    fn throughput_is_the_counters_difference_per_second_of_each_interval() {
        assert_eq!(rates(&[]), Vec::<Option<f64>>::new());
        assert_eq!(rates(&[(1_000, 5)]), vec![None]);
        let samples = [(1_000, 5), (3_000, 25), (4_000, 25), (4_000, 30), (9_000, 80)];
        assert_eq!(rates(&samples), vec![None, Some(10.0), Some(0.0), None, Some(10.0)]);
    }
}
