//! No secret ever leaves the process: a sentinel password in every place a secret can be given
//! (the file, a pass-through property, the environment, a secret properties file, a password
//! file) is looked for in every place the relay writes to: its logs at debug level, `validate`,
//! `check`, error messages (a TOML syntax error and a fatal error included), `/metrics`,
//! `/readyz` and `/healthz`.

mod common;

use std::process::Command;

use common::*;

const SENTINEL: &str = "SENTINEL-7f3a";

fn get(port: u16, path: &str) -> String {
    common::http::get(port, path).map(|(status, body)| format!("{status} {body}")).unwrap_or_default()
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
    let s = Setup::create(&services().kafka, "", true, |slot| {
        format!(
            "[source]\nmode = \"replication\"\n[replication]\nslot = \"{slot}\"\npublication = \"p_{slot}\"\n"
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
    let relay_env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let mut relay = s.start_with_env("relay", &relay_env);
    relay.wait_ready("active").await;
    let port = relay.metrics_port();
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
    let missing_db =
        config.replacen(&format!("database = \"{}\"", s.db.name), "database = \"no_such_db\"", 1);
    std::fs::write(s.config(), missing_db).unwrap();
    assert_clean("a fatal error", &relay_output(&["--log-level", "debug", "run", "--config", &path], &env));
    std::fs::write(s.config(), config.replacen(&format!("{SENTINEL}-pg\""), &format!("{SENTINEL}-pg"), 1))
        .unwrap();
    let broken = relay_output(&["validate", "--config", &path], &env);
    assert!(broken.contains("line"), "{broken}");
    assert_clean("a TOML syntax error", &broken);
}
