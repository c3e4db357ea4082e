//! AWS MSK IAM: the OAUTHBEARER token Amazon MSK takes for IAM access control, as AWS's own
//! signers make it (aws-msk-iam-sasl-signer-*): a `GET https://kafka.<region>.amazonaws.com/
//! ?Action=kafka-cluster%3AConnect` presigned with SigV4 (service `kafka-cluster`, signature in
//! the query, 900 s), a `User-Agent` parameter added, the whole URL base64url-encoded without
//! padding. The token expires with its signature (`X-Amz-Date` + `X-Amz-Expires`), or with the
//! credentials that signed it when they expire first.
//!
//! Signing is the `aws-sigv4` crate's; the credentials come from [`super::aws`]'s chain. No AWS
//! endpoint is reachable where this was written: the signing is tested against AWS's published
//! SigV4 test vectors (query-signed `get-vanilla`, with and without a session token) and the
//! token decoded back to its fields, not against a cluster.

use std::time::{Duration, SystemTime};

use aws_credential_types::Credentials;
use aws_sigv4::http_request::{SignableBody, SignableRequest, SignatureLocation, SigningSettings, sign};
use aws_sigv4::sign::v4;
use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;

use super::aws::{AwsCredentials, CredentialChain};
use super::{FetchError, Token};
use crate::config::{KafkaAuthConfig, Secret};

/// How long a signed token is valid (AWS's signers use 900 s, SigV4's presign maximum for it).
const TOKEN_LIFETIME: Duration = Duration::from_secs(900);
/// The service name MSK's IAM authentication signs for.
const SERVICE: &str = "kafka-cluster";

pub(super) struct MskIam {
    region: String,
    chain: CredentialChain,
}

impl MskIam {
    pub(super) fn new(auth: &KafkaAuthConfig) -> Result<MskIam, FetchError> {
        let region = auth.aws_region().ok_or(FetchError::Refused {
            setting: "kafka.auth.region",
            why: "no region: set kafka.auth.region or AWS_REGION".into(),
        })?;
        let timeout = Duration::from_millis(auth.request_timeout_ms);
        Ok(MskIam { chain: CredentialChain::from_environment(&region, timeout), region })
    }

    pub(super) async fn fetch(&self) -> Result<Token, FetchError> {
        let credentials = self.chain.credentials().await?;
        let token = token(&self.region, &credentials, SystemTime::now())?;
        Ok(token)
    }
}

/// The MSK IAM token for `region`, signed with `credentials` at `now`.
pub fn token(region: &str, credentials: &AwsCredentials, now: SystemTime) -> Result<Token, FetchError> {
    let host = format!("kafka.{region}.amazonaws.com");
    let url = format!("https://{host}/?Action=kafka-cluster%3AConnect");
    let params = presign(&url, &host, credentials, region, SERVICE, now, TOKEN_LIFETIME)?;
    let mut signed = url;
    for (name, value) in params {
        signed.push('&');
        signed.push_str(&name);
        signed.push('=');
        signed.push_str(&value);
    }
    signed.push_str(concat!("&User-Agent=outbox-relay%2F", env!("CARGO_PKG_VERSION")));
    let signature_expiry = now + TOKEN_LIFETIME;
    let expires_at = credentials.expires_at.map_or(signature_expiry, |e| e.min(signature_expiry));
    Ok(Token {
        value: Secret::new(URL_SAFE_NO_PAD.encode(signed)),
        expires_at,
        principal: credentials.access_key_id.clone(),
    })
}

/// The SigV4 query parameters (already URL-encoded) that presign `GET url` for `service` in
/// `region` at `now`, valid for `expires_in`.
pub fn presign(
    url: &str,
    host: &str,
    credentials: &AwsCredentials,
    region: &str,
    service: &str,
    now: SystemTime,
    expires_in: Duration,
) -> Result<Vec<(String, String)>, FetchError> {
    let failed = |e: &dyn std::fmt::Display| FetchError::Unavailable(format!("SigV4 signing failed: {e}"));
    let identity = Credentials::new(
        credentials.access_key_id.clone(),
        credentials.secret_access_key.expose().to_string(),
        credentials.session_token.as_ref().map(|t| t.expose().to_string()),
        credentials.expires_at,
        "outbox-relay",
    )
    .into();
    let mut settings = SigningSettings::default();
    settings.signature_location = SignatureLocation::QueryParams;
    settings.expires_in = Some(expires_in);
    let params = v4::SigningParams::builder()
        .identity(&identity)
        .region(region)
        .name(service)
        .time(now)
        .settings(settings)
        .build()
        .map_err(|e| failed(&e))?
        .into();
    let request = SignableRequest::new("GET", url, std::iter::once(("host", host)), SignableBody::Bytes(&[]))
        .map_err(|e| failed(&e))?;
    let (instructions, _signature) = sign(request, &params).map_err(|e| failed(&e))?.into_parts();
    let encode =
        |v: &str| form_urlencoded::byte_serialize(v.as_bytes()).collect::<String>().replace('+', "%20");
    Ok(instructions.params().iter().map(|(name, value)| (name.to_string(), encode(value))).collect())
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::time::UNIX_EPOCH;

    use super::*;

    /// 2015-08-30T12:36:00Z, the test suite's timestamp.
    fn suite_time() -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(1_440_938_160)
    }

    fn suite_credentials(session_token: Option<&str>) -> AwsCredentials {
        AwsCredentials {
            access_key_id: "AKIDEXAMPLE".into(),
            secret_access_key: Secret::new("wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY"),
            session_token: session_token.map(Secret::new),
            expires_at: None,
        }
    }

    fn signature(params: &[(String, String)]) -> &str {
        &params.iter().find(|(n, _)| n == "X-Amz-Signature").unwrap().1
    }

    /// AWS's SigV4 test suite (aws-signing-test-suite/v4, as shipped with the aws-sigv4 crate):
    /// `get-vanilla` and `get-vanilla-with-session-token`, signed in the query for 3600 s; the
    /// expected signatures are the suite's query-signature.txt.
    #[test]
    fn presigning_matches_the_sigv4_test_suite() {
        let url = "https://example.amazonaws.com/";
        let host = "example.amazonaws.com";
        let hour = Duration::from_secs(3600);
        let params =
            presign(url, host, &suite_credentials(None), "us-east-1", "service", suite_time(), hour).unwrap();
        assert_eq!(signature(&params), "e93c787ed7f371d5c6b165c1b38ede9550f4dce4144713e844b25b7192d3865d");
        let by_name: HashMap<_, _> = params.iter().cloned().collect();
        assert_eq!(
            by_name["X-Amz-Credential"],
            "AKIDEXAMPLE%2F20150830%2Fus-east-1%2Fservice%2Faws4_request"
        );
        assert_eq!(by_name["X-Amz-Date"], "20150830T123600Z");
        assert_eq!(by_name["X-Amz-Expires"], "3600");
        assert_eq!(by_name["X-Amz-SignedHeaders"], "host");

        let token = "6e86291e8372ff2a2260956d9b8aae1d763fbf315fa00fa31553b73ebf194267";
        let params =
            presign(url, host, &suite_credentials(Some(token)), "us-east-1", "service", suite_time(), hour)
                .unwrap();
        assert_eq!(signature(&params), "7ff2b50b376cb4d151970630573d6291dc128cc5c2a12ffb237f73cc53f67b6c");
    }

    #[test]
    fn an_msk_token_decodes_to_a_presigned_connect_request() {
        let credentials = suite_credentials(Some("session/token+x"));
        let token = token("eu-west-1", &credentials, suite_time()).unwrap();
        assert_eq!(token.expires_at, suite_time() + Duration::from_secs(900));
        assert_eq!(token.principal, "AKIDEXAMPLE");
        let value = token.value.expose();
        assert!(
            !value.contains('=') && !value.contains('+') && !value.contains('/'),
            "base64url without padding"
        );
        let url = String::from_utf8(URL_SAFE_NO_PAD.decode(value).unwrap()).unwrap();
        let (base, query) = url.split_once('?').unwrap();
        assert_eq!(base, "https://kafka.eu-west-1.amazonaws.com/");
        let fields: HashMap<String, String> = form_urlencoded::parse(query.as_bytes()).into_owned().collect();
        assert_eq!(fields["Action"], "kafka-cluster:Connect");
        assert_eq!(fields["X-Amz-Algorithm"], "AWS4-HMAC-SHA256");
        assert_eq!(fields["X-Amz-Credential"], "AKIDEXAMPLE/20150830/eu-west-1/kafka-cluster/aws4_request");
        assert_eq!(fields["X-Amz-Date"], "20150830T123600Z");
        assert_eq!(fields["X-Amz-Expires"], "900");
        assert_eq!(fields["X-Amz-SignedHeaders"], "host");
        assert_eq!(fields["X-Amz-Security-Token"], "session/token+x");
        assert_eq!(fields["X-Amz-Signature"].len(), 64);
        assert!(fields["User-Agent"].starts_with("outbox-relay/"));
        // credentials that expire first cut the token's life short
        let short =
            AwsCredentials { expires_at: Some(suite_time() + Duration::from_secs(60)), ..credentials };
        assert_eq!(
            super::token("eu-west-1", &short, suite_time()).unwrap().expires_at,
            suite_time() + Duration::from_secs(60)
        );
    }
}
