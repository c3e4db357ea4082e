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

/// A Kafka property librdkafka refuses: a misspelt key, or a value it does not take. Its error
/// quotes the value (`Client config error: ... sasl.pasword SENTINEL`), so the relay checks
/// every property at load and names only the key, in `validate`, `check` and `run`, and the
/// ledger, which loads the relay's `[kafka]`, does the same.
#[tokio::test(flavor = "multi_thread")]
async fn a_kafka_property_librdkafka_refuses_is_named_without_its_value() {
    for (key, value) in [
        ("sasl.pasword", format!("{SENTINEL}-typo")),
        ("enable.ssl.certificate.verification", format!("{SENTINEL}-bad")),
    ] {
        // given the property, in the file and as a secret from the environment
        let s = Setup::create(&services().kafka, "", true, |_| RelayToml::polling()).await;
        let text = std::fs::read_to_string(s.config()).unwrap();
        let in_file =
            text.replacen("[kafka]\n", &format!("[kafka]\nproperties = {{ \"{key}\" = \"{value}\" }}\n"), 1);
        std::fs::write(s.config(), &in_file).unwrap();
        let path = s.config().display().to_string();
        let env_name = format!("OUTBOX_RELAY_KAFKA_{}", key.to_ascii_uppercase().replace('.', "_"));
        for (how, env) in [("file", vec![]), ("environment", vec![(env_name.as_str(), value.as_str())])] {
            if how == "environment" {
                std::fs::write(s.config(), &text).unwrap();
            }
            // then every command refuses the configuration, naming the key, not the value
            for command in ["validate", "check", "run"] {
                let (code, out) = relay_output(&[command, "--config", &path], &env);
                assert_eq!(code, 2, "{key} from the {how}, {command}: {out}");
                assert!(
                    out.contains(&format!("\"{key}\"")) && out.contains("librdkafka"),
                    "{command}: {out}"
                );
                assert_clean(&format!("{command} with {key} from the {how}"), &out);
            }
        }

        // and the ledger, given the same [kafka], says the same
        let ledger_toml = s.dir.path().join("ledger.toml");
        let kafka = in_file.split("[kafka]\n").nth(1).unwrap().split("\n[").next().unwrap();
        let postgres = in_file.split("[kafka]\n").next().unwrap();
        std::fs::write(&ledger_toml, format!("{postgres}[kafka]\n{kafka}\n[consumer]\ntopic = \"t\"\n"))
            .unwrap();
        let log = s.dir.path().join("ledger.log");
        let mut ledger = common::service::ServiceProcess::spawn(
            "ledger",
            &["run", "--config", ledger_toml.to_str().unwrap()],
            &[],
            &log,
        );
        let code = ledger.wait_exit();
        let text = ledger.log_text();
        assert!(code != 0 && text.contains(&format!("\"{key}\"")), "ledger exit {code}: {text}");
        assert_clean("the ledger's log", &text);
    }
}

/// Values are redacted unless their key is known to hold no credential: a key the old list of
/// secret words missed (`ssl.certificate.pem`; the OIDC keys `*passphrase*`, `*private.key*` and
/// `sasl.oauthbearer.extensions` this binary's librdkafka refuses, unit-tested in
/// `config::secrets`) is hidden, a harmless one shown.
#[tokio::test(flavor = "multi_thread")]
async fn kafka_properties_are_redacted_unless_known_to_be_harmless() {
    let s = Setup::create(&services().kafka, "", true, |_| RelayToml::polling()).await;
    let text = std::fs::read_to_string(s.config()).unwrap().replacen(
        "[kafka]\n",
        &format!(
            "[kafka]\nproperties = {{ \"ssl.certificate.pem\" = \"{SENTINEL}-pem\", \
             \"ssl.keystore.password\" = \"{SENTINEL}-ks\", \"socket.timeout.ms\" = \"60001\" }}\n"
        ),
        1,
    );
    std::fs::write(s.config(), text).unwrap();
    let (code, validated) = relay_output(&["validate", "--config", &s.config().display().to_string()], &[]);
    assert_eq!(code, 0, "{validated}");
    assert_clean("validate", &validated);
    assert!(validated.contains("60001"), "a harmless value is shown: {validated}");
}

/// A secret file other users can read is warned about at start-up and by `check`.
#[cfg(unix)]
#[tokio::test(flavor = "multi_thread")]
async fn a_secret_file_others_can_read_is_warned_about() {
    use std::os::unix::fs::PermissionsExt;
    let s = Setup::create(&services().kafka, "", true, |_| RelayToml::polling()).await;
    let secrets = s.dir.path().join("kafka.properties");
    std::fs::write(&secrets, format!("sasl.password={SENTINEL}\n")).unwrap();
    std::fs::set_permissions(&secrets, std::fs::Permissions::from_mode(0o644)).unwrap();
    let text = std::fs::read_to_string(s.config()).unwrap().replacen(
        "[kafka]\n",
        &format!("[kafka]\nsecret_properties_file = \"{}\"\n", secrets.display()),
        1,
    );
    std::fs::write(s.config(), text).unwrap();
    let path = s.config().display().to_string();
    let (_, checked) = relay_output(&["check", "--config", &path], &[]);
    assert!(
        checked.contains("WARN secrets.file_mode") && checked.contains("kafka.secret_properties_file"),
        "{checked}"
    );
    let (_, validated) = relay_output(&["validate", "--config", &path], &[]);
    assert!(validated.contains("readable by every user"), "{validated}");
    assert_clean("check", &checked);
    std::fs::set_permissions(&secrets, std::fs::Permissions::from_mode(0o600)).unwrap();
    let (_, checked) = relay_output(&["check", "--config", &path], &[]);
    assert!(checked.contains("OK   secrets.file_mode"), "{checked}");
}
