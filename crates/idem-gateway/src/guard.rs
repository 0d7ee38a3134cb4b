//! The store as the gateway uses it: every call bounded by
//! `--store-timeout`, and (with `--fail-open`) a memory of the keys this
//! gateway recently saw claimed, so fail-open never reruns one of them.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use idem_core::{
    Begin, BeginRequest, DynStore, IdempotencyKey, Lease, Phase, Record, Scope, Store, StoreError,
    StoredResponse,
};
use tokio::time::Instant;

/// Most keys [`Recent`] holds. Past it, expired entries are dropped; if
/// none has expired, the memory reports every key as seen (fail-open then
/// refuses everything rather than forget a key it should protect).
const RECENT_CAP: usize = 50_000;

/// A store whose every call is bounded by a deadline (a late call fails
/// with [`StoreError::Timeout`], its effect unknown), and which notes in
/// [`Recent`] the keys `begin` found claimed or done.
#[derive(Debug, Clone)]
pub(crate) struct GuardedStore {
    inner: DynStore,
    timeout: Duration,
    recent: Option<Arc<Recent>>,
}

impl GuardedStore {
    pub(crate) fn new(inner: DynStore, timeout: Duration, recent: Option<Arc<Recent>>) -> Self {
        Self {
            inner,
            timeout,
            recent,
        }
    }
}

async fn bounded<T>(
    phase: Phase,
    limit: Duration,
    fut: impl Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    match tokio::time::timeout(limit, fut).await {
        Ok(r) => r,
        Err(_) => Err(StoreError::Timeout { phase }),
    }
}

#[async_trait]
impl Store for GuardedStore {
    async fn begin(&self, req: &BeginRequest) -> Result<Begin, StoreError> {
        let r = bounded(Phase::Begin, self.timeout, self.inner.begin(req)).await;
        if let (Some(recent), Ok(b)) = (&self.recent, &r) {
            // Acquired (this gateway runs it), InFlight (someone runs it),
            // Replay (it ran): a rerun of this request would be a second
            // execution. Mismatch is another request under the same key.
            if !matches!(b, Begin::Mismatch) {
                recent.note(&req.scope, &req.key);
            }
        }
        r
    }

    async fn complete(
        &self,
        lease: &Lease,
        response: &StoredResponse,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        bounded(
            Phase::Complete,
            self.timeout,
            self.inner.complete(lease, response, ttl),
        )
        .await
    }

    async fn release(&self, lease: &Lease) -> Result<(), StoreError> {
        bounded(Phase::Release, self.timeout, self.inner.release(lease)).await
    }

    async fn extend(&self, lease: &Lease, lease_for: Duration) -> Result<Lease, StoreError> {
        bounded(
            Phase::Extend,
            self.timeout,
            self.inner.extend(lease, lease_for),
        )
        .await
    }

    async fn get(&self, scope: &Scope, key: &IdempotencyKey) -> Result<Option<Record>, StoreError> {
        bounded(Phase::Get, self.timeout, self.inner.get(scope, key)).await
    }

    async fn delete(&self, scope: &Scope, key: &IdempotencyKey) -> Result<bool, StoreError> {
        bounded(Phase::Delete, self.timeout, self.inner.delete(scope, key)).await
    }

    async fn purge_expired(&self) -> Result<u64, StoreError> {
        // A purge deletes in batches; each statement is bounded by the
        // store's own timeouts. This bound only stops a hung purge from
        // stalling the purge loop for good.
        bounded(
            Phase::Purge,
            self.timeout.saturating_mul(12),
            self.inner.purge_expired(),
        )
        .await
    }

    async fn wait_for_change(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        max: Duration,
    ) -> Result<(), StoreError> {
        bounded(
            Phase::Get,
            max.saturating_add(self.timeout),
            self.inner.wait_for_change(scope, key, max),
        )
        .await
    }
}

/// Keys this gateway saw claimed or completed within the last `window`,
/// by (scope, key). Only kept with `--fail-open`.
#[derive(Debug)]
pub(crate) struct Recent {
    window: Duration,
    seen: Mutex<HashMap<(Scope, IdempotencyKey), Instant>>,
}

impl Recent {
    pub(crate) fn new(window: Duration) -> Self {
        Self {
            window,
            seen: Mutex::new(HashMap::new()),
        }
    }

    fn note(&self, scope: &Scope, key: &IdempotencyKey) {
        let now = Instant::now();
        let Ok(mut seen) = self.seen.lock() else {
            return;
        };
        if seen.len() >= RECENT_CAP && !seen.contains_key(&(scope.clone(), key.clone())) {
            let window = self.window;
            seen.retain(|_, at| now.duration_since(*at) < window);
        }
        if seen.len() < RECENT_CAP {
            seen.insert((scope.clone(), key.clone()), now);
        }
    }

    /// Whether the key was seen claimed or done within the window. `true`
    /// as well when the memory is full of live entries (or poisoned): it
    /// cannot tell, so it answers the safe way.
    pub(crate) fn contains(&self, scope: &Scope, key: &IdempotencyKey) -> bool {
        let Ok(seen) = self.seen.lock() else {
            return true;
        };
        if seen.len() >= RECENT_CAP {
            return true;
        }
        seen.get(&(scope.clone(), key.clone()))
            .is_some_and(|at| at.elapsed() < self.window)
    }
}

/// `--fail-open` forwards a key only if this gateway did not see it
/// claimed, in flight or completed within the window: a rerun of such a
/// key would be a certain second execution.
impl idem_http::FailOpenGuard for Recent {
    fn allows(&self, scope: &Scope, key: &IdempotencyKey) -> bool {
        !self.contains(scope, key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use idem_core::{Fingerprint, MemoryStore};
    use idem_testkit::FaultyStore;

    #[tokio::test]
    async fn begin_notes_claimed_and_done_keys_but_not_mismatches() {
        let recent = Arc::new(Recent::new(Duration::from_secs(60)));
        let store = GuardedStore::new(
            Arc::new(MemoryStore::new()),
            Duration::from_secs(1),
            Some(recent.clone()),
        );
        let scope = Scope::anonymous();
        let (k1, k2) = (
            IdempotencyKey::new("a").unwrap(),
            IdempotencyKey::new("b").unwrap(),
        );
        assert!(!recent.contains(&scope, &k1));
        let req = |k: &IdempotencyKey, body: &[u8]| BeginRequest {
            scope: scope.clone(),
            key: k.clone(),
            fingerprint: Fingerprint::of(body),
            lease: Duration::from_secs(5),
        };
        assert!(matches!(
            store.begin(&req(&k1, b"x")).await.unwrap(),
            Begin::Acquired(_)
        ));
        assert!(recent.contains(&scope, &k1));
        assert!(!recent.contains(&scope, &k2));
        assert!(!recent.contains(&Scope::new("other").unwrap(), &k1));
    }

    #[tokio::test(start_paused = true)]
    async fn entries_expire_after_the_window() {
        let recent = Recent::new(Duration::from_secs(10));
        let (s, k) = (Scope::anonymous(), IdempotencyKey::new("k").unwrap());
        recent.note(&s, &k);
        tokio::time::advance(Duration::from_secs(9)).await;
        assert!(recent.contains(&s, &k));
        tokio::time::advance(Duration::from_secs(2)).await;
        assert!(!recent.contains(&s, &k));
    }

    #[tokio::test(start_paused = true)]
    async fn a_hung_store_call_times_out() {
        let store = GuardedStore::new(
            Arc::new(FaultyStore::hung()),
            Duration::from_millis(300),
            None,
        );
        let (s, k) = (Scope::anonymous(), IdempotencyKey::new("k").unwrap());
        let started = Instant::now();
        let e = store.get(&s, &k).await.unwrap_err();
        assert!(
            matches!(e, StoreError::Timeout { phase: Phase::Get }),
            "{e}"
        );
        assert_eq!(started.elapsed(), Duration::from_millis(300));
        let e = store
            .begin(&BeginRequest {
                scope: s,
                key: k,
                fingerprint: Fingerprint::of(b""),
                lease: Duration::from_secs(1),
            })
            .await
            .unwrap_err();
        assert!(
            matches!(
                e,
                StoreError::Timeout {
                    phase: Phase::Begin
                }
            ),
            "{e}"
        );
    }
}
