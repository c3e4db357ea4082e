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
    // given a relay told to verify the server fully, by the test CA and the name localhost
    relay_in_both_modes(&format!(
        "host = \"localhost\"\nsslmode = \"verify-full\"\nsslrootcert = \"{}\"",
        ca("ca.crt")
    ))
    .await;
}

/// `check` says the session is encrypted, and events written arrive, in polling and in
/// replication mode (the SQL sessions' TLS and the replication connection's own), with the
/// `postgres` settings.
async fn relay_in_both_modes(postgres: &str) {
    for mode in ["polling", "replication"] {
        let (database, client) = database().await;
        let suffix = random_suffix();
        let topic = format!("tls.{suffix}");
        create_topic(&topic, 1).await;
        let dir = tempfile::tempdir().unwrap();
        let config = write_config(dir.path(), &database, postgres, mode, &suffix);

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

/// (In replication mode too: the vendored replication client's verifier matched only rustls's
/// `NotValidForName`, and rustls 0.23.46 says `NotValidForNameContext`, so verify-ca refused
/// the replication connection whose host the certificate does not name.)
#[tokio::test(flavor = "multi_thread")]
async fn verify_ca_accepts_the_chain_whatever_the_host_name() {
    relay_in_both_modes(&format!(
        "host = \"127.0.0.1\"\nsslmode = \"verify-ca\"\nsslrootcert = \"{}\"",
        ca("ca.crt")
    ))
    .await;
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
    create_password_role(&client).await;
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

    // and with a wrong password, run stops (fatal, reason auth) saying what to check
    let env = [("OUTBOX_RELAY__POSTGRES__PASSWORD", "a-wrong-one")];
    let (code, _, stderr) = run_relay_with_env(&["run", "--config", config], &env, IDLE);
    assert_eq!(code, 1, "{stderr}");
    assert!(stderr.contains("password authentication failed") && stderr.contains("reason=auth"), "{stderr}");
    assert!(
        stderr.contains("check postgres.user and its password") && stderr.contains("pg_hba.conf"),
        "{stderr}"
    );

    // and with the password, the session is let in
    let env = [("OUTBOX_RELAY__POSTGRES__PASSWORD", "the-right-one")];
    let (_, stdout, stderr) = run_relay_with_env(&["check", "--config", config], &env, IDLE);
    assert!(stdout.contains("OK   postgres.connect"), "{stdout}{stderr}");
}

/// What a man in the middle answering at `postgres.host` asks of the relay, and what it gets.
mod man_in_the_middle {
    use std::io::{Read, Write};
    use std::net::TcpListener;
    use std::path::Path;
    use std::sync::Arc;
    use std::time::Duration;

    /// Declines TLS (`tls` None) or offers it with `tls`'s certificate, then asks for the password
    /// with authentication request `request` (3 cleartext, 5 MD5, 10 SCRAM-SHA-256 without
    /// channel binding) and returns every byte the client sent after it.
    pub fn listen(tls: Option<(&Path, &Path)>, request: i32) -> (u16, std::thread::JoinHandle<Vec<u8>>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let config = tls.map(|(cert, key)| server_config(cert, key));
        let handle = std::thread::spawn(move || {
            let (mut socket, _) = listener.accept().unwrap();
            socket.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            let mut ssl_request = [0u8; 8];
            socket.read_exact(&mut ssl_request).unwrap();
            match config {
                None => {
                    socket.write_all(b"N").unwrap();
                    ask_password(&mut socket, request)
                }
                Some(config) => {
                    socket.write_all(b"S").unwrap();
                    let connection = rustls::ServerConnection::new(config).unwrap();
                    let mut tls = rustls::StreamOwned::new(connection, socket);
                    ask_password(&mut tls, request)
                }
            }
        });
        (port, handle)
    }

    fn ask_password(stream: &mut impl ReadWrite, request: i32) -> Vec<u8> {
        let mut len = [0u8; 4];
        stream.read_exact(&mut len).unwrap();
        let mut startup = vec![0u8; i32::from_be_bytes(len) as usize - 4];
        stream.read_exact(&mut startup).unwrap();
        let mut message = vec![b'R'];
        let body: Vec<u8> = match request {
            5 => [5i32.to_be_bytes().as_slice(), &[1, 2, 3, 4]].concat(),
            10 => [10i32.to_be_bytes().as_slice(), b"SCRAM-SHA-256\0\0"].concat(),
            code => code.to_be_bytes().to_vec(),
        };
        message.extend_from_slice(&(body.len() as i32 + 4).to_be_bytes());
        message.extend_from_slice(&body);
        stream.write_all(&message).unwrap();
        stream.flush().unwrap();
        let mut sent = Vec::new();
        let mut buf = [0u8; 1024];
        // until the client closes (or the read times out)
        while let Ok(n @ 1..) = stream.read(&mut buf) {
            sent.extend_from_slice(&buf[..n]);
        }
        sent
    }

    pub trait ReadWrite: Read + Write {}
    impl<T: Read + Write> ReadWrite for T {}

    fn server_config(cert: &Path, key: &Path) -> Arc<rustls::ServerConfig> {
        use rustls::pki_types::pem::PemObject;
        use rustls::pki_types::{CertificateDer, PrivateKeyDer};
        let certs = CertificateDer::pem_file_iter(cert).unwrap().collect::<Result<Vec<_>, _>>().unwrap();
        let key = PrivateKeyDer::from_pem_file(key).unwrap();
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(certs, key)
            .unwrap();
        Arc::new(config)
    }

    /// A self-signed certificate for localhost, made with openssl (as deploy/local makes the
    /// test CA): (certificate, key).
    pub fn self_signed(dir: &Path) -> (std::path::PathBuf, std::path::PathBuf) {
        let (cert, key) = (dir.join("mitm.crt"), dir.join("mitm.key"));
        let status = std::process::Command::new("openssl")
            .args(["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost"])
            .arg("-keyout")
            .arg(&key)
            .arg("-out")
            .arg(&cert)
            .stderr(std::process::Stdio::null())
            .status()
            .unwrap();
        assert!(status.success(), "openssl could not make a certificate");
        (cert, key)
    }
}

/// Under `prefer` and `require` the server is not authenticated: whoever answers may ask for
/// the password in clear or as MD5. The relay sends nothing and says why.
#[tokio::test(flavor = "multi_thread")]
async fn a_man_in_the_middle_asking_for_the_password_gets_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let (cert, key) = man_in_the_middle::self_signed(dir.path());
    for (sslmode, tls) in [("prefer", false), ("require", true), ("prefer", true)] {
        for request in [3, 5] {
            // given a server that asks for the password after declining or offering TLS
            let (port, sent) = man_in_the_middle::listen(tls.then_some((&*cert, &*key)), request);
            let config = dir.path().join("relay.toml");
            std::fs::write(
                &config,
                format!(
                    "[postgres]\nhost = \"localhost\"\nport = {port}\nuser = \"relay\"\npassword = \"SENTINEL-mitm\"\n\
                     sslmode = \"{sslmode}\"\n[kafka]\nbrokers = [\"{}\"]\n[metrics]\nlisten = \"\"\n",
                    services().kafka
                ),
            )
            .unwrap();

            // when check connects
            let (_, stdout, stderr) = run_relay(&["check", "--config", config.to_str().unwrap()], IDLE);

            // then the password never went, and check says what to set
            let what = format!("sslmode {sslmode}, TLS {tls}, request {request}");
            let sent = sent.join().unwrap();
            let sent = String::from_utf8_lossy(&sent);
            assert!(!sent.contains("SENTINEL") && !sent.starts_with('p'), "{what}: the relay sent {sent:?}");
            assert!(
                stdout.contains("FAIL postgres.connect") && stdout.contains("the password was not sent"),
                "{what}: {stdout}{stderr}"
            );
            assert!(stdout.contains("verify-full"), "{what}: {stdout}");
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn verify_ca_without_a_root_certificate_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("relay.toml");
    std::fs::write(&config, "[postgres]\nsslmode = \"verify-ca\"\n[kafka]\nbrokers = [\"127.0.0.1:9\"]\n")
        .unwrap();
    let (code, _, stderr) = run_relay(&["validate", "--config", config.to_str().unwrap()], IDLE);
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("postgres.sslmode") && stderr.contains("postgres.sslrootcert"), "{stderr}");
}

/// The replication transport (the vendored pgwire-replication, which cannot bind SCRAM to TLS)
/// sends no password at all, nor a SCRAM exchange, over TLS that does not verify the server.
#[tokio::test(flavor = "multi_thread")]
async fn the_replication_connection_sends_no_password_over_unverified_tls() {
    use pgwire_replication::{ReplicationClient, ReplicationConfig, SslMode, TlsConfig};
    let dir = tempfile::tempdir().unwrap();
    let (cert, key) = man_in_the_middle::self_signed(dir.path());
    for (mode, tls) in [(SslMode::Prefer, false), (SslMode::Require, true)] {
        for request in [3, 5, 10] {
            // given a server that asks for the password
            let (port, sent) = man_in_the_middle::listen(tls.then_some((&*cert, &*key)), request);
            let mut tls_config = TlsConfig::disabled();
            tls_config.mode = mode;
            let config =
                ReplicationConfig::new("localhost", "relay", "SENTINEL-repl", "db", "slot", "publication")
                    .with_port(port)
                    .with_tls(tls_config);

            // when the replication client connects
            let mut client = ReplicationClient::connect_gated(config).await.unwrap();
            let error = client.simple_query("IDENTIFY_SYSTEM").await.unwrap_err().to_string();

            // then nothing was sent after the request, and the error says why
            let what = format!("{mode:?}, request {request}");
            let sent = sent.join().unwrap();
            assert!(sent.is_empty(), "{what}: the client sent {:?}", String::from_utf8_lossy(&sent));
            assert!(error.contains("the password was not sent"), "{what}: {error}");
        }
    }
}

/// Under `require` with a password the SQL sessions authenticate by SCRAM-SHA-256-PLUS, bound to
/// the TLS channel: against the real server (scram-sha-256 for outbox_pw over hostssl), `check`
/// connects (with tokio-postgres-rustls 0.13, which never bound, it could not).
#[tokio::test(flavor = "multi_thread")]
async fn require_with_a_password_binds_scram_to_tls() {
    let (database, client) = database().await;
    create_password_role(&client).await;
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(
        dir.path(),
        &database,
        "host = \"127.0.0.1\"\nsslmode = \"require\"",
        "polling",
        &random_suffix(),
    );
    let text =
        std::fs::read_to_string(&config).unwrap().replace("user = \"postgres\"", "user = \"outbox_pw\"");
    std::fs::write(&config, text).unwrap();
    let env = [("OUTBOX_RELAY__POSTGRES__PASSWORD", "the-right-one")];
    let (_, stdout, stderr) =
        run_relay_with_env(&["check", "--config", config.to_str().unwrap()], &env, IDLE);
    assert!(
        stdout.contains("OK   postgres.connect") && stdout.contains("session encrypted"),
        "{stdout}{stderr}"
    );
    assert!(stdout.contains("WARN postgres.sslmode"), "{stdout}");
}

/// The role `outbox_pw`, whose password is `the-right-one` (the server's pg_hba.conf lets it in
/// only with it).
async fn create_password_role(client: &tokio_postgres::Client) {
    client
        .batch_execute(
            "DO $$ BEGIN CREATE ROLE outbox_pw LOGIN PASSWORD 'the-right-one'; \
             EXCEPTION WHEN duplicate_object THEN NULL; END $$",
        )
        .await
        .unwrap();
}

/// `sslmode = "require"` against a server without TLS (the shared test server) is a fatal `tls`
/// error saying so, in `check` and in `run`: it was "check host and port", and `run` retried for
/// ever as `postgres_unavailable`.
#[tokio::test(flavor = "multi_thread")]
async fn require_against_a_server_without_tls_is_fatal_and_says_so() {
    let db = TestDb::new().await;
    let dir = tempfile::tempdir().unwrap();
    for sslmode in ["require", "verify-full"] {
        let config = common::write_config(dir.path(), &db, RelayToml::polling());
        let text = std::fs::read_to_string(&config).unwrap();
        let text = text.replace("sslmode = \"disable\"", &format!("sslmode = \"{sslmode}\""));
        assert!(text.contains(&format!("sslmode = \"{sslmode}\"")), "{text}");
        std::fs::write(&config, text).unwrap();
        let config = config.to_str().unwrap();

        let (code, stdout, stderr) = run_relay(&["check", "--config", config], IDLE);
        assert_eq!(code, 1, "{sslmode}: {stdout}{stderr}");
        assert!(
            stdout.contains("FAIL postgres.connect") && stdout.contains("the server does not support SSL"),
            "{sslmode}: {stdout}"
        );
        assert!(!stdout.contains("check postgres.host and postgres.port"), "{sslmode}: {stdout}");

        let (code, _, stderr) = run_relay(&["run", "--config", config], IDLE);
        assert_eq!(code, 1, "{sslmode}: {stderr}");
        assert!(
            stderr.contains("the server does not support SSL") && stderr.contains("reason=tls_unavailable"),
            "{sslmode}: {stderr}"
        );
    }
}

/// `sslrootcert = "system"` means the system's CAs, as in libpq 16 (it was refused as a file
/// that does not exist): `SSL_CERT_FILE` names the bundle, as OpenSSL reads it, else the
/// system's own bundle. Both the SQL sessions and the replication stream trust it.
#[tokio::test(flavor = "multi_thread")]
async fn sslrootcert_system_trusts_the_system_bundle_in_both_connections() {
    // given a relay told to trust the system's CAs, the system's bundle being the test CA
    let (database, client) = database().await;
    let suffix = random_suffix();
    let topic = format!("tls.{suffix}");
    create_topic(&topic, 1).await;
    let dir = tempfile::tempdir().unwrap();
    let postgres = "host = \"localhost\"\nsslmode = \"verify-full\"\nsslrootcert = \"system\"";
    let config = write_config(dir.path(), &database, postgres, "replication", &suffix);
    let bundle = ca("ca.crt");
    let env = [("SSL_CERT_FILE", bundle.as_str())];

    // then check connects over verified TLS
    let (code, stdout, stderr) =
        run_relay_with_env(&["check", "--config", config.to_str().unwrap()], &env, IDLE);
    assert!(
        stdout.contains("OK   postgres.connect") && stdout.contains("session encrypted"),
        "{stdout}{stderr}"
    );
    assert_eq!(code, 0, "{stdout}{stderr}");

    // and the relay streams (the replication connection trusts the same bundle)
    let consumer = consumer(&[&topic]);
    let mut relay = RelayProcess::spawn(&config, &dir.path().join("relay.log"), "info", &env);
    client
        .execute(
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload) VALUES ('t', 'k', 'E', '{}')",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(consume(&consumer, 1, IDLE).await.len(), 1, "{}", relay.log_text());
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0), "{}", relay.log_text());

    // and the system's own bundle, which lacks the test CA, is not trusted
    let (code, stdout, _) =
        run_relay_with_env(&["check", "--config", config.to_str().unwrap()], &[("SSL_CERT_FILE", "")], IDLE);
    assert_eq!(code, 1, "{stdout}");
    assert!(stdout.contains("TLS handshake failed"), "{stdout}");

    // and a mode below verify-full is refused with it, as libpq refuses it
    let weak =
        write_config(dir.path(), &database, &postgres.replace("verify-full", "require"), "polling", &suffix);
    let (code, _, stderr) = run_relay(&["validate", "--config", weak.to_str().unwrap()], IDLE);
    assert_eq!(code, 2, "{stderr}");
    assert!(
        stderr.contains("postgres.sslmode: require may not be used with postgres.sslrootcert = \"system\""),
        "{stderr}"
    );
}

/// IAM tokens (RDS, Cloud SQL) are passwords that change: `postgres.password_file` is read at
/// every connect. On a TLS server of this test's own (the role's password changes): the role's
/// password and the file change, the relay's sessions are terminated, and it reconnects with
/// the new one (the old one no longer logs in) and keeps publishing.
#[tokio::test(flavor = "multi_thread")]
async fn a_password_file_changed_between_connects_is_read_again() {
    // given a polling relay logging in as outbox_pw (scram-sha-256 over TLS) with its password
    // in a file
    let own = hold("hold-postgres", &[("OUTBOX_PG_TLS", "1")]);
    let admin = connect(&own["OUTBOX_RELAY_TEST_PG_SOCKET_URL"]).await;
    let database = format!("tls_{}", random_suffix());
    admin.batch_execute(&format!("CREATE DATABASE {database}")).await.unwrap();
    let client = connect(&replace_database(&own["OUTBOX_RELAY_TEST_PG_SOCKET_URL"], &database)).await;
    apply_migrations(&client).await;
    client
        .batch_execute(
            "CREATE ROLE outbox_pw LOGIN PASSWORD 'token-one' IN ROLE outbox_relay_polling; \
             GRANT USAGE ON SCHEMA public TO outbox_pw",
        )
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let password_file = dir.path().join("token");
    std::fs::write(&password_file, "token-one\n").unwrap();
    let suffix = random_suffix();
    let topic = format!("tls.{suffix}");
    create_topic(&topic, 1).await;
    let ca = PathBuf::from(&own["OUTBOX_RELAY_TEST_PG_TLS_DIR"]).join("ca.crt");
    let postgres = format!(
        "host = \"localhost\"\nsslmode = \"verify-full\"\nsslrootcert = \"{}\"\npassword_file = \"{}\"",
        ca.display(),
        password_file.display()
    );
    let config = write_config(dir.path(), &database, &postgres, "polling", &suffix);
    let text = std::fs::read_to_string(&config).unwrap();
    let text = text.replace("user = \"postgres\"", "user = \"outbox_pw\"").replace(
        &format!("port = {}", server().port),
        &format!("port = {}", own["OUTBOX_RELAY_TEST_PG_PORT"]),
    );
    std::fs::write(&config, text).unwrap();
    let consumer = consumer(&[&topic]);
    let mut relay = RelayProcess::start(&config, &dir.path().join("relay.log"));
    let insert = "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload) VALUES ('t', $1, 'E', '{}')";
    client.execute(insert, &[&"before"]).await.unwrap();
    assert_eq!(consume(&consumer, 1, IDLE).await.len(), 1, "{}", relay.log_text());

    // when the token rotates (the role's password, then the file) and the relay's sessions end
    client.batch_execute("ALTER ROLE outbox_pw PASSWORD 'token-two'").await.unwrap();
    std::fs::write(&password_file, "token-two\n").unwrap();
    let since = std::time::SystemTime::now();
    let killed: i64 = client
        .query_one(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE usename = 'outbox_pw'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(killed >= 1, "no session of the relay to end");

    // then it logs in again with the new token and publishes
    wait_reconnected(&client, "usename = 'outbox_pw'", since).await;
    client.execute(insert, &[&"after"]).await.unwrap();
    assert_eq!(consume(&consumer, 1, IDLE).await.len(), 1, "{}", relay.log_text());
    assert_eq!(relay.exited(), None, "{}", relay.log_text());
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0), "{}", relay.log_text());
}
