//! What `check` says about `[kafka.auth]`: the mechanism, whether a token could be had (and when
//! it expires, and whom it names), and the grant or role it needs. The token itself is never
//! shown.

use std::time::SystemTime;

use super::Finding;
use crate::config::RelayConfig;
use crate::credentials::{self, FetchError};

const CHECK: &str = "kafka.auth";

/// `None` without `[kafka.auth]`.
pub(super) async fn finding(config: &RelayConfig) -> Option<Finding> {
    let mechanism = config.kafka.auth.as_ref()?.mechanism;
    let needs = credentials::needs(mechanism);
    Some(match credentials::first_token(&config.kafka).await {
        Ok(Some(token)) => {
            let left = token.expires_at.duration_since(SystemTime::now()).unwrap_or_default().as_secs();
            Finding::ok(
                CHECK,
                format!(
                    "{}: a token was obtained for principal {}, expiring in {left} s; it needs {needs}",
                    mechanism.label(),
                    token.principal
                ),
            )
        }
        Ok(None) => return None,
        Err(e @ FetchError::Refused { .. }) => Finding::fail(
            CHECK,
            format!("{}: no token: {e}", mechanism.label()),
            format!("fix it; it needs {needs}"),
        ),
        Err(e) => Finding::fail(
            CHECK,
            format!("{}: no token: {e}", mechanism.label()),
            "check that the identity provider (or the token file, or the AWS credentials) is reachable",
        ),
    })
}
