//! RDS/Aurora IAM database authentication (`postgres.auth = "aws_iam"`): the password is a token
//! made at each connect, as AWS's `generate-db-auth-token` makes it: `GET
//! https://<host>:<port>/?Action=connect&DBUser=<user>` presigned with SigV4 (service `rds-db`,
//! 900 s), the URL without its `https://`. PostgreSQL gets it as the password; the server must
//! be verified (`sslmode = verify-full`), since the token is a bearer credential while it lasts.
//!
//! The credentials come from [`super::aws`]'s chain, one per process, cached until shortly
//! before they expire. A connect that needs new credentials from a remote source (STS, the
//! container endpoint, IMDS) waits for them on a thread of its own: at most once an hour.
//!
//! Tested against the SigV4 test suite through [`super::msk_iam::presign`] and by decoding a
//! token back to its fields; no RDS endpoint is reachable where this was written.

use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime};

use super::FetchError;
use super::aws::{AwsCredentials, CredentialChain};
use super::msk_iam::presign;

/// How long a token is valid (AWS's own tool makes them for 900 s).
const TOKEN_LIFETIME: Duration = Duration::from_secs(900);

/// The token for `user` at `host:port` in `region`, signed with `credentials` at `now`.
pub fn token(
    host: &str,
    port: u16,
    user: &str,
    region: &str,
    credentials: &AwsCredentials,
    now: SystemTime,
) -> Result<String, FetchError> {
    let authority = format!("{host}:{port}");
    let user = form_urlencoded::byte_serialize(user.as_bytes()).collect::<String>();
    let url = format!("https://{authority}/?Action=connect&DBUser={user}");
    let params = presign(&url, &authority, credentials, region, "rds-db", now, TOKEN_LIFETIME)?;
    let mut token = url.trim_start_matches("https://").to_string();
    for (name, value) in params {
        token.push('&');
        token.push_str(&name);
        token.push('=');
        token.push_str(&value);
    }
    Ok(token)
}

/// The token for `user` at `host:port` in `region`, now, with the process's AWS credentials.
pub fn password(host: &str, port: u16, user: &str, region: &str) -> Result<String, FetchError> {
    static CHAIN: OnceLock<Arc<CredentialChain>> = OnceLock::new();
    let chain = CHAIN
        .get_or_init(|| Arc::new(CredentialChain::from_environment(region, Duration::from_secs(10))))
        .clone();
    // (a thread with a runtime of its own: the caller may be on any runtime, or on none)
    let credentials = std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a runtime");
        runtime.block_on(chain.credentials())
    })
    .join()
    .map_err(|_| FetchError::Unavailable("the AWS credential request panicked".into()))??;
    token(host, port, user, region, &credentials, SystemTime::now())
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::time::UNIX_EPOCH;

    use super::*;
    use crate::config::Secret;

    #[test]
    fn an_rds_token_is_a_presigned_connect_url_without_its_scheme() {
        let credentials = AwsCredentials {
            access_key_id: "AKIDEXAMPLE".into(),
            secret_access_key: Secret::new("wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY"),
            session_token: None,
            expires_at: None,
        };
        let at = UNIX_EPOCH + Duration::from_secs(1_440_938_160);
        let host = "db.cluster-abc.eu-west-1.rds.amazonaws.com";
        let token = token(host, 5432, "outbox_relay", "eu-west-1", &credentials, at).unwrap();
        let (authority, query) = token.split_once("/?").unwrap();
        assert_eq!(authority, format!("{host}:5432"));
        let fields: HashMap<String, String> = form_urlencoded::parse(query.as_bytes()).into_owned().collect();
        assert_eq!(fields["Action"], "connect");
        assert_eq!(fields["DBUser"], "outbox_relay");
        assert_eq!(fields["X-Amz-Credential"], "AKIDEXAMPLE/20150830/eu-west-1/rds-db/aws4_request");
        assert_eq!(fields["X-Amz-Expires"], "900");
        assert_eq!(fields["X-Amz-SignedHeaders"], "host");
        assert_eq!(fields["X-Amz-Signature"].len(), 64);
    }
}
