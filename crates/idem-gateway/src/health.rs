//! Health probes: `GET /_idem/live`, `GET /_idem/ready` and
//! `GET /_idem/health` (an alias of ready), on the public listener and on
//! the admin listener (see `docs/HEALTH.md`).
//!
//! - **live** answers 200 `{"status":"ok"}` whenever the process serves
//!   HTTP. It never calls the store: a store outage must not make a
//!   supervisor restart a gateway that would recover by itself.
//! - **ready** answers 200 `{"status":"ok","store":"<kind>"}` when the
//!   store accepts a write, else 503 `application/problem+json` with the
//!   reason. The check is a *canary*: `begin` on the reserved scope `_idem`
//!   and the key `_idem-ready-<instance id>` (a random id per process, so
//!   two gateways on one store never touch each other's canary), then
//!   `release` of that claim by its fence. Every store deletes a released
//!   record, so nothing is left behind (Redis keeps the key's fence counter
//!   until it expires by itself, `lease + keep_expired` later; the SQL
//!   stores' fence is one store-wide row). A canary left in flight by an
//!   earlier check that failed half way is deleted by the next one (a
//!   write as well). The whole check is bounded by [`READY_TIMEOUT`];
//!   its result is kept for at most [`READY_CACHE`], and concurrent probes
//!   share one check (single flight), so a probe storm costs the store at
//!   most two calls a second.
//! - With a SQLite store, ready also checks that the database file the
//!   gateway opened is still the one at its path: a deleted or replaced
//!   file is not noticed by SQLite (open connections keep writing into the
//!   deleted inode, and those writes vanish at the next restart), so it
//!   answers 503 `file-deleted` until the gateway is restarted.

use std::hash::{BuildHasher, Hasher};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use idem_core::{Begin, BeginRequest, DynStore, Fingerprint, IdempotencyKey, Scope, StoreError};
use idem_http::{BoxBody, Problem};
use tokio::sync::Mutex;
use tokio::time::Instant;

use crate::proxy::error_chain;

/// The liveness probe: 200 while the process serves.
pub(crate) const LIVE_PATH: &str = "/_idem/live";
/// The readiness probe: 200 when the store accepts a write.
pub(crate) const READY_PATH: &str = "/_idem/ready";
/// The older name of the readiness probe (same answers).
pub(crate) const HEALTH_PATH: &str = "/_idem/health";

/// The longest a readiness check takes (the canary's `begin` and
/// `release` together); a slower store is reported as `timeout`.
pub(crate) const READY_TIMEOUT: Duration = Duration::from_secs(2);

/// How long a readiness result is reused: probes within this time of the
/// last check get its answer without calling the store.
pub(crate) const READY_CACHE: Duration = Duration::from_secs(1);

/// The lease of the canary claim: if its `release` fails, the record
/// stays in flight at most this long (the next check deletes it sooner).
const CANARY_LEASE: Duration = Duration::from_secs(10);

/// The scope of every canary (a scope a client's headers never hash to:
/// hashed scopes are 64 hex digits).
const CANARY_SCOPE: &str = "_idem";

/// Why the store is not ready (the `reason` member of the 503 problem).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reason {
    /// The store could not be reached or answered with an error.
    Unavailable,
    /// The check did not finish within [`READY_TIMEOUT`].
    Timeout,
    /// The store refuses writes (a read-only file, database or replica).
    ReadOnly,
    /// The disk under the store is full.
    DiskFull,
    /// A capped store (`memory://?idem_max_records=N`, Redis `maxmemory`)
    /// is at its cap.
    Full,
    /// The canary record could not be decoded.
    Corrupt,
    /// The SQLite file the gateway opened was deleted or replaced.
    FileDeleted,
}

impl Reason {
    /// The `reason` member of the 503 problem.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Reason::Unavailable => "unavailable",
            Reason::Timeout => "timeout",
            Reason::ReadOnly => "read-only",
            Reason::DiskFull => "disk-full",
            Reason::Full => "full",
            Reason::Corrupt => "corrupt",
            Reason::FileDeleted => "file-deleted",
        }
    }

    /// The problem kind (`urn:idem:problem:<kind>`): `store-full` when no
    /// room is left, else `store-unavailable`.
    fn problem_kind(self) -> &'static str {
        match self {
            Reason::Full | Reason::DiskFull => "store-full",
            _ => "store-unavailable",
        }
    }

    /// Reads a store error: its kind first, then (for the backend's
    /// own errors) its message, which is how read-only and disk-full
    /// conditions are told apart from an outage. The message is always
    /// shown in `detail` as well.
    fn of(e: &StoreError) -> Reason {
        match e {
            StoreError::Full { .. } => Reason::Full,
            StoreError::Timeout { .. } => Reason::Timeout,
            StoreError::Corrupt { .. } => Reason::Corrupt,
            _ => {
                let text = error_chain(e).to_ascii_lowercase();
                let has = |words: &[&str]| words.iter().any(|w| text.contains(w));
                if has(&["readonly", "read-only", "read only", "permission denied"]) {
                    Reason::ReadOnly
                } else if has(&[
                    "disk is full",
                    "disk full",
                    "no space left",
                    "could not extend file",
                    "table is full",
                ]) {
                    Reason::DiskFull
                } else if has(&["oom command not allowed", "maxmemory"]) {
                    Reason::Full
                } else {
                    Reason::Unavailable
                }
            }
        }
    }
}

/// The answer of one readiness check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Readiness {
    /// The store accepted the canary write.
    Ready,
    /// It did not.
    NotReady {
        /// Why, in one word.
        reason: Reason,
        /// The store's own message.
        detail: String,
    },
}

/// The readiness check of one gateway process, shared by both listeners.
#[derive(Debug)]
pub(crate) struct Health {
    store: DynStore,
    kind: &'static str,
    scope: Scope,
    /// `_idem-ready-<16 hex digits>`, random per process.
    canary: IdempotencyKey,
    /// The SQLite file and its identity when the check started.
    file: Option<FileIdentity>,
    /// The last result and when it was taken; the lock is held while a
    /// check runs (the single flight).
    last: Arc<Mutex<Option<(Instant, Readiness)>>>,
}

impl Health {
    /// The check of `store` (of `kind`, opened from `store_url`).
    pub(crate) fn new(store: DynStore, kind: &'static str, store_url: &str) -> Arc<Self> {
        let scope = Scope::new(CANARY_SCOPE).unwrap_or_else(|_| Scope::anonymous());
        let id = instance_id();
        let canary = IdempotencyKey::new(format!("_idem-ready-{id}"))
            .unwrap_or_else(|_| IdempotencyKey::new("_idem-ready").expect("a valid key"));
        Arc::new(Self {
            store,
            kind,
            scope,
            canary,
            file: (kind == "sqlite")
                .then(|| sqlite_path(store_url))
                .flatten()
                .and_then(FileIdentity::now),
            last: Arc::new(Mutex::new(None)),
        })
    }

    /// The store's kind (`sqlite`, `redis`, …).
    pub(crate) fn kind(&self) -> &'static str {
        self.kind
    }

    /// The canary's key (for tests and logs).
    #[cfg(test)]
    pub(crate) fn canary(&self) -> &IdempotencyKey {
        &self.canary
    }

    /// Whether the store accepts a write: the last result when it is at
    /// most [`READY_CACHE`] old, else a new check. Callers that arrive
    /// while a check runs wait for it and share its result. The check runs
    /// on a task of its own: a probe that gives up does not cut it short.
    pub(crate) async fn readiness(self: &Arc<Self>) -> Readiness {
        let mut last = self.last.clone().lock_owned().await;
        if let Some((at, r)) = last.as_ref() {
            if at.elapsed() < READY_CACHE {
                return r.clone();
            }
        }
        let me = self.clone();
        let check = tokio::spawn(async move {
            let r = me.check().await;
            me.log_change(last.as_ref().map(|(_, r)| r), &r);
            *last = Some((Instant::now(), r.clone()));
            r
        });
        check.await.unwrap_or_else(|e| Readiness::NotReady {
            reason: Reason::Unavailable,
            detail: format!("the readiness check failed: {e}"),
        })
    }

    /// One check, uncached.
    async fn check(&self) -> Readiness {
        if let Some(file) = &self.file {
            if let Err(detail) = file.still_there() {
                return Readiness::NotReady {
                    reason: Reason::FileDeleted,
                    detail,
                };
            }
        }
        match tokio::time::timeout(READY_TIMEOUT, self.canary_write()).await {
            Ok(Ok(())) => Readiness::Ready,
            Ok(Err(e)) => Readiness::NotReady {
                reason: Reason::of(&e),
                detail: error_chain(&e),
            },
            Err(_) => Readiness::NotReady {
                reason: Reason::Timeout,
                detail: format!(
                    "the store did not take a write within {}",
                    humantime::format_duration(READY_TIMEOUT)
                ),
            },
        }
    }

    /// Claims the canary key and releases it again.
    async fn canary_write(&self) -> Result<(), StoreError> {
        let req = BeginRequest {
            scope: self.scope.clone(),
            key: self.canary.clone(),
            fingerprint: Fingerprint::of(b"idem readiness canary"),
            lease: CANARY_LEASE,
        };
        match self.store.begin(&req).await? {
            Begin::Acquired(lease) => match self.store.release(&lease).await {
                // Lost: an overlapping check deleted it; the claim was written.
                Ok(()) | Err(StoreError::LeaseLost { .. }) => Ok(()),
                Err(e) => Err(e),
            },
            // An earlier check's canary that was not released: deleting
            // it is a write too, and leaves nothing behind.
            Begin::InFlight { .. } | Begin::Replay(_) | Begin::Mismatch => self
                .store
                .delete(&self.scope, &self.canary)
                .await
                .map(|_| ()),
        }
    }

    /// Logs a change of readiness (not every failing probe).
    fn log_change(&self, before: Option<&Readiness>, now: &Readiness) {
        match (before, now) {
            (Some(b), n) if b == n => {}
            (_, Readiness::NotReady { reason, detail }) => tracing::warn!(
                store = self.kind,
                reason = reason.as_str(),
                error = %detail,
                "not ready: the store does not accept writes"
            ),
            (Some(Readiness::NotReady { .. }), Readiness::Ready) => {
                tracing::info!(store = self.kind, "ready again: the store accepts writes");
            }
            (_, Readiness::Ready) => {}
        }
    }
}

/// Who asks a probe: what a 503 may say.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Audience {
    /// The client port: the reason word only (the store's own message can
    /// name files, hosts and tables).
    Public,
    /// The admin port: the reason and the store's message.
    Operator,
}

/// The answer to `GET`/`HEAD` of a probe path (`/_idem/live`,
/// `/_idem/ready`, `/_idem/health`), or `None` for any other path.
pub(crate) async fn respond<B>(
    req: &Request<B>,
    health: &Arc<Health>,
    audience: Audience,
) -> Option<Response<BoxBody>> {
    let path = req.uri().path();
    let ready = match path {
        LIVE_PATH => false,
        READY_PATH | HEALTH_PATH => true,
        _ => return None,
    };
    if req.method() != Method::GET && req.method() != Method::HEAD {
        let mut resp = Problem::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "method-not-allowed",
            format!("{path} answers GET and HEAD"),
        )
        .into_response();
        resp.headers_mut()
            .insert(header::ALLOW, HeaderValue::from_static("GET, HEAD"));
        return Some(resp);
    }
    if !ready {
        return Some(json(StatusCode::OK, &serde_json::json!({ "status": "ok" })));
    }
    let kind = health.kind();
    Some(match health.readiness().await {
        Readiness::Ready => json(
            StatusCode::OK,
            &serde_json::json!({ "status": "ok", "store": kind }),
        ),
        Readiness::NotReady { reason, detail } => Problem::new(
            StatusCode::SERVICE_UNAVAILABLE,
            reason.problem_kind(),
            match audience {
                Audience::Operator => format!(
                    "the {kind} store does not accept writes ({}): {detail}",
                    reason.as_str()
                ),
                Audience::Public => format!(
                    "the {kind} store does not accept writes ({}); the store's message is in \
                     the gateway's log and on its admin listener",
                    reason.as_str()
                ),
            },
        )
        .with_member("store", kind)
        .with_member("reason", reason.as_str())
        .into_response(),
    })
}

/// Logs what a Redis store persists, with a WARN when a Redis restart
/// (or a machine crash) would forget completed keys, which then run again
/// (no AOF and no RDB, RDB only, `appendfsync no`), or when it cannot be
/// read (`CONFIG` disabled, as on managed Redis). Opens a connection of
/// its own for the check, bounded by `options.timeout`; other store URLs
/// are left alone.
#[cfg(feature = "redis")]
pub(crate) async fn log_redis_persistence(url: &str, options: &crate::StoreOptions) {
    let Ok(u) = idem_redis::RedisUrl::parse(url) else {
        return;
    };
    let o = u
        .options
        .with_connection_timeout(options.timeout)
        .with_response_timeout(options.timeout);
    match idem_redis::check_persistence(u.url.expose(), &o).await {
        Ok(p) => match p.warning() {
            Some(w) => tracing::warn!(redis_persistence = %p, "{w}"),
            None => tracing::info!(redis_persistence = %p, "Redis persists completed keys"),
        },
        Err(e) => tracing::warn!(
            error = %error_chain(&e),
            "Redis persistence could not be checked: make sure the server runs with \
             `appendonly yes` (and `appendfsync everysec` or `always`), or a restart forgets \
             completed keys and their retries run again"
        ),
    }
}

/// An `application/json` answer that is never cached.
fn json(status: StatusCode, value: &serde_json::Value) -> Response<BoxBody> {
    let mut resp = Response::new(idem_http::full(value.to_string()));
    *resp.status_mut() = status;
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    resp
}

/// 16 hex digits, random per process (the standard library's randomly
/// seeded hasher, mixed with the process id and the time).
fn instance_id() -> String {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    if let Ok(t) = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
        h.write_u128(t.as_nanos());
    }
    format!("{:016x}", h.finish())
}

/// The database file of a `sqlite:` URL or plain path; `None` for an
/// in-memory database.
fn sqlite_path(url: &str) -> Option<PathBuf> {
    let s = url.trim();
    let file = match s.strip_prefix("sqlite:") {
        Some(rest) => {
            let rest = rest.strip_prefix("//").unwrap_or(rest);
            if rest.contains("mode=memory") {
                return None;
            }
            rest.split('?').next().unwrap_or_default()
        }
        None => s,
    };
    if file.is_empty() || file == ":memory:" {
        return None;
    }
    Some(PathBuf::from(file))
}

/// A file and what identified it when the gateway started.
#[derive(Debug)]
struct FileIdentity {
    path: PathBuf,
    #[cfg(unix)]
    id: (u64, u64),
}

impl FileIdentity {
    /// The file at `path` now; `None` when it cannot be read (the check
    /// is then left out).
    fn now(path: PathBuf) -> Option<Self> {
        let path = std::fs::canonicalize(&path).unwrap_or(path);
        let meta = std::fs::metadata(&path).ok()?;
        #[cfg(not(unix))]
        let _ = meta;
        Some(Self {
            #[cfg(unix)]
            id: unix_id(&meta),
            path,
        })
    }

    /// `Err` with a message when the file is gone or is another file.
    fn still_there(&self) -> Result<(), String> {
        let shown = self.path.display();
        match std::fs::metadata(&self.path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(format!(
                "the SQLite file {shown} was deleted; the gateway's open connections write \
                 into the deleted file and every record is lost at the next restart: \
                 restart the gateway"
            )),
            Err(e) => Err(format!("cannot read the SQLite file {shown}: {e}")),
            #[cfg(unix)]
            Ok(meta) if unix_id(&meta) != self.id => Err(format!(
                "the SQLite file {shown} was replaced by another file; the gateway still \
                 writes into the one it opened: restart the gateway"
            )),
            Ok(_) => Ok(()),
        }
    }
}

#[cfg(unix)]
fn unix_id(meta: &std::fs::Metadata) -> (u64, u64) {
    use std::os::unix::fs::MetadataExt;
    (meta.dev(), meta.ino())
}

#[cfg(test)]
mod tests {
    use super::*;
    use idem_core::{MemoryLimits, MemoryStore, Store};

    fn memory(max: usize) -> Arc<MemoryStore> {
        let limits = MemoryLimits {
            max_entries: max,
            ..MemoryLimits::default()
        };
        Arc::new(MemoryStore::new().with_limits(limits))
    }

    #[tokio::test]
    async fn canary_leaves_nothing_and_full_is_reported() {
        let store = memory(1);
        let h = Health::new(store.clone(), "memory", "memory://");
        assert_eq!(h.check().await, Readiness::Ready);
        let scope = Scope::new(CANARY_SCOPE).unwrap();
        assert_eq!(store.get(&scope, h.canary()).await.unwrap(), None);

        // One record in flight fills the store.
        let req = BeginRequest {
            scope: Scope::new("s").unwrap(),
            key: IdempotencyKey::new("k").unwrap(),
            fingerprint: Fingerprint::of(b"x"),
            lease: Duration::from_secs(30),
        };
        let Begin::Acquired(lease) = store.begin(&req).await.unwrap() else {
            panic!("not acquired");
        };
        match h.check().await {
            Readiness::NotReady { reason, .. } => assert_eq!(reason, Reason::Full),
            r => panic!("{r:?}"),
        }
        store.release(&lease).await.unwrap();
        assert_eq!(h.check().await, Readiness::Ready);
    }

    #[tokio::test]
    async fn a_left_over_canary_is_deleted() {
        let store = memory(10);
        let h = Health::new(store.clone(), "memory", "memory://");
        let req = BeginRequest {
            scope: Scope::new(CANARY_SCOPE).unwrap(),
            key: h.canary().clone(),
            fingerprint: Fingerprint::of(b"idem readiness canary"),
            lease: CANARY_LEASE,
        };
        assert!(matches!(
            store.begin(&req).await.unwrap(),
            Begin::Acquired(_)
        ));
        assert_eq!(h.check().await, Readiness::Ready);
        assert_eq!(store.get(&req.scope, h.canary()).await.unwrap(), None);
    }

    #[tokio::test]
    async fn results_are_cached_and_probes_share_one_check() {
        use idem_testkit::faulty::{Fault, Op};
        // A memory store whose `begin` takes 50 ms, its calls counted.
        let store = idem_testkit::FaultyStore::new(MemoryStore::new());
        store.set(Op::Begin, Fault::Delay(Duration::from_millis(50)));
        let h = Health::new(Arc::new(store.clone()), "memory", "memory://");
        let begins = || store.calls(Op::Begin);
        // 200 probes at once while the check takes 50 ms: one check.
        let all = futures::future::join_all((0..200).map(|_| h.readiness())).await;
        assert!(all.iter().all(|r| *r == Readiness::Ready));
        assert_eq!(begins(), 1);
        // Within the second: the cached answer.
        assert_eq!(h.readiness().await, Readiness::Ready);
        assert_eq!(begins(), 1);
        // After it: a new check.
        tokio::time::sleep(READY_CACHE).await;
        assert_eq!(h.readiness().await, Readiness::Ready);
        assert_eq!(begins(), 2);
    }

    #[test]
    fn reasons_from_store_messages() {
        let e = |m: &str| StoreError::unavailable(idem_core::Phase::Begin, m.to_owned());
        assert_eq!(
            Reason::of(&e("attempt to write a readonly database")),
            Reason::ReadOnly
        );
        assert_eq!(Reason::of(&e("database or disk is full")), Reason::DiskFull);
        assert_eq!(
            Reason::of(&e("cannot execute INSERT in a read-only transaction")),
            Reason::ReadOnly
        );
        assert_eq!(
            Reason::of(&e("OOM command not allowed when used memory > 'maxmemory'")),
            Reason::Full
        );
        assert_eq!(Reason::of(&e("connection refused")), Reason::Unavailable);
        assert_eq!(
            Reason::of(&StoreError::Timeout {
                phase: idem_core::Phase::Begin
            }),
            Reason::Timeout
        );
    }

    #[test]
    fn sqlite_paths() {
        assert_eq!(
            sqlite_path("sqlite://a/b.db?mode=rwc"),
            Some("a/b.db".into())
        );
        assert_eq!(sqlite_path("sqlite:///abs/b.db"), Some("/abs/b.db".into()));
        assert_eq!(sqlite_path("sqlite::memory:"), None);
        assert_eq!(sqlite_path("sqlite://x?mode=memory"), None);
    }
}
