//! The outboxes a configuration names: `[outbox]` (one table) or `[[outboxes]]` (several), each
//! with its topic routing and record format, refused naming the setting when contradictory.

use super::*;

#[test]
fn row_topics_are_off_and_the_allowlist_empty_by_default() {
    let cfg = load(MINIMAL, &[]).unwrap();
    assert!(!cfg.outbox.row_topics);
    assert!(cfg.outbox.allowed_topics.is_empty());
    let cfg = load(
        &format!(
            "{MINIMAL}[outbox]\nrow_topics = true\nallowed_topics = [\"billing\", \"outbox.event.*\"]\n"
        ),
        &[],
    )
    .unwrap();
    assert_eq!(cfg.outbox.allowed_topics, ["billing", "outbox.event.*"]);
    let env = [("OUTBOX_RELAY__OUTBOX__ALLOWED_TOPICS", "outbox.event.*,audit")];
    assert_eq!(load(MINIMAL, &env).unwrap().outbox.allowed_topics, ["outbox.event.*", "audit"]);
}

#[test]
fn contradictory_topic_routing_is_refused_naming_the_setting() {
    for (outbox, path) in [
        ("row_topics = true\n", "outbox.row_topics: needs outbox.allowed_topics"),
        (
            "row_topics = true\nallowed_topics = [\"outbox.event.*\"]\ncolumns = { topic = \"\" }\n",
            "outbox.row_topics: needs outbox.columns.topic",
        ),
        ("allowed_topics = [\"bad topic\"]\n", "outbox.allowed_topics[0]: \"bad topic\" is neither"),
        ("allowed_topics = [\"a*b*\"]\n", "outbox.allowed_topics[0]:"),
        ("allowed_topics = [\"\"]\n", "outbox.allowed_topics[0]:"),
        ("allowed_topics = [\"billing\"]\n", "outbox.allowed_topics: allows no topic outbox.topic_template"),
        (
            "topic_template = \"events\"\nallowed_topics = [\"events.*\"]\n",
            "outbox.allowed_topics: allows no topic",
        ),
    ] {
        let err = load(&format!("{MINIMAL}[outbox]\n{outbox}"), &[]).unwrap_err().to_string();
        assert!(err.starts_with(path), "{outbox}: {err}");
    }
    // what the template can render is enough
    for allowed in ["\"outbox.*\"", "\"outbox.event.order\"", "\"outbox.event.order*\"", "\"*\""] {
        let toml = format!("{MINIMAL}[outbox]\nallowed_topics = [{allowed}]\n");
        assert!(load(&toml, &[]).is_ok(), "{allowed}");
    }
}

const TWO_OUTBOXES: &str = "[[outboxes]]\nname = \"orders\"\n\n[[outboxes]]\nname = \"ledger\"\ntable = \"ledger_outbox\"\n\
    topic_template = \"ledger.{event_type}\"\n[outboxes.dead_letter]\ntable = \"ledger_dead\"\non_poison = \"block\"\n";

#[test]
fn the_single_table_form_is_one_outbox_named_after_its_table() {
    let cfg = load(&format!("{MINIMAL}[outbox]\ntable = \"events\"\n"), &[]).unwrap();
    let outboxes = cfg.outboxes();
    assert_eq!(outboxes.len(), 1);
    assert_eq!((outboxes[0].name.as_str(), outboxes[0].path.as_str()), ("events", "outbox"));
    assert_eq!(outboxes[0].config, cfg.outbox);
    assert_eq!(outboxes[0].dead_letter, cfg.dead_letter);
}

#[test]
fn listed_outboxes_keep_their_order_names_and_dead_letter_settings() {
    let cfg = load(&format!("{MINIMAL}[dead_letter]\ntable = \"ops.dead\"\n{TWO_OUTBOXES}"), &[]).unwrap();
    let outboxes = cfg.outboxes();
    let names: Vec<_> = outboxes.iter().map(|o| (o.name.as_str(), o.path.as_str())).collect();
    assert_eq!(names, [("orders", "outboxes[0]"), ("ledger", "outboxes[1]")]);
    assert_eq!(outboxes[0].config.table, "outbox_events");
    // the shared [dead_letter] unless the entry has its own
    assert_eq!(outboxes[0].dead_letter.schema_and_table(), ("ops", "dead"));
    assert_eq!(outboxes[1].dead_letter.schema_and_table(), ("public", "ledger_dead"));
    assert_eq!(outboxes[1].dead_letter.on_poison, OnPoison::Block);
    assert_eq!(outboxes[1].config.topic_template, "ledger.{event_type}");
}

#[test]
fn an_outbox_listed_twice_or_misconfigured_is_refused_naming_the_entry() {
    let same_name =
        format!("{MINIMAL}[[outboxes]]\nname = \"a\"\n[[outboxes]]\nname = \"a\"\ntable = \"t2\"\n");
    let err = load(&same_name, &[]).unwrap_err().to_string();
    assert!(err.starts_with("outboxes[1].name: \"a\" is the name of outboxes[0] too"), "{err}");
    let same_table = format!("{MINIMAL}[[outboxes]]\nname = \"a\"\n[[outboxes]]\nname = \"b\"\n");
    let err = load(&same_table, &[]).unwrap_err().to_string();
    assert!(
        err.starts_with("outboxes[1].table: public.outbox_events is listed twice (as \"a\" in outboxes[0]"),
        "{err}"
    );
    let bad_name = format!("{MINIMAL}[[outboxes]]\nname = \"has space\"\n");
    let err = load(&bad_name, &[]).unwrap_err().to_string();
    assert!(err.starts_with("outboxes[0].name: \"has space\" is not an outbox name"), "{err}");
    let bad_template = format!("{MINIMAL}{TWO_OUTBOXES}").replace("ledger.{event_type}", "ledger.{type}");
    let err = load(&bad_template, &[]).unwrap_err().to_string();
    assert!(err.starts_with("outboxes[1].topic_template: unknown placeholder {type}"), "{err}");
    let bad_dead_letter = format!("{MINIMAL}{TWO_OUTBOXES}").replace("\"ledger_dead\"", "\"a.b.c\"");
    let err = load(&bad_dead_letter, &[]).unwrap_err().to_string();
    assert!(err.starts_with("outboxes[1].dead_letter.table: \"a.b.c\" is not schema.table"), "{err}");
    let both = format!("{MINIMAL}[outbox]\ntable = \"x\"\n{TWO_OUTBOXES}");
    let err = load(&both, &[]).unwrap_err().to_string();
    assert!(
        err.starts_with("outbox: set either [outbox] (one table) or [[outboxes]] (several), not both"),
        "{err}"
    );
    // the single-table form's paths stay as they were
    let err = load(&format!("{MINIMAL}[outbox]\ntable = \"\"\n"), &[]).unwrap_err().to_string();
    assert!(err.starts_with("outbox.table: must not be empty"), "{err}");
}

#[test]
fn one_listed_outbox_is_the_single_table_form_in_another_spelling() {
    let one = format!("{MINIMAL}[source]\nmode = \"polling\"\n[[outboxes]]\nname = \"orders\"\n");
    assert_eq!(load(&one, &[]).unwrap().outboxes()[0].name, "orders");
}

#[test]
fn record_formats_are_validated_naming_the_setting() {
    let ce = |extra: &str| {
        load(&format!("{MINIMAL}[outbox]\nformat = \"cloudevents\"\n[outbox.cloudevents]\n{extra}"), &[])
    };
    let err = ce("").unwrap_err().to_string();
    assert!(err.starts_with("outbox.cloudevents.source: must not be empty"), "{err}");
    let err = ce("source = \"/x\"\ntype = \"{kind}\"\n").unwrap_err().to_string();
    assert!(err.starts_with("outbox.cloudevents.type: unknown placeholder {kind}"), "{err}");
    let err = ce("source = \"/x\"\nmode = \"structured\"\ndata_content_type = \"text/plain\"\n")
        .unwrap_err()
        .to_string();
    assert!(err.starts_with("outbox.cloudevents.data_content_type: \"text/plain\" is not JSON"), "{err}");
    let config = ce("source = \"/orders/{aggregate_type}\"\nmode = \"structured\"\n").unwrap();
    assert_eq!(config.outbox.cloudevents.mode, CloudEventsMode::Structured);
    let toml =
        format!("{MINIMAL}[outbox]\nformat = \"debezium\"\n[outbox.debezium]\nexpand_json_payload = true\n");
    let err = load(&toml, &[]).unwrap_err().to_string();
    assert!(
        err.starts_with("outbox.debezium.expand_json_payload: needs value_converter = \"json\""),
        "{err}"
    );
    let err = load(&format!("{MINIMAL}[outbox]\nformat = \"avro\"\n"), &[]).unwrap_err().to_string();
    assert_eq!(
        err,
        "outbox.format: \"avro\" is not a valid value; it must be one of `raw`, `cloudevents`, `debezium`"
    );
}
