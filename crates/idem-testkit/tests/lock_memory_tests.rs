//! The lock checks on `MemoryLockBackend`, on a manual clock and tokio's
//! paused clock (no real sleeping).

mod memory_lock_tests {
    idem_testkit::lock_tests!(
        lock,
        #[::tokio::test(start_paused = true)],
        || async { idem_testkit::lock_checks::MemoryLockHarness::new() }
    );

    use std::sync::Arc;
    use std::time::Duration;

    use idem_core::lock::{
        Acquire, Lock, LockBackend, LockError, LockGuard, LockLease, MemoryLockBackend, Run,
        RunOptions, TryAcquire,
    };
    use idem_core::{ManualClock, Millis};

    /// `try_acquire` of a free `name`: its guard.
    async fn held<B: LockBackend>(lock: &Lock<B>, name: &str, ttl: Duration) -> LockGuard {
        match lock.try_acquire(name, ttl).await.expect("acquire") {
            Acquire::Held(g) => g,
            other => panic!("free name: {other:?}"),
        }
    }

    /// `got` is the name's second holder (fence 2), which then releases it;
    /// `what` says in the panic why it should hold the name.
    async fn second_holder_releases(got: Result<Acquire, LockError>, what: &str) {
        let Ok(Acquire::Held(g)) = got else {
            panic!("{what}: {got:?}")
        };
        assert_eq!(g.fence(), 2);
        assert!(g.release().await.expect("release"));
    }

    /// A guard's lease end is the manual clock's time plus the TTL, and
    /// renewals move it by the clock.
    #[tokio::test(start_paused = true)]
    async fn lease_ends_follow_the_injected_clock() {
        let clock = ManualClock::new(Millis(1_000_000));
        let lock = Lock::new(MemoryLockBackend::new(Arc::new(clock.clone())));
        let g = held(&lock, "clocked", Duration::from_millis(900)).await;
        assert_eq!(g.lease().until, Millis(1_000_900));
        clock.advance(Duration::from_millis(400));
        tokio::time::sleep(Duration::from_millis(400)).await;
        // The watchdog renewed at 300 ms (clock then at 1_000_400 at most).
        assert!(g.until() > Millis(1_000_900));
        assert!(g.release().await.expect("release"));
    }

    /// A guard dropped without release frees the name (in the background).
    #[tokio::test(start_paused = true)]
    async fn dropped_guard_releases() {
        let lock = Lock::new(MemoryLockBackend::default());
        let g = held(&lock, "dropped", Duration::from_secs(60)).await;
        drop(g);
        let got = lock
            .acquire("dropped", Duration::from_secs(60), Duration::from_secs(1))
            .await;
        second_holder_releases(got, "a dropped guard must release its lock").await;
    }

    /// `wait = Duration::MAX` cannot be added to an instant: it means "no
    /// deadline", never a panic (regression: "overflow when adding
    /// duration to instant").
    #[tokio::test(start_paused = true)]
    async fn acquire_with_duration_max_waits_without_deadline() {
        let lock = Lock::new(MemoryLockBackend::default());
        let g = held(&lock, "max-wait", Duration::from_secs(5)).await;
        let l2 = lock.clone();
        let waiter = tokio::spawn(async move {
            l2.acquire("max-wait", Duration::from_secs(5), Duration::MAX)
                .await
        });
        // Still waiting (not Busy, not a panic) while the name is held.
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert!(!waiter.is_finished(), "acquire(wait = MAX) gave up early");
        assert!(g.release().await.expect("release"));
        let got = waiter.await.expect("acquire(wait = MAX) panicked");
        second_holder_releases(got, "acquire(wait = MAX) after release").await;
    }

    /// `Lock::run` with `wait: Duration::MAX` runs the operation.
    #[tokio::test(start_paused = true)]
    async fn run_with_duration_max_wait_runs() {
        let lock = Lock::new(MemoryLockBackend::default());
        let ran = tokio::spawn(async move {
            lock.run(
                "max-run",
                Duration::from_secs(5),
                RunOptions {
                    keep_on_success: false,
                    wait: Duration::MAX,
                },
                |f| async move { Ok::<_, std::io::Error>(f.fence) },
            )
            .await
        })
        .await
        .expect("run(wait = MAX) panicked");
        assert!(matches!(ran, Ok(Run::Done(1))), "{ran:?}");
    }

    /// A backend whose release takes 200 ms (a slow network).
    #[derive(Debug, Clone, Default)]
    struct SlowRelease(MemoryLockBackend);

    #[async_trait::async_trait]
    impl LockBackend for SlowRelease {
        async fn try_acquire(&self, name: &str, ttl: Duration) -> Result<TryAcquire, LockError> {
            self.0.try_acquire(name, ttl).await
        }
        async fn extend(
            &self,
            lease: &LockLease,
            ttl: Duration,
        ) -> Result<Option<LockLease>, LockError> {
            self.0.extend(lease, ttl).await
        }
        async fn release(&self, lease: &LockLease) -> Result<bool, LockError> {
            tokio::time::sleep(Duration::from_millis(200)).await;
            self.0.release(lease).await
        }
    }

    /// Dropping the future of `guard.release()` while the backend call is
    /// in flight still frees the name (regression: it stayed taken until
    /// its TTL).
    #[tokio::test(start_paused = true)]
    async fn cancelled_release_still_releases() {
        let lock = Lock::new(SlowRelease::default());
        let g = held(&lock, "cancelled-release", Duration::from_secs(60)).await;
        let cut = tokio::time::timeout(Duration::from_millis(20), g.release()).await;
        assert!(
            cut.is_err(),
            "the release should still be in flight at 20 ms"
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
        let again = lock
            .try_acquire("cancelled-release", Duration::from_secs(60))
            .await
            .expect("acquire");
        let Acquire::Held(g2) = again else {
            panic!("a cancelled release() left the name taken until its TTL: {again:?}")
        };
        assert_eq!(g2.fence(), 2);
    }

    /// Dropping `Lock::run` while it releases after the operation still
    /// frees the name.
    #[tokio::test(start_paused = true)]
    async fn run_dropped_while_releasing_still_releases() {
        let lock = Lock::new(SlowRelease::default());
        let run = lock.run(
            "run-drop",
            Duration::from_secs(60),
            RunOptions::default(),
            |_f| async { Ok::<_, std::io::Error>(()) },
        );
        // The op finishes at once; the release takes 200 ms: cut at 50 ms.
        let cut = tokio::time::timeout(Duration::from_millis(50), run).await;
        assert!(cut.is_err(), "run should still be releasing at 50 ms");
        tokio::time::sleep(Duration::from_secs(1)).await;
        let again = lock
            .try_acquire("run-drop", Duration::from_secs(60))
            .await
            .expect("acquire");
        assert!(
            matches!(again, Acquire::Held(_)),
            "a run dropped while releasing left the name taken: {again:?}"
        );
    }
}
