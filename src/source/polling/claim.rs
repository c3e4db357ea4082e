//! What one claim takes from the outbox: the rows, in id order, up to the batch size and the
//! byte budget, inside the claim's transaction.
//!
//! Invariants:
//! - rows are fetched through a portal in chunks and fetching stops at the budget: rows not
//!   fetched are not locked;
//! - a batch overshoots the byte budget by at most one chunk of rows like those seen;
//! - a row whose event columns hold more than `polling.max_row_bytes` (as text) is never
//!   fetched: the claim brings its id and size alone ([`ClaimedRow::unread`]), PostgreSQL
//!   computing the size, so one huge row cannot exhaust the relay's memory.
use std::collections::HashSet;
use std::time::SystemTime;

use tokio_postgres::{Client, Statement, Transaction};

use crate::dead_letter::LetterKey;
use crate::error::RelayError;
use crate::record::OutboxRow;
use crate::table::{RowAt, col, outbox_row};

/// Claimed rows, in id order.
pub(super) type Claimed = Vec<ClaimedRow>;

/// A claimed row: where it lies, the row, its `created_at`.
#[derive(Debug)]
pub(super) struct ClaimedRow {
    pub(super) at: RowAt,
    /// The row; of an unread one, its id alone.
    pub(super) raw: OutboxRow,
    pub(super) created_at: Option<SystemTime>,
    /// The row's size when it is over `polling.max_row_bytes`: only its id was fetched.
    pub(super) unread: Option<u64>,
}

/// The statements of one configured outbox table (they need the id column's type).
pub(super) struct Statements {
    pub(super) claim: String,
    pub(super) unpublished_count: String,
    pub(super) release: String,
    pub(super) delete: String,
}

/// The statements a session runs for each batch, prepared once on its connection: parsed and
/// planned once, and PostgreSQL may settle on a generic plan (a release's plan for its 5,000
/// row positions took longer to make than the delete itself).
pub(super) struct Prepared {
    claim: Statement,
    pub(super) release: Statement,
    pub(super) delete: Statement,
}

impl Prepared {
    pub(super) async fn on(client: &Client, statements: &Statements) -> Result<Prepared, RelayError> {
        Ok(Prepared {
            claim: client.prepare(&statements.claim).await?,
            release: client.prepare(&statements.release).await?,
            delete: client.prepare(&statements.delete).await?,
        })
    }
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

/// How much a claim fetches: rows, bytes of them (`polling.max_batch_bytes`), bytes of one row
/// (`polling.max_row_bytes`).
#[derive(Debug, Clone, Copy)]
pub(super) struct Bounds {
    pub(super) limit: usize,
    pub(super) budget: usize,
    pub(super) max_row_bytes: usize,
}

/// Claims up to `limit` rows in id order through a portal, in chunks sized by [`Chunks`], and
/// stops fetching once they hold `polling.max_batch_bytes`: rows not fetched are not locked.
/// A row over `polling.max_row_bytes` comes unread. Returns the rows, and whether the claim
/// ended at the limit or the budget.
pub(super) async fn claim(
    tx: &Transaction<'_>,
    statements: &Prepared,
    bounds: Bounds,
) -> Result<(Claimed, bool), RelayError> {
    let params: [&(dyn tokio_postgres::types::ToSql + Sync); 2] =
        [&(bounds.limit as i64), &(bounds.max_row_bytes as i64)];
    let portal = tx.bind(&statements.claim, &params).await?;
    let mut claimed = Vec::new();
    let mut chunks = Chunks::new(bounds.limit, bounds.budget);
    loop {
        let rows = tx.query_portal(&portal, chunks.next() as i32).await?;
        let fetched = rows.len();
        for row in rows {
            let (raw, created_at) = outbox_row(&row)?;
            let bytes: i64 = row.try_get(col::ROW_BYTES)?;
            let unread = (bytes as u64 > bounds.max_row_bytes as u64).then_some(bytes as u64);
            chunks.row(raw.size());
            let at = RowAt::of(&row, raw.id.as_deref())?;
            claimed.push(ClaimedRow { at, raw, created_at, unread });
        }
        if let Some(full) = chunks.fetched(fetched) {
            return Ok((claimed, full));
        }
    }
}

/// How much of the outbox a claim fetches next. The first chunk is one row; each next one is
/// sized from the largest row seen so far (and at most doubles), so a batch overshoots the
/// byte budget by at most one chunk of rows like those seen.
#[derive(Debug)]
pub(super) struct Chunks {
    limit: usize,
    budget: usize,
    rows: usize,
    bytes: usize,
    largest: usize,
    chunk: usize,
}

impl Chunks {
    pub(super) fn new(limit: usize, budget: usize) -> Chunks {
        Chunks { limit, budget, rows: 0, bytes: 0, largest: 0, chunk: 1 }
    }

    /// How many rows to fetch next.
    pub(super) fn next(&self) -> usize {
        self.chunk
    }

    /// A row of `size` bytes was fetched.
    pub(super) fn row(&mut self, size: usize) {
        (self.rows, self.bytes, self.largest) = (self.rows + 1, self.bytes + size, self.largest.max(size));
    }

    /// A fetch returned `fetched` rows: `Some(full)` when the claim ends here (`full`: at the
    /// limit or the budget, so more rows may wait), `None` when it fetches [`Chunks::next`].
    pub(super) fn fetched(&mut self, fetched: usize) -> Option<bool> {
        if fetched < self.chunk {
            return Some(false);
        }
        let left = self.limit.saturating_sub(self.rows);
        if left == 0 || self.bytes >= self.budget {
            return Some(true);
        }
        self.chunk = ((self.budget - self.bytes) / self.largest.max(1)).clamp(1, left.min(self.chunk * 2));
        None
    }
}

/// While holding at the row `held` (its id): whether the claim (one row, SKIP LOCKED) got it,
/// passed over it, or found it gone.
pub(super) async fn held_row(
    tx: &Transaction<'_>,
    statements: &Statements,
    held: Option<&str>,
    rows: &Claimed,
) -> Result<HeldRow, RelayError> {
    let Some(id) = held else { return Ok(HeldRow::Claimed) };
    // (a row without an id cannot be looked up: it is only ever the first row claimed)
    if id.is_empty() || rows.first().is_some_and(|row| row.at.id == id) {
        return Ok(HeldRow::Claimed);
    }
    let waiting: i64 = tx.query_one(&statements.unpublished_count, &[&vec![id]]).await?.get(0);
    Ok(if waiting > 0 { HeldRow::Skipped } else { HeldRow::Gone })
}

/// Splits claimed rows into those to map and the rows replication mode dead-lettered
/// (`dead_lettered`, while switching modes): those are released unsent.
pub(super) fn already_dead_lettered(
    dead_lettered: &HashSet<LetterKey>,
    rows: Claimed,
) -> (Claimed, Vec<RowAt>) {
    if dead_lettered.is_empty() {
        return (rows, Vec::new());
    }
    let (settled, rows): (Vec<_>, Vec<_>) = rows
        .into_iter()
        .partition(|row| LetterKey::of(&row.raw).is_some_and(|key| dead_lettered.contains(&key)));
    if !settled.is_empty() {
        tracing::info!(rows = settled.len(), "released unsent: replication mode dead-lettered them");
    }
    (rows, settled.into_iter().map(|row| row.at).collect())
}

#[cfg(test)]
mod tests {
    use super::Chunks;

    /// The chunks a claim fetches from an outbox of rows of `sizes` bytes, and whether it ended
    /// full.
    fn claim(sizes: &[usize], limit: usize, budget: usize) -> (Vec<usize>, bool) {
        let (mut chunks, mut fetches, mut rows) = (Chunks::new(limit, budget), Vec::new(), sizes.iter());
        loop {
            let chunk = chunks.next();
            fetches.push(chunk);
            let fetched: Vec<usize> = rows.by_ref().take(chunk).copied().collect();
            fetched.iter().for_each(|size| chunks.row(*size));
            if let Some(full) = chunks.fetched(fetched.len()) {
                return (fetches, full);
            }
        }
    }

    #[test]
    fn chunks_grow_from_one_row_and_at_most_double() {
        let (fetches, full) = claim(&[10; 100], 100, 1_000_000);
        assert_eq!(fetches, [1, 2, 4, 8, 16, 32, 37]);
        assert!(full, "the claim ended at the limit: more rows may wait");
    }

    #[test]
    fn a_claim_that_runs_out_of_rows_is_not_full() {
        let (fetches, full) = claim(&[10; 5], 100, 1_000_000);
        assert_eq!(fetches, [1, 2, 4]);
        assert!(!full);
    }

    #[test]
    fn the_byte_budget_stops_fetching_within_one_chunk_of_rows_like_those_seen() {
        // rows of 100 bytes, a budget of 1,000: 1 + 2 + 4 rows, then the 3 that still fit
        let (fetches, full) = claim(&[100; 50], 50, 1_000);
        assert_eq!(fetches, [1, 2, 4, 3]);
        assert!(full, "the claim ended at the budget");
        // a large row seen first sizes the next chunks by it: one row at a time
        let (fetches, full) = claim(&[600, 300, 200, 10, 10], 50, 1_000);
        assert_eq!((fetches, full), (vec![1, 1, 1], true));
    }
}
