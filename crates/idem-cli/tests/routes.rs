//! Per-route rules from one configuration file (issue 14), through the real
//! binary: `idem gateway --config FILE` in front of a real upstream that
//! counts every execution and echoes what it received.
//!
//! Each test writes its own TOML file (top-level gateway settings, then
//! `[[routes]]`), starts one gateway on free ports with a `memory://` store
//! (or a SQLite file in a temporary directory when the test reads the
//! records back with `idem keys`), and asserts on statuses, bodies, the
//! `Idempotent-Replayed` header and the upstream's execution count. No test
//! sleeps through a TTL or a lease: TTLs and leases are read from the
//! stored records (`idem keys list --json`), policies are judged by what a
//! retry gets.
//!
//! Covered: webhooks keyed by a JSON Pointer into the body (redeliveries,
//! excluded fields, a changed amount, a missing pointer, a body that is not
//! JSON, with and without `require_key`); route precedence (first match
//! wins, methods — also one the top level does not guard —, `{id}`
//! placeholders, path spellings); per-route `require_key`, `require_token`,
//! `guard`, `ttl`, `lease`, `wait`, `status_policy`, `statuses`,
//! `max_body`, `retention_limit`, `scope_headers`,
//! `fingerprint_ignore_query`, `fingerprint_headers`,
//! `fingerprint_include`, `fingerprint_exclude`, `fingerprint_path`,
//! `fingerprint_method`, `fingerprint_body`, `key_header`; chunked bodies;
//! the route name in logs and metrics (every outcome); flags and `IDEM_*`
//! variables over the file, inherited by routes; `idem config check` on bad
//! files; reload on SIGHUP and on file change, under load (20 rewrites,
//! invalid ones among them, no failed request), with the running rules kept
//! on a bad file, a request in flight keeping its rules, routes reordered;
//! the example file `examples/config/idem.toml` under `idem config check`
//! and as a running gateway.

mod support;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::response::IntoResponse;
use axum::Router;
use support::{idem, serve, GatewayProc};

// ---------------------------------------------------------------- upstream

/// One execution the upstream saw.
#[derive(Debug, Clone)]
struct Exec {
    method: String,
    /// The path as the upstream received it.
    path: String,
    query: Option<String>,
    headers: HeaderMap,
    body: Vec<u8>,
}

/// An upstream that records every execution and echoes it. Request
/// headers steer the answer (they are not part of the default
/// fingerprint): `x-status` (default 201), `x-sleep-ms` (default 0),
/// `x-size` (pad the response body to at least that many bytes).
struct Echo {
    url: String,
    execs: Arc<Mutex<Vec<Exec>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Echo {
    async fn start() -> Self {
        let execs: Arc<Mutex<Vec<Exec>>> = Arc::default();
        let state = execs.clone();
        let app = Router::new().fallback(
            move |method: Method, uri: Uri, headers: HeaderMap, body: Bytes| {
                let state = state.clone();
                async move { echo(state, method, uri, headers, body).await }
            },
        );
        let (url, task) = serve(app).await;
        Self { url, execs, task }
    }

    /// How many requests the upstream executed.
    fn total(&self) -> usize {
        self.execs.lock().unwrap().len()
    }

    /// How many executions had a path starting with `prefix` (as received,
    /// compared case-insensitively).
    fn on(&self, prefix: &str) -> usize {
        let prefix = prefix.to_ascii_lowercase();
        self.execs
            .lock()
            .unwrap()
            .iter()
            .filter(|e| e.path.to_ascii_lowercase().starts_with(&prefix))
            .count()
    }

    fn execs(&self) -> Vec<Exec> {
        self.execs.lock().unwrap().clone()
    }
}

impl Drop for Echo {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn echo(
    execs: Arc<Mutex<Vec<Exec>>>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> axum::response::Response {
    let num = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok())
    };
    let status = num("x-status")
        .and_then(|s| u16::try_from(s).ok())
        .and_then(|s| StatusCode::from_u16(s).ok())
        .unwrap_or(StatusCode::CREATED);
    let sleep = num("x-sleep-ms").unwrap_or(0);
    let size = usize::try_from(num("x-size").unwrap_or(0)).unwrap_or(0);
    let n = {
        let mut v = execs.lock().unwrap();
        v.push(Exec {
            method: method.to_string(),
            path: uri.path().to_owned(),
            query: uri.query().map(str::to_owned),
            headers: headers.clone(),
            body: body.to_vec(),
        });
        v.len()
    };
    if sleep > 0 {
        tokio::time::sleep(Duration::from_millis(sleep)).await;
    }
    let nonce: u64 = rand::random();
    let mut out = serde_json::json!({
        "execution": n,
        "method": method.as_str(),
        "path": uri.path(),
        "nonce": nonce,
    })
    .to_string();
    if out.len() < size {
        let pad = "x".repeat(size - out.len());
        out = serde_json::json!({
            "execution": n,
            "method": method.as_str(),
            "path": uri.path(),
            "nonce": nonce,
            "pad": pad,
        })
        .to_string();
    }
    (status, [("content-type", "application/json")], out).into_response()
}

// ---------------------------------------------------------------- gateway

/// A gateway started from a configuration file, with its directory.
struct Gw {
    proc: GatewayProc,
    /// Kept until the gateway is gone.
    _dir: tempfile::TempDir,
    config: PathBuf,
}

impl Gw {
    /// Writes `upstream`, `store` (default `memory://`), `top` and then
    /// `routes` to `<dir>/idem.toml` and runs `idem gateway --config` on it.
    async fn start(name: &str, up: &Echo, top: &str, routes: &str) -> Self {
        Self::start_in(tempfile::tempdir().unwrap(), name, up, None, top, routes).await
    }

    async fn start_in(
        dir: tempfile::TempDir,
        name: &str,
        up: &Echo,
        store: Option<&str>,
        top: &str,
        routes: &str,
    ) -> Self {
        let store = store.unwrap_or("memory://");
        let text = format!(
            "# written by tests/routes.rs ({name})\nupstream = {:?}\nstore = {store:?}\n{top}\n{routes}\n",
            up.url
        );
        let config = dir.path().join("idem.toml");
        std::fs::write(&config, &text).unwrap();
        let path = config.display().to_string();
        let proc = own_gateway(dir.path(), name, &["--config", &path], &[]).await;
        Self {
            proc,
            _dir: dir,
            config,
        }
    }

    fn url(&self, path: &str) -> String {
        self.proc.url(path)
    }

    /// The gateway's log, with the configuration file for context.
    fn logs(&self) -> String {
        format!(
            "--- {}:\n{}\n--- log:\n{}",
            self.config.display(),
            std::fs::read_to_string(&self.config).unwrap_or_default(),
            self.proc.logs()
        )
    }
}

/// `GatewayProc::start_with(dir, name, args)` with `env` set, made sure to
/// be this test's own gateway: its log says it listens. Ports are picked
/// by binding and closing, so a parallel test process may take the same
/// port first; then this gateway fails to bind while the health check
/// answers from the other one. Such a start is retried on fresh ports
/// (three attempts).
async fn own_gateway(
    dir: &Path,
    name: &str,
    args: &[&str],
    env: &[(&str, std::ffi::OsString)],
) -> GatewayProc {
    use futures::FutureExt;
    for attempt in 1..=3 {
        let label = format!("{name}-{attempt}");
        let env: Vec<(String, std::ffi::OsString)> = env
            .iter()
            .map(|(k, v)| ((*k).to_owned(), v.clone()))
            .collect();
        let started =
            std::panic::AssertUnwindSafe(GatewayProc::start_with(dir, &label, args, move |cmd| {
                for (k, v) in env {
                    cmd.env(k, v);
                }
            }))
            .catch_unwind()
            .await;
        let log = dir.join(format!("{label}.log"));
        let lost_port = || {
            std::fs::read_to_string(&log)
                .unwrap_or_default()
                .contains("in use")
        };
        let mut proc = match started {
            Ok(p) => p,
            Err(_) if attempt < 3 && lost_port() => continue,
            Err(panic) => std::panic::resume_unwind(panic),
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if !proc.running() {
                if attempt < 3 && lost_port() {
                    break;
                }
                panic!("gateway {label} exited:\n{}", proc.logs());
            }
            if proc.logs().contains("idem gateway listening") {
                return proc;
            }
            assert!(
                Instant::now() < deadline,
                "gateway {label}: no `idem gateway listening` line:\n{}",
                proc.logs()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    unreachable!("the third attempt returns or panics")
}

// --------------------------------------------------------------- requests

/// One answer, read to the end.
#[derive(Debug, Clone)]
struct Got {
    status: u16,
    replayed: bool,
    content_type: String,
    headers: HeaderMap,
    body: String,
}

impl Got {
    fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap_or(serde_json::Value::Null)
    }

    /// The `execution` number the upstream wrote (0 when absent).
    fn execution(&self) -> u64 {
        self.json()["execution"].as_u64().unwrap_or(0)
    }

    fn problem_type(&self) -> String {
        self.json()["type"].as_str().unwrap_or("").to_owned()
    }
}

/// Sends `method path` to the gateway with `headers` and `body`
/// (`content-type: application/json` unless `headers` name another).
async fn send(
    c: &reqwest::Client,
    gw: &Gw,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Got {
    let url = gw.url(path);
    let mut r = c
        .request(
            reqwest::Method::from_bytes(method.as_bytes()).unwrap(),
            &url,
        )
        .timeout(Duration::from_secs(20))
        .body(body.to_owned());
    if !headers
        .iter()
        .any(|(n, _)| n.eq_ignore_ascii_case("content-type"))
    {
        r = r.header("content-type", "application/json");
    }
    for (n, v) in headers {
        r = r.header(*n, *v);
    }
    let resp = r
        .send()
        .await
        .unwrap_or_else(|e| panic!("{method} {url}: {e}\n{}", gw.logs()));
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let replayed = headers
        .get("idempotent-replayed")
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"true"));
    let content_type = headers
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    let body = resp.text().await.unwrap_or_default();
    Got {
        status,
        replayed,
        content_type,
        headers,
        body,
    }
}

/// `POST path` with `Idempotency-Key: key` (or none) and `body`.
async fn post(c: &reqwest::Client, gw: &Gw, path: &str, key: Option<&str>, body: &str) -> Got {
    match key {
        Some(k) => send(c, gw, "POST", path, &[("idempotency-key", k)], body).await,
        None => send(c, gw, "POST", path, &[], body).await,
    }
}

/// Asserts a problem+json answer with `status` and, when given, the problem
/// type `urn:idem:problem:<kind>`.
#[track_caller]
fn assert_problem(got: &Got, status: u16, kind: Option<&str>, what: &str) {
    assert_eq!(got.status, status, "{what}: {got:?}");
    assert!(
        got.content_type.starts_with("application/problem+json"),
        "{what}: a problem+json answer expected: {got:?}"
    );
    if let Some(kind) = kind {
        assert_eq!(
            got.problem_type(),
            format!("urn:idem:problem:{kind}"),
            "{what}: {got:?}"
        );
    }
    assert!(
        !got.replayed,
        "{what}: a refusal is never a replay: {got:?}"
    );
}

/// Asserts a fresh upstream answer (not a replay) with `status`.
#[track_caller]
fn assert_executed(got: &Got, status: u16, what: &str) {
    assert_eq!(got.status, status, "{what}: {got:?}");
    assert!(!got.replayed, "{what}: not a replay expected: {got:?}");
    assert!(
        got.execution() > 0,
        "{what}: the upstream's answer: {got:?}"
    );
}

/// Asserts that `second` replays `first`.
#[track_caller]
fn assert_replay_of(second: &Got, first: &Got, what: &str) {
    assert_eq!(second.status, first.status, "{what}: {second:?}");
    assert!(
        second.replayed,
        "{what}: `Idempotent-Replayed: true` expected: {second:?}"
    );
    assert_eq!(
        second.body, first.body,
        "{what}: a replay carries the stored body"
    );
}

fn now_ms() -> u64 {
    u64::try_from(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_millis(),
    )
    .unwrap()
}

/// The records of a store, by `idem keys list --all --json`.
fn records(store: &str) -> Vec<serde_json::Value> {
    let out = idem()
        .args(["keys", "list", "--store", store, "--all", "--json"])
        .output()
        .expect("run idem keys list");
    let (stdout, _) = support::succeeded(&out, "idem keys list");
    let v: serde_json::Value = serde_json::from_str(stdout.trim())
        .unwrap_or_else(|e| panic!("idem keys list --json printed no JSON ({e}): {stdout}"));
    v["records"].as_array().cloned().unwrap_or_default()
}

/// The record of `key` in `store` (panics when there is none).
fn record(store: &str, key: &str) -> serde_json::Value {
    let all = records(store);
    all.iter()
        .find(|r| r["key"] == key)
        .cloned()
        .unwrap_or_else(|| panic!("no record of {key:?} in {store}: {all:?}"))
}

fn sqlite_store(dir: &Path) -> String {
    format!("sqlite://{}", dir.join("idem.db").display())
}

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(20))
        .build()
        .unwrap()
}

// ---------------------------------------------------------------- webhooks

const WEBHOOKS: &str = r#"
[[routes]]
name = "webhooks"
path = "/webhooks"
key_json_pointer = "/event_id"
fingerprint_exclude = ["/delivered_at"]
"#;

fn event(id: &str, amount: u64, delivered_at: &str) -> String {
    serde_json::json!({
        "event_id": id,
        "type": "payment.succeeded",
        "data": {"amount": amount, "currency": "EUR"},
        "delivered_at": delivered_at,
    })
    .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webhook_redelivery_with_another_attempt_header_is_a_replay() {
    let up = Echo::start().await;
    let gw = Gw::start("webhook-redelivery", &up, "", WEBHOOKS).await;
    let c = client();
    let body = event("evt_1", 1000, "2026-12-02T06:00:00Z");
    let first = send(
        &c,
        &gw,
        "POST",
        "/webhooks/psp",
        &[("x-delivery-attempt", "1")],
        &body,
    )
    .await;
    assert_executed(&first, 201, "first delivery");
    let second = send(
        &c,
        &gw,
        "POST",
        "/webhooks/psp",
        &[("x-delivery-attempt", "2")],
        &body,
    )
    .await;
    assert_replay_of(&second, &first, "second delivery of evt_1");
    assert_eq!(up.total(), 1, "one execution for one event");
    let e = &up.execs()[0];
    assert_eq!(e.headers["x-delivery-attempt"], "1");
    assert_eq!(
        e.body,
        body.as_bytes(),
        "the body reaches the upstream as sent"
    );
    assert!(
        !e.headers.contains_key("idempotency-key"),
        "the gateway adds no Idempotency-Key"
    );

    // Another sender (another Authorization, so another scope) with the
    // same event id is another record.
    let other_sender = send(
        &c,
        &gw,
        "POST",
        "/webhooks/psp",
        &[
            ("x-delivery-attempt", "1"),
            ("authorization", "Bearer other-psp"),
        ],
        &body,
    )
    .await;
    assert_executed(&other_sender, 201, "evt_1 from another scope");
    assert_eq!(up.total(), 2);

    // Another event is another key.
    let other = send(
        &c,
        &gw,
        "POST",
        "/webhooks/psp",
        &[("x-delivery-attempt", "1")],
        &event("evt_2", 1000, "2026-12-02T06:00:00Z"),
    )
    .await;
    assert_executed(&other, 201, "evt_2");
    assert_eq!(up.total(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webhook_excluded_field_may_differ() {
    let up = Echo::start().await;
    let gw = Gw::start("webhook-exclude", &up, "", WEBHOOKS).await;
    let c = client();
    let first = post(
        &c,
        &gw,
        "/webhooks/psp",
        None,
        &event("evt_1", 1000, "2026-12-02T06:00:00Z"),
    )
    .await;
    assert_executed(&first, 201, "first delivery");
    let later = post(
        &c,
        &gw,
        "/webhooks/psp",
        None,
        &event("evt_1", 1000, "2026-12-02T06:05:00Z"),
    )
    .await;
    assert_replay_of(
        &later,
        &first,
        "redelivery with another delivered_at (excluded from the fingerprint)",
    );
    assert_eq!(up.total(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webhook_ids_may_be_integers_and_nothing_else() {
    let up = Echo::start().await;
    let gw = Gw::start("webhook-ids", &up, "", WEBHOOKS).await;
    let c = client();
    let first = post(
        &c,
        &gw,
        "/webhooks/psp",
        None,
        r#"{"event_id":12345,"n":1}"#,
    )
    .await;
    assert_executed(&first, 201, "an integer event_id");
    let again = post(
        &c,
        &gw,
        "/webhooks/psp",
        None,
        r#"{"n":1,"event_id":12345}"#,
    )
    .await;
    assert_replay_of(&again, &first, "the same integer event_id");
    assert_eq!(up.total(), 1);
    for bad in [
        r#"{"event_id":1.5}"#,
        r#"{"event_id":{"id":"evt_1"}}"#,
        r#"{"event_id":true}"#,
        r#"{"event_id":""}"#,
    ] {
        let got = post(&c, &gw, "/webhooks/psp", None, bad).await;
        assert_problem(&got, 400, Some("invalid-key"), bad);
    }
    assert_eq!(up.total(), 1, "no bad key reaches the upstream");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webhook_same_event_with_another_amount_is_422() {
    let up = Echo::start().await;
    let gw = Gw::start("webhook-mismatch", &up, "", WEBHOOKS).await;
    let c = client();
    let first = post(
        &c,
        &gw,
        "/webhooks/psp",
        None,
        &event("evt_1", 1000, "2026-12-02T06:00:00Z"),
    )
    .await;
    assert_executed(&first, 201, "first delivery");
    let changed = post(
        &c,
        &gw,
        "/webhooks/psp",
        None,
        &event("evt_1", 9999, "2026-12-02T06:00:00Z"),
    )
    .await;
    assert_problem(
        &changed,
        422,
        Some("key-mismatch"),
        "evt_1 with another amount",
    );
    assert_eq!(up.total(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webhook_without_the_key_is_refused_when_the_route_requires_one() {
    let up = Echo::start().await;
    let routes = WEBHOOKS.replace("key_json_pointer", "require_key = true\nkey_json_pointer");
    let gw = Gw::start("webhook-required", &up, "", &routes).await;
    let c = client();

    let missing = post(
        &c,
        &gw,
        "/webhooks/psp",
        None,
        r#"{"type":"ping","delivered_at":"2026-12-02T06:00:00Z"}"#,
    )
    .await;
    assert_problem(
        &missing,
        400,
        Some("key-required"),
        "a body without /event_id",
    );
    assert!(
        missing.json()["detail"]
            .as_str()
            .unwrap_or("")
            .contains("/event_id"),
        "a clear problem names the JSON Pointer it looked for: {missing:?}"
    );

    let not_json = send(
        &c,
        &gw,
        "POST",
        "/webhooks/psp",
        &[("content-type", "text/plain")],
        "event_id=evt_1",
    )
    .await;
    assert_problem(&not_json, 400, None, "a body that is not JSON");
    let broken = post(&c, &gw, "/webhooks/psp", None, r#"{"event_id":"evt_1","#).await;
    assert_problem(&broken, 400, None, "malformed JSON");

    // A header does not stand in for the body's key on this route.
    let header_only = post(
        &c,
        &gw,
        "/webhooks/psp",
        Some("evt_h"),
        r#"{"type":"ping"}"#,
    )
    .await;
    assert_problem(
        &header_only,
        400,
        Some("key-required"),
        "an Idempotency-Key header where the key comes from the body",
    );
    assert_eq!(up.total(), 0, "nothing refused reaches the upstream");

    // With the member, it runs.
    let ok = post(
        &c,
        &gw,
        "/webhooks/psp",
        None,
        &event("evt_1", 5, "2026-12-02T06:00:00Z"),
    )
    .await;
    assert_executed(&ok, 201, "a body with /event_id");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webhook_without_the_key_passes_through_when_the_route_does_not_require_one() {
    let up = Echo::start().await;
    let gw = Gw::start("webhook-optional", &up, "", WEBHOOKS).await;
    let c = client();
    let body = r#"{"type":"ping","delivered_at":"2026-12-02T06:00:00Z"}"#;
    for attempt in 1..=2 {
        let got = post(&c, &gw, "/webhooks/psp", None, body).await;
        assert_executed(&got, 201, &format!("keyless body, attempt {attempt}"));
    }
    assert_eq!(up.total(), 2, "no key: each delivery runs (passed through)");
}

/// A body with two `event_id` members is not I-JSON; an upstream parser
/// reads one of them (serde_json and JavaScript take the last), so passing
/// such a body through would run one event once per delivery. Whatever the
/// route says about missing keys, it never runs twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webhook_body_with_a_duplicate_event_id_never_runs_twice() {
    let up = Echo::start().await;
    let gw = Gw::start("webhook-duplicate-member", &up, "", WEBHOOKS).await;
    let c = client();
    let body = r#"{"event_id":"evt_d","amount":5,"event_id":"evt_d"}"#;
    let mut answers = Vec::new();
    for _ in 0..2 {
        answers.push(post(&c, &gw, "/webhooks/psp", None, body).await);
    }
    assert!(
        up.total() <= 1,
        "two deliveries of evt_d ran {} times: {answers:?}",
        up.total()
    );
}

/// A body that is not I-JSON on a body-key route is refused (400
/// `body-not-json`) even when the route does not require a key: an
/// upstream's parser may still find a key in it (see the duplicate
/// `event_id` test above), so passing it through could run an event twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webhook_body_that_is_not_json_is_refused_even_when_the_route_does_not_require_a_key() {
    let up = Echo::start().await;
    let gw = Gw::start("webhook-not-json", &up, "", WEBHOOKS).await;
    let c = client();
    for attempt in 1..=2 {
        let got = send(
            &c,
            &gw,
            "POST",
            "/webhooks/psp",
            &[("content-type", "text/plain")],
            "event_id=evt_1",
        )
        .await;
        assert_problem(
            &got,
            400,
            Some("body-not-json"),
            &format!("a body that is not JSON, attempt {attempt}"),
        );
    }
    assert_eq!(up.total(), 0, "not JSON: refused, nothing ran");
}

// ------------------------------------------------------------- precedence

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_matching_route_wins() {
    let up = Echo::start().await;
    let routes = r#"
[[routes]]
name = "refunds"
path = "/payments/{id}/refunds"
guard = false

[[routes]]
name = "payments"
path = "/payments"
require_key = true

[[routes]]
name = "archive"
path = "/payments/archive"
guard = false
"#;
    let gw = Gw::start("precedence", &up, "", routes).await;
    let c = client();

    // The specific route listed first wins over the broader one.
    let refund = post(&c, &gw, "/payments/p1/refunds", None, r#"{"amount":1}"#).await;
    assert_executed(
        &refund,
        201,
        "keyless POST under the unguarded refunds route",
    );
    for _ in 0..2 {
        let got = post(&c, &gw, "/payments/p1/refunds/r9", Some("k-ref"), "{}").await;
        assert_executed(&got, 201, "refunds is passed through: no replay");
    }
    assert_eq!(up.on("/payments/p1/refunds"), 3);

    // `{id}` is exactly one segment: these are payments requests.
    for path in [
        "/payments/refunds",
        "/payments/p1/x/refunds",
        "/payments/p1",
    ] {
        let got = post(&c, &gw, path, None, "{}").await;
        assert_problem(
            &got,
            400,
            Some("key-required"),
            &format!("keyless POST {path}"),
        );
    }
    // Listed after the broader payments route, archive never matches.
    let archive = post(&c, &gw, "/payments/archive", None, "{}").await;
    assert_problem(
        &archive,
        400,
        Some("key-required"),
        "a route shadowed by an earlier, broader one",
    );
    let first = post(&c, &gw, "/payments/archive", Some("k-arch"), "{}").await;
    assert_executed(&first, 201, "archive under the payments rules");
    let again = post(&c, &gw, "/payments/archive", Some("k-arch"), "{}").await;
    assert_replay_of(&again, &first, "archive is guarded by payments");
    assert_eq!(up.on("/payments/archive"), 1);
    // Outside every route: the top-level rules (no key required).
    let other = post(&c, &gw, "/orders", None, "{}").await;
    assert_executed(&other, 201, "default route");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_covers_only_its_methods() {
    let up = Echo::start().await;
    let routes = r#"
[[routes]]
name = "payments"
methods = ["POST"]
path = "/payments"
require_key = true

[[routes]]
name = "edits"
methods = ["PATCH"]
path = "/payments/{id}"
guard = false
"#;
    let gw = Gw::start("methods", &up, "", routes).await;
    let c = client();

    let post_nokey = post(&c, &gw, "/payments/7", None, "{}").await;
    assert_problem(
        &post_nokey,
        400,
        Some("key-required"),
        "keyless POST /payments/7",
    );

    // PATCH is not the payments route's: the next route (edits, unguarded).
    for _ in 0..2 {
        let got = send(
            &c,
            &gw,
            "PATCH",
            "/payments/7",
            &[("idempotency-key", "k-edit")],
            "{}",
        )
        .await;
        assert_executed(&got, 201, "PATCH /payments/7 under edits");
    }
    assert_eq!(up.on("/payments/7"), 2, "edits passes PATCH through");
    assert!(up
        .execs()
        .iter()
        .filter(|e| e.path == "/payments/7")
        .all(|e| e.method == "PATCH"));

    // PATCH /payments matches neither: the default rules (PATCH guarded,
    // no key required).
    let nokey = send(&c, &gw, "PATCH", "/payments", &[], "{}").await;
    assert_executed(
        &nokey,
        201,
        "keyless PATCH /payments under the default route",
    );
    let first = send(
        &c,
        &gw,
        "PATCH",
        "/payments",
        &[("idempotency-key", "k-p")],
        "{}",
    )
    .await;
    assert_executed(&first, 201, "PATCH /payments with a key");
    let again = send(
        &c,
        &gw,
        "PATCH",
        "/payments",
        &[("idempotency-key", "k-p")],
        "{}",
    )
    .await;
    assert_replay_of(&again, &first, "the default route guards PATCH");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_spelling_of_the_path_gets_the_payments_rules() {
    let up = Echo::start().await;
    let routes = r#"
[[routes]]
name = "payments"
path = "/payments"
require_key = true
"#;
    let gw = Gw::start("spellings", &up, "", routes).await;
    let c = client();
    for path in [
        "/payments",
        "/PAYMENTS",
        "/Payments/42",
        "/%70ayments",
        "/%50AYMENTS/42",
        "//payments",
        "/./payments",
    ] {
        let got = post(&c, &gw, path, None, "{}").await;
        assert_problem(
            &got,
            400,
            Some("key-required"),
            &format!("keyless POST {path}"),
        );
    }
    assert_eq!(up.total(), 0, "{:?}", up.execs());
    let other = post(&c, &gw, "/paymentsx", None, "{}").await;
    assert_executed(&other, 201, "/paymentsx is not under /payments");
}

// ------------------------------------------------------ per-route settings

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn require_key_on_one_route_only() {
    let up = Echo::start().await;
    let routes = r#"
[[routes]]
name = "payments"
path = "/payments"
require_key = true

[[routes]]
name = "carts"
path = "/carts"
"#;
    let gw = Gw::start("require-key", &up, "", routes).await;
    let c = client();
    let pay = post(&c, &gw, "/payments", None, r#"{"amount":1}"#).await;
    assert_problem(&pay, 400, Some("key-required"), "keyless POST /payments");
    assert_eq!(up.total(), 0);
    let cart = post(&c, &gw, "/carts", None, r#"{"item":1}"#).await;
    assert_executed(&cart, 201, "keyless POST /carts");
    let other = post(&c, &gw, "/orders", None, r#"{"item":1}"#).await;
    assert_executed(&other, 201, "keyless POST under the default route");
    assert_eq!(up.total(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn require_key_at_the_top_and_off_on_one_route() {
    let up = Echo::start().await;
    let routes = r#"
[[routes]]
name = "carts"
path = "/carts"
require_key = false
"#;
    let gw = Gw::start("require-key-top", &up, "require_key = true", routes).await;
    let c = client();
    let cart = post(&c, &gw, "/carts", None, "{}").await;
    assert_executed(&cart, 201, "keyless POST /carts (the route says no)");
    let other = post(&c, &gw, "/orders", None, "{}").await;
    assert_problem(
        &other,
        400,
        Some("key-required"),
        "keyless POST under the top-level rule",
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unguarded_route_is_passed_through() {
    let up = Echo::start().await;
    let routes = r#"
[[routes]]
name = "carts"
path = "/carts"
guard = false
"#;
    let gw = Gw::start("guard-false", &up, "", routes).await;
    let c = client();
    for i in 0..2 {
        let got = post(&c, &gw, "/carts/1", Some("k-cart"), r#"{"item":1}"#).await;
        assert_executed(&got, 201, &format!("cart {i}"));
        assert!(
            got.headers.get("idempotent-replayed").is_none(),
            "no Idempotent-Replayed at all on an unguarded route: {got:?}"
        );
    }
    assert_eq!(up.on("/carts"), 2, "guard = false: both run");
    for e in up.execs() {
        assert_eq!(
            e.headers["idempotency-key"], "k-cart",
            "the key reaches the upstream untouched"
        );
    }
    // The same key elsewhere is guarded.
    let first = post(&c, &gw, "/orders", Some("k-cart"), "{}").await;
    assert_executed(&first, 201, "default route");
    let again = post(&c, &gw, "/orders", Some("k-cart"), "{}").await;
    assert_replay_of(&again, &first, "default route replays");
    assert_eq!(up.total(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ttl_per_route_is_the_stored_expiry() {
    let dir = tempfile::tempdir().unwrap();
    let store = sqlite_store(dir.path());
    ttl_per_route_in(dir, &store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ttl_per_route_is_the_stored_expiry_on_redis() {
    let dir = tempfile::tempdir().unwrap();
    let redis = support::RedisProc::start(dir.path(), support::free_addr().port());
    let store = format!("redis://127.0.0.1:{}/", redis.port);
    ttl_per_route_in(dir, &store).await;
    // The records' own Redis expiry follows the route too.
    let port = redis.port.to_string();
    let keys = support::stdout_of("redis-cli", &["-p", &port, "--scan", "--pattern", "*:r"]);
    let mut pttl: Vec<u64> = keys
        .lines()
        .map(|k| {
            support::stdout_of("redis-cli", &["-p", &port, "PTTL", k.trim()])
                .parse()
                .unwrap()
        })
        .collect();
    pttl.sort_unstable();
    let hour = 3_600_000u64;
    assert_eq!(pttl.len(), 3, "three records: {keys}");
    // Redis keeps a record a while past its TTL (`keep_expired`, 1 h by
    // default): the same margin on every route, so compare differences.
    assert!(
        pttl[0] >= 2 * hour - 60_000 && pttl[0] < 48 * hour,
        "the short route's record expires in Redis after 2h (+ keep_expired): {pttl:?}"
    );
    for t in &pttl[1..] {
        let gap = t - pttl[0];
        assert!(
            (46 * hour - 60_000..=46 * hour + 60_000).contains(&gap),
            "the others 46 h later (48h - 2h): {pttl:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ttl_per_route_is_the_stored_expiry_on_postgres() {
    let base = support::POSTGRES.require();
    let schema = support::unique("routes_ttl");
    let store = support::with_param(
        &support::with_param(&base, "idem_schema", &schema),
        "idem_table",
        "records",
    );
    struct DropSchema(String, String);
    impl Drop for DropSchema {
        fn drop(&mut self) {
            support::cleanup(
                &format!("schema {}", self.1),
                "psql",
                &[
                    &self.0,
                    "-q",
                    "-c",
                    &format!("DROP SCHEMA IF EXISTS \"{}\" CASCADE", self.1),
                ],
            );
        }
    }
    let _cleanup = DropSchema(base, schema);
    ttl_per_route_in(tempfile::tempdir().unwrap(), &store).await;
}

/// Three routes' TTLs (own 2h, inherited 48h, default 48h) as the records
/// of `store` show them.
async fn ttl_per_route_in(dir: tempfile::TempDir, store: &str) {
    let store = store.to_owned();
    let up = Echo::start().await;
    let routes = r#"
[[routes]]
name = "short"
path = "/short"
ttl = "2h"

[[routes]]
name = "inherits"
path = "/inherits"
require_key = false
"#;
    let gw = Gw::start_in(dir, "ttl", &up, Some(&store), r#"ttl = "48h""#, routes).await;
    let c = client();
    let before = now_ms();
    assert_executed(
        &post(&c, &gw, "/short", Some("k-short"), "{}").await,
        201,
        "short",
    );
    assert_executed(
        &post(&c, &gw, "/long", Some("k-long"), "{}").await,
        201,
        "default",
    );
    assert_executed(
        &post(&c, &gw, "/inherits", Some("k-inh"), "{}").await,
        201,
        "a route without ttl",
    );
    let after = now_ms();
    let expires = |key: &str| {
        let r = record(&store, key);
        assert_eq!(r["state"], "completed", "{r}");
        r["expires_at_ms"]
            .as_u64()
            .unwrap_or_else(|| panic!("no expires_at_ms: {r}"))
    };
    let hour = 3_600_000;
    let short = expires("k-short");
    assert!(
        short >= before + 2 * hour - 1000 && short <= after + 2 * hour + 1000,
        "the short route's ttl is 2h: expires {} ms from now",
        short.saturating_sub(after)
    );
    let long = expires("k-long");
    assert!(
        long >= before + 48 * hour - 1000 && long <= after + 48 * hour + 1000,
        "the default route's ttl is the top-level 48h: expires {} ms from now",
        long.saturating_sub(after)
    );
    let inherited = expires("k-inh");
    assert!(
        inherited >= before + 48 * hour - 1000 && inherited <= after + 48 * hour + 1000,
        "a route without ttl inherits the top-level 48h: expires {} ms from now",
        inherited.saturating_sub(after)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_per_route_is_the_held_claim() {
    let dir = tempfile::tempdir().unwrap();
    let store = sqlite_store(dir.path());
    let up = Echo::start().await;
    let routes = r#"
[[routes]]
name = "payments"
path = "/payments"
lease = "8s"
"#;
    let gw = Gw::start_in(dir, "lease", &up, Some(&store), r#"lease = "40s""#, routes).await;
    let c = client();
    let slow = |path: &'static str, key: &'static str| {
        let c = c.clone();
        let url = gw.url(path);
        tokio::spawn(async move {
            c.post(url)
                .header("idempotency-key", key)
                .header("content-type", "application/json")
                .header("x-sleep-ms", "4000")
                .body("{}")
                .send()
                .await
                .map(|r| r.status().as_u16())
        })
    };
    let a = slow("/payments", "k-pay");
    let b = slow("/orders", "k-ord");
    let deadline = Instant::now() + Duration::from_secs(10);
    while up.total() < 2 {
        assert!(
            Instant::now() < deadline,
            "the upstream was not called:\n{}",
            gw.logs()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let now = now_ms();
    let lease_left = |key: &str| {
        let r = record(&store, key);
        assert_eq!(r["state"], "in-flight", "{r}");
        r["lease_until_ms"]
            .as_u64()
            .unwrap_or_else(|| panic!("no lease_until_ms: {r}"))
            .saturating_sub(now)
    };
    let pay = lease_left("k-pay");
    assert!(
        (3_000..=9_000).contains(&pay),
        "the payments route's lease is 8s: {pay} ms left"
    );
    let ord = lease_left("k-ord");
    assert!(
        (30_000..=41_000).contains(&ord),
        "the default route's lease is the top-level 40s: {ord} ms left"
    );
    assert_eq!(a.await.unwrap().unwrap(), 201);
    assert_eq!(b.await.unwrap().unwrap(), 201);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_per_route() {
    let up = Echo::start().await;
    let routes = r#"
[[routes]]
name = "payments"
path = "/payments"
wait = "10s"
"#;
    let gw = Gw::start("wait", &up, "", routes).await;
    let c = client();
    for (path, key) in [("/payments", "k-w1"), ("/orders", "k-w2")] {
        let original = {
            let c = c.clone();
            let url = gw.url(path);
            tokio::spawn(async move {
                c.post(url)
                    .header("idempotency-key", key)
                    .header("content-type", "application/json")
                    .header("x-sleep-ms", "2000")
                    .body("{}")
                    .send()
                    .await
                    .unwrap()
                    .status()
                    .as_u16()
            })
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while up.on(path) == 0 {
            assert!(
                Instant::now() < deadline,
                "{path}: not called:\n{}",
                gw.logs()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let dup = send(
            &c,
            &gw,
            "POST",
            path,
            &[("idempotency-key", key), ("x-sleep-ms", "2000")],
            "{}",
        )
        .await;
        if path == "/payments" {
            assert_eq!(dup.status, 201, "wait = 10s: the duplicate waits: {dup:?}");
            assert!(dup.replayed, "and gets the replay: {dup:?}");
        } else {
            assert_problem(&dup, 409, Some("in-flight"), "default wait 0: 409 at once");
        }
        assert_eq!(original.await.unwrap(), 201);
        assert_eq!(up.on(path), 1, "{path}: one execution");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_5xx_replays_a_500_on_its_route_only() {
    let up = Echo::start().await;
    let routes = r#"
[[routes]]
name = "payments"
path = "/payments"
status_policy = "store-5xx"
"#;
    let gw = Gw::start("store-5xx", &up, "", routes).await;
    let c = client();
    let fail = [("idempotency-key", "k-500"), ("x-status", "500")];
    // One key on two routes (one scope) is one record: another key there.
    let fail_b = [("idempotency-key", "k-500b"), ("x-status", "500")];
    let first = send(&c, &gw, "POST", "/payments", &fail, "{}").await;
    assert_executed(&first, 500, "payments 500");
    let again = send(&c, &gw, "POST", "/payments", &fail, "{}").await;
    assert_replay_of(&again, &first, "store-5xx: the 500 is replayed");
    assert_eq!(up.on("/payments"), 1);

    let first = send(&c, &gw, "POST", "/orders", &fail_b, "{}").await;
    assert_executed(&first, 500, "default 500");
    let again = send(&c, &gw, "POST", "/orders", &fail_b, "{}").await;
    assert_executed(
        &again,
        500,
        "default policy: a 500 is released, the retry runs",
    );
    assert_eq!(up.on("/orders"), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_status_override_holds_a_504() {
    let up = Echo::start().await;
    let routes = r#"
[[routes]]
name = "payments"
path = "/payments"
statuses = { "504" = "hold" }
"#;
    let gw = Gw::start("hold-504", &up, "", routes).await;
    let c = client();
    let timeout = [("idempotency-key", "k-504"), ("x-status", "504")];
    // One key on two routes (one scope) is one record: another key there.
    let timeout_b = [("idempotency-key", "k-504b"), ("x-status", "504")];
    let first = send(&c, &gw, "POST", "/payments", &timeout, "{}").await;
    assert_eq!(first.status, 504, "{first:?}");
    let again = send(&c, &gw, "POST", "/payments", &timeout, "{}").await;
    assert_problem(
        &again,
        409,
        Some("held"),
        "504 held: the key stays in flight, held (timeout)",
    );
    assert_eq!(up.on("/payments"), 1, "held: the retry does not run");

    let first = send(&c, &gw, "POST", "/orders", &timeout_b, "{}").await;
    assert_eq!(first.status, 504, "{first:?}");
    let again = send(&c, &gw, "POST", "/orders", &timeout_b, "{}").await;
    assert_executed(&again, 504, "default policy: an upstream 504 is released");
    assert_eq!(up.on("/orders"), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_body_per_route() {
    let up = Echo::start().await;
    let routes = r#"
[[routes]]
name = "small"
path = "/small"
max_body = "1KiB"
"#;
    let gw = Gw::start("max-body", &up, "", routes).await;
    let c = client();
    let big = serde_json::json!({ "blob": "y".repeat(4000) }).to_string();
    let refused = post(&c, &gw, "/small", Some("k-big"), &big).await;
    assert_problem(
        &refused,
        413,
        Some("body-too-large"),
        "4 kB on a 1 KiB route",
    );
    assert_eq!(up.total(), 0);
    let fits = post(&c, &gw, "/small", Some("k-small"), r#"{"blob":"y"}"#).await;
    assert_executed(&fits, 201, "a small body on the small route");
    let elsewhere = post(&c, &gw, "/large", Some("k-big"), &big).await;
    assert_executed(&elsewhere, 201, "4 kB under the default 10 MiB");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_limit_per_route() {
    let up = Echo::start().await;
    let routes = r#"
[[routes]]
name = "reports"
path = "/reports"
retention_limit = "1KiB"
"#;
    let gw = Gw::start("retention", &up, "", routes).await;
    let c = client();
    let big = [("idempotency-key", "k-rep"), ("x-size", "4096")];
    // One key on two routes (one scope) is one record: another key there.
    let big_b = [("idempotency-key", "k-rep2"), ("x-size", "4096")];
    let first = send(&c, &gw, "POST", "/reports", &big, "{}").await;
    assert_executed(&first, 201, "a 4 kB answer reaches its first caller");
    assert!(first.body.len() >= 4096);
    let again = send(&c, &gw, "POST", "/reports", &big, "{}").await;
    assert_problem(
        &again,
        410,
        Some("response-not-retained"),
        "past the route's 1 KiB",
    );
    assert_eq!(up.on("/reports"), 1, "not run again");

    let first = send(&c, &gw, "POST", "/other", &big_b, "{}").await;
    assert_executed(&first, 201, "default route");
    let again = send(&c, &gw, "POST", "/other", &big_b, "{}").await;
    assert_replay_of(&again, &first, "under the default 1 MiB the answer is kept");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scope_headers_per_route() {
    let up = Echo::start().await;
    let routes = r#"
[[routes]]
name = "payments"
path = "/payments"
scope_headers = ["x-api-key"]
"#;
    let gw = Gw::start("scope", &up, "", routes).await;
    let c = client();
    let as_caller = |api: &'static str| [("idempotency-key", "k-shared"), ("x-api-key", api)];
    let alice = send(&c, &gw, "POST", "/payments", &as_caller("alice"), "{}").await;
    let bob = send(&c, &gw, "POST", "/payments", &as_caller("bob"), "{}").await;
    assert_executed(&alice, 201, "alice");
    assert_executed(&bob, 201, "bob: another scope on this route");
    let alice2 = send(&c, &gw, "POST", "/payments", &as_caller("alice"), "{}").await;
    assert_replay_of(&alice2, &alice, "alice again");
    assert_eq!(up.on("/payments"), 2);

    // The default route scopes by Authorization: neither sends one, so the
    // two share the anonymous scope.
    let alice = send(&c, &gw, "POST", "/orders", &as_caller("alice"), "{}").await;
    let bob = send(&c, &gw, "POST", "/orders", &as_caller("bob"), "{}").await;
    assert_executed(&alice, 201, "alice on the default route");
    assert_replay_of(
        &bob,
        &alice,
        "bob shares alice's scope on the default route",
    );
    assert_eq!(up.on("/orders"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ignored_query_parameters_do_not_count() {
    let up = Echo::start().await;
    let routes = r#"
[[routes]]
name = "search"
path = "/search"
fingerprint_ignore_query = ["utm_source"]
"#;
    let gw = Gw::start("ignore-query", &up, "", routes).await;
    let c = client();
    let first = post(&c, &gw, "/search?page=1&utm_source=mail", Some("k-q"), "{}").await;
    assert_executed(&first, 201, "first");
    let other_utm = post(&c, &gw, "/search?page=1&utm_source=ads", Some("k-q"), "{}").await;
    assert_replay_of(&other_utm, &first, "another utm_source only");
    let no_utm = post(&c, &gw, "/search?page=1", Some("k-q"), "{}").await;
    assert_replay_of(&no_utm, &first, "without utm_source");
    let other_page = post(&c, &gw, "/search?page=2&utm_source=mail", Some("k-q"), "{}").await;
    assert_problem(&other_page, 422, Some("key-mismatch"), "another page");
    assert_eq!(up.on("/search"), 1);
    assert_eq!(
        up.execs()[0].query.as_deref(),
        Some("page=1&utm_source=mail"),
        "an ignored parameter still reaches the upstream"
    );

    // Elsewhere every parameter counts.
    let first = post(&c, &gw, "/orders?utm_source=mail", Some("k-q2"), "{}").await;
    assert_executed(&first, 201, "default route");
    let other = post(&c, &gw, "/orders?utm_source=ads", Some("k-q2"), "{}").await;
    assert_problem(
        &other,
        422,
        Some("key-mismatch"),
        "default route, another utm_source",
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fingerprint_headers_and_included_fields_per_route() {
    let up = Echo::start().await;
    let routes = r#"
[[routes]]
name = "charges"
path = "/charges"
fingerprint_include = ["/amount"]

[[routes]]
name = "tenants"
path = "/tenants"
fingerprint_headers = ["x-tenant"]
"#;
    let gw = Gw::start("fingerprint-parts", &up, "", routes).await;
    let c = client();
    // Only /amount counts on charges.
    let first = post(
        &c,
        &gw,
        "/charges",
        Some("k-c"),
        r#"{"amount":10,"note":"a"}"#,
    )
    .await;
    assert_executed(&first, 201, "first charge");
    let other_note = post(
        &c,
        &gw,
        "/charges",
        Some("k-c"),
        r#"{"amount":10,"note":"b"}"#,
    )
    .await;
    assert_replay_of(&other_note, &first, "another note, the same amount");
    let other_amount = post(
        &c,
        &gw,
        "/charges",
        Some("k-c"),
        r#"{"amount":11,"note":"a"}"#,
    )
    .await;
    assert_problem(&other_amount, 422, Some("key-mismatch"), "another amount");
    assert_eq!(up.on("/charges"), 1);

    // X-Tenant counts on tenants, not elsewhere.
    let t = |tenant: &'static str| [("idempotency-key", "k-t"), ("x-tenant", tenant)];
    // One key on two routes (one scope) is one record: another key here.
    let t_b = |tenant: &'static str| [("idempotency-key", "k-t2"), ("x-tenant", tenant)];
    let first = send(&c, &gw, "POST", "/tenants", &t("t1"), "{}").await;
    assert_executed(&first, 201, "tenant t1");
    let same = send(&c, &gw, "POST", "/tenants", &t("t1"), "{}").await;
    assert_replay_of(&same, &first, "tenant t1 again");
    let other = send(&c, &gw, "POST", "/tenants", &t("t2"), "{}").await;
    assert_problem(
        &other,
        422,
        Some("key-mismatch"),
        "the same key from tenant t2",
    );
    let first = send(&c, &gw, "POST", "/orders", &t_b("t1"), "{}").await;
    assert_executed(&first, 201, "default route");
    let other = send(&c, &gw, "POST", "/orders", &t_b("t2"), "{}").await;
    assert_replay_of(
        &other,
        &first,
        "X-Tenant does not count on the default route",
    );
    // And the body does count on the default route.
    let changed = post(&c, &gw, "/orders", Some("k-t2"), r#"{"amount":1}"#).await;
    assert_problem(
        &changed,
        422,
        Some("key-mismatch"),
        "another body on the default route",
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn require_token_per_route() {
    let up = Echo::start().await;
    let routes = r#"
[[routes]]
name = "payments"
path = "/payments"
require_token = true
"#;
    let gw = Gw::start("require-token", &up, "", routes).await;
    let c = client();
    let alice = [("authorization", "Bearer alice")];
    let nokey = send(&c, &gw, "POST", "/payments", &alice, "{}").await;
    assert_problem(
        &nokey,
        428,
        Some("token-required"),
        "no token on the token route",
    );
    let made_up = send(
        &c,
        &gw,
        "POST",
        "/payments",
        &[
            ("authorization", "Bearer alice"),
            ("idempotency-key", "made-up"),
        ],
        "{}",
    )
    .await;
    assert_problem(
        &made_up,
        403,
        Some("token-unknown"),
        "a key that is no token",
    );
    assert_eq!(up.total(), 0);

    // The route turns the token endpoint on.
    let issued = c
        .post(gw.url("/_idem/tokens"))
        .header("authorization", "Bearer alice")
        .send()
        .await
        .unwrap();
    assert_eq!(issued.status(), 201, "POST /_idem/tokens:\n{}", gw.logs());
    let v: serde_json::Value = issued.json().await.unwrap();
    let token = v["token"]
        .as_str()
        .unwrap_or_else(|| panic!("{v}"))
        .to_owned();
    let with = [
        ("authorization", "Bearer alice"),
        ("idempotency-key", token.as_str()),
    ];
    let first = send(&c, &gw, "POST", "/payments", &with, "{}").await;
    assert_executed(&first, 201, "a live token");
    let again = send(&c, &gw, "POST", "/payments", &with, "{}").await;
    assert_replay_of(&again, &first, "the token's retry");

    // Elsewhere any key will do.
    let other = send(
        &c,
        &gw,
        "POST",
        "/orders",
        &[
            ("authorization", "Bearer alice"),
            ("idempotency-key", "made-up"),
        ],
        "{}",
    )
    .await;
    assert_executed(&other, 201, "a plain key on the default route");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn top_level_token_prefixes_hold_on_every_route() {
    let up = Echo::start().await;
    let routes = r#"
[[routes]]
name = "carts"
path = "/pay/carts"
guard = false

[[routes]]
name = "relaxed"
path = "/pay/relaxed"
require_key = false
"#;
    let gw = Gw::start("token-prefix", &up, r#"require_token = ["/pay"]"#, routes).await;
    let c = client();
    let who = ("authorization", "Bearer alice");
    for path in ["/pay/carts/1", "/pay/relaxed", "/pay/other"] {
        let none = send(&c, &gw, "POST", path, &[who], "{}").await;
        assert_problem(
            &none,
            428,
            Some("token-required"),
            &format!("{path} without a token"),
        );
        let made_up = send(
            &c,
            &gw,
            "POST",
            path,
            &[who, ("idempotency-key", "made-up")],
            "{}",
        )
        .await;
        assert_problem(
            &made_up,
            403,
            Some("token-unknown"),
            &format!("{path} with a made-up key"),
        );
    }
    assert_eq!(up.total(), 0, "{:?}", up.execs());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_may_guard_a_method_the_top_level_does_not() {
    let up = Echo::start().await;
    let routes = r#"
[[routes]]
name = "uploads"
methods = ["PUT"]
path = "/uploads"
"#;
    let gw = Gw::start("put-route", &up, "", routes).await;
    let c = client();
    let key = [("idempotency-key", "k-put")];
    let first = send(&c, &gw, "PUT", "/uploads/a", &key, r#"{"v":1}"#).await;
    assert_executed(&first, 201, "PUT under uploads");
    let again = send(&c, &gw, "PUT", "/uploads/a", &key, r#"{"v":1}"#).await;
    assert_replay_of(&again, &first, "uploads guards PUT");
    assert_eq!(up.on("/uploads"), 1);
    // PUT elsewhere is not guarded (top-level methods: POST, PATCH).
    for _ in 0..2 {
        let got = send(
            &c,
            &gw,
            "PUT",
            "/files/a",
            &[("idempotency-key", "k-put2")],
            "{}",
        )
        .await;
        assert_executed(&got, 201, "PUT under the default route");
    }
    assert_eq!(up.on("/files"), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_header_per_route() {
    let up = Echo::start().await;
    let routes = r#"
[[routes]]
name = "jobs"
path = "/jobs"
key_header = "X-Request-Id"
"#;
    let gw = Gw::start("key-header", &up, "", routes).await;
    let c = client();
    let first = send(&c, &gw, "POST", "/jobs", &[("x-request-id", "req-1")], "{}").await;
    assert_executed(&first, 201, "first with X-Request-Id");
    let again = send(&c, &gw, "POST", "/jobs", &[("X-Request-Id", "req-1")], "{}").await;
    assert_replay_of(&again, &first, "same X-Request-Id");
    assert_eq!(up.on("/jobs"), 1);
    // On this route Idempotency-Key is just a header: no key, passed through.
    for _ in 0..2 {
        let got = post(&c, &gw, "/jobs", Some("k-j"), "{}").await;
        assert_executed(&got, 201, "Idempotency-Key only, on the X-Request-Id route");
    }
    assert_eq!(up.on("/jobs"), 3);
    // Elsewhere X-Request-Id is not a key.
    for _ in 0..2 {
        let got = send(
            &c,
            &gw,
            "POST",
            "/orders",
            &[("x-request-id", "req-1")],
            "{}",
        )
        .await;
        assert_executed(&got, 201, "X-Request-Id on the default route");
    }
    assert_eq!(up.on("/orders"), 2);
}

// ------------------------------------------------------ logs and metrics

/// Whether a log line names the route `name` (text format: `route="name"`,
/// or `route=name`).
fn names_route(line: &str, name: &str) -> bool {
    line.contains(&format!("route=\"{name}\"")) || line.contains(&format!("route={name} "))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_route_name_is_in_logs_and_metrics() {
    use prometheus_parse::{Scrape, Value};

    let up = Echo::start().await;
    let routes = r#"
[[routes]]
name = "payments"
path = "/payments"

[[routes]]
name = "carts"
path = "/carts"
guard = false

[[routes]]
name = "strict"
path = "/strict"
require_key = true
"#;
    let gw = Gw::start("names", &up, "access_log = true", routes).await;
    let c = client();
    let first = post(&c, &gw, "/payments", Some("k-log-1"), "{}").await;
    assert_executed(&first, 201, "payments");
    let again = post(&c, &gw, "/payments", Some("k-log-1"), "{}").await;
    assert!(again.replayed, "{again:?}");
    assert_executed(
        &post(&c, &gw, "/orders", Some("k-log-2"), "{}").await,
        201,
        "default",
    );

    assert_executed(
        &post(&c, &gw, "/carts/zz-cart-line", None, "{}").await,
        201,
        "carts",
    );

    let refused = post(&c, &gw, "/strict", None, "{}").await;
    assert_problem(&refused, 400, Some("key-required"), "strict");
    let mismatch = post(&c, &gw, "/payments", Some("k-log-1"), r#"{"other":1}"#).await;
    assert_problem(
        &mismatch,
        422,
        Some("key-mismatch"),
        "payments, another body",
    );

    // The per-request log lines (written after the answer: poll briefly).
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let log = gw.proc.logs();
        let lines: Vec<&str> = log
            .lines()
            .filter(|l| l.contains("k-log-1") || l.contains("k-log-2"))
            .collect();
        let pay = lines
            .iter()
            .filter(|l| l.contains("k-log-1") && names_route(l, "payments"))
            .count();
        let default = lines
            .iter()
            .filter(|l| l.contains("k-log-2") && names_route(l, "default"))
            .count();
        let carts = log
            .lines()
            .filter(|l| l.contains("zz-cart-line") && names_route(l, "carts"))
            .count();
        if pay >= 2 && default >= 1 && carts >= 1 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "two request lines with route=\"payments\", one with route=\"default\" and \
             (access_log = true) one with route=\"carts\" for the passed-through cart \
             expected ({pay}, {default}, {carts}); the lines of these keys:\n{}\n{}",
            lines.join("\n"),
            gw.logs()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let text = c
        .get(format!("http://{}/metrics", gw.proc.admin))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let s = Scrape::parse(text.lines().map(|l| Ok(l.to_owned()))).unwrap();
    let value = |outcome: &str, route: &str| -> f64 {
        s.samples
            .iter()
            .filter(|x| x.metric == "idem_requests_total")
            .filter(|x| {
                x.labels.get("outcome") == Some(outcome) && x.labels.get("route") == Some(route)
            })
            .map(|x| match x.value {
                Value::Counter(v) | Value::Gauge(v) | Value::Untyped(v) => v,
                _ => 0.0,
            })
            .sum()
    };
    let series: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("idem_requests_total"))
        .collect();
    assert_eq!(
        value("executed", "payments"),
        1.0,
        "idem_requests_total{{outcome=\"executed\",route=\"payments\"}}:\n{}",
        series.join("\n")
    );
    assert_eq!(value("replayed", "payments"), 1.0, "{}", series.join("\n"));
    assert_eq!(value("executed", "default"), 1.0, "{}", series.join("\n"));
    assert_eq!(value("mismatch", "payments"), 1.0, "{}", series.join("\n"));
    assert_eq!(
        value("rejected", "strict"),
        1.0,
        "a refusal counts under its route:\n{}",
        series.join("\n")
    );
    assert_eq!(
        value("passthrough", "carts"),
        1.0,
        "a passed-through route's request counts under its name:\n{}",
        series.join("\n")
    );
}

// ------------------------------------------------------------ the example

/// `examples/config/idem.toml`.
fn example() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/config/idem.toml")
}

#[test]
fn the_example_passes_config_check() {
    let file = example();
    assert!(file.exists(), "{} is missing", file.display());
    let out = idem()
        .args(["config", "check"])
        .arg(&file)
        .output()
        .expect("run idem config check");
    let (stdout, stderr) = support::succeeded(&out, "idem config check examples/config/idem.toml");
    let at = |name: &str| {
        stdout
            .find(name)
            .unwrap_or_else(|| panic!("{name} is not in the check's output:\n{stdout}\n{stderr}"))
    };
    assert!(
        at("payments") < at("carts") && at("carts") < at("webhooks"),
        "routes in match order:\n{stdout}"
    );
}

#[test]
fn config_check_refuses_a_bad_file() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        (
            "unknown-key",
            "upstream = \"http://127.0.0.1:3000\"\n\n[[routes]]\nname = \"payments\"\npath = \"/payments\"\nttll = \"24h\"\n",
            "ttll",
        ),
        (
            "bad-path",
            "upstream = \"http://127.0.0.1:3000\"\n\n[[routes]]\nname = \"payments\"\npath = \"payments\"\n",
            "payments",
        ),
        (
            "safe-method",
            "upstream = \"http://127.0.0.1:3000\"\n\n[[routes]]\nname = \"reads\"\nmethods = [\"GET\"]\npath = \"/reads\"\n",
            "GET",
        ),
        (
            "both-key-sources",
            "upstream = \"http://127.0.0.1:3000\"\n\n[[routes]]\nname = \"w\"\npath = \"/w\"\nkey_header = \"X-Id\"\nkey_json_pointer = \"/id\"\n",
            "key_json_pointer",
        ),
        (
            "bad-pointer",
            "upstream = \"http://127.0.0.1:3000\"\n\n[[routes]]\nname = \"w\"\npath = \"/w\"\nkey_json_pointer = \"event_id\"\n",
            "event_id",
        ),
        (
            "duplicate-name",
            "upstream = \"http://127.0.0.1:3000\"\n\n[[routes]]\nname = \"a\"\npath = \"/a\"\n\n[[routes]]\nname = \"a\"\npath = \"/b\"\n",
            "\"a\"",
        ),
        (
            "short-lease",
            "upstream = \"http://127.0.0.1:3000\"\n\n[[routes]]\nname = \"p\"\npath = \"/p\"\nlease = \"2s\"\n",
            "lease",
        ),
        (
            "ttl-below-lease",
            "upstream = \"http://127.0.0.1:3000\"\n\n[[routes]]\nname = \"p\"\npath = \"/p\"\nttl = \"10s\"\n",
            "ttl",
        ),
        (
            "named-default",
            "upstream = \"http://127.0.0.1:3000\"\n\n[[routes]]\nname = \"default\"\npath = \"/p\"\n",
            "default",
        ),
        (
            "token-ttl-above-ttl",
            "upstream = \"http://127.0.0.1:3000\"\n\n[[routes]]\nname = \"p\"\npath = \"/p\"\nrequire_token = true\nttl = \"10m\"\n",
            "token",
        ),
        (
            "max-body-above-max-buffered",
            "upstream = \"http://127.0.0.1:3000\"\n\n[[routes]]\nname = \"p\"\npath = \"/p\"\nmax_body = \"1GiB\"\n",
            "max_body",
        ),
        (
            "held-2xx",
            "upstream = \"http://127.0.0.1:3000\"\n\n[[routes]]\nname = \"p\"\npath = \"/p\"\nstatuses = { \"2xx\" = \"release\" }\n",
            "2xx",
        ),
        (
            "wildcard-path",
            "upstream = \"http://127.0.0.1:3000\"\n\n[[routes]]\nname = \"p\"\npath = \"/webhooks/*\"\n",
            "*",
        ),
        (
            "bad-disposition",
            "upstream = \"http://127.0.0.1:3000\"\n\n[[routes]]\nname = \"p\"\npath = \"/p\"\nstatuses = { \"504\" = \"keep\" }\n",
            "keep",
        ),
        (
            "bad-status",
            "upstream = \"http://127.0.0.1:3000\"\n\n[[routes]]\nname = \"p\"\npath = \"/p\"\nstatuses = { \"5x\" = \"hold\" }\n",
            "5x",
        ),
    ];
    let too_many: String = std::iter::once("upstream = \"http://127.0.0.1:3000\"\n".to_owned())
        .chain((0..1001).map(|i| format!("\n[[routes]]\nname = \"r{i}\"\npath = \"/r{i}\"\n")))
        .collect();
    let cases = cases
        .iter()
        .map(|&(n, t, w)| (n, t.to_owned(), w))
        .chain([("too-many", too_many, "1001")]);
    for (name, text, named) in cases {
        let file = dir.path().join(format!("{name}.toml"));
        std::fs::write(&file, text).unwrap();
        let out = idem()
            .args(["config", "check"])
            .arg(&file)
            .output()
            .expect("run idem config check");
        let stderr = String::from_utf8_lossy(&out.stderr);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            !out.status.success(),
            "{name}: a bad file must fail the check:\n{stdout}\n{stderr}"
        );
        assert!(
            stderr.contains(named) || stdout.contains(named),
            "{name}: the error names {named:?}:\n{stdout}\n{stderr}"
        );
        assert!(
            !stderr.contains("panicked"),
            "{name}: a clear error, not a panic:\n{stderr}"
        );
    }
    // The unknown key's line number (line 6).
    let out = idem()
        .args(["config", "check"])
        .arg(dir.path().join("unknown-key.toml"))
        .output()
        .unwrap();
    let all = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        all.contains("line 6") || all.contains(":6:") || all.contains("6 |"),
        "the line of `ttll` (6) is named:\n{all}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_example_runs_its_three_routes() {
    let up = Echo::start().await;
    let dir = tempfile::tempdir().unwrap();
    let file = example().display().to_string();
    // Flags override the file: the test's upstream and an in-memory store.
    let gw = own_gateway(
        dir.path(),
        "example",
        &[
            "--config",
            &file,
            "--upstream",
            &up.url,
            "--store",
            "memory://",
        ],
        &[],
    )
    .await;
    let gw = Gw {
        proc: gw,
        _dir: dir,
        config: example(),
    };
    let c = client();

    // payments: a key is required; with one, a retry is a replay.
    let nokey = post(&c, &gw, "/payments", None, r#"{"amount":10}"#).await;
    assert_problem(&nokey, 400, Some("key-required"), "keyless POST /payments");
    let first = post(&c, &gw, "/payments", Some("pay-1"), r#"{"amount":10}"#).await;
    assert_executed(&first, 201, "payment");
    let again = post(&c, &gw, "/payments", Some("pay-1"), r#"{"amount":10}"#).await;
    assert_replay_of(&again, &first, "payment retry");
    assert_eq!(up.on("/payments"), 1);

    // carts: passed through.
    for _ in 0..2 {
        let got = post(&c, &gw, "/carts/1/items", Some("cart-1"), r#"{"sku":"a"}"#).await;
        assert_executed(&got, 201, "cart");
    }
    assert_eq!(up.on("/carts"), 2);

    // webhooks: the key is the body's event_id; delivered_at does not count.
    let d1 = send(
        &c,
        &gw,
        "POST",
        "/webhooks/psp",
        &[("x-delivery-attempt", "1")],
        &event("evt_9", 10, "2026-12-02T06:00:00Z"),
    )
    .await;
    assert_executed(&d1, 201, "delivery 1");
    let d2 = send(
        &c,
        &gw,
        "POST",
        "/webhooks/psp",
        &[("x-delivery-attempt", "2")],
        &event("evt_9", 10, "2026-12-02T06:01:00Z"),
    )
    .await;
    assert_replay_of(&d2, &d1, "delivery 2");
    assert_eq!(up.on("/webhooks"), 1);
}

// ------------------------------------------------------------------ reload

/// The routes of the reload test: payments with `require_key` on or off.
fn payments_route(require_key: bool) -> String {
    format!(
        "\n[[routes]]\nname = \"payments\"\npath = \"/payments\"\nrequire_key = {require_key}\n"
    )
}

/// How many lines of the gateway's log contain `needle`.
fn log_count(gw: &Gw, needle: &str) -> usize {
    gw.proc
        .logs()
        .lines()
        .filter(|l| l.contains(needle))
        .count()
}

/// Waits (at most 10 s) until the gateway's log has more than `seen` lines
/// containing `needle`.
async fn until_logged(gw: &Gw, needle: &str, seen: usize) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while log_count(gw, needle) <= seen {
        assert!(
            Instant::now() < deadline,
            "no new `{needle}` line within 10 s:\n{}",
            gw.logs()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Sends a keyless `POST path` until it answers 400 `key-required` (the
/// changed file applied), at most 10 s.
async fn until_key_required(c: &reqwest::Client, gw: &Gw, path: &str, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let got = post(c, gw, path, None, "{}").await;
        if got.status == 400 {
            assert_problem(&got, 400, Some("key-required"), what);
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: the change was not applied within 10 s: {got:?}\n{}",
            gw.logs()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_under_load_drops_no_request_and_keeps_the_rules_on_a_bad_file() {
    let up = Echo::start().await;
    let mut gw = Gw::start("reload", &up, "", &payments_route(false)).await;
    let c = client();
    assert_executed(
        &post(&c, &gw, "/payments", None, "{}").await,
        201,
        "keyless POST before the reload",
    );
    let head = std::fs::read_to_string(&gw.config).unwrap();
    let head = head.split("[[routes]]").next().unwrap().to_owned();
    let config = gw.config.clone();
    let write = |routes: &str| std::fs::write(&config, format!("{head}{routes}")).unwrap();

    // A client loop: keyed requests, which every version of the file lets
    // through, must all succeed while the file is rewritten.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let looper = {
        let (c, stop, url) = (c.clone(), stop.clone(), gw.url("/payments"));
        tokio::spawn(async move {
            let (mut ok, mut failed) = (0usize, Vec::new());
            let mut i = 0u64;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                i += 1;
                let r = c
                    .post(&url)
                    .header("idempotency-key", format!("loop-{i}"))
                    .header("content-type", "application/json")
                    .body("{}")
                    .send()
                    .await;
                match r {
                    Ok(r) if r.status() == 201 => ok += 1,
                    Ok(r) => failed.push(format!("loop-{i}: {}", r.status())),
                    Err(e) => failed.push(format!("loop-{i}: {e}")),
                }
            }
            (ok, failed)
        })
    };
    let bad = [
        "\n[[routes]]\nname = \"payments\"\npath = \"payments\"\n",
        "\n[[routes]]\nname = \"payments\"\npath = \"/payments\"\nttll = \"1h\"\n",
        "\n[[routes]\nname = ",
    ];
    for round in 0..20 {
        match round % 4 {
            0 => write(&payments_route(true)),
            1 | 3 => write(bad[round % bad.len()]),
            _ => write(&payments_route(false)),
        }
        gw.proc.signal("-HUP");
        tokio::time::sleep(Duration::from_millis(120)).await;
    }
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let (ok, failed) = looper.await.unwrap();
    assert!(ok > 0, "the client loop ran");
    assert!(
        failed.is_empty(),
        "no request fails during reloads: {failed:?}\n{}",
        gw.logs()
    );
    assert!(
        gw.proc.running(),
        "the gateway survives the reloads:\n{}",
        gw.logs()
    );
    let (applied, refused) = (
        log_count(&gw, "configuration reloaded"),
        log_count(&gw, "configuration reload failed"),
    );
    eprintln!("during the loop: {ok} requests, {applied} reloads applied, {refused} refused");
    assert!(
        applied >= 1 && refused >= 1,
        "the loop saw good and bad reloads ({applied} applied, {refused} refused):\n{}",
        gw.logs()
    );

    // A good file is applied: keyless payments are refused now.
    write(&payments_route(true));
    gw.proc.signal("-HUP");
    until_key_required(&c, &gw, "/payments", "after the reload").await;

    // A bad file changes nothing and says why.
    let failures = log_count(&gw, "configuration reload failed");
    write(bad[0]);
    gw.proc.signal("-HUP");
    until_logged(&gw, "configuration reload failed", failures).await;
    let got = post(&c, &gw, "/payments", None, "{}").await;
    assert_problem(
        &got,
        400,
        Some("key-required"),
        "the running rules are kept",
    );
    let (status, _) = gw.proc.health(&c).await;
    assert_eq!(status, 200, "health is not affected by a bad file");
    let text = c
        .get(format!("http://{}/metrics", gw.proc.admin))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        text.lines()
            .any(|l| l.starts_with("idem_config_last_reload_success")
                && l.trim_end().ends_with(" 0")),
        "idem_config_last_reload_success 0 after a refused reload:\n{}",
        text.lines()
            .filter(|l| l.starts_with("idem_config"))
            .collect::<Vec<_>>()
            .join("\n")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_in_flight_keeps_its_rules_across_a_reload() {
    let up = Echo::start().await;
    let policy = |p: &str| {
        format!(
            "\n[[routes]]\nname = \"payments\"\npath = \"/payments\"\nstatus_policy = \"{p}\"\n"
        )
    };
    let gw = Gw::start("reload-in-flight", &up, "", &policy("store-5xx")).await;
    let c = client();
    let slow_500 = [
        ("idempotency-key", "k-fly"),
        ("x-status", "500"),
        ("x-sleep-ms", "3000"),
    ];
    let original = {
        let (c, url) = (c.clone(), gw.url("/payments"));
        tokio::spawn(async move {
            let mut r = c.post(url).body("{}");
            for (n, v) in slow_500 {
                r = r.header(n, v);
            }
            r.header("content-type", "application/json")
                .send()
                .await
                .unwrap()
                .status()
                .as_u16()
        })
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while up.total() == 0 {
        assert!(Instant::now() < deadline, "not called:\n{}", gw.logs());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // The new rules release 500s; the request in flight started under
    // store-5xx and keeps it.
    let text = std::fs::read_to_string(&gw.config).unwrap();
    std::fs::write(&gw.config, text.replace("store-5xx", "default")).unwrap();
    gw.proc.signal("-HUP");
    until_logged(&gw, "configuration reloaded", 0).await;
    assert!(
        !original.is_finished(),
        "the reload was applied while the request was in flight (3 s upstream)"
    );
    assert_eq!(original.await.unwrap(), 500);
    let retry = send(&c, &gw, "POST", "/payments", &slow_500, "{}").await;
    assert!(
        retry.replayed && retry.status == 500,
        "stored under the rules it started with (store-5xx): {retry:?}\n{}",
        gw.logs()
    );
    assert_eq!(up.total(), 1);
    // A request started after the reload gets the new rules.
    let fresh = [("idempotency-key", "k-new"), ("x-status", "500")];
    assert_executed(
        &send(&c, &gw, "POST", "/payments", &fresh, "{}").await,
        500,
        "new",
    );
    assert_executed(
        &send(&c, &gw, "POST", "/payments", &fresh, "{}").await,
        500,
        "default policy after the reload: released, runs again",
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_file_is_applied_without_a_signal() {
    let up = Echo::start().await;
    let gw = Gw::start("reload-watch", &up, "", &payments_route(false)).await;
    let c = client();
    assert_executed(&post(&c, &gw, "/payments", None, "{}").await, 201, "before");
    let text = std::fs::read_to_string(&gw.config).unwrap();
    std::fs::write(
        &gw.config,
        text.replace("require_key = false", "require_key = true"),
    )
    .unwrap();
    until_key_required(&c, &gw, "/payments", "after the file changed").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn variables_and_flags_override_the_file_and_routes_inherit_them() {
    let up = Echo::start().await;
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("idem.toml");
    std::fs::write(
        &config,
        "upstream = \"http://127.0.0.1:9\"\nstore = \"memory://\"\nrequire_key = false\n\
         \n[[routes]]\nname = \"carts\"\npath = \"/carts\"\n\
         \n[[routes]]\nname = \"open\"\npath = \"/open\"\nrequire_key = false\n",
    )
    .unwrap();
    let path = config.display().to_string();
    // The flag gives the upstream (the file's answers nothing), the
    // variable turns require_key on.
    let proc = own_gateway(
        dir.path(),
        "override",
        &["--config", &path, "--upstream", &up.url],
        &[("IDEM_REQUIRE_KEY", "true".into())],
    )
    .await;
    let gw = Gw {
        proc,
        _dir: dir,
        config,
    };
    let c = client();
    let top = post(&c, &gw, "/orders", None, "{}").await;
    assert_problem(
        &top,
        400,
        Some("key-required"),
        "IDEM_REQUIRE_KEY over the file",
    );
    let carts = post(&c, &gw, "/carts", None, "{}").await;
    assert_problem(
        &carts,
        400,
        Some("key-required"),
        "a route without require_key inherits the overridden top level",
    );
    let open = post(&c, &gw, "/open", None, "{}").await;
    assert_executed(&open, 201, "a route's own require_key = false stays");
    assert_eq!(up.total(), 1, "the --upstream flag won over the file's");
}

// ------------------------------------------------------- chunked bodies

/// A raw HTTP/1.1 POST with a chunked body (no Content-Length), one chunk
/// per item of `chunks`; returns the status and the whole answer as text.
async fn chunked_post(
    gw: &Gw,
    path: &str,
    headers: &[(&str, &str)],
    chunks: &[&str],
) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(gw.proc.addr).await.unwrap();
    let mut req = format!(
        "POST {path} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\n\
         Transfer-Encoding: chunked\r\nConnection: close\r\n",
        gw.proc.addr
    );
    for (n, v) in headers {
        req.push_str(&format!("{n}: {v}\r\n"));
    }
    req.push_str("\r\n");
    for c in chunks {
        req.push_str(&format!("{:x}\r\n{c}\r\n", c.len()));
    }
    req.push_str("0\r\n\r\n");
    // The gateway may answer (413) before it has read everything.
    let _ = s.write_all(req.as_bytes()).await;
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut out)).await;
    let text = String::from_utf8_lossy(&out).into_owned();
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no status line in {text:?}\n{}", gw.logs()));
    (status, text)
}

fn replayed_raw(answer: &str) -> bool {
    answer
        .to_ascii_lowercase()
        .contains("\r\nidempotent-replayed: true\r\n")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chunked_bodies_meet_the_route_max_body_and_carry_body_keys() {
    let up = Echo::start().await;
    let routes = r#"
[[routes]]
name = "small"
path = "/small"
max_body = "1KiB"

[[routes]]
name = "webhooks"
path = "/webhooks"
key_json_pointer = "/event_id"
require_key = true
max_body = "1KiB"
"#;
    let gw = Gw::start("chunked", &up, "", routes).await;
    let big = "y".repeat(1000);
    let chunks = ["{\"blob\":\"", &big, &big, &big, "\"}"];
    let (status, answer) =
        chunked_post(&gw, "/small", &[("Idempotency-Key", "k-ch")], &chunks).await;
    assert_eq!(status, 413, "3 kB chunked on a 1 KiB route:\n{answer}");
    let (status, answer) = chunked_post(&gw, "/webhooks/psp", &[], &chunks).await;
    assert_eq!(
        status, 413,
        "3 kB chunked on a 1 KiB body-key route:\n{answer}"
    );
    let (status, answer) =
        chunked_post(&gw, "/elsewhere", &[("Idempotency-Key", "k-ch")], &chunks).await;
    assert_eq!(
        status, 201,
        "3 kB chunked under the default max_body:\n{answer}"
    );
    assert_eq!(up.total(), 1);

    // A key in a chunked JSON body, split across chunks.
    let event = ["{\"event_id\":\"ev", "t_ch\",\"amount\":", "5}"];
    let (status, first) = chunked_post(&gw, "/webhooks/psp", &[], &event).await;
    assert_eq!(status, 201, "{first}");
    assert!(!replayed_raw(&first), "{first}");
    let (status, again) = chunked_post(&gw, "/webhooks/psp", &[], &event).await;
    assert_eq!(status, 201, "{again}");
    assert!(
        replayed_raw(&again),
        "the same event, chunked: a replay:\n{again}"
    );
    assert_eq!(up.total(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_deliveries_of_one_event_run_once() {
    let up = Echo::start().await;
    let routes = format!("{WEBHOOKS}wait = \"10s\"\n");
    let gw = Gw::start("webhook-concurrent", &up, "", &routes).await;
    let c = client();
    let body = event("evt_c", 7, "2026-12-02T06:00:00Z");
    let mut tasks = Vec::new();
    for attempt in 0..10 {
        let (c, url, body) = (c.clone(), gw.url("/webhooks/psp"), body.clone());
        tasks.push(tokio::spawn(async move {
            let r = c
                .post(url)
                .header("content-type", "application/json")
                .header("x-delivery-attempt", attempt.to_string())
                .header("x-sleep-ms", "300")
                .body(body)
                .send()
                .await
                .unwrap();
            let replayed = r.headers().contains_key("idempotent-replayed");
            (r.status().as_u16(), replayed, r.text().await.unwrap())
        }));
    }
    let mut answers = Vec::new();
    for t in tasks {
        answers.push(t.await.unwrap());
    }
    assert_eq!(
        up.total(),
        1,
        "ten concurrent deliveries, one execution: {answers:?}"
    );
    assert!(
        answers
            .iter()
            .all(|(s, _, b)| *s == 201 && *b == answers[0].2),
        "each waits (wait = 10s) and gets the one answer: {answers:?}"
    );
    assert_eq!(
        answers.iter().filter(|(_, r, _)| !r).count(),
        1,
        "one original, nine replays: {answers:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_may_reorder_the_routes() {
    let up = Echo::start().await;
    let narrow = "\n[[routes]]\nname = \"refunds\"\npath = \"/payments/refunds\"\nguard = false\n";
    let broad = "\n[[routes]]\nname = \"payments\"\npath = \"/payments\"\nrequire_key = true\n";
    let gw = Gw::start("reorder", &up, "", &format!("{narrow}{broad}")).await;
    let c = client();
    let before = post(&c, &gw, "/payments/refunds", None, "{}").await;
    assert_executed(&before, 201, "refunds listed first wins");

    let text = std::fs::read_to_string(&gw.config).unwrap();
    let head = text.split("[[routes]]").next().unwrap();
    std::fs::write(&gw.config, format!("{head}{broad}{narrow}")).unwrap();
    gw.proc.signal("-HUP");
    until_key_required(&c, &gw, "/payments/refunds", "payments listed first now").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_keeps_the_variables_over_the_file_and_routes_inherit_the_new_top_level() {
    let up = Echo::start().await;
    let dir = tempfile::tempdir().unwrap();
    let store = sqlite_store(dir.path());
    let config = dir.path().join("idem.toml");
    let file = |ttl: &str| {
        format!(
            "upstream = {:?}\nstore = {store:?}\nrequire_key = false\nttl = \"{ttl}\"\n\
             \n[[routes]]\nname = \"r\"\npath = \"/r\"\nmethods = [\"POST\"]\n",
            up.url
        )
    };
    std::fs::write(&config, file("2h")).unwrap();
    let path = config.display().to_string();
    let proc = own_gateway(
        dir.path(),
        "reload-env",
        &["--config", &path],
        &[("IDEM_REQUIRE_KEY", "true".into())],
    )
    .await;
    let gw = Gw {
        proc,
        _dir: dir,
        config,
    };
    let c = client();
    let hour = 3_600_000u64;
    let expiry_in = |key: &str| {
        record(&store, key)["expires_at_ms"]
            .as_u64()
            .unwrap_or(0)
            .saturating_sub(now_ms())
    };
    assert_executed(
        &post(&c, &gw, "/r", Some("k-2h"), "{}").await,
        201,
        "before",
    );
    let left = expiry_in("k-2h");
    assert!(
        (2 * hour - 60_000..=2 * hour).contains(&left),
        "the route inherits ttl 2h: {left} ms"
    );

    std::fs::write(&gw.config, file("5h")).unwrap();
    gw.proc.signal("-HUP");
    until_logged(&gw, "configuration reloaded", 0).await;
    assert_executed(&post(&c, &gw, "/r", Some("k-5h"), "{}").await, 201, "after");
    let left = expiry_in("k-5h");
    assert!(
        (5 * hour - 60_000..=5 * hour).contains(&left),
        "after the reload the route inherits the new top-level ttl 5h: {left} ms\n{}",
        gw.logs()
    );
    let keyless = post(&c, &gw, "/r", None, "{}").await;
    assert_problem(
        &keyless,
        400,
        Some("key-required"),
        "IDEM_REQUIRE_KEY=true still overrides the reloaded file",
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fingerprint_parts_may_be_left_out() {
    let up = Echo::start().await;
    let routes = r#"
[[routes]]
name = "items"
path = "/items"
fingerprint_path = false
fingerprint_method = false

[[routes]]
name = "things"
path = "/things"
fingerprint_path = false

[[routes]]
name = "notes"
path = "/notes"
fingerprint_body = false
"#;
    let gw = Gw::start("fingerprint-off", &up, "", routes).await;
    let c = client();
    let key = |k: &'static str| [("idempotency-key", k)];

    // Path and method left out on items: another item, PATCH, same key.
    let first = send(&c, &gw, "POST", "/items/1", &key("k-i"), "{}").await;
    assert_executed(&first, 201, "items/1");
    let other_path = send(&c, &gw, "POST", "/items/2", &key("k-i"), "{}").await;
    assert_replay_of(&other_path, &first, "fingerprint_path = false");
    let patch = send(&c, &gw, "PATCH", "/items/1", &key("k-i"), "{}").await;
    assert_replay_of(&patch, &first, "fingerprint_method = false");
    let body = send(&c, &gw, "POST", "/items/1", &key("k-i"), r#"{"a":1}"#).await;
    assert_problem(
        &body,
        422,
        Some("key-mismatch"),
        "the body still counts on items",
    );
    // Without the path the route's name counts: the same key and body on
    // another such route is another request.
    let things = send(&c, &gw, "POST", "/things/1", &key("k-i"), "{}").await;
    assert_problem(
        &things,
        422,
        Some("key-mismatch"),
        "one key on two path-less routes",
    );

    // Body left out on notes.
    let first = post(&c, &gw, "/notes", Some("k-n"), r#"{"text":"a"}"#).await;
    assert_executed(&first, 201, "note");
    let edited = post(&c, &gw, "/notes", Some("k-n"), r#"{"text":"b"}"#).await;
    assert_replay_of(&edited, &first, "fingerprint_body = false");
    assert_eq!(up.total(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idem_config_names_the_file_too() {
    let up = Echo::start().await;
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("idem.toml");
    std::fs::write(
        &config,
        format!(
            "upstream = {:?}\nstore = \"memory://\"\n{}",
            up.url,
            payments_route(true)
        ),
    )
    .unwrap();
    let proc = own_gateway(
        dir.path(),
        "env-config",
        &[],
        &[("IDEM_CONFIG", config.clone().into_os_string())],
    )
    .await;
    let gw = Gw {
        proc,
        _dir: dir,
        config,
    };
    let c = client();
    let got = post(&c, &gw, "/payments", None, "{}").await;
    assert_problem(
        &got,
        400,
        Some("key-required"),
        "routes from IDEM_CONFIG's file",
    );
    assert_executed(
        &post(&c, &gw, "/orders", None, "{}").await,
        201,
        "default route",
    );
}

#[test]
fn a_bad_file_stops_the_gateway_at_start_naming_the_line() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("idem.toml");
    std::fs::write(
        &config,
        "upstream = \"http://127.0.0.1:9\"\nstore = \"memory://\"\n\n[[routes]]\nname = \"p\"\npath = \"/p\"\nstatus_policy = \"store-500\"\n",
    )
    .unwrap();
    let mut child = idem()
        .args(["gateway", "--listen"])
        .arg(support::free_addr().to_string())
        .arg("--config")
        .arg(&config)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("the gateway kept running on a bad file");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
    assert_eq!(
        status.code(),
        Some(2),
        "a configuration error exits 2:\n{stderr}"
    );
    assert!(
        stderr.contains("store-500") && (stderr.contains(":7:") || stderr.contains("line 7")),
        "names the value and its line (7):\n{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
}

/// Reads more of a response into `rest` (at most 10 s).
async fn read_more(s: &mut tokio::net::TcpStream, rest: &mut Vec<u8>) {
    use tokio::io::AsyncReadExt;
    let mut chunk = [0u8; 4096];
    let n = tokio::time::timeout(Duration::from_secs(10), s.read(&mut chunk))
        .await
        .expect("the body within 10 s")
        .unwrap();
    assert!(n > 0, "closed mid-body");
    rest.extend_from_slice(&chunk[..n]);
}

/// Reads one HTTP/1.1 response from `s` (Content-Length or chunked):
/// its status and body.
async fn read_response(s: &mut tokio::net::TcpStream) -> (u16, String) {
    use tokio::io::AsyncReadExt;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        let n = tokio::time::timeout(Duration::from_secs(10), s.read(&mut chunk))
            .await
            .expect("a response within 10 s")
            .unwrap();
        assert!(
            n > 0,
            "the connection was closed: {:?}",
            String::from_utf8_lossy(&buf)
        );
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_ascii_lowercase();
    let status: u16 = head.split(' ').nth(1).unwrap().parse().unwrap();
    let mut rest = buf[head_end..].to_vec();
    let body = if let Some(len) = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .map(|v| v.trim().parse::<usize>().unwrap())
    {
        while rest.len() < len {
            read_more(s, &mut rest).await;
        }
        rest[..len].to_vec()
    } else {
        // Chunked: read until the last chunk.
        while !rest.windows(5).any(|w| w == b"0\r\n\r\n") {
            read_more(s, &mut rest).await;
        }
        rest
    };
    (status, String::from_utf8_lossy(&body).into_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_connection_survives_a_reload_and_gets_the_new_rules() {
    use tokio::io::AsyncWriteExt;
    let up = Echo::start().await;
    let gw = Gw::start("reload-keepalive", &up, "", &payments_route(false)).await;
    let mut s = tokio::net::TcpStream::connect(gw.proc.addr).await.unwrap();
    let request = format!(
        "POST /payments HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\n\
         Content-Length: 2\r\n\r\n{{}}",
        gw.proc.addr
    );
    s.write_all(request.as_bytes()).await.unwrap();
    let (status, body) = read_response(&mut s).await;
    assert_eq!(status, 201, "keyless POST before the reload: {body}");

    let text = std::fs::read_to_string(&gw.config).unwrap();
    std::fs::write(
        &gw.config,
        text.replace("require_key = false", "require_key = true"),
    )
    .unwrap();
    gw.proc.signal("-HUP");
    until_logged(&gw, "configuration reloaded", 0).await;
    s.write_all(request.as_bytes()).await.unwrap();
    let (status, body) = read_response(&mut s).await;
    assert_eq!(
        status,
        400,
        "the same connection, after the reload: the new rules (require_key): {body}\n{}",
        gw.logs()
    );
    assert!(body.contains("key-required"), "{body}");
    assert_eq!(up.total(), 1);
}

#[test]
fn every_flag_of_the_configuration_table_has_a_file_key() {
    let readme =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../README.md"))
            .unwrap();
    let flags: Vec<String> = readme
        .lines()
        .filter_map(|l| l.strip_prefix("| `--"))
        .filter_map(|l| l.split([' ', '`']).next())
        .filter(|f| *f != "config")
        .map(str::to_owned)
        .collect();
    assert!(
        flags.len() > 20,
        "the README's configuration table: {flags:?}"
    );
    let out = idem()
        .args(["config", "schema"])
        .output()
        .expect("run idem config schema");
    let (schema, _) = support::succeeded(&out, "idem config schema");
    let schema: serde_json::Value = serde_json::from_str(&schema).unwrap();
    let keys = schema["properties"].as_object().expect("properties");
    let missing: Vec<String> = flags
        .iter()
        .map(|f| f.replace('-', "_"))
        .filter(|k| !keys.contains_key(k))
        .collect();
    assert!(
        missing.is_empty(),
        "flags of the README's configuration table without a file key (issue 14: \
         \"every flag in the configuration table has its file equivalent\"): {missing:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_route_name_is_a_field_of_json_log_lines() {
    let up = Echo::start().await;
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("idem.toml");
    std::fs::write(
        &config,
        format!(
            "upstream = {:?}\nstore = \"memory://\"\n\n[[routes]]\nname = \"payments\"\npath = \"/payments\"\n",
            up.url
        ),
    )
    .unwrap();
    let path = config.display().to_string();
    let proc = own_gateway(
        dir.path(),
        "json-log",
        &["--log-format", "json", "--config", &path],
        &[],
    )
    .await;
    let gw = Gw {
        proc,
        _dir: dir,
        config,
    };
    let c = client();
    assert_executed(
        &post(&c, &gw, "/payments", Some("k-json"), "{}").await,
        201,
        "payments",
    );
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let found = gw.proc.logs().lines().any(|l| {
            serde_json::from_str::<serde_json::Value>(l).is_ok_and(|v| {
                let f = if v["fields"].is_object() {
                    &v["fields"]
                } else {
                    &v
                };
                f["key"] == "k-json" && f["route"] == "payments"
            })
        });
        if found {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "a JSON request line with \"route\":\"payments\":\n{}",
            gw.logs()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_spelling_of_the_path_escapes_the_payments_rules() {
    let up = Echo::start().await;
    let routes = r#"
[[routes]]
name = "payments"
path = "/payments"
require_key = true
"#;
    let gw = Gw::start("escapes", &up, "", routes).await;
    let c = client();
    // Each is refused (the payments rules, or an ambiguous path refused
    // outright); none reaches the upstream without a key. (An encoded
    // `%3B` is data, not a `;parameter`: `/payments%3Bv=1` is another
    // segment, as the front door decided, and is not listed.)
    for path in [
        "/payments%2F1",
        "/payments%2f1",
        "/payments;v=1",
        "/x/..%2Fpayments",
        "/%2e/payments",
        "/payments%00",
        "/PAYMENTS%2F",
        "/pay%6Dents/1",
    ] {
        let got = post(&c, &gw, path, None, "{}").await;
        assert!(
            (400..500).contains(&got.status),
            "keyless POST {path}: refused expected: {got:?}"
        );
        assert_eq!(
            up.total(),
            0,
            "POST {path} reached the upstream: {:?}",
            up.execs()
        );
    }
    // The absolute form of the request target.
    let target = format!("http://{}/PAYMENTS/1", gw.proc.addr);
    let (status, answer) = chunked_post(&gw, &target, &[], &["{}"]).await;
    assert_eq!(status, 400, "keyless absolute-form POST:\n{answer}");
    assert_eq!(up.total(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn log_format_from_the_file() {
    let up = Echo::start().await;
    let routes = "\n[[routes]]\nname = \"payments\"\npath = \"/payments\"\n";
    let gw = Gw::start("file-json-log", &up, "log_format = \"json\"", routes).await;
    let c = client();
    assert_executed(
        &post(&c, &gw, "/payments", Some("k-fj"), "{}").await,
        201,
        "payments",
    );
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let log = gw.proc.logs();
        let json_lines = log
            .lines()
            .filter(|l| serde_json::from_str::<serde_json::Value>(l).is_ok())
            .count();
        if json_lines > 0 && log.contains("k-fj") && log.contains("\"route\":\"payments\"") {
            assert_eq!(
                json_lines,
                log.lines().filter(|l| !l.trim().is_empty()).count(),
                "every line is JSON:\n{log}"
            );
            break;
        }
        assert!(
            Instant::now() < deadline,
            "log_format = \"json\" in the file: JSON lines with the route expected:\n{log}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
