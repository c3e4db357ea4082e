//! Polling mode against the real PostgreSQL and broker, with the relay as a child process:
//! no loss, no phantom, per-aggregate order, across crashes, broker refusals and failover.

mod common;

use std::time::{Duration, Instant};

use common::process::RelayProcess;
use common::workload::*;
use common::*;

impl Setup {
    async fn new(extra_config: &str) -> Setup {
        Setup::create(&services().kafka, "", true, |_| {
            format!("[source]\nmode = \"polling\"\n[polling]\npoll_interval_ms = 200\nbatch_size = 200\n{extra_config}")
        })
        .await
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn ten_thousand_concurrent_events_arrive_once_in_order() {
    // given a running relay and 100 aggregates
    let s = Setup::new("").await;
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
    assert_eq!(s.outbox_rows().await, 0, "published rows are deleted");

    // and SIGTERM stops it cleanly with exit status 0
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0), "{}", relay.log_text());
}

#[tokio::test(flavor = "multi_thread")]
async fn kill_9_mid_run_loses_nothing_and_keeps_order() {
    // given a relay publishing while writers write
    let s = Setup::new("").await;
    create_aggregates(&s.db.client().await, 100).await;
    let consumer = consumer(&[&s.topic]);
    let mut relay = s.start("first");
    let writer =
        tokio::spawn(write_concurrently_owned(s.db.url.clone(), s.aggregate_type.clone(), 100, 6_000));

    // when the relay is killed with SIGKILL once events are flowing (500 published: written,
    // and gone from the outbox), not once the consumer saw them, which may be after the end
    let client = s.db.client().await;
    let published = "SELECT (SELECT coalesce(sum(seq), 0) FROM test_aggregates)::bigint \
                     - (SELECT count(*) FROM outbox_events)";
    let deadline = Instant::now() + IDLE;
    while client.query_one(published, &[]).await.unwrap().get::<_, i64>(0) < 500 {
        assert!(Instant::now() < deadline, "events did not start flowing");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    relay.kill9();
    let early = consume(&consumer, 500, IDLE).await;
    assert_eq!(early.len(), 500, "events did not start flowing");
    let committed = writer.await.unwrap();
    let backlog = s.outbox_rows().await;
    let mut relay = s.start("second");

    // then after a restart every committed event arrives, first arrivals in order, and the
    // only duplicates are from the one batch in flight at the kill
    let mut records = early;
    let unique_so_far = unique_ids(&records).len();
    records.extend(consume_unique(&consumer, 6_000 - unique_so_far, IDLE, LINGER).await);
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
    use rdkafka::mocking::MockCluster;
    use rdkafka::types::{RDKafkaApiKey, RDKafkaRespErr};

    // given a relay whose broker (librdkafka's mock cluster) refuses every produce request
    let mock = MockCluster::new(1).unwrap();
    let db = TestDb::new().await;
    let aggregate_type = format!("t{}", random_suffix());
    let topic = format!("outbox.event.{aggregate_type}");
    mock.create_topic(&topic, 2, 1).unwrap();
    mock.request_errors(
        RDKafkaApiKey::Produce,
        &[RDKafkaRespErr::RD_KAFKA_RESP_ERR_NOT_ENOUGH_REPLICAS; 100_000],
    );
    let dir = tempfile::tempdir().unwrap();
    let config = write_config_with(
        dir.path(),
        &db,
        &mock.bootstrap_servers(),
        "stall_warning_ms = 2000\n[kafka.properties]\n\"reconnect.backoff.max.ms\" = \"500\"\n\"retry.backoff.ms\" = \"50\"",
        "[source]\nmode = \"polling\"\n",
    );
    let client = db.client().await;
    create_aggregates(&client, 10).await;
    let mut writer = db.client().await;
    for i in 0..50 {
        write_events(&mut writer, &aggregate_type, &format!("agg-{}", i % 10), 1, true).await;
    }
    let mut relay = RelayProcess::start(&config, &dir.path().join("relay.log"));

    // when the relay tries for several message timeouts
    tokio::time::sleep(Duration::from_secs(8)).await;

    // then no row was deleted, and the relay says why it is retrying
    let rows: i64 = client.query_one("SELECT count(*) FROM outbox_events", &[]).await.unwrap().get(0);
    assert_eq!(rows, 50, "rows were released without an acknowledgement");
    assert!(relay.log_text().contains("Kafka has acknowledged nothing"), "{}", relay.log_text());
    assert!(relay.exited().is_none(), "the relay gave up: {}", relay.log_text());

    // when the broker accepts again, then everything is published once acknowledged
    mock.clear_request_errors(RDKafkaApiKey::Produce);
    let committed = committed_counts(&client).await;
    let mock_consumer: rdkafka::consumer::StreamConsumer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", mock.bootstrap_servers())
        .set("group.id", "refusal-test")
        .set("auto.offset.reset", "earliest")
        .create()
        .unwrap();
    rdkafka::consumer::Consumer::subscribe(&mock_consumer, &[&topic]).unwrap();
    let records = consume_unique(&mock_consumer, 50, IDLE, LINGER).await;
    assert_delivered(&records, &committed);
    let deadline = Instant::now() + IDLE;
    while client.query_one("SELECT count(*) FROM outbox_events", &[]).await.unwrap().get::<_, i64>(0) > 0 {
        assert!(Instant::now() < deadline, "rows were never released after acknowledgement");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(relay.log_text().contains("Kafka acknowledges records again"), "{}", relay.log_text());
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0));
}

/// application_name of the session holding the leader lock, if any.
async fn active_instance(client: &tokio_postgres::Client) -> Option<String> {
    client
        .query_opt(
            "SELECT a.application_name FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid \
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
    let s = Setup::new("").await;
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

    // when writers load the outbox for 30 s
    let load_until = Instant::now() + Duration::from_secs(30);
    let mut writer = s.db.client().await;
    let mut written = 0;
    while Instant::now() < load_until {
        let aggregate = format!("agg-{}", rand::random_range(0..50));
        written +=
            write_events(&mut writer, &s.aggregate_type, &aggregate, rand::random_range(1..=5), true).await;
        tokio::time::sleep(Duration::from_millis(5)).await;
    }

    // then everything arrives once, in per-aggregate order: one instance was active
    let committed = committed_counts(&client).await;
    let records = consume_unique(&consumer, written, IDLE, LINGER).await;
    let report = assert_delivered(&records, &committed);
    assert_eq!(report.duplicates, 0, "an event was published twice in steady state");
    let logs: String = relays.iter().map(|(_, r)| r.log_text()).collect();
    assert_eq!(logs.matches("active: this instance now relays the outbox").count(), 1, "{logs}");
    assert!(logs.contains("standby: another instance is active"), "{logs}");

    // when the active instance is killed
    let active = active_instance(&client).await.expect("one instance holds the lock");
    let index = relays.iter().position(|(name, _)| *name == active).unwrap();
    relays[index].1.kill9();
    let killed_at = Instant::now();
    let more = 200;
    for i in 0..more {
        write_events(&mut writer, &s.aggregate_type, &format!("agg-{}", i % 50), 1, true).await;
    }

    // then the standby takes over and publishes what follows, in order, within the failover time
    let committed = committed_counts(&client).await;
    let mut all = records;
    all.extend(consume_unique(&consumer, more, IDLE, LINGER).await);
    let failover = killed_at.elapsed();
    assert_delivered(&all, &committed);
    let survivor = active_instance(&client).await.expect("the standby took the lock");
    assert_ne!(survivor, active);
    eprintln!("failover: events written after the kill arrived {failover:?} after it");
    assert!(failover < Duration::from_secs(15), "failover took {failover:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn poison_rows_are_dead_lettered_and_the_rest_flows() {
    // given a relay with a short message timeout, and rows that cannot be published among good ones
    let s = Setup::new("").await;
    let text = std::fs::read_to_string(s.config())
        .unwrap()
        .replace("[kafka]\n", "[kafka]\nproperties = { \"topic.metadata.propagation.max.ms\" = \"3000\", \"allow.auto.create.topics\" = \"false\" }\n");
    std::fs::write(s.config(), text).unwrap();
    let client = s.db.client().await;
    client.batch_execute("ALTER TABLE outbox_events ALTER COLUMN aggregate_id DROP NOT NULL").await.unwrap();
    let insert = "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload, headers, topic) \
                  VALUES ($1, $2, 'E', $3::text::jsonb, $4::text::jsonb, $5)";
    let big = format!("{{\"blob\": \"{}\"}}", "x".repeat(2_000_000));
    let rows: Vec<(Option<&str>, String, Option<&str>, Option<&str>)> = vec![
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
    let deadline = Instant::now() + IDLE;
    let reasons: Vec<(Option<String>, String)> = loop {
        let dead = client
            .query("SELECT row_data->>'aggregate_id', reason FROM outbox_dead_letter ORDER BY id", &[])
            .await
            .unwrap();
        if dead.len() >= 3 || Instant::now() > deadline {
            break dead.iter().map(|r| (r.get(0), r.get(1))).collect();
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(reasons.len(), 3, "{reasons:?} {}", relay.log_text());
    let reason_of =
        |id: Option<&str>| reasons.iter().find(|(a, _)| a.as_deref() == id).map(|(_, r)| r.clone()).unwrap();
    assert!(reason_of(None).contains("aggregate_id is NULL"), "{reasons:?}");
    assert!(reason_of(Some("big")).to_lowercase().contains("size"), "{reasons:?}");
    assert!(reason_of(Some("lost")).contains("does not exist"), "{reasons:?}");
    assert_eq!(s.outbox_rows().await, 0);
    let log = relay.log_text();
    assert!(log.contains("event moved to the dead-letter table"), "{log}");
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0));
}

#[tokio::test(flavor = "multi_thread")]
async fn block_policy_stops_at_the_poison_row_until_it_is_fixed() {
    // given on_poison = "block" and a NULL aggregate id between two good rows
    let s = Setup::new("on_poison = \"block\"\n").await;
    let client = s.db.client().await;
    client.batch_execute("ALTER TABLE outbox_events ALTER COLUMN aggregate_id DROP NOT NULL").await.unwrap();
    for aggregate_id in [Some("before"), None, Some("after")] {
        client
            .execute(
                "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload) VALUES ($1, $2, 'E', '{}')",
                &[&s.aggregate_type, &aggregate_id],
            )
            .await
            .unwrap();
    }
    let consumer = consumer(&[&s.topic]);
    let mut relay = s.start("relay");

    // then the row before it is published, and nothing after it while it is there
    let first = consume(&consumer, 1, IDLE).await;
    assert_eq!(first[0].key.as_deref(), Some("before"));
    let nothing = consume(&consumer, 1, Duration::from_secs(4)).await;
    assert!(nothing.is_empty(), "published past the blocking row: {nothing:?}");
    assert_eq!(s.outbox_rows().await, 2);
    assert!(relay.log_text().contains("blocked at an unpublishable event"), "{}", relay.log_text());

    // when the operator fixes the row, then the rest flows
    client
        .execute("UPDATE outbox_events SET aggregate_id = 'fixed' WHERE aggregate_id IS NULL", &[])
        .await
        .unwrap();
    let mut rest: Vec<_> = consume(&consumer, 2, IDLE).await.into_iter().map(|r| r.key.unwrap()).collect();
    rest.sort(); // different keys, different partitions: no order between them
    assert_eq!(rest, ["after", "fixed"]);
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0));
}

#[tokio::test(flavor = "multi_thread")]
async fn debezium_style_table_relays_with_column_names_changed() {
    // given a Debezium-layout table and only column names changed in the config
    let config = "[outbox]\ntable = \"outboxevent\"\n[outbox.columns]\naggregate_type = \"aggregatetype\"\n\
                  aggregate_id = \"aggregateid\"\nevent_type = \"type\"\nheaders = \"\"\ntopic = \"\"\ncreated_at = \"\"\n";
    let s = Setup::new(config).await;
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
    let left: i64 = client.query_one("SELECT count(*) FROM outboxevent", &[]).await.unwrap().get(0);
    assert_eq!(left, 0);
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0));
}

#[tokio::test(flavor = "multi_thread")]
async fn mark_mode_sets_published_at_and_publishes_once() {
    // given after_publish = "mark"
    let s = Setup::new("after_publish = \"mark\"\n").await;
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
    let s = Setup::new("").await;
    let client = s.db.client().await;
    create_aggregates(&client, 20).await;
    let consumer = consumer(&[&s.topic]);
    let mut relay = s.start("relay");
    let writer =
        tokio::spawn(write_concurrently_owned(s.db.url.clone(), s.aggregate_type.clone(), 20, 3_000));

    // when its PostgreSQL session is terminated, twice, while events flow
    let mut records = consume(&consumer, 300, IDLE).await;
    for _ in 0..2 {
        let sql = "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
                   WHERE application_name = 'outbox-relay' AND datname = current_database()";
        terminate_one(&client, sql, &[]).await;
        records.extend(consume(&consumer, 300, IDLE).await);
    }
    let committed = writer.await.unwrap();

    // then it reconnects and every committed event arrives, in order
    let unique = unique_ids(&records);
    records.extend(consume_unique(&consumer, 3_000 - unique.len(), IDLE, LINGER).await);
    let report = assert_delivered(&records, &committed);
    assert_eq!(report.unique, 3_000);
    assert!(relay.log_text().contains("relay recovered"), "{}", relay.log_text());
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0));
}
