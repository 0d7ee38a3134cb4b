//! `idem_sql::patterns` on MySQL / MariaDB. Server: `IDEM_TEST_MYSQL_URL`
//! (default `mysql://root@127.0.0.1:3306/test`). Every connection runs at
//! REPEATABLE READ (InnoDB's default, set explicitly); tables are named
//! `database.pat_<run>_…` and dropped at the end.

mod patterns_common;

use idem_sql::patterns::{InsertOrGet, PatternError, SqlValue, StateMachine, Transition};
use patterns_common::{self as pc, servers, Backend};
use sqlx::{Connection, Executor};

type My = pc::Db<sqlx::MySql>;

/// Drops this run's tables (`pat_<tag>…`).
async fn done(b: My) {
    let tables: Vec<String> = sqlx::query_scalar(
        "SELECT CAST(table_name AS CHAR) FROM information_schema.tables \
         WHERE table_schema = DATABASE() AND table_name LIKE ?",
    )
    .bind(format!("pat\\_{}%", b.tag.replace('_', "\\_")))
    .fetch_all(&b.pool)
    .await
    .expect("list tables");
    for t in tables {
        b.exec(&format!("DROP TABLE `{t}`")).await;
    }
    b.pool.close().await;
}

async fn my() -> My {
    let pool = servers::pool_with(servers::pool_options::<sqlx::MySql>(20).after_connect(
        |conn, _| {
            Box::pin(async move {
                conn.execute("SET SESSION TRANSACTION ISOLATION LEVEL REPEATABLE READ")
                    .await?;
                Ok(())
            })
        },
    ))
    .await;
    let db: String = sqlx::query_scalar("SELECT CAST(DATABASE() AS CHAR)")
        .fetch_one(&pool)
        .await
        .expect("database");
    let tag = format!("{}_", idem_testkit::support::random_hex(6));
    My {
        table_opts: " ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin",
        namespace: db,
        tag,
        // Text columns with a `_bin` collation come back as binary.
        text_as_bytes: true,
        ..My::new(pool, "BIGINT AUTO_INCREMENT PRIMARY KEY")
    }
}

/// A database (see [`my`]) with the tables `ddl` makes, `{p}` in it
/// standing for this run's table-name prefix; with that prefix.
async fn my_with_tables(ddl: &str) -> (My, String) {
    let b = my().await;
    let p = format!("{}pat_{}", b.prefix(), b.tag);
    b.exec(&ddl.replace("{p}", &p)).await;
    (b, p)
}

pc::pattern_checks!(
    server: my(),
    done,
    transactions:
    /// 16 REPEATABLE READ transactions, each with its snapshot taken (a plain
    /// read of the table) before the race: the losers' plain reads could not
    /// see the winner's row; the locking read does.
    insert_or_get_16_repeatable_read_transactions = |pool, t| async move {
        let mut tx = pool.begin().await.expect("begin");
        let _: i64 = pc::scalar_in(&mut *tx, &format!("SELECT COUNT(*) FROM {t}")).await;
        Some(tx)
    }
);

/// REPEATABLE READ transaction with a stale snapshot: a plain SELECT still
/// says `pending`, but the transition answers `Conflict(completed)` (the
/// latest committed state, by the locking re-read).
#[tokio::test]
async fn repeatable_read_stale_snapshot_conflict_latest() {
    let b = my().await;
    let (t, sm) = pc::state_machine(&b, 1).await;
    let mut c = b.pool.acquire().await.unwrap();
    let mut tx = c.begin().await.unwrap();
    let read = format!("SELECT CAST(state AS CHAR) FROM {t} WHERE id = 0");
    let seen: String = pc::scalar_in(&mut *tx, &read).await;
    assert_eq!(seen, "pending");
    pc::complete_elsewhere(&b, &sm, 0).await;
    let still: String = pc::scalar_in(&mut *tx, &read).await;
    assert_eq!(still, "pending", "the snapshot is stale (REPEATABLE READ)");
    pc::expect_cancel_conflicts(&sm, &mut *tx).await;
    // AlreadyIn from the latest state too.
    assert_eq!(
        sm.transition(&mut *tx, 0, &["pending"], "completed")
            .await
            .unwrap(),
        Transition::AlreadyIn("completed".into())
    );
    tx.commit().await.unwrap();
    drop(c);
    done(b).await;
}

/// A duplicate inside a REPEATABLE READ transaction whose snapshot predates
/// the other row: the id is found (locking read), and the transaction goes
/// on (a 1062 rolls back only the statement).
#[tokio::test]
async fn insert_or_get_repeatable_read_invisible_row() {
    let b = my().await;
    let (t, iog) = pc::keyed_insert_or_get(&b).await;
    let mut c = b.pool.acquire().await.unwrap();
    let mut tx = c.begin().await.unwrap();
    let n: i64 = pc::scalar_in(&mut *tx, &format!("SELECT COUNT(*) FROM {t}")).await;
    assert_eq!(n, 0);
    let first = pc::insert_elsewhere(&b, &iog, "k").await;
    pc::duplicate_then_go_on(&b, &t, &iog, tx, &first).await;
    drop(c);
    done(b).await;
}

/// Regression: on MySQL a plain `INSERT` into a key column without a
/// UNIQUE index never raises 1062: two calls both inserted, and the second
/// got the first row's id (read back by key). The key column is now checked
/// once in `information_schema.STATISTICS`: a typed error, nothing inserted.
/// A unique index over (key, other) is not enough; the primary key is.
#[tokio::test]
async fn insert_or_get_needs_a_unique_key_column() {
    let (b, p) = my_with_tables(
        "CREATE TABLE {p}plain (id BIGINT AUTO_INCREMENT PRIMARY KEY, k VARCHAR(20) NOT NULL); \
         CREATE TABLE {p}pair (id BIGINT AUTO_INCREMENT PRIMARY KEY, k VARCHAR(20) NOT NULL, \
           o INT NOT NULL DEFAULT 0, UNIQUE KEY k_o (k, o)); \
         CREATE TABLE {p}pk (k VARCHAR(20) PRIMARY KEY, n INT)",
    )
    .await;
    let mut c = b.pool.acquire().await.unwrap();
    for t in ["plain", "pair"] {
        let ins = InsertOrGet::new(&format!("{p}{t}"), "id", "k").unwrap();
        for _ in 0..2 {
            let r = ins.insert_or_get(&mut *c, "x", &[]).await;
            assert!(
                matches!(&r, Err(PatternError::KeyNotUnique { column, .. }) if column == "k"),
                "{t}: {r:?}"
            );
        }
        assert_eq!(b.int(&format!("SELECT COUNT(*) FROM {p}{t}")).await, 0);
    }
    // The key is the primary key: fine, and the id is the key itself.
    let ins = InsertOrGet::new(&format!("{p}pk"), "k", "k").unwrap();
    let a = ins.insert_or_get(&mut *c, "x", &[]).await.unwrap();
    let again = ins.insert_or_get(&mut *c, "x", &[]).await.unwrap();
    assert!(a.inserted && !again.inserted);
    assert_eq!(a.id, again.id);
    // A table that does not exist is the database's error, not ours.
    let missing = InsertOrGet::new(&format!("{p}missing"), "id", "k").unwrap();
    let r = missing.insert_or_get(&mut *c, "x", &[]).await;
    assert!(matches!(r, Err(PatternError::Database { .. })), "{r:?}");
    drop(c);
    done(b).await;
}

/// After an insert the id is the inserted row's own: `LAST_INSERT_ID()` for
/// an AUTO_INCREMENT id (not a read by key), the given id otherwise.
#[tokio::test]
async fn insert_or_get_returns_the_inserted_rows_id() {
    let (b, p) = my_with_tables(
        "CREATE TABLE {p}auto (id BIGINT AUTO_INCREMENT PRIMARY KEY, k VARCHAR(20) NOT NULL UNIQUE) \
           AUTO_INCREMENT = 1000; \
         CREATE TABLE {p}given (id VARCHAR(20) PRIMARY KEY, k VARCHAR(20) NOT NULL UNIQUE)",
    )
    .await;
    let mut c = b.pool.acquire().await.unwrap();
    let auto = InsertOrGet::new(&format!("{p}auto"), "id", "k").unwrap();
    let a = auto.insert_or_get(&mut *c, "x", &[]).await.unwrap();
    let y = auto.insert_or_get(&mut *c, "y", &[]).await.unwrap();
    let a2 = auto.insert_or_get(&mut *c, "x", &[]).await.unwrap();
    assert_eq!((a.id.clone(), a.inserted), (SqlValue::I64(1000), true));
    assert_eq!((y.id, y.inserted), (SqlValue::I64(1001), true));
    assert_eq!((a2.id, a2.inserted), (a.id, false));
    let given = InsertOrGet::new(&format!("{p}given"), "id", "k").unwrap();
    let g = given
        .insert_or_get(&mut *c, "x", &[("id", "g-1".into())])
        .await
        .unwrap();
    let g2 = given
        .insert_or_get(&mut *c, "x", &[("id", "g-2".into())])
        .await
        .unwrap();
    assert_eq!((g.id, g.inserted), (SqlValue::Text("g-1".into()), true));
    assert_eq!((g2.id, g2.inserted), (SqlValue::Text("g-1".into()), false));
    drop(c);
    done(b).await;
}

/// MySQL sends each call's parameter types with `COM_STMT_EXECUTE`, so a
/// cached statement run with a `Text` id after an `I64` one compares the
/// text as text (converted to a number by MySQL's rules), never as the
/// first call's type: row 3544952156018063160 (the bytes of "12345678" as
/// a big-endian i64) is untouched.
#[tokio::test]
async fn another_value_type_on_the_same_connection_is_sent_as_itself() {
    let b = my().await;
    let t = format!("{}pat_{}types", b.prefix(), b.tag);
    let victim = i64::from_be_bytes(*b"12345678");
    b.exec(&format!(
        "CREATE TABLE {t} (id BIGINT PRIMARY KEY, state VARCHAR(20) NOT NULL, n BIGINT NOT NULL DEFAULT 0); \
         INSERT INTO {t} (id, state) VALUES (1, 'a'), (2, 'a'), ({victim}, 'a')"
    ))
    .await;
    let m = StateMachine::new(&t, "id", "state").unwrap();
    let mut c = b.pool.acquire().await.unwrap();
    pc::text_id_after_int_id(&m, &mut *c).await;
    m.transition_setting(&mut *c, 1, &["b"], "c", &[("n", 5.into())])
        .await
        .unwrap();
    m.transition_setting(&mut *c, 2, &["a"], "c", &[("n", "12345678".into())])
        .await
        .unwrap();
    drop(c);
    assert_eq!(
        b.text(&format!("SELECT state FROM {t} WHERE id = {victim}"))
            .await
            .as_deref(),
        Some("a")
    );
    assert_eq!(
        b.int(&format!("SELECT n FROM {t} WHERE id = 2")).await,
        12_345_678
    );
    done(b).await;
}
