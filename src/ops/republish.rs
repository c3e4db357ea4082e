//! `outbox-relay republish`: sends chosen events again, for consumers that lost their state (a
//! restored database, a reset consumer group, a bug that dropped what it read). Chosen by
//! aggregate, by ids, or by a `created_at` window, from the rows the outbox table still holds.
//!
//! Invariants:
//! - an event Kafka still holds is sent again as it was first written: the same key, value and
//!   headers (the `id`, the relay's source and position headers, the row's own), to the same
//!   partition, plus `outbox_relay_republished`; a consumer that deduplicates by id or position
//!   applies it once. One Kafka no longer holds (retention) is sent as the relay maps its row now,
//!   by its key's partition, without a position;
//! - events go out in their original order (by id, as the relay published them), each partition's
//!   in send order (the idempotent producer keeps it), through the daemon's delivery stage in a
//!   one-off session ([`crate::delivery::once`]: its sink, classification and, with
//!   `kafka.transactional`, one Kafka transaction under a `transactional.id` of its own), and the
//!   command waits for every acknowledgement; one Kafka refuses is named and the exit code is 1;
//! - offline ([`run`], the command with no relay running) it refuses to run while any relay of
//!   this outbox is connected (active or standby): a relay publishing newer events meanwhile
//!   would put the old ones after them;
//! - live ([`live`], the admin API, the signal table, the command beside a running relay) the
//!   active session carries it out ([`crate::delivery::live`]): it stops reading and settles
//!   first, so every event it sent is in Kafka when the originals are read; only events Kafka
//!   holds are sent again (one it does not hold yet is the stream's to send, after them), as
//!   first written, in each partition's original order, through the session's own stage and
//!   sink, with nothing of the stream between them; then the stream reads on. So in each
//!   partition the copies follow every original they copy and precede every record the stream
//!   sends after them;
//! - `--dry-run` sends nothing and says what it would send.

use std::collections::{BTreeSet, HashMap};
use std::time::{Duration, SystemTime};

use rdkafka::message::{Headers, Message};
use tokio_postgres::Client;

use super::locate;
use super::verify::records::CLOCK_SLACK;
use crate::config::{OutboxConfig, RelayConfig};
use crate::delivery::live::Leader;
use crate::delivery::once::{self, Delivered};
use crate::error::{FatalReason, RelayError};
use crate::outboxes::Outbox;
use crate::record::format::Format;
use crate::record::{AsWritten, KafkaRecord, Mapping, OutboxRow};
use crate::sink::kafka::{KafkaSink, REPUBLISHED_HEADER};
use crate::table::{OutboxTable, outbox_row};

/// Which events.
#[derive(Debug, Clone, Default)]
pub struct Options {
    /// `aggregate_id`, optionally with `aggregate_type` (`--aggregate-type`).
    pub aggregate: Option<(Option<String>, String)>,
    pub ids: Vec<String>,
    /// `created_at` in [since, until) as PostgreSQL reads a timestamptz.
    pub since: Option<String>,
    pub until: Option<String>,
    pub dry_run: bool,
}

/// One line per event, and the counts.
#[derive(Debug, Default)]
pub struct Outcome {
    pub lines: Vec<String>,
    pub sent: u64,
    /// Events Kafka refused or ids with no row: the exit code is 1.
    pub refused: u64,
    /// Live: chosen events Kafka does not hold (yet): not sent (the stream sends them after).
    pub not_in_kafka: u64,
    /// Nothing was sent: a line per event says what would be.
    pub dry_run: bool,
}

impl super::Output for Outcome {
    /// The events' lines, then the counts.
    fn text(&self) -> String {
        let mut out: String = self.lines.iter().map(|line| format!("{line}\n")).collect();
        out += &match self.dry_run {
            true => format!("dry run: nothing sent; {} event(s) cannot be\n", self.refused),
            false => format!("sent {} event(s) again; {} could not be\n", self.sent, self.refused),
        };
        if self.not_in_kafka > 0 {
            out += &format!("{} chosen event(s) Kafka does not hold were not sent\n", self.not_in_kafka);
        }
        out
    }

    fn exit_code(&self) -> u8 {
        if self.refused == 0 { 0 } else { super::EXIT_FAILURE }
    }
}

/// A record to send again.
#[derive(Debug)]
struct Again {
    id: String,
    record: KafkaRecord,
    /// Where the original lies (partition, offset), when Kafka still holds it.
    original: Option<(i32, i64)>,
}

/// An event's first record, as Kafka holds it.
#[derive(Debug, Clone)]
struct Original {
    topic: String,
    partition: i32,
    offset: i64,
    key: Option<Vec<u8>>,
    value: Option<Vec<u8>>,
    headers: Vec<(String, Option<Vec<u8>>)>,
}

/// How long a live republish waits for the active session to stop and settle.
pub(crate) const QUIET_WAIT: Duration = Duration::from_secs(30);

/// Sends the chosen events again with no relay running (or says what it would send).
pub async fn run(config: &RelayConfig, outbox: &Outbox, options: &Options) -> Result<Outcome, RelayError> {
    republish(config, outbox, options, None).await
}

/// Sends the chosen events again through this process's active session, beside its stream (see
/// the module doc); `Err` (standby-like) when no active session served it.
pub(crate) async fn live(
    config: &RelayConfig,
    outbox: &Outbox,
    options: &Options,
    leader: &Leader,
) -> Result<Outcome, RelayError> {
    republish(config, outbox, options, Some(leader)).await
}

/// Step by step: (live: the session stops and settles,) the rows, the records they map to, the
/// originals Kafka holds, then the records to send.
async fn republish(
    config: &RelayConfig,
    outbox: &Outbox,
    options: &Options,
    leader: Option<&Leader>,
) -> Result<Outcome, RelayError> {
    let (client, _) = crate::postgres::connect_primary(&config.postgres).await?;
    let table = &outbox.table;
    let id_type = table.id_type(&client).await?;
    if !options.dry_run && leader.is_none() {
        refuse_beside_a_relay(&client, config).await?;
    }
    // live: nothing is read from here on until the records are sent (or this gives up)
    let quiet = match leader.filter(|_| !options.dry_run) {
        Some(leader) => Some(leader.quiet(QUIET_WAIT).await.map_err(|e| RelayError::Standby(e.to_string()))?),
        None => None,
    };
    let mut outcome = Outcome { dry_run: options.dry_run, ..Outcome::default() };
    let rows = chosen_rows(&client, table, &id_type, options, &mut outcome).await?;
    if rows.is_empty() {
        let deleting = config.source.mode == crate::config::SourceMode::Polling
            && config.polling.after_publish == crate::config::AfterPublish::Delete;
        outcome.lines.push(match deleting {
            true => "no event chosen: nothing to send (polling.after_publish = \"delete\" leaves no published row to \
                     send again; \"mark\" keeps them)"
                .into(),
            false => "no event chosen: nothing to send".into(),
        });
        return Ok(outcome);
    }
    // the originals are read from the first row's time
    let since = rows.iter().filter_map(|(_, _, created_at)| *created_at).min();
    let records = mapped(&outbox.mapping, rows, &mut outcome)?;
    // (the source names the records, and a Kafka transaction's id)
    let kafka = &config.kafka;
    let identities = match kafka.source_headers || kafka.transactional {
        true => crate::readback::source_identities(&client, config).await?,
        false => Vec::new(),
    };
    let header_source = identities.get(outbox.id.index()).filter(|_| kafka.source_headers).cloned();
    let originals = read_originals((config, outbox), &records, since, header_source).await?;
    let again = match leader {
        Some(_) => live_to_send(records, originals, &mut outcome),
        None => to_send(&outbox.config, records, originals, &mut outcome),
    };
    if options.dry_run {
        for a in &again {
            outcome.lines.push(format!("event {}: would send {}", a.id, a.describe()));
        }
        return Ok(outcome);
    }
    match quiet {
        Some(quiet) => send_live(config, quiet, again, &mut outcome).await?,
        None => send(config, (&identities, outbox), again, &mut outcome).await?,
    }
    Ok(outcome)
}

/// Live: what to send, each original as first written (plus the republished header), in each
/// partition's original order; a chosen event Kafka does not hold is not sent: the stream has
/// not sent it yet (it will, after these), or retention removed it (republish it offline).
fn live_to_send(
    records: Vec<(String, KafkaRecord)>,
    mut originals: HashMap<String, Original>,
    outcome: &mut Outcome,
) -> Vec<Again> {
    let stamp = republished_stamp();
    let mut again = Vec::with_capacity(records.len());
    for (id, record) in records {
        let Some(original) = originals.remove(&id) else {
            outcome.not_in_kafka += 1;
            outcome.lines.push(format!(
                "event {id}: not sent: Kafka does not hold it (not published yet: the stream sends it after these; \
                 or removed by retention: republish it with the relays stopped to send it as its row maps now)"
            ));
            continue;
        };
        match as_first_written(record, original, &stamp) {
            Ok((record, at)) => again.push(Again { id, record, original: Some(at) }),
            Err(why) => {
                outcome.refused += 1;
                outcome.lines.push(format!("event {id}: {why}"));
            }
        }
    }
    // each partition's copies in the order its originals were written
    again.sort_by(|a, b| (&a.record.topic, a.original).cmp(&(&b.record.topic, b.original)));
    again
}

/// Live: sends `again` through the quiet session and notes what became of each.
async fn send_live(
    config: &RelayConfig,
    quiet: crate::delivery::live::Quiet,
    again: Vec<Again>,
    outcome: &mut Outcome,
) -> Result<(), RelayError> {
    let limit = Duration::from_millis(config.kafka.message_timeout_ms) + Duration::from_secs(10);
    let described: Vec<(String, String)> = again.iter().map(|a| (a.id.clone(), a.describe())).collect();
    let records = again.into_iter().map(|a| a.record).collect();
    let delivered = quiet.send(records, limit).await.map_err(|e| RelayError::Standby(e.to_string()))?;
    for ((id, describe), delivered) in described.iter().zip(delivered) {
        note(outcome, id, describe, delivered);
    }
    Ok(())
}

/// One event's line and count.
fn note(outcome: &mut Outcome, id: &str, describe: &str, delivered: Delivered) {
    match delivered {
        Delivered::Acked => {
            outcome.sent += 1;
            outcome.lines.push(format!("event {id}: sent {describe}"));
        }
        Delivered::Refused(why) => {
            outcome.refused += 1;
            outcome.lines.push(format!("event {id}: Kafka refused it: {why}"));
        }
        Delivered::Unacknowledged(why) => {
            outcome.refused += 1;
            outcome.lines.push(format!("event {id}: Kafka did not acknowledge it ({why})"));
        }
    }
}

/// The records the rows map to now, each with its event id; a row that cannot be published is
/// refused.
fn mapped(
    mapping: &Mapping,
    rows: Vec<(String, OutboxRow, Option<SystemTime>)>,
    outcome: &mut Outcome,
) -> Result<Vec<(String, KafkaRecord)>, RelayError> {
    let mut records = Vec::new();
    for (id, raw, created_at) in rows {
        match mapping.to_record(raw, created_at)? {
            Ok(record) => records.push((id, record)),
            Err(refused) => {
                outcome.refused += 1;
                outcome.lines.push(format!("event {id}: cannot be published: {}", refused.reason));
            }
        }
    }
    Ok(records)
}

/// The originals of `records` Kafka still holds, read on a blocking thread from the first row's
/// time (less the clock slack) to each partition's end.
async fn read_originals(
    (config, outbox): (&RelayConfig, &Outbox),
    records: &[(String, KafkaRecord)],
    since: Option<SystemTime>,
    source: Option<String>,
) -> Result<HashMap<String, Original>, RelayError> {
    let topics: Vec<String> =
        records.iter().map(|(_, r)| r.topic.clone()).collect::<BTreeSet<_>>().into_iter().collect();
    let wanted: HashMap<String, usize> =
        records.iter().enumerate().map(|(i, (id, _))| (id.clone(), i)).collect();
    let (kafka, format) = (config.kafka.clone(), Format::of(&outbox.config));
    let from = since.map(|at| at.checked_sub(CLOCK_SLACK).unwrap_or(SystemTime::UNIX_EPOCH));
    tokio::task::spawn_blocking(move || originals(&kafka, &topics, from, &format, source, &wanted))
        .await
        .map_err(|e| RelayError::Kafka(format!("reading Kafka failed: {e}")))?
}

/// What to send, in the records' order: each original as first written, plus the republished
/// header; a record Kafka no longer holds as its row maps now (the sink gives it this source's
/// header), in the relay's own format only, else refused.
fn to_send(
    outbox: &OutboxConfig,
    records: Vec<(String, KafkaRecord)>,
    mut originals: HashMap<String, Original>,
    outcome: &mut Outcome,
) -> Vec<Again> {
    let stamp = republished_stamp();
    // a record Kafka no longer holds is made again only in the relay's own format: the others'
    // values are made by the sink (CloudEvents' envelope, a registry's schema id)
    let remappable = outbox.format == crate::config::RecordFormat::Raw && outbox.registry.is_none();
    let mut again = Vec::with_capacity(records.len());
    for (id, mut record) in records {
        let refused = match originals.remove(&id) {
            Some(original) => match as_first_written(record, original, &stamp) {
                Ok((record, at)) => {
                    again.push(Again { id, record, original: Some(at) });
                    continue;
                }
                Err(why) => why,
            },
            None if remappable => {
                record.row_headers.push((REPUBLISHED_HEADER.to_string(), stamp.clone()));
                again.push(Again { id, record, original: None });
                continue;
            }
            None => format!(
                "Kafka no longer holds it, and outbox.format {:?} records are made by the relay's sink: recreate the \
                 slot (outbox-relay setup --recreate-slot) to send it as the relay does",
                outbox.format
            ),
        };
        outcome.refused += 1;
        outcome.lines.push(format!("event {id}: {refused}"));
    }
    again
}

/// `record` as its `original` was first written (its topic, partition, key, value and headers,
/// plus the republished header `stamp`), and where the original lies; or why it cannot be.
fn as_first_written(
    record: KafkaRecord,
    original: Original,
    stamp: &str,
) -> Result<(KafkaRecord, (i32, i64)), String> {
    let Original { topic, partition, offset, key, value, mut headers } = original;
    let at = format!("{topic}[{partition}] offset {offset}");
    let key = match key.map(String::from_utf8) {
        Some(Ok(key)) => key,
        _ => {
            return Err(format!(
                "its original ({at}) has no key, or one that is not UTF-8: the relay never writes such"
            ));
        }
    };
    let Some(payload) = value else {
        return Err(format!("its original ({at}) has no value: the relay never writes such"));
    };
    headers.push((REPUBLISHED_HEADER.to_string(), Some(stamp.as_bytes().to_vec())));
    let as_written = Some(Box::new(AsWritten { partition, headers }));
    Ok((KafkaRecord { topic, key, payload, position: None, as_written, ..record }, (partition, offset)))
}

impl Again {
    fn describe(&self) -> String {
        match self.original {
            Some((partition, offset)) => {
                format!("to {}[{partition}] as first written (offset {offset})", self.record.topic)
            }
            None => format!("to {} as its row maps now (Kafka no longer holds it)", self.record.topic),
        }
    }
}

/// Fails when any relay of this outbox is connected: it may publish newer events while the old
/// ones are sent again, putting them after the newer ones.
async fn refuse_beside_a_relay(client: &Client, config: &RelayConfig) -> Result<(), RelayError> {
    let rows = client
        .query(
            "SELECT pid, coalesce(client_addr::text, 'a local socket'), backend_type FROM pg_stat_activity \
             WHERE application_name = $1 AND (datname = current_database() OR datname IS NULL) \
               AND pid <> pg_backend_pid()",
            &[&config.postgres.application_name],
        )
        .await?;
    if rows.is_empty() {
        return Ok(());
    }
    let sessions: Vec<String> = rows
        .iter()
        .map(|r| {
            format!("pid {} from {} ({})", r.get::<_, i32>(0), r.get::<_, String>(1), r.get::<_, String>(2))
        })
        .collect();
    Err(RelayError::fatal(
        FatalReason::Config,
        format!(
            "a relay of this outbox is connected ({} named {:?}): events it publishes meanwhile would come before the \
             ones sent again -- stop every instance (scale the StatefulSet to 0), republish, then start them; \
             --dry-run works beside it",
            sessions.join(", "),
            config.postgres.application_name
        ),
    ))
}

/// The rows chosen, in id order: (id, row, created_at). Ids with no row are refused.
async fn chosen_rows(
    client: &Client,
    table: &OutboxTable,
    id_type: &str,
    options: &Options,
    outcome: &mut Outcome,
) -> Result<Vec<(String, OutboxRow, Option<SystemTime>)>, RelayError> {
    let (aggregate_type, aggregate_id) = match &options.aggregate {
        Some((t, id)) => (t.clone(), Some(id.clone())),
        None => (None, None),
    };
    let ids: Option<Vec<String>> = (!options.ids.is_empty()).then(|| options.ids.clone());
    let sql = table.chosen_sql(id_type);
    let rows = client
        .query(&sql, &[&aggregate_type, &aggregate_id, &ids, &options.since, &options.until])
        .await
        .map_err(|e| match e.code() {
            Some(code) if code.code().starts_with("22") => RelayError::fatal(
                FatalReason::Config,
                format!(
                    "--since/--until/--ids: PostgreSQL cannot read them ({e}); e.g. \"2026-12-01 10:00+00\""
                ),
            ),
            _ => e.into(),
        })?;
    let mut chosen = Vec::with_capacity(rows.len());
    for row in &rows {
        let (raw, created_at) = outbox_row(row)?;
        chosen.push((raw.id.clone().unwrap_or_default(), raw, created_at));
    }
    for id in &options.ids {
        if !chosen.iter().any(|(found, _, _)| found == id) {
            outcome.refused += 1;
            outcome
                .lines
                .push(format!("event {id}: no row in {} (deleted, or never written)", table.display_name()));
        }
    }
    Ok(chosen)
}

/// The first record of each wanted id in `topics`, as first written.
fn originals(
    kafka: &crate::config::KafkaConfig,
    topics: &[String],
    since: Option<SystemTime>,
    format: &Format,
    source: Option<String>,
    wanted: &HashMap<String, usize>,
) -> Result<HashMap<String, Original>, RelayError> {
    let mut found: HashMap<String, Original> = HashMap::new();
    locate::scan(kafka, topics, since, format, source.as_deref(), |m, id| {
        if !wanted.contains_key(id) || found.contains_key(id) {
            return;
        }
        let headers = m
            .headers()
            .map(|h| h.iter().map(|h| (h.key.to_string(), h.value.map(<[u8]>::to_vec))).collect())
            .unwrap_or_default();
        found.insert(
            id.to_string(),
            Original {
                topic: m.topic().to_string(),
                partition: m.partition(),
                offset: m.offset(),
                key: m.key().map(<[u8]>::to_vec),
                value: m.payload().map(<[u8]>::to_vec),
                headers,
            },
        );
    })
    .map_err(|e| RelayError::Kafka(format!("reading Kafka: {e}")))?;
    Ok(found)
}

/// Sends `again` in order through a one-off session of the delivery stage (the daemon's sink,
/// classification and Kafka transactions) and waits for each; `source`: this outbox's identity.
async fn send(
    config: &RelayConfig,
    (identities, outbox): (&[String], &Outbox),
    again: Vec<Again>,
    outcome: &mut Outcome,
) -> Result<(), RelayError> {
    let mut config = config.clone();
    if let Some(source) = identities.get(outbox.id.index()) {
        config.kafka = once::one_off_kafka(&config.kafka, source, "republish");
    }
    let mut sink = KafkaSink::new(&config.kafka)
        .map_err(|e| RelayError::Kafka(format!("cannot create a producer: {e}")))?;
    let limit = Duration::from_millis(config.kafka.message_timeout_ms) + Duration::from_secs(10);
    let described: Vec<(String, String)> = again.iter().map(|a| (a.id.clone(), a.describe())).collect();
    let records = again.into_iter().enumerate().map(|(i, a)| (i, a.record)).collect();
    for (i, delivered) in once::send_all(&mut sink, &config, identities, records, limit).await? {
        let (id, describe) = &described[i];
        note(outcome, id, describe, delivered);
    }
    Ok(())
}

/// The `outbox_relay_republished` header's value: now, in Unix milliseconds.
fn republished_stamp() -> String {
    SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default().as_millis().to_string()
}
