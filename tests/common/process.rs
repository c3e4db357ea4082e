//! The relay as a child process, as users run it: started, signalled, killed with SIGKILL.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct RelayProcess {
    child: Option<Child>,
    pub log: PathBuf,
}

impl RelayProcess {
    /// Starts `outbox-relay run --config CONFIG`, its stderr going to `log`.
    pub fn start(config: &Path, log: &Path) -> RelayProcess {
        let log_file = std::fs::OpenOptions::new().create(true).append(true).open(log).unwrap();
        let child = Command::new(super::relay_bin())
            .args(["--log-level", "info,outbox_relay=debug", "run", "--config"])
            .arg(config)
            .env_remove("OUTBOX_RELAY_CONFIG")
            .stdout(Stdio::null())
            .stderr(log_file)
            .spawn()
            .expect("start outbox-relay");
        RelayProcess { child: Some(child), log: log.to_path_buf() }
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
                panic!("outbox-relay did not exit within {limit:?} of SIGTERM; log:\n{}", self.log_text());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The exit status if it has exited.
    pub fn exited(&mut self) -> Option<i32> {
        let child = self.child.as_mut()?;
        child.try_wait().unwrap().map(|s| s.code().unwrap_or(-1))
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for RelayProcess {
    fn drop(&mut self) {
        self.kill9();
    }
}
