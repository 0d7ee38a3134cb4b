//! The reverse proxy: the inner service the idempotency layer wraps.

use std::convert::Infallible;
use std::future::Future;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderName, HeaderValue};
use http::uri::{Authority, PathAndQuery, Scheme};
use http::{HeaderMap, Method, Request, Response, StatusCode, Uri, Version};
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use idem_core::HoldReason;
use idem_http::{
    normalize_path, problem, BoxBody, BoxError, Disposition, Fence, IDEMPOTENCY_FENCE,
};
use ipnet::IpNet;
use std::borrow::Cow;
use tower_http::timeout::{TimeoutBody, TimeoutError};
use tracing::Instrument;

use crate::tls::upstream::{is_handshake_refusal, Connector};
use crate::tls::{TlsError, UpstreamTls};

/// Hop-by-hop fields (RFC 9110 §7.6.1) and their removal, shared with the
/// layer's replays; `Idempotency-Key` is kept even when `Connection` names it.
pub use idem_http::replay::{strip_hop_by_hop, HOP_BY_HOP};

static X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
static X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");
static X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");

/// [`Forwarding::apply`] for one request from `peer`.
#[cfg(test)]
pub(crate) fn set_forwarding(
    headers: &mut HeaderMap,
    peer: IpAddr,
    trusted: bool,
    host: Option<&HeaderValue>,
    tls: bool,
) {
    Forwarding::new(peer, trusted, tls).apply(headers, host);
}

/// The forwarding fields' parts that depend only on the client's
/// connection (the peer, whether it is trusted, TLS or not), formatted once
/// per connection rather than once per request; [`Forwarding::apply`] sets
/// them on each request.
#[derive(Debug)]
pub(crate) struct Forwarding {
    trusted: bool,
    /// `https` or `http`.
    proto: &'static str,
    /// The canonical peer address, as `X-Forwarded-For` appends it.
    client: HeaderValue,
    /// This hop's RFC 7239 `for` node: `for=192.0.2.1` or
    /// `for="[2001:db8::1]"`.
    for_node: String,
    /// This hop's whole element without a host: `for=…;proto=<proto>`.
    element_without_host: HeaderValue,
}

impl Forwarding {
    /// The forwarding of a connection from `peer` (`trusted` when it is one
    /// of the operator's proxies), over TLS when `tls`.
    pub(crate) fn new(peer: IpAddr, trusted: bool, tls: bool) -> Self {
        let proto = if tls { "https" } else { "http" };
        let peer = peer.to_canonical();
        let client = peer.to_string();
        let for_node = match peer {
            IpAddr::V4(_) => format!("for={client}"),
            IpAddr::V6(_) => format!("for=\"[{client}]\""),
        };
        let element_without_host = format!("{for_node};proto={proto}");
        Self {
            trusted,
            proto,
            client: HeaderValue::from_str(&client)
                .unwrap_or_else(|_| HeaderValue::from_static("unknown")),
            element_without_host: HeaderValue::from_str(&element_without_host)
                .unwrap_or_else(|_| HeaderValue::from_static("for=unknown")),
            for_node,
        }
    }

    /// The forwarding of a connection from `peer` to `upstream`, which says
    /// whether the peer is trusted.
    pub(crate) fn to(upstream: &Upstream, peer: IpAddr, tls: bool) -> Self {
        Self::new(peer, upstream.trusts(peer), tls)
    }

    /// Sets the forwarding fields of a request from the peer, whose `Host`
    /// (or target authority) was `host`, over this hop (`https` when the client's
    /// connection is TLS, else `http`): `X-Forwarded-For` (the peer appended),
    /// `X-Forwarded-Host` (the original host), `X-Forwarded-Proto: <proto>`,
    /// and `Forwarded` (RFC 7239, an element `for=…;host="…";proto=<proto>`
    /// appended).
    ///
    /// From a trusted peer (a proxy of the operator's, `--trusted-proxy`)
    /// the fields it sent are kept: its `X-Forwarded-Host`/`-Proto` describe
    /// the original request and stay; the lists are appended to. From any other
    /// peer every one of these fields is dropped first, so a client cannot
    /// claim another address, host or scheme to the upstream.
    pub(crate) fn apply(&self, headers: &mut HeaderMap, host: Option<&HeaderValue>) {
        if !self.trusted {
            for name in [
                &X_FORWARDED_FOR,
                &X_FORWARDED_HOST,
                &X_FORWARDED_PROTO,
                &header::FORWARDED,
            ] {
                headers.remove(name);
            }
            // None of them is left: the lists are this hop's alone.
            headers.insert(X_FORWARDED_FOR.clone(), self.client.clone());
            if let Some(h) = host {
                headers.insert(X_FORWARDED_HOST.clone(), h.clone());
            }
            headers.insert(
                X_FORWARDED_PROTO.clone(),
                HeaderValue::from_static(self.proto),
            );
            let element = self.element(host);
            headers.insert(header::FORWARDED, element);
            return;
        }
        append_forwarded_for_str(headers, &self.client);
        if let Some(h) = host {
            if !headers.contains_key(&X_FORWARDED_HOST) {
                headers.insert(X_FORWARDED_HOST.clone(), h.clone());
            }
        }
        if !headers.contains_key(&X_FORWARDED_PROTO) {
            headers.insert(
                X_FORWARDED_PROTO.clone(),
                HeaderValue::from_static(self.proto),
            );
        }
        self.append_forwarded(headers, host);
    }

    /// This hop's RFC 7239 element: `for=…;host="…";proto=<proto>`, the
    /// `host` a quoted-string (a host with a port is not a token) and left
    /// out when it is not text or holds a `"` or `\`.
    fn element(&self, host: Option<&HeaderValue>) -> HeaderValue {
        match host.and_then(|h| h.to_str().ok()) {
            Some(h) if !h.contains(['"', '\\']) => {
                let mut v = Vec::with_capacity(
                    self.for_node.len() + h.len() + ";host=\"\";proto=".len() + self.proto.len(),
                );
                v.extend_from_slice(self.for_node.as_bytes());
                v.extend_from_slice(b";host=\"");
                v.extend_from_slice(h.as_bytes());
                v.extend_from_slice(b"\";proto=");
                v.extend_from_slice(self.proto.as_bytes());
                HeaderValue::from_maybe_shared(Bytes::from(v))
                    .unwrap_or_else(|_| self.element_without_host.clone())
            }
            _ => self.element_without_host.clone(),
        }
    }

    /// Appends this hop's element to `Forwarded`, joining earlier fields
    /// into one comma-separated list.
    fn append_forwarded(&self, headers: &mut HeaderMap, host: Option<&HeaderValue>) {
        let element = self.element(host);
        let mut value: Vec<u8> = Vec::new();
        for v in headers.get_all(header::FORWARDED) {
            value.extend_from_slice(v.as_bytes());
            value.extend_from_slice(b", ");
        }
        let value = if value.is_empty() {
            element
        } else {
            value.extend_from_slice(element.as_bytes());
            HeaderValue::from_maybe_shared(Bytes::from(value)).unwrap_or(element)
        };
        headers.remove(header::FORWARDED);
        headers.insert(header::FORWARDED, value);
    }
}

/// Appends `client` to `X-Forwarded-For`, joining earlier fields into one
/// comma-separated list (`X-Forwarded-For: 203.0.113.7, 10.0.0.2`).
pub fn append_forwarded_for(headers: &mut HeaderMap, client: IpAddr) {
    let client = client.to_canonical().to_string();
    let client =
        HeaderValue::from_str(&client).unwrap_or_else(|_| HeaderValue::from_static("unknown"));
    append_forwarded_for_str(headers, &client);
}

/// [`append_forwarded_for`] with the client's canonical address already
/// formatted.
fn append_forwarded_for_str(headers: &mut HeaderMap, client: &HeaderValue) {
    let mut list: Vec<&str> = headers
        .get_all(&X_FORWARDED_FOR)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .collect();
    let value = if list.is_empty() {
        client.clone()
    } else {
        list.push(client.to_str().unwrap_or("unknown"));
        HeaderValue::from_str(&list.join(", ")).unwrap_or_else(|_| client.clone())
    };
    headers.remove(&X_FORWARDED_FOR);
    headers.insert(X_FORWARDED_FOR.clone(), value);
}

/// The upstream's address split into the parts a request needs, and the
/// peers whose forwarding fields are trusted.
#[derive(Debug)]
pub(crate) struct Upstream {
    /// `http` or `https`.
    scheme: Scheme,
    authority: Authority,
    host: HeaderValue,
    /// Path prefix without a trailing slash ("" for none), normalised.
    prefix: String,
    /// `--trusted-proxy`.
    trusted: Vec<IpNet>,
}

impl Upstream {
    /// The scheme (`http` or `https`; `http` when the URI has none) and
    /// the authority are kept as given: the `Host` sent upstream is the
    /// URL's authority, with its port only when the URL names one.
    ///
    /// # Errors
    /// A message for a URI without a host, or whose path prefix is not a
    /// normalised path ([`normalize_path`]: no `..`, `//`, `%2F`, …), since
    /// the prefix is what no request may leave.
    pub(crate) fn new(uri: &Uri) -> Result<Self, String> {
        let authority = uri
            .authority()
            .cloned()
            .ok_or_else(|| format!("{uri} has no host"))?;
        let host = HeaderValue::from_str(authority.as_str())
            .map_err(|_| format!("{uri}: the host is not a valid header value"))?;
        let prefix = uri.path().trim_end_matches('/').to_owned();
        if !prefix.is_empty() {
            match normalize_path(&prefix) {
                Ok(Cow::Borrowed(_)) => {}
                Ok(Cow::Owned(n)) => {
                    return Err(format!(
                        "{uri}: the path prefix {prefix:?} is not in normal form; write it as {n:?}"
                    ))
                }
                Err(e) => return Err(format!("{uri}: the path prefix {prefix:?} is refused: {e}")),
            }
        }
        Ok(Self {
            scheme: uri.scheme().cloned().unwrap_or(Scheme::HTTP),
            authority,
            host,
            prefix,
            trusted: Vec::new(),
        })
    }

    /// The same upstream, trusting the forwarding fields of peers in
    /// `trusted` (`--trusted-proxy`).
    pub(crate) fn trusting(mut self, trusted: Vec<IpNet>) -> Self {
        self.trusted = trusted;
        self
    }

    /// Whether `peer` is a trusted proxy.
    fn trusts(&self, peer: IpAddr) -> bool {
        let peer = peer.to_canonical();
        self.trusted.iter().any(|net| net.contains(&peer))
    }

    /// The upstream URI for a request's target: prefix + path + query.
    /// `None` unless the target is origin- or absolute-form with a path in
    /// normal form ([`normalize_path`], as the gateway's entry makes it):
    /// a path with dot segments or encoded slashes could leave the prefix
    /// at an upstream that resolves them (`/api/../admin`).
    fn uri_for(&self, target: &Uri) -> Option<Uri> {
        let pq = target.path_and_query()?.as_str();
        if !pq.starts_with('/') {
            return None;
        }
        if !matches!(normalize_path(target.path()), Ok(Cow::Borrowed(_))) {
            return None;
        }
        let pq: PathAndQuery = if self.prefix.is_empty() {
            pq.parse().ok()?
        } else {
            format!("{}{pq}", self.prefix).parse().ok()?
        };
        Uri::builder()
            .scheme(self.scheme.clone())
            .authority(self.authority.clone())
            .path_and_query(pq)
            .build()
            .ok()
    }
}

/// The HTTP client used for every upstream call: pooled keep-alive
/// connections over TCP, TLS for an `https://` upstream
/// ([`crate::tls::upstream`]); HTTP/1.1, or HTTP/2 only with
/// `--upstream-http2` (prior knowledge h2c to an `http://` upstream, ALPN
/// `h2` over TLS).
#[derive(Clone, Debug)]
pub(crate) struct UpstreamClient {
    client: Client<Connector, BoxBody>,
    /// HTTP/2 to the upstream (`--upstream-http2`).
    http2: bool,
}

/// The upstream client for `upstream` (its scheme says whether TLS is
/// used). `tls` (`--upstream-ca`, `--upstream-client-cert/-key`) is read
/// only for an `https://` upstream. `upstream_timeout` bounds the connect,
/// TCP and TLS handshake together (half of it, at most 5 s);
/// `idle_timeout` (`--upstream-idle-timeout`) is how long a pooled
/// keep-alive connection may sit unused before it is dropped rather than
/// reused.
///
/// The idle timeout must stay below the upstream's own keep-alive timeout
/// (Node.js 5 s, gunicorn 2 s, …): a request written to a connection the
/// upstream is closing at that moment fails with "connection closed before
/// message completed", an outcome the gateway cannot know, so the key is
/// held for its lease.
///
/// # Errors
/// A [`TlsError`] for an `https://` upstream whose TLS files cannot be
/// used, or when no CA is given and no system root loads
/// ([`crate::tls::upstream::client_config`]).
pub(crate) fn client(
    upstream: &Uri,
    tls: &UpstreamTls,
    http2: bool,
    upstream_timeout: Duration,
    idle_timeout: Duration,
) -> Result<UpstreamClient, TlsError> {
    let tls = if upstream.scheme() == Some(&Scheme::HTTPS) {
        Some(crate::tls::upstream::client_config(tls, http2)?)
    } else {
        None
    };
    // Shorter than the whole upstream timeout, so a host that does not
    // answer the TCP or TLS handshake is reported as "unreachable" (nothing
    // sent, key released) rather than as a timeout of unknown outcome.
    let connect_timeout = (upstream_timeout / 2).min(Duration::from_secs(5));
    let connector = Connector::new(tls, connect_timeout, http2);
    let mut builder = Client::builder(TokioExecutor::new());
    builder
        .pool_timer(TokioTimer::new())
        .pool_idle_timeout(idle_timeout);
    if http2 {
        builder.http2_only(true).timer(TokioTimer::new());
    }
    Ok(UpstreamClient {
        client: builder.build(connector),
        http2,
    })
}

/// Whether a failed upstream call reached nothing: the connection could
/// not be made (refused, timed out, a failed TLS handshake), or the
/// upstream's TLS layer refused it by an alert ([`is_handshake_refusal`],
/// e.g. a client certificate it requires and did not get).
fn nothing_sent(e: &hyper_util::client::legacy::Error) -> bool {
    e.is_connect() || is_handshake_refusal(e)
}

/// Whether the client's `TE` lists `trailers` (RFC 9110 §10.1.4): it takes
/// trailer fields, so the upstream may send them. Passed on to an HTTP/2
/// upstream only: an HTTP/1.1 request is forwarded without `TE` (and
/// without `Trailer`), as before HTTP/2 support.
fn accepts_trailers(headers: &HeaderMap) -> bool {
    headers
        .get_all(header::TE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|t| t.split(';').next())
        .any(|t| t.trim().eq_ignore_ascii_case("trailers"))
}

/// The `Trailer` fields of a response, which [`strip_hop_by_hop`] removes
/// but which are end-to-end (RFC 9110 §6.6.2): to an HTTP/1.1 client
/// (that sent `TE: trailers`, on a chunked response) hyper sends only the
/// trailer fields the response announced in them.
fn announced_trailers(headers: &HeaderMap) -> Vec<HeaderValue> {
    headers.get_all(header::TRAILER).iter().cloned().collect()
}

/// Puts back the `Trailer` fields taken by [`announced_trailers`].
fn announce_trailers(headers: &mut HeaderMap, trailer: Vec<HeaderValue>) {
    for v in trailer {
        headers.append(header::TRAILER, v);
    }
}

/// Forwards one request to the upstream. Cloned per connection with the
/// client's address.
#[derive(Clone, Debug)]
pub(crate) struct Proxy {
    pub(crate) client: UpstreamClient,
    pub(crate) upstream: Arc<Upstream>,
    pub(crate) timeout: Duration,
    /// The forwarding fields of the client's connection: its address,
    /// whether it is a trusted proxy, and whether it is TLS
    /// (`X-Forwarded-Proto: https`).
    pub(crate) forwarding: Arc<Forwarding>,
    /// `idem_upstream_duration_seconds`: request sent to response head.
    pub(crate) duration: metrics::Histogram,
}

impl tower_service::Service<Request<BoxBody>> for Proxy {
    type Response = Response<BoxBody>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response<BoxBody>, Infallible>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<BoxBody>) -> Self::Future {
        let this = self.clone();
        Box::pin(async move { Ok(this.forward(req).await) })
    }
}

/// The `idem.upstream` span of one upstream call (`DEBUG`, target `idem`:
/// recorded only when traces are exported; see [`crate::otel`]).
fn upstream_span(method: &Method, path: &str) -> tracing::Span {
    tracing::debug_span!(
        target: "idem",
        "idem.upstream",
        otel.kind = "client",
        http.request.method = %method,
        url.path = path,
        http.response.status_code = tracing::field::Empty,
        error.type = tracing::field::Empty,
        otel.status_code = tracing::field::Empty,
    )
}

/// Records the upstream's status, or what failed, on its span.
fn record_upstream<B>(
    span: &tracing::Span,
    sent: &Result<
        Result<Response<B>, hyper_util::client::legacy::Error>,
        tokio::time::error::Elapsed,
    >,
) {
    if span.is_disabled() {
        return;
    }
    let error = match sent {
        Ok(Ok(resp)) => {
            span.record("http.response.status_code", resp.status().as_u16());
            resp.status().is_server_error().then_some("http-status")
        }
        Ok(Err(e)) if nothing_sent(e) => Some("connect"),
        Ok(Err(_)) => Some("connection"),
        Err(_) => Some("timeout"),
    };
    if let Some(kind) = error {
        span.record("error.type", kind);
        span.record("otel.status_code", "error");
    }
}

fn with_disposition(mut resp: Response<BoxBody>, d: Disposition) -> Response<BoxBody> {
    resp.extensions_mut().insert(d);
    resp
}

/// `resp` marked [`Disposition::Hold`] with the [`HoldReason`] the layer
/// records on the key.
fn held_for(resp: Response<BoxBody>, reason: HoldReason) -> Response<BoxBody> {
    let mut resp = with_disposition(resp, Disposition::Hold);
    resp.extensions_mut().insert(reason);
    resp
}

impl Proxy {
    /// Forwards one request and answers with the upstream's response, or a
    /// problem (502/504) carrying the key's [`Disposition`].
    async fn forward(self, req: Request<BoxBody>) -> Response<BoxBody> {
        let (mut parts, body) = req.into_parts();
        if parts.method == Method::CONNECT {
            return with_disposition(
                problem(
                    StatusCode::METHOD_NOT_ALLOWED,
                    "method-not-allowed",
                    "CONNECT is not proxied by the gateway",
                ),
                Disposition::Release,
            );
        }
        let Some(uri) = self.upstream.uri_for(&parts.uri) else {
            return with_disposition(
                problem(
                    StatusCode::BAD_REQUEST,
                    "bad-request-target",
                    "the request target must be an origin-form path such as /orders?id=1",
                ),
                Disposition::Release,
            );
        };
        let original_host = parts.headers.get(header::HOST).cloned().or_else(|| {
            parts
                .uri
                .authority()
                .and_then(|a| HeaderValue::from_str(a.as_str()).ok())
        });

        // HTTP/2 has no Upgrade (RFC 9113 §8.2.2): none is asked of an h2 upstream.
        let upgrade = if self.client.http2 {
            None
        } else {
            crate::upgrade::asked(&mut parts)
        };
        let headers = &mut parts.headers;
        let te_trailers = self.client.http2 && accepts_trailers(headers);
        strip_hop_by_hop(headers);
        if te_trailers {
            // The one `TE` allowed in HTTP/2 (RFC 9113 §8.2.2); gRPC needs it.
            headers.insert(header::TE, HeaderValue::from_static("trailers"));
        }
        if let Some(asked) = &upgrade {
            asked.restore(headers);
        }
        // `Expect: 100-continue` was answered by this hop's server already.
        headers.remove(header::EXPECT);
        // The fence is the gateway's to send (a guarded request's lease),
        // never the client's.
        headers.remove(IDEMPOTENCY_FENCE);
        if let Some(fence) = parts.extensions.get::<Fence>() {
            headers.insert(IDEMPOTENCY_FENCE, fence.header_value());
        }
        self.forwarding.apply(headers, original_host.as_ref());
        headers.insert(header::HOST, self.upstream.host.clone());
        parts.uri = uri;
        parts.version = Version::HTTP_11;
        let method = parts.method.clone();
        let path = parts.uri.path().to_owned();
        let span = upstream_span(&method, &path);
        // With `--otlp-endpoint`, the upstream continues the trace from
        // this call (a new `traceparent`); otherwise the client's passes.
        #[cfg(feature = "otel")]
        crate::otel::inject(&span, &mut parts.headers);

        let started = std::time::Instant::now();
        let sent = tokio::time::timeout(
            self.timeout,
            self.client.client.request(Request::from_parts(parts, body)),
        )
        .instrument(span.clone())
        .await;
        self.duration.record(started.elapsed());
        record_upstream(&span, &sent);
        match sent {
            Ok(Ok(resp)) if resp.status().is_informational() => {
                // Only a 101 reaches here (hyper skips other 1xx): the
                // upgrade the request asked for (see `crate::upgrade`),
                // or an answer to a request that asked for none (a guarded
                // one never does: its `Upgrade` was stripped), unusable.
                if let Some(asked) = upgrade {
                    if resp.status() == StatusCode::SWITCHING_PROTOCOLS {
                        return asked.switch(resp);
                    }
                }
                tracing::error!(%method, %path, status = resp.status().as_u16(), "the upstream switched protocols on a request that asked for no upgrade");
                with_disposition(
                    problem(
                        StatusCode::BAD_GATEWAY,
                        "upstream-protocol",
                        format!(
                            "the upstream answered {} (switching protocols) to a request that \
                             asked for no upgrade the gateway passes on, and nothing was stored",
                            resp.status().as_u16()
                        ),
                    ),
                    Disposition::Release,
                )
            }
            Ok(Ok(resp)) => {
                let (mut parts, body) = resp.into_parts();
                let trailer = announced_trailers(&parts.headers);
                strip_hop_by_hop(&mut parts.headers);
                announce_trailers(&mut parts.headers, trailer);
                let version = parts.version;
                // Only the gateway says whether an answer is a replay, on
                // guarded and unguarded requests alike.
                parts.headers.remove("idempotent-replayed");
                // The client's connection is the gateway's, not the
                // upstream's: an HTTP/1.0 upstream must not turn the answer
                // into HTTP/1.0 (hyper would then close the client's
                // keep-alive connection).
                parts.version = Version::HTTP_11;
                let body = UpstreamBody::new(body, self.timeout, version);
                Response::from_parts(parts, body.boxed_unsync())
            }
            Ok(Err(e)) if nothing_sent(&e) => {
                tracing::warn!(%method, %path, error = %error_chain(&e), "upstream unreachable; nothing was sent");
                with_disposition(
                    problem(
                        StatusCode::BAD_GATEWAY,
                        "upstream-unreachable",
                        "the upstream service could not be reached; the request was not sent and may be retried",
                    ),
                    Disposition::Release,
                )
            }
            Ok(Err(e)) => {
                tracing::error!(%method, %path, error = %error_chain(&e), "upstream failed after the request was sent; outcome unknown");
                held_for(
                    problem(
                        StatusCode::BAD_GATEWAY,
                        "upstream-failed",
                        "the upstream connection failed after the request was sent; its outcome is unknown, \
                         so the key is held",
                    ),
                    HoldReason::ConnectionLost,
                )
            }
            Err(_) => {
                tracing::error!(%method, %path, timeout = ?self.timeout, "upstream timed out; outcome unknown");
                held_for(
                    problem(
                        StatusCode::GATEWAY_TIMEOUT,
                        "upstream-timeout",
                        "the upstream did not answer in time; its outcome is unknown, \
                         so the key is held",
                    ),
                    HoldReason::Timeout,
                )
            }
        }
    }
}

pin_project_lite::pin_project! {
    /// The upstream's response body, failing when the upstream sends no
    /// frame for `timeout` (`--upstream-timeout`) while it is being read:
    /// an upstream that stalls mid-body must not hold the key, and its first
    /// caller, forever. The idle timeout is tower-http's [`TimeoutBody`]: it
    /// counts from each `poll_frame` that starts waiting for a new frame, so
    /// a slow reader downstream is never blamed on the upstream.
    ///
    /// Around it, this body keeps what `TimeoutBody` does not pass on: the
    /// upstream's declared length ([`Body::size_hint`], by which the layer
    /// streams a body declared larger than `--retention-limit` without
    /// buffering it), an error that names the timeout ([`BodyIdle`]), and the
    /// end after an error.
    ///
    /// Every frame is passed on, trailers included. Over HTTP/1.1 a body
    /// whose declared length is used up has ended (trailers need chunked
    /// coding, which has no length); over HTTP/2 trailers may follow a body
    /// of any declared length (RFC 9113 §8.1), so the end is only the inner
    /// body's.
    ///
    /// The error reaches the idempotency layer like any broken body: within
    /// `--retention-limit` the caller gets 502 `upstream-failed` and the key is
    /// held until its lease ends; past it, the streamed response is cut short.
    pub(crate) struct UpstreamBody<B> {
        #[pin]
        body: TimeoutBody<B>,
        timeout: Duration,
        // What is left of the declared length.
        left: SizeHint,
        // The body ended or failed: no more frames.
        ended: bool,
        // Trailers may follow the declared length (HTTP/2).
        trailers_after_length: bool,
    }
}

impl<B: Body> UpstreamBody<B> {
    /// Wraps `body`, of a response in `version`; must be polled within a
    /// Tokio runtime.
    pub(crate) fn new(body: B, timeout: Duration, version: Version) -> Self {
        Self {
            left: body.size_hint(),
            body: TimeoutBody::new(timeout, body),
            timeout,
            ended: false,
            trailers_after_length: version >= Version::HTTP_2,
        }
    }
}

/// The error of an [`UpstreamBody`] that timed out.
#[derive(Debug, thiserror::Error)]
#[error("the upstream sent no part of its response body for {}", humantime::format_duration(*.0))]
pub(crate) struct BodyIdle(Duration);

impl<B> Body for UpstreamBody<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.project();
        if *this.ended {
            return Poll::Ready(None);
        }
        let frame = ready!(this.body.poll_frame(cx));
        match &frame {
            Some(Ok(f)) => {
                if let Some(data) = f.data_ref() {
                    *this.left = shrunk(*this.left, data.len());
                }
            }
            _ => *this.ended = true,
        }
        let timeout = *this.timeout;
        Poll::Ready(frame.map(|r| {
            r.map_err(|e| {
                if e.is::<TimeoutError>() {
                    BodyIdle(timeout).into()
                } else {
                    e
                }
            })
        }))
    }

    fn is_end_stream(&self) -> bool {
        self.ended || (!self.trailers_after_length && self.left.exact() == Some(0))
    }

    fn size_hint(&self) -> SizeHint {
        if self.ended {
            SizeHint::with_exact(0)
        } else {
            self.left
        }
    }
}

/// `hint` less `n` bytes received.
fn shrunk(hint: SizeHint, n: usize) -> SizeHint {
    let n = n as u64;
    let mut left = SizeHint::new();
    left.set_lower(hint.lower().saturating_sub(n));
    if let Some(upper) = hint.upper() {
        left.set_upper(upper.saturating_sub(n));
    }
    left
}

/// An error and its sources, `outer: inner: innermost`.
pub(crate) fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::time::Instant;

    #[test]
    fn forwarded_for_is_appended() {
        let mut h = HeaderMap::new();
        append_forwarded_for(&mut h, "10.0.0.1".parse().unwrap());
        assert_eq!(h["x-forwarded-for"], "10.0.0.1");
        let mut h = HeaderMap::new();
        h.append(
            "x-forwarded-for",
            HeaderValue::from_static("203.0.113.7, 198.51.100.1"),
        );
        h.append("x-forwarded-for", HeaderValue::from_static("192.0.2.9"));
        append_forwarded_for(&mut h, "::ffff:10.0.0.2".parse().unwrap());
        assert_eq!(h.get_all("x-forwarded-for").iter().count(), 1);
        assert_eq!(
            h["x-forwarded-for"],
            "203.0.113.7, 198.51.100.1, 192.0.2.9, 10.0.0.2"
        );
    }

    #[test]
    fn forwarding_fields_of_untrusted_peers_are_replaced() {
        let mut h = HeaderMap::new();
        h.insert("x-forwarded-for", HeaderValue::from_static("203.0.113.7"));
        h.insert("x-forwarded-host", HeaderValue::from_static("evil.test"));
        h.insert("x-forwarded-proto", HeaderValue::from_static("https"));
        h.insert(
            "forwarded",
            HeaderValue::from_static("for=203.0.113.7;proto=https"),
        );
        let host = HeaderValue::from_static("shop.test:8000");
        let mut untrusted = h.clone();
        set_forwarding(
            &mut untrusted,
            "10.0.0.2".parse().unwrap(),
            false,
            Some(&host),
            false,
        );
        assert_eq!(untrusted["x-forwarded-for"], "10.0.0.2");
        assert_eq!(untrusted["x-forwarded-host"], "shop.test:8000");
        assert_eq!(untrusted["x-forwarded-proto"], "http");
        assert_eq!(
            untrusted["forwarded"],
            "for=10.0.0.2;host=\"shop.test:8000\";proto=http"
        );
        let mut trusted = h;
        set_forwarding(
            &mut trusted,
            "::ffff:10.0.0.2".parse().unwrap(),
            true,
            Some(&host),
            false,
        );
        assert_eq!(trusted["x-forwarded-for"], "203.0.113.7, 10.0.0.2");
        assert_eq!(trusted["x-forwarded-host"], "evil.test");
        assert_eq!(trusted["x-forwarded-proto"], "https");
        assert_eq!(
            trusted["forwarded"],
            "for=203.0.113.7;proto=https, for=10.0.0.2;host=\"shop.test:8000\";proto=http"
        );
        let mut v6 = HeaderMap::new();
        set_forwarding(&mut v6, "2001:db8::1".parse().unwrap(), false, None, false);
        assert_eq!(v6["forwarded"], "for=\"[2001:db8::1]\";proto=http");
        // Over the TLS listener the scheme is https.
        let mut tls = HeaderMap::new();
        set_forwarding(&mut tls, "10.0.0.2".parse().unwrap(), false, None, true);
        assert_eq!(tls["x-forwarded-proto"], "https");
        assert_eq!(tls["forwarded"], "for=10.0.0.2;proto=https");
    }

    /// The forwarding fields as they were set before [`Forwarding`]: every
    /// value formatted per request.
    fn set_forwarding_reference(
        headers: &mut HeaderMap,
        peer: IpAddr,
        trusted: bool,
        host: Option<&HeaderValue>,
        tls: bool,
    ) {
        let proto = if tls { "https" } else { "http" };
        if !trusted {
            for name in [
                &X_FORWARDED_FOR,
                &X_FORWARDED_HOST,
                &X_FORWARDED_PROTO,
                &header::FORWARDED,
            ] {
                headers.remove(name);
            }
        }
        let peer = peer.to_canonical();
        let client = peer.to_string();
        let mut list: Vec<String> = headers
            .get_all(&X_FORWARDED_FOR)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
            .collect();
        list.push(client.clone());
        let xff = HeaderValue::from_str(&list.join(", "))
            .or_else(|_| HeaderValue::from_str(&client))
            .unwrap_or_else(|_| HeaderValue::from_static("unknown"));
        headers.remove(&X_FORWARDED_FOR);
        headers.insert(X_FORWARDED_FOR.clone(), xff);
        if let Some(h) = host {
            if !headers.contains_key(&X_FORWARDED_HOST) {
                headers.insert(X_FORWARDED_HOST.clone(), h.clone());
            }
        }
        if !headers.contains_key(&X_FORWARDED_PROTO) {
            headers.insert(X_FORWARDED_PROTO.clone(), HeaderValue::from_static(proto));
        }
        let mut element = match peer {
            IpAddr::V4(v4) => format!("for={v4}"),
            IpAddr::V6(v6) => format!("for=\"[{v6}]\""),
        };
        if let Some(h) = host.and_then(|h| h.to_str().ok()) {
            if !h.contains(['"', '\\']) {
                element.push_str(&format!(";host=\"{h}\""));
            }
        }
        element.push_str(";proto=");
        element.push_str(proto);
        let mut value: Vec<u8> = Vec::new();
        for v in headers.get_all(header::FORWARDED) {
            value.extend_from_slice(v.as_bytes());
            value.extend_from_slice(b", ");
        }
        value.extend_from_slice(element.as_bytes());
        let value = HeaderValue::from_bytes(&value)
            .or_else(|_| HeaderValue::from_str(&element))
            .unwrap_or_else(|_| HeaderValue::from_static("for=unknown"));
        headers.remove(header::FORWARDED);
        headers.insert(header::FORWARDED, value);
    }

    #[test]
    fn forwarding_per_connection_matches_the_reference() {
        let peers: Vec<IpAddr> = [
            "10.0.0.2",
            "::ffff:10.0.0.2",
            "2001:db8::1",
            "::1",
            "0.0.0.0",
        ]
        .iter()
        .map(|p| p.parse().unwrap())
        .collect();
        let hosts: Vec<Option<HeaderValue>> = vec![
            None,
            Some(HeaderValue::from_static("shop.test:8000")),
            Some(HeaderValue::from_static("[::1]:8080")),
            Some(HeaderValue::from_static("a\"b")),
            Some(HeaderValue::from_static("a\\b")),
            Some(HeaderValue::from_static("")),
            Some(HeaderValue::from_bytes(b"caf\xc3\xa9.test").unwrap()),
        ];
        let fields: [(&str, &[u8]); 9] = [
            ("x-forwarded-for", b"203.0.113.7, 198.51.100.1"),
            ("x-forwarded-for", b" , 192.0.2.9,"),
            ("x-forwarded-for", b"\xff"),
            ("x-forwarded-host", b"evil.test"),
            ("x-forwarded-proto", b"https"),
            ("forwarded", b"for=203.0.113.7;proto=https"),
            ("forwarded", b""),
            ("forwarded", b"for=\xff"),
            ("content-type", b"text/plain"),
        ];
        for mask in 0u32..(1 << fields.len()) {
            let mut h = HeaderMap::new();
            h.insert(header::ACCEPT, HeaderValue::from_static("*/*"));
            for (i, (name, value)) in fields.iter().enumerate() {
                if mask & (1 << i) != 0 {
                    h.append(
                        HeaderName::from_static(name),
                        HeaderValue::from_bytes(value).unwrap(),
                    );
                }
            }
            h.insert(header::USER_AGENT, HeaderValue::from_static("t"));
            for &peer in &peers {
                for trusted in [false, true] {
                    for tls in [false, true] {
                        let forwarding = Forwarding::new(peer, trusted, tls);
                        for host in &hosts {
                            let mut want = h.clone();
                            set_forwarding_reference(&mut want, peer, trusted, host.as_ref(), tls);
                            let mut got = h.clone();
                            forwarding.apply(&mut got, host.as_ref());
                            let want: Vec<_> = want.iter().collect();
                            let got: Vec<_> = got.iter().collect();
                            assert_eq!(
                                got, want,
                                "{peer} trusted={trusted} tls={tls} {host:?} {h:?}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn trust_is_by_cidr() {
        let up = Upstream::new(&"http://127.0.0.1:9".parse().unwrap())
            .unwrap()
            .trusting(vec![
                "10.0.0.0/8".parse().unwrap(),
                "::1/128".parse().unwrap(),
            ]);
        assert!(up.trusts("10.1.2.3".parse().unwrap()));
        assert!(up.trusts("::ffff:10.1.2.3".parse().unwrap()));
        assert!(up.trusts("::1".parse().unwrap()));
        assert!(!up.trusts("11.0.0.1".parse().unwrap()));
        assert!(!up.trusts("127.0.0.1".parse().unwrap()));
    }

    #[test]
    fn the_prefix_cannot_be_left() {
        let up = Upstream::new(&"http://127.0.0.1:9/api".parse().unwrap()).unwrap();
        for escape in [
            "/../admin",
            "/a/../../admin",
            "/%2e%2e/admin",
            "//admin",
            "/..%2Fadmin",
        ] {
            assert!(up.uri_for(&escape.parse().unwrap()).is_none(), "{escape}");
        }
        let u = up.uri_for(&"/admin?x=/../y".parse().unwrap()).unwrap();
        assert_eq!(u.to_string(), "http://127.0.0.1:9/api/admin?x=/../y");
        for bad in [
            "http://h/api/../x",
            "http://h//api",
            "http://h/a%2Fb",
            "http://h/%61pi",
        ] {
            assert!(Upstream::new(&bad.parse().unwrap()).is_err(), "{bad}");
        }
    }

    type Frames = futures::stream::Iter<std::vec::IntoIter<Result<Frame<Bytes>, Infallible>>>;

    fn frames(n: usize) -> Frames {
        let frames: Vec<_> = (0..n)
            .map(|i| Ok(Frame::data(Bytes::from(format!("{i};")))))
            .collect();
        futures::stream::iter(frames)
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_that_stops_sending_fails_after_the_idle_timeout() {
        use futures::StreamExt;
        let stalled = frames(2).chain(futures::stream::pending());
        let mut body = std::pin::pin!(UpstreamBody::new(
            http_body_util::StreamBody::new(stalled),
            Duration::from_secs(2),
            Version::HTTP_11,
        ));
        assert!(body.frame().await.unwrap().is_ok());
        assert!(body.frame().await.unwrap().is_ok());
        let started = Instant::now();
        let err = body.frame().await.unwrap().unwrap_err();
        assert_eq!(started.elapsed(), Duration::from_secs(2));
        assert!(err.is::<BodyIdle>(), "{err}");
        assert!(err.to_string().contains("2s"), "{err}");
        assert!(body.frame().await.is_none(), "ends after the error");
        assert!(body.is_end_stream());
    }

    #[tokio::test]
    async fn the_declared_length_is_passed_on() {
        let mut body = std::pin::pin!(UpstreamBody::new(
            http_body_util::Full::new(Bytes::from_static(b"abcd")),
            Duration::from_secs(1),
            Version::HTTP_11,
        ));
        assert_eq!(body.size_hint().exact(), Some(4));
        assert!(!body.is_end_stream());
        assert!(body.frame().await.unwrap().is_ok());
        assert_eq!(body.size_hint().exact(), Some(0));
        assert!(body.is_end_stream());
    }

    #[tokio::test(start_paused = true)]
    async fn a_slow_reader_is_not_blamed_on_the_upstream() {
        let mut body = std::pin::pin!(UpstreamBody::new(
            http_body_util::StreamBody::new(frames(3)),
            Duration::from_secs(1),
            Version::HTTP_11,
        ));
        let mut got = Vec::new();
        while let Some(frame) = body.frame().await {
            got.extend_from_slice(&frame.unwrap().into_data().unwrap());
            tokio::time::sleep(Duration::from_secs(10)).await;
        }
        assert_eq!(got, b"0;1;2;");
    }

    #[test]
    fn te_trailers_is_found_in_any_list() {
        for (te, yes) in [
            ("trailers", true),
            ("gzip, Trailers", true),
            ("deflate;q=0.5, trailers;q=1", true),
            ("gzip", false),
            ("trailersx", false),
        ] {
            let mut h = HeaderMap::new();
            h.insert(header::TE, HeaderValue::from_static(te));
            assert_eq!(accepts_trailers(&h), yes, "{te}");
        }
        assert!(!accepts_trailers(&HeaderMap::new()));
    }

    #[tokio::test]
    async fn over_http2_trailers_may_follow_the_declared_length() {
        let mut trailers = HeaderMap::new();
        trailers.insert("grpc-status", HeaderValue::from_static("0"));
        let frames: Vec<Result<Frame<Bytes>, Infallible>> = vec![
            Ok(Frame::data(Bytes::from_static(b"abcd"))),
            Ok(Frame::trailers(trailers)),
        ];
        let inner = http_body_util::StreamBody::new(futures::stream::iter(frames));
        // A declared length, as hyper reports for `content-length: 4`.
        struct Declared<B>(B);
        impl<B: Body + Unpin> Body for Declared<B> {
            type Data = B::Data;
            type Error = B::Error;
            fn poll_frame(
                mut self: Pin<&mut Self>,
                cx: &mut Context<'_>,
            ) -> Poll<Option<Result<Frame<B::Data>, B::Error>>> {
                Pin::new(&mut self.0).poll_frame(cx)
            }
            fn size_hint(&self) -> SizeHint {
                SizeHint::with_exact(4)
            }
        }
        let mut body = std::pin::pin!(UpstreamBody::new(
            Declared(inner),
            Duration::from_secs(1),
            Version::HTTP_2,
        ));
        assert!(body.frame().await.unwrap().unwrap().is_data());
        assert!(!body.is_end_stream(), "the trailers are still to come");
        let t = body
            .frame()
            .await
            .unwrap()
            .unwrap()
            .into_trailers()
            .unwrap();
        assert_eq!(t["grpc-status"], "0");
        assert!(body.frame().await.is_none());
    }

    #[test]
    fn upstream_uris_keep_path_and_query_under_the_prefix() {
        let up = Upstream::new(&"http://127.0.0.1:9/api/".parse().unwrap()).unwrap();
        let u = up.uri_for(&"/orders?x=1&y=%20".parse().unwrap()).unwrap();
        assert_eq!(u.to_string(), "http://127.0.0.1:9/api/orders?x=1&y=%20");
        let up = Upstream::new(&"https://example.test/api".parse().unwrap()).unwrap();
        let u = up.uri_for(&"/a".parse().unwrap()).unwrap();
        assert_eq!(u.to_string(), "https://example.test/api/a");
        let up = Upstream::new(&"http://example.test".parse().unwrap()).unwrap();
        let u = up
            .uri_for(&"http://gw.test/a/b?q".parse().unwrap())
            .unwrap();
        assert_eq!(u.to_string(), "http://example.test/a/b?q");
        assert!(up.uri_for(&"*".parse().unwrap()).is_none());
        assert!(up.uri_for(&"gw.test:443".parse().unwrap()).is_none());
    }
}
