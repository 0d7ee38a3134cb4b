//! Per-route rules in the layer: first match wins, each route's settings
//! apply to its requests only, keys from a JSON body, and a reload that
//! leaves a running request on the rules it started with.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body as AxumBody;
use axum::routing::any;
use axum::Router;
use bytes::Bytes;
use http::{HeaderName, Method, Request, StatusCode};
use http_body_util::BodyExt;
use idem_core::MemoryStore;
use idem_http::routes::KeySource;
use idem_http::{IdempotencyLayer, Options, Route, StatusPolicy};
use tower::ServiceExt;

/// An app whose every POST counts an execution and answers `status` with
/// the execution's number; `/slow/*` first waits on `gate`.
#[derive(Clone)]
struct App {
    runs: Arc<AtomicUsize>,
    gate: Arc<tokio::sync::Notify>,
}

impl App {
    fn new() -> Self {
        Self {
            runs: Arc::new(AtomicUsize::new(0)),
            gate: Arc::new(tokio::sync::Notify::new()),
        }
    }

    fn runs(&self) -> usize {
        self.runs.load(Ordering::SeqCst)
    }

    fn router(&self) -> Router {
        let runs = self.runs.clone();
        let gate = self.gate.clone();
        let handler = move |req: Request<AxumBody>| {
            let runs = runs.clone();
            let gate = gate.clone();
            async move {
                if req.uri().path().starts_with("/slow") {
                    gate.notified().await;
                }
                let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
                let status = if req.uri().path().starts_with("/fail") {
                    StatusCode::INTERNAL_SERVER_ERROR
                } else {
                    StatusCode::CREATED
                };
                (status, format!("run {n}"))
            }
        };
        Router::new().fallback(any(handler))
    }
}

fn route(name: &str, path: &str, f: impl FnOnce(&mut Route)) -> Route {
    let mut r = Route::new(name, path, Options::default()).unwrap();
    f(&mut r);
    r
}

async fn send(
    layer: &IdempotencyLayer,
    app: &App,
    method: Method,
    path: &str,
    headers: &[(&str, &str)],
    body: &'static str,
) -> (StatusCode, http::HeaderMap, Bytes) {
    let mut b = Request::builder().method(method).uri(path);
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    let resp = tower::Layer::layer(layer, app.router())
        .oneshot(b.body(AxumBody::from(body)).unwrap())
        .await
        .unwrap();
    let (parts, body) = resp.into_parts();
    (
        parts.status,
        parts.headers,
        body.collect().await.unwrap().to_bytes(),
    )
}

fn problem_type(body: &Bytes) -> String {
    let v: serde_json::Value = serde_json::from_slice(body).unwrap();
    v["type"].as_str().unwrap_or_default().to_owned()
}

const KEY: (&str, &str) = ("idempotency-key", "k1");

#[tokio::test]
async fn the_first_matching_route_decides() {
    let app = App::new();
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .with_routes(vec![
            route("payments-refunds", "/payments/{id}/refunds", |r| {
                r.guard = false;
            }),
            route("payments", "/payments", |r| {
                r.options.require_key = true;
                r.options.methods = vec![Method::POST];
            }),
            // Listed after a broader route: never reached.
            route("payments-late", "/payments/x", |r| r.guard = false),
        ])
        .unwrap();
    // Under /payments a key is required, whatever the spelling.
    for path in [
        "/payments",
        "/payments/1",
        "/PAYMENTS/1",
        "/%70ayments",
        "//payments/x",
    ] {
        let (status, _, body) = send(&layer, &app, Method::POST, path, &[], "{}").await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{path}");
        assert_eq!(
            problem_type(&body),
            "urn:idem:problem:key-required",
            "{path}"
        );
    }
    assert_eq!(app.runs(), 0);
    // The more specific route listed first wins: passed through, twice.
    for _ in 0..2 {
        let (status, h, _) = send(
            &layer,
            &app,
            Method::POST,
            "/payments/7/refunds",
            &[KEY],
            "{}",
        )
        .await;
        assert_eq!(status, StatusCode::CREATED);
        assert!(h.get("idempotent-replayed").is_none());
    }
    assert_eq!(app.runs(), 2);
    // PATCH is not a method of `payments`: the default rules (no key needed).
    let (status, _, _) = send(&layer, &app, Method::PATCH, "/payments/1", &[], "{}").await;
    assert_eq!(status, StatusCode::CREATED);
    // Elsewhere the default: no key needed, a key is honoured.
    let (status, _, _) = send(&layer, &app, Method::POST, "/orders", &[], "{}").await;
    assert_eq!(status, StatusCode::CREATED);
    let runs = app.runs();
    send(&layer, &app, Method::POST, "/orders", &[KEY], "{}").await;
    let (_, h, _) = send(&layer, &app, Method::POST, "/orders", &[KEY], "{}").await;
    assert_eq!(h["idempotent-replayed"], "true");
    assert_eq!(app.runs(), runs + 1);
}

#[tokio::test]
async fn a_key_from_the_json_body() {
    let app = App::new();
    let pointer = KeySource::JsonPointer("/event_id".into());
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .with_routes(vec![
            route("webhooks", "/webhooks", |r| {
                r.options.key_source = pointer.clone();
                r.options.fingerprint.exclude = vec!["/delivered_at".into()];
            }),
            route("strict", "/strict", |r| {
                r.options.key_source = pointer.clone();
                r.options.require_key = true;
            }),
        ])
        .unwrap();
    let json = ("content-type", "application/json");
    let first = send(
        &layer,
        &app,
        Method::POST,
        "/webhooks/stripe",
        &[json, ("x-delivery-attempt", "1")],
        r#"{"event_id":"evt_1","amount":10,"delivered_at":"t1"}"#,
    )
    .await;
    assert_eq!(first.0, StatusCode::CREATED);
    let again = send(
        &layer,
        &app,
        Method::POST,
        "/webhooks/stripe",
        &[json, ("x-delivery-attempt", "2")],
        r#"{"event_id":"evt_1","amount":10,"delivered_at":"t1"}"#,
    )
    .await;
    assert_eq!(again.0, StatusCode::CREATED);
    assert_eq!(again.1["idempotent-replayed"], "true");
    assert_eq!(again.2, first.2);
    assert_eq!(app.runs(), 1);
    // No key in the body and none required: through, each time.
    for _ in 0..2 {
        let (status, h, _) = send(
            &layer,
            &app,
            Method::POST,
            "/webhooks/x",
            &[json],
            r#"{"other":1}"#,
        )
        .await;
        assert_eq!(status, StatusCode::CREATED);
        assert!(h.get("idempotent-replayed").is_none());
    }
    assert_eq!(app.runs(), 3);
    // Required: 400, nothing runs.
    for body in [r#"{"other":1}"#, ""] {
        let (status, _, b) = send(&layer, &app, Method::POST, "/strict", &[json], body).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
        assert_eq!(problem_type(&b), "urn:idem:problem:key-required", "{body}");
    }
    // A body that is not I-JSON is refused, required or not: an upstream
    // parser may still read a key in it (the last of two members).
    for path in ["/strict", "/webhooks"] {
        for body in [
            "not json",
            r#"{"event_id":"evt_1","event_id":"evt_1","amount":10}"#,
            r#"{"event_id":"evt_1","x":"\ud800"}"#,
        ] {
            let (status, _, b) = send(&layer, &app, Method::POST, path, &[json], body).await;
            assert_eq!(status, StatusCode::BAD_REQUEST, "{path} {body}");
            assert_eq!(
                problem_type(&b),
                "urn:idem:problem:body-not-json",
                "{path} {body}"
            );
        }
    }
    // A member that is not a key: 400 invalid-key, required or not.
    for body in [
        r#"{"event_id":{"a":1}}"#,
        r#"{"event_id":""}"#,
        r#"{"event_id":1.5}"#,
    ] {
        let (status, _, b) = send(&layer, &app, Method::POST, "/webhooks", &[json], body).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
        assert_eq!(problem_type(&b), "urn:idem:problem:invalid-key", "{body}");
    }
    assert_eq!(app.runs(), 3);
}

#[tokio::test]
async fn each_route_has_its_own_policy_header_and_limits() {
    let app = App::new();
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .with_routes(vec![
            route("stripe-like", "/fail/stored", |r| {
                r.options.policy = StatusPolicy::store_5xx();
            }),
            route("request-id", "/rid", |r| {
                r.options.key_source = KeySource::Header(HeaderName::from_static("x-request-id"));
            }),
            route("small", "/small", |r| r.options.max_body = 4),
        ])
        .unwrap();
    // 500 stored on one route: the retry replays it.
    for _ in 0..2 {
        let (status, _, body) = send(&layer, &app, Method::POST, "/fail/stored", &[KEY], "x").await;
        assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(body, "run 1");
    }
    // Released by default: the retry runs again.
    let k2 = ("idempotency-key", "k2");
    send(&layer, &app, Method::POST, "/fail/released", &[k2], "x").await;
    let (_, _, body) = send(&layer, &app, Method::POST, "/fail/released", &[k2], "x").await;
    assert_eq!(body, "run 3");
    // The key in another header; Idempotency-Key means nothing there.
    let rid = ("x-request-id", "r-1");
    send(&layer, &app, Method::POST, "/rid", &[rid], "x").await;
    let (_, h, _) = send(&layer, &app, Method::POST, "/rid", &[rid], "x").await;
    assert_eq!(h["idempotent-replayed"], "true");
    let (_, h, _) = send(&layer, &app, Method::POST, "/rid", &[KEY], "x").await;
    assert!(h.get("idempotent-replayed").is_none());
    // Per-route body limit.
    let (status, _, _) = send(
        &layer,
        &app,
        Method::POST,
        "/small",
        &[("idempotency-key", "k3")],
        "12345",
    )
    .await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    let (status, _, _) = send(
        &layer,
        &app,
        Method::POST,
        "/big",
        &[("idempotency-key", "k4")],
        "12345",
    )
    .await;
    assert_eq!(status, StatusCode::CREATED);
}

#[tokio::test]
async fn a_reload_applies_to_new_requests_and_not_to_running_ones() {
    let app = App::new();
    let store = MemoryStore::new();
    let layer = IdempotencyLayer::new(store).with_wait(Duration::ZERO);
    let svc = tower::Layer::layer(&layer, app.router());
    // A request starts under the old rules (no key needed, a key honoured)…
    let running = tokio::spawn(
        svc.clone().oneshot(
            Request::post("/slow/1")
                .header("idempotency-key", "slow")
                .body(AxumBody::from("x"))
                .unwrap(),
        ),
    );
    tokio::time::sleep(Duration::from_millis(100)).await;
    // …then the rules change: every POST needs a key, and /slow is a
    // pass-through route.
    let options = Options {
        require_key: true,
        ..Options::default()
    };
    layer
        .reload(options, vec![route("slow", "/slow", |r| r.guard = false)])
        .unwrap();
    // The services made before the reload see the new rules.
    let resp = svc
        .clone()
        .oneshot(Request::post("/orders").body(AxumBody::from("x")).unwrap())
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::BAD_REQUEST);
    // The running request finishes under its rules: its result is stored,
    // so a duplicate under the old rules would replay it. Under the new
    // rules /slow passes through.
    app.gate.notify_one();
    let resp = running.await.unwrap().unwrap();
    assert_eq!(resp.status(), StatusCode::CREATED);
    let runs = app.runs();
    // Back to the first rules: the running request's result was stored
    // (it ran guarded), so its duplicate replays without running.
    layer.reload(Options::default(), vec![]).unwrap();
    let (_, h, _) = send(
        &layer,
        &app,
        Method::POST,
        "/slow/1",
        &[("idempotency-key", "slow")],
        "x",
    )
    .await;
    assert_eq!(h["idempotent-replayed"], "true");
    assert_eq!(app.runs(), runs);
    layer
        .reload(
            Options {
                require_key: true,
                ..Options::default()
            },
            vec![],
        )
        .unwrap();
    // A bad table is refused and the rules in force stay.
    let bad = vec![route("default", "/x", |_| {})];
    assert!(layer.reload(Options::default(), bad).is_err());
    let (status, _, _) = send(&layer, &app, Method::POST, "/orders", &[], "x").await;
    assert_eq!(
        status,
        StatusCode::BAD_REQUEST,
        "the reloaded rules are still in force"
    );
}

#[tokio::test]
async fn a_clone_built_on_does_not_change_the_original() {
    let app = App::new();
    let layer = IdempotencyLayer::new(MemoryStore::new());
    let svc = tower::Layer::layer(&layer, app.router());
    let _strict = layer.clone().with_require_key(true);
    let resp = svc
        .oneshot(Request::post("/orders").body(AxumBody::from("x")).unwrap())
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::CREATED);
}

#[tokio::test]
async fn a_pass_through_route_under_a_token_prefix_still_needs_the_token() {
    let app = App::new();
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .with_require_token(["/pay"])
        .with_routes(vec![route("payfree", "/pay/free", |r| r.guard = false)])
        .unwrap();
    let (status, _, body) = send(&layer, &app, Method::POST, "/pay/free", &[], "{}").await;
    assert_eq!(status, StatusCode::PRECONDITION_REQUIRED);
    assert_eq!(problem_type(&body), "urn:idem:problem:token-required");
    let (status, _, _) = send(&layer, &app, Method::POST, "/pay/free", &[KEY], "{}").await;
    assert_eq!(status, StatusCode::FORBIDDEN, "not a live token");
    assert_eq!(app.runs(), 0);
    // Outside the prefix the route passes through.
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .with_require_token(["/pay"])
        .with_routes(vec![route("free", "/free", |r| r.guard = false)])
        .unwrap();
    let (status, _, _) = send(&layer, &app, Method::POST, "/free", &[], "{}").await;
    assert_eq!(status, StatusCode::CREATED);
}
