//! Metrics and trace spans for every store call: [`InstrumentedStore`].
//!
//! Recorded through the [`metrics`] facade, so whatever recorder the
//! process installed (the gateway's Prometheus exporter, or an
//! application's own) gets them; without a recorder they cost a branch.
//!
//! | series | type | labels |
//! |---|---|---|
//! | `idem_store_operation_duration_seconds` | histogram, seconds | `op` |
//! | `idem_store_errors_total` | counter | `op`, `kind` |
//!
//! `op` is one of [`StoreOp::ALL`] (`begin`, `complete`, `release`,
//! `extend`, `get`, `delete`, `purge`, `list`, `wait`; `wait` counts errors
//! only: its duration is a wait by design); `kind` one of
//! [`error_kind`]'s values. Label values are fixed strings: no key, scope
//! or URL ever becomes a label.
//!
//! Each call also runs inside a `tracing` span named `idem.store` (target
//! `idem`, level DEBUG) with the field `op`, a child of the caller's span
//! (so an OpenTelemetry layer exports it under the request's span).

use std::future::Future;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use metrics::Histogram;
use tracing::Instrument;

use crate::admin::{KeyAdmin, ListPage, ListQuery};
use crate::error::StoreError;
use crate::store::{Begin, BeginRequest, HoldReason, Lease, Record, Store};
use crate::{IdempotencyKey, Scope, StoredResponse};

/// The histogram of store call durations, seconds, by `op`.
pub const STORE_DURATION: &str = "idem_store_operation_duration_seconds";
/// The counter of failed store calls, by `op` and `kind`.
pub const STORE_ERRORS: &str = "idem_store_errors_total";

/// Counter: runs whose lease was lost (another run took the key over)
/// before their result or release was written; the newer run's outcome
/// stands (see [`crate::Saved::LeaseLost`]).
pub const LEASE_LOST: &str = "idem_lease_lost_total";
/// Counter: `complete` attempts after a run's first one failed (the save's
/// bounded retry, see [`crate::EngineConfig::save_wait`]).
pub const SAVE_RETRIES: &str = "idem_save_retries_total";
/// Counter: claims that took a key over from a holder whose lease had
/// ended (a crashed or stalled run).
pub const LEASE_TAKEOVERS: &str = "idem_lease_takeovers_total";
/// Counter: results whose save was given up (the store failed through
/// [`crate::EngineConfig::save_wait`] and the background retry): the
/// operation ran, its result is not stored, and the key is held
/// ([`crate::HoldReason::SaveFailed`]) for an operator to settle.
pub const SAVES_GIVEN_UP: &str = "idem_saves_given_up_total";

/// A store call, as the `op` label names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum StoreOp {
    /// [`Store::begin`].
    Begin,
    /// [`Store::complete`].
    Complete,
    /// [`Store::release`].
    Release,
    /// [`Store::extend`].
    Extend,
    /// [`Store::hold`].
    Hold,
    /// [`Store::get`].
    Get,
    /// [`Store::delete`].
    Delete,
    /// [`Store::purge_expired`].
    Purge,
    /// [`KeyAdmin::list`].
    List,
    /// [`Store::wait_for_change`] (errors only).
    Wait,
}

impl StoreOp {
    /// Every op, in label order.
    pub const ALL: [StoreOp; 10] = [
        StoreOp::Begin,
        StoreOp::Complete,
        StoreOp::Release,
        StoreOp::Extend,
        StoreOp::Hold,
        StoreOp::Get,
        StoreOp::Delete,
        StoreOp::Purge,
        StoreOp::List,
        StoreOp::Wait,
    ];

    /// The label value: `begin`, `complete`, `release`, `extend`, `hold`, `get`,
    /// `delete`, `purge`, `list`, `wait`.
    pub fn as_str(self) -> &'static str {
        match self {
            StoreOp::Begin => "begin",
            StoreOp::Complete => "complete",
            StoreOp::Release => "release",
            StoreOp::Extend => "extend",
            StoreOp::Hold => "hold",
            StoreOp::Get => "get",
            StoreOp::Delete => "delete",
            StoreOp::Purge => "purge",
            StoreOp::List => "list",
            StoreOp::Wait => "wait",
        }
    }
}

/// The `kind` label of a store error: `unavailable`, `timeout`, `corrupt`,
/// `full`, `lease_lost` (a stale fence: another run took the key over),
/// `config`, `invalid` (a bad list request).
///
/// ```
/// use idem_core::{instrument::error_kind, Phase, StoreError};
/// assert_eq!(error_kind(&StoreError::Timeout { phase: Phase::Begin }), "timeout");
/// assert_eq!(error_kind(&StoreError::LeaseLost { fence: 3 }), "lease_lost");
/// ```
pub fn error_kind(e: &StoreError) -> &'static str {
    match e {
        StoreError::LeaseLost { .. } => "lease_lost",
        StoreError::Unavailable { .. } => "unavailable",
        StoreError::Timeout { .. } => "timeout",
        StoreError::Corrupt { .. } => "corrupt",
        StoreError::Full { .. } => "full",
        StoreError::Config(_) => "config",
        StoreError::Invalid(_) => "invalid",
    }
}

/// A [`Store`] that times every call into
/// `idem_store_operation_duration_seconds{op}`, counts failures in
/// `idem_store_errors_total{op,kind}` and runs each call in an `idem.store`
/// span (see the [module docs](self)). Everything else is `S`'s: the answers,
/// the errors, the listing capability ([`Store::admin`], timed as `list`).
///
/// `idem_http::IdempotencyLayer` wraps its store in one, so a service using
/// the layer gets these series; wrap a store yourself when you use the
/// [`crate::Engine`] directly. Wrap once: two wrappers count every call
/// twice.
///
/// The histogram handles are registered when the wrapper is made: install
/// the process's metrics recorder before that (a wrapper made earlier
/// records nothing).
///
/// ```
/// use idem_core::{instrument::InstrumentedStore, Engine, MemoryStore};
/// let engine = Engine::new(InstrumentedStore::new(MemoryStore::new()));
/// # let _ = engine;
/// ```
#[derive(Debug, Clone)]
pub struct InstrumentedStore<S> {
    inner: S,
    /// One histogram per op of [`StoreOp::ALL`], in that order.
    durations: [Histogram; 10],
}

impl<S> InstrumentedStore<S> {
    /// Wraps `inner`, registering its histograms with the current recorder.
    pub fn new(inner: S) -> Self {
        Self {
            inner,
            durations: StoreOp::ALL
                .map(|op| metrics::histogram!(STORE_DURATION, "op" => op.as_str())),
        }
    }

    /// The wrapped store.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// Runs one store call as `op`: in its span, timed, its error counted.
    async fn observe<T>(
        &self,
        op: StoreOp,
        call: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        // DEBUG: the default `info` log filter leaves it off (no cost, and
        // log lines keep their shape); the OTel layer has its own filter.
        let span = tracing::debug_span!(target: "idem", "idem.store", op = op.as_str());
        let started = Instant::now();
        // A span no subscriber wants (the usual case without tracing
        // export) is not entered on every poll.
        let result = if span.is_disabled() {
            call.await
        } else {
            call.instrument(span).await
        };
        if op != StoreOp::Wait {
            self.durations[op as usize].record(started.elapsed());
        }
        if let Err(e) = &result {
            count_error(op, e);
        }
        result
    }
}

/// Adds one to `idem_store_errors_total{op,kind}` (errors are rare: the
/// handle is looked up each time).
fn count_error(op: StoreOp, e: &StoreError) {
    metrics::counter!(STORE_ERRORS, "op" => op.as_str(), "kind" => error_kind(e)).increment(1);
}

#[async_trait]
impl<S: Store> Store for InstrumentedStore<S> {
    async fn begin(&self, req: &BeginRequest) -> Result<Begin, StoreError> {
        self.observe(StoreOp::Begin, self.inner.begin(req)).await
    }

    async fn complete(
        &self,
        lease: &Lease,
        response: &StoredResponse,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        self.observe(StoreOp::Complete, self.inner.complete(lease, response, ttl))
            .await
    }

    async fn release(&self, lease: &Lease) -> Result<(), StoreError> {
        self.observe(StoreOp::Release, self.inner.release(lease))
            .await
    }

    async fn extend(&self, lease: &Lease, lease_for: Duration) -> Result<Lease, StoreError> {
        self.observe(StoreOp::Extend, self.inner.extend(lease, lease_for))
            .await
    }

    async fn hold(
        &self,
        lease: &Lease,
        reason: HoldReason,
        hold_for: Duration,
    ) -> Result<Lease, StoreError> {
        self.observe(StoreOp::Hold, self.inner.hold(lease, reason, hold_for))
            .await
    }

    async fn get(&self, scope: &Scope, key: &IdempotencyKey) -> Result<Option<Record>, StoreError> {
        self.observe(StoreOp::Get, self.inner.get(scope, key)).await
    }

    async fn delete(&self, scope: &Scope, key: &IdempotencyKey) -> Result<bool, StoreError> {
        self.observe(StoreOp::Delete, self.inner.delete(scope, key))
            .await
    }

    async fn purge_expired(&self) -> Result<u64, StoreError> {
        self.observe(StoreOp::Purge, self.inner.purge_expired())
            .await
    }

    async fn wait_for_change(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        max: Duration,
    ) -> Result<(), StoreError> {
        self.observe(StoreOp::Wait, self.inner.wait_for_change(scope, key, max))
            .await
    }

    fn admin(&self) -> Option<&dyn KeyAdmin> {
        // Listed through this wrapper (so `list` is timed) when the inner
        // store can list at all.
        self.inner.admin().map(|_| self as &dyn KeyAdmin)
    }
}

#[async_trait]
impl<S: Store> KeyAdmin for InstrumentedStore<S> {
    async fn list(&self, query: &ListQuery) -> Result<ListPage, StoreError> {
        let call = async {
            match self.inner.admin() {
                Some(admin) => admin.list(query).await,
                None => Err(StoreError::Invalid(
                    "this store cannot list its records".into(),
                )),
            }
        };
        self.observe(StoreOp::List, call).await
    }

    fn newest_first(&self) -> bool {
        self.inner.admin().is_some_and(KeyAdmin::newest_first)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Fingerprint, MemoryStore};
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};

    #[test]
    fn every_call_is_timed_and_errors_are_counted_by_kind() {
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        metrics::with_local_recorder(&recorder, || {
            let store = InstrumentedStore::new(MemoryStore::new());
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async {
                let req = BeginRequest {
                    scope: Scope::anonymous(),
                    key: IdempotencyKey::new("k").unwrap(),
                    fingerprint: Fingerprint::of(b"x"),
                    lease: Duration::from_secs(5),
                };
                let Begin::Acquired(lease) = store.begin(&req).await.unwrap() else {
                    panic!("not acquired")
                };
                store.release(&lease).await.unwrap();
                // The fence is stale now.
                assert!(store.release(&lease).await.is_err());
                // The capability is the inner store's.
                assert_eq!(store.admin().is_some(), store.get_ref().admin().is_some());
                let listed = KeyAdmin::list(&store, &ListQuery::default()).await;
                if store.get_ref().admin().is_none() {
                    assert!(matches!(listed, Err(StoreError::Invalid(_))));
                }
            });
        });
        let snap = snapshotter.snapshot().into_hashmap();
        let samples = |op: &str| {
            snap.iter()
                .find(|(k, _)| {
                    k.key().name() == STORE_DURATION
                        && k.key().labels().any(|l| l.key() == "op" && l.value() == op)
                })
                .map(|(_, (_, _, v))| match v {
                    DebugValue::Histogram(h) => h.len(),
                    _ => 0,
                })
                .unwrap_or(0)
        };
        assert_eq!(samples("begin"), 1);
        assert_eq!(samples("release"), 2);
        assert_eq!(samples("list"), 1);
        assert_eq!(samples("complete"), 0);
        let errors: Vec<_> = snap
            .iter()
            .filter(|(k, _)| k.key().name() == STORE_ERRORS)
            .map(|(k, (_, _, v))| {
                let labels: Vec<String> = k
                    .key()
                    .labels()
                    .map(|l| format!("{}={}", l.key(), l.value()))
                    .collect();
                (labels.join(","), matches!(v, DebugValue::Counter(1)))
            })
            .collect();
        assert!(
            errors.contains(&("op=release,kind=lease_lost".to_owned(), true)),
            "{errors:?}"
        );
    }

    /// A claim whose holder's lease ended is taken over (counted), and the
    /// old holder's save then finds its lease lost (counted).
    #[test]
    fn takeovers_and_lost_leases_are_counted_by_the_engine() {
        use crate::{Action, Engine, EngineConfig, ManualClock, Saved};
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        metrics::with_local_recorder(&recorder, || {
            let clock = ManualClock::starting_now();
            let store = MemoryStore::new().with_clock(clock.clone());
            let config = EngineConfig {
                lease: Duration::from_secs(1),
                watchdog: false,
                ..EngineConfig::default()
            };
            let engine = Engine::with_config(store, config);
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async {
                let (scope, key) = (Scope::anonymous(), IdempotencyKey::new("t").unwrap());
                let fp = Fingerprint::of(b"x");
                let outcome = engine
                    .execute(&scope, &key, fp, |_| async {
                        // The holder stalls past its lease; a retry takes over.
                        clock.advance(Duration::from_secs(2));
                        let retry = engine
                            .execute(&scope, &key, fp, |_| async {
                                ((), Action::Store(StoredResponse::new(201, "second")))
                            })
                            .await
                            .unwrap();
                        assert!(matches!(retry, crate::Outcome::Executed { .. }));
                        ((), Action::Store(StoredResponse::new(201, "first")))
                    })
                    .await
                    .unwrap();
                let crate::Outcome::Executed { saved, .. } = outcome else {
                    panic!("not executed")
                };
                assert!(matches!(saved, Saved::LeaseLost), "{saved:?}");
            });
        });
        let snap = snapshotter.snapshot().into_hashmap();
        let counter = |name: &str| {
            snap.iter()
                .find(|(k, _)| k.key().name() == name)
                .map(|(_, (_, _, v))| matches!(v, DebugValue::Counter(1)))
        };
        assert_eq!(counter(LEASE_TAKEOVERS), Some(true));
        assert_eq!(counter(LEASE_LOST), Some(true));
        assert_eq!(counter(SAVE_RETRIES), None);
    }
}
