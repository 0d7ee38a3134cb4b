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

use std::time::Duration;

use common::servers::Server;
use common::MIN;
use idem_core::{IdempotencyKey, Store, StoreError};
use idem_sql::{MySqlOptions, MySqlStore};
use idem_testkit::support::{acquire, expect_in_flight, fp, fresh_key, fresh_scope, req};

common::server_backend!(
    MySqlStore, MySqlOptions, sqlx::MySql, Server::MySql,
    by_key: "scope = ? AND `key` = ?", with_table,
    drop: "SET SESSION lock_wait_timeout = 5; DROP TABLE IF EXISTS `{0}`, `{0}_fence`"
);

mod mysql_tests {
    use super::*;

    idem_testkit::conformance_tests!(conformance, harness);

    common::server_checks!(
        MySqlStore,
        corrupt: ["response = x'deadbeef'", "response = NULL", "fingerprint = x'00'"],
        unreachable: "mysql://root@127.0.0.1:{}/test",
        round_trips:
        /// Round trips on the wire with one warmed-up connection: a claim is six
        /// (read, BEGIN, upsert, fence, update, COMMIT), `complete` one, a
        /// replay one.
        round_trips_claim_six_complete_one_replay_one => (6, 1, 1)
    );

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
            common::refused_as_config(
                &format!("{table:?}"),
                MySqlStore::connect_with(MySqlOptions::new(url()).with_table(table)),
            )
            .await;
        }
        assert!(matches!(
            MySqlStore::connect("postgres://x@127.0.0.1/test").await,
            Err(StoreError::Config(_))
        ));
    }

    /// A table with the configured name but other columns is refused at connect.
    #[tokio::test]
    async fn foreign_table_shape_is_config_error() {
        let h = harness().await;
        let name = format!("{}_other", name_of(&h));
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

    /// A step blocked by another transaction's row lock for longer than
    /// `lock_wait_timeout` fails with `Timeout` and writes nothing.
    #[tokio::test]
    async fn lock_wait_timeout_is_timeout() {
        let h = harness_with(|o| o.with_lock_wait_timeout(Duration::from_secs(1))).await;
        common::blocked_step_is_timeout(&h.store, Duration::from_secs(4)).await;
    }

    /// Keys differing only in case or trailing spaces are distinct records
    /// (the columns are binary; a default collation would merge them).
    #[tokio::test]
    async fn keys_are_compared_byte_for_byte() {
        let h = harness().await;
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
        let h = harness().await;
        let store = &h.store;
        let (scope, key) = (fresh_scope(), fresh_key("extend"));
        let lease = acquire(store, &req(&scope, &key, fp("a"), MIN)).await;
        for _ in 0..50 {
            let a = store.extend(&lease, MIN).await.expect("extend");
            let b = store.extend(&lease, MIN).await.expect("extend again");
            assert!(b.until >= a.until);
        }
    }

    /// `purge_expired` deletes in batches and trims the fence counter table,
    /// keeping its newest row; fences keep growing afterwards.
    #[tokio::test]
    async fn purge_works_in_batches_and_keeps_fences_growing() {
        let h = harness().await;
        let store = &h.store;
        let live = common::purge_in_batches(store, |scope| async move {
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
        })
        .await;
        let scope = live.scope.clone();
        let left: i64 =
            sqlx::query_scalar(&format!("SELECT COUNT(*) FROM `{}_fence`", name_of(&h)))
                .fetch_one(store.pool())
                .await
                .expect("count");
        assert_eq!(left, 1, "the newest fence row is kept");
        let next = acquire(store, &req(&scope, &fresh_key("next"), fp("a"), MIN)).await;
        assert!(next.fence > live.fence);
    }
}
