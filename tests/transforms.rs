//! Per-outbox transforms (`[outbox.transforms]`) against a real PostgreSQL and Kafka, in both
//! modes, through a relay killed with SIGKILL mid-stream: a mixed stream where excluded event
//! types never reach Kafka, redacted fields appear in no record (each record read back byte for
//! byte), events routed by a payload field land on their topics in per-aggregate order, and
//! `verify` reports nothing missing with the filtered rows counted exactly; `locate` names the
//! rule that filtered an event, and verify still counts the filtered rows once the rules no
//! longer exclude them (the relay recorded them). A header comes from a column the relay reads
//! for that rule alone (`column:channel`), in both modes.

use std::collections::HashMap;

use ring::hmac;

use crate::common::workload::{AGGREGATE_SQL, assert_delivered, unique_ids};
use crate::common::{
    Consumed, EXIT_LIMIT, IDLE, LINGER, RelayToml, Setup, consume, consumer, create_topic, run_relay,
};

const HASH_KEY: &str = "a-test-hmac-key-of-more-than-32-bytes";
const AGGREGATES: usize = 10;

/// The region an aggregate's events are routed by: even aggregates `eu`, odd ones `us`.
fn region(aggregate: usize) -> &'static str {
    if aggregate.is_multiple_of(2) { "eu" } else { "us" }
}

/// The value of the table's own `channel` column (no `columns.*` key) for an aggregate's events.
fn channel(aggregate: usize) -> String {
    format!("web-{aggregate}")
}

fn email(aggregate: usize) -> String {
    format!("buyer-{aggregate}@example.com")
}

/// The record value the relay must write for event `seq` of `aggregate`: the jsonb text with
/// every object on a redaction's way written compactly, members in jsonb's order.
fn expected_payload(aggregate: usize, seq: i64) -> String {
    let key = hmac::Key::new(hmac::HMAC_SHA256, HASH_KEY.as_bytes());
    let tag = hmac::sign(&key, email(aggregate).as_bytes());
    let hex: String = tag.as_ref().iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "{{\"seq\":{seq},\"card\":{{\"number\":\"****\"}},\"email\":\"{hex}\",\"region\":\"{}\",\"tenant\":\"acme\"}}",
        region(aggregate)
    )
}

/// `total` transactions over the aggregates, each one published event (`OrderPlaced`, its
/// aggregate's next seq, a card and an email to redact) and, every other one, an internal event
/// (`Cache.internal`, excluded) before it. Returns the committed seqs by aggregate and the
/// number of internal events.
async fn write_mixed(url: &str, aggregate_type: &str, total: usize) -> (HashMap<String, i64>, i64) {
    let mut client = crate::common::connect(url).await;
    let mut internal = 0;
    for n in 0..total {
        let aggregate = rand::random_range(0..AGGREGATES);
        let id = format!("agg-{aggregate}");
        let tx = client.transaction().await.unwrap();
        let seq: i64 = tx
            .query_one("UPDATE test_aggregates SET seq = seq + 1 WHERE id = $1 RETURNING seq", &[&id])
            .await
            .unwrap()
            .get(0);
        if n % 2 == 0 {
            tx.execute(
                "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload) \
                 VALUES ($1, $2, 'Cache.internal', jsonb_build_object('secret', 'internal-' || $3::text))",
                &[&aggregate_type, &id, &(n as i64).to_string()],
            )
            .await
            .unwrap();
            internal += 1;
        }
        tx.execute(
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload, channel) \
             VALUES ($1, $2, 'OrderPlaced', jsonb_build_object('seq', $3::bigint, 'region', $4::text, \
             'tenant', 'acme', 'email', $5::text, 'card', jsonb_build_object('number', '4111-1111-1111-1111', \
             'cvc', 'CVC-SECRET')), $6)",
            &[&aggregate_type, &id, &seq, &region(aggregate), &email(aggregate), &channel(aggregate)],
        )
        .await
        .unwrap();
        tx.commit().await.unwrap();
    }
    let committed = crate::common::workload::committed_counts(&client).await;
    (committed, internal)
}

/// The outbox's transforms: the internal type excluded, events routed by `/region` to
/// `<prefix>.<region>`, a header from the payload, one from an event column and one from another
/// column of the table, three redactions.
fn transforms_toml(prefix: &str, key_file: &std::path::Path) -> String {
    format!(
        "[outbox]\nallowed_topics = [\"outbox.event.*\", \"{prefix}.*\"]\n\
         [outbox.transforms]\nexclude_event_types = [\"*.internal\"]\nroute_by_field = \"/region\"\n\
         route_topic = \"{prefix}.{{value}}\"\nhash_key_file = \"{}\"\n\
         [[outbox.transforms.headers]]\nfrom = \"payload:/tenant\"\nname = \"tenant\"\n\
         [[outbox.transforms.headers]]\nfrom = \"column:aggregate_id\"\nname = \"order\"\n\
         [[outbox.transforms.headers]]\nfrom = \"column:channel\"\nname = \"channel\"\n\
         [[outbox.transforms.redact]]\npointer = \"/card/number\"\naction = \"replace\"\nwith = \"****\"\n\
         [[outbox.transforms.redact]]\npointer = \"/card/cvc\"\naction = \"drop\"\n\
         [[outbox.transforms.redact]]\npointer = \"/email\"\naction = \"hash\"\n",
        key_file.display()
    )
}

/// A relay in `mode` with transforms is killed with SIGKILL while a mixed stream is written,
/// and started again.
async fn transforms_through_a_kill_9(mode: &str) {
    // given an outbox whose transforms filter, route, add headers and redact
    let keys = tempfile::tempdir().unwrap();
    let key_file = keys.path().join("redact.key");
    std::fs::write(&key_file, format!("{HASH_KEY}\n")).unwrap();
    let prefix = format!("r{}", crate::common::random_suffix());
    let s = Setup::create(&crate::common::services().kafka, "", true, |slot| {
        // (polling marks its rows: verify compares the rows it keeps)
        let config = RelayToml::either(mode, slot).set("polling", "after_publish", "mark");
        format!("{config}\n{}", transforms_toml(&prefix, &key_file))
    })
    .await;
    let (eu, us) = (format!("{prefix}.eu"), format!("{prefix}.us"));
    create_topic(&eu, 4).await;
    create_topic(&us, 4).await;
    let client = s.db.client().await;
    client.batch_execute(AGGREGATE_SQL).await.unwrap();
    // (a column of the application's that the relay reads only for the header rule)
    client.batch_execute("ALTER TABLE outbox_events ADD COLUMN channel text").await.unwrap();
    client
        .execute(
            "INSERT INTO test_aggregates (id) SELECT 'agg-' || g FROM generate_series(0, $1 - 1) g",
            &[&(AGGREGATES as i32)],
        )
        .await
        .unwrap();
    // (the template's topic too: nothing may arrive there)
    let consumer = consumer(&[&eu, &us, &s.topic]);
    let mut relay = s.start_with_env("first", &[("OUTBOX_RELAY__REPLICATION__STATUS_INTERVAL_MS", "60000")]);
    relay.wait_ready("active").await;

    // when the stream is written and the relay is killed with SIGKILL once some events arrived
    let writer = tokio::spawn({
        let (url, aggregate_type) = (s.db.url.clone(), s.aggregate_type.clone());
        async move { write_mixed(&url, &aggregate_type, 600).await }
    });
    let mut records = consume(&consumer, 100, IDLE).await;
    assert!(!records.is_empty(), "{}", relay.log_text());
    relay.kill9();
    let (committed, internal) = writer.await.unwrap();
    let mut relay = s.start("second");
    let total: i64 = committed.values().sum();
    while (unique_ids(&records).len() as i64) < total {
        let more = consume(&consumer, total as usize - unique_ids(&records).len(), IDLE).await;
        assert!(!more.is_empty(), "{} of {total} arrived: {}", unique_ids(&records).len(), relay.log_text());
        records.extend(more);
    }
    records.extend(consume(&consumer, usize::MAX, LINGER).await);

    // then every published event arrived once, in per-aggregate order, on its region's topic
    let report = assert_delivered(&records, &committed);
    assert_eq!(report.unique as i64, total);
    for record in &records {
        let aggregate: usize = record.key.as_deref().unwrap().trim_start_matches("agg-").parse().unwrap();
        assert_eq!(record.topic, format!("{prefix}.{}", region(aggregate)), "routed by /region");
        assert_eq!(record.header("event_type"), Some("OrderPlaced"), "an excluded type reached Kafka");
        assert_eq!(record.header("tenant"), Some("acme"));
        assert_eq!(record.header("order"), record.key.as_deref());
        assert_eq!(record.header("channel"), Some(channel(aggregate).as_str()), "from the channel column");
        // read back byte for byte: the redacted value, and no trace of what was redacted
        let seq = crate::common::workload::seq_of(record);
        assert_eq!(record.payload.as_deref(), Some(expected_payload(aggregate, seq).as_str()));
        assert_no_secret(record);
    }
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0), "{}", relay.log_text());

    // and verify counts the internal events filtered, none missing
    let config = s.config().display().to_string();
    let (code, stdout, stderr) = run_relay(&["verify", "--config", &config, "--format", "json"], EXIT_LIMIT);
    let verified: serde_json::Value =
        serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{e}: {stderr}"));
    assert_eq!(code, 0, "{verified}");
    assert_eq!(verified["filtered"]["count"], internal, "{verified}");
    assert_eq!(verified["rows"], total + internal, "{verified}");
    for class in ["missing", "pending", "unexpected", "out_of_order", "mismatched", "unpublishable"] {
        assert_eq!(verified[class]["count"], 0, "{class}: {verified}");
    }
    // and once the rules no longer exclude the internal type, verify still counts the rows the
    // relay filtered (recorded when their rows were settled) as filtered, none missing
    let toml = std::fs::read_to_string(s.config()).unwrap();
    let kept = toml.replace("exclude_event_types = [\"*.internal\"]\n", "");
    assert_ne!(kept, toml, "the exclusion is in the configuration");
    let dir = tempfile::tempdir().unwrap();
    let changed = dir.path().join("relay.toml");
    std::fs::write(&changed, kept).unwrap();
    let changed = changed.display().to_string();
    let (code, stdout, stderr) = run_relay(&["verify", "--config", &changed, "--format", "json"], EXIT_LIMIT);
    let again: serde_json::Value = serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{e}: {stderr}"));
    assert_eq!(code, 0, "{again}");
    assert_eq!(again["filtered"]["count"], internal, "recorded as filtered: {again}");
    for class in ["missing", "pending", "unexpected", "out_of_order", "mismatched", "unpublishable"] {
        assert_eq!(again[class]["count"], 0, "{class}: {again}");
    }

    // and locate names the rule that filtered an internal event
    let first_internal: i64 = client
        .query_one("SELECT min(id) FROM outbox_events WHERE event_type = 'Cache.internal'", &[])
        .await
        .unwrap()
        .get(0);
    let id = first_internal.to_string();
    let (code, stdout, stderr) = run_relay(&["locate", "--config", &config, "--id", &id], EXIT_LIMIT);
    assert_eq!(code, 0, "{stdout}{stderr}");
    assert!(
        stdout.contains("filtered by outbox.transforms.exclude_event_types[0] (\"*.internal\")"),
        "{stdout}{stderr}"
    );
    eprintln!("{mode}: {total} events published, {internal} filtered, {} records", records.len());
}

/// No redacted value and no internal event in any part of a record.
fn assert_no_secret(record: &Consumed) {
    let mut text = record.payload.clone().unwrap_or_default();
    for (name, value) in &record.headers {
        text.push_str(name);
        text.push_str(value);
    }
    for secret in ["4111-1111", "CVC-SECRET", "\"cvc\"", "@example.com", "internal-", "Cache.internal"] {
        assert!(!text.contains(secret), "{secret} in {record:?}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn polling_relay_killed_by_sigkill_filters_routes_and_redacts_every_event() {
    transforms_through_a_kill_9("polling").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn replication_relay_killed_by_sigkill_filters_routes_and_redacts_every_event() {
    transforms_through_a_kill_9("replication").await;
}
