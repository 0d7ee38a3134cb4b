//! Lock backends on SQL databases (see `idem_core::lock` and
//! `docs/patterns/lock.md`):
//!
//! * [`LeaseLockBackend`] — a lease table on SQLite, PostgreSQL or
//!   MySQL/MariaDB: `idem_locks(name PK, owner, fence, until_ms)`. Each
//!   step is one atomic statement (one short transaction on MySQL), timed
//!   by the database's clock.
//! * [`PgAdvisoryLockBackend`] (feature `postgres`) — PostgreSQL session
//!   advisory locks held on a connection taken out of the pool, with a
//!   fence counter table.

use std::time::Duration;

use async_trait::async_trait;
use idem_core::lock::{new_owner_token, LockBackend, LockError, LockLease, LockOp, TryAcquire};
use sqlx::Row;

use crate::common::{millis, span_ms};
use crate::dialect::{error_kind, is_plain_ident, Dialect, ErrorKind};

/// Default table of [`LeaseLockBackend`].
pub const DEFAULT_LOCK_TABLE: &str = "idem_locks";
/// Default fence counter table of [`PgAdvisoryLockBackend`].
pub const DEFAULT_FENCE_TABLE: &str = "idem_lock_fences";
/// Longest table name accepted (PostgreSQL keeps 63 bytes; a little room
/// is left for derived names).
pub const MAX_LOCK_TABLE_LEN: usize = 54;

/// How often a MySQL step is tried when InnoDB reports a deadlock or a lock
/// wait timeout (the transaction was rolled back).
#[cfg(feature = "mysql")]
const MY_ATTEMPTS: u32 = 6;

/// Checks a table name: 1 to [`MAX_LOCK_TABLE_LEN`] characters of
/// `[A-Za-z0-9_]`, not starting with a digit. Names are checked before they
/// are quoted into SQL; values are always bound.
///
/// # Errors
/// [`LockError::Config`].
pub fn validate_table(name: &str) -> Result<(), LockError> {
    if is_plain_ident(name, MAX_LOCK_TABLE_LEN) {
        Ok(())
    } else {
        Err(LockError::Config(format!(
            "lock table name {name:?} is not a plain identifier: use 1 to \
             {MAX_LOCK_TABLE_LEN} characters of [A-Za-z0-9_], not starting with a digit"
        )))
    }
}

fn db_err(op: LockOp) -> impl Fn(sqlx::Error) -> LockError {
    move |e| match e {
        sqlx::Error::ColumnDecode { .. }
        | sqlx::Error::Decode(_)
        | sqlx::Error::ColumnNotFound(_) => LockError::Corrupt {
            op,
            detail: e.to_string(),
        },
        e => LockError::unavailable(op, e),
    }
}

fn fence_of(v: i64, op: LockOp) -> Result<u64, LockError> {
    match u64::try_from(v) {
        Ok(f) if f > 0 => Ok(f),
        _ => Err(LockError::Corrupt {
            op,
            detail: format!("fence {v} is not positive"),
        }),
    }
}

fn retry_after(left_ms: Option<i64>) -> Duration {
    Duration::from_millis(u64::try_from(left_ms.unwrap_or(1)).unwrap_or(1).max(1))
}

/// `CREATE TABLE IF NOT EXISTS` racing with itself on PostgreSQL can fail
/// with unique_violation (23505) on the catalog or duplicate_table (42P07):
/// the table exists then.
fn ignore_created_concurrently<T>(r: Result<T, sqlx::Error>) -> Result<(), sqlx::Error> {
    match r {
        Err(e)
            if !matches!(
                error_kind(&e),
                Some(ErrorKind::UniqueViolation | ErrorKind::DuplicateTable)
            ) =>
        {
            Err(e)
        }
        _ => Ok(()),
    }
}

#[derive(Debug, Clone)]
enum Db {
    Sqlite(sqlx::SqlitePool),
    #[cfg(feature = "postgres")]
    Postgres(sqlx::PgPool),
    #[cfg(feature = "mysql")]
    MySql(sqlx::MySqlPool),
}

impl Db {
    fn dialect(&self) -> Dialect {
        match self {
            Self::Sqlite(_) => Dialect::Sqlite,
            #[cfg(feature = "postgres")]
            Self::Postgres(_) => Dialect::Postgres,
            #[cfg(feature = "mysql")]
            Self::MySql(_) => Dialect::MySql,
        }
    }
}

/// Runs `$body` with `$pool` bound to the pool of a database that has
/// `INSERT … ON CONFLICT … RETURNING` (SQLite, PostgreSQL); MySQL's steps
/// are [`LeaseLockBackend`]'s `mysql_*` methods, dispatched before.
macro_rules! on_returning_pool {
    ($db:expr, $pool:ident => $body:expr) => {
        match $db {
            Db::Sqlite($pool) => $body,
            #[cfg(feature = "postgres")]
            Db::Postgres($pool) => $body,
            #[cfg(feature = "mysql")]
            Db::MySql(_) => unreachable!("MySQL steps are dispatched before"),
        }
    };
}

/// The statements of a lease table, with the table's quoted name, the
/// dialect's placeholders and its clock filled in.
#[derive(Debug, Clone)]
struct LeaseSql {
    create: String,
    /// SQLite / PostgreSQL: the grant, `RETURNING fence, until_ms` (no row:
    /// held). MySQL: the upsert, read back by `read`.
    acquire: String,
    /// SQLite / PostgreSQL: the time left on a held lease. MySQL: the row
    /// as the upsert left it.
    read: String,
    extend: String,
    /// MySQL: the renewed row, read back in the renewal's transaction.
    #[cfg_attr(not(feature = "mysql"), allow(dead_code))]
    extend_read: String,
    release: String,
}

impl LeaseSql {
    fn new(d: Dialect, table: &str) -> Self {
        let t = d.quote(table);
        let now = d.now_ms();
        let [p1, p2, p3] = d.params::<3>();
        let create = match d {
            Dialect::Sqlite => format!(
                "CREATE TABLE IF NOT EXISTS {t} (name TEXT NOT NULL PRIMARY KEY, \
                 owner TEXT NULL, fence INTEGER NOT NULL, until_ms INTEGER NOT NULL)"
            ),
            #[cfg(feature = "postgres")]
            Dialect::Postgres => format!(
                "CREATE TABLE IF NOT EXISTS {t} (name TEXT NOT NULL PRIMARY KEY, \
                 owner TEXT NULL, fence BIGINT NOT NULL, until_ms BIGINT NOT NULL)"
            ),
            #[cfg(feature = "mysql")]
            Dialect::MySql => format!(
                "CREATE TABLE IF NOT EXISTS {t} (name VARBINARY(255) NOT NULL PRIMARY KEY, \
                 owner VARBINARY(64) NULL, fence BIGINT NOT NULL, until_ms BIGINT NOT NULL) \
                 ENGINE=InnoDB"
            ),
        };
        let (acquire, read) = match d {
            // Assignments in ON DUPLICATE KEY UPDATE run left to right and
            // see earlier ones, so `until_ms` (the condition) is assigned
            // last. The read-back in the same transaction sees the row as
            // this statement left it (its row lock is held).
            #[cfg(feature = "mysql")]
            Dialect::MySql => (
                format!(
                    "INSERT INTO {t} (name, owner, fence, until_ms) \
                     VALUES (?, ?, 1, {now} + ?) \
                     ON DUPLICATE KEY UPDATE \
                       owner = IF(until_ms <= {now}, VALUES(owner), owner), \
                       fence = IF(until_ms <= {now}, fence + 1, fence), \
                       until_ms = IF(until_ms <= {now}, VALUES(until_ms), until_ms)"
                ),
                format!("SELECT owner, fence, until_ms, until_ms - {now} FROM {t} WHERE name = ?"),
            ),
            _ => (
                format!(
                    "INSERT INTO {t} (name, owner, fence, until_ms) \
                     VALUES ({p1}, {p2}, 1, {now} + {p3}) \
                     ON CONFLICT (name) DO UPDATE SET owner = EXCLUDED.owner, \
                       fence = {t}.fence + 1, until_ms = EXCLUDED.until_ms \
                     WHERE {t}.until_ms <= {now} \
                     RETURNING fence, until_ms"
                ),
                format!("SELECT until_ms - {now} FROM {t} WHERE name = {p1}"),
            ),
        };
        let live = format!("name = {p2} AND owner = {p3} AND until_ms > {now}");
        Self {
            create,
            acquire,
            read,
            extend: match d {
                // MySQL reports rows *changed*, and a renewal within the
                // same millisecond changes nothing: the row is read back in
                // the same transaction instead.
                #[cfg(feature = "mysql")]
                Dialect::MySql => format!("UPDATE {t} SET until_ms = {now} + {p1} WHERE {live}"),
                _ => format!(
                    "UPDATE {t} SET until_ms = {now} + {p1} WHERE {live} RETURNING until_ms"
                ),
            },
            extend_read: format!(
                "SELECT until_ms FROM {t} WHERE name = {p1} AND owner = {p2} AND until_ms > {now}"
            ),
            // `owner` changes from the token to NULL, so a match is always
            // a changed row (also on MySQL).
            release: format!(
                "UPDATE {t} SET owner = NULL, until_ms = 0 \
                 WHERE name = {p1} AND owner = {p2} AND until_ms > {now}"
            ),
        }
    }
}

/// A lock backend on a lease table, for SQLite, PostgreSQL and
/// MySQL/MariaDB (10.5+ / 8.0+):
///
/// ```sql
/// CREATE TABLE idem_locks (
///     name     TEXT PRIMARY KEY,  -- VARBINARY(255) on MySQL: exact bytes
///     owner    TEXT NULL,         -- the holder's token; NULL once released
///     fence    BIGINT NOT NULL,   -- the last fence granted for this name
///     until_ms BIGINT NOT NULL    -- lease end, ms since the epoch (database clock)
/// );
/// ```
///
/// A row is created on a name's first grant and never deleted, so its
/// `fence` column is the name's fence counter: it grows by one on every
/// grant, across release and expiry. (One small row per distinct name;
/// delete rows of names no longer used only if their fences may restart.)
///
/// | step | statement |
/// |---|---|
/// | acquire | `INSERT … ON CONFLICT (name) DO UPDATE SET owner = new, fence = fence + 1, until_ms = now + ttl WHERE until_ms <= now RETURNING fence, until_ms` (MySQL: `INSERT … ON DUPLICATE KEY UPDATE` with the same condition, read back in one transaction) |
/// | extend | `UPDATE … SET until_ms = now + ttl WHERE name = ? AND owner = ? AND until_ms > now` |
/// | release | `UPDATE … SET owner = NULL, until_ms = 0 WHERE name = ? AND owner = ? AND until_ms > now` |
///
/// `now` is the database's clock (`clock_timestamp()`, `UTC_TIMESTAMP(6)`,
/// SQLite's `julianday('now')`), so application servers' clocks do not
/// matter. Call [`LeaseLockBackend::migrate`] once to create the table.
/// Clones share the pool.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use std::time::Duration;
/// use idem_core::lock::{Acquire, Lock};
/// use idem_sql::LeaseLockBackend;
///
/// let pool = sqlx::SqlitePool::connect("sqlite::memory:").await?;
/// let backend = LeaseLockBackend::sqlite(pool);
/// backend.migrate().await?;
/// let lock = Lock::new(backend);
/// let Acquire::Held(guard) = lock.try_acquire("report:2024-06", Duration::from_secs(30)).await? else {
///     unreachable!("nobody else holds it")
/// };
/// assert_eq!(guard.fence(), 1);
/// assert!(guard.release().await?);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct LeaseLockBackend {
    db: Db,
    table: String,
    sql: LeaseSql,
}

impl LeaseLockBackend {
    fn with_db(db: Db) -> Self {
        let sql = LeaseSql::new(db.dialect(), DEFAULT_LOCK_TABLE);
        Self {
            db,
            table: DEFAULT_LOCK_TABLE.to_owned(),
            sql,
        }
    }

    /// A lease table on SQLite (the pool's `busy_timeout` bounds waiting
    /// for the write lock).
    pub fn sqlite(pool: sqlx::SqlitePool) -> Self {
        Self::with_db(Db::Sqlite(pool))
    }

    /// A lease table on PostgreSQL (in the connection's `search_path`).
    #[cfg(feature = "postgres")]
    pub fn postgres(pool: sqlx::PgPool) -> Self {
        Self::with_db(Db::Postgres(pool))
    }

    /// A lease table on MySQL 8.0+ or MariaDB 10.5+ (InnoDB).
    #[cfg(feature = "mysql")]
    pub fn mysql(pool: sqlx::MySqlPool) -> Self {
        Self::with_db(Db::MySql(pool))
    }

    /// Uses table `name` instead of `idem_locks`.
    ///
    /// # Errors
    /// [`LockError::Config`] unless `name` is a plain identifier
    /// ([`validate_table`]).
    pub fn with_table(mut self, name: &str) -> Result<Self, LockError> {
        validate_table(name)?;
        self.table = name.to_owned();
        self.sql = LeaseSql::new(self.db.dialect(), name);
        Ok(self)
    }

    /// The table in use.
    pub fn table(&self) -> &str {
        &self.table
    }

    /// Creates the table when it does not exist (safe to call from several
    /// processes at once).
    ///
    /// # Errors
    /// [`LockError::Unavailable`] (op `Connect`) when the database refuses.
    pub async fn migrate(&self) -> Result<(), LockError> {
        let sql = &self.sql.create;
        let r = match &self.db {
            #[cfg(feature = "mysql")]
            Db::MySql(pool) => sqlx::query(sql).execute(pool).await.map(drop),
            db => on_returning_pool!(db, pool => sqlx::query(sql).execute(pool).await.map(drop)),
        };
        ignore_created_concurrently(r).map_err(db_err(LockOp::Connect))
    }
}

#[async_trait]
impl LockBackend for LeaseLockBackend {
    async fn try_acquire(&self, name: &str, ttl: Duration) -> Result<TryAcquire, LockError> {
        const OP: LockOp = LockOp::Acquire;
        let owner = new_owner_token();
        let ttl = span_ms(ttl);
        #[cfg(feature = "mysql")]
        if let Db::MySql(pool) = &self.db {
            let (row_owner, fence, until, left): (Option<Vec<u8>>, i64, i64, i64) =
                mysql_retrying(OP, || async {
                    let mut tx = pool.begin().await?;
                    sqlx::query(&self.sql.acquire)
                        .bind(name.as_bytes())
                        .bind(owner.as_bytes())
                        .bind(ttl)
                        .execute(&mut *tx)
                        .await?;
                    let r = sqlx::query_as(&self.sql.read)
                        .bind(name.as_bytes())
                        .fetch_one(&mut *tx)
                        .await?;
                    tx.commit().await?;
                    Ok(r)
                })
                .await?;
            let granted =
                (row_owner.as_deref() == Some(owner.as_bytes())).then_some((fence, until));
            return grant_or_busy(name, owner, granted, Some(left));
        }
        let (granted, left) = on_returning_pool!(&self.db, pool => {
            let row = sqlx::query(&self.sql.acquire)
                .bind(name)
                .bind(&owner)
                .bind(ttl)
                .fetch_optional(pool)
                .await
                .map_err(db_err(OP))?;
            let granted: Option<(i64, i64)> = row
                .map(|r| Ok((r.try_get(0)?, r.try_get(1)?)))
                .transpose()
                .map_err(db_err(OP))?;
            let left: Option<i64> = match granted {
                Some(_) => None,
                None => sqlx::query_scalar(&self.sql.read)
                    .bind(name)
                    .fetch_optional(pool)
                    .await
                    .map_err(db_err(OP))?,
            };
            (granted, left)
        });
        grant_or_busy(name, owner, granted, left)
    }

    async fn extend(
        &self,
        lease: &LockLease,
        ttl: Duration,
    ) -> Result<Option<LockLease>, LockError> {
        const OP: LockOp = LockOp::Extend;
        let ttl = span_ms(ttl);
        let until: Option<i64> = match &self.db {
            #[cfg(feature = "mysql")]
            Db::MySql(pool) => {
                mysql_retrying(OP, || async {
                    let mut tx = pool.begin().await?;
                    sqlx::query(&self.sql.extend)
                        .bind(ttl)
                        .bind(lease.name.as_bytes())
                        .bind(lease.owner.as_bytes())
                        .execute(&mut *tx)
                        .await?;
                    let r: Option<i64> = sqlx::query_scalar(&self.sql.extend_read)
                        .bind(lease.name.as_bytes())
                        .bind(lease.owner.as_bytes())
                        .fetch_optional(&mut *tx)
                        .await?;
                    tx.commit().await?;
                    Ok(r)
                })
                .await?
            }
            db => on_returning_pool!(db, pool => sqlx::query_scalar(&self.sql.extend)
                .bind(ttl)
                .bind(&lease.name)
                .bind(&lease.owner)
                .fetch_optional(pool)
                .await
                .map_err(db_err(OP))?),
        };
        Ok(until.map(|u| LockLease {
            until: millis(u),
            ..lease.clone()
        }))
    }

    async fn release(&self, lease: &LockLease) -> Result<bool, LockError> {
        const OP: LockOp = LockOp::Release;
        let affected = match &self.db {
            #[cfg(feature = "mysql")]
            Db::MySql(pool) => {
                mysql_retrying(OP, || async {
                    Ok(sqlx::query(&self.sql.release)
                        .bind(lease.name.as_bytes())
                        .bind(lease.owner.as_bytes())
                        .execute(pool)
                        .await?
                        .rows_affected())
                })
                .await?
            }
            db => on_returning_pool!(db, pool => sqlx::query(&self.sql.release)
                .bind(&lease.name)
                .bind(&lease.owner)
                .execute(pool)
                .await
                .map_err(db_err(OP))?
                .rows_affected()),
        };
        Ok(affected == 1)
    }
}

/// The answer of `try_acquire`: the grant (fence, lease end), or busy with
/// the time left on the holder's lease.
fn grant_or_busy(
    name: &str,
    owner: String,
    granted: Option<(i64, i64)>,
    left: Option<i64>,
) -> Result<TryAcquire, LockError> {
    match granted {
        Some((fence, until)) => Ok(TryAcquire::Acquired(LockLease {
            name: name.to_owned(),
            owner,
            fence: fence_of(fence, LockOp::Acquire)?,
            until: millis(until),
        })),
        None => Ok(TryAcquire::Busy {
            retry_after: retry_after(left),
        }),
    }
}

/// Runs a MySQL step, again after a deadlock (1213) or a lock wait timeout
/// (1205) — both roll the statement back — up to [`MY_ATTEMPTS`] times.
#[cfg(feature = "mysql")]
async fn mysql_retrying<T, F, Fut>(op: LockOp, step: F) -> Result<T, LockError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, sqlx::Error>>,
{
    crate::common::retry(MY_ATTEMPTS, crate::common::BACKOFF_BASE, step, |e| {
        matches!(
            error_kind(e),
            Some(ErrorKind::Deadlock | ErrorKind::LockWaitTimeout)
        )
    })
    .await
    .map_err(db_err(op))
}

#[cfg(feature = "postgres")]
pub use advisory::PgAdvisoryLockBackend;

#[cfg(feature = "postgres")]
mod advisory {
    use std::collections::HashMap;
    use std::sync::{Arc, Mutex as StdMutex, MutexGuard};
    use std::time::Duration;

    use async_trait::async_trait;
    use idem_core::lock::{new_owner_token, LockBackend, LockError, LockLease, LockOp, TryAcquire};
    use sqlx::postgres::PgConnection;
    use sqlx::{Connection, PgPool};
    use tokio::sync::{oneshot, Mutex};

    use super::{
        db_err, fence_of, ignore_created_concurrently, millis, span_ms, validate_table,
        DEFAULT_FENCE_TABLE,
    };
    use crate::dialect::{error_kind, Dialect, ErrorKind};

    /// PostgreSQL's clock in ms when evaluated.
    const PG_NOW_MS: &str = Dialect::Postgres.now_ms();

    /// One granted advisory lock: the session that holds it.
    #[derive(Debug)]
    struct Held {
        /// The lease's name and fence: a lease naming another lock (the
        /// same token on a forged lease) must not match.
        name: String,
        fence: u64,
        key: i64,
        pid: i32,
        /// `None` once closed.
        conn: Mutex<Option<PgConnection>>,
    }

    /// A lock backend on PostgreSQL session advisory locks
    /// (`pg_try_advisory_lock`), with fences from a counter table
    /// (`idem_lock_fences(name PK, fence)`, bumped in its own autocommitted
    /// statement `INSERT … ON CONFLICT (name) DO UPDATE SET fence = fence + 1
    /// RETURNING fence` after each grant).
    ///
    /// **The lease is the session, not the TTL.** Each grant takes one
    /// connection out of the pool (`PoolConnection::detach`; the pool opens
    /// a replacement) and holds the lock on it until release, which unlocks
    /// and closes that connection. So:
    ///
    /// * TTL expiry does NOT apply while the session lives: a holder that
    ///   hangs keeps the lock (and the others wait) until it releases, its
    ///   guard is dropped, or its session ends. `ttl` only paces the
    ///   watchdog (which checks `pg_locks` on the holding session every
    ///   `ttl / 3`) and [`LockGuard::keep`](idem_core::lock::LockGuard::keep)
    ///   (released from this process once `ttl` has passed).
    /// * A lost session frees the lock: the process dies, the connection
    ///   breaks, an operator runs `pg_terminate_backend`. The next holder
    ///   then gets a larger fence; the old holder's watchdog finds the
    ///   session gone and fires `lost()`. TCP keepalives (or
    ///   `idle_session_timeout`-style limits) bound how long a dead client's
    ///   session can linger.
    /// * No lock-holding connection ever returns to the pool (where
    ///   another caller would re-enter the lock, since advisory locks are
    ///   re-entrant per session).
    ///
    /// Advisory keys are a 64-bit hash of the counter table's name and the
    /// lock name: two names that collide share one lock (more exclusion,
    /// never less); their fences stay separate. Clones share the pool and
    /// the held sessions.
    #[derive(Debug, Clone)]
    pub struct PgAdvisoryLockBackend {
        pool: PgPool,
        table: String,
        held: Arc<StdMutex<HashMap<String, Arc<Held>>>>,
    }

    impl PgAdvisoryLockBackend {
        /// Advisory locks on `pool`'s database, fences in `idem_lock_fences`.
        pub fn new(pool: PgPool) -> Self {
            Self {
                pool,
                table: DEFAULT_FENCE_TABLE.to_owned(),
                held: Arc::default(),
            }
        }

        /// Uses fence table `name` instead of `idem_lock_fences` (and keys
        /// advisory locks by it too, so separate tables are separate lock
        /// spaces).
        ///
        /// # Errors
        /// [`LockError::Config`] unless `name` is a plain identifier.
        pub fn with_table(mut self, name: &str) -> Result<Self, LockError> {
            validate_table(name)?;
            self.table = name.to_owned();
            Ok(self)
        }

        /// Creates the fence table when it does not exist.
        ///
        /// # Errors
        /// [`LockError::Unavailable`] (op `Connect`).
        pub async fn migrate(&self) -> Result<(), LockError> {
            let r = sqlx::query(&format!(
                "CREATE TABLE IF NOT EXISTS \"{}\" (name TEXT NOT NULL PRIMARY KEY, \
                 fence BIGINT NOT NULL)",
                self.table
            ))
            .execute(&self.pool)
            .await;
            ignore_created_concurrently(r).map_err(db_err(LockOp::Connect))
        }

        /// The advisory lock key of `name` (64-bit FNV-1a of the fence table's
        /// name, a zero byte and `name`), as `pg_locks` shows it split into
        /// `classid` (high 32 bits) and `objid` (low 32 bits).
        pub fn advisory_key(&self, name: &str) -> i64 {
            crate::common::fnv1a(&[&self.table, name]) as i64
        }

        /// The backend process id of the session holding `lease`, while this
        /// backend holds it (for operators and tests: `pg_terminate_backend`).
        pub fn session_pid(&self, lease: &LockLease) -> Option<i32> {
            self.lookup(lease).map(|h| h.pid)
        }

        /// The held session of exactly this lease (owner, name and fence).
        fn lookup(&self, lease: &LockLease) -> Option<Arc<Held>> {
            self.held()
                .get(&lease.owner)
                .filter(|h| h.name == lease.name && h.fence == lease.fence)
                .cloned()
        }

        /// Takes the held session of exactly this lease out of the map.
        fn take(&self, lease: &LockLease) -> Option<Arc<Held>> {
            let mut held = self.held();
            let matches = held
                .get(&lease.owner)
                .is_some_and(|h| h.name == lease.name && h.fence == lease.fence);
            if matches {
                held.remove(&lease.owner)
            } else {
                None
            }
        }

        /// How many sessions this backend holds locks on.
        pub fn held_sessions(&self) -> usize {
            self.held().len()
        }

        fn held(&self) -> MutexGuard<'_, HashMap<String, Arc<Held>>> {
            self.held.lock().unwrap_or_else(|p| p.into_inner())
        }

        fn busy_hint(ttl: Duration) -> Duration {
            (ttl / 10).clamp(Duration::from_millis(10), Duration::from_secs(1))
        }

        /// The grant itself (run in a spawned task by `try_acquire`).
        async fn grant(
            &self,
            name: &str,
            ttl: Duration,
        ) -> Result<Option<(LockLease, Arc<Held>)>, LockError> {
            const OP: LockOp = LockOp::Acquire;
            let key = self.advisory_key(name);
            let mut pooled = self.pool.acquire().await.map_err(db_err(OP))?;
            let (got, pid): (bool, i32) =
                sqlx::query_as("SELECT pg_try_advisory_lock($1), pg_backend_pid()")
                    .bind(key)
                    .fetch_one(&mut *pooled)
                    .await
                    .map_err(db_err(OP))?;
            if !got {
                // Holds nothing: back to the pool.
                return Ok(None);
            }
            // Never back to the pool from here on.
            let mut conn = pooled.detach();
            let bumped: Result<(i64, i64), sqlx::Error> = sqlx::query_as(&format!(
                "INSERT INTO \"{t}\" (name, fence) VALUES ($1, 1) \
                 ON CONFLICT (name) DO UPDATE SET fence = \"{t}\".fence + 1 \
                 RETURNING fence, {PG_NOW_MS}",
                t = self.table
            ))
            .bind(name)
            .fetch_one(&mut conn)
            .await;
            let (fence, now) = match bumped {
                Ok(v) => v,
                Err(e) => {
                    // Closing the session frees the lock.
                    let _ = conn.close().await;
                    return Err(db_err(OP)(e));
                }
            };
            let fence = match fence_of(fence, OP) {
                Ok(f) => f,
                Err(e) => {
                    let _ = conn.close().await;
                    return Err(e);
                }
            };
            let lease = LockLease {
                name: name.to_owned(),
                owner: new_owner_token(),
                fence,
                until: millis(now.saturating_add(span_ms(ttl))),
            };
            let held = Arc::new(Held {
                name: lease.name.clone(),
                fence: lease.fence,
                key,
                pid,
                conn: Mutex::new(Some(conn)),
            });
            Ok(Some((lease, held)))
        }
    }

    /// Whether a failed call on the holding session means the session is
    /// gone (so is the lock): I/O, protocol, a closed connection, or
    /// SQLSTATE class 57 (operator intervention: terminated, shutdown).
    fn session_gone(e: &sqlx::Error) -> bool {
        match e {
            sqlx::Error::Io(_) | sqlx::Error::Protocol(_) | sqlx::Error::WorkerCrashed => true,
            // SQLSTATE class 57.
            sqlx::Error::Database(_) => matches!(
                error_kind(e),
                Some(ErrorKind::StatementTimeout | ErrorKind::OperatorIntervention)
            ),
            _ => false,
        }
    }

    #[async_trait]
    impl LockBackend for PgAdvisoryLockBackend {
        async fn try_acquire(&self, name: &str, ttl: Duration) -> Result<TryAcquire, LockError> {
            // Spawned so a caller that drops this future mid-way can never
            // leave a granted session behind: if nobody takes the answer,
            // the task releases it.
            let (tx, rx) = oneshot::channel();
            let this = self.clone();
            let name = name.to_owned();
            tokio::spawn(async move {
                let answer = match this.grant(&name, ttl).await {
                    Ok(Some((lease, held))) => {
                        this.held().insert(lease.owner.clone(), held);
                        Ok(TryAcquire::Acquired(lease))
                    }
                    Ok(None) => Ok(TryAcquire::Busy {
                        retry_after: Self::busy_hint(ttl),
                    }),
                    Err(e) => Err(e),
                };
                if let Err(Ok(TryAcquire::Acquired(lease))) = tx.send(answer) {
                    let _ = this.release(&lease).await;
                }
            });
            rx.await.map_err(|_| {
                LockError::unavailable(LockOp::Acquire, "the acquire task ended without an answer")
            })?
        }

        async fn extend(
            &self,
            lease: &LockLease,
            ttl: Duration,
        ) -> Result<Option<LockLease>, LockError> {
            let Some(held) = self.lookup(lease) else {
                return Ok(None);
            };
            let this = self.clone();
            let lease = lease.clone();
            // Spawned so a renewal cut short by a timeout never leaves the
            // session's connection mid-query.
            let task = tokio::spawn(async move {
                let mut slot = held.conn.lock().await;
                let Some(conn) = slot.as_mut() else {
                    return Ok(None);
                };
                let hi = (held.key >> 32) & 0xffff_ffff;
                let lo = held.key & 0xffff_ffff;
                let r: Result<(bool, i64), sqlx::Error> = sqlx::query_as(&format!(
                    "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' \
                       AND pid = pg_backend_pid() AND granted AND objsubid = 1 \
                       AND classid = ($1::bigint)::oid AND objid = ($2::bigint)::oid), {PG_NOW_MS}"
                ))
                .bind(hi)
                .bind(lo)
                .fetch_one(&mut *conn)
                .await;
                match r {
                    Ok((true, now)) => Ok(Some(LockLease {
                        until: millis(now.saturating_add(span_ms(ttl))),
                        ..lease
                    })),
                    Ok((false, _)) | Err(_) => {
                        if let Err(e) = &r {
                            tracing::warn!(name = %lease.name, error = %e,
                                "the session holding an advisory lock failed; closing it");
                        }
                        // Whatever happened, this session no longer
                        // (provably) holds the lock: close it, which frees
                        // the lock if it still did.
                        if let Some(conn) = slot.take() {
                            let _ = conn.close().await;
                        }
                        this.take(&lease);
                        Ok(None)
                    }
                }
            });
            task.await
                .map_err(|e| LockError::unavailable(LockOp::Extend, e))?
        }

        async fn release(&self, lease: &LockLease) -> Result<bool, LockError> {
            let Some(held) = self.take(lease) else {
                return Ok(false);
            };
            let task = tokio::spawn(async move {
                let mut slot = held.conn.lock().await;
                let Some(conn) = slot.as_mut() else {
                    return Ok(false);
                };
                let r: Result<bool, sqlx::Error> =
                    sqlx::query_scalar("SELECT pg_advisory_unlock($1)")
                        .bind(held.key)
                        .fetch_one(&mut *conn)
                        .await;
                let conn = slot.take();
                drop(slot);
                if let Some(conn) = conn {
                    // Unlocked or not, the session ends here: a session
                    // never returns to the pool.
                    let _ = conn.close().await;
                }
                match r {
                    Ok(unlocked) => Ok(unlocked),
                    Err(e) if session_gone(&e) => Ok(false),
                    Err(e) => Err(db_err(LockOp::Release)(e)),
                }
            });
            task.await
                .map_err(|e| LockError::unavailable(LockOp::Release, e))?
        }

        fn session_scoped(&self) -> bool {
            true
        }
    }
}
