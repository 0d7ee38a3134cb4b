//! Reading SQL store URLs: the scheme, the `idem_*` parameters each store
//! takes, and the URL left for sqlx (see [`idem_core::url`] for the rules
//! every store shares).

use idem_core::url::StoreUrl;
#[cfg(any(feature = "postgres", feature = "mysql"))]
use idem_core::url::{Param, UrlOptions};
use idem_core::{RedactedUrl, StoreError};

/// A checked `sqlite://` store URL: `sqlite://relative/path.db` or
/// `sqlite:///absolute/path.db`, with sqlx's query parameters (e.g.
/// `mode=rwc`). SQLite store URLs take no `idem_*` parameters.
///
/// ```
/// use idem_sql::url::SqliteUrl;
/// let url = SqliteUrl::parse("SQLITE://data/idem.db?mode=rwc")?;
/// assert_eq!(url.url.expose(), "sqlite://data/idem.db?mode=rwc");
/// assert!(SqliteUrl::parse("sqlite:///").is_err());
/// # Ok::<(), idem_core::StoreError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct SqliteUrl {
    /// The URL for [`SqliteStore::open_with`](crate::SqliteStore::open_with)
    /// (scheme in lower case).
    pub url: RedactedUrl,
}

impl SqliteUrl {
    /// Reads a `sqlite://` store URL without opening the file.
    ///
    /// # Errors
    /// [`StoreError::Config`] for another scheme, a URL that names no file
    /// (`sqlite://`, `sqlite:///`) or any `idem_*` parameter.
    pub fn parse(url: &str) -> Result<Self, StoreError> {
        let u = StoreUrl::parse(url)?;
        if u.scheme() != "sqlite" {
            return Err(u.error("not a SQLite URL; use sqlite://"));
        }
        u.require_base(
            &["/"],
            "file",
            "use sqlite://relative.db or sqlite:///absolute/path.db",
        )?;
        let options = u.options("sqlite", &[])?;
        Ok(Self {
            url: options.driver_url().clone(),
        })
    }
}

/// The `idem_*` parameters of a PostgreSQL store URL.
#[cfg(feature = "postgres")]
const POSTGRES_PARAMS: &[Param] = &[
    Param::Text("idem_table"),
    Param::Text("idem_schema"),
    Param::Flag("idem_migrate"),
];

/// The `idem_*` parameters of a MySQL store URL.
#[cfg(feature = "mysql")]
const MYSQL_PARAMS: &[Param] = &[Param::Text("idem_table"), Param::Flag("idem_migrate")];

#[cfg(feature = "postgres")]
impl crate::PostgresOptions {
    /// Defaults for the database a store URL names, with its `idem_*`
    /// parameters applied: `idem_table` ([`Self::table`]), `idem_schema`
    /// ([`Self::schema`]), `idem_migrate` ([`Self::migrate`], `true`/`false`,
    /// also `1`/`0`, `yes`/`no`, `on`/`off`). The other query parameters
    /// (e.g. `sslmode`) stay in [`Self::url`] for sqlx.
    ///
    /// ```
    /// use idem_sql::PostgresOptions;
    /// let o = PostgresOptions::from_url(
    ///     "postgresql://idem@db/app?sslmode=require&idem_schema=idem&idem_migrate=false",
    /// )?;
    /// assert_eq!((o.url.as_str(), o.schema.as_str()), ("postgresql://idem@db/app?sslmode=require", "idem"));
    /// assert!(!o.migrate);
    /// # Ok::<(), idem_core::StoreError>(())
    /// ```
    ///
    /// TLS: sqlx's `sslmode` (`disable`, `allow`, `prefer` (its default),
    /// `require`, `verify-ca`, `verify-full`), `sslrootcert`, `sslcert` and
    /// `sslkey` pass through unchanged; the files they name are checked to
    /// be readable here.
    ///
    /// # Errors
    /// [`StoreError::Config`] for a scheme other than `postgres://` or
    /// `postgresql://`, a URL that names no server, an unknown, empty,
    /// repeated or malformed `idem_*` parameter, a table or schema name
    /// that is not a plain identifier, or a file named by `sslrootcert`,
    /// `sslcert` or `sslkey` (also spelt `ssl-root-cert`, `ssl-ca`,
    /// `ssl-cert`, `ssl-key`) that cannot be opened.
    pub fn from_url(url: &str) -> Result<Self, StoreError> {
        let postgres = ServerUrl {
            schemes: &["postgres", "postgresql"],
            driver_scheme: None,
            kind: "postgres",
            params: POSTGRES_PARAMS,
            files: &[
                "sslrootcert",
                "ssl-root-cert",
                "ssl-ca",
                "sslcert",
                "ssl-cert",
                "sslkey",
                "ssl-key",
            ],
            other: "not a PostgreSQL URL; use postgres:// or postgresql://",
        };
        let params = postgres.read(url)?;
        let schema = params.text("idem_schema");
        check_name("idem_schema", schema, crate::common::MAX_SCHEMA_LEN)?;
        let mut o = Self::new(params.driver_url().expose());
        o.table = params.text("idem_table").map_or(o.table, str::to_owned);
        o.schema = schema.map_or(o.schema, str::to_owned);
        o.migrate = params.flag("idem_migrate").unwrap_or(o.migrate);
        Ok(o)
    }
}

#[cfg(feature = "mysql")]
impl crate::MySqlOptions {
    /// Defaults for the database a store URL names, with its `idem_*`
    /// parameters applied: `idem_table` ([`Self::table`]) and
    /// `idem_migrate` ([`Self::migrate`]). `mariadb://` is read as
    /// `mysql://`; the other query parameters stay in [`Self::url`] for sqlx.
    ///
    /// ```
    /// use idem_sql::MySqlOptions;
    /// let o = MySqlOptions::from_url("mariadb://root@db:3306/app?idem_table=keys")?;
    /// assert_eq!((o.url.as_str(), o.table.as_str()), ("mysql://root@db:3306/app", "keys"));
    /// # Ok::<(), idem_core::StoreError>(())
    /// ```
    ///
    /// TLS: sqlx's `ssl-mode` (`DISABLED`, `PREFERRED` (its default),
    /// `REQUIRED`, `VERIFY_CA`, `VERIFY_IDENTITY`), `ssl-ca`, `ssl-cert` and
    /// `ssl-key` pass through unchanged; the files they name are checked to
    /// be readable here.
    ///
    /// # Errors
    /// [`StoreError::Config`] for a scheme other than `mysql://` or
    /// `mariadb://`, a URL that names no server, an unknown, empty,
    /// repeated or malformed `idem_*` parameter, a table name that is not
    /// a plain identifier, or a file named by `ssl-ca`, `ssl-cert` or
    /// `ssl-key` (also spelt `sslca`, `sslcert`, `sslkey`) that cannot be
    /// opened.
    pub fn from_url(url: &str) -> Result<Self, StoreError> {
        let mysql = ServerUrl {
            schemes: &["mysql", "mariadb"],
            driver_scheme: Some("mysql"),
            kind: "mysql",
            params: MYSQL_PARAMS,
            files: &[
                "sslca", "ssl-ca", "sslcert", "ssl-cert", "sslkey", "ssl-key",
            ],
            other: "not a MySQL URL; use mysql:// or mariadb://",
        };
        let params = mysql.read(url)?;
        let mut o = Self::new(params.driver_url().expose());
        o.table = params.text("idem_table").map_or(o.table, str::to_owned);
        o.migrate = params.flag("idem_migrate").unwrap_or(o.migrate);
        Ok(o)
    }
}

/// How a SQL server's store URL is read.
#[cfg(any(feature = "postgres", feature = "mysql"))]
struct ServerUrl {
    /// The schemes it accepts (lower case).
    schemes: &'static [&'static str],
    /// The scheme the driver URL gets, when not the one given.
    driver_scheme: Option<&'static str>,
    /// The store's name in messages.
    kind: &'static str,
    /// Its `idem_*` parameters; `idem_table` among them.
    params: &'static [Param],
    /// The driver's parameters that name a file (the TLS CA, client
    /// certificate and key), checked to be readable.
    files: &'static [&'static str],
    /// The message for a URL of another scheme.
    other: &'static str,
}

#[cfg(any(feature = "postgres", feature = "mysql"))]
impl ServerUrl {
    /// Checks the scheme, that a server is named, the parameters and the
    /// table name.
    fn read(&self, url: &str) -> Result<UrlOptions, StoreError> {
        let mut u = StoreUrl::parse(url)?;
        if !self.schemes.contains(&u.scheme()) {
            return Err(u.error(self.other));
        }
        u.require_base(&[], "server", "name a host")?;
        if let Some(scheme) = self.driver_scheme {
            u = u.with_scheme(scheme);
        }
        let params = u.options(self.kind, self.params)?;
        let table = params.text("idem_table");
        check_name("idem_table", table, crate::common::MAX_TABLE_LEN)?;
        self.check_files(&u, params.driver_url().expose())?;
        Ok(params)
    }

    /// Opens each file a TLS parameter of the driver URL names (decoded as
    /// sqlx decodes it), so a wrong path is a configuration error at start
    /// rather than an "unavailable" store with a bare "No such file or
    /// directory". Values that are PEM text themselves are left to sqlx.
    fn check_files(&self, u: &StoreUrl, driver_url: &str) -> Result<(), StoreError> {
        let Ok(parsed) = url::Url::parse(driver_url) else {
            return Ok(()); // sqlx reports a URL it cannot read
        };
        for (name, value) in parsed.query_pairs() {
            if !self.files.contains(&name.as_ref()) || value.starts_with("-----BEGIN") {
                continue;
            }
            if let Err(e) = std::fs::File::open(value.as_ref()) {
                return Err(u.error(format_args!("{name} {value:?}: {e}")));
            }
        }
        Ok(())
    }
}

/// Checks a name given in a store URL early, so a typo is a configuration
/// error before anything connects, in the words the URL's reader uses.
#[cfg(any(feature = "postgres", feature = "mysql"))]
fn check_name(param: &str, name: Option<&str>, max: usize) -> Result<(), StoreError> {
    match name {
        Some(name) => crate::common::validate_ident(param, name, max).map_err(|_| {
            StoreError::Config(format!(
                "store URL: {param} {name:?} is not a plain identifier (1 to {max} characters \
                 of A-Z, a-z, 0-9 and _, not starting with a digit)"
            ))
        }),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config_error(r: Result<impl std::fmt::Debug, StoreError>) -> String {
        match r {
            Err(StoreError::Config(m)) => m,
            other => panic!("not a config error: {other:?}"),
        }
    }

    #[test]
    fn sqlite_urls() {
        let u = SqliteUrl::parse("sqlite://idem.db?mode=rwc").unwrap();
        assert_eq!(u.url.expose(), "sqlite://idem.db?mode=rwc");
        assert_eq!(
            SqliteUrl::parse("sqlite:///tmp/x.db").unwrap().url.expose(),
            "sqlite:///tmp/x.db"
        );
        for bad in [
            "sqlite://",
            "sqlite:///",
            "sqlite://x.db?idem_table=t",
            "idem.db",
            "memory://",
        ] {
            config_error(SqliteUrl::parse(bad));
        }
        assert_eq!(
            config_error(SqliteUrl::parse("sqlite:///")),
            "store URL \"sqlite:///\" names no file; use sqlite://relative.db or sqlite:///absolute/path.db"
        );
        assert!(config_error(SqliteUrl::parse("sqlite://x.db?idem_table=t"))
            .ends_with("sqlite store URLs take no idem_* parameters"));
    }

    #[cfg(feature = "postgres")]
    #[test]
    fn postgres_urls() {
        use crate::PostgresOptions;
        let o = PostgresOptions::from_url("postgres://u:pw@h:5432/test?sslmode=disable&idem_table=t_1&idem_schema=s&idem_migrate=false").unwrap();
        assert_eq!(o.url, "postgres://u:pw@h:5432/test?sslmode=disable");
        assert_eq!(o.table, "t_1");
        assert_eq!(o.schema, "s");
        assert!(!o.migrate);
        let o = PostgresOptions::from_url("POSTGRES://h/db").unwrap();
        assert_eq!(
            (o.url.as_str(), o.table.as_str(), o.schema.as_str()),
            ("postgres://h/db", "idem_records", "public")
        );
        assert!(o.migrate);
        for bad in [
            "postgres://",
            "mysql://h/db",
            "postgres://h/db?idem_prefix=x",
            "postgres://h/db?idem_tabel=x",
            "postgres://h/db?idem_table=1abc",
            "postgres://h/db?idem_table=a-b",
            "postgres://h/db?idem_table=",
            "postgres://h/db?idem_table=a&idem_table=b",
            "postgres://h/db?idem_migrate=maybe",
            "postgres://h/db?idem_schema=s.t",
        ] {
            config_error(PostgresOptions::from_url(bad));
        }
        assert_eq!(
            config_error(PostgresOptions::from_url("postgres://h/db?idem_table=a-b")),
            "store URL: idem_table \"a-b\" is not a plain identifier (1 to 54 characters \
             of A-Z, a-z, 0-9 and _, not starting with a digit)"
        );
        assert_eq!(
            config_error(PostgresOptions::from_url(
                "postgres://u:s3cret@h/db?idem_nope=1"
            )),
            "store URL \"postgres://u:***@h/db?idem_nope=1\": unknown parameter \"idem_nope\"; \
             postgres store URLs take idem_table, idem_schema, idem_migrate"
        );
        assert_eq!(
            config_error(PostgresOptions::from_url("postgresql://")),
            "store URL \"postgresql://\" names no server; name a host"
        );
    }

    #[cfg(feature = "mysql")]
    #[test]
    fn mysql_urls() {
        use crate::MySqlOptions;
        let o =
            MySqlOptions::from_url("mariadb://root@h:3306/test?idem_table=orders_keys").unwrap();
        assert_eq!(o.url, "mysql://root@h:3306/test");
        assert_eq!(o.table, "orders_keys");
        let o = MySqlOptions::from_url("mysql://root@h/test?ssl-mode=disabled&idem_migrate=off")
            .unwrap();
        assert_eq!(o.url, "mysql://root@h/test?ssl-mode=disabled");
        assert!(!o.migrate);
        for bad in [
            "mysql://",
            "postgres://h/db",
            "mysql://h/db?idem_schema=s",
            "mysql://h/db?idem_table=1abc",
            "mysql://h/db?idem_migrate=2",
        ] {
            config_error(MySqlOptions::from_url(bad));
        }
        assert!(
            config_error(MySqlOptions::from_url("mysql://h/db?idem_schema=s"))
                .ends_with("mysql store URLs take idem_table, idem_migrate")
        );
    }

    #[cfg(all(feature = "postgres", feature = "mysql"))]
    #[test]
    fn tls_files_must_be_readable() {
        use crate::{MySqlOptions, PostgresOptions};
        let dir = tempfile::tempdir().unwrap();
        let ca = dir.path().join("ca.pem");
        std::fs::write(&ca, "-----BEGIN CERTIFICATE-----\n").unwrap();
        let ca = ca.display();
        let ok = format!("postgres://h/db?sslmode=verify-full&sslrootcert={ca}&idem_schema=s");
        assert_eq!(
            PostgresOptions::from_url(&ok).unwrap().url,
            format!("postgres://h/db?sslmode=verify-full&sslrootcert={ca}")
        );
        MySqlOptions::from_url(&format!(
            "mysql://h/db?ssl-mode=VERIFY_IDENTITY&ssl-ca={ca}"
        ))
        .unwrap();
        assert_eq!(
            config_error(PostgresOptions::from_url(
                "postgres://u:s3cret@h/db?sslmode=verify-full&sslrootcert=/nonexistent/ca.pem"
            )),
            "store URL \"postgres://u:***@h/db?sslmode=verify-full&sslrootcert=/nonexistent/ca.pem\": \
             sslrootcert \"/nonexistent/ca.pem\": No such file or directory (os error 2)"
        );
        for bad in [
            "postgres://h/db?sslcert=/nonexistent/c.crt",
            "postgres://h/db?sslkey=%2Fnonexistent%2Fc.key",
        ] {
            assert!(
                config_error(PostgresOptions::from_url(bad)).contains("/nonexistent/"),
                "{bad}"
            );
        }
        for bad in [
            "mariadb://h/db?ssl-ca=/nonexistent/ca.pem",
            "mysql://h/db?sslca=/nonexistent/ca.pem",
            "mysql://h/db?ssl-key=/nonexistent/k.pem",
        ] {
            assert!(
                config_error(MySqlOptions::from_url(bad)).contains("/nonexistent/"),
                "{bad}"
            );
        }
    }
}
