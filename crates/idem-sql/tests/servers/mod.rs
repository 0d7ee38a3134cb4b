//! The real database servers the SQL tests run against, in one place: their
//! URLs (`IDEM_TEST_POSTGRES_URL`, default
//! `postgres://postgres@127.0.0.1:5432/test`; `IDEM_TEST_MYSQL_URL`, default
//! `mysql://root@127.0.0.1:3306/test`), the commands that start them, pools
//! that fail the test (never skip it) when a server is down, SQLite files
//! shared by a pool, and clean-up that runs when a check ends.

#![allow(dead_code, unreachable_pub)]

use std::time::Duration;

/// Starts the PostgreSQL server of this machine.
pub const START_PG: &str =
    "pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start";
/// Starts the MariaDB server of this machine.
pub const START_MY: &str =
    "start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd";

/// The PostgreSQL server's URL.
pub fn pg_url() -> String {
    std::env::var("IDEM_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

/// The MySQL / MariaDB server's URL.
pub fn my_url() -> String {
    std::env::var("IDEM_TEST_MYSQL_URL")
        .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into())
}

/// Fails the test (never skips it) when the server cannot be reached, with
/// the command that starts it; otherwise with the error.
pub fn connect_failed(what: &str, url: &str, err: &sqlx::Error, start: &str) -> ! {
    if matches!(err, sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut) {
        panic!(
            "{what} at {url} is not reachable ({err}).\n\
             These tests need the real server. Start it with:\n    {start}\n\
             (or point the URL variable at another server)"
        );
    }
    panic!("connecting to {what} at {url} failed: {err} ({err:?})")
}

/// Pool options for the tests: `max` connections, 10 s to get one.
pub fn pool_options<DB: sqlx::Database>(max: u32) -> sqlx::pool::PoolOptions<DB> {
    sqlx::pool::PoolOptions::new()
        .max_connections(max)
        .acquire_timeout(Duration::from_secs(10))
}

/// A pool with `opts` on the server `what` at `url`, or the test fails
/// naming `start`.
async fn pool_at<DB: sqlx::Database>(
    opts: sqlx::pool::PoolOptions<DB>,
    what: &str,
    url: &str,
    start: &str,
) -> sqlx::Pool<DB> {
    opts.connect(url)
        .await
        .unwrap_or_else(|e| connect_failed(what, url, &e, start))
}

/// A pool on the PostgreSQL server, with `opts`.
#[cfg(feature = "postgres")]
pub async fn pg_pool_with(opts: sqlx::postgres::PgPoolOptions) -> sqlx::PgPool {
    pool_at(opts, "PostgreSQL", &pg_url(), START_PG).await
}

/// A pool of `max` connections on the PostgreSQL server.
#[cfg(feature = "postgres")]
pub async fn pg_pool(max: u32) -> sqlx::PgPool {
    pg_pool_with(pool_options(max)).await
}

/// A pool on the MySQL / MariaDB server, with `opts`.
#[cfg(feature = "mysql")]
pub async fn my_pool_with(opts: sqlx::mysql::MySqlPoolOptions) -> sqlx::MySqlPool {
    pool_at(opts, "MySQL/MariaDB", &my_url(), START_MY).await
}

/// A pool of `max` connections on the MySQL / MariaDB server.
#[cfg(feature = "mysql")]
pub async fn my_pool(max: u32) -> sqlx::MySqlPool {
    my_pool_with(pool_options(max)).await
}

/// A pool of `max` connections on the SQLite file `path` (created), in WAL
/// mode with a `busy` timeout, so concurrent transactions really contend.
pub async fn sqlite_file_pool(
    path: &std::path::Path,
    max: u32,
    busy: Duration,
) -> sqlx::SqlitePool {
    use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
    let opts = SqliteConnectOptions::new()
        .filename(path)
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .busy_timeout(busy);
    SqlitePoolOptions::new()
        .max_connections(max)
        .connect_with(opts)
        .await
        .expect("open SQLite")
}

/// Which server a [`Cleanup`] talks to.
#[derive(Clone, Copy, Debug)]
pub enum Server {
    /// PostgreSQL, at [`pg_url`].
    #[cfg(feature = "postgres")]
    Postgres,
    /// MySQL / MariaDB, at [`my_url`].
    #[cfg(feature = "mysql")]
    MySql,
}

/// Runs `sql` (one or more statements) on a fresh connection to `server`
/// when dropped: the clean-up of a check's schema or tables. Drop is
/// synchronous, so it runs on a thread with its own runtime; errors are
/// ignored (a clean-up must not hide the check's own failure).
#[derive(Debug)]
pub struct Cleanup {
    server: Server,
    name: String,
    sql: String,
}

impl Cleanup {
    /// Runs `sql` on `server` when dropped; `name` is what it cleans up
    /// (a schema, a table), for the check to use.
    pub fn new(server: Server, name: &str, sql: impl Into<String>) -> Self {
        Self {
            server,
            name: name.to_owned(),
            sql: sql.into(),
        }
    }

    /// The schema or table this cleans up.
    pub fn name(&self) -> &str {
        &self.name
    }
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        let (server, sql) = (self.server, self.sql.clone());
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async {
                use sqlx::Connection;
                match server {
                    #[cfg(feature = "postgres")]
                    Server::Postgres => {
                        if let Ok(mut c) = sqlx::PgConnection::connect(&pg_url()).await {
                            let _ = sqlx::raw_sql(&sql).execute(&mut c).await;
                            let _ = c.close().await;
                        }
                    }
                    #[cfg(feature = "mysql")]
                    Server::MySql => {
                        if let Ok(mut c) = sqlx::MySqlConnection::connect(&my_url()).await {
                            let _ = sqlx::raw_sql(&sql).execute(&mut c).await;
                            let _ = c.close().await;
                        }
                    }
                }
            });
        })
        .join();
    }
}
