//! Serving the router over HTTP/1.1 with the limits `axum::serve` does not have: a connection
//! that does not finish its request headers within `http.header_read_timeout_ms` (a slowloris
//! client, or one idle between requests) is closed, and at most `http.max_connections` are
//! served at once (the rest wait in the listen backlog), each buffering at most
//! `http.max_header_bytes` of a request's head. So a connection holds a bounded amount of
//! memory until its caller is authenticated (`api` checks the token before it reads a body, and
//! reads at most `http.max_body_bytes` of one). The request timeout and the pool's bounded wait
//! live in `api` and `pool`.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

use crate::config::HttpConfig;

/// How long a stop waits for the requests in hand before leaving them.
const DRAIN_MAX: Duration = Duration::from_secs(30);

/// Serves `router` on `listener` until `stop` resolves, then finishes the requests in hand
/// (at most [`DRAIN_MAX`]).
pub async fn serve(listener: TcpListener, router: Router, http: &HttpConfig, stop: impl Future<Output = ()>) {
    let connections = Arc::new(Semaphore::new(http.max_connections));
    let graceful = GracefulShutdown::new();
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(http.header_read_timeout())
        .max_buf_size(http.max_header_bytes);
    tokio::pin!(stop);
    loop {
        let permit = tokio::select! {
            permit = connections.clone().acquire_owned() => permit.expect("the semaphore is never closed"),
            () = &mut stop => break,
        };
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    // out of file descriptors, most likely: let some close
                    tracing::warn!(error = %e, "could not accept a connection; trying again in 100 ms");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            () = &mut stop => break,
        };
        let connection =
            builder.serve_connection(TokioIo::new(stream), TowerToHyperService::new(router.clone()));
        let connection = graceful.watch(connection);
        tokio::spawn(async move {
            match connection.await {
                Err(e) if e.is_timeout() => {
                    tracing::info!(%peer, "connection closed: no complete request headers within http.header_read_timeout_ms");
                }
                Err(e) => tracing::debug!(%peer, error = %e, "connection ended with an error"),
                Ok(()) => {}
            }
            drop(permit);
        });
    }
    drop(listener);
    tokio::select! {
        () = graceful.shutdown() => {}
        () = tokio::time::sleep(DRAIN_MAX) => tracing::warn!("stopped with requests still in hand after 30 s"),
    }
}
