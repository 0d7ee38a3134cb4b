//! Upstreams that stall a response body, and upstreams that close idle
//! keep-alive connections.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

/// `201`, `Content-Length: 20`, 10 bytes of body, then 5 s of silence: the
/// first caller gets 502 `upstream-failed` after `--upstream-timeout`, not
/// a hang, and the key is held (a duplicate gets 409, no second run).
#[tokio::test]
async fn a_stalled_response_body_fails_after_the_upstream_timeout() {
    let stall = RawAction::WriteAndStall(
        b"HTTP/1.1 201 Created\r\ncontent-type: text/plain\r\ncontent-length: 20\r\n\r\n0123456789"
            .to_vec(),
        Duration::from_secs(5),
    );
    let (raw, gw) = raw_rig(stall, |c| {
        c.upstream_timeout = Duration::from_millis(500);
        c.layer.lease = Duration::from_secs(30);
    })
    .await;
    let c = client();
    let k = key("stall");

    let started = Instant::now();
    let first = post(&c, &gw.url("/orders"), Some(&k), r#"{"amount":1}"#).await;
    let took = started.elapsed();
    assert_eq!(first.status, 502, "{}", first.text());
    assert_eq!(first.problem_type(), "urn:idem:problem:upstream-failed");
    assert!(took < Duration::from_secs(2), "answered after {took:?}");
    assert!(
        took >= Duration::from_millis(450),
        "answered after {took:?}, before the idle timeout"
    );
    assert_eq!(raw.hits(), 1);

    let dup = post(&c, &gw.url("/orders"), Some(&k), r#"{"amount":1}"#).await;
    assert_eq!(dup.status, 409, "{}", dup.text());
    assert_eq!(
        dup.problem_type(),
        "urn:idem:problem:held",
        "{}",
        dup.text()
    );
    assert_eq!(raw.hits(), 1, "the key is held: no second execution");
}

/// A body that keeps coming, chunk after chunk, within the idle timeout
/// is not cut off even when the whole body takes longer than it.
#[tokio::test]
async fn a_slow_but_steady_body_is_not_cut_off() {
    let up = upstream().await;
    let gw = gateway(&up.url(), |c| {
        // /chunked sends three chunks 100 ms apart: 200 ms in all.
        c.upstream_timeout = Duration::from_millis(150);
    })
    .await;
    let got = post(&client(), &gw.url("/chunked"), Some(&key("steady")), "{}").await;
    assert_eq!(got.status, 200, "{}", got.text());
    assert_eq!(
        got.text(),
        "chunk0-of-execution-1;chunk1-of-execution-1;chunk2-of-execution-1;"
    );
}

/// An HTTP/1.1 keep-alive upstream whose idle close races the next request
/// in the worst way: a request arriving on a connection that has been
/// idle longer than `idle_close` is read and then the connection is
/// closed without an answer (as when the close crosses the request on
/// the wire). Counts connections and answered requests.
struct ClosingUpstream {
    addr: std::net::SocketAddr,
    connections: Arc<AtomicUsize>,
    answered: Arc<AtomicUsize>,
    task: JoinHandle<()>,
}

impl Drop for ClosingUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn closing_upstream(idle_close: Duration) -> ClosingUpstream {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let connections = Arc::new(AtomicUsize::new(0));
    let answered = Arc::new(AtomicUsize::new(0));
    let (conns, ans) = (connections.clone(), answered.clone());
    let task = tokio::spawn(async move {
        loop {
            let Ok((mut sock, _)) = listener.accept().await else {
                return;
            };
            conns.fetch_add(1, Ordering::SeqCst);
            let ans = ans.clone();
            tokio::spawn(async move {
                let mut idle_since = Instant::now();
                loop {
                    let req = read_request(&mut sock).await;
                    if req.is_empty() {
                        return;
                    }
                    if idle_since.elapsed() > idle_close {
                        return; // closed while the request was on its way
                    }
                    let n = ans.fetch_add(1, Ordering::SeqCst) + 1;
                    let body = format!("order {n}");
                    let resp = format!(
                        "HTTP/1.1 201 Created\r\ncontent-length: {}\r\n\r\n{body}",
                        body.len()
                    );
                    if sock.write_all(resp.as_bytes()).await.is_err() {
                        return;
                    }
                    idle_since = Instant::now();
                }
            });
        }
    });
    ClosingUpstream {
        addr,
        connections,
        answered,
        task,
    }
}

/// `n` sequential keyed POSTs, `gap_ms` apart, through a gateway with
/// `--upstream-idle-timeout` of `idle_ms` in front of an upstream that
/// closes a connection idle for `upstream_idle_ms` (all in milliseconds);
/// the upstream and the statuses.
async fn posts_through(
    upstream_idle_ms: u64,
    idle_ms: u64,
    n: usize,
    gap_ms: u64,
) -> (ClosingUpstream, Vec<u16>) {
    let up = closing_upstream(Duration::from_millis(upstream_idle_ms)).await;
    let gw = gateway(&format!("http://{}", up.addr), |c| {
        c.upstream_idle_timeout = Duration::from_millis(idle_ms);
    })
    .await;
    let statuses = sequential_posts(&gw, n, Duration::from_millis(gap_ms)).await;
    (up, statuses)
}

async fn sequential_posts(gw: &TestGateway, n: usize, gap: Duration) -> Vec<u16> {
    let c = client();
    let mut statuses = Vec::new();
    for _ in 0..n {
        let got = post(&c, &gw.url("/orders"), Some(&key("keepalive")), "{}").await;
        statuses.push(got.status);
        tokio::time::sleep(gap).await;
    }
    statuses
}

/// With `--upstream-idle-timeout` below the upstream's keep-alive timeout,
/// no pooled connection is reused after the upstream may have closed it:
/// no 502 and no held key.
#[tokio::test]
async fn idle_pooled_connections_are_not_reused_past_the_idle_timeout() {
    let (up, statuses) = posts_through(150, 50, 20, 200).await;
    assert!(statuses.iter().all(|&s| s == 201), "{statuses:?}");
    assert_eq!(up.answered.load(Ordering::SeqCst), 20);
    assert!(up.connections.load(Ordering::SeqCst) >= 20);
}

/// Back-to-back requests still share one pooled connection.
#[tokio::test]
async fn busy_connections_are_still_reused() {
    let (up, statuses) = posts_through(300, 100, 10, 0).await;
    assert!(statuses.iter().all(|&s| s == 201), "{statuses:?}");
    assert!(
        up.connections.load(Ordering::SeqCst) < 10,
        "{} connections for 10 requests",
        up.connections.load(Ordering::SeqCst)
    );
}

/// The harness reproduces the race: with a pool idle timeout longer than
/// the upstream's (30 s was the old, fixed value), a reused connection
/// fails and the caller gets 502 `upstream-failed`.
#[tokio::test]
async fn control_a_long_idle_timeout_hits_the_race() {
    let (_up, statuses) = posts_through(150, 30_000, 2, 200).await;
    assert_eq!(statuses, vec![201, 502]);
}
