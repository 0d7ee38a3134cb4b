//! Health probes of a real `idem gateway` process: `/_idem/ready` follows
//! whether the store accepts a write, `/_idem/live` stays 200 throughout,
//! and the canary leaves no record behind.
//!
//! - SQLite file deleted (with its WAL and SHM) → 503 `file-deleted`,
//!   which stays until the gateway is restarted (its connections write
//!   into the deleted inode; nothing written now survives a restart).
//! - Disk full (a 2 MiB tmpfs filled by a file) → 503 `disk-full`, 200
//!   once the filler is removed, and requests run again without a restart.
//!   Mounting needs root (`mount -t tmpfs`): without it the test FAILS.
//!   (A read-only remount is refused while the gateway holds the file open
//!   for writing, EBUSY, so read-only is covered by the reason unit tests.)
//! - Memory store full (`memory://?idem_max_records=N`, N requests held by
//!   a slow upstream) → 503 `store-full`, 200 once they expire.
//! - Redis (a private `redis-server` on a free port) killed → 503, started
//!   again → 200; paused (SIGSTOP) → 503 `timeout`. The gateway warns at
//!   start that this Redis has no persistence, and not when it has AOF.
//!
//! Readiness is cached for up to 1 s, so every change is polled for with a
//! deadline.

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::Value;
use support::*;

/// The longest a change of readiness may take to show (1 s cache, 2 s check).
const SHOWS_WITHIN: Duration = Duration::from_secs(8);

async fn get(c: &reqwest::Client, url: &str) -> (u16, Value) {
    let r = c.get(url).send().await.unwrap();
    let status = r.status().as_u16();
    let body = r.bytes().await.unwrap_or_default();
    (status, serde_json::from_slice(&body).unwrap_or(Value::Null))
}

/// Polls `path` until it answers `status`; returns its JSON.
async fn until(c: &reqwest::Client, gw: &GatewayProc, path: &str, status: u16) -> Value {
    let deadline = Instant::now() + SHOWS_WITHIN;
    loop {
        let (s, v) = get(c, &gw.url(path)).await;
        if s == status {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "{path} still answers {s} {v} after {SHOWS_WITHIN:?}, not {status}:\n{}",
            gw.logs()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `/_idem/live` answers 200 `{"status":"ok"}`, on both listeners.
async fn live(c: &reqwest::Client, gw: &GatewayProc) {
    let (s, v) = get(c, &gw.url("/_idem/live")).await;
    assert_eq!((s, v), (200, serde_json::json!({"status": "ok"})));
    let (s, _) = get(c, &format!("http://{}/_idem/live", gw.admin)).await;
    assert_eq!(s, 200, "admin /_idem/live");
}

/// Ready with the store's kind, on both listeners and as `/_idem/health`.
async fn ready(c: &reqwest::Client, gw: &GatewayProc, kind: &str) {
    let v = until(c, gw, "/_idem/ready", 200).await;
    assert_eq!(v, serde_json::json!({"status": "ok", "store": kind}));
    let (s, v) = get(c, &gw.url("/_idem/health")).await;
    assert_eq!((s, &v["store"]), (200, &Value::from(kind)), "{v}");
    let (s, v) = get(c, &format!("http://{}/_idem/ready", gw.admin)).await;
    assert_eq!(s, 200, "admin /_idem/ready: {v}");
}

/// Waits for 503 and checks the problem's members on both ports; returns
/// the admin port's answer (with the store's message).
async fn not_ready(c: &reqwest::Client, gw: &GatewayProc, kind: &str) -> Value {
    let v = until(c, gw, "/_idem/ready", 503).await;
    assert_eq!(v["status"], 503, "{v}");
    assert_eq!(v["store"], kind, "{v}");
    let t = v["type"].as_str().unwrap_or_default();
    assert!(
        t == "urn:idem:problem:store-unavailable" || t == "urn:idem:problem:store-full",
        "{v}"
    );
    // The client port names the reason, never the store's own message
    // (it can name files, hosts, tables); the admin port gives both.
    let public = v["detail"].as_str().unwrap_or_default();
    assert!(public.contains("admin listener"), "{v}");
    let (s, a) = get(c, &format!("http://{}/_idem/ready", gw.admin)).await;
    assert_eq!((s, &a["reason"]), (503, &v["reason"]), "{a}");
    let operator = a["detail"].as_str().unwrap_or_default();
    let message = operator.split_once("): ").map_or("", |(_, m)| m);
    assert!(
        !message.is_empty(),
        "no store message on the admin port: {a}"
    );
    assert!(
        !public.contains(message),
        "the client port shows the store's message: {v}"
    );
    // The alias says the same (from the same cached check).
    let (s, h) = get(c, &gw.url("/_idem/health")).await;
    assert_eq!((s, &h["reason"]), (503, &v["reason"]), "{h}");
    live(c, gw).await;
    a
}

fn sqlite_count(db: &Path, sql: &str) -> u64 {
    let out = stdout_of("sqlite3", &[db.to_str().unwrap(), sql]);
    out.trim()
        .parse()
        .unwrap_or_else(|_| panic!("sqlite3 {sql}: {out:?}"))
}

#[tokio::test]
async fn sqlite_file_deleted_is_not_ready_until_restart() {
    let dir = tempfile::tempdir().unwrap();
    let up = Upstream::start().await;
    let db = dir.path().join("idem.db");
    let store = format!("sqlite://{}", db.display());
    let args = ["--upstream", &up.url, "--store", &store];
    let c = reqwest::Client::new();
    let mut gw = GatewayProc::start(dir.path(), "gw", &args).await;
    live(&c, &gw).await;
    ready(&c, &gw, "sqlite").await;
    // Many probes (cached or not) and one real request: only the request's
    // record is in the file; the canary left nothing.
    for _ in 0..5 {
        assert_eq!(get(&c, &gw.url("/_idem/ready")).await.0, 200);
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let r = pay(&c, &gw.url("/pay?ms=1"), &unique("ready-sqlite"))
        .await
        .unwrap();
    assert_eq!(r.status, 201, "{}", r.body);
    assert_eq!(sqlite_count(&db, "SELECT count(*) FROM idem_records"), 1);
    assert_eq!(
        sqlite_count(
            &db,
            "SELECT count(*) FROM idem_records WHERE scope = '_idem'"
        ),
        0
    );

    for suffix in ["", "-wal", "-shm"] {
        let f = PathBuf::from(format!("{}{suffix}", db.display()));
        std::fs::remove_file(&f).unwrap_or_else(|e| panic!("rm {}: {e}", f.display()));
    }
    let v = not_ready(&c, &gw, "sqlite").await;
    assert_eq!(v["reason"], "file-deleted", "{v}");
    assert!(v["detail"].as_str().unwrap().contains("restart"), "{v}");
    // What SQLite does meanwhile: an open connection still "succeeds",
    // writing into the deleted file (a new pooled connection would create
    // an empty file without tables, and fail). Readiness does not come
    // back by itself: either way the file at the path is not the one open.
    let r = pay(&c, &gw.url("/pay?ms=1"), &unique("ready-ghost"))
        .await
        .unwrap();
    assert!(
        r.status == 201 || r.status == 503,
        "{} {}",
        r.status,
        r.body
    );
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(get(&c, &gw.url("/_idem/ready")).await.0, 503);
    assert!(gw.logs().contains("not ready"), "{}", gw.logs());

    // A restart opens a new file: ready again.
    gw.kill9();
    let gw = GatewayProc::start(dir.path(), "gw2", &args).await;
    ready(&c, &gw, "sqlite").await;
    assert_eq!(
        sqlite_count(
            &db,
            "SELECT count(*) FROM idem_records WHERE scope = '_idem'"
        ),
        0
    );
}

/// A tmpfs of `size` on a fresh folder, unmounted on drop.
struct Tmpfs {
    dir: tempfile::TempDir,
}

impl Tmpfs {
    fn mount(size: &str) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir.path())
            .output()
            .expect("run mount");
        assert!(
            out.status.success(),
            "this test needs to mount a tmpfs (run it as root, or in a container with \
             CAP_SYS_ADMIN): `mount -t tmpfs -o size={size} tmpfs {}` failed: {}",
            dir.path().display(),
            String::from_utf8_lossy(&out.stderr)
        );
        Self { dir }
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount")
            .arg("-l")
            .arg(self.dir.path())
            .status();
    }
}

/// Writes into `path` until the disk is full; returns the bytes written.
fn fill(path: &Path) -> u64 {
    use std::io::Write;
    let mut f = std::fs::File::create(path).unwrap();
    let chunk = vec![0x55u8; 4096];
    let mut n = 0;
    loop {
        match f.write(&chunk) {
            Ok(0) => break,
            Ok(k) => n += k as u64,
            Err(e) if e.raw_os_error() == Some(28) => break, // ENOSPC
            Err(e) => panic!("filling {}: {e}", path.display()),
        }
    }
    let _ = f.sync_all();
    n
}

#[tokio::test]
async fn disk_full_is_not_ready_until_there_is_room() {
    let fs = Tmpfs::mount("2m");
    let logs = tempfile::tempdir().unwrap();
    let up = Upstream::start().await;
    let db = fs.path().join("idem.db");
    let store = format!("sqlite://{}", db.display());
    let c = reqwest::Client::new();
    let gw = GatewayProc::start(
        logs.path(),
        "gw",
        &["--upstream", &up.url, "--store", &store],
    )
    .await;
    ready(&c, &gw, "sqlite").await;

    let filler = fs.path().join("filler");
    let n = fill(&filler);
    assert!(n > 0, "nothing could be written to the tmpfs");
    let v = not_ready(&c, &gw, "sqlite").await;
    assert_eq!(v["reason"], "disk-full", "{v}");
    assert_eq!(v["type"], "urn:idem:problem:store-full", "{v}");
    // A real request is refused the same way, before the upstream.
    let r = pay(&c, &gw.url("/pay?ms=1"), &unique("full"))
        .await
        .unwrap();
    assert_eq!(r.status, 503, "{}", r.body);
    assert_eq!(up.total(), 0);

    std::fs::remove_file(&filler).unwrap();
    ready(&c, &gw, "sqlite").await;
    // The store recovered without a restart: a real request runs.
    let r = pay(&c, &gw.url("/pay?ms=1"), &unique("after-full"))
        .await
        .unwrap();
    assert_eq!(r.status, 201, "{}", r.body);
    assert_eq!(
        sqlite_count(
            &db,
            "SELECT count(*) FROM idem_records WHERE scope = '_idem'"
        ),
        0
    );
}

#[tokio::test]
async fn memory_store_full_is_not_ready_until_records_expire() {
    const N: usize = 4;
    let dir = tempfile::tempdir().unwrap();
    let up = Upstream::start().await;
    let store = format!("memory://?idem_max_records={N}");
    let c = reqwest::Client::new();
    let gw = GatewayProc::start(
        dir.path(),
        "gw",
        &[
            "--upstream",
            &up.url,
            "--store",
            &store,
            "--lease",
            "1s",
            "--ttl",
            "1s",
            "--store-timeout",
            "300ms",
            "--max-live-tokens",
            "2",
        ],
    )
    .await;
    ready(&c, &gw, "memory").await;
    // N requests held in flight by a slow upstream fill the store.
    let held: Vec<_> = (0..N)
        .map(|i| {
            let (c, url) = (c.clone(), gw.url("/pay?ms=4000"));
            tokio::spawn(async move { pay(&c, &url, &unique(&format!("held-{i}"))).await })
        })
        .collect();
    let v = not_ready(&c, &gw, "memory").await;
    assert_eq!(v["reason"], "full", "{v}");
    assert_eq!(v["type"], "urn:idem:problem:store-full", "{v}");
    for h in held {
        assert_eq!(h.await.unwrap().unwrap().status, 201);
    }
    // Completed records are kept for their TTL (1 s), then make room.
    ready(&c, &gw, "memory").await;
    assert_eq!(up.total(), N);
}

#[tokio::test]
async fn redis_down_paused_and_back() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_addr().port();
    let mut redis = RedisProc::start(dir.path(), port);
    let up = Upstream::start().await;
    let store = format!("redis://127.0.0.1:{port}/?idem_prefix=ready");
    let c = reqwest::Client::new();
    let gw = GatewayProc::start(
        dir.path(),
        "gw",
        &[
            "--upstream",
            &up.url,
            "--store",
            &store,
            "--store-timeout",
            "500ms",
            "--lease",
            "2s",
        ],
    )
    .await;
    ready(&c, &gw, "redis").await;
    let logs = gw.logs();
    assert!(
        logs.contains("WARN") && logs.contains("Redis has no persistence"),
        "no persistence warning:\n{logs}"
    );
    assert!(logs.contains("appendonly yes"), "{logs}");
    // The canary left no record (its fence counter expires by itself).
    let records = stdout_of(
        "redis-cli",
        &[
            "-p",
            &port.to_string(),
            "--scan",
            "--pattern",
            "{ready:*}:r",
        ],
    );
    assert_eq!(records.trim(), "", "canary records left behind");

    redis.kill();
    let v = not_ready(&c, &gw, "redis").await;
    assert!(
        v["reason"] == "unavailable" || v["reason"] == "timeout",
        "{v}"
    );
    redis.restart();
    ready(&c, &gw, "redis").await;

    {
        let _paused = redis.pause();
        let v = not_ready(&c, &gw, "redis").await;
        assert_eq!(v["reason"], "timeout", "{v}");
    }
    ready(&c, &gw, "redis").await;
    let r = pay(&c, &gw.url("/pay?ms=1"), &unique("redis-back"))
        .await
        .unwrap();
    assert_eq!(r.status, 201, "{}", r.body);
}

#[tokio::test]
async fn redis_with_aof_gets_no_persistence_warning() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_addr().port();
    let _redis = RedisProc::start_with(dir.path(), port, &["--appendonly", "yes"]);
    let up = Upstream::start().await;
    let store = format!("redis://127.0.0.1:{port}/");
    let gw = GatewayProc::start(
        dir.path(),
        "gw",
        &["--upstream", &up.url, "--store", &store],
    )
    .await;
    let logs = gw.logs();
    assert!(
        logs.contains("Redis persists completed keys") && logs.contains("appendfsync everysec"),
        "{logs}"
    );
    assert!(!logs.contains("persistence could not"), "{logs}");
    assert!(!logs.contains("no persistence"), "{logs}");
}

#[tokio::test]
async fn probes_answer_get_and_head_only() {
    let dir = tempfile::tempdir().unwrap();
    let up = Upstream::start().await;
    let c = reqwest::Client::new();
    let gw = GatewayProc::start(
        dir.path(),
        "gw",
        &["--upstream", &up.url, "--store", "memory://"],
    )
    .await;
    for path in ["/_idem/live", "/_idem/ready", "/_idem/health"] {
        let r = c.head(gw.url(path)).send().await.unwrap();
        assert_eq!(r.status(), 200, "HEAD {path}");
        let r = c.post(gw.url(path)).send().await.unwrap();
        assert_eq!(r.status(), 405, "POST {path}");
        assert_eq!(r.headers()["allow"], "GET, HEAD");
    }
    assert_eq!(up.total(), 0);
}
