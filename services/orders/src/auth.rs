//! Who is calling: a bearer JWT, verified with the one key the service is configured with.
//!
//! Invariants:
//! - Exactly one algorithm is accepted, the one of the configured key (HS256 with
//!   `auth.hs256_secret_file`, RS256 with `auth.rs256_public_key_file`): a token's own `alg` never
//!   chooses how it is checked, so `none` and an HS256 token "signed" with the RSA public key
//!   (algorithm confusion) are refused.
//! - `exp` and `sub` are required; `nbf` is checked when present (both with `auth.leeway_secs`);
//!   `iss` and `aud` are required and must match when configured (off by default: a start-up
//!   warning says so).
//! - The caller is the token's `sub`, and nothing else: the customer an order is placed for, and
//!   the scope of its Idempotency-Keys.
//! - A refusal tells the client only that it is unauthorized; the reason goes to the log.

use std::path::Path;

use axum::http::{HeaderMap, header};
use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Header, Validation};
use outbox_relay::config::ConfigError;
use serde::{Deserialize, Serialize};

use crate::config::AuthConfig;

/// The shortest HS256 secret accepted: the hash's output size (RFC 7518, section 3.2).
pub const MIN_HS256_SECRET_BYTES: usize = 32;

/// The longest `sub` accepted: it becomes the order's `customer_id`.
pub const MAX_SUBJECT_CHARS: usize = 100;

/// The claims the service reads.
#[derive(Debug, Serialize, Deserialize)]
pub struct Claims {
    pub sub: String,
    pub exp: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub iss: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub aud: Option<String>,
    /// Not before (seconds since the epoch): checked when present, with `auth.leeway_secs`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nbf: Option<u64>,
}

/// An authenticated caller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    pub subject: String,
}

/// Why a request was not authenticated: for the log, never for the client.
#[derive(Debug, thiserror::Error)]
pub enum Refused {
    #[error("no Authorization header")]
    Missing,
    #[error("the Authorization header is not \"Bearer <token>\"")]
    NotBearer,
    #[error("token refused: {0}")]
    Invalid(#[from] jsonwebtoken::errors::Error),
    #[error("token refused: sub must be 1 to {MAX_SUBJECT_CHARS} visible characters")]
    BadSubject,
}

/// Checks bearer tokens against the configured key.
pub struct Verifier {
    key: DecodingKey,
    validation: Validation,
}

impl Verifier {
    /// Reads the configured key file; errors name the setting.
    pub fn from_config(auth: &AuthConfig) -> Result<Verifier, ConfigError> {
        let (key, algorithm) = if !auth.hs256_secret_file.is_empty() {
            let secret = read_hs256_secret(Path::new(&auth.hs256_secret_file))
                .map_err(|message| ConfigError::invalid("auth.hs256_secret_file", message))?;
            let key = DecodingKey::from_secret(&secret).expect("a secret of 32 bytes or more");
            (key, Algorithm::HS256)
        } else {
            let path = &auth.rs256_public_key_file;
            let pem = std::fs::read(path)
                .map_err(|e| ConfigError::invalid("auth.rs256_public_key_file", format!("{path}: {e}")))?;
            let key = DecodingKey::from_rsa_pem(&pem).map_err(|e| {
                ConfigError::invalid(
                    "auth.rs256_public_key_file",
                    format!("{path}: not an RSA public key in PEM: {e}"),
                )
            })?;
            (key, Algorithm::RS256)
        };
        let mut validation = Validation::new(algorithm);
        validation.leeway = auth.leeway_secs;
        // (jsonwebtoken leaves `nbf` unchecked unless asked: a token minted for later is refused)
        validation.validate_nbf = true;
        let mut required = vec!["exp", "sub"];
        if !auth.issuer.is_empty() {
            validation.set_issuer(&[&auth.issuer]);
            required.push("iss");
        }
        if auth.audience.is_empty() {
            validation.validate_aud = false;
        } else {
            validation.set_audience(&[&auth.audience]);
            required.push("aud");
        }
        validation.set_required_spec_claims(&required);
        if auth.issuer.is_empty() || auth.audience.is_empty() {
            tracing::warn!(
                "auth.issuer or auth.audience is empty: a token the key signed for another service is \
                 accepted; set both to what your identity provider puts in this service's tokens"
            );
        }
        Ok(Verifier { key, validation })
    }

    /// The caller named by the request's `Authorization: Bearer` token.
    pub fn verify(&self, headers: &HeaderMap) -> Result<Caller, Refused> {
        let value = headers.get(header::AUTHORIZATION).ok_or(Refused::Missing)?;
        let token = value
            .to_str()
            .ok()
            .and_then(|v| v.split_once(' '))
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
            .map(|(_, token)| token.trim())
            .ok_or(Refused::NotBearer)?;
        let claims = jsonwebtoken::decode::<Claims>(token, &self.key, &self.validation)?.claims;
        let subject_ok = (1..=MAX_SUBJECT_CHARS).contains(&claims.sub.chars().count())
            && claims.sub.chars().all(|c| !c.is_control() && !c.is_whitespace());
        if !subject_ok {
            return Err(Refused::BadSubject);
        }
        Ok(Caller { subject: claims.sub })
    }
}

/// The secret in `path`: its bytes with surrounding whitespace trimmed, at least
/// [`MIN_HS256_SECRET_BYTES`] of them.
pub fn read_hs256_secret(path: &Path) -> Result<Vec<u8>, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let secret = bytes.trim_ascii().to_vec();
    if secret.len() < MIN_HS256_SECRET_BYTES {
        return Err(format!(
            "{}: the secret is {} bytes; at least {MIN_HS256_SECRET_BYTES} are needed \
             (e.g. head -c 48 /dev/urandom | base64 > FILE)",
            path.display(),
            secret.len()
        ));
    }
    Ok(secret)
}

/// An HS256 token with `claims`: what `orders mint-token` and `orders-load` send.
pub fn mint_hs256(secret: &[u8], claims: &Claims) -> String {
    let key = EncodingKey::from_secret(secret).expect("a non-empty secret");
    jsonwebtoken::encode(&Header::new(Algorithm::HS256), claims, &key).expect("HS256 signs any claims")
}

/// Seconds since the Unix epoch, for `exp`.
pub fn now_secs() -> u64 {
    jsonwebtoken::get_current_timestamp()
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    const SECRET: &[u8] = b"0123456789abcdef0123456789abcdef";

    fn verifier(issuer: &str, audience: &str) -> Verifier {
        let dir = tempdir();
        let file = dir.join("secret");
        std::fs::write(&file, [SECRET, b"\n"].concat()).unwrap();
        let auth = AuthConfig {
            hs256_secret_file: file.to_str().unwrap().into(),
            issuer: issuer.into(),
            audience: audience.into(),
            leeway_secs: 0,
            ..AuthConfig::default()
        };
        Verifier::from_config(&auth).unwrap()
    }

    fn tempdir() -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "orders-auth-{}-{}",
            std::process::id(),
            rand::random::<u64>()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn bearer(token: &str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(header::AUTHORIZATION, HeaderValue::from_str(&format!("Bearer {token}")).unwrap());
        headers
    }

    fn claims(sub: &str, exp: u64) -> Claims {
        Claims { sub: sub.into(), exp, iss: None, aud: None, nbf: None }
    }

    #[test]
    fn a_valid_token_names_its_subject_and_the_rest_are_refused() {
        let verifier = verifier("", "");
        let good = mint_hs256(SECRET, &claims("customer-1", now_secs() + 60));
        assert_eq!(verifier.verify(&bearer(&good)).unwrap().subject, "customer-1");

        let expired = mint_hs256(SECRET, &claims("customer-1", now_secs() - 10));
        let forged = mint_hs256(b"another secret, 32 bytes or more!", &claims("customer-1", now_secs() + 60));
        let empty_sub = mint_hs256(SECRET, &claims("", now_secs() + 60));
        for token in [expired, forged, empty_sub, "not.a.token".into()] {
            assert!(verifier.verify(&bearer(&token)).is_err(), "{token}");
        }
        assert!(matches!(verifier.verify(&HeaderMap::new()), Err(Refused::Missing)));
    }

    #[test]
    fn a_token_not_valid_before_a_later_time_is_refused_until_then() {
        let verifier = verifier("", "");
        let exp = now_secs() + 3600;
        let later = mint_hs256(SECRET, &Claims { nbf: Some(now_secs() + 600), ..claims("c", exp) });
        let refused = verifier.verify(&bearer(&later)).unwrap_err().to_string();
        assert!(refused.contains("ImmatureSignature"), "{refused}");
        let earlier = mint_hs256(SECRET, &Claims { nbf: Some(now_secs() - 10), ..claims("c", exp) });
        assert_eq!(verifier.verify(&bearer(&earlier)).unwrap().subject, "c");
    }

    #[test]
    fn issuer_and_audience_are_required_when_configured() {
        let verifier = verifier("shop", "orders");
        let exp = now_secs() + 60;
        let with = |iss: Option<&str>, aud: Option<&str>| Claims {
            iss: iss.map(Into::into),
            aud: aud.map(Into::into),
            ..claims("c", exp)
        };
        assert!(verifier.verify(&bearer(&mint_hs256(SECRET, &with(Some("shop"), Some("orders"))))).is_ok());
        for bad in [with(None, Some("orders")), with(Some("shop"), None), with(Some("x"), Some("orders"))] {
            assert!(verifier.verify(&bearer(&mint_hs256(SECRET, &bad))).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_short_secret_is_refused_naming_the_setting() {
        let file = tempdir().join("short");
        std::fs::write(&file, "short").unwrap();
        let auth = AuthConfig { hs256_secret_file: file.to_str().unwrap().into(), ..AuthConfig::default() };
        let error = Verifier::from_config(&auth).err().unwrap().to_string();
        assert!(error.contains("auth.hs256_secret_file") && error.contains("at least 32"), "{error}");
    }
}
