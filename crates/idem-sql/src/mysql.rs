//! The MySQL / MariaDB store: claims in one short InnoDB transaction, the
//! other steps single guarded statements, time and fences from the server.

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use idem_core::admin::{ListPage, ListQuery};
use idem_core::{
    Begin, BeginRequest, HoldReason, IdempotencyKey, KeyAdmin, Lease, Phase, Record, Scope, Store,
    StoreError, StoredResponse,
};
use rand::Rng;
use sqlx::mysql::{MySqlConnectOptions, MySqlConnection, MySqlPool, MySqlRow};
use sqlx::{Connection, Executor, Row};

use crate::common::{
    self, bind_key, bind_lease, classify, lease_kept, list, millis, ms_i64, now_of, to_i64,
    validate_ident, with_retries, Failure, RawRecord, IN_PROGRESS, MAX_TABLE_LEN, PURGE_BATCH,
    SETTLE_ROUNDS,
};
use crate::dialect::Dialect;

/// The schema template (`migrations/mysql/idem_records.sql`).
const SCHEMA_SQL: &str = include_str!("../migrations/mysql/idem_records.sql");

/// This dialect.
const MY: Dialect = Dialect::MySql;

/// The server's clock in ms ([`Dialect::now_ms`]): independent of the
/// session's `time_zone`, constant within one statement (its start), as
/// MySQL documents for `UTC_TIMESTAMP`.
const NOW_MS: &str = MY.now_ms();

/// Settings of a [`MySqlStore`] opened with [`MySqlStore::connect_with`].
///
/// ```
/// use std::time::Duration;
/// use idem_sql::MySqlOptions;
/// let opts = MySqlOptions::new("mysql://idem@db.internal/app")
///     .with_table("idem_records")
///     .with_lock_wait_timeout(Duration::from_secs(3));
/// assert_eq!(opts.max_connections, 16);
/// ```
#[derive(Clone)]
#[non_exhaustive]
pub struct MySqlOptions {
    /// The connection URL, `mysql://user:password@host:3306/database?...`
    /// (`mariadb://` is accepted as a synonym). The database must exist.
    pub url: String,
    /// The records table (default `idem_records`); the fence counter is
    /// `<table>_fence`. Must match `[A-Za-z_][A-Za-z0-9_]{0,53}`. Quoted
    /// with backticks; whether it is case-sensitive depends on the server's
    /// `lower_case_table_names`.
    pub table: String,
    /// Most connections in the pool (default 16, at least 1).
    pub max_connections: u32,
    /// How long a step waits for a free pooled connection (or to open one)
    /// before failing with [`StoreError::Unavailable`]. Default 5 s.
    pub acquire_timeout: Duration,
    /// How long [`MySqlStore::connect_with`] waits for its first connection
    /// (default 5 s). A refused connection fails at once.
    pub connect_timeout: Duration,
    /// `innodb_lock_wait_timeout` of every connection, whole seconds, at
    /// least 1 (default 5 s; the server's default is 50 s). A step that
    /// waits longer for a row lock fails with [`StoreError::Timeout`].
    pub lock_wait_timeout: Duration,
    /// The statement time limit (default 5 s; `None` keeps the server's):
    /// MariaDB's `max_statement_time` (every statement), MySQL's
    /// `max_execution_time` (`SELECT` only; writes are bounded by
    /// `lock_wait_timeout`). Exceeded: [`StoreError::Timeout`]. When set, a
    /// client-side deadline per attempt also catches a connection that
    /// hangs without an error.
    pub statement_timeout: Option<Duration>,
    /// Create the tables when missing (default `true`).
    pub migrate: bool,
    /// How often [`Store::wait_for_change`] polls (default 25 ms, at least 1 ms).
    pub poll_interval: Duration,
}

crate::common::debug_redacting_url! {
    MySqlOptions {
        table, max_connections, acquire_timeout, connect_timeout, lock_wait_timeout,
        statement_timeout, migrate, poll_interval,
    }
}

impl MySqlOptions {
    /// Defaults for the database at `url`.
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            table: "idem_records".into(),
            max_connections: 16,
            acquire_timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(5),
            lock_wait_timeout: Duration::from_secs(5),
            statement_timeout: Some(Duration::from_secs(5)),
            migrate: true,
            poll_interval: Duration::from_millis(25),
        }
    }

    crate::common::option_setters!(
        table,
        max_connections,
        acquire_timeout,
        connect_timeout,
        statement_timeout,
        migrate,
        poll_interval,
    );

    /// Sets [`Self::lock_wait_timeout`] (rounded up to whole seconds, at least 1).
    pub fn with_lock_wait_timeout(mut self, d: Duration) -> Self {
        self.lock_wait_timeout = d;
        self
    }

    fn lock_wait_secs(&self) -> u64 {
        self.lock_wait_timeout
            .as_secs()
            .saturating_add(u64::from(self.lock_wait_timeout.subsec_nanos() > 0))
            .max(1)
    }
}

/// A [`Store`] in an InnoDB table of MySQL 8.0+ or MariaDB 10.5+, for
/// several instances where MySQL is the house database. Uses only SQL both
/// accept (no `VALUES()` in `ON DUPLICATE KEY UPDATE`, no `RETURNING`, no
/// sequences). Tested against MariaDB 10.11; not yet run against MySQL 8.
///
/// # Steps
/// - `begin` first reads the record with one plain `SELECT` (a consistent
///   read: no lock). A live record answers `InFlight`, `Mismatch` or
///   `Replay` from it: a replay is one round trip.
/// - Otherwise it claims the key in one short transaction:
///   `INSERT … ON DUPLICATE KEY UPDATE` where every assignment is
///   `IF(deadline <= now, new, old)` and `deadline` is assigned last (MySQL
///   applies the assignments left to right, each seeing the ones before, so
///   the condition must read the old `deadline` throughout). The statement
///   writes a random negative placeholder fence. InnoDB holds the row's
///   exclusive lock from here to `COMMIT` whether the row was inserted,
///   taken over or left alone, so a second claimant waits and then sees the
///   winner. Inside that lock the fence is drawn (`INSERT` into the
///   `<table>_fence` AUTO_INCREMENT table) and written with `UPDATE … WHERE
///   fence = <placeholder>`: one row means the claim is ours. Zero rows
///   means the record was live: a locking `SELECT … FOR UPDATE` (the
///   current version, whatever the isolation level) answers from it.
///   A claim costs six round trips (read, `BEGIN`, upsert, fence, update,
///   `COMMIT`); `complete` one more.
/// - `complete`, `release`, `extend` are single `UPDATE` / `DELETE … WHERE
///   fence = ? AND state = 0`. Their success is read from the affected-row
///   count where the row always changes (sqlx sets `CLIENT_FOUND_ROWS`, so
///   MySQL reports *matched* rows, but this store does not depend on it):
///   `extend` and `hold` may rewrite an unchanged deadline, so they also read
///   `LAST_INSERT_ID(expr)`, which is evaluated only for a matched row.
///   A held key is an in-progress row whose `response` holds the hold
///   reason's name (`NULL` while the claim runs; cleared on a takeover).
///
/// # InnoDB behaviour relied on (MySQL "Locks Set by Different SQL
/// Statements in InnoDB"; MariaDB "InnoDB Lock Modes")
/// - `INSERT … ON DUPLICATE KEY UPDATE` sets an exclusive lock on the
///   duplicate row, held to the end of the transaction.
/// - Connections run at `READ COMMITTED` (set at connect): no gap locks,
///   so two claims of a missing key do not deadlock on the gap; a
///   deadlock that still happens (error 1213, the transaction is rolled
///   back) is retried up to 5 times with jittered backoff. Reads that must
///   see the latest version use `FOR UPDATE`, so a pool left at
///   `REPEATABLE READ` (`from_pool`) is still correct, only more prone to
///   deadlocks.
/// - `INSERT IGNORE` is never used (it turns unrelated errors into
///   warnings); a duplicate is recognised by error number 1062, never by
///   message text.
///
/// # Time
/// Milliseconds since the Unix epoch by the server's clock
/// (`UTC_TIMESTAMP(6)`, independent of the session's time zone), stored as
/// `BIGINT`: 1,500 ms is 1.5 s.
///
/// # Fences
/// Drawn from one AUTO_INCREMENT counter per table while the claimant holds
/// the record's lock, so they grow store-wide and in the order claims are
/// granted, across release, expiry, purge and delete. MySQL 8 and MariaDB
/// 10.2.4+ keep AUTO_INCREMENT counters across restarts; `purge_expired`
/// trims the counter table but always keeps its newest row.
///
/// # Waiting
/// MySQL has no notifications: [`Store::wait_for_change`] polls every
/// [`MySqlOptions::poll_interval`] until the claim changes, its lease ends,
/// or `max` passes.
///
/// ```no_run
/// # async fn demo() -> Result<(), idem_core::StoreError> {
/// use idem_sql::MySqlStore;
/// let store = MySqlStore::connect("mysql://root@127.0.0.1:3306/test").await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct MySqlStore {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    pool: MySqlPool,
    sql: Statements,
    poll_interval: Duration,
    /// Client-side deadline per attempt.
    call_limit: Option<Duration>,
    /// The quoted table name (for messages and operators).
    table: String,
}

#[derive(Debug)]
struct Statements {
    read: String,
    read_locked: String,
    claim: String,
    next_fence: String,
    set_fence: String,
    complete: String,
    release: String,
    extend: String,
    hold: String,
    delete: String,
    purge: String,
    fence_max: String,
    fence_trim: String,
}

impl Statements {
    fn new(records: &str, fence: &str) -> Self {
        let cols = "fingerprint, state, fence, deadline, response";
        // The takeover condition: the record's deadline (lease end or
        // expiry) has passed, and it is a result or a claim of this same
        // request (`?` = the fingerprint; an ended claim of another request
        // answers 422). MySQL evaluates the assignments below in order, each
        // seeing the ones before it: `deadline` is assigned last, so every
        // IF reads the old deadline; `fingerprint` is assigned first, and
        // once it is (only when the condition held) it equals `?`, so the
        // condition reads the same in every IF.
        let expired = format!("(deadline <= {NOW_MS} AND (state <> 0 OR fingerprint = ?))");
        Self {
            // ? scope, ? key.
            read: format!(
                "SELECT {cols}, {NOW_MS} AS now_ms FROM {records} WHERE scope = ? AND `key` = ?"
            ),
            read_locked: format!(
                "SELECT {cols}, {NOW_MS} AS now_ms FROM {records} \
                 WHERE scope = ? AND `key` = ? FOR UPDATE"
            ),
            // ? scope, key, fingerprint, placeholder, lease; fingerprint,
            // placeholder, lease.
            //
            // A takeover reports the state it replaced through
            // LAST_INSERT_ID(expr) (the table has no AUTO_INCREMENT, so the
            // statement reports nothing else): state + 1, so 1 an ended
            // claim (`took_over`), 2 an ended result; a plain insert reports 0.
            claim: format!(
                "INSERT INTO {records} (scope, `key`, fingerprint, state, fence, deadline, response) \
                 VALUES (?, ?, ?, 0, ?, {NOW_MS} + ?, NULL) \
                 ON DUPLICATE KEY UPDATE \
                   fingerprint = IF({expired}, ?, fingerprint), \
                   response = IF({expired}, NULL, response), \
                   state = IF({expired}, 0 * LAST_INSERT_ID(state + 1), state), \
                   fence = IF({expired}, ?, fence), \
                   deadline = IF({expired}, {NOW_MS} + ?, deadline)"
            ),
            next_fence: format!("INSERT INTO {fence} () VALUES ()"),
            // ? fence, scope, key, placeholder. Reports the lease end
            // through LAST_INSERT_ID(expr).
            set_fence: format!(
                "UPDATE {records} SET fence = ?, deadline = LAST_INSERT_ID(deadline) \
                 WHERE scope = ? AND `key` = ? AND fence = ?"
            ),
            // ? ttl, response, scope, key, fence.
            complete: format!(
                "UPDATE {records} SET state = 1, deadline = {NOW_MS} + ?, response = ? \
                 WHERE scope = ? AND `key` = ? AND fence = ? AND state = 0"
            ),
            // ? scope, key, fence.
            release: format!(
                "DELETE FROM {records} WHERE scope = ? AND `key` = ? AND fence = ? AND state = 0"
            ),
            // ? lease, scope, key, fence.
            extend: format!(
                "UPDATE {records} SET deadline = LAST_INSERT_ID({NOW_MS} + ?) \
                 WHERE scope = ? AND `key` = ? AND fence = ? AND state = 0"
            ),
            // ? hold for, reason, scope, key, fence.
            hold: format!(
                "UPDATE {records} SET deadline = LAST_INSERT_ID(GREATEST(deadline, {NOW_MS} + ?)), \
                 response = ? WHERE scope = ? AND `key` = ? AND fence = ? AND state = 0"
            ),
            delete: format!("DELETE FROM {records} WHERE scope = ? AND `key` = ?"),
            // ? batch size.
            purge: format!(
                "DELETE FROM {records} WHERE deadline <= {NOW_MS} ORDER BY deadline LIMIT ?"
            ),
            fence_max: format!("SELECT CAST(COALESCE(MAX(id), 0) AS SIGNED) FROM {fence}"),
            // ? newest id, batch size.
            fence_trim: format!("DELETE FROM {fence} WHERE id < ? ORDER BY id LIMIT ?"),
        }
    }
}

fn quote(ident: &str) -> String {
    MY.quote(ident)
}

/// Which server the store talks to: the statement time limit differs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Flavor {
    MariaDb,
    MySql,
}

/// The session settings every connection gets.
fn session_sql(flavor: Flavor, options: &MySqlOptions) -> Vec<String> {
    let mut set = format!(
        "SET SESSION innodb_lock_wait_timeout = {}",
        options.lock_wait_secs()
    );
    if let Some(t) = options.statement_timeout {
        match flavor {
            Flavor::MariaDb => set.push_str(&format!(
                ", SESSION max_statement_time = {:.3}",
                t.as_secs_f64().max(0.001)
            )),
            Flavor::MySql => set.push_str(&format!(
                ", SESSION max_execution_time = {}",
                ms_i64(t).max(1)
            )),
        }
    }
    vec![
        "SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED".to_owned(),
        set,
    ]
}

async fn apply_session(conn: &mut MySqlConnection, sql: &[String]) -> Result<(), sqlx::Error> {
    for s in sql {
        conn.execute(sqlx::raw_sql(s)).await?;
    }
    Ok(())
}

impl MySqlStore {
    /// Connects to the database at `url` with [`MySqlOptions::new`]'s
    /// defaults (table `idem_records`, 16 connections, 5 s timeouts) and
    /// creates the tables when missing.
    ///
    /// # Errors
    /// [`StoreError::Config`] for a malformed URL;
    /// [`StoreError::Unavailable`] (phase `Connect`) when no connection can
    /// be opened within the connect timeout (a refused connection fails at
    /// once) or the tables cannot be created or checked.
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        Self::connect_with(MySqlOptions::new(url)).await
    }

    /// Connects with explicit settings.
    ///
    /// # Errors
    /// As for [`Self::connect`]; also [`StoreError::Config`] for a table
    /// name that is not a plain identifier, or an existing table of another
    /// shape.
    pub async fn connect_with(options: MySqlOptions) -> Result<Self, StoreError> {
        validate_ident("table", &options.table, MAX_TABLE_LEN)?;
        common::check_scheme(
            &options.url,
            &["mysql", "mariadb"],
            "a MySQL URL starts with mysql:// (or mariadb://)",
        )?;
        let url = match options.url.strip_prefix("mariadb://") {
            Some(rest) => format!("mysql://{rest}"),
            None => options.url.clone(),
        };
        let connect = MySqlConnectOptions::from_str(&url)
            .map_err(|e| StoreError::Config(format!("bad MySQL URL: {e}")))?;
        let mut conn = common::connect_first(
            options.connect_timeout,
            "MySQL",
            MySqlConnection::connect_with(&connect),
        )
        .await?;
        let prepared = async {
            let flavor = flavor(&mut conn).await?;
            let session = session_sql(flavor, &options);
            apply_session(&mut conn, &session)
                .await
                .map_err(|e| StoreError::unavailable(Phase::Connect, e))?;
            prepare_schema(&mut conn, &options).await?;
            Ok::<_, StoreError>(session)
        }
        .await;
        let _ = conn.close().await;
        let session = Arc::new(prepared?);
        let pool = common::pool_options(options.max_connections, options.acquire_timeout)
            .after_connect(move |conn, _meta| {
                let session = session.clone();
                Box::pin(async move { apply_session(conn, &session).await })
            })
            .connect_lazy_with(connect);
        Ok(Self::build(pool, &options))
    }

    /// Uses an existing pool with the default table (`idem_records`),
    /// creating it when missing. The pool's session settings are the
    /// caller's: set `READ COMMITTED` and a short `innodb_lock_wait_timeout`
    /// in its `after_connect`, as [`Self::connect`] does (the store is
    /// correct without, but deadlocks more and waits up to the server's
    /// 50 s for locks).
    ///
    /// # Errors
    /// [`StoreError::Unavailable`] (phase `Connect`) when no connection can
    /// be had or the tables cannot be created; [`StoreError::Config`] for an
    /// existing table of another shape.
    pub async fn from_pool(pool: MySqlPool) -> Result<Self, StoreError> {
        Self::from_pool_with(pool, MySqlOptions::new("")).await
    }

    /// Uses an existing pool with the table, `migrate`, `poll_interval`
    /// and client-side deadline of `options`; its URL, pool and session
    /// settings are ignored.
    ///
    /// # Errors
    /// As for [`Self::from_pool`]; [`StoreError::Config`] for a bad name.
    pub async fn from_pool_with(
        pool: MySqlPool,
        options: MySqlOptions,
    ) -> Result<Self, StoreError> {
        validate_ident("table", &options.table, MAX_TABLE_LEN)?;
        prepare_schema(&mut *common::setup_connection(&pool).await?, &options).await?;
        Ok(Self::build(pool, &options))
    }

    fn build(pool: MySqlPool, options: &MySqlOptions) -> Self {
        let records = quote(&options.table);
        let fence = quote(&format!("{}_fence", options.table));
        Self {
            inner: Arc::new(Inner {
                sql: Statements::new(&records, &fence),
                poll_interval: options.poll_interval.max(Duration::from_millis(1)),
                call_limit: options.statement_timeout.map(|t| {
                    options.acquire_timeout
                        + 2 * t
                        + Duration::from_secs(options.lock_wait_secs())
                        + Duration::from_secs(2)
                }),
                table: records,
                pool,
            }),
        }
    }

    /// The connection pool (for operators' queries and tests).
    pub fn pool(&self) -> &MySqlPool {
        &self.inner.pool
    }

    /// The quoted table name, e.g. `` `idem_records` ``.
    pub fn table(&self) -> &str {
        &self.inner.table
    }

    /// Closes the pool; calls made afterwards fail with
    /// [`StoreError::Unavailable`].
    pub async fn close(&self) {
        self.inner.pool.close().await;
    }

    /// Runs one attempt under the client-side deadline, mapping errors.
    async fn attempt<T, Fut>(&self, phase: Phase, fut: Fut) -> Result<T, Failure>
    where
        Fut: std::future::Future<Output = Result<T, sqlx::Error>>,
    {
        self.limited(phase, async { fut.await.map_err(|e| classify(phase, e)) })
            .await
    }

    /// Runs `fut` under the client-side deadline.
    async fn limited<T, Fut>(&self, phase: Phase, fut: Fut) -> Result<T, Failure>
    where
        Fut: std::future::Future<Output = Result<T, Failure>>,
    {
        common::limited(self.inner.call_limit, phase, fut).await
    }

    async fn read(
        &self,
        phase: Phase,
        scope: &Scope,
        key: &IdempotencyKey,
    ) -> Result<Option<(RawRecord, i64)>, StoreError> {
        let sql = &self.inner.sql.read;
        let row = with_retries(phase, || {
            self.attempt(
                phase,
                sqlx::query(sql)
                    .bind(scope.as_str().as_bytes())
                    .bind(key.as_str().as_bytes())
                    .fetch_optional(&self.inner.pool),
            )
        })
        .await?;
        row.map(|r| Ok((raw_record(&r, phase)?, now_of(&r, phase)?)))
            .transpose()
    }

    async fn execute<'q>(
        &self,
        phase: Phase,
        q: impl Fn() -> sqlx::query::Query<'q, sqlx::MySql, sqlx::mysql::MySqlArguments>,
    ) -> Result<sqlx::mysql::MySqlQueryResult, StoreError> {
        with_retries(phase, || self.attempt(phase, q().execute(&self.inner.pool))).await
    }

    /// The lease end an `extend` or `hold` statement (`deadline =
    /// LAST_INSERT_ID(…)`) wrote: `LAST_INSERT_ID(expr)` runs only for a
    /// matched row and reports the new end, also when it equals the old one
    /// (no "change", so 0 rows affected: then the row is read to tell a
    /// kept lease from a lost one).
    async fn lease_end(
        &self,
        phase: Phase,
        lease: &Lease,
        done: &sqlx::mysql::MySqlQueryResult,
    ) -> Result<Lease, StoreError> {
        let until = match done.last_insert_id() {
            0 if done.rows_affected() == 0 => {
                return Err(StoreError::LeaseLost { fence: lease.fence })
            }
            0 => match self.read(phase, &lease.scope, &lease.key).await? {
                Some((raw, _)) if raw.state == IN_PROGRESS && raw.fence == to_i64(lease.fence) => {
                    raw.deadline
                }
                _ => return Err(StoreError::LeaseLost { fence: lease.fence }),
            },
            u => to_i64(u),
        };
        Ok(Lease {
            until: millis(until),
            ..lease.clone()
        })
    }

    /// One round of `begin` on one connection: the plain read, and when the
    /// record is not live, the claim transaction (see the type's docs).
    /// Using one connection for both saves a pool round trip (sqlx pings a
    /// connection when it returns to the pool).
    async fn begin_once(&self, req: &BeginRequest) -> Result<Step, Failure> {
        const P: Phase = Phase::Begin;
        let fail = |e: StoreError| Failure::Fail(e);
        let sql = &self.inner.sql;
        let scope = req.scope.as_str().as_bytes();
        let key = req.key.as_str().as_bytes();
        let fp = req.fingerprint.as_bytes().as_slice();
        let mut conn = self
            .inner
            .pool
            .acquire()
            .await
            .map_err(|e| classify(P, e))?;
        // 1. One consistent read: a live record answers from it.
        let row = sqlx::query(&sql.read)
            .bind(scope)
            .bind(key)
            .fetch_optional(&mut *conn)
            .await
            .map_err(|e| classify(P, e))?;
        if let Some(row) = row {
            let raw = raw_record(&row, P).map_err(fail)?;
            let now = now_of(&row, P).map_err(fail)?;
            if raw.decides(req, now, P).map_err(fail)? {
                return raw.answer(req, now, P).map(Step::Done).map_err(fail);
            }
        }
        // 2. Absent or expired: claim in one transaction.
        let placeholder: i64 = -rand::thread_rng().gen_range(1..i64::MAX);
        let lease = common::span_ms(req.lease);
        let claimed = async {
            let mut tx = conn.begin().await?;
            let replaced = sqlx::query(&sql.claim)
                .bind(scope)
                .bind(key)
                .bind(fp)
                .bind(placeholder)
                .bind(lease)
                // Each IF's takeover condition binds the fingerprint.
                .bind(fp)
                .bind(fp)
                .bind(fp)
                .bind(fp)
                .bind(fp)
                .bind(placeholder)
                .bind(fp)
                .bind(lease)
                .execute(&mut *tx)
                .await?
                .last_insert_id();
            let took_over = replaced == 1;
            // We hold the row's lock now, whether it is ours or not.
            let fence = sqlx::query(&sql.next_fence)
                .execute(&mut *tx)
                .await?
                .last_insert_id();
            let set = sqlx::query(&sql.set_fence)
                .bind(i64::try_from(fence).unwrap_or(i64::MAX))
                .bind(scope)
                .bind(key)
                .bind(placeholder)
                .execute(&mut *tx)
                .await?;
            let claim = if set.rows_affected() == 1 {
                match set.last_insert_id() {
                    0 => match locked_row(&mut tx, &sql.read_locked, scope, key).await? {
                        // LAST_INSERT_ID(expr) not reported: read the lease end.
                        Some(row) => Claim::Acquired {
                            fence,
                            until: row.try_get("deadline")?,
                            took_over,
                        },
                        None => Claim::Vanished,
                    },
                    until => Claim::Acquired {
                        fence,
                        until: i64::try_from(until).unwrap_or(i64::MAX),
                        took_over,
                    },
                }
            } else {
                match locked_row(&mut tx, &sql.read_locked, scope, key).await? {
                    Some(row) => Claim::Existing(row),
                    None => Claim::Vanished,
                }
            };
            tx.commit().await?;
            Ok::<_, sqlx::Error>(claim)
        }
        .await
        .map_err(|e| classify(P, e))?;
        Ok(match claimed {
            Claim::Acquired {
                fence,
                until,
                took_over,
            } => Step::Done(Begin::Acquired(Lease {
                scope: req.scope.clone(),
                key: req.key.clone(),
                fence,
                until: millis(until),
                took_over,
            })),
            // Read under the lock the claim's upsert held, so this is the
            // version that stopped the takeover: live when it was checked,
            // even if its deadline passed since (then the retry-after is the
            // 1 ms minimum).
            Claim::Existing(row) => {
                let raw = raw_record(&row, P).map_err(fail)?;
                let now = now_of(&row, P).map_err(fail)?;
                Step::Done(raw.answer(req, now, P).map_err(fail)?)
            }
            Claim::Vanished => Step::Again,
        })
    }
}

/// What one round of `begin` came to.
#[derive(Debug)]
enum Step {
    Done(Begin),
    /// The record changed under the claim (cannot happen with InnoDB's
    /// locks; handled anyway): start over.
    Again,
}

async fn locked_row(
    tx: &mut sqlx::Transaction<'_, sqlx::MySql>,
    sql: &str,
    scope: &[u8],
    key: &[u8],
) -> Result<Option<MySqlRow>, sqlx::Error> {
    sqlx::query(sql)
        .bind(scope)
        .bind(key)
        .fetch_optional(&mut **tx)
        .await
}

/// What a claim transaction found.
#[derive(Debug)]
enum Claim {
    /// The key is ours with this fence and lease end (ms), taken over
    /// from an ended claim or not.
    Acquired {
        fence: u64,
        until: i64,
        took_over: bool,
    },
    /// The record was live: its row, read under our lock.
    Existing(MySqlRow),
    /// The row disappeared under our lock (cannot happen with InnoDB; start over).
    Vanished,
}

async fn flavor(conn: &mut MySqlConnection) -> Result<Flavor, StoreError> {
    let version: String = sqlx::query_scalar("SELECT VERSION()")
        .fetch_one(&mut *conn)
        .await
        .map_err(|e| StoreError::unavailable(Phase::Connect, e))?;
    Ok(if version.to_ascii_lowercase().contains("mariadb") {
        Flavor::MariaDb
    } else {
        Flavor::MySql
    })
}

/// The columns and types (`information_schema.COLUMNS.DATA_TYPE`) this
/// store reads and writes.
const COLUMNS: [(&str, &str); 7] = [
    ("scope", "varbinary"),
    ("key", "varbinary"),
    ("fingerprint", "varbinary"),
    ("state", "tinyint"),
    ("fence", "bigint"),
    ("deadline", "bigint"),
    ("response", "longblob"),
];

/// Checks an existing table's columns; `Ok(false)` when there is no table.
async fn check_shape(
    conn: &mut MySqlConnection,
    options: &MySqlOptions,
) -> Result<bool, StoreError> {
    let found: Vec<(String, String)> = sqlx::query_as(
        "SELECT CAST(COLUMN_NAME AS CHAR), CAST(LOWER(DATA_TYPE) AS CHAR) \
         FROM information_schema.COLUMNS \
         WHERE TABLE_SCHEMA = DATABASE() AND (TABLE_NAME = ? \
           OR (@@lower_case_table_names <> 0 AND TABLE_NAME = LOWER(?)))",
    )
    .bind(&options.table)
    .bind(&options.table)
    .fetch_all(&mut *conn)
    .await
    .map_err(|e| StoreError::unavailable(Phase::Connect, e))?;
    common::check_columns(&found, &COLUMNS, &options.table)
}

/// Checks an existing table's shape, creates the tables when asked
/// (idempotently, serialised between processes by `GET_LOCK`), and checks
/// the result.
async fn prepare_schema(
    conn: &mut MySqlConnection,
    options: &MySqlOptions,
) -> Result<(), StoreError> {
    const P: Phase = Phase::Connect;
    let unavailable = |e: sqlx::Error| StoreError::unavailable(P, e);
    let records = quote(&options.table);
    let existed = check_shape(conn, options).await?;
    if options.migrate {
        let lock = format!("idem-migrate-{:016x}", common::name_hash(&options.table));
        let got: Option<i64> = sqlx::query_scalar("SELECT GET_LOCK(?, 30)")
            .bind(&lock)
            .fetch_one(&mut *conn)
            .await
            .map_err(unavailable)?;
        if got != Some(1) {
            return Err(StoreError::unavailable(
                P,
                "another process held the migration lock for 30 s",
            ));
        }
        let ddl = SCHEMA_SQL
            .replace("{records}", &records)
            .replace("{fence}", &quote(&format!("{}_fence", options.table)))
            .replace(
                "{deadline_index}",
                &quote(&format!("{}_deadline", options.table)),
            )
            .replace("{state_check}", &quote(&format!("{}_state", options.table)));
        let mut result = Ok(());
        for stmt in statements(&ddl) {
            if let Err(e) = conn.execute(sqlx::raw_sql(&stmt)).await {
                result = Err(unavailable(e));
                break;
            }
        }
        let _ = sqlx::query("SELECT RELEASE_LOCK(?)")
            .bind(&lock)
            .execute(&mut *conn)
            .await;
        result?;
    }
    if !existed && !check_shape(conn, options).await? {
        return Err(StoreError::Config(format!(
            "table {records} does not exist (and migrate is off)"
        )));
    }
    Ok(())
}

/// The statements of the template: `--` comment lines dropped (they may
/// hold semicolons), then split at `;`.
fn statements(template: &str) -> Vec<String> {
    template
        .lines()
        .filter(|l| !l.trim_start().starts_with("--"))
        .collect::<Vec<_>>()
        .join("\n")
        .split(';')
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
        .collect()
}

fn raw_record(row: &MySqlRow, phase: Phase) -> Result<RawRecord, StoreError> {
    RawRecord::from_row::<_, i8>(row, phase)
}

#[async_trait]
impl Store for MySqlStore {
    async fn begin(&self, req: &BeginRequest) -> Result<Begin, StoreError> {
        const P: Phase = Phase::Begin;
        for round in 0..SETTLE_ROUNDS {
            let step = with_retries(P, || self.limited(P, self.begin_once(req))).await?;
            match step {
                Step::Done(answer) => return Ok(answer),
                Step::Again => {
                    tracing::debug!(round, "claimed row vanished; starting over");
                    tokio::time::sleep(common::backoff(round + 1)).await;
                }
            }
        }
        Err(StoreError::unavailable(
            P,
            format!("the record kept changing; gave up after {SETTLE_ROUNDS} rounds"),
        ))
    }

    async fn complete(
        &self,
        lease: &Lease,
        response: &StoredResponse,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        let blob = response.encode();
        let sql = &self.inner.sql.complete;
        let done = self
            .execute(Phase::Complete, || {
                let q = sqlx::query(sql)
                    .bind(common::span_ms(ttl))
                    .bind(blob.as_slice());
                bind_lease(q, lease)
            })
            .await?;
        // The row always changes (state 0 → 1), so "changed" and "matched"
        // counts agree.
        lease_kept(done.rows_affected() == 1, lease)
    }

    async fn release(&self, lease: &Lease) -> Result<(), StoreError> {
        let sql = &self.inner.sql.release;
        let done = self
            .execute(Phase::Release, || bind_lease(sqlx::query(sql), lease))
            .await?;
        lease_kept(done.rows_affected() == 1, lease)
    }

    async fn extend(&self, lease: &Lease, lease_for: Duration) -> Result<Lease, StoreError> {
        const P: Phase = Phase::Extend;
        let sql = &self.inner.sql.extend;
        let done = self
            .execute(P, || {
                bind_lease(sqlx::query(sql).bind(common::span_ms(lease_for)), lease)
            })
            .await?;
        self.lease_end(P, lease, &done).await
    }

    async fn hold(
        &self,
        lease: &Lease,
        reason: HoldReason,
        hold_for: Duration,
    ) -> Result<Lease, StoreError> {
        const P: Phase = Phase::Hold;
        let sql = &self.inner.sql.hold;
        let done = self
            .execute(P, || {
                bind_lease(
                    sqlx::query(sql)
                        .bind(common::span_ms(hold_for))
                        .bind(reason.as_str().as_bytes()),
                    lease,
                )
            })
            .await?;
        self.lease_end(P, lease, &done).await
    }

    async fn get(&self, scope: &Scope, key: &IdempotencyKey) -> Result<Option<Record>, StoreError> {
        const P: Phase = Phase::Get;
        match self.read(P, scope, key).await? {
            Some((raw, now)) if raw.is_live(now) => raw.to_record(P).map(Some),
            _ => Ok(None),
        }
    }

    async fn delete(&self, scope: &Scope, key: &IdempotencyKey) -> Result<bool, StoreError> {
        let sql = &self.inner.sql.delete;
        let done = self
            .execute(Phase::Delete, || bind_key(sqlx::query(sql), scope, key))
            .await?;
        Ok(done.rows_affected() > 0)
    }

    /// Deletes expired records in batches of 1,000 (one statement each)
    /// until a batch comes back short, then trims the fence counter table
    /// to its newest row (which it keeps, so the counter survives restarts
    /// of servers that recompute it from `MAX(id)`).
    async fn purge_expired(&self) -> Result<u64, StoreError> {
        const P: Phase = Phase::Purge;
        let sql = &self.inner.sql;
        let total = common::in_batches(PURGE_BATCH, || async {
            let done = self
                .execute(P, || sqlx::query(&sql.purge).bind(PURGE_BATCH))
                .await?;
            Ok(done.rows_affected())
        })
        .await?;
        let newest: i64 = with_retries(P, || {
            self.attempt(
                P,
                sqlx::query_scalar(&sql.fence_max).fetch_one(&self.inner.pool),
            )
        })
        .await?;
        common::in_batches(PURGE_BATCH * 10, || async {
            let done = self
                .execute(P, || {
                    sqlx::query(&sql.fence_trim)
                        .bind(newest)
                        .bind(PURGE_BATCH * 10)
                })
                .await?;
            Ok(done.rows_affected())
        })
        .await?;
        Ok(total)
    }

    /// Polls the record every [`MySqlOptions::poll_interval`] (default
    /// 25 ms) until it is no longer the same live claim (completed,
    /// released, taken over, past its lease), or `max` has passed.
    async fn wait_for_change(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        max: Duration,
    ) -> Result<(), StoreError> {
        const P: Phase = Phase::Get;
        let started = tokio::time::Instant::now();
        let claim = |r: Option<(RawRecord, i64)>| r.and_then(|(raw, now)| raw.live_claim(now));
        let Some((fence, left)) = claim(self.read(P, scope, key).await?) else {
            return Ok(());
        };
        let until = common::instant_after(started, left + Duration::from_millis(1))
            .min(common::instant_after(started, max));
        common::poll_while_claimed(until, self.inner.poll_interval, fence, || async {
            Ok(claim(self.read(P, scope, key).await?).map(|(f, _)| f))
        })
        .await
    }

    fn admin(&self) -> Option<&dyn KeyAdmin> {
        Some(self)
    }
}

/// Listing: one `SELECT … ORDER BY fence DESC LIMIT n` per page (the
/// shared statement of the SQL stores), newest claim first, a plain
/// consistent read (no locks) at `READ COMMITTED`, time by the server's
/// clock. Without a scope filter InnoDB scans the table and sorts for the
/// newest `n + 1` rows (a filesort bounded by the page); with one it reads
/// only that scope's rows through the primary key. Retried on a deadlock;
/// bounded by the statement time limit.
#[async_trait]
impl KeyAdmin for MySqlStore {
    async fn list(&self, query: &ListQuery) -> Result<ListPage, StoreError> {
        const P: Phase = Phase::List;
        let records = self.inner.table.as_str();
        let st = list::statement(MY, records, false, query)?;
        let rows = with_retries(P, || {
            self.attempt(
                P,
                list::bind(MY, &st, None, sqlx::query(&st.sql)).fetch_all(&self.inner.pool),
            )
        })
        .await?;
        list::page::<_, i8>(records, query, &rows)
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
    fn statements_assign_deadline_last() {
        let s = Statements::new("`t`", "`t_fence`");
        let update = s
            .claim
            .split("ON DUPLICATE KEY UPDATE")
            .nth(1)
            .expect("odku");
        let at = |col: &str| {
            update
                .find(&format!("{col} = IF("))
                .unwrap_or_else(|| panic!("{col} is assigned: {update}"))
        };
        for col in ["fingerprint", "response", "state", "fence"] {
            assert!(
                at(col) < at("deadline"),
                "deadline must be assigned after {col}: {update}"
            );
        }
        assert!(!s.claim.contains("IGNORE"));
    }

    #[test]
    fn session_settings_per_flavor() {
        let o =
            MySqlOptions::new("mysql://x/y").with_lock_wait_timeout(Duration::from_millis(1500));
        let maria = session_sql(Flavor::MariaDb, &o).join(";");
        assert!(maria.contains("READ COMMITTED"));
        assert!(maria.contains("innodb_lock_wait_timeout = 2"));
        assert!(maria.contains("max_statement_time = 5.000"));
        let mysql = session_sql(Flavor::MySql, &o).join(";");
        assert!(mysql.contains("max_execution_time = 5000"));
    }

    #[test]
    fn template_splits_into_statements() {
        let parts = statements(SCHEMA_SQL);
        assert_eq!(parts.len(), 2, "{parts:?}");
        assert!(parts
            .iter()
            .all(|p| p.starts_with("CREATE TABLE IF NOT EXISTS")));
    }
}
