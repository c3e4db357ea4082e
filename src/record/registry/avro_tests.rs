use apache_avro::reader::datum::GenericDatumReader;
use serde_json::json;

use super::*;

const ORDER: &str = r#"{
    "type": "record", "name": "OrderPlaced", "namespace": "shop",
    "fields": [
        {"name": "id", "type": "string"},
        {"name": "amount", "type": "long"},
        {"name": "currency", "type": "string", "default": "EUR"},
        {"name": "note", "type": ["null", "string"], "default": null},
        {"name": "status", "type": {"type": "enum", "name": "Status", "symbols": ["NEW", "PAID"]}},
        {"name": "lines", "type": {"type": "array", "items": {
            "type": "record", "name": "Line",
            "fields": [{"name": "sku", "type": "string"}, {"name": "qty", "type": "int"}]}}},
        {"name": "tags", "type": {"type": "map", "values": "string"}, "default": {}},
        {"name": "placed_at", "type": {"type": "long", "logicalType": "timestamp-millis"}},
        {"name": "previous", "type": ["null", "Line"], "default": null}
    ]
}"#;

fn order() -> Json {
    json!({
        "id": "o-1", "amount": -3, "note": {"string": "hi"}, "status": "PAID",
        "lines": [{"sku": "A", "qty": 2}], "placed_at": 1000
    })
}

fn encoded(schema: &str, json: &Json) -> Result<Vec<u8>, String> {
    let mut out = Vec::new();
    AvroSchema::parse(schema).unwrap().encode(json, &mut out).map(|()| out)
}

#[test]
fn a_record_encodes_to_the_hand_computed_bytes_and_reads_back() {
    let bytes = encoded(ORDER, &order()).unwrap();
    #[rustfmt::skip]
    let expected: &[u8] = &[
        0x06, b'o', b'-', b'1',       // id: length 3 (zigzag 6), "o-1"
        0x05,                         // amount -3: zigzag 5
        0x06, b'E', b'U', b'R',       // currency: the default
        0x02, 0x04, b'h', b'i',       // note: union branch 1 (string), "hi"
        0x02,                         // status: symbol 1 (PAID)
        0x02, 0x02, b'A', 0x04, 0x00, // lines: a block of 1 {sku "A", qty 2}, end
        0x00,                         // tags: the default, an empty map
        0xd0, 0x0f,                   // placed_at 1000: zigzag 2000 as a varint
        0x00,                         // previous: union branch 0 (null)
    ];
    assert_eq!(bytes, expected);

    let schema = AvroSchema::parse(ORDER).unwrap();
    let reader = GenericDatumReader::builder(&schema.root).build().unwrap();
    let Value::Record(fields) = reader.read_value(&mut &bytes[..]).unwrap() else { panic!("not a record") };
    assert_eq!(fields[1], ("amount".to_string(), Value::Long(-3)));
    assert_eq!(fields[3].1, Value::Union(1, Box::new(Value::String("hi".into()))));
    assert_eq!(fields[4].1, Value::Enum(1, "PAID".into()));
    assert_eq!(fields[7].1, Value::TimestampMillis(1000));
}

#[test]
fn the_full_name_is_namespace_dot_name() {
    assert_eq!(AvroSchema::parse(ORDER).unwrap().full_name().as_deref(), Some("shop.OrderPlaced"));
    assert_eq!(AvroSchema::parse(r#""string""#).unwrap().full_name(), None);
}

#[test]
fn a_mismatch_names_the_field() {
    let with = |key: &str, value: Json| {
        let mut payload = order();
        payload[key] = value;
        encoded(ORDER, &payload).unwrap_err()
    };
    assert_eq!(with("amount", json!("x")), r#"field "amount": expected long, got string "x""#);
    assert_eq!(
        with("lines", json!([{"sku": "A", "qty": 2}, {"sku": "B", "qty": "two"}])),
        r#"field "lines[1].qty": expected int, got string "two""#
    );
    assert_eq!(
        with("lines", json!([{"sku": "A", "qty": 3_000_000_000_u64}])),
        r#"field "lines[0].qty": expected int, got number 3000000000 (out of range)"#
    );
    assert_eq!(
        with("status", json!("LOST")),
        r#"field "status": expected a symbol of enum shop.Status (NEW, PAID), got string "LOST""#
    );
    assert_eq!(with("colour", json!("red")), r#"field "colour": is not a field of record shop.OrderPlaced"#);
    assert_eq!(with("tags", json!({"a": 1})), r#"field "tags[a]": expected string, got number 1"#);
    assert_eq!(with("lines", json!([{"sku": "A"}])), r#"missing required field "lines[0].qty""#);

    let mut missing = order();
    missing.as_object_mut().unwrap().remove("id");
    assert_eq!(encoded(ORDER, &missing).unwrap_err(), r#"missing required field "id""#);
    let error = encoded(ORDER, &json!([1])).unwrap_err();
    assert_eq!(error, "payload: expected record shop.OrderPlaced, got array of 1 items");
}

#[test]
fn a_union_takes_the_avro_json_form_or_the_first_branch_that_fits() {
    let schema = r#"["null", "long", "string", {"type": "record", "name": "p.Point", "fields": [{"name": "x", "type": "int"}]}]"#;
    let branch = |json: Json| encoded(schema, &json).map(|bytes| bytes[0]);
    assert_eq!(branch(json!(null)), Ok(0));
    assert_eq!(branch(json!(5)), Ok(2), "long is branch 1, zigzag 2");
    assert_eq!(branch(json!("5")), Ok(4));
    assert_eq!(branch(json!({"string": "5"})), Ok(4));
    assert_eq!(branch(json!({"x": 1})), Ok(6));
    assert_eq!(branch(json!({"p.Point": {"x": 1}})), Ok(6));
    assert_eq!(branch(json!({"Point": {"x": 1}})), Ok(6), "the short name is accepted too");
    assert_eq!(
        branch(json!({"long": "x"})),
        Err(r#"payload: expected long, got string "x""#.to_string()),
        "the branch it names is the error"
    );
    assert_eq!(
        branch(json!(true)),
        Err("payload: expected one of [null, long, string, p.Point], got boolean true".into())
    );

    // a reference to a named type defined earlier, in a nullable union: its own error
    let mut order = order();
    order["previous"] = json!({"sku": "B", "qty": 1});
    assert_eq!(encoded(ORDER, &order).unwrap().last(), Some(&0x02));
    order["previous"] = json!({"sku": "B", "qty": 1.5});
    assert_eq!(encoded(ORDER, &order).unwrap_err(), r#"field "previous.qty": expected int, got number 1.5"#);
}

#[test]
fn numbers_are_range_checked_and_integral_floats_count() {
    assert_eq!(encoded(r#""long""#, &json!(3.0)), Ok(vec![0x06]));
    assert_eq!(
        encoded(r#""long""#, &json!(u64::MAX)).unwrap_err(),
        format!("payload: expected long, got number {} (out of range)", u64::MAX)
    );
    assert_eq!(
        encoded(r#""int""#, &json!(-2_147_483_649_i64)).unwrap_err(),
        "payload: expected int, got number -2147483649 (out of range)"
    );
    assert_eq!(
        encoded(r#""float""#, &json!(1e300)).unwrap_err(),
        "payload: expected float, got number 1e+300 (out of the float range)"
    );
    assert_eq!(encoded(r#""double""#, &json!(0.5)), Ok(0.5f64.to_le_bytes().to_vec()));
}

#[test]
fn bytes_fixed_logical_types_and_uuid() {
    assert_eq!(encoded(r#""bytes""#, &json!("hé")), Ok(vec![0x06, b'h', 0xc3, 0xa9]));
    let fixed = r#"{"type": "fixed", "name": "Code", "size": 2}"#;
    assert_eq!(encoded(fixed, &json!("ab")), Ok(b"ab".to_vec()));
    assert_eq!(
        encoded(fixed, &json!("abc")).unwrap_err(),
        "payload: expected fixed Code (2 bytes as a string), got 3 bytes"
    );
    let date = r#"{"type": "int", "logicalType": "date"}"#;
    assert_eq!(encoded(date, &json!(1)), Ok(vec![0x02]));
    assert!(encoded(date, &json!("2024-01-01")).unwrap_err().starts_with("payload: expected date"));
    let uuid = r#"{"type": "string", "logicalType": "uuid"}"#;
    let text = "0e6f1c2a-4b5d-4e8f-9a0b-1c2d3e4f5a6b";
    let mut expected = vec![72];
    expected.extend_from_slice(text.as_bytes());
    assert_eq!(encoded(uuid, &json!(text)), Ok(expected));
    assert_eq!(encoded(uuid, &json!("nope")).unwrap_err(), r#"payload: expected uuid, got string "nope""#);
}

#[test]
fn decimal_is_refused_when_the_schema_is_parsed() {
    let schema = r#"{"type": "record", "name": "Price", "fields": [
        {"name": "amount", "type": {"type": "bytes", "logicalType": "decimal", "precision": 9, "scale": 2}}]}"#;
    let error = AvroSchema::parse(schema).unwrap_err();
    assert!(error.starts_with(r#"field "amount": the logical type decimal is not supported"#), "{error}");
    assert!(AvroSchema::parse("{").unwrap_err().starts_with("not a valid Avro schema:"));
}
