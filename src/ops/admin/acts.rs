//! The API's acts (POST): pause, resume, replay dead letters, republish, verify now. Each
//! answers with a receipt and writes one audit line.
//!
//! Invariants:
//! - one audit line per act, done or refused (target `outbox_relay::audit`, fields `who`, `via`
//!   (`api`, `signal <id>`), `act`, `result`, and `detail`), never with a token or a body's secrets in it;
//! - a standby refuses every act with 409, naming the leader when it can: acts belong to the
//!   active instance (pausing a standby would pause nothing; replaying beside the leader is the
//!   leader's job);
//! - acts run one at a time ([`super::Admin`]'s lock): two replays never race for one letter in
//!   one process, and a verify does not overlap a replay it would report on;
//! - republish and replay are carried out by this process's active session, beside its stream
//!   ([`crate::delivery::live`]); while paused they are refused (409): the session reads and
//!   sends nothing until resumed.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use hyper::StatusCode;
use serde::Deserialize;
use serde_json::{Value, json};

use super::auth::Caller;
use super::routes::{Endpoint, Route};
use super::{Admin, Answer};
use crate::config::SourceMode;
use crate::observe::health::Phase;

/// The body of `POST /v1/pause`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct PauseBody {
    reason: Option<String>,
}

/// The body of `POST /v1/dead-letters/replay`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct ReplayBody {
    outbox: Option<String>,
    #[serde(default)]
    ids: Vec<i64>,
    #[serde(default)]
    vouch: Vec<i64>,
    #[serde(default)]
    dry_run: bool,
}

/// The body of `POST /v1/republish`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RepublishBody {
    pub outbox: Option<String>,
    pub aggregate_id: Option<String>,
    pub aggregate_type: Option<String>,
    #[serde(default)]
    pub ids: Vec<String>,
    pub since: Option<String>,
    pub until: Option<String>,
    #[serde(default)]
    pub dry_run: bool,
}

/// The body of `POST /v1/verify`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct VerifyBody {
    outbox: Option<String>,
    since: Option<String>,
    until: Option<String>,
}

/// `verify`'s window when the body names none.
const VERIFY_SINCE: &str = "1h";

/// What an act did: the receipt's `result`, its HTTP status, and what else it says.
struct Done {
    status: StatusCode,
    result: &'static str,
    detail: Value,
}

impl Done {
    fn new(status: StatusCode, result: &'static str, detail: Value) -> Done {
        Done { status, result, detail }
    }

    fn refused(status: StatusCode, why: String) -> Done {
        Done::new(status, "refused", json!({ "error": why }))
    }
}

fn now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default().as_secs()
}

/// The name of the act at `endpoint`.
fn name(endpoint: Endpoint) -> &'static str {
    match endpoint {
        Endpoint::Pause => "pause",
        Endpoint::Resume => "resume",
        Endpoint::Replay => "replay_dead_letters",
        Endpoint::Republish => "republish",
        Endpoint::Verify => "verify",
        _ => "none",
    }
}

/// Runs the act at `endpoint` for `caller`: the receipt, after its audit line.
pub(super) async fn act(admin: &Admin, endpoint: Endpoint, caller: &Caller, body: &[u8]) -> Answer {
    let (status, receipt) = perform(admin, endpoint, (&caller.name, "api"), body).await;
    Answer::json(status, &receipt)
}

/// The act at `endpoint`, asked by `who` through `via` (`api`, `signal <id>`), with its JSON
/// `body`: its HTTP status and receipt, after its audit line. One act at a time per process.
pub(crate) async fn perform(
    admin: &Admin,
    endpoint: Endpoint,
    (who, via): (&str, &str),
    body: &[u8],
) -> (StatusCode, Value) {
    let _one_at_a_time = admin.acting.lock().await;
    let done = match leader_elsewhere(admin).await {
        Some(refusal) => refusal,
        None => match endpoint {
            Endpoint::Pause => parsed(body, |b: PauseBody| pause(admin, who, b)).await,
            Endpoint::Resume => parsed(body, |_: Value| resume(admin)).await,
            Endpoint::Replay => parsed(body, |b: ReplayBody| replay(admin, b)).await,
            Endpoint::Republish => parsed(body, |b: RepublishBody| republish(admin, b)).await,
            Endpoint::Verify => parsed(body, |b: VerifyBody| verify(admin, (who, via), b)).await,
            other => Done::refused(StatusCode::INTERNAL_SERVER_ERROR, format!("{other:?} is not an act")),
        },
    };
    let act = name(endpoint);
    let detail = done.detail.get("error").map(Value::to_string).unwrap_or_default();
    tracing::info!(target: "outbox_relay::audit", who = %who, via, act, result = done.result, detail, "admin act");
    let receipt = json!({
        "act": act, "by": who, "at_unix_seconds": now(), "result": done.result, "detail": done.detail,
    });
    (done.status, receipt)
}

/// The audit line of an act refused before it ran (no token, a read token, no CSRF token).
pub(super) fn audit_refused(route: &Route, refused: &Answer) {
    let act = name(route.endpoint);
    let status = refused.status.as_u16();
    tracing::info!(target: "outbox_relay::audit", who = "-", act, result = "refused", status, "admin act");
}

/// The body as `B` (empty: `B`'s default), then `run` with it; a body that is not `B` is a 400.
async fn parsed<B, F>(body: &[u8], run: impl FnOnce(B) -> F) -> Done
where
    B: for<'de> Deserialize<'de> + Default,
    F: Future<Output = Done>,
{
    let body = if body.iter().all(u8::is_ascii_whitespace) {
        B::default()
    } else {
        match serde_json::from_slice(body) {
            Ok(body) => body,
            Err(e) => {
                return Done::refused(
                    StatusCode::BAD_REQUEST,
                    format!("the body is not what this act takes: {e}"),
                );
            }
        }
    };
    run(body).await
}

/// On a standby: the refusal, naming the leader when this instance knows it.
async fn leader_elsewhere(admin: &Admin) -> Option<Done> {
    if admin.health.phase() != Phase::Standby {
        return None;
    }
    let readiness = admin.health.readiness().unwrap_or_else(|why| why);
    let mut leader = readiness.strip_prefix("standby: ").map(str::to_string);
    if admin.config.source.mode == SourceMode::Replication {
        leader = slot_holder(admin).await.or(leader);
    }
    let recorded = admin.control.leader().await;
    let url = recorded.as_ref().and_then(|r| r.url.clone());
    let error = match &url {
        Some(url) => format!("this instance is a standby: acts go to the active instance, at {url}"),
        None => "this instance is a standby: acts go to the active instance".into(),
    };
    let detail = json!({
        "error": error,
        "leader": leader,
        "leader_url": url,
        "leader_instance": recorded.and_then(|r| r.instance),
    });
    Some(Done::new(StatusCode::CONFLICT, "refused", detail))
}

/// Who streams from the slot: `pid P, <application> from <address>`.
async fn slot_holder(admin: &Admin) -> Option<String> {
    let client = crate::postgres::connect(&admin.config.postgres).await.ok()?;
    let sql = "SELECT s.active_pid, a.application_name, a.client_addr::text FROM pg_replication_slots s \
               LEFT JOIN pg_stat_activity a ON a.pid = s.active_pid WHERE s.slot_name = $1 AND s.active_pid IS NOT NULL";
    let row = client.query_opt(sql, &[&admin.config.replication.slot]).await.ok()??;
    let (pid, name, address): (i32, Option<String>, Option<String>) = (row.get(0), row.get(1), row.get(2));
    let from = address.unwrap_or_else(|| "a local socket".into());
    Some(format!("pid {pid}, {} from {from}", name.unwrap_or_default()))
}

/// Pauses this instance at once, then writes the pause where the relay's other instances read
/// it at a take-over; the receipt says whether that write took (`shared`).
async fn pause(admin: &Admin, who: &str, body: PauseBody) -> Done {
    let pause = admin.health.pause();
    let reason = body.reason.filter(|r| !r.trim().is_empty()).map(|r| r.chars().take(500).collect());
    let result = if pause.pause(who, reason) { "paused" } else { "already_paused" };
    let paused = pause.state();
    let mut detail = json!({ "paused": paused });
    shared(admin.control.share(paused.as_ref()).await, &mut detail);
    Done::new(StatusCode::OK, result, detail)
}

async fn resume(admin: &Admin) -> Done {
    let result = if admin.health.pause().resume() { "resumed" } else { "not_paused" };
    let mut detail = json!({ "paused": Value::Null });
    shared(admin.control.share(None).await, &mut detail);
    Done::new(StatusCode::OK, result, detail)
}

/// `shared` (and why not) in a pause's or resume's receipt.
fn shared(written: Result<(), String>, detail: &mut Value) {
    detail["shared"] = json!(written.is_ok());
    if let Err(why) = written {
        detail["shared_error"] = json!(format!(
            "this instance is {}, but the relay's other instances will not know it after a failover: {why}",
            if detail["paused"].is_null() { "resumed" } else { "paused" }
        ));
    }
}

async fn replay(admin: &Admin, body: ReplayBody) -> Done {
    let needs = (!body.ids.is_empty() || !body.vouch.is_empty()).then_some("ids");
    let outbox = match super::reads::chosen(admin, body.outbox.as_deref(), needs.or(Some("replay"))) {
        Ok(outboxes) => outboxes[0],
        Err(refused) => return Done::refused(refused.status, refused.body.trim().to_string()),
    };
    if let Some(refused) = paused(admin).filter(|_| !body.dry_run) {
        return refused;
    }
    let options = crate::ops::replay::Options { ids: body.ids, vouched: body.vouch, dry_run: body.dry_run };
    match crate::ops::replay::live(&admin.config, outbox, &options, &admin.leader).await {
        Ok(outcome) => {
            let result = match (outcome.dry_run, outcome.refused) {
                (true, _) => "dry_run",
                (false, 0) => "replayed",
                (false, _) if outcome.replayed > 0 => "partly_replayed",
                (false, _) => "not_replayed",
            };
            let detail = json!({
                "outbox": outbox.name, "replayed": outcome.replayed, "refused": outcome.refused,
                "lines": outcome.lines,
            });
            Done::new(StatusCode::OK, result, detail)
        }
        Err(e) => failed(e),
    }
}

/// The refusal of a live act while paused: the session sends nothing until resumed.
fn paused(admin: &Admin) -> Option<Done> {
    let paused = admin.health.pause().state()?;
    Some(Done::refused(
        StatusCode::CONFLICT,
        format!(
            "{}: the relay sends nothing until resumed -- resume it (POST /v1/resume), then ask again",
            paused.said()
        ),
    ))
}

/// An act that could not finish: 502 when PostgreSQL or Kafka failed it, 409 when no active
/// session of this process served it (it ended, or lost its leadership, meanwhile).
fn failed(e: crate::error::RelayError) -> Done {
    let status = match e {
        crate::error::RelayError::Standby(_) => StatusCode::CONFLICT,
        _ => StatusCode::BAD_GATEWAY,
    };
    Done::new(status, "failed", json!({ "error": e.to_string() }))
}

async fn republish(admin: &Admin, body: RepublishBody) -> Done {
    let outbox = match super::reads::chosen(admin, body.outbox.as_deref(), Some("republish")) {
        Ok(outboxes) => outboxes[0],
        Err(refused) => return Done::refused(refused.status, refused.body.trim().to_string()),
    };
    let options = match republish_options(body) {
        Ok(options) => options,
        Err(why) => return Done::refused(StatusCode::BAD_REQUEST, why),
    };
    if let Some(refused) = paused(admin).filter(|_| !options.dry_run) {
        return refused;
    }
    match crate::ops::republish::live(&admin.config, outbox, &options, &admin.leader).await {
        Ok(outcome) => {
            let result = match (outcome.dry_run, outcome.sent, outcome.refused) {
                (true, _, _) => "dry_run",
                (false, 0, 0) if outcome.not_in_kafka == 0 => "nothing_chosen",
                (false, 0, 0) => "not_republished",
                (false, _, 0) => "republished",
                (false, 0, _) => "not_republished",
                (false, _, _) => "partly_republished",
            };
            let detail = json!({
                "outbox": outbox.name, "sent": outcome.sent, "refused": outcome.refused,
                "not_in_kafka": outcome.not_in_kafka, "lines": outcome.lines,
            });
            Done::new(StatusCode::OK, result, detail)
        }
        Err(e) => failed(e),
    }
}

/// What `body` chooses, as the command's options; at least one of aggregate, ids, since.
pub(crate) fn republish_options(body: RepublishBody) -> Result<crate::ops::republish::Options, String> {
    if body.aggregate_id.is_none() && body.ids.is_empty() && body.since.is_none() {
        return Err(
            "choose the events: aggregate_id (with aggregate_type), ids, or since (with until)".into()
        );
    }
    if body.aggregate_type.is_some() && body.aggregate_id.is_none() {
        return Err("aggregate_type needs aggregate_id".into());
    }
    let aggregate = body.aggregate_id.map(|id| (body.aggregate_type, id));
    Ok(crate::ops::republish::Options {
        aggregate,
        ids: body.ids,
        since: body.since,
        until: body.until,
        dry_run: body.dry_run,
    })
}

async fn verify(admin: &Admin, asked_by: (&str, &str), body: VerifyBody) -> Done {
    let outboxes = match super::reads::chosen(admin, body.outbox.as_deref(), None) {
        Ok(outboxes) => outboxes,
        Err(refused) => return Done::refused(refused.status, refused.body.trim().to_string()),
    };
    let options = crate::ops::verify::Options {
        since: body.since.or_else(|| Some(VERIFY_SINCE.into())),
        until: body.until,
        wait: Duration::from_secs(5),
        show: 10,
    };
    let mut reports = Vec::new();
    let mut codes = Vec::new();
    for outbox in outboxes {
        match crate::ops::verify::run(&admin.config, outbox, &options).await {
            Ok(report) => {
                codes.push(report.exit_code());
                reports.push(json!({ "outbox": outbox.name, "verdict": report.verdict(), "report": report }));
            }
            Err(e) => return Done::new(StatusCode::BAD_GATEWAY, "failed", json!({ "error": e.to_string() })),
        }
    }
    use crate::ops::verify::report::{EXIT_FOUND, EXIT_PENDING};
    let result = match (codes.contains(&EXIT_FOUND), codes.contains(&EXIT_PENDING)) {
        (true, _) => "found_problems",
        (false, true) => "pending",
        (false, false) => "all_there",
    };
    let detail = json!({ "since": options.since, "outboxes": reports });
    super::verification::keep(admin, asked_by, result, &detail);
    Done::new(StatusCode::OK, result, detail)
}
