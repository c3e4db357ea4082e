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
//!   is 1 from the pause to the resume (one switch per process, so one gauge);
//! - with a shared pause ([`Pause::share`]: the instances of one relay keep it in PostgreSQL,
//!   [`crate::ops::control`]), an instance that becomes the active one reads no event before the
//!   shared pause is read: [`Pause::take_over`] (called on every change into the active phase)
//!   holds the switch as paused until [`Pause::settle`] applies what the relay's instances
//!   share. So a pause outlives the instance that was paused (a failover, a restart), and no
//!   event slips out between a take-over and the read.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
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
    /// Not a pause yet: this instance is taking over and reads the shared pause first.
    #[serde(skip)]
    pub taking_over: bool,
}

/// The process's pause switch; clones share it.
#[derive(Debug, Clone)]
pub struct Pause {
    state: Arc<watch::Sender<Option<Paused>>>,
    /// The relay's instances share the pause: a take-over reads it first.
    shared: Arc<AtomicBool>,
}

impl Default for Pause {
    fn default() -> Pause {
        Pause { state: Arc::new(watch::Sender::new(None)), shared: Arc::default() }
    }
}

impl Paused {
    /// `paused by <who>[: <reason>]`, as `/readyz` says it.
    pub fn said(&self) -> String {
        if self.taking_over {
            return "taking over: reading whether this relay is paused (outbox_relay_control)".into();
        }
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
            if state.as_ref().is_some_and(|s| !s.taking_over) {
                return false;
            }
            *state = Some(Paused { by: by.to_owned(), since, reason, taking_over: false });
            true
        });
        gauges(self.state.borrow().as_ref());
        changed
    }

    /// Resumes publishing; returns false when it was not paused.
    pub fn resume(&self) -> bool {
        let changed = self.state.send_if_modified(|state| state.take().is_some_and(|s| !s.taking_over));
        gauges(None);
        changed
    }

    /// The relay's instances share the pause from now on ([`crate::ops::control`] keeps it).
    pub fn share(&self) {
        self.shared.store(true, Ordering::Relaxed);
    }

    /// This instance becomes the active one: with a shared pause, it reads nothing until
    /// [`Pause::settle`] says whether the relay is paused (a pause of this instance's own stays).
    pub fn take_over(&self) {
        if !self.shared.load(Ordering::Relaxed) {
            return;
        }
        self.state.send_if_modified(|state| {
            if state.is_some() {
                return false;
            }
            let since = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default().as_secs();
            *state = Some(Paused { by: "outbox-relay".into(), since, reason: None, taking_over: true });
            true
        });
    }

    /// Taking over and waiting for the shared pause.
    pub fn taking_over(&self) -> bool {
        self.state.borrow().as_ref().is_some_and(|s| s.taking_over)
    }

    /// The shared pause as read (`None`: not paused): applied when this instance is taking
    /// over; otherwise this instance's own switch stands. True when it was applied.
    pub fn settle(&self, shared: Option<Paused>) -> bool {
        let applied = self.state.send_if_modified(|state| {
            if !state.as_ref().is_some_and(|s| s.taking_over) {
                return false;
            }
            *state = shared;
            true
        });
        if applied {
            gauges(self.state.borrow().as_ref());
        }
        applied
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

/// `outbox_relay_paused` and `outbox_relay_paused_by` say `paused` (None: publishing).
fn gauges(paused: Option<&Paused>) {
    let m = metrics();
    m.paused.set(i64::from(paused.is_some()));
    m.paused_by.reset();
    match paused {
        Some(paused) => m.paused_by.with_label_values(&[paused.by.as_str()]).set(1),
        None => m.paused_by.with_label_values(&[""]).set(0),
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

    #[tokio::test]
    async fn a_take_over_reads_nothing_until_the_shared_pause_is_settled() {
        let pause = Pause::default();
        pause.take_over();
        assert_eq!(pause.state(), None, "an unshared pause does not hold a take-over");

        pause.share();
        pause.take_over();
        assert!(pause.taking_over());
        let mut paused = pause.watch();
        let waiter = tokio::spawn(async move { while_paused(&mut paused).await });
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished(), "a session reads nothing while the take-over reads the pause");
        let shared =
            Paused { by: "oncall".into(), since: 7, reason: Some("incident".into()), taking_over: false };
        assert!(pause.settle(Some(shared.clone())));
        assert_eq!(pause.state(), Some(shared), "the shared pause holds in the new active instance");
        assert!(!waiter.is_finished());
        assert!(!pause.settle(None), "settling again changes nothing outside a take-over");
        assert!(pause.resume());
        waiter.await.unwrap();

        pause.take_over();
        assert!(pause.settle(None));
        assert_eq!(pause.state(), None, "nothing shared: the new active instance reads on");
        assert!(pause.pause("alice", None));
        pause.take_over();
        assert_eq!(pause.state().unwrap().by, "alice", "this instance's own pause stays across a take-over");
    }
}
