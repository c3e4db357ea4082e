//! The foundation against the real services: the schema, the broker round trip, `check`, and
//! configuration errors as a user meets them.

use crate::common;

use std::time::Duration;

use common::*;
use rdkafka::ClientConfig;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};

const RUN_TIMEOUT: Duration = Duration::from_secs(60);

#[tokio::test]
async fn schema_applies_and_partitions_are_maintained() {
    // given the migrations applied to a fresh database
    let db = TestDb::new().await;
    let client = db.client().await;

    // when an order and its event are written in one transaction
    client
        .batch_execute(&std::fs::read_to_string(repo_root().join("sql/examples/orders.sql")).unwrap())
        .await
        .unwrap();
    let order_id: i64 = client.query_one("SELECT place_order('c-1', 1999)", &[]).await.unwrap().get(0);

    // then the event lands in today's partition, not the default one
    let row = client
        .query_one("SELECT tableoid::regclass::text, aggregate_id, event_type FROM outbox_events", &[])
        .await
        .unwrap();
    let partition: String = row.get(0);
    assert!(partition.starts_with("outbox_events_p"), "landed in {partition}");
    assert_eq!(row.get::<_, String>(1), order_id.to_string());
    assert_eq!(row.get::<_, String>(2), "OrderPlaced");

    // and a rolled-back order leaves neither row
    client.batch_execute("BEGIN; SELECT place_order('c-2', 5); ROLLBACK;").await.unwrap();
    let events: i64 = client.query_one("SELECT count(*) FROM outbox_events", &[]).await.unwrap().get(0);
    let orders: i64 = client.query_one("SELECT count(*) FROM orders", &[]).await.unwrap().get(0);
    assert_eq!((events, orders), (1, 1));

    // and creating partitions again is idempotent
    let created: i32 = client.query_one("SELECT outbox_create_partitions(7)", &[]).await.unwrap().get(0);
    assert_eq!(created, 0);

    // and an old partition with an unpublished row is kept unless forced, then dropped
    client
        .batch_execute(
            "CREATE TABLE outbox_events_p20000101 PARTITION OF outbox_events
                 FOR VALUES FROM ('2000-01-01 00:00:00+00') TO ('2000-01-02 00:00:00+00');
             INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload, created_at)
                 VALUES ('order', '1', 'Old', '{}', '2000-01-01 12:00:00+00');",
        )
        .await
        .unwrap();
    let dropped: i32 =
        client.query_one("SELECT outbox_drop_partitions(interval '7 days')", &[]).await.unwrap().get(0);
    assert_eq!(dropped, 0);
    let dropped: i32 = client
        .query_one("SELECT outbox_drop_partitions(interval '7 days', force => true)", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(dropped, 1);
    let today_kept: i64 = client.query_one("SELECT count(*) FROM outbox_events", &[]).await.unwrap().get(0);
    assert_eq!(today_kept, 1);
}

#[tokio::test]
async fn broker_round_trip_with_acks_all() {
    // given a topic on the real broker
    let topic = random_topic("foundation");
    create_topic(&topic, 3).await;
    let consumer = consumer(&[&topic]);

    // when a record is produced with acks=all and idempotence, as the relay produces
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &services().kafka)
        .set("acks", "all")
        .set("enable.idempotence", "true")
        .create()
        .unwrap();
    let headers = OwnedHeaders::new().insert(Header { key: "event_type", value: Some("OrderPlaced") });
    producer
        .send(
            FutureRecord::to(&topic).key("order-1").payload("{\"total\":1}").headers(headers),
            Duration::from_secs(30),
        )
        .await
        .expect("broker acknowledges");

    // then a consumer reads it back with key, value and headers intact
    let records = consume(&consumer, 1, Duration::from_secs(30)).await;
    assert_eq!(records.len(), 1);
    assert_eq!(records[0].key.as_deref(), Some("order-1"));
    assert_eq!(records[0].payload.as_deref(), Some("{\"total\":1}"));
    assert_eq!(records[0].header("event_type"), Some("OrderPlaced"));
}

#[test]
fn the_configuration_builder_keeps_each_section_in_its_first_place_and_each_key_at_its_last_value() {
    let toml = RelayToml::polling()
        .set("polling", "batch_size", 200)
        .set("dedup", "enabled", false)
        .set("polling", "poll_interval_ms", 100)
        .kafka_property("retry.backoff.ms", "50")
        .to_string();
    assert_eq!(
        toml,
        "[source]\nmode = \"polling\"\n[polling]\npoll_interval_ms = 100\nbatch_size = 200\n\
         [dedup]\nenabled = false\n[kafka.properties]\n\"retry.backoff.ms\" = \"50\"\n"
    );
}

#[tokio::test]
async fn check_passes_against_the_local_environment() {
    let db = TestDb::new().await;
    let dir = tempfile::tempdir().unwrap();
    for mode in ["replication", "polling"] {
        let config = write_config(dir.path(), &db, RelayToml::mode(mode));
        let (code, stdout, stderr) = run_relay(&["check", "--config", config.to_str().unwrap()], RUN_TIMEOUT);
        assert_eq!(code, 0, "check failed in {mode} mode:\n{stdout}\n{stderr}");
        assert!(stdout.contains("OK   postgres.connect"), "{stdout}");
        assert!(stdout.contains("OK   outbox.table"), "{stdout}");
        assert!(stdout.contains("OK   kafka.brokers"), "{stdout}");
        assert!(!stdout.contains("FAIL"), "{stdout}");
    }
}

#[tokio::test]
async fn check_lists_the_topics_the_outbox_routes_to_and_warns_of_missing_ones() {
    // given an outbox whose newest rows route to one topic that exists and one that does not
    let db = TestDb::new().await;
    let dir = tempfile::tempdir().unwrap();
    let (present, absent) = (format!("p{}", random_suffix()), format!("a{}", random_suffix()));
    create_topic(&format!("outbox.event.{present}"), 1).await;
    let client = db.client().await;
    for aggregate_type in [&present, &present, &absent] {
        client
            .execute(
                "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload) VALUES ($1, 'k', 'E', '{}')",
                &[aggregate_type],
            )
            .await
            .unwrap();
    }

    // when check runs, then it names the missing topic, with how many rows go to it, as a WARN
    let config = write_config(dir.path(), &db, RelayToml::mode("polling"));
    let (code, stdout, stderr) = run_relay(&["check", "--config", config.to_str().unwrap()], RUN_TIMEOUT);
    assert_eq!(code, 0, "a missing topic is a warning, not a failure:\n{stdout}\n{stderr}");
    let line = stdout.lines().find(|l| l.contains("kafka.topics")).unwrap_or_default();
    assert!(line.starts_with("WARN"), "{stdout}");
    assert!(line.contains(&format!("outbox.event.{absent} (1 of the newest rows)")), "{stdout}");
    assert!(
        !line.contains(&format!("outbox.event.{present} ")),
        "an existing topic is not missing: {stdout}"
    );

    // and once the topic exists (and its metadata has settled), it is OK
    create_topic(&format!("outbox.event.{absent}"), 1).await;
    wait_until("check to find the created topic", async || {
        let (_, stdout, _) = run_relay(&["check", "--config", config.to_str().unwrap()], RUN_TIMEOUT);
        stdout.contains("OK   kafka.topics") && stdout.contains(&format!("outbox.event.{absent}"))
    })
    .await;
}

#[tokio::test]
async fn check_names_a_missing_fixed_topic_and_a_row_s_own_topic() {
    // given an empty outbox whose template is one fixed topic that does not exist
    let db = TestDb::new().await;
    let dir = tempfile::tempdir().unwrap();
    let fixed = format!("fixed{}", random_suffix());
    let config =
        write_config(dir.path(), &db, RelayToml::mode("polling").set("outbox", "topic_template", &fixed));
    let kafka_topics = || {
        let (_, stdout, _) = run_relay(&["check", "--config", config.to_str().unwrap()], RUN_TIMEOUT);
        stdout.lines().find(|l| l.contains("kafka.topics")).unwrap_or_default().to_string()
    };
    // then check warns of it before any row is written
    let line = kafka_topics();
    assert!(
        line.starts_with("WARN") && line.contains(&format!("topic {fixed} (outbox.topic_template")),
        "{line}"
    );

    // when it exists and a row names its own topic, which does not
    create_topic(&fixed, 1).await;
    let own = format!("own{}", random_suffix());
    db.client()
        .await
        .execute(
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload, topic) VALUES ('a', 'k', 'E', '{}', $1)",
            &[&own],
        )
        .await
        .unwrap();
    // then check names the row's topic (the column wins over the template)
    let line = kafka_topics();
    assert!(line.starts_with("WARN") && line.contains(&format!("{own} (1 of the newest rows)")), "{line}");
}

#[tokio::test]
async fn setup_in_polling_mode_sets_up_nothing_and_refuses_the_slot_flags() {
    let db = TestDb::new().await;
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), &db, RelayToml::mode("polling"));
    let config = config.to_str().unwrap();
    let (code, stdout, stderr) = run_relay(&["setup", "--config", config], RUN_TIMEOUT);
    assert_eq!(code, 0, "{stderr}");
    assert!(stdout.contains("nothing to set up"), "{stdout}");
    for flag in ["--recreate-slot", "--skip-published"] {
        let (code, _, stderr) = run_relay(&["setup", flag, "--config", config], RUN_TIMEOUT);
        assert_eq!(code, 2, "{flag}: {stderr}");
        assert!(stderr.contains("polling has no slot"), "{flag}: {stderr}");
    }
    let slots: i64 = db
        .client()
        .await
        .query_one("SELECT count(*) FROM pg_replication_slots WHERE database = current_database()", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(slots, 0, "a slot no one reads");
}

#[tokio::test]
async fn check_reports_missing_columns_and_unreachable_kafka() {
    let db = TestDb::new().await;
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), &db, "[outbox.columns]\naggregate_id = \"aggregateid\"\n");
    // point Kafka at a closed port
    let text = std::fs::read_to_string(&config).unwrap().replace(&services().kafka, "127.0.0.1:1");
    std::fs::write(&config, text).unwrap();
    let (code, stdout, _) = run_relay(&["check", "--config", config.to_str().unwrap()], RUN_TIMEOUT);
    assert_eq!(code, 1, "{stdout}");
    assert!(stdout.contains("FAIL outbox.table"), "{stdout}");
    assert!(stdout.contains("outbox.columns.aggregate_id = \"aggregateid\""), "{stdout}");
    assert!(stdout.contains("FAIL kafka.brokers"), "{stdout}");
}

#[tokio::test]
async fn check_fails_on_wal_level_replica_in_replication_mode() {
    // given a second PostgreSQL started with wal_level=replica
    let env = hold("hold-postgres", &[("OUTBOX_WAL_LEVEL", "replica")]);
    let url = &env["OUTBOX_RELAY_TEST_PG_URL"];
    let client = connect(url).await;
    apply_migrations(&client).await;
    let port = url.rsplit_once(':').unwrap().1.split('/').next().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("relay.toml");
    std::fs::write(
        &config,
        format!(
            "[source]\nmode = \"replication\"\n[postgres]\nport = {port}\nuser = \"postgres\"\nsslmode = \"disable\"\n\
             [kafka]\nbrokers = [\"{}\"]\n",
            services().kafka
        ),
    )
    .unwrap();

    // when check runs
    let (code, stdout, _) = run_relay(&["check", "--config", config.to_str().unwrap()], RUN_TIMEOUT);

    // then it fails with exit 1 and says how to fix wal_level
    assert_eq!(code, 1, "{stdout}");
    let line = stdout.lines().find(|l| l.contains("postgres.wal_level")).expect("a wal_level line");
    assert!(line.starts_with("FAIL"), "{line}");
    assert!(line.contains("wal_level = replica") && line.contains("wal_level = logical"), "{line}");
}

#[test]
fn invalid_configuration_exits_2_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("relay.toml");
    let cases = [
        ("[kafka]\nbrokers = [\"127.0.0.1:9092\"]\nbrokerz = []\n", "kafka.brokerz"),
        ("[kafka]\nbrokers = []\n", "kafka.brokers: must not be empty"),
        ("[kafka]\nbrokers = [\"127.0.0.1:9092\"]\n[polling]\nbatch_size = \"ten\"\n", "polling.batch_size"),
        ("[kafka]\nbrokers = [\"127.0.0.1:9092\"]\n[postgres]\nport = -1\n", "postgres.port"),
    ];
    for (toml, expected) in cases {
        std::fs::write(&path, toml).unwrap();
        for command in ["check", "run"] {
            let (code, _, stderr) = run_relay(&[command, "--config", path.to_str().unwrap()], RUN_TIMEOUT);
            assert_eq!(code, 2, "{command} with {toml:?}: {stderr}");
            assert!(stderr.contains(expected), "{command} with {toml:?}: expected {expected:?} in {stderr}");
        }
    }
}

#[test]
fn version_and_help_are_printed() {
    let (code, stdout, _) = run_relay(&["--version"], RUN_TIMEOUT);
    assert_eq!(code, 0);
    assert_eq!(stdout.trim(), format!("outbox-relay {}", env!("CARGO_PKG_VERSION")));
    let (code, stdout, _) = run_relay(&["check", "--help"], RUN_TIMEOUT);
    assert_eq!(code, 0);
    assert!(stdout.contains("--config"), "{stdout}");
}

#[tokio::test]
async fn check_on_a_database_without_the_migrations_says_so_and_blames_nothing_else() {
    // given a database none of sql/ was applied to
    let db = TestDb::with_schema(false).await;
    let dir = tempfile::tempdir().unwrap();
    for mode in ["replication", "polling"] {
        // when check runs
        let config = write_config(dir.path(), &db, RelayToml::mode(mode));
        let (code, stdout, stderr) = run_relay(&["check", "--config", config.to_str().unwrap()], RUN_TIMEOUT);
        assert_eq!(code, 1, "{stdout}{stderr}");
        let line = |check: &str| {
            let found = stdout.lines().find(|l| l.split_whitespace().nth(1) == Some(check));
            found.unwrap_or_default().to_string()
        };
        // then the table's absence is named, and what depends on it says so rather than blaming
        // ownership or a grant
        assert!(line("outbox.table").contains("table public.outbox_events does not exist"), "{stdout}");
        assert!(
            line("kafka.topics").contains("table public.outbox_events does not exist (outbox.table)"),
            "{stdout}"
        );
        assert!(!stdout.contains("db error"), "{mode}: a bare error: {stdout}");
        assert!(!stdout.contains("grant the relay role SELECT"), "{mode}: {stdout}");
        if mode == "replication" {
            let publication = line("replication.publication");
            assert!(
                publication.contains("cannot tell: table public.outbox_events does not exist"),
                "{stdout}"
            );
            assert!(
                line("replication.slot_memory").contains("relation \"outbox_relay_slots\" does not exist")
            );
        }
    }
}
