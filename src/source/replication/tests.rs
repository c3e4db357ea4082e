//! The stream session (run by [`Source::session`]) against the scripted sink, on a real
//! PostgreSQL's logical slot (and, where the read-back is the point, a real Kafka): see
//! [`crate::source::testing`]. The slot is made first (`setup`), so each session streams.

use std::sync::Arc;

use super::ReplicationSource;
use crate::config::RelayConfig;
use crate::lsn::Lsn;
use crate::outboxes::Outboxes;
use crate::record::Position;
use crate::sink::scripted::{Lifecycle, ScriptedSink};
use crate::source::testing::{Db, Driven, publish, service, session};

/// A replication source of `config` over `sink`, its slot made (with nothing to copy).
async fn source(config: RelayConfig, mut sink: ScriptedSink) -> Driven<ReplicationSource> {
    let outboxes = Arc::new(Outboxes::new(&config));
    let mut source = ReplicationSource::new(config, outboxes);
    source.setup(&mut sink, false).await.expect("setup makes the slot");
    Driven::new(source, sink)
}

/// The WAL written so far: a slot confirmed this far holds nothing written before.
async fn wal_end(db: &Db) -> Lsn {
    let lsn: String = db.client.query_one("SELECT pg_current_wal_lsn()::text", &[]).await.unwrap().get(0);
    lsn.parse().unwrap()
}

/// How far the slot (named as the database) is confirmed.
async fn confirmed(db: &Db) -> Lsn {
    let sql = "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1";
    let lsn: String = db.client.query_one(sql, &[&db.name]).await.unwrap().get(0);
    lsn.parse().unwrap()
}

/// Resolves once the slot is confirmed through `lsn` (looked at every 20 ms).
async fn confirmed_through(db: &Db, lsn: Lsn) {
    while confirmed(db).await < lsn {
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// The commit position the stream gives the first transaction with an outbox insert after the
/// slot's confirmed point: its pgoutput `Begin`'s final LSN, peeked (not consumed) from the slot.
async fn first_insert_commit(db: &Db, publication: &str) -> Lsn {
    let sql = "SELECT data FROM pg_logical_slot_peek_binary_changes($1, NULL, NULL, \
               'proto_version', '1', 'publication_names', $2)";
    let rows = db.client.query(sql, &[&db.name, &publication]).await.unwrap();
    let mut begun = None;
    for row in rows {
        let data: Vec<u8> = row.get(0);
        match data.first() {
            Some(b'B') => begun = Some(Lsn(u64::from_be_bytes(data[1..9].try_into().unwrap()))),
            Some(b'I') => return begun.expect("an insert inside a transaction"),
            _ => {}
        }
    }
    panic!("no outbox insert in the slot")
}

#[tokio::test]
async fn a_failed_activate_streams_nothing_and_the_next_session_publishes_every_row_once_in_order() {
    // given a slot, three rows written after it, and a sink whose activation fails once
    let db = Db::new().await;
    let mut source = source(db.config("replication", "127.0.0.1:1", false), ScriptedSink::new()).await;
    let before = confirmed(&db).await;
    let mut ids = Vec::new();
    for _ in 0..3 {
        ids.push(db.write("order").await);
    }
    let written = wal_end(&db).await;
    source.sink.fail(Lifecycle::Activate, 1);
    // when a session runs
    let failed = session(&mut source, std::future::pending()).await;
    // then it ends with the sink's error, having sent nothing and confirmed nothing
    let error = failed.expect_err("a failed activation ends the session");
    assert!(error.to_string().contains("Activate failed"), "{error}");
    assert!(source.sink.sent().is_empty());
    assert_eq!(confirmed(&db).await, before);
    // and after the supervisor's recovery, the next session publishes every row once, in order
    source.recover();
    session(&mut source, confirmed_through(&db, written)).await.unwrap();
    assert_eq!(source.sink.sent(), ids);
}

#[tokio::test]
async fn a_failed_kafka_commit_confirms_nothing_and_the_next_session_commits_the_events_once() {
    // given a slot, two rows in one transaction after it, and a transactional sink whose first
    // commit fails
    let db = Db::new().await;
    let config = db.config("replication", "127.0.0.1:1", false);
    let mut source = source(config, ScriptedSink::transactional()).await;
    let before = confirmed(&db).await;
    db.client.batch_execute("BEGIN").await.unwrap();
    let ids = vec![db.write("order").await, db.write("order").await];
    db.client.batch_execute("COMMIT").await.unwrap();
    let written = wal_end(&db).await;
    source.sink.fail(Lifecycle::Commit, 1);
    // when a session streams them
    let failed = session(&mut source, std::future::pending()).await;
    // then it ends with the sink's error: nothing became visible, and the slot is not confirmed
    // past them
    let error = failed.expect_err("a failed commit ends the session");
    assert!(error.to_string().contains("Commit failed"), "{error}");
    assert_eq!(source.sink.sent(), ids);
    assert!(source.sink.commits().is_empty());
    assert_eq!(confirmed(&db).await, before);
    // and the next session (a fresh producer aborted the open transaction) commits them once
    source.recover();
    session(&mut source, confirmed_through(&db, written)).await.unwrap();
    assert_eq!(source.sink.commits(), [ids]);
}

#[tokio::test]
async fn an_event_kafka_already_holds_is_confirmed_unsent_and_the_rest_are_sent() {
    // given a slot and an event an earlier session published without confirming it (a crash
    // after Kafka's acknowledgement: the slot replays it), then an event never published
    let db = Db::new().await;
    let config = db.config("replication", &service("OUTBOX_RELAY_TEST_KAFKA"), true);
    let publication = config.replication.publication.clone();
    let mut source = source(config.clone(), ScriptedSink::new()).await;
    let aggregate = format!("unit{:08x}", rand::random::<u32>());
    let published = db.write(&aggregate).await;
    let commit = first_insert_commit(&db, &publication).await;
    publish(&db, &config, (&aggregate, &published), Position::Stream { commit, index: 0 }).await;
    let unpublished = db.write(&aggregate).await;
    let written = wal_end(&db).await;
    // when a session streams (its sends go to the scripted sink, its read-back to Kafka)
    session(&mut source, confirmed_through(&db, written)).await.unwrap();
    // then the event Kafka holds was confirmed without being sent again, and the other was sent
    assert_eq!(source.sink.sent(), [unpublished]);
}

#[tokio::test]
async fn paused_the_stream_confirms_nothing_past_what_was_sent_and_resumed_it_sends_every_row_once() {
    // given a slot, and a session paused before two rows are written
    let db = Db::new().await;
    let mut driven = source(db.config("replication", "127.0.0.1:1", false), ScriptedSink::new()).await;
    let before = confirmed(&db).await;
    let pause = driven.health.pause().clone();
    assert!(pause.pause("test", None));
    let ids = vec![db.write("order").await, db.write("order").await];
    let written = wal_end(&db).await;
    let paused_then_resumed = async {
        // then the slot is not confirmed past them (an absence: waited for over several status
        // intervals)
        tokio::time::sleep(std::time::Duration::from_millis(1_500)).await;
        let paused_at = confirmed(&db).await;
        assert!(paused_at < written, "paused at {paused_at}, the rows end at {written} (from {before})");
        // and once resumed, the stream sends them and confirms past them
        assert!(pause.resume());
        confirmed_through(&db, written).await;
    };
    session(&mut driven, paused_then_resumed).await.unwrap();
    assert_eq!(driven.sink.sent(), ids, "every row once, in order");
}
