//! `idem check URL` against real processes on 127.0.0.1: the gateway on the
//! memory and SQLite stores passes every check; the bare upstream (no idem)
//! and the broken Python service (`examples/broken-idempotency/server.py`,
//! a check-then-set middleware) fail the checks they should, and only
//! those; each other fault of the Python service fails its own check.
//! The checks are CASES A1 (concurrent), A2 (in-flight), D1 and C2
//! (replay), D2 (disconnect), E1 (invalid keys, no key) and E2 (other
//! path) seen from outside.
//!
//! The upstream is an axum app in the test process that counts executions
//! (`GET /count`) and sleeps `X-Delay-Ms` per request; the gateway, the
//! Python service and `idem check` itself are child processes on free
//! ports, killed on drop. Each `idem check` run is bounded (60 s, and its
//! own --timeout).

mod support;

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::{get, post};
use axum::Router;
use serde_json::Value;
use support::{
    cleanup, idem, mariadb_args, serve, unique, with_param, GatewayProc, MYSQL, POSTGRES, REDIS,
};

/// The header that makes the upstreams slow, and the delay.
const SLOW: &str = "X-Delay-Ms: 300";
const BODY: &str = r#"{"sku":"A-1","qty":1,"note":{"gift":false,"to":"Ada"}}"#;

// ---------------------------------------------------------------- upstream

/// An orders upstream that counts executions: `POST /orders` answers 201
/// with a body, `Location` and `ETag` unique to the execution, after
/// `X-Delay-Ms`; `GET /count` answers `{"executions": N}`.
struct Upstream {
    url: String,
    hits: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl Upstream {
    async fn start() -> Self {
        let hits = Arc::new(AtomicU64::new(0));
        let app = Router::new()
            .route(
                "/orders",
                post(
                    |State(h): State<Arc<AtomicU64>>, headers: HeaderMap| async move {
                        let n = h.fetch_add(1, Ordering::SeqCst) + 1;
                        let delay = headers
                            .get("x-delay-ms")
                            .and_then(|v| v.to_str().ok())
                            .and_then(|v| v.parse::<u64>().ok())
                            .unwrap_or(0);
                        tokio::time::sleep(Duration::from_millis(delay)).await;
                        (
                            StatusCode::CREATED,
                            [
                                ("content-type", "application/json".to_owned()),
                                ("location", format!("/orders/{n}")),
                                ("etag", format!("\"order-{n}\"")),
                            ],
                            format!("{{\"id\":{n},\"status\":\"created\"}}"),
                        )
                    },
                ),
            )
            .route(
                "/count",
                get(|State(h): State<Arc<AtomicU64>>| async move {
                    format!("{{\"executions\":{}}}", h.load(Ordering::SeqCst))
                }),
            )
            .with_state(hits.clone());
        let (url, task) = serve(app).await;
        Self { url, hits, task }
    }

    fn hits(&self) -> u64 {
        self.hits.load(Ordering::SeqCst)
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

// ---------------------------------------------------------- python service

/// `examples/broken-idempotency/server.py` on a free port; killed on drop.
struct Broken {
    child: Child,
    url: String,
}

impl Broken {
    fn start(faults: &str) -> Self {
        let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".to_owned());
        let script: PathBuf = [
            env!("CARGO_MANIFEST_DIR"),
            "..",
            "..",
            "examples",
            "broken-idempotency",
            "server.py",
        ]
        .iter()
        .collect();
        let mut child = Command::new(&python)
            .arg(&script)
            .args(["--port", "0", "--faults", faults])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot run {python} ({e}): these tests need Python 3 (./scripts/test.sh \
                     installs it; or set PYTHON)"
                )
            });
        let stdout = child.stdout.take().expect("piped");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = BufReader::new(stdout).read_line(&mut line);
            let _ = tx.send(line);
        });
        let line = rx
            .recv_timeout(Duration::from_secs(20))
            .expect("the Python service did not start within 20 s");
        let url = line
            .split_whitespace()
            .find(|w| w.starts_with("http://"))
            .unwrap_or_else(|| panic!("unexpected first line from server.py: {line:?}"))
            .to_owned();
        Broken { child, url }
    }
}

impl Drop for Broken {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

// -------------------------------------------------------------- idem check

/// What one `idem check` run printed, and its exit code.
struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

impl Run {
    /// The `--json` report.
    fn json(&self) -> Value {
        serde_json::from_str(&self.stdout).unwrap_or_else(|e| {
            panic!(
                "not a JSON report ({e}):\n{}\nstderr:\n{}",
                self.stdout, self.stderr
            )
        })
    }

    /// One check's result object.
    fn check(&self, name: &str) -> Value {
        self.json()["checks"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["check"] == name)
            .unwrap_or_else(|| panic!("no check {name} in\n{}", self.stdout))
            .clone()
    }

    fn verdict(&self, name: &str) -> String {
        self.check(name)["verdict"].as_str().unwrap().to_owned()
    }

    fn reason(&self, name: &str) -> String {
        self.check(name)["reason"].as_str().unwrap().to_owned()
    }

    fn details(&self, name: &str) -> Vec<String> {
        self.check(name)["details"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_str().unwrap().to_owned())
            .collect()
    }

    /// Asserts the verdicts, naming the whole report when one differs.
    fn expect(&self, expected: &[(&str, &str)]) {
        for (name, verdict) in expected {
            assert_eq!(
                self.verdict(name),
                *verdict,
                "check {name}: {}\nthe report:\n{}",
                self.reason(name),
                self.stdout
            );
        }
    }
}

/// Runs `idem check ARGS` (at most 60 s).
async fn check(args: &[&str]) -> Run {
    let mut cmd = tokio::process::Command::from(idem());
    cmd.arg("check")
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let out = tokio::time::timeout(Duration::from_secs(60), cmd.output())
        .await
        .expect("idem check ran for more than 60 s")
        .expect("run idem check");
    Run {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// `idem check URL/orders --json` with the body, the slow header and the
/// count URL of `count_base`.
async fn check_counted(base: &str, count_base: &str, extra: &[&str]) -> Run {
    let url = format!("{base}/orders");
    let count = format!("{count_base}/count");
    let mut args = vec![
        url.as_str(),
        "--data",
        BODY,
        "--count-url",
        &count,
        "--slow-header",
        SLOW,
        "--json",
    ];
    args.extend_from_slice(extra);
    check(&args).await
}

const EVERY_CHECK_PASSES: [(&str, &str); 9] = [
    ("concurrent", "pass"),
    ("replay", "pass"),
    ("in-flight", "pass"),
    ("disconnect", "pass"),
    ("other-body", "pass"),
    ("other-path", "pass"),
    ("json-variants", "pass"),
    ("invalid-keys", "pass"),
    ("no-key", "info"),
];

/// The verdicts of the `n`-th report shown in README.md's section "Is my
/// API idempotent?" (`FAIL` written `fail`), in table order.
fn readme_verdicts(n: usize) -> Vec<(String, String)> {
    let path: PathBuf = [env!("CARGO_MANIFEST_DIR"), "..", "..", "README.md"]
        .iter()
        .collect();
    let text = std::fs::read_to_string(&path).unwrap();
    let section = text
        .split("\n## Is my API idempotent?\n")
        .nth(1)
        .expect("README.md has a section \"Is my API idempotent?\"");
    let section = section.split("\n## ").next().unwrap();
    let block = section
        .split("```text\n")
        .nth(n + 1)
        .and_then(|b| b.split("```").next())
        .unwrap_or_else(|| panic!("README's section has no report {n}"));
    let names: Vec<&str> = EVERY_CHECK_PASSES.iter().map(|(c, _)| *c).collect();
    block
        .lines()
        .filter_map(|l| {
            let mut words = l.split_whitespace();
            let (check, verdict) = (words.next()?, words.next()?);
            names
                .contains(&check)
                .then(|| (check.to_owned(), verdict.to_ascii_lowercase()))
        })
        .collect()
}

impl Run {
    /// `check → verdict`, in report order.
    fn verdicts(&self) -> Vec<(String, String)> {
        self.json()["checks"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| {
                let name = c["check"].as_str().unwrap().to_owned();
                (name, c["verdict"].as_str().unwrap().to_owned())
            })
            .collect()
    }
}

// ------------------------------------------------------------------- tests

/// Runs `f` when dropped (cleanup that also runs when the test fails).
struct Finally<F: FnMut()>(F);

impl<F: FnMut()> Drop for Finally<F> {
    fn drop(&mut self) {
        (self.0)();
    }
}

/// The gateway on `store` (`{dir}`: a temporary folder), with `args`, in
/// front of the counting upstream: every check passes; the in-flight
/// retry gets 409, or the replay when `waits`.
async fn gateway_passes_every_check(store: &str, args: &[&str], waits: bool) {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let store = store.replace("{dir}", &dir.path().display().to_string());
    let mut gw_args = vec!["--upstream", up.url.as_str(), "--store", &store];
    gw_args.extend_from_slice(args);
    let gw = GatewayProc::start(dir.path(), "gw", &gw_args).await;
    let run = check_counted(&gw.url(""), &up.url, &[]).await;
    assert_eq!(run.code, 0, "{}\n{}\n{}", run.stdout, run.stderr, gw.logs());
    run.expect(&EVERY_CHECK_PASSES);
    assert!(
        run.reason("concurrent")
            .starts_with("1 execution for 8 concurrent copies"),
        "{}",
        run.stdout
    );
    let in_flight = run.reason("in-flight");
    if waits {
        assert!(
            in_flight.starts_with("the retry waited and got 201 (the replay)"),
            "{in_flight}"
        );
    } else {
        assert!(
            in_flight.starts_with("409 with Retry-After: "),
            "{in_flight}"
        );
    }
    assert!(
        run.reason("other-body").starts_with("422"),
        "{}",
        run.stdout
    );
    assert!(
        run.reason("other-path").starts_with("422"),
        "{}",
        run.stdout
    );
    let report = run.json();
    assert_eq!(report["summary"]["fail"], 0);
    assert!(report["requests_sent"].as_u64().unwrap() <= 200);
    // Every request of every check used a fresh key: no key is shared
    // between two checks.
    let mut keys_of: Vec<(String, String)> = Vec::new();
    for c in report["checks"].as_array().unwrap() {
        for r in c["requests"].as_array().unwrap() {
            if let Some(k) = r["key"].as_str().filter(|k| k.starts_with("idem-check-")) {
                let name = c["check"].as_str().unwrap().to_owned();
                if let Some((other, _)) = keys_of.iter().find(|(o, kk)| kk == k && *o != name) {
                    panic!("key {k} used by {other} and {name}");
                }
                keys_of.push((name, k.to_owned()));
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateway_on_memory_passes_every_check() {
    gateway_passes_every_check("memory://", &[], false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateway_on_memory_in_wait_mode_passes_every_check() {
    gateway_passes_every_check("memory://", &["--wait", "5s"], true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateway_on_sqlite_passes_every_check() {
    gateway_passes_every_check("sqlite://{dir}/idem.db", &[], false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateway_on_postgres_passes_every_check() {
    let base = POSTGRES.require();
    let schema = unique("check_pg");
    let url = with_param(
        &with_param(&base, "idem_schema", &schema),
        "idem_table",
        "records",
    );
    let _drop = Finally(|| {
        let sql = format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE");
        cleanup(
            &format!("schema {schema}"),
            "psql",
            &[&base, "-q", "-c", &sql],
        );
    });
    gateway_passes_every_check(&url, &[], false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateway_on_mariadb_passes_every_check() {
    let base = MYSQL.require();
    let table = unique("check_my");
    let url = with_param(&base, "idem_table", &table);
    let _drop = Finally(|| {
        let mut args = mariadb_args(&base);
        args.push("-e".into());
        args.push(format!("DROP TABLE IF EXISTS `{table}`, `{table}_fence`"));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        cleanup(&format!("table {table}"), "mariadb", &args);
    });
    gateway_passes_every_check(&url, &[], false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateway_on_redis_passes_every_check() {
    let base = REDIS.require();
    let prefix = unique("check_rd");
    let url = with_param(&base, "idem_prefix", &prefix);
    let _drop = Finally(|| support::cleanup_redis_prefix(&base, &prefix));
    gateway_passes_every_check(&url, &[], false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_keep_to_the_rate_limit() {
    let up = Upstream::start().await;
    let url = format!("{}/orders", up.url);
    // 5 a second, bursts of 2: the third and fourth request wait.
    let run = check(&[
        &url,
        "-d",
        BODY,
        "--rate",
        "5",
        "-n",
        "2",
        "--checks",
        "invalid-keys,no-key",
        "--json",
    ])
    .await;
    let report = run.json();
    let sent: Vec<f64> = report["checks"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|c| c["requests"].as_array().unwrap().clone())
        .map(|r| r["sent_ms"].as_f64().unwrap())
        .collect();
    assert_eq!(sent.len(), 4, "{}", run.stdout);
    assert!(
        sent[3] - sent[0] >= 350.0,
        "not spaced by the rate: {sent:?}"
    );
    assert_eq!(report["requests_sent"], 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bare_upstream_runs_concurrent_duplicates_more_than_once() {
    let up = Upstream::start().await;
    let run = check_counted(&up.url, &up.url, &[]).await;
    assert_eq!(run.code, 1, "{}\n{}", run.stdout, run.stderr);
    run.expect(&[
        ("concurrent", "fail"),
        ("in-flight", "fail"),
        ("disconnect", "fail"),
        ("replay", "fail"),
        ("other-body", "fail"),
        ("invalid-keys", "fail"),
    ]);
    assert!(
        run.reason("concurrent")
            .starts_with("8 executions for 8 concurrent copies"),
        "{}",
        run.stdout
    );
    assert!(
        run.reason("replay")
            .starts_with("the retry ran again: 2 executions"),
        "{}",
        run.stdout
    );
    // The table on a pipe: no colours, FAIL rows, exit status 1.
    let url = format!("{}/orders", up.url);
    let count = format!("{}/count", up.url);
    let table = check(&[
        &url,
        "-d",
        BODY,
        "--count-url",
        &count,
        "--checks",
        "concurrent",
    ])
    .await;
    assert_eq!(table.code, 1, "{}", table.stdout);
    assert!(!table.stdout.contains('\x1b'), "{}", table.stdout);
    let row = table
        .stdout
        .lines()
        .find(|l| l.starts_with("concurrent "))
        .unwrap_or_else(|| panic!("no row:\n{}", table.stdout));
    assert!(row.contains("FAIL") && row.contains("8×201"), "{row}");
    assert!(
        row.contains("8 executions for 8 concurrent copies of one key"),
        "{row}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broken_check_then_set_service_shows_the_race() {
    let svc = Broken::start("race");
    let dir = tempfile::tempdir().unwrap();
    let page = dir.path().join("report.html");
    let page_arg = page.display().to_string();
    let run = check_counted(&svc.url, &svc.url, &["--html", &page_arg]).await;
    assert_eq!(run.code, 1, "{}\n{}", run.stdout, run.stderr);
    // The race, and nothing else: its replays, fingerprints and key checks
    // are right.
    run.expect(&[
        ("concurrent", "fail"),
        ("in-flight", "fail"),
        ("disconnect", "fail"),
        ("replay", "pass"),
        ("other-body", "pass"),
        ("other-path", "pass"),
        ("json-variants", "pass"),
        ("invalid-keys", "pass"),
        ("no-key", "info"),
    ]);
    let concurrent = run.reason("concurrent");
    assert!(
        concurrent.contains("executions for 8 concurrent copies"),
        "{concurrent}"
    );
    assert!(!concurrent.starts_with("1 "), "{concurrent}");
    assert!(
        run.reason("in-flight")
            .starts_with("the retry ran while the first was still running: 2 executions"),
        "{}",
        run.stdout
    );
    // The timeline: one bar per request of the concurrency checks, eight
    // copies that all ran, the hang-up.
    let html = std::fs::read_to_string(&page).expect("--html wrote the page");
    assert!(html.starts_with("<!doctype html>"), "{html}");
    for section in ["<h2>concurrent — ", "<h2>in-flight — ", "<h2>disconnect — "] {
        assert!(html.contains(section), "no {section:?} in the page");
    }
    let concurrent = html
        .split("<h2>concurrent — ")
        .nth(1)
        .and_then(|s| s.split("</svg>").next())
        .unwrap();
    assert_eq!(
        concurrent.matches("<rect class=\"run\"").count(),
        8,
        "{concurrent}"
    );
    assert!(html.contains("<rect class=\"hungup\""), "no hang-up bar");
    assert!(html.matches("<rect ").count() >= 8 + 2 + 2, "{html}");
    assert_eq!(
        run.verdicts(),
        readme_verdicts(0),
        "README's report of the broken service is not what idem check answers"
    );
    assert!(
        run.reason("disconnect")
            .starts_with("the retry ran again after a hang-up at 50ms: 2 executions"),
        "{}",
        run.stdout
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broken_service_behind_the_gateway_passes() {
    let svc = Broken::start("race");
    let dir = tempfile::tempdir().unwrap();
    let gw = GatewayProc::start(
        dir.path(),
        "gw",
        &["--upstream", &svc.url, "--store", "memory://"],
    )
    .await;
    let run = check_counted(&gw.url(""), &svc.url, &[]).await;
    assert_eq!(run.code, 0, "{}\n{}\n{}", run.stdout, run.stderr, gw.logs());
    run.expect(&EVERY_CHECK_PASSES);
    assert_eq!(
        run.verdicts(),
        readme_verdicts(1),
        "README's report of the service behind idem is not what idem check answers"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_correct_python_middleware_passes_too() {
    // Without the race the middleware claims keys atomically: idem check
    // has nothing to report about a service it does not guard.
    let svc = Broken::start("none");
    let run = check_counted(&svc.url, &svc.url, &[]).await;
    assert_eq!(run.code, 0, "{}\n{}", run.stdout, run.stderr);
    run.expect(&EVERY_CHECK_PASSES);
    assert!(
        run.reason("in-flight")
            .starts_with("409 with Retry-After: 1"),
        "{}",
        run.stdout
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_fault_fails_its_own_check() {
    // Executions told apart by the body's id this time (no count URL).
    let svc = Broken::start("raw-body,any-path,lose-headers,any-key,no-retry-after");
    let url = format!("{}/orders", svc.url);
    let run = check(&[
        &url,
        "-d",
        BODY,
        "--id-pointer",
        "/id",
        "--slow-header",
        SLOW,
        "--json",
    ])
    .await;
    assert_eq!(run.code, 1, "{}\n{}", run.stdout, run.stderr);
    run.expect(&[
        ("concurrent", "pass"),
        ("replay", "fail"),
        ("in-flight", "fail"),
        ("disconnect", "n/a"),
        ("other-body", "pass"),
        ("other-path", "fail"),
        ("json-variants", "fail"),
        ("invalid-keys", "fail"),
    ]);
    let replay = run.details("replay");
    assert!(
        replay
            .iter()
            .any(|d| d.starts_with("header location: \"/orders/")),
        "{replay:?}"
    );
    assert!(
        replay.iter().any(|d| d.starts_with("header etag: ")),
        "{replay:?}"
    );
    assert_eq!(replay.len(), 2, "only the lost headers differ: {replay:?}");
    assert!(
        run.reason("in-flight").contains("carries no Retry-After"),
        "{}",
        run.stdout
    );
    assert!(
        run.reason("other-path")
            .contains("got the first path's answer"),
        "{}",
        run.stdout
    );
    assert!(
        run.reason("json-variants")
            .contains("422 (treated as another request)"),
        "{}",
        run.stdout
    );
    assert!(
        run.reason("invalid-keys").contains("was accepted (201)"),
        "{}",
        run.stdout
    );
    assert!(
        run.reason("disconnect").contains("needs --count-url"),
        "{}",
        run.stdout
    );

    let svc = Broken::start("any-body");
    let url = format!("{}/orders", svc.url);
    let run = check(&[
        &url,
        "-d",
        BODY,
        "--id-header",
        "location",
        "--json",
        "--checks",
        "other-body,replay",
    ])
    .await;
    assert_eq!(run.code, 1, "{}\n{}", run.stdout, run.stderr);
    run.expect(&[("other-body", "fail"), ("replay", "pass")]);
    assert!(
        run.reason("other-body")
            .starts_with("the other body got the first request's answer (201)"),
        "{}",
        run.stdout
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_witness_or_a_slow_endpoint_the_checks_say_not_applicable() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let gw = GatewayProc::start(
        dir.path(),
        "gw",
        &["--upstream", &up.url, "--store", "memory://"],
    )
    .await;
    let url = gw.url("/orders");
    let run = check(&[&url, "-d", BODY, "--overlap-after", "2s", "--json"]).await;
    assert_eq!(run.code, 0, "{}\n{}", run.stdout, run.stderr);
    run.expect(&[
        ("concurrent", "n/a"),
        ("disconnect", "n/a"),
        ("in-flight", "n/a"),
        ("replay", "pass"),
        ("other-body", "pass"),
        ("other-path", "pass"),
        ("json-variants", "pass"),
        ("invalid-keys", "pass"),
    ]);
    assert!(run
        .reason("concurrent")
        .contains("--id-pointer, --id-header or --count-url"));
    assert!(
        run.reason("in-flight")
            .contains("before the retry was due at 2s"),
        "{}",
        run.reason("in-flight")
    );
    assert!(
        run.reason("replay").contains("(executions not counted)"),
        "{}",
        run.stdout
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dry_run_prints_the_plan_and_sends_nothing() {
    let up = Upstream::start().await;
    let url = format!("{}/orders", up.url);
    let count = format!("{}/count", up.url);
    let run = check(&[
        &url,
        "-d",
        BODY,
        "--count-url",
        &count,
        "--slow-header",
        SLOW,
        "--dry-run",
    ])
    .await;
    assert_eq!(run.code, 0, "{}\n{}", run.stdout, run.stderr);
    for line in [
        "the plan (nothing sent)",
        "8 × POST /orders with key K + x-delay-ms: 300, all at once on 8 connections",
        "POST /orders/idem-check-other with key K",
        "content-type: application/json (added: the body is JSON)",
        "POST /orders with a 300-character key",
    ] {
        assert!(run.stdout.contains(line), "no {line:?} in\n{}", run.stdout);
    }
    assert_eq!(up.hits(), 0, "a dry run sent a request");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_errors_exit_2_with_a_reason() {
    let cases: [(&[&str], &str); 10] = [
        (&["http://192.0.2.1/orders"], "--allow-host 192.0.2.1"),
        (&["https://127.0.0.1/orders"], "https:// is not supported"),
        (&["127.0.0.1/orders"], "not an absolute URL"),
        (
            &["http://127.0.0.1/o", "-H", "Idempotency-Key: mine"],
            "a fresh key per check",
        ),
        (&["http://127.0.0.1/o", "-H", "no colon"], "'Name: value'"),
        (
            &["http://127.0.0.1/o", "--checks", "concurrent,bogus"],
            "unknown check \"bogus\"",
        ),
        (
            &[
                "http://127.0.0.1/o",
                "--id-pointer",
                "/id",
                "--max-requests",
                "5",
            ],
            "more than --max-requests 5",
        ),
        (
            &["http://127.0.0.1/o", "--id-pointer", "id"],
            "not a JSON Pointer",
        ),
        (
            &["http://127.0.0.1/o", "--html", "/nonexistent-dir/x.html"],
            "--html /nonexistent-dir/x.html",
        ),
        (&["http://127.0.0.1/o", "--rate", "1e-300"], "at least 0.1"),
    ];
    for (args, message) in cases {
        let run = check(args).await;
        assert_eq!(run.code, 2, "{args:?}: {}\n{}", run.stdout, run.stderr);
        assert!(
            run.stderr.contains(message),
            "{args:?}: no {message:?} in {}",
            run.stderr
        );
        assert!(!run.stderr.contains("panicked"), "{}", run.stderr);
    }
    // Nothing listens on the URL: exit 2 before any check is judged (a
    // down service is not "not idempotent").
    let free = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = free.local_addr().unwrap().port();
    drop(free);
    let run = check(&[
        &format!("http://127.0.0.1:{port}/orders"),
        "--id-pointer",
        "/id",
    ])
    .await;
    assert_eq!(run.code, 2, "{}\n{}", run.stdout, run.stderr);
    assert!(run.stderr.contains("cannot connect to"), "{}", run.stderr);
    assert!(!run.stdout.contains("FAIL"), "{}", run.stdout);
    // clap's own usage errors are exit 2 too.
    let run = check(&[
        "http://127.0.0.1/o",
        "--id-pointer",
        "/id",
        "--count-url",
        "http://127.0.0.1/c",
    ])
    .await;
    assert_eq!(run.code, 2, "{}", run.stderr);
    let run = check(&["http://127.0.0.1/o", "-n", "1"]).await;
    assert_eq!(run.code, 2, "{}", run.stderr);
    // A host named by --allow-host is planned (nothing is sent in a dry run).
    let run = check(&[
        "http://192.0.2.1/orders",
        "--allow-host",
        "192.0.2.1",
        "--dry-run",
    ])
    .await;
    assert_eq!(run.code, 0, "{}", run.stderr);
}

/// `idem demo --no-showcase` (the orders example behind a gateway, on free
/// ports): its gateway URL; the child is killed on drop.
#[cfg(feature = "demo")]
struct Demo {
    child: Child,
    gateway: String,
    _dir: tempfile::TempDir,
}

#[cfg(feature = "demo")]
impl Demo {
    fn start() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let mut child = idem()
            .args(["demo", "--no-showcase", "--listen", "127.0.0.1:0"])
            .current_dir(dir.path())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start idem demo");
        let stdout = child.stdout.take().expect("piped");
        // Owned by the guard from here on: killed and waited for on any
        // panic below.
        let mut demo = Demo {
            child,
            gateway: String::new(),
            _dir: dir,
        };
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                // Keeps draining after the gateway line: the demo never
                // blocks on a full pipe.
                let _ = tx.send(line);
            }
        });
        let mut seen = String::new();
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while demo.gateway.is_empty() {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            let line = rx
                .recv_timeout(left)
                .unwrap_or_else(|_| panic!("idem demo did not get ready in 30 s:\n{seen}"));
            seen.push_str(&line);
            seen.push('\n');
            let gateway = line
                .trim_start()
                .strip_prefix("gateway")
                .and_then(|rest| rest.split_whitespace().find(|w| w.starts_with("http://")));
            if let Some(url) = gateway {
                demo.gateway = url.trim_end_matches('/').to_owned();
            }
        }
        demo
    }
}

#[cfg(feature = "demo")]
impl Drop for Demo {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[cfg(feature = "demo")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_orders_example_behind_the_demo_gateway_passes() {
    let demo = Demo::start();
    let url = format!("{}/orders", demo.gateway);
    let run = check(&[
        &url,
        "-d",
        r#"{"outer_order_no":"CHK-1","amount_cents":1999}"#,
        // The default other body changes the amount: the service itself
        // refuses that order number with another amount (409), whatever
        // the key; another order number is a request it takes.
        "--other-data",
        r#"{"outer_order_no":"CHK-2","amount_cents":1999}"#,
        "--id-pointer",
        "/id",
        "--json",
    ])
    .await;
    assert_eq!(run.code, 0, "{}\n{}", run.stdout, run.stderr);
    run.expect(&[
        ("concurrent", "pass"),
        ("replay", "pass"),
        ("other-body", "pass"),
        ("other-path", "pass"),
        ("json-variants", "pass"),
        ("invalid-keys", "pass"),
        ("no-key", "info"),
    ]);
}
