//! JSON text as Kafka Connect's `JsonConverter` (Jackson) writes it, for Debezium's records.

/// A JSON string literal as Jackson writes one: `"` and `\` escaped, control characters as `\n`,
/// `\t`, ... or `\u00XX` (upper-case hex), characters outside the BMP as escaped surrogate
/// pairs (`\uD83D\uDE00`); everything else, non-ASCII too, as it is.
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
            c if (c as u32) > 0xFFFF => {
                // outside the BMP: as the UTF-16 surrogate pair, escaped (Jackson's way)
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{unit:04X}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// A JSON document as the outbox router's `expand.json.payload` and `JsonConverter` (schemas
/// off) write it, checked against Debezium 3.6's records (`tests/fixtures/debezium`): the router
/// infers a Connect schema from the document and the converter writes the value through it, so
/// - it is compact, members in the document's order, integers as written, decimals as Java
///   doubles (`1.50` is `1.5`, `1e-6` is `1.0E-6`);
/// - a member that is null or an empty array has no schema and is left out;
/// - the objects of one array share one schema: each has every member any of them has (later
///   elements' members first), null where it has none;
/// - a document that is not an object, or holds an array of mixed types (integers with decimals
///   too), or an integer beyond 64 bits, is not expanded: `None` (the router keeps the payload a
///   string; for the last two Debezium's task fails instead, and the relay sends the string).
pub fn expanded(text: &str) -> Option<String> {
    if has_huge_integer(text) {
        return None;
    }
    // (serde_json's own maps would sort the members)
    let document: Node = serde_json::from_str(text).ok()?;
    let Node::Object(_) = &document else { return None };
    let schema = infer(&document).ok()??;
    let mut out = String::with_capacity(text.len());
    write(&document, &schema, &mut out);
    Some(out)
}

/// Whether the JSON text holds an integer literal beyond 64 bits (serde_json would read it as a
/// double; jsonb prints `1.5e300` as such an integer).
fn has_huge_integer(text: &str) -> bool {
    let (mut in_string, mut escaped) = (false, false);
    let mut token = String::new();
    let huge =
        |token: &str| !token.is_empty() && !token.contains(['.', 'e', 'E']) && token.parse::<i64>().is_err();
    for c in text.chars() {
        if in_string {
            (escaped, in_string) = match (escaped, c) {
                (true, _) => (false, true),
                (false, '\\') => (true, true),
                (false, '"') => (false, false),
                _ => (false, true),
            };
        } else if c == '"' {
            in_string = true;
        } else if c.is_ascii_digit() || matches!(c, '-' | '+' | '.' | 'e' | 'E') {
            token.push(c);
            continue;
        }
        if huge(&token) {
            return true;
        }
        token.clear();
    }
    huge(&token)
}

/// A JSON value that keeps its members in document order.
enum Node {
    Null,
    Bool(bool),
    Integer(String),
    Decimal(f64),
    /// An integer beyond 64 bits: nothing a Connect schema holds.
    Huge,
    String(String),
    Array(Vec<Node>),
    Object(Vec<(String, Node)>),
}

/// The Connect schema the router infers.
#[derive(Clone, PartialEq)]
enum Schema {
    Bool,
    Integer,
    Decimal,
    String,
    Array(Box<Schema>),
    Struct(Vec<(String, Schema)>),
}

/// `Ok(None)`: no schema (null, an empty array); `Err`: none can be inferred.
fn infer(node: &Node) -> Result<Option<Schema>, ()> {
    Ok(Some(match node {
        Node::Null => return Ok(None),
        Node::Huge => return Err(()),
        Node::Bool(_) => Schema::Bool,
        Node::Integer(_) => Schema::Integer,
        Node::Decimal(_) => Schema::Decimal,
        Node::String(_) => Schema::String,
        Node::Object(members) => {
            let mut fields = Vec::with_capacity(members.len());
            for (name, value) in members {
                if let Some(schema) = infer(value)? {
                    fields.push((name.clone(), schema));
                }
            }
            Schema::Struct(fields)
        }
        Node::Array(items) => {
            let mut element: Option<Schema> = None;
            for item in items {
                let Some(schema) = infer(item)? else { continue };
                element = Some(match element {
                    None => schema,
                    Some(seen) => merge(seen, schema)?,
                });
            }
            match element {
                Some(element) => Schema::Array(Box::new(element)),
                None => return Ok(None),
            }
        }
    }))
}

/// One schema for two elements of an array: equal, or structs (the later one's fields first).
fn merge(earlier: Schema, later: Schema) -> Result<Schema, ()> {
    match (earlier, later) {
        (Schema::Struct(earlier), Schema::Struct(mut fields)) => {
            for (name, schema) in earlier {
                match fields.iter().position(|(n, _)| *n == name) {
                    Some(i) => {
                        let later = std::mem::replace(&mut fields[i].1, Schema::Bool);
                        fields[i].1 = merge(schema, later)?;
                    }
                    None => fields.push((name, schema)),
                }
            }
            Ok(Schema::Struct(fields))
        }
        (earlier, later) if earlier == later => Ok(later),
        _ => Err(()),
    }
}

fn write(node: &Node, schema: &Schema, out: &mut String) {
    match (node, schema) {
        (Node::Bool(b), _) => out.push_str(if *b { "true" } else { "false" }),
        (Node::Integer(n), _) => out.push_str(n),
        (Node::Decimal(d), _) => out.push_str(&java_double(*d)),
        (Node::String(s), _) => push_java_string(out, s),
        (Node::Array(items), Schema::Array(element)) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write(item, element, out);
            }
            out.push(']');
        }
        (Node::Object(members), Schema::Struct(fields)) => {
            out.push('{');
            for (i, (name, field)) in fields.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                push_java_string(out, name);
                out.push(':');
                match members.iter().find(|(n, _)| n == name) {
                    Some((_, value)) => write(value, field, out),
                    None => out.push_str("null"),
                }
            }
            out.push('}');
        }
        _ => out.push_str("null"),
    }
}

impl<'de> serde::Deserialize<'de> for Node {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(Visitor)
    }
}

struct Visitor;

impl<'de> serde::de::Visitor<'de> for Visitor {
    type Value = Node;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("JSON")
    }
    fn visit_unit<E>(self) -> Result<Node, E> {
        Ok(Node::Null)
    }
    fn visit_bool<E>(self, v: bool) -> Result<Node, E> {
        Ok(Node::Bool(v))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Node, E> {
        Ok(Node::Integer(v.to_string()))
    }
    fn visit_u64<E>(self, v: u64) -> Result<Node, E> {
        Ok(if i64::try_from(v).is_ok() { Node::Integer(v.to_string()) } else { Node::Huge })
    }
    fn visit_f64<E>(self, v: f64) -> Result<Node, E> {
        Ok(Node::Decimal(v))
    }
    fn visit_str<E>(self, v: &str) -> Result<Node, E> {
        Ok(Node::String(v.to_string()))
    }
    fn visit_string<E>(self, v: String) -> Result<Node, E> {
        Ok(Node::String(v))
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Node, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element()? {
            items.push(item);
        }
        Ok(Node::Array(items))
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Node, A::Error> {
        let mut members: Vec<(String, Node)> = Vec::new();
        while let Some((name, value)) = map.next_entry::<String, Node>()? {
            // (the last of a duplicate name wins, as in jsonb)
            members.retain(|(n, _)| *n != name);
            members.push((name, value));
        }
        Ok(Node::Object(members))
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
