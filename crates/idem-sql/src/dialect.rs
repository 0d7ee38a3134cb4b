//! Everything that differs per SQL database, in one place: the "now in
//! milliseconds" expression, identifier rules and quoting, placeholders,
//! and what a driver error means ([`error_kind`]: by SQLSTATE, MySQL error
//! number or SQLite extended result code, never by message text).
//!
//! The stores, the lock backends, the inbox and the patterns write their
//! statements with a [`Dialect`] and map an [`ErrorKind`] to their own
//! answer (retry, timeout, busy…). A new database adds a variant here and
//! its arms in the methods below; nothing else matches on the database.

/// A SQL database family.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dialect {
    /// SQLite (3.35+).
    Sqlite,
    /// PostgreSQL (10+).
    #[cfg(feature = "postgres")]
    Postgres,
    /// MySQL 8.0+ / MariaDB 10.5+.
    #[cfg(feature = "mysql")]
    MySql,
}

impl Dialect {
    /// The database's clock in whole milliseconds since the Unix epoch, as
    /// a SQL expression of a 64-bit integer type.
    ///
    /// - SQLite: `julianday('now')`, constant within one statement.
    /// - PostgreSQL: `clock_timestamp()`, read when the expression is
    ///   evaluated (not at the transaction's start), rounded down;
    ///   `extract` returns `numeric` on PostgreSQL 14+ and `double
    ///   precision` before, both keep the milliseconds.
    /// - MySQL / MariaDB: `UTC_TIMESTAMP(6)` with plain datetime arithmetic,
    ///   independent of the session's `time_zone` (`UNIX_TIMESTAMP(NOW())`
    ///   would shift during a DST change); constant within one statement.
    pub(crate) const fn now_ms(self) -> &'static str {
        match self {
            Self::Sqlite => "CAST((julianday('now') - 2440587.5) * 86400000.0 AS INTEGER)",
            #[cfg(feature = "postgres")]
            Self::Postgres => "floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint",
            #[cfg(feature = "mysql")]
            Self::MySql => {
                "CAST(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) \
                 DIV 1000 AS SIGNED)"
            }
        }
    }

    /// PostgreSQL only: like [`Self::now_ms`], at the statement's start
    /// (`now()`): stable within a statement, so an index on a time column
    /// can serve the comparison.
    #[cfg(feature = "postgres")]
    pub(crate) const PG_STATEMENT_NOW_MS: &'static str =
        "floor(extract(epoch FROM now()) * 1000)::bigint";

    /// The database's clock in ms, constant within one statement (so it
    /// can be compared on every row of a scan): [`Self::now_ms`], except on
    /// PostgreSQL, whose `clock_timestamp()` moves during a statement, where
    /// it is `now()` (the statement's start).
    pub(crate) const fn stable_now_ms(self) -> &'static str {
        match self {
            #[cfg(feature = "postgres")]
            Self::Postgres => Self::PG_STATEMENT_NOW_MS,
            _ => self.now_ms(),
        }
    }

    /// `ident` quoted as an identifier (`"name"`, MySQL `` `name` ``).
    /// Only for names that passed [`is_plain_ident`]: no quote character
    /// can occur in them.
    pub(crate) fn quote(self, ident: &str) -> String {
        let q = match self {
            #[cfg(feature = "mysql")]
            Self::MySql => '`',
            _ => '"',
        };
        format!("{q}{ident}{q}")
    }

    /// The parts (`schema`, `table`) quoted and joined by `.`.
    pub(crate) fn quote_path<S: AsRef<str>>(self, parts: &[S]) -> String {
        parts
            .iter()
            .map(|p| self.quote(p.as_ref()))
            .collect::<Vec<_>>()
            .join(".")
    }

    /// The placeholder of the `n`-th bound value (1-based): `?n` on SQLite,
    /// `$n` on PostgreSQL, `?` on MySQL (bound in order).
    pub(crate) fn param(self, n: usize) -> String {
        match self {
            Self::Sqlite => format!("?{n}"),
            #[cfg(feature = "postgres")]
            Self::Postgres => format!("${n}"),
            #[cfg(feature = "mysql")]
            Self::MySql => "?".to_owned(),
        }
    }

    /// The locking clause that makes a `SELECT` read the latest committed
    /// row, also inside a `REPEATABLE READ` transaction.
    ///
    /// PostgreSQL outside a transaction needs none: the statement runs in
    /// its own transaction whose snapshot is taken after an `UPDATE` that
    /// committed before it; a `FOR SHARE` there would lock the row and cost
    /// a WAL flush at commit (measured per conflict on the dev machine:
    /// 4.8 ms with it, 0.4 ms without). MySQL's locking read is cheap in
    /// autocommit, so it is always used (it also covers a transaction
    /// opened with a raw `BEGIN`, which sqlx does not track). SQLite's
    /// writer holds the database lock: a plain read is current.
    pub(crate) fn latest_read_suffix(self, in_transaction: bool) -> &'static str {
        let _ = in_transaction;
        match self {
            Self::Sqlite => "",
            #[cfg(feature = "postgres")]
            Self::Postgres if in_transaction => " FOR SHARE",
            #[cfg(feature = "postgres")]
            Self::Postgres => "",
            #[cfg(feature = "mysql")]
            Self::MySql => " LOCK IN SHARE MODE",
        }
    }

    /// The statement that opens a transaction that will write, when not
    /// the driver's plain `BEGIN`: SQLite's `BEGIN IMMEDIATE` takes the
    /// write lock up front (waited for by the busy timeout) rather than
    /// upgrading a read lock later.
    pub(crate) fn write_begin(self) -> Option<&'static str> {
        match self {
            Self::Sqlite => Some("BEGIN IMMEDIATE"),
            #[allow(unreachable_patterns)]
            _ => None,
        }
    }

    /// Whether `INSERT … ON CONFLICT … DO NOTHING RETURNING` exists (not on
    /// MySQL / MariaDB).
    pub(crate) fn has_insert_returning(self) -> bool {
        match self {
            #[cfg(feature = "mysql")]
            Self::MySql => false,
            _ => true,
        }
    }

    /// The placeholders `1..=N` in order, for `format!` templates.
    pub(crate) fn params<const N: usize>(self) -> [String; N] {
        std::array::from_fn(|i| self.param(i + 1))
    }
}

/// Whether `name` matches `[A-Za-z_][A-Za-z0-9_]*` and is at most `max`
/// bytes long. Names are always checked before they are quoted into SQL;
/// values are always bound.
pub(crate) fn is_plain_ident(name: &str, max: usize) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
        && name.len() <= max
}

/// What a database error means, told apart by code (the idea of sqlx's
/// `DatabaseError::kind()`, with the kinds idem needs). Which kinds occur
/// depends on the drivers built in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(not(all(feature = "postgres", feature = "mysql")), allow(dead_code))]
pub(crate) enum ErrorKind {
    /// A unique or primary key constraint was violated: PostgreSQL `23505`,
    /// MySQL 1062 (`ER_DUP_ENTRY`), SQLite 2067 / 1555
    /// (`SQLITE_CONSTRAINT_UNIQUE` / `_PRIMARYKEY`).
    UniqueViolation,
    /// The transaction could not be serialized: PostgreSQL `40001`, SQLite
    /// 517 (`SQLITE_BUSY_SNAPSHOT`: a read snapshot went stale).
    SerializationFailure,
    /// A deadlock; the transaction was rolled back: PostgreSQL `40P01`,
    /// MySQL 1213 (`ER_LOCK_DEADLOCK`).
    Deadlock,
    /// MySQL 1205 (`ER_LOCK_WAIT_TIMEOUT`, `innodb_lock_wait_timeout`): the
    /// statement was rolled back.
    LockWaitTimeout,
    /// PostgreSQL `55P03` (`lock_not_available`: `lock_timeout`, `NOWAIT`).
    LockNotAvailable,
    /// The statement ran out of time or was cancelled: PostgreSQL `57014`
    /// (`statement_timeout`), MySQL 3024 (`max_execution_time`), MariaDB
    /// 1969 (`max_statement_time`), 1317 (`KILL QUERY`).
    StatementTimeout,
    /// SQLite `SQLITE_BUSY` (5) or `SQLITE_LOCKED` (6), with their extended
    /// codes (other than 517): the busy timeout passed.
    Busy,
    /// PostgreSQL `42P07` (`duplicate_table`).
    DuplicateTable,
    /// PostgreSQL class `57` other than `57014` (operator intervention: the
    /// session was terminated, the server is shutting down).
    OperatorIntervention,
}

impl ErrorKind {
    /// A deadlock or serialization failure: the work was rolled back and
    /// may be run again.
    pub(crate) fn is_conflict(self) -> bool {
        matches!(self, Self::Deadlock | Self::SerializationFailure)
    }

    /// A lock or statement time limit passed.
    pub(crate) fn is_timeout(self) -> bool {
        matches!(
            self,
            Self::LockWaitTimeout | Self::LockNotAvailable | Self::StatementTimeout
        )
    }
}

/// MySQL / MariaDB error numbers (never matched by message).
#[cfg(feature = "mysql")]
mod errno {
    pub(super) const DUP_ENTRY: u16 = 1062;
    pub(super) const LOCK_WAIT_TIMEOUT: u16 = 1205;
    pub(super) const LOCK_DEADLOCK: u16 = 1213;
    pub(super) const QUERY_INTERRUPTED: u16 = 1317;
    pub(super) const STATEMENT_TIMEOUT: u16 = 1969;
    pub(super) const QUERY_TIMEOUT: u16 = 3024;
}

/// The kind of a database error, by the code of the driver that raised it;
/// `None` for other errors (I/O, pool, decoding) and unlisted codes.
pub(crate) fn error_kind(e: &sqlx::Error) -> Option<ErrorKind> {
    let sqlx::Error::Database(db) = e else {
        return None;
    };
    #[cfg(feature = "mysql")]
    if let Some(my) = db.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>() {
        return match my.number() {
            errno::DUP_ENTRY => Some(ErrorKind::UniqueViolation),
            errno::LOCK_DEADLOCK => Some(ErrorKind::Deadlock),
            errno::LOCK_WAIT_TIMEOUT => Some(ErrorKind::LockWaitTimeout),
            errno::STATEMENT_TIMEOUT | errno::QUERY_TIMEOUT | errno::QUERY_INTERRUPTED => {
                Some(ErrorKind::StatementTimeout)
            }
            _ => None,
        };
    }
    #[cfg(feature = "postgres")]
    if let Some(pg) = db.try_downcast_ref::<sqlx::postgres::PgDatabaseError>() {
        return match pg.code() {
            "23505" => Some(ErrorKind::UniqueViolation),
            "40001" => Some(ErrorKind::SerializationFailure),
            "40P01" => Some(ErrorKind::Deadlock),
            "55P03" => Some(ErrorKind::LockNotAvailable),
            "57014" => Some(ErrorKind::StatementTimeout),
            "42P07" => Some(ErrorKind::DuplicateTable),
            c if c.starts_with("57") => Some(ErrorKind::OperatorIntervention),
            _ => None,
        };
    }
    if db.try_downcast_ref::<sqlx::sqlite::SqliteError>().is_some() {
        // sqlx reports SQLite's extended result code as the code.
        let code: i32 = db.code()?.parse().ok()?;
        return match code {
            517 => Some(ErrorKind::SerializationFailure),
            1555 | 2067 => Some(ErrorKind::UniqueViolation),
            c if matches!(c & 0xff, 5 | 6) => Some(ErrorKind::Busy),
            _ => None,
        };
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identifiers_and_quotes() {
        assert!(is_plain_ident("idem_records", 54));
        assert!(is_plain_ident("_x9", 3));
        for bad in ["", "9a", "a-b", "a b", "a\"b", "a`b", "é", "a.b"] {
            assert!(!is_plain_ident(bad, 63), "{bad:?}");
        }
        assert!(!is_plain_ident("abcd", 3));
        assert_eq!(Dialect::Sqlite.quote_path(&["s", "t"]), "\"s\".\"t\"");
        assert_eq!(
            Dialect::Sqlite.params::<2>(),
            ["?1".to_owned(), "?2".to_owned()]
        );
        #[cfg(feature = "mysql")]
        assert_eq!(Dialect::MySql.quote("t"), "`t`");
        #[cfg(feature = "postgres")]
        assert_eq!(Dialect::Postgres.param(3), "$3");
    }
}
