//! Key administration: what an operator needs to find and free a key
//! (`idem keys`, the gateway's admin API).
//!
//! [`Store::get`](crate::Store::get), [`Store::delete`](crate::Store::delete)
//! and [`Store::purge_expired`](crate::Store::purge_expired) are part of
//! every store; listing is the one extra capability, [`KeyAdmin`], reached
//! through [`Store::admin`](crate::Store::admin). All five stores of this
//! workspace implement it; a store that does not answers `None` there.
//!
//! Records are named in logs, traces and listings by [`key_hash`]: a short
//! hash of the scope and the key, so the raw key (which may be guessable or
//! carry customer data) and the caller's credentials never leave the store.

use async_trait::async_trait;

use super::Record;
use crate::clock::Millis;
use crate::error::StoreError;
use crate::{IdempotencyKey, Scope};

/// Most records one [`KeyAdmin::list`] call returns: 1,000.
pub const MAX_LIST_LIMIT: usize = 1000;

/// Which records [`KeyAdmin::list`] returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum StateFilter {
    /// Every record (in flight and completed).
    #[default]
    Any,
    /// Records whose state is [`RecordState::InProgress`](crate::RecordState::InProgress),
    /// also those whose lease has ended (a crashed holder's key: the next
    /// `begin` takes it over).
    InFlight,
    /// Records whose state is [`RecordState::Completed`](crate::RecordState::Completed)
    /// and whose TTL has not ended.
    Completed,
}

/// A [`KeyAdmin::list`] request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListQuery {
    /// Which states.
    pub state: StateFilter,
    /// Only this caller's records (`None`: every scope).
    pub scope: Option<Scope>,
    /// Most records to return, 1..=[`MAX_LIST_LIMIT`]; others are an error.
    pub limit: usize,
    /// Where to go on: the [`ListPage::next`] of the previous page; `None`
    /// for the first page. Opaque; only the store that made it reads it.
    pub cursor: Option<String>,
}

impl Default for ListQuery {
    fn default() -> Self {
        Self {
            state: StateFilter::Any,
            scope: None,
            limit: 100,
            cursor: None,
        }
    }
}

impl ListQuery {
    /// Checks `limit` (1..=[`MAX_LIST_LIMIT`]).
    ///
    /// # Errors
    /// [`StoreError::Invalid`] for a limit outside that range.
    pub fn validate(&self) -> Result<(), StoreError> {
        if self.limit == 0 || self.limit > MAX_LIST_LIMIT {
            return Err(StoreError::Invalid(format!(
                "list limit {} is outside 1..={MAX_LIST_LIMIT}",
                self.limit
            )));
        }
        Ok(())
    }
}

/// One listed record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListedRecord {
    /// Whose key.
    pub scope: Scope,
    /// The key.
    pub key: IdempotencyKey,
    /// The record, as [`Store::get`](crate::Store::get) would return it.
    pub record: Record,
}

/// One page of [`KeyAdmin::list`].
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ListPage {
    /// At most `limit` records, newest first where the store can order them
    /// (see each store's documentation).
    pub records: Vec<ListedRecord>,
    /// The cursor of the next page; `None` when this was the last one.
    pub next: Option<String>,
}

/// Listing records: the optional store capability behind `idem keys list`.
///
/// Visibility follows [`Store::get`](crate::Store::get): a record `get`
/// would not return (a completed record past its TTL) is not listed.
/// Records written or deleted while an operator pages through may be listed
/// twice or not at all; no record present for the whole listing is missed.
#[async_trait]
pub trait KeyAdmin: Send + Sync {
    /// One page of records matching `query`.
    ///
    /// # Errors
    /// [`StoreError::Invalid`] for a bad limit or a cursor this store did
    /// not make; availability errors as for any store call (phase
    /// [`Phase::List`](crate::Phase::List)).
    async fn list(&self, query: &ListQuery) -> Result<ListPage, StoreError>;

    /// Whether a listing of one state ([`StateFilter::InFlight`] or
    /// [`StateFilter::Completed`]) comes newest first — by claim or by
    /// completion, as each store documents — so a tool can say so. `false`
    /// (the default): in no particular order (the Redis store, which walks
    /// its keyspace with `SCAN`; there a record may also appear twice when
    /// Redis resized its table between pages).
    fn newest_first(&self) -> bool {
        false
    }
}

/// How a scoped key is named where the raw key must not appear (logs,
/// traces, metrics exemplars, `idem keys`): the first 16 hex digits (64
/// bits) of SHA-256 over the length-prefixed scope and key.
///
/// ```
/// use idem_core::{key_hash, IdempotencyKey, Scope};
/// let h = key_hash(&Scope::anonymous(), &IdempotencyKey::new("order-1").unwrap());
/// assert_eq!(h.len(), 16);
/// assert_ne!(h, key_hash(&Scope::new("tenant").unwrap(), &IdempotencyKey::new("order-1").unwrap()));
/// ```
pub fn key_hash(scope: &Scope, key: &IdempotencyKey) -> String {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    for part in [scope.as_str().as_bytes(), key.as_str().as_bytes()] {
        h.update((part.len() as u64).to_be_bytes());
        h.update(part);
    }
    hex::encode(&h.finalize()[..8])
}

/// When a record's state ends (lease end or expiry), by the store's clock;
/// a helper for listings.
pub fn state_until(record: &Record) -> Millis {
    match &record.state {
        crate::RecordState::InProgress { lease_until, .. } => *lease_until,
        crate::RecordState::Completed { expires_at, .. } => *expires_at,
    }
}
