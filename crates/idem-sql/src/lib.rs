//! # idem-sql
//!
//! SQL stores for idem. Today: [`SqliteStore`], the embedded default — one
//! file, durable, safe to share between several processes on one machine.
//! PostgreSQL and MySQL stores will live here too.
//!
//! | store | URL | when to use |
//! |---|---|---|
//! | [`SqliteStore`] | `sqlite://idem.db`, `sqlite:///abs/path.db`, `sqlite::memory:`, or a plain path | one machine, durable |
//! | `PostgresStore` (feature `postgres`, default) | `postgres://user@host:5432/db` | several instances, durable; waiters woken by `LISTEN`/`NOTIFY` |
//! | `MySqlStore` (feature `mysql`, default) | `mysql://user@host:3306/db` (MySQL 8.0+, MariaDB 10.5+) | several instances where MySQL/MariaDB is the house database |
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use idem_core::{Engine, Fingerprint, IdempotencyKey, Once, Scope};
//! use idem_sql::SqliteStore;
//!
//! let store = SqliteStore::open("sqlite::memory:").await?;
//! let engine = Engine::new(store);
//! let key = IdempotencyKey::new("order-42")?;
//! let charge = || async { Ok::<_, std::io::Error>(1000u32) };
//! let first = engine.once(&Scope::anonymous(), &key, Fingerprint::of(b"charge"), charge).await?;
//! let again = engine.once(&Scope::anonymous(), &key, Fingerprint::of(b"charge"), charge).await?;
//! assert_eq!((first, again), (Once::Executed(1000), Once::Replayed(1000)));
//! # Ok(()) }
//! ```

#[cfg(any(feature = "postgres", feature = "mysql"))]
mod common;
pub mod inbox;
pub mod lock;
#[cfg(feature = "mysql")]
mod mysql;
#[cfg(feature = "postgres")]
mod postgres;
mod sqlite;
pub mod url;

pub mod patterns;

pub use lock::LeaseLockBackend;
#[cfg(feature = "postgres")]
pub use lock::PgAdvisoryLockBackend;
#[cfg(feature = "mysql")]
pub use mysql::{MySqlOptions, MySqlStore};
#[cfg(feature = "postgres")]
pub use postgres::{PostgresOptions, PostgresStore};
pub use sqlite::{SqliteOptions, SqliteStore};
