//! The pause switch: an operator stops publishing without stopping the relay.
//!
//! Invariants:
//! - pausing changes only what a session reads next: the active instance keeps its leadership
//!   (the polling lock, the replication slot), settles what it already handed to Kafka, and then
//!   reads no new row or WAL message until resumed; so nothing is confirmed past what Kafka
//!   acknowledged, and no standby takes over while paused (a first copy, made when the slot is
//!   created, runs to its end; the stream after it is paused);
//! - the switch is the process's: [`crate::observe::health::Health`] owns one, every session
//!   of the process reads it, and whoever flips it (the admin API, the signal table) says who
//!   they are, so readiness and the metrics can say "paused by <who>": `/readyz` answers 503
//!   `paused by <who>[: reason]` while the instance is the active one, and `outbox_relay_paused`
//!   is 1 from the pause to the resume (one switch per process, so one gauge).

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::Serialize;
use tokio::sync::watch;

use crate::observe::metrics::metrics;

/// Who paused the relay, when, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Paused {
    /// The principal that asked (a token's name, a certificate's subject, a signal row's role).
    pub by: String,
    /// Seconds since the Unix epoch.
    pub since: u64,
    /// What they said, if anything.
    pub reason: Option<String>,
}

/// The process's pause switch; clones share it.
#[derive(Debug, Clone)]
pub struct Pause {
    state: Arc<watch::Sender<Option<Paused>>>,
}

impl Default for Pause {
    fn default() -> Pause {
        Pause { state: Arc::new(watch::Sender::new(None)) }
    }
}

impl Paused {
    /// `paused by <who>[: <reason>]`, as `/readyz` says it.
    pub fn said(&self) -> String {
        match &self.reason {
            Some(reason) if !reason.is_empty() => format!("paused by {}: {reason}", self.by),
            _ => format!("paused by {}", self.by),
        }
    }
}

impl Pause {
    /// Pauses publishing; returns false (and changes nothing) when already paused.
    pub fn pause(&self, by: &str, reason: Option<String>) -> bool {
        let since = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default().as_secs();
        let changed = self.state.send_if_modified(|state| {
            if state.is_some() {
                return false;
            }
            *state = Some(Paused { by: by.to_owned(), since, reason });
            true
        });
        metrics().paused.set(1);
        changed
    }

    /// Resumes publishing; returns false when it was not paused.
    pub fn resume(&self) -> bool {
        let changed = self.state.send_if_modified(|state| state.take().is_some());
        metrics().paused.set(0);
        changed
    }

    /// Paused now: by whom, since when.
    pub fn state(&self) -> Option<Paused> {
        self.state.borrow().clone()
    }

    /// A receiver a session selects on: it reads nothing new while the value is `Some`.
    pub fn watch(&self) -> watch::Receiver<Option<Paused>> {
        self.state.subscribe()
    }
}

/// Waits while `paused` says paused; returns at once otherwise. Cancel-safe.
pub async fn while_paused(paused: &mut watch::Receiver<Option<Paused>>) {
    // the sender lives as long as the Health that owns it, which outlives every session
    let _ = paused.wait_for(Option::is_none).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_paused_switch_holds_its_waiters_until_resumed_and_says_who() {
        let pause = Pause::default();
        let mut paused = pause.watch();
        assert!(pause.pause("alice", Some("maintenance".into())));
        assert!(!pause.pause("bob", None), "a second pause changes nothing");
        assert_eq!(pause.state().unwrap().by, "alice");
        let waiter = tokio::spawn(async move { while_paused(&mut paused).await });
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished());
        assert!(pause.resume());
        waiter.await.unwrap();
        assert!(!pause.resume(), "resuming a running relay says so");
        assert_eq!(pause.state(), None);
    }
}
