//! SQL patterns for exactly-once writes in your own tables: state-machine
//! transitions by compare-and-set ([`StateMachine`]), optimistic updates by
//! version ([`Versioned`]) and insert-or-get on a business key
//! ([`InsertOrGet`]).
//!
//! Each runs on a `&mut` connection implementing [`SqlConnection`]:
//! `sqlx::SqliteConnection` (always), `sqlx::PgConnection` (feature
//! `postgres`), `sqlx::MySqlConnection` (feature `mysql`) — so `&mut *tx`
//! (inside your transaction) and `&mut *pool.acquire().await?` both work.
//!
//! Answers are values, not errors: a lost race is
//! [`Transition::Conflict`] / [`VersionedUpdate::Stale`] / an existing id
//! from [`InsertOrGet`]. Names are validated
//! (`[A-Za-z_][A-Za-z0-9_]{0,62}`, tables optionally `schema.table`) and
//! quoted; values are always bound. Errors are told apart by database
//! error code, never by message text.
//!
//! Guides: `docs/patterns/transitions.md`, `docs/patterns/insert-or-get.md`.

mod conn;
mod error;
mod ident;
mod insert_or_get;
mod sql;
mod transition;
mod value;
mod versioned;

pub use conn::SqlConnection;
pub use error::PatternError;
pub use insert_or_get::{Created, InsertOrGet};
pub use transition::{StateMachine, Transition};
pub use value::SqlValue;
pub use versioned::{Versioned, VersionedUpdate};

/// The guides' examples, run as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../../../../docs/patterns/transitions.md")]
struct TransitionsGuide;

#[cfg(doctest)]
#[doc = include_str!("../../../../docs/patterns/insert-or-get.md")]
struct InsertOrGetGuide;
