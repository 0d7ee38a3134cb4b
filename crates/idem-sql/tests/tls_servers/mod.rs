//! Throw-away TLS servers for the TLS tests, started on loopback by the test
//! binary itself (never the machine's shared servers): PostgreSQL with
//! `ssl=on` and a `pg_hba.conf` that refuses plain TCP, MariaDB with
//! `--require-secure-transport=ON`, and `redis-server` on a TLS port only.
//! Each has its own free port, its own temporary folder (data, socket, log,
//! certificates from [`idem_testkit::pki`]) and is started once per test
//! binary ([`postgres`], [`mariadb`], [`redis`], [`redis_mtls`],
//! [`redis_cluster`]: a
//! `OnceLock`), within [`START_BOUND`], or the test fails naming the
//! command and showing the server's log.
//!
//! The server runs under a small `bash` keeper that reads its standard
//! input, a pipe from this process: when the test binary exits, however it
//! ends, the pipe closes and the keeper stops the server and removes its
//! folder.
//!
//! Shared by crates/idem-sql/tests/tls_tests.rs,
//! crates/idem-redis/tests/tls_tests.rs and
//! crates/idem-gateway/tests/store_tls.rs (by `#[path]`), with the checks
//! of a refused connection ([`chain`], [`expect_connect_error`]); it needs
//! only std, `tempfile`, `idem-core` and `idem-testkit` (feature `pki`).

#![allow(dead_code, unreachable_pub)]

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use idem_testkit::pki::{TestCa, Usage};

/// The error and all its sources, joined by `: `.
pub fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut next = e.source();
    while let Some(e) = next {
        s.push_str(": ");
        s.push_str(&e.to_string());
        next = e.source();
    }
    s
}

/// `got` failed at connect (not by a configuration error or a timeout),
/// and its error chain holds every one of `needles`; returns the chain.
pub fn expect_connect_error<T>(
    what: &str,
    got: Result<T, idem_core::StoreError>,
    needles: &[&str],
) -> String {
    let e = match got {
        Ok(_) => panic!("{what}: connected, but must fail"),
        Err(e) => e,
    };
    assert!(
        matches!(
            e,
            idem_core::StoreError::Unavailable {
                phase: idem_core::Phase::Connect,
                ..
            }
        ),
        "{what}: not a connect error: {e:?}"
    );
    let text = chain(&e);
    for n in needles {
        assert!(text.contains(n), "{what}: {n:?} not in {text:?}");
    }
    text
}

/// How long a server (its set-up steps included) may take to start.
pub const START_BOUND: Duration = Duration::from_secs(20);

/// The certificate files of one server, in its folder. The server's
/// certificate names only `localhost`: a URL with host `127.0.0.1` is "the
/// wrong host" for a check of the name.
#[derive(Debug)]
pub struct TlsFiles {
    /// The server's folder.
    pub dir: PathBuf,
    /// The CA that signed the server's and the client's certificates.
    pub ca: PathBuf,
    /// Another CA, which signed nothing here.
    pub other_ca: PathBuf,
    /// The server's certificate (for `localhost`) and key.
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
    /// A client certificate (common name `client_name`) and key.
    pub client_cert: PathBuf,
    pub client_key: PathBuf,
}

impl TlsFiles {
    fn new(dir: &Path, client_name: &str) -> Self {
        Self::for_names(dir, &["localhost"], client_name)
    }

    /// A server certificate for `names` (a Redis Cluster announces its
    /// nodes by IP address, so its certificate must name that).
    fn for_names(dir: &Path, names: &[&str], client_name: &str) -> Self {
        let ca = TestCa::new("idem TLS test CA");
        let other = TestCa::new("idem TLS test: another CA");
        let (server_cert, server_key) = ca.issue(names, Usage::Server).write(dir, "server");
        let (client_cert, client_key) =
            ca.issue(&[client_name], Usage::Client).write(dir, "client");
        Self {
            dir: dir.to_owned(),
            ca: ca.write(dir, "ca.pem"),
            other_ca: other.write(dir, "other-ca.pem"),
            server_cert,
            server_key,
            client_cert,
            client_key,
        }
    }

    /// `path` as a URL parameter value (the test folders hold no `&`, `#`
    /// or white space).
    pub fn param(path: &Path) -> String {
        path.display().to_string()
    }
}

/// A running TLS server.
#[derive(Debug)]
pub struct TlsServer {
    /// Its TCP port on 127.0.0.1.
    pub port: u16,
    /// Its certificates.
    pub files: TlsFiles,
    /// The keeper; its standard input stays open as long as this process.
    keeper: Mutex<Child>,
}

/// PostgreSQL 15+ (`/usr/lib/postgresql/*/bin`), run as the `postgres` OS
/// user: `ssl=on`; `pg_hba.conf` lets user `postgres` in over TLS without a
/// password, refuses plain TCP, and asks for a client certificate (common
/// name `postgres`) for the database `certdb`.
pub fn postgres() -> &'static TlsServer {
    static S: OnceLock<Result<TlsServer, String>> = OnceLock::new();
    once(&S, start_postgres)
}

/// MariaDB (`mariadbd`) with `--require-secure-transport=ON`: user `idem`
/// (no password, `REQUIRE SSL`), user `idem_x509` (`REQUIRE X509`: a client
/// certificate signed by the CA), user `idem_plain` (no TLS requirement of
/// its own), database `test`.
pub fn mariadb() -> &'static TlsServer {
    static S: OnceLock<Result<TlsServer, String>> = OnceLock::new();
    once(&S, start_mariadb)
}

/// `redis-server` on a TLS port only, `--tls-auth-clients no`.
pub fn redis() -> &'static TlsServer {
    static S: OnceLock<Result<TlsServer, String>> = OnceLock::new();
    once(&S, || start_redis("no"))
}

/// `redis-server` on a TLS port only, `--tls-auth-clients yes`: clients
/// must show a certificate signed by the CA.
pub fn redis_mtls() -> &'static TlsServer {
    static S: OnceLock<Result<TlsServer, String>> = OnceLock::new();
    once(&S, || start_redis("yes"))
}

/// A Redis Cluster of three TLS-only primaries (`--tls-cluster yes`, the
/// cluster bus over TLS too), its certificate for `127.0.0.1` and
/// `localhost`, `--tls-auth-clients no`, made with `redis-cli --tls
/// --cluster create` and up (`cluster_state:ok`) before this returns.
pub fn redis_cluster() -> &'static TlsCluster {
    static S: OnceLock<Result<TlsCluster, String>> = OnceLock::new();
    once(&S, start_redis_cluster)
}

/// A running TLS Redis Cluster.
#[derive(Debug)]
pub struct TlsCluster {
    /// The primaries' TLS ports on 127.0.0.1.
    pub ports: Vec<u16>,
    /// The certificates (in the first node's folder).
    pub files: TlsFiles,
    /// One keeper per node.
    keepers: Mutex<Vec<Child>>,
}

fn start_redis_cluster() -> TlsCluster {
    let deadline = Instant::now() + START_BOUND;
    need("redis-server", "redis-server");
    need("redis-cli", "redis-tools");
    let first = fresh_dir("redis-cluster");
    let files = TlsFiles::for_names(&first, &["127.0.0.1", "localhost"], "idem-client");
    let mut ports: Vec<u16> = Vec::new();
    while ports.len() < 3 {
        // The cluster bus listens on port + 10000.
        let port = free_port();
        if port < 55_000 && !ports.contains(&port) {
            ports.push(port);
        }
    }
    let mut keepers = Vec::new();
    for (i, port) in ports.iter().enumerate() {
        let dir = if i == 0 {
            first.clone()
        } else {
            fresh_dir("redis-cluster")
        };
        let mut server = redis_command(&files, *port, "no", &dir);
        server.args(["--cluster-enabled", "yes", "--tls-cluster", "yes"]);
        // The cluster bus always checks the connecting node's certificate:
        // the nodes show the client certificate (clientAuth) when they dial.
        server
            .arg("--tls-client-cert-file")
            .arg(&files.client_cert)
            .arg("--tls-client-key-file")
            .arg(&files.client_key);
        server
            .arg("--cluster-config-file")
            .arg(dir.join("nodes.conf"));
        keepers.push(keep(server, &dir, "Ready to accept connections", deadline));
    }
    let mut create = Command::new("redis-cli");
    create.arg("--tls").arg("--cacert").arg(&files.ca);
    create.args(["--cluster", "create"]);
    create.args(ports.iter().map(|p| format!("127.0.0.1:{p}")));
    create.args(["--cluster-replicas", "0", "--cluster-yes"]);
    run(create, deadline);
    loop {
        let out = Command::new("redis-cli")
            .arg("--tls")
            .arg("--cacert")
            .arg(&files.ca)
            .args([
                "-h",
                "127.0.0.1",
                "-p",
                &ports[0].to_string(),
                "cluster",
                "info",
            ])
            .output()
            .expect("redis-cli cluster info");
        if String::from_utf8_lossy(&out.stdout).contains("cluster_state:ok") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the TLS Redis Cluster on {ports:?} did not reach cluster_state:ok within {START_BOUND:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    TlsCluster {
        ports,
        files,
        keepers: Mutex::new(keepers),
    }
}

/// The server in `cell`, started by `start` the first time; a start that
/// failed is not tried again: every later test fails with its message.
fn once<T>(cell: &'static OnceLock<Result<T, String>>, start: impl FnOnce() -> T) -> &'static T {
    let got = cell.get_or_init(|| {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(start)).map_err(|p| {
            p.downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                .unwrap_or_else(|| "the server did not start".to_owned())
        })
    });
    match got {
        Ok(t) => t,
        Err(m) => panic!("{m}"),
    }
}

/// A port that was free a moment ago on 127.0.0.1.
fn free_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
    l.local_addr().expect("local addr").port()
}

/// A fresh folder, kept after this process (the keeper removes it).
fn fresh_dir(what: &str) -> PathBuf {
    tempfile::Builder::new()
        .prefix(&format!("idem-tls-{what}-"))
        .tempdir()
        .expect("temporary folder")
        .keep()
}

/// `cmd` as a shell-like line, for messages.
fn shown(cmd: &Command) -> String {
    let mut s = cmd.get_program().to_string_lossy().into_owned();
    for a in cmd.get_args() {
        s.push(' ');
        s.push_str(&a.to_string_lossy());
    }
    s
}

/// Fails naming the Debian package when `program` is not installed.
fn need(program: &str, package: &str) {
    let found = Path::new(program).is_absolute() && Path::new(program).exists()
        || Command::new("sh")
            .args(["-c", &format!("command -v {program}")])
            .stdout(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
    assert!(
        found,
        "the TLS tests need {program}; install the Debian package {package} \
         (scripts/test.sh does: need_program)"
    );
}

/// Runs a set-up step to its end within `deadline`, or fails naming it.
fn run(mut cmd: Command, deadline: Instant) {
    let line = shown(&cmd);
    let out_file = tempfile::NamedTempFile::new().expect("step log");
    let out_path = out_file.path().to_owned();
    let out = out_file.reopen().expect("step log");
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(out.try_clone().expect("dup"))
        .stderr(out)
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run `{line}`: {e}"));
    loop {
        if let Some(status) = child.try_wait().expect("wait") {
            let log = std::fs::read_to_string(&out_path).unwrap_or_default();
            assert!(status.success(), "`{line}` failed ({status}):\n{log}");
            return;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let log = std::fs::read_to_string(&out_path).unwrap_or_default();
            panic!("`{line}` did not finish within {START_BOUND:?}:\n{log}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Starts `server` under a keeper, its output in `dir/server.log`, and
/// waits until the log holds `ready`; fails naming the command when the
/// server exits or `deadline` passes first.
// The keeper is returned running on purpose: it lives as long as this
// process, and nobody waits for it.
#[allow(clippy::zombie_processes)]
fn keep(server: Command, dir: &Path, ready: &str, deadline: Instant) -> Child {
    let line = shown(&server);
    let log = dir.join("server.log");
    let script = r#"dir=$1; shift
"$@" >>"$dir/server.log" 2>&1 &
p=$!
echo "$p" >"$dir/server.pid"
read -r _ || true
kill "$p" 2>/dev/null
wait "$p"
rm -rf "$dir""#;
    let mut keeper = Command::new("bash");
    keeper
        .arg("-c")
        .arg(script)
        .arg("keeper")
        .arg(dir)
        .arg(server.get_program())
        .args(server.get_args())
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let mut child = keeper
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start `{line}` (under bash): {e}"));
    loop {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        if text.contains(ready) {
            return child;
        }
        let pid = std::fs::read_to_string(dir.join("server.pid")).unwrap_or_default();
        let gone = !pid.trim().is_empty() && !Path::new(&format!("/proc/{}", pid.trim())).exists();
        if gone || Instant::now() > deadline {
            // The keeper stops what it started and removes the folder.
            drop(child.stdin.take());
            let _ = child.wait();
            let why = if gone {
                "exited".to_owned()
            } else {
                format!("was not ready within {START_BOUND:?}")
            };
            panic!(
                "the TLS test server `{line}` {why}; its log ({}):\n{text}",
                log.display()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
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
            "the TLS tests need PostgreSQL's initdb and postgres under \
             /usr/lib/postgresql/<version>/bin; install the Debian package postgresql"
        )
    })
}

/// `program` run as the OS user `user` (initdb and postgres refuse root).
fn as_user(user: &str, program: impl AsRef<std::ffi::OsStr>) -> Command {
    let mut c = Command::new("setpriv");
    c.args([
        &format!("--reuid={user}"),
        &format!("--regid={user}"),
        "--init-groups",
    ])
    .arg(program);
    c
}

fn start_postgres() -> TlsServer {
    let deadline = Instant::now() + START_BOUND;
    need("setpriv", "util-linux");
    need("psql", "postgresql-client");
    let bin = postgres_bin();
    let dir = fresh_dir("postgres");
    let files = TlsFiles::new(&dir, "postgres");
    let data = dir.join("data");
    let mut chown = Command::new("chown");
    chown.arg("-R").arg("postgres:postgres").arg(&dir);
    run(chown, deadline);
    let mut initdb = as_user("postgres", bin.join("initdb"));
    initdb
        .arg("-D")
        .arg(&data)
        .args(["-U", "postgres", "-A", "trust", "--no-sync", "-E", "UTF8"]);
    run(initdb, deadline);
    std::fs::write(
        data.join("pg_hba.conf"),
        "local all all trust\n\
         hostssl certdb all 127.0.0.1/32 cert\n\
         hostssl all all 127.0.0.1/32 trust\n\
         hostnossl all all 127.0.0.1/32 reject\n",
    )
    .expect("write pg_hba.conf");
    let port = free_port();
    let mut server = as_user("postgres", bin.join("postgres"));
    server.arg("-D").arg(&data).arg("-p").arg(port.to_string());
    for (k, v) in [
        ("listen_addresses", "127.0.0.1".to_owned()),
        ("unix_socket_directories", dir.display().to_string()),
        ("ssl", "on".to_owned()),
        ("ssl_cert_file", files.server_cert.display().to_string()),
        ("ssl_key_file", files.server_key.display().to_string()),
        ("ssl_ca_file", files.ca.display().to_string()),
        ("fsync", "off".to_owned()),
        ("max_connections", "200".to_owned()),
    ] {
        server.arg("-c").arg(format!("{k}={v}"));
    }
    let keeper = keep(
        server,
        &dir,
        "database system is ready to accept connections",
        deadline,
    );
    let mut psql = Command::new("psql");
    psql.arg("-h")
        .arg(&dir)
        .args(["-p", &port.to_string(), "-U", "postgres", "-d", "postgres"])
        .args(["-v", "ON_ERROR_STOP=1", "-c", "CREATE DATABASE certdb"]);
    run(psql, deadline);
    TlsServer {
        port,
        files,
        keeper: Mutex::new(keeper),
    }
}

fn start_mariadb() -> TlsServer {
    let deadline = Instant::now() + START_BOUND;
    need("mariadb-install-db", "mariadb-server");
    need("mariadbd", "mariadb-server");
    need("mariadb", "mariadb-client");
    let dir = fresh_dir("mariadb");
    let files = TlsFiles::new(&dir, "idem_x509");
    let data = dir.join("data");
    let mut install = Command::new("mariadb-install-db");
    install
        .arg("--no-defaults")
        .arg(format!("--datadir={}", data.display()))
        .args([
            "--user=root",
            "--auth-root-authentication-method=socket",
            "--skip-test-db",
        ]);
    run(install, deadline);
    let port = free_port();
    let socket = dir.join("mariadb.sock");
    let mut server = Command::new("mariadbd");
    server
        .arg("--no-defaults")
        .arg("--user=root")
        .arg(format!("--datadir={}", data.display()))
        .arg(format!("--socket={}", socket.display()))
        .arg(format!("--pid-file={}", dir.join("mariadbd.pid").display()))
        .arg(format!("--port={port}"))
        .args([
            "--bind-address=127.0.0.1",
            "--skip-name-resolve",
            "--require-secure-transport=ON",
            "--innodb-buffer-pool-size=32M",
            "--skip-log-bin",
            "--max-connections=300",
        ])
        .arg(format!("--ssl-cert={}", files.server_cert.display()))
        .arg(format!("--ssl-key={}", files.server_key.display()))
        .arg(format!("--ssl-ca={}", files.ca.display()));
    let keeper = keep(server, &dir, "ready for connections", deadline);
    let mut setup = Command::new("mariadb");
    setup
        .arg("--no-defaults")
        .arg(format!("--socket={}", socket.display()))
        .args(["-uroot", "-e"])
        .arg(
            "CREATE USER idem@'%' REQUIRE SSL; GRANT ALL ON *.* TO idem@'%'; \
             CREATE USER idem_x509@'%' REQUIRE X509; GRANT ALL ON *.* TO idem_x509@'%'; \
             CREATE USER idem_plain@'%'; GRANT ALL ON *.* TO idem_plain@'%'; \
             CREATE DATABASE test;",
        );
    run(setup, deadline);
    TlsServer {
        port,
        files,
        keeper: Mutex::new(keeper),
    }
}

fn start_redis(auth_clients: &str) -> TlsServer {
    let deadline = Instant::now() + START_BOUND;
    need("redis-server", "redis-server");
    let dir = fresh_dir("redis");
    let files = TlsFiles::new(&dir, "idem-client");
    let port = free_port();
    let server = redis_command(&files, port, auth_clients, &dir);
    let keeper = keep(server, &dir, "Ready to accept connections", deadline);
    TlsServer {
        port,
        files,
        keeper: Mutex::new(keeper),
    }
}

/// `redis-server` on TLS port `port` only, with `files`, its data in `dir`.
fn redis_command(files: &TlsFiles, port: u16, auth_clients: &str, dir: &Path) -> Command {
    let mut server = Command::new("redis-server");
    server
        .args(["--port", "0", "--bind", "127.0.0.1"])
        .args(["--tls-port", &port.to_string()])
        .arg("--tls-cert-file")
        .arg(&files.server_cert)
        .arg("--tls-key-file")
        .arg(&files.server_key)
        .arg("--tls-ca-cert-file")
        .arg(&files.ca)
        .args(["--tls-auth-clients", auth_clients])
        .args(["--save", "", "--appendonly", "no"])
        .arg("--dir")
        .arg(dir);
    server
}
