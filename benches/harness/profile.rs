//! `BENCH_PERF_DIR=dir deploy/local/bench ...`: records a CPU profile of the relay during each
//! backlog drain with `perf record -e cpu-clock -g` (hardware counters are not available on
//! these machines), into `dir/<what>.perf.data`. Read one with
//! `perf report -i dir/replication.perf.data --no-children --sort comm,dso,sym`.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

/// A `perf record` attached to one process; stopped (SIGINT, so it writes its file) on drop.
pub struct Profile(Option<Child>);

impl Profile {
    /// Starts profiling `pid` when `BENCH_PERF_DIR` is set; does nothing otherwise.
    pub fn attach(pid: u32, what: &str) -> Profile {
        let Some(dir) = std::env::var_os("BENCH_PERF_DIR").map(PathBuf::from) else { return Profile(None) };
        std::fs::create_dir_all(&dir).expect("BENCH_PERF_DIR");
        let out = dir.join(format!("{what}.perf.data"));
        // (`BENCH_PERF_CALL_GRAPH=dwarf`: call chains through libc and librdkafka, which keep no
        // frame pointers, at the price of a far larger file)
        let call_graph = std::env::var("BENCH_PERF_CALL_GRAPH").unwrap_or_else(|_| "fp".into());
        let child = Command::new("perf")
            .args([
                "record",
                "-e",
                "cpu-clock",
                "-F",
                "999",
                "--call-graph",
                &call_graph,
                "-p",
                &pid.to_string(),
            ])
            .arg("-o")
            .arg(&out)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("perf record (BENCH_PERF_DIR is set)");
        eprintln!("[bench]   profiling the relay into {}", out.display());
        Profile(Some(child))
    }
}

impl Drop for Profile {
    fn drop(&mut self) {
        if let Some(mut child) = self.0.take() {
            // SAFETY: kill(2) on the pid of a child this process spawned and has not reaped
            unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
            let _ = child.wait();
        }
    }
}
