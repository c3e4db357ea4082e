//! A Kafka outage must not hurt the whole database: in polling mode the claim transaction holds
//! row locks and the xmin horizon (vacuum) only while it waits for acknowledgements, so that
//! wait is bounded by `polling.claim_timeout_ms`. With the broker frozen (SIGSTOP), the relay's
//! session is never in a transaction older than the bound, and once the broker is back every
//! event arrives, in per-aggregate order.

use crate::common;

use std::time::{Duration, Instant};

use common::broker::OwnBroker;
use common::workload::*;
use common::*;

/// How long the broker stays frozen: several claim bounds, each one a claim that must give up.
const FROZEN: Duration = Duration::from_secs(20);
const CLAIM_TIMEOUT_MS: u64 = 3_000;

#[tokio::test(flavor = "multi_thread")]
async fn a_frozen_broker_never_pins_the_xmin_horizon_past_the_claim_bound() {
    // given a polling relay publishing to a broker of its own
    let broker = OwnBroker::start();
    let s = Setup::create(&broker.brokers(), "", false, |_| {
        RelayToml::polling()
            .set("polling", "batch_size", 200)
            .set("polling", "claim_timeout_ms", CLAIM_TIMEOUT_MS)
            .set("retry", "initial_backoff_ms", 200)
            .set("retry", "max_backoff_ms", 2000)
    })
    .await;
    create_topic_on(&broker.brokers(), &s.topic, 4).await;
    let client = s.db.client().await;
    create_aggregates(&client, 20).await;
    let consumer = consumer_on(&broker.brokers(), &[&s.topic]);
    let mut relay = s.start("relay");
    relay.wait_ready("active").await;
    // (one event first: the relay reads its topic back before its first record to it, outside
    // any claim; from then on every claim publishes at once)
    let mut first = connect(&s.db.url).await;
    write_events(&mut first, &s.aggregate_type, "agg-0", 1, true).await;
    let mut records = consume(&consumer, 1, IDLE).await;
    assert_eq!(records.len(), 1, "{}", relay.log_text());

    // when the broker freezes while 1,000 events are written
    broker.freeze();
    let writer = {
        let (url, aggregate_type) = (s.db.url.clone(), s.aggregate_type.clone());
        tokio::spawn(async move { write_concurrently(&url, &aggregate_type, 20, 1_000, 4).await })
    };

    // then for as long as it stays frozen (from the first write on), no relay session is in a transaction older than the
    // bound (plus a margin for the rollback and a sampling interval)
    let limit = Duration::from_millis(CLAIM_TIMEOUT_MS) + Duration::from_secs(3);
    // (a transaction holds the horizon through its snapshot, backend_xmin, or through the
    // transaction id its row locks took, backend_xid)
    let oldest_sql = "SELECT coalesce(max(extract(epoch FROM now() - xact_start)), 0)::float8 FROM pg_stat_activity \
                      WHERE application_name = 'outbox-relay' AND datname = current_database() \
                      AND xact_start IS NOT NULL AND (backend_xid IS NOT NULL OR backend_xmin IS NOT NULL)";
    let started = Instant::now();
    let mut oldest_seen = 0.0f64;
    while started.elapsed() < FROZEN {
        let oldest: f64 = client.query_one(oldest_sql, &[]).await.unwrap().get(0);
        oldest_seen = oldest_seen.max(oldest);
        assert!(oldest < limit.as_secs_f64(), "a relay transaction held the xmin horizon for {oldest:.1} s");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    // (it did claim and give up, rather than never claim)
    assert!(
        oldest_seen > 0.5,
        "the relay never held a claim while the broker was frozen: {}",
        relay.log_text()
    );
    let timeouts = relay.metric("outbox_relay_publish_errors_total{error_type=\"timeout\"}").unwrap_or(0.0);
    assert!(timeouts > 0.0, "no claim timed out: {}", relay.log_text());

    // and once the broker is back, every committed event arrives, first arrivals in order
    let committed = writer.await.unwrap();
    broker.thaw();
    records.extend(consume_unique(&consumer, 1_000, IDLE, LINGER).await);
    let report = assert_delivered(&records, &committed);
    assert_eq!(report.unique, 1_001);
    wait_until("the published rows to be deleted", async || s.outbox_rows().await == 0).await;
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_broker_that_refuses_connections_is_logged_as_reconnecting_not_as_errors() {
    // given a relay whose broker refuses every connection (nothing listens on its port) and an
    // event to publish
    let brokers = format!("127.0.0.1:{}", common::http::free_port());
    let s = Setup::create(&brokers, "", false, |_| RelayToml::polling()).await;
    insert_event(&s.db.client().await, &s.aggregate_type, Some("agg-0")).await;

    // when it has tried for a while
    let mut relay = s.start("relay");
    wait_until("the relay to say no broker is reachable", async || {
        relay.log_text().contains("no Kafka broker reachable")
    })
    .await;
    tokio::time::sleep(Duration::from_secs(3)).await;

    // then the log says it reconnects, and no line of it is an ERROR: librdkafka's own report of
    // each refused connect (its FAIL line, at its error level) is not repeated at ERROR
    let log = relay.log_text();
    let errors: Vec<&str> = log.lines().filter(|line| line.contains("ERROR")).collect();
    assert!(errors.is_empty(), "ERROR lines for a broker that is only down:\n{}", errors.join("\n"));
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0), "{log}");
}
