//! Replication mode: stream pgoutput from a logical slot, confirm only what Kafka acknowledged.
//!
//! Invariants:
//! - events are produced in WAL (commit) order; the idempotent producer keeps that order per
//!   partition, so per-aggregate order holds;
//! - the position confirmed to PostgreSQL is the Commit `end_lsn` of the longest prefix of
//!   transactions whose every event Kafka acknowledged ([`crate::checkpoint::Tracker`]); when
//!   nothing is in flight, a keepalive's WAL end (the last position sent) is confirmed, so a
//!   quiet outbox in a busy database does not pin WAL;
//! - any record that fails transiently ends the session: the stream restarts from the slot's
//!   confirmed position, re-sending the unconfirmed tail (at-least-once, same `id` header);
//! - at most `replication.max_in_flight_events` records are unacknowledged; reading pauses at
//!   the bound, so memory stays flat however large the backlog.
//!
//! Files: [`slot`] (the slot and its first copy), [`publication`] (the publication and what it
//! delivers), [`copy`] (the first copy of a new slot), [`stream`] (one streaming session's
//! loop), [`decode`] (pgoutput), [`transport`] (the replication connection, behind our own
//! seam), [`failover`] (the slot's copies on standbys), `refusal.rs` (why a slot is refused).

mod copy;
pub use copy::CopyReport;
mod decode;
pub(crate) mod failover;
pub(crate) mod publication;
mod refusal;
pub(crate) mod slot;
mod stream;
#[cfg(test)]
mod tests;
mod transport;

use std::sync::Arc;

use tokio::sync::watch;
use tokio_postgres::Client;

use crate::config::{Endpoint, RelayConfig};
use crate::dead_letter::DeadLetters;
use crate::delivery::live::Desk;
use crate::delivery::{self, Delivery};
use crate::error::RelayError;
use crate::lsn::Lsn;
use crate::observe::metrics::Mode;
use crate::observe::pulse::Pulse;
use crate::outboxes::Outboxes;
use crate::readback::{self, Lookback};
use crate::sink::Sink;
use crate::source::Source;
use slot::SlotPlan;
use stream::{Feed, StreamSession};
use transport::WalStream;

/// Prefix of the relay's heartbeat messages (non-transactional, empty content).
pub const HEARTBEAT_PREFIX: &str = "outbox-relay-heartbeat";

/// The `mode` label of this source's metrics.
const MODE: Mode = Mode::Replication;

/// One slot and one publication for every outbox of the relay.
pub(crate) struct ReplicationSource {
    config: RelayConfig,
    outboxes: Arc<Outboxes>,
    dead_letters: DeadLetters,
    /// A standby's session, refused the slot's lock last time: asked again next time.
    standing_by: Option<(Client, Endpoint)>,
    /// Requests the active session serves beside its stream ([`crate::delivery::live`]).
    desk: Desk,
}

impl<S: Sink> Source<S> for ReplicationSource {
    async fn session(
        &mut self,
        sink: &mut S,
        pulse: &Pulse,
        shutdown: &mut watch::Receiver<bool>,
    ) -> Result<(), RelayError> {
        self.run_session(sink, pulse, shutdown).await
    }
}

impl ReplicationSource {
    pub(crate) fn new(config: RelayConfig, outboxes: Arc<Outboxes>) -> ReplicationSource {
        let dead_letters = DeadLetters::new(&outboxes, &config.retry, MODE);
        ReplicationSource { dead_letters, outboxes, config, desk: Desk::default(), standing_by: None }
    }

    /// Serves the requests of `desk` (the admin API's, the signal table's) while active.
    pub(crate) fn with_desk(mut self, desk: Desk) -> ReplicationSource {
        self.desk = desk;
        self
    }

    /// Opens the records of what was published, once per process (as polling: its warning is
    /// not repeated at every reconnect).
    async fn open_recorders(&self, client: &tokio_postgres::Client) -> Result<(), RelayError> {
        for outbox in self.outboxes.iter() {
            outbox.recorder(client).await?;
        }
        Ok(())
    }

    /// `outbox-relay setup`: the publication, and the slot with its first copy when missing.
    /// Returns the new slot's consistent point and what its copy did, or `None` when the slot
    /// was there.
    pub(crate) async fn setup<S: Sink>(
        &mut self,
        sink: &mut S,
        recreate: bool,
    ) -> Result<Option<(Lsn, CopyReport)>, RelayError> {
        let (client, server) = crate::postgres::connect_primary(&self.config.postgres).await?;
        slot::lock(&self.config, &client).await?;
        let plan = slot::prepare(&self.config, &client, recreate).await?;
        if let SlotPlan::Stream { .. } = plan {
            return Ok(None);
        }
        self.open_recorders(&client).await?;
        // a command, not a daemon: no supervisor, no shutdown but Ctrl-C ending the process
        let pulse = Pulse::detached();
        let (_never, mut shutdown) = watch::channel(false);
        let mut replication = transport::connect(&self.config, &server, Lsn::ZERO).await?;
        let created =
            slot::create_and_copy((&*self, sink), &server, &mut replication, &client, &pulse, &mut shutdown)
                .await?;
        Ok(Some(created))
    }

    /// A session on the primary holding the slot's lock. A standby keeps its session from one
    /// try to the next ([`STANDBY_RETRY`](crate::supervisor::STANDBY_RETRY)): each try is then
    /// one statement, not a connection, its authentication and the records' set-up.
    async fn lead(&mut self) -> Result<(Client, Endpoint), RelayError> {
        let (client, server) = match self.standing_by.take() {
            Some(kept) if !kept.0.is_closed() => kept,
            _ => {
                let (client, server) = crate::postgres::connect_primary(&self.config.postgres).await?;
                self.open_recorders(&client).await?;
                (client, server)
            }
        };
        match slot::lock(&self.config, &client).await {
            Err(e @ RelayError::Standby(_)) => {
                self.standing_by = Some((client, server));
                Err(e)
            }
            Err(e) => Err(e),
            Ok(()) => Ok((client, server)),
        }
    }

    /// One replication session: prepare the slot, (copy,) stream until shutdown or an error.
    async fn run_session<S: Sink>(
        &mut self,
        sink: &mut S,
        pulse: &Pulse,
        shutdown: &mut watch::Receiver<bool>,
    ) -> Result<(), RelayError> {
        let (client, server) = self.lead().await?;
        let plan = slot::prepare(&self.config, &client, false).await?;
        let slot_name = &self.config.replication.slot.clone();
        let (replication, confirmed) = match plan {
            SlotPlan::Stream { confirmed, make_failover } => {
                let mut replication = transport::connect(&self.config, &server, confirmed).await?;
                if make_failover {
                    slot::make_failover(&mut replication, slot_name).await?;
                }
                (replication, confirmed)
            }
            SlotPlan::Create => {
                let mut replication = transport::connect(&self.config, &server, Lsn::ZERO).await?;
                let (point, _) = slot::create_and_copy(
                    (&*self, sink),
                    &server,
                    &mut replication,
                    &client,
                    pulse,
                    shutdown,
                )
                .await?;
                (replication, point)
            }
        };
        let wal = WalStream::start(replication, slot_name).await?;
        tracing::info!(slot = %slot_name, %confirmed, tables = %self.outboxes.table_names(), "active: streaming from the slot");
        pulse.active();
        // (after the copy's prologue, identities are read again and nothing else is done)
        let lookback = Lookback::Since(confirmed);
        let identities = readback::source_identities(&client, &self.config).await?;
        let prologue =
            delivery::prologue(sink, &identities, &self.config, (MODE, lookback), pulse, shutdown).await?;
        let stage = (&self.dead_letters, &self.config.kafka);
        let delivery = Delivery::open(&*sink, prologue, stage, pulse, MODE).await;
        let feed = Feed::new(delivery, confirmed, &self.outboxes, &self.config.replication);
        let input = (wal, pulse.paused(), self.desk.turn().await);
        StreamSession::new(&self.config, &self.dead_letters, &self.outboxes, &client, input, feed)
            .run(shutdown)
            .await
    }
}
