//! Validated table and column names, quoted per dialect.

use super::conn::Dialect;
use super::error::PatternError;

/// Longest identifier part accepted (PostgreSQL's `NAMEDATALEN - 1`; MySQL
/// allows 64, SQLite more).
pub(crate) const MAX_IDENT_LEN: usize = 63;

fn is_ident(name: &str) -> bool {
    crate::dialect::is_plain_ident(name, MAX_IDENT_LEN)
}

/// A column name: `[A-Za-z_][A-Za-z0-9_]{0,62}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Column(String);

impl Column {
    pub(crate) fn parse(name: &str) -> Result<Self, PatternError> {
        if is_ident(name) {
            Ok(Self(name.to_owned()))
        } else {
            Err(PatternError::InvalidIdentifier {
                what: "column",
                name: name.to_owned(),
            })
        }
    }

    pub(crate) fn name(&self) -> &str {
        &self.0
    }

    pub(crate) fn quoted(&self, dialect: Dialect) -> String {
        dialect.quote(&self.0)
    }
}

/// A table name, `table` or `schema.table`, each part an identifier.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Table {
    schema: Option<String>,
    name: String,
}

impl Table {
    pub(crate) fn parse(name: &str) -> Result<Self, PatternError> {
        let bad = || PatternError::InvalidIdentifier {
            what: "table",
            name: name.to_owned(),
        };
        let mut parts = name.split('.');
        let (first, second) = (parts.next(), parts.next());
        if parts.next().is_some() {
            return Err(bad());
        }
        let (schema, table) = match (first, second) {
            (Some(t), None) => (None, t),
            (Some(s), Some(t)) => (Some(s), t),
            _ => return Err(bad()),
        };
        if !is_ident(table) || schema.is_some_and(|s| !is_ident(s)) {
            return Err(bad());
        }
        Ok(Self {
            schema: schema.map(str::to_owned),
            name: table.to_owned(),
        })
    }

    /// The schema part, when given.
    #[cfg_attr(not(feature = "mysql"), allow(dead_code))]
    pub(crate) fn schema(&self) -> Option<&str> {
        self.schema.as_deref()
    }

    /// The table part.
    #[cfg_attr(not(feature = "mysql"), allow(dead_code))]
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    pub(crate) fn quoted(&self, dialect: Dialect) -> String {
        match &self.schema {
            Some(s) => dialect.quote_path(&[s, &self.name]),
            None => dialect.quote(&self.name),
        }
    }
}

/// What a pattern works on: a table, its id column, and the one column the
/// pattern manages (the state, the version, the business key).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Target {
    pub(crate) table: Table,
    pub(crate) id: Column,
    pub(crate) column: Column,
}

/// The names of a [`Target`], quoted for one dialect.
#[derive(Debug)]
pub(crate) struct Quoted {
    pub(crate) table: String,
    pub(crate) id: String,
    pub(crate) column: String,
}

impl Target {
    /// Validates the three names.
    pub(crate) fn parse(table: &str, id_column: &str, column: &str) -> Result<Self, PatternError> {
        Ok(Self {
            table: Table::parse(table)?,
            id: Column::parse(id_column)?,
            column: Column::parse(column)?,
        })
    }

    pub(crate) fn quoted(&self, dialect: Dialect) -> Quoted {
        Quoted {
            table: self.table.quoted(dialect),
            id: self.id.quoted(dialect),
            column: self.column.quoted(dialect),
        }
    }
}

/// `InvalidArgument` when `value` (an id or key, named by `what`) is `NULL`.
pub(crate) fn not_null(value: &super::SqlValue, what: &str) -> Result<(), PatternError> {
    if value.is_null() {
        Err(PatternError::InvalidArgument {
            detail: format!("the {what} is NULL"),
        })
    } else {
        Ok(())
    }
}

/// Checks the `set` list of an update or insert: valid, distinct names, none
/// of them in `reserved` (the columns the pattern writes itself).
pub(crate) fn columns(
    set: &[(&str, super::SqlValue)],
    reserved: &[(&Column, &str)],
) -> Result<Vec<Column>, PatternError> {
    let mut out: Vec<Column> = Vec::with_capacity(set.len());
    for (name, _) in set {
        let c = Column::parse(name)?;
        if let Some((_, role)) = reserved.iter().find(|(r, _)| r.name() == c.name()) {
            return Err(PatternError::InvalidArgument {
                detail: format!("column {name:?} is the {role} column; the pattern sets it"),
            });
        }
        if out.iter().any(|o| o.name() == c.name()) {
            return Err(PatternError::InvalidArgument {
                detail: format!("column {name:?} appears twice"),
            });
        }
        out.push(c);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        assert!(Column::parse("state").is_ok());
        assert!(Column::parse("_x9").is_ok());
        assert!(Column::parse(&"a".repeat(63)).is_ok());
        for bad in ["", "a;drop", "9a", "a b", "a\"b", "a`b", "a'b", "é", "a.b"] {
            assert!(Column::parse(bad).is_err(), "{bad:?}");
        }
        assert!(Column::parse(&"a".repeat(64)).is_err());
        assert!(Table::parse("s.t").is_ok());
        for bad in ["", ".", "s.", ".t", "a.b.c", "s.t;", "s . t"] {
            assert!(Table::parse(bad).is_err(), "{bad:?}");
        }
        let t = Table::parse("s.t").unwrap();
        assert_eq!(t.quoted(Dialect::Sqlite), "\"s\".\"t\"");
    }
}
