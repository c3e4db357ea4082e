//! `admin.control` and `admin.signal_table`: may the relay's instances share a pause
//! (`sql/015_relay_control.sql`), and may the relay execute the signal table's requests
//! (`sql/014_relay_signal.sql`)? The relay runs without either, so these are WARNs: without
//! the first a pause holds only in the instance that was paused; without the second the
//! requests operators insert are never executed.

use tokio_postgres::Client;

use super::Finding;
use crate::config::AdminConfig;
use crate::table::quote_ident;

const CONTROL: &str = "admin.control";
const SIGNAL: &str = "admin.signal_table";

const CONTROL_SQL: &str = "SELECT CASE WHEN to_regclass('outbox_relay_control') IS NULL THEN false \
     ELSE has_table_privilege('outbox_relay_control', 'SELECT') \
     AND has_table_privilege('outbox_relay_control', 'INSERT') \
     AND has_table_privilege('outbox_relay_control', 'UPDATE') END";

/// The signal table ($1, as written in the configuration), and whether the relay may read it
/// and write what became of a row, and whether the operator role ($2) exists.
const SIGNAL_SQL: &str = "SELECT to_regclass($1) IS NOT NULL, \
     CASE WHEN to_regclass($1) IS NULL THEN false \
     ELSE has_table_privilege(to_regclass($1), 'SELECT') \
     AND has_column_privilege(to_regclass($1), 'result', 'UPDATE') \
     AND has_column_privilege(to_regclass($1), 'receipt', 'UPDATE') END, \
     EXISTS (SELECT 1 FROM pg_roles WHERE rolname = $2)";

pub(super) async fn findings(client: &Client, admin: &AdminConfig, role: &str) -> Vec<Finding> {
    let mut findings = vec![control(client, role).await];
    if !admin.signal_table.is_empty() {
        findings.push(signal(client, admin, role).await);
    }
    findings
}

async fn control(client: &Client, role: &str) -> Finding {
    match client.query_one(CONTROL_SQL, &[]).await {
        Ok(row) if row.get::<_, bool>(0) => Finding::ok(
            CONTROL,
            format!("role {role} shares the pause and the leader's address in outbox_relay_control"),
        ),
        Ok(_) => Finding::warn(
            CONTROL,
            format!(
                "outbox_relay_control is missing, or role {role} may not SELECT, INSERT and UPDATE it: a pause holds only \
                 in the instance that was paused (a failover or a restart resumes publishing), and a standby's refusal \
                 cannot name the active instance's admin URL"
            ),
            "apply sql/015_relay_control.sql and sql/100_relay_role.sql",
        ),
        Err(e) => Finding::warn(
            CONTROL,
            format!("cannot check outbox_relay_control: {}", crate::error::describe_pg(&e)),
            "apply sql/015_relay_control.sql",
        ),
    }
}

async fn signal(client: &Client, admin: &AdminConfig, role: &str) -> Finding {
    let table = admin.signal_table.split('.').map(quote_ident).collect::<Vec<_>>().join(".");
    let operator = &admin.signal_operator_role;
    let row = match client.query_one(SIGNAL_SQL, &[&table, operator]).await {
        Ok(row) => row,
        Err(e) => {
            let said = format!("cannot check {}: {}", admin.signal_table, crate::error::describe_pg(&e));
            return Finding::warn(
                SIGNAL,
                said,
                "apply sql/014_relay_signal.sql, or run `outbox-relay setup`",
            );
        }
    };
    let (exists, usable, role_exists): (bool, bool, bool) = (row.get(0), row.get(1), row.get(2));
    let table = &admin.signal_table;
    if !exists {
        let said = format!("{table} does not exist: requests inserted there would never be executed");
        return Finding::warn(
            SIGNAL,
            said,
            "run `outbox-relay setup` (it creates the table with the configured names)",
        );
    }
    if !usable {
        let said = format!(
            "role {role} may not read {table} and write what became of a request (UPDATE of result and receipt): \
             requests would wait forever"
        );
        return Finding::warn(
            SIGNAL,
            said,
            "apply sql/100_relay_role.sql (it grants both relay roles what they need)",
        );
    }
    if !role_exists {
        let said = format!(
            "role {operator} (admin.signal_operator_role) does not exist: no one may insert a request"
        );
        return Finding::warn(SIGNAL, said, "run `outbox-relay setup`, or set admin.signal_operator_role");
    }
    Finding::ok(
        SIGNAL,
        format!("role {role} executes the requests members of {operator} insert into {table}"),
    )
}
