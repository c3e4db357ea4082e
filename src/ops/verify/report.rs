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

/// Exit codes: 0 all there, once and in order; 1 something missing, unexpected, out of order or
/// different; 3 nothing wrong found but some rows still pending.
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
        let wrong =
            self.missing.count + self.unexpected.count + self.out_of_order.count + self.mismatched.count;
        match (wrong, self.pending.count) {
            (0, 0) => EXIT_OK,
            (0, _) => EXIT_PENDING,
            _ => EXIT_FOUND,
        }
    }

    pub fn verdict(&self) -> &'static str {
        match self.exit_code() {
            EXIT_OK => "OK: every row of the window is in Kafka, once per id at most as counted, in order",
            EXIT_PENDING => {
                "PENDING: nothing wrong found, but some rows are not in Kafka yet; run verify again"
            }
            _ => "FAIL",
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
        let lines: [(&str, &Class, &str); 7] = [
            ("missing", &self.missing, "in the table, not in Kafka"),
            ("pending", &self.pending, "not in Kafka yet and not owed yet"),
            ("unexpected", &self.unexpected, "in Kafka, no row in the table"),
            ("duplicated", &self.duplicated, "ids in Kafka more than once"),
            ("out of order", &self.out_of_order, "records of one key not in commit order"),
            ("mismatched", &self.mismatched, "key, value or headers differ from the row"),
            ("unpublishable", &self.unpublishable, "rows the relay dead-letters instead"),
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
