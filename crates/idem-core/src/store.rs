//! The store contract: atomic semantic steps on one record per scoped key.
//!
//! ```text
//!  (absent) --begin--> InProgress{fingerprint, fence, lease_until}
//!  InProgress --complete(fence)--> Completed{fingerprint, response, expires_at}
//!  InProgress --release(fence)---> (absent)            # retryable failure
//!  InProgress --lease expired, begin--> InProgress{fence'} # crash recovery, fence' > fence
//!  InProgress --hold(fence, reason)--> InProgress{held: reason}   # outcome unknown
//!  Completed --expires_at passed--> (absent)
//! ```
//!
//! Every step is ONE atomic operation in the store (one transaction, one
//! conditional statement, one Lua script) — never a read followed by a write.

pub mod admin;

use std::time::Duration;

use async_trait::async_trait;

use crate::clock::Millis;
use crate::error::StoreError;
use crate::{Fingerprint, IdempotencyKey, Scope, StoredResponse};

/// What [`Store::begin`] is asked to do.
#[derive(Debug, Clone)]
pub struct BeginRequest {
    /// Whose key.
    pub scope: Scope,
    /// The key.
    pub key: IdempotencyKey,
    /// The request's fingerprint.
    pub fingerprint: Fingerprint,
    /// How long the claim holds before another caller may take the key over.
    /// Stores keep millisecond precision: 1,500 ms is 1.5 s everywhere.
    pub lease: Duration,
}

/// A claim on a key: the right to run its operation and then `complete` or
/// `release` it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    /// Whose key.
    pub scope: Scope,
    /// The key.
    pub key: IdempotencyKey,
    /// The fencing token: strictly greater than every fence granted earlier
    /// for the same scoped key, also across expiry and purge (stores draw it
    /// from a store-wide counter or from `max(previous + 1, store time in µs)`).
    /// A resource that remembers the highest fence it saw can reject a late
    /// write from a holder that lost its lease.
    pub fence: u64,
    /// When the lease ends, by the store's clock.
    pub until: Millis,
    /// Whether this claim took the key over from an earlier holder whose
    /// lease had ended without a `complete` or `release` (crash recovery:
    /// the holder died or stalled): `true` when [`Store::begin`] found the
    /// record in progress past its lease; `false` for a fresh claim (the key
    /// was absent, released, deleted, purged, or completed and past its TTL).
    ///
    /// What the gateway counts as `idem_lease_takeovers_total`. It describes
    /// how the claim began: [`Store::extend`] returns the lease with this
    /// field unchanged.
    pub took_over: bool,
}

/// The answer of [`Store::begin`]. Refusals are values, not errors.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Begin {
    /// The key was free (absent, expired, or in flight past its lease): the
    /// caller holds it and must run the operation.
    Acquired(Lease),
    /// Another caller holds the key with the same fingerprint and its lease is live.
    InFlight {
        /// Time left on the holder's lease, by the store's clock.
        retry_after: Duration,
    },
    /// The key completed with the same fingerprint: here is its result.
    Replay(StoredResponse),
    /// The key is in flight or completed with a different fingerprint.
    Mismatch,
}

/// Why a key is held: its operation may have taken effect, but no result
/// was stored, so the key is kept in flight (duplicates get
/// [`Begin::InFlight`], another request [`Begin::Mismatch`]) instead of
/// being run again, until its lease ends or an operator settles it
/// (`idem keys release` / `idem keys complete`: [`Store::release`] /
/// [`Store::complete`] with the record's fence).
///
/// Written by [`Store::hold`]; read back by [`Store::get`] as
/// [`RecordState::InProgress::held`]. Stores keep it as its
/// [`HoldReason::as_str`] name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum HoldReason {
    /// The operation did not answer in time (the gateway answered 504).
    Timeout,
    /// The answer started, then its body broke or stalled, so it could
    /// neither be stored nor known to have had no effect.
    BrokenBody,
    /// The result could not be saved (the store failed through
    /// [`crate::EngineConfig::save_wait`]).
    SaveFailed,
    /// The connection to the operation (the upstream) failed after the
    /// request was sent, before an answer came.
    ConnectionLost,
    /// The operation's future was dropped before it finished
    /// ([`crate::EngineConfig::on_cancel`]): it may still have had its effect.
    Cancelled,
    /// The operation asked to be held ([`crate::Action::Hold`]) for a
    /// reason of its own, e.g. a result that cannot be encoded.
    Unknown,
}

impl HoldReason {
    /// Every reason, for listings and tests.
    pub const ALL: [HoldReason; 6] = [
        HoldReason::Timeout,
        HoldReason::BrokenBody,
        HoldReason::ConnectionLost,
        HoldReason::SaveFailed,
        HoldReason::Cancelled,
        HoldReason::Unknown,
    ];

    /// The stable name stores keep and tools print: `timeout`,
    /// `broken-body`, `connection-lost`, `save-failed`, `cancelled`, `unknown`.
    pub fn as_str(self) -> &'static str {
        match self {
            HoldReason::Timeout => "timeout",
            HoldReason::BrokenBody => "broken-body",
            HoldReason::ConnectionLost => "connection-lost",
            HoldReason::SaveFailed => "save-failed",
            HoldReason::Cancelled => "cancelled",
            HoldReason::Unknown => "unknown",
        }
    }

    /// The reason named `name` ([`Self::as_str`]); `None` for another name.
    pub fn parse(name: &[u8]) -> Option<Self> {
        Self::ALL
            .into_iter()
            .find(|r| r.as_str().as_bytes() == name)
    }
}

impl std::fmt::Display for HoldReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A record's state, as [`Store::get`] returns it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RecordState {
    /// Claimed and running (or its holder crashed and the lease has not ended).
    InProgress {
        /// The current fence.
        fence: u64,
        /// When the lease ends.
        lease_until: Millis,
        /// `Some` once the run ended with an unknown outcome and the key was
        /// held ([`Store::hold`]); `None` while it runs (or its holder died).
        held: Option<HoldReason>,
    },
    /// Done; replayed until `expires_at`.
    Completed {
        /// The stored result.
        response: StoredResponse,
        /// When the record is forgotten.
        expires_at: Millis,
    },
}

/// One record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// The fingerprint of the request that claimed the key.
    pub fingerprint: Fingerprint,
    /// Its state.
    pub state: RecordState,
}

/// A store of idempotency records: the atomic steps of the key protocol.
///
/// Implementations must pass the conformance suite in `idem-testkit`.
/// Time (lease ends, expiry) is the store's own clock, never the caller's.
#[async_trait]
pub trait Store: Send + Sync + std::fmt::Debug + 'static {
    /// Claims `req.key` for `req.scope`, atomically:
    /// absent / expired / in flight past its lease → [`Begin::Acquired`] with a
    /// new, larger fence; in flight with a live lease → [`Begin::InFlight`]
    /// (same fingerprint) or [`Begin::Mismatch`]; completed → [`Begin::Replay`]
    /// (same fingerprint) or [`Begin::Mismatch`].
    ///
    /// # Errors
    /// [`StoreError::Unavailable`] / [`StoreError::Timeout`] when the store
    /// cannot answer (the caller must not run the operation),
    /// [`StoreError::Corrupt`] for an undecodable record, [`StoreError::Full`]
    /// when a capped store has no room.
    async fn begin(&self, req: &BeginRequest) -> Result<Begin, StoreError>;

    /// Stores `response` for the key held by `lease` and keeps it for `ttl`
    /// (millisecond precision), only if `lease.fence` is still current.
    ///
    /// "Current" means the record is in progress with exactly this fence. A
    /// lease that has run out but was not taken over (and not purged) is
    /// still current: storing the finished result then prevents a second
    /// run. Once another caller acquired the key, or the record was purged,
    /// the fence is stale. The same rule holds for `release` and `extend`.
    ///
    /// # Errors
    /// [`StoreError::LeaseLost`] when the fence is not current (nothing is
    /// written); availability errors as for `begin` — after a timeout the
    /// outcome is unknown and the key must be left to its lease, never released.
    async fn complete(
        &self,
        lease: &Lease,
        response: &StoredResponse,
        ttl: Duration,
    ) -> Result<(), StoreError>;

    /// Frees the key held by `lease` (a retryable failure), only if its fence
    /// is still current.
    ///
    /// # Errors
    /// [`StoreError::LeaseLost`] when the fence is not current; availability errors.
    async fn release(&self, lease: &Lease) -> Result<(), StoreError>;

    /// Moves the end of the lease to store-now + `lease`, only if the fence
    /// is still current and the record is in progress. Returns the renewed lease.
    ///
    /// # Errors
    /// [`StoreError::LeaseLost`] when the fence is not current or the key
    /// completed; availability errors.
    async fn extend(&self, lease: &Lease, lease_for: Duration) -> Result<Lease, StoreError>;

    /// Holds the key of a run whose outcome is unknown: marks the record
    /// held by `lease` with `reason` and moves its lease end to
    /// `max(current end, store-now + hold_for)` (millisecond precision; a
    /// zero `hold_for` keeps the end). Only while the fence is current and
    /// the record is in progress. Returns the lease with its new end.
    ///
    /// A held record answers `begin` as any in-flight record does; once its
    /// lease ends the same request may take it over (and the mark is
    /// gone). An operator settles it earlier with [`Store::release`] or
    /// [`Store::complete`] under the record's fence.
    ///
    /// # Errors
    /// [`StoreError::LeaseLost`] when the fence is not current or the key
    /// completed; availability errors.
    async fn hold(
        &self,
        lease: &Lease,
        reason: HoldReason,
        hold_for: Duration,
    ) -> Result<Lease, StoreError>;

    /// Reads a record; `None` when absent or expired.
    ///
    /// # Errors
    /// Availability errors; [`StoreError::Corrupt`].
    async fn get(&self, scope: &Scope, key: &IdempotencyKey) -> Result<Option<Record>, StoreError>;

    /// Deletes a record whatever its state (an operator's tool). Returns
    /// whether one existed.
    ///
    /// # Errors
    /// Availability errors.
    async fn delete(&self, scope: &Scope, key: &IdempotencyKey) -> Result<bool, StoreError>;

    /// Removes expired records (completed past `expires_at`, in progress past
    /// their lease). Returns how many were removed.
    ///
    /// An expired record already reads as absent; this frees its space.
    /// Nothing in this crate calls it: the gateway does every
    /// `GatewayConfig::purge_interval` (60 s), a library user calls it on a
    /// timer of their own. Until then the SQL stores keep expired rows, the
    /// Redis store's records also drop by themselves after its
    /// `keep_expired`, and [`crate::MemoryStore`] evicts expired records
    /// when it needs room.
    ///
    /// # Errors
    /// Availability errors.
    async fn purge_expired(&self) -> Result<u64, StoreError>;

    /// Waits until the record of an in-flight key may have changed (completed,
    /// released, taken over), or `max` has passed, whichever is first. A
    /// caller in wait mode calls `begin` again after it returns. Spurious
    /// early returns are allowed. The default sleeps `min(max, 50 ms)`
    /// (bounded polling); stores with notifications override it.
    ///
    /// # Errors
    /// Availability errors of the notification channel.
    async fn wait_for_change(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        max: Duration,
    ) -> Result<(), StoreError> {
        let _ = (scope, key);
        tokio::time::sleep(max.min(Duration::from_millis(50))).await;
        Ok(())
    }

    /// The store's listing capability ([`crate::admin`]), if it has one.
    /// Wrappers (timeouts, fault injection) must pass it through. The
    /// default is `None`.
    fn admin(&self) -> Option<&dyn crate::KeyAdmin> {
        None
    }
}

#[async_trait]
impl<S: Store + ?Sized> Store for std::sync::Arc<S> {
    async fn begin(&self, req: &BeginRequest) -> Result<Begin, StoreError> {
        (**self).begin(req).await
    }
    async fn complete(
        &self,
        lease: &Lease,
        response: &StoredResponse,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        (**self).complete(lease, response, ttl).await
    }
    async fn release(&self, lease: &Lease) -> Result<(), StoreError> {
        (**self).release(lease).await
    }
    async fn extend(&self, lease: &Lease, lease_for: Duration) -> Result<Lease, StoreError> {
        (**self).extend(lease, lease_for).await
    }
    async fn hold(
        &self,
        lease: &Lease,
        reason: HoldReason,
        hold_for: Duration,
    ) -> Result<Lease, StoreError> {
        (**self).hold(lease, reason, hold_for).await
    }
    async fn get(&self, scope: &Scope, key: &IdempotencyKey) -> Result<Option<Record>, StoreError> {
        (**self).get(scope, key).await
    }
    async fn delete(&self, scope: &Scope, key: &IdempotencyKey) -> Result<bool, StoreError> {
        (**self).delete(scope, key).await
    }
    async fn purge_expired(&self) -> Result<u64, StoreError> {
        (**self).purge_expired().await
    }
    async fn wait_for_change(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        max: Duration,
    ) -> Result<(), StoreError> {
        (**self).wait_for_change(scope, key, max).await
    }
    fn admin(&self) -> Option<&dyn crate::KeyAdmin> {
        (**self).admin()
    }
}

/// A type-erased, shareable store (what the gateway holds).
pub type DynStore = std::sync::Arc<dyn Store>;
