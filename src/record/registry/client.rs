//! The registry's REST API (Confluent's, which Apicurio serves under `/apis/ccompat/v7`): the
//! three calls the encoder makes, and what each answer means for the caller.
//!
//! - register: `POST /subjects/{subject}/versions` `{"schema", "schemaType"}` -> `{"id"}`;
//! - look up by content: `POST /subjects/{subject}` -> `{"id", "version", "schema"}`, 404 when
//!   the subject (`40401`) or the schema under it (`40403`) is unknown;
//! - latest: `GET /subjects/{subject}/versions/latest` -> `{"id", "schema", "schemaType"}`.
//!
//! A status is classified once, in [`classify`]: unreachable, timeout, 408, 429 and 5xx are
//! [`EncodeError::Unavailable`] (retried); a 404 with the registry's own code for an unknown
//! subject, version or schema under it is [`EncodeError::NoSchema`] (this subject's rows only);
//! a certificate that cannot be trusted and every other refusal are [`EncodeError::Refused`],
//! with the setting to change.

use std::error::Error as StdError;
use std::sync::Arc;
use std::time::Duration;

use reqwest::header::{ACCEPT, CONTENT_TYPE};
use reqwest::{Method, StatusCode, Url};
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;
use rustls::{ClientConfig, RootCertStore};
use serde::Deserialize;

use super::error::{EncodeError, excerpt};
use crate::config::registry::{PASSWORD_ENV, RegistryConfig, SchemaType};

/// The media type of the registry's API, requests and answers.
const SCHEMA_REGISTRY_JSON: &str = "application/vnd.schemaregistry.v1+json";

/// The largest answer read from the registry: a schema, its id and an error body fit many times
/// over (Confluent's own default limit on a schema is 1 MiB of text, escaped in JSON here). A
/// longer answer is refused when its `Content-Length` says so, or as soon as that many bytes
/// have arrived, so a registry (or whatever answers at `registry.url`) cannot exhaust memory.
pub(super) const MAX_RESPONSE_BYTES: usize = 8 * 1024 * 1024;

/// A registry connection: the base URL and the credentials.
pub(super) struct Client {
    http: reqwest::Client,
    base: Url,
    username: String,
    /// The credentials' settings: `password`, or `password_file` read at each request.
    credentials: RegistryConfig,
}

/// What a registry call was, for the message of its error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Call {
    Register,
    Lookup,
    Latest,
    ById,
}

/// The answer to a register call.
#[derive(Deserialize)]
struct Registered {
    id: u32,
}

/// The answer to a lookup or latest call: a version of the subject.
#[derive(Debug, Deserialize)]
pub(super) struct Version {
    pub(super) id: u32,
    #[serde(default)]
    pub(super) schema: String,
    /// Absent for Avro.
    #[serde(rename = "schemaType", default)]
    pub(super) schema_type: Option<String>,
}

/// A registry error body, `{"error_code": 40401, "message": "Subject not found."}`.
#[derive(Deserialize)]
struct Refusal {
    error_code: Option<i64>,
    message: Option<String>,
}

impl Client {
    /// The HTTP client with the TLS roots (`ca_file`, else the Mozilla roots) and the timeout.
    pub(super) fn new(config: &RegistryConfig) -> Result<Client, String> {
        let base = Url::parse(&config.url).map_err(|e| format!("registry.url: {e}"))?;
        if base.cannot_be_a_base() || !matches!(base.scheme(), "http" | "https") {
            return Err(format!("registry.url: {} is not an http:// or https:// base URL", config.url));
        }
        if let Some(refused) = config.refuse_http_credentials("registry") {
            return Err(refused);
        }
        let timeout = Duration::from_millis(config.timeout_ms);
        let http = reqwest::Client::builder()
            .tls_backend_preconfigured(tls(&config.ca_file)?)
            .timeout(timeout)
            .connect_timeout(timeout)
            .user_agent(concat!("outbox-relay/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| format!("registry: cannot set up the HTTP client: {}", chain(&e)))?;
        Ok(Client { http, base, username: config.username.clone(), credentials: config.clone() })
    }

    /// Registers `schema` under `subject` (or finds it registered) and returns its id.
    pub(super) async fn register(
        &self,
        subject: &str,
        kind: SchemaType,
        schema: &str,
    ) -> Result<u32, EncodeError> {
        let url = self.url(&["subjects", subject, "versions"]);
        let body = self.send(Call::Register, subject, Method::POST, url, Some(request(kind, schema))).await?;
        parse::<Registered>(Call::Register, &body).map(|answer| answer.id)
    }

    /// The id `schema` has under `subject`; refused when it is not registered there.
    pub(super) async fn lookup(
        &self,
        subject: &str,
        kind: SchemaType,
        schema: &str,
    ) -> Result<u32, EncodeError> {
        let url = self.url(&["subjects", subject]);
        let body = self.send(Call::Lookup, subject, Method::POST, url, Some(request(kind, schema))).await?;
        parse::<Version>(Call::Lookup, &body).map(|version| version.id)
    }

    /// The latest version of `subject`.
    pub(super) async fn latest(&self, subject: &str) -> Result<Version, EncodeError> {
        let url = self.url(&["subjects", subject, "versions", "latest"]);
        let body = self.send(Call::Latest, subject, Method::GET, url, None).await?;
        parse::<Version>(Call::Latest, &body)
    }

    /// The schema registered with `id` (what a consumer of the wire format looks up).
    pub(super) async fn by_id(&self, id: u32) -> Result<Version, EncodeError> {
        let subject = format!("(schema id {id})");
        let url = self.url(&["schemas", "ids", &id.to_string()]);
        let body = self.send(Call::ById, &subject, Method::GET, url, None).await?;
        // (the answer is {"schema": ..., "schemaType": ...}, without the id)
        let mut answer: serde_json::Value = serde_json::from_slice(&body)
            .map_err(|e| EncodeError::Unavailable(format!("GET /schemas/ids/{id}: {e}")))?;
        answer["id"] = id.into();
        serde_json::from_value(answer)
            .map_err(|e| EncodeError::Unavailable(format!("GET /schemas/ids/{id}: {e}")))
    }

    /// The registry's base URL.
    pub(super) fn base(&self) -> &Url {
        &self.base
    }

    /// `base/segment/...`, each segment percent-encoded (a subject may hold `/` or spaces).
    fn url(&self, segments: &[&str]) -> Url {
        let mut url = self.base.clone();
        if let Ok(mut path) = url.path_segments_mut() {
            path.pop_if_empty().extend(segments);
        }
        url
    }

    async fn send(
        &self,
        call: Call,
        subject: &str,
        method: Method,
        url: Url,
        body: Option<Vec<u8>>,
    ) -> Result<Vec<u8>, EncodeError> {
        let shown = format!("{method} {}", url.path());
        let mut request = self.http.request(method, url).header(ACCEPT, SCHEMA_REGISTRY_JSON);
        if !self.username.is_empty() {
            let password = self.credentials.current_password().map_err(|detail| EncodeError::Refused {
                subject: subject.to_string(),
                detail: format!("{detail}; the file must hold the registry password on its first line"),
            })?;
            request = request.basic_auth(&self.username, Some(password.expose()));
        }
        if let Some(body) = body {
            request = request.header(CONTENT_TYPE, SCHEMA_REGISTRY_JSON).body(body);
        }
        let transport = |e: reqwest::Error| transport_error(&shown, subject, &e);
        let mut response = request.send().await.map_err(transport)?;
        let status = response.status();
        let too_long = || EncodeError::Refused {
            subject: subject.to_string(),
            detail: format!(
                "{shown}: the registry's answer ({status}) is longer than {MAX_RESPONSE_BYTES} bytes, \
                 more than any schema; check registry.url"
            ),
        };
        if response.content_length().is_some_and(|length| length > MAX_RESPONSE_BYTES as u64) {
            return Err(too_long());
        }
        let mut body = Vec::new();
        while let Some(chunk) = response.chunk().await.map_err(transport)? {
            if body.len() + chunk.len() > MAX_RESPONSE_BYTES {
                return Err(too_long());
            }
            body.extend_from_slice(&chunk);
        }
        if status.is_success() {
            return Ok(body);
        }
        Err(classify(call, subject, &self.username, status, &body))
    }
}

/// The body of a register or lookup call: Avro is the default `schemaType`, so it is left out
/// for Avro (older registries know no other).
fn request(kind: SchemaType, schema: &str) -> Vec<u8> {
    let body = match kind {
        SchemaType::Avro => serde_json::json!({ "schema": schema }),
        other => serde_json::json!({ "schema": schema, "schemaType": other.registry_name() }),
    };
    body.to_string().into_bytes()
}

fn parse<'a, T: Deserialize<'a>>(call: Call, body: &'a [u8]) -> Result<T, EncodeError> {
    serde_json::from_slice(body).map_err(|e| {
        let text = excerpt(&String::from_utf8_lossy(body));
        EncodeError::Unavailable(format!(
            "the registry's answer to {} is not what the API defines ({e}): {text}; check registry.url",
            call.name()
        ))
    })
}

impl Call {
    fn name(self) -> &'static str {
        match self {
            Call::Register => "registering a schema",
            Call::Lookup => "looking up a schema",
            Call::Latest => "reading the latest schema",
            Call::ById => "reading a schema by its id",
        }
    }
}

/// What an error status means for the caller, with what to change.
pub(super) fn classify(
    call: Call,
    subject: &str,
    username: &str,
    status: StatusCode,
    body: &[u8],
) -> EncodeError {
    let refusal: Option<Refusal> = serde_json::from_slice(body).ok();
    let code = refusal.as_ref().and_then(|r| r.error_code).unwrap_or_default();
    let said = match refusal.as_ref().and_then(|r| r.message.as_deref()) {
        Some(message) => excerpt(message),
        None => excerpt(&String::from_utf8_lossy(body)),
    };
    let refused = |detail: String| EncodeError::Refused { subject: subject.to_string(), detail };
    let on_subject = |detail: String| refused(format!("subject {subject}: {detail}"));
    match status.as_u16() {
        408 | 429 | 500..=599 => {
            EncodeError::Unavailable(format!("{} answered {status}: {said}", call.name()))
        }
        401 if username.is_empty() => refused(format!(
            "the registry requires authentication (401); set registry.username and registry.password \
             (or {PASSWORD_ENV})"
        )),
        401 => refused(format!(
            "the registry refuses the credentials of user \"{username}\" (401); check registry.username \
             and registry.password (or {PASSWORD_ENV})"
        )),
        403 => on_subject(format!(
            "the registry user \"{username}\" is not allowed {} (403: {said}); grant it access to the \
             subject, or set registry.username to a user that has it",
            call.name()
        )),
        404 => not_found(call, subject, code, &said),
        409 => on_subject(format!(
            "the registry refuses the schema in registry.schema_file as incompatible with the \
             subject's compatibility level ({said}); make the schema compatible with the subject's \
             latest version, or change the subject's compatibility level on the registry"
        )),
        422 => on_subject(format!(
            "the registry refuses the schema as invalid (422, error code {code}: {said}); fix \
             registry.schema_file (and registry.schema_type)"
        )),
        _ => on_subject(format!(
            "the registry answered {status} to {}: {said}; check registry.url",
            call.name()
        )),
    }
}

/// What a 404 means for `call`: by the registry's error `code`, no such schema id, no such schema
/// or subject, or a `registry.url` that is not the API's base.
fn not_found(call: Call, subject: &str, code: i64, said: &str) -> EncodeError {
    let no_schema = |detail: String| EncodeError::NoSchema { subject: subject.to_string(), detail };
    match call {
        // (a record naming a schema the registry does not hold cannot be read, ever)
        Call::ById => EncodeError::Mismatch {
            subject: subject.to_string(),
            schema_id: 0,
            detail: format!("the registry holds no schema of this id ({said})"),
        },
        Call::Lookup if code == 40401 || code == 40403 => no_schema(format!(
            "schema not registered under subject {subject}; register it or set auto_register = true"
        )),
        Call::Latest if code == 40401 || code == 40402 => no_schema(format!(
            "subject {subject}: it has no schema in the registry; register one, or set \
             registry.schema_file and auto_register = true"
        )),
        _ => EncodeError::Refused {
            subject: subject.to_string(),
            detail: format!(
                "subject {subject}: the registry answered 404 to {} ({said}); check registry.url: it must be the \
                 base of the Confluent-compatible API (for Apicurio, http://host:8080/apis/ccompat/v7)",
                call.name()
            ),
        },
    }
}

/// A request that got no answer: retried, unless the registry's certificate cannot be trusted.
fn transport_error(shown: &str, subject: &str, error: &reqwest::Error) -> EncodeError {
    let cause = chain(error);
    if certificate_refused(error) {
        return EncodeError::Refused {
            subject: subject.to_string(),
            detail: format!(
                "subject {subject}: {shown}: the registry's certificate cannot be trusted ({cause}); set registry.ca_file to \
                 the PEM of the CA that signs it, and check the host name in registry.url"
            ),
        };
    }
    let what = if error.is_timeout() { "timed out (registry.timeout_ms)" } else { "failed" };
    EncodeError::Unavailable(format!("{shown} {what}: {cause}"))
}

/// True when rustls refused the server's certificate, somewhere in the error's causes.
fn certificate_refused(error: &(dyn StdError + 'static)) -> bool {
    let mut next = Some(error);
    while let Some(error) = next {
        let tls = match error.downcast_ref::<std::io::Error>().and_then(|io| io.get_ref()) {
            Some(inner) => inner.downcast_ref::<rustls::Error>(),
            None => error.downcast_ref::<rustls::Error>(),
        };
        if matches!(tls, Some(rustls::Error::InvalidCertificate(_))) {
            return true;
        }
        next = error.source();
    }
    false
}

/// An error and its causes, `a: b: c` (reqwest's own message says little).
fn chain(error: &dyn StdError) -> String {
    let mut text = error.to_string();
    let mut next = error.source();
    while let Some(cause) = next {
        let said = cause.to_string();
        if !text.contains(&said) {
            text.push_str(": ");
            text.push_str(&said);
        }
        next = cause.source();
    }
    text
}

/// rustls on the ring provider, trusting `ca_file` when set, else the Mozilla roots.
fn tls(ca_file: &str) -> Result<ClientConfig, String> {
    let mut roots = RootCertStore::empty();
    if ca_file.is_empty() {
        roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    } else {
        let certificates = CertificateDer::pem_file_iter(ca_file)
            .map_err(|e| format!("registry.ca_file {ca_file}: {e}"))?
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| format!("registry.ca_file {ca_file}: {e}"))?;
        let (added, _) = roots.add_parsable_certificates(certificates);
        if added == 0 {
            return Err(format!("registry.ca_file {ca_file}: no usable certificate in it"));
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("registry: TLS setup: {e}"))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(config)
}
