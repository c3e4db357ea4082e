//! `outbox-relay replay-dead-letters` against the real PostgreSQL and broker: a dead-lettered
//! event is `unpublishable` to `verify` (never `missing`), a letter whose cause is not fixed
//! stays, and a fixed one reaches Kafka under its event's own id, its letter and row removed in
//! one go, so that `verify` then finds everything.

use crate::common;

use common::workload::*;
use common::*;
use serde_json::Value;

/// `verify --format json`: (exit code, report).
fn verify(s: &Setup, args: &[&str]) -> (i32, Value) {
    let config = s.config().display().to_string();
    let mut all =
        vec!["verify", "--config", &config, "--format", "json", "--wait-secs", "20", "--show", "50"];
    all.extend_from_slice(args);
    let (code, stdout, stderr) = run_relay(&all, EXIT_LIMIT);
    let report = serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{e}: {stdout}{stderr}"));
    (code, report)
}

fn replay(s: &Setup, args: &[&str]) -> (i32, String) {
    let config = s.config().display().to_string();
    let mut all = vec!["replay-dead-letters", "--config", &config];
    all.extend_from_slice(args);
    let (code, stdout, stderr) = run_relay(&all, EXIT_LIMIT);
    (code, format!("{stdout}{stderr}"))
}

async fn letters(client: &tokio_postgres::Client) -> i64 {
    client.query_one("SELECT count(*) FROM outbox_dead_letter", &[]).await.unwrap().get(0)
}

/// A dead-letter signing key (`dead_letter.signing_key_file`) in a file of its own, kept while
/// the directory lives.
fn signing_key() -> (tempfile::TempDir, String) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("letters.key");
    std::fs::write(&path, format!("{}\n", random_suffix().repeat(8))).unwrap();
    let path = path.display().to_string();
    (dir, path)
}

/// A streaming relay, signing its letters with `key`, whose rows may name a topic, on a broker
/// that does not create topics.
async fn streaming_setup(key: &str) -> Setup {
    let kafka = "properties = { \"allow.auto.create.topics\" = \"false\", \"topic.metadata.propagation.max.ms\" = \"2000\" }";
    Setup::create(&services().kafka, kafka, true, |slot| {
        RelayToml::replication(slot)
            .set("outbox", "row_topics", true)
            .set_literal("outbox", "allowed_topics", "[\"outbox.event.*\", \"missing-*\"]")
            .set("dead_letter", "signing_key_file", key)
    })
    .await
}

/// Writes an event for a topic that does not exist between two transactions of agg-1's, and
/// waits until the relay published the others and dead-lettered it: (its id, the topic).
async fn dead_letter_one(s: &Setup, client: &mut tokio_postgres::Client) -> (String, String) {
    let consumer = consumer(&[&s.topic]);
    write_events(client, &s.aggregate_type, "agg-1", 3, true).await;
    let missing = random_topic("missing");
    let lettered: String = client
        .query_one(
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload, topic) \
             VALUES ($1, 'agg-1', 'E', '{\"n\": 1}', $2) RETURNING id::text",
            &[&s.aggregate_type, &missing],
        )
        .await
        .unwrap()
        .get(0);
    write_events(client, &s.aggregate_type, "agg-1", 3, true).await;
    consume_unique(&consumer, 6, IDLE, LINGER).await;
    wait_until("the dead letter", async || letters(client).await == 1).await;
    (lettered, missing)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_dead_lettered_event_is_unpublishable_until_replayed_under_its_own_id() {
    // given a streaming relay whose rows may name a topic, on a broker that does not create
    // topics, and between two transactions an event for a topic that does not exist (Kafka
    // refuses it: it is dead-lettered, and its row stays in the outbox)
    let (_key_dir, key) = signing_key();
    let s = streaming_setup(&key).await;
    let mut client = s.db.client().await;
    create_aggregates(&client, 2).await;
    let mut relay = s.start("relay");
    relay.wait_ready("active").await;
    let (lettered, missing) = dead_letter_one(&s, &mut client).await;
    let letter: i64 = client.query_one("SELECT id FROM outbox_dead_letter", &[]).await.unwrap().get(0);
    let vouch = letter.to_string();

    // when verify compares: the event is unpublishable, with the letter's reason, not missing, and
    // verify fails: the event is not in Kafka
    let (code, report) = verify(&s, &[]);
    assert_eq!(code, 1, "{report}");
    assert_eq!(report["missing"]["count"], 0, "{report}");
    assert_eq!(report["unpublishable"]["count"], 1, "{report}");
    let first = report["unpublishable"]["first"][0].as_str().unwrap();
    assert!(first.starts_with(&format!("{lettered} (dead-lettered: ")), "{report}");

    // when it is edited (its data changed): the relay's key no longer verifies it, so it is
    // refused until the operator vouches for it
    let set_topic =
        "UPDATE outbox_dead_letter SET row_data = jsonb_set(row_data, '{topic}', to_jsonb($1::text))";
    client.execute(set_topic, &[&"elsewhere"]).await.unwrap();
    let (code, out) = replay(&s, &[]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains(&format!("letter {letter} (event {lettered}): refused, not sent")), "{out}");
    assert!(out.contains(&format!("--vouch {letter}")), "{out}");

    // when it is replayed, vouched for, with data that still cannot map, or before its topic
    // exists: refused, named, and it stays
    let (code, out) = replay(&s, &["--vouch", &vouch]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains(&format!("(event {lettered}): still cannot be published")), "{out}");
    client.execute(set_topic, &[&missing]).await.unwrap();
    // (a dry run tells it as the real run does: nothing approved that will fail)
    for dry in [&["--dry-run"][..], &[]] {
        let (code, out) = replay(&s, &[dry, &["--vouch", &vouch][..]].concat());
        assert_eq!(code, 1, "{out}");
        assert!(
            out.contains(&format!(
                "(event {lettered}): Kafka would refuse it: topic {missing} does not exist: create it"
            )),
            "{out}"
        );
        assert!(out.contains(" 0 letter(s); 1 cannot be, and stay"), "{out}");
    }
    assert_eq!(letters(&client).await, 1);

    // when its cause is fixed (the topic created), tried dry, then replayed
    create_topic(&missing, 1).await;
    let (code, out) = replay(&s, &["--dry-run", "--vouch", &vouch]);
    assert!(code == 0 && out.contains("would send") && out.contains("would replay 1"), "{out}");
    assert_eq!(letters(&client).await, 1, "a dry run changes nothing");
    let (code, out) = replay(&s, &["--vouch", &vouch]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("replayed 1 letter(s)"), "{out}");

    // then Kafka holds it once, under its event's id, marked replayed; its letter and row are gone
    let replayed = consume_unique(&common::consumer(&[&missing]), 1, IDLE, LINGER).await;
    assert_eq!(replayed.len(), 1);
    assert_eq!(replayed[0].header("id"), Some(lettered.as_str()));
    assert!(replayed[0].header("outbox_relay_replayed").is_some(), "{:?}", replayed[0].headers);
    assert_eq!(letters(&client).await, 0);
    let rows: i64 = client
        .query_one("SELECT count(*) FROM outbox_events WHERE id = $1::text::bigint", &[&lettered])
        .await
        .unwrap()
        .get(0);
    assert_eq!(rows, 0);

    // and verify finds everything, once, the replay neither out of order nor unexpected
    let (code, report) = verify(&s, &[]);
    assert_eq!(code, 0, "{report}");
    for class in ["missing", "unexpected", "unpublishable", "out_of_order", "mismatched", "duplicated"] {
        assert_eq!(report[class]["count"], 0, "{class}: {report}");
    }
    assert_eq!(report["replayed"], 1, "{report}");
    assert_eq!(report["published_elsewhere"], 0, "a replay counts as replayed alone: {report}");
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0), "{}", relay.log_text());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_forged_letter_inserted_by_a_relay_role_is_refused_and_never_published() {
    // given a letter the relay wrote (signed), its relay stopped, and a real event not published
    // yet (the relay is stopped)
    let (_key_dir, key) = signing_key();
    let s = streaming_setup(&key).await;
    let mut client = s.db.client().await;
    create_aggregates(&client, 2).await;
    let mut relay = s.start("relay");
    relay.wait_ready("active").await;
    let (lettered, missing) = dead_letter_one(&s, &mut client).await;
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0), "{}", relay.log_text());
    let real: String = client
        .query_one(
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload) \
             VALUES ($1, 'agg-2', 'Real', '{\"real\": true}') RETURNING id::text",
            &[&s.aggregate_type],
        )
        .await
        .unwrap()
        .get(0);

    // when the replication role (it may INSERT letters) forges one under the real event's id,
    // to the real topic, carrying the genuine letter's digest
    client.batch_execute("SET ROLE outbox_relay").await.unwrap();
    let row_data = serde_json::json!({
        "id": real, "aggregate_type": s.aggregate_type, "aggregate_id": "agg-2", "event_type": "Forged",
        "payload": "{\"forged\": true}", "topic": s.topic,
    });
    let forged: i64 = client
        .query_one(
            "INSERT INTO outbox_dead_letter (source_table, event_id, row_data, reason, digest) \
             SELECT 'public.outbox_events', $1, $2::text::jsonb, 'forged', digest FROM outbox_dead_letter \
             RETURNING id",
            &[&real, &row_data.to_string()],
        )
        .await
        .unwrap()
        .get(0);
    client.batch_execute("RESET ROLE").await.unwrap();
    // ...and the operator, the cause of the genuine one fixed, replays every letter
    create_topic(&missing, 1).await;
    let (code, out) = replay(&s, &[]);

    // then the forged letter is refused, named, with what to do; the genuine one is replayed
    assert_eq!(code, 1, "{out}");
    assert!(out.contains(&format!("letter {forged} (event {real}): refused, not sent")), "{out}");
    assert!(
        out.contains("another role holding INSERT on") && out.contains(&format!("--vouch {forged}")),
        "{out}"
    );
    assert!(out.contains("replayed 1 letter(s); 1 cannot be"), "{out}");
    let replayed = consume_unique(&common::consumer(&[&missing]), 1, IDLE, LINGER).await;
    assert_eq!(replayed.len(), 1);
    assert_eq!(replayed[0].header("id"), Some(lettered.as_str()));
    // and Kafka never saw the forgery: the topic holds the six events the relay published, none
    // replayed, none under the real event's id
    let published = consume_unique(&common::consumer(&[&s.topic]), 6, IDLE, LINGER).await;
    assert_eq!(published.len(), 6, "{published:?}");
    assert!(published.iter().all(|r| r.header("outbox_relay_replayed").is_none()), "{published:?}");
    assert!(published.iter().all(|r| r.header("id") != Some(real.as_str())), "{published:?}");
    // and the real event's row stays, unrecorded as published; the forged letter stays
    let row: i64 = client
        .query_one("SELECT count(*) FROM outbox_events WHERE id = $1::text::bigint", &[&real])
        .await
        .unwrap()
        .get(0);
    assert_eq!(row, 1, "the real event's row is not deleted");
    let recorded: i64 = client
        .query_one(
            "SELECT count(*) FROM outbox_relay_published WHERE block = $1::text::bigint / 8192 \
             AND substring(ids from ($1::text::bigint % 8192)::int + 1 for 1) = B'1'",
            &[&real],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(recorded, 0, "the real event's id is not recorded as published");
    let left: i64 = client
        .query_one("SELECT count(*) FROM outbox_dead_letter WHERE id = $1", &[&forged])
        .await
        .unwrap()
        .get(0);
    assert_eq!(left, 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn check_fails_a_dead_letter_table_without_the_digest_a_signing_key_needs() {
    // given a relay that signs its letters, on a table with the digest column
    let (_key_dir, key) = signing_key();
    let s = Setup::create(&services().kafka, "", true, |slot| {
        RelayToml::replication(slot).set("source", "mode", "polling").set(
            "dead_letter",
            "signing_key_file",
            &key,
        )
    })
    .await;
    let config = s.config().display().to_string();
    let check = || run_relay(&["check", "--config", &config], EXIT_LIMIT);
    let (_, out, _) = check();
    assert!(out.contains("OK   dead_letter.table"), "{out}");
    // when the column is missing (sql/011 not applied), then check fails, naming it and the file
    s.db.client().await.batch_execute("ALTER TABLE outbox_dead_letter DROP COLUMN digest").await.unwrap();
    let (code, out, _) = check();
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("FAIL dead_letter.table") && out.contains("lacks digest text"), "{out}");
    assert!(out.contains("sql/011_dead_letter_digest.sql"), "{out}");
}
