//! TLS to Kafka, and zstd, end to end against the real broker. tansu 0.6 cannot serve TLS
//! itself, so a broker of the test's own advertises a TLS-terminating proxy (rustls, in this
//! test) as its listener: every byte the relay exchanges with Kafka crosses TLS, verified against
//! a CA the test made with openssl. And SASL against a broker without it fails with a clear
//! error from `check`, not a crash loop.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use common::broker::OwnBroker;
use common::http::free_port;
use common::*;
use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{Consumer, StreamConsumer};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// Certificates from deploy/local's make_tls: ca.crt, and server.crt/key for DNS:localhost.
fn make_tls(dir: &Path) {
    let script = format!("source deploy/local/lib.sh && make_tls {}", dir.display());
    let status = Command::new("bash").arg("-c").arg(script).current_dir(repo_root()).status().unwrap();
    assert!(status.success(), "make_tls failed");
}

/// A broker whose only advertised listener is a TLS proxy in front of it.
struct TlsBroker {
    _broker: OwnBroker,
    proxy_port: u16,
    _dir: tempfile::TempDir,
    ca: PathBuf,
}

impl TlsBroker {
    async fn start() -> TlsBroker {
        let dir = tempfile::tempdir().unwrap();
        make_tls(dir.path());
        let proxy_port = free_port();
        let broker = OwnBroker::start(Some(&format!("localhost:{proxy_port}")));
        let broker_port = broker.port;
        let certs = CertificateDer::pem_file_iter(dir.path().join("server.crt"))
            .unwrap()
            .map(|c| c.unwrap())
            .collect();
        let key = PrivateKeyDer::from_pem_file(dir.path().join("server.key")).unwrap();
        let provider = Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
        let config = tokio_rustls::rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(certs, key)
            .unwrap();
        let acceptor = TlsAcceptor::from(Arc::new(config));
        let listener = TcpListener::bind(("127.0.0.1", proxy_port)).await.unwrap();
        tokio::spawn(async move {
            while let Ok((socket, _)) = listener.accept().await {
                let acceptor = acceptor.clone();
                tokio::spawn(async move {
                    let Ok(mut tls) = acceptor.accept(socket).await else { return };
                    let Ok(mut upstream) = TcpStream::connect(("127.0.0.1", broker_port)).await else {
                        return;
                    };
                    let _ = tokio::io::copy_bidirectional(&mut tls, &mut upstream).await;
                });
            }
        });
        let ca = dir.path().join("ca.crt");
        TlsBroker { _broker: broker, proxy_port, _dir: dir, ca }
    }

    fn brokers(&self) -> String {
        format!("localhost:{}", self.proxy_port)
    }

    fn client(&self) -> ClientConfig {
        let mut cc = ClientConfig::new();
        cc.set("bootstrap.servers", self.brokers())
            .set("security.protocol", "SSL")
            .set("ssl.ca.location", self.ca.display().to_string());
        cc
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn the_relay_publishes_over_tls_with_zstd() {
    // given a broker reachable only over TLS, and a topic on it
    let broker = TlsBroker::start().await;
    let topic = random_topic("tls");
    let admin: AdminClient<DefaultClientContext> = broker.client().create().unwrap();
    wait_until("the TLS broker to create a topic", async || {
        let created = admin
            .create_topics([&NewTopic::new(&topic, 1, TopicReplication::Fixed(1))], &AdminOptions::new())
            .await;
        matches!(created.as_deref(), Ok([Ok(_)]))
    })
    .await;

    // and a relay configured for TLS (verifying the broker against the test CA) and zstd
    let db = TestDb::new().await;
    let dir = tempfile::tempdir().unwrap();
    let kafka = format!(
        "compression = \"zstd\"\nproperties = {{ \"security.protocol\" = \"SSL\", \"ssl.ca.location\" = \"{}\" }}",
        broker.ca.display()
    );
    let extra = format!(
        "[source]\nmode = \"polling\"\n[polling]\npoll_interval_ms = 200\n[outbox]\ntopic_template = \"{topic}\"\n"
    );
    let config = write_config_with(dir.path(), &db, &broker.brokers(), &kafka, &extra);
    let (code, stdout, stderr) = run_relay(&["check", "--config", config.to_str().unwrap()], IDLE);
    assert_eq!(code, 0, "{stdout}{stderr}");

    // when events are written, then they arrive through TLS, compressed, intact
    let consumer: StreamConsumer = broker
        .client()
        .set("group.id", format!("tls-{}", random_suffix()))
        .set("auto.offset.reset", "earliest")
        .create()
        .unwrap();
    consumer.subscribe(&[&topic]).unwrap();
    let mut relay = process::RelayProcess::start(&config, &dir.path().join("relay.log"));
    let client = db.client().await;
    let payload = format!("{{\"text\": \"{}\"}}", "compressible ".repeat(200));
    for key in ["a", "b", "c"] {
        client
            .execute(
                "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload) VALUES ('t', $1, 'E', $2::text::jsonb)",
                &[&key, &payload],
            )
            .await
            .unwrap();
    }
    let records = consume(&consumer, 3, IDLE).await;
    assert_eq!(records.len(), 3, "{}", relay.log_text());
    let stored: serde_json::Value = serde_json::from_str(records[0].payload.as_deref().unwrap()).unwrap();
    assert_eq!(stored["text"].as_str().unwrap().len(), "compressible ".len() * 200);
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_broker_certificate_the_relay_cannot_trust_is_reported_by_check() {
    let broker = TlsBroker::start().await;
    let db = TestDb::new().await;
    let dir = tempfile::tempdir().unwrap();
    // the system roots do not include the test CA
    let kafka = "properties = { \"security.protocol\" = \"SSL\" }";
    let config =
        write_config_with(dir.path(), &db, &broker.brokers(), kafka, "[source]\nmode = \"polling\"\n");
    let (code, stdout, stderr) = run_relay(&["check", "--config", config.to_str().unwrap()], IDLE);
    assert_eq!(code, 1, "{stdout}{stderr}");
    let line =
        stdout.lines().find(|l| l.starts_with("FAIL kafka.brokers")).unwrap_or_else(|| panic!("{stdout}"));
    assert!(line.contains("TLS/SASL"), "{line}");
}

#[tokio::test(flavor = "multi_thread")]
async fn sasl_against_a_broker_without_it_fails_clearly_in_check() {
    // given the real (plaintext, SASL-less) broker and a relay configured for SASL/SCRAM
    let db = TestDb::new().await;
    let dir = tempfile::tempdir().unwrap();
    let kafka = "properties = { \"security.protocol\" = \"SASL_PLAINTEXT\", \"sasl.mechanisms\" = \"SCRAM-SHA-512\", \"sasl.username\" = \"relay\" }";
    let config =
        write_config_with(dir.path(), &db, &services().kafka, kafka, "[source]\nmode = \"polling\"\n");
    let (code, stdout, stderr) = run_relay_with_env(
        &["check", "--config", config.to_str().unwrap()],
        &[("OUTBOX_RELAY_KAFKA_SASL_PASSWORD", "SENTINEL-SASL-PASSWORD")],
        IDLE,
    );

    // then check fails on Kafka, saying where to look, without showing the password
    assert_eq!(code, 1, "{stdout}{stderr}");
    let line =
        stdout.lines().find(|l| l.starts_with("FAIL kafka.brokers")).unwrap_or_else(|| panic!("{stdout}"));
    assert!(line.contains("TLS/SASL"), "{line}");
    assert!(!stdout.contains("SENTINEL") && !stderr.contains("SENTINEL"), "{stdout}{stderr}");
}
