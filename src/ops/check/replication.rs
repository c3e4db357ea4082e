//! The checks of replication mode: `wal_level`, the sender and slot limits, the slot, the
//! publication, `pg_logical_emit_message`, and how much WAL a slot may retain.

use tokio_postgres::Client;

use super::{Finding, query_setting};
use crate::config::RelayConfig;
use crate::outboxes::Outbox;
use crate::source::replication::publication::{self, Problem};
use crate::source::replication::slot::{self, SlotInfo, Verdict};

pub(super) async fn checks(config: &RelayConfig, outbox: &Outbox, client: &Client) -> Vec<Finding> {
    let mut findings = Vec::new();
    match query_setting(client, "wal_level").await {
        Ok(level) if level == "logical" => findings.push(Finding::ok("postgres.wal_level", "wal_level = logical")),
        Ok(level) => findings.push(Finding::fail(
            "postgres.wal_level",
            format!("wal_level = {level}; replication mode needs logical"),
            "set wal_level = logical in postgresql.conf (ALTER SYSTEM SET wal_level = logical) and restart PostgreSQL, or use source.mode = \"polling\"",
        )),
        Err(e) => findings.push(Finding::fail("postgres.wal_level", format!("cannot read wal_level: {}", crate::error::describe_pg(&e)), "check the role can run SHOW")),
    }
    findings.push(role_check(config, client).await);
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
                format!("cannot read {name}: {}", crate::error::describe_pg(&e)),
                "check the role can run SHOW",
            )),
        }
    }
    findings.push(slot_check(config, client).await);
    findings.push(publication_check((config, outbox), client).await);
    findings.push(emit_check(client).await);
    findings.push(message_signing_check(config, client).await);
    match query_setting(client, "max_slot_wal_keep_size").await {
        Ok(size) if size == "-1" => findings.push(Finding::warn(
            "postgres.max_slot_wal_keep_size",
            "max_slot_wal_keep_size = -1: a stalled relay makes PostgreSQL keep WAL without limit until the disk fills",
            "set max_slot_wal_keep_size to WAL rate x the longest relay outage you accept (docs/deployment.md, PostgreSQL: versions and settings)",
        )),
        Ok(size) => findings.push(Finding::ok("postgres.max_slot_wal_keep_size", format!("max_slot_wal_keep_size = {size}"))),
        Err(e) => findings.push(Finding::warn("postgres.max_slot_wal_keep_size", format!("cannot read it: {}", crate::error::describe_pg(&e)), "PostgreSQL 13 or newer is required")),
    }
    findings
}

/// The slot as `run` and `setup` will judge it: the same verdict ([`slot::verdict`]), so a FAIL
/// here is the error they would stop with, in the same words.
async fn slot_check(config: &RelayConfig, client: &Client) -> Finding {
    const CHECK: &str = "replication.slot";
    let slot = &config.replication.slot;
    let verdict = match slot::verdict(config, client).await {
        Ok(verdict) => verdict,
        Err(e) => {
            return Finding::fail(
                CHECK,
                format!("cannot read slot \"{slot}\" or the relay's memory of it: {e}"),
                "apply sql/006_relay_slots.sql to sql/008_relay_slots_owner.sql and grant the role SELECT on \
                 outbox_relay_slots (sql/100_relay_role.sql)",
            );
        }
    };
    match verdict {
        Verdict::Refused(refusal) => Finding::fail(CHECK, refusal.problem, refusal.fix),
        Verdict::Create { .. } => {
            Finding::ok(CHECK, format!("slot \"{slot}\" does not exist yet; `run` or `setup` creates it"))
        }
        Verdict::Recopy(info) => Finding::warn(
            CHECK,
            format!(
                "slot \"{slot}\" exists but its first copy of the table's rows never finished ({})",
                describe(&info)
            ),
            "nothing to do by hand: the next `setup` or `run` drops it and makes it again, copying the rows \
             (stop any instance still using it first)",
        ),
        Verdict::Stream(info) => {
            let lag = client
                .query_one("SELECT pg_size_pretty(pg_current_wal_lsn() - confirmed_flush_lsn) FROM pg_replication_slots WHERE slot_name = $1", &[slot])
                .await
                .ok()
                .and_then(|row| row.get::<_, Option<String>>(0))
                .unwrap_or_else(|| "?".into());
            let detail = format!("slot \"{slot}\": {}, lag {lag}", describe(&info));
            if info.wal_status.as_deref() == Some("unreserved") {
                Finding::warn(
                    CHECK,
                    detail,
                    "the slot is about to lose WAL it needs: get the relay running and caught up now",
                )
            } else {
                Finding::ok(CHECK, detail)
            }
        }
    }
}

fn describe(info: &SlotInfo) -> String {
    format!(
        "wal_status = {}, active = {}, confirmed_flush_lsn = {}",
        info.wal_status.as_deref().unwrap_or("?"),
        info.active_pid.is_some(),
        info.confirmed_flush.map(|lsn| lsn.to_string()).unwrap_or_default(),
    )
}

async fn publication_check((config, outbox): (&RelayConfig, &Outbox), client: &Client) -> Finding {
    let publication = &config.replication.publication;
    let table = &outbox.table;
    // (without the table there is nothing to publish, and no owner to name)
    if let Ok(row) = client.query_one("SELECT to_regclass($1) IS NULL", &[&table.qualified()]).await
        && row.get::<_, bool>(0)
    {
        return Finding::fail(
            "replication.publication",
            format!("cannot tell: table {} does not exist (outbox.table)", table.display_name()),
            "apply the migrations in sql/ first, then run check again",
        );
    }
    let exists = client.query_opt("SELECT 1 FROM pg_publication WHERE pubname = $1", &[publication]).await;
    let problem = match exists {
        Ok(Some(_)) => publication::problem(config, client).await,
        Ok(None) => return missing_publication((config, outbox), client).await,
        Err(e) => Err(e),
    };
    match problem {
        Ok(None) => Finding::ok(
            "replication.publication",
            format!("publication \"{publication}\" delivers every insert of {}", table.display_name()),
        ),
        Ok(Some(problem)) => problem_finding(publication, table, problem),
        Err(e) => Finding::fail(
            "replication.publication",
            format!("cannot read pg_publication: {}", crate::error::describe_pg(&e)),
            "check the role's privileges",
        ),
    }
}

/// check's finding for a `problem` of the publication: the fix is the table's for a table or a
/// column that is gone, the publication's otherwise.
fn problem_finding(publication: &str, table: &crate::table::OutboxTable, problem: Problem) -> Finding {
    const CHECK: &str = "replication.publication";
    match problem {
        Problem::TableMissing(_) => Finding::fail(
            CHECK,
            format!(
                "publication \"{publication}\" cannot include {}: it does not exist",
                table.display_name()
            ),
            format!("see outbox.table: {problem}"),
        ),
        Problem::ColumnMissing { missing, fix } => Finding::fail(CHECK, missing, fix),
        problem => Finding::fail(
            CHECK,
            problem.to_string(),
            "the publication must publish inserts of every row and every column the relay reads (docs/replication.md)",
        ),
    }
}

/// The publication does not exist: fine when `setup` or `run` will create it (as the table's
/// owner), else a FAIL with the SQL that creates it.
async fn missing_publication((config, outbox): (&RelayConfig, &Outbox), client: &Client) -> Finding {
    let publication = &config.replication.publication;
    if !config.replication.create_publication {
        return Finding::fail(
            "replication.publication",
            format!(
                "publication \"{publication}\" does not exist and replication.create_publication = false"
            ),
            publication::create_sql(config),
        );
    }
    // `setup` and `run` create it only as the table's owner: the same test, the same words
    match publication::creation_refusal(config, client).await {
        Ok(None) => Finding::ok(
            "replication.publication",
            format!(
                "publication \"{publication}\" does not exist yet; `setup` or `run` creates it (this role \
                 owns {})",
                outbox.table.display_name()
            ),
        ),
        Ok(Some(refusal)) => Finding::fail("replication.publication", refusal.problem, refusal.fix),
        Err(e) => Finding::fail(
            "replication.publication",
            format!(
                "cannot tell whether this role may create the publication: {}",
                crate::error::describe_pg(&e)
            ),
            "check the role can read pg_class",
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
             (sql/005_outbox_emit.sql does it), then GRANT outbox_writer TO the application role; where no \
             superuser can (RDS, Cloud SQL), sign outbox_emit()'s messages: replication.message_signing_key_file \
             (sql/012_outbox_emit_signed.sql)",
        ),
        Ok(_) => Finding::ok("replication.emit", "pg_logical_emit_message is not executable by PUBLIC"),
        Err(e) => Finding::warn(
            "replication.emit",
            format!("cannot check pg_logical_emit_message: {}", crate::error::describe_pg(&e)),
            "check the role can read pg_proc",
        ),
    }
}

/// Whether outbox messages are checked: with `replication.message_signing_key_file`, only those
/// `outbox_emit()` signed are published, whoever may call `pg_logical_emit_message`; without
/// it, any role that may call it can publish an event under an id of its choice. (The key row
/// itself is the function owner's alone: `check` cannot see whether it is installed.)
async fn message_signing_check(config: &RelayConfig, client: &Client) -> Finding {
    const CHECK: &str = "replication.message_signing";
    if config.replication.message_signing_key_file.is_empty() {
        return Finding::warn(
            CHECK,
            "outbox messages are published unverified (replication.message_signing_key_file is not set): any \
             role that may call pg_logical_emit_message can publish an event under an id of its choice, which \
             a consumer deduplicating by id then takes for the real event",
            "openssl rand -hex 32 > emit.key; apply sql/012_outbox_emit_signed.sql and install the key in \
             outbox_emit_key as the function's owner; set replication.message_signing_key_file = the file \
             (docs/security.md, \"Signed outbox messages\")",
        );
    }
    match client.query_one("SELECT to_regclass('outbox_emit_key') IS NOT NULL", &[]).await {
        Ok(row) if row.get::<_, bool>(0) => Finding::ok(
            CHECK,
            "outbox messages are published only when replication.message_signing_key_file verifies \
             outbox_emit()'s digest; any other is dead-lettered (not checked: that outbox_emit_key holds the \
             same key, which only the function's owner can read)",
        ),
        Ok(_) => Finding::fail(
            CHECK,
            "replication.message_signing_key_file is set, but outbox_emit_key does not exist: outbox_emit() \
             signs nothing, so every event it emits is dead-lettered",
            "apply sql/012_outbox_emit_signed.sql and install the key file's key in outbox_emit_key as the \
             function's owner, or unset replication.message_signing_key_file",
        ),
        Err(e) => Finding::warn(
            CHECK,
            format!("cannot look for outbox_emit_key: {e}"),
            "check the role's privileges",
        ),
    }
}

fn setting_check_name(name: &str) -> &'static str {
    match name {
        "max_replication_slots" => "postgres.max_replication_slots",
        _ => "postgres.max_wal_senders",
    }
}

/// How this role may replicate: the REPLICATION attribute (or superuser), or on RDS and Aurora,
/// where no customer role can hold the attribute, membership in `rds_replication`.
const ROLE_SQL: &str = "SELECT r.rolreplication OR r.rolsuper AS attribute, \
     EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'rds_replication') AS rds_role, \
     coalesce((SELECT pg_has_role(current_user, g.oid, 'MEMBER') FROM pg_roles g \
               WHERE g.rolname = 'rds_replication'), false) AS rds_member, \
     current_setting('rds.extensions', true) IS NOT NULL AS looks_rds \
     FROM pg_roles r WHERE r.rolname = current_user";

async fn role_check(config: &RelayConfig, client: &Client) -> Finding {
    match client.query_one(ROLE_SQL, &[]).await {
        Ok(row) => role_finding(
            &config.postgres.user,
            row.get("attribute"),
            row.get("rds_role"),
            row.get("rds_member"),
            row.get("looks_rds"),
        ),
        Err(e) => Finding::fail(
            "postgres.role",
            format!("cannot read role attributes: {}", crate::error::describe_pg(&e)),
            "check the role can read pg_roles",
        ),
    }
}

/// The replication privilege, judged. Membership in `rds_replication` is what RDS and Aurora
/// grant replication by; elsewhere it grants nothing, so it passes only on a server that looks
/// like RDS (it has the `rds.extensions` setting), and is a WARN otherwise: the heuristic may
/// miss a managed service that works the same way, and a FAIL would block it.
fn role_finding(role: &str, attribute: bool, rds_role: bool, rds_member: bool, looks_rds: bool) -> Finding {
    const CHECK: &str = "postgres.role";
    let quoted = crate::table::quote_ident(role);
    match (attribute, rds_member, looks_rds) {
        (true, _, _) => Finding::ok(CHECK, format!("role {role} has REPLICATION")),
        (false, true, true) => Finding::ok(
            CHECK,
            format!("role {role} is a member of rds_replication, which grants replication on RDS and Aurora"),
        ),
        (false, true, false) => Finding::warn(
            CHECK,
            format!(
                "role {role} lacks the REPLICATION attribute and is a member of rds_replication, which grants \
                 replication only on RDS and Aurora; this server does not look like RDS (no rds.extensions \
                 setting), and elsewhere the slot and the stream will be refused"
            ),
            format!(
                "unless this is RDS or Aurora: ALTER ROLE {quoted} WITH REPLICATION (see sql/100_relay_role.sql)"
            ),
        ),
        (false, false, _) if rds_role && looks_rds => Finding::fail(
            CHECK,
            format!(
                "role {role} lacks replication: on RDS and Aurora it comes from the role rds_replication"
            ),
            format!(
                "GRANT rds_replication TO {quoted} (no role but rdsadmin may set the REPLICATION attribute there; \
                 sql/100_relay_role.sql does it)"
            ),
        ),
        (false, false, _) => Finding::fail(
            CHECK,
            format!("role {role} lacks the REPLICATION attribute"),
            format!("ALTER ROLE {quoted} WITH REPLICATION (see sql/100_relay_role.sql)"),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::super::Status;
    use super::role_finding;

    /// A dropped `headers` column was blamed on the publication ("must publish ... every column
    /// the relay reads"): the fix is the table or `outbox.columns`, in the daemon's words.
    #[test]
    fn a_dropped_column_is_fixed_in_the_table_or_outbox_columns() {
        let config: crate::config::RelayConfig =
            serde_json::from_value(serde_json::json!({ "kafka": { "brokers": ["127.0.0.1:9092"] } }))
                .unwrap();
        let table = crate::table::OutboxTable::of(&config.outbox, &config.polling);
        let problem = super::Problem::ColumnMissing {
            missing: "public.outbox_events has no column headers (dropped or renamed), which the relay reads"
                .into(),
            fix: "add \"headers\" back, or set outbox.columns.headers = \"\" if it is gone for good".into(),
        };
        let finding = super::problem_finding("outbox_relay", &table, problem);
        assert_eq!(finding.status, Status::Fail);
        assert_eq!(
            finding.detail,
            "public.outbox_events has no column headers (dropped or renamed), which the relay reads"
        );
        assert_eq!(
            finding.fix,
            "add \"headers\" back, or set outbox.columns.headers = \"\" if it is gone for good"
        );
    }

    #[test]
    fn rds_replication_counts_only_where_the_server_looks_like_rds() {
        assert_eq!(role_finding("r", true, false, false, false).status, Status::Ok);
        assert_eq!(role_finding("r", false, true, true, true).status, Status::Ok);
        let elsewhere = role_finding("r", false, true, true, false);
        assert_eq!(elsewhere.status, Status::Warn);
        assert!(elsewhere.fix.contains("ALTER ROLE \"r\" WITH REPLICATION"), "{elsewhere}");
        let rds = role_finding("r", false, true, false, true);
        assert_eq!(rds.status, Status::Fail);
        assert!(rds.fix.starts_with("GRANT rds_replication TO \"r\""), "{rds}");
        let vanilla = role_finding("r", false, false, false, false);
        assert!(vanilla.fix.starts_with("ALTER ROLE \"r\" WITH REPLICATION"), "{vanilla}");
    }
}
