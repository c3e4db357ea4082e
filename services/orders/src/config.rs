//! The order service's configuration: one TOML file, then `ORDERS__SECTION__FIELD` environment
//! overrides, read with the relay's own loader so that `[postgres]` means exactly what it means
//! to the relay (TLS, multi-host, password files).

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use outbox_relay::config::{ConfigError, DEFAULT_PG_APPLICATION_NAME, PostgresConfig, load_layered};
use serde::{Deserialize, Serialize};

/// The longest a key may be remembered.
pub const MAX_KEY_TTL_SECS: u64 = 30 * 86_400;

/// `http.max_header_bytes` by default: a bearer token, a key and the usual headers fit.
pub const DEFAULT_MAX_HEADER_BYTES: usize = 16 * 1024;
/// `http.max_body_bytes` by default.
pub const DEFAULT_MAX_BODY_BYTES: usize = 16 * 1024;

/// The environment prefix: `ORDERS__HTTP__LISTEN=0.0.0.0:8080`.
pub const ENV_PREFIX: &str = "ORDERS";

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OrdersConfig {
    pub postgres: PostgresConfig,
    pub http: HttpConfig,
    pub auth: AuthConfig,
    pub rate_limit: RateLimitConfig,
    pub idempotency: IdempotencyConfig,
    pub faults: FaultConfig,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HttpConfig {
    /// Address of the API (`POST /orders`), `/healthz` and `/metrics`.
    pub listen: String,
    /// Sessions kept open to PostgreSQL; a request waits for one when all are busy.
    pub pool_size: usize,
    /// How long a request waits for a session when all are busy before answering 503 with
    /// `Retry-After`.
    pub pool_wait_ms: u64,
    /// How long a connection may take to send a request's headers (and how long it may sit idle
    /// between requests) before it is closed: a client that trickles its headers (slowloris)
    /// holds a connection this long at most.
    pub header_read_timeout_ms: u64,
    /// How long a request may take in all, body included; then 503 with `Retry-After` (the
    /// order may or may not have been written, and a retry with the same key tells which).
    pub request_timeout_ms: u64,
    /// Connections served at once; further ones wait in the listen backlog until one closes.
    pub max_connections: usize,
    /// The most a connection may buffer of a request's line and headers (hyper's read buffer;
    /// 8192 at least). Longer headers: the connection is closed.
    pub max_header_bytes: usize,
    /// The largest request body read, and only once the caller is authenticated; a longer one
    /// is answered 413. An order is a few dozen bytes of JSON.
    pub max_body_bytes: usize,
}

impl Default for HttpConfig {
    fn default() -> Self {
        HttpConfig {
            listen: "127.0.0.1:8080".into(),
            pool_size: 8,
            pool_wait_ms: 5_000,
            header_read_timeout_ms: 10_000,
            request_timeout_ms: 30_000,
            max_connections: 1_024,
            max_header_bytes: DEFAULT_MAX_HEADER_BYTES,
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
        }
    }
}

/// Bearer-token authentication of `POST /orders`: a JWT signed with HS256 (a shared secret) or
/// RS256 (the issuer's private key; the service holds the public key). Set exactly one key file.
/// The token's `sub` is the customer the order is placed for.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AuthConfig {
    /// File holding the HS256 shared secret (its bytes, surrounding whitespace trimmed; at least
    /// 32 bytes). Only HS256 tokens are accepted with it.
    pub hs256_secret_file: String,
    /// PEM file of the RSA public key (2048 bits or more) that verifies RS256 tokens. Only
    /// RS256 tokens are accepted with it.
    pub rs256_public_key_file: String,
    /// The `iss` a token must carry; empty: not checked.
    pub issuer: String,
    /// The `aud` a token must carry; empty: not checked.
    pub audience: String,
    /// Clock skew allowed when checking `exp` and `nbf`.
    pub leeway_secs: u64,
}

impl Default for AuthConfig {
    fn default() -> Self {
        AuthConfig {
            hs256_secret_file: String::new(),
            rs256_public_key_file: String::new(),
            issuer: String::new(),
            audience: String::new(),
            leeway_secs: 30,
        }
    }
}

/// A token bucket per caller (the token's `sub`): `burst` requests at once, refilled at
/// `requests_per_sec`; past it, 429 with `Retry-After`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RateLimitConfig {
    /// Sustained requests per second allowed to one caller.
    pub requests_per_sec: f64,
    /// Requests one caller may make at once after a quiet spell.
    pub burst: u32,
}

impl Default for RateLimitConfig {
    fn default() -> Self {
        RateLimitConfig { requests_per_sec: 10.0, burst: 20 }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct IdempotencyConfig {
    /// How long a request owns its key. A request that crashed mid-way leaves its key in
    /// progress; a retry may take it over once the lease is over. Longer than the slowest
    /// request, or two attempts could overlap (the fencing check still stops the stale one).
    pub lease_ms: u64,
    /// How long a retry waits for another request holding the same key before answering 409
    /// with `Retry-After`.
    pub wait_ms: u64,
    /// How long a key is remembered; after that the same key is a new request.
    pub key_ttl_secs: u64,
    /// How often expired keys are deleted (`idempotency_keys_cleanup()`); 0 disables it.
    pub cleanup_interval_secs: u64,
}

impl Default for IdempotencyConfig {
    fn default() -> Self {
        IdempotencyConfig {
            lease_ms: 30_000,
            wait_ms: 2_000,
            key_ttl_secs: 86_400,
            cleanup_interval_secs: 60,
        }
    }
}

/// Faults for tests and drills only; leave unset in production.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FaultConfig {
    /// Abort the process right after a request claimed its key, before the order is written:
    /// a crash mid-request.
    pub abort_after_claim: bool,
    /// Sleep this long after claiming a key, before writing: a stalled worker whose lease runs
    /// out.
    pub pause_after_claim_ms: u64,
    /// Abort the process right after the order's transaction committed, before answering: the
    /// order exists and the client never hears of it.
    pub abort_after_write: bool,
}

impl OrdersConfig {
    /// Loads `file` with the process's environment on top, and validates.
    pub fn load(file: &Path) -> Result<OrdersConfig, ConfigError> {
        let env = std::env::vars().collect();
        let mut config: OrdersConfig = load_layered(file, ENV_PREFIX, env, "see deploy/orders.example.toml")?;
        if config.postgres.application_name == DEFAULT_PG_APPLICATION_NAME {
            // pg_stat_activity tells the service's sessions from the relay's
            config.postgres.application_name = "orders".into();
        }
        config.validate()?;
        Ok(config)
    }

    /// Checks what types alone cannot; each error names the field to fix.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.postgres.validate()?;
        if self.http.listen.parse::<SocketAddr>().is_err() {
            return Err(ConfigError::invalid(
                "http.listen",
                format!("\"{}\" is not ip:port", self.http.listen),
            ));
        }
        if !(1..=256).contains(&self.http.pool_size) {
            return Err(ConfigError::invalid("http.pool_size", "must be between 1 and 256"));
        }
        self.validate_limits()?;
        self.validate_auth()?;
        let i = &self.idempotency;
        if !(100..=3_600_000).contains(&i.lease_ms) {
            return Err(ConfigError::invalid("idempotency.lease_ms", "must be between 100 and 3600000"));
        }
        if i.wait_ms > 60_000 {
            return Err(ConfigError::invalid("idempotency.wait_ms", "must be <= 60000"));
        }
        if !(1..=MAX_KEY_TTL_SECS).contains(&i.key_ttl_secs) {
            return Err(ConfigError::invalid(
                "idempotency.key_ttl_secs",
                "must be between 1 and 2592000 (30 days)",
            ));
        }
        if i.key_ttl_secs.saturating_mul(1000) <= i.lease_ms {
            return Err(ConfigError::invalid(
                "idempotency.key_ttl_secs",
                "must be longer than idempotency.lease_ms, or a key could expire while in progress",
            ));
        }
        Ok(())
    }
}

impl OrdersConfig {
    fn validate_limits(&self) -> Result<(), ConfigError> {
        let h = &self.http;
        if !(1..=60_000).contains(&h.pool_wait_ms) {
            return Err(ConfigError::invalid("http.pool_wait_ms", "must be between 1 and 60000"));
        }
        if !(100..=300_000).contains(&h.header_read_timeout_ms) {
            return Err(ConfigError::invalid(
                "http.header_read_timeout_ms",
                "must be between 100 and 300000",
            ));
        }
        if !(100..=600_000).contains(&h.request_timeout_ms) {
            return Err(ConfigError::invalid("http.request_timeout_ms", "must be between 100 and 600000"));
        }
        if !(1..=100_000).contains(&h.max_connections) {
            return Err(ConfigError::invalid("http.max_connections", "must be between 1 and 100000"));
        }
        if !(8_192..=1 << 20).contains(&h.max_header_bytes) {
            return Err(ConfigError::invalid("http.max_header_bytes", "must be between 8192 and 1048576"));
        }
        if !(64..=1 << 20).contains(&h.max_body_bytes) {
            return Err(ConfigError::invalid("http.max_body_bytes", "must be between 64 and 1048576"));
        }
        let r = &self.rate_limit;
        if !(r.requests_per_sec.is_finite() && r.requests_per_sec > 0.0 && r.requests_per_sec <= 1e6) {
            return Err(ConfigError::invalid("rate_limit.requests_per_sec", "must be > 0 and <= 1000000"));
        }
        if !(1..=1_000_000).contains(&r.burst) {
            return Err(ConfigError::invalid("rate_limit.burst", "must be between 1 and 1000000"));
        }
        Ok(())
    }

    fn validate_auth(&self) -> Result<(), ConfigError> {
        let a = &self.auth;
        match (a.hs256_secret_file.is_empty(), a.rs256_public_key_file.is_empty()) {
            (true, true) => Err(ConfigError::invalid(
                "auth.hs256_secret_file",
                "set auth.hs256_secret_file or auth.rs256_public_key_file: POST /orders is served only \
                 to callers with a bearer token",
            )),
            (false, false) => Err(ConfigError::invalid(
                "auth.rs256_public_key_file",
                "set only one of auth.hs256_secret_file and auth.rs256_public_key_file",
            )),
            _ if a.leeway_secs > 300 => Err(ConfigError::invalid("auth.leeway_secs", "must be <= 300")),
            _ => Ok(()),
        }
    }
}

impl HttpConfig {
    pub fn pool_wait(&self) -> Duration {
        Duration::from_millis(self.pool_wait_ms)
    }

    pub fn header_read_timeout(&self) -> Duration {
        Duration::from_millis(self.header_read_timeout_ms)
    }

    pub fn request_timeout(&self) -> Duration {
        Duration::from_millis(self.request_timeout_ms)
    }
}

impl IdempotencyConfig {
    pub fn lease(&self) -> Duration {
        Duration::from_millis(self.lease_ms)
    }

    pub fn wait(&self) -> Duration {
        Duration::from_millis(self.wait_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(extra_env: &[(&str, &str)]) -> Result<OrdersConfig, ConfigError> {
        let file = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/orders.example.toml");
        let env = extra_env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        let config: OrdersConfig = load_layered(&file, ENV_PREFIX, env, "")?;
        config.validate()?;
        Ok(config)
    }

    #[test]
    fn the_example_file_loads_and_the_environment_overrides_it() {
        let config = load(&[("ORDERS__HTTP__LISTEN", "0.0.0.0:9000")]).unwrap();
        assert_eq!(config.auth.hs256_secret_file, "/var/run/secrets/orders/jwt-hs256");
        assert_eq!(config.http.listen, "0.0.0.0:9000");
        assert_eq!(config.idempotency.lease_ms, 30_000);
    }

    #[test]
    fn errors_name_the_field() {
        for (name, value, field) in [
            ("ORDERS__IDEMPOTENCY__LEASE_MS", "5", "idempotency.lease_ms"),
            ("ORDERS__IDEMPOTENCY__KEY_TTL_SECS", "99999999999", "idempotency.key_ttl_secs"),
            ("ORDERS__HTTP__LISTEN", "nowhere", "http.listen"),
            ("ORDERS__HTTP__POOL_SIZE", "0", "http.pool_size"),
            ("ORDERS__HTTP__HEADER_READ_TIMEOUT_MS", "0", "http.header_read_timeout_ms"),
            ("ORDERS__HTTP__MAX_CONNECTIONS", "0", "http.max_connections"),
            ("ORDERS__HTTP__MAX_HEADER_BYTES", "1024", "http.max_header_bytes"),
            ("ORDERS__HTTP__MAX_BODY_BYTES", "0", "http.max_body_bytes"),
            ("ORDERS__RATE_LIMIT__BURST", "0", "rate_limit.burst"),
            ("ORDERS__AUTH__HS256_SECRET_FILE", "", "auth.hs256_secret_file"),
            ("ORDERS__AUTH__RS256_PUBLIC_KEY_FILE", "/k.pem", "auth.rs256_public_key_file"),
        ] {
            let error = load(&[(name, value)]).unwrap_err().to_string();
            assert!(error.contains(field), "{name}={value}: {error}");
        }
    }
}
