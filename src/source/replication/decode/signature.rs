//! Signed `outbox_emit()` messages (`sql/012_outbox_emit_signed.sql`). Where EXECUTE on
//! `pg_logical_emit_message` cannot be revoked from PUBLIC, any login may write a transactional
//! message with the outbox prefix naming an event id of its choice; only `outbox_emit()` can
//! read the key in `outbox_emit_key`, so only its messages carry a digest the relay's key
//! (`replication.message_signing_key_file`) verifies.
//!
//! Invariants:
//! - a message's digest is HMAC-SHA256 under the key over [`DOMAIN`] and the event's seven
//!   fields (id, aggregate type, aggregate id, event type, payload, headers, topic), each a
//!   presence byte, its length (8 bytes, big-endian) and its bytes, exactly as `outbox_emit()`
//!   computes it: no two different events share an input, and a dead letter's digest
//!   (another domain) never verifies as a message's;
//! - a digest is checked in constant time (`ring::hmac::verify`); one that is missing or not
//!   hex does not verify.

use ring::hmac;

use crate::config::MIN_SIGNING_KEY_BYTES;
use crate::record::OutboxRow;

/// What the digest's input starts with (`outbox_emit()` writes the same bytes).
const DOMAIN: &[u8] = b"outbox-relay emitted event v1";

/// The setting that names the key file, for messages.
const SETTING: &str = "replication.message_signing_key_file";

/// The key `outbox_emit()` signs with.
#[derive(Clone)]
pub struct MessageKey(hmac::Key);

impl std::fmt::Debug for MessageKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("MessageKey(redacted)")
    }
}

impl MessageKey {
    /// The key in the file at `path`: its bytes less trailing whitespace (as the SQL table holds
    /// it), at least [`MIN_SIGNING_KEY_BYTES`] of them.
    pub fn read(path: &str) -> Result<MessageKey, String> {
        let bytes = std::fs::read(path).map_err(|e| format!("{SETTING}: cannot read {path}: {e}"))?;
        MessageKey::new(&bytes).map_err(|held| {
            format!("{SETTING}: {path} holds {held} bytes; a key needs at least {MIN_SIGNING_KEY_BYTES}")
        })
    }

    /// The key `bytes` (less trailing whitespace); too short: how many bytes it has.
    pub fn new(bytes: &[u8]) -> Result<MessageKey, usize> {
        let end = bytes.iter().rposition(|b| !b.is_ascii_whitespace()).map_or(0, |i| i + 1);
        if end < MIN_SIGNING_KEY_BYTES {
            return Err(end);
        }
        Ok(MessageKey(hmac::Key::new(hmac::HMAC_SHA256, &bytes[..end])))
    }

    /// Why the event `row` with `digest` is not one `outbox_emit()` signed with this key; `Ok`
    /// when it is.
    pub fn check(&self, row: &OutboxRow, digest: Option<&str>) -> Result<(), &'static str> {
        let digest = digest.ok_or("it carries no digest")?;
        let tag = crate::secret::from_hex(digest).ok_or("its digest is not hex")?;
        hmac::verify(&self.0, &message(row), &tag).map_err(|_| "its digest is not this key's")
    }

    /// The digest `outbox_emit()` writes for `row` (tests).
    #[cfg(test)]
    pub fn sign(&self, row: &OutboxRow) -> String {
        hmac::sign(&self.0, &message(row)).as_ref().iter().map(|b| format!("{b:02x}")).collect()
    }
}

/// The digest's input: the domain, then each field as a presence byte, its length and its bytes.
fn message(row: &OutboxRow) -> Vec<u8> {
    let fields = [
        &row.id,
        &row.aggregate_type,
        &row.aggregate_id,
        &row.event_type,
        &row.payload,
        &row.headers,
        &row.topic,
    ];
    crate::secret::framed(DOMAIN, fields.iter().map(|f| f.as_deref()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(id: &str) -> OutboxRow {
        OutboxRow {
            id: Some(id.into()),
            aggregate_type: Some("a".into()),
            aggregate_id: Some("b".into()),
            event_type: Some("c".into()),
            payload: Some("{\"x\": 1}".into()),
            headers: Some("{\"h\": \"v\"}".into()),
            topic: None,
            unreadable: None,
            columns: Vec::new(),
        }
    }

    #[test]
    fn a_digest_outbox_emit_wrote_verifies() {
        // as sql/012_outbox_emit_signed.sql's outbox_emit() signed this event under the key 'k' x 32 (PostgreSQL 15)
        let key = MessageKey::new(&[b'k'; 32]).unwrap();
        let digest = "b3661ecc6028854f05c8b03236574cd3c7d923c868232bc17027256c3834116d";
        assert_eq!(key.check(&row("bf303ab3-f8e6-45fa-94c7-498ca6030733"), Some(digest)), Ok(()));
        // a key over 64 bytes is hashed first, as HMAC says, on both sides
        let long = MessageKey::new(&b"ab".repeat(50)).unwrap();
        let event = OutboxRow {
            payload: Some("{}".into()),
            headers: None,
            topic: Some("tp".into()),
            ..row("d4a57ff7-3a48-4e18-9d5c-3970a13b950e")
        };
        let digest = "d7f11399f31d68bc8e03346f89272613186c88d8963ebff4fb7f2b0608c0a9cc";
        assert_eq!(long.check(&event, Some(digest)), Ok(()));
    }

    #[test]
    fn a_forged_or_altered_message_does_not_verify() {
        let key = MessageKey::new(&[7; 32]).unwrap();
        let digest = key.sign(&row("1"));
        assert_eq!(key.check(&row("1"), Some(&digest)), Ok(()));
        // another id, another field, a field moved to its neighbour, another key: no
        assert!(key.check(&row("2"), Some(&digest)).is_err());
        let altered = OutboxRow { payload: Some("{\"x\": 2}".into()), ..row("1") };
        assert!(key.check(&altered, Some(&digest)).is_err());
        let moved = OutboxRow { headers: None, topic: Some("{\"h\": \"v\"}".into()), ..row("1") };
        assert!(key.check(&moved, Some(&digest)).is_err());
        assert!(MessageKey::new(&[8; 32]).unwrap().check(&row("1"), Some(&digest)).is_err());
        // none, or not hex
        assert_eq!(key.check(&row("1"), None), Err("it carries no digest"));
        for bad in ["", "zz", "abc", &digest[..62]] {
            assert!(key.check(&row("1"), Some(bad)).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_short_key_is_refused_naming_its_length() {
        assert_eq!(MessageKey::new(&[b'k'; 31]).unwrap_err(), 31);
        assert!(MessageKey::new(b"0123456789abcdef0123456789abcdef\n").is_ok());
    }
}
