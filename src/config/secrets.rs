//! Secrets in the configuration: which librdkafka property values are shown (the
//! [`Secret`](crate::secret::Secret) type holds the others), and warnings about secret files
//! other users can read.
//!
//! Invariants:
//! - a `kafka.properties` value is shown only when its key is on a short list of settings known
//!   to hold no credential ([`is_secret_kafka_property`] is false for them alone): a key the
//!   list does not know, a misspelt one included, is redacted; new librdkafka secrets
//!   (`sasl.oauthbearer.assertion.private.key.passphrase`, ...) are hidden without a release;
//! - a secret file readable by its group or by everyone is a warning, not an error: a mounted
//!   Kubernetes Secret is often 0644 inside a pod no one else shares.

use std::path::Path;

/// Parts of a key that mark a credential whatever else the key says.
const SECRET_NEEDLES: &[&str] = &[
    "password",
    "passphrase",
    "secret",
    "private.key",
    "sasl.oauthbearer.config",
    "sasl.oauthbearer.extensions",
    "sasl.jaas",
    "ssl.key.pem",
    "ssl_key",
    "token",
];

/// librdkafka settings whose values are shown: they name a mechanism, a file, a host or a
/// tuning, never a credential.
const PLAIN_KAFKA_PROPERTIES: &[&str] = &[
    "security.protocol",
    "sasl.mechanism",
    "sasl.mechanisms",
    "sasl.username",
    "sasl.kerberos.service.name",
    "sasl.kerberos.principal",
    "sasl.kerberos.keytab",
    "sasl.oauthbearer.method",
    "sasl.oauthbearer.client.id",
    "sasl.oauthbearer.scope",
    "ssl.ca.location",
    "ssl.crl.location",
    "ssl.certificate.location",
    "ssl.key.location",
    "ssl.keystore.location",
    "ssl.endpoint.identification.algorithm",
    "enable.ssl.certificate.verification",
    "ssl.cipher.suites",
    "ssl.curves.list",
    "ssl.sigalgs.list",
    "client.rack",
    "broker.address.family",
    "api.version.request",
    "debug",
    "partitioner",
    "retries",
    "batch.num.messages",
    "batch.size",
    "queue.buffering.max.messages",
    "queue.buffering.max.kbytes",
    "socket.keepalive.enable",
    "socket.nagle.disable",
    "topic.metadata.refresh.sparse",
];

/// Suffixes of numeric librdkafka settings (`socket.timeout.ms`, `message.max.bytes`).
const PLAIN_SUFFIXES: &[&str] = &[".ms", ".bytes", ".kbytes", ".messages"];

/// True unless `key` is a librdkafka setting known to hold no credential: values are redacted
/// by default.
pub fn is_secret_kafka_property(key: &str) -> bool {
    let key = key.to_ascii_lowercase();
    if SECRET_NEEDLES.iter().any(|needle| key.contains(needle)) {
        return true;
    }
    let plain = PLAIN_KAFKA_PROPERTIES.contains(&key.as_str())
        || PLAIN_SUFFIXES.iter().any(|suffix| key.ends_with(suffix));
    !plain
}

/// A warning when the secret file `path` (of setting `setting`) can be read by users other than
/// its owner; `None` when it cannot, or cannot be inspected (reading it reports that).
pub fn file_mode_warning(setting: &str, path: &str) -> Option<String> {
    if path.is_empty() {
        return None;
    }
    mode_warning(setting, path, std::fs::metadata(Path::new(path)).ok()?)
}

#[cfg(unix)]
fn mode_warning(setting: &str, path: &str, metadata: std::fs::Metadata) -> Option<String> {
    use std::os::unix::fs::PermissionsExt;
    let mode = metadata.permissions().mode() & 0o777;
    let readers = match (mode & 0o004 != 0, mode & 0o040 != 0) {
        (true, _) => "every user",
        (false, true) => "its group",
        (false, false) => return None,
    };
    Some(format!(
        "{setting} {path} is readable by {readers} (mode {mode:04o}): chmod 600 it (or 400), \
         or set defaultMode: 0400 on the Kubernetes Secret volume"
    ))
}

#[cfg(not(unix))]
fn mode_warning(_setting: &str, _path: &str, _metadata: std::fs::Metadata) -> Option<String> {
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_are_redacted_and_unknown_keys_too() {
        for key in [
            "sasl.password",
            "ssl.key.password",
            "ssl.keystore.password",
            "sasl.oauthbearer.client.secret",
            "sasl.oauthbearer.assertion.private.key.passphrase",
            "sasl.oauthbearer.assertion.private.key.pem",
            "sasl.oauthbearer.extensions",
            "sasl.oauthbearer.config",
            "ssl.key.pem",
            "SSL.KEY.PASSWORD",
            // a misspelt key is not known to be harmless
            "sasl.pasword",
            "ssl.certificate.pem",
        ] {
            assert!(is_secret_kafka_property(key), "{key} is shown");
        }
        for key in ["security.protocol", "sasl.username", "ssl.ca.location", "socket.timeout.ms"] {
            assert!(!is_secret_kafka_property(key), "{key} is hidden");
        }
    }

    #[cfg(unix)]
    #[test]
    fn a_secret_file_others_can_read_is_named() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("pw");
        std::fs::write(&file, "x\n").unwrap();
        let path = file.display().to_string();
        let chmod = |mode| std::fs::set_permissions(&file, std::fs::Permissions::from_mode(mode)).unwrap();
        chmod(0o600);
        assert_eq!(file_mode_warning("postgres.password_file", &path), None);
        chmod(0o640);
        let warning = file_mode_warning("postgres.password_file", &path).unwrap();
        assert!(warning.starts_with("postgres.password_file") && warning.contains("its group"), "{warning}");
        chmod(0o644);
        assert!(file_mode_warning("x", &path).unwrap().contains("every user (mode 0644)"));
        assert_eq!(file_mode_warning("x", ""), None);
    }
}
