//! Why the relay will not use or create a slot or publication, and what to do: one value that
//! `run` and `setup` stop with and `check` reports in the same words.

use crate::error::{FatalReason, RelayError};

/// Why the relay will not use or create the slot, and what to do: `run` and `setup` stop with
/// it ([`Refusal::error`]), `check` FAILs with the same words.
#[derive(Debug, Clone)]
pub(crate) struct Refusal {
    pub reason: FatalReason,
    pub problem: String,
    pub fix: String,
}

impl Refusal {
    pub(crate) fn error(&self) -> RelayError {
        RelayError::fatal(self.reason, format!("{}; {}", self.problem, self.fix))
    }
}
