//! `orders run --config orders.toml`: the order service. Exit codes: 0 after SIGTERM/SIGINT,
//! 1 on a runtime error, 2 on a configuration error.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::{Parser, Subcommand};
use orders::api::{App, router};
use orders::config::OrdersConfig;
use orders::idempotency;

#[derive(Parser)]
#[command(version, about = "Example order service: POST /orders under an Idempotency-Key")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serves the API until SIGTERM or SIGINT.
    Run {
        #[arg(long, env = "ORDERS_CONFIG")]
        config: PathBuf,
    },
}

/// The tables the service writes, and the file that creates each.
const TABLES: [(&str, &str); 3] = [
    ("outbox_events", "sql/001_outbox_events.sql (the relay's schema)"),
    ("orders", "sql/examples/orders.sql"),
    ("idempotency_keys", "sql/examples/idempotency.sql"),
];

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let Command::Run { config } = Cli::parse().command;
    let config = match OrdersConfig::load(&config) {
        Ok(config) => config,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let runtime = tokio::runtime::Runtime::new().expect("a tokio runtime");
    match runtime.block_on(serve(config)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn serve(config: OrdersConfig) -> Result<(), String> {
    let listen = config.http.listen.clone();
    let cleanup_every = config.idempotency.cleanup_interval_secs;
    let app = Arc::new(App::new(config));
    check_tables(&app).await?;
    if cleanup_every > 0 {
        tokio::spawn(clean_up(app.clone(), Duration::from_secs(cleanup_every)));
    }
    let listener =
        tokio::net::TcpListener::bind(&listen).await.map_err(|e| format!("http.listen {listen}: {e}"))?;
    tracing::info!(%listen, "serving POST /orders");
    axum::serve(listener, router(app))
        .with_graceful_shutdown(stop_signal())
        .await
        .map_err(|e| e.to_string())?;
    tracing::info!("stopped");
    Ok(())
}

/// Fails naming the SQL file to apply when a table is missing.
async fn check_tables(app: &App) -> Result<(), String> {
    let session = app.pool.get().await.map_err(|e| e.to_string())?;
    for (table, file) in TABLES {
        let row = session
            .query_one("SELECT to_regclass($1) IS NOT NULL", &[&table])
            .await
            .map_err(|e| e.to_string())?;
        if !row.get::<_, bool>(0) {
            return Err(format!("table {table} does not exist in this database: apply {file}"));
        }
    }
    Ok(())
}

async fn clean_up(app: Arc<App>, every: Duration) {
    let mut tick = tokio::time::interval(every);
    loop {
        tick.tick().await;
        let result = match app.pool.get().await {
            Ok(session) => idempotency::cleanup(&session).await.map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        match result {
            Ok(0) => {}
            Ok(deleted) => tracing::info!(deleted, "expired idempotency keys deleted"),
            Err(e) => tracing::warn!(error = %e, "expired idempotency keys not deleted; trying again later"),
        }
    }
}

async fn stop_signal() {
    let mut term =
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).expect("SIGTERM handler");
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
    tracing::info!("stopping: finishing the requests in hand");
}
