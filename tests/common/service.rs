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

/// The order service on a port of its own, for `db`.
pub struct OrdersService {
    pub process: ServiceProcess,
    pub port: u16,
    pub config: PathBuf,
}

impl OrdersService {
    /// Writes `DIR/NAME.toml` (the `[postgres]` of `db`, a free port, then `extra` TOML), starts
    /// `orders run` on it, and waits until /healthz answers.
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
            "[postgres]\nhost = \"{host}\"\nport = {port}\nuser = \"{user}\"\ndatabase = \"{}\"\n\n\
             [http]\nlisten = \"127.0.0.1:{http_port}\"\n\n{extra}\n",
            db.name
        );
        let config = dir.join(format!("{name}.toml"));
        std::fs::write(&config, toml).unwrap();
        Self::start_on(&config, http_port, &dir.join(format!("{name}.log"))).await
    }

    /// Starts `orders run --config CONFIG` (which listens on `port`) and waits for /healthz.
    pub async fn start_on(config: &Path, port: u16, log: &Path) -> OrdersService {
        let args = ["run", "--config", config.to_str().unwrap()];
        let mut process = ServiceProcess::spawn("orders", &args, &[], log);
        super::wait_until(format!("the order service on port {port} to answer /healthz"), async || {
            if let Some(code) = process.exited() {
                panic!("orders exited with {code}; log:\n{}", process.log_text());
            }
            super::http::get(port, "/healthz").is_some_and(|(status, _)| status == 200)
        })
        .await;
        OrdersService { process, port, config: config.to_path_buf() }
    }

    /// POST /orders with `key` (None: without the header) and `body`.
    pub fn order(&self, key: Option<&str>, body: &str) -> Option<super::http::Answer> {
        let headers: Vec<(&str, &str)> = key.map(|k| ("Idempotency-Key", k)).into_iter().collect();
        super::http::post(self.port, "/orders", &headers, body)
    }
}
