//! The layer's own limits on guarded request bodies, in process: the
//! shared budget of buffered bytes (`max_buffered`) for bodies without a
//! declared length, and the total body deadline (`body_timeout`).

use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body::Frame;
use http_body_util::{BodyExt, Full};
use idem_http::{BoxBody, IdempotencyLayer};
use tokio::sync::mpsc;
use tower::{Layer, Service, ServiceExt};

/// A chunked body fed through a channel (no declared length).
struct Chunks(mpsc::Receiver<Bytes>);

impl http_body::Body for Chunks {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.0.poll_recv(cx).map(|c| c.map(|b| Ok(Frame::data(b))))
    }
}

fn inner() -> impl Service<
    Request<BoxBody>,
    Response = Response<Full<Bytes>>,
    Error = Infallible,
    Future = impl Send,
> + Clone
       + Send
       + 'static {
    tower::service_fn(|req: Request<BoxBody>| async move {
        let n = req
            .into_body()
            .collect()
            .await
            .map_or(0, |b| b.to_bytes().len());
        let mut r = Response::new(Full::new(Bytes::from(n.to_string())));
        *r.status_mut() = StatusCode::CREATED;
        Ok::<_, Infallible>(r)
    })
}

fn post(key: &str, body: Chunks) -> Request<Chunks> {
    Request::post("/pay")
        .header("idempotency-key", key)
        .body(body)
        .unwrap()
}

async fn problem_type(resp: Response<BoxBody>) -> String {
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    v["type"].as_str().unwrap_or_default().to_owned()
}

#[tokio::test]
async fn chunked_bodies_share_the_budget_and_give_it_back() {
    let layer = IdempotencyLayer::new(idem_core::MemoryStore::new())
        .with_max_body(1000)
        .with_max_buffered(100);
    let (tx_a, rx_a) = mpsc::channel(4);
    tx_a.send(Bytes::from(vec![b'a'; 60])).await.unwrap();
    let a = tokio::spawn(layer.layer(inner()).oneshot(post("a", Chunks(rx_a))));
    tokio::time::sleep(Duration::from_millis(50)).await;

    // B's first chunk fits (30 of the 40 left), its second does not.
    let (tx_b, rx_b) = mpsc::channel(4);
    tx_b.send(Bytes::from(vec![b'b'; 30])).await.unwrap();
    tx_b.send(Bytes::from(vec![b'b'; 30])).await.unwrap();
    let b = layer
        .layer(inner())
        .oneshot(post("b", Chunks(rx_b)))
        .await
        .unwrap();
    assert_eq!(b.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(b.headers().contains_key(http::header::RETRY_AFTER));
    assert_eq!(problem_type(b).await, "urn:idem:problem:overloaded");

    // A finishes; its 60 bytes go back once the inner service is done.
    drop(tx_a);
    let a = a.await.unwrap().unwrap();
    assert_eq!(a.status(), StatusCode::CREATED);
    let (tx_c, rx_c) = mpsc::channel(4);
    tx_c.send(Bytes::from(vec![b'c'; 100])).await.unwrap();
    drop(tx_c);
    let c = layer
        .layer(inner())
        .oneshot(post("b", Chunks(rx_c)))
        .await
        .unwrap();
    assert_eq!(
        c.status(),
        StatusCode::CREATED,
        "the whole budget is free again"
    );
}

#[tokio::test]
async fn a_body_that_never_ends_gets_408_within_body_timeout() {
    let layer = IdempotencyLayer::new(idem_core::MemoryStore::new())
        .with_body_timeout(Duration::from_millis(200))
        .with_max_buffered(100)
        .with_max_body(100);
    let (tx, rx) = mpsc::channel(4);
    tx.send(Bytes::from_static(b"{")).await.unwrap();
    let resp = tokio::time::timeout(
        Duration::from_secs(5),
        layer.layer(inner()).oneshot(post("slow", Chunks(rx))),
    )
    .await
    .expect("answered")
    .unwrap();
    assert_eq!(resp.status(), StatusCode::REQUEST_TIMEOUT);
    assert_eq!(problem_type(resp).await, "urn:idem:problem:body-timeout");
    drop(tx);
    // The key was not touched and the budget is free: the same key runs.
    let (tx, rx) = mpsc::channel(4);
    tx.send(Bytes::from(vec![b'x'; 100])).await.unwrap();
    drop(tx);
    let resp = layer
        .layer(inner())
        .oneshot(post("slow", Chunks(rx)))
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::CREATED);
}
