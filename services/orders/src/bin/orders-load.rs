//! `orders-load`: places orders against the order service the way a careful client does, with
//! the retry policy of `orders::retry` and the same `Idempotency-Key` on every retry, and can
//! pretend responses were lost (`--lose-responses`) to prove that retrying is safe.
//!
//! Each order is placed as a customer `customer-<n % customers>`, with a bearer token for that
//! customer minted from `--hs256-secret-file` (the service's `auth.hs256_secret_file`); or, with
//! `--token`, every order as that token's subject.
//!
//! Prints one JSON summary to stdout at the end; `--orders 0` runs until Ctrl-C, printing a
//! progress line every 5 s. Every key's final answer is checked against any answer seen (and
//! "lost") before it: a retry that got a different order counts as `inconsistent`.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use clap::{ArgGroup, Parser};
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use orders::auth::{self, Claims};
use orders::retry::{Decision, Outcome, Policy};
use rand::Rng;
use serde_json::json;

#[derive(Parser, Clone)]
#[command(about = "Places orders with retries and the same Idempotency-Key per order")]
#[command(group(ArgGroup::new("credentials").required(true).args(["hs256_secret_file", "token"])))]
struct Args {
    /// The service's HS256 secret (auth.hs256_secret_file): each customer's token is minted
    /// with it.
    #[arg(long, env = "ORDERS_LOAD_HS256_SECRET_FILE")]
    hs256_secret_file: Option<std::path::PathBuf>,
    /// The `iss` of minted tokens (the service's auth.issuer, if set).
    #[arg(long, default_value = "")]
    issuer: String,
    /// The `aud` of minted tokens (the service's auth.audience, if set).
    #[arg(long, default_value = "")]
    audience: String,
    /// A bearer token: every order is placed as its subject (`--customers` is then ignored).
    #[arg(long, env = "ORDERS_LOAD_TOKEN")]
    token: Option<String>,
    /// The service, `http://host:port`.
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    url: String,
    /// Orders to place; 0: until Ctrl-C.
    #[arg(long, default_value_t = 100)]
    orders: u64,
    /// Customers the orders are spread over (`customer-0` ...).
    #[arg(long, default_value_t = 10)]
    customers: u64,
    /// Requests in flight at once.
    #[arg(long, default_value_t = 4)]
    concurrency: usize,
    /// Orders per second in all; 0: as fast as answers come.
    #[arg(long, default_value_t = 0.0)]
    rate: f64,
    /// The share of answers to treat as lost (then retried with the same key).
    #[arg(long, default_value_t = 0.0)]
    lose_responses: f64,
    /// Keys are `PREFIX-<n>`; give each run its own.
    #[arg(long, default_value = "load")]
    key_prefix: String,
    #[arg(long, default_value_t = 100)]
    min_cents: i64,
    #[arg(long, default_value_t = 5_000)]
    max_cents: i64,
}

#[derive(Default)]
struct Tally {
    next: AtomicU64,
    attempts: AtomicU64,
    created: AtomicU64,
    replayed: AtomicU64,
    lost_injected: AtomicU64,
    gave_up: AtomicU64,
    inconsistent: AtomicU64,
    statuses: Mutex<BTreeMap<String, u64>>,
}

/// Where each attempt's bearer token comes from.
enum Credentials {
    Mint { secret: Vec<u8>, issuer: Option<String>, audience: Option<String> },
    Fixed(String),
}

impl Credentials {
    fn from_args(args: &Args) -> Credentials {
        if let Some(token) = &args.token {
            return Credentials::Fixed(token.clone());
        }
        let file = args.hs256_secret_file.as_ref().expect("clap requires one of the two");
        let secret = auth::read_hs256_secret(file).unwrap_or_else(|e| {
            eprintln!("orders-load: --hs256-secret-file: {e}");
            std::process::exit(2);
        });
        let optional = |s: &str| (!s.is_empty()).then(|| s.to_string());
        Credentials::Mint { secret, issuer: optional(&args.issuer), audience: optional(&args.audience) }
    }

    /// A token for `customer`, valid for ten minutes.
    fn token(&self, customer: &str) -> String {
        match self {
            Credentials::Fixed(token) => token.clone(),
            Credentials::Mint { secret, issuer, audience } => {
                let claims = Claims {
                    sub: customer.to_string(),
                    exp: auth::now_secs() + 600,
                    iss: issuer.clone(),
                    aud: audience.clone(),
                    nbf: None,
                };
                auth::mint_hs256(secret, &claims)
            }
        }
    }
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    let credentials = Arc::new(Credentials::from_args(&args));
    let addr = args.url.trim_start_matches("http://").trim_end_matches('/').to_string();
    let tally = Arc::new(Tally::default());
    let pace = (args.rate > 0.0).then(|| {
        Arc::new(tokio::sync::Mutex::new(tokio::time::interval(Duration::from_secs_f64(1.0 / args.rate))))
    });
    let mut workers = Vec::new();
    for _ in 0..args.concurrency.max(1) {
        let (args, addr, tally, pace) = (args.clone(), addr.clone(), tally.clone(), pace.clone());
        let credentials = credentials.clone();
        workers.push(tokio::spawn(async move {
            loop {
                let n = tally.next.fetch_add(1, Ordering::Relaxed);
                if args.orders > 0 && n >= args.orders {
                    break;
                }
                if let Some(pace) = &pace {
                    pace.lock().await.tick().await;
                }
                place_one(&args, &credentials, &addr, &tally, n).await;
            }
        }));
    }
    if args.orders == 0 {
        tokio::spawn(progress(tally.clone()));
    }
    for worker in workers {
        worker.await.expect("worker");
    }
    println!("{}", summary(&tally, args.orders));
}

/// Places order `n`: attempts until the policy says done or give up.
async fn place_one(args: &Args, credentials: &Credentials, addr: &str, tally: &Tally, n: u64) {
    let policy = Policy::default();
    let key = format!("{}-{n}", args.key_prefix);
    let customer = format!("customer-{}", n % args.customers.max(1));
    let body =
        json!({ "total_cents": rand::rng().random_range(args.min_cents..=args.max_cents) }).to_string();
    let mut first_seen: Option<serde_json::Value> = None;
    for attempt in 1.. {
        tally.attempts.fetch_add(1, Ordering::Relaxed);
        let mut outcome = match post(addr, &credentials.token(&customer), &key, &body).await {
            Some((status, retry_after, replayed, answer)) => {
                *tally.statuses.lock().unwrap().entry(status.to_string()).or_default() += 1;
                if (200..300).contains(&status) {
                    if first_seen.get_or_insert_with(|| answer.clone())["order_id"] != answer["order_id"] {
                        tally.inconsistent.fetch_add(1, Ordering::Relaxed);
                    }
                    let counter = if replayed { &tally.replayed } else { &tally.created };
                    counter.fetch_add(1, Ordering::Relaxed);
                }
                Outcome::Response { status, retry_after }
            }
            None => Outcome::NoResponse,
        };
        if matches!(outcome, Outcome::Response { status, .. } if (200..300).contains(&status))
            && rand::rng().random_bool(args.lose_responses.clamp(0.0, 1.0))
        {
            tally.lost_injected.fetch_add(1, Ordering::Relaxed);
            outcome = Outcome::NoResponse;
        }
        let decision = policy.decide(attempt, outcome, &mut rand::rng());
        match decision {
            Decision::Done => return,
            Decision::GiveUp => {
                tally.gave_up.fetch_add(1, Ordering::Relaxed);
                eprintln!("orders-load: gave up on key {key} after attempt {attempt}: {outcome:?}");
                return;
            }
            Decision::RetryAfter(pause) => tokio::time::sleep(pause).await,
        }
    }
}

/// One POST /orders: (status, Retry-After, replayed, JSON body), or None without an answer.
async fn post(
    addr: &str,
    token: &str,
    key: &str,
    body: &str,
) -> Option<(u16, Option<Duration>, bool, serde_json::Value)> {
    let attempt = async {
        let stream = tokio::net::TcpStream::connect(addr).await.ok()?;
        let (mut sender, connection) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream)).await.ok()?;
        tokio::spawn(connection);
        let request = hyper::Request::post("/orders")
            .header("host", addr)
            .header("content-type", "application/json")
            .header("authorization", format!("Bearer {token}"))
            .header("idempotency-key", key)
            .body(Full::new(Bytes::from(body.to_string())))
            .ok()?;
        let response = sender.send_request(request).await.ok()?;
        let status = response.status().as_u16();
        let header =
            |name: &str| response.headers().get(name).and_then(|v| v.to_str().ok()).map(str::to_string);
        let retry_after = header("retry-after").and_then(|v| v.parse().ok()).map(Duration::from_secs);
        let replayed = header("idempotent-replayed").is_some();
        let bytes = response.into_body().collect().await.ok()?.to_bytes();
        Some((status, retry_after, replayed, serde_json::from_slice(&bytes).unwrap_or_default()))
    };
    tokio::time::timeout(Duration::from_secs(10), attempt).await.ok().flatten()
}

fn summary(tally: &Tally, orders: u64) -> serde_json::Value {
    let load = |c: &AtomicU64| c.load(Ordering::Relaxed);
    json!({
        "orders": if orders > 0 { orders } else { load(&tally.next) },
        "attempts": load(&tally.attempts),
        "created": load(&tally.created),
        "replayed": load(&tally.replayed),
        "lost_injected": load(&tally.lost_injected),
        "gave_up": load(&tally.gave_up),
        "inconsistent": load(&tally.inconsistent),
        "statuses": *tally.statuses.lock().unwrap(),
    })
}

async fn progress(tally: Arc<Tally>) {
    let mut tick = tokio::time::interval(Duration::from_secs(5));
    tick.tick().await;
    loop {
        tick.tick().await;
        eprintln!("orders-load: {}", summary(&tally, 0));
    }
}
