//! [`Versioned`]: optimistic updates by version number.

use super::conn::SqlConnection;
use super::ident::{self, Target};
use super::sql::{update, Sql};
use super::transition::read_latest;
use super::{PatternError, SqlValue};

/// What [`Versioned::update`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum VersionedUpdate {
    /// The row was at the expected version; it is updated and now at this
    /// version (expected + 1).
    Updated(i64),
    /// The row is at another version (the latest committed one, read as
    /// [`StateMachine`](super::StateMachine) re-reads). Nothing changed.
    Stale(i64),
    /// No row has this id.
    NotFound,
}

/// Optimistic concurrency by a version column: one
/// `UPDATE t SET version = version + 1, col = ?… WHERE id = ? AND version = ?`,
/// and, only when it matches no row, one read of the current version
/// (`FOR SHARE` on PostgreSQL, `LOCK IN SHARE MODE` on MySQL / MariaDB, a
/// plain read on SQLite: the latest committed row, also inside a caller's
/// `REPEATABLE READ` transaction; see [`StateMachine`](super::StateMachine)
/// for the per-database details, which are the same). Never loops.
///
/// Of N concurrent updates at one version exactly one gets `Updated`; the
/// others get `Stale(expected + 1)` (or later), or
/// [`PatternError::SerializationFailure`] inside a PostgreSQL
/// `REPEATABLE READ` transaction.
///
/// The version column is an integer (`BIGINT` recommended); the id column
/// is unique.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use idem_sql::patterns::{Versioned, VersionedUpdate};
/// use sqlx::Connection;
///
/// let mut conn = sqlx::SqliteConnection::connect("sqlite::memory:").await?;
/// sqlx::query("CREATE TABLE docs (id TEXT PRIMARY KEY, version INTEGER NOT NULL, body TEXT)")
///     .execute(&mut conn).await?;
/// sqlx::query("INSERT INTO docs VALUES ('a', 1, 'v1')").execute(&mut conn).await?;
///
/// let docs = Versioned::new("docs", "id", "version")?;
/// let u = docs.update(&mut conn, "a", 1, &[("body", "v2".into())]).await?;
/// assert_eq!(u, VersionedUpdate::Updated(2));
/// let u = docs.update(&mut conn, "a", 1, &[("body", "lost".into())]).await?;
/// assert_eq!(u, VersionedUpdate::Stale(2));
/// assert_eq!(docs.update(&mut conn, "b", 1, &[]).await?, VersionedUpdate::NotFound);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct Versioned {
    /// The table, the id column and the version column.
    target: Target,
}

impl Versioned {
    /// Versioned rows of `table`, named by `id_column`, versioned by
    /// `version_column`.
    ///
    /// # Errors
    ///
    /// [`PatternError::InvalidIdentifier`] for a bad name (as
    /// [`StateMachine::new`](super::StateMachine::new)).
    pub fn new(table: &str, id_column: &str, version_column: &str) -> Result<Self, PatternError> {
        Target::parse(table, id_column, version_column).map(|target| Self { target })
    }

    /// Sets the columns in `set` on row `id` and increments its version,
    /// if the row is at `expected_version`.
    ///
    /// # Errors
    ///
    /// - [`PatternError::InvalidIdentifier`]: a column name in `set`.
    /// - [`PatternError::InvalidArgument`]: `id` `NULL`, a column twice,
    ///   the id or version column in `set`.
    /// - [`PatternError::SerializationFailure`], [`PatternError::Busy`],
    ///   [`PatternError::Database`]: as
    ///   [`StateMachine::transition_setting`](super::StateMachine::transition_setting).
    /// - [`PatternError::Decode`]: the version column is `NULL` or not an
    ///   integer.
    pub async fn update<C: SqlConnection + ?Sized>(
        &self,
        conn: &mut C,
        id: impl Into<SqlValue> + Send,
        expected_version: i64,
        set: &[(&str, SqlValue)],
    ) -> Result<VersionedUpdate, PatternError> {
        let id = id.into();
        let t = &self.target;
        let cols = ident::columns(set, &[(&t.column, "version"), (&t.id, "id")])?;
        ident::not_null(&id, "id")?;
        let Some(next) = expected_version.checked_add(1) else {
            return Err(PatternError::InvalidArgument {
                detail: "the expected version is i64::MAX; it cannot be incremented".into(),
            });
        };
        let d = conn.dialect();
        let q = t.quoted(d);
        let head = |sql: &mut Sql| {
            sql.push(&q.column).push(" = ").push(&q.column).push(" + 1");
        };
        let mut sql = update(d, &q, head, &cols, set, id.clone());
        sql.push(" AND ")
            .push(&q.column)
            .push(" = ")
            .bind(expected_version.into());
        if conn.execute(&sql.text, &sql.args).await? > 0 {
            return Ok(VersionedUpdate::Updated(next));
        }
        match read_latest(conn, &q, id).await? {
            None => Ok(VersionedUpdate::NotFound),
            Some(SqlValue::I64(v)) => Ok(VersionedUpdate::Stale(v)),
            Some(other) => Err(PatternError::Decode {
                detail: format!("the version column holds {other:?}, not an integer"),
            }),
        }
    }
}
