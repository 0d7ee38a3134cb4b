//! Adversarial probes of the lock and the SQL patterns that passed when
//! they were written (huge `from` lists, aborted transactions, odd values,
//! advisory-lock sessions, lease hammering, look-alike names). The probes
//! that found defects are now regression tests next to the code they
//! cover: `patterns_postgres.rs` / `patterns_mysql.rs` / `patterns_sqlite.rs`
//! (parameter types on a reused connection, MySQL key without UNIQUE,
//! uuid ids) and `idem-testkit/tests/lock_memory_tests.rs` (`Duration::MAX`
//! waits, cancelled releases).

#![cfg(all(feature = "postgres", feature = "mysql"))]

use std::time::Duration;

use idem_core::lock::{Acquire, Lock};
use idem_sql::patterns::{InsertOrGet, PatternError, SqlValue, StateMachine, Transition};
use idem_sql::{LeaseLockBackend, PgAdvisoryLockBackend};
use idem_testkit::support::random_hex;
use servers::{my_pool, pg_pool};
use sqlx::Connection;

mod servers;

/// Runs `sql` (one or more statements), which must succeed.
async fn exec<'e, E: sqlx::Executor<'e>>(e: E, sql: &'e str) {
    sqlx::raw_sql(sql)
        .execute(e)
        .await
        .unwrap_or_else(|err| panic!("{sql}: {err}"));
}

async fn pg() -> (sqlx::PgPool, String) {
    let pool = pg_pool(4).await;
    let schema = format!("adv_{}", random_hex(8));
    exec(&pool, &format!("CREATE SCHEMA {schema}")).await;
    (pool, schema)
}

/// A fresh schema (see [`pg`]) with the table `{t}` (`<schema>.t`) that
/// `sql` makes and fills, and a state machine on its `id` and `state`.
async fn pg_state_table(sql: &str) -> (sqlx::PgPool, String, StateMachine) {
    let (pool, s) = pg().await;
    let t = format!("{s}.t");
    exec(&pool, &sql.replace("{t}", &t)).await;
    let m = StateMachine::new(&t, "id", "state").unwrap();
    (pool, s, m)
}

#[tokio::test]
async fn pg_huge_from_list_is_a_typed_error() {
    let (pool, s, m) = pg_state_table(
        "CREATE TABLE {t} (id BIGINT PRIMARY KEY, state TEXT); INSERT INTO {t} VALUES (1, 'a')",
    )
    .await;
    let from: Vec<String> = (0..70_000).map(|i| format!("s{i}")).collect();
    let from: Vec<&str> = from.iter().map(String::as_str).collect();
    let mut c = pool.acquire().await.unwrap();
    let r = m.transition(&mut *c, 1, &from, "b").await;
    eprintln!("pg 70000 from: {r:?}");
    drop(c);
    let t = m
        .transition(&mut *pool.acquire().await.unwrap(), 1, &["a"], "b")
        .await;
    eprintln!("after: {t:?}");
    exec(&pool, &format!("DROP SCHEMA {s} CASCADE")).await;
    assert!(r.is_err());
    assert_eq!(t.unwrap(), Transition::Transitioned);
}

#[tokio::test]
async fn sqlite_huge_from_list_is_a_typed_error() {
    let mut c = sqlx::SqliteConnection::connect("sqlite::memory:")
        .await
        .unwrap();
    exec(
        &mut c,
        "CREATE TABLE t (id INTEGER PRIMARY KEY, state TEXT); INSERT INTO t VALUES (1,'a')",
    )
    .await;
    let m = StateMachine::new("t", "id", "state").unwrap();
    let from: Vec<String> = (0..40_000).map(|i| format!("s{i}")).collect();
    let from: Vec<&str> = from.iter().map(String::as_str).collect();
    let r = m.transition(&mut c, 1, &from, "b").await;
    eprintln!("sqlite 40000 from: {r:?}");
    assert!(r.is_err());
}

#[tokio::test]
async fn mysql_huge_from_list_is_a_typed_error() {
    let pool = my_pool(2).await;
    let t = format!("adv_{}", random_hex(8));
    let create = format!(
        "CREATE TABLE {t} (id BIGINT PRIMARY KEY, state VARCHAR(20)); INSERT INTO {t} VALUES (1, 'a')"
    );
    exec(&pool, &create).await;
    let m = StateMachine::new(&t, "id", "state").unwrap();
    let from: Vec<String> = (0..70_000).map(|i| format!("s{i}")).collect();
    let from: Vec<&str> = from.iter().map(String::as_str).collect();
    let r = m
        .transition(&mut *pool.acquire().await.unwrap(), 1, &from, "b")
        .await;
    eprintln!("mysql 70000 from: {r:?}");
    // collation: case / trailing spaces
    let r2 = m
        .transition(&mut *pool.acquire().await.unwrap(), 1, &["A "], "b")
        .await;
    eprintln!("mysql from 'A ' on row 'a': {r2:?}");
    let r3 = m
        .transition(&mut *pool.acquire().await.unwrap(), 1, &["zzz"], "B")
        .await;
    eprintln!("mysql to 'B' on row 'b': {r3:?}");
    exec(&pool, &format!("DROP TABLE {t}")).await;
    assert!(r.is_err());
}

#[tokio::test]
async fn pg_aborted_transaction() {
    let (pool, s, m) = pg_state_table(
        "CREATE TABLE {t} (id BIGINT PRIMARY KEY, k TEXT UNIQUE, state TEXT); INSERT INTO {t} VALUES (1, 'k1', 'a')",
    )
    .await;
    let ins = InsertOrGet::new(&format!("{s}.t"), "id", "k").unwrap();
    let mut c = pool.acquire().await.unwrap();
    let mut tx = c.begin().await.unwrap();
    let _ = sqlx::query("SELECT 1/0").execute(&mut *tx).await;
    let r = m.transition(&mut *tx, 1, &["a"], "b").await;
    eprintln!("transition in aborted tx: {r:?}");
    let r2 = ins.insert_or_get(&mut *tx, "k2", &[("id", 2.into())]).await;
    eprintln!("insert_or_get in aborted tx: {r2:?}");
    drop(tx);
    // duplicate on another unique key inside a tx
    let mut tx = c.begin().await.unwrap();
    let r3 = ins.insert_or_get(&mut *tx, "k9", &[("id", 1.into())]).await;
    eprintln!("insert_or_get dup PK in tx: {r3:?}");
    drop(tx);
    drop(c);
    exec(&pool, &format!("DROP SCHEMA {s} CASCADE")).await;
    assert!(matches!(r, Err(PatternError::Database { .. })));
    assert!(r2.is_err());
    assert!(matches!(r3, Err(PatternError::UniqueViolation { .. })));
}

#[tokio::test]
async fn pg_odd_states_and_values() {
    let (pool, s, m) = pg_state_table(
        "CREATE TABLE {t} (id BIGINT PRIMARY KEY, state TEXT, n INT); INSERT INTO {t} VALUES (1, NULL, 0), (2, 'a', 0)",
    )
    .await;
    let mut c = pool.acquire().await.unwrap();
    let null_state = m.transition(&mut *c, 1, &["a"], "b").await;
    let nul_byte = m.transition(&mut *c, 2, &["a"], "b\0c").await;
    let bytes_into_int = m
        .transition_setting(&mut *c, 2, &["a"], "b", &[("n", SqlValue::Bytes(vec![1]))])
        .await;
    let quote = m
        .transition(&mut *c, 2, &["a"], "x'); DROP TABLE t; --")
        .await;
    let now = m.transition(&mut *c, 2, &["zz"], "q").await;
    drop(c);
    exec(&pool, &format!("DROP SCHEMA {s} CASCADE")).await;
    assert!(
        matches!(null_state, Err(PatternError::Decode { .. })),
        "{null_state:?}"
    );
    assert!(
        matches!(nul_byte, Err(PatternError::Database { .. })),
        "{nul_byte:?}"
    );
    assert!(
        matches!(bytes_into_int, Err(PatternError::Database { .. })),
        "{bytes_into_int:?}"
    );
    assert_eq!(quote.unwrap(), Transition::Transitioned);
    assert_eq!(
        now.unwrap(),
        Transition::Conflict("x'); DROP TABLE t; --".into())
    );
}

#[tokio::test]
async fn advisory_locks_hold_server_connections() {
    let pool = pg_pool(3).await;
    let table = format!("adv_f_{}", random_hex(8));
    let b = PgAdvisoryLockBackend::new(pool.clone())
        .with_table(&table)
        .unwrap();
    b.migrate().await.unwrap();
    let lock = Lock::new(b.clone());
    let count = || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend'",
        )
        .fetch_one(&pool)
        .await
        .unwrap()
    };
    let before = count().await;
    let mut guards = Vec::new();
    for i in 0..12 {
        match lock
            .try_acquire(&format!("n{i}"), Duration::from_secs(30))
            .await
            .unwrap()
        {
            Acquire::Held(g) => guards.push(g),
            Acquire::Busy { .. } => panic!("busy"),
        }
    }
    let during = count().await;
    // drop the futures of release mid-way
    for g in guards.drain(..6) {
        let f = g.release();
        let _ = tokio::time::timeout(Duration::from_micros(1), f).await;
    }
    drop(guards);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let after = count().await;
    eprintln!("client backends: before {before}, with 12 locks held on a pool of 3: {during}, after release {after}; held_sessions {}", b.held_sessions());
    exec(&pool, &format!("DROP TABLE {table}")).await;
    assert_eq!(b.held_sessions(), 0);
}

async fn hammer<B: idem_core::lock::LockBackend + Clone>(what: &str, b: B) {
    use std::sync::{Arc, Mutex};
    let fences = Arc::new(Mutex::new(Vec::new()));
    let errors = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    let name = format!("h-{}", random_hex(6));
    for _ in 0..8 {
        let (b, fences, errors, name) = (b.clone(), fences.clone(), errors.clone(), name.clone());
        tasks.push(tokio::spawn(async move {
            let lock = Lock::new(b);
            for _ in 0..40 {
                match lock.try_acquire(&name, Duration::from_millis(30)).await {
                    Ok(Acquire::Held(g)) => {
                        fences.lock().unwrap().push(g.fence());
                        tokio::time::sleep(Duration::from_millis(rand_ms(50))).await;
                        if rand_ms(2) == 0 {
                            drop(g);
                        } else if let Err(e) = g.release().await {
                            errors.lock().unwrap().push(e.to_string());
                        }
                    }
                    Ok(Acquire::Busy { retry_after }) => {
                        tokio::time::sleep(retry_after.min(Duration::from_millis(20))).await
                    }
                    Err(e) => errors.lock().unwrap().push(e.to_string()),
                }
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let mut f = fences.lock().unwrap().clone();
    let n = f.len();
    f.sort_unstable();
    f.dedup();
    let errors = errors.lock().unwrap().clone();
    eprintln!(
        "{what}: {n} grants, {} distinct fences, errors: {:?}",
        f.len(),
        &errors[..errors.len().min(3)]
    );
    assert_eq!(n, f.len(), "{what}: a fence was granted twice");
}

fn rand_ms(max: u64) -> u64 {
    u64::from_str_radix(&random_hex(4), 16).unwrap() % max
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn lease_hammer_all_dbs() {
    let t = format!("adv_lk_{}", random_hex(8));
    let dir = tempfile::tempdir().unwrap();
    let sqlite = sqlx::sqlite::SqlitePoolOptions::new()
        .max_connections(4)
        .connect_with(
            sqlx::sqlite::SqliteConnectOptions::new()
                .filename(dir.path().join("l.db"))
                .create_if_missing(true)
                .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal),
        )
        .await
        .unwrap();
    let b = LeaseLockBackend::sqlite(sqlite).with_table(&t).unwrap();
    b.migrate().await.unwrap();
    hammer("sqlite", b).await;
    let pgp = pg_pool(6).await;
    let b = LeaseLockBackend::postgres(pgp.clone())
        .with_table(&t)
        .unwrap();
    b.migrate().await.unwrap();
    hammer("postgres lease", b).await;
    let b = PgAdvisoryLockBackend::new(pgp.clone())
        .with_table(&t.replace("lk", "af"))
        .unwrap();
    b.migrate().await.unwrap();
    hammer("postgres advisory", b).await;
    exec(
        &pgp,
        &format!("DROP TABLE {t}; DROP TABLE {}", t.replace("lk", "af")),
    )
    .await;
    let myp = my_pool(6).await;
    let b = LeaseLockBackend::mysql(myp.clone()).with_table(&t).unwrap();
    b.migrate().await.unwrap();
    hammer("mariadb lease", b).await;
    exec(&myp, &format!("DROP TABLE {t}")).await;
}

#[tokio::test]
async fn odd_names_are_distinct_locks() {
    let t = format!("adv_nm_{}", random_hex(8));
    let myp = my_pool(3).await;
    let pgp = pg_pool(3).await;
    let sq = sqlx::sqlite::SqlitePoolOptions::new()
        .max_connections(1)
        .connect("sqlite::memory:")
        .await
        .unwrap();
    let backs = vec![
        (
            "mariadb",
            LeaseLockBackend::mysql(myp.clone()).with_table(&t).unwrap(),
        ),
        (
            "postgres",
            LeaseLockBackend::postgres(pgp.clone())
                .with_table(&t)
                .unwrap(),
        ),
        (
            "sqlite",
            LeaseLockBackend::sqlite(sq).with_table(&t).unwrap(),
        ),
    ];
    let long = "😀".repeat(63);
    let pairs = [
        ("a", "a "),
        ("a", "A"),
        ("ß", "ss"),
        ("e\u{301}", "é"),
        (long.as_str(), "😀"),
    ];
    let mut shared = Vec::new();
    for (what, b) in backs {
        b.migrate().await.unwrap();
        let lock = Lock::new(b);
        for (x, y) in pairs {
            let Acquire::Held(g) = lock.try_acquire(x, Duration::from_secs(5)).await.unwrap()
            else {
                panic!("{what} {x:?}")
            };
            let r = lock.try_acquire(y, Duration::from_secs(5)).await;
            if !matches!(r, Ok(Acquire::Held(_))) {
                shared.push(format!("{what}: {x:?} blocks {y:?}: {r:?}"));
            }
            drop(r);
            g.release().await.unwrap();
        }
    }
    exec(&myp, &format!("DROP TABLE {t}")).await;
    exec(&pgp, &format!("DROP TABLE {t}")).await;
    eprintln!("shared: {shared:#?}");
    assert!(shared.is_empty());
}
