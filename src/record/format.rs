//! Record formats (`outbox.format`): the relay's own (`raw`), CloudEvents 1.0 over Kafka, and
//! Debezium's outbox event router's records.
//!
//! A format decides the record's key, value and leading headers from the row's columns; the
//! topic, the relay's position headers and the row's own headers stay as in `raw`. It also says
//! how to read an event's identity back from a record (the id, the payload and the event type as
//! written), which the read-back (`readback`) and `verify` compare, so that a record of any
//! format is recognised by its event id.
//!
//! Invariants:
//! - the same row gives the same bytes in both source modes, except CloudEvents' `time`, which
//!   is the commit time when streamed (so the read-back never compares `time`);
//! - a row the format cannot represent (a structured CloudEvent whose payload is not JSON, an
//!   empty required attribute) is unpublishable, with a reason naming the column.

use std::time::{SystemTime, UNIX_EPOCH};

use crate::config::{CloudEventsMode, Converter, DebeziumConfig, OutboxConfig, RecordFormat};

use super::PoisonReason;

mod json;

/// How an outbox's rows become records; built once per outbox.
#[derive(Debug, Clone)]
pub enum Format {
    Raw,
    CloudEvents(Box<CloudEvents>),
    Debezium(DebeziumConfig),
}

#[derive(Debug, Clone)]
pub struct CloudEvents {
    structured: bool,
    source: Template,
    event_type: Template,
    subject: Option<Template>,
    time: bool,
    content_type: String,
}

/// A record's key, value and leading headers when they are not `raw`'s, with what the read-back
/// compares and the row's text the record no longer holds as it was.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Formatted {
    /// The headers before the row's own (the relay's position headers come before these).
    pub headers: Vec<(&'static str, String)>,
    /// The event type as the record carries it: CloudEvents' `type`; empty for Debezium's.
    pub written_type: String,
    /// The row's aggregate id, when the key is not it as it is.
    pub aggregate_id: Option<String>,
    /// The row's payload, when the value is not it as it is.
    pub payload: Option<String>,
    /// The read-back compares `payload` (a structured CloudEvent's `data`), not the value.
    pub data_is_payload: bool,
}

/// An event's columns as the format reads them.
pub struct Fields<'a> {
    pub id: &'a str,
    pub aggregate_type: &'a str,
    pub aggregate_id: &'a str,
    pub event_type: &'a str,
    pub payload: &'a str,
    pub created_at: Option<SystemTime>,
    /// Members added to a Debezium record's value beside `payload` (the transforms'
    /// `placement = "envelope"`), each value as JSON text; empty: the value is the payload.
    pub envelope: &'a [(String, String)],
}

/// What a format built: the key and value when they differ from the aggregate id and payload.
pub struct Built {
    pub key: Option<String>,
    pub value: Option<Vec<u8>>,
    pub formatted: Formatted,
}

/// An event's identity as a record carries it, read back.
#[derive(Debug, PartialEq, Eq)]
pub struct Identity<'m> {
    pub id: std::borrow::Cow<'m, str>,
    /// The payload as written: the value, or a structured CloudEvent's `data`.
    pub payload: std::borrow::Cow<'m, [u8]>,
    pub event_type: std::borrow::Cow<'m, str>,
}

pub const CE_STRUCTURED_CONTENT_TYPE: &str = "application/cloudevents+json; charset=UTF-8";

impl Format {
    pub fn of(outbox: &OutboxConfig) -> Format {
        match outbox.format {
            RecordFormat::Raw => Format::Raw,
            RecordFormat::Debezium => Format::Debezium(outbox.debezium.clone()),
            RecordFormat::Cloudevents => {
                let c = &outbox.cloudevents;
                Format::CloudEvents(Box::new(CloudEvents {
                    structured: c.mode == CloudEventsMode::Structured,
                    source: Template::parse(&c.source),
                    event_type: Template::parse(&c.event_type),
                    subject: (!c.subject.is_empty()).then(|| Template::parse(&c.subject)),
                    time: c.time,
                    content_type: c.data_content_type.clone(),
                }))
            }
        }
    }

    /// Whether a row header of this name would pass for one of the format's own (in any case).
    pub fn reserves(&self, name: &str) -> bool {
        match self {
            Format::CloudEvents(_) => {
                name.get(..3).is_some_and(|p| p.eq_ignore_ascii_case("ce_"))
                    || name.eq_ignore_ascii_case("content-type")
            }
            Format::Raw | Format::Debezium(_) => false,
        }
    }

    /// The record's key, value and headers for a row; `None` for `raw`.
    pub fn build(&self, f: &Fields<'_>) -> Result<Option<Built>, PoisonReason> {
        match self {
            Format::Raw => Ok(None),
            Format::CloudEvents(ce) => ce.build(f).map(Some),
            Format::Debezium(d) => Ok(Some(debezium(d, f))),
        }
    }

    /// Reads an event's identity from a record of this format: `header` looks a header up.
    pub fn identity<'m>(
        &self,
        header: impl Fn(&str) -> Option<&'m [u8]>,
        value: &'m [u8],
    ) -> Option<Identity<'m>> {
        let text = |name: &str| header(name).and_then(|v| std::str::from_utf8(v).ok());
        let borrowed = |id: &'m str, event_type: &'m str| Identity {
            id: id.into(),
            payload: value.into(),
            event_type: event_type.into(),
        };
        match self {
            Format::Raw => Some(borrowed(text("id")?, text("event_type").unwrap_or_default())),
            Format::Debezium(_) => Some(borrowed(text("id")?, "")),
            Format::CloudEvents(ce) if !ce.structured => {
                Some(borrowed(text("ce_id")?, text("ce_type").unwrap_or_default()))
            }
            Format::CloudEvents(_) => {
                #[derive(serde::Deserialize)]
                struct Envelope<'a> {
                    #[serde(borrow)]
                    id: std::borrow::Cow<'a, str>,
                    #[serde(borrow, rename = "type")]
                    event_type: std::borrow::Cow<'a, str>,
                    #[serde(borrow)]
                    data: Option<&'a serde_json::value::RawValue>,
                }
                let e: Envelope<'m> = serde_json::from_slice(value).ok()?;
                let data = e.data.map_or("", |d| d.get());
                Some(Identity { id: e.id, payload: data.as_bytes().into(), event_type: e.event_type })
            }
        }
    }
}

impl CloudEvents {
    fn build(&self, f: &Fields<'_>) -> Result<Built, PoisonReason> {
        let empty = |attribute: &str, template: &Template| PoisonReason::EmptyAttribute {
            attribute: attribute.to_string(),
            columns: template.columns(),
        };
        if f.id.is_empty() {
            return Err(PoisonReason::EmptyAttribute { attribute: "id".into(), columns: "id".into() });
        }
        let source = self.source.render(f);
        if source.is_empty() {
            return Err(empty("source", &self.source));
        }
        let event_type = self.event_type.render(f);
        if event_type.is_empty() {
            return Err(empty("type", &self.event_type));
        }
        let subject = self.subject.as_ref().map(|s| s.render(f)).filter(|s| !s.is_empty());
        let time = f.created_at.filter(|_| self.time).map(rfc3339);
        let attributes = Attributes { source, event_type, subject, time };
        match self.structured {
            true => self.structured(f, attributes),
            false => Ok(self.binary(f, attributes)),
        }
    }

    /// Binary mode: the attributes in `ce_*` headers, the payload as the value.
    fn binary(&self, f: &Fields<'_>, a: Attributes) -> Built {
        let mut headers = vec![("ce_specversion", "1.0".to_string()), ("ce_id", f.id.to_string())];
        headers.push(("ce_source", a.source));
        headers.push(("ce_type", a.event_type.clone()));
        headers.extend(a.subject.map(|s| ("ce_subject", s)));
        headers.extend(a.time.map(|t| ("ce_time", t)));
        headers.push(("content-type", self.content_type.clone()));
        let formatted = Formatted {
            headers,
            written_type: a.event_type,
            aggregate_id: None,
            payload: None,
            data_is_payload: false,
        };
        Built { key: None, value: None, formatted }
    }

    /// Structured mode: one JSON envelope with the attributes and the payload as `data`.
    fn structured(&self, f: &Fields<'_>, a: Attributes) -> Result<Built, PoisonReason> {
        if serde_json::from_str::<serde::de::IgnoredAny>(f.payload).is_err() {
            return Err(PoisonReason::NotJson { attribute: "data".into() });
        }
        let mut value = String::with_capacity(f.payload.len() + 160);
        value.push_str("{\"specversion\":\"1.0\"");
        for (name, text) in [("id", Some(f.id)), ("source", Some(&a.source)), ("type", Some(&a.event_type))]
            .into_iter()
            .chain([("subject", a.subject.as_deref()), ("time", a.time.as_deref())])
        {
            if let Some(text) = text {
                value.push_str(&format!(",\"{name}\":"));
                value.push_str(&serde_json::Value::from(text).to_string());
            }
        }
        value.push_str(",\"datacontenttype\":");
        value.push_str(&serde_json::Value::from(self.content_type.as_str()).to_string());
        value.push_str(",\"data\":");
        value.push_str(f.payload);
        value.push('}');
        let headers = vec![("content-type", CE_STRUCTURED_CONTENT_TYPE.to_string())];
        let formatted = Formatted {
            headers,
            written_type: a.event_type,
            aggregate_id: None,
            payload: Some(f.payload.to_string()),
            data_is_payload: true,
        };
        Ok(Built { key: None, value: Some(value.into_bytes()), formatted })
    }
}

/// A CloudEvent's rendered attributes (`id` is the row's).
struct Attributes {
    source: String,
    event_type: String,
    subject: Option<String>,
    time: Option<String>,
}

/// Debezium's records: the `id` header, the key and value through the configured converters.
fn debezium(d: &DebeziumConfig, f: &Fields<'_>) -> Built {
    let key = match d.key_converter {
        Converter::String => None,
        Converter::Json => Some(json::java_string(f.aggregate_id)),
        Converter::JsonWithSchemas => Some(format!(
            "{{\"schema\":{{\"type\":\"string\",\"optional\":false}},\"payload\":{}}}",
            json::java_string(f.aggregate_id)
        )),
    };
    let value = match d.value_converter {
        Converter::String => None,
        Converter::Json => {
            let payload = match d.expand_json_payload {
                true => json::expanded(f.payload).unwrap_or_else(|| json::java_string(f.payload)),
                false => json::java_string(f.payload),
            };
            Some(enveloped(payload, f.envelope))
        }
        Converter::JsonWithSchemas => Some(format!(
            "{{\"schema\":{{\"type\":\"string\",\"optional\":false,\"name\":\"io.debezium.data.Json\",\"version\":1}},\"payload\":{}}}",
            json::java_string(f.payload)
        )),
    };
    let formatted = Formatted {
        headers: vec![("id", f.id.to_string())],
        written_type: String::new(),
        aggregate_id: key.is_some().then(|| f.aggregate_id.to_string()),
        payload: value.is_some().then(|| f.payload.to_string()),
        data_is_payload: false,
    };
    Built { key, value: value.map(String::into_bytes), formatted }
}

/// The router's envelope: `{"payload": <payload>, "<name>": <value>, ...}` with members, or the
/// payload alone without.
fn enveloped(payload: String, members: &[(String, String)]) -> String {
    if members.is_empty() {
        return payload;
    }
    let mut value = format!("{{\"payload\":{payload}");
    for (name, member) in members {
        value.push(',');
        value.push_str(&serde_json::to_string(name).expect("a string"));
        value.push(':');
        value.push_str(member);
    }
    value.push('}');
    value
}

/// A CloudEvents attribute template: text and `{column}` placeholders, parsed once.
#[derive(Debug, Clone)]
struct Template(Vec<Part>);

#[derive(Debug, Clone)]
enum Part {
    Text(String),
    Id,
    AggregateType,
    AggregateId,
    EventType,
}

impl Template {
    /// Parses a validated template (`config::format` checked its placeholders).
    fn parse(template: &str) -> Template {
        let mut parts = Vec::new();
        let mut rest = template;
        while let Some(open) = rest.find('{') {
            let Some(close) = rest[open..].find('}').map(|c| open + c) else { break };
            if open > 0 {
                parts.push(Part::Text(rest[..open].to_string()));
            }
            parts.push(match &rest[open + 1..close] {
                "id" => Part::Id,
                "aggregate_type" => Part::AggregateType,
                "aggregate_id" => Part::AggregateId,
                "event_type" => Part::EventType,
                other => Part::Text(format!("{{{other}}}")),
            });
            rest = &rest[close + 1..];
        }
        if !rest.is_empty() {
            parts.push(Part::Text(rest.to_string()));
        }
        Template(parts)
    }

    fn render(&self, f: &Fields<'_>) -> String {
        let mut out = String::with_capacity(32);
        for part in &self.0 {
            out.push_str(match part {
                Part::Text(text) => text,
                Part::Id => f.id,
                Part::AggregateType => f.aggregate_type,
                Part::AggregateId => f.aggregate_id,
                Part::EventType => f.event_type,
            });
        }
        out
    }

    /// The columns it reads, for a reason: `aggregate_type, event_type`.
    fn columns(&self) -> String {
        let names: Vec<&str> = self
            .0
            .iter()
            .filter_map(|p| match p {
                Part::Text(_) => None,
                Part::Id => Some("id"),
                Part::AggregateType => Some("aggregate_type"),
                Part::AggregateId => Some("aggregate_id"),
                Part::EventType => Some("event_type"),
            })
            .collect();
        if names.is_empty() { "no column".into() } else { names.join(", ") }
    }
}

/// RFC 3339 in UTC with microseconds, as CloudEvents' `time` (`2026-12-03T19:04:05.123456Z`).
pub fn rfc3339(at: SystemTime) -> String {
    let since = at.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = since.as_secs();
    let (days, rest) = ((secs / 86_400) as i64, secs % 86_400);
    // days since 1970-01-01 to a civil date (Howard Hinnant's days_from_civil, inverted)
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let (h, m, s) = (rest / 3600, rest % 3600 / 60, rest % 60);
    format!("{year:04}-{month:02}-{day:02}T{h:02}:{m:02}:{s:02}.{:06}Z", since.subsec_micros())
}

#[cfg(test)]
mod tests;
