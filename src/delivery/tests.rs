//! The delivery stage against the scripted sink: settled outcomes by position, the in-flight
//! counts, the poison policy under each setting, hold and resend, and (with the stream's
//! tracker) confirming only the contiguous acknowledged prefix.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::watch;

use super::fixture::Fixture;
use super::{Delivery, Settled, prologue};
use crate::checkpoint::{Tracker, TxnId};
use crate::dead_letter::DeadLetter;
use crate::error::RelayError;
use crate::lsn::Lsn;
use crate::observe::metrics::{Clock, Mode};
use crate::observe::trace::{SpanData, TRACEPARENT, TraceContext, Tracer, Value};
use crate::readback::Lookback;
use crate::record::OutboxRow;
use crate::sink::Sink;
use crate::sink::scripted::{Fault, Lifecycle, ScriptedSink, record};

/// How long a test waits for the stage to settle before it fails.
const PATIENCE: Duration = Duration::from_secs(5);

/// The next position settled (the stage's outcomes of no position, a stall tick or a resend,
/// are passed over); `None` once nothing is in flight and nothing is held.
async fn next<P: Clone>(
    delivery: &mut Delivery<'_, ScriptedSink, P>,
) -> Result<Option<Settled<P>>, RelayError> {
    let step = async {
        loop {
            if let Some(settled) = delivery.next().await? {
                return Ok(Some(settled));
            }
            if delivery.records() == 0 && !delivery.holding() {
                return Ok(None);
            }
        }
    };
    tokio::time::timeout(PATIENCE, step).await.expect("the stage settled nothing in time")
}

/// Every outcome until nothing is in flight and nothing is held.
async fn settle_all<P: Clone>(delivery: &mut Delivery<'_, ScriptedSink, P>) -> Vec<Settled<P>> {
    let mut settled = Vec::new();
    while delivery.records() > 0 || delivery.holding() {
        settled.extend(next(delivery).await.unwrap());
    }
    settled
}

fn acked<P: Copy>(settled: &[Settled<P>]) -> Vec<P> {
    settled.iter().filter_map(|s| if let Settled::Acked(p) = s { Some(*p) } else { None }).collect()
}

async fn send_all(delivery: &mut Delivery<'_, ScriptedSink, u32>, ids: &[u32]) {
    for id in ids {
        let settled = delivery.send(*id, record(&id.to_string()), Instant::now()).await.unwrap();
        assert!(settled.is_none(), "nothing is read back: every record is sent");
    }
}

#[tokio::test]
async fn records_settle_by_position_and_in_flight_counts_records_and_bytes() {
    // given a stage whose second record's acknowledgement is held
    let f = Fixture::new("dead_letter");
    f.sink.script("2", [Fault::Hold]);
    let mut delivery = f.delivery().await;
    // when three records are sent
    send_all(&mut delivery, &[1, 2, 3]).await;
    let size = record("1").size();
    assert_eq!((delivery.records(), delivery.bytes()), (3, 3 * size));
    // then the two acknowledged settle by their positions, and only the held one stays counted
    let mut settled = vec![next(&mut delivery).await.unwrap().unwrap()];
    settled.push(next(&mut delivery).await.unwrap().unwrap());
    assert_eq!(acked(&settled), [1, 3]);
    assert_eq!((delivery.records(), delivery.bytes()), (1, size));
    f.sink.release();
    assert_eq!(acked(&settle_all(&mut delivery).await), [2]);
    assert_eq!((delivery.records(), delivery.bytes()), (0, 0));
    assert_eq!(f.sink.written(), ["1", "2", "3"]);
}

#[tokio::test]
async fn a_held_response_is_a_stall_until_it_comes() {
    // given a record whose acknowledgement is held, and a stall warning after 100 ms
    let f = Fixture::new("dead_letter");
    f.sink.script("1", [Fault::Hold]);
    let mut delivery = f.delivery().await;
    send_all(&mut delivery, &[1]).await;
    // when nothing is acknowledged for longer than that
    tokio::time::sleep(Duration::from_millis(150)).await;
    delivery.check_stall();
    // then readiness says Kafka stalled, and the record is still in flight
    let stalled = f.health.readiness().unwrap_err();
    assert!(stalled.contains("Kafka has acknowledged nothing"), "{stalled}");
    assert_eq!(delivery.records(), 1);
    // and once it is acknowledged, the stall is over
    f.sink.release();
    assert_eq!(acked(&settle_all(&mut delivery).await), [1]);
    delivery.check_stall();
    assert_eq!(f.health.readiness(), Ok("active".into()));
}

#[tokio::test]
async fn idling_before_records_are_sent_is_no_stall() {
    // given a stage that settled everything, then had nothing to send for longer than the
    // stall warning (a polling session between claims, a hold before its resend)
    let f = Fixture::new("dead_letter");
    let mut delivery = f.delivery().await;
    send_all(&mut delivery, &[1]).await;
    assert_eq!(acked(&settle_all(&mut delivery).await), [1]);
    delivery.check_stall();
    tokio::time::sleep(Duration::from_millis(150)).await;
    // when a record is sent and checked at once, its acknowledgement held
    f.sink.script("2", [Fault::Hold]);
    send_all(&mut delivery, &[2]).await;
    delivery.check_stall();
    // then that is no stall: the silence began with the send
    assert_eq!(f.health.readiness(), Ok("active".into()));
    f.sink.release();
    assert_eq!(acked(&settle_all(&mut delivery).await), [2]);
}

#[tokio::test]
async fn a_refused_record_is_dead_lettered_under_dead_letter() {
    let f = Fixture::new("dead_letter");
    f.sink.script("2", [Fault::Reject]);
    let mut delivery = f.delivery().await;
    send_all(&mut delivery, &[1, 2, 3]).await;
    let settled = settle_all(&mut delivery).await;
    assert_eq!(acked(&settled), [1, 3]);
    let letters: Vec<&DeadLetter> = settled
        .iter()
        .filter_map(|s| if let Settled::DeadLettered(2, l) = s { Some(&**l) } else { None })
        .collect();
    assert_eq!(letters.len(), 1, "{settled:?}");
    assert_eq!(letters[0].id, "2");
    assert!(letters[0].reason.contains("size"), "{}", letters[0].reason);
    assert!(!delivery.holding());
    assert_eq!(f.sink.sent(), ["1", "2", "3"], "a dead-lettered record is not sent again");
}

#[tokio::test]
async fn a_refused_record_is_held_and_sent_again_under_block_until_kafka_takes_it() {
    // given the block policy and a record Kafka refuses twice
    let f = Fixture::new("block");
    f.sink.script("2", [Fault::Reject, Fault::Reject]);
    let mut delivery = f.delivery().await;
    send_all(&mut delivery, &[1, 2, 3]).await;
    // when the reports come
    let mut settled = Vec::new();
    while settled.len() < 3 {
        settled.extend(next(&mut delivery).await.unwrap());
    }
    // then the refused record is held, readiness says so, and the others settle
    assert!(matches!(settled[1], Settled::Held(2)), "{settled:?}");
    assert_eq!(acked(&settled), [1, 3]);
    assert!(delivery.holding());
    let blocked = f.health.readiness().unwrap_err();
    assert!(blocked.contains("blocked at event 2"), "{blocked}");
    // and it is sent again at backoff until taken, then settles acknowledged and the hold ends
    assert_eq!(acked(&settle_all(&mut delivery).await), [2]);
    assert_eq!(f.sink.sent(), ["1", "2", "3", "2", "2"]);
    assert_eq!(f.sink.written(), ["1", "3", "2"]);
    assert!(!delivery.holding());
    assert_eq!(f.health.readiness(), Ok("active".into()));
}

#[tokio::test]
async fn held_records_are_sent_again_in_the_order_they_were_first_sent() {
    // given the block policy and two records Kafka refuses, the first one's refusal reported last
    let f = Fixture::new("block");
    f.sink.script("1", [Fault::Hold]);
    f.sink.script("2", [Fault::Reject]);
    let mut delivery = f.delivery().await;
    send_all(&mut delivery, &[1, 2]).await;
    let second = next(&mut delivery).await.unwrap();
    assert!(matches!(second, Some(Settled::Held(2))), "{second:?}");
    f.sink.reject_held();
    let first = next(&mut delivery).await.unwrap();
    assert!(matches!(first, Some(Settled::Held(1))), "{first:?}");
    // then the hold is at the first one sent, and it is sent again first
    assert_eq!(delivery.held_id(), Some("1"));
    assert!(f.health.readiness().unwrap_err().contains("blocked at event 1"));
    assert_eq!(acked(&settle_all(&mut delivery).await), [1, 2]);
    assert_eq!(f.sink.sent(), ["1", "2", "1", "2"]);
    assert_eq!(f.sink.written(), ["1", "2"]);
}

#[tokio::test]
async fn a_row_that_cannot_map_is_dead_lettered_or_held_by_the_policy() {
    let letter =
        || DeadLetter::row(OutboxRow { id: Some("7".into()), ..OutboxRow::default() }, "no topic".into());
    let f = Fixture::new("dead_letter");
    let mut delivery = f.delivery::<u32>().await;
    assert!(matches!(delivery.unpublishable(7, letter()), Settled::DeadLettered(7, l) if l.id == "7"));
    assert!(!delivery.holding());

    let f = Fixture::new("block");
    let mut delivery = f.delivery::<u32>().await;
    assert!(matches!(delivery.unpublishable(7, letter()), Settled::Held(7)));
    // held for good: reported again at each retry, never sent, never released
    for _ in 0..6 {
        let step =
            tokio::time::timeout(PATIENCE, delivery.next()).await.expect("a retry or a stall tick in time");
        assert!(step.unwrap().is_none());
        assert!(delivery.holding());
    }
    assert!(f.sink.sent().is_empty());
    assert!(f.health.readiness().unwrap_err().contains("blocked at event 7"));
}

#[tokio::test]
async fn a_lost_acknowledgement_ends_the_session() {
    // a record written but not acknowledged: the source must send it again from its position
    let f = Fixture::new("block");
    f.sink.script("1", [Fault::FailAfterWrite]);
    let mut delivery = f.delivery().await;
    send_all(&mut delivery, &[1]).await;
    let error = next(&mut delivery).await.unwrap_err();
    assert!(matches!(&error, RelayError::Unacknowledged { event, .. } if event == "1"), "{error}");
    assert!(!delivery.holding(), "a transient failure is not poison");
}

/// Three one-event transactions committed at 100, 200 and 300, their records sent in order.
async fn stream_of_three(
    delivery: &mut Delivery<'_, ScriptedSink, TxnId>,
    tracker: &mut Tracker,
) -> Vec<TxnId> {
    let mut txns = Vec::new();
    for (i, end) in [100u64, 200, 300].into_iter().enumerate() {
        let txn = tracker.begin();
        tracker.sent(txn);
        assert!(delivery.send(txn, record(&(i + 1).to_string()), Instant::now()).await.unwrap().is_none());
        tracker.commit(txn, Lsn(end));
        txns.push(txn);
    }
    txns
}

#[tokio::test]
async fn only_the_contiguous_acknowledged_prefix_is_confirmed() {
    // given three transactions whose first record is acknowledged last
    let f = Fixture::new("dead_letter");
    f.sink.script("1", [Fault::Delay(Duration::from_millis(50))]);
    let mut delivery = f.delivery().await;
    let mut tracker = Tracker::new(Lsn(0));
    let txns = stream_of_three(&mut delivery, &mut tracker).await;
    // when the later two are acknowledged, nothing may be confirmed
    for _ in 0..2 {
        let Some(Settled::Acked(txn)) = next(&mut delivery).await.unwrap() else { panic!() };
        assert_ne!(txn, txns[0]);
        tracker.acked(txn);
        assert_eq!(tracker.advance(), None, "confirmed past an unacknowledged transaction");
    }
    // then the first's acknowledgement confirms all three at once
    let Some(Settled::Acked(txn)) = next(&mut delivery).await.unwrap() else { panic!() };
    tracker.acked(txn);
    assert_eq!(tracker.advance(), Some(Lsn(300)));
}

#[tokio::test]
async fn a_held_transaction_stops_confirmation_until_its_record_is_taken() {
    // given the block policy and the second transaction's record refused once
    let f = Fixture::new("block");
    f.sink.script("2", [Fault::Reject]);
    let mut delivery = f.delivery().await;
    let mut tracker = Tracker::new(Lsn(0));
    stream_of_three(&mut delivery, &mut tracker).await;
    // when every report is handled (the held record sent again and taken)
    let mut confirmed = Vec::new();
    while delivery.records() > 0 || delivery.holding() {
        match next(&mut delivery).await.unwrap() {
            Some(Settled::Acked(txn)) => tracker.acked(txn),
            Some(Settled::Held(_)) | None => {}
            Some(Settled::DeadLettered(..)) => panic!("dead-lettered under block"),
        }
        confirmed.extend(tracker.advance());
    }
    // then the first transaction was confirmed alone while the second was held, and the rest after
    assert_eq!(confirmed, [Lsn(100), Lsn(300)]);
    assert_eq!(f.sink.written(), ["1", "3", "2"]);
}

#[tokio::test]
async fn with_kafka_transactions_an_acknowledged_record_settles_only_at_its_commit() {
    let f = Fixture::transactional("dead_letter");
    let mut delivery = f.delivery().await;
    send_all(&mut delivery, &[1, 2]).await;
    assert!(delivery.in_transaction() && !delivery.commit_due(false), "two records, a bound of three");
    assert!(delivery.commit_due(true), "an idle source commits");
    // the acknowledgements arrive, and settle nothing yet
    assert!(settle_all(&mut delivery).await.is_empty());
    send_all(&mut delivery, &[3]).await;
    assert!(delivery.commit_due(false), "three records reach kafka.transaction_max_events");
    assert!(settle_all(&mut delivery).await.is_empty());
    // the commit settles all three, in order, and makes them visible at once
    assert_eq!(acked(&delivery.commit(&Clock::now()).await.unwrap()), [1, 2, 3]);
    assert_eq!(f.sink.commits(), [vec!["1", "2", "3"]]);
    assert!(!delivery.in_transaction() && delivery.commit(&Clock::now()).await.unwrap().is_empty());
    // the next record begins the next transaction
    send_all(&mut delivery, &[4]).await;
    settle_all(&mut delivery).await;
    assert_eq!(acked(&delivery.commit(&Clock::now()).await.unwrap()), [4]);
    assert_eq!(f.sink.commits().len(), 2);
}

#[tokio::test]
async fn with_kafka_transactions_a_refused_record_aborts_and_the_next_session_dead_letters_it_unsent() {
    let f = Fixture::transactional("dead_letter");
    f.sink.script("2", [Fault::Reject]);
    {
        let mut delivery = f.delivery::<u32>().await;
        send_all(&mut delivery, &[1, 2, 3]).await;
        let mut error = None;
        while delivery.records() > 0 {
            if let Err(e) = next(&mut delivery).await {
                error = Some(e);
            }
        }
        // the session ends: nothing of the transaction was settled or committed
        let error = error.expect("the refusal ends the session").to_string();
        assert!(error.contains("refused event 2") && error.contains("aborted"), "{error}");
        assert!(f.sink.commits().is_empty());
        f.sink.abandon();
    }
    // the next session reads the same events again: 2 is dead-lettered without being sent
    let mut delivery = f.delivery::<u32>().await;
    let sent_before = f.sink.sent().len();
    let mut settled = Vec::new();
    for id in [1u32, 2, 3] {
        settled.extend(delivery.send(id, record(&id.to_string()), Instant::now()).await.unwrap());
    }
    assert!(matches!(settled.as_slice(), [Settled::DeadLettered(2, letter)] if letter.id == "2"));
    assert_eq!(f.sink.sent()[sent_before..], ["1", "3"]);
    settle_all(&mut delivery).await;
    assert_eq!(acked(&delivery.commit(&Clock::now()).await.unwrap()), [1, 3]);
    assert_eq!(f.sink.commits(), [vec!["1", "3"]], "the aborted transaction's records stay invisible");
    // remembered once: a third session would send it again
    assert!(f.dead_letters.refused_before(&record("2")).is_none());
}

#[tokio::test]
async fn with_kafka_transactions_under_block_a_refused_record_is_not_remembered() {
    let f = Fixture::transactional("block");
    f.sink.script("1", [Fault::Reject]);
    let mut delivery = f.delivery::<u32>().await;
    send_all(&mut delivery, &[1]).await;
    let error = next(&mut delivery).await.unwrap_err().to_string();
    assert!(error.contains("sent again after a backoff"), "{error}");
    assert!(!delivery.holding(), "the session ends instead of holding");
    assert!(f.dead_letters.refused_before(&record("1")).is_none());
}

#[tokio::test]
async fn a_failed_activate_opens_no_stage_and_the_next_sessions_prologue_opens_one() {
    // given a transactional sink whose activation fails once (it could not fence the producers
    // before it), and the read-back off (the scripted sink has no topics to read)
    let mut f = Fixture::transactional("dead_letter");
    f.config.dedup.enabled = false;
    f.sink.fail(Lifecycle::Activate, 1);
    let (_stop, shutdown) = watch::channel(false);
    let identities = ["system/db/public.outbox_events".to_string()];
    let lookback = (Mode::Replication, Lookback::Everything);
    // when a session's prologue runs
    let failed = prologue(&mut f.sink, &identities, &f.config, lookback, &f.pulse, &shutdown).await;
    // then it ends with the sink's error, the identities set before the activation was tried
    let Err(error) = failed else { panic!("a failed activation opened a stage") };
    assert!(error.to_string().contains("Activate failed"), "{error}");
    assert_eq!(f.sink.sources(), [Arc::from(identities[0].as_str())]);
    // and the next session's prologue opens a stage that sends and commits
    let opened = prologue(&mut f.sink, &identities, &f.config, lookback, &f.pulse, &shutdown).await.unwrap();
    let stage = (&f.dead_letters, &f.config.kafka);
    let mut delivery = Delivery::<_, u32>::open(&f.sink, opened, stage, &f.pulse, Mode::Replication).await;
    send_all(&mut delivery, &[1]).await;
    assert!(settle_all(&mut delivery).await.is_empty());
    assert_eq!(acked(&delivery.commit(&Clock::now()).await.unwrap()), [1]);
}

#[tokio::test]
async fn with_kafka_transactions_a_failed_commit_settles_nothing() {
    // given two records Kafka acknowledged in the open transaction
    let f = Fixture::transactional("dead_letter");
    let mut delivery = f.delivery::<u32>().await;
    send_all(&mut delivery, &[1, 2]).await;
    assert!(settle_all(&mut delivery).await.is_empty());
    // when the commit fails
    f.sink.fail(Lifecycle::Commit, 1);
    let error = delivery.commit(&Clock::now()).await.unwrap_err();
    // then the session ends with that error, no position settled (none is released: the next
    // session sends them again) and nothing became visible to read_committed readers
    assert!(error.to_string().contains("Commit failed"), "{error}");
    assert!(f.sink.commits().is_empty());
}

#[tokio::test]
async fn with_kafka_transactions_a_transaction_that_cannot_begin_sends_nothing() {
    let f = Fixture::transactional("dead_letter");
    f.sink.fail(Lifecycle::Begin, 1);
    let mut delivery = f.delivery::<u32>().await;
    let error = delivery.send(1, record("1"), Instant::now()).await.unwrap_err();
    assert!(error.to_string().contains("Begin failed"), "{error}");
    assert!(f.sink.sent().is_empty());
    assert_eq!(delivery.records(), 0);
}

#[tokio::test]
async fn the_stage_sends_a_held_record_again_itself_when_due() {
    // given the block policy and a record Kafka refuses once
    let f = Fixture::new("block");
    f.sink.script("1", [Fault::Reject]);
    let mut delivery = f.delivery::<u32>().await;
    send_all(&mut delivery, &[1]).await;
    assert!(matches!(next(&mut delivery).await.unwrap(), Some(Settled::Held(1))));
    // when the stage runs on its own (the stream's and the copy's way)
    let settled = async {
        loop {
            if let Some(settled) = delivery.next().await.unwrap() {
                return settled;
            }
        }
    };
    let (settled, ()) =
        tokio::time::timeout(PATIENCE, async { tokio::join!(settled, f.sink.reached(2)) }).await.unwrap();
    // then it sent the record again at the hold's backoff, and Kafka took it
    assert!(matches!(settled, Settled::Acked(1)), "{settled:?}");
    assert_eq!(f.sink.written(), ["1"]);
}

#[tokio::test]
async fn a_source_that_claims_held_rows_again_is_not_sent_them_by_the_stage() {
    // given polling's stage (it claims a held row again itself) held at a refused record
    let f = Fixture::new("block");
    f.sink.script("1", [Fault::Reject]);
    let mut delivery = f.delivery::<u32>().await;
    delivery.reclaims_held();
    send_all(&mut delivery, &[1]).await;
    assert!(matches!(next(&mut delivery).await.unwrap(), Some(Settled::Held(1))));
    // when the stage runs for ten times the hold's longest backoff (20 ms)
    let ran = tokio::time::timeout(Duration::from_millis(200), async {
        loop {
            assert!(delivery.next().await.unwrap().is_none());
        }
    });
    assert!(ran.await.is_err());
    // then nothing was sent again: the retry is the claim's
    assert_eq!(f.sink.sent(), ["1"]);
    assert!(delivery.holding());
}

/// A stage whose spans go to a queue the test reads (the process's tracer stays uninstalled).
fn traced<'a>(delivery: &mut Delivery<'a, ScriptedSink, u32>) -> tokio::sync::mpsc::Receiver<SpanData> {
    let (queue, spans) = tokio::sync::mpsc::channel(16);
    let tracer: &'static Tracer = Box::leak(Box::new(Tracer::with_queue(0.0, queue)));
    delivery.spans =
        Some(super::traced::Spans::new(tracer, "replication", ["orders".to_string()].into_iter().collect()));
    spans
}

#[tokio::test]
async fn a_sampled_record_carries_its_publish_span_which_ends_at_the_acknowledgement() {
    // given a traced stage, a record with a sampled traceparent and one with an unsampled one
    let f = Fixture::new("dead_letter");
    let mut delivery = f.delivery().await;
    let mut spans = traced(&mut delivery);
    let parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let unsampled = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00";
    for (position, header) in [(1, parent), (2, unsampled)] {
        let mut event = record(&position.to_string());
        event.row_headers.push((TRACEPARENT.into(), header.into()));
        delivery.send(position, event, Instant::now()).await.unwrap();
    }
    // when both are acknowledged
    assert_eq!(acked(&settle_all(&mut delivery).await), [1, 2]);
    // then the sampled one went out naming a child span of its parent, which is exported
    let sent = f.sink.records();
    let header = |r: &crate::record::KafkaRecord| {
        r.row_headers.iter().find(|(k, _)| k == TRACEPARENT).unwrap().1.clone()
    };
    let child = TraceContext::parse(&header(&sent[0])).unwrap();
    let parent = TraceContext::parse(parent).unwrap();
    assert_eq!((child.trace_id, child.sampled), (parent.trace_id, true));
    assert_ne!(child.span_id, parent.span_id);
    let span = spans.try_recv().unwrap();
    assert_eq!((span.context, span.parent), (child, Some(parent.span_id)));
    assert!(span.end >= span.start);
    assert!(span.attributes.contains(&("messaging.kafka.offset", Value::Int(0))), "{span:?}");
    assert!(span.attributes.contains(&("outbox_relay.outbox", Value::Str("orders".into()))));
    // and the unsampled one went out unchanged, with no span
    assert_eq!(header(&sent[1]), unsampled);
    assert!(spans.try_recv().is_err());
    // and the source's work carried the sampled one's span, once
    assert_eq!(delivery.take_carried().linked(), [child]);
    assert!(delivery.take_carried().is_empty());
}

#[tokio::test]
async fn in_a_kafka_transaction_the_publish_spans_end_at_the_commit_linked_from_its_span() {
    // given a traced transactional stage and two sampled records acknowledged in one transaction
    let f = Fixture::transactional("dead_letter");
    let mut delivery = f.delivery().await;
    let mut spans = traced(&mut delivery);
    for position in [1, 2] {
        let mut event = record(&position.to_string());
        event
            .row_headers
            .push((TRACEPARENT.into(), "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into()));
        delivery.send(position, event, Instant::now()).await.unwrap();
    }
    while delivery.records() > 0 {
        assert!(next(&mut delivery).await.unwrap().is_none(), "nothing settles before the commit");
    }
    assert!(spans.try_recv().is_err(), "no span ends before the commit");
    // when it commits
    let settled = delivery.commit(&Clock::now()).await.unwrap();
    assert_eq!(acked(&settled), [1, 2]);
    // then both publish spans end, then the commit's span, linked to them
    let (first, second, commit) =
        (spans.try_recv().unwrap(), spans.try_recv().unwrap(), spans.try_recv().unwrap());
    assert_eq!(commit.name, "kafka transaction commit");
    assert_eq!(commit.links, [first.context, second.context]);
    assert!(first.end >= commit.start && second.end == first.end);
}
