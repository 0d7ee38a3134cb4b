//! Opening a store from its URL.

use std::sync::Arc;
use std::time::Duration;

use idem_core::url::Param;
use idem_core::{DynStore, MemoryLimits, MemoryStore, RedactedUrl, StoreError};

/// Every URL form the gateway accepts, for error messages.
pub(crate) const SUPPORTED: &str = "memory://, sqlite://relative/path.db, \
     sqlite:///absolute/path.db, postgres://user@host:5432/db (or postgresql://), \
     mysql://user@host:3306/db (or mariadb://), redis://host:6379/ (or rediss:// for TLS, \
     redis+unix:///path.sock), redis+cluster://host:port,host:port (or rediss+cluster://)";

/// The kind of store a URL selects.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StoreKind {
    Memory,
    Sqlite,
    Postgres,
    MySql,
    Redis,
    RedisCluster,
}

impl StoreKind {
    /// Reads the scheme of a store URL and has its backend check the rest
    /// (options and names), without connecting.
    pub(crate) fn of_url(url: &str) -> Result<Self, StoreError> {
        StoreUrl::parse(url).map(|u| u.kind())
    }

    /// The kind a URL's scheme selects, built in or not.
    fn of_scheme(url: &str) -> Result<Self, StoreError> {
        let url = url.trim();
        let shown = redact(url);
        let Some((scheme, rest)) = url.split_once("://") else {
            return Err(StoreError::Config(format!(
                "store URL {shown:?} has no scheme; supported: {SUPPORTED}"
            )));
        };
        Ok(match scheme.to_ascii_lowercase().as_str() {
            "memory" if rest.is_empty() || rest.starts_with('?') => Self::Memory,
            "memory" => {
                return Err(StoreError::Config(format!(
                    "store URL {shown:?}: memory:// takes nothing after the scheme but \
                     ?idem_max_records=N"
                )))
            }
            "sqlite" => Self::Sqlite,
            "postgres" | "postgresql" => Self::Postgres,
            "mysql" | "mariadb" => Self::MySql,
            "redis" | "rediss" | "redis+unix" => Self::Redis,
            "redis+cluster" | "rediss+cluster" => Self::RedisCluster,
            s => {
                return Err(StoreError::Config(format!(
                    "store URL {shown:?}: unknown scheme {s:?}; supported: {SUPPORTED}"
                )))
            }
        })
    }

    /// The name reported by `GET /_idem/health`.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Memory => "memory",
            Self::Sqlite => "sqlite",
            Self::Postgres => "postgres",
            Self::MySql => "mysql",
            Self::Redis => "redis",
            Self::RedisCluster => "redis-cluster",
        }
    }

    /// The Cargo feature (of this crate and of `idem-cli`) that builds this
    /// kind of store in.
    fn feature(self) -> &'static str {
        match self {
            Self::Memory => "memory",
            Self::Sqlite => "sqlite",
            Self::Postgres => "postgres",
            Self::MySql => "mysql",
            Self::Redis | Self::RedisCluster => "redis",
        }
    }

    /// The error for a URL of a kind this build leaves out.
    fn compiled_out(self, url: &str) -> StoreError {
        StoreError::Config(format!(
            "store URL {:?}: {} stores are not built into this binary; build it with the \
             Cargo feature `{}` (on by default)",
            redact(url.trim()),
            self.name(),
            self.feature()
        ))
    }
}

/// Settings the gateway applies to every store it opens (the `--store-*`
/// flags).
///
/// ```
/// use std::time::Duration;
/// let o = idem_gateway::StoreOptions::default();
/// assert_eq!((o.pool_size, o.timeout), (16, Duration::from_secs(5)));
/// ```
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct StoreOptions {
    /// Most pooled connections of a PostgreSQL or MySQL store (default 16,
    /// at least 1). SQLite keeps its own small pool (one writer at a time
    /// gains nothing from more); Redis multiplexes one connection.
    pub pool_size: u32,
    /// The longest one store call may take (default 5 s): waiting for a
    /// pooled connection, opening one, and the statement or script itself.
    /// Also the store's connect timeout at startup, PostgreSQL's
    /// `statement_timeout`, MySQL's `innodb_lock_wait_timeout` and statement
    /// time limit, Redis's connection timeout, SQLite's busy timeout. A call
    /// cut off by it fails with [`StoreError::Timeout`]; its effect is
    /// unknown. The stores' own client-side deadlines are longer (about
    /// `2 × timeout + 2 s`: PostgreSQL's and MySQL's per statement, Redis's
    /// response timeout), so a `begin` cut off here still hears the store's
    /// late answer and the gateway releases a claim that landed after its
    /// caller gave up.
    pub timeout: Duration,
}

impl Default for StoreOptions {
    fn default() -> Self {
        Self {
            pool_size: 16,
            timeout: Duration::from_secs(5),
        }
    }
}

impl StoreOptions {
    /// Sets [`Self::pool_size`] (0 is taken as 1).
    pub fn with_pool_size(mut self, n: u32) -> Self {
        self.pool_size = n.max(1);
        self
    }

    /// Sets [`Self::timeout`].
    pub fn with_timeout(mut self, d: Duration) -> Self {
        self.timeout = d;
        self
    }
}

/// A store URL read by the backend its scheme selects: what
/// [`open_store_with`] opens. Each backend checks its own `idem_*`
/// parameters and names ([`idem_sql::url::SqliteUrl`],
/// `idem_sql::PostgresOptions::from_url`, `idem_sql::MySqlOptions::from_url`,
/// `idem_redis::RedisUrl`).
#[derive(Clone)]
pub(crate) enum StoreUrl {
    Memory(MemoryLimits),
    Sqlite(idem_sql::url::SqliteUrl),
    #[cfg(feature = "postgres")]
    Postgres(idem_sql::PostgresOptions),
    #[cfg(feature = "mysql")]
    MySql(idem_sql::MySqlOptions),
    #[cfg(feature = "redis")]
    Redis(idem_redis::RedisUrl),
}

impl std::fmt::Debug for StoreUrl {
    // The SQL options' derived Debug would print the URL's password.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let url = match self {
            Self::Memory(_) => RedactedUrl::new("memory://"),
            Self::Sqlite(u) => u.url.clone(),
            #[cfg(feature = "postgres")]
            Self::Postgres(o) => RedactedUrl::new(o.url.as_str()),
            #[cfg(feature = "mysql")]
            Self::MySql(o) => RedactedUrl::new(o.url.as_str()),
            #[cfg(feature = "redis")]
            Self::Redis(u) => u.url.clone(),
        };
        f.debug_struct("StoreUrl")
            .field("kind", &self.kind())
            .field("driver_url", &url)
            .finish_non_exhaustive()
    }
}

impl StoreUrl {
    /// Parses and checks a store URL without connecting: the gateway reads
    /// the scheme, the backend the rest.
    pub(crate) fn parse(url: &str) -> Result<Self, StoreError> {
        let kind = StoreKind::of_scheme(url)?;
        // With every backend built in, the last arm is never reached.
        #[allow(unreachable_patterns)]
        Ok(match kind {
            StoreKind::Memory => Self::Memory(memory_limits(url)?),
            StoreKind::Sqlite => Self::Sqlite(idem_sql::url::SqliteUrl::parse(url)?),
            #[cfg(feature = "postgres")]
            StoreKind::Postgres => Self::Postgres(idem_sql::PostgresOptions::from_url(url)?),
            #[cfg(feature = "mysql")]
            StoreKind::MySql => Self::MySql(idem_sql::MySqlOptions::from_url(url)?),
            #[cfg(feature = "redis")]
            StoreKind::Redis | StoreKind::RedisCluster => {
                Self::Redis(idem_redis::RedisUrl::parse(url)?)
            }
            kind => return Err(kind.compiled_out(url)),
        })
    }

    /// The kind of store.
    pub(crate) fn kind(&self) -> StoreKind {
        match self {
            Self::Memory(_) => StoreKind::Memory,
            Self::Sqlite(_) => StoreKind::Sqlite,
            #[cfg(feature = "postgres")]
            Self::Postgres(_) => StoreKind::Postgres,
            #[cfg(feature = "mysql")]
            Self::MySql(_) => StoreKind::MySql,
            #[cfg(feature = "redis")]
            Self::Redis(u) if u.cluster => StoreKind::RedisCluster,
            #[cfg(feature = "redis")]
            Self::Redis(_) => StoreKind::Redis,
        }
    }
}

/// The caps of a `memory://` URL: `idem_max_records=N` (default
/// 1,000,000, at least 1) sets [`MemoryLimits::max_entries`].
fn memory_limits(url: &str) -> Result<MemoryLimits, StoreError> {
    let u = idem_core::url::StoreUrl::parse(url)?;
    let o = u.options("memory", &[Param::Text("idem_max_records")])?;
    if o.driver_url().expose() != "memory://" {
        return Err(u.error("memory:// takes no parameters but idem_max_records"));
    }
    let mut limits = MemoryLimits::default();
    if let Some(n) = o.text("idem_max_records") {
        limits.max_entries = match n.parse::<usize>() {
            Ok(n) if n > 0 => n,
            _ => {
                return Err(u.error(format_args!(
                    "idem_max_records takes a number of records above 0, not {n:?}"
                )))
            }
        };
    }
    Ok(limits)
}

/// The record cap of a `memory://` URL (`idem_max_records`), `None` for
/// other stores and for URLs that do not parse.
pub(crate) fn memory_max_records(url: &str) -> Option<usize> {
    match StoreKind::of_scheme(url) {
        Ok(StoreKind::Memory) => memory_limits(url).ok().map(|l| l.max_entries),
        _ => None,
    }
}

/// A store URL fit for logs and messages: a password in the user info is
/// replaced by `***` (`postgres://idem:***@db/app`).
pub(crate) use idem_core::url::redact;
/// Opens the store a URL names, with [`StoreOptions::default`].
///
/// See [`open_store_with`] for the URL forms.
///
/// ```
/// # tokio::runtime::Runtime::new().unwrap().block_on(async {
/// let store = idem_gateway::open_store("memory://").await.unwrap();
/// assert!(idem_gateway::open_store("ftp://db/idem").await.is_err());
/// # });
/// ```
///
/// # Errors
/// As [`open_store_with`].
pub async fn open_store(url: &str) -> Result<DynStore, StoreError> {
    open_store_with(url, &StoreOptions::default()).await
}

/// Opens the store a URL names.
///
/// | URL | store |
/// |---|---|
/// | `memory://` | an in-process [`MemoryStore`] (nothing survives the process) |
/// | `sqlite://relative.db`, `sqlite:///absolute/path.db` | a SQLite file, created if missing |
/// | `postgres://user:pw@host:5432/db` (`postgresql://`) | [`idem_sql::PostgresStore`] |
/// | `mysql://user:pw@host:3306/db` (`mariadb://`) | [`idem_sql::MySqlStore`] (MySQL 8.0+, MariaDB 10.5+) |
/// | `redis://[user:pw@]host:6379[/db]`, `rediss://…`, `redis+unix:///path.sock` | [`idem_redis::RedisStore`], one server |
/// | `redis+cluster://host:port,host:port` (`rediss+cluster://`) | [`idem_redis::RedisStore`] on a Redis Cluster |
///
/// Query parameters starting with `idem_` are the gateway's and are
/// removed before the URL reaches the driver; all others are the
/// driver's, passed through unchanged (PostgreSQL's `sslmode`,
/// `sslrootcert`, `sslcert`, `sslkey`; MySQL's `ssl-mode`, `ssl-ca`,
/// `ssl-cert`, `ssl-key`). `rediss://…#insecure` is refused:
///
/// | parameter | stores | meaning | default |
/// |---|---|---|---|
/// | `idem_table` | PostgreSQL, MySQL | the records table (a plain identifier, ≤ 54 bytes) | `idem_records` |
/// | `idem_schema` | PostgreSQL | the schema of the table, created when missing | `public` |
/// | `idem_migrate` | PostgreSQL, MySQL | create missing tables at startup (`false` when the role may not run DDL) | `true` |
/// | `idem_prefix` | Redis | the first part of every Redis key and channel (≤ 64 bytes) | `idem` |
/// | `idem_tls_ca` | `rediss://` | the CA (PEM file) the server's certificate must chain to | the system's roots |
/// | `idem_tls_cert`, `idem_tls_key` | `rediss://` | a client certificate and key (PEM files), both or neither | none |
/// | `idem_max_records` | memory | most records kept (claims, results and submit-token markers); a full store answers 503 `store-full` | `1000000` |
///
/// Each store reads its own URL (`idem_sql::PostgresOptions::from_url`,
/// `idem_sql::MySqlOptions::from_url`, [`idem_sql::url::SqliteUrl`],
/// `idem_redis::RedisUrl`); this function picks it by the scheme.
/// PostgreSQL, MySQL and Redis need this crate's features `postgres`,
/// `mysql` and `redis` (all on by default; SQLite and memory are always
/// built in); `rediss://` needs `redis-tls` (on by default).
/// The connection is opened (and the schema created) before this returns.
///
/// # Errors
/// [`StoreError::Config`] for an unsupported or malformed URL (the message
/// lists the supported forms), a bad option, or a store whose feature this
/// build leaves out (the message names the feature); the store's own errors when
/// it cannot be reached within `options.timeout`
/// ([`StoreError::Unavailable`] or [`StoreError::Timeout`], phase
/// `Connect`) or its file or tables cannot be created.
pub async fn open_store_with(url: &str, options: &StoreOptions) -> Result<DynStore, StoreError> {
    let t = options.timeout;
    let store: DynStore = match StoreUrl::parse(url)? {
        StoreUrl::Memory(limits) => Arc::new(MemoryStore::new().with_limits(limits)),
        StoreUrl::Sqlite(u) => {
            let o = idem_sql::SqliteOptions::default()
                .with_busy_timeout(t)
                .with_acquire_timeout(t);
            Arc::new(idem_sql::SqliteStore::open_with(u.url.expose(), o).await?)
        }
        #[cfg(feature = "postgres")]
        StoreUrl::Postgres(o) => {
            let o = o
                .with_max_connections(options.pool_size.max(1))
                .with_acquire_timeout(t)
                .with_connect_timeout(t)
                .with_statement_timeout(Some(t));
            Arc::new(idem_sql::PostgresStore::connect_with(o).await?)
        }
        #[cfg(feature = "mysql")]
        StoreUrl::MySql(o) => {
            let o = o
                .with_max_connections(options.pool_size.max(1))
                .with_acquire_timeout(t)
                .with_connect_timeout(t)
                .with_lock_wait_timeout(t)
                .with_statement_timeout(Some(t));
            Arc::new(idem_sql::MySqlStore::connect_with(o).await?)
        }
        #[cfg(feature = "redis")]
        StoreUrl::Redis(u) => {
            // The response timeout outlasts the gateway's bound on each call
            // (like the SQL stores' client-side deadlines): a script sent
            // before Redis stalled is still answered, so a claim that lands
            // after its caller timed out can be released (see `guard`).
            let o = u
                .options
                .with_response_timeout(t.saturating_mul(2).saturating_add(Duration::from_secs(2)))
                .with_connection_timeout(t);
            Arc::new(idem_redis::RedisStore::connect_with(u.url.expose(), o).await?)
        }
    };
    Ok(store)
}

#[cfg(test)]
mod tests {
    use super::*;

    // The backends' own tests check what they take out of their URLs
    // (idem-core `url`, idem-sql `url`, idem-redis `url`); these check the
    // dispatch by scheme.

    #[cfg(all(feature = "postgres", feature = "mysql", feature = "redis"))]
    fn parse(url: &str) -> StoreUrl {
        StoreUrl::parse(url).unwrap_or_else(|e| panic!("{url}: {e}"))
    }

    #[cfg(all(feature = "postgres", feature = "mysql", feature = "redis"))]
    #[test]
    fn kinds() {
        for (url, kind) in [
            ("memory://", StoreKind::Memory),
            ("sqlite://idem.db", StoreKind::Sqlite),
            ("sqlite:///tmp/x.db", StoreKind::Sqlite),
            ("postgres://u@h:5432/db", StoreKind::Postgres),
            ("postgresql://h/db", StoreKind::Postgres),
            ("POSTGRES://h/db", StoreKind::Postgres),
            ("mysql://root@h:3306/test", StoreKind::MySql),
            ("mariadb://root@h/test", StoreKind::MySql),
            ("redis://127.0.0.1:6379/", StoreKind::Redis),
            ("rediss://h:6380", StoreKind::Redis),
            ("redis+unix:///run/redis.sock", StoreKind::Redis),
            ("redis+cluster://h:7000,h:7001", StoreKind::RedisCluster),
            ("rediss+cluster://h:7000", StoreKind::RedisCluster),
        ] {
            assert_eq!(StoreKind::of_url(url).unwrap(), kind, "{url}");
            assert_eq!(parse(url).kind(), kind, "{url}");
        }
        for bad in [
            "idem.db",
            "sqlite://",
            "memory://x",
            "memory://?idem_max_records=0",
            "memory://?idem_max_records=lots",
            "memory://?idem_nope=1",
            "memory://?x=1",
            "postgres://",
            "redis+cluster://",
            "foo://x",
            "ftp://x",
        ] {
            let e = StoreKind::of_url(bad).unwrap_err();
            assert!(matches!(e, StoreError::Config(_)), "{bad}: {e}");
        }
        let e = StoreKind::of_url("mongodb://h/db").unwrap_err().to_string();
        for form in [
            "memory://",
            "sqlite://",
            "postgres://",
            "mysql://",
            "redis://",
            "redis+cluster://",
        ] {
            assert!(e.contains(form), "{form} not in {e}");
        }
    }

    #[test]
    fn built_in_kinds() {
        assert_eq!(StoreKind::of_url("memory://").unwrap(), StoreKind::Memory);
        assert_eq!(memory_max_records("memory://"), Some(1_000_000));
        assert_eq!(
            memory_max_records("memory://?idem_max_records=50"),
            Some(50)
        );
        assert_eq!(memory_max_records("sqlite://x.db"), None);
        assert_eq!(
            StoreKind::of_url(" SQLITE://idem.db ").unwrap(),
            StoreKind::Sqlite
        );
        match StoreKind::of_url("sqlite:///") {
            Err(StoreError::Config(m)) => assert_eq!(
                m,
                "store URL \"sqlite:///\" names no file; \
                 use sqlite://relative.db or sqlite:///absolute/path.db"
            ),
            other => panic!("{other:?}"),
        }
    }

    #[cfg(not(all(feature = "postgres", feature = "mysql", feature = "redis")))]
    #[test]
    fn left_out_backends_are_config_errors_naming_the_feature() {
        for (url, feature) in [
            ("postgres://u:s3cret@h/db", "postgres"),
            ("mariadb://h/db", "mysql"),
            ("redis+cluster://h:1", "redis"),
        ] {
            if cfg!(feature = "postgres") && feature == "postgres"
                || cfg!(feature = "mysql") && feature == "mysql"
                || cfg!(feature = "redis") && feature == "redis"
            {
                continue;
            }
            match StoreKind::of_url(url) {
                Err(StoreError::Config(m)) => {
                    assert!(m.contains(&format!("Cargo feature `{feature}`")), "{m}");
                    assert!(!m.contains("s3cret"), "{m}");
                }
                other => panic!("{url}: {other:?}"),
            }
        }
    }

    #[cfg(all(feature = "postgres", feature = "mysql", feature = "redis"))]
    #[test]
    fn bad_parameters_are_config_errors() {
        for bad in [
            "postgres://h/db?idem_prefix=x",
            "postgres://h/db?idem_tabel=x",
            "postgres://h/db?idem_table=1abc",
            "postgres://h/db?idem_table=a-b",
            "postgres://h/db?idem_table=",
            "postgres://h/db?idem_table=a&idem_table=b",
            "postgres://h/db?idem_migrate=maybe",
            "mysql://h/db?idem_schema=s",
            "redis://h?idem_table=t",
            "redis://h?idem_prefix=a%7Bb",
            "redis://h?idem_prefix=%ZZ",
            "sqlite://x.db?idem_table=t",
        ] {
            match StoreUrl::parse(bad) {
                Err(StoreError::Config(_)) => {}
                other => panic!("{bad}: {other:?}"),
            }
        }
    }

    #[cfg(all(feature = "postgres", feature = "mysql", feature = "redis"))]
    #[test]
    fn passwords_are_redacted() {
        // The rule itself is tested in idem-core's `url` module.
        assert_eq!(
            redact("postgres://idem:s3cret@db:5432/app?x=1"),
            "postgres://idem:***@db:5432/app?x=1"
        );
        let e = StoreUrl::parse("postgres://u:s3cret@h/db?idem_nope=1")
            .unwrap_err()
            .to_string();
        assert!(!e.contains("s3cret"), "{e}");
        assert!(!format!("{:?}", parse("postgres://u:s3cret@h/db")).contains("s3cret"));
        for url in ["mysql://u:s3cret@h/db", "redis://:s3cret@h/"] {
            assert!(!format!("{:?}", parse(url)).contains("s3cret"), "{url}");
        }
    }
}
