//! The store's own rusqlite connections (the writer's and the readers'):
//! how they are opened, and the one record read they share.

use std::path::PathBuf;
use std::time::Duration;

use idem_core::{IdempotencyKey, Phase, Scope, StoreError};
use rusqlite::{params, OptionalExtension};

use crate::common::RawRecord;

/// Where and how the writer opens its connection.
#[derive(Debug, Clone)]
pub(super) struct Target {
    /// The database file (or the name of an in-memory `memdb` database).
    pub(super) path: PathBuf,
    /// SQLite's VFS (`Some("memdb")` for an in-memory database).
    pub(super) vfs: Option<&'static str>,
    pub(super) busy_timeout: Duration,
}

/// Opens a connection of the writer or a reader: the store's busy timeout
/// and `synchronous = FULL` (WAL was set on the file when the store opened
/// it; an in-memory database keeps its journal in memory).
pub(super) fn open(target: &Target) -> Result<rusqlite::Connection, rusqlite::Error> {
    use rusqlite::OpenFlags;
    let flags = OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX;
    let conn = match target.vfs {
        Some(vfs) => rusqlite::Connection::open_with_flags_and_vfs(&target.path, flags, vfs)?,
        None => rusqlite::Connection::open_with_flags(&target.path, flags)?,
    };
    conn.busy_timeout(target.busy_timeout)?;
    conn.pragma_update(None, "synchronous", "FULL")?;
    conn.set_prepared_statement_cache_capacity(32);
    Ok(conn)
}

/// A column decoding error is a corrupt record, not an unavailable store.
pub(super) fn is_decode(e: &rusqlite::Error) -> bool {
    matches!(
        e,
        rusqlite::Error::InvalidColumnType(..)
            | rusqlite::Error::FromSqlConversionFailure(..)
            | rusqlite::Error::IntegralValueOutOfRange(..)
    )
}

/// Reads one record: `None` when absent, the inner error for an
/// undecodable row ([`StoreError::Corrupt`] for `phase`), the outer one for a failed
/// statement.
pub(super) fn read_record(
    conn: &rusqlite::Connection,
    scope: &Scope,
    key: &IdempotencyKey,
    phase: Phase,
) -> Result<Option<Result<RawRecord, StoreError>>, rusqlite::Error> {
    let row = conn
        .prepare_cached(super::SELECT_RECORD)?
        .query_row(params![scope.as_str(), key.as_str()], |row| {
            Ok(RawRecord {
                fingerprint: row.get(0)?,
                state: row.get(1)?,
                fence: row.get(2)?,
                deadline: row.get(3)?,
                response: row.get(4)?,
            })
        })
        .optional();
    match row {
        Ok(row) => Ok(row.map(Ok)),
        Err(e) if is_decode(&e) => Ok(Some(Err(StoreError::corrupt(
            phase,
            format!("undecodable column: {e}"),
        )))),
        Err(e) => Err(e),
    }
}
