//! Errors that stop the process: each means no record can be applied until an operator acts.
//! Everything else (an unreachable database, a lock timeout, a poison record, a record the
//! database refuses, a broker hiccup) is handled where it happens: retried, declined or
//! dead-lettered (see [`crate::retry`]), so one record can never stop the consumer. Each message
//! says what to do.

use outbox_relay::config::ConfigError;
use outbox_relay::error::RelayError;
use rdkafka::error::KafkaError;

#[derive(Debug, thiserror::Error)]
pub enum LedgerError {
    /// Exit status 2: the configuration cannot work.
    #[error("invalid configuration: {0}")]
    Config(#[from] ConfigError),
    /// The database refused the session in a way retrying cannot fix (credentials, TLS).
    #[error("{0}")]
    Connect(RelayError),
    #[error(
        "database \"{database}\" has no table {tables}: apply sql/examples/ledger.sql (and the \
         relay's sql/001_outbox_events.sql for outbox_events; for another consumer.outbox_table, make it \
         like outbox_events) to it, then start the ledger again"
    )]
    MissingTables { database: String, tables: String },
    /// The database cannot apply any event (a table or column gone, a privilege missing): an
    /// error classified [`crate::retry::Failure::Fatal`], or one that fails opening a session.
    /// Never a single record's failure: that record is dead-lettered instead.
    #[error(
        "postgres: {during}: {error}: no event can be applied to this database until that is \
         fixed (a table, column or privilege missing?); fix it and start the ledger again"
    )]
    Database { during: String, error: String },
    #[error("kafka: cannot create the {client}: {source}; check the [kafka] section")]
    KafkaClient { client: &'static str, source: KafkaError },
    #[error("kafka: {what}: {source}")]
    Kafka { what: String, source: KafkaError },
}

impl LedgerError {
    /// The process exit status: 2 for configuration, 1 for the rest.
    pub fn exit_code(&self) -> u8 {
        match self {
            LedgerError::Config(_) => 2,
            _ => 1,
        }
    }
}
