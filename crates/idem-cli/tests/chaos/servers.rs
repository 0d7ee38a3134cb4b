//! The store servers the harness restarts: PostgreSQL, MariaDB and
//! `redis-server`, each its own, on a free loopback port with its data in
//! a temporary folder — never the machine's shared servers.
//!
//! As in crates/idem-sql/tests/tls_servers/mod.rs, each server runs under
//! a small `bash` keeper that reads its standard input, a pipe from this
//! process: when the test binary exits, however it ends, the pipe closes
//! and the keeper kills the server and removes its folder. PostgreSQL runs
//! as the OS user `postgres` (`setpriv`; initdb and postgres refuse root).
//!
//! A restart kills the server (SIGKILL; PostgreSQL: SIGQUIT, its immediate
//! shutdown, so no backend outlives the postmaster) and starts it again
//! on the same port and data: a crash and a recovery.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::support::free_addr;

/// How long a start (set-up steps included) may take.
pub const START_BOUND: Duration = Duration::from_secs(180);

/// Which store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreKind {
    Postgres,
    Mariadb,
    Redis,
    Sqlite,
}

impl StoreKind {
    /// The store's name in tables and key prefixes.
    pub fn name(self) -> &'static str {
        match self {
            StoreKind::Postgres => "postgres",
            StoreKind::Mariadb => "mariadb",
            StoreKind::Redis => "redis",
            StoreKind::Sqlite => "sqlite",
        }
    }
}

/// A running (or stopped, between a kill and its start) store server.
pub struct StoreServer {
    pub kind: StoreKind,
    pub port: u16,
    dir: PathBuf,
    command: Vec<String>,
    /// Signal that stops the server (`-KILL`, or `-QUIT` for PostgreSQL).
    stop_signal: &'static str,
    ready: &'static str,
    keeper: Option<Child>,
}

/// Fails naming the Debian package when `program` is not installed.
pub fn need(program: &str, package: &str) {
    let found = Path::new(program).is_absolute() && Path::new(program).exists()
        || Command::new("sh")
            .args(["-c", &format!("command -v {program}")])
            .stdout(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
    assert!(
        found,
        "the chaos test needs {program}; install it with `apt-get install -y {package}`"
    );
}

/// A fresh folder, removed by the keeper (or by [`StoreServer`]'s drop).
fn fresh_dir(what: &str) -> PathBuf {
    tempfile::Builder::new()
        .prefix(&format!("idem-chaos-{what}-"))
        .tempdir()
        .expect("temporary folder")
        .keep()
}

/// Runs a set-up step to its end, or fails naming it with its output.
fn run(cmd: &mut Command) {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("cannot run {:?}: {e}", cmd.get_program()));
    assert!(
        out.status.success(),
        "{cmd:?} failed ({}):\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The newest `/usr/lib/postgresql/<version>/bin`.
fn postgres_bin() -> PathBuf {
    let mut dirs: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let v = e.file_name().to_string_lossy().parse::<u32>().ok()?;
            Some((v, e.path().join("bin")))
        })
        .filter(|(_, p)| p.join("postgres").exists())
        .collect();
    dirs.sort();
    dirs.pop().map(|(_, p)| p).unwrap_or_else(|| {
        panic!(
            "the chaos test needs PostgreSQL's initdb and postgres under \
             /usr/lib/postgresql/<version>/bin; install them with `apt-get install -y postgresql`"
        )
    })
}

/// `program` run as the OS user `user`.
fn as_user(user: &str, program: &Path) -> Command {
    let mut c = Command::new("setpriv");
    c.args([
        &format!("--reuid={user}"),
        &format!("--regid={user}"),
        "--init-groups",
    ])
    .arg(program);
    c
}

impl StoreServer {
    /// Initialises and starts a PostgreSQL cluster (trust, user `postgres`).
    pub fn postgres() -> Self {
        need("setpriv", "util-linux");
        let bin = postgres_bin();
        let dir = fresh_dir("postgres");
        let data = dir.join("data");
        run(Command::new("chown")
            .arg("-R")
            .arg("postgres:postgres")
            .arg(&dir));
        run(as_user("postgres", &bin.join("initdb"))
            .arg("-D")
            .arg(&data)
            .args(["-U", "postgres", "-A", "trust", "--no-sync", "-E", "UTF8"]));
        let port = free_addr().port();
        let mut command = vec![
            "setpriv".to_owned(),
            "--reuid=postgres".into(),
            "--regid=postgres".into(),
            "--init-groups".into(),
            bin.join("postgres").display().to_string(),
            "-D".into(),
            data.display().to_string(),
            "-p".into(),
            port.to_string(),
        ];
        for (k, v) in [
            ("listen_addresses", "127.0.0.1".to_owned()),
            ("unix_socket_directories", dir.display().to_string()),
            ("fsync", "off".to_owned()),
            ("max_connections", "200".to_owned()),
            ("shared_buffers", "16MB".to_owned()),
        ] {
            command.push("-c".into());
            command.push(format!("{k}={v}"));
        }
        let mut s = Self {
            kind: StoreKind::Postgres,
            port,
            dir,
            command,
            stop_signal: "-QUIT",
            ready: "database system is ready to accept connections",
            keeper: None,
        };
        s.start();
        s
    }

    /// Installs and starts a MariaDB server with user `idem@'%'` (no
    /// password) and database `test`.
    pub fn mariadb() -> Self {
        need("mariadb-install-db", "mariadb-server");
        need("mariadbd", "mariadb-server");
        need("mariadb", "mariadb-client");
        let dir = fresh_dir("mariadb");
        let data = dir.join("data");
        run(Command::new("mariadb-install-db")
            .arg("--no-defaults")
            .arg(format!("--datadir={}", data.display()))
            .args([
                "--user=root",
                "--auth-root-authentication-method=socket",
                "--skip-test-db",
            ]));
        let port = free_addr().port();
        let socket = dir.join("mariadb.sock");
        let command = vec![
            "mariadbd".to_owned(),
            "--no-defaults".into(),
            "--user=root".into(),
            format!("--datadir={}", data.display()),
            format!("--socket={}", socket.display()),
            format!("--pid-file={}", dir.join("mariadbd.pid").display()),
            format!("--port={port}"),
            "--bind-address=127.0.0.1".into(),
            "--skip-name-resolve".into(),
            "--innodb-buffer-pool-size=32M".into(),
            "--innodb-log-file-size=16M".into(),
            "--skip-log-bin".into(),
            // Commits reach the OS at once (a killed server keeps them) and
            // the disk once a second: a busy disk's fsync latency would
            // otherwise time out every store call. Crashes here are
            // process crashes, not power losses.
            "--innodb-flush-log-at-trx-commit=2".into(),
            "--max-connections=300".into(),
            // Connections reset by the proxies mid-handshake count as
            // connect errors; past this many MariaDB blocks the host.
            "--max-connect-errors=1000000000".into(),
        ];
        let mut s = Self {
            kind: StoreKind::Mariadb,
            port,
            dir,
            command,
            stop_signal: "-KILL",
            ready: "ready for connections",
            keeper: None,
        };
        s.start();
        run(Command::new("mariadb")
            .arg("--no-defaults")
            .arg(format!("--socket={}", socket.display()))
            .args(["-uroot", "-e"])
            .arg(
                "CREATE USER idem@'%'; GRANT ALL ON *.* TO idem@'%'; \
                 CREATE DATABASE test;",
            ));
        s
    }

    /// Starts `redis-server` with AOF on and `appendfsync always`: a
    /// killed server keeps every record it acknowledged.
    pub fn redis() -> Self {
        need("redis-server", "redis-server");
        let dir = fresh_dir("redis");
        let port = free_addr().port();
        let command = [
            "redis-server",
            "--port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "yes",
            "--appendfsync",
            "always",
            "--dir",
            &dir.display().to_string(),
        ]
        .map(str::to_owned)
        .to_vec();
        let mut s = Self {
            kind: StoreKind::Redis,
            port,
            dir,
            command,
            stop_signal: "-KILL",
            ready: "Ready to accept connections",
            keeper: None,
        };
        s.start();
        s
    }

    /// The server's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("server.log")).unwrap_or_default()
    }

    /// Starts the server under a new keeper and waits until its log says
    /// it is ready (after the ready lines of earlier starts).
    pub fn start(&mut self) {
        assert!(self.keeper.is_none(), "already running");
        let seen = self.log().matches(self.ready).count();
        let _ = std::fs::remove_file(self.dir.join("server.pid"));
        let script = r#"dir=$1; shift
"$@" >>"$dir/server.log" 2>&1 &
p=$!
echo "$p" >"$dir/server.pid"
read -r line || true
if [ "$line" != restart ]; then
  kill -9 "$p" 2>/dev/null
  wait "$p"
  rm -rf "$dir"
fi"#;
        let child = Command::new("bash")
            .arg("-c")
            .arg(script)
            .arg("keeper")
            .arg(&self.dir)
            .args(&self.command)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {:?} under bash: {e}", self.command));
        self.keeper = Some(child);
        let deadline = Instant::now() + START_BOUND;
        loop {
            let log = self.log();
            if log.matches(self.ready).count() > seen {
                return;
            }
            if let Some(pid) = self.pid() {
                if !Path::new(&format!("/proc/{pid}")).exists() {
                    panic!(
                        "{} exited at start; its log ({}):\n{log}",
                        self.command[0],
                        self.dir.display()
                    );
                }
            }
            assert!(
                Instant::now() < deadline,
                "{} was not ready within {START_BOUND:?}; its log:\n{log}",
                self.command[0]
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The running server's process id (from the keeper).
    fn pid(&self) -> Option<u32> {
        std::fs::read_to_string(self.dir.join("server.pid"))
            .ok()?
            .trim()
            .parse()
            .ok()
    }

    /// Kills the server (as a crash) and waits until it is gone.
    pub fn kill(&mut self) {
        let Some(mut keeper) = self.keeper.take() else {
            return;
        };
        if let Some(pid) = self.pid() {
            let _ = Command::new("kill")
                .args([self.stop_signal, &pid.to_string()])
                .status();
            let deadline = Instant::now() + Duration::from_secs(30);
            while Path::new(&format!("/proc/{pid}")).exists() && Instant::now() < deadline {
                // A zombie until the keeper reaps it: look at its state.
                let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
                if stat.contains(") Z ") {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        if let Some(mut stdin) = keeper.stdin.take() {
            use std::io::Write;
            let _ = stdin.write_all(b"restart\n");
        }
        let _ = keeper.wait();
        if self.kind == StoreKind::Postgres {
            // The backends go with the postmaster after SIGQUIT; wait for
            // the shared memory to be free (postmaster.pid gone or stale).
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        if let Some(mut keeper) = self.keeper.take() {
            // EOF: the keeper kills the server and removes the folder.
            drop(keeper.stdin.take());
            let _ = keeper.wait();
        } else {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}
