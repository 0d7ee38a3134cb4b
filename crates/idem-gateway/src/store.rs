//! Opening a store from its URL.

use std::sync::Arc;
use std::time::Duration;

use idem_core::{DynStore, MemoryStore, StoreError};

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
    /// Reads the scheme of a store URL and checks the URL's gateway options.
    pub(crate) fn of_url(url: &str) -> Result<Self, StoreError> {
        StoreUrl::parse(url).map(|u| u.kind)
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

    /// The `idem_*` query parameters this kind of store takes.
    fn options(self) -> &'static [&'static str] {
        match self {
            Self::Memory | Self::Sqlite => &[],
            Self::Postgres => &["idem_table", "idem_schema", "idem_migrate"],
            Self::MySql => &["idem_table", "idem_migrate"],
            Self::Redis | Self::RedisCluster => &["idem_prefix"],
        }
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
    /// time limit, Redis's response and connection timeouts, SQLite's busy
    /// timeout. A call cut off by it fails with [`StoreError::Timeout`]; its
    /// effect is unknown.
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

/// A store URL taken apart: the kind, the URL the driver gets (the
/// gateway's `idem_*` query parameters removed, `mariadb://` rewritten to
/// `mysql://`), and the gateway's options.
#[derive(Clone)]
pub(crate) struct StoreUrl {
    pub(crate) kind: StoreKind,
    driver_url: String,
    table: Option<String>,
    schema: Option<String>,
    prefix: Option<String>,
    migrate: Option<bool>,
}

impl std::fmt::Debug for StoreUrl {
    // The driver URL may hold a password.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreUrl")
            .field("kind", &self.kind)
            .field("driver_url", &redact(&self.driver_url))
            .field("table", &self.table)
            .field("schema", &self.schema)
            .field("prefix", &self.prefix)
            .field("migrate", &self.migrate)
            .finish()
    }
}

impl StoreUrl {
    /// Parses and checks a store URL without connecting.
    pub(crate) fn parse(url: &str) -> Result<Self, StoreError> {
        let url = url.trim();
        let shown = redact(url);
        let Some((scheme, rest)) = url.split_once("://") else {
            return Err(StoreError::Config(format!(
                "store URL {shown:?} has no scheme; supported: {SUPPORTED}"
            )));
        };
        let scheme = scheme.to_ascii_lowercase();
        let kind = match scheme.as_str() {
            "memory" if rest.is_empty() => StoreKind::Memory,
            "memory" => {
                return Err(StoreError::Config(format!(
                    "store URL {shown:?}: memory:// takes nothing after the scheme"
                )))
            }
            "sqlite" => StoreKind::Sqlite,
            "postgres" | "postgresql" => StoreKind::Postgres,
            "mysql" | "mariadb" => StoreKind::MySql,
            "redis" | "rediss" | "redis+unix" => StoreKind::Redis,
            "redis+cluster" | "rediss+cluster" => StoreKind::RedisCluster,
            s => {
                return Err(StoreError::Config(format!(
                    "store URL {shown:?}: unknown scheme {s:?}; supported: {SUPPORTED}"
                )))
            }
        };
        let (base, query) = rest.split_once('?').unwrap_or((rest, ""));
        if kind != StoreKind::Memory
            && (base.is_empty() || (kind == StoreKind::Sqlite && base == "/"))
        {
            let hint = match kind {
                StoreKind::Sqlite => "use sqlite://relative.db or sqlite:///absolute/path.db",
                StoreKind::RedisCluster => "name its nodes: redis+cluster://host:port,host:port",
                _ => "name a host",
            };
            return Err(StoreError::Config(format!(
                "store URL {shown:?} names no {}; {hint}",
                if kind == StoreKind::Sqlite {
                    "file"
                } else {
                    "server"
                }
            )));
        }
        let mut parsed = Self {
            kind,
            driver_url: String::new(),
            table: None,
            schema: None,
            prefix: None,
            migrate: None,
        };
        let mut kept: Vec<&str> = Vec::new();
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
            if !name.to_ascii_lowercase().starts_with("idem_") {
                kept.push(pair);
                continue;
            }
            let allowed = kind.options();
            if !allowed.contains(&name) {
                let takes = if allowed.is_empty() {
                    format!("{} store URLs take no idem_* parameters", kind.name())
                } else {
                    format!("{} store URLs take {}", kind.name(), allowed.join(", "))
                };
                return Err(StoreError::Config(format!(
                    "store URL {shown:?}: unknown parameter {name:?}; {takes}"
                )));
            }
            let value = percent_decode(value).ok_or_else(|| {
                StoreError::Config(format!(
                    "store URL {shown:?}: {name} is not valid percent-encoded UTF-8"
                ))
            })?;
            if value.is_empty() {
                return Err(StoreError::Config(format!(
                    "store URL {shown:?}: {name} is empty"
                )));
            }
            let slot = match name {
                "idem_table" => &mut parsed.table,
                "idem_schema" => &mut parsed.schema,
                "idem_prefix" => &mut parsed.prefix,
                _ => {
                    let b = match value.to_ascii_lowercase().as_str() {
                        "true" | "1" | "yes" | "on" => true,
                        "false" | "0" | "no" | "off" => false,
                        _ => {
                            return Err(StoreError::Config(format!(
                                "store URL {shown:?}: {name} takes true or false, not {value:?}"
                            )))
                        }
                    };
                    if parsed.migrate.replace(b).is_some() {
                        return Err(StoreError::Config(format!(
                            "store URL {shown:?}: {name} is given twice"
                        )));
                    }
                    continue;
                }
            };
            if slot.replace(value).is_some() {
                return Err(StoreError::Config(format!(
                    "store URL {shown:?}: {name} is given twice"
                )));
            }
        }
        let scheme_out = if scheme == "mariadb" {
            "mysql"
        } else {
            scheme.as_str()
        };
        parsed.driver_url = if kept.is_empty() {
            format!("{scheme_out}://{base}")
        } else {
            format!("{scheme_out}://{base}?{}", kept.join("&"))
        };
        parsed.check_names()?;
        Ok(parsed)
    }

    /// Checks the names early, so a typo is a configuration error (exit
    /// code 2) rather than a failure to start.
    fn check_names(&self) -> Result<(), StoreError> {
        let ident = |what: &str, v: &Option<String>, max: usize| match v {
            Some(s)
                if s.len() > max
                    || !s.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_')
                    || !s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') =>
            {
                Err(StoreError::Config(format!(
                    "store URL: {what} {s:?} is not a plain identifier (1 to {max} characters \
                     of A-Z, a-z, 0-9 and _, not starting with a digit)"
                )))
            }
            _ => Ok(()),
        };
        ident("idem_table", &self.table, 54)?;
        ident("idem_schema", &self.schema, 63)?;
        if let Some(p) = &self.prefix {
            idem_redis::RedisOptions::default()
                .with_key_prefix(p.clone())
                .validate()
                .map_err(|e| match e {
                    StoreError::Config(m) => {
                        StoreError::Config(format!("store URL: idem_prefix: {m}"))
                    }
                    e => e,
                })?;
        }
        Ok(())
    }
}

/// Decodes `%XX` escapes (`+` stays a `+`).
fn percent_decode(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'%' => {
                let hex = s.get(i + 1..i + 3)?;
                out.push(u8::from_str_radix(hex, 16).ok()?);
                i += 3;
            }
            c => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8(out).ok()
}

/// A store URL fit for logs and messages: a password in the user info is
/// replaced by `***` (`postgres://idem:***@db/app`).
pub(crate) fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(end);
    match authority.rfind('@') {
        Some(at) => {
            let (userinfo, hosts) = authority.split_at(at);
            match userinfo.split_once(':') {
                Some((user, _)) => format!("{scheme}://{user}:***{hosts}{tail}"),
                None => url.to_owned(),
            }
        }
        None => url.to_owned(),
    }
}

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
/// driver's (e.g. PostgreSQL's `sslmode`):
///
/// | parameter | stores | meaning | default |
/// |---|---|---|---|
/// | `idem_table` | PostgreSQL, MySQL | the records table (a plain identifier, ≤ 54 bytes) | `idem_records` |
/// | `idem_schema` | PostgreSQL | the schema of the table, created when missing | `public` |
/// | `idem_migrate` | PostgreSQL, MySQL | create missing tables at startup (`false` when the role may not run DDL) | `true` |
/// | `idem_prefix` | Redis | the first part of every Redis key and channel (≤ 64 bytes) | `idem` |
///
/// `rediss://` needs this crate's `redis-tls` feature (on by default).
/// The connection is opened (and the schema created) before this returns.
///
/// # Errors
/// [`StoreError::Config`] for an unsupported or malformed URL (the message
/// lists the supported forms) or a bad option; the store's own errors when
/// it cannot be reached within `options.timeout`
/// ([`StoreError::Unavailable`] or [`StoreError::Timeout`], phase
/// `Connect`) or its file or tables cannot be created.
pub async fn open_store_with(url: &str, options: &StoreOptions) -> Result<DynStore, StoreError> {
    let u = StoreUrl::parse(url)?;
    let t = options.timeout;
    let pool = options.pool_size.max(1);
    let store: DynStore = match u.kind {
        StoreKind::Memory => Arc::new(MemoryStore::new()),
        StoreKind::Sqlite => {
            let o = idem_sql::SqliteOptions::default()
                .with_busy_timeout(t)
                .with_acquire_timeout(t);
            Arc::new(idem_sql::SqliteStore::open_with(&u.driver_url, o).await?)
        }
        StoreKind::Postgres => {
            let mut o = idem_sql::PostgresOptions::new(u.driver_url.clone())
                .with_max_connections(pool)
                .with_acquire_timeout(t)
                .with_connect_timeout(t)
                .with_statement_timeout(Some(t));
            if let Some(table) = &u.table {
                o = o.with_table(table.clone());
            }
            if let Some(schema) = &u.schema {
                o = o.with_schema(schema.clone());
            }
            if let Some(m) = u.migrate {
                o = o.with_migrate(m);
            }
            Arc::new(idem_sql::PostgresStore::connect_with(o).await?)
        }
        StoreKind::MySql => {
            let mut o = idem_sql::MySqlOptions::new(u.driver_url.clone())
                .with_max_connections(pool)
                .with_acquire_timeout(t)
                .with_connect_timeout(t)
                .with_lock_wait_timeout(t)
                .with_statement_timeout(Some(t));
            if let Some(table) = &u.table {
                o = o.with_table(table.clone());
            }
            if let Some(m) = u.migrate {
                o = o.with_migrate(m);
            }
            Arc::new(idem_sql::MySqlStore::connect_with(o).await?)
        }
        StoreKind::Redis | StoreKind::RedisCluster => {
            let mut o = idem_redis::RedisOptions::default()
                .with_response_timeout(t)
                .with_connection_timeout(t);
            if let Some(p) = &u.prefix {
                o = o.with_key_prefix(p.clone());
            }
            Arc::new(idem_redis::RedisStore::connect_with(&u.driver_url, o).await?)
        }
    };
    Ok(store)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(url: &str) -> StoreUrl {
        StoreUrl::parse(url).unwrap_or_else(|e| panic!("{url}: {e}"))
    }

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
        }
        for bad in [
            "idem.db",
            "sqlite://",
            "memory://x",
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
    fn gateway_parameters_are_taken_out_of_the_driver_url() {
        let u = parse("postgres://u:pw@h:5432/test?sslmode=disable&idem_table=t_1&idem_schema=s&idem_migrate=false");
        assert_eq!(u.driver_url, "postgres://u:pw@h:5432/test?sslmode=disable");
        assert_eq!(u.table.as_deref(), Some("t_1"));
        assert_eq!(u.schema.as_deref(), Some("s"));
        assert_eq!(u.migrate, Some(false));

        let u = parse("mariadb://root@h:3306/test?idem_table=orders_keys");
        assert_eq!(u.driver_url, "mysql://root@h:3306/test");
        assert_eq!(u.table.as_deref(), Some("orders_keys"));

        let u = parse("redis://h:6379/2?idem_prefix=pay%3Av2");
        assert_eq!(u.driver_url, "redis://h:6379/2");
        assert_eq!(u.prefix.as_deref(), Some("pay:v2"));

        let u = parse("redis+cluster://h:7000,h:7001/?protocol=resp3&idem_prefix=x");
        assert_eq!(
            u.driver_url,
            "redis+cluster://h:7000,h:7001/?protocol=resp3"
        );
        assert_eq!(u.prefix.as_deref(), Some("x"));

        let u = parse("sqlite://idem.db?mode=rwc");
        assert_eq!(u.driver_url, "sqlite://idem.db?mode=rwc");
    }

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

    #[test]
    fn passwords_are_redacted() {
        assert_eq!(
            redact("postgres://idem:s3cret@db:5432/app?x=1"),
            "postgres://idem:***@db:5432/app?x=1"
        );
        assert_eq!(redact("redis://:pw@h:6379/"), "redis://:***@h:6379/");
        assert_eq!(
            redact("redis+cluster://u:pw@a:1,b:2"),
            "redis+cluster://u:***@a:1,b:2"
        );
        assert_eq!(redact("mysql://root@h/test"), "mysql://root@h/test");
        assert_eq!(redact("memory://"), "memory://");
        let e = StoreUrl::parse("postgres://u:s3cret@h/db?idem_nope=1")
            .unwrap_err()
            .to_string();
        assert!(!e.contains("s3cret"), "{e}");
        assert!(!format!("{:?}", parse("postgres://u:s3cret@h/db")).contains("s3cret"));
    }
}
