//! One outbox's transforms (`[outbox.transforms]`), parsed once when the mapping is built: the
//! filter, the route, the header rules and the redactions the mapping applies to every row.
//!
//! Invariants:
//! - the filter reads only the event and aggregate types, so a filtered row is filtered in both
//!   modes, by `verify` and by `locate` alike, whatever its payload;
//! - the route and the headers read the payload as stored, the redactions then rewrite it; the
//!   configuration refuses a header or a route read from a redacted field (`config::transforms`);
//! - an event a rule cannot apply to is unpublishable ([`PoisonReason::Transform`], naming the
//!   outbox, the rule and the path), never published half-transformed, never skipped;
//! - the HMAC key is read here, once, and never printed (its `Debug` says whether it was read).

use std::fmt;

use ring::hmac;
use serde_json::Value;

use super::PoisonReason;
use crate::config::{HeaderSource, OutboxConfig, Placement, ROUTE_PLACEHOLDER, RedactAction, pointer_tokens};
use crate::error::{FatalReason, RelayError};

mod redact;

/// A glob over a type name: `*` any run of characters, `?` one; anything else itself.
#[derive(Debug, Clone)]
struct Glob {
    chars: Vec<char>,
    /// The same, when ASCII.
    bytes: Option<Vec<u8>>,
}

impl Glob {
    fn new(text: &str) -> Glob {
        Glob { chars: text.chars().collect(), bytes: text.is_ascii().then(|| text.as_bytes().to_vec()) }
    }

    fn matches(&self, name: &str) -> bool {
        // (type names are ASCII nearly always: compared by bytes then, without an allocation)
        if let Some(pattern) = self.bytes.as_ref().filter(|_| name.is_ascii()) {
            return wild(pattern, name.as_bytes(), b'*', b'?');
        }
        let name: Vec<char> = name.chars().collect();
        wild(&self.chars, &name, '*', '?')
    }
}

/// Whether `name` matches `pattern` (`star` any run, `one` any one), by backtracking to the last
/// star: linear in practice, never exponential.
fn wild<T: PartialEq + Copy>(pattern: &[T], name: &[T], star: T, one: T) -> bool {
    let (mut pi, mut ni, mut last_star, mut mark) = (0, 0, None, 0);
    while ni < name.len() {
        if pi < pattern.len() && pattern[pi] != star && (pattern[pi] == one || pattern[pi] == name[ni]) {
            (pi, ni) = (pi + 1, ni + 1);
        } else if pi < pattern.len() && pattern[pi] == star {
            (last_star, mark, pi) = (Some(pi), ni, pi + 1);
        } else if let Some(s) = last_star {
            (pi, mark) = (s + 1, mark + 1);
            ni = mark;
        } else {
            return false;
        }
    }
    pattern[pi..].iter().all(|c| *c == star)
}

/// An include or exclude list, with the setting it came from.
#[derive(Debug, Clone, Default)]
struct Globs {
    setting: String,
    globs: Vec<(String, Glob)>,
}

impl Globs {
    fn of(setting: String, entries: &[String]) -> Globs {
        Globs { setting, globs: entries.iter().map(|e| (e.clone(), Glob::new(e))).collect() }
    }

    /// The first entry matching `name`, as `setting[i] ("glob")`.
    fn matching(&self, name: &str) -> Option<String> {
        let (i, (text, _)) = self.globs.iter().enumerate().find(|(_, (_, g))| g.matches(name))?;
        Some(format!("{}[{i}] (\"{text}\")", self.setting))
    }
}

#[derive(Debug, Clone)]
struct Route {
    rule: String,
    pointer: String,
    tokens: Vec<String>,
    /// `route_topic` around `{value}`.
    before: String,
    after: String,
}

#[derive(Debug, Clone)]
struct Header {
    rule: String,
    name: String,
    /// A header, or a member of a Debezium record's value (as JSON).
    envelope: bool,
    source: HeaderSource,
    tokens: Vec<String>,
}

#[derive(Debug, Clone)]
struct Redaction {
    rule: String,
    tokens: Vec<String>,
    action: RedactAction,
    /// `with`'s JSON text (replace).
    with: String,
}

/// The key of `hash_key_file`: read or not, never shown.
#[derive(Clone)]
struct HashKey(Result<hmac::Key, String>);

impl fmt::Debug for HashKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.0.is_ok() { "HashKey(read)" } else { "HashKey(unreadable)" })
    }
}

/// The parsed transforms of one outbox.
#[derive(Debug, Clone, Default)]
pub(super) struct Transforms {
    /// The outbox's name, for reasons.
    outbox: String,
    include_event: Globs,
    exclude_event: Globs,
    include_aggregate: Globs,
    exclude_aggregate: Globs,
    route: Option<Route>,
    headers: Vec<Header>,
    redactions: Vec<Redaction>,
    key: Option<HashKey>,
    /// The route or a header reads the payload as JSON.
    reads_payload: bool,
}

/// What the transforms made of a row that passed the filter.
#[derive(Debug, Default)]
pub(super) struct Shaped {
    /// The routed topic, instead of the template's.
    pub(super) topic: Option<String>,
    /// Headers from the rules, after the row's own.
    pub(super) headers: Vec<(String, String)>,
    /// Members of a Debezium record's value from the rules (`placement = "envelope"`), each
    /// value as JSON text.
    pub(super) envelope: Vec<(String, String)>,
    /// The redacted payload, when a redaction changed it.
    pub(super) payload: Option<String>,
}

/// The columns a rule may read.
pub(super) struct Columns<'a> {
    pub(super) id: &'a str,
    pub(super) aggregate_type: &'a str,
    pub(super) aggregate_id: &'a str,
    pub(super) event_type: &'a str,
    pub(super) topic: Option<&'a str>,
    pub(super) payload: &'a str,
    /// The other columns the header rules read, by name, as the row came.
    pub(super) others: &'a [(String, Option<String>)],
}

impl Transforms {
    /// The transforms of `outbox` (its settings at `path`, `outbox` or `outboxes[2]`).
    pub(super) fn of(outbox: &OutboxConfig, path: &str) -> Transforms {
        let t = &outbox.transforms;
        let section = format!("{path}.transforms");
        let globs = |key: &str, entries: &[String]| Globs::of(format!("{section}.{key}"), entries);
        let tokens = |pointer: &str| pointer_tokens(pointer).unwrap_or_default();
        let route = (!t.route_by_field.is_empty()).then(|| {
            let topic = if t.route_topic.is_empty() { ROUTE_PLACEHOLDER } else { &t.route_topic };
            let (before, after) = topic.split_once(ROUTE_PLACEHOLDER).unwrap_or((topic, ""));
            Route {
                rule: format!("{section}.route_by_field"),
                pointer: t.route_by_field.clone(),
                tokens: tokens(&t.route_by_field),
                before: before.to_string(),
                after: after.to_string(),
            }
        });
        let headers: Vec<Header> = t
            .headers
            .iter()
            .enumerate()
            .filter_map(|(i, h)| {
                let source = h.source(&outbox.columns)?;
                let tokens = match &source {
                    HeaderSource::Payload(pointer) => tokens(pointer),
                    HeaderSource::Column(_) | HeaderSource::Other(_) => Vec::new(),
                };
                let rule = format!("{section}.headers[{i}]");
                let envelope = h.placement == Placement::Envelope;
                Some(Header { rule, name: h.name.clone(), envelope, source, tokens })
            })
            .collect();
        let redactions = t
            .redact
            .iter()
            .enumerate()
            .map(|(i, r)| Redaction {
                rule: format!("{section}.redact[{i}]"),
                tokens: tokens(&r.pointer),
                action: r.action,
                with: r.with.as_ref().map_or_else(|| "\"[redacted]\"".to_string(), Value::to_string),
            })
            .collect();
        let key = (!t.hash_key_file.is_empty()).then(|| HashKey(read_key(&t.hash_key_file)));
        let reads_payload =
            route.is_some() || headers.iter().any(|h| matches!(h.source, HeaderSource::Payload(_)));
        Transforms {
            outbox: if outbox.name.is_empty() { outbox.table.clone() } else { outbox.name.clone() },
            include_event: globs("include_event_types", &t.include_event_types),
            exclude_event: globs("exclude_event_types", &t.exclude_event_types),
            include_aggregate: globs("include_aggregate_types", &t.include_aggregate_types),
            exclude_aggregate: globs("exclude_aggregate_types", &t.exclude_aggregate_types),
            route,
            headers,
            redactions,
            key,
            reads_payload,
        }
    }

    /// Whether a payload field chooses the topic.
    pub(super) fn routes(&self) -> bool {
        self.route.is_some()
    }

    /// The rule that filters an event of these types out, if one does.
    pub(super) fn filtered(&self, event_type: &str, aggregate_type: &str) -> Option<PoisonReason> {
        let none = |globs: &Globs| format!("{} (matches none)", globs.setting);
        let rule = self
            .exclude_event
            .matching(event_type)
            .or_else(|| {
                let missed =
                    !self.include_event.globs.is_empty() && self.include_event.matching(event_type).is_none();
                missed.then(|| none(&self.include_event))
            })
            .or_else(|| self.exclude_aggregate.matching(aggregate_type))
            .or_else(|| {
                let missed = !self.include_aggregate.globs.is_empty()
                    && self.include_aggregate.matching(aggregate_type).is_none();
                missed.then(|| none(&self.include_aggregate))
            })?;
        Some(PoisonReason::Filtered { outbox: self.outbox.clone(), rule })
    }

    /// The route, the headers and the redacted payload of a row the filter kept; the outer
    /// error is an unreadable HMAC key (the relay stops: it is configuration).
    /// (`row_headers`: the row's own, which a rule's header may not repeat.)
    pub(super) fn shape(
        &self,
        columns: &Columns<'_>,
        row_headers: &[(String, String)],
    ) -> Result<Result<Shaped, PoisonReason>, RelayError> {
        let mut shaped = Shaped::default();
        let parsed = match self.reads_payload.then(|| serde_json::from_str::<Value>(columns.payload)) {
            None => None,
            Some(Ok(value)) => Some(value),
            Some(Err(e)) => {
                let rule = match &self.route {
                    Some(route) => &route.rule,
                    None => {
                        &self.headers.iter().find(|h| !h.tokens.is_empty()).expect("reads the payload").rule
                    }
                };
                return Ok(Err(self.refused(rule, "", format!("the payload is not JSON ({e})"))));
            }
        };
        if let (Some(route), Some(value)) = (&self.route, &parsed) {
            shaped.topic = match self.routed(route, value) {
                Ok(topic) => Some(topic),
                Err(reason) => return Ok(Err(reason)),
            };
        }
        for header in &self.headers {
            if header.envelope {
                match self.header(header, columns, parsed.as_ref()) {
                    Ok(value) => shaped.envelope.push((header.name.clone(), value)),
                    Err(reason) => return Ok(Err(reason)),
                }
                continue;
            }
            if row_headers.iter().any(|(name, _)| name.eq_ignore_ascii_case(&header.name)) {
                let detail = "the row's headers column sets this header too; rename one of them".to_string();
                return Ok(Err(self.refused(&header.rule, &format!("header {}", header.name), detail)));
            }
            match self.header(header, columns, parsed.as_ref()) {
                Ok(value) => shaped.headers.push((header.name.clone(), value)),
                Err(reason) => return Ok(Err(reason)),
            }
        }
        let mut payload: Option<String> = None;
        for redaction in &self.redactions {
            let action = match redaction.action {
                RedactAction::Replace => redact::Action::Replace(&redaction.with),
                RedactAction::Drop => redact::Action::Drop,
                RedactAction::Hash => match self.key.as_ref().map(|k| &k.0) {
                    Some(Ok(key)) => redact::Action::Hash(key),
                    Some(Err(e)) => {
                        return Err(RelayError::fatal(
                            FatalReason::Config,
                            format!("{}: {e}", redaction.rule),
                        ));
                    }
                    None => unreachable!("config validation: hash needs hash_key_file"),
                },
            };
            let text = payload.as_deref().unwrap_or(columns.payload);
            match redact::redact(text, &redaction.tokens, &action) {
                Ok(Some(redacted)) => payload = Some(redacted),
                Ok(None) => {}
                Err(stopped) => {
                    let detail =
                        format!("{} is {}, not an object or array", display(&stopped.at), stopped.found);
                    return Ok(Err(self.refused(
                        &redaction.rule,
                        &redact::pointer(&redaction.tokens),
                        detail,
                    )));
                }
            }
        }
        shaped.payload = payload;
        Ok(Ok(shaped))
    }

    fn routed(&self, route: &Route, value: &Value) -> Result<String, PoisonReason> {
        let field = match follow(value, &route.tokens) {
            Ok(Some(Value::String(s))) => s.clone(),
            Ok(Some(Value::Number(n))) => n.to_string(),
            Ok(Some(other)) => {
                let detail = format!("the field is {}, not a string or a number", kind(other));
                return Err(self.refused(&route.rule, &route.pointer, detail));
            }
            Ok(None) => {
                return Err(self.refused(&route.rule, &route.pointer, "the routing field is missing".into()));
            }
            Err((at, found)) => {
                let detail = format!("{} is {found}, not an object or array", display(&at));
                return Err(self.refused(&route.rule, &route.pointer, detail));
            }
        };
        Ok(format!("{}{field}{}", route.before, route.after))
    }

    fn header(
        &self,
        header: &Header,
        c: &Columns<'_>,
        parsed: Option<&Value>,
    ) -> Result<String, PoisonReason> {
        match &header.source {
            HeaderSource::Column(key) => {
                let value = match *key {
                    "id" => Some(c.id),
                    "aggregate_type" => Some(c.aggregate_type),
                    "aggregate_id" => Some(c.aggregate_id),
                    "event_type" => Some(c.event_type),
                    _ => c.topic,
                };
                let value = value.ok_or_else(|| {
                    self.refused(&header.rule, &format!("column {key}"), "the column is NULL".into())
                })?;
                Ok(if header.envelope { Value::from(value).to_string() } else { value.to_string() })
            }
            HeaderSource::Other(name) => {
                let at = format!("column {name}");
                let value = match c.others.iter().find(|(n, _)| n == name) {
                    Some((_, Some(value))) => value,
                    Some((_, None)) => {
                        return Err(self.refused(&header.rule, &at, "the column is NULL".into()));
                    }
                    None => {
                        let detail = "the event came without it (an outbox_emit() message carries the event columns \
                                      only; or the column is gone from the table)";
                        return Err(self.refused(&header.rule, &at, detail.into()));
                    }
                };
                Ok(if header.envelope { Value::from(value.as_str()).to_string() } else { value.clone() })
            }
            HeaderSource::Payload(pointer) => {
                let value = parsed.expect("the payload was read for this header");
                match follow(value, &header.tokens) {
                    Ok(Some(Value::String(s))) if !header.envelope => Ok(s.clone()),
                    Ok(Some(other)) => Ok(other.to_string()),
                    Ok(None) => Err(self.refused(&header.rule, pointer, "the field is missing".into())),
                    Err((at, found)) => {
                        let detail = format!("{} is {found}, not an object or array", display(&at));
                        Err(self.refused(&header.rule, pointer, detail))
                    }
                }
            }
        }
    }

    fn refused(&self, rule: &str, path: &str, detail: String) -> PoisonReason {
        PoisonReason::Transform {
            outbox: self.outbox.clone(),
            rule: rule.to_string(),
            path: display(path),
            detail,
        }
    }
}

/// A pointer as a reason shows it (`/` for the whole payload).
fn display(pointer: &str) -> String {
    if pointer.is_empty() { "the payload".into() } else { pointer.to_string() }
}

/// The value at `tokens`: `Ok(None)` when a member or element is not there (or a value on the
/// way is null), `Err((where, what))` when the way goes through a string, number or boolean.
fn follow<'v>(value: &'v Value, tokens: &[String]) -> Result<Option<&'v Value>, (String, &'static str)> {
    let mut at = value;
    for (depth, token) in tokens.iter().enumerate() {
        at = match at {
            Value::Object(map) => match map.get(token) {
                Some(next) => next,
                None => return Ok(None),
            },
            Value::Array(items) => match token.parse::<usize>().ok().and_then(|i| items.get(i)) {
                Some(next) => next,
                None => return Ok(None),
            },
            Value::Null => return Ok(None),
            other => return Err((redact::pointer(&tokens[..depth]), kind(other))),
        };
    }
    Ok(Some(at))
}

fn kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// The key in `path`, without trailing whitespace (as `openssl rand -hex 32 > key` writes it).
fn read_key(path: &str) -> Result<hmac::Key, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("cannot read the HMAC key file {path}: {e}"))?;
    let held = bytes.iter().rposition(|b| !b.is_ascii_whitespace()).map_or(0, |i| i + 1);
    Ok(hmac::Key::new(hmac::HMAC_SHA256, &bytes[..held]))
}

#[cfg(test)]
mod tests;
