//! `orders run --config orders.toml`: the order service. Exit codes: 0 after SIGTERM/SIGINT,
//! 1 on a runtime error, 2 on a configuration error.
//!
//! `orders mint-token --config orders.toml --subject customer-1`: prints a bearer token signed
//! with the configured HS256 secret, for demos and tests (a real deployment's tokens come from
//! its identity provider).

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::{Parser, Subcommand};
use orders::api::{App, router};
use orders::auth::{self, Claims, Verifier};
use orders::config::OrdersConfig;
use orders::{idempotency, server};

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
    /// Prints an HS256 bearer token for SUBJECT, signed with the config's
    /// auth.hs256_secret_file and carrying its auth.issuer and auth.audience.
    MintToken {
        #[arg(long, env = "ORDERS_CONFIG")]
        config: PathBuf,
        /// The caller, and so the customer its orders are for.
        #[arg(long)]
        subject: String,
        /// Seconds until the token expires (negative: already expired, for tests).
        #[arg(long, default_value_t = 3600, allow_negative_numbers = true)]
        ttl_secs: i64,
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
    let (config, mint) = match Cli::parse().command {
        Command::Run { config } => (config, None),
        Command::MintToken { config, subject, ttl_secs } => (config, Some((subject, ttl_secs))),
    };
    let config = match OrdersConfig::load(&config) {
        Ok(config) => config,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    if let Some((subject, ttl_secs)) = mint {
        return mint_token(&config, subject, ttl_secs);
    }
    let verifier = match Verifier::from_config(&config.auth) {
        Ok(verifier) => verifier,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let runtime = tokio::runtime::Runtime::new().expect("a tokio runtime");
    match runtime.block_on(serve(config, verifier)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn mint_token(config: &OrdersConfig, subject: String, ttl_secs: i64) -> ExitCode {
    if config.auth.hs256_secret_file.is_empty() {
        eprintln!(
            "error: auth.hs256_secret_file: mint-token signs with an HS256 secret; this config has none"
        );
        return ExitCode::from(2);
    }
    let secret = match auth::read_hs256_secret(Path::new(&config.auth.hs256_secret_file)) {
        Ok(secret) => secret,
        Err(e) => {
            eprintln!("error: auth.hs256_secret_file: {e}");
            return ExitCode::from(2);
        }
    };
    let optional = |s: &str| (!s.is_empty()).then(|| s.to_string());
    let claims = Claims {
        sub: subject,
        exp: auth::now_secs().saturating_add_signed(ttl_secs),
        iss: optional(&config.auth.issuer),
        aud: optional(&config.auth.audience),
        nbf: None,
    };
    println!("{}", auth::mint_hs256(&secret, &claims));
    ExitCode::SUCCESS
}

async fn serve(config: OrdersConfig, verifier: Verifier) -> Result<(), String> {
    let listen = config.http.listen.clone();
    let cleanup_every = config.idempotency.cleanup_interval_secs;
    let http = config.http.clone();
    outbox_relay::relay::start_tracing(&outbox_relay::config::TracingConfig::for_service("orders"))
        .map_err(|e| e.to_string())?;
    let app = Arc::new(App::new(config, verifier));
    check_tables(&app).await?;
    if cleanup_every > 0 {
        tokio::spawn(clean_up(app.clone(), Duration::from_secs(cleanup_every)));
    }
    let listener =
        tokio::net::TcpListener::bind(&listen).await.map_err(|e| format!("http.listen {listen}: {e}"))?;
    tracing::info!(%listen, "serving POST /orders");
    server::serve(listener, router(app), &http, stop_signal()).await;
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
    let scoped = "SELECT count(*) FROM pg_attribute \
         WHERE attrelid = 'idempotency_keys'::regclass AND attname = 'caller' AND NOT attisdropped";
    let row = session.query_one(scoped, &[]).await.map_err(|e| e.to_string())?;
    if row.get::<_, i64>(0) == 0 {
        return Err("table idempotency_keys has no caller column (it predates keys scoped by caller): \
                    apply sql/examples/idempotency.sql again, which adds it"
            .into());
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
