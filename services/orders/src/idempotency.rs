//! The Idempotency-Key store: who owns a request, and what every retry of it gets back.
//!
//! Invariants (the table is `idempotency_keys`, sql/examples/idempotency.sql):
//! - A key belongs to its caller (the token's subject): the PRIMARY KEY is (caller, key), so the
//!   same key from two callers names two requests, and no caller can read or block another's.
//! - That PRIMARY KEY decides between concurrent requests and replicas: the request whose
//!   INSERT succeeds owns the key; an INSERT of the same key waits for it to commit, then sees
//!   the row. No in-memory lock, no lock with a TTL, decides anything.
//! - An owner holds a lease: `lease_token`, valid until `lease_expires_at`. After that (or at
//!   once if it recorded `failed`), another attempt takes the key over with a compare-and-set
//!   that bumps the token.
//! - The owner's final write (the order, its event and the stored response, one transaction)
//!   first locks the key's row and checks its token (fencing). An owner whose lease was taken
//!   over writes nothing; the takeover's UPDATE, in turn, waits on that row lock, so the two can
//!   never both complete.
//! - The same key with a different request (fingerprint) is refused; the same key with the same
//!   request gets the stored status and body, byte for byte.

use std::time::Duration;

use sha2::{Digest, Sha256};
use tokio::time::Instant;
use tokio_postgres::Client;
use tokio_postgres::error::SqlState;

use crate::config::IdempotencyConfig;

/// What a request may do with its key.
#[derive(Debug)]
pub enum Begin {
    /// It owns the key: do the work, then [`complete`] with this lease.
    Owned(Lease),
    /// The key completed earlier: answer this.
    Replay { status: u16, body: serde_json::Value },
    /// The key belongs to a different request.
    Mismatch,
    /// Another attempt holds the key; ask again after this long.
    Busy { retry_after: Duration },
}

/// Ownership of one key, proven by its token at the final write.
#[derive(Debug, Clone)]
pub struct Lease {
    pub caller: String,
    pub key: String,
    pub token: i64,
    pub took_over: bool,
}

/// The `Retry-After` of a 409 from a fenced attempt: the attempt that took over is most likely
/// about to finish.
pub const FENCED_RETRY_AFTER: Duration = Duration::from_secs(1);

/// SHA-256 of what makes two requests the same request.
pub fn fingerprint(method: &str, path: &str, canonical_body: &str) -> Vec<u8> {
    let mut hash = Sha256::new();
    for part in [method, path, canonical_body] {
        hash.update(part.as_bytes());
        hash.update([0]);
    }
    hash.finalize().to_vec()
}

const CLAIM: &str = "INSERT INTO idempotency_keys \
     (caller, key, fingerprint, state, lease_token, lease_expires_at, expires_at) \
     VALUES ($5, $1, $2, 'in_progress', nextval('idempotency_lease_tokens'), \
             now() + make_interval(secs => $3), now() + make_interval(secs => $4)) \
     ON CONFLICT (caller, key) DO NOTHING RETURNING lease_token";

const READ: &str = "SELECT fingerprint, state, lease_token, lease_expires_at < now(), \
     expires_at < now(), response_status, response_body, \
     extract(epoch FROM lease_expires_at - now())::float8 \
     FROM idempotency_keys WHERE caller = $2 AND key = $1";

/// A new token from the sequence, never one a stalled worker could still hold; the key is kept
/// at least a TTL from the takeover.
const TAKE_OVER: &str = "UPDATE idempotency_keys \
     SET state = 'in_progress', lease_token = nextval('idempotency_lease_tokens'), \
         lease_expires_at = now() + make_interval(secs => $3), \
         expires_at = greatest(expires_at, now() + make_interval(secs => $4)) \
     WHERE caller = $5 AND key = $1 AND lease_token = $2 \
       AND (state = 'failed' OR (state = 'in_progress' AND lease_expires_at < now())) \
     RETURNING lease_token";

const FORGET_EXPIRED: &str = "DELETE FROM idempotency_keys \
     WHERE caller = $3 AND key = $1 AND lease_token = $2 AND expires_at < now() \
       AND (state <> 'in_progress' OR lease_expires_at < now())";

/// The longest `Retry-After` of a 409: the holder's remaining lease, at most this.
const BUSY_RETRY_AFTER_MAX: Duration = Duration::from_secs(5);

/// The key's row as [`READ`] returns it.
struct Held {
    fingerprint: Vec<u8>,
    state: String,
    token: i64,
    lapsed: bool,
    expired: bool,
    response: Option<(i16, serde_json::Value)>,
    lease_left: Duration,
}

impl Held {
    fn from_row(row: &tokio_postgres::Row) -> Held {
        let status: Option<i16> = row.get(5);
        Held {
            fingerprint: row.get(0),
            state: row.get(1),
            token: row.get(2),
            lapsed: row.get(3),
            expired: row.get(4),
            response: status.map(|s| (s, row.get(6))),
            lease_left: Duration::from_secs_f64(row.get::<_, f64>(7).max(0.0)),
        }
    }
}

/// Claims `caller`'s `key` for a request with `fingerprint`, or says what to answer instead.
/// Waits up to `idempotency.wait_ms` while another attempt holds the key.
pub async fn begin(
    client: &Client,
    config: &IdempotencyConfig,
    caller: &str,
    key: &str,
    fingerprint: &[u8],
) -> Result<Begin, tokio_postgres::Error> {
    let lease_secs = config.lease().as_secs_f64();
    let ttl_secs = config.key_ttl_secs as f64;
    let deadline = Instant::now() + config.wait();
    loop {
        if let Some(row) =
            client.query_opt(CLAIM, &[&key, &fingerprint, &lease_secs, &ttl_secs, &caller]).await?
        {
            return Ok(Begin::Owned(Lease {
                caller: caller.into(),
                key: key.into(),
                token: row.get(0),
                took_over: false,
            }));
        }
        let Some(held) = client.query_opt(READ, &[&key, &caller]).await?.map(|row| Held::from_row(&row))
        else {
            continue; // deleted by the cleanup in between: claim again
        };
        // an expired key is forgotten first: after its TTL a key names a new request, whatever
        // the body
        if held.expired && (held.state != "in_progress" || held.lapsed) {
            client.execute(FORGET_EXPIRED, &[&key, &held.token, &caller]).await?;
            continue;
        }
        if held.fingerprint != fingerprint {
            return Ok(Begin::Mismatch);
        }
        match (held.state.as_str(), held.response) {
            ("completed", Some((status, body))) => return Ok(Begin::Replay { status: status as u16, body }),
            ("failed", _) => {}
            _ if held.lapsed => {}
            _ if Instant::now() >= deadline => {
                let retry_after = held.lease_left.clamp(Duration::from_secs(1), BUSY_RETRY_AFTER_MAX);
                return Ok(Begin::Busy { retry_after });
            }
            _ => {
                tokio::time::sleep(Duration::from_millis(25)).await;
                continue;
            }
        }
        let take_over = [
            &key as &(dyn tokio_postgres::types::ToSql + Sync),
            &held.token,
            &lease_secs,
            &ttl_secs,
            &caller,
        ];
        if let Some(row) = client.query_opt(TAKE_OVER, &take_over).await? {
            return Ok(Begin::Owned(Lease {
                caller: caller.into(),
                key: key.into(),
                token: row.get(0),
                took_over: true,
            }));
        }
    }
}

/// Locks the key's row inside `txn` and checks that `lease` still owns it: the fencing check
/// that must precede the final write. False: another attempt took the key over.
pub async fn fence(
    txn: &tokio_postgres::Transaction<'_>,
    lease: &Lease,
) -> Result<bool, tokio_postgres::Error> {
    let row = txn
        .query_opt(
            "SELECT 1 FROM idempotency_keys \
             WHERE caller = $3 AND key = $1 AND lease_token = $2 AND state = 'in_progress' FOR UPDATE",
            &[&lease.key, &lease.token, &lease.caller],
        )
        .await?;
    Ok(row.is_some())
}

/// Stores the response inside `txn` (after [`fence`]): every later retry gets it.
pub async fn store_response(
    txn: &tokio_postgres::Transaction<'_>,
    lease: &Lease,
    status: u16,
    body: &serde_json::Value,
) -> Result<(), tokio_postgres::Error> {
    txn.execute(
        "UPDATE idempotency_keys SET state = 'completed', response_status = $3, response_body = $4 \
         WHERE caller = $5 AND key = $1 AND lease_token = $2",
        &[&lease.key, &lease.token, &(status as i16), body, &lease.caller],
    )
    .await?;
    Ok(())
}

/// Marks the key failed after a transient error, so the next retry takes it over at once instead
/// of waiting for the lease. Best effort: if this fails too, the lease runs out instead.
pub async fn release(client: &Client, lease: &Lease) {
    let result = client
        .execute(
            "UPDATE idempotency_keys SET state = 'failed' \
             WHERE caller = $3 AND key = $1 AND lease_token = $2 AND state = 'in_progress'",
            &[&lease.key, &lease.token, &lease.caller],
        )
        .await;
    if let Err(e) = result {
        tracing::warn!(key = %lease.key, error = %e, "could not release the key; a retry waits for its lease");
    }
}

/// Deletes expired keys; returns how many.
pub async fn cleanup(client: &Client) -> Result<i64, tokio_postgres::Error> {
    Ok(client.query_one("SELECT idempotency_keys_cleanup()", &[]).await?.get(0))
}

/// True when `e` is worth a retry by the client (the server or the network, not the request).
pub fn is_transient(e: &tokio_postgres::Error) -> bool {
    match e.code() {
        None => true,
        Some(code) => {
            code == &SqlState::T_R_SERIALIZATION_FAILURE
                || code == &SqlState::T_R_DEADLOCK_DETECTED
                || code == &SqlState::LOCK_NOT_AVAILABLE
                || code == &SqlState::ADMIN_SHUTDOWN
                || code == &SqlState::CANNOT_CONNECT_NOW
                || code == &SqlState::READ_ONLY_SQL_TRANSACTION
                || code.code().starts_with("08")
                || code.code().starts_with("53")
        }
    }
}
