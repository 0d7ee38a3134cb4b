//! The gateway's idempotency guarantees against a real upstream: the
//! CASES.md sections A–F that concern the gateway, replay fidelity, key
//! syntax, and what each upstream failure does to the key.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use idem_core::MemoryStore;
use reqwest::header::{HeaderMap, HeaderValue};
use tokio::io::AsyncWriteExt;

/// Two copies of one keyed POST to `url`, the second sent `gap` after the first.
async fn two_copies(c: &reqwest::Client, url: &str, k: &str, gap: Duration) -> (Got, Got) {
    tokio::join!(post(c, url, Some(k), "{}"), async {
        tokio::time::sleep(gap).await;
        post(c, url, Some(k), "{}").await
    })
}

/// The headers that name one caller (an Authorization, an API key).
type Caller<'a> = &'a [(&'a str, &'a str)];

/// Callers `a` and `b` POST to `url` with the same key `k`: two executions,
/// neither sees the other's response, and each replay is its own.
async fn assert_callers_kept_apart(
    c: &reqwest::Client,
    up: &TestUpstream,
    url: &str,
    k: &str,
    (a, b): (Caller<'_>, Caller<'_>),
) {
    let first_a = post_as(c, url, k, a, "{}").await;
    let first_b = post_as(c, url, k, b, "{}").await;
    assert_eq!((first_a.status, first_b.status), (201, 201));
    assert!(
        !first_a.replayed() && !first_b.replayed(),
        "b got a's response"
    );
    assert_ne!(first_a.body, first_b.body);
    assert_eq!(up.hits(), 2, "two callers, two executions");
    let again_a = post_as(c, url, k, a, "{}").await;
    let again_b = post_as(c, url, k, b, "{}").await;
    assert!(again_a.replayed() && again_b.replayed());
    assert_eq!(again_a.body, first_a.body);
    assert_eq!(again_b.body, first_b.body);
    assert_eq!(up.hits(), 2, "the same caller again: replayed");
}

/// Two copies of one keyed POST to `url`, `gap` apart, while the first
/// runs: the first runs (200), the copy is refused as in flight, and the
/// upstream ran once.
async fn assert_copy_refused_while_running(label: &str, url: &str, gap: Duration) {
    let Rig { up, gw, c } = rig(|_| {}).await;
    let (a, b) = two_copies(&c, &gw.url(url), &key(label), gap).await;
    assert_eq!(a.status, 200);
    assert!(!a.replayed());
    assert_in_flight(&b);
    assert_eq!(up.hits(), 1);
}

/// POSTs `{}` with key `k` to `url` twice: the first runs and answers
/// `status`, the second replays it (status, body and, when given, content
/// type) without a second execution. Returns the first.
async fn assert_replayed(
    Rig { up, gw, c }: &Rig,
    url: &str,
    k: &str,
    status: u16,
    content_type: Option<&str>,
) -> Got {
    let first = post(c, &gw.url(url), Some(k), "{}").await;
    assert_eq!(first.status, status, "{}", first.text());
    assert!(!first.replayed());
    let again = post(c, &gw.url(url), Some(k), "{}").await;
    assert!(
        again.replayed(),
        "the response was not stored: {}",
        again.status
    );
    assert_eq!(again.status, status);
    assert_eq!(again.body, first.body);
    if let Some(ct) = content_type {
        assert_eq!(again.header("content-type").as_deref(), Some(ct));
    }
    assert_eq!(up.hits(), 1);
    first
}

/// A keyed POST to the raw upstream's /pay fails with 502
/// `upstream-failed` after one execution, and the key is then held: a copy
/// gets 409 and does not run. Returns the 502.
async fn assert_failed_and_held(
    c: &reqwest::Client,
    gw: &TestGateway,
    raw: &RawUpstream,
    k: &str,
) -> Got {
    let a = post(c, &gw.url("/pay"), Some(k), "{}").await;
    assert_eq!(a.status, 502, "{}", a.text());
    assert_eq!(a.problem_type(), "urn:idem:problem:upstream-failed");
    assert_eq!(raw.hits(), 1);
    // The request was sent: its effect is unknown, so the key is held and
    // nothing runs again inside the lease.
    assert_held(&post(c, &gw.url("/pay"), Some(k), "{}").await);
    assert_eq!(raw.hits(), 1);
    a
}

/// A raw upstream that writes `answer` and closes the socket, and a
/// gateway in front of it with a 5 s lease.
async fn breaking_rig(answer: &[u8]) -> (RawUpstream, TestGateway) {
    raw_rig(RawAction::WriteAndClose(answer.to_vec()), |c| {
        c.layer.lease = Duration::from_secs(5);
        // The lease must be longer than the store timeout (5 s by default).
        c.store_options.timeout = Duration::from_secs(2);
    })
    .await
}

/// 409 `held`: the first request's outcome is unknown (a `reason` member,
/// `Retry-After` whole seconds).
fn assert_held(r: &Got) {
    assert_eq!(r.status, 409, "{}", r.text());
    assert_eq!(r.problem_type(), "urn:idem:problem:held", "{}", r.text());
    assert!(r.json()["reason"].is_string(), "{}", r.text());
    let secs: u64 = r
        .header("retry-after")
        .expect("409 carries Retry-After")
        .parse()
        .expect("Retry-After is whole seconds");
    assert!(secs >= 1, "Retry-After {secs}");
}

fn assert_in_flight(r: &Got) {
    assert_eq!(r.status, 409, "{}", r.text());
    assert_eq!(r.problem_type(), "urn:idem:problem:in-flight");
    let secs: u64 = r
        .header("retry-after")
        .expect("409 carries Retry-After")
        .parse()
        .expect("Retry-After is whole seconds");
    assert!(secs >= 1, "Retry-After {secs}");
}

#[tokio::test]
async fn fifty_concurrent_duplicates_execute_once() {
    let Rig { up, gw, c } = rig(|_| {}).await;
    let k = key("fifty");
    let url = gw.url("/slow?ms=300");
    let mut tasks = Vec::new();
    for _ in 0..50 {
        let (c, url, k) = (c.clone(), url.clone(), k.clone());
        tasks.push(tokio::spawn(async move {
            post(&c, &url, Some(&k), r#"{"amount":10}"#).await
        }));
    }
    let mut originals = 0;
    let mut conflicts = 0;
    let mut replays = 0;
    for t in tasks {
        let r = t.await.unwrap();
        match r.status {
            200 => {
                assert_eq!(r.text(), "slow 1");
                if r.replayed() {
                    replays += 1;
                } else {
                    originals += 1;
                }
            }
            409 => {
                assert_in_flight(&r);
                conflicts += 1;
            }
            s => panic!("unexpected {s}: {}", r.text()),
        }
    }
    assert_eq!(up.hits(), 1);
    assert_eq!(originals, 1);
    assert_eq!(originals + conflicts + replays, 50);
    // After it finished, a duplicate is a replay.
    let r = post(&c, &url, Some(&k), r#"{"amount":10}"#).await;
    assert!(r.replayed());
    assert_eq!(r.text(), "slow 1");
    assert_eq!(up.hits(), 1);
}

/// One test per case of [`assert_copy_refused_while_running`]: name, key
/// label, the slow route, the gap between the copies.
macro_rules! copy_refused_while_running {
    ($($name:ident: $label:literal, $url:literal, $gap:expr;)*) => {$(
        #[tokio::test]
        async fn $name() {
            assert_copy_refused_while_running($label, $url, $gap).await;
        }
    )*};
}

copy_refused_while_running! {
    a1_two_concurrent_copies_run_once_and_the_other_gets_409:
        "a1", "/slow?ms=500", Duration::from_millis(100);
    a2_duplicate_during_a_three_second_call_gets_409:
        "a2", "/slow?ms=3000", Duration::from_secs(1);
}

#[tokio::test]
async fn a1_in_wait_mode_the_duplicate_gets_the_replay() {
    let Rig { up, gw, c } = rig(|c| c.layer.wait = Duration::from_secs(3)).await;
    let k = key("a1-wait");
    let url = gw.url("/slow?ms=500");
    let (a, b) = two_copies(&c, &url, &k, Duration::from_millis(100)).await;
    assert_eq!(
        (a.status, b.status),
        (200, 200),
        "{} / {}",
        a.text(),
        b.text()
    );
    assert!(!a.replayed());
    assert!(b.replayed());
    assert_eq!(a.body, b.body);
    assert_eq!(up.hits(), 1);
}

#[tokio::test]
async fn d1_replay_keeps_status_location_etag_cookies_and_body() {
    let Rig { up, gw, c } = rig(|_| {}).await;
    let k = key("d1");
    let first = post(&c, &gw.url("/orders"), Some(&k), r#"{"item":"book"}"#).await;
    assert_eq!(first.status, 201);
    assert_eq!(first.header("location").as_deref(), Some("/orders/1"));
    assert_eq!(first.header("etag").as_deref(), Some("\"v1\""));
    assert_eq!(
        first.all("set-cookie"),
        vec!["a=1; Path=/", "b=2; HttpOnly"]
    );
    assert!(!first.replayed(), "the original is not marked as a replay");
    assert_eq!(first.json(), serde_json::json!({"order": 1}));

    let again = post(&c, &gw.url("/orders"), Some(&k), r#"{"item":"book"}"#).await;
    assert_eq!(again.status, 201);
    assert!(again.replayed());
    assert_eq!(again.stable_headers(), first.stable_headers());
    assert_eq!(again.body, first.body);
    assert_eq!(up.hits(), 1);
}

#[tokio::test]
async fn binary_bodies_replay_byte_for_byte() {
    let rig = rig(|_| {}).await;
    let ct = Some("application/octet-stream");
    let first = assert_replayed(&rig, "/binary", &key("bin"), 200, ct).await;
    assert!(
        std::str::from_utf8(&first.body).is_err(),
        "the test body must not be UTF-8"
    );
}

#[tokio::test]
async fn b3_chunked_upstream_response_is_stored() {
    let rig = rig_with(MemoryStore::new(), |_| {}).await;
    let first = assert_replayed(&rig, "/chunked", &key("b3"), 200, None).await;
    assert_eq!(
        first.text(),
        "chunk0-of-execution-1;chunk1-of-execution-1;chunk2-of-execution-1;"
    );
}

#[tokio::test]
async fn c1_5xx_is_not_stored_and_a_retry_runs_once_more() {
    let Rig { up, gw, c } = rig(|_| {}).await;
    let k = key("c1");
    let a = post(&c, &gw.url("/status/500"), Some(&k), "{}").await;
    assert_eq!(a.status, 500);
    assert_eq!(a.json()["execution"], 1);
    let b = post(&c, &gw.url("/status/500"), Some(&k), "{}").await;
    assert_eq!(b.status, 500);
    assert!(!b.replayed());
    assert_eq!(b.json()["execution"], 2);
    assert_eq!(up.hits(), 2);
    // 503 and 429 are released too.
    for code in [503, 429] {
        let k = key("c1-released");
        post(&c, &gw.url(&format!("/status/{code}")), Some(&k), "{}").await;
        let r = post(&c, &gw.url(&format!("/status/{code}")), Some(&k), "{}").await;
        assert!(!r.replayed(), "{code} was stored");
    }
}

/// A released 5xx is kept (`--share-failure`, default 1 s) only for the
/// duplicates that waited for it (next test): a client's own retry right
/// after it is not given the failure — it waits out the window and runs
/// again. 503 and 429 are released too.
#[tokio::test]
async fn a_retry_after_a_shared_5xx_waits_out_its_window_and_runs() {
    let Rig { up, gw, c } = rig(|_| {}).await;
    let k = key("c1");
    let a = post(&c, &gw.url("/status/500"), Some(&k), "{}").await;
    assert_eq!(a.status, 500);
    assert_eq!(a.json()["execution"], 1);
    assert!(!a.replayed());
    let started = Instant::now();
    let b = post(&c, &gw.url("/status/500"), Some(&k), "{}").await;
    assert_eq!(b.status, 500);
    assert!(!b.replayed(), "a later retry got the shared failure");
    assert_eq!(b.json()["execution"], 2);
    assert_eq!(up.hits(), 2);
    assert!(
        started.elapsed() < Duration::from_millis(2500),
        "the retry waited longer than twice the window: {:?}",
        started.elapsed()
    );
    for code in [503, 429] {
        let k = key("c1-released");
        post(&c, &gw.url(&format!("/status/{code}")), Some(&k), "{}").await;
        let r = post(&c, &gw.url(&format!("/status/{code}")), Some(&k), "{}").await;
        assert!(!r.replayed(), "{code} was stored");
    }
}

/// The wait of a later retry for a shared failure's window is bounded
/// (twice `--share-failure`): when the shared answer outlives that — here a
/// store clock that stands still, as a longer window of another instance
/// would — the retry gets it (with `Retry-After`) instead of hanging; once
/// the window has passed, a retry runs.
#[tokio::test]
async fn a_later_retry_waits_at_most_twice_the_window() {
    let clock = idem_core::ManualClock::starting_now();
    let Rig { up, gw, c } = rig_with(MemoryStore::new().with_clock(clock.clone()), |c| {
        c.layer.share_failure = Duration::from_secs(1);
    })
    .await;
    let k = key("c1-bound");
    let a = post(&c, &gw.url("/status/500"), Some(&k), "{}").await;
    assert_eq!((a.status, a.replayed()), (500, false));
    let started = Instant::now();
    let shared = post(&c, &gw.url("/status/500"), Some(&k), "{}").await;
    let waited = started.elapsed();
    assert_eq!(shared.status, 500);
    assert!(shared.replayed());
    assert_eq!(shared.json()["execution"], 1);
    assert_eq!(shared.header("retry-after").as_deref(), Some("1"));
    assert!(
        waited >= Duration::from_millis(1900) && waited < Duration::from_secs(5),
        "waited {waited:?}"
    );
    clock.advance(Duration::from_millis(1001));
    let b = post(&c, &gw.url("/status/500"), Some(&k), "{}").await;
    assert_eq!((b.status, b.replayed()), (500, false));
    assert_eq!(b.json()["execution"], 2);
    assert_eq!(up.hits(), 2);
}

/// Issue 16: with `--wait 5s` and an upstream that does its work and then
/// answers 500, 20 concurrent duplicates used to cause 16 to 17 executions
/// (each waiter woke to a released key and ran it again). They share the
/// one execution's answer now (the default `--share-failure 1s`); with
/// `--share-failure 0` the old behaviour is back, which shows the test can
/// fail.
#[tokio::test]
async fn waiters_share_a_5xx_instead_of_running_it_again() {
    for (share, most) in [(Duration::from_secs(1), 1), (Duration::ZERO, 20)] {
        let Rig { up, gw, .. } = rig(|c| {
            c.layer.wait = Duration::from_secs(5);
            c.layer.share_failure = share;
        })
        .await;
        let k = key("wait-500");
        let url = gw.url("/status/500?ms=100");
        let answers = futures::future::join_all((0..20).map(|_| {
            let (url, k) = (url.clone(), k.clone());
            async move { post(&client(), &url, Some(&k), "{}").await }
        }))
        .await;
        for a in &answers {
            assert_eq!(a.status, 500, "{}", a.text());
        }
        if most == 1 {
            assert_eq!(up.hits(), 1, "one execution for 20 waiting duplicates");
            let replays = answers.iter().filter(|a| a.replayed()).count();
            assert_eq!(replays, 19);
            assert!(answers.iter().all(|a| a.json()["execution"] == 1));
        } else {
            assert!(up.hits() > 1, "without sharing the waiters run it again");
        }
    }
}

#[tokio::test]
async fn c1_connection_broken_before_an_answer_holds_the_key_for_its_lease_then_runs_once_more() {
    let (raw, gw) = raw_rig(RawAction::CloseWithoutAnswer, |c| {
        c.layer.lease = Duration::from_secs(1);
        c.store_options.timeout = Duration::from_millis(500);
    })
    .await;
    let c = client();
    let k = key("c1-broken");
    assert_failed_and_held(&c, &gw, &raw, &k).await;
    tokio::time::sleep(Duration::from_millis(1300)).await;
    let d = post(&c, &gw.url("/pay"), Some(&k), "{}").await;
    assert_eq!(d.status, 502);
    assert_eq!(
        raw.hits(),
        2,
        "after the lease a retry runs exactly once more"
    );
}

#[tokio::test]
async fn reset_mid_response_headers_is_a_held_502() {
    // The upstream starts an answer and closes the socket half-way through its head.
    let (raw, gw) = breaking_rig(b"HTTP/1.1 200 OK\r\nContent-Ty").await;
    let c = client();
    assert_failed_and_held(&c, &gw, &raw, &key("reset")).await;
}

#[tokio::test]
async fn reset_mid_response_body_holds_the_key() {
    // Headers and part of the body arrive, then the upstream closes the socket.
    let (raw, gw) = breaking_rig(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial").await;
    let c = client();
    // The body broke while the layer buffered it for the store, before a
    // byte was sent: the first caller gets a complete 502 problem, not the
    // upstream's 200 with a truncated body, and the key is held: the
    // upstream may have acted.
    let a = assert_failed_and_held(&c, &gw, &raw, &key("reset-body")).await;
    assert_eq!(
        a.header("content-type").as_deref(),
        Some("application/problem+json")
    );
    let detail = a.json()["detail"].as_str().unwrap_or("").to_owned();
    assert!(
        detail.contains("unknown") && detail.contains("lease"),
        "{detail}"
    );
    assert!(!a.text().contains("partial"), "the partial body leaked");
}

#[tokio::test]
async fn reset_mid_response_body_past_the_retention_limit_truncates_and_completes() {
    // 40 bytes of a promised 100, over a 16-byte retention limit: the layer
    // has completed the key and started streaming before the break, so the
    // first caller sees a truncated body and a duplicate gets 410.
    let mut answer = b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n".to_vec();
    answer.extend_from_slice(&[b'x'; 40]);
    let (raw, gw) = raw_rig(RawAction::WriteAndClose(answer), |c| {
        c.layer.retention_limit = 16
    })
    .await;
    let c = client();
    let k = key("reset-big");
    let resp = c
        .post(gw.url("/pay"))
        .header("idempotency-key", &k)
        .header("content-type", "application/json")
        .body("{}")
        .send()
        .await;
    if let Ok(resp) = resp {
        assert_eq!(resp.status().as_u16(), 200);
        assert!(resp.bytes().await.is_err(), "the stream was cut short");
    }
    let dup = post(&c, &gw.url("/pay"), Some(&k), "{}").await;
    assert_eq!(dup.status, 410, "{}", dup.text());
    assert_eq!(dup.problem_type(), "urn:idem:problem:response-not-retained");
    assert_eq!(raw.hits(), 1);
}

#[tokio::test]
async fn scope_header_flag_keeps_api_keys_apart() {
    use clap::Parser;
    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        g: idem_gateway::GatewayArgs,
    }
    let up = upstream().await;
    let url = up.url();
    let cli = Cli::try_parse_from([
        "idem",
        "--upstream",
        url.as_str(),
        "--store",
        "memory://",
        "--listen",
        "127.0.0.1:0",
        "--admin-listen",
        "off",
        "--scope-header",
        "X-Api-Key",
    ])
    .expect("--scope-header is a flag");
    let config = cli.g.into_config().unwrap();
    let gw = gateway_with(config, Arc::new(MemoryStore::new())).await;
    let c = client();
    let k = key("scope-header");
    // The same Authorization: not part of the scope any more.
    let callers: (Caller, Caller) = (
        &[("x-api-key", "key-a"), ("authorization", "Bearer shared")],
        &[("x-api-key", "key-b"), ("authorization", "Bearer shared")],
    );
    assert_callers_kept_apart(&c, &up, &gw.url("/orders"), &k, callers).await;
}

#[tokio::test]
async fn c2_406_is_replayed_as_406_with_its_body() {
    let rig = rig(|_| {}).await;
    let ct = Some("application/json");
    assert_replayed(&rig, "/status/406", &key("c2"), 406, ct).await;
}

#[tokio::test]
async fn d2_client_gone_before_the_answer_still_stores_it() {
    let up = upstream().await;
    let gw = gateway(&up.url(), |_| {}).await;
    let k = key("d2");
    give_up_on(&gw.url("/slow?ms=500"), &k, 150).await;
    // The upstream call goes on and its result is stored: retries see 409
    // until it lands, then the replay.
    let deadline = Instant::now() + Duration::from_secs(10);
    let r = loop {
        let r = post(&client(), &gw.url("/slow?ms=500"), Some(&k), "{}").await;
        if r.status != 409 || Instant::now() > deadline {
            break r;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(
        r.replayed(),
        "the result was not stored after the client left"
    );
    assert_eq!(r.text(), "slow 1");
    assert_eq!(up.hits(), 1);
}

#[tokio::test]
async fn d2_client_gone_mid_request_body_never_reaches_the_upstream() {
    let up = upstream().await;
    let gw = gateway(&up.url(), |_| {}).await;
    let k = key("d2-body");
    let mut s = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    let head = format!(
        "POST /orders HTTP/1.1\r\nHost: gw\r\nIdempotency-Key: {k}\r\n\
         Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{{\"item\":"
    );
    s.write_all(head.as_bytes()).await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    drop(s);
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(up.hits(), 0, "a partial body was forwarded");
    let r = post(&client(), &gw.url("/orders"), Some(&k), r#"{"item":"x"}"#).await;
    assert_eq!(r.status, 201, "{}", r.text());
    assert!(!r.replayed());
    assert_eq!(up.hits(), 1);
}

#[tokio::test]
async fn e1_requests_without_a_key_pass_through_and_blank_keys_are_400() {
    let mem = MemoryStore::new();
    let Rig { up, gw, c } = rig_with(mem.clone(), |_| {}).await;
    let a = post(&c, &gw.url("/orders"), None, "{}").await;
    let b = post(&c, &gw.url("/orders"), None, "{}").await;
    assert_eq!((a.status, b.status), (201, 201));
    assert_eq!(up.hits(), 2);
    assert!(mem.is_empty(), "a request without a key touched the store");
    for blank in ["", "   ", "\"\"", "\"  \""] {
        let r = post(&c, &gw.url("/orders"), Some(blank), "{}").await;
        assert_eq!(r.status, 400, "key {blank:?}: {}", r.text());
        assert_eq!(r.problem_type(), "urn:idem:problem:invalid-key");
    }
    assert_eq!(up.hits(), 2);
    assert!(mem.is_empty());
}

#[tokio::test]
async fn malformed_keys_are_400_and_never_reach_the_upstream() {
    let Rig { up, gw, c } = rig(|_| {}).await;
    for bad in ["\"abc", "\"a\"b\"", &"x".repeat(256), "a\tb"] {
        let r = post(&c, &gw.url("/orders"), Some(bad), "{}").await;
        assert_eq!(r.status, 400, "key {bad:?}: {}", r.text());
        assert_eq!(
            r.header("content-type").as_deref(),
            Some("application/problem+json")
        );
    }
    // Two key fields.
    let mut h = HeaderMap::new();
    h.append("idempotency-key", HeaderValue::from_static("one"));
    h.append("idempotency-key", HeaderValue::from_static("two"));
    let r = read(
        c.post(gw.url("/orders"))
            .headers(h)
            .body("{}")
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(r.status, 400);
    assert_eq!(r.problem_type(), "urn:idem:problem:multiple-keys");
    assert_eq!(up.hits(), 0);

    // 255 characters is fine, and "k" as an sf-string is the same key as k.
    let long = format!("{}-{}", key("l"), "y".repeat(200));
    let long = &long[..255.min(long.len())];
    assert_eq!(
        post(&c, &gw.url("/orders"), Some(long), "{}").await.status,
        201
    );
    let k = key("sf");
    let a = post(&c, &gw.url("/orders"), Some(&k), "{}").await;
    let b = post(&c, &gw.url("/orders"), Some(&format!("\"{k}\"")), "{}").await;
    assert_eq!(a.status, 201);
    assert!(b.replayed(), "an sf-string key differs from its bare token");
    assert_eq!(up.hits(), 2);
}

#[tokio::test]
async fn e2_same_key_on_another_path_body_or_method_is_422() {
    let Rig { up, gw, c } = rig(|_| {}).await;
    let k = key("e2");
    let a = post(&c, &gw.url("/orders"), Some(&k), r#"{"n":1}"#).await;
    assert_eq!(a.status, 201);
    let other_path = post(&c, &gw.url("/refunds"), Some(&k), r#"{"n":1}"#).await;
    assert_eq!(other_path.status, 422, "{}", other_path.text());
    assert_eq!(other_path.problem_type(), "urn:idem:problem:key-mismatch");
    let other_body = post(&c, &gw.url("/orders"), Some(&k), r#"{"n":2}"#).await;
    assert_eq!(other_body.status, 422);
    let other_method = send_json(
        &c,
        Method::PATCH,
        &gw.url("/orders"),
        Some(&k),
        r#"{"n":1}"#,
    )
    .await;
    assert_eq!(other_method.status, 422);
    let other_query = post(&c, &gw.url("/orders?x=1"), Some(&k), r#"{"n":1}"#).await;
    assert_eq!(other_query.status, 422);
    assert_eq!(up.hits(), 1);

    // While the original is still in flight, a different request is 422 too.
    let k = key("e2-inflight");
    let url = gw.url("/slow?ms=500");
    let (x, y) = tokio::join!(post(&c, &url, Some(&k), "{}"), async {
        tokio::time::sleep(Duration::from_millis(100)).await;
        post(&c, &gw.url("/orders"), Some(&k), "{}").await
    });
    assert_eq!(x.status, 200);
    assert_eq!(y.status, 422);
}

#[tokio::test]
async fn e3_callers_with_different_credentials_do_not_share_keys() {
    let Rig { up, gw, c } = rig(|_| {}).await;
    let k = key("e3");
    let callers: (Caller, Caller) = (
        &[("authorization", "Bearer alice")],
        &[("authorization", "Bearer bob")],
    );
    assert_callers_kept_apart(&c, &up, &gw.url("/orders"), &k, callers).await;
}

#[tokio::test]
async fn f1_after_the_ttl_the_same_key_runs_again() {
    let Rig { up, gw, c } = rig(|c| {
        c.layer.ttl = Duration::from_secs(1);
        c.layer.lease = Duration::from_secs(1);
        c.store_options.timeout = Duration::from_millis(500);
    })
    .await;
    let k = key("f1");
    assert_eq!(
        post(&c, &gw.url("/orders"), Some(&k), "{}").await.status,
        201
    );
    let r = post(&c, &gw.url("/orders"), Some(&k), "{}").await;
    assert!(r.replayed());
    tokio::time::sleep(Duration::from_millis(1300)).await;
    let r = post(&c, &gw.url("/orders"), Some(&k), "{}").await;
    assert_eq!(r.status, 201);
    assert!(!r.replayed(), "replayed past its TTL");
    assert_eq!(up.hits(), 2);
}

#[tokio::test]
async fn upstream_down_is_502_released_and_the_retry_runs_once_it_is_up() {
    let port = free_port(); // bound and closed: nothing listens there
    let gw = gateway(&format!("http://127.0.0.1:{port}"), |_| {}).await;
    let c = client();
    let k = key("down");
    let a = post(&c, &gw.url("/orders"), Some(&k), "{}").await;
    assert_eq!(a.status, 502, "{}", a.text());
    assert_eq!(a.problem_type(), "urn:idem:problem:upstream-unreachable");
    assert_eq!(
        a.header("content-type").as_deref(),
        Some("application/problem+json")
    );
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
        .await
        .unwrap();
    let up = upstream_on(listener).await;
    let b = post(&c, &gw.url("/orders"), Some(&k), "{}").await;
    assert_eq!(b.status, 201, "{}", b.text());
    assert!(!b.replayed());
    assert_eq!(up.hits(), 1);
    let again = post(&c, &gw.url("/orders"), Some(&k), "{}").await;
    assert!(again.replayed());
    assert_eq!(up.hits(), 1);
}

#[tokio::test]
async fn upstream_timeout_is_504_and_holds_the_key_until_its_lease_ends() {
    let Rig { up, gw, c } = rig(|c| {
        c.upstream_timeout = Duration::from_millis(300);
        c.layer.lease = Duration::from_secs(1);
        c.store_options.timeout = Duration::from_millis(500);
    })
    .await;
    let k = key("timeout");
    let url = gw.url("/slow-first?ms=3000");
    let t0 = Instant::now();
    let a = post(&c, &url, Some(&k), "{}").await;
    assert_eq!(a.status, 504, "{}", a.text());
    assert_eq!(a.problem_type(), "urn:idem:problem:upstream-timeout");
    assert_within(t0, Duration::from_secs(2), "the upstream timeout");
    // The first call may still land: no second execution inside the lease.
    let b = post(&c, &url, Some(&k), "{}").await;
    assert_held(&b);
    assert_eq!(b.json()["reason"], "timeout");
    assert_eq!(up.hits(), 1);
    tokio::time::sleep(Duration::from_millis(1300)).await;
    let d = post(&c, &url, Some(&k), "{}").await;
    assert_eq!(d.status, 200, "{}", d.text());
    assert_eq!(d.text(), "slow-first 2");
    assert_eq!(up.hits(), 2);
}

#[tokio::test]
async fn store_unavailable_is_503_and_the_upstream_is_not_called() {
    let (Rig { up, gw, c }, store) = faulty_rig(|_| {}).await;
    store.set_each(&BEGIN_AND_GET, Fault::Unavailable);
    let r = post(&c, &gw.url("/orders"), Some(&key("s503")), "{}").await;
    assert_eq!(r.status, 503, "{}", r.text());
    assert_eq!(r.problem_type(), "urn:idem:problem:store-unavailable");
    assert_eq!(
        up.hits(),
        0,
        "the upstream was called although the store failed"
    );
    assert!(store.calls(Op::Begin) >= 1);
    // Unguarded traffic does not need the store.
    assert_eq!(post(&c, &gw.url("/orders"), None, "{}").await.status, 201);
    store.clear_all();
    assert_eq!(
        post(&c, &gw.url("/orders"), Some(&key("s503-ok")), "{}")
            .await
            .status,
        201
    );
    assert_eq!(up.hits(), 2);
}

#[tokio::test]
async fn corrupt_record_is_500_and_the_gateway_keeps_serving() {
    let (Rig { up, gw, c }, store) = faulty_rig(|_| {}).await;
    store.set_each(&BEGIN_AND_GET, Fault::Corrupt(UNDECODABLE));
    let r = post(&c, &gw.url("/orders"), Some(&key("corrupt")), "{}").await;
    assert_eq!(r.status, 500, "{}", r.text());
    assert_eq!(r.problem_type(), "urn:idem:problem:corrupt-record");
    assert_eq!(up.hits(), 0);
    store.clear_all();
    let r = post(&c, &gw.url("/orders"), Some(&key("after-corrupt")), "{}").await;
    assert_eq!(r.status, 201);
    let r = fetch(&c, &gw.url("/_idem/health")).await;
    assert_eq!(r.status, 200);
}

/// The same two failures with a real SQLite file damaged behind the
/// gateway's back: a record whose response does not decode, then a table
/// that is gone.
#[tokio::test]
async fn sqlite_corrupt_record_is_500_and_a_broken_store_is_503() {
    let up = upstream().await;
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("idem.db");
    let mut cfg = config(&up.url());
    cfg.store = format!("sqlite://{}", db.display()).into();
    let gw = idem_gateway::Gateway::bind(cfg).await.unwrap();
    let addr = gw.local_addr();
    let serve = tokio::spawn(gw.serve(std::future::pending()));
    let url = |p: &str| format!("http://{addr}{p}");
    let c = client();
    let k = key("sqlite-corrupt");
    assert_eq!(post(&c, &url("/orders"), Some(&k), "{}").await.status, 201);

    let pool = sqlx::SqlitePool::connect(&format!("sqlite://{}", db.display()))
        .await
        .unwrap();
    let n = sqlx::query("UPDATE idem_records SET response = x'09' WHERE key = ?")
        .bind(&k)
        .execute(&pool)
        .await
        .unwrap()
        .rows_affected();
    assert_eq!(n, 1);
    let r = post(&c, &url("/orders"), Some(&k), "{}").await;
    assert_eq!(r.status, 500, "{}", r.text());
    assert_eq!(r.problem_type(), "urn:idem:problem:corrupt-record");
    // Other keys still work.
    assert_eq!(
        post(&c, &url("/orders"), Some(&key("sqlite-ok")), "{}")
            .await
            .status,
        201
    );
    assert_eq!(up.hits(), 2);

    sqlx::query("DROP TABLE idem_records")
        .execute(&pool)
        .await
        .unwrap();
    let r = post(&c, &url("/orders"), Some(&key("sqlite-gone")), "{}").await;
    assert_eq!(r.status, 503, "{}", r.text());
    assert_eq!(r.problem_type(), "urn:idem:problem:store-unavailable");
    assert_eq!(
        up.hits(),
        2,
        "the upstream was called although the store failed"
    );
    let r = fetch(&c, &url("/_idem/health")).await;
    assert_eq!(r.status, 503, "{}", r.text());
    serve.abort();
}

#[tokio::test]
async fn response_over_the_retention_limit_reaches_the_first_caller_only() {
    let Rig { up, gw, c } = rig(|c| c.layer.retention_limit = 1024).await;
    let k = key("large");
    let a = post(&c, &gw.url("/large?bytes=50000"), Some(&k), "{}").await;
    assert_eq!(a.status, 200);
    assert_eq!(a.body.len(), 50_000);
    let b = post(&c, &gw.url("/large?bytes=50000"), Some(&k), "{}").await;
    assert_eq!(b.status, 410, "{}", b.text());
    assert_eq!(b.problem_type(), "urn:idem:problem:response-not-retained");
    assert_eq!(
        up.hits(),
        1,
        "a duplicate of an oversized response ran again"
    );
}

#[tokio::test]
async fn require_key_refuses_guarded_requests_without_one() {
    let Rig { up, gw, c } = rig(|c| c.layer.require_key = true).await;
    let r = post(&c, &gw.url("/orders"), None, "{}").await;
    assert_eq!(r.status, 400);
    assert_eq!(r.problem_type(), "urn:idem:problem:key-required");
    assert_eq!(fetch(&c, &gw.url("/items")).await.status, 200);
    assert_eq!(up.hits(), 1);
}

#[tokio::test]
async fn put_is_guarded_only_when_configured() {
    let up = upstream().await;
    let c = client();
    let send = |url: String, k: String| {
        let c = c.clone();
        async move {
            read(
                c.put(url)
                    .header("idempotency-key", k)
                    .body("{}")
                    .send()
                    .await
                    .unwrap(),
            )
            .await
        }
    };
    let gw = gateway(&up.url(), |_| {}).await;
    let k = key("put");
    send(gw.url("/echo"), k.clone()).await;
    assert!(!send(gw.url("/echo"), k.clone()).await.replayed());
    assert_eq!(up.hits(), 2);
    let gw = gateway(&up.url(), |c| {
        c.layer.methods = vec![http::Method::POST, http::Method::PUT]
    })
    .await;
    send(gw.url("/echo"), k.clone()).await;
    assert!(send(gw.url("/echo"), k).await.replayed());
    assert_eq!(up.hits(), 3);
}
