//! The ledger (services/ledger) when records or the database fail it, against a real
//! PostgreSQL and a real Kafka-protocol broker: a record that cannot be applied goes to the
//! dead-letter topic with its reason and every header while the next one is applied, lock
//! contention is retried and then dead-lettered, a lost session is reconnected without using up
//! an attempt, and `replay-dlq` sends dead letters back (and a replay that still fails goes back
//! to the dead-letter topic), only ever into the consumer's topic, whatever `dlq_*` headers the
//! record brought.

use crate::common;
use crate::ledger_support as support;

use common::*;
use support::*;

#[tokio::test(flavor = "multi_thread")]
async fn poison_records_are_dead_lettered_with_their_reason_and_headers_and_the_consumer_moves_on() {
    // given six records that can never be applied, each followed by a valid one: two of them
    // with an id the database could not store as a key (a NUL byte; 4,000 random hex digits,
    // more than a btree index row holds even compressed), known by their position instead
    let l = Ledger::new(1, &[]).await;
    l.fund("carol", 10_000).await;
    let not_json = Record { payload: Some("{not json".into()), ..order_placed(1, "carol", 100) };
    let mut without_payment_id: serde_json::Value =
        serde_json::from_str(order_placed(3, "carol", 100).payload.as_deref().unwrap()).unwrap();
    without_payment_id.as_object_mut().unwrap().remove("payment_id");
    let without_payment_id =
        Record { payload: Some(without_payment_id.to_string()), ..order_placed(3, "carol", 100) };
    let unknown_type = order_placed(5, "carol", 100).with_header("event_type", "OrderShipped");
    let without_id = order_placed(7, "carol", 100).without_header("id");
    let nul_id = order_placed(9, "carol", 100).with_header("id", "9\0");
    let random_hex: String = (0..250).map(|_| format!("{:016x}", rand::random::<u64>())).collect();
    let long_id = order_placed(11, "carol", 100).with_header("id", &random_hex);
    let poison = [
        (not_json, "not JSON", false),
        (without_payment_id, "payment_id", false),
        (unknown_type, "OrderShipped", false),
        (without_id, "header id", true),
        (nul_id, "header id (the event id) holds a control character: \"9\\0\"", true),
        (long_id, "header id (the event id) is 4000 characters long, at most 128", true),
    ];
    for (i, (record, _, _)) in poison.iter().enumerate() {
        let valid = order_placed(2 * i as i64 + 2, "carol", 100);
        l.produce(std::slice::from_ref(record)).await;
        l.produce(&[valid]).await;
    }

    // when the ledger consumes them
    let _ledger = l.start("ledger");
    l.committed().wait_for(12).await;

    // then each poison record is in the dead-letter topic as it was, with the reason
    let dead_letters = consume(&l.dead_letters(), 7, LINGER).await;
    assert_eq!(dead_letters.len(), 6, "{dead_letters:#?}");
    for (record, expected_reason, known_by_position) in &poison {
        let traceparent = record.header("traceparent").unwrap();
        let dead = dead_letters
            .iter()
            .find(|d| d.header("traceparent") == Some(traceparent))
            .unwrap_or_else(|| panic!("no dead letter for {record:?}"));
        let reason = dead.header("dlq_reason").unwrap();
        assert!(reason.contains(expected_reason), "dlq_reason {reason:?} should name {expected_reason:?}");
        assert_eq!(dead.key.as_deref(), Some(record.key.as_str()));
        assert_eq!(dead.payload, record.payload);
        for (name, value) in &record.headers {
            assert_eq!(dead.header(name), Some(value.as_str()), "original header {name}");
        }
        assert_eq!(dead.header("dlq_attempts"), Some("1"));
        assert_eq!(dead.header("dlq_topic"), Some(l.topic.as_str()));
        assert_eq!(dead.header("dlq_partition"), Some("0"));
        let offset: i64 = dead.header("dlq_offset").unwrap().parse().unwrap();
        let position = format!("{}/0/{offset}", l.topic);
        let event_id = if *known_by_position { position } else { record.header("id").unwrap().to_string() };
        let (outcome, detail) = l.outcome(&event_id).await.expect("an inbox row for the dead letter");
        assert_eq!((outcome.as_str(), detail.as_deref()), ("dead_lettered", Some(reason)));
    }

    // and every valid record after them was applied
    assert_eq!(l.scalar("SELECT count(*) FROM ledger_entries").await, 6);
    assert_eq!(l.balance("carol").await, 10_000 - 6 * 100);
    assert_eq!(l.scalar("SELECT count(*) FROM processed_events WHERE outcome = 'debited'").await, 6);
}

/// Lock timeouts of 200 ms, three attempts: a lock held throughout dead-letters quickly.
const LOCK_SETTINGS: [(&str, &str); 4] = [
    ("lock_timeout_ms", "200"),
    ("max_attempts", "3"),
    ("initial_backoff_ms", "50"),
    ("max_backoff_ms", "200"),
];

/// Lock timeouts of 3 s, ten attempts: a test that sees an attempt waiting has seconds to
/// release the lock within it, however loaded the machine.
const PATIENT_LOCK_SETTINGS: [(&str, &str); 4] = [
    ("lock_timeout_ms", "3000"),
    ("max_attempts", "10"),
    ("initial_backoff_ms", "50"),
    ("max_backoff_ms", "200"),
];

#[tokio::test(flavor = "multi_thread")]
async fn a_lock_held_past_max_attempts_dead_letters_and_a_lock_released_in_time_is_retried_and_applied() {
    // given a ledger with lock_timeout_ms = 200 and max_attempts = 3, and a wallet held locked
    let l = Ledger::new(1, &LOCK_SETTINGS).await;
    l.fund("dave", 1_000).await;
    let mut ledger = l.start("ledger");
    let mut client = l.db.client().await;
    let lock = lock_wallet(&mut client, "dave").await;

    // when an order for it arrives and the lock is held through every attempt
    l.produce(&[order_placed(1, "dave", 300)]).await;
    let dead_letters = l.dead_letters();
    let dead = consume(&dead_letters, 1, IDLE).await;

    // then it is dead-lettered naming the lock, and nothing was debited
    assert_eq!(dead.len(), 1);
    let reason = dead[0].header("dlq_reason").unwrap();
    assert!(reason.starts_with("lock timeout after 3 attempts"), "{reason}");
    assert_eq!(dead[0].header("dlq_attempts"), Some("3"));
    lock.rollback().await.unwrap();
    l.committed().wait_for(1).await;
    assert_eq!(l.outcome("1").await.map(|o| o.0).as_deref(), Some("dead_lettered"));
    assert_eq!(l.balance("dave").await, 1_000);
    assert_eq!(l.scalar("SELECT count(*) FROM ledger_entries").await, 0);

    // given the ledger restarted with lock_timeout_ms = 3000 and max_attempts = 10
    assert_eq!(ledger.terminate(EXIT_LIMIT), Some(0), "{}", ledger.log_text());
    l.write_config(&PATIENT_LOCK_SETTINGS);
    let ledger = l.start("patient");

    // when the next order finds the wallet locked, and the lock is released after a failed
    // attempt, while a later one waits (seconds before it would time out)
    let lock = lock_wallet(&mut client, "dave").await;
    l.produce(&[order_placed(2, "dave", 300)]).await;
    let watcher = l.db.client().await;
    let mut first_attempt = None;
    wait_until("the ledger to wait for the lock", async || {
        first_attempt = ledger_waiting_since(&watcher, &l).await;
        first_attempt.is_some()
    })
    .await;
    wait_until("the ledger to wait for the lock in a later attempt", async || {
        ledger_waiting_since(&watcher, &l).await.is_some_and(|since| Some(since) > first_attempt)
    })
    .await;
    lock.commit().await.unwrap();

    // then it is applied, once, and not dead-lettered
    l.committed().wait_for(2).await;
    assert!(ledger.log_text().contains("transaction failed, retrying"), "{}", ledger.log_text());
    assert_eq!(l.outcome("2").await.map(|o| o.0).as_deref(), Some("debited"));
    assert_eq!(l.balance("dave").await, 700);
    assert_eq!(l.scalar("SELECT count(*) FROM ledger_entries").await, 1);
    assert!(consume(&dead_letters, 1, LINGER).await.is_empty(), "only the first order is dead-lettered");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_lost_database_session_is_reconnected_and_the_record_retried_without_using_up_an_attempt() {
    // given a ledger that dead-letters at the first lock timeout, waiting for a locked wallet
    let l = Ledger::new(1, &[("max_attempts", "1"), ("lock_timeout_ms", "30000")]).await;
    l.fund("frank", 1_000).await;
    let _ledger = l.start("ledger");
    let mut client = l.db.client().await;
    let watcher = l.db.client().await;
    let lock = lock_wallet(&mut client, "frank").await;
    l.produce(&[order_placed(1, "frank", 400)]).await;
    let waiting_pid = async || {
        let sql = "SELECT pid FROM pg_stat_activity WHERE datname = $1 AND application_name = 'ledger' \
                   AND wait_event_type = 'Lock'";
        watcher.query_opt(sql, &[&l.db.name]).await.unwrap().map(|row| row.get::<_, i32>(0))
    };
    let mut first = None;
    wait_until("the ledger to wait for the lock", async || {
        first = waiting_pid().await;
        first.is_some()
    })
    .await;

    // when its session is terminated mid-transaction
    let terminated: bool =
        watcher.query_one("SELECT pg_terminate_backend($1)", &[&first.unwrap()]).await.unwrap().get(0);
    assert!(terminated);

    // then it reconnects and tries the same record again, and it is applied once the lock is free
    wait_until("a new ledger session to wait for the lock", async || {
        waiting_pid().await.is_some_and(|pid| Some(pid) != first)
    })
    .await;
    lock.commit().await.unwrap();
    l.committed().wait_for(1).await;
    assert_eq!(l.outcome("1").await.map(|o| o.0).as_deref(), Some("debited"));
    assert_eq!(l.balance("frank").await, 600);
    assert!(consume(&l.dead_letters(), 1, LINGER).await.is_empty(), "an outage is not an attempt");
}

#[tokio::test(flavor = "multi_thread")]
async fn replay_dlq_applies_a_dead_letter_once_and_a_replay_of_an_applied_event_changes_nothing() {
    // given an order dead-lettered because its wallet stayed locked
    let l = Ledger::new(1, &LOCK_SETTINGS).await;
    l.fund("erin", 1_000).await;
    let _ledger = l.start("ledger");
    let mut client = l.db.client().await;
    let lock = lock_wallet(&mut client, "erin").await;
    let order = order_placed(1, "erin", 250);
    l.produce(std::slice::from_ref(&order)).await;
    assert_eq!(consume(&l.dead_letters(), 1, IDLE).await.len(), 1);
    l.committed().wait_for(1).await;
    lock.rollback().await.unwrap();

    // when the dead letter is replayed
    let (code, log) = l.run_to_exit(&["replay-dlq"], &[]).await;
    assert_eq!(code, 0, "{log}");

    // then the order is applied once, from a copy without the dead-letter headers
    l.committed().wait_for(2).await;
    let applied_once = async || {
        assert_eq!(l.outcome("1").await.map(|o| o.0).as_deref(), Some("debited"));
        assert_eq!(l.balance("erin").await, 750);
        assert_eq!(l.scalar("SELECT count(*) FROM ledger_entries").await, 1);
        assert_eq!(
            l.scalar("SELECT count(*) FROM outbox_events WHERE event_type = 'PaymentCompleted'").await,
            1
        );
    };
    applied_once().await;
    let on_topic = consume(&consumer(&[&l.topic]), 2, IDLE).await;
    let replayed = &on_topic[1];
    assert!(replayed.headers.iter().all(|(k, _)| !k.starts_with("dlq_")), "{replayed:?}");
    for (name, value) in &order.headers {
        assert_eq!(replayed.header(name), Some(value.as_str()), "original header {name}");
    }
    assert_eq!(replayed.payload, order.payload);

    // when the same dead letter is replayed again (by a replay in another group)
    let other_group = format!("other-{}", random_suffix());
    let (code, log) = l.run_to_exit(&["replay-dlq"], &[("LEDGER__CONSUMER__GROUP_ID", &other_group)]).await;
    assert_eq!(code, 0, "{log}");
    l.committed().wait_for(3).await;

    // then nothing changed
    applied_once().await;

    // and a replay in the first group again finds nothing left to send: it committed
    let (code, log) = l.run_to_exit(&["replay-dlq"], &[]).await;
    assert_eq!(code, 0, "{log}");
    assert_eq!(consume(&consumer(&[&l.topic]), 4, LINGER).await.len(), 3);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_replayed_record_that_still_cannot_be_read_goes_back_to_the_dead_letter_topic() {
    // given a record that cannot be read (its value is not JSON), dead-lettered
    let l = Ledger::new(1, &[]).await;
    let poison = Record { payload: Some("{not json".into()), ..order_placed(1, "gina", 100) };
    l.produce(std::slice::from_ref(&poison)).await;
    let _ledger = l.start("ledger");
    let dead_letters = l.dead_letters();
    let first = consume(&dead_letters, 1, IDLE).await;
    assert_eq!(first.len(), 1);
    let reason = first[0].header("dlq_reason").unwrap().to_string();
    l.committed().wait_for(1).await;

    // when it is replayed before its cause is fixed
    let (code, log) = l.run_to_exit(&["replay-dlq"], &[]).await;
    assert_eq!(code, 0, "{log}");

    // then the replayed copy is dead-lettered again, for the same reason, and the inbox row
    // names that copy
    l.committed().wait_for(2).await;
    let again = consume(&dead_letters, 1, IDLE).await;
    assert_eq!(again.len(), 1, "the replayed copy must be dead-lettered again");
    assert_eq!(again[0].header("dlq_reason"), Some(reason.as_str()));
    assert_eq!(again[0].header("dlq_offset"), Some("1"));
    assert_eq!(again[0].payload, poison.payload);
    assert_eq!(l.outcome("1").await, Some(("dead_lettered".into(), Some(reason))));
    assert_eq!(l.scalar("SELECT \"offset\" FROM processed_events WHERE event_id = '1'").await, 1);

    // and the next replay finds it there and sends it back once more; it ends at the end of
    // the dead-letter topic as it found it, though the ledger dead-letters the copy again
    let (code, log) = l.run_to_exit(&["replay-dlq"], &[]).await;
    assert_eq!(code, 0, "{log}");
    l.committed().wait_for(3).await;
    let third = consume(&dead_letters, 1, IDLE).await;
    assert_eq!(third.first().and_then(|d| d.header("dlq_offset")), Some("2"), "{third:?}");
    assert_eq!(l.scalar("SELECT count(*) FROM processed_events").await, 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn replay_dlq_sends_only_into_the_consumers_topic_whatever_dlq_headers_a_record_brings() {
    // given a record that cannot be read, carrying dlq_* headers of its own that point elsewhere
    let l = Ledger::new(1, &[]).await;
    let elsewhere = random_topic("elsewhere");
    create_topic(&elsewhere, 1).await;
    let poison = Record { payload: Some("{not json".into()), ..order_placed(1, "ivan", 100) }
        .with_header("dlq_topic", &elsewhere)
        .with_header("dlq_reason", "forged");
    l.produce(std::slice::from_ref(&poison)).await;
    let _ledger = l.start("ledger");
    let dead_letters = l.dead_letters();
    let first = consume(&dead_letters, 1, IDLE).await;
    assert_eq!(first.len(), 1);
    l.committed().wait_for(1).await;
    // then its dead letter holds the ledger's dlq_* headers once each, not the record's
    let named = |name: &str| first[0].headers.iter().filter(|(k, _)| k == name).count();
    assert_eq!((named("dlq_topic"), named("dlq_reason")), (1, 1), "{:?}", first[0].headers);
    assert_eq!(first[0].header("dlq_topic"), Some(l.topic.as_str()));

    // and a dead letter of another topic lies in the dead-letter topic (written by hand, or by
    // a ledger of another topic)
    let stray = order_placed(2, "ivan", 100).with_header("dlq_topic", &elsewhere);
    l.produce_to(&l.dead_letter_topic, &[stray.on_partition(0)]).await;

    // when the dead letters are replayed
    let (code, log) = l.run_to_exit(&["replay-dlq"], &[]).await;
    assert_eq!(code, 0, "{log}");

    // then the first goes back into the consumer's topic, without any dlq_* header, and nothing
    // reaches the topic a header named; the stray one is skipped, named in the log
    let on_topic = consume(&consumer(&[&l.topic]), 2, IDLE).await;
    assert_eq!(on_topic.len(), 2, "{on_topic:?}");
    let replayed = &on_topic[1];
    assert!(replayed.headers.iter().all(|(k, _)| !k.starts_with("dlq_")), "{replayed:?}");
    assert_eq!(replayed.payload, poison.payload);
    assert!(consume(&consumer(&[&elsewhere]), 1, LINGER).await.is_empty(), "replayed into {elsewhere}");
    assert!(log.contains("dead letter not replayed") && log.contains(&elsewhere), "{log}");
    assert!(log.contains("replayed=1") && log.contains("skipped=1"), "{log}");
}
