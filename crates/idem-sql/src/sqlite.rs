//! The SQLite store: one file, WAL, `synchronous = FULL`, every step one
//! atomic statement or one `BEGIN IMMEDIATE` transaction.

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use idem_core::admin::{ListPage, ListQuery};
use idem_core::{
    duration_ms, Begin, BeginRequest, Clock, HoldReason, IdempotencyKey, KeyAdmin, Lease, Phase,
    Record, Scope, SharedClock, Store, StoreError, StoredResponse, SystemClock,
};
use sqlx::migrate::{MigrateError, Migrator};
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous,
};
use sqlx::SqliteConnection;

use crate::common::{
    in_batches, lease_kept, list, millis, poll_while_claimed, retry, to_i64, RawRecord,
    IN_PROGRESS, PURGE_BATCH,
};
use crate::dialect::Dialect;

/// The embedded schema migrations (`migrations/sqlite` in this crate).
static MIGRATOR: Migrator = sqlx::migrate!("migrations/sqlite");

/// Settings of a [`SqliteStore`] opened with [`SqliteStore::open_with`].
///
/// ```
/// use std::time::Duration;
/// use idem_sql::SqliteOptions;
/// let opts = SqliteOptions::default()
///     .with_busy_timeout(Duration::from_secs(10))
///     .with_max_connections(8);
/// assert_eq!(opts.busy_timeout, Duration::from_secs(10));
/// ```
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct SqliteOptions {
    /// How long a statement waits for another connection or process that
    /// holds the write lock before failing with `SQLITE_BUSY`
    /// (reported as [`StoreError::Unavailable`]). Default 5 s.
    pub busy_timeout: Duration,
    /// Most connections in the pool (default 4, at least 1). An in-memory
    /// database always uses exactly one.
    pub max_connections: u32,
    /// How long a call waits for a free pooled connection before failing
    /// with [`StoreError::Unavailable`]. Default 10 s.
    pub acquire_timeout: Duration,
    /// How often [`Store::wait_for_change`] polls the record (default 25 ms).
    pub poll_interval: Duration,
}

impl Default for SqliteOptions {
    fn default() -> Self {
        Self {
            busy_timeout: Duration::from_secs(5),
            max_connections: 4,
            acquire_timeout: Duration::from_secs(10),
            poll_interval: Duration::from_millis(25),
        }
    }
}

impl SqliteOptions {
    /// Sets [`Self::busy_timeout`].
    pub fn with_busy_timeout(mut self, d: Duration) -> Self {
        self.busy_timeout = d;
        self
    }

    crate::common::option_setters!(max_connections, acquire_timeout, poll_interval);
}

/// A [`Store`] in one SQLite file: durable, and safe to share between
/// several processes on one machine (not over a network file system: WAL
/// needs shared memory).
///
/// # Durability and locking
/// - `journal_mode = WAL`, `synchronous = FULL`: a step that returned is on
///   disk, also after a power loss (`NORMAL` may lose the last commits on
///   power loss, which could let a completed payment run again).
/// - `begin` reads first without the write lock; a live record is answered
///   from that one consistent read. Otherwise it claims the key inside a
///   `BEGIN IMMEDIATE` transaction (the write lock is taken before the
///   re-read, so two processes can never both read "free" and both claim).
///   `complete`, `release`, `extend`, `hold` and `delete` are single conditional
///   statements (`UPDATE … WHERE fence = ?`), atomic on their own. A held
///   key is an in-progress row whose `response` column holds the hold
///   reason's name (`NULL` while the claim runs; the migration's columns
///   are unchanged).
/// - A busy database is waited for up to [`SqliteOptions::busy_timeout`]
///   (default 5 s); after that the call fails with
///   [`StoreError::Unavailable`] and has written nothing.
///
/// # Time
/// Lease ends and expiry are milliseconds since the Unix epoch from the
/// store's [`Clock`] (default [`SystemClock`]; [`Self::with_clock`] injects a
/// [`idem_core::ManualClock`] in tests), bound as parameters. Processes
/// sharing a file share the machine's clock.
///
/// # Fences
/// A new claim's fence is `max(last + 1, now_ms × 1000)`, where `last` is the
/// highest fence this database ever granted (kept in the `idem_fence`
/// table, updated in the claiming transaction). Fences therefore strictly
/// grow across release, expiry, purge and delete, and stay above those of
/// an older copy of the database while the clock moves forward.
///
/// # Schema
/// Tables `idem_records` and `idem_fence`, created by embedded migrations
/// (recorded in sqlx's `_sqlx_migrations`). Use a file of its own: sqlx
/// migrations of another application in the same file would see ours as
/// unknown.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), idem_core::StoreError> {
/// use idem_sql::SqliteStore;
/// let dir = std::env::temp_dir().join(format!("idem-doc-{}", std::process::id()));
/// std::fs::create_dir_all(&dir).unwrap();
/// let store = SqliteStore::open(dir.join("idem.db").to_str().unwrap()).await?;
/// # store.close().await;
/// # std::fs::remove_dir_all(&dir).ok();
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct SqliteStore {
    pool: SqlitePool,
    clock: SharedClock,
    /// Serialises this process's write steps, so they queue here instead of
    /// in SQLite's busy handler (which sleeps between retries). Other
    /// processes are still excluded by SQLite's own lock.
    write_lock: Arc<tokio::sync::Mutex<()>>,
    poll_interval: Duration,
}

impl SqliteStore {
    /// Opens (creating it if missing) and migrates the database at
    /// `path_or_url`, with [`SqliteOptions::default`].
    ///
    /// Accepted forms: `sqlite://idem.db` (relative), `sqlite:///abs/idem.db`,
    /// `sqlite::memory:` (one private in-memory database, for tests), with
    /// optional sqlx query parameters, or a plain file path.
    ///
    /// # Errors
    /// [`StoreError::Config`] for an empty path or a URL of another scheme;
    /// [`StoreError::Unavailable`] (phase `Connect`) when the file cannot be
    /// opened or created, or the migrations fail.
    pub async fn open(path_or_url: &str) -> Result<Self, StoreError> {
        Self::open_with(path_or_url, SqliteOptions::default()).await
    }

    /// Like [`Self::open`], with explicit settings.
    ///
    /// # Errors
    /// As for [`Self::open`].
    pub async fn open_with(path_or_url: &str, options: SqliteOptions) -> Result<Self, StoreError> {
        let (connect, in_memory) = connect_options(path_or_url)?;
        if !in_memory {
            // "Created if missing" covers the folders too: a fresh
            // `sqlite://data/idem.db` should not fail on a missing `data/`.
            if let Some(dir) = connect.get_filename().parent() {
                if !dir.as_os_str().is_empty() {
                    std::fs::create_dir_all(dir)
                        .map_err(|e| StoreError::unavailable(Phase::Connect, e))?;
                }
            }
        }
        let connect = connect
            .create_if_missing(true)
            .journal_mode(if in_memory {
                SqliteJournalMode::Memory
            } else {
                SqliteJournalMode::Wal
            })
            .synchronous(SqliteSynchronous::Full)
            .busy_timeout(options.busy_timeout);
        let mut pool = SqlitePoolOptions::new().acquire_timeout(options.acquire_timeout);
        pool = if in_memory {
            // The database lives as long as its one connection.
            pool.max_connections(1)
                .min_connections(1)
                .idle_timeout(None)
                .max_lifetime(None)
        } else {
            pool.max_connections(options.max_connections.max(1))
        };
        let pool = pool
            .connect_with(connect)
            .await
            .map_err(|e| StoreError::unavailable(Phase::Connect, e))?;
        let mut store = Self::from_pool(pool).await?;
        store.poll_interval = options.poll_interval.max(Duration::from_millis(1));
        Ok(store)
    }

    /// Uses an existing pool and runs the migrations on it. The pool's
    /// connect options are the caller's: set WAL, `synchronous = FULL` and a
    /// busy timeout as [`Self::open`] does.
    ///
    /// # Errors
    /// [`StoreError::Unavailable`] (phase `Connect`) when the migrations fail.
    pub async fn from_pool(pool: SqlitePool) -> Result<Self, StoreError> {
        migrate(&pool).await?;
        Ok(Self {
            pool,
            clock: Arc::new(SystemClock),
            write_lock: Arc::new(tokio::sync::Mutex::new(())),
            poll_interval: SqliteOptions::default().poll_interval,
        })
    }

    /// Uses `clock` for lease ends and expiry (a [`idem_core::ManualClock`]
    /// in tests). Every store sharing a file must agree on the time.
    pub fn with_clock(mut self, clock: impl Clock) -> Self {
        self.clock = Arc::new(clock);
        self
    }

    /// The connection pool (for operators' queries and tests).
    pub fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    /// Closes every connection; calls made afterwards fail with
    /// [`StoreError::Unavailable`].
    pub async fn close(&self) {
        self.pool.close().await;
    }

    fn now(&self) -> i64 {
        to_i64(self.clock.now().0)
    }
}

/// Parses a SQLite URL or a plain path; tells whether it names an in-memory database.
fn connect_options(path_or_url: &str) -> Result<(SqliteConnectOptions, bool), StoreError> {
    let s = path_or_url.trim();
    if let Some(rest) = s.strip_prefix("sqlite:") {
        let db = rest.strip_prefix("//").unwrap_or(rest);
        let db_part = db.split('?').next().unwrap_or_default();
        let in_memory = db_part == ":memory:" || db.contains("mode=memory");
        if db_part.is_empty() && !in_memory {
            return Err(StoreError::Config(format!(
                "SQLite URL {path_or_url:?} names no file (try sqlite://idem.db)"
            )));
        }
        let opts = SqliteConnectOptions::from_str(s)
            .map_err(|e| StoreError::Config(format!("bad SQLite URL {path_or_url:?}: {e}")))?;
        return Ok((opts, in_memory));
    }
    if s.is_empty() {
        return Err(StoreError::Config("empty SQLite path".into()));
    }
    if s.contains("://") {
        return Err(StoreError::Config(format!(
            "{path_or_url:?} is neither a sqlite: URL nor a file path"
        )));
    }
    if s == ":memory:" {
        return connect_options("sqlite::memory:");
    }
    Ok((SqliteConnectOptions::new().filename(s), false))
}

/// Runs the embedded migrations. Several processes may open a new file at
/// once; SQLite migrations take no lock, so a loser of that race retries
/// (the migration is idempotent and then found applied): at most 6
/// attempts, pausing 25 ms × 2ⁿ (jittered) in between.
async fn migrate(pool: &SqlitePool) -> Result<(), StoreError> {
    retry(
        6,
        Duration::from_millis(25),
        || MIGRATOR.run(pool),
        |e| {
            matches!(
                e,
                MigrateError::Execute(_) | MigrateError::ExecuteMigration(..)
            )
        },
    )
    .await
    .map_err(|e| StoreError::unavailable(Phase::Connect, e))
}

fn unavailable(phase: Phase) -> impl FnOnce(sqlx::Error) -> StoreError {
    move |e| StoreError::unavailable(phase, e)
}

const SELECT_RECORD: &str = "SELECT fingerprint, state, fence, deadline, response \
     FROM idem_records WHERE scope = ?1 AND key = ?2";

async fn read_record(
    conn: &mut SqliteConnection,
    scope: &Scope,
    key: &IdempotencyKey,
    phase: Phase,
) -> Result<Option<RawRecord>, StoreError> {
    sqlx::query(SELECT_RECORD)
        .bind(scope.as_str())
        .bind(key.as_str())
        .fetch_optional(&mut *conn)
        .await
        .map_err(unavailable(phase))?
        .map(|r| RawRecord::from_row::<_, i64>(&r, phase))
        .transpose()
}

impl SqliteStore {
    async fn read_pooled(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        phase: Phase,
    ) -> Result<Option<RawRecord>, StoreError> {
        let mut conn = self.pool.acquire().await.map_err(unavailable(phase))?;
        read_record(&mut conn, scope, key, phase).await
    }
}

impl SqliteStore {
    /// Step 2 of `begin`: claims the key inside `BEGIN IMMEDIATE` on `conn`.
    async fn claim(
        &self,
        conn: &mut sqlx::SqliteConnection,
        req: &BeginRequest,
    ) -> Result<Begin, StoreError> {
        const P: Phase = Phase::Begin;
        let mut tx = sqlx::Connection::begin_with(conn, "BEGIN IMMEDIATE")
            .await
            .map_err(unavailable(P))?;
        // Read the time once the lock is held, so waiting for it does not
        // shorten the new lease.
        let now = self.now();
        // An ended claim (in progress past its lease) of this same request
        // is taken over; an ended result is simply replaced.
        let mut took_over = false;
        if let Some(row) = read_record(&mut tx, &req.scope, &req.key, P).await? {
            if row.decides(req, now, P)? {
                let answer = row.answer(req, now, P);
                tx.rollback().await.map_err(unavailable(P))?;
                return answer;
            }
            took_over = row.state == IN_PROGRESS;
        }
        let fence: i64 = sqlx::query_scalar(
            "INSERT INTO idem_fence (id, last) VALUES (1, ?1) \
             ON CONFLICT (id) DO UPDATE SET last = max(last + 1, excluded.last) \
             RETURNING last",
        )
        .bind(now.saturating_mul(1000))
        .fetch_one(&mut *tx)
        .await
        .map_err(unavailable(P))?;
        let fence = u64::try_from(fence)
            .map_err(|_| StoreError::corrupt(P, format!("negative fence counter {fence}")))?;
        let until = now.saturating_add(to_i64(duration_ms(req.lease)));
        sqlx::query(
            "INSERT INTO idem_records (scope, key, fingerprint, state, fence, deadline, response) \
             VALUES (?1, ?2, ?3, 0, ?4, ?5, NULL) \
             ON CONFLICT (scope, key) DO UPDATE SET fingerprint = excluded.fingerprint, \
             state = 0, fence = excluded.fence, deadline = excluded.deadline, response = NULL",
        )
        .bind(req.scope.as_str())
        .bind(req.key.as_str())
        .bind(req.fingerprint.as_bytes().as_slice())
        .bind(to_i64(fence))
        .bind(until)
        .execute(&mut *tx)
        .await
        .map_err(unavailable(P))?;
        tx.commit().await.map_err(unavailable(P))?;
        Ok(Begin::Acquired(Lease {
            scope: req.scope.clone(),
            key: req.key.clone(),
            fence,
            until: millis(until),
            took_over,
        }))
    }
}

#[async_trait]
impl Store for SqliteStore {
    async fn begin(&self, req: &BeginRequest) -> Result<Begin, StoreError> {
        const P: Phase = Phase::Begin;
        // 1. One read, no write lock: a live record answers from it.
        if let Some(row) = self.read_pooled(&req.scope, &req.key, P).await? {
            let now = self.now();
            if row.decides(req, now, P)? {
                return row.answer(req, now, P);
            }
        }
        // 2. Absent or expired: claim under the write lock, re-reading first.
        let _local = self.write_lock.lock().await;
        let mut conn = self.pool.acquire().await.map_err(unavailable(P))?;
        let claimed = self.claim(&mut conn, req).await;
        if matches!(claimed, Err(StoreError::Unavailable { .. })) {
            // A statement or COMMIT that failed (disk full, read-only file,
            // I/O error) can end the transaction inside SQLite while sqlx
            // still counts it open; the pool would hand that connection out
            // again and every later claim would fail with "begin_with at
            // non-zero transaction depth" until a restart. Close it instead
            // (not for a corrupt record: the transaction ended cleanly, and
            // an in-memory database lives only as long as its connection).
            conn.close_on_drop();
        }
        claimed
    }

    async fn complete(
        &self,
        lease: &Lease,
        response: &StoredResponse,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        const P: Phase = Phase::Complete;
        let blob = response.encode();
        let _local = self.write_lock.lock().await;
        let expires = self.now().saturating_add(to_i64(duration_ms(ttl)));
        let done = sqlx::query(
            "UPDATE idem_records SET state = 1, deadline = ?1, response = ?2 \
             WHERE scope = ?3 AND key = ?4 AND state = 0 AND fence = ?5",
        )
        .bind(expires)
        .bind(blob)
        .bind(lease.scope.as_str())
        .bind(lease.key.as_str())
        .bind(to_i64(lease.fence))
        .execute(&self.pool)
        .await
        .map_err(unavailable(P))?;
        lease_kept(done.rows_affected() == 1, lease)
    }

    async fn release(&self, lease: &Lease) -> Result<(), StoreError> {
        let _local = self.write_lock.lock().await;
        let done = sqlx::query(
            "DELETE FROM idem_records WHERE scope = ?1 AND key = ?2 AND state = 0 AND fence = ?3",
        )
        .bind(lease.scope.as_str())
        .bind(lease.key.as_str())
        .bind(to_i64(lease.fence))
        .execute(&self.pool)
        .await
        .map_err(unavailable(Phase::Release))?;
        lease_kept(done.rows_affected() == 1, lease)
    }

    async fn extend(&self, lease: &Lease, lease_for: Duration) -> Result<Lease, StoreError> {
        let _local = self.write_lock.lock().await;
        let until = self.now().saturating_add(to_i64(duration_ms(lease_for)));
        let done = sqlx::query(
            "UPDATE idem_records SET deadline = ?1 \
             WHERE scope = ?2 AND key = ?3 AND state = 0 AND fence = ?4",
        )
        .bind(until)
        .bind(lease.scope.as_str())
        .bind(lease.key.as_str())
        .bind(to_i64(lease.fence))
        .execute(&self.pool)
        .await
        .map_err(unavailable(Phase::Extend))?;
        lease_kept(done.rows_affected() == 1, lease)?;
        Ok(Lease {
            until: millis(until),
            ..lease.clone()
        })
    }

    async fn hold(
        &self,
        lease: &Lease,
        reason: HoldReason,
        hold_for: Duration,
    ) -> Result<Lease, StoreError> {
        let _local = self.write_lock.lock().await;
        let at_least = self.now().saturating_add(to_i64(duration_ms(hold_for)));
        let row = sqlx::query(
            "UPDATE idem_records SET deadline = MAX(deadline, ?1), response = ?2 \
             WHERE scope = ?3 AND key = ?4 AND state = 0 AND fence = ?5 \
             RETURNING deadline",
        )
        .bind(at_least)
        .bind(reason.as_str().as_bytes())
        .bind(lease.scope.as_str())
        .bind(lease.key.as_str())
        .bind(to_i64(lease.fence))
        .fetch_optional(&self.pool)
        .await
        .map_err(unavailable(Phase::Hold))?;
        let Some(row) = row else {
            return Err(StoreError::LeaseLost { fence: lease.fence });
        };
        let until: i64 = sqlx::Row::try_get(&row, "deadline")
            .map_err(|e| StoreError::corrupt(Phase::Hold, e.to_string()))?;
        Ok(Lease {
            until: millis(until),
            ..lease.clone()
        })
    }

    async fn get(&self, scope: &Scope, key: &IdempotencyKey) -> Result<Option<Record>, StoreError> {
        const P: Phase = Phase::Get;
        let Some(row) = self.read_pooled(scope, key, P).await? else {
            return Ok(None);
        };
        if !row.is_live(self.now()) {
            return Ok(None);
        }
        row.to_record(P).map(Some)
    }

    async fn delete(&self, scope: &Scope, key: &IdempotencyKey) -> Result<bool, StoreError> {
        let _local = self.write_lock.lock().await;
        let done = sqlx::query("DELETE FROM idem_records WHERE scope = ?1 AND key = ?2")
            .bind(scope.as_str())
            .bind(key.as_str())
            .execute(&self.pool)
            .await
            .map_err(unavailable(Phase::Delete))?;
        Ok(done.rows_affected() > 0)
    }

    async fn purge_expired(&self) -> Result<u64, StoreError> {
        in_batches(PURGE_BATCH, || async {
            let _local = self.write_lock.lock().await;
            let done = sqlx::query(
                "DELETE FROM idem_records WHERE (scope, key) IN \
                 (SELECT scope, key FROM idem_records WHERE deadline <= ?1 LIMIT ?2)",
            )
            .bind(self.now())
            .bind(PURGE_BATCH)
            .execute(&self.pool)
            .await
            .map_err(unavailable(Phase::Purge))?;
            Ok(done.rows_affected())
        })
        .await
    }

    /// Polls the record every [`SqliteOptions::poll_interval`] (default
    /// 25 ms) until it is no longer the same live claim (completed,
    /// released, taken over, or past its lease), or `max` has passed.
    async fn wait_for_change(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        max: Duration,
    ) -> Result<(), StoreError> {
        const P: Phase = Phase::Get;
        let deadline = crate::common::instant_after(tokio::time::Instant::now(), max);
        let claim = |row: Option<RawRecord>, now: i64| {
            row.and_then(|r| r.live_claim(now)).map(|(fence, _)| fence)
        };
        let Some(fence) = claim(self.read_pooled(scope, key, P).await?, self.now()) else {
            return Ok(());
        };
        poll_while_claimed(deadline, self.poll_interval, fence, || async {
            Ok(claim(self.read_pooled(scope, key, P).await?, self.now()))
        })
        .await
    }

    fn admin(&self) -> Option<&dyn KeyAdmin> {
        Some(self)
    }
}

/// The records table, as the listing names it.
const RECORDS: &str = "\"idem_records\"";

/// Listing: one `SELECT … ORDER BY fence DESC LIMIT n` per page, newest
/// claim first (see the crate's `docs/STORES.md`). Without a scope filter
/// SQLite walks the table and keeps the newest `n + 1` rows (cost grows
/// with the table, memory with the page); with one it walks only that
/// scope's rows (the primary key starts with the scope). The read takes no
/// write lock and sees one snapshot; time is the store's clock, as for `get`.
#[async_trait]
impl KeyAdmin for SqliteStore {
    async fn list(&self, query: &ListQuery) -> Result<ListPage, StoreError> {
        const P: Phase = Phase::List;
        const D: Dialect = Dialect::Sqlite;
        let st = list::statement(D, RECORDS, true, query)?;
        let mut conn = self.pool.acquire().await.map_err(unavailable(P))?;
        let rows = list::bind(D, &st, Some(self.now()), sqlx::query(&st.sql))
            .fetch_all(&mut *conn)
            .await
            .map_err(unavailable(P))?;
        list::page::<_, i64>(RECORDS, query, &rows)
    }

    /// Newest claim first (by fence), in every state.
    fn newest_first(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn url_forms() {
        assert!(connect_options("sqlite::memory:").expect("memory").1);
        assert!(connect_options(":memory:").expect("memory").1);
        assert!(connect_options("sqlite://:memory:").expect("memory").1);
        let (o, mem) = connect_options("sqlite://idem.db").expect("relative");
        assert!(!mem);
        assert_eq!(o.get_filename(), std::path::Path::new("idem.db"));
        let (o, _) = connect_options("sqlite:///var/lib/idem/idem.db").expect("absolute");
        assert_eq!(
            o.get_filename(),
            std::path::Path::new("/var/lib/idem/idem.db")
        );
        let (o, _) = connect_options("/tmp/with ? mark.db").expect("plain path");
        assert_eq!(
            o.get_filename(),
            std::path::Path::new("/tmp/with ? mark.db")
        );
        for bad in [
            "",
            "  ",
            "sqlite://",
            "sqlite:",
            "postgres://localhost/idem",
            "memory://",
        ] {
            assert!(
                matches!(connect_options(bad), Err(StoreError::Config(_))),
                "{bad:?} must be a config error"
            );
        }
    }
}
