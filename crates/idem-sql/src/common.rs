//! Pieces the SQL stores share: identifier validation, record decoding,
//! the notification hash, error classification and bounded retries.
#![cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(dead_code))]

use std::future::Future;
use std::time::Duration;

use idem_core::{
    Begin, BeginRequest, Fingerprint, IdempotencyKey, Lease, Phase, Scope, StoreError,
    StoredResponse,
};
use rand::Rng;

use crate::dialect::{error_kind, is_plain_ident, ErrorKind};

/// Record states as stored in the `state` column.
pub(crate) const IN_PROGRESS: i64 = 0;
pub(crate) const COMPLETED: i64 = 1;

/// Longest schema name accepted (PostgreSQL's `NAMEDATALEN - 1`).
#[cfg(feature = "postgres")]
pub(crate) const MAX_SCHEMA_LEN: usize = 63;

/// Longest table name accepted: 63 bytes less the longest suffix the stores
/// derive from it (`_deadline`), so no derived name is ever truncated by the
/// database (PostgreSQL truncates identifiers past 63 bytes silently, which
/// could make two tables share an index or sequence name).
pub(crate) const MAX_TABLE_LEN: usize = 54;

/// How many times a step is tried when the database reports a transient
/// conflict (a deadlock or a serialization failure), and the base pause.
pub(crate) const MAX_ATTEMPTS: u32 = 5;
pub(crate) const BACKOFF_BASE: Duration = Duration::from_millis(5);

/// Records removed per statement by `purge_expired`, so a large purge never
/// holds locks for long.
pub(crate) const PURGE_BATCH: i64 = 1_000;

/// How often a server store's `begin` starts over when the record changed
/// under it (each round is one statement or one short transaction; in
/// practice the second round settles) before it gives up with
/// `Unavailable`.
pub(crate) const SETTLE_ROUNDS: u32 = 10;

/// A pooled connection idle for longer than this is pinged before use
/// (a fresh one is not: that would double the round trips of every step).
pub(crate) const PING_IDLE_AFTER: Duration = Duration::from_secs(10);

/// Checks `name` against `[A-Za-z_][A-Za-z0-9_]{0,max-1}`. Names are always
/// checked before they are quoted into SQL; values are always bound.
pub(crate) fn validate_ident(what: &str, name: &str, max: usize) -> Result<(), StoreError> {
    if is_plain_ident(name, max) {
        Ok(())
    } else {
        Err(StoreError::Config(format!(
            "{what} name {name:?} is not a plain identifier: use 1 to {max} characters of \
             [A-Za-z0-9_], not starting with a digit"
        )))
    }
}

/// 64-bit FNV-1a over the parts, separated by a zero byte.
pub(crate) fn fnv1a(parts: &[&str]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for (i, part) in parts.iter().enumerate() {
        let sep: &[u8] = if i == 0 { &[] } else { &[0] };
        for &b in sep.iter().chain(part.as_bytes()) {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

/// 64-bit FNV-1a over the key, a zero byte and the scope (keys are visible
/// ASCII, so the zero byte separates unambiguously). Used to name a record in
/// notifications and advisory locks: a collision only costs a spurious
/// wake-up or a moment of waiting, never a wrong answer.
#[cfg(feature = "postgres")]
pub(crate) fn record_hash(scope: &str, key: &str) -> u64 {
    fnv1a(&[key, scope])
}

/// 64-bit FNV-1a of a string (for names derived from the table name).
pub(crate) fn name_hash(s: &str) -> u64 {
    fnv1a(&[s])
}

/// The pause before retry `attempt` (1-based): `base` × 2^(attempt-1)
/// (at most × 64), with ±50 % jitter so racing callers spread out.
pub(crate) fn pause(base: Duration, attempt: u32) -> Duration {
    let base = base * 2u32.saturating_pow(attempt.saturating_sub(1)).min(64);
    let jitter = rand::thread_rng().gen_range(0.5..1.5);
    base.mul_f64(jitter)
}

/// [`pause`] from [`BACKOFF_BASE`] (5 ms): 2.5 ms to 480 ms.
pub(crate) fn backoff(attempt: u32) -> Duration {
    pause(BACKOFF_BASE, attempt)
}

/// The one bounded retry loop of this crate: runs `op` at most `attempts`
/// times (at least once) while it fails with an error `retryable` accepts,
/// pausing [`pause`]`(base, n)` before retry `n`. The last error, or the
/// first one `retryable` refuses, is returned as it is.
pub(crate) async fn retry<T, E, F, Fut>(
    attempts: u32,
    base: Duration,
    mut op: F,
    mut retryable: impl FnMut(&E) -> bool,
) -> Result<T, E>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, E>>,
{
    let mut attempt = 1;
    loop {
        match op().await {
            Err(e) if attempt < attempts && retryable(&e) => {
                tracing::debug!(attempt, "transient database error; retrying");
                tokio::time::sleep(pause(base, attempt)).await;
                attempt += 1;
            }
            done => return done,
        }
    }
}

/// `start + d`, saturating: a `d` too long to add (`Duration::MAX`, as a
/// `wait_for_change` max) gives a deadline about 30 years on, which no
/// wait reaches.
pub(crate) fn instant_after(start: tokio::time::Instant, d: Duration) -> tokio::time::Instant {
    const FAR: Duration = Duration::from_secs(30 * 365 * 24 * 3600);
    start.checked_add(d).unwrap_or_else(|| start + FAR.min(d))
}

/// A duration in whole milliseconds as an `i64` for SQL, rounded up (a
/// non-zero duration never becomes 0 ms) and saturating.
pub(crate) fn ms_i64(d: Duration) -> i64 {
    i64::try_from(idem_core::duration_ms(d)).unwrap_or(i64::MAX)
}

/// Longest lease or TTL written, in ms (about 31,700 years): keeps
/// `now + span` far from `i64` overflow in SQL.
pub(crate) const MAX_SPAN_MS: i64 = 1_000_000_000_000_000;

/// A lease or TTL in whole milliseconds for SQL: rounded up, capped at
/// [`MAX_SPAN_MS`].
pub(crate) fn span_ms(d: Duration) -> i64 {
    ms_i64(d).min(MAX_SPAN_MS)
}

/// A `u64` (a fence, a time in ms) as an `i64` for SQL, saturating.
pub(crate) fn to_i64(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// A time in ms read from SQL; negative is taken as 0.
pub(crate) fn millis(v: i64) -> idem_core::Millis {
    idem_core::Millis(u64::try_from(v).unwrap_or(0))
}

/// One record row, undecoded. `deadline` and `now` are milliseconds since
/// the Unix epoch by the database's clock.
#[derive(Debug)]
pub(crate) struct RawRecord {
    pub(crate) fingerprint: Vec<u8>,
    pub(crate) state: i64,
    pub(crate) fence: i64,
    pub(crate) deadline: i64,
    pub(crate) response: Option<Vec<u8>>,
}

impl RawRecord {
    pub(crate) fn fingerprint(&self, phase: Phase) -> Result<Fingerprint, StoreError> {
        <[u8; 32]>::try_from(self.fingerprint.as_slice())
            .map(Fingerprint)
            .map_err(|_| {
                StoreError::corrupt(
                    phase,
                    format!("fingerprint is {} bytes, not 32", self.fingerprint.len()),
                )
            })
    }

    pub(crate) fn fence(&self, phase: Phase) -> Result<u64, StoreError> {
        match u64::try_from(self.fence) {
            Ok(f) if f > 0 => Ok(f),
            _ => Err(StoreError::corrupt(
                phase,
                format!("fence {} is not positive", self.fence),
            )),
        }
    }

    pub(crate) fn until(&self) -> idem_core::Millis {
        millis(self.deadline)
    }

    pub(crate) fn response(&self, phase: Phase) -> Result<StoredResponse, StoreError> {
        let blob = self
            .response
            .as_deref()
            .ok_or_else(|| StoreError::corrupt(phase, "completed record without a response"))?;
        StoredResponse::decode(blob)
            .map_err(|e| StoreError::corrupt(phase, format!("stored response: {e}")))
    }

    /// Why an in-progress record is held: its `response` column holds the
    /// [`HoldReason`](idem_core::HoldReason)'s name once `hold` wrote it
    /// (`NULL` while the claim runs; `begin` clears it on a takeover).
    pub(crate) fn held(&self, phase: Phase) -> Result<Option<idem_core::HoldReason>, StoreError> {
        self.response
            .as_deref()
            .map(|b| {
                idem_core::HoldReason::parse(b).ok_or_else(|| {
                    StoreError::corrupt(phase, "in-progress record with an unknown hold reason")
                })
            })
            .transpose()
    }

    /// Whether the record is live at `now` (in progress before its lease
    /// end, or completed before its expiry).
    pub(crate) fn is_live(&self, now: i64) -> bool {
        self.deadline > now
    }

    /// Whether the record answers `req` instead of being claimed: it is
    /// live, or it is an ended claim (in progress past its lease) of another
    /// request (another fingerprint: 422). An ended claim is taken over only
    /// by the same request, so a different body reusing the key while the
    /// first one's outcome is unknown is refused, as while it is live.
    ///
    /// # Errors
    ///
    /// [`StoreError::Corrupt`] when the stored fingerprint is malformed.
    pub(crate) fn decides(
        &self,
        req: &BeginRequest,
        now: i64,
        phase: Phase,
    ) -> Result<bool, StoreError> {
        Ok(self.is_live(now)
            || (self.state == IN_PROGRESS && self.fingerprint(phase)? != req.fingerprint))
    }

    /// The answer to `begin` from a live record (the caller checked
    /// [`Self::decides`]). `retry_after` is at least 1 ms and at most the
    /// lease asked for: `now` is the database's statement time, and on
    /// MySQL/MariaDB `NOW()` is when the statement *started* — a begin
    /// that started before the winner's and waited on its row lock would
    /// otherwise report a few ms more than a whole lease (seen: 2.002 s
    /// for a 2 s lease).
    pub(crate) fn answer(
        &self,
        req: &BeginRequest,
        now: i64,
        phase: Phase,
    ) -> Result<Begin, StoreError> {
        let same = self.fingerprint(phase)? == req.fingerprint;
        Ok(match self.state {
            IN_PROGRESS if same => {
                self.fence(phase)?;
                Begin::InFlight {
                    retry_after: Duration::from_millis(
                        u64::try_from(self.deadline.saturating_sub(now))
                            .unwrap_or(0)
                            .max(1),
                    )
                    .min(req.lease.max(Duration::from_millis(1))),
                }
            }
            COMPLETED if same => Begin::Replay(self.response(phase)?),
            IN_PROGRESS | COMPLETED => Begin::Mismatch,
            s => {
                return Err(StoreError::corrupt(
                    phase,
                    format!("unknown record state {s}"),
                ))
            }
        })
    }

    /// The record as [`idem_core::Store::get`] reports it (the caller
    /// checked liveness).
    pub(crate) fn to_record(&self, phase: Phase) -> Result<idem_core::Record, StoreError> {
        let fingerprint = self.fingerprint(phase)?;
        let state = match self.state {
            IN_PROGRESS => idem_core::RecordState::InProgress {
                fence: self.fence(phase)?,
                lease_until: self.until(),
                held: self.held(phase)?,
            },
            COMPLETED => idem_core::RecordState::Completed {
                response: self.response(phase)?,
                expires_at: self.until(),
            },
            s => {
                return Err(StoreError::corrupt(
                    phase,
                    format!("unknown record state {s}"),
                ))
            }
        };
        Ok(idem_core::Record { fingerprint, state })
    }
}

/// What a failed database call means for the caller.
#[derive(Debug)]
pub(crate) enum Failure {
    /// A transient conflict (deadlock, serialization failure): the statement
    /// was rolled back and may be tried again.
    Retry(sqlx::Error),
    /// The final error to report.
    Fail(StoreError),
}

/// Maps a store statement's error by its [`ErrorKind`] (never by message
/// text): a deadlock or serialization failure is retried; so is a unique
/// violation in `begin` (its upsert never raises one for the key; should an
/// operator's extra unique index do so, the statement changed nothing and
/// may be repeated); a lock or statement time limit is
/// [`StoreError::Timeout`]; an undecodable row is [`StoreError::Corrupt`];
/// anything else [`StoreError::Unavailable`].
pub(crate) fn classify(phase: Phase, e: sqlx::Error) -> Failure {
    match error_kind(&e) {
        Some(k) if k.is_conflict() => return Failure::Retry(e),
        Some(ErrorKind::UniqueViolation) if phase == Phase::Begin => return Failure::Retry(e),
        Some(k) if k.is_timeout() => return Failure::Fail(StoreError::Timeout { phase }),
        _ => {}
    }
    Failure::Fail(match e {
        sqlx::Error::ColumnDecode { .. }
        | sqlx::Error::Decode(_)
        | sqlx::Error::ColumnNotFound(_)
        | sqlx::Error::ColumnIndexOutOfBounds { .. } => {
            StoreError::corrupt(phase, format!("undecodable row: {e}"))
        }
        e => StoreError::unavailable(phase, e),
    })
}

/// Runs `op` up to [`MAX_ATTEMPTS`] times while it fails with
/// [`Failure::Retry`], pausing with [`backoff`] in between; the last
/// transient error is reported as [`StoreError::Unavailable`].
pub(crate) async fn with_retries<T, F, Fut>(phase: Phase, op: F) -> Result<T, StoreError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, Failure>>,
{
    retry(MAX_ATTEMPTS, BACKOFF_BASE, op, |f| {
        matches!(f, Failure::Retry(_))
    })
    .await
    .map_err(|f| match f {
        Failure::Retry(e) => StoreError::unavailable(phase, e),
        Failure::Fail(e) => e,
    })
}

/// Runs `fut` under an optional client-side deadline; past it the step
/// fails with [`StoreError::Timeout`] (its effect unknown).
pub(crate) async fn limited<T, Fut>(
    limit: Option<Duration>,
    phase: Phase,
    fut: Fut,
) -> Result<T, Failure>
where
    Fut: Future<Output = Result<T, Failure>>,
{
    match limit {
        Some(limit) => tokio::time::timeout(limit, fut)
            .await
            .unwrap_or(Err(Failure::Fail(StoreError::Timeout { phase }))),
        None => fut.await,
    }
}

/// A column of `row` decoded as `T`, or [`StoreError::Corrupt`].
pub(crate) fn column<R, T>(row: &R, name: &str, phase: Phase) -> Result<T, StoreError>
where
    R: sqlx::Row,
    for<'a> &'a str: sqlx::ColumnIndex<R>,
    T: for<'r> sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
{
    row.try_get(name)
        .map_err(|e| StoreError::corrupt(phase, format!("undecodable column: {e}")))
}

/// The database clock a statement read (column `now_ms`), or
/// [`StoreError::Corrupt`].
pub(crate) fn now_of<R>(row: &R, phase: Phase) -> Result<i64, StoreError>
where
    R: sqlx::Row,
    for<'a> &'a str: sqlx::ColumnIndex<R>,
    i64: for<'r> sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
{
    row.try_get("now_ms")
        .map_err(|e| StoreError::corrupt(phase, format!("undecodable clock: {e}")))
}

impl RawRecord {
    /// Decodes the columns `fingerprint`, `state` (stored as `S`: SQLite
    /// `INTEGER`, PostgreSQL `smallint`, MySQL `TINYINT`), `fence`,
    /// `deadline` and `response` of `row`.
    pub(crate) fn from_row<R, S>(row: &R, phase: Phase) -> Result<Self, StoreError>
    where
        R: sqlx::Row,
        for<'a> &'a str: sqlx::ColumnIndex<R>,
        S: Into<i64> + for<'r> sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
        i64: for<'r> sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
        Vec<u8>: for<'r> sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    {
        Ok(Self {
            fingerprint: column(row, "fingerprint", phase)?,
            state: column::<R, S>(row, "state", phase)?.into(),
            fence: column(row, "fence", phase)?,
            deadline: column(row, "deadline", phase)?,
            response: column(row, "response", phase)?,
        })
    }

    /// The fence and the time left on the lease of a live claim (in
    /// progress before its lease end at `now`); `None` otherwise.
    pub(crate) fn live_claim(&self, now: i64) -> Option<(i64, Duration)> {
        (self.state == IN_PROGRESS && self.deadline > now).then(|| {
            (
                self.fence,
                Duration::from_millis(u64::try_from(self.deadline - now).unwrap_or(0)),
            )
        })
    }
}

/// `Ok(())` when a step guarded by the lease's fence matched its row;
/// [`StoreError::LeaseLost`] when it matched none (the fence is no longer
/// current).
pub(crate) fn lease_kept(matched: bool, lease: &Lease) -> Result<(), StoreError> {
    if matched {
        Ok(())
    } else {
        Err(StoreError::LeaseLost { fence: lease.fence })
    }
}

/// A server store's query (scope and key are bound as bytes).
type Query<'q, DB> = sqlx::query::Query<'q, DB, <DB as sqlx::Database>::Arguments<'q>>;

/// Binds a record's `scope` and `key` (as bytes) to `q`.
pub(crate) fn bind_key<'q, DB>(
    q: Query<'q, DB>,
    scope: &'q Scope,
    key: &'q IdempotencyKey,
) -> Query<'q, DB>
where
    DB: sqlx::Database,
    &'q [u8]: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
{
    q.bind(scope.as_str().as_bytes())
        .bind(key.as_str().as_bytes())
}

/// Binds a lease step's guard, its `scope`, `key` (as bytes) and `fence`.
pub(crate) fn bind_lease<'q, DB>(q: Query<'q, DB>, lease: &'q Lease) -> Query<'q, DB>
where
    DB: sqlx::Database,
    &'q [u8]: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    i64: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
{
    bind_key(q, &lease.scope, &lease.key).bind(to_i64(lease.fence))
}

/// Runs `step` (one batch of a purge, answering how many rows it removed)
/// until a batch removes fewer than `batch` rows; the total removed.
pub(crate) async fn in_batches<Fut>(
    batch: i64,
    mut step: impl FnMut() -> Fut,
) -> Result<u64, StoreError>
where
    Fut: Future<Output = Result<u64, StoreError>>,
{
    let mut total = 0;
    loop {
        let n = step().await?;
        total += n;
        if n < u64::try_from(batch).unwrap_or(0) {
            return Ok(total);
        }
    }
}

/// Listing records ([`idem_core::KeyAdmin`]), written once for every
/// dialect: the statement, its bound values, the cursor and the decoding.
///
/// Order: newest claim first, by `fence` — every fence is drawn from one
/// store-wide counter (SQLite `idem_fence`, a PostgreSQL sequence, a MySQL
/// `AUTO_INCREMENT`), so it is unique and grows with the claim time; a
/// completed record keeps the fence of its claim. Keyset pagination: the
/// cursor holds the last fence listed and the next page asks for
/// `fence < it`, never an `OFFSET`. A record present for the whole listing
/// keeps its fence and is listed exactly once; one taken over meanwhile
/// gets a larger fence and may be missed (it is a new claim).
pub(crate) mod list {
    use idem_core::admin::{ListPage, ListQuery, ListedRecord, StateFilter};
    use idem_core::{IdempotencyKey, Phase, Scope, StoreError};

    use super::{column, fnv1a, Query, RawRecord};
    use crate::dialect::Dialect;

    /// The cursor's text: `sql1-<fence, 16 hex>-<filter tag, 8 hex>`.
    const CURSOR_PREFIX: &str = "sql1-";

    /// A page statement: the SQL and where its values go. Values are bound
    /// in this order by [`bind`]: the time (SQLite only), the scope, the
    /// cursor's fence, the row limit.
    #[derive(Debug)]
    pub(crate) struct Statement {
        pub(crate) sql: String,
        scope: Option<Scope>,
        after: Option<i64>,
        rows: i64,
    }

    /// What ties a cursor to one listing: the table and the filters, so a
    /// cursor handed to another table, state or scope is refused.
    fn tag(records: &str, query: &ListQuery) -> u32 {
        let state = match query.state {
            StateFilter::Any => "any",
            StateFilter::InFlight => "in-flight",
            StateFilter::Completed => "completed",
        };
        let scope = query.scope.as_ref().map_or("\u{1}every", Scope::as_str);
        (fnv1a(&[records, state, scope]) >> 32) as u32
    }

    /// The cursor after a page whose last record has `fence`.
    fn cursor(fence: i64, tag: u32) -> String {
        format!("{CURSOR_PREFIX}{fence:016x}-{tag:08x}")
    }

    /// The fence a cursor made by [`cursor`] holds.
    ///
    /// # Errors
    /// [`StoreError::Invalid`] for any other text, or a cursor of another
    /// listing (table, state filter or scope).
    fn parse_cursor(text: &str, tag: u32) -> Result<i64, StoreError> {
        let bad = || {
            StoreError::Invalid(format!(
                "cursor {text:?} was not made by this store's listing"
            ))
        };
        let rest = text.strip_prefix(CURSOR_PREFIX).ok_or_else(bad)?;
        let (fence, t) = rest.split_once('-').ok_or_else(bad)?;
        let hex = |s: &str, len: usize| {
            (s.len() == len && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')))
                .then(|| u64::from_str_radix(s, 16).ok())
                .flatten()
        };
        let fence = hex(fence, 16)
            .and_then(|f| i64::try_from(f).ok())
            .filter(|f| *f > 0)
            .ok_or_else(bad)?;
        if hex(t, 8) != Some(u64::from(tag)) {
            return Err(StoreError::Invalid(format!(
                "cursor {text:?} belongs to another listing (other table, state or scope)"
            )));
        }
        Ok(fence)
    }

    /// The statement of one page of `query` over `records` (quoted).
    /// `bound_now`: the store binds its own clock (SQLite's injectable
    /// [`idem_core::Clock`]); otherwise the database's clock is read
    /// ([`Dialect::stable_now_ms`]). One more row than the limit is asked
    /// for, to tell whether a next page exists.
    ///
    /// # Errors
    /// [`StoreError::Invalid`] for a bad limit or cursor.
    pub(crate) fn statement(
        d: Dialect,
        records: &str,
        bound_now: bool,
        query: &ListQuery,
    ) -> Result<Statement, StoreError> {
        query.validate()?;
        let after = query
            .cursor
            .as_deref()
            .map(|c| parse_cursor(c, tag(records, query)))
            .transpose()?;
        let mut n = 0;
        let mut next = || {
            n += 1;
            d.param(n)
        };
        let now = if bound_now {
            next()
        } else {
            d.stable_now_ms().to_owned()
        };
        let mut cond = vec![match query.state {
            StateFilter::Any => format!("(state = 0 OR deadline > {now})"),
            StateFilter::InFlight => "state = 0".to_owned(),
            StateFilter::Completed => format!("state = 1 AND deadline > {now}"),
        }];
        if query.scope.is_some() {
            cond.push(format!("scope = {}", next()));
        }
        if after.is_some() {
            cond.push(format!("fence < {}", next()));
        }
        let key = d.quote("key");
        let sql = format!(
            "SELECT scope, {key}, fingerprint, state, fence, deadline, response, {now} AS now_ms \
             FROM {records} WHERE {} ORDER BY fence DESC LIMIT {}",
            cond.join(" AND "),
            next()
        );
        Ok(Statement {
            sql,
            scope: query.scope.clone(),
            after,
            rows: i64::try_from(query.limit)
                .unwrap_or(i64::MAX)
                .saturating_add(1),
        })
    }

    /// Binds `st`'s values to `q` (made from `st.sql`): `now` when the
    /// store binds its clock, the scope (as text on SQLite, whose columns
    /// are `TEXT`; as bytes elsewhere), the cursor's fence, the row limit.
    pub(crate) fn bind<'q, DB>(
        d: Dialect,
        st: &'q Statement,
        now: Option<i64>,
        mut q: Query<'q, DB>,
    ) -> Query<'q, DB>
    where
        DB: sqlx::Database,
        &'q [u8]: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
        &'q str: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
        i64: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    {
        if let Some(now) = now {
            q = q.bind(now);
        }
        if let Some(scope) = &st.scope {
            q = if d == Dialect::Sqlite {
                q.bind(scope.as_str())
            } else {
                q.bind(scope.as_str().as_bytes())
            };
        }
        if let Some(after) = st.after {
            q = q.bind(after);
        }
        q.bind(st.rows)
    }

    /// The page from the rows of `st` (state column stored as `S`, see
    /// [`RawRecord::from_row`]), and the cursor of the next one.
    ///
    /// # Errors
    /// [`StoreError::Corrupt`] for an undecodable row (also a scope or key
    /// that is not valid).
    pub(crate) fn page<R, S>(
        records: &str,
        query: &ListQuery,
        rows: &[R],
    ) -> Result<ListPage, StoreError>
    where
        R: sqlx::Row,
        for<'a> &'a str: sqlx::ColumnIndex<R>,
        S: Into<i64> + for<'r> sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
        i64: for<'r> sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
        Vec<u8>: for<'r> sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    {
        const P: Phase = Phase::List;
        let text = |name: &str, row: &R| -> Result<String, StoreError> {
            String::from_utf8(column::<R, Vec<u8>>(row, name, P)?)
                .map_err(|_| StoreError::corrupt(P, format!("{name} is not UTF-8")))
        };
        let mut records_out = Vec::with_capacity(rows.len().min(query.limit));
        let mut last = None;
        for row in rows.iter().take(query.limit) {
            let raw = RawRecord::from_row::<R, S>(row, P)?;
            let scope = Scope::new(text("scope", row)?)
                .map_err(|e| StoreError::corrupt(P, format!("stored scope: {e}")))?;
            let key = IdempotencyKey::new(text("key", row)?)
                .map_err(|e| StoreError::corrupt(P, format!("stored key: {e}")))?;
            last = Some(raw.fence);
            records_out.push(ListedRecord {
                scope,
                key,
                record: raw.to_record(P)?,
            });
        }
        let next = match last {
            Some(fence) if rows.len() > query.limit => Some(cursor(fence, tag(records, query))),
            _ => None,
        };
        Ok(ListPage {
            records: records_out,
            next,
        })
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn cursors_round_trip_and_refuse_strangers() {
            let q = ListQuery::default();
            let t = tag("t", &q);
            assert_eq!(parse_cursor(&cursor(42, t), t).expect("ours"), 42);
            let other_scope = ListQuery {
                scope: Some(Scope::new("tenant").expect("scope")),
                ..ListQuery::default()
            };
            assert_ne!(tag("t", &other_scope), t);
            assert_ne!(tag("u", &q), t);
            for bad in [
                "",
                "sql1-",
                "sql1-000000000000002a",
                "sql1-000000000000002a-",
                "sql1-000000000000002A-00000000",
                "sql1-0000000000000000-00000000",
                "sql1-800000000000002a-00000000",
                "sql1-2a-00000000",
                "redis1-x",
                "sql1-000000000000002a-000000000",
            ] {
                assert!(
                    matches!(parse_cursor(bad, t), Err(StoreError::Invalid(_))),
                    "{bad:?}"
                );
            }
            assert!(matches!(
                parse_cursor(&cursor(42, tag("t", &other_scope)), t),
                Err(StoreError::Invalid(_))
            ));
        }

        #[test]
        fn statement_shapes() {
            let q = ListQuery {
                state: StateFilter::Completed,
                scope: Some(Scope::new("s").expect("scope")),
                limit: 7,
                cursor: None,
            };
            let st = statement(Dialect::Sqlite, "\"idem_records\"", true, &q).expect("sql");
            assert_eq!(
                st.sql,
                "SELECT scope, \"key\", fingerprint, state, fence, deadline, response, ?1 AS now_ms \
                 FROM \"idem_records\" WHERE state = 1 AND deadline > ?1 AND scope = ?2 \
                 ORDER BY fence DESC LIMIT ?3"
            );
            assert_eq!(st.rows, 8);
            let paged = ListQuery {
                cursor: Some(cursor(9, tag("\"idem_records\"", &q))),
                ..q.clone()
            };
            let st = statement(Dialect::Sqlite, "\"idem_records\"", true, &paged).expect("sql");
            assert!(
                st.sql
                    .contains("AND fence < ?3 ORDER BY fence DESC LIMIT ?4"),
                "{}",
                st.sql
            );
            for limit in [0, idem_core::admin::MAX_LIST_LIMIT + 1] {
                let q = ListQuery {
                    limit,
                    ..ListQuery::default()
                };
                assert!(matches!(
                    statement(Dialect::Sqlite, "t", true, &q),
                    Err(StoreError::Invalid(_))
                ));
            }
        }
    }
}

/// Checks that a server URL has one of `schemes` (compared without case).
///
/// # Errors
/// [`StoreError::Config`] with `hint`.
pub(crate) fn check_scheme(url: &str, schemes: &[&str], hint: &str) -> Result<(), StoreError> {
    let scheme = url.split_once("://").map(|(s, _)| s.to_ascii_lowercase());
    if scheme.is_some_and(|s| schemes.contains(&s.as_str())) {
        Ok(())
    } else {
        Err(StoreError::Config(hint.to_owned()))
    }
}

/// Opens a server store's first, direct connection within `timeout`: it
/// fails fast (a pool would retry a refused connection until its acquire
/// timeout and report only "timed out"), and it runs the migrations.
pub(crate) async fn connect_first<C>(
    timeout: Duration,
    server: &str,
    connect: impl Future<Output = Result<C, sqlx::Error>>,
) -> Result<C, StoreError> {
    match tokio::time::timeout(timeout, connect).await {
        Ok(Ok(c)) => Ok(c),
        Ok(Err(e)) => Err(StoreError::unavailable(Phase::Connect, e)),
        Err(_) => Err(StoreError::unavailable(
            Phase::Connect,
            format!("no connection to {server} within {timeout:?}"),
        )),
    }
}

/// A connection of `pool` for creating or checking the schema.
///
/// # Errors
/// [`StoreError::Unavailable`] (phase `Connect`).
pub(crate) async fn setup_connection<DB: sqlx::Database>(
    pool: &sqlx::Pool<DB>,
) -> Result<sqlx::pool::PoolConnection<DB>, StoreError> {
    pool.acquire()
        .await
        .map_err(|e| StoreError::unavailable(Phase::Connect, e))
}

/// The pool settings of a server store: `max_connections` (at least 1),
/// `acquire_timeout`, and a ping before handing out a connection idle for
/// more than [`PING_IDLE_AFTER`] (not before every use: that would double
/// the round trips of every step).
pub(crate) fn pool_options<DB: sqlx::Database>(
    max_connections: u32,
    acquire_timeout: Duration,
) -> sqlx::pool::PoolOptions<DB> {
    sqlx::pool::PoolOptions::new()
        .max_connections(max_connections.max(1))
        .acquire_timeout(acquire_timeout)
        .test_before_acquire(false)
        .before_acquire(|conn, meta| {
            Box::pin(async move {
                if meta.idle_for > PING_IDLE_AFTER {
                    sqlx::Connection::ping(conn).await?;
                }
                Ok(true)
            })
        })
}

/// Compares an existing table's columns (`found`: name and type as the
/// catalog reports them) with the ones a store needs; `Ok(false)` when
/// nothing was found (no table).
///
/// # Errors
/// [`StoreError::Config`] naming the missing columns of `table`.
pub(crate) fn check_columns(
    found: &[(String, String)],
    needed: &[(&str, &str)],
    table: &str,
) -> Result<bool, StoreError> {
    if found.is_empty() {
        return Ok(false);
    }
    let wrong: Vec<String> = needed
        .iter()
        .filter(|(name, ty)| !found.iter().any(|(n, t)| n == name && t == ty))
        .map(|(name, ty)| format!("{name} {ty}"))
        .collect();
    if wrong.is_empty() {
        Ok(true)
    } else {
        Err(StoreError::Config(format!(
            "table {table} exists but is not an idem table: it lacks {}",
            wrong.join(", ")
        )))
    }
}

/// Polls `claim` every `interval` until it no longer reports the claim
/// `fence` (completed, released, taken over, past its lease) or `until`.
pub(crate) async fn poll_while_claimed<Fut>(
    until: tokio::time::Instant,
    interval: Duration,
    fence: i64,
    mut claim: impl FnMut() -> Fut,
) -> Result<(), StoreError>
where
    Fut: Future<Output = Result<Option<i64>, StoreError>>,
{
    loop {
        let now = tokio::time::Instant::now();
        if now >= until {
            return Ok(());
        }
        tokio::time::sleep((until - now).min(interval)).await;
        if claim().await? != Some(fence) {
            return Ok(());
        }
    }
}

/// The `with_*` setters the stores' option structs share, one per field
/// named (each sets the field of that name, with the bounds its doc says).
macro_rules! option_setters {
    ($($field:ident),* $(,)?) => { $( $crate::common::option_setters!(@ $field); )* };
    (@ table) => {
        /// Sets [`Self::table`] (validated when the store connects).
        pub fn with_table(mut self, table: impl Into<String>) -> Self {
            self.table = table.into();
            self
        }
    };
    (@ max_connections) => {
        /// Sets [`Self::max_connections`] (0 is taken as 1).
        pub fn with_max_connections(mut self, n: u32) -> Self {
            self.max_connections = n.max(1);
            self
        }
    };
    (@ acquire_timeout) => {
        /// Sets [`Self::acquire_timeout`].
        pub fn with_acquire_timeout(mut self, d: std::time::Duration) -> Self {
            self.acquire_timeout = d;
            self
        }
    };
    (@ connect_timeout) => {
        /// Sets [`Self::connect_timeout`].
        pub fn with_connect_timeout(mut self, d: std::time::Duration) -> Self {
            self.connect_timeout = d;
            self
        }
    };
    (@ statement_timeout) => {
        /// Sets [`Self::statement_timeout`] (`None`: the server's setting).
        pub fn with_statement_timeout(mut self, d: Option<std::time::Duration>) -> Self {
            self.statement_timeout = d;
            self
        }
    };
    (@ migrate) => {
        /// Sets [`Self::migrate`].
        pub fn with_migrate(mut self, migrate: bool) -> Self {
            self.migrate = migrate;
            self
        }
    };
    (@ poll_interval) => {
        /// Sets [`Self::poll_interval`] (at least 1 ms).
        pub fn with_poll_interval(mut self, d: std::time::Duration) -> Self {
            self.poll_interval = d.max(std::time::Duration::from_millis(1));
            self
        }
    };
}
pub(crate) use option_setters;

/// `Debug` for a store's option struct whose `url` field is a `String`:
/// every field as `#[derive(Debug)]` would print it, but the URL's
/// password as `***` ([`idem_core::url::redact`]). Lists every other
/// field by name; a field left out does not compile.
#[cfg(any(feature = "postgres", feature = "mysql"))]
macro_rules! debug_redacting_url {
    ($ty:ident { $($field:ident),* $(,)? }) => {
        impl std::fmt::Debug for $ty {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                let $ty { url, $($field),* } = self;
                f.debug_struct(stringify!($ty))
                    .field("url", &idem_core::url::redact(url))
                    $(.field(stringify!($field), $field))*
                    .finish()
            }
        }
    };
}
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) use debug_redacting_url;

#[cfg(test)]
mod tests {
    use super::*;

    /// The option structs made with [`debug_redacting_url!`] show their
    /// URL with the password as `***`, their other fields as derived, and
    /// keep the URL itself whole.
    #[cfg(any(feature = "postgres", feature = "mysql"))]
    #[test]
    fn option_debug_redacts_the_url_password() {
        let cases = [
            #[cfg(feature = "postgres")]
            {
                let url = "postgres://idem:s3cret@db.internal:5432/app?sslmode=require";
                let o = crate::PostgresOptions::new(url);
                ("PostgresOptions", format!("{o:?}"), url, o.url)
            },
            #[cfg(feature = "mysql")]
            {
                let url = "mysql://idem:s3cret@db.internal:3306/app";
                let o = crate::MySqlOptions::new(url);
                ("MySqlOptions", format!("{o:?}"), url, o.url)
            },
        ];
        for (name, shown, given, kept) in cases {
            assert!(!shown.contains("s3cret"), "{shown}");
            let head = format!("{name} {{ url: {:?}, ", given.replace("s3cret", "***"));
            assert!(shown.starts_with(&head), "{shown}");
            assert!(shown.contains(", max_connections: 16, "), "{shown}");
            assert_eq!(kept, given, "the URL itself is kept whole");
        }
    }

    #[test]
    fn identifiers() {
        for ok in ["idem_records", "_x", "A1", &"a".repeat(54)] {
            assert!(validate_ident("table", ok, MAX_TABLE_LEN).is_ok(), "{ok}");
        }
        for bad in [
            "",
            "1abc",
            "a-b",
            "a b",
            "a;drop",
            "a\"b",
            "a`b",
            "é",
            "a.b",
            &"a".repeat(55),
        ] {
            assert!(
                matches!(
                    validate_ident("table", bad, MAX_TABLE_LEN),
                    Err(StoreError::Config(_))
                ),
                "{bad:?}"
            );
        }
        #[cfg(feature = "postgres")]
        assert!(validate_ident("schema", &"s".repeat(63), MAX_SCHEMA_LEN).is_ok());
    }

    #[test]
    #[cfg(feature = "postgres")]
    fn record_hash_separates_key_and_scope() {
        assert_ne!(record_hash("ab", "c"), record_hash("a", "bc"));
        assert_ne!(record_hash("", "k"), record_hash("k", ""));
        assert_eq!(record_hash("s", "k"), record_hash("s", "k"));
    }

    #[test]
    fn backoff_grows_and_is_bounded() {
        for attempt in 1..=10 {
            let d = backoff(attempt);
            assert!(d >= Duration::from_micros(2500) && d <= Duration::from_millis(480));
        }
    }
}

/// Compile-time check: every store's constructor futures are `Send`, so a
/// store can be built inside `tokio::spawn` (this module fails to compile
/// otherwise).
#[cfg(test)]
#[allow(dead_code)]
mod send_check {
    fn assert_send<T: Send>(_: T) {}

    fn sqlite_constructor_futures_are_send(pool: sqlx::SqlitePool) {
        assert_send(crate::SqliteStore::from_pool(pool));
        assert_send(crate::SqliteStore::open(""));
    }

    #[cfg(feature = "postgres")]
    fn postgres_constructor_futures_are_send(pool: sqlx::PgPool) {
        assert_send(crate::PostgresStore::from_pool(pool));
        assert_send(crate::PostgresStore::connect_with(
            crate::PostgresOptions::new(""),
        ));
    }

    #[cfg(feature = "mysql")]
    fn mysql_constructor_futures_are_send(pool: sqlx::MySqlPool) {
        assert_send(crate::MySqlStore::from_pool(pool));
        assert_send(crate::MySqlStore::connect(""));
    }
}
