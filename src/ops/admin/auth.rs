//! Who is asking: bearer tokens read from their files (`admin.tokens`), compared in constant
//! time, and the process's CSRF token for the console's mutations.
//!
//! Invariants:
//! - a token's value lives only in [`Tokens`] (as a [`Secret`]); no error, log line or answer
//!   contains it, only the token's name;
//! - a presented token is compared with every configured one, each comparison taking the same
//!   time whatever the bytes (SHA-256 digests folded with XOR), so timing tells nothing of how
//!   much of a guess was right nor which token it came close to;
//! - the CSRF token is 32 random bytes made once per process: a page served by another process
//!   (a restarted relay) must be reloaded before it may act.

use ring::digest::{SHA256, digest};

use crate::config::{AdminConfig, AdminScope, MIN_ADMIN_TOKEN_BYTES};
use crate::error::{FatalReason, RelayError};
use crate::secret::Secret;

/// A caller the tokens know.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Caller {
    /// The token's name: the audit lines' "who".
    pub name: String,
    pub scope: AdminScope,
}

/// The configured tokens, read from their files, and the client certificates' holders.
#[derive(Debug)]
pub(crate) struct Tokens {
    known: Vec<(Caller, Secret)>,
    /// Each client by its certificate's subject common name (`admin.clients`).
    clients: Vec<(Caller, String)>,
}

/// The subject common name of the client certificate the connection presented, verified against
/// `admin.tls_client_ca_file` by the TLS handshake: a request extension.
#[derive(Debug, Clone)]
pub(crate) struct ClientCertificate(pub String);

impl Tokens {
    /// Reads every `admin.tokens[i].token_file`; an unreadable or short one is an error naming it.
    pub fn load(admin: &AdminConfig) -> Result<Tokens, RelayError> {
        let mut known = Vec::new();
        for (i, token) in admin.tokens.iter().enumerate() {
            let setting = format!("admin.tokens[{i}].token_file");
            let text = std::fs::read_to_string(&token.token_file).map_err(|e| {
                config_error(format!("{setting} {}: cannot read the token: {e}", token.token_file))
            })?;
            let value = text.trim_end();
            if value.len() < MIN_ADMIN_TOKEN_BYTES {
                return Err(config_error(format!(
                    "{setting} {}: the token has {} bytes, fewer than {MIN_ADMIN_TOKEN_BYTES}: write a longer \
                     one (openssl rand -hex 32)",
                    token.token_file,
                    value.len()
                )));
            }
            let caller = Caller { name: token.name.clone(), scope: token.scope };
            known.push((caller, Secret::new(value)));
        }
        let clients = admin
            .clients
            .iter()
            .map(|c| (Caller { name: c.name.clone(), scope: c.scope }, c.subject_cn.clone()))
            .collect();
        Ok(Tokens { known, clients })
    }

    /// The caller a verified client certificate's subject common name names, if any.
    pub fn certified(&self, subject_cn: &str) -> Option<Caller> {
        self.clients.iter().find(|(_, cn)| cn == subject_cn).map(|(caller, _)| caller.clone())
    }

    /// For tests: tokens as (name, scope, value).
    #[cfg(test)]
    pub fn of(tokens: &[(&str, AdminScope, &str)]) -> Tokens {
        let known = tokens
            .iter()
            .map(|(name, scope, value)| (Caller { name: (*name).into(), scope: *scope }, Secret::new(*value)))
            .collect();
        Tokens { known, clients: Vec::new() }
    }

    /// The caller an `Authorization` header's value names (`Bearer <token>`), if any.
    pub fn caller(&self, authorization: Option<&str>) -> Option<Caller> {
        let presented = authorization?.strip_prefix("Bearer ")?.trim();
        let mut found = None;
        // every token is compared, found or not, so the time spent says nothing of which matched
        for (caller, secret) in &self.known {
            if same(presented.as_bytes(), secret.expose().as_bytes()) && found.is_none() {
                found = Some(caller.clone());
            }
        }
        found
    }
}

fn config_error(message: String) -> RelayError {
    RelayError::fatal(FatalReason::Config, message)
}

/// Equal, in a time that depends on neither input's bytes (digests of fixed length compared with
/// every byte folded in).
pub(crate) fn same(a: &[u8], b: &[u8]) -> bool {
    let (a, b) = (digest(&SHA256, a), digest(&SHA256, b));
    let difference = a.as_ref().iter().zip(b.as_ref()).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    std::hint::black_box(difference) == 0
}

/// A new CSRF token: 32 random bytes, hex.
pub(crate) fn csrf_token() -> String {
    let bytes: [u8; 32] = rand::random();
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The subject common name (CN) of a DER certificate, when it has one as a UTF8String,
/// PrintableString or IA5String. Only what the TLS handshake already verified is read.
pub(crate) fn subject_common_name(der: &[u8]) -> Option<String> {
    let (_, certificate, _) = element(der)?;
    let (_, mut tbs, _) = element(certificate)?;
    // TBSCertificate: [0] version (optional), serial, signature, issuer, validity, subject, ...
    let mut skip = if tbs.first() == Some(&0xa0) { 5 } else { 4 };
    while skip > 0 {
        tbs = element(tbs)?.2;
        skip -= 1;
    }
    let (_, mut names, _) = element(tbs)?;
    // Name: SEQUENCE OF SET OF SEQUENCE { type OID, value }
    while let Some((_, mut set, rest)) = element(names) {
        names = rest;
        while let Some((_, attribute, rest)) = element(set) {
            set = rest;
            let (_, oid, value) = element(attribute)?;
            if oid == [0x55, 0x04, 0x03] {
                let (tag, text, _) = element(value)?;
                return matches!(tag, 0x0c | 0x13 | 0x16).then(|| String::from_utf8(text.to_vec()).ok())?;
            }
        }
    }
    None
}

/// The DER element at the start of `input`: (tag, contents, what follows).
fn element(input: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let (&tag, rest) = input.split_first()?;
    let (&first, rest) = rest.split_first()?;
    let (length, rest) = if first < 0x80 {
        (usize::from(first), rest)
    } else {
        let octets = usize::from(first & 0x7f);
        if octets == 0 || octets > 4 || rest.len() < octets {
            return None;
        }
        let length = rest[..octets].iter().fold(0usize, |n, b| (n << 8) | usize::from(*b));
        (length, &rest[octets..])
    };
    (rest.len() >= length).then(|| (tag, &rest[..length], &rest[length..]))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `openssl req -x509 -subj "/O=outbox-relay tests/CN=oncall-cert/OU=ops"` (P-256).
    const CERTIFICATE: &str = "-----BEGIN CERTIFICATE-----\n\
MIIB2TCCAX+gAwIBAgIUYAinYMV1LlbOmOImze6u85mfLaowCgYIKoZIzj0EAwIw\n\
QTEbMBkGA1UECgwSb3V0Ym94LXJlbGF5IHRlc3RzMRQwEgYDVQQDDAtvbmNhbGwt\n\
Y2VydDEMMAoGA1UECwwDb3BzMCAXDTI2MTIwNzE4Mzk0NFoYDzIxMjYxMTEzMTgz\n\
OTQ0WjBBMRswGQYDVQQKDBJvdXRib3gtcmVsYXkgdGVzdHMxFDASBgNVBAMMC29u\n\
Y2FsbC1jZXJ0MQwwCgYDVQQLDANvcHMwWTATBgcqhkjOPQIBBggqhkjOPQMBBwNC\n\
AAQXbrOTWy/jOEtF9toy4X1I6rI1EuaLM45iJShIWNq5LROSVsnw7VZnGlbXSc8y\n\
bqVP1b9MM1ATlTSm2HOuCVXHo1MwUTAdBgNVHQ4EFgQUSwliA1AR1r/Q2fHJ1rZW\n\
ymvciowwHwYDVR0jBBgwFoAUSwliA1AR1r/Q2fHJ1rZWymvciowwDwYDVR0TAQH/\n\
BAUwAwEB/zAKBggqhkjOPQQDAgNIADBFAiBh7mEOLlXgXu9mGR8GpY4C9Ry0SJso\n\
06pzv+8G/WAEiAIhAL4hX1FCLncgJg91vZiOrcMqC1rivDefBKBb4b06IHJq\n\
-----END CERTIFICATE-----";

    #[test]
    fn the_subject_common_name_is_read_from_among_the_other_attributes() {
        use rustls::pki_types::CertificateDer;
        use rustls::pki_types::pem::PemObject;
        let der = CertificateDer::from_pem_slice(CERTIFICATE.as_bytes()).unwrap();
        assert_eq!(subject_common_name(der.as_ref()).as_deref(), Some("oncall-cert"));
        for cut in [0, 1, 10, 100, der.len() - 1] {
            // a truncated certificate reads as nothing (the handshake never lets one through)
            let _ = subject_common_name(&der[..cut]);
        }
        assert_eq!(subject_common_name(&[0x30, 0x03, 0x02, 0x01, 0x01]), None);
    }

    #[test]
    fn only_a_configured_bearer_token_names_a_caller() {
        let tokens = Tokens::of(&[
            ("viewer", AdminScope::Read, "read-token-0123456789"),
            ("oncall", AdminScope::Operate, "operate-token-0123456789"),
        ]);
        let oncall = tokens.caller(Some("Bearer operate-token-0123456789")).unwrap();
        assert_eq!((oncall.name.as_str(), oncall.scope), ("oncall", AdminScope::Operate));
        assert_eq!(tokens.caller(Some("Bearer read-token-0123456789")).unwrap().scope, AdminScope::Read);
        for wrong in [
            None,
            Some(""),
            Some("Bearer "),
            Some("Bearer read-token-012345678"),
            Some("read-token-0123456789"),
        ] {
            assert_eq!(tokens.caller(wrong), None, "{wrong:?}");
        }
    }

    #[test]
    fn a_token_file_is_read_trimmed_and_a_short_one_refused_naming_the_setting() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("t");
        std::fs::write(&file, "0123456789abcdef0123\n").unwrap();
        let mut admin = AdminConfig::default();
        admin.tokens.push(crate::config::AdminToken {
            name: "oncall".into(),
            scope: AdminScope::Operate,
            token_file: file.display().to_string(),
        });
        let tokens = Tokens::load(&admin).unwrap();
        assert!(tokens.caller(Some("Bearer 0123456789abcdef0123")).is_some());
        assert!(!format!("{tokens:?}").contains("0123456789abcdef0123"), "the token is never shown");
        std::fs::write(&file, "short\n").unwrap();
        let said = Tokens::load(&admin).unwrap_err().to_string();
        assert!(said.contains("admin.tokens[0].token_file") && !said.contains("short\n"), "{said}");
        admin.tokens[0].token_file = dir.path().join("missing").display().to_string();
        assert!(Tokens::load(&admin).unwrap_err().to_string().contains("cannot read the token"));
    }

    #[test]
    fn csrf_tokens_differ_and_compare_equal_only_to_themselves() {
        let (a, b) = (csrf_token(), csrf_token());
        assert_eq!(a.len(), 64);
        assert_ne!(a, b);
        assert!(same(a.as_bytes(), a.as_bytes()));
        assert!(!same(a.as_bytes(), b.as_bytes()));
    }
}
