use std::io::Write;

use crate::config::{
    HeaderRule, OutboxConfig, Placement, RecordFormat, RedactAction, RedactRule, TransformsConfig,
};
use crate::record::{KafkaRecord, Mapping, OutboxRow, PoisonReason, Unpublishable};

fn row(event_type: &str, payload: &str) -> OutboxRow {
    OutboxRow {
        id: Some("7".into()),
        aggregate_type: Some("order".into()),
        aggregate_id: Some("42".into()),
        event_type: Some(event_type.into()),
        payload: Some(payload.into()),
        headers: Some("{\"trace\": \"t1\"}".into()),
        topic: None,
        unreadable: None,
        columns: Vec::new(),
    }
}

fn mapping(transforms: TransformsConfig) -> Mapping {
    let outbox = OutboxConfig {
        name: "orders".into(),
        allowed_topics: vec!["outbox.event.*".into(), "region.*".into()],
        transforms,
        ..OutboxConfig::default()
    };
    Mapping::new(&outbox)
}

fn record(mapping: &Mapping, row: OutboxRow) -> KafkaRecord {
    mapping.to_record(row, None).expect("no registry").expect("publishable")
}

fn refused(mapping: &Mapping, row: OutboxRow) -> Box<Unpublishable> {
    mapping.to_record(row, None).expect("no registry").expect_err("refused")
}

fn redact(pointer: &str, action: RedactAction) -> RedactRule {
    RedactRule { pointer: pointer.into(), action, with: None }
}

#[test]
fn excluded_and_not_included_types_are_filtered_naming_the_rule() {
    let m = mapping(TransformsConfig {
        exclude_event_types: vec!["Audit*".into(), "*.internal".into()],
        include_aggregate_types: vec!["ord?r".into(), "invoice".into()],
        ..TransformsConfig::default()
    });
    let out = refused(&m, row("cache.internal", "{}"));
    assert_eq!(out.filtered_by(), Some("outbox.transforms.exclude_event_types[1] (\"*.internal\")"));
    assert_eq!(
        out.reason.to_string(),
        "outbox orders: filtered by outbox.transforms.exclude_event_types[1] (\"*.internal\")"
    );
    let other = OutboxRow { aggregate_type: Some("cart".into()), ..row("OrderPlaced", "{}") };
    assert_eq!(
        refused(&m, other).filtered_by(),
        Some("outbox.transforms.include_aggregate_types (matches none)")
    );
    assert_eq!(record(&m, row("OrderPlaced", "{}")).topic, "outbox.event.order");
    // a glob matches the whole name, not a part of it
    assert!(m.to_record(row("PreAudit", "{}"), None).unwrap().is_ok());
}

#[test]
fn the_filter_reads_no_payload_so_a_filtered_row_of_any_payload_is_filtered() {
    let m = mapping(TransformsConfig {
        exclude_event_types: vec!["Internal".into()],
        route_by_field: "/region".into(),
        ..TransformsConfig::default()
    });
    let out = refused(&m, row("Internal", "not json"));
    assert!(out.filtered_by().is_some(), "{:?}", out.reason);
}

#[test]
fn a_route_takes_the_topic_from_a_payload_field_within_the_allowlist() {
    let m = mapping(TransformsConfig {
        route_by_field: "/place/region".into(),
        route_topic: "region.{value}".into(),
        ..TransformsConfig::default()
    });
    assert_eq!(record(&m, row("OrderPlaced", r#"{"place":{"region":"eu"}}"#)).topic, "region.eu");
    assert_eq!(record(&m, row("OrderPlaced", r#"{"place":{"region":7}}"#)).topic, "region.7");
    let missing = refused(&m, row("OrderPlaced", r#"{"place":{}}"#));
    assert_eq!(
        missing.reason.to_string(),
        "outbox orders: outbox.transforms.route_by_field cannot apply at /place/region: the routing field is \
         missing; fix the payload (or the rule), then replay the dead letter"
    );
    let through = refused(&m, row("OrderPlaced", r#"{"place":"eu"}"#));
    assert!(
        through.reason.to_string().contains("/place is a string, not an object or array"),
        "{}",
        through.reason
    );
    let not_json = refused(&m, row("OrderPlaced", "plain"));
    assert!(not_json.reason.to_string().contains("the payload is not JSON"), "{}", not_json.reason);
    // the allowlist applies: a value outside it is refused, naming the route
    let outside = OutboxConfig {
        allowed_topics: vec!["region.eu".into()],
        transforms: TransformsConfig {
            route_by_field: "/r".into(),
            route_topic: "region.{value}".into(),
            ..Default::default()
        },
        ..OutboxConfig::default()
    };
    let out = refused(&Mapping::new(&outside), row("OrderPlaced", r#"{"r":"us"}"#));
    assert!(
        matches!(&out.reason, PoisonReason::TopicNotAllowed { from, .. } if from.contains("route_by_field")),
        "{:?}",
        out.reason
    );
    // and a value that is no topic name is refused as such
    let bad = refused(&m, row("OrderPlaced", r#"{"place":{"region":"e u"}}"#));
    assert!(matches!(bad.reason, PoisonReason::BadTopic { .. }), "{:?}", bad.reason);
}

#[test]
fn headers_come_from_columns_and_payload_fields_after_the_rows_own() {
    let header = |from: &str, name: &str| HeaderRule {
        from: from.into(),
        name: name.into(),
        placement: Placement::Header,
    };
    let m = mapping(TransformsConfig {
        headers: vec![
            header("column:aggregate_id", "order_id"),
            header("payload:/tenant", "tenant"),
            header("payload:/n", "n"),
        ],
        ..TransformsConfig::default()
    });
    let event = record(&m, row("OrderPlaced", r#"{"tenant":"acme","n":3}"#));
    let headers: Vec<(&str, &str)> = event.headers().skip(3).collect();
    assert_eq!(headers, [("trace", "t1"), ("order_id", "42"), ("tenant", "acme"), ("n", "3")]);
    let missing = refused(&m, row("OrderPlaced", r#"{"n":3}"#));
    assert!(
        missing
            .reason
            .to_string()
            .contains("outbox.transforms.headers[1] cannot apply at /tenant: the field is missing"),
        "{}",
        missing.reason
    );
    let clash = OutboxRow {
        headers: Some(r#"{"Tenant":"x"}"#.into()),
        ..row("OrderPlaced", r#"{"tenant":"acme","n":3}"#)
    };
    let clash = refused(&m, clash);
    assert!(
        clash.reason.to_string().contains("headers[1] cannot apply at header tenant"),
        "{}",
        clash.reason
    );
}

#[test]
fn redactions_replace_drop_and_hash_and_the_rest_stays_byte_for_byte() {
    let mut key = tempfile::NamedTempFile::new().unwrap();
    writeln!(key, "0123456789abcdef0123456789abcdef").unwrap();
    let m = mapping(TransformsConfig {
        redact: vec![
            RedactRule {
                with: Some(serde_json::json!("****")),
                ..redact("/card/number", RedactAction::Replace)
            },
            redact("/card/cvc", RedactAction::Drop),
            redact("/email", RedactAction::Hash),
        ],
        hash_key_file: key.path().display().to_string(),
        ..TransformsConfig::default()
    });
    let payload = r#"{"card": {"number": "4111 1111 1111 1111", "cvc": "123", "exp": "12/30"}, "email": "a@b.c", "total": 1.50}"#;
    let event = record(&m, row("OrderPlaced", payload));
    let text = String::from_utf8(event.payload.clone()).unwrap();
    let tag = ring::hmac::sign(
        &ring::hmac::Key::new(ring::hmac::HMAC_SHA256, b"0123456789abcdef0123456789abcdef"),
        b"a@b.c",
    );
    let hex: String = tag.as_ref().iter().map(|b| format!("{b:02x}")).collect();
    assert_eq!(text, format!(r#"{{"card":{{"number":"****","exp":"12/30"}},"email":"{hex}","total":1.50}}"#));
    for secret in ["4111", "123", "a@b.c"] {
        assert!(!text.contains(secret), "{text}");
    }
    // the same row redacts to the same bytes (a replay is recognised by its record)
    assert_eq!(record(&m, row("OrderPlaced", payload)).payload, event.payload);
    // a payload without the fields is published as it is
    assert_eq!(record(&m, row("OrderPlaced", r#"{"x": 1}"#)).payload, br#"{"x": 1}"#);
    // a pointer through a scalar is unpublishable, naming the rule and the path
    let out = refused(&m, row("OrderPlaced", r#"{"card": "4111"}"#));
    assert_eq!(
        out.reason.to_string(),
        "outbox orders: outbox.transforms.redact[0] cannot apply at /card/number: /card is a string, not an object \
         or array; fix the payload (or the rule), then replay the dead letter"
    );
    assert_eq!(out.row.payload.as_deref(), Some(r#"{"card": "4111"}"#), "the letter keeps the row as it was");
}

#[test]
fn formats_carry_the_redacted_payload() {
    let outbox = OutboxConfig {
        format: RecordFormat::Debezium,
        transforms: TransformsConfig {
            redact: vec![redact("/pan", RedactAction::Drop)],
            ..Default::default()
        },
        ..OutboxConfig::default()
    };
    let event = record(&Mapping::new(&outbox), row("OrderPlaced", r#"{"pan":"4111","a":1}"#));
    let value = String::from_utf8(event.payload.clone()).unwrap();
    assert!(!value.contains("4111") && value.contains("a"), "{value}");
}

#[test]
fn an_unreadable_hash_key_stops_the_relay_rather_than_publish_unhashed() {
    let m = mapping(TransformsConfig {
        redact: vec![redact("/pan", RedactAction::Hash)],
        hash_key_file: "/nonexistent/redact.key".into(),
        ..TransformsConfig::default()
    });
    let err = m.to_record(row("OrderPlaced", r#"{"pan":"4111"}"#), None).unwrap_err().to_string();
    assert!(
        err.contains("outbox.transforms.redact[0]: cannot read the HMAC key file /nonexistent/redact.key"),
        "{err}"
    );
}

#[test]
fn a_header_from_another_column_is_its_value_and_a_null_or_absent_one_is_refused_naming_it() {
    let m = mapping(TransformsConfig {
        headers: vec![HeaderRule {
            from: "column:tenant_id".into(),
            name: "tenant".into(),
            placement: Placement::Header,
        }],
        ..TransformsConfig::default()
    });
    let with = |value: Option<&str>| OutboxRow {
        columns: vec![("tenant_id".into(), value.map(String::from))],
        ..row("OrderPlaced", "{}")
    };
    let event = record(&m, with(Some("acme")));
    assert_eq!(event.headers().skip(3).collect::<Vec<_>>(), [("trace", "t1"), ("tenant", "acme")]);
    assert_eq!(
        event.row_columns,
        [("tenant_id".to_string(), Some("acme".to_string()))],
        "kept for a dead letter"
    );
    let null = refused(&m, with(None)).reason.to_string();
    assert!(
        null.contains("outbox.transforms.headers[0] cannot apply at column tenant_id: the column is NULL"),
        "{null}"
    );
    let absent = refused(&m, row("OrderPlaced", "{}")).reason.to_string();
    assert!(
        absent.contains("column tenant_id: the event came without it (an outbox_emit() message"),
        "{absent}"
    );
}

#[test]
fn a_header_rule_may_name_a_column_by_the_tables_name_for_it() {
    // a Debezium-style table: `type` holds the event type
    let outbox = OutboxConfig {
        columns: crate::config::ColumnsConfig { event_type: "type".into(), ..Default::default() },
        transforms: TransformsConfig {
            headers: vec![HeaderRule {
                from: "column:type".into(),
                name: "eventType".into(),
                placement: Placement::Header,
            }],
            ..Default::default()
        },
        ..OutboxConfig::default()
    };
    let event = record(&Mapping::new(&outbox), row("OrderPlaced", "{}"));
    assert_eq!(event.headers().last(), Some(("eventType", "OrderPlaced")));
}

#[test]
fn envelope_members_go_beside_the_payload_in_a_debezium_value() {
    // the router's `type:envelope:eventType` with JsonConverter and expand.json.payload
    let envelope = |from: &str, name: &str| HeaderRule {
        from: from.into(),
        name: name.into(),
        placement: Placement::Envelope,
    };
    let outbox = OutboxConfig {
        format: RecordFormat::Debezium,
        debezium: crate::config::DebeziumConfig {
            key_converter: crate::config::Converter::Json,
            value_converter: crate::config::Converter::Json,
            expand_json_payload: true,
        },
        transforms: TransformsConfig {
            headers: vec![envelope("column:event_type", "eventType"), envelope("payload:/n", "n")],
            ..Default::default()
        },
        ..OutboxConfig::default()
    };
    let event = record(&Mapping::new(&outbox), row("OrderPlaced", r#"{"n": 3}"#));
    let value = String::from_utf8(event.payload.clone()).unwrap();
    assert_eq!(value, r#"{"payload":{"n":3},"eventType":"OrderPlaced","n":3}"#);
    assert!(event.headers().all(|(name, _)| name != "eventType"), "an envelope member is no header");
}

#[test]
fn globs_match_whole_names_with_stars_and_question_marks() {
    let glob = |pattern: &str, name: &str| super::Glob::new(pattern).matches(name);
    assert!(glob("order.*", "order.placed") && glob("order.*", "order."));
    assert!(!glob("order.*", "xorder.placed") && !glob("order.*", "order"));
    assert!(glob("*.internal", "cache.internal") && !glob("*.internal", "cache.internal.v2"));
    assert!(glob("a*b*c", "aXXbYYbZc") && !glob("a*b*c", "aXXbYY"));
    assert!(glob("v?", "v2") && !glob("v?", "v10"));
    assert!(glob("*", "") && glob("Zahlung*", "ZahlungGeprüft") && glob("Prüf?ng", "Prüfung"));
    assert!(glob("OrderPlaced", "OrderPlaced") && !glob("OrderPlaced", "orderplaced"));
}
