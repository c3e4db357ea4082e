//! `outbox-relay setup`: the publication, and the slot with its first copy when it is missing.
//! A command, not a daemon: no supervisor, no retries; Ctrl-C ends it (the next `setup` or the
//! relay's first session does the copy again, and the read-back keeps it from sending twice).
//!
//! Invariant: setup returns what it did ([`SetupReport`]), counted by the copy itself; it reads
//! no process-wide metric.

use std::sync::Arc;

use super::Failure;
use crate::config::{RelayConfig, SourceMode};
use crate::error::{FatalReason, RelayError};
use crate::lsn::Lsn;
use crate::outboxes::Outboxes;
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
    let mut sink = KafkaSink::new(&config.kafka).map_err(|e| {
        RelayError::fatal(FatalReason::Other, format!("cannot create the Kafka producer: {e}"))
    })?;
    let outboxes = Arc::new(Outboxes::new(&config));
    Ok(match ReplicationSource::new(config, outboxes).setup(&mut sink, recreate_slot).await? {
        Some((at, copy)) => SetupReport::SlotCreated { at, copy },
        None => SetupReport::SlotPresent,
    })
}

/// What `setup` says it did.
#[derive(Debug)]
pub enum Setup {
    /// Polling mode has no publication or slot to set up (`signal`: the signal table, when
    /// `admin.signal_table` names one).
    NothingToDo { mode: SourceMode, signal: Option<String> },
    /// The publication is there, and the slot was there or was created.
    Done { publication: String, slot: String, report: SetupReport, signal: Option<String> },
}

impl super::Output for Setup {
    fn text(&self) -> String {
        let (Setup::NothingToDo { signal, .. } | Setup::Done { signal, .. }) = self;
        let signal = signal.as_ref().map(|line| format!("{line}\n")).unwrap_or_default();
        self.mode_text() + &signal
    }

    fn exit_code(&self) -> u8 {
        0
    }
}

impl Setup {
    fn mode_text(&self) -> String {
        match self {
            Setup::NothingToDo { mode, .. } => {
                format!("source.mode = {mode}: nothing to set up (setup prepares replication mode's slot)\n")
            }
            Setup::Done { publication, slot, report, .. } => {
                let slot = match report {
                    SetupReport::SlotCreated { at, copy } => format!(
                        "slot \"{slot}\": created at {at}; rows already in the table: {} published, {} already in \
                         Kafka (not sent again), {} dead-lettered, {} filtered out by transforms",
                        copy.published, copy.already_in_kafka, copy.dead_lettered, copy.filtered
                    ),
                    SetupReport::SlotPresent => format!("slot \"{slot}\": present, nothing to do"),
                };
                format!("publication \"{publication}\": present\n{slot}\n")
            }
        }
    }
}

/// The signal table (`admin.signal_table`), created when set ([`super::signal::setup`]).
async fn signal(config: &RelayConfig) -> Result<Option<String>, Failure> {
    if config.admin.signal_table.is_empty() {
        return Ok(None);
    }
    let client = crate::postgres::connect(&config.postgres).await.map_err(Failure::failed)?;
    super::signal::setup(&client, &config.admin).await.map_err(|e| Failure::of(e, "setup could not finish"))
}

/// `setup` as the command line asks: refused (exit 2) when the flags do not fit the mode;
/// nothing to do in polling mode; else [`run`], with `skip_published` reading Kafka back first.
pub async fn command(
    mut config: RelayConfig,
    recreate_slot: bool,
    skip_published: bool,
) -> Result<Setup, Failure> {
    let mode = config.source.mode;
    if mode != SourceMode::Replication {
        // a slot made here would hold WAL for no one
        if recreate_slot || skip_published {
            return Err(Failure::usage(format!(
                "--recreate-slot and --skip-published are for replication mode, and source.mode is {mode}: \
                 polling has no slot"
            )));
        }
        return Ok(Setup::NothingToDo { mode, signal: signal(&config).await? });
    }
    if skip_published {
        // the read-back's own requirements (kafka.source_headers) hold as for dedup.enabled
        config.dedup.enabled = true;
        config.validate().map_err(|e| Failure::usage(format!("--skip-published: {e}")))?;
    }
    let slot = config.replication.slot.clone();
    let publication = config.replication.publication.clone();
    let signal = signal(&config).await?;
    let report = run(config, recreate_slot).await.map_err(Failure::failed)?;
    Ok(Setup::Done { publication, slot, report, signal })
}
