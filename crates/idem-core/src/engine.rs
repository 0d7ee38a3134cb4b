//! The engine: run any async operation at most once per scoped key.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::error::StoreError;
use crate::store::{Begin, BeginRequest, Lease, Store};
use crate::{Fingerprint, IdempotencyKey, Scope, StoredResponse};

/// What to do with a key once its operation has finished.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Keep this result and replay it to every duplicate until the TTL ends.
    Store(StoredResponse),
    /// Free the key: the operation had no effect (or a retry is wanted), so a
    /// retry runs again.
    Release,
    /// The outcome is unknown (e.g. a timeout after the request was sent):
    /// leave the key in flight until its lease ends, so nothing runs again
    /// while the first attempt may still be landing.
    Hold,
}

/// Engine settings.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// How long a claim holds before another caller may take it over
    /// (default 30 s). Renewed by the watchdog while the operation runs.
    pub lease: Duration,
    /// How long a completed result is replayed (default 24 h).
    pub ttl: Duration,
    /// How long a duplicate waits for an in-flight original before it gets
    /// [`Outcome::InFlight`] (default 0: answer at once).
    pub wait: Duration,
    /// Renew the lease every `lease / 3` while the operation runs (default on).
    pub watchdog: bool,
    /// What happens to the key when the operation's future is dropped
    /// before it finishes (default [`Action::Hold`]: its effect is unknown, so
    /// the key frees itself when the lease ends; [`Action::Release`] frees it
    /// at once). [`Action::Store`] is treated as `Hold`.
    pub on_cancel: Action,
    /// How long the caller waits for a result's save to succeed when the
    /// first `complete` fails (default 2 s). Until then the save is retried
    /// with backoff while the lease is renewed, so duplicates get `InFlight`,
    /// never a second run.
    pub save_wait: Duration,
    /// How long a failed save keeps being retried in the background after
    /// `save_wait`, the lease renewed each time (default 10 min). When the
    /// store answers `extend` but keeps refusing `complete` (the response is
    /// too large for it, or a capped store is full), the result is saved
    /// without its body (`body_omitted`), so duplicates get a clear refusal
    /// instead of a second run.
    pub save_retry: Duration,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            lease: Duration::from_secs(30),
            ttl: Duration::from_secs(24 * 3600),
            wait: Duration::ZERO,
            watchdog: true,
            on_cancel: Action::Hold,
            save_wait: Duration::from_secs(2),
            save_retry: Duration::from_secs(600),
        }
    }
}

/// What happened to the key after the operation ran.
#[derive(Debug)]
pub enum Saved {
    /// The result was stored.
    Stored,
    /// The key was released.
    Released,
    /// The key is held until its lease ends.
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

    /// An engine with explicit settings.
    pub fn with_config(store: S, config: EngineConfig) -> Self {
        Self { store, config }
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
    /// # Errors
    /// The store's errors; the operation must not run.
    pub async fn begin(&self, req: &BeginRequest) -> Result<Begin, StoreError> {
        let deadline = tokio::time::Instant::now() + self.config.wait;
        loop {
            let b = self.store.begin(req).await?;
            let Begin::InFlight { retry_after } = b else {
                return Ok(b);
            };
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            if left.is_zero() {
                return Ok(Begin::InFlight { retry_after });
            }
            // Wake no later than the lease end (to take over a crashed holder).
            let max = left.min(retry_after.max(Duration::from_millis(1)));
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
        let mut guard = ClaimGuard {
            store: self.store.clone(),
            lease: Some(lease.clone()),
            on_cancel: self.config.on_cancel.clone(),
        };
        let lost = Arc::new(AtomicBool::new(false));
        let run = op(lease.clone());
        // The watchdog runs in this task beside the operation (one timer,
        // no spawned task per execution): it renews while the operation is
        // polled and stops when the operation finishes or this future is
        // dropped. An operation that blocks its thread also blocks renewal.
        let (value, action) = if self.config.watchdog && !self.config.lease.is_zero() {
            let renew = watchdog(
                self.store.clone(),
                lease.clone(),
                self.config.lease,
                lost.clone(),
            );
            tokio::pin!(run, renew);
            tokio::select! {
                biased;
                out = &mut run => out,
                // Only returns once the lease is lost; the operation still
                // finishes, and saving it then reports `LeaseLost`.
                () = &mut renew => run.await,
            }
        } else {
            run.await
        };
        // From here the guard must not act on drop: saving is short and a
        // drop now is treated like a failed save (the key is held).
        guard.lease = None;
        let current = lease; // the watchdog extends in the store; the fence is what counts
        let saved = match action {
            Action::Store(resp) => {
                let mut saver = Saver {
                    store: self.store.clone(),
                    lease: current.clone(),
                    response: resp,
                    ttl: self.config.ttl,
                    lease_for: self.config.lease,
                    strikes: 0,
                    delay: Duration::from_millis(20),
                };
                let wait = tokio::time::Instant::now() + self.config.save_wait;
                match saver.run_until(wait).await {
                    Ok(saved) => saved,
                    Err(e) => {
                        if self.config.save_retry.is_zero() {
                            tracing::error!(key = %key, fence, error = %e, "saving the result failed; the key is held until its lease ends");
                            return Ok(Outcome::Executed {
                                value,
                                fence,
                                saved: Saved::Failed(e),
                            });
                        }
                        tracing::error!(key = %key, fence, error = %e, "saving the result failed; still retrying in the background while the lease is kept alive");
                        let until = tokio::time::Instant::now() + self.config.save_retry;
                        let key = key.clone();
                        tokio::spawn(async move {
                            match saver.run_until(until).await {
                                Ok(Saved::Stored) => {
                                    tracing::info!(key = %key, fence, "the result was saved on a later attempt")
                                }
                                Ok(_) => {
                                    tracing::warn!(key = %key, fence, "the lease was lost before the result could be saved")
                                }
                                Err(e) => {
                                    tracing::error!(key = %key, fence, error = %e, "gave up saving the result; the key frees itself when its lease ends")
                                }
                            }
                        });
                        Saved::Failed(e)
                    }
                }
            }
            Action::Release => match self.store.release(&current).await {
                Ok(()) => Saved::Released,
                Err(StoreError::LeaseLost { .. }) => Saved::LeaseLost,
                Err(e) => {
                    tracing::warn!(key = %key, fence, error = %e, "releasing the key failed; it frees itself when its lease ends");
                    Saved::Failed(e)
                }
            },
            Action::Hold => Saved::Held,
        };
        if lost.load(Ordering::Relaxed) && !matches!(saved, Saved::LeaseLost) {
            tracing::warn!(key = %key, fence, "lease renewal failed while the operation ran");
        }
        Ok(Outcome::Executed {
            value,
            fence,
            saved,
        })
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
                        Err(_) => Action::Hold,
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

/// Saves a result whose first `complete` may fail: retries with backoff,
/// renews the lease between attempts, and falls back to saving without the
/// body when the store is reachable but keeps refusing the full result.
#[derive(Debug)]
struct Saver<S> {
    store: S,
    lease: Lease,
    response: StoredResponse,
    ttl: Duration,
    lease_for: Duration,
    /// `complete`s refused (not timed out) while `extend` succeeded: the
    /// store is up and refuses the result itself.
    strikes: u32,
    delay: Duration,
}

impl<S: Store> Saver<S> {
    /// Tries until saved, the lease is lost, or `until` passes (then the last error).
    async fn run_until(&mut self, until: tokio::time::Instant) -> Result<Saved, StoreError> {
        loop {
            let err = match self
                .store
                .complete(&self.lease, &self.response, self.ttl)
                .await
            {
                Ok(()) => return Ok(Saved::Stored),
                Err(StoreError::LeaseLost { .. }) => return Ok(Saved::LeaseLost),
                Err(e) => e,
            };
            match self.store.extend(&self.lease, self.lease_for).await {
                Ok(l) => {
                    self.lease = l;
                    // A timeout says nothing about the payload; a definite
                    // refusal while the store answers `extend` does.
                    if !matches!(err, StoreError::Timeout { .. }) {
                        self.strikes += 1;
                    }
                    if self.strikes >= 5 && !self.response.body_omitted {
                        tracing::error!(key = %self.lease.key, error = %err, body_bytes = self.response.body.len(), "the store keeps refusing this result; saving it without its body");
                        self.response.body = bytes::Bytes::new();
                        self.response.body_omitted = true;
                        continue;
                    }
                }
                Err(StoreError::LeaseLost { .. }) => return Ok(Saved::LeaseLost),
                Err(_) => {}
            }
            let now = tokio::time::Instant::now();
            if now + self.delay > until {
                return Err(err);
            }
            tokio::time::sleep(self.delay).await;
            self.delay = (self.delay * 2).min(Duration::from_secs(1));
        }
    }
}

/// Renews the lease every third of its length until aborted or lost.
async fn watchdog<S: Store>(store: S, mut lease: Lease, every: Duration, lost: Arc<AtomicBool>) {
    let period = (every / 3).max(Duration::from_millis(1));
    loop {
        tokio::time::sleep(period).await;
        match store.extend(&lease, every).await {
            Ok(l) => lease = l,
            Err(StoreError::LeaseLost { .. }) => {
                lost.store(true, Ordering::Relaxed);
                return;
            }
            // A transient failure: try again next period; the lease may still hold.
            Err(e) => tracing::warn!(key = %lease.key, error = %e, "lease renewal failed"),
        }
    }
}

/// Undoes a claim whose operation was dropped mid-flight.
struct ClaimGuard<S: Store + Clone> {
    store: S,
    lease: Option<Lease>,
    on_cancel: Action,
}

impl<S: Store + Clone> Drop for ClaimGuard<S> {
    fn drop(&mut self) {
        let Some(lease) = self.lease.take() else {
            return;
        };
        if self.on_cancel == Action::Release {
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                let store = self.store.clone();
                rt.spawn(async move {
                    let _ = store.release(&lease).await;
                });
            }
        }
        // Hold (or no runtime): the watchdog is stopped, so the key frees
        // itself when the lease ends.
    }
}
