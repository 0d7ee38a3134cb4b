//! Scenarios of `idem_sql::patterns` shared by the SQLite, PostgreSQL and
//! MySQL test files, each run against a real database.

#![allow(dead_code, unreachable_pub)]

use std::sync::Arc;

use async_trait::async_trait;
use idem_sql::patterns::{
    Created, InsertOrGet, PatternError, SqlConnection, SqlValue, StateMachine, Transition,
    Versioned, VersionedUpdate,
};
use tokio::sync::Barrier;

#[path = "../servers/mod.rs"]
pub mod servers;

/// One database under test: a pool and what its dialect needs in the
/// checks' DDL. Implemented once, by [`Db`], for every sqlx database.
#[async_trait]
pub trait Backend: Send + Sync + 'static {
    type Db: sqlx::Database<Connection = Self::Conn>;
    type Conn: SqlConnection + sqlx::Connection<Database = Self::Db>;
    fn pool(&self) -> &sqlx::Pool<Self::Db>;
    /// Column definition of an auto-generated integer primary key.
    fn auto_id(&self) -> &'static str;
    /// Appended to CREATE TABLE (MySQL: the utf8mb4 charset).
    fn table_opts(&self) -> &'static str;
    /// Where the tables go: "" or "schema.".
    fn prefix(&self) -> String;
    /// Put at the start of every table name of this run (for cleanup).
    fn tag(&self) -> String;
    async fn exec(&self, sql: &str);
    async fn text(&self, sql: &str) -> Option<String>;
    async fn int(&self, sql: &str) -> i64;
}

/// A database under test.
pub struct Db<DB: sqlx::Database> {
    pub pool: sqlx::Pool<DB>,
    /// Column definition of an auto-generated integer primary key.
    pub auto_id: &'static str,
    /// Appended to CREATE TABLE.
    pub table_opts: &'static str,
    /// The schema (PostgreSQL) or database (MySQL) the tables go in, or "".
    pub namespace: String,
    /// Put at the start of every table name of this run (for cleanup).
    pub tag: String,
    /// Text comes back as bytes (MySQL: columns with a `_bin` collation).
    pub text_as_bytes: bool,
    /// Kept alive as long as the database (a temporary folder).
    pub keep: Option<Box<dyn std::any::Any + Send + Sync>>,
}

impl<DB: sqlx::Database> Db<DB> {
    /// A database with plain DDL on `pool`.
    pub fn new(pool: sqlx::Pool<DB>, auto_id: &'static str) -> Self {
        Self {
            pool,
            auto_id,
            table_opts: "",
            namespace: String::new(),
            tag: String::new(),
            text_as_bytes: false,
            keep: None,
        }
    }
}

#[async_trait]
impl<DB> Backend for Db<DB>
where
    DB: sqlx::Database,
    DB::Connection: SqlConnection,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    for<'r> (i64,): sqlx::FromRow<'r, DB::Row>,
    for<'r> (Option<String>,): sqlx::FromRow<'r, DB::Row>,
    for<'r> (Option<Vec<u8>>,): sqlx::FromRow<'r, DB::Row>,
    for<'q> DB::Arguments<'q>: sqlx::IntoArguments<'q, DB>,
{
    type Db = DB;
    type Conn = DB::Connection;
    fn pool(&self) -> &sqlx::Pool<DB> {
        &self.pool
    }
    fn auto_id(&self) -> &'static str {
        self.auto_id
    }
    fn table_opts(&self) -> &'static str {
        self.table_opts
    }
    fn prefix(&self) -> String {
        if self.namespace.is_empty() {
            String::new()
        } else {
            format!("{}.", self.namespace)
        }
    }
    fn tag(&self) -> String {
        self.tag.clone()
    }
    async fn exec(&self, sql: &str) {
        sqlx::raw_sql(sql).execute(&self.pool).await.expect(sql);
    }
    async fn text(&self, sql: &str) -> Option<String> {
        if !self.text_as_bytes {
            return sqlx::query_scalar::<_, Option<String>>(sql)
                .fetch_optional(&self.pool)
                .await
                .expect(sql)
                .flatten();
        }
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

/// Writes, at the call site, the `#[tokio::test]`s every database runs:
/// `$open` is an async expression giving a [`Db`], `$done` an async
/// function that takes it back at the end (dropping its tables);
/// `transactions` names the 16-transactions race and gives its `begin`
/// (see [`insert_or_get_race`]).
macro_rules! pattern_checks {
    ($open:expr, $done:expr, transactions: $(#[$doc:meta])* $tx_name:ident = $begin:expr) => {
        $(#[$doc])*
        #[::tokio::test(flavor = "multi_thread", worker_threads = 4)]
        async fn $tx_name() {
            let b = $open.await;
            $crate::patterns_common::insert_or_get_race(&b, $begin).await;
            $done(b).await;
        }
        $crate::patterns_common::pattern_checks!($open, $done);
    };
    ($open:expr, $done:expr) => {
        $crate::patterns_common::pattern_checks!(@test i2_concurrent_transitions_one_winner,
            (flavor = "multi_thread", worker_threads = 4), $open, $done,
            |b| $crate::patterns_common::i2_race(&b));
        $crate::patterns_common::pattern_checks!(@test transition_answers, (), $open, $done,
            |b| $crate::patterns_common::transition_answers(&b));
        $crate::patterns_common::pattern_checks!(@test versioned_updates,
            (flavor = "multi_thread", worker_threads = 4), $open, $done,
            |b| $crate::patterns_common::versioned(&b));
        $crate::patterns_common::pattern_checks!(@test insert_or_get_basics, (), $open, $done,
            |b| $crate::patterns_common::insert_or_get_basics(&b));
        $crate::patterns_common::pattern_checks!(@test insert_or_get_16_connections,
            (flavor = "multi_thread", worker_threads = 4), $open, $done,
            |b| $crate::patterns_common::insert_or_get_race(&b, |_, _| async { None }));
        $crate::patterns_common::pattern_checks!(@test bad_set_columns, (), $open, $done,
            |b| $crate::patterns_common::bad_set_columns(&b));
    };
    // The servers' checks: the above, and waiters behind a transaction that
    // inserts the key and rolls back.
    (server: $open:expr, $done:expr, transactions: $(#[$doc:meta])* $tx_name:ident = $begin:expr) => {
        $crate::patterns_common::pattern_checks!($open, $done,
            transactions: $(#[$doc])* $tx_name = $begin);
        $crate::patterns_common::pattern_checks!(@test insert_or_get_after_holder_rolls_back,
            (flavor = "multi_thread", worker_threads = 4), $open, $done,
            |b| $crate::patterns_common::insert_or_get_after_rollback(&b));
    };
    (@test $name:ident, ($($flavor:tt)*), $open:expr, $done:expr, |$b:ident| $check:expr) => {
        #[::tokio::test($($flavor)*)]
        async fn $name() {
            let $b = $open.await;
            $check.await;
            $done($b).await;
        }
    };
}
pub(crate) use pattern_checks;

/// Closes a database's pool (the end of a check on SQLite).
pub async fn close<DB: sqlx::Database>(b: Db<DB>) {
    b.pool.close().await;
}

/// A fresh table name (with the backend's schema prefix).
pub fn table<B: Backend>(b: &B, what: &str) -> String {
    format!(
        "{}pat_{}{what}_{}",
        b.prefix(),
        b.tag(),
        idem_testkit::support::random_hex(10)
    )
}

/// A [`state_table`] of `rows` rows and the state machine on its `id` and
/// `state`.
pub async fn state_machine<B: Backend>(b: &B, rows: i64) -> (String, StateMachine) {
    let t = state_table(b, rows).await;
    let sm = StateMachine::new(&t, "id", "state").expect("names");
    (t, sm)
}

/// The one value `sql` reads on `conn` (in a transaction: as its snapshot
/// sees it; a read of the table takes the snapshot).
pub async fn scalar_in<C, O>(conn: &mut C, sql: &str) -> O
where
    C: sqlx::Connection,
    O: Send + Unpin,
    for<'c> &'c mut C: sqlx::Executor<'c, Database = C::Database>,
    for<'r> (O,): sqlx::FromRow<'r, <C::Database as sqlx::Database>::Row>,
    for<'q> <C::Database as sqlx::Database>::Arguments<'q>: sqlx::IntoArguments<'q, C::Database>,
{
    sqlx::query_scalar(sql).fetch_one(conn).await.expect(sql)
}

/// `id BIGINT PK, state, note, version`, rows 0..n in `pending`.
pub async fn state_table<B: Backend>(b: &B, rows: i64) -> String {
    let t = table(b, "sm");
    b.exec(&format!(
        "CREATE TABLE {t} (id BIGINT PRIMARY KEY, state VARCHAR(32) NOT NULL, \
         note VARCHAR(200), version BIGINT NOT NULL DEFAULT 1){}",
        b.table_opts()
    ))
    .await;
    for i in 0..rows {
        b.exec(&format!(
            "INSERT INTO {t} (id, state) VALUES ({i}, 'pending')"
        ))
        .await;
    }
    t
}

pub async fn state_of<B: Backend>(b: &B, t: &str, id: i64) -> Option<String> {
    b.text(&format!("SELECT state FROM {t} WHERE id = {id}"))
        .await
}

/// I2: `pending → completed` and `pending → cancelled` at the same time
/// from two connections, 20 rows: exactly one changes each row, the loser
/// gets `Conflict(winner's state)`.
pub async fn i2_race<B: Backend>(b: &B) {
    const ROUNDS: i64 = 20;
    let (t, sm) = state_machine(b, ROUNDS).await;
    let mut wins = [0usize; 2];
    for id in 0..ROUNDS {
        // Two connections, taken before the start line.
        let c1 = b.pool().acquire().await.expect("conn 1");
        let c2 = b.pool().acquire().await.expect("conn 2");
        let barrier = Arc::new(Barrier::new(2));
        let run = |mut c: sqlx::pool::PoolConnection<B::Db>, to: &'static str| {
            let (sm, barrier) = (sm.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                sm.transition_setting(&mut *c, id, &["pending"], to, &[("note", to.into())])
                    .await
            })
        };
        let a = run(c1, "completed");
        let b2 = run(c2, "cancelled");
        let a = a.await.expect("task").expect("transition");
        let bb = b2.await.expect("task").expect("transition");
        let now = state_of(b, &t, id).await.expect("row");
        match (&a, &bb) {
            (Transition::Transitioned, Transition::Conflict(s)) => {
                assert_eq!((s.as_str(), now.as_str()), ("completed", "completed"));
                wins[0] += 1;
            }
            (Transition::Conflict(s), Transition::Transitioned) => {
                assert_eq!((s.as_str(), now.as_str()), ("cancelled", "cancelled"));
                wins[1] += 1;
            }
            other => panic!("round {id}: exactly one winner expected, got {other:?}"),
        }
        // The winner's other column was written with it, the loser's not.
        let note = b
            .text(&format!("SELECT note FROM {t} WHERE id = {id}"))
            .await;
        assert_eq!(note.as_deref(), Some(now.as_str()));
    }
    assert_eq!(wins[0] + wins[1], ROUNDS as usize);
    eprintln!(
        "i2 race: completed won {}, cancelled won {}",
        wins[0], wins[1]
    );
}

/// Sequential answers: Transitioned, AlreadyIn, Conflict, NotFound; a
/// transition from several states; argument checks; rollback.
pub async fn transition_answers<B: Backend>(b: &B) {
    let (t, sm) = state_machine(b, 3).await;
    let mut c = b.pool().acquire().await.expect("conn");
    let c = &mut *c;
    assert_eq!(
        sm.transition(c, 0, &["pending"], "paid").await.unwrap(),
        Transition::Transitioned
    );
    assert_eq!(
        sm.transition(c, 0, &["pending"], "paid").await.unwrap(),
        Transition::AlreadyIn("paid".into())
    );
    assert_eq!(
        sm.transition(c, 0, &["pending"], "cancelled")
            .await
            .unwrap(),
        Transition::Conflict("paid".into())
    );
    assert_eq!(
        sm.transition(c, 99, &["pending"], "paid").await.unwrap(),
        Transition::NotFound
    );
    // Any of several states.
    assert_eq!(
        sm.transition(c, 0, &["pending", "paid"], "shipped")
            .await
            .unwrap(),
        Transition::Transitioned
    );
    assert_eq!(state_of(b, &t, 0).await.as_deref(), Some("shipped"));
    // `to` among `from`: the row matches, so it counts as a transition.
    assert_eq!(
        sm.transition(c, 0, &["shipped"], "shipped").await.unwrap(),
        Transition::Transitioned
    );
    // Text ids bind too (compared with the integer column on SQLite/MySQL
    // only; PostgreSQL types parameters strictly), so use integers here.
    // Bad arguments: nothing sent.
    for (from, set, what) in [
        (&[][..], &[][..], "empty from"),
        (
            &["pending"][..],
            &[("state", SqlValue::from("x"))][..],
            "state in set",
        ),
        (
            &["pending"][..],
            &[("id", SqlValue::from(5))][..],
            "id in set",
        ),
        (
            &["pending"][..],
            &[("note", SqlValue::from("a")), ("note", SqlValue::from("b"))][..],
            "twice",
        ),
    ] {
        match sm.transition_setting(c, 1, from, "paid", set).await {
            Err(PatternError::InvalidArgument { .. }) => {}
            other => panic!("{what}: expected InvalidArgument, got {other:?}"),
        }
    }
    match sm.transition(c, SqlValue::Null, &["pending"], "paid").await {
        Err(PatternError::InvalidArgument { .. }) => {}
        other => panic!("NULL id: expected InvalidArgument, got {other:?}"),
    }
    assert_eq!(state_of(b, &t, 1).await.as_deref(), Some("pending"));
    // Inside a transaction that rolls back: no change.
    {
        let mut tx = sqlx::Connection::begin(&mut *c).await.expect("begin");
        assert_eq!(
            sm.transition(&mut *tx, 1, &["pending"], "paid")
                .await
                .unwrap(),
            Transition::Transitioned
        );
        tx.rollback().await.expect("rollback");
    }
    assert_eq!(state_of(b, &t, 1).await.as_deref(), Some("pending"));
    // A NULL value is set as NULL.
    sm.transition_setting(c, 2, &["pending"], "paid", &[("note", SqlValue::Null)])
        .await
        .unwrap();
    assert_eq!(
        b.text(&format!("SELECT note FROM {t} WHERE id = 2")).await,
        None
    );
    // A missing table is a database error, not a panic.
    let missing = StateMachine::new(&format!("{t}_missing"), "id", "state").unwrap();
    match missing.transition(c, 1, &["a"], "b").await {
        Err(PatternError::Database { .. }) => {}
        other => panic!("missing table: {other:?}"),
    }
}

/// Versioned: Updated / Stale / NotFound; 8 concurrent updates at one
/// version, 5 rounds: one `Updated` each round, the others `Stale(next)`.
pub async fn versioned<B: Backend>(b: &B) {
    let t = state_table(b, 2).await;
    let v = Versioned::new(&t, "id", "version").expect("names");
    {
        let mut c = b.pool().acquire().await.expect("conn");
        let c = &mut *c;
        assert_eq!(
            v.update(c, 0, 1, &[("note", "one".into())]).await.unwrap(),
            VersionedUpdate::Updated(2)
        );
        assert_eq!(
            v.update(c, 0, 1, &[("note", "lost".into())]).await.unwrap(),
            VersionedUpdate::Stale(2)
        );
        assert_eq!(
            v.update(c, 0, 7, &[]).await.unwrap(),
            VersionedUpdate::Stale(2)
        );
        assert_eq!(
            v.update(c, 42, 1, &[]).await.unwrap(),
            VersionedUpdate::NotFound
        );
        assert_eq!(
            b.text(&format!("SELECT note FROM {t} WHERE id = 0"))
                .await
                .as_deref(),
            Some("one")
        );
        match v.update(c, 0, 2, &[("version", 9.into())]).await {
            Err(PatternError::InvalidArgument { .. }) => {}
            other => panic!("version in set: {other:?}"),
        }
    }
    for round in 0..5i64 {
        let expected = 1 + round;
        let barrier = Arc::new(Barrier::new(8));
        let mut tasks = Vec::new();
        for i in 0..8 {
            let mut conn = b.pool().acquire().await.expect("conn");
            let (v, barrier) = (v.clone(), barrier.clone());
            tasks.push(tokio::spawn(async move {
                barrier.wait().await;
                v.update(&mut *conn, 1, expected, &[("note", format!("w{i}").into())])
                    .await
            }));
        }
        let mut updated = 0;
        for task in tasks {
            match task.await.expect("task").expect("update") {
                VersionedUpdate::Updated(n) => {
                    assert_eq!(n, expected + 1);
                    updated += 1;
                }
                VersionedUpdate::Stale(n) => assert_eq!(n, expected + 1),
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(updated, 1, "round {round}: exactly one Updated");
        assert_eq!(
            b.int(&format!("SELECT version FROM {t} WHERE id = 1"))
                .await,
            expected + 1
        );
    }
}

/// In `tx`, after `first` was inserted for `"k"` elsewhere: `"k"` again
/// is found (`first`'s id, not inserted) and the transaction goes on (it
/// inserts `"k2"`) and commits; `t` then holds both rows.
pub async fn duplicate_then_go_on<B: Backend>(
    b: &B,
    t: &str,
    iog: &InsertOrGet,
    mut tx: sqlx::Transaction<'_, B::Db>,
    first: &Created,
) {
    let again = iog.insert_or_get(&mut *tx, "k", &[]).await.unwrap();
    assert_eq!((&again.id, again.inserted), (&first.id, false));
    let more = iog.insert_or_get(&mut *tx, "k2", &[]).await.unwrap();
    assert!(more.inserted);
    tx.commit().await.unwrap();
    assert_eq!(b.int(&format!("SELECT COUNT(*) FROM {t}")).await, 2);
}

/// A [`keyed_table`] and the insert-or-get on its `id` and `biz_key`.
pub async fn keyed_insert_or_get<B: Backend>(b: &B) -> (String, InsertOrGet) {
    let t = keyed_table(b).await;
    let iog = InsertOrGet::new(&t, "id", "biz_key").expect("names");
    (t, iog)
}

/// `id` auto, `biz_key` unique, `note`, `other` unique.
pub async fn keyed_table<B: Backend>(b: &B) -> String {
    let t = table(b, "iog");
    b.exec(&format!(
        "CREATE TABLE {t} (id {}, biz_key VARCHAR(200) NOT NULL UNIQUE, \
         note VARCHAR(200), other VARCHAR(50) UNIQUE){}",
        b.auto_id(),
        b.table_opts()
    ))
    .await;
    t
}

/// Insert-or-get, sequential: insert, get, values round-trip, another
/// unique key's violation is an error, bad arguments.
pub async fn insert_or_get_basics<B: Backend>(b: &B) {
    let (t, iog) = keyed_insert_or_get(b).await;
    let mut c = b.pool().acquire().await.expect("conn");
    let c = &mut *c;
    let tricky = "O'Brien \"q\" `b` ; -- \\ ünïcødé 😀 '); DROP TABLE x; --";
    let first = iog
        .insert_or_get(
            c,
            tricky,
            &[("note", tricky.into()), ("other", "o1".into())],
        )
        .await
        .unwrap();
    assert!(first.inserted);
    assert!(matches!(first.id, SqlValue::I64(_)), "{first:?}");
    let again = iog
        .insert_or_get(c, tricky, &[("note", "ignored".into())])
        .await
        .unwrap();
    assert_eq!((&again.id, again.inserted), (&first.id, false));
    let note = b
        .text(&format!("SELECT note FROM {t} WHERE id = {}", first.id))
        .await;
    assert_eq!(note.as_deref(), Some(tricky), "values round-trip");
    let key = b
        .text(&format!("SELECT biz_key FROM {t} WHERE id = {}", first.id))
        .await;
    assert_eq!(key.as_deref(), Some(tricky), "key round-trips");
    assert_eq!(b.int(&format!("SELECT COUNT(*) FROM {t}")).await, 1);
    // Another unique column clashing: an error, not a wrong id.
    match iog.insert_or_get(c, "k2", &[("other", "o1".into())]).await {
        Err(PatternError::UniqueViolation { .. }) => {}
        other => panic!("other unique key: expected UniqueViolation, got {other:?}"),
    }
    // The caller may pass the id.
    let given = iog
        .insert_or_get(c, "k3", &[("id", 1_000_000.into())])
        .await
        .unwrap();
    assert_eq!((given.id, given.inserted), (SqlValue::I64(1_000_000), true));
    for (key, values, what) in [
        (SqlValue::Null, &[][..], "NULL key"),
        (
            SqlValue::from("k"),
            &[("biz_key", SqlValue::from("x"))][..],
            "key in values",
        ),
    ] {
        match iog.insert_or_get(c, key, values).await {
            Err(PatternError::InvalidArgument { .. }) => {}
            other => panic!("{what}: {other:?}"),
        }
    }
    assert_eq!(b.int(&format!("SELECT COUNT(*) FROM {t}")).await, 2);
}

/// 16 tasks on 16 connections insert-or-get one key at once (5 keys in
/// turn): one row per key, the same id for all, exactly one `inserted`, no
/// error. When `begin(pool, table)` gives a transaction, each call runs
/// inside its own, which commits after it.
pub async fn insert_or_get_race<B: Backend, F, Fut>(b: &B, begin: F)
where
    F: Fn(sqlx::Pool<B::Db>, String) -> Fut,
    Fut: std::future::Future<Output = Option<sqlx::Transaction<'static, B::Db>>>,
{
    const N: usize = 16;
    let (t, iog) = keyed_insert_or_get(b).await;
    for round in 0..5 {
        let key = format!("order-{round}-{}", idem_testkit::support::random_hex(6));
        let barrier = Arc::new(Barrier::new(N));
        let mut tasks = Vec::new();
        for i in 0..N {
            let tx = begin(b.pool().clone(), t.clone()).await;
            let conn = match tx {
                Some(_) => None,
                None => Some(b.pool().acquire().await.expect("conn")),
            };
            let (iog, barrier, key) = (iog.clone(), barrier.clone(), key.clone());
            tasks.push(tokio::spawn(async move {
                barrier.wait().await;
                let note = SqlValue::from(format!("task {i}"));
                match (tx, conn) {
                    (Some(mut tx), _) => {
                        let r = iog.insert_or_get(&mut *tx, key, &[("note", note)]).await;
                        if r.is_ok() {
                            tx.commit().await.expect("commit");
                        }
                        r
                    }
                    (None, Some(mut conn)) => {
                        iog.insert_or_get(&mut *conn, key, &[("note", note)]).await
                    }
                    _ => unreachable!(),
                }
            }));
        }
        one_row_one_id(b, &t, &key, round, tasks).await;
    }
}

/// Another connection inserts `key` (while a check's transaction holds an
/// older snapshot): a new row.
pub async fn insert_elsewhere<B: Backend>(b: &B, iog: &InsertOrGet, key: &str) -> Created {
    let mut other = b.pool().acquire().await.expect("conn");
    let first = iog.insert_or_get(&mut *other, key, &[]).await.unwrap();
    assert!(first.inserted);
    first
}

/// Another connection moves row `id` from `pending` to `completed` (while a
/// check's transaction holds an older snapshot).
pub async fn complete_elsewhere<B: Backend>(b: &B, sm: &StateMachine, id: i64) {
    let mut other = b.pool().acquire().await.expect("conn");
    assert_eq!(
        sm.transition(&mut *other, id, &["pending"], "completed")
            .await
            .unwrap(),
        Transition::Transitioned
    );
}

/// `pending → cancelled` of row 0 on `c` answers `Conflict(completed)`: the
/// latest committed state, whatever `c`'s snapshot saw.
pub async fn expect_cancel_conflicts<C: SqlConnection>(sm: &StateMachine, c: &mut C) {
    assert_eq!(
        sm.transition(c, 0, &["pending"], "cancelled")
            .await
            .unwrap(),
        Transition::Conflict("completed".into())
    );
}

/// `r` is the typed retryable error of a stale snapshot.
pub fn expect_serialization_failure<T: std::fmt::Debug>(r: Result<T, PatternError>) {
    match r {
        Err(e @ PatternError::SerializationFailure { .. }) => assert!(e.is_retryable()),
        other => panic!("expected SerializationFailure, got {other:?}"),
    }
}

/// Awaits the racing insert-or-gets of `key` into `t`: no error, exactly
/// one `inserted`, the same id for all, one row with the key. Returns the id.
async fn one_row_one_id<B: Backend>(
    b: &B,
    t: &str,
    key: &str,
    round: usize,
    tasks: Vec<tokio::task::JoinHandle<Result<Created, PatternError>>>,
) -> SqlValue {
    let mut ids = Vec::new();
    let mut inserted = 0;
    for task in tasks {
        let c = task
            .await
            .expect("task")
            .unwrap_or_else(|e| panic!("round {round}: insert_or_get failed: {e} ({e:?})"));
        inserted += usize::from(c.inserted);
        ids.push(c.id);
    }
    assert_eq!(inserted, 1, "round {round}: exactly one inserted");
    assert!(ids.iter().all(|id| *id == ids[0]), "same id: {ids:?}");
    assert_eq!(
        b.int(&format!("SELECT COUNT(*) FROM {t} WHERE biz_key = '{key}'"))
            .await,
        1
    );
    ids.swap_remove(0)
}

/// On `c`, row 1 of `m`'s table moves `a → b` by an `I64` id; then the
/// text `"12345678"` (the bytes of a row's big-endian id) finds no row:
/// each call's values are sent as themselves.
pub async fn text_id_after_int_id<C: SqlConnection>(m: &StateMachine, c: &mut C) {
    assert_eq!(
        m.transition(&mut *c, 1, &["a"], "b").await.unwrap(),
        Transition::Transitioned
    );
    assert_eq!(
        m.transition(&mut *c, "12345678", &["a"], "b")
            .await
            .unwrap(),
        Transition::NotFound
    );
}

/// Bad names are refused before anything is sent.
pub fn bad_identifiers() {
    let long = "a".repeat(64);
    let bad = [
        "a;drop",
        "",
        long.as_str(),
        "a\"b",
        "a'b",
        "a`b",
        "a b",
        "1a",
        "a.b.c",
        "a-b",
        "ü",
    ];
    for name in bad {
        let checks: [Result<(), PatternError>; 9] = [
            StateMachine::new(name, "id", "state").map(drop),
            StateMachine::new("t", name, "state").map(drop),
            StateMachine::new("t", "id", name).map(drop),
            Versioned::new(name, "id", "v").map(drop),
            Versioned::new("t", name, "v").map(drop),
            Versioned::new("t", "id", name).map(drop),
            InsertOrGet::new(name, "id", "k").map(drop),
            InsertOrGet::new("t", name, "k").map(drop),
            InsertOrGet::new("t", "id", name).map(drop),
        ];
        for (i, r) in checks.into_iter().enumerate() {
            match r {
                Err(PatternError::InvalidIdentifier { name: n, .. }) => assert_eq!(n, name),
                other if name == "a.b.c" && i % 3 != 0 => {
                    // a column may not contain a dot either
                    assert!(
                        matches!(other, Err(PatternError::InvalidIdentifier { .. })),
                        "{name:?} #{i}: {other:?}"
                    );
                }
                other => panic!("{name:?} #{i}: expected InvalidIdentifier, got {other:?}"),
            }
        }
    }
    assert!(StateMachine::new(&"a".repeat(63), "id", "state").is_ok());
    assert!(StateMachine::new("s.t", "id", "state").is_ok());
}

/// Bad column names in `set` / `values` are refused at call time.
pub async fn bad_set_columns<B: Backend>(b: &B) {
    let (t, sm) = state_machine(b, 1).await;
    let v = Versioned::new(&t, "id", "version").unwrap();
    let iog = InsertOrGet::new(&t, "id", "note").unwrap();
    let mut c = b.pool().acquire().await.expect("conn");
    let c = &mut *c;
    for name in ["a;drop", "", "x\"y", "note = 'x', state"] {
        let set = [(name, SqlValue::from("x"))];
        assert!(matches!(
            sm.transition_setting(c, 0, &["pending"], "x", &set).await,
            Err(PatternError::InvalidIdentifier { .. })
        ));
        assert!(matches!(
            v.update(c, 0, 1, &set).await,
            Err(PatternError::InvalidIdentifier { .. })
        ));
        assert!(matches!(
            iog.insert_or_get(c, "k", &set).await,
            Err(PatternError::InvalidIdentifier { .. })
        ));
    }
    assert_eq!(state_of(b, &t, 0).await.as_deref(), Some("pending"));
}

/// A transaction inserts the key and waits; 6 autocommit callers queue
/// behind it; it rolls back. The waiters then race for the key (on InnoDB
/// this is where a 1213 deadlock between waiters happens; it is retried):
/// one row, one id, no error.
pub async fn insert_or_get_after_rollback<B: Backend>(b: &B) {
    const N: usize = 6;
    let (t, iog) = keyed_insert_or_get(b).await;
    for round in 0..3 {
        let key = format!("rb-{round}");
        let mut holder = b.pool().begin().await.expect("begin");
        let held = iog
            .insert_or_get(&mut *holder, key.clone(), &[])
            .await
            .expect("holder inserts");
        assert!(held.inserted);
        let mut tasks = Vec::new();
        for _ in 0..N {
            let mut conn = b.pool().acquire().await.expect("conn");
            let (iog, key) = (iog.clone(), key.clone());
            tasks.push(tokio::spawn(async move {
                iog.insert_or_get(&mut *conn, key, &[]).await
            }));
        }
        // Let the waiters reach the lock (ordering only; a late one just
        // finds the row).
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
        holder.rollback().await.expect("rollback");
        let id = one_row_one_id(b, &t, &key, round, tasks).await;
        assert_ne!(id, held.id, "the rolled-back id is not reused");
    }
}
