//! The commands that send (`republish`, `replay-dead-letters`) beside a running relay: they ask
//! its admin API, so the active instance carries them out between its stream's records, and run
//! offline only when no relay answers.
//!
//! Invariants:
//! - the relay is found at `admin.url`, else at `admin.listen`'s address (`https://` with
//!   `admin.tls_cert_file`); with neither, or nothing listening there, the command runs offline
//!   (and the offline command still refuses beside a connected relay);
//! - the token presented is `admin.client_token_file`'s, else the first `operate` token of
//!   `admin.tokens`; it is never printed;
//! - a relay that answers decides: its receipt is printed (the same lines the offline command
//!   prints), a standby's refusal names the leader, and nothing is then done offline; a
//!   standby's refusal that names the active instance's URL is followed there once (never
//!   further: two standbys naming each other cannot loop).

use std::time::Duration;

use serde_json::Value;

use super::{EXIT_FAILURE, Failure, Output};
use crate::config::{AdminConfig, AdminScope, RelayConfig};

/// How long a command waits for the relay's receipt (a republish reads Kafka, then waits for
/// every acknowledgement).
const RECEIPT_WAIT: Duration = Duration::from_secs(600);

/// Whether a running relay took the request.
pub enum Reached {
    /// None answers (why): run offline.
    NoRelay(String),
    /// One answered: its receipt.
    Receipt(Receipt),
}

/// A running relay's answer to an act.
#[derive(Debug)]
pub struct Receipt {
    pub url: String,
    pub status: u16,
    pub receipt: Value,
}

/// Where the commands find the relay's API, if anywhere.
fn url(admin: &AdminConfig) -> Option<String> {
    if !admin.url.is_empty() {
        return Some(admin.url.trim_end_matches('/').to_string());
    }
    let scheme = if admin.tls() { "https" } else { "http" };
    admin.enabled().then(|| format!("{scheme}://{}", admin.listen))
}

/// The token the commands present, read from its file.
fn token(admin: &AdminConfig) -> Result<String, Failure> {
    let (setting, file) = match admin.client_token_file.as_str() {
        "" => match admin.tokens.iter().position(|t| t.scope == AdminScope::Operate) {
            Some(i) => (format!("admin.tokens[{i}].token_file"), admin.tokens[i].token_file.clone()),
            None => {
                return Err(Failure::usage(
                    "admin.client_token_file: a relay's admin API is configured, and no operate token to call it \
                     with: set admin.client_token_file (a file holding an operate-scope token)",
                ));
            }
        },
        file => ("admin.client_token_file".to_string(), file.to_string()),
    };
    let token = std::fs::read_to_string(&file)
        .map_err(|e| Failure::usage(format!("{setting}: cannot read {file}: {e}")))?;
    Ok(token.trim_end().to_string())
}

/// POSTs `body` to `path` of the running relay, as an operator: its receipt, or why none
/// answered. A standby that names the active instance's URL (`admin.advertise_url`) is
/// followed there, once.
pub async fn act(config: &RelayConfig, path: &str, body: &Value) -> Result<Reached, Failure> {
    let admin = &config.admin;
    let Some(url) = url(admin) else {
        return Ok(Reached::NoRelay("admin.url and admin.listen are empty".into()));
    };
    let token = token(admin)?;
    let reached = act_at(admin, (&url, &token), path, body).await?;
    let Reached::Receipt(refused) = &reached else { return Ok(reached) };
    match refused.receipt["detail"]["leader_url"].as_str() {
        Some(leader) if refused.status == 409 && leader.trim_end_matches('/') != url => {
            let leader = leader.trim_end_matches('/').to_string();
            tracing::info!(standby = %url, leader = %leader, "the relay there is a standby; asking the active instance");
            match act_at(admin, (&leader, &token), path, body).await? {
                Reached::NoRelay(why) => Err(Failure::failed(format!(
                    "the relay at {url} is a standby and names the active instance at {leader}, where {why}"
                ))),
                receipt => Ok(receipt),
            }
        }
        _ => Ok(reached),
    }
}

/// [`act`] at one relay's `url`, with `token`.
async fn act_at(
    admin: &AdminConfig,
    (url, token): (&str, &str),
    path: &str,
    body: &Value,
) -> Result<Reached, Failure> {
    let url = url.to_string();
    let ca_file = if url.starts_with("https://") { admin.tls_cert_file.as_str() } else { "" };
    let client = crate::credentials::http_client("admin.tls_cert_file", ca_file, Duration::from_secs(5))
        .map_err(|e| Failure::failed(e.to_string()))?;
    let bearer = format!("Bearer {token}");
    let session = client.get(format!("{url}/v1/session")).header("authorization", &bearer).send().await;
    let session = match session {
        Ok(answer) => answer,
        Err(e) if e.is_connect() => return Ok(Reached::NoRelay(format!("nothing answers at {url}"))),
        Err(e) => return Err(Failure::failed(format!("the relay's admin API at {url}: {e}"))),
    };
    if !session.status().is_success() {
        return Err(Failure::usage(format!(
            "the relay's admin API at {url} refused the token ({}): check admin.client_token_file or admin.tokens",
            session.status()
        )));
    }
    let session = read_json(session, &format!("{url}/v1/session")).await?;
    let csrf = session["csrf_token"].as_str().unwrap_or_default().to_string();
    let answer = client
        .post(format!("{url}{path}"))
        .header("authorization", &bearer)
        .header("x-csrf-token", csrf)
        .timeout(RECEIPT_WAIT)
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await
        .map_err(|e| Failure::failed(format!("{url}{path}: {e}")))?;
    let status = answer.status().as_u16();
    let receipt = read_json(answer, &format!("{url}{path}")).await?;
    Ok(Reached::Receipt(Receipt { url, status, receipt }))
}

/// An answer's JSON body.
async fn read_json(answer: reqwest::Response, what: &str) -> Result<Value, Failure> {
    let bytes = answer.bytes().await.map_err(|e| Failure::failed(format!("{what}: {e}")))?;
    serde_json::from_slice(&bytes).map_err(|e| Failure::failed(format!("{what}: not JSON: {e}")))
}

/// The results of a receipt that mean every chosen event or letter was sent (or could be).
const ALL_DONE: &[&str] = &["republished", "nothing_chosen", "replayed", "dry_run"];

impl Output for Receipt {
    /// The receipt's lines, then what the relay said.
    fn text(&self) -> String {
        let detail = &self.receipt["detail"];
        let mut out: String = detail["lines"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|line| format!("{}\n", line.as_str().unwrap_or_default()))
            .collect();
        let result = self.receipt["result"].as_str().unwrap_or("?");
        out += &format!("carried out by the running relay at {}: {result}", self.url);
        if let Some(error) = detail["error"].as_str() {
            out += &format!(": {error}");
        }
        if let Some(leader) = detail["leader_url"].as_str() {
            out += &format!(" (the leader's admin API: {leader})");
        } else if let Some(leader) = detail["leader"].as_str() {
            out += &format!(" (the leader: {leader}; point admin.url at its admin listener)");
        }
        out + "\n"
    }

    fn exit_code(&self) -> u8 {
        let result = self.receipt["result"].as_str().unwrap_or_default();
        if self.status == 200 && ALL_DONE.contains(&result) { 0 } else { EXIT_FAILURE }
    }
}
