//! `ScopeBy::ClientCert` in process: the `ClientCertificate` a server puts
//! in the request's extensions is the scope; a request without one is
//! refused (400 `client-certificate-required`), never anonymous.

use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use idem_http::{BoxBody, ClientCertificate, IdempotencyLayer, ScopeBy};
use tower::{Layer, ServiceExt};

fn post(cert: Option<&'static [u8]>) -> Request<Full<Bytes>> {
    let mut req = Request::post("/pay")
        .header("idempotency-key", "same-key")
        .header("authorization", "Bearer shared")
        .body(Full::new(Bytes::from_static(b"{}")))
        .unwrap();
    if let Some(der) = cert {
        req.extensions_mut()
            .insert(ClientCertificate(Bytes::from_static(der)));
    }
    req
}

#[tokio::test]
async fn the_certificate_scopes_and_none_is_refused() {
    let calls = Arc::new(AtomicUsize::new(0));
    let layer =
        IdempotencyLayer::new(idem_core::MemoryStore::new()).with_scope(ScopeBy::ClientCert);
    let inner = {
        let calls = calls.clone();
        tower::service_fn(move |_req: Request<BoxBody>| {
            let n = calls.fetch_add(1, Ordering::SeqCst) + 1;
            async move {
                let mut r = Response::new(Full::new(Bytes::from(n.to_string())));
                *r.status_mut() = StatusCode::CREATED;
                Ok::<_, Infallible>(r)
            }
        })
    };
    let call = |req| layer.layer(inner.clone()).oneshot(req);
    let body =
        |r: Response<BoxBody>| async move { r.into_body().collect().await.unwrap().to_bytes() };

    let refused = call(post(None)).await.unwrap();
    assert_eq!(refused.status(), StatusCode::BAD_REQUEST);
    assert!(String::from_utf8_lossy(&body(refused).await).contains("client-certificate-required"));
    assert_eq!(calls.load(Ordering::SeqCst), 0);

    let a = call(post(Some(b"cert-a"))).await.unwrap();
    assert_eq!(a.status(), StatusCode::CREATED);
    let b = call(post(Some(b"cert-b"))).await.unwrap();
    assert_eq!(b.status(), StatusCode::CREATED);
    assert_eq!(
        calls.load(Ordering::SeqCst),
        2,
        "two certificates, two callers"
    );
    let a2 = call(post(Some(b"cert-a"))).await.unwrap();
    assert_eq!(a2.headers()["idempotent-replayed"], "true");
    assert_eq!(body(a2).await, "1");
    assert_eq!(calls.load(Ordering::SeqCst), 2);

    // Tokens are issued in the certificate's scope; none without one.
    let mut ext = http::Extensions::new();
    assert!(layer
        .issue_token_in(&http::HeaderMap::new(), &ext)
        .await
        .is_err());
    ext.insert(ClientCertificate(Bytes::from_static(b"cert-a")));
    assert!(layer
        .issue_token_in(&http::HeaderMap::new(), &ext)
        .await
        .is_ok());
}
