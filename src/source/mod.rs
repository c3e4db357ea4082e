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
use crate::sink::Sink;

/// A source of events, driven by the supervisor (`supervisor::run`), which owns the sink: it
/// makes it fresh after a failed session and flushes it at shutdown, so a source only opens a
/// delivery stage on it for each session.
pub(crate) trait Source<S: Sink> {
    /// One session: connect, become active (or return [`RelayError::Standby`]), relay through a
    /// delivery stage on `sink` until `shutdown` turns true (`Ok`) or an error.
    fn session(
        &mut self,
        sink: &mut S,
        pulse: &Pulse,
        shutdown: &mut watch::Receiver<bool>,
    ) -> impl Future<Output = Result<(), RelayError>> + Send;
}
