//! Prints the records of Kafka topics as they arrive; creates the topics when missing.
//! Used by `deploy/local/demo`:  cargo run --example tail -- BROKERS TOPIC [TOPIC...]

use std::time::Duration;

use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::{Headers, Message};

#[tokio::main]
async fn main() {
    let mut args = std::env::args().skip(1);
    let brokers = args.next().expect("usage: tail BROKERS TOPIC [TOPIC...]");
    let topics: Vec<String> = args.collect();
    assert!(!topics.is_empty(), "usage: tail BROKERS TOPIC [TOPIC...]");

    let admin: AdminClient<DefaultClientContext> =
        ClientConfig::new().set("bootstrap.servers", &brokers).create().expect("admin client");
    let new_topics: Vec<NewTopic> =
        topics.iter().map(|t| NewTopic::new(t, 3, TopicReplication::Fixed(1))).collect();
    for result in admin.create_topics(&new_topics, &AdminOptions::new()).await.expect("create topics") {
        match result {
            Ok(topic) => eprintln!("[tail] created topic {topic}"),
            Err((topic, e)) => eprintln!("[tail] topic {topic}: {e}"),
        }
    }

    let consumer: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .set("group.id", "outbox-relay-demo-tail")
        .set("auto.offset.reset", "earliest")
        .set("topic.metadata.refresh.interval.ms", "1000")
        .create()
        .expect("consumer");
    let names: Vec<&str> = topics.iter().map(String::as_str).collect();
    consumer.subscribe(&names).expect("subscribe");
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
