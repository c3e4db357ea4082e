//! What a promotion would do to the slot: the standbys' copies of a failover slot
//! (PostgreSQL 17+), and PostgreSQL 18's invalidation of slots left idle too long. `check`
//! reports these and the sampler exports them, from the same queries.
//!
//! Invariants:
//! - a standby's copy counts as ready only when a promotion would keep it: synced, persisted
//!   (PostgreSQL keeps a new copy temporary until the primary's slot has moved past the
//!   standby's catalog horizon, and a promotion drops temporary copies), not conflicting and
//!   not invalidated;
//! - the standbys are the servers of `postgres.host` other than the primary the relay uses;
//!   one that is not in recovery is reported as such, never advised to drop a slot.

use std::collections::HashMap;
use std::fmt;

use tokio_postgres::Client;

use crate::config::{Endpoint, PostgresConfig};
use crate::error::RelayError;
use crate::lsn::Lsn;

/// A standby's copy of the slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum CopyState {
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
    /// The server is not in recovery: not a standby (another name of the primary?).
    NotStandby,
    /// The server could not be asked (down, or refusing the relay's role).
    Unreachable(String),
}

impl CopyState {
    pub(crate) fn is_ready(&self) -> bool {
        *self == CopyState::Ready
    }
}

/// A standby's copy of the slot: its state, and the position it has confirmed (where a relay
/// going on from it after a promotion starts: what lies past it is sent again).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SlotCopy {
    pub state: CopyState,
    pub confirmed: Option<Lsn>,
}

impl SlotCopy {
    fn of(state: CopyState) -> SlotCopy {
        SlotCopy { state, confirmed: None }
    }

    /// Whether a planned switchover to this standby is safe now, with the relay at `confirmed`
    /// on the primary: the copy is one a promotion keeps and has reached that position, so the
    /// relay goes on from it sending nothing twice. `Err` says what is missing.
    pub(crate) fn switchover_ready(&self, confirmed: Lsn) -> Result<Lsn, String> {
        if !self.state.is_ready() {
            return Err(self.state.to_string());
        }
        match self.confirmed {
            Some(copy) if copy >= confirmed => Ok(copy),
            Some(copy) => Err(format!(
                "has a copy at {copy}, {} bytes behind the {confirmed} the relay confirmed on the primary: the slot \
                 sync worker copies it every few seconds (sync_replication_slots); events confirmed past the copy \
                 would be sent again after a promotion now",
                confirmed.bytes_since(copy)
            )),
            None => Err("has a copy with no confirmed position".into()),
        }
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
            CopyState::NotStandby => {
                f.write_str("is not a standby (not in recovery): another name of the primary?")
            }
            CopyState::Unreachable(error) => write!(f, "cannot be asked: {error}"),
        }
    }
}

/// Sessions to the standbys of `postgres.host`, kept from one look to the next (the sampler
/// looks every few seconds); a session that fails is dropped and opened again next time.
#[derive(Default)]
pub(crate) struct Standbys {
    sessions: HashMap<String, Client>,
}

impl Standbys {
    /// Each standby (every server of `postgres.host` but `primary`) with its copy of `slot`.
    pub(crate) async fn copies(
        &mut self,
        pg: &PostgresConfig,
        primary: &Endpoint,
        slot: &str,
    ) -> Vec<(Endpoint, SlotCopy)> {
        let mut copies = Vec::new();
        for standby in pg.endpoints().into_iter().filter(|e| e != primary) {
            let copy = self.copy(pg, &standby, slot).await;
            copies.push((standby, copy));
        }
        copies
    }

    /// The copy of `slot` on `standby`.
    pub(crate) async fn copy(&mut self, pg: &PostgresConfig, standby: &Endpoint, slot: &str) -> SlotCopy {
        let key = standby.to_string();
        if self.sessions.get(&key).is_none_or(Client::is_closed) {
            match crate::postgres::connect_to(pg, standby).await {
                Ok(client) => self.sessions.insert(key.clone(), client),
                Err(e) => return SlotCopy::of(CopyState::Unreachable(e.to_string())),
            };
        }
        let row = self.sessions[&key]
            .query_one(
                "SELECT pg_is_in_recovery(), \
                        (SELECT to_jsonb(s) FROM pg_replication_slots s WHERE slot_name = $1)::text",
                &[&slot],
            )
            .await;
        let (in_recovery, copy): (bool, Option<String>) = match row {
            Ok(r) => (r.get(0), r.get(1)),
            Err(e) => {
                self.sessions.remove(&key);
                return SlotCopy::of(CopyState::Unreachable(e.to_string()));
            }
        };
        match copy.and_then(|text| serde_json::from_str::<serde_json::Value>(&text).ok()) {
            _ if !in_recovery => SlotCopy::of(CopyState::NotStandby),
            None => SlotCopy::of(CopyState::Missing),
            Some(copy) => SlotCopy {
                state: copy_state(&copy),
                confirmed: copy["confirmed_flush_lsn"].as_str().and_then(|lsn| lsn.parse().ok()),
            },
        }
    }
}

/// What a standby's `pg_replication_slots` row (as JSON) says of its copy.
fn copy_state(copy: &serde_json::Value) -> CopyState {
    let flag = |name: &str| copy[name].as_bool();
    let reason = copy["invalidation_reason"].as_str().map(str::to_string);
    match (flag("synced"), flag("temporary"), flag("conflicting"), reason) {
        (_, _, _, Some(reason)) => CopyState::Invalidated(reason),
        (_, _, Some(true), None) => CopyState::Invalidated("conflicting with recovery".into()),
        (Some(true), Some(true), _, None) => CopyState::Temporary,
        (Some(true), Some(false), _, None) => CopyState::Ready,
        // not synced, or a server before 17 (no `synced`): nothing keeps it in step
        _ => CopyState::Unsynced,
    }
}

/// Why this server cannot have failover slots (before PostgreSQL 17), or `None`.
pub(crate) async fn unsupported(client: &Client) -> Result<Option<String>, RelayError> {
    let version: i32 =
        client.query_one("SELECT current_setting('server_version_num')::int", &[]).await?.get(0);
    Ok((version < 170_000).then(|| {
        format!(
            "replication.failover = true needs failover slots, which PostgreSQL has from version 17 (the server \
             is {}.{})",
            version / 10_000,
            version % 10_000
        )
    }))
}

/// The slot's idle time and PostgreSQL 18's `idle_replication_slot_timeout`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Idle {
    /// Seconds since the slot was last streamed from (0 while active; 0 before 17).
    pub inactive_secs: f64,
    /// The timeout in seconds; `None` when off (0) or before 18.
    pub timeout_secs: Option<f64>,
}

impl Idle {
    /// Seconds left before PostgreSQL invalidates the idle slot (at its next checkpoint).
    pub(crate) fn remaining_secs(&self) -> Option<f64> {
        self.timeout_secs.map(|timeout| (timeout - self.inactive_secs).max(0.0))
    }
}

/// `idle_replication_slot_timeout` in seconds (0: off); no row before PostgreSQL 18. Also a
/// scalar subquery of the sampler's slot query (NULL before 18).
pub(crate) const IDLE_TIMEOUT_SQL: &str = "SELECT setting::float8 * CASE unit WHEN 'min' THEN 60 WHEN 'h' THEN 3600 ELSE 1 END \
                                           FROM pg_settings WHERE name = 'idle_replication_slot_timeout'";

/// Seconds since the slot was last streamed from, as a column of a `pg_replication_slots s`
/// query (0 while active, and before 17, which has no `inactive_since`).
pub(crate) const INACTIVE_SECS_SQL: &str =
    "coalesce(extract(epoch FROM now() - (to_jsonb(s) ->> 'inactive_since')::timestamptz), 0)::float8";

/// `idle_replication_slot_timeout` in seconds (0: off); `None` before PostgreSQL 18.
pub(crate) async fn idle_timeout_secs(client: &Client) -> Result<Option<f64>, RelayError> {
    Ok(client.query_opt(IDLE_TIMEOUT_SQL, &[]).await?.map(|r| r.get(0)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn copy(json: &str) -> CopyState {
        copy_state(&serde_json::from_str(json).unwrap())
    }

    #[test]
    fn a_copy_is_ready_only_when_synced_persisted_and_valid() {
        let row = |synced: bool, temporary: bool, conflicting: bool, reason: &str| {
            format!(
                r#"{{"synced": {synced}, "temporary": {temporary}, "conflicting": {conflicting}, "invalidation_reason": {reason}}}"#
            )
        };
        assert_eq!(copy(&row(true, false, false, "null")), CopyState::Ready);
        assert_eq!(copy(&row(true, true, false, "null")), CopyState::Temporary);
        assert_eq!(copy(&row(false, false, false, "null")), CopyState::Unsynced);
        assert_eq!(
            copy(&row(true, false, false, "\"rows_removed\"")),
            CopyState::Invalidated("rows_removed".into())
        );
        assert!(matches!(copy(&row(true, false, true, "null")), CopyState::Invalidated(_)));
        assert_eq!(copy(r#"{"slot_name": "s"}"#), CopyState::Unsynced);
    }

    #[test]
    fn the_time_left_never_goes_below_zero_and_is_none_without_a_timeout() {
        let idle = Idle { inactive_secs: 100.0, timeout_secs: Some(3600.0) };
        assert_eq!(idle.remaining_secs(), Some(3500.0));
        assert_eq!(Idle { inactive_secs: 4000.0, ..idle }.remaining_secs(), Some(0.0));
        assert_eq!(Idle { timeout_secs: None, ..idle }.remaining_secs(), None);
    }
}
