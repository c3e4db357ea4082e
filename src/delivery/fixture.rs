//! A delivery stage over the scripted sink, for the stage's tests and its users' (the first
//! copy's): a configuration with the poison policy under test, its dead letters, and a pulse
//! whose health a test can read.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use super::Delivery;
use crate::config::RelayConfig;
use crate::dead_letter::DeadLetters;
use crate::observe::health::{Health, Phase};
use crate::observe::metrics::Mode;
use crate::observe::pulse::Pulse;
use crate::outboxes::Outboxes;
use crate::readback::{Dedup, Lookback};
use crate::record::OutboxRow;
use crate::sink::scripted::ScriptedSink;

/// What a delivery stage over the scripted sink needs: a configuration with `on_poison`, its
/// dead letters, and a pulse whose health a test can read.
pub(crate) struct Fixture {
    pub(crate) config: RelayConfig,
    pub(crate) sink: ScriptedSink,
    pub(crate) dead_letters: DeadLetters,
    pub(crate) health: Arc<Health>,
    pub(crate) pulse: Pulse,
}

impl Fixture {
    pub(crate) fn new(on_poison: &str) -> Fixture {
        Fixture::with_sink(on_poison, ScriptedSink::new())
    }

    /// Over a sink that writes in Kafka transactions.
    pub(crate) fn transactional(on_poison: &str) -> Fixture {
        Fixture::with_sink(on_poison, ScriptedSink::transactional())
    }

    /// With the `[[outboxes]]` `outboxes` (JSON), each under the shared `on_poison` unless it
    /// has its own.
    pub(crate) fn with_outboxes(on_poison: &str, outboxes: serde_json::Value) -> Fixture {
        Fixture::configured(on_poison, ScriptedSink::new(), outboxes)
    }

    fn with_sink(on_poison: &str, sink: ScriptedSink) -> Fixture {
        Fixture::configured(on_poison, sink, serde_json::json!([]))
    }

    fn configured(on_poison: &str, sink: ScriptedSink, outboxes: serde_json::Value) -> Fixture {
        let config: RelayConfig = serde_json::from_value(serde_json::json!({
            "kafka": {"brokers": ["127.0.0.1:1"], "stall_warning_ms": 100, "transactional": crate::sink::Sink::transactional(&sink),
                      "transaction_max_events": 3},
            "dead_letter": {"on_poison": on_poison},
            "outboxes": outboxes,
            "retry": {"initial_backoff_ms": 10, "max_backoff_ms": 20},
        }))
        .unwrap();
        let health = Arc::new(Health::new(Duration::from_secs(1)));
        health.set_phase(Phase::Active);
        Fixture {
            dead_letters: DeadLetters::new(&Outboxes::new(&config), &config.retry, Mode::Replication),
            sink,
            pulse: Pulse::new(health.clone()),
            health,
            config,
        }
    }

    /// A stage whose read-back is off (the sink has no source identity).
    pub(crate) async fn delivery<P: Clone>(&self) -> Delivery<'_, ScriptedSink, P> {
        let (_, shutdown) = watch::channel(false);
        let lookback = (Mode::Replication, Lookback::Everything);
        let dedup =
            Dedup::new(&self.config, lookback, (&[], crate::sink::Sink::pinned(&self.sink)), &shutdown);
        let prologue = super::Prologue { dedup };
        let stage = (&self.dead_letters, &self.config.kafka);
        Delivery::open(&self.sink, prologue, stage, &self.pulse, Mode::Replication).await
    }
}

/// An outbox row with id `id` that maps to a record of that id (under the default outbox
/// configuration); `!7` is row 7 when it cannot map (it has no aggregate id).
pub(crate) fn outbox_row(id: &str) -> OutboxRow {
    OutboxRow {
        id: Some(id.trim_start_matches('!').to_string()),
        aggregate_type: Some("order".into()),
        aggregate_id: (!id.starts_with('!')).then(|| "42".into()),
        event_type: Some("OrderPlaced".into()),
        payload: Some("{}".into()),
        ..OutboxRow::default()
    }
}
