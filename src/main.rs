//! Bootstrap only: parse the command line ([`outbox_relay::ops::cli`]), load and validate the
//! configuration, start logging, dispatch the command, print what it says with the one printer
//! ([`print_output`]), and map its outcome to an exit code (0 ok, 1 failure, 2 invalid
//! configuration or argument; `verify` and `locate` add 3: nothing wrong found, some rows still
//! pending).

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use outbox_relay::config::RelayConfig;
use outbox_relay::ops::cli::{Cli, Command, LogFormat, chosen};
use outbox_relay::ops::remote::{self, Reached};
use outbox_relay::ops::{EXIT_FAILURE, EXIT_USAGE, Failure, Output};
use outbox_relay::ops::{check, locate, replay, republish, setup, status, switchover, verify};
use outbox_relay::outboxes::{Outbox, Outboxes};
use serde_json::json;
use tokio::runtime::Runtime;

/// `verify --watch`'s rolling window when `--since` is not given.
const WATCH_WINDOW: &str = "15m";

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging(cli.log_format, &cli.log_level);
    let config = match RelayConfig::load(cli.command.config())
        .and_then(|config| outbox_relay::record::registry::check(&config).map(|()| config))
    {
        Ok(config) => config,
        Err(e) => {
            eprintln!("error: invalid configuration: {e}");
            return ExitCode::from(EXIT_USAGE);
        }
    };
    for deprecation in &config.deprecations {
        tracing::warn!("{deprecation}");
    }
    dispatch(cli.command, config, &runtime())
}

/// Runs `command` and prints what it says; the exit code.
fn dispatch(command: Command, config: RelayConfig, runtime: &Runtime) -> ExitCode {
    let text = LogFormat::Text;
    let outboxes = Outboxes::new(&config);
    let (name, needed_by) = command.outbox();
    let chosen = match chosen(&outboxes, name, needed_by) {
        Ok(chosen) => chosen,
        Err(e) => return print_output(Err::<(), _>(Failure::usage(e)), text),
    };
    match command {
        Command::Run { .. } => run(config, runtime),
        Command::Validate { .. } => {
            println!("{}", serde_json::to_string_pretty(&config.redacted()).expect("json"));
            ExitCode::SUCCESS
        }
        Command::Check { .. } => runtime.block_on(per_outbox(&chosen, true, async |o| {
            print_output(Ok::<_, Failure>(check::run(&config, o).await), text)
        })),
        Command::Setup { recreate_slot, skip_published, .. } => {
            print_output(runtime.block_on(setup::command(config, recreate_slot, skip_published)), text)
        }
        Command::Status { metrics_url, format, .. } => {
            runtime.block_on(per_outbox(&chosen, is_text(format), async |o| {
                let report = status::run(&config, o, metrics_url.as_deref()).await;
                print_output(report.map_err(Failure::failed), format)
            }))
        }
        Command::Locate { id, format, wait_secs, .. } => {
            runtime.block_on(per_outbox(&chosen, is_text(format), async |o| {
                let receipt = locate::run(&config, o, &id, Duration::from_secs(wait_secs)).await;
                print_output(receipt.map_err(|e| Failure::of(e, "locate could not finish")), format)
            }))
        }
        Command::SwitchoverReady { standby, .. } => {
            let verdict = runtime.block_on(switchover::run(&config, &standby));
            print_output(verdict.map(switchover::Readiness).map_err(|e| Failure::of(e, "cannot tell")), text)
        }
        Command::Verify { since, until, format, wait_secs, show, watch, every_secs, listen, .. } => {
            let wait = Duration::from_secs(wait_secs);
            let watch = watch.then_some((Duration::from_secs(every_secs), listen));
            let options = verify::Options { since, until, wait, show };
            run_verify((&config, &chosen), options, watch, format, runtime)
        }
        Command::ReplayDeadLetters { ids, dry_run, vouch, .. } => {
            runtime.block_on(per_outbox(&chosen, true, async |o| {
                // a running relay replays beside its stream; offline only when none answers
                let body = json!({ "outbox": o.name, "ids": ids, "vouch": vouch, "dry_run": dry_run });
                match remote::act(&config, "/v1/dead-letters/replay", &body).await {
                    Ok(Reached::Receipt(receipt)) => print_output(Ok::<_, Failure>(receipt), text),
                    Ok(Reached::NoRelay(_)) => {
                        let options = replay::Options { ids: ids.clone(), vouched: vouch.clone(), dry_run };
                        print_output(replay::run(&config, o, &options).await.map_err(Failure::failed), text)
                    }
                    Err(failure) => print_output(Err::<(), _>(failure), text),
                }
            }))
        }
        Command::Republish { aggregate, aggregate_type, ids, since, until, dry_run, .. } => {
            let body = json!({
                "outbox": chosen[0].name, "aggregate_id": aggregate, "aggregate_type": aggregate_type, "ids": ids,
                "since": since, "until": until, "dry_run": dry_run,
            });
            // a running relay republishes beside its stream; offline only when none answers
            match runtime.block_on(remote::act(&config, "/v1/republish", &body)) {
                Ok(Reached::Receipt(receipt)) => print_output(Ok::<_, Failure>(receipt), text),
                Ok(Reached::NoRelay(_)) => {
                    let aggregate = aggregate.map(|id| (aggregate_type, id));
                    let options = republish::Options { aggregate, ids, since, until, dry_run };
                    let outcome = runtime.block_on(republish::run(&config, chosen[0], &options));
                    print_output(outcome.map_err(|e| Failure::of(e, "republish could not finish")), text)
                }
                Err(failure) => print_output(Err::<(), _>(failure), text),
            }
        }
    }
}

/// The one printer: a command's output on stdout (as JSON with `--format json`, when it has a
/// JSON form), or why it gave none on stderr; the exit code either says.
fn print_output(outcome: Result<impl Output, Failure>, format: LogFormat) -> ExitCode {
    match outcome {
        Ok(output) => {
            match matches!(format, LogFormat::Json).then(|| output.json()).flatten() {
                Some(json) => println!("{json}"),
                None => print!("{}", output.text()),
            }
            ExitCode::from(output.exit_code())
        }
        Err(failure) => {
            eprintln!("error: {}", failure.message);
            ExitCode::from(failure.exit)
        }
    }
}

fn is_text(format: LogFormat) -> bool {
    matches!(format, LogFormat::Text)
}

/// `verify`: once, a report per outbox; or with `watch` (every, listen) again and again over a
/// rolling window until a signal, where any error is the command's (exit 2).
fn run_verify(
    (config, outboxes): (&RelayConfig, &[&Outbox]),
    mut options: verify::Options,
    watch: Option<(Duration, SocketAddr)>,
    format: LogFormat,
    runtime: &Runtime,
) -> ExitCode {
    if let Some((every, listen)) = watch {
        options.since = options.since.or_else(|| Some(WATCH_WINDOW.to_string()));
        let watched = runtime.block_on(verify::watch::run((config, outboxes), &options, every, listen));
        return print_output(watched.map_err(Failure::usage), LogFormat::Text);
    }
    runtime.block_on(per_outbox(outboxes, is_text(format), async |o| {
        print_output(verify::run(config, o, &options).await.map_err(Failure::from), format)
    }))
}

/// Runs an operator command for each of `outboxes`, in the configured order: with several, each
/// under a line naming it (`header`: in text output). The exit code is the first failing one's.
async fn per_outbox(outboxes: &[&Outbox], header: bool, run: impl AsyncFn(&Outbox) -> ExitCode) -> ExitCode {
    let mut code = ExitCode::SUCCESS;
    for outbox in outboxes {
        if header && outboxes.len() > 1 {
            println!("== outbox {} ({}) ==", outbox.name, outbox.table.display_name());
        }
        let ran = run(outbox).await;
        if code == ExitCode::SUCCESS {
            code = ran;
        }
    }
    code
}

/// `run`: the relay until a signal (0) or a fatal error (1, logged with its reason).
fn run(config: RelayConfig, runtime: &Runtime) -> ExitCode {
    tracing::info!(version = env!("CARGO_PKG_VERSION"), "starting outbox-relay: {}", config.summary());
    tracing::debug!(config = %config.redacted(), "effective configuration (secrets redacted)");
    match runtime.block_on(outbox_relay::relay::run(config)) {
        Ok(()) => {
            tracing::info!("stopped");
            ExitCode::SUCCESS
        }
        Err(e) => {
            outbox_relay::sink::kafka::mark_stopping();
            let reason = match e.action() {
                outbox_relay::error::Action::Fatal(reason) => reason.label(),
                _ => "other",
            };
            tracing::error!(error = %e, reason = %reason, "fatal error, exiting");
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
fn runtime() -> Runtime {
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if std::env::var_os("TOKIO_WORKER_THREADS").is_none() {
        builder.worker_threads(1);
    }
    builder.enable_all().build().expect("tokio runtime")
}
