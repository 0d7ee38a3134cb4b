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

use common::servers::Server;
use common::{ServerHarness, MIN};
use idem_core::{Store, StoreError};
use idem_sql::{PostgresOptions, PostgresStore};
use idem_testkit::support::{acquire, fp, fresh_key, fresh_scope, req, response};

/// A store in a fresh schema; the schema is dropped when the check ends.
type PgHarness = ServerHarness<PostgresStore>;

common::server_backend!(
    PostgresStore, PostgresOptions, sqlx::Postgres, Server::Postgres,
    by_key: "scope = $1 AND key = $2", with_schema,
    drop: "SET lock_timeout = '5s'; DROP SCHEMA IF EXISTS \"{0}\" CASCADE"
);

mod postgres_tests {
    use super::*;

    idem_testkit::conformance_tests!(conformance, harness);

    common::server_checks!(
        PostgresStore,
        corrupt: [
            "response = '\\xdeadbeef'::bytea",
            "response = NULL",
            "fingerprint = '\\x00'::bytea",
        ],
        unreachable: "postgres://postgres@127.0.0.1:{}/test",
        round_trips:
        /// Round trips on the wire, through a counting proxy, with one pooled
        /// connection whose statements are already prepared: `begin` 1,
        /// `complete` 1, a replay 1 (so a first execution costs 2).
        round_trips_first_execution_two_replay_one => (1, 1, 1)
    );

    /// The conformance suite again with notifications off: `wait_for_change`
    /// polls, and `complete` / `release` run without `pg_notify`.
    mod without_notify {
        use super::*;

        async fn polling_harness() -> PgHarness {
            harness_with(|o| o.with_notify(false)).await
        }

        idem_testkit::conformance_tests!(conformance, polling_harness);
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
            common::refused_as_config(
                &format!("{schema:?}.{table:?}"),
                PostgresStore::connect_with(
                    PostgresOptions::new(url())
                        .with_schema(schema)
                        .with_table(table),
                ),
            )
            .await;
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
        let h = harness().await;
        let schema = name_of(&h);
        sqlx::raw_sql(&format!(
            "CREATE TABLE \"{schema}\".\"not_ours\" (id int PRIMARY KEY)"
        ))
        .execute(h.store.pool())
        .await
        .expect("create");
        let got = PostgresStore::connect_with(options(schema).with_table("not_ours")).await;
        assert!(matches!(got, Err(StoreError::Config(_))), "{got:?}");
    }

    /// A step that outlives `statement_timeout` (here: blocked by another
    /// transaction's row lock) fails with `Timeout` and writes nothing.
    #[tokio::test]
    async fn statement_timeout_is_timeout() {
        let h = harness_with(|o| o.with_statement_timeout(Some(Duration::from_millis(300)))).await;
        common::blocked_step_is_timeout(&h.store, Duration::from_secs(3)).await;
    }

    /// With polling made useless (10 s), a waiter still wakes within
    /// ~100 ms of `complete` and of `release`: the wake-up comes from
    /// `NOTIFY`.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn notify_wakes_waiters_promptly() {
        let h = harness_with(|o| o.with_poll_interval(Duration::from_secs(10))).await;
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

    /// `purge_expired` deletes in batches: 2,500 expired records go in one
    /// call; live ones stay.
    #[tokio::test]
    async fn purge_works_in_batches() {
        let h = harness().await;
        let store = &h.store;
        common::purge_in_batches(store, |scope| async move {
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
        })
        .await;
    }
}
