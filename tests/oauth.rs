//! SASL OAUTHBEARER against Apache Kafka with a real OpenID Connect provider: Keycloak
//! (`deploy/local/services hold-oauth`, a stack of the test's own), whose realm issues 60 s
//! access tokens to the confidential client `outbox-relay` (client credentials grant), and a
//! broker listener that validates them against the realm's JWKS and re-authenticates each
//! session every 20 s or when its token expires (KIP-368). The relay fetches its tokens itself
//! (`[kafka.auth] mechanism = "oidc"`) and hands them to librdkafka.
//!
//! What a user cares about is asserted: every committed event arrives, once, in per-aggregate
//! order, across several token refreshes and an identity provider outage longer than a token's
//! life; a wrong client secret stops the relay naming the setting, never showing the secret.

use crate::common;

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Child;
use std::time::Duration;

use common::broker::Listeners;
use common::process::RelayProcess;
use common::workload::*;
use common::*;

/// Aggregates the workload writes to.
const AGGREGATES: usize = 8;
/// How long a load runs: past two of the realm's 60 s token lifetimes, so the relay refreshes
/// its token at least three times (at half its life) while it publishes.
const LOAD: Duration = Duration::from_secs(100);

/// Keycloak and a one-node Kafka with an OAUTH listener, stopped when dropped.
struct OAuthStack {
    holder: Option<Child>,
    env: HashMap<String, String>,
}

impl OAuthStack {
    fn start() -> OAuthStack {
        let (holder, env) = spawn_services("hold-oauth", &[]);
        let stack = OAuthStack { holder: Some(holder), env };
        // the relay's principal (the token's azp claim) may write and read every topic and
        // describe its read-back group, and nothing else
        let kafka = stack.kafka();
        kafka.allow("User:outbox-relay", &["Write", "Read", "Describe"], &["--topic", "*"]);
        kafka.allow("User:outbox-relay", &["Describe", "Read"], &["--group", "*"]);
        stack
    }

    fn kafka(&self) -> Listeners<'_> {
        Listeners(&self.env)
    }

    fn var(&self, name: &str) -> &str {
        &self.env[name]
    }

    /// The OAUTH listener's bootstrap list.
    fn oauth_brokers(&self) -> String {
        self.var("OUTBOX_RELAY_TEST_KAFKA_OAUTH").to_string()
    }

    /// The `[kafka]` lines of a relay on the OAUTH listener; `secret` is the client secret's
    /// setting (`client_secret_file = ...`, or nothing when the environment gives it).
    fn kafka_settings(&self, secret: &str) -> String {
        format!(
            "{QUICK_KAFKA_SETTINGS}\n\"ssl.ca.location\" = \"{}\"\n\n[kafka.auth]\nmechanism = \"oidc\"\n\
             token_endpoint_url = \"{}\"\nclient_id = \"{}\"\nca_file = \"{}\"\n{secret}\n",
            self.kafka().ca().display(),
            self.var("OUTBOX_RELAY_TEST_OIDC_TOKEN_URL"),
            self.var("OUTBOX_RELAY_TEST_OIDC_CLIENT_ID"),
            self.var("OUTBOX_RELAY_TEST_OIDC_CA"),
        )
    }

    fn secret_file_setting(&self) -> String {
        format!("client_secret_file = \"{}\"", self.var("OUTBOX_RELAY_TEST_OIDC_CLIENT_SECRET_FILE"))
    }

    /// A fresh access token from the realm, asked for as any client would (curl).
    fn fetch_token(&self) -> String {
        let secret = std::fs::read_to_string(self.var("OUTBOX_RELAY_TEST_OIDC_CLIENT_SECRET_FILE")).unwrap();
        let out = std::process::Command::new("curl")
            .args(["-sSf", "--cacert", self.var("OUTBOX_RELAY_TEST_OIDC_CA")])
            .args(["-d", "grant_type=client_credentials", "-d"])
            .arg(format!("client_id={}", self.var("OUTBOX_RELAY_TEST_OIDC_CLIENT_ID")))
            .arg("-d")
            .arg(format!("client_secret={}", secret.trim()))
            .arg(self.var("OUTBOX_RELAY_TEST_OIDC_TOKEN_URL"))
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let answer: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        answer["access_token"].as_str().unwrap().to_string()
    }

    fn keycloak_dir(&self) -> PathBuf {
        PathBuf::from(self.var("OUTBOX_RELAY_TEST_KEYCLOAK_DIR"))
    }

    /// Stops the identity provider (its whole process group) and waits until it is gone.
    fn stop_provider(&self) {
        let pid = std::fs::read_to_string(self.keycloak_dir().join("pid")).unwrap().trim().to_string();
        let group = format!("-{pid}");
        let _ = std::process::Command::new("kill").args(["-TERM", "--", &group]).status();
        for _ in 0..600 {
            let alive = std::process::Command::new("kill")
                .args(["-0", "--", &group])
                .stderr(std::process::Stdio::null())
                .status()
                .is_ok_and(|s| s.success());
            if !alive {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = std::process::Command::new("kill").args(["-KILL", "--", &group]).status();
    }

    /// Starts the identity provider again; returns once its realm answers.
    fn start_provider(&self) {
        let status = std::process::Command::new(self.keycloak_dir().join("start")).status().unwrap();
        assert!(status.success(), "Keycloak did not start again: see {}", self.keycloak_dir().display());
    }
}

impl Drop for OAuthStack {
    fn drop(&mut self) {
        if let Some(mut holder) = self.holder.take() {
            drop(holder.stdin.take());
            let _ = holder.wait();
        }
    }
}

/// A relay in `mode` on the stack's OAUTH listener (client secret from the realm's file), its
/// topic, aggregates to write to; started and active.
async fn oauth_relay(stack: &OAuthStack, mode: &str) -> (Setup, RelayProcess) {
    relay_with(stack, mode, &stack.kafka_settings(&stack.secret_file_setting())).await
}

/// As [`oauth_relay`], with the `[kafka]` lines `kafka`.
async fn relay_with(stack: &OAuthStack, mode: &str, kafka: &str) -> (Setup, RelayProcess) {
    let s = Setup::create(&stack.oauth_brokers(), kafka, false, |slot| {
        RelayToml::either(mode, slot).set("retry", "initial_backoff_ms", 100).set(
            "retry",
            "max_backoff_ms",
            1000,
        )
    })
    .await;
    create_topic_on(&stack.kafka().plaintext(), &s.topic, 2).await;
    create_aggregates(&s.db.client().await, AGGREGATES).await;
    let relay = s.start("relay");
    relay.wait_ready("active").await;
    (s, relay)
}

/// Writes events for `duration` in small transactions, a few a second; returns what committed.
async fn write_for(s: &Setup, duration: Duration) -> HashMap<String, i64> {
    let deadline = tokio::time::Instant::now() + duration;
    while tokio::time::Instant::now() < deadline {
        write_concurrently(&s.db.url, &s.aggregate_type, AGGREGATES, 20, 2).await;
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    committed_counts(&s.db.client().await).await
}

/// Reads the topic over PLAINTEXT and asserts every committed event arrived once, in order.
async fn assert_arrived_once_in_order(
    stack: &OAuthStack,
    s: &Setup,
    committed: &HashMap<String, i64>,
    relay: &RelayProcess,
) {
    let total: i64 = committed.values().sum();
    let consumer = consumer_on(&stack.kafka().plaintext(), &[&s.topic]);
    let records = consume_unique(&consumer, total as usize, IDLE, LINGER).await;
    assert_eq!(unique_ids(&records).len() as i64, total, "not every event arrived: {}", relay.log_text());
    let report = assert_delivered(&records, committed);
    assert_eq!(report.duplicates, 0, "events arrived twice");
}

/// The number of tokens the relay obtained, from its log.
fn tokens_obtained(relay: &RelayProcess) -> usize {
    relay.log_text().matches("kafka token obtained").count()
}

async fn publishes_across_token_refreshes(mode: &str) {
    // given Keycloak issuing 60 s tokens, a broker that re-authenticates sessions, and a relay
    let stack = OAuthStack::start();
    let (s, mut relay) = oauth_relay(&stack, mode).await;

    // when events are written for longer than two token lifetimes
    let committed = write_for(&s, LOAD).await;

    // then the relay refreshed its token several times, and every event arrived once, in order
    assert_arrived_once_in_order(&stack, &s, &committed, &relay).await;
    assert!(tokens_obtained(&relay) >= 3, "fewer than 3 tokens were obtained: {}", relay.log_text());
    let secret = std::fs::read_to_string(stack.var("OUTBOX_RELAY_TEST_OIDC_CLIENT_SECRET_FILE")).unwrap();
    assert!(!relay.log_text().contains(secret.trim()), "the client secret reached the log");
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0), "{}", relay.log_text());
}

#[tokio::test(flavor = "multi_thread")]
async fn polling_publishes_once_each_in_order_across_token_refreshes() {
    publishes_across_token_refreshes("polling").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn replication_publishes_once_each_in_order_across_token_refreshes() {
    publishes_across_token_refreshes("replication").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn identity_provider_down_longer_than_a_token_holds_then_resumes() {
    // given a relay publishing over OAUTHBEARER
    let stack = OAuthStack::start();
    let (s, mut relay) = oauth_relay(&stack, "replication").await;
    let mut committed = write_for(&s, Duration::from_secs(5)).await;

    // when the identity provider is down for longer than a token's life while events are written
    stack.stop_provider();
    let outage = tokio::spawn({
        let (url, aggregate_type) = (s.db.url.clone(), s.aggregate_type.clone());
        async move {
            for _ in 0..15 {
                write_concurrently(&url, &aggregate_type, AGGREGATES, 10, 1).await;
                tokio::time::sleep(Duration::from_secs(5)).await;
            }
        }
    });

    // then /readyz and the failure counter say why before the token held expires
    let failures = "outbox_relay_credential_refresh_failures_total";
    relay.wait_metric(failures, |v| v >= 1.0).await;
    let said = relay.context("/readyz to name the token refresh".into());
    wait_until(said, async || {
        relay.readyz().is_some_and(|(status, body)| status == 503 && body.contains("kafka.auth (oidc)"))
    })
    .await;
    outage.await.unwrap();

    // and once the provider is back the relay resumes: nothing lost, nothing doubled, in order
    stack.start_provider();
    committed.extend(write_for(&s, Duration::from_secs(5)).await);
    let committed = committed_counts(&s.db.client().await).await;
    assert_arrived_once_in_order(&stack, &s, &committed, &relay).await;
    relay.wait_ready("active").await;
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0), "{}", relay.log_text());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_wrong_client_secret_is_a_fatal_error_naming_the_setting() {
    // given a relay whose client secret (from the environment) the identity provider refuses
    let stack = OAuthStack::start();
    let kafka = stack.kafka_settings("");
    let s =
        Setup::create(&stack.oauth_brokers(), &kafka, false, |slot| RelayToml::either("polling", slot)).await;
    let env = [("OUTBOX_RELAY__KAFKA__AUTH__CLIENT_SECRET", "SENTINEL-WRONG-SECRET")];

    // when it starts, then it stops at once with a fatal error naming the setting, without the secret
    let mut relay = s.start_with_env("relay", &env);
    let code = relay.wait_exit();
    let log = relay.log_text();
    assert_ne!(code, 0, "{log}");
    assert!(log.contains("fatal error") && log.contains("kafka.auth.client_secret"), "{log}");
    assert!(log.contains("refused client \"outbox-relay\""), "{log}");
    assert!(!log.contains("SENTINEL"), "the secret reached the log: {log}");

    // and `check` fails on it the same way
    let (code, stdout, stderr) =
        run_relay_with_env(&["check", "--config", s.config().to_str().unwrap()], &env, IDLE);
    assert_eq!(code, 1, "{stdout}{stderr}");
    let line =
        stdout.lines().find(|l| l.starts_with("FAIL kafka.auth")).unwrap_or_else(|| panic!("{stdout}"));
    assert!(line.contains("kafka.auth.client_secret"), "{line}");
    assert!(!stdout.contains("SENTINEL") && !stderr.contains("SENTINEL"), "{stdout}{stderr}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_token_file_rewritten_before_it_expires_keeps_the_relay_publishing() {
    // given a token file (as a sidecar or a projected service-account token keeps it) and a relay
    // reading its token from it
    let stack = OAuthStack::start();
    let files = tempfile::tempdir().unwrap();
    let token_file = files.path().join("token");
    std::fs::write(&token_file, stack.fetch_token()).unwrap();
    let kafka = format!(
        "{QUICK_KAFKA_SETTINGS}\n\"ssl.ca.location\" = \"{}\"\n\n[kafka.auth]\nmechanism = \"token_file\"\n\
         token_file = \"{}\"\n",
        stack.kafka().ca().display(),
        token_file.display()
    );
    let (s, mut relay) = relay_with(&stack, "polling", &kafka).await;

    // when the file is rewritten with a new 60 s token every 20 s while events are written for
    // longer than two token lifetimes
    let rewriting = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let rewriter = std::thread::spawn({
        let (rewriting, token_file) = (rewriting.clone(), token_file.clone());
        let stack_env = stack.env.clone();
        move || {
            let stack = OAuthStack { holder: None, env: stack_env };
            while rewriting.load(std::sync::atomic::Ordering::SeqCst) {
                for _ in 0..200 {
                    if !rewriting.load(std::sync::atomic::Ordering::SeqCst) {
                        return;
                    }
                    std::thread::sleep(Duration::from_millis(100));
                }
                std::fs::write(&token_file, stack.fetch_token()).unwrap();
            }
        }
    });
    let committed = write_for(&s, LOAD).await;

    // then every event arrived once, in order, and the relay read the file again as it changed
    assert_arrived_once_in_order(&stack, &s, &committed, &relay).await;
    rewriting.store(false, std::sync::atomic::Ordering::SeqCst);
    rewriter.join().unwrap();
    assert!(tokens_obtained(&relay) >= 4, "the token file was not read again: {}", relay.log_text());
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0), "{}", relay.log_text());
}
