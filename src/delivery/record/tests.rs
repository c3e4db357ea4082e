use super::*;

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
    }
}

fn mapping() -> Mapping {
    Mapping::new(&OutboxConfig::default())
}

#[test]
fn row_becomes_record() {
    let event = mapping().to_record(raw(), None).unwrap();
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

#[test]
fn row_topic_overrides_template() {
    let event = mapping().to_record(OutboxRow { topic: Some("billing".into()), ..raw() }, None).unwrap();
    assert_eq!(event.topic, "billing");
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
    let event = Mapping::new(&outbox).to_record(raw(), None).unwrap();
    assert_eq!(event.topic, "order.OrderPlaced");
}

#[test]
fn null_aggregate_id_is_poison_naming_the_column() {
    let row = OutboxRow { aggregate_id: None, ..raw() };
    let err = mapping().to_record(row.clone(), None).unwrap_err();
    assert_eq!(err.reason.to_string(), "column aggregate_id is NULL");
    assert_eq!(err.row, row, "the row comes back whole, for the dead-letter table");
}

#[test]
fn bad_headers_and_topics_are_poison() {
    let err = mapping().to_record(OutboxRow { headers: Some("[1]".into()), ..raw() }, None).unwrap_err();
    assert!(matches!(err.reason, PoisonReason::BadHeaders { .. }), "{}", err.reason);
    let err = mapping().to_record(OutboxRow { topic: Some("a b".into()), ..raw() }, None).unwrap_err();
    assert!(matches!(err.reason, PoisonReason::BadTopic { .. }), "{}", err.reason);
    let err = mapping().to_record(OutboxRow { aggregate_type: Some("ü".into()), ..raw() }, None).unwrap_err();
    assert!(matches!(err.reason, PoisonReason::BadTopic { .. }), "{}", err.reason);
}

#[test]
fn unreadable_text_is_poison_naming_the_column() {
    let row = OutboxRow { payload: Some("caf\u{fffd}".into()), unreadable: Some("payload".into()), ..raw() };
    let err = mapping().to_record(row, None).unwrap_err();
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
    let event = mapping().to_record(raw(), None).unwrap();
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
    assert_eq!(mapping().to_record(back, None).unwrap(), event);
}
