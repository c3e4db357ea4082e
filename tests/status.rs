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

    // and once the relay is stopped, that no one holds the slot and nothing answers
    let port = relay.metrics_port();
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0));
    let report = status(&s, port);
    assert!(line(&report, "leader (slot holder)").starts_with("none"), "{report}");
    assert_eq!(line(&report, "relay sessions"), "0 named \"outbox-relay\" (0 streaming)", "{report}");
    assert!(line(&report, "metrics endpoint").contains("no answer"), "{report}");
}

#[tokio::test(flavor = "multi_thread")]
async fn polling_status_shows_the_backlog_and_its_oldest_row() {
    // given a polling relay that is not running, and three unpublished rows
    let s = Setup::create(&services().kafka, "", true, |_| RelayToml::mode("polling")).await;
    let client = s.db.client().await;
    for _ in 0..3 {
        insert_event(&client, &s.aggregate_type, Some("a-1")).await;
    }

    // when status runs, then it counts them
    let report = status(&s, http::free_port());
    assert_eq!(line(&report, "mode"), "polling");
    assert_eq!(line(&report, "backlog (unpublished rows)"), "3");
    assert!(line(&report, "oldest unpublished row").ends_with("s old"), "{report}");

    // and when a relay has published them, the backlog is empty
    let mut relay = s.start("relay");
    relay.wait_metric("outbox_relay_events_published_total{mode=\"polling\"}", |v| v >= 3.0).await;
    let report = status(&s, relay.metrics_port());
    assert_eq!(line(&report, "backlog (unpublished rows)"), "0", "{report}");
    assert!(line(&report, "this instance leads").starts_with("yes"), "{report}");
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0));
}
