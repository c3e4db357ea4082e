//! The metrics and health listener faces whatever can reach the pod: 2,000 connections that send
//! half a request and wait must not stop `/healthz` from answering, nor the relay from
//! reconnecting to PostgreSQL and relaying, and the server closes them itself. Slow clients
//! holding every slot leave a reserve for the probes, and `/readyz` tells strangers one word.

use crate::common;

use std::io::{Read, Write};
use std::net::{IpAddr, TcpStream, UdpSocket};
use std::process::Command;
use std::time::{Duration, Instant};

use common::http::{free_port, get};
use common::process::{ChildProcess, TEST_LOG_LEVEL};
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
    let slow = half_requests(port, "/healthz", 2_000);

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

/// The relay of `s` under `bash -c SCRIPT` (which ends in `exec "$@"`), listening on `listen`
/// (`IP:PORT`), `env` added.
fn spawn_relay(s: &Setup, script: &str, listen: &str, env: &[(&str, &str)]) -> ChildProcess {
    let mut command = Command::new("bash");
    command
        .args(["-c", script, "relay"])
        .arg(relay_bin())
        .args(["--log-level", TEST_LOG_LEVEL, "run", "--config"])
        .arg(s.config())
        .env_remove("OUTBOX_RELAY_CONFIG")
        .env("OUTBOX_RELAY__METRICS__LISTEN", listen)
        .envs(env.iter().copied());
    ChildProcess::start(command, "outbox-relay", &s.dir.path().join("relay.log"))
}

#[tokio::test(flavor = "multi_thread")]
async fn slow_clients_in_every_slot_leave_a_reserve_for_probes() {
    // given a relay whose file limit (256) makes its listener take 64 connections at once
    let s = Setup::create(&services().kafka, "", true, |_| RelayToml::mode("polling")).await;
    let port = free_port();
    let relay = spawn_relay(&s, "ulimit -n 256 && exec \"$@\"", &format!("127.0.0.1:{port}"), &[]);
    let started = format!("/readyz to answer; log: {}", relay.log.display());
    wait_until(started, async || get(port, "/readyz").is_some_and(|(_, body)| body.starts_with("active")))
        .await;

    // when 64 connections each send half a request and wait
    let slow = half_requests(port, "/metrics", 64);

    // then /healthz answers while the first of them is still held open (it has 5 s to finish its
    // headers): a reserved slot took the probe, not a slot a slow client gave back
    wait_until("/healthz to answer", async || get(port, "/healthz").is_some_and(|(status, _)| status == 200))
        .await;
    let mut first = &slow[0];
    first.set_nonblocking(true).unwrap();
    let mut probe = [0u8; 1];
    let still_open = matches!(first.read(&mut probe), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock);
    assert!(
        still_open,
        "the probe got in only once the slow connections were closed; log:\n{}",
        relay.log_text()
    );
    drop(relay);
}

/// A local address of this machine that is not loopback, if it has one.
fn outward_address() -> Option<IpAddr> {
    let socket = UdpSocket::bind("0.0.0.0:0").ok()?;
    // (connecting a UDP socket sends nothing: it only picks the route's source address)
    socket.connect("192.0.2.1:9").ok()?;
    let address = socket.local_addr().ok()?.ip();
    (!address.is_loopback() && !address.is_unspecified()).then_some(address)
}

#[tokio::test(flavor = "multi_thread")]
async fn readyz_tells_a_stranger_one_word_and_loopback_why() {
    // given a relay that cannot reach PostgreSQL (port 1), listening on every address
    let Some(outward) = outward_address() else {
        panic!("this machine has no address but loopback: the test needs one to ask from")
    };
    let s = Setup::create(&services().kafka, "", true, |_| RelayToml::mode("polling")).await;
    let port = free_port();
    let env = [("OUTBOX_RELAY__POSTGRES__PORT", "1"), ("OUTBOX_RELAY__RETRY__MAX_BACKOFF_MS", "1000")];
    let relay = spawn_relay(&s, "exec \"$@\"", &format!("0.0.0.0:{port}"), &env);

    // when /readyz is asked from loopback and from the machine's outward address
    let why = format!("/readyz to say degraded and why; log: {}", relay.log.display());
    wait_until(why, async || {
        get(port, "/readyz").is_some_and(|(status, body)| {
            status == 503 && body.starts_with("degraded:") && body.contains("postgres")
        })
    })
    .await;
    let mut stream = TcpStream::connect((outward, port)).expect("connect from the outward address");
    stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(stream, "GET /readyz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();

    // then the stranger gets the status and one word, nothing of the reason
    assert!(response.starts_with("HTTP/1.1 503"), "{response}");
    assert_eq!(response.split_once("\r\n\r\n").map(|(_, body)| body), Some("degraded\n"), "{response}");
    drop(relay);
}

/// `count` connections to `port`, each holding half a GET of `path`: headers begun, never ended.
fn half_requests(port: u16, path: &str, count: usize) -> Vec<TcpStream> {
    let request = format!("GET {path} HTTP/1.1\r\nHost: x\r\n");
    (0..count)
        .map(|_| {
            let mut stream = TcpStream::connect(("127.0.0.1", port)).expect("connect");
            stream.write_all(request.as_bytes()).unwrap();
            stream
        })
        .collect()
}
