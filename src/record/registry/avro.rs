//! A JSON payload as Avro binary, guided by the schema.
//!
//! The JSON value is converted to an Avro value field by field, so an error names the field path
//! (`field "items[2].sku": expected string, got number 7`), then written with apache-avro.
//!
//! What is accepted:
//! - records: an object; a missing field takes its default, or is an error when it has none; a
//!   key the record does not have is an error (the encoding would drop it silently);
//! - int/long: integers (or integral numbers such as `3.0`) in range; float/double: numbers;
//!   string: strings; bytes and fixed: a string's UTF-8 bytes (not Avro-JSON's code points
//!   0-255); enum: a symbol; arrays, maps (objects);
//! - unions: the Avro-JSON form `{"long": 5}` (a one-key object naming a branch), or a plain
//!   value, which takes the first branch it fits (`null` takes the null branch);
//! - logical types date, time-millis/micros, timestamp-millis/micros/nanos and
//!   local-timestamp-*: their numbers (no date strings); uuid: its string.
//!
//! Left out (the schema is refused when it is parsed): decimal, big-decimal and duration.

use std::fmt;

use apache_avro::schema::{
    EnumSchema, FixedSchema, Name, Names, RecordSchema, ResolvedSchema, Schema, UnionSchema,
};
use apache_avro::types::Value;
use apache_avro::writer::datum::GenericDatumWriter;
use serde_json::Value as Json;

use super::error::describe;

/// A parsed Avro schema with its named types resolved.
pub(super) struct AvroSchema {
    root: Schema,
    /// The named types it defines, by full name, for its references.
    names: Names,
}

impl fmt::Debug for AvroSchema {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("AvroSchema").field(&self.full_name()).finish()
    }
}

impl AvroSchema {
    /// Parses an `.avsc` document; refuses what the encoder leaves out.
    pub(super) fn parse(text: &str) -> Result<AvroSchema, String> {
        let schema = Schema::parse_str(text).map_err(|e| format!("not a valid Avro schema: {e}"))?;
        if let Some(problem) = unsupported(&schema, &Path::Root) {
            return Err(problem);
        }
        let resolved =
            ResolvedSchema::try_from(&schema).map_err(|e| format!("not a valid Avro schema: {e}"))?;
        let names =
            resolved.get_names().iter().map(|(name, named)| (name.clone(), (*named).clone())).collect();
        Ok(AvroSchema { root: schema, names })
    }

    /// `namespace.name` of a named top-level schema (a record, enum or fixed).
    pub(super) fn full_name(&self) -> Option<String> {
        self.root.name().map(|name| name.fullname(None))
    }

    /// Appends the Avro binary of `json` to `out`; the error names the field.
    pub(super) fn encode(&self, json: &Json, out: &mut Vec<u8>) -> Result<(), String> {
        let value = Converter { names: &self.names }.convert(&self.root, json, &Path::Root)?;
        let writer =
            GenericDatumWriter::builder(&self.root).build().map_err(|e| format!("avro writer: {e}"))?;
        writer.write_value(out, value).map_err(|e| format!("avro encoding: {e}"))?;
        Ok(())
    }
}

/// Where in the payload a value is, built on the stack and rendered only for an error.
#[derive(Clone, Copy)]
enum Path<'a> {
    Root,
    Field(&'a Path<'a>, &'a str),
    Index(&'a Path<'a>, usize),
    Key(&'a Path<'a>, &'a str),
}

impl fmt::Display for Path<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Path::Root => Ok(()),
            Path::Field(Path::Root, name) => f.write_str(name),
            Path::Field(parent, name) => write!(f, "{parent}.{name}"),
            Path::Index(parent, index) => write!(f, "{parent}[{index}]"),
            Path::Key(parent, key) => write!(f, "{parent}[{key}]"),
        }
    }
}

impl Path<'_> {
    /// `field "a.b"`, or `payload` for the whole of it.
    fn at(&self) -> String {
        match self {
            Path::Root => "payload".to_string(),
            path => format!("field \"{path}\""),
        }
    }
}

fn expected(path: &Path, what: &str, json: &Json) -> String {
    format!("{}: expected {what}, got {}", path.at(), describe(json))
}

/// The first part of the schema the encoder does not support, as an error naming its field.
fn unsupported(schema: &Schema, path: &Path) -> Option<String> {
    let kind = match schema {
        Schema::Decimal(_) => "decimal",
        Schema::BigDecimal => "big-decimal",
        Schema::Duration(_) => "duration",
        Schema::Array(array) => return unsupported(&array.items, &Path::Index(path, 0)),
        Schema::Map(map) => return unsupported(&map.types, &Path::Key(path, "*")),
        Schema::Union(union) => return union.variants().iter().find_map(|v| unsupported(v, path)),
        Schema::Record(record) => {
            return record.fields.iter().find_map(|f| unsupported(&f.schema, &Path::Field(path, &f.name)));
        }
        _ => return None,
    };
    Some(format!(
        "{}: the logical type {kind} is not supported by the relay's Avro encoder; use a string, \
         long or bytes field instead",
        path.at()
    ))
}

/// JSON to Avro values, with the schema's named types for its references.
struct Converter<'s> {
    names: &'s Names,
}

impl Converter<'_> {
    fn convert(&self, schema: &Schema, json: &Json, path: &Path) -> Result<Value, String> {
        Ok(match schema {
            Schema::Null if json.is_null() => Value::Null,
            Schema::Null => return Err(expected(path, "null", json)),
            Schema::Boolean => Value::Boolean(json.as_bool().ok_or_else(|| expected(path, "boolean", json))?),
            Schema::Int => Value::Int(int(json, path, "int")?),
            Schema::Long => Value::Long(integer(json, path, "long", i64::MIN, i64::MAX)?),
            Schema::Float => Value::Float(float(json, path)?),
            Schema::Double => Value::Double(json.as_f64().ok_or_else(|| expected(path, "double", json))?),
            Schema::Bytes => Value::Bytes(text(json, path, "bytes (a string)")?.as_bytes().to_vec()),
            Schema::String => Value::String(text(json, path, "string")?.to_string()),
            Schema::Array(array) => self.array(&array.items, json, path)?,
            Schema::Map(map) => self.map(&map.types, json, path)?,
            Schema::Union(union) => self.union(union, json, path)?,
            Schema::Record(record) => self.record(record, json, path)?,
            Schema::Enum(schema) => symbol(schema, json, path)?,
            Schema::Fixed(schema) => fixed(schema, json, path)?,
            Schema::Ref { name } => return self.named(name, json, path),
            _ => return logical(schema, json, path),
        })
    }

    fn named(&self, name: &Name, json: &Json, path: &Path) -> Result<Value, String> {
        match self.names.get(name) {
            Some(schema) => self.convert(schema, json, path),
            None => Err(format!("{}: the schema refers to {name:?}, which it does not define", path.at())),
        }
    }

    fn array(&self, items: &Schema, json: &Json, path: &Path) -> Result<Value, String> {
        let Json::Array(elements) = json else { return Err(expected(path, "array", json)) };
        let converted =
            elements.iter().enumerate().map(|(i, e)| self.convert(items, e, &Path::Index(path, i)));
        Ok(Value::Array(converted.collect::<Result<_, _>>()?))
    }

    fn map(&self, values: &Schema, json: &Json, path: &Path) -> Result<Value, String> {
        let Json::Object(object) = json else { return Err(expected(path, "map (an object)", json)) };
        let converted =
            object.iter().map(|(k, v)| Ok((k.clone(), self.convert(values, v, &Path::Key(path, k))?)));
        Ok(Value::Map(converted.collect::<Result<_, String>>()?))
    }

    fn record(&self, record: &RecordSchema, json: &Json, path: &Path) -> Result<Value, String> {
        let name = record.name.fullname(None);
        let Json::Object(object) = json else { return Err(expected(path, &format!("record {name}"), json)) };
        if let Some(unknown) = object.keys().find(|key| !record.lookup.contains_key(*key)) {
            return Err(format!("{}: is not a field of record {name}", Path::Field(path, unknown).at()));
        }
        let mut fields = Vec::with_capacity(record.fields.len());
        for field in &record.fields {
            let field_path = Path::Field(path, &field.name);
            let given = object.get(&field.name).or_else(|| field.aliases.iter().find_map(|a| object.get(a)));
            let value = match (given, &field.default) {
                (Some(json), _) => self.convert(&field.schema, json, &field_path)?,
                (None, Some(default)) => self
                    .convert(&field.schema, default, &field_path)
                    .map_err(|e| format!("the schema's default does not fit it: {e}"))?,
                (None, None) => return Err(format!("missing required field \"{field_path}\"")),
            };
            fields.push((field.name.clone(), value));
        }
        Ok(Value::Record(fields))
    }

    /// The Avro-JSON form (`{"branch": value}`) first, then the first branch the value fits.
    fn union(&self, union: &UnionSchema, json: &Json, path: &Path) -> Result<Value, String> {
        let variants = union.variants();
        let wrapped = wrapped_branch(variants, json)
            .map(|(index, inner)| (index, self.convert(&variants[index], inner, path)));
        if let Some((index, Ok(value))) = wrapped {
            return Ok(Value::Union(index as u32, Box::new(value)));
        }
        let mut errors = Vec::with_capacity(variants.len());
        for (index, variant) in variants.iter().enumerate() {
            match self.convert(variant, json, path) {
                Ok(value) => return Ok(Value::Union(index as u32, Box::new(value))),
                Err(error) => errors.push(error),
            }
        }
        if let Some((_, Err(error))) = wrapped {
            return Err(error);
        }
        // with one branch besides null, that branch's error is the precise one
        let mut non_null = variants.iter().enumerate().filter(|(_, v)| !matches!(v, Schema::Null));
        if let (Some((index, _)), None) = (non_null.next(), non_null.next()) {
            return Err(errors.swap_remove(index));
        }
        let names: Vec<String> = variants.iter().map(type_name).collect();
        Err(expected(path, &format!("one of [{}]", names.join(", ")), json))
    }
}

/// The branch a one-key object `{"<type name>": value}` names, with the value.
fn wrapped_branch<'j>(variants: &[Schema], json: &'j Json) -> Option<(usize, &'j Json)> {
    let Json::Object(object) = json else { return None };
    if object.len() != 1 {
        return None;
    }
    let (key, inner) = object.iter().next()?;
    let short = |s: &Schema| s.name().is_some_and(|name| name.name() == key);
    let index = variants.iter().position(|v| type_name(v) == *key || short(v))?;
    Some((index, inner))
}

/// The name Avro-JSON gives a union branch: the full name of a named type, else the type.
fn type_name(schema: &Schema) -> String {
    if let Some(name) = schema.name() {
        return name.fullname(None);
    }
    let name = match schema {
        Schema::Null => "null",
        Schema::Boolean => "boolean",
        Schema::Int | Schema::Date | Schema::TimeMillis => "int",
        Schema::Float => "float",
        Schema::Double => "double",
        Schema::Bytes | Schema::Decimal(_) | Schema::BigDecimal => "bytes",
        Schema::String | Schema::Uuid(_) => "string",
        Schema::Array(_) => "array",
        Schema::Map(_) => "map",
        Schema::Union(_) => "union",
        _ => "long",
    };
    name.to_string()
}

fn text<'j>(json: &'j Json, path: &Path, what: &str) -> Result<&'j str, String> {
    json.as_str().ok_or_else(|| expected(path, what, json))
}

fn int(json: &Json, path: &Path, what: &str) -> Result<i32, String> {
    integer(json, path, what, i32::MIN.into(), i32::MAX.into()).map(|i| i as i32)
}

/// An integer in `min..=max`; an integral float (`3.0`, as jsonb may print it) counts.
fn integer(json: &Json, path: &Path, what: &str, min: i64, max: i64) -> Result<i64, String> {
    let Json::Number(number) = json else { return Err(expected(path, what, json)) };
    let out_of_range = || format!("{}: expected {what}, got number {number} (out of range)", path.at());
    if let Some(i) = number.as_i64() {
        return if (min..=max).contains(&i) { Ok(i) } else { Err(out_of_range()) };
    }
    if number.is_u64() {
        return Err(out_of_range());
    }
    let f = number.as_f64().unwrap_or(f64::NAN);
    if !f.is_finite() || f.fract() != 0.0 {
        return Err(expected(path, what, json));
    }
    // `max as f64 + 1.0` is exact for i32 and 2^63 for i64: the first integer past the range
    if f < min as f64 || f >= max as f64 + 1.0 {
        return Err(out_of_range());
    }
    Ok(f as i64)
}

fn float(json: &Json, path: &Path) -> Result<f32, String> {
    let value = json.as_f64().ok_or_else(|| expected(path, "float", json))?;
    let narrowed = value as f32;
    if narrowed.is_finite() {
        Ok(narrowed)
    } else {
        Err(format!("{}: expected float, got {} (out of the float range)", path.at(), describe(json)))
    }
}

fn symbol(schema: &EnumSchema, json: &Json, path: &Path) -> Result<Value, String> {
    let name = schema.name.fullname(None);
    let given = text(json, path, &format!("a symbol of enum {name}"))?;
    match schema.symbols.iter().position(|s| s == given) {
        Some(index) => Ok(Value::Enum(index as u32, given.to_string())),
        None => {
            let listed: Vec<&str> = schema.symbols.iter().take(10).map(String::as_str).collect();
            let more = if schema.symbols.len() > listed.len() { ", ..." } else { "" };
            Err(format!(
                "{}: expected a symbol of enum {name} ({}{more}), got {}",
                path.at(),
                listed.join(", "),
                describe(json)
            ))
        }
    }
}

fn fixed(schema: &FixedSchema, json: &Json, path: &Path) -> Result<Value, String> {
    let what = format!("fixed {} ({} bytes as a string)", schema.name.fullname(None), schema.size);
    let bytes = text(json, path, &what)?.as_bytes();
    if bytes.len() != schema.size {
        return Err(format!("{}: expected {what}, got {} bytes", path.at(), bytes.len()));
    }
    Ok(Value::Fixed(schema.size, bytes.to_vec()))
}

/// The logical types: numbers (uuid: a string).
fn logical(schema: &Schema, json: &Json, path: &Path) -> Result<Value, String> {
    let long = |what: &str| integer(json, path, what, i64::MIN, i64::MAX);
    Ok(match schema {
        Schema::Date => Value::Date(int(json, path, "date (days since 1970-01-01, an int)")?),
        Schema::TimeMillis => Value::TimeMillis(int(json, path, "time-millis (an int)")?),
        Schema::TimeMicros => Value::TimeMicros(long("time-micros (a long)")?),
        Schema::TimestampMillis => Value::TimestampMillis(long("timestamp-millis (a long)")?),
        Schema::TimestampMicros => Value::TimestampMicros(long("timestamp-micros (a long)")?),
        Schema::TimestampNanos => Value::TimestampNanos(long("timestamp-nanos (a long)")?),
        Schema::LocalTimestampMillis => Value::LocalTimestampMillis(long("local-timestamp-millis (a long)")?),
        Schema::LocalTimestampMicros => Value::LocalTimestampMicros(long("local-timestamp-micros (a long)")?),
        Schema::LocalTimestampNanos => Value::LocalTimestampNanos(long("local-timestamp-nanos (a long)")?),
        Schema::Uuid(_) => {
            let given = text(json, path, "uuid (a string)")?;
            let uuid = apache_avro::Uuid::parse_str(given).map_err(|_| expected(path, "uuid", json))?;
            Value::Uuid(uuid)
        }
        other => return Err(format!("{}: the schema type {other:?} is not supported", path.at())),
    })
}

#[cfg(test)]
#[path = "avro_tests.rs"]
mod tests;
