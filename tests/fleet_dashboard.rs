//! The fleet dashboard (dashboards/outbox-relay-fleet.json): one row per relay across databases,
//! with the columns an operator of many databases reads first, each row linking to the per-relay
//! dashboard. That every metric its queries name exists in a real scrape is
//! observability::a_real_scrape_lists_every_metric_with_sane_values's check (it reads dashboards/).

use serde_json::Value;

use crate::common::repo_root;

fn dashboard(name: &str) -> Value {
    serde_json::from_str(&std::fs::read_to_string(repo_root().join("dashboards").join(name)).unwrap())
        .unwrap()
}

#[test]
fn the_fleet_table_has_a_row_per_relay_and_links_each_to_its_dashboard() {
    let fleet = dashboard("outbox-relay-fleet.json");
    let relay_uid = dashboard("outbox-relay.json")["uid"].as_str().unwrap().to_string();
    let table = &fleet["panels"][0];
    assert_eq!(table["type"], "table", "{table}");

    // one row per relay: every query keeps exactly the labels that name one, and the rows merge
    let targets = table["targets"].as_array().unwrap();
    for target in targets {
        let expr = target["expr"].as_str().unwrap();
        assert!(expr.contains("by (namespace, database, outbox, slot)"), "{expr}");
        assert_eq!(target["format"], "table", "{target}");
    }
    assert_eq!(table["transformations"][0]["id"], "merge");

    // the columns: state, slot lag, retained WAL, events/s, dead letters, last verification, fatal
    let renamed = &table["transformations"][1]["options"]["renameByName"];
    let columns: Vec<&str> = renamed.as_object().unwrap().values().map(|v| v.as_str().unwrap()).collect();
    for column in [
        "State",
        "Slot lag",
        "Retained WAL",
        "Events/s",
        "Dead letters waiting",
        "Last verification",
        "Fatal",
    ] {
        assert!(columns.contains(&column), "no column {column} in {columns:?}");
    }
    let metrics = [
        "outbox_relay_leader",
        "outbox_relay_slot_confirmed_lag_bytes",
        "outbox_relay_slot_retained_wal_bytes",
        "outbox_relay_events_published_total",
        "outbox_relay_dead_letters_outstanding",
        "outbox_relay_verify_last_pass_timestamp_seconds",
        "outbox_relay_fatal_error",
    ];
    for metric in metrics {
        assert!(
            targets.iter().any(|t| t["expr"].as_str().unwrap().contains(metric)),
            "no query reads {metric}"
        );
    }
    // and the fatal reasons beside it
    assert!(fleet["panels"].as_array().unwrap().iter().any(|p| {
        p["targets"][0]["expr"]
            .as_str()
            .is_some_and(|e| e.contains("reason") && e.contains("outbox_relay_fatal_error"))
    }));

    // each row links to the per-relay dashboard with its database, outbox and slot
    let link = table["fieldConfig"]["overrides"]
        .as_array()
        .unwrap()
        .iter()
        .find(|o| o["matcher"]["options"] == "database")
        .map(|o| o["properties"][0]["value"][0]["url"].as_str().unwrap().to_string())
        .expect("no link on the database column");
    assert!(link.starts_with(&format!("/d/{relay_uid}/")), "{link}");
    for variable in ["database", "outbox", "slot"] {
        assert!(link.contains(&format!("var-{variable}=${{__data.fields.{variable}}}")), "{link}");
    }
}
