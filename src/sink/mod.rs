//! Sinks: where events go. Kafka is the one sink.

pub(crate) mod cluster;
pub(crate) mod dedup;
pub mod kafka;
