//! JSON text as Kafka Connect's `JsonConverter` (Jackson) writes it, for Debezium's records.

/// A JSON string literal as Jackson writes one: `"` and `\` escaped, control characters as `\n`,
/// `\t`, ... or `\u00XX` (upper-case hex); everything else, non-ASCII too, as it is.
pub fn java_string(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 2);
    push_java_string(&mut out, text);
    out
}

fn push_java_string(out: &mut String, text: &str) {
    out.push('"');
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04X}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
}

/// A JSON document as the outbox router's `expand.json.payload` and `JsonConverter` (schemas
/// off) write it: compact, members in the document's order, decimals as Java doubles. `None`
/// when the text is not JSON (the router then keeps the payload a string).
pub fn expanded(text: &str) -> Option<String> {
    // (serde_json's own maps would sort the members)
    let ordered: OrderedValue = serde_json::from_str(text).ok()?;
    let mut out = String::with_capacity(text.len());
    ordered.write(&mut out);
    Some(out)
}

/// A JSON value that keeps its members in document order and its numbers as written.
enum OrderedValue {
    Null,
    Bool(bool),
    Number(String),
    String(String),
    Array(Vec<OrderedValue>),
    Object(Vec<(String, OrderedValue)>),
}

impl OrderedValue {
    fn write(&self, out: &mut String) {
        match self {
            OrderedValue::Null => out.push_str("null"),
            OrderedValue::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            OrderedValue::Number(n) => out.push_str(n),
            OrderedValue::String(s) => push_java_string(out, s),
            OrderedValue::Array(items) => {
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    item.write(out);
                }
                out.push(']');
            }
            OrderedValue::Object(members) => {
                out.push('{');
                for (i, (name, item)) in members.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    push_java_string(out, name);
                    out.push(':');
                    item.write(out);
                }
                out.push('}');
            }
        }
    }
}

impl<'de> serde::Deserialize<'de> for OrderedValue {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(Visitor)
    }
}

struct Visitor;

impl<'de> serde::de::Visitor<'de> for Visitor {
    type Value = OrderedValue;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("JSON")
    }
    fn visit_unit<E>(self) -> Result<OrderedValue, E> {
        Ok(OrderedValue::Null)
    }
    fn visit_bool<E>(self, v: bool) -> Result<OrderedValue, E> {
        Ok(OrderedValue::Bool(v))
    }
    fn visit_i64<E>(self, v: i64) -> Result<OrderedValue, E> {
        Ok(OrderedValue::Number(v.to_string()))
    }
    fn visit_u64<E>(self, v: u64) -> Result<OrderedValue, E> {
        Ok(OrderedValue::Number(v.to_string()))
    }
    fn visit_f64<E>(self, v: f64) -> Result<OrderedValue, E> {
        Ok(OrderedValue::Number(java_double(v)))
    }
    fn visit_str<E>(self, v: &str) -> Result<OrderedValue, E> {
        Ok(OrderedValue::String(v.to_string()))
    }
    fn visit_string<E>(self, v: String) -> Result<OrderedValue, E> {
        Ok(OrderedValue::String(v))
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<OrderedValue, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element()? {
            items.push(item);
        }
        Ok(OrderedValue::Array(items))
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<OrderedValue, A::Error> {
        let mut members = Vec::new();
        while let Some((name, value)) = map.next_entry::<String, OrderedValue>()? {
            members.push((name, value));
        }
        Ok(OrderedValue::Object(members))
    }
}

/// `Double.toString`: plain decimals from 10^-3 up to 10^7 (with at least one fractional
/// digit), else `d.dddE±n`; the shortest digits that read back as the same double.
pub fn java_double(v: f64) -> String {
    if !v.is_finite() {
        return if v.is_nan() {
            "NaN".into()
        } else if v > 0.0 {
            "Infinity".into()
        } else {
            "-Infinity".into()
        };
    }
    if v == 0.0 {
        return if v.is_sign_negative() { "-0.0".into() } else { "0.0".into() };
    }
    let magnitude = v.abs();
    if (1e-3..1e7).contains(&magnitude) {
        let plain = format!("{v}");
        return if plain.contains('.') { plain } else { format!("{plain}.0") };
    }
    // Rust's `{:e}` gives the shortest digits: `1.5e-5`, `1e10`
    let sci = format!("{v:e}");
    let (mantissa, exponent) = sci.split_once('e').expect("{:e} has an exponent");
    let mantissa = if mantissa.contains('.') { mantissa.to_string() } else { format!("{mantissa}.0") };
    format!("{mantissa}E{exponent}")
}
