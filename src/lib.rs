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
//! - [`table`]: the configured outbox table and every SQL text about it;
//! - [`check`]: the `outbox-relay check` preflight;
//! - [`event`]: how a row becomes a Kafka record (one mapping for both modes);
//! - [`dead_letter`]: the one path for an event that cannot be published;
//! - [`sink`]: the Kafka producer (`acks=all`, idempotent), failures classified;
//! - [`source`]: where events come from (polling, replication);
//! - [`checkpoint`], [`position`]: which LSN may be confirmed; LSN arithmetic;
//! - [`postgres`]: connecting, with `sslmode`, certificates and password files;
//! - [`error`]: the one error type and the one policy (retry, standby, fatal);
//! - [`supervisor`]: runs a source: backoff, standby wait, health, shutdown flush;
//! - [`relay`]: the daemon: listener, sampler, supervisor, signals;
//! - [`health`], [`metrics`], [`http`], [`sampler`]: what SREs see.

pub mod check;
pub(crate) mod checkpoint;
pub mod config;
pub(crate) mod dead_letter;
pub mod error;
pub(crate) mod event;
pub(crate) mod health;
pub(crate) mod http;
pub mod metrics;
pub mod position;
pub mod postgres;
pub mod relay;
pub(crate) mod sampler;
pub mod sink;
pub mod source;
pub mod status;
pub(crate) mod supervisor;
pub(crate) mod table;
pub mod verify;
