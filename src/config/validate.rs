//! Checking a loaded configuration: deprecated settings moved to their new place, then every
//! section validated.
//!
//! Invariants:
//! - every error names the offending path (`kafka.brokers: must not be empty`) and says what
//!   would be valid;
//! - a deprecated setting and its replacement set to different values is an error, never a
//!   silent choice.

use super::*;

impl RelayConfig {
    /// Moves settings from their old place to their new one, leaving a warning in
    /// [`RelayConfig::deprecations`]. Both places set to different values is an error.
    pub(super) fn move_deprecated(&mut self) -> Result<(), ConfigError> {
        let defaults = DeadLetterConfig::default();
        if let Some(on_poison) = self.polling.on_poison.take() {
            if self.dead_letter.on_poison != defaults.on_poison && self.dead_letter.on_poison != on_poison {
                return Err(ConfigError::invalid(
                    "polling.on_poison",
                    "deprecated and in conflict with dead_letter.on_poison; remove polling.on_poison",
                ));
            }
            self.dead_letter.on_poison = on_poison;
            self.deprecations
                .push("polling.on_poison is deprecated: set dead_letter.on_poison instead".into());
        }
        if let Some(table) = self.polling.dead_letter_table.take() {
            let table = if table.contains('.') { table } else { format!("public.{table}") };
            if self.dead_letter.table != defaults.table && self.dead_letter.table != table {
                return Err(ConfigError::invalid(
                    "polling.dead_letter_table",
                    "deprecated and in conflict with dead_letter.table; remove polling.dead_letter_table",
                ));
            }
            self.dead_letter.table = table;
            self.deprecations.push(
                "polling.dead_letter_table is deprecated: set dead_letter.table (schema.table) instead"
                    .into(),
            );
        }
        Ok(())
    }

    /// Checks what types alone cannot. Each error names the path to fix.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.kafka.validate()?;
        self.postgres.validate()?;
        self.validate_outboxes()?;
        self.validate_polling()?;
        self.validate_replication()?;
        self.validate_dedup()?;
        self.validate_metrics()?;
        self.admin.validate()?;
        self.tracing.resolve(|name| std::env::var(name).ok())?;
        for outbox in self.outboxes() {
            validate_signing_key("dead_letter.signing_key_file", &outbox.dead_letter.signing_key_file)?;
        }
        let messages = &self.replication.message_signing_key_file;
        validate_signing_key("replication.message_signing_key_file", messages)?;
        if self.retry.initial_backoff_ms == 0 {
            return Err(ConfigError::invalid("retry.initial_backoff_ms", "must be > 0"));
        }
        if self.retry.max_backoff_ms < self.retry.initial_backoff_ms {
            return Err(ConfigError::invalid("retry.max_backoff_ms", "must be >= retry.initial_backoff_ms"));
        }
        Ok(())
    }

    fn validate_replication(&self) -> Result<(), ConfigError> {
        let r = &self.replication;
        for (path, name) in [("replication.slot", &r.slot), ("replication.publication", &r.publication)] {
            let ok = !name.is_empty()
                && name.len() <= 63
                && name.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
            if !ok {
                return Err(ConfigError::invalid(path, "must be 1-63 characters of a-z, 0-9 and _"));
            }
        }
        if !(100..=60_000).contains(&r.status_interval_ms) {
            return Err(ConfigError::invalid(
                "replication.status_interval_ms",
                "must be between 100 and 60000",
            ));
        }
        if r.message_prefix.is_empty() {
            return Err(ConfigError::invalid("replication.message_prefix", "must not be empty"));
        }
        if !(1..=1_000_000).contains(&r.max_in_flight_events) {
            return Err(ConfigError::invalid(
                "replication.max_in_flight_events",
                "must be between 1 and 1000000",
            ));
        }
        if !((1 << 20)..=(4 << 30)).contains(&r.max_in_flight_bytes) {
            return Err(ConfigError::invalid(
                "replication.max_in_flight_bytes",
                "must be between 1048576 (1 MiB) and 4294967296 (4 GiB)",
            ));
        }
        if !((1 << 20)..=(1 << 30)).contains(&r.max_message_bytes) {
            return Err(ConfigError::invalid(
                "replication.max_message_bytes",
                "must be between 1048576 (1 MiB) and 1073741824 (1 GiB)",
            ));
        }
        Ok(())
    }

    fn validate_dedup(&self) -> Result<(), ConfigError> {
        let d = &self.dedup;
        if d.enabled && !self.kafka.source_headers {
            return Err(ConfigError::invalid(
                "dedup.enabled",
                "needs kafka.source_headers = true (the relay recognises its own records by them); \
                 set dedup.enabled = false as well, or keep the headers",
            ));
        }
        if d.max_scan_records == 0 {
            return Err(ConfigError::invalid("dedup.max_scan_records", "must be > 0"));
        }
        if !(1_000..=3_600_000).contains(&d.scan_timeout_ms) {
            return Err(ConfigError::invalid("dedup.scan_timeout_ms", "must be between 1000 and 3600000"));
        }
        Ok(())
    }

    fn validate_metrics(&self) -> Result<(), ConfigError> {
        let m = &self.metrics;
        if !m.listen.is_empty() && m.listen.parse::<std::net::SocketAddr>().is_err() {
            return Err(ConfigError::invalid("metrics.listen", format!("\"{}\" is not ip:port", m.listen)));
        }
        if !(1..=3600).contains(&m.sample_interval_secs) {
            return Err(ConfigError::invalid("metrics.sample_interval_secs", "must be between 1 and 3600"));
        }
        if m.slot_lag_warning_bytes > m.slot_lag_critical_bytes {
            return Err(ConfigError::invalid(
                "metrics.slot_lag_warning_bytes",
                "must be <= metrics.slot_lag_critical_bytes",
            ));
        }
        Ok(())
    }

    /// Every outbox: its own settings, then that no name or table is listed twice.
    fn validate_outboxes(&self) -> Result<(), ConfigError> {
        if !self.outboxes.is_empty() && self.outbox != OutboxConfig::default() {
            return Err(ConfigError::invalid(
                "outbox",
                "set either [outbox] (one table) or [[outboxes]] (several), not both: move the [outbox] \
                 settings (and any OUTBOX_RELAY__OUTBOX__* variable) into an [[outboxes]] entry",
            ));
        }
        let outboxes = self.outboxes();
        for (i, outbox) in outboxes.iter().enumerate() {
            validate_outbox(outbox)?;
            let earlier = &outboxes[..i];
            if let Some(first) = earlier.iter().find(|o| o.name == outbox.name) {
                return Err(ConfigError::invalid(
                    format!("{}.name", outbox.path),
                    format!(
                        "\"{}\" is the name of {} too: each outbox needs its own name",
                        outbox.name, first.path
                    ),
                ));
            }
            if let Some(first) = earlier.iter().find(|o| {
                (&o.config.schema, &o.config.table) == (&outbox.config.schema, &outbox.config.table)
            }) {
                return Err(ConfigError::invalid(
                    format!("{}.table", outbox.path),
                    format!(
                        "{}.{} is listed twice (as \"{}\" in {} too): list each outbox table once",
                        outbox.config.schema, outbox.config.table, first.name, first.path
                    ),
                ));
            }
        }
        Ok(())
    }

    fn validate_polling(&self) -> Result<(), ConfigError> {
        let p = &self.polling;
        if !(1..=100_000).contains(&p.batch_size) {
            return Err(ConfigError::invalid("polling.batch_size", "must be between 1 and 100000"));
        }
        if p.poll_interval_ms == 0 {
            return Err(ConfigError::invalid("polling.poll_interval_ms", "must be > 0"));
        }
        if !(100..=600_000).contains(&p.claim_timeout_ms) {
            return Err(ConfigError::invalid("polling.claim_timeout_ms", "must be between 100 and 600000"));
        }
        if !((64 << 10)..=(1 << 30)).contains(&p.max_batch_bytes) {
            return Err(ConfigError::invalid(
                "polling.max_batch_bytes",
                "must be between 65536 (64 KiB) and 1073741824 (1 GiB)",
            ));
        }
        if !((1 << 20)..=(1 << 30)).contains(&p.max_row_bytes) {
            return Err(ConfigError::invalid(
                "polling.max_row_bytes",
                "must be between 1048576 (1 MiB) and 1073741824 (1 GiB)",
            ));
        }
        if p.after_publish == AfterPublish::Mark && p.published_at_column.is_empty() {
            return Err(ConfigError::invalid(
                "polling.published_at_column",
                "must not be empty when polling.after_publish = \"mark\"",
            ));
        }
        Ok(())
    }
}

/// A key file (`setting`), when set: readable, and long enough.
fn validate_signing_key(setting: &str, path: &str) -> Result<(), ConfigError> {
    if path.is_empty() {
        return Ok(());
    }
    let bytes =
        std::fs::read(path).map_err(|e| ConfigError::invalid(setting, format!("cannot read {path}: {e}")))?;
    let held = bytes.iter().rposition(|b| !b.is_ascii_whitespace()).map_or(0, |i| i + 1);
    if held < super::MIN_SIGNING_KEY_BYTES {
        return Err(ConfigError::invalid(
            setting,
            format!(
                "{path} holds {held} bytes; a key needs at least {} (e.g. openssl rand -hex 32 > {path})",
                super::MIN_SIGNING_KEY_BYTES
            ),
        ));
    }
    Ok(())
}

/// One outbox's settings; errors name them under its path (`outbox.table`, `outboxes[1].table`).
fn validate_outbox(outbox: &OutboxEntry) -> Result<(), ConfigError> {
    let (o, path) = (&outbox.config, &outbox.path);
    if o.schema.is_empty() {
        return Err(ConfigError::invalid(format!("{path}.schema"), "must not be empty"));
    }
    if o.table.is_empty() {
        return Err(ConfigError::invalid(format!("{path}.table"), "must not be empty"));
    }
    let name_valid = !outbox.name.is_empty()
        && outbox.name.len() <= 63
        && outbox.name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'));
    if !name_valid {
        return Err(ConfigError::invalid(
            format!("{path}.name"),
            format!(
                "\"{}\" is not an outbox name: 1 to 63 of a-z, A-Z, 0-9, '_', '-' and '.' (it is a metric label); \
                 set {path}.name",
                outbox.name
            ),
        ));
    }
    for (key, name) in o.columns.required() {
        if name.is_empty() {
            return Err(ConfigError::invalid(
                format!("{path}.columns.{key}"),
                "must not be empty: the column is required",
            ));
        }
    }
    validate_topic_template(path, &o.topic_template)?;
    validate_topic_routing(path, o)?;
    match o.format {
        RecordFormat::Raw => {}
        RecordFormat::Cloudevents => o.cloudevents.validate(path)?,
        RecordFormat::Debezium => o.debezium.validate(path)?,
    }
    if let Some(registry) = &o.registry {
        validate_registry(path, o, registry)?;
    }
    super::transforms::validate(path, o)?;
    validate_signing_key(&format!("{path}.transforms.hash_key_file"), &o.transforms.hash_key_file)?;
    let dead_letter_path =
        if o.dead_letter.is_some() { format!("{path}.dead_letter") } else { "dead_letter".into() };
    let (schema, table) = outbox.dead_letter.schema_and_table();
    if schema.is_empty() || table.is_empty() || table.contains('.') {
        return Err(ConfigError::invalid(
            format!("{dead_letter_path}.table"),
            format!("\"{}\" is not schema.table or table", outbox.dead_letter.table),
        ));
    }
    Ok(())
}

/// `[outbox.registry]`: its own settings and a format whose value is the
/// payload (a structured CloudEvent or a Debezium record embeds it as JSON text).
fn validate_registry(
    path: &str,
    o: &OutboxConfig,
    registry: &super::registry::RegistryConfig,
) -> Result<(), ConfigError> {
    let section = format!("{path}.registry");
    registry.validate(&section).map_err(|message| split_path(&section, message))?;
    let embeds = match o.format {
        RecordFormat::Raw => false,
        RecordFormat::Cloudevents => o.cloudevents.mode == CloudEventsMode::Structured,
        RecordFormat::Debezium => true,
    };
    if embeds {
        return Err(ConfigError::invalid(
            &section,
            format!(
                "cannot encode the values of {path}.format = {:?}{}: it embeds the payload as JSON; use \
                 format = \"raw\" or cloudevents mode = \"binary\"",
                format!("{:?}", o.format).to_lowercase(),
                if o.format == RecordFormat::Cloudevents { " (structured mode)" } else { "" }
            ),
        ));
    }
    let json = o.cloudevents.data_content_type == "application/json"
        || o.cloudevents.data_content_type.ends_with("+json");
    if o.format == RecordFormat::Cloudevents
        && json
        && registry.schema_type != super::registry::SchemaType::Json
    {
        return Err(ConfigError::invalid(
            format!("{path}.cloudevents.data_content_type"),
            format!(
                "\"{}\" says the value is JSON, but {section} encodes it as {:?} in the Confluent wire format; set \
                 it to the encoding's media type, e.g. \"application/avro\" or \"application/protobuf\"",
                o.cloudevents.data_content_type, registry.schema_type
            ),
        ));
    }
    // the schema file parses: `record::registry::check`, which the commands run after loading
    Ok(())
}

/// A message `validate` wrote as `path.key: text` as a [`ConfigError`] of that path.
fn split_path(section: &str, message: String) -> ConfigError {
    match message.split_once(": ") {
        Some((path, text)) if path.starts_with(section) => ConfigError::invalid(path, text),
        _ => ConfigError::invalid(section, message),
    }
}

/// `outbox.allowed_topics` entries are topic names or prefixes ending in `*`; `row_topics`
/// needs a topic column and a list; a set list must leave the template some topic.
fn validate_topic_routing(path: &str, o: &OutboxConfig) -> Result<(), ConfigError> {
    validate_allowed_topics(path, &o.allowed_topics)?;
    if o.row_topics && o.columns.topic.is_empty() {
        return Err(ConfigError::invalid(
            format!("{path}.row_topics"),
            format!(
                "needs {path}.columns.topic, which is \"\" (no topic column); name the column, or set \
                 {path}.row_topics = false"
            ),
        ));
    }
    if o.row_topics && o.allowed_topics.is_empty() {
        return Err(ConfigError::invalid(
            format!("{path}.row_topics"),
            format!(
                "needs {path}.allowed_topics, the topics a row may name (e.g. [\"billing\", \"audit.*\"]); \
                 without it every row naming a topic would be dead-lettered"
            ),
        ));
    }
    if !o.allowed_topics.is_empty() && !allows_template(&o.allowed_topics, &o.topic_template) {
        let start = o.topic_template.split('{').next().unwrap_or_default();
        return Err(ConfigError::invalid(
            format!("{path}.allowed_topics"),
            format!(
                "allows no topic {path}.topic_template (\"{}\") renders, so every event would be \
                 dead-lettered; add the template's topics (e.g. \"{start}*\")",
                o.topic_template
            ),
        ));
    }
    Ok(())
}

/// Each `allowed_topics` entry is a topic name, or a prefix ending in `*` (`*` alone: any).
fn validate_allowed_topics(path: &str, allowed_topics: &[String]) -> Result<(), ConfigError> {
    for (i, entry) in allowed_topics.iter().enumerate() {
        let name = entry.strip_suffix('*').unwrap_or(entry);
        let valid = name.len() <= 249
            && (!name.is_empty() || entry == "*")
            && name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
        if !valid {
            return Err(ConfigError::invalid(
                format!("{path}.allowed_topics[{i}]"),
                format!(
                    "\"{entry}\" is neither a topic name nor a prefix ending in * (a-z, A-Z, 0-9, '.', '_' \
                     and '-', at most 249, and * only at the end)"
                ),
            ));
        }
    }
    Ok(())
}

/// Whether an entry of `allowed` can match a topic `template` renders: the template's fixed
/// start (up to its first placeholder) must be able to match the entry.
fn allows_template(allowed: &[String], template: &str) -> bool {
    let start = template.split('{').next().unwrap_or_default();
    let whole = !template.contains('{');
    allowed.iter().any(|entry| match entry.strip_suffix('*') {
        Some(prefix) => start.starts_with(prefix) || (!whole && prefix.starts_with(start)),
        None => {
            if whole {
                entry == start
            } else {
                entry.starts_with(start)
            }
        }
    })
}

fn validate_topic_template(path: &str, template: &str) -> Result<(), ConfigError> {
    let path = format!("{path}.topic_template");
    if template.is_empty() {
        return Err(ConfigError::invalid(&path, "must not be empty"));
    }
    let mut rest = template;
    while let Some(open) = rest.find('{') {
        let Some(close) = rest[open..].find('}') else {
            return Err(ConfigError::invalid(&path, "has a '{' without a closing '}'"));
        };
        let name = &rest[open + 1..open + close];
        if !TOPIC_PLACEHOLDERS.contains(&name) {
            return Err(ConfigError::invalid(
                &path,
                format!("unknown placeholder {{{name}}}; use {{aggregate_type}} or {{event_type}}"),
            ));
        }
        rest = &rest[open + close + 1..];
    }
    Ok(())
}
