//! Memory is bounded in bytes, not only in events: 50,000 outbox rows of 10 KB stream through a
//! relay whose peak RSS stays under the 256 MiB the StatefulSet allows
//! (`replication.max_in_flight_bytes`, 64 MiB by default, pauses reading at that many bytes in
//! flight). The figure is recorded in BENCHMARKS.md.

mod common;

use common::broker::OwnBroker;
use common::*;

const ROWS: i64 = 50_000;
const LIMIT_BYTES: u64 = 256 << 20;

/// The peak resident set of process `pid` (VmHWM), in bytes.
fn peak_rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("VmHWM:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() * 1024
}

#[tokio::test(flavor = "multi_thread")]
async fn fifty_thousand_ten_kilobyte_rows_stream_in_bounded_memory() {
    // given a streaming relay, on a broker of this test's own (500 MB would slow the shared one
    // for every other test)
    let broker = OwnBroker::start(None);
    let s = Setup::create(&broker.brokers(), "", false, |slot| {
        format!(
            "[source]\nmode = \"replication\"\n[replication]\nslot = \"{slot}\"\npublication = \"p_{slot}\"\n"
        )
    })
    .await;
    wait_until("the test's broker to listen", async || {
        std::net::TcpStream::connect(("127.0.0.1", broker.port)).is_ok()
    })
    .await;
    create_topic_on(&broker.brokers(), &s.topic, 4).await;
    let client = s.db.client().await;
    let mut relay = s.start("relay");
    relay.wait_ready("active").await;

    // when 50,000 rows of 10 KB (500 MB) are committed, in transactions of 1,000
    for batch in 0..ROWS / 1_000 {
        client
            .execute(
                "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload) \
                 SELECT $1, 'agg-' || (g % 100), 'Big', jsonb_build_object('n', g, 'blob', repeat(md5(g::text), 320)) \
                 FROM generate_series($2::bigint, $2::bigint + 999) g",
                &[&s.aggregate_type, &(batch * 1_000)],
            )
            .await
            .unwrap();
    }

    // then Kafka acknowledged every one, and the relay's peak RSS stayed under the limit
    let series = "outbox_relay_events_published_total{mode=\"replication\"}";
    wait_until_within(
        std::time::Duration::from_secs(600),
        relay.context("every row acknowledged".into()),
        async || relay.metric(series).is_some_and(|v| v >= ROWS as f64),
    )
    .await;
    let peak = peak_rss(relay.pid());
    eprintln!("peak RSS after {ROWS} rows of 10 KB: {} MiB", peak >> 20);
    assert!(peak < LIMIT_BYTES, "peak RSS {} MiB reached the StatefulSet's 256 MiB", peak >> 20);
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0));
}
