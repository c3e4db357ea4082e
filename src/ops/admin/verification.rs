//! The last verification pass, kept for `GET /v1/verification` and the console's panel.
//!
//! Invariants:
//! - only a pass that finished is kept (one that could not reach PostgreSQL or Kafka is not a
//!   finding), whoever asked for it: the API's `POST /v1/verify` or a signal row, both through
//!   [`super::acts`]; a newer pass replaces it;
//! - it lives in the process: `null` until the first pass after start, never a 404;
//! - its counts are the report's own (`verify --format json`), class by class, per outbox.

use std::time::{SystemTime, UNIX_EPOCH};

use hyper::StatusCode;
use serde_json::{Map, Value, json};

use super::{Admin, Answer};

/// The report's classes of findings (`verify --format json`), in the order the console lists
/// them.
pub(crate) const CLASSES: &[&str] = &[
    "missing",
    "unpublishable",
    "duplicated",
    "out_of_order",
    "unexpected",
    "mismatched",
    "pending",
    "filtered",
];

/// Keeps the pass `detail` (`{"since", "outboxes": [{"outbox", "verdict", "report"}]}`) that
/// `who` asked for through `via`, with its `result`, as the last one.
pub(super) fn keep(admin: &Admin, (who, via): (&str, &str), result: &str, detail: &Value) {
    let at = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default().as_secs();
    *admin.verification.lock().unwrap() = Some(pass(at, (who, via), result, detail));
}

/// What `GET /v1/verification` says: the last pass, or `null`.
pub(super) fn answer(admin: &Admin) -> Answer {
    let last = admin.verification.lock().unwrap().clone();
    Answer::json(StatusCode::OK, &last.unwrap_or(Value::Null))
}

/// The pass as kept: when, by whom, its result and window, and per outbox its verdict, its
/// counts per class and its report.
fn pass(at_unix_seconds: u64, (who, via): (&str, &str), result: &str, detail: &Value) -> Value {
    let outboxes: Vec<Value> = detail["outboxes"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default()
        .iter()
        .map(|o| {
            let counts: Map<String, Value> = CLASSES
                .iter()
                .map(|class| (class.to_string(), o["report"][class]["count"].clone()))
                .collect();
            json!({ "outbox": o["outbox"], "verdict": o["verdict"], "counts": counts, "report": o["report"] })
        })
        .collect();
    json!({
        "at_unix_seconds": at_unix_seconds, "by": who, "via": via, "result": result,
        "since": detail["since"], "outboxes": outboxes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::admin::auth::Tokens;

    #[test]
    fn nothing_before_the_first_pass_then_the_last_one_with_its_counts_per_class() {
        let admin = Admin::for_tests(Tokens::of(&[]));
        assert_eq!(answer(&admin).body.trim(), "null");

        let report = serde_json::to_value(crate::ops::verify::report::Report::default()).unwrap();
        let mut found = report.clone();
        found["missing"]["count"] = json!(2);
        found["unpublishable"]["count"] = json!(1);
        let detail = |report: &Value| json!({ "since": "1h", "outboxes": [{ "outbox": "orders", "verdict": "v", "report": report }] });
        keep(&admin, ("oncall", "api"), "found_problems", &detail(&found));
        keep(&admin, ("ops", "signal 7"), "all_there", &detail(&report));

        let last: Value = serde_json::from_str(&answer(&admin).body).unwrap();
        assert_eq!(
            (&last["by"], &last["via"], &last["result"]),
            (&json!("ops"), &json!("signal 7"), &json!("all_there"))
        );
        let counts = last["outboxes"][0]["counts"].as_object().unwrap();
        assert_eq!(counts.keys().count(), CLASSES.len());
        assert!(counts.values().all(|count| count == 0), "the newer pass replaces the older: {counts:?}");
        assert!(last["at_unix_seconds"].as_u64().unwrap() > 0);

        let pass = pass(1, ("oncall", "api"), "found_problems", &detail(&found));
        assert_eq!(pass["outboxes"][0]["counts"]["missing"], 2);
        assert_eq!(pass["outboxes"][0]["counts"]["unpublishable"], 1);
        assert_eq!(pass["outboxes"][0]["report"], found);
    }
}
