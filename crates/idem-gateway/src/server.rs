//! The listener, the per-connection service stack, `/_idem/` endpoints,
//! the purge task and graceful shutdown.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use idem_core::token::IssueError;
use idem_core::{DynStore, StoreError};
use idem_http::{
    normalize_path, problem, BoxBody, ClientCertificate, IdempotencyLayer, IdempotencyService,
    ScopeBy, TaskTracker, TokenCap, TokenIssueError,
};
use std::borrow::Cow;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_rustls::TlsAcceptor;
use tower::Layer;

use crate::admin::{self, AdminToken};
use crate::config::{show_scope, ConfigError, GatewayConfig};
use crate::guard::{GuardedStore, Recent};
use crate::health::Health;
use crate::limits::ConnectionCap;
use crate::proxy::{self, error_chain, Forwarding, Proxy, Upstream, UpstreamClient};
use crate::store::{open_store_with, StoreKind};
use crate::tls::listener::TlsListener;
use crate::upgrade::{ConnectionSlot, Tunnels};

/// Paths under this prefix are answered by the gateway itself and never proxied.
pub const RESERVED_PREFIX: &str = "/_idem/";

/// Why the gateway could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GatewayError {
    /// The configuration is not usable.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The store could not be opened: unreachable within
    /// `--store-timeout`, refused, or its tables could not be created.
    #[error("cannot open the {kind} store {url}")]
    Store {
        /// The kind of store (`postgres`, `redis`, …).
        kind: &'static str,
        /// The store URL, password replaced by `***`.
        url: String,
        /// The store's error.
        #[source]
        source: StoreError,
    },
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
    /// The store, every call bounded by `store_options.timeout`.
    store: DynStore,
    kind: &'static str,
    /// Keys seen claimed or done (with `fail_open` only).
    recent: Option<Arc<Recent>>,
    upstream: Arc<Upstream>,
    listener: TcpListener,
    local_addr: SocketAddr,
    /// TLS on the listener (`--tls-cert`), loaded at bind.
    tls: Option<TlsListener>,
    /// The admin listener (`--admin-listen`), and the admin token.
    admin: Option<(TcpListener, Option<AdminToken>)>,
}

impl std::fmt::Debug for Gateway {
    // Not derived: a store's own Debug may print every record it holds.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gateway")
            .field("local_addr", &self.local_addr)
            .field("upstream", &self.config.upstream)
            .field("store", &self.config.store)
            .field("kind", &self.kind)
            .field("fail_open", &self.config.fail_open)
            .finish_non_exhaustive()
    }
}

impl Gateway {
    /// Validates `config`, opens its store ([`crate::open_store_with`],
    /// with `config.store_options`) and binds the listening socket.
    /// Nothing is served until [`Gateway::serve`].
    ///
    /// A store that cannot be reached now is an error (fail fast: a
    /// supervisor restarts the gateway, and a misconfigured URL is found at
    /// once). A store that goes away *later* does not stop the gateway: it
    /// answers 503 (or forwards unprotected with `fail_open`) until the
    /// store is back, and recovers without a restart.
    ///
    /// With a Redis store, what the server persists is read once on a
    /// connection of its own (`idem_redis::check_persistence`) and a WARN
    /// is logged when a Redis restart would forget completed keys.
    ///
    /// # Errors
    /// [`GatewayError::Config`] for an invalid configuration,
    /// [`GatewayError::Store`] when the store cannot be opened within
    /// `store_options.timeout`, [`GatewayError::Bind`] when the address
    /// cannot be bound.
    pub async fn bind(config: GatewayConfig) -> Result<Gateway, GatewayError> {
        config.validate()?;
        install_metrics(&config);
        let store = open_store_with(config.store.expose(), &config.store_options)
            .await
            .map_err(|source| GatewayError::Store {
                kind: StoreKind::of_url(config.store.expose()).map_or("custom", StoreKind::name),
                url: config.store.redacted(),
                source,
            })?;
        #[cfg(feature = "redis")]
        crate::health::log_redis_persistence(config.store.expose(), &config.store_options).await;
        Self::bind_with_store(config, store).await
    }

    /// Like [`Gateway::bind`] with a store the caller opened (any
    /// [`idem_core::Store`]); `config.store` is then only reported by
    /// `/_idem/ready` and the startup log. Every call to the store is
    /// still bounded by `config.store_options.timeout`.
    ///
    /// # Errors
    /// As [`Gateway::bind`], without the store errors.
    pub async fn bind_with_store(
        config: GatewayConfig,
        store: DynStore,
    ) -> Result<Gateway, GatewayError> {
        let mut checked = config.clone();
        if StoreKind::of_url(checked.store.expose()).is_err() {
            // A caller-supplied store need not have a URL we know.
            checked.store = "memory://".into();
        }
        checked.validate()?;
        install_metrics(&config);
        let kind = StoreKind::of_url(config.store.expose()).map_or("custom", StoreKind::name);
        let recent = config.fail_open.then(|| {
            Arc::new(Recent::new(
                config.layer.lease.saturating_add(config.layer.wait),
            ))
        });
        let store: DynStore = Arc::new(GuardedStore::new(
            store,
            config.store_options.timeout,
            recent.clone(),
        ));
        let upstream = Upstream::new(&config.upstream)
            .map(|u| Arc::new(u.trusting(config.trusted_proxies.clone())))
            .map_err(|e| GatewayError::Config(ConfigError::Upstream(e)))?;
        // Bad certificate files are refused at start (exit 2), naming the flag.
        let tls = config
            .tls
            .as_ref()
            .map(TlsListener::new)
            .transpose()
            .map_err(|e| GatewayError::Config(ConfigError::Tls(e)))?;
        let bind_error = |source| GatewayError::Bind {
            addr: config.listen,
            source,
        };
        let listener = TcpListener::bind(config.listen).await.map_err(bind_error)?;
        let local_addr = listener.local_addr().map_err(bind_error)?;
        let admin = match config.admin_listen.addr() {
            None => {
                if let Some(path) = &config.admin_token_file {
                    tracing::warn!(
                        admin_token_file = %path.display(),
                        "--admin-token-file is set but --admin-listen is off: the token is not read and no admin API is served"
                    );
                }
                None
            }
            Some(addr) => {
                let token = match &config.admin_token_file {
                    Some(path) => Some(
                        AdminToken::load(path)
                            .map_err(|e| GatewayError::Config(ConfigError::AdminToken(e)))?,
                    ),
                    None => None,
                };
                let admin_listener = admin::bind(addr)
                    .await
                    .map_err(|source| GatewayError::Bind { addr, source })?;
                Some((admin_listener, token))
            }
        };
        Ok(Gateway {
            config,
            store,
            kind,
            recent,
            upstream,
            listener,
            local_addr,
            tls,
            admin,
        })
    }

    /// The address of the admin listener (the real port when the
    /// configuration asked for port 0); `None` when it is off.
    pub fn admin_addr(&self) -> Option<SocketAddr> {
        self.admin.as_ref().and_then(|(l, _)| l.local_addr().ok())
    }

    /// The address the gateway listens on (the real port when the
    /// configuration asked for port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The store the gateway uses (every call bounded by the
    /// configuration's `store_options.timeout`).
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
    /// Upgraded connections (WebSocket) are waited for within the same
    /// bound, and those still open at its end are closed.
    ///
    /// A background task purges expired records every
    /// [`GatewayConfig::purge_interval`] (`--purge-interval`); its errors
    /// are logged.
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
            recent,
            upstream,
            listener,
            local_addr,
            tls,
            admin,
        } = self;
        log_startup(&config, kind, local_addr);
        // Before anything answers (the admin listener included): once the
        // gateway answers, a SIGHUP reloads the certificate and the reload
        // counters show.
        let tls_hup = tls.as_ref().and_then(|_| {
            crate::tls::listener::register_metrics();
            crate::tls::listener::Hangup::register()
        });
        let health = Health::new(store.clone(), kind, config.store.expose());
        // The layer wraps the store (store call metrics): the admin API and
        // the purge task use it as the layer does.
        let routes = Routes::new(&config, store, health.clone(), recent, upstream)?;
        let store = routes.layer.store().clone();
        let admin_stop = tokio_util::sync::CancellationToken::new();
        let _admin_stop_on_exit = admin_stop.clone().drop_guard();
        if let Some((admin_listener, token)) = admin {
            if let Ok(addr) = admin_listener.local_addr() {
                tracing::info!(admin = %addr, admin_api = token.is_some(), "idem admin listening");
            }
            let state = Arc::new(admin::AdminState {
                store: store.clone(),
                kind,
                token,
                store_timeout: config.store_options.timeout,
                health: health.clone(),
                status: admin::status::PageState::default(),
            });
            admin::status::start_sampler();
            tokio::spawn(admin::serve(admin_listener, state, admin_stop.clone()));
        }
        let cap = config.connection_cap()?;
        log_connection_cap(&config, &cap);
        let purge = tokio::spawn(purge_loop(store, config.purge_interval));
        // Hot reload of the configuration file, until shutdown begins.
        let reload_stop = tokio_util::sync::CancellationToken::new();
        let _reload_stop_on_exit = reload_stop.clone().drop_guard();
        if let Some(source) = config.config_source.clone() {
            tokio::spawn(crate::config::reload::run(
                source,
                (routes.layer.clone(), config.tokens_served()),
                reload_stop.clone(),
            ));
        }
        if let Some(tls) = &tls {
            tokio::spawn(tls.clone().watch(tls_hup, reload_stop.clone()));
        }
        let graceful = GracefulShutdown::new();
        let door = Door::new(config.header_timeout, cap.connections);
        let acceptor = tls.as_ref().map(|t| t.acceptor().clone());
        accept_until(listener, shutdown, &routes, &graceful, &door, acceptor).await;
        reload_stop.cancel();
        drain(
            graceful,
            routes.layer.tracker(),
            &routes.tunnels,
            config.shutdown_grace,
        )
        .await;
        purge.abort();
        Ok(())
    }
}

/// Installs the Prometheus recorder ([`admin::metrics::install`]) when
/// the admin listener is on, before the store and the layer register
/// their metric handles.
fn install_metrics(config: &GatewayConfig) {
    if config.admin_listen.addr().is_some() {
        admin::metrics::install();
    }
}

/// The one line that says how the gateway runs, and warnings for settings
/// that can hurt.
fn log_startup(config: &GatewayConfig, kind: &'static str, local_addr: SocketAddr) {
    let layer = &config.layer;
    let methods: Vec<&str> = layer.methods.iter().map(Method::as_str).collect();
    let scope = match &layer.scope {
        ScopeBy::Headers(_) => format!("headers:{}", show_scope(&layer.scope)),
        ScopeBy::Fixed(_) | ScopeBy::ClientCert => show_scope(&layer.scope),
    };
    let config_file = config
        .config_source
        .as_ref()
        .map_or_else(|| "none".to_owned(), |s| s.path.display().to_string());
    let tls = match &config.tls {
        None => "off".to_owned(),
        Some(t) if t.client_ca.is_some() => format!("mtls ({})", t.cert.display()),
        Some(t) => format!("on ({})", t.cert.display()),
    };
    tracing::info!(
        listen = %local_addr,
        tls = %tls,
        config_file = %config_file,
        routes = %format!("{} + default", config.routes.len()),
        upstream = %config.upstream,
        store = %config.store,
        store_kind = kind,
        store_pool_size = config.store_options.pool_size,
        store_timeout = %humantime::format_duration(config.store_options.timeout),
        fail_open = config.fail_open,
        ttl = %humantime::format_duration(layer.ttl),
        lease = %humantime::format_duration(layer.lease),
        methods = %methods.join(","),
        require_key = layer.require_key,
        max_body = layer.max_body,
        retention_limit = layer.retention_limit,
        upstream_timeout = %humantime::format_duration(config.upstream_timeout),
        wait = %humantime::format_duration(layer.wait),
        scope = %scope,
        token_ttl = %humantime::format_duration(layer.token_ttl),
        require_token = %layer.require_token.join(","),
        tokens_served = config.tokens_served(),
        anonymous_tokens = layer.anonymous_tokens,
        tokens_per_scope = layer.tokens_per_scope,
        max_live_tokens = layer.max_live_tokens,
        purge_interval = %humantime::format_duration(config.purge_interval),
        "idem gateway listening"
    );
    if config.store_options.timeout.saturating_mul(3) > layer.lease {
        tracing::warn!(
            store_timeout = %humantime::format_duration(config.store_options.timeout),
            lease = %humantime::format_duration(layer.lease),
            "--store-timeout is more than a third of --lease: a slow lease renewal can let \
             the lease run out while the upstream call runs"
        );
    }
    if config.fail_open {
        tracing::warn!(
            "--fail-open is ON: while the store is unreachable, requests go to the upstream \
             WITHOUT idempotency protection and a retried request can run twice"
        );
    }
}

/// Logs the connection cap in force, and warns when the file-descriptor
/// limit lowered it.
fn log_connection_cap(config: &GatewayConfig, cap: &ConnectionCap) {
    tracing::info!(
        max_connections = cap.connections,
        nofile = cap.nofile.map_or_else(|| "unlimited".to_owned(), |n| n.to_string()),
        fds_reserved = cap.reserve,
        header_timeout = %humantime::format_duration(config.header_timeout),
        body_timeout = %humantime::format_duration(config.layer.body_timeout),
        max_buffered = config.layer.max_buffered,
        "connection limits"
    );
    if cap.limited_by_nofile(config.max_connections) {
        // A cut of a few connections (the descriptors the gateway keeps for
        // itself) is no fault worth a warning at every start; a real one is.
        let severe = cap.connections < config.max_connections / 10 * 9;
        if severe {
            tracing::warn!(
                max_connections = config.max_connections,
                effective = cap.connections,
                nofile = cap.nofile.unwrap_or(0),
                "the file-descriptor limit (ulimit -n) lowers --max-connections; raise it to serve more connections"
            );
        } else {
            tracing::info!(
                max_connections = config.max_connections,
                effective = cap.connections,
                nofile = cap.nofile.unwrap_or(0),
                "the file-descriptor limit (ulimit -n) lowers --max-connections slightly"
            );
        }
    }
}

/// What every connection's service is made of.
struct Routes {
    /// The idempotency layer over the guarded store (with the fail-open
    /// guard when `fail_open` is on).
    layer: IdempotencyLayer,
    /// The same layer, shared, for `POST /_idem/tokens`.
    tokens: Arc<TokenEndpoint>,
    client: UpstreamClient,
    upstream: Arc<Upstream>,
    upstream_timeout: Duration,
    /// `idem_upstream_duration_seconds`.
    upstream_duration: metrics::Histogram,
    health: Arc<Health>,
    /// The upgraded connections (WebSocket), closed by the drain.
    tunnels: Tunnels,
}

impl Routes {
    fn new(
        config: &GatewayConfig,
        store: DynStore,
        health: Arc<Health>,
        recent: Option<Arc<Recent>>,
        upstream: Arc<Upstream>,
    ) -> Result<Self, ConfigError> {
        let mut options = config.layer.clone();
        if let Some(recent) = recent {
            options.fail_open = Some(recent);
        }
        // `GatewayConfig::validate` checked the routes.
        let layer = IdempotencyLayer::from_parts(store.clone(), options)
            .with_routes(config.routes.clone())
            .expect("routes are validated with the configuration");
        let client = proxy::client(
            &config.upstream,
            &config.upstream_tls,
            config.upstream_http2,
            config.upstream_timeout,
            config.upstream_idle_timeout,
        )
        .map_err(ConfigError::UpstreamTls)?;
        Ok(Self {
            tokens: Arc::new(TokenEndpoint {
                layer: layer.clone(),
                served: config.tokens_served(),
            }),
            layer,
            client,
            upstream,
            upstream_timeout: config.upstream_timeout,
            upstream_duration: metrics::histogram!(admin::metrics::UPSTREAM_DURATION),
            health,
            tunnels: Tunnels::default(),
        })
    }

    /// The service for one connection from `peer`, over TLS or not.
    fn root(&self, peer: SocketAddr, tls: bool) -> Root {
        let proxy = Proxy {
            client: self.client.clone(),
            upstream: self.upstream.clone(),
            timeout: self.upstream_timeout,
            forwarding: Arc::new(Forwarding::to(&self.upstream, peer.ip(), tls)),
            duration: self.upstream_duration.clone(),
        };
        Root {
            inner: self.layer.layer(proxy),
            health: self.health.clone(),
            tokens: self.tokens.clone(),
            client_cert: None,
        }
    }
}

/// Accepts connections until `shutdown` resolves, each served on its own
/// task watched by `graceful`; then closes the listening socket. At most
/// `door.connections` are served at once: past it, nothing is accepted
/// until one closes (new connections wait in the kernel's backlog, as
/// nginx does when its `worker_connections` are used up).
async fn accept_until(
    listener: TcpListener,
    shutdown: impl Future<Output = ()>,
    routes: &Routes,
    graceful: &GracefulShutdown,
    door: &Door,
    tls: Option<TlsAcceptor>,
) {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(door.header_timeout);
    tokio::pin!(shutdown);
    loop {
        let slot = tokio::select! {
            biased;
            () = &mut shutdown => break,
            slot = door.connections.clone().acquire_owned() => match slot {
                Ok(slot) => slot,
                Err(_) => break, // never closed
            },
        };
        let accepted = tokio::select! {
            biased;
            () = &mut shutdown => break,
            r = listener.accept() => r,
        };
        match accepted {
            Ok((stream, peer)) => {
                let root = Tracked {
                    inner: routes.root(peer, tls.is_some()),
                    activity: Arc::new(tokio::sync::watch::Sender::new(0)),
                    requests: door.requests.clone(),
                };
                let conn = Conn {
                    builder: builder.clone(),
                    watcher: graceful.watcher(),
                    peer,
                    slot: routes.tunnels.slot(slot, door.requests.clone()),
                    header_timeout: door.header_timeout,
                };
                match &tls {
                    None => {
                        tokio::spawn(conn.serve(stream, root));
                    }
                    Some(acceptor) => {
                        tokio::spawn(conn.serve_tls(acceptor.clone(), stream, root));
                    }
                }
            }
            Err(e) => {
                // EMFILE and friends: back off instead of spinning.
                tracing::warn!(error = %e, "accepting a connection failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// The limits every client connection is held to.
struct Door {
    /// See [`GatewayConfig::header_timeout`].
    header_timeout: Duration,
    /// One permit per client connection served.
    connections: Arc<Semaphore>,
    /// One permit per request in flight (its response body included), as
    /// many as connections: an HTTP/2 connection's streams wait for one,
    /// so the upstream never gets more connections than the cap.
    requests: Arc<Semaphore>,
}

impl Door {
    fn new(header_timeout: Duration, cap: usize) -> Self {
        Self {
            header_timeout,
            connections: Arc::new(Semaphore::new(cap)),
            requests: Arc::new(Semaphore::new(cap)),
        }
    }
}

/// One accepted connection: what serving it needs, and its connection
/// `slot`, held until it closes (a TLS connection is counted from accept,
/// its handshake included).
struct Conn {
    builder: auto::Builder<TokioExecutor>,
    watcher: hyper_util::server::graceful::Watcher,
    peer: SocketAddr,
    slot: ConnectionSlot,
    header_timeout: Duration,
}

impl Conn {
    /// The TLS handshake, then [`Conn::serve`] over it (run on the
    /// connection's own task, so a slow handshake never holds the accept
    /// loop). The handshake must end within `header_timeout`; a client that
    /// does not finish it in time, or whose handshake fails (no or a bad
    /// client certificate, no common protocol), is closed with a DEBUG
    /// line. With mTLS, the verified leaf certificate goes into every
    /// request's extensions ([`ClientCertificate`]).
    async fn serve_tls(self, acceptor: TlsAcceptor, stream: TcpStream, mut root: Tracked) {
        let peer = self.peer;
        let accepted = tokio::time::Instant::now();
        let tls = match tokio::time::timeout(self.header_timeout, acceptor.accept(stream)).await {
            Ok(Ok(tls)) => tls,
            Ok(Err(e)) => {
                tracing::debug!(%peer, error = %e, "TLS handshake failed");
                return;
            }
            Err(_) => {
                tracing::debug!(%peer, "closing a connection whose TLS handshake did not finish within --header-timeout");
                return;
            }
        };
        root.inner.client_cert = tls
            .get_ref()
            .1
            .peer_certificates()
            .and_then(|chain| chain.first())
            .map(|leaf| ClientCertificate(bytes::Bytes::copy_from_slice(leaf)));
        // The first request head is due `header_timeout` after accept, the
        // handshake included.
        let first_head_by = accepted + self.header_timeout;
        self.serve_until(tls, root, first_head_by).await;
    }

    /// Serves the connection, watched by the graceful shutdown, until it
    /// closes.
    ///
    /// The connection is closed once it has had no request in flight for
    /// `header_timeout`: from accept (a TLS handshake included;
    /// hyper's own header read timeout only starts once the first byte is
    /// in, and hyper-util's HTTP/1-or-2 sniffing waits for bytes without
    /// any deadline), and from the end of each response (the keep-alive
    /// idle time). A request counts as in flight from its complete head to
    /// the end of its response body, so a slow upload or a long download is
    /// not cut; those have their own deadlines (`--body-timeout`,
    /// `--upstream-timeout`). For HTTP/2 this closes a connection with no
    /// open stream, whatever pings or settings it sends.
    async fn serve<I>(self, io: I, root: Tracked)
    where
        I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        let first_head_by = tokio::time::Instant::now() + self.header_timeout;
        self.serve_until(io, root, first_head_by).await;
    }

    /// [`Conn::serve`], the first request head due by `first_head_by`.
    async fn serve_until<I>(self, io: I, root: Tracked, first_head_by: tokio::time::Instant)
    where
        I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        let Conn {
            builder,
            watcher,
            peer,
            slot,
            header_timeout,
        } = self;
        // Held until the connection closes, or lent to the tunnel of an
        // upgraded request (`crate::upgrade`) until that closes.
        let _slot = slot.hold();
        let mut activity = root.activity.subscribe();
        let service = tower::ServiceExt::map_request(root, move |mut req: Request<Incoming>| {
            req.extensions_mut().insert(slot.clone());
            req
        });
        let conn = builder
            .serve_connection_with_upgrades(TokioIo::new(io), TowerToHyperService::new(service));
        let conn = watcher.watch(conn);
        tokio::pin!(conn);
        // When the connection closes if no request comes: the first head's
        // deadline, then `header_timeout` after each response ends.
        let mut idle_until = first_head_by;
        let result = loop {
            let busy = *activity.borrow_and_update();
            let idle = async {
                if busy == 0 {
                    tokio::time::sleep_until(idle_until).await;
                } else {
                    std::future::pending::<()>().await;
                }
            };
            tokio::select! {
                r = &mut conn => break r,
                _ = activity.changed() => {
                    if *activity.borrow() == 0 {
                        idle_until = tokio::time::Instant::now() + header_timeout;
                    }
                }
                () = idle => {
                    tracing::debug!(%peer, "closing a connection without a request for --header-timeout");
                    return;
                }
            }
        };
        if let Err(e) = result {
            tracing::debug!(%peer, error = %error_chain(&*e), "connection closed with an error");
        }
    }
}

/// The service of one connection: counts its requests in flight (from the
/// complete head to the end of the response body) for the idle deadline,
/// and holds a request permit for each.
#[derive(Clone)]
struct Tracked {
    inner: Root,
    activity: Arc<tokio::sync::watch::Sender<usize>>,
    requests: Arc<Semaphore>,
}

/// One request in flight on a connection; dropped with the response body.
struct Busy {
    activity: Arc<tokio::sync::watch::Sender<usize>>,
    _permit: Option<OwnedSemaphorePermit>,
}

impl Busy {
    fn new(activity: Arc<tokio::sync::watch::Sender<usize>>) -> Self {
        activity.send_modify(|n| *n += 1);
        Self {
            activity,
            _permit: None,
        }
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.activity.send_modify(|n| *n = n.saturating_sub(1));
    }
}

pin_project_lite::pin_project! {
    /// A response body that keeps its request counted as in flight.
    struct BusyBody {
        #[pin]
        inner: BoxBody,
        busy: Busy,
    }
}

impl http_body::Body for BusyBody {
    type Data = bytes::Bytes;
    type Error = idem_http::BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        self.project().inner.poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

impl tower_service::Service<Request<Incoming>> for Tracked {
    type Response = Response<BusyBody>;
    type Error = Infallible;
    type Future = BoxFuture<Result<Response<BusyBody>, Infallible>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        tower_service::Service::<Request<Incoming>>::poll_ready(&mut self.inner, cx)
    }

    fn call(&mut self, req: Request<Incoming>) -> Self::Future {
        let mut busy = Busy::new(self.activity.clone());
        let requests = self.requests.clone();
        // Call the service that was driven to readiness; leave a clone.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        Box::pin(async move {
            busy._permit = requests.acquire_owned().await.ok();
            let resp = match tower_service::Service::call(&mut inner, req).await {
                Ok(resp) => resp,
                Err(never) => match never {},
            };
            Ok(resp.map(|inner| BusyBody { inner, busy }))
        })
    }
}

/// Waits, for at most `grace` in all, for the open connections to finish
/// their requests, for the upgraded connections (`tunnels`) to close (those
/// still open at the deadline are closed then), and for the layer's runs
/// whose clients left (`tracker`) to store their results.
async fn drain(
    graceful: GracefulShutdown,
    tracker: &TaskTracker,
    tunnels: &Tunnels,
    grace: Duration,
) {
    tracing::info!(
        connections = graceful.count(),
        upgraded = tunnels.len(),
        runs = tracker.len(),
        "shutting down: no new connections; waiting for in-flight requests"
    );
    let deadline = tokio::time::Instant::now() + grace;
    tokio::select! {
        () = graceful.shutdown() => tracing::info!("all connections closed"),
        () = tokio::time::sleep_until(deadline) => tracing::warn!(
            grace = %humantime::format_duration(grace),
            "in-flight requests did not finish in time; their keys stay in flight until their leases end"
        ),
    }
    tunnels.close_by(deadline).await;
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
            grace = %humantime::format_duration(grace),
            "guarded requests did not finish in time; their keys stay in flight until their leases end"
        ),
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
/// the idempotency layer around the proxy (which fails open by itself when
/// configured to).
#[derive(Clone)]
struct Root {
    inner: IdempotencyService<Proxy>,
    /// `/_idem/live`, `/_idem/ready`, `/_idem/health`.
    health: Arc<Health>,
    /// The layer, for `POST /_idem/tokens` (issuing in the scope the layer
    /// derives).
    tokens: Arc<TokenEndpoint>,
    /// The verified client certificate of this connection (mTLS), put in
    /// every request's extensions for [`ScopeBy::ClientCert`].
    client_cert: Option<ClientCertificate>,
}

/// `POST /_idem/tokens`: the layer that issues (sharing the guarded
/// layer's token budget), and whether the endpoint is on
/// ([`GatewayConfig::tokens_served`]).
struct TokenEndpoint {
    layer: IdempotencyLayer,
    served: bool,
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl tower_service::Service<Request<Incoming>> for Root {
    type Response = Response<BoxBody>;
    type Error = Infallible;
    type Future = BoxFuture<Result<Response<BoxBody>, Infallible>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        tower_service::Service::<Request<Incoming>>::poll_ready(&mut self.inner, cx)
    }

    /// The entry of every request: checks `Host` (RFC 9112 §3.2), then
    /// normalises the target's path once ([`idem_http::normalize_path`];
    /// the query is kept as it is) and replaces it in the request, so the
    /// `/_idem/` check, the layer's token routes and fingerprint, and the
    /// path forwarded under the upstream's prefix all see one path. An
    /// ambiguous path gets 400 `ambiguous-path`, whatever the method.
    fn call(&mut self, mut req: Request<Incoming>) -> Self::Future {
        // Whatever the request says: only the TLS stack sets it.
        req.extensions_mut().remove::<ClientCertificate>();
        if let Some(cert) = &self.client_cert {
            req.extensions_mut().insert(cert.clone());
        }
        if let Err(resp) = check_host(&req) {
            return Box::pin(std::future::ready(Ok(resp)));
        }
        if req.uri().path().starts_with('/') {
            match normalize_path(req.uri().path()) {
                Ok(Cow::Borrowed(_)) => {}
                Ok(Cow::Owned(path)) => match with_path(req.uri(), &path) {
                    Some(uri) => *req.uri_mut() = uri,
                    None => return Box::pin(std::future::ready(Ok(bad_target()))),
                },
                Err(e) => {
                    tracing::debug!(path = %req.uri().path(), error = %e, "ambiguous request path refused");
                    let resp = problem(
                        StatusCode::BAD_REQUEST,
                        "ambiguous-path",
                        format!(
                            "the request path is refused: {e}; servers read such a path in \
                             different ways, so it is not forwarded"
                        ),
                    );
                    return Box::pin(std::future::ready(Ok(resp)));
                }
            }
        } else if req.method() != Method::CONNECT {
            // `*` or an authority-form target (CONNECT gets its 405 from the proxy).
            return Box::pin(std::future::ready(Ok(bad_target())));
        }
        let path = req.uri().path();
        // Case-insensitive, so `/_IDEM/…` is not handed to an upstream
        // whose router ignores case either.
        let reserved = path
            .get(..RESERVED_PREFIX.len())
            .is_some_and(|p| p.eq_ignore_ascii_case(RESERVED_PREFIX))
            || path.eq_ignore_ascii_case("/_idem");
        if reserved {
            let health = self.health.clone();
            let tokens = self.tokens.clone();
            return Box::pin(async move { Ok(internal(req, &health, &tokens).await) });
        }
        Box::pin(self.inner.call(req))
    }
}

/// `uri` with `path` instead of its path, the query kept.
fn with_path(uri: &http::Uri, path: &str) -> Option<http::Uri> {
    let pq = match uri.query() {
        Some(q) => format!("{path}?{q}"),
        None => path.to_owned(),
    };
    let mut parts = uri.clone().into_parts();
    parts.path_and_query = Some(pq.parse().ok()?);
    http::Uri::from_parts(parts).ok()
}

/// 400 `bad-request-target`: `*` or an authority-form target.
fn bad_target() -> Response<BoxBody> {
    problem(
        StatusCode::BAD_REQUEST,
        "bad-request-target",
        "the request target must be an origin-form path such as /orders?id=1",
    )
}

/// RFC 9112 §3.2: an HTTP/1.1 request without `Host`, any request with
/// more than one `Host` field, or with a `Host` that is not `host[:port]`
/// → 400 `invalid-host` (HTTP/2 may carry the authority in `:authority`
/// only). Two `Host` fields could name two hosts, and a proxy behind may
/// take the other one.
#[allow(clippy::result_large_err)]
fn check_host<B>(req: &Request<B>) -> Result<(), Response<BoxBody>> {
    let hosts = req.headers().get_all(header::HOST);
    let refuse = |detail: &str| {
        Err(problem(
            StatusCode::BAD_REQUEST,
            "invalid-host",
            format!("{detail} (RFC 9112, section 3.2)"),
        ))
    };
    let mut it = hosts.iter();
    match (it.next(), it.next()) {
        (None, _) if req.version() == http::Version::HTTP_11 => {
            refuse("an HTTP/1.1 request must carry a Host field")
        }
        (None, _) if req.version() == http::Version::HTTP_2 && req.uri().authority().is_none() => {
            refuse("an HTTP/2 request must carry :authority or a Host field")
        }
        (None, _) => Ok(()),
        (Some(_), Some(_)) => refuse("the request has more than one Host field; send exactly one"),
        (Some(h), None) => match http::uri::Authority::try_from(h.as_bytes()) {
            // RFC 9113 §8.3.1: a Host that names another entity than
            // :authority makes an HTTP/2 request malformed.
            Ok(a)
                if req.version() == http::Version::HTTP_2
                    && req
                        .uri()
                        .authority()
                        .is_some_and(|t| !t.as_str().eq_ignore_ascii_case(a.as_str())) =>
            {
                refuse("the Host field differs from :authority (RFC 9113, section 8.3.1)")
            }
            Ok(a) if !a.as_str().contains('@') && !a.host().is_empty() => Ok(()),
            _ => refuse("the Host field is not a valid host[:port]"),
        },
    }
}

/// The gateway's own endpoints under `/_idem/`.
async fn internal(
    req: Request<Incoming>,
    health: &Arc<Health>,
    tokens: &TokenEndpoint,
) -> Response<BoxBody> {
    if let Some(resp) = crate::health::respond(&req, health, crate::health::Audience::Public).await
    {
        return resp;
    }
    if req.uri().path() == TOKENS_PATH {
        if !tokens.served {
            return problem(
                StatusCode::NOT_FOUND,
                "not-found",
                "submit tokens are off: the gateway issues them only with a --require-token \
                 route or --issue-tokens",
            );
        }
        return issue_token(&req, &tokens.layer).await;
    }
    problem(
        StatusCode::NOT_FOUND,
        "not-found",
        "no such gateway endpoint; paths under /_idem/ are reserved and never proxied",
    )
}

/// Where submit tokens are issued.
const TOKENS_PATH: &str = "/_idem/tokens";

/// `POST /_idem/tokens`: a submit token for the caller's scope →
/// 201 `{"token": "tok_…", "expires_in": seconds}`; 400 `scope-required`
/// without the scope headers (unless `--anonymous-tokens`), 429
/// `too-many-tokens` with `Retry-After` beyond `--tokens-per-scope` or
/// `--max-live-tokens`, 503 when the store fails.
async fn issue_token(req: &Request<Incoming>, layer: &IdempotencyLayer) -> Response<BoxBody> {
    if req.method() != Method::POST {
        return method_not_allowed("/_idem/tokens answers POST", "POST");
    }
    match layer.issue_token_in(req.headers(), req.extensions()).await {
        Ok(issued) => json(
            StatusCode::CREATED,
            &serde_json::json!({
                "token": issued.token,
                "expires_in": issued.expires_in_secs(),
            }),
        ),
        Err(TokenIssueError::ScopeRequired) if layer.options().scope == ScopeBy::ClientCert => {
            problem(
                StatusCode::BAD_REQUEST,
                "client-certificate-required",
                "a submit token is issued to a caller, identified here by its TLS client \
                 certificate; this request came without one",
            )
        }
        Err(TokenIssueError::ScopeRequired) => problem(
            StatusCode::BAD_REQUEST,
            "scope-required",
            format!(
                "a submit token is issued to a caller: send the header that identifies you \
                 ({}); this gateway issues no anonymous tokens",
                show_scope(&layer.options().scope)
            ),
        ),
        Err(TokenIssueError::TooMany { cap, retry_after }) => {
            let detail = match cap {
                TokenCap::PerScope(n) => format!(
                    "you hold {n} live submit tokens, the most this gateway issues to one \
                     caller; use one, or retry when the oldest expires"
                ),
                TokenCap::Total(n) => format!(
                    "this gateway holds {n} live submit tokens, the most it issues in all; \
                     retry later"
                ),
                _ => "too many live submit tokens; retry later".to_owned(),
            };
            tracing::debug!(?cap, "submit token refused: cap reached");
            let mut resp = problem(StatusCode::TOO_MANY_REQUESTS, "too-many-tokens", detail);
            resp.headers_mut().insert(
                header::RETRY_AFTER,
                HeaderValue::from(retry_after.as_secs()),
            );
            resp
        }
        Err(TokenIssueError::Issue(IssueError::Store(e))) => {
            tracing::warn!(error = %error_chain(&e), "issuing a submit token failed");
            let kind = if matches!(e, StoreError::Full { .. }) {
                "store-full"
            } else {
                "store-unavailable"
            };
            problem(
                StatusCode::SERVICE_UNAVAILABLE,
                kind,
                "the idempotency store failed; no submit token was issued. Retry later.",
            )
        }
        Err(e) => {
            tracing::error!(error = %error_chain(&e), "issuing a submit token failed");
            problem(
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal",
                format!("no submit token was issued: {e}"),
            )
        }
    }
}

/// 405 `method-not-allowed` with the `Allow` field.
fn method_not_allowed(detail: &'static str, allow: &'static str) -> Response<BoxBody> {
    let mut resp = problem(StatusCode::METHOD_NOT_ALLOWED, "method-not-allowed", detail);
    resp.headers_mut()
        .insert(header::ALLOW, HeaderValue::from_static(allow));
    resp
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
