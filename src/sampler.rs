//! Samples PostgreSQL's view of the relay into gauges every `metrics.sample_interval_secs`:
//! the slot (replication mode) or the backlog (polling mode).
//!
//! It runs on its own connection, apart from the relay loop, so the numbers SREs are paged on
//! stay truthful while Kafka is down and the loop is stuck retrying.

use std::time::Duration;

use tokio_postgres::{Client, NoTls};

use crate::config::{AfterPublish, RelayConfig, SourceMode};
use crate::metrics::{WAL_STATUSES, metrics};
use crate::table::{OutboxTable, quote_ident};

/// Rows counted at most, so sampling a huge backlog stays cheap.
const BACKLOG_COUNT_CAP: i64 = 1_000_000;

pub fn spawn(config: RelayConfig) {
    let interval = Duration::from_secs(config.metrics.sample_interval_secs);
    tokio::spawn(async move {
        let mut client: Option<Client> = None;
        loop {
            if client.as_ref().is_none_or(Client::is_closed) {
                client = match config.postgres.client_config().connect(NoTls).await {
                    Ok((c, connection)) => {
                        tokio::spawn(connection);
                        Some(c)
                    }
                    Err(e) => {
                        tracing::debug!(error = %e, "metrics sampler cannot connect");
                        None
                    }
                };
            }
            if let Some(c) = &client {
                let sampled = match config.source.mode {
                    SourceMode::Replication => sample_slot(&config, c).await,
                    SourceMode::Polling => sample_backlog(&config, c).await,
                };
                if let Err(e) = sampled {
                    tracing::debug!(error = %e, "metrics sampling failed");
                }
            }
            tokio::time::sleep(interval).await;
        }
    });
}

async fn sample_slot(config: &RelayConfig, client: &Client) -> Result<(), tokio_postgres::Error> {
    let m = metrics();
    let row = client
        .query_opt(
            "SELECT (pg_current_wal_lsn() - confirmed_flush_lsn)::bigint, (pg_current_wal_lsn() - restart_lsn)::bigint, \
                    wal_status, safe_wal_size, active, (pg_current_wal_lsn() - '0/0')::float8 \
             FROM pg_replication_slots WHERE slot_name = $1",
            &[&config.replication.slot],
        )
        .await?;
    let Some(row) = row else {
        m.slot_active.set(0);
        return Ok(());
    };
    m.slot_confirmed_lag.set(row.get::<_, Option<i64>>(0).unwrap_or(0));
    m.slot_retained_wal.set(row.get::<_, Option<i64>>(1).unwrap_or(0));
    let status: Option<String> = row.get(2);
    for s in WAL_STATUSES {
        m.slot_wal_status.with_label_values(&[s]).set(i64::from(status.as_deref() == Some(*s)));
    }
    // NULL safe_wal_size means max_slot_wal_keep_size = -1: no limit; export -1 to say so
    m.slot_safe_wal_size.set(row.get::<_, Option<i64>>(3).unwrap_or(-1));
    m.slot_active.set(i64::from(row.get::<_, bool>(4)));
    m.server_wal_lsn.set(row.get::<_, f64>(5));
    Ok(())
}

async fn sample_backlog(config: &RelayConfig, client: &Client) -> Result<(), tokio_postgres::Error> {
    let m = metrics();
    let table = OutboxTable::new(&config.outbox).qualified();
    let filter = match config.polling.after_publish {
        AfterPublish::Delete => String::new(),
        AfterPublish::Mark => format!("WHERE {} IS NULL", quote_ident(&config.polling.published_at_column)),
    };
    let count: i64 = client
        .query_one(
            &format!("SELECT count(*) FROM (SELECT 1 FROM {table} {filter} LIMIT {BACKLOG_COUNT_CAP}) s"),
            &[],
        )
        .await?
        .get(0);
    m.backlog_events.set(count);
    let created_at = &config.outbox.columns.created_at;
    if !created_at.is_empty() {
        let id = quote_ident(&config.outbox.columns.id);
        let age: Option<f64> = client
            .query_opt(
                &format!(
                    "SELECT extract(epoch FROM now() - {})::float8 FROM {table} {filter} ORDER BY {id} LIMIT 1",
                    quote_ident(created_at)
                ),
                &[],
            )
            .await?
            .and_then(|r| r.get(0));
        m.backlog_oldest_age.set(age.unwrap_or(0.0).max(0.0));
    }
    Ok(())
}
