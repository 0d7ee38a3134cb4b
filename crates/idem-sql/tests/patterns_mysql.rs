//! `idem_sql::patterns` on MySQL / MariaDB. Server: `IDEM_TEST_MYSQL_URL`
//! (default `mysql://root@127.0.0.1:3306/test`). Every connection runs at
//! REPEATABLE READ (InnoDB's default, set explicitly); tables are named
//! `database.pat_<run>_…` and dropped at the end.

mod patterns_common;

use async_trait::async_trait;
use idem_sql::patterns::{InsertOrGet, StateMachine, Transition};
use patterns_common::{self as pc, Backend};
use sqlx::mysql::{MySqlPool, MySqlPoolOptions};
use sqlx::{Connection, Executor};

const START: &str = "start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd";

fn url() -> String {
    std::env::var("IDEM_TEST_MYSQL_URL")
        .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into())
}

struct My {
    pool: MySqlPool,
    db: String,
    tag: String,
}

#[async_trait]
impl Backend for My {
    type Db = sqlx::MySql;
    type Conn = sqlx::MySqlConnection;
    fn pool(&self) -> &MySqlPool {
        &self.pool
    }
    fn auto_id(&self) -> &'static str {
        "BIGINT AUTO_INCREMENT PRIMARY KEY"
    }
    fn table_opts(&self) -> &'static str {
        " ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin"
    }
    fn prefix(&self) -> String {
        format!("{}.", self.db)
    }
    fn tag(&self) -> String {
        self.tag.clone()
    }
    async fn exec(&self, sql: &str) {
        sqlx::raw_sql(sql).execute(&self.pool).await.expect(sql);
    }
    async fn text(&self, sql: &str) -> Option<String> {
        // Text columns with a `_bin` collation come back as binary.
        sqlx::query_scalar::<_, Option<Vec<u8>>>(sql)
            .fetch_optional(&self.pool)
            .await
            .expect(sql)
            .flatten()
            .map(|b| String::from_utf8(b).expect("utf-8"))
    }
    async fn int(&self, sql: &str) -> i64 {
        sqlx::query_scalar::<_, i64>(sql)
            .fetch_one(&self.pool)
            .await
            .expect(sql)
    }
}

impl My {
    async fn done(self) {
        let tables: Vec<String> = sqlx::query_scalar(
            "SELECT CAST(table_name AS CHAR) FROM information_schema.tables \
             WHERE table_schema = DATABASE() AND table_name LIKE ?",
        )
        .bind(format!("pat\\_{}%", self.tag.replace('_', "\\_")))
        .fetch_all(&self.pool)
        .await
        .expect("list tables");
        for t in tables {
            self.exec(&format!("DROP TABLE `{t}`")).await;
        }
        self.pool.close().await;
    }
}

async fn my() -> My {
    let url = url();
    let pool = MySqlPoolOptions::new()
        .max_connections(20)
        .acquire_timeout(std::time::Duration::from_secs(10))
        .after_connect(|conn, _| {
            Box::pin(async move {
                conn.execute("SET SESSION TRANSACTION ISOLATION LEVEL REPEATABLE READ")
                    .await?;
                Ok(())
            })
        })
        .connect(&url)
        .await
        .unwrap_or_else(|e| pc::connect_failed("MySQL/MariaDB", &url, &e, START));
    let db: String = sqlx::query_scalar("SELECT CAST(DATABASE() AS CHAR)")
        .fetch_one(&pool)
        .await
        .expect("database");
    let tag = format!("{}_", idem_testkit::support::random_hex(6));
    My { pool, db, tag }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn i2_concurrent_transitions_one_winner() {
    let b = my().await;
    pc::i2_race(&b).await;
    b.done().await;
}

#[tokio::test]
async fn transition_answers() {
    let b = my().await;
    pc::transition_answers(&b).await;
    b.done().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn versioned_updates() {
    let b = my().await;
    pc::versioned(&b).await;
    b.done().await;
}

#[tokio::test]
async fn insert_or_get_basics() {
    let b = my().await;
    pc::insert_or_get_basics(&b).await;
    b.done().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn insert_or_get_16_connections() {
    let b = my().await;
    pc::insert_or_get_race(&b, |_, _| async { None }).await;
    b.done().await;
}

/// 16 REPEATABLE READ transactions, each with its snapshot taken (a plain
/// read of the table) before the race: the losers' plain reads could not
/// see the winner's row; the locking read does.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn insert_or_get_16_repeatable_read_transactions() {
    let b = my().await;
    pc::insert_or_get_race(&b, |pool, t| async move {
        let mut tx = pool.begin().await.expect("begin");
        let _: i64 = sqlx::query_scalar(&format!("SELECT COUNT(*) FROM {t}"))
            .fetch_one(&mut *tx)
            .await
            .expect("snapshot");
        Some(tx)
    })
    .await;
    b.done().await;
}

#[tokio::test]
async fn bad_set_columns() {
    let b = my().await;
    pc::bad_set_columns(&b).await;
    b.done().await;
}

/// REPEATABLE READ transaction with a stale snapshot: a plain SELECT still
/// says `pending`, but the transition answers `Conflict(completed)` (the
/// latest committed state, by the locking re-read).
#[tokio::test]
async fn repeatable_read_stale_snapshot_conflict_latest() {
    let b = my().await;
    let t = pc::state_table(&b, 1).await;
    let sm = StateMachine::new(&t, "id", "state").unwrap();
    let mut c = b.pool.acquire().await.unwrap();
    let mut tx = c.begin().await.unwrap();
    let read = format!("SELECT CAST(state AS CHAR) FROM {t} WHERE id = 0");
    let seen: String = sqlx::query_scalar(&read).fetch_one(&mut *tx).await.unwrap();
    assert_eq!(seen, "pending");
    let mut other = b.pool.acquire().await.unwrap();
    assert_eq!(
        sm.transition(&mut *other, 0, &["pending"], "completed")
            .await
            .unwrap(),
        Transition::Transitioned
    );
    let still: String = sqlx::query_scalar(&read).fetch_one(&mut *tx).await.unwrap();
    assert_eq!(still, "pending", "the snapshot is stale (REPEATABLE READ)");
    assert_eq!(
        sm.transition(&mut *tx, 0, &["pending"], "cancelled")
            .await
            .unwrap(),
        Transition::Conflict("completed".into())
    );
    // AlreadyIn from the latest state too.
    assert_eq!(
        sm.transition(&mut *tx, 0, &["pending"], "completed")
            .await
            .unwrap(),
        Transition::AlreadyIn("completed".into())
    );
    tx.commit().await.unwrap();
    drop((c, other));
    b.done().await;
}

/// A duplicate inside a REPEATABLE READ transaction whose snapshot predates
/// the other row: the id is found (locking read), and the transaction goes
/// on (a 1062 rolls back only the statement).
#[tokio::test]
async fn insert_or_get_repeatable_read_invisible_row() {
    let b = my().await;
    let t = pc::keyed_table(&b).await;
    let iog = InsertOrGet::new(&t, "id", "biz_key").unwrap();
    let mut c = b.pool.acquire().await.unwrap();
    let mut tx = c.begin().await.unwrap();
    let n: i64 = sqlx::query_scalar(&format!("SELECT COUNT(*) FROM {t}"))
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    assert_eq!(n, 0);
    let mut other = b.pool.acquire().await.unwrap();
    let first = iog.insert_or_get(&mut *other, "k", &[]).await.unwrap();
    assert!(first.inserted);
    let again = iog.insert_or_get(&mut *tx, "k", &[]).await.unwrap();
    assert_eq!((&again.id, again.inserted), (&first.id, false));
    let more = iog.insert_or_get(&mut *tx, "k2", &[]).await.unwrap();
    assert!(more.inserted);
    tx.commit().await.unwrap();
    assert_eq!(b.int(&format!("SELECT COUNT(*) FROM {t}")).await, 2);
    drop((c, other));
    b.done().await;
}

/// Waiters behind a transaction that inserts the key and rolls back.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn insert_or_get_after_holder_rolls_back() {
    let b = my().await;
    pc::insert_or_get_after_rollback(&b).await;
    b.done().await;
}
