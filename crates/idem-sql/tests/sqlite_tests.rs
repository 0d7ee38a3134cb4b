//! [`SqliteStore`] against the conformance suite on a temporary file, plus
//! what the suite cannot see: durability across reopening, several stores
//! and several processes on one file, corrupt rows, a busy database, and
//! the connection settings.
//!
//! `cargo test -p idem-sql sqlite_tests` runs them all.

mod common;

use std::time::Duration;

use common::MIN;
use idem_core::{Begin, ManualClock, Phase, Scope, Store, StoreError};
use idem_sql::{SqliteOptions, SqliteStore};
use idem_testkit::support::{
    acquire, expect_in_flight, expect_replay, fp, fresh_key, fresh_scope, req, response,
    rich_response,
};
use idem_testkit::{Harness, KeptHarness};
use tempfile::TempDir;

/// A fresh database file per check, on a [`ManualClock`].
type SqliteHarness = KeptHarness<SqliteStore, TempDir>;

async fn sqlite_harness() -> SqliteHarness {
    let dir = tempfile::tempdir().expect("temp dir");
    let clock = ManualClock::starting_now();
    let path = dir.path().join("idem.db");
    let store = SqliteStore::open(path.to_str().expect("utf-8 path"))
        .await
        .expect("open")
        .with_clock(clock.clone());
    SqliteHarness::on_clock(store, clock, dir)
}

mod sqlite_tests {
    use super::*;

    idem_testkit::conformance_tests!(conformance, sqlite_harness);

    fn db_path(dir: &TempDir) -> String {
        dir.path()
            .join("idem.db")
            .to_str()
            .expect("utf-8 path")
            .to_owned()
    }

    /// Results and claims survive closing and reopening the file, and fences
    /// keep growing afterwards.
    #[tokio::test]
    async fn records_survive_close_and_reopen() {
        let dir = tempfile::tempdir().expect("temp dir");
        let url = format!("sqlite://{}", db_path(&dir));
        let clock = ManualClock::starting_now();
        let scope = fresh_scope();
        let (done, held) = (fresh_key("done"), fresh_key("held"));
        let (done_lease, held_lease) = {
            let store = SqliteStore::open(&url)
                .await
                .expect("open")
                .with_clock(clock.clone());
            let d = acquire(&store, &req(&scope, &done, fp("a"), MIN)).await;
            store
                .complete(&d, &rich_response(), MIN)
                .await
                .expect("complete");
            let h = acquire(&store, &req(&scope, &held, fp("a"), MIN)).await;
            store.close().await;
            assert!(
                matches!(
                    store.get(&scope, &done).await,
                    Err(StoreError::Unavailable { .. })
                ),
                "a closed store answers Unavailable"
            );
            (d, h)
        };
        let store = SqliteStore::open(&url)
            .await
            .expect("reopen")
            .with_clock(clock.clone());
        expect_replay(&store, &req(&scope, &done, fp("a"), MIN), &rich_response()).await;
        expect_in_flight(&store, &req(&scope, &held, fp("a"), MIN), MIN).await;
        // The claim made before the restart can still be completed.
        store
            .complete(&held_lease, &response("after restart"), MIN)
            .await
            .expect("complete after reopen");
        expect_replay(
            &store,
            &req(&scope, &held, fp("a"), MIN),
            &response("after restart"),
        )
        .await;
        let next = acquire(&store, &req(&scope, &fresh_key("next"), fp("a"), MIN)).await;
        assert!(next.fence > held_lease.fence && next.fence > done_lease.fence);
    }

    /// Two stores with separate pools on one file race 32 concurrent begins
    /// of one key: exactly one wins.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn two_pools_on_one_file_race_one_winner() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = db_path(&dir);
        let a = SqliteStore::open(&path).await.expect("open a");
        let b = SqliteStore::open(&path).await.expect("open b");
        let (scope, key) = (fresh_scope(), fresh_key("two-pools"));
        let r = req(&scope, &key, fp("a"), MIN);
        let won = idem_testkit::server_checks::race_begins(&a, &b, &r, 32).await;
        // Both pools see the winner's claim and result.
        b.complete(&won, &response("won"), MIN)
            .await
            .expect("complete through the other pool");
        expect_replay(&a, &r, &response("won")).await;
    }

    /// Corrupt rows give `StoreError::Corrupt`, never a panic.
    #[tokio::test]
    async fn corrupt_rows_are_corrupt_errors() {
        let h = sqlite_harness().await;
        let store = h.store();
        let pool = store.pool().clone();
        common::corrupt_rows(&store, |scope, key, what| {
            let set = match what {
                "response" => "response = x'deadbeef'",
                "null-response" => "response = NULL",
                _ => "fingerprint = x'00'",
            };
            let pool = pool.clone();
            async move {
                sqlx::query(&format!(
                    "UPDATE idem_records SET {set} WHERE scope = ?1 AND key = ?2"
                ))
                .bind(scope.as_str())
                .bind(key.as_str())
                .execute(&pool)
                .await
                .expect("corrupt the row");
            }
        })
        .await;
    }

    /// A database held by another writer past the busy timeout: the call
    /// fails with `Unavailable` (keeping sqlx's error as the source) and
    /// writes nothing.
    #[tokio::test]
    async fn busy_database_is_unavailable() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = db_path(&dir);
        let store = SqliteStore::open_with(
            &path,
            SqliteOptions::default().with_busy_timeout(Duration::from_millis(200)),
        )
        .await
        .expect("open");
        let (scope, key) = (fresh_scope(), fresh_key("busy"));
        let held = acquire(&store, &req(&scope, &key, fp("a"), MIN)).await;
        let other = SqliteStore::open(&path).await.expect("open other");
        let mut blocker = other
            .pool()
            .begin_with("BEGIN IMMEDIATE")
            .await
            .expect("lock");
        sqlx::query("UPDATE idem_fence SET last = last WHERE id = 1")
            .execute(&mut *blocker)
            .await
            .expect("write");
        let started = std::time::Instant::now();
        let err = store
            .begin(&req(&scope, &fresh_key("blocked"), fp("a"), MIN))
            .await
            .expect_err("the write lock is held");
        assert!(
            started.elapsed() >= Duration::from_millis(150),
            "waited for the busy timeout"
        );
        match &err {
            StoreError::Unavailable {
                phase: Phase::Begin,
                source,
            } => {
                assert!(source.to_string().contains("locked"), "source: {source}");
            }
            other => panic!("expected Unavailable, got {other:?}"),
        }
        assert!(
            std::error::Error::source(&err).is_some(),
            "the sqlx error is kept as the source"
        );
        match store.complete(&held, &response("x"), MIN).await {
            Err(StoreError::Unavailable {
                phase: Phase::Complete,
                ..
            }) => {}
            other => panic!("expected Unavailable, got {other:?}"),
        }
        blocker.rollback().await.expect("unlock");
        // Nothing was written: the claim is still in flight and completes now.
        expect_in_flight(&store, &req(&scope, &key, fp("a"), MIN), MIN).await;
        store
            .complete(&held, &response("x"), MIN)
            .await
            .expect("complete");
    }

    /// The connection settings money needs: WAL, synchronous FULL, the busy timeout.
    #[tokio::test]
    async fn pragmas_are_wal_full_and_busy_timeout() {
        let dir = tempfile::tempdir().expect("temp dir");
        let store = SqliteStore::open_with(
            &db_path(&dir),
            SqliteOptions::default().with_busy_timeout(Duration::from_millis(1234)),
        )
        .await
        .expect("open");
        let mut conn = store.pool().acquire().await.expect("conn");
        let mode: String = sqlx::query_scalar("PRAGMA journal_mode")
            .fetch_one(&mut *conn)
            .await
            .expect("journal_mode");
        assert_eq!(mode.to_lowercase(), "wal");
        let sync: i64 = sqlx::query_scalar("PRAGMA synchronous")
            .fetch_one(&mut *conn)
            .await
            .expect("synchronous");
        assert_eq!(sync, 2, "synchronous = FULL");
        let busy: i64 = sqlx::query_scalar("PRAGMA busy_timeout")
            .fetch_one(&mut *conn)
            .await
            .expect("busy_timeout");
        assert_eq!(busy, 1234);
    }

    /// Every accepted form opens (creating the file), bad ones are typed errors.
    #[tokio::test]
    async fn open_accepts_urls_and_paths() {
        let dir = tempfile::tempdir().expect("temp dir");
        let abs = dir.path().join("abs.db");
        let plain = dir.path().join("plain.db");
        let nested = dir.path().join("missing").join("folders").join("n.db");
        for (url, file) in [
            (format!("sqlite://{}", abs.display()), Some(&abs)),
            (format!("sqlite://{}", nested.display()), Some(&nested)),
            (plain.display().to_string(), Some(&plain)),
            ("sqlite::memory:".to_owned(), None),
        ] {
            let store = SqliteStore::open(&url)
                .await
                .unwrap_or_else(|e| panic!("{url}: {e}"));
            if let Some(f) = file {
                assert!(f.exists(), "{url} creates {}", f.display());
            }
            let (scope, key) = (Scope::anonymous(), fresh_key("open"));
            let l = acquire(&store, &req(&scope, &key, fp("a"), MIN)).await;
            store
                .complete(&l, &response("ok"), MIN)
                .await
                .expect("complete");
            expect_replay(&store, &req(&scope, &key, fp("a"), MIN), &response("ok")).await;
        }
        assert!(matches!(
            SqliteStore::open("postgres://localhost/idem").await,
            Err(StoreError::Config(_))
        ));
        assert!(matches!(
            SqliteStore::open("").await,
            Err(StoreError::Config(_))
        ));
        // A folder that cannot be made (a regular file stands in its way).
        let file = dir.path().join("a-file");
        std::fs::write(&file, b"x").expect("write");
        let blocked = file.join("idem.db");
        match SqliteStore::open(blocked.to_str().expect("utf-8")).await {
            Err(StoreError::Unavailable {
                phase: Phase::Connect,
                ..
            }) => {}
            other => panic!("expected Unavailable at connect, got {other:?}"),
        }
    }

    /// Several OS processes on one file race begins of one key: exactly one
    /// `Acquired` overall. The children are this test binary running
    /// [`cross_process_child`].
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn processes_sharing_a_file_race_one_winner() {
        const PER_PROCESS: usize = 16;
        const CHILDREN: usize = 2;
        let dir = tempfile::tempdir().expect("temp dir");
        let path = db_path(&dir);
        let store = SqliteStore::open(&path).await.expect("open");
        let (scope, key) = (fresh_scope(), fresh_key("processes"));
        let start_at = now_ms() + 1_500;
        let exe = std::env::current_exe().expect("test binary");
        // Spawn now (not lazily), so the children run while this process races too.
        let children: Vec<_> = (0..CHILDREN)
            .map(|_| {
                tokio::process::Command::new(&exe)
                    .args([
                        "--exact",
                        "sqlite_tests::cross_process_child",
                        "--ignored",
                        "--nocapture",
                        "--test-threads=1",
                    ])
                    .env("IDEM_CHILD_DB", &path)
                    .env("IDEM_CHILD_SCOPE", scope.as_str())
                    .env("IDEM_CHILD_KEY", key.as_str())
                    .env("IDEM_CHILD_START_AT_MS", start_at.to_string())
                    .env("IDEM_CHILD_TASKS", PER_PROCESS.to_string())
                    .stdout(std::process::Stdio::piped())
                    .stderr(std::process::Stdio::piped())
                    .kill_on_drop(true)
                    .spawn()
                    .expect("spawn a child process")
            })
            .collect();
        let mine = race_at(&store, &scope, &key, start_at, PER_PROCESS).await;
        let mut acquired = mine.0;
        let mut in_flight = mine.1;
        for child in children {
            let out = tokio::time::timeout(Duration::from_secs(60), child.wait_with_output())
                .await
                .expect("the child finishes")
                .expect("child ran");
            let stdout = String::from_utf8_lossy(&out.stdout);
            assert!(
                out.status.success(),
                "child failed: {stdout}\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
            let line = stdout
                .lines()
                .find_map(|l| l.split_once("IDEM_CHILD_RESULT ").map(|(_, r)| r))
                .unwrap_or_else(|| panic!("no result from child: {stdout}"));
            let nums: Vec<usize> = line
                .split_whitespace()
                .map(|kv| {
                    kv.split('=')
                        .nth(1)
                        .and_then(|v| v.parse().ok())
                        .expect("k=v")
                })
                .collect();
            acquired += nums[0];
            in_flight += nums[1];
        }
        assert_eq!(
            acquired,
            1,
            "exactly one Acquired across {} processes",
            CHILDREN + 1
        );
        assert_eq!(in_flight, PER_PROCESS * (CHILDREN + 1) - 1);
    }

    /// Helper for [`processes_sharing_a_file_race_one_winner`], run in a
    /// child process; does nothing unless that test set its environment.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    #[ignore = "run as a child process by processes_sharing_a_file_race_one_winner"]
    async fn cross_process_child() {
        let Ok(path) = std::env::var("IDEM_CHILD_DB") else {
            eprintln!("cross_process_child: only meaningful as a child of processes_sharing_a_file_race_one_winner");
            return;
        };
        let var = |k: &str| std::env::var(k).unwrap_or_else(|_| panic!("{k} unset"));
        let scope = Scope::new(var("IDEM_CHILD_SCOPE")).expect("scope");
        let key = idem_core::IdempotencyKey::new(var("IDEM_CHILD_KEY")).expect("key");
        let start_at: u64 = var("IDEM_CHILD_START_AT_MS").parse().expect("start");
        let tasks: usize = var("IDEM_CHILD_TASKS").parse().expect("tasks");
        let store = SqliteStore::open(&path).await.expect("open in child");
        let (acquired, in_flight) = race_at(&store, &scope, &key, start_at, tasks).await;
        println!("IDEM_CHILD_RESULT acquired={acquired} in_flight={in_flight}");
    }

    /// Sleeps until `start_at` (ms since the epoch), then fires `n`
    /// concurrent begins; returns (acquired, in flight).
    async fn race_at(
        store: &SqliteStore,
        scope: &Scope,
        key: &idem_core::IdempotencyKey,
        start_at: u64,
        n: usize,
    ) -> (usize, usize) {
        let now = now_ms();
        tokio::time::sleep(Duration::from_millis(start_at.saturating_sub(now))).await;
        let r = req(scope, key, fp("a"), MIN);
        let tasks: Vec<_> = (0..n)
            .map(|_| {
                let (store, r) = (store.clone(), r.clone());
                tokio::spawn(async move { store.begin(&r).await })
            })
            .collect();
        let (mut acquired, mut in_flight) = (0, 0);
        for t in tasks {
            match t.await.expect("task").expect("begin") {
                Begin::Acquired(_) => acquired += 1,
                Begin::InFlight { .. } => in_flight += 1,
                other => panic!("unexpected {other:?}"),
            }
        }
        (acquired, in_flight)
    }

    fn now_ms() -> u64 {
        idem_core::Clock::now(&idem_core::SystemClock).0
    }
}
