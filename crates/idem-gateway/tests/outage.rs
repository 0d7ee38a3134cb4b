//! The store failing under a running gateway: `--store-timeout` bounds
//! every call, a result that cannot be saved keeps its key in flight
//! (CASES A1), fail-closed is the default, and `--fail-open` forwards
//! unprotected only when the store failed before the upstream was called.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::routing;
use axum::Router;
use common::*;
use idem_core::{IdempotencyKey, RecordState, Scope, Store};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn in_flight(r: &Got) -> bool {
    r.status == 409
        && r.problem_type() == "urn:idem:problem:in-flight"
        && r.header("retry-after").is_some()
}

#[tokio::test]
async fn a1_a_store_timeout_while_saving_never_frees_the_key() {
    let (Rig { up, gw, c }, store) = faulty_rig(|cfg| {
        cfg.store_options.timeout = Duration::from_millis(300);
        cfg.layer.lease = Duration::from_secs(2);
        cfg.layer.ttl = Duration::from_secs(60);
    })
    .await;
    store.set(Op::Complete, Fault::Hang);
    let k = key("a1-save-timeout");

    let started = Instant::now();
    let first = post(&c, &gw.url("/orders"), Some(&k), "{}").await;
    // The first caller still gets its answer: the upstream acted. It waited
    // for the save up to the engine's save_wait (2 s), each try cut off by
    // --store-timeout.
    assert_eq!(first.status, 201, "{}", first.text());
    assert_within(
        started,
        Duration::from_secs(4),
        "the hung save was not cut off",
    );
    assert!(store.calls(Op::Complete) >= 1);
    assert_eq!(up.hits(), 1);

    // While the store hangs, every duplicate is told to wait — also past the
    // original lease (the saver keeps renewing it) — nothing runs again, and
    // the key is never released.
    for _ in 0..3 {
        let r = post(&c, &gw.url("/orders"), Some(&k), "{}").await;
        assert!(in_flight(&r), "{} {}", r.status, r.text());
    }
    tokio::time::sleep(Duration::from_millis(2300)).await;
    let r = post(&c, &gw.url("/orders"), Some(&k), "{}").await;
    assert!(
        in_flight(&r),
        "past the first lease: {} {}",
        r.status,
        r.text()
    );
    assert_eq!(up.hits(), 1, "the key was freed after a failed save");
    assert_eq!(store.calls(Op::Release), 0);
    let rec = store
        .inner()
        .get(&Scope::anonymous(), &IdempotencyKey::new(&k).unwrap())
        .await
        .unwrap()
        .expect("record kept");
    assert!(
        matches!(rec.state, RecordState::InProgress { .. }),
        "{rec:?}"
    );

    // The store recovers: the retried save lands, and the retry is the
    // replay of the first run — with its body — never a second execution.
    store.clear(Op::Complete);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let r = post(&c, &gw.url("/orders"), Some(&k), "{}").await;
        if r.replayed() {
            assert_eq!(r.status, 201, "{}", r.text());
            assert_eq!(r.text(), first.text(), "the replay carries the body");
            break;
        }
        assert!(in_flight(&r), "{} {}", r.status, r.text());
        assert!(Instant::now() < deadline, "the retried save never landed");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(up.hits(), 1);
}

#[tokio::test]
async fn a_hung_store_answers_503_within_the_store_timeout() {
    let up = upstream().await;
    let mut cfg = config(&up.url());
    cfg.store_options.timeout = Duration::from_millis(400);
    let gw = gateway_with(cfg, Arc::new(FaultyStore::hung())).await;
    let c = client();
    let started = Instant::now();
    let r = post(&c, &gw.url("/orders"), Some(&key("hung")), "{}").await;
    let took = started.elapsed();
    assert_eq!(r.status, 503, "{}", r.text());
    assert_eq!(r.problem_type(), "urn:idem:problem:store-unavailable");
    assert!(
        took >= Duration::from_millis(350) && took < Duration::from_secs(3),
        "{took:?}"
    );
    assert_eq!(up.hits(), 0);
    // Unguarded traffic does not wait for the store.
    assert_eq!(post(&c, &gw.url("/orders"), None, "{}").await.status, 201);
}

#[tokio::test]
async fn fail_closed_is_the_default_and_service_resumes_when_the_store_returns() {
    let (Rig { up, gw, c }, store) = faulty_rig(|_| {}).await;
    store.set_each(&BEGIN_AND_GET, Fault::Unavailable);
    for i in 0..5 {
        let r = post(
            &c,
            &gw.url("/orders"),
            Some(&key(&format!("down{i}"))),
            "{}",
        )
        .await;
        assert_eq!(r.status, 503, "{}", r.text());
        assert_eq!(r.problem_type(), "urn:idem:problem:store-unavailable");
        assert_eq!(
            r.header("content-type").as_deref(),
            Some("application/problem+json")
        );
        assert_eq!(r.header("idempotency-status"), None);
    }
    assert_eq!(up.hits(), 0, "fail-closed reached the upstream");
    let h = fetch(&c, &gw.url("/_idem/health")).await;
    assert_eq!(h.status, 503);
    store.clear_all();
    let k = key("back");
    runs_then_replays(&c, &gw.url("/orders"), &k).await;
    assert_eq!(up.hits(), 1);
}

#[tokio::test]
async fn fail_open_forwards_unprotected_when_begin_fails() {
    let (Rig { up, gw, c }, store) = faulty_rig(|cfg| {
        cfg.fail_open = true;
    })
    .await;
    store.set_each(&BEGIN_AND_GET, Fault::Unavailable);

    let k = key("open");
    let body = r#"{"amount": 10}"#;
    let r = post_as(
        &c,
        &gw.url("/echo?x=1"),
        &k,
        &[("authorization", "Bearer a")],
        body,
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(
        r.header("idempotency-status").as_deref(),
        Some("unprotected")
    );
    assert!(!r.replayed());
    assert_eq!(up.hits(), 1);
    // The upstream got the request as the layer would have sent it.
    let seen = up.last_seen();
    assert_eq!(seen.uri, "/echo?x=1");
    assert_eq!(seen.body, body.as_bytes());
    assert_eq!(seen.headers["idempotency-key"], k.as_str());
    assert_eq!(seen.headers["authorization"], "Bearer a");

    // Nothing was recorded in the store, but this instance remembers the
    // key it forwarded: a retry of it while the store is down gets 503,
    // not a second run.
    let r = post_as(
        &c,
        &gw.url("/echo?x=1"),
        &k,
        &[("authorization", "Bearer a")],
        body,
    )
    .await;
    assert_eq!(r.status, 503, "{}", r.text());
    assert_eq!(
        up.hits(),
        1,
        "fail-open forwarded a retry of a key it already forwarded"
    );

    // Another key is still forwarded unprotected.
    let r = post(&c, &gw.url("/orders"), Some(&key("open2")), "{}").await;
    assert_eq!(r.status, 201);
    assert_eq!(
        r.header("idempotency-status").as_deref(),
        Some("unprotected")
    );
    assert_eq!(up.hits(), 2);

    // Unguarded requests are not marked; the store's own health is still 503.
    let r = post(&c, &gw.url("/orders"), None, "{}").await;
    assert_eq!((r.status, r.header("idempotency-status")), (201, None));
    let h = fetch(&c, &gw.url("/_idem/health")).await;
    assert_eq!(h.status, 503);

    // Back to normal when the store is.
    store.clear_all();
    let k = key("open-healthy");
    let r = runs_then_replays(&c, &gw.url("/orders"), &k).await;
    assert_eq!(r.header("idempotency-status"), None);
    assert_eq!(up.hits(), 4);
}

#[tokio::test]
async fn fail_open_never_reruns_a_request_whose_result_could_not_be_saved() {
    let (Rig { up, gw, c }, store) = faulty_rig(|cfg| {
        cfg.fail_open = true;
        cfg.layer.lease = Duration::from_secs(5);
        // The lease must be longer than the store timeout (5 s by default).
        cfg.store_options.timeout = Duration::from_secs(2);
    })
    .await;
    store.set(Op::Complete, Fault::Unavailable);
    let k = key("open-save");
    let r = post(&c, &gw.url("/orders"), Some(&k), "{}").await;
    assert_eq!(r.status, 201, "{}", r.text());
    assert_eq!(r.header("idempotency-status"), None, "the key was claimed");
    assert_eq!(up.hits(), 1);
    let dup = post(&c, &gw.url("/orders"), Some(&k), "{}").await;
    assert!(in_flight(&dup), "{} {}", dup.status, dup.text());
    assert_eq!(up.hits(), 1);
    assert_eq!(store.calls(Op::Release), 0);
}

#[tokio::test]
async fn fail_open_refuses_a_key_this_gateway_saw_moments_ago() {
    let (Rig { up, gw, c }, store) = faulty_rig(|cfg| {
        cfg.fail_open = true;
    })
    .await;
    let k = key("seen");
    assert_eq!(
        post(&c, &gw.url("/orders"), Some(&k), "{}").await.status,
        201
    );
    store.set_each(&BEGIN_AND_GET, Fault::Unavailable);
    // Rerunning it would certainly be a second execution: fail closed.
    let r = post(&c, &gw.url("/orders"), Some(&k), "{}").await;
    assert_eq!(r.status, 503, "{}", r.text());
    assert_eq!(r.problem_type(), "urn:idem:problem:store-unavailable");
    assert_eq!(up.hits(), 1);
    // A key it never saw goes through unprotected.
    let r = post(&c, &gw.url("/orders"), Some(&key("unseen")), "{}").await;
    assert_eq!(
        r.header("idempotency-status").as_deref(),
        Some("unprotected")
    );
    assert_eq!(up.hits(), 2);
}

#[tokio::test]
async fn fail_open_passes_an_upstream_503_through_without_a_second_call() {
    // An upstream that itself answers like an idem gateway whose store is down.
    let hits = Arc::new(AtomicUsize::new(0));
    let h = hits.clone();
    let app = Router::new().route(
        "/pay",
        routing::post(move || {
            let h = h.clone();
            async move {
                h.fetch_add(1, Ordering::SeqCst);
                (
                    axum::http::StatusCode::SERVICE_UNAVAILABLE,
                    [("content-type", "application/problem+json")],
                    r#"{"type":"urn:idem:problem:store-unavailable","status":503}"#,
                )
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    let mut cfg = config(&format!("http://{addr}"));
    cfg.fail_open = true;
    let gw = gateway_with(cfg, Arc::new(MemoryStore::new())).await;
    let r = post(&client(), &gw.url("/pay"), Some(&key("up503")), "{}").await;
    assert_eq!(r.status, 503);
    assert_eq!(r.header("idempotency-status"), None);
    assert_eq!(
        hits.load(Ordering::SeqCst),
        1,
        "fail-open called the upstream twice"
    );
    task.abort();
}

#[tokio::test]
async fn fail_open_keeps_the_body_limit_and_bad_keys() {
    let (Rig { up, gw, c }, store) = faulty_rig(|cfg| {
        cfg.fail_open = true;
        cfg.layer.max_body = 16;
    })
    .await;
    store.set_each(&BEGIN_AND_GET, Fault::Unavailable);
    // Over the limit, by Content-Length and by a chunked body.
    let r = post(&c, &gw.url("/orders"), Some(&key("big")), &"x".repeat(64)).await;
    assert_eq!(r.status, 413, "{}", r.text());
    let mut sock = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    let head = format!(
        "POST /orders HTTP/1.1\r\nHost: gw\r\nIdempotency-Key: {}\r\n\
         Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n",
        key("big-chunked")
    );
    let _ = sock.write_all(head.as_bytes()).await;
    for _ in 0..8 {
        // The gateway may answer and close before all of it is sent.
        let _ = sock.write_all(b"a\r\n0123456789\r\n").await;
    }
    let _ = sock.write_all(b"0\r\n\r\n").await;
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), sock.read_to_end(&mut answer)).await;
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    // A blank key is refused before the store is asked.
    let r = post(&c, &gw.url("/orders"), Some("   "), "{}").await;
    assert_eq!(r.status, 400);
    assert_eq!(up.hits(), 0);
}
