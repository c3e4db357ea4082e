//! `[outbox.transforms]`: every refusal names the outbox and the rule.

use super::*;

fn refused(outbox: &str) -> String {
    load(&format!("{MINIMAL}{outbox}"), &[]).unwrap_err().to_string()
}

#[test]
fn a_full_set_of_transforms_loads() {
    let key = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(key.path(), "0123456789abcdef0123456789abcdef\n").unwrap();
    let cfg = load(
        &format!(
            "{MINIMAL}[outbox]\nallowed_topics = [\"outbox.event.*\", \"region.*\"]\n[outbox.transforms]\n\
             exclude_event_types = [\"*.internal\"]\ninclude_aggregate_types = \"order, invoice\"\n\
             route_by_field = \"/region\"\nroute_topic = \"region.{{value}}\"\nhash_key_file = \"{}\"\n\
             [[outbox.transforms.headers]]\nfrom = \"column:aggregate_id\"\nname = \"key\"\n\
             [[outbox.transforms.headers]]\nfrom = \"payload:/tenant\"\nname = \"tenant\"\n\
             [[outbox.transforms.redact]]\npointer = \"/card/number\"\naction = \"hash\"\n\
             [[outbox.transforms.redact]]\npointer = \"/email\"\naction = \"replace\"\nwith = \"x\"\n",
            key.path().display()
        ),
        &[],
    )
    .unwrap();
    let t = &cfg.outbox.transforms;
    assert_eq!(t.include_aggregate_types, ["order", "invoice"]);
    assert_eq!(t.redact[0].action, RedactAction::Hash);
    assert_eq!(t.redact[1].with, Some(serde_json::json!("x")));
    assert!(t.reads_payload());
}

#[test]
fn errors_name_the_outbox_and_the_rule() {
    let cases: &[(&str, &str)] = &[
        (
            "[[outboxes]]\nname = \"a\"\n[[outboxes]]\nname = \"b\"\ntable = \"b\"\n[outboxes.transforms]\n\
             exclude_event_types = [\"x\", \"\"]\n",
            "outboxes[1].transforms.exclude_event_types[1]: is empty",
        ),
        (
            "[outbox.transforms]\nroute_by_field = \"/region\"\n",
            "outbox.transforms.route_by_field: needs the outbox's allowed_topics",
        ),
        (
            "[outbox.transforms]\nroute_by_field = \"region\"\n",
            "outbox.transforms.route_by_field: \"region\" is not a JSON pointer",
        ),
        (
            "[outbox]\nallowed_topics = \"*\"\n[outbox.transforms]\nroute_by_field = \"/r\"\nroute_topic = \"r.{x}\"\n",
            "outbox.transforms.route_topic: \"r.{x}\" must hold {value}",
        ),
        (
            "[outbox.transforms]\nroute_topic = \"r.{value}\"\n",
            "outbox.transforms.route_topic: is set without outbox.transforms.route_by_field",
        ),
        (
            "[[outbox.transforms.headers]]\nfrom = \"tenant\"\nname = \"t\"\n",
            "outbox.transforms.headers[0].from: \"tenant\" is neither column:<",
        ),
        (
            "[[outbox.transforms.headers]]\nfrom = \"column:payload\"\nname = \"t\"\n",
            "outbox.transforms.headers[0].from: \"payload\" is the payload, headers or created_at column",
        ),
        (
            "[[outbox.transforms.headers]]\nfrom = \"column:a_column_name_longer_than_fifty_bytes_is_refused_here\"\nname = \"t\"\n",
            "outbox.transforms.headers[0].from: column names of up to 50 bytes only",
        ),
        (
            "[[outbox.transforms.headers]]\nfrom = \"column:event_type\"\nname = \"ID\"\n",
            "outbox.transforms.headers[0].name: \"ID\" is reserved for the relay",
        ),
        (
            "[[outbox.transforms.headers]]\nfrom = \"column:id\"\nname = \"a\"\n\
             [[outbox.transforms.headers]]\nfrom = \"payload:/x\"\nname = \"A\"\n",
            "outbox.transforms.headers[1].name: \"A\" is the name of outbox.transforms.headers[0] too",
        ),
        (
            "[[outbox.transforms.redact]]\npointer = \"\"\naction = \"drop\"\n",
            "outbox.transforms.redact[0].pointer: \"\" is not a JSON pointer to a payload field",
        ),
        (
            "[[outbox.transforms.redact]]\npointer = \"/pan\"\naction = \"hash\"\n",
            "outbox.transforms.redact[0].action: \"hash\" needs outbox.transforms.hash_key_file",
        ),
        (
            "[[outbox.transforms.redact]]\npointer = \"/pan\"\naction = \"drop\"\nwith = 1\n",
            "outbox.transforms.redact[0].with: is only for action = \"replace\"",
        ),
        (
            "[[outbox.transforms.headers]]\nfrom = \"payload:/customer/email\"\nname = \"email\"\n\
             [[outbox.transforms.redact]]\npointer = \"/customer\"\naction = \"drop\"\n",
            "outbox.transforms.redact[0]: redacts /customer, which outbox.transforms.headers[0] reads",
        ),
        (
            "[[outbox.transforms.headers]]\nfrom = \"payload:/customer\"\nname = \"customer\"\n\
             [[outbox.transforms.redact]]\npointer = \"/customer/email\"\naction = \"drop\"\n",
            "outbox.transforms.redact[0]: redacts /customer/email, which outbox.transforms.headers[0] reads",
        ),
        (
            "[outbox]\nallowed_topics = \"*\"\n[outbox.transforms]\nroute_by_field = \"/r\"\n\
             [[outbox.transforms.redact]]\npointer = \"/r\"\naction = \"drop\"\n",
            "outbox.transforms.redact[0]: redacts /r, which outbox.transforms.route_by_field reads",
        ),
        (
            "[outbox.transforms]\nhash_key_file = \"/nonexistent/redact.key\"\n",
            "outbox.transforms.hash_key_file: cannot read /nonexistent/redact.key",
        ),
        (
            "[[outbox.transforms.headers]]\nfrom = \"column:event_type\"\nname = \"eventType\"\nplacement = \"envelope\"\n",
            "outbox.transforms.headers[0].placement: \"envelope\" puts the value in a Debezium record's value",
        ),
        (
            "[outbox]\nformat = \"debezium\"\n[outbox.debezium]\nvalue_converter = \"json\"\n\
             [[outbox.transforms.headers]]\nfrom = \"column:id\"\nname = \"payload\"\nplacement = \"envelope\"\n",
            "outbox.transforms.headers[0].name: \"payload\" cannot name an envelope member",
        ),
        ("[outbox.transforms]\nexclude_event_type = [\"x\"]\n", "did you mean `exclude_event_types`?"),
    ];
    for (toml, expected) in cases {
        let err = refused(toml);
        assert!(err.contains(expected), "{toml}\n=> {err}\n(expected {expected})");
    }
}

#[test]
fn a_registry_encoded_payload_refuses_redactions_its_schema_cannot_hold() {
    let registry = "[outbox.registry]\nurl = \"http://127.0.0.1:8081\"\nschema_type = \"avro\"\n";
    let err =
        refused(&format!("{registry}[[outbox.transforms.redact]]\npointer = \"/pan\"\naction = \"drop\"\n"));
    assert!(
        err.starts_with("outbox.transforms.redact[0]: drops a field inside a payload the schema registry"),
        "{err}"
    );
    let err = refused(&format!(
        "{registry}[[outbox.transforms.redact]]\npointer = \"/pan\"\naction = \"replace\"\nwith = 0\n"
    ));
    assert!(err.starts_with("outbox.transforms.redact[0]: writes a non-string"), "{err}");
    let ok = format!(
        "{MINIMAL}{registry}[[outbox.transforms.redact]]\npointer = \"/pan\"\naction = \"replace\"\n"
    );
    load(&ok, &[]).unwrap();
}

#[test]
fn the_hash_key_is_never_in_the_printed_configuration() {
    let key = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(key.path(), "a-very-secret-hmac-key-of-32-bytes!!").unwrap();
    let cfg = load(
        &format!(
            "{MINIMAL}[outbox.transforms]\nhash_key_file = \"{}\"\n[[outbox.transforms.redact]]\npointer = \"/pan\"\n\
             action = \"hash\"\n",
            key.path().display()
        ),
        &[],
    )
    .unwrap();
    let printed = format!("{cfg:?} {}", serde_json::to_string(&cfg).unwrap());
    assert!(!printed.contains("a-very-secret"), "{printed}");
}
