//! The steady state: a writer at a fixed rate against a running relay, and the latency from
//! each COMMIT returning to the consumer receiving its record (with the relay's own histogram,
//! its CPU and memory over the window). Used by the full run and by every `--only` section that
//! measures latency.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rdkafka::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer, StreamConsumer};
use rdkafka::message::{Headers, Message};
use tokio_postgres::Client;

use super::common::{self, TestDb, connect, create_topic, random_suffix, services, wait_until_within};
use super::{PARTITIONS, Relay, drop_topic};

#[derive(Clone)]
pub(super) struct Latency {
    pub(super) relay_p99_ms: f64,
    pub(super) p50_ms: f64,
    pub(super) p99_ms: f64,
    pub(super) max_ms: f64,
    pub(super) sustained: bool,
    /// The relay's CPU seconds per 100,000 events over the window (to its last event's
    /// acknowledgement).
    pub(super) cpu_per_100k: f64,
    /// The relay's peak RSS at the window's end, MiB.
    pub(super) rss_mib: f64,
    /// Offsets of the topic beyond the relay's records: with Kafka transactions, one commit
    /// marker per transaction and partition it wrote to.
    pub(super) markers: f64,
    /// The relay's threads over the window, by name ([`super::idle::threads`]): CPU seconds per
    /// 100k events, and wake-ups per second.
    pub(super) threads: BTreeMap<String, (f64, f64)>,
}

/// A writer at `rate` events/s (transactions of 10) against a running replication relay;
/// latency from the writer's COMMIT returning to the consumer receiving the record.
pub(super) async fn steady_latency(rate: usize, duration: Duration) -> Latency {
    steady_latency_in("replication", "", rate, duration).await
}

/// As [`steady_latency`], the relay in `mode` with `kafka` lines added to its `[kafka]`.
pub(super) async fn steady_latency_in(
    mode: &'static str,
    kafka: &str,
    rate: usize,
    duration: Duration,
) -> Latency {
    // start from a quiet server: flush what the backlog runs before wrote, so a checkpoint
    // triggered by their WAL does not land inside the latency window
    connect(&services().pg_url).await.batch_execute("CHECKPOINT").await.unwrap();
    let db = TestDb::new().await;
    let client = db.client().await;
    let aggregate_type = format!("l{}", random_suffix());
    let topic = format!("outbox.event.{aggregate_type}");
    create_topic(&topic, PARTITIONS).await;
    let slot = format!("s_{}", random_suffix());
    let relay = Relay::start_with(&db, mode, &slot, kafka, "");
    relay.process.wait_ready("active").await;
    let consumer = latency_consumer(&topic);
    // warm up before measuring: the relay reads the topic back before its first record to it
    // (up to a second or so), and the consumer settles; neither belongs in the steady state
    write_warm_up(&client, &aggregate_type).await;
    wait_until_within(Duration::from_secs(60), "the warm-up events", async || relay.published() >= 10.0)
        .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let scrape = || {
        let scrape = common::http::get(relay.process.metrics_port(), "/metrics").map(|(_, body)| body);
        scrape.unwrap_or_default()
    };
    let before = scrape();
    let cpu_before = relay.usage().1;
    let threads_before = super::idle::threads(relay.process.pid());
    let profile = super::profile::Profile::attach(relay.process.pid(), &format!("{mode}-at-{rate}"));
    let received = tokio::spawn(receive_ids(consumer));
    let (committed, achieved) = write_at_rate(&client, &aggregate_type, rate, duration).await;
    let expected = committed.len() * 10;
    let cpu = settled_cpu(&relay, 10 + expected).await - cpu_before;
    drop(profile);
    let per_100k = 100_000.0 / expected.max(1) as f64;
    let threads = super::idle::threads_since(relay.process.pid(), &threads_before)
        .into_iter()
        .map(|(name, (cpu, switches))| (name, (cpu * per_100k, switches / duration.as_secs_f64())))
        .collect();
    let at = received.await.unwrap();
    let relay_p99_ms =
        histogram_quantile(&before, &scrape(), "outbox_relay_end_to_end_latency_seconds", 0.99) * 1000.0;
    let markers = end_offsets(&topic) - relay.published();
    let rss_mib = relay.usage().0;
    drop(relay);
    drop(db);
    drop_topic(&topic).await;
    let (received, sustained) = judge_window(&committed, &at, rate, achieved, duration);
    Latency {
        relay_p99_ms,
        p50_ms: received.p50_ms,
        p99_ms: received.p99_ms,
        max_ms: received.max_ms,
        sustained,
        cpu_per_100k: cpu * per_100k,
        rss_mib,
        markers,
        threads,
    }
}

/// A window's commit-to-consumer latencies ([`commit_to_consumer`]), and whether the rate was
/// sustained: every event arrived, the writer kept its rate, and latency did not grow.
pub(super) fn judge_window(
    committed: &[Committed],
    at: &HashMap<i64, f64>,
    rate: usize,
    achieved: f64,
    duration: Duration,
) -> (Received, bool) {
    let expected = committed.len() * 10;
    let received = commit_to_consumer(committed, at, duration);
    let sustained = received.sustained && received.received == expected && achieved >= rate as f64 * 0.95;
    if !sustained {
        eprintln!(
            "[bench]   not sustained: {} of {expected} events received, {achieved:.0}/s written, p99 {:.1} ms in the \
             first half, {:.1} ms in the second",
            received.received, received.early_p99_ms, received.late_p99_ms
        );
    }
    (received, sustained)
}

/// Ten warm-up events (`aggregate_id` `warm-up`) before a steady state is measured.
pub(super) async fn write_warm_up(client: &Client, aggregate_type: &str) {
    client
        .execute(
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload) \
             SELECT $1, 'warm-up', 'WarmUp', '{}' FROM generate_series(1, 10)",
            &[&aggregate_type],
        )
        .await
        .unwrap();
}

/// A `read_committed` consumer of every partition of `topic` from its start: it sees a
/// transactional record once its transaction committed, as the readers of exactly once do.
pub(super) fn latency_consumer(topic: &str) -> StreamConsumer {
    let consumer: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", &services().kafka)
        .set("group.id", format!("bench-{}", random_suffix()))
        .set("auto.offset.reset", "earliest")
        .set("isolation.level", "read_committed")
        .set("fetch.wait.max.ms", "5")
        .set("fetch.min.bytes", "1")
        .create()
        .unwrap();
    // every partition assigned, no consumer group: the local broker takes ~20 s to complete a
    // group join, longer than the first receive waits (the NaN rows of earlier short runs)
    let mut assignment = rdkafka::TopicPartitionList::new();
    for partition in 0..PARTITIONS {
        assignment.add_partition_offset(topic, partition, rdkafka::Offset::Beginning).unwrap();
    }
    consumer.assign(&assignment).unwrap();
    consumer
}

/// When each record arrived, by its `id` header, until none came for 15 s.
pub(super) async fn receive_ids(consumer: StreamConsumer) -> HashMap<i64, f64> {
    let mut at: HashMap<i64, f64> = HashMap::new();
    while let Ok(Ok(m)) = tokio::time::timeout(Duration::from_secs(15), consumer.recv()).await {
        let id: i64 = m
            .headers()
            .and_then(|h| {
                h.iter()
                    .find(|h| h.key == "id")
                    .and_then(|h| std::str::from_utf8(h.value?).ok()?.parse().ok())
            })
            .unwrap_or(-1);
        at.insert(id, now_secs());
    }
    at
}

/// A transaction the writer committed: its events' ids (one apart: the sequence steps by one per
/// row since sql/013_outbox_event_ids_step_one.sql), when COMMIT returned, and the seconds into the
/// window.
type Committed = (Vec<i64>, f64, f64);

/// Commits transactions of 10 events at `rate` events/s for `duration`; returns each one's
/// (ids, commit time, seconds into the window) and the rate achieved.
pub(super) async fn write_at_rate(
    client: &Client,
    aggregate_type: &str,
    rate: usize,
    duration: Duration,
) -> (Vec<Committed>, f64) {
    let txns_per_sec = (rate / 10).max(1);
    let interval = Duration::from_secs_f64(1.0 / txns_per_sec as f64);
    let mut committed = Vec::new();
    let started = Instant::now();
    let mut next = started;
    while started.elapsed() < duration {
        let row = client
            .query_one(
                "WITH ins AS (INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload)
                   SELECT $1, (g % 1000)::text, 'OrderPlaced', jsonb_build_object('note', repeat('x', 150))
                   FROM generate_series(1, 10) g RETURNING id) SELECT array_agg(id) FROM ins",
                &[&aggregate_type],
            )
            .await
            .unwrap();
        committed.push((row.get(0), now_secs(), started.elapsed().as_secs_f64()));
        next += interval;
        if let Some(wait) = next.checked_duration_since(Instant::now()) {
            tokio::time::sleep(wait).await;
        }
    }
    let achieved = committed.len() as f64 * 10.0 / started.elapsed().as_secs_f64();
    (committed, achieved)
}

/// The relay's CPU seconds once it published `events` (or 30 s passed): the window's work
/// without the idle wait for late records after it.
async fn settled_cpu(relay: &Relay, events: usize) -> f64 {
    let limit = Instant::now() + Duration::from_secs(30);
    while relay.published() < events as f64 && Instant::now() < limit {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    relay.usage().1
}

/// Commit-to-consumer latencies of a window.
pub(super) struct Received {
    received: usize,
    pub(super) p50_ms: f64,
    pub(super) p99_ms: f64,
    pub(super) max_ms: f64,
    early_p99_ms: f64,
    late_p99_ms: f64,
    /// The p99 of the window's second half is at most twice its first half's (or 250 ms).
    sustained: bool,
}

/// Each committed event's latency from its commit to its arrival (`at`).
fn commit_to_consumer(committed: &[Committed], at: &HashMap<i64, f64>, duration: Duration) -> Received {
    let (mut all, mut early, mut late) = (Vec::new(), Vec::new(), Vec::new());
    for (ids, commit, elapsed) in committed {
        for id in ids {
            if let Some(t) = at.get(id) {
                let ms = (t - commit) * 1000.0;
                all.push(ms);
                if *elapsed < duration.as_secs_f64() / 2.0 { early.push(ms) } else { late.push(ms) }
            }
        }
    }
    for v in [&mut all, &mut early, &mut late] {
        v.sort_by(f64::total_cmp);
    }
    let pct =
        |v: &[f64], p: f64| if v.is_empty() { f64::NAN } else { v[((v.len() - 1) as f64 * p) as usize] };
    Received {
        received: all.len(),
        p50_ms: pct(&all, 0.5),
        p99_ms: pct(&all, 0.99),
        max_ms: all.last().copied().unwrap_or(f64::NAN),
        early_p99_ms: pct(&early, 0.99),
        late_p99_ms: pct(&late, 0.99),
        sustained: pct(&late, 0.99) <= (pct(&early, 0.99) * 2.0).max(250.0),
    }
}

/// The sum of `topic`'s partition end offsets: its records, and its transaction markers.
pub(super) fn end_offsets(topic: &str) -> f64 {
    let consumer: BaseConsumer =
        ClientConfig::new().set("bootstrap.servers", &services().kafka).create().unwrap();
    (0..PARTITIONS)
        .map(|p| consumer.fetch_watermarks(topic, p, Duration::from_secs(10)).map_or(0, |(_, high)| high))
        .sum::<i64>() as f64
}

/// `histogram_quantile` over the cumulative buckets of `name` between two scrapes (what was
/// observed after `before`), interpolating linearly inside the bucket as Prometheus does.
pub(super) fn histogram_quantile(before: &str, after: &str, name: &str, q: f64) -> f64 {
    // (the bucket's labels are the deployment's and `le`)
    let prefix = format!("{name}_bucket{{");
    let buckets = |scrape: &str| -> Vec<(f64, f64)> {
        scrape
            .lines()
            .filter_map(|l| l.strip_prefix(&prefix))
            .filter_map(|rest| {
                let (labels, count) = rest.rsplit_once("} ")?;
                let le = labels.split(',').find_map(|l| l.strip_prefix("le=\""))?.trim_end_matches('"');
                let le = if le == "+Inf" { f64::INFINITY } else { le.parse().ok()? };
                Some((le, count.parse().ok()?))
            })
            .collect()
    };
    let earlier = buckets(before);
    let buckets: Vec<(f64, f64)> = buckets(after)
        .into_iter()
        .map(|(le, count)| (le, count - earlier.iter().find(|(l, _)| *l == le).map_or(0.0, |(_, c)| *c)))
        .collect();
    let Some(&(_, total)) = buckets.last() else { return f64::NAN };
    let rank = q * total;
    let (mut lower, mut below) = (0.0, 0.0);
    for (le, count) in buckets {
        if count >= rank {
            if le.is_infinite() {
                return lower;
            }
            return lower + (le - lower) * ((rank - below) / (count - below).max(1.0));
        }
        (lower, below) = (le, count);
    }
    lower
}

fn now_secs() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs_f64()
}
