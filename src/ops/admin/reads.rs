//! The API's reads (GET): the session, `status`, the outboxes' state, dead letters, `locate`.
//!
//! Invariants:
//! - a read changes nothing (the operator commands it calls only read);
//! - the lags and counts of `/v1/outboxes` are the relay's own gauges, read from the one metrics
//!   registry, so the console and `/metrics` cannot disagree;
//! - a read that names no outbox (`?outbox=`) works on every outbox, except where one event or
//!   report belongs to one outbox (`status`, `locate`): then one must be named when there are
//!   several, as the commands ask.

use std::time::Duration;

use hyper::StatusCode;
use hyper::http::request::Parts;
use serde_json::{Value, json};

use super::auth::Caller;
use super::routes::{Endpoint, query};
use super::{Admin, Answer};
use crate::config::SourceMode;
use crate::observe::health::Phase;
use crate::observe::metrics::metrics;
use crate::ops::Output;
use crate::outboxes::Outbox;

/// The most letters `/v1/dead-letters` lists per outbox.
const MAX_LETTERS: i64 = 1_000;

/// The answer to a GET of `endpoint`.
pub(super) async fn answer(admin: &Admin, endpoint: Endpoint, caller: &Caller, parts: &Parts) -> Answer {
    match endpoint {
        Endpoint::Session => Answer::json(
            StatusCode::OK,
            &json!({ "name": caller.name, "scope": caller.scope.as_str(), "csrf_token": admin.csrf }),
        ),
        Endpoint::Status => status(admin, parts).await,
        Endpoint::Outboxes => Answer::json(StatusCode::OK, &outboxes(admin)),
        Endpoint::DeadLetters => dead_letters(admin, parts).await,
        Endpoint::Locate => locate(admin, parts).await,
        other => Answer::error(StatusCode::INTERNAL_SERVER_ERROR, format!("{other:?} is not a read")),
    }
}

/// The outboxes `?outbox=` names (all without it); `needed_by`: what needs one named with several.
pub(super) fn chosen<'a>(
    admin: &'a Admin,
    name: Option<&str>,
    needed_by: Option<&str>,
) -> Result<Vec<&'a Outbox>, Answer> {
    crate::ops::cli::chosen(&admin.outboxes, name, needed_by)
        .map_err(|e| Answer::error(StatusCode::BAD_REQUEST, e.replace("--outbox NAME", "?outbox=NAME")))
}

async fn status(admin: &Admin, parts: &Parts) -> Answer {
    let outboxes = match chosen(admin, query(parts, "outbox").as_deref(), Some("status")) {
        Ok(outboxes) => outboxes,
        Err(refused) => return refused,
    };
    match crate::ops::status::run(&admin.config, outboxes[0], None).await {
        Ok(report) => Answer::json_text(StatusCode::OK, report.json().unwrap_or_default()),
        Err(e) => Answer::error(StatusCode::BAD_GATEWAY, format!("status could not finish: {e}")),
    }
}

/// This instance's role in one word: `active`, `paused`, `standby`, `starting`, `degraded`,
/// `fatal`.
pub(super) fn role(admin: &Admin) -> &'static str {
    match admin.health.phase() {
        Phase::Active if admin.health.pause().state().is_some() => "paused",
        Phase::Active => "active",
        Phase::Standby => "standby",
        Phase::Starting => "starting",
        Phase::Retrying(_) => "degraded",
        Phase::Fatal(_) => "fatal",
    }
}

/// The instance and each outbox, from the relay's gauges.
fn outboxes(admin: &Admin) -> Value {
    let m = metrics();
    let readiness = admin.health.readiness().unwrap_or_else(|why| why);
    let mode = admin.config.source.mode;
    let slot = (mode == SourceMode::Replication).then(|| {
        json!({
            "name": admin.config.replication.slot,
            "lag_bytes": m.slot_confirmed_lag.get(),
            "retained_wal_bytes": m.slot_retained_wal.get(),
        })
    });
    let each: Vec<Value> = admin
        .outboxes
        .iter()
        .map(|o| {
            let name = [o.name.as_str()];
            json!({
                "name": o.name,
                "table": o.table.display_name(),
                "dead_letter_table": o.dead_letter.table,
                "state": role(admin),
                "events_published": m.outbox_events_published.with_label_values(&name).get(),
                "backlog_events": (mode == SourceMode::Polling).then(|| m.outbox_backlog_events.with_label_values(&name).get()),
                "dead_letters_outstanding": m.outbox_dead_letters_outstanding.with_label_values(&name).get(),
            })
        })
        .collect();
    json!({
        "instance": {
            "state": role(admin),
            "readiness": readiness,
            "mode": mode.to_string(),
            "paused": admin.health.pause().state(),
            "events_published": m.events_published.with_label_values(&[&mode.to_string()]).get(),
            "version": env!("CARGO_PKG_VERSION"),
        },
        "slot": slot,
        "outboxes": each,
    })
}

/// Each chosen outbox's oldest letters (`?limit=`, 100 by default), with their reasons.
async fn dead_letters(admin: &Admin, parts: &Parts) -> Answer {
    let outboxes = match chosen(admin, query(parts, "outbox").as_deref(), None) {
        Ok(outboxes) => outboxes,
        Err(refused) => return refused,
    };
    let limit = match query(parts, "limit").map(|l| l.parse::<i64>()) {
        None => 100,
        Some(Ok(limit)) if (1..=MAX_LETTERS).contains(&limit) => limit,
        Some(_) => return Answer::error(StatusCode::BAD_REQUEST, format!("limit: give 1 to {MAX_LETTERS}")),
    };
    let client = match crate::postgres::connect(&admin.config.postgres).await {
        Ok(client) => client,
        Err(e) => return Answer::error(StatusCode::BAD_GATEWAY, format!("cannot reach PostgreSQL: {e}")),
    };
    let mut letters = Vec::new();
    for outbox in outboxes {
        let sql = crate::dead_letter::list_sql(&outbox.dead_letter);
        let rows = match client.query(&sql, &[&outbox.table.display_name(), &limit]).await {
            Ok(rows) => rows,
            Err(e) => {
                let said = format!("cannot read {} of outbox {}: {e}", outbox.dead_letter.table, outbox.name);
                return Answer::error(StatusCode::BAD_GATEWAY, said);
            }
        };
        letters.extend(rows.iter().map(|r| {
            json!({
                "outbox": outbox.name, "id": r.get::<_, i64>(0), "event_id": r.get::<_, String>(1),
                "reason": r.get::<_, String>(2), "dead_lettered_at": r.get::<_, Option<String>>(3),
                "aggregate_type": r.get::<_, Option<String>>(4), "aggregate_id": r.get::<_, Option<String>>(5),
                "event_type": r.get::<_, Option<String>>(6),
            })
        }));
    }
    Answer::json(StatusCode::OK, &json!({ "dead_letters": letters }))
}

/// `?id=` (and `?outbox=` with several, `?wait_secs=`, 0 by default): the event's receipt.
async fn locate(admin: &Admin, parts: &Parts) -> Answer {
    let Some(id) = query(parts, "id").filter(|id| !id.trim().is_empty()) else {
        return Answer::error(StatusCode::BAD_REQUEST, "id: give the event's id (?id=...)");
    };
    let outboxes = match chosen(admin, query(parts, "outbox").as_deref(), Some("locate")) {
        Ok(outboxes) => outboxes,
        Err(refused) => return refused,
    };
    let wait = match query(parts, "wait_secs").map(|w| w.parse::<u64>()) {
        None => 0,
        Some(Ok(secs)) if secs <= 60 => secs,
        Some(_) => return Answer::error(StatusCode::BAD_REQUEST, "wait_secs: give 0 to 60"),
    };
    let receipt =
        crate::ops::locate::run(&admin.config, outboxes[0], id.trim(), Duration::from_secs(wait)).await;
    match receipt {
        Ok(receipt) => Answer::json_text(StatusCode::OK, receipt.json().unwrap_or_default()),
        Err(e @ crate::error::RelayError::Fatal { .. }) => {
            Answer::error(StatusCode::BAD_REQUEST, e.to_string().replace("--id", "id"))
        }
        Err(e) => Answer::error(StatusCode::BAD_GATEWAY, format!("locate could not finish: {e}")),
    }
}
