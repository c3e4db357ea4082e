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
//! Modules, top down (each uses only those below it):
//! - [`relay`]: the daemon: listener, sampler, supervisor, signals; [`ops`]: the operator
//!   commands (`check`, `status`, `verify`);
//! - [`supervisor`]: runs a source: the error policy, backoff, standby wait, shutdown flush;
//! - [`source`]: where events come from (polling, replication), and the sampler of what
//!   PostgreSQL says of them (slot, backlog);
//! - [`delivery`]: the one path from a source to Kafka (read-back, the poison policy, hold and
//!   resend, the stall watch), and how a row becomes a Kafka record (`delivery::record`, one
//!   mapping for both modes, in the outbox's format: raw, CloudEvents, Debezium's); [`registry`]:
//!   values in Avro, JSON Schema or Protobuf through a schema registry; [`dead_letter`]: the one row shape and INSERT of a dead letter;
//! - [`sink`]: the Kafka producer (`acks=all`, idempotent), failures classified, the read-back;
//! - [`checkpoint`]: which LSN may be confirmed; [`table`]: the outbox table and its SQL;
//!   [`postgres`]: connecting, with `sslmode`, certificates and password files;
//! - [`observe`]: metrics (with their typed labels), health and the session's pulse, the HTTP
//!   listener;
//! - [`backoff`]: capped exponential backoff, shared with the example services;
//! - [`config`]: the TOML + environment configuration, validated, secrets redacted;
//!   [`error`]: the one error type and the one policy (retry, standby, fatal); [`lsn`]: LSN
//!   arithmetic.

pub mod backoff;
pub(crate) mod checkpoint;
pub mod config;
pub(crate) mod dead_letter;
pub(crate) mod delivery;
pub mod error;
pub(crate) mod label;
pub mod lsn;
pub mod observe;
pub mod ops;
pub mod postgres;
pub mod published;
pub(crate) mod readback;
pub mod record;
pub mod relay;
pub mod secret;
pub mod sink;
pub mod source;
pub(crate) mod supervisor;
pub(crate) mod table;

/// The metric names and their help, public for the tests that scrape a relay.
pub use observe::metrics;
