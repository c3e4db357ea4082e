//! The command line: every command and flag of `outbox-relay`, as clap reads them, and the choice
//! of outbox a command works on. `main` parses it, loads the configuration it names and
//! dispatches; `--help` prints these doc comments.

use std::path::{Path, PathBuf};

use clap::{Parser, Subcommand, ValueEnum};

use crate::outboxes::{Outbox, Outboxes};

/// Moves committed transactional-outbox events from PostgreSQL to Apache Kafka.
///
/// Start with `outbox-relay check --config relay.toml`; every setting is documented in
/// deploy/relay.example.toml and can be overridden with OUTBOX_RELAY__SECTION__KEY variables
/// (for example OUTBOX_RELAY__POSTGRES__PASSWORD).
#[derive(Parser, Debug)]
#[command(name = "outbox-relay", version, about, long_about)]
pub struct Cli {
    /// Log format: `text` for people, `json` for log pipelines.
    #[arg(long, value_enum, default_value_t = LogFormat::Text, global = true, env = "OUTBOX_RELAY_LOG_FORMAT")]
    pub log_format: LogFormat,

    /// Log filter in tracing's EnvFilter syntax, e.g. `info` or `outbox_relay=debug`.
    #[arg(long, default_value = "info", global = true, env = "OUTBOX_RELAY_LOG")]
    pub log_level: String,

    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
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
    /// any duplicates), filtered out by the outbox's transforms (naming the rule), pending,
    /// dead-lettered (with the reason), missing, or unknown. Exits 0 published or filtered, 3
    /// pending, 1 otherwise, 2 on a bad argument or configuration. Reads only.
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
        /// With several outboxes (`[[outboxes]]`): the outbox whose event this is (its `name`).
        /// Needed then: each outbox numbers its events on its own.
        #[arg(long)]
        outbox: Option<String>,
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
        /// With several outboxes (`[[outboxes]]`): only this outbox (its `name`). Default: each
        /// in turn, under a line naming it.
        #[arg(long)]
        outbox: Option<String>,
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
        /// Letter ids, comma-separated, you checked and vouch for although the relay's key
        /// (`dead_letter.signing_key_file`) does not verify them: edited since the relay wrote
        /// them, or written without a key. Every other unverified letter is refused.
        #[arg(long, value_delimiter = ',')]
        vouch: Vec<i64>,
        /// With several outboxes (`[[outboxes]]`): only this outbox's letters (its `name`).
        /// Needed with `--ids`, whose letters belong to one outbox.
        #[arg(long)]
        outbox: Option<String>,
    },
}

#[derive(Copy, Clone, Debug, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

impl Command {
    /// The configuration file every command names.
    pub fn config(&self) -> &Path {
        match self {
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
        }
    }
}

impl Command {
    /// The outbox the command names (`--outbox`), and what needs one named with several: an
    /// event id belongs to one outbox, as do the letter ids of `replay-dead-letters --ids`;
    /// `republish` sends one outbox's events.
    pub fn outbox(&self) -> (Option<&str>, Option<&'static str>) {
        match self {
            Command::Locate { outbox, .. } => (outbox.as_deref(), Some("locate")),
            Command::Verify { outbox, .. } => (outbox.as_deref(), None),
            Command::ReplayDeadLetters { ids, vouch, outbox, .. } => {
                let needed_by =
                    (!ids.is_empty()).then_some("--ids").or((!vouch.is_empty()).then_some("--vouch"));
                (outbox.as_deref(), needed_by)
            }
            Command::Republish { outbox, .. } => (outbox.as_deref(), Some("republish")),
            _ => (None, None),
        }
    }
}

/// The outboxes a command runs for: outbox `name` alone, or all of them when no name is given
/// and no outbox must be named: `needed_by` names what needs one ([`Command::outbox`]).
pub fn chosen<'a>(
    outboxes: &'a Outboxes,
    name: Option<&str>,
    needed_by: Option<&str>,
) -> Result<Vec<&'a Outbox>, String> {
    let names = || outboxes.iter().map(|o| o.name.as_str()).collect::<Vec<_>>().join(", ");
    match (name, needed_by) {
        (None, Some(needer)) if outboxes.len() > 1 => {
            Err(format!("{needer} needs --outbox NAME with several outboxes: one of {}", names()))
        }
        (None, _) => Ok(outboxes.iter().collect()),
        (Some(name), _) => match outboxes.iter().find(|o| o.name == name) {
            Some(outbox) => Ok(vec![outbox]),
            None => Err(format!("--outbox {name}: no outbox has this name; the outboxes are {}", names())),
        },
    }
}
