//! The integration tests, one module per file beside this one, built as ONE test binary.
//!
//! One binary compiles the harness (`tests/common`) once and links once, where a binary per file
//! compiled and linked it 26 times: the largest part of the test command's build on a fresh
//! clone. cargo-nextest still runs each test in a process of its own; a test's name is
//! `<file>::<test>` (e.g. `replication::a_second_instance_waits_then_takes_over`), and
//! `deploy/local/test` selects the core files by that prefix.

mod common;
mod ledger_support;

mod admin;
mod admin_tls;
mod chain;
mod check_then_run;
mod console;
mod dead_letter;
mod docs;
mod emit;
mod exactly_once;
mod failover;
mod first_deployment;
mod fleet_dashboard;
mod formats;
mod foundation;
mod helm;
mod http;
mod image;
mod kafka_faults;
mod kafka_tls;
mod kubernetes;
mod layers;
mod leader_acts;
mod ledger;
mod ledger_faults;
mod memory;
mod mode_switch;
mod oauth;
mod observability;
mod orders;
mod orders_security;
mod outage;
mod outboxes;
mod polling;
mod publication;
mod registry;
mod replay;
mod replication;
mod roles;
mod secrets;
mod slot_loss;
mod status;
mod tls;
mod traces;
mod transactions;
mod transforms;
mod verify;
