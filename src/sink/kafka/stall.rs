//! The stall watch: notices when records wait and Kafka acknowledges nothing for
//! `kafka.stall_warning_ms`, says so once per stall, and asks the brokers' metadata why.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use super::METADATA_TIMEOUT;
use crate::config::KafkaConfig;
use crate::observe::metrics::{ErrorType, metrics};
use crate::observe::pulse::Pulse;

/// How a stall ended, as the log says it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum StallEnd {
    /// Kafka acknowledged a record.
    Acknowledged,
    /// No record waits any more, none acknowledged: they were dead-lettered, or their session
    /// ended (a failed commit, a fenced producer) and the next one sends them again.
    NothingWaits,
}

impl StallEnd {
    fn text(self) -> &'static str {
        match self {
            StallEnd::Acknowledged => "Kafka acknowledges records again",
            // once said right after a failed commit, where it was not true
            StallEnd::NothingWaits => {
                "the stall is over without an acknowledgement: no record waits for Kafka any more (dead-lettered, \
                 or their session ended and the next one sends them again)"
            }
        }
    }
}

/// Notices when records wait and Kafka acknowledges nothing for `kafka.stall_warning_ms`.
/// Records are never failed for it (see `kafka.message_timeout_ms`): the relay only says so,
/// once per stall, in the log, on `/readyz` (through the session's [`Pulse`]) and in
/// `publish_errors_total{error_type="stalled"}`. A stall ends when something is acknowledged
/// or nothing is waiting any more.
pub(crate) struct StallWatch {
    after: Duration,
    /// Since when records have waited with nothing acknowledged: None while nothing waits, so
    /// a silence starts when records are handed over again, not when the last ones were settled
    /// (a polling session idles between claims, and a hold between resends: no stall).
    last_progress: Option<Instant>,
    stalled: bool,
    /// For the stall's diagnosis ([`crate::sink::kafka::cluster::unhealthy_partitions`]).
    kafka: KafkaConfig,
    /// Counts stalls: a diagnosis that returns after its stall ended is dropped.
    stall_number: Arc<AtomicUsize>,
}

impl StallWatch {
    pub(crate) fn new(kafka: &KafkaConfig) -> StallWatch {
        StallWatch {
            after: Duration::from_millis(kafka.stall_warning_ms),
            last_progress: None,
            stalled: false,
            kafka: kafka.clone(),
            stall_number: Arc::new(AtomicUsize::new(0)),
        }
    }

    /// The silence started at `since` (an earlier session's, still unanswered).
    pub(crate) fn silent_since(&mut self, since: Instant) {
        self.last_progress = Some(since);
    }

    /// Records were handed to Kafka: if none waited, the silence starts now.
    pub(crate) fn waiting(&mut self) {
        self.last_progress.get_or_insert_with(Instant::now);
    }

    /// Since when nothing was acknowledged (while records wait; now if no check has seen them
    /// wait yet).
    pub(crate) fn quiet_since(&self) -> Instant {
        self.last_progress.unwrap_or_else(Instant::now)
    }

    /// How often [`StallWatch::check`] should run.
    pub(crate) fn period(&self) -> Duration {
        (self.after / 4).max(Duration::from_millis(25))
    }

    /// Something was acknowledged at `now`.
    pub(crate) fn progressed(&mut self, now: Instant, pulse: &Pulse) {
        self.last_progress = Some(now);
        self.unstall(pulse, StallEnd::Acknowledged);
    }

    /// Nothing waits any more: neither a stall nor a silence. (Records acknowledged went through
    /// [`StallWatch::progressed`] first: a stall still on here ended without an acknowledgement.)
    fn settled(&mut self, pulse: &Pulse) {
        self.last_progress = None;
        metrics().kafka_unacknowledged.set(0.0);
        self.unstall(pulse, StallEnd::NothingWaits);
    }

    fn unstall(&mut self, pulse: &Pulse, end: StallEnd) {
        if self.stalled {
            self.stalled = false;
            self.stall_number.fetch_add(1, Ordering::SeqCst);
            tracing::info!("{}", end.text());
            pulse.stalled(None);
        }
    }

    /// Periodic check with the number of records waiting.
    pub(crate) fn check(&mut self, waiting: usize, pulse: &Pulse) {
        pulse.tick();
        if waiting == 0 {
            self.settled(pulse);
            return;
        }
        let since = *self.last_progress.get_or_insert_with(Instant::now);
        let quiet = since.elapsed();
        metrics().kafka_unacknowledged.set(quiet.as_secs_f64());
        if !self.stalled && quiet >= self.after {
            self.stalled = true;
            tracing::warn!(
                waiting,
                quiet_ms = quiet.as_millis() as u64,
                "Kafka has acknowledged nothing; records are retried until acknowledged"
            );
            metrics().publish_errors.with_label_values(&[ErrorType::Stalled.label()]).inc();
            // the silence's start, not its length now: /readyz says how long as of when it is asked
            pulse.stalled(Some(since));
            self.diagnose(since, pulse);
        }
    }

    /// Asks the brokers' metadata why nothing is acknowledged, off the runtime's threads; a
    /// finding is logged and added to the stall's `/readyz` text while the stall lasts.
    fn diagnose(&self, since: Instant, pulse: &Pulse) {
        let (kafka, health, number) = (self.kafka.clone(), pulse.health(), self.stall_number.clone());
        let this_stall = number.load(Ordering::SeqCst);
        tokio::task::spawn_blocking(move || {
            let Some(why) = crate::sink::kafka::cluster::unhealthy_partitions(&kafka, METADATA_TIMEOUT)
            else {
                return;
            };
            if number.load(Ordering::SeqCst) == this_stall {
                tracing::warn!(diagnosis = %why, "why Kafka may acknowledge nothing");
                health.diagnose_stall(since, why);
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stall_that_ends_without_an_acknowledgement_does_not_say_kafka_acknowledges() {
        assert_eq!(StallEnd::Acknowledged.text(), "Kafka acknowledges records again");
        let nothing = StallEnd::NothingWaits.text();
        assert!(!nothing.contains("acknowledges records again"), "{nothing}");
        assert!(nothing.contains("without an acknowledgement"), "{nothing}");
    }
}
