//! Opening a store from its URL.

use std::sync::Arc;

use idem_core::{DynStore, MemoryStore, StoreError};

const SUPPORTED: &str = "memory://, sqlite://relative/path.db, sqlite:///absolute/path.db";

/// The kind of store a URL selects.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StoreKind {
    Memory,
    Sqlite,
}

impl StoreKind {
    /// Reads the scheme of a store URL.
    pub(crate) fn of_url(url: &str) -> Result<Self, StoreError> {
        let Some((scheme, rest)) = url.split_once("://") else {
            return Err(StoreError::Config(format!(
                "store URL {url:?} has no scheme; supported: {SUPPORTED}"
            )));
        };
        match scheme.to_ascii_lowercase().as_str() {
            "memory" if rest.is_empty() => Ok(Self::Memory),
            "memory" => Err(StoreError::Config(format!(
                "store URL {url:?}: memory:// takes nothing after the scheme"
            ))),
            "sqlite" if sqlite_path(rest).is_empty() => Err(StoreError::Config(format!(
                "store URL {url:?} names no file; use sqlite://relative.db or sqlite:///absolute/path.db"
            ))),
            "sqlite" => Ok(Self::Sqlite),
            s @ ("postgres" | "postgresql" | "mysql" | "mariadb" | "redis" | "rediss") => {
                Err(StoreError::Config(format!(
                    "store URL {url:?}: {s}:// stores are not supported by this version yet; supported: {SUPPORTED}"
                )))
            }
            s => Err(StoreError::Config(format!(
                "store URL {url:?}: unknown scheme {s:?}; supported: {SUPPORTED}"
            ))),
        }
    }

    /// The name reported by `GET /_idem/health`.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Memory => "memory",
            Self::Sqlite => "sqlite",
        }
    }
}

/// The file path of a `sqlite://` URL's remainder: `rel.db` → `rel.db`,
/// `/abs/x.db` → `/abs/x.db`; a `?query` is cut off.
fn sqlite_path(rest: &str) -> &str {
    rest.split_once('?').map_or(rest, |(p, _)| p)
}

/// Opens the store a URL names.
///
/// | URL | store |
/// |---|---|
/// | `memory://` | an in-process [`MemoryStore`] (nothing survives the process) |
/// | `sqlite://relative.db` | SQLite file relative to the working directory, created if missing |
/// | `sqlite:///absolute/path.db` | SQLite file at an absolute path, created if missing |
///
/// PostgreSQL, MySQL and Redis URLs are recognised and refused for now.
///
/// ```
/// # tokio::runtime::Runtime::new().unwrap().block_on(async {
/// let store = idem_gateway::open_store("memory://").await.unwrap();
/// assert!(idem_gateway::open_store("postgres://db/idem").await.is_err());
/// # });
/// ```
///
/// # Errors
/// [`StoreError::Config`] for an unsupported or malformed URL (the message
/// lists the supported forms); the SQLite store's errors when the file
/// cannot be opened, created or migrated.
pub async fn open_store(url: &str) -> Result<DynStore, StoreError> {
    match StoreKind::of_url(url)? {
        StoreKind::Memory => Ok(Arc::new(MemoryStore::new())),
        StoreKind::Sqlite => {
            let store = idem_sql::SqliteStore::open(url).await?;
            Ok(Arc::new(store))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds() {
        assert_eq!(StoreKind::of_url("memory://").unwrap(), StoreKind::Memory);
        assert_eq!(
            StoreKind::of_url("sqlite://idem.db").unwrap(),
            StoreKind::Sqlite
        );
        assert_eq!(
            StoreKind::of_url("sqlite:///tmp/x.db").unwrap(),
            StoreKind::Sqlite
        );
        for bad in [
            "idem.db",
            "sqlite://",
            "memory://x",
            "redis://localhost",
            "postgres://h/db",
            "foo://x",
        ] {
            let e = StoreKind::of_url(bad).unwrap_err();
            assert!(matches!(e, StoreError::Config(_)), "{bad}: {e}");
        }
        let e = StoreKind::of_url("mysql://h/db").unwrap_err().to_string();
        assert!(e.contains("memory://") && e.contains("sqlite://"), "{e}");
    }
}
