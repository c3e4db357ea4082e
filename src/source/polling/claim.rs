//! What one claim takes from the outbox: the rows, in id order, up to the batch size and the
//! byte budget, inside the claim's transaction.
//!
//! Invariants:
//! - rows are fetched through a portal in chunks and fetching stops at the budget: rows not
//!   fetched are not locked;
//! - a batch overshoots the byte budget by at most one chunk of rows like those seen.

use std::collections::HashSet;
use std::time::SystemTime;

use tokio_postgres::Transaction;

use crate::dead_letter::{Hold, LetterKey};
use crate::delivery::record::OutboxRow;
use crate::error::RelayError;
use crate::table::outbox_row;

/// Claimed rows with their `created_at`.
pub(super) type Claimed = Vec<(OutboxRow, Option<SystemTime>)>;

/// The statements of one configured outbox table (they need the id column's type).
pub(super) struct Statements {
    pub(super) claim: String,
    pub(super) unpublished_count: String,
    pub(super) release: String,
    pub(super) delete: String,
}

/// Where the row the relay holds at stands in a claim.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum HeldRow {
    /// Not holding, or the held row came first.
    Claimed,
    /// Still unpublished but passed over: another session locks it (while fixing it, say).
    Skipped,
    /// No longer in the outbox.
    Gone,
}

/// Claims up to `limit` rows in id order through a portal, in chunks, and stops fetching
/// once they hold `polling.max_batch_bytes`: rows not fetched are not locked. The first
/// chunk is one row; each next one is sized from the largest row seen so far (and at most
/// doubles), so a batch overshoots the budget by at most one chunk of rows like those seen.
/// Returns the rows, and whether the claim ended at the limit or the budget.
pub(super) async fn claim(
    tx: &Transaction<'_>,
    statements: &Statements,
    limit: usize,
    budget: usize,
) -> Result<(Claimed, bool), RelayError> {
    let portal = tx.bind(statements.claim.as_str(), &[&(limit as i64)]).await?;
    let mut claimed = Vec::new();
    let (mut bytes, mut largest, mut chunk) = (0usize, 0usize, 1usize);
    loop {
        let rows = tx.query_portal(&portal, chunk as i32).await?;
        let fetched = rows.len();
        for row in rows {
            let (raw, created_at) = outbox_row(&row)?;
            let size = raw.size();
            (bytes, largest) = (bytes + size, largest.max(size));
            claimed.push((raw, created_at));
        }
        let left = limit - claimed.len();
        if fetched < chunk {
            return Ok((claimed, false));
        }
        if left == 0 || bytes >= budget {
            return Ok((claimed, true));
        }
        chunk = ((budget - bytes) / largest.max(1)).clamp(1, left.min(chunk * 2));
    }
}

/// While holding: whether the claim (one row, SKIP LOCKED) got the held row, passed over it,
/// or found it gone.
pub(super) async fn held_row(
    tx: &Transaction<'_>,
    statements: &Statements,
    hold: Option<&Hold>,
    rows: &[(OutboxRow, Option<SystemTime>)],
) -> Result<HeldRow, RelayError> {
    let Some(hold) = hold else { return Ok(HeldRow::Claimed) };
    let id = hold.letter.id.as_str();
    // (a row without an id cannot be looked up: it is only ever the first row claimed)
    if id.is_empty() || rows.first().is_some_and(|(raw, _)| raw.id.as_deref() == Some(id)) {
        return Ok(HeldRow::Claimed);
    }
    let waiting: i64 = tx.query_one(&statements.unpublished_count, &[&vec![id]]).await?.get(0);
    Ok(if waiting > 0 { HeldRow::Skipped } else { HeldRow::Gone })
}

/// Splits claimed rows into those to map and the ids of rows replication mode dead-lettered
/// (`dead_lettered`, while switching modes): those are released unsent.
pub(super) fn already_dead_lettered(
    dead_lettered: &HashSet<LetterKey>,
    rows: Claimed,
) -> (Claimed, Vec<String>) {
    if dead_lettered.is_empty() {
        return (rows, Vec::new());
    }
    let (settled, rows): (Vec<_>, Vec<_>) = rows
        .into_iter()
        .partition(|(raw, _)| LetterKey::of(raw).is_some_and(|key| dead_lettered.contains(&key)));
    if !settled.is_empty() {
        tracing::info!(rows = settled.len(), "released unsent: replication mode dead-lettered them");
    }
    (rows, settled.into_iter().filter_map(|(raw, _)| raw.id).collect())
}
