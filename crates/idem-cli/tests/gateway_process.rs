//! `idem gateway` as real processes on real sockets, with a SQLite store:
//! results survive SIGKILL and a restart, a crash right after the claim
//! blocks retries only for the lease (CASES.md B1), two processes on one
//! SQLite file run a key once, SIGTERM lets an in-flight request finish and
//! be stored, and flags / `IDEM_*` variables are honoured or refused.
//!
//! The upstream is an axum app inside the test process that counts
//! executions; each gateway is a child process (killed on drop) on a port
//! picked by binding 127.0.0.1:0 and closing it.

mod support;

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::routing::post;
use axum::Router;
use support::{idem, serve, GatewayProc};

// ---------------------------------------------------------------- upstream

#[derive(serde::Deserialize)]
struct SlowQ {
    ms: Option<u64>,
}

/// An upstream that counts executions: `/orders` answers 201 at once,
/// `/slow?ms=N` after N ms, `/slow-first?ms=N` sleeps in its first
/// execution only.
struct Upstream {
    url: String,
    hits: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl Upstream {
    async fn start() -> Self {
        let hits = Arc::new(AtomicUsize::new(0));
        let app = Router::new()
            .route(
                "/orders",
                post(|State(h): State<Arc<AtomicUsize>>| async move {
                    let n = h.fetch_add(1, Ordering::SeqCst) + 1;
                    (
                        StatusCode::CREATED,
                        [("location", format!("/orders/{n}"))],
                        format!("{{\"order\":{n}}}"),
                    )
                }),
            )
            .route(
                "/slow",
                post(
                    |State(h): State<Arc<AtomicUsize>>, Query(q): Query<SlowQ>| async move {
                        let n = h.fetch_add(1, Ordering::SeqCst) + 1;
                        tokio::time::sleep(Duration::from_millis(q.ms.unwrap_or(500))).await;
                        format!("slow {n}")
                    },
                ),
            )
            .route(
                "/slow-first",
                post(
                    |State(h): State<Arc<AtomicUsize>>, Query(q): Query<SlowQ>| async move {
                        let n = h.fetch_add(1, Ordering::SeqCst) + 1;
                        if n == 1 {
                            tokio::time::sleep(Duration::from_millis(q.ms.unwrap_or(500))).await;
                        }
                        format!("slow-first {n}")
                    },
                ),
            )
            .with_state(hits.clone());
        let (url, task) = serve(app).await;
        Self { url, hits, task }
    }

    fn hits(&self) -> usize {
        self.hits.load(Ordering::SeqCst)
    }

    /// Waits (at most 10 s) until the upstream has been called.
    async fn wait_for_hit(&self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.hits() == 0 {
            assert!(
                Instant::now() < deadline,
                "the claim never reached the upstream"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[derive(Debug)]
struct Got {
    status: u16,
    replayed: bool,
    location: Option<String>,
    body: String,
}

async fn post_key(c: &reqwest::Client, url: &str, key: &str) -> Got {
    let r = c
        .post(url)
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(r#"{"amount":10}"#)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let replayed = r
        .headers()
        .get("idempotent-replayed")
        .is_some_and(|v| v == "true");
    let location = r
        .headers()
        .get("location")
        .map(|v| v.to_str().unwrap_or("").to_owned());
    let body = r.text().await.unwrap();
    Got {
        status,
        replayed,
        location,
        body,
    }
}

fn sqlite_url(dir: &Path) -> String {
    format!("sqlite://{}", dir.join("idem.db").display())
}

/// What the SQLite tests start from: the upstream, a temporary folder, the
/// store URL of `idem.db` in it, and a client.
async fn sqlite_setup() -> (Upstream, tempfile::TempDir, String, reqwest::Client) {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let store = sqlite_url(dir.path());
    (up, dir, store, reqwest::Client::new())
}

// ------------------------------------------------------------------- tests

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_results_survive_sigkill_and_restart() {
    let (up, dir, store, c) = sqlite_setup().await;
    let args = ["--upstream", &up.url, "--store", &store];

    let mut a = GatewayProc::start(dir.path(), "a", &args).await;
    let first = post_key(&c, &a.url("/orders"), "survive-1").await;
    assert_eq!(first.status, 201, "{first:?}\n{}", a.logs());
    assert!(!first.replayed);
    a.kill9();

    let b = GatewayProc::start(dir.path(), "b", &args).await;
    let again = post_key(&c, &b.url("/orders"), "survive-1").await;
    assert_eq!(again.status, 201, "{again:?}\n{}", b.logs());
    assert!(
        again.replayed,
        "the result did not survive SIGKILL: {again:?}"
    );
    assert_eq!(again.body, first.body);
    assert_eq!(again.location, first.location);
    assert_eq!(up.hits(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn b1_crash_after_the_claim_blocks_retries_only_for_the_lease() {
    let (up, dir, store, c) = sqlite_setup().await;
    let args = [
        "--upstream",
        &up.url,
        "--store",
        &store,
        "--lease",
        "2s",
        // The lease must be longer than the store timeout (5 s by default).
        "--store-timeout",
        "1s",
        "--ttl",
        "1h",
    ];
    let mut a = GatewayProc::start(dir.path(), "a", &args).await;
    // The survivor runs beside A on the same file, so the retries below do
    // not depend on how fast a process restarts.
    let b = GatewayProc::start(dir.path(), "b", &args).await;
    let url = a.url("/slow-first?ms=30000");
    let doomed = tokio::spawn({
        let c = c.clone();
        async move {
            c.post(url)
                .header("idempotency-key", "b1")
                .body(r#"{"amount":10}"#)
                .header("content-type", "application/json")
                .send()
                .await
        }
    });
    up.wait_for_hit().await;
    a.kill9();
    let killed = Instant::now();
    assert!(
        doomed.await.unwrap().is_err(),
        "the first caller got an answer from a dead gateway"
    );

    // A renewed its 2 s lease every 667 ms, so at least 1.33 s of it was
    // left when it died: a retry at 1 s must find the key in flight.
    tokio::time::sleep(Duration::from_secs(1).saturating_sub(killed.elapsed())).await;
    let early = post_key(&c, &b.url("/slow-first?ms=30000"), "b1").await;
    assert!(
        killed.elapsed() < Duration::from_millis(1330),
        "the retry came too late to test inside the lease ({:?})",
        killed.elapsed()
    );
    assert_eq!(early.status, 409, "{early:?}\n{}", b.logs());
    assert_eq!(up.hits(), 1);

    tokio::time::sleep(Duration::from_secs(3).saturating_sub(killed.elapsed())).await;
    let late = post_key(&c, &b.url("/slow-first?ms=30000"), "b1").await;
    assert_eq!(late.status, 200, "{late:?}\n{}", b.logs());
    assert_eq!(late.body, "slow-first 2");
    assert_eq!(up.hits(), 2, "after the lease the retry runs exactly once");
    let replay = post_key(&c, &b.url("/slow-first?ms=30000"), "b1").await;
    assert!(replay.replayed);
    assert_eq!(up.hits(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_gateway_processes_on_one_sqlite_file_run_a_key_once() {
    let (up, dir, store, c) = sqlite_setup().await;
    let args = ["--upstream", &up.url, "--store", &store];
    let a = GatewayProc::start(dir.path(), "a", &args).await;
    let b = GatewayProc::start(dir.path(), "b", &args).await;
    let mut tasks = Vec::new();
    for i in 0..20 {
        let url = if i % 2 == 0 {
            a.url("/slow?ms=400")
        } else {
            b.url("/slow?ms=400")
        };
        let c = c.clone();
        tasks.push(tokio::spawn(
            async move { post_key(&c, &url, "shared-1").await },
        ));
    }
    let mut originals = 0;
    for t in tasks {
        let r = t.await.unwrap();
        match r.status {
            200 if !r.replayed => {
                originals += 1;
                assert_eq!(r.body, "slow 1");
            }
            200 => assert_eq!(r.body, "slow 1"),
            409 => {}
            s => panic!("unexpected {s}: {r:?}\nA:\n{}\nB:\n{}", a.logs(), b.logs()),
        }
    }
    assert_eq!(originals, 1);
    assert_eq!(up.hits(), 1, "two gateways on one file ran the key twice");
    // Both replay the same result afterwards.
    for g in [&a, &b] {
        let r = post_key(&c, &g.url("/slow?ms=400"), "shared-1").await;
        assert!(r.replayed, "{r:?}");
        assert_eq!(r.body, "slow 1");
    }
    assert_eq!(up.hits(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_lets_the_in_flight_request_finish_and_be_stored() {
    let (up, dir, store, c) = sqlite_setup().await;
    let args = ["--upstream", &up.url, "--store", &store];
    let mut a = GatewayProc::start(dir.path(), "a", &args).await;
    let url = a.url("/slow?ms=1500");
    let inflight = tokio::spawn({
        let c = c.clone();
        async move { post_key(&c, &url, "term-1").await }
    });
    up.wait_for_hit().await;
    a.signal("-TERM");
    let r = inflight.await.unwrap();
    assert_eq!(r.status, 200, "{r:?}\n{}", a.logs());
    assert_eq!(r.body, "slow 1");
    let status = a.wait_exit(Duration::from_secs(10)).await;
    assert!(status.success(), "exit status {status}:\n{}", a.logs());
    // A new connection is refused once it has gone.
    assert!(std::net::TcpStream::connect(a.addr).is_err());

    let b = GatewayProc::start(dir.path(), "b", &args).await;
    let again = post_key(&c, &b.url("/slow?ms=1500"), "term-1").await;
    assert!(
        again.replayed,
        "the in-flight result was not stored: {again:?}"
    );
    assert_eq!(again.body, "slow 1");
    assert_eq!(up.hits(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigint_stops_an_idle_gateway_cleanly() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let mut a = GatewayProc::start(
        dir.path(),
        "a",
        &["--upstream", &up.url, "--store", "memory://"],
    )
    .await;
    a.signal("-INT");
    let status = a.wait_exit(Duration::from_secs(10)).await;
    assert!(status.success(), "exit status {status}:\n{}", a.logs());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn environment_variables_configure_the_gateway() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    // Only the variables; --listen comes from start_with, so set IDEM_LISTEN
    // to something else to check that the flag wins.
    let a = GatewayProc::start_with(dir.path(), "env", &[], |cmd| {
        cmd.env("IDEM_UPSTREAM", &up.url)
            .env("IDEM_STORE", "memory://")
            .env("IDEM_METHODS", "put,post")
            .env("IDEM_REQUIRE_KEY", "true")
            .env("IDEM_LISTEN", "127.0.0.1:1")
            .env("IDEM_TTL", "1h")
            .env("IDEM_LEASE", "5s")
            .env("IDEM_STORE_TIMEOUT", "2s")
            .env("IDEM_MAX_BODY", "16")
            .env("IDEM_RETENTION_LIMIT", "1KiB")
            .env("IDEM_UPSTREAM_TIMEOUT", "10s")
            .env("IDEM_WAIT", "0");
    })
    .await;
    let c = reqwest::Client::new();
    // IDEM_REQUIRE_KEY: a POST without a key is refused.
    let r = c.post(a.url("/orders")).body("{}").send().await.unwrap();
    assert_eq!(r.status(), 400);
    // IDEM_MAX_BODY=16: a 17-byte guarded body is too large.
    let r = c
        .post(a.url("/orders"))
        .header("idempotency-key", "big")
        .body("x".repeat(17))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 413);
    assert_eq!(up.hits(), 0);
    let r = post_key(&c, &a.url("/orders"), "env-1").await;
    assert_eq!(r.status, 201);
    assert!(post_key(&c, &a.url("/orders"), "env-1").await.replayed);
    assert_eq!(up.hits(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relative_sqlite_path_is_created_in_the_working_directory() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let _a = GatewayProc::start(
        dir.path(),
        "rel",
        &["--upstream", &up.url, "--store", "sqlite://rel.db"],
    )
    .await;
    assert!(dir.path().join("rel.db").exists());
}

#[test]
fn bad_configuration_is_refused_with_a_clear_message() {
    let cases: &[(&[&str], &str)] = &[
        (&[], "--upstream"),
        (
            &[
                "--upstream",
                "https://127.0.0.1:1",
                "--upstream-ca",
                "/nonexistent/ca.pem",
            ],
            "--upstream-ca /nonexistent/ca.pem",
        ),
        (
            &[
                "--upstream",
                "http://127.0.0.1:1",
                "--upstream-ca",
                "/nonexistent/ca.pem",
            ],
            "https://",
        ),
        (&["--upstream", "not a url"], "--upstream"),
        (
            &["--upstream", "http://127.0.0.1:1", "--lease", "0"],
            "lease",
        ),
        (
            &[
                "--upstream",
                "http://127.0.0.1:1",
                "--lease",
                "10s",
                "--ttl",
                "5s",
            ],
            "ttl",
        ),
        (
            &["--upstream", "http://127.0.0.1:1", "--methods", "GET"],
            "GET",
        ),
        (
            &["--upstream", "http://127.0.0.1:1", "--ttl", "forever"],
            "--ttl",
        ),
        (
            &["--upstream", "http://127.0.0.1:1", "--max-body", "lots"],
            "--max-body",
        ),
        (
            &[
                "--upstream",
                "http://127.0.0.1:1",
                "--store",
                "mongodb://db/x",
            ],
            "sqlite://",
        ),
    ];
    for (args, needle) in cases {
        let out = idem()
            .arg("gateway")
            .args(["--listen", "127.0.0.1:0"])
            .args(*args)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} started");
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(
            stderr.contains(needle),
            "{args:?}: {needle:?} not in {stderr}"
        );
    }
    // The same checks apply to the variables.
    let out = idem()
        .arg("gateway")
        .env("IDEM_UPSTREAM", "ftp://x")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("http://"));
}
