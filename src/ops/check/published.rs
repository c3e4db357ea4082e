//! `postgres.published`: may the relay record what it published (`sql/010_published.sql`)? The
//! relay runs without it, so this is a WARN: `verify` then cannot tell a row deleted after it
//! was published from a phantom.

use tokio_postgres::Client;

use super::Finding;
use crate::published::USABLE_SQL;

const CHECK: &str = "postgres.published";

pub(super) async fn finding(client: &Client, role: &str) -> Finding {
    match client.query_one(USABLE_SQL, &[]).await {
        Ok(row) if row.get::<_, bool>(0) => {
            Finding::ok(CHECK, format!("role {role} records the ids it publishes in outbox_relay_published"))
        }
        Ok(_) => Finding::warn(
            CHECK,
            format!(
                "outbox_relay_published is missing, or role {role} may not SELECT, INSERT and UPDATE it: the relay will not \
                 record what it publishes, and `verify` cannot vouch for rows deleted after publishing"
            ),
            "apply sql/010_published.sql and sql/100_relay_role.sql (GRANT SELECT, INSERT, UPDATE ON \
             outbox_relay_published TO the relay's role)",
        ),
        Err(e) => Finding::warn(
            CHECK,
            format!("cannot check outbox_relay_published: {}", crate::error::describe_pg(&e)),
            "apply sql/010_published.sql",
        ),
    }
}
