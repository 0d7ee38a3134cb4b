//! TLS test support: a gateway serving TLS (optionally mTLS) with
//! certificates from `idem_testkit::pki`, and clients (rustls, hyper's
//! HTTP/1.1 and HTTP/2 connections) that trust its CA. Reusable by any test
//! that needs the TLS listener (`tls_gateway`, `client_config`, `connect`).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::{http1, http2};
use hyper_util::rt::{TokioExecutor, TokioIo};
use idem_gateway::tls::ListenerTls;
use idem_gateway::GatewayConfig;
pub use idem_testkit::pki::{Issued, TestCa, Usage};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;
use tokio_rustls::TlsConnector;

use super::{gateway, upstream, TestGateway, TestUpstream};

/// A TLS gateway in front of a counting upstream, and its PKI.
pub struct TlsRig {
    pub dir: tempfile::TempDir,
    /// The CA of the server certificate.
    pub ca: TestCa,
    /// The CA whose client certificates the gateway accepts (mTLS).
    pub client_ca: Option<TestCa>,
    pub cert: PathBuf,
    pub key: PathBuf,
    pub up: TestUpstream,
    pub gw: TestGateway,
}

impl TlsRig {
    pub fn addr(&self) -> SocketAddr {
        self.gw.addr
    }

    /// A client config trusting the server's CA, offering `alpn`, showing
    /// `client` (if any).
    pub fn client(&self, alpn: &[&[u8]], client: Option<&Issued>) -> Arc<rustls::ClientConfig> {
        client_config(&self.ca, alpn, client)
    }

    /// A client certificate from the gateway's client CA.
    pub fn client_cert(&self, name: &str) -> Issued {
        self.client_ca
            .as_ref()
            .expect("an mTLS rig")
            .issue(&[name], Usage::Client)
    }
}

/// Starts an upstream and a gateway serving TLS on 127.0.0.1 with a server
/// certificate for `localhost` and `127.0.0.1`; `mtls`: also a client CA
/// (`--tls-client-ca`). `tweak` adjusts the configuration last.
pub async fn tls_gateway(mtls: bool, tweak: impl FnOnce(&mut GatewayConfig)) -> TlsRig {
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new("idem test server CA");
    let (cert, key) = ca
        .issue(&["localhost", "127.0.0.1"], Usage::Server)
        .write(dir.path(), "server");
    let client_ca = mtls.then(|| TestCa::new("idem test client CA"));
    let client_ca_path = client_ca
        .as_ref()
        .map(|c| c.write(dir.path(), "client-ca.crt"));
    let up = upstream().await;
    let tls = ListenerTls {
        cert: cert.clone(),
        key: key.clone(),
        client_ca: client_ca_path,
    };
    let gw = gateway(&up.url(), |c| {
        c.tls = Some(tls);
        tweak(c);
    })
    .await;
    TlsRig {
        dir,
        ca,
        client_ca,
        cert,
        key,
        up,
        gw,
    }
}

/// A rustls client config trusting `ca` only, offering `alpn`, showing
/// `client`'s certificate when given.
pub fn client_config(
    ca: &TestCa,
    alpn: &[&[u8]],
    client: Option<&Issued>,
) -> Arc<rustls::ClientConfig> {
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(ca.cert_pem.as_bytes()) {
        roots.add(c.unwrap()).unwrap();
    }
    let builder = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots);
    let mut config = match client {
        None => builder.with_no_client_auth(),
        Some(c) => builder
            .with_client_auth_cert(
                vec![CertificateDer::from(c.cert_der.clone())],
                PrivateKeyDer::from_pem_slice(c.key_pem.as_bytes()).unwrap(),
            )
            .unwrap(),
    };
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Arc::new(config)
}

/// A TLS connection to `addr` for the name `localhost`.
pub async fn connect(
    addr: SocketAddr,
    config: Arc<rustls::ClientConfig>,
) -> std::io::Result<TlsStream<TcpStream>> {
    let tcp = TcpStream::connect(addr).await?;
    TlsConnector::from(config)
        .connect(ServerName::try_from("localhost").unwrap(), tcp)
        .await
}

/// The leaf certificate the server showed on `tls`.
pub fn server_leaf(tls: &TlsStream<TcpStream>) -> Vec<u8> {
    tls.get_ref().1.peer_certificates().unwrap()[0].to_vec()
}

/// The ALPN protocol negotiated on `tls`.
pub fn alpn(tls: &TlsStream<TcpStream>) -> Option<Vec<u8>> {
    tls.get_ref().1.alpn_protocol().map(<[u8]>::to_vec)
}

/// An HTTP connection over TLS: HTTP/1.1 or HTTP/2, by what was negotiated.
pub enum Sender {
    H1(http1::SendRequest<Full<Bytes>>),
    H2(http2::SendRequest<Full<Bytes>>),
}

/// One answer, read to its end.
#[derive(Debug)]
pub struct Answer {
    pub status: http::StatusCode,
    pub version: http::Version,
    pub headers: http::HeaderMap,
    pub body: Bytes,
}

impl Answer {
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
    pub fn replayed(&self) -> bool {
        self.headers
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true")
    }
}

/// Speaks HTTP over `tls` (HTTP/2 when ALPN chose `h2`).
pub async fn http(tls: TlsStream<TcpStream>) -> Result<Sender, hyper::Error> {
    let h2 = alpn(&tls).as_deref() == Some(b"h2".as_slice());
    let io = TokioIo::new(tls);
    if h2 {
        let (send, conn) = http2::handshake(TokioExecutor::new(), io).await?;
        tokio::spawn(conn);
        Ok(Sender::H2(send))
    } else {
        let (send, conn) = http1::handshake(io).await?;
        tokio::spawn(conn);
        Ok(Sender::H1(send))
    }
}

impl Sender {
    /// Sends `method path` with `headers` and `body`, reads the answer.
    pub async fn send(
        &mut self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &str,
    ) -> Result<Answer, Box<dyn std::error::Error + Send + Sync>> {
        let mut b = http::Request::builder().method(method);
        b = match self {
            Sender::H1(_) => b.uri(path).header("host", "localhost"),
            Sender::H2(_) => b.uri(format!("https://localhost{path}")),
        };
        for (n, v) in headers {
            b = b.header(*n, *v);
        }
        let req = b.body(Full::new(Bytes::from(body.to_owned())))?;
        let resp = match self {
            Sender::H1(s) => {
                s.ready().await?;
                s.send_request(req).await?
            }
            Sender::H2(s) => {
                s.ready().await?;
                s.send_request(req).await?
            }
        };
        let (parts, body) = resp.into_parts();
        let body = body.collect().await?.to_bytes();
        Ok(Answer {
            status: parts.status,
            version: parts.version,
            headers: parts.headers,
            body,
        })
    }

    /// A guarded `POST /orders` with `key` and `body`.
    pub async fn post(
        &mut self,
        key: &str,
        body: &str,
    ) -> Result<Answer, Box<dyn std::error::Error + Send + Sync>> {
        self.send(
            "POST",
            "/orders",
            &[
                ("idempotency-key", key),
                ("content-type", "application/json"),
            ],
            body,
        )
        .await
    }
}

/// Connects, speaks HTTP and sends one request: the whole client path.
pub async fn request_once(
    addr: SocketAddr,
    config: Arc<rustls::ClientConfig>,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Result<Answer, Box<dyn std::error::Error + Send + Sync>> {
    let tls = connect(addr, config).await?;
    let mut s = http(tls).await?;
    s.send(method, path, headers, body).await
}

/// Replaces the certificate and key files at once (each written to a
/// temporary file and renamed over the old one, as cert-manager and
/// certbot do).
pub fn replace_pair(cert: &std::path::Path, key: &std::path::Path, cert_pem: &str, key_pem: &str) {
    for (path, pem) in [(cert, cert_pem), (key, key_pem)] {
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, pem).unwrap();
        std::fs::rename(&tmp, path).unwrap();
    }
}
