//! `outbox-relay verify`: does Kafka hold what the outbox holds, once and in order?
//!
//! 1. The rows of the window (`created_at` in [since, until), or all) are read as a stream, each
//!    mapped to the record the relay makes of it, kept as a 16-byte fingerprint
//!    ([`expected`]).
//! 2. Pending rows are told apart: in replication mode verify waits (up to `--wait-secs`) for
//!    the slot to confirm the WAL position read after the rows, past every row it saw; when
//!    the slot gets there every row read is owed, and one Kafka lacks is missing. In polling
//!    `mark` mode a row still unpublished is pending. Polling `delete` mode keeps no rows to
//!    compare and is refused.
//! 3. Every topic the rows route to is read from the window's start to its end, committed
//!    records only ([`records`]); this source's records are matched by their `id` header.
//! 4. Ids Kafka holds that the window does not are looked up in the whole table: a row outside
//!    the window is fine, no row at all is unexpected.
//!
//! It changes nothing, anywhere: no offsets are committed, no row is touched.

pub mod expected;
pub mod records;
pub mod report;
pub mod watch;

use std::time::{Duration, Instant, SystemTime};

use tokio_postgres::Client;

use crate::config::{AfterPublish, RelayConfig, SourceMode};
use crate::delivery::record::Mapping;
use crate::delivery::record::format::Format;
use crate::published::{IdBits, Record};
use crate::table::{OutboxTable, outbox_row};
use expected::{Expected, fingerprint};
use records::{Located, Reader};
use report::Report;

/// Rows fetched from the window at a time.
const ROW_BATCH: i32 = 10_000;

/// What to compare, and how much to show.
#[derive(Debug, Clone)]
pub struct Options {
    /// As PostgreSQL reads a timestamptz (`2026-12-01 00:00+00`, `today`), or `<n>s|m|h|d` ago.
    pub since: Option<String>,
    pub until: Option<String>,
    /// How long to wait for the slot to confirm what verify read.
    pub wait: Duration,
    /// Ids shown per class.
    pub show: usize,
}

/// Why verify could not give an answer.
#[derive(Debug, thiserror::Error)]
pub enum VerifyError {
    /// The question cannot be asked of this configuration or with these arguments.
    #[error("{0}")]
    Usage(String),
    #[error("{0}")]
    Failed(String),
}

impl From<VerifyError> for super::Failure {
    /// A usage error exits 2 as it is; any other exits 1, saying verify could not finish.
    fn from(e: VerifyError) -> Self {
        match e {
            VerifyError::Usage(_) => super::Failure::usage(e),
            VerifyError::Failed(_) => super::Failure::failed(format!("verify could not finish: {e}")),
        }
    }
}

impl From<crate::error::RelayError> for VerifyError {
    fn from(e: crate::error::RelayError) -> Self {
        VerifyError::Failed(e.to_string())
    }
}

impl From<tokio_postgres::Error> for VerifyError {
    fn from(e: tokio_postgres::Error) -> Self {
        crate::error::RelayError::from(e).into()
    }
}

pub async fn run(config: &RelayConfig, options: &Options) -> Result<Report, VerifyError> {
    let started = Instant::now();
    let (mut client, _) = crate::postgres::connect_primary(&config.postgres).await?;
    let table = OutboxTable::new(config);
    let (since, until) = window(&client, &table, options).await?;
    let source = crate::sink::dedup::source_identity(&client, config).await?;
    let mut report = Report {
        table: table.display_name(),
        source: source.clone(),
        since: described(&client, since).await?,
        until: described(&client, until).await?,
        ..Report::default()
    };
    let mut expected =
        read_rows(&mut client, &table, config, (since, until), options.show, &mut report).await?;
    // read before the slot's target position: every id recorded by then was committed before it
    let touched_since =
        since.map(|at| at.checked_sub(records::CLOCK_SLACK).unwrap_or(SystemTime::UNIX_EPOCH));
    let record = Record::load(&client, &table.display_name(), touched_since, since).await?;
    let record_bytes = record.published.memory_bytes() + record.recent.memory_bytes();
    let caught_up = match config.source.mode {
        SourceMode::Replication => slot_caught_up(&client, &config.replication.slot, options.wait).await?,
        // a row delete mode keeps is one not yet published
        SourceMode::Polling if config.polling.after_publish == AfterPublish::Delete => {
            Err("not yet published (polling.after_publish = \"delete\" keeps only unpublished rows)".into())
        }
        SourceMode::Polling => Ok(()),
    };
    // polling records an id once Kafka acknowledged it; replication before the slot confirms it
    let recorded_owed = config.source.mode == SourceMode::Polling || caught_up.is_ok();
    let reader_source = config.kafka.source_headers.then_some(source);
    // rows deleted after publishing leave their topics in the record only
    expected.topics.extend(record.topics);
    report.topics = expected.topics.iter().cloned().collect();
    let format = Format::of(&config.outbox);
    let whole = compared_whole(&config.outbox);
    let reader =
        Reader::new(&config.kafka, reader_source, (format, whole), since, record.published, options.show)
            .map_err(|e| VerifyError::Failed(format!("cannot create a Kafka client: {e}")))?;
    let (scan, expected) = tokio::task::spawn_blocking(move || {
        let scan = reader.scan(&mut expected);
        (scan, expected)
    })
    .await
    .map_err(|e| VerifyError::Failed(format!("reading Kafka failed: {e}")))?;
    let mut scan = scan.map_err(VerifyError::Failed)?;
    report.partitions = scan.partitions;
    report.records = scan.records;
    report.records_of_other_sources = scan.foreign;
    report.missing_topics = std::mem::take(&mut scan.missing_topics);
    report.out_of_order = std::mem::take(&mut scan.out_of_order);
    report.published_elsewhere = scan.published_elsewhere;
    report.replayed = scan.replayed;
    report.record_kept = record.kept;
    let lookup = Lookup {
        client: &client,
        table: &table,
        id_type: table.id_type(&client).await?,
        letters: crate::dead_letter::reasons_sql(config),
    };
    classify_rows(&lookup, &expected, caught_up, options.show, &mut report).await?;
    // what was published while Kafka was read is recorded by the time the slot confirms past it
    let settled = match config.source.mode {
        SourceMode::Replication if !scan.outside.is_empty() => {
            slot_caught_up(&client, &config.replication.slot, options.wait).await?
        }
        _ => Ok(()),
    };
    classify_outside(&lookup, &scan.outside, settled, options.show, &mut report).await?;
    let floor = if since.is_some() { Some(0) } else { scan.floor() };
    if floor.is_none() && record.kept {
        report.record_unchecked = Some(format!(
            "ids recorded as published whose rows are gone were not checked: retention removed every record of {} \
             (or every one of this source there); give --since within the topics' retention",
            scan.emptied().first().map_or("a partition", String::as_str)
        ));
    }
    classify_recorded(
        &lookup,
        &expected,
        &record.recent,
        &scan,
        floor,
        recorded_owed,
        options.show,
        &mut report,
    )
    .await?;
    report.memory_bytes = expected.memory_bytes() + record_bytes;
    report.seconds = started.elapsed().as_secs_f64();
    Ok(report)
}

/// The window's bounds as timestamps, read by PostgreSQL (so every format it accepts works).
async fn window(
    client: &Client,
    table: &OutboxTable,
    options: &Options,
) -> Result<(Option<SystemTime>, Option<SystemTime>), VerifyError> {
    if table.created_at_column().is_empty() && (options.since.is_some() || options.until.is_some()) {
        return Err(VerifyError::Usage(
            "--since and --until need the outbox's created_at column (outbox.columns.created_at is \"\")"
                .into(),
        ));
    }
    let bound = async |flag: &str, value: &Option<String>| -> Result<Option<SystemTime>, VerifyError> {
        let Some(value) = value else { return Ok(None) };
        let sql = match relative(value) {
            Some(_) => "SELECT now() - $1::text::interval",
            None => "SELECT $1::text::timestamptz",
        };
        let text = relative(value).unwrap_or_else(|| value.clone());
        let row = client.query_one(sql, &[&text]).await.map_err(|e| {
            VerifyError::Usage(format!(
                "{flag} {value:?}: not a time ({e}); give e.g. \"2026-12-01 10:00:00+00\", \"today\" or \"2h\" (ago)"
            ))
        })?;
        Ok(Some(row.get(0)))
    };
    let since = bound("--since", &options.since).await?;
    let until = bound("--until", &options.until).await?;
    Ok((since, until))
}

/// `30m` -> `30 minutes`: a span back from now; None for anything else.
fn relative(value: &str) -> Option<String> {
    let unit = match value.chars().last()? {
        's' => "seconds",
        'm' => "minutes",
        'h' => "hours",
        'd' => "days",
        _ => return None,
    };
    let number = &value[..value.len() - 1];
    number.parse::<u32>().ok().map(|n| format!("{n} {unit}"))
}

async fn described(client: &Client, at: Option<SystemTime>) -> Result<Option<String>, VerifyError> {
    let Some(at) = at else { return Ok(None) };
    let row = client.query_one("SELECT $1::timestamptz::text", &[&at]).await?;
    Ok(Some(row.get(0)))
}

/// Streams the rows of the window into their expected records.
async fn read_rows(
    client: &mut Client,
    table: &OutboxTable,
    config: &RelayConfig,
    window: (Option<SystemTime>, Option<SystemTime>),
    show: usize,
    report: &mut Report,
) -> Result<Expected, VerifyError> {
    let mapping = Mapping::new(&config.outbox);
    let whole = compared_whole(&config.outbox);
    // a portal read in batches: the rows are never all in memory, whatever the window
    let txn = client.build_transaction().read_only(true).start().await?;
    let portal = txn.bind(&table.window_sql(), &[&window.0, &window.1]).await?;
    let mut expected = Expected::default();
    loop {
        let rows = txn.query_portal(&portal, ROW_BATCH).await?;
        for row in &rows {
            let (raw, created_at) = outbox_row(row)?;
            let id = raw.id.clone().unwrap_or_default();
            match mapping.to_record(raw, created_at).map_err(|e| VerifyError::Failed(e.to_string()))? {
                Ok(event) => {
                    let print = match &event.formatted {
                        _ if whole => {
                            let headers = event.headers().map(|(k, v)| (k, v.as_bytes()));
                            fingerprint(&event.topic, event.key.as_bytes(), &event.payload, headers)
                        }
                        _ => {
                            let written = std::iter::once(("type", event.written_type().as_bytes()));
                            fingerprint(&event.topic, event.key.as_bytes(), event.written_payload(), written)
                        }
                    };
                    expected.add(&event.id, &event.topic, print);
                }
                Err(refused) => report.unpublishable.note(show, || format!("{id} ({})", refused.reason)),
            }
        }
        if rows.len() < ROW_BATCH as usize {
            break;
        }
    }
    txn.commit().await?;
    report.rows = expected.rows + report.unpublishable.count;
    Ok(expected)
}

/// Waits up to `wait` for `slot` to confirm the WAL position after the rows were read. An
/// error says why rows Kafka lacks may still be on their way: the slot did not get there in
/// time, or no relay streams from it (then waiting is pointless).
async fn slot_caught_up(
    client: &Client,
    slot: &str,
    wait: Duration,
) -> Result<Result<(), String>, VerifyError> {
    let target: String = client.query_one("SELECT pg_current_wal_lsn()::text", &[]).await?.get(0);
    let deadline = Instant::now() + wait;
    loop {
        let row = client
            .query_opt(
                "SELECT confirmed_flush_lsn::text, confirmed_flush_lsn >= $1::text::pg_lsn, active_pid IS NOT NULL \
                 FROM pg_replication_slots WHERE slot_name = $2 AND database = current_database()",
                &[&target, &slot],
            )
            .await?;
        // no slot: nothing is on its way, whatever Kafka lacks is missing
        let Some(row) = row else { return Ok(Ok(())) };
        if row.get::<_, Option<bool>>(1) == Some(true) {
            return Ok(Ok(()));
        }
        let confirmed: Option<String> = row.get(0);
        let confirmed = confirmed.as_deref().unwrap_or("nothing");
        if !row.get::<_, bool>(2) {
            return Ok(Err(format!(
                "no relay streams from slot \"{slot}\", which confirmed {confirmed}, behind the WAL ({target}): \
                 rows Kafka lacks may be owed by the slot; start the relay and verify again"
            )));
        }
        if Instant::now() >= deadline {
            return Ok(Err(format!(
                "slot \"{slot}\" had confirmed {confirmed} and not yet {target} (the WAL position after the \
                 rows were read) after {wait:?}: rows Kafka lacks may still be on their way"
            )));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// What the lookups in PostgreSQL need.
struct Lookup<'a> {
    client: &'a Client,
    table: &'a OutboxTable,
    id_type: String,
    /// `$1` the source table, `$2` event ids: those dead-lettered, with the reason.
    letters: String,
}

/// Rows Kafka held more than once or differently, and rows it lacks: dead-lettered, missing or
/// pending.
async fn classify_rows(
    lookup: &Lookup<'_>,
    expected: &Expected,
    caught_up: Result<(), String>,
    show: usize,
    report: &mut Report,
) -> Result<(), VerifyError> {
    let mut unseen = Vec::new();
    for (id, slot) in expected.slots() {
        match slot.seen {
            0 => unseen.push(id.clone()),
            1 => {}
            n => {
                report.duplicated.note(show, || format!("{id} x{n}"));
                report.duplicate_records += u64::from(n - 1);
            }
        }
        if slot.mismatched > 0 {
            report.mismatched.note(show, || id.clone());
        }
    }
    let unseen = unlettered(lookup, unseen, show, report).await?;
    owed(unseen, caught_up, lookup, show, report).await
}

/// Ids Kafka lacks that were dead-lettered are `unpublishable` (with the letter's reason); the
/// others are returned.
async fn unlettered(
    lookup: &Lookup<'_>,
    ids: Vec<String>,
    show: usize,
    report: &mut Report,
) -> Result<Vec<String>, VerifyError> {
    let mut letters = std::collections::HashMap::new();
    let source_table = lookup.table.display_name();
    for batch in ids.chunks(10_000) {
        match lookup.client.query(&lookup.letters, &[&source_table, &batch]).await {
            Ok(rows) => letters.extend(rows.iter().map(|r| (r.get::<_, String>(0), r.get::<_, String>(1)))),
            // no dead-letter table: nothing was dead-lettered there
            Err(e) if e.code() == Some(&tokio_postgres::error::SqlState::UNDEFINED_TABLE) => break,
            Err(e) => return Err(e.into()),
        }
    }
    let mut rest = Vec::with_capacity(ids.len() - letters.len().min(ids.len()));
    for id in ids {
        match letters.get(&id) {
            Some(reason) => report.unpublishable.note(show, || format!("{id} (dead-lettered: {reason})")),
            None => rest.push(id),
        }
    }
    Ok(rest)
}

/// Rows Kafka lacks, not dead-lettered: pending when the slot has not confirmed past them or the
/// row is not yet marked published, else missing.
async fn owed(
    unseen: Vec<String>,
    caught_up: Result<(), String>,
    lookup: &Lookup<'_>,
    show: usize,
    report: &mut Report,
) -> Result<(), VerifyError> {
    if let Err(reason) = caught_up {
        for id in unseen {
            report.pending.note(show, || id);
        }
        report.pending_reason = Some(reason);
        return Ok(());
    }
    let present = present(lookup, &unseen).await?;
    for id in unseen {
        match present.get(&id) {
            Some(true) => report.pending.note(show, || id),
            _ => report.missing.note(show, || id),
        }
    }
    if report.pending.count > 0 {
        report.pending_reason = Some("not yet marked published (polling.after_publish = \"mark\")".into());
    }
    Ok(())
}

/// Records whose id the window does not hold and the relay had not recorded as published: a row
/// outside the window is fine; an id recorded since (published while verify read Kafka) is its
/// row's, deleted after publishing; any other is unexpected, once the relay has recorded
/// everything it sent before the read ended (`settled`: polling records as it deletes; in
/// replication, the slot confirmed past what verify read, which comes only after the record).
async fn classify_outside(
    lookup: &Lookup<'_>,
    outside: &[Located],
    settled: Result<(), String>,
    show: usize,
    report: &mut Report,
) -> Result<(), VerifyError> {
    let ids: Vec<String> = outside.iter().map(|l| l.id.clone()).collect();
    let present = present(lookup, &ids).await?;
    let gone: Vec<&Located> = outside.iter().filter(|l| !present.contains_key(&l.id)).collect();
    let numbers: Vec<i64> = gone.iter().filter_map(|l| crate::published::numeric_id(&l.id)).collect();
    let recorded = match report.record_kept {
        true => crate::published::recorded(lookup.client, &lookup.table.display_name(), &numbers).await?,
        false => IdBits::default(),
    };
    for located in gone {
        if crate::published::numeric_id(&located.id).is_some_and(|n| recorded.contains(n)) {
            report.published_elsewhere += 1;
        } else if let Err(reason) = &settled {
            report.pending.note(show, || format!("record {} ({}), not recorded yet", located.id, located.at));
            report.pending_reason.get_or_insert_with(|| reason.clone());
        } else {
            report.unexpected.note(show, || format!("{} ({})", located.id, located.at));
        }
    }
    Ok(())
}

/// Ids recorded as published in blocks first written within the window (at or above `floor`,
/// the oldest id Kafka still holds, when there is no window) whose rows are gone: Kafka must
/// hold them. Without `floor` (no window, and no record of this source in Kafka) none is asked.
#[allow(clippy::too_many_arguments)]
async fn classify_recorded(
    lookup: &Lookup<'_>,
    expected: &Expected,
    recent: &IdBits,
    scan: &records::Scan,
    floor: Option<i64>,
    caught_up: bool,
    show: usize,
    report: &mut Report,
) -> Result<(), VerifyError> {
    let Some(floor) = floor else { return Ok(()) };
    let mut gone: Vec<String> = recent
        .ids()
        .filter(|id| *id >= floor && !scan.seen_published.contains(*id))
        .map(|id| id.to_string())
        .filter(|id| !expected.contains(id))
        .collect();
    gone.sort_by_key(|id| id.parse::<i64>().unwrap_or_default());
    let present = present(lookup, &gone).await?;
    gone.retain(|id| !present.contains_key(id));
    for id in unlettered(lookup, gone, show, report).await? {
        if caught_up {
            report.missing.note(show, || format!("{id} (published, row deleted)"));
        } else {
            report.pending.note(show, || id);
        }
    }
    Ok(())
}

/// Which of `ids` the table holds, each with whether it is still unpublished (mark mode). Ids
/// that cannot be of the id column's type are not held.
async fn present(
    lookup: &Lookup<'_>,
    ids: &[String],
) -> Result<std::collections::HashMap<String, bool>, VerifyError> {
    let mut present = std::collections::HashMap::new();
    let integer = matches!(lookup.id_type.as_str(), "bigint" | "integer" | "smallint");
    let sql = lookup.table.ids_present_sql(&lookup.id_type);
    for batch in ids.chunks(10_000) {
        let batch: Vec<&String> = batch.iter().filter(|id| !integer || id.parse::<i64>().is_ok()).collect();
        if batch.is_empty() {
            continue;
        }
        for row in lookup.client.query(&sql, &[&batch]).await? {
            present.insert(row.get::<_, String>(0), row.get::<_, bool>(1));
        }
    }
    Ok(present)
}
/// Whether `verify` compares an outbox's records whole (key, value, every header): the relay's
/// own records. Other formats' headers hold CloudEvents' `time` (the commit time when streamed),
/// and a registry's values its schema id, so for them the key, the payload and the event type
/// as written are compared.
fn compared_whole(outbox: &crate::config::OutboxConfig) -> bool {
    outbox.format == crate::config::RecordFormat::Raw && outbox.registry.is_none()
}
