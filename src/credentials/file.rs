//! A token another process writes to a file (a Kubernetes projected service-account token, a
//! sidecar): read again when the file changes (its modification time or length), and its expiry
//! taken from the JWT's `exp` (a token without one is re-read every five minutes).

use std::sync::Mutex;
use std::time::{Duration, SystemTime};

use super::{FetchError, Token, jwt};
use crate::config::{KafkaAuthConfig, Secret};

/// How long a token without `exp` is used before the file is read again.
const WITHOUT_EXPIRY: Duration = Duration::from_secs(300);

pub(super) struct TokenFile {
    path: String,
    /// (modification time, length) of the file as last read.
    seen: Mutex<Option<(SystemTime, u64)>>,
}

impl TokenFile {
    pub(super) fn new(auth: &KafkaAuthConfig) -> TokenFile {
        TokenFile { path: auth.token_file.clone(), seen: Mutex::new(None) }
    }

    fn stamp(&self) -> Option<(SystemTime, u64)> {
        let metadata = std::fs::metadata(&self.path).ok()?;
        Some((metadata.modified().ok()?, metadata.len()))
    }

    /// The file differs from what was last read.
    pub(super) fn changed(&self) -> bool {
        let seen = *self.seen.lock().unwrap();
        seen.is_some() && self.stamp() != seen
    }

    pub(super) fn fetch(&self) -> Result<Token, FetchError> {
        let stamp = self.stamp();
        let text = std::fs::read_to_string(&self.path)
            .map_err(|e| FetchError::Unavailable(format!("kafka.auth.token_file {}: {e}", self.path)))?;
        let token = text.trim();
        if token.is_empty() {
            return Err(FetchError::Unavailable(format!("kafka.auth.token_file {} is empty", self.path)));
        }
        *self.seen.lock().unwrap() = stamp;
        let claims = jwt::claims(token).unwrap_or_default();
        let expires_at = claims.expires_at.unwrap_or_else(|| SystemTime::now() + WITHOUT_EXPIRY);
        if expires_at <= SystemTime::now() {
            return Err(FetchError::Unavailable(format!(
                "kafka.auth.token_file {}: the token in it has expired",
                self.path
            )));
        }
        let principal = claims.subject.unwrap_or_else(|| "the token file's subject".into());
        Ok(Token { value: Secret::new(token), expires_at, principal })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::AuthMechanism;
    use base64::Engine;
    use base64::engine::general_purpose::URL_SAFE_NO_PAD;

    fn jwt(exp: u64, sub: &str) -> String {
        let payload = URL_SAFE_NO_PAD.encode(format!(r#"{{"exp":{exp},"sub":"{sub}"}}"#));
        format!("eyJhbGciOiJSUzI1NiJ9.{payload}.c2ln")
    }

    #[test]
    fn a_rewritten_token_file_is_read_again() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("token");
        let exp = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).unwrap().as_secs() + 600;
        std::fs::write(&path, jwt(exp, "first")).unwrap();
        let mut auth: KafkaAuthConfig =
            serde_json::from_value(serde_json::json!({"mechanism": "token_file", "token_file": path}))
                .unwrap();
        auth.mechanism = AuthMechanism::TokenFile;
        let file = TokenFile::new(&auth);
        let token = file.fetch().unwrap();
        assert_eq!(token.principal, "first");
        assert!(!file.changed());
        std::fs::write(&path, jwt(exp + 60, "second-principal")).unwrap();
        assert!(file.changed(), "a longer token was written");
        assert_eq!(file.fetch().unwrap().principal, "second-principal");
        std::fs::write(&path, jwt(1, "old")).unwrap();
        assert!(file.fetch().unwrap_err().to_string().contains("expired"));
    }
}
