//! The proxy part of the gateway against a real upstream: forwarding,
//! hop-by-hop fields, X-Forwarded-For, Host, streaming, `/_idem/`
//! endpoints, purge and graceful shutdown.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use idem_core::{MemoryStore, Store};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[tokio::test]
async fn forwards_method_path_query_headers_and_body() {
    let Rig { up, gw, c } = rig(|_| {}).await;
    let k = key("fwd");
    let r = send(
        &c,
        Method::POST,
        &gw.url("/echo?a=1&b=%20x"),
        &[
            ("idempotency-key", &k),
            ("x-custom", "one"),
            ("content-type", "text/plain"),
        ],
        "hello body",
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let seen = up.last_seen();
    assert_eq!(seen.method, "POST");
    assert_eq!(seen.uri.to_string(), "/echo?a=1&b=%20x");
    assert_eq!(seen.body.as_ref(), b"hello body");
    assert_eq!(seen.headers["x-custom"], "one");
    assert_eq!(seen.headers["content-type"], "text/plain");
    // The key reaches the upstream unchanged.
    assert_eq!(seen.headers["idempotency-key"], k.as_str());
}

#[tokio::test]
async fn upstream_path_prefix_is_prepended() {
    let up = upstream().await;
    // The upstream's routes live at /, so a prefix of "/" is a no-op and
    // a real prefix must show up in what the upstream sees.
    let gw = gateway(&format!("{}/", up.url()), |_| {}).await;
    let r = fetch(&client(), &gw.url("/items?x=1")).await;
    assert_eq!(r.status, 200);
    assert_eq!(up.last_seen().uri.to_string(), "/items?x=1");

    let gw2 = gateway(&format!("{}/api", up.url()), |_| {}).await;
    let r = fetch(&client(), &gw2.url("/items")).await;
    assert_eq!(r.status, 404, "the upstream has no /api/items");
    assert_eq!(up.last_seen().uri.path(), "/api/items");
}

#[tokio::test]
async fn x_forwarded_for_is_appended_and_host_rewritten() {
    let up = upstream().await;
    let gw = gateway(&up.url(), |_| {}).await;
    let forwarded = [("x-forwarded-for", "203.0.113.9"), ("host", "shop.example")];
    let r = call(&client(), Method::GET, &gw.url("/echo"), &forwarded).await;
    assert_eq!(r.status, 200);
    let seen = up.last_seen();
    // The client is no --trusted-proxy: its X-Forwarded-For is replaced
    // (front_door_door.rs has the trusted case).
    assert_eq!(seen.headers["x-forwarded-for"], "127.0.0.1");
    assert_eq!(seen.headers["host"], up.addr.to_string().as_str());
    assert_eq!(seen.headers["x-forwarded-host"], "shop.example");
    assert_eq!(seen.headers["x-forwarded-proto"], "http");

    // Without an earlier proxy, the list is just the client.
    fetch(&client(), &gw.url("/echo")).await;
    assert_eq!(up.last_seen().headers["x-forwarded-for"], "127.0.0.1");
}

#[tokio::test]
async fn hop_by_hop_request_fields_are_not_forwarded() {
    let up = upstream().await;
    let gw = gateway(&up.url(), |_| {}).await;
    let mut s = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    let req = "POST /echo HTTP/1.1\r\n\
               Host: gw\r\n\
               Connection: keep-alive, X-Drop-Me\r\n\
               X-Drop-Me: secret\r\n\
               Keep-Alive: timeout=5\r\n\
               Proxy-Connection: keep-alive\r\n\
               TE: trailers\r\n\
               Trailer: X-Checksum\r\n\
               X-Keep-Me: yes\r\n\
               Content-Length: 4\r\n\
               \r\n\
               body";
    s.write_all(req.as_bytes()).await.unwrap();
    let resp = read_request(&mut s).await; // reads head + Content-Length body
    let text = String::from_utf8_lossy(&resp);
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    let seen = up.last_seen();
    for gone in [
        "connection",
        "x-drop-me",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "upgrade",
        "transfer-encoding",
    ] {
        assert!(
            !seen.headers.contains_key(gone),
            "{gone} was forwarded: {:?}",
            seen.headers
        );
    }
    assert_eq!(seen.headers["x-keep-me"], "yes");
    assert_eq!(seen.body.as_ref(), b"body");
}

#[tokio::test]
async fn chunked_request_body_is_forwarded_without_transfer_encoding_leaking() {
    let up = upstream().await;
    let gw = gateway(&up.url(), |_| {}).await;
    for k in [None, Some(key("chunked-req"))] {
        let mut s = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
        let key_line = k
            .as_ref()
            .map(|k| format!("Idempotency-Key: {k}\r\n"))
            .unwrap_or_default();
        let req = format!(
            "POST /echo HTTP/1.1\r\nHost: gw\r\n{key_line}Transfer-Encoding: chunked\r\n\r\n\
             5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"
        );
        s.write_all(req.as_bytes()).await.unwrap();
        let resp = read_request(&mut s).await;
        assert!(
            String::from_utf8_lossy(&resp).starts_with("HTTP/1.1 200"),
            "{}",
            String::from_utf8_lossy(&resp)
        );
        let seen = up.last_seen();
        assert_eq!(seen.body.as_ref(), b"hello world");
    }
}

#[tokio::test]
async fn hop_by_hop_response_fields_are_removed() {
    let (_raw, gw) = raw_rig(
        RawAction::WriteAndClose(
            b"HTTP/1.1 200 OK\r\n\
          Connection: close, X-Hop-Resp\r\n\
          X-Hop-Resp: 1\r\n\
          Keep-Alive: timeout=5\r\n\
          Proxy-Connection: close\r\n\
          Upgrade: h2c\r\n\
          X-End-To-End: kept\r\n\
          Content-Length: 2\r\n\
          \r\n\
          ok"
            .to_vec(),
        ),
        |_| {},
    )
    .await;
    for k in [None, Some(key("hop-resp"))] {
        let mut req = client().post(gw.url("/x")).body("b");
        if let Some(k) = &k {
            req = req.header("idempotency-key", k);
        }
        let r = read(req.send().await.unwrap()).await;
        assert_eq!(r.status, 200);
        assert_eq!(r.body, b"ok");
        assert_eq!(r.header("x-end-to-end").as_deref(), Some("kept"));
        for gone in ["x-hop-resp", "keep-alive", "proxy-connection", "upgrade"] {
            assert!(
                r.header(gone).is_none(),
                "{gone} reached the client: {:?}",
                r.headers
            );
        }
        // `Connection: close` from the upstream must not close the client's connection.
        assert_ne!(r.header("connection").as_deref(), Some("close, X-Hop-Resp"));
    }
}

#[tokio::test]
async fn get_passes_through_unguarded_even_with_a_key() {
    let mem = MemoryStore::new();
    let Rig { up, gw, c } = rig_with(mem.clone(), |_| {}).await;
    let k = key("get");
    for i in 1..=2 {
        let r = call(
            &c,
            Method::GET,
            &gw.url("/items"),
            &[("idempotency-key", &k)],
        )
        .await;
        assert_eq!(r.status, 200);
        assert_eq!(r.text(), format!("items {i}"));
        assert!(!r.replayed());
    }
    assert_eq!(up.hits(), 2);
    assert!(mem.is_empty(), "a GET touched the store");
}

/// Only the gateway says whether an answer is a replay: an upstream's own
/// `Idempotent-Replayed` is dropped on unguarded requests too (no key here).
#[tokio::test]
async fn an_upstream_replayed_header_never_reaches_the_client() {
    let up = upstream().await;
    let gw = gateway_with(config(&up.url()), Arc::new(MemoryStore::new())).await;
    let c = client();
    let r = read(c.post(gw.url("/claims-replayed")).send().await.unwrap()).await;
    assert_eq!(r.status, 201, "{}", r.text());
    assert_eq!(r.header("idempotent-replayed"), None);
    assert_eq!(up.hits(), 1);
}

#[tokio::test]
async fn unguarded_bodies_stream_without_the_body_limit() {
    let up = upstream().await;
    let gw = gateway(&up.url(), |c| c.layer.max_body = 1024).await;
    let big = "x".repeat(200_000);
    // No key: not guarded, so no 413 and no buffering limit.
    let r = read(
        client()
            .post(gw.url("/echo"))
            .body(big.clone())
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["body_len"], 200_000);
    // With a key the same body is over --max-body.
    let r = read(
        client()
            .post(gw.url("/echo"))
            .header("idempotency-key", key("big"))
            .body(big)
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(r.status, 413, "{}", r.text());
    assert_eq!(up.hits(), 1);
}

#[tokio::test]
async fn unguarded_responses_stream_chunk_by_chunk() {
    let up = upstream().await;
    let gw = gateway(&up.url(), |_| {}).await;
    let start = Instant::now();
    let mut resp = client().get(gw.url("/chunked")).send().await.unwrap();
    let first = resp.chunk().await.unwrap().unwrap();
    let first_at = start.elapsed();
    assert!(first.starts_with(b"chunk0"), "{first:?}");
    let mut rest = Vec::new();
    while let Some(c) = resp.chunk().await.unwrap() {
        rest.extend_from_slice(&c);
    }
    let all_at = start.elapsed();
    assert!(
        first_at + Duration::from_millis(150) < all_at,
        "the first chunk ({first_at:?}) came with the last ({all_at:?}): the response was buffered"
    );
    assert!(String::from_utf8_lossy(&rest).ends_with("chunk2-of-execution-1;"));
}

#[tokio::test]
async fn health_endpoint_reports_the_store_and_is_never_proxied() {
    let (Rig { up, gw, c }, store) = faulty_rig(|_| {}).await;
    let r = fetch(&c, &gw.url("/_idem/health")).await;
    assert_eq!(r.status, 200);
    assert_eq!(
        r.header("content-type").as_deref(),
        Some("application/json")
    );
    assert_eq!(
        r.json(),
        serde_json::json!({"status": "ok", "store": "memory"})
    );

    let r = fetch(&c, &gw.url("/_idem/nope")).await;
    assert_eq!(r.status, 404);
    assert_eq!(
        r.header("content-type").as_deref(),
        Some("application/problem+json")
    );
    assert_eq!(r.problem_type(), "urn:idem:problem:not-found");

    let keyed = [("idempotency-key", "k")];
    let r = call(&c, Method::POST, &gw.url("/_idem/health"), &keyed).await;
    assert_eq!(r.status, 405);
    assert_eq!(r.header("allow").as_deref(), Some("GET, HEAD"));

    // Readiness is cached for up to 1 s: poll for the change.
    store.set_each(&BEGIN_AND_GET, Fault::Unavailable);
    let r = health_until(&c, &gw.url("/_idem/health"), 503).await;
    assert_eq!(r.problem_type(), "urn:idem:problem:store-unavailable");
    assert_eq!(r.json()["reason"], "unavailable");
    store.clear_all();
    health_until(&c, &gw.url("/_idem/health"), 200).await;

    assert_eq!(up.hits(), 0, "an /_idem/ path reached the upstream");
}

/// Fetches `url` until it answers `status` (at most 5 s).
async fn health_until(c: &reqwest::Client, url: &str, status: u16) -> Got {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let r = fetch(c, url).await;
        if r.status == status {
            return r;
        }
        assert!(
            Instant::now() < deadline,
            "{url} still answers {} after 5 s: {}",
            r.status,
            r.text()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn health_reports_sqlite() {
    let up = upstream().await;
    let dir = tempfile::tempdir().unwrap();
    let mut c = config(&up.url());
    c.store = format!("sqlite://{}", dir.path().join("h.db").display()).into();
    let gw = idem_gateway::Gateway::bind(c).await.unwrap();
    let addr = gw.local_addr();
    let task = tokio::spawn(gw.serve(std::future::pending()));
    let r = read(
        client()
            .get(format!("http://{addr}/_idem/health"))
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["store"], "sqlite");
    assert!(
        dir.path().join("h.db").exists(),
        "the SQLite file was not created"
    );
    task.abort();
}

#[tokio::test]
async fn expired_records_are_purged_in_the_background() {
    let up = upstream().await;
    let mem = MemoryStore::new();
    let mut c = config(&up.url());
    // The shortest the gateway accepts: a lease of 1 s (`MIN_LEASE`),
    // longer than the store timeout.
    c.layer.ttl = Duration::from_secs(1);
    c.layer.lease = Duration::from_secs(1);
    c.store_options.timeout = Duration::from_millis(500);
    c.purge_interval = Duration::from_millis(100);
    let gw = gateway_with(c, Arc::new(mem.clone())).await;
    let r = post(&client(), &gw.url("/orders"), Some(&key("purge")), "{}").await;
    assert_eq!(r.status, 201);
    assert_eq!(mem.len(), 1);
    assert!(
        eventually(Duration::from_secs(5), || mem.is_empty()).await,
        "the expired record was not purged"
    );
}

#[tokio::test]
async fn graceful_shutdown_lets_in_flight_requests_finish_and_store() {
    let up = upstream().await;
    let mem = MemoryStore::new();
    let mut gw = gateway_with(config(&up.url()), Arc::new(mem.clone())).await;
    let url = gw.url("/slow?ms=600");
    let k = key("graceful");
    let k2 = k.clone();
    let inflight = tokio::spawn(async move { post(&client(), &url, Some(&k2), "{}").await });
    assert!(eventually(Duration::from_secs(5), || up.hits() == 1).await);
    let t0 = Instant::now();
    gw.signal_shutdown();
    let served = gw.task.take().unwrap().await.unwrap();
    assert!(served.is_ok());
    let r = inflight.await.unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.text(), "slow 1");
    assert!(
        t0.elapsed() >= Duration::from_millis(300),
        "serve returned before the request finished"
    );
    // Its result is in the store, so a new gateway on the same store replays it.
    let gw2 = gateway_with(config(&up.url()), Arc::new(mem.clone())).await;
    let r = post(&client(), &gw2.url("/slow?ms=600"), Some(&k), "{}").await;
    assert_eq!(r.status, 200);
    assert!(r.replayed());
    assert_eq!(r.text(), "slow 1");
    assert_eq!(up.hits(), 1);
    // The old listener is closed.
    assert!(tokio::net::TcpStream::connect(gw.addr).await.is_err());
}

#[tokio::test]
async fn shutdown_waits_for_the_run_of_a_client_that_left() {
    let up = upstream().await;
    let mem = MemoryStore::new();
    let mut gw = gateway_with(config(&up.url()), Arc::new(mem.clone())).await;
    let k = key("left");
    // The client gives up long before the 1 s upstream call ends; its
    // connection closes, the run goes on in the layer's spawned task.
    give_up_on(&gw.url("/slow?ms=1000"), &k, 200).await;
    assert_eq!(up.hits(), 1);
    // Let the gateway notice the closed connection: no connection is left
    // for the graceful shutdown to wait on.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let t0 = Instant::now();
    gw.signal_shutdown();
    gw.task.take().unwrap().await.unwrap().unwrap();
    // `serve` returned only once the run had stored its result.
    let rec = mem
        .get(
            &idem_core::Scope::anonymous(),
            &idem_core::IdempotencyKey::new(k.clone()).unwrap(),
        )
        .await
        .unwrap();
    assert!(
        matches!(
            rec,
            Some(idem_core::Record {
                state: idem_core::RecordState::Completed { .. },
                ..
            })
        ),
        "serve returned {:?} after the shutdown signal with the result not stored: {rec:?}",
        t0.elapsed()
    );
    assert!(
        t0.elapsed() >= Duration::from_millis(300),
        "{:?}",
        t0.elapsed()
    );
    // A new gateway on the same store replays it.
    let gw2 = gateway_with(config(&up.url()), Arc::new(mem.clone())).await;
    let r = post(&client(), &gw2.url("/slow?ms=1000"), Some(&k), "{}").await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(r.replayed());
    assert_eq!(r.text(), "slow 1");
    assert_eq!(up.hits(), 1);
}

#[tokio::test]
async fn shutdown_gives_up_on_a_left_run_after_the_grace() {
    let up = upstream().await;
    let gw_cfg = {
        let mut c = config(&up.url());
        c.shutdown_grace = Duration::from_millis(300);
        c
    };
    let mut gw = gateway_with(gw_cfg, Arc::new(MemoryStore::new())).await;
    give_up_on(&gw.url("/slow?ms=5000"), &key("grace"), 100).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    let t0 = Instant::now();
    gw.signal_shutdown();
    gw.task.take().unwrap().await.unwrap().unwrap();
    assert_within(t0, Duration::from_secs(3), "the grace bounds the wait");
}

#[tokio::test]
async fn idle_keep_alive_connections_do_not_block_shutdown() {
    let up = upstream().await;
    let gw = gateway(&up.url(), |c| c.shutdown_grace = Duration::from_secs(20)).await;
    let mut s = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    s.write_all(b"GET /items HTTP/1.1\r\nHost: gw\r\n\r\n")
        .await
        .unwrap();
    let resp = read_request(&mut s).await;
    assert!(String::from_utf8_lossy(&resp).starts_with("HTTP/1.1 200"));
    let t0 = Instant::now();
    gw.stop().await.unwrap();
    assert_within(
        t0,
        Duration::from_secs(5),
        "shutdown waited on an idle connection",
    );
    let mut buf = [0u8; 16];
    assert_eq!(
        s.read(&mut buf).await.unwrap_or(0),
        0,
        "idle connection left open"
    );
}

#[tokio::test]
async fn bind_errors_are_reported() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let mut c = config("http://127.0.0.1:9");
    c.listen = taken.local_addr().unwrap();
    let e = idem_gateway::Gateway::bind(c).await.unwrap_err();
    assert!(matches!(e, idem_gateway::GatewayError::Bind { .. }), "{e}");

    let mut c = config("http://127.0.0.1:9");
    c.store = "couchdb://localhost".into();
    let e = idem_gateway::Gateway::bind(c).await.unwrap_err();
    assert!(e.to_string().contains("sqlite://"), "{e}");

    // A well-formed URL whose server is not there: the gateway does not
    // start (fail fast), and says which store, without its password.
    let mut c = config("http://127.0.0.1:9");
    let port = free_port();
    c.store = format!("redis://:hunter2@127.0.0.1:{port}/").into();
    c.store_options.timeout = Duration::from_secs(2);
    let e = idem_gateway::Gateway::bind(c).await.unwrap_err();
    let msg = error_chain(&e);
    assert!(
        matches!(e, idem_gateway::GatewayError::Store { kind: "redis", .. }),
        "{msg}"
    );
    assert!(msg.contains(&format!("127.0.0.1:{port}")), "{msg}");
    assert!(!msg.contains("hunter2"), "{msg}");

    let mut c = config("http://127.0.0.1:9");
    c.layer.lease = Duration::ZERO;
    assert!(idem_gateway::Gateway::bind(c).await.is_err());
}

#[tokio::test]
async fn open_store_schemes() {
    let dir = tempfile::tempdir().unwrap();
    let m = idem_gateway::open_store("memory://").await.unwrap();
    assert_eq!(m.purge_expired().await.unwrap(), 0);
    let abs = dir.path().join("abs.db");
    let s = idem_gateway::open_store(&format!("sqlite://{}", abs.display()))
        .await
        .unwrap();
    s.purge_expired().await.unwrap();
    assert!(abs.exists());
    for bad in [
        "bogus",
        "ftp://x",
        "postgres://h/db?idem_table=a-b",
        "redis://h?idem_table=t",
    ] {
        match idem_gateway::open_store(bad).await {
            Err(idem_core::StoreError::Config(msg)) => {
                assert!(msg.contains("memory://") || msg.contains("idem_"), "{msg}")
            }
            other => panic!("{bad}: {other:?}"),
        }
    }
    // Recognised schemes are tried (and fail here: nothing listens).
    let port = free_port();
    let opts = idem_gateway::StoreOptions::default().with_timeout(Duration::from_secs(2));
    for url in [
        format!("postgres://postgres@127.0.0.1:{port}/test"),
        format!("mariadb://root@127.0.0.1:{port}/test"),
        format!("redis://127.0.0.1:{port}/"),
    ] {
        let started = std::time::Instant::now();
        match idem_gateway::open_store_with(&url, &opts).await {
            Err(
                idem_core::StoreError::Unavailable { .. } | idem_core::StoreError::Timeout { .. },
            ) => {}
            other => panic!("{url}: {other:?}"),
        }
        assert_within(started, Duration::from_secs(8), &url);
    }
}

/// An HTTP/1.0 upstream (Python's `http.server`, say) must not make the
/// gateway answer its own client in HTTP/1.0 and close the connection:
/// the first answer and the replay both come back as HTTP/1.1 on one
/// kept-alive connection.
#[tokio::test]
async fn http10_upstream_answers_client_in_http11() {
    let (raw, gw) = raw_rig(
        RawAction::WriteAndClose(
            b"HTTP/1.0 201 Created\r\nContent-Type: text/plain\r\nContent-Length: 2\r\n\r\nok"
                .to_vec(),
        ),
        |_| {},
    )
    .await;
    let k = key("http10");
    let mut sock = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    let request = format!(
        "POST /pay HTTP/1.1\r\nHost: x\r\nIdempotency-Key: {k}\r\nContent-Length: 1\r\n\r\nx"
    );
    for round in ["first", "replay"] {
        sock.write_all(request.as_bytes()).await.unwrap();
        let mut buf = Vec::new();
        let mut chunk = [0u8; 4096];
        // Read until the 2-byte body after the head has arrived.
        while !(buf.windows(4).any(|w| w == b"\r\n\r\n") && buf.ends_with(b"ok")) {
            let n = tokio::time::timeout(Duration::from_secs(10), sock.read(&mut chunk))
                .await
                .unwrap_or_else(|_| panic!("{round}: no answer within 10 s"))
                .unwrap();
            assert!(
                n > 0,
                "{round}: the gateway closed the client's connection: {:?}",
                String::from_utf8_lossy(&buf)
            );
            buf.extend_from_slice(&chunk[..n]);
        }
        let head = String::from_utf8_lossy(&buf).to_string();
        assert!(head.starts_with("HTTP/1.1 201"), "{round}: {head}");
        assert!(
            !head.to_ascii_lowercase().contains("connection: close"),
            "{round}: {head}"
        );
    }
    assert_eq!(raw.hits(), 1, "the replay must not reach the upstream");
}
