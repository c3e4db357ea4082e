//! Sources: where committed outbox events come from.

pub mod polling;
pub mod replication;
