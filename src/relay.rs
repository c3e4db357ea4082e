//! The daemon: start the configured source, stop it gracefully on SIGTERM/SIGINT.
//!
//! On a signal the source stops claiming, finishes (or abandons uncommitted) the batch in flight
//! and flushes the producer. If that takes longer than `shutdown.grace_period_secs` the process
//! exits anyway: an uncommitted batch is rolled back by PostgreSQL when the session closes, so
//! its rows are published again by the next run (at-least-once), never lost. With `[tracing]`
//! on, the spans queued by then (the stream session's among them) are exported before the exit,
//! for at most 5 s (`TRACE_FLUSH_LIMIT`).

use std::sync::Arc;
use std::time::Duration;

use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::watch;

use crate::config::{RelayConfig, SourceMode, TracingConfig};
use crate::delivery::live::Desk;
use crate::error::{Action, FatalReason, RelayError};
use crate::observe::health::{Health, Phase};
use crate::observe::http;
use crate::observe::metrics::metrics;
use crate::outboxes::Outboxes;
use crate::sink::kafka::KafkaSink;
use crate::source::polling::PollingSource;
use crate::source::replication::ReplicationSource;
use crate::source::sampler;
use crate::supervisor;

pub async fn run(config: RelayConfig) -> Result<(), RelayError> {
    let linger = Duration::from_secs(config.metrics.fatal_exit_delay_secs);
    let serving = !config.metrics.listen.is_empty();
    let health = Arc::new(Health::new(Duration::from_millis(config.retry.max_backoff_ms)));
    let result = run_until_stopped(config, health.clone()).await;
    if let Err(e) = &result {
        let reason = match e.action() {
            Action::Fatal(reason) => reason,
            Action::Retry | Action::Standby => FatalReason::Other,
        };
        let lingering = serving && !linger.is_zero();
        // logged before the metric and /readyz say so: whoever sees those finds the reason logged
        if lingering {
            tracing::error!(
                error = %e,
                reason = %reason.label(),
                exit_in_secs = linger.as_secs(),
                "fatal error; serving metrics, then exiting"
            );
        }
        metrics().fatal.with_label_values(&[reason.label()]).set(1);
        health.set_phase(Phase::Fatal(e.to_string()));
        if lingering {
            // keep /metrics up long enough for a scrape to see outbox_relay_fatal_error = 1
            tokio::time::sleep(linger).await;
        }
    }
    result
}

async fn run_until_stopped(config: RelayConfig, health: Arc<Health>) -> Result<(), RelayError> {
    let m = metrics();
    m.initialize(config.source.mode.into(), env!("CARGO_PKG_VERSION"));
    m.label_deployment(crate::observe::metrics::deployment_labels(&config));
    let outboxes = Arc::new(Outboxes::new(&config));
    m.initialize_outboxes(outboxes.iter().map(|o| o.name.as_str()));
    m.slot_lag_warning.set(config.metrics.slot_lag_warning_bytes as i64);
    m.slot_lag_critical.set(config.metrics.slot_lag_critical_bytes as i64);
    if !config.metrics.listen.is_empty() {
        let listen = config.metrics.listen.parse().expect("validated");
        http::serve(listen, health.clone(), http::relay_metrics).await.map_err(|e| {
            RelayError::fatal(FatalReason::Config, format!("metrics.listen {listen}: cannot listen: {e}"))
        })?;
    }
    // the requests the active session serves beside its stream: the admin API's and the signal table's
    let (leader, desk) = crate::delivery::live::channel();
    let admin =
        crate::ops::admin::Admin::new(Arc::new(config.clone()), outboxes.clone(), health.clone(), leader)?;
    // (before the supervisor: its first take-over reads the pause the relay's instances share)
    admin.control.spawn();
    crate::ops::admin::serve(admin.clone()).await?;
    crate::ops::signal::spawn(admin);
    start_tracing(&config.tracing)?;
    sampler::spawn(config.clone(), outboxes.clone());
    first_kafka_token(&config).await?;
    let (shutdown_tx, shutdown_rx) = watch::channel(false);
    let sink = KafkaSink::new(&config.kafka).map_err(|e| {
        RelayError::fatal(
            FatalReason::Config,
            format!("cannot create the Kafka producer (check kafka.*): {e}"),
        )
    })?;
    let grace = Duration::from_secs(config.shutdown.grace_period_secs);
    let mut source = spawn_supervisor(config, outboxes, sink, health, (shutdown_rx, desk));
    let signal_error = |e: std::io::Error| {
        RelayError::fatal(FatalReason::Other, format!("cannot install a signal handler: {e}"))
    };
    let mut sigterm = signal(SignalKind::terminate()).map_err(signal_error)?;
    let mut sigint = signal(SignalKind::interrupt()).map_err(signal_error)?;
    let signal_name = tokio::select! {
        finished = &mut source => {
            crate::observe::trace::flush(TRACE_FLUSH_LIMIT).await;
            return joined(finished);
        }
        _ = sigterm.recv() => "SIGTERM",
        _ = sigint.recv() => "SIGINT",
    };
    tracing::info!(signal = signal_name, grace_period_secs = grace.as_secs(), "shutting down");
    crate::sink::kafka::mark_stopping();
    let _ = shutdown_tx.send(true);
    let stopped = match tokio::time::timeout(grace, &mut source).await {
        Ok(finished) => joined(finished),
        Err(_) => {
            tracing::warn!(
                "grace period elapsed with a batch in flight; it was not committed and will be published again"
            );
            source.abort();
            Ok(())
        }
    };
    // the spans of the work that just ended (a stream session's) are exported before the exit
    crate::observe::trace::flush(TRACE_FLUSH_LIMIT).await;
    stopped
}

/// At exit, how long the spans queued are given to reach the tracing backend.
const TRACE_FLUSH_LIMIT: Duration = Duration::from_secs(5);

/// The supervisor of the configured source, over `sink`, on a task of its own.
fn spawn_supervisor(
    config: RelayConfig,
    outboxes: Arc<Outboxes>,
    mut sink: KafkaSink,
    health: Arc<Health>,
    (shutdown, desk): (watch::Receiver<bool>, Desk),
) -> tokio::task::JoinHandle<Result<(), RelayError>> {
    let retry = config.retry.clone();
    match config.source.mode {
        SourceMode::Polling => {
            let source = PollingSource::new(config, outboxes).with_desk(desk);
            tokio::spawn(async move { supervisor::run(source, &mut sink, health, &retry, shutdown).await })
        }
        SourceMode::Replication => {
            let source = ReplicationSource::new(config, outboxes).with_desk(desk);
            tokio::spawn(async move { supervisor::run(source, &mut sink, health, &retry, shutdown).await })
        }
    }
}

/// With `[kafka.auth]`, the first token before any Kafka client: an identity provider that
/// refuses the relay's client stops it here, naming the setting; one that cannot be reached now
/// is retried by the token source while the session starts (`/readyz` says why).
async fn first_kafka_token(config: &RelayConfig) -> Result<(), RelayError> {
    match crate::credentials::first_token(&config.kafka).await {
        Ok(_) => Ok(()),
        Err(e @ crate::credentials::FetchError::Refused { .. }) => {
            Err(RelayError::fatal(FatalReason::Config, format!("kafka token: {e}")))
        }
        Err(e) => {
            tracing::warn!(error = %e, "no Kafka token yet; retrying in the background");
            Ok(())
        }
    }
}

fn joined(finished: Result<Result<(), RelayError>, tokio::task::JoinError>) -> Result<(), RelayError> {
    finished.map_err(|e| RelayError::fatal(FatalReason::Other, format!("the relay task panicked: {e}")))?
}

/// Installs the process's span exporter when `tracing` (or the `OTEL_*` environment) turns it
/// on; the example services call it too, with their own service name. Within a runtime.
pub fn start_tracing(tracing: &TracingConfig) -> Result<(), RelayError> {
    let settings = tracing.resolve(|name| std::env::var(name).ok());
    let invalid = |e: String| RelayError::fatal(FatalReason::Config, e);
    let Some(settings) = settings.map_err(|e| invalid(e.to_string()))? else { return Ok(()) };
    let timeout = Duration::from_millis(settings.export_timeout_ms);
    let http = crate::credentials::http_client("tracing.ca_file", &settings.ca_file, timeout)
        .map_err(|e| invalid(e.to_string()))?;
    crate::observe::trace::install(&settings, http);
    Ok(())
}
