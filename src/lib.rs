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
//! ## Layers, top down
//!
//! A module uses only modules on its own line or below it; `tests/layers.rs` reads this list and
//! fails on an import that points up, on a top-level module missing from it, and on files that
//! use each other in a circle.
//! 1. `main`, [`relay`], [`ops`]: the binary's bootstrap; the daemon (listener, sampler,
//!    supervisor, signals); the operator commands (`check`, `status`, `verify`, `locate`,
//!    `replay-dead-letters`, `republish`, ...)
//! 2. [`supervisor`]: runs a source: the error policy, backoff, standby wait, shutdown flush
//! 3. [`source`]: where events come from (polling, replication), and the sampler of what
//!    PostgreSQL says of them (slot, backlog)
//! 4. [`delivery`]: the one path from a source to Kafka (the poison policy, hold and resend, the
//!    stall watch, Kafka transactions, the republish and replay the active session carries out
//!    beside its stream)
//! 5. [`dead_letter`], [`outboxes`], [`published`]: the one row shape and INSERT of a dead
//!    letter; the typed list of the outboxes read (built once, passed down); the record of what
//!    was published
//! 6. [`readback`]: the Kafka consumer that finds what this relay already published (dedup)
//! 7. [`sink`]: the Kafka producer (`acks=all`, idempotent), failures classified; its client
//!    settings (TLS, SASL) for every client of the relay's
//! 8. [`table`]: the outbox table and its SQL
//! 9. [`record`]: how a row becomes a Kafka record, one mapping for both modes, in the outbox's
//!    format (raw, CloudEvents, Debezium's), values encoded through a schema registry
//!    (`record::registry`: Avro, JSON Schema, Protobuf)
//! 10. [`postgres`], [`checkpoint`]: connecting, with `sslmode`, certificates and password files;
//!     which LSN may be confirmed
//! 11. [`credentials`]: the Kafka OAUTHBEARER tokens of `[kafka.auth]` (OIDC client credentials,
//!     a token file, AWS MSK IAM) and RDS IAM tokens, fetched, cached and refreshed in one place
//! 12. [`observe`]: metrics (with their typed labels), health and the session's pulse, the HTTP
//!     listener
//! 13. [`backoff`]: capped exponential backoff, shared with the example services
//! 14. [`config`]: the TOML + environment configuration, validated, secrets redacted
//! 15. [`secret`], [`label`], [`error`], [`lsn`]: a string never logged; the metric-label enum
//!     macro; the one error type and the one policy (retry, standby, fatal); LSN arithmetic

pub mod backoff;
pub(crate) mod checkpoint;
pub mod config;
pub mod credentials;
pub(crate) mod dead_letter;
pub(crate) mod delivery;
pub mod error;
pub(crate) mod label;
pub mod lsn;
pub mod observe;
pub mod ops;
pub mod outboxes;
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
