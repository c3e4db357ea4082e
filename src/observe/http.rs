//! The HTTP listener: `/metrics` (Prometheus text), `/healthz` (liveness), `/readyz` (readiness),
//! served by hyper (HTTP/1.1) with limits, because it faces whatever can reach the pod.
//!
//! - `/healthz` is 200 while the relay's loop makes progress or waits on purpose (standby,
//!   backoff, idle); 503 when it has not ticked for twice the retry cap: restart it.
//! - `/readyz` is 200 when connected and relaying (body `active`) or healthy standby (body
//!   `standby`; a standby must be Ready or a StatefulSet rollout would stall on it), 503 while
//!   starting or degraded (body says why).
//!
//! Limits: at most [`max_connections`] connections at once (one more is accepted and closed at
//! once, so the backlog cannot grow); a request's headers must arrive within
//! [`HEADER_TIMEOUT`] and a whole connection, response included, is closed after
//! [`CONNECTION_DEADLINE`]; only GET and HEAD; an accept error (out of file descriptors) pauses
//! the loop instead of spinning a core.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::header::{CONTENT_TYPE, HeaderValue};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

use crate::observe::health::Health;
use crate::observe::metrics::metrics;

/// A request's headers must have arrived by then.
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(5);
/// A connection is closed this long after it was accepted, whatever it is doing.
pub const CONNECTION_DEADLINE: Duration = Duration::from_secs(30);
/// Pause after an accept error (e.g. EMFILE), so a persistent one does not spin a core.
const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(100);

/// Connections served at once: 4,096, or a quarter of the file descriptor limit when that is
/// lower, so scrapers and probes can never take the descriptors the relay needs for PostgreSQL
/// and Kafka.
pub fn max_connections() -> usize {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit only writes the struct it is given.
    let got = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } == 0;
    let quarter = if got { (limit.rlim_cur / 4) as usize } else { 256 };
    quarter.clamp(16, 4_096)
}

/// Binds `listen` and serves until the process ends.
pub(crate) async fn serve(listen: SocketAddr, health: Arc<Health>) -> std::io::Result<()> {
    let listener = TcpListener::bind(listen).await?;
    let bound = listener.local_addr()?;
    let cap = max_connections();
    tracing::info!(listen = %bound, max_connections = cap, "serving /metrics, /healthz and /readyz");
    let slots = Arc::new(Semaphore::new(cap));
    tokio::spawn(async move {
        loop {
            let socket = match listener.accept().await {
                Ok((socket, _)) => socket,
                Err(e) => {
                    tracing::debug!(error = %e, "metrics listener: accept failed");
                    tokio::time::sleep(ACCEPT_ERROR_PAUSE).await;
                    continue;
                }
            };
            // full: the connection is dropped (closed) at once
            let Ok(slot) = slots.clone().try_acquire_owned() else { continue };
            let health = health.clone();
            tokio::spawn(async move {
                let service = service_fn(move |request| {
                    let health = health.clone();
                    async move { Ok::<_, Infallible>(respond(&request, &health)) }
                });
                let connection = http1::Builder::new()
                    .timer(TokioTimer::new())
                    .header_read_timeout(HEADER_TIMEOUT)
                    .keep_alive(false)
                    .serve_connection(TokioIo::new(socket), service);
                let _ = tokio::time::timeout(CONNECTION_DEADLINE, connection).await;
                drop(slot);
            });
        }
    });
    Ok(())
}

fn respond(request: &Request<Incoming>, health: &Health) -> Response<Full<Bytes>> {
    const TEXT: &str = "text/plain; charset=utf-8";
    let (status, content_type, body) = if request.method() != Method::GET && request.method() != Method::HEAD
    {
        (StatusCode::METHOD_NOT_ALLOWED, TEXT, "GET only\n".to_string())
    } else {
        match request.uri().path() {
            "/metrics" => (StatusCode::OK, "text/plain; version=0.0.4; charset=utf-8", metrics().render()),
            "/healthz" if health.live() => (StatusCode::OK, TEXT, "ok\n".into()),
            "/healthz" => (
                StatusCode::SERVICE_UNAVAILABLE,
                TEXT,
                "the relay loop made no progress: restart it\n".into(),
            ),
            "/readyz" => match health.readiness() {
                Ok(body) => (StatusCode::OK, TEXT, format!("{body}\n")),
                Err(why) => (StatusCode::SERVICE_UNAVAILABLE, TEXT, format!("{why}\n")),
            },
            _ => (StatusCode::NOT_FOUND, TEXT, "try /metrics, /healthz or /readyz\n".into()),
        }
    };
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    response
}
