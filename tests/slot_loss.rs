//! A slot PostgreSQL invalidates, on a server of each test's own (the settings are server-wide):
//! by removing WAL past `max_slot_wal_keep_size` (every major), and on 18 by
//! `idle_replication_slot_timeout`. The relay refuses to stream from it, naming the cause and
//! its fix, and `setup --recreate-slot` publishes what the table holds and the topic does not.

use crate::common;

use std::collections::HashMap;
use std::time::Duration;

use common::workload::insert_event;
use common::*;
use tokio_postgres::Client;

/// A streaming setup on a fresh server started with `env`; the relay has published one event
/// and stopped, and a second event was written after it.
async fn published_then_stopped(env: &[(&str, &str)]) -> (HashMap<String, String>, Setup, Client) {
    let (server, s) = on_own_server(env, |config| config).await;
    let client = s.db.client().await;
    let consumer = consumer(&[&s.topic]);
    let mut relay = s.start("relay");
    relay.wait_ready("active").await;
    insert_event(&client, &s.aggregate_type, Some("before")).await;
    assert_eq!(consume(&consumer, 1, IDLE).await.len(), 1, "{}", relay.log_text());
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0));
    insert_event(&client, &s.aggregate_type, Some("while-stopped")).await;
    (server, s, client)
}

/// A streaming setup (its configuration changed by `more`) on a fresh server started with
/// `env`.
async fn on_own_server(
    env: &[(&str, &str)],
    more: impl FnOnce(RelayToml) -> RelayToml,
) -> (HashMap<String, String>, Setup) {
    let server = hold("hold-postgres", env);
    let db = TestDb::create_at(&server["OUTBOX_RELAY_TEST_PG_URL"], "", true).await;
    let s =
        Setup::create_on(db, &services().kafka, "", true, |slot| more(RelayToml::replication(slot))).await;
    (server, s)
}

/// Checkpoints until `slot` reports `wal_status = lost`, `more_wal` moving the server on.
async fn checkpoint_until_lost(client: &Client, slot: &str, more_wal: &str) {
    wait_until_within(Duration::from_secs(60), format!("slot {slot} to be invalidated"), async || {
        client.batch_execute(more_wal).await.unwrap();
        client.batch_execute("CHECKPOINT").await.unwrap();
        let status: Option<String> = client
            .query_one("SELECT wal_status FROM pg_replication_slots WHERE slot_name = $1", &[&slot])
            .await
            .unwrap()
            .get(0);
        status.as_deref() == Some("lost")
    })
    .await;
}

/// The relay refuses the lost slot with `says`; `setup --recreate-slot` then publishes the row
/// written while it was stopped, and not the one the topic already holds. Returns what setup
/// printed.
async fn refused_then_recreated(s: &Setup, says: &[&str]) -> String {
    let config = s.config().display().to_string();
    let (code, _, stderr) = run_relay(&["run", "--config", &config], EXIT_LIMIT);
    assert_eq!(code, 1, "{stderr}");
    for part in says {
        assert!(stderr.contains(part), "{part}: {stderr}");
    }
    let consumer = consumer(&[&s.topic]);
    let (code, stdout, stderr) = run_relay(&["setup", "--recreate-slot", "--config", &config], EXIT_LIMIT);
    assert_eq!(code, 0, "{stdout}{stderr}");
    let mut keys: Vec<String> = consume(&consumer, 2, IDLE).await.into_iter().filter_map(|r| r.key).collect();
    keys.extend(consume(&consumer, usize::MAX, LINGER).await.into_iter().filter_map(|r| r.key));
    assert_eq!(keys, ["before", "while-stopped"], "{stdout}{stderr}");
    format!("{stdout}{stderr}")
}

#[tokio::test(flavor = "multi_thread")]
async fn a_slot_invalidated_for_removed_wal_is_refused_naming_the_setting() {
    // given a relay stopped behind its slot on a server that keeps at most 1 MB of WAL for slots
    let (_server, s, client) =
        published_then_stopped(&[("OUTBOX_PG_EXTRA_OPTS", "-c max_slot_wal_keep_size=1MB")]).await;
    let version = server_version(&client).await;

    // when the server writes and recycles WAL past that
    checkpoint_until_lost(
        &client,
        &s.slot,
        "SELECT pg_switch_wal(); CREATE TEMP TABLE IF NOT EXISTS w (x int); INSERT INTO w VALUES (1)",
    )
    .await;

    // then the relay stops, naming the cause (17+ says it) and the setting; recreate recovers
    let reason = if version >= 170_000 {
        "invalidation_reason = wal_removed"
    } else {
        "not reported before PostgreSQL 17"
    };
    let setup =
        refused_then_recreated(&s, &[reason, "raise max_slot_wal_keep_size", "setup --recreate-slot"]).await;
    // and setup warns that the setting that lost the slot is still in force
    assert!(setup.contains("max_slot_wal_keep_size = 1MB is still the value that lost the slot"), "{setup}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_slot_invalidated_for_idling_is_refused_naming_the_timeout_since_pg18() {
    // (idle_replication_slot_timeout is new in 18)
    require_major(18).await;
    // given a relay stopped, its slot idle, on a server whose slots may idle 1 s
    let (_server, s, client) = published_then_stopped(&[]).await;
    client.batch_execute("ALTER SYSTEM SET idle_replication_slot_timeout = '1s'").await.unwrap();
    client.batch_execute("SELECT pg_reload_conf()").await.unwrap();

    // when a checkpoint finds it idle past that
    checkpoint_until_lost(&client, &s.slot, "SELECT pg_sleep(1.1)").await;

    // then the relay stops naming the timeout; recreate recovers
    let setup = refused_then_recreated(
        &s,
        &["invalidation_reason = idle_timeout", "raise idle_replication_slot_timeout"],
    )
    .await;
    // (max_slot_wal_keep_size did not lose it)
    assert!(!setup.contains("still the value that lost the slot"), "{setup}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_lost_slot_recovered_with_skip_published_sends_only_what_kafka_lacks_and_verify_agrees() {
    // given a relay with the read-back off (dedup.enabled = false) that published 200 events and
    // stopped, 50 more written meanwhile, on a server that keeps at most 1 MB of WAL for slots
    let env = [("OUTBOX_PG_EXTRA_OPTS", "-c max_slot_wal_keep_size=1MB")];
    let (_server, s) = on_own_server(&env, |config| config.set("dedup", "enabled", false)).await;
    let client = s.db.client().await;
    let consumer = consumer(&[&s.topic]);
    let mut relay = s.start("relay");
    relay.wait_ready("active").await;
    for i in 0..200 {
        insert_event(&client, &s.aggregate_type, Some(&format!("a-{}", i % 7))).await;
    }
    assert_eq!(consume(&consumer, 200, IDLE).await.len(), 200, "{}", relay.log_text());
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0));
    for i in 0..50 {
        insert_event(&client, &s.aggregate_type, Some(&format!("a-{}", i % 7))).await;
    }

    // when the slot is lost and recreated with --skip-published
    checkpoint_until_lost(
        &client,
        &s.slot,
        "SELECT pg_switch_wal(); CREATE TEMP TABLE IF NOT EXISTS w (x int)",
    )
    .await;
    let config = s.config().display().to_string();
    let (code, stdout, stderr) =
        run_relay(&["setup", "--recreate-slot", "--skip-published", "--config", &config], EXIT_LIMIT);

    // then only the 50 Kafka lacked are sent, it says so, and verify finds every row once
    assert_eq!(code, 0, "{stdout}{stderr}");
    assert!(stdout.contains("50 published, 200 already in Kafka"), "{stdout}");
    assert_eq!(consume(&consumer, usize::MAX, LINGER).await.len(), 50);
    let (code, stdout, stderr) = run_relay(&["verify", "--config", &config, "--format", "json"], EXIT_LIMIT);
    let report: serde_json::Value = serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{e}: {stderr}"));
    assert_eq!(code, 0, "{report}");
    assert_eq!((report["rows"].as_u64(), report["records"].as_u64()), (Some(250), Some(250)), "{report}");
    for class in ["missing", "pending", "duplicated"] {
        assert_eq!(report[class]["count"], 0, "{class}: {report}");
    }
}
