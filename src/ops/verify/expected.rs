//! What Kafka should hold: one compact entry per outbox row of the window, read as a stream.
//!
//! Rows arrive in id order. Numeric, dense ids (a sequence) are kept in a vector indexed by
//! `id - first id`, 16 bytes a row whatever the window; other ids (uuids, sparse numbers) in a
//! map. Each entry is the fingerprint of the record the relay makes of the row (topic, key,
//! payload and headers, the relay's own two headers aside) and how often Kafka held it.

use std::collections::{BTreeSet, HashMap};
use std::hash::{DefaultHasher, Hash, Hasher};

/// One row's expectation.
#[derive(Debug, Clone, Copy, Default)]
pub struct Slot {
    /// 0: no row with this id in the window.
    pub fingerprint: u64,
    /// Records of this id read, and how many of them differed from the row.
    pub seen: u32,
    pub mismatched: u32,
}

impl Slot {
    fn is_row(&self) -> bool {
        self.fingerprint != 0
    }
}

/// The fingerprint of a record: its topic, key, value and headers (the relay's own aside).
pub fn fingerprint<'a>(
    topic: &str,
    key: &[u8],
    payload: &[u8],
    headers: impl Iterator<Item = (&'a str, &'a [u8])>,
) -> u64 {
    let mut hash = DefaultHasher::new();
    (topic, key, payload).hash(&mut hash);
    for header in headers {
        header.hash(&mut hash);
    }
    hash.finish().max(1)
}

/// The rows of the window.
#[derive(Default)]
pub struct Expected {
    first: Option<i64>,
    dense: Vec<Slot>,
    sparse: HashMap<String, Slot>,
    pub topics: BTreeSet<String>,
    pub rows: u64,
}

/// How far a numeric id may run past the rows held before the vector gives way to the map.
const MAX_GAP: i64 = 65_536;

impl Expected {
    /// Adds the row `id` whose record has `fingerprint`, on `topic`. Ids come in increasing
    /// order (`ORDER BY id`); one that does not (a text id column sorts "10" before "9") goes to
    /// the map.
    pub fn add(&mut self, id: &str, topic: &str, fingerprint: u64) {
        self.rows += 1;
        if !self.topics.contains(topic) {
            self.topics.insert(topic.to_string());
        }
        let slot = Slot { fingerprint, ..Slot::default() };
        match (id.parse::<i64>(), self.first) {
            (Ok(n), None) if self.sparse.is_empty() => {
                self.first = Some(n);
                self.dense.push(slot);
            }
            (Ok(n), Some(first)) if (0..MAX_GAP).contains(&(n - first - self.dense.len() as i64)) => {
                let index = (n - first) as usize;
                self.dense.resize(index, Slot::default());
                self.dense.push(slot);
            }
            _ => {
                self.sparse.insert(id.to_string(), slot);
            }
        }
    }

    /// The entry of the row `id`, if the window holds one.
    pub fn get_mut(&mut self, id: &str) -> Option<&mut Slot> {
        let dense = match (self.first, id.parse::<i64>()) {
            (Some(first), Ok(n)) if n >= first => self.dense.get_mut((n - first) as usize),
            _ => None,
        };
        match dense {
            Some(slot) if slot.is_row() => Some(slot),
            _ => self.sparse.get_mut(id).filter(|s| s.is_row()),
        }
    }

    /// Whether the window holds the row `id`.
    pub fn contains(&self, id: &str) -> bool {
        let dense = match (self.first, id.parse::<i64>()) {
            (Some(first), Ok(n)) if n >= first => self.dense.get((n - first) as usize),
            _ => None,
        };
        dense.is_some_and(|s| s.is_row()) || self.sparse.get(id).is_some_and(|s| s.is_row())
    }

    /// Every row with its entry, in id order for the numeric ones.
    pub fn slots(&self) -> impl Iterator<Item = (String, &Slot)> {
        let first = self.first.unwrap_or(0);
        let dense = self
            .dense
            .iter()
            .enumerate()
            .filter(|(_, s)| s.is_row())
            .map(move |(i, s)| ((first + i as i64).to_string(), s));
        dense.chain(self.sparse.iter().map(|(id, s)| (id.clone(), s)))
    }

    /// Bytes held, for the report.
    pub fn memory_bytes(&self) -> usize {
        self.dense.capacity() * size_of::<Slot>() + self.sparse.capacity() * (size_of::<Slot>() + 48)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dense_ids_share_a_vector_and_others_a_map() {
        let mut expected = Expected::default();
        for (id, fp) in [("10", 1), ("11", 2), ("13", 3), ("1000000", 4), ("abc", 5)] {
            expected.add(id, "t", fp);
        }
        assert_eq!(expected.dense.len(), 4);
        assert_eq!(expected.sparse.len(), 2);
        assert_eq!(expected.get_mut("11").unwrap().fingerprint, 2);
        assert!(expected.get_mut("12").is_none(), "a gap is no row");
        assert!(expected.get_mut("9").is_none());
        assert_eq!(expected.get_mut("1000000").unwrap().fingerprint, 4);
        assert_eq!(expected.get_mut("abc").unwrap().fingerprint, 5);
        let ids: Vec<String> = expected.slots().map(|(id, _)| id).collect();
        assert_eq!(&ids[..3], ["10", "11", "13"]);
        assert_eq!(ids.len(), 5);
    }

    #[test]
    fn a_fingerprint_covers_every_part_of_the_record() {
        let base = fingerprint("t", b"k", b"{}", [("id", &b"1"[..])].into_iter());
        assert_ne!(base, fingerprint("u", b"k", b"{}", [("id", &b"1"[..])].into_iter()));
        assert_ne!(base, fingerprint("t", b"j", b"{}", [("id", &b"1"[..])].into_iter()));
        assert_ne!(base, fingerprint("t", b"k", b"[]", [("id", &b"1"[..])].into_iter()));
        assert_ne!(base, fingerprint("t", b"k", b"{}", [("id", &b"2"[..])].into_iter()));
        assert_eq!(base, fingerprint("t", b"k", b"{}", [("id", &b"1"[..])].into_iter()));
    }
}
