//! The broker's floor (issue 33): how fast the same broker acknowledges a plain producer, warmed
//! up as the relay's steady state is, that writes what the relay writes, with the relay's
//! producer settings (acks=all, idempotence, `linger.ms` 5), at the steady state's rate and
//! shape (transactions of 10 events every 10,000/rate ms, ~200-byte values, 1,000 keys, five
//! headers); then the relay's commit-to-ack p99 at that rate (replication mode) as a multiple of
//! the floor's p99. Side by side in one run, the order flipped each run.
//!
//! The floor's latency is produce-to-ack: from `send` to the delivery report. The relay's
//! commit-to-ack also holds the walsender's send delay, the relay's decoding and batching, and
//! its own wait for a full batch; what the multiple leaves over the floor is the relay's share.
//!
//! `deploy/local/bench --only floor` runs this alone and writes its section of BENCHMARKS.md.

use std::time::{Duration, Instant};

use rdkafka::ClientConfig;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};

use super::common::{create_topic, random_topic, services};
use super::report::median;
use super::{Options, stat, steady_latency_in};

/// Issue 33's goals: the relay's p99 at 2,000 events/s at most this many ms, and at most this
/// multiple of the floor's.
const P99_GOAL_MS: f64 = 25.0;
const FLOOR_MULTIPLE_GOAL: f64 = 2.0;

#[derive(Default)]
pub struct FloorCost {
    floor_p50: Vec<f64>,
    floor_p99: Vec<f64>,
    relay_p99: Vec<f64>,
    consumer_p99: Vec<f64>,
}

fn rate(o: &Options) -> usize {
    o.rates.first().copied().unwrap_or(2_000)
}

pub async fn run(o: &Options) -> FloorCost {
    let mut cost = FloorCost::default();
    let rate = rate(o);
    for run in 1..=o.runs {
        for floor_first in if run % 2 == 1 { [true, false] } else { [false, true] } {
            if floor_first {
                eprintln!("[bench] floor run {run}/{}: a plain producer at {rate}/s", o.runs);
                let (p50, p99) = producer_latency(&o.kafka, rate, o.duration).await;
                eprintln!("[bench]   produce-to-ack p50 {p50:.1} ms, p99 {p99:.1} ms");
                cost.floor_p50.push(p50);
                cost.floor_p99.push(p99);
            } else {
                eprintln!("[bench] floor run {run}/{}: the relay (replication) at {rate}/s", o.runs);
                let l = steady_latency_in("replication", &o.kafka, rate, o.duration).await;
                eprintln!("[bench]   commit-to-ack p99 {:.1} ms", l.relay_p99_ms);
                cost.relay_p99.push(l.relay_p99_ms);
                cost.consumer_p99.push(l.p99_ms);
            }
        }
    }
    cost
}

/// A producer with the relay's settings (and `kafka`'s `key = value` lines, as the relay gets
/// them) writing bursts of 10 records at `rate` for `duration`: (p50, p99) produce-to-ack, ms.
async fn producer_latency(kafka: &str, rate: usize, duration: Duration) -> (f64, f64) {
    let topic = random_topic("floor");
    create_topic(&topic, super::PARTITIONS).await;
    let mut config = ClientConfig::new();
    config
        .set("bootstrap.servers", &services().kafka)
        .set("acks", "all")
        .set("enable.idempotence", "true")
        .set("linger.ms", outbox_relay::config::DEFAULT_KAFKA_LINGER_MS.to_string());
    for line in kafka.lines().filter_map(|l| l.split_once('=')) {
        if line.0.trim() == "linger_ms" {
            config.set("linger.ms", line.1.trim());
        }
    }
    let producer: FutureProducer = config.create().unwrap();
    let value = format!("{{\"note\": \"{}\"}}", "x".repeat(180));
    // warm up, as the relay's steady state is: the connections, the producer id and the
    // partitions' leaders are there before the first timed record (else the start is the p99)
    for partition in 0..super::PARTITIONS {
        let record = FutureRecord::to(&topic).key("warm-up").payload(&value).partition(partition);
        producer.send(record, Duration::from_secs(30)).await.map_err(|(e, _)| e).expect("a warm-up record");
    }
    let interval = Duration::from_secs_f64(10.0 / rate as f64);
    let (started, mut next, mut sent) = (Instant::now(), Instant::now(), 0usize);
    let mut acks = Vec::new();
    while started.elapsed() < duration {
        for _ in 0..10 {
            let key = (sent % 1000).to_string();
            let id = sent.to_string();
            let headers =
                ["outbox_relay_source", "outbox_relay_position", "id", "event_type", "aggregate_type"]
                    .into_iter()
                    .fold(OwnedHeaders::new_with_capacity(5), |h, key| {
                        h.insert(Header { key, value: Some(id.as_bytes()) })
                    });
            let record = FutureRecord::to(&topic).key(&key).payload(&value).headers(headers);
            let at = Instant::now();
            let delivery = producer.send_result(record).map_err(|(e, _)| e).expect("enqueue");
            acks.push(tokio::spawn(async move {
                delivery.await.expect("delivered").expect("acknowledged");
                at.elapsed().as_secs_f64() * 1000.0
            }));
            sent += 1;
        }
        next += interval;
        if let Some(wait) = next.checked_duration_since(Instant::now()) {
            tokio::time::sleep(wait).await;
        }
    }
    let mut ms = Vec::with_capacity(acks.len());
    for ack in acks {
        ms.push(ack.await.unwrap());
    }
    super::drop_topic(&topic).await;
    ms.sort_by(f64::total_cmp);
    let pct = |q: f64| ms[((ms.len() as f64 * q) as usize).min(ms.len() - 1)];
    (pct(0.5), pct(0.99))
}

/// The section's text (markdown).
pub fn render(o: &Options, cost: &FloorCost) -> String {
    let rate = rate(o);
    let multiple: Vec<f64> = cost.relay_p99.iter().zip(&cost.floor_p99).map(|(r, f)| r / f).collect();
    let mut out = format!(
        "{}  \nBoth with acks=all, idempotence and linger.ms {}{}.\n\n| measure ({rate} events/s for {} s; median of {} runs, min-max) | value |\n|---|---|\n",
        super::report::machine(),
        outbox_relay::config::DEFAULT_KAFKA_LINGER_MS,
        if o.kafka.is_empty() {
            String::new()
        } else {
            format!("; `[kafka]` {}", o.kafka.replace('\n', ", "))
        },
        o.duration.as_secs(),
        o.runs
    );
    out += &format!("| plain producer, produce-to-ack p50, ms | {} |\n", stat(&cost.floor_p50, 1));
    out +=
        &format!("| plain producer, produce-to-ack p99, ms (the floor) | {} |\n", stat(&cost.floor_p99, 1));
    out += &format!("| relay (replication), commit-to-ack p99, ms | {} |\n", stat(&cost.relay_p99, 1));
    out +=
        &format!("| relay (replication), commit-to-consumer p99, ms | {} |\n", stat(&cost.consumer_p99, 1));
    out += &format!("| relay commit-to-ack p99 / the floor's p99 (per run) | {} |\n", stat(&multiple, 2));
    let (p99, times) = (median(&cost.relay_p99), median(&multiple));
    let met = |ok: bool| if ok { "met" } else { "**missed**" };
    out + &format!(
        "\n| goal (issue 33) | measured | |\n|---|---|---|\n| commit-to-ack p99 at {rate} events/s <= {P99_GOAL_MS} ms | {p99:.1} ms | {} |\n| ... and within {FLOOR_MULTIPLE_GOAL}x of the broker's floor | {times:.2}x | {} |\n",
        met(p99 <= P99_GOAL_MS),
        met(times <= FLOOR_MULTIPLE_GOAL)
    )
}
