//! The order service's protections (issue 28, item 2), over HTTP against a real PostgreSQL:
//! bearer-token authentication (the customer is the token's subject, and an Idempotency-Key is
//! its caller's own), a per-caller rate limit, the header-read timeout, bounded waits for a
//! database session and for a request, and a 500 that tells the client nothing but a request id.

use crate::common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use crate::orders::Shop;
use common::service::{OrdersService, ServiceProcess, workspace_bin};
use common::*;

/// JWT's base64url, unpadded (RFC 7515, section 2).
fn base64url(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let n = chunk.iter().enumerate().fold(0u32, |n, (i, b)| n | (*b as u32) << (16 - 8 * i));
        for i in 0..=chunk.len() {
            out.push(ALPHABET[(n >> (18 - 6 * i) & 63) as usize] as char);
        }
    }
    out
}

/// `header.claims.` of a JWT, for signing (or not) by hand.
fn signing_input(header: serde_json::Value, subject: &str) -> String {
    let exp = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs() + 3600;
    let claims = serde_json::json!({ "sub": subject, "exp": exp });
    format!("{}.{}", base64url(header.to_string().as_bytes()), base64url(claims.to_string().as_bytes()))
}

/// `openssl dgst -sha256 ARGS` of `input`, as base64url: a signature made outside the service.
fn openssl_sha256(input: &str, args: &[&str]) -> String {
    let mut child = Command::new("openssl")
        .args(["dgst", "-sha256", "-binary"])
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("openssl");
    child.stdin.take().unwrap().write_all(input.as_bytes()).unwrap();
    let output = child.wait_with_output().unwrap();
    assert!(output.status.success());
    base64url(&output.stdout)
}

fn assert_unauthorized(answer: &http::Answer, what: &str) {
    assert_eq!(answer.status, 401, "{what}: {answer:?}");
    assert_eq!(answer.header("www-authenticate"), Some("Bearer"), "{what}: {answer:?}");
    assert_eq!(answer.json()["code"], "unauthorized", "{what}: {answer:?}");
    let body = answer.body.to_lowercase();
    for detail in ["expired", "signature", "algorithm", "alg", "secret", "claim"] {
        assert!(!body.contains(detail), "{what}: the 401 tells why ({detail}): {answer:?}");
    }
}

const BODY: &str = r#"{"total_cents": 1999}"#;

#[tokio::test(flavor = "multi_thread")]
async fn a_request_without_a_valid_bearer_token_is_refused_with_401_and_writes_nothing() {
    // given the service, and tokens that are missing, forged, expired, unsigned or of another
    // algorithm
    let shop = Shop::new().await;
    let service = shop.start("orders", "").await;
    let good = service.token("customer-1", 3600);
    let other_secret = shop.dir.path().join("other.secret");
    std::fs::write(&other_secret, "a different secret, of 32 bytes or more").unwrap();
    let forged = String::from_utf8(
        Command::new(workspace_bin("orders"))
            .args(["mint-token", "--config", service.config.to_str().unwrap(), "--subject", "customer-1"])
            .env("ORDERS__AUTH__HS256_SECRET_FILE", &other_secret)
            .output()
            .unwrap()
            .stdout,
    )
    .unwrap();
    let expired = service.token("customer-1", -3600);
    let unsigned =
        format!("{}.", signing_input(serde_json::json!({"alg": "none", "typ": "JWT"}), "customer-1"));
    let (_, good_claims_and_signature) = good.split_once('.').unwrap();
    let as_rs256 = format!("{}.{good_claims_and_signature}", base64url(br#"{"alg":"RS256","typ":"JWT"}"#));
    let parts: Vec<&str> = good.split('.').collect();
    let other_subject = signing_input(serde_json::json!({"alg": "HS256", "typ": "JWT"}), "customer-2");
    let tampered = format!("{}.{}.{}", parts[0], other_subject.split_once('.').unwrap().1, parts[2]);

    // when each is sent
    let no_header = service.order_with(None, Some("k-1"), BODY).unwrap();
    let not_bearer = http::post(
        service.port,
        "/orders",
        &[("Idempotency-Key", "k-1"), ("Authorization", &format!("Basic {good}"))],
        BODY,
    )
    .unwrap();

    // then each is a 401 asking for a bearer token, saying nothing of why, and nothing is written
    assert_unauthorized(&no_header, "no Authorization header");
    assert_unauthorized(&not_bearer, "Basic instead of Bearer");
    for (what, token) in [
        ("garbage", "not-a-token"),
        ("signed with another secret", forged.trim()),
        ("expired an hour ago", &expired),
        ("alg none", &unsigned),
        ("header switched to RS256", &as_rs256),
        ("claims changed after signing", &tampered),
    ] {
        assert_unauthorized(&service.order_with(Some(token), Some("k-1"), BODY).unwrap(), what);
    }
    assert_eq!(shop.written().await, (0, 0, 0));
    // and the log says why, for the operator
    let log = service.process.log_text();
    assert!(log.contains("token refused") && log.contains("no Authorization header"), "{log}");
    // while the good token places the order
    assert_eq!(service.order_with(Some(&good), Some("k-1"), BODY).unwrap().status, 201);
}

#[tokio::test(flavor = "multi_thread")]
async fn an_rs256_service_accepts_its_issuers_tokens_and_not_an_hs256_one_keyed_with_its_public_key() {
    // given a service verifying RS256 with the issuer's public key, iss and aud required
    let shop = Shop::new().await;
    let dir = shop.dir.path();
    let private = dir.join("issuer.pem");
    let public = dir.join("issuer.pub.pem");
    let openssl = |args: &[&str]| assert!(Command::new("openssl").args(args).status().unwrap().success());
    openssl(&["genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048", "-out", path(&private)]);
    openssl(&["pkey", "-in", path(&private), "-pubout", "-out", path(&public)]);
    let service = start_rs256(&shop, &public).await;

    // when a token signed by the issuer comes, then an HS256 token whose HMAC key is the public
    // key file (algorithm confusion), each with the right iss and aud
    let claims = |subject: &str| {
        let exp =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs() + 3600;
        let claims = serde_json::json!({"sub": subject, "exp": exp, "iss": "shop", "aud": "orders"});
        base64url(claims.to_string().as_bytes())
    };
    let input = format!("{}.{}", base64url(br#"{"alg":"RS256","typ":"JWT"}"#), claims("customer-rs"));
    let signed = format!("{input}.{}", openssl_sha256(&input, &["-sign", path(&private)]));
    let input = format!("{}.{}", base64url(br#"{"alg":"HS256","typ":"JWT"}"#), claims("customer-rs"));
    let public_hex: String = std::fs::read(&public).unwrap().iter().map(|b| format!("{b:02x}")).collect();
    let hmac_key = format!("hexkey:{public_hex}");
    let confused = format!("{input}.{}", openssl_sha256(&input, &["-mac", "HMAC", "-macopt", &hmac_key]));

    // then the issuer's token places the order for its subject, and the confused one is a 401
    let placed = service.order_with(Some(&signed), Some("k-rs"), BODY).unwrap();
    assert_eq!(
        (placed.status, placed.json()["customer_id"].as_str()),
        (201, Some("customer-rs")),
        "{placed:?}"
    );
    assert_unauthorized(
        &service.order_with(Some(&confused), Some("k-hs"), BODY).unwrap(),
        "HS256 keyed with the public key",
    );
    assert_eq!(shop.written().await, (1, 1, 1));
}

fn path(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// The service with `[auth]` on RS256 with `public`, issuer `shop`, audience `orders`.
async fn start_rs256(shop: &Shop, public: &Path) -> OrdersService {
    let (host, port, user) = shop.db.pg_parts();
    let http_port = http::free_port();
    let config = shop.dir.path().join("rs256.toml");
    let toml = format!(
        "[postgres]\nhost = \"{host}\"\nport = {port}\nuser = \"{user}\"\ndatabase = \"{}\"\n\
         sslmode = \"disable\"\n[http]\nlisten = \"127.0.0.1:{http_port}\"\n\
         [auth]\nrs256_public_key_file = {:?}\nissuer = \"shop\"\naudience = \"orders\"\n",
        shop.db.name, public
    );
    std::fs::write(&config, toml).unwrap();
    let args = ["run", "--config", path(&config)];
    let mut process = ServiceProcess::spawn("orders", &args, &[], &shop.dir.path().join("rs256.log"));
    wait_until("the RS256 service to answer /healthz", async || {
        if let Some(code) = process.exited() {
            panic!("orders exited with {code}; log:\n{}", process.log_text());
        }
        http::get(http_port, "/healthz").is_some_and(|(status, _)| status == 200)
    })
    .await;
    OrdersService { process, port: http_port, config }
}

#[tokio::test(flavor = "multi_thread")]
async fn the_customer_is_the_tokens_subject_and_a_body_naming_another_is_refused() {
    // given the service and a token for customer-7
    let shop = Shop::new().await;
    let service = shop.start("orders", "").await;
    let token = service.token("customer-7", 3600);

    // when customer-7 places an order naming no customer, then one naming customer-8
    let placed = service.order_with(Some(&token), Some("k-own"), BODY).unwrap();
    let other_body = r#"{"customer_id": "customer-8", "total_cents": 1999}"#;
    let other = service.order_with(Some(&token), Some("k-other"), other_body).unwrap();

    // then the first is customer-7's order, and the second is refused with 403, writing nothing
    assert_eq!(placed.status, 201, "{placed:?}");
    assert_eq!(placed.json()["customer_id"], "customer-7");
    let customer: String = shop.client.query_one("SELECT customer_id FROM orders", &[]).await.unwrap().get(0);
    assert_eq!(customer, "customer-7");
    assert_eq!((other.status, other.json()["code"].as_str()), (403, Some("forbidden")), "{other:?}");
    assert_eq!(shop.written().await, (1, 1, 1));
}

#[tokio::test(flavor = "multi_thread")]
async fn an_idempotency_key_is_its_callers_own() {
    // given two callers
    let shop = Shop::new().await;
    let service = shop.start("orders", "").await;
    let (a, b) = (service.token("customer-a", 3600), service.token("customer-b", 3600));

    // when both send the same key with the same body, and then the first retries
    let from_a = service.order_with(Some(&a), Some("k-shared"), BODY).unwrap();
    let from_b = service.order_with(Some(&b), Some("k-shared"), BODY).unwrap();
    let a_again = service.order_with(Some(&a), Some("k-shared"), BODY).unwrap();

    // then they are two orders, one each, neither a replay of the other's
    assert_eq!((from_a.status, from_b.status), (201, 201), "{from_a:?} {from_b:?}");
    assert_eq!(from_b.header("idempotent-replayed"), None);
    assert_eq!(from_a.json()["customer_id"], "customer-a");
    assert_eq!(from_b.json()["customer_id"], "customer-b");
    assert_ne!(from_a.json()["order_id"], from_b.json()["order_id"]);
    // and the first caller's retry is its own answer, replayed
    assert_eq!((a_again.status, a_again.json()), (201, from_a.json()));
    assert_eq!(a_again.header("idempotent-replayed"), Some("true"));
    assert_eq!(shop.written().await, (2, 2, 2));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_caller_over_its_rate_limit_gets_429_with_retry_after_and_other_callers_do_not() {
    // given a limit of a burst of 2, refilled once a minute
    let shop = Shop::new().await;
    let service = shop.start("orders", "[rate_limit]\nrequests_per_sec = 0.0167\nburst = 2\n").await;
    let (busy, calm) = (service.token("customer-busy", 3600), service.token("customer-calm", 3600));

    // when one caller sends three orders at once, and another caller one
    let answers: Vec<_> =
        (0..3).map(|n| service.order_with(Some(&busy), Some(&format!("k-{n}")), BODY).unwrap()).collect();
    let other = service.order_with(Some(&calm), Some("k-0"), BODY).unwrap();

    // then the third is 429 with a Retry-After of about a minute, writing nothing; the other
    // caller is served
    assert_eq!(answers.iter().map(|a| a.status).collect::<Vec<_>>(), [201, 201, 429], "{answers:?}");
    let retry_after: u64 = answers[2].header("retry-after").unwrap().parse().unwrap();
    assert!((50..=60).contains(&retry_after), "{:?}", answers[2]);
    assert_eq!(other.status, 201, "{other:?}");
    assert_eq!(shop.written().await, (3, 3, 3));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_connection_that_never_finishes_its_headers_is_closed_after_the_header_timeout() {
    // given a service with a 1 s header-read timeout
    let shop = Shop::new().await;
    let service = shop.start("orders", "header_read_timeout_ms = 1000\n").await;

    // when a client sends the start of a request and never the blank line that ends its headers
    let mut slow = TcpStream::connect(("127.0.0.1", service.port)).unwrap();
    slow.write_all(b"POST /orders HTTP/1.1\r\nHost: 127.0.0.1\r\nIdempotency-Key: k-slow\r\n").unwrap();

    // then the server closes the connection (read ends) rather than holding it for the client;
    // 60 s is only how long the test waits before calling it held
    slow.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let mut answer = Vec::new();
    match slow.read_to_end(&mut answer) {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
        Err(e) => panic!("the server held a connection without complete headers for 60 s: {e}"),
    }
    // and the service goes on serving
    assert_eq!(service.order(Some("k-after"), BODY).unwrap().status, 201);
}

#[tokio::test(flavor = "multi_thread")]
async fn an_internal_error_answers_a_generic_500_whose_request_id_the_log_has() {
    // given a database that refuses every order with a message meant for operators only
    let shop = Shop::new().await;
    shop.client
        .batch_execute(
            "CREATE FUNCTION refuse_order() RETURNS trigger LANGUAGE plpgsql AS \
             $$ BEGIN RAISE EXCEPTION 'internal detail: table orders_archive_7 is full'; END $$; \
             CREATE TRIGGER refuse_order BEFORE INSERT ON orders FOR EACH ROW EXECUTE FUNCTION refuse_order();",
        )
        .await
        .unwrap();
    let service = shop.start("orders", "").await;

    // when an order comes
    let answer = service.order(Some("k-500"), r#"{"customer_id": "customer-1", "total_cents": 5}"#).unwrap();

    // then it is a 500 that names a request id and nothing of the cause
    assert_eq!(answer.status, 500, "{answer:?}");
    let id = answer.header("x-request-id").expect("an X-Request-Id").to_string();
    assert_eq!(
        answer.json(),
        serde_json::json!({
            "error": "internal error: the service's log has the details under this request_id",
            "code": "error",
            "request_id": id,
        })
    );
    assert!(!answer.body.contains("orders_archive_7"), "{answer:?}");
    // and the log has the cause under that id
    let log = service.process.log_text();
    let line = log.lines().find(|l| l.contains("orders_archive_7")).unwrap_or_else(|| panic!("{log}"));
    assert!(line.contains(&id), "the cause is logged without the request id: {line}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_request_waits_for_a_session_and_for_its_answer_only_so_long() {
    // given one session, a 200 ms wait for it, a 1 s request timeout, and requests that stall
    // 3 s holding their session
    let shop = Shop::new().await;
    let extra = "pool_size = 1\npool_wait_ms = 200\nrequest_timeout_ms = 1000\n\
                 [faults]\npause_after_claim_ms = 3000\n";
    let service = shop.start("orders", extra).await;

    // when one request takes the session and another comes meanwhile
    let port = service.port;
    let token = service.token("customer-1", 3600);
    let bearer = format!("Bearer {token}");
    let first = {
        let bearer = bearer.clone();
        std::thread::spawn(move || {
            http::post(port, "/orders", &[("Idempotency-Key", "k-slow"), ("Authorization", &bearer)], BODY)
        })
    };
    wait_until("the first request to claim its key", async || {
        shop.count("SELECT count(*) FROM idempotency_keys").await == 1
    })
    .await;
    let second = service.order_with(Some(&token), Some("k-waiting"), BODY).unwrap();

    // then the second is refused with 503 once its wait for a session is over
    assert_eq!((second.status, second.json()["code"].as_str()), (503, Some("unavailable")), "{second:?}");
    assert!(second.header("retry-after").is_some(), "{second:?}");
    // and the first is answered 503 at its timeout, while its work goes on to write the order,
    // which its retry gets
    let first = first.join().unwrap().unwrap();
    assert_eq!((first.status, first.json()["code"].as_str()), (503, Some("timeout")), "{first:?}");
    wait_until("the first order to be written", async || shop.written().await.0 == 1).await;
    let retry = service.order_with(Some(&token), Some("k-slow"), BODY).unwrap();
    assert_eq!((retry.status, retry.header("idempotent-replayed")), (201, Some("true")), "{retry:?}");
}

/// A process's resident memory in bytes: `VmRSS` (now) or `VmHWM` (its peak), from /proc.
fn resident(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with(field)).unwrap_or_else(|| panic!("{field}: {status}"));
    let kib: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kib * 1024
}

/// What one connection may cost the service beyond its head and body buffers: hyper's write
/// buffer and connection state, the task, the router's clone; generous (measured: a few KiB).
const CONNECTION_OVERHEAD_BYTES: u64 = 64 * 1024;

/// An unauthenticated `POST /orders` on a connection of its own: the head announcing `body`
/// bytes, then all of them but the last, then whatever the service answers, until it closes.
/// The connection's outcome: the status line's code, or 0 when it was reset or refused.
async fn unauthenticated_post(port: u16, body: &'static [u8]) -> u16 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Ok(mut socket) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await else { return 0 };
    let head = format!(
        "POST /orders HTTP/1.1\r\nHost: 127.0.0.1\r\nIdempotency-Key: k-flood\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len() + 1
    );
    // (a refusal before the body is read resets the writes: that is the point)
    if socket.write_all(head.as_bytes()).await.is_ok() {
        let _ = socket.write_all(body).await;
    }
    let mut answer = Vec::new();
    let _ = socket.read_to_end(&mut answer).await;
    let answer = String::from_utf8_lossy(&answer);
    answer.split_whitespace().nth(1).and_then(|code| code.parse().ok()).unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread")]
async fn two_thousand_unauthenticated_connections_keep_the_services_memory_within_its_bound() {
    // given a service serving 512 connections at once, each buffering at most 8 KiB of head and,
    // once authenticated, 1 KiB of body: its memory may grow by at most
    // 512 x (8 KiB + 1 KiB + the connection's own overhead)
    let (max_connections, max_header_bytes, max_body_bytes) = (512u64, 8192u64, 1024u64);
    let shop = Shop::new().await;
    let extra = format!(
        "max_connections = {max_connections}\nmax_header_bytes = {max_header_bytes}\n\
         max_body_bytes = {max_body_bytes}\nrequest_timeout_ms = 5000\n"
    );
    let service = shop.start("orders", &extra).await;
    assert_eq!(service.order(Some("k-warm"), BODY).unwrap().status, 201, "warm-up order");
    let pid = service.process.pid();
    let before = resident(pid, "VmRSS");
    let bound = max_connections * (max_header_bytes + max_body_bytes + CONNECTION_OVERHEAD_BYTES);

    // when 2,000 connections without a token each send a head announcing a 1 MiB body (half of
    // axum's default limit) and all of it but the last byte, at once
    let body: &'static [u8] = Box::leak(vec![b' '; 1 << 20].into_boxed_slice());
    let port = service.port;
    let clients: Vec<_> = (0..2_000).map(|_| tokio::spawn(unauthenticated_post(port, body))).collect();
    let mut outcomes = std::collections::BTreeMap::<u16, usize>::new();
    for client in clients {
        *outcomes.entry(client.await.unwrap()).or_default() += 1;
    }

    // then the service's peak resident memory grew by no more than the bound: it refused each
    // with 401 before reading a body, whatever the clients sent
    let grown = resident(pid, "VmHWM").saturating_sub(before);
    eprintln!("peak resident memory grew by {} KiB (bound {} KiB): {outcomes:?}", grown / 1024, bound / 1024);
    assert!(
        grown <= bound,
        "the service's peak memory grew by {} KiB, over the bound of {} KiB derived from its config \
         (outcomes by status, 0 = reset: {outcomes:?})",
        grown / 1024,
        bound / 1024
    );
    assert!(outcomes.get(&401).is_some_and(|n| *n > 0), "no 401 among {outcomes:?}");
    assert!(!outcomes.contains_key(&201), "{outcomes:?}");
    // and it goes on serving, and wrote nothing for them; an authenticated caller's body over
    // http.max_body_bytes is answered 413
    assert_eq!(service.order(Some("k-after"), BODY).unwrap().status, 201);
    let token = service.token("customer-1", 3600);
    let long =
        format!(r#"{{"total_cents": 1999, "customer_id": "{}"}}"#, "c".repeat(max_body_bytes as usize));
    let refused = service.order_with(Some(&token), Some("k-long"), &long).unwrap();
    assert_eq!((refused.status, refused.json()["code"].as_str()), (413, Some("too_large")), "{refused:?}");
    assert_eq!(shop.written().await.0, 2);
}
