//! The service's database: the `orders` table (layer 3's constraints and
//! compare-and-set transitions) and the connection to SQLite or PostgreSQL.

use std::str::FromStr;
use std::time::Duration;

use idem_sql::patterns::{InsertOrGet, SqlValue, StateMachine, Transition};
use serde::Serialize;
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::sqlite::{SqliteConnectOptions, SqlitePool};
use sqlx::{Connection, FromRow};

use crate::{Error, Result};

/// Runs `$body` with `$conn` bound to a pooled connection of either
/// dialect. The body is type-checked once per dialect.
macro_rules! with_conn {
    ($db:expr, $conn:ident => $body:expr) => {
        match $db {
            $crate::db::Db::Sqlite(pool) => {
                let mut $conn = pool.acquire().await.map_err($crate::Error::from)?;
                $body
            }
            $crate::db::Db::Postgres(pool) => {
                let mut $conn = pool.acquire().await.map_err($crate::Error::from)?;
                $body
            }
        }
    };
}

/// Runs `$body` inside a transaction `$tx` (committed when the body returns
/// `Ok` — and, with a third argument, when that predicate accepts the
/// answer — rolled back otherwise).
macro_rules! with_tx {
    (@in $pool:expr, $tx:ident => $body:expr, $keep:expr) => {{
        let mut $tx = $pool.begin().await.map_err($crate::Error::from)?;
        let out = $body;
        if out.as_ref().is_ok_and($keep) {
            $tx.commit().await.map_err($crate::Error::from)?;
        }
        out
    }};
    // Commits only an `Ok` answer that `$keep` accepts (rolled back otherwise).
    ($db:expr, $tx:ident => $body:expr, $keep:expr) => {
        match $db {
            $crate::db::Db::Sqlite(pool) => with_tx!(@in pool, $tx => $body, $keep),
            $crate::db::Db::Postgres(pool) => with_tx!(@in pool, $tx => $body, $keep),
        }
    };
    ($db:expr, $tx:ident => $body:expr) => {
        with_tx!($db, $tx => $body, |_| true)
    };
}
pub(crate) use {with_conn, with_tx};

/// The order states. `PAYMENT_FAILED` may be paid again (a new attempt).
pub mod status {
    /// Created, not yet paid.
    pub const PENDING: &str = "PENDING";
    /// A payment attempt is running or its outcome is unknown (resumed by
    /// the next pay request).
    pub const PAYING: &str = "PAYING";
    /// Paid: terminal.
    pub const PAID: &str = "PAID";
    /// The provider declined the last attempt; paying again starts a new one.
    pub const PAYMENT_FAILED: &str = "PAYMENT_FAILED";
}

/// A connection pool on one of the two supported databases.
#[derive(Debug, Clone)]
pub enum Db {
    /// SQLite (one file).
    Sqlite(SqlitePool),
    /// PostgreSQL.
    Postgres(PgPool),
}

/// An order as stored and as answered (JSON); decoded from its row by column name.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, sqlx::FromRow)]
pub struct Order {
    /// Row id.
    pub id: i64,
    /// The caller's order number (unique).
    pub outer_order_no: String,
    /// Amount in cents (1 ..= [`crate::MAX_AMOUNT_CENTS`]).
    pub amount_cents: i64,
    /// One of [`status`].
    pub status: String,
    /// The current payment attempt (1-based); the provider key of an
    /// attempt is `order-{id}-attempt-{attempt}`.
    pub attempt: i64,
    /// The highest lock fence that has written this order (0: none yet).
    pub fence: i64,
    /// The provider charge that paid the order, once `PAID`.
    pub charge_id: Option<i64>,
    /// Creation time, ms since the Unix epoch.
    pub created_at: i64,
    /// Last change, ms since the Unix epoch.
    pub updated_at: i64,
}

pub(crate) fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

const SQLITE_SCHEMA: &[&str] = &[
    "CREATE TABLE IF NOT EXISTS orders (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        outer_order_no TEXT NOT NULL UNIQUE,
        amount_cents INTEGER NOT NULL CHECK (amount_cents > 0),
        status TEXT NOT NULL,
        attempt INTEGER NOT NULL DEFAULT 1,
        fence INTEGER NOT NULL DEFAULT 0,
        charge_id INTEGER,
        created_at INTEGER NOT NULL,
        updated_at INTEGER NOT NULL)",
    "CREATE TABLE IF NOT EXISTS provider_charges (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        order_id INTEGER NOT NULL,
        amount_cents INTEGER NOT NULL,
        provider_key TEXT NOT NULL UNIQUE,
        outcome TEXT NOT NULL,
        fence INTEGER NOT NULL,
        created_at INTEGER NOT NULL)",
    "CREATE INDEX IF NOT EXISTS provider_charges_order ON provider_charges (order_id)",
    "CREATE TABLE IF NOT EXISTS provider_fences (
        order_id INTEGER PRIMARY KEY,
        fence INTEGER NOT NULL)",
    "CREATE TABLE IF NOT EXISTS key_fences (
        scope TEXT NOT NULL,
        idem_key TEXT NOT NULL,
        fence INTEGER NOT NULL,
        PRIMARY KEY (scope, idem_key))",
];

const POSTGRES_SCHEMA: &[&str] = &[
    "CREATE TABLE IF NOT EXISTS orders (
        id BIGSERIAL PRIMARY KEY,
        outer_order_no TEXT NOT NULL UNIQUE,
        amount_cents BIGINT NOT NULL CHECK (amount_cents > 0),
        status TEXT NOT NULL,
        attempt BIGINT NOT NULL DEFAULT 1,
        fence BIGINT NOT NULL DEFAULT 0,
        charge_id BIGINT,
        created_at BIGINT NOT NULL,
        updated_at BIGINT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS provider_charges (
        id BIGSERIAL PRIMARY KEY,
        order_id BIGINT NOT NULL,
        amount_cents BIGINT NOT NULL,
        provider_key TEXT NOT NULL UNIQUE,
        outcome TEXT NOT NULL,
        fence BIGINT NOT NULL,
        created_at BIGINT NOT NULL)",
    "CREATE INDEX IF NOT EXISTS provider_charges_order ON provider_charges (order_id)",
    "CREATE TABLE IF NOT EXISTS provider_fences (
        order_id BIGINT PRIMARY KEY,
        fence BIGINT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS key_fences (
        scope TEXT NOT NULL,
        idem_key TEXT NOT NULL,
        fence BIGINT NOT NULL,
        PRIMARY KEY (scope, idem_key))",
];

/// Checks a PostgreSQL schema name (`[A-Za-z_][A-Za-z0-9_]{0,62}`).
fn valid_schema(s: &str) -> bool {
    let mut chars = s.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_')
        && s.len() <= 63
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

impl Db {
    /// Connects to `url` (`sqlite://…`, `sqlite::memory:` is refused since
    /// each pooled connection would see its own database; `postgres://…`
    /// or `postgresql://…`). For PostgreSQL, `schema` (created when
    /// missing) becomes every connection's `search_path`, so all tables —
    /// the orders', the idempotency store's and the lock's — live there.
    ///
    /// # Errors
    /// [`Error::Config`] for an unknown scheme or bad schema name;
    /// [`Error::Database`] when the database cannot be reached.
    pub async fn connect(url: &str, schema: Option<&str>) -> Result<Self> {
        if url.starts_with("sqlite:") {
            if url.contains(":memory:") || url.contains("mode=memory") {
                return Err(Error::Config(
                    "an in-memory SQLite database cannot be shared by the pool; use a file".into(),
                ));
            }
            let opts = SqliteConnectOptions::from_str(url)
                .map_err(|e| Error::Config(format!("bad SQLite URL {url:?}: {e}")))?
                .create_if_missing(true)
                .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal)
                .synchronous(sqlx::sqlite::SqliteSynchronous::Full)
                .busy_timeout(Duration::from_secs(10));
            if let Some(dir) = opts.get_filename().parent() {
                if !dir.as_os_str().is_empty() {
                    std::fs::create_dir_all(dir).map_err(|e| {
                        Error::Config(format!("cannot create {}: {e}", dir.display()))
                    })?;
                }
            }
            let pool = sqlx::sqlite::SqlitePoolOptions::new()
                .max_connections(8)
                .acquire_timeout(Duration::from_secs(15))
                .connect_with(opts)
                .await?;
            Ok(Self::Sqlite(pool))
        } else if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            let opts = PgConnectOptions::from_str(url)
                .map_err(|e| Error::Config(format!("bad PostgreSQL URL: {e}")))?;
            let mut pool = PgPoolOptions::new()
                .max_connections(16)
                .acquire_timeout(Duration::from_secs(10));
            if let Some(schema) = schema {
                if !valid_schema(schema) {
                    return Err(Error::Config(format!(
                        "bad schema name {schema:?}: expected [A-Za-z_][A-Za-z0-9_]{{0,62}}"
                    )));
                }
                let mut conn = sqlx::PgConnection::connect_with(&opts).await?;
                sqlx::query(&format!("CREATE SCHEMA IF NOT EXISTS \"{schema}\""))
                    .execute(&mut conn)
                    .await?;
                conn.close().await?;
                let set = format!("SET search_path TO \"{schema}\"");
                pool = pool.after_connect(move |conn, _| {
                    let set = set.clone();
                    Box::pin(async move {
                        sqlx::query(&set).execute(conn).await?;
                        Ok(())
                    })
                });
            }
            Ok(Self::Postgres(pool.connect_with(opts).await?))
        } else {
            Err(Error::Config(format!(
                "unsupported database URL {url:?}: use sqlite://FILE or postgres://USER@HOST/DB"
            )))
        }
    }

    /// Creates the orders and provider tables when missing.
    ///
    /// # Errors
    /// [`Error::Database`].
    pub async fn migrate(&self) -> Result<()> {
        match self {
            Db::Sqlite(pool) => {
                for stmt in SQLITE_SCHEMA {
                    sqlx::query(stmt).execute(pool).await?;
                }
            }
            Db::Postgres(pool) => {
                let mut conn = pool.acquire().await?;
                // Serialise concurrent first starts (CREATE … IF NOT EXISTS
                // can still collide in the catalog).
                let mut tx = conn.begin().await?;
                sqlx::query("SELECT pg_advisory_xact_lock(7338801)")
                    .execute(&mut *tx)
                    .await?;
                for stmt in POSTGRES_SCHEMA {
                    sqlx::query(stmt).execute(&mut *tx).await?;
                }
                tx.commit().await?;
            }
        }
        Ok(())
    }
}

const ORDER_COLUMNS: &str =
    "id, outer_order_no, amount_cents, status, attempt, fence, charge_id, created_at, updated_at";

/// What [`Orders::create`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CreateOutcome {
    /// A new order row.
    Created(Order),
    /// The order number existed already with the same amount.
    Existing(Order),
    /// The order number existed already with another amount.
    Conflict(Order),
}

/// What a fenced transition did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fenced {
    /// The compare-and-set ran (or the order was already in the target).
    Done(Transition),
    /// A holder with a higher fence has written the order: this holder's
    /// lease has passed; nothing was written.
    Stale {
        /// The fence recorded on the order.
        current: i64,
    },
    /// A later run of the same idempotency key has written (its
    /// `Idempotency-Fence` is higher than this run's): this run lost its
    /// key; nothing was written.
    StaleKey {
        /// The highest fence recorded for the key.
        current: i64,
    },
}

/// The idempotency key a pay request runs under and the fence of its claim
/// (`idem_http::Fence`, what `idem gateway` forwards as
/// `Idempotency-Fence`), as the service records it: table `key_fences`
/// keeps the highest fence seen per (scope, key), and a write carrying a
/// lower one is refused (docs/PROTOCOL.md, "Fences").
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct KeyFence {
    /// The caller's scope as the idempotency layer derives it
    /// (`Scope::as_str`): fences of one key in different scopes are not
    /// comparable.
    pub scope: String,
    /// The `Idempotency-Key`.
    pub key: String,
    /// The claim's fence (a u64 that fits an `i64`).
    pub fence: i64,
}

/// The order table's operations (layer 3).
#[derive(Debug, Clone)]
pub struct Orders {
    db: Db,
    insert: InsertOrGet,
    machine: StateMachine,
}

impl Orders {
    /// The operations on `db` (tables made by [`Db::migrate`]).
    ///
    /// # Errors
    /// [`Error::Pattern`] (cannot happen with the fixed names used here).
    pub fn new(db: Db) -> Result<Self> {
        Ok(Self {
            db,
            insert: InsertOrGet::new("orders", "id", "outer_order_no")?,
            machine: StateMachine::new("orders", "id", "status")?,
        })
    }

    /// The database.
    pub fn db(&self) -> &Db {
        &self.db
    }

    /// Insert-or-get on the unique `outer_order_no`: concurrent creates of
    /// one number make one row; every caller learns its id.
    ///
    /// # Errors
    /// [`Error::Database`] / [`Error::Pattern`].
    pub async fn create(&self, outer_order_no: &str, amount_cents: i64) -> Result<CreateOutcome> {
        let now = now_ms();
        let created = with_conn!(&self.db, conn => {
            self.insert
                .insert_or_get(
                    &mut *conn,
                    outer_order_no,
                    &[
                        ("amount_cents", SqlValue::from(amount_cents)),
                        ("status", SqlValue::from(status::PENDING)),
                        ("attempt", SqlValue::from(1_i64)),
                        ("fence", SqlValue::from(0_i64)),
                        ("created_at", SqlValue::from(now)),
                        ("updated_at", SqlValue::from(now)),
                    ],
                )
                .await?
        });
        let id = match created.id {
            SqlValue::I64(id) => id,
            other => return Err(Error::Internal(format!("unexpected order id {other:?}"))),
        };
        let order = self
            .get(id)
            .await?
            .ok_or_else(|| Error::Internal(format!("order {id} vanished after insert")))?;
        Ok(if created.inserted {
            CreateOutcome::Created(order)
        } else if order.amount_cents == amount_cents {
            CreateOutcome::Existing(order)
        } else {
            CreateOutcome::Conflict(order)
        })
    }

    /// The order `id`, if any.
    ///
    /// # Errors
    /// [`Error::Database`].
    pub async fn get(&self, id: i64) -> Result<Option<Order>> {
        let sql = format!("SELECT {ORDER_COLUMNS} FROM orders WHERE id = $1");
        with_conn!(&self.db, conn => {
            match sqlx::query(&sql).bind(id).fetch_optional(&mut *conn).await? {
                Some(row) => Ok(Some(Order::from_row(&row)?)),
                None => Ok(None),
            }
        })
    }

    /// A compare-and-set transition of order `id` from one of `from` to
    /// `to` (also setting `set` and `updated_at`), guarded by the lock's
    /// `fence`: in one transaction, `UPDATE orders SET fence = $f WHERE id
    /// = $id AND fence <= $f` records the fence (and, on PostgreSQL, locks
    /// the row), then [`StateMachine::transition_setting`] runs. A holder
    /// whose fence is lower than the one recorded gets [`Fenced::Stale`]
    /// and writes nothing. Same as [`Self::transition_as`] without a key
    /// fence.
    ///
    /// # Errors
    /// [`Error::Database`] / [`Error::Pattern`]; [`Error::NotFound`] when
    /// there is no order `id`.
    pub async fn transition(
        &self,
        id: i64,
        fence: i64,
        from: &[&str],
        to: &str,
        set: &[(&str, SqlValue)],
    ) -> Result<Fenced> {
        self.transition_as(id, fence, None, from, to, set).await
    }

    /// [`Self::transition`], also guarded by the idempotency key's fence
    /// `key` (when the request came through the idempotency layer): first in
    /// the same transaction, `INSERT INTO key_fences … ON CONFLICT DO
    /// UPDATE SET fence = $f WHERE key_fences.fence <= $f` raises the key's
    /// recorded fence; when a higher one is recorded (a later run of the
    /// same key has written: this run lost its key after an unknown
    /// outcome) the answer is [`Fenced::StaleKey`] and nothing is written.
    ///
    /// # Errors
    /// As for [`Self::transition`].
    pub async fn transition_as(
        &self,
        id: i64,
        fence: i64,
        key: Option<&KeyFence>,
        from: &[&str],
        to: &str,
        set: &[(&str, SqlValue)],
    ) -> Result<Fenced> {
        let mut set: Vec<(&str, SqlValue)> = set.to_vec();
        set.push(("updated_at", SqlValue::from(now_ms())));
        // Only a transition that ran is committed: a refusal writes nothing
        // (not even the raised key fence).
        with_tx!(&self.db, tx => {
            let mut stale_key = None;
            if let Some(kf) = key {
                let raised: Option<i64> = sqlx::query_scalar(
                    "INSERT INTO key_fences (scope, idem_key, fence) VALUES ($1, $2, $3) \
                     ON CONFLICT (scope, idem_key) DO UPDATE SET fence = excluded.fence \
                     WHERE key_fences.fence <= excluded.fence RETURNING fence",
                )
                .bind(kf.scope.as_str())
                .bind(kf.key.as_str())
                .bind(kf.fence)
                .fetch_optional(&mut *tx)
                .await?;
                if raised.is_none() {
                    let current: i64 = sqlx::query_scalar(
                        "SELECT fence FROM key_fences WHERE scope = $1 AND idem_key = $2",
                    )
                    .bind(kf.scope.as_str())
                    .bind(kf.key.as_str())
                    .fetch_one(&mut *tx)
                    .await?;
                    stale_key = Some(current);
                }
            }
            if let Some(current) = stale_key {
                Ok(Fenced::StaleKey { current })
            } else {
                let claimed = sqlx::query("UPDATE orders SET fence = $1 WHERE id = $2 AND fence <= $1")
                    .bind(fence)
                    .bind(id)
                    .execute(&mut *tx)
                    .await?
                    .rows_affected();
                if claimed == 0 {
                    let current: Option<i64> = sqlx::query_scalar("SELECT fence FROM orders WHERE id = $1")
                        .bind(id)
                        .fetch_optional(&mut *tx)
                        .await?;
                    match current {
                        Some(current) => Ok(Fenced::Stale { current }),
                        None => Err(Error::NotFound(id)),
                    }
                } else {
                    let t = self
                        .machine
                        .transition_setting(&mut *tx, id, from, to, &set)
                        .await?;
                    Ok(Fenced::Done(t))
                }
            }
        }, |f: &Fenced| matches!(f, Fenced::Done(_)))
    }
}
