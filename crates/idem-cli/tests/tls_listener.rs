//! The `idem gateway` process with `--tls-cert/--tls-key`: SIGHUP reloads
//! the certificate (and does not end the process), reloads are counted in
//! `/metrics`, and bad TLS settings are refused at start with exit 2.

mod support;

use std::path::Path;
use std::process::{Child, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use idem_testkit::pki::{TestCa, Usage};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use support::*;

/// SIGKILLed on drop.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn hup(child: &Child) {
    let ok = std::process::Command::new("kill")
        .args(["-HUP", &child.id().to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok, "kill -HUP failed");
}

/// `idem_tls_cert_reloads_total{result="ok"}` and `{result="error"}`.
async fn reloads(c: &reqwest::Client, admin: std::net::SocketAddr) -> Option<(u64, u64)> {
    let text = c
        .get(format!("http://{admin}/metrics"))
        .send()
        .await
        .ok()?
        .text()
        .await
        .ok()?;
    let find = |result: &str| {
        let prefix = format!("idem_tls_cert_reloads_total{{result=\"{result}\"}}");
        text.lines()
            .find(|l| l.starts_with(&prefix))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
    };
    Some((find("ok")?, find("error")?))
}

async fn until(
    c: &reqwest::Client,
    admin: std::net::SocketAddr,
    log: &Path,
    what: &str,
    cond: impl Fn((u64, u64)) -> bool,
) -> (u64, u64) {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        if let Some(m) = reloads(c, admin).await {
            if cond(m) {
                return m;
            }
        }
        assert!(
            Instant::now() < deadline,
            "{what}: not reached:\n{}",
            std::fs::read_to_string(log).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The leaf certificate a new handshake with `addr` shows.
async fn served_leaf(addr: std::net::SocketAddr, ca: &TestCa) -> Vec<u8> {
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(ca.cert_pem.as_bytes()) {
        roots.add(c.unwrap()).unwrap();
    }
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let tls = tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(ServerName::try_from("localhost").unwrap(), tcp)
        .await
        .unwrap();
    tls.get_ref().1.peer_certificates().unwrap()[0].to_vec()
}

fn replace(path: &Path, text: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

#[tokio::test]
async fn sighup_reloads_the_certificate_and_the_process_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let up = Upstream::start().await;
    let ca = TestCa::new("cli test CA");
    let first = ca.issue(&["localhost"], Usage::Server);
    let (cert, key) = first.write(dir.path(), "server");
    let (addr, admin) = (free_addr(), free_addr());
    let log = dir.path().join("gw.log");
    let child = idem()
        .args(["gateway", "--listen", &addr.to_string()])
        .args(["--admin-listen", &admin.to_string()])
        .args(["--upstream", &up.url, "--store", "memory://"])
        .arg("--tls-cert")
        .arg(&cert)
        .arg("--tls-key")
        .arg(&key)
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .expect("spawn idem gateway");
    let mut gw = Proc(child);
    let c = reqwest::Client::new();
    // Up: the counters show (registered with the SIGHUP handler).
    assert_eq!(until(&c, admin, &log, "start", |_| true).await, (0, 0));
    assert_eq!(served_leaf(addr, &ca).await, first.cert_der);

    // Files unchanged: only the signal can cause this reload.
    hup(&gw.0);
    until(&c, admin, &log, "SIGHUP reload", |(ok, _)| ok == 1).await;
    assert!(
        gw.0.try_wait().unwrap().is_none(),
        "SIGHUP ended the process"
    );
    let logs = std::fs::read_to_string(&log).unwrap();
    assert!(
        logs.contains("TLS certificate reloaded") && logs.contains("SIGHUP"),
        "{logs}"
    );

    // A new pair, then SIGHUP: new handshakes see it.
    let next = ca.issue(&["localhost"], Usage::Server);
    replace(&cert, &next.cert_pem);
    replace(&key, &next.key_pem);
    hup(&gw.0);
    until(&c, admin, &log, "new pair", |(ok, _)| ok >= 2).await;
    assert_eq!(served_leaf(addr, &ca).await, next.cert_der);

    // A broken key and SIGHUP: refused, the certificate in force stays.
    replace(&key, "not a key");
    hup(&gw.0);
    until(&c, admin, &log, "refused reload", |(_, err)| err >= 1).await;
    assert_eq!(served_leaf(addr, &ca).await, next.cert_der);
    assert!(gw.0.try_wait().unwrap().is_none());
    let logs = std::fs::read_to_string(&log).unwrap();
    assert!(logs.contains("TLS certificate reload failed"), "{logs}");
}

#[test]
fn bad_tls_settings_exit_2_naming_the_flag() {
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new("ca");
    let (cert, key) = ca
        .issue(&["localhost"], Usage::Server)
        .write(dir.path(), "s");
    let ca_file = ca.write(dir.path(), "ca.crt");
    let missing = dir.path().join("missing.crt");
    let p = |p: &Path| p.to_str().unwrap().to_owned();
    let cases: Vec<(Vec<String>, &[&str])> = vec![
        (
            vec![
                "--tls-cert".into(),
                p(&missing),
                "--tls-key".into(),
                p(&key),
            ],
            &["--tls-cert", "missing.crt"],
        ),
        (
            vec!["--tls-cert".into(), p(&cert), "--tls-key".into(), p(&cert)],
            &["--tls-key"],
        ),
        (
            vec![
                "--tls-cert".into(),
                p(&cert),
                "--tls-key".into(),
                p(&key),
                "--scope-from".into(),
                "client-cert".into(),
            ],
            &["--scope-from", "--tls-client-ca"],
        ),
        (
            vec![
                "--tls-cert".into(),
                p(&cert),
                "--tls-key".into(),
                p(&key),
                "--tls-client-ca".into(),
                p(&ca_file),
                "--scope-from".into(),
                "client-cert".into(),
                "--scope-header".into(),
                "x-api-key".into(),
            ],
            &["--scope-from", "--scope-header"],
        ),
    ];
    for (args, words) in cases {
        let out = idem()
            .args(["gateway", "--listen", "127.0.0.1:0"])
            .args(["--upstream", "http://127.0.0.1:9", "--store", "memory://"])
            .args(&args)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        for w in words {
            assert!(stderr.contains(w), "{args:?}: {w} not in {stderr}");
        }
    }
}
