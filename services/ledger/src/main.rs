//! `ledger`: the consumer end of the chain. It reads `OrderPlaced` events that outbox-relay
//! published to `outbox.event.order`, and applies each **once**: it debits the customer's
//! wallet and writes a ledger row, or declines the payment, and in the same transaction writes
//! the follow-up event (`PaymentCompleted` / `PaymentDeclined`) into the relay's outbox.
//!
//! The guarantee, in five lines:
//! 1. one local transaction per event: the inbox row (`processed_events`, keyed by the
//!    `outbox_relay_source` and `id` headers), the debit or the decline, and the follow-up outbox
//!    event ([`apply`]);
//! 2. the Kafka offset is committed only after that transaction committed ([`consumer`]), so a
//!    crash redelivers, and the inbox turns a redelivery into a no-op;
//! 3. the debit is a single conditional UPDATE: two concurrent debits can never overdraw;
//! 4. a lock timeout, serialization failure or deadlock is retried with backoff, then
//!    dead-lettered; an unreachable database, or one out of disk, memory or otherwise failing
//!    server-wide, is waited for, never dead-lettered ([`retry`]);
//! 5. a record that can never apply (not JSON, a field missing, no usable `id` or source header, an
//!    unknown event type) goes to the dead-letter topic at once, with every original header and the
//!    reason ([`dead_letter`]); nothing is skipped silently.
//!
//! Commands (exit status 0 ok, 1 failure, 2 invalid configuration; errors go to stderr as
//! `error: ...`):
//! - `ledger run --config FILE` (or `LEDGER_CONFIG=FILE`): consume until SIGTERM/SIGINT, which
//!   finishes and commits the record in hand;
//! - `ledger replay-dlq --config FILE [--limit N]`: send the dead letters back to the topic they
//!   came from (without their `dlq_*` headers), in group `<group_id>-replay`, committing each;
//!   it stops at the end of the dead-letter topic. The inbox applies a replayed event once, and
//!   skips it if it was applied meanwhile.
//!
//! Configuration: `deploy/ledger.example.toml`, every key overridable by `LEDGER__SECTION__KEY`.
//! Logs: stderr, filtered by `RUST_LOG` (default `info`); one line per dead letter (warn), per
//! decline (info), per duplicate (debug).
//!
//! Modules: [`config`], [`record`] (what a record means), [`apply`] (the transaction),
//! [`retry`] (the failure policy and backoff), [`consumer`] (the loop and offset commits),
//! [`dead_letter`] (dead letters and replay), [`error`] (what stops the process).

mod apply;
mod config;
mod consumer;
mod dead_letter;
mod error;
mod record;
mod retry;

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use tokio::sync::watch;

use crate::config::LedgerConfig;
use crate::consumer::Ledger;
use crate::error::LedgerError;

/// Applies each OrderPlaced event once: debits the wallet or declines, in one transaction with
/// the inbox row and the follow-up outbox event.
#[derive(Parser, Debug)]
#[command(name = "ledger", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Consume and apply events until SIGTERM or SIGINT.
    Run {
        /// Configuration file (TOML); see deploy/ledger.example.toml.
        #[arg(long, short, env = "LEDGER_CONFIG")]
        config: PathBuf,
    },
    /// Send dead letters back to their original topic, then exit.
    ReplayDlq {
        /// Configuration file (TOML); see deploy/ledger.example.toml.
        #[arg(long, short, env = "LEDGER_CONFIG")]
        config: PathBuf,
        /// Replay at most this many dead letters.
        #[arg(long)]
        limit: Option<u64>,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging();
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("tokio runtime");
    match runtime.block_on(run(cli.command)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(e.exit_code())
        }
    }
}

use outbox_relay::config::TracingConfig;

async fn run(command: Command) -> Result<(), LedgerError> {
    let (Command::Run { config } | Command::ReplayDlq { config, .. }) = &command;
    let config = LedgerConfig::load(config, std::env::vars().collect())?;
    let shutdown = shutdown_signal();
    match command {
        Command::Run { .. } => {
            tracing::info!(version = env!("CARGO_PKG_VERSION"), config = %config.summary(), "starting ledger");
            outbox_relay::relay::start_tracing(&TracingConfig::for_service("ledger"))
                .map_err(LedgerError::Connect)?;
            match Ledger::start(config, shutdown).await? {
                Some(ledger) => ledger.run().await,
                None => Ok(()),
            }
        }
        Command::ReplayDlq { limit, .. } => {
            let replayed = dead_letter::replay(&config, limit, shutdown).await?;
            tracing::info!(replayed, "replay done");
            println!("replayed {replayed} dead letter(s)");
            Ok(())
        }
    }
}

fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let colors = std::io::stderr().is_terminal();
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(colors).init();
}

/// Turns true at the first SIGTERM or SIGINT.
fn shutdown_signal() -> watch::Receiver<bool> {
    let (stop, stopped) = watch::channel(false);
    tokio::spawn(async move {
        let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("install the SIGTERM handler");
        tokio::select! {
            _ = terminate.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
        }
        tracing::info!("shutdown requested: finishing the record in hand");
        // the receivers see `true` even after this task ends
        let _ = stop.send(true);
    });
    stopped
}
