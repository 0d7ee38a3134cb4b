//! Shared by the Redis test binaries: connecting to the shared server,
//! starting private `redis-server` processes (killed by PID), and a raw
//! connection for poking at records.

#![allow(dead_code, unreachable_pub)]

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use idem_redis::{RedisOptions, RedisStore};

/// How to start the shared Redis when it is down (SERVICES.md).
pub const START_REDIS: &str = "redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 \
     --save \"\" --appendonly no --dir /var/lib/redis --logfile /var/log/redis/ci.log";

/// The shared server's URL: `IDEM_TEST_REDIS_URL`, default `redis://127.0.0.1:6379/`.
pub fn redis_url() -> String {
    std::env::var("IDEM_TEST_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379/".to_owned())
}

/// A key prefix for this test process, so runs never see each other's keys.
pub fn run_prefix() -> &'static str {
    static PREFIX: OnceLock<String> = OnceLock::new();
    PREFIX.get_or_init(|| format!("idem-test-{}", idem_testkit::support::random_hex(12)))
}

/// Options for tests: this run's prefix, and ended records dropped by Redis
/// after 30 s (long enough for every check, short enough to leave no litter).
pub fn test_options() -> RedisOptions {
    RedisOptions::default()
        .with_key_prefix(run_prefix())
        .with_keep_expired(Duration::from_secs(30))
}

/// [`test_options`] with a prefix of one check's own (this run's prefix
/// and a random suffix), for the conformance suite: a check's
/// `purge_expired` then cannot remove another check's ended claims, which
/// a listing check expects to see.
pub fn check_options() -> RedisOptions {
    test_options().with_key_prefix(format!(
        "{}-{}",
        run_prefix(),
        idem_testkit::support::random_hex(8)
    ))
}

/// Connects to `url` or fails the test, naming how to start the server.
pub async fn connect(url: &str, options: RedisOptions) -> RedisStore {
    match RedisStore::connect_with(url, options).await {
        Ok(s) => s,
        Err(e) => panic!(
            "cannot connect to Redis at {url}: {e} ({e:?}).\n\
             Start the shared server with: {START_REDIS}\n\
             (or point IDEM_TEST_REDIS_URL at a running Redis 7)"
        ),
    }
}

/// The shared server's store with this run's prefix.
pub async fn shared_store() -> RedisStore {
    connect(&redis_url(), test_options()).await
}

/// A plain multiplexed connection (no idem logic) to `url`.
pub async fn raw(url: &str) -> redis::aio::MultiplexedConnection {
    let client = redis::Client::open(url).unwrap_or_else(|e| panic!("bad URL {url}: {e}"));
    client
        .get_multiplexed_async_connection()
        .await
        .unwrap_or_else(|e| panic!("cannot connect to {url}: {e}. Start it with: {START_REDIS}"))
}

/// Fails the test unless `program` is on the PATH.
pub fn need_program(program: &str) {
    let found = Command::new(program)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok();
    assert!(
        found,
        "{program} is not installed; install it with: apt-get install -y redis-server redis-tools"
    );
}

/// A loopback TCP port nobody listens on right now (nor on `port + 10000`,
/// the Cluster bus port).
pub fn free_port() -> u16 {
    for _ in 0..200 {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind an ephemeral port");
        let port = l.local_addr().expect("local addr").port();
        if port >= 55_000 {
            continue;
        }
        if TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok() {
            return port;
        }
    }
    panic!("no free loopback port pair found");
}

/// A private `redis-server` this test started; killed by its PID on drop.
pub struct Server {
    pub port: u16,
    child: Option<Child>,
    dir: PathBuf,
    /// The CA file when the server speaks TLS only.
    tls_ca: Option<PathBuf>,
}

impl Server {
    /// Starts `redis-server` on `port` (keeping nothing on disk) with its
    /// files in `dir`, plus `extra` arguments, and waits until it answers.
    pub fn start(port: u16, dir: &Path, extra: &[&str]) -> Self {
        Self::spawn(port, dir, extra, None)
    }

    /// Starts `redis-server` speaking only TLS on `port`, with a fresh CA
    /// and a server certificate for 127.0.0.1 signed by it (made by
    /// `openssl`); returns the server and the CA certificate (PEM).
    pub fn start_tls(port: u16, dir: &Path) -> (Self, Vec<u8>) {
        need_program("openssl");
        let p = |name: &str| dir.join(name).to_str().expect("utf-8").to_owned();
        let (ca, ca_key, cert, key, csr, ext) = (
            p("ca.pem"),
            p("ca.key"),
            p("cert.pem"),
            p("key.pem"),
            p("cert.csr"),
            p("ext.cnf"),
        );
        std::fs::write(
            &ext,
            "basicConstraints=CA:FALSE\nsubjectAltName=IP:127.0.0.1\n\
             keyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n",
        )
        .expect("write ext.cnf");
        let steps: [&[&str]; 3] = [
            &[
                "req",
                "-x509",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-days",
                "1",
                "-subj",
                "/CN=idem test CA",
                "-keyout",
                &ca_key,
                "-out",
                &ca,
            ],
            &[
                "req",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-subj",
                "/CN=127.0.0.1",
                "-keyout",
                &key,
                "-out",
                &csr,
            ],
            &[
                "x509",
                "-req",
                "-in",
                &csr,
                "-CA",
                &ca,
                "-CAkey",
                &ca_key,
                "-CAcreateserial",
                "-days",
                "1",
                "-extfile",
                &ext,
                "-out",
                &cert,
            ],
        ];
        for args in steps {
            run_ok(
                Command::new("openssl").args(args),
                &format!("openssl {args:?}"),
            );
        }
        let port_s = port.to_string();
        let extra = [
            "--port",
            "0",
            "--tls-port",
            &port_s,
            "--tls-cert-file",
            &cert,
            "--tls-key-file",
            &key,
            "--tls-ca-cert-file",
            &ca,
            "--tls-auth-clients",
            "no",
        ];
        let server = Self::spawn(port, dir, &extra, Some(PathBuf::from(&ca)));
        (server, std::fs::read(&ca).expect("read the CA certificate"))
    }

    fn spawn(port: u16, dir: &Path, extra: &[&str], tls_ca: Option<PathBuf>) -> Self {
        need_program("redis-server");
        need_program("redis-cli");
        let port_s = port.to_string();
        let log = dir.join(format!("redis-{port}.log"));
        let mut args = vec![
            "--port",
            &port_s,
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--daemonize",
            "no",
        ];
        args.extend_from_slice(extra);
        let dir_s = dir.to_str().expect("utf-8 temp dir");
        let log_s = log.to_str().expect("utf-8 log path");
        args.extend_from_slice(&["--dir", dir_s, "--logfile", log_s]);
        let child = Command::new("redis-server")
            .args(&args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn redis-server");
        let server = Self {
            port,
            child: Some(child),
            dir: dir.to_owned(),
            tls_ca,
        };
        server.wait_until_up();
        server
    }

    /// The server's PID.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    /// `redis://127.0.0.1:<port>/`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// Runs `redis-cli -p <port> <args>` and returns its output.
    pub fn cli(&self, args: &[&str]) -> String {
        match &self.tls_ca {
            None => cli(self.port, args),
            Some(ca) => {
                let ca = ca.to_str().expect("utf-8");
                let mut all = vec!["--tls", "--cacert", ca];
                all.extend_from_slice(args);
                cli(self.port, &all)
            }
        }
    }

    fn wait_until_up(&self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if self.cli(&["ping"]).trim() == "PONG" {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let log = std::fs::read_to_string(self.dir.join(format!("redis-{}.log", self.port)))
            .unwrap_or_default();
        panic!(
            "redis-server on port {} did not answer within 10 s; its log:\n{log}",
            self.port
        );
    }

    /// Kills the server (SIGKILL by PID) and reaps it.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Runs `redis-cli -h 127.0.0.1 -p <port> <args>`; its stdout.
pub fn cli(port: u16, args: &[&str]) -> String {
    let out = Command::new("redis-cli")
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run redis-cli");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Runs `cmd` (stdin closed) and fails the test unless it succeeds;
/// returns its output.
pub fn run_ok(cmd: &mut Command, what: &str) -> std::process::Output {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("run {what}: {e}"));
    assert!(
        out.status.success(),
        "{what} failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// A task that waits (up to 20 s) for a change of `key` and returns how
/// long it waited.
pub fn spawn_waiter(
    store: &RedisStore,
    scope: &idem_core::Scope,
    key: &idem_core::IdempotencyKey,
) -> tokio::task::JoinHandle<Duration> {
    use idem_core::Store;
    let (store, scope, key) = (store.clone(), scope.clone(), key.clone());
    tokio::spawn(async move {
        let t = Instant::now();
        store
            .wait_for_change(&scope, &key, Duration::from_secs(20))
            .await
            .expect("wait");
        t.elapsed()
    })
}
