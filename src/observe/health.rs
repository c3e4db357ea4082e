//! What `/healthz`, `/readyz` and the leader gauge say, kept in one place.
//!
//! Invariants:
//! - the [`Phase`] (starting, active, standby, retrying, fatal) and the facts sources report
//!   (alive, Kafka stalled, held at an unpublishable event, the polling lock held by a session
//!   that is no relay) arrive through the supervisor's
//!   [`crate::observe::pulse::Pulse`]; readiness is derived from all of them when asked, and
//!   `outbox_relay_events_blocked` follows the blocked fact wherever it changes;
//! - `outbox_relay_leader` is 1 exactly while the phase is `Active`: it means leadership, not
//!   health (a stalled or blocked leader is still the leader);
//! - liveness allows for the longest deliberate wait: twice the retry cap, at least a minute.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::observe::metrics::metrics;

/// Where the supervisor is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Phase {
    Starting,
    /// This instance relays.
    Active,
    /// Another instance relays; this one waits to take over.
    Standby,
    /// A session failed; backing off before the next one (the error).
    Retrying(String),
    /// Stopped on a fatal error (the error).
    Fatal(String),
}

/// What readiness is made of.
#[derive(Debug)]
struct Facts {
    phase: Phase,
    /// Kafka acknowledged nothing for a while with records waiting.
    stalled: Option<String>,
    /// Held at an unpublishable event (`on_poison = "block"`).
    blocked: Option<String>,
    /// Who keeps this standby from the polling lock, as its last session found it.
    lock_holder: Option<LockHolder>,
}

/// The session holding the polling lock, as a standby found it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct LockHolder {
    /// Who it is (pid, role, application), and what to do when it is no relay.
    pub said: String,
    /// Its role could claim rows: another relay. When it is not, nobody relays, so the standby
    /// is degraded, not ready.
    pub relay: bool,
}

/// The process's health; shared by the supervisor (writer) and the HTTP listener (reader).
#[derive(Debug)]
pub struct Health {
    last_tick_ms: AtomicU64,
    stale_after_ms: u64,
    facts: Mutex<Facts>,
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default().as_millis() as u64
}

impl Health {
    /// `max_backoff`: the longest deliberate wait of the loop.
    pub fn new(max_backoff: Duration) -> Health {
        Health {
            last_tick_ms: AtomicU64::new(now_ms()),
            stale_after_ms: (max_backoff * 2).max(Duration::from_secs(60)).as_millis() as u64,
            facts: Mutex::new(Facts {
                phase: Phase::Starting,
                stalled: None,
                blocked: None,
                lock_holder: None,
            }),
        }
    }

    /// The loop is alive: called every iteration, including deliberate waits.
    pub fn tick(&self) {
        self.last_tick_ms.store(now_ms(), Ordering::Relaxed);
    }

    pub(crate) fn set_phase(&self, phase: Phase) {
        self.tick();
        metrics().leader.set(i64::from(phase == Phase::Active));
        let mut facts = self.facts.lock().unwrap();
        if phase != Phase::Active {
            // a new session starts with neither (a source still holding reports it again)
            facts.stalled = None;
            facts.blocked = None;
            metrics().events_blocked.set(0);
        }
        if phase != Phase::Standby {
            // (a standby session reports the holder before the supervisor sets the phase)
            facts.lock_holder = None;
        }
        facts.phase = phase;
    }

    pub(crate) fn set_stalled(&self, stalled: Option<String>) {
        self.facts.lock().unwrap().stalled = stalled;
    }

    pub(crate) fn set_blocked(&self, blocked: Option<String>) {
        metrics().events_blocked.set(i64::from(blocked.is_some()));
        self.facts.lock().unwrap().blocked = blocked;
    }

    /// Who holds the polling lock this standby wants (None: nobody it could see); returns
    /// whether that changed, so the caller logs a new holder once.
    pub(crate) fn set_lock_holder(&self, holder: Option<LockHolder>) -> bool {
        let mut facts = self.facts.lock().unwrap();
        let changed = facts.lock_holder != holder;
        facts.lock_holder = holder;
        changed
    }

    #[cfg(test)]
    pub fn phase(&self) -> Phase {
        self.facts.lock().unwrap().phase.clone()
    }

    pub fn live(&self) -> bool {
        now_ms().saturating_sub(self.last_tick_ms.load(Ordering::Relaxed)) < self.stale_after_ms
    }

    /// `Ok(body)` when ready, `Err(why)` when not.
    pub fn readiness(&self) -> Result<String, String> {
        let facts = self.facts.lock().unwrap();
        match (&facts.phase, &facts.blocked, &facts.stalled) {
            (Phase::Fatal(e), _, _) => Err(format!("degraded: fatal: {e}")),
            // blocked is reported from the session that holds (stream, polling or first copy)
            (_, Some(blocked), _) => Err(format!("degraded: {blocked}")),
            (Phase::Starting, None, _) => Err("starting".into()),
            (Phase::Retrying(e), None, _) => Err(format!("degraded: {e}")),
            (Phase::Standby, None, _) => match &facts.lock_holder {
                Some(LockHolder { said, relay: false }) => Err(format!("degraded: {said}")),
                Some(LockHolder { said, relay: true }) => Ok(format!("standby: {said}")),
                None => Ok("standby: another instance is active".into()),
            },
            (Phase::Active, None, Some(stalled)) => Err(format!("degraded: {stalled}")),
            (Phase::Active, None, None) => Ok("active".into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readiness_follows_the_present() {
        let h = Health::new(Duration::from_secs(1));
        assert_eq!(h.readiness(), Err("starting".into()));
        h.set_phase(Phase::Active);
        assert_eq!(h.readiness(), Ok("active".into()));
        h.set_stalled(Some("Kafka has acknowledged nothing for 12 s".into()));
        assert!(h.readiness().unwrap_err().contains("acknowledged nothing"));
        h.set_stalled(None);
        assert_eq!(h.readiness(), Ok("active".into()));
        h.set_blocked(Some("blocked at event 7: column aggregate_id is NULL".into()));
        assert!(h.readiness().unwrap_err().contains("blocked at event 7"));
        assert_eq!(metrics().events_blocked.get(), 1);
        h.set_phase(Phase::Retrying("postgres: connection reset".into()));
        assert!(h.readiness().unwrap_err().starts_with("degraded: postgres"));
        assert_eq!(metrics().events_blocked.get(), 0, "the gauge follows the blocked fact");
        h.set_phase(Phase::Active);
        assert_eq!(h.readiness(), Ok("active".into()), "a new session starts unblocked");
        h.set_phase(Phase::Standby);
        assert!(h.readiness().unwrap().starts_with("standby"));
        h.set_phase(Phase::Starting);
        h.set_blocked(Some("blocked at event 3: column id is NULL".into()));
        assert!(h.readiness().unwrap_err().contains("blocked at event 3"), "a first copy that holds says so");
    }

    #[test]
    fn a_lock_held_by_no_relay_degrades_the_standby_until_it_is_active() {
        let h = Health::new(Duration::from_secs(1));
        let said = "the polling lock 7 of public.outbox_events is held by pid 42 (role \"mallory\"), which is not a relay";
        let stranger = LockHolder { said: said.into(), relay: false };
        assert!(h.set_lock_holder(Some(stranger.clone())), "a new holder is news");
        h.set_phase(Phase::Standby);
        assert_eq!(h.readiness(), Err(format!("degraded: {said}")));
        assert!(!h.set_lock_holder(Some(stranger.clone())), "the same holder is not news");
        let relay = LockHolder { said: "another instance is active: pid 43".into(), relay: true };
        assert!(h.set_lock_holder(Some(relay)));
        assert_eq!(h.readiness(), Ok("standby: another instance is active: pid 43".into()));
        h.set_lock_holder(Some(stranger));
        h.set_phase(Phase::Active);
        h.set_phase(Phase::Standby);
        assert_eq!(
            h.readiness(),
            Ok("standby: another instance is active".into()),
            "becoming active forgets the holder"
        );
    }
}
