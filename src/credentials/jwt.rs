//! The claims of a JWT the relay holds (`exp`, `sub`), read without verifying the signature:
//! the brokers verify it; the relay only needs to know when to replace it and whom it names.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;

/// The claims the relay reads.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Claims {
    /// `exp`: when the token expires.
    pub expires_at: Option<SystemTime>,
    /// `sub`: the principal.
    pub subject: Option<String>,
}

/// The claims of `token`, or `None` when it is not a JWT (three base64url parts, JSON claims).
pub fn claims(token: &str) -> Option<Claims> {
    let mut parts = token.trim().split('.');
    let (_header, payload, _signature) = (parts.next()?, parts.next()?, parts.next()?);
    if parts.next().is_some() {
        return None;
    }
    let bytes = URL_SAFE_NO_PAD.decode(payload.trim_end_matches('=')).ok()?;
    let json: serde_json::Value = serde_json::from_slice(&bytes).ok()?;
    let expires_at =
        json.get("exp").and_then(serde_json::Value::as_u64).map(|s| UNIX_EPOCH + Duration::from_secs(s));
    let subject = json.get("sub").and_then(serde_json::Value::as_str).map(String::from);
    Some(Claims { expires_at, subject })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_and_sub_are_read_from_a_jwt() {
        let payload = URL_SAFE_NO_PAD.encode(br#"{"exp":1796409708,"sub":"8ebcf0f6","aud":"account"}"#);
        let claims = claims(&format!("eyJhbGciOiJSUzI1NiJ9.{payload}.c2ln")).unwrap();
        assert_eq!(claims.expires_at, Some(UNIX_EPOCH + Duration::from_secs(1_796_409_708)));
        assert_eq!(claims.subject.as_deref(), Some("8ebcf0f6"));
        assert_eq!(super::claims("not-a-jwt"), None);
        assert_eq!(super::claims("a.b.c.d"), None);
    }
}
