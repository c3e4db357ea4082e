//! A Kafka-protocol broker (tansu, in memory) of one test's own, for faults the shared one must
//! not suffer: frozen with SIGSTOP, or reachable only through a proxy it advertises.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

use super::http::free_port;
use super::repo_root;

/// The tansu binary deploy/local found or installed.
pub fn tansu_bin() -> PathBuf {
    let out = Command::new("bash")
        .arg("-c")
        .arg("source deploy/local/lib.sh && tansu_bin")
        .current_dir(repo_root())
        .output()
        .unwrap();
    PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
}

pub struct OwnBroker {
    child: Child,
    pub port: u16,
}

impl OwnBroker {
    /// Starts a broker on a free port, advertising `advertised` (host:port) when given, else
    /// itself.
    pub fn start(advertised: Option<&str>) -> OwnBroker {
        let port = free_port();
        let advertised = advertised.map(String::from).unwrap_or_else(|| format!("127.0.0.1:{port}"));
        let child = Command::new(tansu_bin())
            .args(["broker", "--listener-url", &format!("tcp://127.0.0.1:{port}")])
            .args(["--advertised-listener-url", &format!("tcp://{advertised}")])
            .args(["--storage-engine", "memory://tansu/"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start tansu");
        OwnBroker { child, port }
    }

    pub fn brokers(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Waits until the broker accepts connections.
    pub async fn wait_listening(&self) {
        super::wait_until("the test's broker to listen", async || {
            std::net::TcpStream::connect(("127.0.0.1", self.port)).is_ok()
        })
        .await;
    }

    /// SIGSTOP: the broker keeps its connections and answers nothing.
    pub fn freeze(&self) {
        signal(self.child.id(), "-STOP");
    }

    /// SIGCONT.
    pub fn thaw(&self) {
        signal(self.child.id(), "-CONT");
    }
}

fn signal(pid: u32, sig: &str) {
    let status = Command::new("kill").arg(sig).arg(pid.to_string()).status().unwrap();
    assert!(status.success(), "kill {sig} {pid}");
}

impl Drop for OwnBroker {
    fn drop(&mut self) {
        self.thaw();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
