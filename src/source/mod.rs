//! Sources: where committed outbox events come from.

pub(crate) mod polling;
pub mod replication;
