//! Bootstrap only: parse the CLI, load and validate the configuration, start logging, run the
//! command, and map its outcome to an exit code (0 ok, 1 failure, 2 invalid configuration;
//! `verify` adds 3: nothing wrong found, some rows still pending).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand, ValueEnum};
use outbox_relay::config::RelayConfig;
use outbox_relay::error::RelayError;
use outbox_relay::ops::check::{self, Status};
use outbox_relay::ops::setup::{self, SetupReport};
use outbox_relay::ops::{locate, replay, republish, switchover, verify};

const EXIT_FAILURE: u8 = 1;
const EXIT_CONFIG: u8 = 2;

/// Moves committed transactional-outbox events from PostgreSQL to Apache Kafka.
///
/// Start with `outbox-relay check --config relay.toml`; every setting is documented in
/// deploy/relay.example.toml and can be overridden with OUTBOX_RELAY__SECTION__KEY variables
/// (for example OUTBOX_RELAY__POSTGRES__PASSWORD).
#[derive(Parser, Debug)]
#[command(name = "outbox-relay", version, about, long_about)]
struct Cli {
    /// Log format: `text` for people, `json` for log pipelines.
    #[arg(long, value_enum, default_value_t = LogFormat::Text, global = true, env = "OUTBOX_RELAY_LOG_FORMAT")]
    log_format: LogFormat,

    /// Log filter in tracing's EnvFilter syntax, e.g. `info` or `outbox_relay=debug`.
    #[arg(long, default_value = "info", global = true, env = "OUTBOX_RELAY_LOG")]
    log_level: String,

    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run the relay daemon until SIGTERM or SIGINT.
    Run {
        /// Configuration file (TOML).
        #[arg(long, short, env = "OUTBOX_RELAY_CONFIG")]
        config: PathBuf,
    },
    /// Replication mode: create the publication and the slot when missing (publishing the rows
    /// already in the table, as `run` does on first start) and print what was done.
    Setup {
        /// Configuration file (TOML).
        #[arg(long, short, env = "OUTBOX_RELAY_CONFIG")]
        config: PathBuf,
        /// Drop the slot (e.g. invalidated: wal_status = lost) and create it again, re-publishing
        /// the rows the outbox table still holds (with dedup.enabled, the default, only those
        /// Kafka lacks). Stop the relay instances first.
        #[arg(long)]
        recreate_slot: bool,
        /// Publish only the rows Kafka lacks, reading the topics back first, even with
        /// dedup.enabled = false (needs kafka.source_headers = true).
        #[arg(long)]
        skip_published: bool,
    },
    /// Load and validate the configuration (file and OUTBOX_RELAY__* environment) without
    /// connecting anywhere; print the effective configuration, secrets redacted, as JSON.
    Validate {
        /// Configuration file (TOML).
        #[arg(long, short, env = "OUTBOX_RELAY_CONFIG")]
        config: PathBuf,
    },
    /// Preflight: check PostgreSQL and Kafka against the configuration and print one line per
    /// finding (OK / WARN / FAIL, each with its fix). Exits 1 when anything FAILs.
    Check {
        /// Configuration file (TOML).
        #[arg(long, short, env = "OUTBOX_RELAY_CONFIG")]
        config: PathBuf,
    },
    /// What an SRE looks at first: mode, the slot (holder, lag, retained WAL, wal_status,
    /// safe_wal_size) or the polling backlog, the relay's sessions, and a running relay's
    /// readiness, leadership and last confirmation. Reads only; changes nothing.
    Status {
        /// Configuration file (TOML).
        #[arg(long, short, env = "OUTBOX_RELAY_CONFIG")]
        config: PathBuf,
        /// The relay's metrics listener, `http://host:port`; default: `metrics.listen` on this host.
        #[arg(long)]
        metrics_url: Option<String>,
        /// `text` for people, `json` for machines.
        #[arg(long, value_enum, default_value = "text")]
        format: LogFormat,
    },
    /// A delivery receipt for one event: published (topic, partition, offset, record time, and
    /// any duplicates), pending, dead-lettered (with the reason), missing, or unknown. Exits 0
    /// published, 3 pending, 1 otherwise, 2 on a bad argument or configuration. Reads only.
    Locate {
        /// Configuration file (TOML).
        #[arg(long, short, env = "OUTBOX_RELAY_CONFIG")]
        config: PathBuf,
        /// The event's id (the outbox's id column).
        #[arg(long)]
        id: String,
        /// `text` for people, `json` for machines.
        #[arg(long, value_enum, default_value = "text")]
        format: LogFormat,
        /// Replication mode: how long to wait for the slot to confirm past the row before an
        /// event Kafka lacks is called pending rather than missing.
        #[arg(long, default_value_t = 10)]
        wait_secs: u64,
    },
    /// Send chosen events again, for consumers that lost their state: each as first written (the
    /// same key, value, headers, position and partition) plus `outbox_relay_republished`, in
    /// their original order, from the rows the outbox still holds. Refuses while a relay of this
    /// outbox is connected. Exits 0 when every event was sent, 1 when one was refused or has no
    /// row, 2 on a bad argument or configuration (or a relay connected).
    #[command(group = clap::ArgGroup::new("which").required(true).multiple(true).args(["aggregate", "ids", "since"]))]
    Republish {
        /// Configuration file (TOML).
        #[arg(long, short, env = "OUTBOX_RELAY_CONFIG")]
        config: PathBuf,
        /// The events of this aggregate (`aggregate_id`).
        #[arg(long)]
        aggregate: Option<String>,
        /// With `--aggregate`: of this `aggregate_type` only.
        #[arg(long, requires = "aggregate")]
        aggregate_type: Option<String>,
        /// These event ids, comma-separated.
        #[arg(long, value_delimiter = ',')]
        ids: Vec<String>,
        /// Events created at or after this timestamp ("2026-12-01 10:00+00").
        #[arg(long)]
        since: Option<String>,
        /// Events created before this timestamp.
        #[arg(long)]
        until: Option<String>,
        /// Say what would be sent; send nothing.
        #[arg(long)]
        dry_run: bool,
        /// With several outboxes (`[[outboxes]]`): this outbox (its `name`).
        #[arg(long)]
        outbox: Option<String>,
    },
    /// Is a planned switchover to STANDBY safe now for the relay? Exits 0 when the standby's copy
    /// of the failover slot is one a promotion keeps and has reached the position the relay
    /// confirmed on the primary (nothing would be sent twice), 1 when not (saying why), 2 on a
    /// bad argument or configuration. For a pre-promotion hook. Reads only.
    SwitchoverReady {
        /// Configuration file (TOML).
        #[arg(long, short, env = "OUTBOX_RELAY_CONFIG")]
        config: PathBuf,
        /// The standby to promote: host, host:port or [ipv6]:port (port: postgres.port).
        #[arg(long)]
        standby: String,
    },
    /// Compare the outbox with Kafka: rows missing from Kafka, records with no row, ids more than
    /// once, records of one key out of commit order, records that differ from their row. Changes
    /// nothing. Exits 0 when all is there, 1 when anything is missing, unexpected, out of order or
    /// different, 3 when nothing is wrong but rows are still on their way.
    Verify {
        /// Configuration file (TOML).
        #[arg(long, short, env = "OUTBOX_RELAY_CONFIG")]
        config: PathBuf,
        /// Rows created at or after this: any timestamp PostgreSQL reads ("2026-12-01 10:00+00",
        /// "today"), or a span back from now ("30m", "2h", "1d"). Default: the first row.
        #[arg(long)]
        since: Option<String>,
        /// Rows created before this (same forms). Default: now.
        #[arg(long)]
        until: Option<String>,
        /// `text` for people, `json` for machines.
        #[arg(long, value_enum, default_value = "text")]
        format: LogFormat,
        /// Replication mode: how long to wait for the slot to confirm what verify read before
        /// rows Kafka lacks are called pending rather than missing.
        #[arg(long, default_value_t = 30)]
        wait_secs: u64,
        /// How many ids to show per class.
        #[arg(long, default_value_t = 10)]
        show: usize,
        /// Verify again and again, as a companion process beside the relay: every `--every-secs`
        /// over a rolling window (`--since`, default "15m"), exporting each pass's findings as
        /// `outbox_relay_verify_*` metrics on `--listen` until SIGTERM.
        #[arg(long)]
        watch: bool,
        /// With `--watch`: seconds from the end of one pass to the start of the next.
        #[arg(long, default_value_t = 60, requires = "watch")]
        every_secs: u64,
        /// With `--watch`: the address of its /metrics, /healthz and /readyz listener.
        #[arg(long, default_value = "0.0.0.0:9188", requires = "watch")]
        listen: std::net::SocketAddr,
    },
    /// Publish this outbox's dead letters again, each under its event's own id, once their cause
    /// is fixed (the letter's row_data, a topic, a size limit). A letter Kafka acknowledged is
    /// removed together with its event's row in one transaction; one that still cannot be
    /// published stays, and the command exits 1 saying why. Run it as the outbox's owner (it
    /// deletes from the outbox and the dead-letter table).
    ReplayDeadLetters {
        /// Configuration file (TOML).
        #[arg(long, short, env = "OUTBOX_RELAY_CONFIG")]
        config: PathBuf,
        /// Letter ids (the dead-letter table's `id`), comma-separated. Default: every letter of
        /// this outbox.
        #[arg(long, value_delimiter = ',')]
        ids: Vec<i64>,
        /// Print what would be sent; send nothing, change nothing.
        #[arg(long)]
        dry_run: bool,
        /// With several outboxes (`[[outboxes]]`): only this outbox's letters (its `name`).
        /// Needed with `--ids`, whose letters belong to one outbox.
        #[arg(long)]
        outbox: Option<String>,
    },
}

#[derive(Copy, Clone, Debug, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

/// `verify --watch`'s rolling window when `--since` is not given.
const WATCH_WINDOW: &str = "15m";

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging(cli.log_format, &cli.log_level);
    let config_path = match &cli.command {
        Command::Run { config }
        | Command::Check { config }
        | Command::Validate { config }
        | Command::Setup { config, .. }
        | Command::Verify { config, .. }
        | Command::ReplayDeadLetters { config, .. }
        | Command::Status { config, .. }
        | Command::SwitchoverReady { config, .. }
        | Command::Locate { config, .. }
        | Command::Republish { config, .. } => config,
    };
    let config = match RelayConfig::load(config_path)
        .and_then(|config| outbox_relay::record::registry::check(&config).map(|()| config))
    {
        Ok(config) => config,
        Err(e) => {
            eprintln!("error: invalid configuration: {e}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    for deprecation in &config.deprecations {
        tracing::warn!("{deprecation}");
    }
    let runtime = runtime();
    match cli.command {
        Command::Validate { .. } => {
            println!("{}", serde_json::to_string_pretty(&config.redacted()).expect("json"));
            ExitCode::SUCCESS
        }
        Command::Check { .. } => runtime.block_on(per_outbox(&config, true, async |c| run_check(&c).await)),
        Command::Setup { recreate_slot, skip_published, .. } => {
            match setup_config(config, recreate_slot, skip_published) {
                Ok(Some(config)) => runtime.block_on(run_setup(config, recreate_slot)),
                Ok(None) => ExitCode::SUCCESS,
                Err(code) => code,
            }
        }
        Command::Status { metrics_url, format, .. } => {
            runtime.block_on(per_outbox(&config, matches!(format, LogFormat::Text), async |c| {
                run_status(&c, metrics_url.as_deref(), format).await
            }))
        }
        Command::Locate { id, format, wait_secs, .. } => {
            let text = matches!(format, LogFormat::Text);
            runtime.block_on(per_outbox(&config, text, async |c| {
                run_locate(&c, &id, Duration::from_secs(wait_secs), format).await
            }))
        }
        Command::SwitchoverReady { standby, .. } => {
            match runtime.block_on(switchover::run(&config, &standby)) {
                Ok(Ok(ready)) => {
                    println!("ready: {ready}");
                    ExitCode::SUCCESS
                }
                Ok(Err(why)) => {
                    println!("not ready: {why}");
                    ExitCode::FAILURE
                }
                Err(e @ RelayError::Fatal { .. }) => {
                    eprintln!("error: {e}");
                    ExitCode::from(EXIT_CONFIG)
                }
                Err(e) => {
                    eprintln!("error: cannot tell: {e}");
                    ExitCode::FAILURE
                }
            }
        }
        Command::Verify { since, until, wait_secs, show, watch: true, every_secs, listen, .. } => {
            let since = since.or_else(|| Some(WATCH_WINDOW.to_string()));
            let options = verify::Options { since, until, wait: Duration::from_secs(wait_secs), show };
            match runtime.block_on(verify::watch::run(
                &config,
                &options,
                Duration::from_secs(every_secs),
                listen,
            )) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("error: {e}");
                    ExitCode::from(EXIT_CONFIG)
                }
            }
        }
        Command::Verify { since, until, format, wait_secs, show, .. } => {
            let options = verify::Options { since, until, wait: Duration::from_secs(wait_secs), show };
            let text = matches!(format, LogFormat::Text);
            runtime.block_on(per_outbox(&config, text, async |c| run_verify(&c, &options, format).await))
        }
        Command::ReplayDeadLetters { ids, dry_run, outbox, .. } => {
            let config = match one_outbox(&config, outbox.as_deref(), !ids.is_empty()) {
                Ok(config) => config,
                Err(e) => {
                    eprintln!("error: {e}");
                    return ExitCode::from(EXIT_CONFIG);
                }
            };
            let options = replay::Options { ids, dry_run };
            runtime.block_on(per_outbox(&config, true, async |c| run_replay(&c, &options).await))
        }
        Command::Republish { aggregate, aggregate_type, ids, since, until, dry_run, outbox, .. } => {
            let config = match one_outbox(&config, outbox.as_deref(), true) {
                Ok(config) => config,
                Err(e) => {
                    eprintln!("error: {}", e.replace("--ids needs", "republish needs"));
                    return ExitCode::from(EXIT_CONFIG);
                }
            };
            let aggregate = aggregate.map(|id| (aggregate_type, id));
            let options = republish::Options { aggregate, ids, since, until, dry_run };
            runtime.block_on(run_republish(&config, &options))
        }
        Command::Run { .. } => run(config, &runtime),
    }
}

async fn run_republish(config: &RelayConfig, options: &republish::Options) -> ExitCode {
    match republish::run(config, options).await {
        Ok(outcome) => {
            for line in &outcome.lines {
                println!("{line}");
            }
            match options.dry_run {
                true => println!("dry run: nothing sent; {} event(s) cannot be", outcome.refused),
                false => println!("sent {} event(s) again; {} could not be", outcome.sent, outcome.refused),
            }
            ExitCode::from(if outcome.refused == 0 { 0 } else { EXIT_FAILURE })
        }
        Err(e @ RelayError::Fatal { .. }) => {
            eprintln!("error: {e}");
            ExitCode::from(EXIT_CONFIG)
        }
        Err(e) => {
            eprintln!("error: republish could not finish: {e}");
            ExitCode::from(EXIT_FAILURE)
        }
    }
}

/// The configuration of outbox `name` alone, or all of them when no name is given and none is
/// `needed` (the letter ids of `replay-dead-letters --ids` belong to one outbox).
fn one_outbox(config: &RelayConfig, name: Option<&str>, needed: bool) -> Result<RelayConfig, String> {
    let outboxes = config.outboxes();
    let names = || outboxes.iter().map(|o| o.name.as_str()).collect::<Vec<_>>().join(", ");
    match name {
        None if needed && outboxes.len() > 1 => {
            Err(format!("--ids needs --outbox NAME with several outboxes: one of {}", names()))
        }
        None => Ok(config.clone()),
        Some(name) => match outboxes.iter().find(|o| o.name == name) {
            Some(outbox) => Ok(config.for_outbox(outbox)),
            None => Err(format!("--outbox {name}: no outbox has this name; the outboxes are {}", names())),
        },
    }
}

/// Runs an operator command for each of the relay's outboxes, in the configured order: with
/// several, each under a line naming it (`header`: in text output). The exit code is the first
/// failing one's.
async fn per_outbox(
    config: &RelayConfig,
    header: bool,
    run: impl AsyncFn(RelayConfig) -> ExitCode,
) -> ExitCode {
    let outboxes = config.outboxes();
    if outboxes.len() == 1 {
        return run(config.clone()).await;
    }
    let mut code = ExitCode::SUCCESS;
    for outbox in &outboxes {
        if header {
            println!("== outbox {} ({}.{}) ==", outbox.name, outbox.config.schema, outbox.config.table);
        }
        let ran = run(config.for_outbox(outbox)).await;
        if code == ExitCode::SUCCESS {
            code = ran;
        }
    }
    code
}

async fn run_replay(config: &RelayConfig, options: &replay::Options) -> ExitCode {
    match replay::run(config, options).await {
        Ok(outcome) => {
            for line in &outcome.lines {
                println!("{line}");
            }
            let verb = if options.dry_run { "would replay" } else { "replayed" };
            let ready =
                if options.dry_run { outcome.lines.len() as u64 - outcome.refused } else { outcome.replayed };
            println!("{verb} {ready} letter(s); {} cannot be, and stay", outcome.refused);
            ExitCode::from(if outcome.refused == 0 { 0 } else { EXIT_FAILURE })
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(EXIT_FAILURE)
        }
    }
}

/// `setup`'s configuration: `None` when polling mode has nothing to set up, the exit code when
/// the flags do not fit the mode.
fn setup_config(
    mut config: RelayConfig,
    recreate_slot: bool,
    skip_published: bool,
) -> Result<Option<RelayConfig>, ExitCode> {
    if config.source.mode != outbox_relay::config::SourceMode::Replication {
        // a slot made here would hold WAL for no one
        if recreate_slot || skip_published {
            eprintln!(
                "error: --recreate-slot and --skip-published are for replication mode, and source.mode \
                 is {}: polling has no slot",
                config.source.mode
            );
            return Err(ExitCode::from(EXIT_CONFIG));
        }
        println!(
            "source.mode = {}: nothing to set up (setup prepares replication mode's slot)",
            config.source.mode
        );
        return Ok(None);
    }
    if skip_published {
        // the read-back's own requirements (kafka.source_headers) hold as for dedup.enabled
        config.dedup.enabled = true;
        if let Err(e) = config.validate() {
            eprintln!("error: --skip-published: {e}");
            return Err(ExitCode::from(EXIT_CONFIG));
        }
    }
    Ok(Some(config))
}

/// `run`: the relay until a signal (0) or a fatal error (1, logged with its reason).
fn run(config: RelayConfig, runtime: &tokio::runtime::Runtime) -> ExitCode {
    tracing::info!(version = env!("CARGO_PKG_VERSION"), "starting outbox-relay: {}", config.summary());
    tracing::debug!(config = %config.redacted(), "effective configuration (secrets redacted)");
    match runtime.block_on(outbox_relay::relay::run(config)) {
        Ok(()) => {
            tracing::info!("stopped");
            ExitCode::SUCCESS
        }
        Err(e) => {
            let reason = match e.action() {
                outbox_relay::error::Action::Fatal(reason) => reason.label(),
                _ => "other",
            };
            tracing::error!(error = %e, reason = %reason, "fatal error, exiting");
            ExitCode::from(EXIT_FAILURE)
        }
    }
}

async fn run_check(config: &RelayConfig) -> ExitCode {
    let findings = check::run(config).await;
    for finding in &findings {
        println!("{finding}");
    }
    let failed = findings.iter().filter(|f| f.status == Status::Fail).count();
    let warned = findings.iter().filter(|f| f.status == Status::Warn).count();
    println!(
        "{} check(s): {failed} failed, {warned} warning(s), mode {}",
        findings.len(),
        config.source.mode
    );
    if failed > 0 { ExitCode::from(EXIT_FAILURE) } else { ExitCode::SUCCESS }
}

async fn run_status(config: &RelayConfig, metrics_url: Option<&str>, format: LogFormat) -> ExitCode {
    match outbox_relay::ops::status::run(config, metrics_url).await {
        Ok(lines) => {
            match format {
                LogFormat::Text => {
                    let width = lines.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
                    for (key, value) in &lines {
                        println!("{key:<width$}  {value}");
                    }
                }
                LogFormat::Json => {
                    let map: serde_json::Map<_, _> = lines
                        .into_iter()
                        .map(|(k, v)| (k.to_string(), serde_json::Value::String(v)))
                        .collect();
                    println!("{}", serde_json::to_string_pretty(&map).expect("json"));
                }
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(EXIT_FAILURE)
        }
    }
}

async fn run_locate(config: &RelayConfig, id: &str, wait: Duration, format: LogFormat) -> ExitCode {
    match locate::run(config, id, wait).await {
        Ok(receipt) => {
            match format {
                LogFormat::Text => print!("{}", receipt.text()),
                LogFormat::Json => println!("{}", serde_json::to_string_pretty(&receipt).expect("json")),
            }
            ExitCode::from(receipt.exit_code())
        }
        Err(e @ RelayError::Fatal { .. }) => {
            eprintln!("error: {e}");
            ExitCode::from(EXIT_CONFIG)
        }
        Err(e) => {
            eprintln!("error: locate could not finish: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run_verify(config: &RelayConfig, options: &verify::Options, format: LogFormat) -> ExitCode {
    match verify::run(config, options).await {
        Ok(report) => {
            match format {
                LogFormat::Text => print!("{}", report.text()),
                LogFormat::Json => println!("{}", serde_json::to_string_pretty(&report).expect("json")),
            }
            ExitCode::from(report.exit_code())
        }
        Err(e @ verify::VerifyError::Usage(_)) => {
            eprintln!("error: {e}");
            ExitCode::from(EXIT_CONFIG)
        }
        Err(e) => {
            eprintln!("error: verify could not finish: {e}");
            ExitCode::from(EXIT_FAILURE)
        }
    }
}

async fn run_setup(config: RelayConfig, recreate_slot: bool) -> ExitCode {
    let slot = config.replication.slot.clone();
    let publication = config.replication.publication.clone();
    match setup::run(config, recreate_slot).await {
        Ok(report) => {
            println!("publication \"{publication}\": present");
            match report {
                SetupReport::SlotCreated { at, copy } => println!(
                    "slot \"{slot}\": created at {at}; rows already in the table: {} published, {} already in \
                     Kafka (not sent again), {} dead-lettered",
                    copy.published, copy.already_in_kafka, copy.dead_lettered
                ),
                SetupReport::SlotPresent => println!("slot \"{slot}\": present, nothing to do"),
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(EXIT_FAILURE)
        }
    }
}

fn init_logging(format: LogFormat, filter: &str) {
    let filter = tracing_subscriber::EnvFilter::try_new(filter).unwrap_or_else(|e| {
        eprintln!("warning: --log-level {filter:?} is not a valid filter ({e}); using info");
        tracing_subscriber::EnvFilter::new("info")
    });
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let builder =
        tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(ansi);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().flatten_event(true).with_current_span(false).init(),
    }
}

/// One runtime thread unless `TOKIO_WORKER_THREADS` says otherwise. The relay's work is one
/// session's loop (librdkafka and the blocking calls have threads of their own), and a second
/// runtime thread costs more in cross-thread wake-ups than it gains: on two cores it drained
/// the same backlog slower and with more CPU per event (BENCHMARKS.md, "One runtime thread").
fn runtime() -> tokio::runtime::Runtime {
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if std::env::var_os("TOKIO_WORKER_THREADS").is_none() {
        builder.worker_threads(1);
    }
    builder.enable_all().build().expect("tokio runtime")
}
