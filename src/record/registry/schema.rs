//! A schema of one of the three types, parsed once, and how it encodes a JSON value.

use std::fmt;

use serde_json::Value as Json;

use super::avro::AvroSchema;
use super::error::excerpt;
use super::protobuf::ProtoSchema;
use crate::config::registry::SchemaType;

/// A parsed schema, ready to encode payloads.
#[derive(Debug)]
pub(super) enum Schema {
    Avro(AvroSchema),
    Json(JsonSchema),
    Protobuf(ProtoSchema),
}

impl Schema {
    /// Parses schema text of `schema_type`; the error says what is wrong with it.
    pub(super) fn parse(schema_type: SchemaType, text: &str) -> Result<Schema, String> {
        match schema_type {
            SchemaType::Avro => AvroSchema::parse(text).map(Schema::Avro),
            SchemaType::Json => JsonSchema::parse(text).map(Schema::Json),
            SchemaType::Protobuf => ProtoSchema::parse(text).map(Schema::Protobuf),
        }
    }

    /// The fully-qualified name the `record_name` strategy uses as the subject, if it has one.
    pub(super) fn full_name(&self) -> Option<String> {
        match self {
            Schema::Avro(avro) => avro.full_name(),
            Schema::Json(json) => json.title.clone(),
            Schema::Protobuf(proto) => Some(proto.full_name()),
        }
    }

    /// Appends the encoding of `json`, parsed from `payload`, (after the wire-format header) to
    /// `out`; the error names the field.
    pub(super) fn encode(&self, json: &Json, payload: &str, out: &mut Vec<u8>) -> Result<(), String> {
        match self {
            Schema::Avro(avro) => avro.encode(json, out),
            Schema::Json(schema) => schema.encode(json, payload, out),
            Schema::Protobuf(proto) => proto.encode(json, out),
        }
    }
}

/// A compiled JSON Schema: the encoding is the payload's JSON text without its insignificant
/// whitespace, once it validates. (The text, not the parsed value printed again: a jsonb number
/// may have more digits than an f64 keeps.)
/// The draft is the one `$schema` names, else draft 7 (what Confluent's serializers assume).
/// `$ref`s to other documents are not fetched.
pub(super) struct JsonSchema {
    validator: jsonschema::Validator,
    title: Option<String>,
}

impl fmt::Debug for JsonSchema {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("JsonSchema").field("title", &self.title).finish_non_exhaustive()
    }
}

impl JsonSchema {
    pub(super) fn parse(text: &str) -> Result<JsonSchema, String> {
        let schema: Json =
            serde_json::from_str(text).map_err(|e| format!("not a valid JSON Schema: not JSON ({e})"))?;
        let built = match schema.get("$schema") {
            Some(_) => jsonschema::validator_for(&schema),
            None => jsonschema::options().with_draft(jsonschema::Draft::Draft7).build(&schema),
        };
        let validator = built.map_err(|e| format!("not a valid JSON Schema: {e}"))?;
        let title = schema.get("title").and_then(Json::as_str).map(str::to_string);
        Ok(JsonSchema { validator, title })
    }

    fn encode(&self, json: &Json, payload: &str, out: &mut Vec<u8>) -> Result<(), String> {
        if let Err(error) = self.validator.validate(json) {
            let path = error.instance_path().to_string();
            // the message quotes the value: cut it, the detail is logged and stored
            let message = error.to_string();
            let message = if message.chars().count() > 200 { excerpt(&message) } else { message };
            return Err(match path.as_str() {
                "" => format!("payload: {message}"),
                pointer => format!("field \"{}\": {message}", dotted(pointer)),
            });
        }
        write_compact(payload, out);
        Ok(())
    }
}

/// Valid JSON text without the whitespace between tokens; strings and numbers as they are.
fn write_compact(text: &str, out: &mut Vec<u8>) {
    let (mut in_string, mut escaped) = (false, false);
    for &byte in text.as_bytes() {
        if in_string {
            out.push(byte);
            match byte {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
        } else if !matches!(byte, b' ' | b'\t' | b'\n' | b'\r') {
            in_string = byte == b'"';
            out.push(byte);
        }
    }
}

/// A JSON Pointer (`/lines/0/sku`) as the other encodings name a field (`lines[0].sku`).
fn dotted(pointer: &str) -> String {
    let mut path = String::new();
    for token in pointer.split('/').skip(1) {
        let token = token.replace("~1", "/").replace("~0", "~");
        match token.parse::<usize>() {
            Ok(index) => path.push_str(&format!("[{index}]")),
            Err(_) if path.is_empty() => path.push_str(&token),
            Err(_) => path.push_str(&format!(".{token}")),
        }
    }
    path
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const PAYMENT: &str = r#"{
        "title": "shop.PaymentCaptured",
        "type": "object",
        "properties": {
            "amount": {"type": "integer", "minimum": 0},
            "currency": {"type": "string", "enum": ["EUR", "USD"]},
            "lines": {"type": "array", "items": {"type": "object", "properties": {"sku": {"type": "string"}}}}
        },
        "required": ["amount", "currency"]
    }"#;

    fn encoded(json: Json) -> Result<Vec<u8>, String> {
        let mut out = Vec::new();
        JsonSchema::parse(PAYMENT).unwrap().encode(&json, &json.to_string(), &mut out).map(|()| out)
    }

    #[test]
    fn a_valid_payload_is_its_compact_json_text() {
        let out = encoded(json!({"amount": 12, "currency": "EUR", "lines": [{"sku": "A"}]})).unwrap();
        assert_eq!(
            String::from_utf8(out).unwrap(),
            r#"{"amount":12,"currency":"EUR","lines":[{"sku":"A"}]}"#
        );
        let schema = Schema::parse(SchemaType::Json, PAYMENT).unwrap();
        assert_eq!(schema.full_name().as_deref(), Some("shop.PaymentCaptured"));
    }

    #[test]
    fn the_text_is_kept_digit_for_digit_without_its_whitespace() {
        let payload = "{\"amount\" : 123456789.123456789012,\n \"currency\": \"E \\\" UR\", \"lines\": [ ]}";
        let schema = r#"{"type": "object"}"#;
        let mut out = Vec::new();
        let json: Json = serde_json::from_str(payload).unwrap();
        JsonSchema::parse(schema).unwrap().encode(&json, payload, &mut out).unwrap();
        let expected = r#"{"amount":123456789.123456789012,"currency":"E \" UR","lines":[]}"#;
        assert_eq!(String::from_utf8(out).unwrap(), expected);
    }

    #[test]
    fn an_invalid_payload_names_the_instance_path() {
        let error = encoded(json!({"amount": "x", "currency": "EUR"})).unwrap_err();
        assert!(error.starts_with("field \"amount\": \"x\" is not of type \"integer\""), "{error}");
        let error = encoded(json!({"amount": 1, "currency": "EUR", "lines": [{"sku": 7}]})).unwrap_err();
        assert!(error.starts_with("field \"lines[0].sku\":"), "{error}");
        assert_eq!(dotted("/a~1b/0/c~0d"), "a/b[0].c~d");
        let error = encoded(json!({"amount": 1})).unwrap_err();
        assert!(error.starts_with("payload: \"currency\" is a required property"), "{error}");
    }

    #[test]
    fn draft_7_unless_the_schema_names_another() {
        // `dependentRequired` is a 2019-09 keyword: draft 7 ignores it
        let schema = r#"{"type": "object", "dependentRequired": {"a": ["b"]}}"#;
        let mut out = Vec::new();
        JsonSchema::parse(schema).unwrap().encode(&json!({"a": 1}), "{\"a\": 1}", &mut out).unwrap();
        let named =
            format!(r#"{{"$schema": "https://json-schema.org/draft/2020-12/schema", {}"#, &schema[1..]);
        let error =
            JsonSchema::parse(&named).unwrap().encode(&json!({"a": 1}), "{\"a\": 1}", &mut out).unwrap_err();
        assert!(error.contains("\"b\""), "{error}");
    }

    #[test]
    fn a_broken_schema_is_refused() {
        assert!(JsonSchema::parse("{").unwrap_err().starts_with("not a valid JSON Schema: not JSON"));
        let error = JsonSchema::parse(r#"{"type": "banana"}"#).unwrap_err();
        assert!(error.starts_with("not a valid JSON Schema:"), "{error}");
    }
}
