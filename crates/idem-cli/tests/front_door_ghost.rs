//! Issue 11, finding 8: a `begin` cut off by `--store-timeout` must not
//! leave a ghost claim. The store is paused (SIGSTOP) while a claim is on
//! the wire: the client gets 503 "not run", the claim runs when the store
//! resumes, and without care every retry then got 409 "still being
//! processed" for the whole lease although nothing ran. Each test starts
//! its OWN `redis-server` on a free port; the shared servers are never
//! paused.

mod support;

use std::time::{Duration, Instant};

use support::*;

/// The lease is long (60 s) so that a ghost claim would hold far past the
/// test's bound; the store timeout is short (300 ms).
async fn gateway(
    dir: &std::path::Path,
    redis: &RedisProc,
    up: &Upstream,
    extra: &[&str],
) -> GatewayProc {
    let store = format!("redis://127.0.0.1:{}/", redis.port);
    let mut args = vec![
        "--upstream",
        &up.url,
        "--store",
        &store,
        "--store-timeout",
        "300ms",
        "--lease",
        "60s",
    ];
    args.extend_from_slice(extra);
    GatewayProc::start(dir, "ghost", &args).await
}

/// Retries `key` until it runs (201), failing if it is still refused after
/// `bound`; every refusal on the way is a 409 whose `Retry-After` is at
/// most the lease. Returns the answer and how many 409s came first.
async fn retry_until_run(
    c: &reqwest::Client,
    url: &str,
    key: &str,
    bound: Duration,
) -> (Got, usize) {
    let deadline = Instant::now() + bound;
    let mut refused = 0;
    loop {
        let r = pay(c, url, key).await.unwrap();
        if r.status == 201 {
            return (r, refused);
        }
        assert_eq!(r.status, 409, "{}", r.body);
        assert_eq!(r.problem_type(), "urn:idem:problem:in-flight", "{}", r.body);
        refused += 1;
        assert!(
            Instant::now() < deadline,
            "still 409 after {bound:?} although nothing runs (a ghost claim holds the 60 s \
             lease): {}",
            r.body
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn a_claim_that_lands_after_its_begin_timed_out_does_not_block_retries() {
    let dir = tempfile::tempdir().unwrap();
    let redis = RedisProc::start(dir.path(), free_addr().port());
    let up = Upstream::start().await;
    let gw = gateway(dir.path(), &redis, &up, &[]).await;
    let c = reqwest::Client::new();
    let url = gw.url("/pay?ms=10");
    let key = unique("ghost");

    {
        // Redis stops reading: the claim script is written to its socket
        // and waits there; the gateway gives up after 300 ms.
        let _paused = redis.pause();
        let r = pay(&c, &url, &key).await.unwrap();
        assert_eq!(r.status, 503, "{}", r.body);
        assert_eq!(r.problem_type(), "urn:idem:problem:store-unavailable");
        assert_eq!(up.total(), 0);
    } // SIGCONT: Redis runs the claim it was sent and answers it late.

    let (r, _) = retry_until_run(&c, &url, &key, Duration::from_secs(10)).await;
    assert!(!r.replayed, "{}", r.body);
    assert_eq!(up.of_key(&key), 1);
    // The run's result is kept as usual.
    let again = pay(&c, &url, &key).await.unwrap();
    assert_eq!(
        (again.status, again.replayed),
        (201, true),
        "{}",
        again.body
    );
    assert_eq!(again.body, r.body);
    assert_eq!(up.of_key(&key), 1);
    assert!(
        gw.logs()
            .contains("released the claim of a begin that timed out"),
        "{}",
        gw.logs()
    );
}
