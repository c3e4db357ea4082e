use super::*;

pub(in crate::source::replication) fn relation(
    oid: u32,
    schema: &str,
    table: &str,
    columns: &[&str],
) -> Vec<u8> {
    let mut m = vec![b'R'];
    m.extend(oid.to_be_bytes());
    for s in [schema, table] {
        m.extend(s.as_bytes());
        m.push(0);
    }
    m.push(b'd');
    m.extend((columns.len() as u16).to_be_bytes());
    for c in columns {
        m.push(0);
        m.extend(c.as_bytes());
        m.push(0);
        m.extend(25u32.to_be_bytes());
        m.extend((-1i32).to_be_bytes());
    }
    m
}

pub(in crate::source::replication) fn insert(oid: u32, values: &[Option<&str>]) -> Vec<u8> {
    let mut m = vec![b'I'];
    m.extend(oid.to_be_bytes());
    m.push(b'N');
    m.extend((values.len() as u16).to_be_bytes());
    for v in values {
        match v {
            None => m.push(b'n'),
            Some(s) => {
                m.push(b't');
                m.extend((s.len() as u32).to_be_bytes());
                m.extend(s.as_bytes());
            }
        }
    }
    m
}

pub(in crate::source::replication) const COLUMNS: &[&str] =
    &["id", "aggregate_type", "aggregate_id", "event_type", "payload", "headers", "topic", "created_at"];

#[test]
fn inserts_of_several_outbox_tables_say_which_outbox_and_others_are_skipped() {
    let ledger = OutboxConfig { table: "ledger_outbox".into(), ..OutboxConfig::default() };
    let mut d = Decoder::new([&OutboxConfig::default(), &ledger]);
    for (oid, table) in [(1, "outbox_events"), (2, "ledger_outbox"), (3, "orders")] {
        assert_eq!(d.decode(&relation(oid, "public", table, COLUMNS)).unwrap(), Change::Relation);
    }
    let row = |id| [Some(id), Some("order"), Some("o-1"), Some("Placed"), Some("{}"), None, None, None];
    let Change::Insert(at, first) = d.decode(&insert(1, &row("7"))).unwrap() else { panic!("outbox 0") };
    let Change::Insert(then, second) = d.decode(&insert(2, &row("7"))).unwrap() else { panic!("outbox 1") };
    assert_eq!((at.index(), then.index()), (0, 1));
    assert_eq!((first.id.as_deref(), second.id.as_deref()), (Some("7"), Some("7")));
    assert_eq!(d.decode(&insert(3, &row("7"))).unwrap(), Change::Skipped(SkippedKind::OtherTable));
    // the second table renamed: named as it was
    let renamed = d.decode(&relation(2, "public", "ledger_old", COLUMNS)).unwrap();
    assert_eq!(
        renamed,
        Change::OutboxRenamed { was: "public.ledger_outbox".into(), now: "public.ledger_old".into() }
    );
}

#[test]
fn a_change_read_in_part_says_what_it_is() {
    let mut d = Decoder::new([&OutboxConfig::default()]);
    d.decode(&relation(7, "public", "outbox_events", COLUMNS)).unwrap();
    let big = "x".repeat(1_000);
    let row =
        insert(7, &[Some("17"), Some("order"), Some("42"), Some("Placed"), Some(&big), None, None, None]);
    // the head of an outbox row holds its id; a head cut inside the id holds none
    assert_eq!(
        d.oversized(&row[..200]),
        Oversized::OutboxInsert { outbox: OutboxId::default(), id: Some("17".into()) }
    );
    assert_eq!(d.oversized(&row[..14]), Oversized::OutboxInsert { outbox: OutboxId::default(), id: None });
    // another table's row, and a logical message named by its prefix
    assert_eq!(
        d.oversized(&insert(8, &[Some("1"), Some(&big)])[..100]),
        Oversized::Other(SkippedKind::OtherTable)
    );
    let mut message = vec![b'M', 1];
    message.extend(0u64.to_be_bytes());
    message.extend(b"someone-else\0");
    message.extend(1_000_000u32.to_be_bytes());
    let prefix = "someone-else".to_string();
    assert_eq!(d.oversized(&message), Oversized::Message { transactional: true, prefix });
}

#[test]
fn decodes_an_outbox_insert_by_column_name() {
    let mut d = Decoder::new([&OutboxConfig::default()]);
    assert_eq!(d.decode(&relation(7, "public", "outbox_events", COLUMNS)).unwrap(), Change::Relation);
    let change = d
        .decode(&insert(
            7,
            &[Some("1"), Some("order"), Some("42"), Some("Placed"), Some("{}"), None, None, Some("t")],
        ))
        .unwrap();
    let Change::Insert(_, raw) = change else { panic!("{change:?}") };
    assert_eq!(raw.id.as_deref(), Some("1"));
    assert_eq!(raw.aggregate_id.as_deref(), Some("42"));
    assert_eq!(raw.payload.as_deref(), Some("{}"));
    assert_eq!(raw.headers, None);
}

#[test]
fn other_tables_are_ignored() {
    let mut d = Decoder::new([&OutboxConfig::default()]);
    d.decode(&relation(8, "public", "orders", &["id"])).unwrap();
    assert_eq!(d.decode(&insert(8, &[Some("1")])).unwrap(), Change::Skipped(SkippedKind::OtherTable));
    assert_eq!(d.decode(b"Y\0\0\0\x01").unwrap(), Change::Skipped(SkippedKind::Type));
}

#[test]
fn text_that_is_not_utf8_marks_its_column_instead_of_failing() {
    let mut d = Decoder::new([&OutboxConfig::default()]);
    d.decode(&relation(7, "public", "outbox_events", COLUMNS)).unwrap();
    let mut row = insert(7, &[Some("1"), Some("a"), Some("b"), Some("c"), Some("{}"), None, None, None]);
    // the payload's text, "{}", becomes "{\xff"
    let at = row.windows(2).position(|w| w == b"{}").unwrap();
    row[at + 1] = 0xff;
    let Change::Insert(_, raw) = d.decode(&row).unwrap() else { panic!("not an insert") };
    assert_eq!(raw.unreadable.as_deref(), Some("payload"));
    assert_eq!(raw.payload.as_deref(), Some("{\u{fffd}"));
}

#[test]
fn a_renamed_outbox_is_reported_not_forgotten() {
    let mut d = Decoder::new([&OutboxConfig::default()]);
    d.decode(&relation(7, "public", "outbox_events", COLUMNS)).unwrap();
    let change = d.decode(&relation(7, "public", "outbox_old", COLUMNS)).unwrap();
    assert_eq!(
        change,
        Change::OutboxRenamed { was: "public.outbox_events".into(), now: "public.outbox_old".into() }
    );
    let change = d.decode(&relation(7, "archive", "outbox_events", COLUMNS)).unwrap();
    assert_eq!(
        change,
        Change::OutboxRenamed { was: "public.outbox_events".into(), now: "archive.outbox_events".into() }
    );
}

#[test]
fn outbox_updates_deletes_and_truncates_are_counted_not_published() {
    let mut d = Decoder::new([&OutboxConfig::default()]);
    d.decode(&relation(7, "public", "outbox_events", COLUMNS)).unwrap();
    assert_eq!(d.decode(b"U\0\0\0\x07N").unwrap(), Change::Skipped(SkippedKind::OutboxUpdate));
    assert_eq!(d.decode(b"D\0\0\0\x07K").unwrap(), Change::Skipped(SkippedKind::OutboxDelete));
    assert_eq!(d.decode(b"D\0\0\0\x09K").unwrap(), Change::Skipped(SkippedKind::OtherTable));
    assert_eq!(
        d.decode(b"T\0\0\0\x02\0\0\0\0\x09\0\0\0\x07").unwrap(),
        Change::Skipped(SkippedKind::OutboxTruncate)
    );
}

#[test]
fn streaming_and_two_phase_messages_are_protocol_errors() {
    let mut d = Decoder::new([&OutboxConfig::default()]);
    for kind in [b'S', b'E', b'c', b'A', b'b', b'P', b'K', b'r', b'p', b'Z'] {
        let err = d.decode(&[kind, 0, 0, 0, 0]).unwrap_err();
        assert!(err.to_string().contains("message type"), "{err}");
    }
}

#[test]
fn truncated_messages_are_errors_not_panics() {
    let mut d = Decoder::new([&OutboxConfig::default()]);
    let full = relation(7, "public", "outbox_events", COLUMNS);
    for cut in 1..full.len() {
        assert!(d.decode(&full[..cut]).is_err(), "cut at {cut}");
    }
    d.decode(&full).unwrap();
    let row = insert(7, &[Some("1"), Some("a"), Some("b"), Some("c"), Some("{}"), None, None, None]);
    for cut in 5..row.len() {
        assert!(d.decode(&row[..cut]).is_err(), "cut at {cut}");
    }
}

#[test]
fn message_content_becomes_a_raw_event() {
    let (raw, digest) = message_event(
        br#"{"id":"u1","aggregate_type":"order","aggregate_id":"9","event_type":"E","payload":"{\"a\": 1}"}"#,
    )
    .unwrap();
    assert_eq!(raw.payload.as_deref(), Some("{\"a\": 1}"));
    assert_eq!((raw.topic, digest), (None, None));
    // sql/012_outbox_emit_signed.sql's outbox_emit() adds its digest (null without a key)
    let (_, digest) = message_event(br#"{"id":"u1","digest":"00ff"}"#).unwrap();
    assert_eq!(digest.as_deref(), Some("00ff"));
    assert_eq!(message_event(br#"{"id":"u1","digest":null}"#).unwrap().1, None);
    assert!(message_event(b"not json").is_err());
}
