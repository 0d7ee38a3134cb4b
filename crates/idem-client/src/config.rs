//! The layer's settings, shared by the layer and its services.

use http::{HeaderName, Method};

use crate::policy::RetryPolicy;

/// Default [`crate::IdempotentLayer::with_max_body`]: 10 MiB, the gateway's
/// default `--max-body`.
pub const DEFAULT_MAX_BODY: usize = 10 * 1024 * 1024;

/// The default key header, `Idempotency-Key` (IETF httpapi draft "The
/// Idempotency-Key HTTP Header Field" §2).
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// The header a server marks a replayed response with (`true`), as idem
/// and Stripe do.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

#[derive(Clone, Debug)]
pub(crate) struct Config {
    pub(crate) header: HeaderName,
    pub(crate) methods: Vec<Method>,
    pub(crate) policy: RetryPolicy,
    pub(crate) max_body: usize,
    pub(crate) quoted: bool,
}
