//! The HTTP listener: `/metrics` (Prometheus text), `/healthz` (liveness), `/readyz` (readiness).
//!
//! A deliberately tiny HTTP/1.1 responder (one request per connection, GET only): the three
//! endpoints are read by Prometheus and the kubelet, and a web framework would be most of the
//! binary.
//!
//! - `/healthz` is 200 while the relay's loop makes progress or waits on purpose (standby,
//!   backoff, idle); 503 when it has not ticked for twice the retry cap: restart it.
//! - `/readyz` is 200 when connected and relaying (body `active`) or healthy standby (body
//!   `standby`; a standby must be Ready or a StatefulSet rollout would stall on it), 503 while
//!   starting or degraded (body says why).

use std::net::SocketAddr;
use std::sync::Mutex;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use crate::metrics::metrics;

/// What the relay is doing, for `/readyz` and the leader gauge.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum State {
    Starting,
    Active,
    Standby,
    Degraded(String),
}

pub struct Health {
    last_tick_ms: AtomicU64,
    stale_after_ms: AtomicU64,
    state: Mutex<State>,
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default().as_millis() as u64
}

impl Health {
    /// The loop is alive: call it every iteration, including deliberate waits.
    pub fn tick(&self) {
        self.last_tick_ms.store(now_ms(), Ordering::Relaxed);
    }

    pub fn set(&self, state: State) {
        self.tick();
        metrics().leader.set(i64::from(state == State::Active));
        *self.state.lock().unwrap() = state;
    }

    pub fn state(&self) -> State {
        self.state.lock().unwrap().clone()
    }

    fn live(&self) -> bool {
        now_ms().saturating_sub(self.last_tick_ms.load(Ordering::Relaxed))
            < self.stale_after_ms.load(Ordering::Relaxed)
    }
}

/// The process's health. Liveness allows for the longest deliberate wait: the retry cap.
pub fn health() -> &'static Health {
    static HEALTH: OnceLock<Health> = OnceLock::new();
    HEALTH.get_or_init(|| Health {
        last_tick_ms: AtomicU64::new(now_ms()),
        stale_after_ms: AtomicU64::new(120_000),
        state: Mutex::new(State::Starting),
    })
}

/// Sets how long the loop may stay silent before `/healthz` fails: twice the longest
/// deliberate wait (the retry cap), at least a minute.
pub fn configure_liveness(max_backoff: Duration) {
    let stale = (max_backoff * 2).max(Duration::from_secs(60));
    health().stale_after_ms.store(stale.as_millis() as u64, Ordering::Relaxed);
}

/// Binds `listen` and serves until the process ends.
pub async fn serve(listen: SocketAddr) -> std::io::Result<()> {
    let listener = TcpListener::bind(listen).await?;
    let bound = listener.local_addr()?;
    tracing::info!(listen = %bound, "serving /metrics, /healthz and /readyz");
    tokio::spawn(async move {
        loop {
            let Ok((mut socket, _)) = listener.accept().await else { continue };
            tokio::spawn(async move {
                let mut buf = vec![0u8; 8192];
                let mut len = 0;
                while len < buf.len() {
                    match tokio::time::timeout(Duration::from_secs(5), socket.read(&mut buf[len..])).await {
                        Ok(Ok(0)) | Err(_) | Ok(Err(_)) => break,
                        Ok(Ok(n)) => len += n,
                    }
                    if buf[..len].windows(4).any(|w| w == b"\r\n\r\n") {
                        break;
                    }
                }
                let request = String::from_utf8_lossy(&buf[..len]);
                let path = request.split_whitespace().nth(1).unwrap_or("/");
                let (status, content_type, body) = respond(path);
                let head = format!(
                    "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                    body.len()
                );
                let _ = socket.write_all(head.as_bytes()).await;
                let _ = socket.write_all(body.as_bytes()).await;
                let _ = socket.shutdown().await;
            });
        }
    });
    Ok(())
}

fn respond(path: &str) -> (&'static str, &'static str, String) {
    const TEXT: &str = "text/plain; charset=utf-8";
    match path {
        "/metrics" => ("200 OK", "text/plain; version=0.0.4; charset=utf-8", metrics().render()),
        "/healthz" if health().live() => ("200 OK", TEXT, "ok\n".into()),
        "/healthz" => {
            ("503 Service Unavailable", TEXT, "the relay loop made no progress: restart it\n".into())
        }
        "/readyz" => match health().state() {
            State::Active => ("200 OK", TEXT, "active\n".into()),
            State::Standby => ("200 OK", TEXT, "standby: another instance is active\n".into()),
            State::Starting => ("503 Service Unavailable", TEXT, "starting\n".into()),
            State::Degraded(why) => ("503 Service Unavailable", TEXT, format!("degraded: {why}\n")),
        },
        _ => ("404 Not Found", TEXT, "try /metrics, /healthz or /readyz\n".into()),
    }
}
