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

    // and check finds nothing to warn about
    let (_, stdout, _) = run_relay(&["check", "--config", s.config().to_str().unwrap()], IDLE);
    assert!(stdout.contains("OK   replication.emit"), "{stdout}");
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
