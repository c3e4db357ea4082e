//! Samples PostgreSQL's view of the relay into gauges every `metrics.sample_interval_secs`:
//! the slot (replication mode) or the backlog (polling mode), and in polling mode the slot too
//! while replication mode's is left (a mode switch not finished: `source::handover`); in both
//! modes the letters of this outbox waiting in the dead-letter table, and the outbox table's
//! partitions (rows in the default partition, how far ahead the last one reaches).
//!
//! It runs on its own connection, apart from the relay loop, so the numbers SREs are paged on
//! stay truthful while Kafka is down and the loop is stuck retrying.

use std::sync::Arc;
use std::time::Duration;

use tokio_postgres::Client;

use crate::config::{DeadLetterConfig, Endpoint, RelayConfig, SourceMode};
use crate::error::RelayError;
use crate::lsn::Lsn;
use crate::observe::metrics::{WalStatus, metrics};
use crate::outboxes::Outboxes;
use crate::source::handover;
use crate::source::replication::failover;
use crate::table::OutboxTable;

/// Rows counted at most, so sampling a huge backlog stays cheap.
pub(crate) const BACKLOG_COUNT_CAP: i64 = 1_000_000;

pub fn spawn(config: RelayConfig, outboxes: Arc<Outboxes>) {
    let interval = Duration::from_secs(config.metrics.sample_interval_secs);
    tokio::spawn(async move {
        let mut client: Option<(Client, Endpoint)> = None;
        let mut standbys = failover::Standbys::default();
        loop {
            if client.as_ref().is_none_or(|(c, _)| c.is_closed()) {
                client = match crate::postgres::connect_primary(&config.postgres).await {
                    Ok(c) => Some(c),
                    Err(e) => {
                        tracing::debug!(error = %e, "metrics sampler cannot connect");
                        None
                    }
                };
            }
            if let Some((c, primary)) = &client {
                let sampled = match config.source.mode {
                    SourceMode::Replication => {
                        sample_slot(&config, c, primary, &mut standbys, &config.replication.slot).await
                    }
                    SourceMode::Polling => {
                        sample_polling(&config, &outboxes, c, primary, &mut standbys).await
                    }
                };
                if let Err(e) = sampled {
                    tracing::debug!(error = %e, "metrics sampling failed");
                }
                // apart from the above: one failing (no dead-letter table) leaves the others
                if let Err(e) = sample_dead_letters(&outboxes, c).await {
                    tracing::debug!(error = %e, "sampling the dead-letter table failed");
                }
                if let Err(e) = sample_partitions(&outboxes, c).await {
                    tracing::debug!(error = %e, "sampling the outbox table's partitions failed");
                }
            }
            tokio::time::sleep(interval).await;
        }
    });
}

/// Polling mode: the backlog, and a slot replication mode left behind, which keeps WAL: its lag
/// is exported (and alerted on) until it is dropped. With several, the one that retains the most
/// ([`handover::leftover_slots`]); with none, the slot gauges read 0.
async fn sample_polling(
    config: &RelayConfig,
    outboxes: &Outboxes,
    client: &Client,
    primary: &Endpoint,
    standbys: &mut failover::Standbys,
) -> Result<(), RelayError> {
    sample_backlog(outboxes, client).await?;
    let leftover = handover::leftover_slots(config, client).await?;
    let slot = leftover.first().map_or(config.replication.slot.as_str(), |s| s.name.as_str());
    sample_slot(config, client, primary, standbys, slot).await
}

async fn sample_slot(
    config: &RelayConfig,
    client: &Client,
    primary: &Endpoint,
    standbys: &mut failover::Standbys,
    slot: &str,
) -> Result<(), RelayError> {
    let m = metrics();
    let sql = format!(
        "SELECT (pg_current_wal_lsn() - confirmed_flush_lsn)::bigint AS confirmed_lag, \
                (pg_current_wal_lsn() - restart_lsn)::bigint AS retained, wal_status, safe_wal_size, active, \
                (pg_current_wal_lsn() - '0/0')::float8 AS wal_lsn, \
                coalesce((to_jsonb(s) ->> 'failover')::boolean, false) AS failover, \
                confirmed_flush_lsn::text AS confirmed, \
                {} AS inactive_secs, ({}) AS idle_timeout \
         FROM pg_replication_slots s WHERE slot_name = $1 AND database = current_database()",
        failover::INACTIVE_SECS_SQL,
        failover::IDLE_TIMEOUT_SQL
    );
    let row = client.query_opt(&sql, &[&slot]).await?;
    let Some(row) = row else {
        // a slot that is gone retains nothing (dropped after a switch to polling mode)
        m.slot_active.set(0);
        m.slot_confirmed_lag.set(0);
        m.slot_retained_wal.set(0);
        for status in WalStatus::ALL {
            m.slot_wal_status.with_label_values(&[status.label()]).set(0);
        }
        m.slot_failover.set(0);
        m.switchover_ready_standbys.set(0);
        m.slot_inactive.set(0.0);
        m.slot_idle_timeout_remaining.set(-1.0);
        return Ok(());
    };
    m.slot_confirmed_lag.set(row.get::<_, Option<i64>>("confirmed_lag").unwrap_or(0));
    m.slot_retained_wal.set(row.get::<_, Option<i64>>("retained").unwrap_or(0));
    let current = row.get::<_, Option<String>>("wal_status").as_deref().and_then(WalStatus::parse);
    for status in WalStatus::ALL {
        m.slot_wal_status.with_label_values(&[status.label()]).set(i64::from(current == Some(*status)));
    }
    // NULL safe_wal_size means max_slot_wal_keep_size = -1: no limit; export -1 to say so
    m.slot_safe_wal_size.set(row.get::<_, Option<i64>>("safe_wal_size").unwrap_or(-1));
    m.slot_active.set(i64::from(row.get::<_, bool>("active")));
    m.server_wal_lsn.set(row.get::<_, f64>("wal_lsn"));
    let failover = row.get::<_, bool>("failover");
    m.slot_failover.set(i64::from(failover));
    let idle = failover::Idle {
        inactive_secs: row.get::<_, f64>("inactive_secs").max(0.0),
        timeout_secs: row.get::<_, Option<f64>>("idle_timeout").filter(|t| *t > 0.0),
    };
    m.slot_inactive.set(idle.inactive_secs);
    m.slot_idle_timeout_remaining.set(idle.remaining_secs().unwrap_or(-1.0));
    // (a slot made a failover slot stays one when the setting is turned off: its alert needs this)
    let confirmed: Option<Lsn> = row.get::<_, Option<String>>("confirmed").and_then(|lsn| lsn.parse().ok());
    if failover {
        let (mut ready, mut switchover) = (0, 0);
        for (standby, copy) in standbys.copies(&config.postgres, primary, slot).await {
            tracing::debug!(%standby, copy = %copy.state, confirmed = ?copy.confirmed, "the standby's copy of the slot");
            ready += i64::from(copy.state.is_ready());
            switchover += i64::from(confirmed.is_some_and(|at| copy.switchover_ready(at).is_ok()));
        }
        m.failover_standbys_ready.set(ready);
        m.switchover_ready_standbys.set(switchover);
    } else {
        m.switchover_ready_standbys.set(0);
    }
    Ok(())
}

/// The unpublished rows, counted up to [`BACKLOG_COUNT_CAP`], and the age in seconds of the one
/// with the lowest id: `None` without a created_at column, `Some(None)` without a row (or with a
/// NULL created_at). `status` shows the same.
pub(crate) async fn backlog(
    table: &OutboxTable,
    client: &Client,
) -> Result<(i64, Option<Option<f64>>), tokio_postgres::Error> {
    let count: i64 = client.query_one(&table.backlog_count_sql(BACKLOG_COUNT_CAP), &[]).await?.get(0);
    let age = match table.backlog_age_sql() {
        Some(sql) => Some(client.query_opt(&sql, &[]).await?.and_then(|r| r.get::<_, Option<f64>>(0))),
        None => None,
    };
    Ok((count, age))
}

/// The backlog of every outbox of the relay: the rows summed, and the oldest one's age.
async fn sample_backlog(outboxes: &Outboxes, client: &Client) -> Result<(), tokio_postgres::Error> {
    let m = metrics();
    let (mut count, mut oldest) = (0, None::<f64>);
    for outbox in outboxes.iter() {
        let (rows, age) = backlog(&outbox.table, client).await?;
        m.outbox_backlog_events.with_label_values(&[&outbox.name]).set(rows);
        count += rows;
        if let Some(age) = age {
            oldest = Some(oldest.unwrap_or(0.0).max(age.unwrap_or(0.0)));
        }
    }
    // both set together: a scrape never shows the new count beside the old age
    m.backlog_events.set(count);
    if let Some(age) = oldest {
        m.backlog_oldest_age.set(age.max(0.0));
    }
    Ok(())
}

/// The letters of this outbox (`source_table` = `schema.table`) waiting in the dead-letter
/// table: a replay (`outbox-relay replay-dead-letters`) or a DELETE removes them.
#[derive(Debug, Default)]
pub(crate) struct Outstanding {
    pub count: i64,
    /// Seconds since the oldest was written; None without one.
    pub oldest_secs: Option<f64>,
    /// The most frequent reasons (cut at 120 characters), with how many letters give each.
    pub reasons: Vec<(String, i64)>,
}

/// [`Outstanding`] of the outbox table `source` in its dead-letter table `letters`, with up to
/// `reasons` reasons; None when the dead-letter table does not exist (`on_poison = "block"`
/// needs none).
pub(crate) async fn dead_letters(
    (letters, source): (&DeadLetterConfig, &OutboxTable),
    client: &Client,
    reasons: i64,
) -> Result<Option<Outstanding>, tokio_postgres::Error> {
    let table = crate::dead_letter::qualified_table(letters);
    let source = source.display_name();
    let counted = client
        .query_one(
            &format!(
                "SELECT count(*), extract(epoch FROM now() - min(dead_lettered_at))::float8 \
                 FROM {table} WHERE source_table = $1"
            ),
            &[&source],
        )
        .await;
    let row = match counted {
        Ok(row) => row,
        Err(e) if e.code() == Some(&tokio_postgres::error::SqlState::UNDEFINED_TABLE) => return Ok(None),
        Err(e) => return Err(e),
    };
    let mut outstanding = Outstanding { count: row.get(0), oldest_secs: row.get(1), reasons: Vec::new() };
    if reasons > 0 && outstanding.count > 0 {
        let sql = format!(
            "SELECT left(reason, 120), count(*) FROM {table} WHERE source_table = $1 \
             GROUP BY 1 ORDER BY 2 DESC, 1 LIMIT $2"
        );
        let rows = client.query(&sql, &[&source, &reasons]).await?;
        outstanding.reasons = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
    }
    Ok(Some(outstanding))
}

/// The letters of every outbox of the relay: their sum, and the oldest one's age.
async fn sample_dead_letters(outboxes: &Outboxes, client: &Client) -> Result<(), tokio_postgres::Error> {
    let m = metrics();
    let (mut count, mut oldest, mut failed) = (0, 0.0_f64, None);
    for outbox in outboxes.iter() {
        let outstanding = dead_letters((&outbox.dead_letter, &outbox.table), client, 0).await;
        let of_outbox = m.outbox_dead_letters_outstanding.with_label_values(&[&outbox.name]);
        match outstanding {
            Ok(Some(o)) => {
                of_outbox.set(o.count);
                count += o.count;
                oldest = oldest.max(o.oldest_secs.unwrap_or(0.0));
            }
            Ok(None) => of_outbox.set(0),
            Err(e) => {
                of_outbox.set(-1);
                failed.get_or_insert(e);
            }
        }
    }
    // a table that cannot be read says -1, not 0: "none waiting" must not be a guess
    m.dead_letters_outstanding.set(if failed.is_some() { -1 } else { count });
    m.dead_letters_oldest_age.set(if failed.is_some() { 0.0 } else { oldest });
    failed.map_or(Ok(()), Err)
}

/// The outbox table's default partition's live rows (PostgreSQL's estimate, from its statistics:
/// no scan, and no privilege on the partition needed), and how many seconds from now the last
/// partition whose upper bound is a date or timestamp ends (NULL: none such).
const PARTITIONS_SQL: &str = "SELECT \
     (SELECT coalesce(s.n_live_tup, 0) FROM pg_partitioned_table p \
      JOIN pg_stat_all_tables s ON s.relid = p.partdefid WHERE p.partrelid = to_regclass($1)), \
     (SELECT extract(epoch FROM max(substring(pg_get_expr(c.relpartbound, c.oid) \
             FROM 'TO \\(''([0-9]{4}-[0-9]{2}-[0-9]{2}[^'']*)''\\)')::timestamptz) - now())::float8 \
      FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = to_regclass($1))";

/// Of every outbox table: the default partitions' rows summed, and the shortest reach of the
/// partitioned ones (-1: none is partitioned by date).
async fn sample_partitions(outboxes: &Outboxes, client: &Client) -> Result<(), tokio_postgres::Error> {
    let m = metrics();
    let (mut default_rows, mut ahead) = (0, None::<f64>);
    for outbox in outboxes.iter() {
        let table = outbox.table.qualified();
        let row = client.query_one(PARTITIONS_SQL, &[&table]).await?;
        default_rows += row.get::<_, Option<i64>>(0).unwrap_or(0);
        if let Some(reach) = row.get::<_, Option<f64>>(1) {
            ahead = Some(ahead.map_or(reach, |a| a.min(reach)));
        }
    }
    m.default_partition_rows.set(default_rows);
    m.partitions_ahead.set(ahead.unwrap_or(-1.0));
    Ok(())
}
