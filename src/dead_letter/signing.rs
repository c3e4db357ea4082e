//! Signed dead letters. `replay-dead-letters` publishes a letter under its event's id, deletes
//! that event's row and records the id as published: it must know the relay wrote the letter.
//! Both relay roles hold INSERT on the dead-letter table (they write the letters), so the table
//! alone cannot tell; a key only the relay and the operator hold (`dead_letter.signing_key_file`)
//! can.
//!
//! Invariants:
//! - a letter's `digest` is HMAC-SHA256 under the key over a domain tag, the outbox's table,
//!   the event id and the seven `row_data` fields, each length-prefixed (no two different
//!   letters share an input), read the same way on both sides (text values; a missing or
//!   non-text field is absent), so jsonb's own order of keys changes nothing;
//! - a digest is checked in constant time (`ring::hmac::verify`); one that is not hex, or not
//!   there, does not verify;
//! - a letter edited after the relay wrote it (an operator fixed its row_data) no longer
//!   verifies: the operator vouches for it by id (`replay-dead-letters --vouch`).

use ring::hmac;

use crate::config::MIN_SIGNING_KEY_BYTES;

/// What the digest's input starts with: a digest of anything else never verifies as a letter's.
const DOMAIN: &[u8] = b"outbox-relay dead letter v1";

/// The key letters are signed and checked with.
#[derive(Clone)]
pub struct SigningKey(hmac::Key);

impl std::fmt::Debug for SigningKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SigningKey(redacted)")
    }
}

impl SigningKey {
    /// The key in the file at `path`: its bytes less trailing whitespace, at least
    /// [`MIN_SIGNING_KEY_BYTES`] of them.
    pub fn read(path: &str) -> Result<SigningKey, String> {
        let bytes = std::fs::read(path)
            .map_err(|e| format!("dead_letter.signing_key_file: cannot read {path}: {e}"))?;
        SigningKey::new(&bytes).map_err(|held| {
            format!(
                "dead_letter.signing_key_file: {path} holds {held} bytes; a key needs at least \
                 {MIN_SIGNING_KEY_BYTES} (e.g. openssl rand -hex 32 > {path})"
            )
        })
    }

    /// The key `bytes` (less trailing whitespace); too short: how many bytes it has.
    pub fn new(bytes: &[u8]) -> Result<SigningKey, usize> {
        let end = bytes.iter().rposition(|b| !b.is_ascii_whitespace()).map_or(0, |i| i + 1);
        if end < MIN_SIGNING_KEY_BYTES {
            return Err(end);
        }
        Ok(SigningKey(hmac::Key::new(hmac::HMAC_SHA256, &bytes[..end])))
    }

    /// The digest of the letter of `event_id` from `source_table` with these `row_data` fields
    /// (`record::RowData::fields`), as lowercase hex.
    pub fn sign(&self, source_table: &str, event_id: &str, fields: &[Option<&str>]) -> String {
        let tag = hmac::sign(&self.0, &message(source_table, event_id, fields));
        tag.as_ref().iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Whether `digest` is this key's digest of that letter.
    pub fn verifies(
        &self,
        source_table: &str,
        event_id: &str,
        fields: &[Option<&str>],
        digest: &str,
    ) -> bool {
        let Some(tag) = crate::secret::from_hex(digest) else { return false };
        hmac::verify(&self.0, &message(source_table, event_id, fields), &tag).is_ok()
    }
}

/// The digest's input: the domain, then each part as a presence byte, its length and its bytes.
fn message(source_table: &str, event_id: &str, fields: &[Option<&str>]) -> Vec<u8> {
    let parts = [Some(source_table), Some(event_id)].into_iter().chain(fields.iter().copied());
    crate::secret::framed(DOMAIN, parts)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(byte: u8) -> SigningKey {
        SigningKey::new(&[byte; 32]).unwrap()
    }

    #[test]
    fn a_digest_verifies_for_its_letter_alone() {
        let fields = [Some("7"), Some("order"), Some("42"), Some("Placed"), Some("{}"), None, None];
        let digest = key(1).sign("public.outbox_events", "7", &fields);
        assert!(key(1).verifies("public.outbox_events", "7", &fields, &digest));
        // another key, table, id, field, or a field moved to its neighbour: no
        assert!(!key(2).verifies("public.outbox_events", "7", &fields, &digest));
        assert!(!key(1).verifies("public.other", "7", &fields, &digest));
        assert!(!key(1).verifies("public.outbox_events", "8", &fields, &digest));
        let mut forged = fields;
        forged[4] = Some("{\"forged\": true}");
        assert!(!key(1).verifies("public.outbox_events", "7", &forged, &digest));
        let mut moved = fields;
        (moved[5], moved[6]) = (Some(""), None);
        assert!(!key(1).verifies(
            "public.outbox_events",
            "7",
            &moved,
            &key(1).sign(
                "public.outbox_events",
                "7",
                &[Some("7"), Some("order"), Some("42"), Some("Placed"), Some("{}"), None, Some("")]
            )
        ));
        // nothing, or not hex: no
        for bad in ["", "zz", "abc", &digest[..62]] {
            assert!(!key(1).verifies("public.outbox_events", "7", &fields, bad), "{bad}");
        }
    }

    #[test]
    fn a_short_key_is_refused_naming_its_length() {
        assert_eq!(SigningKey::new(&[b'k'; 31]).unwrap_err(), 31);
        assert_eq!(SigningKey::new(b"0123456789abcdef0123456789abcdef\n").map(|_| ()), Ok(()));
        assert_eq!(SigningKey::new(b"0123456789abcdef0123456789abcde \n").unwrap_err(), 31);
    }
}
