//! Test harness: a real upstream (axum on an ephemeral port, or a raw TCP
//! server for broken connections), an in-process gateway on 127.0.0.1:0,
//! and the testkit's fault store ([`FaultyStore`]) re-exported.
#![allow(dead_code, unused_imports, unreachable_pub, missing_docs)]

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{FromRequest, Path, Query, Request};
pub use axum::http::Method;
use axum::http::{HeaderMap, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{self, any, get};
use axum::Router;
pub use idem_core::MemoryStore;
use idem_core::{DynStore, Store};
use idem_gateway::{Gateway, GatewayConfig};
pub use idem_testkit::faulty::{Fault, FaultyStore, Op};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

pub mod tls;

/// What the upstream saw of one request.
#[derive(Debug, Clone)]
pub struct Seen {
    pub method: Method,
    pub uri: Uri,
    pub headers: HeaderMap,
    pub body: Bytes,
}

#[derive(Clone, Default)]
struct AppState {
    hits: Arc<AtomicUsize>,
    seen: Arc<Mutex<Vec<Seen>>>,
}

impl AppState {
    fn hit(&self, seen: Seen) -> usize {
        self.seen.lock().unwrap().push(seen);
        self.hits.fetch_add(1, Ordering::SeqCst) + 1
    }
}

/// An execution of the upstream: extracting it records the request (read
/// to the end) and counts it; `.0` is this execution's number.
struct Hit(usize, Seen);

impl FromRequest<AppState> for Hit {
    type Rejection = Response;

    async fn from_request(req: Request, s: &AppState) -> Result<Self, Response> {
        let (parts, body) = req.into_parts();
        let body = Bytes::from_request(Request::from_parts(parts.clone(), body), s)
            .await
            .map_err(IntoResponse::into_response)?;
        let seen = Seen {
            method: parts.method,
            uri: parts.uri,
            headers: parts.headers,
            body,
        };
        Ok(Hit(s.hit(seen.clone()), seen))
    }
}

/// A running upstream that counts executions.
pub struct TestUpstream {
    pub addr: SocketAddr,
    pub hits: Arc<AtomicUsize>,
    pub seen: Arc<Mutex<Vec<Seen>>>,
    task: JoinHandle<()>,
}

impl TestUpstream {
    pub fn hits(&self) -> usize {
        self.hits.load(Ordering::SeqCst)
    }
    pub fn last_seen(&self) -> Seen {
        self.seen
            .lock()
            .unwrap()
            .last()
            .cloned()
            .expect("upstream saw a request")
    }
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

impl Drop for TestUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[derive(serde::Deserialize)]
struct SlowQ {
    ms: Option<u64>,
}

#[derive(serde::Deserialize)]
struct LargeQ {
    bytes: usize,
}

fn app(state: AppState) -> Router {
    Router::new()
        // 201 with Location, ETag, two Set-Cookie and a JSON body naming the execution.
        .route(
            "/orders",
            routing::post(|Hit(n, _): Hit| async move {
                Response::builder()
                    .status(StatusCode::CREATED)
                    .header("location", format!("/orders/{n}"))
                    .header("etag", format!("\"v{n}\""))
                    .header("set-cookie", format!("a={n}; Path=/"))
                    .header("set-cookie", "b=2; HttpOnly")
                    .header("content-type", "application/json")
                    .body(Body::from(format!("{{\"order\":{n}}}")))
                    .unwrap()
            })
            .patch(|Hit(n, _): Hit| async move { (StatusCode::OK, format!("patched {n}")) }),
        )
        // An upstream that claims its own answer is a replay.
        .route(
            "/claims-replayed",
            routing::post(|Hit(n, _): Hit| async move {
                Response::builder()
                    .status(StatusCode::CREATED)
                    .header("idempotent-replayed", "true")
                    .body(Body::from(format!("claims {n}")))
                    .unwrap()
            }),
        )
        .route(
            "/refunds",
            routing::post(
                |Hit(n, _): Hit| async move { (StatusCode::CREATED, format!("refund {n}")) },
            ),
        )
        .route(
            "/slow",
            routing::post(|Query(q): Query<SlowQ>, Hit(n, _): Hit| slow("slow", q, n, true)),
        )
        // Sleeps only in its first execution.
        .route(
            "/slow-first",
            routing::post(|Query(q): Query<SlowQ>, Hit(n, _): Hit| {
                slow("slow-first", q, n, n == 1)
            }),
        )
        .route(
            "/status/{code}",
            // `?ms=`: does its work, sleeps that long, then answers.
            routing::post(
                |Path(code): Path<u16>, Query(q): Query<SlowQ>, Hit(n, _): Hit| async move {
                    if let Some(ms) = q.ms {
                        tokio::time::sleep(Duration::from_millis(ms)).await;
                    }
                    let status = StatusCode::from_u16(code).unwrap_or(StatusCode::IM_A_TEAPOT);
                    (
                        status,
                        [("content-type", "application/json")],
                        format!("{{\"status\":{code},\"execution\":{n}}}"),
                    )
                },
            ),
        )
        .route(
            "/binary",
            routing::post(|Hit(n, _): Hit| async move {
                let mut body = vec![0u8, 0x9f, 0x92, 0x96, 0xff, 0xfe, b'\r', b'\n', 0];
                body.push(n as u8);
                ([("content-type", "application/octet-stream")], body)
            }),
        )
        .route(
            "/large",
            routing::post(|Query(q): Query<LargeQ>, Hit(n, _): Hit| async move {
                let body: Vec<u8> = (0..q.bytes).map(|i| (i % 251) as u8 ^ n as u8).collect();
                body
            }),
        )
        // Three chunks, 100 ms apart, with no Content-Length (chunked encoding).
        .route(
            "/chunked",
            any(|Hit(n, _): Hit| async move {
                let stream = async_stream(n);
                Response::builder()
                    .status(StatusCode::OK)
                    .header("content-type", "text/plain")
                    .body(Body::from_stream(stream))
                    .unwrap()
            }),
        )
        // Echoes what it received, as JSON; repeated headers kept.
        .route(
            "/echo",
            any(|Hit(n, seen): Hit| async move {
                let headers: Vec<(String, String)> = seen
                    .headers
                    .iter()
                    .map(|(k, v)| {
                        (
                            k.to_string(),
                            String::from_utf8_lossy(v.as_bytes()).into_owned(),
                        )
                    })
                    .collect();
                axum::Json(serde_json::json!({
                    "execution": n,
                    "method": seen.method.as_str(),
                    "uri": seen.uri.to_string(),
                    "headers": headers,
                    "body_len": seen.body.len(),
                }))
                .into_response()
            }),
        )
        .route(
            "/items",
            get(|Hit(n, _): Hit| async move { format!("items {n}") }),
        )
        .fallback(|_: Hit| async { (StatusCode::NOT_FOUND, "no such route") })
        .with_state(state)
}

/// Execution `n` of a slow route: sleeps `?ms=` (500 ms by default) when
/// `sleeps`, then answers 200 `{label} {n}`.
async fn slow(label: &str, q: SlowQ, n: usize, sleeps: bool) -> (StatusCode, String) {
    if sleeps {
        tokio::time::sleep(Duration::from_millis(q.ms.unwrap_or(500))).await;
    }
    (StatusCode::OK, format!("{label} {n}"))
}

fn async_stream(n: usize) -> impl futures::Stream<Item = Result<Bytes, std::io::Error>> + Send {
    futures::stream::unfold(0u8, move |i| async move {
        if i == 3 {
            return None;
        }
        if i > 0 {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Some((
            Ok(Bytes::from(format!("chunk{i}-of-execution-{n};"))),
            i + 1,
        ))
    })
}

/// Starts the upstream app on an ephemeral port.
pub async fn upstream() -> TestUpstream {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    upstream_on(listener).await
}

/// Starts the upstream app on a given listener.
pub async fn upstream_on(listener: TcpListener) -> TestUpstream {
    let addr = listener.local_addr().unwrap();
    let state = AppState::default();
    let (hits, seen) = (state.hits.clone(), state.seen.clone());
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, app(state)).await;
    });
    TestUpstream {
        addr,
        hits,
        seen,
        task,
    }
}

/// What a raw upstream does with each request.
#[derive(Debug, Clone)]
pub enum RawAction {
    /// Read the request and close the socket without a byte of answer.
    CloseWithoutAnswer,
    /// Write these bytes, then close the socket.
    WriteAndClose(Vec<u8>),
    /// Write these bytes, keep the socket open for the duration (a stalled
    /// response), then close it.
    WriteAndStall(Vec<u8>, Duration),
}

/// A raw TCP upstream for broken connections and exact response bytes.
pub struct RawUpstream {
    pub addr: SocketAddr,
    pub hits: Arc<AtomicUsize>,
    pub requests: Arc<Mutex<Vec<Vec<u8>>>>,
    task: JoinHandle<()>,
}

impl RawUpstream {
    pub fn hits(&self) -> usize {
        self.hits.load(Ordering::SeqCst)
    }
}

impl Drop for RawUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Reads one HTTP/1.1 request head and its Content-Length body.
pub async fn read_request(sock: &mut tokio::net::TcpStream) -> Vec<u8> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        if let Some(end) = find(&buf, b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
            let len = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse::<usize>().ok())
                .unwrap_or(0);
            if buf.len() >= end + 4 + len {
                return buf;
            }
        }
        match sock.read(&mut chunk).await {
            Ok(0) | Err(_) => return buf,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
}

fn find(h: &[u8], n: &[u8]) -> Option<usize> {
    h.windows(n.len()).position(|w| w == n)
}

pub async fn raw_upstream(action: RawAction) -> RawUpstream {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let hits = Arc::new(AtomicUsize::new(0));
    let requests = Arc::new(Mutex::new(Vec::new()));
    let (h, r) = (hits.clone(), requests.clone());
    let task = tokio::spawn(async move {
        loop {
            let Ok((mut sock, _)) = listener.accept().await else {
                return;
            };
            let (h, r, action) = (h.clone(), r.clone(), action.clone());
            tokio::spawn(async move {
                let req = read_request(&mut sock).await;
                if req.is_empty() {
                    return;
                }
                h.fetch_add(1, Ordering::SeqCst);
                r.lock().unwrap().push(req);
                match action {
                    RawAction::CloseWithoutAnswer => {}
                    RawAction::WriteAndClose(bytes) => {
                        let _ = sock.write_all(&bytes).await;
                        let _ = sock.flush().await;
                    }
                    RawAction::WriteAndStall(bytes, stall) => {
                        let _ = sock.write_all(&bytes).await;
                        let _ = sock.flush().await;
                        tokio::time::sleep(stall).await;
                    }
                }
                drop(sock);
            });
        }
    });
    RawUpstream {
        addr,
        hits,
        requests,
        task,
    }
}

/// A raw upstream doing `action`, and a gateway in front of it (memory
/// store) configured by `tweak`.
pub async fn raw_rig(
    action: RawAction,
    tweak: impl FnOnce(&mut GatewayConfig),
) -> (RawUpstream, TestGateway) {
    let raw = raw_upstream(action).await;
    let gw = gateway(&format!("http://{}", raw.addr), tweak).await;
    (raw, gw)
}

/// A running in-process gateway; shut down (gracefully) on drop.
pub struct TestGateway {
    pub addr: SocketAddr,
    pub store: DynStore,
    shutdown: Option<oneshot::Sender<()>>,
    pub task: Option<JoinHandle<Result<(), idem_gateway::GatewayError>>>,
}

impl TestGateway {
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// Signals shutdown and waits for `serve` to return.
    pub async fn stop(mut self) -> Result<(), idem_gateway::GatewayError> {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        self.task.take().unwrap().await.unwrap()
    }

    pub fn signal_shutdown(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
    }
}

impl Drop for TestGateway {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
    }
}

/// A configuration for `upstream` on 127.0.0.1:0 with a memory store.
pub fn config(upstream: &str) -> GatewayConfig {
    let mut c = GatewayConfig::new(upstream.parse().unwrap());
    c.listen = "127.0.0.1:0".parse().unwrap();
    c.store = "memory://".into();
    // Many gateways run at once in one test binary: no admin port to share.
    c.admin_listen = idem_gateway::AdminListen::Off;
    c
}

/// Starts a gateway with `config` and the given store.
pub async fn gateway_with(config: GatewayConfig, store: DynStore) -> TestGateway {
    let gw = Gateway::bind_with_store(config, store.clone())
        .await
        .unwrap();
    let addr = gw.local_addr();
    let (tx, rx) = oneshot::channel::<()>();
    let task = tokio::spawn(gw.serve(async move {
        let _ = rx.await;
    }));
    TestGateway {
        addr,
        store,
        shutdown: Some(tx),
        task: Some(task),
    }
}

/// Starts a gateway in front of `upstream` with a memory store, after `tweak`.
pub async fn gateway(upstream: &str, tweak: impl FnOnce(&mut GatewayConfig)) -> TestGateway {
    let mut c = config(upstream);
    tweak(&mut c);
    gateway_with(c, Arc::new(MemoryStore::new())).await
}

/// An upstream, a gateway with a memory store in front of it, and a client:
/// what most tests start with.
pub struct Rig {
    pub up: TestUpstream,
    pub gw: TestGateway,
    pub c: reqwest::Client,
}

/// Starts a [`Rig`], the gateway configured by `tweak`.
pub async fn rig(tweak: impl FnOnce(&mut GatewayConfig)) -> Rig {
    let up = upstream().await;
    let gw = gateway(&up.url(), tweak).await;
    Rig {
        up,
        gw,
        c: client(),
    }
}

/// Like [`rig`], with the gateway on `store`.
pub async fn rig_with<S: Store + Clone>(store: S, tweak: impl FnOnce(&mut GatewayConfig)) -> Rig {
    let up = upstream().await;
    let mut cfg = config(&up.url());
    tweak(&mut cfg);
    let gw = gateway_with(cfg, Arc::new(store)).await;
    Rig {
        up,
        gw,
        c: client(),
    }
}

/// Like [`rig`], with the gateway on a [`FaultyStore`] over a memory
/// store, returned beside it to arm faults on.
pub async fn faulty_rig(tweak: impl FnOnce(&mut GatewayConfig)) -> (Rig, FaultyStore<MemoryStore>) {
    let store = FaultyStore::new(MemoryStore::new());
    (rig_with(store.clone(), tweak).await, store)
}

/// The request `method url` with `headers` (repeats kept).
fn with_headers(
    c: &reqwest::Client,
    method: Method,
    url: &str,
    headers: &[(&str, &str)],
) -> reqwest::RequestBuilder {
    headers
        .iter()
        .fold(c.request(method, url), |r, (name, value)| {
            r.header(*name, *value)
        })
}

/// Sends `method url` with `headers` (repeats kept) and `body`, read to the end.
pub async fn send(
    c: &reqwest::Client,
    method: Method,
    url: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Got {
    let r = with_headers(c, method, url, headers).body(body.to_owned());
    read(r.send().await.unwrap()).await
}

/// Sends `method url` with `headers` (repeats kept) and no body, read to
/// the end.
pub async fn call(c: &reqwest::Client, method: Method, url: &str, headers: &[(&str, &str)]) -> Got {
    read(with_headers(c, method, url, headers).send().await.unwrap()).await
}

/// GETs `url`, read to the end.
pub async fn fetch(c: &reqwest::Client, url: &str) -> Got {
    read(c.get(url).send().await.unwrap()).await
}

/// A client that gives up after `ms` milliseconds.
pub fn impatient(ms: u64) -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_millis(ms))
        .build()
        .unwrap()
}

/// POSTs `{}` with key `k` to `url` from a client that gives up after
/// `ms` milliseconds, and expects it to give up (the call goes on).
pub async fn give_up_on(url: &str, k: &str, ms: u64) {
    let gone = post_request(&impatient(ms), url, Some(k), "{}")
        .send()
        .await;
    assert!(gone.is_err(), "the client was meant to give up");
}

pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap()
}

/// A unique key per call.
pub fn key(label: &str) -> String {
    static N: AtomicUsize = AtomicUsize::new(0);
    format!(
        "{label}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst)
    )
}

/// A response read to the end.
#[derive(Debug, Clone, PartialEq)]
pub struct Got {
    pub status: u16,
    pub headers: Vec<(String, Vec<u8>)>,
    pub body: Vec<u8>,
}

impl Got {
    pub fn header(&self, name: &str) -> Option<String> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| String::from_utf8_lossy(v).into_owned())
    }
    pub fn all(&self, name: &str) -> Vec<String> {
        self.headers
            .iter()
            .filter(|(n, _)| n == name)
            .map(|(_, v)| String::from_utf8_lossy(v).into_owned())
            .collect()
    }
    pub fn replayed(&self) -> bool {
        self.header("idempotent-replayed").as_deref() == Some("true")
    }
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or(serde_json::Value::Null)
    }
    /// The problem `type` of an RFC 9457 body.
    pub fn problem_type(&self) -> String {
        self.json()["type"].as_str().unwrap_or("").to_owned()
    }
    /// Headers other than those that legitimately differ between an
    /// original and its replay.
    pub fn stable_headers(&self) -> Vec<(String, Vec<u8>)> {
        self.headers
            .iter()
            .filter(|(n, _)| n != "date" && n != "idempotent-replayed")
            .cloned()
            .collect()
    }
}

pub async fn read(resp: reqwest::Response) -> Got {
    let status = resp.status().as_u16();
    let headers = resp
        .headers()
        .iter()
        .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec()))
        .collect();
    let body = resp.bytes().await.unwrap().to_vec();
    Got {
        status,
        headers,
        body,
    }
}

/// POSTs `body` to `url` with an `Idempotency-Key` (when given).
pub async fn post(c: &reqwest::Client, url: &str, key: Option<&str>, body: &str) -> Got {
    send_json(c, Method::POST, url, key, body).await
}

/// Sends JSON `body` as `method url` with an `Idempotency-Key` (when
/// given), read to the end.
pub async fn send_json(
    c: &reqwest::Client,
    method: Method,
    url: &str,
    key: Option<&str>,
    body: &str,
) -> Got {
    read(
        json_request(c, method, url, key, body)
            .send()
            .await
            .unwrap(),
    )
    .await
}

/// POSTs JSON `body` with key `k` as the caller its `caller` headers name
/// (an Authorization, an API key), read to the end.
pub async fn post_as(
    c: &reqwest::Client,
    url: &str,
    k: &str,
    caller: &[(&str, &str)],
    body: &str,
) -> Got {
    let mut r = post_request(c, url, Some(k), body);
    for (name, value) in caller {
        r = r.header(*name, *value);
    }
    read(r.send().await.unwrap()).await
}

/// The request [`post`] sends.
pub fn post_request(
    c: &reqwest::Client,
    url: &str,
    key: Option<&str>,
    body: &str,
) -> reqwest::RequestBuilder {
    json_request(c, Method::POST, url, key, body)
}

/// The request [`send_json`] sends.
pub fn json_request(
    c: &reqwest::Client,
    method: Method,
    url: &str,
    key: Option<&str>,
    body: &str,
) -> reqwest::RequestBuilder {
    let r = c
        .request(method, url)
        .header("content-type", "application/json")
        .body(body.to_owned());
    match key {
        Some(k) => r.header("idempotency-key", k),
        None => r,
    }
}

/// POSTs `{}` with key `k` to `url` twice: the first runs (201), the
/// second is its replay. Returns the first.
pub async fn runs_then_replays(c: &reqwest::Client, url: &str, k: &str) -> Got {
    let first = post(c, url, Some(k), "{}").await;
    assert_eq!(first.status, 201, "{}", first.text());
    assert!(
        post(c, url, Some(k), "{}").await.replayed(),
        "{k} was not replayed"
    );
    first
}

/// A free port on 127.0.0.1 (bound, read, closed).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The calls a store outage is armed on in these tests: `begin` and `get`
/// (a store that went away, or a record that does not decode).
pub const BEGIN_AND_GET: [Op; 2] = [Op::Begin, Op::Get];

/// The detail of an injected [`Fault::Corrupt`].
pub const UNDECODABLE: &str = "unknown response format version 9";

/// Waits until `cond` holds, polling every 20 ms, for at most `bound`.
pub async fn eventually(bound: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let end = tokio::time::Instant::now() + bound;
    while tokio::time::Instant::now() < end {
        if cond() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    cond()
}

/// Asserts that less than `bound` passed since `t0`; `what` names the wait.
pub fn assert_within(t0: std::time::Instant, bound: Duration, what: &str) {
    let took = t0.elapsed();
    assert!(took < bound, "{what}: took {took:?}, over {bound:?}");
}

/// An error and its sources, `outer: inner: innermost`.
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    std::iter::successors(Some(e), |e| e.source())
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(": ")
}

/// An HTTP/2 (prior knowledge, h2c) client connection to `addr`: its
/// request sender, the connection driven on a task.
pub async fn h2_sender<B>(addr: SocketAddr) -> hyper::client::conn::http2::SendRequest<B>
where
    B: http_body::Body + Unpin + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (send, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(tcp),
    )
    .await
    .unwrap();
    tokio::spawn(conn);
    send
}
