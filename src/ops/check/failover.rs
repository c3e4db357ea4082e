//! What a promotion or a long outage would do to the slot (replication mode): failover slots
//! and the standbys' copies (PostgreSQL 17+), and `idle_replication_slot_timeout` (18+).

use tokio_postgres::Client;

use super::{Finding, query_setting};
use crate::config::{Endpoint, RelayConfig};
use crate::source::replication::failover::{self, CopyState};

/// Below this, `idle_replication_slot_timeout` can invalidate the slot during an outage an
/// on-call engineer plausibly takes to fix (a weekend night, a node drain gone wrong).
const IDLE_TIMEOUT_WARN_SECS: f64 = 24.0 * 3600.0;

pub(super) async fn findings(config: &RelayConfig, client: &Client, primary: &Endpoint) -> Vec<Finding> {
    let mut findings = vec![slot_memory(client).await];
    if !config.replication.failover {
        findings.push(Finding::ok(
            "replication.failover",
            "off: a promotion of a standby loses the slot, and the relay then stops with failover_without_slot \
             (docs/operations.md, Failover)",
        ));
    } else {
        match failover::unsupported(client).await {
            Ok(Some(why)) => findings.push(Finding::fail(
                "replication.failover",
                why,
                "set replication.failover = false (docs/operations.md, Failover: what a promotion then means)",
            )),
            Ok(None) => {
                findings.push(synchronized_standby_slots(client).await);
                findings.extend(standby_copies(config, primary).await);
            }
            Err(e) => findings.push(Finding::warn(
                "replication.failover",
                format!("cannot read the server's version: {e}"),
                "check the role can run SHOW",
            )),
        }
    }
    if let Some(finding) = idle_timeout(client).await {
        findings.push(finding);
    }
    findings
}

/// The relay tells a slot lost to a failover from one dropped by the timeline it remembers, and
/// its own outbox's slots from another's by the table.
async fn slot_memory(client: &Client) -> Finding {
    match client.query_opt("SELECT created_timeline, outbox_table FROM outbox_relay_slots LIMIT 0", &[]).await
    {
        Ok(_) => Finding::ok(
            "replication.slot_memory",
            "outbox_relay_slots remembers each slot's timeline and outbox table",
        ),
        Err(e) => Finding::fail(
            "replication.slot_memory",
            format!(
                "cannot read outbox_relay_slots.created_timeline and outbox_table: {}",
                crate::error::describe_pg(&e)
            ),
            "apply sql/006_relay_slots.sql, sql/007_relay_slots_timeline.sql and sql/008_relay_slots_owner.sql, and \
             grant the table (sql/100_relay_role.sql)",
        ),
    }
}

/// Without `synchronized_standby_slots` the primary sends the relay transactions a standby may
/// not have yet: after a promotion they are gone from the database but were published.
async fn synchronized_standby_slots(client: &Client) -> Finding {
    match query_setting(client, "synchronized_standby_slots").await {
        Ok(slots) if !slots.trim().is_empty() => Finding::ok(
            "postgres.synchronized_standby_slots",
            format!(
                "synchronized_standby_slots = '{slots}': the relay receives only what those standbys have"
            ),
        ),
        Ok(_) => Finding::warn(
            "postgres.synchronized_standby_slots",
            "synchronized_standby_slots is empty: the relay may publish a transaction the standby never received, \
             which a promotion then loses (a phantom event)",
            "on the primary, set synchronized_standby_slots to the physical slot of each failover-candidate standby \
             and reload",
        ),
        Err(e) => Finding::warn(
            "postgres.synchronized_standby_slots",
            format!("cannot read synchronized_standby_slots: {}", crate::error::describe_pg(&e)),
            "check the role can run SHOW",
        ),
    }
}

/// Each standby of `postgres.host`: does it hold a copy a promotion keeps?
async fn standby_copies(config: &RelayConfig, primary: &Endpoint) -> Vec<Finding> {
    let copies =
        failover::Standbys::default().copies(&config.postgres, primary, &config.replication.slot).await;
    if copies.is_empty() {
        return vec![Finding::warn(
            "replication.failover.standby",
            "postgres.host names no standby: the relay cannot find the new primary after a promotion, nor see whether \
             a standby holds a copy of the slot",
            "list the failover-candidate standbys in postgres.host (\"primary:5432,standby:5432\")",
        )];
    }
    copies.into_iter().map(|(standby, copy)| copy_finding(&standby, copy.state)).collect()
}

fn copy_finding(standby: &Endpoint, copy: CopyState) -> Finding {
    let detail = format!("{standby} {copy}");
    let fix = match copy {
        CopyState::Ready => return Finding::ok("replication.failover.standby", detail),
        CopyState::Missing => {
            "on the standby: sync_replication_slots = on, hot_standby_feedback = on, primary_slot_name set and dbname \
             in primary_conninfo; the slot must exist with failover (the relay creates it so)"
        }
        CopyState::Unsynced => {
            "a slot of that name the standby does not synchronize (left there before a switchover made this server a \
             standby?) blocks synchronization: drop it on the standby with pg_drop_replication_slot"
        }
        CopyState::Temporary => {
            "wait: the copy persists once the primary's slot moves past the standby's catalog horizon (the relay \
             streaming and a checkpoint, or pg_log_standby_snapshot(), move it)"
        }
        CopyState::NotStandby => "list each server once in postgres.host, the primary and its standbys",
        CopyState::Invalidated(_) | CopyState::Unreachable(_) => {
            "a promotion of this standby now would lose the slot: repair the standby (its log says why)"
        }
    };
    Finding::warn("replication.failover.standby", detail, fix)
}

/// PostgreSQL 18 invalidates a slot left idle longer than `idle_replication_slot_timeout`.
async fn idle_timeout(client: &Client) -> Option<Finding> {
    let secs = failover::idle_timeout_secs(client).await.ok()??;
    Some(if secs <= 0.0 {
        Finding::ok("postgres.idle_replication_slot_timeout", "idle_replication_slot_timeout = 0: off")
    } else if secs < IDLE_TIMEOUT_WARN_SECS {
        Finding::warn(
            "postgres.idle_replication_slot_timeout",
            format!(
                "idle_replication_slot_timeout = {secs} s: a relay down longer than that has its slot invalidated, \
                 and events written meanwhile never reach Kafka"
            ),
            "raise it above the longest relay outage you accept (at least a day), or set it to 0; watch \
             outbox_relay_slot_idle_timeout_remaining_seconds",
        )
    } else {
        Finding::ok(
            "postgres.idle_replication_slot_timeout",
            format!("idle_replication_slot_timeout = {secs} s"),
        )
    })
}
