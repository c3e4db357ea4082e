//! `[postgres]`: the servers (one, or a list tried for the one that accepts writes), the
//! credentials and TLS. Every connection of the relay is made from this section
//! (`crate::postgres`); `validate` names the `postgres.*` field to fix.
//!
//! Invariant: `verify-ca` always has its own trust anchors (`sslrootcert`): against the public
//! roots, a chain check without the name check would accept any certificate any public CA
//! issued, for any host.

use std::fmt;
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::{
    ConfigError, DEFAULT_PG_APPLICATION_NAME, DEFAULT_PG_CONNECT_TIMEOUT_SECS, DEFAULT_PG_DATABASE,
    DEFAULT_PG_HOST, DEFAULT_PG_PORT, DEFAULT_PG_USER, Secret,
};

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PostgresConfig {
    /// One server, or a comma-separated list tried in order for the one that accepts writes
    /// (libpq's `target_session_attrs=read-write`); each `host` or `host:port`.
    pub host: String,
    /// The port of the servers in `host` that do not name their own.
    pub port: u16,
    pub user: String,
    pub password: Option<Secret>,
    /// A file whose first line is the password (a mounted Kubernetes Secret); read at each
    /// connect. Used when `password` is not set.
    pub password_file: String,
    pub database: String,
    pub connect_timeout_secs: u64,
    /// Shown in `pg_stat_activity`; give each instance its own to tell them apart.
    pub application_name: String,
    /// `disable`, `prefer`, `require`, `verify-ca` or `verify-full` (default), as libpq; under
    /// `prefer` and `require` (without `sslrootcert`) a password is sent only by SCRAM with
    /// channel binding (`crate::postgres`).
    pub sslmode: SslMode,
    /// PEM file of the CA certificates to trust; empty: the Mozilla roots (under `verify-full`
    /// only: `verify-ca` needs it).
    pub sslrootcert: String,
    /// PEM client certificate and key, for certificate authentication; both or neither.
    pub sslcert: String,
    pub sslkey: String,
}

/// One server of `postgres.host`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    pub host: String,
    pub port: u16,
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.host.contains(':') {
            write!(f, "[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{}:{}", self.host, self.port)
        }
    }
}

impl PostgresConfig {
    /// The servers of `host`, in order (validated: every entry parses).
    pub fn endpoints(&self) -> Vec<Endpoint> {
        self.parse_endpoints().unwrap_or_default()
    }

    fn parse_endpoints(&self) -> Result<Vec<Endpoint>, String> {
        self.host.split(',').map(str::trim).map(|entry| self.parse_endpoint(entry)).collect()
    }

    /// `host`, `host:port`, `[v6]` or `[v6]:port` (a bare IPv6 address takes `port`).
    fn parse_endpoint(&self, entry: &str) -> Result<Endpoint, String> {
        let bad = || format!("entry \"{entry}\" is not host, host:port or [ipv6]:port (port 1-65535)");
        let (host, port) = match entry.strip_prefix('[') {
            Some(rest) => match rest.split_once(']') {
                Some((host, "")) => (host, None),
                Some((host, port)) => (host, Some(port.strip_prefix(':').ok_or_else(bad)?)),
                None => return Err(bad()),
            },
            None if entry.matches(':').count() == 1 => {
                entry.split_once(':').map(|(h, p)| (h, Some(p))).unwrap()
            }
            None => (entry, None),
        };
        if entry.is_empty() {
            return Err("has an empty entry".to_string());
        }
        let port = match port {
            None => self.port,
            Some(port) => port.parse::<u16>().ok().filter(|p| *p > 0).ok_or_else(bad)?,
        };
        if host.is_empty() {
            return Err(bad());
        }
        Ok(Endpoint { host: host.into(), port })
    }
}

/// `postgres.sslmode`, with libpq's meanings (see [`crate::postgres`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum SslMode {
    Disable,
    Prefer,
    Require,
    VerifyCa,
    /// The default, as in the Kubernetes ConfigMap: the chain and the host name are checked.
    #[default]
    VerifyFull,
}

impl fmt::Display for SslMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            SslMode::Disable => "disable",
            SslMode::Prefer => "prefer",
            SslMode::Require => "require",
            SslMode::VerifyCa => "verify-ca",
            SslMode::VerifyFull => "verify-full",
        })
    }
}

impl PostgresConfig {
    /// Checks what types alone cannot; each error names the `postgres.*` field to fix.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let pg = self;
        if pg.host.is_empty() {
            return Err(ConfigError::invalid("postgres.host", "must not be empty"));
        }
        if let Err(problem) = pg.parse_endpoints() {
            return Err(ConfigError::invalid(
                "postgres.host",
                format!("{problem}: give one server or a comma-separated list, e.g. \"pg-0:5432,pg-1:5432\""),
            ));
        }
        if pg.port == 0 {
            return Err(ConfigError::invalid("postgres.port", "must be between 1 and 65535"));
        }
        if pg.user.is_empty() {
            return Err(ConfigError::invalid("postgres.user", "must not be empty"));
        }
        if pg.database.is_empty() {
            return Err(ConfigError::invalid("postgres.database", "must not be empty"));
        }
        if pg.password.is_some() && !pg.password_file.is_empty() {
            return Err(ConfigError::invalid(
                "postgres.password_file",
                "set postgres.password or postgres.password_file, not both",
            ));
        }
        if pg.sslcert.is_empty() != pg.sslkey.is_empty() {
            return Err(ConfigError::invalid(
                "postgres.sslkey",
                "postgres.sslcert and postgres.sslkey go together: set both or neither",
            ));
        }
        if pg.sslmode == SslMode::VerifyCa && pg.sslrootcert.is_empty() {
            return Err(ConfigError::invalid(
                "postgres.sslmode",
                "verify-ca needs postgres.sslrootcert: without it any certificate a public CA signed for \
                 any name would pass; set postgres.sslrootcert to the CA that signed the server's \
                 certificate, or use verify-full",
            ));
        }
        for (path, file) in [
            ("postgres.sslrootcert", &pg.sslrootcert),
            ("postgres.sslcert", &pg.sslcert),
            ("postgres.sslkey", &pg.sslkey),
        ] {
            if !file.is_empty() && !Path::new(file).is_file() {
                return Err(ConfigError::invalid(path, format!("{file}: no such file")));
            }
        }
        Ok(())
    }
}

impl Default for PostgresConfig {
    fn default() -> Self {
        PostgresConfig {
            host: DEFAULT_PG_HOST.into(),
            port: DEFAULT_PG_PORT,
            user: DEFAULT_PG_USER.into(),
            password: None,
            password_file: String::new(),
            database: DEFAULT_PG_DATABASE.into(),
            connect_timeout_secs: DEFAULT_PG_CONNECT_TIMEOUT_SECS,
            application_name: DEFAULT_PG_APPLICATION_NAME.into(),
            sslmode: SslMode::default(),
            sslrootcert: String::new(),
            sslcert: String::new(),
            sslkey: String::new(),
        }
    }
}
