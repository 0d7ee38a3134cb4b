//! Finding and freeing a stuck key, with real processes: a gateway whose
//! upstream hangs is SIGKILLed mid-request, so its keys stay in flight in
//! the store (a retry gets 409 until the lease ends). `idem keys` lists,
//! shows and deletes one of them, the admin API (`/keys` on a second
//! gateway's admin listener) the other; after each deletion a retry runs
//! (the upstream counts it). On SQLite, PostgreSQL, MariaDB and Redis; the
//! memory store's admin API is tested on a live gateway (a killed one
//! forgets everything).
//!
//! Needs the shared servers of /work/shared/SERVICES.md (URLs from
//! `IDEM_TEST_POSTGRES_URL`, `IDEM_TEST_MYSQL_URL`, `IDEM_TEST_REDIS_URL`);
//! a test whose server is unreachable fails and names the command that
//! starts it. Each test keeps its data apart (its own SQLite file,
//! PostgreSQL schema, MariaDB table or Redis key prefix) and removes it.

mod support;

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::http::{HeaderMap, StatusCode};

use axum::Router;
use serde_json::Value;
use support::*;

const TOKEN: &str = "admin-token-for-keys-tests-0123456789";

/// Every member of a record's JSON (the shape `idem keys --json` and the
/// admin API share).
const RECORD_FIELDS: [&str; 12] = [
    "key",
    "scope",
    "key_hash",
    "state",
    "held",
    "fingerprint",
    "fence",
    "lease_until",
    "lease_until_ms",
    "expires_at",
    "expires_at_ms",
    "response",
];

/// Runs `f` on drop (cleanup that also happens when the test panics).
struct OnDrop<F: FnMut()>(F);
impl<F: FnMut()> Drop for OnDrop<F> {
    fn drop(&mut self) {
        (self.0)();
    }
}

// --------------------------------------------------------------- upstream

/// An upstream whose FIRST execution of each key hangs (two minutes: the
/// gateway in front is killed meanwhile) and whose later ones answer 201
/// at once; counts executions per key.
struct Hanging {
    url: String,
    counts: Arc<Mutex<HashMap<String, usize>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Hanging {
    async fn start() -> Self {
        let counts: Arc<Mutex<HashMap<String, usize>>> = Arc::default();
        let c = counts.clone();
        let app = Router::new().route(
            "/pay",
            axum::routing::post(move |h: HeaderMap| {
                let c = c.clone();
                async move {
                    let key = h
                        .get("idempotency-key")
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or("")
                        .to_owned();
                    let n = {
                        let mut m = c.lock().unwrap();
                        let e = m.entry(key.clone()).or_insert(0);
                        *e += 1;
                        *e
                    };
                    if n == 1 {
                        tokio::time::sleep(Duration::from_secs(120)).await;
                    }
                    (
                        StatusCode::CREATED,
                        [("content-type", "application/json")],
                        format!("{{\"key\":{key:?},\"execution\":{n}}}"),
                    )
                }
            }),
        );
        let (url, task) = serve(app).await;
        Self { url, counts, task }
    }

    fn of_key(&self, key: &str) -> usize {
        self.counts.lock().unwrap().get(key).copied().unwrap_or(0)
    }

    /// Waits until the upstream has seen `key` `n` times.
    async fn wait_for(&self, key: &str, n: usize) {
        let deadline = Instant::now() + Duration::from_secs(15);
        while self.of_key(key) < n {
            assert!(
                Instant::now() < deadline,
                "the upstream did not see {key:?} {n} times"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for Hanging {
    fn drop(&mut self) {
        self.task.abort();
    }
}

// ---------------------------------------------------------------- helpers

/// POSTs the fixed body with `key` (and `auth` as `Authorization`).
async fn post(c: &reqwest::Client, url: &str, key: &str, auth: Option<&str>) -> (u16, String) {
    let mut r = c
        .post(url)
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(r#"{"amount":10}"#);
    if let Some(a) = auth {
        r = r.header("authorization", a);
    }
    let r = r.send().await.unwrap();
    (r.status().as_u16(), r.text().await.unwrap())
}

/// Sends a request that hangs upstream, in the background.
fn post_in_background(
    c: &reqwest::Client,
    url: String,
    key: &str,
    auth: Option<&str>,
) -> tokio::task::JoinHandle<()> {
    let (c, key, auth) = (c.clone(), key.to_owned(), auth.map(str::to_owned));
    tokio::spawn(async move {
        let mut r = c
            .post(url)
            .header("idempotency-key", key)
            .header("content-type", "application/json")
            .body(r#"{"amount":10}"#);
        if let Some(a) = auth {
            r = r.header("authorization", a);
        }
        let _ = r.send().await;
    })
}

/// `idem keys ARGS…` (the parts joined; run on a blocking thread):
/// status, stdout, stderr.
async fn keys(parts: &[&[&str]]) -> (i32, String, String) {
    let args: Vec<String> = parts.concat().iter().map(|s| (*s).to_owned()).collect();
    tokio::task::spawn_blocking(move || {
        let out = idem()
            .arg("keys")
            .args(&args)
            .output()
            .expect("run idem keys");
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    })
    .await
    .unwrap()
}

/// `idem keys ARGS` that must succeed; its standard output.
async fn keys_ok(parts: &[&[&str]]) -> String {
    let (code, out, err) = keys(parts).await;
    assert_eq!(
        code,
        0,
        "idem keys {:?}\nstdout:\n{out}\nstderr:\n{err}",
        parts.concat()
    );
    out
}

fn json(s: &str) -> Value {
    serde_json::from_str(s.trim()).unwrap_or_else(|e| panic!("not JSON ({e}): {s}"))
}

fn assert_record_shape(r: &Value) {
    let got: BTreeSet<&str> = r.as_object().unwrap().keys().map(String::as_str).collect();
    let want: BTreeSet<&str> = RECORD_FIELDS.into_iter().collect();
    assert_eq!(got, want, "{r}");
    assert_eq!(r["key_hash"].as_str().unwrap().len(), 16, "{r}");
    assert_eq!(r["fingerprint"].as_str().unwrap().len(), 64, "{r}");
}

/// The record of `key` in a listing (`{"records": […]}`).
fn find<'a>(page: &'a Value, key: &str) -> Option<&'a Value> {
    page["records"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["key"] == key)
}

/// Every page of `idem keys list ARGS… --json`, followed by its cursor
/// (the Redis store's pages may stop short: it scans a bounded part of the
/// keyspace per call), merged into one `{"records": […]}`.
async fn cli_list_all(parts: &[&[&str]]) -> Value {
    let mut records = Vec::new();
    let mut cursor: Option<String> = None;
    for _ in 0..10_000 {
        let mut args: Vec<&str> = parts.concat();
        args.push("--json");
        if let Some(c) = &cursor {
            args.extend(["--cursor", c.as_str()]);
        }
        let page = json(&keys_ok(&[&args]).await);
        records.extend(page["records"].as_array().unwrap().iter().cloned());
        match page["next"].as_str() {
            Some(n) => cursor = Some(n.to_owned()),
            None => return serde_json::json!({ "records": records }),
        }
    }
    panic!("the listing did not end");
}

/// Every page of the table of `idem keys list ARGS…`, joined.
async fn cli_table_all(parts: &[&[&str]]) -> String {
    let mut out = String::new();
    let mut cursor: Option<String> = None;
    for _ in 0..10_000 {
        let mut args: Vec<&str> = parts.concat();
        if let Some(c) = &cursor {
            args.extend(["--cursor", c.as_str()]);
        }
        let page = keys_ok(&[&args]).await;
        out.push_str(&page);
        let next = page.lines().find_map(|l| {
            let (_, n) = l.split_once("add --cursor ")?;
            n.split_whitespace().next().map(|n| n.trim_end_matches(','))
        });
        match next {
            Some(n) => cursor = Some(n.to_owned()),
            None => return out,
        }
    }
    panic!("the listing did not end");
}

/// Every page of `GET path` (a `/keys?…` listing) on `gw`'s admin listener.
async fn api_list_all(c: &reqwest::Client, gw: &GatewayProc, path: &str) -> Value {
    let mut records = Vec::new();
    let mut cursor: Option<String> = None;
    for _ in 0..10_000 {
        let p = match &cursor {
            Some(n) => format!("{path}&cursor={}", encode(n)),
            None => path.to_owned(),
        };
        let (status, ct, page) = body_of(admin(c, gw, reqwest::Method::GET, &p)).await;
        assert_eq!(
            (status, ct.as_deref()),
            (200, Some("application/json")),
            "{p}: {page}"
        );
        assert!(page["newest_first"].is_boolean(), "{page}");
        records.extend(page["records"].as_array().unwrap().iter().cloned());
        match page["next"].as_str() {
            Some(n) => cursor = Some(n.to_owned()),
            None => return serde_json::json!({ "records": records }),
        }
    }
    panic!("the listing did not end");
}

/// Percent-encodes a key for a `/keys/{scope}/{key}` path.
fn encode(key: &str) -> String {
    key.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

fn token_file(dir: &Path) -> PathBuf {
    let p = dir.join("admin-token");
    std::fs::write(&p, format!("{TOKEN}\n")).unwrap();
    p
}

/// A request to the admin listener of `gw`, with the admin token.
fn admin(
    c: &reqwest::Client,
    gw: &GatewayProc,
    method: reqwest::Method,
    path: &str,
) -> reqwest::RequestBuilder {
    c.request(method, format!("http://{}{path}", gw.admin))
        .bearer_auth(TOKEN)
}

async fn body_of(r: reqwest::RequestBuilder) -> (u16, Option<String>, Value) {
    let r = r.send().await.unwrap();
    let status = r.status().as_u16();
    let ct = r
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let text = r.text().await.unwrap();
    (
        status,
        ct,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

/// Waits until `gw`'s log holds `needle`.
async fn wait_log(gw: &GatewayProc, needle: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let logs = gw.logs();
        if logs.contains(needle) {
            return logs;
        }
        assert!(
            Instant::now() < deadline,
            "no {needle:?} in the log:\n{logs}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

// ------------------------------------------------------------ the story

/// Two keys left in flight by a killed gateway on `store`; one freed with
/// `idem keys`, the other over the admin API; each retry then runs.
async fn stuck_keys_are_found_and_freed(store: &str, kind: &str) {
    let up = Hanging::start().await;
    let dir = tempfile::tempdir().unwrap();
    let token = token_file(dir.path());
    let token = token.to_str().unwrap();
    let args = [
        "--upstream",
        &up.url,
        "--store",
        store,
        "--admin-token-file",
        token,
        "--lease",
        "30s",
        "--ttl",
        "1h",
        "--upstream-timeout",
        "5m",
    ];
    let c = reqwest::Client::builder()
        .timeout(Duration::from_secs(20))
        .build()
        .unwrap();
    let run = unique(kind);
    // Key 1 is a caller's (scoped by its Authorization), key 2 anonymous
    // with characters that need percent-encoding in a path.
    let (k1, auth1) = (format!("{run}-cli"), format!("Bearer alice-{run}"));
    let k2 = format!("{run}/api key");

    let mut a = GatewayProc::start(dir.path(), "a", &args).await;
    let pay_a = a.url("/pay");
    let h1 = post_in_background(&c, pay_a.clone(), &k1, Some(&auth1));
    let h2 = post_in_background(&c, pay_a, &k2, None);
    up.wait_for(&k1, 1).await;
    up.wait_for(&k2, 1).await;
    a.kill9();
    let _ = h1.await;
    let _ = h2.await;

    let b = GatewayProc::start(dir.path(), "b", &args).await;
    let pay_b = b.url("/pay");
    let (s1, body) = post(&c, &pay_b, &k1, Some(&auth1)).await;
    assert_eq!(s1, 409, "key 1 is not stuck: {body}");
    let (s2, body) = post(&c, &pay_b, &k2, None).await;
    assert_eq!(s2, 409, "key 2 is not stuck: {body}");

    // ---- idem keys
    let st = ["--store", store];
    let scope1 = format!("authorization:{auth1}");
    let page = cli_list_all(&[&["list"], &st, &["--state", "in-flight"]]).await;
    let r1 = find(&page, &k1).unwrap_or_else(|| panic!("{k1} not listed in flight: {page}"));
    assert_record_shape(r1);
    assert_eq!(r1["state"], "in-flight", "{r1}");
    assert!(r1["fence"].as_u64().is_some(), "{r1}");
    assert!(find(&page, &k2).is_some(), "{k2} not listed: {page}");
    let scope_hash = r1["scope"].as_str().unwrap().to_owned();
    assert_eq!(scope_hash.len(), 64, "{r1}");

    // Only this caller's scope, named by the header value it sent, or by hash.
    for how in [
        ["--scope-header", scope1.as_str()],
        ["--scope-hash", scope_hash.as_str()],
    ] {
        let mine = cli_list_all(&[&["list"], &st, &how]).await;
        assert!(find(&mine, &k1).is_some(), "{how:?}: {mine}");
        assert!(find(&mine, &k2).is_none(), "{how:?}: {mine}");
    }
    let all = json(&keys_ok(&[&["list"], &st, &["--all", "--limit", "1", "--json"]]).await);
    assert!(all["next"].is_null(), "{all}");
    assert!(
        find(&all, &k1).is_some() && find(&all, &k2).is_some(),
        "--all: {all}"
    );
    let completed = cli_list_all(&[&["list"], &st, &["--state", "completed"]]).await;
    assert!(find(&completed, &k1).is_none(), "{completed}");

    let table = cli_table_all(&[&["list"], &st, &["--scope-header", &scope1]]).await;
    let row = table
        .lines()
        .find(|l| l.starts_with(&k1))
        .unwrap_or_else(|| panic!("{k1} not in the table:\n{table}"));
    assert!(
        row.contains("in-flight") && row.contains("lease ends"),
        "{table}"
    );
    assert!(
        row.contains(&scope_hash[..12]) && row.contains(r1["key_hash"].as_str().unwrap()),
        "{table}"
    );

    let got = json(&keys_ok(&[&["get"], &st, &["--scope-header", &scope1, &k1, "--json"]]).await);
    assert_eq!(got, *r1, "get and list disagree");
    let shown = keys_ok(&[&["get"], &st, &["--scope-hash", &scope_hash, &k1]]).await;
    assert!(
        shown.contains("in-flight") && shown.contains("lease ends"),
        "{shown}"
    );
    // The anonymous scope has no key 1.
    let (code, _, err) = keys(&[&["get"], &st, &[k1.as_str()]]).await;
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("no record"), "{err}");

    let (code, out, err) = keys(&[&["delete"], &st, &["--scope-header", &scope1, &k1]]).await;
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains("deleted key") && out.contains("in flight"),
        "{out}"
    );
    assert!(
        err.contains("idem key deleted by an operator")
            && err.contains(r1["key_hash"].as_str().unwrap()),
        "the deletion is not logged: {err}"
    );
    let (code, _, _) = keys(&[&["get"], &st, &["--scope-hash", &scope_hash, &k1]]).await;
    assert_eq!(code, 1, "still there after delete");
    let (code, _, _) = keys(&[&["delete"], &st, &["--scope-hash", &scope_hash, &k1]]).await;
    assert_eq!(code, 1, "a second delete found something");

    let (s, body) = post(&c, &pay_b, &k1, Some(&auth1)).await;
    assert_eq!(
        s,
        201,
        "the retry of key 1 did not run: {body}\n{}",
        b.logs()
    );
    assert_eq!(up.of_key(&k1), 2, "key 1 ran {} times", up.of_key(&k1));

    // ---- the admin API (on gateway B's admin listener)
    let (st401, _, _) = body_of(c.get(format!("http://{}/keys", b.admin))).await;
    assert_eq!(st401, 401);
    let (st401, _, _) = body_of(
        c.get(format!("http://{}/keys", b.admin))
            .bearer_auth("wrong-token-wrong-token-wrong"),
    )
    .await;
    assert_eq!(st401, 401);

    let page = api_list_all(&c, &b, "/keys?state=in-flight&scope=anonymous").await;
    let r2 = find(&page, &k2)
        .unwrap_or_else(|| panic!("{k2} not listed: {page}"))
        .clone();
    assert_record_shape(&r2);
    assert_eq!(
        (r2["state"].as_str(), r2["scope"].as_str()),
        (Some("in-flight"), Some("anonymous"))
    );
    assert!(find(&page, &k1).is_none(), "{page}");

    let path = format!("/keys/anonymous/{}", encode(&k2));
    let (status, _, got) = body_of(admin(&c, &b, reqwest::Method::GET, &path)).await;
    assert_eq!(status, 200, "{got}");
    assert_eq!(got, r2);
    let (status, _, gone) = body_of(admin(&c, &b, reqwest::Method::DELETE, &path)).await;
    assert_eq!(status, 200, "{gone}");
    assert_eq!(gone["deleted"], true);
    assert_eq!(gone["record"], r2, "{gone}");
    let logs = wait_log(&b, "idem key deleted by an operator").await;
    let line = logs
        .lines()
        .find(|l| l.contains("idem key deleted by an operator"))
        .unwrap();
    for part in [
        r2["key_hash"].as_str().unwrap(),
        "admin-api",
        "admin token",
        "in-flight",
    ] {
        assert!(line.contains(part), "{part:?} not in {line}");
    }
    assert!(!line.contains(&k2), "the raw key is logged: {line}");
    let (status, ct, problem) = body_of(admin(&c, &b, reqwest::Method::GET, &path)).await;
    assert_eq!(
        (status, ct.as_deref()),
        (404, Some("application/problem+json")),
        "{problem}"
    );
    assert_eq!(problem["type"], "urn:idem:problem:key-not-found");
    let (status, _, _) = body_of(admin(&c, &b, reqwest::Method::DELETE, &path)).await;
    assert_eq!(status, 404);

    let (s, body) = post(&c, &pay_b, &k2, None).await;
    assert_eq!(s, 201, "the retry of key 2 did not run: {body}");
    assert_eq!(up.of_key(&k2), 2);

    // Completed now, both of them, with their responses.
    let page = api_list_all(&c, &b, "/keys?state=completed&limit=1000").await;
    for k in [&k1, &k2] {
        let r = find(&page, k).unwrap_or_else(|| panic!("{k} not completed: {page}"));
        assert_eq!(r["response"]["status"], 201, "{r}");
        assert!(
            r["expires_at_ms"].as_u64().is_some() && r["fence"].is_null(),
            "{r}"
        );
    }
    let (status, _, purged) = body_of(admin(&c, &b, reqwest::Method::POST, "/keys/purge")).await;
    assert_eq!(status, 200, "{purged}");
    assert!(purged["purged"].as_u64().is_some(), "{purged}");
    let out = json(&keys_ok(&[&["purge"], &st, &["--json"]]).await);
    assert!(out["purged"].as_u64().is_some(), "{out}");
}

// ----------------------------------------------------------------- stores

/// An upstream whose first execution of each key takes 3 s (the gateway,
/// with `--upstream-timeout 1s`, answers 504: its outcome is unknown) and
/// later ones answer 201 at once; counts executions per key.
async fn timing_out() -> (
    String,
    Arc<Mutex<HashMap<String, usize>>>,
    tokio::task::JoinHandle<()>,
) {
    let counts: Arc<Mutex<HashMap<String, usize>>> = Arc::default();
    let c = counts.clone();
    let app = Router::new().route(
        "/pay",
        axum::routing::post(move |h: HeaderMap| {
            let c = c.clone();
            async move {
                let key = h
                    .get("idempotency-key")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("")
                    .to_owned();
                let n = {
                    let mut m = c.lock().unwrap();
                    let e = m.entry(key).or_insert(0);
                    *e += 1;
                    *e
                };
                if n == 1 {
                    // Past the gateway's --upstream-timeout: it answers 504.
                    tokio::time::sleep(Duration::from_secs(3)).await;
                }
                (StatusCode::CREATED, format!("{{\"execution\":{n}}}"))
            }
        }),
    );
    let (url, task) = serve(app).await;
    (url, counts, task)
}

/// Issue 16 item 4: an upstream timeout (504) leaves its key held (reason `timeout`) for
/// `--hold-for`, past its lease; `idem keys` shows it held; an operator
/// completes one (`idem keys complete`: duplicates get that answer, the
/// upstream never runs again) and releases the other over the admin API
/// (`DELETE`: the retry runs) and completes a third there; completing a
/// key completed already, or with a bad answer, is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_keys_are_shown_and_settled_by_an_operator() {
    let (up, counts, _task) = timing_out().await;
    let of_key = |k: &str| counts.lock().unwrap().get(k).copied().unwrap_or(0);
    let dir = tempfile::tempdir().unwrap();
    let store = format!("sqlite://{}", dir.path().join("idem.db").display());
    let token = token_file(dir.path());
    let args = [
        "--upstream",
        &up,
        "--store",
        &store,
        "--admin-token-file",
        token.to_str().unwrap(),
        "--lease",
        "2s",
        "--store-timeout",
        "500ms",
        "--upstream-timeout",
        "1s",
        "--hold-for",
        "1h",
    ];
    let gw = GatewayProc::start(dir.path(), "held", &args).await;
    let c = reqwest::Client::builder()
        .timeout(Duration::from_secs(20))
        .build()
        .unwrap();
    let run = unique("held");
    let (k1, k2) = (format!("{run}-cli"), format!("{run}-api"));
    let pay = gw.url("/pay");
    for k in [&k1, &k2] {
        let (s, body) = post(&c, &pay, k, None).await;
        assert_eq!(s, 504, "{body}");
    }
    // Past the 2 s lease the keys are still held: a retry gets 409 and
    // does not run.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    for k in [&k1, &k2] {
        let (s, body) = post(&c, &pay, k, None).await;
        assert_eq!(s, 409, "{k} is not held past its lease: {body}");
        assert!(
            body.contains("urn:idem:problem:held") && body.contains("\"reason\":\"timeout\""),
            "{body}"
        );
        assert_eq!(of_key(k), 1);
    }
    let st = ["--store", store.as_str()];
    let got = json(&keys_ok(&[&["get"], &st, &[k1.as_str(), "--json"]]).await);
    assert_record_shape(&got);
    assert_eq!(
        (&got["state"], &got["held"]),
        (&"in-flight".into(), &"timeout".into()),
        "{got}"
    );
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    assert!(
        got["lease_until_ms"].as_u64().unwrap() > now_ms + 3_000_000,
        "not held for --hold-for 1h: {got}"
    );
    let shown = keys_ok(&[&["get"], &st, &[k1.as_str()]]).await;
    assert!(shown.contains("held (timeout)"), "{shown}");
    let table = cli_table_all(&[&["list"], &st]).await;
    assert!(
        table
            .lines()
            .any(|l| l.starts_with(&k1) && l.contains("held (timeout)")),
        "{table}"
    );

    // ---- idem keys complete
    let (code, out, err) = keys(&[
        &["complete"],
        &st,
        &[
            k1.as_str(),
            "--status",
            "201",
            "-H",
            "content-type: application/json",
            "--body",
            r#"{"settled":true}"#,
        ],
    ])
    .await;
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("completed key"), "{out}");
    assert!(
        err.contains("idem key completed by an operator"),
        "not logged: {err}"
    );
    let (s, body) = post(&c, &pay, &k1, None).await;
    assert_eq!((s, body.as_str()), (201, r#"{"settled":true}"#));
    assert_eq!(of_key(&k1), 1, "a completed held key ran again");
    // Completed already: refused, exit 1.
    let (code, _, err) = keys(&[&["complete"], &st, &[k1.as_str(), "--status", "200"]]).await;
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("completed already"), "{err}");
    // A bad status is a usage error.
    let (code, _, err) = keys(&[&["complete"], &st, &[k2.as_str(), "--status", "42"]]).await;
    assert_eq!(code, 2, "{err}");

    // ---- the admin API: completing needs a held key unless forced;
    // DELETE releases it and the retry runs.
    let path = format!("/keys/anonymous/{}", encode(&k2));
    let (status, _, rec) = body_of(admin(&c, &gw, reqwest::Method::GET, &path)).await;
    assert_eq!((status, &rec["held"]), (200, &"timeout".into()), "{rec}");
    let (status, _, problem) = body_of(
        admin(&c, &gw, reqwest::Method::POST, &format!("{path}/complete")).body("{\"status\": 99}"),
    )
    .await;
    assert_eq!(status, 400, "{problem}");
    let (status, _, problem) = body_of(
        admin(&c, &gw, reqwest::Method::POST, &format!("{path}/complete")).body("not json"),
    )
    .await;
    assert_eq!(status, 400, "{problem}");
    let (status, _, gone) = body_of(admin(&c, &gw, reqwest::Method::DELETE, &path)).await;
    assert_eq!(status, 200, "{gone}");
    let (s, body) = post(&c, &pay, &k2, None).await;
    assert_eq!(s, 201, "the released key did not run: {body}");
    assert_eq!(of_key(&k2), 2);
    let (status, _, problem) = body_of(
        admin(&c, &gw, reqwest::Method::POST, &format!("{path}/complete"))
            .body("{\"status\": 200}"),
    )
    .await;
    assert_eq!(
        (status, &problem["type"]),
        (409, &"urn:idem:problem:already-completed".into()),
        "{problem}"
    );

    // Completed over the admin API: the answer, with its headers, is
    // what a retry gets.
    let k3 = format!("{run}-live");
    let (s, _) = post(&c, &pay, &k3, None).await;
    assert_eq!(s, 504);
    let p3 = format!("/keys/anonymous/{}/complete", encode(&k3));
    let (status, _, done) = body_of(
        admin(&c, &gw, reqwest::Method::POST, &p3)
            .body(r#"{"status": 200, "body": "ok", "headers": {"x-settled": "yes"}}"#),
    )
    .await;
    assert_eq!((status, &done["completed"]), (200, &true.into()), "{done}");
    assert_eq!(done["record"]["state"], "completed", "{done}");
    let r = c
        .post(&pay)
        .header("idempotency-key", &k3)
        .header("content-type", "application/json")
        .body(r#"{"amount":10}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    assert_eq!(r.headers()["x-settled"], "yes");
    assert_eq!(r.headers()["idempotent-replayed"], "true");
    assert_eq!(r.text().await.unwrap(), "ok");
    assert_eq!(of_key(&k3), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_stuck_key_is_listed_shown_deleted_and_retried() {
    let dir = tempfile::tempdir().unwrap();
    let store = format!("sqlite://{}", dir.path().join("idem.db").display());
    stuck_keys_are_found_and_freed(&store, "sqlite").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_stuck_key_is_listed_shown_deleted_and_retried() {
    let base = POSTGRES.require();
    let schema = unique("keys_pg");
    let store = with_param(&base, "idem_schema", &schema);
    let _drop = OnDrop(|| {
        cleanup(
            &format!("schema {schema}"),
            "psql",
            &[
                &base,
                "-q",
                "-c",
                &format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE"),
            ],
        )
    });
    stuck_keys_are_found_and_freed(&store, "postgres").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_stuck_key_is_listed_shown_deleted_and_retried() {
    let base = MYSQL.require();
    let table = unique("keys_my");
    let store = with_param(&base, "idem_table", &table);
    let _drop = OnDrop(|| {
        let mut args = mariadb_args(&base);
        args.push("-e".into());
        args.push(format!("DROP TABLE IF EXISTS `{table}`, `{table}_fence`"));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        cleanup(&format!("table {table}"), "mariadb", &args)
    });
    stuck_keys_are_found_and_freed(&store, "mysql").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_stuck_key_is_listed_shown_deleted_and_retried() {
    let base = REDIS.require();
    let prefix = unique("keys_rd");
    let store = with_param(&base, "idem_prefix", &prefix);
    let _drop = OnDrop(|| cleanup_redis_prefix(&base, &prefix));
    stuck_keys_are_found_and_freed(&store, "redis").await;
}

// ----------------------------------------------------------------- memory

/// The memory store forgets everything with its process, so its key is
/// stuck behind a live gateway: the admin API frees it while the first
/// call still hangs, and the retry runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_admin_api_lists_shows_and_frees_a_key() {
    let up = Hanging::start().await;
    let dir = tempfile::tempdir().unwrap();
    let token = token_file(dir.path());
    let gw = GatewayProc::start(
        dir.path(),
        "mem",
        &[
            "--upstream",
            &up.url,
            "--store",
            "memory://",
            "--admin-token-file",
            token.to_str().unwrap(),
            "--upstream-timeout",
            "5m",
        ],
    )
    .await;
    let c = reqwest::Client::builder()
        .timeout(Duration::from_secs(20))
        .build()
        .unwrap();
    let key = unique("mem");
    let first = post_in_background(&c, gw.url("/pay"), &key, Some("Bearer bob"));
    up.wait_for(&key, 1).await;
    let (s, _) = post(&c, &gw.url("/pay"), &key, Some("Bearer bob")).await;
    assert_eq!(s, 409);

    // Errors first: every one a problem+json.
    for (method, path, status, allow) in [
        (reqwest::Method::PUT, "/keys", 405, Some("GET")),
        (reqwest::Method::GET, "/keys/purge", 405, Some("POST")),
        (
            reqwest::Method::POST,
            "/keys/anonymous/x",
            405,
            Some("GET, DELETE"),
        ),
        (reqwest::Method::GET, "/keys?limit=0", 400, None),
        (reqwest::Method::GET, "/keys?state=done", 400, None),
        (reqwest::Method::GET, "/keys?scope=xyz", 400, None),
        (reqwest::Method::GET, "/keys?bogus=1", 400, None),
        (reqwest::Method::GET, "/keys?cursor=zz", 400, None),
        (reqwest::Method::GET, "/keys/not-a-scope/k", 400, None),
        (reqwest::Method::GET, "/keys/anonymous/%FF", 400, None),
        (reqwest::Method::GET, "/keys/anonymous", 404, None),
    ] {
        let r = admin(&c, &gw, method.clone(), path).send().await.unwrap();
        assert_eq!(r.status().as_u16(), status, "{method} {path}");
        assert_eq!(
            r.headers().get("allow").and_then(|v| v.to_str().ok()),
            allow,
            "{method} {path}"
        );
        assert_eq!(
            r.headers()["content-type"],
            "application/problem+json",
            "{method} {path}"
        );
    }

    let (status, _, page) = body_of(admin(&c, &gw, reqwest::Method::GET, "/keys")).await;
    assert_eq!(status, 200, "{page}");
    assert!(page["next"].is_null(), "{page}");
    let r = find(&page, &key)
        .unwrap_or_else(|| panic!("not listed: {page}"))
        .clone();
    assert_record_shape(&r);
    assert_eq!(r["state"], "in-flight");
    let scope = r["scope"].as_str().unwrap().to_owned();
    assert_eq!(scope.len(), 64);

    // Paging: one record a page.
    let (_, _, one) = body_of(admin(&c, &gw, reqwest::Method::GET, "/keys?limit=1")).await;
    assert_eq!(one["records"].as_array().unwrap().len(), 1, "{one}");

    let path = format!("/keys/{scope}/{}", encode(&key));
    let (status, _, got) = body_of(admin(&c, &gw, reqwest::Method::GET, &path)).await;
    assert_eq!((status, &got), (200, &r));
    let (status, _, gone) = body_of(admin(&c, &gw, reqwest::Method::DELETE, &path)).await;
    assert_eq!(status, 200, "{gone}");
    assert_eq!(gone["record"]["fence"], r["fence"]);
    wait_log(&gw, "idem key deleted by an operator").await;

    let (s, body) = post(&c, &gw.url("/pay"), &key, Some("Bearer bob")).await;
    assert_eq!(s, 201, "the retry did not run: {body}");
    assert_eq!(up.of_key(&key), 2);
    first.abort();

    // Without a token file the API does not exist.
    let bare = GatewayProc::start(
        dir.path(),
        "bare",
        &["--upstream", &up.url, "--store", "memory://"],
    )
    .await;
    for path in ["/keys", "/keys/anonymous/k"] {
        let r = c
            .get(format!("http://{}{path}", bare.admin))
            .bearer_auth(TOKEN)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 404, "{path}");
    }
}

// ------------------------------------------------------------ CLI errors

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idem_keys_reports_bad_flags_and_unreachable_stores() {
    // A store that opens without creating anything, for the checks a store makes.
    let redis_store = with_param(&REDIS.require(), "idem_prefix", &unique("keys_cur"));
    let dir = tempfile::tempdir().unwrap();
    let missing = format!("sqlite://{}", dir.path().join("nope.db").display());
    for (args, code, says) in [
        (
            vec!["list", "--store", "memory://", "--limit", "0"],
            2,
            "--limit",
        ),
        (
            vec!["list", "--store", "memory://", "--state", "done"],
            2,
            "--state",
        ),
        (
            vec!["get", "--store", "memory://", "--scope-hash", "abc", "k"],
            2,
            "scope hash",
        ),
        (
            vec![
                "get",
                "--store",
                "memory://",
                "--scope-header",
                "authorization",
                "k",
            ],
            2,
            "NAME:VALUE",
        ),
        (
            vec![
                "get",
                "--store",
                "memory://",
                "--scope-header",
                "a:b",
                "--scope-hash",
                "anonymous",
                "k",
            ],
            2,
            "cannot be used with",
        ),
        (vec!["get", "--store", "memory://", ""], 2, "empty"),
        (vec!["list", "--store", "ftp://x"], 2, "unknown scheme"),
        (
            vec!["list", "--store", &redis_store, "--cursor", "nope"],
            2,
            "cursor",
        ),
        (vec!["list", "--store", &missing], 2, "does not exist"),
        (vec!["list"], 2, "--store"),
        (
            vec![
                "list",
                "--store",
                "postgres://root@127.0.0.1:1/test",
                "--store-timeout",
                "2s",
            ],
            1,
            "127.0.0.1:1",
        ),
        // A memory store lives in its gateway: a new one would be empty.
        (vec!["get", "--store", "memory://", "k"], 2, "admin API"),
        (vec!["list", "--store", "memory://"], 2, "admin API"),
        // A mistyped table is an error, never an empty listing (and never
        // created: idem keys does not migrate).
        (
            vec![
                "list",
                "--store",
                "postgres://root@127.0.0.1:5432/test?idem_table=keys_typo_never_created",
            ],
            2,
            "does not exist",
        ),
    ] {
        let (got, out, err) = keys(&[&args]).await;
        assert_eq!(got, code, "{args:?}\nstdout:\n{out}\nstderr:\n{err}");
        assert!(err.contains(says), "{args:?}: {says:?} not in\n{err}");
    }
    assert!(
        !dir.path().join("nope.db").exists(),
        "idem keys created a database"
    );
    // IDEM_STORE is honoured.
    let env_store = redis_store.clone();
    let out = tokio::task::spawn_blocking(move || {
        idem()
            .args(["keys", "list", "--json"])
            .env("IDEM_STORE", env_store)
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let (stdout, _) = succeeded(&out, "idem keys list with IDEM_STORE");
    assert_eq!(
        json(&stdout),
        serde_json::json!({"records": [], "next": null, "newest_first": false})
    );
}
