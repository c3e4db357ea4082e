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
//! - the active instance that an operator paused is not ready, and says by whom (`paused by
//!   alice: maintenance`); a blocked or fatal one says that first, a standby is unaffected;
//! - liveness allows for the longest deliberate wait: twice the retry cap, at least a minute;
//! - what is said about a stall is about the present: the fact kept is when Kafka went silent,
//!   and its duration is computed when readiness is asked (a stall noticed after 11 s and asked
//!   about a minute later says 71 s, not 11);
//! - the kubelet's probe ([`Health::serving`]) is not readiness: a pod serves no traffic, so it is
//!   ready once it has started (been active or standby once), while its loop is alive and it is
//!   not stopping on a fatal error; Kafka and PostgreSQL outages are for `/readyz`, the metrics and
//!   the alerts, and never hold a node drain.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::observe::metrics::metrics;
use crate::observe::pause::Pause;

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
    stalled: Option<Stall>,
    /// Held at an unpublishable event (`on_poison = "block"`).
    blocked: Option<String>,
    /// Who keeps this standby from the polling lock, as its last session found it.
    lock_holder: Option<LockHolder>,
}

/// Kafka's silence: since when nothing was acknowledged with records waiting, and what the
/// brokers' metadata said of it, if anything yet.
#[derive(Debug, Clone)]
struct Stall {
    since: Instant,
    diagnosis: Option<String>,
}

impl Stall {
    /// `Kafka has acknowledged nothing for N s[; diagnosis]`, N as of `now`.
    fn describe(&self, now: Instant) -> String {
        let quiet = now.saturating_duration_since(self.since).as_secs();
        match &self.diagnosis {
            Some(why) => format!("Kafka has acknowledged nothing for {quiet} s; {why}"),
            None => format!("Kafka has acknowledged nothing for {quiet} s"),
        }
    }
}

/// Why the Kafka token ([kafka.auth]) cannot be refreshed, while it cannot: process-wide, as the
/// token source is (`crate::credentials` writes it, every relay's readiness reads it).
static CREDENTIALS_FAILING: Mutex<Option<String>> = Mutex::new(None);

/// The Kafka token's refresh fails (`Some(why)`), or works again (`None`).
pub fn set_credentials_failing(why: Option<String>) {
    *CREDENTIALS_FAILING.lock().unwrap() = why;
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
    /// Been active or standby at least once: through its start (connected, configured).
    started: AtomicBool,
    facts: Mutex<Facts>,
    /// The process's pause switch ([`Pause`]): sessions read it, the admin API flips it.
    pause: Pause,
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
            started: AtomicBool::new(false),
            facts: Mutex::new(Facts {
                phase: Phase::Starting,
                stalled: None,
                blocked: None,
                lock_holder: None,
            }),
            pause: Pause::default(),
        }
    }

    /// The process's pause switch.
    pub fn pause(&self) -> &Pause {
        &self.pause
    }

    /// The loop is alive: called every iteration, including deliberate waits.
    pub fn tick(&self) {
        self.last_tick_ms.store(now_ms(), Ordering::Relaxed);
    }

    pub(crate) fn set_phase(&self, phase: Phase) {
        self.tick();
        metrics().leader.set(i64::from(phase == Phase::Active));
        if matches!(phase, Phase::Active | Phase::Standby) {
            self.started.store(true, Ordering::Relaxed);
        }
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
        if phase == Phase::Active && facts.phase != Phase::Active {
            // before the session reads: a pause the relay's instances share holds here too
            self.pause.take_over();
        }
        facts.phase = phase;
    }

    /// Kafka has acknowledged nothing since `since` with records waiting (`Some`), or
    /// acknowledges again (`None`).
    pub(crate) fn set_stalled(&self, since: Option<Instant>) {
        self.facts.lock().unwrap().stalled = since.map(|since| Stall { since, diagnosis: None });
    }

    /// What the brokers' metadata says of the stall that began at `since`; dropped when that
    /// stall is over.
    pub(crate) fn diagnose_stall(&self, since: Instant, why: String) {
        let mut facts = self.facts.lock().unwrap();
        if let Some(stall) = facts.stalled.as_mut().filter(|s| s.since == since) {
            stall.diagnosis = Some(why);
        }
    }

    pub(crate) fn set_blocked(&self, blocked: Option<String>) {
        metrics().events_blocked.set(i64::from(blocked.is_some()));
        self.facts.lock().unwrap().blocked = blocked;
    }

    /// Why the process holds at an unpublishable event (`blocked at event <id>: <reason>`), while
    /// it does: one fact per process, as `outbox_relay_events_blocked` is one gauge.
    pub(crate) fn blocked(&self) -> Option<String> {
        self.facts.lock().unwrap().blocked.clone()
    }

    /// Who holds the polling lock this standby wants (None: nobody it could see); returns
    /// whether that changed, so the caller logs a new holder once.
    pub(crate) fn set_lock_holder(&self, holder: Option<LockHolder>) -> bool {
        let mut facts = self.facts.lock().unwrap();
        let changed = facts.lock_holder != holder;
        facts.lock_holder = holder;
        changed
    }

    /// Where the supervisor is now (the admin API refuses acts on a standby).
    pub(crate) fn phase(&self) -> Phase {
        self.facts.lock().unwrap().phase.clone()
    }

    pub fn live(&self) -> bool {
        now_ms().saturating_sub(self.last_tick_ms.load(Ordering::Relaxed)) < self.stale_after_ms
    }

    /// `Ok(body)` when ready, `Err(why)` when not.
    pub fn readiness(&self) -> Result<String, String> {
        self.readiness_at(Instant::now())
    }

    /// [`Health::readiness`] as of `now`.
    fn readiness_at(&self, now: Instant) -> Result<String, String> {
        let facts = self.facts.lock().unwrap();
        let failing = CREDENTIALS_FAILING.lock().unwrap().clone();
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
            (Phase::Active, None, _) if self.pause.state().is_some() => {
                Err(self.pause.state().map(|paused| paused.said()).unwrap_or_default())
            }
            (Phase::Active, None, _) if failing.is_some() => {
                Err(format!("degraded: {}", failing.unwrap_or_default()))
            }
            (Phase::Active, None, Some(stall)) => Err(format!("degraded: {}", stall.describe(now))),
            (Phase::Active, None, None) => Ok("active".into()),
        }
    }

    /// The kubelet's readiness (`/startedz`): `Ok` once this instance has been active or standby,
    /// while its loop is alive and it is not stopping on a fatal error, whatever Kafka and
    /// PostgreSQL do now (a pod serves no traffic: a Kafka outage must not hold a node drain).
    /// Either way the text is [`Health::readiness`]'s.
    pub fn serving(&self) -> Result<String, String> {
        let readiness = self.readiness();
        let fatal = matches!(self.facts.lock().unwrap().phase, Phase::Fatal(_));
        if fatal || !self.live() {
            return Err(readiness.unwrap_or_else(|why| why));
        }
        if !self.started.load(Ordering::Relaxed) {
            return Err(readiness.map_or_else(|why| why, |_| "starting".into()));
        }
        Ok(readiness.unwrap_or_else(|why| why))
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
        h.set_stalled(Instant::now().checked_sub(Duration::from_secs(12)));
        assert!(h.readiness().unwrap_err().contains("acknowledged nothing for 12 s"));
        h.set_stalled(None);
        assert_eq!(h.readiness(), Ok("active".into()));
        h.set_blocked(Some("blocked at event 7: column aggregate_id is NULL".into()));
        assert!(h.readiness().unwrap_err().contains("blocked at event 7"));
        assert_eq!(metrics().events_blocked.get(), 1);
        assert_eq!(h.blocked().as_deref(), Some("blocked at event 7: column aggregate_id is NULL"));
        h.set_phase(Phase::Retrying("postgres: connection reset".into()));
        assert!(h.readiness().unwrap_err().starts_with("degraded: postgres"));
        assert_eq!(metrics().events_blocked.get(), 0, "the gauge follows the blocked fact");
        assert_eq!(h.blocked(), None);
        h.set_phase(Phase::Active);
        assert_eq!(h.readiness(), Ok("active".into()), "a new session starts unblocked");
        h.set_phase(Phase::Standby);
        assert!(h.readiness().unwrap().starts_with("standby"));
        h.set_phase(Phase::Starting);
        h.set_blocked(Some("blocked at event 3: column id is NULL".into()));
        assert!(h.readiness().unwrap_err().contains("blocked at event 3"), "a first copy that holds says so");
    }

    #[test]
    fn a_paused_leader_is_not_ready_and_says_by_whom_until_resumed() {
        let h = Health::new(Duration::from_secs(1));
        h.set_phase(Phase::Active);
        assert!(h.pause().pause("alice", Some("maintenance".into())));
        assert_eq!(h.readiness(), Err("paused by alice: maintenance".into()));
        assert_eq!(metrics().paused.get(), 1);
        assert_eq!(h.serving(), Ok("paused by alice: maintenance".into()), "the kubelet keeps it");
        h.set_phase(Phase::Standby);
        assert!(h.readiness().unwrap().starts_with("standby"), "a standby relays nothing anyway");
        h.set_phase(Phase::Active);
        assert!(h.pause().resume());
        assert_eq!(h.readiness(), Ok("active".into()));
        assert_eq!(metrics().paused.get(), 0);
    }

    #[test]
    fn a_stall_says_how_long_kafka_has_been_silent_when_asked() {
        // given a leader whose stall watch noticed, 11 s into the silence, that Kafka acknowledges
        // nothing
        let h = Health::new(Duration::from_secs(1));
        h.set_phase(Phase::Active);
        let since = Instant::now();
        h.set_stalled(Some(since));
        let said_at = |secs| h.readiness_at(since + Duration::from_secs(secs)).unwrap_err();
        assert_eq!(said_at(11), "degraded: Kafka has acknowledged nothing for 11 s");

        // when it is asked again a minute into the silence, then it says a minute, not 11 s
        assert_eq!(said_at(60), "degraded: Kafka has acknowledged nothing for 60 s");

        // and the brokers' diagnosis joins the stall it was made for, not a later one
        h.diagnose_stall(since, "partition 0 of t has no leader".into());
        assert_eq!(
            said_at(75),
            "degraded: Kafka has acknowledged nothing for 75 s; partition 0 of t has no leader"
        );
        h.set_stalled(None);
        let later = since + Duration::from_secs(100);
        h.set_stalled(Some(later));
        h.diagnose_stall(since, "stale".into());
        assert_eq!(
            h.readiness_at(later + Duration::from_secs(3)).unwrap_err(),
            "degraded: Kafka has acknowledged nothing for 3 s"
        );
    }

    #[test]
    fn the_kubelet_s_probe_holds_only_for_start_up_a_hung_loop_or_a_fatal_error() {
        // given a relay that has not yet been active or standby: not ready for the kubelet
        let h = Health::new(Duration::from_secs(1));
        assert_eq!(h.serving(), Err("starting".into()));
        h.set_phase(Phase::Retrying("postgres: connection refused".into()));
        assert!(h.serving().is_err(), "a relay that never connected is not through its start");

        // when it has been active once, then Kafka's silence or a lost session leave it ready,
        // saying why it is degraded
        h.set_phase(Phase::Active);
        assert_eq!(h.serving(), Ok("active".into()));
        h.set_stalled(Some(Instant::now()));
        assert_eq!(h.serving(), Ok("degraded: Kafka has acknowledged nothing for 0 s".into()));
        assert!(h.readiness().is_err(), "/readyz still says it is degraded");
        h.set_phase(Phase::Retrying("kafka: all brokers down".into()));
        assert_eq!(h.serving(), Ok("degraded: kafka: all brokers down".into()));
        h.set_phase(Phase::Standby);
        assert!(h.serving().unwrap().starts_with("standby"));

        // and a fatal error ends it
        h.set_phase(Phase::Fatal("slot lost".into()));
        assert_eq!(h.serving(), Err("degraded: fatal: slot lost".into()));
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
