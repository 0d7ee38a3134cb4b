//! The lock checks on `RedisLockBackend` against the shared Redis (CASES G),
//! plus Redis-specific checks (key layout, `SCRIPT FLUSH`, an unreachable
//! server). Needs the server from SERVICES.md; fails (never skips) without.

mod common;

use std::time::Duration;

use async_trait::async_trait;
use idem_core::lock::{LockBackend, LockError, TryAcquire};
use idem_redis::RedisLockBackend;
use idem_testkit::lock_checks::{fresh_name, LockHarness};
use redis::AsyncCommands;

use common::{raw, redis_url, test_options, Server, START_REDIS};

async fn connect(url: &str) -> RedisLockBackend {
    match RedisLockBackend::connect_with(url, test_options()).await {
        Ok(b) => b,
        Err(e) => panic!(
            "cannot connect to Redis at {url}: {e} ({e:?}).\n\
             Start the shared server with: {START_REDIS}\n\
             (or point IDEM_TEST_REDIS_URL at a running Redis 7)"
        ),
    }
}

/// The shared server, this run's key prefix; time passes by sleeping.
/// A 30 s lease on `name`, which must be free.
async fn acquired(b: &RedisLockBackend, name: &str, what: &str) -> idem_core::lock::LockLease {
    let TryAcquire::Acquired(lease) = b
        .try_acquire(name, Duration::from_secs(30))
        .await
        .expect(what)
    else {
        panic!("fresh name")
    };
    lease
}

struct RedisLockHarness(RedisLockBackend);

#[async_trait]
impl LockHarness for RedisLockHarness {
    type B = RedisLockBackend;

    fn backend(&self) -> RedisLockBackend {
        self.0.clone()
    }

    async fn sleep(&self, d: Duration) {
        tokio::time::sleep(d).await;
    }
}

mod redis_lock_tests {
    use super::*;

    idem_testkit::lock_tests!(
        lock,
        #[::tokio::test(flavor = "multi_thread", worker_threads = 2)],
        || async { RedisLockHarness(connect(&redis_url()).await) }
    );

    /// The lock key holds the owner token with a TTL; the fence counter
    /// shares its hash tag and never expires (fences survive expiry).
    #[tokio::test]
    async fn key_layout() {
        let b = connect(&redis_url()).await;
        let name = fresh_name("layout");
        let lease = acquired(&b, &name, "acquire").await;
        let (lock, fence) = b.keys(&name);
        assert!(lock.starts_with(&format!("{{{}:lock:", common::run_prefix())));
        let mut c = raw(&redis_url()).await;
        let owner: String = c.get(&lock).await.expect("GET");
        assert_eq!(owner, lease.owner);
        let pttl: i64 = c.pttl(&lock).await.expect("PTTL");
        assert!(pttl > 20_000 && pttl <= 30_000, "{pttl}");
        let f: u64 = c.get(&fence).await.expect("GET fence");
        assert_eq!(f, lease.fence);
        assert_eq!(c.pttl::<_, i64>(&fence).await.expect("PTTL"), -1);
        assert!(b.release(&lease).await.expect("release"));
        assert!(!c.exists::<_, bool>(&lock).await.expect("EXISTS"));
        assert!(c.exists::<_, bool>(&fence).await.expect("EXISTS"));
        let _: () = c.del(&fence).await.expect("DEL");
    }

    /// `SCRIPT FLUSH` between steps (a restarted server): every step still
    /// works. On a private server so the shared one keeps its scripts.
    #[tokio::test]
    async fn steps_survive_script_flush() {
        let dir = tempfile::tempdir().expect("temp dir");
        let server = Server::start(common::free_port(), dir.path(), &[]);
        let b = connect(&server.url()).await;
        let flush = || assert_eq!(server.cli(&["script", "flush"]).trim(), "OK");
        let name = fresh_name("flush");
        flush();
        let lease = acquired(&b, &name, "acquire after flush").await;
        flush();
        assert!(b
            .extend(&lease, Duration::from_secs(30))
            .await
            .expect("extend after flush")
            .is_some());
        flush();
        assert!(b.release(&lease).await.expect("release after flush"));
    }

    /// A server that is not there: a typed error, not a hang or a panic.
    #[tokio::test]
    async fn unreachable_server_is_a_typed_error() {
        let url = format!("redis://127.0.0.1:{}/", common::free_port());
        match RedisLockBackend::connect_with(&url, test_options()).await {
            Err(LockError::Unavailable { .. } | LockError::Timeout { .. }) => {}
            other => panic!("expected Unavailable/Timeout, got {other:?}"),
        }
        assert!(matches!(
            RedisLockBackend::connect("ftp://x").await,
            Err(LockError::Config(_))
        ));
    }

    /// A server stopped while a lock is held: the holder's renewals fail,
    /// `lost()` fires, release reports an error (never a false success).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn server_gone_fires_lost() {
        let dir = tempfile::tempdir().expect("temp dir");
        let server = Server::start(common::free_port(), dir.path(), &[]);
        let b = connect(&server.url()).await;
        let lock = idem_core::lock::Lock::new(b);
        let idem_core::lock::Acquire::Held(g) = lock
            .try_acquire(&fresh_name("gone"), Duration::from_millis(1500))
            .await
            .expect("acquire")
        else {
            panic!("fresh name")
        };
        let lost = g.lost();
        drop(server);
        tokio::time::timeout(Duration::from_secs(5), lost.cancelled())
            .await
            .expect("lost() fires within the lease once renewals fail");
        assert!(g.release().await.is_err());
    }
}
