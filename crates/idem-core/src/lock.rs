//! A distributed lock by business key (a *name*), with leases, fencing
//! tokens and a renewal watchdog (CASES G1–G4, `docs/patterns/lock.md`).
//!
//! A [`LockBackend`] provides three atomic steps on a name:
//!
//! * `try_acquire(name, ttl)`: grant the name to a fresh random owner token
//!   for `ttl` when nobody holds a live lease on it, with a fencing token
//!   that is larger than every fence granted for the name before (also
//!   across expiry and release); else [`TryAcquire::Busy`].
//! * `extend(lease, ttl)`: one compare-and-extend on the owner token.
//! * `release(lease)`: one compare-and-delete on the owner token: a no-op
//!   (returns `false`) for a holder whose lease has passed and was taken.
//!
//! [`Lock`] wraps a backend with what every caller needs: validation,
//! an acquire that is safe to cancel, retry while busy ([`Lock::acquire`]),
//! a [`LockGuard`] whose watchdog renews the lease at a third of its TTL and
//! fires [`LockGuard::lost`] when renewal fails, and [`Lock::run`].
//!
//! A TTL lock alone does not guarantee mutual exclusion: a holder that
//! pauses (GC, swap, a stopped VM) past its lease, a clock that jumps, or a
//! Redis failover lets two holders overlap (CASES G4). Write with the
//! [`Fencing::fence`] checked by the resource (`UPDATE … WHERE fence <
//! $new`) so a stale holder's late write is refused.
//!
//! Backends: [`MemoryLockBackend`] here; `idem_redis::RedisLockBackend`,
//! `idem_sql::PgAdvisoryLockBackend` and `idem_sql::LeaseLockBackend`.

use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::oneshot;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::clock::Millis;
use crate::error::BoxError;

mod memory;

pub use memory::MemoryLockBackend;

/// Longest lock name, in bytes.
pub const MAX_NAME_LEN: usize = 255;
/// Shortest TTL [`Lock`] accepts (10 ms): the watchdog renews at a third of it.
pub const MIN_TTL: Duration = Duration::from_millis(10);
/// Longest TTL [`Lock`] accepts (30 days).
pub const MAX_TTL: Duration = Duration::from_secs(30 * 24 * 3600);

/// A granted lease on a name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LockLease {
    /// The lock's name (business key), as given.
    pub name: String,
    /// This acquisition's owner token: 128 random bits as 32 lowercase hex
    /// digits, new for every grant. Release and extend compare it.
    pub owner: String,
    /// The fencing token: larger than every fence granted for this name
    /// before, starting at 1.
    pub fence: u64,
    /// When the lease ends by the backend's clock (ms since the epoch). For
    /// session-scoped backends (PostgreSQL advisory locks) an estimate: the
    /// lease lasts while the session does.
    pub until: Millis,
}

/// The answer of [`LockBackend::try_acquire`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TryAcquire {
    /// The name is ours.
    Acquired(LockLease),
    /// Someone else holds the name.
    Busy {
        /// How long until the current lease ends, when the backend knows;
        /// otherwise a backend-chosen polling hint.
        retry_after: Duration,
    },
}

/// The step a lock error happened in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum LockOp {
    /// Creating tables, connecting.
    Connect,
    /// `try_acquire`.
    Acquire,
    /// `extend`.
    Extend,
    /// `release`.
    Release,
}

impl fmt::Display for LockOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LockOp::Connect => "connect",
            LockOp::Acquire => "acquire",
            LockOp::Extend => "extend",
            LockOp::Release => "release",
        })
    }
}

/// A lock call that failed. "Busy" is not an error: it is
/// [`Acquire::Busy`] / [`Run::Busy`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LockError {
    /// The backend could not be reached or answered with an error.
    #[error("lock backend unavailable during {op}")]
    Unavailable {
        /// The step that failed.
        op: LockOp,
        /// The backend's error.
        #[source]
        source: BoxError,
    },
    /// A backend call did not finish in time. Its effect is unknown; an
    /// acquire that lands later is released in the background.
    #[error("lock backend timed out during {op} after {after:?}")]
    Timeout {
        /// The step that timed out.
        op: LockOp,
        /// The time limit.
        after: Duration,
    },
    /// The name is empty, longer than [`MAX_NAME_LEN`] bytes or holds a
    /// control character.
    #[error("invalid lock name {name:?}: {reason}")]
    InvalidName {
        /// The name given.
        name: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The TTL is outside [`MIN_TTL`]..=[`MAX_TTL`].
    #[error("invalid lock ttl {ttl:?}: must be between 10 ms and 30 days")]
    InvalidTtl {
        /// The TTL given.
        ttl: Duration,
    },
    /// A configuration error (a bad table name or prefix).
    #[error("invalid lock configuration: {0}")]
    Config(String),
    /// The backend answered something this version cannot read.
    #[error("unexpected answer from the lock backend during {op}: {detail}")]
    Corrupt {
        /// The step.
        op: LockOp,
        /// What was wrong.
        detail: String,
    },
}

impl LockError {
    /// [`LockError::Unavailable`] from any backend error.
    pub fn unavailable(op: LockOp, source: impl Into<BoxError>) -> Self {
        LockError::Unavailable {
            op,
            source: source.into(),
        }
    }
}

/// The three atomic steps a lock backend provides. Implementations must make
/// each step ONE atomic operation on the backend (a script, a statement, a
/// transaction) and keep time by the backend's clock.
#[async_trait]
pub trait LockBackend: Send + Sync + fmt::Debug + 'static {
    /// Grants `name` for `ttl` to a new owner token (see [`new_owner_token`])
    /// when no live lease holds it, with a fence larger than every fence
    /// granted for `name` before.
    ///
    /// # Errors
    /// [`LockError::Unavailable`] when the backend fails; the grant may then
    /// have happened or not (it ends at its TTL).
    async fn try_acquire(&self, name: &str, ttl: Duration) -> Result<TryAcquire, LockError>;

    /// Compare-and-extend: when `lease` (its owner token) still holds the
    /// name and has not expired, pushes its end to now + `ttl` and returns
    /// the updated lease. `None` = the lease is no longer ours (lost).
    ///
    /// # Errors
    /// [`LockError::Unavailable`] when the backend fails.
    async fn extend(
        &self,
        lease: &LockLease,
        ttl: Duration,
    ) -> Result<Option<LockLease>, LockError>;

    /// Compare-and-delete: frees the name when `lease` still holds it.
    /// `false` = no-op (we were not the live holder any more).
    ///
    /// # Errors
    /// [`LockError::Unavailable`] when the backend fails.
    async fn release(&self, lease: &LockLease) -> Result<bool, LockError>;

    /// `true` when a lease is bound to a database session rather than a TTL
    /// (PostgreSQL advisory locks): the lease does not expire while the
    /// session lives, so [`LockGuard::keep`] releases it from this process
    /// once the TTL has passed. Default `false`.
    fn session_scoped(&self) -> bool {
        false
    }
}

#[async_trait]
impl<B: LockBackend + ?Sized> LockBackend for Arc<B> {
    async fn try_acquire(&self, name: &str, ttl: Duration) -> Result<TryAcquire, LockError> {
        (**self).try_acquire(name, ttl).await
    }
    async fn extend(
        &self,
        lease: &LockLease,
        ttl: Duration,
    ) -> Result<Option<LockLease>, LockError> {
        (**self).extend(lease, ttl).await
    }
    async fn release(&self, lease: &LockLease) -> Result<bool, LockError> {
        (**self).release(lease).await
    }
    fn session_scoped(&self) -> bool {
        (**self).session_scoped()
    }
}

/// A new owner token: 128 random bits as 32 lowercase hex digits.
pub fn new_owner_token() -> String {
    format!("{:032x}", rand::random::<u128>())
}

/// Checks a lock name: 1..=[`MAX_NAME_LEN`] bytes, no control characters.
///
/// # Errors
/// [`LockError::InvalidName`].
pub fn validate_name(name: &str) -> Result<(), LockError> {
    let reason = if name.is_empty() {
        "empty"
    } else if name.len() > MAX_NAME_LEN {
        "longer than 255 bytes"
    } else if name.chars().any(char::is_control) {
        "holds a control character"
    } else {
        return Ok(());
    };
    Err(LockError::InvalidName {
        name: name.chars().take(64).collect(),
        reason,
    })
}

/// Checks a TTL: [`MIN_TTL`]..=[`MAX_TTL`].
///
/// # Errors
/// [`LockError::InvalidTtl`].
pub fn validate_ttl(ttl: Duration) -> Result<(), LockError> {
    if (MIN_TTL..=MAX_TTL).contains(&ttl) {
        Ok(())
    } else {
        Err(LockError::InvalidTtl { ttl })
    }
}

/// The answer of [`Lock::try_acquire`] and [`Lock::acquire`].
#[derive(Debug)]
#[must_use]
pub enum Acquire {
    /// The lock is ours while the guard lives (renewed in the background).
    Held(LockGuard),
    /// Someone else holds it: map to "operation in progress".
    Busy {
        /// A hint for when to try again.
        retry_after: Duration,
    },
}

/// What [`Lock::run`] hands the operation: the fence to write with and a
/// token that fires when the lock is lost.
#[derive(Debug, Clone)]
pub struct Fencing {
    /// The lease's fencing token: pass it to the resource and have it refuse
    /// writes with a smaller one (`UPDATE … WHERE fence < $fence`).
    pub fence: u64,
    /// Fires when renewal failed: the lease may have passed to someone else.
    pub lost: CancellationToken,
}

/// Options of [`Lock::run`].
#[derive(Debug, Clone, Copy, Default)]
pub struct RunOptions {
    /// On success, keep the lock until its TTL ends instead of releasing it:
    /// a short dedup window in which the same name answers busy. Default
    /// `false`. On failure (`Err`) the lock is always released.
    pub keep_on_success: bool,
    /// How long to retry while the name is busy before answering
    /// [`Run::Busy`]. Default zero: one attempt.
    pub wait: Duration,
}

/// The answer of [`Lock::run`].
#[derive(Debug)]
#[must_use]
pub enum Run<T> {
    /// The operation ran under the lock and returned this.
    Done(T),
    /// Someone else holds the name; the operation did not run.
    Busy {
        /// A hint for when to try again.
        retry_after: Duration,
    },
}

/// The error of [`Lock::run`].
#[derive(Debug)]
pub enum LockRunError<E> {
    /// The operation ran and failed; the lock was released.
    Op(E),
    /// The lock could not be acquired (the operation did not run).
    Lock(LockError),
}

impl<E: fmt::Display> fmt::Display for LockRunError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LockRunError::Op(e) => write!(f, "operation under lock failed: {e}"),
            LockRunError::Lock(e) => write!(f, "{e}"),
        }
    }
}

impl<E: std::error::Error + 'static> std::error::Error for LockRunError<E> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            LockRunError::Op(e) => Some(e),
            LockRunError::Lock(e) => Some(e),
        }
    }
}

/// Default limit on one backend call made by [`Lock`] (5 s).
pub const DEFAULT_CALL_TIMEOUT: Duration = Duration::from_secs(5);

struct Inner<B> {
    backend: Arc<B>,
    call_timeout: Duration,
}

/// A distributed lock over a [`LockBackend`]. Clones share the backend.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use std::time::Duration;
/// use idem_core::lock::{Lock, MemoryLockBackend, Run, RunOptions};
///
/// let lock = Lock::new(MemoryLockBackend::default());
/// let ran = lock
///     .run("invoice:42", Duration::from_secs(10), RunOptions::default(), |f| async move {
///         // write with f.fence checked by the database
///         Ok::<_, std::io::Error>(f.fence)
///     })
///     .await?;
/// assert!(matches!(ran, Run::Done(1)));
/// # Ok(()) }
/// ```
pub struct Lock<B> {
    inner: Arc<Inner<B>>,
}

impl<B> Clone for Lock<B> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
        }
    }
}

impl<B: fmt::Debug> fmt::Debug for Lock<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lock")
            .field("backend", &self.inner.backend)
            .field("call_timeout", &self.inner.call_timeout)
            .finish()
    }
}

impl<B: LockBackend> Lock<B> {
    /// A lock over `backend`, with [`DEFAULT_CALL_TIMEOUT`] per backend call.
    pub fn new(backend: B) -> Self {
        Self {
            inner: Arc::new(Inner {
                backend: Arc::new(backend),
                call_timeout: DEFAULT_CALL_TIMEOUT,
            }),
        }
    }

    /// The same lock with another limit on each backend call (acquire,
    /// release; renewals are bounded by the lease instead). Default
    /// [`DEFAULT_CALL_TIMEOUT`] (5 s). Any length is accepted: 0 fails every
    /// call the backend does not answer at once ([`LockError::Timeout`]);
    /// one too long to add to the current instant (up to `Duration::MAX`)
    /// means no limit.
    pub fn with_call_timeout(self, timeout: Duration) -> Self {
        Self {
            inner: Arc::new(Inner {
                backend: self.inner.backend.clone(),
                call_timeout: timeout,
            }),
        }
    }

    /// The backend.
    pub fn backend(&self) -> &B {
        &self.inner.backend
    }

    /// One attempt to take `name` for `ttl`.
    ///
    /// Safe to cancel: the backend call runs in a spawned task; when this
    /// future is dropped (or times out) before the answer arrives, a lease
    /// granted later is released in the background, never left held.
    ///
    /// # Errors
    /// [`LockError::InvalidName`], [`LockError::InvalidTtl`], or the
    /// backend's error; [`LockError::Timeout`] after the call timeout.
    pub async fn try_acquire(&self, name: &str, ttl: Duration) -> Result<Acquire, LockError> {
        validate_name(name)?;
        validate_ttl(ttl)?;
        let started = Instant::now();
        let (tx, rx) = oneshot::channel::<Result<Acquire, LockError>>();
        let backend: Arc<dyn LockBackend> = self.inner.backend.clone();
        let name = name.to_owned();
        let call_timeout = self.inner.call_timeout;
        tokio::spawn(async move {
            let answer = match backend.try_acquire(&name, ttl).await {
                // The guard is built here, so a grant dropped anywhere on its
                // way to the caller (a failed send, a receiver dropped with
                // the value inside) is released by the guard's Drop.
                Ok(TryAcquire::Acquired(lease)) => Ok(Acquire::Held(LockGuard::start(
                    backend,
                    lease,
                    ttl,
                    started,
                    call_timeout,
                ))),
                Ok(TryAcquire::Busy { retry_after }) => Ok(Acquire::Busy { retry_after }),
                Err(e) => Err(e),
            };
            if let Err(Ok(Acquire::Held(guard))) = tx.send(answer) {
                tracing::debug!(name = %guard.lease.name, fence = guard.lease.fence,
                    "acquire cancelled by its caller; releasing the grant");
                drop(guard);
            }
        });
        match tokio::time::timeout(self.inner.call_timeout, rx).await {
            Err(_) => Err(LockError::Timeout {
                op: LockOp::Acquire,
                after: self.inner.call_timeout,
            }),
            Ok(Err(_)) => Err(LockError::unavailable(
                LockOp::Acquire,
                "the acquire task ended without an answer (runtime shutting down?)",
            )),
            Ok(Ok(answer)) => answer,
        }
    }

    /// Takes `name` for `ttl`, retrying while it is busy (exponential
    /// backoff from 10 ms to 500 ms with jitter, never longer than the
    /// holder's `retry_after`) for at most `wait`; then answers
    /// [`Acquire::Busy`]. `wait` zero = one attempt; a `wait` too large to
    /// add to the current instant (such as `Duration::MAX`) waits without a
    /// deadline until the name is granted or the future is dropped. Safe to
    /// cancel.
    ///
    /// # Errors
    /// As [`Lock::try_acquire`]; the first error ends the wait.
    pub async fn acquire(
        &self,
        name: &str,
        ttl: Duration,
        wait: Duration,
    ) -> Result<Acquire, LockError> {
        // `None`: a wait too long to represent (`Duration::MAX`), i.e. no
        // deadline; the caller bounds it by dropping the future.
        let deadline = Instant::now().checked_add(wait);
        let mut backoff = Duration::from_millis(10);
        loop {
            match self.try_acquire(name, ttl).await? {
                Acquire::Held(g) => return Ok(Acquire::Held(g)),
                Acquire::Busy { retry_after } => {
                    let now = Instant::now();
                    let left = match deadline {
                        Some(d) if now >= d => return Ok(Acquire::Busy { retry_after }),
                        Some(d) => d - now,
                        None => Duration::MAX,
                    };
                    let jitter = 0.5 + rand::random::<f64>() / 2.0;
                    let pause = backoff
                        .min(retry_after.max(Duration::from_millis(1)))
                        .mul_f64(jitter)
                        .max(Duration::from_millis(1))
                        .min(left);
                    tokio::time::sleep(pause).await;
                    backoff = (backoff * 2).min(Duration::from_millis(500));
                }
            }
        }
    }

    /// Runs `op` while holding `name`: acquires (retrying for
    /// `opts.wait`), hands `op` a [`Fencing`], then releases the lock when
    /// `op` fails, and on success releases it too unless
    /// `opts.keep_on_success` (then it stays until its TTL ends: a dedup
    /// window). Busy is a value, [`Run::Busy`]: `op` did not run.
    ///
    /// The lock is renewed at `ttl / 3` while `op` runs; if renewal fails
    /// `Fencing::lost` fires and `op` should stop (its fenced writes are
    /// refused anyway once a newer holder wrote). Dropping this future
    /// mid-way releases the lock in the background.
    ///
    /// A release that fails after `op` succeeded is logged, not returned
    /// (the lock then ends at its TTL): the operation's result is kept.
    ///
    /// # Errors
    /// [`LockRunError::Lock`] when acquiring failed, [`LockRunError::Op`]
    /// with `op`'s error.
    pub async fn run<T, E, F, Fut>(
        &self,
        name: &str,
        ttl: Duration,
        opts: RunOptions,
        op: F,
    ) -> Result<Run<T>, LockRunError<E>>
    where
        F: FnOnce(Fencing) -> Fut + Send,
        Fut: Future<Output = Result<T, E>> + Send,
        T: Send,
        E: Send,
    {
        let acquired = if opts.wait.is_zero() {
            self.try_acquire(name, ttl).await
        } else {
            self.acquire(name, ttl, opts.wait).await
        };
        let guard = match acquired.map_err(LockRunError::Lock)? {
            Acquire::Held(g) => g,
            Acquire::Busy { retry_after } => return Ok(Run::Busy { retry_after }),
        };
        let fencing = Fencing {
            fence: guard.fence(),
            lost: guard.lost(),
        };
        match op(fencing).await {
            Ok(v) => {
                if opts.keep_on_success {
                    guard.keep();
                } else {
                    let (name, fence) = (guard.lease.name.clone(), guard.lease.fence);
                    if let Err(e) = guard.release().await {
                        tracing::warn!(%name, fence, error = %e,
                            "releasing the lock after success failed; it ends at its TTL");
                    }
                }
                Ok(Run::Done(v))
            }
            Err(e) => {
                let (name, fence) = (guard.lease.name.clone(), guard.lease.fence);
                if let Err(le) = guard.release().await {
                    tracing::warn!(%name, fence, error = %le,
                        "releasing the lock after a failure failed; it ends at its TTL");
                }
                Err(LockRunError::Op(e))
            }
        }
    }
}

/// A held lock. A background watchdog renews the lease every `ttl / 3`
/// while the guard lives; [`LockGuard::lost`] fires when renewal fails
/// (the backend says the lease is no longer ours, or no renewal succeeded
/// before the lease's end as measured locally from the start of the
/// acquire). Dropping the guard releases the lock in the background.
pub struct LockGuard {
    lease: LockLease,
    until: Arc<AtomicU64>,
    lost: CancellationToken,
    stop: CancellationToken,
    backend: Arc<dyn LockBackend>,
    ttl: Duration,
    call_timeout: Duration,
    done: bool,
}

impl fmt::Debug for LockGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockGuard")
            .field("lease", &self.lease)
            .field("until", &self.until())
            .field("lost", &self.lost.is_cancelled())
            .finish_non_exhaustive()
    }
}

impl LockGuard {
    fn start(
        backend: Arc<dyn LockBackend>,
        lease: LockLease,
        ttl: Duration,
        started: Instant,
        call_timeout: Duration,
    ) -> Self {
        let until = Arc::new(AtomicU64::new(lease.until.0));
        let lost = CancellationToken::new();
        let stop = CancellationToken::new();
        tokio::spawn(watchdog(
            backend.clone(),
            lease.clone(),
            ttl,
            started,
            until.clone(),
            lost.clone(),
            stop.clone(),
        ));
        Self {
            lease,
            until,
            lost,
            stop,
            backend,
            ttl,
            call_timeout,
            done: false,
        }
    }

    /// The fencing token of this grant.
    pub fn fence(&self) -> u64 {
        self.lease.fence
    }

    /// The lease as granted (its `until` is the first end; see
    /// [`LockGuard::until`] for the latest renewal).
    pub fn lease(&self) -> &LockLease {
        &self.lease
    }

    /// The lease's end after the latest renewal, by the backend's clock.
    pub fn until(&self) -> Millis {
        Millis(self.until.load(Ordering::SeqCst))
    }

    /// A token that fires when the lock is lost (renewal failed). It never
    /// fires after [`LockGuard::release`] or [`LockGuard::keep`].
    pub fn lost(&self) -> CancellationToken {
        self.lost.clone()
    }

    /// Stops renewing and frees the name (compare-and-delete on the owner
    /// token). `Ok(false)` = no-op: the lease had passed and the name was
    /// free or taken by someone else.
    ///
    /// Safe to cancel: the backend call runs in a spawned task, so dropping
    /// this future (a `select!`, a timeout, a cancelled request) while it is
    /// in flight still frees the name; only the answer is lost.
    ///
    /// # Errors
    /// The backend's error, or [`LockError::Timeout`] after the call
    /// timeout (5 s by default); the lock then ends at its TTL.
    pub async fn release(mut self) -> Result<bool, LockError> {
        // From here the spawned task owns the release; Drop must not send a
        // second one.
        self.done = true;
        self.stop.cancel();
        let backend = self.backend.clone();
        let lease = self.lease.clone();
        let timeout = self.call_timeout;
        let task = tokio::spawn(async move {
            match tokio::time::timeout(timeout, backend.release(&lease)).await {
                Ok(r) => r,
                Err(_) => Err(LockError::Timeout {
                    op: LockOp::Release,
                    after: timeout,
                }),
            }
        });
        match task.await {
            Ok(r) => r,
            Err(e) => Err(LockError::unavailable(
                LockOp::Release,
                format!("the release task did not finish: {e}"),
            )),
        }
    }

    /// Stops renewing and leaves the lock to expire at its TTL (counted from
    /// the last renewal): a dedup window in which the name answers busy.
    /// On a session-scoped backend (PostgreSQL advisory) the lease does not
    /// expire by itself, so a background task releases it once the TTL has
    /// passed (if the process dies first, the session's end frees it).
    pub fn keep(mut self) {
        self.done = true;
        self.stop.cancel();
        if self.backend.session_scoped() {
            let backend = self.backend.clone();
            let lease = self.lease.clone();
            // The TTL from now: an upper bound on the remaining lease.
            let at = Instant::now() + self.ttl;
            spawn_detached(async move {
                tokio::time::sleep_until(at).await;
                if let Err(e) = backend.release(&lease).await {
                    tracing::warn!(name = %lease.name, error = %e, "releasing a kept session lock failed");
                }
            });
        }
    }
}

impl Drop for LockGuard {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        self.stop.cancel();
        let backend = self.backend.clone();
        let lease = self.lease.clone();
        let timeout = self.call_timeout;
        spawn_detached(async move {
            match tokio::time::timeout(timeout, backend.release(&lease)).await {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => tracing::warn!(name = %lease.name, fence = lease.fence, error = %e,
                    "releasing a dropped lock failed; it ends at its TTL"),
                Err(_) => tracing::warn!(name = %lease.name, fence = lease.fence,
                    "releasing a dropped lock timed out; it ends at its TTL"),
            }
        });
    }
}

/// Spawns on the current runtime if there is one (a guard dropped outside a
/// runtime ends at its TTL instead).
fn spawn_detached(fut: impl Future<Output = ()> + Send + 'static) {
    if let Ok(handle) = tokio::runtime::Handle::try_current() {
        handle.spawn(fut);
    }
}

async fn watchdog(
    backend: Arc<dyn LockBackend>,
    lease: LockLease,
    ttl: Duration,
    started: Instant,
    until: Arc<AtomicU64>,
    lost: CancellationToken,
    stop: CancellationToken,
) {
    let every = (ttl / 3).max(Duration::from_millis(1));
    // Local bound on the lease: measured from the start of the call that
    // granted or renewed it, so it never ends later than the backend's.
    let mut deadline = started + ttl;
    let mut next = started + every;
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep_until(next) => {}
        }
        let attempt = Instant::now();
        if attempt >= deadline {
            break;
        }
        let answer = tokio::select! {
            _ = stop.cancelled() => return,
            r = tokio::time::timeout_at(deadline, backend.extend(&lease, ttl)) => r,
        };
        match answer {
            Ok(Ok(Some(renewed))) => {
                until.store(renewed.until.0, Ordering::SeqCst);
                deadline = attempt + ttl;
                next = attempt + every;
            }
            Ok(Ok(None)) => break,
            Ok(Err(e)) => {
                tracing::warn!(name = %lease.name, fence = lease.fence, error = %e,
                    "renewing the lock failed; retrying until the lease ends");
                next = (Instant::now() + every / 3).min(deadline);
            }
            Err(_) => break,
        }
    }
    if !stop.is_cancelled() {
        tracing::warn!(name = %lease.name, fence = lease.fence, "lock lost: renewal failed");
        lost.cancel();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_ttls_are_validated() {
        assert!(validate_name("orders:1").is_ok());
        assert!(matches!(
            validate_name(""),
            Err(LockError::InvalidName { .. })
        ));
        assert!(validate_name(&"x".repeat(256)).is_err());
        assert!(validate_name("a\nb").is_err());
        assert!(validate_ttl(Duration::from_millis(9)).is_err());
        assert!(validate_ttl(Duration::from_secs(1)).is_ok());
        assert!(validate_ttl(MAX_TTL + Duration::from_secs(1)).is_err());
    }

    #[test]
    fn owner_tokens_are_128_bit_hex() {
        let a = new_owner_token();
        assert_eq!(a.len(), 32);
        assert!(a.chars().all(|c| c.is_ascii_hexdigit()));
        assert_ne!(a, new_owner_token());
    }

    mod extremes {
        use super::*;
        use proptest::prelude::*;

        fn extreme() -> impl Strategy<Value = Duration> {
            prop_oneof![
                Just(Duration::ZERO),
                Just(Duration::from_nanos(1)),
                Just(MIN_TTL),
                Just(Duration::from_secs(5)),
                Just(MAX_TTL),
                Just(Duration::from_secs(u64::MAX)),
                Just(Duration::MAX),
            ]
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(48))]

            /// Issue 16 item 7: the lease APIs at extreme durations (TTL,
            /// wait, call timeout): no panic; a TTL outside
            /// `MIN_TTL..=MAX_TTL` is `InvalidTtl`, a zero call timeout a
            /// `Timeout`, else the operation runs under the lock.
            #[test]
            fn extreme_lock_durations_never_panic(
                ttl in extreme(), wait in extreme(), call_timeout in extreme(), keep in any::<bool>(),
            ) {
                let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
                rt.block_on(async {
                    let lock = Lock::new(MemoryLockBackend::default()).with_call_timeout(call_timeout);
                    let opts = RunOptions { keep_on_success: keep, wait };
                    let r = lock.run("extreme", ttl, opts, |f| async move { Ok::<_, std::io::Error>(f.fence) }).await;
                    match r {
                        Ok(Run::Done(_)) => prop_assert!((MIN_TTL..=MAX_TTL).contains(&ttl)),
                        Ok(Run::Busy { .. }) => prop_assert!(false, "nothing else holds the name"),
                        Err(LockRunError::Lock(LockError::InvalidTtl { .. })) => {
                            prop_assert!(!(MIN_TTL..=MAX_TTL).contains(&ttl))
                        }
                        Err(LockRunError::Lock(LockError::Timeout { .. })) => {
                            prop_assert!(call_timeout < Duration::from_millis(1))
                        }
                        Err(e) => prop_assert!(false, "{e}"),
                    }
                    Ok(())
                })?;
            }
        }
    }
}
