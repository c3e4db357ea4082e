//! The admin API and console: a listener of its own (`[admin]`, off by default) serving a
//! versioned JSON API under `/v1` (described by `/v1/openapi.json`) and a console page at `/`.
//!
//! Invariants:
//! - every route is in [`routes::ROUTES`] with the scope it needs, and the OpenAPI document is
//!   made from that same list, so what is served and what is described cannot differ;
//! - nothing but `/` and `/v1/openapi.json` answers without a token ([`auth`]); an act (POST)
//!   needs the `operate` scope, the process's CSRF token in `X-CSRF-Token`, and no foreign
//!   `Origin`; a standby refuses every act (409) naming the leader when it knows it;
//! - every act, done or refused, writes exactly one audit line (target `outbox_relay::audit`:
//!   who, what, result) and answers with a receipt ([`acts::Receipt`]);
//! - acts run one at a time (the signal table's too, [`crate::ops::signal`]), and go where the
//!   operator commands go: pause flips the process's switch ([`crate::observe::pause`]), replay
//!   and republish are [`crate::ops::replay`] and [`crate::ops::republish`] carried out by the
//!   active session beside its stream ([`crate::delivery::live`]), verify is
//!   [`crate::ops::verify`]; the API adds no other path to Kafka;
//! - the listener keeps the metrics listener's limits ([`listener`]): a connection cap, a header
//!   deadline, a body size limit, a deadline per connection.

pub(crate) mod acts;
pub(crate) mod auth;
mod console;
mod listener;
pub mod openapi;
mod reads;
pub mod routes;
mod verification;

use std::sync::Arc;

use http_body_util::Full;
use hyper::body::Bytes;
use hyper::header::{CACHE_CONTROL, CONTENT_TYPE, HeaderName, HeaderValue};
use hyper::{Response, StatusCode};
use serde_json::{Value, json};
use tokio::sync::Mutex;

use crate::config::RelayConfig;
use crate::delivery::live::Leader;
use crate::error::RelayError;
use crate::observe::health::Health;
use crate::observe::history::History;
use crate::ops::control::Control;
use crate::outboxes::Outboxes;

/// What every request handler may read: the relay's configuration, its outboxes, its health (and
/// pause switch), the tokens, and the process's CSRF token.
pub(crate) struct Admin {
    pub(crate) config: Arc<RelayConfig>,
    outboxes: Arc<Outboxes>,
    pub(crate) health: Arc<Health>,
    tokens: auth::Tokens,
    csrf: String,
    /// Held while an act runs: one at a time.
    acting: Mutex<()>,
    /// The active session of this process, which carries out republish and replay.
    leader: Leader,
    /// The last hour of the lag, backlog and throughput gauges (`/v1/history`), sampled while
    /// the listener is on.
    history: Arc<History>,
    /// The last finished verification pass (`/v1/verification`): None before the first.
    verification: std::sync::Mutex<Option<Value>>,
    /// The one PostgreSQL session the reads that need one share (`/v1/dead-letters`), opened
    /// on first use and again after it fails.
    postgres: Mutex<Option<tokio_postgres::Client>>,
    /// The pause and the leader's URL this relay's instances share.
    pub(crate) control: Arc<Control>,
}

impl Admin {
    /// What the listener and the signal table act through: reads the tokens first (when the
    /// listener is on), so a mistake stops the relay at start naming the setting.
    pub(crate) fn new(
        config: Arc<RelayConfig>,
        outboxes: Arc<Outboxes>,
        health: Arc<Health>,
        leader: Leader,
    ) -> Result<Arc<Admin>, RelayError> {
        let tokens = auth::Tokens::load(&config.admin)?;
        let admin = Admin::of(config, outboxes, (health, tokens), leader);
        if admin.config.admin.enabled() {
            // sampled with the listener only: a relay without it keeps no history
            admin.history.spawn();
        }
        Ok(Arc::new(admin))
    }

    /// The state every handler reads, nothing started yet.
    fn of(
        config: Arc<RelayConfig>,
        outboxes: Arc<Outboxes>,
        (health, tokens): (Arc<Health>, auth::Tokens),
        leader: Leader,
    ) -> Admin {
        let history = Arc::new(history_of(&config, &outboxes));
        let control = Arc::new(Control::new(&config, &outboxes, health.pause().clone()));
        Admin {
            config,
            outboxes,
            health,
            tokens,
            csrf: auth::csrf_token(),
            acting: Mutex::new(()),
            leader,
            control,
            history,
            verification: std::sync::Mutex::new(None),
            postgres: Mutex::new(None),
        }
    }
}

/// An empty history of `outboxes`, sampled as often as the gauges it reads are
/// (`metrics.sample_interval_secs`).
fn history_of(config: &RelayConfig, outboxes: &Outboxes) -> History {
    let interval = std::time::Duration::from_secs(config.metrics.sample_interval_secs);
    let names = outboxes.iter().map(|o| o.name.clone()).collect();
    History::new(interval, names, config.source.mode == crate::config::SourceMode::Replication)
}

/// Starts the admin listener when `admin.listen` is set: reads the certificate first, so a
/// mistake stops the relay at start naming the setting.
pub(crate) async fn serve(admin: Arc<Admin>) -> Result<(), RelayError> {
    if !admin.config.admin.enabled() {
        return Ok(());
    }
    let tls = listener::tls(&admin.config.admin)?;
    if admin.config.admin.exposed_without_tls() {
        tracing::warn!(listen = %admin.config.admin.listen, "the admin API listens beyond loopback without TLS: set admin.tls_cert_file and admin.tls_key_file");
    }
    listener::serve(admin, tls).await
}

/// An answer before it becomes a hyper response.
#[derive(Debug)]
pub(crate) struct Answer {
    pub status: StatusCode,
    pub content_type: &'static str,
    pub body: String,
    pub headers: Vec<(HeaderName, String)>,
}

const JSON: &str = "application/json";

impl Answer {
    pub fn json(status: StatusCode, value: &Value) -> Answer {
        let body = serde_json::to_string_pretty(value).expect("json") + "\n";
        Answer { status, content_type: JSON, body, headers: Vec::new() }
    }

    /// A JSON body already made (`status --format json`, a receipt).
    pub fn json_text(status: StatusCode, body: String) -> Answer {
        Answer { status, content_type: JSON, body, headers: Vec::new() }
    }

    /// `{"error": message}`.
    pub fn error(status: StatusCode, message: impl Into<String>) -> Answer {
        Answer::json(status, &json!({ "error": message.into() }))
    }

    pub fn with_header(mut self, name: HeaderName, value: impl Into<String>) -> Answer {
        self.headers.push((name, value.into()));
        self
    }

    /// The hyper response: never cached, never sniffed, never framed.
    pub fn into_response(self) -> Response<Full<Bytes>> {
        let mut response = Response::new(Full::new(Bytes::from(self.body)));
        *response.status_mut() = self.status;
        let headers = response.headers_mut();
        headers.insert(CONTENT_TYPE, HeaderValue::from_static(self.content_type));
        headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
        headers.insert("x-content-type-options", HeaderValue::from_static("nosniff"));
        headers.insert("x-frame-options", HeaderValue::from_static("DENY"));
        for (name, value) in self.headers {
            if let Ok(value) = HeaderValue::from_str(&value) {
                headers.insert(name, value);
            }
        }
        response
    }
}

#[cfg(test)]
impl Admin {
    /// An admin of a minimal configuration (one outbox, the default mode: replication) with
    /// `tokens`.
    pub(crate) fn for_tests(tokens: auth::Tokens) -> Admin {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("relay.toml");
        std::fs::write(&file, "[kafka]\nbrokers = [\"127.0.0.1:9092\"]\n").unwrap();
        let config = RelayConfig::load_with_env(&file, Default::default()).unwrap();
        let outboxes = Arc::new(Outboxes::new(&config));
        let health = Arc::new(Health::new(std::time::Duration::from_secs(1)));
        let leader = crate::delivery::live::channel().0;
        Admin::of(Arc::new(config), outboxes, (health, tokens), leader)
    }
}
