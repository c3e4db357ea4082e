//! `outbox-relay setup`: the publication, and the slot with its first copy when it is missing.
//! A command, not a daemon: no supervisor, no retries; Ctrl-C ends it (the next `setup` or the
//! relay's first session does the copy again, and the read-back keeps it from sending twice).
//!
//! Invariant: setup returns what it did ([`SetupReport`]), counted by the copy itself; it reads
//! no process-wide metric.

use crate::config::RelayConfig;
use crate::error::{FatalReason, RelayError};
use crate::lsn::Lsn;
use crate::sink::kafka::KafkaSink;
use crate::source::replication::{CopyReport, ReplicationSource};

/// What `setup` did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SetupReport {
    /// The slot was there already: nothing to do.
    SlotPresent,
    /// The slot was created at `at`, and the rows already in the table were copied.
    SlotCreated { at: Lsn, copy: CopyReport },
}

/// Sets up replication mode's publication and slot (`recreate_slot`: drop a lost or unwanted
/// slot first).
pub async fn run(config: RelayConfig, recreate_slot: bool) -> Result<SetupReport, RelayError> {
    let sink = KafkaSink::new(&config.kafka).map_err(|e| {
        RelayError::fatal(FatalReason::Other, format!("cannot create the Kafka producer: {e}"))
    })?;
    Ok(match ReplicationSource::new(config, sink).setup(recreate_slot).await? {
        Some((at, copy)) => SetupReport::SlotCreated { at, copy },
        None => SetupReport::SlotPresent,
    })
}
