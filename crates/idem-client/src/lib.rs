//! # idem-client
//!
//! A tower [`Layer`](tower_layer::Layer) for Rust services that **call**
//! idempotent HTTP APIs (an API behind `idem gateway`, Stripe-style APIs):
//! every logical request gets one idempotency key, and every retry of it
//! carries that same key, so a retry after a lost response gets the stored
//! answer instead of running the operation a second time.
//!
//! It follows the IETF httpapi draft "The Idempotency-Key HTTP Header
//! Field" (the header, its syntax, 409 for a request still in flight, 422
//! for a key reused with another request) and RFC 9110 (§10.2.3
//! `Retry-After`, §15.6 server errors). Per request whose method is keyed
//! (POST and PATCH by default), [`IdempotentService`]:
//!
//! | outcome of an attempt | what happens |
//! |---|---|
//! | 2xx, 3xx, 400, 422, a 409 without `Retry-After`, any other 4xx but 429 | returned as it is (final) |
//! | `Idempotent-Replayed: true` | returned, with [`Replayed`]`(true)`: treat it as success |
//! | 409 with `Retry-After` (still in flight), 429 | retried after `Retry-After` (bounded), else the backoff |
//! | 5xx except 501, 505 (502, 503, 504 included) | retried after the backoff (or `Retry-After`) |
//! | connection error, closed before the answer | retried after the backoff |
//! | no response headers within the attempt timeout | dropped, retried after the backoff |
//! | attempts or deadline used up | [`Error::AttemptsExhausted`] / [`Error::DeadlineExceeded`], naming the attempts and the last outcome |
//!
//! The request body is **buffered once** into [`bytes::Bytes`] (up to
//! [`IdempotentLayer::with_max_body`], 10 MiB by default) so it can be sent
//! again; the inner service takes `Request<Full<Bytes>>`. Response bodies
//! are not buffered. Defaults are in [`RetryPolicy`] (5 attempts, 30 s in
//! all, 10 s per attempt, backoff from 100 ms to 5 s, `Retry-After` up to
//! 10 s).
//!
//! ## With hyper-util's client
//!
//! ```no_run
//! use bytes::Bytes;
//! use http_body_util::{BodyExt, Full};
//! use hyper_util::client::legacy::Client;
//! use hyper_util::rt::TokioExecutor;
//! use idem_client::{Attempts, IdempotentLayer, Replayed};
//! use tower::{ServiceBuilder, ServiceExt};
//!
//! # async fn pay() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! let http = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
//! let client = ServiceBuilder::new()
//!     .layer(IdempotentLayer::new())
//!     .service(http);
//!
//! let request = http::Request::post("http://127.0.0.1:8080/orders/1/pay")
//!     .header("content-type", "application/json")
//!     .body(Full::new(Bytes::from_static(br#"{"amount":1200}"#)))?;
//! // One logical request: `oneshot` on a clone (the clones share hyper's pool).
//! let response = client.clone().oneshot(request).await?;
//! let replayed = response.extensions().get::<Replayed>().is_some_and(|r| r.0);
//! let attempts = response.extensions().get::<Attempts>().map_or(1, |a| a.0);
//! println!("{} after {attempts} attempt(s), replayed: {replayed}", response.status());
//! let body = response.into_body().collect().await?.to_bytes();
//! # let _ = body;
//! # Ok(())
//! # }
//! ```
//!
//! ## The same key on every attempt
//!
//! Any `Service<Request<Full<Bytes>>>` can be wrapped; here one that fails
//! the first attempt with 503, then answers 201 only to the key it saw
//! first:
//!
//! ```
//! use std::sync::{Arc, Mutex};
//! use std::time::Duration;
//! use bytes::Bytes;
//! use http_body_util::Full;
//! use idem_client::{Attempts, IdempotentLayer, RetryPolicy};
//! use tower::{service_fn, Layer, ServiceExt};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let seen = Arc::new(Mutex::new(Vec::<String>::new()));
//! let server = {
//!     let seen = seen.clone();
//!     service_fn(move |req: http::Request<Full<Bytes>>| {
//!         let seen = seen.clone();
//!         async move {
//!             let key = req.headers()["idempotency-key"].to_str().unwrap().to_owned();
//!             let mut seen = seen.lock().unwrap();
//!             seen.push(key.clone());
//!             let status = if seen.len() == 1 { 503 } else if key == seen[0] { 201 } else { 422 };
//!             Ok::<_, std::convert::Infallible>(
//!                 http::Response::builder().status(status).body(()).unwrap(),
//!             )
//!         }
//!     })
//! };
//! let policy = RetryPolicy::default().with_base_delay(Duration::from_millis(1));
//! let client = IdempotentLayer::new().with_policy(policy).layer(server);
//!
//! let request = http::Request::post("http://api.example/orders")
//!     .body(Full::new(Bytes::from_static(b"{}")))
//!     .unwrap();
//! let response = client.oneshot(request).await.unwrap();
//! assert_eq!(response.status(), 201);
//! assert_eq!(response.extensions().get::<Attempts>(), Some(&Attempts(2)));
//! let seen = seen.lock().unwrap();
//! assert_eq!(seen[0], seen[1], "the retry carried the first attempt's key");
//! # }
//! ```
#![forbid(unsafe_code)]

mod config;
mod error;
mod key;
mod layer;
mod policy;
pub mod retry_after;
mod service;

pub use config::{DEFAULT_MAX_BODY, IDEMPOTENCY_KEY, IDEMPOTENT_REPLAYED};
pub use error::{BoxError, Error, Failure};
pub use key::{IdempotencyKey, InvalidKey, MAX_KEY_LEN};
pub use layer::IdempotentLayer;
pub use policy::{
    is_retryable, is_retryable_response, RetryPolicy, DEFAULT_ATTEMPT_TIMEOUT, DEFAULT_BASE_DELAY,
    DEFAULT_DEADLINE, DEFAULT_MAX_ATTEMPTS, DEFAULT_MAX_DELAY, DEFAULT_MAX_RETRY_AFTER,
};
pub use service::{Attempts, IdempotentService, Replayed, ResponseFuture};
