//! W3C Trace Context (`traceparent`, version 00): the ids a span is known by, parsed from a row's
//! header and written into a Kafka record's.
//!
//! Invariants:
//! - only a well-formed version-00 value parses (55 characters, lowercase hex, neither id all
//!   zeros); anything else is not a parent, and the relay then treats the row as having none;
//! - a context formats back to exactly the header it parsed from.

use std::fmt;

/// A span's identity in a trace, and whether the trace is sampled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceContext {
    pub trace_id: [u8; 16],
    pub span_id: [u8; 8],
    pub sampled: bool,
}

impl TraceContext {
    /// Parses a `traceparent` header value; `None` when it is not a valid version-00 value.
    pub fn parse(header: &str) -> Option<TraceContext> {
        let header = header.trim();
        let mut parts = header.split('-');
        let (version, trace, span, flags) = (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
        if parts.next().is_some() || version != "00" || header.len() != 55 {
            return None;
        }
        let trace_id: [u8; 16] = hex(trace)?;
        let span_id: [u8; 8] = hex(span)?;
        let [flags]: [u8; 1] = hex(flags)?;
        if trace_id == [0; 16] || span_id == [0; 8] {
            return None;
        }
        Some(TraceContext { trace_id, span_id, sampled: flags & 1 == 1 })
    }

    /// A new span of the same trace.
    pub fn child(&self) -> TraceContext {
        TraceContext { span_id: new_span_id(), ..*self }
    }

    /// The root span of a new, sampled trace.
    pub fn root() -> TraceContext {
        let mut trace_id = [0u8; 16];
        while trace_id == [0; 16] {
            trace_id = rand::random();
        }
        TraceContext { trace_id, span_id: new_span_id(), sampled: true }
    }

    /// The trace id as 32 lowercase hex digits (how OTLP/JSON and the backends' APIs name it).
    pub fn trace_hex(&self) -> String {
        to_hex(&self.trace_id)
    }

    /// The span id as 16 lowercase hex digits.
    pub fn span_hex(&self) -> String {
        to_hex(&self.span_id)
    }
}

/// The `traceparent` header value.
impl fmt::Display for TraceContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "00-{}-{}-{:02x}", self.trace_hex(), self.span_hex(), u8::from(self.sampled))
    }
}

/// A random span id, never all zeros.
pub fn new_span_id() -> [u8; 8] {
    loop {
        let id: [u8; 8] = rand::random();
        if id != [0; 8] {
            return id;
        }
    }
}

/// Lowercase hex of `bytes`.
pub fn to_hex(bytes: &[u8]) -> String {
    use fmt::Write;
    let mut text = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        write!(text, "{b:02x}").expect("writing to a String");
    }
    text
}

/// `N` bytes from exactly `2 * N` lowercase hex digits.
fn hex<const N: usize>(text: &str) -> Option<[u8; N]> {
    if text.len() != 2 * N || !text.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) {
        return None;
    }
    let mut out = [0u8; N];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&text[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const HEADER: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn a_valid_traceparent_parses_and_formats_back_unchanged() {
        let context = TraceContext::parse(HEADER).unwrap();
        assert!(context.sampled);
        assert_eq!(context.trace_hex(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(context.to_string(), HEADER);
        let unsampled = TraceContext::parse(&HEADER.replace("-01", "-00")).unwrap();
        assert!(!unsampled.sampled);
    }

    #[test]
    fn a_malformed_traceparent_is_not_a_parent() {
        for bad in [
            "",
            "00-abc-01",
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-4bf92f3577b34da6a3ce929d0e0e473g-00f067aa0ba902b7-01",
        ] {
            assert_eq!(TraceContext::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn a_child_keeps_the_trace_and_takes_a_new_span() {
        let parent = TraceContext::parse(HEADER).unwrap();
        let child = parent.child();
        assert_eq!(child.trace_id, parent.trace_id);
        assert_ne!(child.span_id, parent.span_id);
        assert_eq!(TraceContext::parse(&child.to_string()), Some(child));
    }
}
