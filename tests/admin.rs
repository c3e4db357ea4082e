//! The admin API against a real PostgreSQL and Kafka: pause then resume under load in both modes
//! (nothing lost, `/readyz` says who paused, the lag grows then drains), a dead letter replayed
//! through the API, and the refusals: no token, a bad token, a read-only token acting, an act
//! without the CSRF token, and a standby acting.

use crate::common;

use std::collections::HashMap;
use std::time::Duration;

use common::http::{Answer, free_port, request};
use common::process::RelayProcess;
use common::workload::*;
use common::*;

pub(crate) const OPERATE_TOKEN: &str = "operate-token-for-the-tests-0123456789";
pub(crate) const READ_TOKEN: &str = "read-token-for-the-tests-0123456789";

/// Writes the two token files into `dir` and returns the `admin.tokens` literal naming them
/// (tests/console.rs too).
pub(crate) fn tokens(dir: &std::path::Path) -> String {
    let file = |name: &str, token: &str| {
        let path = dir.join(format!("{name}.token"));
        std::fs::write(&path, format!("{token}\n")).unwrap();
        path.display().to_string()
    };
    format!(
        "[{{ name = \"oncall\", scope = \"operate\", token_file = \"{}\" }}, \
          {{ name = \"viewer\", scope = \"read\", token_file = \"{}\" }}]",
        file("oncall", OPERATE_TOKEN),
        file("viewer", READ_TOKEN)
    )
}

/// A relay of `s` with its admin listener on a free port: (relay, admin port).
/// A writer committing `per_txn` events to `agg-0`..`agg-{aggregates - 1}` in turn, `pause`
/// apart, until told to stop; it returns how many events it committed per aggregate.
pub(crate) async fn keep_writing(
    s: &Setup,
    aggregates: usize,
    per_txn: usize,
    pause: Duration,
) -> (tokio::sync::watch::Sender<bool>, tokio::task::JoinHandle<HashMap<String, i64>>) {
    let mut writer = s.db.client().await;
    let aggregate_type = s.aggregate_type.clone();
    let (stop_tx, mut stop) = tokio::sync::watch::channel(false);
    let writing = tokio::spawn(async move {
        let mut committed: HashMap<String, i64> = HashMap::new();
        for i in 0.. {
            let aggregate = format!("agg-{}", i % aggregates);
            let n = write_events(&mut writer, &aggregate_type, &aggregate, per_txn, true).await;
            *committed.entry(aggregate).or_default() += n as i64;
            if *stop.borrow_and_update() {
                break;
            }
            tokio::time::sleep(pause).await;
        }
        committed
    });
    (stop_tx, writing)
}

pub(crate) fn start(s: &Setup, name: &str) -> (RelayProcess, u16) {
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    (s.start_with_env(name, &[("OUTBOX_RELAY__ADMIN__LISTEN", &listen)]), port)
}

fn bearer(token: &str) -> String {
    format!("Bearer {token}")
}

/// GET `path` with `token`.
pub(crate) fn get(port: u16, path: &str, token: &str) -> Answer {
    let auth = bearer(token);
    request(port, "GET", path, &[("Authorization", &auth)], "").expect("the admin listener answers")
}

/// POST `body` to `path` as the operator, with the CSRF token the session gives.
pub(crate) fn act(port: u16, path: &str, body: &str) -> Answer {
    let csrf = get(port, "/v1/session", OPERATE_TOKEN).json()["csrf_token"].as_str().unwrap().to_string();
    let auth = bearer(OPERATE_TOKEN);
    request(port, "POST", path, &[("Authorization", &auth), ("X-CSRF-Token", &csrf)], body)
        .expect("the admin listener answers")
}

/// The lag the API shows: the slot's (replication) or the backlog (polling), from the gauges.
fn lag(port: u16) -> f64 {
    let outboxes = get(port, "/v1/outboxes", READ_TOKEN).json();
    match outboxes["slot"].is_null() {
        true => outboxes["outboxes"][0]["backlog_events"].as_f64().unwrap_or(0.0),
        false => outboxes["slot"]["lag_bytes"].as_f64().unwrap_or(0.0),
    }
}

pub(crate) async fn setup(mode: &str) -> Setup {
    setup_with(mode, |toml| toml).await
}

/// As [`setup`], with `more` settings.
pub(crate) async fn setup_with(mode: &str, more: impl FnOnce(RelayToml) -> RelayToml) -> Setup {
    setup_with_kafka(mode, "", more).await
}

/// As [`setup_with`], with `kafka` lines added to `[kafka]`.
pub(crate) async fn setup_with_kafka(
    mode: &str,
    kafka: &str,
    more: impl FnOnce(RelayToml) -> RelayToml,
) -> Setup {
    Setup::create(&services().kafka, kafka, true, |slot| {
        let dir = std::env::temp_dir().join(format!("admin-{slot}"));
        std::fs::create_dir_all(&dir).unwrap();
        more(
            RelayToml::either(mode, slot)
                .set("metrics", "listen", "127.0.0.1:0")
                .set("metrics", "sample_interval_secs", 1)
                .set("metrics", "fatal_exit_delay_secs", 0)
                .set_literal("admin", "tokens", tokens(&dir)),
        )
    })
    .await
}

async fn pause_then_resume_under_load(mode: &str) {
    // given a relay with its admin listener, and a writer committing 5 events per transaction on
    // 8 aggregates for the whole test
    let s = setup(mode).await;
    let client = s.db.client().await;
    create_aggregates(&client, 8).await;
    let consumer = consumer(&[&s.topic]);
    let (relay, port) = start(&s, "relay");
    relay.wait_ready("active").await;
    let (stop_tx, writing) = keep_writing(&s, 8, 5, Duration::from_millis(20)).await;
    let before = consume(&consumer, 20, IDLE).await.len();
    assert!(before >= 20, "the relay relays before the pause");
    let lag_before = lag(port);

    // when the operator pauses it
    let receipt = act(port, "/v1/pause", r#"{"reason": "maintenance"}"#);
    assert_eq!(
        (receipt.status, receipt.json()["result"].as_str()),
        (200, Some("paused")),
        "{}",
        receipt.body
    );

    // then /readyz says who paused it, the gauge says paused, and once what was in flight settled
    // nothing more reaches Kafka while the lag grows
    relay.wait_ready("paused by oncall: maintenance").await;
    assert_eq!(relay.metric("outbox_relay_paused"), Some(1.0));
    consume(&consumer, usize::MAX, Duration::from_secs(2)).await;
    let lag_paused = relay.context(format!("the {mode} lag to grow past {lag_before} while paused"));
    wait_until(lag_paused, async || lag(port) > lag_before.max(1.0) * 2.0).await;
    assert!(
        consume(&consumer, usize::MAX, Duration::from_secs(3)).await.is_empty(),
        "published while paused"
    );
    let lag_while_paused = lag(port);

    // when it is resumed and the writer stops
    let receipt = act(port, "/v1/resume", "");
    assert_eq!(receipt.json()["result"], "resumed", "{}", receipt.body);
    relay.wait_ready("active").await;
    assert_eq!(relay.metric("outbox_relay_paused"), Some(0.0));
    stop_tx.send(true).unwrap();
    let committed = writing.await.unwrap();

    // then every committed event arrives once, in order per aggregate, and the lag drains
    let total: i64 = committed.values().sum();
    let all = consume_unique(&common::consumer(&[&s.topic]), total as usize, IDLE, LINGER).await;
    assert_delivered(&all, &committed);
    let drained = relay.context(format!("the {mode} lag to drain below {lag_while_paused}"));
    wait_until(drained, async || lag(port) < lag_while_paused).await;
    let log = relay.log_text();
    assert!(log.contains("admin act") && log.contains("oncall"), "the acts are audited:\n{log}");
}

#[tokio::test(flavor = "multi_thread")]
async fn polling_pause_then_resume_under_load_loses_nothing_and_says_who_paused() {
    pause_then_resume_under_load("polling").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn replication_pause_then_resume_under_load_loses_nothing_and_says_who_paused() {
    pause_then_resume_under_load("replication").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn no_token_a_bad_token_a_read_token_and_a_standby_are_refused_their_acts() {
    // given an active relay and a standby, both with the admin listener
    let s = setup("polling").await;
    let (relay, port) = start(&s, "relay");
    relay.wait_ready("active").await;
    let (standby, standby_port) = start(&s, "standby");
    standby.wait_ready("standby").await;

    // then without a token, or with one not configured, nothing but the page and the document
    // answers
    let unauthorized = request(port, "GET", "/v1/status", &[], "").unwrap();
    assert_eq!(unauthorized.status, 401, "{}", unauthorized.body);
    assert!(unauthorized.header("www-authenticate").is_some_and(|h| h.starts_with("Bearer")));
    assert_eq!(get(port, "/v1/outboxes", "not-a-token-of-this-relay").status, 401);
    assert_eq!(request(port, "GET", "/", &[], "").unwrap().status, 200);
    let document = request(port, "GET", "/v1/openapi.json", &[], "").unwrap().json();
    assert!(document["paths"]["/v1/dead-letters/replay"]["post"].is_object(), "{document}");

    // and a read token reads `status` as `status --format json` gives it, but may not act
    let status = get(port, "/v1/status", READ_TOKEN);
    assert_eq!(status.status, 200, "{}", status.body);
    let keys: Vec<String> = status.json().as_object().unwrap().keys().cloned().collect();
    for key in outbox_relay::ops::status::JSON_KEYS {
        assert!(keys.iter().any(|k| k == key), "{key} missing from {}", status.body);
    }
    let auth = bearer(READ_TOKEN);
    let csrf = get(port, "/v1/session", READ_TOKEN).json()["csrf_token"].as_str().unwrap().to_string();
    let refused =
        request(port, "POST", "/v1/pause", &[("Authorization", &auth), ("X-CSRF-Token", &csrf)], "");
    assert_eq!(refused.unwrap().status, 403);

    // and an operator's act without the CSRF token is refused, and nothing was paused
    let auth = bearer(OPERATE_TOKEN);
    assert_eq!(request(port, "POST", "/v1/pause", &[("Authorization", &auth)], "").unwrap().status, 403);
    assert!(relay.readyz().unwrap().1.starts_with("active"));

    // and the standby refuses an act, naming the leader
    let refused = act(standby_port, "/v1/pause", "{}");
    assert_eq!(refused.status, 409, "{}", refused.body);
    let leader = refused.json()["detail"]["leader"].clone();
    assert!(leader.as_str().is_some_and(|l| l.contains("pid")), "{}", refused.body);
    assert!(standby.readyz().unwrap().1.starts_with("standby"));
    let log = standby.log_text();
    assert!(log.contains("admin act") && log.contains("refused"), "the refusal is audited:\n{log}");
    assert_eq!(get(port, "/v1/outboxes", READ_TOKEN).json()["instance"]["state"], "active");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_dead_letter_is_listed_with_its_reason_and_replayed_through_the_api() {
    // given a streaming relay that signs its letters, whose rows may name a topic, on a broker
    // that creates none, and an event for a topic that does not exist: dead-lettered
    let key_dir = tempfile::tempdir().unwrap();
    let key = key_dir.path().join("letters.key");
    std::fs::write(&key, format!("{}\n", random_suffix().repeat(8))).unwrap();
    let kafka = "properties = { \"allow.auto.create.topics\" = \"false\", \"topic.metadata.propagation.max.ms\" = \"2000\" }";
    let s = Setup::create(&services().kafka, kafka, true, |slot| {
        let dir = std::env::temp_dir().join(format!("admin-{slot}"));
        std::fs::create_dir_all(&dir).unwrap();
        RelayToml::replication(slot)
            .set("outbox", "row_topics", true)
            .set_literal("outbox", "allowed_topics", "[\"outbox.event.*\", \"missing-*\"]")
            .set("dead_letter", "signing_key_file", key.display().to_string())
            .set_literal("admin", "tokens", tokens(&dir))
    })
    .await;
    let mut client = s.db.client().await;
    create_aggregates(&client, 1).await;
    let (relay, port) = start(&s, "relay");
    relay.wait_ready("active").await;
    write_events(&mut client, &s.aggregate_type, "agg-0", 2, true).await;
    let missing = random_topic("missing");
    let insert = "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload, topic) \
                  VALUES ($1, 'agg-0', 'E', '{\"n\": 1}', $2) RETURNING id::text";
    let lettered: String = client.query_one(insert, &[&s.aggregate_type, &missing]).await.unwrap().get(0);
    let listed = async || get(port, "/v1/dead-letters", READ_TOKEN).json()["dead_letters"].clone();
    wait_until(relay.context("the letter to be listed".into()), async || {
        listed().await.as_array().is_some_and(|l| !l.is_empty())
    })
    .await;

    // then the API lists it with its reason, and locate says it is dead-lettered
    let letters = listed().await;
    let letter = &letters[0];
    assert_eq!(letter["event_id"], lettered.as_str(), "{letters}");
    assert!(letter["reason"].as_str().unwrap().contains(&missing), "{letters}");
    let receipt = get(port, &format!("/v1/locate?id={lettered}"), READ_TOKEN).json();
    assert_eq!(receipt["state"], "dead_lettered", "{receipt}");

    // when its cause is fixed and the operator replays it through the API
    create_topic(&missing, 1).await;
    let body = format!("{{\"ids\": [{}]}}", letter["id"]);
    let receipt = act(port, "/v1/dead-letters/replay", &body);

    // then the receipt says replayed, Kafka holds it under its own id, and locate finds it
    assert_eq!(
        (receipt.status, receipt.json()["result"].as_str()),
        (200, Some("replayed")),
        "{}",
        receipt.body
    );
    let replayed = consume_unique(&common::consumer(&[&missing]), 1, IDLE, LINGER).await;
    assert_eq!(replayed.len(), 1);
    assert_eq!(replayed[0].header("id"), Some(lettered.as_str()));
    assert!(listed().await.as_array().unwrap().is_empty());
    let receipt = get(port, &format!("/v1/locate?id={lettered}"), READ_TOKEN).json();
    assert_eq!(receipt["state"], "published", "{receipt}");
    assert!(relay.log_text().contains("replay_dead_letters"), "the act is audited");
}

/// The server processes of `client`'s database other than its own whose last statement was the
/// dead-letter list (`/v1/dead-letters`'s), oldest first.
async fn dead_letter_readers(client: &tokio_postgres::Client) -> Vec<i32> {
    let sql = "SELECT pid FROM pg_stat_activity WHERE datname = current_database() \
               AND pid <> pg_backend_pid() AND query LIKE 'SELECT id, event_id, reason,%' ORDER BY backend_start";
    client.query(sql, &[]).await.unwrap().iter().map(|r| r.get(0)).collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn the_dead_letters_read_reuses_one_postgresql_session_and_opens_another_when_it_is_killed() {
    // given a relay with its admin listener
    let s = setup("polling").await;
    let client = s.db.client().await;
    let (relay, port) = start(&s, "relay");
    relay.wait_ready("active").await;
    let letters = || {
        let answer = get(port, "/v1/dead-letters", READ_TOKEN);
        assert_eq!(answer.status, 200, "{}", answer.body);
    };

    // when the dead letters are read three times
    letters();
    let first = dead_letter_readers(&client).await;
    letters();
    letters();

    // then one server process answered all three, and it stays open between them
    assert_eq!(first.len(), 1, "{first:?}");
    assert_eq!(dead_letter_readers(&client).await, first, "a session per request");

    // when that process is ended (a failover, an idle timeout, an operator)
    let ended: bool = client.query_one("SELECT pg_terminate_backend($1)", &[&first[0]]).await.unwrap().get(0);
    assert!(ended);
    let gone = relay.context(format!("server process {} to end", first[0]));
    wait_until(gone, async || !dead_letter_readers(&client).await.contains(&first[0])).await;

    // then the next read is answered on a new session, which is kept in turn
    letters();
    let second = dead_letter_readers(&client).await;
    assert_eq!(second.len(), 1, "{second:?}");
    assert_ne!(second, first);
    letters();
    assert_eq!(dead_letter_readers(&client).await, second);
}
