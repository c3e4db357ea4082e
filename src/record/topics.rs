//! Which topics an event may go to (`outbox.allowed_topics`), parsed once when the mapping is
//! built, so the hot path only compares strings.
//!
//! Invariants:
//! - an empty list allows no topic a row chose: with `outbox.allowed_topics = []` only what the
//!   template renders is published (the mapping decides that; see `Mapping::check`);
//! - an entry is an exact topic name, or a prefix followed by one `*` at the end; nothing else
//!   is a pattern (`config::validate` refuses other entries).

use std::collections::HashSet;

/// The parsed `outbox.allowed_topics`.
#[derive(Debug, Clone, Default)]
pub(super) struct AllowedTopics {
    exact: HashSet<String>,
    prefixes: Vec<String>,
}

impl AllowedTopics {
    pub(super) fn new(entries: &[String]) -> AllowedTopics {
        let mut allowed = AllowedTopics::default();
        for entry in entries {
            match entry.strip_suffix('*') {
                Some(prefix) => allowed.prefixes.push(prefix.to_string()),
                None => {
                    allowed.exact.insert(entry.clone());
                }
            }
        }
        allowed
    }

    /// Nothing is listed: the template alone decides.
    pub(super) fn is_empty(&self) -> bool {
        self.exact.is_empty() && self.prefixes.is_empty()
    }

    /// `topic` is listed, or starts with a listed prefix. An empty list permits nothing.
    pub(super) fn permits(&self, topic: &str) -> bool {
        self.exact.contains(topic) || self.prefixes.iter().any(|prefix| topic.starts_with(prefix.as_str()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn allowed(entries: &[&str]) -> AllowedTopics {
        AllowedTopics::new(&entries.iter().map(|e| e.to_string()).collect::<Vec<_>>())
    }

    #[test]
    fn exact_names_and_prefixes_match_and_nothing_else() {
        let list = allowed(&["billing", "outbox.event.*"]);
        assert!(list.permits("billing"));
        assert!(list.permits("outbox.event.order"));
        assert!(list.permits("outbox.event."));
        assert!(!list.permits("billing.dlq"), "an exact name is not a prefix");
        assert!(!list.permits("outbox.events"));
        assert!(!list.permits("ledger.internal"));
    }

    #[test]
    fn an_empty_list_permits_nothing_and_a_lone_star_everything() {
        assert!(allowed(&[]).is_empty());
        assert!(!allowed(&[]).permits("outbox.event.order"));
        assert!(allowed(&["*"]).permits("anything"));
    }
}
