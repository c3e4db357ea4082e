//! An incoming Kafka record, and what it means to the ledger: an [`OrderPlaced`] to apply, or
//! a [`Poison`] reason to dead-letter it for.
//!
//! Invariants:
//! - [`classify`] is pure: the same record always gets the same answer, so a poison record is
//!   dead-lettered at once, never retried;
//! - a poison reason names what is wrong (the header, the field), because it travels with the
//!   record to the dead-letter topic as `dlq_reason` for the operator who reads it;
//! - an event is known by its source and its id ([`Inbound::source`], [`Inbound::event_id`]):
//!   ids are unique only within one outbox table, so the inbox is keyed by both, and an event
//!   from another outbox that reuses an id is never taken for a duplicate;
//! - the event id is the relay's `id` header (the outbox row id) and the source its
//!   `outbox_relay_source` header, each when it is 1 to [`MAX_EVENT_ID_CHARS`] characters of
//!   UTF-8 without a control character; a record without such an id is poison, and is known by
//!   `<topic>/<partition>/<offset>`; a record without such a source, or from a source
//!   `consumer.sources` does not list, is poison too. So the inbox key the database gets is
//!   always one it can store and index (a NUL byte would be refused, a multi-kilobyte key
//!   exceeds a btree row);
//! - a reason quotes record data only escaped and shortened ([`excerpt`]): it is stored in
//!   `processed_events.detail`, which must accept it whatever the record holds.

use rdkafka::Message;
use rdkafka::message::{BorrowedMessage, Headers};
use serde_json::{Map, Value};

/// The header holding the event id (the outbox row id), set by the relay.
pub const ID_HEADER: &str = "id";
/// The header naming the outbox the event came from
/// (`<system identifier>/<database>/<schema>.<table>`), set by the relay.
pub const SOURCE_HEADER: &str = "outbox_relay_source";
/// The header holding the event type, set by the relay.
pub const EVENT_TYPE_HEADER: &str = "event_type";
/// The one event type this consumer applies.
pub const ORDER_PLACED: &str = "OrderPlaced";
/// The longest `id` header accepted as an event id. The relay's ids (outbox row ids) are far
/// shorter; the limit keeps the inbox key well inside a btree index row.
pub const MAX_EVENT_ID_CHARS: usize = 128;
/// How much of a value a poison reason quotes.
const EXCERPT_CHARS: usize = 40;

/// A record copied out of the consumer, so the consumer can be polled again while it is
/// applied, retried or dead-lettered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Inbound {
    pub topic: String,
    pub partition: i32,
    pub offset: i64,
    pub key: Option<Vec<u8>>,
    pub payload: Option<Vec<u8>>,
    /// Every header, in order, values as sent (a null value stays null).
    pub headers: Vec<(String, Option<Vec<u8>>)>,
}

impl Inbound {
    pub fn from_message(message: &BorrowedMessage<'_>) -> Inbound {
        let headers = message
            .headers()
            .map(|hs| hs.iter().map(|h| (h.key.to_string(), h.value.map(<[u8]>::to_vec))).collect())
            .unwrap_or_default();
        let mut inbound = Inbound {
            topic: message.topic().to_string(),
            partition: message.partition(),
            offset: message.offset(),
            key: message.key().map(<[u8]>::to_vec),
            payload: message.payload().map(<[u8]>::to_vec),
            headers,
        };
        inbound.unwrap_cloudevent();
        inbound
    }

    /// A CloudEvent (the relay's `outbox.format = "cloudevents"`) read as the relay's own record:
    /// `ce_id` and `ce_type` (binary mode) or the envelope's `id`, `type` and `data`
    /// (structured mode) become the `id` and `event_type` headers and the value. Any other record
    /// stays as it is.
    pub fn unwrap_cloudevent(&mut self) {
        let structured =
            self.header("content-type").is_some_and(|t| t.starts_with("application/cloudevents+json"));
        let (id, event_type) = if structured {
            #[derive(serde::Deserialize)]
            struct Envelope {
                id: Option<String>,
                #[serde(rename = "type")]
                event_type: Option<String>,
                data: Option<Box<serde_json::value::RawValue>>,
            }
            let Some(envelope) =
                self.payload.as_deref().and_then(|p| serde_json::from_slice::<Envelope>(p).ok())
            else {
                return;
            };
            self.payload = envelope.data.map(|d| d.get().as_bytes().to_vec());
            (envelope.id, envelope.event_type)
        } else if self.header("ce_specversion").is_some() {
            (self.header("ce_id").map(str::to_string), self.header("ce_type").map(str::to_string))
        } else {
            return;
        };
        self.headers.retain(|(k, _)| k != ID_HEADER && k != EVENT_TYPE_HEADER);
        self.headers.extend(id.map(|id| (ID_HEADER.to_string(), Some(id.into_bytes()))));
        self.headers.extend(event_type.map(|t| (EVENT_TYPE_HEADER.to_string(), Some(t.into_bytes()))));
    }

    /// The first header called `name`, as text (None when absent, null or not UTF-8).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(key, _)| key == name)
            .and_then(|(_, value)| value.as_deref())
            .and_then(|value| std::str::from_utf8(value).ok())
    }

    /// The event id: the `id` header, or `<topic>/<partition>/<offset>` without a valid one.
    pub fn event_id(&self) -> String {
        match self.key_header(ID_HEADER, "header id (the event id)") {
            Ok(id) => id.to_string(),
            Err(_) => self.position(),
        }
    }

    /// The outbox the event came from: the `outbox_relay_source` header, or empty without a
    /// valid one.
    pub fn source(&self) -> &str {
        self.key_header(SOURCE_HEADER, "").unwrap_or_default()
    }

    /// The header `name` if it can be part of the inbox key, or the poison reason why not
    /// (`what` names it there).
    fn key_header(&self, name: &str, what: &str) -> Result<&str, String> {
        let Some((_, value)) = self.headers.iter().find(|(key, _)| key == name) else {
            return Err(format!("missing {what}: the relay sets it on every record"));
        };
        let Some(value) = value.as_deref() else {
            return Err(format!("{what} is null"));
        };
        let Ok(id) = std::str::from_utf8(value) else {
            return Err(format!("{what} is not UTF-8"));
        };
        let chars = id.chars().count();
        if chars == 0 {
            return Err(format!("{what} is empty"));
        }
        if chars > MAX_EVENT_ID_CHARS {
            return Err(format!(
                "{what} is {chars} characters long, at most {MAX_EVENT_ID_CHARS}: {}",
                excerpt(id)
            ));
        }
        if id.chars().any(char::is_control) {
            return Err(format!("{what} holds a control character: {}", excerpt(id)));
        }
        Ok(id)
    }

    /// `<topic>/<partition>/<offset>`, for logs.
    pub fn position(&self) -> String {
        format!("{}/{}/{}", self.topic, self.partition, self.offset)
    }
}

/// An order to charge: the payload of an `OrderPlaced` event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OrderPlaced {
    pub event_id: String,
    pub order_id: i64,
    pub customer_id: String,
    pub total_cents: i64,
    /// A UUID in text form (checked here, so the database never refuses it).
    pub payment_id: String,
    /// W3C trace context of the record, carried into the follow-up event.
    pub traceparent: Option<String>,
}

/// Why a record can never be applied: the `dlq_reason` of its dead letter.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Poison(pub String);

/// The outboxes whose events the ledger applies: `consumer.sources`, each
/// `<system identifier>/<database>/<schema>.<table>`, or `*/<database>/<schema>.<table>` for
/// that table in any cluster. Empty: any source.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Sources(pub Vec<String>);

impl Sources {
    pub fn trusts(&self, source: &str) -> bool {
        let matches = |pattern: &String| match pattern.strip_prefix("*/") {
            Some(rest) => source.split_once('/').is_some_and(|(_, after)| after == rest),
            None => pattern == source,
        };
        self.0.is_empty() || self.0.iter().any(matches)
    }
}

/// Reads `record` as an `OrderPlaced` event from one of `sources`, or says why it is not one.
pub fn classify(record: &Inbound, sources: &Sources) -> Result<OrderPlaced, Poison> {
    let poison = |reason: String| Err(Poison(reason));
    let event_id = record.key_header(ID_HEADER, "header id (the event id)").map_err(Poison)?.to_string();
    let what = "header outbox_relay_source (the outbox the event came from)";
    let source = record.key_header(SOURCE_HEADER, what).map_err(Poison)?;
    if !sources.trusts(source) {
        return poison(format!(
            "header outbox_relay_source {} is not one of consumer.sources: an outbox this ledger does not \
             take payments from wrote it",
            excerpt(source)
        ));
    }
    match record.header(EVENT_TYPE_HEADER) {
        Some(ORDER_PLACED) => {}
        Some(other) => {
            return poison(format!(
                "unknown event_type {}: this consumer applies {ORDER_PLACED} only",
                excerpt(other)
            ));
        }
        None => return poison("missing header event_type".into()),
    }
    let Some(payload) = record.payload.as_deref().filter(|p| !p.is_empty()) else {
        return poison("empty value: expected an OrderPlaced JSON object".into());
    };
    let object = match serde_json::from_slice::<Value>(payload) {
        Ok(Value::Object(object)) => object,
        Ok(other) => return poison(format!("value is JSON but not an object: {}", kind(&other))),
        Err(e) => return poison(format!("value is not JSON: {e}")),
    };
    let order = OrderPlaced {
        event_id,
        order_id: integer(&object, "order_id")?,
        customer_id: text(&object, "customer_id")?.to_string(),
        total_cents: integer(&object, "total_cents")?,
        payment_id: text(&object, "payment_id")?.to_ascii_lowercase(),
        traceparent: record.header("traceparent").map(str::to_string),
    };
    if order.total_cents <= 0 {
        return poison(format!("field total_cents: must be > 0, got {}", order.total_cents));
    }
    if !is_uuid(&order.payment_id) {
        return poison(format!("field payment_id: {} is not a UUID", excerpt(&order.payment_id)));
    }
    Ok(order)
}

fn integer(object: &Map<String, Value>, field: &str) -> Result<i64, Poison> {
    match object.get(field) {
        None | Some(Value::Null) => Err(Poison(format!("field {field}: missing"))),
        Some(value) => value
            .as_i64()
            .ok_or_else(|| Poison(format!("field {field}: expected an integer, got {}", kind(value)))),
    }
}

fn text<'a>(object: &'a Map<String, Value>, field: &str) -> Result<&'a str, Poison> {
    match object.get(field) {
        None | Some(Value::Null) => Err(Poison(format!("field {field}: missing"))),
        Some(Value::String(s)) if s.is_empty() => Err(Poison(format!("field {field}: empty"))),
        Some(Value::String(s)) => Ok(s),
        Some(value) => Err(Poison(format!("field {field}: expected a string, got {}", kind(value)))),
    }
}

/// A JSON value's type and a short excerpt, for a reason text.
fn kind(value: &Value) -> String {
    let name = match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    };
    let text = value.to_string();
    let excerpt: String = text.chars().take(40).collect();
    format!("{name} ({excerpt}{})", if text.chars().count() > 40 { "..." } else { "" })
}

/// `text` quoted, escaped (a NUL byte or a control character as `\0`, `\u{1b}`) and cut to
/// [`EXCERPT_CHARS`] characters: record data as a reason may quote it.
fn excerpt(text: &str) -> String {
    let shown: String = text.chars().take(EXCERPT_CHARS).collect();
    let cut = if text.chars().count() > EXCERPT_CHARS { "..." } else { "" };
    format!("{shown:?}{cut}")
}

/// `8-4-4-4-12` hexadecimal digits: what PostgreSQL's uuid input accepts in canonical form.
fn is_uuid(text: &str) -> bool {
    let groups: Vec<&str> = text.split('-').collect();
    let lengths = [8, 4, 4, 4, 12];
    groups.len() == lengths.len()
        && groups
            .iter()
            .zip(lengths)
            .all(|(group, len)| group.len() == len && group.chars().all(|c| c.is_ascii_hexdigit()))
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAYMENT: &str = "3f2b8c1e-9a4d-4e5f-8a7b-1c2d3e4f5a6b";
    const SOURCE: &str = "7714106138773647812/shop/public.outbox_events";

    fn record(event_type: Option<&str>, payload: &str) -> Inbound {
        let mut headers = vec![
            ("id".to_string(), Some(b"42".to_vec())),
            (SOURCE_HEADER.to_string(), Some(SOURCE.as_bytes().to_vec())),
        ];
        if let Some(event_type) = event_type {
            headers.push(("event_type".into(), Some(event_type.as_bytes().to_vec())));
        }
        headers.push(("traceparent".into(), Some(b"00-abc-def-01".to_vec())));
        Inbound {
            topic: "outbox.event.order".into(),
            partition: 2,
            offset: 7,
            key: Some(b"9".to_vec()),
            payload: Some(payload.as_bytes().to_vec()),
            headers,
        }
    }

    fn valid_payload() -> String {
        format!(r#"{{"order_id": 9, "customer_id": "c-1", "total_cents": 300, "payment_id": "{PAYMENT}"}}"#)
    }

    fn reason(record: &Inbound) -> String {
        classify(record, &Sources::default()).unwrap_err().0
    }

    #[test]
    fn an_order_placed_record_is_read() {
        let order = classify(&record(Some("OrderPlaced"), &valid_payload()), &Sources::default()).unwrap();
        assert_eq!(
            order,
            OrderPlaced {
                event_id: "42".into(),
                order_id: 9,
                customer_id: "c-1".into(),
                total_cents: 300,
                payment_id: PAYMENT.into(),
                traceparent: Some("00-abc-def-01".into()),
            }
        );
    }

    #[test]
    fn cloudevents_are_read_as_the_relays_own_records() {
        let expected = classify(&record(Some("OrderPlaced"), &valid_payload()), &Sources::default()).unwrap();
        // binary mode: the attributes in ce_* headers
        let mut binary = record(None, &valid_payload());
        binary.headers.retain(|(k, _)| k != "id");
        for (k, v) in
            [("ce_specversion", "1.0"), ("ce_id", "42"), ("ce_type", "OrderPlaced"), ("ce_source", "/shop")]
        {
            binary.headers.push((k.into(), Some(v.as_bytes().to_vec())));
        }
        binary.unwrap_cloudevent();
        assert_eq!(classify(&binary, &Sources::default()).unwrap(), expected);
        // structured mode: one JSON envelope, the payload as data
        let envelope = format!(
            r#"{{"specversion":"1.0","id":"42","source":"/shop","type":"OrderPlaced","data":{}}}"#,
            valid_payload()
        );
        let mut structured = record(None, &envelope);
        structured.headers.retain(|(k, _)| k != "id");
        structured
            .headers
            .push(("content-type".into(), Some(b"application/cloudevents+json; charset=UTF-8".to_vec())));
        structured.unwrap_cloudevent();
        assert_eq!(classify(&structured, &Sources::default()).unwrap(), expected);
        // a record of the relay's own format is left alone
        let mut raw = record(Some("OrderPlaced"), &valid_payload());
        raw.unwrap_cloudevent();
        assert_eq!(raw, record(Some("OrderPlaced"), &valid_payload()));
    }

    #[test]
    fn each_poison_reason_names_the_problem() {
        let drop_field = |field: &str| {
            let mut value: Value = serde_json::from_str(&valid_payload()).unwrap();
            value.as_object_mut().unwrap().remove(field);
            value.to_string()
        };
        let cases = [
            (record(Some("OrderPlaced"), "not json"), "not JSON"),
            (record(Some("OrderPlaced"), "[1]"), "not an object"),
            (record(Some("OrderPlaced"), ""), "empty value"),
            (record(Some("OrderPlaced"), &drop_field("payment_id")), "field payment_id: missing"),
            (record(Some("OrderPlaced"), &drop_field("order_id")), "field order_id: missing"),
            (record(Some("OrderShipped"), &valid_payload()), "unknown event_type \"OrderShipped\""),
            (record(None, &valid_payload()), "missing header event_type"),
            (
                record(Some("OrderPlaced"), &valid_payload().replace("300", "\"300\"")),
                "field total_cents: expected an integer, got a string",
            ),
            (
                record(Some("OrderPlaced"), &valid_payload().replace("300", "0")),
                "field total_cents: must be > 0",
            ),
            (
                record(Some("OrderPlaced"), &valid_payload().replace(PAYMENT, "nope")),
                "field payment_id: \"nope\" is not a UUID",
            ),
            (record(Some("OrderPlaced"), &valid_payload().replace("\"c-1\"", "7")), "field customer_id"),
        ];
        for (record, expected) in cases {
            let reason = reason(&record);
            assert!(reason.contains(expected), "expected {expected:?} in {reason:?}");
        }
    }

    #[test]
    fn a_record_without_an_id_is_poison_and_known_by_its_position() {
        let mut r = record(Some("OrderPlaced"), &valid_payload());
        r.headers.retain(|(k, _)| k != "id");
        assert!(reason(&r).contains("missing header id"));
        assert_eq!(r.event_id(), "outbox.event.order/2/7");
        r.headers.push(("id".into(), None));
        assert_eq!(r.event_id(), "outbox.event.order/2/7");
    }

    #[test]
    fn an_id_the_database_could_not_store_is_poison_and_known_by_its_position() {
        let with_id = |id: Option<&[u8]>| {
            let mut r = record(Some("OrderPlaced"), &valid_payload());
            r.headers[0].1 = id.map(<[u8]>::to_vec);
            r
        };
        let long = "7".repeat(MAX_EVENT_ID_CHARS + 1);
        let cases: [(&[u8], &str); 5] = [
            (b"4\x002", r#"header id (the event id) holds a control character: "4\02""#),
            (b"4\n2", r#"holds a control character: "4\n2""#),
            (long.as_bytes(), "header id (the event id) is 129 characters long, at most 128: \"7777"),
            (b"\xff42", "header id (the event id) is not UTF-8"),
            (b"", "header id (the event id) is empty"),
        ];
        for (id, expected) in cases {
            let r = with_id(Some(id));
            let reason = reason(&r);
            assert!(reason.contains(expected), "expected {expected:?} in {reason:?}");
            assert!(!reason.chars().any(char::is_control), "a reason holds no control character: {reason:?}");
            assert!(reason.len() < 200, "a reason quotes an excerpt only: {reason:?}");
            assert_eq!(r.event_id(), "outbox.event.order/2/7");
        }
        assert_eq!(reason(&with_id(None)), "header id (the event id) is null");
        // the longest id accepted, and any printable text
        let longest = "é".repeat(MAX_EVENT_ID_CHARS);
        assert_eq!(
            classify(&with_id(Some(longest.as_bytes())), &Sources::default()).unwrap().event_id,
            longest
        );
        assert_eq!(with_id(Some(b"order 42/a")).event_id(), "order 42/a");
    }

    #[test]
    fn a_record_from_no_source_or_an_untrusted_one_is_poison() {
        let order = record(Some("OrderPlaced"), &valid_payload());
        let trusted = |patterns: &[&str]| {
            let sources = Sources(patterns.iter().map(|p| p.to_string()).collect());
            classify(&order, &sources).map(|o| o.event_id).map_err(|p| p.0)
        };
        // any source, one exact source, or the table in any cluster
        assert_eq!(trusted(&[]), Ok("42".to_string()));
        assert_eq!(trusted(&["1/other/public.outbox_events", SOURCE]), Ok("42".to_string()));
        assert_eq!(trusted(&["*/shop/public.outbox_events"]), Ok("42".to_string()));
        // another database, table or cluster is refused, naming the setting
        for patterns in
            [["*/other/public.outbox_events"], ["*/shop/public.outbox"], ["1/shop/public.outbox_events"]]
        {
            let reason = trusted(&patterns).unwrap_err();
            assert!(reason.contains("is not one of consumer.sources"), "{reason}");
        }
        // a record without the header is poison, whatever consumer.sources says
        let mut anonymous = order.clone();
        anonymous.headers.retain(|(k, _)| k != SOURCE_HEADER);
        assert!(reason(&anonymous).contains("missing header outbox_relay_source"), "{}", reason(&anonymous));
        assert_eq!((order.source(), anonymous.source()), (SOURCE, ""));
    }

    #[test]
    fn record_data_in_a_reason_is_escaped_and_shortened() {
        let nul_type = record(Some("Order\0Placed"), &valid_payload());
        assert!(
            reason(&nul_type).starts_with(r#"unknown event_type "Order\0Placed": "#),
            "{}",
            reason(&nul_type)
        );
        let long_payment = valid_payload().replace(PAYMENT, &"a\\u0000".repeat(100));
        let reason = reason(&record(Some("OrderPlaced"), &long_payment));
        assert!(reason.starts_with(r#"field payment_id: "a\0a\0"#), "{reason}");
        assert!(reason.ends_with(r#"\0"... is not a UUID"#), "{reason}");
        assert!(!reason.contains('\0'));
    }

    #[test]
    fn uuids_are_checked_by_shape() {
        assert!(is_uuid(PAYMENT));
        assert!(!is_uuid("3f2b8c1e-9a4d-4e5f-8a7b-1c2d3e4f5a6"));
        assert!(!is_uuid("3f2b8c1e9a4d4e5f8a7b1c2d3e4f5a6b"));
        assert!(!is_uuid("3f2b8c1e-9a4d-4e5f-8a7b-1c2d3e4f5a6g"));
    }
}
