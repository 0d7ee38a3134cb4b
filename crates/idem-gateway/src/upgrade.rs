//! Protocol upgrades (RFC 9110 §7.8; WebSocket, RFC 6455 §4) through the
//! proxy: an unguarded HTTP/1.1 request asking for an upgrade goes to the
//! upstream with its `Connection: upgrade` and `Upgrade` fields, and when
//! the upstream answers `101 Switching Protocols` the client gets that 101
//! and the two upgraded connections are joined, bytes copied both ways,
//! until either side closes.
//!
//! - **Which requests.** An HTTP/1.1 request with an `Upgrade` field and
//!   `upgrade` among its `Connection` options, whose method idem never
//!   guards ([`UNGUARDABLE`]: GET, HEAD, OPTIONS, TRACE; a WebSocket
//!   handshake is a GET). Any other request loses its `Upgrade` as every
//!   hop-by-hop field, so a guarded request is never upgraded, whatever
//!   `--methods`, the routes or a reload say; an upstream 101 to it is a
//!   502 `upstream-protocol`, the key released. HTTP/1.0 requests,
//!   `h2c` (an upgrade of one connection to HTTP/2, never tunnelled) and
//!   HTTP/2 extended CONNECT (RFC 8441) are not upgraded.
//! - **Which 101s.** The upstream's 101 must name in `Upgrade` a protocol
//!   the client offered (RFC 9110 §7.8); otherwise, or when the upstream's
//!   side cannot be taken over, the client gets 502 `upstream-protocol`.
//! - **The connection cap.** An upgraded connection keeps the slot its
//!   client connection held under `--max-connections` ([`ConnectionSlot`])
//!   until the tunnel closes, and counts as a request in flight (it holds
//!   an upstream connection) while it copies.
//! - **Closing.** When one side ends its stream (EOF or an error), the
//!   other side's write half is shut down and its remaining bytes are
//!   copied for at most [`CLOSE_LINGER`]; then both connections are
//!   closed. There is no idle timeout: an upgraded connection with no
//!   traffic stays open (WebSocket pings keep their own time).
//! - **Shutdown.** [`Tunnels::close_by`]: the gateway's drain waits for
//!   tunnels like for requests in flight, and closes those still open at
//!   the shutdown deadline ([`crate::GatewayConfig::shutdown_grace`], 30 s).
//! - **Logs.** One DEBUG line (target `idem`, message `upgraded connection
//!   closed`) per tunnel: method, path, protocol, bytes each way, duration,
//!   and why it ended.

use std::io;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::header::{self, HeaderMap, HeaderValue};
use http::{request, Method, Response, StatusCode, Version};
use http_body_util::{BodyExt, Empty};
use hyper::upgrade::{OnUpgrade, Upgraded};
use hyper_util::rt::TokioIo;
use idem_http::{problem, BoxBody, Disposition, TaskTracker};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use idem_http::replay::strip_hop_by_hop;

/// The methods idem never guards (the configuration refuses them in
/// `--methods` and in routes: they are safe, RFC 9110 §9.2.1), and so the
/// only ones whose requests may be upgraded.
pub(crate) const UNGUARDABLE: [Method; 4] =
    [Method::GET, Method::HEAD, Method::OPTIONS, Method::TRACE];

/// How long the other direction of a tunnel may go on once one side ended
/// its stream (5 s), before both connections are closed: room for a
/// closing handshake (a WebSocket Close frame answered), not for a peer
/// that never closes.
pub(crate) const CLOSE_LINGER: Duration = Duration::from_secs(5);

/// The copy buffer of each direction of a tunnel (16 KiB).
const BUFFER: usize = 16 * 1024;

/// The upgraded connections of one gateway: tracked, so shutdown can wait
/// for them, and closed together at its deadline.
#[derive(Clone, Debug, Default)]
pub(crate) struct Tunnels {
    tracker: TaskTracker,
    stop: CancellationToken,
}

impl Tunnels {
    /// The tunnels open now (their upgrades included, from the 101 on).
    pub(crate) fn len(&self) -> usize {
        self.tracker.len()
    }

    /// The slot `permit` of a client connection, lent to a tunnel should
    /// one of its requests be upgraded; a tunnel also holds one of the
    /// `requests` permits (one per request in flight, the bound on upstream
    /// connections) while it copies.
    pub(crate) fn slot(
        &self,
        permit: OwnedSemaphorePermit,
        requests: Arc<Semaphore>,
    ) -> ConnectionSlot {
        ConnectionSlot {
            permit: Arc::new(Mutex::new(Some(permit))),
            requests,
            tunnels: self.clone(),
        }
    }

    /// Waits for every tunnel to close, until `deadline`; then closes those
    /// still open and waits for them to go. A tunnel whose upgrade completes
    /// after this is closed at once.
    pub(crate) async fn close_by(&self, deadline: Instant) {
        self.tracker.close();
        if !self.tracker.is_empty() {
            tracing::info!(
                upgraded = self.tracker.len(),
                "waiting for upgraded connections (WebSocket) to close"
            );
        }
        if tokio::time::timeout_at(deadline, self.tracker.wait())
            .await
            .is_err()
        {
            tracing::warn!(
                upgraded = self.tracker.len(),
                "upgraded connections still open at the shutdown deadline are closed"
            );
        }
        self.stop.cancel();
        self.tracker.wait().await;
    }
}

/// A client connection's slot under the connection cap
/// (`--max-connections`), shared by the connection's task and its
/// requests (a request extension): a tunnel takes it over, so an upgraded
/// connection, which outlives the HTTP connection it came from, still
/// counts until it closes.
#[derive(Clone, Debug)]
pub(crate) struct ConnectionSlot {
    permit: Arc<Mutex<Option<OwnedSemaphorePermit>>>,
    /// The gateway's requests in flight, which an upgraded connection
    /// counts among (it holds an upstream connection as a request does).
    requests: Arc<Semaphore>,
    tunnels: Tunnels,
}

impl ConnectionSlot {
    /// Held by the connection's task: frees the slot when dropped, unless a
    /// tunnel took it.
    pub(crate) fn hold(&self) -> HeldSlot {
        HeldSlot(self.clone())
    }

    fn take(&self) -> Option<OwnedSemaphorePermit> {
        self.permit.lock().map(|mut p| p.take()).unwrap_or(None)
    }
}

/// See [`ConnectionSlot::hold`].
#[derive(Debug)]
pub(crate) struct HeldSlot(ConnectionSlot);

impl Drop for HeldSlot {
    fn drop(&mut self) {
        drop(self.0.take());
    }
}

/// A request that asked for an upgrade the gateway will pass on.
#[derive(Debug)]
pub(crate) struct Asked {
    /// The client's `Upgrade` field (its fields joined).
    protocols: HeaderValue,
    /// The client connection, once the 101 is written.
    client: OnUpgrade,
    slot: ConnectionSlot,
    method: Method,
    path: String,
}

/// Takes from `parts` the upgrade it asks for, when the gateway passes it
/// on (see the module docs); `None` otherwise, and the request's `Upgrade`
/// is then stripped with the other hop-by-hop fields.
pub(crate) fn asked(parts: &mut request::Parts) -> Option<Asked> {
    let slot = parts.extensions.remove::<ConnectionSlot>();
    if parts.version != Version::HTTP_11
        || !UNGUARDABLE.contains(&parts.method)
        || !connection_has(&parts.headers, "upgrade")
    {
        return None;
    }
    let protocols = offer(&parts.headers)?;
    let client = parts.extensions.remove::<OnUpgrade>()?;
    Some(Asked {
        protocols,
        client,
        slot: slot?,
        method: parts.method.clone(),
        path: parts.uri.path().to_owned(),
    })
}

impl Asked {
    /// Puts `Connection: upgrade` and the client's `Upgrade` back on the
    /// request to the upstream (RFC 9110 §7.8: a proxy re-adds them for the
    /// next hop), after the hop-by-hop fields were stripped.
    pub(crate) fn restore(&self, headers: &mut HeaderMap) {
        headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        headers.insert(header::UPGRADE, self.protocols.clone());
    }

    /// The client's answer to the upstream's `101` `resp`: that 101 (its
    /// fields but the hop-by-hop ones, with `Connection: upgrade` and the
    /// upstream's `Upgrade`), and a tunnel joining both connections once
    /// they are upgraded; or 502 `upstream-protocol` for a 101 that switches
    /// to a protocol the client did not offer.
    pub(crate) fn switch<B>(self, mut resp: Response<B>) -> Response<BoxBody> {
        let Some(chosen) = joined(resp.headers(), &header::UPGRADE)
            .filter(|chosen| offered(&self.protocols, chosen))
        else {
            tracing::error!(method = %self.method, path = %self.path, "the upstream switched to a protocol the client did not ask for");
            return refused(
                "the upstream answered 101 (switching protocols) without naming in Upgrade a \
                 protocol the client offered",
            );
        };
        let upstream = hyper::upgrade::on(&mut resp);
        let (mut parts, _) = resp.into_parts();
        strip_hop_by_hop(&mut parts.headers);
        parts.headers.remove("idempotent-replayed");
        parts
            .headers
            .insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        parts.headers.insert(header::UPGRADE, chosen.clone());
        parts.version = Version::HTTP_11;
        parts.extensions = http::Extensions::new();
        let tunnels = self.slot.tunnels.clone();
        let tunnel = Tunnel {
            permit: self.slot.take(),
            requests: self.slot.requests.clone(),
            protocol: String::from_utf8_lossy(chosen.as_bytes()).into_owned(),
            method: self.method,
            path: self.path,
            stop: tunnels.stop.clone(),
        };
        tunnels.tracker.spawn(tunnel.run(self.client, upstream));
        Response::from_parts(
            parts,
            Empty::new().map_err(|never| match never {}).boxed_unsync(),
        )
    }
}

/// 502 `upstream-protocol` with `detail`, the key released.
fn refused(detail: &str) -> Response<BoxBody> {
    let mut resp = problem(
        StatusCode::BAD_GATEWAY,
        "upstream-protocol",
        format!("{detail}; nothing was stored"),
    );
    resp.extensions_mut().insert(Disposition::Release);
    resp
}

/// Whether the `Connection` fields of `headers` list `option`.
fn connection_has(headers: &HeaderMap, option: &str) -> bool {
    headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|o| o.trim().eq_ignore_ascii_case(option))
}

/// The fields `name` of `headers` joined into one list; `None` without any
/// (or with only empty ones).
fn joined(headers: &HeaderMap, name: &header::HeaderName) -> Option<HeaderValue> {
    let values: Vec<&str> = headers
        .get_all(name)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|v| !v.is_empty())
        .collect();
    if values.is_empty() {
        return None;
    }
    HeaderValue::from_str(&values.join(", ")).ok()
}

/// The protocols the client's `Upgrade` fields offer, joined, but `h2c`:
/// an upgrade to HTTP/2 describes one connection (its `HTTP2-Settings` is
/// hop-by-hop, and RFC 9113 §3.1 deprecates it), not something to tunnel.
/// `None` when nothing is left.
fn offer(headers: &HeaderMap) -> Option<HeaderValue> {
    let protocols: Vec<&str> = headers
        .get_all(header::UPGRADE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .filter(|p| {
            let name = p.split('/').next().unwrap_or("");
            !name.trim().eq_ignore_ascii_case("h2c")
        })
        .collect();
    if protocols.is_empty() {
        return None;
    }
    HeaderValue::from_str(&protocols.join(", ")).ok()
}

/// Whether every protocol in `chosen` (the upstream's `Upgrade`) is one
/// of `offered` (the client's), names compared case-insensitively
/// (RFC 9110 §7.8: `protocol-name ["/" protocol-version]`).
fn offered(offered: &HeaderValue, chosen: &HeaderValue) -> bool {
    let list = |v: &HeaderValue| -> Vec<String> {
        v.to_str()
            .unwrap_or("")
            .split(',')
            .map(|p| p.trim().to_ascii_lowercase())
            .filter(|p| !p.is_empty())
            .collect()
    };
    let offered = list(offered);
    let chosen = list(chosen);
    !chosen.is_empty() && chosen.iter().all(|c| offered.contains(c))
}

/// One upgraded connection pair, copied both ways on a task of its own.
struct Tunnel {
    /// The client connection's slot under the connection cap.
    permit: Option<OwnedSemaphorePermit>,
    /// A request permit is taken once both sides are upgraded (the 101's
    /// own was given back when its response ended).
    requests: Arc<Semaphore>,
    protocol: String,
    method: Method,
    path: String,
    stop: CancellationToken,
}

/// Why a tunnel ended.
#[derive(Debug, Clone, Copy)]
enum End {
    /// Both sides ended their streams.
    Closed,
    /// One side ended; the other did not within [`CLOSE_LINGER`].
    Linger,
    /// The gateway shut down.
    Shutdown,
}

impl Tunnel {
    async fn run(self, client: OnUpgrade, upstream: OnUpgrade) {
        let _permit = self.permit;
        let started = Instant::now();
        let upgraded = tokio::select! {
            r = async { tokio::try_join!(client, upstream) } => r,
            () = self.stop.cancelled() => return,
        };
        let (client, upstream) = match upgraded {
            Ok(both) => both,
            Err(e) => {
                tracing::debug!(target: "idem", method = %self.method, path = %self.path, error = %e, "an upgrade did not complete");
                return;
            }
        };
        let _request = tokio::select! {
            p = self.requests.clone().acquire_owned() => p.ok(),
            () = self.stop.cancelled() => return,
        };
        let mut sent = 0;
        let mut received = 0;
        let end = join(client, upstream, &self.stop, &mut sent, &mut received).await;
        tracing::debug!(
            target: "idem",
            method = %self.method,
            path = %self.path,
            protocol = %self.protocol,
            bytes_to_upstream = sent,
            bytes_to_client = received,
            duration_ms = started.elapsed().as_millis() as u64,
            end = ?end,
            "upgraded connection closed"
        );
    }
}

/// Copies `client` to `upstream` (counted in `sent`) and back (counted in
/// `received`) until both ends close, one end closed for
/// [`CLOSE_LINGER`], or `stop`; the connections are closed when this
/// returns.
async fn join(
    client: Upgraded,
    upstream: Upgraded,
    stop: &CancellationToken,
    sent: &mut u64,
    received: &mut u64,
) -> End {
    let (mut client_read, mut client_write) = tokio::io::split(TokioIo::new(client));
    let (mut up_read, mut up_write) = tokio::io::split(TokioIo::new(upstream));
    let to_upstream = pump(&mut client_read, &mut up_write, sent);
    let to_client = pump(&mut up_read, &mut client_write, received);
    tokio::pin!(to_upstream, to_client);
    let upstream_bound_ended = tokio::select! {
        _ = &mut to_upstream => true,
        _ = &mut to_client => false,
        () = stop.cancelled() => return End::Shutdown,
    };
    let the_other = async {
        if upstream_bound_ended {
            to_client.await
        } else {
            to_upstream.await
        }
    };
    tokio::select! {
        r = tokio::time::timeout(CLOSE_LINGER, the_other) => match r {
            Ok(_) => End::Closed,
            Err(_) => End::Linger,
        },
        () = stop.cancelled() => End::Shutdown,
    }
}

/// Copies `from` to `to`, flushing each chunk (a TLS stream holds what is
/// not flushed), counting the bytes in `count`, until `from` ends or
/// either fails; then shuts `to`'s write half down.
async fn pump<R, W>(from: &mut R, to: &mut W, count: &mut u64) -> io::Result<()>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut buf = vec![0; BUFFER];
    let copied = async {
        loop {
            let n = from.read(&mut buf).await?;
            if n == 0 {
                return Ok(());
            }
            to.write_all(&buf[..n]).await?;
            to.flush().await?;
            *count += n as u64;
        }
    }
    .await;
    let _ = to.shutdown().await;
    copied
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_methods_idem_cannot_guard_are_upgraded() {
        for m in &UNGUARDABLE {
            assert!(
                crate::config::check_method(m).is_err(),
                "{m} can be guarded"
            );
        }
        assert!(crate::config::check_method(&Method::POST).is_ok());
    }

    #[test]
    fn the_upstream_must_pick_an_offered_protocol() {
        let client = HeaderValue::from_static("websocket, h2c/1");
        assert!(offered(&client, &HeaderValue::from_static("WebSocket")));
        assert!(offered(&client, &HeaderValue::from_static("h2c/1")));
        assert!(!offered(&client, &HeaderValue::from_static("h2c")));
        assert!(!offered(&client, &HeaderValue::from_static("tls/1.3")));
        assert!(!offered(&client, &HeaderValue::from_static(" , ")));
    }

    #[test]
    fn h2c_is_never_offered_upstream() {
        let mut h = HeaderMap::new();
        h.append(header::UPGRADE, HeaderValue::from_static("h2c"));
        assert_eq!(offer(&h), None);
        h.append(
            header::UPGRADE,
            HeaderValue::from_static("H2C/1, websocket"),
        );
        h.append(header::UPGRADE, HeaderValue::from_static(" , foo/2"));
        assert_eq!(offer(&h).unwrap(), "websocket, foo/2");
    }

    #[test]
    fn connection_options_are_a_case_insensitive_list() {
        let mut h = HeaderMap::new();
        h.append(header::CONNECTION, HeaderValue::from_static("keep-alive"));
        assert!(!connection_has(&h, "upgrade"));
        h.append(header::CONNECTION, HeaderValue::from_static("x, Upgrade"));
        assert!(connection_has(&h, "upgrade"));
    }

    #[test]
    fn a_slot_taken_by_a_tunnel_outlives_its_connection() {
        let sem = Arc::new(tokio::sync::Semaphore::new(1));
        let tunnels = Tunnels::default();
        let slot = tunnels.slot(sem.clone().try_acquire_owned().unwrap(), sem.clone());
        let held = slot.hold();
        let taken = slot.take();
        drop(held);
        assert_eq!(sem.available_permits(), 0, "the tunnel holds it");
        drop(taken);
        assert_eq!(sem.available_permits(), 1);
        let slot = tunnels.slot(sem.clone().try_acquire_owned().unwrap(), sem.clone());
        let held = slot.hold();
        let _request = slot.clone();
        drop(held);
        assert_eq!(sem.available_permits(), 1, "freed with its connection");
    }
}
