//! TLS, SASL/SCRAM and ACLs against Apache Kafka's own listeners (the shared test broker's SSL and
//! SASL_SSL listeners, with certificates deploy/local made with openssl), and zstd, end to end.
//! The relay's SCRAM user `relay` may do only what the ACLs a test grants allow.

use crate::common;

use std::path::Path;

use common::broker::{Listeners, shared};
use common::*;
use rdkafka::ClientConfig;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::producer::{FutureProducer, FutureRecord};

/// The `[kafka]` lines of a relay on the SSL listener, verifying the broker against `ca`.
fn ssl_settings(ca: &Path) -> String {
    format!("properties = {{ \"security.protocol\" = \"SSL\", \"ssl.ca.location\" = \"{}\" }}", ca.display())
}

/// The `[kafka]` lines of a relay on the SASL_SSL listener as SCRAM user `relay`; the password
/// comes from `OUTBOX_RELAY_KAFKA_SASL_PASSWORD`.
fn scram_settings(ca: &Path) -> String {
    format!(
        "properties = {{ \"security.protocol\" = \"SASL_SSL\", \"ssl.ca.location\" = \"{}\", \
         \"sasl.mechanisms\" = \"SCRAM-SHA-512\", \"sasl.username\" = \"relay\" }}",
        ca.display()
    )
}

fn polling_on(topic: &str) -> RelayToml {
    RelayToml::polling().set("outbox", "topic_template", topic)
}

/// A consumer over the SSL listener (principal ANONYMOUS, a super user of the test broker).
fn ssl_consumer(kafka: &Listeners, topic: &str) -> StreamConsumer {
    let consumer: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", kafka.ssl())
        .set("security.protocol", "SSL")
        .set("ssl.ca.location", kafka.ca().display().to_string())
        .set("group.id", format!("tls-{}", random_suffix()))
        .set("auto.offset.reset", "earliest")
        .create()
        .unwrap();
    consumer.subscribe(&[topic]).unwrap();
    consumer
}

async fn insert_events(db: &TestDb, keys: &[&str], payload: &str) {
    let client = db.client().await;
    for key in keys {
        client
            .execute(
                "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload) VALUES ('t', $1, 'E', $2::text::jsonb)",
                &[key, &payload],
            )
            .await
            .unwrap();
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn the_relay_publishes_over_the_brokers_tls_with_zstd() {
    // given the broker's SSL listener, a topic, and a relay configured for TLS (verifying the
    // broker against the test CA) and zstd
    let kafka = shared();
    let topic = random_topic("tls");
    create_topic(&topic, 1).await;
    let db = TestDb::new().await;
    let dir = tempfile::tempdir().unwrap();
    let settings = format!("compression = \"zstd\"\n{}", ssl_settings(&kafka.ca()));
    let config = write_config_with(dir.path(), &db, &kafka.ssl(), &settings, polling_on(&topic));
    let (code, stdout, stderr) = run_relay(&["check", "--config", config.to_str().unwrap()], IDLE);
    assert_eq!(code, 0, "{stdout}{stderr}");

    // when events are written, then they arrive through TLS, compressed, intact
    let consumer = ssl_consumer(&kafka, &topic);
    let mut relay = process::RelayProcess::start(&config, &dir.path().join("relay.log"));
    let payload = format!("{{\"text\": \"{}\"}}", "compressible ".repeat(200));
    insert_events(&db, &["a", "b", "c"], &payload).await;
    let records = consume(&consumer, 3, IDLE).await;
    assert_eq!(records.len(), 3, "{}", relay.log_text());
    let stored: serde_json::Value = serde_json::from_str(records[0].payload.as_deref().unwrap()).unwrap();
    assert_eq!(stored["text"].as_str().unwrap().len(), "compressible ".len() * 200);
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_broker_certificate_the_relay_cannot_trust_is_reported_by_check() {
    let kafka = shared();
    let db = TestDb::new().await;
    let dir = tempfile::tempdir().unwrap();
    // the system roots do not include the test CA
    let settings = "properties = { \"security.protocol\" = \"SSL\" }";
    let config = write_config_with(dir.path(), &db, &kafka.ssl(), settings, RelayToml::mode("polling"));
    let (code, stdout, stderr) = run_relay(&["check", "--config", config.to_str().unwrap()], IDLE);
    assert_eq!(code, 1, "{stdout}{stderr}");
    let line =
        stdout.lines().find(|l| l.starts_with("FAIL kafka.brokers")).unwrap_or_else(|| panic!("{stdout}"));
    assert!(line.contains("TLS/SASL"), "{line}");
}

#[tokio::test(flavor = "multi_thread")]
async fn scram_with_the_right_password_publishes_with_only_its_topics_acls() {
    // given SCRAM user relay, allowed to write, read and describe its topic, and to find the
    // coordinator of its read-back group (as docs/security.md's ACL list says), and nothing else
    let kafka = shared();
    let topic = random_topic("scram");
    create_topic(&topic, 2).await;
    kafka.allow("User:relay", &["Write", "Read", "Describe"], &["--topic", &topic]);
    let client_id = format!("relay-{}", random_suffix());
    kafka.allow("User:relay", &["Describe"], &["--group", &format!("{client_id}-read-back")]);
    let db = TestDb::new().await;
    let dir = tempfile::tempdir().unwrap();
    let settings = format!("client_id = \"{client_id}\"\n{}", scram_settings(&kafka.ca()));
    let config = write_config_with(dir.path(), &db, &kafka.sasl_ssl(), &settings, polling_on(&topic));
    let password = kafka.password("relay");
    let env = [("OUTBOX_RELAY_KAFKA_SASL_PASSWORD", password.as_str())];
    let (code, stdout, stderr) =
        run_relay_with_env(&["check", "--config", config.to_str().unwrap()], &env, IDLE);
    assert_eq!(code, 0, "{stdout}{stderr}");

    // when events are written, then they arrive, the read-back included (dedup is on by default)
    let consumer = ssl_consumer(&kafka, &topic);
    let log = dir.path().join("relay.log");
    let mut relay = process::RelayProcess::spawn(&config, &log, process::TEST_LOG_LEVEL, &env);
    insert_events(&db, &["a", "b"], "{}").await;
    let records = consume(&consumer, 2, IDLE).await;
    assert_eq!(records.len(), 2, "{}", relay.log_text());
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0), "{}", relay.log_text());
    // a restarted relay reads its topic back as user relay before it publishes again
    let mut relay = process::RelayProcess::spawn(&config, &log, process::TEST_LOG_LEVEL, &env);
    insert_events(&db, &["c"], "{}").await;
    let records = consume(&consumer, 1, IDLE).await;
    assert_eq!(records.len(), 1, "{}", relay.log_text());
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0), "{}", relay.log_text());
    assert!(!relay.log_text().contains(&password), "the SCRAM password reached the log");

    // and the same credentials cannot write a topic without an ACL
    let other = random_topic("scram-denied");
    create_topic(&other, 1).await;
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", kafka.sasl_ssl())
        .set("security.protocol", "SASL_SSL")
        .set("ssl.ca.location", kafka.ca().display().to_string())
        .set("sasl.mechanisms", "SCRAM-SHA-512")
        .set("sasl.username", "relay")
        .set("sasl.password", &password)
        .create()
        .unwrap();
    let denied = producer.send(FutureRecord::<str, str>::to(&other).payload("x"), IDLE).await;
    let error = denied.expect_err("a write without an ACL was accepted").0;
    assert_eq!(
        error.rdkafka_error_code(),
        Some(rdkafka::types::RDKafkaErrorCode::TopicAuthorizationFailed),
        "{error}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_wrong_scram_password_fails_check_clearly_without_showing_it() {
    // given the SASL_SSL listener and a relay with a wrong SCRAM password
    let kafka = shared();
    let db = TestDb::new().await;
    let dir = tempfile::tempdir().unwrap();
    let config = write_config_with(
        dir.path(),
        &db,
        &kafka.sasl_ssl(),
        &scram_settings(&kafka.ca()),
        RelayToml::mode("polling"),
    );
    let (code, stdout, stderr) = run_relay_with_env(
        &["check", "--config", config.to_str().unwrap()],
        &[("OUTBOX_RELAY_KAFKA_SASL_PASSWORD", "SENTINEL-SASL-PASSWORD")],
        IDLE,
    );

    // then check fails on Kafka, naming authentication and where to look, without the password
    assert_eq!(code, 1, "{stdout}{stderr}");
    let line =
        stdout.lines().find(|l| l.starts_with("FAIL kafka.brokers")).unwrap_or_else(|| panic!("{stdout}"));
    assert!(line.contains("TLS/SASL"), "{line}");
    assert!(line.to_lowercase().contains("authentication"), "{line}");
    assert!(!stdout.contains("SENTINEL") && !stderr.contains("SENTINEL"), "{stdout}{stderr}");
}

/// A polling relay on the SASL_SSL listener as user `relay` (password from the environment),
/// client id `client_id`, publishing to `topic_template`.
fn scram_relay(
    kafka: &Listeners,
    db: &TestDb,
    dir: &Path,
    client_id: &str,
    topic_template: &str,
) -> process::RelayProcess {
    let settings = format!("client_id = \"{client_id}\"\n{}", scram_settings(&kafka.ca()));
    let config = write_config_with(dir, db, &kafka.sasl_ssl(), &settings, polling_on(topic_template));
    let password = kafka.password("relay");
    let env = [("OUTBOX_RELAY_KAFKA_SASL_PASSWORD", password.as_str())];
    process::RelayProcess::spawn(&config, &dir.join("relay.log"), process::TEST_LOG_LEVEL, &env)
}

async fn wait_exit(relay: &mut process::RelayProcess) -> i32 {
    let started = std::time::Instant::now();
    loop {
        if let Some(code) = relay.exited() {
            return code;
        }
        assert!(started.elapsed() < IDLE, "the relay did not stop: {}", relay.log_text());
        tokio::time::sleep(POLL).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn an_acl_that_denies_writing_one_topic_dead_letters_its_events_naming_the_principal() {
    // given user relay allowed to write one of two topics (and to read both back)
    let kafka = shared();
    let prefix = random_topic("acl");
    let (allowed, denied) = (format!("{prefix}.allowed"), format!("{prefix}.denied"));
    let client_id = format!("relay-{}", random_suffix());
    for topic in [&allowed, &denied] {
        create_topic(topic, 1).await;
        kafka.allow("User:relay", &["Read", "Describe"], &["--topic", topic]);
    }
    kafka.allow("User:relay", &["Write"], &["--topic", &allowed]);
    kafka.allow("User:relay", &["Describe"], &["--group", &format!("{client_id}-read-back")]);
    let db = TestDb::new().await;
    let dir = tempfile::tempdir().unwrap();
    let mut relay = scram_relay(&kafka, &db, dir.path(), &client_id, &format!("{prefix}.{{aggregate_type}}"));

    // when events go to both topics
    let client = db.client().await;
    for (aggregate_type, key) in [("allowed", "a"), ("denied", "b"), ("allowed", "c")] {
        client
            .execute(
                "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload) VALUES ($1, $2, 'E', '{}')",
                &[&aggregate_type, &key],
            )
            .await
            .unwrap();
    }

    // then the allowed topic gets its events, and the denied one's event is dead-lettered with a
    // reason naming the principal, the topic and the grant (dead_letter.on_poison's default)
    let records = consume(&ssl_consumer(&kafka, &allowed), 2, IDLE).await;
    assert_eq!(records.len(), 2, "{}", relay.log_text());
    let reason = async || -> Option<String> {
        let row = client.query_opt("SELECT reason FROM outbox_dead_letter", &[]).await.unwrap();
        row.map(|r| r.get(0))
    };
    wait_until(relay.context("the denied event to be dead-lettered".into()), async || {
        reason().await.is_some()
    })
    .await;
    let reason = reason().await.unwrap();
    assert!(
        reason.contains("User:relay") && reason.contains(&denied) && reason.contains("WRITE"),
        "{reason}"
    );
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0), "{}", relay.log_text());
}

#[tokio::test(flavor = "multi_thread")]
async fn an_acl_without_read_stops_the_relay_naming_the_principal_and_the_grant() {
    // given user relay allowed to write its topic but not to read it back
    let kafka = shared();
    let topic = random_topic("acl-noread");
    let client_id = format!("relay-{}", random_suffix());
    create_topic(&topic, 2).await;
    kafka.allow("User:relay", &["Write", "Describe"], &["--topic", &topic]);
    kafka.allow("User:relay", &["Describe"], &["--group", &format!("{client_id}-read-back")]);
    // (a record already there: an empty topic needs no read, and so shows no refusal)
    let producer: FutureProducer =
        ClientConfig::new().set("bootstrap.servers", kafka.plaintext()).create().unwrap();
    producer
        .send(FutureRecord::<str, str>::to(&topic).payload("{}"), IDLE)
        .await
        .map_err(|(e, _)| e)
        .unwrap();
    let db = TestDb::new().await;
    let dir = tempfile::tempdir().unwrap();
    insert_events(&db, &["k"], "{}").await;

    // when the relay starts and reads its topic back before publishing to it
    let mut relay = scram_relay(&kafka, &db, dir.path(), &client_id, &topic);
    let code = wait_exit(&mut relay).await;

    // then it stops (fatal privilege), naming the principal, the topic, the grant and the way out
    let log = relay.log_text();
    assert_eq!(code, 1, "{log}");
    assert!(log.contains("User:relay") && log.contains(&topic), "{log}");
    assert!(log.contains("READ and DESCRIBE") && log.contains("dedup.enabled = false"), "{log}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_wrong_scram_password_stops_the_relay_naming_the_principal() {
    // given a relay whose SCRAM password is wrong, and an event to publish
    let kafka = shared();
    let topic = random_topic("scram-wrong");
    create_topic(&topic, 1).await;
    let db = TestDb::new().await;
    let dir = tempfile::tempdir().unwrap();
    insert_events(&db, &["k"], "{}").await;
    let settings = format!("client_id = \"relay-{}\"\n{}", random_suffix(), scram_settings(&kafka.ca()));
    let config = write_config_with(dir.path(), &db, &kafka.sasl_ssl(), &settings, polling_on(&topic));
    let env = [("OUTBOX_RELAY_KAFKA_SASL_PASSWORD", "SENTINEL-SASL-PASSWORD")];
    let mut relay =
        process::RelayProcess::spawn(&config, &dir.path().join("relay.log"), process::TEST_LOG_LEVEL, &env);

    // then it stops (fatal auth) naming the principal and where the password comes from, and
    // never shows the password
    let code = wait_exit(&mut relay).await;
    let log = relay.log_text();
    assert_eq!(code, 1, "{log}");
    assert!(log.contains("reason=auth") || log.contains("reason=\"auth\""), "{log}");
    assert!(log.contains("User:relay") && log.contains("OUTBOX_RELAY_KAFKA_SASL_PASSWORD"), "{log}");
    assert!(!log.contains("SENTINEL"), "{log}");
}
