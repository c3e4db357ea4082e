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
