use super::*;
use crate::config::RelayConfig;

fn config(toml_polling: AfterPublish) -> RelayConfig {
    let mut config: RelayConfig =
        serde_json::from_value(serde_json::json!({"kafka": {"brokers": ["k:9092"]}})).unwrap();
    config.polling.after_publish = toml_polling;
    config
}

#[test]
fn identifiers_are_quoted() {
    assert_eq!(quote_ident("type"), "\"type\"");
    assert_eq!(quote_ident("a\"b"), "\"a\"\"b\"");
    assert_eq!(quote_literal("it's"), "'it''s'");
}

#[test]
fn unpublished_is_one_definition_used_everywhere() {
    let mark = {
        let c = config(AfterPublish::Mark);
        OutboxTable::of(&c.outbox, &c.polling)
    };
    assert_eq!(mark.unpublished(), "t.\"published_at\" IS NULL");
    for sql in
        [mark.claim_sql(), mark.copy_sql(), mark.backlog_count_sql(10), mark.backlog_age_sql().unwrap()]
    {
        assert!(sql.contains("WHERE t.\"published_at\" IS NULL"), "{sql}");
    }
    let delete = {
        let c = config(AfterPublish::Delete);
        OutboxTable::of(&c.outbox, &c.polling)
    };
    assert!(delete.claim_sql().contains("WHERE TRUE ORDER BY t.\"id\""), "{}", delete.claim_sql());
    assert!(delete.release_sql().starts_with("DELETE FROM \"public\".\"outbox_events\" t WHERE t.ctid"));
    assert!(mark.release_sql().starts_with("UPDATE \"public\".\"outbox_events\" t SET \"published_at\""));
}

#[test]
fn another_column_a_header_rule_reads_is_claimed_copied_and_dead_lettered_by_name() {
    let mut c = config(AfterPublish::Delete);
    c.outbox.transforms.headers.push(crate::config::HeaderRule {
        from: "column:channel".into(),
        name: "channel".into(),
        placement: crate::config::Placement::Header,
    });
    let table = OutboxTable::of(&c.outbox, &c.polling);
    assert_eq!(table.others(), ["channel"]);
    let read = "t.\"channel\"::text AS \"relay_column:channel\"";
    assert!(table.claim_sql().contains(read), "{}", table.claim_sql());
    assert!(table.claim_sql().contains("v.\"relay_column:channel\""), "counted and fetched like the rest");
    assert!(table.copy_sql().contains(read), "{}", table.copy_sql());
    let letters = table.copy_to_letters_sql("outbox_dead_letter");
    assert!(letters.contains("'columns', jsonb_build_object('channel', t.\"channel\"::text)"), "{letters}");
}

#[test]
fn a_claim_fetches_only_the_id_of_a_row_over_the_row_bound() {
    let table = {
        let c = config(AfterPublish::Delete);
        OutboxTable::of(&c.outbox, &c.polling)
    };
    let claim = table.claim_sql();
    // every event column but the id is fetched only under $2, measured once per row
    for alias in
        [col::AGGREGATE_TYPE, col::AGGREGATE_ID, col::EVENT_TYPE, col::PAYLOAD, col::HEADERS, col::TOPIC]
    {
        assert!(claim.contains(&format!("<= $2 THEN v.{alias} END AS {alias}")), "{alias}: {claim}");
    }
    assert!(claim.starts_with("SELECT v.id, "), "{claim}");
    assert!(claim.contains("OFFSET 0) v") && claim.contains("AS relay_row_bytes"), "{claim}");
    assert!(claim.ends_with("LIMIT $1 FOR UPDATE OF t SKIP LOCKED"), "{claim}");
    // and the letter of such a row is made from the row by PostgreSQL, keyed as row_data is
    let copy = table.copy_to_letters_sql("\"public\".\"outbox_dead_letter\"");
    assert!(copy.starts_with(
        "INSERT INTO \"public\".\"outbox_dead_letter\" (source_table, event_id, row_data, reason)"
    ));
    assert!(copy.contains("jsonb_build_object('id', t.\"id\"::text, 'aggregate_type', "), "{copy}");
    assert!(copy.contains("'payload', t.\"payload\"::text"), "{copy}");
}

#[test]
fn columns_are_aliased_for_reading_by_name() {
    let mut c = config(AfterPublish::Delete);
    c.outbox.columns.event_type = "type".into();
    c.outbox.columns.headers = String::new();
    let sql = OutboxTable::of(&c.outbox, &c.polling).copy_sql();
    assert!(sql.contains("t.\"type\"::text AS event_type"), "{sql}");
    assert!(sql.contains("NULL::text AS headers"), "{sql}");
}
