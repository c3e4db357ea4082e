//! The API's reads (GET): the session, `status`, the outboxes' state, dead letters, `locate`,
//! the last hour's history and the last verification pass.
//!
//! Invariants:
//! - a read changes nothing (the operator commands it calls only read);
//! - the lags and counts of `/v1/outboxes` are the relay's own gauges, read from the one metrics
//!   registry, and `/v1/history` holds samples of those same gauges
//!   ([`crate::observe::history`]), so the console and `/metrics` cannot disagree;
//! - an outbox is `held` while the process holds at an unpublishable event and the outbox's
//!   `dead_letter.on_poison` is `block`: the fact (and `outbox_relay_events_blocked`) is one per
//!   process, so with several such outboxes each says held, with the same reason;
//! - the reads that need PostgreSQL share one session ([`Admin`]'s), opened on first use and
//!   again when it has closed: the console's polling opens no connection per request;
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
use crate::config::{OnPoison, SourceMode};
use crate::observe::health::Phase;
use crate::observe::history::{Sample, rates};
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
        Endpoint::History => Answer::json_text(StatusCode::OK, history(admin).to_string()),
        Endpoint::Verification => super::verification::answer(admin),
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

/// `outbox`'s state: `held` (with the reason) while the process holds at an unpublishable event
/// and the outbox's policy is to hold, else the instance's [`role`].
fn state(admin: &Admin, outbox: &Outbox, blocked: &Option<String>) -> (&'static str, Option<String>) {
    match blocked {
        Some(why) if outbox.dead_letter.on_poison == OnPoison::Block => ("held", Some(why.clone())),
        _ => (role(admin), None),
    }
}

/// The instance and each outbox, from the relay's gauges.
fn outboxes(admin: &Admin) -> Value {
    let m = metrics();
    let readiness = admin.health.readiness().unwrap_or_else(|why| why);
    let blocked = admin.health.blocked();
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
            let (state, held) = state(admin, o, &blocked);
            json!({
                "name": o.name,
                "table": o.table.display_name(),
                "dead_letter_table": o.dead_letter.table,
                "state": state,
                "held": held,
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
            "events_blocked": m.events_blocked.get(),
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
    let mut session = admin.postgres.lock().await;
    for attempt in 1..=2 {
        let reused = session.as_ref().is_some_and(|client| !client.is_closed());
        if !reused {
            match crate::postgres::connect(&admin.config.postgres).await {
                Ok(client) => *session = Some(client),
                Err(e) => {
                    return Answer::error(StatusCode::BAD_GATEWAY, format!("cannot reach PostgreSQL: {e}"));
                }
            }
        }
        let client = session.as_ref().expect("connected");
        match letters_of(client, &outboxes, limit).await {
            Ok(letters) => return Answer::json(StatusCode::OK, &json!({ "dead_letters": letters })),
            // the server ended the session while it was idle: once more on a new one
            Err((_, closed)) if closed && reused && attempt == 1 => *session = None,
            Err((said, closed)) => {
                if closed {
                    *session = None;
                }
                return Answer::error(StatusCode::BAD_GATEWAY, said);
            }
        }
    }
    unreachable!("the second attempt answers")
}

/// The letters of `outboxes` on `client`; else what failed, and whether the session is closed.
async fn letters_of(
    client: &tokio_postgres::Client,
    outboxes: &[&Outbox],
    limit: i64,
) -> Result<Vec<Value>, (String, bool)> {
    let mut letters = Vec::new();
    for outbox in outboxes {
        let sql = crate::dead_letter::list_sql(&outbox.dead_letter);
        let rows = client.query(&sql, &[&outbox.table.display_name(), &limit]).await.map_err(|e| {
            let said = format!("cannot read {} of outbox {}: {e}", outbox.dead_letter.table, outbox.name);
            (said, e.is_closed() || client.is_closed())
        })?;
        letters.extend(rows.iter().map(|r| {
            json!({
                "outbox": outbox.name, "id": r.get::<_, i64>(0), "event_id": r.get::<_, String>(1),
                "reason": r.get::<_, String>(2), "dead_lettered_at": r.get::<_, Option<String>>(3),
                "aggregate_type": r.get::<_, Option<String>>(4), "aggregate_id": r.get::<_, Option<String>>(5),
                "event_type": r.get::<_, Option<String>>(6),
            })
        }));
    }
    Ok(letters)
}

/// The history's samples, one array per series (oldest first), with the throughput of each
/// interval derived from the published counters.
fn history(admin: &Admin) -> Value {
    let history = &admin.history;
    let samples = history.samples();
    let at: Vec<u64> = samples.iter().map(|s| s.at_unix_ms).collect();
    let slot = |series: fn(&Sample) -> Option<i64>| {
        history.replication().then(|| samples.iter().map(series).collect::<Vec<_>>())
    };
    let outboxes: Vec<Value> = history
        .outboxes()
        .iter()
        .enumerate()
        .map(|(i, name)| {
            let published: Vec<u64> = samples.iter().map(|s| s.outboxes[i].1).collect();
            let counted: Vec<(u64, u64)> = at.iter().copied().zip(published.iter().copied()).collect();
            let backlog =
                (!history.replication()).then(|| samples.iter().map(|s| s.outboxes[i].0).collect::<Vec<_>>());
            json!({
                "name": name,
                "backlog_events": backlog,
                "events_published": published,
                "events_per_second": rates(&counted),
            })
        })
        .collect();
    json!({
        "interval_secs": history.interval().as_secs(),
        "capacity": history.capacity(),
        "mode": if history.replication() { "replication" } else { "polling" },
        "at_unix_ms": at,
        "slot_lag_bytes": slot(|s| s.slot_lag_bytes),
        "retained_wal_bytes": slot(|s| s.retained_wal_bytes),
        "outboxes": outboxes,
    })
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::admin::auth::Tokens;

    #[test]
    fn the_history_is_one_array_per_series_oldest_first_with_the_throughput_of_each_interval() {
        // (the tests' configuration streams: the slot's series, no backlog)
        let admin = Admin::for_tests(Tokens::of(&[]));
        let empty = history(&admin);
        assert_eq!(empty["at_unix_ms"], json!([]), "it starts empty");
        assert_eq!((&empty["mode"], &empty["slot_lag_bytes"]), (&json!("replication"), &json!([])));
        for (at, lag, published) in [(1_000, 400, 10), (6_000, 200, 20), (11_000, 0, 45)] {
            admin.history.record(Sample {
                at_unix_ms: at,
                slot_lag_bytes: Some(lag),
                retained_wal_bytes: Some(lag + 1_000),
                outboxes: vec![(None, published)],
            });
        }
        let history = history(&admin);
        assert_eq!(history["at_unix_ms"], json!([1_000, 6_000, 11_000]));
        assert_eq!(history["slot_lag_bytes"], json!([400, 200, 0]));
        assert_eq!(history["retained_wal_bytes"], json!([1_400, 1_200, 1_000]));
        let outbox = &history["outboxes"][0];
        assert_eq!(outbox["name"], admin.outboxes.first().name.as_str());
        assert_eq!(outbox["backlog_events"], Value::Null);
        assert_eq!(outbox["events_published"], json!([10, 20, 45]));
        assert_eq!(outbox["events_per_second"], json!([null, 2.0, 5.0]));
        assert_eq!(history["interval_secs"], admin.config.metrics.sample_interval_secs);
    }
}
