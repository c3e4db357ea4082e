//! Memory is bounded in bytes, not only in events: the relay's peak RSS stays under the 256 MiB
//! the StatefulSet allows with 50,000 rows of 10 KB in either mode, with one row of 50 MB (more
//! than Kafka takes: it is dead-lettered whole), and with one transaction of 200,000 events
//! (it arrives whole). `replication.max_in_flight_bytes` pauses reading at that many bytes in
//! flight; `polling.max_batch_bytes` ends a claim at that many bytes. The figures are recorded
//! in BENCHMARKS.md.

use crate::common;

use std::collections::HashSet;
use std::time::Duration;

use common::broker::{OwnBroker, signal};
use common::process::RelayProcess;
use common::*;
use rdkafka::Message;
use rdkafka::message::Headers;

const LIMIT_BYTES: u64 = 256 << 20;
/// How long the relay may make no progress at all (nothing read, nothing acknowledged) before a
/// test gives up on it. No test here bounds the whole run: how fast the relay moves half a
/// gigabyte is the benchmark's to measure (BENCHMARKS.md), and on a machine loaded 15-70 times
/// its cores the 200,000-event transaction took longer than the ten minutes it once had.
const STALL_LIMIT: Duration = Duration::from_secs(180);

/// The peak resident set of process `pid` (VmHWM), in bytes.
fn peak_rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("VmHWM:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() * 1024
}

/// A running relay in `mode` on a broker of the test's own (hundreds of megabytes would slow
/// the shared one for every other test).
struct Run {
    broker: OwnBroker,
    s: Setup,
    relay: RelayProcess,
}

impl Run {
    async fn start(mode: &str) -> Run {
        Self::start_with_env(mode, &[]).await
    }

    async fn start_with_env(mode: &str, env: &[(&str, &str)]) -> Run {
        Self::start_after(mode, env, async |_| {}).await
    }

    /// As [`Run::start_with_env`], with `before` run before the relay starts (its rows are the
    /// first copy's, in replication mode).
    async fn start_after(mode: &str, env: &[(&str, &str)], before: impl AsyncFnOnce(&Setup)) -> Run {
        let broker = OwnBroker::start();
        let s = Setup::create(&broker.brokers(), "", false, |slot| {
            RelayToml::replication(slot).set("source", "mode", mode)
        })
        .await;
        create_topic_on(&broker.brokers(), &s.topic, 4).await;
        before(&s).await;
        let relay = s.start_with_env("relay", env);
        relay.wait_ready("active").await;
        Run { broker, s, relay }
    }

    /// Waits until `events` events are acknowledged, for as long as the relay makes progress:
    /// it fails when neither the events read nor those acknowledged grew for [`STALL_LIMIT`].
    async fn wait_published(&self, mode: &str, events: i64) {
        let published = format!("outbox_relay_events_published_total{{mode=\"{mode}\"}}");
        let read = format!("outbox_relay_events_read_total{{mode=\"{mode}\"}}");
        let progress = || (self.relay.metric(&published), self.relay.metric(&read));
        let (mut last, mut since) = (progress(), std::time::Instant::now());
        loop {
            let now = progress();
            if now.0.is_some_and(|v| v >= events as f64) {
                return;
            }
            if now != last {
                (last, since) = (now, std::time::Instant::now());
            }
            assert!(
                since.elapsed() < STALL_LIMIT,
                "{events} events acknowledged: no progress for {STALL_LIMIT:?} at (acknowledged, read) = {last:?}: {}",
                self.relay.log_text()
            );
            tokio::time::sleep(POLL).await;
        }
    }

    /// The distinct event ids (the `id` header) of the records the topic holds, read until
    /// `expected` distinct ones arrived or nothing more comes for [`IDLE`], and how many records
    /// held them. (The broker's high watermarks lag the log, so the records are counted.)
    /// Payloads are not kept: they may be gigabytes.
    async fn ids_in_kafka(&self, expected: usize) -> (HashSet<String>, usize) {
        let consumer = consumer_on(&self.broker.brokers(), &[&self.s.topic]);
        let (mut ids, mut records) = (HashSet::new(), 0);
        while ids.len() < expected {
            let Ok(message) = tokio::time::timeout(IDLE, consumer.recv()).await else { break };
            let message = message.expect("consume");
            let id = message.headers().and_then(|hs| hs.iter().find(|h| h.key == "id").and_then(|h| h.value));
            ids.insert(String::from_utf8_lossy(id.expect("an id header")).into_owned());
            records += 1;
        }
        (ids, records)
    }

    /// Asserts the topic holds exactly `expected` records, each once.
    async fn assert_in_kafka_once(&self, expected: usize) {
        let (ids, records) = self.ids_in_kafka(expected).await;
        assert_eq!((ids.len(), records), (expected, expected), "(distinct events, records) in Kafka");
    }

    /// Asserts the peak RSS stayed under the StatefulSet's limit, and stops the relay.
    fn finish(self, what: &str) {
        self.finish_within(what, LIMIT_BYTES)
    }

    /// Asserts the peak RSS stayed under `limit` bytes, and stops the relay.
    fn finish_within(mut self, what: &str, limit: u64) {
        let peak = peak_rss(self.relay.pid());
        eprintln!("peak RSS with {what}: {} MiB", peak >> 20);
        assert!(
            peak < limit,
            "peak RSS {} MiB with {what} reached the {} MiB limit",
            peak >> 20,
            limit >> 20
        );
        assert_eq!(self.relay.terminate(EXIT_LIMIT), Some(0));
    }
}

/// Commits `rows` rows of 10 KB, in transactions of 1,000.
async fn write_ten_kilobyte_rows(s: &Setup, rows: i64) {
    write_rows(s, rows, 1_000, 320).await
}

/// Commits `rows` rows whose payload holds `md5s` MD5 digests (32 bytes each), `per_txn` to a
/// transaction.
async fn write_rows(s: &Setup, rows: i64, per_txn: i64, md5s: i32) {
    let client = s.db.client().await;
    for batch in 0..rows / per_txn {
        client
            .execute(
                "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload) \
                 SELECT $1, 'agg-' || (g % 100), 'Big', jsonb_build_object('n', g, 'blob', repeat(md5(g::text), $4)) \
                 FROM generate_series($2::bigint, $2::bigint + $3 - 1) g",
                &[&s.aggregate_type, &(batch * per_txn), &per_txn, &md5s],
            )
            .await
            .unwrap();
    }
}

async fn fifty_thousand_ten_kilobyte_rows(mode: &str) {
    const ROWS: i64 = 50_000;
    let run = Run::start(mode).await;
    write_ten_kilobyte_rows(&run.s, ROWS).await;
    run.wait_published(mode, ROWS).await;
    run.assert_in_kafka_once(ROWS as usize).await;
    run.finish(&format!("{ROWS} rows of 10 KB ({mode})"));
}

#[tokio::test(flavor = "multi_thread")]
async fn fifty_thousand_ten_kilobyte_rows_stream_in_bounded_memory() {
    fifty_thousand_ten_kilobyte_rows("replication").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn fifty_thousand_ten_kilobyte_rows_are_polled_in_bounded_memory() {
    fifty_thousand_ten_kilobyte_rows("polling").await;
}

/// The largest claim a polling relay logged ("batch committed claimed=N").
fn largest_claim(log: &std::path::Path) -> usize {
    let log = std::fs::read_to_string(log).unwrap();
    let claims = log.lines().filter(|l| l.contains("batch committed")).filter_map(|l| {
        let (_, rest) = l.split_once("claimed=")?;
        rest.split(|c: char| !c.is_ascii_digit()).next()?.parse().ok()
    });
    claims.max().unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_polling_claim_ends_at_its_byte_budget() {
    // given a polling relay claiming up to 5,000 rows, or 1 MiB of them
    let env = [
        ("OUTBOX_RELAY__POLLING__BATCH_SIZE", "5000"),
        ("OUTBOX_RELAY__POLLING__MAX_BATCH_BYTES", "1048576"),
    ];
    let run = Run::start_with_env("polling", &env).await;

    // when 5,000 rows of 10 KB wait in the table
    write_ten_kilobyte_rows(&run.s, 5_000).await;
    run.wait_published("polling", 5_000).await;

    // then every claim stayed near 1 MiB (about 100 rows, never the 5,000 the count allows)
    let largest = largest_claim(&run.relay.log);
    assert!((50..=110).contains(&largest), "the largest claim held {largest} rows of 10 KB");
    run.assert_in_kafka_once(5_000).await;
    run.finish("5,000 rows of 10 KB in claims of 1 MiB");
}

/// Commits `rows` rows of 900 KB (Kafka takes records up to 1 MB), in transactions of 10.
async fn write_large_rows(s: &Setup, rows: i64) {
    write_rows(s, rows, 10, 28_125).await
}

/// 400 rows of 900 KB: a backlog the stream's read-ahead (1,024 changes) would have held whole.
const LARGE_ROWS: i64 = 400;

#[tokio::test(flavor = "multi_thread")]
async fn a_backlog_of_large_rows_streams_in_bounded_memory() {
    // given a running relay with 4 MiB in flight at most, and a backlog of large rows written
    // while it was stopped
    let run =
        Run::start_with_env("replication", &[("OUTBOX_RELAY__REPLICATION__MAX_IN_FLIGHT_BYTES", "4194304")])
            .await;
    signal(run.relay.pid(), "-STOP");
    write_large_rows(&run.s, LARGE_ROWS).await;
    signal(run.relay.pid(), "-CONT");
    // then it is relayed whole, within docs/deployment.md's bound: an idle relay's 21 MiB plus 4.5 times
    // the bytes it may hold, in flight (4 MiB) and read ahead (8 MiB; it read 1,024 changes
    // ahead, whatever their size: 118 MiB here before)
    run.wait_published("replication", LARGE_ROWS).await;
    run.assert_in_kafka_once(LARGE_ROWS as usize).await;
    let bound = (21 << 20) + (4 + 8) * (9 << 20) / 2;
    run.finish_within(&format!("{LARGE_ROWS} rows of 900 KB streamed"), bound);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_first_copy_of_large_rows_is_chunked_in_bytes() {
    // given large rows in the table before the slot exists
    let run = Run::start_after("replication", &[], async |s| write_large_rows(s, LARGE_ROWS).await).await;
    // then the first copy publishes them in bounded memory: a chunk ends at
    // replication.max_in_flight_bytes, not only at 2,000 rows
    run.wait_published("replication", LARGE_ROWS).await;
    run.assert_in_kafka_once(LARGE_ROWS as usize).await;
    run.finish(&format!("{LARGE_ROWS} rows of 900 KB copied"));
}

/// One 50 MB row between two small ones of the same aggregate: Kafka takes at most 1 MB, so
/// the row is dead-lettered whole, with its reason, and the small ones are published.
async fn a_fifty_megabyte_row(mode: &str) {
    const BLOB: i32 = 50_000_000;
    let run = Run::start(mode).await;
    let client = run.s.db.client().await;
    let insert = "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload) \
                  VALUES ($1, 'agg', 'E', jsonb_build_object('blob', repeat('x', $2)))";
    for size in [1, BLOB, 1] {
        client.execute(insert, &[&run.s.aggregate_type, &size]).await.unwrap();
    }
    run.wait_published(mode, 2).await;
    let dead: Vec<(String, i32)> = client
        .query("SELECT reason, length(row_data->>'payload') FROM outbox_dead_letter", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert!(dead[0].0.to_lowercase().contains("too large"), "reason: {}", dead[0].0);
    // and the reason names the limits to raise
    assert!(
        dead[0].0.contains("message.max.bytes") && dead[0].0.contains("max.message.bytes"),
        "{}",
        dead[0].0
    );
    assert!(dead[0].1 > BLOB, "the dead-lettered payload is cut: {} bytes", dead[0].1);
    run.assert_in_kafka_once(2).await;
    run.finish(&format!("a 50 MB row ({mode})"));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_fifty_megabyte_row_is_dead_lettered_whole_from_the_stream() {
    a_fifty_megabyte_row("replication").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_fifty_megabyte_row_is_dead_lettered_whole_by_polling() {
    a_fifty_megabyte_row("polling").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_transaction_of_two_hundred_thousand_events_arrives_whole() {
    const EVENTS: i64 = 200_000;
    let run = Run::start("replication").await;
    run.s
        .db
        .client()
        .await
        .execute(
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload) \
             SELECT $1, 'agg-' || (g % 1000), 'E', jsonb_build_object('n', g) FROM generate_series(1, $2::bigint) g",
            &[&run.s.aggregate_type, &EVENTS],
        )
        .await
        .unwrap();
    run.wait_published("replication", EVENTS).await;
    run.assert_in_kafka_once(EVENTS as usize).await;
    run.finish(&format!("one transaction of {EVENTS} events"));
}

#[tokio::test(flavor = "multi_thread")]
async fn changes_over_the_stream_limit_are_dead_lettered_by_reference_or_skipped_not_fatal() {
    // given a streaming relay that reads changes of at most 1 MiB
    let limit = [("OUTBOX_RELAY__REPLICATION__MAX_MESSAGE_BYTES", "1048576")];
    let run = Run::start_with_env("replication", &limit).await;
    let client = run.s.db.client().await;
    let insert = "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload) \
                  VALUES ($1, 'agg', 'E', jsonb_build_object('blob', repeat('x', $2))) RETURNING id::text";
    let write = async |size: i32| -> String {
        client.query_one(insert, &[&run.s.aggregate_type, &size]).await.unwrap().get(0)
    };

    // when a 2 MB row is committed between two small ones, and someone else's 2 MB logical
    // decoding message after them (it stopped the relay for good before, whatever its prefix)
    write(1).await;
    let big = write(2_000_000).await;
    write(1).await;
    let message = "SELECT pg_logical_emit_message(true, 'someone-else', repeat('y', 2000000))";
    client.execute(message, &[]).await.unwrap();
    write(1).await;

    // then the small ones are published, the big row is dead-lettered by reference (its id and
    // size: its content was never read), the message is skipped, and the slot moves past them
    run.wait_published("replication", 3).await;
    let dead: Vec<(Option<String>, String)> = client
        .query("SELECT row_data->>'id', reason FROM outbox_dead_letter", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0].0.as_deref(), Some(big.as_str()));
    assert!(dead[0].1.contains("more than replication.max_message_bytes (1048576)"), "{}", dead[0].1);
    assert!(dead[0].1.contains("dead-lettered by reference"), "{}", dead[0].1);
    let skipped = "outbox_relay_stream_messages_skipped_total{kind=\"foreign_message\"}";
    assert!(run.relay.metric(skipped).is_some_and(|n| n >= 1.0), "{}", run.relay.log_text());
    let end = wal_lsn(&client).await;
    wait_until(run.relay.context("the slot confirmed past the big changes".into()), async || {
        slot_confirmed_flush(&client, &run.s.slot).await >= end
    })
    .await;
    run.assert_in_kafka_once(3).await;
    run.finish("a 2 MB row and a 2 MB message over a 1 MiB stream limit");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_row_over_the_polling_row_limit_is_dead_lettered_unread_while_the_rest_flow_on() {
    // given a polling relay that fetches rows of at most 1 MiB
    const BLOB: i32 = 100_000_000;
    let limit = [("OUTBOX_RELAY__POLLING__MAX_ROW_BYTES", "1048576")];
    let run = Run::start_with_env("polling", &limit).await;
    let client = run.s.db.client().await;
    let insert = "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload) \
                  VALUES ($1, 'agg', 'E', jsonb_build_object('blob', repeat('x', $2))) RETURNING id::text";

    // when a 100 MB row is committed between two small ones of the same aggregate
    let mut ids = Vec::new();
    for size in [1, BLOB, 1] {
        ids.push(
            client.query_one(insert, &[&run.s.aggregate_type, &size]).await.unwrap().get::<_, String>(0),
        );
    }

    // then the small ones are published, and the big one is dead-lettered with its reason: the
    // letter holds it whole (PostgreSQL copied it: nothing is lost), unsigned, and it left the
    // outbox
    run.wait_published("polling", 2).await;
    wait_until(run.relay.context("the big row dead-lettered".into()), async || {
        client.query_one("SELECT count(*) FROM outbox_dead_letter", &[]).await.unwrap().get::<_, i64>(0) == 1
    })
    .await;
    let letter = client
        .query_one(
            "SELECT event_id, reason, length(row_data->>'payload'), digest IS NULL FROM outbox_dead_letter",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(letter.get::<_, String>(0), ids[1]);
    let reason: String = letter.get(1);
    assert!(reason.contains("more than polling.max_row_bytes (1048576)"), "{reason}");
    assert!(reason.contains("did not read it"), "{reason}");
    assert!(letter.get::<_, i32>(2) > BLOB, "the letter's payload is cut");
    assert!(letter.get::<_, bool>(3), "the relay signed a row it did not read");
    assert_eq!(run.s.outbox_rows().await, 0);
    run.assert_in_kafka_once(2).await;
    // and the relay never held the row: its peak RSS stayed under the row's own size
    run.finish_within("a 100 MB row over a 1 MiB polling row limit", BLOB as u64);
}
