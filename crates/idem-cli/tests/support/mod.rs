//! Shared by the process tests (`gateway_process.rs`, `multi_instance.rs`,
//! `outage.rs`, `demo.rs`, `e2e_python.rs`): an upstream that counts
//! executions per `Idempotency-Key`, `idem gateway` child processes
//! (killed on drop), reachability checks for the shared servers, unique
//! names for test data, and best-effort cleanup.
#![allow(dead_code, unreachable_pub)]

use std::collections::HashMap;
use std::fs::File;
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use axum::Router;

// ---------------------------------------------------------------- servers

/// A shared server a test needs: its URL (from the environment or the
/// default), and how to start it (from /work/shared/SERVICES.md).
pub struct Server {
    pub name: &'static str,
    pub env: &'static str,
    pub default_url: &'static str,
    pub start: &'static str,
}

pub const POSTGRES: Server = Server {
    name: "PostgreSQL",
    env: "IDEM_TEST_POSTGRES_URL",
    default_url: "postgres://postgres@127.0.0.1:5432/test",
    start: "pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start",
};

pub const MYSQL: Server = Server {
    name: "MariaDB",
    env: "IDEM_TEST_MYSQL_URL",
    default_url: "mysql://root@127.0.0.1:3306/test",
    start: "start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd",
};

pub const REDIS: Server = Server {
    name: "Redis",
    env: "IDEM_TEST_REDIS_URL",
    default_url: "redis://127.0.0.1:6379/",
    start: "redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save \"\" \
            --appendonly no --dir /var/lib/redis --logfile /var/log/redis/ci.log",
};

impl Server {
    /// The URL to use; panics (the test FAILS) naming the start command
    /// when nothing answers at its address.
    pub fn require(&self) -> String {
        let url = std::env::var(self.env)
            .ok()
            .filter(|u| !u.trim().is_empty())
            .unwrap_or_else(|| self.default_url.to_owned());
        let addr = host_port(&url);
        let reachable = addr
            .to_socket_addrs()
            .ok()
            .and_then(|mut a| a.next())
            .map(|a| TcpStream::connect_timeout(&a, Duration::from_secs(3)));
        match reachable {
            Some(Ok(_)) => url,
            Some(Err(e)) => panic!(
                "{} is not reachable at {addr} ({e}); this test needs it. Start it with:\n  {}\n\
                 (or point {} at another server)",
                self.name, self.start, self.env
            ),
            None => panic!(
                "{}: cannot resolve {addr} from {}={url}; start the server with:\n  {}",
                self.name, self.env, self.start
            ),
        }
    }
}

/// `host:port` of a `scheme://[user[:pw]@]host[:port][/…]` URL.
fn host_port(url: &str) -> String {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let authority = rest.split(['/', '?']).next().unwrap_or(rest);
    let hostport = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    if hostport.contains(':') {
        hostport.to_owned()
    } else {
        let port = match url.split_once("://").map(|(s, _)| s) {
            Some("postgres" | "postgresql") => 5432,
            Some("mysql" | "mariadb") => 3306,
            _ => 6379,
        };
        format!("{hostport}:{port}")
    }
}

/// Adds a query parameter to a URL.
pub fn with_param(url: &str, name: &str, value: &str) -> String {
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}{name}={value}")
}

/// A name no other test run uses: `<label>_<pid>_<micros>` (a plain SQL
/// identifier).
pub fn unique(label: &str) -> String {
    let micros = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() % 1_000_000_000_000);
    format!("{label}_{}_{micros}", std::process::id())
}

/// The standard output and error of a finished child, after asserting
/// that it succeeded (`what` names it in the failure, with both outputs).
pub fn succeeded(out: &std::process::Output, what: &str) -> (String, String) {
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        out.status.success(),
        "{what} failed ({})\nstdout:\n{stdout}\nstderr:\n{stderr}",
        out.status
    );
    (stdout, stderr)
}

/// Runs a cleanup command; a failure is reported, never fatal.
pub fn cleanup(what: &str, program: &str, args: &[&str]) {
    match Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .output()
    {
        Ok(out) if out.status.success() => {}
        Ok(out) => eprintln!(
            "cleanup of {what} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ),
        Err(e) => eprintln!("cleanup of {what}: cannot run {program}: {e}"),
    }
}

/// The trimmed standard output of a command that must succeed.
pub fn stdout_of(program: &str, args: &[&str]) -> String {
    let out = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("cannot run {program}: {e}"));
    assert!(
        out.status.success(),
        "{program} {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// `host` and `port` of a Redis URL.
pub fn redis_host_port(url: &str) -> (String, String) {
    let hp = host_port(url);
    let (host, port) = hp.rsplit_once(':').unwrap_or((&hp, "6379"));
    (host.to_owned(), port.to_owned())
}

/// Best-effort removal of a Redis prefix's keys on `host:port`.
pub fn cleanup_redis_prefix(url: &str, prefix: &str) {
    let hp = host_port(url);
    let (host, port) = hp.rsplit_once(':').unwrap_or((&hp, "6379"));
    cleanup(
        &format!("Redis keys {{{prefix}:*"),
        "redis-cli",
        &[
            "-h",
            host,
            "-p",
            port,
            "EVAL",
            "local n = 0 for _, k in ipairs(redis.call('KEYS', ARGV[1])) do \
             redis.call('DEL', k) n = n + 1 end return n",
            "0",
            &format!("{{{prefix}:*"),
        ],
    );
}

// ------------------------------------------------------------ own servers

/// A `redis-server` child on a loopback port, nothing kept on disk;
/// SIGKILLed on drop.
pub struct RedisProc {
    child: Option<Child>,
    pub port: u16,
    dir: PathBuf,
    extra: Vec<String>,
}

impl RedisProc {
    pub fn start(dir: &Path, port: u16) -> Self {
        Self::start_with(dir, port, &[])
    }

    /// With extra `redis-server` arguments (e.g. `--cluster-enabled yes`).
    pub fn start_with(dir: &Path, port: u16, extra: &[&str]) -> Self {
        let mut r = RedisProc {
            child: None,
            port,
            dir: dir.to_owned(),
            extra: extra.iter().map(|s| (*s).to_owned()).collect(),
        };
        r.restart();
        r
    }

    /// Starts the server (again) on the same port and waits for `PING`.
    pub fn restart(&mut self) {
        if let Err(e) = self.try_restart() {
            panic!("{e}");
        }
    }

    /// As [`RedisProc::restart`], but a server that exits at start (its
    /// port taken meanwhile) is an `Err` naming the reason.
    pub fn try_restart(&mut self) -> Result<(), String> {
        assert!(self.child.is_none(), "already running");
        let program = "redis-server";
        let child = Command::new(program)
            .args([
                "--port",
                &self.port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--daemonize",
                "no",
                "--dir",
                &self.dir.display().to_string(),
            ])
            .args(&self.extra)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot start {program} ({e}); install it with \
                     `apt-get install -y redis-server`"
                )
            });
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if redis_ping(self.port) {
                return Ok(());
            }
            if let Some(Ok(Some(status))) = self.child.as_mut().map(Child::try_wait) {
                self.child = None;
                return Err(format!(
                    "redis-server on port {} exited at start: {status}",
                    self.port
                ));
            }
            assert!(
                Instant::now() < deadline,
                "redis-server on port {} did not answer PING within 10 s",
                self.port
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGKILL, and wait until it is gone.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for RedisProc {
    fn drop(&mut self) {
        self.kill();
    }
}

pub fn redis_ping(port: u16) -> bool {
    use std::io::{Read, Write};
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let Ok(mut s) = std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
    let mut buf = [0u8; 16];
    s.write_all(b"PING\r\n").is_ok()
        && s.read(&mut buf)
            .is_ok_and(|n| buf[..n].starts_with(b"+PONG"))
}

/// Three `redis-server --cluster-enabled yes` primaries on free loopback
/// ports, joined by `redis-cli --cluster create`; killed on drop.
pub struct RedisCluster {
    pub nodes: Vec<RedisProc>,
}

impl RedisCluster {
    pub fn start(dir: &Path) -> Self {
        let mut nodes = Vec::new();
        let mut failures = Vec::new();
        while nodes.len() < 3 {
            let port = free_addr().port();
            // A cluster node also binds its bus on port + 10000, which
            // another test's connection may hold: such a port is skipped,
            // and a node that still loses the race is started elsewhere.
            let bus_free = port
                .checked_add(10000)
                .is_some_and(|bus| std::net::TcpListener::bind(("127.0.0.1", bus)).is_ok());
            if !bus_free || nodes.iter().any(|n: &RedisProc| n.port == port) {
                continue;
            }
            let conf = format!("nodes-{port}.conf");
            let mut node = RedisProc {
                child: None,
                port,
                dir: dir.to_owned(),
                extra: ["--cluster-enabled", "yes", "--cluster-config-file", &conf]
                    .map(str::to_owned)
                    .to_vec(),
            };
            match node.try_restart() {
                Ok(()) => nodes.push(node),
                Err(e) => {
                    failures.push(e);
                    assert!(failures.len() < 5, "no cluster node started: {failures:?}");
                }
            }
        }
        let addrs: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        let out = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&addrs)
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .stdin(Stdio::null())
            .output()
            .expect("run redis-cli (apt-get install -y redis-tools)");
        assert!(
            out.status.success(),
            "redis-cli --cluster create failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let deadline = Instant::now() + Duration::from_secs(30);
        for n in &nodes {
            loop {
                let info = Command::new("redis-cli")
                    .args([
                        "-h",
                        "127.0.0.1",
                        "-p",
                        &n.port.to_string(),
                        "cluster",
                        "info",
                    ])
                    .output()
                    .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
                    .unwrap_or_default();
                if info.contains("cluster_state:ok") && info.contains("cluster_known_nodes:3") {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "node {} did not reach cluster_state:ok within 30 s:\n{info}",
                    n.port
                );
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        Self { nodes }
    }

    /// `redis+cluster://127.0.0.1:p1,127.0.0.1:p2,127.0.0.1:p3`.
    pub fn url(&self) -> String {
        let addrs: Vec<String> = self
            .nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        format!("redis+cluster://{}", addrs.join(","))
    }
}

// --------------------------------------------------------------- upstream

#[derive(serde::Deserialize)]
struct PayQ {
    ms: Option<u64>,
}

#[derive(Default)]
struct Counts {
    total: AtomicUsize,
    per_key: Mutex<HashMap<String, usize>>,
}

/// Serves `app` on a free loopback port; returns its `http://` URL and the
/// server's task (abort it to stop).
pub async fn serve(app: Router) -> (String, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    (url, task)
}

/// An upstream that counts executions per `Idempotency-Key`: `POST /pay`
/// sleeps `?ms=` (default 100) and answers 201 with a body unique to the
/// execution, so a replay can be told from a second run.
pub struct Upstream {
    pub url: String,
    counts: Arc<Counts>,
    task: tokio::task::JoinHandle<()>,
}

impl Upstream {
    pub async fn start() -> Self {
        let counts = Arc::new(Counts::default());
        let app = Router::new()
            .route(
                "/pay",
                post(
                    |State(c): State<Arc<Counts>>, Query(q): Query<PayQ>, h: HeaderMap| async move {
                        let key = h
                            .get("idempotency-key")
                            .and_then(|v| v.to_str().ok())
                            .unwrap_or("")
                            .to_owned();
                        let n = c.total.fetch_add(1, Ordering::SeqCst) + 1;
                        let per = {
                            let mut m = c.per_key.lock().unwrap();
                            let e = m.entry(key.clone()).or_insert(0);
                            *e += 1;
                            *e
                        };
                        tokio::time::sleep(Duration::from_millis(q.ms.unwrap_or(100))).await;
                        let nonce: u64 = rand::random();
                        (
                            StatusCode::CREATED,
                            [
                                ("content-type", "application/json".to_owned()),
                                ("location", format!("/payments/{n}")),
                            ],
                            format!(
                                "{{\"key\":{key:?},\"execution\":{n},\"of_key\":{per},\"nonce\":{nonce}}}"
                            ),
                        )
                    },
                ),
            )
            .with_state(counts.clone());
        let (url, task) = serve(app).await;
        Self { url, counts, task }
    }

    pub fn total(&self) -> usize {
        self.counts.total.load(Ordering::SeqCst)
    }

    pub fn of_key(&self, key: &str) -> usize {
        self.counts
            .per_key
            .lock()
            .unwrap()
            .get(key)
            .copied()
            .unwrap_or(0)
    }

    pub fn per_key(&self) -> HashMap<String, usize> {
        self.counts.per_key.lock().unwrap().clone()
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

// ---------------------------------------------------------------- gateway

/// A free port on 127.0.0.1 (bound, read, closed).
///
/// The port is drawn from 20000–32767, below Linux's ephemeral range
/// (32768–60999): a port the kernel hands out for port 0 is in that range,
/// where any outgoing connection of a parallel test may take it between
/// this check and the gateway's own bind (seen as `Address already in
/// use`). Ports handed out by this process are not handed out again.
pub fn free_addr() -> SocketAddr {
    use std::sync::atomic::{AtomicU64, Ordering};
    static SEQ: AtomicU64 = AtomicU64::new(0);
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    let seed = u64::from(std::process::id()).wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
    for _ in 0..1000 {
        let n = SEQ.fetch_add(1, Ordering::Relaxed);
        let mut x = seed ^ n.wrapping_mul(0xBF58_476D_1CE4_E5B9);
        x ^= x >> 31;
        x = x.wrapping_mul(0x94D0_49BB_1331_11EB);
        x ^= x >> 29;
        let port = 20000 + (x % 12768) as u16;
        let mut given = GIVEN.lock().unwrap();
        if given.contains(&port) {
            continue;
        }
        if let Ok(l) = std::net::TcpListener::bind(("127.0.0.1", port)) {
            given.push(port);
            return l.local_addr().unwrap();
        }
    }
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

/// `idem` with the developer's IDEM_* settings removed.
pub fn idem() -> Command {
    idem_under(&[])
}

/// `idem` run by `wrapper` (e.g. `["prlimit", "--nofile=64:64", "--"]`;
/// none: `idem` itself), with the developer's IDEM_* settings removed.
pub fn idem_under(wrapper: &[&str]) -> Command {
    let mut cmd = match wrapper.split_first() {
        Some((program, args)) => {
            let mut cmd = Command::new(program);
            cmd.args(args).arg(env!("CARGO_BIN_EXE_idem"));
            cmd
        }
        None => Command::new(env!("CARGO_BIN_EXE_idem")),
    };
    for (name, _) in std::env::vars_os() {
        if name.to_string_lossy().starts_with("IDEM_") {
            cmd.env_remove(name);
        }
    }
    cmd.env_remove("RUST_LOG");
    // Tests run many gateways at once: none takes the default admin port
    // unless it asks for one (GatewayProc gives each a free port).
    cmd.env("IDEM_ADMIN_LISTEN", "off");
    cmd.stdin(Stdio::null());
    cmd
}

/// A running `idem gateway` process; SIGKILLed on drop.
pub struct GatewayProc {
    pub child: Child,
    pub addr: SocketAddr,
    /// The admin listener (`--admin-listen`, a free port).
    pub admin: SocketAddr,
    pub log: PathBuf,
}

impl GatewayProc {
    /// Starts `idem gateway --listen <free port> ARGS` and waits until
    /// `/_idem/health` answers 200.
    pub async fn start(dir: &Path, name: &str, args: &[&str]) -> Self {
        Self::start_with(dir, name, args, |_| {}).await
    }

    /// Like [`GatewayProc::start`], after `tweak` (e.g. to set variables).
    pub async fn start_with(
        dir: &Path,
        name: &str,
        args: &[&str],
        tweak: impl FnOnce(&mut Command),
    ) -> Self {
        Self::spawn(idem(), dir, name, args, tweak).await
    }

    /// Runs `cmd` (an `idem` command) as `gateway --listen <free port>
    /// ARGS`, after `tweak`, and waits until it is healthy.
    async fn spawn(
        mut cmd: Command,
        dir: &Path,
        name: &str,
        args: &[&str],
        tweak: impl FnOnce(&mut Command),
    ) -> Self {
        let addr = free_addr();
        let admin = free_addr();
        let log = dir.join(format!("{name}.log"));
        cmd.arg("gateway")
            .arg("--listen")
            .arg(addr.to_string())
            .arg("--admin-listen")
            .arg(admin.to_string())
            .args(args)
            .current_dir(dir)
            .stdout(Stdio::null())
            .stderr(File::create(&log).unwrap());
        tweak(&mut cmd);
        let child = cmd.spawn().expect("spawn idem gateway");
        let mut gw = GatewayProc {
            child,
            addr,
            admin,
            log,
        };
        gw.wait_healthy().await;
        gw
    }

    async fn wait_healthy(&mut self) {
        let c = reqwest::Client::new();
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("gateway exited early ({status}):\n{}", self.logs());
            }
            if let Ok(r) = c.get(self.url("/_idem/health")).send().await {
                if r.status() == 200 {
                    return;
                }
            }
            assert!(
                Instant::now() < deadline,
                "gateway not healthy in time:\n{}",
                self.logs()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    pub fn logs(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Whether the process is still the one started (not exited).
    pub fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    pub fn pid(&self) -> String {
        self.child.id().to_string()
    }

    /// SIGKILL: no chance to clean up.
    pub fn kill9(&mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }

    /// Sends `sig` (e.g. `-TERM`) with `kill`.
    pub fn signal(&self, sig: &str) {
        let ok = Command::new("kill")
            .args([sig, &self.pid()])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill {sig} failed");
    }

    /// Waits for the process to exit by itself.
    pub async fn wait_exit(&mut self, bound: Duration) -> std::process::ExitStatus {
        let deadline = Instant::now() + bound;
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                return s;
            }
            assert!(
                Instant::now() < deadline,
                "gateway did not exit within {bound:?}:\n{}",
                self.logs()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The JSON of `GET /_idem/health` and its status.
    pub async fn health(&self, c: &reqwest::Client) -> (u16, serde_json::Value) {
        let r = c.get(self.url("/_idem/health")).send().await.unwrap();
        let status = r.status().as_u16();
        let body = r.bytes().await.unwrap_or_default();
        (
            status,
            serde_json::from_slice(&body).unwrap_or(serde_json::Value::Null),
        )
    }
}

impl Drop for GatewayProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

// --------------------------------------------------------------- requests

/// One answer, read to the end.
#[derive(Debug, Clone)]
pub struct Got {
    pub status: u16,
    pub replayed: bool,
    pub content_type: Option<String>,
    pub unprotected: bool,
    pub body: String,
}

impl Got {
    pub fn problem_type(&self) -> String {
        serde_json::from_str::<serde_json::Value>(&self.body)
            .ok()
            .and_then(|v| v["type"].as_str().map(str::to_owned))
            .unwrap_or_default()
    }
}

/// POSTs a fixed JSON body with an `Idempotency-Key`.
pub async fn pay(c: &reqwest::Client, url: &str, key: &str) -> Result<Got, reqwest::Error> {
    let r = c
        .post(url)
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(r#"{"amount":10,"currency":"EUR"}"#)
        .send()
        .await?;
    let status = r.status().as_u16();
    let header = |n: &str| {
        r.headers()
            .get(n)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    let replayed = header("idempotent-replayed").as_deref() == Some("true");
    let unprotected = header("idempotency-status").as_deref() == Some("unprotected");
    let content_type = header("content-type");
    let body = r.text().await?;
    Ok(Got {
        status,
        replayed,
        content_type,
        unprotected,
        body,
    })
}

// ------------------------------------------------------------------ conns
// (added by the "conns" helper: connection limits)

impl GatewayProc {
    /// Like [`GatewayProc::start`], with the gateway run by `wrapper`
    /// (e.g. `["prlimit", "--nofile=64:64", "--"]`).
    pub async fn start_under(dir: &Path, name: &str, wrapper: &[&str], args: &[&str]) -> Self {
        Self::spawn(idem_under(wrapper), dir, name, args, |_| {}).await
    }
}

// ------------------------------------------------------------------ ghost
// (added by the "ghost" helper: a store paused mid-claim)

impl RedisProc {
    /// SIGSTOPs this private server until the returned guard is dropped
    /// (SIGCONT). Its connections stay open: what clients send meanwhile
    /// waits unanswered in its socket buffers and runs when it resumes.
    /// Never used on the shared servers.
    pub fn pause(&self) -> RedisPaused {
        let pid = self.child.as_ref().expect("redis-server running").id();
        redis_signal(pid, "-STOP");
        RedisPaused { pid }
    }
}

/// A paused private `redis-server`; dropping it resumes the server.
pub struct RedisPaused {
    pid: u32,
}

impl Drop for RedisPaused {
    fn drop(&mut self) {
        redis_signal(self.pid, "-CONT");
    }
}

fn redis_signal(pid: u32, sig: &str) {
    let ok = Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "kill {sig} {pid} failed");
}

// ----------------------------------------------------------------- health
// (added by the "health" helper: readiness is cached for up to 1 s)

impl GatewayProc {
    /// `GET /_idem/health` polled until it answers `status` (at most 10 s):
    /// readiness is cached for up to 1 s, so a change shows a moment late.
    pub async fn health_until(&self, c: &reqwest::Client, status: u16) -> (u16, serde_json::Value) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let (s, body) = self.health(c).await;
            if s == status || Instant::now() >= deadline {
                return (s, body);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// `mysql://user[:pw]@host[:port]/db` → `mariadb` client arguments.
pub fn mariadb_args(url: &str) -> Vec<String> {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let rest = rest.split('?').next().unwrap_or(rest);
    let (auth, hostdb) = rest.rsplit_once('@').unwrap_or(("root", rest));
    let (user, pw) = auth.split_once(':').unwrap_or((auth, ""));
    let (hostport, db) = hostdb.split_once('/').unwrap_or((hostdb, "test"));
    let (host, port) = hostport.split_once(':').unwrap_or((hostport, "3306"));
    let mut v = vec![
        format!("--host={host}"),
        format!("--port={port}"),
        format!("--user={user}"),
    ];
    if !pw.is_empty() {
        v.push(format!("--password={pw}"));
    }
    v.push(if db.is_empty() {
        "test".into()
    } else {
        db.to_owned()
    });
    v
}
