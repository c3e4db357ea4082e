//! A one-off session against the scripted sink: every record gets one outcome, in order;
//! nothing is held or dead-lettered whatever the policy; with Kafka transactions all or none.

use std::time::Duration;

use super::{Delivered, send_all};
use crate::delivery::fixture::Fixture;
use crate::sink::scripted::{Fault, Lifecycle, record};

const LIMIT: Duration = Duration::from_secs(5);

fn records(ids: &[&str]) -> Vec<(String, crate::record::KafkaRecord)> {
    ids.iter().map(|id| (id.to_string(), record(id))).collect()
}

#[tokio::test]
async fn a_refused_record_is_refused_not_held_and_the_rest_are_acked_in_order() {
    // given the block policy, and a broker that refuses record 2 for good
    let mut f = Fixture::new("block");
    f.sink.script("2", [Fault::Reject]);
    // when three records are sent once
    let sent = send_all(&mut f.sink, &f.config, &[], records(&["1", "2", "3"]), LIMIT).await.unwrap();
    // then 2 is refused with the sink's reason (not held: sent once), the others acknowledged
    let ids: Vec<&str> = sent.iter().map(|(id, _)| id.as_str()).collect();
    assert_eq!(ids, ["1", "2", "3"]);
    assert_eq!(sent[0].1, Delivered::Acked);
    assert!(matches!(&sent[1].1, Delivered::Refused(_)), "{:?}", sent[1]);
    assert_eq!(sent[2].1, Delivered::Acked);
    assert_eq!(f.sink.sent(), ["1", "2", "3"], "nothing is sent again");
}

#[tokio::test]
async fn a_transient_failure_leaves_its_record_unacknowledged() {
    let mut f = Fixture::new("dead_letter");
    f.sink.script("1", [Fault::FailAfterWrite]);
    let sent = send_all(&mut f.sink, &f.config, &[], records(&["1", "2"]), LIMIT).await.unwrap();
    assert!(matches!(&sent[0].1, Delivered::Unacknowledged(why) if why.contains("event 1")), "{sent:?}");
    assert_eq!(sent[1].1, Delivered::Acked);
}

#[tokio::test]
async fn with_kafka_transactions_every_record_commits_at_once() {
    let mut f = Fixture::transactional("dead_letter");
    let sent = send_all(&mut f.sink, &f.config, &[], records(&["1", "2"]), LIMIT).await.unwrap();
    assert!(sent.iter().all(|(_, s)| *s == Delivered::Acked), "{sent:?}");
    assert_eq!(f.sink.commits(), [vec!["1", "2"]]);
}

#[tokio::test]
async fn with_kafka_transactions_one_refusal_acks_none() {
    // given a broker that refuses record 2 inside the transaction
    let mut f = Fixture::transactional("dead_letter");
    f.sink.script("2", [Fault::Reject]);
    let sent = send_all(&mut f.sink, &f.config, &[], records(&["1", "2", "3"]), LIMIT).await.unwrap();
    // then nothing commits, and no record counts as sent
    assert!(f.sink.commits().is_empty());
    assert!(sent.iter().all(|(_, s)| matches!(s, Delivered::Unacknowledged(_))), "{sent:?}");
}

#[tokio::test]
async fn a_session_that_cannot_activate_sends_nothing() {
    let mut f = Fixture::transactional("dead_letter");
    f.sink.fail(Lifecycle::Activate, 1);
    assert!(send_all(&mut f.sink, &f.config, &[], records(&["1"]), LIMIT).await.is_err());
    assert!(f.sink.sent().is_empty());
}

#[tokio::test]
async fn an_outbox_of_its_own_block_policy_is_refused_with_the_reason_too() {
    // given an outbox whose own dead_letter policy is block
    let outboxes = serde_json::json!([{"name": "orders", "dead_letter": {"on_poison": "block"}}]);
    let mut f = Fixture::with_outboxes("dead_letter", outboxes);
    f.sink.script("1", [Fault::Reject]);
    let sent = send_all(&mut f.sink, &f.config, &[], records(&["1"]), LIMIT).await.unwrap();
    // then the refusal says the sink's reason, and the record was sent once
    assert!(matches!(&sent[0].1, Delivered::Refused(why) if why != "Kafka refused it"), "{sent:?}");
    assert_eq!(f.sink.sent(), ["1"]);
}
