//! Sources: where committed outbox events come from.

pub(crate) mod handover;
pub(crate) mod polling;
pub mod replication;
pub(crate) mod sampler;
#[cfg(test)]
pub(crate) mod testing;

use std::future::Future;

use tokio::sync::watch;

use crate::error::RelayError;
use crate::observe::pulse::Pulse;

/// A source of events, driven by the supervisor (`supervisor::run`).
pub trait Source {
    /// One session: connect, become active (or return [`RelayError::Standby`]), relay until
    /// `shutdown` turns true (`Ok`) or an error.
    fn session(
        &mut self,
        pulse: &Pulse,
        shutdown: &mut watch::Receiver<bool>,
    ) -> impl Future<Output = Result<(), RelayError>> + Send;

    /// Prepares for the next session after a failed one (e.g. a fresh Kafka producer).
    fn recover(&mut self);

    /// Waits for what was handed to Kafka, at shutdown.
    fn flush(&self) -> impl Future<Output = ()> + Send;
}
