//! The connector for `https://` upstreams: system roots or `--upstream-ca`,
//! SNI and the name check from the URL's host, an optional client
//! certificate; and HTTP/2 to the upstream (`--upstream-http2`).
//!
//! The protocol to the upstream is chosen by the configuration, never by
//! the upstream: with `--upstream-http2`, HTTP/2 only (ALPN offers only
//! `h2`; to an `http://` upstream, prior knowledge h2c, RFC 9113 §3.3);
//! without it, HTTP/1.1 only (ALPN offers only `http/1.1`). Offering both
//! and letting an https upstream pick would turn an upstream that speaks h2
//! into an HTTP/2 hop whenever it can, and an HTTP/2 hop cannot carry an
//! HTTP/1.1 protocol upgrade (WebSocket, RFC 6455), which the gateway
//! passes on for unguarded requests.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http::Uri;
use hyper_rustls::{HttpsConnector, MaybeHttpsStream};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioIo;
use rustls::{ClientConfig, RootCertStore};
use tokio::net::TcpStream;

use super::{load_certs, load_key, TlsError, UpstreamTls};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The ALPN protocol id of HTTP/2 over TLS (RFC 9113 §3.2).
const ALPN_H2: &[u8] = b"h2";
/// The ALPN protocol id of HTTP/1.1 (RFC 7301 §6).
const ALPN_HTTP1: &[u8] = b"http/1.1";

/// The rustls client configuration for an `https://` upstream.
///
/// - Trust: the CAs of `tls.ca` (`--upstream-ca`) only, if given;
///   otherwise the system's roots (rustls-native-certs: `SSL_CERT_FILE`,
///   `SSL_CERT_DIR`, or the platform's store).
/// - The server's name is checked against the URL's host (SNI is sent for
///   a DNS name; an IP-address host is matched against the certificate's
///   IP-address SANs), by rustls's WebPKI verifier. There is no switch to
///   turn the check off.
/// - A client certificate when `tls.client_cert` and `tls.client_key` are
///   both given (a half pair is refused by `GatewayConfig::validate`, and
///   shows no certificate here).
/// - ALPN: `h2` only with `http2`, `http/1.1` only without.
/// - TLS 1.2 and 1.3, the *ring* provider's safe defaults.
///
/// # Errors
/// [`TlsError::Read`]/[`TlsError::Pem`] for a file that cannot be read
/// or holds no certificate/key, [`TlsError::Rustls`] when rustls refuses a
/// CA or the key does not match the certificate, [`TlsError::NoRoots`]
/// when no `--upstream-ca` is given and no system root loads.
pub(crate) fn client_config(tls: &UpstreamTls, http2: bool) -> Result<ClientConfig, TlsError> {
    let roots = roots(tls)?;
    let builder =
        ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .map_err(|source| TlsError::Rustls {
                flag: "--upstream",
                source,
            })?
            .with_root_certificates(roots);
    let mut config = match (&tls.client_cert, &tls.client_key) {
        (Some(cert), Some(key)) => {
            let chain = load_certs("--upstream-client-cert", cert)?;
            let key = load_key("--upstream-client-key", key)?;
            builder
                .with_client_auth_cert(chain, key)
                .map_err(|source| TlsError::Rustls {
                    flag: "--upstream-client-cert/--upstream-client-key",
                    source,
                })?
        }
        _ => builder.with_no_client_auth(),
    };
    config.alpn_protocols = vec![if http2 { ALPN_H2 } else { ALPN_HTTP1 }.to_vec()];
    Ok(config)
}

/// The CAs an `https://` upstream's certificate must chain to.
fn roots(tls: &UpstreamTls) -> Result<RootCertStore, TlsError> {
    let mut roots = RootCertStore::empty();
    if let Some(ca) = &tls.ca {
        for cert in load_certs("--upstream-ca", ca)? {
            roots.add(cert).map_err(|source| TlsError::Rustls {
                flag: "--upstream-ca",
                source,
            })?;
        }
        return Ok(roots);
    }
    let found = rustls_native_certs::load_native_certs();
    let (added, _unparsable) = roots.add_parsable_certificates(found.certs);
    if added == 0 {
        let why = if found.errors.is_empty() {
            "none found".to_owned()
        } else {
            found
                .errors
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join("; ")
        };
        return Err(TlsError::NoRoots(why));
    }
    Ok(roots)
}

/// The stream of one upstream connection: plain TCP, or TLS over it.
pub(crate) type UpstreamStream = MaybeHttpsStream<TokioIo<TcpStream>>;

/// Opens upstream connections: TCP with `TCP_NODELAY`, then TLS for an
/// `https://` URI, both within one connect timeout. Every failure here
/// (refused, timed out, a failed TLS handshake: unknown CA, a name
/// mismatch, no common protocol) is a *connect* error of the client
/// (`hyper_util::client::legacy::Error::is_connect`): nothing was sent.
#[derive(Clone, Debug)]
pub(crate) struct Connector {
    inner: HttpsConnector<HttpConnector>,
    timeout: Duration,
    http2: bool,
}

impl Connector {
    /// A connector giving each connection (TCP and TLS handshake together)
    /// `timeout`, speaking HTTP/2 when `http2`. `tls` is the configuration
    /// for an `https://` upstream ([`client_config`]); `None` for an
    /// `http://` one (an `https://` URI then fails to connect: no CA is
    /// trusted).
    pub(crate) fn new(tls: Option<ClientConfig>, timeout: Duration, http2: bool) -> Self {
        let mut tcp = HttpConnector::new();
        tcp.set_nodelay(true);
        tcp.set_connect_timeout(Some(timeout));
        // The scheme is the TLS layer's to check.
        tcp.enforce_http(false);
        let tls = tls.unwrap_or_else(|| {
            ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
                .with_safe_default_protocol_versions()
                .expect("the ring provider supports the default protocol versions")
                .with_root_certificates(RootCertStore::empty())
                .with_no_client_auth()
        });
        Self {
            inner: HttpsConnector::from((tcp, tls)),
            timeout,
            http2,
        }
    }
}

/// A connection that took longer than the connect timeout (TCP connect and
/// TLS handshake together).
#[derive(Debug, thiserror::Error)]
#[error("connecting (TCP and TLS handshake) took longer than {}", humantime::format_duration(*.0))]
pub(crate) struct ConnectTimeout(Duration);

/// An `https://` upstream that did not agree to HTTP/2 in ALPN while
/// `--upstream-http2` asks for it.
#[derive(Debug, thiserror::Error)]
#[error("--upstream-http2: the upstream did not select h2 in the TLS handshake (ALPN), so it cannot speak HTTP/2 over TLS")]
pub(crate) struct NoH2;

impl tower_service::Service<Uri> for Connector {
    type Response = UpstreamStream;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<UpstreamStream, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, dst: Uri) -> Self::Future {
        let connecting = self.inner.call(dst);
        let (timeout, http2) = (self.timeout, self.http2);
        Box::pin(async move {
            let stream = tokio::time::timeout(timeout, connecting)
                .await
                .map_err(|_| ConnectTimeout(timeout))??;
            if let MaybeHttpsStream::Https(tls) = &stream {
                if http2 && tls.inner().get_ref().1.alpn_protocol() != Some(ALPN_H2) {
                    return Err(NoH2.into());
                }
            }
            Ok(stream)
        })
    }
}

/// Whether `e` (or an error it wraps) is a TLS alert by which the upstream
/// refused the handshake: its TLS layer rejected this connection, so no
/// request on it reached the service.
///
/// With TLS 1.3 a server checks the client's certificate only after the
/// client has finished its side of the handshake (RFC 8446 §4.4.2.4): a
/// missing or untrusted client certificate is reported by an alert that
/// arrives when the request has already been written, as a read error
/// rather than a connect error. These alerts are sent only during a
/// handshake (rustls has no renegotiation or post-handshake
/// authentication), so the request was never delivered.
pub(crate) fn is_handshake_refusal(e: &(dyn std::error::Error + 'static)) -> bool {
    use rustls::AlertDescription as A;
    let mut cur = Some(e);
    while let Some(err) = cur {
        if let Some(rustls::Error::AlertReceived(alert)) = err.downcast_ref::<rustls::Error>() {
            return matches!(
                alert,
                A::CertificateRequired
                    | A::BadCertificate
                    | A::UnsupportedCertificate
                    | A::CertificateRevoked
                    | A::CertificateExpired
                    | A::CertificateUnknown
                    | A::UnknownCA
                    | A::AccessDenied
                    | A::HandshakeFailure
                    | A::DecryptError
            );
        }
        // `io::Error::source` skips the error it wraps: look inside.
        cur = match err.downcast_ref::<std::io::Error>() {
            Some(io) => io
                .get_ref()
                .map(|inner| inner as &(dyn std::error::Error + 'static))
                .or_else(|| err.source()),
            None => err.source(),
        };
    }
    false
}
