//! Apache Kafka of one test's own (one node, or a three-node cluster), for faults the shared
//! broker must not suffer: killed with SIGKILL, frozen with SIGSTOP, stopped and restarted on its
//! log directory. Started by `deploy/local/services hold-kafka`, stopped when this value drops.
//!
//! Every node listens on PLAINTEXT (principal ANONYMOUS, a super user of the test broker), SSL,
//! SASL_SSL with SCRAM-SHA-512 (users `relay` and `admin`), and its KRaft controller port; the
//! StandardAuthorizer lets a SCRAM user do only what an ACL allows ([`OwnBroker::allow`]).

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

pub struct OwnBroker {
    holder: Option<Child>,
    env: HashMap<String, String>,
}

/// The listeners of a broker as `OUTBOX_RELAY_TEST_KAFKA*` variables name them.
pub struct Listeners<'a>(pub &'a HashMap<String, String>);

impl Listeners<'_> {
    /// PLAINTEXT bootstrap list.
    pub fn plaintext(&self) -> String {
        self.0["OUTBOX_RELAY_TEST_KAFKA"].clone()
    }

    /// SSL bootstrap list (`localhost:port`, the name the certificate holds).
    pub fn ssl(&self) -> String {
        self.0["OUTBOX_RELAY_TEST_KAFKA_SSL"].clone()
    }

    /// SASL_SSL (SCRAM-SHA-512) bootstrap list.
    pub fn sasl_ssl(&self) -> String {
        self.0["OUTBOX_RELAY_TEST_KAFKA_SASL_SSL"].clone()
    }

    /// The CA that signed every listener's certificate.
    pub fn ca(&self) -> PathBuf {
        PathBuf::from(&self.0["OUTBOX_RELAY_TEST_KAFKA_CA"])
    }

    /// The state directory of the broker (kafka/ under deploy/local's state).
    pub fn dir(&self) -> PathBuf {
        PathBuf::from(&self.0["OUTBOX_RELAY_TEST_KAFKA_DIR"])
    }

    /// The SCRAM password of `user` ("relay" or "admin").
    pub fn password(&self, user: &str) -> String {
        let path = self.dir().join(format!("{user}.password"));
        std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
            .trim()
            .to_string()
    }

    /// Runs a Kafka tool class (e.g. `org.apache.kafka.tools.AclCommand`) against the PLAINTEXT
    /// listener's first node; panics with its output if it fails. Returns its stdout.
    pub fn tool(&self, class: &str, args: &[&str]) -> String {
        let bootstrap = self.plaintext();
        let first = bootstrap.split(',').next().unwrap();
        let out = Command::new(self.dir().join("tool"))
            .arg(class)
            .args(["--bootstrap-server", first])
            .args(args)
            .output()
            .expect("run the Kafka tool");
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(out.status.success(), "{class} {args:?}: {stdout}{}", String::from_utf8_lossy(&out.stderr));
        stdout
    }

    /// ACLs: `principal` (e.g. `User:relay`) may do `operations` on `resource`, which is
    /// `--topic NAME` or `--group NAME` (and `--resource-pattern-type prefixed` for a prefix).
    pub fn allow(&self, principal: &str, operations: &[&str], resource: &[&str]) {
        let mut args = vec!["--add", "--allow-principal", principal];
        args.extend(resource);
        for operation in operations {
            args.extend(["--operation", operation]);
        }
        self.tool("org.apache.kafka.tools.AclCommand", &args);
    }
}

/// The listeners of the shared test broker (`deploy/local/test`'s, or the one the harness
/// started).
pub fn shared() -> Listeners<'static> {
    Listeners(&super::services().kafka_env)
}

impl OwnBroker {
    /// One node, ready (it answered a metadata request).
    pub fn start() -> OwnBroker {
        Self::start_nodes(1)
    }

    /// A cluster of three nodes (replication factor 3, min.insync.replicas = 2), every node
    /// registered.
    pub fn cluster() -> OwnBroker {
        Self::start_nodes(3)
    }

    fn start_nodes(nodes: usize) -> OwnBroker {
        let (holder, env) =
            super::spawn_services("hold-kafka", &[("OUTBOX_KAFKA_NODES", &nodes.to_string())]);
        OwnBroker { holder: Some(holder), env }
    }

    pub fn listeners(&self) -> Listeners<'_> {
        Listeners(&self.env)
    }

    /// The PLAINTEXT bootstrap list.
    pub fn brokers(&self) -> String {
        self.listeners().plaintext()
    }

    /// Node ids, 1-based.
    pub fn nodes(&self) -> Vec<i32> {
        let count = self.brokers().split(',').count() as i32;
        (1..=count).collect()
    }

    fn node_dir(&self, node: i32) -> PathBuf {
        self.listeners().dir().join(format!("node-{node}"))
    }

    /// The PID of `node`'s JVM.
    pub fn pid(&self, node: i32) -> u32 {
        let path = self.node_dir(node).join("pid");
        std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
            .trim()
            .parse()
            .unwrap()
    }

    /// SIGSTOP every node: each keeps its connections and answers nothing.
    pub fn freeze(&self) {
        for node in self.nodes() {
            signal(self.pid(node), "-STOP");
        }
    }

    /// SIGCONT every node.
    pub fn thaw(&self) {
        for node in self.nodes() {
            signal(self.pid(node), "-CONT");
        }
    }

    /// SIGKILL `node` and wait until it is gone.
    pub fn kill9(&self, node: i32) {
        let pid = self.pid(node);
        signal(pid, "-KILL");
        wait_gone(pid);
    }

    /// SIGTERM `node` (a controlled shutdown: it hands its leaderships over) and wait until it
    /// has exited.
    pub fn stop(&self, node: i32) {
        let pid = self.pid(node);
        signal(pid, "-TERM");
        wait_gone(pid);
    }

    /// Starts `node` again on its log directory; returns once it answers a metadata request.
    pub fn restart(&self, node: i32) {
        let status =
            Command::new(self.node_dir(node).join("start")).status().expect("run the node's start script");
        assert!(
            status.success(),
            "Kafka node {node} did not come back: see {}",
            self.node_dir(node).display()
        );
    }
}

pub fn signal(pid: u32, sig: &str) {
    // a node a test killed is gone: nothing to signal
    let _ = Command::new("kill").arg(sig).arg(pid.to_string()).stderr(Stdio::null()).status();
}

fn wait_gone(pid: u32) {
    for _ in 0..600 {
        let alive = Command::new("kill")
            .args(["-0", &pid.to_string()])
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !alive {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    panic!("process {pid} did not exit within 30 s");
}

impl Drop for OwnBroker {
    fn drop(&mut self) {
        // SIGKILL first: a test broker's data is thrown away, a controlled shutdown only costs time
        for node in self.nodes() {
            signal(self.pid(node), "-KILL");
        }
        if let Some(mut holder) = self.holder.take() {
            drop(holder.stdin.take());
            let _ = holder.wait();
        }
    }
}
