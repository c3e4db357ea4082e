//! The operator commands: `check` (preflight), `setup` (the publication and slot of replication
//! mode), `status` (one look at a running relay and its slot or backlog), `verify` (did every
//! committed row reach Kafka), `switchover-ready` (may this standby be promoted now).
//!
//! Invariant: a command returns what it found or did for `main` to print; only `setup` changes
//! anything (through the replication source, which owns the slot and its first copy).

pub mod check;
pub mod locate;
pub mod replay;
pub mod republish;
pub mod setup;
pub mod status;
pub mod switchover;
pub mod verify;
