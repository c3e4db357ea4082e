//! AWS credentials from the standard chain a pod or an instance has, in the order AWS's SDKs
//! document ("Standardized credential providers", AWS SDKs and Tools Reference Guide):
//! 1. the environment: `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`;
//! 2. web identity (EKS IRSA): `AWS_WEB_IDENTITY_TOKEN_FILE` and `AWS_ROLE_ARN`
//!    (`AWS_ROLE_SESSION_NAME`), exchanged with STS `AssumeRoleWithWebIdentity` (an unsigned
//!    call; the regional endpoint, or `AWS_ENDPOINT_URL_STS` / `AWS_ENDPOINT_URL`);
//! 3. the container endpoint (ECS, EKS Pod Identity): `AWS_CONTAINER_CREDENTIALS_FULL_URI` or
//!    `AWS_CONTAINER_CREDENTIALS_RELATIVE_URI`, with `AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE` or
//!    `AWS_CONTAINER_AUTHORIZATION_TOKEN`;
//! 4. the instance metadata service, IMDSv2 (unless `AWS_EC2_METADATA_DISABLED=true`;
//!    `AWS_EC2_METADATA_SERVICE_ENDPOINT` overrides where).
//!
//! Shared config and credentials files (`~/.aws`) are not read: a pod has none.
//!
//! Invariants: the chain reads the environment it was made with (tests give their own); a
//! source whose variables are set and that fails is the error (the chain does not fall through
//! to the instance's role); credentials are cached until five minutes before they expire; the
//! secret key and session token are [`Secret`]s.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::Deserialize;

use super::FetchError;
use crate::config::Secret;

/// Credentials are renewed this long before they expire.
const RENEW_BEFORE: Duration = Duration::from_secs(300);
const IMDS: &str = "http://169.254.169.254";
const ECS_HOST: &str = "http://169.254.170.2";

/// One set of AWS credentials.
#[derive(Debug, Clone)]
pub struct AwsCredentials {
    pub access_key_id: String,
    pub secret_access_key: Secret,
    pub session_token: Option<Secret>,
    pub expires_at: Option<SystemTime>,
}

/// The chain, with the environment it reads and the credentials it holds.
pub struct CredentialChain {
    env: HashMap<String, String>,
    region: String,
    http: reqwest::Client,
    cached: Mutex<Option<AwsCredentials>>,
}

impl CredentialChain {
    /// The chain over the process's environment.
    pub fn from_environment(region: &str, timeout: Duration) -> CredentialChain {
        Self::new(std::env::vars().collect(), region, timeout)
    }

    pub fn new(env: HashMap<String, String>, region: &str, timeout: Duration) -> CredentialChain {
        let http = reqwest::Client::builder()
            .timeout(timeout)
            .connect_timeout(timeout)
            .tls_backend_preconfigured(super::oidc::tls("").expect("the Mozilla roots"))
            .build()
            .expect("an HTTP client");
        CredentialChain { env, region: region.to_string(), http, cached: Mutex::new(None) }
    }

    fn var(&self, name: &str) -> Option<&str> {
        self.env.get(name).map(String::as_str).filter(|v| !v.is_empty())
    }

    /// Credentials: the cached ones while they are not about to expire, else the first source
    /// of the chain that is configured.
    pub async fn credentials(&self) -> Result<AwsCredentials, FetchError> {
        if let Some(c) = self.cached.lock().unwrap().clone()
            && c.expires_at.is_none_or(|e| e > SystemTime::now() + RENEW_BEFORE)
        {
            return Ok(c);
        }
        let fresh = self.resolve().await?;
        *self.cached.lock().unwrap() = Some(fresh.clone());
        Ok(fresh)
    }

    async fn resolve(&self) -> Result<AwsCredentials, FetchError> {
        if let (Some(id), Some(secret)) = (self.var("AWS_ACCESS_KEY_ID"), self.var("AWS_SECRET_ACCESS_KEY")) {
            return Ok(AwsCredentials {
                access_key_id: id.to_string(),
                secret_access_key: Secret::new(secret),
                session_token: self.var("AWS_SESSION_TOKEN").map(Secret::new),
                expires_at: None,
            });
        }
        if let (Some(file), Some(role)) = (self.var("AWS_WEB_IDENTITY_TOKEN_FILE"), self.var("AWS_ROLE_ARN"))
        {
            return self.web_identity(file, role).await;
        }
        if self.var("AWS_CONTAINER_CREDENTIALS_FULL_URI").is_some()
            || self.var("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI").is_some()
        {
            return self.container().await;
        }
        if self.var("AWS_EC2_METADATA_DISABLED").is_some_and(|v| v.eq_ignore_ascii_case("true")) {
            return Err(FetchError::Unavailable(
                "no AWS credentials: none in the environment, no web identity, no container endpoint, and the \
                 instance metadata service is disabled"
                    .into(),
            ));
        }
        self.instance().await
    }

    /// STS AssumeRoleWithWebIdentity with the token in `file` (read at each call: the kubelet
    /// rotates it).
    async fn web_identity(&self, file: &str, role: &str) -> Result<AwsCredentials, FetchError> {
        let token = std::fs::read_to_string(file)
            .map_err(|e| FetchError::Unavailable(format!("AWS_WEB_IDENTITY_TOKEN_FILE {file}: {e}")))?;
        let endpoint = self
            .var("AWS_ENDPOINT_URL_STS")
            .or_else(|| self.var("AWS_ENDPOINT_URL"))
            .map(str::to_string)
            .unwrap_or_else(|| format!("https://sts.{}.amazonaws.com", self.region));
        let session = self.var("AWS_ROLE_SESSION_NAME").unwrap_or("outbox-relay");
        let body = form_urlencoded::Serializer::new(String::new())
            .append_pair("Action", "AssumeRoleWithWebIdentity")
            .append_pair("Version", "2011-06-15")
            .append_pair("RoleArn", role)
            .append_pair("RoleSessionName", session)
            .append_pair("WebIdentityToken", token.trim())
            .finish();
        let answer = self
            .http
            .post(format!("{}/", endpoint.trim_end_matches('/')))
            .header(reqwest::header::CONTENT_TYPE, "application/x-www-form-urlencoded")
            .body(body)
            .send()
            .await
            .map_err(|e| FetchError::Unavailable(format!("STS {endpoint}: {e}")))?;
        let status = answer.status();
        let text =
            answer.text().await.map_err(|e| FetchError::Unavailable(format!("STS {endpoint}: {e}")))?;
        if !status.is_success() {
            let code = xml_value(&text, "Code").unwrap_or("no error code");
            let why = format!("STS AssumeRoleWithWebIdentity for {role}: HTTP {status}: {code}");
            return Err(match code {
                "AccessDenied" | "InvalidIdentityToken" => {
                    FetchError::Refused { setting: "AWS_ROLE_ARN", why }
                }
                _ => FetchError::Unavailable(why),
            });
        }
        let field = |name: &str| {
            xml_value(&text, name)
                .ok_or_else(|| FetchError::Unavailable(format!("STS {endpoint}: the answer has no {name}")))
        };
        Ok(AwsCredentials {
            access_key_id: field("AccessKeyId")?.to_string(),
            secret_access_key: Secret::new(field("SecretAccessKey")?),
            session_token: Some(Secret::new(field("SessionToken")?)),
            expires_at: parse_time(field("Expiration")?),
        })
    }

    /// The container credentials endpoint (ECS task role, EKS Pod Identity).
    async fn container(&self) -> Result<AwsCredentials, FetchError> {
        let url = match self.var("AWS_CONTAINER_CREDENTIALS_FULL_URI") {
            Some(full) => full.to_string(),
            None => format!(
                "{ECS_HOST}{}",
                self.var("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI").unwrap_or_default()
            ),
        };
        let mut request = self.http.get(&url);
        let authorization = match self.var("AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE") {
            Some(file) => Some(std::fs::read_to_string(file).map_err(|e| {
                FetchError::Unavailable(format!("AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE {file}: {e}"))
            })?),
            None => self.var("AWS_CONTAINER_AUTHORIZATION_TOKEN").map(str::to_string),
        };
        if let Some(token) = authorization {
            request = request.header(reqwest::header::AUTHORIZATION, token.trim());
        }
        let answer = request.send().await.map_err(|e| FetchError::Unavailable(format!("{url}: {e}")))?;
        self.json_credentials(&url, answer).await
    }

    /// IMDSv2: a session token, the role's name, its credentials.
    async fn instance(&self) -> Result<AwsCredentials, FetchError> {
        let base =
            self.var("AWS_EC2_METADATA_SERVICE_ENDPOINT").unwrap_or(IMDS).trim_end_matches('/').to_string();
        let unavailable =
            |e: &dyn std::fmt::Display| FetchError::Unavailable(format!("instance metadata {base}: {e}"));
        let session = self
            .http
            .put(format!("{base}/latest/api/token"))
            .header("X-aws-ec2-metadata-token-ttl-seconds", "21600")
            .send()
            .await
            .map_err(|e| unavailable(&e))?
            .text()
            .await
            .map_err(|e| unavailable(&e))?;
        let path = format!("{base}/latest/meta-data/iam/security-credentials/");
        let get = |url: String| self.http.get(url).header("X-aws-ec2-metadata-token", session.trim()).send();
        let role = get(path.clone())
            .await
            .map_err(|e| unavailable(&e))?
            .text()
            .await
            .map_err(|e| unavailable(&e))?;
        let role = role.lines().next().unwrap_or_default().trim().to_string();
        let url = format!("{path}{role}");
        let answer = get(url.clone()).await.map_err(|e| unavailable(&e))?;
        self.json_credentials(&url, answer).await
    }

    /// The JSON credentials the container endpoint and IMDS answer.
    async fn json_credentials(
        &self,
        url: &str,
        answer: reqwest::Response,
    ) -> Result<AwsCredentials, FetchError> {
        #[derive(Deserialize)]
        #[serde(rename_all = "PascalCase")]
        struct Answer {
            access_key_id: String,
            secret_access_key: String,
            token: Option<String>,
            expiration: Option<String>,
        }
        let status = answer.status();
        if !status.is_success() {
            return Err(FetchError::Unavailable(format!("{url}: HTTP {status}")));
        }
        let body = answer.bytes().await.map_err(|e| FetchError::Unavailable(format!("{url}: {e}")))?;
        let a: Answer = serde_json::from_slice(&body)
            .map_err(|e| FetchError::Unavailable(format!("{url}: not credentials: {e}")))?;
        Ok(AwsCredentials {
            access_key_id: a.access_key_id,
            secret_access_key: Secret::new(a.secret_access_key),
            session_token: a.token.map(Secret::new),
            expires_at: a.expiration.as_deref().and_then(parse_time),
        })
    }
}

/// The text of the first `<name>` element of `xml` (STS answers are flat enough for this).
fn xml_value<'a>(xml: &'a str, name: &str) -> Option<&'a str> {
    let start = xml.find(&format!("<{name}>"))? + name.len() + 2;
    let end = start + xml[start..].find(&format!("</{name}>"))?;
    Some(xml[start..end].trim())
}

/// `YYYY-MM-DDTHH:MM:SS[.fff]Z` as a time.
fn parse_time(text: &str) -> Option<SystemTime> {
    let text = text.trim().trim_end_matches('Z');
    let (date, time) = text.split_once('T')?;
    let mut d = date.split('-').map(|p| p.parse::<i64>());
    let (y, m, day) = (d.next()?.ok()?, d.next()?.ok()?, d.next()?.ok()?);
    let mut t = time.split(':');
    let (h, min) = (t.next()?.parse::<i64>().ok()?, t.next()?.parse::<i64>().ok()?);
    let s = t.next()?.split('.').next()?.parse::<i64>().ok()?;
    // days from the civil date (Howard Hinnant's algorithm)
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    let secs = days * 86_400 + h * 3600 + min * 60 + s;
    Some(UNIX_EPOCH + Duration::from_secs(u64::try_from(secs).ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    fn env(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        // never the instance metadata service from a test
        let mut env: HashMap<String, String> = [("AWS_EC2_METADATA_DISABLED", "true")]
            .iter()
            .chain(pairs)
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        env.retain(|_, v| !v.is_empty());
        env
    }

    /// A one-request HTTP server on loopback answering `status` and `body`; returns its URL and
    /// the request it got.
    async fn answer_once(status: u16, body: &'static str) -> (String, tokio::task::JoinHandle<String>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let served = tokio::spawn(async move {
            let (mut socket, _) = listener.accept().await.unwrap();
            let mut request = Vec::new();
            let mut buf = [0u8; 4096];
            loop {
                let n = socket.read(&mut buf).await.unwrap();
                request.extend_from_slice(&buf[..n]);
                let text = String::from_utf8_lossy(&request);
                if let Some((head, body)) = text.split_once("\r\n\r\n") {
                    let length = head
                        .lines()
                        .find_map(|l| {
                            l.to_ascii_lowercase()
                                .strip_prefix("content-length:")
                                .map(|v| v.trim().parse().unwrap())
                        })
                        .unwrap_or(0usize);
                    if body.len() >= length {
                        break;
                    }
                }
            }
            let response = format!(
                "HTTP/1.1 {status} X\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
            socket.write_all(response.as_bytes()).await.unwrap();
            String::from_utf8_lossy(&request).into_owned()
        });
        (url, served)
    }

    #[tokio::test]
    async fn the_environment_comes_first() {
        let chain = CredentialChain::new(
            env(&[
                ("AWS_ACCESS_KEY_ID", "AKIDENV"),
                ("AWS_SECRET_ACCESS_KEY", "s"),
                ("AWS_SESSION_TOKEN", "t"),
                ("AWS_WEB_IDENTITY_TOKEN_FILE", "/nonexistent"),
                ("AWS_ROLE_ARN", "arn:aws:iam::1:role/r"),
            ]),
            "eu-west-1",
            Duration::from_secs(5),
        );
        let c = chain.credentials().await.unwrap();
        assert_eq!(c.access_key_id, "AKIDENV");
        assert_eq!(c.session_token.unwrap().expose(), "t");
        assert_eq!(c.expires_at, None);
    }

    #[tokio::test]
    async fn a_web_identity_token_file_is_exchanged_with_sts() {
        // given a projected service-account token and an STS that answers AssumeRoleWithWebIdentity
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("token");
        std::fs::write(&file, "eyJ.web.identity\n").unwrap();
        let (sts, request) = answer_once(
            200,
            "<AssumeRoleWithWebIdentityResponse><AssumeRoleWithWebIdentityResult><Credentials>\
             <AccessKeyId>ASIAWEB</AccessKeyId><SecretAccessKey>secret</SecretAccessKey>\
             <SessionToken>session</SessionToken><Expiration>2026-12-04T20:15:30Z</Expiration>\
             </Credentials></AssumeRoleWithWebIdentityResult></AssumeRoleWithWebIdentityResponse>",
        )
        .await;
        let chain = CredentialChain::new(
            env(&[
                ("AWS_WEB_IDENTITY_TOKEN_FILE", file.to_str().unwrap()),
                ("AWS_ROLE_ARN", "arn:aws:iam::123456789012:role/outbox-relay"),
                ("AWS_ENDPOINT_URL_STS", &sts),
            ]),
            "eu-west-1",
            Duration::from_secs(5),
        );

        // when credentials are asked for, then STS's are used, with their expiry
        let c = chain.credentials().await.unwrap();
        assert_eq!(c.access_key_id, "ASIAWEB");
        assert_eq!(c.secret_access_key.expose(), "secret");
        assert_eq!(c.session_token.unwrap().expose(), "session");
        assert_eq!(c.expires_at, Some(UNIX_EPOCH + Duration::from_secs(1_796_415_330)));
        let request = request.await.unwrap();
        assert!(request.starts_with("POST / "), "{request}");
        let body = request.split_once("\r\n\r\n").unwrap().1;
        let fields: HashMap<String, String> = form_urlencoded::parse(body.as_bytes()).into_owned().collect();
        assert_eq!(fields["Action"], "AssumeRoleWithWebIdentity");
        assert_eq!(fields["RoleArn"], "arn:aws:iam::123456789012:role/outbox-relay");
        assert_eq!(fields["WebIdentityToken"], "eyJ.web.identity");
    }

    #[tokio::test]
    async fn sts_refusing_the_web_identity_names_the_role_setting() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("token");
        std::fs::write(&file, "eyJ").unwrap();
        let (sts, _) =
            answer_once(403, "<ErrorResponse><Error><Code>AccessDenied</Code></Error></ErrorResponse>").await;
        let chain = CredentialChain::new(
            env(&[
                ("AWS_WEB_IDENTITY_TOKEN_FILE", file.to_str().unwrap()),
                ("AWS_ROLE_ARN", "arn:r"),
                ("AWS_ENDPOINT_URL_STS", &sts),
            ]),
            "eu-west-1",
            Duration::from_secs(5),
        );
        let err = chain.credentials().await.unwrap_err();
        assert!(matches!(err, FetchError::Refused { setting: "AWS_ROLE_ARN", .. }), "{err}");
    }

    #[tokio::test]
    async fn the_container_endpoint_is_asked_with_its_authorization_token() {
        let (endpoint, request) = answer_once(
            200,
            r#"{"AccessKeyId":"ASIAPOD","SecretAccessKey":"s","Token":"t","Expiration":"2026-12-04T20:15:30Z"}"#,
        )
        .await;
        let dir = tempfile::tempdir().unwrap();
        let token_file = dir.path().join("eks-pod-identity-token");
        std::fs::write(&token_file, "pod-identity-token\n").unwrap();
        let chain = CredentialChain::new(
            env(&[
                ("AWS_CONTAINER_CREDENTIALS_FULL_URI", &format!("{endpoint}/v1/credentials")),
                ("AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE", token_file.to_str().unwrap()),
            ]),
            "eu-west-1",
            Duration::from_secs(5),
        );
        let c = chain.credentials().await.unwrap();
        assert_eq!(c.access_key_id, "ASIAPOD");
        let request = request.await.unwrap().to_ascii_lowercase();
        assert!(request.starts_with("get /v1/credentials"), "{request}");
        assert!(request.contains("authorization: pod-identity-token"), "{request}");
    }

    #[tokio::test]
    async fn with_nothing_configured_and_imds_disabled_the_chain_says_so() {
        let chain = CredentialChain::new(env(&[]), "eu-west-1", Duration::from_secs(5));
        let err = chain.credentials().await.unwrap_err().to_string();
        assert!(err.contains("no AWS credentials"), "{err}");
    }

    #[test]
    fn times_parse() {
        assert_eq!(parse_time("1970-01-01T00:00:00Z"), Some(UNIX_EPOCH));
        assert_eq!(parse_time("2015-08-30T12:36:00Z"), Some(UNIX_EPOCH + Duration::from_secs(1_440_938_160)));
        assert_eq!(
            parse_time("2015-08-30T12:36:00.123Z"),
            Some(UNIX_EPOCH + Duration::from_secs(1_440_938_160))
        );
        assert_eq!(parse_time("garbage"), None);
    }
}
