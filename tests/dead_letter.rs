//! The one dead-letter path: `dead_letter.on_poison = "block"` behaves the same in the
//! replication stream and the first copy as in polling mode (it holds at the event, reports it,
//! and publishes nothing acknowledged again while it holds), and a dead-lettered row looks the
//! same whichever mode wrote it. Row data that would choose a topic outside
//! `outbox.allowed_topics` (or any topic, without `outbox.row_topics`), or a header of the
//! relay's, takes the same path, with a reason naming the topic or header and the setting.

use crate::common;

use std::collections::HashMap;
use std::time::Duration;

use common::process::RelayProcess;
use common::*;
use tokio_postgres::Client;

const INSERT: &str = "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload, topic) \
                      VALUES ($1, $2, 'E', '{\"n\": 1}', $3)";

/// A relay test whose outbox accepts rows without an aggregate id.
struct Held {
    s: Setup,
    client: Client,
}

/// Rows may name their topic among the tests' own and `missing-*` ([`random_topic`]).
fn row_topics(config: RelayToml) -> RelayToml {
    config.set("outbox", "row_topics", true).set_literal(
        "outbox",
        "allowed_topics",
        "[\"outbox.event.*\", \"missing-*\"]",
    )
}

impl Held {
    /// With rows naming their topic allowed as [`row_topics`] says.
    async fn new(mode: &str, dead_letter: &str, kafka_extra: &str) -> Held {
        Held::with(mode, dead_letter, kafka_extra, row_topics).await
    }

    /// As [`Held::new`], the outbox settings as `outbox` makes them.
    async fn with(
        mode: &str,
        dead_letter: &str,
        kafka_extra: &str,
        outbox: impl FnOnce(RelayToml) -> RelayToml,
    ) -> Held {
        let s = Setup::create(&services().kafka, kafka_extra, true, |slot| {
            outbox(
                RelayToml::either(mode, slot)
                    .set("retry", "initial_backoff_ms", 200)
                    .set("retry", "max_backoff_ms", 1000)
                    .set("dead_letter", "on_poison", dead_letter),
            )
        })
        .await;
        let client = s.db.client().await;
        client
            .batch_execute("ALTER TABLE outbox_events ALTER COLUMN aggregate_id DROP NOT NULL")
            .await
            .unwrap();
        Held { s, client }
    }

    /// One transaction with an event per key; `None` is a row without an aggregate id.
    async fn write(&mut self, keys: &[Option<&str>], topic: Option<&str>) {
        let tx = self.client.transaction().await.unwrap();
        for key in keys {
            tx.execute(INSERT, &[&self.s.aggregate_type, key, &topic]).await.unwrap();
        }
        tx.commit().await.unwrap();
    }

    async fn wait_blocked(&self, relay: &RelayProcess) {
        wait_until(relay.context("/readyz to say blocked".into()), async || {
            relay.readyz().is_some_and(|(status, body)| status == 503 && body.contains("blocked at event"))
        })
        .await;
        assert_eq!(relay.metric("outbox_relay_events_blocked"), Some(1.0));
    }

    fn restart_with(&self, relay: &mut RelayProcess, dead_letter: &str, name: &str) -> RelayProcess {
        assert_eq!(relay.terminate(EXIT_LIMIT), Some(0), "{}", relay.log_text());
        let config = std::fs::read_to_string(self.s.config()).unwrap();
        let config = config.replace("on_poison = \"block\"", &format!("on_poison = \"{dead_letter}\""));
        std::fs::write(self.s.config(), config).unwrap();
        self.s.start(name)
    }
}

fn counts(records: &[Consumed]) -> HashMap<String, usize> {
    let mut counts = HashMap::new();
    for r in records {
        *counts.entry(r.key.clone().unwrap_or_default()).or_default() += 1;
    }
    counts
}

#[tokio::test(flavor = "multi_thread")]
async fn the_stream_holds_at_an_unmappable_row_without_publishing_anything_twice() {
    // given a streaming relay with on_poison = "block"
    let mut h = Held::new("replication", "block", "").await;
    let consumer = consumer(&[&h.s.topic]);
    let mut relay = h.s.start("relay");
    relay.wait_ready("active").await;

    // when a transaction holds a good event, then a row without an aggregate id
    h.write(&[Some("first")], None).await;
    h.write(&[Some("same-txn"), None, Some("same-txn-after")], None).await;
    // (the held transaction's COMMIT starts before this; keepalives may lawfully confirm up to it)
    let after_held = wal_lsn(&h.client).await;
    h.write(&[Some("later")], None).await;

    // then it reports the row and holds: what precedes it arrives once, while the relay retries
    // (the old behaviour ended the session and sent "same-txn" again at every retry)
    h.wait_blocked(&relay).await;
    let mut held = consume(&consumer, 2, IDLE).await;
    held.extend(consume(&consumer, 10, Duration::from_secs(5)).await);
    let seen = counts(&held);
    assert_eq!(seen.get("first"), Some(&1), "{seen:?}");
    assert_eq!(seen.get("same-txn"), Some(&1), "published again while holding: {seen:?}");
    assert!(!seen.contains_key("later"), "published past the held row: {seen:?}");
    assert!(!seen.contains_key("same-txn-after"), "published past the held row: {seen:?}");
    assert!(relay.exited().is_none(), "the relay gave up: {}", relay.log_text());
    // and the slot is not confirmed past the held transaction
    assert!(
        slot_confirmed_flush(&h.client, &h.s.slot).await < after_held,
        "confirmed past the held transaction"
    );
    let (_, body) = relay.readyz().unwrap_or_default();
    assert!(body.contains("column aggregate_id is NULL"), "{body}");

    // when the operator switches to dead_letter, then the row is dead-lettered and the rest flows
    // (the two that were held, then a short wait for anything sent again)
    let mut relay = h.restart_with(&mut relay, "dead_letter", "second");
    let mut rest = consume(&consumer, 2, IDLE).await;
    rest.extend(consume(&consumer, 10, LINGER).await);
    let rest = counts(&rest);
    for key in ["same-txn-after", "later"] {
        assert_eq!(rest.get(key), Some(&1), "{rest:?}");
    }
    assert_eq!(rest.len(), 2, "published again after the restart: {rest:?}");
    let dead: i64 = h.client.query_one("SELECT count(*) FROM outbox_dead_letter", &[]).await.unwrap().get(0);
    assert_eq!(dead, 1);
    relay.wait_ready("active").await;
    assert_eq!(relay.metric("outbox_relay_events_blocked"), Some(0.0));
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0));
}

#[tokio::test(flavor = "multi_thread")]
async fn the_stream_holds_at_a_refused_record_until_kafka_takes_it() {
    // given a streaming relay with on_poison = "block" and a broker that does not create topics
    let kafka = "properties = { \"allow.auto.create.topics\" = \"false\", \"topic.metadata.propagation.max.ms\" = \"2000\", \"topic.metadata.refresh.interval.ms\" = \"1000\" }";
    let mut h = Held::new("replication", "block", kafka).await;
    let missing = random_topic("missing");
    let consumer = consumer(&[&h.s.topic]);
    let mut relay = h.s.start("relay");
    relay.wait_ready("active").await;

    // when an event names a topic that does not exist
    h.write(&[Some("first")], None).await;
    h.write(&[Some("refused")], Some(&missing)).await;
    h.wait_blocked(&relay).await;
    h.write(&[Some("later")], None).await;

    // then the relay holds there: nothing after it, nothing twice
    let mut held = consume(&consumer, 1, IDLE).await;
    held.extend(consume(&consumer, 10, Duration::from_secs(4)).await);
    let held = counts(&held);
    assert_eq!(held.get("first"), Some(&1), "{held:?}");
    assert!(!held.contains_key("later"), "published past the held record: {held:?}");

    // when the topic is created, then the held record goes through and the rest follows
    create_topic(&missing, 1).await;
    let refused = consume(&common::consumer(&[&missing]), 1, IDLE).await;
    assert_eq!(refused.len(), 1, "the held record never reached its topic");
    let rest = counts(&consume(&consumer, 1, IDLE).await);
    assert_eq!(rest.get("later"), Some(&1), "{rest:?}");
    relay.wait_ready("active").await;
    let again = counts(&consume(&consumer, 10, LINGER).await);
    assert!(again.is_empty(), "published twice: {again:?}");
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0));
}

#[tokio::test(flavor = "multi_thread")]
async fn the_first_copy_holds_at_an_unmappable_row_without_giving_up_the_slot() {
    // given rows in the table before the slot exists, one without an aggregate id
    let mut h = Held::new("replication", "block", "").await;
    h.write(&[Some("a"), None, Some("b")], None).await;
    let consumer = consumer(&[&h.s.topic]);

    // when the relay creates the slot and copies the table with on_poison = "block"
    let mut relay = h.s.start("relay");

    // then it holds inside the copy: the row before it arrives once, the slot stays
    h.wait_blocked(&relay).await;
    let mut held = consume(&consumer, 1, IDLE).await;
    held.extend(consume(&consumer, 10, Duration::from_secs(5)).await);
    let held = counts(&held);
    assert_eq!(held.get("a"), Some(&1), "{held:?}");
    assert!(!held.contains_key("b"), "copied past the held row: {held:?}");
    let slots: i64 = h
        .client
        .query_one("SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1", &[&h.s.slot])
        .await
        .unwrap()
        .get(0);
    assert_eq!(slots, 1, "the slot was given up while holding");

    // when restarted with dead_letter, then the copy is made again and completes
    // (the row after the held one, then a short wait for anything sent again)
    let mut relay = h.restart_with(&mut relay, "dead_letter", "second");
    let mut rest = consume(&consumer, 1, IDLE).await;
    rest.extend(consume(&consumer, 10, LINGER).await);
    let rest = counts(&rest);
    assert_eq!(rest.get("b"), Some(&1), "{rest:?}");
    assert_eq!(rest.len(), 1, "copied again after the restart: {rest:?}");
    relay.wait_ready("active").await;
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_dead_lettered_row_looks_the_same_from_either_mode() {
    let mut rows = Vec::new();
    for mode in ["polling", "replication"] {
        // given a row without an aggregate id, with headers and an explicit topic
        let mut h = Held::new(mode, "dead_letter", "").await;
        let topic = h.s.topic.clone();
        let mut relay = h.s.start("relay");
        relay.wait_ready("active").await;
        let tx = h.client.transaction().await.unwrap();
        tx.execute(
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload, headers, topic) \
             VALUES ('order', NULL, 'Placed', '{\"n\": 1}', '{\"traceparent\": \"t\"}', $1)",
            &[&topic],
        )
        .await
        .unwrap();
        tx.commit().await.unwrap();

        // when the relay dead-letters it
        relay
            .wait_metric(&format!("outbox_relay_events_dead_lettered_total{{mode=\"{mode}\"}}"), |v| v >= 1.0)
            .await;
        let row =
            h.client.query_one("SELECT row_data, source_table FROM outbox_dead_letter", &[]).await.unwrap();
        let mut data: serde_json::Value = row.get(0);
        assert_eq!(row.get::<_, String>(1), "public.outbox_events");
        // the row's own id and topic, then nulled: ids differ between the two databases and
        // topics are random per test
        assert!(data["id"].as_str().is_some_and(|id| !id.is_empty()), "{mode}: {data}");
        assert_eq!(data["topic"].as_str(), Some(topic.as_str()), "{mode}");
        data["id"] = serde_json::Value::Null;
        data["topic"] = serde_json::Value::Null;
        rows.push((mode, data));
        assert_eq!(relay.terminate(EXIT_LIMIT), Some(0));
    }

    // then both rows have the same shape and the same values
    let expected = serde_json::json!({
        "id": null, "aggregate_type": "order", "aggregate_id": null, "event_type": "Placed",
        "payload": "{\"n\": 1}", "headers": "{\"traceparent\": \"t\"}", "topic": null,
    });
    for (mode, data) in &rows {
        assert_eq!(data, &expected, "{mode}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn text_that_is_not_utf8_is_dead_lettered_or_stops_the_stream_loudly() {
    for mode in ["polling", "replication"] {
        // given a SQL_ASCII database, which stores any bytes, and a payload that is not UTF-8
        let db = TestDb::with_encoding("SQL_ASCII").await;
        let s = Setup::create_on(db, &services().kafka, "", true, |slot| RelayToml::either(mode, slot)).await;
        let client = s.db.client().await;
        let consumer = consumer(&[&s.topic]);
        // (a fatal error is kept on /metrics for a while before the relay exits)
        let mut relay = s.start_with_env("relay", &[("OUTBOX_RELAY__METRICS__FATAL_EXIT_DELAY_SECS", "30")]);
        relay.wait_ready("active").await;
        let insert = |key: &str, hex: &str| {
            format!(
                "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload) VALUES \
                 ('{}', '{key}', 'E', convert_from('\\x{hex}'::bytea, 'SQL_ASCII')::jsonb)",
                s.aggregate_type
            )
        };
        client.batch_execute(&insert("good", "7b2261223a2022227d")).await.unwrap();
        let records = consume(&consumer, 1, IDLE).await;
        assert_eq!(records.len(), 1, "{mode}: {}", relay.log_text());
        assert_eq!(records[0].key.as_deref(), Some("good"), "{mode}");
        client.batch_execute(&insert("bad", "7b2261223a2022ff227d")).await.unwrap();

        if mode == "polling" {
            // then polling reads the row's bytes and dead-letters it, naming the column
            relay
                .wait_metric("outbox_relay_events_dead_lettered_total{mode=\"polling\"}", |v| v >= 1.0)
                .await;
            let reason: String =
                client.query_one("SELECT reason FROM outbox_dead_letter", &[]).await.unwrap().get(0);
            assert_eq!(reason, "column payload is not valid UTF-8 text");
            assert!(relay.exited().is_none(), "{}", relay.log_text());
            assert_eq!(relay.terminate(EXIT_LIMIT), Some(0));
        } else {
            // then the server refuses to stream it: the relay stops loudly (no retry loop), the
            // slot not confirmed past it, and says what to do
            relay.wait_metric("outbox_relay_fatal_error{reason=\"encoding\"}", |v| v == 1.0).await;
            let log = relay.log_text();
            assert!(log.contains("setup --recreate-slot") && log.contains("polling mode"), "{log}");
            let (_, body) = relay.readyz().unwrap_or_default();
            assert!(body.starts_with("degraded: fatal:"), "{body}");
            // (no retry loop: the error was fatal at once)
            assert!(!relay.log_text().contains("relay degraded, retrying"), "{}", relay.log_text());
            relay.kill9();
            // and the bad transaction is still ahead of the slot: decoding it again, here in SQL,
            // hits the same byte. (The confirmed position alone can lawfully pass the INSERT's
            // WAL record, when other databases' WAL lies between it and the COMMIT.)
            assert_still_in_slot_undecodable(&client, &s.slot).await;
        }
    }
}

/// Peeks `slot` through pgoutput in SQL once the relay has let go of it, and expects the decode
/// to fail on invalid UTF-8: proof that the slot was not confirmed past the bad transaction.
async fn assert_still_in_slot_undecodable(client: &Client, slot: &str) {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let peek = format!(
        "SELECT count(*) FROM pg_logical_slot_peek_binary_changes('{slot}', NULL, NULL, \
         'proto_version', '1', 'publication_names', 'p_{slot}')"
    );
    loop {
        let err = match client.query_one(&peek, &[]).await {
            Ok(row) => panic!("the slot decoded past the bad row ({} changes)", row.get::<_, i64>(0)),
            Err(e) => e,
        };
        let code = err.code().map(|c| c.code().to_owned()).unwrap_or_default();
        // 55006: the killed relay's walsender has not let go of the slot yet
        if code == "55006" && std::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        }
        assert_eq!(code, "22021", "{err:?}");
        return;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn after_a_dead_letter_readiness_and_leadership_say_the_present() {
    for mode in ["replication", "polling"] {
        // given a relay that dead-letters, warns of a stall after 500 ms, and a broker that does
        // not create topics (a record to a missing topic waits 2 s for it, then is refused);
        // without dedup, so no read-back looks at the topic first
        let kafka = "stall_warning_ms = 500\nproperties = { \"allow.auto.create.topics\" = \"false\", \"topic.metadata.propagation.max.ms\" = \"2000\", \"topic.metadata.refresh.interval.ms\" = \"1000\" }\n[dedup]\nenabled = false";
        let mut h = Held::new(mode, "dead_letter", kafka).await;
        let consumer = consumer(&[&h.s.topic]);
        let mut relay = h.s.start("relay");
        relay.wait_ready("active").await;

        // when an event names a topic that does not exist, and is dead-lettered
        let missing = random_topic("missing");
        h.write(&[Some("refused")], Some(&missing)).await;
        wait_until(relay.context(format!("{mode}: the dead letter")), async || {
            relay.metric(&format!("outbox_relay_events_dead_lettered_total{{mode=\"{mode}\"}}")) == Some(1.0)
        })
        .await;

        // then the log named the missing topic, from the metadata, before any stall warning
        let log = relay.log_text();
        let named = log.lines().position(|l| l.contains("has no such topic") && l.contains(&missing));
        let stalled = log.lines().position(|l| l.contains("Kafka has acknowledged nothing"));
        assert!(named.is_some(), "{mode}: the missing topic was not named: {log}");
        assert!(stalled.is_none_or(|stalled| named < Some(stalled)), "{mode}: the stall came first: {log}");

        // and with nothing waiting any more, /readyz is ready and the leader gauge is 1: a stall
        // of the dead-lettered record is over once it left
        wait_until(relay.context(format!("{mode}: /readyz ready after the dead letter")), async || {
            relay.readyz().is_some_and(|(status, _)| status == 200)
        })
        .await;
        assert_eq!(relay.metric("outbox_relay_leader"), Some(1.0), "{mode}");

        // and events flow on, and once they are acknowledged /readyz is ready. (Awaited: with a
        // 500 ms stall warning, the later record's own acknowledgement took longer than that on a
        // loaded machine, a stall /readyz rightly reported as 503 until it came.)
        h.write(&[Some("later")], None).await;
        let later = counts(&consume(&consumer, 1, IDLE).await);
        assert_eq!(later.get("later"), Some(&1), "{mode}: {later:?}");
        wait_until(relay.context(format!("{mode}: /readyz ready with nothing waiting")), async || {
            relay.readyz().is_some_and(|(status, _)| status == 200)
        })
        .await;
        assert_eq!(relay.terminate(EXIT_LIMIT), Some(0), "{mode}");
    }
}

/// The reason the dead-letter table holds for the row of aggregate id `key`.
async fn reason_of(client: &Client, key: &str) -> String {
    let sql = "SELECT reason FROM outbox_dead_letter WHERE row_data->>'aggregate_id' = $1";
    client.query_one(sql, &[&key]).await.unwrap_or_else(|e| panic!("no dead letter for {key}: {e}")).get(0)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_row_topic_outside_the_allowlist_and_a_relay_header_are_dead_lettered_naming_them() {
    for mode in ["polling", "replication"] {
        // given rows may name topics among outbox.event.* and missing-*, and a topic outside them
        let h = Held::new(mode, "dead_letter", "").await;
        let outside = random_topic("ledger-internal");
        create_topic(&outside, 1).await;
        let consumer = consumer(&[&h.s.topic, &outside]);
        let mut relay = h.s.start("relay");
        relay.wait_ready("active").await;

        // when one row names that topic, one carries the relay's source header, one is good
        let insert = "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload, headers, topic) \
                      VALUES ($1, $2, 'E', '{}', $3::text::jsonb, $4)";
        let forged_headers = "{\"outbox_relay_source\": \"1/other/public.outbox_events\"}";
        for (key, headers, topic) in [
            ("outside", None, Some(outside.as_str())),
            ("forged", Some(forged_headers), None),
            ("good", None, None),
        ] {
            h.client.execute(insert, &[&h.s.aggregate_type, &key, &headers, &topic]).await.unwrap();
        }

        // then only the good row is published, to the template's topic
        let records = consume(&consumer, 1, IDLE).await;
        let late = consume(&consumer, 2, LINGER).await;
        let keys: Vec<_> = records.iter().chain(&late).map(|r| (r.key.clone(), r.topic.clone())).collect();
        assert_eq!(keys, [(Some("good".to_string()), h.s.topic.clone())], "{mode}");
        // and the other two are dead-lettered, each reason naming what and the setting
        relay
            .wait_metric(&format!("outbox_relay_events_dead_lettered_total{{mode=\"{mode}\"}}"), |v| v >= 2.0)
            .await;
        let reason = reason_of(&h.client, "outside").await;
        assert_eq!(
            reason,
            format!(
                "topic \"{outside}\" (from column topic) is not in outbox.allowed_topics; add it, or a \
                 prefix of it ending in *, to outbox.allowed_topics"
            ),
            "{mode}"
        );
        let reason = reason_of(&h.client, "forged").await;
        assert!(
            reason.starts_with("header \"outbox_relay_source\" in column headers is reserved"),
            "{mode}: {reason}"
        );
        assert_eq!(relay.terminate(EXIT_LIMIT), Some(0), "{mode}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn without_row_topics_a_row_naming_a_topic_is_dead_lettered_naming_the_setting() {
    // given the default: rows may not choose their topic
    let h = Held::with("replication", "dead_letter", "", |config| config).await;
    let other = random_topic("other");
    create_topic(&other, 1).await;
    let consumer = consumer(&[&h.s.topic, &other]);
    let mut relay = h.s.start("relay");
    relay.wait_ready("active").await;

    // when a row names another topic, and one names the template's own (as a dead letter does)
    let insert = "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload, topic) \
                  VALUES ($1, $2, 'E', '{}', $3)";
    for (key, topic) in [("elsewhere", &other), ("own", &h.s.topic)] {
        h.client.execute(insert, &[&h.s.aggregate_type, &key, topic]).await.unwrap();
    }

    // then the first is dead-lettered naming outbox.row_topics, the second published
    let records = consume(&consumer, 1, IDLE).await;
    let late = consume(&consumer, 1, LINGER).await;
    let keys: Vec<_> = records.iter().chain(&late).map(|r| (r.key.clone(), r.topic.clone())).collect();
    assert_eq!(keys, [(Some("own".to_string()), h.s.topic.clone())]);
    relay.wait_metric("outbox_relay_events_dead_lettered_total{mode=\"replication\"}", |v| v >= 1.0).await;
    let reason = reason_of(&h.client, "elsewhere").await;
    assert!(
        reason.starts_with(&format!(
            "topic \"{other}\" from column topic is refused: outbox.row_topics = false"
        )),
        "{reason}"
    );
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0));
}
