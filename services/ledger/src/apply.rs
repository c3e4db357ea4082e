//! The one database transaction per event: the inbox row, the debit or the decline, and the
//! follow-up event in the relay's outbox (`sql/examples/ledger.sql`).
//!
//! Invariants:
//! - **once**: the transaction first inserts the event's `processed_events` row, keyed by the
//!   event's source and id ([`Inbound::source`], the id header). A row that is
//!   already there (the event was debited or declined) inserts nothing and the transaction
//!   changes nothing else: a redelivered event is a [`Outcome::Duplicate`]. Only a
//!   `dead_lettered` row is taken over, so an event replayed from the dead-letter topic is
//!   applied (once) after all. A concurrent delivery of the same event blocks on the primary
//!   key until the first transaction ends, then sees its row.
//! - **never overdrawn**: the debit is one statement,
//!   `UPDATE wallets ... SET balance_cents = balance_cents - $1 WHERE customer_id = $2 AND
//!   balance_cents >= $1`. Under READ COMMITTED, UPDATE locks the row it is about to change and,
//!   if a concurrent transaction changed it meanwhile, re-evaluates the WHERE clause against
//!   the newest committed version (EvalPlanQual; PostgreSQL manual 13.2.1). So of two debits
//!   racing for the last funds one matches and the other updates no row. A SELECT followed by
//!   an UPDATE would check a balance that may be stale by the time it writes: both debits
//!   would pass the check (and the table's CHECK would then fail one with an error instead of
//!   a clean decline).
//! - **a decline is an outcome, not a failure**: no wallet, or too little in it, records
//!   `declined` with the reason and emits `PaymentDeclined`; the record is done.
//! - the follow-up event (`PaymentCompleted` / `PaymentDeclined`, aggregate `payment`, the
//!   order id as aggregate id) commits with the debit, so the relay publishes it if and only if
//!   the debit (or the decline) happened: the chain continues on `outbox.event.payment`.

use outbox_relay::config::PostgresConfig;

use crate::config::ConsumerConfig;
use outbox_relay::error::Action;
use serde_json::{Value, json};
use tokio_postgres::{Client, Statement, Transaction};

use crate::error::LedgerError;
use crate::record::{Inbound, OrderPlaced};
use crate::retry::{Failure, describe};

/// What applying one event did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Debited,
    /// Declined, and why.
    Declined(Decline),
    /// The event was applied before: nothing changed.
    Duplicate,
}

/// Why a payment was declined.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decline {
    /// For the `PaymentDeclined` event, which every reader of its topic sees: no amount, no
    /// balance.
    pub reason: &'static str,
    /// For `processed_events.detail` and the log: with the balance found.
    pub detail: String,
}

/// What the inbox holds for an event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seen {
    /// `debited`, `declined` or `dead_lettered`.
    pub outcome: String,
    /// The row was written for this very record (same topic, partition and offset): the
    /// record is a redelivery, not another copy of the event.
    pub same_record: bool,
}

/// The outcome of an event sent to the dead-letter topic.
pub const DEAD_LETTERED: &str = "dead_lettered";

/// The tables the ledger writes, besides its outbox (`consumer.outbox_table`); checked at start.
const TABLES: [&str; 3] = ["wallets", "processed_events", "ledger_entries"];

/// Takes the inbox row; a `dead_lettered` one is taken over (a replay), any other stays.
const CLAIM_SQL: &str = "INSERT INTO processed_events (source, event_id, topic, \"partition\", \"offset\", outcome) \
     VALUES ($1, $2, $3, $4, $5, 'debited') \
     ON CONFLICT (source, event_id) DO UPDATE SET topic = EXCLUDED.topic, \"partition\" = EXCLUDED.\"partition\", \
     \"offset\" = EXCLUDED.\"offset\", outcome = EXCLUDED.outcome, processed_at = now(), \
     detail = 'replayed after: ' || processed_events.detail \
     WHERE processed_events.outcome = 'dead_lettered'";
const DEBIT_SQL: &str = "UPDATE wallets SET balance_cents = balance_cents - $1, updated_at = now() \
     WHERE customer_id = $2 AND balance_cents >= $1";
const LEDGER_ENTRY_SQL: &str = "INSERT INTO ledger_entries \
     (payment_id, order_id, customer_id, amount_cents, event_source, event_id) \
     VALUES ($1::text::uuid, $2, $3, $4, $5, $6)";
const BALANCE_SQL: &str = "SELECT balance_cents FROM wallets WHERE customer_id = $1";
const DECLINED_SQL: &str =
    "UPDATE processed_events SET outcome = 'declined', detail = $3 WHERE source = $1 AND event_id = $2";
/// The follow-up event, into `outbox` (`consumer.outbox_table`, quoted).
fn follow_up_sql(outbox: &str) -> String {
    format!(
        "INSERT INTO {outbox} (aggregate_type, aggregate_id, event_type, payload, headers) \
         VALUES ('payment', $1, $2, $3, $4)"
    )
}

/// `"schema"."table"` of `consumer.outbox_table`.
fn quoted_outbox((schema, table): (&str, &str)) -> String {
    let quote = |name: &str| format!("\"{}\"", name.replace('"', "\"\""));
    format!("{}.{}", quote(schema), quote(table))
}
const SEEN_SQL: &str = "SELECT outcome, topic = $3 AND \"partition\" = $4 AND \"offset\" = $5 \
     FROM processed_events WHERE source = $1 AND event_id = $2";
/// A `dead_lettered` row is moved to the newest copy dead-lettered (a replay that failed again),
/// so a redelivery of that copy is known as one; any other row stays.
const DEAD_LETTERED_SQL: &str = "INSERT INTO processed_events \
     (source, event_id, topic, \"partition\", \"offset\", outcome, detail) \
     VALUES ($1, $2, $3, $4, $5, 'dead_lettered', $6) \
     ON CONFLICT (source, event_id) DO UPDATE SET topic = EXCLUDED.topic, \"partition\" = EXCLUDED.\"partition\", \
     \"offset\" = EXCLUDED.\"offset\", detail = EXCLUDED.detail, processed_at = now() \
     WHERE processed_events.outcome = 'dead_lettered'";

/// The statements of one session, prepared once.
struct Statements {
    claim: Statement,
    debit: Statement,
    ledger_entry: Statement,
    balance: Statement,
    declined: Statement,
    follow_up: Statement,
    seen: Statement,
    dead_lettered: Statement,
}

/// A database session with `lock_timeout` set and the statements prepared.
pub struct Session {
    client: Client,
    statements: Statements,
}

/// Why no session could be opened.
pub enum OpenError {
    /// Worth another try after a backoff (the server is unreachable, or refused for now).
    Retry(String),
    /// An operator must act: the process stops.
    Fatal(LedgerError),
}

impl OpenError {
    fn from_db(error: tokio_postgres::Error) -> OpenError {
        match crate::retry::classify(&error) {
            Failure::Fatal | Failure::Permanent => OpenError::Fatal(LedgerError::Database {
                during: "opening a session".into(),
                error: describe(&error),
            }),
            Failure::Outage | Failure::Contended => OpenError::Retry(describe(&error)),
        }
    }
}

impl Session {
    /// Connects through the relay's `connect` (TLS, multi-host, password files), refuses a
    /// database without the ledger's tables (naming the file that creates them), and prepares.
    pub async fn open(pg: &PostgresConfig, consumer: &ConsumerConfig) -> Result<Session, OpenError> {
        let outbox = quoted_outbox(consumer.outbox_table());
        let client = outbox_relay::postgres::connect(pg).await.map_err(|e| match e.action() {
            Action::Fatal(_) => OpenError::Fatal(LedgerError::Connect(e)),
            _ => OpenError::Retry(e.to_string()),
        })?;
        let missing: Vec<String> = client
            .query(
                "SELECT t FROM unnest($1::text[] || $2::text) AS t WHERE to_regclass(t) IS NULL",
                &[&TABLES.as_slice(), &outbox],
            )
            .await
            .map_err(OpenError::from_db)?
            .iter()
            .map(|row| row.get(0))
            .collect();
        if !missing.is_empty() {
            let tables = missing.join(", ");
            return Err(OpenError::Fatal(LedgerError::MissingTables {
                database: pg.database.clone(),
                tables,
            }));
        }
        Session::prepare(client, consumer.lock_timeout_ms, &outbox).await.map_err(OpenError::from_db)
    }

    /// Sets `lock_timeout` and prepares the statements on `client`; follow-ups go to `outbox`.
    async fn prepare(
        client: Client,
        lock_timeout_ms: u64,
        outbox: &str,
    ) -> Result<Session, tokio_postgres::Error> {
        // a plain integer is milliseconds; the setting lasts for the session
        client.batch_execute(&format!("SET lock_timeout = {lock_timeout_ms}")).await?;
        let statements = Statements {
            claim: client.prepare(CLAIM_SQL).await?,
            debit: client.prepare(DEBIT_SQL).await?,
            ledger_entry: client.prepare(LEDGER_ENTRY_SQL).await?,
            balance: client.prepare(BALANCE_SQL).await?,
            declined: client.prepare(DECLINED_SQL).await?,
            follow_up: client.prepare(&follow_up_sql(outbox)).await?,
            seen: client.prepare(SEEN_SQL).await?,
            dead_lettered: client.prepare(DEAD_LETTERED_SQL).await?,
        };
        Ok(Session { client, statements })
    }

    /// Applies `order`, read from `record`, in one transaction.
    pub async fn apply(
        &mut self,
        order: &OrderPlaced,
        record: &Inbound,
    ) -> Result<Outcome, tokio_postgres::Error> {
        let st = &self.statements;
        let source = record.source();
        let tx = self.client.transaction().await?;
        let claimed = tx
            .execute(&st.claim, &[&source, &order.event_id, &record.topic, &record.partition, &record.offset])
            .await?;
        if claimed == 0 {
            tx.rollback().await?;
            return Ok(Outcome::Duplicate);
        }
        let debited = tx.execute(&st.debit, &[&order.total_cents, &order.customer_id]).await? == 1;
        let outcome = if debited {
            let params: [&(dyn tokio_postgres::types::ToSql + Sync); 6] = [
                &order.payment_id,
                &order.order_id,
                &order.customer_id,
                &order.total_cents,
                &source,
                &order.event_id,
            ];
            tx.execute(&st.ledger_entry, &params).await?;
            Outcome::Debited
        } else {
            let reason = decline_reason(&tx, &st.balance, order).await?;
            tx.execute(&st.declined, &[&source, &order.event_id, &reason.detail]).await?;
            Outcome::Declined(reason)
        };
        let (event_type, payload) = follow_up(order, &outcome);
        let headers = follow_up_headers(order);
        tx.execute(&st.follow_up, &[&order.order_id.to_string(), &event_type, &payload, &headers]).await?;
        tx.commit().await?;
        Ok(outcome)
    }

    /// What the inbox holds for `event_id`, read from `record`, if anything.
    pub async fn seen(
        &self,
        event_id: &str,
        record: &Inbound,
    ) -> Result<Option<Seen>, tokio_postgres::Error> {
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 5] =
            [&record.source(), &event_id, &record.topic, &record.partition, &record.offset];
        let row = self.client.query_opt(&self.statements.seen, &params).await?;
        Ok(row.map(|row| Seen { outcome: row.get(0), same_record: row.get(1) }))
    }

    /// Records that `record` (event `event_id`) went to the dead-letter topic for `reason`.
    /// An event debited or declined keeps its outcome; one dead-lettered before now names
    /// `record` and `reason`.
    pub async fn record_dead_letter(
        &self,
        event_id: &str,
        record: &Inbound,
        reason: &str,
    ) -> Result<(), tokio_postgres::Error> {
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 6] =
            [&record.source(), &event_id, &record.topic, &record.partition, &record.offset, &reason];
        self.client.execute(&self.statements.dead_lettered, &params).await?;
        Ok(())
    }
}

/// Why the conditional debit matched no row. Read after the fact, for the message only: the
/// decision was the debit's.
async fn decline_reason(
    tx: &Transaction<'_>,
    balance: &Statement,
    order: &OrderPlaced,
) -> Result<Decline, tokio_postgres::Error> {
    let row = tx.query_opt(balance, &[&order.customer_id]).await?;
    Ok(match row.map(|row| row.get::<_, i64>(0)) {
        None => {
            Decline { reason: "no wallet", detail: format!("no wallet for customer {}", order.customer_id) }
        }
        Some(balance) => Decline {
            reason: "insufficient balance",
            detail: format!(
                "insufficient balance: {balance} cents available, {} cents needed",
                order.total_cents
            ),
        },
    })
}

/// The event type and payload of the follow-up event.
fn follow_up(order: &OrderPlaced, outcome: &Outcome) -> (&'static str, Value) {
    let mut payload = json!({
        "payment_id": order.payment_id,
        "order_id": order.order_id,
        "customer_id": order.customer_id,
        "total_cents": order.total_cents,
    });
    match outcome {
        Outcome::Declined(decline) => {
            payload["reason"] = Value::String(decline.reason.into());
            ("PaymentDeclined", payload)
        }
        _ => ("PaymentCompleted", payload),
    }
}

/// The follow-up event's headers (the relay makes each a Kafka header): the event it answers,
/// and the trace it belongs to.
fn follow_up_headers(order: &OrderPlaced) -> Value {
    let mut headers = json!({ "causation_id": order.event_id });
    if let Some(traceparent) = &order.traceparent {
        headers["traceparent"] = Value::String(traceparent.clone());
    }
    headers
}

#[cfg(test)]
mod tests {
    use super::*;

    fn order(traceparent: Option<&str>) -> OrderPlaced {
        OrderPlaced {
            event_id: "17".into(),
            order_id: 9,
            customer_id: "c-1".into(),
            total_cents: 300,
            payment_id: "3f2b8c1e-9a4d-4e5f-8a7b-1c2d3e4f5a6b".into(),
            traceparent: traceparent.map(str::to_string),
        }
    }

    #[test]
    fn a_debit_is_followed_by_payment_completed() {
        let (event_type, payload) = follow_up(&order(None), &Outcome::Debited);
        assert_eq!(event_type, "PaymentCompleted");
        assert_eq!(
            payload,
            json!({"payment_id": "3f2b8c1e-9a4d-4e5f-8a7b-1c2d3e4f5a6b", "order_id": 9,
                   "customer_id": "c-1", "total_cents": 300})
        );
    }

    #[test]
    fn a_decline_is_followed_by_payment_declined_with_its_reason() {
        let decline = Decline {
            reason: "insufficient balance",
            detail: "insufficient balance: 120 cents available, 300 cents needed".into(),
        };
        let (event_type, payload) = follow_up(&order(None), &Outcome::Declined(decline));
        assert_eq!(event_type, "PaymentDeclined");
        assert_eq!(payload["reason"], "insufficient balance");
        assert_eq!(payload["total_cents"], 300);
        assert!(!payload.to_string().contains("120"), "the balance is not published: {payload}");
    }

    #[test]
    fn the_follow_up_names_its_cause_and_keeps_the_trace() {
        assert_eq!(follow_up_headers(&order(None)), json!({"causation_id": "17"}));
        assert_eq!(
            follow_up_headers(&order(Some("00-t-s-01"))),
            json!({"causation_id": "17", "traceparent": "00-t-s-01"})
        );
    }
}
