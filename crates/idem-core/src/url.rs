//! Store URLs: [`RedactedUrl`], a URL that hides its password when shown,
//! and [`StoreUrl`], the pieces every store uses to read its URL and its
//! `idem_*` query parameters (written once here, so every backend refuses a
//! bad URL with the same words).
//!
//! A store URL is `scheme://base?query`. Query parameters whose name starts
//! with `idem_` (any case) are idem's options; all others belong to the
//! driver and are passed on untouched, in their order.
//!
//! ```
//! use idem_core::url::{Param, StoreUrl};
//! let url = StoreUrl::parse("postgres://u:pw@h/db?sslmode=disable&idem_table=t&idem_migrate=off")?;
//! let opts = url.options("postgres", &[Param::Text("idem_table"), Param::Flag("idem_migrate")])?;
//! assert_eq!(opts.text("idem_table"), Some("t"));
//! assert_eq!(opts.flag("idem_migrate"), Some(false));
//! assert_eq!(opts.driver_url().expose(), "postgres://u:pw@h/db?sslmode=disable");
//! assert_eq!(opts.driver_url().to_string(), "postgres://u:***@h/db?sslmode=disable");
//! # Ok::<(), idem_core::StoreError>(())
//! ```

use std::convert::Infallible;
use std::fmt;
use std::str::FromStr;

use crate::StoreError;

/// A URL whose [`Debug`](fmt::Debug) and [`Display`](fmt::Display) replace
/// a password in the user info by `***` (`postgres://idem:***@db/app`), so
/// a struct holding one can derive `Debug` and be logged. The full URL, for
/// the driver, is [`Self::expose`].
///
/// Only the password is hidden: the user, the hosts, the path and the query
/// are shown as given (see [`redact`] for the exact rule). Equality compares
/// the full URLs.
///
/// ```
/// use idem_core::RedactedUrl;
/// let url: RedactedUrl = "redis://:s3cret@cache:6379/0".parse().unwrap();
/// assert_eq!(url.to_string(), "redis://:***@cache:6379/0");
/// assert_eq!(format!("{url:?}"), "\"redis://:***@cache:6379/0\"");
/// assert_eq!(url.expose(), "redis://:s3cret@cache:6379/0");
/// ```
#[derive(Clone, PartialEq, Eq, Hash, Default)]
pub struct RedactedUrl(String);

impl RedactedUrl {
    /// Wraps `url` as given (nothing is checked or trimmed).
    pub fn new(url: impl Into<String>) -> Self {
        Self(url.into())
    }

    /// The full URL, password included: for the driver, never for logs.
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// The full URL, password included, as an owned string.
    pub fn into_inner(self) -> String {
        self.0
    }

    /// The URL as shown: the password replaced by `***`.
    pub fn redacted(&self) -> String {
        redact(&self.0)
    }
}

impl fmt::Display for RedactedUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&redact(&self.0))
    }
}

impl fmt::Debug for RedactedUrl {
    /// Shown as the redacted string, quoted, exactly as `{:?}` of a
    /// `String` holding it.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&redact(&self.0), f)
    }
}

impl FromStr for RedactedUrl {
    type Err = Infallible;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(Self::new(s))
    }
}

impl From<String> for RedactedUrl {
    fn from(url: String) -> Self {
        Self(url)
    }
}

impl From<&str> for RedactedUrl {
    fn from(url: &str) -> Self {
        Self(url.to_owned())
    }
}

/// A URL fit for logs and messages: a password in the user info is
/// replaced by `***` (`postgres://idem:***@db/app`).
///
/// The user info is what precedes the last `@` of the authority (the text
/// after `://` up to the first `/`, `?` or `#`); its password is what
/// follows its first `:`. A URL without `://`, without user info or without
/// a password is returned unchanged.
///
/// ```
/// use idem_core::url::redact;
/// assert_eq!(redact("redis+cluster://u:pw@a:1,b:2"), "redis+cluster://u:***@a:1,b:2");
/// assert_eq!(redact("mysql://root@h/test"), "mysql://root@h/test");
/// ```
pub fn redact(url: &str) -> String {
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

/// One `idem_*` query parameter a kind of store takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Param {
    /// A text value: percent-decoded, not empty.
    Text(&'static str),
    /// A boolean: `true`, `1`, `yes`, `on` or `false`, `0`, `no`, `off`
    /// (any case).
    Flag(&'static str),
}

impl Param {
    /// The parameter's name, e.g. `idem_table`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Text(n) | Self::Flag(n) => n,
        }
    }
}

/// A store URL taken apart (`scheme://base?query`), not yet checked
/// against what a store takes.
///
/// Every error it gives is [`StoreError::Config`] and starts with
/// `store URL "<the URL, password hidden>"`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreUrl {
    /// The scheme, lower case; what the driver URL starts with.
    scheme: String,
    /// Between `://` and `?`.
    base: String,
    /// After the first `?` (empty when there is none).
    query: String,
    /// The whole URL as given (trimmed), password hidden.
    shown: String,
}

impl StoreUrl {
    /// Splits `url` (surrounding white space ignored) into its scheme,
    /// base and query.
    ///
    /// # Errors
    /// [`StoreError::Config`] when `url` has no `://`.
    pub fn parse(url: &str) -> Result<Self, StoreError> {
        let url = url.trim();
        let shown = redact(url);
        let Some((scheme, rest)) = url.split_once("://") else {
            return Err(StoreError::Config(format!(
                "store URL {shown:?} has no scheme"
            )));
        };
        let (base, query) = rest.split_once('?').unwrap_or((rest, ""));
        Ok(Self {
            scheme: scheme.to_ascii_lowercase(),
            base: base.to_owned(),
            query: query.to_owned(),
            shown,
        })
    }

    /// The scheme in lower case (`postgres` for `POSTGRES://h/db`).
    pub fn scheme(&self) -> &str {
        &self.scheme
    }

    /// What lies between `://` and the query (user info, hosts, path).
    pub fn base(&self) -> &str {
        &self.base
    }

    /// The URL as given, password replaced by `***`.
    pub fn shown(&self) -> &str {
        &self.shown
    }

    /// The driver URL will start with `scheme` instead (e.g. `mysql` for a
    /// `mariadb://` URL); messages still show the URL as given.
    pub fn with_scheme(mut self, scheme: &str) -> Self {
        self.scheme = scheme.to_ascii_lowercase();
        self
    }

    /// A [`StoreError::Config`] about this URL:
    /// `store URL "<shown>": <detail>`.
    pub fn error(&self, detail: impl fmt::Display) -> StoreError {
        StoreError::Config(format!("store URL {:?}: {detail}", self.shown))
    }

    /// Checks that the base is neither empty nor one of `also_empty`.
    ///
    /// # Errors
    /// [`StoreError::Config`] `store URL "<shown>" names no <what>; <hint>`.
    pub fn require_base(
        &self,
        also_empty: &[&str],
        what: &str,
        hint: &str,
    ) -> Result<(), StoreError> {
        if self.base.is_empty() || also_empty.contains(&self.base.as_str()) {
            return Err(StoreError::Config(format!(
                "store URL {:?} names no {what}; {hint}",
                self.shown
            )));
        }
        Ok(())
    }

    /// Takes the `idem_*` parameters out of the query: each must be one of
    /// `params` (names compared exactly), given once, with a valid value.
    /// The other parameters stay in the [driver URL](UrlOptions::driver_url).
    /// `kind` names the store in messages (`postgres store URLs take …`).
    ///
    /// # Errors
    /// [`StoreError::Config`] for the first parameter, in query order, that
    /// is unknown (the message lists what `kind` takes), not valid
    /// percent-encoded UTF-8, empty, not a boolean where one is expected,
    /// or given twice; and when the query holds white space or a control
    /// character (percent-encode it: `%20`), or white space ends the base
    /// before `?`. The driver URL is thereby stable: read again, it gives
    /// itself back ([`StoreUrl::parse`] trims, and empty `&&` pairs are
    /// dropped).
    pub fn options(&self, kind: &str, params: &[Param]) -> Result<UrlOptions, StoreError> {
        if let Some(c) = self
            .query
            .chars()
            .find(|c| c.is_whitespace() || c.is_control())
        {
            return Err(self.error(format_args!(
                "the query holds {c:?}; percent-encode white space and control characters (a space is %20)"
            )));
        }
        if self.base.ends_with(char::is_whitespace) {
            return Err(self.error("white space before the `?` of the query"));
        }
        let mut values: Vec<(&'static str, Value)> = Vec::new();
        let mut kept: Vec<&str> = Vec::new();
        for pair in self.query.split('&').filter(|p| !p.is_empty()) {
            let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
            if !name.to_ascii_lowercase().starts_with("idem_") {
                kept.push(pair);
                continue;
            }
            let Some(param) = params.iter().copied().find(|p| p.name() == name) else {
                return Err(self.error(format_args!(
                    "unknown parameter {name:?}; {}",
                    takes(kind, params)
                )));
            };
            let value = percent_decode(value).ok_or_else(|| {
                self.error(format_args!("{name} is not valid percent-encoded UTF-8"))
            })?;
            if value.is_empty() {
                return Err(self.error(format_args!("{name} is empty")));
            }
            let value = match param {
                Param::Text(_) => Value::Text(value),
                Param::Flag(_) => Value::Flag(parse_flag(&value).ok_or_else(|| {
                    self.error(format_args!("{name} takes true or false, not {value:?}"))
                })?),
            };
            if values.iter().any(|(n, _)| *n == param.name()) {
                return Err(self.error(format_args!("{name} is given twice")));
            }
            values.push((param.name(), value));
        }
        let driver_url = if kept.is_empty() {
            format!("{}://{}", self.scheme, self.base)
        } else {
            format!("{}://{}?{}", self.scheme, self.base, kept.join("&"))
        };
        Ok(UrlOptions {
            driver_url: RedactedUrl(driver_url),
            values,
        })
    }
}

/// "`kind` store URLs take …", for a message about an unknown parameter.
fn takes(kind: &str, params: &[Param]) -> String {
    if params.is_empty() {
        format!("{kind} store URLs take no idem_* parameters")
    } else {
        let names: Vec<&str> = params.iter().map(|p| p.name()).collect();
        format!("{kind} store URLs take {}", names.join(", "))
    }
}

/// A boolean parameter value: `true`, `1`, `yes`, `on` / `false`, `0`,
/// `no`, `off`, any case.
fn parse_flag(value: &str) -> Option<bool> {
    match value.to_ascii_lowercase().as_str() {
        "true" | "1" | "yes" | "on" => Some(true),
        "false" | "0" | "no" | "off" => Some(false),
        _ => None,
    }
}

/// Decodes `%XX` escapes (`+` stays a `+`); `None` when an escape is not
/// two hex digits or the bytes are not UTF-8.
fn percent_decode(s: &str) -> Option<String> {
    // percent-encoding passes a malformed escape through; refuse it instead.
    let b = s.as_bytes();
    let well_formed = b
        .iter()
        .enumerate()
        .filter(|(_, c)| **c == b'%')
        .all(|(i, _)| {
            b.get(i + 1..i + 3)
                .is_some_and(|h| h.iter().all(u8::is_ascii_hexdigit))
        });
    if !well_formed {
        return None;
    }
    percent_encoding::percent_decode_str(s)
        .decode_utf8()
        .ok()
        .map(|c| c.into_owned())
}

/// A parameter's checked value.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Value {
    Text(String),
    Flag(bool),
}

/// The `idem_*` parameters of a store URL, checked, and the URL left for
/// the driver ([`StoreUrl::options`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UrlOptions {
    driver_url: RedactedUrl,
    values: Vec<(&'static str, Value)>,
}

impl UrlOptions {
    /// The URL for the driver: the scheme (lower case, or as set by
    /// [`StoreUrl::with_scheme`]), the base, and the query without the
    /// `idem_*` parameters.
    pub fn driver_url(&self) -> &RedactedUrl {
        &self.driver_url
    }

    /// The decoded value of text parameter `name`, if given.
    pub fn text(&self, name: &str) -> Option<&str> {
        self.values.iter().find_map(|(n, v)| match v {
            Value::Text(s) if *n == name => Some(s.as_str()),
            _ => None,
        })
    }

    /// The value of boolean parameter `name`, if given.
    pub fn flag(&self, name: &str) -> Option<bool> {
        self.values.iter().find_map(|(n, v)| match v {
            Value::Flag(b) if *n == name => Some(*b),
            _ => None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PG: &[Param] = &[
        Param::Text("idem_table"),
        Param::Text("idem_schema"),
        Param::Flag("idem_migrate"),
    ];

    fn options(url: &str, params: &[Param]) -> Result<UrlOptions, StoreError> {
        StoreUrl::parse(url)?.options("postgres", params)
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
        assert_eq!(redact("idem.db"), "idem.db");
        let e = options("postgres://u:s3cret@h/db?idem_nope=1", PG)
            .unwrap_err()
            .to_string();
        assert!(!e.contains("s3cret"), "{e}");
        let u = RedactedUrl::from("postgres://u:s3cret@h/db".to_owned());
        assert!(!format!("{u:?}").contains("s3cret"));
        assert!(!u.to_string().contains("s3cret"));
        assert_eq!(u.expose(), "postgres://u:s3cret@h/db");
        assert_eq!(u, "postgres://u:s3cret@h/db".parse().unwrap());
        assert_ne!(u, RedactedUrl::new("postgres://u:other@h/db"));
    }

    #[test]
    fn parameters_are_split_from_the_driver_url() {
        let o = options(
            "POSTGRES://u:pw@h:5432/test?sslmode=disable&idem_table=t_1&idem_schema=s&idem_migrate=false",
            PG,
        )
        .unwrap();
        assert_eq!(
            o.driver_url().expose(),
            "postgres://u:pw@h:5432/test?sslmode=disable"
        );
        assert_eq!(o.text("idem_table"), Some("t_1"));
        assert_eq!(o.text("idem_schema"), Some("s"));
        assert_eq!(o.flag("idem_migrate"), Some(false));
        assert_eq!(o.text("idem_migrate"), None);

        let o = options(
            "redis://h:6379/2?idem_prefix=pay%3Av2",
            &[Param::Text("idem_prefix")],
        )
        .unwrap();
        assert_eq!(o.driver_url().expose(), "redis://h:6379/2");
        assert_eq!(o.text("idem_prefix"), Some("pay:v2"));

        let u = StoreUrl::parse(" mariadb://root@h/test?idem_table=x ").unwrap();
        assert_eq!(u.shown(), "mariadb://root@h/test?idem_table=x");
        let o = u.with_scheme("mysql").options("mysql", PG).unwrap();
        assert_eq!(o.driver_url().expose(), "mysql://root@h/test");
    }

    #[test]
    fn bad_parameters_are_config_errors() {
        for (bad, says) in [
            (
                "p://h?idem_prefix=x",
                r#"unknown parameter "idem_prefix"; postgres store URLs take idem_table, idem_schema, idem_migrate"#,
            ),
            ("p://h?IDEM_TABLE=x", "unknown parameter \"IDEM_TABLE\""),
            ("p://h?idem_table=", "idem_table is empty"),
            (
                "p://h?idem_table=%ZZ",
                "idem_table is not valid percent-encoded UTF-8",
            ),
            (
                "p://h?idem_table=a%4",
                "idem_table is not valid percent-encoded UTF-8",
            ),
            (
                "p://h?idem_table=%FF",
                "idem_table is not valid percent-encoded UTF-8",
            ),
            (
                "p://h?idem_table=a&idem_table=b",
                "idem_table is given twice",
            ),
            (
                "p://h?idem_migrate=1&idem_migrate=no",
                "idem_migrate is given twice",
            ),
            (
                "p://h?idem_migrate=maybe",
                r#"idem_migrate takes true or false, not "maybe""#,
            ),
        ] {
            match options(bad, PG) {
                Err(StoreError::Config(m)) => {
                    assert!(m.starts_with(&format!("store URL {bad:?}: ")), "{m}");
                    assert!(m.contains(says), "{bad}: {m}");
                }
                other => panic!("{bad}: {other:?}"),
            }
        }
        let e = options("p://h?idem_x=1", &[]).unwrap_err().to_string();
        assert!(
            e.ends_with("postgres store URLs take no idem_* parameters"),
            "{e}"
        );
        let e = StoreUrl::parse("idem.db").unwrap_err().to_string();
        assert!(e.contains("has no scheme"), "{e}");
        let u = StoreUrl::parse("sqlite:///").unwrap();
        let e = u
            .require_base(&["/"], "file", "use x")
            .unwrap_err()
            .to_string();
        assert!(e.ends_with(r#""sqlite:///" names no file; use x"#), "{e}");
        for yes in ["true", "1", "YES", "On"] {
            assert_eq!(parse_flag(yes), Some(true));
        }
        for no in ["false", "0", "No", "OFF"] {
            assert_eq!(parse_flag(no), Some(false));
        }
    }

    #[test]
    fn white_space_in_the_query_is_refused() {
        // fuzz/crashes/store_url: the driver URL kept " " pairs, and its
        // trailing one was trimmed when the driver URL was read again.
        let e = options("postgres://u:pw@h/db?sslded&& & &&&&&& &", PG)
            .unwrap_err()
            .to_string();
        assert!(e.contains("percent-encode"), "{e}");
        assert!(!e.contains("pw@"), "{e}");
        assert!(options("postgres://h/db?a=b\tc", PG).is_err());
        assert!(options("postgres://h/db ?sslmode=disable", PG).is_err());
        let o = options(
            "postgres://h/db?sslmode=disable&&application_name=a%20b&",
            PG,
        )
        .unwrap();
        let url = o.driver_url().expose();
        assert_eq!(
            url,
            "postgres://h/db?sslmode=disable&application_name=a%20b"
        );
        assert_eq!(options(url, PG).unwrap().driver_url().expose(), url);
    }
}
