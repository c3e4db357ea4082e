//! The ledger (services/ledger) as its users run it, against a real PostgreSQL and a real
//! Kafka-protocol broker: each OrderPlaced record is applied once whatever the delivery does
//! (duplicates, two consumers at once, kill -9), a record of an aborted Kafka transaction never,
//! and a bad configuration or a missing table is refused naming what to fix.
//! tests/ledger_faults.rs covers dead letters, lock contention, a lost session and `replay-dlq`.
//!
//! The records are produced by the test as the relay would publish them (key = order id,
//! headers `id`, `event_type`, ...); tests/chain.rs runs the whole chain with the relay.

use crate::common;
use crate::ledger_support as support;
use crate::transactions::isolated_consumer;

use std::time::Duration;

use common::*;
use support::*;

#[tokio::test(flavor = "multi_thread")]
async fn a_duplicate_delivery_is_applied_once_across_a_restart() {
    // given a funded wallet and one OrderPlaced record delivered twice
    let l = Ledger::new(1, &[]).await;
    l.fund("alice", 1_000).await;
    let record = order_placed(1, "alice", 300);
    l.produce(&[record.clone(), record.clone()]).await;
    let committed = l.committed();

    // when the ledger consumes both copies
    let mut ledger = l.start("ledger");
    committed.wait_for(2).await;

    // then the event was applied once
    let applied_once = async || {
        assert_eq!(l.balance("alice").await, 700);
        assert_eq!(l.scalar("SELECT count(*) FROM ledger_entries").await, 1);
        assert_eq!(l.scalar("SELECT count(*) FROM processed_events").await, 1);
        let completed = "SELECT count(*) FROM outbox_events WHERE event_type = 'PaymentCompleted' \
                         AND aggregate_type = 'payment' AND aggregate_id = '500001'";
        assert_eq!(l.scalar(completed).await, 1);
        assert_eq!(l.scalar("SELECT count(*) FROM outbox_events").await, 1);
        assert_eq!(l.outcome("1").await, Some(("debited".into(), None)));
    };
    applied_once().await;

    // when it is stopped, the record is delivered a third time, and it starts again
    assert_eq!(ledger.terminate(EXIT_LIMIT), Some(0), "{}", ledger.log_text());
    l.produce(&[record]).await;
    let _ledger = l.start("ledger");
    committed.wait_for(3).await;

    // then nothing changed
    applied_once().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_record_of_an_aborted_kafka_transaction_is_never_applied_and_the_committed_one_after_it_is() {
    // given a funded wallet, and on one partition an OrderPlaced record in a Kafka transaction
    // that aborted, then one in a transaction that committed
    let l = Ledger::new(1, &[]).await;
    l.fund("alice", 1_000).await;
    l.produce_in_transaction(&[order_placed(1, "alice", 300)], false).await;
    l.produce_in_transaction(&[order_placed(2, "alice", 200)], true).await;

    // when the ledger consumes the partition
    let ledger = l.start("ledger");
    wait_until("the committed record to be applied", async || l.outcome("2").await.is_some()).await;

    // then only the committed record was applied; the aborted one, before it in the log, was
    // not (nor dead-lettered: nothing of it reached the inbox)
    assert_eq!(l.outcome("2").await, Some(("debited".into(), None)));
    assert_eq!(l.outcome("1").await, None, "{}", ledger.log_text());
    assert_eq!(l.balance("alice").await, 800);
    assert_eq!(l.scalar("SELECT count(*) FROM processed_events").await, 1);
    // and the aborted record is in the log: a read_uncommitted consumer sees both
    let uncommitted = isolated_consumer(&services().kafka, &l.topic, "read_uncommitted");
    let ids: Vec<String> =
        consume(&uncommitted, 2, IDLE).await.iter().map(|r| r.header("id").unwrap().to_string()).collect();
    assert_eq!(ids, ["1", "2"]);
}

#[tokio::test(flavor = "multi_thread")]
async fn two_consumers_debiting_one_wallet_at_once_never_overdraw_it() {
    // given one wallet of 10,000 cents and two ledger processes in one group on 4 partitions
    let l = Ledger::new(4, &[]).await;
    l.fund("bob", 10_000).await;
    let first = l.start("first");
    let second = l.start("second");
    // the group as its coordinator describes it, and each ledger's own word that it has
    // partitions (a stable group's members take their assignment a moment later)
    wait_until("both ledgers to join the group and be assigned partitions", async || {
        l.stable_group_members() == 2
            && first.log_text().contains("partitions assigned")
            && second.log_text().contains("partitions assigned")
    })
    .await;

    // when 100 orders of 300 cents each arrive, spread over the partitions
    let records: Vec<Record> =
        (1..=100).map(|i| order_placed(i, "bob", 300).on_partition(i as i32 % 4)).collect();
    l.produce(&records).await;
    wait_until("every event to be processed", async || {
        l.scalar("SELECT count(*) FROM processed_events").await == 100
    })
    .await;

    // then exactly what the balance allows was debited, and the rest declined
    let outcome = |o: &str| format!("SELECT count(*) FROM processed_events WHERE outcome = '{o}'");
    assert_eq!(l.scalar(&outcome("debited")).await, 33);
    assert_eq!(l.scalar(&outcome("declined")).await, 67);
    assert_eq!(l.balance("bob").await, 100);
    assert_eq!(l.scalar("SELECT coalesce(sum(amount_cents), 0)::bigint FROM ledger_entries").await, 9_900);
    let events = |t: &str| format!("SELECT count(*) FROM outbox_events WHERE event_type = '{t}'");
    assert_eq!(l.scalar(&events("PaymentCompleted")).await, 33);
    assert_eq!(l.scalar(&events("PaymentDeclined")).await, 67);
    let declined_for_funds = "SELECT count(*) FROM processed_events WHERE outcome = 'declined' \
                              AND detail LIKE 'insufficient balance%'";
    assert_eq!(l.scalar(declined_for_funds).await, 67);
    assert!(consume(&l.dead_letters(), 1, LINGER).await.is_empty(), "nothing may be dead-lettered");
    for ledger in [&first, &second] {
        let log = ledger.log_text();
        assert!(
            log.contains("debited") || log.contains("payment declined"),
            "both ledgers applied events:\n{log}"
        );
    }
}

/// Waits until all `events` records were processed and their offsets committed, then asserts
/// each was applied once ([`assert_each_applied_once`]) and that both outcomes occurred.
async fn assert_all_applied_once(l: &Ledger, events: i64, initial: i64) -> (i64, i64) {
    wait_until_within(Duration::from_secs(180), "every event processed", async || {
        l.scalar("SELECT count(*) FROM processed_events").await == events
    })
    .await;
    l.committed().wait_for(events).await;
    let (debited, declined) = assert_each_applied_once(l, events, initial).await;
    assert!(declined > 0 && debited > 0, "the workload must exercise both outcomes");
    (debited, declined)
}

/// Asserts that each of `events` records was applied once, with `initial` cents in every wallet
/// at the start; returns how many were debited and declined.
async fn assert_each_applied_once(l: &Ledger, events: i64, initial: i64) -> (i64, i64) {
    let positions = "SELECT count(DISTINCT (\"partition\", \"offset\")) FROM processed_events";
    assert_eq!(l.scalar(positions).await, events, "one inbox row per record");
    let debited = l.scalar("SELECT count(*) FROM processed_events WHERE outcome = 'debited'").await;
    let declined = l.scalar("SELECT count(*) FROM processed_events WHERE outcome = 'declined'").await;
    assert_eq!(debited + declined, events, "nothing dead-lettered");
    assert_eq!(l.scalar("SELECT count(*) FROM ledger_entries").await, debited);
    let follow_ups = |t: &str| format!("SELECT count(*) FROM outbox_events WHERE event_type = '{t}'");
    assert_eq!(l.scalar(&follow_ups("PaymentCompleted")).await, debited);
    assert_eq!(l.scalar(&follow_ups("PaymentDeclined")).await, declined);
    // every wallet holds its initial balance less its own ledger entries
    let wrong_balances = format!(
        "SELECT count(*) FROM wallets w WHERE w.balance_cents <> {initial} - \
         (SELECT coalesce(sum(amount_cents), 0) FROM ledger_entries e WHERE e.customer_id = w.customer_id)"
    );
    assert_eq!(l.scalar(&wrong_balances).await, 0, "a wallet disagrees with its ledger entries");
    (debited, declined)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_consumer_killed_mid_stream_loses_nothing_and_applies_nothing_twice() {
    // given 100 wallets and 2,000 orders (some beyond the balance) over 4 partitions
    const CUSTOMERS: i64 = 100;
    const EVENTS: i64 = 2_000;
    const INITIAL: i64 = 5_000;
    // (a lock timeout far beyond the test's first kill: c7's record must not be dead-lettered
    // while the test waits to see it blocked, however loaded the machine)
    let l = Ledger::new(4, &[("lock_timeout_ms", "60000")]).await;
    let wallets = format!(
        "INSERT INTO wallets (customer_id, balance_cents) \
         SELECT 'c' || g, {INITIAL} FROM generate_series(0, {CUSTOMERS} - 1) g"
    );
    l.db.client().await.batch_execute(&wallets).await.unwrap();
    let records: Vec<Record> = (1..=EVENTS)
        .map(|i| {
            order_placed(i, &format!("c{}", i % CUSTOMERS), 50 + (i * 37) % 500).on_partition((i % 4) as i32)
        })
        .collect();
    l.produce(&records).await;

    // when the ledger is killed with SIGKILL while a record is in hand (blocked on a locked
    // wallet), and then four times more while it consumes, and restarted each time
    let mut client = l.db.client().await;
    let watcher = l.db.client().await;
    let lock = lock_wallet(&mut client, "c7").await;
    let mut ledger = l.start("ledger");
    wait_until("the ledger to wait for the locked wallet", async || {
        ledger_waiting_since(&watcher, &l).await.is_some()
    })
    .await;
    ledger.kill9();
    lock.rollback().await.unwrap();
    ledger = l.start("ledger");
    let processed = async || l.scalar("SELECT count(*) FROM processed_events").await;
    for kill in 1..=4 {
        let threshold = kill * EVENTS / 5;
        wait_until_within(Duration::from_secs(180), format!("{threshold} events processed"), async || {
            processed().await >= threshold
        })
        .await;
        ledger.kill9();
        ledger = l.start("ledger");
    }

    // then every event was applied once: one inbox row, one effect, one follow-up event each
    let (debited, declined) = assert_all_applied_once(&l, EVENTS, INITIAL).await;
    let log = std::fs::read_to_string(l.dir.path().join("ledger.log")).unwrap();
    let redelivered = log.matches("duplicate delivery skipped").count();
    eprintln!(
        "{redelivered} record(s) redelivered after the kills, skipped; {debited} debited, {declined} declined"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn one_of_two_consumers_in_a_group_killed_mid_stream_leaves_each_payment_applied_once() {
    // given 50 wallets, 1,000 orders over 4 partitions, and two ledgers in one consumer group
    const CUSTOMERS: i64 = 50;
    const EVENTS: i64 = 1_000;
    const INITIAL: i64 = 5_000;
    let l = Ledger::new(4, &[]).await;
    let wallets = format!(
        "INSERT INTO wallets (customer_id, balance_cents) \
         SELECT 'c' || g, {INITIAL} FROM generate_series(0, {CUSTOMERS} - 1) g"
    );
    l.db.client().await.batch_execute(&wallets).await.unwrap();
    let first = l.start("first");
    let mut second = l.start("second");
    wait_until("both ledgers to join the group and be assigned partitions", async || {
        l.stable_group_members() == 2
            && first.log_text().contains("partitions assigned")
            && second.log_text().contains("partitions assigned")
    })
    .await;

    // when the orders arrive and one ledger is killed with SIGKILL mid-stream
    let records: Vec<Record> = (1..=EVENTS)
        .map(|i| {
            order_placed(i, &format!("c{}", i % CUSTOMERS), 50 + (i * 37) % 500).on_partition((i % 4) as i32)
        })
        .collect();
    l.produce(&records).await;
    let processed = async || l.scalar("SELECT count(*) FROM processed_events").await;
    wait_until("a fifth of the events to be processed", async || processed().await >= EVENTS / 5).await;
    second.kill9();

    // then the group rebalances to the survivor (the coordinator drops the dead member after its
    // session timeout), which applies the rest
    wait_until("the group to have one member", async || l.stable_group_members() == 1).await;
    assert_all_applied_once(&l, EVENTS, INITIAL).await;
    assert!(first.log_text().contains("debited"), "{}", first.log_text());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_config_error_names_the_field_and_missing_tables_name_the_sql_file() {
    // given a configuration with max_attempts = 0, in the file or from the environment
    let l = Ledger::new(1, &[("max_attempts", "0")]).await;
    let (code, log) = l.run_to_exit(&["run"], &[]).await;
    assert_eq!(code, 2, "{log}");
    assert!(log.contains("error: invalid configuration: consumer.max_attempts: must be >= 1"), "{log}");
    l.write_config(&[]);
    let (code, log) = l.run_to_exit(&["run"], &[("LEDGER__CONSUMER__LOCK_TIMEOUT_MS", "0")]).await;
    assert_eq!(code, 2, "{log}");
    assert!(log.contains("consumer.lock_timeout_ms"), "{log}");

    // given a database with the relay's schema but not the ledger's tables
    let bare = Ledger::on(TestDb::new().await, 1, &[]).await;
    let (code, log) = bare.run_to_exit(&["run"], &[]).await;
    assert_eq!(code, 1, "{log}");
    assert!(log.contains("sql/examples/ledger.sql") && log.contains("wallets"), "{log}");
}

#[tokio::test(flavor = "multi_thread")]
async fn an_event_id_another_outbox_used_first_is_no_duplicate_and_an_untrusted_outbox_is_dead_lettered() {
    // given a ledger that takes payments from two outboxes, and two funded wallets
    let sources = r#"["*/ledger/public.outbox_events", "*/shop/public.outbox_events"]"#;
    let l = Ledger::new(1, &[("sources", sources)]).await;
    l.fund("alice", 1_000).await;
    l.fund("bob", 1_000).await;
    let shop = "7714106138773647812/shop/public.outbox_events";

    // when event 1 of the shop's outbox arrives first, then event 1 of the ledger's own, then
    // events of an outbox not listed and of none at all
    let from_shop = order_placed(1, "bob", 100).with_header("outbox_relay_source", shop);
    let real = order_placed(1, "alice", 300);
    let rogue =
        order_placed(2, "bob", 500).with_header("outbox_relay_source", "1/rogue/public.outbox_events");
    let anonymous = order_placed(3, "bob", 700).without_header("outbox_relay_source");
    l.produce(&[from_shop, real, rogue.clone(), anonymous.clone()]).await;
    let _ledger = l.start("ledger");
    l.committed().wait_for(4).await;

    // then both events 1 were applied, each once: the shop's did not make the real one a
    // "duplicate"
    assert_eq!((l.balance("alice").await, l.balance("bob").await), (700, 900));
    let inbox = "SELECT count(*) FROM processed_events WHERE event_id = '1' AND outcome = 'debited'";
    assert_eq!(l.scalar(inbox).await, 2);
    // and the other two were dead-lettered, naming the header and the setting
    let dead_letters = consume(&l.dead_letters(), 2, LINGER).await;
    let reason = |record: &Record| {
        let traceparent = record.header("traceparent");
        let dead =
            dead_letters.iter().find(|d| d.header("traceparent") == traceparent).expect("its dead letter");
        dead.header("dlq_reason").unwrap().to_string()
    };
    assert!(
        reason(&rogue).contains("\"1/rogue/public.outbox_events\" is not one of consumer.sources"),
        "{}",
        reason(&rogue)
    );
    assert!(reason(&anonymous).contains("missing header outbox_relay_source"), "{}", reason(&anonymous));
}

#[tokio::test(flavor = "multi_thread")]
async fn follow_up_events_go_to_the_outbox_table_the_ledger_is_given() {
    // given a ledger whose follow-ups go to its own outbox table
    let l = Ledger::new(1, &[("outbox_table", "\"public.ledger_outbox\"")]).await;
    l.fund("alice", 1_000).await;
    l.produce(&[order_placed(1, "alice", 300)]).await;
    let committed = l.committed();

    // when it applies an OrderPlaced event
    let _ledger = l.start("ledger");
    committed.wait_for(1).await;

    // then its PaymentCompleted is in that table, and none in the relay's outbox_events
    let completed = "SELECT count(*) FROM ledger_outbox WHERE event_type = 'PaymentCompleted' AND aggregate_id = '500001'";
    assert_eq!(l.scalar(completed).await, 1);
    assert_eq!(l.scalar("SELECT count(*) FROM outbox_events").await, 0);

    // and a table that does not exist is refused at start, naming it
    let missing = Ledger::new(1, &[("outbox_table", "\"ops.no_such_outbox\"")]).await;
    let (code, log) = missing.run_to_exit(&["run"], &[]).await;
    assert_eq!(code, 1, "{log}");
    assert!(log.contains("no_such_outbox"), "{log}");
}
