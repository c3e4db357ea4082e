//! Prints the records of Kafka topics as they arrive. Used by `deploy/local/demo`, which creates
//! the topics first (deploy/local/topics):  cargo run --example tail -- BROKERS TOPIC [TOPIC...]
//!
//! It assigns itself every partition from the beginning instead of joining a consumer group: the
//! local broker takes about 20 s to complete a group join, so a subscribing tail printed the
//! demo's first records 20 s after the ledger had already applied them.

use std::time::Duration;

use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::{Headers, Message};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};

#[tokio::main]
async fn main() {
    let mut args = std::env::args().skip(1);
    let brokers = args.next().expect("usage: tail BROKERS TOPIC [TOPIC...]");
    let topics: Vec<String> = args.collect();
    assert!(!topics.is_empty(), "usage: tail BROKERS TOPIC [TOPIC...]");

    let consumer: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .set("group.id", "outbox-relay-demo-tail")
        .set("enable.auto.commit", "false")
        .create()
        .expect("consumer");
    let mut assignment = TopicPartitionList::new();
    for topic in &topics {
        let metadata = consumer.fetch_metadata(Some(topic), Duration::from_secs(10)).expect("topic metadata");
        let partitions =
            metadata.topics().iter().find(|t| t.name() == topic).map_or(0, |t| t.partitions().len());
        assert!(
            partitions > 0,
            "topic {topic} does not exist: create it (deploy/local/topics {brokers} {topic})"
        );
        for partition in 0..partitions as i32 {
            assignment.add_partition_offset(topic, partition, Offset::Beginning).expect("assignment");
        }
    }
    consumer.assign(&assignment).expect("assign");
    let names: Vec<&str> = topics.iter().map(String::as_str).collect();
    eprintln!("[tail] waiting for records on {}", names.join(", "));
    loop {
        match consumer.recv().await {
            Ok(m) => {
                let headers: Vec<String> = m
                    .headers()
                    .map(|hs| {
                        hs.iter()
                            .map(|h| {
                                format!("{}={}", h.key, String::from_utf8_lossy(h.value.unwrap_or_default()))
                            })
                            .collect()
                    })
                    .unwrap_or_default();
                println!(
                    "{}[{}]@{} key={} headers[{}] {}",
                    m.topic(),
                    m.partition(),
                    m.offset(),
                    String::from_utf8_lossy(m.key().unwrap_or_default()),
                    headers.join(" "),
                    String::from_utf8_lossy(m.payload().unwrap_or_default())
                );
            }
            Err(e) => {
                eprintln!("[tail] {e}");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    }
}
