//! The store going away under a running `idem gateway` process, and coming
//! back. Each test starts its OWN `redis-server` (or PostgreSQL cluster)
//! on a free loopback port and kills it; the shared servers are never
//! touched.
//!
//! - Fail closed (default): while the store is down every guarded request
//!   is a 503 `store-unavailable` problem and the upstream is not called;
//!   when the store is back, requests succeed again without a gateway
//!   restart.
//! - `--fail-open`: while the store is down requests reach the upstream,
//!   marked `Idempotency-Status: unprotected`.
//! - A store that is unreachable at startup stops the gateway with a clear
//!   message (fail fast).

mod support;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use support::*;

// ------------------------------------------------------------ own servers

fn free_port() -> u16 {
    free_addr().port()
}

// ------------------------------------------------------------------- load

/// One request of the background load.
#[derive(Debug)]
struct Sample {
    sent: Instant,
    done: Instant,
    key: String,
    got: Result<Got, String>,
}

/// Workers that POST fresh keys to `url` until stopped.
struct Load {
    stop: Arc<AtomicBool>,
    samples: Arc<Mutex<Vec<Sample>>>,
    workers: Vec<tokio::task::JoinHandle<()>>,
}

impl Load {
    fn start(url: String, run: &str, workers: usize) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let samples = Arc::new(Mutex::new(Vec::new()));
        let c = reqwest::Client::builder()
            .timeout(Duration::from_secs(15))
            .build()
            .unwrap();
        let workers = (0..workers)
            .map(|w| {
                let (stop, samples, c, url) =
                    (stop.clone(), samples.clone(), c.clone(), url.clone());
                let run = run.to_owned();
                tokio::spawn(async move {
                    let mut i = 0;
                    // Bounded: at most 2,000 requests per worker.
                    while !stop.load(Ordering::SeqCst) && i < 2000 {
                        let key = format!("{run}-w{w}-{i}");
                        i += 1;
                        let sent = Instant::now();
                        let got = pay(&c, &url, &key).await.map_err(|e| e.to_string());
                        let done = Instant::now();
                        samples.lock().unwrap().push(Sample {
                            sent,
                            done,
                            key,
                            got,
                        });
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                })
            })
            .collect();
        Self {
            stop,
            samples,
            workers,
        }
    }

    async fn stop(self) -> Vec<Sample> {
        self.stop.store(true, Ordering::SeqCst);
        for w in self.workers {
            w.await.unwrap();
        }
        std::mem::take(&mut *self.samples.lock().unwrap())
    }

    /// How many requests sent at or after `t` have their answer.
    fn answered_since(&self, t: Instant) -> usize {
        self.samples
            .lock()
            .unwrap()
            .iter()
            .filter(|s| s.sent >= t)
            .count()
    }

    fn ok_count(&self) -> usize {
        self.samples
            .lock()
            .unwrap()
            .iter()
            .filter(|s| s.got.as_ref().is_ok_and(|g| g.status == 201))
            .count()
    }
}

fn is_store_unavailable(g: &Got) -> bool {
    g.status == 503
        && g.content_type.as_deref() == Some("application/problem+json")
        && g.problem_type() == "urn:idem:problem:store-unavailable"
}

/// Polls a fresh key every 100 ms until it is answered 201, for at most
/// `bound`; returns how long that took.
async fn wait_recovered(gw: &GatewayProc, run: &str, bound: Duration) -> Duration {
    let c = reqwest::Client::new();
    let started = Instant::now();
    let mut last = None;
    for i in 0.. {
        if started.elapsed() > bound {
            panic!(
                "the gateway did not recover within {bound:?} (last answer {last:?}):\n{}",
                gw.logs()
            );
        }
        match pay(&c, &gw.url("/pay?ms=10"), &format!("{run}-probe-{i}")).await {
            Ok(g) if g.status == 201 => return started.elapsed(),
            other => last = Some(other.map_err(|e| e.to_string())),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    unreachable!()
}

// ------------------------------------------------------------------ tests

/// A store server this test owns and may kill.
trait OwnServer {
    /// Starts one on `port` with its files in `dir`.
    fn start(dir: &Path, port: u16) -> Self
    where
        Self: Sized;
    fn kill(&mut self);
    fn restart(&mut self);
}

/// A temporary folder, a free port, and an `S` started on that port with
/// its files in that folder.
fn own_server<S: OwnServer>() -> (tempfile::TempDir, u16, S) {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let server = S::start(dir.path(), port);
    (dir, port, server)
}

impl OwnServer for RedisProc {
    fn start(dir: &Path, port: u16) -> Self {
        RedisProc::start(dir, port)
    }
    fn kill(&mut self) {
        RedisProc::kill(self);
    }
    fn restart(&mut self) {
        RedisProc::restart(self);
    }
}

/// A gateway on `store` under load; the server is killed mid-load and
/// restarted: 503s while down, no upstream call, recovery without a
/// gateway restart, no key run twice.
async fn outage_scenario(server: &mut dyn OwnServer, store: &str, kind: &str, dir: &Path) {
    let up = Upstream::start().await;
    let mut gw = GatewayProc::start(
        dir,
        "gw",
        &[
            "--upstream",
            &up.url,
            "--store",
            store,
            "--store-timeout",
            "1s",
            "--lease",
            "5s",
        ],
    )
    .await;
    let c = reqwest::Client::new();
    let run = unique("out");

    let load = Load::start(gw.url("/pay?ms=50"), &run, 8);
    let deadline = Instant::now() + Duration::from_secs(10);
    while load.ok_count() < 20 {
        assert!(
            Instant::now() < deadline,
            "no load got through:\n{}",
            gw.logs()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // Kill the store mid-load.
    server.kill();
    let killed_at = Instant::now();
    // Requests that passed `begin` before the kill may still reach the
    // upstream for a moment; then the count must stand still.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let executions_when_down = up.total();
    tokio::time::sleep(Duration::from_millis(2000)).await;
    // Workers caught saving a result at the kill wait out the engine's save
    // wait (2 s) first: keep the store down until requests sent during the
    // outage have been answered (bounded).
    let deadline = Instant::now() + Duration::from_secs(10);
    while load.answered_since(killed_at) < 6 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (status, body) = gw.health_until(&c, 503).await;
    assert_eq!(status, 503, "health while the store is down: {body}");
    assert_eq!(body["type"], "urn:idem:problem:store-unavailable");
    let restart_at = Instant::now();
    assert_eq!(
        up.total(),
        executions_when_down,
        "the upstream was called while the store was down"
    );

    // Bring it back on the same port; the gateway process is not touched.
    server.restart();
    let recovery = wait_recovered(&gw, &run, Duration::from_secs(10)).await;
    let recovered_at = Instant::now();
    tokio::time::sleep(Duration::from_millis(700)).await;
    let samples = load.stop().await;
    assert!(gw.running(), "the gateway process died:\n{}", gw.logs());
    let (status, body) = gw.health_until(&c, 200).await;
    assert_eq!((status, &body["store"]), (200, &serde_json::json!(kind)));

    let down: Vec<&Sample> = samples
        .iter()
        .filter(|s| s.sent >= killed_at && s.done <= restart_at)
        .collect();
    assert!(
        down.len() >= 6,
        "only {} requests were made while the store was down",
        down.len()
    );
    for s in &down {
        match &s.got {
            Ok(g) if is_store_unavailable(g) => {}
            other => panic!(
                "{} while the store was down: {other:?}\n{}",
                s.key,
                gw.logs()
            ),
        }
    }
    let after: Vec<&Sample> = samples.iter().filter(|s| s.sent >= recovered_at).collect();
    assert!(!after.is_empty(), "no load after the recovery");
    for s in &after {
        match &s.got {
            Ok(g) if g.status == 201 && !g.replayed && !g.unprotected => {}
            other => panic!("{} after the recovery: {other:?}\n{}", s.key, gw.logs()),
        }
    }
    // Exactly once throughout: no key ran twice, and every 201 had a run.
    for (key, n) in up.per_key() {
        assert_eq!(n, 1, "{key} ran {n} times");
    }
    let answered_201 = samples
        .iter()
        .filter(|s| s.got.as_ref().is_ok_and(|g| g.status == 201))
        .count();
    assert!(answered_201 <= up.total());
    eprintln!(
        "{kind} outage: {} requests, {} while down (all 503), {} after recovery; recovered \
         {recovery:?} after the restart",
        samples.len(),
        down.len(),
        after.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_outage_is_503_without_upstream_calls_and_recovers_without_a_restart() {
    let (dir, port, mut redis) = own_server::<RedisProc>();
    let store = format!("redis://127.0.0.1:{port}/?idem_prefix=outage");
    outage_scenario(&mut redis, &store, "redis", dir.path()).await;
}

/// A PostgreSQL cluster of its own (`initdb` + `pg_ctl` as user
/// `postgres`, data in a temporary directory, loopback port); stopped
/// (`-m immediate`) on drop.
struct PgProc {
    bin: PathBuf,
    data: PathBuf,
    port: u16,
    running: bool,
}

impl PgProc {
    const BIN: &'static str = "/usr/lib/postgresql/15/bin";

    fn as_postgres(&self, program: &str, args: &[&str]) -> std::process::Output {
        let exe = self.bin.join(program);
        Command::new("runuser")
            .args(["-u", "postgres", "--"])
            .arg(&exe)
            .args(args)
            .stdin(Stdio::null())
            .output()
            .unwrap_or_else(|e| panic!("cannot run {} as postgres: {e}", exe.display()))
    }

    fn start(dir: &Path, port: u16) -> Self {
        let bin = PathBuf::from(Self::BIN);
        assert!(
            bin.join("initdb").exists(),
            "{} has no initdb; install PostgreSQL 15 (`apt-get install -y postgresql`)",
            bin.display()
        );
        // The cluster's files belong to postgres.
        let uid: u32 = String::from_utf8_lossy(
            &Command::new("id")
                .args(["-u", "postgres"])
                .output()
                .unwrap()
                .stdout,
        )
        .trim()
        .parse()
        .expect("a postgres user");
        std::os::unix::fs::chown(dir, Some(uid), None).unwrap();
        let pg = PgProc {
            bin,
            data: dir.join("data"),
            port,
            running: false,
        };
        let data = pg.data.display().to_string();
        let out = pg.as_postgres(
            "initdb",
            &["-D", &data, "-A", "trust", "-U", "postgres", "--no-sync"],
        );
        assert!(
            out.status.success(),
            "initdb failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let mut pg = pg;
        pg.restart();
        pg
    }
}

impl OwnServer for PgProc {
    fn start(dir: &Path, port: u16) -> Self {
        PgProc::start(dir, port)
    }
    fn kill(&mut self) {
        if self.running {
            let data = self.data.display().to_string();
            let out = self.as_postgres("pg_ctl", &["-D", &data, "-m", "immediate", "-w", "stop"]);
            assert!(
                out.status.success(),
                "pg_ctl stop failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            self.running = false;
        }
    }

    fn restart(&mut self) {
        let data = self.data.display().to_string();
        let sockets = self.data.parent().unwrap().display().to_string();
        let opts = format!(
            "-p {} -c listen_addresses=127.0.0.1 -k {sockets} -c fsync=off",
            self.port
        );
        let log = self
            .data
            .parent()
            .unwrap()
            .join("pg.log")
            .display()
            .to_string();
        let out = self.as_postgres(
            "pg_ctl",
            &[
                "-D", &data, "-l", &log, "-o", &opts, "-w", "-t", "30", "start",
            ],
        );
        assert!(
            out.status.success(),
            "pg_ctl start failed: {}\n{}",
            String::from_utf8_lossy(&out.stderr),
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        self.running = true;
    }
}

impl Drop for PgProc {
    fn drop(&mut self) {
        if self.running {
            let data = self.data.display().to_string();
            let _ = self.as_postgres("pg_ctl", &["-D", &data, "-m", "immediate", "stop"]);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_outage_is_503_without_upstream_calls_and_recovers_without_a_restart() {
    let (_dir, port, mut pg) = own_server::<PgProc>();
    let store = format!("postgres://postgres@127.0.0.1:{port}/postgres?idem_schema=outage");
    // Gateway logs go to a directory of their own (the cluster's belongs to postgres).
    let logs = tempfile::tempdir().unwrap();
    outage_scenario(&mut pg, &store, "postgres", logs.path()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_outage_with_fail_open_forwards_unprotected() {
    let (dir, port, mut redis) = own_server::<RedisProc>();
    let up = Upstream::start().await;
    let store = format!("redis://127.0.0.1:{port}/");
    // --fail-open and the timeout by their variables.
    let gw = GatewayProc::start_with(
        dir.path(),
        "fo",
        &["--upstream", &up.url, "--store", &store],
        |cmd| {
            cmd.env("IDEM_FAIL_OPEN", "true")
                .env("IDEM_STORE_TIMEOUT", "1s");
        },
    )
    .await;
    let c = reqwest::Client::new();
    let run = unique("fo");
    let done = format!("{run}-done");
    let r = pay(&c, &gw.url("/pay?ms=10"), &done).await.unwrap();
    assert_eq!((r.status, r.unprotected), (201, false));

    redis.kill();
    for i in 0..5 {
        let r = pay(&c, &gw.url("/pay?ms=10"), &format!("{run}-{i}"))
            .await
            .unwrap();
        assert_eq!(r.status, 201, "{r:?}\n{}", gw.logs());
        assert!(r.unprotected, "not marked unprotected: {r:?}");
        assert!(!r.replayed);
    }
    assert_eq!(up.total(), 6);
    // A key this gateway saw completed is not rerun, even with --fail-open.
    let r = pay(&c, &gw.url("/pay?ms=10"), &done).await.unwrap();
    assert_eq!(r.status, 503, "{r:?}");
    assert_eq!(up.of_key(&done), 1);
    let logs = gw.logs();
    assert!(logs.contains("--fail-open is ON"), "{logs}");
    assert!(logs.contains("FAIL-OPEN"), "{logs}");

    redis.restart();
    wait_recovered(&gw, &run, Duration::from_secs(10)).await;
    let k = format!("{run}-after");
    let r = pay(&c, &gw.url("/pay?ms=10"), &k).await.unwrap();
    assert_eq!((r.status, r.unprotected), (201, false));
    assert!(pay(&c, &gw.url("/pay?ms=10"), &k).await.unwrap().replayed);
}

/// Runs `idem gateway --upstream <nothing> --store <store> <extra>` (with
/// `env` set on the command) to its exit: its exit code and stderr.
fn gateway_exit(
    store: &str,
    extra: &[&str],
    env: impl FnOnce(&mut std::process::Command),
) -> (Option<i32>, String) {
    let mut cmd = idem();
    cmd.args([
        "gateway",
        "--upstream",
        "http://127.0.0.1:9",
        "--store",
        store,
    ])
    .args(extra);
    env(&mut cmd);
    let out = cmd.output().unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn an_unreachable_store_at_startup_stops_the_gateway_with_a_clear_message() {
    let port = free_port();
    for (store, kind) in [
        (format!("redis://:secret@127.0.0.1:{port}/"), "redis"),
        (
            format!("postgres://postgres:secret@127.0.0.1:{port}/test"),
            "postgres",
        ),
        (
            format!("mysql://root:secret@127.0.0.1:{port}/test"),
            "mysql",
        ),
    ] {
        let started = Instant::now();
        let (code, stderr) = gateway_exit(&store, &["--listen", "127.0.0.1:0"], |cmd| {
            cmd.env("IDEM_STORE_TIMEOUT", "2s");
        });
        let took = started.elapsed();
        assert_eq!(code, Some(1), "{store}: {stderr}");
        assert!(
            stderr.contains(&format!("cannot open the {kind} store")),
            "{store}: {stderr}"
        );
        assert!(stderr.contains(&format!("127.0.0.1:{port}")), "{stderr}");
        assert!(
            !stderr.contains("secret"),
            "a password was printed: {stderr}"
        );
        assert!(!stderr.contains("panicked"), "{stderr}");
        assert!(took < Duration::from_secs(15), "{store}: took {took:?}");
    }
    // A URL the gateway cannot use at all is a configuration error (exit 2).
    for (store, needle) in [
        ("mongodb://h/db", "postgres://"),
        ("postgres://h/db?idem_table=no-dash", "idem_table"),
        ("redis://h?idem_schema=x", "idem_prefix"),
    ] {
        let (code, stderr) = gateway_exit(store, &[], |_| {});
        assert_eq!(code, Some(2), "{store}: {stderr}");
        assert!(
            stderr.contains("--store") && stderr.contains(needle),
            "{store}: {stderr}"
        );
    }
    for (flag, value) in [("--store-pool-size", "0"), ("--store-timeout", "0")] {
        let (code, stderr) = gateway_exit("memory://", &[flag, value], |_| {});
        assert_eq!(code, Some(2), "{flag}: {stderr}");
        assert!(stderr.contains(flag), "{stderr}");
    }
}
