//! [`PatternError`] and the mapping of driver errors by code.

use crate::dialect::{error_kind, ErrorKind};

/// Why a pattern could not give an answer.
///
/// Refusals are not errors: a lost race is [`Transition::Conflict`](super::Transition::Conflict),
/// [`VersionedUpdate::Stale`](super::VersionedUpdate::Stale), a duplicate key is
/// [`Created { inserted: false, .. }`](super::Created). Errors are kept for
/// bad input and for what the database refused. The driver's error is kept
/// as the [`source`](std::error::Error::source). Codes are told apart by
/// number (SQLSTATE, MySQL error number, SQLite extended result code),
/// never by message text.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PatternError {
    /// A table or column name is not `[A-Za-z_][A-Za-z0-9_]{0,62}` (a table
    /// may be `schema.table`, each part checked). Nothing was sent.
    #[error(
        "{what} {name:?} is not a plain identifier: use 1 to 63 characters of [A-Za-z0-9_], \
         not starting with a digit{}",
        if *what == "table" { " (optionally schema.table)" } else { "" }
    )]
    InvalidIdentifier {
        /// `"table"` or `"column"`.
        what: &'static str,
        /// The name as given.
        name: String,
    },
    /// An argument other than a name is unusable (an empty `from` set, a
    /// `NULL` id or key, a column set twice, the state / version / key
    /// column in `set`). Nothing was sent.
    #[error("invalid argument: {detail}")]
    InvalidArgument {
        /// What is wrong.
        detail: String,
    },
    /// The database rolled the transaction back, or refused it, to keep it
    /// serializable: PostgreSQL SQLSTATE `40001` (a `REPEATABLE READ` /
    /// `SERIALIZABLE` transaction touched a row changed since its snapshot)
    /// or `40P01` (deadlock), MySQL / MariaDB error 1213 (deadlock; the
    /// whole transaction was rolled back), SQLite `SQLITE_BUSY_SNAPSHOT`
    /// (517: a read transaction's snapshot is stale and cannot write).
    /// Retryable: roll back and run the whole transaction again.
    #[error("serialization failure: the transaction must be rolled back and retried")]
    SerializationFailure {
        /// The driver's error.
        #[source]
        source: sqlx::Error,
    },
    /// A lock was not granted in time: SQLite `SQLITE_BUSY` / `SQLITE_LOCKED`
    /// (after the connection's busy timeout, 5 s by default in sqlx), MySQL
    /// 1205 (`innodb_lock_wait_timeout`), PostgreSQL `55P03`
    /// (`lock_timeout`). Retryable: the statement changed nothing (on MySQL
    /// the transaction is still open unless `innodb_rollback_on_timeout`).
    #[error("busy: a lock was not granted in time")]
    Busy {
        /// The driver's error.
        #[source]
        source: sqlx::Error,
    },
    /// A unique constraint other than the one the pattern handles was
    /// violated (PostgreSQL `23505`, MySQL 1062, SQLite 2067 / 1555).
    #[error("unique constraint violated")]
    UniqueViolation {
        /// The driver's error.
        #[source]
        source: sqlx::Error,
    },
    /// A column read back has a type the pattern cannot represent, or a
    /// value it cannot accept (a `NULL` state, a version that is not an
    /// integer).
    #[error("unexpected column value: {detail}")]
    Decode {
        /// What was found.
        detail: String,
    },
    /// A key kept vanishing between the insert that found it and the read
    /// that looked for it (it was deleted each time), after the bounded
    /// number of attempts.
    #[error("the row for the key vanished {attempts} times between insert and read")]
    Contended {
        /// Attempts made.
        attempts: u32,
    },
    /// [`InsertOrGet`](super::InsertOrGet) on MySQL / MariaDB: the key
    /// column has no UNIQUE index of its own (a unique index or primary key
    /// made of exactly that column), so a plain `INSERT` cannot detect the
    /// duplicate. Checked once per `InsertOrGet` value in
    /// `information_schema.STATISTICS` before the first insert; nothing
    /// was inserted. (PostgreSQL and SQLite refuse the same table with
    /// [`PatternError::Database`]: `42P10`, "ON CONFLICT clause does not
    /// match any PRIMARY KEY or UNIQUE constraint".)
    #[error("key column {column:?} of table {table:?} has no UNIQUE index of its own")]
    KeyNotUnique {
        /// The table, as given.
        table: String,
        /// The key column.
        column: String,
    },
    /// Any other database error.
    #[error("database error")]
    Database {
        /// The driver's error.
        #[source]
        source: sqlx::Error,
    },
}

impl PatternError {
    /// `true` when running the same call again (after rolling back the
    /// caller's transaction, for [`PatternError::SerializationFailure`]) may
    /// succeed: serialization failures, busy locks, contention.
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            Self::SerializationFailure { .. } | Self::Busy { .. } | Self::Contended { .. }
        )
    }
}

/// Maps a driver error by its [`ErrorKind`] (by code, never by message
/// text).
pub(crate) fn classify(source: sqlx::Error) -> PatternError {
    match error_kind(&source) {
        Some(k) if k.is_conflict() => PatternError::SerializationFailure { source },
        Some(ErrorKind::UniqueViolation) => PatternError::UniqueViolation { source },
        Some(ErrorKind::Busy | ErrorKind::LockWaitTimeout | ErrorKind::LockNotAvailable) => {
            PatternError::Busy { source }
        }
        _ => PatternError::Database { source },
    }
}
