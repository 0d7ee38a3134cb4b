//! `idem gateway` processes the harness kills, pauses and restarts, each
//! on a fixed port so clients keep their addresses across a restart.

use std::fs::OpenOptions;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::support::{free_addr, idem};

/// One gateway process (SIGKILLed on drop).
pub struct Gateway {
    pub idx: usize,
    pub addr: SocketAddr,
    args: Vec<String>,
    pub log: PathBuf,
    child: Option<Child>,
    /// SIGSTOPped and not yet continued.
    pub stopped: bool,
}

impl Gateway {
    /// A gateway on a free port with `args` after `--listen`; not started.
    pub fn new(dir: &Path, name: &str, idx: usize, args: Vec<String>) -> Self {
        Self {
            idx,
            addr: free_addr(),
            args,
            log: dir.join(format!("{name}.log")),
            child: None,
            stopped: false,
        }
    }

    /// Spawns the process once, its standard error appended to the log.
    fn spawn(&mut self) {
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .unwrap();
        let mut cmd: Command = idem();
        cmd.arg("gateway")
            .arg("--listen")
            .arg(self.addr.to_string())
            .args(&self.args)
            .stdout(Stdio::null())
            .stderr(log);
        self.child = Some(cmd.spawn().expect("spawn idem gateway"));
    }

    /// Starts the process (again) and waits until it listens; a gateway
    /// that exits at start (its store unreachable: it fails fast) is
    /// started again, as a supervisor would, until `bound` passes.
    /// Listening is enough: under faults or on a busy machine the store may
    /// be down or slow for a while, the readiness probe with it, and the
    /// gateway answers 503s meanwhile, as it should.
    pub async fn restart(&mut self, bound: Duration) {
        let deadline = Instant::now() + bound;
        self.spawn();
        loop {
            let child = self.child.as_mut().unwrap();
            if let Ok(Some(_)) = child.try_wait() {
                assert!(
                    Instant::now() < deadline,
                    "gateway {} kept exiting at start for {bound:?}:\n{}",
                    self.idx,
                    self.tail(40)
                );
                tokio::time::sleep(Duration::from_millis(300)).await;
                self.spawn();
                continue;
            }
            if tokio::net::TcpStream::connect(self.addr).await.is_ok() {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "gateway {} not listening within {bound:?}:\n{}",
                self.idx,
                self.tail(40)
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// SIGKILL (no chance to clean up); waits for the exit.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        self.stopped = false;
    }

    /// Sends `sig` (`-STOP`, `-CONT`).
    pub fn signal(&mut self, sig: &str) {
        if let Some(c) = &self.child {
            let _ = Command::new("kill")
                .args([sig, &c.id().to_string()])
                .status();
            self.stopped = sig == "-STOP";
        }
    }

    /// The last `n` lines of the log.
    pub fn tail(&self, n: usize) -> String {
        let log = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        if self.stopped {
            self.signal("-CONT");
        }
        self.kill9();
    }
}
