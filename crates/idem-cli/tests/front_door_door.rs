//! The front door (issue 11, items 1, 2, 7 and 9) through the real `idem`
//! binary: methods that differ from a guarded one by case, other spellings
//! of a path (token routes, `/_idem/`, the upstream prefix), an upstream
//! `101`, duplicate `Host` fields, forwarding fields, the key as the
//! upstream sees it, and key errors that name their character.
//!
//! The upstream behaves like Flask/Werkzeug in front of a file-server-like
//! router: it upper-cases the method, percent-decodes the whole path
//! (`%2F` included), merges repeated slashes and resolves dot segments,
//! then charges `POST /pay/<id>` (or `/api/pay/<id>`) and counts charges per
//! normalised path. Requests go over raw TCP (tokio `TcpStream`) where a
//! client library would clean them up first (lowercase methods, odd paths,
//! two `Host` fields, non-ASCII header bytes).

mod support;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::response::IntoResponse;
use axum::Router;
use support::{serve, unique, GatewayProc};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

// ---------------------------------------------------------------- upstream

/// What the upstream saw of one request.
#[derive(Debug, Clone)]
struct Seen {
    /// The method after upper-casing.
    method: String,
    /// The path as it arrived.
    raw_path: String,
    /// The path as the upstream routes it (decoded, merged, dots resolved).
    path: String,
    headers: HeaderMap,
}

#[derive(Default)]
struct Ledger {
    seen: Vec<Seen>,
    /// Charges per normalised path.
    charges: HashMap<String, usize>,
}

/// A Werkzeug-like upstream (see the module docs).
struct FlaskLike {
    url: String,
    addr: String,
    ledger: Arc<Mutex<Ledger>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for FlaskLike {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Decodes every `%XX`, merges slashes and resolves `.` and `..`.
fn werkzeug_path(raw: &str) -> String {
    let b = raw.as_bytes();
    let hex = |c: u8| (c as char).to_digit(16);
    let mut decoded = Vec::new();
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 2 < b.len() {
            if let (Some(h), Some(l)) = (hex(b[i + 1]), hex(b[i + 2])) {
                decoded.push((h * 16 + l) as u8);
                i += 3;
                continue;
            }
        }
        decoded.push(b[i]);
        i += 1;
    }
    let decoded = String::from_utf8_lossy(&decoded).replace('\\', "/");
    let mut segs: Vec<&str> = Vec::new();
    for s in decoded.split('/') {
        match s {
            "" | "." => {}
            ".." => {
                segs.pop();
            }
            s => segs.push(s),
        }
    }
    format!("/{}", segs.join("/"))
}

async fn flask_handler(
    State(ledger): State<Arc<Mutex<Ledger>>>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
) -> axum::response::Response {
    let method = method.as_str().to_ascii_uppercase();
    let path = werkzeug_path(uri.path());
    let mut l = ledger.lock().unwrap();
    l.seen.push(Seen {
        method: method.clone(),
        raw_path: uri.path().to_owned(),
        path: path.clone(),
        headers,
    });
    let segs: Vec<&str> = path.split('/').skip(1).collect();
    let is_pay = matches!(segs.as_slice(), ["pay", _] | ["api", "pay", _]);
    if method == "POST" && is_pay {
        let n = {
            let e = l.charges.entry(path.clone()).or_insert(0);
            *e += 1;
            *e
        };
        return (
            StatusCode::CREATED,
            [("x-upstream", "flask-like")],
            format!(
                "{{\"charged\":{path:?},\"charge\":{n},\"nonce\":{}}}",
                rand::random::<u64>()
            ),
        )
            .into_response();
    }
    let status = match segs.first() {
        Some(&"admin" | &"echo") => StatusCode::OK,
        _ => StatusCode::NOT_FOUND,
    };
    (status, [("x-upstream", "flask-like")], path).into_response()
}

impl FlaskLike {
    async fn start() -> Self {
        let ledger = Arc::new(Mutex::new(Ledger::default()));
        let app = Router::new()
            .fallback(flask_handler)
            .with_state(ledger.clone());
        let (url, task) = serve(app).await;
        let addr = url.trim_start_matches("http://").to_owned();
        Self {
            url,
            addr,
            ledger,
            task,
        }
    }

    fn charges(&self) -> usize {
        self.ledger.lock().unwrap().charges.values().sum()
    }

    fn charges_of(&self, path: &str) -> usize {
        self.ledger
            .lock()
            .unwrap()
            .charges
            .get(path)
            .copied()
            .unwrap_or(0)
    }

    fn seen(&self) -> Vec<Seen> {
        self.ledger.lock().unwrap().seen.clone()
    }
}

// ----------------------------------------------------------------- client

/// One answer read off a raw connection.
#[derive(Debug)]
struct Answer {
    status: u16,
    head: String,
    body: String,
}

impl Answer {
    fn header(&self, name: &str) -> Option<String> {
        self.head.lines().skip(1).find_map(|l| {
            let (n, v) = l.split_once(':')?;
            n.trim()
                .eq_ignore_ascii_case(name)
                .then(|| v.trim().to_owned())
        })
    }

    fn problem_type(&self) -> String {
        serde_json::from_str::<serde_json::Value>(&self.body)
            .ok()
            .and_then(|v| v["type"].as_str().map(str::to_owned))
            .unwrap_or_default()
    }

    fn is_problem(&self, kind: &str) -> bool {
        self.header("content-type").as_deref() == Some("application/problem+json")
            && self.problem_type() == format!("urn:idem:problem:{kind}")
    }

    fn upstream_answered(&self) -> bool {
        self.header("x-upstream").is_some()
    }
}

/// Sends `head` (request line and fields, without the blank line; a
/// `Connection: close` is added) and `body` as raw bytes, and reads the
/// answer until the gateway closes the connection.
async fn raw(addr: SocketAddr, head: &[u8], body: &str) -> Answer {
    let mut s = TcpStream::connect(addr).await.unwrap();
    let mut req = head.to_vec();
    req.extend_from_slice(
        format!(
            "\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .as_bytes(),
    );
    s.write_all(&req).await.unwrap();
    let mut buf = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut buf))
        .await
        .expect("the gateway answered within 10 s")
        .unwrap();
    let text = String::from_utf8_lossy(&buf).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status line in {text:?}"));
    Answer {
        status,
        head: head.to_owned(),
        body: body.to_owned(),
    }
}

/// `METHOD TARGET HTTP/1.1` with `Host`, JSON content and the extra fields.
async fn send(addr: SocketAddr, method: &str, target: &str, fields: &[(&str, &str)]) -> Answer {
    let mut head =
        format!("{method} {target} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json");
    for (n, v) in fields {
        head.push_str(&format!("\r\n{n}: {v}"));
    }
    raw(addr, head.as_bytes(), r#"{"amount":10}"#).await
}

async fn gateway(dir: &tempfile::TempDir, upstream: &str, extra: &[&str]) -> GatewayProc {
    let mut args = vec!["--upstream", upstream, "--store", "memory://"];
    args.extend_from_slice(extra);
    GatewayProc::start(dir.path(), &unique("door"), &args).await
}

// ------------------------------------------------------------------ tests

/// Item 1: `POST`, `POST`, `post`, `post`, `Post` with one key → one charge
/// (main: 1, 1, 2, 3, 4); the case variants get 400 `method-case`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lowercase_method_never_skips_the_guard() {
    let up = FlaskLike::start().await;
    let dir = tempfile::tempdir().unwrap();
    let gw = gateway(&dir, &up.url, &[]).await;
    let key = unique("pay-once");
    let k = [("Idempotency-Key", key.as_str())];
    let first = send(gw.addr, "POST", "/pay/1", &k).await;
    assert_eq!(first.status, 201, "{first:?}");
    let again = send(gw.addr, "POST", "/pay/1", &k).await;
    assert_eq!(again.status, 201);
    assert_eq!(again.header("idempotent-replayed").as_deref(), Some("true"));
    for method in ["post", "post", "Post", "pOST"] {
        let a = send(gw.addr, method, "/pay/1", &k).await;
        assert_eq!(a.status, 400, "{method}: {a:?}");
        assert!(a.is_problem("method-case"), "{method}: {a:?}");
        assert!(!a.upstream_answered());
    }
    // Without a key too: a case variant is never forwarded unguarded.
    let a = send(gw.addr, "patch", "/pay/2", &[]).await;
    assert!(a.is_problem("method-case"), "{a:?}");
    assert_eq!(up.charges_of("/pay/1"), 1, "charges per retry");
    assert!(
        up.seen().iter().all(|s| s.method == "POST"),
        "{:?}",
        up.seen()
    );
    assert_eq!(up.charges(), 1);
    // An unguarded method in any case is the upstream's business.
    let a = send(gw.addr, "get", "/echo", &[]).await;
    assert_eq!(a.status, 200, "{a:?}");
}

/// Item 2: behind `--require-token /pay`, no spelling of `/pay/1` without a
/// key is ever 2xx (main: 201 each time, charges 1–5).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_routes_hold_for_every_spelling_of_the_path() {
    let up = FlaskLike::start().await;
    let dir = tempfile::tempdir().unwrap();
    let gw = gateway(&dir, &up.url, &["--require-token", "/pay"]).await;
    for (method, target) in [
        ("POST", "/%70ay/1"),
        ("POST", "/pa%79/1"),
        ("POST", "/pay%2F1"),
        ("POST", "/pay%2f1"),
        ("POST", "//pay/1"),
        ("POST", "/pay//1"),
        ("POST", "/./pay/1"),
        ("POST", "/x/../pay/1"),
        ("POST", "/%2e%2e/pay/1"),
        ("POST", "/pay;x/1"),
        ("POST", "/PAY/1"),
        ("POST", "/pay%252F1"),
        ("post", "/pay/1"),
        ("Post", "/%70ay/1"),
    ] {
        let a = send(gw.addr, method, target, &[]).await;
        assert!(!(200..300).contains(&a.status), "{method} {target} → {a:?}");
        assert!(
            a.head.contains("application/problem+json"),
            "{method} {target} → {a:?}"
        );
        // With a key that is no token: refused as well.
        let k = unique("not-a-token");
        let a = send(gw.addr, method, target, &[("Idempotency-Key", &k)]).await;
        assert!(
            !(200..300).contains(&a.status),
            "{method} {target} keyed → {a:?}"
        );
    }
    assert_eq!(up.charges(), 0, "{:?}", up.seen());
}

/// Item 2: `/_idem/` under any spelling is the gateway's (main: `/%5Fidem/tokens` was proxied).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reserved_paths_are_never_proxied_under_any_spelling() {
    let up = FlaskLike::start().await;
    let dir = tempfile::tempdir().unwrap();
    let gw = gateway(&dir, &up.url, &["--require-token", "/pay"]).await;
    for (method, target) in [
        ("POST", "/%5Fidem/tokens"),
        ("POST", "/%5fidem/tokens"),
        ("POST", "//_idem/tokens"),
        ("POST", "/x/../_idem/tokens"),
        ("POST", "/_idem/./tokens"),
        ("GET", "/%5Fidem/health"),
        ("GET", "/_IDEM/health"),
        ("GET", "/%5Fidem"),
        ("GET", "/_idem%2Fhealth"),
    ] {
        let a = send(gw.addr, method, target, &[]).await;
        assert!(
            !a.upstream_answered(),
            "{method} {target} was proxied: {a:?}"
        );
    }
    let a = send(gw.addr, "GET", "/%5Fidem/health", &[]).await;
    assert_eq!(a.status, 200, "{a:?}");
    assert!(up.seen().is_empty(), "{:?}", up.seen());
}

/// Item 2: `--upstream http://…/api` is never left (main: `/../admin` was
/// forwarded as `/api/../admin`, which the upstream resolves to `/admin`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_upstream_prefix_is_never_escaped() {
    let up = FlaskLike::start().await;
    let dir = tempfile::tempdir().unwrap();
    let gw = gateway(&dir, &format!("http://{}/api", up.addr), &[]).await;
    let escapes = [
        "/../admin",
        "/..//admin",
        "//../admin",
        "/a/../../admin",
        "/%2e%2e/admin",
        "/.%2E/admin",
        "/..%2Fadmin",
        "/%2e%2e%2fadmin",
        "/..%5Cadmin",
        "/..\\admin",
        "/..;/admin",
        "/%252e%252e/admin",
    ];
    for target in escapes {
        for method in ["GET", "POST"] {
            let k = unique("esc");
            let a = send(gw.addr, method, target, &[("Idempotency-Key", &k)]).await;
            assert_ne!(a.status, 200, "{method} {target} → {a:?}");
        }
    }
    let seen = up.seen();
    let outside: Vec<&Seen> = seen
        .iter()
        .filter(|s| !(s.path == "/api" || s.path.starts_with("/api/")))
        .collect();
    assert!(outside.is_empty(), "reached outside /api: {outside:?}");
    // The prefix still works for ordinary paths, normalised on the way.
    let a = send(
        gw.addr,
        "POST",
        "/%70ay/7",
        &[("Idempotency-Key", &unique("p"))],
    )
    .await;
    assert_eq!(a.status, 201, "{a:?}");
    assert_eq!(up.charges_of("/api/pay/7"), 1);
    assert_eq!(up.seen().last().unwrap().raw_path, "/api/pay/7");
}

// ------------------------------------------------------------ upstream 101

/// An upstream that answers `101 Switching Protocols` to every request,
/// counting them.
async fn switching_upstream() -> (String, Arc<Mutex<usize>>, tokio::task::JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let hits = Arc::new(Mutex::new(0usize));
    let counted = hits.clone();
    let task = tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = listener.accept().await else {
                return;
            };
            let hits = counted.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                loop {
                    let Ok(n) = s.read(&mut chunk).await else {
                        return;
                    };
                    if n == 0 {
                        return;
                    }
                    buf.extend_from_slice(&chunk[..n]);
                    if buf.windows(4).any(|w| w == b"\r\n\r\n") {
                        break;
                    }
                }
                *hits.lock().unwrap() += 1;
                let _ = s
                    .write_all(
                        b"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\n\
                          Upgrade: websocket\r\n\r\n",
                    )
                    .await;
                tokio::time::sleep(Duration::from_millis(200)).await;
            });
        }
    });
    (url, hits, task)
}

/// Item 7: an upstream 101 to a guarded POST is a failure, 502
/// `upstream-protocol`, the key released (main: stored and replayed for the
/// TTL); to an unguarded GET, 502 too (main: passed on without `Upgrade`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_101_is_never_stored_or_passed_on() {
    let (url, hits, task) = switching_upstream().await;
    let dir = tempfile::tempdir().unwrap();
    let gw = gateway(&dir, &url, &[]).await;
    let key = unique("upgrade");
    for round in 1..=2 {
        let a = send(gw.addr, "POST", "/ws", &[("Idempotency-Key", &key)]).await;
        assert_eq!(a.status, 502, "round {round}: {a:?}");
        assert!(a.is_problem("upstream-protocol"), "{a:?}");
        assert!(a.header("idempotent-replayed").is_none(), "{a:?}");
        assert_eq!(*hits.lock().unwrap(), round, "the key was not released");
    }
    let a = send(gw.addr, "GET", "/ws", &[("Upgrade", "websocket")]).await;
    assert_eq!(a.status, 502, "{a:?}");
    assert!(a.is_problem("upstream-protocol"), "{a:?}");
    task.abort();
}

// ---------------------------------------------------------------- hygiene

/// Item 9: two `Host` fields → 400 problem (RFC 9112 §3.2; main: accepted);
/// so is an HTTP/1.1 request without one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_host_fields_are_refused() {
    let up = FlaskLike::start().await;
    let dir = tempfile::tempdir().unwrap();
    let gw = gateway(&dir, &up.url, &[]).await;
    let k = unique("hosts");
    for head in [
        format!("POST /pay/1 HTTP/1.1\r\nHost: a.test\r\nHost: b.test\r\nIdempotency-Key: {k}"),
        "GET /echo HTTP/1.1\r\nHost: a.test\r\nHost: a.test".to_owned(),
        "GET /echo HTTP/1.1\r\nX-Other: 1".to_owned(),
        "GET /echo HTTP/1.1\r\nHost: a b".to_owned(),
    ] {
        let a = raw(gw.addr, head.as_bytes(), "").await;
        assert_eq!(a.status, 400, "{head:?}: {a:?}");
        assert!(a.is_problem("invalid-host"), "{head:?}: {a:?}");
    }
    assert!(up.seen().is_empty(), "{:?}", up.seen());
    let ok = raw(gw.addr, b"GET /echo HTTP/1.0", "").await;
    assert_eq!(ok.status, 200, "HTTP/1.0 may omit Host: {ok:?}");
}

/// Item 9: forwarding fields are the gateway's own unless the peer is a
/// `--trusted-proxy` (main: a client's `X-Forwarded-Host`/`-Proto` reached
/// the upstream unchanged).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forwarding_fields_are_trusted_only_from_trusted_proxies() {
    let up = FlaskLike::start().await;
    let dir = tempfile::tempdir().unwrap();
    let claims = [
        ("X-Forwarded-For", "203.0.113.9"),
        ("X-Forwarded-Host", "evil.test"),
        ("X-Forwarded-Proto", "https"),
        ("Forwarded", "for=203.0.113.9;proto=https"),
    ];
    let untrusted = gateway(&dir, &up.url, &[]).await;
    let a = send(untrusted.addr, "GET", "/echo", &claims).await;
    assert_eq!(a.status, 200);
    let h = up.seen().last().unwrap().headers.clone();
    let host = untrusted.addr.to_string();
    assert_eq!(h["x-forwarded-for"], "127.0.0.1");
    assert_eq!(h["x-forwarded-host"], host.as_str());
    assert_eq!(h["x-forwarded-proto"], "http");
    assert_eq!(
        h["forwarded"],
        format!("for=127.0.0.1;host=\"{host}\";proto=http").as_str()
    );
    assert_eq!(h.get_all("x-forwarded-host").iter().count(), 1);

    let trusted = GatewayProc::start_with(
        dir.path(),
        &unique("trusted"),
        &["--upstream", &up.url, "--store", "memory://"],
        |c| {
            c.env("IDEM_TRUSTED_PROXIES", "10.0.0.0/8,127.0.0.0/8");
        },
    )
    .await;
    let a = send(trusted.addr, "GET", "/echo", &claims).await;
    assert_eq!(a.status, 200);
    let h = up.seen().last().unwrap().headers.clone();
    let host = trusted.addr.to_string();
    assert_eq!(h["x-forwarded-for"], "203.0.113.9, 127.0.0.1");
    assert_eq!(h["x-forwarded-host"], "evil.test");
    assert_eq!(h["x-forwarded-proto"], "https");
    assert_eq!(
        h["forwarded"],
        format!("for=203.0.113.9;proto=https, for=127.0.0.1;host=\"{host}\";proto=http").as_str()
    );
}

/// Item 9: one key, one value to the upstream: `"k"`, `k` and `"k";p=1`
/// all arrive as `k` (main: forwarded raw).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_key_reaches_the_upstream_bare() {
    let up = FlaskLike::start().await;
    let dir = tempfile::tempdir().unwrap();
    let gw = gateway(&dir, &up.url, &[]).await;
    let k = unique("bare");
    for (i, sent) in [format!("\"{k}\""), k.clone(), format!("\"{k}\";p=1")]
        .iter()
        .enumerate()
    {
        let a = send(gw.addr, "POST", "/pay/9", &[("Idempotency-Key", sent)]).await;
        assert_eq!(a.status, 201, "{sent}: {a:?}");
        assert_eq!(
            a.header("idempotent-replayed").is_some(),
            i > 0,
            "{sent}: one key"
        );
    }
    let k2 = unique("bare2");
    let a = send(
        gw.addr,
        "POST",
        "/pay/10",
        &[("Idempotency-Key", &format!("\"{k2}\";a=?1"))],
    )
    .await;
    assert_eq!(a.status, 201);
    let keys: Vec<String> = up
        .seen()
        .iter()
        .map(|s| s.headers["idempotency-key"].to_str().unwrap().to_owned())
        .collect();
    assert_eq!(keys, [k, k2]);
    assert_eq!(up.charges(), 2);
}

/// Item 9: a key with `é` is reported as `'é'`, not as `'Ã' at byte 3`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_errors_name_the_character() {
    let up = FlaskLike::start().await;
    let dir = tempfile::tempdir().unwrap();
    let gw = gateway(&dir, &up.url, &[]).await;
    let head = format!(
        "POST /pay/1 HTTP/1.1\r\nHost: {}\r\nIdempotency-Key: caf\u{e9}-1",
        gw.addr
    );
    let a = raw(gw.addr, head.as_bytes(), "{}").await;
    assert_eq!(a.status, 400, "{a:?}");
    assert!(a.is_problem("invalid-key"), "{a:?}");
    let detail = serde_json::from_str::<serde_json::Value>(&a.body).unwrap()["detail"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(detail.contains("'\u{e9}' at byte 3"), "{detail}");
    assert!(!detail.contains('\u{c3}'), "{detail}");
    let mut bytes = format!(
        "POST /pay/1 HTTP/1.1\r\nHost: {}\r\nIdempotency-Key: ab",
        gw.addr
    )
    .into_bytes();
    bytes.push(0xff);
    let a = raw(gw.addr, &bytes, "{}").await;
    assert!(a.is_problem("invalid-key"), "{a:?}");
    assert!(a.body.contains("0xFF"), "{a:?}");
    assert_eq!(up.charges(), 0);
}

/// Item 9, a limit of hyper: a DEL or control character in a field is
/// refused by hyper's parser (httparse) with its own bare 400, before any
/// of the gateway's code runs; nothing reaches the upstream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_characters_in_a_field_get_hypers_bare_400() {
    let up = FlaskLike::start().await;
    let dir = tempfile::tempdir().unwrap();
    let gw = gateway(&dir, &up.url, &[]).await;
    for bad in [&b"a\x7fb"[..], b"a\x01b"] {
        let mut head =
            format!("POST /pay/1 HTTP/1.1\r\nHost: {}\r\nX-Note: ", gw.addr).into_bytes();
        head.extend_from_slice(bad);
        let a = raw(gw.addr, &head, "{}").await;
        assert_eq!(a.status, 400, "{a:?}");
        assert!(a.body.is_empty(), "hyper answers without a body: {a:?}");
    }
    assert!(up.seen().is_empty());
}

/// Item 2: an upstream prefix that is not one plain path, or a
/// `--trusted-proxy` that is no CIDR, stops the gateway at start (exit 2,
/// naming the flag).
#[test]
fn unusable_prefix_or_trusted_proxy_is_refused_at_start() {
    for (args, flag) in [
        (
            vec!["--upstream", "http://127.0.0.1:1/api/../admin"],
            "--upstream",
        ),
        (vec!["--upstream", "http://127.0.0.1:1/a%2Fb"], "--upstream"),
        (
            vec![
                "--upstream",
                "http://127.0.0.1:1",
                "--trusted-proxy",
                "proxy.internal",
            ],
            "--trusted-proxy",
        ),
    ] {
        let mut child = support::idem()
            .arg("gateway")
            .args(&args)
            .args(["--store", "memory://", "--listen", "127.0.0.1:0"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        // Bounded: a gateway that accepted the setting would serve forever.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while child.try_wait().unwrap().is_none() {
            if std::time::Instant::now() > deadline {
                let _ = child.kill();
                panic!("{args:?}: the gateway started instead of refusing the setting");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let out = child.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(flag), "{args:?}: {stderr}");
    }
}
