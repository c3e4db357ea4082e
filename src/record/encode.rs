//! A record value encoded against the outbox's schema registry (`[outbox.registry]`).
//!
//! The first record of a subject waits for the registry: a blocking section of this worker
//! thread (the mapping is synchronous), bounded by `registry.timeout_ms`; later records use the
//! cached schema. A payload the subject's schema refuses is unpublishable; when the subject
//! follows its latest version, the latest version is asked for again first (one registered since
//! may take it). A subject the registry does not hold, named by the row's topic, makes that row
//! unpublishable too (a writer's `aggregate_type` must not stop every other row: issue 46's N2).
//! The registry unreachable ends the session (retried); refusing stops the relay.

use std::sync::Arc;

use super::PoisonReason;
use super::registry::{EncodeError, Registry};
use crate::error::{FatalReason, RelayError};

/// `payload` encoded for `topic` (`None` without a registry); unpublishable, or the registry's
/// error for the session.
pub(super) fn encode(
    registry: Option<&Result<Arc<Registry>, String>>,
    topic: &str,
    payload: &str,
) -> Result<Result<Option<Vec<u8>>, PoisonReason>, RelayError> {
    let registry = match registry {
        None => return Ok(Ok(None)),
        Some(Ok(registry)) => registry,
        Some(Err(e)) => return Err(RelayError::fatal(FatalReason::SchemaRegistry, format!("registry: {e}"))),
    };
    let asked = || match tokio::runtime::Handle::try_current() {
        Ok(runtime) => tokio::task::block_in_place(|| runtime.block_on(registry.encode(topic, payload))),
        Err(_) => Err(EncodeError::Unavailable("no async runtime to ask the registry from".into())),
    };
    let mut encoded = registry.encode_cached(topic, payload).unwrap_or_else(asked);
    if matches!(encoded, Err(EncodeError::Mismatch { .. })) && registry.follows_latest() {
        // (a newer version may have been registered since the subject was cached: the payload
        // is refused only by the subject's latest version as it is now)
        registry.forget(topic);
        encoded = asked();
    }
    match encoded {
        Ok(value) => Ok(Ok(Some(value))),
        Err(e @ EncodeError::Mismatch { .. }) => {
            Ok(Err(PoisonReason::SchemaMismatch { detail: e.to_string() }))
        }
        Err(e @ EncodeError::NoSchema { .. }) => Ok(Err(PoisonReason::NoSchema { detail: e.to_string() })),
        Err(e @ EncodeError::Unavailable(_)) => Err(RelayError::Registry(e.to_string())),
        Err(e @ EncodeError::Refused { .. }) => {
            Err(RelayError::fatal(FatalReason::SchemaRegistry, e.to_string()))
        }
    }
}
