//! The record of what the relay published: one bit per event id, per source table
//! (`sql/010_published.sql`), so `verify` can tell a row deleted after it was published from a
//! phantom, and a published event Kafka lost from one never sent.
//!
//! Invariants:
//! - an id is recorded only once Kafka acknowledged its record (polling: in the transaction that
//!   releases the row; replication: once its transaction is settled, before the slot confirms
//!   past it; the first copy: once its chunk is settled), so Kafka owes every recorded id,
//!   whether a relay is running or not;
//! - recording is idempotent (bits are OR-ed), so a replay records nothing new;
//! - an id the transforms filtered out is recorded as such (`filtered`,
//!   `sql/016_published_filtered.sql`) when its row is settled, as a published one is, so
//!   `verify` counts it filtered even once the rules change;
//! - ids that are not non-negative integers are not recorded (a uuid id column);
//! - without the table or the privilege the relay says so once at start and records nothing:
//!   verify then cannot vouch for deleted rows, and says so.

use std::collections::{BTreeSet, HashMap};
use std::time::SystemTime;

use tokio_postgres::GenericClient;

use crate::error::RelayError;

/// Ids per block: one `bit(8192)` row.
pub const BLOCK: i64 = 8192;
const WORDS: usize = (BLOCK / 64) as usize;

/// One upsert per block, in block order (two writers lock the blocks they share in the same order:
/// no deadlock), OR-ing the ids and adding the topics not yet listed.
const RECORD_SQL: &str = "INSERT INTO outbox_relay_published AS p (source_table, block, ids, topics) \
     SELECT $1::text, id / 8192, bit_or(B'1'::bit(8192) >> (id % 8192)::int), $3::text[] \
     FROM unnest($2::bigint[]) AS id GROUP BY id / 8192 ORDER BY 2 \
     ON CONFLICT (source_table, block) DO UPDATE SET ids = p.ids | EXCLUDED.ids, last_published_at = now(), \
     topics = CASE WHEN EXCLUDED.topics <@ p.topics THEN p.topics \
                   ELSE ARRAY(SELECT DISTINCT unnest(p.topics || EXCLUDED.topics)) END";

/// [`RECORD_SQL`] with the ids the transforms filtered out (`$4`) OR-ed into `filtered`
/// (`sql/016_published_filtered.sql`).
const RECORD_WITH_FILTERED_SQL: &str = "INSERT INTO outbox_relay_published AS p (source_table, block, ids, filtered, topics) \
     SELECT $1::text, id / 8192, \
            bit_or(CASE WHEN f THEN B'0'::bit(8192) ELSE B'1'::bit(8192) >> (id % 8192)::int END), \
            bit_or(CASE WHEN f THEN B'1'::bit(8192) >> (id % 8192)::int ELSE B'0'::bit(8192) END), $3::text[] \
     FROM (SELECT id, false AS f FROM unnest($2::bigint[]) AS id \
           UNION ALL SELECT id, true FROM unnest($4::bigint[]) AS id) u \
     GROUP BY id / 8192 ORDER BY 2 \
     ON CONFLICT (source_table, block) DO UPDATE SET ids = p.ids | EXCLUDED.ids, \
         filtered = coalesce(p.filtered, B'0'::bit(8192)) | EXCLUDED.filtered, last_published_at = now(), \
         topics = CASE WHEN EXCLUDED.topics <@ p.topics THEN p.topics \
                       ELSE ARRAY(SELECT DISTINCT unnest(p.topics || EXCLUDED.topics)) END";

/// Whether the record has the column of filtered ids (`sql/016_published_filtered.sql`).
const HAS_FILTERED_SQL: &str = "SELECT EXISTS (SELECT 1 FROM pg_attribute \
     WHERE attrelid = to_regclass('outbox_relay_published') AND attname = 'filtered' AND NOT attisdropped)";

/// The filtered ids of the blocks written at or after `$2`.
const LOAD_FILTERED_SQL: &str = "SELECT block, filtered::text FROM outbox_relay_published \
     WHERE source_table = $1 AND filtered IS NOT NULL AND last_published_at >= coalesce($2, '-infinity'::timestamptz)";

/// Whether the table exists and this role may write it (the upsert reads the block it ORs into:
/// SELECT too).
pub const USABLE_SQL: &str = "SELECT CASE WHEN to_regclass('outbox_relay_published') IS NULL THEN false \
     ELSE has_table_privilege('outbox_relay_published', 'SELECT') \
     AND has_table_privilege('outbox_relay_published', 'INSERT') \
     AND has_table_privilege('outbox_relay_published', 'UPDATE') END";

const LOAD_SQL: &str = "SELECT block, ids::text, first_published_at, topics FROM outbox_relay_published \
     WHERE source_table = $1 AND last_published_at >= coalesce($2, '-infinity'::timestamptz)";

/// Writes the record for one source table.
#[derive(Debug, Clone)]
pub struct Recorder {
    /// `schema.table`, as the dead-letter table names it.
    source_table: String,
    enabled: bool,
    /// The record keeps filtered ids too (`sql/016_published_filtered.sql`).
    filtered: bool,
}

impl Recorder {
    /// A recorder for `source_table` when the table exists and this role may write it; otherwise
    /// a warning that says what to apply, and a recorder that records nothing.
    pub async fn open(client: &impl GenericClient, source_table: &str) -> Result<Recorder, RelayError> {
        let enabled: bool = client.query_one(USABLE_SQL, &[]).await?.get(0);
        if !enabled {
            tracing::warn!(
                "outbox_relay_published is missing or this role may not SELECT, INSERT and UPDATE it: published ids are \
                 not recorded, so `verify` cannot tell rows deleted after publishing from phantoms -- fix: apply \
                 sql/010_published.sql and sql/100_relay_role.sql"
            );
        }
        let filtered = enabled && client.query_one(HAS_FILTERED_SQL, &[]).await?.get::<_, bool>(0);
        if enabled && !filtered {
            tracing::warn!(
                "outbox_relay_published has no column of filtered ids: the ids the transforms filter out are not \
                 recorded, so `verify` judges such rows by the rules as they are when it runs -- fix: apply \
                 sql/016_published_filtered.sql"
            );
        }
        Ok(Recorder { source_table: source_table.to_string(), enabled, filtered })
    }

    /// Records what `sent` holds.
    pub async fn record(&self, client: &impl GenericClient, sent: &Sent) -> Result<(), RelayError> {
        let filtered: &[i64] = if self.filtered { &sent.filtered } else { &[] };
        if !self.enabled || (sent.ids.is_empty() && filtered.is_empty()) {
            return Ok(());
        }
        let topics: Vec<&String> = sent.topics.iter().collect();
        if self.filtered {
            let params: [&(dyn tokio_postgres::types::ToSql + Sync); 4] =
                [&self.source_table, &sent.ids, &topics, &filtered];
            client.execute(RECORD_WITH_FILTERED_SQL, &params).await?;
        } else {
            client.execute(RECORD_SQL, &[&self.source_table, &sent.ids, &topics]).await?;
        }
        Ok(())
    }
}

/// Events handed to Kafka (or acknowledged), to record: their ids and topics.
#[derive(Debug, Default)]
pub struct Sent {
    ids: Vec<i64>,
    topics: BTreeSet<String>,
    /// Ids the outbox's transforms filtered out: settled without a record.
    filtered: Vec<i64>,
}

impl Sent {
    /// Notes the event `id` sent to `topic` (an id that is not a non-negative integer is not
    /// recorded).
    pub fn add(&mut self, id: &str, topic: &str) {
        if let Some(id) = numeric_id(id) {
            self.ids.push(id);
            if !self.topics.contains(topic) {
                self.topics.insert(topic.to_string());
            }
        }
    }

    /// Notes the event `id` the transforms filtered out.
    pub fn add_filtered(&mut self, id: &str) {
        self.filtered.extend(numeric_id(id));
    }

    /// The events `ids`, sent to some of `topics`.
    pub fn of<'a>(ids: impl IntoIterator<Item = &'a str>, topics: BTreeSet<String>) -> Sent {
        Sent { ids: ids.into_iter().filter_map(numeric_id).collect(), topics, filtered: Vec::new() }
    }

    /// These events, and `ids` the transforms filtered out.
    pub fn with_filtered<'a>(mut self, ids: impl IntoIterator<Item = &'a str>) -> Sent {
        self.filtered.extend(ids.into_iter().filter_map(numeric_id));
        self
    }

    /// These events and `other`'s.
    pub fn and(mut self, other: Sent) -> Sent {
        self.ids.extend(other.ids);
        self.topics.extend(other.topics);
        self.filtered.extend(other.filtered);
        self
    }

    /// Nothing sent and nothing filtered.
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty() && self.filtered.is_empty()
    }

    pub fn len(&self) -> usize {
        self.ids.len()
    }
}

/// `id` as a number the record can hold.
pub fn numeric_id(id: &str) -> Option<i64> {
    id.parse::<i64>().ok().filter(|n| *n >= 0)
}

/// A set of non-negative ids, one bit each, in blocks of [`BLOCK`].
#[derive(Debug, Default)]
pub struct IdBits {
    blocks: HashMap<i64, Box<[u64; WORDS]>>,
}

impl IdBits {
    pub fn insert(&mut self, id: i64) {
        let block = self.blocks.entry(id / BLOCK).or_insert_with(|| Box::new([0; WORDS]));
        let bit = (id % BLOCK) as usize;
        block[bit / 64] |= 1 << (bit % 64);
    }

    pub fn contains(&self, id: i64) -> bool {
        let bit = (id % BLOCK) as usize;
        id >= 0 && self.blocks.get(&(id / BLOCK)).is_some_and(|b| b[bit / 64] & (1 << (bit % 64)) != 0)
    }

    /// The ids of block `block` as `bit(8192)` text puts them (the first character is bit 0).
    fn set_block(&mut self, block: i64, text: &str) {
        let mut words = Box::new([0u64; WORDS]);
        for (bit, c) in text.bytes().enumerate().take(BLOCK as usize) {
            if c == b'1' {
                words[bit / 64] |= 1 << (bit % 64);
            }
        }
        self.blocks.insert(block, words);
    }

    /// Every id held, in no particular order.
    pub fn ids(&self) -> impl Iterator<Item = i64> + '_ {
        self.blocks.iter().flat_map(|(block, words)| {
            words.iter().enumerate().flat_map(move |(w, word)| {
                (0..64)
                    .filter(move |b| word & (1 << b) != 0)
                    .map(move |b| block * BLOCK + (w * 64 + b) as i64)
            })
        })
    }

    pub fn memory_bytes(&self) -> usize {
        self.blocks.len() * (WORDS * 8 + 32)
    }
}

/// The record of one source table as `verify` reads it.
#[derive(Debug, Default)]
pub struct Record {
    /// Whether the table exists: without it nothing can be said of deleted rows.
    pub kept: bool,
    pub published: IdBits,
    /// Blocks first written at or after the window's start: ids the window may call missing.
    pub recent: IdBits,
    /// The topics of the blocks read.
    pub topics: BTreeSet<String>,
}

impl Record {
    /// Reads the blocks of `source_table` written at or after `touched_since` (all without it);
    /// those first written at or after `since` also go to `recent`.
    pub async fn load(
        client: &impl GenericClient,
        source_table: &str,
        touched_since: Option<SystemTime>,
        since: Option<SystemTime>,
    ) -> Result<Record, RelayError> {
        let exists: bool =
            client.query_one("SELECT to_regclass('outbox_relay_published') IS NOT NULL", &[]).await?.get(0);
        let mut record = Record { kept: exists, ..Record::default() };
        if !exists {
            return Ok(record);
        }
        for row in client.query(LOAD_SQL, &[&source_table, &touched_since]).await? {
            let (block, text, first): (i64, String, SystemTime) = (row.get(0), row.get(1), row.get(2));
            record.published.set_block(block, &text);
            record.topics.extend(row.get::<_, Vec<String>>(3));
            if since.is_none_or(|since| first >= since) {
                record.recent.set_block(block, &text);
            }
        }
        Ok(record)
    }
}

/// The ids of `source_table` the relay recorded as filtered out by the transforms, in the blocks
/// written at or after `touched_since` (all without it); none without the record or its column.
pub async fn filtered(
    client: &impl GenericClient,
    source_table: &str,
    touched_since: Option<SystemTime>,
) -> Result<IdBits, RelayError> {
    let mut bits = IdBits::default();
    if !client.query_one(HAS_FILTERED_SQL, &[]).await?.get::<_, bool>(0) {
        return Ok(bits);
    }
    for row in client.query(LOAD_FILTERED_SQL, &[&source_table, &touched_since]).await? {
        bits.set_block(row.get(0), row.get::<_, &str>(1));
    }
    Ok(bits)
}

/// The block of event `id` as recorded now: its bits, its topics and when it was first written;
/// None when the block (or the table) does not exist.
pub async fn block_of(
    client: &impl GenericClient,
    source_table: &str,
    id: i64,
) -> Result<Option<(IdBits, Vec<String>, SystemTime)>, RelayError> {
    let exists: bool =
        client.query_one("SELECT to_regclass('outbox_relay_published') IS NOT NULL", &[]).await?.get(0);
    if !exists {
        return Ok(None);
    }
    let sql = "SELECT ids::text, topics, first_published_at FROM outbox_relay_published \
               WHERE source_table = $1 AND block = $2";
    let Some(row) = client.query_opt(sql, &[&source_table, &(id / BLOCK)]).await? else { return Ok(None) };
    let mut bits = IdBits::default();
    bits.set_block(id / BLOCK, row.get::<_, &str>(0));
    Ok(Some((bits, row.get(1), row.get(2))))
}

/// The blocks of `ids` as recorded now: for records read after the record was loaded (published
/// while verify ran).
pub async fn recorded(
    client: &impl GenericClient,
    source_table: &str,
    ids: &[i64],
) -> Result<IdBits, RelayError> {
    let mut bits = IdBits::default();
    let blocks: Vec<i64> = ids.iter().map(|id| id / BLOCK).collect::<BTreeSet<_>>().into_iter().collect();
    if blocks.is_empty() {
        return Ok(bits);
    }
    let sql =
        "SELECT block, ids::text FROM outbox_relay_published WHERE source_table = $1 AND block = ANY($2)";
    for row in client.query(sql, &[&source_table, &blocks]).await? {
        bits.set_block(row.get(0), row.get::<_, &str>(1));
    }
    Ok(bits)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bits_hold_exactly_the_ids_inserted() {
        let mut bits = IdBits::default();
        for id in [0, 63, 64, 8191, 8192, 1_000_003] {
            bits.insert(id);
        }
        for id in [0, 63, 64, 8191, 8192, 1_000_003] {
            assert!(bits.contains(id), "{id}");
        }
        for id in [1, 62, 65, 8190, 8193, 1_000_002, -1] {
            assert!(!bits.contains(id), "{id}");
        }
        let mut ids: Vec<i64> = bits.ids().collect();
        ids.sort();
        assert_eq!(ids, [0, 63, 64, 8191, 8192, 1_000_003]);
    }

    #[test]
    fn a_block_reads_as_postgresql_prints_it() {
        let mut text = "0".repeat(8192);
        text.replace_range(0..1, "1");
        text.replace_range(100..101, "1");
        text.replace_range(8191..8192, "1");
        let mut bits = IdBits::default();
        bits.set_block(3, &text);
        let mut ids: Vec<i64> = bits.ids().collect();
        ids.sort();
        assert_eq!(ids, [3 * 8192, 3 * 8192 + 100, 3 * 8192 + 8191]);
    }

    #[test]
    fn only_non_negative_integers_are_recorded() {
        assert_eq!(numeric_id("42"), Some(42));
        assert_eq!(numeric_id("-1"), None);
        assert_eq!(numeric_id("3f2c9a2e-1b1d-4c1e-9a55-2f8e3c1d0b7a"), None);
    }
}
