//! Writers that behave like applications, and the delivery checks every test shares.
//!
//! Each event's payload is `{"seq": n}` where n counts the events of its aggregate, allocated
//! under the aggregate's row lock in the same transaction as the outbox insert (as docs/outbox-table.md
//! tells applications to do). So "per-aggregate order holds" means: per key, the first
//! arrivals are exactly 1, 2, ..., N.

use std::collections::{HashMap, HashSet};

use tokio_postgres::Client;

use super::Consumed;

pub const AGGREGATE_SQL: &str =
    "CREATE TABLE IF NOT EXISTS test_aggregates (id text PRIMARY KEY, seq bigint NOT NULL DEFAULT 0)";

/// Inserts one outbox row of event type `E` and payload `{}` for `aggregate_id` (None: a NULL
/// aggregate id, for poison tests whose table allows it).
pub async fn insert_event(client: &Client, aggregate_type: &str, aggregate_id: Option<&str>) {
    client
        .execute(
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload) VALUES ($1, $2, 'E', '{}')",
            &[&aggregate_type, &aggregate_id],
        )
        .await
        .unwrap();
}

/// The ids of the outbox's rows, in order.
pub async fn outbox_ids(client: &Client) -> Vec<i64> {
    let rows = client.query("SELECT id FROM outbox_events ORDER BY id", &[]).await.unwrap();
    rows.iter().map(|r| r.get(0)).collect()
}

/// Creates `count` aggregates named `agg-0` .. `agg-{count-1}`.
pub async fn create_aggregates(client: &Client, count: usize) {
    client.batch_execute(AGGREGATE_SQL).await.unwrap();
    client
        .execute(
            "INSERT INTO test_aggregates (id) SELECT 'agg-' || g FROM generate_series(0, $1 - 1) g ON CONFLICT DO NOTHING",
            &[&(count as i32)],
        )
        .await
        .unwrap();
}

/// One transaction: `events` events for `aggregate`, then COMMIT (or ROLLBACK when
/// `commit` is false). Returns the number of events committed.
pub async fn write_events(
    client: &mut Client,
    aggregate_type: &str,
    aggregate: &str,
    events: usize,
    commit: bool,
) -> usize {
    write_txn(client, aggregate_type, aggregate, events, commit).await.len()
}

/// As [`write_events`], returning the committed events' seqs (empty after a rollback).
pub async fn write_txn(
    client: &mut Client,
    aggregate_type: &str,
    aggregate: &str,
    events: usize,
    commit: bool,
) -> Vec<i64> {
    try_write_txn(client, aggregate_type, aggregate, events, commit).await.unwrap()
}

/// As [`write_txn`], returning the server's error (a server that died mid-run).
pub async fn try_write_txn(
    client: &mut Client,
    aggregate_type: &str,
    aggregate: &str,
    events: usize,
    commit: bool,
) -> Result<Vec<i64>, tokio_postgres::Error> {
    let tx = client.transaction().await?;
    let mut seqs = Vec::with_capacity(events);
    for _ in 0..events {
        let seq: i64 = tx
            .query_one("UPDATE test_aggregates SET seq = seq + 1 WHERE id = $1 RETURNING seq", &[&aggregate])
            .await?
            .get(0);
        tx.execute(
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload) \
             VALUES ($1, $2, 'SeqEvent', jsonb_build_object('seq', $3::bigint))",
            &[&aggregate_type, &aggregate, &seq],
        )
        .await?;
        seqs.push(seq);
    }
    if commit {
        tx.commit().await?;
        Ok(seqs)
    } else {
        tx.rollback().await?;
        Ok(Vec::new())
    }
}

/// `writers` concurrent connections write `total` events over `aggregates` aggregates in
/// transactions of 1 to 5 events. Returns the number of events per aggregate.
pub async fn write_concurrently(
    db_url: &str,
    aggregate_type: &str,
    aggregates: usize,
    total: usize,
    writers: usize,
) -> HashMap<String, i64> {
    let mut tasks = Vec::new();
    for w in 0..writers {
        let url = db_url.to_string();
        let aggregate_type = aggregate_type.to_string();
        let share = total / writers + usize::from(w < total % writers);
        tasks.push(tokio::spawn(async move {
            let mut client = super::connect(&url).await;
            let mut written = 0;
            while written < share {
                let aggregate = format!("agg-{}", rand::random_range(0..aggregates));
                let n = rand::random_range(1..=5).min(share - written);
                written += write_events(&mut client, &aggregate_type, &aggregate, n, true).await;
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    committed_counts(&super::connect(db_url).await).await
}

pub async fn committed_counts(client: &Client) -> HashMap<String, i64> {
    client
        .query("SELECT id, seq FROM test_aggregates WHERE seq > 0", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect()
}

/// What arrived, checked against what was committed.
#[derive(Debug)]
pub struct DeliveryReport {
    pub unique: usize,
    pub duplicates: usize,
}

pub fn seq_of(record: &Consumed) -> i64 {
    let payload: serde_json::Value = serde_json::from_str(record.payload.as_deref().unwrap()).unwrap();
    payload["seq"].as_i64().unwrap()
}

/// Asserts: every committed event arrived, nothing else arrived, each key stayed on one
/// partition, and per key the first arrivals are 1..=N in order. Returns the duplicate count.
pub fn assert_delivered(records: &[Consumed], committed: &HashMap<String, i64>) -> DeliveryReport {
    let mut seen: HashSet<String> = HashSet::new();
    let mut next: HashMap<String, i64> = HashMap::new();
    let mut partition_of: HashMap<String, (String, i32)> = HashMap::new();
    let mut duplicates = 0;
    for r in records {
        let id = r.header("id").expect("id header").to_string();
        let key = r.key.clone().expect("key");
        let seq = seq_of(r);
        let partition = partition_of.entry(key.clone()).or_insert((r.topic.clone(), r.partition));
        assert_eq!(*partition, (r.topic.clone(), r.partition), "aggregate {key} arrived on two partitions");
        if !seen.insert(id) {
            duplicates += 1;
            continue;
        }
        let expected = next.entry(key.clone()).or_insert(1);
        assert_eq!(
            seq, *expected,
            "aggregate {key}: first arrival of seq {seq}, expected {expected} (reordered or lost)"
        );
        *expected += 1;
    }
    for (key, n) in committed {
        let got = next.get(key).copied().unwrap_or(1) - 1;
        assert_eq!(got, *n, "aggregate {key}: {got} of {n} committed events arrived");
    }
    for key in next.keys() {
        assert!(committed.contains_key(key), "events arrived for {key}, which committed none (phantom)");
    }
    DeliveryReport { unique: seen.len(), duplicates }
}

/// Consumes until `unique` distinct event ids arrived (or `idle` passes with nothing new),
/// then for `linger` more, so late duplicates are counted too.
pub async fn consume_unique(
    consumer: &rdkafka::consumer::StreamConsumer,
    unique: usize,
    idle: std::time::Duration,
    linger: std::time::Duration,
) -> Vec<Consumed> {
    let mut records = Vec::new();
    let mut ids = HashSet::new();
    while ids.len() < unique {
        let batch = super::consume(consumer, 1, idle).await;
        if batch.is_empty() {
            break;
        }
        for r in batch {
            ids.insert(r.header("id").unwrap_or_default().to_string());
            records.push(r);
        }
    }
    records.extend(super::consume(consumer, usize::MAX, linger).await);
    records
}

/// The distinct event ids among `records`.
pub fn unique_ids(records: &[Consumed]) -> HashSet<String> {
    records.iter().map(|r| r.header("id").unwrap_or_default().to_string()).collect()
}
