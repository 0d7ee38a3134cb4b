//! The lock checks (CASES G) on the SQL backends against real servers:
//! `LeaseLockBackend` on SQLite, PostgreSQL and MySQL/MariaDB, and
//! `PgAdvisoryLockBackend` (session leases: a lapse is simulated with
//! `pg_terminate_backend` of the holder's session). Plus backend-specific
//! checks: no lock-holding connection goes back to the pool, table names
//! are validated, two pools race, migrate twice.
//!
//! Servers: `IDEM_TEST_POSTGRES_URL` (default
//! `postgres://postgres@127.0.0.1:5432/test`), `IDEM_TEST_MYSQL_URL`
//! (default `mysql://root@127.0.0.1:3306/test`). Every check uses tables
//! of its own (`idem_lk_<random>`), dropped when it ends. A server that is
//! down fails the tests (never skips) with the command that starts it.
//!
//! `cargo test -p idem-sql --test lock_tests`

mod servers;

use std::time::Duration;

use async_trait::async_trait;
use idem_core::lock::{Acquire, Lock, LockBackend, LockError, LockLease, TryAcquire};
use idem_sql::{LeaseLockBackend, PgAdvisoryLockBackend};
use idem_testkit::lock_checks::{fresh_name, LockHarness};
use idem_testkit::support::random_hex;
use servers::{my_pool, pg_pool, Cleanup, Server};
use sqlx::PgPool;

fn table_name() -> String {
    format!("idem_lk_{}", random_hex(12))
}

/// Drops a per-check table when the check ends.
fn drop_table(server: Server, table: &str) -> Cleanup {
    let quoted = match server {
        Server::Postgres => format!("\"{table}\""),
        Server::MySql => format!("`{table}`"),
    };
    Cleanup::new(server, table, format!("DROP TABLE IF EXISTS {quoted}"))
}

/// A SQL backend under the lock checks: its leases are sessions only for
/// PostgreSQL advisory locks, where a lapse is the holder's session being
/// terminated.
trait SqlLockBackend: LockBackend + Clone {
    /// See [`LockHarness::session_scoped`].
    const SESSION_SCOPED: bool = false;

    /// The pid of the database session holding `lease`, if it is one.
    fn session_pid(&self, lease: &LockLease) -> Option<i32> {
        let _ = lease;
        None
    }
}

impl SqlLockBackend for LeaseLockBackend {}

impl SqlLockBackend for PgAdvisoryLockBackend {
    const SESSION_SCOPED: bool = true;

    fn session_pid(&self, lease: &LockLease) -> Option<i32> {
        PgAdvisoryLockBackend::session_pid(self, lease)
    }
}

/// A SQL backend on a fresh table of its own, migrated, dropped when the
/// check ends. Time passes by sleeping: every SQL backend keeps time by its
/// database.
struct SqlHarness<B> {
    backend: B,
    /// The PostgreSQL pool of an advisory backend (for `pg_locks` and
    /// terminating sessions).
    pool: Option<PgPool>,
    _drop: Option<Cleanup>,
    _dir: Option<tempfile::TempDir>,
}

type LeaseHarness = SqlHarness<LeaseLockBackend>;
type AdvisoryHarness = SqlHarness<PgAdvisoryLockBackend>;

#[async_trait]
impl<B: SqlLockBackend> LockHarness for SqlHarness<B> {
    type B = B;

    fn backend(&self) -> B {
        self.backend.clone()
    }

    async fn sleep(&self, d: Duration) {
        tokio::time::sleep(d).await;
    }

    fn session_scoped(&self) -> bool {
        B::SESSION_SCOPED
    }

    async fn kill_session(&self, lease: &LockLease) {
        let pid = self
            .backend
            .session_pid(lease)
            .expect("the backend holds this lease's session");
        let killed: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
            .bind(pid)
            .fetch_one(self.pool.as_ref().expect("a PostgreSQL pool"))
            .await
            .expect("pg_terminate_backend");
        assert!(killed, "session {pid} was terminated");
    }
}

impl LeaseHarness {
    /// `backend` on a fresh table of its own, migrated.
    async fn on_fresh_table(
        backend: LeaseLockBackend,
        server: Option<Server>,
        dir: Option<tempfile::TempDir>,
    ) -> Self {
        let table = table_name();
        let backend = backend.with_table(&table).expect("table name");
        backend.migrate().await.expect("migrate");
        Self {
            backend,
            pool: None,
            _drop: server.map(|s| drop_table(s, &table)),
            _dir: dir,
        }
    }

    async fn sqlite() -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let pool =
            servers::sqlite_file_pool(&dir.path().join("locks.db"), 4, Duration::from_secs(10))
                .await;
        Self::on_fresh_table(LeaseLockBackend::sqlite(pool), None, Some(dir)).await
    }

    async fn postgres() -> Self {
        let backend = LeaseLockBackend::postgres(pg_pool(8).await);
        Self::on_fresh_table(backend, Some(Server::Postgres), None).await
    }

    async fn mysql() -> Self {
        let backend = LeaseLockBackend::mysql(my_pool(8).await);
        Self::on_fresh_table(backend, Some(Server::MySql), None).await
    }
}

impl AdvisoryHarness {
    async fn new() -> Self {
        let table = table_name();
        let pool = pg_pool(8).await;
        let backend = PgAdvisoryLockBackend::new(pool.clone())
            .with_table(&table)
            .expect("table name");
        backend.migrate().await.expect("migrate");
        Self {
            backend,
            pool: Some(pool),
            _drop: Some(drop_table(Server::Postgres, &table)),
            _dir: None,
        }
    }

    /// Advisory locks held on `key` by any session (from `pg_locks`).
    async fn holders(&self, key: i64) -> i64 {
        sqlx::query_scalar(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted \
             AND objsubid = 1 AND classid = ($1::bigint)::oid AND objid = ($2::bigint)::oid",
        )
        .bind((key >> 32) & 0xffff_ffff)
        .bind(key & 0xffff_ffff)
        .fetch_one(self.pool.as_ref().expect("a PostgreSQL pool"))
        .await
        .expect("pg_locks")
    }
}

/// One module `<backend>_tests` per backend, each with the whole lock suite.
macro_rules! lock_suites {
    ($($module:ident: $make:expr;)*) => {$(
        mod $module {
            use super::*;
            idem_testkit::lock_tests!(
                lock,
                #[::tokio::test(flavor = "multi_thread", worker_threads = 2)],
                || async { $make.await }
            );
        }
    )*};
}

lock_suites! {
    sqlite_lease_tests: LeaseHarness::sqlite();
    postgres_lease_tests: LeaseHarness::postgres();
    mysql_lease_tests: LeaseHarness::mysql();
}

mod pg_advisory_tests {
    use super::*;
    idem_testkit::lock_tests!(
        lock,
        #[::tokio::test(flavor = "multi_thread", worker_threads = 2)],
        || async { AdvisoryHarness::new().await }
    );

    /// Grants and busy answers never leave an advisory lock on a pooled
    /// connection: after cancelled, busy, failed and released acquires,
    /// no session holds the key and the backend holds no session.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn no_lock_left_on_pooled_connections() {
        let h = AdvisoryHarness::new().await;
        let lock = Lock::new(h.backend());
        let name = fresh_name("pool");
        let key = h.backend.advisory_key(&name);
        for k in 0..10u64 {
            let _ = tokio::time::timeout(
                Duration::from_millis(k),
                lock.try_acquire(&name, Duration::from_secs(60)),
            )
            .await;
        }
        let Acquire::Held(g) = lock
            .acquire(&name, Duration::from_secs(60), Duration::from_secs(10))
            .await
            .expect("acquire")
        else {
            panic!("free after cancelled acquires")
        };
        assert_eq!(h.holders(key).await, 1);
        // Busy attempts run on pooled connections and leave nothing behind.
        for _ in 0..10 {
            assert!(matches!(
                lock.try_acquire(&name, Duration::from_secs(60))
                    .await
                    .expect("try"),
                Acquire::Busy { .. }
            ));
        }
        assert_eq!(h.holders(key).await, 1);
        assert!(g.release().await.expect("release"));
        assert_eq!(h.holders(key).await, 0);
        assert_eq!(h.backend.held_sessions(), 0);
        // Every pooled connection can take the lock now (none re-enters a
        // lock it still holds).
        let mut grants = Vec::new();
        for _ in 0..3 {
            match h
                .backend
                .try_acquire(&name, Duration::from_secs(60))
                .await
                .expect("acquire")
            {
                TryAcquire::Acquired(l) => grants.push(l),
                TryAcquire::Busy { .. } => {}
            }
        }
        assert_eq!(grants.len(), 1, "one grant while it is held");
        assert!(h.backend.release(&grants[0]).await.expect("release"));
        assert_eq!(h.holders(key).await, 0);
    }

    /// A session-scoped lease outlives its TTL while the session lives (no
    /// expiry), and `lost()` stays quiet; only release frees it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn session_lease_does_not_expire_by_ttl() {
        let h = AdvisoryHarness::new().await;
        let b = h.backend();
        let name = fresh_name("session");
        let TryAcquire::Acquired(a) = b
            .try_acquire(&name, Duration::from_millis(300))
            .await
            .expect("acquire")
        else {
            panic!("fresh name")
        };
        tokio::time::sleep(Duration::from_millis(900)).await;
        assert!(matches!(
            b.try_acquire(&name, Duration::from_millis(300))
                .await
                .expect("try"),
            TryAcquire::Busy { .. }
        ));
        assert!(b
            .extend(&a, Duration::from_millis(300))
            .await
            .expect("extend")
            .is_some());
        assert!(b.release(&a).await.expect("release"));
        assert!(!b.release(&a).await.expect("release"));
    }
}

mod config_tests {
    use super::*;

    #[tokio::test]
    async fn table_names_are_validated() {
        let pool = sqlx::SqlitePool::connect("sqlite::memory:")
            .await
            .expect("sqlite");
        for bad in [
            "",
            "1x",
            "a-b",
            "a;drop table x",
            "a\"b",
            "a.b",
            &"t".repeat(55),
        ] {
            assert!(
                matches!(
                    LeaseLockBackend::sqlite(pool.clone()).with_table(bad),
                    Err(LockError::Config(_))
                ),
                "{bad:?}"
            );
        }
        let b = LeaseLockBackend::sqlite(pool)
            .with_table("my_locks")
            .expect("plain identifier");
        assert_eq!(b.table(), "my_locks");
        b.migrate().await.expect("migrate");
        b.migrate().await.expect("migrate twice");
    }

    /// Two pools (two "processes") race for one name on each server:
    /// exactly one grant.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn two_pools_one_winner() {
        for (h, other) in [
            (
                LeaseHarness::postgres().await,
                LeaseLockBackend::postgres(pg_pool(8).await),
            ),
            (
                LeaseHarness::mysql().await,
                LeaseLockBackend::mysql(my_pool(8).await),
            ),
        ] {
            let other = other.with_table(h.backend().table()).expect("table");
            let name = fresh_name("two-pools");
            let tasks: Vec<_> = (0..12)
                .map(|i| {
                    let b = if i % 2 == 0 {
                        h.backend()
                    } else {
                        other.clone()
                    };
                    let name = name.clone();
                    tokio::spawn(async move { b.try_acquire(&name, Duration::from_secs(60)).await })
                })
                .collect();
            let mut won = 0;
            for t in tasks {
                if let TryAcquire::Acquired(_) = t.await.expect("task").expect("try_acquire") {
                    won += 1;
                }
            }
            assert_eq!(won, 1);
        }
    }

    /// The database's clock decides: a lease's `until` is near the
    /// database's now + TTL.
    #[tokio::test]
    async fn until_is_database_time() {
        let h = LeaseHarness::postgres().await;
        let b = h.backend();
        let TryAcquire::Acquired(l) = b
            .try_acquire(&fresh_name("clock"), Duration::from_secs(10))
            .await
            .expect("acquire")
        else {
            panic!("fresh name")
        };
        let now: i64 = sqlx::query_scalar(
            "SELECT floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint",
        )
        .fetch_one(&pg_pool(8).await)
        .await
        .expect("now");
        let until = i64::try_from(l.until.0).expect("until");
        assert!((until - now - 10_000).abs() < 5_000, "{until} vs {now}");
    }
}
