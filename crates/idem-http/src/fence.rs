//! The lease's fencing token, handed to the code that runs a guarded
//! request.
//!
//! Every claim of a key gets a fence strictly greater than every fence
//! granted before for the same scoped key ([`idem_core::Lease::fence`]).
//! When a run's outcome is unknown (a timeout, a crashed gateway) and the
//! key is later taken over, the later run has the higher fence. A service
//! that remembers the highest fence it saw per key, and refuses a write
//! with a lower one, cannot be written to by a run that lost its key.
//!
//! - In process: the layer puts [`Fence`] into the request's extensions
//!   before it calls the inner service (`req.extensions().get::<Fence>()`).
//! - Over HTTP: `idem gateway` sends it to the upstream as
//!   [`IDEMPOTENCY_FENCE`] (`Idempotency-Fence: <u64 in decimal>`) on every
//!   guarded request, and removes any `Idempotency-Fence` a client sent, on
//!   every request, so the upstream sees only fences the gateway granted.
//!
//! Requests that are not guarded (no key, an unguarded method, or
//! forwarded by `--fail-open` while the store is down) carry no fence.

use http::HeaderName;

/// The request field that carries the fence to an upstream:
/// `Idempotency-Fence: <u64>` (decimal, no sign, no leading zeros).
pub const IDEMPOTENCY_FENCE: HeaderName = HeaderName::from_static("idempotency-fence");

/// The fencing token of the lease under which a guarded request runs: in
/// the request's extensions when the layer calls the inner service.
///
/// Ordered: a later claim of the same scoped key always has a greater one.
/// Fences of different keys are not comparable.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Fence(pub u64);

impl Fence {
    /// The fence as the [`IDEMPOTENCY_FENCE`] field value.
    pub fn header_value(self) -> http::HeaderValue {
        http::HeaderValue::from(self.0)
    }
}
