//! idem-client against the real gateway (in-process `idem_gateway::Gateway`,
//! memory store) in front of a real upstream (axum) that counts executions,
//! all on 127.0.0.1 with ephemeral ports. The client is hyper-util's
//! pooled client wrapped in [`IdempotentLayer`].
//!
//! The lost response is made by a TCP proxy between the client and the
//! gateway that, on its first connection, forwards the request and closes
//! both sockets as soon as the gateway's response starts, without passing
//! a byte of it on.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{self, any};
use axum::Router;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use idem_client::{
    Attempts, Error, Failure, IdempotencyKey, IdempotentLayer, IdempotentService, Replayed,
    RetryPolicy,
};
use idem_gateway::{Gateway, GatewayConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tower::{Layer, ServiceExt};

// ---------------------------------------------------------------- upstream

#[derive(Clone, Default)]
struct Counts {
    hits: Arc<AtomicUsize>,
    /// The `Idempotency-Key` of every execution, in order.
    keys: Arc<Mutex<Vec<String>>>,
}

impl Counts {
    fn hit(&self, headers: &HeaderMap) -> usize {
        let key = headers
            .get("idempotency-key")
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
            .unwrap_or_default();
        self.keys.lock().unwrap().push(key);
        self.hits.fetch_add(1, Ordering::SeqCst) + 1
    }
    fn hits(&self) -> usize {
        self.hits.load(Ordering::SeqCst)
    }
    fn keys(&self) -> Vec<String> {
        self.keys.lock().unwrap().clone()
    }
}

#[derive(serde::Deserialize)]
struct Q {
    /// Sleep this long before answering.
    ms: Option<u64>,
    /// Sleep only in the first execution.
    first_only: Option<bool>,
    /// Send `Retry-After` with this value.
    retry_after: Option<String>,
}

async fn answer(counts: &Counts, headers: &HeaderMap, q: &Q, status: StatusCode) -> Response {
    let n = counts.hit(headers);
    if let Some(ms) = q.ms {
        if n == 1 || !q.first_only.unwrap_or(false) {
            tokio::time::sleep(Duration::from_millis(ms)).await;
        }
    }
    let mut r = (
        status,
        [("content-type", "application/json")],
        format!("{{\"execution\":{n}}}"),
    )
        .into_response();
    if let Some(v) = &q.retry_after {
        r.headers_mut().insert("retry-after", v.parse().unwrap());
    }
    r
}

struct Upstream {
    addr: SocketAddr,
    counts: Counts,
    task: JoinHandle<()>,
}

impl Drop for Upstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// `POST /orders` → 201 `{"execution":n}`; `/status/{code}` → that status;
/// both take `?ms=`, `?first_only=true` and `?retry_after=`.
async fn upstream() -> Upstream {
    let counts = Counts::default();
    let app = Router::new()
        .route(
            "/orders",
            routing::post(
                |State(c): State<Counts>, Query(q): Query<Q>, h: HeaderMap| async move {
                    answer(&c, &h, &q, StatusCode::CREATED).await
                },
            ),
        )
        .route(
            "/status/{code}",
            any(
                |State(c): State<Counts>,
                 Path(code): Path<u16>,
                 Query(q): Query<Q>,
                 h: HeaderMap| async move {
                    answer(&c, &h, &q, StatusCode::from_u16(code).unwrap()).await
                },
            ),
        )
        .with_state(counts.clone());
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    Upstream { addr, counts, task }
}

// ----------------------------------------------------------------- gateway

struct TestGateway {
    addr: SocketAddr,
    shutdown: Option<oneshot::Sender<()>>,
}

impl Drop for TestGateway {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
    }
}

/// The real gateway in front of `up`: memory store, a 5 s lease (so its
/// 409 says `Retry-After: 5` or less), no admin listener.
async fn gateway(up: &Upstream) -> TestGateway {
    gateway_on(up, "127.0.0.1:0".parse().unwrap()).await
}

/// Like [`gateway`], listening on `listen`.
async fn gateway_on(up: &Upstream, listen: SocketAddr) -> TestGateway {
    let mut c = GatewayConfig::new(format!("http://{}", up.addr).parse().unwrap());
    c.listen = listen;
    c.store = "memory://".into();
    c.admin_listen = idem_gateway::AdminListen::Off;
    c.layer.lease = Duration::from_secs(5);
    // The lease must be longer than the store timeout (5 s by default).
    c.store_options.timeout = Duration::from_secs(2);
    // These tests retry a released 5xx at once and time it; with the
    // default `--share-failure` window (1 s) each such retry first waits
    // the window out in the gateway (it did not wait for the failed run).
    c.layer.share_failure = Duration::ZERO;
    let gw = Gateway::bind_with_store(c, Arc::new(idem_core::MemoryStore::new()))
        .await
        .unwrap();
    let addr = gw.local_addr();
    let (tx, rx) = oneshot::channel::<()>();
    tokio::spawn(gw.serve(async move {
        let _ = rx.await;
    }));
    TestGateway {
        addr,
        shutdown: Some(tx),
    }
}

// ---------------------------------------------------------- cutting proxy

/// Where [`cut_proxy`] cuts a connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Cut {
    /// When the first byte of the answer arrives; none of it is passed on.
    BeforeAnswer,
    /// After the answer's head and the first byte of its body are passed on.
    InBody,
}

/// A TCP proxy to `target` whose first `cuts` connections lose the
/// response at `at`: the request is forwarded, then both sockets are closed.
struct CutProxy {
    addr: SocketAddr,
    cut: Arc<AtomicUsize>,
    task: JoinHandle<()>,
}

impl Drop for CutProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn cut_proxy(target: SocketAddr, cuts: usize, at: Cut) -> CutProxy {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let cut = Arc::new(AtomicUsize::new(0));
    let left = Arc::new(AtomicUsize::new(cuts));
    let cut2 = cut.clone();
    let task = tokio::spawn(async move {
        loop {
            let Ok((mut client, _)) = listener.accept().await else {
                return;
            };
            let (cut, left) = (cut2.clone(), left.clone());
            tokio::spawn(async move {
                let Ok(mut server) = TcpStream::connect(target).await else {
                    return;
                };
                let cut_this = left
                    .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                    .is_ok();
                if !cut_this {
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                    return;
                }
                let (mut cr, mut cw) = client.split();
                let (mut sr, mut sw) = server.split();
                let mut buf = [0u8; 8192];
                let mut answer = Vec::new();
                let mut chunk = [0u8; 8192];
                loop {
                    tokio::select! {
                        n = cr.read(&mut buf) => match n {
                            Ok(0) | Err(_) => return,
                            Ok(n) => if sw.write_all(&buf[..n]).await.is_err() { return },
                        },
                        n = sr.read(&mut chunk) => {
                            let Ok(n @ 1..) = n else { return };
                            answer.extend_from_slice(&chunk[..n]);
                            let head_end = answer.windows(4).position(|w| w == b"\r\n\r\n");
                            match (at, head_end) {
                                (Cut::BeforeAnswer, _) => {}
                                (Cut::InBody, Some(end)) if answer.len() > end + 4 => {
                                    let _ = cw.write_all(&answer[..end + 5]).await;
                                    let _ = cw.flush().await;
                                }
                                (Cut::InBody, _) => continue,
                            }
                            cut.fetch_add(1, Ordering::SeqCst);
                            return;
                        }
                    }
                }
            });
        }
    });
    CutProxy { addr, cut, task }
}

// ------------------------------------------------------------------ client

type Http = Client<HttpConnector, Full<Bytes>>;

fn client(policy: RetryPolicy) -> IdempotentService<Http> {
    let http = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    IdempotentLayer::new().with_policy(policy).layer(http)
}

/// Fast, bounded retries for tests.
fn policy() -> RetryPolicy {
    RetryPolicy::default()
        .with_base_delay(Duration::from_millis(10))
        .with_max_delay(Duration::from_millis(100))
        .with_max_retry_after(Duration::from_secs(1))
        .with_attempt_timeout(Duration::from_secs(2))
        .with_deadline(Duration::from_secs(5))
}

fn post(addr: SocketAddr, path: &str, body: &'static str) -> http::Request<Full<Bytes>> {
    http::Request::post(format!("http://{addr}{path}"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(body.as_bytes())))
        .unwrap()
}

fn with_key(mut req: http::Request<Full<Bytes>>, key: &str) -> http::Request<Full<Bytes>> {
    req.extensions_mut()
        .insert(IdempotencyKey::new(key).unwrap());
    req
}

async fn send(c: &IdempotentService<Http>, req: http::Request<Full<Bytes>>) -> Result<Got, Error> {
    let r = c.clone().oneshot(req).await?;
    let replayed = r.extensions().get::<Replayed>().copied();
    let attempts = r.extensions().get::<Attempts>().copied();
    let key = r.extensions().get::<IdempotencyKey>().cloned();
    let status = r.status();
    let replayed_header = r.headers().get("idempotent-replayed").cloned();
    let body = r.into_body().collect().await.unwrap().to_bytes();
    Ok(Got {
        status,
        replayed: replayed.expect("the Replayed extension").0,
        attempts: attempts.expect("the Attempts extension").0,
        key,
        replayed_header,
        body: String::from_utf8_lossy(&body).into_owned(),
    })
}

#[derive(Debug)]
struct Got {
    status: StatusCode,
    replayed: bool,
    attempts: u32,
    key: Option<IdempotencyKey>,
    replayed_header: Option<http::HeaderValue>,
    body: String,
}

// ------------------------------------------------------------------- tests

#[tokio::test]
async fn a_lost_response_is_recovered_by_the_replay_with_one_execution() {
    let up = upstream().await;
    let gw = gateway(&up).await;
    let proxy = cut_proxy(gw.addr, 1, Cut::BeforeAnswer).await;
    let c = client(policy());

    let got = send(&c, post(proxy.addr, "/orders", r#"{"sku":"A-1"}"#))
        .await
        .unwrap();

    assert_eq!(
        proxy.cut.load(Ordering::SeqCst),
        1,
        "the first answer was lost"
    );
    assert_eq!(got.status, StatusCode::CREATED, "{got:?}");
    assert_eq!(got.body, r#"{"execution":1}"#, "the original's answer");
    assert_eq!(got.attempts, 2, "{got:?}");
    assert!(got.replayed, "the retry got the stored answer: {got:?}");
    assert_eq!(got.replayed_header.as_ref().unwrap(), "true");
    assert_eq!(up.counts.hits(), 1, "the upstream ran once");
    // The key the client generated reached the upstream, and is reported.
    let key = got.key.expect("the key extension");
    assert_eq!(up.counts.keys(), [key.as_str().to_owned()]);
    assert_eq!(key.as_str().len(), 36, "a UUID: {key}");

    // A second logical request gets a fresh key and runs.
    let got = send(&c, post(proxy.addr, "/orders", r#"{"sku":"A-1"}"#))
        .await
        .unwrap();
    assert_eq!((got.attempts, got.replayed), (1, false));
    assert_eq!(got.body, r#"{"execution":2}"#);
    let keys = up.counts.keys();
    assert_ne!(keys[0], keys[1], "one key per logical request");
}

#[tokio::test]
async fn a_first_attempt_slower_than_its_timeout_waits_out_the_409_and_gets_the_replay() {
    let up = upstream().await;
    let gw = gateway(&up).await;
    // The first execution takes 900 ms; an attempt may take 250 ms.
    let c = client(
        policy()
            .with_attempt_timeout(Duration::from_millis(250))
            .with_max_attempts(4),
    );
    let start = Instant::now();
    let got = send(&c, post(gw.addr, "/orders?ms=900&first_only=true", "{}"))
        .await
        .unwrap();
    let took = start.elapsed();

    // 1: timed out; 2: 409 in flight, Retry-After 5 s bounded to 1 s; 3: the replay.
    assert_eq!(got.status, StatusCode::CREATED, "{got:?}");
    assert_eq!(got.body, r#"{"execution":1}"#);
    assert!(got.replayed, "{got:?}");
    assert_eq!(got.attempts, 3, "{got:?}");
    assert_eq!(up.counts.hits(), 1, "the upstream ran once");
    assert!(
        took >= Duration::from_millis(1200),
        "waited the bounded Retry-After: {took:?}"
    );
    assert!(took < Duration::from_secs(3), "{took:?}");
}

#[tokio::test]
async fn a_409_with_retry_after_is_waited_for_then_the_replay_succeeds() {
    let up = upstream().await;
    let gw = gateway(&up).await;
    // Another copy of the request (same key) is running for 800 ms.
    let first = {
        let other = client(policy());
        let req = with_key(post(gw.addr, "/orders?ms=800", "{}"), "pay-order-9");
        tokio::spawn(async move { send(&other, req).await })
    };
    tokio::time::sleep(Duration::from_millis(150)).await;
    // Two attempts, a 1 ms backoff: only waiting for Retry-After (bounded to
    // 1 s) lets the second attempt come after the original finished.
    let c = client(
        policy()
            .with_max_attempts(2)
            .with_base_delay(Duration::from_millis(1))
            .with_max_delay(Duration::from_millis(1)),
    );
    let start = Instant::now();
    let got = send(
        &c,
        with_key(post(gw.addr, "/orders?ms=800", "{}"), "pay-order-9"),
    )
    .await
    .unwrap();
    let took = start.elapsed();
    assert_eq!(got.status, StatusCode::CREATED, "{got:?}");
    assert!(got.replayed, "{got:?}");
    assert_eq!(got.attempts, 2);
    assert_eq!(got.key.unwrap().as_str(), "pay-order-9");
    assert!(took >= Duration::from_millis(1000), "{took:?}");
    let first = first.await.unwrap().unwrap();
    assert_eq!((first.attempts, first.replayed), (1, false));
    assert_eq!(first.body, got.body);
    assert_eq!(up.counts.hits(), 1);
}

#[tokio::test]
async fn a_key_reused_with_another_request_gets_422_once_and_400_is_not_retried() {
    let up = upstream().await;
    let gw = gateway(&up).await;
    let c = client(policy());
    let got = send(
        &c,
        with_key(post(gw.addr, "/orders", r#"{"qty":1}"#), "k-422"),
    )
    .await
    .unwrap();
    assert_eq!(got.status, StatusCode::CREATED);

    let got = send(
        &c,
        with_key(post(gw.addr, "/orders", r#"{"qty":2}"#), "k-422"),
    )
    .await
    .unwrap();
    assert_eq!(got.status, StatusCode::UNPROCESSABLE_ENTITY, "{got:?}");
    assert!(
        got.body.contains("urn:idem:problem:key-mismatch"),
        "{}",
        got.body
    );
    assert_eq!(
        (got.attempts, got.replayed),
        (1, false),
        "returned as it is"
    );

    // An ambiguous path: the gateway's 400, not retried.
    let got = send(&c, post(gw.addr, "/orders%2Fx", "{}")).await.unwrap();
    assert_eq!(got.status, StatusCode::BAD_REQUEST, "{got:?}");
    assert_eq!(got.attempts, 1);
    assert_eq!(up.counts.hits(), 1);
}

#[tokio::test]
async fn a_5xx_is_retried_with_the_same_key_until_the_attempts_run_out() {
    let up = upstream().await;
    let gw = gateway(&up).await;
    let c = client(policy().with_max_attempts(3));
    let err = send(&c, post(gw.addr, "/status/503", "{}"))
        .await
        .unwrap_err();
    match &err {
        Error::AttemptsExhausted {
            attempts: 3,
            key: Some(_),
            last: Failure::Status { status, .. },
        } => assert_eq!(*status, StatusCode::SERVICE_UNAVAILABLE),
        other => panic!("{other:?}"),
    }
    assert_eq!(err.last_status(), Some(StatusCode::SERVICE_UNAVAILABLE));
    assert!(err.to_string().contains("3 attempt(s)"), "{err}");
    // The gateway released each 5xx, so each retry ran, with the one key.
    let keys = up.counts.keys();
    assert_eq!(keys.len(), 3);
    assert!(keys.iter().all(|k| *k == keys[0]), "{keys:?}");
    assert_eq!(err.key().unwrap().as_str(), keys[0]);

    // A GET is not keyed: sent once, and its 503 is the answer.
    let req = http::Request::get(format!("http://{}/status/503", gw.addr))
        .body(Full::new(Bytes::new()))
        .unwrap();
    let got = send(&c, req).await.unwrap();
    assert_eq!((got.status.as_u16(), got.attempts), (503, 1));
    assert_eq!(up.counts.keys().last().unwrap(), "", "no key on a GET");
}

#[tokio::test]
async fn the_deadline_caps_the_total_time() {
    let up = upstream().await;
    let gw = gateway(&up).await;
    let deadline = Duration::from_millis(800);

    // Always 500 (released by the gateway): retried until the deadline.
    let c = client(
        policy()
            .with_max_attempts(1000)
            .with_base_delay(Duration::from_millis(50))
            .with_deadline(deadline),
    );
    let start = Instant::now();
    let err = send(&c, post(gw.addr, "/status/500", "{}"))
        .await
        .unwrap_err();
    let took = start.elapsed();
    assert!(matches!(err, Error::DeadlineExceeded { .. }), "{err:?}");
    assert!(err.attempts() >= 3, "{err:?}");
    assert_eq!(err.last_status(), Some(StatusCode::INTERNAL_SERVER_ERROR));
    assert!(took <= deadline + Duration::from_millis(300), "{took:?}");

    // One slow attempt is cut at the deadline.
    let start = Instant::now();
    let err = send(&c, post(gw.addr, "/orders?ms=3000", "{}"))
        .await
        .unwrap_err();
    let took = start.elapsed();
    assert!(
        matches!(
            err,
            Error::DeadlineExceeded {
                attempts: 1,
                last: Some(Failure::Timeout(_)),
                ..
            }
        ),
        "{err:?}"
    );
    assert!(
        took >= deadline && took <= deadline + Duration::from_millis(300),
        "{took:?}"
    );

    // A Retry-After that ends after the deadline is not waited for.
    let start = Instant::now();
    let err = send(&c, post(gw.addr, "/status/503?retry_after=30", "{}"))
        .await
        .unwrap_err();
    assert!(start.elapsed() < Duration::from_millis(500), "{err:?}");
    match err {
        Error::DeadlineExceeded {
            attempts: 1,
            last:
                Some(Failure::Status {
                    status,
                    retry_after,
                }),
            ..
        } => {
            assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
            assert_eq!(retry_after, Some(Duration::from_secs(30)));
        }
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn a_refused_connection_is_retried_until_the_gateway_listens() {
    let up = upstream().await;
    // A free port, closed again: connections to it are refused until the
    // gateway binds it 300 ms later.
    let addr = TcpListener::bind("127.0.0.1:0")
        .await
        .unwrap()
        .local_addr()
        .unwrap();
    let c = client(policy().with_max_attempts(100));
    let call = tokio::spawn({
        let c = c.clone();
        async move { send(&c, post(addr, "/orders", "{}")).await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!call.is_finished(), "still retrying");
    let _gw = gateway_on(&up, addr).await;
    let got = call.await.unwrap().unwrap();
    assert_eq!(got.status, StatusCode::CREATED, "{got:?}");
    assert!(got.attempts > 1, "{got:?}");
    assert!(!got.replayed);
    assert_eq!(up.counts.hits(), 1);
}

#[tokio::test]
async fn a_quoted_key_and_the_bare_key_are_one_key_to_the_gateway() {
    let up = upstream().await;
    let gw = gateway(&up).await;
    let quoted = IdempotentLayer::new()
        .with_quoted_key(true)
        .with_policy(policy())
        .layer(Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>());
    let first = send(
        &quoted,
        with_key(post(gw.addr, "/orders", "{}"), "order-77"),
    )
    .await
    .unwrap();
    assert_eq!((first.status, first.replayed), (StatusCode::CREATED, false));
    // The gateway forwards the bare key.
    assert_eq!(up.counts.keys(), ["order-77"]);
    let bare = client(policy());
    let again = send(&bare, with_key(post(gw.addr, "/orders", "{}"), "order-77"))
        .await
        .unwrap();
    assert!(again.replayed, "{again:?}");
    assert_eq!(again.body, first.body);
    assert_eq!(up.counts.hits(), 1);
}

#[tokio::test]
async fn a_body_cut_after_the_head_is_the_callers_and_the_key_gets_the_replay() {
    let up = upstream().await;
    let gw = gateway(&up).await;
    let proxy = cut_proxy(gw.addr, 1, Cut::InBody).await;
    let c = client(policy());

    // The head arrived (201), so the layer returns it; its body breaks.
    let r = c
        .clone()
        .oneshot(post(proxy.addr, "/orders", r#"{"sku":"B-2"}"#))
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::CREATED);
    assert_eq!(r.extensions().get::<Attempts>(), Some(&Attempts(1)));
    let key = r.extensions().get::<IdempotencyKey>().cloned().unwrap();
    let body = r.into_body().collect().await;
    assert!(body.is_err(), "the body was cut: {body:?}");
    assert_eq!(proxy.cut.load(Ordering::SeqCst), 1);

    // Sent again with the response's key: the stored answer, whole.
    let got = send(
        &c,
        with_key(
            post(proxy.addr, "/orders", r#"{"sku":"B-2"}"#),
            key.as_str(),
        ),
    )
    .await
    .unwrap();
    assert!(got.replayed, "{got:?}");
    assert_eq!(got.body, r#"{"execution":1}"#);
    assert_eq!(up.counts.hits(), 1);
}
