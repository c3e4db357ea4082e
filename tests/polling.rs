//! Polling mode against the real PostgreSQL and broker, with the relay as a child process:
//! no loss, no phantom, per-aggregate order, across crashes, broker refusals and failover.

use crate::common;

use std::time::{Duration, Instant};

use common::mock::MockKafka;
use common::process::RelayProcess;
use common::workload::*;
use common::*;

fn polling_config() -> RelayToml {
    RelayToml::polling().set("polling", "batch_size", 200)
}

impl Setup {
    /// A polling setup in batches of 200, its configuration changed by `more`.
    async fn polling(more: impl FnOnce(RelayToml) -> RelayToml) -> Setup {
        Setup::create(&services().kafka, "", true, |_| more(polling_config())).await
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn ten_thousand_concurrent_events_arrive_once_in_order() {
    // given a running relay and 100 aggregates
    let s = Setup::polling(|config| config).await;
    create_aggregates(&s.db.client().await, 100).await;
    let consumer = consumer(&[&s.topic]);
    let mut relay = s.start("relay");

    // when 8 concurrent writers commit 10,000 events
    let committed = write_concurrently(&s.db.url, &s.aggregate_type, 100, 10_000, 8).await;

    // then every event arrives exactly once, in per-aggregate order
    let records = consume_unique(&consumer, 10_000, IDLE, LINGER).await;
    let report = assert_delivered(&records, &committed);
    assert_eq!(report.unique, 10_000);
    assert_eq!(report.duplicates, 0, "steady state must not publish twice");
    // (published rows are deleted by the claim's commit, after Kafka acknowledged them)
    wait_until("the published rows to be deleted", async || s.outbox_rows().await == 0).await;

    // and SIGTERM stops it cleanly with exit status 0
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0), "{}", relay.log_text());
}

#[tokio::test(flavor = "multi_thread")]
async fn kill_9_mid_run_loses_nothing_and_keeps_order() {
    // given a relay publishing while writers write
    let s = Setup::polling(|config| config).await;
    create_aggregates(&s.db.client().await, 100).await;
    let consumer = consumer(&[&s.topic]);
    let mut relay = s.start("first");
    let writer =
        tokio::spawn(write_concurrently_owned(s.db.url.clone(), s.aggregate_type.clone(), 100, 6_000));

    // when the relay is killed with SIGKILL once events are flowing: 500 acknowledged, as its
    // metrics say (the consumer may still be joining its group, and the writers done, by the
    // time it has read 500)
    relay.wait_metric("outbox_relay_events_published_total{mode=\"polling\"}", |v| v >= 500.0).await;
    relay.kill9();
    let committed = writer.await.unwrap();
    let backlog = s.outbox_rows().await;
    let mut relay = s.start("second");

    // then after a restart every committed event arrives, first arrivals in order, and the
    // only duplicates are from the one batch in flight at the kill
    let records = consume_unique(&consumer, 6_000, IDLE, LINGER).await;
    let report = assert_delivered(&records, &committed);
    assert_eq!(report.unique, 6_000);
    assert!(report.duplicates <= 200, "{} duplicates, more than one batch (200)", report.duplicates);
    assert!(backlog > 0, "the kill happened after everything was published; the test proved nothing");
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0));
}

async fn write_concurrently_owned(
    url: String,
    aggregate_type: String,
    aggregates: usize,
    total: usize,
) -> std::collections::HashMap<String, i64> {
    write_concurrently(&url, &aggregate_type, aggregates, total, 4).await
}

#[tokio::test(flavor = "multi_thread")]
async fn rows_stay_until_the_broker_acknowledges() {
    // given a relay whose broker (librdkafka's mock cluster) refuses every produce request
    let mock = MockKafka::start();
    let s = Setup::on_mock(&mock, 2, |_| polling_config()).await;
    mock.refuse_produce();
    let client = s.db.client().await;
    create_aggregates(&client, 10).await;
    let mut writer = s.db.client().await;
    for i in 0..50 {
        write_events(&mut writer, &s.aggregate_type, &format!("agg-{}", i % 10), 1, true).await;
    }
    let mut relay = s.start("relay");

    // when the relay tries for several message timeouts
    tokio::time::sleep(Duration::from_secs(8)).await;

    // then no row was deleted, and the relay says why it is retrying: the stall is counted
    // and /readyz is degraded
    assert_eq!(s.outbox_rows().await, 50, "rows were released without an acknowledgement");
    relay.wait_metric("outbox_relay_publish_errors_total{error_type=\"stalled\"}", |v| v >= 1.0).await;
    let degraded = relay.context("/readyz to answer 503 degraded".into());
    wait_until(degraded, async || relay.readyz().is_some_and(|(s, b)| s == 503 && b.starts_with("degraded")))
        .await;
    assert!(relay.exited().is_none(), "the relay gave up: {}", relay.log_text());

    // when the broker accepts again, then everything is published once acknowledged, the rows
    // are released, and the relay is ready again
    mock.accept_produce();
    let committed = committed_counts(&client).await;
    let records = consume_unique(&mock.consumer(&[&s.topic]), 50, IDLE, LINGER).await;
    assert_delivered(&records, &committed);
    wait_until("the rows to be released after acknowledgement", async || s.outbox_rows().await == 0).await;
    relay.wait_ready("active").await;
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0));
}

/// application_name of the session holding the leader lock, if any (the leader also holds
/// `polling.leader_lock_key` itself, for relays from before the per-table lock).
async fn active_instance(client: &tokio_postgres::Client) -> Option<String> {
    client
        .query_opt(
            "SELECT DISTINCT a.application_name FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid \
             WHERE l.locktype = 'advisory' AND l.granted AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())",
            &[],
        )
        .await
        .unwrap()
        .map(|r| r.get(0))
}

#[tokio::test(flavor = "multi_thread")]
async fn two_instances_keep_order_and_fail_over() {
    // given two relay instances against the same table
    let s = Setup::polling(|config| config).await;
    let client = s.db.client().await;
    create_aggregates(&client, 50).await;
    let consumer = consumer(&[&s.topic]);
    let config = std::fs::read_to_string(s.config()).unwrap();
    let mut relays = Vec::new();
    for name in ["relay-a", "relay-b"] {
        let path = s.dir.path().join(format!("{name}.toml"));
        std::fs::write(
            &path,
            config.replace("[postgres]\n", &format!("[postgres]\napplication_name = \"{name}\"\n")),
        )
        .unwrap();
        relays.push((name, RelayProcess::start(&path, &s.dir.path().join(format!("{name}.log")))));
    }
    let (leader, standby) = roles(&relays).await;

    // when writers load the outbox for 30 s
    let load_until = Instant::now() + Duration::from_secs(30);
    let mut writer = s.db.client().await;
    let mut written = 0;
    let mut checked = Instant::now();
    while Instant::now() < load_until {
        let aggregate = format!("agg-{}", rand::random_range(0..50));
        written +=
            write_events(&mut writer, &s.aggregate_type, &aggregate, rand::random_range(1..=5), true).await;
        if checked.elapsed() >= Duration::from_millis(100) {
            assert_roles_kept(&relays, leader, standby);
            checked = Instant::now();
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }

    // then everything arrives once, in per-aggregate order: one instance was active throughout,
    // the one holding the lock, and the other stood by
    let committed = committed_counts(&client).await;
    let records = consume_unique(&consumer, written, IDLE, LINGER).await;
    let report = assert_delivered(&records, &committed);
    assert_eq!(report.duplicates, 0, "an event was published twice in steady state");
    assert_roles_kept(&relays, leader, standby);
    assert_eq!(relays[leader].1.metric("outbox_relay_leader"), Some(1.0));
    assert_eq!(relays[standby].1.metric("outbox_relay_leader"), Some(0.0));
    let active = active_instance(&client).await.expect("one instance holds the lock");
    assert_eq!(active, relays[leader].0, "/readyz and the lock disagree on the active instance");

    // when the active instance is killed
    relays[leader].1.kill9();
    let killed_at = Instant::now();
    let more = 200;
    for i in 0..more {
        write_events(&mut writer, &s.aggregate_type, &format!("agg-{}", i % 50), 1, true).await;
    }

    // then the standby takes over and publishes what follows, in order
    let committed = committed_counts(&client).await;
    let mut all = records;
    all.extend(consume_unique(&consumer, more, IDLE, Duration::ZERO).await);
    let failover = killed_at.elapsed();
    all.extend(consume(&consumer, usize::MAX, LINGER).await); // late duplicates
    assert_delivered(&all, &committed);
    let survivor = active_instance(&client).await.expect("the standby took the lock");
    assert_eq!(survivor, relays[standby].0);
    relays[standby].1.wait_ready("active").await;
    // (how long it took is printed, not asserted: BENCHMARKS.md measures speed)
    eprintln!("failover: events written after the kill arrived {failover:?} after it");
}

/// Waits until one relay's /readyz says active and another's standby; returns their indexes.
async fn roles(relays: &[(&str, RelayProcess)]) -> (usize, usize) {
    let mut found = None;
    wait_until("one active and one standby instance on /readyz", async || {
        let bodies: Vec<String> =
            relays.iter().map(|(_, r)| r.readyz().map(|(_, body)| body).unwrap_or_default()).collect();
        let active = bodies.iter().position(|b| b.starts_with("active"));
        let standby = bodies.iter().position(|b| b.starts_with("standby"));
        found = active.zip(standby);
        found.is_some()
    })
    .await;
    found.unwrap()
}

/// The active instance never says standby and the standby never says active.
fn assert_roles_kept(relays: &[(&str, RelayProcess)], leader: usize, standby: usize) {
    let body = |i: usize| relays[i].1.readyz().map(|(_, body)| body).unwrap_or_default();
    let (leader_says, standby_says) = (body(leader), body(standby));
    assert!(!leader_says.starts_with("standby"), "{} lost the lead: {leader_says}", relays[leader].0);
    assert!(!standby_says.starts_with("active"), "{} became active too: {standby_says}", relays[standby].0);
}

#[tokio::test(flavor = "multi_thread")]
async fn poison_rows_are_dead_lettered_and_the_rest_flows() {
    // given a relay with a short metadata wait that does not ask the broker to create topics
    // (the test broker, as Kafka's default, creates any topic a producer's metadata request
    // allows it to), and rows that cannot be published among good ones (one naming its own
    // topic, which rows may here)
    let s = Setup::polling(|config| {
        let allowed = "[\"outbox.event.*\", \"no-such-topic-anywhere\"]";
        config.set("outbox", "row_topics", true).set_literal("outbox", "allowed_topics", allowed)
    })
    .await;
    let text = std::fs::read_to_string(s.config()).unwrap().replace(
        "[kafka]\n",
        "[kafka]\nproperties = { \"topic.metadata.propagation.max.ms\" = \"3000\", \"allow.auto.create.topics\" = \"false\" }\n",
    );
    std::fs::write(s.config(), text).unwrap();
    let client = s.db.client().await;
    client.batch_execute("ALTER TABLE outbox_events ALTER COLUMN aggregate_id DROP NOT NULL").await.unwrap();
    let insert = "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload, headers, topic) \
                  VALUES ($1, $2, 'E', $3::text::jsonb, $4::text::jsonb, $5)";
    let big = format!("{{\"blob\": \"{}\"}}", "x".repeat(2_000_000));
    // (aggregate_id, payload, headers, topic)
    type Row<'a> = (Option<&'a str>, String, Option<&'a str>, Option<&'a str>);
    let rows: Vec<Row> = vec![
        (
            Some("good-1"),
            "{\"seq\": 1}".into(),
            Some("{\"traceparent\": \"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\"}"),
            None,
        ),
        (None, "{\"seq\": 1}".into(), None, None),
        (Some("good-2"), "{\"seq\": 1}".into(), None, None),
        (Some("big"), big, None, None),
        (Some("good-3"), "{\"seq\": 1}".into(), None, None),
        (Some("lost"), "{\"seq\": 1}".into(), None, Some("no-such-topic-anywhere")),
        (Some("good-4"), "{\"seq\": 1}".into(), None, None),
    ];
    for (aggregate_id, payload, headers, topic) in &rows {
        client.execute(insert, &[&s.aggregate_type, aggregate_id, payload, headers, topic]).await.unwrap();
    }
    let consumer = consumer(&[&s.topic]);

    // when the relay runs
    let mut relay = s.start("relay");

    // then the good rows arrive, with the application's traceparent header
    let records = consume(&consumer, 4, IDLE).await;
    let keys: Vec<_> = records.iter().map(|r| r.key.clone().unwrap()).collect();
    assert_eq!(keys.len(), 4, "{keys:?}");
    for key in ["good-1", "good-2", "good-3", "good-4"] {
        assert!(keys.contains(&key.to_string()), "{key} missing from {keys:?}");
    }
    let good1 = records.iter().find(|r| r.key.as_deref() == Some("good-1")).unwrap();
    assert_eq!(good1.header("traceparent"), Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"));
    assert_eq!(good1.header("event_type"), Some("E"));
    assert_eq!(good1.header("aggregate_type"), Some(s.aggregate_type.as_str()));

    // and the three poison rows are in the dead-letter table with their reasons, none left behind
    let dead_lettered =
        relay.wait_metric("outbox_relay_events_dead_lettered_total{mode=\"polling\"}", |v| v >= 3.0).await;
    assert_eq!(dead_lettered, 3.0);
    let reasons: Vec<(Option<String>, String)> = client
        .query("SELECT row_data->>'aggregate_id', reason FROM outbox_dead_letter ORDER BY id", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(reasons.len(), 3, "{reasons:?}");
    let reason_of =
        |id: Option<&str>| reasons.iter().find(|(a, _)| a.as_deref() == id).map(|(_, r)| r.clone()).unwrap();
    assert!(reason_of(None).contains("aggregate_id is NULL"), "{reasons:?}");
    assert!(reason_of(Some("big")).to_lowercase().contains("size"), "{reasons:?}");
    assert!(reason_of(Some("lost")).contains("does not exist"), "{reasons:?}");
    assert_eq!(s.outbox_rows().await, 0);
    assert_eq!(relay.metric("outbox_relay_events_published_total{mode=\"polling\"}"), Some(4.0));
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0));
}

#[tokio::test(flavor = "multi_thread")]
async fn block_policy_stops_at_the_poison_row_until_it_is_fixed() {
    // given on_poison = "block" and a NULL aggregate id between two good rows
    let s = Setup::polling(|config| config.set("polling", "on_poison", "block")).await;
    let client = s.db.client().await;
    client.batch_execute("ALTER TABLE outbox_events ALTER COLUMN aggregate_id DROP NOT NULL").await.unwrap();
    for aggregate_id in [Some("before"), None, Some("after")] {
        insert_event(&client, &s.aggregate_type, aggregate_id).await;
    }
    let consumer = consumer(&[&s.topic]);
    let mut relay = s.start("relay");

    // then the row before it is published, and nothing after it while it is there
    let first = consume(&consumer, 1, IDLE).await;
    assert_eq!(first[0].key.as_deref(), Some("before"));
    let nothing = consume(&consumer, 1, Duration::from_secs(4)).await;
    assert!(nothing.is_empty(), "published past the blocking row: {nothing:?}");
    assert_eq!(s.outbox_rows().await, 2);
    assert_eq!(relay.metric("outbox_relay_events_published_total{mode=\"polling\"}"), Some(1.0));
    assert_eq!(relay.metric("outbox_relay_events_dead_lettered_total{mode=\"polling\"}"), Some(0.0));
    let (status, body) = relay.readyz().unwrap_or_default();
    assert!(status == 503 && body.contains("blocked at event"), "{status} {body}");
    assert_eq!(relay.metric("outbox_relay_events_blocked"), Some(1.0));

    // when the operator fixes the row in a transaction, nothing past it is published while that
    // transaction locks it (the claim skips locked rows: it must not skip the held one)
    let mut operator = s.db.client().await;
    let fix = operator.transaction().await.unwrap();
    fix.execute("UPDATE outbox_events SET aggregate_id = 'fixed' WHERE aggregate_id IS NULL", &[])
        .await
        .unwrap();
    let nothing = consume(&consumer, 1, Duration::from_secs(4)).await;
    assert!(nothing.is_empty(), "published past the held row while it was locked: {nothing:?}");

    // then once the fix commits, the rest flows
    fix.commit().await.unwrap();
    let mut rest: Vec<_> = consume(&consumer, 2, IDLE).await.into_iter().map(|r| r.key.unwrap()).collect();
    rest.sort(); // different keys, different partitions: no order between them
    assert_eq!(rest, ["after", "fixed"]);
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0));
}

#[tokio::test(flavor = "multi_thread")]
async fn debezium_style_table_relays_with_column_names_changed() {
    // given a Debezium-layout table and only column names changed in the config
    let s = Setup::polling(RelayToml::debezium_table).await;
    let client = s.db.client().await;
    client
        .batch_execute(
            &std::fs::read_to_string(repo_root().join("sql/examples/debezium_outbox.sql")).unwrap(),
        )
        .await
        .unwrap();
    let ids: Vec<String> = client
        .query(
            "INSERT INTO outboxevent (id, aggregatetype, aggregateid, type, payload) \
             SELECT gen_random_uuid(), $1, 'order-' || g, 'OrderCreated', jsonb_build_object('n', g) \
             FROM generate_series(1, 20) g RETURNING id::text",
            &[&s.aggregate_type],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let consumer = consumer(&[&s.topic]);

    // when the relay runs, then every row arrives keyed by aggregateid with its uuid as id header
    let mut relay = s.start("relay");
    let records = consume(&consumer, 20, IDLE).await;
    assert_eq!(records.len(), 20, "{}", relay.log_text());
    let mut got: Vec<String> = records.iter().map(|r| r.header("id").unwrap().to_string()).collect();
    let mut want = ids.clone();
    got.sort();
    want.sort();
    assert_eq!(got, want);
    assert!(
        records.iter().all(|r| r.key.as_deref().unwrap().starts_with("order-")
            && r.header("event_type") == Some("OrderCreated"))
    );
    // (the claim commits its DELETE after Kafka acknowledged: a consumer can see the records first)
    wait_until(relay.context("the published rows to be deleted".into()), async || {
        client.query_one("SELECT count(*) FROM outboxevent", &[]).await.unwrap().get::<_, i64>(0) == 0
    })
    .await;
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0));
}

#[tokio::test(flavor = "multi_thread")]
async fn mark_mode_sets_published_at_and_publishes_once() {
    // given after_publish = "mark"
    let s = Setup::polling(|config| config.set("polling", "after_publish", "mark")).await;
    let client = s.db.client().await;
    create_aggregates(&client, 5).await;
    let mut writer = s.db.client().await;
    for i in 0..30 {
        write_events(&mut writer, &s.aggregate_type, &format!("agg-{}", i % 5), 1, true).await;
    }
    let consumer = consumer(&[&s.topic]);

    // when the relay runs for a while
    let mut relay = s.start("relay");
    let records = consume_unique(&consumer, 30, IDLE, Duration::from_secs(3)).await;

    // then each event is published once and its row kept with published_at set
    let report = assert_delivered(&records, &committed_counts(&client).await);
    assert_eq!(report.duplicates, 0);
    let unmarked: i64 = client
        .query_one("SELECT count(*) FROM outbox_events WHERE published_at IS NULL", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!((s.outbox_rows().await, unmarked), (30, 0));
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0));
}

#[tokio::test(flavor = "multi_thread")]
async fn postgres_session_terminated_mid_run_loses_nothing() {
    // given a relay publishing while a writer writes
    let s = Setup::polling(|config| config).await;
    let client = s.db.client().await;
    create_aggregates(&client, 20).await;
    let consumer = consumer(&[&s.topic]);
    let mut relay = s.start("relay");
    let writer =
        tokio::spawn(write_concurrently_owned(s.db.url.clone(), s.aggregate_type.clone(), 20, 3_000));

    // when its PostgreSQL session is terminated, twice, while events flow
    let relay_sessions = "application_name = 'outbox-relay' AND datname = current_database()";
    let mut records = consume(&consumer, 300, IDLE).await;
    let mut last_kill = std::time::SystemTime::UNIX_EPOCH;
    for _ in 0..2 {
        let sql =
            format!("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE {relay_sessions}");
        last_kill = terminate_one(&client, &sql, &[]).await;
        records.extend(consume(&consumer, 300, IDLE).await);
    }
    let committed = writer.await.unwrap();

    // then it reconnects and every committed event arrives, in order
    let unique = unique_ids(&records);
    records.extend(consume_unique(&consumer, 3_000 - unique.len(), IDLE, LINGER).await);
    let report = assert_delivered(&records, &committed);
    assert_eq!(report.unique, 3_000);
    wait_reconnected(&client, relay_sessions, last_kill).await;
    relay.wait_ready("active").await;
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0));
}

#[tokio::test(flavor = "multi_thread")]
async fn rows_sharing_an_id_are_each_published_and_released_alone() {
    // given 20 events, then two rows the table owner wrote over the id trigger with the ids of
    // the 5th and 10th and an earlier created_at (an id-keeping import gone wrong, or a forgery)
    let s = Setup::polling(|config| config.set("polling", "batch_size", 1)).await;
    let mut client = s.db.client().await;
    for _ in 0..20 {
        insert_event(&client, &s.aggregate_type, Some("real")).await;
    }
    let ids = outbox_ids(&client).await;
    let tx = client.transaction().await.unwrap();
    tx.batch_execute("ALTER TABLE outbox_events DISABLE TRIGGER outbox_events_assign_id").await.unwrap();
    for id in [ids[4], ids[9]] {
        tx.execute(
            "INSERT INTO outbox_events (id, aggregate_type, aggregate_id, event_type, payload, created_at) \
             OVERRIDING SYSTEM VALUE VALUES ($1, $2, 'forged', 'E', '{}', now() - interval '1 minute')",
            &[&id, &s.aggregate_type],
        )
        .await
        .unwrap();
    }
    tx.batch_execute("ALTER TABLE outbox_events ENABLE TRIGGER outbox_events_assign_id").await.unwrap();
    tx.commit().await.unwrap();
    let consumer = consumer(&[&s.topic]);

    // when the relay claims them one row at a time
    let mut relay = s.start("relay");
    let records = consume(&consumer, 22, IDLE).await;

    // then each of the 22 rows reached Kafka: releasing one row deleted no other of the same id
    let published = |aggregate: &str| records.iter().filter(|r| r.key.as_deref() == Some(aggregate)).count();
    assert_eq!((published("real"), published("forged")), (20, 2), "{records:?}");
    // (the last row is released just after Kafka acknowledged its record: a consumer can be faster)
    wait_until("every row to be released", async || s.outbox_rows().await == 0).await;
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0));
}

/// The polling lock's key as docs/polling.md documents it: derived from the outbox
/// table's name and `polling.leader_lock_key` (default 122550254464888).
const LOCK_KEY_SQL: &str = "SELECT hashtextextended('public.outbox_events', 122550254464888)";

/// A session of a new role that may only log in (no grant on the outbox): no relay.
async fn stranger(s: &Setup) -> (String, tokio_postgres::Client) {
    let role = format!("stranger_{}", random_suffix());
    s.db.client().await.batch_execute(&format!("CREATE ROLE {role} LOGIN")).await.unwrap();
    let mut config: tokio_postgres::Config = s.db.url.parse().unwrap();
    config.user(&role).application_name("psql");
    let (client, connection) = config.connect(tokio_postgres::NoTls).await.unwrap();
    tokio::spawn(connection);
    (role, client)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_session_that_is_no_relay_holding_the_lock_is_named_on_readyz() {
    // given a session of a role with no grant on the outbox holding the polling lock
    let s = Setup::polling(|config| config).await;
    let client = s.db.client().await;
    create_aggregates(&client, 1).await;
    let consumer = consumer(&[&s.topic]);
    let (role, stranger) = stranger(&s).await;
    let pid: i32 = stranger.query_one("SELECT pg_backend_pid()", &[]).await.unwrap().get(0);
    stranger.query_one(&format!("SELECT pg_advisory_lock(({LOCK_KEY_SQL}))"), &[]).await.unwrap();

    // when the relay starts
    let mut relay = s.start("relay");

    // then /readyz (from loopback) is degraded and names the holder and the remedy, and so does the log
    let named = relay.context(format!("/readyz to name pid {pid} as no relay"));
    wait_until(named, async || {
        relay.readyz().is_some_and(|(status, body)| {
            status == 503
                && body.starts_with("degraded")
                && body.contains(&format!("pid {pid} (role \"{role}\", application \"psql\""))
                && body.contains("not a relay")
                && body.contains(&format!("pg_terminate_backend({pid})"))
        })
    })
    .await;
    assert!(relay.log_text().contains("not a relay"), "{}", relay.log_text());

    // when the holder's session ends, then the relay takes over and relays
    let ended: bool = client.query_one("SELECT pg_terminate_backend($1)", &[&pid]).await.unwrap().get(0);
    assert!(ended);
    relay.wait_ready("active").await;
    let mut writer = s.db.client().await;
    write_events(&mut writer, &s.aggregate_type, "agg-0", 3, true).await;
    assert_eq!(consume(&consumer, 3, IDLE).await.len(), 3, "{}", relay.log_text());
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0));
}

#[tokio::test(flavor = "multi_thread")]
async fn the_old_fixed_lock_key_held_by_no_relay_does_not_stall_polling() {
    // given a session of a role with no grant holding polling.leader_lock_key itself (the fixed
    // key every relay took before the lock was derived per table)
    let s = Setup::polling(|config| config).await;
    let client = s.db.client().await;
    create_aggregates(&client, 1).await;
    let consumer = consumer(&[&s.topic]);
    let (_, stranger) = stranger(&s).await;
    stranger.query_one("SELECT pg_advisory_lock(122550254464888)", &[]).await.unwrap();

    // when the relay starts, then it is active and relays
    let mut relay = s.start("relay");
    relay.wait_ready("active").await;
    let mut writer = s.db.client().await;
    write_events(&mut writer, &s.aggregate_type, "agg-0", 3, true).await;
    assert_eq!(consume(&consumer, 3, IDLE).await.len(), 3, "{}", relay.log_text());

    // and a session that could claim rows (an older relay, as far as this one can tell) holding
    // the old key keeps a second relay a standby that names it
    let older = s.db.client().await;
    let older_pid: i32 = older.query_one("SELECT pg_backend_pid()", &[]).await.unwrap().get(0);
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0));
    drop(stranger);
    wait_until("the stranger's lock to go", async || {
        older.query_one("SELECT pg_try_advisory_lock(122550254464888)", &[]).await.unwrap().get::<_, bool>(0)
    })
    .await;
    let mut second = s.start("second");
    let named = second.context(format!("/readyz to say standby, naming pid {older_pid}"));
    wait_until(named, async || {
        second.readyz().is_some_and(|(status, body)| {
            status == 200 && body.starts_with("standby") && body.contains(&format!("pid {older_pid}"))
        })
    })
    .await;
    assert_eq!(second.terminate(EXIT_LIMIT), Some(0));
}
