//! The metrics and health listener faces whatever can reach the pod: 2,000 connections that send
//! half a request and wait must not stop `/healthz` from answering, nor the relay from
//! reconnecting to PostgreSQL and relaying, and the server closes them itself.

use crate::common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::http::get;
use common::workload::*;
use common::*;

#[tokio::test(flavor = "multi_thread")]
async fn two_thousand_slow_connections_do_not_stop_health_or_relaying() {
    // given a relaying polling relay
    let s = Setup::create(&services().kafka, "", true, |_| {
        RelayToml::polling().set("retry", "initial_backoff_ms", 100).set("retry", "max_backoff_ms", 1000)
    })
    .await;
    let client = s.db.client().await;
    create_aggregates(&client, 1).await;
    let consumer = consumer(&[&s.topic]);
    let mut relay = s.start("relay");
    relay.wait_ready("active").await;
    let port = relay.metrics_port();

    // when 2,000 connections each send half a request and wait
    let slow: Vec<TcpStream> = (0..2_000)
        .map(|_| {
            let mut stream = TcpStream::connect(("127.0.0.1", port)).expect("connect");
            stream.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n").unwrap();
            stream
        })
        .collect();

    // then /healthz still answers, at once
    let (status, body) = get(port, "/healthz").expect("/healthz did not answer");
    assert_eq!((status, body.as_str()), (200, "ok\n"));

    // and the relay survives losing its PostgreSQL session: it reconnects and relays
    // (the session holding the leader lock is the one that claims)
    terminate_one(
        &client,
        "SELECT count(pg_terminate_backend(pid)) FROM (SELECT DISTINCT pid FROM pg_locks \
         WHERE locktype = 'advisory' AND database = (SELECT oid FROM pg_database WHERE datname = current_database())) l",
        &[],
    )
    .await;
    let mut writer = s.db.client().await;
    write_events(&mut writer, &s.aggregate_type, "agg-0", 5, true).await;
    assert_eq!(consume(&consumer, 5, IDLE).await.len(), 5, "{}", relay.log_text());

    // and the server closes the slow connections itself
    let mut first = slow.into_iter().next().unwrap();
    first.set_read_timeout(Some(IDLE)).unwrap();
    let mut buf = Vec::new();
    let started = Instant::now();
    let _ = first.read_to_end(&mut buf);
    assert!(started.elapsed() < IDLE, "a half-sent request held its connection open");
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_request_trickled_a_byte_at_a_time_is_cut_off() {
    // given a relay's listener
    let s = Setup::create(&services().kafka, "", true, |_| RelayToml::mode("polling")).await;
    let mut relay = s.start("relay");
    relay.wait_ready("active").await;
    let port = relay.metrics_port();

    // when a client sends its request headers one byte per second, forever
    let trickled = std::thread::spawn(move || {
        let mut stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
        stream.write_all(b"GET /metrics HTTP/1.1\r\nX-Slow: ").unwrap();
        for sent in 0..60 {
            std::thread::sleep(Duration::from_secs(1));
            if stream.write_all(b"a").is_err() {
                return sent;
            }
            let mut probe = [0u8; 1];
            stream.set_nonblocking(true).unwrap();
            let closed = matches!(stream.read(&mut probe), Ok(0));
            stream.set_nonblocking(false).unwrap();
            if closed {
                return sent;
            }
        }
        60
    });

    // then the server closes it (the header deadline counts from the first byte, not the last)
    let sent = trickled.join().unwrap();
    assert!(sent < 20, "the server kept a trickling request open for {sent} s");
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0));
}
