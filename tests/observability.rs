//! What SREs see: a real scrape of a running relay, the alert rules under promtool and under a
//! real Prometheus, and the deployment files.

use crate::common;

use std::collections::BTreeSet;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::broker::OwnBroker;
use common::http::{free_port, get, sample};
use common::workload::*;
use common::*;

fn metric_names(scrape: &str) -> BTreeSet<String> {
    scrape
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split(' ').next())
        .map(String::from)
        .collect()
}

/// Every `outbox_relay_*` name used in the dashboards, the alert rules and the Kubernetes rules.
fn names_used_by_dashboards_and_alerts() -> BTreeSet<String> {
    let mut files: Vec<std::path::PathBuf> = Vec::new();
    for dir in ["dashboards", "deploy/prometheus", "deploy/kubernetes"] {
        for entry in std::fs::read_dir(repo_root().join(dir)).unwrap() {
            files.push(entry.unwrap().path());
        }
    }
    let mut names = BTreeSet::new();
    for file in files {
        let text = std::fs::read_to_string(&file).unwrap();
        let mut rest = text.as_str();
        while let Some(at) = rest.find("outbox_relay_") {
            let tail = &rest[at..];
            let end = tail.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(tail.len());
            let name = &tail[..end];
            let base = ["_bucket", "_sum", "_count"].iter().fold(name, |n, s| n.strip_suffix(s).unwrap_or(n));
            names.insert(base.to_string());
            rest = &tail[end..];
        }
    }
    names
}

#[tokio::test(flavor = "multi_thread")]
async fn a_real_scrape_lists_every_metric_with_sane_values() {
    // given a replication relay with its metrics listener, and 200 events relayed
    let s = Setup::create(&services().kafka, "", true, |slot| {
        RelayToml::replication(slot).set("metrics", "sample_interval_secs", 1)
    })
    .await;
    create_aggregates(&s.db.client().await, 10).await;
    let mut relay = s.start("relay");
    relay.wait_ready("active").await;
    let mut writer = s.db.client().await;
    for i in 0..40 {
        write_events(&mut writer, &s.aggregate_type, &format!("agg-{}", i % 10), 5, true).await;
    }

    // when the events are acknowledged and the slot sampled
    relay.wait_metric("outbox_relay_events_published_total", |v| v >= 200.0).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let scrape = relay.scrape();

    // then every metric the relay defines is in the scrape
    let names = metric_names(&scrape);
    for (name, _) in outbox_relay::metrics::ALL {
        assert!(names.contains(*name), "{name} missing from the scrape:\n{scrape}");
    }

    // and the values make sense after the run
    let value = |series: &str| sample(&scrape, series).unwrap_or_else(|| panic!("{series} has no sample"));
    assert_eq!(value("outbox_relay_events_read_total{mode=\"replication\"}"), 200.0);
    assert_eq!(value("outbox_relay_events_published_total{mode=\"replication\"}"), 200.0);
    assert_eq!(value("outbox_relay_end_to_end_latency_seconds_count"), 200.0);
    assert_eq!(value("outbox_relay_publish_latency_seconds_count"), 200.0);
    assert_eq!(value("outbox_relay_events_in_flight"), 0.0);
    assert_eq!(value("outbox_relay_leader"), 1.0);
    assert_eq!(value("outbox_relay_slot_active"), 1.0);
    assert_eq!(value("outbox_relay_slot_wal_status{status=\"reserved\"}"), 1.0);
    assert_eq!(value("outbox_relay_slot_wal_status{status=\"lost\"}"), 0.0);
    assert_eq!(value("outbox_relay_slot_lag_critical_threshold_bytes"), 10_737_418_240.0);
    assert!(value("outbox_relay_slot_confirmed_lag_bytes") < 16.0 * 1024.0 * 1024.0);
    let confirmed = value("outbox_relay_confirmed_lsn_bytes");
    // the server's position is sampled every second, the confirmed one moves continuously
    let server = value("outbox_relay_server_wal_lsn_bytes");
    assert!(
        confirmed > 0.0 && (server - confirmed).abs() < 16.0 * 1024.0 * 1024.0,
        "{confirmed} vs {server}"
    );
    assert!(value("outbox_relay_received_lsn_bytes") >= confirmed);
    let since_confirm =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs_f64()
            - value("outbox_relay_last_confirm_timestamp_seconds");
    assert!(since_confirm < 60.0, "last confirmation {since_confirm} s ago");
    assert_eq!(value("outbox_relay_build_info"), 1.0);
    assert!(scrape.contains(&format!("version=\"{}\"", env!("CARGO_PKG_VERSION"))));

    // and every metric a dashboard panel or an alert uses exists in this real scrape
    let used = names_used_by_dashboards_and_alerts();
    assert!(used.len() > 15, "found only {used:?}");
    let missing: Vec<_> = used.difference(&names).collect();
    assert!(missing.is_empty(), "used by dashboards/alerts but not exported: {missing:?}");

    // and the health endpoints answer
    assert_eq!(get(relay.metrics_port(), "/healthz").unwrap().0, 200);
    assert_eq!(relay.readyz().unwrap(), (200, "active\n".to_string()));
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0));
}

#[tokio::test(flavor = "multi_thread")]
async fn polling_backlog_and_degraded_readiness_while_kafka_is_down() {
    // given a polling relay whose Kafka is unreachable, and rows written
    let s = Setup::create("127.0.0.1:1", "stall_warning_ms = 1000", false, |_| {
        RelayToml::mode("polling").set("metrics", "sample_interval_secs", 1)
    })
    .await;
    let client = s.db.client().await;
    client
        .batch_execute(
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload, created_at) \
             SELECT 'order', g::text, 'E', '{}', now() - interval '30 seconds' FROM generate_series(1, 25) g",
        )
        .await
        .unwrap();
    let mut relay = s.start("relay");

    // then the backlog and its age are reported, and readiness says degraded
    relay.wait_metric("outbox_relay_backlog_events", |v| v == 25.0).await;
    let scrape = relay.scrape();
    assert!(sample(&scrape, "outbox_relay_backlog_oldest_age_seconds").unwrap() >= 30.0, "{scrape}");
    wait_until("a degraded /readyz", async || {
        relay.readyz().is_some_and(|(s, b)| s == 503 && b.contains("degraded"))
    })
    .await;
    assert_eq!(
        get(relay.metrics_port(), "/healthz").unwrap().0,
        200,
        "waiting for Kafka is progress, not a hang"
    );
    let scrape = relay.scrape();
    assert_eq!(sample(&scrape, "outbox_relay_publish_errors_total{error_type=\"stalled\"}"), Some(1.0));
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0));
}

fn promtool() -> &'static str {
    assert!(
        Command::new("promtool").arg("--version").output().is_ok(),
        "promtool is missing: deploy/local/test installs it (apt-get install prometheus)"
    );
    "promtool"
}

#[test]
fn alert_rules_pass_promtool_check_and_unit_tests() {
    let dir = repo_root().join("deploy/prometheus");
    for args in [vec!["check", "rules", "alerts.yml"], vec!["test", "rules", "alerts_test.yml"]] {
        let out = Command::new(promtool()).args(&args).current_dir(&dir).output().unwrap();
        assert!(
            out.status.success(),
            "promtool {args:?}:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

struct Prometheus(Child);

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The state of `alert` in Prometheus's API: `Some(Some("firing" | "pending"))`, `Some(None)`
/// when Prometheus answered and the alert is inactive, `None` while it does not answer.
fn alert_state(port: u16, alert: &str) -> Option<Option<String>> {
    let (_, body) = get(port, "/api/v1/alerts")?;
    let json: serde_json::Value = serde_json::from_str(&body).ok()?;
    let alerts = json["data"]["alerts"].as_array()?;
    let found = alerts.iter().find(|a| a["labels"]["alertname"] == alert);
    Some(found.and_then(|a| a["state"].as_str().map(String::from)))
}

#[tokio::test(flavor = "multi_thread")]
async fn a_real_prometheus_fires_the_slot_lag_and_kafka_silence_alerts_while_kafka_is_frozen() {
    // given a replication relay on a broker of its own, with low lag thresholds
    let broker = OwnBroker::start();
    let s = Setup::create(&broker.brokers(), QUICK_KAFKA_SETTINGS, false, |slot| {
        RelayToml::replication(slot)
            .set("metrics", "sample_interval_secs", 1)
            .set("metrics", "slot_lag_warning_bytes", 65536)
            .set("metrics", "slot_lag_critical_bytes", 262144)
    })
    .await;
    create_topic_on(&broker.brokers(), &s.topic, 1).await;
    create_aggregates(&s.db.client().await, 10).await;
    let mut relay = s.start("relay");
    relay.wait_ready("active").await;
    let relay_port = relay.metrics_port();
    let dir = &s.dir;

    // and a real Prometheus scraping it every second with the shipped rules ("for" shortened,
    // and Kafka's silence alerting after 3 s instead of 5 min)
    let prom_port = free_port();
    let rules = std::fs::read_to_string(repo_root().join("deploy/prometheus/alerts.yml"))
        .unwrap()
        .replace(
            "(outbox_relay_kafka_unacknowledged_seconds) > 300",
            "(outbox_relay_kafka_unacknowledged_seconds) > 3",
        )
        .lines()
        .map(|l| {
            if l.trim_start().starts_with("for: ") {
                l.split("for:").next().unwrap().to_string() + "for: 2s"
            } else {
                l.to_string()
            }
        })
        .collect::<Vec<_>>()
        .join("\n");
    std::fs::write(dir.path().join("alerts.yml"), rules).unwrap();
    std::fs::write(
        dir.path().join("prometheus.yml"),
        format!(
            "global: {{scrape_interval: 1s, evaluation_interval: 1s}}\nrule_files: [alerts.yml]\n\
             scrape_configs:\n  - job_name: outbox-relay\n    static_configs: [{{targets: ['127.0.0.1:{relay_port}']}}]\n"
        ),
    )
    .unwrap();
    let _prometheus = Prometheus(
        Command::new("prometheus")
            .arg(format!("--config.file={}", dir.path().join("prometheus.yml").display()))
            .arg(format!("--storage.tsdb.path={}", dir.path().join("tsdb").display()))
            .arg(format!("--web.listen-address=127.0.0.1:{prom_port}"))
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.path().join("prometheus.log")).unwrap())
            .spawn()
            .expect("prometheus is missing: deploy/local/test installs it (apt-get install prometheus)"),
    );

    // when Kafka stops answering while events keep coming
    broker.freeze();
    let writing = Instant::now();
    let mut writer = s.db.client().await;
    let mut i = 0;
    let fired = relay.context("the slot-lag and Kafka-silence alerts to fire".into());
    let firing = |alert| alert_state(prom_port, alert).flatten().as_deref() == Some("firing");
    wait_until_within(Duration::from_secs(120), fired, async || {
        write_events(&mut writer, &s.aggregate_type, &format!("agg-{}", i % 10), 20, true).await;
        i += 1;
        tokio::time::sleep(Duration::from_millis(150)).await;
        firing("OutboxRelaySlotLagCritical") && firing("OutboxRelayKafkaSilent")
    })
    .await;

    // then both fired in Prometheus, and resolve once Kafka is back
    eprintln!("slot-lag and Kafka-silence alerts firing {:?} after Kafka went down", writing.elapsed());
    broker.thaw();
    wait_until("the alerts to resolve", async || {
        alert_state(prom_port, "OutboxRelaySlotLagCritical") == Some(None)
            && alert_state(prom_port, "OutboxRelayKafkaSilent") == Some(None)
    })
    .await;
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0));
}

#[test]
fn deployment_files_pass_offline_validation() {
    let out = Command::new(repo_root().join("deploy/validate"))
        .env("OUTBOX_RELAY_BIN", relay_bin())
        .output()
        .expect("run deploy/validate");
    assert!(
        out.status.success(),
        "deploy/validate failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(Path::new(&repo_root().join("deploy/Dockerfile")).exists());
}

#[test]
fn every_alert_links_a_runbook_section_in_the_readme() {
    let alerts = std::fs::read_to_string(repo_root().join("deploy/prometheus/alerts.yml")).unwrap();
    let readme = std::fs::read_to_string(repo_root().join("README.md")).unwrap();
    let anchors: BTreeSet<String> = readme
        .lines()
        .filter(|l| l.starts_with('#'))
        .map(|l| {
            l.trim_start_matches('#')
                .trim()
                .to_lowercase()
                .chars()
                .filter(|c| c.is_alphanumeric() || *c == '-')
                .collect()
        })
        .collect();
    let mut linked = 0;
    for link in alerts.split("README#").skip(1) {
        let anchor: String = link.chars().take_while(|c| c.is_alphanumeric()).collect();
        assert!(anchors.contains(&anchor), "alerts.yml links README#{anchor}, which has no heading");
        linked += 1;
    }
    assert_eq!(linked, alerts.matches("- alert:").count(), "every alert needs a runbook link");
}
