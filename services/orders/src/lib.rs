//! The order service: the write side of the transactional outbox, as a template.
//!
//! `POST /orders` writes the order and its `OrderPlaced` event in one PostgreSQL transaction, under
//! an `Idempotency-Key` stored in the same database: a client that retries after a timeout, a
//! double click, or a replica that crashed mid-request still yields one order and one event.
//! outbox-relay then publishes the event; `services/ledger` applies it once.
//!
//! - `api`: the HTTP surface and what each answer means;
//! - `auth`: who is calling (a bearer JWT's subject), which is also the customer;
//! - `rate_limit`: a token bucket per caller;
//! - `server`: HTTP/1.1 serving with a header-read timeout and a connection limit;
//! - `idempotency`: the key store (claim, lease, takeover, fencing, replay);
//! - `order`: the one transaction;
//! - `retry`: the client's retry policy;
//! - `pool`, `config`: sessions and settings, on the relay's own connect function and loader.

pub mod api;
pub mod auth;
pub mod config;
pub mod idempotency;
pub mod order;
pub mod pool;
pub mod rate_limit;
pub mod retry;
pub mod server;
