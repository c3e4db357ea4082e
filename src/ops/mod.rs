//! The operator commands: `check` (preflight), `status` (one look at a running relay and its
//! slot or backlog), `verify` (did every committed row reach Kafka).
//!
//! Invariant: a command reads, and returns what it found for `main` to print; the only command
//! that changes anything (`setup`) lives with the replication source, whose slot it creates.

pub mod check;
pub mod status;
pub mod verify;
