//! The polling claim shell (`relay_batch`, run by [`Source::session`]) against the scripted
//! sink, on a real PostgreSQL (and, where the read-back is the point, a real Kafka): see
//! [`crate::source::testing`].

use std::sync::Arc;

use super::PollingSource;
use crate::config::RelayConfig;
use crate::outboxes::Outboxes;
use crate::record::Position;
use crate::sink::scripted::{Lifecycle, ScriptedSink};
use crate::source::testing::{Db, Driven, publish, service, session};

/// A polling source of `config` over `sink`.
fn source(config: RelayConfig, sink: ScriptedSink) -> Driven<PollingSource> {
    let outboxes = Arc::new(Outboxes::new(&config));
    Driven::new(PollingSource::new(config, outboxes), sink)
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

#[tokio::test]
async fn paused_the_leader_claims_nothing_and_resumed_it_publishes_every_row_once_in_order() {
    // given a session that published a first row
    let db = Db::new().await;
    let mut ids = vec![db.write("order").await];
    let mut driven = source(db.config("polling", "127.0.0.1:1", false), ScriptedSink::new());
    let pause = driven.health.pause().clone();
    let mut later = Vec::new();
    let paused_then_resumed = async {
        db.drained().await;
        // when it is paused and two rows are written
        assert!(pause.pause("test", None));
        later.push(db.write("order").await);
        later.push(db.write("order").await);
        // then nothing is claimed (an absence: waited for over ten poll intervals)
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
        assert_eq!(db.rows().await, 2, "paused, the leader claims nothing");
        // and once resumed, both are published
        assert!(pause.resume());
        db.drained().await;
    };
    session(&mut driven, paused_then_resumed).await.unwrap();
    ids.extend(later);
    assert_eq!(driven.sink.sent(), ids, "every row once, in order");
}
