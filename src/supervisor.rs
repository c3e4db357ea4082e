//! Runs a source, one session at a time: the error policy applied, backoff, the standby wait,
//! health, and the flush at shutdown.
//!
//! Invariants:
//! - a source knows nothing of the backoff between sessions, health states or exit codes: a
//!   session returns `Ok` at shutdown or an error, and reports facts through its [`Pulse`] (the
//!   one backoff a session itself waits on is the hold at an unpublishable event, under
//!   `dead_letter.on_poison = "block"`);
//! - what follows an error is decided by [`RelayError::action`] alone;
//! - the backoff resets only when events flowed in a session (Kafka acknowledged one) or the
//!   session outlived the longest backoff, not when it merely connected or confirmed an idle
//!   position: a session that fails right after starting keeps backing off instead of
//!   reconnecting several times a second (a walsender that sends a keepalive and then an error
//!   was such a loop);
//! - an outage is logged once when it starts and once when progress resumes, not per retry.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use crate::backoff::{Backoff, wait_or_shutdown};
use crate::config::RetryConfig;
use crate::error::{Action, RelayError};
use crate::observe::health::{Health, Phase};
use crate::observe::pulse::Pulse;
use crate::sink::Sink;
use crate::source::Source;

/// How often a standby asks again to become active (the advisory lock in polling mode, the slot
/// in replication mode): the failover time once the active instance's session has ended.
pub const STANDBY_RETRY: Duration = Duration::from_millis(1_000);

/// Runs `source` over `sink` until shutdown (flushing the sink) or a fatal error.
pub async fn run<K: Sink, S: Source<K>>(
    mut source: S,
    sink: &mut K,
    health: Arc<Health>,
    retry: &RetryConfig,
    mut shutdown: watch::Receiver<bool>,
) -> Result<(), RelayError> {
    let pulse = Pulse::new(health.clone());
    let mut backoff = Backoff::from_config(retry);
    let mut standby_logged = false;
    while !*shutdown.borrow() {
        let started = std::time::Instant::now();
        let result = source.session(sink, &pulse, &mut shutdown).await;
        // events flowed, or the session outlived the longest backoff (an idle outbox's session
        // that ran for hours was no quick failure)
        if pulse.take_progress() || started.elapsed() >= backoff.max() {
            backoff.reset();
        }
        let Err(e) = result else { break };
        match e.action() {
            Action::Fatal(_) => {
                crate::sink::kafka::mark_stopping();
                return Err(e);
            }
            Action::Standby => {
                if !standby_logged {
                    tracing::info!(reason = %e, "standby: another instance is active");
                    standby_logged = true;
                }
                pulse.standing_by();
                health.set_phase(Phase::Standby);
                wait_or_shutdown(STANDBY_RETRY, &mut shutdown).await;
            }
            Action::Retry => {
                standby_logged = false;
                let delay = backoff.next_delay();
                if !*shutdown.borrow() {
                    pulse.failed(e.kind(), &e, delay);
                    health.set_phase(Phase::Retrying(e.to_string()));
                }
                sink.recover();
                wait_or_shutdown(delay, &mut shutdown).await;
            }
        }
    }
    tracing::info!("stopping; waiting for Kafka to acknowledge what was sent");
    sink.flush().await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    use crate::error::FatalReason;
    use crate::sink::scripted::ScriptedSink;

    /// A source whose sessions return the scripted results, recording what the supervisor did.
    #[derive(Default, Clone)]
    struct Record {
        phases: Arc<Mutex<Vec<Phase>>>,
        /// Before each session: the wait the supervisor chose (zero before the first) and how
        /// often it had logged `relay recovered`.
        outage: Arc<Mutex<Vec<(Duration, usize)>>>,
    }

    struct Scripted {
        /// `Ok(progress)`: the session becomes active (and makes progress), then ends on a
        /// cut connection, or at shutdown when it is the last one.
        results: Vec<Result<bool, RelayError>>,
        health: Arc<Health>,
        record: Record,
    }

    impl Source<ScriptedSink> for Scripted {
        async fn session(
            &mut self,
            _: &mut ScriptedSink,
            pulse: &Pulse,
            _: &mut watch::Receiver<bool>,
        ) -> Result<(), RelayError> {
            self.record.phases.lock().unwrap().push(self.health.phase());
            self.record.outage.lock().unwrap().push(pulse.outage());
            match self.results.remove(0) {
                Ok(progress) => {
                    pulse.active();
                    if progress {
                        pulse.progressed();
                    }
                    if self.results.is_empty() { Ok(()) } else { Err(RelayError::Disconnected("cut".into())) }
                }
                Err(e) => Err(e),
            }
        }
    }

    fn retry() -> RetryConfig {
        RetryConfig { initial_backoff_ms: 1, max_backoff_ms: 2 }
    }

    async fn supervise(
        results: Vec<Result<bool, RelayError>>,
    ) -> (Result<(), RelayError>, Record, ScriptedSink) {
        supervise_with(results, &retry()).await
    }

    /// The supervisor's run of a source scripted to `results`, over a scripted sink.
    async fn supervise_with(
        results: Vec<Result<bool, RelayError>>,
        retry: &RetryConfig,
    ) -> (Result<(), RelayError>, Record, ScriptedSink) {
        let health = Arc::new(Health::new(Duration::from_secs(1)));
        let record = Record::default();
        let source = Scripted { results, health: health.clone(), record: record.clone() };
        let mut sink = ScriptedSink::new();
        let (_tx, rx) = watch::channel(false);
        (run(source, &mut sink, health, retry, rx).await, record, sink)
    }

    /// The waits the supervisor chose between the sessions `results` script, and how often it
    /// had logged `relay recovered` before the last one.
    async fn waits(results: Vec<Result<bool, RelayError>>) -> (Vec<Duration>, usize) {
        let retry = RetryConfig { initial_backoff_ms: 1, max_backoff_ms: 60_000 };
        let (result, record, _) = supervise_with(results, &retry).await;
        result.unwrap();
        let outage = record.outage.lock().unwrap().clone();
        (outage[1..].iter().map(|(wait, _)| *wait).collect(), outage.last().unwrap().1)
    }

    #[tokio::test]
    async fn a_session_that_connects_but_publishes_nothing_does_not_reset_the_backoff() {
        // sessions that get as far as active and then fail (a dropped publication's loop:
        // connect, start streaming, fail) keep backing off, and say "recovered" never: only an
        // acknowledged event resets the delay
        let (failing, recoveries) = waits((0..7).map(|_| Ok(false)).collect()).await;
        assert!(failing[5] >= Duration::from_millis(16), "the sixth wait grew (cap 32 ms): {failing:?}");
        assert_eq!(recoveries, 0);
        let (flowing, recoveries) = waits((0..7).map(|_| Ok(true)).collect()).await;
        assert!(flowing.iter().all(|wait| *wait <= Duration::from_millis(1)), "{flowing:?}");
        assert_eq!(recoveries, 5, "each session that published ended an outage (the last one's is not seen)");
    }

    #[tokio::test]
    async fn the_policy_decides_between_sessions() {
        let (result, record, sink) = supervise(vec![
            Err(RelayError::Kafka("down".into())),
            Err(RelayError::Standby("slot busy".into())),
            Ok(true),
            Ok(false),
        ])
        .await;
        result.unwrap();
        let phases = record.phases.lock().unwrap().clone();
        assert_eq!(phases[0], Phase::Starting);
        assert_eq!(phases[1], Phase::Retrying("kafka: down".into()), "a retry is degraded, saying why");
        assert_eq!(phases[2], Phase::Standby);
        assert_eq!(phases[3], Phase::Retrying("postgres: cut".into()));
        // the Kafka failure and the cut connection make the sink fresh; standby does not
        assert_eq!(sink.recoveries(), 2);
        assert!(sink.flushed(), "shutdown flushes the sink");
    }

    #[tokio::test]
    async fn a_fatal_error_stops_at_once_without_recovering() {
        let (result, record, sink) =
            supervise(vec![Err(RelayError::fatal(FatalReason::SlotLost, "lost")), Ok(true)]).await;
        assert_eq!(result.unwrap_err().action(), Action::Fatal(FatalReason::SlotLost));
        assert_eq!(record.phases.lock().unwrap().len(), 1);
        assert_eq!(sink.recoveries(), 0);
        assert!(!sink.flushed(), "a fatal error stops without waiting on Kafka");
    }
}
