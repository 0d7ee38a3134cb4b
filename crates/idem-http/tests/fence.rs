//! The lease's [`Fence`] in the request's extensions, for a Rust service
//! behind the layer: present on every run of a guarded request, greater on
//! a later run of the same key, absent on unguarded requests.

use std::convert::Infallible;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use idem_http::{BoxBody, Fence, IdempotencyLayer};
use tower::{Layer, ServiceExt};

fn request(method: &str, key: Option<&str>) -> Request<Full<Bytes>> {
    let mut b = Request::builder().method(method).uri("/pay");
    if let Some(k) = key {
        b = b.header("idempotency-key", k);
    }
    b.body(Full::new(Bytes::from_static(b"{}"))).unwrap()
}

#[tokio::test]
async fn the_service_gets_the_fence_of_each_run() {
    let fences: Arc<Mutex<Vec<Option<Fence>>>> = Arc::default();
    let layer = IdempotencyLayer::new(idem_core::MemoryStore::new());
    let inner = {
        let fences = fences.clone();
        tower::service_fn(move |req: Request<BoxBody>| {
            fences
                .lock()
                .unwrap()
                .push(req.extensions().get::<Fence>().copied());
            async move {
                // A 503 is released: the same key runs again.
                let mut r = Response::new(Full::new(Bytes::new()));
                *r.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
                Ok::<_, Infallible>(r)
            }
        })
    };
    let call = |req| layer.layer(inner.clone()).oneshot(req);
    for _ in 0..2 {
        call(request("POST", Some("k"))).await.unwrap();
    }
    call(request("POST", None)).await.unwrap();
    call(request("GET", Some("k"))).await.unwrap();
    let seen = fences.lock().unwrap().clone();
    assert_eq!(seen.len(), 4, "{seen:?}");
    let (first, second) = (seen[0].expect("a fence"), seen[1].expect("a fence"));
    assert!(second > first, "{second:?} must exceed {first:?}");
    assert_eq!(seen[2..], [None, None], "unguarded requests carry no fence");
}
