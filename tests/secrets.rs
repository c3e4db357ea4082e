//! No secret ever leaves the process: a sentinel password in every place a secret can be given
//! (the file, a pass-through property, the environment, a secret properties file, a password
//! file) is looked for in every place the relay writes to: its logs at debug level, `validate`,
//! `check`, error messages (a TOML syntax error and a fatal error included), `/metrics`,
//! `/readyz` and `/healthz`.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Command;
use std::time::{Duration, Instant};

use common::*;

const SENTINEL: &str = "SENTINEL-7f3a";

fn get(port: u16, path: &str) -> String {
    let Ok(mut stream) = TcpStream::connect(("127.0.0.1", port)) else { return String::new() };
    stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let _ = write!(stream, "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    let mut response = String::new();
    let _ = stream.read_to_string(&mut response);
    response
}

/// Runs `outbox-relay ARGS` with the secret environment; stdout + stderr.
fn relay_output(args: &[&str], env: &[(&str, String)]) -> String {
    let out = Command::new(relay_bin())
        .args(args)
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .output()
        .unwrap();
    format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

fn assert_clean(what: &str, text: &str) {
    assert!(!text.contains("SENTINEL"), "{what} shows a secret:\n{text}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_sentinel_password_appears_nowhere() {
    // given a secret in every place one can be given
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let s = Setup::create(&services().kafka, "", true, |slot| {
        format!(
            "[source]\nmode = \"replication\"\n[replication]\nslot = \"{slot}\"\npublication = \"p_{slot}\"\n\
             [metrics]\nlisten = \"127.0.0.1:{port}\"\nfatal_exit_delay_secs = 0\n"
        )
    })
    .await;
    let secrets = s.dir.path().join("kafka.properties");
    std::fs::write(&secrets, format!("ssl.key.password={SENTINEL}-file\n")).unwrap();
    let config = std::fs::read_to_string(s.config()).unwrap().replacen(
        "[kafka]\n",
        &format!(
            "[kafka]\nsecret_properties_file = \"{}\"\nproperties = {{ \"sasl.password\" = \"{SENTINEL}-prop\" }}\n",
            secrets.display()
        ),
        1,
    );
    let config = config.replacen("[postgres]\n", &format!("[postgres]\npassword = \"{SENTINEL}-pg\"\n"), 1);
    std::fs::write(s.config(), &config).unwrap();
    let env = vec![("OUTBOX_RELAY_KAFKA_SSL_KEYSTORE_PASSWORD", format!("{SENTINEL}-env"))];
    let path = s.config().display().to_string();

    // then validate and check show none of them
    assert_clean("validate", &relay_output(&["validate", "--config", &path], &env));
    assert_clean("check", &relay_output(&["check", "--config", &path], &env));

    // and a running relay, at debug level, in its log and on every endpoint
    let mut relay = RelayProcess_spawn(&s, &env);
    let deadline = Instant::now() + IDLE;
    while !get(port, "/readyz").contains("active") {
        assert!(Instant::now() < deadline, "never active: {}", relay.log_text());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let client = s.db.client().await;
    client
        .execute(
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload) VALUES ($1, 'k', 'E', '{}')",
            &[&s.aggregate_type],
        )
        .await
        .unwrap();
    assert_eq!(consume(&consumer(&[&s.topic]), 1, IDLE).await.len(), 1);
    for endpoint in ["/metrics", "/readyz", "/healthz"] {
        assert_clean(endpoint, &get(port, endpoint));
    }
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0));
    assert_clean("the relay's log", &relay.log_text());

    // and errors: a fatal one (a database that does not exist), and a TOML syntax error on the
    // password's own line
    let missing_db = config.replacen(&format!("database = \"{}\"", s.db.name), "database = \"no_such_db\"", 1);
    std::fs::write(s.config(), missing_db).unwrap();
    assert_clean("a fatal error", &relay_output(&["--log-level", "debug", "run", "--config", &path], &env));
    std::fs::write(s.config(), config.replacen(&format!("{SENTINEL}-pg\""), &format!("{SENTINEL}-pg"), 1)).unwrap();
    let broken = relay_output(&["validate", "--config", &path], &env);
    assert!(broken.contains("line"), "{broken}");
    assert_clean("a TOML syntax error", &broken);
}

#[allow(non_snake_case)]
fn RelayProcess_spawn(s: &Setup, env: &[(&str, String)]) -> common::process::RelayProcess {
    for (k, v) in env {
        // SAFETY: the test sets these before spawning and no other thread reads the environment
        unsafe { std::env::set_var(k, v) };
    }
    s.start("relay")
}
