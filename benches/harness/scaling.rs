//! `deploy/local/bench --only scaling`: the replication drain's rate, CPU per event, memory and
//! bytes in flight as payloads grow (100 B, 1 KB, 10 KB at 10 events per transaction) and as
//! transactions grow (1, 10, 100 events of 1 KB each), each beside `pg_recvlogical` on the same
//! WAL and a plain producer sending as many records of the same size to the same broker (the
//! 10 KB point is the network-bound case: bytes, not events, are the work). Writes a table (the
//! `scaling` section of BENCHMARKS.md) and a chart, `benches/scaling.svg`.

use std::path::Path;

use outbox_relay::config::DEFAULT_MAX_IN_FLIGHT_BYTES;

use super::{Drain, Options, Shape, producer_limit, replication_drain, stat};

/// (payload bytes, events per transaction, events drained): the byte volume stays at 200 MB or
/// under, so a point takes seconds, not minutes.
const VARIANTS: [(i32, i32, usize); 5] = [
    (100, 10, 200_000),
    (1_000, 10, 100_000),
    (10_000, 10, 20_000),
    (1_000, 1, 100_000),
    (1_000, 100, 100_000),
];

pub struct Point {
    payload_bytes: i32,
    per_txn: i32,
    events: usize,
    drains: Vec<Drain>,
    /// `pg_recvlogical`'s seconds on the same WAL, one per drain.
    recvlogical: Vec<f64>,
    /// A plain producer's seconds for as many records of the same size, one per drain: the
    /// broker's own ceiling.
    producer: Vec<f64>,
}

pub async fn run(o: &Options) -> Vec<Point> {
    let mut points: Vec<Point> = VARIANTS
        .iter()
        .map(|&(payload_bytes, per_txn, events)| Point {
            payload_bytes,
            per_txn,
            events,
            drains: Vec::new(),
            recvlogical: Vec::new(),
            producer: Vec::new(),
        })
        .collect();
    for run in 1..=o.runs {
        for p in &mut points {
            eprintln!(
                "[bench] run {run}/{}: replication drain of {} events of {} B, {} per transaction",
                o.runs, p.events, p.payload_bytes, p.per_txn
            );
            let shape = Shape { per_txn: p.per_txn, payload_bytes: p.payload_bytes };
            let (d, recvlogical) = replication_drain(p.events, Some(shape), true).await;
            let recvlogical = recvlogical.expect("a twin slot was asked for");
            eprintln!(
                "[bench]   {:.0} events/s (pg_recvlogical {:.0}), {:.2} CPU s/100k, peak RSS {:.1} MiB, at most {:.1} MiB in flight",
                p.events as f64 / d.seconds,
                p.events as f64 / recvlogical,
                d.cpu_per_100k,
                d.rss_mib,
                d.max_bytes_in_flight / (1 << 20) as f64
            );
            p.drains.push(d);
            p.recvlogical.push(recvlogical);
            let producer = producer_limit(p.events, Some(p.payload_bytes as usize)).await;
            eprintln!("[bench]   a plain producer: {:.0} records/s", p.events as f64 / producer);
            p.producer.push(producer);
        }
    }
    points
}

fn rates(p: &Point) -> Vec<f64> {
    p.drains.iter().map(|d| p.events as f64 / d.seconds).collect()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

pub fn render(o: &Options, points: &[Point]) -> String {
    let bound = DEFAULT_MAX_IN_FLIGHT_BYTES as f64 / (1 << 20) as f64;
    let mut out = format!(
        "Replication drains, median of {} runs (min-max); the relay at its defaults \
         (replication.max_in_flight_bytes = {bound} MiB).\n\n\
         | payload | events per transaction | events | drain, events/s | after the first event, events/s | MB/s | `pg_recvlogical` on the same WAL, events/s | relay / `pg_recvlogical` | plain producer, records/s | relay / plain producer | relay CPU s per 100k events | peak RSS, MiB | most bytes in flight seen, MiB |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
        o.runs
    );
    for p in points {
        let field = |f: fn(&Drain) -> f64| p.drains.iter().map(f).collect::<Vec<_>>();
        let mbps: Vec<f64> = rates(p).iter().map(|r| r * p.payload_bytes as f64 / 1e6).collect();
        let recvlogical: Vec<f64> = p.recvlogical.iter().map(|s| p.events as f64 / s).collect();
        // each run's relay beside its own pg_recvlogical
        let ratio: Vec<f64> = p.drains.iter().zip(&p.recvlogical).map(|(d, r)| r / d.seconds).collect();
        let producer: Vec<f64> = p.producer.iter().map(|s| p.events as f64 / s).collect();
        let of_producer: Vec<f64> = p.drains.iter().zip(&p.producer).map(|(d, s)| s / d.seconds).collect();
        out += &format!(
            "| {} B | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
            p.payload_bytes,
            p.per_txn,
            p.events,
            stat(&rates(p), 0),
            stat(&field(|d| d.after_first), 0),
            stat(&mbps, 1),
            stat(&recvlogical, 0),
            stat(&ratio, 2),
            stat(&producer, 0),
            stat(&of_producer, 2),
            stat(&field(|d| d.cpu_per_100k), 2),
            stat(&field(|d| d.rss_mib), 1),
            stat(&field(|d| d.max_bytes_in_flight / (1 << 20) as f64), 1),
        );
    }
    let largest = points.iter().map(|p| p.payload_bytes as usize).max().unwrap_or(0);
    let most = points.iter().flat_map(|p| &p.drains).map(|d| d.max_bytes_in_flight).fold(0.0, f64::max);
    out += &format!(
        "\nThe byte bound: the most bytes in flight seen (sampled about every 50 ms) was {:.1} MiB ({most:.0} \
         bytes) against the {bound} MiB bound, which reading may pass by one record: {}.\n\n![scaling curve](benches/scaling.svg)\n",
        most / (1 << 20) as f64,
        // (one record past the bound: the largest payload, and 1 KiB for its key, topic and headers)
        if most <= (DEFAULT_MAX_IN_FLIGHT_BYTES + largest + 1_024) as f64 {
            "never exceeded"
        } else {
            "**exceeded**"
        }
    );
    out
}

/// Two bar panels (events/s by payload size, by transaction size), each bar labelled with its
/// rate and CPU per 100k events.
pub fn write_chart(points: &[Point]) {
    let panel = |title: &str, chosen: Vec<(&Point, String)>, x0: f64| {
        let top = chosen.iter().map(|(p, _)| median(rates(p))).fold(1.0, f64::max);
        let mut svg = format!(
            "<text x=\"{}\" y=\"24\" font-size=\"14\" text-anchor=\"middle\">{title}</text>\n",
            x0 + 160.0
        );
        for (i, (p, label)) in chosen.iter().enumerate() {
            let rate = median(rates(p));
            let cpu = median(p.drains.iter().map(|d| d.cpu_per_100k).collect());
            let h = 200.0 * rate / top;
            let x = x0 + 20.0 + i as f64 * 100.0;
            svg += &format!(
                "<rect x=\"{x}\" y=\"{:.1}\" width=\"70\" height=\"{h:.1}\" fill=\"#4a78b5\"/>\n\
                 <text x=\"{:.1}\" y=\"{:.1}\" font-size=\"11\" text-anchor=\"middle\">{rate:.0}/s</text>\n\
                 <text x=\"{:.1}\" y=\"262\" font-size=\"12\" text-anchor=\"middle\">{label}</text>\n\
                 <text x=\"{:.1}\" y=\"278\" font-size=\"10\" text-anchor=\"middle\" fill=\"#555\">{cpu:.2} CPU s/100k</text>\n",
                245.0 - h,
                x + 35.0,
                240.0 - h,
                x + 35.0,
                x + 35.0
            );
        }
        svg
    };
    let by_payload: Vec<(&Point, String)> =
        points.iter().filter(|p| p.per_txn == 10).map(|p| (p, format!("{} B", p.payload_bytes))).collect();
    let by_txn: Vec<(&Point, String)> = points
        .iter()
        .filter(|p| p.payload_bytes == 1_000)
        .map(|p| (p, format!("{} / txn", p.per_txn)))
        .collect();
    let mut by_txn = by_txn;
    by_txn.sort_by_key(|(p, _)| p.per_txn);
    let svg = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"720\" height=\"300\" font-family=\"sans-serif\">\n\
         <rect width=\"720\" height=\"300\" fill=\"white\"/>\n{}{}\
         <line x1=\"20\" y1=\"245\" x2=\"700\" y2=\"245\" stroke=\"#333\"/>\n</svg>\n",
        panel("replication drain, events/s, by payload (10 per txn)", by_payload, 0.0),
        panel("by events per transaction (1 KB payloads)", by_txn, 360.0),
    );
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/scaling.svg");
    std::fs::write(&path, svg).unwrap();
    eprintln!("[bench] wrote {}", path.display());
}
