//! Key administration shared by `idem keys` and the admin API (`/keys`):
//! naming a scope, the JSON shape of a record, and the four operations
//! (list, get, delete, purge), each bounded in time.
//!
//! ## The JSON shape of a record ([`KeyRecord`])
//!
//! ```json
//! {
//!   "key": "order-1",
//!   "scope": "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08",
//!   "key_hash": "5e2bf57d3f40c4b6",
//!   "state": "in-flight",
//!   "held": "timeout",
//!   "fingerprint": "2c26b46b68ffc68ff99b453c1d30413413422d706483bfa0f98a5e886266e7ae",
//!   "fence": 1764637200123000,
//!   "lease_until": "2025-12-02T01:00:30.123Z",
//!   "lease_until_ms": 1764637230123,
//!   "expires_at": null,
//!   "expires_at_ms": null,
//!   "response": null
//! }
//! ```
//!
//! - `scope`: 64 lowercase hex digits (the SHA-256 the gateway derives
//!   from the caller's `--scope-header` fields) or `anonymous`.
//! - `key_hash`: [`idem_core::key_hash`], how logs and traces name the key.
//! - `state`: `in-flight` or `completed`.
//! - `held`: in flight only: `null` while the request runs (or its holder
//!   died), else why its outcome is unknown and the key is held
//!   ([`idem_core::HoldReason`]: `timeout`, `broken-body`,
//!   `connection-lost`, `save-failed`, `cancelled`, `unknown`). A held key is the operator's to settle:
//!   [`delete`] releases it (the next request runs), [`complete`] stores
//!   the answer duplicates get; untouched, it frees itself when its lease
//!   (at least `--hold-for`) ends.
//! - `fence`, `lease_until`, `lease_until_ms`: in flight only (else
//!   `null`); times are RFC 3339 in UTC with milliseconds, and the same
//!   instant in milliseconds since the Unix epoch, by the store's clock.
//!   A listed in-flight record whose lease has ended belongs to a holder
//!   that stopped renewing it: the next request with the key takes it over.
//! - `expires_at`, `expires_at_ms`: completed only: when the result is
//!   forgotten.
//! - `response`: completed only: `{"status": 201, "body_bytes": 57,
//!   "body_omitted": false, "headers": 3}` (the stored status, the stored
//!   body's length in bytes, whether the body was too large to keep, the
//!   number of stored header fields). Bodies and header values are never
//!   shown: they may carry customer data.
//!
//! A listing is `{"records": [KeyRecord, …], "next": "cursor" | null,
//! "newest_first": true}` ([`KeyPage`]); a deletion is [`Deleted`]; an
//! operator's completion is [`Completed`]; a purge is `{"purged": 12}`.

use std::fmt;
use std::future::Future;
use std::time::{Duration, SystemTime};

use http::{HeaderMap, HeaderName, HeaderValue};
use idem_core::admin::{ListPage, ListQuery, StateFilter};
use idem_core::{
    key_hash, IdempotencyKey, Lease, Millis, Phase, Record, RecordState, Scope, Store, StoreError,
};
use idem_http::ScopeBy;
use serde::{Deserialize, Serialize};

/// One record as `idem keys --json` and the admin API show it (see the
/// [module documentation](self) for each field).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyRecord {
    /// The idempotency key.
    pub key: String,
    /// The scope: 64 hex digits or `anonymous`.
    pub scope: String,
    /// [`idem_core::key_hash`] of scope and key (16 hex digits).
    pub key_hash: String,
    /// `in-flight` or `completed`.
    pub state: String,
    /// Why an in-flight key is held ([`idem_core::HoldReason::as_str`]);
    /// `None` while it runs, and for a completed key.
    #[serde(default)]
    pub held: Option<String>,
    /// The request fingerprint, 64 hex digits.
    pub fingerprint: String,
    /// The fence of the claim (in flight only).
    pub fence: Option<u64>,
    /// When the lease ends, RFC 3339 UTC (in flight only).
    pub lease_until: Option<String>,
    /// When the lease ends, ms since the Unix epoch (in flight only).
    pub lease_until_ms: Option<u64>,
    /// When the result is forgotten, RFC 3339 UTC (completed only).
    pub expires_at: Option<String>,
    /// When the result is forgotten, ms since the Unix epoch (completed only).
    pub expires_at_ms: Option<u64>,
    /// The stored response, without its body (completed only).
    pub response: Option<ResponseSummary>,
}

/// What is known of a stored response without showing it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResponseSummary {
    /// The stored HTTP status.
    pub status: u16,
    /// The stored body's length in bytes (0 when it was omitted).
    pub body_bytes: u64,
    /// Whether the body was larger than the retention limit and not kept
    /// (a duplicate gets 410).
    pub body_omitted: bool,
    /// How many header fields were stored.
    pub headers: u64,
}

/// `in-flight`, the [`KeyRecord::state`] of a claimed key.
pub const STATE_IN_FLIGHT: &str = "in-flight";
/// `completed`, the [`KeyRecord::state`] of a key with a stored result.
pub const STATE_COMPLETED: &str = "completed";

/// An instant of the store's clock as RFC 3339 UTC with milliseconds.
///
/// An instant past 9999-12-31T23:59:59.999Z (a record kept "for ever":
/// a TTL of `Duration::MAX` saturates) is shown as that last instant;
/// RFC 3339 has no later year.
pub fn rfc3339(at: Millis) -> String {
    /// 9999-12-31T23:59:59.999Z in ms since the Unix epoch.
    const LAST: u64 = 253_402_300_799_999;
    let t = SystemTime::UNIX_EPOCH + Duration::from_millis(at.0.min(LAST));
    humantime::format_rfc3339_millis(t).to_string()
}

impl KeyRecord {
    /// The shape of `record`, the record of `key` in `scope`.
    pub fn new(scope: &Scope, key: &IdempotencyKey, record: &Record) -> Self {
        let mut r = Self {
            key: key.as_str().to_owned(),
            scope: scope.as_str().to_owned(),
            key_hash: key_hash(scope, key),
            state: String::new(),
            held: None,
            fingerprint: record.fingerprint.to_hex(),
            fence: None,
            lease_until: None,
            lease_until_ms: None,
            expires_at: None,
            expires_at_ms: None,
            response: None,
        };
        match &record.state {
            RecordState::InProgress {
                fence,
                lease_until,
                held,
            } => {
                r.state = STATE_IN_FLIGHT.to_owned();
                r.held = held.map(|h| h.as_str().to_owned());
                r.fence = Some(*fence);
                r.lease_until = Some(rfc3339(*lease_until));
                r.lease_until_ms = Some(lease_until.0);
            }
            RecordState::Completed {
                response,
                expires_at,
            } => {
                r.state = STATE_COMPLETED.to_owned();
                r.expires_at = Some(rfc3339(*expires_at));
                r.expires_at_ms = Some(expires_at.0);
                r.response = Some(ResponseSummary {
                    status: response.status,
                    body_bytes: response.body.len() as u64,
                    body_omitted: response.body_omitted,
                    headers: response.headers.len() as u64,
                });
            }
        }
        r
    }

    /// When the current state ends (lease end or expiry), ms since the
    /// Unix epoch by the store's clock.
    pub fn until_ms(&self) -> Option<u64> {
        self.lease_until_ms.or(self.expires_at_ms)
    }
}

/// One page of a listing:
/// `{"records": […], "next": "…" | null, "newest_first": true}`.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct KeyPage {
    /// The records, in the store's order.
    pub records: Vec<KeyRecord>,
    /// Pass it as the cursor to get the next page; `null` on the last one.
    pub next: Option<String>,
    /// Whether the records of one state come newest first
    /// ([`idem_core::KeyAdmin::newest_first`]: the memory and SQL stores;
    /// the Redis store lists in no particular order).
    pub newest_first: bool,
}

impl KeyPage {
    /// The shape of `page`; `newest_first` as the store says.
    pub fn new(page: &ListPage, newest_first: bool) -> Self {
        Self {
            records: page
                .records
                .iter()
                .map(|r| KeyRecord::new(&r.scope, &r.key, &r.record))
                .collect(),
            next: page.next.clone(),
            newest_first,
        }
    }
}

/// What a deletion removed:
/// `{"deleted": true, "key": …, "scope": …, "key_hash": …, "record": KeyRecord | null}`.
/// `record` is the record as read just before the deletion; `null` when it
/// was no longer visible (a result past its TTL, a lease that had ended)
/// but its row was still there.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Deleted {
    /// Always `true` (a deletion of nothing is "not found", not this).
    pub deleted: bool,
    /// The key.
    pub key: String,
    /// The scope.
    pub scope: String,
    /// [`idem_core::key_hash`] of scope and key.
    pub key_hash: String,
    /// The record as it was.
    pub record: Option<KeyRecord>,
}

/// `{"purged": N}`: how many expired records a purge removed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Purged {
    /// Records removed.
    pub purged: u64,
}

/// A key-administration call that failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KeysError {
    /// The store has no listing capability ([`Store::admin`] is `None`).
    #[error("this store cannot list its records (it has no key-administration capability); get, delete and purge still work")]
    NoListing,
    /// The store failed, timed out, or refused the request
    /// ([`StoreError::Invalid`] for a bad limit or cursor).
    #[error(transparent)]
    Store(#[from] StoreError),
    /// [`delete`] found the record in flight, but by the time it asked the
    /// store to free that claim the claim had ended (its holder completed
    /// or released it, or another request took it over). Nothing was
    /// deleted; look at the record again.
    #[error("the record changed while it was being deleted (its claim completed, was released or was taken over); nothing was deleted: look at it again")]
    Changed,
    /// [`complete`] found the key completed already: its stored answer
    /// stands (delete it first to replace it).
    #[error("the key is completed already; its stored response stands (delete the key first to replace it)")]
    AlreadyCompleted,
    /// [`complete`] found the key in flight and not held: its request may
    /// still be running and finish by itself. Wait for it, or force it.
    #[error("the key is in flight and not held: its request may still be running and store its own result; wait until it is held or gone, or force the completion")]
    NotHeld,
    /// [`complete`] was given a response it cannot store (a status outside
    /// 100..=599, a bad header).
    #[error("{0}")]
    BadResponse(String),
}

async fn bounded<T>(
    phase: Phase,
    timeout: Duration,
    call: impl Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    tokio::time::timeout(timeout, call)
        .await
        .map_err(|_| StoreError::Timeout { phase })?
}

/// One page of records, the store call bounded by `timeout`.
///
/// # Errors
/// [`KeysError::NoListing`] for a store without listing; the store's
/// errors ([`StoreError::Timeout`] after `timeout`, [`StoreError::Invalid`]
/// for a limit outside 1..=1000 or a cursor it did not make).
pub async fn list(
    store: &dyn Store,
    query: &ListQuery,
    timeout: Duration,
) -> Result<KeyPage, KeysError> {
    query.validate()?;
    let admin = store.admin().ok_or(KeysError::NoListing)?;
    let page = bounded(Phase::List, timeout, admin.list(query)).await?;
    Ok(KeyPage::new(&page, admin.newest_first()))
}

/// The record of `key` in `scope` (`None`: absent, or past its TTL or
/// lease), the store call bounded by `timeout`.
///
/// # Errors
/// The store's errors ([`StoreError::Timeout`] after `timeout`).
pub async fn get(
    store: &dyn Store,
    scope: &Scope,
    key: &IdempotencyKey,
    timeout: Duration,
) -> Result<Option<KeyRecord>, KeysError> {
    let rec = bounded(Phase::Get, timeout, store.get(scope, key)).await?;
    Ok(rec.map(|r| KeyRecord::new(scope, key, &r)))
}

/// Deletes the record of `key` in `scope` as [`get`] sees it, each call
/// bounded by `timeout`; `None` when `get` sees nothing (an absent key,
/// or a claim whose lease ended: the next request takes it over anyway).
/// The caller logs the deletion ([`log_deleted`]).
///
/// - An **in-flight** record is freed with [`Store::release`] under the
///   fence just read: a compare-and-set on the fence, so a claim that
///   completed or changed hands in between is left alone
///   ([`KeysError::Changed`]) instead of a stored result being deleted.
///   The next request with the key runs while the first holder may still
///   be running: its late `complete` fails (its fence is no longer
///   current) and its result is not stored.
/// - A **completed** record is deleted ([`Store::delete`]): the next
///   request with the key runs again.
///
/// # Errors
/// [`KeysError::Changed`] as above; the store's errors
/// ([`StoreError::Timeout`] after `timeout`; after a timeout of the
/// release or delete itself the record may or may not be gone).
pub async fn delete(
    store: &dyn Store,
    scope: &Scope,
    key: &IdempotencyKey,
    timeout: Duration,
) -> Result<Option<Deleted>, KeysError> {
    let Some(raw) = bounded(Phase::Get, timeout, store.get(scope, key)).await? else {
        return Ok(None);
    };
    let record = Some(KeyRecord::new(scope, key, &raw));
    let existed = match raw.state {
        RecordState::InProgress {
            fence, lease_until, ..
        } => {
            let lease = Lease {
                scope: scope.clone(),
                key: key.clone(),
                fence,
                until: lease_until,
                took_over: false,
            };
            match bounded(Phase::Release, timeout, store.release(&lease)).await {
                Ok(()) => true,
                Err(StoreError::LeaseLost { .. }) => return Err(KeysError::Changed),
                Err(e) => return Err(e.into()),
            }
        }
        RecordState::Completed { .. } => {
            bounded(Phase::Delete, timeout, store.delete(scope, key)).await?
        }
    };
    Ok(existed.then(|| Deleted {
        deleted: true,
        key: key.as_str().to_owned(),
        scope: scope.as_str().to_owned(),
        key_hash: key_hash(scope, key),
        record,
    }))
}

/// An operator's answer for a held key, as `idem keys complete` and
/// `POST /keys/{scope}/{key}/complete` take it:
/// `{"status": 201, "headers": {"content-type": "application/json"},
/// "body": "{\"id\":7}", "ttl": "24h", "force": false}`.
///
/// - `status`: 200..=599 (a final status: a 1xx cannot be replayed).
/// - `headers`: optional, name → value; names and values as HTTP allows.
///   Not the framing and hop-by-hop fields (`content-length`,
///   `transfer-encoding`, `connection`, `upgrade`, …) the replay writes
///   itself, nor `idempotent-replayed`, which it adds.
/// - `body`: optional text (default empty); none on 204 and 304.
/// - `ttl`: optional duration (`90s`, `24h`), how long the answer is
///   replayed: 1 s to 100 years; default 24 h ([`idem_core::DEFAULT_TTL`]).
/// - `force`: complete a key that is in flight and not held (its request
///   may still be running; its own result then loses). Default `false`.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CompleteRequest {
    /// The HTTP status duplicates get.
    pub status: u16,
    /// Header fields duplicates get.
    #[serde(default)]
    pub headers: std::collections::BTreeMap<String, String>,
    /// The body duplicates get.
    #[serde(default)]
    pub body: String,
    /// How long the answer is replayed (humantime: `24h`).
    #[serde(default)]
    pub ttl: Option<String>,
    /// Complete a key that is not held.
    #[serde(default)]
    pub force: bool,
}

impl CompleteRequest {
    /// The stored response and TTL this request asks for.
    ///
    /// # Errors
    /// [`KeysError::BadResponse`] for a status outside 200..=599, a body
    /// on 204 or 304, a header name or value HTTP refuses, a framing or
    /// hop-by-hop field, or a TTL that does not parse or is outside 1 s to
    /// 100 years.
    pub fn to_response(&self) -> Result<(idem_core::StoredResponse, Duration), KeysError> {
        let bad = |m: String| KeysError::BadResponse(m);
        if !(200..=599).contains(&self.status) {
            return Err(bad(format!(
                "status {} is not a final HTTP status (200..=599)",
                self.status
            )));
        }
        if matches!(self.status, 204 | 304) && !self.body.is_empty() {
            return Err(bad(format!(
                "a {} response has no body; leave the body out",
                self.status
            )));
        }
        let mut resp = idem_core::StoredResponse::new(self.status, self.body.clone().into_bytes());
        for (name, value) in &self.headers {
            let n = HeaderName::from_bytes(name.as_bytes())
                .map_err(|_| bad(format!("{name:?} is not a header name")))?;
            let framing = crate::HOP_BY_HOP.contains(&n.as_str())
                || n == http::header::CONTENT_LENGTH
                || n == http::header::TRANSFER_ENCODING
                || n == idem_http::IDEMPOTENT_REPLAYED;
            if framing {
                return Err(bad(format!(
                    "{name:?} is written by the replay itself; leave it out"
                )));
            }
            HeaderValue::from_str(value)
                .map_err(|_| bad(format!("the value of {name:?} is not a valid header value")))?;
            resp.headers
                .push((n.as_str().to_owned(), value.clone().into_bytes()));
        }
        let ttl = match &self.ttl {
            None => idem_core::DEFAULT_TTL,
            Some(t) => crate::parse_duration(t).map_err(|e| bad(format!("ttl {t:?}: {e}")))?,
        };
        if ttl < Duration::from_secs(1) {
            return Err(bad(format!(
                "ttl {} would forget the answer (almost) at once, and the next retry would run \
                 the request again; give at least 1s",
                humantime::format_duration(ttl)
            )));
        }
        Ok((resp, ttl))
    }
}

/// What an operator's completion stored:
/// `{"completed": true, "key": …, "scope": …, "key_hash": …, "fence": 17, "record": KeyRecord}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Completed {
    /// Always `true`.
    pub completed: bool,
    /// The key.
    pub key: String,
    /// The scope.
    pub scope: String,
    /// [`idem_core::key_hash`] of scope and key.
    pub key_hash: String,
    /// The fence of the claim that was completed.
    pub fence: u64,
    /// The record as it is now (completed), or `None` when it could not be
    /// read back.
    pub record: Option<KeyRecord>,
}

/// Settles a held key with an operator's answer: stores `response` for
/// `key` in `scope` for `ttl`, so every duplicate gets it replayed and the
/// request is never run again (e.g. after checking in the upstream's own
/// records that the charge went through). Each store call is bounded by
/// `timeout`; `None` when [`get`] sees no record (absent, or a claim
/// whose lease ended).
///
/// A [`Store::complete`] under the fence just read: a compare-and-set, so
/// a claim that completed or changed hands in between is left alone
/// ([`KeysError::Changed`]). Only a held key is completed unless `force`
/// is set: a key in flight and not held may still be running
/// ([`KeysError::NotHeld`]); its own late result then loses (its fence is
/// no longer current).
///
/// # Errors
/// [`KeysError::AlreadyCompleted`], [`KeysError::NotHeld`],
/// [`KeysError::Changed`]; the store's errors ([`StoreError::Timeout`]
/// after `timeout`: the answer may or may not have been stored).
pub async fn complete(
    store: &dyn Store,
    scope: &Scope,
    key: &IdempotencyKey,
    response: &idem_core::StoredResponse,
    ttl: Duration,
    force: bool,
    timeout: Duration,
) -> Result<Option<Completed>, KeysError> {
    if !(100..=599).contains(&response.status) {
        return Err(KeysError::BadResponse(format!(
            "status {} is not an HTTP status (100..=599)",
            response.status
        )));
    }
    let Some(raw) = bounded(Phase::Get, timeout, store.get(scope, key)).await? else {
        return Ok(None);
    };
    let (fence, lease_until) = match raw.state {
        RecordState::Completed { .. } => return Err(KeysError::AlreadyCompleted),
        RecordState::InProgress { held: None, .. } if !force => return Err(KeysError::NotHeld),
        RecordState::InProgress {
            fence, lease_until, ..
        } => (fence, lease_until),
    };
    let lease = Lease {
        scope: scope.clone(),
        key: key.clone(),
        fence,
        until: lease_until,
        took_over: false,
    };
    match bounded(
        Phase::Complete,
        timeout,
        store.complete(&lease, response, ttl),
    )
    .await
    {
        Ok(()) => {}
        Err(StoreError::LeaseLost { .. }) => return Err(KeysError::Changed),
        Err(e) => return Err(e.into()),
    }
    let record = bounded(Phase::Get, timeout, store.get(scope, key))
        .await
        .ok()
        .flatten()
        .map(|r| KeyRecord::new(scope, key, &r));
    Ok(Some(Completed {
        completed: true,
        key: key.as_str().to_owned(),
        scope: scope.as_str().to_owned(),
        key_hash: key_hash(scope, key),
        fence,
        record,
    }))
}

/// Logs an operator's completion at WARN, one line, as [`log_deleted`]
/// does: who, through what, which key (`key_hash`, `scope`, `fence`), the
/// stored status, and when.
pub fn log_completed(c: &Completed, status: u16, by: &str, via: &str) {
    let at = humantime::format_rfc3339_millis(SystemTime::now()).to_string();
    tracing::warn!(
        by,
        via,
        key_hash = %c.key_hash,
        scope = %c.scope,
        fence = c.fence,
        status,
        at = %at,
        "idem key completed by an operator"
    );
}

/// Removes expired records ([`Store::purge_expired`]), bounded by `timeout`.
///
/// # Errors
/// The store's errors ([`StoreError::Timeout`] after `timeout`).
pub async fn purge(store: &dyn Store, timeout: Duration) -> Result<Purged, KeysError> {
    let purged = bounded(Phase::Purge, timeout, store.purge_expired()).await?;
    Ok(Purged { purged })
}

/// Logs a deletion at WARN, one line: who (`by`, e.g. `peer 127.0.0.1:5511
/// with the admin token`), through what (`via`: `admin-api` or `idem
/// keys`), what (`key_hash`, `scope`, the `state` it was in and its
/// `fence`), and when (`at`, RFC 3339 UTC). The raw key is not logged.
pub fn log_deleted(d: &Deleted, by: &str, via: &str) {
    let at = humantime::format_rfc3339_millis(SystemTime::now()).to_string();
    let (state, fence) = match &d.record {
        Some(r) if r.held.is_some() => ("held", r.fence),
        Some(r) => (r.state.as_str(), r.fence),
        None => ("expired", None),
    };
    tracing::warn!(
        by,
        via,
        key_hash = %d.key_hash,
        scope = %d.scope,
        state,
        fence,
        at = %at,
        "idem key deleted by an operator"
    );
}

/// Parses a scope named by its hash: 64 hex digits (any case) or
/// `anonymous`.
///
/// ```
/// let s = idem_gateway::keys::parse_scope_hash(&"AB".repeat(32)).unwrap();
/// assert_eq!(s.as_str(), "ab".repeat(32));
/// assert!(idem_gateway::keys::parse_scope_hash("abc").is_err());
/// ```
///
/// # Errors
/// A message saying what a scope hash looks like.
pub fn parse_scope_hash(s: &str) -> Result<Scope, String> {
    let t = s.trim();
    if t == Scope::ANONYMOUS {
        return Ok(Scope::anonymous());
    }
    if t.len() == 64 && t.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Scope::new(t.to_ascii_lowercase()).map_err(|e| e.to_string());
    }
    Err(format!(
        "{s:?} is not a scope hash: give the 64 hex digits `idem keys list` shows in full \
         with --json (or `anonymous`)"
    ))
}

/// The scope the gateway derives for a request whose scope headers were
/// `pairs` (`NAME:VALUE` each, e.g. `authorization:Bearer abc`): the same
/// [`ScopeBy::Headers`] code the layer runs, over the named headers in the
/// order they first appear here (give them in the gateway's
/// `--scope-header` order; it matters only when a request carried more than
/// one of them) and the values of one header in the order given. Spaces
/// and tabs around a value are dropped, as an HTTP server drops them. No
/// pairs: the anonymous scope.
///
/// ```
/// use idem_gateway::keys::scope_of_headers;
/// let a = scope_of_headers(&["Authorization: Bearer a"]).unwrap();
/// let mut h = http::HeaderMap::new();
/// h.insert("authorization", "Bearer a".parse().unwrap());
/// assert_eq!(a, idem_http::ScopeBy::default().scope_of(&h));
/// assert_eq!(scope_of_headers(&[] as &[&str]).unwrap(), idem_core::Scope::anonymous());
/// ```
///
/// # Errors
/// A message naming the malformed pair: no `:`, a name the gateway's
/// `--scope-header` refuses, or a value that is not a valid header value.
pub fn scope_of_headers(pairs: &[impl AsRef<str>]) -> Result<Scope, String> {
    let mut names: Vec<HeaderName> = Vec::new();
    let mut headers = HeaderMap::new();
    for pair in pairs {
        let pair = pair.as_ref();
        let Some((name, value)) = pair.split_once(':') else {
            return Err(format!(
                "{pair:?} is not NAME:VALUE (e.g. \"authorization:Bearer abc\")"
            ));
        };
        let name = crate::parse_scope_header(name).map_err(|e| format!("{pair:?}: {e}"))?;
        let value = HeaderValue::from_str(value.trim_matches([' ', '\t'])).map_err(|_| {
            format!("{pair:?}: the value is not a valid header value (visible ASCII, no control characters)")
        })?;
        if !names.contains(&name) {
            names.push(name.clone());
        }
        headers.append(name, value);
    }
    Ok(ScopeBy::Headers(names).scope_of(&headers))
}

/// Parses a state filter: `in-flight` (or `in_flight`), `completed`, `any`.
///
/// # Errors
/// A message listing the accepted values.
pub fn parse_state(s: &str) -> Result<StateFilter, String> {
    match s.trim().to_ascii_lowercase().as_str() {
        "in-flight" | "in_flight" | "inflight" => Ok(StateFilter::InFlight),
        "completed" => Ok(StateFilter::Completed),
        "any" | "" => Ok(StateFilter::Any),
        _ => Err(format!(
            "{s:?} is not a state; use in-flight, completed or any"
        )),
    }
}

/// The key-administration error as one line, for messages.
impl KeysError {
    /// The error and its sources, joined with ": ".
    pub fn chain(&self) -> String {
        let mut out = self.to_string();
        let mut source = std::error::Error::source(self);
        while let Some(s) = source {
            let t = s.to_string();
            if !out.contains(&t) {
                out.push_str(": ");
                out.push_str(&t);
            }
            source = s.source();
        }
        out
    }
}

/// Displays a [`Scope`] shortened for tables: the first 12 hex digits of a
/// hashed scope followed by `…`, or the scope itself when short.
#[derive(Debug, Clone, Copy)]
pub struct ShortScope<'a>(pub &'a str);

impl fmt::Display for ShortScope<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.len() > 13 && self.0.is_char_boundary(12) {
            write!(f, "{}…", &self.0[..12])
        } else {
            f.write_str(self.0)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use idem_core::{Fingerprint, StoredResponse};

    #[tokio::test]
    async fn only_a_held_key_is_completed_unless_forced() {
        use idem_core::{BeginRequest, HoldReason, MemoryStore};
        let store = MemoryStore::new();
        let scope = Scope::anonymous();
        let t = Duration::from_secs(5);
        let answer = StoredResponse::new(201, "settled");
        let begin = |k: &str| BeginRequest {
            scope: scope.clone(),
            key: IdempotencyKey::new(k).unwrap(),
            fingerprint: Fingerprint::of(b"x"),
            lease: Duration::from_secs(30),
        };
        let claim = |b: idem_core::Begin| match b {
            idem_core::Begin::Acquired(l) => l,
            other => panic!("{other:?}"),
        };
        let live = claim(store.begin(&begin("live")).await.unwrap());
        let r = complete(&store, &scope, &live.key, &answer, t, false, t).await;
        assert!(matches!(r, Err(KeysError::NotHeld)), "{r:?}");
        let forced = complete(&store, &scope, &live.key, &answer, t, true, t)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(forced.fence, live.fence);
        assert_eq!(forced.record.unwrap().state, STATE_COMPLETED);
        // The holder's own late result loses.
        assert!(matches!(
            store
                .complete(&live, &StoredResponse::new(200, "late"), t)
                .await,
            Err(StoreError::LeaseLost { .. })
        ));
        let r = complete(&store, &scope, &live.key, &answer, t, true, t).await;
        assert!(matches!(r, Err(KeysError::AlreadyCompleted)), "{r:?}");

        let held = claim(store.begin(&begin("held")).await.unwrap());
        store.hold(&held, HoldReason::Timeout, t).await.unwrap();
        let done = complete(&store, &scope, &held.key, &answer, t, false, t)
            .await
            .unwrap()
            .unwrap();
        assert!(done.completed);
        let absent = IdempotencyKey::new("absent").unwrap();
        assert!(complete(&store, &scope, &absent, &answer, t, false, t)
            .await
            .unwrap()
            .is_none());
        let bad = StoredResponse::new(42, "");
        assert!(matches!(
            complete(&store, &scope, &held.key, &bad, t, false, t).await,
            Err(KeysError::BadResponse(_))
        ));
    }

    #[test]
    fn instants_past_year_9999_are_shown_as_its_last_one() {
        assert_eq!(rfc3339(Millis(u64::MAX)), "9999-12-31T23:59:59.999Z");
        assert_eq!(rfc3339(Millis(0)), "1970-01-01T00:00:00.000Z");
        let scope = Scope::anonymous();
        let key = IdempotencyKey::new("forever").unwrap();
        let rec = Record {
            fingerprint: Fingerprint::of(b"x"),
            state: RecordState::Completed {
                response: StoredResponse::new(200, ""),
                expires_at: Millis(u64::MAX),
            },
        };
        assert_eq!(
            KeyRecord::new(&scope, &key, &rec).expires_at.as_deref(),
            Some("9999-12-31T23:59:59.999Z")
        );
    }

    #[test]
    fn completions_are_checked() {
        let ok = CompleteRequest {
            status: 201,
            headers: [("Content-Type".to_owned(), "application/json".to_owned())].into(),
            body: "{}".into(),
            ttl: Some("90s".into()),
            force: false,
        };
        let (resp, ttl) = ok.to_response().unwrap();
        assert_eq!((resp.status, ttl), (201, Duration::from_secs(90)));
        assert_eq!(
            resp.headers,
            vec![("content-type".to_owned(), b"application/json".to_vec())]
        );
        for bad in [
            CompleteRequest {
                ttl: Some("1ms".into()),
                ..ok.clone()
            },
            CompleteRequest {
                ttl: Some("500000000y".into()),
                ..ok.clone()
            },
            CompleteRequest {
                status: 101,
                ..ok.clone()
            },
            CompleteRequest {
                status: 204,
                ..ok.clone()
            },
            CompleteRequest {
                headers: [("content-length".to_owned(), "9".to_owned())].into(),
                ..ok.clone()
            },
            CompleteRequest {
                headers: [("Transfer-Encoding".to_owned(), "chunked".to_owned())].into(),
                ..ok.clone()
            },
            CompleteRequest {
                headers: [("idempotent-replayed".to_owned(), "false".to_owned())].into(),
                ..ok.clone()
            },
            CompleteRequest {
                headers: [("connection".to_owned(), "close".to_owned())].into(),
                ..ok.clone()
            },
            CompleteRequest {
                status: 600,
                ..ok.clone()
            },
            CompleteRequest {
                ttl: Some("0s".into()),
                ..ok.clone()
            },
            CompleteRequest {
                ttl: Some("soon".into()),
                ..ok.clone()
            },
            CompleteRequest {
                headers: [("bad name".to_owned(), "v".to_owned())].into(),
                ..ok.clone()
            },
            CompleteRequest {
                headers: [("x".to_owned(), "a\nb".to_owned())].into(),
                ..ok.clone()
            },
        ] {
            assert!(
                matches!(bad.to_response(), Err(KeysError::BadResponse(_))),
                "{bad:?}"
            );
        }
        let parsed: CompleteRequest = serde_json::from_str(r#"{"status": 204}"#).unwrap();
        assert_eq!(parsed.to_response().unwrap().1, idem_core::DEFAULT_TTL);
        assert!(serde_json::from_str::<CompleteRequest>(r#"{"status": 204, "extra": 1}"#).is_err());
    }

    #[test]
    fn records_have_the_documented_shape() {
        let scope = Scope::anonymous();
        let key = IdempotencyKey::new("order-1").unwrap();
        let rec = Record {
            fingerprint: Fingerprint::of(b"x"),
            state: RecordState::InProgress {
                fence: 7,
                lease_until: Millis(1_764_637_230_123),
                held: None,
            },
        };
        let v = serde_json::to_value(KeyRecord::new(&scope, &key, &rec)).unwrap();
        assert_eq!(v["key"], "order-1");
        assert_eq!(v["scope"], "anonymous");
        assert_eq!(v["key_hash"], key_hash(&scope, &key));
        assert_eq!(v["state"], "in-flight");
        assert_eq!(v["fence"], 7);
        assert_eq!(v["lease_until"], "2025-12-02T01:00:30.123Z");
        assert_eq!(v["lease_until_ms"], 1_764_637_230_123u64);
        assert!(v["expires_at"].is_null() && v["response"].is_null());
        assert!(v["held"].is_null());
        assert_eq!(v.as_object().unwrap().len(), 12);
        let held = Record {
            fingerprint: Fingerprint::of(b"x"),
            state: RecordState::InProgress {
                fence: 7,
                lease_until: Millis(1_764_637_230_123),
                held: Some(idem_core::HoldReason::Timeout),
            },
        };
        let v = serde_json::to_value(KeyRecord::new(&scope, &key, &held)).unwrap();
        assert_eq!(
            (&v["state"], &v["held"]),
            (&"in-flight".into(), &"timeout".into())
        );

        let mut resp = StoredResponse::new(201, "hello");
        resp.headers.push(("location".into(), b"/p/1".to_vec()));
        let done = Record {
            fingerprint: Fingerprint::of(b"x"),
            state: RecordState::Completed {
                response: resp,
                expires_at: Millis(0),
            },
        };
        let v = serde_json::to_value(KeyRecord::new(&scope, &key, &done)).unwrap();
        assert_eq!(v["state"], "completed");
        assert!(v["fence"].is_null() && v["lease_until"].is_null());
        assert_eq!(v["expires_at"], "1970-01-01T00:00:00.000Z");
        assert_eq!(
            v["response"],
            serde_json::json!({"status": 201, "body_bytes": 5, "body_omitted": false, "headers": 1})
        );
    }

    #[test]
    fn scopes_by_headers_match_the_layer() {
        let by = ScopeBy::Headers(vec![
            HeaderName::from_static("authorization"),
            HeaderName::from_static("x-api-key"),
        ]);
        let mut h = HeaderMap::new();
        h.append("authorization", HeaderValue::from_static("a"));
        h.append("authorization", HeaderValue::from_static("b"));
        h.append("x-api-key", HeaderValue::from_static("k"));
        let ours =
            scope_of_headers(&["Authorization:a", "X-Api-Key: k ", "authorization:\tb"]).unwrap();
        assert_eq!(ours, by.scope_of(&h));
        for bad in [
            "no-colon",
            "idempotency-key:x",
            "bad name:x",
            "authorization:a\u{7f}",
        ] {
            assert!(scope_of_headers(&[bad]).is_err(), "{bad}");
        }
    }

    #[test]
    fn scope_hashes_and_states_parse() {
        assert_eq!(parse_scope_hash(" anonymous ").unwrap(), Scope::anonymous());
        assert!(parse_scope_hash(&"g".repeat(64)).is_err());
        assert!(parse_scope_hash(&"a".repeat(63)).is_err());
        assert_eq!(parse_state("In-Flight").unwrap(), StateFilter::InFlight);
        assert_eq!(parse_state("completed").unwrap(), StateFilter::Completed);
        assert_eq!(parse_state("any").unwrap(), StateFilter::Any);
        assert!(parse_state("done").is_err());
        assert_eq!(
            ShortScope(&"a".repeat(64)).to_string(),
            format!("{}…", "a".repeat(12))
        );
        assert_eq!(ShortScope("anonymous").to_string(), "anonymous");
    }

    #[tokio::test]
    async fn operations_on_the_memory_store() {
        let store = idem_core::MemoryStore::new();
        let scope = Scope::anonymous();
        let key = IdempotencyKey::new("k").unwrap();
        let t = Duration::from_secs(1);
        assert_eq!(get(&store, &scope, &key, t).await.unwrap(), None);
        assert!(delete(&store, &scope, &key, t).await.unwrap().is_none());
        store
            .begin(&idem_core::BeginRequest {
                scope: scope.clone(),
                key: key.clone(),
                fingerprint: Fingerprint::of(b"f"),
                lease: Duration::from_secs(30),
            })
            .await
            .unwrap();
        let page = list(&store, &ListQuery::default(), t).await.unwrap();
        assert_eq!(page.records.len(), 1);
        assert_eq!(page.records[0].state, STATE_IN_FLIGHT);
        let d = delete(&store, &scope, &key, t).await.unwrap().unwrap();
        assert_eq!(d.record.unwrap().fence, page.records[0].fence);
        assert_eq!(purge(&store, t).await.unwrap().purged, 0);
        let bad = ListQuery {
            limit: 0,
            ..ListQuery::default()
        };
        assert!(matches!(
            list(&store, &bad, t).await,
            Err(KeysError::Store(StoreError::Invalid(_)))
        ));
    }

    /// A store without the listing capability (every method but `admin`
    /// forwarded to a memory store). With `complete_after_get` set, the
    /// next `get` completes that lease right after reading: the holder
    /// finishing between an operator's read and delete.
    #[derive(Debug, Default)]
    struct Unlisted(
        idem_core::MemoryStore,
        std::sync::Mutex<Option<idem_core::Lease>>,
    );

    #[async_trait::async_trait]
    impl Store for Unlisted {
        async fn begin(
            &self,
            req: &idem_core::BeginRequest,
        ) -> Result<idem_core::Begin, StoreError> {
            self.0.begin(req).await
        }
        async fn complete(
            &self,
            lease: &idem_core::Lease,
            response: &StoredResponse,
            ttl: Duration,
        ) -> Result<(), StoreError> {
            self.0.complete(lease, response, ttl).await
        }
        async fn release(&self, lease: &idem_core::Lease) -> Result<(), StoreError> {
            self.0.release(lease).await
        }
        async fn extend(
            &self,
            lease: &idem_core::Lease,
            lease_for: Duration,
        ) -> Result<idem_core::Lease, StoreError> {
            self.0.extend(lease, lease_for).await
        }
        async fn hold(
            &self,
            lease: &idem_core::Lease,
            reason: idem_core::HoldReason,
            hold_for: Duration,
        ) -> Result<idem_core::Lease, StoreError> {
            self.0.hold(lease, reason, hold_for).await
        }
        async fn get(
            &self,
            scope: &Scope,
            key: &IdempotencyKey,
        ) -> Result<Option<Record>, StoreError> {
            let read = self.0.get(scope, key).await;
            let finishing = self.1.lock().unwrap().take();
            if let Some(lease) = finishing {
                let done = StoredResponse::new(201, "charged");
                self.0
                    .complete(&lease, &done, Duration::from_secs(60))
                    .await?;
            }
            read
        }
        async fn delete(&self, scope: &Scope, key: &IdempotencyKey) -> Result<bool, StoreError> {
            self.0.delete(scope, key).await
        }
        async fn purge_expired(&self) -> Result<u64, StoreError> {
            self.0.purge_expired().await
        }
    }

    #[tokio::test]
    async fn a_store_without_listing_says_so_and_still_gets_and_deletes() {
        let store = Unlisted::default();
        let t = Duration::from_secs(1);
        let e = list(&store, &ListQuery::default(), t).await.unwrap_err();
        assert!(matches!(e, KeysError::NoListing), "{e:?}");
        assert!(e.chain().contains("cannot list"), "{}", e.chain());
        let (scope, key) = (Scope::anonymous(), IdempotencyKey::new("k").unwrap());
        assert_eq!(get(&store, &scope, &key, t).await.unwrap(), None);
        assert_eq!(purge(&store, t).await.unwrap().purged, 0);
    }

    /// CASES-style race found from outside: an operator deletes an
    /// in-flight key just as its holder completes. The delete must not
    /// remove the stored result (a retry would run again).
    #[tokio::test]
    async fn a_delete_racing_the_holders_complete_keeps_the_result() {
        let store = Unlisted::default();
        let t = Duration::from_secs(1);
        let (scope, key) = (Scope::anonymous(), IdempotencyKey::new("k").unwrap());
        let idem_core::Begin::Acquired(lease) = store
            .begin(&idem_core::BeginRequest {
                scope: scope.clone(),
                key: key.clone(),
                fingerprint: Fingerprint::of(b"f"),
                lease: Duration::from_secs(30),
            })
            .await
            .unwrap()
        else {
            panic!("not acquired")
        };
        *store.1.lock().unwrap() = Some(lease);
        let e = delete(&store, &scope, &key, t).await.unwrap_err();
        assert!(matches!(e, KeysError::Changed), "{e:?}");
        let kept = store.0.get(&scope, &key).await.unwrap().unwrap();
        assert!(
            matches!(kept.state, RecordState::Completed { .. }),
            "the stored result was deleted: {kept:?}"
        );
        // Asked again, the operator deletes the completed record knowingly.
        let d = delete(&store, &scope, &key, t).await.unwrap().unwrap();
        assert_eq!(d.record.unwrap().state, STATE_COMPLETED);
        assert_eq!(store.0.get(&scope, &key).await.unwrap(), None);
    }

    #[tokio::test(start_paused = true)]
    async fn store_calls_are_bounded() {
        #[derive(Debug)]
        struct Stuck;
        #[async_trait::async_trait]
        impl Store for Stuck {
            async fn begin(
                &self,
                _: &idem_core::BeginRequest,
            ) -> Result<idem_core::Begin, StoreError> {
                std::future::pending().await
            }
            async fn complete(
                &self,
                _: &idem_core::Lease,
                _: &StoredResponse,
                _: Duration,
            ) -> Result<(), StoreError> {
                std::future::pending().await
            }
            async fn release(&self, _: &idem_core::Lease) -> Result<(), StoreError> {
                std::future::pending().await
            }
            async fn extend(
                &self,
                _: &idem_core::Lease,
                _: Duration,
            ) -> Result<idem_core::Lease, StoreError> {
                std::future::pending().await
            }
            async fn hold(
                &self,
                _: &idem_core::Lease,
                _: idem_core::HoldReason,
                _: Duration,
            ) -> Result<idem_core::Lease, StoreError> {
                std::future::pending().await
            }
            async fn get(
                &self,
                _: &Scope,
                _: &IdempotencyKey,
            ) -> Result<Option<Record>, StoreError> {
                std::future::pending().await
            }
            async fn delete(&self, _: &Scope, _: &IdempotencyKey) -> Result<bool, StoreError> {
                std::future::pending().await
            }
            async fn purge_expired(&self) -> Result<u64, StoreError> {
                std::future::pending().await
            }
        }
        let (scope, key) = (Scope::anonymous(), IdempotencyKey::new("k").unwrap());
        let t = Duration::from_millis(200);
        assert!(matches!(
            get(&Stuck, &scope, &key, t).await,
            Err(KeysError::Store(StoreError::Timeout { phase: Phase::Get }))
        ));
        assert!(matches!(
            delete(&Stuck, &scope, &key, t).await,
            Err(KeysError::Store(StoreError::Timeout { .. }))
        ));
        assert!(matches!(
            purge(&Stuck, t).await,
            Err(KeysError::Store(StoreError::Timeout {
                phase: Phase::Purge
            }))
        ));
    }
}
