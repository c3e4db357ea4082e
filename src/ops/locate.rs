//! `outbox-relay locate --id ID`: a delivery receipt for one event. Was it published, and where
//! (topic, partition, offset, the record's time)? Or is it pending, dead-lettered (with the
//! reason), missing, or unknown? It reads only.
//!
//! 1. PostgreSQL: the event's row (still in the table; unpublished in `mark` mode), its letter in
//!    the dead-letter table, and its bit in the record of what was published
//!    (`outbox_relay_published`: the block's topics and first publication too).
//! 2. Kafka: the topics it may be in (the row's, as the relay maps it; without a row, its
//!    block's), each partition read from the row's `created_at` (or the block's first
//!    publication) minus 5 minutes to its end as the read begins; this source's records are
//!    matched by their event id, whatever the record format, as `verify` matches them.
//! 3. Not in Kafka: dead-lettered if it has a letter; filtered if the outbox's transforms leave
//!    its row out (`filtered by <rule>`, as the configuration given judges it); pending while it may still be on its way
//!    (replication: the slot has not confirmed the WAL position read after the row; polling: the
//!    row is unpublished); missing when it is owed (the slot confirmed past it, the row is marked,
//!    or it was recorded as published); unknown when nothing knows the id.

use std::collections::BTreeSet;
use std::time::{Duration, Instant, SystemTime};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::message::{BorrowedMessage, Message};
use rdkafka::{Offset, TopicPartitionList};
use serde::Serialize;
use tokio_postgres::Client;

use super::verify::records::{CLOCK_SLACK, identity, read_to_end};
use crate::config::{AfterPublish, RelayConfig, SourceMode};
use crate::error::RelayError;
use crate::outboxes::Outbox;
use crate::record::format::Format;
use crate::sink::kafka::ReaderContext;
use crate::table::outbox_row;

/// What a Kafka request may take.
const REQUEST: Duration = Duration::from_secs(10);

/// Where the event stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum State {
    Published,
    /// The outbox's transforms leave it out: owed to no topic.
    Filtered,
    Pending,
    DeadLettered,
    Missing,
    Unknown,
}

/// One record of the event in Kafka.
#[derive(Debug, Clone, Serialize)]
pub struct Location {
    pub topic: String,
    pub partition: i32,
    pub offset: i64,
    /// The record's timestamp, milliseconds since the Unix epoch.
    pub timestamp_ms: Option<i64>,
    /// The same in UTC, RFC 3339.
    pub time: Option<String>,
}

/// The receipt.
#[derive(Debug, Serialize)]
pub struct Receipt {
    pub id: String,
    pub state: State,
    /// Every record of this source with the id (more than one: at-least-once duplicates).
    pub records: Vec<Location>,
    /// The row is in the outbox table.
    pub in_table: bool,
    /// Its dead letter's reason.
    pub dead_letter: Option<String>,
    /// The record of what was published has its id.
    pub recorded: bool,
    /// The topics read, and from when.
    pub topics: Vec<String>,
    pub since: Option<String>,
    /// Why, in a sentence.
    pub said: String,
}

impl super::Output for Receipt {
    /// Exit status: 0 published (or filtered out: nothing is owed), 3 pending, 1 otherwise.
    fn exit_code(&self) -> u8 {
        match self.state {
            State::Published | State::Filtered => 0,
            State::Pending => 3,
            _ => 1,
        }
    }

    fn text(&self) -> String {
        let mut out = format!("event {}: {}\n", self.id, self.said);
        for l in &self.records {
            let at = l.time.as_ref().map_or(String::new(), |time| format!(", record time {time}"));
            out += &format!("  {}[{}] offset {}{at}\n", l.topic, l.partition, l.offset);
        }
        if !self.topics.is_empty() {
            let since = self.since.as_deref().unwrap_or("their beginning");
            out += &format!("  read {} from {since}\n", self.topics.join(", "));
        }
        out
    }

    fn json(&self) -> Option<String> {
        Some(serde_json::to_string_pretty(self).expect("json"))
    }
}

/// `ms` since the Unix epoch as RFC 3339 in UTC, to the millisecond (PostgreSQL formats it).
async fn timestamp(client: &Client, ms: i64) -> Result<String, RelayError> {
    let sql = "SELECT to_char(to_timestamp($1::float8 / 1000) AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"')";
    Ok(client.query_one(sql, &[&(ms as f64)]).await?.get(0))
}

fn millis(at: SystemTime) -> i64 {
    at.duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default().as_millis() as i64
}

/// The receipt for event `id`, step by step as the module doc says.
pub async fn run(
    config: &RelayConfig,
    outbox: &Outbox,
    id: &str,
    wait: Duration,
) -> Result<Receipt, RelayError> {
    let (client, _) = crate::postgres::connect_primary(&config.postgres).await?;
    let table = &outbox.table;
    let id_type = table.id_type(&client).await?;
    let integer = matches!(id_type.as_str(), "bigint" | "integer" | "smallint");
    if integer && id.parse::<i64>().is_err() {
        return Err(RelayError::fatal(
            crate::error::FatalReason::Config,
            format!("--id {id:?}: the outbox's id column is {id_type}; give a number"),
        ));
    }
    // the WAL position after the row was read: the slot must confirm past it for the row to be owed
    let read_at: String = client.query_one("SELECT pg_current_wal_lsn()::text", &[]).await?.get(0);
    let known = known(&client, outbox, &id_type, id).await?;
    let dead_letter = letter(&client, outbox, id).await?;
    let since = known.since.map(|at| at.checked_sub(CLOCK_SLACK).unwrap_or(SystemTime::UNIX_EPOCH));
    let records = records(&client, (config, outbox), &known.topics, since, id).await?;
    let since_text = match since {
        Some(at) => Some(timestamp(&client, millis(at)).await?),
        None => None,
    };
    let mut receipt = Receipt {
        id: id.to_string(),
        state: State::Unknown,
        records,
        in_table: known.in_table,
        dead_letter,
        recorded: known.recorded,
        topics: known.topics.into_iter().collect(),
        since: since_text,
        said: String::new(),
    };
    (receipt.state, receipt.said) = match known.filtered {
        Some(rule) if receipt.records.is_empty() && receipt.dead_letter.is_none() => (
            State::Filtered,
            format!("filtered by {rule}: the outbox's transforms leave it out, so no topic is owed it"),
        ),
        _ => judge(config, &client, &receipt, known.unpublished, &read_at, wait).await?,
    };
    Ok(receipt)
}

/// What PostgreSQL knows of the event.
#[derive(Default)]
struct Known {
    in_table: bool,
    /// Its row is not yet marked published (polling `mark` mode).
    unpublished: bool,
    /// The rule of the outbox's transforms that filters its row out.
    filtered: Option<String>,
    /// The record of what was published has its id.
    recorded: bool,
    /// The topics it may be in, and since when.
    topics: BTreeSet<String>,
    since: Option<SystemTime>,
}

/// Step 1: the event's row (its topic as the relay maps it, its `created_at`, unpublished or
/// not) and its bit in the record of what was published (without a row, its block's topics and
/// first publication tell where and since when to look).
async fn known(client: &Client, outbox: &Outbox, id_type: &str, id: &str) -> Result<Known, RelayError> {
    let table = &outbox.table;
    let row = client.query_opt(&table.row_by_id_sql(id_type), &[&vec![id]]).await?;
    let mut known = Known { in_table: row.is_some(), ..Known::default() };
    if let Some(row) = &row {
        let (raw, created_at) = outbox_row(row)?;
        known.unpublished = row.get::<_, bool>(crate::table::col::UNPUBLISHED);
        match outbox.mapping.to_record(raw, created_at)? {
            Ok(record) => {
                known.topics.insert(record.topic);
            }
            Err(refused) => known.filtered = refused.filtered_by().map(String::from),
        }
        known.since = created_at;
    }
    let number = crate::published::numeric_id(id);
    let block = match number {
        Some(n) => crate::published::block_of(client, &table.display_name(), n).await?,
        None => None,
    };
    if let (Some(n), Some((bits, block_topics, first))) = (number, block) {
        known.recorded = bits.contains(n);
        if row.is_none() {
            known.topics.extend(block_topics);
            known.since = Some(first);
        }
    }
    Ok(known)
}

/// Step 2: every record of this source with event id `id` in `topics`, read from `since` on a
/// blocking thread, each with its record time.
async fn records(
    client: &Client,
    (config, outbox): (&RelayConfig, &Outbox),
    topics: &BTreeSet<String>,
    since: Option<SystemTime>,
    id: &str,
) -> Result<Vec<Location>, RelayError> {
    if topics.is_empty() {
        return Ok(Vec::new());
    }
    let (kafka, format, id) = (config.kafka.clone(), Format::of(&outbox.config), id.to_string());
    let source = match config.kafka.source_headers {
        true => Some(crate::readback::source_identity(client, &outbox.config).await?),
        false => None,
    };
    let topics: Vec<String> = topics.iter().cloned().collect();
    let mut found =
        tokio::task::spawn_blocking(move || find(&kafka, &topics, since, &format, source.as_deref(), &id))
            .await
            .map_err(|e| RelayError::Kafka(format!("reading Kafka failed: {e}")))?
            .map_err(|e| RelayError::Kafka(format!("reading Kafka: {e}")))?;
    for location in &mut found {
        if let Some(ms) = location.timestamp_ms {
            location.time = Some(timestamp(client, ms).await?);
        }
    }
    Ok(found)
}

/// The state, and why.
async fn judge(
    config: &RelayConfig,
    client: &Client,
    r: &Receipt,
    unpublished: bool,
    read_at: &str,
    wait: Duration,
) -> Result<(State, String), RelayError> {
    if let Some(first) = r.records.first() {
        let copies = match r.records.len() {
            1 => String::new(),
            n => format!(" ({n} records: at-least-once duplicates, the first counts)"),
        };
        return Ok((
            State::Published,
            format!("published to {}[{}] at offset {}{copies}", first.topic, first.partition, first.offset),
        ));
    }
    if let Some(reason) = &r.dead_letter {
        return Ok((
            State::DeadLettered,
            format!(
                "dead-lettered: {reason} (fix the cause, then outbox-relay replay-dead-letters --ids {})",
                r.id
            ),
        ));
    }
    if !r.in_table {
        return Ok(match r.recorded {
            true => (
                State::Missing,
                "recorded as published, its row deleted since, and no record of it in Kafka: removed by retention or \
                 deleted from the topic (to send it again, restore its row from a backup, then outbox-relay \
                 republish --ids ID; docs/operations.md, OutboxRelayEventsMissing)"
                    .replace("ID", &r.id),
            ),
            false => (State::Unknown, "no row, no dead letter and no record of it being published".into()),
        });
    }
    let owed = match config.source.mode {
        SourceMode::Polling if unpublished || config.polling.after_publish == AfterPublish::Delete => {
            Err("its row is not yet published (polling)".to_string())
        }
        SourceMode::Polling => Ok(()),
        SourceMode::Replication => slot_past(client, &config.replication.slot, read_at, wait).await?,
    };
    Ok(match owed {
        Ok(()) => (
            State::Missing,
            format!(
                "owed and not in Kafka: send it again with outbox-relay republish --ids {} (outbox-relay verify says \
                 which others are; docs/operations.md, OutboxRelayEventsMissing)",
                r.id
            ),
        ),
        Err(why) => (State::Pending, format!("pending: {why}")),
    })
}

/// The latest letter's reason for event `id`, if any.
async fn letter(client: &Client, outbox: &Outbox, id: &str) -> Result<Option<String>, RelayError> {
    let (sql, source_table) =
        (crate::dead_letter::reasons_sql(&outbox.dead_letter), outbox.table.display_name());
    match client.query_opt(&sql, &[&source_table, &vec![id]]).await {
        Ok(row) => Ok(row.map(|r| r.get::<_, String>(1))),
        // no dead-letter table: nothing was dead-lettered
        Err(e) if e.code() == Some(&tokio_postgres::error::SqlState::UNDEFINED_TABLE) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// Waits up to `wait` for `slot` to confirm `target`; `Err` says why the row may still be on its
/// way.
async fn slot_past(
    client: &Client,
    slot: &str,
    target: &str,
    wait: Duration,
) -> Result<Result<(), String>, RelayError> {
    let deadline = Instant::now() + wait;
    loop {
        let row = client
            .query_opt(
                "SELECT confirmed_flush_lsn >= $1::text::pg_lsn, active_pid IS NOT NULL FROM pg_replication_slots \
                 WHERE slot_name = $2 AND database = current_database()",
                &[&target, &slot],
            )
            .await?;
        let Some(row) = row else { return Ok(Ok(())) };
        if row.get::<_, Option<bool>>(0) == Some(true) {
            return Ok(Ok(()));
        }
        if !row.get::<_, bool>(1) {
            return Ok(Err(format!(
                "no relay streams from slot \"{slot}\", which has not confirmed past the row"
            )));
        }
        if Instant::now() >= deadline {
            return Ok(Err(format!("slot \"{slot}\" has not confirmed past the row yet (waited {wait:?})")));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Every record of this source (`source`: its header; None, any) in `topics` whose event id is
/// `id`, reading each partition from `since` (its beginning without) to its end as of now.
fn find(
    kafka: &crate::config::KafkaConfig,
    topics: &[String],
    since: Option<SystemTime>,
    format: &Format,
    source: Option<&str>,
    id: &str,
) -> Result<Vec<Location>, KafkaError> {
    let mut found = Vec::new();
    scan(kafka, topics, since, format, source, |message, event_id| {
        if event_id == id {
            found.push(Location {
                topic: message.topic().to_string(),
                partition: message.partition(),
                offset: message.offset(),
                timestamp_ms: message.timestamp().to_millis(),
                time: None,
            });
        }
    })?;
    Ok(found)
}

/// Reads each partition of `topics` from `since` (its beginning without) to its end as of now,
/// with committed records only, calling `seen` with each record of this source (`source`: its
/// header; None, any) and its event id as `format` reads it.
pub(crate) fn scan(
    kafka: &crate::config::KafkaConfig,
    topics: &[String],
    since: Option<SystemTime>,
    format: &Format,
    source: Option<&str>,
    mut seen: impl FnMut(&BorrowedMessage<'_>, &str),
) -> Result<(), KafkaError> {
    let consumer: BaseConsumer<ReaderContext> =
        super::verify::records::reader_config(kafka).create_with_context(ReaderContext)?;
    crate::sink::kafka::serve_token_request(&consumer);
    let idle_limit = Duration::from_millis(kafka.message_timeout_ms.max(30_000));
    for topic in topics {
        let Some(assignment) = assignment(&consumer, topic, since)? else { continue };
        read_to_end(&consumer, topic, &assignment, idle_limit, |message| {
            if let Some(identity) = identity(message, format, source) {
                seen(message, &identity.id);
            }
        })?;
    }
    Ok(())
}

/// Every partition of `topic` from `since` (by record time; its beginning without); None when
/// the topic does not exist.
fn assignment(
    consumer: &BaseConsumer<ReaderContext>,
    topic: &str,
    since: Option<SystemTime>,
) -> Result<Option<TopicPartitionList>, KafkaError> {
    let metadata = consumer.fetch_metadata(Some(topic), REQUEST)?;
    let Some(found) = metadata.topics().iter().find(|t| t.name() == topic) else { return Ok(None) };
    if found.error().is_some() || found.partitions().is_empty() {
        return Ok(None);
    }
    let start = since.map_or(Offset::Beginning, |at| Offset::Offset(millis(at)));
    let mut request = TopicPartitionList::new();
    for p in found.partitions() {
        request.add_partition_offset(topic, p.id(), start)?;
    }
    Ok(Some(match since {
        None => request,
        Some(_) => consumer.offsets_for_times(request, REQUEST)?,
    }))
}
