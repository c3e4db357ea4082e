//! Sinks: where events go. Kafka is the one sink.

pub(crate) mod dedup;
pub mod kafka;
