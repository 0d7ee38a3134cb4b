//! The transactional inbox (`idem_sql::inbox`) against SQLite (a temp file),
//! PostgreSQL and MySQL/MariaDB (real servers; unreachable → the test
//! FAILS naming the start command). Each test uses its own random inbox and
//! business tables and drops them at the end.
//!
//! Servers: `IDEM_TEST_POSTGRES_URL` (default
//! `postgres://postgres@127.0.0.1:5432/test`), `IDEM_TEST_MYSQL_URL`
//! (default `mysql://root@127.0.0.1:3306/test`).
//!
//! CASES.md section H: H1 (a duplicate recognised by error code, under a
//! non-English `lc_messages` on PostgreSQL where the OS has such a locale),
//! H2 (committed, ack lost → the redelivery is a duplicate), H3 (a failing
//! handler commits neither its effect nor the inbox row).

mod servers;

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idem_sql::inbox::{Claim, Inbox, InboxError, InboxOptions, ProcessError, Processed};

/// Commits a claim that must be new.
async fn commit_new<DB: idem_sql::inbox::InboxDatabase>(claim: Claim<DB>) {
    match claim {
        Claim::New(tx) => tx.commit().await.expect("commit"),
        Claim::Duplicate => panic!("expected a new claim"),
    }
}

fn suffix() -> String {
    idem_testkit::support::random_hex(10)
}

/// The scenarios, for one database: `$pool` is an async expression giving
/// a pool; `$credits` creates the credits table `{0}` (`payment_id`,
/// `cents`); `$ins` inserts a credit `(payment_id, cents)`; `$drop` drops a
/// table. Writes `setup_with(pool)` and `setup()`, giving `(inbox,
/// credits_table, inbox_table)`, and `duplicate_error`.
macro_rules! scenarios {
    ($db:ty, $pool:expr, $credits:literal, $ins:literal, $drop:literal) => {
        use super::*;

        type Db = $db;

        async fn setup_with(pool: sqlx::Pool<Db>) -> (Inbox<Db>, String, String) {
            let (table, credits) = (
                format!("inbox_{}", suffix()),
                format!("credits_{}", suffix()),
            );
            sqlx::query(&format!($credits, credits))
                .execute(&pool)
                .await
                .unwrap();
            let inbox =
                Inbox::with_options(pool, InboxOptions::default().with_table(table.clone()))
                    .unwrap();
            inbox.migrate().await.unwrap();
            (inbox, credits, table)
        }

        async fn setup() -> (Inbox<Db>, String, String) {
            setup_with($pool.await).await
        }

        /// H1: on fresh tables on `pool`, claims `("c", "m")`, then runs
        /// `insert` (that row again, by hand, `{0}` the inbox table) and
        /// returns the database's error; `claim` still answers `Duplicate`
        /// afterwards. The tables are dropped.
        async fn duplicate_error(pool: sqlx::Pool<Db>, insert: &str) -> sqlx::Error {
            let (inbox, credits, table) = setup_with(pool).await;
            commit_new(inbox.claim("c", "m").await.unwrap()).await;
            let err = sqlx::query(&insert.replace("{0}", &table))
                .execute(inbox.pool())
                .await
                .unwrap_err();
            assert!(matches!(
                inbox.claim("c", "m").await.unwrap(),
                Claim::Duplicate
            ));
            cleanup(&inbox, &[&credits, &table]).await;
            err
        }

        /// The error code of a database error.
        #[allow(dead_code)]
        fn code(err: &sqlx::Error) -> Option<String> {
            err.as_database_error()
                .and_then(|e| e.code())
                .map(|c| c.into_owned())
        }

        async fn credit(
            tx: &mut sqlx::Transaction<'static, Db>,
            credits: &str,
            id: &str,
        ) -> Result<(), sqlx::Error> {
            sqlx::query(&format!($ins, credits))
                .bind(id.to_owned())
                .bind(500_i64)
                .execute(&mut **tx)
                .await
                .map(|_| ())
        }

        async fn effects(inbox: &Inbox<Db>, credits: &str, id: Option<&str>) -> i64 {
            let sql = match id {
                Some(id) => format!("SELECT count(*) FROM {credits} WHERE payment_id = '{id}'"),
                None => format!("SELECT count(*) FROM {credits}"),
            };
            sqlx::query_scalar::<_, i64>(&sql)
                .fetch_one(inbox.pool())
                .await
                .expect("count")
        }

        async fn cleanup(inbox: &Inbox<Db>, tables: &[&str]) {
            for t in tables {
                sqlx::query(&format!($drop, t))
                    .execute(inbox.pool())
                    .await
                    .expect("drop");
            }
        }

        /// One delivery through `process`: credits `id` once.
        async fn deliver(inbox: &Inbox<Db>, credits: &str, id: &str) -> Processed<()> {
            let (credits, idc) = (credits.to_owned(), id.to_owned());
            inbox
                .process("payments", id, move |tx| {
                    Box::pin(async move { credit(tx, &credits, &idc).await })
                })
                .await
                .expect("process")
        }

        #[tokio::test]
        async fn n_messages_with_injected_duplicates_give_n_effects() {
            let (inbox, credits, table) = setup().await;
            let n = 20;
            let mut applied = 0;
            let mut dups = 0;
            // Each id delivered 1–3 times, interleaved.
            for round in 0..3 {
                for i in 0..n {
                    if round > 0 && i % (round + 1) != 0 {
                        continue;
                    }
                    match deliver(&inbox, &credits, &format!("pay-{i}")).await {
                        Processed::Applied(()) => applied += 1,
                        Processed::Duplicate => dups += 1,
                    }
                }
            }
            assert_eq!(applied, n);
            assert!(dups > 0);
            assert_eq!(effects(&inbox, &credits, None).await, n as i64);
            for i in 0..n {
                assert_eq!(
                    effects(&inbox, &credits, Some(&format!("pay-{i}"))).await,
                    1
                );
                assert!(inbox
                    .is_processed("payments", &format!("pay-{i}"))
                    .await
                    .unwrap());
            }
            cleanup(&inbox, &[&credits, &table]).await;
        }

        #[tokio::test]
        async fn concurrent_copies_apply_once() {
            let (inbox, credits, table) = setup().await;
            let inbox = Arc::new(inbox);
            let tasks: Vec<_> = (0..6)
                .map(|_| {
                    let (inbox, credits) = (inbox.clone(), credits.clone());
                    tokio::spawn(async move { deliver(&inbox, &credits, "same").await })
                })
                .collect();
            let mut applied = 0;
            for t in tasks {
                if t.await.unwrap() == Processed::Applied(()) {
                    applied += 1;
                }
            }
            assert_eq!(applied, 1);
            assert_eq!(effects(&inbox, &credits, Some("same")).await, 1);
            cleanup(&inbox, &[&credits, &table]).await;
        }

        /// H3: the handler wrote its effect, then failed → neither the
        /// effect nor the inbox row is committed; the redelivery applies once.
        #[tokio::test]
        async fn h3_failing_handler_commits_neither_effect_nor_row() {
            let (inbox, credits, table) = setup().await;
            let c = credits.clone();
            let r = inbox
                .process("payments", "p1", move |tx| {
                    Box::pin(async move {
                        credit(tx, &c, "p1").await.expect("write");
                        Err::<(), _>("boom after the business write")
                    })
                })
                .await;
            assert!(matches!(
                r,
                Err(ProcessError::Handler("boom after the business write"))
            ));
            assert_eq!(effects(&inbox, &credits, Some("p1")).await, 0);
            assert!(!inbox.is_processed("payments", "p1").await.unwrap());
            assert_eq!(
                deliver(&inbox, &credits, "p1").await,
                Processed::Applied(())
            );
            assert_eq!(effects(&inbox, &credits, Some("p1")).await, 1);
            cleanup(&inbox, &[&credits, &table]).await;
        }

        #[tokio::test]
        async fn fails_twice_then_succeeds_one_effect() {
            let (inbox, credits, table) = setup().await;
            let attempts = Arc::new(AtomicU32::new(0));
            let mut outcomes = Vec::new();
            for _ in 0..5 {
                let (c, a) = (credits.clone(), attempts.clone());
                let r = inbox
                    .process("payments", "flaky", move |tx| {
                        Box::pin(async move {
                            credit(tx, &c, "flaky").await.expect("write");
                            if a.fetch_add(1, Ordering::SeqCst) < 2 {
                                return Err("transient");
                            }
                            Ok(())
                        })
                    })
                    .await;
                outcomes.push(match r {
                    Ok(Processed::Applied(())) => "applied",
                    Ok(Processed::Duplicate) => "duplicate",
                    Err(ProcessError::Handler(_)) => "failed",
                    Err(e) => panic!("{e:?}"),
                });
            }
            assert_eq!(
                outcomes,
                ["failed", "failed", "applied", "duplicate", "duplicate"]
            );
            assert_eq!(attempts.load(Ordering::SeqCst), 3);
            assert_eq!(effects(&inbox, &credits, Some("flaky")).await, 1);
            cleanup(&inbox, &[&credits, &table]).await;
        }

        /// A crash before commit (the transaction dropped) → the redelivery
        /// applies once; a crash between commit and ack (H2) → the
        /// redelivery is a duplicate and the handler does not run.
        #[tokio::test]
        async fn crash_windows() {
            let (inbox, credits, table) = setup().await;
            // Before commit.
            match inbox.claim("payments", "c1").await.unwrap() {
                Claim::New(mut tx) => {
                    credit(&mut tx, &credits, "c1").await.unwrap();
                    drop(tx); // the consumer died: no commit, no ack
                }
                Claim::Duplicate => panic!("fresh id"),
            }
            assert_eq!(
                deliver(&inbox, &credits, "c1").await,
                Processed::Applied(())
            );
            // After commit, before ack.
            match inbox.claim("payments", "c2").await.unwrap() {
                Claim::New(mut tx) => {
                    credit(&mut tx, &credits, "c2").await.unwrap();
                    tx.commit().await.unwrap(); // … and the ack is lost
                }
                Claim::Duplicate => panic!("fresh id"),
            }
            assert_eq!(deliver(&inbox, &credits, "c2").await, Processed::Duplicate);
            assert_eq!(effects(&inbox, &credits, Some("c1")).await, 1);
            assert_eq!(effects(&inbox, &credits, Some("c2")).await, 1);
            cleanup(&inbox, &[&credits, &table]).await;
        }

        /// Consumers are separate namespaces; purge forgets old rows, and a
        /// redelivery after the purge is processed again (documented).
        #[tokio::test]
        async fn consumers_are_separate_and_purge_forgets() {
            let (inbox, credits, table) = setup().await;
            commit_new(inbox.claim("a", "m").await.unwrap()).await;
            commit_new(inbox.claim("b", "m").await.unwrap()).await;
            assert!(matches!(
                inbox.claim("a", "m").await.unwrap(),
                Claim::Duplicate
            ));
            assert!(
                matches!(inbox.claim("a", "M").await.unwrap(), Claim::New(_)),
                "ids compare byte for byte"
            );
            assert_eq!(
                inbox
                    .purge_older_than(Duration::from_secs(3600))
                    .await
                    .unwrap(),
                0
            );
            tokio::time::sleep(Duration::from_millis(1100)).await;
            assert_eq!(
                inbox
                    .purge_older_than(Duration::from_millis(500))
                    .await
                    .unwrap(),
                2
            );
            assert!(
                matches!(inbox.claim("a", "m").await.unwrap(), Claim::New(_)),
                "past retention: processed again"
            );
            cleanup(&inbox, &[&credits, &table]).await;
        }

        /// Issue 16 item 7: ids that differ only by trailing spaces (or a
        /// tab) are distinct messages on every database (MySQL's
        /// `utf8mb4_bin` columns padded spaces: `'m1' = 'm1 '`).
        #[tokio::test]
        async fn ids_differing_by_trailing_spaces_are_distinct() {
            let (inbox, credits, table) = setup().await;
            commit_new(inbox.claim("c", "m1").await.unwrap()).await;
            for other in ["m1 ", "m1  ", "m1\t", " m1"] {
                assert!(
                    matches!(inbox.claim("c", other).await.unwrap(), Claim::New(_)),
                    "{other:?} is another message than \"m1\""
                );
                assert!(!inbox.is_processed("c", other).await.unwrap(), "{other:?}");
            }
            commit_new(inbox.claim("c", "m1 ").await.unwrap()).await;
            commit_new(inbox.claim("c ", "m1").await.unwrap()).await;
            assert!(matches!(
                inbox.claim("c", "m1 ").await.unwrap(),
                Claim::Duplicate
            ));
            assert!(matches!(
                inbox.claim("c", "m1").await.unwrap(),
                Claim::Duplicate
            ));
            cleanup(&inbox, &[&credits, &table]).await;
        }

        /// Issue 16 item 7: an age too long to mean anything (up to
        /// `Duration::MAX`) purges nothing and is no error, on every
        /// database (PostgreSQL's interval overflowed).
        #[tokio::test]
        async fn purge_of_an_extreme_age_saturates_to_nothing() {
            let (inbox, credits, table) = setup().await;
            commit_new(inbox.claim("c", "kept").await.unwrap()).await;
            for age in [
                idem_sql::inbox::MAX_PURGE_AGE,
                Duration::from_secs(u64::MAX),
                Duration::MAX,
                Duration::from_secs(i64::MAX as u64 / 1000),
            ] {
                assert_eq!(
                    inbox.purge_older_than(age).await.expect("no error"),
                    0,
                    "{age:?}"
                );
            }
            assert!(inbox.is_processed("c", "kept").await.unwrap());
            cleanup(&inbox, &[&credits, &table]).await;
        }

        #[tokio::test]
        async fn bad_input_is_typed() {
            let (inbox, credits, table) = setup().await;
            assert!(matches!(
                inbox.claim("", "m").await,
                Err(InboxError::InvalidId {
                    what: "consumer",
                    len: 0
                })
            ));
            assert!(matches!(
                inbox.claim("c", &"x".repeat(256)).await,
                Err(InboxError::InvalidId {
                    what: "message id",
                    len: 256
                })
            ));
            let bad = Inbox::with_options(
                inbox.pool().clone(),
                InboxOptions::default().with_table("x; DROP TABLE y"),
            );
            assert!(matches!(bad, Err(InboxError::InvalidTable(_))));
            // migrate is idempotent
            inbox.migrate().await.unwrap();
            cleanup(&inbox, &[&credits, &table]).await;
        }
    };
}

mod sqlite {
    /// A file (not :memory:) so concurrent transactions really contend.
    async fn pool() -> sqlx::SqlitePool {
        let dir = Box::leak(Box::new(tempfile::tempdir().expect("tempdir")));
        servers::sqlite_file_pool(&dir.path().join("inbox.db"), 4, Duration::from_secs(10)).await
    }

    scenarios!(
        sqlx::Sqlite,
        pool(),
        "CREATE TABLE {} (payment_id TEXT NOT NULL, cents INTEGER NOT NULL)",
        "INSERT INTO {} (payment_id, cents) VALUES (?1, ?2)",
        "DROP TABLE {}"
    );

    /// H1 on SQLite: the duplicate is the extended code 1555
    /// (SQLITE_CONSTRAINT_PRIMARYKEY), which `claim` maps to `Duplicate`.
    #[tokio::test]
    async fn h1_sqlite_duplicate_code_is_1555() {
        let err = duplicate_error(
            pool().await,
            "INSERT INTO {0} (consumer, message_id, processed_at) VALUES ('c', 'm', 0)",
        )
        .await;
        assert_eq!(code(&err).as_deref(), Some("1555"));
    }
}

#[cfg(feature = "postgres")]
mod postgres {
    async fn pool(lc_messages: Option<&'static str>) -> sqlx::PgPool {
        servers::pool_with(servers::pool_options::<sqlx::Postgres>(8).after_connect(
            move |conn, _| {
                Box::pin(async move {
                    if let Some(lc) = lc_messages {
                        sqlx::query(&format!("SET lc_messages = '{lc}'"))
                            .execute(&mut *conn)
                            .await?;
                    }
                    Ok(())
                })
            },
        ))
        .await
    }

    scenarios!(
        sqlx::Postgres,
        pool(None),
        "CREATE TABLE {} (payment_id TEXT NOT NULL, cents BIGINT NOT NULL)",
        "INSERT INTO {} (payment_id, cents) VALUES ($1, $2)",
        "DROP TABLE {}"
    );

    /// H1: the duplicate is recognised by SQLSTATE 23505, not by text. Where
    /// the OS has a German or French locale, every connection runs with that
    /// `lc_messages` (localised server messages); otherwise the check runs
    /// with the server's default and says so (the code path is the same:
    /// `InboxDatabase::is_duplicate` reads only the SQLSTATE).
    #[tokio::test]
    async fn h1_duplicate_by_sqlstate_under_localised_messages() {
        let probe = pool(None).await;
        let mut chosen = None;
        for lc in ["de_DE.UTF-8", "de_DE.utf8", "fr_FR.UTF-8", "fr_FR.utf8"] {
            if sqlx::query(&format!("SET lc_messages = '{lc}'"))
                .execute(&probe)
                .await
                .is_ok()
            {
                chosen = Some(lc);
                break;
            }
        }
        if chosen.is_none() {
            eprintln!("no German/French OS locale: lc_messages stays at the server default");
        }
        let err = duplicate_error(
            pool(chosen).await,
            "INSERT INTO {0} (consumer, message_id) VALUES ('c', 'm')",
        )
        .await;
        assert_eq!(code(&err).as_deref(), Some("23505"), "{err}");
    }

    /// `schema.table` names work.
    #[tokio::test]
    async fn schema_qualified_table() {
        let pool = pool(None).await;
        let schema = format!("inbox_s_{}", suffix());
        sqlx::query(&format!("CREATE SCHEMA {schema}"))
            .execute(&pool)
            .await
            .unwrap();
        let inbox = Inbox::with_options(
            pool.clone(),
            InboxOptions::default().with_table(format!("{schema}.inbox")),
        )
        .unwrap();
        inbox.migrate().await.unwrap();
        commit_new(inbox.claim("c", "m").await.unwrap()).await;
        assert!(matches!(
            inbox.claim("c", "m").await.unwrap(),
            Claim::Duplicate
        ));
        sqlx::query(&format!("DROP SCHEMA {schema} CASCADE"))
            .execute(&pool)
            .await
            .unwrap();
    }
}

#[cfg(feature = "mysql")]
mod mysql {
    scenarios!(
        sqlx::MySql,
        servers::my_pool(8),
        "CREATE TABLE {} (payment_id VARCHAR(64) NOT NULL, cents BIGINT NOT NULL) ENGINE=InnoDB",
        "INSERT INTO {} (payment_id, cents) VALUES (?, ?)",
        "DROP TABLE {}"
    );

    /// A table made by the first inbox (`VARCHAR(255)` columns,
    /// `utf8mb4_bin`) is upgraded by `migrate` to binary ids: its rows are
    /// kept, and an id that differs by a trailing space is a new message.
    #[tokio::test]
    async fn migrate_upgrades_a_varchar_table_to_binary_ids() {
        let pool = servers::my_pool(4).await;
        let table = format!("inbox_old_{}", suffix());
        sqlx::raw_sql(&format!(
            "CREATE TABLE {table} (consumer VARCHAR(255) NOT NULL, \
             message_id VARCHAR(255) NOT NULL, processed_at DATETIME(3) NOT NULL, \
             PRIMARY KEY (consumer, message_id), KEY {table}_processed_at (processed_at)) \
             ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin"
        ))
        .execute(&pool)
        .await
        .unwrap();
        sqlx::query(&format!(
            "INSERT INTO {table} VALUES ('c', 'm1', UTC_TIMESTAMP(3))"
        ))
        .execute(&pool)
        .await
        .unwrap();
        let inbox = Inbox::with_options(
            pool.clone(),
            InboxOptions::default().with_table(table.clone()),
        )
        .unwrap();
        inbox.migrate().await.unwrap();
        inbox.migrate().await.unwrap(); // idempotent
        let types: Vec<String> = sqlx::query_scalar(
            "SELECT CAST(DATA_TYPE AS CHAR) FROM information_schema.COLUMNS \
             WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = ? \
             AND COLUMN_NAME IN ('consumer', 'message_id')",
        )
        .bind(&table)
        .fetch_all(&pool)
        .await
        .unwrap();
        assert_eq!(types, ["varbinary", "varbinary"]);
        assert!(inbox.is_processed("c", "m1").await.unwrap(), "row kept");
        assert!(matches!(
            inbox.claim("c", "m1").await.unwrap(),
            Claim::Duplicate
        ));
        assert!(matches!(
            inbox.claim("c", "m1 ").await.unwrap(),
            Claim::New(_)
        ));
        sqlx::query(&format!("DROP TABLE {table}"))
            .execute(&pool)
            .await
            .unwrap();
    }

    /// H1 on MySQL/MariaDB: error number 1062.
    #[tokio::test]
    async fn h1_duplicate_by_errno_1062() {
        let err = duplicate_error(
            servers::my_pool(8).await,
            "INSERT INTO {0} (consumer, message_id, processed_at) VALUES ('c', 'm', UTC_TIMESTAMP(3))",
        )
        .await;
        let errno = err
            .as_database_error()
            .and_then(|e| e.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>())
            .map(|e| e.number());
        assert_eq!(errno, Some(1062));
    }
}
