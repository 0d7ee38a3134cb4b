//! The TLS listener with real handshakes on loopback: HTTP/1.1 and h2 by
//! ALPN, guarded requests over TLS, mTLS (no, expired, foreign and good
//! client certificates), scope by client certificate, a handshake that
//! never finishes, and certificate rotation without a restart.

mod common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use common::tls::*;
use common::{config, key};
use idem_core::MemoryStore;
use idem_gateway::tls::ListenerTls;
use idem_gateway::{Gateway, GatewayError, ScopeFrom};
use idem_http::ScopeBy;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const H1: &[&[u8]] = &[b"http/1.1"];
const H2: &[&[u8]] = &[b"h2"];
const BOTH: &[&[u8]] = &[b"h2", b"http/1.1"];

/// Bounds every wait of these tests.
const BOUND: Duration = Duration::from_secs(20);

#[tokio::test]
async fn http1_and_h2_over_tls_run_once_and_replay() {
    let rig = tls_gateway(false, |_| {}).await;
    let k = key("tls-h1-h2");

    let tls = connect(rig.addr(), rig.client(H1, None)).await.unwrap();
    assert_eq!(alpn(&tls).as_deref(), Some(b"http/1.1".as_slice()));
    let mut h1 = http(tls).await.unwrap();
    let first = h1.post(&k, r#"{"a":1}"#).await.unwrap();
    assert_eq!(first.status, 201, "{}", first.text());
    assert_eq!(first.version, http::Version::HTTP_11);
    assert!(!first.replayed());

    let tls = connect(rig.addr(), rig.client(H2, None)).await.unwrap();
    assert_eq!(alpn(&tls).as_deref(), Some(b"h2".as_slice()));
    let mut h2 = http(tls).await.unwrap();
    let again = h2.post(&k, r#"{"a":1}"#).await.unwrap();
    assert_eq!(again.version, http::Version::HTTP_2);
    assert_eq!(again.status, 201);
    assert!(again.replayed(), "{:?}", again.headers);
    assert_eq!(again.body, first.body);
    assert_eq!(rig.up.hits(), 1, "executed once over TLS");
    // The upstream is told the client's scheme.
    let seen = rig.up.last_seen();
    assert_eq!(seen.headers["x-forwarded-proto"], "https");
    assert!(
        seen.headers["forwarded"]
            .to_str()
            .unwrap()
            .ends_with(";proto=https"),
        "{:?}",
        seen.headers["forwarded"]
    );

    // Both offered: the server prefers h2.
    let tls = connect(rig.addr(), rig.client(BOTH, None)).await.unwrap();
    assert_eq!(alpn(&tls).as_deref(), Some(b"h2".as_slice()));
    // No ALPN at all: HTTP/1.1.
    let plain = request_once(rig.addr(), rig.client(&[], None), "GET", "/items", &[], "")
        .await
        .unwrap();
    assert_eq!(
        (plain.status.as_u16(), plain.version),
        (200, http::Version::HTTP_11)
    );
}

#[tokio::test]
async fn a_client_that_does_not_trust_the_server_fails_and_plain_http_is_not_served() {
    let rig = tls_gateway(false, |_| {}).await;
    let stranger = TestCa::new("someone else");
    let e = connect(rig.addr(), client_config(&stranger, H1, None))
        .await
        .expect_err("an untrusted server certificate");
    assert!(e.to_string().contains("certificate"), "{e}");
    // Plain HTTP on the TLS port gets no HTTP answer.
    let mut tcp = tokio::net::TcpStream::connect(rig.addr()).await.unwrap();
    tcp.write_all(b"GET /items HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    let mut buf = Vec::new();
    let _ = tokio::time::timeout(BOUND, tcp.read_to_end(&mut buf)).await;
    assert!(
        !buf.starts_with(b"HTTP/"),
        "{:?}",
        String::from_utf8_lossy(&buf)
    );
    assert_eq!(rig.up.hits(), 0);
}

/// A request that must fail (the server refuses the handshake; with TLS 1.3
/// the client learns it at its first read).
async fn refused(rig: &TlsRig, client: Option<&Issued>) -> String {
    let r = request_once(rig.addr(), rig.client(H1, client), "GET", "/items", &[], "").await;
    match r {
        Ok(a) => panic!("served: {} {}", a.status, a.text()),
        Err(e) => e.to_string(),
    }
}

#[tokio::test]
async fn mtls_requires_a_valid_client_certificate_of_the_ca() {
    let rig = tls_gateway(true, |_| {}).await;
    refused(&rig, None).await;
    let now = SystemTime::now();
    let expired = rig.client_ca.as_ref().unwrap().issue_valid(
        &["expired-client"],
        Usage::Client,
        now - Duration::from_secs(10 * 86_400),
        now - Duration::from_secs(86_400),
    );
    refused(&rig, Some(&expired)).await;
    let foreign = TestCa::new("foreign CA").issue(&["foreign-client"], Usage::Client);
    refused(&rig, Some(&foreign)).await;
    assert_eq!(rig.up.hits(), 0, "no refused client reached the upstream");

    let good = rig.client_cert("good-client");
    for alpn in [H1, H2] {
        let a = request_once(
            rig.addr(),
            rig.client(alpn, Some(&good)),
            "GET",
            "/items",
            &[],
            "",
        )
        .await
        .unwrap();
        assert_eq!(a.status, 200, "{}", a.text());
    }
    assert_eq!(rig.up.hits(), 2);
}

#[tokio::test]
async fn the_client_certificate_is_the_scope() {
    let rig = tls_gateway(true, |c| {
        c.scope_from = ScopeFrom::ClientCert;
        c.layer.scope = ScopeBy::ClientCert;
    })
    .await;
    let (alice, bob) = (rig.client_cert("alice"), rig.client_cert("bob"));
    let k = key("cert-scope");
    let body = r#"{"amount":1}"#;
    // The same Authorization for both: only the certificate scopes.
    let auth = [
        ("idempotency-key", k.as_str()),
        ("content-type", "application/json"),
        ("authorization", "Bearer shared"),
    ];
    let post = |who: Issued, alpn: &'static [&'static [u8]]| {
        let config = rig.client(alpn, Some(&who));
        let addr = rig.addr();
        async move {
            request_once(addr, config, "POST", "/orders", &auth, body)
                .await
                .unwrap()
        }
    };
    let a1 = post(alice.clone(), H1).await;
    assert_eq!(a1.status, 201, "{}", a1.text());
    let b1 = post(bob.clone(), H2).await;
    assert_eq!(b1.status, 201, "{}", b1.text());
    assert!(!b1.replayed(), "another certificate is another caller");
    assert_eq!(
        rig.up.hits(),
        2,
        "two certificates, same key: two executions"
    );
    let a2 = post(alice, H2).await;
    assert!(
        a2.replayed(),
        "the same certificate on a new connection: replayed"
    );
    assert_eq!(a2.body, a1.body);
    let b2 = post(bob, H1).await;
    assert!(b2.replayed());
    assert_eq!(b2.body, b1.body);
    assert_eq!(rig.up.hits(), 2);
}

#[tokio::test]
async fn client_cert_scoping_is_refused_without_a_client_ca_or_with_scope_headers() {
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new("ca");
    let (cert, key) = ca
        .issue(&["localhost"], Usage::Server)
        .write(dir.path(), "s");
    let mut c = config("http://127.0.0.1:9");
    c.tls = Some(ListenerTls {
        cert,
        key,
        client_ca: None,
    });
    c.scope_from = ScopeFrom::ClientCert;
    c.layer.scope = ScopeBy::ClientCert;
    let e = c.validate().unwrap_err().to_string();
    assert!(
        e.contains("--scope-from") && e.contains("--tls-client-ca"),
        "{e}"
    );
    // scope_from without the layer's scope (or the other way round).
    c.tls.as_mut().unwrap().client_ca = Some(ca.write(dir.path(), "ca.crt"));
    c.validate().unwrap();
    c.layer.scope = ScopeBy::default();
    assert!(c
        .validate()
        .unwrap_err()
        .to_string()
        .contains("--scope-from"));
}

#[tokio::test]
async fn bad_certificate_files_are_refused_at_start_naming_the_flag() {
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new("ca");
    let (cert, key) = ca
        .issue(&["localhost"], Usage::Server)
        .write(dir.path(), "s");
    let (_, other_key) = ca
        .issue(&["localhost"], Usage::Server)
        .write(dir.path(), "o");
    let garbage = dir.path().join("garbage.pem");
    std::fs::write(&garbage, "hello").unwrap();
    let cases = [
        (
            dir.path().join("missing.crt"),
            key.clone(),
            None,
            "--tls-cert",
        ),
        (garbage.clone(), key.clone(), None, "--tls-cert"),
        (cert.clone(), garbage.clone(), None, "--tls-key"),
        (cert.clone(), other_key, None, "--tls-key"),
        (
            cert.clone(),
            key.clone(),
            Some(garbage.clone()),
            "--tls-client-ca",
        ),
    ];
    for (cert, key, client_ca, flag) in cases {
        let mut c = config("http://127.0.0.1:9");
        c.tls = Some(ListenerTls {
            cert,
            key,
            client_ca,
        });
        match Gateway::bind_with_store(c, Arc::new(MemoryStore::new())).await {
            Err(e @ GatewayError::Config(_)) => {
                let msg = e.to_string();
                assert!(msg.contains(flag), "{flag}: {msg}");
            }
            Err(e) => panic!("{flag}: not a configuration error: {e}"),
            Ok(_) => panic!("{flag}: started"),
        }
    }
}

#[tokio::test]
async fn a_handshake_that_never_finishes_does_not_hold_the_gateway() {
    let rig = tls_gateway(false, |c| c.header_timeout = Duration::from_millis(800)).await;
    // One silent client, one that stops in the middle of its ClientHello.
    let mut silent = tokio::net::TcpStream::connect(rig.addr()).await.unwrap();
    let mut partial = tokio::net::TcpStream::connect(rig.addr()).await.unwrap();
    partial.write_all(&[0x16, 0x03, 0x01, 0x00]).await.unwrap();
    // Meanwhile another client is served.
    let a = tokio::time::timeout(
        BOUND,
        request_once(rig.addr(), rig.client(H1, None), "GET", "/items", &[], ""),
    )
    .await
    .expect("served while two handshakes hang")
    .unwrap();
    assert_eq!(a.status, 200);
    // And both are closed after --header-timeout.
    for s in [&mut silent, &mut partial] {
        let mut buf = [0u8; 64];
        let r = tokio::time::timeout(BOUND, s.read(&mut buf))
            .await
            .expect("closed by the gateway");
        assert!(matches!(r, Ok(0) | Err(_)), "{r:?}");
    }
}

#[tokio::test]
async fn a_hanging_handshake_counts_against_the_connection_cap_until_its_timeout() {
    let rig = tls_gateway(false, |c| {
        c.header_timeout = Duration::from_millis(800);
        c.max_connections = 1;
    })
    .await;
    let mut silent = tokio::net::TcpStream::connect(rig.addr()).await.unwrap();
    // Give the gateway time to accept it (the only slot).
    tokio::time::sleep(Duration::from_millis(100)).await;
    let served = tokio::spawn({
        let (addr, config) = (rig.addr(), rig.client(H1, None));
        async move { request_once(addr, config, "GET", "/items", &[], "").await }
    });
    let mut buf = [0u8; 8];
    let r = tokio::time::timeout(BOUND, silent.read(&mut buf))
        .await
        .expect("the silent client is closed after --header-timeout");
    assert!(matches!(r, Ok(0) | Err(_)), "{r:?}");
    let a = tokio::time::timeout(BOUND, served)
        .await
        .expect("served once the slot is free")
        .unwrap()
        .unwrap();
    assert_eq!(a.status, 200);
}

/// Waits until a new handshake shows `want` as the server's leaf.
async fn until_served_with(rig: &TlsRig, want: &[u8]) {
    let deadline = tokio::time::Instant::now() + BOUND;
    loop {
        let tls = connect(rig.addr(), rig.client(H1, None)).await.unwrap();
        if server_leaf(&tls) == want {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the new certificate was not picked up"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn certificates_rotate_under_load_without_a_failed_request() {
    let rig = Arc::new(tls_gateway(false, |_| {}).await);
    let first = server_leaf(&connect(rig.addr(), rig.client(H1, None)).await.unwrap());
    let stop = Arc::new(AtomicBool::new(false));
    let (ok, failed) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let mut clients = Vec::new();
    for (i, alpn) in [H1, H2].into_iter().enumerate() {
        let (rig, stop, ok, failed) = (rig.clone(), stop.clone(), ok.clone(), failed.clone());
        clients.push(tokio::spawn(async move {
            // One kept-alive connection, and a new connection every request.
            let mut kept = http(connect(rig.addr(), rig.client(alpn, None)).await.unwrap())
                .await
                .unwrap();
            let mut n = 0u32;
            while !stop.load(Ordering::SeqCst) && n < 5_000 {
                n += 1;
                let k = format!("rot-{i}-{n}-{}", std::process::id());
                let fresh = request_once(
                    rig.addr(),
                    rig.client(alpn, None),
                    "POST",
                    "/orders",
                    &[
                        ("idempotency-key", &k),
                        ("content-type", "application/json"),
                    ],
                    "{}",
                )
                .await;
                let again = kept.post(&k, "{}").await;
                for r in [fresh, again] {
                    match r {
                        Ok(a) if a.status == 201 => ok.fetch_add(1, Ordering::SeqCst),
                        Ok(a) => panic!("{} {}", a.status, a.text()),
                        Err(e) => {
                            eprintln!("request failed: {e}");
                            failed.fetch_add(1, Ordering::SeqCst)
                        }
                    };
                }
            }
        }));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let next = rig.ca.issue(&["localhost", "127.0.0.1"], Usage::Server);
    assert_ne!(next.cert_der, first);
    replace_pair(&rig.cert, &rig.key, &next.cert_pem, &next.key_pem);
    until_served_with(&rig, &next.cert_der).await;
    // And a second rotation while the load goes on.
    let third = rig.ca.issue(&["localhost", "127.0.0.1"], Usage::Server);
    replace_pair(&rig.cert, &rig.key, &third.cert_pem, &third.key_pem);
    until_served_with(&rig, &third.cert_der).await;
    stop.store(true, Ordering::SeqCst);
    for c in clients {
        tokio::time::timeout(BOUND, c).await.unwrap().unwrap();
    }
    assert_eq!(failed.load(Ordering::SeqCst), 0, "no request failed");
    assert!(ok.load(Ordering::SeqCst) > 4, "the load ran");
}

#[tokio::test]
async fn a_broken_replacement_keeps_the_old_certificate_and_a_later_good_one_is_used() {
    let rig = tls_gateway(false, |_| {}).await;
    let first = server_leaf(&connect(rig.addr(), rig.client(H1, None)).await.unwrap());
    // A key that is not the certificate's.
    let a = rig.ca.issue(&["localhost"], Usage::Server);
    let b = rig.ca.issue(&["localhost"], Usage::Server);
    replace_pair(&rig.cert, &rig.key, &a.cert_pem, &b.key_pem);
    // Past a poll and its settling, the old certificate still serves.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let tls = connect(rig.addr(), rig.client(H1, None)).await.unwrap();
    assert_eq!(server_leaf(&tls), first, "the old certificate stays");
    let r = http(tls)
        .await
        .unwrap()
        .send("GET", "/items", &[], "")
        .await
        .unwrap();
    assert_eq!(r.status, 200);
    // Not PEM at all.
    replace_pair(&rig.cert, &rig.key, "garbage", "garbage");
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let tls = connect(rig.addr(), rig.client(H1, None)).await.unwrap();
    assert_eq!(server_leaf(&tls), first);
    // A good pair is picked up.
    replace_pair(&rig.cert, &rig.key, &a.cert_pem, &a.key_pem);
    until_served_with(&rig, &a.cert_der).await;
}

/// What a reload refuses beyond a bad pair: a chain with a certificate that
/// is not X.509, an expired leaf, and a FIFO put at the certificate's path
/// (never opened for reading and waited on: the watch goes on and a later
/// good pair is used).
#[tokio::test]
async fn a_bad_chain_an_expired_leaf_and_a_fifo_are_not_loaded() {
    let rig = tls_gateway(false, |_| {}).await;
    let first = server_leaf(&connect(rig.addr(), rig.client(H1, None)).await.unwrap());
    let stays = |what: &'static str| {
        let rig = &rig;
        let first = &first;
        async move {
            tokio::time::sleep(Duration::from_millis(2500)).await;
            let tls = connect(rig.addr(), rig.client(H1, None))
                .await
                .unwrap_or_else(|e| panic!("{what}: the handshake failed: {e}"));
            assert_eq!(
                &server_leaf(&tls),
                first,
                "{what}: the old certificate stays"
            );
        }
    };
    let good = rig.ca.issue(&["localhost"], Usage::Server);
    // The leaf, then a CERTIFICATE block that is not a certificate.
    let junk = "-----BEGIN CERTIFICATE-----\nAAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=\n-----END CERTIFICATE-----\n";
    replace_pair(
        &rig.cert,
        &rig.key,
        &format!("{}{junk}", good.cert_pem),
        &good.key_pem,
    );
    stays("a chain with a block that is not X.509").await;
    let day = Duration::from_secs(86_400);
    let now = std::time::SystemTime::now();
    let expired = rig
        .ca
        .issue_valid(&["localhost"], Usage::Server, now - 3 * day, now - day);
    replace_pair(&rig.cert, &rig.key, &expired.cert_pem, &expired.key_pem);
    stays("an expired leaf").await;
    std::fs::remove_file(&rig.cert).unwrap();
    let made = std::process::Command::new("mkfifo")
        .arg(&rig.cert)
        .status()
        .expect("mkfifo (coreutils)");
    assert!(made.success());
    stays("a FIFO at the certificate's path").await;
    std::fs::remove_file(&rig.cert).unwrap();
    replace_pair(&rig.cert, &rig.key, &good.cert_pem, &good.key_pem);
    until_served_with(&rig, &good.cert_der).await;
}
