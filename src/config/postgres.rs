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
    /// only: `verify-ca` needs it); `"system"`: the system's CA bundle, as in libpq 16
    /// (`verify-full` only, as libpq).
    pub sslrootcert: String,
    /// PEM client certificate and key, for certificate authentication; both or neither.
    pub sslcert: String,
    pub sslkey: String,
    /// `password` (default: `password`, `password_file` or none), or `aws_iam`: an RDS/Aurora
    /// IAM authentication token made at each connect (SigV4, credentials from the AWS chain;
    /// needs `sslmode = "verify-full"` and the `rds_iam` role on the user).
    pub auth: PgAuth,
    /// With `auth = "aws_iam"`: the database's AWS region; empty: `AWS_REGION`, then
    /// `AWS_DEFAULT_REGION`.
    pub aws_region: String,
}

/// `postgres.auth`: how the relay proves who it is to PostgreSQL.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PgAuth {
    #[default]
    Password,
    AwsIam,
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

    /// One server as `postgres.host` names them (`host`, `host:port`, `[v6]:port`; the port
    /// defaults to `postgres.port`), e.g. a `--standby` argument.
    pub fn endpoint(&self, entry: &str) -> Result<Endpoint, String> {
        self.parse_endpoint(entry.trim())
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
        if pg.auth == PgAuth::AwsIam {
            pg.validate_aws_iam()?;
        }
        pg.validate_tls()
    }

    /// `postgres.auth = "aws_iam"`: no password of its own, `verify-full`, and a region.
    fn validate_aws_iam(&self) -> Result<(), ConfigError> {
        let pg = self;
        if pg.password.is_some() || !pg.password_file.is_empty() {
            return Err(ConfigError::invalid(
                "postgres.auth",
                "\"aws_iam\" makes the password at each connect: leave postgres.password and \
                 postgres.password_file unset",
            ));
        }
        if pg.sslmode != SslMode::VerifyFull {
            return Err(ConfigError::invalid(
                "postgres.sslmode",
                "must be \"verify-full\" with postgres.auth = \"aws_iam\": the token is a bearer credential for \
                 15 minutes and goes only to a server whose certificate and name are checked",
            ));
        }
        if pg.aws_region().is_none() {
            return Err(ConfigError::invalid(
                "postgres.aws_region",
                "must be set with postgres.auth = \"aws_iam\" (or AWS_REGION)",
            ));
        }
        Ok(())
    }

    /// The TLS settings: a client certificate with its key, a root for `verify-ca`, the system's
    /// roots only with `verify-full`, and every file named there.
    fn validate_tls(&self) -> Result<(), ConfigError> {
        let pg = self;
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
        if pg.sslrootcert == SYSTEM_ROOTS {
            if pg.sslmode != SslMode::VerifyFull {
                // libpq 16 refuses it too: the system's CAs sign certificates for any host
                return Err(ConfigError::invalid(
                    "postgres.sslmode",
                    format!(
                        "{} may not be used with postgres.sslrootcert = \"system\" (as libpq says): any \
                         public CA signs certificates for any host, so only verify-full, which checks the name, \
                         means anything; use verify-full",
                        pg.sslmode
                    ),
                ));
            }
            pg.root_cert_file().map_err(|problem| ConfigError::invalid("postgres.sslrootcert", problem))?;
        }
        for (path, file) in [
            ("postgres.sslrootcert", &pg.sslrootcert),
            ("postgres.sslcert", &pg.sslcert),
            ("postgres.sslkey", &pg.sslkey),
        ] {
            if !file.is_empty() && file.as_str() != SYSTEM_ROOTS && !Path::new(file).is_file() {
                return Err(ConfigError::invalid(path, format!("{file}: no such file")));
            }
        }
        Ok(())
    }
}

/// `postgres.sslrootcert = "system"`: the system's trusted CAs, as libpq 16 means it.
pub const SYSTEM_ROOTS: &str = "system";

/// Where the system's CA bundle is, in the order OpenSSL's builds and `openssl-probe` look
/// (Debian/Ubuntu, RHEL/Fedora, openSUSE, Alpine and the BSDs); `SSL_CERT_FILE` comes first.
const SYSTEM_BUNDLES: &[&str] = &[
    "/etc/ssl/certs/ca-certificates.crt",
    "/etc/pki/tls/certs/ca-bundle.crt",
    "/etc/pki/ca-trust/extracted/pem/tls-ca-bundle.pem",
    "/etc/ssl/ca-bundle.pem",
    "/etc/ssl/cert.pem",
];

impl PostgresConfig {
    /// The PEM file of the CAs to trust: `sslrootcert`, or for `"system"` the system's bundle
    /// (`SSL_CERT_FILE` when set, as libpq's OpenSSL reads it, else the first bundle found);
    /// `None` when unset (the relay's built-in Mozilla roots). The error says what was looked for.
    pub fn root_cert_file(&self) -> Result<Option<String>, String> {
        if self.sslrootcert != SYSTEM_ROOTS {
            return Ok((!self.sslrootcert.is_empty()).then(|| self.sslrootcert.clone()));
        }
        system_bundle(std::env::var("SSL_CERT_FILE").ok(), |path| Path::new(path).is_file()).map(Some)
    }
}

fn system_bundle(ssl_cert_file: Option<String>, exists: impl Fn(&str) -> bool) -> Result<String, String> {
    if let Some(file) = ssl_cert_file.filter(|f| !f.is_empty()) {
        return if exists(&file) {
            Ok(file)
        } else {
            Err(format!("\"system\": SSL_CERT_FILE names {file}, which does not exist"))
        };
    }
    SYSTEM_BUNDLES.iter().find(|path| exists(path)).map(|path| path.to_string()).ok_or_else(|| {
        format!(
            "\"system\": no system CA bundle found (looked for {}; install the ca-certificates package, or \
             set SSL_CERT_FILE)",
            SYSTEM_BUNDLES.join(", ")
        )
    })
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
            auth: PgAuth::Password,
            aws_region: String::new(),
        }
    }
}

impl PostgresConfig {
    /// The AWS region of `auth = "aws_iam"`: `aws_region`, else `AWS_REGION`, else
    /// `AWS_DEFAULT_REGION`.
    pub fn aws_region(&self) -> Option<String> {
        if !self.aws_region.is_empty() {
            return Some(self.aws_region.clone());
        }
        ["AWS_REGION", "AWS_DEFAULT_REGION"]
            .iter()
            .find_map(|n| std::env::var(n).ok().filter(|v| !v.is_empty()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aws_iam_needs_verify_full_a_region_and_no_password() {
        let iam = PostgresConfig {
            auth: PgAuth::AwsIam,
            aws_region: "eu-west-1".into(),
            sslmode: SslMode::VerifyFull,
            ..Default::default()
        };
        assert!(iam.validate().is_ok());
        let err = |c: PostgresConfig| c.validate().unwrap_err().to_string();
        assert!(
            err(PostgresConfig { sslmode: SslMode::Require, ..iam.clone() }).starts_with("postgres.sslmode")
        );
        assert!(
            err(PostgresConfig { password: Some(Secret::new("x")), ..iam.clone() })
                .starts_with("postgres.auth")
        );
    }

    #[test]
    fn system_roots_are_ssl_cert_file_or_the_first_bundle_found() {
        let only = |present: &'static str| move |path: &str| path == present;
        assert_eq!(system_bundle(None, only("/etc/ssl/cert.pem")).unwrap(), "/etc/ssl/cert.pem");
        assert_eq!(
            system_bundle(None, |_| true).unwrap(),
            "/etc/ssl/certs/ca-certificates.crt",
            "Debian's bundle comes first"
        );
        assert_eq!(system_bundle(Some("/ca.pem".into()), only("/ca.pem")).unwrap(), "/ca.pem");
        assert!(
            system_bundle(Some("/nope.pem".into()), only("/etc/ssl/cert.pem"))
                .is_err_and(|e| e.contains("SSL_CERT_FILE"))
        );
        assert!(system_bundle(None, |_| false).is_err_and(|e| e.contains("ca-certificates")));
    }
}
