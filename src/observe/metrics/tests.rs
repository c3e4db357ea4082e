use super::*;

#[test]
fn every_metric_renders_with_its_name() {
    let m = metrics();
    m.events_read.with_label_values(&["polling"]).inc();
    m.events_published.with_label_values(&["polling"]).inc();
    m.events_dead_lettered.with_label_values(&["polling"]).inc();
    m.publish_errors.with_label_values(&["timeout"]).inc();
    m.slot_wal_status.with_label_values(&["reserved"]).set(1);
    m.build_info.with_label_values(&["0", "polling"]).set(1.0);
    m.fatal.with_label_values(&["other"]).set(0);
    let published = m.events_published.with_label_values(&["polling"]);
    m.acknowledged_at(&published, Instant::now(), Some(SystemTime::now()), &Clock::now());
    let text = m.render();
    for name in
        [EVENTS_READ, PUBLISH_LATENCY, END_TO_END_LATENCY, SLOT_CONFIRMED_LAG, LEADER, BUILD_INFO, FATAL]
    {
        assert!(text.contains(&format!("# TYPE {name} ")), "{name} missing");
    }
    assert!(text.contains("outbox_relay_end_to_end_latency_seconds_bucket{le=\"0.001\"}"));
    m.initialize(Mode::Replication, "0");
    m.initialize_outboxes(["orders", "ledger"]);
    let text = m.render();
    assert!(text.contains("outbox_relay_outbox_events_published_total{outbox_name=\"ledger\"} 0"), "{text}");
    for (name, help) in ALL {
        assert!(text.contains(&format!("# HELP {name} {help}")), "{name} missing after initialize");
    }
    assert!(text.contains("outbox_relay_end_to_end_latency_seconds_bucket{le=\"60\"}"));
}

#[test]
fn every_series_carries_the_deployment_s_labels() {
    let m = Metrics::new();
    m.initialize(Mode::Polling, "0");
    m.label_deployment(["app".into(), "public.outbox_events".into(), "orders_slot".into()]);
    m.events_read.with_label_values(&["polling"]).inc();
    m.leader.set(1);
    let text = m.render();
    let deployment = r#"database="app",outbox="public.outbox_events",slot="orders_slot""#;
    assert!(text.contains(&format!("outbox_relay_leader{{{deployment}}} 1")), "{text}");
    assert!(text.contains(&format!("outbox_relay_events_read_total{{mode=\"polling\",{deployment}}} 1")));
    assert!(
        text.contains(&format!("outbox_relay_end_to_end_latency_seconds_bucket{{{deployment},le=\"60\"}} 0")),
        "{text}"
    );
    let samples = text.lines().filter(|l| !l.starts_with('#'));
    let unlabelled: Vec<_> = samples.filter(|l| !l.contains(deployment)).collect();
    assert!(unlabelled.is_empty(), "series without the deployment's labels: {unlabelled:?}");
}
