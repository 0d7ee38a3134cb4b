//! The admin listener (`--admin-listen`, default `127.0.0.1:9901`): what
//! an operator reads and steers, on a port clients never use (Envoy's
//! admin interface is the model).
//!
//! | path | needs the admin token | module |
//! |---|---|---|
//! | `GET /metrics` | no | [`metrics`]: Prometheus text exposition |
//! | `GET /_idem/live`, `GET /_idem/ready` | no | the same probes as the public listener |
//! | `/keys…` | yes | [`keys`]: list, show, delete records |
//! | `GET /`, `GET /status.js`, `GET /status.css` | no, but 404 without a token file | [`status`]: the live status page (no data in it) |
//! | `GET /status.json` | yes | [`status`]: the page's data |
//!
//! Without `--admin-token-file` the token-guarded paths and the status
//! page answer 404, as if they did not exist. The page itself carries no
//! data: a browser cannot send a bearer token on a plain navigation, so
//! the page asks for the token and sends it on its `fetch` of
//! `/status.json`. A missing or wrong token gets 401 with
//! `WWW-Authenticate: Bearer` (RFC 6750 §3).

pub(crate) mod auth;
pub(crate) mod keys;
pub(crate) mod metrics;
pub(crate) mod status;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http::{Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use idem_core::DynStore;
use idem_http::{problem, BoxBody};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

pub(crate) use auth::AdminToken;

/// What every admin request can reach.
#[allow(dead_code)] // skeleton: the keys and status modules read these
pub(crate) struct AdminState {
    /// The gateway's store (every call bounded by `--store-timeout`; the
    /// listing capability is reached through `store.admin()`).
    pub store: DynStore,
    /// The store's kind (`sqlite`, `redis`, …).
    pub kind: &'static str,
    /// The bearer token of the guarded paths; `None`: they answer 404.
    pub token: Option<AdminToken>,
    /// The longest store call.
    pub store_timeout: Duration,
    /// The readiness check, shared with the public listener.
    pub health: Arc<crate::health::Health>,
    /// The status page's cached store probe and in-flight listing.
    pub status: status::PageState,
}

/// Most admin connections served at once: 16 (within the 32 file
/// descriptors the connection cap keeps for the gateway itself, so the
/// admin port can never starve the client port). Past it a new connection
/// is closed at once.
pub(crate) const MAX_ADMIN_CONNECTIONS: usize = 16;
/// How long an admin connection may wait for its first byte, and for each
/// request head: 10 s.
pub(crate) const ADMIN_HEADER_TIMEOUT: Duration = Duration::from_secs(10);
/// The longest life of one admin connection: 60 s (a scraper or the
/// status page reconnects; a silent HTTP/2 connection cannot stay).
pub(crate) const ADMIN_CONNECTION_LIFETIME: Duration = Duration::from_secs(60);

/// Serves the admin listener until `stop` is cancelled. Connections are
/// served on their own tasks, at most [`MAX_ADMIN_CONNECTIONS`] at once,
/// each closed when it sends nothing for [`ADMIN_HEADER_TIMEOUT`] after
/// accept, when a request head takes longer than that, and after
/// [`ADMIN_CONNECTION_LIFETIME`] in any case.
pub(crate) async fn serve(listener: TcpListener, state: Arc<AdminState>, stop: CancellationToken) {
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_ADMIN_CONNECTIONS));
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(ADMIN_HEADER_TIMEOUT);
    let builder = Arc::new(builder);
    loop {
        let (stream, peer) = tokio::select! {
            () = stop.cancelled() => return,
            r = listener.accept() => match r {
                Ok(a) => a,
                Err(e) => {
                    tracing::warn!(error = %e, "admin listener: accepting a connection failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            tracing::debug!(%peer, "admin listener: {MAX_ADMIN_CONNECTIONS} connections open; closing a new one");
            drop(stream);
            continue;
        };
        let state = state.clone();
        let builder = builder.clone();
        let stop = stop.clone();
        tokio::spawn(async move {
            let _slot = slot;
            let mut first = [0u8; 1];
            match tokio::time::timeout(ADMIN_HEADER_TIMEOUT, stream.peek(&mut first)).await {
                Ok(Ok(n)) if n > 0 => {}
                _ => return,
            }
            let service = hyper::service::service_fn(move |req| {
                let state = state.clone();
                async move { Ok::<_, Infallible>(route(req, &state, peer).await) }
            });
            let conn = builder.serve_connection(TokioIo::new(stream), service);
            tokio::select! {
                r = conn => if let Err(e) = r {
                    tracing::debug!(error = %e, %peer, "admin connection ended with an error");
                },
                () = stop.cancelled() => {}
                () = tokio::time::sleep(ADMIN_CONNECTION_LIFETIME) => {}
            }
        });
    }
}

/// Dispatches one admin request.
async fn route(req: Request<Incoming>, state: &AdminState, peer: SocketAddr) -> Response<BoxBody> {
    let path = req.uri().path().to_owned();
    match path.as_str() {
        "/metrics" => {
            if req.method() != Method::GET && req.method() != Method::HEAD {
                return method_not_allowed();
            }
            metrics::render()
        }
        crate::health::LIVE_PATH | crate::health::READY_PATH | crate::health::HEALTH_PATH => {
            crate::health::respond(&req, &state.health, crate::health::Audience::Operator)
                .await
                .unwrap_or_else(not_found)
        }
        p if p == "/keys" || p.starts_with("/keys/") => {
            match auth::denied(&req, state.token.as_ref()) {
                None => keys::handle(req, state, peer).await,
                Some(resp) => resp,
            }
        }
        p if status::is_page_asset(p) => match state.token {
            Some(_) => status::asset(&req),
            None => not_found(),
        },
        "/status.json" => match auth::denied(&req, state.token.as_ref()) {
            None => status::handle(req, state).await,
            Some(resp) => resp,
        },
        _ => not_found(),
    }
}

/// 404 problem for an unknown admin path.
pub(crate) fn not_found() -> Response<BoxBody> {
    problem(StatusCode::NOT_FOUND, "not-found", "no such admin endpoint")
}

/// 405 problem.
pub(crate) fn method_not_allowed() -> Response<BoxBody> {
    problem(
        StatusCode::METHOD_NOT_ALLOWED,
        "method-not-allowed",
        "this admin endpoint does not answer this method",
    )
}

/// Binds the admin listener.
///
/// # Errors
/// The bind error.
pub(crate) async fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    TcpListener::bind(addr).await
}
