//! What `verify` found, for people (a summary and the first ids of each class) and for
//! machines (`--format json`), and the exit code it means.

use serde::Serialize;

/// One class of finding: how many, and the first few.
#[derive(Debug, Default, Serialize)]
pub struct Class {
    pub count: u64,
    pub first: Vec<String>,
}

impl Class {
    pub fn note(&mut self, keep: usize, item: impl FnOnce() -> String) {
        self.count += 1;
        if self.first.len() < keep {
            self.first.push(item());
        }
    }
}

#[derive(Debug, Default, Serialize)]
pub struct Report {
    pub table: String,
    pub source: String,
    pub since: Option<String>,
    pub until: Option<String>,
    pub rows: u64,
    pub topics: Vec<String>,
    pub partitions: usize,
    pub records: u64,
    pub records_of_other_sources: u64,
    /// In the table, not in Kafka.
    pub missing: Class,
    /// Not in Kafka yet, and not known to be owed yet: committed after the relay's confirmed
    /// position, or not yet marked published.
    pub pending: Class,
    /// In Kafka, with no row in the table.
    pub unexpected: Class,
    /// The same id more than once (`first`: `id xN`); at-least-once allows it.
    pub duplicated: Class,
    pub duplicate_records: u64,
    /// Records of one key in another order than their commits.
    pub out_of_order: Class,
    /// A record whose key, value or headers differ from what the row maps to.
    pub mismatched: Class,
    /// Rows the relay cannot publish (dead-lettered instead), with the reason.
    pub unpublishable: Class,
    /// Rows the outbox's transforms filter out (never sent), with the rule.
    pub filtered: Class,
    /// Records of ids the relay recorded as published whose rows are not in the window: deleted
    /// after publishing (polling delete mode, a cleanup, a dropped partition), or outside it.
    pub published_elsewhere: u64,
    /// Records `replay-dead-letters` sent.
    pub replayed: u64,
    /// Whether the record of what was published exists (`sql/010_published.sql`): without it a
    /// record whose row was deleted is `unexpected`.
    pub record_kept: bool,
    /// Why recorded ids whose rows are gone were not checked, when they were not.
    pub record_unchecked: Option<String>,
    /// Topics the rows route to that do not exist.
    pub missing_topics: Vec<String>,
    /// Why pending rows could not be told from missing ones, when they could not.
    pub pending_reason: Option<String>,
    pub memory_bytes: usize,
    pub seconds: f64,
}

/// Exit codes: 0 every row there, in order (at-least-once duplicates allowed); 1 a row not in
/// Kafka (missing, or dead-lettered), a record with no row, out of order or different; 3
/// nothing wrong found but some rows still pending.
pub const EXIT_OK: u8 = 0;
pub const EXIT_FOUND: u8 = 1;
pub const EXIT_PENDING: u8 = 3;

impl crate::ops::Output for Report {
    fn text(&self) -> String {
        Report::text(self)
    }

    fn json(&self) -> Option<String> {
        Some(serde_json::to_string_pretty(self).expect("json"))
    }

    fn exit_code(&self) -> u8 {
        Report::exit_code(self)
    }
}

impl Report {
    pub fn exit_code(&self) -> u8 {
        match (self.wrong().is_empty(), self.pending.count) {
            (true, 0) => EXIT_OK,
            (true, _) => EXIT_PENDING,
            _ => EXIT_FOUND,
        }
    }

    /// What is wrong, class by class, with what each means.
    fn wrong(&self) -> Vec<String> {
        let classes = [
            (self.missing.count, "missing (owed, not in Kafka)"),
            (
                self.unpublishable.count,
                "dead-lettered, not in Kafka (fix the cause, then outbox-relay replay-dead-letters)",
            ),
            (self.unexpected.count, "in Kafka with no row"),
            (self.out_of_order.count, "out of order"),
            (self.mismatched.count, "different from their rows"),
        ];
        classes.iter().filter(|(n, _)| *n > 0).map(|(n, what)| format!("{n} {what}")).collect()
    }

    /// The summary line: true of every state the report can hold.
    pub fn verdict(&self) -> String {
        let verdict = self.verdict_of_rows();
        match self.filtered.count {
            0 => verdict,
            n => format!("{verdict} ({n} row(s) filtered out by the outbox's transforms: owed to no topic)"),
        }
    }

    fn verdict_of_rows(&self) -> String {
        match self.exit_code() {
            EXIT_OK if self.rows == 0 => "OK: the window has no rows".into(),
            EXIT_OK if self.rows == self.filtered.count => "OK: the window has no rows to publish".into(),
            EXIT_OK if self.duplicated.count > 0 => format!(
                "OK: every row of the window is in Kafka, in order; {} id(s) more than once ({} extra record(s):                  at-least-once duplicates or republished, which consumers skip by the id header)",
                self.duplicated.count, self.duplicate_records
            ),
            EXIT_OK => "OK: every row of the window is in Kafka, once, in order".into(),
            EXIT_PENDING => format!(
                "PENDING: nothing wrong found, but {} row(s) are not in Kafka yet; run verify again",
                self.pending.count
            ),
            _ => format!("FAIL: {}", self.wrong().join("; ")),
        }
    }

    /// The summary for people.
    pub fn text(&self) -> String {
        let window = format!(
            "[{}, {})",
            self.since.as_deref().unwrap_or("the first row"),
            self.until.as_deref().unwrap_or("now")
        );
        let mut out = format!(
            "verify {} (source {}), created_at in {window}\n  {} row(s); {} record(s) of this source read from {} topic(s), {} partition(s) ({} of other sources skipped)\n",
            self.table,
            self.source,
            self.rows,
            self.records,
            self.topics.len(),
            self.partitions,
            self.records_of_other_sources
        );
        let lines: [(&str, &Class, &str); 8] = [
            ("missing", &self.missing, "in the table, not in Kafka"),
            ("pending", &self.pending, "not in Kafka yet and not owed yet"),
            ("unexpected", &self.unexpected, "in Kafka, no row in the table"),
            ("duplicated", &self.duplicated, "ids in Kafka more than once"),
            ("out of order", &self.out_of_order, "records of one key not in commit order"),
            ("mismatched", &self.mismatched, "key, value or headers differ from the row"),
            ("unpublishable", &self.unpublishable, "rows the relay dead-letters instead"),
            ("filtered", &self.filtered, "rows the outbox's transforms filter out, owed to no topic"),
        ];
        for (name, class, meaning) in lines {
            out.push_str(&format!("  {name:<14}{:>10}  ({meaning})", class.count));
            if !class.first.is_empty() {
                out.push_str(&format!("; first: {}", class.first.join(", ")));
            }
            out.push('\n');
        }
        out.push_str(&format!(
            "  {:<14}{:>10}  (records of published ids whose rows were deleted or lie outside the window)\n",
            "rows gone", self.published_elsewhere
        ));
        if self.replayed > 0 {
            out.push_str(&format!(
                "  {:<14}{:>10}  (records sent by replay-dead-letters)\n",
                "replayed", self.replayed
            ));
        }
        if !self.record_kept {
            out.push_str(
                "  no record of what was published (apply sql/010_published.sql): a record whose row was deleted is \
                 counted unexpected\n",
            );
        }
        if let Some(unchecked) = &self.record_unchecked {
            out.push_str(&format!("  {unchecked}\n"));
        }
        if !self.missing_topics.is_empty() {
            out.push_str(&format!("  topics that do not exist: {}\n", self.missing_topics.join(", ")));
        }
        if let Some(reason) = &self.pending_reason {
            out.push_str(&format!("  pending: {reason}\n"));
        }
        out.push_str(&format!("{} ({:.1} s)\n", self.verdict(), self.seconds));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn class(count: u64) -> Class {
        Class { count, first: Vec::new() }
    }

    /// Every state verify can find, with the summary line and exit code each gives (the table
    /// in docs/commands.md).
    #[test]
    fn every_state_has_a_true_summary_line_and_its_exit_code() {
        for (state, report, code, verdict) in states() {
            assert_eq!(report.exit_code(), code, "{state}");
            assert!(report.verdict().starts_with(verdict), "{state}: {}", report.verdict());
            assert!(report.text().contains(&report.verdict()), "{state}");
        }
    }

    /// Each state: its name, a report of it, the exit code and the start of the summary line.
    fn states() -> Vec<(&'static str, Report, u8, &'static str)> {
        let published = || Report { rows: 10, records: 10, ..Report::default() };
        vec![
            ("no rows", Report::default(), EXIT_OK, "OK: the window has no rows"),
            ("published", published(), EXIT_OK, "OK: every row of the window is in Kafka, once, in order"),
            (
                "duplicated",
                Report { duplicated: class(7), duplicate_records: 7, ..published() },
                EXIT_OK,
                "OK: every row of the window is in Kafka, in order; 7 id(s) more than once (7 extra record(s)",
            ),
            (
                "replayed",
                Report { replayed: 3, ..published() },
                EXIT_OK,
                "OK: every row of the window is in Kafka, once, in order",
            ),
            (
                "filtered",
                Report { rows: 12, filtered: class(2), ..published() },
                EXIT_OK,
                "OK: every row of the window is in Kafka, once, in order (2 row(s) filtered out by the outbox's \
                 transforms: owed to no topic)",
            ),
            (
                "only filtered rows",
                Report { rows: 2, records: 0, filtered: class(2), ..Report::default() },
                EXIT_OK,
                "OK: the window has no rows to publish (2 row(s) filtered out",
            ),
            (
                "pending",
                Report { pending: class(4), ..published() },
                EXIT_PENDING,
                "PENDING: nothing wrong found, but 4 row(s) are not in Kafka yet",
            ),
            (
                "dead-lettered",
                Report { unpublishable: class(3), ..published() },
                EXIT_FOUND,
                "FAIL: 3 dead-lettered, not in Kafka (fix the cause, then outbox-relay replay-dead-letters)",
            ),
            (
                "missing",
                Report { missing: class(2), pending: class(1), ..published() },
                EXIT_FOUND,
                "FAIL: 2 missing (owed, not in Kafka)",
            ),
            (
                "unexpected",
                Report { unexpected: class(1), ..published() },
                EXIT_FOUND,
                "FAIL: 1 in Kafka with no row",
            ),
            (
                "out of order",
                Report { out_of_order: class(1), ..published() },
                EXIT_FOUND,
                "FAIL: 1 out of order",
            ),
            (
                "mismatched and dead-lettered",
                Report { mismatched: class(1), unpublishable: class(1), duplicated: class(1), ..published() },
                EXIT_FOUND,
                "FAIL: 1 dead-lettered, not in Kafka (fix the cause, then outbox-relay replay-dead-letters); 1 \
                 different from their rows",
            ),
        ]
    }
}
