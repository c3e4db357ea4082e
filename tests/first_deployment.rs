//! The README's "First deployment on your own database", run as written: its shell blocks taken
//! from README.md itself, on a PostgreSQL server of this test's own (roles are server-wide: a
//! fresh server is the one a new user has), by an administrator for step 1 and, for the rest,
//! by an owner with only the privileges the README names (`LOGIN`, owner of the database; no
//! superuser, no `CREATEROLE`, `REPLICATION` only as step 1 gives it). Step 3 (`kafka-topics.sh`)
//! is done by the harness: the test broker has no shell scripts.

use std::path::Path;
use std::process::{Command, Stdio};

use crate::common;
use common::process::ChildProcess;
use common::*;

/// The shell blocks of step `n` of the README's first deployment, each as one string.
fn readme_step(n: u32) -> Vec<String> {
    let readme = std::fs::read_to_string(repo_root().join("README.md")).unwrap();
    let section = readme
        .split("\n## First deployment on your own database\n")
        .nth(1)
        .expect("README.md has a \"First deployment on your own database\" section");
    let section = section.split("\n## ").next().unwrap();
    let step = section
        .split(&format!("\n{n}. **"))
        .nth(1)
        .unwrap_or_else(|| panic!("the README's first deployment has no step {n}"));
    let step = step.split(&format!("\n{}. **", n + 1)).next().unwrap();
    let mut blocks = Vec::new();
    let mut lines = step.lines();
    while let Some(line) = lines.next() {
        if line.trim() == "```sh" {
            let block: Vec<&str> = lines.by_ref().take_while(|l| l.trim() != "```").map(str::trim).collect();
            blocks.push(block.join("\n"));
        }
    }
    assert!(!blocks.is_empty(), "step {n} of the README's first deployment has no ```sh block");
    blocks
}

/// Runs `script` with bash (`-e`, as a reader pasting it stops at a failure), in `dir`, with
/// `env` and the relay binary first on PATH, without a terminal (so psql's `\password` reads
/// `stdin`); returns (exit code, stdout and stderr).
fn run_block(script: &str, dir: &Path, env: &[(&str, String)], stdin: &str) -> (i32, String) {
    let path = format!("{}:{}", relay_bin().parent().unwrap().display(), std::env::var("PATH").unwrap());
    let mut child = Command::new("setsid")
        .args(["bash", "-e", "-c", script])
        .current_dir(dir)
        .env("PATH", path)
        .env_remove("OUTBOX_RELAY_CONFIG")
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run bash under setsid");
    use std::io::Write;
    child.stdin.take().unwrap().write_all(stdin.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.code().unwrap_or(-1), text)
}

/// deploy/relay.example.toml with the settings step 4 names, for this server and broker. The
/// test server has no TLS: `sslmode = "disable"` stands for the README's `sslrootcert`. The
/// metrics listener gets a free loopback port (tests run side by side).
fn relay_toml(port: u16, database: &str, metrics_port: u16) -> String {
    let example = std::fs::read_to_string(repo_root().join("deploy/relay.example.toml")).unwrap();
    let replaced = [
        ("port = 5432", format!("port = {port}")),
        ("database = \"postgres\"", format!("database = \"{database}\"")),
        ("password_file = \"\"", "password_file = \"relay.password\"".to_string()),
        ("sslmode = \"verify-full\"", "sslmode = \"disable\"".to_string()),
        ("brokers = [\"127.0.0.1:9092\"]", format!("brokers = [\"{}\"]", services().kafka)),
        ("listen = \"0.0.0.0:9187\"", format!("listen = \"127.0.0.1:{metrics_port}\"")),
    ];
    // each in the [postgres], [kafka] or [metrics] section: the first of its kind in the file
    // ([outbox.registry] has a password_file too, later)
    let mut text = example;
    for (from, to) in replaced {
        assert!(text.contains(from), "deploy/relay.example.toml has no `{from}`");
        text = text.replacen(from, &to, 1);
    }
    let postgres = text.split("\n[postgres]\n").nth(1).unwrap().split("\n[").next().unwrap();
    assert!(postgres.contains("password_file = \"relay.password\""), "{postgres}");
    text
}

#[tokio::test(flavor = "multi_thread")]
async fn the_readmes_first_deployment_works_as_written_for_an_owner_without_createrole() {
    // given a fresh server (its superuser is the administrator) and a migration role that owns
    // the database and holds nothing more
    let server = hold("hold-postgres", &[]);
    let admin_url = &server["OUTBOX_RELAY_TEST_PG_URL"];
    let (host, port, _) = {
        let cfg: tokio_postgres::Config = admin_url.parse().unwrap();
        let tokio_postgres::config::Host::Tcp(host) = &cfg.get_hosts()[0] else { panic!("{admin_url}") };
        (host.clone(), cfg.get_ports()[0], ())
    };
    let admin = connect(admin_url).await;
    admin.batch_execute("CREATE ROLE app_owner LOGIN").await.unwrap();
    admin.batch_execute("CREATE DATABASE shop OWNER app_owner").await.unwrap();
    let admin = connect(&replace_database(admin_url, "shop")).await;
    let role = "SELECT rolsuper, rolcreaterole, rolreplication FROM pg_roles WHERE rolname = $1";
    let row = admin.query_one(role, &[&"app_owner"]).await.unwrap();
    assert_eq!((row.get(0), row.get(1), row.get(2)), (false, false, false));
    let dir = tempfile::tempdir().unwrap();
    std::os::unix::fs::symlink(repo_root().join("sql"), dir.path().join("sql")).unwrap();
    let env = [
        ("ADMIN_DATABASE_URL", format!("postgres://postgres@{host}:{port}/shop")),
        ("DATABASE_URL", format!("postgres://app_owner@{host}:{port}/shop")),
        ("OWNER", "app_owner".to_string()),
    ];

    // step 1: the administrator makes the roles and sets the relay's password
    for block in readme_step(1) {
        let (code, out) = run_block(&block, dir.path(), &env, "relay-secret\nrelay-secret\n");
        assert_eq!(code, 0, "step 1:\n{block}\n{out}");
    }
    for (name, replication) in
        [("outbox_relay", true), ("outbox_relay_polling", false), ("outbox_relay_verify", false)]
    {
        let row = admin.query_one(role, &[&name]).await.unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!((row.get(0), row.get(2)), (false, replication), "{name}");
    }
    let row = admin.query_one(role, &[&"app_owner"]).await.unwrap();
    assert_eq!((row.get(0), row.get(1), row.get(2)), (false, false, true), "the owner: REPLICATION only");

    // step 2: the owner applies every migration, and the relay's role is granted what it needs
    let blocks = readme_step(2);
    let (code, out) = run_block(&blocks[0], dir.path(), &env, "");
    assert_eq!(code, 0, "step 2:\n{}\n{out}", blocks[0]);
    assert!(!out.contains("ERROR"), "step 2:\n{out}");
    let granted: bool = admin
        .query_one("SELECT has_table_privilege('outbox_relay', 'outbox_events', 'SELECT')", &[])
        .await
        .unwrap()
        .get(0);
    assert!(granted);

    // step 3: the topic (by the harness), and an event written before the slot exists
    let aggregate_type = format!("fd{}", random_suffix());
    let topic = format!("outbox.event.{aggregate_type}");
    create_topic(&topic, 1).await;
    let insert = "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload) \
                  VALUES ($1, $2, 'Placed', '{}')";
    admin.execute(insert, &[&aggregate_type, &"before-setup"]).await.unwrap();

    // step 4: relay.toml as the step says, and `setup` as the owner with its password file
    let metrics_port = common::http::free_port();
    std::fs::write(dir.path().join("relay.toml"), relay_toml(port, "shop", metrics_port)).unwrap();
    for (file, secret) in [("relay.password", "relay-secret"), ("owner.password", "owner-secret")] {
        let path = dir.path().join(file);
        std::fs::write(&path, format!("{secret}\n")).unwrap();
        std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    }
    let blocks = readme_step(4);
    let (code, out) = run_block(&blocks[0], dir.path(), &env, "");
    assert_eq!(code, 0, "step 4:\n{}\n{out}", blocks[0]);

    // step 5: `check` as the relay's role passes
    let blocks = readme_step(5);
    let (code, out) = run_block(&blocks[0], dir.path(), &env, "");
    assert_eq!(code, 0, "step 5:\n{}\n{out}", blocks[0]);
    assert!(!out.lines().any(|l| l.starts_with("FAIL")), "step 5:\n{out}");

    // step 6: `run`, and both events arrive, the one the slot's first copy published included
    let consumer = consumer(&[&topic]);
    let blocks = readme_step(6);
    let mut command = Command::new("bash");
    command
        .args(["-c", &format!("exec {}", blocks[0])])
        .current_dir(dir.path())
        .env(
            "PATH",
            format!("{}:{}", relay_bin().parent().unwrap().display(), std::env::var("PATH").unwrap()),
        )
        .env_remove("OUTBOX_RELAY_CONFIG");
    let mut relay = ChildProcess::start(command, "outbox-relay run (step 6)", &dir.path().join("relay.log"));
    admin.execute(insert, &[&aggregate_type, &"after-setup"]).await.unwrap();
    let keys: Vec<String> = consume(&consumer, 2, IDLE).await.into_iter().filter_map(|r| r.key).collect();
    assert_eq!(keys, ["before-setup", "after-setup"], "{}", relay.log_text());

    // step 7: `verify` finds every row in Kafka (a pass may first find one on its way: exit 3)
    let blocks = readme_step(7);
    let mut verified = (-1, String::new());
    wait_until("step 7's verify to exit 0", async || {
        verified = run_block(&blocks[0], dir.path(), &env, "");
        verified.0 == 0
    })
    .await;
    assert!(verified.1.contains("OK"), "step 7:\n{}", verified.1);
    assert_eq!(relay.terminate(EXIT_LIMIT), Some(0), "{}", relay.log_text());
}

/// Step 4's command (the owner's password file) against the relay.toml step 4 describes (the
/// relay's password as a file): the one replaces the other, no "not both" error. The README once
/// had step 5 set OUTBOX_RELAY__POSTGRES__PASSWORD over step 4's password_file: exit 2.
#[test]
fn the_owners_setup_command_takes_the_relay_toml_of_step_four() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("relay.toml"), relay_toml(5432, "shop", 9187)).unwrap();
    std::fs::write(dir.path().join("relay.password"), "relay\n").unwrap();
    std::fs::write(dir.path().join("owner.password"), "owner\n").unwrap();
    let setup = readme_step(4).into_iter().find(|b| b.contains("setup")).expect("step 4 runs setup");
    let (variables, rest) =
        setup.split_once(" outbox-relay setup ").expect("`VAR=... outbox-relay setup ...`");
    assert!(variables.contains("OUTBOX_RELAY__POSTGRES__USER="), "{setup}");
    // the same environment, with `validate` (which loads and checks the configuration, and
    // connects to nothing) in place of `setup`
    let script = format!("{variables} outbox-relay validate {rest}");
    let (code, out) = run_block(&script, dir.path(), &[("OWNER", "app_owner".to_string())], "");
    assert_eq!(code, 0, "{script}\n{out}");
    assert!(out.contains("app_owner"), "the owner's user name is not in effect:\n{out}");
}

/// Event ids step by one from 1: the identity default takes the id, and the id trigger (which
/// closes OVERRIDING SYSTEM VALUE, sql/009) keeps it instead of taking a second value
/// (sql/013). They once went 2, 4, 6, and `locate --id 1` found no event. A named id still
/// never duplicates one: not the last one given, not the next one.
#[tokio::test(flavor = "multi_thread")]
async fn the_first_events_ids_are_one_two_three_and_an_override_takes_none_of_them() {
    // given a fresh outbox
    let db = TestDb::new().await;
    let client = db.client().await;
    let insert = "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload) \
                  VALUES ('order', $1, 'E', '{}') RETURNING id";
    let mut ids = Vec::new();

    // when three events are written, two of them in one statement
    for row in client
        .query(
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload) \
             VALUES ('order', 'a', 'E', '{}'), ('order', 'b', 'E', '{}') RETURNING id",
            &[],
        )
        .await
        .unwrap()
    {
        ids.push(row.get::<_, i64>(0));
    }
    ids.push(client.query_one(insert, &[&"c"]).await.unwrap().get(0));

    // then their ids are 1, 2, 3
    assert_eq!(ids, [1, 2, 3]);

    // and an insert naming the last id, or the next, gets a new one of the sequence instead
    let overriding = "INSERT INTO outbox_events (id, aggregate_type, aggregate_id, event_type, payload) \
                      OVERRIDING SYSTEM VALUE VALUES ($1, 'order', 'forged', 'E', '{}') RETURNING id";
    let again: i64 = client.query_one(overriding, &[&3i64]).await.unwrap().get(0);
    let next: i64 = client.query_one(overriding, &[&(again + 1)]).await.unwrap().get(0);
    let after: i64 = client.query_one(insert, &[&"d"]).await.unwrap().get(0);
    assert_eq!((again, next, after), (4, 5, 6));
    let distinct: i64 =
        client.query_one("SELECT count(DISTINCT id) FROM outbox_events", &[]).await.unwrap().get(0);
    assert_eq!(distinct, 6);
}
