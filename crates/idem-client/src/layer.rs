//! [`IdempotentLayer`]: its builders, and the layer that wraps a client.

use std::sync::Arc;

use http::{HeaderName, Method};
use tower_layer::Layer;

use crate::config::{Config, DEFAULT_MAX_BODY, IDEMPOTENCY_KEY};
use crate::policy::RetryPolicy;
use crate::service::IdempotentService;

/// A tower [`Layer`] that gives every keyed request (POST and PATCH by
/// default) an idempotency key and retries it, with that same key, until
/// it gets a final answer — see [`IdempotentService`] for what it does
/// per request.
///
/// Defaults: header [`IDEMPOTENCY_KEY`], methods POST and PATCH (the
/// draft's non-idempotent methods), [`RetryPolicy::default`], bodies
/// buffered up to [`DEFAULT_MAX_BODY`] (10 MiB), keys sent bare.
///
/// ```
/// use std::time::Duration;
/// use http::Method;
/// use idem_client::{IdempotentLayer, RetryPolicy};
///
/// let layer = IdempotentLayer::new()
///     .with_header_name(http::HeaderName::from_static("x-request-id"))
///     .with_methods([Method::POST, Method::PUT, Method::PATCH, Method::DELETE])
///     .with_policy(RetryPolicy::default().with_deadline(Duration::from_secs(10)));
/// # let _ = layer;
/// ```
#[derive(Clone, Debug)]
pub struct IdempotentLayer {
    config: Arc<Config>,
}

impl Default for IdempotentLayer {
    fn default() -> Self {
        Self::new()
    }
}

impl IdempotentLayer {
    /// A layer with the defaults above.
    pub fn new() -> Self {
        Self {
            config: Arc::new(Config {
                header: IDEMPOTENCY_KEY,
                methods: vec![Method::POST, Method::PATCH],
                policy: RetryPolicy::default(),
                max_body: DEFAULT_MAX_BODY,
                quoted: false,
            }),
        }
    }

    fn edit(mut self, f: impl FnOnce(&mut Config)) -> Self {
        f(Arc::make_mut(&mut self.config));
        self
    }

    /// The key header's name (default `Idempotency-Key`; e.g. `X-Request-Id`
    /// for APIs with their own name).
    pub fn with_header_name(self, header: HeaderName) -> Self {
        self.edit(|c| c.header = header)
    }

    /// The methods that get a key and are retried (default POST and PATCH).
    /// Requests of other methods are sent once, as they are, without a
    /// key: a retry of a request without a key could run it twice.
    pub fn with_methods(self, methods: impl IntoIterator<Item = Method>) -> Self {
        let methods = methods.into_iter().collect();
        self.edit(|c| c.methods = methods)
    }

    /// Attempts, deadline, timeouts and backoff (default [`RetryPolicy::default`]).
    pub fn with_policy(self, policy: RetryPolicy) -> Self {
        self.edit(|c| c.policy = policy)
    }

    /// The largest request body buffered for retries, in bytes (default
    /// [`DEFAULT_MAX_BODY`], 10 MiB). A larger body fails with
    /// [`crate::Error::BodyTooLarge`] before anything is sent.
    pub fn with_max_body(self, bytes: usize) -> Self {
        self.edit(|c| c.max_body = bytes)
    }

    /// Send generated and extension keys as an RFC 8941 sf-string
    /// (`Idempotency-Key: "8e03…"`), the draft's syntax (default false: the
    /// bare key, `Idempotency-Key: 8e03…`, as Stripe-style APIs expect; idem
    /// accepts both).
    pub fn with_quoted_key(self, quoted: bool) -> Self {
        self.edit(|c| c.quoted = quoted)
    }
}

impl<S> Layer<S> for IdempotentLayer {
    type Service = IdempotentService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        IdempotentService::new(inner, self.config.clone())
    }
}
