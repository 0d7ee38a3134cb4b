//! The layer's settings, each default defined once here (the engine's
//! `lease`, `ttl` and `wait` come from [`EngineConfig::default`]).

use std::sync::Arc;
use std::time::Duration;

use http::Method;
use idem_core::{Action, EngineConfig, IdempotencyKey, Scope};

use crate::fingerprint::FingerprintSpec;
use crate::key::KeySource;
use crate::path::{normalize_path, rule_form};
use crate::policy::StatusPolicy;
use crate::scope::ScopeBy;

/// Guarded methods by default: POST and PATCH.
pub const DEFAULT_METHODS: [Method; 2] = [Method::POST, Method::PATCH];
/// Largest guarded request body by default, bytes: 10 MiB (10,485,760).
pub const DEFAULT_MAX_BODY: usize = 10 * 1024 * 1024;
/// Largest response body kept for replay by default, bytes: 1 MiB (1,048,576).
pub const DEFAULT_RETENTION_LIMIT: usize = 1024 * 1024;
/// How long a submit token may be used for a first submit by default: 1 h.
pub const DEFAULT_TOKEN_TTL: Duration = Duration::from_secs(3600);
/// How long reading a guarded request body may take in all by default: 30 s.
pub const DEFAULT_BODY_TIMEOUT: Duration = Duration::from_secs(30);
/// Bytes of guarded request bodies buffered at once across all requests by
/// default: 256 MiB (268,435,456).
pub const DEFAULT_MAX_BUFFERED: usize = 256 * 1024 * 1024;

/// Decides whether a guarded request may run *unprotected* when the store
/// failed before the inner service was called (fail-open; see
/// [`Options::fail_open`]).
///
/// ```
/// use idem_core::{IdempotencyKey, Scope};
/// #[derive(Debug)]
/// struct Always;
/// impl idem_http::FailOpenGuard for Always {
///     fn allows(&self, _: &Scope, _: &IdempotencyKey) -> bool { true }
/// }
/// let layer = idem_http::IdempotencyLayer::new(idem_core::MemoryStore::new())
///     .with_fail_open(std::sync::Arc::new(Always));
/// assert!(layer.options().fail_open.is_some());
/// ```
pub trait FailOpenGuard: std::fmt::Debug + Send + Sync + 'static {
    /// Whether the request with `key` in `scope` may be forwarded without
    /// protection. `false` answers 503 `store-unavailable` as without
    /// fail-open (e.g. for a key seen claimed moments ago, whose rerun
    /// would be a certain second execution).
    fn allows(&self, scope: &Scope, key: &IdempotencyKey) -> bool;
}

/// Settings of the layer (builder methods on [`crate::IdempotencyLayer`]).
#[derive(Debug, Clone)]
pub struct Options {
    /// Guarded methods (default [`DEFAULT_METHODS`]: POST, PATCH).
    pub methods: Vec<Method>,
    /// Answer 400 to a guarded request without a key (default false).
    pub require_key: bool,
    /// Scope derivation (default `Headers([Authorization])`).
    pub scope: ScopeBy,
    /// Largest guarded request body, bytes (default [`DEFAULT_MAX_BODY`],
    /// 10 MiB) → 413 beyond.
    pub max_body: usize,
    /// Largest response body kept for replay, bytes (default
    /// [`DEFAULT_RETENTION_LIMIT`], 1 MiB).
    pub retention_limit: usize,
    /// Lease (default [`EngineConfig::default`]'s, 30 s).
    pub lease: Duration,
    /// Replay window (default [`EngineConfig::default`]'s, 24 h).
    pub ttl: Duration,
    /// How long a duplicate waits for an in-flight original (default
    /// [`EngineConfig::default`]'s, 0).
    pub wait: Duration,
    /// How long the answer of a released failure (a status the policy
    /// releases, e.g. a 5xx or 502 `upstream-unreachable`, with a body of
    /// at most `retention_limit`) is kept for the duplicates that waited
    /// for it, which get it replayed; a later retry waits out the window
    /// and runs again (default [`EngineConfig::default`]'s, 1 s; 0:
    /// released at once).
    /// See [`idem_core::Action::ReleaseWith`].
    pub share_failure: Duration,
    /// How long a key whose outcome is unknown (a 504, a broken response
    /// body, a cancelled run, a save given up) stays held before a retry
    /// may run it again: its lease end moves to at least now + `hold_for`
    /// (default [`EngineConfig::default`]'s, 0: until its lease ends).
    /// An operator settles a held key earlier (`idem keys delete` /
    /// `complete`). See [`idem_core::EngineConfig::hold_for`].
    pub hold_for: Duration,
    /// Which statuses are stored, released or held (default
    /// [`crate::default_policy`]: 1xx–4xx except 408, 409, 425, 429 are
    /// stored, the rest released; see [`StatusPolicy`] for overrides).
    pub policy: StatusPolicy,
    /// Where the idempotency key comes from (default the `Idempotency-Key`
    /// header; see [`KeySource`]).
    pub key_source: KeySource,
    /// Which parts of a request count for its fingerprint (default: the
    /// method, path, query, `Content-Type` and body; see
    /// [`FingerprintSpec`]).
    pub fingerprint: FingerprintSpec,
    /// Path prefixes whose guarded requests must carry a live submit token
    /// ([`idem_core::token`]) as their `Idempotency-Key` (default none).
    /// Matched by path segment: `/pay` matches `/pay` and `/pay/42`, not
    /// `/payment`; a prefix ending in `/` matches every path under it.
    /// Without a key such a request gets 428 `token-required`; with a key
    /// that is not a token issued for its scope, or one whose TTL passed
    /// before its first use, 403 `token-unknown`. The inner service is not
    /// called either way.
    pub require_token: Vec<String>,
    /// How long a token issued by [`crate::IdempotencyLayer::issue_token`]
    /// may be used for a first submit (default [`DEFAULT_TOKEN_TTL`], 1 h;
    /// capped at `ttl`).
    pub token_ttl: Duration,
    /// Fail-open (default `None`: fail closed). With a guard, a guarded
    /// request whose store failed before the inner service was called
    /// (`begin` unreachable or timed out, or waiting for an original
    /// failed; not a full store, not a corrupt record) is passed to the
    /// inner service anyway, as it was buffered, when the guard
    /// [allows](FailOpenGuard::allows) its key; the answer is marked
    /// `Idempotency-Status: unprotected` ([`crate::IDEMPOTENCY_STATUS`])
    /// and nothing is recorded, so a retry may run again. Never applied to
    /// the routes of `require_token` (a token cannot be checked without the
    /// store), nor once the inner service was called.
    pub fail_open: Option<Arc<dyn FailOpenGuard>>,
    /// Whether [`crate::IdempotencyLayer::issue_token`] issues tokens to a
    /// request that carries none of the scope headers (default false: it
    /// answers [`crate::TokenIssueError::ScopeRequired`]). On, every such
    /// caller shares the anonymous scope, and with it one
    /// `tokens_per_scope` budget.
    pub anonymous_tokens: bool,
    /// Most live submit tokens per scope (default
    /// [`crate::DEFAULT_TOKENS_PER_SCOPE`], 100); beyond it
    /// [`crate::TokenIssueError::TooMany`]. A token stops counting when it
    /// is used (its result stored) or its TTL ends. Counted per layer, so
    /// per gateway instance.
    pub tokens_per_scope: usize,
    /// Most live submit tokens in all (default
    /// [`crate::DEFAULT_MAX_LIVE_TOKENS`], 100,000), so that tokens (one
    /// store record each) cannot fill the store that holds the results:
    /// keep it well below a capped store's record limit (the memory store's
    /// `MemoryLimits::max_entries`, 1,000,000 by default). Counted per
    /// layer, so per gateway instance.
    pub max_live_tokens: usize,
    /// The longest reading a guarded request body may take in all, from
    /// the moment the layer starts reading it to its last byte (default
    /// [`DEFAULT_BODY_TIMEOUT`], 30 s). A body still incomplete then gets
    /// 408 `urn:idem:problem:body-timeout` with `Connection: close`
    /// (RFC 9110 §15.5.9); the key is not touched and the bytes read so far
    /// are freed. A total deadline, not an idle one: a body that trickles a
    /// byte a second is cut off too. Must be above 0.
    pub body_timeout: Duration,
    /// The most bytes of guarded request bodies held in memory at once by
    /// all the services of one [`crate::IdempotencyLayer`] (default
    /// [`DEFAULT_MAX_BUFFERED`], 256 MiB). A request reserves its
    /// `Content-Length` before its body is read; one without a length
    /// reserves each chunk as it arrives. When the budget has no room, the
    /// answer is 503 `urn:idem:problem:overloaded` with `Retry-After: 1`
    /// (RFC 9110 §15.6.4, §10.2.3) and `Connection: close`, before the
    /// body is read (or as soon as the chunk that does not fit arrives);
    /// the key is not touched. The bytes are given back when the buffered
    /// body is dropped (after the inner service has consumed it). Keep it
    /// at least `max_body`, or bodies between the two are always refused.
    /// Read when the layer is built: set it with
    /// [`crate::IdempotencyLayer::with_max_buffered`] or
    /// [`crate::IdempotencyLayer::with_options`].
    pub max_buffered: usize,
    /// Whether requests the layer passes through (unguarded methods,
    /// guarded ones without a key) get a log line too (default false):
    /// target `idem`, level INFO, message `request`, with `outcome =
    /// passthrough`, `status`, `duration_ms`, `method`, the normalised
    /// `path` and `route`. Guarded requests always get their line.
    pub access_log: bool,
}

impl Default for Options {
    fn default() -> Self {
        let engine = EngineConfig::default();
        Self {
            methods: DEFAULT_METHODS.to_vec(),
            require_key: false,
            scope: ScopeBy::default(),
            max_body: DEFAULT_MAX_BODY,
            retention_limit: DEFAULT_RETENTION_LIMIT,
            lease: engine.lease,
            ttl: engine.ttl,
            wait: engine.wait,
            share_failure: engine.share_failure,
            hold_for: engine.hold_for,
            policy: StatusPolicy::default(),
            key_source: KeySource::default(),
            fingerprint: FingerprintSpec::default(),
            require_token: Vec::new(),
            token_ttl: DEFAULT_TOKEN_TTL,
            fail_open: None,
            anonymous_tokens: false,
            tokens_per_scope: crate::tokens::DEFAULT_TOKENS_PER_SCOPE,
            max_live_tokens: crate::tokens::DEFAULT_MAX_LIVE_TOKENS,
            body_timeout: DEFAULT_BODY_TIMEOUT,
            max_buffered: DEFAULT_MAX_BUFFERED,
            access_log: false,
        }
    }
}

impl Options {
    /// Checks the settings the guarantee depends on: a lease of at least
    /// [`idem_core::MIN_LEASE`] (1 s) and a TTL not shorter than the lease
    /// ([`EngineConfig::validate`]). The layer never refuses to build: below
    /// the floor its engine runs with the lease raised to 1 s, see [`idem_core::Engine::with_config`]; call this to
    /// refuse such settings at startup instead.
    ///
    /// ```
    /// use std::time::Duration;
    /// let o = idem_http::Options { lease: Duration::from_millis(1), ..Default::default() };
    /// assert!(o.validate().is_err());
    /// assert!(idem_http::Options::default().validate().is_ok());
    /// ```
    ///
    /// # Errors
    /// [`idem_core::EngineConfigError`].
    pub fn validate(&self) -> Result<(), idem_core::EngineConfigError> {
        self.engine_config().validate()
    }

    /// The engine settings these options imply: `lease`, `ttl`, `wait`,
    /// `share_failure`, a
    /// watchdog that renews the lease every third of its length, and
    /// `Hold` when a run is dropped mid-flight (a panicking inner service):
    /// the key frees itself when its lease ends.
    pub fn engine_config(&self) -> EngineConfig {
        EngineConfig {
            lease: self.lease,
            ttl: self.ttl,
            wait: self.wait,
            share_failure: self.share_failure,
            hold_for: self.hold_for,
            watchdog: true,
            on_cancel: Action::Hold(idem_core::HoldReason::Cancelled),
            ..EngineConfig::default()
        }
    }

    /// Whether a guarded request for `path` must carry a submit token
    /// (see [`Options::require_token`]).
    ///
    /// `path` and each prefix are compared in one form, whatever their
    /// spelling: normalised ([`crate::path::normalize_path`]: unreserved
    /// escapes decoded, dot segments removed, repeated slashes merged),
    /// then fully percent-decoded and ASCII-lower-cased, so a route is
    /// covered however an upstream may decode it, including routers that
    /// ignore case (`/PAY/1` requires a token under `/pay`; a case-sensitive
    /// upstream that has no `/PAY` route loses nothing by it). A path that
    /// cannot be normalised (ambiguous, see [`crate::path::PathError`]) is
    /// taken to need a token whenever a token route exists; the layer
    /// refuses such paths with 400 before it asks.
    ///
    /// ```
    /// let o = idem_http::Options { require_token: vec!["/pay".into()], ..Default::default() };
    /// assert!(o.token_required("/pay"));
    /// assert!(o.token_required("/pay/42"));
    /// assert!(o.token_required("/%70ay/42"));
    /// assert!(o.token_required("//pay/42"));
    /// assert!(o.token_required("/x/../pay/42"));
    /// assert!(o.token_required("/PAY/42"));
    /// assert!(!o.token_required("/payment"));
    /// assert!(!o.token_required("/orders"));
    /// ```
    pub fn token_required(&self, path: &str) -> bool {
        if self.require_token.is_empty() {
            return false;
        }
        let Ok(path) = normalize_path(path) else {
            return true;
        };
        let path = rule_form(&path);
        self.require_token.iter().any(|prefix| {
            let prefix = match normalize_path(prefix) {
                Ok(p) => rule_form(&p),
                Err(_) => rule_form(prefix),
            };
            path_has_prefix(&path, &prefix)
        })
    }
}

/// `path` equals `prefix`, or continues it with a new segment (or `prefix`
/// ends in `/`).
fn path_has_prefix(path: &[u8], prefix: &[u8]) -> bool {
    match path.strip_prefix(prefix) {
        Some(rest) => rest.is_empty() || prefix.ends_with(b"/") || rest.starts_with(b"/"),
        None => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::StatusCode;

    #[test]
    fn secure_defaults() {
        let o = Options::default();
        assert_eq!(o.methods, vec![Method::POST, Method::PATCH]);
        assert!(!o.require_key);
        assert_eq!(o.max_body, 10 * 1024 * 1024);
        assert_eq!(o.retention_limit, 1024 * 1024);
        assert_eq!(o.lease, Duration::from_secs(30));
        assert_eq!(o.ttl, Duration::from_secs(86_400));
        assert_eq!(o.wait, Duration::ZERO);
        assert_eq!(
            o.policy.disposition(StatusCode::INTERNAL_SERVER_ERROR),
            crate::Disposition::Release
        );
        let c = o.engine_config();
        assert!(c.watchdog);
        assert_eq!(c.on_cancel, Action::Hold(idem_core::HoldReason::Cancelled));
        assert!(o.require_token.is_empty());
        assert_eq!(o.token_ttl, Duration::from_secs(3600));
        assert!(o.fail_open.is_none());
        assert!(!o.anonymous_tokens);
        assert_eq!(o.tokens_per_scope, 100);
        assert_eq!(o.max_live_tokens, 100_000);
        assert!(o.validate().is_ok());
        assert_eq!(o.body_timeout, Duration::from_secs(30));
        assert_eq!(o.max_buffered, 256 * 1024 * 1024);
    }

    #[test]
    fn token_prefixes_match_by_segment() {
        let p = |a: &str, b: &str| path_has_prefix(a.as_bytes(), b.as_bytes());
        assert!(p("/pay", "/pay"));
        assert!(p("/pay/1", "/pay"));
        assert!(!p("/payment", "/pay"));
        assert!(p("/pay/1", "/pay/"));
        assert!(!p("/pay", "/pay/"));
        assert!(p("/anything", "/"));
        assert!(!p("/orders", "/pay"));
    }

    #[test]
    fn token_routes_hold_for_every_spelling() {
        let o = Options {
            require_token: vec!["/pay".into(), "/Check%6Fut/".into(), "/a:b".into()],
            ..Options::default()
        };
        for covered in [
            "/pay",
            "/pay/1",
            "/%70ay/1",
            "/pa%79/1",
            "//pay/1",
            "/pay//1",
            "/./pay/1",
            "/x/../pay/1",
            "/%2e%2e/pay/1",
            "/PAY/1",
            "/checkout/1",
            "/CHECKOUT/x",
            "/a%3Ab/1",
            "/pay%2F1",
            "/pay;x/1",
        ] {
            assert!(o.token_required(covered), "{covered}");
        }
        for free in ["/", "/payment", "/pa", "/orders/pay", "/checkout", "/a:c"] {
            assert!(!o.token_required(free), "{free}");
        }
        assert!(!Options::default().token_required("/pay%2F1"));
    }
}
