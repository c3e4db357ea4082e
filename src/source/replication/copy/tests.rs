//! The first copy's chunk loop ([`Copying`], [`settle_all`]) against the scripted sink: what a
//! chunk counts, how many records are in flight, what settles before a row that cannot map,
//! and how a poison row holds the copy under each policy.

use std::time::{Duration, Instant};

use tokio::sync::watch;

use super::{Chunk, CopyReport, Copying, settle_all};
use crate::config::OutboxConfig;
use crate::dead_letter::DeadLetter;
use crate::delivery::fixture::{Fixture, outbox_row};
use crate::error::RelayError;
use crate::lsn::Lsn;
use crate::record::{Mapping, OutboxRow};
use crate::sink::scripted::{Fault, record};

/// How long a test waits for a chunk before it fails.
const PATIENCE: Duration = Duration::from_secs(5);

#[tokio::test]
async fn a_chunk_settles_whole_counting_what_kafka_took_and_what_it_refused() {
    // given a chunk whose second record Kafka refuses, under dead_letter
    let f = Fixture::new("dead_letter");
    f.sink.script("2", [Fault::Reject]);
    f.sink.script("3", [Fault::Delay(Duration::from_millis(30))]);
    let mut delivery = f.delivery::<u64>().await;
    for index in 1..=3u64 {
        assert!(delivery.send(index, record(&index.to_string()), Instant::now()).await.unwrap().is_none());
    }
    // when the chunk is awaited
    let (mut report, mut letters) = (CopyReport::default(), Vec::new());
    let (_stop, mut shutdown) = watch::channel(false);
    let settled = settle_all(&mut delivery, &mut report, &mut letters, &mut shutdown);
    tokio::time::timeout(PATIENCE, settled).await.unwrap().unwrap();
    // then every record settled: two published, the refused one's letter to write
    assert_eq!(report, CopyReport { published: 2, already_in_kafka: 0, dead_lettered: 1, filtered: 0 });
    assert_eq!(letters.iter().map(|l| l.id.as_str()).collect::<Vec<_>>(), ["2"]);
    assert_eq!(delivery.records(), 0);
}

#[tokio::test]
async fn a_refused_record_holds_the_copy_until_kafka_takes_it() {
    // given the block policy and a record Kafka refuses twice
    let f = Fixture::new("block");
    f.sink.script("2", [Fault::Reject, Fault::Reject]);
    let mut delivery = f.delivery::<u64>().await;
    for index in 1..=3u64 {
        delivery.send(index, record(&index.to_string()), Instant::now()).await.unwrap();
    }
    // when the chunk is awaited
    let (mut report, mut letters) = (CopyReport::default(), Vec::new());
    let (_stop, mut shutdown) = watch::channel(false);
    let settled = settle_all(&mut delivery, &mut report, &mut letters, &mut shutdown);
    tokio::time::timeout(PATIENCE, settled).await.unwrap().unwrap();
    // then it returned only once the record was sent again and taken: nothing dead-lettered
    assert_eq!(report, CopyReport { published: 3, already_in_kafka: 0, dead_lettered: 0, filtered: 0 });
    assert!(letters.is_empty());
    assert_eq!(f.sink.sent(), ["1", "2", "3", "2", "2"]);
    assert!(!delivery.holding());
}

#[tokio::test]
async fn a_row_that_cannot_map_holds_the_copy_until_shutdown() {
    // given the block policy and a row that cannot become a record
    let f = Fixture::new("block");
    let mut delivery = f.delivery::<u64>().await;
    let row = OutboxRow { id: Some("9".into()), ..OutboxRow::default() };
    delivery.unpublishable(0, DeadLetter::row(row, "no topic".into()));
    // when the copy awaits it and shutdown comes 100 ms later
    let (stop, mut shutdown) = watch::channel(false);
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(100)).await;
        stop.send(true).unwrap();
    });
    let (mut report, mut letters) = (CopyReport::default(), Vec::new());
    let started = Instant::now();
    let settled = settle_all(&mut delivery, &mut report, &mut letters, &mut shutdown);
    let result = tokio::time::timeout(PATIENCE, settled).await.unwrap();
    // then the copy waited for it, and ends interrupted with nothing sent or dead-lettered
    assert!(matches!(result, Err(RelayError::Interrupted)), "{result:?}");
    assert!(started.elapsed() >= Duration::from_millis(100));
    assert_eq!(report, CopyReport::default());
    assert!(letters.is_empty() && f.sink.sent().is_empty());
}

/// Copies the rows `ids` (see [`outbox_row`]) through `copying`, one at a time, returning the
/// records in flight after each.
async fn copy(copying: &mut Copying<'_, crate::sink::scripted::ScriptedSink>, ids: &[&str]) -> Vec<usize> {
    let (_stop, mut shutdown) = watch::channel(false);
    let mut in_flight = Vec::new();
    for id in ids {
        let row = copying.row(outbox_row(id), None, &mut shutdown);
        tokio::time::timeout(PATIENCE, row).await.unwrap().unwrap();
        in_flight.push(copying.delivery.records());
    }
    in_flight
}

#[tokio::test]
async fn a_chunk_is_settled_whole_before_the_next_row_is_read() {
    // given chunks of two rows, the first record acknowledged late
    let f = Fixture::new("dead_letter");
    f.sink.script("1", [Fault::Delay(Duration::from_millis(30))]);
    let mapping = Mapping::new(&OutboxConfig::default());
    let mut copying =
        Copying::new(f.delivery().await, &mapping, Lsn(100), Chunk { rows: 2, bytes: usize::MAX });
    // when five rows are copied
    let in_flight = copy(&mut copying, &["1", "2", "3", "4", "5"]).await;
    // then never more than a chunk is in flight: each full chunk settles before the next row
    assert_eq!(in_flight, [1, 0, 1, 0, 1]);
    assert_eq!(copying.report.published, 4);
    let (_stop, mut shutdown) = watch::channel(false);
    copying.settle(&mut shutdown).await.unwrap();
    assert_eq!(
        copying.report,
        CopyReport { published: 5, already_in_kafka: 0, dead_lettered: 0, filtered: 0 }
    );
    assert_eq!(f.sink.written(), ["1", "2", "3", "4", "5"]);
}

#[tokio::test]
async fn a_chunk_also_ends_at_its_byte_bound() {
    // given chunks of 2,000 rows but only a little more than two records' bytes
    let f = Fixture::new("dead_letter");
    let mapping = Mapping::new(&OutboxConfig::default());
    let mut one = Copying::new(f.delivery().await, &mapping, Lsn(100), Chunk { rows: 2, bytes: usize::MAX });
    copy(&mut one, &["0"]).await;
    let bytes = one.delivery.bytes();
    drop(one);
    let chunk = Chunk { rows: 2_000, bytes: bytes * 2 + 1 };
    let mut copying = Copying::new(f.delivery().await, &mapping, Lsn(100), chunk);
    // when five rows are copied
    let in_flight = copy(&mut copying, &["1", "2", "3", "4", "5"]).await;
    // then the chunk ends at the row that reached the byte bound: three rows at most in flight
    assert!(bytes > 0);
    assert_eq!(in_flight, [1, 2, 0, 1, 2]);
}

#[tokio::test]
async fn what_precedes_a_row_that_cannot_map_settles_before_its_dead_letter() {
    // given the dead_letter policy and a late acknowledgement before a row that cannot map
    let f = Fixture::new("dead_letter");
    f.sink.script("1", [Fault::Delay(Duration::from_millis(30))]);
    let mapping = Mapping::new(&OutboxConfig::default());
    let mut copying =
        Copying::new(f.delivery().await, &mapping, Lsn(100), Chunk { rows: 2_000, bytes: usize::MAX });
    // when the row after it cannot map
    let in_flight = copy(&mut copying, &["1", "!2", "3"]).await;
    // then the record before it was acknowledged first, and the row is a dead letter to write
    assert_eq!(in_flight, [1, 0, 1]);
    assert_eq!(
        copying.report,
        CopyReport { published: 1, already_in_kafka: 0, dead_lettered: 1, filtered: 0 }
    );
    assert_eq!(copying.letters.iter().map(|l| l.id.as_str()).collect::<Vec<_>>(), ["2"]);
}

#[tokio::test]
async fn under_block_nothing_after_a_row_that_cannot_map_is_copied() {
    // given the block policy and a row that cannot map, and shutdown 100 ms later
    let f = Fixture::new("block");
    let mapping = Mapping::new(&OutboxConfig::default());
    let mut copying =
        Copying::new(f.delivery().await, &mapping, Lsn(100), Chunk { rows: 2_000, bytes: usize::MAX });
    copy(&mut copying, &["1"]).await;
    let (stop, mut shutdown) = watch::channel(false);
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(100)).await;
        stop.send(true).unwrap();
    });
    // when the copy reaches it
    let held = copying.row(outbox_row("!2"), None, &mut shutdown);
    let result = tokio::time::timeout(PATIENCE, held).await.unwrap();
    // then what precedes it was published, and the copy held there until shutdown
    assert!(matches!(result, Err(RelayError::Interrupted)), "{result:?}");
    assert_eq!(copying.report.published, 1);
    assert!(copying.letters.is_empty());
    assert_eq!(f.sink.sent(), ["1"]);
}
