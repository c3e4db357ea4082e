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
//! [`Backoff`] is capped exponential backoff with full jitter: the n-th delay is uniform in
//! `[0, min(max, initial * 2^n)]`, so instances that failed together do not retry together.

use std::time::Duration;

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

/// Capped exponential backoff with full jitter.
#[derive(Debug, Clone)]
pub struct Backoff {
    initial: Duration,
    max: Duration,
    failures: u32,
}

impl Backoff {
    pub fn new(initial: Duration, max: Duration) -> Backoff {
        Backoff { initial, max, failures: 0 }
    }

    /// The delay before the next try: uniform in `[0, cap]`.
    pub fn next_delay(&mut self) -> Duration {
        let cap = self.cap();
        self.failures = self.failures.saturating_add(1);
        let cap_ms = u64::try_from(cap.as_millis()).unwrap_or(u64::MAX);
        Duration::from_millis(rand::random_range(0..=cap_ms))
    }

    /// `min(max, initial * 2^failures)`.
    fn cap(&self) -> Duration {
        let factor = 1u32.checked_shl(self.failures.min(31)).unwrap_or(u32::MAX);
        self.initial.saturating_mul(factor).min(self.max)
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

    #[test]
    fn the_cap_doubles_up_to_the_maximum() {
        let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_millis(1_000));
        let mut caps = Vec::new();
        for _ in 0..6 {
            caps.push(backoff.cap().as_millis());
            backoff.next_delay();
        }
        assert_eq!(caps, [100, 200, 400, 800, 1_000, 1_000]);
        for _ in 0..100 {
            backoff.next_delay();
        }
        assert_eq!(backoff.cap(), Duration::from_millis(1_000));
    }

    #[test]
    fn every_delay_is_within_its_cap() {
        let mut backoff = Backoff::new(Duration::from_millis(10), Duration::from_millis(50));
        let mut seen_below_cap = false;
        for _ in 0..200 {
            let cap = backoff.cap();
            let delay = backoff.next_delay();
            assert!(delay <= cap, "{delay:?} > {cap:?}");
            seen_below_cap |= delay < cap;
        }
        // full jitter: not every delay is the cap
        assert!(seen_below_cap);
    }
}
