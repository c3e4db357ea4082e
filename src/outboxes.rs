//! The typed list of the outboxes a relay reads, built once near `main` from the configuration
//! and passed down: each entry is everything about one outbox (its id, its table and SQL, its
//! row-to-record mapping and format, its dead-letter settings, its record of published ids).
//!
//! Invariants:
//! - built once per process ([`Outboxes::new`]); the sources, the sampler and the dead letters
//!   read this list, never a copy of the whole configuration narrowed to one outbox;
//! - per-outbox state elsewhere is a [`PerOutbox`] indexed by [`OutboxId`], never a bare number;
//! - an outbox's record of published ids is opened once per process, by whichever session reads
//!   it first ([`Outbox::recorder`]), so its warning (when the table is missing) is not repeated
//!   at every reconnect.

use std::ops::Index;

use tokio::sync::OnceCell;
use tokio_postgres::GenericClient;

use crate::config::{DeadLetterConfig, OutboxConfig, OutboxId, PerOutbox, RelayConfig};
use crate::error::RelayError;
use crate::published::Recorder;
use crate::record::Mapping;
use crate::table::OutboxTable;

/// One outbox of the relay's.
#[derive(Debug)]
pub struct Outbox {
    pub id: OutboxId,
    /// Unique among the relay's outboxes: the `outbox` label of its metrics.
    pub name: String,
    /// Where its settings are, for errors: `outbox` or `outboxes[2]`.
    pub path: String,
    pub config: OutboxConfig,
    /// Its own `dead_letter`, or the shared `[dead_letter]`.
    pub dead_letter: DeadLetterConfig,
    pub table: OutboxTable,
    pub mapping: Mapping,
    recorder: OnceCell<Recorder>,
}

impl Outbox {
    /// The record of this outbox's published ids, opened on first use (see the invariants).
    pub async fn recorder(&self, client: &impl GenericClient) -> Result<&Recorder, RelayError> {
        let source_table = self.table.display_name();
        self.recorder.get_or_try_init(|| Recorder::open(client, &source_table)).await
    }
}

/// The relay's outboxes, in configured order (`[outbox]`, or the `[[outboxes]]` entries).
#[derive(Debug)]
pub struct Outboxes(PerOutbox<Outbox>);

impl Outboxes {
    pub fn new(config: &RelayConfig) -> Outboxes {
        Outboxes(PerOutbox::of(&config.outboxes(), |id, entry| Outbox {
            id,
            name: entry.name.clone(),
            path: entry.path.clone(),
            table: OutboxTable::of(&entry.config, &config.polling),
            mapping: Mapping::of(&entry.config, id, &entry.path),
            config: entry.config.clone(),
            dead_letter: entry.dead_letter.clone(),
            recorder: OnceCell::new(),
        }))
    }

    pub fn iter(&self) -> impl Iterator<Item = &Outbox> {
        self.0.values()
    }

    /// The first outbox: the one `[outbox]`, or the first `[[outboxes]]` entry.
    pub fn first(&self) -> &Outbox {
        self.0.values().next().expect("a relay reads at least one outbox (config validation)")
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// `make(outbox)` for each outbox: per-outbox state, indexed by [`OutboxId`].
    pub fn per<T>(&self, mut make: impl FnMut(&Outbox) -> T) -> PerOutbox<T> {
        let list: Vec<&Outbox> = self.iter().collect();
        PerOutbox::of(&list, |_, o| make(o))
    }

    /// The tables, for the log: `public.orders_outbox, public.billing_outbox`.
    pub fn table_names(&self) -> String {
        self.iter().map(|o| o.table.display_name()).collect::<Vec<_>>().join(", ")
    }
}

impl Index<OutboxId> for Outboxes {
    type Output = Outbox;

    fn index(&self, id: OutboxId) -> &Outbox {
        &self.0[id]
    }
}
