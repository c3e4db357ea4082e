//! Record formats (`outbox.format`): CloudEvents in both modes of the Kafka binding and
//! Debezium's outbox-router records, published through a relay killed with SIGKILL under load,
//! then read by a consumer that knows only the format: every committed event arrives once, in
//! per-aggregate order, because the read-back recognises records of every format.

use crate::common::workload::{assert_delivered, create_aggregates, write_concurrently};
use crate::common::{Consumed, IDLE, LINGER, RelayToml, Setup, consume, consumer};

/// The event inside a record of `format`, as a consumer of that format reads it: its id as the
/// `id` header and its payload, so the delivery checks apply unchanged.
fn unwrap_event(format: &str, record: &Consumed) -> Consumed {
    let mut event = record.clone();
    let (id, payload) = match format {
        "structured" => {
            assert_eq!(record.header("content-type"), Some("application/cloudevents+json; charset=UTF-8"));
            let envelope: serde_json::Value =
                serde_json::from_str(record.payload.as_deref().unwrap()).unwrap();
            // CloudEvents 1.0's required attributes, and this relay's mapping of them
            assert_eq!(envelope["specversion"], "1.0");
            assert_eq!(envelope["source"], "/tests/formats");
            assert_eq!(envelope["type"], "SeqEvent");
            assert_eq!(envelope["subject"].as_str(), record.key.as_deref());
            assert!(envelope["time"].as_str().is_some_and(|t| t.ends_with('Z')), "{envelope}");
            assert_eq!(envelope["datacontenttype"], "application/json");
            (envelope["id"].as_str().unwrap().to_string(), envelope["data"].to_string())
        }
        "binary" => {
            assert_eq!(record.header("ce_specversion"), Some("1.0"));
            assert_eq!(record.header("ce_source"), Some("/tests/formats"));
            assert_eq!(record.header("ce_type"), Some("SeqEvent"));
            assert_eq!(record.header("ce_subject"), record.key.as_deref());
            assert_eq!(record.header("content-type"), Some("application/json"));
            assert!(record.header("id").is_none() && record.header("event_type").is_none());
            (record.header("ce_id").unwrap().to_string(), record.payload.clone().unwrap())
        }
        "debezium" => {
            // JsonConverter (schemas off) with expand.json.payload: the payload as a document
            let key: String = serde_json::from_str(record.key.as_deref().unwrap()).unwrap();
            event.key = Some(key);
            assert!(record.header("event_type").is_none() && record.header("aggregate_type").is_none());
            (record.header("id").unwrap().to_string(), record.payload.clone().unwrap())
        }
        other => panic!("no format {other}"),
    };
    event.headers.retain(|(k, _)| k != "id");
    event.headers.push(("id".into(), id));
    event.payload = Some(payload);
    event
}

fn format_toml(config: RelayToml, format: &str) -> RelayToml {
    match format {
        "debezium" => config
            .set("outbox", "format", "debezium")
            .set("outbox.debezium", "key_converter", "json")
            .set("outbox.debezium", "value_converter", "json")
            .set("outbox.debezium", "expand_json_payload", true),
        mode => config.set("outbox", "format", "cloudevents").set("outbox.cloudevents", "mode", mode).set(
            "outbox.cloudevents",
            "source",
            "/tests/formats",
        ),
    }
}

/// A relay in `mode` publishing `format` records is killed with SIGKILL while writers write, and
/// started again: every committed event arrives, once, in per-aggregate order.
async fn a_format_through_a_kill_9(mode: &str, format: &str) {
    // given a relay whose outbox publishes `format` records
    let s = Setup::create(&crate::common::services().kafka, "", true, |slot| {
        format!("{}\n", format_toml(RelayToml::either(mode, slot), format))
    })
    .await;
    let client = s.db.client().await;
    create_aggregates(&client, 20).await;
    let consumer = consumer(&[&s.topic]);
    // (the first relay reports its position seldom: the slot sends again what it had sent)
    let mut relay = s.start_with_env("first", &[("OUTBOX_RELAY__REPLICATION__STATUS_INTERVAL_MS", "60000")]);
    relay.wait_ready("active").await;

    // when writers write and the relay is killed with SIGKILL once some events arrived
    let writer = tokio::spawn({
        let (url, aggregate_type) = (s.db.url.clone(), s.aggregate_type.clone());
        async move { write_concurrently(&url, &aggregate_type, 20, 1500, 4).await }
    });
    let mut records = consume(&consumer, 300, IDLE).await;
    assert!(!records.is_empty(), "{}", relay.log_text());
    relay.kill9();
    let committed = writer.await.unwrap();
    let mut relay = s.start("second");

    // then the consumer of the format gets every committed event once, in order
    let total: i64 = committed.values().sum();
    loop {
        let events: Vec<Consumed> = records.iter().map(|r| unwrap_event(format, r)).collect();
        let unique = crate::common::workload::unique_ids(&events).len();
        if unique as i64 >= total {
            break;
        }
        let more = consume(&consumer, total as usize - unique, IDLE).await;
        assert!(!more.is_empty(), "{unique} of {total} arrived: {}", relay.log_text());
        records.extend(more);
    }
    records.extend(consume(&consumer, usize::MAX, LINGER).await);
    let events: Vec<Consumed> = records.iter().map(|r| unwrap_event(format, r)).collect();
    let report = assert_delivered(&events, &committed);
    assert_eq!(report.unique as i64, total);
    assert_eq!(report.duplicates, 0, "the read-back recognises {format} records: {}", relay.log_text());
    if mode == "replication" {
        assert!(relay.log_text().contains("not sent again"), "the read-back was not put to the test");
    }
    eprintln!("{mode}, {format}: {total} events, {} records", records.len());
    assert_eq!(relay.terminate(crate::common::EXIT_LIMIT), Some(0), "{}", relay.log_text());
    // and `verify` reads the format: every row once, in order, none mismatched
    crate::common::assert_verified(&s.config(), 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn structured_cloudevents_through_a_kill_9_arrive_once_in_order() {
    a_format_through_a_kill_9("replication", "structured").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn binary_cloudevents_through_a_kill_9_arrive_once_in_order() {
    a_format_through_a_kill_9("polling", "binary").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn debezium_records_through_a_kill_9_arrive_once_in_order() {
    a_format_through_a_kill_9("replication", "debezium").await;
}

/// `deploy/local/debezium/run ARGS`: Debezium's connector and outbox router on Kafka Connect.
fn debezium(args: &[&str]) {
    let out = std::process::Command::new(crate::common::repo_root().join("deploy/local/debezium/run"))
        .args(args)
        .env_remove("OUTBOX_LOCAL_STATE")
        .output()
        .expect("run deploy/local/debezium/run");
    assert!(
        out.status.success(),
        "debezium/run {args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Writes `n` events of Debezium's outbox table (`sql/examples/debezium_outbox.sql`) for
/// aggregates `a-0` .. `a-4`, `first` on.
async fn write_debezium_rows(client: &tokio_postgres::Client, aggregate_type: &str, first: i32, n: i32) {
    client
        .execute(
            "INSERT INTO outboxevent (id, aggregatetype, aggregateid, type, payload) \
             SELECT gen_random_uuid(), $1, 'a-' || (i % 5), 'OrderCreated', \
                    jsonb_build_object('n', i, 'total', i * 1.5, 'lines', jsonb_build_array(jsonb_build_object('sku', 'x' || i))) \
             FROM generate_series($2::int, $2::int + $3::int - 1) i",
            &[&aggregate_type, &first, &n],
        )
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn a_cutover_from_debezium_with_skip_published_sends_nothing_twice() {
    // given the real Debezium outbox router (JSON converters, expand.json.payload) that published
    // 30 events of Debezium's outbox table, and was stopped; the rows are kept
    let s = Setup::create(&crate::common::services().kafka, "", true, |slot| {
        // (librdkafka's Java-compatible partitioner: Debezium's producer is Java's)
        let toml = RelayToml::replication(slot)
            .set("kafka.properties", "partitioner", "murmur2_random")
            .debezium_table()
            .set("outbox", "format", "debezium")
            .set("outbox.debezium", "key_converter", "json")
            .set("outbox.debezium", "value_converter", "json")
            .set("outbox.debezium", "expand_json_payload", true);
        format!("{toml}\n")
    })
    .await;
    let client = s.db.client().await;
    let table =
        std::fs::read_to_string(crate::common::repo_root().join("sql/examples/debezium_outbox.sql")).unwrap();
    client.batch_execute(&table).await.unwrap();
    let consumer = consumer(&[&s.topic]);
    let state = tempfile::tempdir().unwrap();
    let (state_dir, dbz_slot) =
        (state.path().to_str().unwrap(), format!("dbz_{}", s.slot.trim_start_matches("s_")));
    let kafka = crate::common::services().kafka.clone();
    debezium(&[
        "start",
        "--state",
        state_dir,
        "--pg-url",
        &s.db.url,
        "--bootstrap",
        &kafka,
        "--converters",
        "json-expanded",
        "--slot",
        &dbz_slot,
        "--publication",
        &format!("p_{dbz_slot}"),
    ]);
    write_debezium_rows(&client, &s.aggregate_type, 0, 30).await;
    let by_debezium = consume(&consumer, 30, IDLE).await;
    debezium(&["stop", "--state", state_dir]);
    client.execute("SELECT pg_drop_replication_slot($1)", &[&dbz_slot]).await.unwrap();
    assert_eq!(by_debezium.len(), 30);
    assert!(by_debezium.iter().all(|r| r.header("outbox_relay_source").is_none()));

    // when the relay's slot is set up with --skip-published (its first copy reads the 30 rows),
    // then it runs while 10 more are written
    let config = s.config().display().to_string();
    let (code, stdout, stderr) = crate::common::run_relay(
        &["setup", "--skip-published", "--config", &config],
        crate::common::EXIT_LIMIT,
    );
    assert_eq!(code, 0, "{stdout}{stderr}");
    assert!(stdout.contains("0 published, 30 already in Kafka"), "{stdout}{stderr}");
    let mut relay = s.start("relay");
    relay.wait_ready("active").await;
    write_debezium_rows(&client, &s.aggregate_type, 30, 10).await;
    let by_relay = consume(&consumer, 10, IDLE).await;
    let late = consume(&consumer, usize::MAX, LINGER).await;

    // then Kafka holds each of the 40 events once: Debezium's 30 and the relay's 10, in
    // Debezium's shape (key, value, id header), each aggregate on the partition Debezium used
    assert_eq!((by_relay.len(), late.len()), (10, 0), "{}", relay.log_text());
    let mut ids = std::collections::HashSet::new();
    let mut partition_of = std::collections::HashMap::new();
    for r in by_debezium.iter().chain(&by_relay) {
        assert!(ids.insert(r.header("id").unwrap().to_string()), "{} twice", r.header("id").unwrap());
        let key = r.key.clone().unwrap();
        assert!(key.starts_with("\"a-"), "a JSON string key: {key}");
        let value: serde_json::Value = serde_json::from_str(r.payload.as_deref().unwrap()).unwrap();
        assert!(value["lines"][0]["sku"].is_string(), "an expanded document: {value}");
        let partition = *partition_of.entry(key.clone()).or_insert(r.partition);
        assert_eq!(
            partition, r.partition,
            "aggregate {key}: Debezium and the relay chose different partitions"
        );
    }
    assert_eq!(ids.len(), 40);
    assert_eq!(relay.terminate(crate::common::EXIT_LIMIT), Some(0), "{}", relay.log_text());
}

/// Operator commands printed librdkafka's `enable.gapless.guarantee is experimental` (the
/// relay's own setting, not the user's), and `format = "debezium"` its partitioner warning in
/// every command: each warning once per process, the gapless one never. (No services: the
/// commands fail to connect, after loading the configuration and, `setup`, making its producers.)
#[test]
fn operator_commands_warn_of_the_partitioner_once_and_never_of_gapless() {
    // given a Debezium outbox without murmur2 and a transactional producer, nothing reachable
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("relay.toml");
    std::fs::write(
        &config,
        "[postgres]\nhost = \"127.0.0.1\"\nport = 1\nuser = \"u\"\ndatabase = \"d\"\npassword = \"p\"\n\
         [kafka]\nbrokers = [\"127.0.0.1:1\"]\ntransactional = true\n[outbox]\nformat = \"debezium\"\n",
    )
    .unwrap();
    for command in ["status", "setup", "verify", "locate"] {
        // when the command runs
        let mut args = vec![command, "--config", config.to_str().unwrap()];
        if command == "locate" {
            args.extend(["--id", "1"]);
        }
        let (_, stdout, stderr) = crate::common::run_relay(&args, crate::common::EXIT_LIMIT);
        // then the partitioner is named once, and gapless never
        assert_eq!(stderr.matches("partitioner = \"murmur2_random\"").count(), 1, "{command}: {stderr}");
        assert!(!format!("{stdout}{stderr}").contains("gapless"), "{command}: {stderr}");
    }
}
