//! The HTTP API: `POST /orders` under an `Idempotency-Key`, `GET /healthz`, `GET /metrics`.
//!
//! | request | answer |
//! |---|---|
//! | no `Authorization: Bearer <JWT>`, or a token that fails verification (`auth`) | 401, `WWW-Authenticate: Bearer`, before the body is read; why is logged, not sent |
//! | more than the caller's `rate_limit` | 429, `Retry-After`, before the body is read |
//! | a body longer than `http.max_body_bytes` | 413, nothing written |
//! | no `Idempotency-Key`, or an empty or non-ASCII one | 400, nothing written |
//! | body not `{"total_cents": 1..}` (a `customer_id` may be given too) | 400 naming the field, nothing written |
//! | a body whose `customer_id` is not the caller (the token's `sub`) | 403, nothing written |
//! | a new key | 201 with the order; order + `OrderPlaced` event + stored response in one transaction |
//! | a key seen with the same request | the stored status and body, `Idempotent-Replayed: true` |
//! | a key seen with a different request | 422 |
//! | a key another attempt holds, for longer than `idempotency.wait_ms` | 409, `Retry-After` |
//! | PostgreSQL unreachable or a transient error | 503, `Retry-After`; the key is freed for the retry, which tells whether the order was written |
//! | not done within `http.request_timeout_ms` | 503, `Retry-After`; the work goes on, and a retry with the same key tells how it ended |
//! | the database refuses the write (a privilege, a constraint), or any other internal error | 500 `{"error": "internal error", "request_id": ...}`; the cause is logged under that id, not sent |
//!
//! The customer is the caller: the token's subject, never the body. A key is the caller's own:
//! the same `Idempotency-Key` from two callers names two requests. Every answer carries an
//! `X-Request-Id`, which the service's log lines for the request carry too.
//!
//! A request's work runs in a task of its own: a client that hangs up mid-request does not cancel
//! the transaction half-way, so its retry finds the finished response rather than a key in
//! progress until the lease runs out.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Extension, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use prometheus::{Encoder, IntCounterVec, Opts, Registry, TextEncoder};
use serde_json::json;
use tracing::Instrument;

use crate::auth::{Caller, Verifier};
use crate::config::OrdersConfig;
use crate::idempotency::{self, Begin, Lease};
use crate::order::{self, OrderRequest, Refusal, Written};
use crate::pool::{Pool, Session};
use crate::rate_limit::RateLimiter;
use outbox_relay::error::RelayError;
use outbox_relay::observe::trace::{Kind, TRACEPARENT, Value, tracer};

pub const IDEMPOTENCY_KEY: &str = "idempotency-key";
pub const REPLAYED: &str = "idempotent-replayed";
pub const REQUEST_ID: &str = "x-request-id";

pub struct App {
    pub pool: Pool,
    pub config: OrdersConfig,
    verifier: Verifier,
    limiter: RateLimiter,
    requests: IntCounterVec,
    registry: Registry,
}

/// The id of one request: in its `X-Request-Id` answer header, its 500 body, and its log lines.
#[derive(Debug, Clone)]
pub struct RequestId(pub String);

impl RequestId {
    fn new() -> RequestId {
        RequestId(format!("{:032x}", rand::random::<u128>()))
    }
}

impl App {
    pub fn new(config: OrdersConfig, verifier: Verifier) -> App {
        let pool = Pool::new(config.postgres.clone(), config.http.pool_size, config.http.pool_wait());
        let limiter = RateLimiter::new(&config.rate_limit);
        let registry = Registry::new();
        let requests = IntCounterVec::new(
            Opts::new("orders_requests_total", "POST /orders answers, by outcome"),
            &["outcome"],
        )
        .expect("valid metric");
        registry.register(Box::new(requests.clone())).expect("registered once");
        App { pool, config, verifier, limiter, requests, registry }
    }
}

pub fn router(app: Arc<App>) -> Router {
    // (the layers run outside in: the caller is authenticated and within its rate limit before
    // a byte of the body is read, and then at most `http.max_body_bytes` of it)
    let orders = post(post_order)
        .layer(DefaultBodyLimit::max(app.config.http.max_body_bytes))
        .layer(middleware::from_fn_with_state(app.clone(), authenticate));
    Router::new()
        .route("/orders", orders)
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/metrics", get(metrics))
        .layer(middleware::from_fn_with_state(app.clone(), per_request))
        .with_state(app)
}

/// Around every request: its id (header and log span) and `http.request_timeout_ms`, which
/// covers reading the body too. A request's work runs in a task of its own and is not cut short
/// by the timeout: a retry with the same key gets its outcome.
async fn per_request(State(app): State<Arc<App>>, mut request: Request, next: Next) -> Response {
    let id = RequestId::new();
    request.extensions_mut().insert(id.clone());
    let span = tracing::info_span!("request", id = %id.0);
    let timeout = app.config.http.request_timeout();
    let answer = tokio::time::timeout(timeout, next.run(request)).instrument(span.clone()).await;
    let mut response = answer.unwrap_or_else(|_| {
        span.in_scope(|| {
            tracing::warn!(?timeout, "request not done within http.request_timeout_ms: answered 503")
        });
        app.requests.with_label_values(&["timeout"]).inc();
        let message = "the request took too long; the order may or may not have been written: retry with the \
                       same key, which tells";
        Reply::error(503, "timeout", message.into()).retry_after(Duration::from_secs(1)).into_response()
    });
    response.headers_mut().insert(REQUEST_ID, HeaderValue::from_str(&id.0).expect("hex digits"));
    response
}

/// One answer: status, JSON body, and the label it is counted under.
struct Reply {
    status: u16,
    body: serde_json::Value,
    outcome: &'static str,
    retry_after: Option<Duration>,
    replayed: bool,
    /// 401: ask for a bearer token.
    challenge: bool,
}

impl Reply {
    fn ok(status: u16, body: serde_json::Value, outcome: &'static str) -> Reply {
        Reply { status, body, outcome, retry_after: None, replayed: false, challenge: false }
    }

    fn error(status: u16, outcome: &'static str, message: String) -> Reply {
        Reply::ok(status, json!({ "error": message, "code": outcome }), outcome)
    }

    /// 500 saying nothing of the cause, which the caller has logged under `id`.
    fn internal(id: &RequestId) -> Reply {
        let body = json!({
            "error": "internal error: the service's log has the details under this request_id",
            "code": "error",
            "request_id": id.0,
        });
        Reply::ok(500, body, "error")
    }

    /// 401 saying nothing of what was wrong with the token (the log says).
    fn unauthorized() -> Reply {
        let message = "a bearer token is required (Authorization: Bearer <token>)".into();
        Reply { challenge: true, ..Reply::error(401, "unauthorized", message) }
    }

    fn retry_after(mut self, after: Duration) -> Reply {
        self.retry_after = Some(after);
        self
    }
}

impl IntoResponse for Reply {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let mut response = (status, axum::Json(self.body)).into_response();
        if let Some(after) = self.retry_after {
            let secs = (after.as_secs_f64().ceil() as u64).max(1).to_string();
            response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_str(&secs).expect("digits"));
        }
        if self.replayed {
            response.headers_mut().insert(REPLAYED, HeaderValue::from_static("true"));
        }
        if self.challenge {
            response.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        response
    }
}

/// Before `POST /orders` reads its body: the caller, within its rate limit, or the 401 or 429
/// (the body left unread; hyper then closes the connection rather than read it).
async fn authenticate(State(app): State<Arc<App>>, mut request: Request, next: Next) -> Response {
    match admit(&app, request.headers()) {
        Ok(caller) => {
            request.extensions_mut().insert(caller);
            next.run(request).await
        }
        Err(reply) => {
            app.requests.with_label_values(&[reply.outcome]).inc();
            reply.into_response()
        }
    }
}

async fn post_order(
    State(app): State<Arc<App>>,
    Extension(id): Extension<RequestId>,
    Extension(caller): Extension<Caller>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let body = match body {
        Ok(body) => body,
        Err(rejection) => {
            let status = rejection.status().as_u16();
            let limit = app.config.http.max_body_bytes;
            let message = match status {
                413 => format!(
                    "the body is longer than http.max_body_bytes ({limit} bytes): an order is a small JSON object"
                ),
                _ => format!("the body could not be read: {rejection}"),
            };
            let reply = Reply::error(status, if status == 413 { "too_large" } else { "invalid" }, message);
            app.requests.with_label_values(&[reply.outcome]).inc();
            return reply.into_response();
        }
    };
    let span = tracer().and_then(|t| t.begin(header_value(&headers, TRACEPARENT), SystemTime::now()));
    let traceparent = span.as_ref().map(|s| s.context.to_string());
    let (task_app, task_id) = (app.clone(), id.clone());
    let work = async move {
        let traceparent = traceparent.as_deref().or_else(|| header_value(&headers, TRACEPARENT));
        place(&task_app, &task_id, &caller, (&headers, traceparent), &body).await
    };
    let reply = match tokio::spawn(work.in_current_span()).await {
        Ok(reply) => reply,
        Err(e) => {
            tracing::error!(error = %e, "the request's task failed");
            Reply::internal(&id)
        }
    };
    app.requests.with_label_values(&[reply.outcome]).inc();
    if let (Some(tracer), Some(span)) = (tracer(), span) {
        let attributes = vec![
            ("http.request.method", Value::from("POST")),
            ("http.route", "/orders".into()),
            ("http.response.status_code", Value::Int(i64::from(reply.status))),
            ("orders.outcome", reply.outcome.into()),
        ];
        tracer.finish(span.finish("POST /orders".into(), Kind::Server, attributes));
    }
    reply.into_response()
}

fn header_value<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers.get(name).and_then(|v| v.to_str().ok())
}

/// Who is calling, within their rate limit; or the 401 or 429 to answer.
fn admit(app: &App, headers: &HeaderMap) -> Result<Caller, Reply> {
    let caller = app.verifier.verify(headers).map_err(|refused| {
        tracing::warn!(reason = %refused, "request refused: not authenticated");
        Reply::unauthorized()
    })?;
    app.limiter.admit(&caller.subject).map_err(|wait| {
        tracing::info!(caller = %caller.subject, ?wait, "request refused: over rate_limit");
        let message = "too many requests from this caller: retry after the Retry-After seconds".into();
        Reply::error(429, "rate_limited", message).retry_after(wait)
    })?;
    Ok(caller)
}

/// Places the order; `traceparent`, the request's span (or the caller's header when the request
/// is not traced), travels on as the event's header.
async fn place(
    app: &App,
    id: &RequestId,
    caller: &Caller,
    (headers, traceparent): (&HeaderMap, Option<&str>),
    body: &[u8],
) -> Reply {
    let key = match idempotency_key(headers) {
        Ok(key) => key,
        Err(message) => return Reply::error(400, "missing_key", message),
    };
    let request = match OrderRequest::parse(body, &caller.subject) {
        Ok(request) => request,
        Err(Refusal::Invalid(message)) => return Reply::error(400, "invalid", message),
        Err(Refusal::OtherCustomer) => {
            tracing::warn!(caller = %caller.subject, "request refused: the body names another customer");
            let message = "customer_id: an order is placed for the caller (the token's subject); \
                           leave customer_id out, or give the caller's own";
            return Reply::error(403, "forbidden", message.into());
        }
    };
    let fingerprint = idempotency::fingerprint("POST", "/orders", &request.canonical());
    let session = match app.pool.get().await {
        Ok(session) => session,
        Err(e) => return unavailable(key, &e.to_string()),
    };
    let config = &app.config.idempotency;
    let lease = match idempotency::begin(&session, config, &caller.subject, key, &fingerprint).await {
        Ok(Begin::Owned(lease)) => lease,
        Ok(Begin::Replay { status, body }) => {
            return Reply { replayed: true, ..Reply::ok(status, body, "replayed") };
        }
        Ok(Begin::Mismatch) => return Reply::error(422, "key_reused", mismatch(key)),
        Ok(Begin::Busy { retry_after }) => return busy(key).retry_after(retry_after),
        Err(e) => return unavailable(key, &RelayError::Postgres(e).to_string()),
    };
    if lease.took_over {
        tracing::info!(
            key,
            token = lease.token,
            "took over a key whose attempt failed or whose lease ran out"
        );
    }
    inject_faults(app).await;
    complete(app, id, session, &lease, &request, traceparent).await
}

/// The final write under `lease`, and what it means for the client.
async fn complete(
    app: &App,
    id: &RequestId,
    mut session: Session<'_>,
    lease: &Lease,
    request: &OrderRequest,
    traceparent: Option<&str>,
) -> Reply {
    let key = lease.key.as_str();
    match order::write(&mut session, lease, request, traceparent).await {
        Ok(Written::Created(created)) => {
            tracing::info!(key, order_id = created.order_id, "order placed");
            if app.config.faults.abort_after_write {
                tracing::error!("faults.abort_after_write: aborting with the order written and not answered");
                std::process::abort();
            }
            Reply::ok(201, serde_json::to_value(&created).expect("plain fields"), "created")
        }
        Ok(Written::Fenced) => {
            tracing::warn!(key, token = lease.token, "lease taken over by another attempt: wrote nothing");
            Reply::error(409, "fenced", fenced(key)).retry_after(idempotency::FENCED_RETRY_AFTER)
        }
        Err(e) => {
            // the session may be the one that broke: the key is freed on another
            drop(session);
            if let Ok(fresh) = app.pool.get().await {
                idempotency::release(&fresh, lease).await;
            }
            if idempotency::is_transient(&e) {
                return unavailable(key, &RelayError::Postgres(e).to_string());
            }
            tracing::error!(key, error = %RelayError::Postgres(e), "order not written: the database refused it");
            Reply::internal(id)
        }
    }
}

/// The request's `Idempotency-Key`: 1 to 255 visible ASCII characters.
fn idempotency_key(headers: &HeaderMap) -> Result<&str, String> {
    let Some(value) = headers.get(IDEMPOTENCY_KEY) else {
        return Err("the Idempotency-Key header is required on POST /orders: send a new unique value \
                    (e.g. a UUID) per order, and the same value on every retry of it"
            .into());
    };
    match value.to_str() {
        Ok(key) if (1..=255).contains(&key.len()) && key.bytes().all(|b| b.is_ascii_graphic()) => Ok(key),
        _ => Err("the Idempotency-Key header must be 1 to 255 visible ASCII characters (e.g. a UUID)".into()),
    }
}

fn mismatch(key: &str) -> String {
    format!(
        "Idempotency-Key {key:?} was already used for a different request: \
         send a new key for a new order, or the original body to get the original answer"
    )
}

fn busy(key: &str) -> Reply {
    let message = format!(
        "a request with Idempotency-Key {key:?} is still in progress: retry after the Retry-After seconds"
    );
    Reply::error(409, "busy", message)
}

fn fenced(key: &str) -> String {
    format!(
        "this attempt's hold on Idempotency-Key {key:?} ran out and another attempt took it over; \
         nothing was written by this one: retry with the same key to get the outcome"
    )
}

/// A transient failure: the order may or may not have been written (a COMMIT whose answer was
/// lost), and the same key tells which.
fn unavailable(key: &str, detail: &str) -> Reply {
    tracing::warn!(key, error = %detail, "order not written now; the key is free for a retry");
    let message = "the database could not be reached, or the write failed for now; the order may or may not \
                   have been written: retry with the same key, which tells";
    Reply::error(503, "unavailable", message.into()).retry_after(Duration::from_secs(1))
}

/// `[faults]`: for tests and drills only.
async fn inject_faults(app: &App) {
    let faults = &app.config.faults;
    if faults.abort_after_claim {
        tracing::error!("faults.abort_after_claim: aborting with the key claimed and nothing written");
        std::process::abort();
    }
    if faults.pause_after_claim_ms > 0 {
        tokio::time::sleep(Duration::from_millis(faults.pause_after_claim_ms)).await;
    }
}

async fn metrics(State(app): State<Arc<App>>) -> Response {
    let mut text = Vec::new();
    TextEncoder::new().encode(&app.registry.gather(), &mut text).expect("text encoding");
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
}
