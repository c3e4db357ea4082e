//! The operator commands: `check` (preflight), `setup` (the publication and slot of replication
//! mode), `status` (one look at a running relay and its slot or backlog), `verify` (did every
//! committed row reach Kafka), `locate` (one event's delivery receipt), `switchover-ready` (may
//! this standby be promoted now), `replay-dead-letters` and `republish` (send events again),
//! [`cli`], the command line they are called from, and [`admin`], the admin API and console
//! that run the same commands inside a running relay.
//!
//! Invariants:
//! - a command returns what it found or did as an [`Output`] (or why it gave none, a [`Failure`])
//!   for `main` to print; none prints its findings itself;
//! - `check`, `status`, `verify`, `locate` and `switchover-ready` only read; `setup` creates the
//!   publication and the slot (through the replication source, which owns the slot and its first
//!   copy), `replay-dead-letters` sends letters and removes them with their rows, and `republish`
//!   sends events again.

pub mod admin;
pub mod check;
pub mod cli;
pub(crate) mod control;
pub mod locate;
pub mod remote;
pub mod replay;
pub mod republish;
pub mod setup;
pub(crate) mod signal;
pub mod status;
pub mod switchover;
pub mod verify;

use crate::error::RelayError;

/// Exit code of a command that failed, or found something wrong.
pub const EXIT_FAILURE: u8 = 1;
/// Exit code of a bad argument or configuration, or a command refused (e.g. beside a relay).
pub const EXIT_USAGE: u8 = 2;

/// What a command found or did, as `main` prints it: its report.
pub trait Output {
    /// For people; each line ends in a newline.
    fn text(&self) -> String;
    /// For machines (`--format json`); `None` for a command without that flag.
    fn json(&self) -> Option<String> {
        None
    }
    /// 0 all is well, 1 something failed or is wrong, 3 (`verify`, `locate`) still pending.
    fn exit_code(&self) -> u8;
}

/// Why a command gave no report: the line printed after `error: `, and the exit code.
#[derive(Debug)]
pub struct Failure {
    pub message: String,
    pub exit: u8,
}

impl Failure {
    /// The command could not do its work (exit 1).
    pub fn failed(message: impl ToString) -> Failure {
        Failure { message: message.to_string(), exit: EXIT_FAILURE }
    }

    /// A bad argument or configuration (exit 2).
    pub fn usage(message: impl ToString) -> Failure {
        Failure { message: message.to_string(), exit: EXIT_USAGE }
    }

    /// A fatal error (a bad argument or configuration, a refusal) as it is, exit 2; any other
    /// after `unfinished: ` ("locate could not finish: ..."), exit 1.
    pub fn of(e: RelayError, unfinished: &str) -> Failure {
        match e {
            RelayError::Fatal { .. } => Failure::usage(e),
            _ => Failure::failed(format!("{unfinished}: {e}")),
        }
    }
}

/// A command that has nothing to say when it went well (`verify --watch` until a signal).
impl Output for () {
    fn text(&self) -> String {
        String::new()
    }

    fn exit_code(&self) -> u8 {
        0
    }
}
