//! `--fail-open`: when the store cannot be reached at `begin`, forward the
//! request to the upstream unprotected instead of answering 503.
//!
//! The idempotency layer is left as it is; this wraps it. A guarded
//! request's body is buffered here first (the layer buffers it anyway), and
//! the request carries a [`ProxyCalled`] flag that the proxy sets. When the
//! layer answers `503 store-unavailable` and the proxy was never called,
//! the store failed before the run (in `begin`, or while waiting for an
//! in-flight original — but such a key was seen in flight, see below) and
//! nothing reached the upstream. Only then is the
//! buffered request forwarded directly, marked `Idempotency-Status:
//! unprotected`. A failure to *save* a result never gets here: the upstream
//! was called, its answer goes back as it is, and the key stays in flight.
//!
//! Keys this gateway saw claimed, in flight or completed within the last
//! lease (+ wait) are never forwarded this way ([`Recent`]): a rerun of
//! those would be a certain second execution.

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use http::{header, HeaderName, HeaderValue, Method, Request, Response, StatusCode};
use http_body::Frame;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use idem_core::IdempotencyKey;
use idem_http::{BoxBody, BoxError, ScopeBy, PROBLEM_TYPE_PREFIX};

use crate::guard::Recent;
use crate::proxy::Proxy;
use crate::server::LayeredProxy;

/// The response field that marks an answer given without protection.
pub const IDEMPOTENCY_STATUS: HeaderName = HeaderName::from_static("idempotency-status");

/// Set by the proxy when it is called for a request: the upstream may have
/// been reached, so the request must never be forwarded a second time.
#[derive(Debug, Clone, Default)]
pub(crate) struct ProxyCalled(pub(crate) Arc<AtomicBool>);

impl ProxyCalled {
    pub(crate) fn mark(&self) {
        self.0.store(true, Ordering::SeqCst);
    }

    fn was_called(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}

/// What fail-open needs to know.
#[derive(Debug)]
pub(crate) struct FailOpen {
    pub(crate) methods: Vec<Method>,
    pub(crate) scope: ScopeBy,
    pub(crate) max_body: usize,
    pub(crate) recent: Arc<Recent>,
}

impl FailOpen {
    /// The key of a request fail-open may forward: a guarded method with
    /// one valid `Idempotency-Key`. Anything else goes to the layer as it
    /// is (it never needs the store, or is refused before it).
    pub(crate) fn key_of<B>(&self, req: &Request<B>) -> Option<IdempotencyKey> {
        if !self.methods.contains(req.method()) {
            return None;
        }
        idem_http::key::key_from_headers(req.headers())
            .ok()
            .flatten()
    }

    /// Runs `req` through `layer`; forwards it unprotected when the store
    /// failed before the run (see the module docs).
    pub(crate) async fn respond(
        &self,
        layer: LayeredProxy,
        proxy: Proxy,
        req: Request<Incoming>,
        key: IdempotencyKey,
    ) -> Response<BoxBody> {
        let (parts, body) = req.into_parts();
        let declared = parts
            .headers
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok());
        let (body, kept) = if declared.is_some_and(|n| n > self.max_body as u64) {
            // The layer answers 413 without reading it or touching the store.
            (boxed(body), None)
        } else {
            match read_up_to(body, self.max_body).await {
                Read::Whole(bytes) => (full(bytes.clone()), Some(bytes)),
                Read::Partial(rest) => (rest, None),
            }
        };
        let Some(bytes) = kept else {
            return answer(call(layer, Request::from_parts(parts, body)).await);
        };
        let mut copy = Request::new(());
        *copy.method_mut() = parts.method.clone();
        *copy.uri_mut() = parts.uri.clone();
        *copy.version_mut() = parts.version;
        *copy.headers_mut() = parts.headers.clone();
        let called = ProxyCalled::default();
        let mut parts = parts;
        parts.extensions.insert(called.clone());
        let resp = answer(call(layer, Request::from_parts(parts, body)).await);
        if resp.status() != StatusCode::SERVICE_UNAVAILABLE || called.was_called() {
            return resp;
        }
        // A 503 the layer made itself: a small problem body. Is it the store?
        let (rparts, rbody) = resp.into_parts();
        let rbytes = read_small(rbody, 64 * 1024).await;
        let unavailable = serde_json::from_slice::<serde_json::Value>(&rbytes)
            .ok()
            .and_then(|v| v.get("type").and_then(|t| t.as_str()).map(str::to_owned))
            .is_some_and(|t| t == format!("{PROBLEM_TYPE_PREFIX}store-unavailable"));
        let original = Response::from_parts(rparts, full(rbytes));
        if !unavailable {
            return original;
        }
        let scope = self.scope.scope_of(copy.headers());
        let method = copy.method().clone();
        let path = copy.uri().path().to_owned();
        if self.recent.contains(&scope, &key) {
            tracing::error!(
                key = %key, %method, %path,
                "FAIL-OPEN REFUSED: the idempotency store is unavailable, but this gateway saw this \
                 key claimed or completed moments ago; forwarding it would run it twice. Answering 503."
            );
            return original;
        }
        tracing::warn!(
            key = %key, %method, %path,
            "FAIL-OPEN: the idempotency store is unavailable; forwarding WITHOUT idempotency protection. \
             This request is not recorded: a retry of it may run again (double charge)."
        );
        let (copy_parts, ()) = copy.into_parts();
        let mut resp = proxy
            .forward(Request::from_parts(copy_parts, full(bytes)))
            .await;
        resp.headers_mut()
            .insert(IDEMPOTENCY_STATUS, HeaderValue::from_static("unprotected"));
        resp
    }
}

/// Calls the layer. A plain function returning a boxed future: naming the
/// service's future inside an `async fn` trips a rustc limitation with the
/// `dyn Error` lifetime inside `BoxBody` ("not general enough").
fn call(layer: LayeredProxy, req: Request<BoxBody>) -> LayerFuture {
    use tower::ServiceExt;
    Box::pin(layer.oneshot(req))
}

type LayerFuture = Pin<
    Box<
        dyn std::future::Future<Output = Result<Response<BoxBody>, std::convert::Infallible>>
            + Send,
    >,
>;

fn answer(r: Result<Response<BoxBody>, std::convert::Infallible>) -> Response<BoxBody> {
    match r {
        Ok(resp) => resp,
        Err(never) => match never {},
    }
}

/// Reads a body of at most `limit` bytes (more, or an error: what was read).
async fn read_small(mut body: BoxBody, limit: usize) -> Bytes {
    let mut buf = BytesMut::new();
    while let Some(Ok(frame)) = body.frame().await {
        if let Ok(data) = frame.into_data() {
            buf.extend_from_slice(&data);
            if buf.len() > limit {
                break;
            }
        }
    }
    buf.freeze()
}

fn full(bytes: Bytes) -> BoxBody {
    Full::new(bytes)
        .map_err(|never| match never {})
        .boxed_unsync()
}

fn boxed(body: Incoming) -> BoxBody {
    body.map_err(|e| -> BoxError { Box::new(e) }).boxed_unsync()
}

/// A request body read as far as it goes.
enum Read {
    /// All of it, within the limit.
    Whole(Bytes),
    /// Past the limit, or broken: what was read, then the rest (or the
    /// error), so the layer sees the same body and answers 413 or 400.
    Partial(BoxBody),
}

async fn read_up_to(mut body: Incoming, limit: usize) -> Read {
    let mut buf = BytesMut::new();
    loop {
        match body.frame().await {
            None => return Read::Whole(buf.freeze()),
            Some(Ok(frame)) => {
                if let Ok(data) = frame.into_data() {
                    buf.extend_from_slice(&data);
                    if buf.len() > limit {
                        return Read::Partial(
                            Resumed {
                                prefix: Some(buf.freeze()),
                                error: None,
                                rest: Some(boxed(body)),
                            }
                            .boxed_unsync(),
                        );
                    }
                }
                // Trailers: the layer drops them from guarded requests too.
            }
            Some(Err(e)) => {
                return Read::Partial(
                    Resumed {
                        prefix: Some(buf.freeze()),
                        error: Some(e.into()),
                        rest: None,
                    }
                    .boxed_unsync(),
                )
            }
        }
    }
}

/// A body that yields `prefix`, then `error` or the frames of `rest`.
struct Resumed {
    prefix: Option<Bytes>,
    error: Option<BoxError>,
    rest: Option<BoxBody>,
}

impl http_body::Body for Resumed {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        if let Some(p) = this.prefix.take() {
            if !p.is_empty() {
                return Poll::Ready(Some(Ok(Frame::data(p))));
            }
        }
        if let Some(e) = this.error.take() {
            return Poll::Ready(Some(Err(e)));
        }
        match &mut this.rest {
            Some(rest) => Pin::new(rest).poll_frame(cx),
            None => Poll::Ready(None),
        }
    }
}
