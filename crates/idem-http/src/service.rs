//! The service: one request through the key protocol.

use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use bytes::{Bytes, BytesMut};
use http::{header, HeaderMap, HeaderValue, Method, Request, Response, StatusCode};
use http_body::Body;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use idem_core::token::{SubmitTokens, TokenOutcome};
use idem_core::{
    Action, DynStore, Engine, Fingerprint, HoldReason, IdempotencyKey, Outcome, Saved, Scope,
    StoreError,
};
use tokio_util::task::TaskTracker;
use tower_service::Service;
use tracing::Instrument;

use crate::body::{full, Prefixed};
use crate::body_key::{key_from_json, BodyKeyError};
use crate::budget::{BodyBudget, Reservation};
use crate::fingerprint::request_fingerprint_with;
use crate::future::ResponseFuture;
use crate::key::KeySource;
use crate::key::{
    key_from_header, key_header_value, KeyHeaderError, IDEMPOTENCY_KEY, IDEMPOTENCY_STATUS,
    IDEMPOTENT_REPLAYED,
};
use crate::observe::{token_rejected, Finished, Observer, RequestOutcome, TokenRejection};
use crate::options::{FailOpenGuard, Options};
use crate::path::{normalize_path, PathError};
use crate::policy::Disposition;
use crate::problem::Problem;
use crate::replay::{replay_response, to_stored};
use crate::routes::{Rules, Table};
use crate::tokens::TokenBudget;
use crate::{BoxBody, BoxError};

/// The service made by [`crate::IdempotencyLayer`].
///
/// It implements `Service<http::Request<B>>` with
/// `Response = http::Response<BoxBody>` and `Error = S::Error` for
///
/// - `S: Service<http::Request<BoxBody>, Response = http::Response<RB>> + Clone + Send + 'static`,
///   `S::Future: Send + 'static`, `S::Error: Send + 'static`;
/// - `B: http_body::Body<Data = Bytes> + Send + 'static`, `B::Error: Into<BoxError>`;
/// - `RB: http_body::Body<Data = Bytes> + Send + 'static`, `RB::Error: Into<BoxError>`.
///
/// Guarded requests run in a spawned task (when a tokio runtime is
/// present) tracked by the layer's [`TaskTracker`], so a client that
/// disconnects does not cancel the inner call or the save, and a server can
/// wait for such runs at shutdown. An inner `Err` releases the key and is
/// returned as is.
///
/// With fail-open ([`Options::fail_open`]), a guarded request whose store
/// failed before the inner service was called is handed to the inner
/// service as it was buffered, and its answer is marked
/// `Idempotency-Status: unprotected`.
#[derive(Debug, Clone)]
pub struct IdempotencyService<S> {
    inner: S,
    /// The rules in force (swapped by [`crate::IdempotencyLayer::reload`]).
    rules: Arc<ArcSwap<Table>>,
    /// The layer's settings (the layer-wide ones apply to every route).
    options: Arc<Options>,
    tracker: TaskTracker,
    /// The layer's live submit tokens (a used token stops counting).
    live_tokens: Arc<TokenBudget>,
    /// The layer's budget of buffered body bytes.
    body_budget: BodyBudget,
}

impl<S> IdempotencyService<S> {
    pub(crate) fn new(
        inner: S,
        rules: Arc<ArcSwap<Table>>,
        options: Arc<Options>,
        tracker: TaskTracker,
        (live_tokens, body_budget): (Arc<TokenBudget>, BodyBudget),
    ) -> Self {
        Self {
            inner,
            rules,
            options,
            tracker,
            live_tokens,
            body_budget,
        }
    }

    /// The wrapped service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The settings.
    pub fn options(&self) -> &Options {
        &self.options
    }
}

impl<S, B, RB> Service<Request<B>> for IdempotencyService<S>
where
    S: Service<Request<BoxBody>, Response = Response<RB>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
    RB: Body<Data = Bytes> + Send + 'static,
    RB::Error: Into<BoxError>,
{
    type Response = Response<BoxBody>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: Request<B>) -> Self::Future {
        // Take the service that was driven to readiness; leave a clone.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        // The rules this request keeps to its end, whatever a reload does.
        let table = self.rules.load_full();
        let started = Instant::now();
        let access_log = self.options.access_log;
        let log = |req: &Request<B>, rules: &Rules| LogCtx {
            started,
            method: req.method().clone(),
            path: req.uri().path().to_owned(),
            route: rules.name.clone(),
            raw_key: None,
            observer: rules.observer.clone(),
        };
        if !table.methods.contains(req.method()) {
            if let Some(guarded) = case_variant_of(&table.methods, req.method()) {
                return ready(
                    log(&req, &table.default).rejected(method_case(req.method(), guarded)),
                );
            }
            // Unguarded: no log context (the path is copied only for the
            // access log).
            let span = crate::trace::proxy_span(req.method(), req.uri().path(), req.headers());
            return span
                .in_scope(|| pass_through(&mut inner, req, started, &table, access_log))
                .in_span(span);
        }
        let entered = crate::trace::request_span(req.method(), req.headers()).entered();
        // Every decision by path (routes, token routes, the fingerprint)
        // and the inner service see one normalised path.
        let normal = match normalized_uri(req.uri()) {
            Ok(uri) => uri,
            Err(e) => return ready(log(&req, &table.default).rejected(ambiguous_path(&e))),
        };
        let normal_path = normal.as_ref().map_or(req.uri().path(), |u| u.path());
        let Some(rules) = table.rules_for_path(req.method(), normal_path) else {
            // No rule guards this method on this path: untouched.
            return pass_through(&mut inner, req, started, &table, access_log)
                .in_span(entered.exit());
        };
        // The token prefixes hold on every route: a pass-through route
        // under one is guarded by the layer's own rules.
        let rules = if !rules.guard && self.options.token_required(normal_path) {
            &table.default
        } else {
            rules
        };
        if !rules.guard {
            return pass_through(&mut inner, req, started, &table, access_log)
                .in_span(entered.exit());
        }
        if let Some(uri) = normal {
            *req.uri_mut() = uri;
        }
        let log = log(&req, rules);
        crate::trace::record_path(&log.path);
        let options = rules.options.clone();
        let token = rules.token || options.token_required(req.uri().path());
        // A token is checked in the scope it was issued in: the layer's.
        let scope_by = if token {
            &self.options.scope
        } else {
            &options.scope
        };
        let key = match &options.key_source {
            KeySource::Header(name) => match key_from_header(req.headers(), name) {
                Ok(Some(key)) => {
                    // The key goes on in one form, the bare value: `"abc"`,
                    // `abc` and `"abc";p=1` are one key here, so they must
                    // be one value to the inner service (and the upstream's
                    // own unique constraint) too.
                    if let Some(v) = key_header_value(&key) {
                        req.headers_mut().insert(name.clone(), v);
                    }
                    Some(key)
                }
                Ok(None) if token => return ready(log.rejected(token_missing())),
                Ok(None) if !options.require_key => {
                    return pass_through(&mut inner, req, started, &table, access_log)
                        .in_span(entered.exit());
                }
                Ok(None) => return ready(log.rejected(key_required(name.as_str()))),
                Err(e) => {
                    let log = LogCtx {
                        raw_key: Some(raw_key_for_log(req.headers(), name)),
                        ..log
                    };
                    return ready(log.rejected(invalid_key(&e, name.as_str())));
                }
            },
            // Known once the body is read.
            KeySource::JsonPointer(_) => None,
        };
        let scope = match scope_by.scope_in(req.headers(), req.extensions()) {
            Ok(scope) => scope,
            Err(e) => return ready(log.rejected(client_certificate_required(&e))),
        };
        if let Some(len) = content_length(req.headers()) {
            if len > options.max_body as u64 {
                let problem = too_large(options.max_body);
                return ready(match key {
                    Some(key) => KeyedLog {
                        ctx: log,
                        scope,
                        key,
                    }
                    .rejected(problem),
                    None => log.rejected(problem),
                });
            }
        }
        let guarded = Guarded {
            engine: rules.engine.clone(),
            options,
            token,
            live_tokens: self.live_tokens.clone(),
            log,
            scope,
            key,
            body_budget: self.body_budget.clone(),
            running: rules.observer.running(),
            table: table.clone(),
        };
        guarded
            .respond::<S, S::Future, S::Error, B, RB>(inner, req, self.tracker.clone())
            .in_span(entered.exit())
    }
}

/// 400 `client-certificate-required`: scoped by the TLS client
/// certificate ([`crate::ScopeBy::ClientCert`]), and the request came
/// without one. Never the anonymous scope: two callers would share keys.
fn client_certificate_required(e: &crate::ClientCertificateRequired) -> Problem {
    Problem::new(
        StatusCode::BAD_REQUEST,
        "client-certificate-required",
        format!(
            "{e}: send the request over a TLS connection that presents a client certificate \
             this server trusts."
        ),
    )
}

/// 428 `token-required`: a token route without a key.
fn token_missing() -> Problem {
    token_rejected(TokenRejection::Missing);
    Problem::new(
        StatusCode::PRECONDITION_REQUIRED,
        "token-required",
        "This request must carry a submit token as its Idempotency-Key. Get one \
         from the service (the gateway issues them at POST /_idem/tokens) before \
         submitting.",
    )
}

/// 400 `key-required`: a route that requires a key, without one in `from`
/// (a header name or a JSON Pointer into the body).
fn key_required(from: &str) -> Problem {
    let detail = if from.starts_with('/') || from.is_empty() {
        format!(
            "This request must carry an idempotency key in its JSON body, at the JSON \
             Pointer {from:?} (RFC 6901)."
        )
    } else if from.eq_ignore_ascii_case(IDEMPOTENCY_KEY.as_str()) {
        "This request must carry an Idempotency-Key header.".to_owned()
    } else {
        format!("This request must carry an idempotency key in its {from} header.")
    };
    Problem::new(StatusCode::BAD_REQUEST, "key-required", detail)
}

/// 400 `invalid-key` or `multiple-keys` for a key header that does not parse.
fn invalid_key(e: &KeyHeaderError, header: &str) -> Problem {
    let kind = match e {
        KeyHeaderError::Multiple { .. } => "multiple-keys",
        _ => "invalid-key",
    };
    Problem::new(
        StatusCode::BAD_REQUEST,
        kind,
        format!(
            "{e} ({header}). An Idempotency-Key is 1 to 255 characters of 0x20-0x7E, not all \
             blank, sent bare or as a structured-field string (\"key\")."
        ),
    )
}

/// Everything a guarded request needs once its body is read.
struct Guarded {
    engine: Engine<DynStore>,
    /// The route's settings.
    options: Arc<Options>,
    /// The key must be a live submit token ([`crate::Options::require_token`]).
    token: bool,
    live_tokens: Arc<TokenBudget>,
    /// The log context.
    log: LogCtx,
    /// The caller's scope.
    scope: Scope,
    /// The key from a header; `None` until the body is read for a key
    /// taken from the body ([`KeySource::JsonPointer`]).
    key: Option<IdempotencyKey>,
    /// The rules in force when the request arrived (for a pass-through
    /// decided after the body is read).
    table: Arc<Table>,
    /// The layer's budget of buffered body bytes.
    body_budget: BodyBudget,
    /// Counts this request in `idem_in_flight` until it is done.
    running: crate::observe::Running,
}

impl Guarded {
    /// Reads the body (413/400 on failure, key untouched), fingerprints the
    /// request, then runs [`Guarded::run`] in a task spawned on `tracker`.
    ///
    /// Generic over the inner service's future `F` and error `E` (rather
    /// than naming `S::Future` / `S::Error` inside the async block) so the
    /// future is provably `Send`.
    fn respond<S, F, E, B, RB>(
        self,
        inner: S,
        req: Request<B>,
        tracker: TaskTracker,
    ) -> ResponseFuture<E>
    where
        S: Service<Request<BoxBody>, Response = Response<RB>, Future = F, Error = E>
            + Send
            + 'static,
        F: std::future::Future<Output = Result<Response<RB>, E>> + Send + 'static,
        E: Send + 'static,
        B: Body<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
        RB: Body<Data = Bytes> + Send + 'static,
        RB::Error: Into<BoxError>,
    {
        ResponseFuture::new(async move {
            let (parts, body) = req.into_parts();
            let reservation = self.body_budget.reservation();
            let declared = content_length(&parts.headers);
            let mut this = self;
            let (bytes, reservation) =
                match read_body(body, declared, &this.options, reservation).await {
                    Ok(read) => read,
                    Err(refused) => return Ok(this.refuse(refused)),
                };
            let key = match (this.key.take(), &this.options.key_source) {
                (Some(key), _) => key,
                (None, KeySource::JsonPointer(pointer)) => {
                    match body_key(&bytes, pointer, this.token, this.options.require_key) {
                        Ok(key) => key,
                        Err(None) => {
                            // No key in the body and none required: the
                            // buffered request goes through untouched.
                            let req = Request::from_parts(
                                parts,
                                Reserved::new(full(bytes), reservation).boxed_unsync(),
                            );
                            let access_log = this.options.access_log;
                            let Guarded { log, table, .. } = this;
                            let mut inner = inner;
                            return pass_through(&mut inner, req, log.started, &table, access_log)
                                .await;
                        }
                        Err(Some(problem)) => return Ok(this.refuse(problem)),
                    }
                }
                (None, KeySource::Header(_)) => {
                    unreachable!("a header key is parsed before the body is read")
                }
            };
            let Guarded {
                engine,
                options,
                token,
                live_tokens,
                log,
                scope,
                running,
                ..
            } = this;
            let log = Arc::new(KeyedLog {
                ctx: log,
                scope,
                key,
            });
            let fingerprint = request_fingerprint_with(
                &options.fingerprint,
                &parts.method,
                &parts.uri,
                &parts.headers,
                &bytes,
            );
            // The reserved bytes go back to the budget when the inner
            // service drops the buffered body.
            let body = Reserved::new(full(bytes), reservation).boxed_unsync();
            let req = Request::from_parts(parts, body);
            let run = Run {
                engine,
                options,
                token,
                live_tokens,
                log: log.clone(),
                running,
            };
            // The spawned run goes on in the request's span.
            let job = Box::pin(
                run.run::<S, F, E, RB>(inner, req, fingerprint)
                    .instrument(tracing::Span::current()),
            );
            match tokio::runtime::Handle::try_current() {
                Ok(rt) => match tracker.spawn_on(job, &rt).await {
                    Ok(result) => result,
                    Err(e) => {
                        // The inner service panicked (or the runtime is
                        // shutting down). The engine's guard left the key to
                        // its lease, so it is not stuck.
                        tracing::error!(target: "idem", key = %log.key, error = %e, "the guarded request's task failed");
                        Ok(log.finish(
                            RequestOutcome::Executed,
                            Problem::new(
                                StatusCode::INTERNAL_SERVER_ERROR,
                                "internal",
                                "The request failed unexpectedly. Its outcome is unknown; \
                                 a retry with the same key is accepted once the key's lease ends.",
                            )
                            .into_response(),
                            Some("held"),
                        ))
                    }
                },
                Err(_) => job.await,
            }
        })
    }

    /// Records a refusal before the run and hands it back.
    fn refuse(&self, problem: Problem) -> Response<BoxBody> {
        match &self.key {
            Some(key) => {
                let resp = problem.into_response();
                self.log.observe(
                    Some((&self.scope, key)),
                    RequestOutcome::Rejected,
                    Some(resp.status()),
                    None,
                );
                resp
            }
            None => self.log.rejected(problem),
        }
    }
}

/// A guarded request with its key, ready to claim it.
struct Run {
    engine: Engine<DynStore>,
    options: Arc<Options>,
    token: bool,
    live_tokens: Arc<TokenBudget>,
    /// The log context, with the caller's scope and the key.
    log: Arc<KeyedLog>,
    running: crate::observe::Running,
}

impl Run {
    /// Claims the key and runs the inner service once, or answers from the
    /// store; when the store fails before the run, fails open or answers
    /// 503 ([`StoreFailure`]).
    async fn run<S, F, E, RB>(
        self,
        inner: S,
        req: Request<BoxBody>,
        fingerprint: Fingerprint,
    ) -> Result<Response<BoxBody>, E>
    where
        S: Service<Request<BoxBody>, Response = Response<RB>, Future = F, Error = E>,
        F: std::future::Future<Output = Result<Response<RB>, E>>,
        RB: Body<Data = Bytes> + Send + 'static,
        RB::Error: Into<BoxError>,
    {
        let Run {
            engine,
            options,
            token,
            live_tokens,
            log,
            running: _running,
        } = self;
        let (scope, key) = (&log.scope, &log.key);
        let store = engine.store().clone();
        let policy = &options.policy;
        let retention_limit = options.retention_limit;
        let share_failure = engine.config().share_failure;
        // The inner service and the request until the engine runs them:
        // still here once the engine returns means nothing was sent.
        let mut unsent = Some((inner, req));
        let op = |lease: idem_core::Lease| {
            let sent = unsent.take();
            async move {
                let Some((mut inner, mut req)) = sent else {
                    unreachable!("the engine runs its operation at most once")
                };
                req.extensions_mut().insert(crate::Fence(lease.fence));
                match inner.call(req).await {
                    Err(e) => (Err(e), Action::Release),
                    Ok(resp) => {
                        let (resp, action) =
                            first_response(resp, policy, retention_limit, share_failure).await;
                        (Ok(resp), action)
                    }
                }
            }
        };
        let outcome = if token {
            let outcome = SubmitTokens::from_engine(engine)
                .execute(scope, key.as_str(), fingerprint, op)
                .await;
            // A token stops counting against the budget once it is used up
            // (its result stored, or found used) or the store no longer
            // knows it; released, held or in flight, it is still live.
            // A shared failure (`released`) leaves the token live: a
            // retry after the window runs.
            if matches!(
                outcome,
                Ok(TokenOutcome::TokenRejected
                    | TokenOutcome::Keyed(
                        Outcome::Executed {
                            saved: Saved::Stored,
                            ..
                        } | Outcome::Mismatch
                    ))
            ) || matches!(&outcome, Ok(TokenOutcome::Keyed(Outcome::Replayed(r))) if !r.released)
            {
                live_tokens.consume(scope, key.as_str());
            }
            match outcome {
                Ok(TokenOutcome::Keyed(outcome)) => Ok(outcome),
                Ok(TokenOutcome::TokenRejected) => {
                    token_rejected(TokenRejection::Unknown);
                    return Ok(log.rejected(token_unknown()));
                }
                Err(e) => Err(e),
            }
        } else {
            engine.execute(scope, key, fingerprint, op).await
        };
        match outcome {
            Err(e) => {
                // A token cannot be checked without the store: token routes
                // never fail open.
                let fail_open = options.fail_open.as_deref().filter(|_| !token);
                store_failed(&e, unsent, fail_open, &log).await
            }
            Ok(Outcome::Executed { value, saved, .. }) => {
                let saved = match &saved {
                    Saved::Stored => "stored",
                    Saved::Released => "released",
                    Saved::Held => "held",
                    Saved::LeaseLost => {
                        tracing::warn!(target: "idem", key = %key, "the lease was lost before the result was saved; a newer run owns the key");
                        "lease-lost"
                    }
                    Saved::Failed(e) => {
                        tracing::error!(target: "idem", key = %key, error = %e, "saving the result failed; answering the first caller anyway, the key is held until its lease ends");
                        "failed"
                    }
                };
                // Released: nothing is kept and a retry runs again (also a
                // 502 for an upstream that was never reached).
                let outcome = if saved == "released" {
                    RequestOutcome::Released
                } else {
                    RequestOutcome::Executed
                };
                match value {
                    Ok(resp) => Ok(log.finish(outcome, resp, Some(saved))),
                    Err(e) => {
                        log.inner_error(outcome, saved);
                        Err(e)
                    }
                }
            }
            Ok(Outcome::Replayed(stored)) => {
                Ok(log.finish(RequestOutcome::Replayed, replay_response(&stored), None))
            }
            Ok(Outcome::InFlight { retry_after }) => {
                if !token {
                    if let Some(resp) = held_answer(&store, scope, key).await {
                        return Ok(log.finish(RequestOutcome::InFlight, resp, None));
                    }
                }
                let secs = retry_after_secs(retry_after);
                let resp = Problem::new(
                    StatusCode::CONFLICT,
                    "in-flight",
                    format!(
                        "A request with this Idempotency-Key is still being processed. \
                         Retry after {secs} s."
                    ),
                )
                .with_header(header::RETRY_AFTER, HeaderValue::from(secs))
                .into_response();
                Ok(log.finish(RequestOutcome::InFlight, resp, None))
            }
            Ok(Outcome::Mismatch) => {
                let resp = Problem::new(
                    StatusCode::UNPROCESSABLE_ENTITY,
                    "key-mismatch",
                    "This Idempotency-Key was already used for a different request (its \
                     method, path, query, content type or body differ). Use a new key for a \
                     new request.",
                )
                .into_response();
                Ok(log.finish(RequestOutcome::Mismatch, resp, None))
            }
        }
    }
}

/// The key in a JSON body at `pointer`. `Err(None)`: no key and none
/// required (pass the request through); `Err(Some(problem))`: refused
/// (400 `key-required`, `invalid-key`, `body-not-json`, or 428
/// `token-required` on a token route).
///
/// A body that is not I-JSON (RFC 7493: malformed, a duplicate member
/// name, a lone surrogate, nested 128 levels deep or more) is refused whether a key
/// is required or not: a parser of the upstream may still read a key in it
/// (the last of two `event_id` members), so passing it through would run
/// an event that already ran.
fn body_key(
    body: &[u8],
    pointer: &str,
    token: bool,
    require_key: bool,
) -> Result<IdempotencyKey, Option<Problem>> {
    match key_from_json(body, pointer) {
        Ok(Some(key)) => Ok(key),
        Ok(None) if token => Err(Some(token_missing())),
        Ok(None) if !require_key => Err(None),
        Ok(None) => Err(Some(
            key_required(pointer).with_member("key_json_pointer", pointer),
        )),
        Err(e @ BodyKeyError::NotJson) => Err(Some(
            Problem::new(
                StatusCode::BAD_REQUEST,
                "body-not-json",
                format!(
                    "{e}: this route reads the idempotency key from the JSON body (at the JSON \
                     Pointer {pointer:?}, RFC 6901), and a body that is not I-JSON (RFC 7493: \
                     malformed, a duplicate member name, a lone surrogate, nested deeper than \
                     128) cannot be judged. Send the body as plain JSON."
                ),
            )
            .with_member("key_json_pointer", pointer),
        )),
        Err(e) => Err(Some(
            Problem::new(
                StatusCode::BAD_REQUEST,
                "invalid-key",
                format!(
                    "{e}. An idempotency key is 1 to 255 characters of 0x20-0x7E, not all \
                     blank: a JSON string, or an integer."
                ),
            )
            .with_member("key_json_pointer", pointer),
        )),
    }
}

/// Calls `inner` with the request's body boxed, and boxes the response body:
/// no buffering, no limit. Counted as [`RequestOutcome::Passthrough`]
/// (from `started`) under the route `table` names for it, and logged with
/// `access_log`.
fn pass_through<S, B, RB>(
    inner: &mut S,
    req: Request<B>,
    started: Instant,
    table: &Table,
    access_log: bool,
) -> ResponseFuture<S::Error>
where
    S: Service<Request<BoxBody>, Response = Response<RB>>,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
    RB: Body<Data = Bytes> + Send + 'static,
    RB::Error: Into<BoxError>,
{
    let rules = table.counted_under(req.method(), req.uri().path());
    let access = access_log.then(|| {
        let path = match normalize_path(req.uri().path()) {
            Ok(p) => p.into_owned(),
            Err(_) => req.uri().path().to_owned(),
        };
        (req.method().clone(), path, rules.name.clone())
    });
    let observer = rules.observer.clone();
    let fut = inner.call(req.map(|b| b.map_err(Into::into).boxed_unsync()));
    boxed_response(fut, started, observer, access)
}

/// The inner service's future with its response body boxed, counted as a
/// pass-through when it resolves. Generic over the future (not
/// `S::Future`) so the async block is provably `Send`.
fn boxed_response<F, E, RB>(
    fut: F,
    started: Instant,
    observer: Arc<Observer>,
    access: Option<(Method, String, Arc<str>)>,
) -> ResponseFuture<E>
where
    F: std::future::Future<Output = Result<Response<RB>, E>> + Send + 'static,
    E: Send + 'static,
    RB: Body<Data = Bytes> + Send + 'static,
    RB::Error: Into<BoxError>,
{
    ResponseFuture::new(async move {
        let resp = fut.await;
        let (method, path, route) = match &access {
            Some((m, p, r)) => (m, p.as_str(), &**r),
            None => (&Method::GET, "", crate::observe::DEFAULT_ROUTE),
        };
        observer.finished(&Finished {
            outcome: RequestOutcome::Passthrough,
            status: resp.as_ref().ok().map(Response::status),
            elapsed: started.elapsed(),
            method,
            path,
            route,
            key: None,
            scoped: None,
            saved: None,
            log: access.is_some(),
        });
        Ok(resp?.map(|b| b.map_err(Into::into).boxed_unsync()))
    })
}

fn ready<E: Send + 'static>(resp: Response<BoxBody>) -> ResponseFuture<E> {
    ResponseFuture::new(std::future::ready(Ok(resp)))
}

/// The store failed before the run (`unsent` holds the inner service and
/// the request when nothing was sent): with a `fail_open` guard that
/// allows the key, an unavailable store lets the request through
/// unprotected — the buffered request goes to `inner`, the answer is marked
/// `Idempotency-Status: unprotected` and nothing is recorded; otherwise the
/// answer is the failure's problem.
async fn store_failed<S, F, E, RB>(
    e: &StoreError,
    unsent: Option<(S, Request<BoxBody>)>,
    fail_open: Option<&dyn FailOpenGuard>,
    log: &KeyedLog,
) -> Result<Response<BoxBody>, E>
where
    S: Service<Request<BoxBody>, Response = Response<RB>, Future = F, Error = E>,
    F: std::future::Future<Output = Result<Response<RB>, E>>,
    RB: Body<Data = Bytes> + Send + 'static,
    RB::Error: Into<BoxError>,
{
    let (scope, key) = (&log.scope, &log.key);
    let failure = StoreFailure::logged(key, e);
    match (unsent, fail_open) {
        (Some((mut inner, req)), Some(guard)) if failure == StoreFailure::Unavailable => {
            if guard.allows(scope, key) {
                tracing::warn!(
                    target: "idem", key = %key, method = %log.method, path = %log.path,
                    "FAIL-OPEN: the idempotency store is unavailable; forwarding WITHOUT idempotency \
                     protection. This request is not recorded: a retry of it may run again (double charge)."
                );
                let (mut parts, body) = inner.call(req).await?.into_parts();
                // Only replays say they are replays.
                parts.headers.remove(IDEMPOTENT_REPLAYED);
                parts
                    .headers
                    .insert(IDEMPOTENCY_STATUS, HeaderValue::from_static("unprotected"));
                let resp = Response::from_parts(parts, body.map_err(Into::into).boxed_unsync());
                return Ok(log.finish(RequestOutcome::FailedOpen, resp, None));
            }
            tracing::error!(
                target: "idem", key = %key, method = %log.method, path = %log.path,
                "FAIL-OPEN REFUSED: the idempotency store is unavailable, but this key was seen \
                 claimed or completed moments ago; forwarding it would run it twice. Answering 503."
            );
            Ok(log.finish(
                RequestOutcome::StoreError,
                failure.problem().into_response(),
                None,
            ))
        }
        _ => Ok(log.finish(
            RequestOutcome::StoreError,
            failure.problem().into_response(),
            None,
        )),
    }
}

/// The guarded method that `method` equals except for ASCII case (`post`
/// for `POST`), if any. `method` itself is not guarded.
fn case_variant_of<'a>(guarded: &'a [Method], method: &Method) -> Option<&'a Method> {
    guarded
        .iter()
        .find(|g| g.as_str().eq_ignore_ascii_case(method.as_str()))
}

/// 400 `method-case`: methods are case-sensitive (RFC 9110 §9.1), and an
/// upstream that upper-cases them (Werkzeug, Rack) would run `post` as the
/// guarded POST; refused as nginx refuses lowercase methods.
fn method_case(method: &Method, guarded: &Method) -> Problem {
    Problem::new(
        StatusCode::BAD_REQUEST,
        "method-case",
        format!(
            "The method {:?} differs from the guarded method {guarded} only in letter case. \
             Methods are case-sensitive (RFC 9110, section 9.1): send {guarded}.",
            method.as_str()
        ),
    )
    .with_member("method", method.as_str())
}

/// `uri` with its path normalised ([`normalize_path`]) and its query kept
/// as it is: `Ok(None)` when the path is normal already.
///
/// # Errors
/// The [`PathError`] of an ambiguous path (or one that does not start with
/// `/`: `*`, an authority-form target).
pub(crate) fn normalized_uri(uri: &http::Uri) -> Result<Option<http::Uri>, PathError> {
    let path = match normalize_path(uri.path()) {
        Ok(std::borrow::Cow::Borrowed(_)) => return Ok(None),
        Ok(std::borrow::Cow::Owned(p)) => p,
        Err(e) => return Err(e),
    };
    let pq = match uri.query() {
        Some(q) => format!("{path}?{q}"),
        None => path,
    };
    let mut parts = uri.clone().into_parts();
    parts.path_and_query = Some(pq.parse().map_err(|_| PathError::NotAbsolute)?);
    http::Uri::from_parts(parts)
        .map(Some)
        .map_err(|_| PathError::NotAbsolute)
}

/// 400 `ambiguous-path` for a path that [`normalize_path`] refuses.
pub(crate) fn ambiguous_path(e: &PathError) -> Problem {
    Problem::new(
        StatusCode::BAD_REQUEST,
        "ambiguous-path",
        format!(
            "The request path is refused: {e}. Servers read such a path in different ways, so no \
             rule about it could hold; send the path in plain form."
        ),
    )
}

/// Reads a guarded request body within [`Options::body_timeout`] in all,
/// at most [`Options::max_body`] bytes, each byte reserved on the layer's
/// budget first (the declared length up front, else chunk by chunk).
///
/// Refusals (the key is untouched): 413 `body-too-large`, 503
/// `overloaded` when the budget has no room, 408 `body-timeout`, 400
/// `body-unreadable`. The bytes read so far and their reservation are
/// dropped with the refusal.
async fn read_body<B>(
    body: B,
    declared: Option<u64>,
    options: &Options,
    mut reservation: Reservation,
) -> Result<(Bytes, Reservation), Problem>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let max_body = options.max_body;
    let mut buf = BytesMut::new();
    if let Some(len) = declared {
        // `call` refused a declared length above max_body.
        let len = usize::try_from(len).unwrap_or(usize::MAX).min(max_body);
        reservation.grow_to(len).map_err(|_| overloaded())?;
        buf.reserve(len);
    }
    let read = async {
        let mut body = std::pin::pin!(Limited::new(body, max_body));
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| {
                if e.downcast_ref::<LengthLimitError>().is_some() {
                    too_large(max_body)
                } else {
                    Problem::new(
                        StatusCode::BAD_REQUEST,
                        "body-unreadable",
                        format!("The request body could not be read: {e}"),
                    )
                }
            })?;
            if let Ok(data) = frame.into_data() {
                reservation
                    .grow_to(buf.len() + data.len())
                    .map_err(|_| overloaded())?;
                buf.extend_from_slice(&data);
            }
        }
        Ok::<_, Problem>(())
    };
    match tokio::time::timeout(options.body_timeout, read).await {
        Ok(Ok(())) => Ok((buf.freeze(), reservation)),
        Ok(Err(problem)) => Err(problem),
        Err(_) => Err(Problem::new(
            StatusCode::REQUEST_TIMEOUT,
            "body-timeout",
            format!(
                "The request body did not arrive within {} ms; nothing was run and the \
                 Idempotency-Key was not used. Send the request again.",
                options.body_timeout.as_millis()
            ),
        )
        .with_member("body_timeout_ms", options.body_timeout.as_millis() as u64)
        .with_header(header::CONNECTION, HeaderValue::from_static("close"))),
    }
}

/// 503 `overloaded`: the layer's budget of buffered body bytes
/// ([`Options::max_buffered`]) has no room for this body.
fn overloaded() -> Problem {
    Problem::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "overloaded",
        "Too many request bodies are being received at once; this one was not read and \
         nothing was run. Retry later with the same Idempotency-Key.",
    )
    .with_header(header::RETRY_AFTER, HeaderValue::from(1u32))
    .with_header(header::CONNECTION, HeaderValue::from_static("close"))
}

pin_project_lite::pin_project! {
    /// A buffered request body that holds its bytes' [`Reservation`] until
    /// it is dropped.
    struct Reserved {
        #[pin]
        inner: BoxBody,
        reservation: Reservation,
    }
}

impl Reserved {
    fn new(inner: BoxBody, reservation: Reservation) -> Self {
        Self { inner, reservation }
    }
}

impl Body for Reserved {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, BoxError>>> {
        self.project().inner.poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

fn content_length(headers: &HeaderMap) -> Option<u64> {
    headers
        .get(header::CONTENT_LENGTH)?
        .to_str()
        .ok()?
        .trim()
        .parse()
        .ok()
}

fn too_large(max: usize) -> Problem {
    Problem::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        "body-too-large",
        format!("The request body is larger than {max} bytes."),
    )
    .with_member("max_body", max)
}

/// Whole seconds left on a lease, rounded up, at least 1.
/// Longest `Retry-After` of a held key's 409: 1 day.
const MAX_HELD_RETRY_AFTER: u64 = 24 * 3600;

/// 409 `held` for a key in flight whose record says it is held (its first
/// request's outcome is unknown: [`idem_core::HoldReason`]), with the
/// reason and a `Retry-After` of the time left on the hold (at most 1 day);
/// `None` when the record is not held, or cannot be read within 1 s (the
/// caller answers the plain 409 `in-flight`).
async fn held_answer(
    store: &DynStore,
    scope: &idem_core::Scope,
    key: &IdempotencyKey,
) -> Option<Response<BoxBody>> {
    let read = tokio::time::timeout(Duration::from_secs(1), store.get(scope, key)).await;
    let Ok(Ok(Some(idem_core::Record {
        state:
            idem_core::RecordState::InProgress {
                held: Some(reason),
                lease_until,
                ..
            },
        ..
    }))) = read
    else {
        return None;
    };
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
    let secs = retry_after_secs(Duration::from_millis(lease_until.0.saturating_sub(now)))
        .min(MAX_HELD_RETRY_AFTER);
    Some(
        Problem::new(
            StatusCode::CONFLICT,
            "held",
            format!(
                "The first request with this Idempotency-Key has an unknown outcome ({reason}): \
                 it may have taken effect, so the key is held and the request is not run again \
                 until an operator settles it or the hold ends. Retry after {secs} s."
            ),
        )
        .with_member("reason", reason.as_str())
        .with_header(header::RETRY_AFTER, HeaderValue::from(secs))
        .into_response(),
    )
}

fn retry_after_secs(left: Duration) -> u64 {
    (left.as_secs() + u64::from(left.subsec_nanos() > 0)).max(1)
}

/// 403 `token-unknown`: the key of a token route is not a live submit token
/// of the caller's scope.
fn token_unknown() -> Problem {
    Problem::new(
        StatusCode::FORBIDDEN,
        "token-unknown",
        "This Idempotency-Key is not a live submit token for this caller: it was never issued \
         to this caller, or it expired before its first use. Get a new token and submit again; \
         nothing was run.",
    )
}

/// What a store error before the run means for the request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum StoreFailure {
    /// The stored record does not decode: 500 `corrupt-record`.
    Corrupt,
    /// The store refuses new records: 503 `store-full`.
    Full,
    /// The store cannot be reached or timed out: 503 `store-unavailable`
    /// (the case fail-open forwards).
    Unavailable,
}

impl StoreFailure {
    /// Classifies `e` and logs it.
    fn logged(key: &IdempotencyKey, e: &StoreError) -> Self {
        match e {
            StoreError::Corrupt { .. } => {
                tracing::error!(target: "idem", key = %key, error = %e, "corrupt idempotency record");
                Self::Corrupt
            }
            StoreError::Full { .. } => {
                tracing::error!(target: "idem", key = %key, error = %e, "idempotency store full");
                Self::Full
            }
            _ => {
                tracing::error!(target: "idem", key = %key, error = %e, "idempotency store unavailable");
                Self::Unavailable
            }
        }
    }

    fn problem(self) -> Problem {
        match self {
            Self::Corrupt => Problem::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "corrupt-record",
                "The stored record for this Idempotency-Key is corrupt; the request was not run.",
            ),
            Self::Full => Problem::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "store-full",
                "The idempotency store is full; the request was not run. Retry later.",
            ),
            Self::Unavailable => Problem::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "store-unavailable",
                "The idempotency store is unavailable; the request was not run. Retry later.",
            ),
        }
    }
}

/// What the inner service's response becomes, and what to do with the key.
///
/// A released answer (a 5xx, an unreachable upstream) whose body fits in
/// `retention_limit` is shared with the duplicates for `share_failure`
/// ([`Action::ReleaseWith`]); its stored copy gains `Retry-After` (whole
/// seconds, rounded up, at least 1; RFC 9110 §10.2.3) when the service sent
/// none, so a duplicate that gets it knows when a retry runs again.
async fn first_response<RB>(
    resp: Response<RB>,
    policy: &crate::policy::StatusPolicy,
    retention_limit: usize,
    share_failure: std::time::Duration,
) -> (Response<BoxBody>, Action)
where
    RB: Body<Data = Bytes> + Send + 'static,
    RB::Error: Into<BoxError>,
{
    let (mut parts, body) = resp.into_parts();
    if parts.status.is_informational() {
        // A 1xx is not an answer to the request: never stored, whatever the
        // policy says. A 101 switched the connection to another protocol
        // the layer cannot follow; the key is released for a retry.
        tracing::warn!(
            target: "idem",
            status = parts.status.as_u16(),
            "the inner service answered a guarded request with a 1xx status; answering 502, the key is released"
        );
        return (informational_answer(parts.status), Action::Release);
    }
    // Only replays say they are replays.
    parts.headers.remove(IDEMPOTENT_REPLAYED);
    let disposition = parts
        .extensions
        .get::<Disposition>()
        .copied()
        .unwrap_or_else(|| policy.disposition(parts.status));
    let body: BoxBody = body.map_err(Into::into).boxed_unsync();
    let (body, action) = match disposition {
        Disposition::Release if share_failure.is_zero() => (body, Action::Release),
        Disposition::Release => match capture(body, retention_limit).await {
            Captured::Complete { data, trailers } => {
                let mut stored = to_stored(parts.status, &parts.headers, data.clone(), false);
                if !parts.headers.contains_key(header::RETRY_AFTER) {
                    let secs = retry_after_secs(share_failure);
                    stored
                        .headers
                        .push(("retry-after".to_owned(), secs.to_string().into_bytes()));
                }
                (
                    Prefixed::complete(data, trailers).boxed_unsync(),
                    Action::ReleaseWith(stored),
                )
            }
            // Too large to share: released at once, the body streamed on.
            Captured::OverLimit { prefix, rest } => {
                (Prefixed::then(prefix, rest).boxed_unsync(), Action::Release)
            }
            Captured::Failed { prefix, error } => {
                tracing::warn!(
                    target: "idem",
                    status = parts.status.as_u16(),
                    received = prefix.len(),
                    error = %error,
                    "the body of a failure answer failed while it was buffered; answering 502, the key is released"
                );
                return (
                    body_failed(parts.status, prefix.len(), true),
                    Action::Release,
                );
            }
        },
        Disposition::Hold => {
            // The inner service may name the reason (the gateway does for
            // its own 504 and 502 `upstream-failed`); else a 504 is a
            // timeout and any other held status is of unknown outcome.
            let reason = match parts.extensions.remove::<HoldReason>() {
                Some(r) => r,
                None if parts.status == StatusCode::GATEWAY_TIMEOUT => HoldReason::Timeout,
                None => HoldReason::Unknown,
            };
            (body, Action::Hold(reason))
        }
        Disposition::Store => match capture(body, retention_limit).await {
            Captured::Complete { data, trailers } => {
                let stored = to_stored(parts.status, &parts.headers, data.clone(), false);
                (
                    Prefixed::complete(data, trailers).boxed_unsync(),
                    Action::Store(stored),
                )
            }
            Captured::OverLimit { prefix, rest } => {
                // Complete now (status and headers, no body), then stream on.
                let stored = to_stored(parts.status, &parts.headers, Bytes::new(), true);
                (
                    Prefixed::then(prefix, rest).boxed_unsync(),
                    Action::Store(stored),
                )
            }
            Captured::Failed { prefix, error } => {
                // Nothing was sent yet (the body is buffered before the
                // answer), so the caller gets a complete 502 rather than the
                // status with a truncated body. The inner service answered,
                // so it may have acted: the outcome is unknown and the key
                // is held until its lease ends.
                tracing::warn!(
                    target: "idem",
                    status = parts.status.as_u16(),
                    received = prefix.len(),
                    error = %error,
                    "the response body failed while it was buffered; answering 502, the key is held"
                );
                return (
                    body_failed(parts.status, prefix.len(), false),
                    Action::Hold(HoldReason::BrokenBody),
                );
            }
        },
    };
    (Response::from_parts(parts, body), action)
}

/// The 502 `upstream-protocol` answer for a 1xx final response (a `101
/// Switching Protocols` to a guarded request).
pub(crate) fn informational_answer(status: StatusCode) -> Response<BoxBody> {
    Problem::new(
        StatusCode::BAD_GATEWAY,
        "upstream-protocol",
        format!(
            "The service answered {} to this request; protocol upgrades and informational \
             answers are not results, so nothing was stored and this Idempotency-Key was \
             released: a retry runs again.",
            status.as_u16()
        ),
    )
    .with_member("upstream_status", status.as_u16())
    .into_response()
}

/// The 502 `upstream-failed` answer for a response whose body failed while
/// it was buffered (for the store, or to be shared). `released`: the status
/// said the request had no effect and the key was released; otherwise the
/// outcome is unknown and the key is held until its lease ends.
fn body_failed(status: StatusCode, received: usize, released: bool) -> Response<BoxBody> {
    let key = if released {
        "The status says the request had no effect, so this Idempotency-Key was \
         released: a retry runs again."
    } else {
        "Its outcome is unknown, so this Idempotency-Key is held until its lease \
         ends; a retry with the same key is accepted after that."
    };
    Problem::new(
        StatusCode::BAD_GATEWAY,
        "upstream-failed",
        format!(
            "The response (status {}) failed after {received} bytes of its body, before \
             anything was sent. {key}",
            status.as_u16()
        ),
    )
    .with_member("upstream_status", status.as_u16())
    .into_response()
}

enum Captured {
    /// The whole body, within the limit.
    Complete {
        data: Bytes,
        trailers: Option<HeaderMap>,
    },
    /// More than the limit: what was read, and the rest.
    OverLimit { prefix: Bytes, rest: BoxBody },
    /// The body failed after `prefix` (nothing was sent yet).
    Failed { prefix: Bytes, error: BoxError },
}

/// Reads `body` until it ends, fails, or passes `limit` bytes.
async fn capture(mut body: BoxBody, limit: usize) -> Captured {
    if body.size_hint().lower() > limit as u64 {
        return Captured::OverLimit {
            prefix: Bytes::new(),
            rest: body,
        };
    }
    let mut buf = BytesMut::new();
    let mut trailers: Option<HeaderMap> = None;
    loop {
        match body.frame().await {
            None => {
                return Captured::Complete {
                    data: buf.freeze(),
                    trailers,
                }
            }
            Some(Err(error)) => {
                return Captured::Failed {
                    prefix: buf.freeze(),
                    error,
                }
            }
            Some(Ok(frame)) => match frame.into_data() {
                Ok(data) => {
                    let over = buf.len().saturating_add(data.len()) > limit;
                    buf.extend_from_slice(&data);
                    if over {
                        return Captured::OverLimit {
                            prefix: buf.freeze(),
                            rest: body,
                        };
                    }
                }
                Err(frame) => {
                    if let Ok(t) = frame.into_trailers() {
                        trailers.get_or_insert_with(HeaderMap::new).extend(t);
                    }
                }
            },
        }
    }
}

/// The raw `Idempotency-Key` of a refused request, for the log line.
fn raw_key_for_log(headers: &HeaderMap, name: &http::HeaderName) -> String {
    let raw: Vec<String> = headers
        .get_all(name)
        .iter()
        .map(|v| {
            String::from_utf8_lossy(v.as_bytes())
                .escape_debug()
                .to_string()
        })
        .collect();
    let mut s = raw.join(", ");
    if s.len() > 300 {
        let mut cut = 300;
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
        s.push('…');
    }
    s
}

/// What the one log line per request needs before its key is known; its
/// outcome is recorded by [`Observer::finished`].
#[derive(Debug)]
struct LogCtx {
    started: Instant,
    method: Method,
    path: String,
    /// The route's name ([`crate::routes`]).
    route: Arc<str>,
    /// A key header that does not parse, escaped and cut to 300 bytes.
    raw_key: Option<String>,
    observer: Arc<Observer>,
}

impl LogCtx {
    fn observe(
        &self,
        scoped: Option<(&Scope, &IdempotencyKey)>,
        outcome: RequestOutcome,
        status: Option<StatusCode>,
        saved: Option<&'static str>,
    ) {
        let key = match scoped {
            Some((_, key)) => Some(key.as_str()),
            None => self.raw_key.as_deref(),
        };
        self.observer.finished(&Finished {
            outcome,
            status,
            elapsed: self.started.elapsed(),
            method: &self.method,
            path: &self.path,
            route: &self.route,
            key,
            scoped,
            saved,
            log: true,
        });
    }

    /// Records a refusal before the key was parsed and hands it back.
    fn rejected(&self, problem: Problem) -> Response<BoxBody> {
        let resp = problem.into_response();
        self.observe(None, RequestOutcome::Rejected, Some(resp.status()), None);
        resp
    }
}

/// The log context of a guarded request: the caller's scope and its key
/// (owned here, shared with the run by an `Arc`).
#[derive(Debug)]
struct KeyedLog {
    ctx: LogCtx,
    scope: Scope,
    key: IdempotencyKey,
}

impl std::ops::Deref for KeyedLog {
    type Target = LogCtx;

    fn deref(&self) -> &LogCtx {
        &self.ctx
    }
}

impl KeyedLog {
    /// Records the outcome and hands the response back.
    fn finish(
        &self,
        outcome: RequestOutcome,
        resp: Response<BoxBody>,
        saved: Option<&'static str>,
    ) -> Response<BoxBody> {
        self.ctx.observe(
            Some((&self.scope, &self.key)),
            outcome,
            Some(resp.status()),
            saved,
        );
        resp
    }

    fn rejected(&self, problem: Problem) -> Response<BoxBody> {
        self.finish(RequestOutcome::Rejected, problem.into_response(), None)
    }

    /// The inner service returned an error (no response).
    fn inner_error(&self, outcome: RequestOutcome, saved: &'static str) {
        self.ctx
            .observe(Some((&self.scope, &self.key)), outcome, None, Some(saved));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_rounds_up_to_whole_seconds() {
        assert_eq!(retry_after_secs(Duration::ZERO), 1);
        assert_eq!(retry_after_secs(Duration::from_millis(1)), 1);
        assert_eq!(retry_after_secs(Duration::from_millis(1000)), 1);
        assert_eq!(retry_after_secs(Duration::from_millis(1001)), 2);
        assert_eq!(retry_after_secs(Duration::from_millis(2500)), 3);
        assert_eq!(retry_after_secs(Duration::from_secs(30)), 30);
    }

    #[test]
    fn content_length_parsing() {
        let mut h = HeaderMap::new();
        assert_eq!(content_length(&h), None);
        h.insert(header::CONTENT_LENGTH, HeaderValue::from_static("42"));
        assert_eq!(content_length(&h), Some(42));
        h.insert(header::CONTENT_LENGTH, HeaderValue::from_static("x"));
        assert_eq!(content_length(&h), None);
    }
}

#[cfg(test)]
mod fail_open_tests {
    use std::convert::Infallible;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use idem_core::MemoryStore;
    use idem_testkit::{faulty::Op, Fault, FaultyStore};
    use tower::ServiceExt;
    use tower_layer::Layer;

    use super::*;
    use crate::{FailOpenGuard, IdempotencyLayer};

    /// A store whose every call fails with `fault`.
    fn down(fault: Fault) -> FaultyStore<MemoryStore> {
        let store = FaultyStore::new(MemoryStore::new());
        store.set_each(&Op::ALL, fault);
        store
    }

    #[derive(Debug)]
    struct Allow(bool);

    impl FailOpenGuard for Allow {
        fn allows(&self, _: &Scope, _: &IdempotencyKey) -> bool {
            self.0
        }
    }

    /// Sends `POST path` with a key and a body through `layer` around an
    /// inner service that echoes the body (and claims to be a replay);
    /// returns the answer, its body and how often the inner service ran.
    async fn send(layer: &IdempotencyLayer, path: &str) -> (http::response::Parts, Bytes, usize) {
        let calls = Arc::new(AtomicUsize::new(0));
        let counted = calls.clone();
        let inner = tower::service_fn(move |req: Request<BoxBody>| {
            let calls = counted.clone();
            async move {
                calls.fetch_add(1, Ordering::SeqCst);
                let body = req.into_body().collect().await.unwrap().to_bytes();
                let mut resp = Response::new(full(body));
                resp.headers_mut()
                    .insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
                Ok::<_, Infallible>(resp)
            }
        });
        let req = Request::post(path)
            // Token-shaped, so a token route asks the store too.
            .header(IDEMPOTENCY_KEY, "tok_0123456789abcdef0123456789abcdef")
            .body(full(r#"{"a":1}"#))
            .unwrap();
        let (parts, body) = layer.layer(inner).oneshot(req).await.unwrap().into_parts();
        let body = body.collect().await.unwrap().to_bytes();
        (parts, body, calls.load(Ordering::SeqCst))
    }

    fn problem_type(body: &Bytes) -> String {
        let v: serde_json::Value = serde_json::from_slice(body).unwrap();
        v["type"].as_str().unwrap().to_owned()
    }

    #[tokio::test]
    async fn the_buffered_request_is_forwarded_once_and_marked() {
        let layer =
            IdempotencyLayer::new(down(Fault::Unavailable)).with_fail_open(Arc::new(Allow(true)));
        let (resp, body, calls) = send(&layer, "/orders").await;
        assert_eq!(resp.status, StatusCode::OK);
        assert_eq!(resp.headers[IDEMPOTENCY_STATUS], "unprotected");
        assert!(resp.headers.get(IDEMPOTENT_REPLAYED).is_none());
        assert_eq!(body, r#"{"a":1}"#);
        assert_eq!(calls, 1);
    }

    #[tokio::test]
    async fn otherwise_the_answer_is_503_and_nothing_runs() {
        let closed = IdempotencyLayer::new(down(Fault::Unavailable));
        let refused_by_guard =
            IdempotencyLayer::new(down(Fault::Unavailable)).with_fail_open(Arc::new(Allow(false)));
        let token_route = IdempotencyLayer::new(down(Fault::Unavailable))
            .with_fail_open(Arc::new(Allow(true)))
            .with_require_token(["/orders"]);
        for (layer, kind) in [
            (closed, "store-unavailable"),
            (refused_by_guard, "store-unavailable"),
            (token_route, "store-unavailable"),
            (
                IdempotencyLayer::new(down(Fault::Full("at capacity")))
                    .with_fail_open(Arc::new(Allow(true))),
                "store-full",
            ),
        ] {
            let (resp, body, calls) = send(&layer, "/orders").await;
            assert_eq!(resp.status, StatusCode::SERVICE_UNAVAILABLE, "{kind}");
            assert_eq!(problem_type(&body), format!("urn:idem:problem:{kind}"));
            assert!(resp.headers.get(IDEMPOTENCY_STATUS).is_none());
            assert_eq!(calls, 0, "{kind}: the inner service ran");
        }
    }
}
