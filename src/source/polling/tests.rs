//! The polling claim shell (`relay_batch`, run by [`Source::session`]) against the scripted
//! sink, on a real PostgreSQL (and, where the read-back is the point, a real Kafka): see
//! [`crate::source::testing`].

use std::sync::Arc;

use super::PollingSource;
use crate::config::RelayConfig;
use crate::outboxes::Outboxes;
use crate::record::Position;
use crate::sink::scripted::{Lifecycle, ScriptedSink};
use crate::source::Source;
use crate::source::testing::{Db, publish, service, session};

/// A polling source of `config` over `sink`.
fn source(config: RelayConfig, sink: ScriptedSink) -> PollingSource<ScriptedSink> {
    let outboxes = Arc::new(Outboxes::new(&config));
    PollingSource::new(config, outboxes, sink)
}

#[tokio::test]
async fn a_failed_activate_claims_nothing_and_the_next_session_publishes_every_row_once_in_order() {
    // given three rows, and a sink whose activation fails once (it could not fence the
    // producers before it)
    let db = Db::new().await;
    let mut ids = Vec::new();
    for _ in 0..3 {
        ids.push(db.write("order").await);
    }
    let sink = ScriptedSink::new();
    sink.fail(Lifecycle::Activate, 1);
    let mut source = source(db.config("polling", "127.0.0.1:1", false), sink);
    // when a session runs
    let failed = session(&mut source, std::future::pending()).await;
    // then it ends with the sink's error, having sent and released nothing
    let error = failed.expect_err("a failed activation ends the session");
    assert!(error.to_string().contains("Activate failed"), "{error}");
    assert!(source.sink.sent().is_empty());
    assert_eq!(db.rows().await, 3);
    // and after the supervisor's recovery, the next session publishes every row once, in order
    source.recover();
    session(&mut source, db.drained()).await.unwrap();
    assert_eq!(source.sink.sent(), ids);
}

#[tokio::test]
async fn a_failed_kafka_commit_releases_no_row_and_the_next_session_commits_the_batch_once() {
    // given two rows, and a transactional sink whose first commit fails
    let db = Db::new().await;
    let ids = vec![db.write("order").await, db.write("order").await];
    let sink = ScriptedSink::transactional();
    sink.fail(Lifecycle::Commit, 1);
    let mut source = source(db.config("polling", "127.0.0.1:1", false), sink);
    // when a session claims and sends them
    let failed = session(&mut source, std::future::pending()).await;
    // then it ends with the sink's error: nothing became visible and both rows are still there
    let error = failed.expect_err("a failed commit ends the session");
    assert!(error.to_string().contains("Commit failed"), "{error}");
    assert_eq!(source.sink.sent(), ids);
    assert!(source.sink.commits().is_empty());
    assert_eq!(db.rows().await, 2);
    // and the next session (a fresh producer aborted the open transaction) commits them once
    source.recover();
    session(&mut source, db.drained()).await.unwrap();
    assert_eq!(source.sink.commits(), [ids]);
}

#[tokio::test]
async fn a_row_whose_record_kafka_already_holds_is_released_unsent_and_the_rest_are_sent() {
    // given a row an earlier session published without committing its release (a crash after
    // Kafka's acknowledgement: the row stayed), and a row never published
    let db = Db::new().await;
    let config = db.config("polling", &service("OUTBOX_RELAY_TEST_KAFKA"), true);
    let aggregate = format!("unit{:08x}", rand::random::<u32>());
    let published = db.write(&aggregate).await;
    let batch = Position::Batch { session: 7, batch: 0, index: 0 };
    publish(&db, &config, (&aggregate, &published), batch).await;
    let unpublished = db.write(&aggregate).await;
    // when a polling session runs (its sends go to the scripted sink, its read-back to Kafka)
    let mut source = source(config, ScriptedSink::new());
    session(&mut source, db.drained()).await.unwrap();
    // then the row Kafka holds was released without being sent again, and the other was sent
    assert_eq!(source.sink.sent(), [unpublished]);
}
