//! How a session's delivery stage opens: the prologue whose order is the correctness argument,
//! written once, and the only way to a [`Delivery`].
//!
//! In order ([`prologue`]):
//! 1. identities: the sink learns the `outbox_relay_source` of each outbox in this database,
//!    which its records carry and the read-back recognises them by;
//! 2. retire: the producer of a failed session is destroyed (at most [`RETIRE_LIMIT`]), so
//!    nothing handed to it can still be written once the read-back has looked;
//! 3. activate: a transactional sink becomes its source's one producer, fencing the ones before
//!    it (the caller is the active instance: the lock holder, the slot's reader);
//! 4. read-back: the session's skip rule ([`Dedup`]), which reads a topic back before anything
//!    of the session is sent to it;
//! 5. then [`Delivery::open`] takes the sink's reports: the stage is the one sending.
//!
//! Each step may run again in one session (the first copy opens a stage per table, then the
//! stream one more): identities are read again, a retired producer is not waited for twice, an
//! active sink stays active.

use tokio::sync::watch;

use super::{Delivery, InFlight, Transaction};
use crate::config::{KafkaConfig, RelayConfig};
use crate::dead_letter::DeadLetters;
use crate::error::RelayError;
use crate::observe::metrics::{Clock, Mode, metrics};
use crate::observe::pulse::Pulse;
use crate::readback::{Dedup, Lookback};
use crate::sink::kafka::StallWatch;
use crate::sink::{RETIRE_LIMIT, Sink};

/// A sink made ready for a session by [`prologue`]: what [`Delivery::open`] needs.
pub(crate) struct Prologue {
    pub(super) dedup: Dedup,
}

/// The session prologue, in its order (see the module doc). `identities`: the outboxes' source
/// identities in this database (`readback::source_identities`); `lookback`: how far back a
/// replay of this session's source can reach, so how far back to read.
pub(crate) async fn prologue<S: Sink>(
    sink: &mut S,
    identities: &[String],
    config: &RelayConfig,
    (mode, lookback): (Mode, Lookback),
    pulse: &Pulse,
    shutdown: &watch::Receiver<bool>,
) -> Result<Prologue, RelayError> {
    sink.set_sources(identities);
    sink.retired(RETIRE_LIMIT).await;
    pulse.alive_while(sink.activate()).await?;
    let dedup = Dedup::new(config, (mode, lookback), (sink.sources(), sink.pinned()), shutdown);
    Ok(Prologue { dedup })
}

impl<'a, S: Sink, P: Clone> Delivery<'a, S, P> {
    /// Opens the stage of a session whose sink went through the [`prologue`]: from now on it is
    /// the one sending, and reports of earlier sessions' records are passed over.
    pub(crate) async fn open(
        sink: &'a S,
        Prologue { dedup }: Prologue,
        (dead_letters, kafka): (&'a DeadLetters, &KafkaConfig),
        pulse: &'a Pulse,
        mode: Mode,
    ) -> Delivery<'a, S, P> {
        let stall = StallWatch::new(kafka);
        let mut stall_tick = tokio::time::interval(stall.period());
        stall_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        Delivery {
            sink,
            dead_letters,
            pulse,
            dedup,
            in_flight: InFlight::default(),
            stall,
            held: None,
            transaction: sink.transactional().then(|| Transaction::new(kafka)),
            published: metrics().events_published.with_label_values(&[mode.label()]),
            published_by_outbox: dead_letters
                .names()
                .map(|name| metrics().outbox_events_published.with_label_values(&[name]))
                .collect(),
            reports: sink.reports().await,
            received: Default::default(),
            received_at: Clock::now(),
            stall_tick,
            resends_held: true,
            spans: crate::observe::trace::tracer().map(|tracer| {
                let names = dead_letters.names().map(str::to_string).collect();
                super::traced::Spans::new(tracer, mode.label(), names)
            }),
            carried: Default::default(),
            aside: Default::default(),
            aside_uncommitted: Vec::new(),
            aside_done: Vec::new(),
        }
    }
}
