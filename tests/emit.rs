//! Who can put an event on a topic in replication mode: only a transaction that commits, through
//! the outbox table or `outbox_emit()`, by a role that was granted it. A non-transactional
//! message with the outbox prefix is never published, and a role with only CONNECT gets nothing
//! onto any topic.

use crate::common;

use std::time::Duration;

use common::*;

#[tokio::test(flavor = "multi_thread")]
async fn a_role_with_only_connect_gets_nothing_onto_any_topic() {
    // given a streaming relay and a role that may only connect
    let s = Setup::create(&services().kafka, "", true, RelayToml::replication).await;
    let admin = s.db.client().await;
    let intruder = format!("intruder_{}", random_suffix());
    admin.batch_execute(&format!("CREATE ROLE {intruder} LOGIN")).await.unwrap();
    let forged_topic = random_topic("forged");
    create_topic(&forged_topic, 1).await;
    let consumer = consumer(&[&s.topic, &forged_topic]);
    let mut relay = s.start("relay");
    relay.wait_ready("active").await;

    // when it tries every way in
    let (_, port, _) = s.db.pg_parts();
    let as_intruder = connect(&format!("postgres://{intruder}@127.0.0.1:{port}/{}", s.db.name)).await;
    let event = format!(
        r#"{{"id": "f1", "aggregate_type": "x", "aggregate_id": "k", "event_type": "Forged", "payload": "{{}}", "topic": "{forged_topic}"}}"#
    );
    for sql in [
        format!("SELECT pg_logical_emit_message(true, 'outbox', '{event}')"),
        format!("SELECT pg_logical_emit_message(false, 'outbox', '{event}')"),
        format!("SELECT outbox_emit('x', 'k', 'Forged', '{{}}', NULL, '{forged_topic}')"),
        format!(
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload, topic) \
             VALUES ('x', 'k', 'Forged', '{{}}', '{forged_topic}')"
        ),
    ] {
        // then each is refused
        let err = as_intruder.batch_execute(&sql).await.expect_err(&sql);
        assert_eq!(
            err.code(),
            Some(&tokio_postgres::error::SqlState::INSUFFICIENT_PRIVILEGE),
            "{sql}: {err}"
        );
    }

    // and a non-transactional message with the prefix, even from a role that may emit, is not
    // published: it is dead-lettered, while a committed event still flows
    admin
        .batch_execute(&format!("SELECT pg_logical_emit_message(false, 'outbox', '{event}')"))
        .await
        .unwrap();
    admin
        .batch_execute(&format!("SELECT outbox_emit('{}', 'real', 'Placed', '{{}}')", s.aggregate_type))
        .await
        .unwrap();
    let records = consume(&consumer, 1, IDLE).await;
    assert_eq!(records.len(), 1);
    assert_eq!(records[0].topic, s.topic);
    let late = consume(&consumer, 1, Duration::from_secs(3)).await;
    assert!(late.is_empty(), "a forged record arrived: {late:?}");
    let reason: String = admin.query_one("SELECT reason FROM outbox_dead_letter", &[]).await.unwrap().get(0);
    assert!(reason.contains("non-transactional"), "{reason}");

    // and check finds nothing to warn about who may emit
    let (_, stdout, _) = run_relay(&["check", "--config", s.config().to_str().unwrap()], IDLE);
    assert!(stdout.contains("OK   replication.emit"), "{stdout}");
    // but that messages and letters are unsigned, naming the settings
    for (line, setting) in [
        ("WARN replication.message_signing", "replication.message_signing_key_file"),
        ("WARN dead_letter.signing", "dead_letter.signing_key_file"),
    ] {
        let warning = stdout.lines().find(|l| l.starts_with(line)).unwrap_or_else(|| panic!("{stdout}"));
        assert!(warning.contains(setting), "{warning}");
    }
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0));
}

#[tokio::test(flavor = "multi_thread")]
async fn outbox_emit_refuses_another_prefix_and_an_event_kafka_could_not_take() {
    // given the outbox schema (no relay needed: the function refuses in the writer's transaction)
    let db = TestDb::new().await;
    let client = db.client().await;

    // when an event is emitted under another prefix, or over 1 MB
    let other_prefix = "SELECT outbox_emit('order', '1', 'Placed', '{}', NULL, NULL, 'someone-else')";
    let too_large =
        "SELECT outbox_emit('order', '1', 'Placed', jsonb_build_object('blob', repeat('x', 1000000)))";

    // then each is refused, saying why, and an ordinary event is still emitted
    let refusal = async |sql: &str| {
        let err = client.batch_execute(sql).await.expect_err(sql);
        err.as_db_error().map(|e| e.message().to_string()).unwrap_or_else(|| err.to_string())
    };
    let why = refusal(other_prefix).await;
    assert!(why.contains("prefix 'someone-else' is not allowed"), "{why}");
    let why = refusal(too_large).await;
    assert!(why.contains("more than 1000000"), "{why}");
    client.batch_execute("SELECT outbox_emit('order', '1', 'Placed', '{}')").await.unwrap();
}

/// Where the REVOKE of sql/005 could not run (a managed PostgreSQL without a superuser): every
/// signature of `pg_logical_emit_message` executable by PUBLIC again.
const REVOKE_NOT_RUN: &str = "DO $$ DECLARE f regprocedure; BEGIN \
     FOR f IN SELECT oid::regprocedure FROM pg_proc WHERE proname = 'pg_logical_emit_message' LOOP \
         EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO PUBLIC', f); \
     END LOOP; END $$";

#[tokio::test(flavor = "multi_thread")]
async fn a_forged_message_naming_a_real_id_is_dead_lettered_where_the_revoke_did_not_run() {
    // given a streaming relay that checks outbox_emit()'s signature, its key installed, on a
    // database where any login may call pg_logical_emit_message, and a role that may only connect
    let dir = tempfile::tempdir().unwrap();
    let key_file = dir.path().join("emit.key");
    let key = random_suffix().repeat(8);
    std::fs::write(&key_file, format!("{key}\n")).unwrap();
    let key_file = key_file.display().to_string();
    let letters_key = dir.path().join("letters.key");
    std::fs::write(&letters_key, random_suffix().repeat(8)).unwrap();
    let letters_key = letters_key.display().to_string();
    let s =
        Setup::create(&services().kafka, "", true, |slot| {
            RelayToml::replication(slot)
                .set("replication", "message_signing_key_file", key_file.as_str())
                .set("dead_letter", "signing_key_file", letters_key.as_str())
        })
        .await;
    let mut admin = s.db.client().await;
    admin.execute("INSERT INTO outbox_emit_key (key) VALUES ($1)", &[&key]).await.unwrap();
    admin.batch_execute(REVOKE_NOT_RUN).await.unwrap();
    let intruder = format!("intruder_{}", random_suffix());
    admin.batch_execute(&format!("CREATE ROLE {intruder} LOGIN")).await.unwrap();
    let consumer = consumer(&[&s.topic]);
    let mut relay = s.start("relay");
    relay.wait_ready("active").await;

    // when a real event is written, and before it commits the intruder emits two forged events
    // naming its id (text and bytea), so they come first in the WAL, as a shadow would
    let real = admin.transaction().await.unwrap();
    let id: String = real
        .query_one(
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload) \
             VALUES ($1, 'acct-1', 'Credited', '{\"amount\": 100}') RETURNING id::text",
            &[&s.aggregate_type],
        )
        .await
        .unwrap()
        .get(0);
    let (_, port, _) = s.db.pg_parts();
    let as_intruder = connect(&format!("postgres://{intruder}@127.0.0.1:{port}/{}", s.db.name)).await;
    let forged = format!(
        r#"{{"id": "{id}", "aggregate_type": "{}", "aggregate_id": "acct-1", "event_type": "Credited", "payload": "{{\"amount\": 1000000}}", "digest": "{}"}}"#,
        s.aggregate_type,
        "0".repeat(64)
    );
    for sql in [
        format!("SELECT pg_logical_emit_message(true, 'outbox', '{forged}')"),
        format!("SELECT pg_logical_emit_message(true, 'outbox', convert_to('{forged}', 'UTF8'))"),
    ] {
        as_intruder.batch_execute(&sql).await.unwrap_or_else(|e| panic!("{sql}: {e}"));
    }
    real.commit().await.unwrap();
    // and an application emits an event through outbox_emit()
    admin
        .batch_execute(&format!("SELECT outbox_emit('{}', 'acct-2', 'Opened', '{{}}')", s.aggregate_type))
        .await
        .unwrap();

    // then Kafka holds the real event once, with its real payload, and outbox_emit()'s event;
    // nothing forged
    let mut records = consume(&consumer, 2, IDLE).await;
    records.extend(consume(&consumer, 1, Duration::from_secs(3)).await);
    let with_id: Vec<&Consumed> = records.iter().filter(|r| r.header("id") == Some(id.as_str())).collect();
    assert_eq!(with_id.len(), 1, "{records:#?}");
    assert_eq!(with_id[0].payload.as_deref(), Some("{\"amount\": 100}"));
    assert_eq!(records.len(), 2, "{records:#?}");
    assert!(records.iter().any(|r| r.key.as_deref() == Some("acct-2")), "{records:#?}");
    // and the forged ones are dead-lettered under the id they named, saying why, unsigned
    // although the relay signs its letters (a replay does not send them unless vouched for)
    let letters = admin
        .query("SELECT event_id, reason, digest FROM outbox_dead_letter ORDER BY id", &[])
        .await
        .unwrap();
    assert_eq!(letters.len(), 2, "{letters:?}");
    for letter in &letters {
        assert_eq!(letter.get::<_, String>(0), id);
        let reason: String = letter.get(1);
        assert!(reason.contains("not signed by outbox_emit()"), "{reason}");
        assert_eq!(letter.get::<_, Option<String>>(2), None);
    }
    // and the slot moves on past them
    let end = wal_lsn(&admin).await;
    wait_until(relay.context("the slot confirmed past the forged messages".into()), async || {
        slot_confirmed_flush(&admin, &s.slot).await >= end
    })
    .await;
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0));

    // and a replay of the letters sends neither: the relay did not sign them
    let config = s.config().display().to_string();
    let (code, stdout, stderr) = run_relay(&["replay-dead-letters", "--config", &config], EXIT_LIMIT);
    assert_eq!(code, 1, "{stdout}{stderr}");
    assert_eq!(stdout.matches("refused, not sent").count(), 2, "{stdout}{stderr}");
    let late = consume(&consumer, 1, Duration::from_secs(3)).await;
    assert!(late.is_empty(), "a replay published a forged event: {late:?}");
    // and check says messages are verified and letters signed
    let (_, stdout, _) = run_relay(&["check", "--config", &config], IDLE);
    assert!(stdout.contains("OK   replication.message_signing"), "{stdout}");
    assert!(stdout.contains("OK   dead_letter.signing"), "{stdout}");
}
