//! The relay's one error type and the ONE function that decides what happens after an error.
//!
//! Every failure becomes a [`RelayError`]; [`RelayError::action`] maps it to retry (capped
//! exponential backoff with jitter), standby (another instance is active) or fatal (an operator
//! must act; the process exits non-zero). The fatal list is explicit and closed:
//! [`FatalReason`] is the `reason` label of `outbox_relay_fatal_error`, so alerts key on a
//! variant, never on the wording of a message. Anything not on the list, known or not, is
//! retried.
//!
//! SQLSTATEs get their general meaning here and only here, whether they come from tokio-postgres
//! or from the replication transport's error text ([`sqlstate_action`]). The codes whose object
//! only the raising replication command knows (the slot or the publication: undefined, in use,
//! invalidated) are turned into their fatal reason or standby by the transport
//! (`source::replication::transport::in_context`) before this policy sees them.

use tokio_postgres::error::SqlState;

use crate::label::labels;

#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    /// A PostgreSQL session (SQL) failed or answered with an error.
    #[error("postgres: {}", describe_pg(.0))]
    Postgres(#[from] tokio_postgres::Error),
    /// The replication connection's server answered with an error (`sqlstate` when it said one).
    #[error("postgres: {message}")]
    Server { sqlstate: Option<String>, message: String },
    /// The connection to PostgreSQL dropped, or the server ended the stream.
    #[error("postgres: {0}")]
    Disconnected(String),
    /// Kafka did not acknowledge a record in time to keep going; retried.
    #[error("kafka: {0}")]
    Kafka(String),
    /// Kafka answered a record with a transient failure: the session ends and the record is
    /// sent again from its position; retried.
    #[error("kafka: event {event} not acknowledged: {detail}")]
    Unacknowledged { event: String, detail: String },
    /// Another instance holds the slot or the leader lock; this one waits as a standby.
    #[error("{0}")]
    Standby(String),
    /// The server sent what the replication protocol does not allow: retrying replays it.
    #[error("replication protocol: {0}; please report this as a bug")]
    Protocol(String),
    /// The schema registry could not be reached, timed out or answered 5xx: retried.
    #[error("{0}")]
    Registry(String),
    /// Shutdown was requested while a step could not finish; nothing was confirmed past it.
    #[error("interrupted by shutdown")]
    Interrupted,
    /// An operator must act; the message says what to do.
    #[error("{message}")]
    Fatal { reason: FatalReason, message: String },
}

/// What the supervisor does after a session ended with an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Back off, then start a new session.
    Retry,
    /// Wait as a standby, then try to become active again.
    Standby,
    /// Stop the relay and exit non-zero.
    Fatal(FatalReason),
}

labels! {
    /// Why the relay stopped: the `reason` label of `outbox_relay_fatal_error`.
    pub enum FatalReason {
        /// The slot was invalidated: PostgreSQL removed WAL it had not read.
        SlotLost = "slot_lost",
        /// The slot the relay published from is gone.
        SlotMissing = "slot_missing",
        /// The server was promoted from a standby that had no copy of the slot.
        FailoverWithoutSlot = "failover_without_slot",
        /// The publication is missing, or does not publish the outbox.
        Publication = "publication",
        /// The outbox table was renamed or moved while the relay streamed.
        OutboxChanged = "outbox_changed",
        /// A table, column or database the configuration names does not exist.
        Schema = "schema",
        /// PostgreSQL refused the credentials.
        Auth = "auth",
        /// TLS cannot be set up, or the server's certificate cannot be trusted.
        Tls = "tls",
        /// `postgres.sslmode` requires TLS and the server does not offer it.
        TlsUnavailable = "tls_unavailable",
        /// The server cannot send text as UTF-8 (a SQL_ASCII database holding other bytes).
        Encoding = "encoding",
        /// A change in the stream is larger than `replication.max_message_bytes`.
        TooLarge = "too_large",
        /// The role lacks a privilege it needs.
        Privilege = "privilege",
        /// The configuration cannot work (checked at start-up).
        Config = "config",
        /// The replication stream broke the protocol.
        Protocol = "protocol",
        /// The schema registry refuses the schema or the credentials, or lacks the subject.
        SchemaRegistry = "schema_registry",
        /// Anything else an operator must look at (e.g. the Kafka producer cannot be created).
        Other = "other",
    }
}

impl RelayError {
    pub fn fatal(reason: FatalReason, message: impl Into<String>) -> RelayError {
        RelayError::Fatal { reason, message: message.into() }
    }

    /// THE policy: what to do after this error.
    pub fn action(&self) -> Action {
        match self {
            RelayError::Postgres(e) => match e.code() {
                Some(code) => sqlstate_action(code.code()),
                None => Action::Retry,
            },
            RelayError::Server { sqlstate: Some(code), .. } => sqlstate_action(code),
            RelayError::Server { sqlstate: None, .. } => Action::Retry,
            RelayError::Disconnected(_) | RelayError::Kafka(_) | RelayError::Interrupted => Action::Retry,
            RelayError::Unacknowledged { .. } => Action::Retry,
            RelayError::Registry(_) => Action::Retry,
            RelayError::Standby(_) => Action::Standby,
            RelayError::Protocol(_) => Action::Fatal(FatalReason::Protocol),
            RelayError::Fatal { reason, .. } => Action::Fatal(*reason),
        }
    }

    /// A low-cardinality label for logs: what kind of outage this is.
    pub fn kind(&self) -> &'static str {
        match self {
            RelayError::Postgres(e) if e.is_closed() || e.code().is_none() => "postgres_unavailable",
            RelayError::Disconnected(_) => "postgres_unavailable",
            RelayError::Postgres(_) | RelayError::Server { .. } => "postgres_error",
            RelayError::Kafka(_) | RelayError::Unacknowledged { .. } => "kafka_unavailable",
            RelayError::Registry(_) => "registry_unavailable",
            RelayError::Standby(_) => "standby",
            RelayError::Interrupted => "shutdown",
            RelayError::Protocol(_) | RelayError::Fatal { .. } => "fatal",
        }
    }
}

/// The policy for a SQLSTATE, from either client. Fatal ones cannot be fixed by retrying.
pub fn sqlstate_action(code: &str) -> Action {
    let state = SqlState::from_code(code);
    let fatal = |reason| Action::Fatal(reason);
    match state {
        SqlState::INVALID_PASSWORD | SqlState::INVALID_AUTHORIZATION_SPECIFICATION => {
            fatal(FatalReason::Auth)
        }
        SqlState::INSUFFICIENT_PRIVILEGE => fatal(FatalReason::Privilege),
        SqlState::UNDEFINED_TABLE | SqlState::UNDEFINED_COLUMN | SqlState::INVALID_CATALOG_NAME => {
            fatal(FatalReason::Schema)
        }
        // an object the configuration names; which one (slot, publication) only the command that
        // raised it knows: the replication transport says so (`transport::in_context`)
        SqlState::UNDEFINED_OBJECT => fatal(FatalReason::Schema),
        // e.g. `logical decoding requires wal_level >= logical`; an invalidated slot is told apart
        // by the replication transport
        SqlState::OBJECT_NOT_IN_PREREQUISITE_STATE => fatal(FatalReason::Config),
        // `invalid byte sequence for encoding "UTF8"`: the same row fails every time
        SqlState::CHARACTER_NOT_IN_REPERTOIRE | SqlState::UNTRANSLATABLE_CHARACTER => {
            fatal(FatalReason::Encoding)
        }
        _ => Action::Retry,
    }
}

/// The SQLSTATE in a server error text such as pgwire-replication's
/// `ERROR: ... (SQLSTATE 55006)`.
pub fn sqlstate_in(message: &str) -> Option<String> {
    let at = message.find("SQLSTATE ")? + "SQLSTATE ".len();
    let code: String = message[at..].chars().take(5).collect();
    (code.len() == 5 && code.chars().all(|c| c.is_ascii_alphanumeric())).then_some(code)
}

/// The server's message and hint when there is one; tokio-postgres's Display says only "db error".
pub(crate) fn describe_pg(e: &tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => match db.hint() {
            Some(hint) => format!("{} ({}); hint: {hint}", db.message(), db.code().code()),
            None => format!("{} ({})", db.message(), db.code().code()),
        },
        None => e.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn server(code: &str) -> RelayError {
        RelayError::Server { sqlstate: Some(code.into()), message: "x".into() }
    }

    #[test]
    fn every_variant_has_its_action() {
        assert_eq!(RelayError::Disconnected("reset".into()).action(), Action::Retry);
        assert_eq!(RelayError::Kafka("down".into()).action(), Action::Retry);
        assert_eq!(RelayError::Interrupted.action(), Action::Retry);
        assert_eq!(RelayError::Standby("slot busy".into()).action(), Action::Standby);
        assert_eq!(
            RelayError::Protocol("Commit without Begin".into()).action(),
            Action::Fatal(FatalReason::Protocol)
        );
        assert_eq!(RelayError::Server { sqlstate: None, message: "?".into() }.action(), Action::Retry);
        for &reason in FatalReason::ALL {
            assert_eq!(RelayError::fatal(reason, "m").action(), Action::Fatal(reason));
        }
    }

    #[test]
    fn sqlstates_are_classified_once() {
        assert_eq!(server("28P01").action(), Action::Fatal(FatalReason::Auth));
        assert_eq!(server("28000").action(), Action::Fatal(FatalReason::Auth));
        assert_eq!(server("42501").action(), Action::Fatal(FatalReason::Privilege));
        assert_eq!(server("42P01").action(), Action::Fatal(FatalReason::Schema));
        assert_eq!(server("42703").action(), Action::Fatal(FatalReason::Schema));
        assert_eq!(server("3D000").action(), Action::Fatal(FatalReason::Schema));
        assert_eq!(server("42704").action(), Action::Fatal(FatalReason::Schema));
        assert_eq!(server("55000").action(), Action::Fatal(FatalReason::Config));
        assert_eq!(server("22021").action(), Action::Fatal(FatalReason::Encoding));
        // admin shutdown, too many connections, serialization, an object in use: transient
        for code in ["57P01", "53300", "40001", "08006", "55006", "42710"] {
            assert_eq!(server(code).action(), Action::Retry, "{code}");
        }
    }

    #[test]
    fn sqlstate_is_read_from_server_text() {
        let text = "ERROR: replication slot \"s\" is active for PID 42 (SQLSTATE 55006)";
        assert_eq!(sqlstate_in(text).as_deref(), Some("55006"));
        assert_eq!(sqlstate_in("no code here"), None);
        assert_eq!(sqlstate_in("SQLSTATE 12"), None);
    }
}
