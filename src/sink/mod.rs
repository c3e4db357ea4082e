//! Sinks: where events go. Kafka is the one sink.

pub mod kafka;
