//! A tiny statement builder: placeholders per dialect, values bound.

use super::conn::Dialect;
use super::ident::{Column, Quoted};
use super::SqlValue;

/// SQL text with its bound values. Names go in through
/// [`Column::quoted`](super::ident::Column::quoted) and
/// [`Table::quoted`](super::ident::Table::quoted) only (validated first).
#[derive(Debug)]
pub(crate) struct Sql {
    dialect: Dialect,
    pub(crate) text: String,
    pub(crate) args: Vec<SqlValue>,
}

impl Sql {
    pub(crate) fn new(dialect: Dialect) -> Self {
        Self {
            dialect,
            text: String::with_capacity(128),
            args: Vec::new(),
        }
    }

    /// Appends fixed SQL text (never user input).
    pub(crate) fn push(&mut self, text: &str) -> &mut Self {
        self.text.push_str(text);
        self
    }

    /// Appends a placeholder bound to `value`; `NULL` is written as the
    /// literal (untyped, so it fits any column on PostgreSQL).
    pub(crate) fn bind(&mut self, value: SqlValue) -> &mut Self {
        if value.is_null() {
            self.text.push_str("NULL");
            return self;
        }
        self.args.push(value);
        self.text.push_str(&self.dialect.param(self.args.len()));
        self
    }
}

/// `UPDATE table SET <head>, c = ?, … WHERE id = ?` with the columns of
/// `set` (validated as `cols`); the caller appends its guard (`AND …`).
/// `head` writes the pattern's own assignment.
pub(crate) fn update(
    dialect: Dialect,
    q: &Quoted,
    head: impl FnOnce(&mut Sql),
    cols: &[Column],
    set: &[(&str, SqlValue)],
    id: SqlValue,
) -> Sql {
    let mut sql = Sql::new(dialect);
    sql.push("UPDATE ").push(&q.table).push(" SET ");
    head(&mut sql);
    for (c, (_, v)) in cols.iter().zip(set) {
        sql.push(", ")
            .push(&c.quoted(dialect))
            .push(" = ")
            .bind(v.clone());
    }
    sql.push(" WHERE ").push(&q.id).push(" = ").bind(id);
    sql
}
