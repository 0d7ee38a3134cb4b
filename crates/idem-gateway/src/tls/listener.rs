//! The TLS listener: a rustls acceptor whose certificate is reloaded when
//! its files change or on SIGHUP (a failed reload keeps the old one and
//! logs why), ALPN `h2` and `http/1.1`, and optional client-certificate
//! verification (`--tls-client-ca`).
//!
//! The certificate in force sits behind an [`ArcSwap`] that the rustls
//! [`ResolvesServerCert`] reads at each handshake: a reload swaps it, new
//! handshakes see the new certificate, connections already open keep
//! theirs, and nothing is restarted.
//!
//! The watch polls both files' metadata every [`POLL_INTERVAL`] (1 s: size,
//! modification time, and on Unix the device, inode and change time, so a
//! rename over the file, as cert-manager's and certbot's symlink swaps do,
//! is seen). A change is loaded only once both files have stayed the same
//! for [`SETTLE`] (250 ms; at most [`SETTLE_TRIES`] looks), so a pair caught
//! half-written is not loaded; a pair still changing is left for the next
//! poll. SIGHUP reloads at once. A reload that fails (a missing or
//! unreadable file, bad PEM, a key that does not match the certificate)
//! keeps the certificate in force and logs WARN with the reason, once per
//! change; a good one logs INFO. A pair is good when every certificate of
//! the chain parses as X.509, the leaf is within its validity period and the
//! key belongs to it. Metrics: [`CERT_RELOADS`]
//! `idem_tls_cert_reloads_total{result="ok"|"error"}`, [`CERT_NOT_AFTER`]
//! `idem_tls_cert_not_after_seconds`.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use arc_swap::ArcSwap;
use rustls::crypto::CryptoProvider;
use rustls::server::{ClientHello, ResolvesServerCert, WebPkiClientVerifier};
use rustls::sign::CertifiedKey;
use rustls::{RootCertStore, ServerConfig};
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;

use super::{load_certs, load_key, ListenerTls, TlsError};

/// Counter of certificate reloads by result, label `result` = `ok` | `error`.
pub(crate) const CERT_RELOADS: &str = "idem_tls_cert_reloads_total";
/// Gauge: when the listener's certificate in force expires (its `notAfter`,
/// Unix seconds), for an alert well before it does.
pub(crate) const CERT_NOT_AFTER: &str = "idem_tls_cert_not_after_seconds";
/// How often the certificate and key files are looked at: every 1 s.
pub(crate) const POLL_INTERVAL: Duration = Duration::from_secs(1);
/// How long both files must stay the same before a change is loaded.
pub(crate) const SETTLE: Duration = Duration::from_millis(250);
/// How many looks, [`SETTLE`] apart, a change gets before the poll gives up
/// until its next round: 8 (2 s).
pub(crate) const SETTLE_TRIES: u32 = 8;
/// The ALPN protocols offered, in the server's order of preference.
pub(crate) const ALPN: [&[u8]; 2] = [b"h2", b"http/1.1"];

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The certificate chain and key of `tls`, checked to match.
///
/// # Errors
/// [`TlsError`] naming `--tls-cert` or `--tls-key` and the file: unreadable,
/// no PEM block of the kind, a key rustls cannot use, or a key that is not
/// the certificate's.
pub(crate) fn load_pair(tls: &ListenerTls) -> Result<CertifiedKey, TlsError> {
    let certs = load_certs("--tls-cert", &tls.cert)?;
    let not_after = check_chain(&tls.cert, &certs)?;
    let key = load_key("--tls-key", &tls.key)?;
    let pair =
        CertifiedKey::from_der(certs, key, &provider()).map_err(|source| TlsError::Rustls {
            flag: "--tls-key (does it belong to --tls-cert?)",
            source,
        })?;
    metrics::gauge!(CERT_NOT_AFTER).set(not_after as f64);
    Ok(pair)
}

/// Every certificate of the chain is X.509 (RFC 5280) that parses, and the
/// leaf is within its validity period now: a chain clients would refuse is
/// never put in force. Returns the leaf's `notAfter` (Unix seconds).
fn check_chain(
    path: &Path,
    certs: &[rustls::pki_types::CertificateDer<'_>],
) -> Result<i64, TlsError> {
    let bad = |what: String| TlsError::Pem {
        flag: "--tls-cert",
        path: path.to_owned(),
        what,
    };
    let mut not_after = 0;
    for (i, der) in certs.iter().enumerate() {
        let (_, cert) = x509_parser::parse_x509_certificate(der).map_err(|e| {
            bad(format!(
                "certificate {} of the chain is not X.509: {e}",
                i + 1
            ))
        })?;
        if i == 0 {
            let validity = cert.validity();
            let now = x509_parser::time::ASN1Time::now();
            if now < validity.not_before {
                return Err(bad(format!(
                    "the certificate is not valid before {}",
                    validity.not_before
                )));
            }
            if now > validity.not_after {
                return Err(bad(format!(
                    "the certificate expired at {}",
                    validity.not_after
                )));
            }
            not_after = validity.not_after.timestamp();
        }
    }
    Ok(not_after)
}

/// The certificate in force, swapped by a reload.
#[derive(Debug)]
pub(crate) struct CertSlot {
    current: ArcSwap<CertifiedKey>,
}

impl ResolvesServerCert for CertSlot {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current.load_full())
    }
}

/// TLS on the gateway's listener: the acceptor and what reloads its
/// certificate.
#[derive(Clone)]
pub(crate) struct TlsListener {
    acceptor: TlsAcceptor,
    slot: Arc<CertSlot>,
    tls: ListenerTls,
}

impl std::fmt::Debug for TlsListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsListener")
            .field("tls", &self.tls)
            .finish_non_exhaustive()
    }
}

impl TlsListener {
    /// Loads the certificate, its key and the client CAs of `tls`.
    ///
    /// # Errors
    /// [`TlsError`] naming the flag and the file: what [`load_pair`]
    /// refuses, a `--tls-client-ca` without a usable CA certificate.
    pub(crate) fn new(tls: &ListenerTls) -> Result<Self, TlsError> {
        let slot = Arc::new(CertSlot {
            current: ArcSwap::from_pointee(load_pair(tls)?),
        });
        let builder = ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|source| TlsError::Rustls {
                flag: "--tls-cert",
                source,
            })?;
        let builder = match &tls.client_ca {
            None => builder.with_no_client_auth(),
            Some(path) => builder.with_client_cert_verifier(client_verifier(path)?),
        };
        let mut config = builder.with_cert_resolver(slot.clone());
        config.alpn_protocols = ALPN.iter().map(|p| p.to_vec()).collect();
        Ok(Self {
            acceptor: TlsAcceptor::from(Arc::new(config)),
            slot,
            tls: tls.clone(),
        })
    }

    /// The acceptor (cheap to clone; every handshake reads the certificate
    /// in force).
    pub(crate) fn acceptor(&self) -> &TlsAcceptor {
        &self.acceptor
    }

    /// Loads the files again; on success the new certificate serves every
    /// later handshake. Logged and counted; a failure keeps the old one.
    pub(crate) fn reload(&self, trigger: &str) -> bool {
        match load_pair(&self.tls) {
            Ok(pair) => {
                let chain = pair.cert.len();
                self.slot.current.store(Arc::new(pair));
                tracing::info!(
                    target: "idem",
                    cert = %self.tls.cert.display(),
                    trigger,
                    chain,
                    "TLS certificate reloaded; new handshakes use it"
                );
                metrics::counter!(CERT_RELOADS, "result" => "ok").increment(1);
                true
            }
            Err(e) => {
                tracing::warn!(
                    target: "idem",
                    cert = %self.tls.cert.display(),
                    key = %self.tls.key.display(),
                    trigger,
                    error = %e,
                    "TLS certificate reload failed; the certificate in force stays"
                );
                metrics::counter!(CERT_RELOADS, "result" => "error").increment(1);
                false
            }
        }
    }

    /// The leaf certificate in force (DER), for tests and logs.
    #[cfg(test)]
    fn leaf(&self) -> Vec<u8> {
        self.slot.current.load().cert[0].to_vec()
    }

    /// Reloads on SIGHUP (`hup`: a SIGHUP stream registered before the
    /// gateway serves, so a signal sent once it answers is not lost) and
    /// when the files change, until `stop` is cancelled.
    pub(crate) async fn watch(self, mut hup: Option<Hangup>, stop: CancellationToken) {
        let files = [self.tls.cert.clone(), self.tls.key.clone()];
        let mut last = look(&files).await;
        let mut tick = tokio::time::interval(POLL_INTERVAL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let hangup = async {
                match hup.as_mut() {
                    Some(h) => h.recv().await,
                    None => std::future::pending::<()>().await,
                }
            };
            let trigger = tokio::select! {
                () = stop.cancelled() => return,
                () = hangup => "SIGHUP",
                _ = tick.tick() => {
                    let now = look(&files).await;
                    if now == last {
                        continue;
                    }
                    match settle(&files, now, &stop).await {
                        Some(settled) => last = settled,
                        None if stop.is_cancelled() => return,
                        None => continue,
                    }
                    "files changed"
                }
            };
            if trigger == "SIGHUP" {
                last = look(&files).await;
            }
            let this = self.clone();
            // Reading and parsing the files is blocking I/O.
            let _ = tokio::task::spawn_blocking(move || this.reload(trigger)).await;
        }
    }
}

/// Registers the reload counter at 0 for both results.
pub(crate) fn register_metrics() {
    metrics::describe_counter!(
        CERT_RELOADS,
        "Reloads of the TLS listener's certificate and key (SIGHUP or a change of the files), by result: ok (new handshakes use it) or error (the certificate in force stays)."
    );
    for result in ["ok", "error"] {
        metrics::counter!(CERT_RELOADS, "result" => result).increment(0);
    }
    metrics::describe_gauge!(
        CERT_NOT_AFTER,
        metrics::Unit::Seconds,
        "When the TLS listener's certificate in force expires (its notAfter, Unix seconds)."
    );
}

/// A SIGHUP stream (Unix), registered when made.
#[derive(Debug)]
pub(crate) struct Hangup {
    #[cfg(unix)]
    signal: tokio::signal::unix::Signal,
}

impl Hangup {
    /// Registers for SIGHUP (once registered, SIGHUP no longer ends the
    /// process). `None` (WARN) when it cannot, or off Unix.
    pub(crate) fn register() -> Option<Self> {
        #[cfg(unix)]
        {
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) {
                Ok(signal) => Some(Self { signal }),
                Err(e) => {
                    tracing::warn!(error = %e, "cannot listen for SIGHUP; the TLS certificate is still reloaded when its files change");
                    None
                }
            }
        }
        #[cfg(not(unix))]
        None
    }

    async fn recv(&mut self) {
        #[cfg(unix)]
        {
            if self.signal.recv().await.is_none() {
                std::future::pending::<()>().await;
            }
        }
        #[cfg(not(unix))]
        std::future::pending::<()>().await;
    }
}

/// The client-certificate verifier of `--tls-client-ca`: a certificate
/// chaining to one of the CAs in the file is required (RFC 5280 path
/// validation by webpki: validity period, key usage clientAuth).
fn client_verifier(
    path: &Path,
) -> Result<Arc<dyn rustls::server::danger::ClientCertVerifier>, TlsError> {
    let mut roots = RootCertStore::empty();
    for ca in load_certs("--tls-client-ca", path)? {
        roots.add(ca).map_err(|source| TlsError::Rustls {
            flag: "--tls-client-ca",
            source,
        })?;
    }
    WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider())
        .build()
        .map_err(|e| TlsError::Pem {
            flag: "--tls-client-ca",
            path: path.to_owned(),
            what: format!("not usable as client CAs: {e}"),
        })
}

/// What a file looked like: its metadata and content (certificate files
/// are small; at most [`super::MAX_PEM`] bytes are read), or why it cannot be read.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Stamp {
    len: u64,
    modified: Option<SystemTime>,
    #[cfg(unix)]
    id: (u64, u64, i64, i64),
    content: Vec<u8>,
}

fn stamp(path: &Path) -> Result<Stamp, String> {
    #[cfg(unix)]
    use std::os::unix::fs::MetadataExt as _;
    let (m, content) = super::read_pem_file(path).map_err(|e| e.to_string())?;
    Ok(Stamp {
        len: m.len(),
        modified: m.modified().ok(),
        #[cfg(unix)]
        id: (m.dev(), m.ino(), m.ctime(), m.ctime_nsec()),
        content,
    })
}

type Look = Vec<Result<Stamp, String>>;

/// Both files looked at, on a blocking thread.
async fn look(files: &[PathBuf; 2]) -> Look {
    let files = files.clone();
    tokio::task::spawn_blocking(move || files.iter().map(|f| stamp(f)).collect())
        .await
        .unwrap_or_default()
}

/// Looks again every [`SETTLE`] until two looks agree, at most
/// [`SETTLE_TRIES`] times. `None`: still changing, or `stop` cancelled.
async fn settle(files: &[PathBuf; 2], mut seen: Look, stop: &CancellationToken) -> Option<Look> {
    for _ in 0..SETTLE_TRIES {
        tokio::select! {
            () = stop.cancelled() => return None,
            () = tokio::time::sleep(SETTLE) => {}
        }
        let again = look(files).await;
        if again == seen {
            return Some(again);
        }
        seen = again;
    }
    tracing::debug!(target: "idem", "the TLS certificate files are still changing; looked at again at the next poll");
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use idem_testkit::pki::{TestCa, Usage};

    fn pair(dir: &Path) -> (TestCa, ListenerTls) {
        let ca = TestCa::new("test CA");
        let (cert, key) = ca.issue(&["localhost"], Usage::Server).write(dir, "server");
        (
            ca,
            ListenerTls {
                cert,
                key,
                client_ca: None,
            },
        )
    }

    #[test]
    fn bad_files_are_refused_naming_the_flag() {
        let dir = tempfile::tempdir().unwrap();
        let (ca, tls) = pair(dir.path());
        assert!(TlsListener::new(&tls).is_ok());
        let missing = ListenerTls {
            cert: dir.path().join("nope.crt"),
            ..tls.clone()
        };
        let e = TlsListener::new(&missing).unwrap_err().to_string();
        assert!(e.contains("--tls-cert") && e.contains("nope.crt"), "{e}");
        // A key that is not the certificate's.
        let (_, other_key) = ca
            .issue(&["localhost"], Usage::Server)
            .write(dir.path(), "other");
        let wrong = ListenerTls {
            key: other_key,
            ..tls.clone()
        };
        let e = TlsListener::new(&wrong).unwrap_err().to_string();
        assert!(e.contains("--tls-key"), "{e}");
        // A key file holding a certificate.
        let swapped = ListenerTls {
            key: tls.cert.clone(),
            ..tls.clone()
        };
        let e = TlsListener::new(&swapped).unwrap_err().to_string();
        assert!(e.contains("--tls-key") && e.contains("PRIVATE KEY"), "{e}");
        // A client CA file without a certificate.
        let no_ca = ListenerTls {
            client_ca: Some(tls.key.clone()),
            ..tls
        };
        let e = TlsListener::new(&no_ca).unwrap_err().to_string();
        assert!(e.contains("--tls-client-ca"), "{e}");
    }

    #[test]
    fn a_failed_reload_keeps_the_certificate_and_a_good_one_replaces_it() {
        let dir = tempfile::tempdir().unwrap();
        let (ca, tls) = pair(dir.path());
        let listener = TlsListener::new(&tls).unwrap();
        let first = listener.leaf();
        std::fs::write(&tls.cert, "not PEM").unwrap();
        assert!(!listener.reload("test"));
        assert_eq!(listener.leaf(), first);
        let next = ca.issue(&["localhost"], Usage::Server);
        next.write(dir.path(), "server");
        assert!(listener.reload("test"));
        assert_eq!(listener.leaf(), next.cert_der);
        assert_ne!(listener.leaf(), first);
    }

    #[tokio::test]
    async fn the_watch_picks_up_a_changed_pair() {
        let dir = tempfile::tempdir().unwrap();
        let (ca, tls) = pair(dir.path());
        let listener = TlsListener::new(&tls).unwrap();
        let stop = CancellationToken::new();
        let task = tokio::spawn(listener.clone().watch(None, stop.clone()));
        tokio::time::sleep(Duration::from_millis(100)).await;
        let next = ca.issue(&["localhost"], Usage::Server);
        next.write(dir.path(), "server");
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while listener.leaf() != next.cert_der {
            assert!(tokio::time::Instant::now() < deadline, "not reloaded");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        stop.cancel();
        task.await.unwrap();
    }

    #[tokio::test]
    async fn settling_waits_for_a_stable_pair() {
        let dir = tempfile::tempdir().unwrap();
        let (_, tls) = pair(dir.path());
        let files = [tls.cert.clone(), tls.key.clone()];
        let stop = CancellationToken::new();
        let now = look(&files).await;
        assert_eq!(settle(&files, now.clone(), &stop).await, Some(now));
        let writer = {
            let p = tls.cert.clone();
            std::thread::spawn(move || {
                use std::io::Write as _;
                let mut f = std::fs::OpenOptions::new().append(true).open(&p).unwrap();
                for i in 0..30 {
                    writeln!(f, "# {i}").unwrap();
                    std::thread::sleep(Duration::from_millis(100));
                }
            })
        };
        let moving = look(&files).await;
        assert!(settle(&files, moving, &stop).await.is_none());
        writer.join().unwrap();
    }
}
