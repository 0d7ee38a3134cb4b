//! The layer's one log line per guarded request, read back as JSON.
//!
//! Alone in its own test binary: a thread-local subscriber
//! (`tracing::subscriber::set_default`) misses events now and then while
//! other tests on other threads register the same callsites without one.

use std::sync::{Arc, Mutex};

use axum::body::Body as AxumBody;
use axum::routing::{get, post};
use axum::Router;
use http::{Method, Request, StatusCode};
use idem_core::MemoryStore;
use idem_http::IdempotencyLayer;

/// A guarded `POST /orders` that answers 201, and an unguarded `GET /read`.
fn app() -> Router {
    Router::new()
        .route("/orders", post(|| async { (StatusCode::CREATED, "order") }))
        .route("/read", get(|| async { "read" }))
}

#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn one_structured_log_line_per_guarded_request() {
    use tower::ServiceExt;
    let out = Captured::default();
    let writer = out.clone();
    let subscriber = tracing_subscriber::fmt()
        .json()
        .with_max_level(tracing::Level::INFO)
        .with_writer(move || writer.clone())
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);
    // A current-thread runtime: spawned tasks log on this thread too.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let svc = app().layer(IdempotencyLayer::new(MemoryStore::new()));
        let req = |key: &'static str, body: &'static str| {
            Request::builder()
                .method(Method::POST)
                .uri("/orders?x=1")
                .header("idempotency-key", key)
                .body(AxumBody::from(body))
                .unwrap()
        };
        for (key, body) in [("log-1", "a"), ("log-1", "a"), ("log-1", "b"), ("", "a")] {
            svc.clone().oneshot(req(key, body)).await.unwrap();
        }
        // Unguarded: no line.
        let get = || {
            Request::builder()
                .uri("/a/./read")
                .body(AxumBody::empty())
                .unwrap()
        };
        svc.clone().oneshot(get()).await.unwrap();
        // With the access log: one line, the path normalised.
        let logged = app().layer(IdempotencyLayer::new(MemoryStore::new()).with_access_log(true));
        logged.oneshot(get()).await.unwrap();
    });
    let text = String::from_utf8(out.0.lock().unwrap().clone()).unwrap();
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .filter(|v: &serde_json::Value| v["target"] == "idem")
        .collect();
    let outcomes: Vec<&str> = lines
        .iter()
        .map(|v| v["fields"]["outcome"].as_str().unwrap())
        .collect();
    assert_eq!(
        outcomes,
        [
            "executed",
            "replayed",
            "mismatch",
            "rejected",
            "passthrough"
        ],
        "{text}"
    );
    let first = &lines[0]["fields"];
    assert_eq!(first["status"], 201);
    assert_eq!(first["key"], "log-1");
    // How `idem keys`, traces and logs name the key.
    let hash = idem_core::key_hash(
        &idem_core::Scope::anonymous(),
        &idem_core::IdempotencyKey::new("log-1").unwrap(),
    );
    assert_eq!(first["key_hash"], hash.as_str());
    assert_eq!(first["route"], "default");
    assert_eq!(first["saved"], "stored");
    assert_eq!(first["method"], "POST");
    assert_eq!(first["path"], "/orders");
    assert!(first["duration_ms"].is_u64());
    assert_eq!(lines[1]["fields"]["key_hash"], hash.as_str());
    assert_eq!(lines[2]["fields"]["status"], 422);
    assert_eq!(lines[3]["fields"]["status"], 400);
    assert_eq!(lines[3]["fields"]["key_hash"], "-");
    let access = &lines[4]["fields"];
    assert_eq!(access["message"], "request");
    assert_eq!(access["status"], 404);
    assert_eq!(access["method"], "GET");
    assert_eq!(access["path"], "/a/read");
    assert!(access.get("key").is_none(), "{access}");
}
