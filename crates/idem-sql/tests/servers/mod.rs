//! The real database servers the SQL tests run against, in one place
//! ([`Server`]): their URLs (`IDEM_TEST_POSTGRES_URL`, default
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

/// A pool with `opts` on the server of `DB`, or the test fails naming the
/// command that starts it.
pub async fn pool_with<DB: OnServer>(opts: sqlx::pool::PoolOptions<DB>) -> sqlx::Pool<DB> {
    let (server, url) = (DB::SERVER, DB::SERVER.url());
    opts.connect(&url)
        .await
        .unwrap_or_else(|e| connect_failed(server.what(), &url, &e, server.start()))
}

/// A pool of `max` connections on the server of `DB`.
pub async fn pool<DB: OnServer>(max: u32) -> sqlx::Pool<DB> {
    pool_with(pool_options(max)).await
}

/// A pool of `max` connections on the PostgreSQL server.
#[cfg(feature = "postgres")]
pub async fn pg_pool(max: u32) -> sqlx::PgPool {
    pool(max).await
}

/// A pool of `max` connections on the MySQL / MariaDB server.
#[cfg(feature = "mysql")]
pub async fn my_pool(max: u32) -> sqlx::MySqlPool {
    pool(max).await
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

/// A database server the tests run against (and a [`Cleanup`] talks to),
/// with what is known of it: its name, URL, default port and the command
/// that starts it.
#[derive(Clone, Copy, Debug)]
pub enum Server {
    /// PostgreSQL, at `IDEM_TEST_POSTGRES_URL`.
    #[cfg(feature = "postgres")]
    Postgres,
    /// MySQL / MariaDB, at `IDEM_TEST_MYSQL_URL`.
    #[cfg(feature = "mysql")]
    MySql,
}

impl Server {
    /// Its name in messages.
    pub const fn what(self) -> &'static str {
        match self {
            #[cfg(feature = "postgres")]
            Self::Postgres => "PostgreSQL",
            #[cfg(feature = "mysql")]
            Self::MySql => "MySQL/MariaDB",
        }
    }

    /// The command that starts it on this machine.
    pub const fn start(self) -> &'static str {
        match self {
            #[cfg(feature = "postgres")]
            Self::Postgres => START_PG,
            #[cfg(feature = "mysql")]
            Self::MySql => START_MY,
        }
    }

    /// Its port when a URL names none.
    pub const fn port(self) -> u16 {
        match self {
            #[cfg(feature = "postgres")]
            Self::Postgres => 5432,
            #[cfg(feature = "mysql")]
            Self::MySql => 3306,
        }
    }

    /// Its URL: the variable's value, or the default.
    // Without a server feature there is no variant, and nothing to reach.
    #[cfg_attr(
        not(any(feature = "postgres", feature = "mysql")),
        allow(unreachable_code)
    )]
    pub fn url(self) -> String {
        let (var, default): (&str, &str) = match self {
            #[cfg(feature = "postgres")]
            Self::Postgres => (
                "IDEM_TEST_POSTGRES_URL",
                "postgres://postgres@127.0.0.1:5432/test",
            ),
            #[cfg(feature = "mysql")]
            Self::MySql => ("IDEM_TEST_MYSQL_URL", "mysql://root@127.0.0.1:3306/test"),
        };
        std::env::var(var).unwrap_or_else(|_| default.into())
    }
}

/// An sqlx database the tests reach on a [`Server`].
pub trait OnServer: sqlx::Database {
    /// Its server.
    const SERVER: Server;
}

#[cfg(feature = "postgres")]
impl OnServer for sqlx::Postgres {
    const SERVER: Server = Server::Postgres;
}

#[cfg(feature = "mysql")]
impl OnServer for sqlx::MySql {
    const SERVER: Server = Server::MySql;
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
                        if let Ok(mut c) = sqlx::PgConnection::connect(&server.url()).await {
                            let _ = sqlx::raw_sql(&sql).execute(&mut c).await;
                            let _ = c.close().await;
                        }
                    }
                    #[cfg(feature = "mysql")]
                    Server::MySql => {
                        if let Ok(mut c) = sqlx::MySqlConnection::connect(&server.url()).await {
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
