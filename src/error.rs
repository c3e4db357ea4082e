//! The relay's error type and the ONE place that decides retry versus fatal.
//!
//! Fatal errors are an explicit list (authentication failed, table or privilege missing,
//! configuration invalid); the relay exits non-zero with the message. Everything else, known or
//! not, is transient: retried with capped exponential backoff and jitter.

use tokio_postgres::error::SqlState;

#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    #[error("postgres: {}", describe_pg(.0))]
    Postgres(#[from] tokio_postgres::Error),
    #[error("kafka: {0}")]
    Kafka(String),
    #[error("postgres: {0}")]
    ConnectionLost(String),
    /// Another instance streams from the slot; this one waits as a standby.
    #[error("{0}")]
    SlotInUse(String),
    /// An operator must act; the message says what to do.
    #[error("{0}")]
    Fatal(String),
}

/// Fatal SQLSTATEs: retrying cannot fix them, an operator must.
const FATAL_SQLSTATES: &[SqlState] = &[
    SqlState::INVALID_PASSWORD,
    SqlState::INVALID_AUTHORIZATION_SPECIFICATION,
    SqlState::INSUFFICIENT_PRIVILEGE,
    SqlState::UNDEFINED_TABLE,
    SqlState::UNDEFINED_COLUMN,
    SqlState::INVALID_CATALOG_NAME,
];

impl RelayError {
    /// True when retrying cannot help.
    pub fn is_fatal(&self) -> bool {
        match self {
            RelayError::Fatal(_) => true,
            RelayError::Postgres(e) => e.code().is_some_and(|code| FATAL_SQLSTATES.contains(code)),
            RelayError::Kafka(_) | RelayError::ConnectionLost(_) | RelayError::SlotInUse(_) => false,
        }
    }

    /// The `reason` label of `outbox_relay_fatal_error`.
    pub fn fatal_reason(&self) -> &'static str {
        match self {
            RelayError::Fatal(m) if m.contains("invalidated") => "slot_lost",
            RelayError::Fatal(m) if m.contains("is missing") => "slot_missing",
            RelayError::Postgres(_) => "postgres",
            _ => "other",
        }
    }

    /// A low-cardinality label for logs and metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            RelayError::Postgres(e) if e.is_closed() || e.code().is_none() => "postgres_unavailable",
            RelayError::ConnectionLost(_) => "postgres_unavailable",
            RelayError::SlotInUse(_) => "standby",
            RelayError::Postgres(_) => "postgres_error",
            RelayError::Kafka(_) => "kafka_unavailable",
            RelayError::Fatal(_) => "fatal",
        }
    }
}

/// The server's message and hint when there is one; tokio-postgres's Display says only "db error".
fn describe_pg(e: &tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => match db.hint() {
            Some(hint) => format!("{} ({}); hint: {hint}", db.message(), db.code().code()),
            None => format!("{} ({})", db.message(), db.code().code()),
        },
        None => e.to_string(),
    }
}
