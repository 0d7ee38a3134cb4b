//! The layer's series through the `metrics` facade, read back from a
//! debugging recorder: one count per outcome, store calls timed, the
//! in-flight gauge back at 0.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body as AxumBody;
use axum::routing::{get, post};
use axum::Router;
use http::{Method, Request, StatusCode};
use idem_core::{MemoryStore, Scope};
use idem_http::{FailOpenGuard, IdempotencyLayer};
use idem_testkit::{faulty::Op, Fault, FaultyStore};
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use tower::ServiceExt;

fn app() -> Router {
    Router::new()
        .route("/orders", post(|| async { (StatusCode::CREATED, "order") }))
        .route(
            "/slow",
            post(|| async {
                tokio::time::sleep(Duration::from_millis(300)).await;
                (StatusCode::CREATED, "slow")
            }),
        )
        .route(
            "/broken",
            post(|| async { (StatusCode::SERVICE_UNAVAILABLE, "try later") }),
        )
        .route("/read", get(|| async { "read" }))
}

fn post_req(path: &str, key: Option<&str>, body: &'static str) -> Request<AxumBody> {
    let mut b = Request::builder().method(Method::POST).uri(path);
    if let Some(k) = key {
        b = b.header("idempotency-key", k);
    }
    b.body(AxumBody::from(body)).unwrap()
}

/// Snapshots taken so far (a snapshot resets what it read: counters and
/// gauges to 0, histograms emptied), so values are sums over them.
#[derive(Default)]
struct Taken(Vec<(metrics_util::CompositeKey, f64)>);

impl Taken {
    fn take(&mut self, snap: &Snapshotter) {
        for (k, _, _, v) in snap.snapshot().into_vec() {
            let v = match v {
                DebugValue::Counter(c) => c as f64,
                DebugValue::Gauge(g) => g.into_inner(),
                DebugValue::Histogram(h) => h.len() as f64,
            };
            self.0.push((k, v));
        }
    }

    /// `name{label=value}`'s value (counter, gauge, or histogram sample
    /// count), summed over every series that matches; 0 when absent.
    fn value(&self, name: &str, label: Option<(&str, &str)>) -> f64 {
        self.0
            .iter()
            .filter(|(k, _)| k.key().name() == name)
            .filter(|(k, _)| {
                label.is_none_or(|(n, v)| k.key().labels().any(|l| l.key() == n && l.value() == v))
            })
            .map(|(_, v)| v)
            .sum()
    }
}

#[derive(Debug)]
struct Allow;

impl FailOpenGuard for Allow {
    fn allows(&self, _: &Scope, _: &idem_core::IdempotencyKey) -> bool {
        true
    }
}

#[test]
fn every_outcome_is_counted_once() {
    let recorder = DebuggingRecorder::new();
    let snap = recorder.snapshotter();
    let mut taken = Taken::default();
    let _local = metrics::set_default_local_recorder(&recorder);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let svc =
            app().layer(IdempotencyLayer::new(MemoryStore::new()).with_require_token(["/pay"]));
        let send = |req| svc.clone().oneshot(req);
        assert_eq!(
            send(post_req("/orders", Some("m-1"), "a"))
                .await
                .unwrap()
                .status(),
            201
        );
        assert_eq!(
            send(post_req("/orders", Some("m-2"), "a"))
                .await
                .unwrap()
                .status(),
            201
        );
        assert_eq!(
            send(post_req("/orders", Some("m-1"), "a"))
                .await
                .unwrap()
                .status(),
            201
        );
        assert_eq!(
            send(post_req("/orders", Some("m-1"), "b"))
                .await
                .unwrap()
                .status(),
            422
        );
        assert_eq!(
            send(post_req("/broken", Some("m-3"), "a"))
                .await
                .unwrap()
                .status(),
            503
        );
        assert_eq!(
            send(post_req("/orders", Some(""), "a"))
                .await
                .unwrap()
                .status(),
            400
        );
        assert_eq!(
            send(post_req("/pay", None, "a")).await.unwrap().status(),
            428
        );
        assert_eq!(
            send(post_req("/pay", Some("tok_nope"), "a"))
                .await
                .unwrap()
                .status(),
            403
        );
        assert_eq!(
            send(post_req("/orders", None, "a")).await.unwrap().status(),
            201
        );
        let read = Request::builder()
            .uri("/read")
            .body(AxumBody::empty())
            .unwrap();
        assert_eq!(send(read).await.unwrap().status(), 200);
        // A duplicate while the original runs: 409.
        let first = tokio::spawn(send(post_req("/slow", Some("m-4"), "a")));
        tokio::time::sleep(Duration::from_millis(100)).await;
        taken.take(&snap);
        assert_eq!(taken.value("idem_in_flight", None), 1.0);
        assert_eq!(
            send(post_req("/slow", Some("m-4"), "a"))
                .await
                .unwrap()
                .status(),
            409
        );
        assert_eq!(first.await.unwrap().unwrap().status(), 201);

        // A store that is down: 503, or forwarded with fail-open.
        let down = FaultyStore::new(MemoryStore::new());
        down.set_each(&Op::ALL, Fault::Unavailable);
        let down = Arc::new(down);
        let closed = app().layer(IdempotencyLayer::from_parts(
            down.clone(),
            Default::default(),
        ));
        assert_eq!(
            closed
                .oneshot(post_req("/orders", Some("d-1"), "a"))
                .await
                .unwrap()
                .status(),
            503
        );
        let open = app().layer(
            IdempotencyLayer::from_parts(down, Default::default()).with_fail_open(Arc::new(Allow)),
        );
        assert_eq!(
            open.oneshot(post_req("/orders", Some("d-2"), "a"))
                .await
                .unwrap()
                .status(),
            201
        );
    });
    taken.take(&snap);
    let value = |name: &str, label: Option<(&str, &str)>| taken.value(name, label);
    let outcome = |o: &str| value("idem_requests_total", Some(("outcome", o)));
    assert_eq!(outcome("executed"), 3.0, "m-1, m-2, m-4");
    assert_eq!(outcome("replayed"), 1.0);
    assert_eq!(outcome("mismatch"), 1.0);
    assert_eq!(outcome("released"), 1.0, "the 503 is released");
    assert_eq!(outcome("rejected"), 3.0, "bad key, no token, unknown token");
    assert_eq!(outcome("passthrough"), 2.0, "no key, GET");
    assert_eq!(outcome("in_flight"), 1.0);
    assert_eq!(outcome("store_error"), 1.0);
    assert_eq!(outcome("failed_open"), 1.0);
    assert_eq!(value("idem_requests_total", None), 14.0);
    assert_eq!(
        value(
            "idem_request_duration_seconds",
            Some(("outcome", "executed"))
        ),
        3.0
    );
    assert_eq!(
        value("idem_tokens_rejected_total", Some(("reason", "missing"))),
        1.0
    );
    assert_eq!(
        value("idem_tokens_rejected_total", Some(("reason", "unknown"))),
        1.0
    );
    assert_eq!(value("idem_in_flight", None), 0.0);
    // begin per keyed request that reached the store (m-1 ×3, m-2, m-3,
    // m-4 ×2, the token check's begin, d-1, d-2).
    let begins = value(
        "idem_store_operation_duration_seconds",
        Some(("op", "begin")),
    );
    assert!(begins >= 9.0, "{begins}");
    assert_eq!(
        value("idem_store_errors_total", Some(("kind", "unavailable"))),
        2.0
    );
}
