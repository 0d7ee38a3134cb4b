//! The PostgreSQL store: every step one SQL statement, time and fences from
//! the database, waiters woken by `LISTEN` / `NOTIFY`.

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use idem_core::admin::{ListPage, ListQuery};
use idem_core::{
    Begin, BeginRequest, HoldReason, IdempotencyKey, KeyAdmin, Lease, Phase, Record, Scope, Store,
    StoreError, StoredResponse,
};
use sqlx::postgres::{PgConnectOptions, PgConnection, PgListener, PgPool, PgPoolOptions, PgRow};
use sqlx::Connection;
use tokio::sync::broadcast;

use crate::common::{
    self, bind_key, bind_lease, classify, column, lease_kept, list, millis, ms_i64, now_of,
    record_hash, validate_ident, with_retries, Failure, RawRecord, MAX_SCHEMA_LEN, MAX_TABLE_LEN,
    PURGE_BATCH, SETTLE_ROUNDS,
};
use crate::dialect::Dialect;

/// The schema template (`migrations/postgres/idem_records.sql`).
const SCHEMA_SQL: &str = include_str!("../migrations/postgres/idem_records.sql");

/// After the `LISTEN` connection fails, waiters poll for this long before a
/// new `LISTEN` is tried.
const LISTEN_RETRY_AFTER: Duration = Duration::from_secs(5);

/// This dialect.
const PG: Dialect = Dialect::Postgres;

/// A statement with its bound values.
type PgQuery<'q> = sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments>;

/// The database's clock in ms when the expression is evaluated
/// ([`Dialect::now_ms`]).
const NOW_MS: &str = PG.now_ms();

/// The same at the statement's start: stable within a statement, so an
/// index on `deadline` can serve the comparison.
const STMT_NOW_MS: &str = Dialect::PG_STATEMENT_NOW_MS;

/// Settings of a [`PostgresStore`] opened with [`PostgresStore::connect_with`].
///
/// ```
/// use std::time::Duration;
/// use idem_sql::PostgresOptions;
/// let opts = PostgresOptions::new("postgres://idem@db.internal/app")
///     .with_schema("idem")
///     .with_table("records")
///     .with_max_connections(32)
///     .with_statement_timeout(Some(Duration::from_secs(2)));
/// assert_eq!(opts.max_connections, 32);
/// assert_eq!(opts.acquire_timeout, Duration::from_secs(5));
/// ```
#[derive(Clone)]
#[non_exhaustive]
pub struct PostgresOptions {
    /// The connection URL, `postgres://user:password@host:port/database?...`
    /// (`postgresql://` too; sqlx's query parameters such as `sslmode` apply).
    pub url: String,
    /// The schema holding the table (default `public`); created when
    /// missing. Must match `[A-Za-z_][A-Za-z0-9_]{0,62}`; quoted, so it is
    /// case-sensitive.
    pub schema: String,
    /// The records table (default `idem_records`). Must match
    /// `[A-Za-z_][A-Za-z0-9_]{0,53}` (54 bytes at most, so the names derived
    /// from it — `<table>_fence`, `<table>_deadline` — fit PostgreSQL's 63);
    /// quoted, so it is case-sensitive.
    pub table: String,
    /// Most connections in the pool (default 16, at least 1). The `LISTEN`
    /// connection is one more, outside the pool.
    pub max_connections: u32,
    /// How long a step waits for a free pooled connection (or to open one)
    /// before failing with [`StoreError::Unavailable`]. Default 5 s.
    pub acquire_timeout: Duration,
    /// How long [`PostgresStore::connect_with`] waits for its first
    /// connection (default 5 s). A refused connection fails at once.
    pub connect_timeout: Duration,
    /// The server-side `statement_timeout` of every connection (default
    /// 5 s; `None` keeps the server's setting). A step cut off by it fails
    /// with [`StoreError::Timeout`] and its effect is unknown. When set, a
    /// client-side deadline of `acquire_timeout + statement_timeout + 2 s`
    /// per statement also catches a connection that hangs without an error.
    pub statement_timeout: Option<Duration>,
    /// Create the schema, table, index and sequence when missing (default
    /// `true`). Turn off when the role may not run DDL and the objects were
    /// created beforehand (see `migrations/postgres/idem_records.sql`).
    pub migrate: bool,
    /// Wake waiters through `LISTEN` / `NOTIFY` (default `true`): `complete`,
    /// `release` and `delete` notify, and [`Store::wait_for_change`] listens on
    /// one shared connection. Off, waiters poll every
    /// [`Self::poll_interval`] and no step notifies (a `NOTIFY` takes a
    /// cluster-wide lock at commit, which can matter at very high rates).
    pub notify: bool,
    /// How often a waiter polls when notifications are off or unavailable
    /// (default 25 ms, at least 1 ms).
    pub poll_interval: Duration,
}

crate::common::debug_redacting_url! {
    PostgresOptions {
        schema, table, max_connections, acquire_timeout, connect_timeout, statement_timeout,
        migrate, notify, poll_interval,
    }
}

impl PostgresOptions {
    /// Defaults for the database at `url`.
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            schema: "public".into(),
            table: "idem_records".into(),
            max_connections: 16,
            acquire_timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(5),
            statement_timeout: Some(Duration::from_secs(5)),
            migrate: true,
            notify: true,
            poll_interval: Duration::from_millis(25),
        }
    }

    /// Sets [`Self::schema`] (validated when the store connects).
    pub fn with_schema(mut self, schema: impl Into<String>) -> Self {
        self.schema = schema.into();
        self
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

    /// Sets [`Self::notify`].
    pub fn with_notify(mut self, notify: bool) -> Self {
        self.notify = notify;
        self
    }
}

/// A [`Store`] in a PostgreSQL table, for several instances sharing one
/// durable store. Needs PostgreSQL 10 or later (tested on 15).
///
/// # One statement per step
/// Every step is a single SQL statement in its own (autocommit) transaction,
/// run at the server's default `READ COMMITTED` level:
///
/// - `begin` is one `INSERT … ON CONFLICT (scope, key) DO UPDATE … WHERE
///   <deadline passed> RETURNING …`, wrapped in a statement that also reads
///   the record as it was when the statement started, so the same round
///   trip answers `InFlight`, `Mismatch` or `Replay` (with the stored
///   response). A live record is answered from that read alone, without
///   attempting the insert: a replay is a pure read. See the comment on the
///   statement in the source for the reasoning about snapshots.
/// - `complete`, `release`, `extend`, `hold` are `UPDATE` / `DELETE … WHERE scope =
///   $1 AND key = $2 AND fence = $3 AND state = 0`: zero rows means the fence
///   is no longer current ([`StoreError::LeaseLost`]). A lease that ran out
///   without being taken over is still current. A held key is an
///   in-progress row whose `response` holds the hold reason's name (`NULL`
///   while the claim runs; cleared on a takeover).
///
/// So a first execution costs two round trips (`begin`, `complete`) and a
/// replay one, once the pool's connections have prepared the statements
/// (sqlx caches prepared statements per connection).
///
/// PostgreSQL documents what this relies on (`INSERT`, "ON CONFLICT
/// Clause"): "ON CONFLICT DO UPDATE guarantees an atomic INSERT or UPDATE
/// outcome … even under high concurrency", and under `READ COMMITTED` the
/// conflicting row is locked and the `WHERE` of `DO UPDATE` is evaluated
/// against its latest committed version, even one the statement's snapshot
/// cannot see ("Transaction Isolation", 13.2.1). Exactly one of several
/// racing callers therefore inserts or takes over a key.
///
/// # Time
/// Lease ends and expiry are milliseconds since the Unix epoch by the
/// database's `clock_timestamp()`, kept as `bigint`: 1,500 ms is 1.5 s.
/// Every instance sharing the database agrees, whatever its own clock says.
///
/// # Fences
/// Each claim draws its fence from one sequence per table (`nextval`), so
/// fences grow store-wide, across release, expiry, purge and delete. A
/// claim takes a transaction-scoped advisory lock on a hash of its key
/// (`pg_advisory_xact_lock(int4, int4)`, the two-key space, which the
/// one-`bigint` locks applications usually take never collide with) before
/// drawing the fence, so claims of one key draw their fences in the order
/// they are granted.
///
/// # Errors and retries
/// Serialization failures and deadlocks (SQLSTATE `40001`, `40P01`) are
/// retried up to 5 times with jittered backoff. `statement_timeout`
/// (`57014`) and `lock_timeout` (`55P03`) are [`StoreError::Timeout`]; a
/// pool or connection failure is [`StoreError::Unavailable`] with sqlx's
/// error as the source; an undecodable row is [`StoreError::Corrupt`].
/// Errors are recognised by SQLSTATE, never by message text.
///
/// # Waiting
/// With [`PostgresOptions::notify`] on (the default), `complete`,
/// `release` and `delete` call `pg_notify` in the same statement (delivered
/// at commit), and [`Store::wait_for_change`] listens on one connection
/// shared by all waiters of this store. If `LISTEN` fails, waiters fall
/// back to polling.
///
/// ```no_run
/// # async fn demo() -> Result<(), idem_core::StoreError> {
/// use idem_sql::{PostgresOptions, PostgresStore};
/// let store = PostgresStore::connect("postgres://postgres@127.0.0.1:5432/test").await?;
/// let custom = PostgresStore::connect_with(
///     PostgresOptions::new("postgres://postgres@127.0.0.1:5432/test").with_schema("idem"),
/// )
/// .await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct PostgresStore {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    pool: PgPool,
    sql: Statements,
    /// The first key of the two-key advisory lock a claim takes.
    lock_class: i32,
    /// The `NOTIFY` channel of this table.
    channel: String,
    notify: bool,
    poll_interval: Duration,
    /// Client-side deadline per statement (see [`PostgresOptions::statement_timeout`]).
    call_limit: Option<Duration>,
    hub: Hub,
    /// The qualified, quoted table name (for messages).
    table: String,
}

/// The SQL of each step, with the validated, quoted names filled in.
#[derive(Debug)]
struct Statements {
    begin: String,
    complete: String,
    release: String,
    extend: String,
    hold: String,
    get: String,
    delete: String,
    purge: String,
    claim_state: String,
}

impl Statements {
    fn new(records: &str, fence_seq: &str, notify: bool) -> Self {
        // Statements that free or finish a key notify waiters in the same
        // statement (delivered at commit). `SELECT pg_notify(..) FROM done`
        // yields one row per changed record, zero when nothing matched.
        let finish = |cte: &str, params: (u8, u8)| {
            if notify {
                format!(
                    "WITH done AS ({cte} RETURNING 1) SELECT pg_notify(${}, ${}) FROM done",
                    params.0, params.1
                )
            } else {
                format!("WITH done AS ({cte} RETURNING 1) SELECT 1 FROM done")
            }
        };
        Self {
            // $1 scope, $2 key, $3 fingerprint, $4 lease (ms), $5/$6 advisory lock keys.
            //
            // Why this shape (READ COMMITTED, one autocommit statement):
            //
            // * `cur` reads the record as of the statement's snapshot. When it
            //   is live (deadline in the future) the statement inserts nothing
            //   (`lk` yields no row), takes no lock, draws no fence and writes
            //   no WAL: replays and in-flight answers are pure reads.
            // * An ended claim (in progress past its lease) of another
            //   fingerprint answers like a live one (422): only the same
            //   request takes an ended claim over.
            // * Otherwise `claim` tries to insert, or to take over a record
            //   whose deadline has passed. ON CONFLICT locks the conflicting
            //   row and evaluates the DO UPDATE's WHERE against its *latest*
            //   committed version (waiting for an in-progress inserter or
            //   updater first), so two racing claims cannot both win: the
            //   second sees the first one's fresh deadline and updates nothing.
            // * When `claim` returns a row we hold the key (Acquired). When it
            //   returns none, the conflicting row is newer than our snapshot:
            //   `cur` may show nothing or a stale version, and RETURNING gives
            //   nothing for a row that was not updated. So we answer from `cur`
            //   only when `cur` is live (it was the truth at the statement's
            //   start: a valid linearization point), and otherwise run the
            //   statement again: a new statement takes a new snapshot that
            //   sees the committed winner. A CTE's SELECT cannot see the row
            //   another CTE locked, so no single statement can do better.
            // * `lk` takes a transaction-scoped advisory lock on the key's
            //   hash before `nextval` runs, so claims of one key draw fences in
            //   the order they are granted: a claim that drew a fence and then
            //   stalled cannot later win with a fence below one granted
            //   meanwhile (a sequence alone hands out numbers before the
            //   uniqueness check).
            // * Time is the database's: the DO UPDATE re-reads the clock after
            //   any lock wait, so a wait neither lets a live lease be taken
            //   over nor shortens the new lease.
            // * `took_over` (an ended claim was taken over, not a fresh key or
            //   an ended result replaced) needs the row the claim replaced:
            //   `xmax <> 0` on the returned row says the upsert updated rather
            //   than inserted, and `cur` says what it replaced. When the row
            //   changed between the snapshot and the claim (another claim
            //   came and ended in that instant), `cur` is stale: a row that
            //   appeared meanwhile was inserted, so in progress (counted as
            //   taken over); a result that turned into an ended claim in that
            //   window is missed. Only a lease or TTL shorter than that race
            //   window can make it wrong.
            begin: format!(
                "WITH cur AS ( \
                   SELECT fingerprint, state, fence, deadline, response FROM {records} \
                   WHERE scope = $1 AND key = $2 \
                 ), clk AS ( \
                   SELECT {NOW_MS} AS now_ms \
                 ), lk AS ( \
                   SELECT pg_advisory_xact_lock($5, $6) \
                   WHERE NOT EXISTS (SELECT 1 FROM cur, clk WHERE cur.deadline > clk.now_ms \
                                     OR (cur.state = 0 AND cur.fingerprint <> $3)) \
                 ), claim AS ( \
                   INSERT INTO {records} AS r (scope, key, fingerprint, state, fence, deadline, response) \
                   SELECT $1, $2, $3, 0, nextval('{fence_seq}'), {NOW_MS} + $4, NULL FROM lk \
                   ON CONFLICT (scope, key) DO UPDATE \
                     SET fingerprint = EXCLUDED.fingerprint, state = 0, fence = EXCLUDED.fence, \
                         deadline = {NOW_MS} + $4, response = NULL \
                     WHERE r.deadline <= {NOW_MS} \
                       AND (r.state <> 0 OR r.fingerprint = EXCLUDED.fingerprint) \
                   RETURNING r.fingerprint, r.state, r.fence, r.deadline, \
                             (r.xmax <> 0) AS replaced \
                 ) \
                 SELECT true AS claimed, fingerprint, state, fence, deadline, \
                        NULL::bytea AS response, (SELECT now_ms FROM clk) AS now_ms, \
                        (replaced AND COALESCE((SELECT state = 0 FROM cur), true)) AS took_over \
                 FROM claim \
                 UNION ALL \
                 SELECT false, fingerprint, state, fence, deadline, response, \
                        (SELECT now_ms FROM clk), false FROM cur"
            ),
            // $1 ttl (ms), $2 response, $3 scope, $4 key, $5 fence, $6 channel, $7 payload.
            complete: finish(
                &format!(
                    "UPDATE {records} SET state = 1, deadline = {NOW_MS} + $1, response = $2 \
                     WHERE scope = $3 AND key = $4 AND fence = $5 AND state = 0"
                ),
                (6, 7),
            ),
            // $1 scope, $2 key, $3 fence, $4 channel, $5 payload.
            release: finish(
                &format!(
                    "DELETE FROM {records} \
                     WHERE scope = $1 AND key = $2 AND fence = $3 AND state = 0"
                ),
                (4, 5),
            ),
            // $1 lease (ms), $2 scope, $3 key, $4 fence.
            extend: format!(
                "UPDATE {records} SET deadline = {NOW_MS} + $1 \
                 WHERE scope = $2 AND key = $3 AND fence = $4 AND state = 0 \
                 RETURNING deadline"
            ),
            // $1 hold for (ms), $2 reason, $3 scope, $4 key, $5 fence.
            hold: format!(
                "UPDATE {records} SET deadline = GREATEST(deadline, {NOW_MS} + $1), response = $2 \
                 WHERE scope = $3 AND key = $4 AND fence = $5 AND state = 0 \
                 RETURNING deadline"
            ),
            // $1 scope, $2 key.
            get: format!(
                "SELECT fingerprint, state, fence, deadline, response, {NOW_MS} AS now_ms \
                 FROM {records} WHERE scope = $1 AND key = $2"
            ),
            // $1 scope, $2 key, $3 channel, $4 payload.
            delete: finish(
                &format!("DELETE FROM {records} WHERE scope = $1 AND key = $2"),
                (3, 4),
            ),
            // $1 batch size. Rows another transaction holds are skipped (a
            // claim taking one over right now); the next purge gets them.
            purge: format!(
                "DELETE FROM {records} WHERE (scope, key) IN ( \
                   SELECT scope, key FROM {records} WHERE deadline <= {STMT_NOW_MS} \
                   LIMIT $1 FOR UPDATE SKIP LOCKED)"
            ),
            // $1 scope, $2 key: what a waiter compares.
            claim_state: format!(
                "SELECT state, fence, deadline, {NOW_MS} AS now_ms \
                 FROM {records} WHERE scope = $1 AND key = $2"
            ),
        }
    }
}

fn quote(ident: &str) -> String {
    PG.quote(ident)
}

impl PostgresStore {
    /// Connects to the database at `url` with [`PostgresOptions::new`]'s
    /// defaults (table `public.idem_records`, 16 connections, 5 s timeouts)
    /// and creates the table when missing.
    ///
    /// # Errors
    /// [`StoreError::Config`] for a malformed URL;
    /// [`StoreError::Unavailable`] (phase `Connect`) when no connection can
    /// be opened within the connect timeout (a refused connection fails at
    /// once) or the schema cannot be created or checked.
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        Self::connect_with(PostgresOptions::new(url)).await
    }

    /// Connects with explicit settings.
    ///
    /// # Errors
    /// As for [`Self::connect`]; also [`StoreError::Config`] for a schema or
    /// table name that is not a plain identifier (see
    /// [`PostgresOptions::table`]), or an existing table of another shape.
    pub async fn connect_with(options: PostgresOptions) -> Result<Self, StoreError> {
        validate_names(&options)?;
        common::check_scheme(
            &options.url,
            &["postgres", "postgresql"],
            "a PostgreSQL URL starts with postgres:// or postgresql://",
        )?;
        let mut connect = PgConnectOptions::from_str(&options.url)
            .map_err(|e| StoreError::Config(format!("bad PostgreSQL URL: {e}")))?
            .application_name("idem");
        if let Some(t) = options.statement_timeout {
            connect = connect.options([("statement_timeout", ms_i64(t).to_string())]);
        }
        let mut conn = common::connect_first(
            options.connect_timeout,
            "PostgreSQL",
            PgConnection::connect_with(&connect),
        )
        .await?;
        let prepared = prepare_schema(&mut conn, &options).await;
        let _ = conn.close().await;
        prepared?;
        let pool = common::pool_options(options.max_connections, options.acquire_timeout)
            .connect_lazy_with(connect);
        Ok(Self::build(pool, &options))
    }

    /// Uses an existing pool with the default schema and table
    /// (`public.idem_records`), creating them when missing. The pool's
    /// settings are the caller's (keep the default `READ COMMITTED`).
    ///
    /// # Errors
    /// [`StoreError::Unavailable`] (phase `Connect`) when no connection can
    /// be had or the schema cannot be created; [`StoreError::Config`] for an
    /// existing table of another shape.
    pub async fn from_pool(pool: PgPool) -> Result<Self, StoreError> {
        Self::from_pool_with(pool, PostgresOptions::new("")).await
    }

    /// Uses an existing pool with the schema, table, `migrate`, `notify`,
    /// `poll_interval` and `statement_timeout` (client-side deadline only)
    /// of `options`; its URL and pool settings are ignored.
    ///
    /// # Errors
    /// As for [`Self::from_pool`]; [`StoreError::Config`] for bad names.
    pub async fn from_pool_with(
        pool: PgPool,
        options: PostgresOptions,
    ) -> Result<Self, StoreError> {
        validate_names(&options)?;
        prepare_schema(&mut *common::setup_connection(&pool).await?, &options).await?;
        Ok(Self::build(pool, &options))
    }

    fn build(pool: PgPool, options: &PostgresOptions) -> Self {
        let records = format!("{}.{}", quote(&options.schema), quote(&options.table));
        let fence_seq = format!(
            "{}.{}",
            quote(&options.schema),
            quote(&format!("{}_fence", options.table))
        );
        let qualified = format!("{}.{}", options.schema, options.table);
        // Channel names are identifiers (at most 63 bytes).
        let channel = if qualified.len() <= 63 {
            qualified.clone()
        } else {
            format!("idem_{:016x}", common::name_hash(&qualified))
        };
        Self {
            inner: Arc::new(Inner {
                sql: Statements::new(&records, &fence_seq, options.notify),
                lock_class: common::name_hash(&qualified) as i32,
                channel,
                notify: options.notify,
                poll_interval: options.poll_interval.max(Duration::from_millis(1)),
                call_limit: options
                    .statement_timeout
                    .map(|t| options.acquire_timeout + t + Duration::from_secs(2)),
                hub: Hub::new(options.connect_timeout),
                table: records,
                pool,
            }),
        }
    }

    /// The connection pool (for operators' queries and tests).
    pub fn pool(&self) -> &PgPool {
        &self.inner.pool
    }

    /// The qualified, quoted table name, e.g. `"public"."idem_records"`.
    pub fn table(&self) -> &str {
        &self.inner.table
    }

    /// Closes the pool and the `LISTEN` connection; calls made afterwards
    /// fail with [`StoreError::Unavailable`].
    pub async fn close(&self) {
        self.inner.hub.stop().await;
        self.inner.pool.close().await;
    }

    fn payload(scope: &Scope, key: &IdempotencyKey) -> String {
        format!("{:016x}", record_hash(scope.as_str(), key.as_str()))
    }

    /// Binds the `NOTIFY` channel and `payload` when notifications are on
    /// (the statement then notifies waiters; see [`Statements::new`]).
    fn notifying<'q>(&'q self, q: PgQuery<'q>, payload: &'q str) -> PgQuery<'q> {
        if self.inner.notify {
            q.bind(self.inner.channel.as_str()).bind(payload)
        } else {
            q
        }
    }

    /// Runs one attempt of a statement under the client-side deadline.
    async fn attempt<T, F, Fut>(&self, phase: Phase, f: F) -> Result<T, Failure>
    where
        F: FnOnce(PgPool) -> Fut,
        Fut: std::future::Future<Output = Result<T, sqlx::Error>>,
    {
        let fut = f(self.inner.pool.clone());
        common::limited(self.inner.call_limit, phase, async {
            fut.await.map_err(|e| classify(phase, e))
        })
        .await
    }

    /// The first row of `sql` run with a record's `scope` and `key`.
    async fn fetch_keyed(
        &self,
        phase: Phase,
        sql: &str,
        scope: &Scope,
        key: &IdempotencyKey,
    ) -> Result<Option<PgRow>, StoreError> {
        let rows = self
            .fetch_all(phase, || bind_key(sqlx::query(sql), scope, key))
            .await?;
        Ok(rows.into_iter().next())
    }

    async fn fetch_all<'q>(
        &self,
        phase: Phase,
        q: impl Fn() -> PgQuery<'q>,
    ) -> Result<Vec<PgRow>, StoreError> {
        with_retries(phase, || {
            let q = q();
            self.attempt(phase, move |pool| async move { q.fetch_all(&pool).await })
        })
        .await
    }
}

fn validate_names(options: &PostgresOptions) -> Result<(), StoreError> {
    validate_ident("schema", &options.schema, MAX_SCHEMA_LEN)?;
    validate_ident("table", &options.table, MAX_TABLE_LEN)
}

/// The columns and types (`information_schema.columns.data_type`) this
/// store reads and writes.
const COLUMNS: [(&str, &str); 7] = [
    ("scope", "bytea"),
    ("key", "bytea"),
    ("fingerprint", "bytea"),
    ("state", "smallint"),
    ("fence", "bigint"),
    ("deadline", "bigint"),
    ("response", "bytea"),
];

/// Checks an existing table's columns; `Ok(false)` when there is no table.
async fn check_shape(
    conn: &mut PgConnection,
    options: &PostgresOptions,
) -> Result<bool, StoreError> {
    let found: Vec<(String, String)> = sqlx::query_as(
        "SELECT column_name::text, data_type::text FROM information_schema.columns \
         WHERE table_schema = $1 AND table_name = $2",
    )
    .bind(&options.schema)
    .bind(&options.table)
    .fetch_all(&mut *conn)
    .await
    .map_err(|e| StoreError::unavailable(Phase::Connect, e))?;
    common::check_columns(
        &found,
        &COLUMNS,
        &format!("{}.{}", options.schema, options.table),
    )
}

/// Checks an existing table's shape, creates the schema objects when asked
/// (idempotently, under an advisory lock, in one transaction), and checks
/// the result.
/// Runs a multi-statement script: a query without arguments goes over
/// PostgreSQL's simple query protocol, which accepts several statements.
/// (`sqlx::raw_sql(..).execute(conn)` does the same but its future is not
/// provably `Send` in sqlx 0.8, so a store could not be built in a spawned task.)
async fn exec_raw(conn: &mut PgConnection, sql: &str) -> Result<(), sqlx::Error> {
    sqlx::Executor::execute(conn, sql).await.map(drop)
}

async fn prepare_schema(
    conn: &mut PgConnection,
    options: &PostgresOptions,
) -> Result<(), StoreError> {
    const P: Phase = Phase::Connect;
    let unavailable = |e: sqlx::Error| StoreError::unavailable(P, e);
    let schema = quote(&options.schema);
    let records = format!("{schema}.{}", quote(&options.table));
    let existed = check_shape(conn, options).await?;
    if options.migrate {
        let ddl = SCHEMA_SQL
            .replace("{records}", &records)
            .replace(
                "{fence_seq}",
                &format!("{schema}.{}", quote(&format!("{}_fence", options.table))),
            )
            .replace(
                "{deadline_index}",
                &quote(&format!("{}_deadline", options.table)),
            );
        let mut tx = conn.begin().await.map_err(unavailable)?;
        sqlx::query("SELECT pg_advisory_xact_lock($1)")
            .bind(common::name_hash(&format!("idem-migrate:{records}")) as i64)
            .execute(&mut *tx)
            .await
            .map_err(unavailable)?;
        // `CREATE SCHEMA IF NOT EXISTS` checks the CREATE privilege on the
        // database before it looks: skip it when the schema exists.
        let exists: bool =
            sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)")
                .bind(&options.schema)
                .fetch_one(&mut *tx)
                .await
                .map_err(unavailable)?;
        if !exists {
            exec_raw(&mut tx, &format!("CREATE SCHEMA IF NOT EXISTS {schema}"))
                .await
                .map_err(unavailable)?;
        }
        exec_raw(&mut tx, &ddl).await.map_err(unavailable)?;
        tx.commit().await.map_err(unavailable)?;
    }
    if !existed && !check_shape(conn, options).await? {
        return Err(StoreError::Config(format!(
            "table {}.{} does not exist (and migrate is off)",
            options.schema, options.table
        )));
    }
    Ok(())
}

fn raw_record(row: &PgRow, phase: Phase) -> Result<RawRecord, StoreError> {
    RawRecord::from_row::<_, i16>(row, phase)
}

#[async_trait]
impl Store for PostgresStore {
    async fn begin(&self, req: &BeginRequest) -> Result<Begin, StoreError> {
        const P: Phase = Phase::Begin;
        let sql = &self.inner.sql.begin;
        let lease = common::span_ms(req.lease);
        let lock_obj = record_hash(req.scope.as_str(), req.key.as_str()) as i32;
        for round in 0..SETTLE_ROUNDS {
            let rows = self
                .fetch_all(P, || {
                    sqlx::query(sql)
                        .bind(req.scope.as_str().as_bytes())
                        .bind(req.key.as_str().as_bytes())
                        .bind(req.fingerprint.as_bytes().as_slice())
                        .bind(lease)
                        .bind(self.inner.lock_class)
                        .bind(lock_obj)
                })
                .await?;
            let mut current = None;
            for row in &rows {
                let claimed: bool = column(row, "claimed", P)?;
                let raw = raw_record(row, P)?;
                if claimed {
                    return Ok(Begin::Acquired(Lease {
                        scope: req.scope.clone(),
                        key: req.key.clone(),
                        fence: raw.fence(P)?,
                        until: raw.until(),
                        took_over: column(row, "took_over", P)?,
                    }));
                }
                current = Some((raw, now_of(row, P)?));
            }
            match current {
                Some((raw, now)) if raw.decides(req, now, P)? => return raw.answer(req, now, P),
                // Absent or expired in our snapshot, yet not ours: another
                // caller changed the record meanwhile. Look again.
                _ => {
                    tracing::trace!(round, "begin raced a concurrent change; re-reading");
                    if round > 0 {
                        tokio::time::sleep(common::backoff(round)).await;
                    }
                }
            }
        }
        Err(StoreError::unavailable(
            P,
            format!("the record kept changing; gave up after {SETTLE_ROUNDS} reads"),
        ))
    }

    async fn complete(
        &self,
        lease: &Lease,
        response: &StoredResponse,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        const P: Phase = Phase::Complete;
        let blob = response.encode();
        let payload = Self::payload(&lease.scope, &lease.key);
        let sql = &self.inner.sql.complete;
        let rows = self
            .fetch_all(P, || {
                let q = sqlx::query(sql)
                    .bind(common::span_ms(ttl))
                    .bind(blob.as_slice());
                self.notifying(bind_lease(q, lease), &payload)
            })
            .await?;
        lease_kept(!rows.is_empty(), lease)
    }

    async fn release(&self, lease: &Lease) -> Result<(), StoreError> {
        const P: Phase = Phase::Release;
        let payload = Self::payload(&lease.scope, &lease.key);
        let sql = &self.inner.sql.release;
        let rows = self
            .fetch_all(P, || {
                self.notifying(bind_lease(sqlx::query(sql), lease), &payload)
            })
            .await?;
        lease_kept(!rows.is_empty(), lease)
    }

    async fn extend(&self, lease: &Lease, lease_for: Duration) -> Result<Lease, StoreError> {
        const P: Phase = Phase::Extend;
        let sql = &self.inner.sql.extend;
        let rows = self
            .fetch_all(P, || {
                bind_lease(sqlx::query(sql).bind(common::span_ms(lease_for)), lease)
            })
            .await?;
        let Some(row) = rows.first() else {
            return Err(StoreError::LeaseLost { fence: lease.fence });
        };
        let until: i64 = column(row, "deadline", P)?;
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
        const P: Phase = Phase::Hold;
        let sql = &self.inner.sql.hold;
        let rows = self
            .fetch_all(P, || {
                bind_lease(
                    sqlx::query(sql)
                        .bind(common::span_ms(hold_for))
                        .bind(reason.as_str().as_bytes()),
                    lease,
                )
            })
            .await?;
        let Some(row) = rows.first() else {
            return Err(StoreError::LeaseLost { fence: lease.fence });
        };
        let until: i64 = column(row, "deadline", P)?;
        Ok(Lease {
            until: millis(until),
            ..lease.clone()
        })
    }

    async fn get(&self, scope: &Scope, key: &IdempotencyKey) -> Result<Option<Record>, StoreError> {
        const P: Phase = Phase::Get;
        let Some(row) = self.fetch_keyed(P, &self.inner.sql.get, scope, key).await? else {
            return Ok(None);
        };
        let raw = raw_record(&row, P)?;
        if !raw.is_live(now_of(&row, P)?) {
            return Ok(None);
        }
        raw.to_record(P).map(Some)
    }

    async fn delete(&self, scope: &Scope, key: &IdempotencyKey) -> Result<bool, StoreError> {
        const P: Phase = Phase::Delete;
        let payload = Self::payload(scope, key);
        let sql = &self.inner.sql.delete;
        let rows = self
            .fetch_all(P, || {
                self.notifying(bind_key(sqlx::query(sql), scope, key), &payload)
            })
            .await?;
        Ok(!rows.is_empty())
    }

    /// Deletes expired records in batches of 1,000 (one statement each,
    /// skipping rows another transaction holds) until a batch comes back
    /// short.
    async fn purge_expired(&self) -> Result<u64, StoreError> {
        const P: Phase = Phase::Purge;
        let sql = &self.inner.sql.purge;
        common::in_batches(PURGE_BATCH, || async {
            let done = with_retries(P, || {
                self.attempt(P, |pool| async move {
                    sqlx::query(sql).bind(PURGE_BATCH).execute(&pool).await
                })
            })
            .await?;
            Ok(done.rows_affected())
        })
        .await
    }

    /// Waits for a `NOTIFY` from `complete`, `release` or `delete` of this
    /// key (one `LISTEN` connection per store, shared by all waiters), for
    /// the holder's lease to end (the key may then be taken over), or for
    /// `max`, whichever comes first. Without notifications (turned off, or
    /// `LISTEN` failed) it polls every [`PostgresOptions::poll_interval`].
    async fn wait_for_change(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        max: Duration,
    ) -> Result<(), StoreError> {
        let started = tokio::time::Instant::now();
        let deadline = common::instant_after(started, max);
        let wanted = record_hash(scope.as_str(), key.as_str());
        // Subscribe before reading, so a change committed after the read is
        // always seen as a notification.
        let mut rx = if self.inner.notify {
            self.inner
                .hub
                .subscribe(&self.inner.pool, &self.inner.channel)
                .await
        } else {
            None
        };
        let Some((fence, left)) = self.live_claim(scope, key).await? else {
            return Ok(());
        };
        let until = common::instant_after(started, left + Duration::from_millis(1)).min(deadline);
        match rx.as_mut() {
            Some(rx) => loop {
                match tokio::time::timeout_at(until, rx.recv()).await {
                    Err(_) => return Ok(()),
                    Ok(Ok(Wake::Key(h))) if h != wanted => continue,
                    // Our key, everyone (the listener reconnected), lagged or closed.
                    Ok(_) => return Ok(()),
                }
            },
            None => {
                common::poll_while_claimed(until, self.inner.poll_interval, fence, || async {
                    Ok(self.live_claim(scope, key).await?.map(|(f, _)| f))
                })
                .await
            }
        }
    }

    fn admin(&self) -> Option<&dyn KeyAdmin> {
        Some(self)
    }
}

/// Listing: one `SELECT … ORDER BY fence DESC LIMIT n` per page (the
/// shared statement of the SQL stores), newest claim first, in its own
/// autocommit `READ COMMITTED` snapshot, time by the database's `now()`.
/// Without a scope filter PostgreSQL scans the table and keeps the newest
/// `n + 1` rows (a top-N sort: memory bounded by the page); with one it
/// reads only that scope's rows through the primary key. Retried like every
/// step on a serialization failure or deadlock; bounded by the statement
/// timeout.
#[async_trait]
impl KeyAdmin for PostgresStore {
    async fn list(&self, query: &ListQuery) -> Result<ListPage, StoreError> {
        const P: Phase = Phase::List;
        let records = self.inner.table.as_str();
        let st = list::statement(PG, records, false, query)?;
        let rows = self
            .fetch_all(P, || list::bind(PG, &st, None, sqlx::query(&st.sql)))
            .await?;
        list::page::<_, i16>(records, query, &rows)
    }

    /// Newest claim first (by fence), in every state.
    fn newest_first(&self) -> bool {
        true
    }
}

impl PostgresStore {
    /// The fence of the key's live claim and the time left on its lease;
    /// `None` when the key is absent, completed or past its lease.
    async fn live_claim(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
    ) -> Result<Option<(i64, Duration)>, StoreError> {
        const P: Phase = Phase::Get;
        let Some(row) = self
            .fetch_keyed(P, &self.inner.sql.claim_state, scope, key)
            .await?
        else {
            return Ok(None);
        };
        let claim = RawRecord {
            fingerprint: Vec::new(),
            state: column::<_, i16>(&row, "state", P)?.into(),
            fence: column(&row, "fence", P)?,
            deadline: column(&row, "deadline", P)?,
            response: None,
        };
        Ok(claim.live_claim(now_of(&row, P)?))
    }
}

/// What the listener tells waiters.
#[derive(Debug, Clone, Copy)]
enum Wake {
    /// A record with this hash changed.
    Key(u64),
    /// Anything may have changed (the listener lost its connection).
    All,
}

/// The shared `LISTEN` connection: one task receives notifications and
/// fans them out to waiters through a broadcast channel.
#[derive(Debug)]
struct Hub {
    tx: broadcast::Sender<Wake>,
    state: tokio::sync::Mutex<HubState>,
    /// When `LISTEN` last failed (set by `subscribe` or by the listener
    /// task when its connection fails for good): waiters poll until
    /// [`LISTEN_RETRY_AFTER`] has passed, instead of each re-dialling.
    failed_at: Arc<std::sync::Mutex<Option<tokio::time::Instant>>>,
    connect_timeout: Duration,
}

#[derive(Debug, Default)]
struct HubState {
    task: Option<tokio::task::JoinHandle<()>>,
    /// The listener's own one-connection pool (closed on `stop`).
    pool: Option<PgPool>,
}

impl Hub {
    fn new(connect_timeout: Duration) -> Self {
        Self {
            tx: broadcast::channel(1024).0,
            state: tokio::sync::Mutex::new(HubState::default()),
            failed_at: Arc::default(),
            connect_timeout,
        }
    }

    fn mark_failed(failed_at: &std::sync::Mutex<Option<tokio::time::Instant>>) {
        *failed_at.lock().unwrap_or_else(|p| p.into_inner()) = Some(tokio::time::Instant::now());
    }

    fn recently_failed(&self) -> bool {
        self.failed_at
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some_and(|at| at.elapsed() < LISTEN_RETRY_AFTER)
    }

    /// A receiver of notifications, once `LISTEN` is in effect; `None` when
    /// notifications are unavailable (the caller polls).
    async fn subscribe(&self, pool: &PgPool, channel: &str) -> Option<broadcast::Receiver<Wake>> {
        let mut st = self.state.lock().await;
        if st.task.as_ref().is_some_and(|t| !t.is_finished()) {
            return Some(self.tx.subscribe());
        }
        if self.recently_failed() {
            return None;
        }
        let lpool = PgPoolOptions::new()
            .max_connections(1)
            .acquire_timeout(self.connect_timeout)
            .idle_timeout(None)
            .max_lifetime(None)
            .test_before_acquire(false)
            .connect_lazy_with(pool.connect_options().as_ref().clone());
        let started = tokio::time::timeout(self.connect_timeout, async {
            let mut listener = PgListener::connect_with(&lpool).await?;
            listener.listen(channel).await?;
            Ok::<_, sqlx::Error>(listener)
        })
        .await;
        let mut listener = match started {
            Ok(Ok(l)) => l,
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "LISTEN failed; waiters poll instead");
                Self::mark_failed(&self.failed_at);
                return None;
            }
            Err(_) => {
                tracing::warn!("LISTEN timed out; waiters poll instead");
                Self::mark_failed(&self.failed_at);
                return None;
            }
        };
        let rx = self.tx.subscribe();
        let tx = self.tx.clone();
        let failed_at = self.failed_at.clone();
        st.task = Some(tokio::spawn(async move {
            loop {
                match listener.try_recv().await {
                    Ok(Some(n)) => {
                        let wake = u64::from_str_radix(n.payload(), 16)
                            .map(Wake::Key)
                            .unwrap_or(Wake::All);
                        let _ = tx.send(wake);
                    }
                    // The connection was lost and re-established: anything
                    // sent meanwhile is gone, so wake everyone to look again.
                    Ok(None) => {
                        let _ = tx.send(Wake::All);
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "LISTEN connection failed; waiters poll");
                        Hub::mark_failed(&failed_at);
                        let _ = tx.send(Wake::All);
                        return;
                    }
                }
            }
        }));
        st.pool = Some(lpool);
        Some(rx)
    }

    async fn stop(&self) {
        let mut st = self.state.lock().await;
        if let Some(t) = st.task.take() {
            t.abort();
        }
        if let Some(p) = st.pool.take() {
            p.close().await;
        }
        let _ = self.tx.send(Wake::All);
    }
}

impl Drop for Hub {
    fn drop(&mut self) {
        if let Ok(mut st) = self.state.try_lock() {
            if let Some(t) = st.task.take() {
                t.abort();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statements_quote_validated_names() {
        let s = Statements::new("\"s\".\"t\"", "\"s\".\"t_fence\"", true);
        assert!(s.begin.contains("INSERT INTO \"s\".\"t\" AS r"));
        assert!(s.begin.contains("nextval('\"s\".\"t_fence\"')"));
        assert!(s.complete.contains("pg_notify($6, $7)"));
        let quiet = Statements::new("\"s\".\"t\"", "\"s\".\"t_fence\"", false);
        assert!(!quiet.complete.contains("pg_notify"));
    }

    #[test]
    fn bad_names_are_config_errors() {
        for (schema, table) in [
            ("public", "bad-name"),
            ("public", "x; DROP TABLE y"),
            ("pub\"lic", "t"),
            ("public", ""),
            ("public", &"t".repeat(55)),
        ] {
            let o = PostgresOptions::new("postgres://x/y")
                .with_schema(schema)
                .with_table(table);
            assert!(matches!(validate_names(&o), Err(StoreError::Config(_))));
        }
    }
}
