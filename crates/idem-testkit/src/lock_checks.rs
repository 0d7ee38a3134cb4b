//! Checks every lock backend runs (CASES section G): expired holders,
//! compare-and-delete, lost leases and fences, fence growth, one winner,
//! cancel safety, `run`, `keep_on_success`, the watchdog.
//!
//! A backend's test file implements [`LockHarness`] and expands
//! [`lock_tests!`](crate::lock_tests), which writes one test per check:
//!
//! ```no_run
//! mod memory_lock_tests {
//!     idem_testkit::lock_tests!(
//!         lock,
//!         #[::tokio::test(start_paused = true)],
//!         || async { idem_testkit::lock_checks::MemoryLockHarness::new() }
//!     );
//! }
//! ```
//!
//! ## Time
//! Checks let time pass with [`LockHarness::sleep`]: on the memory backend
//! it moves a [`ManualClock`] and tokio's paused clock together; backends
//! that keep time themselves (Redis `TIME`, SQL clocks) sleep for real, so
//! TTLs here are 1 s and margins at least 100 ms in the direction where
//! lateness only helps, 500 ms otherwise.
//!
//! ## Session-scoped backends
//! PostgreSQL advisory locks do not expire while their session lives. For
//! them ([`LockHarness::session_scoped`]) the checks simulate the pause or
//! partition that makes a lease pass with [`LockHarness::kill_session`]
//! (`pg_terminate_backend` of the holder's session) instead of sleeping
//! past the TTL.

use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use async_trait::async_trait;
use idem_core::lock::{
    new_owner_token, Acquire, LockBackend, LockError, LockGuard, LockLease, LockRunError, Run,
    RunOptions, TryAcquire,
};
use idem_core::lock::{Lock, MemoryLockBackend};
use idem_core::ManualClock;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::support::{all_at_once, random_hex};

const TTL: Duration = Duration::from_millis(1000);
const LONG: Duration = Duration::from_secs(60);

/// What the lock checks need from a backend under test.
#[async_trait]
pub trait LockHarness: Send + Sync + 'static {
    /// The backend under test.
    type B: LockBackend + Clone;

    /// A handle on the backend (clones share its locks).
    fn backend(&self) -> Self::B;

    /// Lets `d` pass by the backend's clock (moves a manual clock, or sleeps).
    async fn sleep(&self, d: Duration);

    /// Whether leases are sessions that do not expire by TTL (PostgreSQL
    /// advisory locks). Default `false`.
    fn session_scoped(&self) -> bool {
        false
    }

    /// Ends the database session holding `lease` (session-scoped backends
    /// only; the checks never call it otherwise).
    async fn kill_session(&self, lease: &LockLease) {
        let _ = lease;
        unimplemented!("only session-scoped backends end sessions")
    }
}

/// A fresh lock name for one check.
pub fn fresh_name(label: &str) -> String {
    format!("lock-check:{label}:{}", random_hex(12))
}

/// [`MemoryLockBackend`] on a [`ManualClock`]; `sleep` moves the manual
/// clock and tokio's clock together in 10 ms steps, so the tests must run
/// on a paused runtime (`#[tokio::test(start_paused = true)]`).
#[derive(Debug, Clone)]
pub struct MemoryLockHarness {
    backend: MemoryLockBackend,
    clock: ManualClock,
}

impl MemoryLockHarness {
    /// A fresh backend, its clock at the current time.
    pub fn new() -> Self {
        let clock = ManualClock::starting_now();
        Self {
            backend: MemoryLockBackend::new(Arc::new(clock.clone())),
            clock,
        }
    }

    /// The backend's clock.
    pub fn clock(&self) -> &ManualClock {
        &self.clock
    }
}

impl Default for MemoryLockHarness {
    fn default() -> Self {
        Self::new()
    }
}

#[async_trait]
impl LockHarness for MemoryLockHarness {
    type B = MemoryLockBackend;

    fn backend(&self) -> MemoryLockBackend {
        self.backend.clone()
    }

    async fn sleep(&self, d: Duration) {
        let step = Duration::from_millis(10);
        let mut left = d;
        while !left.is_zero() {
            let s = step.min(left);
            self.clock.advance(s);
            tokio::time::sleep(s).await;
            left -= s;
        }
    }
}

/// A backend wrapper whose `extend` can be made to hang (a paused process,
/// a partition between the holder and the backend).
#[derive(Debug, Clone)]
pub struct Stalling<B> {
    inner: B,
    stalled: Arc<watch::Sender<bool>>,
}

impl<B> Stalling<B> {
    /// Wraps `inner`, not stalled.
    pub fn new(inner: B) -> Self {
        Self {
            inner,
            stalled: Arc::new(watch::Sender::new(false)),
        }
    }

    /// Makes `extend` calls hang (`true`) or go through (`false`).
    pub fn stall(&self, on: bool) {
        self.stalled.send_replace(on);
    }
}

#[async_trait]
impl<B: LockBackend> LockBackend for Stalling<B> {
    async fn try_acquire(&self, name: &str, ttl: Duration) -> Result<TryAcquire, LockError> {
        self.inner.try_acquire(name, ttl).await
    }

    async fn extend(
        &self,
        lease: &LockLease,
        ttl: Duration,
    ) -> Result<Option<LockLease>, LockError> {
        let mut rx = self.stalled.subscribe();
        let _ = rx.wait_for(|stalled| !*stalled).await;
        self.inner.extend(lease, ttl).await
    }

    async fn release(&self, lease: &LockLease) -> Result<bool, LockError> {
        self.inner.release(lease).await
    }

    fn session_scoped(&self) -> bool {
        self.inner.session_scoped()
    }
}

async fn raw_acquire<B: LockBackend>(b: &B, name: &str, ttl: Duration) -> LockLease {
    match b.try_acquire(name, ttl).await.expect("try_acquire") {
        TryAcquire::Acquired(l) => l,
        TryAcquire::Busy { retry_after } => {
            panic!("{name} must be free, got Busy {{ retry_after: {retry_after:?} }}")
        }
    }
}

async fn expect_raw_busy<B: LockBackend>(b: &B, name: &str) {
    match b.try_acquire(name, TTL).await.expect("try_acquire") {
        TryAcquire::Busy { retry_after } => assert!(retry_after > Duration::ZERO),
        TryAcquire::Acquired(l) => panic!("{name} must be held, but was granted again: {l:?}"),
    }
}

fn held(a: Acquire, what: &str) -> LockGuard {
    match a {
        Acquire::Held(g) => g,
        Acquire::Busy { retry_after } => panic!("{what}: expected Held, got Busy({retry_after:?})"),
    }
}

/// The lease of `lease` has passed: sleep past the TTL, or end the session.
async fn let_lapse<H: LockHarness>(h: &H, lease: &LockLease, ttl: Duration) {
    if h.session_scoped() {
        h.kill_session(lease).await;
    } else {
        h.sleep(ttl + Duration::from_millis(100)).await;
    }
}

/// Takes `name` over once its lease passed: a single attempt must succeed
/// for TTL backends; a session backend frees the lock when the killed
/// session has exited, so it is polled for up to 10 s.
async fn take_over<H: LockHarness>(h: &H, name: &str, ttl: Duration) -> LockLease {
    let b = h.backend();
    if !h.session_scoped() {
        return raw_acquire(&b, name, ttl).await;
    }
    for _ in 0..200 {
        if let TryAcquire::Acquired(l) = b.try_acquire(name, ttl).await.expect("try_acquire") {
            return l;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("{name} was not freed within 10 s of ending its holder's session")
}

/// Waits (by the harness's clock, in 50 ms steps) up to `bound` for `token`.
async fn fired<H: LockHarness>(h: &H, token: &CancellationToken, bound: Duration) -> bool {
    let step = Duration::from_millis(50);
    let mut waited = Duration::ZERO;
    while waited < bound && !token.is_cancelled() {
        h.sleep(step).await;
        waited += step;
    }
    token.is_cancelled()
}

/// Takes `name` through `lock` once its previous lease passed: at once on
/// a TTL backend, within 10 s on a session backend.
async fn lock_after_lapse<H: LockHarness, B: LockBackend>(
    h: &H,
    lock: &Lock<B>,
    name: &str,
) -> LockGuard {
    let wait = if h.session_scoped() {
        Duration::from_secs(10)
    } else {
        Duration::ZERO
    };
    held(
        lock.acquire(name, LONG, wait).await.expect("acquire"),
        "the name must be free once its lease passed",
    )
}

/// The name is free (a dropped acquire left nothing held): acquirable
/// within 10 s although every grant in the check asked for 60 s.
async fn expect_free<B: LockBackend>(lock: &Lock<B>, name: &str, after: &str) {
    let g = held(
        lock.acquire(name, LONG, Duration::from_secs(10))
            .await
            .expect("acquire"),
        &format!("{name} must not stay held after {after}"),
    );
    assert!(
        g.release().await.expect("release"),
        "release of a live lock"
    );
}

/// G1: A takes the name for 1,000 ms and works 1,500 ms without renewing
/// (a pause). B acquires at 1,100 ms; A's release at 1,500 ms is a no-op
/// and B still holds (session backends: A's session ends at 1,000 ms).
pub async fn g1_expired_holder_release_is_noop<H: LockHarness>(h: &H) {
    let b = h.backend();
    let name = fresh_name("g1");
    let a = raw_acquire(&b, &name, TTL).await;
    if h.session_scoped() {
        h.sleep(TTL).await;
        h.kill_session(&a).await;
        h.sleep(Duration::from_millis(100)).await;
    } else {
        h.sleep(Duration::from_millis(1100)).await;
    }
    let b_lease = take_over(h, &name, Duration::from_secs(5)).await;
    assert!(b_lease.fence > a.fence, "{} > {}", b_lease.fence, a.fence);
    assert_ne!(b_lease.owner, a.owner);
    h.sleep(Duration::from_millis(400)).await;
    assert!(
        !b.release(&a).await.expect("release"),
        "A's late release must be a no-op"
    );
    assert!(
        b.extend(&a, TTL).await.expect("extend").is_none(),
        "A cannot extend B's lease"
    );
    expect_raw_busy(&b, &name).await;
    assert!(
        b.release(&b_lease).await.expect("release"),
        "B still held it"
    );
}

/// G2: release is compare-and-delete on the owner token: a forged or
/// stale owner deletes nothing, and a second release is a no-op.
pub async fn g2_release_is_compare_and_delete<H: LockHarness>(h: &H) {
    let b = h.backend();
    let name = fresh_name("g2");
    let a = raw_acquire(&b, &name, TTL).await;
    let forged = LockLease {
        owner: new_owner_token(),
        ..a.clone()
    };
    assert!(!b.release(&forged).await.expect("release"));
    assert!(b.extend(&forged, TTL).await.expect("extend").is_none());
    let elsewhere = LockLease {
        name: fresh_name("g2-unheld"),
        ..a.clone()
    };
    assert!(!b.release(&elsewhere).await.expect("release"));
    expect_raw_busy(&b, &name).await;
    // A's lease passes; C takes over; stale A cannot delete C's lock.
    let_lapse(h, &a, TTL).await;
    let c = take_over(h, &name, LONG).await;
    assert!(!b.release(&a).await.expect("release"));
    expect_raw_busy(&b, &name).await;
    assert!(b.release(&c).await.expect("release"));
    assert!(
        !b.release(&c).await.expect("release"),
        "a second release is a no-op"
    );
    // Free again.
    let d = raw_acquire(&b, &name, TTL).await;
    assert!(d.fence > c.fence);
    assert!(b.release(&d).await.expect("release"));
}

/// G3: A's renewals stall past its lease (session backends: its session
/// ends); B takes the name; A's `lost()` fires, A's fence is smaller than
/// B's, A's release is a no-op and B keeps the lock.
pub async fn g3_stalled_renewal_fires_lost_and_fences_order<H: LockHarness>(h: &H) {
    let name = fresh_name("g3");
    let stalling = Stalling::new(h.backend());
    let lock_a = Lock::new(stalling.clone());
    let a = held(lock_a.try_acquire(&name, TTL).await.expect("acquire"), "A");
    let lost = a.lost();
    if h.session_scoped() {
        h.kill_session(a.lease()).await;
    } else {
        stalling.stall(true);
        h.sleep(TTL + Duration::from_millis(100)).await;
    }
    let lock_b = Lock::new(h.backend());
    let b = held(
        lock_b
            .acquire(&name, LONG, Duration::from_secs(10))
            .await
            .expect("acquire"),
        "B after A's lease passed",
    );
    assert!(
        fired(h, &lost, Duration::from_secs(3)).await,
        "A's lost() must fire once its renewal failed"
    );
    stalling.stall(false);
    assert!(a.fence() < b.fence(), "{} < {}", a.fence(), b.fence());
    assert!(
        !a.release().await.expect("release"),
        "A's release is a no-op"
    );
    expect_raw_busy(&h.backend(), &name).await;
    assert!(!b.lost().is_cancelled());
    assert!(b.release().await.expect("release"));
}

/// Fences grow on every grant of a name: after a release and after an
/// expiry (session backends: a lost session).
pub async fn fences_grow_across_release_and_expiry<H: LockHarness>(h: &H) {
    let b = h.backend();
    let name = fresh_name("fences");
    let f1 = raw_acquire(&b, &name, TTL).await;
    assert!(f1.fence >= 1);
    assert!(b.release(&f1).await.expect("release"));
    let f2 = raw_acquire(&b, &name, TTL).await;
    assert!(f2.fence > f1.fence, "{} > {}", f2.fence, f1.fence);
    let_lapse(h, &f2, TTL).await;
    let f3 = take_over(h, &name, TTL).await;
    assert!(f3.fence > f2.fence, "{} > {}", f3.fence, f2.fence);
    assert!(b.release(&f3).await.expect("release"));
    let lock = Lock::new(h.backend());
    let g = held(lock.try_acquire(&name, TTL).await.expect("acquire"), "free");
    assert!(g.fence() > f3.fence);
    assert_eq!(g.lease().name, name);
    assert!(g.release().await.expect("release"));
    // Another name has its own lock.
    let other = raw_acquire(&b, &fresh_name("fences-other"), TTL).await;
    assert!(b.release(&other).await.expect("release"));
}

/// 16 concurrent `try_acquire`s of one free name: exactly one is granted.
pub async fn one_winner_among_16<H: LockHarness>(h: &H) {
    let lock = Lock::new(h.backend());
    let name = fresh_name("race");
    let answers = all_at_once(16, |_| {
        let (lock, name) = (lock.clone(), name.clone());
        async move { lock.try_acquire(&name, LONG).await }
    })
    .await;
    let mut winners = Vec::new();
    let mut busy = 0;
    for answer in answers {
        match answer.expect("try_acquire") {
            Acquire::Held(g) => winners.push(g),
            Acquire::Busy { .. } => busy += 1,
        }
    }
    assert_eq!(winners.len(), 1, "exactly one winner ({busy} busy)");
    assert_eq!(busy, 15);
    let g = winners.pop().expect("winner");
    assert!(g.release().await.expect("release"));
}

/// Dropping an acquire at many points never leaves the name held: after
/// k polls (k = 0..16), after k ms, a waiting `acquire` dropped mid-wait,
/// and a `run` dropped while its operation runs.
pub async fn cancel_safe_acquire_and_run<H: LockHarness>(h: &H) {
    let lock = Lock::new(h.backend());
    let name = fresh_name("cancel");
    let mut dropped_pending = 0;
    for k in 0..16usize {
        let mut fut = Box::pin(lock.try_acquire(&name, LONG));
        let mut answer = None;
        for _ in 0..k {
            match futures::poll!(fut.as_mut()) {
                Poll::Ready(r) => {
                    answer = Some(r);
                    break;
                }
                Poll::Pending => tokio::task::yield_now().await,
            }
        }
        drop(fut);
        match answer {
            Some(r) => {
                if let Acquire::Held(g) = r.expect("try_acquire") {
                    assert!(g.release().await.expect("release"));
                }
            }
            None => dropped_pending += 1,
        }
        expect_free(&lock, &name, &format!("an acquire dropped after {k} polls")).await;

        match tokio::time::timeout(
            Duration::from_millis(k as u64),
            lock.try_acquire(&name, LONG),
        )
        .await
        {
            Ok(r) => {
                if let Acquire::Held(g) = r.expect("try_acquire") {
                    assert!(g.release().await.expect("release"));
                }
            }
            Err(_) => dropped_pending += 1,
        }
        expect_free(&lock, &name, &format!("an acquire timed out after {k} ms")).await;
    }
    assert!(
        dropped_pending >= 2,
        "the check must drop some acquires mid-way"
    );

    // A waiting acquire dropped while the name is busy; then the holder
    // releases: nothing granted to the dropped waiter may stay held.
    let holder = held(
        lock.try_acquire(&name, LONG).await.expect("acquire"),
        "holder",
    );
    let waiting = tokio::time::timeout(
        Duration::from_millis(300),
        lock.acquire(&name, LONG, Duration::from_secs(30)),
    )
    .await;
    assert!(waiting.is_err(), "the waiter must still be waiting");
    assert!(holder.release().await.expect("release"));
    expect_free(&lock, &name, "a waiting acquire was dropped").await;

    // A run dropped while its operation runs releases the lock.
    let entered = Arc::new(tokio::sync::Notify::new());
    let run = lock.run(&name, LONG, RunOptions::default(), {
        let entered = entered.clone();
        |_f| async move {
            entered.notify_one();
            std::future::pending::<Result<(), std::io::Error>>().await
        }
    });
    let dropped = tokio::time::timeout(Duration::from_millis(500), async {
        tokio::join!(run, entered.notified()).0
    })
    .await;
    assert!(dropped.is_err(), "the operation never ends");
    expect_free(&lock, &name, "a run was dropped mid-operation").await;
}

/// `run` releases the lock when the operation fails, and (without
/// `keep_on_success`) when it succeeds; the operation gets the fence.
pub async fn run_releases_on_err<H: LockHarness>(h: &H) {
    let lock = Lock::new(h.backend());
    let name = fresh_name("run-err");
    let r = lock
        .run(&name, LONG, RunOptions::default(), |f| async move {
            assert!(f.fence >= 1);
            assert!(!f.lost.is_cancelled());
            Err::<(), _>(std::io::Error::other("boom"))
        })
        .await;
    match r {
        Err(LockRunError::Op(e)) => assert_eq!(e.to_string(), "boom"),
        other => panic!("expected Op(boom), got {other:?}"),
    }
    let g = held(
        lock.try_acquire(&name, LONG).await.expect("acquire"),
        "free right after a failed run",
    );
    let fence = g.fence();
    assert!(g.release().await.expect("release"));
    let r = lock
        .run(&name, LONG, RunOptions::default(), |f| async move {
            Ok::<_, std::io::Error>(f.fence)
        })
        .await
        .expect("run");
    match r {
        Run::Done(f) => assert!(f > fence),
        Run::Busy { .. } => panic!("the name was free"),
    }
    let g = held(
        lock.try_acquire(&name, LONG).await.expect("acquire"),
        "free right after a successful run",
    );
    assert!(g.release().await.expect("release"));
}

/// `keep_on_success` keeps the lock until its TTL ends (a dedup window in
/// which `run` answers Busy without running), then the name is free.
pub async fn keep_on_success_keeps_until_ttl<H: LockHarness>(h: &H) {
    let lock = Lock::new(h.backend());
    let name = fresh_name("keep");
    // 2 s: the "still kept" checks have 1 s of margin on a loaded machine.
    let ttl = 2 * TTL;
    let keep = RunOptions {
        keep_on_success: true,
        wait: Duration::ZERO,
    };
    let r = lock
        .run(&name, ttl, keep, |_| async { Ok::<_, std::io::Error>(1) })
        .await
        .expect("run");
    assert!(matches!(r, Run::Done(1)));
    let ran = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let again = lock
        .run(&name, ttl, RunOptions::default(), {
            let ran = ran.clone();
            |_| async move {
                ran.store(true, std::sync::atomic::Ordering::SeqCst);
                Ok::<_, std::io::Error>(2)
            }
        })
        .await
        .expect("run");
    match again {
        Run::Busy { retry_after } => assert!(retry_after > Duration::ZERO),
        Run::Done(v) => panic!("the kept lock must answer Busy, ran and got {v}"),
    }
    assert!(!ran.load(std::sync::atomic::Ordering::SeqCst));
    // Still kept half-way through the TTL (nobody released it).
    h.sleep(ttl / 2).await;
    expect_raw_busy(&h.backend(), &name).await;
    h.sleep(ttl / 2 + Duration::from_millis(600)).await;
    let g = lock_after_lapse(h, &lock, &name).await;
    assert!(g.release().await.expect("release"));
}

/// The watchdog keeps a 2,000 ms lock alive across 6,000 ms of work (3 × TTL;
/// renewals every 667 ms leave 1.3 s for a late one on a loaded machine):
/// others stay busy all along, `lost()` never fires, the lease end moves.
pub async fn watchdog_keeps_lock_alive_3x_ttl<H: LockHarness>(h: &H) {
    let lock = Lock::new(h.backend());
    let name = fresh_name("watchdog");
    let ttl = 2 * TTL;
    let g = held(lock.try_acquire(&name, ttl).await.expect("acquire"), "free");
    let other = h.backend();
    for _ in 0..6 {
        h.sleep(Duration::from_millis(1000)).await;
        expect_raw_busy(&other, &name).await;
    }
    assert!(!g.lost().is_cancelled(), "renewals kept the lease");
    assert!(
        g.until() > g.lease().until,
        "the lease end moved: {:?} > {:?}",
        g.until(),
        g.lease().until
    );
    assert!(g.release().await.expect("release"));
}

/// Busy is a value with a positive `retry_after`; a waiting `acquire`
/// gets the name when its holder releases, with a larger fence.
pub async fn busy_is_a_value_and_waiters_get_it<H: LockHarness>(h: &H) {
    let lock = Lock::new(h.backend());
    let name = fresh_name("busy");
    let a = held(
        lock.try_acquire(&name, LONG).await.expect("acquire"),
        "free",
    );
    match lock.try_acquire(&name, LONG).await.expect("try_acquire") {
        Acquire::Busy { retry_after } => assert!(retry_after > Duration::ZERO),
        Acquire::Held(g) => panic!("granted twice: {g:?}"),
    }
    match lock
        .acquire(&name, LONG, Duration::from_millis(300))
        .await
        .expect("acquire")
    {
        Acquire::Busy { .. } => {}
        Acquire::Held(g) => panic!("granted twice: {g:?}"),
    }
    let waiter = tokio::spawn({
        let (lock, name) = (lock.clone(), name.clone());
        async move { lock.acquire(&name, LONG, Duration::from_secs(10)).await }
    });
    h.sleep(Duration::from_millis(300)).await;
    let a_fence = a.fence();
    assert!(a.release().await.expect("release"));
    let b = held(waiter.await.expect("task").expect("acquire"), "the waiter");
    assert!(b.fence() > a_fence);
    assert!(b.release().await.expect("release"));
}

/// Bad names and TTLs are typed errors, never a panic or a grant.
pub async fn bad_input_is_typed<H: LockHarness>(h: &H) {
    let lock = Lock::new(h.backend());
    for bad in ["", "a\u{0}b", "line\nbreak"] {
        assert!(matches!(
            lock.try_acquire(bad, TTL).await,
            Err(LockError::InvalidName { .. })
        ));
    }
    let long = "n".repeat(256);
    assert!(matches!(
        lock.try_acquire(&long, TTL).await,
        Err(LockError::InvalidName { .. })
    ));
    let max = "é".repeat(127); // 254 bytes: accepted
    let g = held(
        lock.try_acquire(&max, TTL).await.expect("acquire"),
        "a 254-byte name",
    );
    assert!(g.release().await.expect("release"));
    for ttl in [
        Duration::ZERO,
        Duration::from_millis(9),
        Duration::from_secs(31 * 24 * 3600),
    ] {
        assert!(matches!(
            lock.try_acquire("fine", ttl).await,
            Err(LockError::InvalidTtl { .. })
        ));
    }
    // Odd but valid names stay apart.
    let n1 = format!("{} {{x}}", fresh_name("odd"));
    let n2 = format!("{n1} ");
    let g1 = held(lock.try_acquire(&n1, TTL).await.expect("acquire"), "n1");
    let g2 = held(
        lock.try_acquire(&n2, TTL).await.expect("acquire"),
        "n2 ≠ n1",
    );
    assert!(g1.release().await.expect("release"));
    assert!(g2.release().await.expect("release"));
}

/// Writes a module `$module` with one test per lock check, each with the
/// test attribute given (memory: `#[::tokio::test(start_paused = true)]`;
/// servers: `#[::tokio::test(flavor = "multi_thread", worker_threads = 2)]`).
/// `$make` is called once per test and returns a future of a
/// [`LockHarness`](crate::lock_checks::LockHarness).
#[macro_export]
macro_rules! lock_tests {
    ($module:ident, #[$attr:meta], $make:expr) => {
        $crate::lock_tests!(@module $module, #[$attr], $make; [
            g1_expired_holder_release_is_noop,
            g2_release_is_compare_and_delete,
            g3_stalled_renewal_fires_lost_and_fences_order,
            fences_grow_across_release_and_expiry,
            one_winner_among_16,
            cancel_safe_acquire_and_run,
            run_releases_on_err,
            keep_on_success_keeps_until_ttl,
            watchdog_keeps_lock_alive_3x_ttl,
            busy_is_a_value_and_waiters_get_it,
            bad_input_is_typed,
        ]);
    };
    (@module $module:ident, #[$attr:meta], $make:expr; [$($check:ident),* $(,)?]) => {
        mod $module {
            #[allow(unused_imports)]
            use super::*;
            $(
                #[$attr]
                async fn $check() {
                    let harness = ($make)().await;
                    $crate::lock_checks::$check(&harness).await;
                }
            )*
        }
    };
}
