use super::*;
use crate::config::OutboxConfig;

fn raw() -> OutboxRow {
    OutboxRow {
        id: Some("7".into()),
        aggregate_type: Some("order".into()),
        aggregate_id: Some("42".into()),
        event_type: Some("OrderPlaced".into()),
        payload: Some("{\"a\": 1}".into()),
        headers: Some("{\"traceparent\": \"00-abc-01\", \"n\": 3}".into()),
        topic: None,
        unreadable: None,
        columns: Vec::new(),
    }
}

fn mapping() -> Mapping {
    Mapping::new(&OutboxConfig::default())
}

#[test]
fn row_becomes_record() {
    let event = mapping().to_record(raw(), None).expect("no registry").unwrap();
    assert_eq!(event.topic, "outbox.event.order");
    assert_eq!(event.key, "42");
    assert_eq!(event.payload, b"{\"a\": 1}");
    let headers: Vec<(&str, &str)> = event.headers().collect();
    assert_eq!(
        headers,
        [
            ("id", "7"),
            ("event_type", "OrderPlaced"),
            ("aggregate_type", "order"),
            ("traceparent", "00-abc-01")
        ]
    );
}

/// A mapping where rows may choose topics among `allowed`.
fn row_topics(allowed: &[&str]) -> Mapping {
    Mapping::new(&OutboxConfig {
        row_topics: true,
        allowed_topics: allowed.iter().map(|a| a.to_string()).collect(),
        ..Default::default()
    })
}

#[test]
fn a_row_topic_is_refused_by_default_naming_the_setting() {
    let row = OutboxRow { topic: Some("ledger.internal".into()), ..raw() };
    let err = mapping().to_record(row.clone(), None).expect("no registry").unwrap_err();
    assert!(matches!(err.reason, PoisonReason::RowTopicOff { .. }), "{}", err.reason);
    let reason = err.reason.to_string();
    assert!(reason.contains("\"ledger.internal\"") && reason.contains("outbox.row_topics"), "{reason}");
    assert_eq!(err.row, row);
    // (NULL and empty are no choice)
    for topic in [None, Some(String::new())] {
        let event = mapping().to_record(OutboxRow { topic, ..raw() }, None).expect("no registry").unwrap();
        assert_eq!(event.topic, "outbox.event.order");
    }
}

#[test]
fn a_row_naming_the_templates_topic_chooses_nothing() {
    // (a dead letter's row_data holds the resolved topic; inserted again it must map alike)
    let row = OutboxRow { topic: Some("outbox.event.order".into()), ..raw() };
    assert_eq!(mapping().to_record(row, None).expect("no registry").unwrap().topic, "outbox.event.order");
}

#[test]
fn with_row_topics_a_row_topic_must_be_allowed() {
    let mapping = row_topics(&["billing", "audit.*"]);
    for topic in ["billing", "audit.eu"] {
        let event = mapping
            .to_record(OutboxRow { topic: Some(topic.into()), ..raw() }, None)
            .expect("no registry")
            .unwrap();
        assert_eq!(event.topic, topic);
    }
    let err = mapping
        .to_record(OutboxRow { topic: Some("ledger.internal".into()), ..raw() }, None)
        .expect("no registry")
        .unwrap_err();
    assert_eq!(
        err.reason.to_string(),
        "topic \"ledger.internal\" (from column topic) is not in outbox.allowed_topics; add it, or a \
         prefix of it ending in *, to outbox.allowed_topics"
    );
    // without a list no row topic is allowed, validated or not
    let err = row_topics(&[])
        .to_record(OutboxRow { topic: Some("billing".into()), ..raw() }, None)
        .expect("no registry")
        .unwrap_err();
    assert!(matches!(err.reason, PoisonReason::TopicNotAllowed { .. }), "{}", err.reason);
}

#[test]
fn a_set_allowlist_applies_to_the_templates_topics_too() {
    // the template's topic is allowed while the list is empty, and must match once it is set
    let outbox = OutboxConfig { allowed_topics: vec!["outbox.event.order".into()], ..Default::default() };
    let mapping = Mapping::new(&outbox);
    assert_eq!(mapping.to_record(raw(), None).expect("no registry").unwrap().topic, "outbox.event.order");
    let err = mapping
        .to_record(OutboxRow { aggregate_type: Some("wallet".into()), ..raw() }, None)
        .expect("no registry")
        .unwrap_err();
    let reason = err.reason.to_string();
    assert!(reason.contains("rendered by outbox.topic_template"), "{reason}");
    assert!(reason.starts_with("topic \"outbox.event.wallet\""), "{reason}");
}

#[test]
fn a_row_header_with_a_relay_name_is_refused_naming_it() {
    for name in [
        "id",
        "event_type",
        "aggregate_type",
        "outbox_relay_source",
        "outbox_relay_position",
        "ID",
        "Outbox_Relay_x",
    ] {
        let row = OutboxRow { headers: Some(format!("{{\"{name}\": \"forged\"}}")), ..raw() };
        let err = mapping().to_record(row, None).expect("no registry").unwrap_err();
        assert_eq!(
            err.reason.to_string(),
            format!(
                "header \"{name}\" in column headers is reserved for the relay (id, event_type, \
                 aggregate_type, outbox_relay_*, and with outbox.format = \"cloudevents\" ce_* and \
                 content-type); rename it in the row's headers"
            )
        );
    }
    // a reserved name is refused whatever its value (a number is not a header, but says the same)
    let err = mapping()
        .to_record(OutboxRow { headers: Some("{\"id\": 5}".into()), ..raw() }, None)
        .expect("no registry")
        .unwrap_err();
    assert!(matches!(err.reason, PoisonReason::ReservedHeader { .. }), "{}", err.reason);
    // look-alikes are the application's own
    let headers = Some("{\"identity\": \"a\", \"outbox_relayer\": \"b\", \"event\": \"c\"}".into());
    let event = mapping().to_record(OutboxRow { headers, ..raw() }, None).expect("no registry").unwrap();
    assert_eq!(event.row_headers.len(), 3);
}

#[test]
fn template_parts_render_in_order() {
    let outbox =
        OutboxConfig { topic_template: "x.{event_type}-{aggregate_type}.y".into(), ..Default::default() };
    assert_eq!(Mapping::new(&outbox).render_topic("order", "Placed"), "x.Placed-order.y");
    let outbox = OutboxConfig { topic_template: "plain".into(), ..Default::default() };
    assert_eq!(Mapping::new(&outbox).render_topic("order", "Placed"), "plain");
}

#[test]
fn template_uses_event_type() {
    let outbox =
        OutboxConfig { topic_template: "{aggregate_type}.{event_type}".into(), ..Default::default() };
    let event = Mapping::new(&outbox).to_record(raw(), None).expect("no registry").unwrap();
    assert_eq!(event.topic, "order.OrderPlaced");
}

#[test]
fn null_aggregate_id_is_poison_naming_the_column() {
    let row = OutboxRow { aggregate_id: None, ..raw() };
    let err = mapping().to_record(row.clone(), None).expect("no registry").unwrap_err();
    assert_eq!(err.reason.to_string(), "column aggregate_id is NULL");
    assert_eq!(err.row, row, "the row comes back whole, for the dead-letter table");
}

#[test]
fn bad_headers_and_topics_are_poison() {
    let err = mapping()
        .to_record(OutboxRow { headers: Some("[1]".into()), ..raw() }, None)
        .expect("no registry")
        .unwrap_err();
    assert!(matches!(err.reason, PoisonReason::BadHeaders { .. }), "{}", err.reason);
    let err = row_topics(&["*"])
        .to_record(OutboxRow { topic: Some("a b".into()), ..raw() }, None)
        .expect("no registry")
        .unwrap_err();
    assert!(matches!(err.reason, PoisonReason::BadTopic { .. }), "{}", err.reason);
    let err = mapping()
        .to_record(OutboxRow { aggregate_type: Some("ü".into()), ..raw() }, None)
        .expect("no registry")
        .unwrap_err();
    assert!(matches!(err.reason, PoisonReason::BadTopic { .. }), "{}", err.reason);
}

#[test]
fn unreadable_text_is_poison_naming_the_column() {
    let row = OutboxRow { payload: Some("caf\u{fffd}".into()), unreadable: Some("payload".into()), ..raw() };
    let err = mapping().to_record(row, None).expect("no registry").unwrap_err();
    assert_eq!(err.reason.to_string(), "column payload is not valid UTF-8 text");
}

#[test]
fn positions_print_and_parse_back() {
    for position in [
        Position::Stream { commit: Lsn(0x16_B374_D848), index: 3 },
        Position::Copy { point: Lsn(0x16_B300_0000), index: 41 },
        Position::Batch { session: 0x9f2c_4e1a_0b7d_3c55, batch: 12, index: 7 },
    ] {
        assert_eq!(position.to_string().parse::<Position>(), Ok(position));
    }
    assert_eq!(Position::Stream { commit: Lsn(0x16_B374_D848), index: 3 }.to_string(), "lsn:16/B374D848:3");
    for bad in ["", "lsn:16/B374D848", "lsn:x:1", "batch:zz-1:2", "other:0/0:1"] {
        assert!(bad.parse::<Position>().is_err(), "{bad}");
    }
}

#[test]
fn a_record_gives_back_the_row_it_came_from() {
    let event = mapping().to_record(raw(), None).expect("no registry").unwrap();
    let json = serde_json::to_value(event.row_data()).unwrap();
    let back = OutboxRow::from_json(json.as_object().unwrap());
    assert_eq!(back.id.as_deref(), Some("7"));
    assert_eq!(back.aggregate_type.as_deref(), Some("order"));
    assert_eq!(back.aggregate_id.as_deref(), Some("42"));
    assert_eq!(back.event_type.as_deref(), Some("OrderPlaced"));
    assert_eq!(back.payload.as_deref(), Some("{\"a\": 1}"));
    assert_eq!(back.headers.as_deref(), Some("{\"traceparent\":\"00-abc-01\"}"));
    assert_eq!(back.topic.as_deref(), Some("outbox.event.order"));
    // and maps to the same record again
    assert_eq!(mapping().to_record(back, None).expect("no registry").unwrap(), event);
}

#[test]
fn row_data_in_a_reason_is_escaped_and_cut() {
    // a topic of a megabyte holding a newline and a NUL
    let topic = format!("a\nb\0{}", "c".repeat(1_000_000));
    let reason = validate_topic(&topic).unwrap_err().to_string();
    assert!(reason.starts_with(r#"topic "a\nb\0cc"#), "{}", &reason[..80]);
    assert!(reason.len() < 200, "a reason quotes an excerpt: {} bytes", reason.len());
    assert!(!reason.contains('\n') && !reason.contains('\0'));
}
