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

    use idem_core::lock::{Acquire, Lock, MemoryLockBackend};
    use idem_core::{ManualClock, Millis};

    /// A guard's lease end is the manual clock's time plus the TTL, and
    /// renewals move it by the clock.
    #[tokio::test(start_paused = true)]
    async fn lease_ends_follow_the_injected_clock() {
        let clock = ManualClock::new(Millis(1_000_000));
        let lock = Lock::new(MemoryLockBackend::new(Arc::new(clock.clone())));
        let Acquire::Held(g) = lock
            .try_acquire("clocked", Duration::from_millis(900))
            .await
            .expect("acquire")
        else {
            panic!("free name")
        };
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
        let Acquire::Held(g) = lock
            .try_acquire("dropped", Duration::from_secs(60))
            .await
            .expect("acquire")
        else {
            panic!("free name")
        };
        drop(g);
        let Acquire::Held(g) = lock
            .acquire("dropped", Duration::from_secs(60), Duration::from_secs(1))
            .await
            .expect("acquire")
        else {
            panic!("a dropped guard must release its lock")
        };
        assert_eq!(g.fence(), 2);
        assert!(g.release().await.expect("release"));
    }
}
