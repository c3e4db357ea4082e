//! Operations the leader carries out live, against a real PostgreSQL and Kafka, in both modes:
//! a republish of one aggregate through the admin API while a writer keeps committing (every
//! live event once and in order, the copies marked, contiguous, and in the order docs/admin.md
//! states); a standby refusing it, naming the leader; the `republish` command asking the running
//! relay, and running offline once none answers; the signal table: an operator's rows executed in
//! order, a non-operator's refused, and a row executed once across a kill -9 of the leader in the
//! middle of it; a pause that outlives a kill -9 of the paused leader (the standby takes over
//! paused); the `republish` command sent to a standby, followed to the leader's URL.

use crate::admin::{act, keep_writing, setup, setup_with_kafka, start};
use crate::common;

use std::time::Duration;

use common::http::free_port;
use common::process::RelayProcess;
use common::workload::*;
use common::*;

const REPUBLISHED: &str = "outbox_relay_republished";

async fn republish_one_aggregate_while_a_writer_commits(mode: &str, kafka: &str) {
    // given a relay with its admin listener (polling marks its rows published: republish sends
    // what the table still holds), and a writer committing 3 events per transaction on 4
    // aggregates for the whole test
    let s = setup_with_kafka(mode, kafka, |toml| match mode {
        "polling" => toml.set("polling", "after_publish", "mark"),
        _ => toml,
    })
    .await;
    let client = s.db.client().await;
    create_aggregates(&client, 4).await;
    let (relay, port) = start(&s, "relay");
    relay.wait_ready("active").await;
    let (stop_tx, writing) = keep_writing(&s, 4, 3, Duration::from_millis(10)).await;
    let consumer = consumer(&[&s.topic]);
    assert!(consume(&consumer, 60, IDLE).await.len() >= 60, "the relay relays before the republish");

    // when the operator republishes agg-1 through the API, the writer still committing
    let body = format!(r#"{{"aggregate_id": "agg-1", "aggregate_type": "{}"}}"#, s.aggregate_type);
    let receipt = act(port, "/v1/republish", &body);
    assert_eq!(
        (receipt.status, receipt.json()["result"].as_str()),
        (200, Some("republished")),
        "{}",
        receipt.body
    );
    let sent = receipt.json()["detail"]["sent"].as_u64().unwrap();
    assert!(sent >= 3, "{}", receipt.body);
    // (the writer goes on a while after it, so live events follow the copies)
    let after = consume(&consumer, 30, IDLE).await;
    assert!(after.len() >= 30, "the relay relays after the republish");
    stop_tx.send(true).unwrap();
    let committed = writing.await.unwrap();

    // then every live event arrived once, in order per aggregate, nothing else
    let total: i64 = committed.values().sum();
    let all = consume_unique(&common::consumer(&[&s.topic]), total as usize, IDLE, LINGER).await;
    let copies: Vec<&Consumed> = all.iter().filter(|r| r.header(REPUBLISHED).is_some()).collect();
    let live: Vec<Consumed> = all.iter().filter(|r| r.header(REPUBLISHED).is_none()).cloned().collect();
    let report = assert_delivered(&live, &committed);
    assert_eq!(report.duplicates, 0, "a live event arrived twice");
    assert_eq!(copies.len() as u64, sent, "the receipt counts the copies that arrived");
    assert!(copies.iter().all(|r| r.key.as_deref() == Some("agg-1")), "only agg-1 was republished");

    // and in agg-1's partition the copies are one run: after the originals of exactly the events
    // they copy (seq 1..=K, each copy byte for byte its original plus the header), and before
    // every live event newer than them (seq K+1..)
    let agg: Vec<&Consumed> = all.iter().filter(|r| r.key.as_deref() == Some("agg-1")).collect();
    let first = agg.iter().position(|r| r.header(REPUBLISHED).is_some()).unwrap();
    let k = sent as usize;
    let seqs = |records: &[&Consumed]| records.iter().map(|r| seq_of(r)).collect::<Vec<_>>();
    let expected: Vec<i64> = (1..=k as i64).collect();
    assert_eq!(seqs(&agg[..first]), expected, "the originals before the copies");
    assert_eq!(seqs(&agg[first..first + k]), expected, "the copies, in their originals' order");
    assert!(agg[first..first + k].iter().all(|r| r.header(REPUBLISHED).is_some()), "the copies are one run");
    let newer: Vec<i64> = (k as i64 + 1..=committed["agg-1"]).collect();
    assert_eq!(seqs(&agg[first + k..]), newer, "the live events after the copies are the newer ones");
    for (original, copy) in agg[..k].iter().zip(&agg[first..first + k]) {
        assert_eq!((&copy.payload, copy.partition), (&original.payload, original.partition));
        let without =
            |r: &Consumed| r.headers.iter().filter(|(k, _)| k != REPUBLISHED).cloned().collect::<Vec<_>>();
        assert_eq!(without(copy), without(original), "a copy carries its original's headers");
    }
    let log = relay.log_text();
    assert!(log.contains("admin act") && log.contains("republish"), "the act is audited:\n{log}");
}

#[tokio::test(flavor = "multi_thread")]
async fn polling_republish_of_one_aggregate_while_a_writer_commits_keeps_every_live_event_once_and_in_order()
{
    republish_one_aggregate_while_a_writer_commits("polling", "").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn replication_republish_of_one_aggregate_while_a_writer_commits_keeps_every_live_event_once_and_in_order()
 {
    republish_one_aggregate_while_a_writer_commits("replication", "").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn replication_republish_with_kafka_transactions_commits_the_streams_transaction_first_and_keeps_the_order()
 {
    let kafka = format!("transactional = true\n{QUICK_KAFKA_SETTINGS}");
    republish_one_aggregate_while_a_writer_commits("replication", &kafka).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn polling_republish_with_kafka_transactions_commits_the_streams_transaction_first_and_keeps_the_order()
{
    let kafka = format!("transactional = true\n{QUICK_KAFKA_SETTINGS}");
    republish_one_aggregate_while_a_writer_commits("polling", &kafka).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_standby_refuses_a_republish_naming_the_leader() {
    // given an active relay and a standby, both with the admin listener, and events published
    let s = setup("replication").await;
    let mut client = s.db.client().await;
    create_aggregates(&client, 1).await;
    let (relay, _) = start(&s, "relay");
    relay.wait_ready("active").await;
    let (standby, standby_port) = start(&s, "standby");
    standby.wait_ready("standby").await;
    write_events(&mut client, &s.aggregate_type, "agg-0", 2, true).await;
    assert_eq!(consume(&consumer(&[&s.topic]), 2, IDLE).await.len(), 2);

    // when the operator asks the standby to republish
    let receipt = act(standby_port, "/v1/republish", r#"{"aggregate_id": "agg-0"}"#);

    // then it refuses (409), naming the leader (the slot's reader), and sends nothing
    assert_eq!(receipt.status, 409, "{}", receipt.body);
    let leader = receipt.json()["detail"]["leader"].clone();
    assert!(leader.as_str().is_some_and(|l| l.contains("pid")), "{}", receipt.body);
    assert!(consume(&consumer(&[&s.topic]), 3, Duration::from_secs(3)).await.len() == 2, "nothing was sent");
    assert!(standby.log_text().contains("refused"), "the refusal is audited");
}

/// A relay setup with the signal table on, looked at every 100 ms.
async fn signal_setup(mode: &str) -> Setup {
    Setup::create(&services().kafka, "", true, |slot| {
        let dir = std::env::temp_dir().join(format!("signal-{slot}"));
        std::fs::create_dir_all(&dir).unwrap();
        RelayToml::either(mode, slot)
            .set("metrics", "listen", "127.0.0.1:0")
            .set("metrics", "fatal_exit_delay_secs", 0)
            .set("admin", "signal_table", "outbox_relay_signal")
            .set("admin", "signal_poll_interval_ms", 100)
            .set_literal("admin", "tokens", crate::admin::tokens(&dir))
    })
    .await
}

/// Makes an operator role and a role that is none (granted INSERT by mistake): their names.
async fn signal_roles(client: &tokio_postgres::Client) -> (String, String) {
    let (operator, other) = (format!("op_{}", random_suffix()), format!("nobody_{}", random_suffix()));
    client
        .batch_execute(&format!(
            "CREATE ROLE {operator} NOLOGIN; GRANT outbox_relay_operator TO {operator}; \
             CREATE ROLE {other} NOLOGIN; GRANT INSERT (kind, args) ON outbox_relay_signal TO {other};"
        ))
        .await
        .unwrap();
    (operator, other)
}

/// Inserts a request as `role` (its session user): the row's id, or the server's refusal.
async fn request_as(
    client: &tokio_postgres::Client,
    role: &str,
    kind: &str,
    args: &str,
) -> Result<i64, tokio_postgres::Error> {
    client.batch_execute(&format!("SET SESSION AUTHORIZATION {role}")).await.unwrap();
    let inserted = client
        .query_one(
            "INSERT INTO outbox_relay_signal (kind, args) VALUES ($1, $2::text::jsonb) RETURNING id",
            &[&kind, &args],
        )
        .await
        .map(|row| row.get(0));
    client.batch_execute("RESET SESSION AUTHORIZATION").await.unwrap();
    inserted
}

/// Row `id`'s (started_at set, executor_pid, result), as it is now.
async fn signal_row(client: &tokio_postgres::Client, id: i64) -> (bool, Option<i32>, Option<String>) {
    let row = client
        .query_one(
            "SELECT started_at IS NOT NULL, executor_pid, result FROM outbox_relay_signal WHERE id = $1",
            &[&id],
        )
        .await
        .unwrap();
    (row.get(0), row.get(1), row.get(2))
}

/// Waits until row `id` has a result: the result.
async fn finished(client: &tokio_postgres::Client, id: i64) -> String {
    let mut result = None;
    wait_until(format!("signal row {id} to be executed"), async || {
        result = signal_row(client, id).await.2;
        result.is_some()
    })
    .await;
    result.unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn polling_signal_rows_of_an_operator_are_executed_in_order_and_a_non_operators_row_is_refused() {
    // given a relay reading the signal table, an operator role and a role granted INSERT by mistake
    let s = signal_setup("polling").await;
    let client = s.db.client().await;
    let relay = s.start("relay");
    relay.wait_ready("active").await;
    let (operator, other) = signal_roles(&client).await;

    // when the other role asks for a pause, the table's trigger refuses the row, naming the role
    client.batch_execute(&format!("SET SESSION AUTHORIZATION {other}")).await.unwrap();
    let refused =
        client.execute("INSERT INTO outbox_relay_signal (kind) VALUES ('pause')", &[]).await.unwrap_err();
    client.batch_execute("RESET SESSION AUTHORIZATION").await.unwrap();
    let said = refused.as_db_error().map(|e| e.message().to_string()).unwrap_or_default();
    assert_eq!(refused.code(), Some(&tokio_postgres::error::SqlState::INSUFFICIENT_PRIVILEGE), "{refused}");
    assert!(said.contains(&format!("role {other} may not ask the relay")), "{said}");
    let rows: i64 = client.query_one("SELECT count(*) FROM outbox_relay_signal", &[]).await.unwrap().get(0);
    assert_eq!(rows, 0);

    // when the operator asks for a pause, then a resume, then a verify
    let pause = request_as(&client, &operator, "pause", r#"{"reason": "from sql"}"#).await.unwrap();
    let resume = request_as(&client, &operator, "resume", "{}").await.unwrap();
    let verify = request_as(&client, &operator, "verify", r#"{"since": "10m"}"#).await.unwrap();

    // then the relay executes each once, in order, writing the result and receipt into the row
    assert_eq!(finished(&client, pause).await, "paused");
    assert_eq!(finished(&client, resume).await, "resumed");
    assert_eq!(finished(&client, verify).await, "all_there");
    let receipt: serde_json::Value = client
        .query_one("SELECT receipt FROM outbox_relay_signal WHERE id = $1", &[&pause])
        .await
        .unwrap()
        .get(0);
    assert_eq!((receipt["act"].as_str(), receipt["by"].as_str()), (Some("pause"), Some(operator.as_str())));
    let order: Vec<i64> = client
        .query("SELECT id FROM outbox_relay_signal ORDER BY finished_at, id", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(order, [pause, resume, verify], "executed in id order");
    let log = relay.log_text();
    assert!(log.contains(&format!("signal {pause}")) && log.contains(&operator), "audited:\n{log}");
    relay.wait_ready("active").await;
}

async fn a_signal_row_is_executed_once_across_a_kill_9_of_the_leader_mid_request(mode: &str) {
    // given an active relay and a standby reading the signal table, and a dead letter the test
    // holds locked (FOR UPDATE): a replay of it waits for the lock, a request that lasts until
    // the test lets go
    let s = signal_setup(mode).await;
    let mut client = s.db.client().await;
    create_aggregates(&client, 1).await;
    let mut relay = s.start("relay");
    relay.wait_ready("active").await;
    let standby = s.start("standby");
    standby.wait_ready("standby").await;
    let (operator, _) = signal_roles(&client).await;
    client
        .execute(
            "INSERT INTO outbox_dead_letter (source_table, event_id, row_data, reason) \
             VALUES ('public.outbox_events', '424242', '{}', 'a test letter')",
            &[],
        )
        .await
        .unwrap();
    let mut holder = s.db.client().await;
    let holding = holder.transaction().await.unwrap();
    holding.execute("SELECT 1 FROM outbox_dead_letter FOR UPDATE", &[]).await.unwrap();

    // when the operator asks for a replay, and the leader is killed -9 while it executes it
    let replay = request_as(&client, &operator, "replay", r#"{"vouch": []}"#).await.unwrap();
    wait_until("the leader to start the replay", async || signal_row(&client, replay).await.0).await;
    let waiting =
        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '%FOR UPDATE%'";
    wait_until("the replay to wait for the letter's lock", async || {
        client.query_one(waiting, &[]).await.unwrap().get::<_, i64>(0) > 0
    })
    .await;
    relay.kill9();
    let (_, executor, result) = signal_row(&client, replay).await;
    assert_eq!(result, None, "the leader died mid-request");
    holding.rollback().await.unwrap();
    let resume = request_as(&client, &operator, "resume", "{}").await.unwrap();

    // then the standby takes over, finishes the started row as interrupted without executing it
    // again, and executes the next row
    standby.wait_ready("active").await;
    assert_eq!(finished(&client, replay).await, "interrupted");
    assert_eq!(signal_row(&client, replay).await.1, executor, "not started again");
    assert_eq!(finished(&client, resume).await, "not_paused");
    let log = standby.log_text();
    assert_eq!(log.matches(&format!("\"signal {replay}\"")).count(), 1, "one audit line for the row:\n{log}");
    assert!(log.contains("interrupted"), "{log}");
    let letters: i64 = client.query_one("SELECT count(*) FROM outbox_dead_letter", &[]).await.unwrap().get(0);
    assert_eq!(letters, 1, "the letter was not replayed by anyone");

    // and the relay that took over publishes what is written now
    write_events(&mut client, &s.aggregate_type, "agg-0", 3, true).await;
    let records = consume_unique(&consumer(&[&s.topic]), 3, IDLE, LINGER).await;
    assert_eq!(unique_ids(&records).len(), 3);
}

#[tokio::test(flavor = "multi_thread")]
async fn polling_a_signal_row_is_executed_once_across_a_kill_9_of_the_leader_mid_request() {
    a_signal_row_is_executed_once_across_a_kill_9_of_the_leader_mid_request("polling").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn replication_a_signal_row_is_executed_once_across_a_kill_9_of_the_leader_mid_request() {
    a_signal_row_is_executed_once_across_a_kill_9_of_the_leader_mid_request("replication").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_republish_command_asks_the_running_relay_and_runs_offline_when_none_answers() {
    // given a relay with its admin listener that published 3 events of agg-0
    let s = setup("replication").await;
    let mut client = s.db.client().await;
    create_aggregates(&client, 1).await;
    let (mut relay, port) = start(&s, "relay");
    relay.wait_ready("active").await;
    write_events(&mut client, &s.aggregate_type, "agg-0", 3, true).await;
    assert_eq!(consume(&consumer(&[&s.topic]), 3, IDLE).await.len(), 3);
    let config = s.config().display().to_string();
    let listen = format!("127.0.0.1:{port}");
    let republish = || {
        let args = ["republish", "--config", config.as_str(), "--aggregate", "agg-0"];
        run_relay_with_env(&args, &[("OUTBOX_RELAY__ADMIN__LISTEN", &listen)], EXIT_LIMIT)
    };

    // when the command runs with the relay's configuration (admin.listen, its operate token)
    let (code, stdout, stderr) = republish();

    // then the running relay carried it out, and says so
    assert_eq!(code, 0, "{stdout}{stderr}");
    let said = format!("carried out by the running relay at http://{listen}: republished");
    assert!(stdout.contains(&said), "{stdout}");
    assert_eq!(stdout.matches("as first written").count(), 3, "{stdout}");
    assert!(relay.log_text().contains("act=\"republish\""), "audited as the token's act");

    // when the relay is stopped and the command runs again, nothing answers: it runs offline
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0));
    let (code, stdout, stderr) = republish();
    assert_eq!(code, 0, "{stdout}{stderr}");
    assert!(stdout.contains("sent 3 event(s) again; 0 could not be"), "{stdout}");

    // and Kafka holds the 3 events and two copies of each, all marked
    let all = consume(&consumer(&[&s.topic]), 9, IDLE).await;
    assert_eq!(all.len(), 9);
    assert_eq!(all.iter().filter(|r| r.header(REPUBLISHED).is_some()).count(), 6);
}

#[tokio::test(flavor = "multi_thread")]
async fn setup_creates_a_signal_table_of_the_configured_name_that_only_operators_may_ask() {
    // given a polling configuration naming a signal table the migrations did not make
    let s = Setup::create(&services().kafka, "", true, |_| {
        RelayToml::polling().set("admin", "signal_table", "relay_requests")
    })
    .await;
    let config = s.config().display().to_string();

    // when setup runs (twice: it is safe to run again)
    for _ in 0..2 {
        let (code, stdout, stderr) = run_relay(&["setup", "--config", &config], EXIT_LIMIT);
        assert_eq!(code, 0, "{stdout}{stderr}");
        assert!(stdout.contains("signal table relay_requests: present"), "{stdout}");
    }

    // then an operator may ask, and a role granted INSERT without the operator role may not
    let client = s.db.client().await;
    let (operator, other) = (format!("op_{}", random_suffix()), format!("nobody_{}", random_suffix()));
    client
        .batch_execute(&format!(
            "CREATE ROLE {operator} NOLOGIN; GRANT outbox_relay_operator TO {operator}; \
             CREATE ROLE {other} NOLOGIN; GRANT INSERT (kind, args) ON relay_requests TO {other};"
        ))
        .await
        .unwrap();
    let insert = "INSERT INTO relay_requests (kind) VALUES ('pause')";
    client.batch_execute(&format!("SET SESSION AUTHORIZATION {operator}")).await.unwrap();
    client.execute(insert, &[]).await.unwrap();
    client
        .batch_execute(&format!("RESET SESSION AUTHORIZATION; SET SESSION AUTHORIZATION {other}"))
        .await
        .unwrap();
    let refused = client.execute(insert, &[]).await.unwrap_err();
    client.batch_execute("RESET SESSION AUTHORIZATION").await.unwrap();
    assert_eq!(refused.code(), Some(&tokio_postgres::error::SqlState::INSUFFICIENT_PRIVILEGE), "{refused}");
    let by: String =
        client.query_one("SELECT requested_by::text FROM relay_requests", &[]).await.unwrap().get(0);
    assert_eq!(by, operator, "the trigger names the session's role");
}

/// A relay of `s` with its admin listener on a free port, advertising it
/// (`admin.advertise_url`): (relay, admin port).
fn start_advertised(s: &Setup, name: &str) -> (RelayProcess, u16) {
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let url = format!("http://{listen}");
    let env =
        [("OUTBOX_RELAY__ADMIN__LISTEN", listen.as_str()), ("OUTBOX_RELAY__ADMIN__ADVERTISE_URL", &url)];
    (s.start_with_env(name, &env), port)
}

async fn a_pause_outlives_a_kill_9_of_the_paused_leader(mode: &str) {
    // given an active relay and a standby, both advertising their admin listeners, and a writer
    // committing 3 events per transaction on 4 aggregates for the whole test
    let s = setup(mode).await;
    let client = s.db.client().await;
    create_aggregates(&client, 4).await;
    let consumer = consumer(&[&s.topic]);
    let (mut relay, port) = start_advertised(&s, "relay");
    relay.wait_ready("active").await;
    let (standby, standby_port) = start_advertised(&s, "standby");
    standby.wait_ready("standby").await;
    let (stop_tx, writing) = keep_writing(&s, 4, 3, Duration::from_millis(20)).await;
    assert!(consume(&consumer, 12, IDLE).await.len() >= 12, "the relay relays before the pause");

    // when the operator pauses the leader, and asks the standby to resume
    let receipt = act(port, "/v1/pause", r#"{"reason": "incident 42"}"#);
    assert_eq!(receipt.json()["result"], "paused", "{}", receipt.body);
    assert_eq!(
        receipt.json()["detail"]["shared"],
        true,
        "the pause is written for the instances to come: {}",
        receipt.body
    );
    relay.wait_ready("paused by oncall: incident 42").await;
    let refused = act(standby_port, "/v1/resume", "");

    // then the standby refuses, naming the leader's admin URL
    assert_eq!(refused.status, 409, "{}", refused.body);
    assert_eq!(
        refused.json()["detail"]["leader_url"],
        format!("http://127.0.0.1:{port}"),
        "{}",
        refused.body
    );

    // when the paused leader is killed
    consume(&consumer, usize::MAX, Duration::from_secs(2)).await;
    relay.kill9();

    // then the standby takes over paused, says by whom, and publishes nothing
    standby.wait_ready("paused by oncall: incident 42").await;
    assert_eq!(standby.metric("outbox_relay_paused"), Some(1.0));
    assert_eq!(standby.metric("outbox_relay_paused_by{by=\"oncall\"}"), Some(1.0));
    assert!(
        consume(&consumer, usize::MAX, Duration::from_secs(3)).await.is_empty(),
        "the new leader published while the relay was paused"
    );
    assert!(standby.log_text().contains("takes over a paused relay"), "the take-over says it stays paused");

    // when the new leader is resumed and the writer stops
    let receipt = act(standby_port, "/v1/resume", "");
    assert_eq!(receipt.json()["result"], "resumed", "{}", receipt.body);
    assert_eq!(receipt.json()["detail"]["shared"], true, "{}", receipt.body);
    standby.wait_ready("active").await;
    assert_eq!(standby.metric("outbox_relay_paused_by{by=\"\"}"), Some(0.0));
    stop_tx.send(true).unwrap();
    let committed = writing.await.unwrap();

    // then every committed event arrives, in order per aggregate (the killed leader's
    // unconfirmed tail may arrive twice, with the same ids)
    let total: i64 = committed.values().sum();
    let all = consume_unique(&common::consumer(&[&s.topic]), total as usize, IDLE, LINGER).await;
    assert_delivered(&all, &committed);
}

#[tokio::test(flavor = "multi_thread")]
async fn polling_a_pause_outlives_a_kill_9_of_the_paused_leader_and_the_standby_takes_over_paused() {
    a_pause_outlives_a_kill_9_of_the_paused_leader("polling").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn replication_a_pause_outlives_a_kill_9_of_the_paused_leader_and_the_standby_takes_over_paused() {
    a_pause_outlives_a_kill_9_of_the_paused_leader("replication").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_republish_command_sent_to_a_standby_is_carried_out_by_the_leader_it_names() {
    // given an active relay and a standby, both advertising their admin listeners, and 2 events
    // of agg-0 published
    let s = setup("replication").await;
    let mut client = s.db.client().await;
    create_aggregates(&client, 1).await;
    let (relay, port) = start_advertised(&s, "relay");
    relay.wait_ready("active").await;
    let (standby, standby_port) = start_advertised(&s, "standby");
    standby.wait_ready("standby").await;
    write_events(&mut client, &s.aggregate_type, "agg-0", 2, true).await;
    assert_eq!(consume(&consumer(&[&s.topic]), 2, IDLE).await.len(), 2);

    // when the command is pointed at the standby (admin.url)
    let config = s.config().display().to_string();
    let standby_url = format!("http://127.0.0.1:{standby_port}");
    let args = ["republish", "--config", config.as_str(), "--aggregate", "agg-0"];
    let (code, stdout, stderr) =
        run_relay_with_env(&args, &[("OUTBOX_RELAY__ADMIN__URL", &standby_url)], EXIT_LIMIT);

    // then the standby's refusal names the leader, the command asks it there, and it is done
    assert_eq!(code, 0, "{stdout}{stderr}");
    let said = format!("carried out by the running relay at http://127.0.0.1:{port}: republished");
    assert!(stdout.contains(&said), "{stdout}{stderr}");
    assert!(standby.log_text().contains("refused"), "the standby's refusal is audited");
    let all = consume(&consumer(&[&s.topic]), 4, IDLE).await;
    assert_eq!(all.iter().filter(|r| r.header(REPUBLISHED).is_some()).count(), 2);
}
