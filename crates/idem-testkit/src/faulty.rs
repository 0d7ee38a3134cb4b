//! A store wrapper that fails the save phase on demand.

use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use idem_core::{
    Begin, BeginRequest, IdempotencyKey, Lease, Phase, Record, Scope, Store, StoreError,
    StoredResponse,
};

/// Which failure a [`FaultyStore`] injects.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Pass every call through.
    None,
    /// `complete` fails with [`StoreError::Unavailable`] without writing.
    CompleteUnavailable,
    /// `complete` fails with [`StoreError::Timeout`] without writing.
    CompleteTimeout,
    /// `release` fails with [`StoreError::Unavailable`] without writing.
    ReleaseUnavailable,
}

impl Fault {
    fn to_u8(self) -> u8 {
        match self {
            Fault::None => 0,
            Fault::CompleteUnavailable => 1,
            Fault::CompleteTimeout => 2,
            Fault::ReleaseUnavailable => 3,
        }
    }

    fn from_u8(v: u8) -> Self {
        match v {
            1 => Fault::CompleteUnavailable,
            2 => Fault::CompleteTimeout,
            3 => Fault::ReleaseUnavailable,
            _ => Fault::None,
        }
    }
}

/// Wraps a store and makes `complete` or `release` fail on demand, to test
/// what callers do when saving a result fails. Clones share the fault
/// setting and the call counters.
#[derive(Debug, Clone)]
pub struct FaultyStore<S> {
    inner: S,
    fault: Arc<AtomicU8>,
    completes: Arc<AtomicU64>,
    releases: Arc<AtomicU64>,
}

impl<S> FaultyStore<S> {
    /// Wraps `inner`, passing every call through until [`Self::set_fault`].
    pub fn new(inner: S) -> Self {
        Self {
            inner,
            fault: Arc::new(AtomicU8::new(0)),
            completes: Arc::new(AtomicU64::new(0)),
            releases: Arc::new(AtomicU64::new(0)),
        }
    }

    /// Sets the failure injected from now on.
    pub fn set_fault(&self, fault: Fault) {
        self.fault.store(fault.to_u8(), Ordering::SeqCst);
    }

    /// How many times `complete` was called (failed calls included).
    pub fn complete_calls(&self) -> u64 {
        self.completes.load(Ordering::SeqCst)
    }

    /// How many times `release` was called (failed calls included).
    pub fn release_calls(&self) -> u64 {
        self.releases.load(Ordering::SeqCst)
    }

    fn fault(&self) -> Fault {
        Fault::from_u8(self.fault.load(Ordering::SeqCst))
    }
}

/// The error injected for `Unavailable` faults.
#[derive(Debug)]
struct Injected;

impl std::fmt::Display for Injected {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("injected fault")
    }
}

impl std::error::Error for Injected {}

#[async_trait]
impl<S: Store + Clone> Store for FaultyStore<S> {
    async fn begin(&self, req: &BeginRequest) -> Result<Begin, StoreError> {
        self.inner.begin(req).await
    }

    async fn complete(
        &self,
        lease: &Lease,
        response: &StoredResponse,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        self.completes.fetch_add(1, Ordering::SeqCst);
        match self.fault() {
            Fault::CompleteUnavailable => Err(StoreError::unavailable(Phase::Complete, Injected)),
            Fault::CompleteTimeout => Err(StoreError::Timeout {
                phase: Phase::Complete,
            }),
            _ => self.inner.complete(lease, response, ttl).await,
        }
    }

    async fn release(&self, lease: &Lease) -> Result<(), StoreError> {
        self.releases.fetch_add(1, Ordering::SeqCst);
        match self.fault() {
            Fault::ReleaseUnavailable => Err(StoreError::unavailable(Phase::Release, Injected)),
            _ => self.inner.release(lease).await,
        }
    }

    async fn extend(&self, lease: &Lease, lease_for: Duration) -> Result<Lease, StoreError> {
        self.inner.extend(lease, lease_for).await
    }

    async fn get(&self, scope: &Scope, key: &IdempotencyKey) -> Result<Option<Record>, StoreError> {
        self.inner.get(scope, key).await
    }

    async fn delete(&self, scope: &Scope, key: &IdempotencyKey) -> Result<bool, StoreError> {
        self.inner.delete(scope, key).await
    }

    async fn purge_expired(&self) -> Result<u64, StoreError> {
        self.inner.purge_expired().await
    }

    async fn wait_for_change(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        max: Duration,
    ) -> Result<(), StoreError> {
        self.inner.wait_for_change(scope, key, max).await
    }
}
