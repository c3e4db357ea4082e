//! No secret ever leaves the process: a sentinel secret in the configuration file (the
//! PostgreSQL password, a pass-through Kafka property), in the environment and in a secret
//! properties file is looked for in every place the relay writes to: its logs at debug level,
//! `validate`, `check`, error messages (a TOML syntax error and a fatal error included),
//! `/metrics`, `/readyz` and `/healthz`. (`postgres.password_file` is read by the same
//! `Secret` type; its reading is unit-tested in `src/postgres.rs`.)

use crate::common;

use common::workload::insert_event;
use common::*;

const SENTINEL: &str = "SENTINEL-7f3a";

/// GET `path`: "STATUS BODY"; the endpoint must answer 200.
fn get(port: u16, path: &str) -> String {
    let (status, body) = common::http::get(port, path).unwrap_or_else(|| panic!("{path} did not answer"));
    assert_eq!(status, 200, "{path}: {body}");
    format!("{status} {body}")
}

/// Runs `outbox-relay ARGS` with the secret environment; (exit code, stdout + stderr).
fn relay_output(args: &[&str], env: &[(&str, &str)]) -> (i32, String) {
    let (code, stdout, stderr) = run_relay_with_env(args, env, IDLE);
    (code, format!("{stdout}{stderr}"))
}

fn assert_clean(what: &str, text: &str) {
    assert!(!text.contains("SENTINEL"), "{what} shows a secret:\n{text}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_sentinel_password_appears_nowhere() {
    // given a secret in every place one can be given
    let s = Setup::create(&services().kafka, "", true, RelayToml::replication).await;
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
    let env_secret = format!("{SENTINEL}-env");
    let env = [("OUTBOX_RELAY_KAFKA_SSL_KEYSTORE_PASSWORD", env_secret.as_str())];
    let path = s.config().display().to_string();

    // then validate shows each secret redacted, and neither it nor check shows any of them
    let (code, validated) = relay_output(&["validate", "--config", &path], &env);
    assert_eq!(code, 0, "{validated}");
    assert!(validated.matches("<redacted>").count() >= 3, "the secrets are not shown redacted:\n{validated}");
    assert_clean("validate", &validated);
    let (_, checked) = relay_output(&["check", "--config", &path], &env);
    assert!(checked.contains("postgres.connect"), "{checked}");
    assert_clean("check", &checked);

    // and a running relay, at debug level, in its log and on every endpoint
    let mut relay = s.start_with_env("relay", &env);
    relay.wait_ready("active").await;
    let port = relay.metrics_port();
    let client = s.db.client().await;
    insert_event(&client, &s.aggregate_type, Some("k")).await;
    assert_eq!(consume(&consumer(&[&s.topic]), 1, IDLE).await.len(), 1);
    for endpoint in ["/metrics", "/readyz", "/healthz"] {
        assert_clean(endpoint, &get(port, endpoint));
    }
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0));
    assert_clean("the relay's log", &relay.log_text());

    // and errors: a fatal one (a database that does not exist), and a TOML syntax error on the
    // password's own line
    let missing_db =
        config.replacen(&format!("database = \"{}\"", s.db.name), "database = \"no_such_db\"", 1);
    std::fs::write(s.config(), missing_db).unwrap();
    let (code, fatal) = relay_output(&["--log-level", "debug", "run", "--config", &path], &env);
    assert!(code != 0 && fatal.contains("no_such_db"), "exit {code}: {fatal}");
    assert_clean("a fatal error", &fatal);
    std::fs::write(s.config(), config.replacen(&format!("{SENTINEL}-pg\""), &format!("{SENTINEL}-pg"), 1))
        .unwrap();
    let (code, broken) = relay_output(&["validate", "--config", &path], &env);
    assert!(code == 2 && broken.contains("line"), "exit {code}: {broken}");
    assert_clean("a TOML syntax error", &broken);
}
