//! Why a payload could not be encoded, classified for the caller: dead-letter the row
//! ([`EncodeError::Mismatch`], [`EncodeError::NoSchema`]), retry ([`EncodeError::Unavailable`])
//! or stop ([`EncodeError::Refused`]).

/// An encoding failure. The message is lowercase and says what to do; a `Mismatch`'s `detail`
/// names the field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EncodeError {
    /// The payload does not fit the schema, or is not JSON: this row can never be encoded with
    /// this schema. The caller dead-letters it with this text.
    #[error("payload does not fit the schema of subject {subject} (id {schema_id}): {detail}")]
    Mismatch { subject: String, schema_id: u32, detail: String },
    /// The registry holds no schema under the subject this record's topic names (404, `40401`
    /// subject not found, `40402` no such version, `40403` schema not under the subject). The
    /// subject comes from the row (`topic_name`), so only the rows of this subject are affected:
    /// the caller dead-letters the row (or holds it), and the rest flow on. (Under
    /// `record_name` every row has the one subject: [`Registry::encode`](super::Registry::encode)
    /// makes it [`EncodeError::Refused`] instead.)
    #[error("schema registry: {detail}")]
    NoSchema { subject: String, detail: String },
    /// The registry could not be reached or answered 5xx/429: retried, never dead-lettered.
    #[error("schema registry unavailable: {0}")]
    Unavailable(String),
    /// The registry refuses the schema or the credentials, or does not hold what is looked up:
    /// retrying does not help, an operator must act. The detail names the subject when it is
    /// about one.
    #[error("schema registry: {detail}")]
    Refused { subject: String, detail: String },
}

impl EncodeError {
    /// True for the errors a retry (with backoff) can cure: the registry was unavailable.
    pub fn is_retryable(&self) -> bool {
        matches!(self, EncodeError::Unavailable(_))
    }
}

/// Row data quoted in a detail: escaped, and cut at 64 characters (a detail is logged and stored
/// with the dead letter, whatever the row holds).
pub(super) fn excerpt(text: &str) -> String {
    const CHARS: usize = 64;
    let cut: String = text.chars().take(CHARS).collect();
    let more = if text.chars().nth(CHARS).is_some() { "..." } else { "" };
    format!("{cut:?}{more}")
}

/// What a JSON value is, for a detail: `string "x"`, `number 3.5`, `object`.
pub(super) fn describe(value: &serde_json::Value) -> String {
    use serde_json::Value;
    match value {
        Value::Null => "null".to_string(),
        Value::Bool(b) => format!("boolean {b}"),
        Value::Number(n) => format!("number {n}"),
        Value::String(s) => format!("string {}", excerpt(s)),
        Value::Array(items) => format!("array of {} items", items.len()),
        Value::Object(_) => "object".to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_unavailable_is_retried() {
        let mismatch = EncodeError::Mismatch { subject: "s".into(), schema_id: 1, detail: "d".into() };
        assert!(!mismatch.is_retryable());
        assert!(!EncodeError::Refused { subject: "s".into(), detail: "d".into() }.is_retryable());
        assert!(!EncodeError::NoSchema { subject: "s".into(), detail: "d".into() }.is_retryable());
        assert!(EncodeError::Unavailable("timed out".into()).is_retryable());
    }

    #[test]
    fn quoted_row_data_is_cut_and_escaped() {
        assert_eq!(describe(&serde_json::json!("a\nb")), "string \"a\\nb\"");
        let long = "x".repeat(100);
        assert_eq!(describe(&serde_json::json!(long)), format!("string \"{}\"...", "x".repeat(64)));
        assert_eq!(describe(&serde_json::json!(3.5)), "number 3.5");
    }
}
