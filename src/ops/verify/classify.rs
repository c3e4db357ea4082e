//! The classes of `verify`'s report, once the rows and the records are read (steps 2 and 4 of
//! [`super`]): rows Kafka holds more than once or differently, rows it lacks (dead-lettered,
//! pending or missing), records with no row of the window, and ids recorded as published whose
//! rows are gone. Each id is looked up in PostgreSQL, which these functions only read.

use tokio_postgres::Client;

use super::expected::Expected;
use super::records::{self, Located};
use super::report::Report;
use super::{Options, Read, VerifyError, slot_caught_up};
use crate::config::{RelayConfig, SourceMode};
use crate::published::IdBits;
use crate::table::OutboxTable;

/// Every class of the report from what was `read`: the window's rows, then the records with no
/// row of it, then the ids recorded as published whose rows are gone.
pub(super) async fn classes(
    lookup: &Lookup<'_>,
    config: &RelayConfig,
    read: Read,
    options: &Options,
    report: &mut Report,
) -> Result<(), VerifyError> {
    let Read { expected, scan, recent, since, caught_up } = read;
    classify_rows(lookup, &expected, caught_up, options.show, report).await?;
    // what was published while Kafka was read is recorded by the time the slot confirms past it
    let settled = match config.source.mode {
        SourceMode::Replication if !scan.outside.is_empty() => {
            slot_caught_up(lookup.client, &config.replication.slot, options.wait).await?
        }
        _ => Ok(()),
    };
    classify_outside(lookup, &scan.outside, settled, options.show, report).await?;
    let floor = if since.is_some() { Some(0) } else { scan.floor() };
    if floor.is_none() && report.record_kept {
        report.record_unchecked = Some(format!(
            "ids recorded as published whose rows are gone were not checked: retention removed every record of {} \
             (or every one of this source there); give --since within the topics' retention",
            scan.emptied().first().map_or("a partition", String::as_str)
        ));
    }
    let show = options.show;
    classify_recorded(lookup, (&expected, &recent, &scan), floor, show, report).await
}

/// What the lookups in PostgreSQL need.
pub(super) struct Lookup<'a> {
    pub(super) client: &'a Client,
    pub(super) table: &'a OutboxTable,
    pub(super) id_type: String,
    /// `$1` the source table, `$2` event ids: those dead-lettered, with the reason.
    pub(super) letters: String,
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
/// hold them (an id is recorded once Kafka acknowledged it, whether a relay runs now or not), and
/// one it lacks is missing. Without `floor` (no window, and no record of this source in Kafka)
/// none is asked.
async fn classify_recorded(
    lookup: &Lookup<'_>,
    (expected, recent, scan): (&Expected, &IdBits, &records::Scan),
    floor: Option<i64>,
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
        report.missing.note(show, || format!("{id} (published, row deleted)"));
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
