//! Relay configurations for the tests, built section by section rather than written as TOML
//! strings by hand: `RelayToml::polling().set("polling", "batch_size", 200)`.

use std::fmt::{self, Display};

/// The part of a relay's configuration below `[postgres]` and `[kafka]`, which
/// [`super::write_config_with`] writes. Sections come out in the order first set and keys in
/// the order set; a key set twice keeps its last value.
#[derive(Clone, Debug, Default)]
pub struct RelayToml {
    sections: Vec<(String, Vec<(String, String)>)>,
}

impl RelayToml {
    pub fn new() -> Self {
        Self::default()
    }

    /// `[source] mode`, and nothing else.
    pub fn mode(mode: &str) -> Self {
        Self::new().set("source", "mode", mode)
    }

    /// Replication mode on `slot`, with the publication `p_<slot>` the tests use.
    pub fn replication(slot: &str) -> Self {
        Self::mode("replication").set("replication", "slot", slot).set(
            "replication",
            "publication",
            format!("p_{slot}"),
        )
    }

    /// Polling mode, polling every 200 ms (the default second is slow for a test).
    pub fn polling() -> Self {
        Self::mode("polling").set("polling", "poll_interval_ms", 200)
    }

    /// `mode` (`"polling"` or `"replication"`) with both sections set as by [`Self::polling`]
    /// and [`Self::replication`], so that one configuration serves either mode.
    pub fn either(mode: &str, slot: &str) -> Self {
        let both = Self::replication(slot).set("polling", "poll_interval_ms", 200);
        both.set("source", "mode", mode)
    }

    /// The outbox as `sql/examples/debezium_outbox.sql` makes it: Debezium's table, only the
    /// column names changed.
    pub fn debezium_table(self) -> Self {
        let columns = [
            ("aggregate_type", "aggregatetype"),
            ("aggregate_id", "aggregateid"),
            ("event_type", "type"),
            ("headers", ""),
            ("topic", ""),
            ("created_at", ""),
        ];
        let config = self.set("outbox", "table", "outboxevent");
        columns.into_iter().fold(config, |config, (key, column)| config.set("outbox.columns", key, column))
    }

    /// Sets `key` of `[section]` to `value`.
    pub fn set(self, section: &str, key: &str, value: impl Value) -> Self {
        self.set_literal(section, key, value.toml())
    }

    /// Sets `key` of `[section]` to the TOML literal `literal` as written (an array, an inline
    /// table, or a value a test gets wrong on purpose).
    pub fn set_literal(mut self, section: &str, key: &str, literal: impl Into<String>) -> Self {
        let keys = match self.sections.iter().position(|(name, _)| name == section) {
            Some(at) => &mut self.sections[at].1,
            None => {
                self.sections.push((section.to_string(), Vec::new()));
                &mut self.sections.last_mut().expect("just pushed").1
            }
        };
        let literal = literal.into();
        match keys.iter_mut().find(|(k, _)| k == key) {
            Some((_, value)) => *value = literal,
            None => keys.push((key.to_string(), literal)),
        }
        self
    }

    /// Sets a librdkafka property (`[kafka.properties]`), whose name has dots of its own.
    pub fn kafka_property(self, name: &str, value: &str) -> Self {
        self.set("kafka.properties", &format!("{name:?}"), value)
    }
}

impl Display for RelayToml {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (section, keys) in &self.sections {
            writeln!(f, "[{section}]")?;
            for (key, value) in keys {
                writeln!(f, "{key} = {value}")?;
            }
        }
        Ok(())
    }
}

/// A value [`RelayToml::set`] writes as TOML.
pub trait Value {
    fn toml(&self) -> String;
}

impl Value for &str {
    fn toml(&self) -> String {
        // Rust's debug form of a string is a valid TOML basic string for what tests write
        // (quotes, backslashes and newlines escaped the same way)
        format!("{self:?}")
    }
}

impl Value for String {
    fn toml(&self) -> String {
        self.as_str().toml()
    }
}

impl Value for &String {
    fn toml(&self) -> String {
        self.as_str().toml()
    }
}

impl Value for bool {
    fn toml(&self) -> String {
        self.to_string()
    }
}

macro_rules! integer_values {
    ($($t:ty),*) => {$(
        impl Value for $t {
            fn toml(&self) -> String {
                self.to_string()
            }
        }
    )*};
}
integer_values!(i32, i64, u16, u32, u64, usize);
