//! Submit tokens through the gateway, over real sockets: `POST
//! /_idem/tokens` and `--require-token` routes (CASES I1).

mod common;

use std::time::Duration;

use common::*;

/// `POST /_idem/tokens` with optional `Authorization`.
async fn issue(c: &reqwest::Client, gw: &TestGateway, auth: Option<&str>) -> Got {
    let mut r = c.post(gw.url("/_idem/tokens"));
    if let Some(a) = auth {
        r = r.header("authorization", a);
    }
    read(r.send().await.unwrap()).await
}

async fn token(c: &reqwest::Client, gw: &TestGateway, auth: Option<&str>) -> String {
    let r = issue(c, gw, auth).await;
    assert_eq!(r.status, 201, "{}", r.text());
    r.json()["token"].as_str().expect("token").to_owned()
}

/// POSTs with a key and an `Authorization` field.
async fn post_as(c: &reqwest::Client, url: &str, key: Option<&str>, auth: &str) -> Got {
    let mut r = c
        .post(url)
        .header("content-type", "application/json")
        .header("authorization", auth)
        .body("{}");
    if let Some(k) = key {
        r = r.header("idempotency-key", k);
    }
    read(r.send().await.unwrap()).await
}

fn assert_problem(r: &Got, status: u16, kind: &str) {
    assert_eq!(r.status, status, "{}", r.text());
    assert_eq!(r.problem_type(), format!("urn:idem:problem:{kind}"));
    assert_eq!(
        r.header("content-type").as_deref(),
        Some("application/problem+json")
    );
}

#[tokio::test]
async fn issuing_a_token_answers_201_json() {
    let Rig { up, gw, c } = rig(|c| {
        c.layer.token_ttl = Duration::from_secs(600);
        c.issue_tokens = true;
    })
    .await;
    let r = issue(&c, &gw, Some("Bearer alice")).await;
    assert_eq!(r.status, 201, "{}", r.text());
    assert_eq!(
        r.header("content-type").as_deref(),
        Some("application/json")
    );
    assert_eq!(r.header("cache-control").as_deref(), Some("no-store"));
    let v = r.json();
    let t = v["token"].as_str().expect("token is a string");
    assert!(t.starts_with("tok_") && t.len() == 36, "{t}");
    assert_eq!(v["expires_in"], 600);
    assert_eq!(v.as_object().unwrap().len(), 2, "{v}");
    // Every token is new.
    let again = token(&c, &gw, Some("Bearer alice")).await;
    assert_ne!(again, t);
    // Only POST.
    let get = fetch(&c, &gw.url("/_idem/tokens")).await;
    assert_problem(&get, 405, "method-not-allowed");
    assert_eq!(get.header("allow").as_deref(), Some("POST"));
    assert_eq!(up.hits(), 0, "never proxied");
}

#[tokio::test]
async fn i1_two_concurrent_submits_with_one_token_run_once() {
    let Rig { up, gw, c } = rig(|c| c.layer.require_token = vec!["/slow".into()]).await;
    let t = token(&c, &gw, Some("Bearer alice")).await;
    let url = gw.url("/slow?ms=500");
    let (a, b) = tokio::join!(post_as(&c, &url, Some(&t), "Bearer alice"), async {
        tokio::time::sleep(Duration::from_millis(100)).await;
        post_as(&c, &url, Some(&t), "Bearer alice").await
    });
    let ok: Vec<&Got> = [&a, &b]
        .into_iter()
        .filter(|r| (200..300).contains(&r.status))
        .collect();
    assert_eq!(ok.len(), 1, "exactly one 2xx: {} / {}", a.status, b.status);
    let other = if (200..300).contains(&a.status) {
        &b
    } else {
        &a
    };
    assert_problem(other, 409, "in-flight");
    assert_eq!(up.hits(), 1, "one upstream call");
    // A later reuse replays.
    let later = post_as(&c, &url, Some(&t), "Bearer alice").await;
    assert_eq!(later.status, 200);
    assert!(later.replayed());
    assert_eq!(later.text(), "slow 1");
    assert_eq!(up.hits(), 1);
}

#[tokio::test]
async fn sixteen_concurrent_submits_with_one_token_run_once() {
    let Rig { up, gw, c } = rig(|c| {
        c.layer.require_token = vec!["/slow".into()];
        c.layer.anonymous_tokens = true;
    })
    .await;
    let t = token(&c, &gw, None).await;
    let url = gw.url("/slow?ms=300");
    let tasks: Vec<_> = (0..16)
        .map(|_| {
            let (c, url, t) = (c.clone(), url.clone(), t.clone());
            tokio::spawn(async move { post(&c, &url, Some(&t), "{}").await })
        })
        .collect();
    let (mut originals, mut others) = (0, 0);
    for task in tasks {
        let r = task.await.unwrap();
        match r.status {
            200 if !r.replayed() => originals += 1,
            200 => others += 1,
            409 => {
                assert_problem(&r, 409, "in-flight");
                others += 1;
            }
            s => panic!("unexpected {s}: {}", r.text()),
        }
    }
    assert_eq!(originals, 1);
    assert_eq!(others, 15);
    assert_eq!(up.hits(), 1);
}

#[tokio::test]
async fn unknown_expired_and_foreign_tokens_are_refused_and_never_reach_upstream() {
    let Rig { up, gw, c } = rig(|c| {
        c.layer.require_token = vec!["/orders".into()];
        c.layer.token_ttl = Duration::from_secs(1);
    })
    .await;
    let url = gw.url("/orders");
    // Well-formed but never issued; a plain idempotency key.
    for k in ["tok_0123456789abcdef0123456789abcdef", &key("plain")] {
        let r = post_as(&c, &url, Some(k), "Bearer alice").await;
        assert_problem(&r, 403, "token-unknown");
        // Refused again: nothing was left in flight.
        let r = post_as(&c, &url, Some(k), "Bearer alice").await;
        assert_problem(&r, 403, "token-unknown");
    }
    // Issued to bob: unknown for alice, usable by bob.
    let bobs = token(&c, &gw, Some("Bearer bob")).await;
    let r = post_as(&c, &url, Some(&bobs), "Bearer alice").await;
    assert_problem(&r, 403, "token-unknown");
    // Expired before its first use (TTL 1 s, used after 2.5 s).
    let alices = token(&c, &gw, Some("Bearer alice")).await;
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let r = post_as(&c, &url, Some(&alices), "Bearer alice").await;
    assert_problem(&r, 403, "token-unknown");
    assert_eq!(up.hits(), 0, "the upstream was never called");
    // Bob's token has expired too by now; a fresh one works.
    let fresh = token(&c, &gw, Some("Bearer bob")).await;
    let r = post_as(&c, &url, Some(&fresh), "Bearer bob").await;
    assert_eq!(r.status, 201, "{}", r.text());
    assert_eq!(up.hits(), 1);
}

#[tokio::test]
async fn a_required_route_without_a_key_is_refused() {
    let Rig { up, gw, c } = rig(|c| c.layer.require_token = vec!["/orders".into()]).await;
    let r = post(&c, &gw.url("/orders"), None, "{}").await;
    assert_problem(&r, 428, "token-required");
    let r = post(&c, &gw.url("/orders/7"), None, "{}").await;
    assert_problem(&r, 428, "token-required");
    assert_eq!(up.hits(), 0);
}

#[tokio::test]
async fn routes_outside_the_prefixes_work_as_before() {
    let Rig { up, gw, c } = rig(|c| c.layer.require_token = vec!["/slow".into()]).await;
    // No key: passes through unguarded.
    let r = post(&c, &gw.url("/orders"), None, "{}").await;
    assert_eq!(r.status, 201, "{}", r.text());
    // Any key: ordinary idempotency.
    let k = key("plain");
    let a = post(&c, &gw.url("/orders"), Some(&k), "{}").await;
    let b = post(&c, &gw.url("/orders"), Some(&k), "{}").await;
    assert_eq!(a.status, 201);
    assert!(b.replayed());
    assert_eq!(a.body, b.body);
    assert_eq!(up.hits(), 2);
    // `/slowly` is not under `/slow`: proxied with any key.
    let r = post(&c, &gw.url("/slowly"), Some(&key("x")), "{}").await;
    assert!(
        !r.problem_type().starts_with("urn:idem:problem:token-"),
        "{}",
        r.text()
    );
    assert_eq!(up.hits(), 3, "reached the upstream");
}

#[tokio::test]
async fn issuing_with_the_store_down_is_503() {
    let (Rig { up: _up, gw, c }, store) = faulty_rig(|c| c.issue_tokens = true).await;
    store.set_each(&BEGIN_AND_GET, Fault::Unavailable);
    let r = issue(&c, &gw, Some("Bearer alice")).await;
    assert_problem(&r, 503, "store-unavailable");
    store.clear_all();
    let r = issue(&c, &gw, Some("Bearer alice")).await;
    assert_eq!(r.status, 201, "{}", r.text());
}

#[tokio::test]
async fn a_token_route_never_fails_open() {
    let (Rig { up, gw, c }, store) = faulty_rig(|cfg| {
        cfg.fail_open = true;
        cfg.layer.require_token = vec!["/orders".into()];
        cfg.layer.anonymous_tokens = true;
    })
    .await;
    let t = token(&c, &gw, None).await;
    store.set_each(&BEGIN_AND_GET, Fault::Unavailable);
    let r = post(&c, &gw.url("/orders"), Some(&t), "{}").await;
    assert_problem(&r, 503, "store-unavailable");
    assert_eq!(up.hits(), 0);
    store.clear_all();
    let r = post(&c, &gw.url("/orders"), Some(&t), "{}").await;
    assert_eq!(r.status, 201, "{}", r.text());
}

#[tokio::test]
async fn without_a_token_route_the_endpoint_is_off() {
    let Rig { up, gw, c } = rig(|_| {}).await;
    for auth in [None, Some("Bearer alice")] {
        let r = issue(&c, &gw, auth).await;
        assert_problem(&r, 404, "not-found");
    }
    let r = fetch(&c, &gw.url("/_idem/tokens")).await;
    assert_problem(&r, 404, "not-found");
    assert_eq!(up.hits(), 0, "never proxied");
}

#[tokio::test]
async fn issuing_needs_a_scope_header() {
    let Rig { up: _up, gw, c } = rig(|c| c.layer.require_token = vec!["/orders".into()]).await;
    let r = issue(&c, &gw, None).await;
    assert_problem(&r, 400, "scope-required");
    assert!(r.text().contains("authorization"), "{}", r.text());
    assert_eq!(issue(&c, &gw, Some("Bearer alice")).await.status, 201);
}

#[tokio::test]
async fn used_tokens_stop_counting_against_the_scope_cap() {
    let Rig { up, gw, c } = rig(|c| {
        c.layer.require_token = vec!["/orders".into()];
        c.layer.tokens_per_scope = 2;
        c.layer.max_live_tokens = 3;
    })
    .await;
    let a = token(&c, &gw, Some("Bearer alice")).await;
    let _b = token(&c, &gw, Some("Bearer alice")).await;
    let r = issue(&c, &gw, Some("Bearer alice")).await;
    assert_problem(&r, 429, "too-many-tokens");
    let secs: u64 = r.header("retry-after").unwrap().parse().unwrap();
    assert!((1..=3600).contains(&secs), "{secs}");
    // A token sent from another scope is refused and still counts.
    let r = post_as(&c, &gw.url("/orders"), Some(&a), "Bearer mallory").await;
    assert_problem(&r, 403, "token-unknown");
    assert_problem(
        &issue(&c, &gw, Some("Bearer alice")).await,
        429,
        "too-many-tokens",
    );
    // Used by its owner: room again.
    let r = post_as(&c, &gw.url("/orders"), Some(&a), "Bearer alice").await;
    assert_eq!(r.status, 201, "{}", r.text());
    let _c = token(&c, &gw, Some("Bearer alice")).await;
    // The gateway-wide cap (3 live: _b, _c and bob's).
    let _bob = token(&c, &gw, Some("Bearer bob")).await;
    let r = issue(&c, &gw, Some("Bearer carol")).await;
    assert_problem(&r, 429, "too-many-tokens");
    assert!(r.text().contains("in all"), "{}", r.text());
    assert_eq!(up.hits(), 1);
}
