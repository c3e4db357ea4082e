//! `outbox-relay check`: a preflight against the configured PostgreSQL and Kafka.
//!
//! Each finding is one line, `OK`, `WARN` or `FAIL`, and every non-OK line says how to fix it.
//! The checks never change anything; `check` is safe to run against production.

use std::fmt;
use std::time::Duration;

use tokio_postgres::Client;

use crate::config::{DeadLetterConfig, Endpoint, RelayConfig, SourceMode};
use crate::error::{FatalReason, RelayError};
use crate::outboxes::Outbox;

mod admin;
mod failover;
mod kafka_auth;
mod privileges;
mod published;
mod replication;
mod security;
mod topics;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Status {
    Ok,
    Warn,
    Fail,
}

#[derive(Debug, Clone)]
pub struct Finding {
    pub status: Status,
    /// Short name of what was checked, e.g. `postgres.wal_level`.
    pub check: &'static str,
    pub detail: String,
    /// What the operator should do; empty for OK.
    pub fix: String,
}

impl Finding {
    fn ok(check: &'static str, detail: impl Into<String>) -> Self {
        Finding { status: Status::Ok, check, detail: detail.into(), fix: String::new() }
    }
    fn warn(check: &'static str, detail: impl Into<String>, fix: impl Into<String>) -> Self {
        Finding { status: Status::Warn, check, detail: detail.into(), fix: fix.into() }
    }
    fn fail(check: &'static str, detail: impl Into<String>, fix: impl Into<String>) -> Self {
        Finding { status: Status::Fail, check, detail: detail.into(), fix: fix.into() }
    }
}

impl fmt::Display for Finding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let status = match self.status {
            Status::Ok => "OK  ",
            Status::Warn => "WARN",
            Status::Fail => "FAIL",
        };
        write!(f, "{status} {:<28} {}", self.check, self.detail)?;
        if !self.fix.is_empty() {
            write!(f, " -- fix: {}", self.fix)?;
        }
        Ok(())
    }
}

/// Every finding, and the mode they were checked for.
#[derive(Debug)]
pub struct Checked {
    pub findings: Vec<Finding>,
    pub mode: SourceMode,
}

impl super::Output for Checked {
    /// One line per finding, then the counts.
    fn text(&self) -> String {
        let mut out = String::new();
        for finding in &self.findings {
            out += &format!("{finding}\n");
        }
        let failed = self.count(Status::Fail);
        let warned = self.count(Status::Warn);
        out += &format!(
            "{} check(s): {failed} failed, {warned} warning(s), mode {}\n",
            self.findings.len(),
            self.mode
        );
        out
    }

    /// 1 when anything failed.
    fn exit_code(&self) -> u8 {
        if self.count(Status::Fail) > 0 { super::EXIT_FAILURE } else { 0 }
    }
}

impl Checked {
    fn count(&self, status: Status) -> usize {
        self.findings.iter().filter(|f| f.status == status).count()
    }
}

/// Runs every check that applies to the configured mode.
pub async fn run(config: &RelayConfig, outbox: &Outbox) -> Checked {
    let mut findings = Vec::new();
    let client = match connect(config).await {
        Ok((client, server)) => {
            findings.extend(postgres_checks((config, outbox), &client, &server).await);
            Some(client)
        }
        Err(finding) => {
            findings.push(finding);
            None
        }
    };
    findings.extend(kafka_auth::finding(config).await);
    let (kafka, topics) = kafka_check(config).await;
    findings.push(kafka);
    if let (Some(client), Some(topics)) = (&client, &topics) {
        findings.push(topics::finding(outbox, client, topics).await);
    }
    if let (Some(client), true) = (&client, config.kafka.transactional) {
        findings.push(transactions_finding(config, outbox, client).await);
    }
    findings.extend(security::config_findings(config));
    Checked { findings, mode: config.source.mode }
}

/// With Kafka transactions: the `transactional.id` the relay will use and the grant it needs.
/// Not tried: initializing transactions under that id would fence the running relay.
async fn transactions_finding(config: &RelayConfig, outbox: &Outbox, client: &Client) -> Finding {
    let id = match config.kafka.transactional_id.as_str() {
        "" => match crate::readback::source_identity(client, &outbox.config).await {
            Ok(source) => format!("outbox-relay:{source}"),
            Err(e) => return Finding::fail("kafka.transactional", format!("cannot derive the id: {e}"), ""),
        },
        id => id.to_string(),
    };
    Finding::ok(
        "kafka.transactional",
        format!(
            "transactional.id \"{id}\": {} needs WRITE and DESCRIBE on TransactionalId \"{id}\" (not tried: it \
             would fence the running relay; without it the relay stops, naming the grant)",
            config.kafka.principal()
        ),
    )
}

async fn connect(config: &RelayConfig) -> Result<(Client, Endpoint), Finding> {
    let pg = &config.postgres;
    let servers: Vec<String> = pg.endpoints().iter().map(Endpoint::to_string).collect();
    let target = format!("{}/{} as {}", servers.join(","), pg.database, pg.user);
    crate::postgres::connect_primary(pg).await.map_err(|e| {
        let fix = match &e {
            RelayError::Fatal { reason: FatalReason::TlsUnavailable, .. } => {
                "turn TLS on at the server, or connect through a server or proxy that has it (see above)"
            }
            RelayError::Fatal { reason: FatalReason::Tls, .. } => {
                "check postgres.sslmode, postgres.sslrootcert and postgres.host against the server's certificate"
            }
            RelayError::Fatal { .. } => "do what the message says: `run` stops with the same error",
            RelayError::Postgres(pg) if pg.as_db_error().is_some() => {
                "check postgres.user, postgres.password (OUTBOX_RELAY__POSTGRES__PASSWORD or postgres.password_file) \
                 and postgres.database, and pg_hba.conf"
            }
            _ => "check postgres.host and postgres.port, and that PostgreSQL is running and reachable",
        };
        Finding::fail("postgres.connect", format!("cannot connect to {target}: {e}"), fix)
    })
}

/// Whether this session is encrypted (`pg_stat_ssl`), and how.
async fn tls_check(config: &RelayConfig, client: &Client) -> Finding {
    let row =
        client.query_one("SELECT ssl, version FROM pg_stat_ssl WHERE pid = pg_backend_pid()", &[]).await;
    let sslmode = config.postgres.sslmode;
    match row {
        Ok(row) if row.get::<_, bool>("ssl") => Finding::ok(
            "postgres.tls",
            format!(
                "session encrypted ({}), sslmode = {sslmode}",
                row.get::<_, Option<String>>("version").unwrap_or_default()
            ),
        ),
        Ok(_) => Finding::warn(
            "postgres.tls",
            format!(
                "session NOT encrypted (sslmode = {sslmode}): the password and every event cross the network in clear"
            ),
            "enable ssl on the server and set postgres.sslmode = verify-full with postgres.sslrootcert",
        ),
        Err(e) => Finding::warn(
            "postgres.tls",
            format!("cannot read pg_stat_ssl: {}", crate::error::describe_pg(&e)),
            "PostgreSQL 9.5 or newer is required",
        ),
    }
}

async fn postgres_checks(
    (config, outbox): (&RelayConfig, &Outbox),
    client: &Client,
    server: &Endpoint,
) -> Vec<Finding> {
    let pg = &config.postgres;
    let version: String = query_setting(client, "server_version").await.unwrap_or_default();
    let mut findings = vec![Finding::ok(
        "postgres.connect",
        format!("connected to {server}/{} as {} (PostgreSQL {version})", pg.database, pg.user),
    )];
    findings.push(tls_check(config, client).await);
    let table = &outbox.table;
    let table_exists = match table_check(outbox, client).await {
        Ok(found) => {
            let exists = found.status != Status::Fail;
            findings.push(found);
            exists
        }
        Err(e) => {
            findings.push(Finding::fail(
                "outbox.table",
                format!("cannot inspect {}: {}", crate::error::describe_pg(&e), table.display_name()),
                "grant the relay role USAGE on the schema",
            ));
            false
        }
    };
    match config.source.mode {
        SourceMode::Replication => {
            findings.extend(replication::checks(config, outbox, client).await);
            findings.extend(failover::findings(config, client, server).await);
        }
        SourceMode::Polling => findings.extend(leftover_slot_checks((config, outbox), client).await),
    }
    if outbox.dead_letter.on_poison == crate::config::OnPoison::DeadLetter {
        findings.push(dead_letter_check(&outbox.dead_letter, client).await);
    }
    if table_exists {
        findings.push(privileges::check(config, outbox, client).await);
        findings.push(published::finding(client, &config.postgres.user).await);
        findings.extend(admin::findings(client, &config.admin, &config.postgres.user).await);
    }
    findings.push(security::privilege_finding(config, outbox, client).await);
    if config.source.mode == SourceMode::Polling {
        findings.push(security::public_connect_finding(client).await);
    }
    findings
}

const LEFTOVER_CHECK: &str = "polling.replication_slot";

/// Polling mode: no slot of this outbox's replication mode left behind (a mode switch not
/// finished: `replication.slot`, or a slot the relay made for this outbox under an earlier
/// name), as it keeps WAL and makes every polling session read each topic back whole. One
/// finding per slot.
async fn leftover_slot_checks((config, outbox): (&RelayConfig, &Outbox), client: &Client) -> Vec<Finding> {
    let slots = match crate::source::handover::leftover_slots(config, client).await {
        Ok(slots) if slots.is_empty() => {
            return vec![Finding::ok(
                LEFTOVER_CHECK,
                format!(
                    "no slot \"{}\" (or other slot the relay made for this outbox) left from replication mode",
                    config.replication.slot
                ),
            )];
        }
        Ok(slots) => slots,
        Err(e) => {
            return vec![Finding::warn(
                LEFTOVER_CHECK,
                format!("cannot read pg_replication_slots: {}", crate::error::describe_pg(&e)),
                "check the role's privileges",
            )];
        }
    };
    slots.iter().map(|slot| leftover_slot_finding((config, outbox), slot)).collect()
}

fn leftover_slot_finding(
    (config, outbox): (&RelayConfig, &Outbox),
    slot: &crate::source::handover::LeftoverSlot,
) -> Finding {
    let mut detail = format!(
        "slot \"{}\" of replication mode still exists (active = {}) and retains {} bytes of WAL",
        slot.name, slot.active, slot.retained_bytes
    );
    if slot.name != config.replication.slot {
        detail.push_str(&format!(
            " (the relay made it for {} under an earlier replication.slot)",
            outbox.table.display_name()
        ));
    }
    if slot.active {
        Finding::fail(
            LEFTOVER_CHECK,
            detail,
            "stop the replication relay that streams from it: both would publish",
        )
    } else if !config.dedup.enabled {
        Finding::fail(
            LEFTOVER_CHECK,
            format!(
                "{detail}; with dedup.enabled = false polling would send again every row replication mode published"
            ),
            "set dedup.enabled = true for the switch (docs/operations.md, Switching source modes)",
        )
    } else {
        Finding::warn(
            LEFTOVER_CHECK,
            format!("{detail}; polling reads each topic back whole until it is dropped"),
            slot.remedy(),
        )
    }
}

/// The dead-letter table exists with the columns the relay writes.
async fn dead_letter_check(letters: &DeadLetterConfig, client: &Client) -> Finding {
    const COLUMNS: [(&str, &str); 4] =
        [("source_table", "text"), ("event_id", "text"), ("row_data", "jsonb"), ("reason", "text")];
    let (schema, table) = letters.schema_and_table();
    let rows = client
        .query(
            "SELECT a.attname::text AS name, format_type(a.atttypid, a.atttypmod) AS type \
             FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid JOIN pg_namespace n ON n.oid = c.relnamespace \
             WHERE n.nspname = $1 AND c.relname = $2 AND a.attnum > 0 AND NOT a.attisdropped",
            &[&schema, &table],
        )
        .await;
    let name = &letters.table;
    let present: Vec<(String, String)> = match rows {
        Ok(rows) => rows.iter().map(|r| (r.get("name"), r.get("type"))).collect(),
        Err(e) => {
            return Finding::fail(
                "dead_letter.table",
                format!("cannot inspect {name}: {}", crate::error::describe_pg(&e)),
                "check the role's privileges",
            );
        }
    };
    if present.is_empty() {
        return Finding::fail(
            "dead_letter.table",
            format!("dead-letter table {name} does not exist"),
            "apply sql/004_dead_letter.sql, or set dead_letter.table",
        );
    }
    // (signed letters: dead_letter.signing_key_file)
    let signed = !letters.signing_key_file.is_empty();
    let wrong: Vec<String> = COLUMNS
        .iter()
        .chain(signed.then_some(&("digest", "text")))
        .filter(|(column, ty)| !present.iter().any(|(n, t)| n == column && t == ty))
        .map(|(column, ty)| format!("{column} {ty}"))
        .collect();
    if wrong.is_empty() {
        Finding::ok("dead_letter.table", format!("dead-letter table {name} has the columns the relay writes"))
    } else {
        Finding::fail(
            "dead_letter.table",
            format!("dead-letter table {name} lacks {}", wrong.join(", ")),
            "create it as sql/004_dead_letter.sql does (and sql/011_dead_letter_digest.sql, with dead_letter.signing_key_file)",
        )
    }
}

async fn query_setting(client: &Client, name: &str) -> Result<String, tokio_postgres::Error> {
    let row = client.query_one("SELECT current_setting($1)", &[&name]).await?;
    Ok(row.get(0))
}

/// The outbox table exists and has every configured column.
async fn table_check(outbox: &Outbox, client: &Client) -> Result<Finding, tokio_postgres::Error> {
    let table = &outbox.table;
    let oid_row = client.query_one("SELECT to_regclass($1)::oid", &[&table.qualified()]).await?;
    let oid: Option<u32> = oid_row.get(0);
    let Some(oid) = oid else {
        return Ok(Finding::fail(
            "outbox.table",
            format!("table {} does not exist", table.display_name()),
            "apply the migrations in sql/ (psql -f sql/001_outbox_events.sql ...), or set outbox.schema / outbox.table",
        ));
    };
    let rows = client
        .query(
            "SELECT attname::text FROM pg_attribute WHERE attrelid = $1 AND attnum > 0 AND NOT attisdropped",
            &[&oid],
        )
        .await?;
    let present: Vec<String> = rows.iter().map(|r| r.get(0)).collect();
    let columns = &outbox.config.columns;
    let others = outbox.table.others().iter().map(|name| ("", name.as_str()));
    let missing: Vec<String> = columns
        .required()
        .into_iter()
        .chain(columns.optional())
        .chain(others)
        .filter(|(_, name)| !present.iter().any(|p| p == name))
        .map(|(key, name)| match key {
            "" => format!("{name} (a header rule's column:{name})"),
            key => format!("outbox.columns.{key} = \"{name}\""),
        })
        .collect();
    if missing.is_empty() {
        Ok(Finding::ok("outbox.table", format!("table {} has every configured column", table.display_name())))
    } else {
        Ok(Finding::fail(
            "outbox.table",
            format!("table {} lacks the configured column(s): {}", table.display_name(), missing.join(", ")),
            "set the outbox.columns.* names to the table's columns (an optional column can be set to \"\"), and \
             point header rules at columns the table has",
        ))
    }
}

/// The brokers' finding, and the topics they know when they answered.
async fn kafka_check(config: &RelayConfig) -> (Finding, Option<std::collections::BTreeSet<String>>) {
    let kafka = config.kafka.clone();
    let brokers = kafka.brokers.join(",");
    let fetched = tokio::task::spawn_blocking(move || {
        crate::sink::kafka::cluster::fetch_cluster_info(&kafka, Duration::from_secs(10))
    })
    .await;
    match fetched {
        Ok(Ok(info)) => (
            Finding::ok(
                "kafka.brokers",
                format!("reached {brokers}: {} broker(s), {} topic(s)", info.brokers, info.topics.len()),
            ),
            Some(info.topics),
        ),
        Ok(Err(e)) => (
            Finding::fail(
                "kafka.brokers",
                format!("cannot reach {brokers}: {e}"),
                "check kafka.brokers, that the brokers are running, and kafka.properties for TLS/SASL",
            ),
            None,
        ),
        Err(e) => (
            Finding::fail("kafka.brokers", format!("metadata request panicked: {e}"), "report this as a bug"),
            None,
        ),
    }
}
