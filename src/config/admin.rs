//! `[admin]`: the admin API and console listener (docs/admin.md), off unless `listen` is set.
//!
//! Invariants:
//! - with `listen` empty (the default) nothing else here is read, and no port is opened;
//! - with `listen` set, at least one token is configured (a listener nobody may use is a mistake),
//!   each token has a unique name, a scope and a file; the token itself is read from that file
//!   when the listener starts, never from this configuration, so it never reaches a log line;
//! - TLS is all or nothing: `tls_cert_file` and `tls_key_file` are set together.

use serde::{Deserialize, Serialize};

use super::ConfigError;

/// The admin listener's port the docs suggest (`127.0.0.1:9189`): beside `metrics.listen`'s 9187
/// and `verify --watch`'s 9188.
pub const SUGGESTED_ADMIN_LISTEN: &str = "127.0.0.1:9189";

/// The shortest token a `token_file` may hold, in bytes.
pub const MIN_ADMIN_TOKEN_BYTES: usize = 16;

/// The signal table's operator role the docs and `sql/014_relay_signal.sql` name.
pub const DEFAULT_SIGNAL_OPERATOR_ROLE: &str = "outbox_relay_operator";

/// The admin API and console (`/v1/...`, `/`), the signal table, and where the commands find a
/// running relay's API.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdminConfig {
    /// Address of the admin listener, `ip:port`; empty (the default): off. Keep it on loopback
    /// (`127.0.0.1:9189`) and reach it with `kubectl port-forward`; beyond loopback, set
    /// `tls_cert_file` and `tls_key_file` (`check` warns otherwise).
    pub listen: String,
    /// PEM certificate chain the listener presents; with `tls_key_file`, it speaks HTTPS only.
    pub tls_cert_file: String,
    /// PEM private key of `tls_cert_file`.
    pub tls_key_file: String,
    /// Who may call the API: a name (in audit lines and "paused by"), a scope, a token file.
    pub tokens: Vec<AdminToken>,
    /// PEM CA certificates that sign the client certificates the listener accepts (mutual TLS,
    /// with `clients`); empty (the default): none is asked for. A request with a bearer token
    /// is judged by its token alone.
    pub tls_client_ca_file: String,
    /// Who may call the API with a client certificate signed by `tls_client_ca_file`: a name (in
    /// audit lines and "paused by"), a scope, and the certificate's subject common name.
    pub clients: Vec<AdminClient>,
    /// Where `republish` and `replay-dead-letters` find a running relay's API
    /// (`http://127.0.0.1:9189`, through a port-forward); empty (the default): `listen`'s
    /// address, when set. A relay answering there carries the command out; none: the command
    /// runs offline.
    pub url: String,
    /// Where this instance's API answers the other instances of the relay
    /// (`https://outbox-relay-0.outbox-relay:9189`): the active instance writes it into
    /// `outbox_relay_control`, a standby's refusal of an act names it, and `republish` and
    /// `replay-dead-letters` follow it from a standby. Empty (the default): refusals name the
    /// active instance's pod and process, not a URL.
    pub advertise_url: String,
    /// The token those commands present (a file, as `tokens[].token_file`); empty (the
    /// default): the first `operate` token of `tokens`.
    pub client_token_file: String,
    /// The signal table (`schema.table` or `table`) whose requests the active relay executes
    /// (`sql/014_relay_signal.sql`, or `setup`); empty (the default): none.
    pub signal_table: String,
    /// The role whose members may insert requests into `signal_table` (the table's trigger and
    /// the relay both check it).
    pub signal_operator_role: String,
    /// How often the active relay looks for new requests, in ms (100 to 60000).
    pub signal_poll_interval_ms: u64,
}

impl Default for AdminConfig {
    fn default() -> AdminConfig {
        AdminConfig {
            listen: String::new(),
            tls_cert_file: String::new(),
            tls_key_file: String::new(),
            tokens: Vec::new(),
            tls_client_ca_file: String::new(),
            clients: Vec::new(),
            url: String::new(),
            advertise_url: String::new(),
            client_token_file: String::new(),
            signal_table: String::new(),
            signal_operator_role: DEFAULT_SIGNAL_OPERATOR_ROLE.into(),
            signal_poll_interval_ms: 1_000,
        }
    }
}

/// One bearer token.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdminToken {
    /// Who holds it: named in every audit line and in "paused by <name>".
    pub name: String,
    /// `read` (look) or `operate` (look and act: pause, resume, replay, verify).
    pub scope: AdminScope,
    /// A file holding the token (its bytes less trailing whitespace, at least 16).
    pub token_file: String,
}

/// One client certificate's holder.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdminClient {
    /// Who holds it: named in every audit line and in "paused by <name>".
    pub name: String,
    /// `read` or `operate`, as a token's.
    pub scope: AdminScope,
    /// The certificate's subject common name (CN), exactly.
    pub subject_cn: String,
}

/// What a token may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AdminScope {
    /// Every GET.
    Read,
    /// Every GET and every act (POST).
    Operate,
}

impl AdminScope {
    pub fn as_str(self) -> &'static str {
        match self {
            AdminScope::Read => "read",
            AdminScope::Operate => "operate",
        }
    }
}

impl AdminConfig {
    /// The listener is on.
    pub fn enabled(&self) -> bool {
        !self.listen.is_empty()
    }

    /// Serves HTTPS.
    pub fn tls(&self) -> bool {
        !self.tls_cert_file.is_empty()
    }

    /// Checks `[admin]`; each error names the setting and what would be valid.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if !(100..=60_000).contains(&self.signal_poll_interval_ms) {
            return Err(ConfigError::invalid("admin.signal_poll_interval_ms", "must be 100 to 60000"));
        }
        if !self.signal_table.is_empty() && self.signal_operator_role.is_empty() {
            return Err(ConfigError::invalid(
                "admin.signal_operator_role",
                "must name the role whose members may insert requests (e.g. \"outbox_relay_operator\")",
            ));
        }
        for (setting, url) in [("admin.url", &self.url), ("admin.advertise_url", &self.advertise_url)] {
            if !(url.is_empty() || url.starts_with("http://") || url.starts_with("https://")) {
                return Err(ConfigError::invalid(
                    setting,
                    format!("\"{url}\" is not an http:// or https:// URL (e.g. \"http://127.0.0.1:9189\")"),
                ));
            }
        }
        if !self.enabled() {
            return Ok(());
        }
        if self.listen.parse::<std::net::SocketAddr>().is_err() {
            return Err(ConfigError::invalid(
                "admin.listen",
                format!("\"{}\" is not ip:port (e.g. \"{SUGGESTED_ADMIN_LISTEN}\"; empty: off)", self.listen),
            ));
        }
        if self.tls_cert_file.is_empty() != self.tls_key_file.is_empty() {
            return Err(ConfigError::invalid(
                "admin.tls_cert_file",
                "set admin.tls_cert_file and admin.tls_key_file together (or neither, on loopback)",
            ));
        }
        if self.tokens.is_empty() && self.clients.is_empty() {
            return Err(ConfigError::invalid(
                "admin.tokens",
                "the admin listener is on but no token may use it: add [[admin.tokens]] with name, scope \
                 (\"read\" or \"operate\") and token_file, or leave admin.listen empty",
            ));
        }
        self.validate_clients()?;
        let names: Vec<&str> = self
            .tokens
            .iter()
            .map(|t| t.name.as_str())
            .chain(self.clients.iter().map(|c| c.name.as_str()))
            .collect();
        for (i, token) in self.tokens.iter().enumerate() {
            let path = format!("admin.tokens[{i}]");
            valid_name(&path, &token.name)?;
            if names[..i].contains(&token.name.as_str()) {
                return Err(ConfigError::invalid(
                    format!("{path}.name"),
                    format!("\"{}\" names another token too: each token needs its own name", token.name),
                ));
            }
            if token.token_file.is_empty() {
                return Err(ConfigError::invalid(
                    format!("{path}.token_file"),
                    "must name the file holding the token",
                ));
            }
        }
        Ok(())
    }

    /// `tls_client_ca_file` and `clients`: set together, over TLS; each client named once (a
    /// token's name too), with a common name no other client has.
    fn validate_clients(&self) -> Result<(), ConfigError> {
        if self.tls_client_ca_file.is_empty() != self.clients.is_empty() {
            return Err(ConfigError::invalid(
                "admin.tls_client_ca_file",
                "set admin.tls_client_ca_file (the CA that signs client certificates) and [[admin.clients]] \
                 together, or neither",
            ));
        }
        if !self.tls_client_ca_file.is_empty() && !self.tls() {
            return Err(ConfigError::invalid(
                "admin.tls_client_ca_file",
                "client certificates need HTTPS: set admin.tls_cert_file and admin.tls_key_file too",
            ));
        }
        for (i, client) in self.clients.iter().enumerate() {
            let path = format!("admin.clients[{i}]");
            valid_name(&path, &client.name)?;
            let earlier = &self.clients[..i];
            if self.tokens.iter().any(|t| t.name == client.name)
                || earlier.iter().any(|c| c.name == client.name)
            {
                return Err(ConfigError::invalid(
                    format!("{path}.name"),
                    format!(
                        "\"{}\" names a token or another client too: each needs its own name",
                        client.name
                    ),
                ));
            }
            if client.subject_cn.is_empty() || earlier.iter().any(|c| c.subject_cn == client.subject_cn) {
                return Err(ConfigError::invalid(
                    format!("{path}.subject_cn"),
                    "must name the certificate's subject common name, one no other client has",
                ));
            }
        }
        Ok(())
    }

    /// Listens beyond loopback without TLS: bearer tokens would cross the network in clear.
    pub fn exposed_without_tls(&self) -> bool {
        let beyond_loopback =
            self.listen.parse::<std::net::SocketAddr>().is_ok_and(|a| !a.ip().to_canonical().is_loopback());
        self.enabled() && beyond_loopback && !self.tls()
    }
}

/// A token's or client's name: what audit lines and "paused by" show.
fn valid_name(path: &str, name: &str) -> Result<(), ConfigError> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name.chars().all(|c| c.is_ascii_alphanumeric() || "-_.@".contains(c));
    if ok {
        return Ok(());
    }
    Err(ConfigError::invalid(
        format!("{path}.name"),
        "must be 1-64 characters of A-Z, a-z, 0-9, '-', '_', '.' and '@'",
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn on(listen: &str) -> AdminConfig {
        AdminConfig {
            listen: listen.into(),
            tokens: vec![AdminToken {
                name: "alice".into(),
                scope: AdminScope::Operate,
                token_file: "/t".into(),
            }],
            ..AdminConfig::default()
        }
    }

    #[test]
    fn off_by_default_and_each_mistake_names_its_setting() {
        assert!(!AdminConfig::default().enabled());
        assert!(AdminConfig::default().validate().is_ok());
        assert!(on("127.0.0.1:9189").validate().is_ok());
        let said = |c: AdminConfig| c.validate().unwrap_err().to_string();
        assert!(said(on("localhost:9189")).starts_with("admin.listen: "));
        let mut half_tls = on("127.0.0.1:9189");
        half_tls.tls_cert_file = "/cert.pem".into();
        assert!(said(half_tls).starts_with("admin.tls_cert_file: "));
        let mut nobody = on("127.0.0.1:9189");
        nobody.tokens.clear();
        assert!(said(nobody).starts_with("admin.tokens: "));
        let mut twice = on("127.0.0.1:9189");
        twice.tokens.push(twice.tokens[0].clone());
        assert!(said(twice).starts_with("admin.tokens[1].name: "));
        let mut spaced = on("127.0.0.1:9189");
        spaced.tokens[0].name = "a b".into();
        assert!(said(spaced).starts_with("admin.tokens[0].name: "));
    }

    #[test]
    fn client_certificates_need_a_ca_https_and_names_of_their_own() {
        let said = |c: &AdminConfig| c.validate().unwrap_err().to_string();
        let mut mutual = on("127.0.0.1:9189");
        mutual.clients.push(AdminClient {
            name: "robot".into(),
            scope: AdminScope::Read,
            subject_cn: "robot".into(),
        });
        assert!(said(&mutual).starts_with("admin.tls_client_ca_file: "), "no CA");
        mutual.tls_client_ca_file = "/ca.pem".into();
        assert!(said(&mutual).contains("need HTTPS"), "{}", said(&mutual));
        (mutual.tls_cert_file, mutual.tls_key_file) = ("/c".into(), "/k".into());
        assert!(mutual.validate().is_ok());
        mutual.tokens.clear();
        assert!(mutual.validate().is_ok(), "clients alone may use the listener");
        let mut same_cn = mutual.clone();
        same_cn.clients.push(AdminClient { name: "other".into(), ..same_cn.clients[0].clone() });
        assert!(said(&same_cn).starts_with("admin.clients[1].subject_cn: "));
        let mut token_named = on("127.0.0.1:9189");
        token_named.clients = mutual.clients.clone();
        token_named.clients[0].name = "alice".into();
        (token_named.tls_client_ca_file, token_named.tls_cert_file, token_named.tls_key_file) =
            ("/ca.pem".into(), "/c".into(), "/k".into());
        assert!(said(&token_named).starts_with("admin.clients[0].name: "));
    }

    #[test]
    fn only_a_listener_beyond_loopback_without_tls_is_exposed() {
        assert!(!on("127.0.0.1:9189").exposed_without_tls());
        assert!(!on("[::1]:9189").exposed_without_tls());
        assert!(on("0.0.0.0:9189").exposed_without_tls());
        let mut tls = on("0.0.0.0:9189");
        (tls.tls_cert_file, tls.tls_key_file) = ("/c".into(), "/k".into());
        assert!(!tls.exposed_without_tls());
        assert!(!AdminConfig::default().exposed_without_tls());
    }
}
