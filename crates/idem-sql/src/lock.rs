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
use idem_core::Millis;
use sqlx::Row;

/// Default table of [`LeaseLockBackend`].
pub const DEFAULT_LOCK_TABLE: &str = "idem_locks";
/// Default fence counter table of [`PgAdvisoryLockBackend`].
pub const DEFAULT_FENCE_TABLE: &str = "idem_lock_fences";
/// Longest table name accepted (PostgreSQL keeps 63 bytes; a little room
/// is left for derived names).
pub const MAX_LOCK_TABLE_LEN: usize = 54;

/// SQLite: ms since the epoch, constant within one statement.
const SQLITE_NOW_MS: &str = "CAST((julianday('now') - 2440587.5) * 86400000.0 AS INTEGER)";
/// PostgreSQL: ms since the epoch when the expression is evaluated.
#[cfg(feature = "postgres")]
const PG_NOW_MS: &str = "floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint";
/// MySQL / MariaDB: ms since the epoch, independent of the session's time
/// zone, constant within one statement.
#[cfg(feature = "mysql")]
const MY_NOW_MS: &str =
    "CAST(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) DIV 1000 AS SIGNED)";

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
    let mut chars = name.chars();
    let first = chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_');
    if first
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
        && name.len() <= MAX_LOCK_TABLE_LEN
    {
        Ok(())
    } else {
        Err(LockError::Config(format!(
            "lock table name {name:?} is not a plain identifier: use 1 to \
             {MAX_LOCK_TABLE_LEN} characters of [A-Za-z0-9_], not starting with a digit"
        )))
    }
}

fn ttl_ms(ttl: Duration) -> i64 {
    // 30 days at most by `idem_core::lock::validate_ttl`; capped anyway.
    i64::try_from(idem_core::duration_ms(ttl))
        .unwrap_or(i64::MAX)
        .min(1_000_000_000_000_000)
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

fn millis(v: i64) -> Millis {
    Millis(u64::try_from(v).unwrap_or(0))
}

fn retry_after(left_ms: Option<i64>) -> Duration {
    Duration::from_millis(u64::try_from(left_ms.unwrap_or(1)).unwrap_or(1).max(1))
}

#[derive(Debug, Clone)]
enum Db {
    Sqlite(sqlx::SqlitePool),
    #[cfg(feature = "postgres")]
    Postgres(sqlx::PgPool),
    #[cfg(feature = "mysql")]
    MySql(sqlx::MySqlPool),
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
}

impl LeaseLockBackend {
    fn with_db(db: Db) -> Self {
        Self {
            db,
            table: DEFAULT_LOCK_TABLE.to_owned(),
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
        const OP: LockOp = LockOp::Connect;
        let t = &self.table;
        match &self.db {
            Db::Sqlite(pool) => {
                sqlx::query(&format!(
                    "CREATE TABLE IF NOT EXISTS \"{t}\" (name TEXT NOT NULL PRIMARY KEY, \
                     owner TEXT NULL, fence INTEGER NOT NULL, until_ms INTEGER NOT NULL)"
                ))
                .execute(pool)
                .await
                .map_err(db_err(OP))?;
            }
            #[cfg(feature = "postgres")]
            Db::Postgres(pool) => {
                let r = sqlx::query(&format!(
                    "CREATE TABLE IF NOT EXISTS \"{t}\" (name TEXT NOT NULL PRIMARY KEY, \
                     owner TEXT NULL, fence BIGINT NOT NULL, until_ms BIGINT NOT NULL)"
                ))
                .execute(pool)
                .await;
                pg_ignore_created_concurrently(r).map_err(db_err(OP))?;
            }
            #[cfg(feature = "mysql")]
            Db::MySql(pool) => {
                sqlx::query(&format!(
                    "CREATE TABLE IF NOT EXISTS `{t}` (name VARBINARY(255) NOT NULL PRIMARY KEY, \
                     owner VARBINARY(64) NULL, fence BIGINT NOT NULL, until_ms BIGINT NOT NULL) \
                     ENGINE=InnoDB"
                ))
                .execute(pool)
                .await
                .map_err(db_err(OP))?;
            }
        }
        Ok(())
    }
}

/// `CREATE TABLE IF NOT EXISTS` racing with itself on PostgreSQL can fail
/// with unique_violation (23505) on the catalog or duplicate_table (42P07):
/// the table exists then.
#[cfg(feature = "postgres")]
fn pg_ignore_created_concurrently(
    r: Result<sqlx::postgres::PgQueryResult, sqlx::Error>,
) -> Result<(), sqlx::Error> {
    match r {
        Ok(_) => Ok(()),
        Err(sqlx::Error::Database(db))
            if matches!(db.code().as_deref(), Some("23505") | Some("42P07")) =>
        {
            Ok(())
        }
        Err(e) => Err(e),
    }
}

#[async_trait]
impl LockBackend for LeaseLockBackend {
    async fn try_acquire(&self, name: &str, ttl: Duration) -> Result<TryAcquire, LockError> {
        let owner = new_owner_token();
        let ttl = ttl_ms(ttl);
        let t = &self.table;
        let granted: Option<(i64, i64)>;
        let left: Option<i64>;
        match &self.db {
            Db::Sqlite(pool) => {
                let row = sqlx::query(&format!(
                    "INSERT INTO \"{t}\" (name, owner, fence, until_ms) \
                     VALUES (?1, ?2, 1, {SQLITE_NOW_MS} + ?3) \
                     ON CONFLICT (name) DO UPDATE SET owner = excluded.owner, \
                       fence = \"{t}\".fence + 1, until_ms = excluded.until_ms \
                     WHERE \"{t}\".until_ms <= {SQLITE_NOW_MS} \
                     RETURNING fence, until_ms"
                ))
                .bind(name)
                .bind(&owner)
                .bind(ttl)
                .fetch_optional(pool)
                .await
                .map_err(db_err(LockOp::Acquire))?;
                granted = row
                    .map(|r| Ok((r.try_get(0)?, r.try_get(1)?)))
                    .transpose()
                    .map_err(db_err(LockOp::Acquire))?;
                left = if granted.is_none() {
                    sqlx::query_scalar(&format!(
                        "SELECT until_ms - {SQLITE_NOW_MS} FROM \"{t}\" WHERE name = ?1"
                    ))
                    .bind(name)
                    .fetch_optional(pool)
                    .await
                    .map_err(db_err(LockOp::Acquire))?
                } else {
                    None
                };
            }
            #[cfg(feature = "postgres")]
            Db::Postgres(pool) => {
                let row = sqlx::query(&format!(
                    "INSERT INTO \"{t}\" (name, owner, fence, until_ms) \
                     VALUES ($1, $2, 1, {PG_NOW_MS} + $3) \
                     ON CONFLICT (name) DO UPDATE SET owner = EXCLUDED.owner, \
                       fence = \"{t}\".fence + 1, until_ms = EXCLUDED.until_ms \
                     WHERE \"{t}\".until_ms <= {PG_NOW_MS} \
                     RETURNING fence, until_ms"
                ))
                .bind(name)
                .bind(&owner)
                .bind(ttl)
                .fetch_optional(pool)
                .await
                .map_err(db_err(LockOp::Acquire))?;
                granted = row
                    .map(|r| Ok((r.try_get(0)?, r.try_get(1)?)))
                    .transpose()
                    .map_err(db_err(LockOp::Acquire))?;
                left = if granted.is_none() {
                    sqlx::query_scalar(&format!(
                        "SELECT until_ms - {PG_NOW_MS} FROM \"{t}\" WHERE name = $1"
                    ))
                    .bind(name)
                    .fetch_optional(pool)
                    .await
                    .map_err(db_err(LockOp::Acquire))?
                } else {
                    None
                };
            }
            #[cfg(feature = "mysql")]
            Db::MySql(pool) => {
                // Assignments in ON DUPLICATE KEY UPDATE run left to right
                // and see earlier ones, so `until_ms` (the condition) is
                // assigned last. The read-back in the same transaction sees
                // the row as this statement left it (its row lock is held).
                let upsert = format!(
                    "INSERT INTO `{t}` (name, owner, fence, until_ms) \
                     VALUES (?, ?, 1, {MY_NOW_MS} + ?) \
                     ON DUPLICATE KEY UPDATE \
                       owner = IF(until_ms <= {MY_NOW_MS}, VALUES(owner), owner), \
                       fence = IF(until_ms <= {MY_NOW_MS}, fence + 1, fence), \
                       until_ms = IF(until_ms <= {MY_NOW_MS}, VALUES(until_ms), until_ms)"
                );
                let read = format!(
                    "SELECT owner, fence, until_ms, until_ms - {MY_NOW_MS} FROM `{t}` WHERE name = ?"
                );
                let (row_owner, fence, until, left_ms): (Option<Vec<u8>>, i64, i64, i64) =
                    mysql_retrying(LockOp::Acquire, || async {
                        let mut tx = pool.begin().await?;
                        sqlx::query(&upsert)
                            .bind(name.as_bytes())
                            .bind(owner.as_bytes())
                            .bind(ttl)
                            .execute(&mut *tx)
                            .await?;
                        let r = sqlx::query_as(&read)
                            .bind(name.as_bytes())
                            .fetch_one(&mut *tx)
                            .await?;
                        tx.commit().await?;
                        Ok(r)
                    })
                    .await?;
                if row_owner.as_deref() == Some(owner.as_bytes()) {
                    granted = Some((fence, until));
                    left = None;
                } else {
                    granted = None;
                    left = Some(left_ms);
                }
            }
        }
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

    async fn extend(
        &self,
        lease: &LockLease,
        ttl: Duration,
    ) -> Result<Option<LockLease>, LockError> {
        const OP: LockOp = LockOp::Extend;
        let ttl = ttl_ms(ttl);
        let t = &self.table;
        let until: Option<i64> = match &self.db {
            Db::Sqlite(pool) => sqlx::query_scalar(&format!(
                "UPDATE \"{t}\" SET until_ms = {SQLITE_NOW_MS} + ?1 \
                 WHERE name = ?2 AND owner = ?3 AND until_ms > {SQLITE_NOW_MS} RETURNING until_ms"
            ))
            .bind(ttl)
            .bind(&lease.name)
            .bind(&lease.owner)
            .fetch_optional(pool)
            .await
            .map_err(db_err(OP))?,
            #[cfg(feature = "postgres")]
            Db::Postgres(pool) => sqlx::query_scalar(&format!(
                "UPDATE \"{t}\" SET until_ms = {PG_NOW_MS} + $1 \
                 WHERE name = $2 AND owner = $3 AND until_ms > {PG_NOW_MS} RETURNING until_ms"
            ))
            .bind(ttl)
            .bind(&lease.name)
            .bind(&lease.owner)
            .fetch_optional(pool)
            .await
            .map_err(db_err(OP))?,
            #[cfg(feature = "mysql")]
            Db::MySql(pool) => {
                // MySQL reports rows *changed*, and a renewal within the
                // same millisecond changes nothing: read the row back in the
                // same transaction instead.
                let update = format!(
                    "UPDATE `{t}` SET until_ms = {MY_NOW_MS} + ? \
                     WHERE name = ? AND owner = ? AND until_ms > {MY_NOW_MS}"
                );
                let read = format!(
                    "SELECT until_ms FROM `{t}` WHERE name = ? AND owner = ? AND until_ms > {MY_NOW_MS}"
                );
                mysql_retrying(OP, || async {
                    let mut tx = pool.begin().await?;
                    sqlx::query(&update)
                        .bind(ttl)
                        .bind(lease.name.as_bytes())
                        .bind(lease.owner.as_bytes())
                        .execute(&mut *tx)
                        .await?;
                    let r: Option<i64> = sqlx::query_scalar(&read)
                        .bind(lease.name.as_bytes())
                        .bind(lease.owner.as_bytes())
                        .fetch_optional(&mut *tx)
                        .await?;
                    tx.commit().await?;
                    Ok(r)
                })
                .await?
            }
        };
        Ok(until.map(|u| LockLease {
            until: millis(u),
            ..lease.clone()
        }))
    }

    async fn release(&self, lease: &LockLease) -> Result<bool, LockError> {
        const OP: LockOp = LockOp::Release;
        let t = &self.table;
        let affected = match &self.db {
            Db::Sqlite(pool) => sqlx::query(&format!(
                "UPDATE \"{t}\" SET owner = NULL, until_ms = 0 \
                 WHERE name = ?1 AND owner = ?2 AND until_ms > {SQLITE_NOW_MS}"
            ))
            .bind(&lease.name)
            .bind(&lease.owner)
            .execute(pool)
            .await
            .map_err(db_err(OP))?
            .rows_affected(),
            #[cfg(feature = "postgres")]
            Db::Postgres(pool) => sqlx::query(&format!(
                "UPDATE \"{t}\" SET owner = NULL, until_ms = 0 \
                 WHERE name = $1 AND owner = $2 AND until_ms > {PG_NOW_MS}"
            ))
            .bind(&lease.name)
            .bind(&lease.owner)
            .execute(pool)
            .await
            .map_err(db_err(OP))?
            .rows_affected(),
            #[cfg(feature = "mysql")]
            Db::MySql(pool) => {
                // `owner` changes from the token to NULL, so a match is
                // always a changed row.
                let sql = format!(
                    "UPDATE `{t}` SET owner = NULL, until_ms = 0 \
                     WHERE name = ? AND owner = ? AND until_ms > {MY_NOW_MS}"
                );
                mysql_retrying(OP, || async {
                    Ok(sqlx::query(&sql)
                        .bind(lease.name.as_bytes())
                        .bind(lease.owner.as_bytes())
                        .execute(pool)
                        .await?
                        .rows_affected())
                })
                .await?
            }
        };
        Ok(affected == 1)
    }
}

/// Runs a MySQL step, again after a deadlock (1213) or a lock wait timeout
/// (1205) — both roll the transaction back — up to [`MY_ATTEMPTS`] times.
#[cfg(feature = "mysql")]
async fn mysql_retrying<T, F, Fut>(op: LockOp, mut step: F) -> Result<T, LockError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, sqlx::Error>>,
{
    let mut attempt = 1u32;
    loop {
        match step().await {
            Ok(v) => return Ok(v),
            Err(sqlx::Error::Database(db))
                if attempt < MY_ATTEMPTS
                    && db
                        .try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
                        .is_some_and(|m| matches!(m.number(), 1213 | 1205)) =>
            {
                tracing::debug!(%op, attempt, "lock step rolled back by InnoDB; retrying");
                tokio::time::sleep(crate::common::backoff(attempt)).await;
                attempt += 1;
            }
            Err(e) => return Err(db_err(op)(e)),
        }
    }
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
        db_err, fence_of, millis, pg_ignore_created_concurrently, ttl_ms, validate_table,
        DEFAULT_FENCE_TABLE, PG_NOW_MS,
    };

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
            pg_ignore_created_concurrently(r).map_err(db_err(LockOp::Connect))
        }

        /// The advisory lock key of `name` (64-bit FNV-1a of the fence table's
        /// name, a zero byte and `name`), as `pg_locks` shows it split into
        /// `classid` (high 32 bits) and `objid` (low 32 bits).
        pub fn advisory_key(&self, name: &str) -> i64 {
            let mut h: u64 = 0xcbf2_9ce4_8422_2325;
            for b in self.table.bytes().chain([0u8]).chain(name.bytes()) {
                h ^= u64::from(b);
                h = h.wrapping_mul(0x0100_0000_01b3);
            }
            i64::from_ne_bytes(h.to_ne_bytes())
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
                until: millis(now.saturating_add(ttl_ms(ttl))),
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
            sqlx::Error::Database(db) => db.code().is_some_and(|c| c.starts_with("57")),
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
                        until: millis(now.saturating_add(ttl_ms(ttl))),
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
