//! [`SqlConnection`]: the connections the patterns run on.

use async_trait::async_trait;

use super::error::{classify, PatternError};
use super::SqlValue;

pub(crate) use crate::dialect::Dialect;

/// A connection the patterns can run on: `sqlx::SqliteConnection`,
/// `sqlx::PgConnection` (feature `postgres`) and `sqlx::MySqlConnection`
/// (feature `mysql`). Sealed: it cannot be implemented outside this crate.
///
/// Pass `&mut *tx` for a `sqlx::Transaction` (the pattern's statements run
/// inside the caller's transaction and commit with it) or `&mut *conn` for a
/// pooled connection (each statement commits on its own).
///
/// Whether the caller is inside a transaction is read from sqlx
/// (`Connection::is_in_transaction`); a transaction opened with a raw
/// `BEGIN` statement is not seen as one, so open transactions with
/// `begin()`.
pub trait SqlConnection: sealed::Sealed {}

mod sealed {
    use super::{async_trait, Dialect, PatternError, SqlValue};

    /// The driver-specific steps (hidden; the trait is sealed).
    #[async_trait]
    pub trait Sealed: Send {
        /// The database family.
        fn dialect(&self) -> Dialect;
        /// Whether sqlx has a transaction open on this connection.
        fn in_transaction(&self) -> bool;
        /// Runs a statement; returns the rows it affected (MySQL: matched,
        /// sqlx sets `CLIENT_FOUND_ROWS`).
        async fn execute(&mut self, sql: &str, args: &[SqlValue]) -> Result<u64, PatternError>;
        /// Runs a query; returns the first column of its first row.
        async fn fetch_first(
            &mut self,
            sql: &str,
            args: &[SqlValue],
        ) -> Result<Option<SqlValue>, PatternError>;
    }
}

macro_rules! bind_all {
    ($q:expr, $args:expr) => {{
        let mut q = $q;
        for a in $args {
            q = match a {
                SqlValue::I64(v) => q.bind(*v),
                SqlValue::Text(v) => q.bind(v.clone()),
                SqlValue::Bytes(v) => q.bind(v.clone()),
                // `Sql::bind` writes NULL as a literal; kept for completeness.
                SqlValue::Null => q.bind(None::<String>),
            };
        }
        q
    }};
}

/// Pattern statements are built per call and their argument types follow
/// the caller's [`SqlValue`] variants, so one SQL text may be run with an
/// `I64` id and later a `Text` one. PostgreSQL fixes a prepared
/// statement's parameter types when it is parsed, and sqlx caches named
/// statements by SQL text only: a cached statement would send a `Text`
/// id's bytes under the `INT8` type of the first call (the 8 bytes of
/// `"12345678"` read as another row's id). So on PostgreSQL every pattern
/// statement is parsed unnamed, with the types of this call's arguments
/// (`persistent(false)`; one extra round trip): a type that does not fit
/// the column is refused by the server (`42883`, `42804`…) as
/// [`PatternError::Database`]. MySQL sends the parameter types with every
/// `COM_STMT_EXECUTE` and SQLite binds each value with its own storage
/// class, so their statements stay cached.
macro_rules! impl_conn {
    ($conn:ty, $dialect:expr, $decode:path, $persistent:expr) => {
        impl SqlConnection for $conn {}

        #[async_trait]
        impl sealed::Sealed for $conn {
            fn dialect(&self) -> Dialect {
                $dialect
            }

            fn in_transaction(&self) -> bool {
                sqlx::Connection::is_in_transaction(self)
            }

            async fn execute(&mut self, sql: &str, args: &[SqlValue]) -> Result<u64, PatternError> {
                let q = bind_all!(sqlx::query(sql).persistent($persistent), args);
                q.execute(&mut *self)
                    .await
                    .map(|r| r.rows_affected())
                    .map_err(classify)
            }

            async fn fetch_first(
                &mut self,
                sql: &str,
                args: &[SqlValue],
            ) -> Result<Option<SqlValue>, PatternError> {
                let q = bind_all!(sqlx::query(sql).persistent($persistent), args);
                let row = q.fetch_optional(&mut *self).await.map_err(classify)?;
                row.as_ref().map($decode).transpose()
            }
        }
    };
}

impl_conn!(sqlx::SqliteConnection, Dialect::Sqlite, decode_sqlite, true);
#[cfg(feature = "postgres")]
impl_conn!(
    sqlx::PgConnection,
    Dialect::Postgres,
    decode_postgres,
    false
);
#[cfg(feature = "mysql")]
impl_conn!(sqlx::MySqlConnection, Dialect::MySql, decode_mysql, true);

fn undecodable(type_name: &str) -> PatternError {
    PatternError::Decode {
        detail: format!(
            "a column of type {type_name} cannot be read as an integer, text or bytes value"
        ),
    }
}

fn decode_err(e: sqlx::Error) -> PatternError {
    PatternError::Decode {
        detail: e.to_string(),
    }
}

/// The type name of the first column's value; `None` for `NULL`.
fn first_type<R: sqlx::Row>(row: &R) -> Result<Option<String>, PatternError>
where
    usize: sqlx::ColumnIndex<R>,
{
    use sqlx::{TypeInfo, ValueRef};
    let raw = row.try_get_raw(0).map_err(decode_err)?;
    Ok((!raw.is_null()).then(|| raw.type_info().name().to_owned()))
}

fn decode_sqlite(row: &sqlx::sqlite::SqliteRow) -> Result<SqlValue, PatternError> {
    use sqlx::Row;
    // The value's own storage class (SQLite types values, not columns).
    let Some(ty) = first_type(row)? else {
        return Ok(SqlValue::Null);
    };
    match ty.as_str() {
        "INTEGER" | "BOOLEAN" => row.try_get::<i64, _>(0).map(SqlValue::I64),
        "TEXT" => row.try_get::<String, _>(0).map(SqlValue::Text),
        "BLOB" => row.try_get::<Vec<u8>, _>(0).map(SqlValue::Bytes),
        other => return Err(undecodable(other)),
    }
    .map_err(decode_err)
}

#[cfg(feature = "postgres")]
fn decode_postgres(row: &sqlx::postgres::PgRow) -> Result<SqlValue, PatternError> {
    use sqlx::Row;
    let Some(ty) = first_type(row)? else {
        return Ok(SqlValue::Null);
    };
    match ty.as_str() {
        "INT8" => row.try_get::<i64, _>(0).map(SqlValue::I64),
        "INT4" => row.try_get::<i32, _>(0).map(|v| SqlValue::I64(v.into())),
        "INT2" => row.try_get::<i16, _>(0).map(|v| SqlValue::I64(v.into())),
        "TEXT" | "VARCHAR" | "BPCHAR" | "NAME" => row.try_get::<String, _>(0).map(SqlValue::Text),
        "BYTEA" => row.try_get::<Vec<u8>, _>(0).map(SqlValue::Bytes),
        "UUID" => {
            // Binary format: the 16 bytes.
            let b = row.try_get_unchecked::<Vec<u8>, _>(0).map_err(decode_err)?;
            return uuid_text(&b)
                .map(SqlValue::Text)
                .ok_or_else(|| PatternError::Decode {
                    detail: format!("a uuid of {} bytes", b.len()),
                });
        }
        other => return Err(undecodable(other)),
    }
    .map_err(decode_err)
}

#[cfg(feature = "postgres")]
fn uuid_text(b: &[u8]) -> Option<String> {
    use std::fmt::Write;
    if b.len() != 16 {
        return None;
    }
    let mut s = String::with_capacity(36);
    for (i, byte) in b.iter().enumerate() {
        if matches!(i, 4 | 6 | 8 | 10) {
            s.push('-');
        }
        let _ = write!(s, "{byte:02x}");
    }
    Some(s)
}

#[cfg(feature = "mysql")]
fn decode_mysql(row: &sqlx::mysql::MySqlRow) -> Result<SqlValue, PatternError> {
    use sqlx::Row;
    let Some(ty) = first_type(row)? else {
        return Ok(SqlValue::Null);
    };
    // Each `try_get` checks the column type first, so the order only picks
    // the first family that fits.
    if let Ok(v) = row.try_get::<i64, _>(0) {
        return Ok(SqlValue::I64(v));
    }
    if let Ok(v) = row.try_get::<u64, _>(0) {
        return i64::try_from(v)
            .map(SqlValue::I64)
            .map_err(|_| PatternError::Decode {
                detail: format!("unsigned value {v} does not fit in an i64"),
            });
    }
    if let Ok(v) = row.try_get::<String, _>(0) {
        return Ok(SqlValue::Text(v));
    }
    if let Ok(v) = row.try_get::<Vec<u8>, _>(0) {
        return Ok(SqlValue::Bytes(v));
    }
    Err(undecodable(&ty))
}
