//! [`PostgresStore`] against a real PostgreSQL server: the whole
//! conformance suite, plus what it cannot see — two pools racing one key,
//! bad names, corrupt rows, an unreachable server, the statement timeout,
//! `LISTEN`/`NOTIFY` wake-ups, and round trips counted on the wire.
//!
//! Server: `IDEM_TEST_POSTGRES_URL` (default
//! `postgres://postgres@127.0.0.1:5432/test`). Each check works in a schema
//! of its own (`idem_t_<random>`), dropped when the check ends, so parallel
//! and later runs never see each other's keys. When the server is down the
//! tests fail (never skip) and name the command that starts it.
//!
//! `cargo test -p idem-sql --test postgres_tests`

mod common;

use std::time::{Duration, Instant};

use async_trait::async_trait;
use idem_core::{Phase, Store, StoreError};
use idem_sql::{PostgresOptions, PostgresStore};
use idem_testkit::support::{
    acquire, expect_in_progress, fp, fresh_key, fresh_scope, req, response,
};
use idem_testkit::Harness;

use common::MIN;

const START: &str = "pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start";

fn url() -> String {
    std::env::var("IDEM_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

/// A store in a fresh schema; the schema is dropped when this is dropped.
struct PgHarness {
    store: PostgresStore,
    _schema: SchemaGuard,
}

struct SchemaGuard(String);

impl Drop for SchemaGuard {
    fn drop(&mut self) {
        // Drop is synchronous: clean up on a thread with its own runtime.
        let schema = self.0.clone();
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async {
                use sqlx::Connection;
                let Ok(mut c) = sqlx::PgConnection::connect(&url()).await else {
                    return;
                };
                let _ = sqlx::raw_sql(&format!(
                    "SET lock_timeout = '5s'; DROP SCHEMA IF EXISTS \"{schema}\" CASCADE"
                ))
                .execute(&mut c)
                .await;
                let _ = c.close().await;
            });
        })
        .join();
    }
}

fn options(schema: &str) -> PostgresOptions {
    PostgresOptions::new(url())
        .with_schema(schema)
        .with_max_connections(8)
}

async fn connect(opts: PostgresOptions) -> PostgresStore {
    match PostgresStore::connect_with(opts).await {
        Ok(s) => s,
        Err(e) => common::connect_failed("PostgreSQL", &url(), &e, START),
    }
}

async fn pg_harness_with(f: impl FnOnce(PostgresOptions) -> PostgresOptions) -> PgHarness {
    let schema = format!("idem_t_{}", common::suffix());
    let guard = SchemaGuard(schema.clone());
    let store = connect(f(options(&schema))).await;
    PgHarness {
        store,
        _schema: guard,
    }
}

async fn pg_harness() -> PgHarness {
    pg_harness_with(|o| o).await
}

#[async_trait]
impl Harness for PgHarness {
    type S = PostgresStore;

    fn store(&self) -> PostgresStore {
        self.store.clone()
    }

    /// The database keeps its own time: let it pass.
    async fn advance(&self, d: Duration) {
        tokio::time::sleep(d).await;
    }
}

mod postgres_tests {
    use super::*;

    idem_testkit::conformance_tests!(conformance, pg_harness);

    /// The conformance suite again with notifications off: `wait_for_change`
    /// polls, and `complete` / `release` run without `pg_notify`.
    mod without_notify {
        use super::*;

        async fn polling_harness() -> PgHarness {
            pg_harness_with(|o| o.with_notify(false)).await
        }

        idem_testkit::conformance_tests!(conformance, polling_harness);
    }

    /// 64 concurrent begins of one key from two stores with separate pools:
    /// exactly one `Acquired`; then 64 racing takeovers of an expired claim:
    /// exactly one winner, with a larger fence.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn sixty_four_begins_from_two_pools_one_winner() {
        let h = pg_harness().await;
        let schema = h._schema.0.clone();
        let other = connect(options(&schema)).await;
        for _ in 0..3 {
            common::race_two_pools(&h.store, &other, 64).await;
        }
        common::race_takeover_two_pools(&h.store, &other, 64).await;
    }

    /// Schema and table names are validated before anything is sent: bad
    /// characters, a leading digit, quotes, SQL, too long → `Config`.
    #[tokio::test]
    async fn bad_names_are_config_errors() {
        for (schema, table) in [
            ("public", "idem-records"),
            ("public", "idem records"),
            ("public", "1records"),
            ("public", "t\"; DROP TABLE x; --"),
            ("public", ""),
            ("public", "t".repeat(55).as_str()),
            ("bad schema", "idem_records"),
            ("s".repeat(64).as_str(), "idem_records"),
        ] {
            let started = Instant::now();
            let got = PostgresStore::connect_with(
                PostgresOptions::new(url())
                    .with_schema(schema)
                    .with_table(table),
            )
            .await;
            assert!(
                matches!(got, Err(StoreError::Config(_))),
                "{schema:?}.{table:?}: {got:?}"
            );
            assert!(started.elapsed() < Duration::from_secs(1));
        }
        for bad_url in ["mysql://root@127.0.0.1/test", "not a url"] {
            assert!(matches!(
                PostgresStore::connect(bad_url).await,
                Err(StoreError::Config(_))
            ));
        }
    }

    /// A table with the configured name but other columns is refused at connect.
    #[tokio::test]
    async fn foreign_table_shape_is_config_error() {
        let h = pg_harness().await;
        let schema = &h._schema.0;
        sqlx::raw_sql(&format!(
            "CREATE TABLE \"{schema}\".\"not_ours\" (id int PRIMARY KEY)"
        ))
        .execute(h.store.pool())
        .await
        .expect("create");
        let got = PostgresStore::connect_with(options(schema).with_table("not_ours")).await;
        assert!(matches!(got, Err(StoreError::Config(_))), "{got:?}");
    }

    /// Corrupt rows are `Corrupt`, never a panic.
    #[tokio::test]
    async fn corrupt_rows_are_corrupt_errors() {
        let h = pg_harness().await;
        let pool = h.store.pool().clone();
        let table = h.store.table().to_owned();
        common::corrupt_rows(&h.store, |scope, key, what| {
            let (pool, table) = (pool.clone(), table.clone());
            async move {
                let set = match what {
                    "response" => "response = '\\xdeadbeef'::bytea",
                    "null-response" => "response = NULL",
                    _ => "fingerprint = '\\x00'::bytea",
                };
                sqlx::query(&format!(
                    "UPDATE {table} SET {set} WHERE scope = $1 AND key = $2"
                ))
                .bind(scope.as_str().as_bytes())
                .bind(key.as_str().as_bytes())
                .execute(&pool)
                .await
                .expect("corrupt the row");
            }
        })
        .await;
    }

    /// A closed port: `Unavailable` at connect, quickly, with the source kept.
    #[tokio::test]
    async fn unreachable_server_is_unavailable_quickly() {
        let port = common::closed_port();
        common::unreachable_fails_fast(PostgresStore::connect(&format!(
            "postgres://postgres@127.0.0.1:{port}/test"
        )))
        .await;
    }

    /// A step that outlives `statement_timeout` (here: blocked by another
    /// transaction's row lock) fails with `Timeout` and writes nothing.
    #[tokio::test]
    async fn statement_timeout_is_timeout() {
        let h =
            pg_harness_with(|o| o.with_statement_timeout(Some(Duration::from_millis(300)))).await;
        let store = &h.store;
        let (scope, key) = (fresh_scope(), fresh_key("timeout"));
        let lease = acquire(store, &req(&scope, &key, fp("a"), MIN)).await;
        let mut blocker = store.pool().begin().await.expect("tx");
        sqlx::query(&format!(
            "SELECT 1 FROM {} WHERE scope = $1 AND key = $2 FOR UPDATE",
            store.table()
        ))
        .bind(scope.as_str().as_bytes())
        .bind(key.as_str().as_bytes())
        .execute(&mut *blocker)
        .await
        .expect("lock the row");
        let started = Instant::now();
        match store.complete(&lease, &response("x"), MIN).await {
            Err(StoreError::Timeout {
                phase: Phase::Complete,
            }) => {}
            other => panic!("expected Timeout, got {other:?}"),
        }
        assert!(started.elapsed() < Duration::from_secs(3));
        blocker.rollback().await.expect("unlock");
        expect_in_progress(store, &scope, &key, fp("a"), lease.fence).await;
        store
            .complete(&lease, &response("x"), MIN)
            .await
            .expect("complete once unblocked");
    }

    /// With polling made useless (10 s), a waiter still wakes within
    /// ~100 ms of `complete` and of `release`: the wake-up comes from
    /// `NOTIFY`.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn notify_wakes_waiters_promptly() {
        let h = pg_harness_with(|o| o.with_poll_interval(Duration::from_secs(10))).await;
        let store = h.store.clone();
        for finish in ["complete", "release"] {
            let (scope, key) = (fresh_scope(), fresh_key(finish));
            let lease = acquire(&store, &req(&scope, &key, fp("a"), MIN)).await;
            let waiter = {
                let (store, scope, key) = (store.clone(), scope.clone(), key.clone());
                tokio::spawn(async move {
                    store
                        .wait_for_change(&scope, &key, Duration::from_secs(20))
                        .await
                        .expect("wait");
                    Instant::now()
                })
            };
            tokio::time::sleep(Duration::from_millis(300)).await;
            assert!(!waiter.is_finished(), "{finish}: the waiter waits");
            let done_at = Instant::now();
            match finish {
                "complete" => store.complete(&lease, &response("x"), MIN).await,
                _ => store.release(&lease).await,
            }
            .expect("finish");
            let woke = tokio::time::timeout(Duration::from_secs(5), waiter)
                .await
                .expect("the waiter wakes")
                .expect("task");
            let latency = woke.saturating_duration_since(done_at);
            assert!(
                latency < Duration::from_millis(500),
                "{finish}: woke {latency:?} after the change"
            );
        }
        // A change to another key does not end the wait (it may wake
        // spuriously, but then returns only by `max`).
        let (scope, key) = (fresh_scope(), fresh_key("quiet"));
        acquire(&store, &req(&scope, &key, fp("a"), MIN)).await;
        let other = acquire(&store, &req(&scope, &fresh_key("other"), fp("a"), MIN)).await;
        let started = Instant::now();
        let waiting = store.wait_for_change(&scope, &key, Duration::from_millis(600));
        let (r, _) = tokio::join!(waiting, async {
            tokio::time::sleep(Duration::from_millis(100)).await;
            store.complete(&other, &response("o"), MIN).await
        });
        r.expect("wait");
        assert!(started.elapsed() >= Duration::from_millis(550));
    }

    /// Round trips on the wire, through a counting proxy, with one pooled
    /// connection whose statements are already prepared: `begin` 1,
    /// `complete` 1, a replay 1 (so a first execution costs 2).
    #[tokio::test]
    async fn round_trips_first_execution_two_replay_one() {
        let h = pg_harness().await;
        let parsed = url::Url::parse(&url()).expect("url");
        let upstream = format!(
            "{}:{}",
            parsed.host_str().expect("host"),
            parsed.port().unwrap_or(5432)
        );
        let proxy = common::RoundTripProxy::start(upstream).await;
        let mut via = parsed.clone();
        via.set_host(Some("127.0.0.1")).expect("host");
        via.set_port(Some(proxy.port)).expect("port");
        let store = connect(
            PostgresOptions::new(via.as_str())
                .with_schema(&h._schema.0)
                .with_max_connections(1),
        )
        .await;
        let (begin, complete, replay) = common::count_round_trips(&store, &proxy).await;
        assert_eq!(
            (begin, complete, replay),
            (1, 1, 1),
            "round trips (begin, complete, replay)"
        );
    }

    /// `purge_expired` deletes in batches: 2,500 expired records go in one
    /// call; live ones stay.
    #[tokio::test]
    async fn purge_works_in_batches() {
        let h = pg_harness().await;
        let store = &h.store;
        let scope = fresh_scope();
        let live = acquire(store, &req(&scope, &fresh_key("live"), fp("a"), MIN)).await;
        sqlx::query(&format!(
            "INSERT INTO {} (scope, key, fingerprint, state, fence, deadline, response) \
             SELECT $1, convert_to('k' || g, 'UTF8'), $2, 0, g, 1, NULL \
             FROM generate_series(1, 2500) g",
            store.table()
        ))
        .bind(scope.as_str().as_bytes())
        .bind(fp("a").as_bytes().as_slice())
        .execute(store.pool())
        .await
        .expect("seed expired rows");
        assert_eq!(store.purge_expired().await.expect("purge"), 2500);
        expect_in_progress(store, &scope, &live.key, fp("a"), live.fence).await;
    }
}
