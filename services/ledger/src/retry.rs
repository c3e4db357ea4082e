//! What happens after a failed database transaction, and how long to wait before the next try.
//!
//! [`classify`] is THE policy, one SQLSTATE table:
//! - [`Failure::Outage`]: the session is gone or the server cannot do work for now (connection
//!   lost, shutting down, too many connections; out of disk, memory or another resource (class
//!   53), a system or I/O error (class 58), an internal error (class XX)). Every record would
//!   fail alike, so the same record is retried on a new session without limit and never
//!   dead-lettered for it: a full disk must not dead-letter valid payments;
//! - [`Failure::Contended`]: this record's transaction lost a race (`lock_timeout`, a
//!   serialization failure, a deadlock) or failed for an unknown reason. Retried up to
//!   `consumer.max_attempts`, then dead-lettered;
//! - [`Failure::Permanent`]: the database refuses this record's data (a check or unique
//!   constraint, a bad value, a program limit such as an index row too large). Retrying
//!   cannot help: dead-lettered at once;
//! - [`Failure::Fatal`]: the database is not what the ledger needs (a table or column missing,
//!   a privilege, the credentials). Every record would fail: the process stops, exit 1.
//!
//! [`Backoff`] is the relay's capped exponential backoff ([`outbox_relay::backoff`]) with full
//! jitter: the n-th delay is uniform in `[0, min(max, initial * 2^n)]`, so instances that failed
//! together do not retry together.

pub use outbox_relay::backoff::Backoff;
use tokio_postgres::error::SqlState;

/// What to do after a failed transaction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    Outage,
    Contended,
    Permanent,
    Fatal,
}

/// THE classification of a database error.
pub fn classify(error: &tokio_postgres::Error) -> Failure {
    if error.is_closed() {
        return Failure::Outage;
    }
    match error.code() {
        // no SQLSTATE: an I/O error, a timeout, a protocol error on the session
        None => Failure::Outage,
        Some(code) => classify_sqlstate(code),
    }
}

/// The policy for one SQLSTATE (PostgreSQL manual, Appendix A, "Error Codes").
pub fn classify_sqlstate(code: &SqlState) -> Failure {
    let class = &code.code()[..2];
    let is = |states: &[SqlState]| states.contains(code);
    if class == "08"
        || is(&[
            SqlState::ADMIN_SHUTDOWN,
            SqlState::CRASH_SHUTDOWN,
            SqlState::CANNOT_CONNECT_NOW,
            SqlState::TOO_MANY_CONNECTIONS,
            SqlState::READ_ONLY_SQL_TRANSACTION,
        ])
    {
        // a read-only transaction: connected to a standby after a failover; reconnect finds
        // the new primary
        return Failure::Outage;
    }
    if is(&[
        SqlState::LOCK_NOT_AVAILABLE,
        SqlState::T_R_SERIALIZATION_FAILURE,
        SqlState::T_R_DEADLOCK_DETECTED,
    ]) {
        return Failure::Contended;
    }
    match class {
        // insufficient resources (disk full, out of memory), system error (I/O), internal
        // error: the server's trouble, not this record's; retrying the same record on a new
        // session is all the ledger can do until an operator fixes the server
        "53" | "58" | "XX" => Failure::Outage,
        // data exception, integrity constraint violation, program limit exceeded (a value too
        // large for an index row): this record's data, whatever the attempt
        "22" | "23" | "54" => Failure::Permanent,
        // invalid authorization, invalid catalog name, syntax error or access rule violation
        // (undefined table or column, insufficient privilege)
        "28" | "3D" | "42" => Failure::Fatal,
        _ => Failure::Contended,
    }
}

/// What a [`Failure::Contended`] error is called in a dead letter's reason.
pub fn contention_name(error: &tokio_postgres::Error) -> &'static str {
    match error.code() {
        Some(code) if *code == SqlState::LOCK_NOT_AVAILABLE => "lock timeout",
        Some(code) if *code == SqlState::T_R_SERIALIZATION_FAILURE => "serialization failure",
        Some(code) if *code == SqlState::T_R_DEADLOCK_DETECTED => "deadlock",
        _ => "transient error",
    }
}

/// The server's message and SQLSTATE when there is one; tokio-postgres's Display says only
/// "db error".
pub fn describe(error: &tokio_postgres::Error) -> String {
    match error.as_db_error() {
        Some(db) => format!("{} ({})", db.message(), db.code().code()),
        None => error.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sqlstates_are_classified_once() {
        let cases = [
            ("55P03", Failure::Contended),
            ("40001", Failure::Contended),
            ("40P01", Failure::Contended),
            ("57014", Failure::Contended),
            // unknown: a transient error of this transaction, retried up to max_attempts
            ("P0001", Failure::Contended),
            ("53100", Failure::Outage),
            ("53200", Failure::Outage),
            ("53400", Failure::Outage),
            ("58030", Failure::Outage),
            ("58P01", Failure::Outage),
            ("XX000", Failure::Outage),
            ("XX001", Failure::Outage),
            ("54000", Failure::Permanent),
            ("22021", Failure::Permanent),
            ("08006", Failure::Outage),
            ("08001", Failure::Outage),
            ("57P01", Failure::Outage),
            ("57P03", Failure::Outage),
            ("53300", Failure::Outage),
            ("25006", Failure::Outage),
            ("23505", Failure::Permanent),
            ("23514", Failure::Permanent),
            ("22P02", Failure::Permanent),
            ("42P01", Failure::Fatal),
            ("42501", Failure::Fatal),
            ("28P01", Failure::Fatal),
            ("3D000", Failure::Fatal),
        ];
        for (code, expected) in cases {
            assert_eq!(classify_sqlstate(&SqlState::from_code(code)), expected, "{code}");
        }
    }
}
