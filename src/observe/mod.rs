//! What SREs see: the metrics (names and typed labels), health and the pulse that writes it, the
//! HTTP listener (`/metrics`, `/healthz`, `/readyz`), and the last hour of a few of the metrics
//! for the console's chart ([`history`]). (What PostgreSQL says of a source, sampled
//! into gauges, is the source's: [`crate::source::sampler`].)
//!
//! Invariants:
//! - nothing here decides what the relay does next: a session writes facts (through its
//!   [`pulse::Pulse`]) and the listener reads them;
//! - every metric name is a const in [`metrics`], and every label value one of its enums.

pub(crate) mod health;
pub mod history;
pub(crate) mod http;
pub mod metrics;
pub mod pause;
pub mod pulse;
pub mod trace;
