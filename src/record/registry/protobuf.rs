//! A JSON payload as Protobuf binary of the schema's first message.
//!
//! The `.proto` text is compiled by protox (the well-known `google/protobuf/*.proto` imports are
//! built in; other imports are not resolved); the payload is read with the canonical Protobuf
//! JSON mapping (prost-reflect: `lowerCamelCase` or original field names, 64-bit integers as
//! numbers or strings, enums by name, well-known types in their JSON forms), unknown fields
//! refused.
//!
//! The Confluent wire format puts the message's index path in the file after the schema id: zigzag
//! varints, the count then the indexes; the first message (`[0]`) is the single byte 0.

use prost::Message;
use prost_reflect::{DeserializeOptions, DynamicMessage, MessageDescriptor};
use protox::file::{ChainFileResolver, File, FileResolver, GoogleFileResolver};
use serde_json::Value as Json;

/// The name the schema text is compiled under.
const FILE_NAME: &str = "schema.proto";

/// A compiled `.proto` schema and the message payloads are encoded as.
#[derive(Debug)]
pub(super) struct ProtoSchema {
    message: MessageDescriptor,
}

/// Serves the schema text as [`FILE_NAME`].
struct SchemaText(String);

impl FileResolver for SchemaText {
    fn open_file(&self, name: &str) -> Result<File, protox::Error> {
        if name == FILE_NAME {
            File::from_source(name, &self.0)
        } else {
            Err(protox::Error::file_not_found(name))
        }
    }
}

impl ProtoSchema {
    /// Compiles `.proto` text; its first message is the one encoded.
    pub(super) fn parse(text: &str) -> Result<ProtoSchema, String> {
        let mut resolver = ChainFileResolver::new();
        resolver.add(SchemaText(text.to_string()));
        resolver.add(GoogleFileResolver::new());
        let mut compiler = protox::Compiler::with_file_resolver(resolver);
        compiler.open_file(FILE_NAME).map_err(|e| format!("not a valid .proto schema: {e}"))?;
        let pool = compiler.descriptor_pool();
        let file = pool.get_file_by_name(FILE_NAME).ok_or("not a valid .proto schema: nothing compiled")?;
        let message = file.messages().next().ok_or("the .proto schema defines no message")?;
        Ok(ProtoSchema { message })
    }

    /// `package.Message` of the first message.
    pub(super) fn full_name(&self) -> String {
        self.message.full_name().to_string()
    }

    /// Appends the message-index path (the first message: `[0]`) and the Protobuf binary of
    /// `json` to `out`; the error names the field.
    pub(super) fn encode(&self, json: &Json, out: &mut Vec<u8>) -> Result<(), String> {
        let mut tracked = serde_path_to_error::Track::new();
        let deserializer = serde_path_to_error::Deserializer::new(json, &mut tracked);
        let options = DeserializeOptions::new();
        let message = DynamicMessage::deserialize_with_options(self.message.clone(), deserializer, &options)
            .map_err(|e| {
                let path = tracked.path().to_string();
                match path.as_str() {
                    "." | "" => format!("payload: {e}"),
                    _ => format!("field \"{path}\": {e}"),
                }
            })?;
        write_message_indexes(&[0], out);
        message.encode(out).map_err(|e| format!("protobuf encoding: {e}"))
    }
}

/// Confluent's message-index path: `[0]` as the single byte 0, else zigzag varints of the count
/// and of each index.
pub(super) fn write_message_indexes(indexes: &[i32], out: &mut Vec<u8>) {
    if indexes == [0] {
        out.push(0);
        return;
    }
    write_zigzag(indexes.len() as i64, out);
    for &index in indexes {
        write_zigzag(index.into(), out);
    }
}

fn write_zigzag(value: i64, out: &mut Vec<u8>) {
    let mut zigzag = ((value << 1) ^ (value >> 63)) as u64;
    while zigzag >= 0x80 {
        out.push((zigzag as u8) | 0x80);
        zigzag >>= 7;
    }
    out.push(zigzag as u8);
}

#[cfg(test)]
mod tests {
    use super::*;

    const ORDER: &str = r#"
        syntax = "proto3";
        package shop.v1;
        import "google/protobuf/timestamp.proto";
        message OrderPlaced {
          string order_id = 1;
          int64 amount_cents = 2;
          repeated Line lines = 3;
          google.protobuf.Timestamp placed_at = 4;
        }
        message Line { string sku = 1; int32 quantity = 2; }
    "#;

    fn encoded(json: Json) -> Result<Vec<u8>, String> {
        let mut out = Vec::new();
        ProtoSchema::parse(ORDER).unwrap().encode(&json, &mut out).map(|()| out)
    }

    #[test]
    fn message_indexes_are_zigzag_varints_with_a_short_form_for_the_first_message() {
        let bytes = |indexes: &[i32]| {
            let mut out = Vec::new();
            write_message_indexes(indexes, &mut out);
            out
        };
        assert_eq!(bytes(&[0]), [0]);
        assert_eq!(bytes(&[1]), [2, 2]);
        assert_eq!(bytes(&[0, 2]), [4, 0, 4]);
        assert_eq!(bytes(&[64]), [2, 0x80, 0x01]);
    }

    #[test]
    fn the_first_message_is_encoded_and_reads_back() {
        let schema = ProtoSchema::parse(ORDER).unwrap();
        assert_eq!(schema.full_name(), "shop.v1.OrderPlaced");
        let json = serde_json::json!({
            "orderId": "o-1", "amount_cents": "1250", "lines": [{"sku": "A", "quantity": 2}],
            "placedAt": "2024-05-01T10:00:00Z"
        });
        let out = encoded(json).unwrap();
        assert_eq!(out[0], 0, "the message-index path of the first message");
        // field 1 (order_id), length-delimited: tag 0x0a, length 3, "o-1"
        assert_eq!(&out[1..6], b"\x0a\x03o-1");
        let decoded = DynamicMessage::decode(schema.message.clone(), &out[1..]).unwrap();
        let back = serde_json::to_value(&decoded).unwrap();
        assert_eq!(back["amountCents"], "1250");
        assert_eq!(back["lines"][0]["quantity"], 2);
        assert_eq!(back["placedAt"], "2024-05-01T10:00:00Z");
    }

    #[test]
    fn a_mismatch_names_the_field() {
        let error = encoded(serde_json::json!({"orderId": "o-1", "amountCents": "many"})).unwrap_err();
        assert!(error.starts_with("field \"amountCents\":"), "{error}");
        let error = encoded(serde_json::json!({"lines": [{"sku": "A", "quantity": "x"}]})).unwrap_err();
        assert!(error.starts_with("field \"lines[0].quantity\":"), "{error}");
        let error = encoded(serde_json::json!({"colour": "red"})).unwrap_err();
        assert!(error.contains("colour"), "{error}");
        let error = encoded(serde_json::json!([1])).unwrap_err();
        assert!(error.starts_with("payload:"), "{error}");
    }

    #[test]
    fn a_schema_without_a_message_or_with_a_syntax_error_is_refused() {
        assert_eq!(
            ProtoSchema::parse("syntax = \"proto3\";").unwrap_err(),
            "the .proto schema defines no message"
        );
        let error = ProtoSchema::parse("message {").unwrap_err();
        assert!(error.starts_with("not a valid .proto schema:"), "{error}");
        let error = ProtoSchema::parse("import \"other.proto\"; message A {}").unwrap_err();
        assert!(error.contains("other.proto"), "{error}");
    }
}
