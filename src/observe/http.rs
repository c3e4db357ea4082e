//! The HTTP listener: `/metrics` (Prometheus text), `/healthz` (liveness), `/readyz` (readiness,
//! for people and `status`), `/startedz` (the kubelet's readiness probe), served by hyper
//! (HTTP/1.1) with limits, because it faces whatever can reach the pod.
//!
//! - `/healthz` is 200 while the relay's loop makes progress or waits on purpose (standby,
//!   backoff, idle); 503 when it has not ticked for twice the retry cap: restart it.
//! - `/readyz` is 200 when connected and relaying (body `active`) or healthy standby (body
//!   `standby`; a standby must be Ready or a StatefulSet rollout would stall on it), 503 while
//!   starting or degraded. The body is that one word; why (an error, a hostname, a session's
//!   role) follows it only for a client on loopback (`kubectl port-forward`, `kubectl exec`, a
//!   sidecar, the tests): the log says it too.
//! - `/startedz` is what the kubelet's readinessProbe asks: 200 once the relay has been active
//!   or standby, while its loop is alive and it is not stopping on a fatal error, whatever Kafka
//!   and PostgreSQL do now ([`Health::serving`]); its body is `/readyz`'s, so a degraded relay
//!   answers 200 `degraded`. A relay pod serves no traffic: readiness gates only rollouts and
//!   disruption budgets, and a Kafka outage that made every leader unready would hold every node
//!   drain.
//!
//! Limits: at most [`max_connections`] connections at once, and [`PROBE_RESERVE`] more that
//! answer only the probes (`/healthz`, `/readyz`, `/startedz`) and are cut after [`PROBE_HEADER_TIMEOUT`], so a probe
//! still gets in while slow clients hold every other slot (one more is accepted and closed at
//! once, so the backlog cannot grow); a request's headers must arrive within [`HEADER_TIMEOUT`]
//! and a whole connection, response included, is closed after [`CONNECTION_DEADLINE`]; only GET
//! and HEAD; an accept error (out of file descriptors) pauses the loop instead of spinning a core.

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
/// Connections beyond [`max_connections`] kept for `/healthz` and `/readyz`.
pub const PROBE_RESERVE: usize = 8;
/// A reserved connection's request must have arrived by then, so slow clients that reach the
/// reserve give it back within a second or two.
pub const PROBE_HEADER_TIMEOUT: Duration = Duration::from_secs(1);
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

/// Who asked: a request's answer depends on it.
#[derive(Debug, Clone, Copy)]
struct Peer {
    /// On loopback: `/readyz` says why, not only its word.
    local: bool,
    /// Holds a reserved slot: only `/healthz` and `/readyz` are answered.
    reserved: bool,
}

/// What `/metrics` answers: the Prometheus text exposition, rendered at each scrape (the relay's
/// [`crate::observe::metrics::Metrics::render`], or `verify --watch`'s).
pub(crate) type Exposition = fn() -> String;

/// The relay's exposition.
pub(crate) fn relay_metrics() -> String {
    metrics().render()
}

/// Binds `listen` and serves until the process ends.
pub(crate) async fn serve(
    listen: SocketAddr,
    health: Arc<Health>,
    exposition: Exposition,
) -> std::io::Result<()> {
    let listener = TcpListener::bind(listen).await?;
    let bound = listener.local_addr()?;
    let cap = max_connections();
    tracing::info!(listen = %bound, max_connections = cap, probe_reserve = PROBE_RESERVE, "serving /metrics, /healthz and /readyz");
    let slots = Arc::new(Semaphore::new(cap));
    let reserve = Arc::new(Semaphore::new(PROBE_RESERVE));
    tokio::spawn(async move {
        loop {
            let (socket, address) = match listener.accept().await {
                Ok(accepted) => accepted,
                Err(e) => {
                    tracing::debug!(error = %e, "metrics listener: accept failed");
                    tokio::time::sleep(ACCEPT_ERROR_PAUSE).await;
                    continue;
                }
            };
            // both full: the connection is dropped (closed) at once
            let (slot, reserved) = match slots.clone().try_acquire_owned() {
                Ok(slot) => (slot, false),
                Err(_) => match reserve.clone().try_acquire_owned() {
                    Ok(slot) => (slot, true),
                    Err(_) => continue,
                },
            };
            let peer = Peer { local: address.ip().to_canonical().is_loopback(), reserved };
            let (header_timeout, deadline) = if reserved {
                (PROBE_HEADER_TIMEOUT, PROBE_HEADER_TIMEOUT * 2)
            } else {
                (HEADER_TIMEOUT, CONNECTION_DEADLINE)
            };
            let health = health.clone();
            tokio::spawn(async move {
                let service = service_fn(move |request| {
                    let health = health.clone();
                    async move { Ok::<_, Infallible>(respond(&request, &health, exposition, peer)) }
                });
                let connection = http1::Builder::new()
                    .timer(TokioTimer::new())
                    .header_read_timeout(header_timeout)
                    .keep_alive(false)
                    .serve_connection(TokioIo::new(socket), service);
                let _ = tokio::time::timeout(deadline, connection).await;
                drop(slot);
            });
        }
    });
    Ok(())
}

/// `/readyz`'s answer to `peer`: the readiness word, and why only on loopback.
fn readyz(health: &Health, peer: Peer) -> (StatusCode, String) {
    said_to(health.readiness(), peer)
}

/// `/startedz`'s answer to `peer`: the kubelet's readiness, in `/readyz`'s words.
fn startedz(health: &Health, peer: Peer) -> (StatusCode, String) {
    said_to(health.serving(), peer)
}

/// An answer to `peer`: 200 or 503, the first word, and why only on loopback.
fn said_to(answer: Result<String, String>, peer: Peer) -> (StatusCode, String) {
    let (status, detail) = match answer {
        Ok(body) => (StatusCode::OK, body),
        Err(why) => (StatusCode::SERVICE_UNAVAILABLE, why),
    };
    if peer.local {
        return (status, format!("{detail}\n"));
    }
    let word = detail.split([':', ' ']).next().unwrap_or_default();
    (status, format!("{word}\n"))
}

fn respond(
    request: &Request<Incoming>,
    health: &Health,
    exposition: Exposition,
    peer: Peer,
) -> Response<Full<Bytes>> {
    const TEXT: &str = "text/plain; charset=utf-8";
    let (status, content_type, body) = if request.method() != Method::GET && request.method() != Method::HEAD
    {
        (StatusCode::METHOD_NOT_ALLOWED, TEXT, "GET only\n".to_string())
    } else {
        match request.uri().path() {
            "/metrics" if peer.reserved => (
                StatusCode::SERVICE_UNAVAILABLE,
                TEXT,
                "busy: only /healthz, /readyz and /startedz answer now\n".into(),
            ),
            "/metrics" => (StatusCode::OK, "text/plain; version=0.0.4; charset=utf-8", exposition()),
            "/healthz" if health.live() => (StatusCode::OK, TEXT, "ok\n".into()),
            "/healthz" => (
                StatusCode::SERVICE_UNAVAILABLE,
                TEXT,
                "the relay loop made no progress: restart it\n".into(),
            ),
            "/readyz" => {
                let (status, body) = readyz(health, peer);
                (status, TEXT, body)
            }
            "/startedz" => {
                let (status, body) = startedz(health, peer);
                (status, TEXT, body)
            }
            _ => (StatusCode::NOT_FOUND, TEXT, "try /metrics, /healthz, /readyz or /startedz\n".into()),
        }
    };
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    response
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::observe::health::Phase;

    #[test]
    fn readyz_says_why_only_on_loopback() {
        let health = Health::new(Duration::from_secs(1));
        health.set_phase(Phase::Retrying("postgres: db.internal:5432: connection refused".into()));
        let stranger = Peer { local: false, reserved: false };
        let local = Peer { local: true, reserved: true };
        assert_eq!(readyz(&health, stranger), (StatusCode::SERVICE_UNAVAILABLE, "degraded\n".into()));
        let (status, body) = readyz(&health, local);
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(body.contains("db.internal:5432"), "{body}");
        health.set_phase(Phase::Standby);
        assert_eq!(readyz(&health, stranger), (StatusCode::OK, "standby\n".into()));
        health.set_phase(Phase::Active);
        assert_eq!(readyz(&health, stranger), (StatusCode::OK, "active\n".into()));
    }

    #[test]
    fn startedz_stays_ready_through_a_degraded_session_once_started() {
        let health = Health::new(Duration::from_secs(1));
        let stranger = Peer { local: false, reserved: false };
        assert_eq!(startedz(&health, stranger), (StatusCode::SERVICE_UNAVAILABLE, "starting\n".into()));
        health.set_phase(Phase::Active);
        health.set_phase(Phase::Retrying("kafka: all brokers down".into()));
        assert_eq!(readyz(&health, stranger), (StatusCode::SERVICE_UNAVAILABLE, "degraded\n".into()));
        assert_eq!(startedz(&health, stranger), (StatusCode::OK, "degraded\n".into()));
    }
}
