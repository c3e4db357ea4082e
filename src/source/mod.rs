//! Sources: where committed outbox events come from.

pub(crate) mod handover;
pub(crate) mod polling;
pub mod replication;
pub(crate) mod sampler;
