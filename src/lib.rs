//! outbox-relay moves committed transactional-outbox rows from PostgreSQL to Apache Kafka.
//!
//! The delivery guarantee, in five lines:
//! 1. an event is published only after the transaction that wrote it committed (no phantoms);
//! 2. a source position (a polling batch, a replication LSN) is released only after Kafka has
//!    acknowledged, with `acks=all` and the idempotent producer, every event up to it (no loss);
//! 3. the events of one aggregate are produced in commit order to one partition (per-key order);
//! 4. a crash replays at most the unacknowledged tail (at-least-once; duplicates carry the same `id`);
//! 5. a row that cannot be published is dead-lettered or blocks, loudly, never dropped.
//!
//! Modules:
//! - [`config`]: the TOML + environment configuration, validated, secrets redacted;
//! - [`table`]: the configured outbox table and the SQL built from its column names;
//! - [`check`]: the `outbox-relay check` preflight;
//! - [`event`]: how a row becomes a Kafka record (one mapping for both modes);
//! - [`sink`]: the Kafka producer (`acks=all`, idempotent), failures classified;
//! - [`source`]: where events come from (polling, replication);
//! - [`checkpoint`], [`position`]: which LSN may be confirmed; LSN arithmetic;
//! - [`relay`]: the daemon and its graceful shutdown;
//! - [`error`], [`retry`]: retry versus fatal, and backoff;
//! - [`metrics`], [`http`], [`sampler`]: what SREs see: metrics, health, slot and backlog gauges.

pub mod check;
pub mod checkpoint;
pub mod config;
pub mod error;
pub mod event;
pub mod http;
pub mod metrics;
pub mod position;
pub mod relay;
pub mod retry;
pub mod sampler;
pub mod sink;
pub mod source;
pub mod table;
