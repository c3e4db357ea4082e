//! `outbox-relay verify` against the real PostgreSQL and broker: silent after a clean run in
//! both modes, and each class of fault found when it is put there by hand (a row the slot
//! skipped, a record with no row, a duplicate, a changed record, two records of one key swapped,
//! a row not yet published).

use crate::common;

use common::workload::*;
use common::*;
use serde_json::Value;

const EVENTS: usize = 300;

fn config(mode: &str) -> impl FnOnce(&str) -> RelayToml {
    let mode = mode.to_string();
    move |slot| match mode.as_str() {
        "polling" => RelayToml::mode("polling").set("polling", "after_publish", "mark"),
        _ => RelayToml::replication(slot),
    }
}

/// `verify --format json`: (exit code, report).
fn verify(s: &Setup, args: &[&str]) -> (i32, Value) {
    let config = s.config().display().to_string();
    let mut all = vec!["verify", "--config", &config, "--format", "json", "--wait-secs", "20"];
    all.extend_from_slice(args);
    let (code, stdout, stderr) = run_relay(&all, EXIT_LIMIT);
    let report = serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{e}: {stdout}{stderr}"));
    (code, report)
}

fn count(report: &Value, class: &str) -> u64 {
    report[class]["count"].as_u64().unwrap_or_else(|| panic!("no {class} in {report}"))
}

/// A relay of `mode` that published `EVENTS` events, stopped; the records as consumed.
async fn published(mode: &str) -> (Setup, Vec<Consumed>) {
    let (s, records, mut relay, _) = publishing(config(mode)).await;
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0), "{}", relay.log_text());
    (s, records)
}

/// A relay configured by `config` that published `EVENTS` events, still running; the records as
/// consumed, and a client of the database.
async fn publishing(
    config: impl FnOnce(&str) -> RelayToml,
) -> (Setup, Vec<Consumed>, common::process::RelayProcess, tokio_postgres::Client) {
    let s = Setup::create(&services().kafka, "", true, config).await;
    let mut client = s.db.client().await;
    create_aggregates(&client, 10).await;
    let consumer = consumer(&[&s.topic]);
    let relay = s.start("relay");
    relay.wait_ready("active").await;
    for i in 0..EVENTS / 3 {
        write_events(&mut client, &s.aggregate_type, &format!("agg-{}", i % 10), 3, true).await;
    }
    let records = consume_unique(&consumer, EVENTS, IDLE, LINGER).await;
    assert_eq!(unique_ids(&records).len(), EVENTS);
    (s, records, relay, client)
}

#[tokio::test(flavor = "multi_thread")]
async fn after_a_clean_run_verify_finds_everything_once_and_in_order_in_both_modes() {
    for mode in ["replication", "polling"] {
        // given a relay that published every event
        let (s, _) = published(mode).await;

        // when verify compares the table with the topic
        let (code, report) = verify(&s, &[]);

        // then every row is there, once, in order, as the relay maps it
        assert_eq!(code, 0, "{mode}: {report}");
        assert_eq!(report["rows"], EVENTS, "{mode}: {report}");
        assert_eq!(report["records"], EVENTS, "{mode}: {report}");
        for class in ["missing", "pending", "unexpected", "duplicated", "out_of_order", "mismatched"] {
            assert_eq!(count(&report, class), 0, "{mode} {class}: {report}");
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn verify_names_each_fault_put_into_the_topic_or_the_table_in_both_modes() {
    for mode in ["replication", "polling"] {
        faults_are_named(mode).await;
    }
}

async fn faults_are_named(mode: &str) {
    // given a relay that published every event
    let (s, records) = published(mode).await;
    let client = s.db.client().await;

    // when a record is sent twice, a record with no row appears, a record of an existing id
    // arrives with another value, two new events of one key arrive in the wrong order, and a
    // row is committed that the relay never sends (the slot moved past it, or marked published)
    produce_again(&records[0]).await;
    let mut phantom = records[1].clone();
    set_header(&mut phantom, "id", "987654321");
    produce_again(&phantom).await;
    let mut changed = records[2].clone();
    changed.payload = Some("{\"changed\": true}".into());
    produce_again(&changed).await;
    let swapped = skipped_rows(&s, &client, 3, mode).await;
    for id in [&swapped[1], &swapped[0]] {
        let mut record = records[3].clone();
        record.key = Some("agg-swap".into());
        record.payload = Some("{}".into());
        set_header(&mut record, "id", id);
        set_header(&mut record, "event_type", "E");
        record.headers.retain(|(k, _)| k != "outbox_relay_position");
        produce_again(&record).await;
    }
    let missing = &swapped[2];
    // (a relay streams again meanwhile, so verify knows what the slot has confirmed)
    let mut relay = (mode == "replication").then(|| s.start("again"));
    if let Some(relay) = &relay {
        relay.wait_ready("active").await;
    }

    // then verify fails, naming each
    let (code, report) = verify(&s, &["--show", "50"]);
    assert_eq!(code, 1, "{mode}: {report}");
    assert_eq!(count(&report, "missing"), 1, "{mode}: {report}");
    assert_eq!(report["missing"]["first"][0], missing.as_str(), "{mode}: {report}");
    assert_eq!(count(&report, "unexpected"), 1, "{mode}: {report}");
    assert!(report["unexpected"]["first"][0].as_str().unwrap().starts_with("987654321 ("), "{report}");
    assert_eq!(count(&report, "duplicated"), 2, "{mode}: {report}");
    assert_eq!(count(&report, "mismatched"), 1, "{mode}: {report}");
    assert_eq!(report["mismatched"]["first"][0], records[2].header("id").unwrap(), "{mode}: {report}");
    assert_eq!(count(&report, "out_of_order"), 1, "{mode}: {report}");
    assert!(report["out_of_order"]["first"][0].as_str().unwrap().contains("agg-swap"), "{report}");
    assert_eq!(count(&report, "pending"), 0, "{mode}: {report}");
    if let Some(relay) = &mut relay {
        assert_eq!(relay.terminate(EXIT_LIMIT), Some(0));
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn polling_rows_not_yet_published_are_pending_and_rows_marked_without_a_record_are_missing() {
    // given a polling relay (mark mode) that published every event, then stopped
    let (s, _) = published("polling").await;
    let client = s.db.client().await;

    // when one row is committed and not published yet
    insert_event(&client, &s.aggregate_type, Some("agg-late")).await;
    let (code, report) = verify(&s, &[]);

    // then it is pending, and verify says so with exit 3
    assert_eq!((code, count(&report, "pending"), count(&report, "missing")), (3, 1, 0), "{report}");

    // and when a row is marked published without ever reaching Kafka, it is missing
    client
        .execute("UPDATE outbox_events SET published_at = now() WHERE aggregate_id = 'agg-late'", &[])
        .await
        .unwrap();
    let (code, report) = verify(&s, &[]);
    assert_eq!((code, count(&report, "pending"), count(&report, "missing")), (1, 0, 1), "{report}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_window_limits_the_rows_compared_and_a_bad_bound_names_the_flag() {
    // given a relay that published every event, and a row that predates the window and was
    // never published
    let (s, _) = published("polling").await;
    let client = s.db.client().await;
    client
        .execute(
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload, created_at, published_at) \
             VALUES ($1, 'agg-old', 'E', '{}', now() - interval '2 days', now())",
            &[&s.aggregate_type],
        )
        .await
        .unwrap();

    // then the whole table shows it missing, the last hour does not
    let (code, report) = verify(&s, &[]);
    assert_eq!((code, count(&report, "missing")), (1, 1), "{report}");
    let (code, report) = verify(&s, &["--since", "1h"]);
    assert_eq!((code, &report["rows"]), (0, &Value::from(EVENTS)), "{report}");

    // and a bound PostgreSQL cannot read is refused naming the flag
    let config = s.config().display().to_string();
    let (code, _, stderr) =
        run_relay(&["verify", "--config", &config, "--since", "last tuesdayish"], EXIT_LIMIT);
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("--since"), "{stderr}");
}

/// [`write_while`] in the background, in the style of `mode` (replication: insert+delete), until
/// [`Writing::stop`].
struct Writing {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    task: tokio::task::JoinHandle<usize>,
}

impl Writing {
    async fn start(s: &Setup, mode: &str) -> Writing {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let client = s.db.client().await;
        let task =
            tokio::spawn(write_while(client, s.aggregate_type.clone(), mode == "replication", stop.clone()));
        Writing { stop, task }
    }

    /// Stops writing; how many events were written.
    async fn stop(self) -> usize {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.task.await.unwrap()
    }
}

/// Writes an event every 20 ms until `stop` (replication: deleted in the same transaction, as
/// the insert+delete style does); returns how many.
async fn write_while(
    mut client: tokio_postgres::Client,
    aggregate_type: String,
    delete: bool,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> usize {
    let insert = "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload) \
                  VALUES ($1, 'agg-live', 'E', '{}') RETURNING id";
    let mut written = 0;
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        let tx = client.transaction().await.unwrap();
        let id: i64 = tx.query_one(insert, &[&aggregate_type]).await.unwrap().get(0);
        if delete {
            tx.execute("DELETE FROM outbox_events WHERE id = $1", &[&id]).await.unwrap();
        }
        tx.commit().await.unwrap();
        written += 1;
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    written
}

fn set_header(record: &mut Consumed, name: &str, value: &str) {
    for (k, v) in &mut record.headers {
        if k == name {
            *v = value.to_string();
        }
    }
}

/// Commits `n` rows of key `agg-swap` that the relay never sends: the (inactive) slot moves
/// past them, or they are marked published as they are written. Returns their ids.
async fn skipped_rows(s: &Setup, client: &tokio_postgres::Client, n: usize, mode: &str) -> Vec<String> {
    let published_at = if mode == "polling" { "now()" } else { "NULL" };
    let mut ids = Vec::new();
    for _ in 0..n {
        let sql = format!(
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload, published_at) \
             VALUES ($1, 'agg-swap', 'E', '{{}}', {published_at}) RETURNING id::text"
        );
        ids.push(client.query_one(&sql, &[&s.aggregate_type]).await.unwrap().get(0));
    }
    if mode == "replication" {
        client
            .execute("SELECT pg_replication_slot_advance($1, pg_current_wal_lsn())", &[&s.slot])
            .await
            .unwrap();
    }
    ids
}

#[tokio::test(flavor = "multi_thread")]
async fn rows_deleted_after_publishing_are_vouched_for_and_a_phantom_and_a_lost_record_still_named() {
    for mode in ["polling", "replication"] {
        deleted_rows_are_vouched_for(mode).await;
    }
}

/// How the rows of published events leave the table.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Cleanup {
    Delete,
    /// `DROP TABLE` of the daily partitions holding them (what `outbox_drop_partitions` does).
    DropPartitions,
}

/// A relay of `mode` (polling deletes what it published) that published `EVENTS` events, still
/// running, with every row gone by `cleanup`: as [`publishing`].
async fn published_without_rows(
    mode: &str,
    cleanup: Cleanup,
) -> (Setup, Vec<Consumed>, common::process::RelayProcess, tokio_postgres::Client) {
    let mode = mode.to_string();
    let (s, records, relay, client) = publishing(move |slot| RelayToml::either(&mode, slot)).await;
    if cleanup == Cleanup::DropPartitions {
        let holding =
            client.query("SELECT DISTINCT tableoid::regclass::text FROM outbox_events", &[]).await.unwrap();
        for partition in holding.iter().map(|row| row.get::<_, String>(0)) {
            assert_ne!(partition, "outbox_events_default", "the rows are in no daily partition");
            client.batch_execute(&format!("DROP TABLE {partition}")).await.unwrap();
        }
    }
    client.execute("DELETE FROM outbox_events", &[]).await.unwrap();
    (s, records, relay, client)
}

/// Polling in `delete` mode, or replication with the rows deleted after publishing (a cleanup).
async fn deleted_rows_are_vouched_for(mode: &str) {
    // given a relay that published every event, and no row left of them
    // (the relay goes on streaming: verify knows what the slot has confirmed)
    let (s, records, mut relay, mut client) = published_without_rows(mode, Cleanup::Delete).await;

    // when verify compares the (empty) table with the topic
    let (code, report) = verify(&s, &[]);

    // then no record is unexpected: the relay's record of what it published vouches for each
    assert_eq!(code, 0, "{mode}: {report}");
    assert_eq!(report["published_elsewhere"], EVENTS, "{mode}: {report}");
    for class in ["missing", "pending", "unexpected", "duplicated", "out_of_order", "mismatched"] {
        assert_eq!(count(&report, class), 0, "{mode} {class}: {report}");
    }

    // when events are published while verify reads the topic (in replication written and
    // deleted in one transaction: the insert+delete style), then none of them is unexpected
    let writing = Writing::start(&s, mode).await;
    let (code, report) = verify(&s, &[]);
    let written = writing.stop().await;
    assert!(written > 0 && (code == 0 || code == 3), "{mode}: {written} written; {report}");
    assert_eq!((count(&report, "unexpected"), count(&report, "missing")), (0, 0), "{mode}: {report}");

    // when a record appears that no row ever had, and the record says an id was published that
    // Kafka lacks (an id after every one the sequence gave, in the same block of the record:
    // ids step by one since sql/013, so none lies between the events')
    let mut phantom = records[1].clone();
    set_header(&mut phantom, "id", "987654321");
    produce_again(&phantom).await;
    let last: i64 = client
        .query_one("SELECT pg_sequence_last_value(pg_get_serial_sequence('outbox_events', 'id'))", &[])
        .await
        .unwrap()
        .get(0);
    let lost = last + 100;
    assert_eq!(lost / 8192, last / 8192, "the lost id must be in a block the relay recorded");
    client
        .execute(
            "UPDATE outbox_relay_published SET ids = ids | (B'1'::bit(8192) >> ($1::bigint % 8192)::int) \
             WHERE block = $1::bigint / 8192",
            &[&lost],
        )
        .await
        .unwrap();

    // then verify names both
    let (code, report) = verify(&s, &["--show", "50"]);
    assert_eq!(code, 1, "{mode}: {report}");
    assert_eq!(count(&report, "unexpected"), 1, "{mode}: {report}");
    assert!(report["unexpected"]["first"][0].as_str().unwrap().starts_with("987654321 ("), "{report}");
    assert_eq!(count(&report, "missing"), 1, "{mode}: {report}");
    assert_eq!(report["missing"]["first"][0], format!("{lost} (published, row deleted)"), "{mode}: {report}");
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0), "{}", relay.log_text());
    if mode == "polling" {
        // and a row delete mode still holds is one not yet published: pending, not missing
        write_events(&mut client, &s.aggregate_type, "agg-1", 1, true).await;
        let (_, report) = verify(&s, &[]);
        assert_eq!((count(&report, "pending"), count(&report, "missing")), (1, 1), "{report}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn verify_watch_with_no_row_left_after_publishing_names_a_record_deleted_from_kafka() {
    for (mode, cleanup) in [
        ("polling", Cleanup::Delete),
        ("replication", Cleanup::Delete),
        ("replication", Cleanup::DropPartitions),
    ] {
        watch_without_rows(mode, cleanup).await;
    }
}

/// `verify --watch` where no row outlives its publishing: polling in `delete` mode, or
/// replication with the published rows deleted afterwards (or their partitions dropped) and the
/// live writer's rows written and deleted in one transaction (the insert+delete style).
async fn watch_without_rows(mode: &str, cleanup: Cleanup) {
    // given a relay that published every event, no row left of them, events still being written,
    // and `verify --watch` beside it
    let (s, records, mut relay, _client) = published_without_rows(mode, cleanup).await;
    let writing = Writing::start(&s, mode).await;
    let args = ["--every-secs", "1", "--wait-secs", "5", "--show", "5"];
    let log = s.dir.path().join("watch.log");
    let mut watch = common::process::RelayProcess::watch(&s.config(), &log, &args);

    // when it passes beside the relay
    watch.wait_ready("active").await;

    // then passes read every record, and the record of what was published vouches for each
    watch.wait_metric("outbox_relay_verify_records", |v| v >= EVENTS as f64).await;
    let scrape = watch.scrape();
    for class in ["missing_events", "unexpected_records", "duplicated_events", "out_of_order_events"] {
        let value = common::http::sample(&scrape, &format!("outbox_relay_verify_{class}"));
        assert_eq!(value, Some(0.0), "{mode} {cleanup:?} {class}:\n{scrape}\n{}", watch.log_text());
    }

    // when the first record of a partition is deleted from Kafka (DeleteRecords)
    let lost = delete_first_record(&records).await;

    // then the next pass counts it missing and names it
    watch.wait_metric("outbox_relay_verify_missing_events", |v| v >= 1.0).await;
    let scrape = watch.scrape();
    let named = format!("outbox_relay_verify_missing_event{{id=\"{lost}\"}}");
    assert!(
        common::http::sample(&scrape, &named).is_some(),
        "{mode} {cleanup:?}: {lost} is not named:\n{scrape}"
    );
    assert_eq!(common::http::sample(&scrape, "outbox_relay_verify_missing_events"), Some(1.0), "{scrape}");
    assert_eq!(
        common::http::sample(&scrape, "outbox_relay_verify_unexpected_records"),
        Some(0.0),
        "{scrape}"
    );

    // when the relay is stopped (the runbook's step 3), and the watch passes again
    assert!(writing.stop().await > 0);
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0), "{}", relay.log_text());
    let found = "outbox_relay_verify_passes_total{result=\"found\"}";
    let before = watch.metric(found).unwrap_or_default();
    watch.wait_metric(found, |v| v >= before + 2.0).await;

    // then the event is still missing and named: the alert does not resolve with nothing fixed
    let scrape = watch.scrape();
    assert_eq!(common::http::sample(&scrape, "outbox_relay_verify_missing_events"), Some(1.0), "{scrape}");
    assert!(
        common::http::sample(&scrape, &named).is_some(),
        "{mode} {cleanup:?}: {lost} is not named:\n{scrape}"
    );
    assert_eq!(watch.terminate(EXIT_LIMIT), Some(0), "{}", watch.log_text());
}

/// `locate --format json --id ID`: (exit code, receipt).
fn locate(s: &Setup, id: &str) -> (i32, Value) {
    let config = s.config().display().to_string();
    let args = ["locate", "--config", &config, "--id", id, "--format", "json", "--wait-secs", "10"];
    let (code, stdout, stderr) = run_relay(&args, EXIT_LIMIT);
    let receipt = serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{e}: {stdout}{stderr}"));
    (code, receipt)
}

#[tokio::test(flavor = "multi_thread")]
async fn the_verify_role_of_sql_100_verifies_and_locates_and_may_change_nothing() {
    // given a replication relay that published every event, streaming on, and its
    // configuration logging in as outbox_relay_verify instead
    let (s, records, mut relay, client) = publishing(config("replication")).await;
    let row = client
        .query_one(
            "SELECT r.rolreplication, bool_or(has_table_privilege('outbox_relay_verify', t, p)) \
             FROM pg_roles r, unnest(ARRAY['outbox_events', 'outbox_dead_letter', 'outbox_relay_slots', \
                  'outbox_relay_published']) t, unnest(ARRAY['INSERT', 'UPDATE', 'DELETE', 'TRUNCATE']) p \
             WHERE r.rolname = 'outbox_relay_verify' GROUP BY r.rolreplication",
            &[],
        )
        .await
        .unwrap();
    assert_eq!((row.get::<_, bool>(0), row.get::<_, bool>(1)), (false, false), "the role may write");
    // and may not read what verify does not: the relay's slot table, a business table
    client.batch_execute("CREATE TABLE orders_of_the_app (id bigint)").await.unwrap();
    let reads: bool = client
        .query_one(
            "SELECT has_table_privilege('outbox_relay_verify', 'outbox_relay_slots', 'SELECT') \
                 OR has_table_privilege('outbox_relay_verify', 'orders_of_the_app', 'SELECT')",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(!reads, "the role reads more than verify needs");
    let text = std::fs::read_to_string(s.config()).unwrap();
    assert!(text.contains("user = \"postgres\""), "{text}");
    let as_verify = s.dir.path().join("verify.toml");
    std::fs::write(&as_verify, text.replacen("user = \"postgres\"", "user = \"outbox_relay_verify\"", 1))
        .unwrap();
    let config = as_verify.display().to_string();

    // when verify compares the outbox with the topic as that role
    let args = ["verify", "--config", &config, "--format", "json", "--wait-secs", "20"];
    let (code, stdout, stderr) = run_relay(&args, EXIT_LIMIT);

    // then it reads everything it needs and finds every event once
    let report: Value = serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{e}: {stdout}{stderr}"));
    assert_eq!(code, 0, "{report}{stderr}");
    for class in ["missing", "pending", "unexpected", "duplicated", "out_of_order", "mismatched"] {
        assert_eq!(count(&report, class), 0, "{class}: {report}");
    }

    // and locate gives a receipt as that role
    let id = records[0].header("id").unwrap();
    let args = ["locate", "--config", &config, "--id", id, "--format", "json", "--wait-secs", "10"];
    let (code, stdout, stderr) = run_relay(&args, EXIT_LIMIT);
    let receipt: Value = serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{e}: {stdout}{stderr}"));
    assert_eq!((code, receipt["state"].as_str()), (0, Some("published")), "{receipt}{stderr}");

    // and verify --watch passes as that role, finding nothing missing
    let args = ["--every-secs", "1", "--wait-secs", "5"];
    let mut watch = common::process::RelayProcess::watch(&as_verify, &s.dir.path().join("watch.log"), &args);
    watch.wait_metric("outbox_relay_verify_rows", |v| v >= EVENTS as f64).await;
    assert_eq!(watch.metric("outbox_relay_verify_missing_events"), Some(0.0), "{}", watch.log_text());
    assert_eq!(watch.terminate(EXIT_LIMIT), Some(0), "{}", watch.log_text());
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0), "{}", relay.log_text());
}

#[tokio::test(flavor = "multi_thread")]
async fn locate_gives_each_event_its_receipt_published_dead_lettered_missing_pending_or_unknown() {
    // given a replication relay that published every event, streaming on
    let (s, records, mut relay, client) = publishing(config("replication")).await;

    // then a published event's receipt names the record the consumer read
    let read = &records[7];
    let id = read.header("id").unwrap();
    let (code, receipt) = locate(&s, id);
    assert_eq!((code, receipt["state"].as_str()), (0, Some("published")), "{receipt}");
    let record = &receipt["records"][0];
    assert_eq!(record["topic"], read.topic.as_str(), "{receipt}");
    assert_eq!(
        (record["partition"].as_i64(), record["offset"].as_i64()),
        (Some(read.partition.into()), Some(read.offset))
    );
    assert!(record["time"].as_str().is_some_and(|t| t.ends_with('Z')), "{receipt}");
    assert_eq!(receipt["records"].as_array().unwrap().len(), 1, "{receipt}");

    // when its record is sent again, then the receipt lists both
    produce_again(read).await;
    let (code, receipt) = locate(&s, id);
    assert_eq!((code, receipt["records"].as_array().map(Vec::len)), (0, Some(2)), "{receipt}");

    // when a row names a topic (rows may not: outbox.row_topics is off), then it is dead-lettered
    // and its receipt says why
    let sql = "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload, topic) \
               VALUES ($1, 'agg-1', 'E', '{}', 'elsewhere') RETURNING id::text";
    let lettered: String = client.query_one(sql, &[&s.aggregate_type]).await.unwrap().get(0);
    let mut receipt = Value::Null;
    wait_until(relay.context("the row to be dead-lettered".into()), async || {
        receipt = locate(&s, &lettered).1;
        receipt["state"] == "dead_lettered"
    })
    .await;
    assert!(receipt["dead_letter"].as_str().unwrap().contains("row_topics"), "{receipt}");

    // when rows are committed that the (stopped) relay's slot moves past, and the relay streams
    // again, then such a row is missing: owed, and not in Kafka
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0));
    let skipped = skipped_rows(&s, &client, 1, "replication").await;
    let mut again = s.start("again");
    again.wait_ready("active").await;
    let (code, receipt) = locate(&s, &skipped[0]);
    assert_eq!((code, receipt["state"].as_str()), (1, Some("missing")), "{receipt}");
    assert_eq!(receipt["in_table"], true, "{receipt}");

    // when no relay streams and a row is committed, then it is pending, and says why
    assert_eq!(again.terminate(EXIT_LIMIT), Some(0));
    let sql = "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload) \
               VALUES ($1, 'agg-1', 'E', '{}') RETURNING id::text";
    let waiting: String = client.query_one(sql, &[&s.aggregate_type]).await.unwrap().get(0);
    let (code, receipt) = locate(&s, &waiting);
    assert_eq!((code, receipt["state"].as_str()), (3, Some("pending")), "{receipt}");
    assert!(receipt["said"].as_str().unwrap().contains("no relay streams"), "{receipt}");

    // and an id nothing knows is unknown; one that is no number is refused, naming the flag
    let (code, receipt) = locate(&s, "987654321");
    assert_eq!((code, receipt["state"].as_str()), (1, Some("unknown")), "{receipt}");
    let config = s.config().display().to_string();
    let (code, _, stderr) = run_relay(&["locate", "--config", &config, "--id", "abc"], EXIT_LIMIT);
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("--id \"abc\""), "{stderr}");
}

#[tokio::test(flavor = "multi_thread")]
async fn republish_sends_chosen_events_again_as_first_written_in_order_once_each() {
    // given a relay that published every event (30 per aggregate) and streams on
    let (s, records, mut relay, _client) = publishing(config("replication")).await;
    let config = s.config().display().to_string();
    let republish = |extra: &[&str]| {
        let mut args = vec!["republish", "--config", config.as_str()];
        args.extend_from_slice(extra);
        run_relay(&args, EXIT_LIMIT)
    };

    // when republish is asked beside the running relay, then it refuses, naming the relay's
    // sessions; a dry run says what it would send and sends nothing
    let (code, _, stderr) = republish(&["--aggregate", "agg-3"]);
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("a relay of this outbox is connected"), "{stderr}");
    let (code, stdout, _) = republish(&["--aggregate", "agg-3", "--dry-run"]);
    assert_eq!(code, 0, "{stdout}");
    assert_eq!(stdout.matches("as first written").count(), 30, "{stdout}");

    // when the relay is stopped and agg-3's events, then two ids (one with no row), are sent again
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0));
    let (code, stdout, stderr) = republish(&["--aggregate", "agg-3"]);
    assert_eq!(code, 0, "{stdout}{stderr}");
    assert!(stdout.contains("sent 30 event(s) again; 0 could not be"), "{stdout}");
    let two: Vec<&str> = records
        .iter()
        .filter(|r| r.key.as_deref() == Some("agg-5"))
        .take(2)
        .map(|r| r.header("id").unwrap())
        .collect();
    let ids = format!("{},{},987654321", two[0], two[1]);
    let (code, stdout, _) = republish(&["--ids", &ids]);
    assert_eq!(code, 1, "{stdout}");
    assert!(stdout.contains("event 987654321: no row"), "{stdout}");
    assert!(stdout.contains("sent 2 event(s) again; 1 could not be"), "{stdout}");

    // then a consumer that lost its state (reading the topic from the start) gets each chosen
    // event once more: agg-3's in their first order, each copy the original's key, value,
    // headers and partition, plus the republished header
    let all = consume(&consumer(&[&s.topic]), EVENTS + 32, IDLE).await;
    assert_eq!(all.len(), EVENTS + 32, "records in the topic");
    let copies: Vec<&Consumed> =
        all.iter().filter(|r| r.header("outbox_relay_republished").is_some()).collect();
    assert_eq!(copies.len(), 32);
    let first_order: Vec<&str> = records
        .iter()
        .filter(|r| r.key.as_deref() == Some("agg-3"))
        .map(|r| r.header("id").unwrap())
        .collect();
    let copied_order: Vec<&str> = copies
        .iter()
        .filter(|r| r.key.as_deref() == Some("agg-3"))
        .map(|r| r.header("id").unwrap())
        .collect();
    assert_eq!(copied_order, first_order, "agg-3's events again, in their first order, once each");
    let copied_five: Vec<&str> = copies
        .iter()
        .filter(|r| r.key.as_deref() == Some("agg-5"))
        .map(|r| r.header("id").unwrap())
        .collect();
    assert_eq!(copied_five, two);
    for copy in copies {
        let original = records.iter().find(|r| r.header("id") == copy.header("id")).unwrap();
        assert_eq!(
            (&copy.key, &copy.payload, copy.partition),
            (&original.key, &original.payload, original.partition)
        );
        let headers: Vec<&(String, String)> =
            copy.headers.iter().filter(|(k, _)| k != "outbox_relay_republished").collect();
        assert_eq!(
            headers,
            original.headers.iter().collect::<Vec<_>>(),
            "the copy's headers are the original's"
        );
    }
    // and verify counts the copies as duplicates: nothing mismatched, out of order or missing
    let mut again = s.start("again");
    again.wait_ready("active").await;
    let (code, report) = verify(&s, &[]);
    assert_eq!(code, 0, "{report}");
    assert_eq!(
        (count(&report, "duplicated"), report["duplicate_records"].as_u64()),
        (32, Some(32)),
        "{report}"
    );
    for class in ["missing", "unexpected", "out_of_order", "mismatched"] {
        assert_eq!(count(&report, class), 0, "{class}: {report}");
    }
    assert_eq!(again.terminate(EXIT_LIMIT), Some(0));
}
