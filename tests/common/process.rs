//! The relay (and the example services) as child processes, as users run them: started,
//! signalled, killed with SIGKILL, and, for the relay, watched as an operator watches it:
//! `/readyz` and `/metrics` on a listener of its own.

use std::fmt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::http::{free_port, get, sample};

/// The log level of the relays tests start: the debug lines explain a failed test.
pub const TEST_LOG_LEVEL: &str = "info,outbox_relay=debug";

/// A child process with its stderr in a log file: killed on drop.
pub struct ChildProcess {
    child: Option<Child>,
    pub log: PathBuf,
    name: String,
}

impl ChildProcess {
    /// Starts `command` (named `name` in messages), its stdout discarded and its stderr appended
    /// to `log`.
    pub fn start(mut command: Command, name: &str, log: &Path) -> ChildProcess {
        let log_file = std::fs::OpenOptions::new().create(true).append(true).open(log).unwrap();
        let child = command
            .stdout(Stdio::null())
            .stderr(log_file)
            .spawn()
            .unwrap_or_else(|e| panic!("start {name}: {e}"));
        ChildProcess { child: Some(child), log: log.to_path_buf(), name: name.to_string() }
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    /// SIGKILL: no shutdown code runs.
    pub fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            child.kill().unwrap();
            child.wait().unwrap();
        }
    }

    /// SIGTERM, then waits for the exit; returns the exit code.
    pub fn terminate(&mut self, limit: Duration) -> Option<i32> {
        let mut child = self.child.take()?;
        Command::new("kill").arg("-TERM").arg(child.id().to_string()).status().unwrap();
        let started = Instant::now();
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                return status.code();
            }
            if started.elapsed() > limit {
                child.kill().unwrap();
                child.wait().unwrap();
                panic!("{} did not exit within {limit:?} of SIGTERM; log:\n{}", self.name, self.log_text());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The exit status if it has exited.
    pub fn exited(&mut self) -> Option<i32> {
        let child = self.child.as_mut()?;
        child.try_wait().unwrap().map(|s| s.code().unwrap_or(-1))
    }

    /// Waits for the process to exit by itself (within a minute); returns its exit code.
    pub fn wait_exit(&mut self) -> i32 {
        let started = Instant::now();
        loop {
            if let Some(code) = self.exited() {
                return code;
            }
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "{} did not exit; log:\n{}",
                self.name,
                self.log_text()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for ChildProcess {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// The relay: its process, and its metrics listener.
pub struct RelayProcess {
    process: ChildProcess,
    metrics_port: u16,
}

/// The process's controls (`kill9`, `terminate`, `exited`, `log`, ...) are the relay's.
impl std::ops::Deref for RelayProcess {
    type Target = ChildProcess;
    fn deref(&self) -> &ChildProcess {
        &self.process
    }
}

impl std::ops::DerefMut for RelayProcess {
    fn deref_mut(&mut self) -> &mut ChildProcess {
        &mut self.process
    }
}

impl RelayProcess {
    /// Starts `outbox-relay run --config CONFIG`, its stderr going to `log`.
    pub fn start(config: &Path, log: &Path) -> RelayProcess {
        Self::spawn(config, log, TEST_LOG_LEVEL, &[])
    }

    /// Starts `outbox-relay --log-level LOG_LEVEL run --config CONFIG` with `env` added, its
    /// stderr going to `log`. Its metrics listener gets a free port of its own: the
    /// environment overrides the config file's `[metrics] listen`.
    pub fn spawn(config: &Path, log: &Path, log_level: &str, env: &[(&str, &str)]) -> RelayProcess {
        let metrics_port = free_port();
        let mut command = Command::new(super::relay_bin());
        command
            .args(["--log-level", log_level, "run", "--config"])
            .arg(config)
            .env_remove("OUTBOX_RELAY_CONFIG")
            .env("OUTBOX_RELAY__METRICS__LISTEN", format!("127.0.0.1:{metrics_port}"))
            .envs(env.iter().copied());
        RelayProcess { process: ChildProcess::start(command, "outbox-relay", log), metrics_port }
    }

    /// Starts `outbox-relay verify --watch --config CONFIG --listen 127.0.0.1:<free port>` with
    /// `args` added, its stderr going to `log`: watched like a relay, on its own listener.
    pub fn watch(config: &Path, log: &Path, args: &[&str]) -> RelayProcess {
        let metrics_port = free_port();
        let mut command = Command::new(super::relay_bin());
        command
            .args(["--log-level", TEST_LOG_LEVEL, "verify", "--watch", "--listen"])
            .arg(format!("127.0.0.1:{metrics_port}"))
            .args(args)
            .arg("--config")
            .arg(config)
            .env_remove("OUTBOX_RELAY_CONFIG");
        RelayProcess {
            process: ChildProcess::start(command, "outbox-relay verify --watch", log),
            metrics_port,
        }
    }

    pub fn metrics_port(&self) -> u16 {
        self.metrics_port
    }

    /// GET /readyz: (status, body), or None while nothing listens.
    pub fn readyz(&self) -> Option<(u16, String)> {
        get(self.metrics_port, "/readyz")
    }

    /// Waits until /readyz's body starts with `body_prefix` ("active", "standby", "degraded").
    pub async fn wait_ready(&self, body_prefix: &str) {
        let what = self.context(format!("/readyz to say {body_prefix:?}"));
        super::wait_until(what, async || {
            self.readyz().is_some_and(|(_, body)| body.starts_with(body_prefix))
        })
        .await;
    }

    /// GET /metrics: the Prometheus text.
    pub fn scrape(&self) -> String {
        match get(self.metrics_port, "/metrics") {
            Some((200, body)) => body,
            other => panic!("GET /metrics answered {other:?}; relay log:\n{}", self.log_text()),
        }
    }

    /// The current value of `series` (see [`super::http::sample`]), None while unscrapable.
    pub fn metric(&self, series: &str) -> Option<f64> {
        get(self.metrics_port, "/metrics").and_then(|(_, body)| sample(&body, series))
    }

    /// Waits until `series` has a value `ok` accepts; returns it.
    pub async fn wait_metric(&self, series: &str, ok: impl Fn(f64) -> bool) -> f64 {
        let mut last = None;
        let what = self.context(format!("{series} to reach the expected value"));
        super::wait_until(what, async || {
            last = self.metric(series);
            last.is_some_and(&ok)
        })
        .await;
        last.unwrap()
    }

    /// `what`, followed by this relay's log when displayed (when a wait gives up).
    pub fn context(&self, what: String) -> impl fmt::Display + '_ {
        WithLog { what, relay: self }
    }
}

/// Reads the relay's log only when displayed: when a wait gives up, not on every poll.
struct WithLog<'a> {
    what: String,
    relay: &'a RelayProcess,
}

impl fmt::Display for WithLog<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}; relay log ({}):\n{}", self.what, self.relay.log.display(), self.relay.log_text())
    }
}
