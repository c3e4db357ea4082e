//! Record values in the Confluent schema-registry wire format: an outbox event's JSON payload
//! (the text PostgreSQL prints for jsonb) encoded with a schema the registry knows.
//!
//! The wire format: byte 0 is the magic byte 0, bytes 1..5 the schema id (big-endian u32), then
//! the encoding: Avro binary; the JSON text (validated against the JSON Schema); or, for
//! Protobuf, the message-index path (`0` for the first message in the file) then the Protobuf
//! binary. What each encoding accepts is in `avro`, `schema` (JSON Schema) and `protobuf`.
//!
//! Subjects: `topic_name` names a record's subject `<topic>-value`, `record_name` names it after
//! the schema (Avro `namespace.name`, Protobuf `package.Message`, JSON Schema `title`).
//!
//! The cache: each subject's schema id (and the parsed schema, for the subject's latest version)
//! is fetched or registered once, at its first record; callers waiting for the same subject
//! share the one request (a `OnceCell` per subject). A failure is not cached: the next record
//! asks again. A version registered later is picked up at the next start.
//!
//! Errors ([`EncodeError`]), classified for the caller:
//! - `Mismatch`: the payload is not JSON or does not fit the schema; the detail names the field.
//!   This row can never be encoded: dead-letter it;
//! - `Unavailable`: the registry cannot be reached, timed out, or answered 429 or 5xx: retry;
//!   never dead-letter a row for it;
//! - `Refused`: the registry refuses the schema (409 incompatible, 422 invalid), the credentials
//!   (401, 403), or does not hold what is looked up (404), or its certificate cannot be trusted:
//!   an operator must act; the message names the setting.
//!
//! Left out: Avro's decimal, big-decimal and duration logical types (such a schema is refused);
//! Protobuf messages other than the file's first, and imports other than the well-known types;
//! JSON Schema `$ref`s to other documents; schema references; record keys (values only).

mod avro;
mod config;
mod error;
mod protobuf;
mod schema;

pub use config::{
    DEFAULT_REGISTRY_TIMEOUT_MS, MAX_REGISTRY_TIMEOUT_MS, PASSWORD_ENV, RegistryConfig, SchemaType,
    SubjectStrategy,
};
pub use error::EncodeError;
