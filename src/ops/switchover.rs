//! `outbox-relay switchover-ready --standby HOST[:PORT]`: is a planned switchover to that
//! standby safe now, for the relay? Yes when the standby's copy of the failover slot is one a
//! promotion keeps (synced, persisted, valid: [`CopyState::Ready`]) and has reached the position
//! the relay confirmed on the primary. The relay then goes on from the copy after the promotion
//! and sends nothing twice; before that, the events between the copy's position and the relay's
//! would be replayed (read back and not sent again, or sent again with `dedup.enabled = false`).
//!
//! It reads only: the slot on the primary, the copy on the standby. Exit 0 ready, 1 not (and
//! why), for a pre-promotion hook that waits until it says 0.

use crate::config::{Endpoint, RelayConfig, SourceMode};
use crate::error::{FatalReason, RelayError};
use crate::lsn::Lsn;
use crate::source::replication::failover::{CopyState, Standbys};

/// The answer: `Ok(what is ready)` or `Err(why not)`.
pub type Verdict = Result<String, String>;

/// The answer as the command prints it: exit 0 ready, 1 not.
#[derive(Debug)]
pub struct Readiness(pub Verdict);

impl super::Output for Readiness {
    fn text(&self) -> String {
        match &self.0 {
            Ok(ready) => format!("ready: {ready}\n"),
            Err(why) => format!("not ready: {why}\n"),
        }
    }

    fn exit_code(&self) -> u8 {
        if self.0.is_ok() { 0 } else { super::EXIT_FAILURE }
    }
}

/// Whether a switchover to `standby` (`host`, `host:port`, `[v6]:port`; the port defaults to
/// `postgres.port`) is safe now.
pub async fn run(config: &RelayConfig, standby: &str) -> Result<Verdict, RelayError> {
    let standby = config
        .postgres
        .endpoint(standby)
        .map_err(|e| RelayError::fatal(FatalReason::Config, format!("--standby: {e}")))?;
    if config.source.mode == SourceMode::Polling {
        return Ok(Ok(format!(
            "polling mode keeps no slot: after a promotion of {standby} it claims the rows the new primary has \
             (list {standby} in postgres.host)"
        )));
    }
    let (client, primary) = crate::postgres::connect_primary(&config.postgres).await?;
    if primary == standby {
        return Ok(Err(format!("{standby} is the primary the relay uses now, not a standby")));
    }
    let slot = &config.replication.slot;
    let row = client
        .query_opt(
            "SELECT confirmed_flush_lsn::text, coalesce((to_jsonb(s) ->> 'failover')::boolean, false) \
             FROM pg_replication_slots s WHERE slot_name = $1 AND database = current_database()",
            &[slot],
        )
        .await?;
    let Some(row) = row else {
        return Ok(Err(format!(
            "slot \"{slot}\" does not exist on the primary {primary}: run outbox-relay setup"
        )));
    };
    if !row.get::<_, bool>(1) {
        return Ok(Err(format!(
            "slot \"{slot}\" is not a failover slot: a promotion loses it (set replication.failover = true, \
             PostgreSQL 17+; docs/operations.md, Failover)"
        )));
    }
    let confirmed: Option<Lsn> = row.get::<_, Option<String>>(0).and_then(|lsn| lsn.parse().ok());
    let Some(confirmed) = confirmed else {
        return Ok(Err(format!("slot \"{slot}\" has confirmed nothing yet on the primary {primary}")));
    };
    let copy = Standbys::default().copy(&config.postgres, &standby, slot).await;
    Ok(match copy.switchover_ready(confirmed) {
        Ok(at) => Ok(format!(
            "{standby} {}, at {at}; the relay confirmed {confirmed} on the primary {primary}: a promotion now \
             sends nothing twice",
            CopyState::Ready
        )),
        Err(why) => Err(format!("{standby} {why}")),
    })
}

/// `status`'s lines: each standby of `postgres.host` and whether a switchover to it is safe now
/// (replication mode with a failover slot only).
pub async fn status_lines(config: &RelayConfig, primary: &Endpoint) -> Vec<(&'static str, String)> {
    let mut lines = Vec::new();
    for standby in config.postgres.endpoints().into_iter().filter(|e| e != primary) {
        let said = match run(config, &standby.to_string()).await {
            Ok(Ok(ready)) => format!("ready: {ready}"),
            Ok(Err(why)) => format!("not ready: {why}"),
            Err(e) => format!("cannot tell: {e}"),
        };
        lines.push(("switchover", said));
    }
    lines
}
