//! The stream's decisions ([`Feed`]) against the scripted sink, fed stream events by hand:
//! confirming only the contiguous acknowledged prefix, the in-flight bounds, the poison policy
//! under each setting, hold and resend, dead letters counted only once written, and idle
//! positions.

use std::time::{Duration, SystemTime};

use super::Feed;
use crate::checkpoint::TxnId;
use crate::config::{DEFAULT_MESSAGE_PREFIX, ReplicationConfig};
use crate::delivery::fixture::{Fixture, outbox_row};
use crate::lsn::Lsn;
use crate::outboxes::Outboxes;
use crate::sink::scripted::{Fault, ScriptedSink};
use crate::source::replication::decode::MessageKey;
use crate::source::replication::transport::WalEvent;

/// How long a test waits for a report before it fails.
const PATIENCE: Duration = Duration::from_secs(5);

/// An outbox message of the row `id` (see [`outbox_row`]: `!2` cannot map).
fn message(id: &str, transactional: bool) -> WalEvent {
    let row = outbox_row(id);
    let content = serde_json::json!({
        "id": row.id, "aggregate_type": row.aggregate_type, "aggregate_id": row.aggregate_id,
        "event_type": row.event_type, "payload": row.payload,
    });
    let content = serde_json::to_vec(&content).unwrap().into();
    WalEvent::Message { transactional, lsn: Lsn(1), prefix: DEFAULT_MESSAGE_PREFIX.into(), content }
}

/// One transaction of the events `ids`, committed at `end`, read as the session reads: only
/// while the feed reads on (a held event or a bound stops it before the Commit).
async fn txn(feed: &mut Feed<'_, ScriptedSink>, end: u64, ids: &[&str]) {
    let begin = WalEvent::Begin { commit_lsn: Lsn(end - 1), commit_time: SystemTime::now() };
    let events = std::iter::once(begin)
        .chain(ids.iter().map(|id| message(id, true)))
        .chain([WalEvent::Commit { end_lsn: Lsn(end) }]);
    for event in events {
        if !feed.reading() {
            return;
        }
        assert_eq!(feed.handle(event).await.unwrap(), None, "an idle position inside a transaction");
    }
}

/// Three one-event transactions, events 1, 2 and 3, committed at 100, 200 and 300.
async fn three_transactions(feed: &mut Feed<'_, ScriptedSink>) {
    for (end, id) in [(100, "1"), (200, "2"), (300, "3")] {
        txn(feed, end, &[id]).await;
    }
}

/// Settles the next position (passing over the stage's outcomes of none: a stall tick).
async fn settle_next(feed: &mut Feed<'_, ScriptedSink>) {
    let settled = async {
        loop {
            if let Some(settled) = feed.delivery.next().await.unwrap() {
                return settled;
            }
        }
    };
    let settled = tokio::time::timeout(PATIENCE, settled).await.expect("a report in time");
    feed.settled(settled);
}

/// What a feed borrows: a stage over the scripted sink, the default mapping, and the
/// replication settings (the in-flight bounds).
struct Rig {
    f: Fixture,
    outboxes: Outboxes,
    replication: ReplicationConfig,
}

impl Rig {
    fn new(on_poison: &str) -> Rig {
        Rig::with(on_poison, ReplicationConfig::default())
    }

    fn with(on_poison: &str, replication: ReplicationConfig) -> Rig {
        Rig::of(Fixture::new(on_poison), replication)
    }

    fn of(f: Fixture, replication: ReplicationConfig) -> Rig {
        let outboxes = Outboxes::new(&f.config);
        Rig { f, outboxes, replication }
    }

    /// A feed from position 0.
    async fn feed(&self) -> Feed<'_, ScriptedSink> {
        Feed::new(self.f.delivery::<TxnId>().await, Lsn(0), &self.outboxes, &self.replication)
    }
}

fn letter_ids(feed: &Feed<'_, ScriptedSink>) -> Vec<String> {
    feed.letters().iter().map(|l| l.id.clone()).collect()
}

#[tokio::test]
async fn only_the_contiguous_acknowledged_prefix_is_confirmed() {
    // given three transactions whose first record is acknowledged last
    let rig = Rig::new("dead_letter");
    rig.f.sink.script("1", [Fault::Delay(Duration::from_millis(50))]);
    let mut feed = rig.feed().await;
    three_transactions(&mut feed).await;
    // when the later two are acknowledged, nothing may be confirmed
    for _ in 0..2 {
        settle_next(&mut feed).await;
        assert_eq!(feed.advance(), None, "confirmed past an unacknowledged transaction");
    }
    // then the first's acknowledgement confirms all three at once
    settle_next(&mut feed).await;
    assert_eq!(feed.advance(), Some(Lsn(300)));
}

#[tokio::test]
async fn reading_stops_at_either_in_flight_bound() {
    // given records whose acknowledgements wait, and a bound of two records
    let rig = Rig::with("dead_letter", ReplicationConfig { max_in_flight_events: 2, ..Default::default() });
    for id in ["1", "2"] {
        rig.f.sink.script(id, [Fault::Hold]);
    }
    let mut feed = rig.feed().await;
    // when two are in flight, reading stops; once they are acknowledged, it goes on
    txn(&mut feed, 100, &["1"]).await;
    assert!(feed.reading());
    txn(&mut feed, 200, &["2"]).await;
    assert!(!feed.reading(), "read past max_in_flight_events");
    rig.f.sink.release();
    settle_next(&mut feed).await;
    assert!(feed.reading());
    // and a byte bound of one record's size stops reading after one record
    let rig = Rig::with("dead_letter", ReplicationConfig { max_in_flight_bytes: 1, ..Default::default() });
    rig.f.sink.script("3", [Fault::Hold]);
    let mut feed = rig.feed().await;
    assert!(feed.reading());
    txn(&mut feed, 300, &["3"]).await;
    assert!(!feed.reading(), "read past max_in_flight_bytes");
}

#[tokio::test]
async fn under_dead_letter_a_refused_record_counts_only_once_its_letter_is_written() {
    // given a transaction whose record Kafka refuses
    let rig = Rig::new("dead_letter");
    rig.f.sink.script("1", [Fault::Reject]);
    let mut feed = rig.feed().await;
    txn(&mut feed, 100, &["1"]).await;
    // when its report comes, the letter is to be written, and nothing is confirmed yet
    settle_next(&mut feed).await;
    assert_eq!(letter_ids(&feed), ["1"]);
    assert_eq!(feed.advance(), None, "confirmed before the dead letter was written");
    // then once written, the transaction is confirmed
    feed.letters_written();
    assert!(feed.letters().is_empty());
    assert_eq!(feed.advance(), Some(Lsn(100)));
}

#[tokio::test]
async fn under_dead_letter_a_row_that_cannot_map_is_a_letter_and_reading_goes_on() {
    let rig = Rig::new("dead_letter");
    let mut feed = rig.feed().await;
    txn(&mut feed, 100, &["!1", "2"]).await;
    assert_eq!(letter_ids(&feed), ["1"]);
    assert!(feed.reading());
    feed.letters_written();
    settle_next(&mut feed).await;
    assert_eq!(feed.advance(), Some(Lsn(100)));
    assert_eq!(rig.f.sink.sent(), ["2"]);
}

#[tokio::test]
async fn a_transaction_of_rows_that_cannot_map_is_confirmed_only_once_their_letters_are_written() {
    // given a transaction whose only row cannot map, its Commit handled
    let rig = Rig::new("dead_letter");
    let mut feed = rig.feed().await;
    txn(&mut feed, 100, &["!1"]).await;
    // then nothing is confirmed until its letter is written, however often the session asks
    assert_eq!(letter_ids(&feed), ["1"]);
    assert_eq!(feed.advance(), None);
    feed.letters_written();
    assert_eq!(feed.advance(), Some(Lsn(100)));
}

#[tokio::test]
async fn under_block_a_refused_record_holds_reading_and_confirmation_until_kafka_takes_it() {
    // given the block policy and the second transaction's record refused once
    let rig = Rig::new("block");
    rig.f.sink.script("2", [Fault::Reject]);
    let mut feed = rig.feed().await;
    three_transactions(&mut feed).await;
    // when the reports come, the first is confirmed alone, and reading stops at the held one
    for _ in 0..3 {
        settle_next(&mut feed).await;
    }
    assert_eq!(feed.advance(), Some(Lsn(100)));
    assert!(!feed.reading() && feed.letters().is_empty());
    // then the held record is sent again when due, taken, and the rest is confirmed
    tokio::time::timeout(PATIENCE, feed.delivery.retry_due()).await.unwrap();
    feed.delivery.retry_held().await.unwrap();
    settle_next(&mut feed).await;
    assert_eq!(feed.advance(), Some(Lsn(300)));
    assert!(feed.reading());
    assert_eq!(rig.f.sink.sent(), ["1", "2", "3", "2"]);
}

#[tokio::test]
async fn under_block_a_row_that_cannot_map_stops_reading_and_confirmation() {
    let rig = Rig::new("block");
    let mut feed = rig.feed().await;
    txn(&mut feed, 100, &["1", "!2"]).await;
    settle_next(&mut feed).await;
    assert!(!feed.reading());
    assert!(feed.letters().is_empty());
    assert_eq!(feed.advance(), None, "confirmed past a held row");
    assert!(rig.f.health.readiness().unwrap_err().contains("blocked at event 2"));
}

#[tokio::test]
async fn a_non_transactional_outbox_message_is_a_letter_confirmed_once_written() {
    let rig = Rig::new("dead_letter");
    let mut feed = rig.feed().await;
    let WalEvent::Message { content, prefix, .. } = message("7", false) else { unreachable!() };
    let forged = WalEvent::Message { transactional: false, lsn: Lsn(150), prefix, content };
    assert_eq!(feed.handle(forged).await.unwrap(), None);
    assert_eq!(letter_ids(&feed), ["7"]);
    assert!(!feed.letters()[0].signed, "a replay would send it under its id");
    assert_eq!(feed.advance(), None, "confirmed before the dead letter was written");
    feed.letters_written();
    assert_eq!(feed.advance(), Some(Lsn(150)));
    assert!(rig.f.sink.sent().is_empty(), "a non-transactional message is never published");
}

#[tokio::test]
async fn a_keepalive_is_confirmed_only_while_nothing_is_in_flight() {
    let rig = Rig::new("dead_letter");
    rig.f.sink.script("1", [Fault::Hold]);
    let mut feed = rig.feed().await;
    assert_eq!(feed.handle(WalEvent::KeepAlive { wal_end: Lsn(50) }).await.unwrap(), Some(Lsn(50)));
    txn(&mut feed, 100, &["1"]).await;
    assert_eq!(feed.handle(WalEvent::KeepAlive { wal_end: Lsn(500) }).await.unwrap(), None);
    rig.f.sink.release();
    settle_next(&mut feed).await;
    assert_eq!(feed.advance(), Some(Lsn(100)));
    assert_eq!(feed.handle(WalEvent::KeepAlive { wal_end: Lsn(500) }).await.unwrap(), Some(Lsn(500)));
}

#[tokio::test]
async fn each_outbox_numbers_its_own_events_and_maps_them_with_its_own_mapping() {
    use crate::record::Position;
    use crate::source::replication::decode::tests::{COLUMNS, insert, relation};
    // given two outboxes, the second with its own topic template
    let outboxes = serde_json::json!([
        {"name": "orders"},
        {"name": "ledger", "table": "ledger_outbox", "topic_template": "ledger.{event_type}"},
    ]);
    let rig = Rig::of(Fixture::with_outboxes("dead_letter", outboxes), ReplicationConfig::default());
    let mut feed = rig.feed().await;

    // when one transaction inserts into the first, the second, and the first again
    for (oid, table) in [(1, "outbox_events"), (2, "ledger_outbox")] {
        feed.handle(WalEvent::Data(relation(oid, "public", table, COLUMNS).into())).await.unwrap();
    }
    let row = |id| [Some(id), Some("order"), Some("o-1"), Some("Placed"), Some("{}"), None, None, None];
    feed.handle(WalEvent::Begin { commit_lsn: Lsn(99), commit_time: SystemTime::now() }).await.unwrap();
    for (oid, id) in [(1, "1"), (2, "1"), (1, "2")] {
        feed.handle(WalEvent::Data(insert(oid, &row(id)).into())).await.unwrap();
    }
    feed.handle(WalEvent::Commit { end_lsn: Lsn(100) }).await.unwrap();

    // then each record says its outbox, is numbered among its outbox's events, and has its
    // outbox's topic
    let sent: Vec<_> =
        rig.f.sink.records().into_iter().map(|r| (r.outbox.index(), r.id, r.topic, r.position)).collect();
    let at = |index| Some(Position::Stream { commit: Lsn(99), index });
    assert_eq!(
        sent,
        [
            (0, "1".to_string(), "outbox.event.order".to_string(), at(0)),
            (1, "1".to_string(), "ledger.Placed".to_string(), at(0)),
            (0, "2".to_string(), "outbox.event.order".to_string(), at(1)),
        ]
    );
    // and the transaction is confirmed only once all three are acknowledged
    for _ in 0..2 {
        settle_next(&mut feed).await;
    }
    assert_eq!(feed.advance(), None);
    settle_next(&mut feed).await;
    assert_eq!(feed.advance(), Some(Lsn(100)));
}

/// A transactional outbox message of the row `id`, with `digest`.
fn signed_message(id: &str, digest: Option<String>) -> WalEvent {
    let WalEvent::Message { content, prefix, .. } = message(id, true) else { unreachable!() };
    let mut object: serde_json::Value = serde_json::from_slice(&content).unwrap();
    object["digest"] = serde_json::json!(digest);
    let content = serde_json::to_vec(&object).unwrap().into();
    WalEvent::Message { transactional: true, lsn: Lsn(1), prefix, content }
}

#[tokio::test]
async fn with_a_message_key_only_messages_outbox_emit_signed_are_published() {
    // given a feed that checks messages with a key, and a message signed with it, one signed
    // with another key naming the same id, and one not signed at all
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("emit.key");
    std::fs::write(&file, format!("{}\n", "k".repeat(32))).unwrap();
    let key = MessageKey::new(&[b'k'; 32]).unwrap();
    let other = MessageKey::new(&[b'o'; 32]).unwrap();
    let replication = ReplicationConfig {
        message_signing_key_file: file.display().to_string(),
        ..ReplicationConfig::default()
    };
    let rig = Rig::with("dead_letter", replication);
    let mut feed = rig.feed().await;
    // when they come in one transaction, the forged ones first
    let events = [
        WalEvent::Begin { commit_lsn: Lsn(99), commit_time: SystemTime::now() },
        signed_message("1", Some(other.sign(&outbox_row("1")))),
        signed_message("2", None),
        signed_message("1", Some(key.sign(&outbox_row("1")))),
        WalEvent::Commit { end_lsn: Lsn(100) },
    ];
    for event in events {
        assert_eq!(feed.handle(event).await.unwrap(), None);
    }
    // then only the signed one is published; the others are letters, unsigned (a replay does
    // not send them unless vouched for), and the transaction is confirmed once all are settled
    assert_eq!(letter_ids(&feed), ["1", "2"]);
    assert!(feed.letters().iter().all(|l| !l.signed), "a forged message's letter is signed");
    assert!(feed.letters()[1].reason.contains("it carries no digest"), "{}", feed.letters()[1].reason);
    feed.letters_written();
    settle_next(&mut feed).await;
    assert_eq!(feed.advance(), Some(Lsn(100)));
    assert_eq!(rig.f.sink.sent(), ["1"]);
}

#[tokio::test]
async fn a_message_key_that_cannot_be_read_stops_the_relay_before_anything_is_published() {
    let replication = ReplicationConfig {
        message_signing_key_file: "/nonexistent/emit.key".into(),
        ..ReplicationConfig::default()
    };
    let rig = Rig::with("dead_letter", replication);
    let mut feed = rig.feed().await;
    let begin = WalEvent::Begin { commit_lsn: Lsn(99), commit_time: SystemTime::now() };
    feed.handle(begin).await.unwrap();
    let err = feed.handle(signed_message("1", None)).await.unwrap_err();
    assert!(err.to_string().contains("replication.message_signing_key_file"), "{err}");
    assert!(rig.f.sink.sent().is_empty());
}
