//! Issue 11, items 3 and 4, through the real `idem` binary: settings that
//! void the guarantee are refused at start, and submit tokens cannot be
//! used to fill the store.

mod support;

use std::time::{Duration, Instant};

use support::*;

/// Runs `idem gateway ARGS` and expects it to refuse to start: exit code
/// and stderr. A gateway that starts instead is killed after a bound.
fn refused(args: &[&str]) -> (Option<i32>, String) {
    let dir = tempfile::tempdir().unwrap();
    let err = dir.path().join("stderr");
    let mut child = idem()
        .arg("gateway")
        .args(["--listen", "127.0.0.1:0"])
        .args(args)
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&err).unwrap())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "{args:?}: the gateway started instead of refusing:\n{}",
                std::fs::read_to_string(&err).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    (status.code(), std::fs::read_to_string(&err).unwrap())
}

#[test]
fn leases_that_cannot_protect_anything_are_refused_at_start() {
    let up = "http://127.0.0.1:9";
    let cases: &[(&[&str], &str)] = &[
        (&["--lease", "1ns"], "--lease"),
        (&["--lease", "999us"], "--lease"),
        (&["--lease", "1ms"], "--lease"),
        (
            &["--lease", "1s", "--store-timeout", "1s"],
            "--store-timeout",
        ),
        (&["--lease", "3s"], "--store-timeout"), // the default store timeout is 5 s
        (&["--ttl", "500ms", "--lease", "1s"], "--ttl"),
    ];
    for (args, flag) in cases {
        let mut all = vec!["--upstream", up, "--store", "memory://"];
        all.extend_from_slice(args);
        let (code, stderr) = refused(&all);
        assert_eq!(code, Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(flag), "{args:?}: {flag} not in {stderr}");
        assert!(stderr.contains("--lease"), "{args:?}: {stderr}");
    }
}

#[tokio::test]
async fn the_floor_itself_is_accepted() {
    let dir = tempfile::tempdir().unwrap();
    let up = Upstream::start().await;
    let gw = memory_gateway(
        dir.path(),
        "floor",
        &up,
        &["--lease", "1s", "--store-timeout", "500ms"],
    )
    .await;
    let c = reqwest::Client::new();
    let r = pay(&c, &gw.url("/pay"), &unique("floor")).await.unwrap();
    assert_eq!(r.status, 201, "{}", r.body);
}

/// `POST /_idem/tokens`, with `Authorization: Bearer <who>` unless `None`.
async fn issue(
    c: &reqwest::Client,
    gw: &GatewayProc,
    who: Option<&str>,
) -> (u16, Option<String>, serde_json::Value) {
    let mut r = c.post(gw.url("/_idem/tokens"));
    if let Some(w) = who {
        r = r.header("authorization", format!("Bearer {w}"));
    }
    let r = r.send().await.unwrap();
    let status = r.status().as_u16();
    let retry = r
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let body = r.bytes().await.unwrap();
    (
        status,
        retry,
        serde_json::from_slice(&body).unwrap_or(serde_json::Value::Null),
    )
}

/// A guarded submit with `token` as the key, as `who`.
async fn submit(c: &reqwest::Client, gw: &GatewayProc, who: &str, token: &str) -> u16 {
    c.post(gw.url("/pay"))
        .header("authorization", format!("Bearer {who}"))
        .header("idempotency-key", token)
        .header("content-type", "application/json")
        .body("{}")
        .send()
        .await
        .unwrap()
        .status()
        .as_u16()
}

fn kind(v: &serde_json::Value) -> &str {
    v["type"].as_str().unwrap_or("")
}

#[tokio::test]
async fn the_token_endpoint_is_off_without_a_token_route() {
    let dir = tempfile::tempdir().unwrap();
    let up = Upstream::start().await;
    let gw = memory_gateway(dir.path(), "off", &up, &[]).await;
    let c = reqwest::Client::new();
    for who in [None, Some("alice")] {
        let (status, _, v) = issue(&c, &gw, who).await;
        assert_eq!(status, 404, "{v}");
        assert_eq!(kind(&v), "urn:idem:problem:not-found", "{v}");
    }
    // `--issue-tokens` turns it on without a token route.
    let on = memory_gateway(dir.path(), "on", &up, &["--issue-tokens"]).await;
    let (status, _, v) = issue(&c, &on, Some("alice")).await;
    assert_eq!(status, 201, "{v}");
    assert_eq!(up.total(), 0);
}

#[tokio::test]
async fn issuing_needs_a_scope_unless_anonymous_tokens_are_allowed() {
    let dir = tempfile::tempdir().unwrap();
    let up = Upstream::start().await;
    let gw = memory_gateway(dir.path(), "scoped", &up, &["--require-token", "/pay"]).await;
    let c = reqwest::Client::new();
    let (status, _, v) = issue(&c, &gw, None).await;
    assert_eq!(status, 400, "{v}");
    assert_eq!(kind(&v), "urn:idem:problem:scope-required", "{v}");
    let (status, _, v) = issue(&c, &gw, Some("alice")).await;
    assert_eq!(status, 201, "{v}");
    let anon = memory_gateway(
        dir.path(),
        "anon",
        &up,
        &["--require-token", "/pay", "--anonymous-tokens"],
    )
    .await;
    let (status, _, v) = issue(&c, &anon, None).await;
    assert_eq!(status, 201, "{v}");
}

#[tokio::test]
async fn a_flood_from_one_scope_stops_at_its_cap_and_others_still_get_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let up = Upstream::start().await;
    let gw = memory_gateway(
        dir.path(),
        "per-scope",
        &up,
        &[
            "--require-token",
            "/pay",
            "--tokens-per-scope",
            "5",
            "--token-ttl",
            "2s",
        ],
    )
    .await;
    let c = reqwest::Client::new();
    let mut alices = Vec::new();
    let mut refused = 0;
    for _ in 0..50 {
        let (status, retry, v) = issue(&c, &gw, Some("alice")).await;
        match status {
            201 => alices.push(v["token"].as_str().unwrap().to_owned()),
            429 => {
                assert_eq!(kind(&v), "urn:idem:problem:too-many-tokens", "{v}");
                let secs: u64 = retry.expect("Retry-After").parse().unwrap();
                assert!((1..=2).contains(&secs), "Retry-After {secs}");
                refused += 1;
            }
            s => panic!("{s}: {v}"),
        }
    }
    assert_eq!((alices.len(), refused), (5, 45));
    // Another caller is not affected.
    let (status, _, v) = issue(&c, &gw, Some("bob")).await;
    assert_eq!(status, 201, "{v}");
    // A token used by a submit stops counting.
    assert_eq!(submit(&c, &gw, "alice", &alices[0]).await, 201);
    assert_eq!(issue(&c, &gw, Some("alice")).await.0, 201);
    assert_eq!(issue(&c, &gw, Some("alice")).await.0, 429);
    // Expired tokens stop counting.
    tokio::time::sleep(Duration::from_millis(2200)).await;
    for _ in 0..5 {
        assert_eq!(issue(&c, &gw, Some("alice")).await.0, 201);
    }
    assert_eq!(up.total(), 1);
}

#[tokio::test]
async fn the_global_cap_holds_across_scopes() {
    let dir = tempfile::tempdir().unwrap();
    let up = Upstream::start().await;
    let gw = memory_gateway(
        dir.path(),
        "global",
        &up,
        &[
            "--issue-tokens",
            "--tokens-per-scope",
            "3",
            "--max-live-tokens",
            "10",
        ],
    )
    .await;
    let c = reqwest::Client::new();
    let mut issued = 0;
    let mut total_cap = 0;
    for i in 0..20 {
        let who = format!("caller-{i}");
        for _ in 0..3 {
            let (status, retry, v) = issue(&c, &gw, Some(&who)).await;
            match status {
                201 => issued += 1,
                429 => {
                    assert_eq!(kind(&v), "urn:idem:problem:too-many-tokens", "{v}");
                    assert!(retry.is_some());
                    total_cap += 1;
                }
                s => panic!("{s}: {v}"),
            }
        }
    }
    assert_eq!(issued, 10);
    assert_eq!(total_cap, 50);
}

#[tokio::test]
async fn a_token_flood_cannot_fill_the_memory_store() {
    let dir = tempfile::tempdir().unwrap();
    let up = Upstream::start().await;
    // A cap of 40 records; tokens may take at most half.
    let store = "memory://?idem_max_records=40";
    let (code, stderr) = refused(&[
        "--upstream",
        &up.url,
        "--store",
        store,
        "--require-token",
        "/pay/once",
        "--max-live-tokens",
        "21",
    ]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("--max-live-tokens"), "{stderr}");
    let gw = GatewayProc::start(
        dir.path(),
        "flood",
        &[
            "--upstream",
            &up.url,
            "--store",
            store,
            "--require-token",
            "/pay/once",
            "--max-live-tokens",
            "20",
        ],
    )
    .await;
    let c = reqwest::Client::new();
    let flood: Vec<_> = (0..200)
        .map(|i| {
            let (c, url) = (c.clone(), gw.url("/_idem/tokens"));
            tokio::spawn(async move {
                c.post(url)
                    .header("authorization", format!("Bearer flood-{i}"))
                    .send()
                    .await
                    .unwrap()
                    .status()
                    .as_u16()
            })
        })
        .collect();
    let mut answers = std::collections::BTreeMap::new();
    for t in flood {
        *answers.entry(t.await.unwrap()).or_insert(0) += 1;
    }
    assert_eq!(answers.get(&201), Some(&20), "{answers:?}");
    assert_eq!(answers.get(&429), Some(&180), "{answers:?}");
    // Other callers' guarded requests still have room.
    for i in 0..15 {
        let r = pay(&c, &gw.url("/pay"), &unique(&format!("room-{i}")))
            .await
            .unwrap();
        assert_eq!(r.status, 201, "{}", r.body);
    }
    assert_eq!(up.total(), 15);
}

/// `idem gateway --upstream UP --store memory:// EXTRA…`, started and healthy.
async fn memory_gateway(
    dir: &std::path::Path,
    name: &str,
    up: &Upstream,
    extra: &[&str],
) -> GatewayProc {
    let mut args = vec!["--upstream", up.url.as_str(), "--store", "memory://"];
    args.extend_from_slice(extra);
    GatewayProc::start(dir, name, &args).await
}
