//! The layer: a store and [`Options`], and the builder methods that set them.

use std::sync::Arc;
use std::time::Duration;

use http::{HeaderMap, Method, StatusCode};
use idem_core::token::{IssuedToken, SubmitTokens};
use idem_core::{DynStore, Engine, InstrumentedStore, Scope, Store};
use tokio_util::task::TaskTracker;
use tower_layer::Layer;

use crate::budget::BodyBudget;
use crate::observe::{token_rejected, Observer, TokenRejection};
use crate::options::{FailOpenGuard, Options};
use crate::policy::{Disposition, StatusPolicy};
use crate::routes::{Route, RouteError, Table};
use crate::scope::ScopeBy;
use crate::service::IdempotencyService;
use crate::tokens::{TokenBudget, TokenIssueError};
use arc_swap::ArcSwap;
use std::sync::OnceLock;

/// What a [`IdempotencyLayer::reload`] changed that its caller should warn
/// about.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Reloaded {
    /// The routes (by name; `default` for the layer's own rules) whose
    /// scope or key source changed: their keys are now looked up under
    /// another scope or read from another place, so the results stored
    /// before the reload are not found by retries, which run again.
    pub rekeyed: Vec<String>,
}

/// `with_*` setters that each set the [`Options`] field of their name
/// (the doc comments written at the call pass through).
macro_rules! options_setters {
    ($($(#[$attr:meta])* $name:ident($field:ident: $ty:ty);)*) => {$(
        $(#[$attr])*
        pub fn $name(mut self, $field: $ty) -> Self {
            self.options.$field = $field;
            self.rebuilt()
        }
    )*};
}

/// The tower layer. `IdempotencyLayer::new(store)` then `with_*` builders:
/// `with_methods(Vec<Method>)`, `with_require_key(bool)`, `with_scope(ScopeBy)`,
/// `with_max_body(usize)`, `with_retention_limit(usize)`, `with_lease(Duration)`,
/// `with_ttl(Duration)`, `with_wait(Duration)`, `with_policy(fn)`,
/// `with_require_token(prefixes)`, `with_token_ttl(Duration)`,
/// `with_fail_open(guard)`, `with_tracker(TaskTracker)`; [`IdempotencyLayer::issue_token`] issues
/// submit tokens.
///
/// It wraps a service into an [`IdempotencyService`]; see the
/// [crate docs](crate) for the behaviour.
///
/// Every guarded request runs in a task spawned on its [`TaskTracker`]
/// ([`IdempotencyLayer::tracker`]), so a server can wait for runs whose
/// clients have left before the process exits (see the tracker's docs).
///
/// ```
/// use std::time::Duration;
/// use idem_core::MemoryStore;
/// use idem_http::IdempotencyLayer;
/// let layer = IdempotencyLayer::new(MemoryStore::new())
///     .with_require_key(true)
///     .with_lease(Duration::from_secs(10));
/// assert_eq!(layer.options().lease, Duration::from_secs(10));
/// ```
#[derive(Debug, Clone)]
pub struct IdempotencyLayer {
    store: DynStore,
    options: Options,
    tracker: TaskTracker,
    /// The live tokens this layer issued (shared by its clones and services).
    live_tokens: Arc<TokenBudget>,
    /// The bytes of buffered request bodies, shared by every service made
    /// ([`Options::max_buffered`]).
    body_budget: BodyBudget,
    /// Metric handles (see [`crate::observe`]).
    observer: Arc<Observer>,
    /// Per-route rules ([`IdempotencyLayer::with_routes`]).
    routes: Vec<Route>,
    /// The rules in force, compiled from `options` and `routes` when the
    /// first service is made, then swapped by [`IdempotencyLayer::reload`].
    /// Shared by clones; every builder method starts a new one, so a
    /// clone built on never changes the services of the original.
    rules: Arc<OnceLock<Arc<ArcSwap<Table>>>>,
}

impl IdempotencyLayer {
    /// A layer over `store` (any [`Store`], including a [`DynStore`]) with
    /// [`Options::default`] and a new [`TaskTracker`].
    pub fn new(store: impl Store) -> Self {
        Self::from_parts(Arc::new(store), Options::default())
    }

    /// A layer over a shared store with explicit options and a new
    /// [`TaskTracker`].
    ///
    /// The store is wrapped in an [`InstrumentedStore`] (store call
    /// metrics and `idem.store` spans), and the layer's metric handles are
    /// registered now ([`crate::observe`]): install the process's metrics
    /// recorder (if any) before building the layer.
    pub fn from_parts(store: DynStore, options: Options) -> Self {
        Self {
            store: Arc::new(InstrumentedStore::new(store)),
            body_budget: BodyBudget::new(options.max_buffered),
            options,
            tracker: TaskTracker::new(),
            live_tokens: Arc::default(),
            observer: Arc::new(Observer::for_route(crate::observe::DEFAULT_ROUTE)),
            routes: Vec::new(),
            rules: Arc::default(),
        }
    }

    /// The layer-wide settings, for a new service.
    fn layer_options(&self) -> Arc<Options> {
        Arc::new(self.options.clone())
    }

    /// This layer with its rules to be compiled again (after a builder
    /// changed a setting).
    fn rebuilt(mut self) -> Self {
        self.rules = Arc::default();
        self
    }

    /// The rules in force (compiled now if no service was made yet).
    fn rules(&self) -> &Arc<ArcSwap<Table>> {
        self.rules.get_or_init(|| {
            Arc::new(ArcSwap::from_pointee(Table::new(
                &self.store,
                &self.options,
                &self.options,
                &self.routes,
            )))
        })
    }

    /// The tracker of the tasks that run guarded requests (shared by every
    /// service this layer makes, and by clones of the layer).
    ///
    /// A guarded request runs in a spawned task, so it goes on — and stores
    /// its result — after its client disconnects. To let those runs finish
    /// before the process exits, stop serving and then close the tracker and
    /// wait for it, bounded by a grace period of your choosing:
    ///
    /// ```
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// use std::time::Duration;
    /// let layer = idem_http::IdempotencyLayer::new(idem_core::MemoryStore::new());
    /// let tracker = layer.tracker().clone();
    /// // ... serve with `layer` until shutdown, then:
    /// tracker.close();
    /// let finished = tokio::time::timeout(Duration::from_secs(30), tracker.wait()).await;
    /// assert!(finished.is_ok());
    /// # });
    /// ```
    ///
    /// Closing only marks the tracker: requests that still arrive are run
    /// and tracked as before, and [`TaskTracker::wait`] returns once the
    /// tracker is closed and no task is left.
    pub fn tracker(&self) -> &TaskTracker {
        &self.tracker
    }

    /// Tracks the tasks of guarded requests on `tracker` (default: a new
    /// tracker per layer), e.g. one the server also uses for its own tasks.
    ///
    /// ```
    /// use idem_http::TaskTracker;
    /// let tracker = TaskTracker::new();
    /// let layer = idem_http::IdempotencyLayer::new(idem_core::MemoryStore::new())
    ///     .with_tracker(tracker.clone());
    /// assert!(layer.tracker().is_empty());
    /// ```
    pub fn with_tracker(mut self, tracker: TaskTracker) -> Self {
        self.tracker = tracker;
        self.rebuilt()
    }

    /// The store, as the layer uses it: the one given, wrapped in an
    /// [`InstrumentedStore`].
    pub fn store(&self) -> &DynStore {
        &self.store
    }

    /// The settings.
    pub fn options(&self) -> &Options {
        &self.options
    }

    /// Replaces all settings.
    ///
    /// ```
    /// use idem_http::{IdempotencyLayer, Options};
    /// let layer = IdempotencyLayer::new(idem_core::MemoryStore::new())
    ///     .with_options(Options { require_key: true, ..Options::default() });
    /// assert!(layer.options().require_key);
    /// ```
    pub fn with_options(mut self, options: Options) -> Self {
        self.body_budget = BodyBudget::new(options.max_buffered);
        self.options = options;
        self.rebuilt()
    }

    /// The most bytes of guarded request bodies held in memory at once by
    /// every service of this layer (default 256 MiB; see
    /// [`Options::max_buffered`]); beyond it a request gets 503
    /// `urn:idem:problem:overloaded` before its body is read. Starts a new
    /// budget: services made before keep the old one.
    ///
    /// ```
    /// let layer = idem_http::IdempotencyLayer::new(idem_core::MemoryStore::new())
    ///     .with_max_buffered(64 * 1024 * 1024);
    /// assert_eq!(layer.options().max_buffered, 64 << 20);
    /// ```
    pub fn with_max_buffered(mut self, max_buffered: usize) -> Self {
        self.options.max_buffered = max_buffered;
        self.body_budget = BodyBudget::new(max_buffered);
        self.rebuilt()
    }

    /// Which statuses are stored, released or held, as a function of the
    /// status (default [`crate::default_policy`]). A [`Disposition`] in a
    /// response's extensions overrides it for that response. For overrides
    /// by status or class on top of the default, see
    /// [`IdempotencyLayer::with_status_policy`].
    ///
    /// ```
    /// use http::StatusCode;
    /// use idem_http::Disposition;
    /// fn keep_only_success(s: StatusCode) -> Disposition {
    ///     if s.is_success() { Disposition::Store } else { Disposition::Release }
    /// }
    /// let layer = idem_http::IdempotencyLayer::new(idem_core::MemoryStore::new())
    ///     .with_policy(keep_only_success);
    /// assert_eq!(layer.options().policy.disposition(StatusCode::NOT_FOUND), Disposition::Release);
    /// ```
    pub fn with_policy(self, policy: fn(StatusCode) -> Disposition) -> Self {
        self.with_status_policy(StatusPolicy::from_fn(policy))
    }

    /// Which statuses are stored, released or held ([`StatusPolicy`]:
    /// [`crate::default_policy`] with overrides).
    ///
    /// ```
    /// use http::StatusCode;
    /// use idem_http::{Disposition, StatusPolicy};
    /// let layer = idem_http::IdempotencyLayer::new(idem_core::MemoryStore::new())
    ///     .with_status_policy(StatusPolicy::store_5xx());
    /// assert_eq!(layer.options().policy.disposition(StatusCode::INTERNAL_SERVER_ERROR), Disposition::Store);
    /// ```
    pub fn with_status_policy(mut self, policy: StatusPolicy) -> Self {
        self.options.policy = policy;
        self.rebuilt()
    }

    /// Per-route rules ([`crate::routes`]): an ordered list, first match
    /// wins; requests no route matches get this layer's options.
    ///
    /// # Errors
    /// [`RouteError`] from [`crate::routes::validate_routes`].
    pub fn with_routes(mut self, routes: Vec<Route>) -> Result<Self, RouteError> {
        crate::routes::validate_routes(&routes)?;
        self.routes = routes;
        Ok(self.rebuilt())
    }

    /// The routes given by [`IdempotencyLayer::with_routes`].
    pub fn routes(&self) -> &[Route] {
        &self.routes
    }

    /// Replaces the rules of every service this layer made (and of its
    /// clones) while they serve: the per-request settings of `options`
    /// (not the layer-wide ones, see [`Route`]) and `routes`. A request
    /// already running keeps the rules it started with.
    ///
    /// Returns what the new rules change that a caller should be warned
    /// about ([`Reloaded`]).
    ///
    /// # Errors
    /// [`RouteError`] when `routes` or `options` are refused; the rules in
    /// force stay.
    pub fn reload(&self, options: Options, routes: Vec<Route>) -> Result<Reloaded, RouteError> {
        crate::routes::validate_routes(&routes)?;
        options.validate().map_err(|e| RouteError::Invalid {
            route: crate::observe::DEFAULT_ROUTE.into(),
            reason: e.to_string(),
        })?;
        if options.methods.is_empty() {
            return Err(RouteError::Invalid {
                route: crate::observe::DEFAULT_ROUTE.into(),
                reason: "no method".into(),
            });
        }
        options
            .fingerprint
            .validate()
            .map_err(|e| RouteError::Invalid {
                route: crate::observe::DEFAULT_ROUTE.into(),
                reason: format!("fingerprint: {e}"),
            })?;
        let table = Table::new(&self.store, &self.options, &options, &routes);
        let rekeyed = self.rules().load().rekeyed_by(&table);
        self.rules().store(Arc::new(table));
        Ok(Reloaded { rekeyed })
    }

    /// The longest reading a guarded request body may take in all (default
    /// 30 s; see [`Options::body_timeout`]); past it, 408
    /// `urn:idem:problem:body-timeout` and the key is not touched.
    ///
    /// ```
    /// use std::time::Duration;
    /// let layer = idem_http::IdempotencyLayer::new(idem_core::MemoryStore::new())
    ///     .with_body_timeout(Duration::from_secs(5));
    /// assert_eq!(layer.options().body_timeout, Duration::from_secs(5));
    /// ```
    pub fn with_body_timeout(mut self, body_timeout: Duration) -> Self {
        self.options.body_timeout = body_timeout;
        self.rebuilt()
    }

    options_setters! {
        /// The guarded methods (default POST and PATCH). Requests of other
        /// methods stream through untouched.
        ///
        /// ```
        /// use http::Method;
        /// let layer = idem_http::IdempotencyLayer::new(idem_core::MemoryStore::new())
        ///     .with_methods(vec![Method::POST, Method::PATCH, Method::PUT, Method::DELETE]);
        /// assert_eq!(layer.options().methods.len(), 4);
        /// ```
        with_methods(methods: Vec<Method>);

        /// Whether a guarded request without an `Idempotency-Key` is refused
        /// with 400 `urn:idem:problem:key-required` (default false: it passes
        /// through and the store is not touched).
        ///
        /// ```
        /// let layer = idem_http::IdempotencyLayer::new(idem_core::MemoryStore::new())
        ///     .with_require_key(true);
        /// assert!(layer.options().require_key);
        /// ```
        with_require_key(require_key: bool);

        /// How a request's scope is derived (default: SHA-256 of every
        /// `Authorization` field; none → the anonymous scope).
        ///
        /// ```
        /// use idem_http::ScopeBy;
        /// let layer = idem_http::IdempotencyLayer::new(idem_core::MemoryStore::new())
        ///     .with_scope(ScopeBy::Headers(vec![http::HeaderName::from_static("x-api-key")]));
        /// assert!(matches!(layer.options().scope, ScopeBy::Headers(_)));
        /// ```
        with_scope(scope: ScopeBy);

        /// The largest guarded request body, in bytes (default 10 MiB = 10,485,760).
        /// A larger one gets 413 `urn:idem:problem:body-too-large` before any
        /// store or inner work.
        ///
        /// ```
        /// let layer = idem_http::IdempotencyLayer::new(idem_core::MemoryStore::new())
        ///     .with_max_body(64 * 1024);
        /// assert_eq!(layer.options().max_body, 65_536);
        /// ```
        with_max_body(max_body: usize);

        /// The largest response body kept for replay, in bytes (default 1 MiB =
        /// 1,048,576). The first caller always gets the whole response; past the
        /// limit the key completes without the body and a duplicate gets 410
        /// `urn:idem:problem:response-not-retained` (never a second execution).
        ///
        /// Within the limit the body is buffered before the first caller is
        /// answered, so a body that fails is answered with a 502
        /// `urn:idem:problem:upstream-failed` and the key is held until its lease
        /// ends. Past the limit the response is already streaming: a failure
        /// cuts the first caller's body short (unavoidably), and the key stays
        /// completed without its body.
        ///
        /// ```
        /// let layer = idem_http::IdempotencyLayer::new(idem_core::MemoryStore::new())
        ///     .with_retention_limit(256 * 1024);
        /// assert_eq!(layer.options().retention_limit, 262_144);
        /// ```
        with_retention_limit(retention_limit: usize);

        /// How long a claim holds before another request may take the key over
        /// (default 30 s; millisecond precision). Renewed every third of its
        /// length while the inner service runs; also the longest a key stays
        /// in flight after a crash or an unknown outcome.
        ///
        /// ```
        /// use std::time::Duration;
        /// let layer = idem_http::IdempotencyLayer::new(idem_core::MemoryStore::new())
        ///     .with_lease(Duration::from_millis(1500));
        /// assert_eq!(layer.options().lease, Duration::from_millis(1500));
        /// ```
        with_lease(lease: Duration);

        /// How long a completed response is replayed (default 24 h).
        ///
        /// ```
        /// use std::time::Duration;
        /// let layer = idem_http::IdempotencyLayer::new(idem_core::MemoryStore::new())
        ///     .with_ttl(Duration::from_secs(3600));
        /// assert_eq!(layer.options().ttl, Duration::from_secs(3600));
        /// ```
        with_ttl(ttl: Duration);

        /// How long a duplicate waits for an in-flight original to finish
        /// before it gets 409 (default 0: answer at once). Within the bound it
        /// gets the original's replay.
        ///
        /// ```
        /// use std::time::Duration;
        /// let layer = idem_http::IdempotencyLayer::new(idem_core::MemoryStore::new())
        ///     .with_wait(Duration::from_secs(5));
        /// assert_eq!(layer.options().wait, Duration::from_secs(5));
        /// ```
        with_wait(wait: Duration);

        /// How long the answer of a released failure (5xx, unreachable
        /// inner service) is kept for the duplicates that waited for it
        /// (default 1 s; 0: released at once; see
        /// [`Options::share_failure`]).
        ///
        /// ```
        /// use std::time::Duration;
        /// let layer = idem_http::IdempotencyLayer::new(idem_core::MemoryStore::new())
        ///     .with_share_failure(Duration::from_secs(1));
        /// assert_eq!(layer.options().share_failure, Duration::from_secs(1));
        /// ```
        with_share_failure(share_failure: Duration);

        /// How long a key whose outcome is unknown (504, broken body) stays
        /// held before a retry may run it again (default 0: until its lease
        /// ends; see [`Options::hold_for`]).
        ///
        /// ```
        /// use std::time::Duration;
        /// let layer = idem_http::IdempotencyLayer::new(idem_core::MemoryStore::new())
        ///     .with_hold_for(Duration::from_secs(3600));
        /// assert_eq!(layer.options().hold_for, Duration::from_secs(3600));
        /// ```
        with_hold_for(hold_for: Duration);


        /// Whether passed-through requests (unguarded methods, guarded ones
        /// without a key) are logged too (default false; see
        /// [`Options::access_log`]).
        ///
        /// ```
        /// let layer = idem_http::IdempotencyLayer::new(idem_core::MemoryStore::new())
        ///     .with_access_log(true);
        /// assert!(layer.options().access_log);
        /// ```
        with_access_log(access_log: bool);
    }

    /// Guarded requests under these path prefixes must carry a live submit
    /// token as their `Idempotency-Key` (see [`Options::require_token`]);
    /// replaces the list.
    ///
    /// ```
    /// let layer = idem_http::IdempotencyLayer::new(idem_core::MemoryStore::new())
    ///     .with_require_token(["/pay", "/checkout/"]);
    /// assert!(layer.options().token_required("/pay/7"));
    /// ```
    pub fn with_require_token<I, P>(mut self, prefixes: I) -> Self
    where
        I: IntoIterator<Item = P>,
        P: Into<String>,
    {
        self.options.require_token = prefixes.into_iter().map(Into::into).collect();
        self.rebuilt()
    }

    options_setters! {
        /// How long a token from [`IdempotencyLayer::issue_token`] may be used
        /// for a first submit (default 1 h; capped at the replay window `ttl`,
        /// so a result is never forgotten while its token is still accepted).
        ///
        /// ```
        /// use std::time::Duration;
        /// let layer = idem_http::IdempotencyLayer::new(idem_core::MemoryStore::new())
        ///     .with_token_ttl(Duration::from_secs(900));
        /// assert_eq!(layer.options().token_ttl, Duration::from_secs(900));
        /// ```
        with_token_ttl(token_ttl: Duration);
    }

    /// Turns fail-open on with `guard` (default off: a guarded request
    /// whose store fails before the run gets 503 `store-unavailable`); see
    /// [`Options::fail_open`] for when it applies.
    ///
    /// **Can run a request twice**: nothing is recorded for a request
    /// forwarded this way, so a retry during the outage runs again.
    pub fn with_fail_open(mut self, guard: Arc<dyn FailOpenGuard>) -> Self {
        self.options.fail_open = Some(guard);
        self.rebuilt()
    }

    /// Submit tokens over this layer's store, with its lease and replay
    /// window ([`Options::engine_config`]).
    pub fn tokens(&self) -> SubmitTokens<DynStore> {
        SubmitTokens::from_engine(Engine::with_config(
            self.store.clone(),
            self.options.engine_config(),
        ))
    }

    /// Issues a submit token for the scope the layer derives from
    /// `headers` ([`Options::scope`]), valid for [`Options::token_ttl`]
    /// (capped at [`Options::ttl`]). Two store calls.
    ///
    /// A request that carries none of the scope headers gets no token
    /// unless [`Options::anonymous_tokens`] is on; a scope that already
    /// holds [`Options::tokens_per_scope`] live tokens, or a layer that
    /// holds [`Options::max_live_tokens`], gets none until one is used or
    /// expires (counted in this process, see [`TokenIssueError::TooMany`]).
    ///
    /// ```
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// use idem_http::{IdempotencyLayer, TokenIssueError};
    /// let layer = IdempotencyLayer::new(idem_core::MemoryStore::new());
    /// let mut h = http::HeaderMap::new();
    /// assert!(matches!(layer.issue_token(&h).await, Err(TokenIssueError::ScopeRequired)));
    /// h.insert("authorization", "Bearer alice".parse().unwrap());
    /// let issued = layer.issue_token(&h).await.unwrap();
    /// assert!(issued.token.starts_with("tok_"));
    /// assert_eq!(issued.expires_in.as_secs(), 3600);
    /// # });
    /// ```
    ///
    /// # Errors
    /// [`TokenIssueError::ScopeRequired`] for an anonymous caller (unless
    /// allowed), [`TokenIssueError::TooMany`] beyond a cap (with the time
    /// until the oldest counted token expires), [`TokenIssueError::Issue`]
    /// when the store fails or `token_ttl` is 0.
    pub async fn issue_token(&self, headers: &HeaderMap) -> Result<IssuedToken, TokenIssueError> {
        self.issue_token_in(headers, &http::Extensions::new()).await
    }

    /// [`IdempotencyLayer::issue_token`] for a request with these headers
    /// and extensions: under [`crate::ScopeBy::ClientCert`] the scope is the
    /// [`crate::ClientCertificate`] in `extensions`
    /// ([`crate::ScopeBy::scope_in`]).
    ///
    /// # Errors
    /// As [`IdempotencyLayer::issue_token`];
    /// [`TokenIssueError::ScopeRequired`] also for a request without the
    /// client certificate its scope needs.
    pub async fn issue_token_in(
        &self,
        headers: &HeaderMap,
        extensions: &http::Extensions,
    ) -> Result<IssuedToken, TokenIssueError> {
        let Ok(scope) = self.options.scope.scope_in(headers, extensions) else {
            token_rejected(TokenRejection::ScopeRequired);
            return Err(TokenIssueError::ScopeRequired);
        };
        if scope == Scope::anonymous() && !self.options.anonymous_tokens {
            token_rejected(TokenRejection::ScopeRequired);
            return Err(TokenIssueError::ScopeRequired);
        }
        let room = self
            .live_tokens
            .reserve(
                &scope,
                std::time::Instant::now(),
                self.options.tokens_per_scope,
                self.options.max_live_tokens,
            )
            .inspect_err(|_| token_rejected(TokenRejection::TooMany))?;
        let issued = self.tokens().issue(&scope, self.options.token_ttl).await?;
        // Counted from now, after the marker was written: never shorter
        // than the store keeps it.
        room.commit(&issued.token, std::time::Instant::now() + issued.expires_in);
        self.observer.token_issued();
        Ok(issued)
    }
}

impl<S> Layer<S> for IdempotencyLayer {
    type Service = IdempotencyService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        IdempotencyService::new(
            inner,
            self.rules().clone(),
            self.layer_options(),
            self.tracker.clone(),
            (self.live_tokens.clone(), self.body_budget.clone()),
        )
    }
}
