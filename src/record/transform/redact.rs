//! Redacting payload fields in place, in the payload's own text: only the objects and arrays on
//! a pointer's way are taken apart and written again (their members in their order, each other
//! value byte for byte as stored), so a redaction changes nothing but what it redacts, and the
//! same payload always redacts to the same bytes.
//!
//! Invariants:
//! - a pointer through a value that is neither an object nor an array (nor null) is an error
//!   naming where it stopped; a member or element that is not there is nothing to redact;
//! - every member of an object with the pointer's name is redacted (JSON allows duplicates;
//!   a consumer may read either).

use std::fmt::Write;

use ring::hmac;
use serde::de::{Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::value::RawValue;

/// What to do with the value at a pointer.
pub(super) enum Action<'k> {
    Replace(&'k str),
    Drop,
    Hash(&'k hmac::Key),
}

/// Why a pointer could not be followed: where it stopped, and what was there.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Stopped {
    pub(super) at: String,
    pub(super) found: &'static str,
}

/// `text` with the value at `tokens` redacted; `None` when there is nothing at it.
pub(super) fn redact(text: &str, tokens: &[String], action: &Action<'_>) -> Result<Option<String>, Stopped> {
    walk(text.trim(), tokens, action, 0)
}

fn walk(text: &str, tokens: &[String], action: &Action<'_>, depth: usize) -> Result<Option<String>, Stopped> {
    let stopped = |found| Stopped { at: pointer(&tokens[..depth]), found };
    let token = &tokens[depth];
    let last = depth + 1 == tokens.len();
    match text.as_bytes().first() {
        Some(b'{') => {
            let Members(mut members) = serde_json::from_str(text).map_err(|_| stopped("invalid JSON"))?;
            let mut changed = false;
            let mut i = 0;
            while i < members.len() {
                if members[i].0 != *token {
                    i += 1;
                    continue;
                }
                match apply(members[i].1.get(), tokens, action, depth, last)? {
                    Some(Some(value)) => members[i].1 = value,
                    Some(None) => {
                        members.remove(i);
                        changed = true;
                        continue;
                    }
                    None => {
                        i += 1;
                        continue;
                    }
                }
                changed = true;
                i += 1;
            }
            Ok(changed.then(|| write_object(&members)))
        }
        Some(b'[') => {
            let Elements(mut elements) = serde_json::from_str(text).map_err(|_| stopped("invalid JSON"))?;
            let index = token.parse::<usize>().map_err(|_| Stopped {
                at: pointer(&tokens[..=depth]),
                found: "an array, and the token is not an index",
            })?;
            if index >= elements.len() {
                return Ok(None);
            }
            match apply(elements[index].get(), tokens, action, depth, last)? {
                Some(Some(value)) => elements[index] = value,
                Some(None) => {
                    elements.remove(index);
                }
                None => return Ok(None),
            }
            let items: Vec<&str> = elements.iter().map(|e| e.get()).collect();
            Ok(Some(format!("[{}]", items.join(","))))
        }
        Some(b'n') if text == "null" => Ok(None),
        Some(b'"') => Err(stopped("a string")),
        Some(b't' | b'f') => Err(stopped("a boolean")),
        Some(_) => Err(stopped("a number")),
        None => Err(stopped("nothing (an empty payload)")),
    }
}

/// The redacted `value` (a member's or an element's): `Some(Some(new))` replaced,
/// `Some(None)` dropped, `None` unchanged (nothing at the rest of the pointer).
fn apply(
    value: &str,
    tokens: &[String],
    action: &Action<'_>,
    depth: usize,
    last: bool,
) -> Result<Option<Option<Box<RawValue>>>, Stopped> {
    let raw = |text: String| RawValue::from_string(text).expect("redaction writes valid JSON");
    if !last {
        return Ok(walk(value, tokens, action, depth + 1)?.map(|text| Some(raw(text))));
    }
    Ok(Some(match action {
        Action::Replace(with) => Some(raw(with.to_string())),
        Action::Drop => None,
        Action::Hash(key) => Some(raw(format!("\"{}\"", hashed(key, value)))),
    }))
}

/// The lowercase hex HMAC-SHA256 of a value's text: a string's characters (unescaped), any other
/// value's JSON text as stored.
pub(super) fn hashed(key: &hmac::Key, value: &str) -> String {
    let text = match serde_json::from_str::<String>(value) {
        Ok(text) => std::borrow::Cow::Owned(text),
        Err(_) => std::borrow::Cow::Borrowed(value),
    };
    let tag = hmac::sign(key, text.as_bytes());
    let mut hex = String::with_capacity(64);
    for byte in tag.as_ref() {
        let _ = write!(hex, "{byte:02x}");
    }
    hex
}

/// The pointer of `tokens` (RFC 6901 escapes), `""` for the whole payload.
pub(super) fn pointer(tokens: &[String]) -> String {
    tokens.iter().map(|t| format!("/{}", t.replace('~', "~0").replace('/', "~1"))).collect()
}

fn write_object(members: &[(String, Box<RawValue>)]) -> String {
    let mut out = String::from("{");
    for (i, (name, value)) in members.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push_str(&serde_json::to_string(name).expect("a string"));
        out.push(':');
        out.push_str(value.get());
    }
    out.push('}');
    out
}

/// An object's members in their order, each value as its text.
struct Members(Vec<(String, Box<RawValue>)>);

impl<'de> serde::Deserialize<'de> for Members {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Members;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Members, A::Error> {
                let mut members = Vec::new();
                while let Some(member) = map.next_entry::<String, Box<RawValue>>()? {
                    members.push(member);
                }
                Ok(Members(members))
            }
        }
        d.deserialize_map(V)
    }
}

/// An array's elements, each as its text.
struct Elements(Vec<Box<RawValue>>);

impl<'de> serde::Deserialize<'de> for Elements {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Elements;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON array")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Elements, A::Error> {
                let mut elements = Vec::new();
                while let Some(element) = seq.next_element::<Box<RawValue>>()? {
                    elements.push(element);
                }
                Ok(Elements(elements))
            }
        }
        d.deserialize_seq(V)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokens(pointer: &str) -> Vec<String> {
        crate::config::pointer_tokens(pointer).unwrap()
    }

    fn key() -> hmac::Key {
        hmac::Key::new(hmac::HMAC_SHA256, b"0123456789abcdef0123456789abcdef")
    }

    #[test]
    fn only_the_redacted_value_changes_and_the_members_keep_their_order() {
        let payload = r#"{"z": 1, "card": {"number": "4111 1111", "exp": "12/30"}, "a": [1, 2]}"#;
        let out = redact(payload, &tokens("/card/number"), &Action::Replace("\"****\"")).unwrap().unwrap();
        assert_eq!(out, r#"{"z":1,"card":{"number":"****","exp":"12/30"},"a":[1, 2]}"#);
        let dropped = redact(payload, &tokens("/card/exp"), &Action::Drop).unwrap().unwrap();
        assert_eq!(dropped, r#"{"z":1,"card":{"number":"4111 1111"},"a":[1, 2]}"#);
        let element = redact(payload, &tokens("/a/1"), &Action::Replace("0")).unwrap().unwrap();
        assert_eq!(element, r#"{"z":1,"card":{"number": "4111 1111", "exp": "12/30"},"a":[1,0]}"#);
    }

    #[test]
    fn a_hash_is_the_keyed_hmac_of_the_text_and_the_same_for_the_same_value() {
        let key = key();
        let one = redact(r#"{"iban":"DE89 3704"}"#, &tokens("/iban"), &Action::Hash(&key)).unwrap().unwrap();
        let two =
            redact(r#"{ "iban" : "DE89 3704" }"#, &tokens("/iban"), &Action::Hash(&key)).unwrap().unwrap();
        assert_eq!(one, two);
        let expected = hashed(&key, "\"DE89 3704\"");
        assert_eq!(one, format!("{{\"iban\":\"{expected}\"}}"));
        assert_eq!(expected.len(), 64);
        assert!(!one.contains("DE89"));
        let other = hmac::Key::new(hmac::HMAC_SHA256, b"another key, another hash, 32 b..");
        assert_ne!(hashed(&other, "\"DE89 3704\""), expected);
    }

    #[test]
    fn nothing_there_is_nothing_to_redact_but_a_pointer_through_a_scalar_stops() {
        let payload = r#"{"card": "4111", "none": null}"#;
        assert_eq!(redact(payload, &tokens("/missing/x"), &Action::Drop), Ok(None));
        assert_eq!(redact(payload, &tokens("/none/x"), &Action::Drop), Ok(None));
        let stopped = redact(payload, &tokens("/card/number"), &Action::Drop).unwrap_err();
        assert_eq!(stopped, Stopped { at: "/card".into(), found: "a string" });
        let stopped = redact("[1]", &tokens("/x"), &Action::Drop).unwrap_err();
        assert_eq!(stopped.at, "/x");
        let stopped = redact("42", &tokens("/x"), &Action::Drop).unwrap_err();
        assert_eq!(stopped, Stopped { at: "".into(), found: "a number" });
    }

    #[test]
    fn every_duplicate_member_is_redacted() {
        let out = redact(r#"{"pan":"1","pan":"2"}"#, &tokens("/pan"), &Action::Replace("null")).unwrap();
        assert_eq!(out.unwrap(), r#"{"pan":null,"pan":null}"#);
    }

    #[test]
    fn escaped_pointer_tokens_name_members_with_slashes_and_tildes() {
        let out = redact(r#"{"a/b":1,"c~d":2}"#, &tokens("/a~1b"), &Action::Drop).unwrap().unwrap();
        assert_eq!(out, r#"{"c~d":2}"#);
        assert_eq!(pointer(&tokens("/a~1b/c~0d")), "/a~1b/c~0d");
    }
}
