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
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use crate::health::Health;
use crate::metrics::metrics;

/// Binds `listen` and serves until the process ends.
pub(crate) async fn serve(listen: SocketAddr, health: Arc<Health>) -> std::io::Result<()> {
    let listener = TcpListener::bind(listen).await?;
    let bound = listener.local_addr()?;
    tracing::info!(listen = %bound, "serving /metrics, /healthz and /readyz");
    tokio::spawn(async move {
        loop {
            let Ok((mut socket, _)) = listener.accept().await else { continue };
            let health = health.clone();
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
                let (status, content_type, body) = respond(path, &health);
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

fn respond(path: &str, health: &Health) -> (&'static str, &'static str, String) {
    const TEXT: &str = "text/plain; charset=utf-8";
    match path {
        "/metrics" => ("200 OK", "text/plain; version=0.0.4; charset=utf-8", metrics().render()),
        "/healthz" if health.live() => ("200 OK", TEXT, "ok\n".into()),
        "/healthz" => {
            ("503 Service Unavailable", TEXT, "the relay loop made no progress: restart it\n".into())
        }
        "/readyz" => match health.readiness() {
            Ok(body) => ("200 OK", TEXT, format!("{body}\n")),
            Err(why) => ("503 Service Unavailable", TEXT, format!("{why}\n")),
        },
        _ => ("404 Not Found", TEXT, "try /metrics, /healthz or /readyz\n".into()),
    }
}
