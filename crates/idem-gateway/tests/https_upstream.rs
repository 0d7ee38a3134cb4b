//! `https://` upstreams and HTTP/2 to the upstream, with real TLS
//! handshakes on loopback: a hyper server over tokio-rustls with
//! certificates from a test CA (`idem_testkit::pki`), the gateway in
//! process in front of it.

mod common;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use common::{post, RawAction};
use http::{Request, Response, Version};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::{TokioExecutor, TokioIo};
use idem_core::{DynStore, MemoryStore};
use idem_gateway::{ConfigError, Gateway, GatewayConfig, GatewayError};
use idem_testkit::pki::{Issued, TestCa, Usage};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

/// What the upstream saw: one entry per request that reached it.
#[derive(Clone, Default)]
struct Seen {
    hits: Arc<AtomicUsize>,
    versions: Arc<Mutex<Vec<Version>>>,
    hosts: Arc<Mutex<Vec<String>>>,
}

impl Seen {
    fn hits(&self) -> usize {
        self.hits.load(Ordering::SeqCst)
    }
    fn versions(&self) -> Vec<Version> {
        self.versions.lock().unwrap().clone()
    }
}

/// An upstream over TLS (or plain TCP when `tls` is `None`) serving
/// HTTP/1.1 and HTTP/2 (ALPN `h2`, `http/1.1`; h2c prior knowledge on
/// plain TCP). Every request is counted and answered `201` with
/// `execution N over HTTP/x` once its body is read.
struct Upstream {
    addr: SocketAddr,
    seen: Seen,
    task: JoinHandle<()>,
}

impl Drop for Upstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// A server configuration with `cert`, requiring a client certificate
/// signed by `client_ca` when given.
fn server_tls(cert: &Issued, client_ca: Option<&TestCa>) -> rustls::ServerConfig {
    let chain = vec![CertificateDer::from_pem_slice(cert.cert_pem.as_bytes()).unwrap()];
    let key = PrivateKeyDer::from_pem_slice(cert.key_pem.as_bytes()).unwrap();
    let builder = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .unwrap();
    let builder = match client_ca {
        Some(ca) => {
            let mut roots = rustls::RootCertStore::empty();
            roots
                .add(CertificateDer::from_pem_slice(ca.cert_pem.as_bytes()).unwrap())
                .unwrap();
            let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                roots.into(),
                provider(),
            )
            .build()
            .unwrap();
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    };
    let mut config = builder.with_single_cert(chain, key).unwrap();
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    config
}

async fn answer(
    seen: Seen,
    req: Request<hyper::body::Incoming>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let version = req.version();
    let host = req
        .headers()
        .get("host")
        .map(|h| h.to_str().unwrap_or("").to_owned())
        .or_else(|| req.uri().authority().map(|a| a.to_string()))
        .unwrap_or_default();
    let _ = req.into_body().collect().await;
    let n = seen.hits.fetch_add(1, Ordering::SeqCst) + 1;
    seen.versions.lock().unwrap().push(version);
    seen.hosts.lock().unwrap().push(host);
    Ok(Response::builder()
        .status(201)
        .header("content-type", "text/plain")
        .body(Full::new(Bytes::from(format!(
            "execution {n} over {version:?}"
        ))))
        .unwrap())
}

async fn start_upstream(tls: Option<rustls::ServerConfig>) -> Upstream {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen = Seen::default();
    let acceptor = tls.map(|c| tokio_rustls::TlsAcceptor::from(Arc::new(c)));
    let s = seen.clone();
    let task = tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                return;
            };
            let (s, acceptor) = (s.clone(), acceptor.clone());
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |req| answer(s.clone(), req));
                let builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
                match acceptor {
                    Some(acceptor) => {
                        // A refused handshake (wrong CA on the other side,
                        // no client certificate) ends here: nothing served.
                        let Ok(tls) = acceptor.accept(tcp).await else {
                            return;
                        };
                        let _ = builder.serve_connection(TokioIo::new(tls), service).await;
                    }
                    None => {
                        let _ = builder.serve_connection(TokioIo::new(tcp), service).await;
                    }
                }
            });
        }
    });
    Upstream { addr, seen, task }
}

/// A test PKI in a temporary folder: the server's CA and its file.
struct Pki {
    dir: tempfile::TempDir,
    ca: TestCa,
    ca_file: PathBuf,
}

fn pki() -> Pki {
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new("idem upstream test CA");
    let ca_file = ca.write(dir.path(), "ca.pem");
    Pki { dir, ca, ca_file }
}

fn https_config(up: &Upstream, host: &str, ca: Option<&PathBuf>) -> GatewayConfig {
    let mut c = common::config(&format!("https://{host}:{}", up.addr.port()));
    c.upstream_tls.ca = ca.cloned();
    c
}

async fn start(config: GatewayConfig, store: &DynStore) -> common::TestGateway {
    common::gateway_with(config, store.clone()).await
}

fn memory() -> DynStore {
    Arc::new(MemoryStore::new())
}

#[tokio::test]
async fn a_guarded_post_to_an_https_upstream_runs_once_and_replays() {
    let pki = pki();
    let cert = pki.ca.issue(&["localhost"], Usage::Server);
    let up = start_upstream(Some(server_tls(&cert, None))).await;
    let gw = start(
        https_config(&up, "localhost", Some(&pki.ca_file)),
        &memory(),
    )
    .await;
    let c = common::client();
    let k = common::key("https");
    let first = post(&c, &gw.url("/orders"), Some(&k), "{}").await;
    assert_eq!(first.status, 201, "{}", first.text());
    assert_eq!(first.text(), "execution 1 over HTTP/1.1");
    let again = post(&c, &gw.url("/orders"), Some(&k), "{}").await;
    assert!(again.replayed(), "{again:?}");
    assert_eq!(again.text(), "execution 1 over HTTP/1.1");
    assert_eq!(up.seen.hits(), 1);
    // The Host sent is the URL's authority, as for an http:// upstream.
    assert_eq!(
        up.seen.hosts.lock().unwrap()[0],
        format!("localhost:{}", up.addr.port())
    );
}

#[tokio::test]
async fn an_ip_address_host_is_checked_against_the_ip_sans() {
    let pki = pki();
    let cert = pki.ca.issue(&["127.0.0.1"], Usage::Server);
    let up = start_upstream(Some(server_tls(&cert, None))).await;
    let gw = start(
        https_config(&up, "127.0.0.1", Some(&pki.ca_file)),
        &memory(),
    )
    .await;
    let got = post(&common::client(), &gw.url("/x"), None, "{}").await;
    assert_eq!(got.status, 201, "{}", got.text());
    assert_eq!(up.seen.hits(), 1);
}

/// A request through a gateway whose TLS setup the upstream's certificate
/// fails: 502 `upstream-unreachable`, nothing reached the upstream, and the
/// key is free: the same key through a gateway set up right (same store)
/// runs.
async fn refused_then_runs(up: &Upstream, wrong: GatewayConfig, right: GatewayConfig) {
    let store = memory();
    let c = common::client();
    let k = common::key("refused");
    let bad = start(wrong, &store).await;
    let got = post(&c, &bad.url("/orders"), Some(&k), "{}").await;
    assert_eq!(got.status, 502, "{}", got.text());
    assert_eq!(
        got.problem_type(),
        "urn:idem:problem:upstream-unreachable",
        "{}",
        got.text()
    );
    assert_eq!(up.seen.hits(), 0, "nothing may reach the upstream");
    let good = start(right, &store).await;
    let got = post(&c, &good.url("/orders"), Some(&k), "{}").await;
    assert_eq!(got.status, 201, "the key was not released: {}", got.text());
    assert!(!got.replayed());
    assert_eq!(up.seen.hits(), 1);
}

#[tokio::test]
async fn a_certificate_from_another_ca_is_unreachable_and_releases_the_key() {
    let pki = pki();
    let cert = pki.ca.issue(&["localhost"], Usage::Server);
    let up = start_upstream(Some(server_tls(&cert, None))).await;
    let other = TestCa::new("someone else");
    let other_file = other.write(pki.dir.path(), "other.pem");
    refused_then_runs(
        &up,
        https_config(&up, "localhost", Some(&other_file)),
        https_config(&up, "localhost", Some(&pki.ca_file)),
    )
    .await;
}

#[tokio::test]
async fn a_name_mismatch_is_unreachable_and_releases_the_key() {
    let pki = pki();
    let cert = pki.ca.issue(&["service.test", "127.0.0.1"], Usage::Server);
    let up = start_upstream(Some(server_tls(&cert, None))).await;
    // `localhost` is not among the names: the right CA, the wrong host.
    refused_then_runs(
        &up,
        https_config(&up, "localhost", Some(&pki.ca_file)),
        https_config(&up, "127.0.0.1", Some(&pki.ca_file)),
    )
    .await;
}

#[tokio::test]
async fn the_system_roots_do_not_trust_a_private_ca() {
    let pki = pki();
    let cert = pki.ca.issue(&["localhost"], Usage::Server);
    let up = start_upstream(Some(server_tls(&cert, None))).await;
    // No --upstream-ca: the machine's roots, which do not know the test CA.
    refused_then_runs(
        &up,
        https_config(&up, "localhost", None),
        https_config(&up, "localhost", Some(&pki.ca_file)),
    )
    .await;
}

#[tokio::test]
async fn an_upstream_requiring_a_client_certificate_gets_it() {
    let pki = pki();
    let cert = pki.ca.issue(&["localhost"], Usage::Server);
    let clients = TestCa::new("idem client CA");
    let up = start_upstream(Some(server_tls(&cert, Some(&clients)))).await;
    let (client_cert, client_key) = clients
        .issue(&["gateway"], Usage::Client)
        .write(pki.dir.path(), "gateway");
    let mut with_cert = https_config(&up, "localhost", Some(&pki.ca_file));
    with_cert.upstream_tls.client_cert = Some(client_cert);
    with_cert.upstream_tls.client_key = Some(client_key);
    // Without the certificate the upstream refuses the handshake (with TLS
    // 1.3, by an alert after the request was written): still nothing
    // reached it, and the key is released.
    refused_then_runs(
        &up,
        https_config(&up, "localhost", Some(&pki.ca_file)),
        with_cert,
    )
    .await;
}

#[tokio::test]
async fn a_client_certificate_from_a_ca_the_upstream_does_not_trust_is_refused() {
    let pki = pki();
    let cert = pki.ca.issue(&["localhost"], Usage::Server);
    let clients = TestCa::new("idem client CA");
    let up = start_upstream(Some(server_tls(&cert, Some(&clients)))).await;
    let stranger = TestCa::new("stranger")
        .issue(&["gateway"], Usage::Client)
        .write(pki.dir.path(), "stranger");
    let good = clients
        .issue(&["gateway"], Usage::Client)
        .write(pki.dir.path(), "good");
    let mut wrong = https_config(&up, "localhost", Some(&pki.ca_file));
    (
        wrong.upstream_tls.client_cert,
        wrong.upstream_tls.client_key,
    ) = (Some(stranger.0), Some(stranger.1));
    let mut right = https_config(&up, "localhost", Some(&pki.ca_file));
    (
        right.upstream_tls.client_cert,
        right.upstream_tls.client_key,
    ) = (Some(good.0), Some(good.1));
    refused_then_runs(&up, wrong, right).await;
}

#[tokio::test]
async fn http2_over_tls_is_negotiated_by_alpn_only_with_the_flag() {
    let pki = pki();
    let cert = pki.ca.issue(&["localhost"], Usage::Server);
    // The upstream offers h2 and http/1.1.
    let up = start_upstream(Some(server_tls(&cert, None))).await;
    let c = common::client();
    let mut h2 = https_config(&up, "localhost", Some(&pki.ca_file));
    h2.upstream_http2 = true;
    let gw = start(h2, &memory()).await;
    let k = common::key("h2");
    let got = post(&c, &gw.url("/orders"), Some(&k), "{}").await;
    assert_eq!(got.status, 201, "{}", got.text());
    assert_eq!(got.text(), "execution 1 over HTTP/2.0");
    assert!(post(&c, &gw.url("/orders"), Some(&k), "{}")
        .await
        .replayed());
    let plain = start(
        https_config(&up, "localhost", Some(&pki.ca_file)),
        &memory(),
    )
    .await;
    let got = post(&c, &plain.url("/orders"), None, "{}").await;
    assert_eq!(got.status, 201, "{}", got.text());
    assert_eq!(up.seen.versions(), [Version::HTTP_2, Version::HTTP_11]);
}

#[tokio::test]
async fn an_upstream_that_does_not_select_h2_is_unreachable_with_the_flag() {
    let pki = pki();
    let cert = pki.ca.issue(&["localhost"], Usage::Server);
    let mut tls = server_tls(&cert, None);
    tls.alpn_protocols = vec![b"http/1.1".to_vec()];
    let up = start_upstream(Some(tls)).await;
    let mut h2 = https_config(&up, "localhost", Some(&pki.ca_file));
    h2.upstream_http2 = true;
    let mut h1 = https_config(&up, "localhost", Some(&pki.ca_file));
    h1.upstream_http2 = false;
    refused_then_runs(&up, h2, h1).await;
}

#[tokio::test]
async fn h2c_prior_knowledge_to_an_http_upstream() {
    let up = start_upstream(None).await;
    let mut c = common::config(&format!("http://127.0.0.1:{}", up.addr.port()));
    c.upstream_http2 = true;
    let gw = start(c, &memory()).await;
    let client = common::client();
    let k = common::key("h2c");
    let got = post(&client, &gw.url("/orders"), Some(&k), "{}").await;
    assert_eq!(got.status, 201, "{}", got.text());
    assert_eq!(got.text(), "execution 1 over HTTP/2.0");
    assert!(post(&client, &gw.url("/orders"), Some(&k), "{}")
        .await
        .replayed());
    // Several requests share the one HTTP/2 connection.
    for _ in 0..3 {
        assert_eq!(post(&client, &gw.url("/x"), None, "{}").await.status, 201);
    }
    assert_eq!(up.seen.versions(), [Version::HTTP_2; 4]);
}

/// What `Gateway::bind_with_store` says of `config`.
async fn refused(config: GatewayConfig) -> String {
    match Gateway::bind_with_store(config, memory()).await {
        Err(GatewayError::Config(e)) => {
            assert!(
                matches!(
                    e,
                    ConfigError::UpstreamTls(_) | ConfigError::UpstreamTlsSettings(_)
                ),
                "{e:?}"
            );
            e.to_string()
        }
        Err(e) => panic!("not a configuration error: {e:?}"),
        Ok(_) => panic!("accepted"),
    }
}

#[tokio::test]
async fn unusable_tls_files_are_refused_at_start_naming_the_flag_and_file() {
    let pki = pki();
    let dir = pki.dir.path();
    let garbage = dir.join("garbage.pem");
    std::fs::write(&garbage, "this is not PEM\n").unwrap();
    let missing = dir.join("missing.pem");
    let url = "https://localhost:1";
    let with = |f: &dyn Fn(&mut GatewayConfig)| {
        let mut c = common::config(url);
        f(&mut c);
        c
    };

    let e = refused(with(&|c| c.upstream_tls.ca = Some(missing.clone()))).await;
    assert!(
        e.contains("--upstream-ca") && e.contains("missing.pem"),
        "{e}"
    );
    let e = refused(with(&|c| c.upstream_tls.ca = Some(garbage.clone()))).await;
    assert!(
        e.contains("--upstream-ca") && e.contains("garbage.pem"),
        "{e}"
    );

    let (cert, key) = pki
        .ca
        .issue(&["gateway"], Usage::Client)
        .write(dir, "client");
    let (_, other_key) = pki.ca.issue(&["other"], Usage::Client).write(dir, "other");
    let e = refused(with(&|c| {
        c.upstream_tls.client_cert = Some(garbage.clone());
        c.upstream_tls.client_key = Some(key.clone());
    }))
    .await;
    assert!(
        e.contains("--upstream-client-cert") && e.contains("garbage.pem"),
        "{e}"
    );
    let e = refused(with(&|c| {
        c.upstream_tls.client_cert = Some(cert.clone());
        c.upstream_tls.client_key = Some(garbage.clone());
    }))
    .await;
    assert!(
        e.contains("--upstream-client-key") && e.contains("garbage.pem"),
        "{e}"
    );
    let e = refused(with(&|c| {
        c.upstream_tls.client_cert = Some(cert.clone());
        c.upstream_tls.client_key = Some(missing.clone());
    }))
    .await;
    assert!(
        e.contains("--upstream-client-key") && e.contains("missing.pem"),
        "{e}"
    );
    let e = refused(with(&|c| {
        c.upstream_tls.client_cert = Some(cert.clone());
        c.upstream_tls.client_key = Some(other_key.clone());
    }))
    .await;
    assert!(
        e.contains("--upstream-client-cert/--upstream-client-key"),
        "{e}"
    );
    assert!(e.to_lowercase().contains("key"), "{e}");
    let e = refused(with(&|c| c.upstream_tls.client_cert = Some(cert.clone()))).await;
    assert!(e.contains("--upstream-client-key"), "{e}");
}

#[tokio::test]
async fn tls_settings_for_an_http_upstream_are_refused() {
    let pki = pki();
    let mut c = common::config("http://127.0.0.1:1");
    c.upstream_tls.ca = Some(pki.ca_file.clone());
    let e = refused(c).await;
    assert!(e.contains("--upstream-ca") && e.contains("https://"), "{e}");
}

/// hyper's client reads a `103 Early Hints` and waits for the final
/// response; hyper's server cannot send an interim response (no API in
/// hyper 1.x), so the 103 is not passed on, and the client gets the final
/// response intact.
#[tokio::test]
async fn an_early_hints_103_gives_the_client_the_final_response_intact() {
    let answer = b"HTTP/1.1 103 Early Hints\r\n\
        Link: </style.css>; rel=preload; as=style\r\n\r\n\
        HTTP/1.1 200 OK\r\n\
        Content-Type: text/plain\r\n\
        X-Final: yes\r\n\
        Content-Length: 5\r\n\r\n\
        final"
        .to_vec();
    let (raw, gw) = common::raw_rig(RawAction::WriteAndClose(answer.clone()), |_| {}).await;
    let c = common::client();
    let got = common::fetch(&c, &gw.url("/page")).await;
    assert_eq!(got.status, 200, "{}", got.text());
    assert_eq!(got.text(), "final");
    assert_eq!(got.header("x-final").as_deref(), Some("yes"));
    assert_eq!(
        got.header("link"),
        None,
        "the 103's fields are not merged in"
    );
    // A guarded request: the final answer is the one stored and replayed.
    let k = common::key("103");
    let first = post(&c, &gw.url("/orders"), Some(&k), "{}").await;
    assert_eq!((first.status, first.text().as_str()), (200, "final"));
    let again = post(&c, &gw.url("/orders"), Some(&k), "{}").await;
    assert!(again.replayed());
    assert_eq!(again.text(), "final");
    assert_eq!(raw.hits(), 2);
}
