//! `outbox-relay check`: a preflight against the configured PostgreSQL and Kafka.
//!
//! Each finding is one line, `OK`, `WARN` or `FAIL`, and every non-OK line says how to fix it.
//! The checks never change anything; `check` is safe to run against production.

use std::fmt;
use std::time::Duration;

use tokio_postgres::Client;

use crate::config::{Endpoint, RelayConfig, SourceMode};
use crate::error::{FatalReason, RelayError};
use crate::source::replication::publication::{self, Problem};
use crate::table::OutboxTable;

mod failover;
mod privileges;
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

/// Runs every check that applies to the configured mode.
pub async fn run(config: &RelayConfig) -> Vec<Finding> {
    let mut findings = Vec::new();
    let client = match connect(config).await {
        Ok((client, server)) => {
            findings.extend(postgres_checks(config, &client, &server).await);
            Some(client)
        }
        Err(finding) => {
            findings.push(finding);
            None
        }
    };
    let (kafka, topics) = kafka_check(config).await;
    findings.push(kafka);
    if let (Some(client), Some(topics)) = (&client, &topics) {
        findings.push(topics::finding(config, client, topics).await);
    }
    findings
}

async fn connect(config: &RelayConfig) -> Result<(Client, Endpoint), Finding> {
    let pg = &config.postgres;
    let servers: Vec<String> = pg.endpoints().iter().map(Endpoint::to_string).collect();
    let target = format!("{}/{} as {}", servers.join(","), pg.database, pg.user);
    crate::postgres::connect_primary(pg).await.map_err(|e| {
        let fix = match &e {
            RelayError::Fatal { reason: FatalReason::Tls, .. } => {
                "check postgres.sslmode, postgres.sslrootcert and postgres.host against the server's certificate"
            }
            RelayError::Fatal { .. } => "fix the setting the message names",
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
            format!("cannot read pg_stat_ssl: {e}"),
            "PostgreSQL 9.5 or newer is required",
        ),
    }
}

async fn postgres_checks(config: &RelayConfig, client: &Client, server: &Endpoint) -> Vec<Finding> {
    let pg = &config.postgres;
    let version: String = query_setting(client, "server_version").await.unwrap_or_default();
    let mut findings = vec![Finding::ok(
        "postgres.connect",
        format!("connected to {server}/{} as {} (PostgreSQL {version})", pg.database, pg.user),
    )];
    findings.push(tls_check(config, client).await);
    let table = OutboxTable::new(config);
    let table_exists = match table_check(config, client, &table).await {
        Ok(found) => {
            let exists = found.status != Status::Fail;
            findings.push(found);
            exists
        }
        Err(e) => {
            findings.push(Finding::fail(
                "outbox.table",
                format!("cannot inspect {}: {e}", table.display_name()),
                "grant the relay role USAGE on the schema",
            ));
            false
        }
    };
    match config.source.mode {
        SourceMode::Replication => {
            findings.extend(replication_checks(config, client).await);
            findings.extend(failover::findings(config, client, server).await);
        }
        SourceMode::Polling => findings.extend(leftover_slot_checks(config, client).await),
    }
    if config.dead_letter.on_poison == crate::config::OnPoison::DeadLetter {
        findings.push(dead_letter_check(config, client).await);
    }
    if table_exists {
        findings.push(privileges::check(config, client).await);
    }
    findings
}

const LEFTOVER_CHECK: &str = "polling.replication_slot";

/// Polling mode: no slot of this outbox's replication mode left behind (a mode switch not
/// finished: `replication.slot`, or a slot the relay made for this outbox under an earlier
/// name), as it keeps WAL and makes every polling session read each topic back whole. One
/// finding per slot.
async fn leftover_slot_checks(config: &RelayConfig, client: &Client) -> Vec<Finding> {
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
                format!("cannot read pg_replication_slots: {e}"),
                "check the role's privileges",
            )];
        }
    };
    slots.iter().map(|slot| leftover_slot_finding(config, slot)).collect()
}

fn leftover_slot_finding(config: &RelayConfig, slot: &crate::source::handover::LeftoverSlot) -> Finding {
    let mut detail = format!(
        "slot \"{}\" of replication mode still exists (active = {}) and retains {} bytes of WAL",
        slot.name, slot.active, slot.retained_bytes
    );
    if slot.name != config.replication.slot {
        detail.push_str(&format!(
            " (the relay made it for {} under an earlier replication.slot)",
            OutboxTable::new(config).display_name()
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
            "set dedup.enabled = true for the switch (README, Switching source modes)",
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
async fn dead_letter_check(config: &RelayConfig, client: &Client) -> Finding {
    const COLUMNS: [(&str, &str); 4] =
        [("source_table", "text"), ("event_id", "text"), ("row_data", "jsonb"), ("reason", "text")];
    let (schema, table) = config.dead_letter.schema_and_table();
    let rows = client
        .query(
            "SELECT a.attname::text AS name, format_type(a.atttypid, a.atttypmod) AS type \
             FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid JOIN pg_namespace n ON n.oid = c.relnamespace \
             WHERE n.nspname = $1 AND c.relname = $2 AND a.attnum > 0 AND NOT a.attisdropped",
            &[&schema, &table],
        )
        .await;
    let name = &config.dead_letter.table;
    let present: Vec<(String, String)> = match rows {
        Ok(rows) => rows.iter().map(|r| (r.get("name"), r.get("type"))).collect(),
        Err(e) => {
            return Finding::fail(
                "dead_letter.table",
                format!("cannot inspect {name}: {e}"),
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
    let wrong: Vec<String> = COLUMNS
        .iter()
        .filter(|(column, ty)| !present.iter().any(|(n, t)| n == column && t == ty))
        .map(|(column, ty)| format!("{column} {ty}"))
        .collect();
    if wrong.is_empty() {
        Finding::ok("dead_letter.table", format!("dead-letter table {name} has the columns the relay writes"))
    } else {
        Finding::fail(
            "dead_letter.table",
            format!("dead-letter table {name} lacks {}", wrong.join(", ")),
            "create it as sql/004_dead_letter.sql does",
        )
    }
}

async fn query_setting(client: &Client, name: &str) -> Result<String, tokio_postgres::Error> {
    let row = client.query_one("SELECT current_setting($1)", &[&name]).await?;
    Ok(row.get(0))
}

/// The outbox table exists and has every configured column.
async fn table_check(
    config: &RelayConfig,
    client: &Client,
    table: &OutboxTable,
) -> Result<Finding, tokio_postgres::Error> {
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
    let columns = &config.outbox.columns;
    let missing: Vec<String> = columns
        .required()
        .into_iter()
        .chain(columns.optional())
        .filter(|(_, name)| !present.iter().any(|p| p == name))
        .map(|(key, name)| format!("outbox.columns.{key} = \"{name}\""))
        .collect();
    if missing.is_empty() {
        Ok(Finding::ok("outbox.table", format!("table {} has every configured column", table.display_name())))
    } else {
        Ok(Finding::fail(
            "outbox.table",
            format!("table {} lacks the configured column(s): {}", table.display_name(), missing.join(", ")),
            "set the outbox.columns.* names to the table's columns (an optional column can be set to \"\")",
        ))
    }
}

async fn replication_checks(config: &RelayConfig, client: &Client) -> Vec<Finding> {
    let mut findings = Vec::new();
    match query_setting(client, "wal_level").await {
        Ok(level) if level == "logical" => findings.push(Finding::ok("postgres.wal_level", "wal_level = logical")),
        Ok(level) => findings.push(Finding::fail(
            "postgres.wal_level",
            format!("wal_level = {level}; replication mode needs logical"),
            "set wal_level = logical in postgresql.conf (ALTER SYSTEM SET wal_level = logical) and restart PostgreSQL, or use source.mode = \"polling\"",
        )),
        Err(e) => findings.push(Finding::fail("postgres.wal_level", format!("cannot read wal_level: {e}"), "check the role can run SHOW")),
    }
    let role = client
        .query_one("SELECT rolreplication OR rolsuper FROM pg_roles WHERE rolname = current_user", &[])
        .await;
    match role {
        Ok(row) if row.get::<_, bool>(0) => findings
            .push(Finding::ok("postgres.role", format!("role {} has REPLICATION", config.postgres.user))),
        Ok(_) => findings.push(Finding::fail(
            "postgres.role",
            format!("role {} lacks the REPLICATION attribute", config.postgres.user),
            format!("ALTER ROLE {} WITH REPLICATION (see sql/100_relay_role.sql)", config.postgres.user),
        )),
        Err(e) => findings.push(Finding::fail(
            "postgres.role",
            format!("cannot read role attributes: {e}"),
            "check the role can read pg_roles",
        )),
    }
    for name in ["max_replication_slots", "max_wal_senders"] {
        match query_setting(client, name).await.map(|v| v.parse::<i64>().unwrap_or(0)) {
            Ok(n) if n > 0 => findings.push(Finding::ok(setting_check_name(name), format!("{name} = {n}"))),
            Ok(n) => findings.push(Finding::fail(
                setting_check_name(name),
                format!("{name} = {n}; replication needs at least 1"),
                format!("set {name} >= 1 in postgresql.conf and restart PostgreSQL"),
            )),
            Err(e) => findings.push(Finding::fail(
                setting_check_name(name),
                format!("cannot read {name}: {e}"),
                "check the role can run SHOW",
            )),
        }
    }
    findings.push(slot_check(config, client).await);
    findings.push(publication_check(config, client).await);
    findings.push(emit_check(client).await);
    match query_setting(client, "max_slot_wal_keep_size").await {
        Ok(size) if size == "-1" => findings.push(Finding::warn(
            "postgres.max_slot_wal_keep_size",
            "max_slot_wal_keep_size = -1: a stalled relay makes PostgreSQL keep WAL without limit until the disk fills",
            "set max_slot_wal_keep_size to WAL rate x the longest relay outage you accept (README, PostgreSQL settings)",
        )),
        Ok(size) => findings.push(Finding::ok("postgres.max_slot_wal_keep_size", format!("max_slot_wal_keep_size = {size}"))),
        Err(e) => findings.push(Finding::warn("postgres.max_slot_wal_keep_size", format!("cannot read it: {e}"), "PostgreSQL 13 or newer is required")),
    }
    findings
}

async fn slot_check(config: &RelayConfig, client: &Client) -> Finding {
    let slot = &config.replication.slot;
    let row = client
        .query_opt(
            "SELECT wal_status, active, confirmed_flush_lsn::text, \
                    pg_size_pretty(pg_current_wal_lsn() - confirmed_flush_lsn) \
             FROM pg_replication_slots WHERE slot_name = $1",
            &[slot],
        )
        .await;
    match row {
        Ok(None) if config.replication.create_slot => Finding::ok(
            "replication.slot",
            format!("slot \"{slot}\" does not exist yet; `run` or `setup` creates it"),
        ),
        Ok(None) => Finding::fail(
            "replication.slot",
            format!("slot \"{slot}\" does not exist and replication.create_slot = false"),
            "run `outbox-relay setup` or set replication.create_slot = true",
        ),
        Ok(Some(r)) => {
            let wal_status: Option<String> = r.get(0);
            let detail = format!(
                "slot \"{slot}\": wal_status = {}, active = {}, confirmed_flush_lsn = {}, lag {}",
                wal_status.as_deref().unwrap_or("?"),
                r.get::<_, bool>(1),
                r.get::<_, Option<String>>(2).unwrap_or_default(),
                r.get::<_, Option<String>>(3).unwrap_or_default()
            );
            match wal_status.as_deref() {
                Some("lost") => Finding::fail(
                    "replication.slot",
                    detail,
                    "the slot was invalidated; raise max_slot_wal_keep_size and run `outbox-relay setup --recreate-slot`",
                ),
                Some("unreserved") => Finding::warn(
                    "replication.slot",
                    detail,
                    "the slot is about to lose WAL it needs: get the relay running and caught up now",
                ),
                _ => Finding::ok("replication.slot", detail),
            }
        }
        Err(e) => Finding::fail(
            "replication.slot",
            format!("cannot read pg_replication_slots: {e}"),
            "check the role's privileges",
        ),
    }
}

async fn publication_check(config: &RelayConfig, client: &Client) -> Finding {
    let publication = &config.replication.publication;
    let table = OutboxTable::new(config);
    let exists = client.query_opt("SELECT 1 FROM pg_publication WHERE pubname = $1", &[publication]).await;
    let problem = match exists {
        Ok(Some(_)) => publication::problem(config, client).await,
        Ok(None) if config.replication.create_publication => {
            return Finding::ok(
                "replication.publication",
                format!(
                    "publication \"{publication}\" does not exist yet; the relay creates it (as the table owner)"
                ),
            );
        }
        Ok(None) => {
            return Finding::fail(
                "replication.publication",
                format!(
                    "publication \"{publication}\" does not exist and replication.create_publication = false"
                ),
                table.create_publication_sql(publication),
            );
        }
        Err(e) => Err(e),
    };
    match problem {
        Ok(None) => Finding::ok(
            "replication.publication",
            format!("publication \"{publication}\" delivers every insert of {}", table.display_name()),
        ),
        Ok(Some(problem @ Problem::TableMissing(_))) => Finding::fail(
            "replication.publication",
            format!(
                "publication \"{publication}\" cannot include {}: it does not exist",
                table.display_name()
            ),
            format!("see outbox.table: {problem}"),
        ),
        Ok(Some(problem)) => Finding::fail(
            "replication.publication",
            problem.to_string(),
            "the publication must publish inserts of every row and every column the relay reads (README, replication mode)",
        ),
        Err(e) => Finding::fail(
            "replication.publication",
            format!("cannot read pg_publication: {e}"),
            "check the role's privileges",
        ),
    }
}

/// Who can emit outbox messages: a transactional message with the outbox prefix is published
/// to the topic it names, so PUBLIC must not be able to call `pg_logical_emit_message`.
async fn emit_check(client: &Client) -> Finding {
    let row = client
        .query_one(
            "SELECT coalesce(bool_or(has_function_privilege('public', oid, 'EXECUTE')), false) AS public \
             FROM pg_proc WHERE proname = 'pg_logical_emit_message'",
            &[],
        )
        .await;
    match row {
        Ok(row) if row.get::<_, bool>("public") => Finding::warn(
            "replication.emit",
            "any database login can call pg_logical_emit_message and so put an event on any topic",
            "as a superuser: REVOKE EXECUTE ON every signature of pg_logical_emit_message FROM PUBLIC \
             (sql/005_outbox_emit.sql does it), then GRANT outbox_writer TO the application role",
        ),
        Ok(_) => Finding::ok("replication.emit", "pg_logical_emit_message is not executable by PUBLIC"),
        Err(e) => Finding::warn(
            "replication.emit",
            format!("cannot check pg_logical_emit_message: {e}"),
            "check the role can read pg_proc",
        ),
    }
}

fn setting_check_name(name: &str) -> &'static str {
    match name {
        "max_replication_slots" => "postgres.max_replication_slots",
        _ => "postgres.max_wal_senders",
    }
}

/// The brokers' finding, and the topics they know when they answered.
async fn kafka_check(config: &RelayConfig) -> (Finding, Option<std::collections::BTreeSet<String>>) {
    let kafka = config.kafka.clone();
    let brokers = kafka.brokers.join(",");
    let fetched = tokio::task::spawn_blocking(move || {
        crate::sink::cluster::fetch_cluster_info(&kafka, Duration::from_secs(10))
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
