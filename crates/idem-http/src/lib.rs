//! # idem-http
//!
//! A tower [`Layer`](tower_layer::Layer) that makes POST/PATCH requests
//! carrying an `Idempotency-Key` header take effect once (IETF httpapi draft
//! "The Idempotency-Key HTTP Header Field"). Works in axum and plain hyper.
//!
//! API CONTRACT (stub written by the lead; the HTTP-layer helper fills it in,
//! the gateway builds against it — keep these names and shapes).

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderName, Method};
use idem_core::{DynStore, Scope};

/// A boxed body error.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// The body type the layer hands to the inner service and returns:
/// guarded requests carry a buffered body, others stream through untouched.
pub type BoxBody = http_body_util::combinators::UnsyncBoxBody<Bytes, BoxError>;

/// An inner service may put this in its response's extensions to override
/// the status-code policy for that response (the gateway marks a 502 for an
/// unreachable upstream `Release` and a 504 for a timeout `Hold`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Disposition {
    /// Store and replay this response.
    Store,
    /// Free the key; a retry runs again.
    Release,
    /// Keep the key in flight until its lease ends (outcome unknown).
    Hold,
}

/// How the scope of a request is derived.
#[derive(Debug, Clone)]
pub enum ScopeBy {
    /// SHA-256 over every value of these headers, in order (default:
    /// `Authorization`); none present → the anonymous scope.
    Headers(Vec<HeaderName>),
    /// One fixed scope for every request.
    Fixed(Scope),
}

/// Settings of the layer (builder methods on [`IdempotencyLayer`]).
#[derive(Debug, Clone)]
pub struct Options {
    /// Guarded methods (default POST, PATCH).
    pub methods: Vec<Method>,
    /// Answer 400 to a guarded request without a key (default false).
    pub require_key: bool,
    /// Scope derivation (default `Headers([Authorization])`).
    pub scope: ScopeBy,
    /// Largest guarded request body, bytes (default 10 MiB) → 413 beyond.
    pub max_body: usize,
    /// Largest response body kept for replay, bytes (default 1 MiB).
    pub retention_limit: usize,
    /// Lease (default 30 s).
    pub lease: Duration,
    /// Replay window (default 24 h).
    pub ttl: Duration,
    /// How long a duplicate waits for an in-flight original (default 0).
    pub wait: Duration,
    /// Which statuses are stored; the rest are released
    /// (default: 1xx–4xx except 408, 409, 425, 429).
    pub policy: fn(http::StatusCode) -> Disposition,
}

/// The tower layer. `IdempotencyLayer::new(store)` then `with_*` builders:
/// `with_methods(Vec<Method>)`, `with_require_key(bool)`, `with_scope(ScopeBy)`,
/// `with_max_body(usize)`, `with_retention_limit(usize)`, `with_lease(Duration)`,
/// `with_ttl(Duration)`, `with_wait(Duration)`, `with_policy(fn)`.
#[derive(Debug, Clone)]
pub struct IdempotencyLayer {
    #[allow(dead_code)]
    store: DynStore,
    #[allow(dead_code)]
    options: Options,
}

// The service: `IdempotencyService<S>` implements
//   Service<http::Request<B>>  where B: http_body::Body<Data = Bytes> + Send + 'static, B::Error: Into<BoxError>
//   with Response = http::Response<BoxBody>, Error = S::Error,
//   for S: Service<http::Request<BoxBody>, Response = http::Response<RB>> + Clone + Send + 'static,
//        S::Future: Send, S::Error: Send, RB: http_body::Body<Data = Bytes> + Send + 'static, RB::Error: Into<BoxError>.
// Guarded requests run in a spawned task, so a client that disconnects does not
// cancel the upstream call or the save.
//
// Also public: `problem(status, kind, detail) -> Response<BoxBody>` building an
// RFC 9457 problem+json response with `type = "urn:idem:problem:<kind>"`, used by
// the gateway for 502/503/504 and /_idem/ endpoints.
