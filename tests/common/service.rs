//! The example services (`services/orders`, `services/ledger`) as child processes, as their
//! users run them: built by cargo as workspace members, started with a config file and
//! environment, killed with SIGKILL or stopped with SIGTERM, their stderr in a log file.

use std::path::{Path, PathBuf};
use std::process::Command;

pub use super::process::ChildProcess;

/// The workspace member binary `name`, next to the test binary's own directory
/// (`target/<profile>/NAME`). `cargo build --workspace` and `cargo nextest run --workspace`
/// (what `deploy/local/test` runs) build it; a plain `cargo test` of the relay alone does not.
pub fn workspace_bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let profile_dir = exe.parent().and_then(Path::parent).expect("target/<profile>/deps/<test>");
    let bin = profile_dir.join(name);
    assert!(
        bin.is_file(),
        "{} is missing: build the workspace first (cargo build --workspace; deploy/local/test does)",
        bin.display()
    );
    bin
}

/// A service as a child process; see [`ChildProcess`] for its controls.
pub type ServiceProcess = ChildProcess;

impl ChildProcess {
    /// Starts workspace binary `bin` with `args` and `env` added, its stderr appended to `log`.
    pub fn spawn(bin: &str, args: &[&str], env: &[(&str, &str)], log: &Path) -> ServiceProcess {
        let mut command = Command::new(workspace_bin(bin));
        command.args(args).envs(env.iter().copied()).env("RUST_BACKTRACE", "1");
        ChildProcess::start(command, bin, log)
    }
}

/// Applies the example services' schemas (`sql/examples/NAME.sql`, in order) to `client`.
pub async fn apply_examples(client: &tokio_postgres::Client, names: &[&str]) {
    for name in names {
        let path = super::repo_root().join("sql/examples").join(format!("{name}.sql"));
        let sql = std::fs::read_to_string(&path).unwrap();
        client.batch_execute(&sql).await.unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    }
}

/// The HS256 secret the order services of a test directory share (`auth.hs256_secret_file`,
/// given as `ORDERS__AUTH__HS256_SECRET_FILE`): created on first use, so replicas started in one
/// directory accept each other's tokens.
pub fn orders_hs256_secret(dir: &Path) -> PathBuf {
    let file = dir.join("orders-jwt-hs256.secret");
    if !file.exists() {
        std::fs::write(&file, format!("{:032x}{:032x}\n", rand::random::<u128>(), rand::random::<u128>()))
            .unwrap();
    }
    file
}

/// The order service on a port of its own, for `db`.
pub struct OrdersService {
    pub process: ServiceProcess,
    pub port: u16,
    pub config: PathBuf,
}

impl OrdersService {
    /// Writes `DIR/NAME.toml` (the `[postgres]` of `db`, a free port, then `extra` TOML), starts
    /// `orders run` on it with the directory's HS256 secret ([`orders_hs256_secret`]), and waits
    /// until /healthz answers.
    pub async fn start(db: &super::TestDb, dir: &Path, name: &str, extra: &str) -> OrdersService {
        Self::start_as(db, dir, name, None, extra).await
    }

    /// As [`OrdersService::start`], connecting as `role` (the server's own user when None).
    pub async fn start_as(
        db: &super::TestDb,
        dir: &Path,
        name: &str,
        role: Option<&str>,
        extra: &str,
    ) -> OrdersService {
        let (host, port, user) = db.pg_parts();
        let user = role.map_or(user, str::to_string);
        let http_port = super::http::free_port();
        let toml = format!(
            "[postgres]\nhost = \"{host}\"\nport = {port}\nuser = \"{user}\"\ndatabase = \"{}\"\nsslmode = \"disable\"\n\n\
             [http]\nlisten = \"127.0.0.1:{http_port}\"\n\n{extra}\n",
            db.name
        );
        let config = dir.join(format!("{name}.toml"));
        std::fs::write(&config, toml).unwrap();
        Self::start_on(&config, http_port, &dir.join(format!("{name}.log"))).await
    }

    /// Starts `orders run --config CONFIG` (which listens on `port`) and waits for /healthz.
    pub async fn start_on(config: &Path, port: u16, log: &Path) -> OrdersService {
        Self::start_on_with_env(config, port, log, &[]).await
    }

    /// As [`OrdersService::start_on`], with `env` added to the service's environment.
    pub async fn start_on_with_env(
        config: &Path,
        port: u16,
        log: &Path,
        env: &[(&str, &str)],
    ) -> OrdersService {
        let args = ["run", "--config", config.to_str().unwrap()];
        let secret = orders_hs256_secret(config.parent().unwrap());
        let mut env = env.to_vec();
        env.push(("ORDERS__AUTH__HS256_SECRET_FILE", secret.to_str().unwrap()));
        let mut process = ServiceProcess::spawn("orders", &args, &env, log);
        super::wait_until(format!("the order service on port {port} to answer /healthz"), async || {
            if let Some(code) = process.exited() {
                panic!("orders exited with {code}; log:\n{}", process.log_text());
            }
            super::http::get(port, "/healthz").is_some_and(|(status, _)| status == 200)
        })
        .await;
        OrdersService { process, port, config: config.to_path_buf() }
    }

    /// POST /orders with `key` (None: without the header) and `body`, as the customer the body
    /// names (`customer-1` if it names none).
    pub fn order(&self, key: Option<&str>, body: &str) -> Option<super::http::Answer> {
        let named = serde_json::from_str::<serde_json::Value>(body)
            .ok()
            .and_then(|b| b.get("customer_id").and_then(|c| c.as_str()).map(str::to_string));
        let token = self.token(named.as_deref().unwrap_or("customer-1"), 3600);
        self.order_with(Some(&token), key, body)
    }

    /// POST /orders with `token` as the bearer (None: no Authorization header), `key` and `body`.
    pub fn order_with(
        &self,
        token: Option<&str>,
        key: Option<&str>,
        body: &str,
    ) -> Option<super::http::Answer> {
        let bearer = token.map(|t| format!("Bearer {t}"));
        let mut headers: Vec<(&str, &str)> = key.map(|k| ("Idempotency-Key", k)).into_iter().collect();
        headers.extend(bearer.as_deref().map(|b| ("Authorization", b)));
        super::http::post(self.port, "/orders", &headers, body)
    }

    /// The HS256 secret file the service verifies tokens with (`orders-load --hs256-secret-file`).
    pub fn hs256_secret_file(&self) -> PathBuf {
        orders_hs256_secret(self.config.parent().unwrap())
    }

    /// A bearer token for `subject`, expiring in `ttl_secs` (negative: expired), from
    /// `orders mint-token` with the service's config and secret.
    pub fn token(&self, subject: &str, ttl_secs: i64) -> String {
        let secret = self.hs256_secret_file();
        let output = Command::new(workspace_bin("orders"))
            .args(["mint-token", "--config", self.config.to_str().unwrap(), "--subject", subject])
            .arg(format!("--ttl-secs={ttl_secs}"))
            .env("ORDERS__AUTH__HS256_SECRET_FILE", &secret)
            .output()
            .unwrap();
        assert!(output.status.success(), "orders mint-token: {}", String::from_utf8_lossy(&output.stderr));
        String::from_utf8(output.stdout).unwrap().trim().to_string()
    }
}
