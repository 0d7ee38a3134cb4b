//! The layer in front of a real axum 0.8 server on 127.0.0.1, driven by a
//! real HTTP/1.1 client (hyper) or a raw TCP socket. Nothing here mocks
//! what runs: the store is the real `MemoryStore` (with a `ManualClock`
//! where time matters); the testkit's `FaultyStore` wraps it to simulate an outage.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body as AxumBody;
use axum::extract::State;
use axum::response::{IntoResponse, Response as AxumResponse};
use axum::routing::{get, post, put};
use axum::{Extension, Router};
use bytes::Bytes;
use http::{header, HeaderMap, HeaderValue, Method, Request, StatusCode};
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::Frame;
use hyper_util::rt::TokioIo;
use idem_core::{
    IdempotencyKey, ManualClock, MemoryStore, Record, RecordState, Scope, Store, StoredResponse,
};
use idem_http::{Disposition, IdempotencyLayer};
use idem_testkit::faulty::{Fault, FaultyStore, Op};
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;
use tokio::task::JoinHandle;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

// ---------------------------------------------------------------- the app

#[derive(Clone, Default)]
struct App {
    calls: Arc<AtomicUsize>,
    finished: Arc<AtomicUsize>,
    gate: Arc<Notify>,
}

impl App {
    fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }

    /// Counts a handler call; returns its number (1 for the first).
    fn hit(&self) -> usize {
        self.calls.fetch_add(1, Ordering::SeqCst) + 1
    }
}

fn delay_of(headers: &HeaderMap) -> Option<Duration> {
    headers
        .get("x-delay-ms")
        .and_then(|v| v.to_str().ok()?.parse().ok())
        .map(Duration::from_millis)
}

/// 201 with Location, ETag, two Set-Cookie and a JSON body echoing the request.
async fn create_order(State(app): State<App>, headers: HeaderMap, body: Bytes) -> AxumResponse {
    let n = app.hit();
    if let Some(d) = delay_of(&headers) {
        tokio::time::sleep(d).await;
    }
    app.finished.fetch_add(1, Ordering::SeqCst);
    let echo = String::from_utf8_lossy(&body).into_owned();
    let seen_key = headers
        .get("idempotency-key")
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
        .unwrap_or_default();
    (
        StatusCode::CREATED,
        [
            (header::HeaderName::from_static("x-seen-key"), seen_key),
            (header::LOCATION, format!("/orders/{n}")),
            (header::ETAG, format!("\"v{n}\"")),
            (header::CONTENT_TYPE, "application/json".to_owned()),
        ],
        AppendCookies(vec!["session=abc; Path=/", "theme=dark"]),
        serde_json::json!({ "order": n, "echo": echo }).to_string(),
    )
        .into_response()
}

/// Appends several `Set-Cookie` fields.
struct AppendCookies(Vec<&'static str>);

impl axum::response::IntoResponseParts for AppendCookies {
    type Error = Infallible;
    fn into_response_parts(
        self,
        mut res: axum::response::ResponseParts,
    ) -> Result<axum::response::ResponseParts, Infallible> {
        for c in self.0 {
            res.headers_mut()
                .append(header::SET_COOKIE, HeaderValue::from_static(c));
        }
        Ok(res)
    }
}

const BINARY: &[u8] = &[0x00, 0xff, 0xfe, 0x80, b'x', 0xc3, 0x28, 0x0a, 0x0d];

async fn binary(State(app): State<App>) -> AxumResponse {
    app.hit();
    (
        StatusCode::CREATED,
        [
            (header::CONTENT_TYPE, "application/octet-stream"),
            // The layer must strip this from a first response.
            (
                header::HeaderName::from_static("idempotent-replayed"),
                "true",
            ),
        ],
        Bytes::from_static(BINARY),
    )
        .into_response()
}

async fn not_acceptable(State(app): State<App>) -> AxumResponse {
    app.hit();
    (
        StatusCode::NOT_ACCEPTABLE,
        [(header::CONTENT_TYPE, "application/json")],
        r#"{"error":"not acceptable","accept":["application/json"]}"#,
    )
        .into_response()
}

/// 500 on the first call, 201 afterwards.
async fn flaky(State(app): State<App>) -> AxumResponse {
    let n = app.hit();
    if n == 1 {
        (StatusCode::INTERNAL_SERVER_ERROR, "database down").into_response()
    } else {
        (StatusCode::CREATED, format!("created on attempt {n}")).into_response()
    }
}

fn pattern(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 31 % 251) as u8).collect()
}

/// A body of `x-len` bytes in one piece.
async fn big(State(app): State<App>, headers: HeaderMap) -> AxumResponse {
    app.hit();
    let len = headers
        .get("x-len")
        .and_then(|v| v.to_str().ok()?.parse().ok())
        .unwrap_or(5000);
    (StatusCode::CREATED, pattern(len)).into_response()
}

/// 2,000 bytes, then waits for the gate, then 3,000 more (streamed).
async fn big_stream(State(app): State<App>) -> AxumResponse {
    app.hit();
    let data = pattern(5000);
    let first = Bytes::copy_from_slice(&data[..2000]);
    let rest = Bytes::copy_from_slice(&data[2000..]);
    let gate = app.gate.clone();
    let stream = async_stream(first, gate, rest);
    (StatusCode::CREATED, AxumBody::from_stream(stream)).into_response()
}

fn async_stream(
    first: Bytes,
    gate: Arc<Notify>,
    rest: Bytes,
) -> impl futures::Stream<Item = Result<Bytes, Infallible>> + Send {
    futures::stream::unfold(0u8, move |step| {
        let (first, gate, rest) = (first.clone(), gate.clone(), rest.clone());
        async move {
            match step {
                0 => Some((Ok(first), 1)),
                1 => {
                    gate.notified().await;
                    Some((Ok(rest), 2))
                }
                _ => None,
            }
        }
    })
}

/// `status` with `first` as the start of its body, then a failure.
fn breaks_after(status: StatusCode, first: Bytes) -> AxumResponse {
    let chunks: Vec<Result<Bytes, std::io::Error>> =
        vec![Ok(first), Err(std::io::Error::other("upstream reset"))];
    (status, AxumBody::from_stream(futures::stream::iter(chunks))).into_response()
}

/// A body that fails after its first chunk.
async fn broken_stream(State(app): State<App>) -> AxumResponse {
    app.hit();
    breaks_after(StatusCode::OK, Bytes::from_static(b"partial"))
}

/// 2,000 bytes (over a 1,024-byte retention limit), then a failure.
async fn broken_big_stream(State(app): State<App>) -> AxumResponse {
    app.hit();
    breaks_after(StatusCode::CREATED, Bytes::from(pattern(2000)))
}

async fn panics(State(app): State<App>) -> StatusCode {
    app.hit();
    if app.calls() > 0 {
        panic!("handler bug");
    }
    StatusCode::OK
}

/// Waits for the gate, then 201.
async fn gated(State(app): State<App>) -> AxumResponse {
    app.hit();
    app.gate.notified().await;
    (StatusCode::CREATED, "done").into_response()
}

async fn hold_502(State(app): State<App>) -> AxumResponse {
    app.hit();
    (
        StatusCode::BAD_GATEWAY,
        Extension(Disposition::Hold),
        "timeout",
    )
        .into_response()
}

async fn release_200(State(app): State<App>) -> AxumResponse {
    app.hit();
    (StatusCode::OK, Extension(Disposition::Release), "not kept").into_response()
}

async fn read_only(State(app): State<App>) -> AxumResponse {
    let n = app.hit();
    (StatusCode::OK, format!("read {n}")).into_response()
}

async fn upload(State(app): State<App>, body: Bytes) -> AxumResponse {
    app.hit();
    (StatusCode::OK, format!("{}", body.len())).into_response()
}

fn router(app: App) -> Router {
    Router::new()
        .route(
            "/orders",
            post(create_order).patch(create_order).get(read_only),
        )
        .route("/refunds", post(create_order))
        .route("/binary", post(binary))
        .route("/not-acceptable", post(not_acceptable))
        .route("/flaky", post(flaky))
        .route("/big", post(big))
        .route("/big-stream", post(big_stream))
        .route("/broken-stream", post(broken_stream))
        .route("/broken-big-stream", post(broken_big_stream))
        .route("/panic", post(panics))
        .route("/gated", post(gated))
        .route("/hold", post(hold_502))
        .route("/release", post(release_200))
        .route("/upload", put(upload))
        .route("/read", get(read_only))
        .with_state(app)
}

/// Serves the app behind `layer` on 127.0.0.1:0.
async fn serve(layer: IdempotencyLayer) -> (SocketAddr, App) {
    let app = App::default();
    let svc = router(app.clone()).layer(layer);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        axum::serve(listener, svc).await.unwrap();
    });
    (addr, app)
}

/// Serves the app behind a layer on a fresh memory store, the layer's
/// settings made by `with`.
async fn serve_on_memory(
    with: impl FnOnce(IdempotencyLayer) -> IdempotencyLayer,
) -> (MemoryStore, SocketAddr, App) {
    let store = MemoryStore::new();
    let (addr, app) = serve(with(IdempotencyLayer::new(store.clone()))).await;
    (store, addr, app)
}

/// Serves the app behind a layer with `lease` on a store whose clock the
/// test moves by hand.
async fn serve_on_clock(lease: Duration) -> (ManualClock, MemoryStore, SocketAddr, App) {
    let clock = ManualClock::starting_now();
    let store = MemoryStore::new().with_clock(clock.clone());
    let (addr, app) = serve(IdempotencyLayer::new(store.clone()).with_lease(lease)).await;
    (clock, store, addr, app)
}

/// The app behind a layer on a fresh memory store, to call in process
/// (no connection).
fn in_process() -> (MemoryStore, App, Router) {
    let store = MemoryStore::new();
    let app = App::default();
    let svc = router(app.clone()).layer(IdempotencyLayer::new(store.clone()));
    (store, app, svc)
}

// ---------------------------------------------------------------- the client

#[derive(Debug)]
struct Reply {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
}

impl Reply {
    fn replayed(&self) -> bool {
        self.headers
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true")
    }

    fn header(&self, name: &str) -> &str {
        self.headers
            .get(name)
            .map(|v| v.to_str().unwrap())
            .unwrap_or_else(|| panic!("no {name} header in {self:?}"))
    }

    fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap()
    }

    /// The `type` of a problem+json body.
    fn problem(&self) -> String {
        assert_eq!(
            self.header("content-type"),
            "application/problem+json",
            "{self:?}"
        );
        let v = self.json();
        assert_eq!(v["status"], self.status.as_u16(), "{v}");
        assert!(v["title"].is_string() && v["detail"].is_string(), "{v}");
        v["type"].as_str().unwrap().to_owned()
    }
}

/// Sends one request on a fresh connection and reads the whole response.
async fn try_send<B>(addr: SocketAddr, req: Request<B>) -> Result<Reply, BoxError>
where
    B: hyper::body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let stream = TcpStream::connect(addr).await?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(conn);
    let resp = sender.send_request(req).await?;
    let (parts, body) = resp.into_parts();
    let body = body.collect().await?.to_bytes();
    Ok(Reply {
        status: parts.status,
        headers: parts.headers,
        body,
    })
}

async fn send<B>(addr: SocketAddr, req: Request<B>) -> Reply
where
    B: hyper::body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    try_send(addr, req).await.unwrap()
}

fn request(method: Method, path: &str) -> http::request::Builder {
    Request::builder()
        .method(method)
        .uri(path)
        .header(header::HOST, "idem.test")
}

/// A `method` request to `path` with key `key` and `body`.
fn keyed(method: Method, path: &str, key: &str, body: &'static [u8]) -> Request<Full<Bytes>> {
    request(method, path)
        .header("idempotency-key", key)
        .body(Full::new(Bytes::from_static(body)))
        .unwrap()
}

/// A POST to /orders with key `key`, answered after `delay_ms`, as the
/// router itself takes it (no connection).
fn slow_order(key: &str, delay_ms: &str) -> Request<AxumBody> {
    Request::builder()
        .method(Method::POST)
        .uri("/orders")
        .header("idempotency-key", key)
        .header("x-delay-ms", delay_ms)
        .body(AxumBody::from("{}"))
        .unwrap()
}

/// Spawns a keyed POST to /gated and returns once the handler runs (and
/// waits for the gate).
async fn start_gated(addr: SocketAddr, app: &App, key: &'static str) -> JoinHandle<Reply> {
    let first = tokio::spawn(async move { send(addr, post_json("/gated", Some(key), "{}")).await });
    eventually("the gated handler to start", || {
        let n = app.calls();
        async move { n == 1 }
    })
    .await;
    first
}

/// A POST with a JSON body and (optionally) a key.
fn post_json(path: &str, key: Option<&str>, body: &str) -> Request<Full<Bytes>> {
    let mut b = request(Method::POST, path).header(header::CONTENT_TYPE, "application/json");
    if let Some(k) = key {
        b = b.header("idempotency-key", k);
    }
    b.body(Full::new(Bytes::from(body.to_owned()))).unwrap()
}

fn anon_key(store: &MemoryStore, key: &str) -> impl std::future::Future<Output = Option<Record>> {
    let store = store.clone();
    let key = IdempotencyKey::new(key).unwrap();
    async move { store.get(&Scope::anonymous(), &key).await.unwrap() }
}

/// Polls `f` until it is true or 5 s pass.
async fn eventually<F, Fut>(what: &str, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    for _ in 0..500 {
        if f().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("timed out waiting for: {what}");
}

fn completed(r: &Option<Record>) -> Option<&StoredResponse> {
    match r {
        Some(Record {
            state: RecordState::Completed { response, .. },
            ..
        }) => Some(response),
        _ => None,
    }
}

/// `r` is a replay of `original`: `status`, marked replayed, the same body.
fn assert_replay(r: &Reply, status: StatusCode, original: &Reply) {
    assert_eq!(r.status, status, "{r:?}");
    assert!(r.replayed(), "{r:?}");
    assert_eq!(r.body, original.body);
}

// ---------------------------------------------------------------- tests

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_concurrent_duplicates_execute_once() {
    let (_store, addr, app) = serve_on_memory(|l| l).await;
    let mut tasks = Vec::new();
    for _ in 0..50 {
        tasks.push(tokio::spawn(async move {
            let mut req = post_json("/orders", Some("\"charge-50\""), r#"{"amount":10}"#);
            req.headers_mut()
                .insert("x-delay-ms", HeaderValue::from_static("200"));
            send(addr, req).await
        }));
    }
    let mut replies = Vec::new();
    for t in tasks {
        replies.push(t.await.unwrap());
    }
    assert_eq!(app.calls(), 1, "the handler ran more than once");
    let originals: Vec<&Reply> = replies
        .iter()
        .filter(|r| r.status == StatusCode::CREATED && !r.replayed())
        .collect();
    assert_eq!(originals.len(), 1, "exactly one first execution");
    let original = originals[0];
    let mut conflicts = 0;
    for r in &replies {
        match r.status {
            StatusCode::CREATED => {
                assert_eq!(r.body, original.body);
                assert_eq!(r.header("location"), original.header("location"));
            }
            StatusCode::CONFLICT => {
                conflicts += 1;
                assert_eq!(r.problem(), "urn:idem:problem:in-flight");
                let secs: u64 = r.header("retry-after").parse().unwrap();
                assert!((1..=30).contains(&secs), "Retry-After {secs}");
            }
            other => panic!("unexpected status {other}: {r:?}"),
        }
    }
    // Usually most duplicates meet the original in flight; on a loaded
    // machine some may arrive after it and get the replay. Both are correct.
    eprintln!("{conflicts} of 50 duplicates got 409");
    // A later duplicate is a replay.
    let again = send(
        addr,
        post_json("/orders", Some("charge-50"), r#"{ "amount" : 10 }"#),
    )
    .await;
    assert_replay(&again, StatusCode::CREATED, original);
    assert_eq!(app.calls(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_is_faithful_d1() {
    let (store, addr, app) = serve_on_memory(|l| l).await;
    let first = send(
        addr,
        post_json("/orders", Some("\"d1\""), r#"{"item":"book"}"#),
    )
    .await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(
        first.header("x-seen-key"),
        "d1",
        "the key is forwarded bare (issue 11: one key, one value to the service)"
    );
    assert!(first.headers.get("idempotent-replayed").is_none());
    // Committed before the answer left: no waiting needed.
    let rec = anon_key(&store, "d1").await;
    assert_eq!(
        completed(&rec).expect("stored before answering").status,
        201
    );
    let again = send(addr, post_json("/orders", Some("d1"), r#"{"item":"book"}"#)).await;
    assert_eq!(again.status, StatusCode::CREATED);
    assert!(again.replayed());
    assert_eq!(again.header("location"), "/orders/1");
    assert_eq!(again.header("etag"), "\"v1\"");
    assert_eq!(again.header("content-type"), "application/json");
    let cookies: Vec<_> = again.headers.get_all("set-cookie").iter().collect();
    assert_eq!(cookies, ["session=abc; Path=/", "theme=dark"]);
    assert_eq!(again.body, first.body);
    assert_eq!(again.header("content-length"), first.body.len().to_string());
    assert_eq!(app.calls(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binary_body_replays_byte_for_byte() {
    let (addr, app) = serve(IdempotencyLayer::new(MemoryStore::new())).await;
    let req = || keyed(Method::POST, "/binary", "bin-1", b"\x01\x02");
    let first = send(addr, req()).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(
        first.headers.get("idempotent-replayed").is_none(),
        "a first response never says it is a replay"
    );
    assert_eq!(first.body.as_ref(), BINARY);
    let again = send(addr, req()).await;
    assert_eq!(again.status, StatusCode::CREATED);
    assert!(again.replayed());
    assert_eq!(
        again.headers.get_all("idempotent-replayed").iter().count(),
        1
    );
    assert_eq!(again.body.as_ref(), BINARY);
    assert_eq!(again.header("content-type"), "application/octet-stream");
    assert_eq!(app.calls(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_406_is_replayed_as_406_c2() {
    let (addr, app) = serve(IdempotencyLayer::new(MemoryStore::new())).await;
    let first = send(addr, post_json("/not-acceptable", Some("c2"), "{}")).await;
    let again = send(addr, post_json("/not-acceptable", Some("c2"), "{}")).await;
    assert_eq!(first.status, StatusCode::NOT_ACCEPTABLE);
    assert_replay(&again, StatusCode::NOT_ACCEPTABLE, &first);
    assert_eq!(again.json()["error"], "not acceptable");
    assert_eq!(app.calls(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_key_for_another_request_is_422_e2() {
    let (addr, app) = serve(IdempotencyLayer::new(MemoryStore::new())).await;
    let body = r#"{"amount":10}"#;
    let first = send(addr, post_json("/orders", Some("e2"), body)).await;
    assert_eq!(first.status, StatusCode::CREATED);

    // Same key and body on another route: never the first route's response.
    let other_path = send(addr, post_json("/refunds", Some("e2"), body)).await;
    assert_eq!(other_path.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(other_path.problem(), "urn:idem:problem:key-mismatch");
    assert!(!other_path.replayed());

    let other_body = send(addr, post_json("/orders", Some("e2"), r#"{"amount":11}"#)).await;
    assert_eq!(other_body.status, StatusCode::UNPROCESSABLE_ENTITY);

    let mut patch = post_json("/orders", Some("e2"), body);
    *patch.method_mut() = Method::PATCH;
    let other_method = send(addr, patch).await;
    assert_eq!(other_method.status, StatusCode::UNPROCESSABLE_ENTITY);

    let other_query = send(addr, post_json("/orders?dry_run=1", Some("e2"), body)).await;
    assert_eq!(other_query.status, StatusCode::UNPROCESSABLE_ENTITY);

    // Key order and whitespace do not matter for JSON.
    let same = send(
        addr,
        post_json("/orders", Some("e2"), "{ \"amount\" : 10.0 }\n"),
    )
    .await;
    assert_eq!(same.status, StatusCode::CREATED);
    assert!(same.replayed());
    assert_eq!(app.calls(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mismatch_while_in_flight_is_422_not_409() {
    let (addr, app) = serve(IdempotencyLayer::new(MemoryStore::new())).await;
    let first =
        tokio::spawn(
            async move { send(addr, post_json("/gated", Some("busy"), r#"{"a":1}"#)).await },
        );
    eventually("the first request to start", || {
        let n = app.calls();
        async move { n == 1 }
    })
    .await;
    let other = send(addr, post_json("/gated", Some("busy"), r#"{"a":2}"#)).await;
    assert_eq!(other.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(other.problem(), "urn:idem:problem:key-mismatch");
    let same = send(addr, post_json("/gated", Some("busy"), r#"{"a":1}"#)).await;
    assert_eq!(same.status, StatusCode::CONFLICT);
    app.gate.notify_one();
    assert_eq!(first.await.unwrap().status, StatusCode::CREATED);
    let other = send(addr, post_json("/gated", Some("busy"), r#"{"a":2}"#)).await;
    assert_eq!(
        other.status,
        StatusCode::UNPROCESSABLE_ENTITY,
        "also once done"
    );
    assert_eq!(app.calls(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_keys_are_400_and_touch_nothing_e1() {
    let (store, addr, app) = serve_on_memory(|l| l).await;
    let too_long = "k".repeat(256);
    let cases: Vec<(&[u8], &str)> = vec![
        (b"", "invalid-key"),
        (b"   ", "invalid-key"),
        (b"\"\"", "invalid-key"),
        (b"\"   \"", "invalid-key"),
        (b"\"unterminated", "invalid-key"),
        (b"\"bad\\escape\"", "invalid-key"),
        (b"\"abc\" trailing", "invalid-key"),
        (b"caf\xc3\xa9", "invalid-key"),
        (b"\"caf\xc3\xa9\"", "invalid-key"),
        (too_long.as_bytes(), "invalid-key"),
    ];
    for (value, kind) in cases {
        let req = request(Method::POST, "/orders")
            .header("idempotency-key", HeaderValue::from_bytes(value).unwrap())
            .body(Full::new(Bytes::from_static(b"{}")))
            .unwrap();
        let r = send(addr, req).await;
        assert_eq!(
            r.status,
            StatusCode::BAD_REQUEST,
            "{:?}",
            String::from_utf8_lossy(value)
        );
        assert_eq!(r.problem(), format!("urn:idem:problem:{kind}"));
    }
    // Two Idempotency-Key fields.
    let req = request(Method::POST, "/orders")
        .header("idempotency-key", "a")
        .header("idempotency-key", "a")
        .body(Full::new(Bytes::from_static(b"{}")))
        .unwrap();
    let r = send(addr, req).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert_eq!(r.problem(), "urn:idem:problem:multiple-keys");
    assert_eq!(app.calls(), 0);
    assert!(store.is_empty());

    // No key: passes through, twice, and the store stays empty.
    let a = send(addr, post_json("/orders", None, r#"{"a":1}"#)).await;
    let b = send(addr, post_json("/orders", None, r#"{"a":1}"#)).await;
    assert_eq!(
        (a.status, b.status),
        (StatusCode::CREATED, StatusCode::CREATED)
    );
    assert!(!a.replayed() && !b.replayed());
    assert_ne!(a.body, b.body);
    assert_eq!(app.calls(), 2);
    assert!(store.is_empty());

    // A bare UUID starting with a digit and a quoted key name the same key.
    let k = "8e0c6a7e-1b2c-4d5e-9f00-123456789abc";
    let bare = send(addr, post_json("/orders", Some(k), "{}")).await;
    let quoted = send(addr, post_json("/orders", Some(&format!("\"{k}\"")), "{}")).await;
    assert_eq!(bare.status, StatusCode::CREATED);
    assert!(quoted.replayed());
    assert_eq!(app.calls(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn require_key_refuses_requests_without_one() {
    let (store, addr, app) = serve_on_memory(|l| l.with_require_key(true)).await;
    let r = send(addr, post_json("/orders", None, "{}")).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert_eq!(r.problem(), "urn:idem:problem:key-required");
    assert_eq!(app.calls(), 0);
    // Unguarded methods still pass.
    let g = send(
        addr,
        request(Method::GET, "/read")
            .body(Full::new(Bytes::new()))
            .unwrap(),
    )
    .await;
    assert_eq!(g.status, StatusCode::OK);
    assert!(store.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn different_credentials_run_separately_e3() {
    let (addr, app) = serve(IdempotencyLayer::new(MemoryStore::new())).await;
    let with_auth = |auth: &'static str, body: &str| {
        let mut r = post_json("/orders", Some("shared-key"), body);
        r.headers_mut()
            .insert(header::AUTHORIZATION, HeaderValue::from_static(auth));
        r
    };
    let alice = send(addr, with_auth("Bearer alice", r#"{"who":"alice"}"#)).await;
    let bob = send(addr, with_auth("Bearer bob", r#"{"who":"bob"}"#)).await;
    assert_eq!(app.calls(), 2);
    assert!(!alice.replayed() && !bob.replayed());
    assert_eq!(alice.json()["echo"], r#"{"who":"alice"}"#);
    assert_eq!(bob.json()["echo"], r#"{"who":"bob"}"#);
    let alice_again = send(addr, with_auth("Bearer alice", r#"{"who":"alice"}"#)).await;
    assert!(alice_again.replayed());
    assert_eq!(alice_again.body, alice.body);
    // Anonymous callers are a third scope.
    let anon = send(
        addr,
        post_json("/orders", Some("shared-key"), r#"{"who":"anon"}"#),
    )
    .await;
    assert!(!anon.replayed());
    assert_eq!(app.calls(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_authorization_fields_scope_in_order() {
    let (addr, app) = serve(IdempotencyLayer::new(MemoryStore::new())).await;
    let two = |a: &'static str, b: &'static str| {
        request(Method::POST, "/orders")
            .header("idempotency-key", "multi")
            .header(header::AUTHORIZATION, a)
            .header(header::AUTHORIZATION, b)
            .body(Full::new(Bytes::from_static(b"x")))
            .unwrap()
    };
    let ab = send(addr, two("Basic a", "Bearer b")).await;
    let ba = send(addr, two("Bearer b", "Basic a")).await;
    let ab_again = send(addr, two("Basic a", "Bearer b")).await;
    assert!(!ab.replayed() && !ba.replayed());
    assert!(ab_again.replayed());
    assert_eq!(app.calls(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_5xx_is_released_and_the_retry_runs_once_more_c1() {
    let (store, addr, app) = serve_on_memory(|l| l).await;
    let first = send(addr, post_json("/flaky", Some("c1"), "{}")).await;
    assert_eq!(first.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert!(!first.replayed());
    // Not kept as the key's result: only shared (for `share_failure`, 1 s)
    // with duplicates that waited for it; the retry below did not wait, so
    // it waits out that window and runs.
    match anon_key(&store, "c1").await {
        None => {}
        Some(rec) => assert!(
            matches!(&rec.state, idem_core::RecordState::Completed { response, .. } if response.released),
            "a 5xx is kept as the result: {rec:?}"
        ),
    }
    let retry = send(addr, post_json("/flaky", Some("c1"), "{}")).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(!retry.replayed());
    let third = send(addr, post_json("/flaky", Some("c1"), "{}")).await;
    assert_eq!(third.status, StatusCode::CREATED);
    assert!(third.replayed());
    assert_eq!(third.body, "created on attempt 2");
    assert_eq!(app.calls(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_request_bodies_are_413_before_any_work() {
    let (store, addr, app) = serve_on_memory(|l| l.with_max_body(1024)).await;
    // With Content-Length.
    let r = send(
        addr,
        post_json("/orders", Some("big-req"), &"x".repeat(2000)),
    )
    .await;
    assert_eq!(r.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(r.problem(), "urn:idem:problem:body-too-large");
    // Chunked, no Content-Length: enforced while reading.
    let chunks: Vec<Result<Frame<Bytes>, Infallible>> = (0..4)
        .map(|_| Ok(Frame::data(Bytes::from(vec![b'y'; 400]))))
        .collect();
    let req = request(Method::POST, "/orders")
        .header("idempotency-key", "big-chunked")
        .body(StreamBody::new(futures::stream::iter(chunks)))
        .unwrap();
    let r = send(addr, req).await;
    assert_eq!(r.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(app.calls(), 0);
    assert!(store.is_empty());
    // Exactly the limit is fine.
    let ok = send(
        addr,
        post_json("/orders", Some("at-limit"), &"x".repeat(1024)),
    )
    .await;
    assert_eq!(ok.status, StatusCode::CREATED);
    // Unguarded methods have no limit and are not buffered.
    let put_req = request(Method::PUT, "/upload")
        .header("idempotency-key", "ignored")
        .body(Full::new(Bytes::from(vec![b'z'; 5000])))
        .unwrap();
    let r = send(addr, put_req).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.body, "5000");
    assert_eq!(store.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_over_the_retention_limit_are_410_on_replay() {
    let (store, addr, app) = serve_on_memory(|l| l.with_retention_limit(1024)).await;
    let first = send(addr, post_json("/big", Some("big-resp"), "{}")).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(
        first.body.as_ref(),
        pattern(5000).as_slice(),
        "the first caller gets it all"
    );
    let rec = anon_key(&store, "big-resp").await;
    let stored = completed(&rec).expect("completed");
    assert!(stored.body_omitted);
    assert!(stored.body.is_empty());
    assert_eq!(stored.status, 201);
    let dup = send(addr, post_json("/big", Some("big-resp"), "{}")).await;
    assert_eq!(dup.status, StatusCode::GONE);
    assert_eq!(dup.problem(), "urn:idem:problem:response-not-retained");
    assert_eq!(dup.json()["original_status"], 201);
    assert!(dup.json()["detail"].as_str().unwrap().contains("201"));
    assert_eq!(app.calls(), 1, "never a second execution");

    // Within the limit it is kept.
    let mut small = post_json("/big", Some("small-resp"), "{}");
    small
        .headers_mut()
        .insert("x-len", HeaderValue::from_static("1024"));
    let first = send(addr, small).await;
    let mut small = post_json("/big", Some("small-resp"), "{}");
    small
        .headers_mut()
        .insert("x-len", HeaderValue::from_static("1024"));
    let again = send(addr, small).await;
    assert!(again.replayed());
    assert_eq!(again.body, first.body);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_response_over_the_limit_completes_before_it_ends() {
    let (store, addr, app) = serve_on_memory(|l| l.with_retention_limit(1024)).await;
    let stream = TcpStream::connect(addr).await.unwrap();
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .unwrap();
    tokio::spawn(conn);
    let resp = sender
        .send_request(post_json("/big-stream", Some("stream-big"), "{}"))
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::CREATED);
    // Headers are here while the handler still holds back the rest: the key
    // is already completed (without its body).
    let rec = anon_key(&store, "stream-big").await;
    assert!(completed(&rec).expect("completed early").body_omitted);
    app.gate.notify_one();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body.as_ref(), pattern(5000).as_slice());
    let dup = send(addr, post_json("/big-stream", Some("stream-big"), "{}")).await;
    assert_eq!(dup.status, StatusCode::GONE);
    assert_eq!(app.calls(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_mode_returns_the_replay() {
    let (addr, app) =
        serve(IdempotencyLayer::new(MemoryStore::new()).with_wait(Duration::from_secs(5))).await;
    let first = start_gated(addr, &app, "wait").await;
    let dup =
        tokio::spawn(async move { send(addr, post_json("/gated", Some("wait"), "{}")).await });
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert!(!dup.is_finished(), "the duplicate waits for the original");
    app.gate.notify_one();
    let first = first.await.unwrap();
    let dup = dup.await.unwrap();
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(!first.replayed());
    assert_replay(&dup, StatusCode::CREATED, &first);
    assert_eq!(app.calls(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_mode_gives_409_when_the_bound_passes() {
    let (addr, app) =
        serve(IdempotencyLayer::new(MemoryStore::new()).with_wait(Duration::from_millis(200)))
            .await;
    let first = start_gated(addr, &app, "w409").await;
    let started = std::time::Instant::now();
    let dup = send(addr, post_json("/gated", Some("w409"), "{}")).await;
    assert!(started.elapsed() >= Duration::from_millis(190));
    assert_eq!(dup.status, StatusCode::CONFLICT);
    assert!(dup.headers.contains_key("retry-after"));
    app.gate.notify_one();
    assert_eq!(first.await.unwrap().status, StatusCode::CREATED);
    assert_eq!(app.calls(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_flight_is_409_with_retry_after_rounded_up() {
    let (clock, _store, addr, app) = serve_on_clock(Duration::from_millis(2500)).await;
    let first = start_gated(addr, &app, "a2").await;
    let dup = send(addr, post_json("/gated", Some("a2"), "{}")).await;
    assert_eq!(dup.status, StatusCode::CONFLICT);
    assert_eq!(dup.problem(), "urn:idem:problem:in-flight");
    assert_eq!(dup.header("retry-after"), "3", "2.5 s left → 3");
    clock.advance(Duration::from_millis(1700));
    let dup = send(addr, post_json("/gated", Some("a2"), "{}")).await;
    assert_eq!(dup.header("retry-after"), "1", "0.8 s left → 1");
    app.gate.notify_one();
    let first = first.await.unwrap();
    assert_eq!(first.status, StatusCode::CREATED);
    let again = send(addr, post_json("/gated", Some("a2"), "{}")).await;
    assert!(again.replayed());
    assert_eq!(app.calls(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_disconnects_does_not_cancel_the_run_d2() {
    let (store, addr, app) = serve_on_memory(|l| l).await;
    let body = r#"{"amount":5}"#;
    let raw = format!(
        "POST /orders HTTP/1.1\r\nHost: idem.test\r\nIdempotency-Key: d2\r\n\
         Content-Type: application/json\r\nX-Delay-Ms: 400\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let mut sock = TcpStream::connect(addr).await.unwrap();
    sock.write_all(raw.as_bytes()).await.unwrap();
    eventually("the handler to start", || {
        let n = app.calls();
        async move { n == 1 }
    })
    .await;
    drop(sock); // the client goes away mid-request
    eventually("the result to be stored", || {
        let f = anon_key(&store, "d2");
        async move { completed(&f.await).is_some() }
    })
    .await;
    assert_eq!(app.finished.load(Ordering::SeqCst), 1);
    let retry = send(addr, post_json("/orders", Some("d2"), body)).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(retry.replayed());
    assert_eq!(retry.json()["order"], 1);
    assert_eq!(app.calls(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_service_future_does_not_cancel_the_run() {
    use tower::ServiceExt;
    let (store, app, svc) = in_process();
    let req = slow_order("dropped", "300");
    // The future is dropped after 50 ms, mid-handler.
    let cut = tokio::time::timeout(Duration::from_millis(50), svc.clone().oneshot(req)).await;
    assert!(cut.is_err());
    eventually("the result to be stored", || {
        let f = anon_key(&store, "dropped");
        async move { completed(&f.await).is_some() }
    })
    .await;
    assert_eq!(app.calls(), 1);
    assert_eq!(app.finished.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tracker_waits_for_runs_whose_callers_left() {
    use tower::ServiceExt;
    let store = MemoryStore::new();
    let app = App::default();
    let tracker = idem_http::TaskTracker::new();
    let layer = IdempotencyLayer::new(store.clone()).with_tracker(tracker.clone());
    assert!(layer.tracker().is_empty());
    let svc = router(app.clone()).layer(layer);
    let req = slow_order("tracked", "400");
    // The caller leaves after 50 ms, mid-handler; the run goes on, tracked.
    let cut = tokio::time::timeout(Duration::from_millis(50), svc.oneshot(req)).await;
    assert!(cut.is_err());
    assert_eq!(tracker.len(), 1, "the run is tracked");
    assert!(completed(&anon_key(&store, "tracked").await).is_none());
    tracker.close();
    tokio::time::timeout(Duration::from_secs(5), tracker.wait())
        .await
        .expect("the run finished");
    // Once the tracker is done, the result is stored: no polling needed.
    let rec = anon_key(&store, "tracked").await;
    assert_eq!(completed(&rec).expect("stored").status, 201);
    assert_eq!(app.finished.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn get_passes_through_untouched() {
    let (store, addr, app) = serve_on_memory(|l| l).await;
    for n in 1..=2 {
        let r = send(addr, keyed(Method::GET, "/orders", "same", b"")).await;
        assert_eq!(r.status, StatusCode::OK);
        assert!(!r.replayed());
        assert_eq!(r.body, format!("read {n}"));
    }
    // Even a malformed key is not looked at on an unguarded method.
    let req = keyed(Method::GET, "/orders", "\"broken", b"");
    assert_eq!(send(addr, req).await.status, StatusCode::OK);
    assert_eq!(app.calls(), 3);
    assert!(store.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guarded_methods_are_configurable() {
    let (_store, addr, app) =
        serve_on_memory(|l| l.with_methods(vec![Method::POST, Method::PUT])).await;
    let put_req = || keyed(Method::PUT, "/upload", "put-1", b"abc");
    let a = send(addr, put_req()).await;
    let b = send(addr, put_req()).await;
    assert!(!a.replayed() && b.replayed());
    assert_eq!(app.calls(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disposition_overrides_the_policy() {
    let (clock, _store, addr, app) = serve_on_clock(Duration::from_secs(5)).await;
    // A 502 marked Hold: the key stays in flight until its lease ends.
    let first = send(addr, post_json("/hold", Some("hold"), "{}")).await;
    assert_eq!(first.status, StatusCode::BAD_GATEWAY);
    let dup = send(addr, post_json("/hold", Some("hold"), "{}")).await;
    assert_eq!(dup.status, StatusCode::CONFLICT);
    assert_eq!(app.calls(), 1);
    clock.advance(Duration::from_millis(5001));
    let after = send(addr, post_json("/hold", Some("hold"), "{}")).await;
    assert_eq!(after.status, StatusCode::BAD_GATEWAY);
    assert_eq!(app.calls(), 2, "the key freed itself when the lease ended");

    // A 200 marked Release is not kept (past its shared window, which the
    // standing clock would otherwise keep).
    let a = send(addr, post_json("/release", Some("rel"), "{}")).await;
    clock.advance(Duration::from_millis(1001));
    let b = send(addr, post_json("/release", Some("rel"), "{}")).await;
    assert!(!a.replayed() && !b.replayed());
    assert_eq!(app.calls(), 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_fails_while_buffered_is_a_502_and_holds_the_key_b3() {
    let (clock, store, addr, app) = serve_on_clock(Duration::from_secs(5)).await;
    // The body fails within the retention limit, while the layer still
    // buffers it: nothing was sent yet, so the first caller gets a complete
    // 502 problem instead of a 200 with a truncated body.
    let first = send(addr, post_json("/broken-stream", Some("b3"), "{}")).await;
    assert_eq!(first.status, StatusCode::BAD_GATEWAY, "{first:?}");
    assert_eq!(first.problem(), "urn:idem:problem:upstream-failed");
    let detail = first.json()["detail"].as_str().unwrap().to_owned();
    assert!(
        detail.contains("unknown") && detail.contains("lease"),
        "{detail}"
    );
    assert!(!first.replayed());
    assert!(
        !first.body.starts_with(b"partial"),
        "the partial body leaked"
    );
    let rec = anon_key(&store, "b3").await;
    assert!(
        matches!(
            rec,
            Some(Record {
                state: RecordState::InProgress { .. },
                ..
            })
        ),
        "held: {rec:?}"
    );
    let dup = send(addr, post_json("/broken-stream", Some("b3"), "{}")).await;
    assert_eq!(dup.status, StatusCode::CONFLICT, "outcome unknown: held");
    assert_eq!(app.calls(), 1);
    clock.advance(Duration::from_millis(5001));
    let _ = try_send(addr, post_json("/broken-stream", Some("b3"), "{}")).await;
    assert_eq!(app.calls(), 2, "never stuck past the lease");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_fails_past_the_retention_limit_is_truncated_and_completed() {
    // Past the limit the layer has already completed the key (without the
    // body) and streams on: a later failure can only cut the stream short.
    let (store, addr, app) = serve_on_memory(|l| l.with_retention_limit(1024)).await;
    let first = try_send(addr, post_json("/broken-big-stream", Some("b3-big"), "{}")).await;
    assert!(first.is_err(), "the failure reaches the client: {first:?}");
    let rec = anon_key(&store, "b3-big").await;
    let stored = completed(&rec).expect("completed before streaming on");
    assert!(stored.body_omitted);
    let dup = send(addr, post_json("/broken-big-stream", Some("b3-big"), "{}")).await;
    assert_eq!(dup.status, StatusCode::GONE);
    assert_eq!(app.calls(), 1, "never a second execution");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_handler_is_500_and_frees_the_key_at_lease_end() {
    let (clock, _store, addr, app) = serve_on_clock(Duration::from_secs(5)).await;
    let r = send(addr, post_json("/panic", Some("p"), "{}")).await;
    assert_eq!(r.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(r.problem(), "urn:idem:problem:internal");
    let dup = send(addr, post_json("/panic", Some("p"), "{}")).await;
    assert_eq!(dup.status, StatusCode::CONFLICT);
    clock.advance(Duration::from_millis(5001));
    let again = send(addr, post_json("/panic", Some("p"), "{}")).await;
    assert_eq!(again.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(app.calls(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_body_that_fails_is_400_and_leaves_the_key_untouched() {
    use tower::ServiceExt;
    let (store, app, svc) = in_process();
    let frames: Vec<Result<Frame<Bytes>, std::io::Error>> = vec![
        Ok(Frame::data(Bytes::from_static(b"{\"amount\":"))),
        Err(std::io::Error::new(
            std::io::ErrorKind::ConnectionReset,
            "client reset",
        )),
    ];
    let req = Request::builder()
        .method(Method::POST)
        .uri("/orders")
        .header("idempotency-key", "unreadable")
        .body(StreamBody::new(futures::stream::iter(frames)))
        .unwrap();
    let resp = svc.clone().oneshot(req).await.unwrap();
    assert_eq!(resp.status(), StatusCode::BAD_REQUEST);
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["type"], "urn:idem:problem:body-unreadable");
    assert_eq!(app.calls(), 0);
    assert!(store.is_empty(), "the key is untouched");
}

// ---------------------------------------------------------------- store failures

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_errors_fail_closed() {
    let store = FaultyStore::new(MemoryStore::new());
    let (addr, app) = serve(IdempotencyLayer::new(store.clone())).await;
    for (fault, status, kind) in [
        (Fault::Unavailable, 503, "store-unavailable"),
        (Fault::Full("cap"), 503, "store-full"),
        (Fault::Corrupt("bad bytes"), 500, "corrupt-record"),
    ] {
        store.set(Op::Begin, fault);
        let r = send(addr, post_json("/orders", Some("outage"), "{}")).await;
        assert_eq!(r.status.as_u16(), status, "{fault:?}");
        assert_eq!(r.problem(), format!("urn:idem:problem:{kind}"));
    }
    assert_eq!(
        app.calls(),
        0,
        "the handler is not called when the store fails"
    );

    // Saving fails after the run: the first caller still gets the real
    // response, and the key is held (no second run while the outcome is unknown).
    store.clear_all();
    store.set(Op::Complete, Fault::Timeout);
    let r = send(addr, post_json("/orders", Some("save-fails"), "{}")).await;
    assert_eq!(r.status, StatusCode::CREATED);
    assert!(!r.replayed());
    store.clear_all();
    let dup = send(addr, post_json("/orders", Some("save-fails"), "{}")).await;
    assert_eq!(dup.status, StatusCode::CONFLICT);
    assert_eq!(app.calls(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_inner_error_releases_the_key() {
    use tower::{service_fn, Layer, ServiceExt};
    let store = MemoryStore::new();
    let calls = Arc::new(AtomicUsize::new(0));
    let c = calls.clone();
    let inner = service_fn(move |_req: Request<idem_http::BoxBody>| {
        let c = c.clone();
        async move {
            if c.fetch_add(1, Ordering::SeqCst) == 0 {
                Err(std::io::Error::other("connection reset"))
            } else {
                Ok(http::Response::new(Full::new(Bytes::from_static(b"ok"))))
            }
        }
    });
    let svc = IdempotencyLayer::new(store.clone()).layer(inner);
    let req = || {
        Request::builder()
            .method(Method::POST)
            .uri("/x")
            .header("idempotency-key", "err")
            .body(Full::new(Bytes::from_static(b"{}")))
            .unwrap()
    };
    let err = svc.clone().oneshot(req()).await;
    assert!(err.is_err());
    assert!(anon_key(&store, "err").await.is_none(), "released");
    let ok = svc.clone().oneshot(req()).await.unwrap();
    assert_eq!(ok.status(), StatusCode::OK);
    let again = svc.oneshot(req()).await.unwrap();
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}
