//! The SQLite store: one file, WAL, `synchronous = FULL`; reads from a
//! pool of readers, write steps group-committed by one writer thread
//! ([`writer`]) in `BEGIN IMMEDIATE` transactions.

mod conn;
mod readers;
mod writer;

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use conn::Target;
use readers::Readers;
use writer::{Done, Op, Writer};

use async_trait::async_trait;
use idem_core::admin::{ListPage, ListQuery};
use idem_core::{
    Begin, BeginRequest, Clock, HoldReason, IdempotencyKey, KeyAdmin, Lease, Phase, Record, Scope,
    SharedClock, Store, StoreError, StoredResponse, SystemClock,
};
use sqlx::migrate::{MigrateError, Migrator};
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous,
};

use crate::common::{in_batches, list, poll_while_claimed, retry, to_i64, RawRecord, PURGE_BATCH};
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
    /// Reader threads, each with its own connection (default 4, 1 to 64),
    /// and the most connections of the sqlx pool ([`SqliteStore::pool`]:
    /// migrations, listings); the writer has one more of its own. An
    /// in-memory database's sqlx pool has one connection.
    pub max_connections: u32,
    /// Most write steps committed in one transaction by group commit
    /// (default 128, at least 1; 1 commits every step on its own, as one
    /// fsync each). See the type docs of [`SqliteStore`].
    pub max_batch: usize,
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
            max_batch: Self::DEFAULT_MAX_BATCH,
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

    /// Default of [`Self::max_batch`]: write steps per group commit.
    pub const DEFAULT_MAX_BATCH: usize = 128;

    /// Sets [`Self::max_batch`] (0 is taken as 1).
    pub fn with_max_batch(mut self, n: usize) -> Self {
        self.max_batch = n;
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
/// - **Group commit.** Every write step goes to one writer thread of this
///   store, which commits the steps queued by concurrent callers together,
///   up to [`SqliteOptions::max_batch`] (default 128) per `BEGIN IMMEDIATE
///   … COMMIT`: one fsync for the batch, each caller answered with its own
///   result only after that commit. The writer never waits to fill a
///   batch (an idle store commits a lone step at once); steps run in
///   arrival order, each seeing the ones before. A failed `COMMIT` fails
///   every step of its batch with nothing written; a failed statement rolls
///   the batch back and its steps are run again one by one.
/// - **Reads** (`get`, the first read of `begin`, `wait_for_change`) run on
///   [`SqliteOptions::max_connections`] reader threads, each with its own
///   connection; listings use the sqlx pool ([`Self::pool`]). Under WAL
///   they never wait for the writer.
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
    /// The sqlx pool: migrations, listings, and [`Self::pool`].
    pool: SqlitePool,
    /// Record reads, on reader threads with their own connections.
    readers: Readers,
    clock: SharedClock,
    /// This process's one writer: write steps queue here (and are
    /// committed in groups) instead of in SQLite's busy handler, which
    /// sleeps between retries. Other processes are still excluded by
    /// SQLite's own lock.
    writer: Writer,
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
        let connect = if in_memory {
            // A private database in SQLite's `memdb` VFS: named, so the
            // writer's own connection reaches the same database; kept alive
            // by the readers' one connection. No WAL in memory: the journal
            // is kept in memory too.
            SqliteConnectOptions::new()
                .filename(format!("/idem-memory-{:016x}", rand::random::<u64>()))
                .vfs("memdb")
                .journal_mode(SqliteJournalMode::Memory)
        } else {
            connect.journal_mode(SqliteJournalMode::Wal)
        };
        let connect = connect
            .create_if_missing(true)
            .synchronous(SqliteSynchronous::Full)
            .busy_timeout(options.busy_timeout);
        // A connection to a local file does not go stale: no ping before
        // each use (sqlx's default), which would double the driver round
        // trips of every read.
        let pool = SqlitePoolOptions::new()
            .acquire_timeout(options.acquire_timeout)
            .test_before_acquire(false);
        let pool = if in_memory {
            pool.max_connections(1)
                .min_connections(1)
                .idle_timeout(None)
                .max_lifetime(None)
        } else {
            pool.max_connections(options.max_connections.max(1))
        };
        let target = Target {
            path: connect.get_filename().to_path_buf(),
            vfs: in_memory.then_some("memdb"),
            busy_timeout: options.busy_timeout,
        };
        let readers = pool
            .connect_with(connect)
            .await
            .map_err(|e| StoreError::unavailable(Phase::Connect, e))?;
        migrate(&readers).await?;
        Self::new(
            readers,
            target,
            options.max_connections,
            options.max_batch,
            options.poll_interval.max(Duration::from_millis(1)),
        )
    }

    fn new(
        pool: SqlitePool,
        target: Target,
        readers: u32,
        max_batch: usize,
        poll_interval: Duration,
    ) -> Result<Self, StoreError> {
        let readers = usize::try_from(readers.clamp(1, 64)).unwrap_or(1);
        Ok(Self {
            readers: Readers::start(&target, readers)?,
            writer: Writer::start(target, max_batch)?,
            pool,
            clock: Arc::new(SystemClock),
            poll_interval,
        })
    }

    /// Uses an existing pool for reads and runs the migrations on it. The
    /// pool's connect options are the caller's: set WAL, `synchronous =
    /// FULL` and a busy timeout as [`Self::open`] does. The writer opens a
    /// connection of its own to the pool's file, with `synchronous = FULL`
    /// and the default busy timeout (5 s).
    ///
    /// # Errors
    /// [`StoreError::Config`] when the pool's database is not a file (a
    /// private in-memory database cannot be reached by the writer's
    /// connection: use [`Self::open`]`("sqlite::memory:")`);
    /// [`StoreError::Unavailable`] (phase `Connect`) when the migrations fail.
    pub async fn from_pool(pool: SqlitePool) -> Result<Self, StoreError> {
        let path = pool.connect_options().get_filename().to_path_buf();
        let name = path.to_string_lossy();
        if name.is_empty() || name == ":memory:" || name.starts_with("file:") {
            return Err(StoreError::Config(format!(
                "SqliteStore::from_pool needs a pool on a database file, not {name:?}"
            )));
        }
        migrate(&pool).await?;
        let defaults = SqliteOptions::default();
        let target = Target {
            path,
            vfs: None,
            busy_timeout: defaults.busy_timeout,
        };
        Self::new(
            pool,
            target,
            defaults.max_connections,
            defaults.max_batch,
            defaults.poll_interval,
        )
    }

    /// Uses `clock` for lease ends and expiry (a [`idem_core::ManualClock`]
    /// in tests). Every store sharing a file must agree on the time.
    pub fn with_clock(mut self, clock: impl Clock) -> Self {
        self.clock = Arc::new(clock);
        self
    }

    /// The readers' connection pool (for operators' queries and tests).
    pub fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    /// Closes every connection (the readers'; the writer's once the steps
    /// already queued are answered); calls made afterwards fail with
    /// [`StoreError::Unavailable`].
    pub async fn close(&self) {
        self.writer.close();
        self.readers.close();
        self.pool.close().await;
    }

    fn now(&self) -> i64 {
        to_i64(self.clock.now().0)
    }

    async fn write(&self, op: Op) -> Result<Done, StoreError> {
        self.writer.submit(op, &self.clock).await
    }
}

/// An answer of the writer that does not fit the step asked (a bug in
/// this module, reported rather than panicking).
fn unexpected(phase: Phase, done: &Done) -> StoreError {
    StoreError::unavailable(
        phase,
        std::io::Error::other(format!(
            "internal error: the SQLite writer answered {done:?}"
        )),
    )
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

impl SqliteStore {
    async fn read(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        phase: Phase,
    ) -> Result<Option<RawRecord>, StoreError> {
        self.readers.read(scope, key, phase).await
    }
}

#[async_trait]
impl Store for SqliteStore {
    async fn begin(&self, req: &BeginRequest) -> Result<Begin, StoreError> {
        const P: Phase = Phase::Begin;
        // 1. One read, no write lock: a live record answers from it.
        let found = self.read(&req.scope, &req.key, P).await?;
        if let Some(row) = &found {
            let now = self.now();
            if row.decides(req, now, P)? {
                return row.answer(req, now, P);
            }
        }
        // 2. Absent or expired: claim under the write lock.
        let op = Op::Claim {
            req: req.clone(),
            absent: found.is_none(),
        };
        match self.write(op).await? {
            Done::Begin(begin) => Ok(begin),
            other => Err(unexpected(P, &other)),
        }
    }

    async fn complete(
        &self,
        lease: &Lease,
        response: &StoredResponse,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        let op = Op::Complete {
            lease: lease.clone(),
            blob: response.encode(),
            ttl,
        };
        match self.write(op).await? {
            Done::Kept => Ok(()),
            other => Err(unexpected(Phase::Complete, &other)),
        }
    }

    async fn release(&self, lease: &Lease) -> Result<(), StoreError> {
        match self.write(Op::Release(lease.clone())).await? {
            Done::Kept => Ok(()),
            other => Err(unexpected(Phase::Release, &other)),
        }
    }

    async fn extend(&self, lease: &Lease, lease_for: Duration) -> Result<Lease, StoreError> {
        let op = Op::Extend {
            lease: lease.clone(),
            lease_for,
        };
        match self.write(op).await? {
            Done::Lease(lease) => Ok(lease),
            other => Err(unexpected(Phase::Extend, &other)),
        }
    }

    async fn hold(
        &self,
        lease: &Lease,
        reason: HoldReason,
        hold_for: Duration,
    ) -> Result<Lease, StoreError> {
        let op = Op::Hold {
            lease: lease.clone(),
            reason,
            hold_for,
        };
        match self.write(op).await? {
            Done::Lease(lease) => Ok(lease),
            other => Err(unexpected(Phase::Hold, &other)),
        }
    }

    async fn get(&self, scope: &Scope, key: &IdempotencyKey) -> Result<Option<Record>, StoreError> {
        const P: Phase = Phase::Get;
        let Some(row) = self.read(scope, key, P).await? else {
            return Ok(None);
        };
        if !row.is_live(self.now()) {
            return Ok(None);
        }
        row.to_record(P).map(Some)
    }

    async fn delete(&self, scope: &Scope, key: &IdempotencyKey) -> Result<bool, StoreError> {
        let op = Op::Delete {
            scope: scope.clone(),
            key: key.clone(),
        };
        match self.write(op).await? {
            Done::Deleted(deleted) => Ok(deleted),
            other => Err(unexpected(Phase::Delete, &other)),
        }
    }

    async fn purge_expired(&self) -> Result<u64, StoreError> {
        in_batches(PURGE_BATCH, || async {
            match self.write(Op::Purge { limit: PURGE_BATCH }).await? {
                Done::Purged(n) => Ok(n),
                other => Err(unexpected(Phase::Purge, &other)),
            }
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
        let Some(fence) = claim(self.read(scope, key, P).await?, self.now()) else {
            return Ok(());
        };
        poll_while_claimed(deadline, self.poll_interval, fence, || async {
            Ok(claim(self.read(scope, key, P).await?, self.now()))
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

/// Group commit, seen from outside the writer: batches form, each step
/// keeps its own answer, a bad step fails alone, a busy database fails a
/// whole batch with nothing written, and a claim whose caller left is
/// released.
#[cfg(test)]
mod group_commit_tests {
    use super::*;
    use idem_testkit::support::{fp, fresh_key, fresh_scope, req, response};
    use std::time::Instant;

    const MIN: Duration = Duration::from_secs(60);

    async fn file_store(dir: &tempfile::TempDir, options: SqliteOptions) -> SqliteStore {
        let path = dir.path().join("idem.db");
        SqliteStore::open_with(path.to_str().expect("utf-8 path"), options)
            .await
            .expect("open")
    }

    /// Takes the file's write lock from another pool, as another process
    /// would, until the returned transaction ends.
    async fn block_writes(store: &SqliteStore) -> sqlx::Transaction<'static, sqlx::Sqlite> {
        let other = store.pool().clone();
        let mut tx = other.begin_with("BEGIN IMMEDIATE").await.expect("lock");
        sqlx::query("UPDATE idem_fence SET last = last")
            .execute(&mut *tx)
            .await
            .expect("write");
        tx
    }

    /// One concurrent `begin` per key (same fingerprint, 1-minute lease).
    fn spawn_begins(
        store: &SqliteStore,
        scope: &Scope,
        keys: &[IdempotencyKey],
    ) -> Vec<tokio::task::JoinHandle<Result<Begin, StoreError>>> {
        keys.iter()
            .map(|key| {
                let (store, r) = (store.clone(), req(scope, key, fp("a"), MIN));
                tokio::spawn(async move { store.begin(&r).await })
            })
            .collect()
    }

    /// Waits (bounded) until `n` more steps than `before` reached the
    /// writer (which is stuck on the lock with the first of them).
    async fn until_submitted(store: &SqliteStore, before: u64, n: usize) {
        let start = Instant::now();
        while store.writer.submitted() - before < n as u64 {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "only {} of {n} steps submitted",
                store.writer.submitted() - before
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_steps_share_one_commit_with_their_own_answers() {
        let dir = tempfile::tempdir().expect("temp dir");
        let store = file_store(&dir, SqliteOptions::default()).await;
        let scope = fresh_scope();
        let blocker = block_writes(&store).await;
        let submitted = store.writer.submitted();
        // One claim gets stuck on the lock; 63 more queue behind it, two of
        // them for one key.
        let twin = fresh_key("twin");
        let mut keys: Vec<IdempotencyKey> = (0..62).map(|_| fresh_key("batch")).collect();
        keys.push(twin.clone());
        keys.push(twin.clone());
        let before = store.writer.commits();
        let tasks = spawn_begins(&store, &scope, &keys);
        until_submitted(&store, submitted, keys.len()).await;
        blocker.rollback().await.expect("unlock");
        let mut acquired = Vec::new();
        let mut in_flight = 0;
        for task in tasks {
            match task.await.expect("task").expect("begin") {
                Begin::Acquired(lease) => acquired.push(lease),
                Begin::InFlight { .. } => in_flight += 1,
                other => panic!("unexpected {other:?}"),
            }
        }
        assert_eq!(acquired.len(), 63, "every key claimed once");
        assert_eq!(in_flight, 1, "the twin's second claim saw the first");
        let fences: std::collections::BTreeSet<u64> = acquired.iter().map(|l| l.fence).collect();
        assert_eq!(fences.len(), 63, "every claim has its own fence");
        assert!(
            store.writer.commits() - before <= 2,
            "64 claims took {} commits",
            store.writer.commits() - before
        );
        // The completes, concurrent, again group-committed; each replays.
        let completes: Vec<_> = acquired
            .iter()
            .map(|lease| {
                let (store, lease) = (store.clone(), lease.clone());
                let body = response(lease.key.as_str());
                tokio::spawn(async move { store.complete(&lease, &body, MIN).await })
            })
            .collect();
        for task in completes {
            task.await.expect("task").expect("complete");
        }
        for lease in &acquired {
            match store.begin(&req(&scope, &lease.key, fp("a"), MIN)).await {
                Ok(Begin::Replay(r)) => assert_eq!(r.body, lease.key.as_str().as_bytes()),
                other => panic!("expected a replay, got {other:?}"),
            }
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_failing_statement_fails_only_its_own_step() {
        let dir = tempfile::tempdir().expect("temp dir");
        let store = file_store(&dir, SqliteOptions::default()).await;
        sqlx::query(
            "CREATE TRIGGER poison BEFORE INSERT ON idem_records WHEN NEW.key LIKE 'poison%' \
             BEGIN SELECT RAISE(ABORT, 'poisoned row'); END",
        )
        .execute(store.pool())
        .await
        .expect("trigger");
        let scope = fresh_scope();
        let blocker = block_writes(&store).await;
        let submitted = store.writer.submitted();
        let keys: Vec<IdempotencyKey> = (0..10)
            .map(|i| fresh_key(if i == 5 { "poison" } else { "good" }))
            .collect();
        let tasks = spawn_begins(&store, &scope, &keys);
        until_submitted(&store, submitted, keys.len()).await;
        blocker.rollback().await.expect("unlock");
        for (key, task) in keys.iter().zip(tasks) {
            let got = task.await.expect("task");
            if key.as_str().starts_with("poison") {
                match got {
                    Err(StoreError::Unavailable { phase, source }) => {
                        assert_eq!(phase, Phase::Begin);
                        assert!(source.to_string().contains("poisoned"), "{source}");
                    }
                    other => panic!("the poisoned claim must fail, got {other:?}"),
                }
                assert!(store.get(&scope, key).await.expect("get").is_none());
            } else {
                assert!(matches!(got, Ok(Begin::Acquired(_))), "{got:?}");
                assert!(store.get(&scope, key).await.expect("get").is_some());
            }
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_busy_database_fails_the_whole_batch_with_nothing_written() {
        let dir = tempfile::tempdir().expect("temp dir");
        let store = file_store(
            &dir,
            SqliteOptions::default().with_busy_timeout(Duration::from_millis(300)),
        )
        .await;
        let scope = fresh_scope();
        let blocker = block_writes(&store).await;
        let keys: Vec<IdempotencyKey> = (0..6).map(|_| fresh_key("busy")).collect();
        let tasks = spawn_begins(&store, &scope, &keys);
        for task in tasks {
            let got = task.await.expect("task");
            assert!(
                matches!(
                    got,
                    Err(StoreError::Unavailable {
                        phase: Phase::Begin,
                        ..
                    })
                ),
                "{got:?}"
            );
        }
        blocker.rollback().await.expect("unlock");
        for key in &keys {
            assert!(store.get(&scope, key).await.expect("get").is_none());
        }
        // The writer recovers: the next claim goes through.
        let r = req(&scope, &keys[0], fp("a"), MIN);
        assert!(matches!(store.begin(&r).await, Ok(Begin::Acquired(_))));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_claim_whose_caller_left_is_released() {
        let dir = tempfile::tempdir().expect("temp dir");
        let store = file_store(&dir, SqliteOptions::default()).await;
        let (scope, key) = (fresh_scope(), fresh_key("left"));
        let blocker = block_writes(&store).await;
        let r = req(&scope, &key, fp("a"), MIN);
        // The caller gives up while its claim waits for the lock.
        let gave_up = tokio::time::timeout(Duration::from_millis(100), store.begin(&r)).await;
        assert!(
            gave_up.is_err(),
            "the claim cannot finish while the lock is held"
        );
        blocker.rollback().await.expect("unlock");
        // The claim is committed once the lock is free, then released.
        let start = Instant::now();
        loop {
            let now = store.begin(&r).await.expect("begin");
            match now {
                Begin::Acquired(lease) => {
                    assert!(!lease.took_over, "released, not taken over after its lease");
                    break;
                }
                Begin::InFlight { .. } => {
                    assert!(
                        start.elapsed() < Duration::from_secs(10),
                        "the orphaned claim was never released"
                    );
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                other => panic!("unexpected {other:?}"),
            }
        }
    }
}
