//! OIDC client credentials (RFC 6749 section 4.4): a POST of `grant_type=client_credentials` with
//! the client id and secret (HTTP Basic, as RFC 6749 section 2.3.1 prefers, and in the body for
//! providers that take only that), `scope` and `audience` when set; the answer's `access_token`
//! and `expires_in`.
//!
//! Invariants: the secret file is read at each request (a rotated Kubernetes Secret is used
//! without a restart); a 400/401 answering `invalid_client` or `unauthorized_client` is
//! [`FetchError::Refused`] naming the secret's setting, any other failure is retried.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use reqwest::StatusCode;
use rustls::{ClientConfig, RootCertStore};
use rustls_pki_types::CertificateDer;
use rustls_pki_types::pem::PemObject;
use serde::Deserialize;

use super::{FetchError, Token, jwt};
use crate::config::{KafkaAuthConfig, Secret};

pub(super) struct Oidc {
    http: reqwest::Client,
    url: String,
    client_id: String,
    client_secret: Option<Secret>,
    client_secret_file: String,
    scope: String,
    audience: String,
}

/// The token endpoint's answer (RFC 6749 section 5.1), or its error (section 5.2).
#[derive(Deserialize)]
struct Answer {
    access_token: Option<String>,
    expires_in: Option<u64>,
    error: Option<String>,
    error_description: Option<String>,
}

impl Oidc {
    pub(super) fn new(auth: &KafkaAuthConfig) -> Result<Oidc, FetchError> {
        let timeout = Duration::from_millis(auth.request_timeout_ms);
        let http = reqwest::Client::builder()
            .tls_backend_preconfigured(tls(&auth.ca_file)?)
            .timeout(timeout)
            .connect_timeout(timeout)
            .user_agent(concat!("outbox-relay/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| FetchError::Unavailable(format!("cannot set up the HTTP client: {e}")))?;
        Ok(Oidc {
            http,
            url: auth.token_endpoint_url.clone(),
            client_id: auth.client_id.clone(),
            client_secret: auth.client_secret.clone(),
            client_secret_file: auth.client_secret_file.clone(),
            scope: auth.scope.clone(),
            audience: auth.audience.clone(),
        })
    }

    /// The secret: `client_secret`, else the first line of `client_secret_file`.
    fn secret(&self) -> Result<Secret, FetchError> {
        if let Some(secret) = &self.client_secret {
            return Ok(secret.clone());
        }
        let text = std::fs::read_to_string(&self.client_secret_file).map_err(|e| {
            FetchError::Unavailable(format!("kafka.auth.client_secret_file {}: {e}", self.client_secret_file))
        })?;
        Ok(Secret::new(text.lines().next().unwrap_or_default().trim()))
    }

    /// Asks the token endpoint for a token with the client's credentials.
    pub(super) async fn fetch(&self) -> Result<Token, FetchError> {
        let secret = self.secret()?;
        let form = self.form(&secret);
        let asked = SystemTime::now();
        let response = self
            .http
            .post(&self.url)
            .header(reqwest::header::CONTENT_TYPE, "application/x-www-form-urlencoded")
            .header(reqwest::header::ACCEPT, "application/json")
            .body(form)
            .send()
            .await
            .map_err(|e| FetchError::Unavailable(format!("{}: {}", self.url, chain(&e))))?;
        let status = response.status();
        let body =
            response.bytes().await.map_err(|e| FetchError::Unavailable(format!("{}: {e}", self.url)))?;
        self.answered(status, serde_json::from_slice(&body).ok(), asked)
    }

    /// The request's body: the grant, the client's id and secret, `scope` and `audience` when set.
    fn form(&self, secret: &Secret) -> String {
        let mut form = form_urlencoded::Serializer::new(String::new());
        form.append_pair("grant_type", "client_credentials")
            .append_pair("client_id", &self.client_id)
            .append_pair("client_secret", secret.expose());
        if !self.scope.is_empty() {
            form.append_pair("scope", &self.scope);
        }
        if !self.audience.is_empty() {
            form.append_pair("audience", &self.audience);
        }
        form.finish()
    }

    /// What the endpoint's answer (`None`: not JSON) with `status` means: a token, a refusal
    /// naming the setting to fix, or a failure to retry.
    fn answered(
        &self,
        status: StatusCode,
        answer: Option<Answer>,
        asked: SystemTime,
    ) -> Result<Token, FetchError> {
        match (status, answer) {
            (StatusCode::OK, Some(Answer { access_token: Some(token), expires_in, .. })) => {
                self.token(token, expires_in, asked)
            }
            (StatusCode::BAD_REQUEST | StatusCode::UNAUTHORIZED, Some(a))
                if matches!(a.error.as_deref(), Some("invalid_client" | "unauthorized_client")) =>
            {
                let setting = if self.client_secret.is_some() {
                    "kafka.auth.client_secret"
                } else {
                    "kafka.auth.client_secret_file"
                };
                Err(FetchError::Refused {
                    setting,
                    why: format!(
                        "the identity provider {} refused client \"{}\" ({}): check kafka.auth.client_id and the \
                         secret",
                        self.url,
                        self.client_id,
                        a.said()
                    ),
                })
            }
            (StatusCode::BAD_REQUEST, Some(a)) if a.error.as_deref() == Some("invalid_scope") => {
                Err(FetchError::Refused {
                    setting: "kafka.auth.scope",
                    why: format!("the identity provider {} refused the scope ({})", self.url, a.said()),
                })
            }
            (status, Some(a)) if a.error.is_some() => {
                Err(FetchError::Unavailable(format!("{}: HTTP {status}: {}", self.url, a.said())))
            }
            (status, _) => {
                Err(FetchError::Unavailable(format!("{}: HTTP {status} without a token", self.url)))
            }
        }
    }

    /// The token granted at `asked`, expiring at the earlier of `expires_in` and its JWT's `exp`.
    fn token(&self, token: String, expires_in: Option<u64>, asked: SystemTime) -> Result<Token, FetchError> {
        let claims = jwt::claims(&token).unwrap_or_default();
        // expires_in is the provider's word; a JWT's exp is the brokers' (the earlier wins)
        let by_answer = expires_in.map(|s| asked + Duration::from_secs(s));
        let expires_at = [by_answer, claims.expires_at].into_iter().flatten().min().ok_or_else(|| {
            FetchError::Unavailable(format!("{}: the token has neither expires_in nor exp", self.url))
        })?;
        let principal = claims.subject.unwrap_or_else(|| self.client_id.clone());
        Ok(Token { value: Secret::new(token), expires_at, principal })
    }
}

impl Answer {
    /// The error the endpoint said, with its description when it gave one.
    fn said(&self) -> String {
        let error = self.error.as_deref().unwrap_or("no error code");
        match &self.error_description {
            Some(d) => format!("{error}: {d}"),
            None => error.to_string(),
        }
    }
}

/// The error and its causes, `a: b: c` (reqwest's own text says only "error sending request").
fn chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut cause = error.source();
    while let Some(e) = cause {
        text.push_str(": ");
        text.push_str(&e.to_string());
        cause = e.source();
    }
    text
}

/// rustls on the ring provider, trusting `ca_file` when set, else the Mozilla roots (as the
/// schema registry's client does).
pub(super) fn tls(ca_file: &str) -> Result<ClientConfig, FetchError> {
    tls_for("kafka.auth.ca_file", ca_file)
}

/// [`tls`] for the CA file `setting` names.
pub(crate) fn tls_for(setting: &'static str, ca_file: &str) -> Result<ClientConfig, FetchError> {
    let refused = |why: String| FetchError::Refused { setting, why };
    let mut roots = RootCertStore::empty();
    if ca_file.is_empty() {
        roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    } else {
        let certificates = CertificateDer::pem_file_iter(ca_file)
            .map_err(|e| refused(format!("{ca_file}: {e}")))?
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| refused(format!("{ca_file}: {e}")))?;
        let (added, _) = roots.add_parsable_certificates(certificates);
        if added == 0 {
            return Err(refused(format!("{ca_file}: no usable certificate in it")));
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    Ok(ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| refused(format!("TLS setup: {e}")))?
        .with_root_certificates(roots)
        .with_no_client_auth())
}
