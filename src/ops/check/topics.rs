//! `kafka.topics`: the topics the outbox routes to, from the most recent rows (the template over
//! their aggregate and event types, or their own `topic` column), against the topics the
//! brokers know (rows the outbox's transforms filter out left aside; an outbox routed by a payload
//! field is not sampled: its topics are in the payloads). The relay does not create topics; a missing one is a WARN (a broker may create
//! topics on first use), with the `kafka-topics.sh` line that creates it.

use std::collections::{BTreeMap, BTreeSet};

use tokio_postgres::Client;

use super::Finding;
use crate::outboxes::Outbox;

/// How many of the newest rows are sampled for their topics.
const SAMPLE_ROWS: i64 = 10_000;

pub(super) async fn finding(outbox: &Outbox, client: &Client, known: &BTreeSet<String>) -> Finding {
    if outbox.mapping.routes_by_payload() {
        let t = &outbox.config.transforms;
        return Finding::ok(
            "kafka.topics",
            format!(
                "events go to the topics a payload field chooses ({}.transforms.route_by_field = \"{}\", route_topic \
                 \"{}\"), within allowed_topics ({}): not sampled; create them ahead (the relay does not create \
                 topics)",
                outbox.path,
                t.route_by_field,
                if t.route_topic.is_empty() { "{value}" } else { &t.route_topic },
                outbox.config.allowed_topics.join(", ")
            ),
        );
    }
    let routed = match routed_topics(outbox, client).await {
        Ok(routed) => routed,
        Err(e) if e.code() == Some(&tokio_postgres::error::SqlState::UNDEFINED_TABLE) => {
            return Finding::warn(
                "kafka.topics",
                format!(
                    "cannot list the topics the outbox routes to: table {} does not exist (outbox.table)",
                    outbox.table.display_name()
                ),
                "apply the migrations in sql/ first, then run check again",
            );
        }
        Err(e) => {
            return Finding::warn(
                "kafka.topics",
                format!(
                    "cannot read the outbox's recent rows to list their topics: {}",
                    crate::error::describe_pg(&e)
                ),
                "grant the relay role SELECT on the outbox table",
            );
        }
    };
    let template = &outbox.config.topic_template;
    if routed.is_empty() && !template.contains('{') && !known.contains(template) {
        // a fixed topic: every event goes there, whether or not a row exists yet
        return Finding::warn(
            "kafka.topics",
            format!("topic {template} (outbox.topic_template: every event goes there) does not exist"),
            create_fix(template),
        );
    }
    if routed.is_empty() {
        return Finding::ok(
            "kafka.topics",
            format!(
                "no rows in the outbox to list topics from; events go to {} (the relay does not create topics)",
                outbox.config.topic_template
            ),
        );
    }
    let missing: Vec<(&String, &u64)> = routed.iter().filter(|(topic, _)| !known.contains(*topic)).collect();
    if missing.is_empty() {
        let names: Vec<&str> = routed.keys().map(String::as_str).collect();
        return Finding::ok(
            "kafka.topics",
            format!("every topic the outbox routes to exists: {}", names.join(", ")),
        );
    }
    let described: Vec<String> =
        missing.iter().map(|(topic, rows)| format!("{topic} ({rows} of the newest rows)")).collect();
    let first = missing[0].0;
    Finding::warn(
        "kafka.topics",
        format!("topics the outbox routes to do not exist: {}", described.join(", ")),
        create_fix(first),
    )
}

/// The fix for missing topics, `first` the one named in the example.
fn create_fix(first: &str) -> String {
    format!(
        "create them (e.g. kafka-topics.sh --create --topic {first} --partitions N --replication-factor 3); \
         unless the broker creates topics on first use, their events wait, then are dead-lettered (or held, \
         on_poison = block)"
    )
}

/// The topics of the newest rows, with how many of them go to each.
async fn routed_topics(
    outbox: &Outbox,
    client: &Client,
) -> Result<BTreeMap<String, u64>, tokio_postgres::Error> {
    let (sql, mapping) = (outbox.table.topic_sample_sql(SAMPLE_ROWS), &outbox.mapping);
    let mut routed = BTreeMap::new();
    for row in client.query(&sql, &[]).await? {
        let (aggregate_type, event_type, topic): (Option<String>, Option<String>, Option<String>) =
            (row.get("aggregate_type"), row.get("event_type"), row.get("topic"));
        let (aggregate, event) =
            (aggregate_type.as_deref().unwrap_or_default(), event_type.as_deref().unwrap_or_default());
        if mapping.filters_out(aggregate, event) {
            // (never published: no topic is owed them)
            continue;
        }
        let topic = mapping.topic_for(
            aggregate_type.as_deref().unwrap_or_default(),
            event_type.as_deref().unwrap_or_default(),
            topic.as_deref(),
        );
        *routed.entry(topic).or_insert(0) += row.get::<_, i64>("rows") as u64;
    }
    Ok(routed)
}
