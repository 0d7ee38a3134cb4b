//! [`MySqlStore`] against a real MySQL / MariaDB server: the whole
//! conformance suite, plus what it cannot see — two pools racing one key,
//! bad names, corrupt rows, an unreachable server, lock-wait timeouts,
//! case- and space-sensitive keys, and round trips counted on the wire.
//!
//! Server: `IDEM_TEST_MYSQL_URL` (default `mysql://root@127.0.0.1:3306/test`).
//! Each check works in tables of its own (`idem_t_<random>`), dropped when
//! the check ends, so parallel and later runs never see each other's keys.
//! When the server is down the tests fail (never skip) and name the command
//! that starts it.
//!
//! `cargo test -p idem-sql --test mysql_tests`

mod common;

use std::time::{Duration, Instant};

use async_trait::async_trait;
use idem_core::{IdempotencyKey, Phase, Store, StoreError};
use idem_sql::{MySqlOptions, MySqlStore};
use idem_testkit::support::{
    acquire, expect_in_flight, expect_in_progress, fp, fresh_key, fresh_scope, req, response,
};
use idem_testkit::Harness;

use common::MIN;

const START: &str = "start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd";

fn url() -> String {
    std::env::var("IDEM_TEST_MYSQL_URL")
        .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into())
}

/// A store on fresh tables; they are dropped when this is dropped.
struct MyHarness {
    store: MySqlStore,
    tables: TablesGuard,
}

struct TablesGuard(String);

impl Drop for TablesGuard {
    fn drop(&mut self) {
        let table = self.0.clone();
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async {
                use sqlx::Connection;
                let Ok(mut c) = sqlx::MySqlConnection::connect(&url()).await else {
                    return;
                };
                let _ = sqlx::raw_sql(&format!(
                    "SET SESSION lock_wait_timeout = 5; \
                     DROP TABLE IF EXISTS `{table}`, `{table}_fence`"
                ))
                .execute(&mut c)
                .await;
                let _ = c.close().await;
            });
        })
        .join();
    }
}

fn options(table: &str) -> MySqlOptions {
    MySqlOptions::new(url())
        .with_table(table)
        .with_max_connections(8)
}

async fn connect(opts: MySqlOptions) -> MySqlStore {
    match MySqlStore::connect_with(opts).await {
        Ok(s) => s,
        Err(e) => common::connect_failed("MySQL/MariaDB", &url(), &e, START),
    }
}

async fn my_harness_with(f: impl FnOnce(MySqlOptions) -> MySqlOptions) -> MyHarness {
    let table = format!("idem_t_{}", common::suffix());
    let tables = TablesGuard(table.clone());
    let store = connect(f(options(&table))).await;
    MyHarness { store, tables }
}

async fn my_harness() -> MyHarness {
    my_harness_with(|o| o).await
}

#[async_trait]
impl Harness for MyHarness {
    type S = MySqlStore;

    fn store(&self) -> MySqlStore {
        self.store.clone()
    }

    /// The server keeps its own time: let it pass.
    async fn advance(&self, d: Duration) {
        tokio::time::sleep(d).await;
    }
}

mod mysql_tests {
    use super::*;

    idem_testkit::conformance_tests!(conformance, my_harness);

    /// 64 concurrent begins of one key from two stores with separate pools:
    /// exactly one `Acquired`; then 64 racing takeovers of an expired claim:
    /// exactly one winner, with a larger fence.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn sixty_four_begins_from_two_pools_one_winner() {
        let h = my_harness().await;
        let other = connect(options(&h.tables.0)).await;
        for _ in 0..3 {
            common::race_two_pools(&h.store, &other, 64).await;
        }
        common::race_takeover_two_pools(&h.store, &other, 64).await;
    }

    /// Table names are validated before anything is sent.
    #[tokio::test]
    async fn bad_names_are_config_errors() {
        for table in [
            "idem-records",
            "idem records",
            "1records",
            "t`; DROP TABLE x; --",
            "",
            "t".repeat(55).as_str(),
        ] {
            let started = Instant::now();
            let got = MySqlStore::connect_with(MySqlOptions::new(url()).with_table(table)).await;
            assert!(
                matches!(got, Err(StoreError::Config(_))),
                "{table:?}: {got:?}"
            );
            assert!(started.elapsed() < Duration::from_secs(1));
        }
        assert!(matches!(
            MySqlStore::connect("postgres://x@127.0.0.1/test").await,
            Err(StoreError::Config(_))
        ));
    }

    /// A table with the configured name but other columns is refused at connect.
    #[tokio::test]
    async fn foreign_table_shape_is_config_error() {
        let h = my_harness().await;
        let name = format!("{}_other", h.tables.0);
        sqlx::raw_sql(&format!("CREATE TABLE `{name}` (id INT PRIMARY KEY)"))
            .execute(h.store.pool())
            .await
            .expect("create");
        let got = MySqlStore::connect_with(options(&name).with_migrate(false)).await;
        sqlx::raw_sql(&format!("DROP TABLE `{name}`"))
            .execute(h.store.pool())
            .await
            .expect("drop");
        assert!(matches!(got, Err(StoreError::Config(_))), "{got:?}");
    }

    /// Corrupt rows are `Corrupt`, never a panic.
    #[tokio::test]
    async fn corrupt_rows_are_corrupt_errors() {
        let h = my_harness().await;
        let pool = h.store.pool().clone();
        let table = h.store.table().to_owned();
        common::corrupt_rows(&h.store, |scope, key, what| {
            let (pool, table) = (pool.clone(), table.clone());
            async move {
                let set = match what {
                    "response" => "response = x'deadbeef'",
                    "null-response" => "response = NULL",
                    _ => "fingerprint = x'00'",
                };
                sqlx::query(&format!(
                    "UPDATE {table} SET {set} WHERE scope = ? AND `key` = ?"
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
        common::unreachable_fails_fast(MySqlStore::connect(&format!(
            "mysql://root@127.0.0.1:{port}/test"
        )))
        .await;
    }

    /// A step blocked by another transaction's row lock for longer than
    /// `lock_wait_timeout` fails with `Timeout` and writes nothing.
    #[tokio::test]
    async fn lock_wait_timeout_is_timeout() {
        let h = my_harness_with(|o| o.with_lock_wait_timeout(Duration::from_secs(1))).await;
        let store = &h.store;
        let (scope, key) = (fresh_scope(), fresh_key("timeout"));
        let lease = acquire(store, &req(&scope, &key, fp("a"), MIN)).await;
        let mut blocker = store.pool().begin().await.expect("tx");
        sqlx::query(&format!(
            "SELECT 1 FROM {} WHERE scope = ? AND `key` = ? FOR UPDATE",
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
        assert!(started.elapsed() < Duration::from_secs(4));
        blocker.rollback().await.expect("unlock");
        expect_in_progress(store, &scope, &key, fp("a"), lease.fence).await;
        store
            .complete(&lease, &response("x"), MIN)
            .await
            .expect("complete once unblocked");
    }

    /// Keys differing only in case or trailing spaces are distinct records
    /// (the columns are binary; a default collation would merge them).
    #[tokio::test]
    async fn keys_are_compared_byte_for_byte() {
        let h = my_harness().await;
        let store = &h.store;
        let scope = fresh_scope();
        let base = fresh_key("Case");
        let variants = [
            base.as_str().to_owned(),
            base.as_str().to_lowercase(),
            format!("{} ", base.as_str()),
            format!("{}  ", base.as_str()),
        ];
        for k in &variants {
            let key = IdempotencyKey::new(k.clone()).expect("key");
            acquire(store, &req(&scope, &key, fp(k), MIN)).await;
        }
        for k in &variants {
            let key = IdempotencyKey::new(k.clone()).expect("key");
            expect_in_flight(store, &req(&scope, &key, fp(k), MIN), MIN).await;
        }
    }

    /// `extend` twice within the same millisecond to the same end still
    /// succeeds (an UPDATE that changes nothing is not a lost lease).
    #[tokio::test]
    async fn extend_to_the_same_deadline_is_not_lease_lost() {
        let h = my_harness().await;
        let store = &h.store;
        let (scope, key) = (fresh_scope(), fresh_key("extend"));
        let lease = acquire(store, &req(&scope, &key, fp("a"), MIN)).await;
        for _ in 0..50 {
            let a = store.extend(&lease, MIN).await.expect("extend");
            let b = store.extend(&lease, MIN).await.expect("extend again");
            assert!(b.until >= a.until);
        }
    }

    /// Round trips on the wire with one warmed-up connection: a claim is six
    /// (read, BEGIN, upsert, fence, update, COMMIT), `complete` one, a
    /// replay one.
    #[tokio::test]
    async fn round_trips_claim_six_complete_one_replay_one() {
        let h = my_harness().await;
        let parsed = url::Url::parse(&url()).expect("url");
        let upstream = format!(
            "{}:{}",
            parsed.host_str().expect("host"),
            parsed.port().unwrap_or(3306)
        );
        let proxy = common::RoundTripProxy::start(upstream).await;
        let mut via = parsed.clone();
        via.set_host(Some("127.0.0.1")).expect("host");
        via.set_port(Some(proxy.port)).expect("port");
        let store = connect(
            MySqlOptions::new(via.as_str())
                .with_table(&h.tables.0)
                .with_max_connections(1),
        )
        .await;
        let (begin, complete, replay) = common::count_round_trips(&store, &proxy).await;
        assert_eq!(
            (begin, complete, replay),
            (6, 1, 1),
            "round trips (begin, complete, replay)"
        );
    }

    /// `purge_expired` deletes in batches and trims the fence counter table,
    /// keeping its newest row; fences keep growing afterwards.
    #[tokio::test]
    async fn purge_works_in_batches_and_keeps_fences_growing() {
        let h = my_harness().await;
        let store = &h.store;
        let scope = fresh_scope();
        let live = acquire(store, &req(&scope, &fresh_key("live"), fp("a"), MIN)).await;
        let fingerprint = fp("a");
        let mut tx = store.pool().begin().await.expect("tx");
        for chunk in 0..5 {
            let mut sql = format!(
                "INSERT INTO {} (scope, `key`, fingerprint, state, fence, deadline, response) VALUES ",
                store.table()
            );
            let rows: Vec<String> = (0..500)
                .map(|i| format!("(?, 'k{}', ?, 0, 1, 1, NULL)", chunk * 500 + i))
                .collect();
            sql.push_str(&rows.join(", "));
            let mut q = sqlx::query(&sql);
            for _ in 0..500 {
                q = q
                    .bind(scope.as_str().as_bytes())
                    .bind(fingerprint.as_bytes().as_slice());
            }
            q.execute(&mut *tx).await.expect("seed");
        }
        tx.commit().await.expect("commit");
        assert_eq!(store.purge_expired().await.expect("purge"), 2500);
        expect_in_progress(store, &scope, &live.key, fp("a"), live.fence).await;
        let left: i64 = sqlx::query_scalar(&format!("SELECT COUNT(*) FROM `{}_fence`", h.tables.0))
            .fetch_one(store.pool())
            .await
            .expect("count");
        assert_eq!(left, 1, "the newest fence row is kept");
        let next = acquire(store, &req(&scope, &fresh_key("next"), fp("a"), MIN)).await;
        assert!(next.fence > live.fence);
    }
}
