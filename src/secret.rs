//! [`Secret`]: a string that never reaches a log line.
//!
//! Invariant: a [`Secret`]'s `Debug` and `Serialize` print a placeholder, never the value; only
//! [`Secret::expose`] reads it, where it is handed to the client that needs it.

use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A string that never reaches a log line.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    pub fn new(value: impl Into<String>) -> Self {
        Secret(value.into())
    }
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("\"<redacted>\"")
    }
}

impl Serialize for Secret {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str("<redacted>")
    }
}

impl<'de> Deserialize<'de> for Secret {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d).map(Secret)
    }
}

/// The input of a keyed digest (the signed dead letters, the signed outbox messages): `domain`,
/// then each part as a presence byte, its length (8 bytes, big-endian) and its bytes, so no two
/// lists of parts frame to the same bytes.
pub(crate) fn framed<'a>(domain: &[u8], parts: impl IntoIterator<Item = Option<&'a str>>) -> Vec<u8> {
    let mut message = domain.to_vec();
    for part in parts {
        match part {
            Some(text) => {
                message.push(1);
                message.extend_from_slice(&(text.len() as u64).to_be_bytes());
                message.extend_from_slice(text.as_bytes());
            }
            None => message.push(0),
        }
    }
    message
}

/// Lower- or upper-case hex as bytes; None when it is not hex.
pub(crate) fn from_hex(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) {
        return None;
    }
    (0..text.len()).step_by(2).map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok()).collect()
}
