//! The polling claim's decisions against the scripted sink: what a claim releases, dead-letters
//! and holds under each poison policy, the held row sent again as it maps now, a claim that
//! never mixes rows Kafka holds with records it sends, and the claim's deadline.

use std::time::{Duration, Instant};

use super::super::claim::ClaimedRow;
use super::{Deadline, Row, Settlement, deliver, map};
use crate::config::{OutboxConfig, OutboxId};
use crate::delivery::Delivery;
use crate::delivery::fixture::{Fixture, outbox_row};
use crate::error::RelayError;
use crate::record::{Mapping, OutboxRow};
use crate::sink::scripted::{Fault, ScriptedSink};
use crate::table::RowAt;

/// How long a test waits for a claim to settle before it fails.
const PATIENCE: Duration = Duration::from_secs(5);

/// Claimed rows by id (see [`outbox_row`]: `!2` is row 2 when it cannot map), the n-th at
/// ctid `(0,n)`.
fn claimed(ids: &[&str]) -> Vec<Row> {
    let rows = ids
        .iter()
        .enumerate()
        .map(|(n, id)| ClaimedRow { at: at(id, n), raw: outbox_row(id), created_at: None, unread: None })
        .collect();
    map(&Mapping::new(&OutboxConfig::default()), rows, (1, 0), (OutboxId::default(), 1 << 20))
        .expect("no registry")
        .0
}

/// Where the `n`-th row of a claim, `id`, lies.
fn at(id: &str, n: usize) -> RowAt {
    RowAt { id: id.trim_start_matches('!').to_string(), tableoid: 16384, ctid: format!("(0,{n})") }
}

/// The ids of `rows`.
fn ids(rows: &[RowAt]) -> Vec<&str> {
    rows.iter().map(|r| r.id.as_str()).collect()
}

fn far() -> Deadline {
    Deadline { at: tokio::time::Instant::now() + PATIENCE, claim_timeout_ms: PATIENCE.as_millis() as u64 }
}

/// One claim of `ids`, settled.
async fn claim(
    delivery: &mut Delivery<'_, ScriptedSink, RowAt>,
    ids: &[&str],
    settled: &[&str],
) -> Settlement {
    let settled = settled.iter().enumerate().map(|(n, id)| at(id, 100 + n)).collect();
    let claim = deliver(delivery, claimed(ids), settled, far());
    tokio::time::timeout(PATIENCE, claim).await.expect("the claim settled in time").unwrap()
}

fn letters(settlement: &Settlement) -> Vec<&str> {
    settlement.letters.iter().map(|l| l.id.as_str()).collect()
}

#[tokio::test]
async fn under_dead_letter_a_claim_releases_what_kafka_took_and_dead_letters_the_rest() {
    // given a claim with a row that cannot map and a record Kafka refuses
    let f = Fixture::new("dead_letter");
    f.sink.script("3", [Fault::Reject]);
    f.sink.script("4", [Fault::Delay(Duration::from_millis(30))]);
    let mut delivery = f.delivery().await;
    // when it is delivered
    let settlement = claim(&mut delivery, &["1", "!2", "3", "4"], &[]).await;
    // then every record settled: the acknowledged rows are released, the others dead-lettered
    assert_eq!(ids(&settlement.release), ["1", "4"]);
    assert_eq!(letters(&settlement), ["2", "3"]);
    assert!(settlement.failed.is_none() && !settlement.again);
    assert_eq!(f.sink.sent(), ["1", "3", "4"]);
    assert!(!delivery.holding() && delivery.records() == 0);
}

#[tokio::test]
async fn under_block_nothing_after_a_row_that_cannot_map_is_sent_until_it_is_fixed() {
    // given the block policy and a row that cannot map between two good ones
    let f = Fixture::new("block");
    let mut delivery = f.delivery().await;
    // when the claim is delivered, only the row before it is sent and released
    let settlement = claim(&mut delivery, &["1", "!2", "3"], &[]).await;
    assert_eq!(ids(&settlement.release), ["1"]);
    assert!(settlement.letters.is_empty());
    assert_eq!(f.sink.sent(), ["1"]);
    assert_eq!(delivery.held_id(), Some("2"));
    // then the held row claimed again, still broken, is reported again and nothing is sent
    let again = claim(&mut delivery, &["!2"], &[]).await;
    assert!(again.release.is_empty() && again.letters.is_empty());
    assert_eq!(f.sink.sent(), ["1"]);
    assert!(f.health.readiness().unwrap_err().contains("blocked at event 2"));
    // and once its row is fixed, it is sent, released, and the hold ends
    let fixed = claim(&mut delivery, &["2"], &[]).await;
    assert_eq!(ids(&fixed.release), ["2"]);
    assert_eq!(f.sink.sent(), ["1", "2"]);
    assert!(!delivery.holding());
    assert_eq!(f.health.readiness(), Ok("active".into()));
}

#[tokio::test]
async fn under_block_a_refused_record_keeps_its_row_and_is_sent_again_until_kafka_takes_it() {
    // given the block policy and a record Kafka refuses twice
    let f = Fixture::new("block");
    f.sink.script("2", [Fault::Reject, Fault::Reject]);
    let mut delivery = f.delivery().await;
    // when the claim is delivered, the refused record's row stays, the others are released
    let settlement = claim(&mut delivery, &["1", "2", "3"], &[]).await;
    assert_eq!(ids(&settlement.release), ["1", "3"]);
    assert!(settlement.letters.is_empty(), "dead-lettered under block");
    assert_eq!(delivery.held_id(), Some("2"));
    // then each retry claims the held row alone and sends it again
    let refused = claim(&mut delivery, &["2"], &[]).await;
    assert!(refused.release.is_empty());
    assert!(delivery.holding());
    let taken = claim(&mut delivery, &["2"], &[]).await;
    assert_eq!(ids(&taken.release), ["2"]);
    assert!(!delivery.holding());
    assert_eq!(f.sink.sent(), ["1", "2", "3", "2", "2"]);
    assert_eq!(f.sink.written(), ["1", "3", "2"]);
}

#[tokio::test]
async fn a_held_row_dead_lettered_elsewhere_is_released_and_ends_the_hold() {
    // given a hold at a row that cannot map
    let f = Fixture::new("block");
    let mut delivery = f.delivery().await;
    claim(&mut delivery, &["!1"], &[]).await;
    assert_eq!(delivery.held_id(), Some("1"));
    // when the held row is claimed again and found settled (replication mode dead-lettered it)
    let settlement = claim(&mut delivery, &[], &["1"]).await;
    // then it is released unsent and the hold ends
    assert_eq!(ids(&settlement.release), ["1"]);
    assert!(!delivery.holding());
    assert!(f.sink.sent().is_empty());
}

#[tokio::test]
async fn a_claim_never_mixes_settled_rows_with_records_it_sends() {
    // given a claim whose first row is settled already and whose others are new
    let f = Fixture::new("dead_letter");
    let mut delivery = f.delivery().await;
    // when it is delivered
    let settlement = claim(&mut delivery, &["2", "3"], &["1"]).await;
    // then only the settled row is released, nothing is sent, and the rest is claimed again
    assert_eq!(ids(&settlement.release), ["1"]);
    assert!(settlement.again);
    assert!(f.sink.sent().is_empty());
    // and settled rows beside rows that cannot map (nothing to send) go together
    let settlement = claim(&mut delivery, &["!4"], &["5"]).await;
    assert_eq!((ids(&settlement.release), letters(&settlement)), (vec!["5"], vec!["4"]));
}

#[tokio::test]
async fn a_lost_acknowledgement_ends_the_session_after_the_acknowledged_rows_are_released() {
    // given a record written but not acknowledged, under either policy
    let f = Fixture::new("block");
    f.sink.script("2", [Fault::FailAfterWrite]);
    let mut delivery = f.delivery().await;
    // when the claim is delivered
    let settlement = claim(&mut delivery, &["1", "2", "3"], &[]).await;
    // then the others are released, and the failure ends the session (the row is read again)
    assert_eq!(ids(&settlement.release), ["1", "3"]);
    let failed = settlement.failed.expect("a transient failure");
    assert!(matches!(&failed, RelayError::Unacknowledged { event, .. } if event == "2"), "{failed}");
    assert!(!delivery.holding(), "a transient failure is not poison");
}

#[tokio::test]
async fn a_claim_waits_for_kafka_no_longer_than_its_deadline() {
    // given a record whose acknowledgement does not come
    let f = Fixture::new("dead_letter");
    f.sink.script("2", [Fault::Hold]);
    let mut delivery = f.delivery().await;
    // when the claim is delivered with a deadline 100 ms away
    let deadline =
        Deadline { at: tokio::time::Instant::now() + Duration::from_millis(100), claim_timeout_ms: 100 };
    let started = Instant::now();
    let claim = deliver(&mut delivery, claimed(&["1", "2"]), Vec::new(), deadline);
    let result = tokio::time::timeout(PATIENCE, claim).await.unwrap();
    // then it gives up at the deadline, so the claim is rolled back, naming the setting
    let error = result.unwrap_err();
    assert!(error.to_string().contains("polling.claim_timeout_ms (100 ms)"), "{error}");
    assert!(started.elapsed() >= Duration::from_millis(100));
    assert_eq!(delivery.records(), 1, "the held record is still in flight");
}

#[tokio::test]
async fn a_hold_is_carried_to_the_next_session() {
    // given a session that ends holding at a refused record
    let f = Fixture::new("block");
    f.sink.script("2", [Fault::Reject]);
    let carried = {
        let mut delivery = f.delivery().await;
        claim(&mut delivery, &["1", "2", "3"], &[]).await;
        assert!(delivery.holding());
        delivery.carry()
    };
    // when the next session's stage resumes from it
    let mut delivery = f.delivery().await;
    delivery.resume(Some(carried));
    // then it still holds at that row, claims it alone, and sends it again when due
    assert_eq!(delivery.held_id(), Some("2"));
    tokio::time::timeout(PATIENCE, delivery.retry_due()).await.expect("the retry comes");
    let taken = claim(&mut delivery, &["2"], &[]).await;
    assert_eq!(ids(&taken.release), ["2"]);
    assert!(!delivery.holding());
    assert_eq!(f.sink.sent(), ["1", "2", "3", "2"]);
}

#[tokio::test]
async fn rows_sharing_an_id_are_released_and_dead_lettered_each_where_it_lies() {
    // given a claim of two rows with the same id (the owner wrote one over the id trigger), the
    // second of which cannot map
    let f = Fixture::new("dead_letter");
    let mut delivery = f.delivery().await;
    // when it is delivered
    let settlement = claim(&mut delivery, &["5", "!5"], &[]).await;
    // then the first row alone is released and the second alone dead-lettered: neither
    // statement touches the other row, as one by id would
    assert_eq!(settlement.release, [at("5", 0)]);
    assert_eq!(settlement.lettered, [at("5", 1)]);
    assert_eq!(letters(&settlement), ["5"]);
}

#[tokio::test]
async fn a_row_over_max_row_bytes_is_a_letter_by_reference_and_the_rest_flow_on() {
    // given a claim whose second row came unread (over polling.max_row_bytes)
    let f = Fixture::new("dead_letter");
    let mut delivery = f.delivery().await;
    let rows = ["1", "2", "3"]
        .iter()
        .enumerate()
        .map(|(n, id)| ClaimedRow {
            at: at(id, n),
            raw: if *id == "2" {
                OutboxRow { id: Some("2".into()), ..OutboxRow::default() }
            } else {
                outbox_row(id)
            },
            created_at: None,
            unread: (*id == "2").then_some(3 << 20),
        })
        .collect();
    let (rows, _) =
        map(&Mapping::new(&OutboxConfig::default()), rows, (1, 0), (OutboxId::default(), 1 << 20)).unwrap();
    // when it is delivered
    let settlement = deliver(&mut delivery, rows, Vec::new(), far()).await.unwrap();
    // then the others are released, and the unread row is a letter of where it lies, unsigned,
    // saying why and what to raise; its row is deleted with the letter written
    assert_eq!(ids(&settlement.release), ["1", "3"]);
    assert_eq!(ids(&settlement.lettered), ["2"]);
    let letter = &settlement.letters[0];
    assert_eq!(letter.unread.as_ref(), Some(&at("2", 1)));
    assert!(!letter.signed);
    assert!(
        letter.reason.contains("3145728 bytes") && letter.reason.contains("polling.max_row_bytes (1048576)"),
        "{}",
        letter.reason
    );
    assert_eq!(f.sink.sent(), ["1", "3"]);
}

#[test]
fn rows_the_transforms_filter_out_come_apart_to_be_released_unsent() {
    // given a claim of three rows, the second of an excluded event type
    let rows = ["1", "2", "3"]
        .iter()
        .enumerate()
        .map(|(n, id)| {
            let mut raw = outbox_row(id);
            if *id == "2" {
                raw.event_type = Some("Cache.internal".into());
            }
            ClaimedRow { at: at(id, n), raw, created_at: None, unread: None }
        })
        .collect();
    let outbox = OutboxConfig {
        transforms: crate::config::TransformsConfig {
            exclude_event_types: vec!["*.internal".into()],
            ..Default::default()
        },
        ..OutboxConfig::default()
    };
    // when they are mapped
    let (mapped, filtered) =
        map(&Mapping::new(&outbox), rows, (1, 0), (OutboxId::default(), 1 << 20)).expect("no registry");
    // then the filtered row is neither sent nor dead-lettered: it is released apart
    assert_eq!(filtered, [at("2", 1)]);
    let ids: Vec<&str> = mapped
        .iter()
        .map(|(at, row)| (at.id.as_str(), row.is_ok()))
        .map(|(id, ok)| {
            assert!(ok, "row {id} maps");
            id
        })
        .collect();
    assert_eq!(ids, ["1", "3"]);
}
