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
//! asks again (callers that were waiting on it try one after the other). A version registered
//! later is picked up at the next start.
//!
//! Wiring: the configuration loader calls [`RegistryConfig::load_secrets`] (the password from
//! `OUTBOX_RELAY_REGISTRY_PASSWORD`) and [`RegistryConfig::validate`] with the section's path;
//! [`Registry::new`] reads the files, and its errors name `registry.<setting>`.
//!
//! Errors ([`EncodeError`]), classified for the caller:
//! - `Mismatch`: the payload is not JSON or does not fit the schema; the detail names the field.
//!   This row can never be encoded: dead-letter it;
//! - `Unavailable`: the registry cannot be reached, timed out, or answered 408, 429 or 5xx: retry;
//!   never dead-letter a row for it;
//! - `NoSchema`: the registry holds no schema under the subject a row's topic names (404 with
//!   the registry's code for it): that row is dead-lettered (or holds under `block`), the rest
//!   flow on. Under `record_name` the subject is every row's: `Refused` instead;
//! - `Refused`: the registry refuses the schema (409 incompatible, 422 invalid), the credentials
//!   (401, 403), or answers a 404 that is not its own (`registry.url` is wrong), or its
//!   certificate cannot be trusted: an operator must act; the message names the setting.
//!
//! Left out: Avro's decimal, big-decimal and duration logical types (such a schema is refused);
//! Protobuf messages other than the file's first, and imports other than the well-known types;
//! JSON Schema `$ref`s to other documents; schema references; record keys (values only).

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::OnceCell;

mod avro;
mod client;
mod decode;
mod error;
mod protobuf;
mod schema;

pub use crate::config::registry::{
    DEFAULT_REGISTRY_TIMEOUT_MS, MAX_REGISTRY_TIMEOUT_MS, PASSWORD_ENV, RegistryConfig, SchemaType,
    SubjectStrategy,
};
pub use decode::Decoder;
pub use error::EncodeError;

use client::Client;
use schema::Schema;

/// Every outbox's registry built once, as the relay will build it: its schema file parses and
/// its client's settings (the CA file) are usable. The configuration's own `validate` cannot do
/// this (parsing a schema is this module's work, and the configuration sits below it); every
/// command runs it right after loading.
pub fn check(config: &crate::config::RelayConfig) -> Result<(), crate::config::ConfigError> {
    for outbox in config.outboxes() {
        if let Some(registry) = &outbox.config.registry {
            let section = format!("{}.registry", outbox.path);
            Registry::new(registry).map_err(|message| {
                crate::config::ConfigError::invalid(&section, message.replacen("registry.", "", 1))
            })?;
        }
    }
    Ok(())
}

/// The first byte of every value in the wire format.
pub const MAGIC_BYTE: u8 = 0;

/// Encodes payloads for one registry configuration; shared by every caller (`&self`).
pub struct Registry {
    client: Client,
    schema_type: SchemaType,
    strategy: SubjectStrategy,
    auto_register: bool,
    /// `schema_file`, read and parsed at start-up.
    configured: Option<Configured>,
    subjects: Mutex<HashMap<String, Arc<OnceCell<Subject>>>>,
}

impl fmt::Debug for Registry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Registry")
            .field("url", &self.client.base().as_str())
            .field("schema_type", &self.schema_type)
            .field("subject_strategy", &self.strategy)
            .field("auto_register", &self.auto_register)
            .finish_non_exhaustive()
    }
}

struct Configured {
    text: String,
    schema: Arc<Schema>,
    /// The subject under `record_name`.
    name: Option<String>,
}

/// A subject's schema as the registry knows it.
#[derive(Clone)]
struct Subject {
    id: u32,
    schema: Arc<Schema>,
}

impl Registry {
    /// Reads and parses `schema_file` (when set) and sets up the HTTP client; the error names
    /// the setting. Nothing is asked of the registry until the first [`Registry::encode`].
    pub fn new(config: &RegistryConfig) -> Result<Registry, String> {
        let configured = match config.schema_file.as_str() {
            "" => None,
            file => Some(configured(config, file)?),
        };
        Ok(Registry {
            client: Client::new(config)?,
            schema_type: config.schema_type,
            strategy: config.subject_strategy,
            auto_register: config.auto_register,
            configured,
            subjects: Mutex::new(HashMap::new()),
        })
    }

    /// The subject the records of `topic` are registered under.
    pub fn subject(&self, topic: &str) -> String {
        match (self.strategy, self.configured.as_ref().and_then(|c| c.name.as_deref())) {
            (SubjectStrategy::RecordName, Some(name)) => name.to_string(),
            _ => format!("{topic}-value"),
        }
    }

    /// The record value for `payload` (JSON text) on `topic`, in the wire format.
    /// A subject the registry does not hold is [`EncodeError::NoSchema`] when the topic (and so
    /// the row) chose it, [`EncodeError::Refused`] under `record_name` (every row's subject).
    pub async fn encode(&self, topic: &str, payload: &str) -> Result<Vec<u8>, EncodeError> {
        let subject_name = self.subject(topic);
        let subject = match self.resolve(&subject_name).await {
            Err(EncodeError::NoSchema { subject, detail })
                if self.strategy == SubjectStrategy::RecordName =>
            {
                return Err(EncodeError::Refused { subject, detail });
            }
            resolved => resolved?,
        };
        encode_with(&subject_name, &subject, payload)
    }

    /// Whether subjects use their latest version (no `schema_file`): a cached one may have been
    /// superseded since.
    pub fn follows_latest(&self) -> bool {
        self.configured.is_none()
    }

    /// Forgets the schema of `topic`'s subject: the next record asks the registry again.
    pub fn forget(&self, topic: &str) {
        let subject = self.subject(topic);
        self.subjects.lock().unwrap_or_else(PoisonError::into_inner).remove(&subject);
    }

    /// As [`Registry::encode`] without waiting: `None` when the subject of `topic` has not been
    /// resolved yet (then `encode` asks the registry).
    pub fn encode_cached(&self, topic: &str, payload: &str) -> Option<Result<Vec<u8>, EncodeError>> {
        let subject_name = self.subject(topic);
        let subject = {
            let subjects = self.subjects.lock().unwrap_or_else(PoisonError::into_inner);
            subjects.get(&subject_name)?.get()?.clone()
        };
        Some(encode_with(&subject_name, &subject, payload))
    }

    /// The subject's id and schema: cached, else asked once however many callers wait.
    async fn resolve(&self, subject: &str) -> Result<Subject, EncodeError> {
        let cell = {
            let mut subjects = self.subjects.lock().unwrap_or_else(PoisonError::into_inner);
            subjects.entry(subject.to_string()).or_default().clone()
        };
        cell.get_or_try_init(|| self.fetch(subject)).await.cloned()
    }

    /// Registers or looks up `schema_file` under `subject`, or reads its latest version.
    async fn fetch(&self, subject: &str) -> Result<Subject, EncodeError> {
        let kind = self.schema_type;
        let resolved = match &self.configured {
            Some(configured) => {
                let id = match self.auto_register {
                    true => self.client.register(subject, kind, &configured.text).await?,
                    false => self.client.lookup(subject, kind, &configured.text).await?,
                };
                Subject { id, schema: configured.schema.clone() }
            }
            None => self.latest(subject).await?,
        };
        tracing::info!(subject, schema_id = resolved.id, "schema registry subject resolved");
        Ok(resolved)
    }

    async fn latest(&self, subject: &str) -> Result<Subject, EncodeError> {
        let version = self.client.latest(subject).await?;
        let refused = |detail: String| EncodeError::Refused { subject: subject.to_string(), detail };
        let registered = version.schema_type.as_deref().unwrap_or("AVRO");
        if !registered.eq_ignore_ascii_case(self.schema_type.registry_name()) {
            return Err(refused(format!(
                "subject {subject}: its latest schema (id {}) is {registered}, but registry.schema_type is \
                 {}; set registry.schema_type to match",
                version.id,
                self.schema_type.registry_name().to_ascii_lowercase()
            )));
        }
        let schema = Schema::parse(self.schema_type, &version.schema).map_err(|e| {
            refused(format!("subject {subject}: its latest schema (id {}) cannot be used: {e}", version.id))
        })?;
        Ok(Subject { id: version.id, schema: Arc::new(schema) })
    }
}

/// `payload` encoded with `subject`'s schema, in the wire format.
fn encode_with(subject_name: &str, subject: &Subject, payload: &str) -> Result<Vec<u8>, EncodeError> {
    let mismatch = |detail: String| EncodeError::Mismatch {
        subject: subject_name.to_string(),
        schema_id: subject.id,
        detail,
    };
    let json: serde_json::Value =
        serde_json::from_str(payload).map_err(|e| mismatch(format!("payload: not JSON ({e})")))?;
    let mut value = Vec::with_capacity(payload.len() + 8);
    write_header(subject.id, &mut value);
    subject.schema.encode(&json, payload, &mut value).map_err(mismatch)?;
    Ok(value)
}

/// Reads and parses `schema_file`; under `record_name`, the schema must have a name.
fn configured(config: &RegistryConfig, file: &str) -> Result<Configured, String> {
    let text = std::fs::read_to_string(file).map_err(|e| format!("registry.schema_file {file}: {e}"))?;
    let schema =
        Schema::parse(config.schema_type, &text).map_err(|e| format!("registry.schema_file {file}: {e}"))?;
    let name = schema.full_name();
    if config.subject_strategy == SubjectStrategy::RecordName && name.is_none() {
        return Err(format!(
            "registry.schema_file {file}: the schema has no name for subject_strategy = \"record_name\" \
             (an Avro record, enum or fixed; a JSON Schema \"title\"); name it, or use \"topic_name\""
        ));
    }
    Ok(Configured { text, schema: Arc::new(schema), name })
}

/// The wire format's header: the magic byte, then the schema id big-endian.
fn write_header(schema_id: u32, out: &mut Vec<u8>) {
    out.push(MAGIC_BYTE);
    out.extend_from_slice(&schema_id.to_be_bytes());
}

#[cfg(test)]
mod tests;
