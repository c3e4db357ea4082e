//! The admin listener's plumbing: accept, TLS when configured, hyper (HTTP/1.1) with the metrics
//! listener's limits, and the hand-over of each request to [`super::routes`] and its handler.
//!
//! Limits: at most [`MAX_CONNECTIONS`] connections at once (one more is accepted and closed at
//! once); a TLS handshake and a request's headers must arrive within
//! [`crate::observe::http::HEADER_TIMEOUT`]; a body may have [`MAX_BODY_BYTES`]; a connection is
//! closed [`CONNECTION_DEADLINE`] after it was accepted, long enough for a verification pass; an
//! accept error pauses the loop instead of spinning a core.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::{BodyExt, Full, Limited};
use hyper::body::{Bytes, Incoming};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_rustls::TlsAcceptor;

use super::routes::{self, Endpoint};
use super::{Admin, Answer, acts, auth, console, openapi, reads};
use crate::config::AdminConfig;
use crate::error::{FatalReason, RelayError};
use crate::observe::http::HEADER_TIMEOUT;

/// Connections served at once: an operator's console and a few scripts, not a crowd.
pub const MAX_CONNECTIONS: usize = 64;
/// The largest request body (a list of letter ids, a reason).
pub const MAX_BODY_BYTES: usize = 64 * 1024;
/// A connection is closed this long after it was accepted (a verification pass may take a while).
pub const CONNECTION_DEADLINE: Duration = Duration::from_secs(300);
const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(100);

/// The TLS acceptor of `admin.tls_cert_file` / `admin.tls_key_file`, when set.
pub(super) fn tls(admin: &AdminConfig) -> Result<Option<TlsAcceptor>, RelayError> {
    if !admin.tls() {
        return Ok(None);
    }
    let failed = |message: String| RelayError::fatal(FatalReason::Tls, message);
    let certs = CertificateDer::pem_file_iter(&admin.tls_cert_file)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .map_err(|e| failed(format!("admin.tls_cert_file {}: {e}", admin.tls_cert_file)))?;
    let key = PrivateKeyDer::from_pem_file(&admin.tls_key_file)
        .map_err(|e| failed(format!("admin.tls_key_file {}: {e}", admin.tls_key_file)))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| failed(format!("cannot set up TLS: {e}")))?;
    let builder = match admin.tls_client_ca_file.as_str() {
        "" => builder.with_no_client_auth(),
        file => {
            let setting = |e: String| failed(format!("admin.tls_client_ca_file {file}: {e}"));
            let mut roots = rustls::RootCertStore::empty();
            for ca in CertificateDer::pem_file_iter(file).map_err(|e| setting(e.to_string()))? {
                roots.add(ca.map_err(|e| setting(e.to_string()))?).map_err(|e| setting(e.to_string()))?;
            }
            // a certificate is asked for, not required: a bearer token still serves alone
            let verifier =
                rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                    .allow_unauthenticated()
                    .build()
                    .map_err(|e| setting(e.to_string()))?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let config = builder
        .with_single_cert(certs, key)
        .map_err(|e| failed(format!("admin.tls_cert_file / admin.tls_key_file: {e}")))?;
    Ok(Some(TlsAcceptor::from(Arc::new(config))))
}

/// Binds `admin.listen` and serves until the process ends.
pub(super) async fn serve(admin: Arc<Admin>, tls: Option<TlsAcceptor>) -> Result<(), RelayError> {
    let listen: SocketAddr = admin.config.admin.listen.parse().expect("validated");
    let listener = TcpListener::bind(listen).await.map_err(|e| {
        RelayError::fatal(FatalReason::Config, format!("admin.listen {listen}: cannot listen: {e}"))
    })?;
    let bound = listener.local_addr().map_err(|e| RelayError::fatal(FatalReason::Config, e.to_string()))?;
    tracing::info!(listen = %bound, tls = tls.is_some(), "serving the admin API (/v1) and console (/)");
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    tokio::spawn(async move {
        loop {
            let (socket, _) = match listener.accept().await {
                Ok(accepted) => accepted,
                Err(e) => {
                    tracing::debug!(error = %e, "admin listener: accept failed");
                    tokio::time::sleep(ACCEPT_ERROR_PAUSE).await;
                    continue;
                }
            };
            let Ok(slot) = slots.clone().try_acquire_owned() else { continue };
            let (admin, tls) = (admin.clone(), tls.clone());
            tokio::spawn(async move {
                let served = async {
                    match tls {
                        None => connection(admin, socket, None).await,
                        Some(acceptor) => {
                            if let Ok(Ok(stream)) =
                                tokio::time::timeout(HEADER_TIMEOUT, acceptor.accept(socket)).await
                            {
                                let certificate =
                                    stream.get_ref().1.peer_certificates().and_then(|c| c.first());
                                let certificate = certificate
                                    .and_then(|c| auth::subject_common_name(c.as_ref()))
                                    .map(auth::ClientCertificate);
                                connection(admin, stream, certificate).await;
                            }
                        }
                    }
                };
                let _ = tokio::time::timeout(CONNECTION_DEADLINE, served).await;
                drop(slot);
            });
        }
    });
    Ok(())
}

/// Serves one connection's requests; `certificate`: the verified client certificate's subject,
/// carried by each request as an extension.
async fn connection(
    admin: Arc<Admin>,
    io: impl AsyncRead + AsyncWrite + Unpin + Send + 'static,
    certificate: Option<auth::ClientCertificate>,
) {
    let service = service_fn(move |mut request: Request<Incoming>| {
        let admin = admin.clone();
        if let Some(certificate) = &certificate {
            request.extensions_mut().insert(certificate.clone());
        }
        async move { Ok::<_, Infallible>(handle(&admin, request).await) }
    });
    let _ = http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_TIMEOUT)
        .serve_connection(TokioIo::new(io), service)
        .await;
}

/// One request: its body (limited), its route and guards, its handler.
async fn handle(admin: &Admin, request: Request<Incoming>) -> Response<Full<Bytes>> {
    let (parts, body) = request.into_parts();
    let body = match Limited::new(body, MAX_BODY_BYTES).collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(_) => {
            let said = format!("the body is over {MAX_BODY_BYTES} bytes, or was cut off");
            return Answer::error(StatusCode::PAYLOAD_TOO_LARGE, said).into_response();
        }
    };
    let method = if parts.method == Method::HEAD { Method::GET } else { parts.method.clone() };
    let answer = match routes::find(&method, parts.uri.path()) {
        Err(refused) => refused,
        Ok(route) => match routes::admit(admin, route, &parts) {
            Err(refused) => {
                if route.method == "POST" {
                    acts::audit_refused(route, &refused);
                }
                refused
            }
            Ok(caller) => match (route.endpoint, caller) {
                (Endpoint::Console, _) => console::page(&admin.csrf),
                (Endpoint::OpenApi, _) => Answer::json(StatusCode::OK, &openapi::document()),
                (_, None) => unreachable!("every other route needs a token"),
                (endpoint, Some(caller)) if route.method == "GET" => {
                    reads::answer(admin, endpoint, &caller, &parts).await
                }
                (endpoint, Some(caller)) => acts::act(admin, endpoint, &caller, &body).await,
            },
        },
    };
    answer.into_response()
}
