//! The API's acts (POST): pause, resume, replay dead letters, verify now. Each answers with a
//! receipt and writes one audit line.
//!
//! Invariants:
//! - one audit line per act, done or refused (target `outbox_relay::audit`, fields `who`, `act`,
//!   `result`, and `detail`), never with a token or a body's secrets in it;
//! - a standby refuses every act with 409, naming the leader when it can: acts belong to the
//!   active instance (pausing a standby would pause nothing; replaying beside the leader is the
//!   leader's job);
//! - acts run one at a time ([`super::Admin`]'s lock): two replays never race for one letter in
//!   one process, and a verify does not overlap a replay it would report on.

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
        Endpoint::Verify => "verify",
        _ => "none",
    }
}

/// Runs the act at `endpoint` for `caller`: the receipt, after its audit line.
pub(super) async fn act(admin: &Admin, endpoint: Endpoint, caller: &Caller, body: &[u8]) -> Answer {
    let _one_at_a_time = admin.acting.lock().await;
    let done = match leader_elsewhere(admin).await {
        Some(refusal) => refusal,
        None => match endpoint {
            Endpoint::Pause => parsed(body, |b: PauseBody| async { pause(admin, caller, b) }).await,
            Endpoint::Resume => parsed(body, |_: Value| async { resume(admin) }).await,
            Endpoint::Replay => parsed(body, |b: ReplayBody| replay(admin, b)).await,
            Endpoint::Verify => parsed(body, |b: VerifyBody| verify(admin, b)).await,
            other => Done::refused(StatusCode::INTERNAL_SERVER_ERROR, format!("{other:?} is not an act")),
        },
    };
    let act = name(endpoint);
    let detail = done.detail.get("error").map(Value::to_string).unwrap_or_default();
    tracing::info!(target: "outbox_relay::audit", who = %caller.name, act, result = done.result, detail, "admin act");
    let receipt = json!({
        "act": act, "by": caller.name, "at_unix_seconds": now(), "result": done.result, "detail": done.detail,
    });
    Answer::json(done.status, &receipt)
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
    let detail = json!({
        "error": "this instance is a standby: acts go to the active instance",
        "leader": leader,
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

fn pause(admin: &Admin, caller: &Caller, body: PauseBody) -> Done {
    let pause = admin.health.pause();
    let reason = body.reason.filter(|r| !r.trim().is_empty()).map(|r| r.chars().take(500).collect());
    let result = if pause.pause(&caller.name, reason) { "paused" } else { "already_paused" };
    Done::new(StatusCode::OK, result, json!({ "paused": pause.state() }))
}

fn resume(admin: &Admin) -> Done {
    let result = if admin.health.pause().resume() { "resumed" } else { "not_paused" };
    Done::new(StatusCode::OK, result, json!({ "paused": Value::Null }))
}

async fn replay(admin: &Admin, body: ReplayBody) -> Done {
    let needs = (!body.ids.is_empty() || !body.vouch.is_empty()).then_some("ids");
    let outbox = match super::reads::chosen(admin, body.outbox.as_deref(), needs.or(Some("replay"))) {
        Ok(outboxes) => outboxes[0],
        Err(refused) => return Done::refused(refused.status, refused.body.trim().to_string()),
    };
    let options = crate::ops::replay::Options { ids: body.ids, vouched: body.vouch, dry_run: body.dry_run };
    match crate::ops::replay::run(&admin.config, outbox, &options).await {
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
        Err(e) => Done::new(StatusCode::BAD_GATEWAY, "failed", json!({ "error": e.to_string() })),
    }
}

async fn verify(admin: &Admin, body: VerifyBody) -> Done {
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
    Done::new(StatusCode::OK, result, json!({ "since": options.since, "outboxes": reports }))
}
