//! Switching `source.mode` in either direction, as docs/operations.md, "Switching source modes", tells an
//! operator to: stop the relay, change the mode, start it. Nothing published before the switch
//! is sent again, nothing written across it is lost, per-aggregate order holds, and the slot
//! replication mode leaves behind is named (metrics, `check`, `status`) until it is dropped.

use crate::common;

use common::workload::*;
use common::*;

/// A relay in `mode`, configured for both, its configuration changed by `more`.
async fn setup(mode: &str, more: impl FnOnce(RelayToml) -> RelayToml) -> Setup {
    Setup::create(&services().kafka, "", true, |slot| {
        more(RelayToml::either(mode, slot).set("dead_letter", "on_poison", "dead_letter"))
    })
    .await
}

/// Rewrites the configuration's `source.mode`.
fn switch_to(s: &Setup, from: &str, to: &str) {
    let config = std::fs::read_to_string(s.config()).unwrap();
    let switched = config.replace(&format!("mode = \"{from}\""), &format!("mode = \"{to}\""));
    assert_ne!(config, switched);
    std::fs::write(s.config(), switched).unwrap();
}

fn check(s: &Setup) -> String {
    let (_, stdout, _) = run_relay(&["check", "--config", s.config().to_str().unwrap()], IDLE);
    stdout
}

async fn write_round(client: &mut tokio_postgres::Client, s: &Setup, per_aggregate: usize) {
    for i in 0..3 {
        write_events(client, &s.aggregate_type, &format!("agg-{i}"), per_aggregate, true).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn replication_to_polling_sends_nothing_twice_and_names_the_old_slot_until_it_is_dropped() {
    // given a replication relay that published 60 events and dead-lettered a row without an
    // aggregate id (replication mode leaves both in the outbox)
    let s = setup("replication", |config| config).await;
    let mut client = s.db.client().await;
    client.batch_execute("ALTER TABLE outbox_events ALTER COLUMN aggregate_id DROP NOT NULL").await.unwrap();
    create_aggregates(&client, 3).await;
    let consumer = consumer(&[&s.topic]);
    let mut relay = s.start("replication");
    relay.wait_ready("active").await;
    write_round(&mut client, &s, 20).await;
    insert_event(&client, &s.aggregate_type, None).await;
    relay.wait_metric("outbox_relay_events_dead_lettered_total{mode=\"replication\"}", |v| v >= 1.0).await;
    relay.wait_metric("outbox_relay_events_published_total{mode=\"replication\"}", |v| v >= 60.0).await;
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0), "{}", relay.log_text());
    // and 15 events written while no relay runs, one of whose ids a forged dead letter (a
    // non-transactional message's, or an id handed out again) also names, with other content
    write_round(&mut client, &s, 5).await;
    client
        .execute(
            "INSERT INTO outbox_dead_letter (source_table, event_id, row_data, reason) \
             SELECT 'public.outbox_events', max(id)::text, \
                    jsonb_build_object('id', max(id)::text, 'aggregate_id', 'agg-0', 'event_type', 'E', 'payload', '{}'), \
                    'forged' FROM outbox_events",
            &[],
        )
        .await
        .unwrap();

    // when the configuration says polling, with dedup off, the relay refuses to start and says why
    switch_to(&s, "replication", "polling");
    let config = s.config();
    let (code, _, stderr) = run_relay_with_env(
        &["run", "--config", config.to_str().unwrap()],
        &[("OUTBOX_RELAY__DEDUP__ENABLED", "false")],
        IDLE,
    );
    assert_ne!(code, 0, "{stderr}");
    assert!(stderr.contains("reason=config") && stderr.contains("dedup.enabled = false"), "{stderr}");
    // and with dedup on (the default) it takes over
    let relay = s.start_with_env("polling", &[("OUTBOX_RELAY__METRICS__SAMPLE_INTERVAL_SECS", "1")]);
    wait_until(relay.context("the outbox to be empty".into()), async || s.outbox_rows().await == 0).await;

    // then every event arrived once, in order; the dead-lettered row was neither sent nor
    // dead-lettered again
    let records = consume_unique(&consumer, 75, IDLE, LINGER).await;
    let report = assert_delivered(&records, &committed_counts(&client).await);
    assert_eq!((report.unique, report.duplicates), (75, 0), "{}", relay.log_text());
    let letters: i64 = client.query_one("SELECT count(*) FROM outbox_dead_letter", &[]).await.unwrap().get(0);
    assert_eq!(letters, 2, "the replication mode's letter and the forged one, no more");
    assert_eq!(relay.metric("outbox_relay_events_published_total{mode=\"polling\"}"), Some(15.0));

    // and the slot left behind is named: its retained WAL, check's warning, status
    relay.wait_metric("outbox_relay_slot_retained_wal_bytes", |v| v > 0.0).await;
    let report = check(&s);
    assert!(
        report.contains("WARN polling.replication_slot") && report.contains("pg_drop_replication_slot"),
        "{report}"
    );
    let (_, status, _) = run_relay(&["status", "--config", config.to_str().unwrap()], IDLE);
    assert!(status.contains("slot left by replication mode"), "{status}");

    // when it is dropped, nothing is retained and check is satisfied
    client.execute("SELECT pg_drop_replication_slot($1)", &[&s.slot]).await.unwrap();
    relay.wait_metric("outbox_relay_slot_retained_wal_bytes", |v| v == 0.0).await;
    let report = check(&s);
    assert!(report.contains("OK   polling.replication_slot"), "{report}");
}

#[tokio::test(flavor = "multi_thread")]
async fn polling_with_marks_to_replication_sends_only_the_rows_not_marked() {
    // given a polling relay that marks published rows, and no read-back to hide a re-send
    let s = setup("polling", |config| {
        config.set("polling", "after_publish", "mark").set("dedup", "enabled", false)
    })
    .await;
    let mut client = s.db.client().await;
    create_aggregates(&client, 3).await;
    let consumer = consumer(&[&s.topic]);
    let mut relay = s.start("polling");
    relay.wait_ready("active").await;
    write_round(&mut client, &s, 10).await;
    let unmarked = "SELECT count(*) FROM outbox_events WHERE published_at IS NULL";
    wait_until(relay.context("every row marked".into()), async || {
        client.query_one(unmarked, &[]).await.unwrap().get::<_, i64>(0) == 0
    })
    .await;
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0), "{}", relay.log_text());
    // and 15 events written while no relay runs
    write_round(&mut client, &s, 5).await;

    // when the configuration says replication: the new slot's first copy takes the rows
    switch_to(&s, "polling", "replication");
    let relay = s.start("replication");
    relay.wait_ready("active").await;

    // then the 30 marked rows are not sent again, the 15 arrive once, in order
    let records = consume_unique(&consumer, 45, IDLE, LINGER).await;
    let report = assert_delivered(&records, &committed_counts(&client).await);
    assert_eq!((report.unique, report.duplicates), (45, 0), "{}", relay.log_text());
}

#[tokio::test(flavor = "multi_thread")]
async fn polling_finishes_the_switch_for_a_slot_made_under_an_earlier_name_and_ignores_other_outboxes() {
    // given a slot replication mode made (`setup` creates and remembers it in outbox_relay_slots)
    let s = setup("replication", |config| config).await;
    let client = s.db.client().await;
    let config = s.config();
    let (code, _, stderr) = run_relay(&["setup", "--config", config.to_str().unwrap()], IDLE);
    assert_eq!(code, 0, "{stderr}");
    insert_event(&client, &s.aggregate_type, Some("agg-0")).await;

    // when the configuration says polling, and names another slot (as an edited file might)
    switch_to(&s, "replication", "polling");
    let earlier = s.slot.clone();
    let text = std::fs::read_to_string(&config).unwrap();
    std::fs::write(&config, text.replace(&format!("slot = \"{earlier}\""), "slot = \"s_renamed\"")).unwrap();

    // and another outbox's stopped relay has a slot in the same database
    let foreign = format!("s_foreign_{}", random_suffix());
    client.execute("SELECT pg_create_logical_replication_slot($1, 'pgoutput')", &[&foreign]).await.unwrap();
    client
        .execute(
            "INSERT INTO outbox_relay_slots (slot_name, created_lsn, outbox_table) VALUES ($1, '0/0', 'billing.outbox')",
            &[&foreign],
        )
        .await
        .unwrap();

    // then check, status and the metrics still name this outbox's slot that keeps WAL, and not
    // the other outbox's
    let report = check(&s);
    assert!(
        report.contains("WARN polling.replication_slot")
            && report.contains(&format!("slot \"{earlier}\""))
            && report.contains("under an earlier replication.slot"),
        "{report}"
    );
    assert!(!report.contains(&foreign), "another outbox's slot: {report}");
    let (_, status, _) = run_relay(&["status", "--config", config.to_str().unwrap()], IDLE);
    assert!(status.contains("slot left by replication mode") && status.contains(&earlier), "{status}");
    assert!(!status.contains(&foreign), "another outbox's slot: {status}");
    let relay = s.start_with_env("polling", &[("OUTBOX_RELAY__METRICS__SAMPLE_INTERVAL_SECS", "1")]);
    relay.wait_metric("outbox_relay_slot_retained_wal_bytes", |v| v > 0.0).await;
    // and the switch is unfinished for it: polling reads each topic back whole
    wait_until(relay.context("the switch to be noticed".into()), async || {
        relay.log_text().contains("switching from replication mode")
    })
    .await;

    // and once it is dropped, nothing is reported
    client.execute("SELECT pg_drop_replication_slot($1)", &[&earlier]).await.unwrap();
    relay.wait_metric("outbox_relay_slot_retained_wal_bytes", |v| v == 0.0).await;
    let report = check(&s);
    assert!(report.contains("OK   polling.replication_slot"), "{report}");
    client.execute("SELECT pg_drop_replication_slot($1)", &[&foreign]).await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn a_replication_relay_started_during_an_unfinished_switch_sends_the_polling_relay_to_standby() {
    // given a polling relay active while the slot of replication mode still exists
    let s = setup("replication", |config| config).await;
    let config = s.config();
    let (code, _, stderr) = run_relay(&["setup", "--config", config.to_str().unwrap()], IDLE);
    assert_eq!(code, 0, "{stderr}");
    switch_to(&s, "replication", "polling");
    let polling = s.start("polling");
    polling.wait_ready("active").await;

    // when a replication relay is started on that slot after all (the same file, the old mode)
    let mut replication = s.start_with_env("replication", &[("OUTBOX_RELAY__SOURCE__MODE", "replication")]);
    replication.wait_ready("active").await;

    // then the polling relay stops publishing beside it: it waits as a standby, naming the slot
    polling.wait_ready("standby").await;
    let log = polling.log_text();
    assert!(log.contains(&format!("streams from slot \"{}\"", s.slot)), "{log}");

    // and once the replication relay is stopped, polling takes over again
    assert_eq!(replication.terminate(EXIT_LIMIT), Some(0), "{}", replication.log_text());
    polling.wait_ready("active").await;
}

/// Replication to polling and back, each step as docs/operations.md, "Switching source modes", says: the slot
/// dropped at the end of the first switch is one the relay remembers publishing from, so `run`
/// and `setup` refuse to make it again silently. `check` says so in the same words (it once said
/// "0 failed", and `setup` then refused), and that page's step, `setup --recreate-slot`, starts
/// replication mode again: every event arrives once, in order.
#[tokio::test(flavor = "multi_thread")]
async fn replication_to_polling_and_back_check_sees_what_setup_sees_and_the_readme_step_works() {
    // given a replication relay that published 30 events
    let s = setup("replication", |config| config).await;
    let mut client = s.db.client().await;
    create_aggregates(&client, 3).await;
    let consumer = consumer(&[&s.topic]);
    let config = s.config();
    let config_arg = config.to_str().unwrap();
    let mut relay = s.start("replication");
    relay.wait_ready("active").await;
    write_round(&mut client, &s, 10).await;
    relay.wait_metric("outbox_relay_events_published_total{mode=\"replication\"}", |v| v >= 30.0).await;
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0), "{}", relay.log_text());

    // and a switch to polling, finished as that page says: polling publishes what was written
    // meanwhile, then the slot is dropped
    switch_to(&s, "replication", "polling");
    write_round(&mut client, &s, 5).await;
    let mut relay = s.start("polling");
    wait_until(relay.context("the outbox to be empty".into()), async || s.outbox_rows().await == 0).await;
    client.execute("SELECT pg_drop_replication_slot($1)", &[&s.slot]).await.unwrap();
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0), "{}", relay.log_text());
    write_round(&mut client, &s, 5).await;

    // when the configuration says replication again
    switch_to(&s, "polling", "replication");

    // then check FAILs the slot with setup's own words, and setup refuses as check said
    let report = check(&s);
    let refused = "is missing, but this relay published from it before";
    assert!(report.contains("FAIL replication.slot") && report.contains(refused), "{report}");
    assert!(report.contains("setup --recreate-slot"), "{report}");
    assert!(!report.contains(" 0 failed"), "{report}");
    let (code, _, stderr) = run_relay(&["setup", "--config", config_arg], IDLE);
    assert_ne!(code, 0, "{stderr}");
    assert!(stderr.contains(refused) && stderr.contains("setup --recreate-slot"), "{stderr}");

    // and that page's step starts replication mode again: the 15 rows polling has not
    // published are, once, and every later event streams
    let (code, stdout, stderr) = run_relay(&["setup", "--recreate-slot", "--config", config_arg], IDLE);
    assert_eq!(code, 0, "{stdout}{stderr}");
    let report = check(&s);
    assert!(report.contains("OK   replication.slot") && report.contains(" 0 failed"), "{report}");
    let relay = s.start("replication");
    relay.wait_ready("active").await;
    write_round(&mut client, &s, 5).await;
    let records = consume_unique(&consumer, 75, IDLE, LINGER).await;
    let delivered = assert_delivered(&records, &committed_counts(&client).await);
    assert_eq!((delivered.unique, delivered.duplicates), (75, 0), "{}", relay.log_text());
}
