//! TLS to PostgreSQL, against a real cluster with `ssl = on` whose pg_hba.conf accepts TCP
//! only over TLS (`hostssl`), its certificates made by `deploy/local` with openssl: both modes
//! relay with `verify-full`, and an untrusted certificate, a wrong host name or `sslmode =
//! disable` stop the relay with an error naming the setting, instead of a retry loop.

use crate::common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use common::process::RelayProcess;
use common::*;

/// The TLS-only server, started once for this test binary.
struct TlsServer {
    socket_url: String,
    port: u16,
    tls_dir: PathBuf,
}

fn server() -> &'static TlsServer {
    static SERVER: OnceLock<TlsServer> = OnceLock::new();
    SERVER.get_or_init(|| {
        let env: HashMap<String, String> = hold("hold-postgres", &[("OUTBOX_PG_TLS", "1")]);
        TlsServer {
            socket_url: env["OUTBOX_RELAY_TEST_PG_SOCKET_URL"].clone(),
            port: env["OUTBOX_RELAY_TEST_PG_PORT"].parse().unwrap(),
            tls_dir: PathBuf::from(&env["OUTBOX_RELAY_TEST_PG_TLS_DIR"]),
        }
    })
}

/// A fresh database on the TLS server (created over the Unix socket), with the schema.
async fn database() -> (String, tokio_postgres::Client) {
    let admin = connect(&server().socket_url).await;
    let name = format!("tls_{}", random_suffix());
    admin.batch_execute(&format!("CREATE DATABASE {name}")).await.unwrap();
    let client = connect(&replace_database(&server().socket_url, &name)).await;
    apply_migrations(&client).await;
    (name, client)
}

fn write_config(dir: &Path, database: &str, postgres: &str, mode: &str, topic_suffix: &str) -> PathBuf {
    let path = dir.join("relay.toml");
    let toml = format!(
        "[source]\nmode = \"{mode}\"\n\
         [postgres]\nport = {}\nuser = \"postgres\"\ndatabase = \"{database}\"\n{postgres}\n\
         [kafka]\nbrokers = [\"{}\"]\n\
         [outbox]\ntopic_template = \"tls.{topic_suffix}\"\n\
         [polling]\npoll_interval_ms = 200\n\
         [replication]\nslot = \"s_{topic_suffix}\"\npublication = \"p_{topic_suffix}\"\n\
         [metrics]\nlisten = \"\"\nfatal_exit_delay_secs = 0\n",
        server().port,
        services().kafka
    );
    std::fs::write(&path, toml).unwrap();
    path
}

fn ca(name: &str) -> String {
    server().tls_dir.join(name).display().to_string()
}

#[tokio::test(flavor = "multi_thread")]
async fn both_modes_relay_over_verify_full() {
    for mode in ["polling", "replication"] {
        // given a relay told to verify the server fully, by the test CA and the name localhost
        let (database, client) = database().await;
        let suffix = random_suffix();
        let topic = format!("tls.{suffix}");
        create_topic(&topic, 1).await;
        let dir = tempfile::tempdir().unwrap();
        let postgres =
            format!("host = \"localhost\"\nsslmode = \"verify-full\"\nsslrootcert = \"{}\"", ca("ca.crt"));
        let config = write_config(dir.path(), &database, &postgres, mode, &suffix);

        // then check says the session is encrypted
        let (code, stdout, stderr) = run_relay(&["check", "--config", config.to_str().unwrap()], IDLE);
        assert!(
            stdout.contains("OK   postgres.tls") && stdout.contains("session encrypted"),
            "{mode}: {stdout}{stderr}"
        );
        assert_eq!(code, 0, "{mode}: {stdout}{stderr}");

        // when events are written, then they arrive
        let consumer = consumer(&[&topic]);
        let mut relay = RelayProcess::start(&config, &dir.path().join("relay.log"));
        for n in 0..3 {
            client
                .execute(
                    "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload) VALUES ('t', $1, 'E', '{}')",
                    &[&format!("k{n}")],
                )
                .await
                .unwrap();
        }
        let records = consume(&consumer, 3, IDLE).await;
        assert_eq!(records.len(), 3, "{mode}: {}", relay.log_text());
        let encrypted: i64 = client
            .query_one(
                "SELECT count(*) FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid) \
                 WHERE a.application_name = 'outbox-relay' AND s.ssl",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        assert!(encrypted >= 1, "{mode}: no encrypted relay session");
        assert_eq!(relay.terminate(EXIT_LIMIT), Some(0), "{mode}: {}", relay.log_text());
    }
}

/// Runs the relay with `postgres` settings until it exits; returns (exit code, stderr).
async fn run_with(postgres: &str) -> (i32, String) {
    let (database, _client) = database().await;
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), &database, postgres, "polling", &random_suffix());
    let (code, _, stderr) = run_relay(&["run", "--config", config.to_str().unwrap()], IDLE);
    (code, stderr)
}

#[tokio::test(flavor = "multi_thread")]
async fn an_untrusted_certificate_stops_the_relay_naming_the_settings() {
    // a CA that did not sign the server's certificate
    let (code, stderr) = run_with(&format!(
        "host = \"localhost\"\nsslmode = \"verify-full\"\nsslrootcert = \"{}\"",
        ca("other-ca.crt")
    ))
    .await;
    assert_eq!(code, 1, "{stderr}");
    assert!(stderr.contains("TLS handshake failed") && stderr.contains("postgres.sslrootcert"), "{stderr}");

    // a host name the certificate does not name
    let (code, stderr) = run_with(&format!(
        "host = \"127.0.0.1\"\nsslmode = \"verify-full\"\nsslrootcert = \"{}\"",
        ca("ca.crt")
    ))
    .await;
    assert_eq!(code, 1, "{stderr}");
    assert!(stderr.contains("TLS handshake failed") && stderr.contains("postgres.host"), "{stderr}");
    assert!(stderr.to_lowercase().contains("not valid for"), "{stderr}");
}

#[tokio::test(flavor = "multi_thread")]
async fn verify_ca_accepts_the_chain_whatever_the_host_name() {
    let (database, _client) = database().await;
    let dir = tempfile::tempdir().unwrap();
    let postgres =
        format!("host = \"127.0.0.1\"\nsslmode = \"verify-ca\"\nsslrootcert = \"{}\"", ca("ca.crt"));
    let config = write_config(dir.path(), &database, &postgres, "polling", &random_suffix());
    let (_, stdout, stderr) = run_relay(&["check", "--config", config.to_str().unwrap()], IDLE);
    assert!(
        stdout.contains("OK   postgres.connect") && stdout.contains("session encrypted"),
        "{stdout}{stderr}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn sslmode_disable_against_a_tls_only_server_is_refused_clearly() {
    let (code, stderr) = run_with("host = \"127.0.0.1\"\nsslmode = \"disable\"").await;
    assert_eq!(code, 1, "{stderr}");
    assert!(
        stderr.contains("accepts only encrypted sessions") && stderr.contains("postgres.sslmode"),
        "{stderr}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_missing_password_is_named_and_stops_the_relay() {
    // given a role the server lets in only with its password (pg_hba.conf: scram-sha-256)
    let (database, client) = database().await;
    client
        .batch_execute(
            "DO $$ BEGIN CREATE ROLE outbox_pw LOGIN PASSWORD 'the-right-one'; \
             EXCEPTION WHEN duplicate_object THEN NULL; END $$",
        )
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let postgres =
        format!("host = \"localhost\"\nsslmode = \"verify-full\"\nsslrootcert = \"{}\"", ca("ca.crt"));
    let config = write_config(dir.path(), &database, &postgres, "polling", &random_suffix());
    let text =
        std::fs::read_to_string(&config).unwrap().replace("user = \"postgres\"", "user = \"outbox_pw\"");
    std::fs::write(&config, text).unwrap();
    let config = config.to_str().unwrap();

    // when no password is configured, then check says what is missing and where to give it
    let (_, stdout, stderr) = run_relay(&["check", "--config", config], IDLE);
    assert!(
        stdout.contains("FAIL postgres.connect") && stdout.contains("no password is configured"),
        "{stdout}{stderr}"
    );
    assert!(stdout.contains("OUTBOX_RELAY__POSTGRES__PASSWORD"), "{stdout}");

    // and run stops at once (fatal, reason auth) instead of retrying
    let (code, _, stderr) = run_relay(&["run", "--config", config], IDLE);
    assert_eq!(code, 1, "{stderr}");
    assert!(stderr.contains("no password is configured") && stderr.contains("reason=auth"), "{stderr}");

    // and with the password, the session is let in
    let env = [("OUTBOX_RELAY__POSTGRES__PASSWORD", "the-right-one")];
    let (_, stdout, stderr) = run_relay_with_env(&["check", "--config", config], &env, IDLE);
    assert!(stdout.contains("OK   postgres.connect"), "{stdout}{stderr}");
}
