//! `outbox-relay replay-dead-letters`: publishes dead letters of this outbox again, each under
//! its event's own id, once their cause is fixed (the data in `row_data`, a topic created, a
//! size limit raised).
//!
//! Invariants:
//! - the letters are locked (`FOR UPDATE`) for the whole replay, so two replays do not both send
//!   one; the privileges to remove them are checked before anything is sent;
//! - only letters the relay wrote are sent ([`trust`]): one whose digest this relay's key
//!   (`dead_letter.signing_key_file`) does not verify is refused, named, and left as it is, unless
//!   the operator vouches for it by id (`--vouch`); nothing of it is sent, removed or recorded;
//! - a letter is removed, with its event's row still in the outbox (replication mode keeps it)
//!   and its id recorded as published, in one transaction committed only after Kafka
//!   acknowledged every record sent; a letter that still cannot map, or that Kafka refuses,
//!   stays, and the command says why and exits 1;
//! - records go to Kafka through the daemon's delivery stage: offline ([`run`]) in a one-off
//!   session ([`crate::delivery::once`]), with `kafka.transactional` one Kafka transaction under
//!   a `transactional.id` of its own (the relay's is never fenced); live ([`live`]: the admin
//!   API, the signal table) through the active session's own stage and sink, between its
//!   stream's records ([`crate::delivery::live`]);
//! - a replayed record carries the relay's headers (`id`, the source) and
//!   `outbox_relay_replayed: <letter id>`, and no position: it comes after later events of its
//!   key, so `verify` neither orders nor compares it, and the relay's read-back passes it over.
//!   A replay that dies after Kafka acknowledged and before the commit leaves the letters: run
//!   again, the events are sent again under the same ids (consumers deduplicate by id).

use std::collections::HashSet;
use std::time::Duration;

use tokio_postgres::Transaction;

use crate::config::RelayConfig;
use crate::delivery::live::Leader;
use crate::delivery::once::{self, Delivered};
use crate::error::{FatalReason, RelayError};
use crate::outboxes::Outbox;
use crate::published::Sent;
use crate::record::{KafkaRecord, Mapping, OutboxRow};
use crate::sink::kafka::{KafkaSink, REPLAYED_HEADER};
use crate::table::OutboxTable;

mod trust;

/// Which letters, and whether to send them.
#[derive(Debug, Clone, Default)]
pub struct Options {
    /// Letter ids (`outbox_dead_letter.id`); empty: every letter of this outbox.
    pub ids: Vec<i64>,
    /// Letters the operator checked and vouches for although this relay's key does not verify
    /// them (edited since the relay wrote them, or written without a key).
    pub vouched: Vec<i64>,
    pub dry_run: bool,
}

/// One line per letter, and the counts.
#[derive(Debug, Default)]
pub struct Outcome {
    pub lines: Vec<String>,
    pub replayed: u64,
    /// Letters that still cannot be published, or ids not found: the exit code is 1.
    pub refused: u64,
    /// Nothing was sent: a line per letter says what would be.
    pub dry_run: bool,
}

impl super::Output for Outcome {
    /// The letters' lines, then the counts.
    fn text(&self) -> String {
        let mut out: String = self.lines.iter().map(|line| format!("{line}\n")).collect();
        let verb = if self.dry_run { "would replay" } else { "replayed" };
        let ready = if self.dry_run { self.lines.len() as u64 - self.refused } else { self.replayed };
        out += &format!("{verb} {ready} letter(s); {} cannot be, and stay\n", self.refused);
        out
    }

    fn exit_code(&self) -> u8 {
        if self.refused == 0 { 0 } else { super::EXIT_FAILURE }
    }
}

/// A letter read for replay.
struct Letter {
    id: i64,
    event_id: String,
    row_data: String,
    /// The relay's digest of it (`sql/011_dead_letter_digest.sql`), if any.
    digest: Option<String>,
}

/// Replays the chosen letters (or says what it would send): read and lock them, map them, send
/// them, then remove the acknowledged ones with their rows and record their ids, in one
/// transaction.
pub async fn run(config: &RelayConfig, outbox: &Outbox, options: &Options) -> Result<Outcome, RelayError> {
    replay(config, outbox, options, None).await
}

/// Replays the chosen letters through this process's active session, beside its stream.
pub(crate) async fn live(
    config: &RelayConfig,
    outbox: &Outbox,
    options: &Options,
    leader: &Leader,
) -> Result<Outcome, RelayError> {
    replay(config, outbox, options, Some(leader)).await
}

async fn replay(
    config: &RelayConfig,
    outbox: &Outbox,
    options: &Options,
    leader: Option<&Leader>,
) -> Result<Outcome, RelayError> {
    let (mut client, _) = crate::postgres::connect_primary(&config.postgres).await?;
    let table = &outbox.table;
    let letters_table = crate::dead_letter::qualified_table(&outbox.dead_letter);
    let mut outcome = Outcome { dry_run: options.dry_run, ..Outcome::default() };
    let recorder = outbox.recorder(&client).await?;
    let identities = crate::readback::source_identities(&client, config).await?;
    let id_type = table.id_type(&client).await?;
    let tx = client.transaction().await?;
    // the transaction stays open while Kafka acknowledges: a server's idle timeout must not end
    // it between the acknowledgement and the commit (a rerun would send the letters again)
    tx.batch_execute("SET LOCAL idle_in_transaction_session_timeout = 0").await?;
    // (a dry run checks what the real run will need: the privileges, the topics, the size limit)
    may_remove(&tx, &letters_table, table).await?;
    let source_table = table.display_name();
    let letters =
        read(&tx, (&letters_table, &source_table), &options.ids, !options.dry_run, &mut outcome).await?;
    let letters = trust::trusted(
        letters,
        &trust::Check::new(&outbox.dead_letter, options, &source_table)?,
        &mut outcome,
    );
    let records = mapped(&outbox.mapping, letters, &letters_table, &mut outcome);
    let records = kafka_takes(config, records, &mut outcome).await?;
    if options.dry_run {
        for (letter, record) in &records {
            outcome.lines.push(format!(
                "letter {} (event {}): would send {}",
                letter.id,
                letter.event_id,
                describe(record)
            ));
        }
        return Ok(outcome);
    }
    if records.is_empty() {
        return Ok(outcome);
    }
    let acked = match leader {
        Some(leader) => send_live(config, leader, &records, &mut outcome).await?,
        None => send(config, (&identities, outbox), &records, &mut outcome).await?,
    };
    // only what this replay published: its letters, their rows, their ids
    let sent: Vec<&(Letter, KafkaRecord)> = records.iter().filter(|(l, _)| acked.contains(&l.id)).collect();
    remove(&tx, &letters_table, &table.delete_ids_sql(&id_type), &sent).await?;
    let topics = sent.iter().map(|(_, r)| r.topic.clone()).collect();
    recorder.record(&tx, &Sent::of(sent.iter().map(|(l, _)| l.event_id.as_str()), topics)).await?;
    tx.commit().await?;
    for (letter, record) in sent {
        outcome.replayed += 1;
        outcome.lines.push(format!(
            "letter {} (event {}): sent {}",
            letter.id,
            letter.event_id,
            describe(record)
        ));
    }
    Ok(outcome)
}

/// The letters of this outbox (all, or those of `ids`), locked unless a dry run only reads them;
/// ids not found are refused.
async fn read(
    tx: &Transaction<'_>,
    (letters_table, source_table): (&str, &str),
    ids: &[i64],
    lock: bool,
    outcome: &mut Outcome,
) -> Result<Vec<Letter>, RelayError> {
    let sql = format!(
        // (the digest through to_jsonb: a table without the column (sql/011_dead_letter_digest.sql) reads none)
        "SELECT id, event_id, row_data::text, to_jsonb(l) ->> 'digest' FROM {letters_table} l \
         WHERE source_table = $1 AND (cardinality($2::bigint[]) = 0 OR id = ANY($2)) ORDER BY id{}",
        if lock { " FOR UPDATE" } else { "" }
    );
    let rows = tx.query(&sql, &[&source_table, &ids]).await?;
    let letter = |r: &tokio_postgres::Row| Letter {
        id: r.get(0),
        event_id: r.get(1),
        row_data: r.get(2),
        digest: r.get(3),
    };
    let letters: Vec<Letter> = rows.iter().map(letter).collect();
    for id in ids.iter().filter(|id| !letters.iter().any(|l| l.id == **id)) {
        outcome.refused += 1;
        outcome.lines.push(format!("letter {id}: no dead letter of {source_table} has this id"));
    }
    Ok(letters)
}

/// The records `letters` become now; a letter that still cannot be published is refused, saying
/// how to fix its row_data in `letters_table`.
fn mapped(
    mapping: &Mapping,
    letters: Vec<Letter>,
    letters_table: &str,
    outcome: &mut Outcome,
) -> Vec<(Letter, KafkaRecord)> {
    let mut records = Vec::new();
    for letter in letters {
        match record_of(mapping, &letter) {
            Ok(record) => records.push((letter, record)),
            Err(reason) => {
                outcome.refused += 1;
                outcome.lines.push(format!(
                    "letter {} (event {}): still cannot be published: {reason} -- fix row_data first, e.g. UPDATE \
                     {letters_table} SET row_data = jsonb_set(row_data, '{{topic}}', '\"orders\"') WHERE id = {}",
                    letter.id, letter.event_id, letter.id
                ));
            }
        }
    }
    records
}

/// The record `letter` becomes now, or why it still cannot be published.
fn record_of(mapping: &Mapping, letter: &Letter) -> Result<KafkaRecord, String> {
    let object = match serde_json::from_str::<serde_json::Value>(&letter.row_data) {
        Ok(serde_json::Value::Object(object)) => object,
        _ => return Err("row_data is not a JSON object".into()),
    };
    if letter.event_id.is_empty() {
        return Err("the letter has no event id (its row had none)".into());
    }
    let mut row = OutboxRow::from_json(&object);
    // the letter names the event; a row_data of another id would publish someone else's
    row.id = Some(letter.event_id.clone());
    let mut record = mapping
        .to_record(row, None)
        .map_err(|e| e.to_string())?
        .map_err(|refused| refused.reason.to_string())?;
    record.row_headers.push((REPLAYED_HEADER.to_string(), letter.id.to_string()));
    Ok(record)
}

/// The records Kafka will take, as far as can be told before sending: each whose topic does not
/// exist, or that is over the producer's `message.max.bytes`, is refused (and its letter stays)
/// with what to do, rather than sent to fail.
async fn kafka_takes(
    config: &RelayConfig,
    records: Vec<(Letter, KafkaRecord)>,
    outcome: &mut Outcome,
) -> Result<Vec<(Letter, KafkaRecord)>, RelayError> {
    if records.is_empty() {
        return Ok(records);
    }
    let kafka = config.kafka.clone();
    let topics = tokio::task::spawn_blocking(move || {
        crate::sink::kafka::cluster::fetch_cluster_info(&kafka, Duration::from_secs(10))
    })
    .await
    .map_err(|e| RelayError::Kafka(format!("reading Kafka's metadata failed: {e}")))?
    .map_err(|e| RelayError::Kafka(format!("cannot read Kafka's metadata: {e}")))?
    .topics;
    let limit = config.kafka.property("message.max.bytes").and_then(|v| v.parse().ok()).unwrap_or(1_000_000);
    let mut takes = Vec::with_capacity(records.len());
    for (letter, record) in records {
        let refusal = if !topics.contains(&record.topic) {
            format!(
                "topic {} does not exist: create it (kafka-topics.sh --create --topic {}), then replay",
                record.topic, record.topic
            )
        } else if record.size() > limit {
            format!(
                "record of about {} bytes is over the producer's message.max.bytes ({limit}): raise                  kafka.properties.\"message.max.bytes\" and the topic's max.message.bytes, or make the event smaller",
                record.size()
            )
        } else {
            takes.push((letter, record));
            continue;
        };
        outcome.refused += 1;
        outcome.lines.push(format!(
            "letter {} (event {}): Kafka would refuse it: {refusal}; it stays",
            letter.id, letter.event_id
        ));
    }
    Ok(takes)
}

fn describe(record: &KafkaRecord) -> String {
    format!("to {} (key {:?}, {} bytes)", record.topic, record.key, record.payload.len())
}

/// Fails before anything is sent when this role could not remove the letters and rows.
async fn may_remove(
    tx: &Transaction<'_>,
    letters_table: &str,
    table: &OutboxTable,
) -> Result<(), RelayError> {
    // (locking the letters FOR UPDATE needs UPDATE on their table)
    let row = tx
        .query_one(
            "SELECT has_table_privilege($1, 'DELETE') AND has_table_privilege($1, 'UPDATE'), \
             has_table_privilege($2, 'DELETE')",
            &[&letters_table, &table.qualified()],
        )
        .await?;
    let (letters, outbox): (bool, bool) = (row.get(0), row.get(1));
    let lacking: Vec<String> = [
        (letters, format!("DELETE, UPDATE ON {letters_table}")),
        (outbox, format!("DELETE ON {}", table.qualified())),
    ]
    .into_iter()
    .filter(|(may, _)| !may)
    .map(|(_, grant)| grant)
    .collect();
    if lacking.is_empty() {
        return Ok(());
    }
    Err(RelayError::fatal(
        FatalReason::Privilege,
        format!(
            "this role lacks {}: a replayed letter is locked, then removed with its event's row in one transaction \
             -- run replay-dead-letters as the outbox's owner, or GRANT {} TO the role",
            lacking.join(" and "),
            lacking.join("; GRANT ")
        ),
    ))
}

/// Sends every record through a one-off session of the delivery stage (the daemon's headers,
/// classification and Kafka transactions) and waits for each; returns the letters Kafka
/// acknowledged, and notes each of the others.
async fn send(
    config: &RelayConfig,
    (identities, outbox): (&[String], &Outbox),
    records: &[(Letter, KafkaRecord)],
    outcome: &mut Outcome,
) -> Result<HashSet<i64>, RelayError> {
    let mut config = config.clone();
    config.kafka = once::one_off_kafka(&config.kafka, &identities[outbox.id.index()], "replay-dead-letters");
    let mut sink = KafkaSink::new(&config.kafka)
        .map_err(|e| RelayError::Kafka(format!("cannot create a producer: {e}")))?;
    let limit = Duration::from_millis(config.kafka.message_timeout_ms) + Duration::from_secs(10);
    let records = records.iter().map(|(letter, record)| (letter.id, record.clone())).collect();
    let sent = once::send_all(&mut sink, &config, identities, records, limit).await?;
    Ok(noted(sent, outcome))
}

/// Sends every record through the active session (see [`crate::delivery::live`]), and waits
/// for each; returns the letters Kafka acknowledged, and notes each of the others.
async fn send_live(
    config: &RelayConfig,
    leader: &Leader,
    records: &[(Letter, KafkaRecord)],
    outcome: &mut Outcome,
) -> Result<HashSet<i64>, RelayError> {
    let unserved = |e: crate::delivery::live::Unserved| RelayError::Standby(e.to_string());
    let quiet = leader.quiet(crate::ops::republish::QUIET_WAIT).await.map_err(unserved)?;
    let limit = Duration::from_millis(config.kafka.message_timeout_ms) + Duration::from_secs(10);
    let letters: Vec<i64> = records.iter().map(|(letter, _)| letter.id).collect();
    let delivered =
        quiet.send(records.iter().map(|(_, r)| r.clone()).collect(), limit).await.map_err(unserved)?;
    Ok(noted(letters.into_iter().zip(delivered).collect(), outcome))
}

/// The letters Kafka acknowledged; a line for each of the others.
fn noted(sent: Vec<(i64, Delivered)>, outcome: &mut Outcome) -> HashSet<i64> {
    let mut acked = HashSet::new();
    for (letter, sent) in sent {
        match sent {
            Delivered::Acked => {
                acked.insert(letter);
            }
            Delivered::Refused(why) => {
                outcome.refused += 1;
                outcome.lines.push(format!("letter {letter}: Kafka refused it: {why}; it stays"));
            }
            Delivered::Unacknowledged(why) => {
                outcome.refused += 1;
                outcome
                    .lines
                    .push(format!("letter {letter}: Kafka did not acknowledge it ({why}); it stays"));
            }
        }
    }
    acked
}

/// Removes the letters of `sent` and their events' rows (`delete_rows_sql`, by id).
async fn remove(
    tx: &Transaction<'_>,
    letters_table: &str,
    delete_rows_sql: &str,
    sent: &[&(Letter, KafkaRecord)],
) -> Result<(), RelayError> {
    let ids: Vec<i64> = sent.iter().map(|(l, _)| l.id).collect();
    let events: Vec<&str> = sent.iter().map(|(l, _)| l.event_id.as_str()).collect();
    tx.execute(&format!("DELETE FROM {letters_table} WHERE id = ANY($1)"), &[&ids]).await?;
    tx.execute(delete_rows_sql, &[&events]).await?;
    Ok(())
}
