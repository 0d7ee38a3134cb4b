//! # idem-http
//!
//! A tower [`Layer`](tower_layer::Layer) that makes POST/PATCH requests
//! carrying an `Idempotency-Key` header take effect once (IETF httpapi draft
//! "The Idempotency-Key HTTP Header Field"). Works in axum and plain hyper.
//!
//! For every guarded request (POST and PATCH by default) that carries a key,
//! the layer
//!
//! 1. parses the key ([`key`]: an RFC 8941 sf-string or a bare token; 400 on
//!    anything else, or on two `Idempotency-Key` fields);
//! 2. derives the caller's [`Scope`] ([`ScopeBy`]: by default a SHA-256 of
//!    every `Authorization` field, in order);
//! 3. reads the body (at most [`Options::max_body`] bytes, else 413) and
//!    fingerprints method, path, query, `Content-Type` and body, with JSON
//!    bodies canonicalised by RFC 8785 ([`fingerprint`]);
//! 4. claims the key in the store through [`idem_core::Engine::execute`] and
//!    either runs the inner service once (with the lease's [`Fence`] in the
//!    request's extensions), or answers with the stored
//!    response (plus `Idempotent-Replayed: true`), a 409 with `Retry-After`
//!    while the original is in flight, or a 422 when the key was used for a
//!    different request;
//! 5. stores the response ([`Disposition`], [`default_policy`]) **before**
//!    answering the first caller.
//!
//! Guarded requests run in a spawned task, so a client that disconnects
//! does not cancel the inner call or the save. The tasks are tracked
//! ([`IdempotencyLayer::tracker`], a [`TaskTracker`]) so a server can wait
//! for them at shutdown instead of exiting before their results are stored.
//! Requests of other methods, and guarded requests without a key, stream
//! through untouched.
//!
//! ## One path, one key
//!
//! A guarded request's path is normalised once ([`normalize_path`]:
//! unreserved escapes decoded, dot segments removed, repeated slashes
//! merged) and the inner service gets the request with that path (query
//! unchanged); the token routes and the fingerprint judge the same path.
//! The `Idempotency-Key` field reaches the inner service as the bare key
//! (`abc` for `"abc"`, `abc` or `"abc";p=1`), so one key to the layer is
//! one value to the service behind it.
//!
//! ## Per-route rules
//!
//! [`IdempotencyLayer::with_routes`] takes an ordered list of [`Route`]s,
//! first match wins ([`routes`]): each names the methods and the path
//! pattern (`/payments`, `/orders/{id}/items`, matched by segment on the
//! normalised, decoded, lower-cased path) it covers and carries a complete
//! [`Options`] — TTL, lease, wait, `require_key`, body and retention
//! limits, scope, where the key comes from ([`KeySource`]: a header, or a
//! JSON Pointer into the body), which parts of the request are
//! fingerprinted ([`fingerprint::FingerprintSpec`]) and which statuses are
//! stored ([`StatusPolicy`]) — or passes its requests through untouched
//! (`guard = false`). A request no route matches gets the layer's own
//! options (route `default`). [`IdempotencyLayer::reload`] replaces the
//! rules while the services serve; a request keeps the rules it started
//! with. The route's name is the `route` label of the request metrics and
//! a field of the log line.
//!
//! ## A response body that fails
//!
//! A stored response's body is buffered (up to the retention limit) before
//! the first caller is answered. If it fails while it is buffered (an
//! upstream that resets mid-body), nothing has been sent yet: the caller
//! gets a complete 502 `upstream-failed` problem instead of the status with
//! a truncated body, and the key is **held** until its lease ends (the inner
//! service answered, so it may have acted). Past the retention limit the
//! key is already completed (without its body) and the rest streams through:
//! a failure there can only cut the first caller's stream short, and a
//! duplicate gets 410 `response-not-retained` (never a second execution).
//! Bodies of released or held responses (5xx, 408, 409, 425, 429) are not
//! buffered; a failure there reaches the caller as a broken stream.
//! Every error the layer itself produces is `application/problem+json`
//! (RFC 9457, [`problem()`]).
//!
//! | response                           | when                                                      |
//! |------------------------------------|-----------------------------------------------------------|
//! | the inner service's                | first execution (stored before it is sent)                |
//! | stored one + `Idempotent-Replayed` | same key, same request, completed                         |
//! | 400 `invalid-key`, `multiple-keys`, `key-required`, `body-unreadable` | bad header, body read error |
//! | 400 `method-case`                  | the method equals a guarded method except for letter case (`post`); methods are case-sensitive (RFC 9110 §9.1) and an upstream that upper-cases them would run it unguarded |
//! | 400 `ambiguous-path`               | a guarded request whose path servers could read as different paths ([`PathError`]: `%2F`, `%5C`, `\`, control characters, malformed or double escapes, `;`) |
//! | 502 `upstream-protocol`            | the inner service answered a guarded request with a 1xx (a `101 Switching Protocols`): never stored, the key is released |
//! | 409 `in-flight` + `Retry-After`    | same key, same request, still running                     |
//! | 410 `response-not-retained`        | the original's body was larger than the retention limit   |
//! | 403 `token-unknown`               | a route of [`Options::require_token`] whose key is not a live submit token of the caller (never issued to it, or expired before its first use); the inner service is not called |
//! | 413 `body-too-large`               | request body larger than [`Options::max_body`]            |
//! | 422 `key-mismatch`                 | same key, different method/path/query/content type/body   |
//! | 428 `token-required`              | a route of [`Options::require_token`] without an `Idempotency-Key` |
//! | 500 `corrupt-record`, `internal`   | undecodable record; the inner service panicked            |
//! | 502 `upstream-failed`              | the response body failed while it was buffered (key held) |
//! | 503 `store-unavailable`, `store-full` | the store failed before the run (the inner service is not called) |
//! | the inner service's + `Idempotency-Status: unprotected` | fail-open ([`Options::fail_open`], off by default): the store was unavailable before the run and the [`FailOpenGuard`] allowed the key; nothing is recorded |
//!
//! ## Metrics and logs
//!
//! The layer counts every request by [`RequestOutcome`] and times it, its
//! store calls ([`idem_core::InstrumentedStore`]) and its in-flight
//! requests through the [`metrics`](https://docs.rs/metrics) facade, and
//! writes one log line per guarded request (target `idem`: outcome, status,
//! duration, key, `key_hash`, method, path, route); see [`observe`] for the
//! series and fields. Install your metrics recorder before building the
//! layer.
//!
//! ## Example (axum 0.8)
//!
//! ```no_run
//! use std::time::Duration;
//! use axum::{routing::post, Router};
//! use idem_core::MemoryStore;
//! use idem_http::IdempotencyLayer;
//!
//! # async fn run() -> std::io::Result<()> {
//! let layer = IdempotencyLayer::new(MemoryStore::new())
//!     .with_ttl(Duration::from_secs(24 * 3600))
//!     .with_wait(Duration::from_secs(2));
//! let app = Router::new()
//!     .route("/orders", post(|| async { (axum::http::StatusCode::CREATED, "order 1") }))
//!     .layer(layer);
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
//! axum::serve(listener, app).await
//! # }
//! ```

mod body;
pub mod body_key;
mod budget;
mod fence;
pub mod fingerprint;
mod future;
mod json_pointer;
pub mod key;
mod layer;
pub mod observe;
mod options;
pub mod path;
mod policy;
mod problem;
pub mod replay;
pub mod routes;
mod scope;
mod service;
mod tokens;
mod trace;

use bytes::Bytes;
pub use idem_core::{DynStore, Scope};

pub use body::full;
pub use fence::{Fence, IDEMPOTENCY_FENCE};
pub use future::ResponseFuture;
pub use key::{KeyHeaderError, IDEMPOTENCY_KEY, IDEMPOTENCY_STATUS, IDEMPOTENT_REPLAYED};
pub use layer::{IdempotencyLayer, Reloaded};
pub use observe::{RequestOutcome, TokenRejection};
pub use options::{
    FailOpenGuard, Options, DEFAULT_MAX_BODY, DEFAULT_METHODS, DEFAULT_RETENTION_LIMIT,
    DEFAULT_TOKEN_TTL,
};
pub use options::{DEFAULT_BODY_TIMEOUT, DEFAULT_MAX_BUFFERED};
pub use path::{normalize_path, PathError};
pub use policy::{default_policy, Disposition, StatusPatternError, StatusPolicy};
pub use problem::{problem, Problem, PROBLEM_JSON, PROBLEM_TYPE_PREFIX};
pub use routes::{KeySource, PathPattern, Route, RouteError};
pub use scope::{ClientCertificate, ClientCertificateRequired, ScopeBy, CLIENT_CERT_SCOPE_TAG};
pub use service::IdempotencyService;
pub use tokens::{TokenCap, TokenIssueError, DEFAULT_MAX_LIVE_TOKENS, DEFAULT_TOKENS_PER_SCOPE};
/// The tracker of the tasks that run guarded requests (re-exported from
/// `tokio-util`), see [`IdempotencyLayer::tracker`].
pub use tokio_util::task::TaskTracker;

/// A boxed body error.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// The body type the layer hands to the inner service and returns:
/// guarded requests carry a buffered body, others stream through untouched.
pub type BoxBody = http_body_util::combinators::UnsyncBoxBody<Bytes, BoxError>;
