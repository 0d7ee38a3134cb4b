//! A programmable fault store: wraps any [`Store`] and makes chosen
//! operations fail, hang or wait, a number of times or always, counting
//! every call.
//!
//! ```
//! use idem_core::MemoryStore;
//! use idem_testkit::faulty::{Fault, FaultyStore, Op};
//!
//! let store = FaultyStore::new(MemoryStore::new());
//! store.set(Op::Complete, Fault::Unavailable); // every `complete` fails
//! store.set_times(Op::Begin, Fault::Timeout, 2); // the next two `begin`s time out
//! store.clear_all(); // pass everything through again
//! assert_eq!(store.calls(Op::Complete), 0);
//! ```

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use idem_core::{
    Begin, BeginRequest, HoldReason, IdempotencyKey, Lease, MemoryStore, Phase, Record, Scope,
    Store, StoreError, StoredResponse,
};

/// One operation of the [`Store`] trait (its discriminant indexes the
/// per-operation faults and counters).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    /// [`Store::begin`].
    Begin = 0,
    /// [`Store::complete`].
    Complete = 1,
    /// [`Store::release`].
    Release = 2,
    /// [`Store::extend`].
    Extend = 3,
    /// [`Store::get`].
    Get = 4,
    /// [`Store::delete`].
    Delete = 5,
    /// [`Store::purge_expired`].
    PurgeExpired = 6,
    /// [`Store::wait_for_change`].
    WaitForChange = 7,
    /// [`Store::hold`].
    Hold = 8,
}

impl Op {
    /// Every operation, in the trait's order.
    pub const ALL: [Op; 9] = [
        Op::Begin,
        Op::Complete,
        Op::Release,
        Op::Extend,
        Op::Get,
        Op::Delete,
        Op::PurgeExpired,
        Op::WaitForChange,
        Op::Hold,
    ];

    /// The [`Phase`] an injected error names (`wait_for_change` reads, so
    /// it reports [`Phase::Get`]).
    pub fn phase(self) -> Phase {
        match self {
            Op::Begin => Phase::Begin,
            Op::Complete => Phase::Complete,
            Op::Release => Phase::Release,
            Op::Extend => Phase::Extend,
            Op::Hold => Phase::Hold,
            Op::Get | Op::WaitForChange => Phase::Get,
            Op::Delete => Phase::Delete,
            Op::PurgeExpired => Phase::Purge,
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// What an armed operation does instead of (or before) passing through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Fails at once with [`StoreError::Unavailable`] (an injected
    /// "connection refused" source) without calling the inner store.
    Unavailable,
    /// Fails at once with [`StoreError::Timeout`] without calling the inner store.
    Timeout,
    /// Fails at once with [`StoreError::Corrupt`] carrying this detail.
    Corrupt(&'static str),
    /// Fails at once with [`StoreError::Full`] carrying this detail.
    Full(&'static str),
    /// Never answers (a caller's timeout has to cut it off).
    Hang,
    /// Waits this long, then passes the call through.
    Delay(Duration),
    /// Passes the call through at once, then holds its answer back this
    /// long: the store applied the step, the caller hears late (a request
    /// already on the wire when the store stalled). A caller that gives up
    /// meanwhile leaves the step applied.
    DelayAnswer(Duration),
    /// Passes the call through, then answers [`StoreError::Timeout`]
    /// whatever the store said: the step applied, the caller heard a
    /// timeout (a client-side time limit cut the answer off).
    TimeoutAfterApply,
}

impl Fault {
    /// The error this fault returns for `op` instead of calling the inner
    /// store; `None` for [`Fault::Hang`], [`Fault::Delay`],
    /// [`Fault::DelayAnswer`] and [`Fault::TimeoutAfterApply`].
    pub fn error(self, op: Op) -> Option<StoreError> {
        let phase = op.phase();
        match self {
            Fault::Unavailable => Some(StoreError::unavailable(phase, Injected)),
            Fault::Timeout => Some(StoreError::Timeout { phase }),
            Fault::Corrupt(detail) => Some(StoreError::Corrupt {
                phase,
                detail: detail.to_owned(),
            }),
            Fault::Full(detail) => Some(StoreError::Full {
                detail: detail.to_owned(),
            }),
            Fault::Hang | Fault::Delay(_) | Fault::DelayAnswer(_) | Fault::TimeoutAfterApply => {
                None
            }
        }
    }
}

/// The source of an injected [`StoreError::Unavailable`].
#[derive(Debug)]
struct Injected;

impl std::fmt::Display for Injected {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("connection refused (injected fault)")
    }
}

impl std::error::Error for Injected {}

/// The fault armed on one operation: which, and for how many more calls
/// (`None`: every call).
#[derive(Debug, Clone, Copy, Default)]
struct Armed {
    fault: Option<Fault>,
    remaining: Option<u64>,
}

#[derive(Debug, Default)]
struct State {
    armed: [Mutex<Armed>; 9],
    calls: [AtomicU64; 9],
    injected: [AtomicU64; 9],
}

/// Wraps a store and, per [`Op`], fails, hangs or delays calls on demand
/// (every call, or the next `n`), counting every call and every injected
/// fault. Unarmed operations pass straight through. Clones share the
/// armed faults and the counters (and the inner store, when it is a
/// handle such as [`MemoryStore`]).
#[derive(Debug, Clone)]
pub struct FaultyStore<S> {
    inner: S,
    state: Arc<State>,
}

impl FaultyStore<MemoryStore> {
    /// A fresh [`MemoryStore`] whose every operation hangs (a store that
    /// accepted the connection and never answers).
    pub fn hung() -> Self {
        let store = Self::new(MemoryStore::new());
        store.set_each(&Op::ALL, Fault::Hang);
        store
    }
}

impl<S> FaultyStore<S> {
    /// Wraps `inner`, passing every call through until a fault is armed.
    pub fn new(inner: S) -> Self {
        Self {
            inner,
            state: Arc::new(State::default()),
        }
    }

    /// The wrapped store.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    /// Arms `fault` on every call of `op` from now on (until [`Self::clear`]).
    pub fn set(&self, op: Op, fault: Fault) {
        self.arm(op, fault, None);
    }

    /// Arms `fault` on every call of each of `ops`.
    pub fn set_each(&self, ops: &[Op], fault: Fault) {
        for op in ops {
            self.set(*op, fault);
        }
    }

    /// Arms `fault` on the next `n` calls of `op`; later calls pass through.
    pub fn set_times(&self, op: Op, fault: Fault, n: u64) {
        self.arm(op, fault, Some(n));
    }

    /// Disarms `op`: its calls pass through again.
    pub fn clear(&self, op: Op) {
        *self.slot(op) = Armed::default();
    }

    /// Disarms every operation.
    pub fn clear_all(&self) {
        for op in Op::ALL {
            self.clear(op);
        }
    }

    /// How many times `op` was called (calls that got a fault included).
    pub fn calls(&self, op: Op) -> u64 {
        self.state.calls[op.index()].load(Ordering::SeqCst)
    }

    /// How many calls of `op` got the armed fault.
    pub fn injected(&self, op: Op) -> u64 {
        self.state.injected[op.index()].load(Ordering::SeqCst)
    }

    fn arm(&self, op: Op, fault: Fault, remaining: Option<u64>) {
        *self.slot(op) = Armed {
            fault: Some(fault),
            remaining,
        };
    }

    fn slot(&self, op: Op) -> std::sync::MutexGuard<'_, Armed> {
        self.state.armed[op.index()]
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Counts a call of `op` and takes its fault, if one is armed.
    fn take(&self, op: Op) -> Option<Fault> {
        self.state.calls[op.index()].fetch_add(1, Ordering::SeqCst);
        let mut slot = self.slot(op);
        let fault = slot.fault?;
        match slot.remaining {
            Some(0) => {
                *slot = Armed::default();
                return None;
            }
            Some(n) => {
                slot.remaining = Some(n - 1);
                if n == 1 {
                    *slot = Armed::default();
                }
            }
            None => {}
        }
        self.state.injected[op.index()].fetch_add(1, Ordering::SeqCst);
        Some(fault)
    }

    /// What a call of `op` meets before it reaches the inner store: an
    /// error, a hang, a delay, or nothing; `Ok(Some(fault))`: pass through,
    /// then apply `fault` ([`Fault::DelayAnswer`],
    /// [`Fault::TimeoutAfterApply`]) to the answer.
    async fn gate(&self, op: Op) -> Res<Option<Fault>> {
        match self.take(op) {
            None => Ok(None),
            Some(Fault::Hang) => std::future::pending().await,
            Some(Fault::Delay(d)) => {
                tokio::time::sleep(d).await;
                Ok(None)
            }
            Some(after @ (Fault::DelayAnswer(_) | Fault::TimeoutAfterApply)) => Ok(Some(after)),
            Some(fault) => Err(fault.error(op).expect("an error fault")),
        }
    }

    /// Runs `op`'s call through its gate, then hands back the inner
    /// store's answer (late for [`Fault::DelayAnswer`], replaced by a
    /// timeout for [`Fault::TimeoutAfterApply`]).
    async fn pass<T>(&self, op: Op, call: impl std::future::Future<Output = Res<T>>) -> Res<T> {
        let after = self.gate(op).await?;
        let answer = call.await;
        match after {
            Some(Fault::DelayAnswer(d)) => tokio::time::sleep(d).await,
            Some(Fault::TimeoutAfterApply) => {
                return Err(StoreError::Timeout { phase: op.phase() })
            }
            _ => {}
        }
        answer
    }
}

/// What every [`Store`] call returns.
type Res<T> = Result<T, StoreError>;

#[async_trait]
impl<S: Store> Store for FaultyStore<S> {
    async fn begin(&self, req: &BeginRequest) -> Res<Begin> {
        self.pass(Op::Begin, self.inner.begin(req)).await
    }

    async fn complete(&self, lease: &Lease, response: &StoredResponse, ttl: Duration) -> Res<()> {
        self.pass(Op::Complete, self.inner.complete(lease, response, ttl))
            .await
    }

    async fn release(&self, lease: &Lease) -> Res<()> {
        self.pass(Op::Release, self.inner.release(lease)).await
    }

    async fn extend(&self, lease: &Lease, lease_for: Duration) -> Res<Lease> {
        self.pass(Op::Extend, self.inner.extend(lease, lease_for))
            .await
    }

    async fn hold(&self, lease: &Lease, reason: HoldReason, hold_for: Duration) -> Res<Lease> {
        self.pass(Op::Hold, self.inner.hold(lease, reason, hold_for))
            .await
    }

    async fn get(&self, scope: &Scope, key: &IdempotencyKey) -> Res<Option<Record>> {
        self.pass(Op::Get, self.inner.get(scope, key)).await
    }

    async fn delete(&self, scope: &Scope, key: &IdempotencyKey) -> Res<bool> {
        self.pass(Op::Delete, self.inner.delete(scope, key)).await
    }

    async fn purge_expired(&self) -> Res<u64> {
        self.pass(Op::PurgeExpired, self.inner.purge_expired())
            .await
    }

    async fn wait_for_change(&self, scope: &Scope, key: &IdempotencyKey, max: Duration) -> Res<()> {
        self.pass(
            Op::WaitForChange,
            self.inner.wait_for_change(scope, key, max),
        )
        .await
    }

    fn admin(&self) -> Option<&dyn idem_core::KeyAdmin> {
        self.inner.admin()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::support::{fp, fresh_key, fresh_scope};

    fn req() -> BeginRequest {
        let (scope, key) = (fresh_scope(), fresh_key("faulty"));
        crate::support::req(&scope, &key, fp("a"), Duration::from_secs(5))
    }

    #[tokio::test]
    async fn faults_are_counted_limited_and_cleared() {
        let store = FaultyStore::new(MemoryStore::new());
        let r = req();
        let (scope, key) = (r.scope.clone(), r.key.clone());
        store.set_times(Op::Begin, Fault::Timeout, 2);
        for _ in 0..2 {
            let e = store.begin(&r).await.unwrap_err();
            assert!(
                matches!(
                    e,
                    StoreError::Timeout {
                        phase: Phase::Begin
                    }
                ),
                "{e:?}"
            );
        }
        assert!(matches!(store.begin(&r).await, Ok(Begin::Acquired(_))));
        assert_eq!((store.calls(Op::Begin), store.injected(Op::Begin)), (3, 2));

        store.set(Op::Get, Fault::Corrupt("bad bytes"));
        for _ in 0..3 {
            let e = store.get(&scope, &key).await.unwrap_err();
            assert!(
                matches!(
                    e,
                    StoreError::Corrupt {
                        phase: Phase::Get,
                        ..
                    }
                ),
                "{e:?}"
            );
        }
        store.clear_all();
        assert!(store.get(&scope, &key).await.unwrap().is_some());
        assert_eq!(store.injected(Op::Get), 3);
    }

    #[tokio::test(start_paused = true)]
    async fn hang_never_answers_and_delay_passes_through() {
        let store = FaultyStore::hung();
        let hung = tokio::time::timeout(Duration::from_secs(60), store.begin(&req())).await;
        assert!(hung.is_err(), "a hung store answered");
        store.clear_all();
        store.set(Op::PurgeExpired, Fault::Delay(Duration::from_secs(3)));
        let start = tokio::time::Instant::now();
        assert_eq!(store.purge_expired().await.unwrap(), 0);
        assert!(start.elapsed() >= Duration::from_secs(3));
    }
}
