//! The listener, the per-connection service stack, `/_idem/` endpoints,
//! the purge task and graceful shutdown.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use idem_core::{DynStore, IdempotencyKey, Scope, StoreError};
use idem_http::{problem, BoxBody, IdempotencyLayer, ScopeBy};
use tokio::net::TcpListener;
use tower::{Layer, ServiceExt};

use crate::config::{ConfigError, GatewayConfig};
use crate::proxy::{self, error_chain, Proxy, Upstream};
use crate::store::{open_store, StoreKind};

/// Paths under this prefix are answered by the gateway itself and never proxied.
pub const RESERVED_PREFIX: &str = "/_idem/";

/// How long `GET /_idem/health` waits for the store.
const HEALTH_TIMEOUT: Duration = Duration::from_secs(2);

/// Why the gateway could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GatewayError {
    /// The configuration is not usable.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The store could not be opened.
    #[error("opening the store failed")]
    Store(#[source] StoreError),
    /// The listening socket could not be bound.
    #[error("cannot listen on {addr}")]
    Bind {
        /// The address asked for.
        addr: SocketAddr,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
}

/// A bound, not yet serving, gateway.
///
/// ```no_run
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// use idem_gateway::{Gateway, GatewayConfig};
/// let mut config = GatewayConfig::new("http://127.0.0.1:3000".parse()?);
/// config.listen = "127.0.0.1:0".parse()?;
/// config.store = "memory://".into();
/// let gateway = Gateway::bind(config).await?;
/// println!("listening on {}", gateway.local_addr());
/// gateway.serve(idem_gateway::shutdown_signal()).await?;
/// # Ok(()) }
/// ```
pub struct Gateway {
    config: GatewayConfig,
    store: DynStore,
    kind: &'static str,
    upstream: Arc<Upstream>,
    listener: TcpListener,
    local_addr: SocketAddr,
}

impl std::fmt::Debug for Gateway {
    // Not derived: a store's own Debug may print every record it holds.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gateway")
            .field("local_addr", &self.local_addr)
            .field("upstream", &self.config.upstream)
            .field("store", &self.config.store)
            .field("kind", &self.kind)
            .finish_non_exhaustive()
    }
}

impl Gateway {
    /// Validates `config`, opens its store ([`open_store`]) and binds the
    /// listening socket. Nothing is served until [`Gateway::serve`].
    ///
    /// # Errors
    /// [`GatewayError::Config`] for an invalid configuration,
    /// [`GatewayError::Store`] when the store cannot be opened,
    /// [`GatewayError::Bind`] when the address cannot be bound.
    pub async fn bind(config: GatewayConfig) -> Result<Gateway, GatewayError> {
        config.validate()?;
        let store = open_store(&config.store)
            .await
            .map_err(GatewayError::Store)?;
        Self::bind_with_store(config, store).await
    }

    /// Like [`Gateway::bind`] with a store the caller opened (any
    /// [`idem_core::Store`]); `config.store` is then only reported by
    /// `/_idem/health` and the startup log.
    ///
    /// # Errors
    /// As [`Gateway::bind`], without the store errors.
    pub async fn bind_with_store(
        config: GatewayConfig,
        store: DynStore,
    ) -> Result<Gateway, GatewayError> {
        let mut checked = config.clone();
        if StoreKind::of_url(&checked.store).is_err() {
            // A caller-supplied store need not have a URL we know.
            checked.store = "memory://".into();
        }
        checked.validate()?;
        let kind = StoreKind::of_url(&config.store).map_or("custom", StoreKind::name);
        let upstream = Upstream::new(&config.upstream)
            .map(Arc::new)
            .map_err(|e| GatewayError::Config(ConfigError::Upstream(e)))?;
        let listener =
            TcpListener::bind(config.listen)
                .await
                .map_err(|source| GatewayError::Bind {
                    addr: config.listen,
                    source,
                })?;
        let local_addr = listener.local_addr().map_err(|source| GatewayError::Bind {
            addr: config.listen,
            source,
        })?;
        Ok(Gateway {
            config,
            store,
            kind,
            upstream,
            listener,
            local_addr,
        })
    }

    /// The address the gateway listens on (the real port when the
    /// configuration asked for port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The store the gateway uses.
    pub fn store(&self) -> &DynStore {
        &self.store
    }

    /// Serves until `shutdown` resolves, then shuts down gracefully: stops
    /// accepting, closes idle connections, waits for in-flight requests to
    /// finish, and then for the runs of guarded requests whose clients have
    /// already left (they go on in the layer's tracked tasks,
    /// [`IdempotencyLayer::tracker`]) to store their results. Both waits
    /// together take at most [`GatewayConfig::shutdown_grace`] (default
    /// 30 s) from the moment `shutdown` resolves; runs still going then are
    /// abandoned and their keys stay in flight until their leases end.
    ///
    /// A background task purges expired records every
    /// [`GatewayConfig::purge_interval`]; its errors are logged.
    ///
    /// # Errors
    /// None today (accept errors such as running out of file descriptors
    /// are logged and retried); the `Result` leaves room for fatal ones.
    pub async fn serve(
        self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), GatewayError> {
        let Gateway {
            config,
            store,
            kind,
            upstream,
            listener,
            local_addr,
        } = self;
        let layer = IdempotencyLayer::new(store.clone())
            .with_methods(config.methods.clone())
            .with_require_key(config.require_key)
            .with_scope(config.scope.clone())
            .with_max_body(config.max_body)
            .with_retention_limit(config.retention_limit)
            .with_lease(config.lease)
            .with_ttl(config.ttl)
            .with_wait(config.wait);
        let client = proxy::client(config.upstream_timeout);
        let methods: Vec<&str> = config.methods.iter().map(Method::as_str).collect();
        let scope = match &config.scope {
            ScopeBy::Headers(names) => {
                let names: Vec<&str> = names.iter().map(http::HeaderName::as_str).collect();
                format!("headers:{}", names.join(","))
            }
            ScopeBy::Fixed(_) => "fixed".to_owned(),
        };
        tracing::info!(
            listen = %local_addr,
            upstream = %config.upstream,
            store = %config.store,
            ttl = %humantime::format_duration(config.ttl),
            lease = %humantime::format_duration(config.lease),
            methods = %methods.join(","),
            require_key = config.require_key,
            max_body = config.max_body,
            retention_limit = config.retention_limit,
            upstream_timeout = %humantime::format_duration(config.upstream_timeout),
            wait = %humantime::format_duration(config.wait),
            scope = %scope,
            "idem gateway listening"
        );

        let purge = tokio::spawn(purge_loop(store.clone(), config.purge_interval));
        let graceful = GracefulShutdown::new();
        let mut builder = auto::Builder::new(TokioExecutor::new());
        builder
            .http1()
            .timer(TokioTimer::new())
            .header_read_timeout(Duration::from_secs(30));
        tokio::pin!(shutdown);
        loop {
            let accepted = tokio::select! {
                biased;
                () = &mut shutdown => break,
                r = listener.accept() => r,
            };
            let (stream, peer) = match accepted {
                Ok(a) => a,
                Err(e) => {
                    // EMFILE and friends: back off instead of spinning.
                    tracing::warn!(error = %e, "accepting a connection failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let proxy = Proxy {
                client: client.clone(),
                upstream: upstream.clone(),
                timeout: config.upstream_timeout,
                peer,
            };
            let svc = TowerToHyperService::new(Root {
                inner: layer.layer(proxy),
                store: store.clone(),
                kind,
            });
            let watcher = graceful.watcher();
            let builder = builder.clone();
            tokio::spawn(async move {
                let conn = builder.serve_connection(TokioIo::new(stream), svc);
                if let Err(e) = watcher.watch(conn).await {
                    tracing::debug!(%peer, error = %error_chain(&*e), "connection closed with an error");
                }
            });
        }
        drop(listener);
        let tracker = layer.tracker().clone();
        tracing::info!(
            connections = graceful.count(),
            runs = tracker.len(),
            "shutting down: no new connections; waiting for in-flight requests"
        );
        let deadline = tokio::time::Instant::now() + config.shutdown_grace;
        tokio::select! {
            () = graceful.shutdown() => tracing::info!("all connections closed"),
            () = tokio::time::sleep_until(deadline) => tracing::warn!(
                grace = %humantime::format_duration(config.shutdown_grace),
                "in-flight requests did not finish in time; their keys stay in flight until their leases end"
            ),
        }
        // Guarded requests whose clients left run on in the layer's tasks;
        // wait for them to store their results before the process can exit.
        tracker.close();
        if !tracker.is_empty() {
            tracing::info!(
                runs = tracker.len(),
                "waiting for guarded requests whose clients left to store their results"
            );
        }
        tokio::select! {
            () = tracker.wait() => {}
            () = tokio::time::sleep_until(deadline) => tracing::warn!(
                runs = tracker.len(),
                grace = %humantime::format_duration(config.shutdown_grace),
                "guarded requests did not finish in time; their keys stay in flight until their leases end"
            ),
        }
        purge.abort();
        Ok(())
    }
}

/// Resolves when the process receives SIGINT (Ctrl-C) or SIGTERM (on
/// non-Unix systems: Ctrl-C only). Pass it to [`Gateway::serve`].
pub async fn shutdown_signal() {
    let ctrl_c = async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            tracing::warn!(error = %e, "cannot listen for SIGINT");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot listen for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => tracing::info!("SIGINT received"),
        () = term => tracing::info!("SIGTERM received"),
    }
}

async fn purge_loop(store: DynStore, every: Duration) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await; // the first tick is immediate
    loop {
        tick.tick().await;
        match store.purge_expired().await {
            Ok(0) => {}
            Ok(n) => tracing::debug!(purged = n, "expired records purged"),
            Err(e) => tracing::warn!(error = %error_chain(&e), "purging expired records failed"),
        }
    }
}

/// Routes `/_idem/*` to the gateway's own endpoints and everything else to
/// the idempotency layer around the proxy.
#[derive(Clone, Debug)]
struct Root<S> {
    inner: S,
    store: DynStore,
    kind: &'static str,
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl<S> tower_service::Service<Request<Incoming>> for Root<S>
where
    S: tower_service::Service<Request<Incoming>, Response = Response<BoxBody>, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send,
{
    type Response = Response<BoxBody>;
    type Error = Infallible;
    type Future = BoxFuture<Result<Response<BoxBody>, Infallible>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<Incoming>) -> Self::Future {
        let path = req.uri().path();
        if path.starts_with(RESERVED_PREFIX) || path == "/_idem" {
            let store = self.store.clone();
            let kind = self.kind;
            return Box::pin(async move { Ok(internal(req, store, kind).await) });
        }
        let inner = self.inner.clone();
        Box::pin(inner.oneshot(req))
    }
}

/// The gateway's own endpoints under `/_idem/`.
async fn internal(
    req: Request<Incoming>,
    store: DynStore,
    kind: &'static str,
) -> Response<BoxBody> {
    if req.uri().path() != "/_idem/health" {
        return problem(
            StatusCode::NOT_FOUND,
            "not-found",
            "no such gateway endpoint; paths under /_idem/ are reserved and never proxied",
        );
    }
    if req.method() != Method::GET && req.method() != Method::HEAD {
        let mut resp = problem(
            StatusCode::METHOD_NOT_ALLOWED,
            "method-not-allowed",
            "/_idem/health answers GET and HEAD",
        );
        resp.headers_mut()
            .insert(header::ALLOW, HeaderValue::from_static("GET, HEAD"));
        return resp;
    }
    match check_store(&store).await {
        Ok(()) => {
            let body = serde_json::json!({ "status": "ok", "store": kind }).to_string();
            let mut resp = Response::new(
                Full::new(Bytes::from(body))
                    .map_err(|e| match e {})
                    .boxed_unsync(),
            );
            resp.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
            resp.headers_mut()
                .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
            resp
        }
        Err(detail) => {
            tracing::warn!(store = kind, error = %detail, "health check: store failing");
            problem(
                StatusCode::SERVICE_UNAVAILABLE,
                "store-unavailable",
                format!("the {kind} store is failing: {detail}"),
            )
        }
    }
}

/// A cheap read of one record that does not exist.
async fn check_store(store: &DynStore) -> Result<(), String> {
    let (Ok(scope), Ok(key)) = (Scope::new("_idem"), IdempotencyKey::new("_idem-health")) else {
        return Err("internal: bad health-check key".into());
    };
    match tokio::time::timeout(HEALTH_TIMEOUT, store.get(&scope, &key)).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(e)) => Err(error_chain(&e)),
        Err(_) => Err(format!("no answer within {HEALTH_TIMEOUT:?}")),
    }
}
