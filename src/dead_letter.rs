//! The one dead-letter path: polling, the replication stream and the first copy of a new slot
//! all hand an unpublishable event here, and `dead_letter.on_poison` decides the same way for
//! all three.
//!
//! Invariants:
//! - an event is unpublishable when its row cannot become a record (a NULL required column,
//!   headers that are not a JSON object, an invalid topic) or when Kafka refuses the record
//!   permanently (unknown topic, too large, not authorized), or, in the stream, when it comes as
//!   a non-transactional outbox message (anyone may write one, even in a rolled-back
//!   transaction) or one whose digest `replication.message_signing_key_file` does not verify
//!   (not `outbox_emit()`'s); nothing else is;
//! - `dead_letter`: the event is written to the dead-letter table with one statement
//!   ([`DeadLetters::write`]) in one row shape: `row_data` holds the row's event columns as
//!   text, keyed by the default column names (`id`, `aggregate_type`, `aggregate_id`,
//!   `event_type`, `payload`, `headers`, `topic`), whatever the table's own names are. Only
//!   then is the event's position released (polling: in the transaction that removes the row);
//! - `block`: the relay holds at the event ([`Hold`]): it reports it (error log, `/readyz`,
//!   `outbox_relay_events_blocked`), retries a refused record with backoff, releases nothing
//!   past it, and never publishes again what Kafka already acknowledged;
//! - with `dead_letter.signing_key_file`, each letter carries the key's digest of its outbox,
//!   event id and `row_data` ([`signing`]): `replay-dead-letters` replays only letters the relay
//!   wrote (or the operator vouched for), whoever else may INSERT into the table. A letter of a
//!   message the relay does not trust (forged, or non-transactional) is written unsigned
//!   ([`DeadLetter::unsigned`]): the relay wrote it, but does not vouch for its content.

use std::collections::{HashSet, VecDeque};
use std::time::Duration;

use tokio_postgres::GenericClient;

use crate::config::{DeadLetterConfig, OnPoison, OutboxId, PerOutbox, RetryConfig};
use crate::error::{FatalReason, RelayError};
use bytes::{BufMut, BytesMut};
use tokio_postgres::types::{IsNull, ToSql, Type, accepts, to_sql_checked};

use crate::backoff::Backoff;
use crate::observe::metrics::{Mode, metrics};
use crate::observe::pulse::Pulse;
use crate::outboxes::{Outbox, Outboxes};
use crate::record::{KafkaRecord, OutboxRow, Unpublishable};
use crate::table::{RowAt, qualified_name};

mod signing;

pub use signing::SigningKey;

/// The dead-letter table (`dead_letter.table`), quoted for SQL.
pub fn qualified_table(letters: &DeadLetterConfig) -> String {
    let (schema, table) = letters.schema_and_table();
    qualified_name(schema, table)
}

/// `$1` the source table, `$2` event ids (text): each one dead-lettered, with its latest letter's
/// reason (`verify`).
pub fn reasons_sql(letters: &DeadLetterConfig) -> String {
    format!(
        "SELECT DISTINCT ON (event_id) event_id, reason FROM {} WHERE source_table = $1 AND event_id = ANY($2::text[]) \
         ORDER BY event_id, id DESC",
        qualified_table(letters)
    )
}

/// `$1` the source table, `$2` how many: the oldest letters of an outbox first, each as id, event
/// id, reason, when (RFC 3339, UTC), aggregate type and id, event type (the admin API's list).
pub fn list_sql(letters: &DeadLetterConfig) -> String {
    format!(
        "SELECT id, event_id, reason, \
         to_char(dead_lettered_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"'), \
         row_data ->> 'aggregate_type', row_data ->> 'aggregate_id', row_data ->> 'event_type' \
         FROM {} WHERE source_table = $1 ORDER BY id LIMIT $2",
        qualified_table(letters)
    )
}

/// An event that cannot be published, with the row it came from and why.
#[derive(Debug, Clone)]
pub struct DeadLetter {
    pub id: String,
    pub row: LetterRow,
    pub reason: String,
    /// The outbox it came from (see [`KafkaRecord::outbox`]): its table and policy decide.
    pub outbox: OutboxId,
    /// Whether the relay signs it (with `dead_letter.signing_key_file`): not a message it could
    /// not trust (a forged or a non-transactional outbox message), whose letter
    /// `replay-dead-letters` must not send unless the operator vouches for it.
    pub signed: bool,
    /// A row the relay did not read (polling: over `polling.max_row_bytes`), where it lies:
    /// PostgreSQL copies it whole from there into the letter ([`DeadLetters::write`]); `row`
    /// holds its id alone.
    pub unread: Option<RowAt>,
}

/// What a dead letter keeps of its event, to write as `row_data`: the row as read, or the
/// record Kafka refused. It is serialized as JSON straight into the INSERT's parameters, so a
/// large payload is not copied once more on its way there.
#[derive(Debug, Clone)]
pub enum LetterRow {
    Row(OutboxRow),
    Record(KafkaRecord),
}

impl ToSql for LetterRow {
    fn to_sql(
        &self,
        _: &Type,
        out: &mut BytesMut,
    ) -> Result<IsNull, Box<dyn std::error::Error + Sync + Send>> {
        match self {
            LetterRow::Row(raw) => serde_json::to_writer(out.writer(), &raw.row_data())?,
            LetterRow::Record(event) => serde_json::to_writer(out.writer(), &event.row_data())?,
        }
        Ok(IsNull::No)
    }

    accepts!(TEXT);
    to_sql_checked!();
}

impl DeadLetter {
    /// A row the mapping refused.
    pub fn unmapped(unpublishable: Unpublishable) -> DeadLetter {
        let outbox = unpublishable.outbox;
        DeadLetter::row(unpublishable.row, unpublishable.reason.to_string()).in_outbox(outbox)
    }

    /// A row of the first outbox that is not published, for `reason` (of another: [`DeadLetter::in_outbox`]).
    pub fn row(row: OutboxRow, reason: String) -> DeadLetter {
        DeadLetter {
            id: row.id.clone().unwrap_or_default(),
            row: LetterRow::Row(row),
            reason,
            outbox: OutboxId::default(),
            signed: true,
            unread: None,
        }
    }

    /// A polling row of `bytes` bytes (its event columns as text), over `polling.max_row_bytes`
    /// (`limit`), lying `at`: not read, so not signed; PostgreSQL copies it into its letter.
    pub fn unread(at: RowAt, bytes: u64, limit: usize) -> DeadLetter {
        let reason = format!(
            "row {} is {bytes} bytes (its event columns as text), more than polling.max_row_bytes ({limit}): the \
             relay did not read it (it would hold it several times over); PostgreSQL copied it whole into this \
             letter, unsigned (the relay signs only what it read). To publish it, raise polling.max_row_bytes and \
             the memory limit with it, and replay it with --vouch once checked",
            at.id
        );
        let row = OutboxRow { id: Some(at.id.clone()), ..OutboxRow::default() };
        DeadLetter { unread: Some(at), ..DeadLetter::row(row, reason).unsigned() }
    }

    /// A record Kafka refused permanently.
    pub fn refused(event: KafkaRecord, reason: String) -> DeadLetter {
        let outbox = event.outbox;
        let id = event.id.clone();
        DeadLetter { id, row: LetterRow::Record(event), reason, outbox, signed: true, unread: None }
    }

    /// The letter, of the outbox `outbox`.
    pub fn in_outbox(self, outbox: OutboxId) -> DeadLetter {
        DeadLetter { outbox, ..self }
    }

    /// The letter, written without a digest: the relay does not vouch for what it holds (a
    /// message anyone may have written), so a replay refuses it unless vouched for.
    pub fn unsigned(self) -> DeadLetter {
        DeadLetter { signed: false, ..self }
    }
}

/// A dead-lettered event as a row is compared with it: its id and content, so an id handed out
/// again (a restarted sequence) or claimed by a forged message is another event.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct LetterKey {
    id: String,
    aggregate_id: Option<String>,
    event_type: Option<String>,
    payload: Option<String>,
}

impl LetterKey {
    /// The key of a row; `None` for a row without an id.
    pub fn of(raw: &OutboxRow) -> Option<LetterKey> {
        Some(LetterKey {
            id: raw.id.clone().filter(|id| !id.is_empty())?,
            aggregate_id: raw.aggregate_id.clone(),
            event_type: raw.event_type.clone(),
            payload: raw.payload.clone(),
        })
    }
}

/// The dead-letter policies and tables of one relay's outboxes.
#[derive(Debug, Clone)]
pub struct DeadLetters {
    /// See [`DeadLetter::outbox`].
    outboxes: PerOutbox<OutboxLetters>,
    mode: Mode,
    retry: RetryConfig,
    /// Letters of records Kafka refused inside a Kafka transaction, which was then aborted
    /// (`kafka.transactional`): the next session dead-letters them without sending them again,
    /// and the rest of their transaction commits. Shared by the clones; at most
    /// [`REFUSED_REMEMBERED`].
    refused: std::sync::Arc<std::sync::Mutex<VecDeque<DeadLetter>>>,
}

/// One outbox's dead-letter table and policy.
#[derive(Debug, Clone)]
struct OutboxLetters {
    /// The outbox's name: its metrics' label.
    name: String,
    insert_sql: String,
    dead_lettered_sql: String,
    source_table: String,
    /// Copies unread rows into letters ([`DeadLetter::unread`]).
    copy_unread_sql: String,
    policy: OnPoison,
    /// The key letters are signed with (`dead_letter.signing_key_file`), or why it could not be
    /// read; `None`: letters are not signed.
    signing: Option<Result<SigningKey, String>>,
}

impl OutboxLetters {
    fn new(outbox: &Outbox) -> OutboxLetters {
        let (schema, table) = outbox.dead_letter.schema_and_table();
        let key_file = &outbox.dead_letter.signing_key_file;
        let signing = (!key_file.is_empty()).then(|| SigningKey::read(key_file));
        OutboxLetters {
            name: outbox.name.clone(),
            insert_sql: format!(
                "INSERT INTO {} (source_table, event_id, row_data, reason{}) \
                 SELECT $1, u.event_id, u.row_data::jsonb, u.reason{} \
                 FROM unnest($2::text[], $3::text[], $4::text[], $5::text[]) AS u(event_id, row_data, reason, digest)",
                qualified_name(schema, table),
                if signing.is_some() { ", digest" } else { "" },
                if signing.is_some() { ", u.digest" } else { "" },
            ),
            dead_lettered_sql: format!(
                "SELECT event_id, row_data ->> 'aggregate_id', row_data ->> 'event_type', row_data ->> 'payload' \
                 FROM {} WHERE source_table = $1 AND event_id <> ''",
                qualified_name(schema, table)
            ),
            source_table: outbox.table.display_name(),
            copy_unread_sql: outbox.table.copy_to_letters_sql(&qualified_name(schema, table)),
            policy: outbox.dead_letter.on_poison,
            signing,
        }
    }
}

impl OutboxLetters {
    /// Each letter's digest (none without a key).
    fn digests(&self, letters: &[&DeadLetter]) -> Result<Vec<Option<String>>, RelayError> {
        let key = match &self.signing {
            None => return Ok(vec![None; letters.len()]),
            Some(Ok(key)) => key,
            Some(Err(why)) => return Err(RelayError::fatal(FatalReason::Config, why.clone())),
        };
        let digest = |letter: &&DeadLetter| {
            if !letter.signed {
                return None;
            }
            let row_data = match &letter.row {
                LetterRow::Row(raw) => raw.row_data(),
                LetterRow::Record(event) => event.row_data(),
            };
            Some(key.sign(&self.source_table, &letter.id, &row_data.fields()))
        };
        Ok(letters.iter().map(digest).collect())
    }

    /// A failed INSERT, saying which migration a signed letter needs.
    fn write_error(&self, error: tokio_postgres::Error) -> RelayError {
        if self.signing.is_some() && error.code() == Some(&tokio_postgres::error::SqlState::UNDEFINED_COLUMN)
        {
            return RelayError::fatal(
                FatalReason::Config,
                format!(
                    "the dead-letter table has no digest column, which dead_letter.signing_key_file needs ({error}): \
                     apply sql/011_dead_letter_digest.sql"
                ),
            );
        }
        error.into()
    }
}

/// Refused records remembered across an aborted transaction, at most (the oldest go first: a
/// record forgotten is refused again, and remembered again).
const REFUSED_REMEMBERED: usize = 1_000;

impl DeadLetters {
    /// `retry`: the backoff of a write that failed; `mode`: the `mode` label of the metrics.
    pub fn new(outboxes: &Outboxes, retry: &RetryConfig, mode: Mode) -> DeadLetters {
        DeadLetters {
            outboxes: outboxes.per(OutboxLetters::new),
            mode,
            retry: retry.clone(),
            refused: Default::default(),
        }
    }

    /// The outboxes' names, in order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.outboxes.values().map(|o| o.name.as_str())
    }

    /// The outboxes, in order.
    pub fn ids(&self) -> impl Iterator<Item = OutboxId> + use<'_> {
        self.outboxes.iter().map(|(id, _)| id)
    }

    fn of(&self, outbox: OutboxId) -> &OutboxLetters {
        &self.outboxes[outbox]
    }

    /// Kafka refused `letter`'s record inside a transaction that is now aborted: under
    /// `on_poison = "dead_letter"` the next session dead-letters it unsent
    /// ([`DeadLetters::refused_before`]).
    pub fn remember_refused(&self, letter: DeadLetter) {
        if self.blocks(letter.outbox) {
            return;
        }
        let mut refused = self.refused.lock().unwrap();
        if refused.len() >= REFUSED_REMEMBERED {
            refused.pop_front();
        }
        refused.push_back(letter);
    }

    /// The letter of `record` if Kafka refused this very record (id, topic, key and payload) in
    /// an aborted transaction; it is forgotten then.
    pub fn refused_before(&self, record: &KafkaRecord) -> Option<DeadLetter> {
        let mut refused = self.refused.lock().unwrap();
        let same = |letter: &DeadLetter| match &letter.row {
            LetterRow::Record(r) => {
                r.id == record.id
                    && r.outbox == record.outbox
                    && r.topic == record.topic
                    && r.key == record.key
                    && r.payload == record.payload
            }
            LetterRow::Row(_) => false,
        };
        let index = refused.iter().position(same)?;
        refused.remove(index)
    }

    /// True when outbox `outbox` has `on_poison = "block"`.
    pub fn blocks(&self, outbox: OutboxId) -> bool {
        self.of(outbox).policy == OnPoison::Block
    }

    /// The events of outbox `outbox` its dead-letter table holds; none when there is no such
    /// table (`on_poison = "block"` needs none).
    pub async fn dead_lettered(
        &self,
        client: &tokio_postgres::Client,
        outbox: OutboxId,
    ) -> Result<HashSet<LetterKey>, RelayError> {
        let of = self.of(outbox);
        match client.query(&of.dead_lettered_sql, &[&of.source_table]).await {
            Ok(rows) => Ok(rows
                .iter()
                .map(|r| LetterKey {
                    id: r.get(0),
                    aggregate_id: r.get(1),
                    event_type: r.get(2),
                    payload: r.get(3),
                })
                .collect()),
            Err(e) if e.code() == Some(&tokio_postgres::error::SqlState::UNDEFINED_TABLE) => {
                Ok(HashSet::new())
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Writes `letters` to the dead-letter table in one statement on `client`. Polling passes
    /// its claim transaction and [`DeadLetters::report`]s them once it commits; sessions that
    /// commit each statement use [`DeadLetters::write_committed`]. Returns how many were written.
    pub async fn write(
        &self,
        client: &(impl GenericClient + Sync),
        letters: &[DeadLetter],
    ) -> Result<u64, RelayError> {
        let mut written = 0;
        // one statement per outbox with letters (each has its table)
        for (outbox, of) in self.outboxes.iter() {
            let (unread, letters): (Vec<&DeadLetter>, Vec<&DeadLetter>) =
                letters.iter().filter(|l| l.outbox == outbox).partition(|l| l.unread.is_some());
            if !unread.is_empty() {
                let (tableoids, ctids) = RowAt::params(unread.iter().filter_map(|l| l.unread.as_ref()));
                let reasons: Vec<&str> = unread.iter().map(|l| l.reason.as_str()).collect();
                let params: [&(dyn ToSql + Sync); 4] = [&of.source_table, &tableoids, &ctids, &reasons];
                written += client.execute(&of.copy_unread_sql, &params).await?;
            }
            if letters.is_empty() {
                continue;
            }
            let ids: Vec<&str> = letters.iter().map(|l| l.id.as_str()).collect();
            let rows: Vec<&LetterRow> = letters.iter().map(|l| &l.row).collect();
            let reasons: Vec<&str> = letters.iter().map(|l| l.reason.as_str()).collect();
            let digests = of.digests(&letters)?;
            let params: [&(dyn ToSql + Sync); 5] = [&of.source_table, &ids, &rows, &reasons, &digests];
            written += client.execute(&of.insert_sql, &params).await.map_err(|e| of.write_error(e))?;
        }
        Ok(written)
    }

    /// Counts and logs `letters`, once they are committed: a claim that rolls back and is
    /// dead-lettered again later is counted once.
    pub fn report(&self, letters: &[DeadLetter]) {
        metrics().events_dead_lettered.with_label_values(&[self.mode.label()]).inc_by(letters.len() as u64);
        for letter in letters {
            let of = self.of(letter.outbox);
            metrics().outbox_events_dead_lettered.with_label_values(&[&of.name]).inc();
            let table = &of.source_table;
            tracing::warn!(event_id = %letter.id, reason = %letter.reason, %table, "event moved to the dead-letter table");
        }
    }

    /// [`DeadLetters::write`] on a session that commits each statement, then [`DeadLetters::report`].
    pub async fn write_committed(
        &self,
        client: &(impl GenericClient + Sync),
        letters: &[DeadLetter],
    ) -> Result<u64, RelayError> {
        let written = self.write(client, letters).await?;
        self.report(letters);
        Ok(written)
    }

    /// Starts holding at `letter` (`on_poison = "block"`), reporting it at once.
    pub fn hold(&self, letter: DeadLetter, pulse: &Pulse) -> Hold {
        let table = self.of(letter.outbox).source_table.clone();
        let hold = Hold { letter, backoff: Backoff::from_config(&self.retry), table };
        hold.report(pulse);
        hold
    }
}

/// The relay holding at one unpublishable event.
#[derive(Debug)]
pub struct Hold {
    pub letter: DeadLetter,
    backoff: Backoff,
    table: String,
}

impl Hold {
    /// Logs the held event and puts it on `/readyz` (again, at each retry).
    pub fn report(&self, pulse: &Pulse) {
        let DeadLetter { id, reason, .. } = &self.letter;
        tracing::error!(
            event_id = %id, %reason, table = %self.table,
            "blocked at an unpublishable event (dead_letter.on_poison = \"block\"): fix its cause \
             (the row, the topic, the broker's size limit) or set dead_letter.on_poison = \"dead_letter\""
        );
        pulse.blocked(Some(format!("blocked at event {id}: {reason}")));
    }

    /// The next retry's delay (capped backoff).
    pub fn next_delay(&mut self) -> Duration {
        self.backoff.next_delay()
    }

    /// The event was published after all, or its row left the outbox.
    pub fn release(self, pulse: &Pulse) {
        tracing::info!(event_id = %self.letter.id, "the held event was published or removed; carrying on");
        pulse.blocked(None);
    }
}
