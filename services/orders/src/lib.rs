//! The order service: the write side of the transactional outbox, as a template.
//!
//! `POST /orders` writes the order and its `OrderPlaced` event in one PostgreSQL transaction, under
//! an `Idempotency-Key` stored in the same database: a client that retries after a timeout, a
//! double click, or a replica that crashed mid-request still yields one order and one event.
//! outbox-relay then publishes the event; `services/ledger` applies it once.
//!
//! - `api`: the HTTP surface and what each answer means;
//! - `idempotency`: the key store (claim, lease, takeover, fencing, replay);
//! - `order`: the one transaction;
//! - `retry`: the client's retry policy;
//! - `pool`, `config`: sessions and settings, on the relay's own connect function and loader.

pub mod api;
pub mod config;
pub mod idempotency;
pub mod order;
pub mod pool;
pub mod retry;
