//! The store as the gateway uses it: every call bounded by
//! `--store-timeout`, and (with `--fail-open`) a memory of the keys this
//! gateway recently saw claimed, so fail-open never reruns one of them.
//!
//! A `begin` cut off by the timeout has an unknown outcome: the claim may
//! still land in the store (the script or statement was already sent).
//! Left alone, such a ghost claim answers every retry with 409 "in flight"
//! for a whole lease although nothing runs. So `begin` runs on a task of
//! its own that the timeout never cancels: the caller waits for it up to
//! the timeout, and when the caller has given up (timed out or gone) and
//! the store later answers [`Begin::Acquired`], the task releases that
//! claim at once — by its fence, so only this claim, never a newer one
//! ([`Store::release`] with a stale lease is [`StoreError::LeaseLost`] and
//! writes nothing, on every store). `release` runs the same way: one cut
//! off by the timeout goes on, and is retried while the store fails.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use idem_core::{
    Begin, BeginRequest, DynStore, HoldReason, IdempotencyKey, Lease, Phase, Record, Scope, Store,
    StoreError, StoredResponse,
};
use tokio::sync::oneshot;
use tokio::time::Instant;

/// Most keys [`Recent`] holds. Past it, expired entries are dropped; if
/// none has expired, the memory reports every key as seen (fail-open then
/// refuses everything rather than forget a key it should protect).
const RECENT_CAP: usize = 50_000;

/// Most `begin`/`release` calls running on their own tasks at once. A
/// store that answers keeps this near the request rate times its latency;
/// a hung one fills it (each task ends by [`settle_window`]). Past it, calls
/// run on the caller's task as plain bounded calls (a timed-out `begin` may
/// then leave a ghost claim for its lease).
const DETACHED_CAP: usize = 10_000;

/// How many times a claim whose caller gave up is released while the
/// store keeps failing (the first try included).
const RELEASE_ATTEMPTS: u32 = 5;

/// The pause before the second release attempt; doubled before each next
/// one (100, 200, 400, 800 ms).
const RELEASE_BACKOFF: Duration = Duration::from_millis(100);

/// How long a detached `begin` or `release` may run in all: the store's
/// own deadlines (PostgreSQL's and MySQL's client-side deadline of about
/// `2 × timeout + 2 s`, Redis's response timeout, see
/// `open_store_with`) end it first; this bound is for stores without one
/// (a store passed to `Gateway::bind_with_store`). At least the lease: a
/// claim that lands later than that still holds for a full lease.
fn settle_window(timeout: Duration, lease: Duration) -> Duration {
    timeout
        .saturating_mul(2)
        .saturating_add(Duration::from_secs(2))
        .max(lease)
}

/// A store whose every call is bounded by a deadline (a late call fails
/// with [`StoreError::Timeout`], its effect unknown), and which notes in
/// [`Recent`] the keys `begin` found claimed or done. `begin` and
/// `release` go on after their caller's deadline (see the module docs).
#[derive(Debug, Clone)]
pub(crate) struct GuardedStore {
    inner: DynStore,
    timeout: Duration,
    recent: Option<Arc<Recent>>,
    /// `begin`/`release` calls now running on their own tasks.
    detached: Arc<AtomicUsize>,
}

impl GuardedStore {
    pub(crate) fn new(inner: DynStore, timeout: Duration, recent: Option<Arc<Recent>>) -> Self {
        Self {
            inner,
            timeout,
            recent,
            detached: Arc::new(AtomicUsize::new(0)),
        }
    }

    /// A slot for one more detached call, or `None` at [`DETACHED_CAP`].
    fn detach_slot(&self) -> Option<Slot> {
        let n = self.detached.fetch_add(1, Ordering::SeqCst);
        let slot = Slot(self.detached.clone());
        (n < DETACHED_CAP).then_some(slot)
    }

    /// Claims on a task of its own, waiting for it up to the timeout (see
    /// the module docs).
    async fn begin_detached(&self, req: &BeginRequest) -> Result<Begin, StoreError> {
        let Some(slot) = self.detach_slot() else {
            tracing::warn!(
                limit = DETACHED_CAP,
                "too many store calls outlived their callers; this begin is cut off at the \
                 store timeout and may leave a claim for its lease"
            );
            return bounded(Phase::Begin, self.timeout, self.inner.begin(req)).await;
        };
        let (tx, rx) = oneshot::channel();
        let (inner, recent, timeout) = (self.inner.clone(), self.recent.clone(), self.timeout);
        let window = settle_window(timeout, req.lease);
        let req = req.clone();
        tokio::spawn(async move {
            let _slot = slot;
            let r = bounded(Phase::Begin, window, inner.begin(&req)).await;
            // `send` hands the answer back when the caller no longer waits.
            if let Err(Ok(Begin::Acquired(lease))) = tx.send(r) {
                settle_ghost(&inner, lease, timeout, recent.as_deref()).await;
            }
        });
        wait_for(Phase::Begin, self.timeout, rx).await
    }
}

/// Decrements the detached-call count when the call ends.
#[derive(Debug)]
struct Slot(Arc<AtomicUsize>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
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

/// Waits up to `limit` for a detached call's answer. On giving up it closes
/// the channel first, so an answer is either taken here or handed back to
/// the task's `send` — never lost in between.
async fn wait_for<T>(
    phase: Phase,
    limit: Duration,
    mut rx: oneshot::Receiver<Result<T, StoreError>>,
) -> Result<T, StoreError> {
    match tokio::time::timeout(limit, &mut rx).await {
        Ok(Ok(r)) => r,
        // The task ended without an answer (it panicked): unknown.
        Ok(Err(_)) => Err(StoreError::Timeout { phase }),
        Err(_) => {
            rx.close();
            rx.try_recv().unwrap_or(Err(StoreError::Timeout { phase }))
        }
    }
}

/// A claim acquired after its caller gave up: nothing will run under it.
/// It is released (by its fence, so never a newer claim), the release
/// retried with backoff while the store fails — unless fail-open forwarded
/// that request unprotected meanwhile: then it did run, and the claim is
/// kept, so retries get 409 until its lease ends rather than a second run.
async fn settle_ghost(inner: &DynStore, lease: Lease, timeout: Duration, recent: Option<&Recent>) {
    let fence = lease.fence;
    if let Some(recent) = recent {
        // It was claimed: with the store down again, fail-open must not
        // forward this key.
        recent.note(&lease.scope, &lease.key);
        if recent.forwarded(&lease.scope, &lease.key) {
            tracing::warn!(
                key = %lease.key, fence,
                "a begin answered after its store timeout: the claim landed, but fail-open \
                 already forwarded this request unprotected; keeping the claim until its \
                 lease ends so a retry is not run again"
            );
            return;
        }
    }
    tracing::warn!(
        key = %lease.key, fence,
        "a begin answered after its store timeout (the client was told the request did not \
         run): releasing that claim"
    );
    if release_retried(inner, &lease, timeout).await {
        tracing::info!(key = %lease.key, fence, "released the claim of a begin that timed out");
    }
}

/// Releases `lease`, each attempt bounded by `timeout`, up to
/// [`RELEASE_ATTEMPTS`] times while the store fails ([`StoreError::Timeout`]
/// or [`StoreError::Unavailable`]); whether the claim is gone.
/// [`StoreError::LeaseLost`] is success
/// enough: the claim is gone already (released, expired and taken over, or
/// purged) and a newer one is never touched.
async fn release_retried(inner: &DynStore, lease: &Lease, timeout: Duration) -> bool {
    let mut pause = RELEASE_BACKOFF;
    let mut attempt = 1;
    loop {
        match bounded(Phase::Release, timeout, inner.release(lease)).await {
            Ok(()) => return true,
            Err(StoreError::LeaseLost { .. }) => {
                tracing::debug!(key = %lease.key, fence = lease.fence, "the claim was gone already");
                return true;
            }
            Err(e @ (StoreError::Timeout { .. } | StoreError::Unavailable { .. }))
                if attempt < RELEASE_ATTEMPTS =>
            {
                tracing::debug!(key = %lease.key, fence = lease.fence, attempt, error = %e, "release failed; retrying");
                tokio::time::sleep(pause).await;
                pause = pause.saturating_mul(2);
                attempt += 1;
            }
            Err(e) => {
                tracing::warn!(
                    key = %lease.key, fence = lease.fence, attempts = attempt, error = %e,
                    "releasing a claim failed; it frees itself when its lease ends"
                );
                return false;
            }
        }
    }
}

#[async_trait]
impl Store for GuardedStore {
    async fn begin(&self, req: &BeginRequest) -> Result<Begin, StoreError> {
        let r = self.begin_detached(req).await;
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

    // A `complete` cut off by the timeout may still land: the result is
    // then stored and duplicates get it replayed, which is what a
    // completed run should give. If it does not land, the engine retries
    // the save (renewing the lease) and duplicates get 409 while a run's
    // result is pending — true, not a ghost. No detaching needed.
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

    // A release the timeout cuts off would leave the key claimed for the
    // rest of its lease with nothing running: it goes on on its own task,
    // and is retried there while the store fails.
    async fn release(&self, lease: &Lease) -> Result<(), StoreError> {
        let Some(slot) = self.detach_slot() else {
            return bounded(Phase::Release, self.timeout, self.inner.release(lease)).await;
        };
        let (tx, rx) = oneshot::channel();
        let (inner, timeout) = (self.inner.clone(), self.timeout);
        let window = settle_window(timeout, Duration::ZERO);
        let lease = lease.clone();
        tokio::spawn(async move {
            let _slot = slot;
            let r = bounded(Phase::Release, window, inner.release(&lease)).await;
            if let Err(Err(StoreError::Timeout { .. } | StoreError::Unavailable { .. })) =
                tx.send(r)
            {
                release_retried(&inner, &lease, timeout).await;
            }
        });
        wait_for(Phase::Release, self.timeout, rx).await
    }

    // An `extend` cut off by the timeout that lands later only moves the
    // end of this run's own lease (the fence must be current); the
    // watchdog renews again or the lease runs out. No detaching needed.
    async fn extend(&self, lease: &Lease, lease_for: Duration) -> Result<Lease, StoreError> {
        bounded(
            Phase::Extend,
            self.timeout,
            self.inner.extend(lease, lease_for),
        )
        .await
    }

    // A `hold` cut off by the timeout that lands later only marks this
    // run's own record (the fence must be current) and moves its lease end
    // forward; until it lands the key is in flight all the same.
    async fn hold(
        &self,
        lease: &Lease,
        reason: HoldReason,
        hold_for: Duration,
    ) -> Result<Lease, StoreError> {
        bounded(
            Phase::Hold,
            self.timeout,
            self.inner.hold(lease, reason, hold_for),
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

    fn admin(&self) -> Option<&dyn idem_core::KeyAdmin> {
        // Listing is not bounded here: the admin API bounds each call itself.
        self.inner.admin()
    }
}

/// Keys this gateway saw claimed or completed within the last `window`,
/// by (scope, key), and the keys fail-open forwarded unprotected. Only
/// kept with `--fail-open`.
#[derive(Debug)]
pub(crate) struct Recent {
    /// Seen claimed (also a claim that landed after its caller gave up and
    /// was released: fail-open still treats that key as seen) or done.
    seen: Memory,
    /// Forwarded unprotected by fail-open: a claim of such a key that lands
    /// late is kept, not released (see [`GuardedStore`]).
    forwarded: Memory,
}

impl Recent {
    pub(crate) fn new(window: Duration) -> Self {
        Self {
            seen: Memory::new(window),
            forwarded: Memory::new(window),
        }
    }

    fn note(&self, scope: &Scope, key: &IdempotencyKey) {
        self.seen.note(scope, key);
    }

    /// Whether the key was seen claimed or done within the window. `true`
    /// as well when the memory is full of live entries (or poisoned): it
    /// cannot tell, so it answers the safe way.
    pub(crate) fn contains(&self, scope: &Scope, key: &IdempotencyKey) -> bool {
        self.seen.contains(scope, key)
    }

    /// Whether fail-open forwarded the key unprotected within the window
    /// (`true` as well when it cannot tell: the claim is then kept).
    fn forwarded(&self, scope: &Scope, key: &IdempotencyKey) -> bool {
        self.forwarded.contains(scope, key)
    }
}

/// Keys noted within the last `window`, at most [`RECENT_CAP`].
#[derive(Debug)]
struct Memory {
    window: Duration,
    at: Mutex<HashMap<(Scope, IdempotencyKey), Instant>>,
}

impl Memory {
    fn new(window: Duration) -> Self {
        Self {
            window,
            at: Mutex::new(HashMap::new()),
        }
    }

    fn note(&self, scope: &Scope, key: &IdempotencyKey) {
        let now = Instant::now();
        let Ok(mut at) = self.at.lock() else {
            return;
        };
        if at.len() >= RECENT_CAP && !at.contains_key(&(scope.clone(), key.clone())) {
            let window = self.window;
            at.retain(|_, t| now.duration_since(*t) < window);
        }
        if at.len() < RECENT_CAP {
            at.insert((scope.clone(), key.clone()), now);
        }
    }

    /// Whether the key was noted within the window; `true` when the memory
    /// is full of live entries or poisoned.
    fn contains(&self, scope: &Scope, key: &IdempotencyKey) -> bool {
        let Ok(at) = self.at.lock() else {
            return true;
        };
        if at.len() >= RECENT_CAP {
            return true;
        }
        at.get(&(scope.clone(), key.clone()))
            .is_some_and(|t| t.elapsed() < self.window)
    }
}

/// `--fail-open` forwards a key only if this gateway did not see it
/// claimed, in flight or completed within the window, and did not already
/// forward it unprotected within the window: a rerun of such a key would
/// be a certain second execution (a retry of a request fail-open let
/// through gets 503, as without fail-open). A key it lets through is noted
/// as forwarded (so a late-landing claim of it is kept).
impl idem_http::FailOpenGuard for Recent {
    fn allows(&self, scope: &Scope, key: &IdempotencyKey) -> bool {
        let allowed = !self.contains(scope, key) && !self.forwarded(scope, key);
        if allowed {
            self.forwarded.note(scope, key);
        }
        allowed
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use idem_core::{Fingerprint, ManualClock, MemoryStore};
    use idem_http::FailOpenGuard;
    use idem_testkit::faulty::{Fault, Op};
    use idem_testkit::FaultyStore;

    const TIMEOUT: Duration = Duration::from_millis(300);

    fn claim(key: &str, lease: Duration) -> BeginRequest {
        BeginRequest {
            scope: Scope::anonymous(),
            key: IdempotencyKey::new(key).unwrap(),
            fingerprint: Fingerprint::of(b"charge 10"),
            lease,
        }
    }

    /// A guarded memory store (with `recent`) whose next `begin` claims the
    /// key at once but answers only after 2 s, far past the 300 ms timeout
    /// (a claim on the wire when the store stalled).
    fn slow_begin(recent: Option<Arc<Recent>>) -> (FaultyStore<MemoryStore>, GuardedStore) {
        let faulty = FaultyStore::new(MemoryStore::new());
        faulty.set_times(Op::Begin, Fault::DelayAnswer(Duration::from_secs(2)), 1);
        let guarded = GuardedStore::new(Arc::new(faulty.clone()), TIMEOUT, recent);
        (faulty, guarded)
    }

    async fn timed_out_begin(store: &GuardedStore, req: &BeginRequest) {
        let started = Instant::now();
        let e = store.begin(req).await.unwrap_err();
        assert!(
            matches!(
                e,
                StoreError::Timeout {
                    phase: Phase::Begin
                }
            ),
            "{e}"
        );
        assert_eq!(started.elapsed(), TIMEOUT);
    }

    #[tokio::test(start_paused = true)]
    async fn a_claim_that_lands_after_its_begin_timed_out_is_released() {
        let (faulty, store) = slow_begin(None);
        let req = claim("ghost", Duration::from_secs(60));
        timed_out_begin(&store, &req).await;
        // The store answers at 2 s: the claim landed, nobody runs it.
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert_eq!(faulty.calls(Op::Release), 1);
        assert_eq!(
            faulty.inner().get(&req.scope, &req.key).await.unwrap(),
            None
        );
        // A retry runs (not 409 for the 60 s lease).
        let b = store.begin(&req).await.unwrap();
        assert!(matches!(b, Begin::Acquired(_)), "{b:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_claim_whose_caller_left_is_released() {
        let (faulty, store) = slow_begin(None);
        let req = claim("left", Duration::from_secs(60));
        // The client hangs up before the store timeout.
        let gone = tokio::time::timeout(Duration::from_millis(100), store.begin(&req)).await;
        assert!(gone.is_err());
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert_eq!(faulty.calls(Op::Release), 1);
        let b = store.begin(&req).await.unwrap();
        assert!(matches!(b, Begin::Acquired(_)), "{b:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_late_answer_in_time_is_the_callers() {
        let faulty = FaultyStore::new(MemoryStore::new());
        faulty.set_times(Op::Begin, Fault::Delay(Duration::from_millis(299)), 1);
        let store = GuardedStore::new(Arc::new(faulty.clone()), TIMEOUT, None);
        let req = claim("in-time", Duration::from_secs(60));
        let b = store.begin(&req).await.unwrap();
        assert!(matches!(b, Begin::Acquired(_)), "{b:?}");
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert_eq!(faulty.calls(Op::Release), 0);
        let b = store.begin(&req).await.unwrap();
        assert!(matches!(b, Begin::InFlight { .. }), "{b:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn the_release_of_a_late_claim_is_retried_while_the_store_fails() {
        let (faulty, store) = slow_begin(None);
        faulty.set_times(Op::Release, Fault::Unavailable, 2);
        let req = claim("retried", Duration::from_secs(60));
        timed_out_begin(&store, &req).await;
        tokio::time::sleep(Duration::from_secs(4)).await;
        assert_eq!(faulty.calls(Op::Release), 3);
        let b = store.begin(&req).await.unwrap();
        assert!(matches!(b, Begin::Acquired(_)), "{b:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn releasing_a_late_claim_never_frees_a_newer_one() {
        let clock = ManualClock::starting_now();
        let faulty = FaultyStore::new(MemoryStore::new().with_clock(clock.clone()));
        faulty.set_times(Op::Begin, Fault::DelayAnswer(Duration::from_secs(2)), 1);
        // Attempts at 2.0, 2.1, 2.3, 2.7 s fail; the last, at 3.5 s, reaches the store.
        faulty.set_times(Op::Release, Fault::Unavailable, 4);
        let store = GuardedStore::new(Arc::new(faulty.clone()), TIMEOUT, None);
        let req = claim("fenced", Duration::from_secs(1));
        timed_out_begin(&store, &req).await;
        tokio::time::sleep(Duration::from_millis(1_800)).await; // t = 2.1 s: it landed
        clock.advance(Duration::from_millis(1_100)); // its 1 s lease has ended
        tokio::time::sleep(Duration::from_millis(300)).await; // t = 2.4 s
        let Begin::Acquired(newer) = store.begin(&req).await.unwrap() else {
            panic!("the expired claim was not taken over")
        };
        tokio::time::sleep(Duration::from_secs(2)).await; // the last attempt ran
        assert_eq!(faulty.calls(Op::Release), 5);
        let b = store.begin(&req).await.unwrap();
        assert!(matches!(b, Begin::InFlight { .. }), "{b:?}");
        store.release(&newer).await.unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn fail_open_keeps_a_late_claim_of_a_request_it_forwarded() {
        let recent = Arc::new(Recent::new(Duration::from_secs(60)));
        let (faulty, store) = slow_begin(Some(recent.clone()));
        let (sent, kept) = (
            claim("sent", Duration::from_secs(60)),
            claim("kept-out", Duration::from_secs(60)),
        );
        timed_out_begin(&store, &sent).await;
        // Fail-open lets it through unprotected: it runs, once.
        assert!(recent.allows(&sent.scope, &sent.key));
        assert!(
            !recent.allows(&sent.scope, &sent.key),
            "a retry of a request fail-open already forwarded was forwarded again"
        );
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert_eq!(faulty.calls(Op::Release), 0);
        let b = store.begin(&sent).await.unwrap();
        assert!(matches!(b, Begin::InFlight { .. }), "{b:?}");

        // One it did not forward is released, and still counts as seen.
        faulty.set_times(Op::Begin, Fault::DelayAnswer(Duration::from_secs(2)), 1);
        timed_out_begin(&store, &kept).await;
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert_eq!(faulty.calls(Op::Release), 1);
        assert!(!recent.allows(&kept.scope, &kept.key));
        let b = store.begin(&kept).await.unwrap();
        assert!(matches!(b, Begin::Acquired(_)), "{b:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_release_cut_off_by_the_timeout_goes_on() {
        let faulty = FaultyStore::new(MemoryStore::new());
        let store = GuardedStore::new(Arc::new(faulty.clone()), TIMEOUT, None);
        let req = claim("release", Duration::from_secs(60));
        let Begin::Acquired(lease) = store.begin(&req).await.unwrap() else {
            panic!("not acquired")
        };
        faulty.set_times(Op::Release, Fault::Delay(Duration::from_secs(1)), 1);
        let e = store.release(&lease).await.unwrap_err();
        assert!(
            matches!(
                e,
                StoreError::Timeout {
                    phase: Phase::Release
                }
            ),
            "{e}"
        );
        tokio::time::sleep(Duration::from_secs(2)).await;
        let b = store.begin(&req).await.unwrap();
        assert!(matches!(b, Begin::Acquired(_)), "{b:?}");
    }

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
