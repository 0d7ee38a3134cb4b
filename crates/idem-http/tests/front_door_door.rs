//! The front door in the library (issue 11, items 1, 2, 7 and 9): what the
//! layer does for its users without the gateway. A case variant of a
//! guarded method is refused, every path decision and the inner service
//! see the normalised path, an ambiguous path is refused, a 1xx answer is
//! never stored, and the inner service gets the key bare.

use std::convert::Infallible;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::BodyExt;
use idem_core::MemoryStore;
use idem_http::{full, BoxBody, IdempotencyLayer};
use tower::{Service, ServiceExt};
use tower_layer::Layer;

/// What the inner service saw: method, path and query, `Idempotency-Key`.
type Log = Arc<Mutex<Vec<(String, String, Option<String>)>>>;

/// An inner service that records each call and answers `status`.
fn inner(
    log: Log,
    status: StatusCode,
) -> impl Service<Request<BoxBody>, Response = Response<BoxBody>, Error = Infallible, Future: Send>
       + Clone
       + Send
       + 'static {
    tower::service_fn(move |req: Request<BoxBody>| {
        let log = log.clone();
        async move {
            log.lock().unwrap().push((
                req.method().to_string(),
                req.uri().to_string(),
                req.headers()
                    .get("idempotency-key")
                    .map(|v| v.to_str().unwrap().to_owned()),
            ));
            let mut resp = Response::new(full(format!("ran {}", log.lock().unwrap().len())));
            *resp.status_mut() = status;
            Ok::<_, Infallible>(resp)
        }
    })
}

async fn call(
    layer: &IdempotencyLayer,
    log: &Log,
    status: StatusCode,
    method: &str,
    uri: &str,
    key: Option<&str>,
) -> (StatusCode, String) {
    let mut req = Request::builder()
        .method(Method::from_bytes(method.as_bytes()).unwrap())
        .uri(uri)
        .header("content-type", "application/json");
    if let Some(k) = key {
        req = req.header("idempotency-key", k);
    }
    let req = req.body(full(Bytes::from_static(b"{}"))).unwrap();
    let resp = layer
        .layer(inner(log.clone(), status))
        .oneshot(req)
        .await
        .unwrap();
    let status = resp.status();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8_lossy(&body).into_owned())
}

fn kind(body: &str) -> String {
    serde_json::from_str::<serde_json::Value>(body).unwrap()["type"]
        .as_str()
        .unwrap()
        .trim_start_matches("urn:idem:problem:")
        .to_owned()
}

#[tokio::test]
async fn a_case_variant_of_a_guarded_method_is_refused() {
    let layer = IdempotencyLayer::new(MemoryStore::new());
    let log = Log::default();
    let ok = StatusCode::CREATED;
    assert_eq!(
        call(&layer, &log, ok, "POST", "/pay", Some("m")).await.0,
        ok
    );
    for m in ["post", "Post", "patch"] {
        let (status, body) = call(&layer, &log, ok, m, "/pay", Some("m")).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{m}");
        assert_eq!(kind(&body), "method-case", "{m}");
        let (status, _) = call(&layer, &log, ok, m, "/pay", None).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{m} without a key");
    }
    assert_eq!(log.lock().unwrap().len(), 1);
    // Not a guarded method in any case: passed through.
    assert_eq!(call(&layer, &log, ok, "get", "/pay", None).await.0, ok);
}

#[tokio::test]
async fn the_inner_service_and_the_fingerprint_see_one_path() {
    let layer = IdempotencyLayer::new(MemoryStore::new());
    let log = Log::default();
    let ok = StatusCode::CREATED;
    let (s, first) = call(
        &layer,
        &log,
        ok,
        "POST",
        "/pay//%70ay/./1?q=%2F..",
        Some("\"p\""),
    )
    .await;
    assert_eq!(s, ok);
    // The same request spelled otherwise is a replay, not a mismatch.
    let (s, again) = call(
        &layer,
        &log,
        ok,
        "POST",
        "/x/../pay/pay/1?q=%2F..",
        Some("p"),
    )
    .await;
    assert_eq!((s, again), (ok, first));
    let seen = log.lock().unwrap().clone();
    assert_eq!(
        seen,
        [(
            "POST".to_owned(),
            "/pay/pay/1?q=%2F..".to_owned(),
            Some("p".to_owned())
        )]
    );
}

#[tokio::test]
async fn token_routes_and_ambiguous_paths() {
    let layer = IdempotencyLayer::new(MemoryStore::new()).with_require_token(["/pay"]);
    let log = Log::default();
    let ok = StatusCode::CREATED;
    for path in ["/%70ay/1", "//pay/1", "/a/../pay/1", "/PAY/1"] {
        let (s, body) = call(&layer, &log, ok, "POST", path, None).await;
        assert_eq!(s, StatusCode::PRECONDITION_REQUIRED, "{path}");
        assert_eq!(kind(&body), "token-required", "{path}");
    }
    for path in [
        "/pay%2F1",
        "/pay%5C1",
        "/pay\\1",
        "/pay%00",
        "/pay%zz",
        "/pay;a/1",
        "/pay%252F1",
    ] {
        let (s, body) = call(&layer, &log, ok, "POST", path, Some("k")).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{path}");
        assert_eq!(kind(&body), "ambiguous-path", "{path}");
    }
    assert!(log.lock().unwrap().is_empty());
}

#[tokio::test]
async fn a_1xx_answer_is_never_stored() {
    let layer = IdempotencyLayer::new(MemoryStore::new());
    let log = Log::default();
    for round in 1..=2 {
        let (s, body) = call(
            &layer,
            &log,
            StatusCode::SWITCHING_PROTOCOLS,
            "POST",
            "/ws",
            Some("u"),
        )
        .await;
        assert_eq!(s, StatusCode::BAD_GATEWAY, "round {round}");
        assert_eq!(kind(&body), "upstream-protocol");
        assert_eq!(log.lock().unwrap().len(), round, "the key was released");
    }
    let (s, _) = call(&layer, &log, StatusCode::CREATED, "POST", "/ws", Some("u")).await;
    assert_eq!(s, StatusCode::CREATED);
}
