//! Short-lived credentials the relay obtains itself: the SASL OAUTHBEARER tokens of `[kafka.auth]`
//! (OIDC client credentials, a token file, AWS MSK IAM), fetched, cached and refreshed in one
//! place, and handed to every librdkafka client through [`oauth_token`].
//!
//! Invariants:
//! - one [`TokenSource`] per distinct `[kafka.auth]` in the process, made when the first client
//!   settings are built ([`kafka_settings`]); every client's `ClientContext` asks it through
//!   [`oauth_token`], found by the key librdkafka passes back (`sasl.oauthbearer.config`), so the
//!   producer, the read-back, `check`, `verify`, `locate` and the example services share one
//!   token and one refresher;
//! - the refresher runs on a thread of its own (with its own small runtime), so librdkafka's
//!   callback (served on the runtime thread for the relay's producer) never waits on the
//!   caller's runtime: it only reads the cached token, waiting for the first one at most a
//!   request timeout (the daemon awaits that one before it makes its producer);
//! - a token is replaced once `refresh_at_percent` of its lifetime has passed; a failed request is
//!   retried with capped exponential backoff, counted (`outbox_relay_credential_refresh_failures_total`,
//!   the alert OutboxRelayKafkaTokenRefreshFailing) and said by `/readyz` while it fails; the
//!   token held stays in use until it expires;
//! - an identity provider that refuses the client (`invalid_client`, 401) is [`FetchError::Refused`],
//!   naming the setting: the daemon stops on it at start-up;
//! - no token or secret is ever logged or printed: [`Token::value`] is a [`Secret`].

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rdkafka::client::OAuthToken;

use crate::backoff::{Backoff, Jitter};
use crate::config::{AuthMechanism, KafkaAuthConfig, KafkaConfig, Secret};
use crate::observe::health::set_credentials_failing;
use crate::observe::metrics::metrics;

pub mod aws;
mod file;
pub mod jwt;
pub mod msk_iam;
mod oidc;
pub mod rds_iam;

/// A bearer token and what librdkafka needs with it.
#[derive(Debug, Clone)]
pub struct Token {
    pub value: Secret,
    pub expires_at: SystemTime,
    /// The principal the token names (its `sub` claim, or the client id): for logs and `check`.
    pub principal: String,
}

/// Why a token could not be had.
#[derive(Debug, Clone, thiserror::Error)]
pub enum FetchError {
    /// The identity provider refused the relay's credentials: fix `setting`.
    #[error("{setting}: {why}")]
    Refused { setting: &'static str, why: String },
    /// The provider or the file could not be reached or read now: retried.
    #[error("{0}")]
    Unavailable(String),
}

/// An HTTPS-capable client for a service the relay calls besides Kafka and PostgreSQL (the
/// tracing backend): server certificates checked against `ca_file` (the public web roots when
/// empty), which `setting` names in an error.
pub fn http_client(
    setting: &'static str,
    ca_file: &str,
    timeout: Duration,
) -> Result<reqwest::Client, FetchError> {
    reqwest::Client::builder()
        .tls_backend_preconfigured(oidc::tls_for(setting, ca_file)?)
        .connect_timeout(timeout)
        .user_agent(concat!("outbox-relay/", env!("CARGO_PKG_VERSION")))
        .build()
        .map_err(|e| FetchError::Unavailable(format!("cannot set up the HTTP client: {e}")))
}

/// Where tokens come from.
enum Origin {
    Oidc(oidc::Oidc),
    File(file::TokenFile),
    MskIam(msk_iam::MskIam),
}

impl Origin {
    fn new(auth: &KafkaAuthConfig) -> Result<Origin, FetchError> {
        Ok(match auth.mechanism {
            AuthMechanism::Oidc => Origin::Oidc(oidc::Oidc::new(auth)?),
            AuthMechanism::TokenFile => Origin::File(file::TokenFile::new(auth)),
            AuthMechanism::MskIam => Origin::MskIam(msk_iam::MskIam::new(auth)?),
        })
    }

    async fn fetch(&self) -> Result<Token, FetchError> {
        match self {
            Origin::Oidc(o) => o.fetch().await,
            Origin::File(f) => f.fetch(),
            Origin::MskIam(m) => m.fetch().await,
        }
    }

    /// For a token file: whether the file changed since the token held was read.
    fn changed(&self) -> bool {
        match self {
            Origin::File(f) => f.changed(),
            _ => false,
        }
    }
}

/// What the refresher knows.
#[derive(Default)]
struct State {
    token: Option<Token>,
    /// The last request failed: why (cleared by a token).
    failure: Option<FetchError>,
    /// At least one request has finished, well or not.
    tried: bool,
}

/// One `[kafka.auth]`'s tokens: the cached token and its refresher.
pub struct TokenSource {
    mechanism: AuthMechanism,
    request_timeout: Duration,
    state: Mutex<State>,
    changed: Condvar,
}

impl TokenSource {
    /// Starts the refresher of `auth` on a thread of its own.
    fn start(auth: &KafkaAuthConfig) -> Arc<TokenSource> {
        let source = Arc::new(TokenSource {
            mechanism: auth.mechanism,
            request_timeout: Duration::from_millis(auth.request_timeout_ms),
            state: Mutex::default(),
            changed: Condvar::new(),
        });
        let (refresher, auth) = (source.clone(), auth.clone());
        std::thread::Builder::new()
            .name("kafka-token".into())
            .spawn(move || {
                let runtime =
                    tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a runtime");
                runtime.block_on(refresher.refresh_forever(&auth));
            })
            .expect("spawn the token refresher");
        source
    }

    /// Fetches, stores, sleeps until the next refresh is due; forever.
    async fn refresh_forever(&self, auth: &KafkaAuthConfig) {
        let mechanism = self.mechanism.label();
        let origin = match Origin::new(auth) {
            Ok(origin) => origin,
            Err(e) => return self.finished(Err(e)),
        };
        let mut backoff = Backoff::new(Duration::from_millis(500), Duration::from_secs(30), Jitter::Equal);
        loop {
            let outcome =
                tokio::time::timeout(self.request_timeout, origin.fetch()).await.unwrap_or_else(|_| {
                    Err(FetchError::Unavailable(format!(
                        "no answer within kafka.auth.request_timeout_ms ({} ms)",
                        self.request_timeout.as_millis()
                    )))
                });
            let wait = match &outcome {
                Ok(token) => {
                    backoff.reset();
                    let lifetime = token.expires_at.duration_since(SystemTime::now()).unwrap_or_default();
                    tracing::info!(
                        mechanism,
                        principal = %token.principal,
                        expires_in_secs = lifetime.as_secs(),
                        "kafka token obtained"
                    );
                    metrics().credential_expiry.set(unix_secs(token.expires_at));
                    lifetime * u32::from(auth.refresh_at_percent) / 100
                }
                Err(e) => {
                    metrics().credential_refresh_failures.inc();
                    let wait = backoff.next_delay();
                    tracing::warn!(mechanism, error = %e, retry_in_ms = wait.as_millis() as u64, "kafka token request failed");
                    wait
                }
            };
            self.finished(outcome);
            self.sleep(&origin, wait.max(Duration::from_millis(100))).await;
        }
    }

    /// Sleeps `wait`, or until a token file changes.
    async fn sleep(&self, origin: &Origin, wait: Duration) {
        let until = Instant::now() + wait;
        while Instant::now() < until {
            tokio::time::sleep((until - Instant::now()).min(Duration::from_secs(1))).await;
            if origin.changed() {
                return;
            }
        }
    }

    /// Records a request's outcome and wakes whoever waits for a token.
    fn finished(&self, outcome: Result<Token, FetchError>) {
        let mut state = self.state.lock().unwrap();
        state.tried = true;
        match outcome {
            Ok(token) => {
                state.token = Some(token);
                state.failure = None;
                set_credentials_failing(None);
            }
            Err(e) => {
                let held = match state.token.as_ref().map(|t| t.expires_at.duration_since(SystemTime::now()))
                {
                    Some(Ok(left)) => format!("the token held expires in {} s", left.as_secs()),
                    Some(Err(_)) => "the token held has expired".into(),
                    None => "no token yet".into(),
                };
                set_credentials_failing(Some(format!(
                    "kafka.auth ({}): the token cannot be refreshed ({held}): {e}",
                    self.mechanism.label()
                )));
                state.failure = Some(e);
            }
        }
        self.changed.notify_all();
    }

    /// The token held while it is valid; else waits up to the request timeout for the first
    /// request to finish. The error says why there is none.
    pub fn current(&self) -> Result<Token, FetchError> {
        let state = self.state.lock().unwrap();
        let (state, _) = self
            .changed
            .wait_timeout_while(state, self.request_timeout + Duration::from_secs(1), |s| !s.tried)
            .unwrap();
        if let Some(token) = state.token.as_ref().filter(|t| t.expires_at > SystemTime::now()) {
            return Ok(token.clone());
        }
        Err(state.failure.clone().unwrap_or_else(|| {
            FetchError::Unavailable(match state.token {
                Some(_) => "the token expired and no new one could be had yet".into(),
                None => "no token yet".into(),
            })
        }))
    }

    /// The mechanism's name.
    pub fn mechanism(&self) -> AuthMechanism {
        self.mechanism
    }
}

fn unix_secs(at: SystemTime) -> f64 {
    at.duration_since(UNIX_EPOCH).unwrap_or_default().as_secs_f64()
}

/// Every token source of the process, by the key its clients carry in `sasl.oauthbearer.config`.
fn sources() -> &'static Mutex<HashMap<String, Arc<TokenSource>>> {
    static SOURCES: OnceLock<Mutex<HashMap<String, Arc<TokenSource>>>> = OnceLock::new();
    SOURCES.get_or_init(Mutex::default)
}

/// The key of `auth`: equal settings share a source (secrets compared, never shown).
fn key_of(auth: &KafkaAuthConfig) -> String {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    let secret = auth.client_secret.as_ref().map(Secret::expose);
    (
        auth.mechanism.label(),
        &auth.token_endpoint_url,
        &auth.client_id,
        secret,
        &auth.client_secret_file,
        &auth.scope,
        &auth.audience,
        &auth.ca_file,
        &auth.token_file,
        &auth.region,
        auth.refresh_at_percent,
    )
        .hash(&mut hasher);
    format!("outbox-relay-token-source={:016x}", hasher.finish())
}

/// The token source of `kafka.auth`, started at the first call; `None` without `[kafka.auth]`.
pub fn source_for(kafka: &KafkaConfig) -> Option<(String, Arc<TokenSource>)> {
    let auth = kafka.auth.as_ref()?;
    let key = key_of(auth);
    let source =
        sources().lock().unwrap().entry(key.clone()).or_insert_with(|| TokenSource::start(auth)).clone();
    Some((key, source))
}

/// The librdkafka settings a client of `kafka` gets for `[kafka.auth]` (none without it):
/// OAUTHBEARER, SASL_SSL unless the properties say SASL_PLAINTEXT, and the key [`oauth_token`]
/// finds the token source by.
pub fn kafka_settings(kafka: &KafkaConfig) -> Vec<(&'static str, String)> {
    let Some((key, _)) = source_for(kafka) else { return Vec::new() };
    let mut settings = vec![("sasl.mechanism", "OAUTHBEARER".to_string()), ("sasl.oauthbearer.config", key)];
    let protocol = kafka.property("security.protocol").map(str::to_ascii_lowercase);
    if !matches!(protocol.as_deref(), Some("sasl_ssl" | "sasl_plaintext")) {
        settings.push(("security.protocol", "SASL_SSL".into()));
    }
    settings
}

/// What every `ClientContext::generate_oauth_token` of the relay answers: the token of the source
/// named by `oauthbearer_config` (the key [`kafka_settings`] set).
pub fn oauth_token(oauthbearer_config: Option<&str>) -> Result<OAuthToken, Box<dyn std::error::Error>> {
    let key = oauthbearer_config.unwrap_or_default();
    let source = sources().lock().unwrap().get(key).cloned();
    let source = source.ok_or("the Kafka client was not configured through [kafka.auth]")?;
    let token = source.current().map_err(|e| e.to_string())?;
    let lifetime_ms = token.expires_at.duration_since(UNIX_EPOCH).unwrap_or_default().as_millis() as i64;
    Ok(OAuthToken { token: token.value.expose().to_string(), principal_name: token.principal, lifetime_ms })
}

/// The first token of `kafka.auth` (waiting for the first request), for the daemon's start and
/// `check`; `Ok(None)` without `[kafka.auth]`.
pub async fn first_token(kafka: &KafkaConfig) -> Result<Option<Token>, FetchError> {
    let Some((_, source)) = source_for(kafka) else { return Ok(None) };
    tokio::task::spawn_blocking(move || source.current())
        .await
        .map_err(|e| FetchError::Unavailable(format!("the token request panicked: {e}")))?
        .map(Some)
}

/// The grant or role a mechanism needs, for `check`.
pub fn needs(mechanism: AuthMechanism) -> &'static str {
    match mechanism {
        AuthMechanism::Oidc => {
            "a confidential client with the client credentials grant (service account) whose tokens the brokers' \
             JWKS validates; the brokers' ACLs name its principal (the token's sub claim by default)"
        }
        AuthMechanism::TokenFile => {
            "a token the brokers validate, written to kafka.auth.token_file before it expires"
        }
        AuthMechanism::MskIam => {
            "an IAM policy allowing kafka-cluster:Connect on the cluster, and WriteData, ReadData, DescribeTopic on \
             its topics and DescribeGroup on the read-back group"
        }
    }
}
