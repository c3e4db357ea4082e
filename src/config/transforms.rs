//! `[outbox.transforms]`: what happens to an event between its row and its record, declared per
//! outbox (no scripting): keep or drop it by event or aggregate type, route it by a payload
//! field, put columns or payload fields in headers, redact payload fields.
//!
//! Invariants:
//! - every error names the outbox and the rule (`outboxes[1].transforms.redact[0].pointer`) and
//!   says what would be valid;
//! - a configuration that could let a redacted value out another way (a header or a topic read
//!   from a redacted field) is refused, as is one a schema registry's encoding cannot hold
//!   (`drop`, or a non-string replacement, with `[outbox.registry]`);
//! - the HMAC key (`hash_key_file`) is read by the mapping, never printed: only its path is
//!   configuration.

use serde::{Deserialize, Serialize};

use super::{ConfigError, Converter, OutboxConfig, RecordFormat, kafka};

/// Header names the relay writes itself; neither a row's `headers` nor a header rule may use
/// them (nor any name starting with [`RESERVED_HEADER_PREFIX`]), in any case.
pub const RESERVED_HEADERS: [&str; 3] = ["id", "event_type", "aggregate_type"];
/// The prefix of the relay's own headers (`outbox_relay_source`, `outbox_relay_position`).
pub const RESERVED_HEADER_PREFIX: &str = "outbox_relay_";
/// The columns a header rule may read (`from = "column:<key>"`), by their `columns.*` key.
pub const HEADER_COLUMNS: [&str; 5] = ["id", "aggregate_type", "aggregate_id", "event_type", "topic"];
/// The longest name of another column a header rule may read (`column:<name>`): the relay reads
/// it as `relay_column:<name>`, which must fit PostgreSQL's 63-byte identifiers.
pub const MAX_HEADER_COLUMN_NAME: usize = 50;
/// The prefix of the alias another column is read as (see [`MAX_HEADER_COLUMN_NAME`]).
pub const HEADER_COLUMN_ALIAS: &str = "relay_column:";
/// The placeholder of `route_topic`.
pub const ROUTE_PLACEHOLDER: &str = "{value}";

/// One outbox's transforms; all empty (default): every event as its row says.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TransformsConfig {
    /// Publish only events whose event type matches one of these (exact names or globs with
    /// `*` and `?`); empty (default): every event type.
    #[serde(deserialize_with = "kafka::string_or_list", skip_serializing_if = "Vec::is_empty")]
    pub include_event_types: Vec<String>,
    /// Never publish events whose event type matches one of these (recorded as filtered).
    #[serde(deserialize_with = "kafka::string_or_list", skip_serializing_if = "Vec::is_empty")]
    pub exclude_event_types: Vec<String>,
    /// Publish only events whose aggregate type matches one of these; empty: every one.
    #[serde(deserialize_with = "kafka::string_or_list", skip_serializing_if = "Vec::is_empty")]
    pub include_aggregate_types: Vec<String>,
    /// Never publish events whose aggregate type matches one of these.
    #[serde(deserialize_with = "kafka::string_or_list", skip_serializing_if = "Vec::is_empty")]
    pub exclude_aggregate_types: Vec<String>,
    /// A JSON pointer into the payload (`/region`) whose value (a string or a number) chooses
    /// the topic through `route_topic`, instead of `topic_template` (Debezium's
    /// `route.by.field`); empty (default): no routing. Needs `allowed_topics`.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub route_by_field: String,
    /// The routed topic, `{value}` replaced by the field's value; empty (default): `{value}`.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub route_topic: String,
    /// Headers added after the row's own, from a column or a payload field.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub headers: Vec<HeaderRule>,
    /// Payload fields replaced, dropped or hashed before the record leaves, in order.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub redact: Vec<RedactRule>,
    /// The HMAC-SHA256 key of `action = "hash"` (at least 32 bytes; trailing whitespace is not
    /// part of it). Never printed.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub hash_key_file: String,
}

/// A header from a column or a payload field (Debezium's
/// `table.fields.additional.placement = column:header:alias`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HeaderRule {
    /// `column:<key or column name>` (`column:aggregate_id`) or `payload:<JSON pointer>`
    /// (`payload:/customer/tenant`).
    pub from: String,
    /// The header's name (the alias).
    pub name: String,
    /// `header` (default), or `envelope`: a member of a Debezium record's value,
    /// `{"payload": ..., "<name>": <value>}` (the router's `:envelope`; needs `format =
    /// "debezium"` with `debezium.value_converter = "json"`).
    #[serde(default)]
    pub placement: Placement,
}

/// Where a header rule puts its value.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Placement {
    #[default]
    Header,
    Envelope,
}

/// A payload field to redact.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RedactRule {
    /// A JSON pointer into the payload (`/card/number`, `/items/0/iban`).
    pub pointer: String,
    /// `replace` (with `with`), `drop` (the member is removed) or `hash` (the value becomes
    /// the lowercase hex HMAC-SHA256 of its text under `hash_key_file`).
    pub action: RedactAction,
    /// The replacement of `action = "replace"`, any JSON value; unset: `"[redacted]"`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub with: Option<serde_json::Value>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RedactAction {
    Replace,
    Drop,
    Hash,
}

/// Where a header rule reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HeaderSource {
    /// A column, by its `columns.*` key ([`HEADER_COLUMNS`]).
    Column(&'static str),
    /// Another column of the table, by its name: the relay reads it for this rule alone.
    Other(String),
    /// A payload field, by its JSON pointer.
    Payload(String),
}

impl TransformsConfig {
    pub fn is_empty(&self) -> bool {
        *self == TransformsConfig::default()
    }

    /// The other columns of the table its header rules read (`column:<name>` of no
    /// `columns.*`), each once, in the rules' order.
    pub fn other_columns(&self, columns: &super::ColumnsConfig) -> Vec<String> {
        let mut names: Vec<String> = Vec::new();
        for rule in &self.headers {
            if let Some(HeaderSource::Other(name)) = rule.source(columns)
                && !names.contains(&name)
            {
                names.push(name);
            }
        }
        names
    }

    /// Whether the payload must be read as JSON (a route, a header from it, a redaction).
    pub fn reads_payload(&self) -> bool {
        !self.route_by_field.is_empty()
            || !self.redact.is_empty()
            || self.headers.iter().any(|h| h.from.starts_with("payload:"))
    }
}

impl HeaderRule {
    /// Where it reads: the column named by its key or by the outbox's name for it, another
    /// column by its name, or a payload field; `None` when `from` is neither `column:<name>` nor
    /// `payload:<pointer>`.
    pub fn source(&self, columns: &super::ColumnsConfig) -> Option<HeaderSource> {
        if let Some(pointer) = self.from.strip_prefix("payload:") {
            return Some(HeaderSource::Payload(pointer.to_string()));
        }
        let column = self.from.strip_prefix("column:")?;
        let by_name = [
            ("id", &columns.id),
            ("aggregate_type", &columns.aggregate_type),
            ("aggregate_id", &columns.aggregate_id),
            ("event_type", &columns.event_type),
            ("topic", &columns.topic),
        ];
        HEADER_COLUMNS
            .iter()
            .find(|key| **key == column)
            .copied()
            .or_else(|| by_name.iter().find(|(_, name)| !name.is_empty() && *name == column).map(|(k, _)| *k))
            .map(HeaderSource::Column)
            .or_else(|| (!column.is_empty()).then(|| HeaderSource::Other(column.to_string())))
    }
}

/// The tokens of a JSON pointer (RFC 6901: `~1` is `/`, `~0` is `~`); `None` when it is neither
/// empty nor starts with `/`.
pub fn pointer_tokens(pointer: &str) -> Option<Vec<String>> {
    if pointer.is_empty() {
        return Some(Vec::new());
    }
    let rest = pointer.strip_prefix('/')?;
    Some(rest.split('/').map(|t| t.replace("~1", "/").replace("~0", "~")).collect())
}

/// One of the relay's header names ([`RESERVED_HEADERS`], `outbox_relay_*`), in any case.
pub fn is_reserved_header(name: &str) -> bool {
    let prefix = RESERVED_HEADER_PREFIX.len();
    RESERVED_HEADERS.iter().any(|reserved| reserved.eq_ignore_ascii_case(name))
        || name.get(..prefix).is_some_and(|start| start.eq_ignore_ascii_case(RESERVED_HEADER_PREFIX))
}

/// `[outbox.transforms]` of the outbox at `path`.
pub(super) fn validate(path: &str, o: &OutboxConfig) -> Result<(), ConfigError> {
    let t = &o.transforms;
    let section = format!("{path}.transforms");
    for (key, globs) in [
        ("include_event_types", &t.include_event_types),
        ("exclude_event_types", &t.exclude_event_types),
        ("include_aggregate_types", &t.include_aggregate_types),
        ("exclude_aggregate_types", &t.exclude_aggregate_types),
    ] {
        if let Some(i) = globs.iter().position(|g| g.trim().is_empty()) {
            return Err(ConfigError::invalid(
                format!("{section}.{key}[{i}]"),
                "is empty: give a type name or a glob (`order.*`, `*.internal`)",
            ));
        }
    }
    validate_route(&section, o)?;
    validate_headers(&section, o)?;
    validate_redact(&section, o)
}

fn validate_route(section: &str, o: &OutboxConfig) -> Result<(), ConfigError> {
    let t = &o.transforms;
    if t.route_by_field.is_empty() {
        if !t.route_topic.is_empty() {
            return Err(ConfigError::invalid(
                format!("{section}.route_topic"),
                format!("is set without {section}.route_by_field: set the field to route by, or remove it"),
            ));
        }
        return Ok(());
    }
    let rule = format!("{section}.route_by_field");
    match pointer_tokens(&t.route_by_field) {
        Some(tokens) if !tokens.is_empty() => {}
        _ => {
            return Err(ConfigError::invalid(
                &rule,
                format!(
                    "\"{}\" is not a JSON pointer to a payload field (e.g. \"/region\")",
                    t.route_by_field
                ),
            ));
        }
    }
    let topic = if t.route_topic.is_empty() { ROUTE_PLACEHOLDER } else { &t.route_topic };
    let fixed = topic.replace(ROUTE_PLACEHOLDER, "");
    if !topic.contains(ROUTE_PLACEHOLDER)
        || fixed.contains(['{', '}'])
        || !fixed.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
    {
        return Err(ConfigError::invalid(
            format!("{section}.route_topic"),
            format!(
                "\"{topic}\" must hold {ROUTE_PLACEHOLDER} once, and otherwise only a-z, A-Z, 0-9, '.', '_' and '-' \
                 (e.g. \"orders.{{value}}\")"
            ),
        ));
    }
    if o.allowed_topics.is_empty() {
        return Err(ConfigError::invalid(
            &rule,
            format!(
                "needs the outbox's allowed_topics: a payload field chooses the topic, so list the topics it may \
                 choose (e.g. [\"{}*\"])",
                topic.split('{').next().unwrap_or_default()
            ),
        ));
    }
    Ok(())
}

fn validate_headers(section: &str, o: &OutboxConfig) -> Result<(), ConfigError> {
    let t = &o.transforms;
    for (i, rule) in t.headers.iter().enumerate() {
        let at = format!("{section}.headers[{i}]");
        let Some(source) = rule.source(&o.columns) else {
            return Err(ConfigError::invalid(
                format!("{at}.from"),
                format!(
                    "\"{}\" is neither column:<{}, or a column of the table> nor payload:<JSON pointer>",
                    rule.from,
                    HEADER_COLUMNS.join("|")
                ),
            ));
        };
        match &source {
            HeaderSource::Other(name) => {
                let c = &o.columns;
                if [&c.payload, &c.headers, &c.created_at].iter().any(|own| !own.is_empty() && *own == name) {
                    return Err(ConfigError::invalid(
                        format!("{at}.from"),
                        format!(
                            "\"{name}\" is the payload, headers or created_at column, which a header cannot carry: \
                             use payload:<JSON pointer> for a payload field"
                        ),
                    ));
                }
                if name.len() > MAX_HEADER_COLUMN_NAME || name.contains('\0') {
                    return Err(ConfigError::invalid(
                        format!("{at}.from"),
                        format!("column names of up to {MAX_HEADER_COLUMN_NAME} bytes only (\"{name}\")"),
                    ));
                }
            }
            HeaderSource::Column("topic") if o.columns.topic.is_empty() => {
                return Err(ConfigError::invalid(
                    format!("{at}.from"),
                    "reads the topic column, which columns.topic = \"\" switches off",
                ));
            }
            HeaderSource::Payload(pointer) if pointer_tokens(pointer).is_none_or(|t| t.is_empty()) => {
                return Err(ConfigError::invalid(
                    format!("{at}.from"),
                    format!("\"{pointer}\" is not a JSON pointer to a payload field (e.g. payload:/tenant)"),
                ));
            }
            _ => {}
        }
        if rule.placement == Placement::Envelope {
            if o.format != RecordFormat::Debezium || o.debezium.value_converter != Converter::Json {
                return Err(ConfigError::invalid(
                    format!("{at}.placement"),
                    "\"envelope\" puts the value in a Debezium record's value ({\"payload\": ..., name: value}): it \
                     needs format = \"debezium\" with debezium.value_converter = \"json\"; or use placement = \"header\"",
                ));
            }
            if rule.name.is_empty() || rule.name == "payload" {
                return Err(ConfigError::invalid(
                    format!("{at}.name"),
                    format!(
                        "\"{}\" cannot name an envelope member (\"payload\" holds the payload)",
                        rule.name
                    ),
                ));
            }
        } else if rule.name.is_empty() || is_reserved_header(&rule.name) {
            return Err(ConfigError::invalid(
                format!("{at}.name"),
                format!(
                    "\"{}\" is {}: choose another header name",
                    rule.name,
                    if rule.name.is_empty() {
                        "empty"
                    } else {
                        "reserved for the relay (id, event_type, aggregate_type, outbox_relay_*)"
                    }
                ),
            ));
        }
        if o.format == RecordFormat::Cloudevents
            && (rule.name.to_ascii_lowercase().starts_with("ce_")
                || rule.name.eq_ignore_ascii_case("content-type"))
        {
            return Err(ConfigError::invalid(
                format!("{at}.name"),
                format!(
                    "\"{}\" is CloudEvents' own (ce_*, content-type): choose another header name",
                    rule.name
                ),
            ));
        }
        if let Some(j) = t.headers[..i].iter().position(|h| h.name.eq_ignore_ascii_case(&rule.name)) {
            return Err(ConfigError::invalid(
                format!("{at}.name"),
                format!("\"{}\" is the name of {section}.headers[{j}] too: each header once", rule.name),
            ));
        }
    }
    Ok(())
}

fn validate_redact(section: &str, o: &OutboxConfig) -> Result<(), ConfigError> {
    let t = &o.transforms;
    let mut hashes = false;
    for (i, rule) in t.redact.iter().enumerate() {
        let at = format!("{section}.redact[{i}]");
        let tokens = match pointer_tokens(&rule.pointer) {
            Some(tokens) if !tokens.is_empty() => tokens,
            _ => {
                return Err(ConfigError::invalid(
                    format!("{at}.pointer"),
                    format!(
                        "\"{}\" is not a JSON pointer to a payload field (e.g. \"/card/number\"; the whole payload \
                         cannot be redacted: exclude the event type instead)",
                        rule.pointer
                    ),
                ));
            }
        };
        if rule.with.is_some() && rule.action != RedactAction::Replace {
            return Err(ConfigError::invalid(
                format!("{at}.with"),
                "is only for action = \"replace\": remove it, or set the action to replace",
            ));
        }
        hashes |= rule.action == RedactAction::Hash;
        // (either way round: a header of `/customer` would carry `/customer/email` with it)
        let within = |other: &str| {
            pointer_tokens(other)
                .is_some_and(|o| !o.is_empty() && (o.starts_with(&tokens) || tokens.starts_with(&o)))
        };
        if within(&t.route_by_field) {
            return Err(ConfigError::invalid(
                &at,
                format!(
                    "redacts {}, which {section}.route_by_field reads: the topic would carry the value; route by \
                     another field",
                    rule.pointer
                ),
            ));
        }
        if let Some(j) = t.headers.iter().position(|h| h.from.strip_prefix("payload:").is_some_and(within)) {
            return Err(ConfigError::invalid(
                &at,
                format!(
                    "redacts {}, which {section}.headers[{j}] reads: the header would carry the value; remove the \
                     header rule",
                    rule.pointer
                ),
            ));
        }
        if o.registry.is_some() {
            let string = match rule.action {
                RedactAction::Hash => true,
                RedactAction::Replace => rule.with.as_ref().is_none_or(serde_json::Value::is_string),
                RedactAction::Drop => false,
            };
            if !string {
                return Err(ConfigError::invalid(
                    &at,
                    format!(
                        "{} inside a payload the schema registry encodes ({}.registry): the schema may require the \
                         field or its type; redact with action = \"hash\" or \"replace\" by a string, and give the \
                         field a string type in the schema",
                        if rule.action == RedactAction::Drop {
                            "drops a field"
                        } else {
                            "writes a non-string"
                        },
                        section.trim_end_matches(".transforms")
                    ),
                ));
            }
        }
    }
    if hashes && t.hash_key_file.is_empty() {
        let i = t.redact.iter().position(|r| r.action == RedactAction::Hash).unwrap_or_default();
        return Err(ConfigError::invalid(
            format!("{section}.redact[{i}].action"),
            format!(
                "\"hash\" needs {section}.hash_key_file, a file of at least {} bytes (e.g. openssl rand -hex 32 > \
                 /etc/outbox-relay/redact.key)",
                super::MIN_SIGNING_KEY_BYTES
            ),
        ));
    }
    // (the key file itself is read and measured with the other key files: `validate`)
    Ok(())
}
