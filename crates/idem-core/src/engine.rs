//! The engine: run any async operation at most once per scoped key.

use std::future::Future;
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::error::StoreError;
use crate::instrument::{LEASE_LOST, LEASE_TAKEOVERS, SAVES_GIVEN_UP, SAVE_RETRIES};
use crate::store::{Begin, BeginRequest, HoldReason, Lease, Record, RecordState, Store};
use crate::{Fingerprint, IdempotencyKey, Scope, StoredResponse};

/// What to do with a key once its operation has finished.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Keep this result and replay it to every duplicate until the TTL ends.
    Store(StoredResponse),
    /// Free the key: the operation had no effect (or a retry is wanted), so a
    /// retry runs again.
    Release,
    /// Free the key after a failure without effect (a 5xx, an unreachable
    /// upstream), but first share this answer with the duplicates of the
    /// same request that waited for this execution ([`EngineConfig::wait`],
    /// in any instance on the store): they get it replayed
    /// ([`StoredResponse::released`] set) instead of running the operation
    /// once each. A later retry — one that did not wait for the execution —
    /// is not given the failure: [`Engine::begin`] waits out the window
    /// ([`EngineConfig::share_failure`]) and then claims the key, so it runs
    /// again.
    ///
    /// Stored as a completed record with a TTL of `share_failure` (so
    /// another fingerprint gets [`Outcome::Mismatch`] within the window);
    /// with `share_failure` 0 this is [`Action::Release`].
    ReleaseWith(StoredResponse),
    /// The outcome is unknown (e.g. a timeout after the request was sent):
    /// keep the key in flight, marked held for this reason
    /// ([`Store::hold`]), until its lease ends — or
    /// [`EngineConfig::hold_for`] from now, when that is later — so
    /// nothing runs again while the first attempt may still be landing,
    /// and an operator can see the key and settle it.
    Hold(HoldReason),
}

/// Engine settings.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// How long a claim holds before another caller may take it over
    /// (default 30 s, millisecond precision). Renewed by the watchdog while
    /// the operation runs. At least [`MIN_LEASE`] (1 s):
    /// [`Engine::try_with_config`] refuses a shorter one,
    /// [`Engine::with_config`] raises it. Long leases saturate (up to
    /// `Duration::MAX`: a claim that ends only when released).
    pub lease: Duration,
    /// How long a completed result is replayed (default 24 h, millisecond
    /// precision; saturates up to `Duration::MAX`, i.e. kept until
    /// deleted). [`EngineConfig::validate`] wants it at least the lease.
    pub ttl: Duration,
    /// How long a duplicate waits for an in-flight original before it gets
    /// [`Outcome::InFlight`] (default 0: answer at once). Any length up to
    /// `Duration::MAX` is accepted; one too long to add to the current
    /// instant waits without a deadline (for the original to finish or
    /// its lease to end).
    pub wait: Duration,
    /// Renew the lease every `lease / 3` while the operation runs (default on).
    pub watchdog: bool,
    /// What happens to the key when the operation's future is dropped
    /// before it finishes (default [`Action::Hold`] with
    /// [`HoldReason::Cancelled`]: its effect is unknown, so the key is held
    /// as for a timeout; [`Action::Release`] frees it at once).
    /// [`Action::Store`] and [`Action::ReleaseWith`] are treated as that
    /// `Hold`.
    pub on_cancel: Action,
    /// How long the caller waits for a result's save to succeed when the
    /// first `complete` fails (default 2 s). Until then the save is retried
    /// with backoff while the lease is renewed, so duplicates get `InFlight`,
    /// never a second run. Any length up to `Duration::MAX` is accepted
    /// (one too long to add to the current instant has no deadline).
    pub save_wait: Duration,
    /// How long a failed save keeps being retried in the background after
    /// `save_wait`, the lease renewed each time (default 10 min). When the
    /// store answers `extend` but keeps refusing `complete` (the response is
    /// too large for it, or a capped store is full), the result is saved
    /// without its body (`body_omitted`), so duplicates get a clear refusal
    /// instead of a second run. 0 turns the background retry off; any
    /// length up to `Duration::MAX` is accepted (no deadline when too long
    /// to add to the current instant).
    pub save_retry: Duration,
    /// How long the answer of a failure without effect
    /// ([`Action::ReleaseWith`]) is kept for the duplicates that waited for
    /// it before the key is free again (default [`DEFAULT_SHARE_FAILURE`],
    /// 1 s; 0: off, the key is released at once; millisecond precision;
    /// saturates up to `Duration::MAX`). Without it, duplicates that waited
    /// for a 5xx wake to a free key and run it again in turn (20 waiters,
    /// 16 to 17 executions); with it they get that answer (they wake within
    /// milliseconds). A later retry, one that did not wait for the
    /// execution, is not given the failure: it waits out the window (at
    /// most twice this length, at least 100 ms) and then runs.
    pub share_failure: Duration,
    /// How long a key whose outcome is unknown stays held ([`Action::Hold`]:
    /// a timeout, a broken body, a cancelled run; and a save given up):
    /// its lease end moves to at least now + `hold_for`, so no retry runs it
    /// again before an operator had a chance to settle it (`idem keys
    /// release` / `complete`). Default [`DEFAULT_HOLD_FOR`], 0: the key
    /// frees itself when its current lease ends, as a crashed holder's key
    /// does. Millisecond precision; saturates up to `Duration::MAX` (held
    /// until an operator settles it).
    pub hold_for: Duration,
}

/// [`EngineConfig::lease`]'s default: 30 s.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(30);
/// [`EngineConfig::ttl`]'s default: 24 h.
pub const DEFAULT_TTL: Duration = Duration::from_secs(24 * 3600);
/// [`EngineConfig::wait`]'s default: 0 (a duplicate is answered at once).
pub const DEFAULT_WAIT: Duration = Duration::ZERO;
/// [`EngineConfig::watchdog`]'s default: on.
pub const DEFAULT_WATCHDOG: bool = true;
/// [`EngineConfig::on_cancel`]'s default: [`Action::Hold`] with
/// [`HoldReason::Cancelled`].
pub const DEFAULT_ON_CANCEL: Action = Action::Hold(HoldReason::Cancelled);
/// [`EngineConfig::hold_for`]'s default: 0 (a held key frees itself when
/// its lease ends).
pub const DEFAULT_HOLD_FOR: Duration = Duration::ZERO;
/// [`EngineConfig::save_wait`]'s default: 2 s.
pub const DEFAULT_SAVE_WAIT: Duration = Duration::from_secs(2);
/// [`EngineConfig::save_retry`]'s default: 10 min.
pub const DEFAULT_SAVE_RETRY: Duration = Duration::from_secs(600);
/// [`EngineConfig::share_failure`]'s default: 1 s — long enough for every
/// waiter, which wakes within milliseconds of the failure; a client's own
/// retry right after the failure waits at most this long and then runs.
pub const DEFAULT_SHARE_FAILURE: Duration = Duration::from_secs(1);

/// The longest [`EngineConfig::share_failure`]: 1 min. A shared failure
/// is kept for the duplicates that waited for it, who wake within
/// milliseconds; a longer window only delays later retries (each waits it
/// out), and one longer than a retry's bounded wait would answer retries
/// the failure instead of running them. [`EngineConfig::validate`]
/// refuses more; [`EngineConfig::clamped`] and [`Engine::with_config`]
/// lower it to this.
pub const MAX_SHARE_FAILURE: Duration = Duration::from_secs(60);

/// The shortest lease the engine runs with: 1 s.
///
/// A lease is measured on the store's clock from the moment the claim is
/// written; a shorter one can end before the operation has even been
/// called (a store round trip, a GC pause, a busy runtime), and then every
/// duplicate takes the key over and runs again — 20 concurrent copies with
/// a 1 ms lease ran 2 to 20 times. [`EngineConfig::validate`] and
/// [`Engine::try_with_config`] refuse a shorter lease; [`Engine::with_config`]
/// raises it to this floor.
pub const MIN_LEASE: Duration = Duration::from_secs(1);

/// Why an [`EngineConfig`] cannot keep its guarantee ([`EngineConfig::validate`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EngineConfigError {
    /// The lease is shorter than [`MIN_LEASE`] (1 s).
    #[error("the lease ({lease:?}) is shorter than the minimum of {min:?}: a claim could end before its operation runs, and duplicates would run again")]
    LeaseTooShort {
        /// The lease given.
        lease: Duration,
        /// [`MIN_LEASE`].
        min: Duration,
    },
    /// [`EngineConfig::share_failure`] is above [`MAX_SHARE_FAILURE`] (1 min).
    #[error("share_failure ({share_failure:?}) is above the maximum of {max:?}: later retries would be answered the shared failure instead of running")]
    ShareFailureTooLong {
        /// The window given.
        share_failure: Duration,
        /// [`MAX_SHARE_FAILURE`].
        max: Duration,
    },
    /// The result TTL is shorter than the lease.
    #[error("the ttl ({ttl:?}) is shorter than the lease ({lease:?}): a result would be forgotten while its key could still be in flight")]
    TtlShorterThanLease {
        /// The TTL given.
        ttl: Duration,
        /// The lease given.
        lease: Duration,
    },
}

impl EngineConfig {
    /// Checks the settings that the at-most-once guarantee depends on: a
    /// lease of at least [`MIN_LEASE`] (1 s) and a TTL not shorter than the
    /// lease.
    ///
    /// ```
    /// use std::time::Duration;
    /// use idem_core::{EngineConfig, EngineConfigError};
    /// assert!(EngineConfig::default().validate().is_ok());
    /// let short = EngineConfig { lease: Duration::from_millis(1), ..EngineConfig::default() };
    /// assert!(matches!(short.validate(), Err(EngineConfigError::LeaseTooShort { .. })));
    /// ```
    ///
    /// # Errors
    /// [`EngineConfigError::LeaseTooShort`], [`EngineConfigError::TtlShorterThanLease`],
    /// [`EngineConfigError::ShareFailureTooLong`].
    pub fn validate(&self) -> Result<(), EngineConfigError> {
        if self.share_failure > MAX_SHARE_FAILURE {
            return Err(EngineConfigError::ShareFailureTooLong {
                share_failure: self.share_failure,
                max: MAX_SHARE_FAILURE,
            });
        }
        if self.lease < MIN_LEASE {
            return Err(EngineConfigError::LeaseTooShort {
                lease: self.lease,
                min: MIN_LEASE,
            });
        }
        if self.ttl < self.lease {
            return Err(EngineConfigError::TtlShorterThanLease {
                ttl: self.ttl,
                lease: self.lease,
            });
        }
        Ok(())
    }

    /// These settings with the lease raised to [`MIN_LEASE`] when it was
    /// below and `share_failure` lowered to [`MAX_SHARE_FAILURE`] when it
    /// was above (the TTL is left as given).
    pub fn clamped(mut self) -> Self {
        self.lease = self.lease.max(MIN_LEASE);
        self.share_failure = self.share_failure.min(MAX_SHARE_FAILURE);
        self
    }
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            lease: DEFAULT_LEASE,
            ttl: DEFAULT_TTL,
            wait: DEFAULT_WAIT,
            watchdog: DEFAULT_WATCHDOG,
            on_cancel: DEFAULT_ON_CANCEL,
            save_wait: DEFAULT_SAVE_WAIT,
            save_retry: DEFAULT_SAVE_RETRY,
            share_failure: DEFAULT_SHARE_FAILURE,
            hold_for: DEFAULT_HOLD_FOR,
        }
    }
}

/// What happened to the key after the operation ran.
#[derive(Debug)]
pub enum Saved {
    /// The result was stored.
    Stored,
    /// The key was released (after [`Action::ReleaseWith`]: once its
    /// answer's [`EngineConfig::share_failure`] window ends).
    Released,
    /// The key is held: its outcome is unknown ([`Action::Hold`]), so it
    /// stays in flight until its lease ends (at least
    /// [`EngineConfig::hold_for`]) or an operator settles it.
    Held,
    /// The lease was lost (expired and taken over) before the result could be
    /// written; the newer holder's outcome stands.
    LeaseLost,
    /// Writing failed; the key is left to its lease (never released, so no
    /// second run starts while the outcome is unknown).
    Failed(StoreError),
}

/// The result of [`Engine::execute`].
#[derive(Debug)]
pub enum Outcome<T> {
    /// This call ran the operation.
    Executed {
        /// The operation's output.
        value: T,
        /// The fencing token this run held.
        fence: u64,
        /// What happened to the key.
        saved: Saved,
    },
    /// A previous run's stored result.
    Replayed(StoredResponse),
    /// Another run holds the key (after waiting up to [`EngineConfig::wait`]).
    InFlight {
        /// Time left on its lease.
        retry_after: Duration,
    },
    /// The key was used for a different request.
    Mismatch,
}

/// Runs operations at most once per (scope, key).
///
/// ```
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// use idem_core::{Engine, MemoryStore, Scope, IdempotencyKey, Fingerprint, Once};
/// let engine = Engine::new(MemoryStore::new());
/// let key = IdempotencyKey::new("order-42")?;
/// let run = || async { Ok::<_, std::io::Error>(42u32) };
/// let first = engine.once(&Scope::anonymous(), &key, Fingerprint::of(b"charge 10"), run).await?;
/// assert_eq!(first, Once::Executed(42));
/// let again = engine.once(&Scope::anonymous(), &key, Fingerprint::of(b"charge 10"), run).await?;
/// assert_eq!(again, Once::Replayed(42));
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct Engine<S> {
    store: S,
    config: EngineConfig,
}

impl<S: Store + Clone> Engine<S> {
    /// An engine over `store` with [`EngineConfig::default`].
    pub fn new(store: S) -> Self {
        Self::with_config(store, EngineConfig::default())
    }

    /// An engine with explicit settings, never refused: a lease below
    /// [`MIN_LEASE`] (1 s) is raised to it ([`EngineConfig::clamped`]; a
    /// warning is logged once per process), since a shorter lease voids the
    /// guarantee the engine exists for. A TTL shorter than the lease is
    /// kept (a short-lived result is the caller's choice; the gateway
    /// refuses it, [`EngineConfig::validate`] reports it). [`Engine::config`] shows the settings in force. Use
    /// [`Engine::try_with_config`] to have such settings refused instead.
    ///
    /// Why raise rather than refuse here: this constructor cannot fail, a
    /// panic would take a server down over a setting, and a lease given in
    /// the wrong unit (`from_millis(30)` for 30 s) must not turn into
    /// duplicate charges.
    ///
    /// ```
    /// use std::time::Duration;
    /// use idem_core::{Engine, EngineConfig, MemoryStore, MIN_LEASE};
    /// let cfg = EngineConfig { lease: Duration::from_millis(5), ..EngineConfig::default() };
    /// assert_eq!(Engine::with_config(MemoryStore::new(), cfg).config().lease, MIN_LEASE);
    /// ```
    pub fn with_config(store: S, config: EngineConfig) -> Self {
        if let Err(e) = config.validate() {
            static WARNED: std::sync::atomic::AtomicBool =
                std::sync::atomic::AtomicBool::new(false);
            if !WARNED.swap(true, std::sync::atomic::Ordering::Relaxed) {
                tracing::warn!(error = %e, "engine settings outside the checked range; a lease below 1 s is raised to 1 s, a share_failure above 1 min lowered to 1 min");
            }
        }
        Self {
            store,
            config: config.clamped(),
        }
    }

    /// An engine with explicit settings, checked ([`EngineConfig::validate`]).
    ///
    /// ```
    /// use std::time::Duration;
    /// use idem_core::{Engine, EngineConfig, MemoryStore};
    /// let cfg = EngineConfig { lease: Duration::from_nanos(1), ..EngineConfig::default() };
    /// assert!(Engine::try_with_config(MemoryStore::new(), cfg).is_err());
    /// ```
    ///
    /// # Errors
    /// [`EngineConfigError`] for a lease under [`MIN_LEASE`] or a TTL
    /// shorter than the lease.
    pub fn try_with_config(store: S, config: EngineConfig) -> Result<Self, EngineConfigError> {
        config.validate()?;
        Ok(Self { store, config })
    }

    /// The store.
    pub fn store(&self) -> &S {
        &self.store
    }

    /// The settings.
    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// Claims the key (waiting for an in-flight original up to
    /// [`EngineConfig::wait`]). Most callers want [`Engine::execute`].
    ///
    /// A `req.lease` below [`MIN_LEASE`] (1 s; 0 included) is raised to it,
    /// as [`Engine::with_config`] does, so no request can claim a key for
    /// less than the floor.
    ///
    /// A shared failure ([`Action::ReleaseWith`]) is answered
    /// ([`Begin::Replay`] of a [`StoredResponse::released`] response) only to
    /// a caller that waited here for the execution that produced it; any
    /// other caller waits out its window (up to twice
    /// [`EngineConfig::share_failure`], at least 100 ms) and claims the key,
    /// or gets the shared answer when the window outlasts that (another
    /// instance sharing for longer).
    ///
    /// # Errors
    /// The store's errors; the operation must not run.
    pub async fn begin(&self, req: &BeginRequest) -> Result<Begin, StoreError> {
        // A lease below the floor would let duplicates run again (issue 16
        // item 7: `BeginRequest::lease` of 0 bypassed `with_config`'s clamp).
        let raised;
        let req = if req.lease < MIN_LEASE {
            raised = BeginRequest {
                lease: MIN_LEASE,
                ..req.clone()
            };
            &raised
        } else {
            req
        };
        // `None`: a wait too long to represent (`Duration::MAX`): no deadline.
        let deadline = deadline_after(self.config.wait);
        // Whether this caller waited for an execution of the key: only then
        // is a shared failure ([`StoredResponse::released`]) its answer.
        let mut waited = false;
        // How long a later retry waits out a shared failure's window.
        let mut window_end: Option<tokio::time::Instant> = None;
        loop {
            let b = self.store.begin(req).await?;
            let retry_after = match b {
                Begin::InFlight { retry_after } => retry_after,
                Begin::Replay(r) if r.released && !waited => {
                    // A later retry, not a duplicate that overlapped the
                    // execution: the failure had no effect and is not its
                    // answer, so it runs once the window ends (at most
                    // twice this engine's `share_failure`, or 100 ms; past
                    // that — another instance's longer window — it gets
                    // the shared answer).
                    let end = *window_end.get_or_insert_with(|| {
                        let bound = self
                            .config
                            .share_failure
                            .saturating_mul(2)
                            .clamp(Duration::from_millis(100), MAX_WAIT_SLICE);
                        tokio::time::Instant::now() + bound
                    });
                    let left = end.saturating_duration_since(tokio::time::Instant::now());
                    if left.is_zero() {
                        return Ok(Begin::Replay(r));
                    }
                    tokio::time::sleep(left.min(SHARED_FAILURE_POLL)).await;
                    continue;
                }
                b => return Ok(b),
            };
            let left = deadline.map_or(Duration::MAX, |d| {
                d.saturating_duration_since(tokio::time::Instant::now())
            });
            if left.is_zero() {
                return Ok(Begin::InFlight { retry_after });
            }
            // Wake no later than the lease end (to take over a crashed
            // holder), and at least once a minute (a store's own deadline
            // arithmetic never sees an extreme duration).
            let max = left
                .min(retry_after.max(Duration::from_millis(1)))
                .min(MAX_WAIT_SLICE);
            waited = true;
            self.store
                .wait_for_change(&req.scope, &req.key, max)
                .await?;
        }
    }

    /// Runs `op` once for (`scope`, `key`): claims the key, runs the
    /// operation while a watchdog renews the lease, then applies the
    /// [`Action`] the operation returned (store, release or hold), before
    /// handing back its output.
    ///
    /// Cancellation: dropping the returned future while `op` runs stops the
    /// watchdog and applies [`EngineConfig::on_cancel`], so the key is never
    /// stuck for longer than its lease.
    ///
    /// # Errors
    /// A store error from `begin` (the operation did not run). Errors while
    /// saving are reported in [`Outcome::Executed`]'s `saved`, since the
    /// operation already ran.
    pub async fn execute<T, F, Fut>(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        fingerprint: Fingerprint,
        op: F,
    ) -> Result<Outcome<T>, StoreError>
    where
        F: FnOnce(Lease) -> Fut,
        Fut: Future<Output = (T, Action)>,
    {
        let req = BeginRequest {
            scope: scope.clone(),
            key: key.clone(),
            fingerprint,
            lease: self.config.lease,
        };
        let lease = match self.begin(&req).await? {
            Begin::Acquired(lease) => lease,
            Begin::InFlight { retry_after } => return Ok(Outcome::InFlight { retry_after }),
            Begin::Replay(r) => return Ok(Outcome::Replayed(r)),
            Begin::Mismatch => return Ok(Outcome::Mismatch),
        };
        let fence = lease.fence;
        if lease.took_over {
            metrics::counter!(LEASE_TAKEOVERS).increment(1);
        }
        let (value, action, lost) = self.run_watched(&lease, op).await;
        let saved = match self.settle(key, lease, action).await {
            Settled::Key(saved) => {
                if lost && !matches!(saved, Saved::LeaseLost) {
                    tracing::warn!(key = %key, fence, "lease renewal failed while the operation ran");
                }
                saved
            }
            Settled::SaveGaveUp(e) => Saved::Failed(e),
        };
        if matches!(saved, Saved::LeaseLost) {
            metrics::counter!(LEASE_LOST).increment(1);
        }
        Ok(Outcome::Executed {
            value,
            fence,
            saved,
        })
    }

    /// Runs `op` on the claimed `lease` while a watchdog renews it (when
    /// [`EngineConfig::watchdog`] is on and the lease is above 0). Returns
    /// the operation's output, its [`Action`], and whether the watchdog
    /// found the lease lost while it ran.
    ///
    /// Dropping this future before `op` finishes applies
    /// [`EngineConfig::on_cancel`] (through a [`ClaimGuard`]).
    async fn run_watched<T, F, Fut>(&self, lease: &Lease, op: F) -> (T, Action, bool)
    where
        F: FnOnce(Lease) -> Fut,
        Fut: Future<Output = (T, Action)>,
    {
        let mut guard = ClaimGuard {
            store: self.store.clone(),
            lease: Some(lease.clone()),
            on_cancel: self.config.on_cancel.clone(),
            hold_for: self.config.hold_for,
        };
        let run = op(lease.clone());
        // The watchdog runs in this task beside the operation (one timer,
        // no spawned task per execution): it renews while the operation is
        // polled and stops when the operation finishes or this future is
        // dropped. An operation that blocks its thread also blocks renewal.
        let ((value, action), lost) = if self.config.watchdog && !self.config.lease.is_zero() {
            let renew = watchdog(self.store.clone(), lease.clone(), self.config.lease);
            tokio::pin!(run, renew);
            tokio::select! {
                biased;
                out = &mut run => (out, false),
                // Only returns once the lease is lost; the operation still
                // finishes, and saving it then reports `LeaseLost`.
                () = &mut renew => (run.await, true),
            }
        } else {
            (run.await, false)
        };
        // From here the guard must not act on drop: saving is short and a
        // drop now is treated like a failed save (the key is held).
        guard.lease = None;
        (value, action, lost)
    }

    /// Applies the run's [`Action`] to its key: saves the result
    /// ([`ResultSave`]), releases the key, or holds it. The watchdog
    /// extended the lease in the store; the fence is what counts, so the
    /// lease as claimed still identifies the run.
    async fn settle(&self, key: &IdempotencyKey, lease: Lease, action: Action) -> Settled {
        match action {
            Action::Store(response) => {
                ResultSave::new(self.store.clone(), lease, response, &self.config)
                    .save(key)
                    .await
            }
            Action::Release => Settled::Key(self.release(key, &lease).await),
            Action::ReleaseWith(response) => {
                Settled::Key(self.release_with(key, &lease, response).await)
            }
            Action::Hold(reason) => Settled::Key(self.hold(key, &lease, reason).await),
        }
    }

    /// Marks the key held for `reason` and keeps it at least
    /// [`EngineConfig::hold_for`] ([`Store::hold`]). When the store cannot
    /// be written the key is still in flight, so it is held all the same
    /// until its lease ends; only a lost lease is reported differently.
    async fn hold(&self, key: &IdempotencyKey, lease: &Lease, reason: HoldReason) -> Saved {
        match hold_key(&self.store, lease, reason, self.config.hold_for).await {
            Err(StoreError::LeaseLost { .. }) => Saved::LeaseLost,
            Ok(()) | Err(_) => {
                let fence = lease.fence;
                tracing::warn!(key = %key, fence, reason = %reason, "the outcome is unknown; the key is held");
                Saved::Held
            }
        }
    }

    /// Frees the key after a failure without effect, sharing `response`
    /// with duplicates for [`EngineConfig::share_failure`] first: one
    /// `complete` with that TTL and the response marked
    /// [`StoredResponse::released`]. When that write fails (not a lost
    /// lease), a plain release is tried instead, so the key is never held
    /// longer than with [`Action::Release`].
    async fn release_with(
        &self,
        key: &IdempotencyKey,
        lease: &Lease,
        mut response: StoredResponse,
    ) -> Saved {
        if self.config.share_failure.is_zero() {
            return self.release(key, lease).await;
        }
        response.released = true;
        match self
            .store
            .complete(lease, &response, self.config.share_failure)
            .await
        {
            Ok(()) => Saved::Released,
            Err(StoreError::LeaseLost { .. }) => Saved::LeaseLost,
            Err(e) => {
                let fence = lease.fence;
                tracing::warn!(key = %key, fence, error = %e, "sharing the failure with duplicates failed; releasing the key");
                self.release(key, lease).await
            }
        }
    }

    /// Frees the key after a run that asked for [`Action::Release`].
    async fn release(&self, key: &IdempotencyKey, lease: &Lease) -> Saved {
        match self.store.release(lease).await {
            Ok(()) => Saved::Released,
            Err(StoreError::LeaseLost { .. }) => Saved::LeaseLost,
            Err(e) => {
                let fence = lease.fence;
                tracing::warn!(key = %key, fence, error = %e, "releasing the key failed; it frees itself when its lease ends");
                Saved::Failed(e)
            }
        }
    }

    /// Runs a fallible operation once and replays its JSON-encoded output:
    /// `Ok` is stored (status 200, JSON body) and replayed to duplicates;
    /// `Err` releases the key so a retry runs again.
    ///
    /// # Errors
    /// [`OnceError::InFlight`] while another run holds the key,
    /// [`OnceError::Mismatch`] for another fingerprint, [`OnceError::Operation`]
    /// with the operation's error, [`OnceError::Store`] when the store fails
    /// before the run, [`OnceError::Decode`] when a stored result does not
    /// decode as `T`.
    pub async fn once<T, E, F, Fut>(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        fingerprint: Fingerprint,
        op: F,
    ) -> Result<Once<T>, OnceError<E>>
    where
        T: Serialize + DeserializeOwned,
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        let out = self
            .execute(scope, key, fingerprint, |_lease| async move {
                let r = op().await;
                let action = match &r {
                    Ok(v) => match serde_json::to_vec(v) {
                        Ok(body) => Action::Store(StoredResponse::new(200, body)),
                        Err(_) => Action::Hold(HoldReason::Unknown),
                    },
                    Err(_) => Action::Release,
                };
                (r, action)
            })
            .await
            .map_err(OnceError::Store)?;
        match out {
            Outcome::Executed { value, .. } => {
                value.map(Once::Executed).map_err(OnceError::Operation)
            }
            Outcome::Replayed(r) => serde_json::from_slice(&r.body)
                .map(Once::Replayed)
                .map_err(OnceError::Decode),
            Outcome::InFlight { retry_after } => Err(OnceError::InFlight { retry_after }),
            Outcome::Mismatch => Err(OnceError::Mismatch),
        }
    }
}

/// The result of [`Engine::once`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Once<T> {
    /// This call ran the operation.
    Executed(T),
    /// An earlier run's result.
    Replayed(T),
}

impl<T> Once<T> {
    /// The value, however it was obtained.
    pub fn into_inner(self) -> T {
        match self {
            Once::Executed(v) | Once::Replayed(v) => v,
        }
    }
}

/// Why [`Engine::once`] did not produce a value.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OnceError<E> {
    /// Another run holds the key.
    #[error("operation in flight; retry after {retry_after:?}")]
    InFlight {
        /// Time left on its lease.
        retry_after: Duration,
    },
    /// The key was used with another fingerprint.
    #[error("idempotency key reused for a different request")]
    Mismatch,
    /// The operation failed (the key was released).
    #[error("operation failed")]
    Operation(#[source] E),
    /// The store failed before the operation ran.
    #[error(transparent)]
    Store(StoreError),
    /// The stored result does not decode as the requested type.
    #[error("stored result does not decode")]
    Decode(#[source] serde_json::Error),
}

/// Backoff of [`ResultSave`]: the first pause between two attempts (it
/// doubles after each one, up to [`SAVE_MAX_DELAY`]).
const SAVE_FIRST_DELAY: Duration = Duration::from_millis(20);
/// Backoff of [`ResultSave`]: the longest pause between two attempts.
const SAVE_MAX_DELAY: Duration = Duration::from_secs(1);
/// Refused `complete`s (while `extend` succeeds) after which [`ResultSave`]
/// saves the result without its body.
const SAVE_STRIKES: u32 = 5;

/// The save of a run's result ([`Action::Store`]) and its bounded retry.
///
/// 1. While the caller waits, up to [`EngineConfig::save_wait`]: `complete`,
///    retried with backoff (20 ms doubling to 1 s), the lease renewed with
///    `extend` between two attempts, so duplicates get `InFlight`, never a
///    second run.
/// 2. If every attempt failed: with [`EngineConfig::save_retry`] above 0,
///    the same attempts go on in a spawned task for up to `save_retry` (the
///    caller gets [`Saved::Failed`] with the last error); with 0, the save
///    gives up and the key is held until its lease ends.
///
/// Either way it stops early when the lease is lost (another run took the
/// key over: [`Saved::LeaseLost`]). When the store answers `extend` but
/// refuses `complete` five times (not timeouts: the result itself is
/// refused, e.g. too large), the result is saved without its body
/// (`body_omitted`), so duplicates get a clear refusal instead of a
/// second run.
#[derive(Debug)]
struct ResultSave<S> {
    store: S,
    lease: Lease,
    response: StoredResponse,
    ttl: Duration,
    lease_for: Duration,
    /// How long the caller waits ([`EngineConfig::save_wait`]).
    wait: Duration,
    /// How long the background retry goes on ([`EngineConfig::save_retry`]).
    retry: Duration,
    /// How long the key is held once the save is given up
    /// ([`EngineConfig::hold_for`]).
    hold_for: Duration,
    /// `complete`s refused (not timed out) while `extend` succeeded: the
    /// store is up and refuses the result itself.
    strikes: u32,
    /// The next pause between two attempts.
    delay: Duration,
}

/// How [`Engine::execute`] settled a run's key.
#[derive(Debug)]
enum Settled {
    /// What happened to the key (also a failed save whose retry goes on in
    /// the background).
    Key(Saved),
    /// The save failed and gave up at once ([`EngineConfig::save_retry`]
    /// is 0); already logged, and the key is held until its lease ends.
    SaveGaveUp(StoreError),
}

impl<S: Store> ResultSave<S> {
    /// The save of `response` under `lease`, with `config`'s TTL, lease
    /// length, `save_wait` and `save_retry`.
    fn new(store: S, lease: Lease, response: StoredResponse, config: &EngineConfig) -> Self {
        Self {
            store,
            lease,
            response,
            ttl: config.ttl,
            lease_for: config.lease,
            wait: config.save_wait,
            retry: config.save_retry,
            hold_for: config.hold_for,
            strikes: 0,
            delay: SAVE_FIRST_DELAY,
        }
    }

    /// Saves while the caller waits, then hands a failed save to the
    /// background retry (see the type's doc). `key` names the run in logs.
    async fn save(mut self, key: &IdempotencyKey) -> Settled {
        let fence = self.lease.fence;
        let wait = deadline_after(self.wait);
        let e = match self.attempt_until(wait).await {
            Ok(saved) => return Settled::Key(saved),
            Err(e) => e,
        };
        if self.retry.is_zero() {
            self.give_up(key, &e).await;
            return Settled::SaveGaveUp(e);
        }
        tracing::error!(key = %key, fence, error = %e, "saving the result failed; still retrying in the background while the lease is kept alive");
        self.retry_in_background(key.clone(), fence);
        Settled::Key(Saved::Failed(e))
    }

    /// Spawns the attempts for up to [`Self::retry`] more; logs how they end.
    fn retry_in_background(mut self, key: IdempotencyKey, fence: u64) {
        let until = deadline_after(self.retry);
        tokio::spawn(async move {
            match self.attempt_until(until).await {
                Ok(Saved::Stored) => {
                    tracing::info!(key = %key, fence, "the result was saved on a later attempt")
                }
                Ok(_) => {
                    metrics::counter!(LEASE_LOST).increment(1);
                    tracing::warn!(key = %key, fence, "the lease was lost before the result could be saved")
                }
                Err(e) => self.give_up(&key, &e).await,
            }
        });
    }

    /// The end of a save that failed for good: counted
    /// (`idem_saves_given_up_total`), logged at ERROR with the key and
    /// fence, and the key held ([`HoldReason::SaveFailed`], at least
    /// [`EngineConfig::hold_for`]) — when the store takes that write.
    async fn give_up(&self, key: &IdempotencyKey, e: &StoreError) {
        metrics::counter!(SAVES_GIVEN_UP).increment(1);
        let fence = self.lease.fence;
        let held = hold_key(
            &self.store,
            &self.lease,
            HoldReason::SaveFailed,
            self.hold_for,
        )
        .await
        .is_ok();
        let until = if held {
            "held (save-failed) until an operator settles it or its hold ends"
        } else {
            "in flight until its lease ends"
        };
        tracing::error!(key = %key, fence, error = %e, "GAVE UP saving the result: the operation ran but its result is not stored, and a retry after the key is free runs it again; the key is {until} (`idem keys get` / `release` / `complete`)");
    }

    /// Tries until saved, the lease is lost, or `until` passes (then the
    /// last error); `None`: no deadline (a duration too long to represent).
    async fn attempt_until(
        &mut self,
        until: Option<tokio::time::Instant>,
    ) -> Result<Saved, StoreError> {
        // Whether a `complete` was sent whose answer was lost (timed out,
        // or the connection failed): it may have saved the result.
        let mut maybe_saved = false;
        loop {
            let err = match self
                .store
                .complete(&self.lease, &self.response, self.ttl)
                .await
            {
                Ok(()) => return Ok(Saved::Stored),
                Err(StoreError::LeaseLost { .. }) => return Ok(self.lost(maybe_saved).await),
                Err(e) => e,
            };
            maybe_saved |= matches!(
                err,
                StoreError::Timeout { .. } | StoreError::Unavailable { .. }
            );
            match self.store.extend(&self.lease, self.lease_for).await {
                Ok(l) => {
                    self.lease = l;
                    // A timeout says nothing about the payload; a definite
                    // refusal while the store answers `extend` does.
                    if !matches!(err, StoreError::Timeout { .. }) {
                        self.strikes += 1;
                    }
                    if self.strikes >= SAVE_STRIKES && !self.response.body_omitted {
                        tracing::error!(key = %self.lease.key, error = %err, body_bytes = self.response.body.len(), "the store keeps refusing this result; saving it without its body");
                        self.response.body = bytes::Bytes::new();
                        self.response.body_omitted = true;
                        metrics::counter!(SAVE_RETRIES).increment(1);
                        continue;
                    }
                }
                Err(StoreError::LeaseLost { .. }) => return Ok(self.lost(maybe_saved).await),
                Err(_) => {}
            }
            if let Some(until) = until {
                if deadline_after(self.delay).is_none_or(|next| next > until) {
                    return Err(err);
                }
            }
            tokio::time::sleep(self.delay).await;
            self.delay = (self.delay * 2).min(SAVE_MAX_DELAY);
            metrics::counter!(SAVE_RETRIES).increment(1);
        }
    }
}

impl<S: Store> ResultSave<S> {
    /// What a lost lease during the save means. After a `complete` whose
    /// answer was lost, the lease is also "lost" when that very attempt
    /// saved the result (the record is no longer in flight under our
    /// fence), so the record is read back once: completed with exactly
    /// this response is [`Saved::Stored`] — no other run owns the key, and
    /// reporting a lost lease would raise a false alarm of a second run.
    /// Otherwise (or when the read fails) [`Saved::LeaseLost`].
    async fn lost(&self, maybe_saved: bool) -> Saved {
        if maybe_saved {
            if let Ok(Some(Record {
                state: RecordState::Completed { response, .. },
                ..
            })) = self.store.get(&self.lease.scope, &self.lease.key).await
            {
                if response == self.response {
                    tracing::info!(key = %self.lease.key, fence = self.lease.fence, "the result was saved by an attempt whose answer was lost");
                    return Saved::Stored;
                }
            }
        }
        Saved::LeaseLost
    }
}

/// The longest single [`Store::wait_for_change`] of [`Engine::begin`]:
/// 60 s. A longer [`EngineConfig::wait`] is waited in slices of it.
const MAX_WAIT_SLICE: Duration = Duration::from_secs(60);

/// How often a later retry that found a shared failure looks again for the
/// end of its window ([`Engine::begin`]).
const SHARED_FAILURE_POLL: Duration = Duration::from_millis(20);

/// Now plus `d`, or `None` when that is not representable (`Duration::MAX`,
/// `u64::MAX` seconds): no deadline.
fn deadline_after(d: Duration) -> Option<tokio::time::Instant> {
    tokio::time::Instant::now().checked_add(d)
}

/// Renews the lease every third of its length; returns only once the lease
/// is lost (dropping the future stops it).
async fn watchdog<S: Store>(store: S, mut lease: Lease, every: Duration) {
    let period = (every / 3).max(Duration::from_millis(1));
    loop {
        tokio::time::sleep(period).await;
        match store.extend(&lease, every).await {
            Ok(l) => lease = l,
            Err(StoreError::LeaseLost { .. }) => return,
            // A transient failure: try again next period; the lease may still hold.
            Err(e) => tracing::warn!(key = %lease.key, error = %e, "lease renewal failed"),
        }
    }
}

/// One [`Store::hold`] call for `lease`; a failure other than a lost lease
/// is logged (the key then stays in flight until its current lease ends).
async fn hold_key<S: Store>(
    store: &S,
    lease: &Lease,
    reason: HoldReason,
    hold_for: Duration,
) -> Result<(), StoreError> {
    match store.hold(lease, reason, hold_for).await {
        Ok(_) => Ok(()),
        Err(e) => {
            if !matches!(e, StoreError::LeaseLost { .. }) {
                let fence = lease.fence;
                tracing::warn!(key = %lease.key, fence, reason = %reason, error = %e, "marking the key held failed; it stays in flight until its lease ends");
            }
            Err(e)
        }
    }
}

/// Undoes a claim whose operation was dropped mid-flight.
struct ClaimGuard<S: Store + Clone> {
    store: S,
    lease: Option<Lease>,
    on_cancel: Action,
    /// [`EngineConfig::hold_for`].
    hold_for: Duration,
}

impl<S: Store + Clone> Drop for ClaimGuard<S> {
    fn drop(&mut self) {
        let Some(lease) = self.lease.take() else {
            return;
        };
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            // No runtime: the watchdog is stopped, so the key frees itself
            // when the lease ends.
            return;
        };
        let store = self.store.clone();
        if self.on_cancel == Action::Release {
            rt.spawn(async move {
                let _ = store.release(&lease).await;
            });
        } else {
            let (reason, hold_for) = match self.on_cancel {
                Action::Hold(reason) => (reason, self.hold_for),
                _ => (HoldReason::Cancelled, self.hold_for),
            };
            rt.spawn(async move {
                let _ = hold_key(&store, &lease, reason, hold_for).await;
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MemoryStore;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    #[test]
    fn a_share_failure_over_the_maximum_is_refused_or_lowered() {
        let c = EngineConfig {
            share_failure: MAX_SHARE_FAILURE + Duration::from_millis(1),
            ..EngineConfig::default()
        };
        assert!(matches!(
            c.validate(),
            Err(EngineConfigError::ShareFailureTooLong { .. })
        ));
        assert_eq!(
            Engine::with_config(MemoryStore::new(), c)
                .config()
                .share_failure,
            MAX_SHARE_FAILURE
        );
        let max = EngineConfig {
            share_failure: MAX_SHARE_FAILURE,
            ..EngineConfig::default()
        };
        assert!(max.validate().is_ok());
    }

    #[test]
    fn the_floor_is_checked_and_the_infallible_path_raises_to_it() {
        for lease in [
            Duration::ZERO,
            Duration::from_nanos(1),
            Duration::from_micros(999),
            Duration::from_millis(999),
        ] {
            let c = EngineConfig {
                lease,
                ..EngineConfig::default()
            };
            assert_eq!(
                c.validate(),
                Err(EngineConfigError::LeaseTooShort {
                    lease,
                    min: MIN_LEASE
                })
            );
            assert!(Engine::try_with_config(MemoryStore::new(), c.clone()).is_err());
            assert_eq!(
                Engine::with_config(MemoryStore::new(), c).config().lease,
                MIN_LEASE
            );
        }
        let c = EngineConfig {
            lease: Duration::from_secs(10),
            ttl: Duration::from_secs(5),
            ..EngineConfig::default()
        };
        assert!(matches!(
            c.validate(),
            Err(EngineConfigError::TtlShorterThanLease { .. })
        ));
        let e = Engine::with_config(MemoryStore::new(), c);
        assert_eq!(e.config().ttl, Duration::from_secs(5), "the ttl is kept");
        let ok = EngineConfig {
            lease: MIN_LEASE,
            ttl: MIN_LEASE,
            ..EngineConfig::default()
        };
        assert!(Engine::try_with_config(MemoryStore::new(), ok).is_ok());
    }

    /// Issue 11 item 3: a 1 ns lease let concurrent duplicates run again.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_tiny_lease_does_not_let_concurrent_duplicates_run_again() {
        let engine = Engine::with_config(
            MemoryStore::new(),
            EngineConfig {
                lease: Duration::from_nanos(1),
                watchdog: false,
                ..EngineConfig::default()
            },
        );
        let runs = Arc::new(AtomicUsize::new(0));
        let key = IdempotencyKey::new("tiny-lease").unwrap();
        let tasks: Vec<_> = (0..20)
            .map(|i| {
                let (engine, runs, key) = (engine.clone(), runs.clone(), key.clone());
                tokio::spawn(async move {
                    // Duplicates arriving over 100 ms, as retries do.
                    tokio::time::sleep(Duration::from_millis(5 * i)).await;
                    engine
                        .execute(
                            &Scope::anonymous(),
                            &key,
                            Fingerprint::of(b"charge"),
                            |_| async move {
                                runs.fetch_add(1, Ordering::SeqCst);
                                tokio::time::sleep(Duration::from_millis(300)).await;
                                ((), Action::Store(StoredResponse::new(201, "ok")))
                            },
                        )
                        .await
                        .unwrap();
                })
            })
            .collect();
        for t in tasks {
            t.await.unwrap();
        }
        assert_eq!(runs.load(Ordering::SeqCst), 1);
    }

    /// A store whose first `fail` `complete`s time out (then it works).
    #[derive(Debug, Clone)]
    struct FlakyComplete {
        inner: MemoryStore,
        fail: Arc<AtomicUsize>,
    }

    #[async_trait::async_trait]
    impl Store for FlakyComplete {
        async fn begin(&self, req: &BeginRequest) -> Result<Begin, StoreError> {
            self.inner.begin(req).await
        }
        async fn complete(
            &self,
            lease: &Lease,
            response: &StoredResponse,
            ttl: Duration,
        ) -> Result<(), StoreError> {
            let left = self.fail.load(Ordering::SeqCst);
            if left > 0 {
                self.fail.store(left - 1, Ordering::SeqCst);
                return Err(StoreError::Timeout {
                    phase: crate::Phase::Complete,
                });
            }
            self.inner.complete(lease, response, ttl).await
        }
        async fn release(&self, lease: &Lease) -> Result<(), StoreError> {
            self.inner.release(lease).await
        }
        async fn extend(&self, lease: &Lease, lease_for: Duration) -> Result<Lease, StoreError> {
            self.inner.extend(lease, lease_for).await
        }
        async fn hold(
            &self,
            lease: &Lease,
            reason: HoldReason,
            hold_for: Duration,
        ) -> Result<Lease, StoreError> {
            self.inner.hold(lease, reason, hold_for).await
        }
        async fn get(
            &self,
            scope: &Scope,
            key: &IdempotencyKey,
        ) -> Result<Option<crate::Record>, StoreError> {
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

    fn stored(body: &'static str) -> ((), Action) {
        ((), Action::Store(StoredResponse::new(200, body)))
    }

    /// Issue 16 item 7: `wait = Duration::MAX` panicked at `Instant + wait`
    /// (every guarded request a 500). Now it waits without a deadline: the
    /// duplicate gets the original's replay.
    #[tokio::test]
    async fn an_unbounded_wait_waits_for_the_original() {
        for wait in [Duration::MAX, Duration::from_secs(u64::MAX)] {
            let engine = Engine::with_config(
                MemoryStore::new(),
                EngineConfig {
                    wait,
                    ..EngineConfig::default()
                },
            );
            let key = IdempotencyKey::new("wait-max").unwrap();
            let (started_tx, started_rx) = tokio::sync::oneshot::channel();
            let first = {
                let (engine, key) = (engine.clone(), key.clone());
                tokio::spawn(async move {
                    engine
                        .execute(
                            &Scope::anonymous(),
                            &key,
                            Fingerprint::of(b"x"),
                            |_| async {
                                let _ = started_tx.send(());
                                tokio::time::sleep(Duration::from_millis(100)).await;
                                stored("first")
                            },
                        )
                        .await
                        .unwrap()
                })
            };
            started_rx.await.unwrap();
            let dup = engine
                .execute(
                    &Scope::anonymous(),
                    &key,
                    Fingerprint::of(b"x"),
                    |_| async { stored("second") },
                )
                .await
                .unwrap();
            assert!(
                matches!(&dup, Outcome::Replayed(r) if r.body == "first"),
                "{wait:?}: {dup:?}"
            );
            assert!(matches!(first.await.unwrap(), Outcome::Executed { .. }));
        }
    }

    /// Issue 16 item 7: `save_wait` / `save_retry = Duration::MAX` panicked
    /// after the operation ran (the result lost, the key in flight). Now a
    /// save that fails twice is retried and stored.
    #[tokio::test]
    async fn unbounded_save_wait_and_retry_still_save() {
        for (save_wait, save_retry) in [
            (Duration::MAX, Duration::MAX),
            (Duration::ZERO, Duration::MAX),
            (Duration::from_secs(u64::MAX), Duration::ZERO),
        ] {
            let store = FlakyComplete {
                inner: MemoryStore::new(),
                fail: Arc::new(AtomicUsize::new(2)),
            };
            let engine = Engine::with_config(
                store.clone(),
                EngineConfig {
                    save_wait,
                    save_retry,
                    ..EngineConfig::default()
                },
            );
            let key = IdempotencyKey::new("save-max").unwrap();
            let out = engine
                .execute(
                    &Scope::anonymous(),
                    &key,
                    Fingerprint::of(b"x"),
                    |_| async { stored("ok") },
                )
                .await
                .unwrap();
            assert!(matches!(out, Outcome::Executed { .. }), "{out:?}");
            // Saved while the caller waited, or by the background retry.
            let mut replayed = false;
            for _ in 0..100 {
                let again = engine
                    .execute(
                        &Scope::anonymous(),
                        &key,
                        Fingerprint::of(b"x"),
                        |_| async { stored("again") },
                    )
                    .await
                    .unwrap();
                if let Outcome::Replayed(r) = again {
                    assert_eq!(r.body, "ok");
                    replayed = true;
                    break;
                }
                assert!(matches!(again, Outcome::InFlight { .. }), "{again:?}");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            assert!(
                replayed,
                "{save_wait:?}/{save_retry:?}: the result was saved"
            );
        }
    }

    /// Issue 16 item 7: `Engine::begin` with a request whose lease is 0
    /// passed it to the store (bypassing the 1 s floor of `with_config`), so
    /// a second copy could take the key over at once.
    #[tokio::test]
    async fn begin_raises_a_zero_lease_to_the_floor() {
        let engine = Engine::new(MemoryStore::new());
        let req = BeginRequest {
            scope: Scope::anonymous(),
            key: IdempotencyKey::new("zero-lease").unwrap(),
            fingerprint: Fingerprint::of(b"x"),
            lease: Duration::ZERO,
        };
        assert!(matches!(
            engine.begin(&req).await.unwrap(),
            Begin::Acquired(_)
        ));
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(
            matches!(engine.begin(&req).await.unwrap(), Begin::InFlight { .. }),
            "a second copy must not take over a live claim"
        );
    }

    mod extremes {
        use super::*;
        use proptest::prelude::*;

        /// 0, 1 ns, 1 ms, 1 s, 30 s, `u64::MAX` s, `Duration::MAX`.
        fn extreme() -> impl Strategy<Value = Duration> {
            prop_oneof![
                Just(Duration::ZERO),
                Just(Duration::from_nanos(1)),
                Just(Duration::from_millis(1)),
                Just(MIN_LEASE),
                Just(Duration::from_secs(30)),
                Just(Duration::from_secs(u64::MAX)),
                Just(Duration::MAX),
            ]
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(48))]

            /// Issue 16 item 7: every duration of `EngineConfig` at an
            /// extreme: no panic; `try_with_config` refuses with a typed
            /// error or gives an engine that runs once and replays, and so
            /// does `with_config` (which raises a short lease).
            #[test]
            fn extreme_engine_settings_never_panic(
                lease in extreme(), ttl in extreme(), wait in extreme(),
                save_wait in extreme(), save_retry in extreme(), watchdog in any::<bool>(),
                share_failure in extreme(), hold_for in extreme(),
            ) {
                let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
                rt.block_on(async {
                    let config = EngineConfig { lease, ttl, wait, watchdog, save_wait, save_retry, share_failure, hold_for, ..EngineConfig::default() };
                    match Engine::try_with_config(MemoryStore::new(), config.clone()) {
                        Ok(e) => prop_assert!(e.config().lease >= MIN_LEASE),
                        Err(EngineConfigError::ShareFailureTooLong { .. }) => prop_assert!(share_failure > MAX_SHARE_FAILURE),
                        Err(EngineConfigError::LeaseTooShort { .. }) => prop_assert!(lease < MIN_LEASE),
                        Err(EngineConfigError::TtlShorterThanLease { .. }) => prop_assert!(ttl < lease),
                    }
                    let engine = Engine::with_config(MemoryStore::new(), config);
                    prop_assert!(engine.config().lease >= MIN_LEASE);
                    prop_assert!(engine.config().share_failure <= MAX_SHARE_FAILURE);
                    let key = IdempotencyKey::new("extreme").unwrap();
                    let scope = Scope::anonymous();
                    let run = || engine.execute(&scope, &key, Fingerprint::of(b"x"), |_| async {
                        stored("once")
                    });
                    let first = run().await.unwrap();
                    prop_assert!(matches!(first, Outcome::Executed { .. }), "{:?}", first);
                    let again = run().await.unwrap();
                    // A TTL shorter than a millisecond may already have passed.
                    prop_assert!(
                        matches!(&again, Outcome::Replayed(r) if r.body == "once")
                            || (ttl < Duration::from_millis(2) && matches!(again, Outcome::Executed { .. })),
                        "{:?}", again
                    );
                    Ok(())
                })?;
            }
        }
    }
}
