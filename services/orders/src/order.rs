//! An order and its `OrderPlaced` event, written in one PostgreSQL transaction together with the
//! key's stored response: either all three commit or none does.
//!
//! The event goes to the relay's `outbox_events` table: aggregate `order`, key = the order id,
//! so the relay publishes it to `outbox.event.order` with the order's id as the Kafka key. The
//! order is created in this same transaction, so no other transaction can write an event of this
//! aggregate before this one commits; a later change to an order (not part of this example)
//! would `SELECT ... FROM orders WHERE id = $1 FOR UPDATE` first, which keeps the events of one
//! order in commit order (docs/outbox-table.md, "The outbox table").

use serde::{Deserialize, Serialize};
use serde_json::json;
use tokio_postgres::Client;

use crate::idempotency::{self, Lease};

/// The body of `POST /orders`: `{"total_cents": 1999}`. The customer is the caller (the bearer
/// token's subject); a body may still name it, and must then name the caller.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Body {
    #[serde(default)]
    customer_id: Option<String>,
    total_cents: i64,
}

/// An order as requested by its caller.
#[derive(Debug)]
pub struct OrderRequest {
    pub customer_id: String,
    pub total_cents: i64,
}

/// Why a body was refused.
#[derive(Debug, PartialEq, Eq)]
pub enum Refusal {
    /// 400: the body is not what the API takes; says what is expected.
    Invalid(String),
    /// 403: the body names a customer other than the caller.
    OtherCustomer,
}

/// The largest order accepted, in cents.
pub const MAX_TOTAL_CENTS: i64 = 100_000_000;

impl OrderRequest {
    /// Parses and checks `caller`'s body; an error names the field and says what is expected.
    pub fn parse(body: &[u8], caller: &str) -> Result<OrderRequest, Refusal> {
        let body: Body = serde_json::from_slice(body)
            .map_err(|e| Refusal::Invalid(format!("the body must be JSON {{\"total_cents\": 1999}}: {e}")))?;
        if body.customer_id.is_some_and(|named| named != caller) {
            return Err(Refusal::OtherCustomer);
        }
        if !(1..=MAX_TOTAL_CENTS).contains(&body.total_cents) {
            return Err(Refusal::Invalid(format!("total_cents: must be between 1 and {MAX_TOTAL_CENTS}")));
        }
        Ok(OrderRequest { customer_id: caller.into(), total_cents: body.total_cents })
    }

    /// The request in one canonical form: two bodies that differ only in spacing or key order
    /// are the same request.
    pub fn canonical(&self) -> String {
        json!({"customer_id": self.customer_id, "total_cents": self.total_cents}).to_string()
    }
}

/// What `POST /orders` answers once the order exists.
#[derive(Debug, Serialize, Deserialize, PartialEq)]
pub struct OrderCreated {
    pub order_id: i64,
    pub payment_id: String,
    pub customer_id: String,
    pub total_cents: i64,
    pub status: String,
}

/// How the final write went.
pub enum Written {
    Created(OrderCreated),
    /// The lease was taken over by another attempt: nothing was written.
    Fenced,
}

/// Writes the order, its event and the key's response in one transaction, after the fencing
/// check. `traceparent`, when the request had one, travels on as a header of the event.
pub async fn write(
    client: &mut Client,
    lease: &Lease,
    request: &OrderRequest,
    traceparent: Option<&str>,
) -> Result<Written, tokio_postgres::Error> {
    let txn = client.transaction().await?;
    if !idempotency::fence(&txn, lease).await? {
        return Ok(Written::Fenced);
    }
    let row = txn
        .query_one(
            "INSERT INTO orders (customer_id, total_cents) VALUES ($1, $2) RETURNING id, payment_id::text, status",
            &[&request.customer_id, &request.total_cents],
        )
        .await?;
    let created = OrderCreated {
        order_id: row.get(0),
        payment_id: row.get(1),
        customer_id: request.customer_id.clone(),
        total_cents: request.total_cents,
        status: row.get(2),
    };
    let payload = serde_json::to_value(&created).expect("plain fields");
    let headers = traceparent.map(|t| json!({ "traceparent": t }));
    txn.execute(
        "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload, headers) \
         VALUES ('order', $1, 'OrderPlaced', $2, $3)",
        &[&created.order_id.to_string(), &payload, &headers],
    )
    .await?;
    idempotency::store_response(&txn, lease, 201, &payload).await?;
    txn.commit().await?;
    Ok(Written::Created(created))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn invalid(body: &[u8]) -> String {
        match OrderRequest::parse(body, "c") {
            Err(Refusal::Invalid(message)) => message,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_body_differing_only_in_spacing_key_order_or_the_named_caller_is_the_same_request() {
        let a = OrderRequest::parse(br#"{"customer_id":"c-1","total_cents":5}"#, "c-1").unwrap();
        let b = OrderRequest::parse(b"{ \"total_cents\" : 5,\n \"customer_id\": \"c-1\" }", "c-1").unwrap();
        let unnamed = OrderRequest::parse(br#"{"total_cents":5}"#, "c-1").unwrap();
        assert_eq!(a.canonical(), b.canonical());
        assert_eq!(a.canonical(), unnamed.canonical());
        let c = OrderRequest::parse(br#"{"customer_id":"c-1","total_cents":6}"#, "c-1").unwrap();
        assert_ne!(a.canonical(), c.canonical());
    }

    #[test]
    fn the_customer_is_the_caller_and_a_body_naming_another_is_refused() {
        let request = OrderRequest::parse(br#"{"total_cents":5}"#, "c-1").unwrap();
        assert_eq!(request.customer_id, "c-1");
        let other = OrderRequest::parse(br#"{"customer_id":"c-2","total_cents":5}"#, "c-1");
        assert_eq!(other.unwrap_err(), Refusal::OtherCustomer);
    }

    #[test]
    fn a_bad_body_is_refused_naming_the_field() {
        assert!(invalid(br#"{"customer_id":"c"}"#).contains("total_cents"));
        assert!(invalid(br#"{"customer_id":"c","total_cents":0}"#).starts_with("total_cents"));
        assert!(invalid(br#"{"customer_id":"c","total_cents":1,"x":1}"#).contains("unknown field"));
        assert!(invalid(b"not json").contains("JSON"));
    }
}
