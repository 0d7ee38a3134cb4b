//! [`SqlValue`]: the values the patterns bind.

use std::fmt;

/// A value bound to a statement (never interpolated into SQL text).
///
/// Bound as `BIGINT` / `INTEGER` ([`SqlValue::I64`]), `TEXT`
/// ([`SqlValue::Text`]) or `BYTEA` / `BLOB` ([`SqlValue::Bytes`]).
/// [`SqlValue::Null`] is written as the SQL literal `NULL` (so it fits a
/// column of any type on PostgreSQL, which types every bound parameter).
///
/// Read back from id columns as: integer columns (PostgreSQL `int2`/`int4`/
/// `int8`, MySQL signed or unsigned integers up to `i64::MAX`, SQLite
/// `INTEGER`) → `I64`; text columns (and PostgreSQL `uuid`, as its
/// hyphenated lowercase text) → `Text`; binary columns → `Bytes`. MySQL
/// reports text columns with a binary collation (`utf8mb4_bin`) as binary,
/// so those read back as `Bytes` (sqlx does not expose the collation).
///
/// ```
/// use idem_sql::patterns::SqlValue;
/// assert_eq!(SqlValue::from(7), SqlValue::I64(7));
/// assert_eq!(SqlValue::from("a"), SqlValue::Text("a".into()));
/// assert_eq!(SqlValue::from(None::<i64>), SqlValue::Null);
/// assert_eq!(SqlValue::I64(7).as_i64(), Some(7));
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum SqlValue {
    /// SQL `NULL`.
    Null,
    /// A 64-bit signed integer.
    I64(i64),
    /// UTF-8 text.
    Text(String),
    /// Raw bytes.
    Bytes(Vec<u8>),
}

impl SqlValue {
    /// The integer, if this is [`SqlValue::I64`].
    pub fn as_i64(&self) -> Option<i64> {
        match self {
            Self::I64(v) => Some(*v),
            _ => None,
        }
    }

    /// The text, if this is [`SqlValue::Text`].
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Self::Text(v) => Some(v),
            _ => None,
        }
    }

    /// The bytes, if this is [`SqlValue::Bytes`].
    pub fn as_bytes(&self) -> Option<&[u8]> {
        match self {
            Self::Bytes(v) => Some(v),
            _ => None,
        }
    }

    /// `true` for [`SqlValue::Null`].
    pub fn is_null(&self) -> bool {
        matches!(self, Self::Null)
    }
}

impl fmt::Display for SqlValue {
    /// `NULL`, the integer, the text, or the bytes as lowercase hex with an
    /// `0x` prefix.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Null => f.write_str("NULL"),
            Self::I64(v) => write!(f, "{v}"),
            Self::Text(v) => f.write_str(v),
            Self::Bytes(v) => {
                f.write_str("0x")?;
                v.iter().try_for_each(|b| write!(f, "{b:02x}"))
            }
        }
    }
}

impl From<i64> for SqlValue {
    fn from(v: i64) -> Self {
        Self::I64(v)
    }
}

impl From<i32> for SqlValue {
    fn from(v: i32) -> Self {
        Self::I64(v.into())
    }
}

impl From<&str> for SqlValue {
    fn from(v: &str) -> Self {
        Self::Text(v.to_owned())
    }
}

impl From<String> for SqlValue {
    fn from(v: String) -> Self {
        Self::Text(v)
    }
}

impl From<&String> for SqlValue {
    fn from(v: &String) -> Self {
        Self::Text(v.clone())
    }
}

impl From<Vec<u8>> for SqlValue {
    fn from(v: Vec<u8>) -> Self {
        Self::Bytes(v)
    }
}

impl From<&[u8]> for SqlValue {
    fn from(v: &[u8]) -> Self {
        Self::Bytes(v.to_vec())
    }
}

impl From<&SqlValue> for SqlValue {
    fn from(v: &SqlValue) -> Self {
        v.clone()
    }
}

impl<T: Into<SqlValue>> From<Option<T>> for SqlValue {
    fn from(v: Option<T>) -> Self {
        v.map_or(Self::Null, Into::into)
    }
}
