//! [`StateMachine`]: compare-and-set state transitions.

use super::conn::SqlConnection;
use super::ident::{self, Quoted, Target};
use super::sql::{update, Sql};
use super::{PatternError, SqlValue};

/// What [`StateMachine::transition`] found.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Transition {
    /// The row was in one of the `from` states and is now in `to` (this
    /// call changed it; the `UPDATE` matched the row).
    Transitioned,
    /// The row was not in a `from` state but already in `to` (someone,
    /// perhaps an earlier attempt of this very call, moved it there). The
    /// state as read.
    AlreadyIn(String),
    /// The row is in another state, which it holds as read by the latest
    /// committed data (see [`StateMachine`]). Nothing was changed.
    Conflict(String),
    /// No row has this id.
    NotFound,
}

/// Moves rows between states by compare-and-set: one
/// `UPDATE t SET state = ? [, col = ?]… WHERE id = ? AND state IN (?, …)`,
/// and, only when it matches no row, one read of the current state to say
/// why. Never loops, never retries.
///
/// The re-read sees the latest committed row, also inside a caller's
/// `REPEATABLE READ` transaction:
///
/// - **PostgreSQL**: `SELECT state … FOR SHARE` inside a transaction (a
///   plain `SELECT` outside one: its own snapshot, taken after the
///   `UPDATE`, is current, and a share lock would cost a WAL flush).
///   Under `READ COMMITTED`
///   the `UPDATE` waits for a concurrent writer of the row and re-checks its
///   condition on the committed version. Under `REPEATABLE READ` /
///   `SERIALIZABLE`, when the row changed after the transaction's snapshot,
///   the `UPDATE` (or the `FOR SHARE` read) fails with SQLSTATE `40001`:
///   returned as [`PatternError::SerializationFailure`] — roll back and
///   retry the transaction (the transaction is aborted; nothing else can
///   run in it).
/// - **MySQL / MariaDB**: `SELECT state … LOCK IN SHARE MODE` (a locking
///   read; works on MariaDB 10.x and MySQL 8). Under `REPEATABLE READ` a
///   plain `SELECT` would return the transaction's snapshot, possibly the
///   very state the `UPDATE` (which reads the latest version) just found
///   changed.
/// - **SQLite**: a plain `SELECT`. The `UPDATE` took the write lock, so the
///   read is current; a read transaction whose snapshot went stale gets
///   `SQLITE_BUSY_SNAPSHOT` from the `UPDATE`:
///   [`PatternError::SerializationFailure`].
///
/// Inside a caller's transaction the share lock of the re-read is held
/// until it ends: the reported state cannot change under the caller's
/// feet. The `UPDATE`'s row lock is held likewise (as for any write).
///
/// Names: `table` may be `schema.table`; every part and column must match
/// `[A-Za-z_][A-Za-z0-9_]{0,62}`; they are quoted per dialect (so they are
/// case-sensitive on PostgreSQL: pass lowercase names for tables created
/// without quotes). Values are always bound. The state column must hold
/// text (`TEXT`/`VARCHAR`; not a PostgreSQL enum type); the id column must
/// be unique (a primary key).
///
/// Sources: PostgreSQL manual §13.2.1–13.2.2 (`UPDATE` under READ
/// COMMITTED re-evaluates its condition on the updated row; REPEATABLE READ
/// raises "could not serialize access due to concurrent update"), MySQL
/// manual "Consistent Nonlocking Reads" and "Locking Reads" (a plain
/// `SELECT` reads the snapshot; `UPDATE` and locking reads the latest
/// version), SQLite "Write-Ahead Logging" (`SQLITE_BUSY_SNAPSHOT`).
///
/// If the row changes back into a `from` state between the `UPDATE` and
/// the read (possible only outside a transaction, on a machine whose
/// transitions go in cycles), the answer is `Conflict` with that state;
/// calling again then succeeds.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use idem_sql::patterns::{StateMachine, Transition};
/// use sqlx::Connection;
///
/// let mut conn = sqlx::SqliteConnection::connect("sqlite::memory:").await?;
/// sqlx::query("CREATE TABLE orders (id INTEGER PRIMARY KEY, state TEXT NOT NULL, note TEXT)")
///     .execute(&mut conn).await?;
/// sqlx::query("INSERT INTO orders (id, state) VALUES (1, 'pending')").execute(&mut conn).await?;
///
/// let orders = StateMachine::new("orders", "id", "state")?;
/// let t = orders.transition(&mut conn, 1, &["pending"], "paid").await?;
/// assert_eq!(t, Transition::Transitioned);
/// let t = orders.transition(&mut conn, 1, &["pending"], "paid").await?;
/// assert_eq!(t, Transition::AlreadyIn("paid".into()));
/// let t = orders.transition(&mut conn, 1, &["pending"], "cancelled").await?;
/// assert_eq!(t, Transition::Conflict("paid".into()));
/// let t = orders.transition(&mut conn, 2, &["pending"], "paid").await?;
/// assert_eq!(t, Transition::NotFound);
///
/// // Other columns change in the same UPDATE, and inside a transaction:
/// let mut tx = conn.begin().await?;
/// let t = orders
///     .transition_setting(&mut *tx, 1, &["paid"], "shipped", &[("note", "by sea".into())])
///     .await?;
/// assert_eq!(t, Transition::Transitioned);
/// tx.commit().await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct StateMachine {
    /// The table, the id column and the state column.
    target: Target,
}

impl StateMachine {
    /// A state machine over `table`'s `state_column`, rows named by
    /// `id_column`.
    ///
    /// # Errors
    ///
    /// [`PatternError::InvalidIdentifier`] for a name that is not
    /// `[A-Za-z_][A-Za-z0-9_]{0,62}` (or `schema.table` of two such).
    pub fn new(table: &str, id_column: &str, state_column: &str) -> Result<Self, PatternError> {
        Target::parse(table, id_column, state_column).map(|target| Self { target })
    }

    /// Moves row `id` from any state in `from` to `to`; see
    /// [`transition_setting`](Self::transition_setting).
    ///
    /// # Errors
    ///
    /// As [`transition_setting`](Self::transition_setting).
    pub async fn transition<C: SqlConnection + ?Sized>(
        &self,
        conn: &mut C,
        id: impl Into<SqlValue> + Send,
        from: &[&str],
        to: &str,
    ) -> Result<Transition, PatternError> {
        self.transition_setting(conn, id, from, to, &[]).await
    }

    /// Moves row `id` from any state in `from` to `to`, setting the columns
    /// in `set` in the same `UPDATE` (only when the transition happens).
    /// One statement when it succeeds, two when it does not.
    ///
    /// # Errors
    ///
    /// - [`PatternError::InvalidIdentifier`]: a column name in `set`.
    /// - [`PatternError::InvalidArgument`]: `from` empty, `id` `NULL`, a
    ///   column twice in `set`, or the state / id column in `set`.
    /// - [`PatternError::SerializationFailure`]: the caller's
    ///   `REPEATABLE READ` / `SERIALIZABLE` transaction saw a stale row
    ///   (PostgreSQL `40001`), a deadlock (PostgreSQL `40P01`, MySQL
    ///   1213), or a stale SQLite read snapshot. Retry the transaction.
    /// - [`PatternError::Busy`]: a lock wait timed out.
    /// - [`PatternError::Decode`]: the state column held `NULL` or a
    ///   non-text value.
    /// - [`PatternError::Database`]: anything else (a missing table…).
    pub async fn transition_setting<C: SqlConnection + ?Sized>(
        &self,
        conn: &mut C,
        id: impl Into<SqlValue> + Send,
        from: &[&str],
        to: &str,
        set: &[(&str, SqlValue)],
    ) -> Result<Transition, PatternError> {
        let id = id.into();
        let t = &self.target;
        let cols = ident::columns(set, &[(&t.column, "state"), (&t.id, "id")])?;
        if from.is_empty() {
            return Err(PatternError::InvalidArgument {
                detail: "the set of `from` states is empty".into(),
            });
        }
        ident::not_null(&id, "id")?;
        let d = conn.dialect();
        let q = t.quoted(d);
        let head = |sql: &mut Sql| {
            sql.push(&q.column).push(" = ").bind(to.into());
        };
        let mut sql = update(d, &q, head, &cols, set, id.clone());
        sql.push(" AND ").push(&q.column).push(" IN (");
        for (i, f) in from.iter().enumerate() {
            if i > 0 {
                sql.push(", ");
            }
            sql.bind((*f).into());
        }
        sql.push(")");
        if conn.execute(&sql.text, &sql.args).await? > 0 {
            return Ok(Transition::Transitioned);
        }
        match read_latest(conn, &q, id).await? {
            None => Ok(Transition::NotFound),
            Some(current) => {
                let s = state_text(current)?;
                Ok(if s == to {
                    Transition::AlreadyIn(s)
                } else {
                    Transition::Conflict(s)
                })
            }
        }
    }
}

/// The state as text: MySQL reports text columns with a binary collation
/// (`utf8mb4_bin`) as binary, so UTF-8 bytes are accepted too.
fn state_text(v: SqlValue) -> Result<String, PatternError> {
    match v {
        SqlValue::Text(s) => Ok(s),
        SqlValue::Bytes(b) => String::from_utf8(b).map_err(|e| PatternError::Decode {
            detail: format!("the state column holds non-UTF-8 bytes: {e}"),
        }),
        other => Err(PatternError::Decode {
            detail: format!("the state column holds {other:?}, not text"),
        }),
    }
}

/// `SELECT column FROM table WHERE id = ?` as a read of the latest
/// committed row (see [`StateMachine`] for why each form).
pub(crate) async fn read_latest<C: SqlConnection + ?Sized>(
    conn: &mut C,
    q: &Quoted,
    id: SqlValue,
) -> Result<Option<SqlValue>, PatternError> {
    let d = conn.dialect();
    let mut sql = Sql::new(d);
    sql.push("SELECT ")
        .push(&q.column)
        .push(" FROM ")
        .push(&q.table)
        .push(" WHERE ")
        .push(&q.id)
        .push(" = ")
        .bind(id)
        .push(d.latest_read_suffix(conn.in_transaction()));
    conn.fetch_first(&sql.text, &sql.args).await
}
