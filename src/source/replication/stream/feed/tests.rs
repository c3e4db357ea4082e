//! The stream's decisions ([`Feed`]) against the scripted sink, fed stream events by hand:
//! confirming only the contiguous acknowledged prefix, the in-flight bounds, the poison policy
//! under each setting, hold and resend, dead letters counted only once written, and idle
//! positions.

use std::time::{Duration, SystemTime};

use super::Feed;
use crate::checkpoint::TxnId;
use crate::config::{DEFAULT_MESSAGE_PREFIX, OutboxConfig, ReplicationConfig};
use crate::delivery::fixture::{Fixture, outbox_row};
use crate::delivery::record::Mapping;
use crate::lsn::Lsn;
use crate::observe::metrics::Clock;
use crate::sink::Reports;
use crate::sink::scripted::{Fault, ScriptedSink};
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

/// Settles the next report.
async fn settle_next(feed: &mut Feed<'_, ScriptedSink>, reports: &mut Reports) {
    let report = tokio::time::timeout(PATIENCE, reports.recv()).await.expect("a report in time");
    feed.settle(report.expect("the sink holds a sender"), &Clock::now()).await.unwrap();
}

/// The stage of `f` fed from position 0 with `replication`'s bounds.
fn feed<'a>(
    f: &'a Fixture,
    mapping: &'a Mapping,
    replication: &'a ReplicationConfig,
) -> Feed<'a, ScriptedSink> {
    let delivery = f.delivery::<TxnId>();
    Feed::new(delivery, Lsn(0), &OutboxConfig::default(), mapping, replication, "public.outbox".into())
}

fn letter_ids(feed: &Feed<'_, ScriptedSink>) -> Vec<String> {
    feed.letters().iter().map(|l| l.id.clone()).collect()
}

#[tokio::test]
async fn only_the_contiguous_acknowledged_prefix_is_confirmed() {
    // given three transactions whose first record is acknowledged last
    let f = Fixture::new("dead_letter");
    f.sink.script("1", [Fault::Delay(Duration::from_millis(50))]);
    let (mapping, replication) = (Mapping::new(&OutboxConfig::default()), ReplicationConfig::default());
    let mut feed = feed(&f, &mapping, &replication);
    let mut reports = feed.delivery.reports().await;
    for (end, id) in [(100, "1"), (200, "2"), (300, "3")] {
        txn(&mut feed, end, &[id]).await;
    }
    // when the later two are acknowledged, nothing may be confirmed
    for _ in 0..2 {
        settle_next(&mut feed, &mut reports).await;
        assert_eq!(feed.advance(), None, "confirmed past an unacknowledged transaction");
    }
    // then the first's acknowledgement confirms all three at once
    settle_next(&mut feed, &mut reports).await;
    assert_eq!(feed.advance(), Some(Lsn(300)));
}

#[tokio::test]
async fn reading_stops_at_either_in_flight_bound() {
    // given records whose acknowledgements wait, and a bound of two records
    let f = Fixture::new("dead_letter");
    for id in ["1", "2", "3"] {
        f.sink.script(id, [Fault::Hold]);
    }
    let mapping = Mapping::new(&OutboxConfig::default());
    let replication = ReplicationConfig { max_in_flight_events: 2, ..ReplicationConfig::default() };
    let mut feed = feed(&f, &mapping, &replication);
    let mut reports = feed.delivery.reports().await;
    // when two are in flight, reading stops; once they are acknowledged, it goes on
    txn(&mut feed, 100, &["1"]).await;
    assert!(feed.reading());
    txn(&mut feed, 200, &["2"]).await;
    assert!(!feed.reading(), "read past max_in_flight_events");
    f.sink.release();
    settle_next(&mut feed, &mut reports).await;
    assert!(feed.reading());
    // and a byte bound of one record's size stops reading after one record
    let replication = ReplicationConfig { max_in_flight_bytes: 1, ..ReplicationConfig::default() };
    let mut feed = self::feed(&f, &mapping, &replication);
    assert!(feed.reading());
    txn(&mut feed, 300, &["3"]).await;
    assert!(!feed.reading(), "read past max_in_flight_bytes");
}

#[tokio::test]
async fn under_dead_letter_a_refused_record_counts_only_once_its_letter_is_written() {
    // given a transaction whose record Kafka refuses
    let f = Fixture::new("dead_letter");
    f.sink.script("1", [Fault::Reject]);
    let (mapping, replication) = (Mapping::new(&OutboxConfig::default()), ReplicationConfig::default());
    let mut feed = feed(&f, &mapping, &replication);
    let mut reports = feed.delivery.reports().await;
    txn(&mut feed, 100, &["1"]).await;
    // when its report comes, the letter is to be written, and nothing is confirmed yet
    settle_next(&mut feed, &mut reports).await;
    assert_eq!(letter_ids(&feed), ["1"]);
    assert_eq!(feed.advance(), None, "confirmed before the dead letter was written");
    // then once written, the transaction is confirmed
    feed.letters_written();
    assert!(feed.letters().is_empty());
    assert_eq!(feed.advance(), Some(Lsn(100)));
}

#[tokio::test]
async fn under_dead_letter_a_row_that_cannot_map_is_a_letter_and_reading_goes_on() {
    let f = Fixture::new("dead_letter");
    let (mapping, replication) = (Mapping::new(&OutboxConfig::default()), ReplicationConfig::default());
    let mut feed = feed(&f, &mapping, &replication);
    let mut reports = feed.delivery.reports().await;
    txn(&mut feed, 100, &["!1", "2"]).await;
    assert_eq!(letter_ids(&feed), ["1"]);
    assert!(feed.reading());
    feed.letters_written();
    settle_next(&mut feed, &mut reports).await;
    assert_eq!(feed.advance(), Some(Lsn(100)));
    assert_eq!(f.sink.sent(), ["2"]);
}

#[tokio::test]
async fn under_block_a_refused_record_holds_reading_and_confirmation_until_kafka_takes_it() {
    // given the block policy and the second transaction's record refused once
    let f = Fixture::new("block");
    f.sink.script("2", [Fault::Reject]);
    let (mapping, replication) = (Mapping::new(&OutboxConfig::default()), ReplicationConfig::default());
    let mut feed = feed(&f, &mapping, &replication);
    let mut reports = feed.delivery.reports().await;
    for (end, id) in [(100, "1"), (200, "2"), (300, "3")] {
        txn(&mut feed, end, &[id]).await;
    }
    // when the reports come, the first is confirmed alone, and reading stops at the held one
    for _ in 0..3 {
        settle_next(&mut feed, &mut reports).await;
    }
    assert_eq!(feed.advance(), Some(Lsn(100)));
    assert!(!feed.reading() && feed.letters().is_empty());
    // then the held record is sent again when due, taken, and the rest is confirmed
    tokio::time::timeout(PATIENCE, feed.delivery.retry_due()).await.unwrap();
    feed.delivery.retry_held().await;
    settle_next(&mut feed, &mut reports).await;
    assert_eq!(feed.advance(), Some(Lsn(300)));
    assert!(feed.reading());
    assert_eq!(f.sink.sent(), ["1", "2", "3", "2"]);
}

#[tokio::test]
async fn under_block_a_row_that_cannot_map_stops_reading_and_confirmation() {
    let f = Fixture::new("block");
    let (mapping, replication) = (Mapping::new(&OutboxConfig::default()), ReplicationConfig::default());
    let mut feed = feed(&f, &mapping, &replication);
    let mut reports = feed.delivery.reports().await;
    txn(&mut feed, 100, &["1", "!2"]).await;
    settle_next(&mut feed, &mut reports).await;
    assert!(!feed.reading());
    assert!(feed.letters().is_empty());
    assert_eq!(feed.advance(), None, "confirmed past a held row");
    assert!(f.health.readiness().unwrap_err().contains("blocked at event 2"));
}

#[tokio::test]
async fn a_non_transactional_outbox_message_is_a_letter_confirmed_once_written() {
    let f = Fixture::new("dead_letter");
    let (mapping, replication) = (Mapping::new(&OutboxConfig::default()), ReplicationConfig::default());
    let mut feed = feed(&f, &mapping, &replication);
    let WalEvent::Message { content, prefix, .. } = message("7", false) else { unreachable!() };
    let forged = WalEvent::Message { transactional: false, lsn: Lsn(150), prefix, content };
    assert_eq!(feed.handle(forged).await.unwrap(), None);
    assert_eq!(letter_ids(&feed), ["7"]);
    assert_eq!(feed.advance(), None, "confirmed before the dead letter was written");
    feed.letters_written();
    assert_eq!(feed.advance(), Some(Lsn(150)));
    assert!(f.sink.sent().is_empty(), "a non-transactional message is never published");
}

#[tokio::test]
async fn a_keepalive_is_confirmed_only_while_nothing_is_in_flight() {
    let f = Fixture::new("dead_letter");
    f.sink.script("1", [Fault::Hold]);
    let (mapping, replication) = (Mapping::new(&OutboxConfig::default()), ReplicationConfig::default());
    let mut feed = feed(&f, &mapping, &replication);
    let mut reports = feed.delivery.reports().await;
    assert_eq!(feed.handle(WalEvent::KeepAlive { wal_end: Lsn(50) }).await.unwrap(), Some(Lsn(50)));
    txn(&mut feed, 100, &["1"]).await;
    assert_eq!(feed.handle(WalEvent::KeepAlive { wal_end: Lsn(500) }).await.unwrap(), None);
    f.sink.release();
    settle_next(&mut feed, &mut reports).await;
    assert_eq!(feed.advance(), Some(Lsn(100)));
    assert_eq!(feed.handle(WalEvent::KeepAlive { wal_end: Lsn(500) }).await.unwrap(), Some(Lsn(500)));
}
