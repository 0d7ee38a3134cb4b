//! `GET /metrics` on the admin listener of real `idem gateway` processes:
//! known traffic in, exact counter values out (parsed as Prometheus text
//! with `prometheus-parse`, not grepped), and no raw key or path in any
//! label.

mod support;

use std::time::Duration;

use prometheus_parse::{Scrape, Value};
use support::{free_addr, pay, GatewayProc, RedisProc, Upstream};

/// Scrapes `/metrics` of `gw`, checking the status and content type.
async fn scrape(c: &reqwest::Client, gw: &GatewayProc) -> Scrape {
    let r = c
        .get(format!("http://{}/metrics", gw.admin))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(
        r.headers()["content-type"],
        "text/plain; version=0.0.4",
        "the Prometheus text format's content type"
    );
    let text = r.text().await.unwrap();
    Scrape::parse(text.lines().map(|l| Ok(l.to_owned()))).unwrap()
}

/// The value of the counter or gauge `name` whose labels include `labels`
/// (summed over the series that match); panics when none does.
fn value(s: &Scrape, name: &str, labels: &[(&str, &str)]) -> f64 {
    let found: Vec<f64> = s
        .samples
        .iter()
        .filter(|x| x.metric == name)
        .filter(|x| labels.iter().all(|(k, v)| x.labels.get(k) == Some(*v)))
        .map(|x| match x.value {
            Value::Counter(v) | Value::Gauge(v) | Value::Untyped(v) => v,
            _ => panic!("{name} is not a counter or gauge"),
        })
        .collect();
    assert!(!found.is_empty(), "no {name}{labels:?} in the scrape");
    found.iter().sum()
}

/// How many samples the histogram `name{labels}` holds (its `+Inf` bucket),
/// summed over the series that match; 0 when none does.
fn count(s: &Scrape, name: &str, labels: &[(&str, &str)]) -> f64 {
    s.samples
        .iter()
        .filter(|x| x.metric == name)
        .filter(|x| labels.iter().all(|(k, v)| x.labels.get(k) == Some(*v)))
        .map(|x| match &x.value {
            Value::Histogram(buckets) => buckets
                .iter()
                .find(|b| b.less_than.is_infinite())
                .map_or(0.0, |b| b.count),
            _ => panic!("{name} is not a histogram"),
        })
        .sum()
}

/// POSTs `body` with `key` (any value, even one the gateway refuses).
async fn post(c: &reqwest::Client, url: &str, key: Option<&str>, body: &str) -> u16 {
    let mut r = c
        .post(url)
        .header("content-type", "application/json")
        .body(body.to_owned());
    if let Some(k) = key {
        r = r.header("idempotency-key", k);
    }
    r.send().await.unwrap().status().as_u16()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn known_traffic_gives_exact_counts() {
    let dir = tempfile::tempdir().unwrap();
    let up = Upstream::start().await;
    let gw = GatewayProc::start(
        dir.path(),
        "metrics-memory",
        &["--upstream", &up.url, "--store", "memory://"],
    )
    .await;
    let c = reqwest::Client::new();
    let fast = gw.url("/pay?ms=0");

    // N = 3 first executions, M = 2 replays, K = 2 mismatches.
    for key in ["secret-e1", "secret-e2", "secret-e3"] {
        assert_eq!(pay(&c, &fast, key).await.unwrap().status, 201);
    }
    for key in ["secret-e1", "secret-e2"] {
        let got = pay(&c, &fast, key).await.unwrap();
        assert!(got.replayed, "{got:?}");
    }
    for key in ["secret-e1", "secret-e3"] {
        assert_eq!(post(&c, &fast, Some(key), r#"{"amount":99}"#).await, 422);
    }
    // Two duplicates while the original runs: 409 each.
    let slow = gw.url("/pay?ms=1500");
    let original = {
        let (c, slow) = (c.clone(), slow.clone());
        tokio::spawn(async move { pay(&c, &slow, "secret-f1").await.unwrap() })
    };
    tokio::time::sleep(Duration::from_millis(400)).await;
    let during = scrape(&c, &gw).await;
    assert_eq!(value(&during, "idem_in_flight", &[]), 1.0);
    for _ in 0..2 {
        assert_eq!(pay(&c, &slow, "secret-f1").await.unwrap().status, 409);
    }
    assert_eq!(original.await.unwrap().status, 201);
    // A request without a key passes through; a blank key is refused.
    assert_eq!(post(&c, &fast, None, "{}").await, 201);
    assert_eq!(post(&c, &fast, Some(" "), "{}").await, 400);

    let s = scrape(&c, &gw).await;
    let outcome = |o: &str| value(&s, "idem_requests_total", &[("outcome", o)]);
    assert_eq!(outcome("executed"), 4.0, "e1, e2, e3, f1");
    assert_eq!(outcome("replayed"), 2.0);
    assert_eq!(outcome("mismatch"), 2.0);
    assert_eq!(outcome("in_flight"), 2.0);
    assert_eq!(outcome("passthrough"), 1.0);
    assert_eq!(outcome("rejected"), 1.0);
    for o in ["released", "store_error", "failed_open"] {
        assert_eq!(outcome(o), 0.0, "{o}");
    }
    // Every outcome's duration, once per request.
    for o in [
        "executed",
        "replayed",
        "mismatch",
        "in_flight",
        "passthrough",
        "rejected",
    ] {
        assert_eq!(
            count(&s, "idem_request_duration_seconds", &[("outcome", o)]),
            outcome(o),
            "{o}"
        );
    }
    assert_eq!(up.total(), 5, "4 executions and the pass-through");
    assert_eq!(count(&s, "idem_upstream_duration_seconds", &[]), 5.0);
    // Store calls: a begin per keyed request that reached the store (3 + 2
    // + 2 + 1 + 2), a complete per stored result.
    let op = |o: &str| count(&s, "idem_store_operation_duration_seconds", &[("op", o)]);
    assert_eq!(op("begin"), 10.0);
    assert_eq!(op("complete"), 4.0);
    assert_eq!(op("release"), 0.0);
    assert_eq!(value(&s, "idem_in_flight", &[]), 0.0);
    assert_eq!(value(&s, "idem_memory_store_records", &[]), 4.0);
    assert!(value(&s, "idem_memory_store_bytes", &[]) > 0.0);
    assert_eq!(
        value(
            &s,
            "idem_build_info",
            &[("version", env!("CARGO_PKG_VERSION"))]
        ),
        1.0
    );

    // Label values are bounded: no key, no path anywhere.
    for sample in &s.samples {
        for (name, v) in sample.labels.iter() {
            assert!(
                !v.contains("secret") && !v.contains('/') && !v.contains("pay"),
                "{}{{{name}={v:?}}} carries a key or a path",
                sample.metric
            );
        }
    }
    // The log names the key by its hash too, on one line per request.
    let logs = gw.logs();
    let executed = logs
        .lines()
        .filter(|l| l.contains("idempotency-key request") && l.contains("outcome=\"executed\""))
        .count();
    assert_eq!(executed, 4, "{logs}");
    assert!(
        logs.contains("key_hash=") && logs.contains("route=\"default\""),
        "{logs}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_outage_is_counted_as_store_errors() {
    let dir = tempfile::tempdir().unwrap();
    let redis = RedisProc::start(dir.path(), free_addr().port());
    let up = Upstream::start().await;
    let store = format!("redis://127.0.0.1:{}/", redis.port);
    let gw = GatewayProc::start(
        dir.path(),
        "metrics-redis",
        &[
            "--upstream",
            &up.url,
            "--store",
            &store,
            "--store-timeout",
            "500ms",
            "--lease",
            "2s",
        ],
    )
    .await;
    let c = reqwest::Client::new();
    let url = gw.url("/pay?ms=0");
    assert_eq!(pay(&c, &url, "outage-before").await.unwrap().status, 201);
    {
        let _paused = redis.pause();
        let got = pay(&c, &url, "outage-during").await.unwrap();
        assert_eq!(got.status, 503, "{got:?}");
        assert_eq!(got.problem_type(), "urn:idem:problem:store-unavailable");
    }
    let s = scrape(&c, &gw).await;
    let outcome = |o: &str| value(&s, "idem_requests_total", &[("outcome", o)]);
    assert_eq!(outcome("executed"), 1.0);
    assert_eq!(outcome("store_error"), 1.0);
    let errors: f64 = value(&s, "idem_store_errors_total", &[("op", "begin")]);
    assert_eq!(errors, 1.0, "one failed begin");
    let kinds: Vec<&str> = s
        .samples
        .iter()
        .filter(|x| x.metric == "idem_store_errors_total")
        .filter_map(|x| x.labels.get("kind"))
        .collect();
    assert!(
        kinds.iter().all(|k| ["timeout", "unavailable"].contains(k)),
        "{kinds:?}"
    );
    assert_eq!(up.total(), 1, "the refused request did not run");
}

/// Issue 12 item 6: a 502 where nothing reached the upstream is counted
/// and logged as `released`, never `executed`; `--access-log` logs the
/// requests without a key too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_upstream_is_released_and_the_access_log_logs_passthroughs() {
    let dir = tempfile::tempdir().unwrap();
    // Nothing listens there.
    let upstream = format!("http://{}", free_addr());
    let gw = GatewayProc::start(
        dir.path(),
        "metrics-unreachable",
        &[
            "--upstream",
            &upstream,
            "--store",
            "memory://",
            "--access-log",
        ],
    )
    .await;
    let c = reqwest::Client::new();
    let got = pay(&c, &gw.url("/pay"), "never-sent").await.unwrap();
    assert_eq!(got.status, 502, "{got:?}");
    assert_eq!(got.problem_type(), "urn:idem:problem:upstream-unreachable");
    let r = c.get(gw.url("/orders/./7")).send().await.unwrap();
    assert_eq!(r.status(), 502);

    let s = scrape(&c, &gw).await;
    let outcome = |o: &str| value(&s, "idem_requests_total", &[("outcome", o)]);
    assert_eq!(outcome("released"), 1.0);
    assert_eq!(outcome("executed"), 0.0);
    assert_eq!(outcome("passthrough"), 1.0);
    let logs = gw.logs();
    let lines: Vec<&str> = logs.lines().filter(|l| l.contains(" idem: ")).collect();
    assert!(
        lines.iter().any(|l| l.contains("idempotency-key request")
            && l.contains("outcome=\"released\"")
            && l.contains("status=502")
            && l.contains("key=\"never-sent\"")),
        "{logs}"
    );
    assert!(!logs.contains("outcome=\"executed\""), "{logs}");
    assert!(
        lines
            .iter()
            .any(|l| l.contains("request outcome=\"passthrough\"")
                && l.contains("method=GET")
                && l.contains("path=/orders/7")
                && l.contains("status=502")),
        "{logs}"
    );
}
