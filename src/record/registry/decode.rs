//! The other end: a consumer reading values of the wire format back to JSON (the ledger does).
//! Avro is decoded with the writer's schema, fetched by the record's schema id once and cached;
//! JSON Schema values are their JSON text after the header. Protobuf is left out (a consumer
//! decodes it with its own message class).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use super::client::Client;
use super::{EncodeError, MAGIC_BYTE, RegistryConfig};

/// Decodes record values of the Confluent wire format; shared by every caller (`&self`).
pub struct Decoder {
    client: Client,
    /// Writer schemas by id: Avro parsed, `None` for JSON Schema.
    schemas: Mutex<HashMap<u32, Arc<Option<apache_avro::Schema>>>>,
}

impl Decoder {
    /// The client of the registry `config` names (only its url, credentials and CA are used).
    pub fn new(config: &RegistryConfig) -> Result<Decoder, String> {
        Ok(Decoder { client: Client::new(config)?, schemas: Mutex::new(HashMap::new()) })
    }

    /// Whether `value` is framed in the wire format: magic byte 0 and a 4-byte schema id.
    pub fn is_framed(value: &[u8]) -> bool {
        value.len() >= 5 && value[0] == MAGIC_BYTE
    }

    /// `value` as JSON. `Mismatch` for bytes that do not decode with the writer's schema, or
    /// whose schema id the registry does not hold or this consumer cannot read (Protobuf, a
    /// schema that does not parse): the consumer dead-letters the record. `Unavailable` when the
    /// registry cannot be asked; `Refused` when it refuses the credentials.
    pub async fn decode(&self, value: &[u8]) -> Result<serde_json::Value, EncodeError> {
        let mismatch = |id: u32, detail: String| EncodeError::Mismatch {
            subject: "(read back)".into(),
            schema_id: id,
            detail,
        };
        if !Self::is_framed(value) {
            return Err(mismatch(0, "the value is not in the wire format (no magic byte 0)".into()));
        }
        let id = u32::from_be_bytes([value[1], value[2], value[3], value[4]]);
        let schema = self.schema(id).await?;
        let mut body = &value[5..];
        match schema.as_ref() {
            None => serde_json::from_slice(body).map_err(|e| mismatch(id, format!("not JSON: {e}"))),
            Some(avro) => {
                let reader = apache_avro::reader::datum::GenericDatumReader::builder(avro)
                    .build()
                    .map_err(|e| mismatch(id, format!("the schema cannot read: {e}")))?;
                let datum = reader
                    .read_value(&mut body)
                    .map_err(|e| mismatch(id, format!("not Avro of the schema: {e}")))?;
                serde_json::Value::try_from(datum).map_err(|e| mismatch(id, e.to_string()))
            }
        }
    }

    async fn schema(&self, id: u32) -> Result<Arc<Option<apache_avro::Schema>>, EncodeError> {
        if let Some(schema) = self.schemas.lock().unwrap_or_else(PoisonError::into_inner).get(&id) {
            return Ok(schema.clone());
        }
        let version = self.client.by_id(id).await?;
        // (a schema this consumer cannot read is this record's problem, as an unknown id is: it
        // is a mismatch, dead-lettered, never retried: issue 46's ledger residual)
        let refused =
            |detail: String| EncodeError::Mismatch { subject: "(read back)".into(), schema_id: id, detail };
        let schema = match version.schema_type.as_deref().unwrap_or("AVRO") {
            "AVRO" => Some(
                apache_avro::Schema::parse_str(&version.schema)
                    .map_err(|e| refused(format!("schema id {id} is not an Avro schema that parses: {e}")))?,
            ),
            "JSON" => None,
            other => {
                return Err(refused(format!(
                    "schema id {id} is {other}: this consumer reads Avro and JSON Schema"
                )));
            }
        };
        let schema = Arc::new(schema);
        self.schemas.lock().unwrap_or_else(PoisonError::into_inner).insert(id, schema.clone());
        Ok(schema)
    }
}
