//! The layer's `tracing` spans, named and shaped for OpenTelemetry
//! (`tracing-opentelemetry` turns them into OTel spans; the field names are
//! the OTel semantic conventions' where one exists).
//!
//! - `idem.request` (`otel.kind = "server"`): one per request of a guarded
//!   method. `crate::observe` records the outcome, status and key hash
//!   where the request ends. Fields: `http.request.method`, `url.path` (the normalised
//!   path, no query), `idem.key_hash` ([`idem_core::key_hash`], never the
//!   raw key or scope), `idem.outcome`, `http.response.status_code`,
//!   `otel.status_code` (`error` for a 5xx answer).
//! - `idem.proxy` (`otel.kind = "server"`): one per request of another
//!   method, passed through. Fields: `http.request.method`, `url.path`,
//!   `http.response.status_code`.
//!
//! Both are `DEBUG` spans of target `idem`: with no subscriber interested
//! (the default `info` log filter, no OTel layer) they cost one callsite
//! check. With the Cargo feature `otel`, a span that is recorded continues
//! the client's trace: its parent is the remote context the global
//! propagator extracts from the request headers (`traceparent`,
//! `tracestate` once an application installed the W3C propagator), unless
//! the layer already runs inside a span of the application's.

use http::{HeaderMap, Method};
use tracing::field::Empty;
use tracing::Span;

/// The `idem.request` span of a request of a guarded method.
pub(crate) fn request_span(method: &Method, headers: &HeaderMap) -> Span {
    let span = tracing::debug_span!(
        target: "idem",
        "idem.request",
        otel.kind = "server",
        http.request.method = %method,
        url.path = Empty,
        idem.key_hash = Empty,
        idem.outcome = Empty,
        http.response.status_code = Empty,
        otel.status_code = Empty,
    );
    continue_trace(&span, headers);
    span
}

/// The `idem.proxy` span of a request that is passed through.
pub(crate) fn proxy_span(method: &Method, path: &str, headers: &HeaderMap) -> Span {
    let span = tracing::debug_span!(
        target: "idem",
        "idem.proxy",
        otel.kind = "server",
        http.request.method = %method,
        url.path = Empty,
        http.response.status_code = Empty,
        otel.status_code = Empty,
    );
    if !span.is_disabled() {
        // Only a path in normal form: the proxy refuses any other, and a
        // trace should not carry what was never forwarded.
        if let Ok(std::borrow::Cow::Borrowed(p)) = crate::path::normalize_path(path) {
            span.record("url.path", p);
        }
    }
    continue_trace(&span, headers);
    span
}

/// Records the (normalised) path on the current span.
pub(crate) fn record_path(path: &str) {
    let span = Span::current();
    if !span.is_disabled() {
        span.record("url.path", path);
    }
}

/// Makes the remote context in `headers` the parent of `span` (feature
/// `otel`), when the span is recorded, was opened outside any span of the
/// application's (the current span, `span` not being entered yet), and the
/// headers carry a valid context.
#[cfg(feature = "otel")]
fn continue_trace(span: &Span, headers: &HeaderMap) {
    use opentelemetry::propagation::Extractor;
    use opentelemetry::trace::TraceContextExt;
    use tracing_opentelemetry::OpenTelemetrySpanExt;

    struct Headers<'a>(&'a HeaderMap);
    impl Extractor for Headers<'_> {
        fn get(&self, key: &str) -> Option<&str> {
            self.0.get(key).and_then(|v| v.to_str().ok())
        }
        fn keys(&self) -> Vec<&str> {
            self.0.keys().map(|k| k.as_str()).collect()
        }
    }

    if span.is_disabled() || !Span::current().is_none() {
        return;
    }
    let cx = opentelemetry::global::get_text_map_propagator(|p| p.extract(&Headers(headers)));
    if cx.span().span_context().is_valid() {
        // Fails only for a span the OTel layer does not record (e.g. one
        // enabled by RUST_LOG=debug alone): nothing to continue then.
        let _ = span.set_parent(cx);
    }
}

#[cfg(not(feature = "otel"))]
fn continue_trace(_: &Span, _: &HeaderMap) {}
