//! What a promotion would do to the slot: the standbys' copies of a failover slot
//! (PostgreSQL 17+), and PostgreSQL 18's invalidation of slots left idle too long. `check`
//! reports these and the sampler exports them, from the same queries.
//!
//! Invariants:
//! - a standby's copy counts as ready only when a promotion would keep it: synced, persisted
//!   (PostgreSQL keeps a new copy temporary until the primary's slot has moved past the
//!   standby's catalog horizon, and a promotion drops temporary copies), not conflicting and
//!   not invalidated;
//! - the standbys are the servers of `postgres.host` other than the primary the relay uses.

use std::fmt;

use tokio_postgres::Client;

use crate::config::{Endpoint, PostgresConfig};
use crate::error::RelayError;

/// A standby's copy of the slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CopyState {
    /// A promotion keeps it, and the relay goes on from it.
    Ready,
    /// The standby has no copy (no `sync_replication_slots`, or not a failover slot).
    Missing,
    /// Being synchronized but not yet persisted: a promotion now would drop it.
    Temporary,
    /// Not (or no longer) synchronized from the primary.
    Unsynced,
    /// Conflicting with recovery, or invalidated (the reason PostgreSQL gives).
    Invalidated(String),
    /// The server could not be asked (down, or refusing the relay's role).
    Unreachable(String),
}

impl CopyState {
    pub fn is_ready(&self) -> bool {
        *self == CopyState::Ready
    }
}

impl fmt::Display for CopyState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CopyState::Ready => f.write_str("has a synced copy a promotion keeps"),
            CopyState::Missing => f.write_str("has no copy of the slot"),
            CopyState::Temporary => {
                f.write_str("has a copy not yet persisted (sync-ready): a promotion now would drop it")
            }
            CopyState::Unsynced => f.write_str("has a copy that is not synchronized from the primary"),
            CopyState::Invalidated(reason) => write!(f, "has an invalidated copy ({reason})"),
            CopyState::Unreachable(error) => write!(f, "cannot be asked: {error}"),
        }
    }
}

/// The copy of `slot` on `standby`, asked over a session of its own (a standby is read-only).
pub async fn standby_copy(pg: &PostgresConfig, standby: &Endpoint, slot: &str) -> CopyState {
    let client = match crate::postgres::connect_to(pg, standby).await {
        Ok(client) => client,
        Err(e) => return CopyState::Unreachable(e.to_string()),
    };
    let row = client
        .query_opt(
            "SELECT synced, temporary, conflicting, invalidation_reason \
             FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await;
    match row {
        Err(e) => CopyState::Unreachable(e.to_string()),
        Ok(None) => CopyState::Missing,
        Ok(Some(r)) => match (r.get(0), r.get(1), r.get::<_, Option<bool>>(2), r.get::<_, Option<String>>(3))
        {
            (_, _, _, Some(reason)) => CopyState::Invalidated(reason),
            (_, _, Some(true), None) => CopyState::Invalidated("conflicting with recovery".into()),
            (false, _, _, None) => CopyState::Unsynced,
            (true, true, _, None) => CopyState::Temporary,
            (true, false, _, None) => CopyState::Ready,
        },
    }
}

/// The servers of `postgres.host` other than `primary`.
pub fn standbys(pg: &PostgresConfig, primary: &Endpoint) -> Vec<Endpoint> {
    pg.endpoints().into_iter().filter(|e| e != primary).collect()
}

/// The slot's idle time and PostgreSQL 18's `idle_replication_slot_timeout`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Idle {
    /// Seconds since the slot was last streamed from (0 while active; 0 before 17).
    pub inactive_secs: f64,
    /// The timeout in seconds; `None` when off (0) or before 18.
    pub timeout_secs: Option<f64>,
}

impl Idle {
    /// Seconds left before PostgreSQL invalidates the idle slot (at its next checkpoint).
    pub fn remaining_secs(&self) -> Option<f64> {
        self.timeout_secs.map(|timeout| (timeout - self.inactive_secs).max(0.0))
    }
}

/// The slot's [`Idle`] state; `None` when the slot does not exist.
pub async fn idle(client: &Client, slot: &str) -> Result<Option<Idle>, RelayError> {
    let row = client
        .query_opt(
            "SELECT coalesce(extract(epoch FROM now() - (to_jsonb(s) ->> 'inactive_since')::timestamptz), 0)::float8, \
                    (SELECT setting::float8 * CASE unit WHEN 'min' THEN 60 WHEN 'h' THEN 3600 ELSE 1 END \
                     FROM pg_settings WHERE name = 'idle_replication_slot_timeout') \
             FROM pg_replication_slots s WHERE slot_name = $1",
            &[&slot],
        )
        .await?;
    Ok(row.map(|r| Idle {
        inactive_secs: r.get::<_, f64>(0).max(0.0),
        timeout_secs: r.get::<_, Option<f64>>(1).filter(|t| *t > 0.0),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_time_left_never_goes_below_zero_and_is_none_without_a_timeout() {
        let idle = Idle { inactive_secs: 100.0, timeout_secs: Some(3600.0) };
        assert_eq!(idle.remaining_secs(), Some(3500.0));
        assert_eq!(Idle { inactive_secs: 4000.0, ..idle }.remaining_secs(), Some(0.0));
        assert_eq!(Idle { timeout_secs: None, ..idle }.remaining_secs(), None);
    }
}
