//! The replication transport behind our own seam.
//!
//! Upstream tokio-postgres cannot open a replication connection, so the stream comes from
//! `pgwire-replication` (pure Rust, proto v1). This file wraps its stream: the streaming
//! session sees [`WalEvent`]s and confirms [`Lsn`]s. Two other files know the crate:
//! `slot.rs` sends the slot commands (`CREATE_REPLICATION_SLOT`, `ALTER_REPLICATION_SLOT`) on
//! the connection before it streams, and `postgres.rs` turns `postgres.sslmode` and the
//! certificates into its TLS settings. Swapping the transport (for `pg_walstream`, or
//! tokio-postgres once it speaks CopyBoth) touches those three files.

use std::time::{Duration, SystemTime};

use bytes::Bytes;
use pgwire_replication::{PgWireError, ReplicationClient, ReplicationConfig, ReplicationEvent};
use tokio_postgres::error::SqlState;

use crate::config::{Endpoint, RelayConfig};
use crate::error::{FatalReason, RelayError, sqlstate_in};
use crate::lsn::Lsn;
use crate::observe::metrics::{SkippedKind, metrics};

/// Microseconds from the Unix epoch to PostgreSQL's (2000-01-01).
const PG_EPOCH_OFFSET_MICROS: u64 = 946_684_800_000_000;

/// What the stream delivers, in WAL order.
#[derive(Debug)]
pub enum WalEvent {
    Begin {
        /// The LSN of the transaction's commit record (pgoutput's `final_lsn`).
        commit_lsn: Lsn,
        commit_time: SystemTime,
    },
    /// `end_lsn`: where a restart resumes after this transaction.
    Commit {
        end_lsn: Lsn,
    },
    /// A pgoutput message other than Begin/Commit/Message (Relation, Insert, ...).
    Data(Bytes),
    Message {
        transactional: bool,
        lsn: Lsn,
        prefix: String,
        content: Bytes,
    },
    /// A change over `replication.max_message_bytes`: only its first [`OVERSIZED_HEAD`] bytes
    /// were read (enough for an outbox row's id, or a logical message's prefix), the rest was
    /// skipped on the wire.
    Oversized {
        lsn: Lsn,
        head: Bytes,
        bytes: usize,
    },
    /// The server's last sent position.
    KeepAlive {
        wal_end: Lsn,
    },
}

/// Opens an authenticated replication session that has not started streaming, so the slot
/// can be created (with an exported snapshot) on it first.
/// `server` is the primary the SQL session found (see [`crate::postgres::connect_primary`]).
pub async fn connect(
    config: &RelayConfig,
    server: &Endpoint,
    ack: Lsn,
) -> Result<ReplicationClient, RelayError> {
    let pg = &config.postgres;
    let r = &config.replication;
    let password = pg.password_for(server)?.unwrap_or_default();
    let cfg = ReplicationConfig::new(
        &server.host,
        &pg.user,
        password,
        &pg.database,
        &r.slot,
        r.publication.as_str(),
    )
    .with_port(server.port)
    .with_tls(crate::postgres::replication_tls(pg))
    // the transport reads ahead of the relay into a channel of this many messages: with
    // its default (8,192) and 10 KB rows that alone is 80 MB, past any in-flight bound
    .with_buffer_size(STREAM_BUFFER_MESSAGES)
    // and into at most this many bytes of them: 1,024 rows of 1 MB would be a gigabyte
    .with_buffer_bytes(STREAM_BUFFER_BYTES)
    // one message (one change) is read whole: bound it, so a huge row stops the relay
    // with a reason instead of an out-of-memory kill
    .with_max_message_size(r.max_message_bytes)
    // ...and a larger change is read only in part, to be skipped or dead-lettered by reference
    .with_oversized_head(OVERSIZED_HEAD)
    .with_start_lsn(pgwire_replication::Lsn::ZERO) // 0/0: resume at the slot's confirmed position
    .with_ack_lsn(pgwire_replication::Lsn(ack.0))
    .with_status_interval(Duration::from_millis(r.status_interval_ms))
    // a quiet stream wakes the transport this often to send a status update nobody needs
    // sooner: a new position, and the server's request for one, go at once
    .with_wakeup_interval(IDLE_STATUS_INTERVAL)
    .with_application_name(pg.application_name.clone());
    // connect_gated spawns the session task; connection errors surface on the first call.
    ReplicationClient::connect_gated(cfg).await.map_err(classify)
}

/// How often a quiet stream sends a status update unasked (`pg_recvlogical`'s default): the
/// server asks for one itself at half its `wal_sender_timeout`, and is answered at once.
pub const IDLE_STATUS_INTERVAL: Duration = Duration::from_secs(10);

/// How much of a change over `replication.max_message_bytes` is read.
pub const OVERSIZED_HEAD: usize = 64 << 10;

/// Messages the transport may read ahead of the relay.
const STREAM_BUFFER_MESSAGES: usize = 1_024;
/// Bytes of messages the transport may read ahead of the relay (one larger message is read
/// alone, up to `replication.max_message_bytes`).
pub const STREAM_BUFFER_BYTES: usize = 8 << 20;

/// The started stream.
pub struct WalStream {
    client: ReplicationClient,
    slot: String,
}

impl WalStream {
    /// Sends START_REPLICATION on the gated session and waits until the server accepted it.
    pub async fn start(mut client: ReplicationClient, slot: &str) -> Result<WalStream, RelayError> {
        let started = match client.start().await {
            Ok(()) => client.wait_started().await,
            Err(e) => Err(e),
        };
        started.map_err(|e| in_context(classify(e), Command::Start, slot))?;
        Ok(WalStream { client, slot: slot.to_string() })
    }

    /// The next event; `Ok(None)` when the server ended the stream.
    pub async fn recv(&mut self) -> Result<Option<WalEvent>, RelayError> {
        loop {
            let event = match self.client.recv().await {
                Ok(None) => return Ok(None),
                Ok(Some(event)) => event,
                Err(e) => return Err(in_context(classify(e), Command::Stream, &self.slot)),
            };
            if let Some(event) = wal_event(event) {
                return Ok(Some(event));
            }
        }
    }

    /// The next event when the transport has already read one, without waiting; `None` when it
    /// has not (and when the stream ended: [`WalStream::recv`] then says how).
    pub fn try_recv(&mut self) -> Option<Result<WalEvent, RelayError>> {
        loop {
            match self.client.try_recv()? {
                Ok(event) => {
                    if let Some(event) = wal_event(event) {
                        return Some(Ok(event));
                    }
                }
                Err(e) => return Some(Err(in_context(classify(e), Command::Stream, &self.slot))),
            }
        }
    }

    /// Tells PostgreSQL it may release WAL up to `lsn` (sent within the status interval, and
    /// at once when the server asks).
    pub fn confirm(&self, lsn: Lsn) {
        self.client.update_applied_lsn(pgwire_replication::Lsn(lsn.0));
    }

    /// As [`WalStream::confirm`], sent at once rather than at the end of the status interval
    /// (see vendor/pgwire-replication/PATCHED.md).
    pub fn confirm_now(&self, lsn: Lsn) {
        self.client.update_applied_lsn_now(pgwire_replication::Lsn(lsn.0));
    }

    /// Ends the stream with CopyDone.
    pub async fn stop(mut self) {
        let _ = self.client.shutdown().await;
    }
}

/// The transport's event as the relay sees it; `None` for one it skips (counted).
fn wal_event(event: ReplicationEvent) -> Option<WalEvent> {
    Some(match event {
        ReplicationEvent::Begin { final_lsn, commit_time_micros, .. } => {
            WalEvent::Begin { commit_lsn: Lsn(final_lsn.0), commit_time: pg_time(commit_time_micros) }
        }
        ReplicationEvent::Commit { end_lsn, .. } => WalEvent::Commit { end_lsn: Lsn(end_lsn.0) },
        ReplicationEvent::XLogData { data, .. } => WalEvent::Data(data),
        ReplicationEvent::Message { transactional, lsn, prefix, content } => {
            WalEvent::Message { transactional, lsn: Lsn(lsn.0), prefix, content }
        }
        ReplicationEvent::KeepAlive { wal_end, .. } => WalEvent::KeepAlive { wal_end: Lsn(wal_end.0) },
        ReplicationEvent::Oversized { wal_start, head, bytes, .. } => {
            WalEvent::Oversized { lsn: Lsn(wal_start.0), head, bytes }
        }
        ReplicationEvent::StoppedAt { .. } => {
            metrics().stream_messages_skipped.with_label_values(&[SkippedKind::StoppedAt.label()]).inc();
            return None;
        }
        #[allow(unreachable_patterns)]
        other => {
            metrics().stream_messages_skipped.with_label_values(&[SkippedKind::Unknown.label()]).inc();
            tracing::warn!(event = ?other, "skipping a replication event this version does not know");
            return None;
        }
    })
}

fn pg_time(micros: i64) -> SystemTime {
    let unix = (micros.max(0) as u64).saturating_add(PG_EPOCH_OFFSET_MICROS);
    SystemTime::UNIX_EPOCH + Duration::from_micros(unix)
}

/// A transport error as a [`RelayError`]; [`RelayError::action`] decides what follows.
pub fn classify(e: PgWireError) -> RelayError {
    match e {
        PgWireError::Server(message) => RelayError::Server { sqlstate: sqlstate_in(&message), message },
        PgWireError::Auth(message) => RelayError::fatal(
            FatalReason::Auth,
            format!(
                "replication connection refused: {message}; check postgres.user / postgres.password and that \
                 pg_hba.conf allows replication connections"
            ),
        ),
        PgWireError::Protocol(message) => RelayError::Protocol(message),
        PgWireError::Tls(message) => RelayError::fatal(
            FatalReason::Tls,
            format!(
                "replication connection: TLS failed: {message}; check postgres.sslmode, postgres.sslrootcert and \
                 postgres.host against the server's certificate"
            ),
        ),
        PgWireError::MessageTooLarge { payload_bytes, limit_bytes } => RelayError::fatal(
            FatalReason::TooLarge,
            format!(
                "the stream holds a change of {payload_bytes} bytes, more than replication.max_message_bytes \
                 ({limit_bytes}); the relay stops rather than run out of memory (it holds a row about four times \
                 while it handles it), and nothing past it was confirmed. Raise replication.max_message_bytes, and \
                 the memory limit with it, then restart"
            ),
        ),
        other => RelayError::Disconnected(format!("replication stream: {other}")),
    }
}

/// The replication command an error came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command {
    /// CREATE_REPLICATION_SLOT.
    Create,
    /// ALTER_REPLICATION_SLOT.
    Alter,
    /// START_REPLICATION.
    Start,
    /// Streaming, after START_REPLICATION.
    Stream,
}

/// What a server error means in the replication command that raised it. The general SQLSTATE
/// policy ([`crate::error::sqlstate_action`]) cannot know which object an "undefined object" or
/// "object in use" is; here it is the slot or the publication.
pub fn in_context(e: RelayError, command: Command, slot: &str) -> RelayError {
    let RelayError::Server { sqlstate: Some(code), message } = e else { return e };
    let fatal = |reason, fix: &str| RelayError::fatal(reason, format!("{message}: {fix}"));
    match (SqlState::from_code(&code), command) {
        // `replication slot "x" is active for PID n`; `replication slot "x" already exists`
        (SqlState::OBJECT_IN_USE | SqlState::DUPLICATE_OBJECT, Command::Create | Command::Start) => {
            RelayError::Standby(message)
        }
        (SqlState::UNDEFINED_OBJECT, Command::Start) => fatal(
            FatalReason::SlotMissing,
            &format!(
                "slot \"{slot}\" disappeared; run `outbox-relay setup --recreate-slot` to create it again and \
                 re-publish what the table still holds"
            ),
        ),
        // pgoutput looks the publication up while decoding
        (SqlState::UNDEFINED_OBJECT, Command::Stream) => fatal(
            FatalReason::Publication,
            &format!(
                "the publication was dropped behind the slot's position; {}",
                super::publication::DROPPED_REMEDY
            ),
        ),
        // `can no longer get changes from replication slot "x"`: invalidated
        (SqlState::OBJECT_NOT_IN_PREREQUISITE_STATE, Command::Start | Command::Stream) => fatal(
            FatalReason::SlotLost,
            "the slot was invalidated: PostgreSQL removed WAL the relay had not read; raise \
             max_slot_wal_keep_size, then run `outbox-relay setup --recreate-slot` to recreate the slot and \
             re-publish what the table still holds",
        ),
        (SqlState::CHARACTER_NOT_IN_REPERTOIRE, Command::Stream) => fatal(
            FatalReason::Encoding,
            "the database (SQL_ASCII) holds outbox text that is not UTF-8, which the server refuses to stream \
             (the insert stays in the slot and fails again at every start); nothing past it was confirmed. Run \
             `outbox-relay setup --recreate-slot`: its copy reads the table itself, dead-letters such rows and \
             re-publishes the rest; or relay this outbox in polling mode, which dead-letters them",
        ),
        _ => RelayError::Server { sqlstate: Some(code), message },
    }
}

#[cfg(test)]
mod tests {
    use super::{Command, in_context};
    use crate::error::{Action, FatalReason, RelayError};

    fn server(code: &str, message: &str) -> RelayError {
        RelayError::Server { sqlstate: Some(code.into()), message: message.into() }
    }

    #[test]
    fn an_undefined_object_is_the_slot_or_the_publication_by_the_command_that_met_it() {
        // 42704 at START_REPLICATION: the slot is gone
        let missing_slot =
            in_context(server("42704", "replication slot \"s\" does not exist"), Command::Start, "s");
        assert_eq!(missing_slot.action(), Action::Fatal(FatalReason::SlotMissing));
        assert!(missing_slot.to_string().contains("setup --recreate-slot"), "{missing_slot}");
        // 42704 while streaming: pgoutput met a change without the publication (dropped, then
        // perhaps created again by `setup`, which the slot never sees): the one remedy is named
        let dropped = in_context(server("42704", "publication \"p\" does not exist"), Command::Stream, "s");
        assert_eq!(dropped.action(), Action::Fatal(FatalReason::Publication));
        assert!(dropped.to_string().contains("setup --recreate-slot"), "{dropped}");
        // a slot another instance streams from: standby, not an error
        let busy =
            in_context(server("55006", "replication slot \"s\" is active for PID 7"), Command::Start, "s");
        assert_eq!(busy.action(), Action::Standby);
        // anything else keeps the general SQLSTATE policy
        let other = in_context(server("08006", "connection failure"), Command::Stream, "s");
        assert_eq!(other.action(), Action::Retry);
    }
}
