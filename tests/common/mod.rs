//! Test harness: a real PostgreSQL and a real Kafka-protocol broker over TCP.
//!
//! When `OUTBOX_RELAY_TEST_PG_URL` and `OUTBOX_RELAY_TEST_KAFKA` are set (as `deploy/local/test`
//! does) they are reused; otherwise `deploy/local/services hold` starts both for this test binary
//! and stops them when the binary exits (its stdin pipe closes). Each test gets a fresh database
//! with the schema applied and random topic names.
//!
//! Tests wait for what an operator would watch (`/readyz`, `/metrics`, the database, the
//! records in Kafka) with [`wait_until`], never for log lines. `benches/harness.rs` includes this
//! module too.
#![allow(dead_code)]

pub mod broker;
pub mod browser;
pub mod config;
pub mod http;
pub mod mock;
pub mod process;
pub mod service;
pub mod workload;

use std::fmt::Display;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant, SystemTime};

use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::{Headers, Message};
use tokio_postgres::{Client, NoTls};

pub use config::RelayToml;

pub struct Services {
    pub pg_url: String,
    /// The PLAINTEXT bootstrap list.
    pub kafka: String,
    /// Every `OUTBOX_RELAY_TEST_KAFKA*` variable: each listener, the CA, the state directory
    /// ([`broker::shared`] reads them).
    pub kafka_env: std::collections::HashMap<String, String>,
}

/// Processes started by `services hold`; their stdin closes when the test binary exits.
static HELD: Mutex<Vec<Child>> = Mutex::new(Vec::new());

pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

pub fn services() -> &'static Services {
    static SERVICES: OnceLock<Services> = OnceLock::new();
    SERVICES.get_or_init(|| {
        let env: std::collections::HashMap<String, String> = match std::env::var("OUTBOX_RELAY_TEST_PG_URL") {
            Ok(_) => std::env::vars().filter(|(k, _)| k.starts_with("OUTBOX_RELAY_TEST_")).collect(),
            Err(_) => hold("hold", &[]),
        };
        let kafka_env: std::collections::HashMap<String, String> = env
            .iter()
            .filter(|(k, _)| k.starts_with("OUTBOX_RELAY_TEST_KAFKA"))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        Services {
            pg_url: env["OUTBOX_RELAY_TEST_PG_URL"].clone(),
            kafka: kafka_env["OUTBOX_RELAY_TEST_KAFKA"].clone(),
            kafka_env,
        }
    })
}

/// Runs `deploy/local/services MODE` and returns the KEY=VALUE lines it prints before READY.
/// The services live until the test binary exits.
pub fn hold(mode: &str, env: &[(&str, &str)]) -> std::collections::HashMap<String, String> {
    let (child, vars) = spawn_services(mode, env);
    HELD.lock().unwrap().push(child);
    vars
}

/// Starts `deploy/local/services MODE` (a `hold` form) and reads the KEY=VALUE lines it prints
/// before READY. The services stop when the returned child's stdin closes.
pub fn spawn_services(
    mode: &str,
    env: &[(&str, &str)],
) -> (Child, std::collections::HashMap<String, String>) {
    let mut child = Command::new(repo_root().join("deploy/local/services"))
        .arg(mode)
        .envs(env.iter().copied())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("start deploy/local/services");
    let stdout = child.stdout.take().unwrap();
    let mut vars = std::collections::HashMap::new();
    for line in BufReader::new(stdout).lines() {
        let line = line.expect("read services output");
        if line == "READY" {
            break;
        }
        if let Some((k, v)) = line.split_once('=') {
            vars.insert(k.to_string(), v.to_string());
        }
    }
    assert!(vars.contains_key("OUTBOX_LOCAL_STATE"), "deploy/local/services {mode} failed");
    (child, vars)
}

/// Runs `PG_BIN/pg_ctl ARGS` (as the postgres user when the tests run as root) and asserts it
/// succeeded.
pub fn pg_ctl(pg_bin: &str, args: &[&str]) {
    let pg_ctl = format!("{pg_bin}/pg_ctl");
    let root = Command::new("id").arg("-u").output().is_ok_and(|o| o.stdout.starts_with(b"0\n"));
    let mut command = if root { Command::new("runuser") } else { Command::new(&pg_ctl) };
    if root {
        command.args(["-u", "postgres", "--", &pg_ctl]);
    }
    let status = command.args(args).stdout(Stdio::null()).status().unwrap();
    assert!(status.success(), "pg_ctl {args:?}: {status}");
}

pub fn random_suffix() -> String {
    format!("{:016x}", rand::random::<u64>())
}

/// A database of its own for one test, with the migrations in `sql/` applied. Dropped on drop.
pub struct TestDb {
    pub name: String,
    pub url: String,
    admin_url: String,
}

impl TestDb {
    pub async fn new() -> TestDb {
        Self::with_schema(true).await
    }

    pub async fn with_schema(apply: bool) -> TestDb {
        Self::create("", apply).await
    }

    /// A database whose server encoding is `encoding` (e.g. SQL_ASCII), with the schema.
    pub async fn with_encoding(encoding: &str) -> TestDb {
        let options = format!(" ENCODING '{encoding}' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0");
        Self::create(&options, true).await
    }

    async fn create(options: &str, apply: bool) -> TestDb {
        Self::create_at(&services().pg_url, options, apply).await
    }

    /// A database with `options` on the server `admin_url` names (a test's own server).
    pub async fn create_at(admin_url: &str, options: &str, apply: bool) -> TestDb {
        let admin_url = admin_url.to_string();
        let name = format!("test_{}", random_suffix());
        let admin = connect(&admin_url).await;
        admin.batch_execute(&format!("CREATE DATABASE {name}{options}")).await.unwrap();
        let url = replace_database(&admin_url, &name);
        let db = TestDb { name, url, admin_url };
        if apply {
            apply_migrations(&db.client().await).await;
        }
        db
    }

    pub async fn client(&self) -> Client {
        connect(&self.url).await
    }

    /// host, port, user of the server, for writing relay configs.
    pub fn pg_parts(&self) -> (String, u16, String) {
        let cfg: tokio_postgres::Config = self.url.parse().unwrap();
        let host = match &cfg.get_hosts()[0] {
            tokio_postgres::config::Host::Tcp(h) => h.clone(),
            #[allow(unreachable_patterns)]
            _ => "127.0.0.1".into(),
        };
        (host, cfg.get_ports()[0], cfg.get_user().unwrap_or("postgres").to_string())
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        let admin_url = self.admin_url.clone();
        let name = self.name.clone();
        // Drop is synchronous; a runtime of its own on a plain thread avoids nesting runtimes.
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            rt.block_on(async {
                if let Ok((client, conn)) = tokio_postgres::connect(&admin_url, NoTls).await {
                    tokio::spawn(conn);
                    drop_slots(&client, &name).await;
                    let _ =
                        client.batch_execute(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)")).await;
                }
            })
        })
        .join();
    }
}

/// Logical slots pin their database: ends their sessions and drops them.
async fn drop_slots(client: &Client, database: &str) {
    for _ in 0..50 {
        let _ = client
            .execute(
                "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots \
                 WHERE database = $1 AND active_pid IS NOT NULL",
                &[&database],
            )
            .await;
        let _ = client
            .execute(
                "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE database = $1 AND NOT active",
                &[&database],
            )
            .await;
        let left: i64 = match client
            .query_one("SELECT count(*) FROM pg_replication_slots WHERE database = $1", &[&database])
            .await
        {
            Ok(row) => row.get(0),
            Err(_) => return,
        };
        if left == 0 {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

pub fn replace_database(url: &str, database: &str) -> String {
    let (base, _) = url.rsplit_once('/').expect("url has a database");
    format!("{base}/{database}")
}

pub async fn connect(url: &str) -> Client {
    let (client, conn) =
        tokio_postgres::connect(url, NoTls).await.unwrap_or_else(|e| panic!("connect {url}: {e}"));
    tokio::spawn(conn);
    client
}

/// Applies `sql/[0-9]*.sql` in file-name order, as `deploy/local` does with psql.
pub async fn apply_migrations(client: &Client) {
    for file in migration_files() {
        let sql = std::fs::read_to_string(&file).unwrap();
        client.batch_execute(&sql).await.unwrap_or_else(|e| panic!("{}: {e:?}", file.display()));
    }
}

pub fn migration_files() -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(repo_root().join("sql"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.extension().is_some_and(|e| e == "sql")
                && p.file_name().unwrap().to_string_lossy().starts_with(|c: char| c.is_ascii_digit())
        })
        .collect();
    files.sort();
    files
}

pub fn random_topic(prefix: &str) -> String {
    format!("{prefix}-{}", random_suffix())
}

pub async fn create_topic(topic: &str, partitions: i32) {
    create_topic_on(&services().kafka, topic, partitions).await
}

/// As [`create_topic`], on the broker at `brokers`.
pub async fn create_topic_on(brokers: &str, topic: &str, partitions: i32) {
    let admin: AdminClient<DefaultClientContext> =
        ClientConfig::new().set("bootstrap.servers", brokers).create().unwrap();
    // the broker's default.replication.factor: 1 on one node, 3 on the cluster
    let new = NewTopic::new(topic, partitions, TopicReplication::Fixed(-1));
    let results = admin.create_topics([&new], &AdminOptions::new()).await.unwrap();
    for r in results {
        r.unwrap_or_else(|(t, e)| panic!("create topic {t}: {e}"));
    }
}

/// The server's current WAL position, as a byte offset.
pub async fn wal_lsn(client: &Client) -> i64 {
    client.query_one("SELECT (pg_current_wal_lsn() - '0/0')::bigint", &[]).await.unwrap().get(0)
}

/// The server's `server_version_num` (e.g. 170010).
pub async fn server_version(client: &Client) -> i32 {
    client.query_one("SELECT current_setting('server_version_num')::int", &[]).await.unwrap().get(0)
}

/// The `server_version_num` of the shared test server: the major the run is about.
pub async fn shared_server_version() -> i32 {
    server_version(&connect(&services().pg_url).await).await
}

/// The gate of a test that needs PostgreSQL `major` or later. Such a test is named
/// `..._since_pg<major>`, and `deploy/local/test` skips it on older majors, so the runner
/// reports it skipped there: a gate that returned early would be a pass that tested nothing.
/// Run on an older server anyway (a filter of one's own), it fails, saying so.
pub async fn require_major(major: i32) {
    let name = std::thread::current().name().unwrap_or_default().to_string();
    assert!(
        name.ends_with(&format!("_since_pg{major}")),
        "{name}: a test gated on PostgreSQL {major} must be named *_since_pg{major}, for the runner to skip it on older majors"
    );
    let version = shared_server_version().await;
    assert!(
        version >= major * 10_000,
        "{name} needs PostgreSQL {major} or later, and the server is {version}: deploy/local/test skips it there"
    );
}

/// `slot`'s confirmed_flush_lsn, as a byte offset.
pub async fn slot_confirmed_flush(client: &Client, slot: &str) -> i64 {
    client
        .query_one(
            "SELECT (confirmed_flush_lsn - '0/0')::bigint FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .unwrap()
        .get(0)
}

/// A record as the consumer saw it.
#[derive(Debug, Clone)]
pub struct Consumed {
    pub topic: String,
    pub partition: i32,
    pub offset: i64,
    pub key: Option<String>,
    pub payload: Option<String>,
    pub headers: Vec<(String, String)>,
}

impl Consumed {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }
}

/// A consumer of `topics` on the test broker, from the earliest offset, in a group of its own.
pub fn consumer(topics: &[&str]) -> StreamConsumer {
    consumer_on(&services().kafka, topics)
}

/// As [`consumer`], on `brokers`. The consumer is assigned every partition of `topics` from the
/// beginning, without joining its consumer group: a test wants every record and commits
/// nothing. A topic that does not exist yet is subscribed to instead.
pub fn consumer_on(brokers: &str, topics: &[&str]) -> StreamConsumer {
    let consumer: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", format!("test-{}", random_suffix()))
        .set("auto.offset.reset", "earliest")
        .set("enable.auto.commit", "false")
        .set("topic.metadata.refresh.interval.ms", "500")
        .create()
        .unwrap();
    let mut assignment = rdkafka::TopicPartitionList::new();
    let mut missing = Vec::new();
    for topic in topics {
        let partitions = consumer
            .fetch_metadata(Some(topic), Duration::from_secs(10))
            .ok()
            .and_then(|md| md.topics().iter().find(|t| t.name() == *topic).map(|t| t.partitions().len()))
            .unwrap_or(0);
        if partitions == 0 {
            missing.push(*topic);
        }
        for partition in 0..partitions as i32 {
            assignment.add_partition_offset(topic, partition, rdkafka::Offset::Beginning).unwrap();
        }
    }
    if missing.is_empty() {
        consumer.assign(&assignment).unwrap();
    } else {
        consumer.subscribe(topics).unwrap();
    }
    consumer
}

/// Reads until `expected` records arrived, or until `idle` passes with nothing new.
pub async fn consume(consumer: &StreamConsumer, expected: usize, idle: Duration) -> Vec<Consumed> {
    let mut out = Vec::new();
    while out.len() < expected {
        match tokio::time::timeout(idle, consumer.recv()).await {
            Ok(Ok(m)) => out.push(Consumed {
                topic: m.topic().to_string(),
                partition: m.partition(),
                offset: m.offset(),
                key: m.key().map(|k| String::from_utf8_lossy(k).into_owned()),
                payload: m.payload().map(|p| String::from_utf8_lossy(p).into_owned()),
                headers: m
                    .headers()
                    .map(|hs| {
                        hs.iter()
                            .map(|h| {
                                (
                                    h.key.to_string(),
                                    h.value
                                        .map(|v| String::from_utf8_lossy(v).into_owned())
                                        .unwrap_or_default(),
                                )
                            })
                            .collect()
                    })
                    .unwrap_or_default(),
            }),
            // a broker that is down, frozen or restarting (librdkafka reconnects by itself), or
            // a subscribed topic the relay has not created yet
            Ok(Err(e))
                if matches!(
                    e.rdkafka_error_code(),
                    Some(
                        rdkafka::types::RDKafkaErrorCode::AllBrokersDown
                            | rdkafka::types::RDKafkaErrorCode::BrokerTransportFailure
                            | rdkafka::types::RDKafkaErrorCode::UnknownTopicOrPartition
                    )
                ) => {}
            Ok(Err(e)) => panic!("consume: {e}"),
            Err(_) => break,
        }
    }
    out
}

/// Writes a relay config file for `db` and the test broker; returns its path.
pub fn write_config(dir: &Path, db: &TestDb, extra: impl Display) -> PathBuf {
    write_config_with(dir, db, &services().kafka, "", extra)
}

/// As [`write_config`], with the brokers and extra lines for the `[kafka]` section given.
pub fn write_config_with(
    dir: &Path,
    db: &TestDb,
    brokers: &str,
    kafka_extra: &str,
    extra: impl Display,
) -> PathBuf {
    let (host, port, user) = db.pg_parts();
    let extra = extra.to_string();
    // many relays run at once in the tests: each gets an ephemeral metrics port unless the
    // test asks for one
    let metrics = if extra.contains("[metrics]") {
        ""
    } else {
        "[metrics]\nlisten = \"127.0.0.1:0\"\nfatal_exit_delay_secs = 0\n"
    };
    let extra = format!("{extra}\n{metrics}");
    let toml = format!(
        "[postgres]\nhost = \"{host}\"\nport = {port}\nuser = \"{user}\"\ndatabase = \"{}\"\nsslmode = \"disable\"\n\n\
         [kafka]\nbrokers = [\"{brokers}\"]\n{kafka_extra}\n\n{extra}",
        db.name
    );
    let path = dir.join("relay.toml");
    std::fs::write(&path, toml).unwrap();
    path
}

/// How long a test waits for something that should happen (a hang guard, not a speed limit).
pub const IDLE: Duration = Duration::from_secs(60);
/// The `[kafka]` lines of a relay whose broker a test breaks: a short stall warning, and quick
/// reconnects and retries so the relay notices a recovered broker within a second.
pub const QUICK_KAFKA_SETTINGS: &str = "stall_warning_ms = 2000\n[kafka.properties]\n\
     \"reconnect.backoff.max.ms\" = \"500\"\n\"retry.backoff.ms\" = \"50\"";

/// How long a test keeps consuming after the last expected record, to catch late duplicates.
pub const LINGER: Duration = Duration::from_secs(3);
/// How long the relay may take to exit after SIGTERM.
pub const EXIT_LIMIT: Duration = Duration::from_secs(40);
/// How often [`wait_until`] looks again.
pub const POLL: Duration = Duration::from_millis(50);

/// Polls `ok` until it holds; panics naming `what` after [`IDLE`]. The one way a test waits for
/// something that should happen.
pub async fn wait_until(what: impl Display, ok: impl AsyncFnMut() -> bool) {
    wait_until_within(IDLE, what, ok).await
}

/// As [`wait_until`], giving up after `limit`.
pub async fn wait_until_within(limit: Duration, what: impl Display, mut ok: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !ok().await {
        assert!(Instant::now() < deadline, "timed out after {limit:?} waiting for {what}");
        tokio::time::sleep(POLL).await;
    }
}

/// A relay test's database, topic (`outbox.event.<aggregate_type>`, 4 partitions unless the
/// broker is not ours), slot name and relay configuration. Each test file adds its own
/// constructor with the mode's settings.
pub struct Setup {
    pub db: TestDb,
    pub dir: tempfile::TempDir,
    pub aggregate_type: String,
    pub topic: String,
    pub slot: String,
}

impl Setup {
    /// `config(slot)` gives the configuration below the `[postgres]` and `[kafka]` sections.
    pub async fn create<C: Display>(
        brokers: &str,
        kafka_extra: &str,
        create: bool,
        config: impl FnOnce(&str) -> C,
    ) -> Setup {
        Self::create_on(TestDb::new().await, brokers, kafka_extra, create, config).await
    }

    /// As [`Setup::create`], on the database `db`.
    pub async fn create_on<C: Display>(
        db: TestDb,
        brokers: &str,
        kafka_extra: &str,
        create: bool,
        config: impl FnOnce(&str) -> C,
    ) -> Setup {
        let aggregate_type = format!("t{}", random_suffix());
        let topic = format!("outbox.event.{aggregate_type}");
        if create {
            create_topic(&topic, 4).await;
        }
        let slot = format!("s_{}", random_suffix());
        let dir = tempfile::tempdir().unwrap();
        write_config_with(dir.path(), &db, brokers, kafka_extra, config(&slot));
        Setup { db, dir, aggregate_type, topic, slot }
    }

    pub fn config(&self) -> PathBuf {
        self.dir.path().join("relay.toml")
    }

    /// As [`Setup::create`], on librdkafka's mock cluster with [`QUICK_KAFKA_SETTINGS`];
    /// the topic is created there with `partitions`.
    pub async fn on_mock<C: Display>(
        mock: &mock::MockKafka,
        partitions: i32,
        config: impl FnOnce(&str) -> C,
    ) -> Setup {
        let s = Self::create(&mock.brokers(), QUICK_KAFKA_SETTINGS, false, config).await;
        mock.create_topic(&s.topic, partitions);
        s
    }

    /// Starts a relay on this setup's configuration, logging to `NAME.log`, with a metrics
    /// listener of its own.
    pub fn start(&self, name: &str) -> process::RelayProcess {
        self.start_with_env(name, &[])
    }

    /// As [`Setup::start`], with `env` added to the relay's environment.
    pub fn start_with_env(&self, name: &str, env: &[(&str, &str)]) -> process::RelayProcess {
        let log = self.dir.path().join(format!("{name}.log"));
        process::RelayProcess::spawn(&self.config(), &log, process::TEST_LOG_LEVEL, env)
    }

    pub async fn outbox_rows(&self) -> i64 {
        self.db.client().await.query_one("SELECT count(*) FROM outbox_events", &[]).await.unwrap().get(0)
    }
}

/// Runs `sql` (which returns how many backends it terminated) until it terminated exactly one:
/// the relay reconnects between kills, and a kill must hit a live session to mean anything.
/// Returns the server's clock just before the kill: a session that started later is a
/// reconnection.
pub async fn terminate_one(
    client: &Client,
    sql: &str,
    params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
) -> SystemTime {
    let mut before = SystemTime::UNIX_EPOCH;
    wait_until("a live relay session to terminate", async || {
        before = client.query_one("SELECT clock_timestamp()", &[]).await.unwrap().get(0);
        let killed: i64 = client.query_one(sql, params).await.unwrap().get(0);
        killed == 1
    })
    .await;
    before
}

/// Waits until a session matching `condition` (on `pg_stat_activity a`, with `$1` the time)
/// started after `since`: the relay reconnected.
pub async fn wait_reconnected(client: &Client, condition: &str, since: SystemTime) {
    let sql = format!("SELECT count(*) FROM pg_stat_activity a WHERE a.backend_start > $1 AND {condition}");
    wait_until("the relay to reconnect after the kill", async || {
        client.query_one(&sql, &[&since]).await.unwrap().get::<_, i64>(0) > 0
    })
    .await;
}

/// The relay binary started from here: this build's, unless the bench's baseline comparison
/// switched to another build for a while ([`use_relay_bin`]) or OUTBOX_TEST_RELAY_BIN names
/// one (deploy/cross/arm64 runs tests with an arm64 build under qemu that way).
static RELAY_BIN: std::sync::Mutex<Option<PathBuf>> = std::sync::Mutex::new(None);

pub fn relay_bin() -> PathBuf {
    let chosen = RELAY_BIN.lock().unwrap().clone();
    chosen
        .or_else(|| std::env::var_os("OUTBOX_TEST_RELAY_BIN").map(PathBuf::from))
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_outbox-relay")))
}

/// Starts `bin` instead of this build's relay from now on; `None`: this build's again.
pub fn use_relay_bin(bin: Option<PathBuf>) {
    *RELAY_BIN.lock().unwrap() = bin;
}

/// Runs `outbox-relay ARGS` to completion; returns (exit code, stdout, stderr).
pub fn run_relay(args: &[&str], timeout: Duration) -> (i32, String, String) {
    run_relay_with_env(args, &[], timeout)
}

/// As [`run_relay`], with `env` added to the relay's environment.
pub fn run_relay_with_env(args: &[&str], env: &[(&str, &str)], timeout: Duration) -> (i32, String, String) {
    let child = Command::new(relay_bin())
        .args(args)
        .env_remove("OUTBOX_RELAY_CONFIG")
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let started = std::time::Instant::now();
    let pid = child.id();
    let waiter = std::thread::spawn(move || child.wait_with_output().unwrap());
    while !waiter.is_finished() {
        if started.elapsed() > timeout {
            let _ = Command::new("kill").arg("-9").arg(pid.to_string()).status();
            panic!("outbox-relay {args:?} did not finish within {timeout:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = waiter.join().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Produces `record` again, as it was (topic, partition, key, value, headers, in order): a
/// duplicate, or with its fields changed first, a record the relay never wrote.
pub async fn produce_again(record: &Consumed) {
    use rdkafka::message::{Header, OwnedHeaders};
    use rdkafka::producer::{FutureProducer, FutureRecord};
    let producer: FutureProducer =
        ClientConfig::new().set("bootstrap.servers", &services().kafka).create().unwrap();
    let mut headers = OwnedHeaders::new();
    for (key, value) in &record.headers {
        headers = headers.insert(Header { key, value: Some(value.as_bytes()) });
    }
    let mut out = FutureRecord::to(&record.topic).partition(record.partition).headers(headers);
    if let Some(key) = &record.key {
        out = out.key(key.as_str());
    }
    if let Some(payload) = &record.payload {
        out = out.payload(payload.as_str());
    }
    producer.send(out, Duration::from_secs(10)).await.map_err(|(e, _)| e).unwrap();
}

/// Deletes the first record of the lowest partition holding one of `records` from Kafka
/// (DeleteRecords up to offset 1), as a retention or an operator's mistake would; its event id.
pub async fn delete_first_record(records: &[Consumed]) -> String {
    use rdkafka::admin::{AdminClient, AdminOptions};
    use rdkafka::client::DefaultClientContext;
    let first = records.iter().min_by_key(|r| (r.partition, r.offset)).unwrap();
    assert_eq!(first.offset, 0, "the records do not start their partition");
    let mut cut = rdkafka::TopicPartitionList::new();
    cut.add_partition_offset(&first.topic, first.partition, rdkafka::Offset::Offset(1)).unwrap();
    let admin: AdminClient<DefaultClientContext> =
        ClientConfig::new().set("bootstrap.servers", &services().kafka).create().unwrap();
    admin.delete_records(&cut, &AdminOptions::new()).await.unwrap();
    first.header("id").unwrap().to_string()
}

/// `outbox-relay verify` of `config` finds nothing missing, duplicated, out of order or
/// mismatched, and `dead_lettered` rows dead-lettered: it exits 0, or 1 when some are (a row not
/// in Kafka fails verify).
pub fn assert_verified(config: &Path, dead_lettered: u64) {
    let config = config.display().to_string();
    let (code, stdout, stderr) = run_relay(&["verify", "--config", &config, "--format", "json"], EXIT_LIMIT);
    let report: serde_json::Value = serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{e}: {stderr}"));
    assert_eq!(code, if dead_lettered == 0 { 0 } else { 1 }, "{report}");
    assert_eq!(report["unpublishable"]["count"], dead_lettered, "{report}");
    for class in ["missing", "duplicated", "out_of_order", "mismatched"] {
        assert_eq!(report[class]["count"], 0, "{class}: {report}");
    }
}
