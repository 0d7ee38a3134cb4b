//! The transactional inbox: exactly-once *effect* for message consumers.
//!
//! A broker delivers at least once. To apply each message's effect once, the
//! consumer records "processed" in the **same transaction** as the business
//! writes, and acknowledges the message only after that transaction
//! committed:
//!
//! ```text
//! BEGIN
//!   INSERT INTO idem_inbox (consumer, message_id, processed_at)   -- first statement
//!     duplicate key (SQLSTATE 23505 / MySQL 1062 / SQLite 1555|2067)
//!       → ROLLBACK, the message was processed before: ack it, skip the handler
//!   … the handler's business writes, on the same transaction …
//! COMMIT                                                           -- effect + inbox row, or neither
//! ack                                                              -- only now
//! ```
//!
//! Crash windows: a crash before `COMMIT` leaves neither the effect nor the
//! row, so the redelivery applies the message once; a crash between `COMMIT`
//! and the ack leaves both, so the redelivery finds the row and is acked
//! without running the handler. **This is the path to use for money**: the
//! store-based dedup of `idem-mq` keeps its record in a different place than
//! the effect, so a crash between the two can lose or repeat an effect.
//!
//! The inbox row is inserted *first*. On PostgreSQL a failed statement aborts
//! the whole transaction, so nothing has been written yet when the duplicate
//! is found and the transaction is simply rolled back (no savepoint needed).
//! A concurrent copy of the same message blocks on the first copy's
//! uncommitted row until that transaction ends (all three databases), then
//! sees the duplicate (committed) or inserts (rolled back). Duplicates are
//! recognised by error code, never by message text (PostgreSQL localises its
//! messages). On MySQL/MariaDB a deadlock (1213) or lock-wait timeout (1205)
//! on the inbox insert, on PostgreSQL a deadlock (40P01) or serialization
//! failure (40001), and on SQLite `SQLITE_BUSY` are retried
//! ([`InboxOptions::retries`] times).
//!
//! **Retention.** Rows are kept until [`Inbox::purge_older_than`] removes
//! them. A redelivery that arrives after its row was purged **is processed
//! again**: the window must exceed the broker's longest redelivery horizon
//! (NATS `max_deliver × ack_wait` plus back-off, a RabbitMQ queue's message
//! TTL or dead-letter round trips, a publisher's retry horizon).
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use idem_sql::inbox::{Claim, Inbox};
//!
//! let pool = sqlx::SqlitePool::connect("sqlite::memory:").await?;
//! sqlx::query("CREATE TABLE credits (payment_id TEXT, cents INTEGER)").execute(&pool).await?;
//! let inbox = Inbox::new(pool.clone());
//! inbox.migrate().await?;
//!
//! for _delivery in 0..2 {
//!     match inbox.claim("payments", "pay-1").await? {
//!         Claim::New(mut tx) => {
//!             sqlx::query("INSERT INTO credits VALUES ('pay-1', 500)").execute(&mut **tx).await?;
//!             tx.commit().await?; // effect + inbox row in one commit; ack after this
//!         }
//!         Claim::Duplicate => { /* processed before: ack without running the handler */ }
//!     }
//! }
//! let n: i64 = sqlx::query_scalar("SELECT count(*) FROM credits").fetch_one(&pool).await?;
//! assert_eq!(n, 1);
//! # Ok(()) }
//! ```

use std::future::Future;
use std::ops::{Deref, DerefMut};
use std::pin::Pin;
use std::time::Duration;

use async_trait::async_trait;
use sqlx::{Pool, Transaction};

use crate::common::{retry, BACKOFF_BASE};
use crate::dialect::{error_kind, is_plain_ident, Dialect, ErrorKind};

/// The default inbox table name.
pub const DEFAULT_TABLE: &str = "idem_inbox";

/// Longest consumer name and message id accepted, in bytes (the columns are
/// `VARBINARY(255)` on MySQL). Hash longer ids first (`idem-mq` does).
pub const MAX_ID_LEN: usize = 255;

/// The longest age [`Inbox::purge_older_than`] uses: 100 years (36,525
/// days). Longer ages saturate to it; the cut-off "now − 100 years" is
/// representable on every database (MySQL's `DATETIME` starts at year 1000,
/// PostgreSQL's `make_interval` overflowed on `Duration::MAX`).
pub const MAX_PURGE_AGE: Duration = Duration::from_secs(36_525 * 24 * 3600);

/// Longest table-name part (PostgreSQL's `NAMEDATALEN - 1`).
const MAX_IDENT_LEN: usize = 63;

/// Why the inbox could not answer. The driver's error is kept as the
/// [`source`](std::error::Error::source).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum InboxError {
    /// The table name is not `[A-Za-z_][A-Za-z0-9_]{0,62}`, optionally
    /// `schema.table`. Nothing was sent.
    #[error(
        "inbox table name {0:?} is not a plain identifier: use 1 to 63 characters of \
         [A-Za-z0-9_], not starting with a digit (optionally schema.table)"
    )]
    InvalidTable(String),
    /// A consumer name or message id is empty or longer than [`MAX_ID_LEN`] bytes.
    #[error("{what} is {len} bytes long; it must be 1 to 255 bytes")]
    InvalidId {
        /// `"consumer"` or `"message id"`.
        what: &'static str,
        /// Its length in bytes.
        len: usize,
    },
    /// The database refused or could not be reached. After a failed
    /// `commit` the outcome is unknown: do not ack; the redelivery finds the
    /// row (committed) or applies the message (not committed).
    #[error("inbox {op} failed")]
    Database {
        /// `"begin"`, `"insert"`, `"commit"`, `"rollback"`, `"migrate"`, `"purge"`, `"lookup"`.
        op: &'static str,
        /// The driver's error.
        #[source]
        source: sqlx::Error,
    },
}

impl InboxError {
    fn db(op: &'static str) -> impl FnOnce(sqlx::Error) -> Self {
        move |source| Self::Database { op, source }
    }
}

/// The error of [`Inbox::process`]: the inbox's own, or the handler's.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ProcessError<E> {
    /// The inbox failed (the handler may or may not have run; nothing is
    /// known to be committed unless the op is `"commit"`, where the outcome
    /// is unknown). Do not ack.
    #[error(transparent)]
    Inbox(#[from] InboxError),
    /// The handler failed; its transaction was rolled back, the inbox row
    /// with it. Do not ack: the redelivery runs the handler again.
    #[error("message handler failed")]
    Handler(#[source] E),
}

/// The answer of [`Inbox::process`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Processed<T> {
    /// The handler ran and its writes committed together with the inbox row.
    Applied(T),
    /// The message was processed before (its row is in the inbox): the
    /// handler did not run. Ack it.
    Duplicate,
}

/// The answer of [`Inbox::claim`].
#[derive(Debug)]
pub enum Claim<DB: InboxDatabase> {
    /// The inbox row is inserted, uncommitted, in this open transaction: run
    /// the business writes on it, then [`InboxTx::commit`], then ack.
    /// Dropping it rolls back (the row with it).
    New(InboxTx<DB>),
    /// The message was processed before: ack it without running the handler.
    Duplicate,
}

/// An open transaction that holds a new inbox row. Derefs to the sqlx
/// [`Transaction`]: run the handler's writes with `&mut **tx`.
#[derive(Debug)]
pub struct InboxTx<DB: InboxDatabase> {
    tx: Transaction<'static, DB>,
}

impl<DB: InboxDatabase> InboxTx<DB> {
    /// Commits the business writes and the inbox row together. Ack the
    /// message only after this returned `Ok`.
    ///
    /// # Errors
    /// [`InboxError::Database`] with op `"commit"`: the outcome is unknown; do not ack.
    pub async fn commit(self) -> Result<(), InboxError> {
        self.tx.commit().await.map_err(InboxError::db("commit"))
    }

    /// Rolls back the business writes and the inbox row.
    ///
    /// # Errors
    /// [`InboxError::Database`] with op `"rollback"` (the database rolls
    /// back by itself when the connection goes).
    pub async fn rollback(self) -> Result<(), InboxError> {
        self.tx.rollback().await.map_err(InboxError::db("rollback"))
    }
}

impl<DB: InboxDatabase> Deref for InboxTx<DB> {
    type Target = Transaction<'static, DB>;
    fn deref(&self) -> &Self::Target {
        &self.tx
    }
}

impl<DB: InboxDatabase> DerefMut for InboxTx<DB> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.tx
    }
}

/// Settings of an [`Inbox`].
#[derive(Debug, Clone)]
pub struct InboxOptions {
    /// The table, `[A-Za-z_][A-Za-z0-9_]{0,62}` optionally `schema.table`.
    /// Default [`DEFAULT_TABLE`] (`idem_inbox`).
    pub table: String,
    /// How many times a deadlock / lock-wait timeout / busy database on the
    /// inbox insert is retried (a new transaction each time, after a pause
    /// of 5 ms × 2ⁿ, jittered). Default 5.
    pub retries: u32,
}

impl Default for InboxOptions {
    fn default() -> Self {
        Self {
            table: DEFAULT_TABLE.to_owned(),
            retries: 5,
        }
    }
}

impl InboxOptions {
    /// Sets [`Self::table`].
    pub fn with_table(mut self, table: impl Into<String>) -> Self {
        self.table = table.into();
        self
    }

    /// Sets [`Self::retries`].
    pub fn with_retries(mut self, retries: u32) -> Self {
        self.retries = retries;
        self
    }
}

/// A future the handler of [`Inbox::process`] returns, borrowing the transaction.
pub type TxFuture<'t, T, E> = Pin<Box<dyn Future<Output = Result<T, E>> + Send + 't>>;

/// The transactional inbox over a sqlx pool: SQLite
/// (`Inbox<sqlx::Sqlite>`), PostgreSQL (`Inbox<sqlx::Postgres>`, feature
/// `postgres`), MySQL/MariaDB (`Inbox<sqlx::MySql>`, feature `mysql`).
/// See the [module docs](self) for the protocol and its guarantees.
///
/// Table (created by [`Inbox::migrate`]): `consumer` (≤ 255 bytes),
/// `message_id` (≤ 255 bytes), `processed_at` (store time: PostgreSQL
/// `timestamptz`, MySQL `DATETIME(3)` UTC, SQLite integer ms since the
/// epoch); primary key `(consumer, message_id)`, compared byte for byte
/// (MySQL `VARBINARY(255)`: no collation, so `m1` and `m1 ` are two
/// messages); an index on `processed_at` for purges.
#[derive(Debug, Clone)]
pub struct Inbox<DB: InboxDatabase> {
    pool: Pool<DB>,
    sql: Statements,
    retries: u32,
}

#[derive(Debug, Clone)]
#[doc(hidden)]
pub struct Statements {
    migrate: Vec<String>,
    upgrade: Option<Upgrade>,
    insert: String,
    exists: String,
    purge: String,
    /// The purge's bound value per millisecond of age (MySQL binds µs).
    purge_units_per_ms: i64,
}

/// A column-type upgrade of a table made by an earlier version: run
/// `alter` when `check` (bound: `schema`, `table`) finds a row.
#[derive(Debug, Clone)]
struct Upgrade {
    check: String,
    alter: String,
    schema: String,
    table: String,
}

impl Statements {
    /// The inbox's statements on `table` (validated parts) in dialect `d`:
    /// only the table's DDL, the time stamp and the purge cut-off differ.
    fn new(d: Dialect, table: &[String]) -> Self {
        let t = d.quote_path(table);
        let name = table.last().expect("one part at least");
        let [p1, p2] = d.params::<2>();
        let index = d.quote(&format!("{name}_processed_at"));
        let (migrate, stamp, cutoff, purge_units_per_ms) = match d {
            Dialect::Sqlite => {
                // SQLite qualifies the index, not its table.
                let index = match table {
                    [schema, _] => format!("{}.{index}", d.quote(schema)),
                    _ => index,
                };
                let now_ms = d.now_ms();
                (
                    vec![
                        format!(
                            "CREATE TABLE IF NOT EXISTS {t} (consumer TEXT NOT NULL, \
                             message_id TEXT NOT NULL, processed_at INTEGER NOT NULL, \
                             PRIMARY KEY (consumer, message_id)) WITHOUT ROWID"
                        ),
                        format!(
                            "CREATE INDEX IF NOT EXISTS {index} ON {} (processed_at)",
                            d.quote(name)
                        ),
                    ],
                    now_ms.to_owned(),
                    format!("{now_ms} - ?1"),
                    1,
                )
            }
            #[cfg(feature = "postgres")]
            Dialect::Postgres => (
                vec![
                    format!(
                        "CREATE TABLE IF NOT EXISTS {t} (consumer TEXT NOT NULL, \
                         message_id TEXT NOT NULL, processed_at TIMESTAMPTZ NOT NULL DEFAULT now(), \
                         PRIMARY KEY (consumer, message_id))"
                    ),
                    format!("CREATE INDEX IF NOT EXISTS {index} ON {t} (processed_at)"),
                ],
                "now()".to_owned(),
                "now() - make_interval(secs => $1::float8 / 1000)".to_owned(),
                1,
            ),
            // VARBINARY, as `idem_records`: a character column pads trailing
            // spaces even under `utf8mb4_bin` ('m1' = 'm1 '), and two
            // distinct messages would share one row.
            #[cfg(feature = "mysql")]
            Dialect::MySql => (
                vec![format!(
                    "CREATE TABLE IF NOT EXISTS {t} (consumer VARBINARY(255) NOT NULL, \
                     message_id VARBINARY(255) NOT NULL, processed_at DATETIME(3) NOT NULL, \
                     PRIMARY KEY (consumer, message_id), KEY {index} (processed_at)) \
                     ENGINE=InnoDB"
                )],
                "UTC_TIMESTAMP(3)".to_owned(),
                "UTC_TIMESTAMP(3) - INTERVAL ? MICROSECOND".to_owned(),
                1000,
            ),
        };
        // A MySQL table made by an earlier version has `VARCHAR(255)
        // utf8mb4_bin` columns: found by the first query (bound: schema or
        // '' for the current database, table), converted by the second.
        // The bytes are kept; rows unique under the padding collation stay
        // unique byte for byte.
        let upgrade = match d {
            #[cfg(feature = "mysql")]
            Dialect::MySql => Some(Upgrade {
                check: "SELECT 1 FROM information_schema.COLUMNS \
                        WHERE TABLE_SCHEMA = COALESCE(NULLIF(?, ''), DATABASE()) \
                        AND TABLE_NAME = ? AND COLUMN_NAME IN ('consumer', 'message_id') \
                        AND DATA_TYPE <> 'varbinary' LIMIT 1"
                    .to_owned(),
                alter: format!(
                    "ALTER TABLE {t} MODIFY consumer VARBINARY(255) NOT NULL, \
                     MODIFY message_id VARBINARY(255) NOT NULL"
                ),
                schema: match table {
                    [schema, _] => schema.clone(),
                    _ => String::new(),
                },
                table: name.clone(),
            }),
            #[allow(unreachable_patterns)]
            _ => None,
        };
        Self {
            migrate,
            upgrade,
            insert: format!(
                "INSERT INTO {t} (consumer, message_id, processed_at) VALUES ({p1}, {p2}, {stamp})"
            ),
            exists: format!("SELECT 1 FROM {t} WHERE consumer = {p1} AND message_id = {p2}"),
            purge: format!("DELETE FROM {t} WHERE processed_at < {cutoff}"),
            purge_units_per_ms,
        }
    }
}

impl<DB: InboxDatabase> Inbox<DB> {
    /// An inbox on table [`DEFAULT_TABLE`]. Call [`Self::migrate`] once.
    pub fn new(pool: Pool<DB>) -> Self {
        Self::with_options(pool, InboxOptions::default()).expect("the default table name is valid")
    }

    /// An inbox with these options.
    ///
    /// # Errors
    /// [`InboxError::InvalidTable`] for a bad table name (nothing is sent).
    pub fn with_options(pool: Pool<DB>, options: InboxOptions) -> Result<Self, InboxError> {
        let parts = split_table(&options.table)?;
        Ok(Self {
            pool,
            sql: Statements::new(DB::DIALECT, &parts),
            retries: options.retries,
        })
    }

    /// The pool (for the handler's own reads, or tests).
    pub fn pool(&self) -> &Pool<DB> {
        &self.pool
    }

    /// Creates the table and its index if missing (idempotent).
    ///
    /// On MySQL/MariaDB it also upgrades a table made by idem 0.1's first
    /// inbox, whose `VARCHAR(255) utf8mb4_bin` id columns treated ids that
    /// differ only by trailing spaces as one (`'m1' = 'm1 '`): the columns
    /// become `VARBINARY(255)` (`ALTER TABLE … MODIFY`, bytes kept; it
    /// rebuilds the table, so on a large inbox run it at a quiet time or
    /// purge first). Nothing is altered once the columns are binary.
    ///
    /// # Errors
    /// [`InboxError::Database`] (op `"migrate"`).
    pub async fn migrate(&self) -> Result<(), InboxError> {
        for stmt in &self.sql.migrate {
            DB::execute(&self.pool, stmt)
                .await
                .map_err(InboxError::db("migrate"))?;
        }
        if let Some(u) = &self.sql.upgrade {
            let old = DB::exists(&self.pool, &u.check, &u.schema, &u.table)
                .await
                .map_err(InboxError::db("migrate"))?;
            if old {
                tracing::info!(table = %u.table, "upgrading the inbox's id columns to VARBINARY(255)");
                DB::execute(&self.pool, &u.alter)
                    .await
                    .map_err(InboxError::db("migrate"))?;
            }
        }
        Ok(())
    }

    /// Opens a transaction and inserts the inbox row `(consumer, message_id)`
    /// as its first statement: [`Claim::New`] with the open transaction, or
    /// [`Claim::Duplicate`] when the row exists (committed by an earlier
    /// delivery). Waits while another transaction holds the same row
    /// uncommitted.
    ///
    /// # Errors
    /// [`InboxError::InvalidId`] for an empty or over-long consumer or id;
    /// [`InboxError::Database`] when the database fails (after
    /// [`InboxOptions::retries`] retries of deadlocks / busy errors).
    pub async fn claim(&self, consumer: &str, message_id: &str) -> Result<Claim<DB>, InboxError> {
        check_id("consumer", consumer)?;
        check_id("message id", message_id)?;
        let attempt = || async {
            let mut tx = DB::begin(&self.pool)
                .await
                .map_err(InboxError::db("begin"))?;
            match DB::insert(&mut tx, &self.sql.insert, consumer, message_id).await {
                Ok(()) => Ok(Claim::New(InboxTx { tx })),
                Err(e) if is_duplicate(&e) => {
                    // Nothing was written; on PostgreSQL the transaction is
                    // aborted anyway. A failed rollback only drops the connection.
                    let _ = tx.rollback().await;
                    Ok(Claim::Duplicate)
                }
                Err(e) => {
                    if is_retryable(&e) {
                        let _ = tx.rollback().await;
                    }
                    Err(InboxError::db("insert")(e))
                }
            }
        };
        retry(
            self.retries.saturating_add(1),
            BACKOFF_BASE,
            attempt,
            |e| matches!(e, InboxError::Database { op: "insert", source } if is_retryable(source)),
        )
        .await
    }

    /// Runs `handler` on the transaction that holds the new inbox row and
    /// commits both; skips it for a message processed before.
    ///
    /// The handler gets `&mut Transaction` and returns a boxed future:
    /// `|tx| Box::pin(async move { sqlx::query(…).execute(&mut **tx).await?; Ok(()) })`
    /// (move owned values into it; the future may borrow only the transaction).
    ///
    /// # Errors
    /// [`ProcessError::Handler`] when the handler failed (rolled back, the
    /// inbox row with it: do not ack, the redelivery runs it again);
    /// [`ProcessError::Inbox`] as for [`Self::claim`] and
    /// [`InboxTx::commit`].
    pub async fn process<T, E, F>(
        &self,
        consumer: &str,
        message_id: &str,
        handler: F,
    ) -> Result<Processed<T>, ProcessError<E>>
    where
        F: for<'t> FnOnce(&'t mut Transaction<'static, DB>) -> TxFuture<'t, T, E>,
    {
        match self.claim(consumer, message_id).await? {
            Claim::Duplicate => Ok(Processed::Duplicate),
            Claim::New(mut tx) => match handler(&mut tx.tx).await {
                Ok(v) => {
                    tx.commit().await?;
                    Ok(Processed::Applied(v))
                }
                Err(e) => {
                    let _ = tx.rollback().await;
                    Err(ProcessError::Handler(e))
                }
            },
        }
    }

    /// Whether `(consumer, message_id)` has a committed inbox row.
    ///
    /// # Errors
    /// [`InboxError::InvalidId`]; [`InboxError::Database`] (op `"lookup"`).
    pub async fn is_processed(&self, consumer: &str, message_id: &str) -> Result<bool, InboxError> {
        check_id("consumer", consumer)?;
        check_id("message id", message_id)?;
        DB::exists(&self.pool, &self.sql.exists, consumer, message_id)
            .await
            .map_err(InboxError::db("lookup"))
    }

    /// Deletes the rows processed more than `age` ago (by the database's
    /// clock, millisecond precision) and returns how many. A redelivery of a
    /// purged message is processed **again**: keep `age` above the broker's
    /// longest redelivery horizon.
    ///
    /// `age` saturates at [`MAX_PURGE_AGE`] (100 years): a longer one, up
    /// to `Duration::MAX`, purges nothing and returns `Ok(0)` on every
    /// database (no row is that old; the cut-off stays inside every
    /// database's date range). `Duration::ZERO` purges every committed row.
    ///
    /// # Errors
    /// [`InboxError::Database`] (op `"purge"`).
    pub async fn purge_older_than(&self, age: Duration) -> Result<u64, InboxError> {
        let age = age.min(MAX_PURGE_AGE);
        let ms = i64::try_from(age.as_millis()).unwrap_or(i64::MAX);
        let age = ms.saturating_mul(self.sql.purge_units_per_ms);
        DB::purge(&self.pool, &self.sql.purge, age)
            .await
            .map_err(InboxError::db("purge"))
    }
}

fn check_id(what: &'static str, s: &str) -> Result<(), InboxError> {
    if s.is_empty() || s.len() > MAX_ID_LEN {
        return Err(InboxError::InvalidId { what, len: s.len() });
    }
    Ok(())
}

/// `table` or `schema.table`, each part a plain identifier.
fn split_table(table: &str) -> Result<Vec<String>, InboxError> {
    let parts: Vec<String> = table.split('.').map(str::to_owned).collect();
    if parts.len() > 2 || !parts.iter().all(|p| is_plain_ident(p, MAX_IDENT_LEN)) {
        return Err(InboxError::InvalidTable(table.to_owned()));
    }
    Ok(parts)
}

/// The duplicate-key error of the inbox insert, by code.
fn is_duplicate(e: &sqlx::Error) -> bool {
    error_kind(e) == Some(ErrorKind::UniqueViolation)
}

/// A deadlock / serialization failure / lock-wait timeout / busy database,
/// after which a new attempt may succeed.
fn is_retryable(e: &sqlx::Error) -> bool {
    matches!(
        error_kind(e),
        Some(
            ErrorKind::Deadlock
                | ErrorKind::SerializationFailure
                | ErrorKind::LockWaitTimeout
                | ErrorKind::Busy
        )
    )
}

mod sealed {
    pub trait Sealed {}
}

/// A database the inbox runs on: `sqlx::Sqlite`, `sqlx::Postgres`,
/// `sqlx::MySql`. Sealed; its items are the dialect and the driver calls
/// (the same for all three, except how a transaction begins and how DDL is
/// sent).
#[async_trait]
pub trait InboxDatabase: sqlx::Database + sealed::Sealed {
    #[doc(hidden)]
    const DIALECT: Dialect;
    #[doc(hidden)]
    async fn begin(pool: &Pool<Self>) -> Result<Transaction<'static, Self>, sqlx::Error>;
    #[doc(hidden)]
    async fn execute(pool: &Pool<Self>, sql: &str) -> Result<(), sqlx::Error>;
    #[doc(hidden)]
    async fn insert(
        tx: &mut Transaction<'static, Self>,
        sql: &str,
        consumer: &str,
        id: &str,
    ) -> Result<(), sqlx::Error>;
    #[doc(hidden)]
    async fn exists(
        pool: &Pool<Self>,
        sql: &str,
        consumer: &str,
        id: &str,
    ) -> Result<bool, sqlx::Error>;
    #[doc(hidden)]
    async fn purge(pool: &Pool<Self>, sql: &str, age: i64) -> Result<u64, sqlx::Error>;
}

/// Implements [`InboxDatabase`] for a sqlx database of `$dialect`, sending
/// DDL with `sqlx::$ddl` (`query`, or `raw_sql` where DDL is not prepared).
macro_rules! inbox_database {
    ($db:ty, $dialect:expr, $ddl:ident) => {
        impl sealed::Sealed for $db {}

        #[async_trait]
        impl InboxDatabase for $db {
            const DIALECT: Dialect = $dialect;

            async fn begin(pool: &Pool<Self>) -> Result<Transaction<'static, Self>, sqlx::Error> {
                match $dialect.write_begin() {
                    Some(statement) => pool.begin_with(statement).await,
                    None => pool.begin().await,
                }
            }

            async fn execute(pool: &Pool<Self>, sql: &str) -> Result<(), sqlx::Error> {
                sqlx::$ddl(sql).execute(pool).await.map(|_| ())
            }

            async fn insert(
                tx: &mut Transaction<'static, Self>,
                sql: &str,
                consumer: &str,
                id: &str,
            ) -> Result<(), sqlx::Error> {
                sqlx::query(sql)
                    .bind(consumer)
                    .bind(id)
                    .execute(&mut **tx)
                    .await
                    .map(|_| ())
            }

            async fn exists(
                pool: &Pool<Self>,
                sql: &str,
                consumer: &str,
                id: &str,
            ) -> Result<bool, sqlx::Error> {
                let row = sqlx::query(sql)
                    .bind(consumer)
                    .bind(id)
                    .fetch_optional(pool)
                    .await?;
                Ok(row.is_some())
            }

            async fn purge(pool: &Pool<Self>, sql: &str, age: i64) -> Result<u64, sqlx::Error> {
                Ok(sqlx::query(sql)
                    .bind(age)
                    .execute(pool)
                    .await?
                    .rows_affected())
            }
        }
    };
}

inbox_database!(sqlx::Sqlite, Dialect::Sqlite, query);
#[cfg(feature = "postgres")]
inbox_database!(sqlx::Postgres, Dialect::Postgres, query);
#[cfg(feature = "mysql")]
inbox_database!(sqlx::MySql, Dialect::MySql, raw_sql);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_names_are_validated() {
        assert!(split_table("idem_inbox").is_ok());
        assert_eq!(split_table("app.inbox_1").unwrap().len(), 2);
        for bad in [
            "",
            "1abc",
            "a-b",
            "a.b.c",
            "x; DROP TABLE y",
            "\"q\"",
            &"a".repeat(64),
        ] {
            assert!(
                matches!(split_table(bad), Err(InboxError::InvalidTable(_))),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn ids_are_bounded() {
        assert!(check_id("consumer", "c").is_ok());
        assert!(matches!(
            check_id("consumer", ""),
            Err(InboxError::InvalidId { len: 0, .. })
        ));
        assert!(matches!(
            check_id("message id", &"x".repeat(256)),
            Err(InboxError::InvalidId { len: 256, .. })
        ));
    }
}
