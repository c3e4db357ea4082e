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
//! A row the outbox's transforms filter out (`[outbox.transforms]`, judged by the configuration
//! verify is given, as the relay judges it), or one the relay recorded as filtered when it
//! settled it ([`crate::published::filtered`]: the rules have changed since), is counted
//! `filtered`: Kafka owes nothing for it, so it is never `missing`.
//!
//! It changes nothing, anywhere: no offsets are committed, no row is touched.

mod classify;
pub mod expected;
pub mod records;
pub mod report;
pub mod watch;

use std::time::{Duration, Instant, SystemTime};

use tokio_postgres::Client;

use crate::config::{AfterPublish, RelayConfig, SourceMode};
use crate::outboxes::Outbox;
use crate::published::{IdBits, Record, numeric_id};
use crate::record::format::Format;
use crate::table::{OutboxTable, outbox_row};
use classify::Lookup;
use expected::{Expected, fingerprint};
use records::Reader;
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

/// Compares the outbox with Kafka, step by step as the module doc says.
pub async fn run(config: &RelayConfig, outbox: &Outbox, options: &Options) -> Result<Report, VerifyError> {
    let started = Instant::now();
    let (mut client, _) = crate::postgres::connect_primary(&config.postgres).await?;
    let table = &outbox.table;
    let (mut report, read) = read(&mut client, (config, outbox), options).await?;
    let lookup = Lookup {
        client: &client,
        table,
        id_type: table.id_type(&client).await?,
        letters: crate::dead_letter::reasons_sql(&outbox.dead_letter),
    };
    classify::classes(&lookup, config, read, options, &mut report).await?;
    report.seconds = started.elapsed().as_secs_f64();
    Ok(report)
}

/// What was read, for [`classify::classes`].
struct Read {
    /// The window's rows, each marked with how Kafka held it.
    expected: Expected,
    scan: records::Scan,
    /// Ids recorded as published in blocks first written within the window.
    recent: IdBits,
    since: Option<SystemTime>,
    /// `Err(why)` while rows Kafka lacks may still be on their way.
    caught_up: Result<(), String>,
}

/// Steps 1 to 3: the window's rows, the record of what was published, whether what Kafka lacks
/// is owed, and every record of the topics; the report's header and counts.
async fn read(
    client: &mut Client,
    (config, outbox): (&RelayConfig, &Outbox),
    options: &Options,
) -> Result<(Report, Read), VerifyError> {
    let table = &outbox.table;
    let (since, until) = window(client, table, options).await?;
    let source = crate::readback::source_identity(client, &outbox.config).await?;
    let mut report = Report {
        table: table.display_name(),
        source: source.clone(),
        since: described(client, since).await?,
        until: described(client, until).await?,
        ..Report::default()
    };
    let touched_since =
        since.map(|at| at.checked_sub(records::CLOCK_SLACK).unwrap_or(SystemTime::UNIX_EPOCH));
    // the ids the relay filtered out, whatever the rules say now
    let filtered = crate::published::filtered(client, &table.display_name(), touched_since).await?;
    let window = (since, until);
    let mut expected = read_rows(client, (outbox, &filtered), window, options.show, &mut report).await?;
    // read before the slot's target position: every id recorded by then was committed before it
    let record = Record::load(client, &table.display_name(), touched_since, since).await?;
    let record_bytes = record.published.memory_bytes() + record.recent.memory_bytes();
    let caught_up = rows_owed(client, config, options.wait).await?;
    // rows deleted after publishing leave their topics in the record only
    expected.topics.extend(record.topics);
    report.topics = expected.topics.iter().cloned().collect();
    report.record_kept = record.kept;
    let reader_source = config.kafka.source_headers.then_some(source);
    let (scan, expected) =
        read_kafka((config, outbox), reader_source, since, record.published, options.show, expected).await?;
    let scan = counted(scan, &mut report);
    report.memory_bytes = expected.memory_bytes() + record_bytes;
    Ok((report, Read { expected, scan, recent: record.recent, since, caught_up }))
}

/// Step 2: `Ok` when Kafka owes every row it lacks, `Err(why)` when some may still be on their
/// way (replication: the slot has not confirmed what verify read; polling `delete` mode: every
/// row it keeps is unpublished).
async fn rows_owed(
    client: &Client,
    config: &RelayConfig,
    wait: Duration,
) -> Result<Result<(), String>, VerifyError> {
    Ok(match config.source.mode {
        SourceMode::Replication => slot_caught_up(client, &config.replication.slot, wait).await?,
        // a row delete mode keeps is one not yet published
        SourceMode::Polling if config.polling.after_publish == AfterPublish::Delete => {
            Err("not yet published (polling.after_publish = \"delete\" keeps only unpublished rows)".into())
        }
        SourceMode::Polling => Ok(()),
    })
}

/// Step 3: every record of the topics `expected` routes to, read on a blocking thread and
/// marked in `expected` as it streams by.
async fn read_kafka(
    (config, outbox): (&RelayConfig, &Outbox),
    source: Option<String>,
    since: Option<SystemTime>,
    published: IdBits,
    show: usize,
    mut expected: Expected,
) -> Result<(records::Scan, Expected), VerifyError> {
    let format = Format::of(&outbox.config);
    let whole = compared_whole(&outbox.config);
    let reader = Reader::new(&config.kafka, source, (format, whole), since, published, show)
        .map_err(|e| VerifyError::Failed(format!("cannot create a Kafka client: {e}")))?;
    let (scan, expected) = tokio::task::spawn_blocking(move || {
        let scan = reader.scan(&mut expected);
        (scan, expected)
    })
    .await
    .map_err(|e| VerifyError::Failed(format!("reading Kafka failed: {e}")))?;
    Ok((scan.map_err(VerifyError::Failed)?, expected))
}

/// The scan's counts and classes into the report; the rest of the scan.
fn counted(mut scan: records::Scan, report: &mut Report) -> records::Scan {
    report.partitions = scan.partitions;
    report.records = scan.records;
    report.records_of_other_sources = scan.foreign;
    report.missing_topics = std::mem::take(&mut scan.missing_topics);
    report.out_of_order = std::mem::take(&mut scan.out_of_order);
    report.published_elsewhere = scan.published_elsewhere;
    report.replayed = scan.replayed;
    scan
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
    (outbox, filtered): (&Outbox, &IdBits),
    window: (Option<SystemTime>, Option<SystemTime>),
    show: usize,
    report: &mut Report,
) -> Result<Expected, VerifyError> {
    let (table, mapping) = (&outbox.table, &outbox.mapping);
    let whole = compared_whole(&outbox.config);
    // a portal read in batches: the rows are never all in memory, whatever the window
    let txn = client.build_transaction().read_only(true).start().await?;
    let portal = txn.bind(&table.window_sql(), &[&window.0, &window.1]).await?;
    let mut expected = Expected::default();
    loop {
        let rows = txn.query_portal(&portal, ROW_BATCH).await?;
        for row in &rows {
            let (raw, created_at) = outbox_row(row)?;
            let id = raw.id.clone().unwrap_or_default();
            let mapped =
                mapping.to_record(raw, created_at).map_err(|e| VerifyError::Failed(e.to_string()))?;
            let recorded_filtered = numeric_id(&id).is_some_and(|n| filtered.contains(n));
            match mapped {
                Err(refused) if refused.filtered_by().is_some() => {
                    let rule = refused.filtered_by().unwrap_or_default();
                    report.filtered.note(show, || format!("{id} ({rule})"));
                }
                // filtered when the relay settled it: owed to no topic, whatever the rules say now
                _ if recorded_filtered => {
                    report
                        .filtered
                        .note(show, || format!("{id} (filtered when relayed; the rules now map it)"));
                }
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
    report.rows = expected.rows + report.unpublishable.count + report.filtered.count;
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

/// Whether `verify` compares an outbox's records whole (key, value, every header): the relay's
/// own records. Other formats' headers hold CloudEvents' `time` (the commit time when streamed),
/// and a registry's values its schema id, so for them the key, the payload and the event type
/// as written are compared.
fn compared_whole(outbox: &crate::config::OutboxConfig) -> bool {
    outbox.format == crate::config::RecordFormat::Raw && outbox.registry.is_none()
}
