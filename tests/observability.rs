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
    // (verify --watch's own are checked against its scrape, below)
    let missing: Vec<_> = used.difference(&names).filter(|n| !n.starts_with(VERIFY_PREFIX)).collect();
    assert!(missing.is_empty(), "used by dashboards/alerts but not exported: {missing:?}");

    // and the outbox's partitions and dead letters are sampled: sql/002 made daily partitions 7
    // days ahead, the default partition and the dead-letter table are empty
    let ahead = value("outbox_relay_outbox_partitions_ahead_seconds");
    assert!((7.0 * 86_400.0..=8.0 * 86_400.0).contains(&ahead), "partitions end in {ahead} s");
    assert_eq!(value("outbox_relay_outbox_default_partition_rows"), 0.0);
    assert_eq!(value("outbox_relay_dead_letters_outstanding"), 0.0);

    // and a row written for a day without a partition is counted in the default partition
    let far = "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload, created_at) \
               VALUES ($1, 'agg-far', 'E', '{}', now() + interval '30 days')";
    writer.execute(far, &[&s.aggregate_type]).await.unwrap();
    relay.wait_metric("outbox_relay_outbox_default_partition_rows", |v| v >= 1.0).await;

    // and the health endpoints answer
    assert_eq!(get(relay.metrics_port(), "/healthz").unwrap().0, 200);
    assert_eq!(get(relay.metrics_port(), "/startedz").unwrap(), (200, "active\n".to_string()));
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
        "promtool is missing: deploy/local/test unpacks it from Debian's prometheus package (apt-get download, no install)"
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

/// The names `verify --watch` exports (`outbox_relay::ops::verify::watch::ALL`).
const VERIFY_PREFIX: &str = "outbox_relay_verify_";

#[tokio::test(flavor = "multi_thread")]
async fn verify_watch_names_an_event_whose_record_was_deleted_and_a_real_prometheus_alerts() {
    // given a replication relay that published 60 events and streams on, and `verify --watch`
    // beside it, passing every second, scraped by a real Prometheus with the shipped rules
    let s = Setup::create(&services().kafka, "", true, RelayToml::replication).await;
    let mut client = s.db.client().await;
    create_aggregates(&client, 10).await;
    let consumer = consumer(&[&s.topic]);
    let mut relay = s.start("relay");
    relay.wait_ready("active").await;
    for i in 0..20 {
        write_events(&mut client, &s.aggregate_type, &format!("agg-{}", i % 10), 3, true).await;
    }
    let records = consume_unique(&consumer, 60, IDLE, LINGER).await;
    let args = ["--every-secs", "1", "--wait-secs", "5", "--show", "5"];
    let mut watch = process::RelayProcess::watch(&s.config(), &s.dir.path().join("watch.log"), &args);
    watch.wait_ready("active").await;
    watch.wait_metric("outbox_relay_verify_rows", |v| v >= 60.0).await;
    assert_eq!(watch.metric("outbox_relay_verify_missing_events"), Some(0.0), "{}", watch.log_text());
    let (_prometheus, prom_port) =
        start_prometheus(s.dir.path(), &[watch.metrics_port()], &quick_rules(|rules| rules));

    // when the first record of a partition is deleted from Kafka (DeleteRecords)
    let lost = delete_first_record(&records).await;

    // then the next pass counts it missing and names it, and nothing else is wrong
    watch.wait_metric("outbox_relay_verify_missing_events", |v| v >= 1.0).await;
    let scrape = watch.scrape();
    assert_eq!(sample(&scrape, "outbox_relay_verify_missing_events"), Some(1.0), "{scrape}");
    let named = format!("outbox_relay_verify_missing_event{{id=\"{lost}\"}}");
    assert!(sample(&scrape, &named).is_some_and(|age| age >= 0.0), "{lost} is not named:\n{scrape}");
    for class in ["unexpected_records", "out_of_order_events", "mismatched_events", "duplicated_events"] {
        assert_eq!(sample(&scrape, &format!("{VERIFY_PREFIX}{class}")), Some(0.0), "{class}:\n{scrape}");
    }
    // and it exports every metric it defines, and those the alert rules use
    let names = metric_names(&scrape);
    for (name, _) in outbox_relay::ops::verify::watch::ALL {
        assert!(names.contains(*name), "{name} missing from the watch's scrape:\n{scrape}");
    }
    let used: Vec<String> =
        names_used_by_dashboards_and_alerts().into_iter().filter(|n| n.starts_with(VERIFY_PREFIX)).collect();
    assert!(!used.is_empty() && used.iter().all(|n| names.contains(n)), "{used:?} vs {names:?}");

    // and Prometheus fires OutboxRelayEventsMissing for this deployment, naming the event
    let mut description = String::new();
    wait_until(watch.context("OutboxRelayEventsMissing to fire".into()), async || {
        description = alert_annotation(prom_port, "OutboxRelayEventsMissing", "description");
        alert_state(prom_port, "OutboxRelayEventsMissing") == Some(Some("firing".into()))
    })
    .await;
    assert!(description.contains(&format!("First missing: {lost} ")), "{description}");
    let labels = alert_labels(prom_port, "OutboxRelayEventsMissing");
    assert_eq!(labels[0]["database"], s.db.name.as_str(), "{labels:?}");
    assert_eq!(watch.terminate(EXIT_LIMIT), Some(0), "{}", watch.log_text());
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0));
}

/// The annotation `name` of the first alert named `alert` (empty when there is none).
fn alert_annotation(port: u16, alert: &str, name: &str) -> String {
    let Some((_, body)) = get(port, "/api/v1/alerts") else { return String::new() };
    let json: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
    let alerts = json["data"]["alerts"].as_array().cloned().unwrap_or_default();
    let found = alerts.iter().find(|a| a["labels"]["alertname"] == alert);
    found.and_then(|a| a["annotations"][name].as_str()).unwrap_or_default().to_string()
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

/// The labels of every alert named `alert`, in whatever state.
fn alert_labels(port: u16, alert: &str) -> Vec<serde_json::Value> {
    let Some((_, body)) = get(port, "/api/v1/alerts") else { return Vec::new() };
    let json: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
    let alerts = json["data"]["alerts"].as_array().cloned().unwrap_or_default();
    alerts.into_iter().filter(|a| a["labels"]["alertname"] == alert).map(|a| a["labels"].clone()).collect()
}

/// The series an instant `query` returns, as label sets (empty while Prometheus does not answer).
fn query(port: u16, query: &str) -> Vec<serde_json::Value> {
    let encoded: String = query
        .bytes()
        .map(|b| if b.is_ascii_alphanumeric() { (b as char).to_string() } else { format!("%{b:02X}") })
        .collect();
    let Some((_, body)) = get(port, &format!("/api/v1/query?query={encoded}")) else { return Vec::new() };
    let json: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
    let results = json["data"]["result"].as_array().cloned().unwrap_or_default();
    results.into_iter().map(|r| r["metric"].clone()).collect()
}

/// The shipped rules with every "for" shortened to 2 s, after `edit`.
fn quick_rules(edit: impl Fn(String) -> String) -> String {
    edit(std::fs::read_to_string(repo_root().join("deploy/prometheus/alerts.yml")).unwrap())
        .lines()
        .map(|l| {
            if l.trim_start().starts_with("for: ") {
                l.split("for:").next().unwrap().to_string() + "for: 2s"
            } else {
                l.to_string()
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// A real Prometheus in `dir` scraping the relays listening on `ports` every second as
/// job="outbox-relay", with `rules`; and the port its API answers on.
fn start_prometheus(dir: &Path, ports: &[u16], rules: &str) -> (Prometheus, u16) {
    let prom_port = free_port();
    std::fs::write(dir.join("alerts.yml"), rules).unwrap();
    let targets: Vec<String> = ports.iter().map(|p| format!("'127.0.0.1:{p}'")).collect();
    std::fs::write(
        dir.join("prometheus.yml"),
        format!(
            "global: {{scrape_interval: 1s, evaluation_interval: 1s}}\nrule_files: [alerts.yml]\n\
             scrape_configs:\n  - job_name: outbox-relay\n    static_configs: [{{targets: [{}]}}]\n",
            targets.join(", ")
        ),
    )
    .unwrap();
    let prometheus = Prometheus(
        Command::new("prometheus")
            .arg(format!("--config.file={}", dir.join("prometheus.yml").display()))
            .arg(format!("--storage.tsdb.path={}", dir.join("tsdb").display()))
            .arg(format!("--web.listen-address=127.0.0.1:{prom_port}"))
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("prometheus.log")).unwrap())
            .spawn()
            .expect("prometheus is missing: deploy/local/test unpacks it from Debian's prometheus package (apt-get download, no install)"),
    );
    (prometheus, prom_port)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_real_prometheus_tells_two_deployments_apart_and_alerts_for_the_one_that_is_down() {
    // given two relay deployments of two databases, both scraped as job="outbox-relay"
    let config = |slot: &str| RelayToml::replication(slot).set("metrics", "sample_interval_secs", 1);
    let orders = Setup::create(&services().kafka, "", true, config).await;
    let billing = Setup::create(&services().kafka, "", true, config).await;
    let mut orders_relay = orders.start("relay");
    let mut billing_relay = billing.start("relay");
    orders_relay.wait_ready("active").await;
    billing_relay.wait_ready("active").await;
    let billing_target = format!("127.0.0.1:{}", billing_relay.metrics_port());
    let (_prometheus, prom_port) = start_prometheus(
        orders.dir.path(),
        &[orders_relay.metrics_port(), billing_relay.metrics_port()],
        &quick_rules(|rules| rules),
    );
    let database = |labels: &serde_json::Value| labels["database"].as_str().unwrap_or_default().to_string();
    let databases = |series: Vec<serde_json::Value>| series.iter().map(database).collect::<BTreeSet<_>>();
    let both: BTreeSet<String> = [orders.db.name.clone(), billing.db.name.clone()].into();

    // then each deployment's slot lag and leader are its own series, as the rules aggregate them
    let per_deployment =
        "max by (namespace, job, database, outbox, slot) (outbox_relay_slot_confirmed_lag_bytes)";
    wait_until("Prometheus to see both deployments' slot lag", async || {
        databases(query(prom_port, per_deployment)) == both
    })
    .await;
    let leaders = query(prom_port, "max by (database, outbox, slot) (outbox_relay_leader) == 1");
    assert_eq!(databases(leaders), both);

    // when the billing relay stops (its deployment has no instance left)
    assert_eq!(billing_relay.terminate(EXIT_LIMIT), Some(0));

    // then "no active instance" fires for billing alone, and so does "down" for its target
    let fired = orders_relay.context("OutboxRelayNoActiveInstance to fire for billing".into());
    wait_until(fired, async || {
        let firing = alert_labels(prom_port, "OutboxRelayNoActiveInstance");
        let down = alert_labels(prom_port, "OutboxRelayDown");
        firing.iter().any(|l| database(l) == billing.db.name)
            && down.iter().any(|l| l["instance"] == billing_target.as_str())
    })
    .await;
    let no_leader = databases(alert_labels(prom_port, "OutboxRelayNoActiveInstance"));
    assert_eq!(no_leader, [billing.db.name.clone()].into(), "the orders deployment still has its leader");
    let down = alert_labels(prom_port, "OutboxRelayDown");
    assert_eq!(down.len(), 1, "only billing's target is down: {down:?}");
    // and the orders relay's series are still its own, billing's are gone from the lag
    assert_eq!(databases(query(prom_port, per_deployment)), [orders.db.name.clone()].into());
    assert_eq!(orders_relay.terminate(EXIT_LIMIT), Some(0));
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
    let rules = quick_rules(|rules| {
        rules.replace(
            "(outbox_relay_kafka_unacknowledged_seconds) > 300",
            "(outbox_relay_kafka_unacknowledged_seconds) > 3",
        )
    });
    let (_prometheus, prom_port) = start_prometheus(dir.path(), &[relay_port], &rules);

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

    // then both fired in Prometheus; and /readyz (and so `status`) says how long Kafka has been
    // silent as of each request, not as of when the stall was noticed
    eprintln!("slot-lag and Kafka-silence alerts firing {:?} after Kafka went down", writing.elapsed());
    let silent_for = |relay: &common::process::RelayProcess| {
        let (_, body) = relay.readyz().unwrap();
        let secs = body.split("acknowledged nothing for ").nth(1).and_then(|r| r.split(' ').next());
        secs.and_then(|s| s.parse::<u64>().ok()).unwrap_or_else(|| panic!("no stall in {body:?}"))
    };
    let first = silent_for(&relay);
    tokio::time::sleep(Duration::from_secs(3)).await;
    let later = silent_for(&relay);
    assert!(later >= first + 2, "/readyz said {first} s, then {later} s three seconds later");

    // and they resolve once Kafka is back
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
fn every_alert_links_a_runbook_section_in_the_operations_page() {
    let alerts = std::fs::read_to_string(repo_root().join("deploy/prometheus/alerts.yml")).unwrap();
    let runbooks = std::fs::read_to_string(repo_root().join("docs/operations.md")).unwrap();
    let anchors = crate::docs::anchors(&runbooks);
    let mut linked = 0;
    for link in alerts.split("docs/operations.md#").skip(1) {
        let anchor: String = link.chars().take_while(|c| c.is_alphanumeric()).collect();
        assert!(
            anchors.contains(&anchor),
            "alerts.yml links docs/operations.md#{anchor}, which has no heading"
        );
        linked += 1;
    }
    assert_eq!(linked, alerts.matches("- alert:").count(), "every alert needs a runbook link");
}
