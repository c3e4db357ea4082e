//! `outbox-relay status` on a live relay and on a stopped one, in both modes: what an SRE reads
//! during an incident is what PostgreSQL and the relay say.

use crate::common;

use common::workload::*;
use common::*;

fn status(s: &Setup, metrics_port: u16) -> String {
    let config = s.config().display().to_string();
    let url = format!("http://127.0.0.1:{metrics_port}");
    let (code, stdout, stderr) =
        run_relay(&["status", "--config", &config, "--metrics-url", &url], EXIT_LIMIT);
    assert_eq!(code, 0, "{stdout}{stderr}");
    stdout
}

/// `status --format json`, parsed.
fn status_json(s: &Setup, metrics_port: u16) -> serde_json::Value {
    let config = s.config().display().to_string();
    let url = format!("http://127.0.0.1:{metrics_port}");
    let (code, stdout, stderr) =
        run_relay(&["status", "--config", &config, "--metrics-url", &url, "--format", "json"], EXIT_LIMIT);
    assert_eq!(code, 0, "{stdout}{stderr}");
    serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{e}: {stdout}"))
}

/// The value of `key` in the report.
fn line<'a>(report: &'a str, key: &str) -> &'a str {
    report
        .lines()
        .find_map(|l| l.strip_prefix(key).filter(|rest| rest.starts_with("  ")).map(str::trim))
        .unwrap_or_else(|| panic!("no {key:?} in:\n{report}"))
}

#[tokio::test(flavor = "multi_thread")]
async fn replication_status_shows_the_slot_its_holder_and_the_relay_s_own_view() {
    // given a streaming relay that published events
    let s = Setup::create(&services().kafka, "", true, RelayToml::replication).await;
    let mut relay = s.start("relay");
    relay.wait_ready("active").await;
    insert_event(&s.db.client().await, &s.aggregate_type, Some("a-1")).await;
    relay.wait_metric("outbox_relay_events_published_total{mode=\"replication\"}", |v| v >= 1.0).await;
    let pid: i32 =
        s.db.client()
            .await
            .query_one("SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1", &[&s.slot])
            .await
            .unwrap()
            .get(0);

    // when status runs
    let report = status(&s, relay.metrics_port());

    // then it names the mode, the relay's sessions (a leader holds its walsender, the SQL
    // session that holds the slot's lock, and the sampler's), the slot, its holder, and what
    // the relay says of itself
    assert_eq!(line(&report, "mode"), "replication");
    assert_eq!(line(&report, "relay sessions"), "3 named \"outbox-relay\" (1 streaming)", "{report}");
    assert_eq!(line(&report, "slot"), format!("\"{}\"", s.slot));
    assert!(line(&report, "leader (slot holder)").starts_with(&format!("pid {pid}, ")), "{report}");
    assert_eq!(line(&report, "wal_status"), "reserved");
    assert!(line(&report, "lag (WAL not confirmed)").ends_with(')'), "{report}");
    assert!(line(&report, "metrics endpoint").ends_with("answers"), "{report}");
    assert!(line(&report, "readiness").starts_with("active"), "{report}");
    assert!(line(&report, "this instance leads").starts_with("yes"), "{report}");
    assert!(line(&report, "last confirmation").ends_with("s ago"), "{report}");
    let json = status_json(&s, relay.metrics_port());
    let mut slot_keys: Vec<&str> = json["slot"].as_object().unwrap().keys().map(String::as_str).collect();
    let mut expected = outbox_relay::ops::status::SLOT_KEYS.to_vec();
    slot_keys.sort_unstable();
    expected.sort_unstable();
    assert_eq!(slot_keys, expected, "{json}");
    assert_eq!(json["slot"]["holder_pid"], pid, "{json}");
    assert_eq!(json["slot"]["wal_status"], "reserved", "{json}");
    assert!(json["slot"]["lag_bytes"].is_i64(), "{json}");
    assert!(json["slot"]["holder_since_unix_seconds"].is_f64(), "{json}");
    assert_eq!(
        (json["relay_sessions"].clone(), json["relay_sessions_streaming"].clone()),
        (3.into(), 1.into())
    );
    assert_eq!(json["leader"], true, "{json}");
    assert!(json["last_confirmation_unix_seconds"].is_f64(), "{json}");

    // and once the relay is stopped, that no one holds the slot and nothing answers
    let port = relay.metrics_port();
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0));
    let report = status(&s, port);
    assert!(line(&report, "leader (slot holder)").starts_with("none"), "{report}");
    assert_eq!(line(&report, "relay sessions"), "0 named \"outbox-relay\" (0 streaming)", "{report}");
    assert!(line(&report, "metrics endpoint").contains("no answer"), "{report}");
}

#[tokio::test(flavor = "multi_thread")]
async fn polling_status_shows_the_backlog_its_oldest_row_and_the_waiting_dead_letters() {
    // given a polling relay that is not running, and three unpublished rows
    let s = Setup::create(&services().kafka, "", true, |_| RelayToml::mode("polling")).await;
    let client = s.db.client().await;
    for _ in 0..3 {
        insert_event(&client, &s.aggregate_type, Some("a-1")).await;
    }

    // and none waits in the dead-letter table
    let report = status(&s, http::free_port());
    assert_eq!(line(&report, "dead letters (waiting)"), "0 in public.outbox_dead_letter", "{report}");

    // and three letters of this outbox (two for one reason, the oldest an hour old) and one of
    // another outbox
    client
        .batch_execute(
            "INSERT INTO outbox_dead_letter (source_table, event_id, row_data, reason, dead_lettered_at) VALUES \
             ('public.outbox_events', '1', '{}', 'the topic t does not exist', now() - interval '1 hour'), \
             ('public.outbox_events', '2', '{}', 'the topic t does not exist', now()), \
             ('public.outbox_events', '3', '{}', 'column aggregate_id is NULL', now()), \
             ('public.other_outbox', '4', '{}', 'column aggregate_id is NULL', now() - interval '2 days')",
        )
        .await
        .unwrap();

    // when status runs, then it counts the rows, and this outbox's dead letters, oldest first,
    // with the most frequent reason first
    let report = status(&s, http::free_port());
    assert_eq!(line(&report, "mode"), "polling");
    assert_eq!(line(&report, "backlog (unpublished rows)"), "3");
    assert!(line(&report, "oldest unpublished row").ends_with("s old"), "{report}");
    let waiting = line(&report, "dead letters (waiting)");
    // (an hour and the seconds status took to start: 60.0 min, or a little more on a slow run)
    let minutes: f64 = waiting
        .strip_prefix("3 in public.outbox_dead_letter, the oldest ")
        .and_then(|rest| rest.strip_suffix(" min old"))
        .and_then(|m| m.parse().ok())
        .unwrap_or_else(|| panic!("{report}"));
    assert!((60.0..61.0).contains(&minutes), "{report}");
    assert_eq!(
        line(&report, "dead-letter reasons"),
        "2 x the topic t does not exist; 1 x column aggregate_id is NULL"
    );
    // (and the same as typed fields under stable keys, for scripts)
    polling_json_says_the_same(&status_json(&s, 1));

    // and when a relay has published the rows, the backlog is empty, and the relay exports the
    // waiting letters as gauges
    let mut relay = s.start("relay");
    relay.wait_metric("outbox_relay_events_published_total{mode=\"polling\"}", |v| v >= 3.0).await;
    let report = status(&s, relay.metrics_port());
    assert_eq!(line(&report, "backlog (unpublished rows)"), "0", "{report}");
    assert!(line(&report, "this instance leads").starts_with("yes"), "{report}");
    // (polling confirms nothing: its progress is what it published)
    assert_eq!(line(&report, "events published"), "3 by this instance since it started", "{report}");
    assert!(!report.contains("last confirmation"), "{report}");
    relay.wait_metric("outbox_relay_dead_letters_outstanding", |v| v == 3.0).await;
    assert!(relay.metric("outbox_relay_dead_letters_oldest_age_seconds").unwrap() >= 3600.0);

    // and once the letters are dealt with (replayed, or deleted), the gauge follows
    client
        .batch_execute("DELETE FROM outbox_dead_letter WHERE source_table = 'public.outbox_events'")
        .await
        .unwrap();
    relay.wait_metric("outbox_relay_dead_letters_outstanding", |v| v == 0.0).await;
    assert_eq!(relay.metric("outbox_relay_dead_letters_oldest_age_seconds"), Some(0.0));
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0));
}

/// `status --format json` of the polling test's outbox (three rows, three letters of it, no
/// relay answering): every key of `JSON_KEYS`, each value typed.
fn polling_json_says_the_same(json: &serde_json::Value) {
    let mut keys: Vec<&str> = json.as_object().unwrap().keys().map(String::as_str).collect();
    let mut expected = outbox_relay::ops::status::JSON_KEYS.to_vec();
    keys.sort_unstable();
    expected.sort_unstable();
    assert_eq!(keys, expected, "{json}");
    assert_eq!(json["mode"], "polling", "{json}");
    assert_eq!(json["backlog_rows"], 3, "{json}");
    assert_eq!(json["backlog_capped"], false, "{json}");
    assert!(json["oldest_unpublished_row_age_seconds"].is_f64(), "{json}");
    assert_eq!(json["dead_letters_waiting"], 3, "{json}");
    assert!(json["dead_letters_oldest_age_seconds"].as_f64().unwrap() >= 3600.0, "{json}");
    assert_eq!(json["dead_letter_reasons"][0]["count"], 2, "{json}");
    assert_eq!(json["slot"], serde_json::Value::Null, "{json}");
    assert_eq!(json["metrics_answered"], false, "{json}");
    assert_eq!(json["last_confirmation_unix_seconds"], serde_json::Value::Null, "{json}");
}
