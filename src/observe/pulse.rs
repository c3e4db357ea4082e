//! What a session reports while it runs: alive, active, progressed, Kafka stalled (since when), held at an
//! unpublishable event. The supervisor makes one [`Pulse`] and reads it between sessions; the
//! sources, the delivery path and the sink only write to it.
//!
//! Invariants:
//! - a pulse writes facts into [`Health`] and decides nothing: what follows a failure is the
//!   supervisor's, through the error policy;
//! - an outage is logged once when it starts (per failure kind) and once when progress resumes,
//!   not per retry.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::health::{Health, Phase};

/// What a session reports to the supervisor.
#[derive(Debug)]
pub struct Pulse {
    health: Arc<Health>,
    progressed: AtomicBool,
    outage: Mutex<OutageLog>,
}

impl Pulse {
    pub(crate) fn new(health: Arc<Health>) -> Pulse {
        Pulse { health, progressed: AtomicBool::new(false), outage: Mutex::default() }
    }

    /// A pulse nobody reads, for one-shot commands (`outbox-relay setup`) and tests.
    pub fn detached() -> Pulse {
        Pulse::new(Arc::new(Health::new(Duration::ZERO)))
    }

    /// The session is alive (call at least every stall period, including while waiting).
    pub fn tick(&self) {
        self.health.tick();
    }

    /// Awaits `work`, ticking every second meanwhile: a long wait that is no hang (a Kafka
    /// transaction initialized or committed, up to `kafka.transaction_timeout_ms`) does not
    /// fail the liveness probe.
    pub async fn alive_while<T>(&self, work: impl std::future::Future<Output = T>) -> T {
        tokio::pin!(work);
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        loop {
            tokio::select! {
                done = &mut work => return done,
                _ = tick.tick() => self.tick(),
            }
        }
    }

    /// The pause switch, as a session selects on it ([`crate::observe::pause::while_paused`]).
    pub fn paused(&self) -> tokio::sync::watch::Receiver<Option<super::pause::Paused>> {
        self.health.pause().watch()
    }

    /// This session is now the active instance.
    pub fn active(&self) {
        self.health.set_phase(Phase::Active);
    }

    /// Events flowed (Kafka acknowledged one): the outage, if any, is over.
    pub fn progressed(&self) {
        if !self.progressed.swap(true, Ordering::Relaxed) {
            self.outage.lock().unwrap().recovered();
        }
    }

    /// Kafka has acknowledged nothing since `since` with records waiting (`Some`), or does
    /// again (`None`).
    pub fn stalled(&self, since: Option<std::time::Instant>) {
        self.health.set_stalled(since);
    }

    /// Where [`Pulse::stalled`] reports to, for a task that outlives the borrow of this pulse
    /// (a stall's diagnosis).
    pub(crate) fn health(&self) -> Arc<Health> {
        self.health.clone()
    }

    /// Held at an unpublishable event (`Some(why)`), or released (`None`).
    pub fn blocked(&self, why: Option<String>) {
        self.health.set_blocked(why);
    }

    /// Whether events flowed since the last call.
    pub(crate) fn take_progress(&self) -> bool {
        self.progressed.swap(false, Ordering::Relaxed)
    }

    /// A session failed with an error of `kind`; the next one starts in `retry_in`.
    pub(crate) fn failed(&self, kind: &str, error: &dyn std::fmt::Display, retry_in: Duration) {
        self.outage.lock().unwrap().failed(kind, error, retry_in);
    }

    /// Another instance is active: whatever outage this one had is over.
    pub(crate) fn standing_by(&self) {
        self.outage.lock().unwrap().recovered();
    }

    /// The wait chosen after the last failure, and how often `relay recovered` was logged.
    #[cfg(test)]
    pub(crate) fn outage(&self) -> (Duration, usize) {
        let outage = self.outage.lock().unwrap();
        (outage.retry_in, outage.recoveries)
    }
}

/// Remembers the current failure kind so a persisting outage is logged once, not every retry.
#[derive(Debug, Default)]
struct OutageLog {
    current: Option<String>,
    /// The wait chosen after the last failure.
    retry_in: Duration,
    /// How often `relay recovered` was logged.
    recoveries: usize,
}

impl OutageLog {
    /// Logs `error` at WARN if its kind differs from the last one logged.
    fn failed(&mut self, kind: &str, error: &dyn std::fmt::Display, retry_in: Duration) {
        self.retry_in = retry_in;
        if self.current.as_deref() != Some(kind) {
            tracing::warn!(kind, %error, retry_in_ms = retry_in.as_millis() as u64, "relay degraded, retrying");
            self.current = Some(kind.to_string());
        } else {
            tracing::debug!(kind, %error, retry_in_ms = retry_in.as_millis() as u64, "still failing");
        }
    }

    /// Logs the recovery once.
    fn recovered(&mut self) {
        if let Some(kind) = self.current.take() {
            self.recoveries += 1;
            tracing::info!(previous = %kind, "relay recovered");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_is_taken_once() {
        let pulse = Pulse::new(Arc::new(Health::new(Duration::from_secs(1))));
        assert!(!pulse.take_progress());
        pulse.progressed();
        assert!(pulse.take_progress());
        assert!(!pulse.take_progress());
    }

    #[test]
    fn an_outage_ends_once_however_often_it_failed() {
        let pulse = Pulse::detached();
        pulse.failed("kafka", &"down", Duration::from_millis(5));
        pulse.failed("kafka", &"down", Duration::from_millis(9));
        pulse.progressed();
        pulse.take_progress();
        pulse.progressed();
        assert_eq!(pulse.outage(), (Duration::from_millis(9), 1));
    }
}
