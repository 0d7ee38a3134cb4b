//! Checks shared by the PostgreSQL and MySQL test files: what the
//! conformance suite cannot see (two pools racing, corrupt rows,
//! unreachable servers, notification wake-ups, round trips).

#![allow(dead_code, unreachable_pub)]

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idem_core::{Begin, IdempotencyKey, Phase, Scope, Store, StoreError};
use idem_testkit::support::{acquire, expect_replay, fp, fresh_key, fresh_scope, req, response};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

pub const MIN: Duration = Duration::from_secs(60);

/// A random lowercase suffix for per-run schema and table names.
pub fn suffix() -> String {
    idem_testkit::support::random_hex(12)
}

/// Fails the test (never skips it): when the server cannot be reached,
/// with the command that starts it; otherwise with the error.
pub fn connect_failed(what: &str, url: &str, err: &StoreError, start: &str) -> ! {
    let unreachable = match err {
        StoreError::Unavailable { source, .. } => match source.downcast_ref::<sqlx::Error>() {
            Some(sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut) => true,
            Some(_) => false,
            // The connect timeout's own message.
            None => true,
        },
        _ => false,
    };
    if !unreachable {
        panic!("connecting to {what} at {url} failed: {err} ({err:?})");
    }
    panic!(
        "{what} at {url} is not reachable ({err}: {:?}).\n\
         These tests need the real server. Start it with:\n    {start}\n\
         (or point the URL variable at another server)",
        std::error::Error::source(err).map(|s| s.to_string())
    )
}

/// `n` concurrent `begin`s of one key, alternating between stores `a` and
/// `b` (two separate pools), released together: exactly one `Acquired`,
/// every other answer `InFlight`. Returns the winner's lease.
pub async fn race_two_pools<S: Store + Clone>(a: &S, b: &S, n: usize) -> idem_core::Lease {
    let (scope, key) = (fresh_scope(), fresh_key("two-pools"));
    let r = req(&scope, &key, fp("a"), MIN);
    let lease = race(a, b, &r, n).await;
    // Both pools see the winner's claim, then its result.
    b.complete(&lease, &response("won"), MIN)
        .await
        .expect("complete through either pool");
    expect_replay(a, &r, &response("won")).await;
    expect_replay(b, &r, &response("won")).await;
    lease
}

/// As [`race_two_pools`], but the key's first claim has run out: `n`
/// callers race to take it over; exactly one wins, with a larger fence.
pub async fn race_takeover_two_pools<S: Store + Clone>(a: &S, b: &S, n: usize) {
    let (scope, key) = (fresh_scope(), fresh_key("takeover"));
    let short = req(&scope, &key, fp("a"), Duration::from_millis(300));
    let first = acquire(a, &short).await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    let winner = race(a, b, &req(&scope, &key, fp("a"), MIN), n).await;
    assert!(
        winner.fence > first.fence,
        "{} > {}",
        winner.fence,
        first.fence
    );
}

async fn race<S: Store + Clone>(
    a: &S,
    b: &S,
    r: &idem_core::BeginRequest,
    n: usize,
) -> idem_core::Lease {
    let barrier = Arc::new(tokio::sync::Barrier::new(n));
    let tasks: Vec<_> = (0..n)
        .map(|i| {
            let store = if i % 2 == 0 { a.clone() } else { b.clone() };
            let (r, barrier) = (r.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                store.begin(&r).await
            })
        })
        .collect();
    let mut acquired = Vec::new();
    let mut in_flight = 0;
    for t in tasks {
        match t.await.expect("task").expect("begin") {
            Begin::Acquired(l) => acquired.push(l),
            Begin::InFlight { retry_after } => {
                assert!(retry_after > Duration::ZERO);
                in_flight += 1;
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(acquired.len(), 1, "exactly one winner: {acquired:?}");
    assert_eq!(in_flight, n - 1);
    acquired.pop().expect("one")
}

/// Completes three keys, corrupts each row with `corrupt(scope, key, what)`
/// (`what` = "response", "fingerprint"), and expects `Corrupt` from `begin`
/// and `get`, never a panic; an operator's `delete` still works.
pub async fn corrupt_rows<S, F, Fut>(store: &S, corrupt: F)
where
    S: Store,
    F: Fn(Scope, IdempotencyKey, &'static str) -> Fut,
    Fut: Future<Output = ()>,
{
    let scope = fresh_scope();
    for what in ["response", "null-response", "fingerprint"] {
        let key = fresh_key(what);
        let l = acquire(store, &req(&scope, &key, fp("a"), MIN)).await;
        store
            .complete(&l, &response("ok"), MIN)
            .await
            .expect("complete");
        corrupt(scope.clone(), key.clone(), what).await;
        match store.begin(&req(&scope, &key, fp("a"), MIN)).await {
            Err(StoreError::Corrupt {
                phase: Phase::Begin,
                detail,
            }) => assert!(!detail.is_empty()),
            other => panic!("{what}: begin must report Corrupt, got {other:?}"),
        }
        match store.get(&scope, &key).await {
            Err(StoreError::Corrupt {
                phase: Phase::Get, ..
            }) => {}
            other => panic!("{what}: get must report Corrupt, got {other:?}"),
        }
        assert!(store.delete(&scope, &key).await.expect("delete"));
        acquire(store, &req(&scope, &key, fp("a"), MIN)).await;
    }
}

/// Connecting to a closed port on 127.0.0.1 fails with `Unavailable`
/// (phase `Connect`) within 3 s and keeps the driver's error as the source.
pub async fn unreachable_fails_fast<T: std::fmt::Debug, Fut>(connect: Fut)
where
    Fut: Future<Output = Result<T, StoreError>>,
{
    let started = Instant::now();
    let got = tokio::time::timeout(Duration::from_secs(10), connect)
        .await
        .expect("connecting to a closed port must not hang");
    let elapsed = started.elapsed();
    match got {
        Err(
            e @ StoreError::Unavailable {
                phase: Phase::Connect,
                ..
            },
        ) => {
            assert!(
                std::error::Error::source(&e).is_some(),
                "source kept: {e:?}"
            );
        }
        other => panic!("expected Unavailable at connect, got {other:?}"),
    }
    assert!(
        elapsed < Duration::from_secs(3),
        "a refused connection fails quickly, took {elapsed:?}"
    );
}

/// A port on 127.0.0.1 that nothing listens on (bound, then released).
pub fn closed_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = l.local_addr().expect("addr").port();
    drop(l);
    port
}

/// A TCP proxy on 127.0.0.1 that counts round trips: every time the
/// client starts sending after the server has answered (or for the first
/// time), one "flight" begins. Bounded: serves until dropped.
pub struct RoundTripProxy {
    pub port: u16,
    flights: Arc<Mutex<Flights>>,
    task: tokio::task::JoinHandle<()>,
}

#[derive(Default)]
struct Flights {
    /// `true` while the last bytes seen went client → server.
    client_last: bool,
    starts: Vec<Instant>,
    /// When bytes last passed either way.
    last_seen: Option<Instant>,
}

impl RoundTripProxy {
    /// Proxies to `upstream` (host:port).
    pub async fn start(upstream: String) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind proxy");
        let port = listener.local_addr().expect("addr").port();
        let flights = Arc::new(Mutex::new(Flights::default()));
        let f = flights.clone();
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = tokio::net::TcpStream::connect(&upstream).await else {
                    continue;
                };
                let f = f.clone();
                tokio::spawn(async move {
                    let (mut cr, mut cw) = client.into_split();
                    let (mut sr, mut sw) = server.into_split();
                    let up = {
                        let f = f.clone();
                        async move {
                            let mut buf = vec![0u8; 64 * 1024];
                            loop {
                                let n = match cr.read(&mut buf).await {
                                    Ok(0) | Err(_) => break,
                                    Ok(n) => n,
                                };
                                {
                                    let mut g = f.lock().expect("lock");
                                    g.last_seen = Some(Instant::now());
                                    if !g.client_last {
                                        g.client_last = true;
                                        g.starts.push(Instant::now());
                                    }
                                }
                                if sw.write_all(&buf[..n]).await.is_err() {
                                    break;
                                }
                            }
                            let _ = sw.shutdown().await;
                        }
                    };
                    let down = async move {
                        let mut buf = vec![0u8; 64 * 1024];
                        loop {
                            let n = match sr.read(&mut buf).await {
                                Ok(0) | Err(_) => break,
                                Ok(n) => n,
                            };
                            {
                                let mut g = f.lock().expect("lock");
                                g.client_last = false;
                                g.last_seen = Some(Instant::now());
                            }
                            if cw.write_all(&buf[..n]).await.is_err() {
                                break;
                            }
                        }
                        let _ = cw.shutdown().await;
                    };
                    tokio::join!(up, down);
                });
            }
        });
        Self {
            port,
            flights,
            task,
        }
    }

    /// Round trips the client started while `fut` ran. Call it on a
    /// current-thread runtime: sqlx pings a connection in a spawned task
    /// when it returns to the pool, and that task must not run before the
    /// end of the measurement is taken.
    pub async fn count<T>(&self, fut: impl Future<Output = T>) -> (T, usize) {
        // Let anything still in flight from earlier calls (that ping)
        // finish first: wait for 100 ms of silence, at most 5 s.
        let give_up = Instant::now() + Duration::from_secs(5);
        loop {
            tokio::time::sleep(Duration::from_millis(20)).await;
            let quiet = {
                let g = self.flights.lock().expect("lock");
                !g.client_last
                    && g.last_seen
                        .is_none_or(|t| t.elapsed() >= Duration::from_millis(100))
            };
            if quiet || Instant::now() >= give_up {
                break;
            }
        }
        let t0 = Instant::now();
        let out = fut.await;
        let t1 = Instant::now();
        let n = self
            .flights
            .lock()
            .expect("lock")
            .starts
            .iter()
            .filter(|t| **t >= t0 && **t <= t1)
            .count();
        (out, n)
    }
}

impl Drop for RoundTripProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Counts the round trips of a first execution (`begin` + `complete`) and
/// of a replay, after warming the connection's statement cache. Returns
/// (begin, complete, replay).
pub async fn count_round_trips<S: Store>(
    store: &S,
    proxy: &RoundTripProxy,
) -> (usize, usize, usize) {
    let scope = fresh_scope();
    // Warm up: prepare every statement once on the (single) connection.
    for _ in 0..2 {
        let key = fresh_key("warm");
        let r = req(&scope, &key, fp("a"), MIN);
        let l = acquire(store, &r).await;
        store
            .complete(&l, &response("w"), MIN)
            .await
            .expect("complete");
        expect_replay(store, &r, &response("w")).await;
    }
    let key = fresh_key("counted");
    let r = req(&scope, &key, fp("a"), MIN);
    let (lease, begin) = proxy.count(acquire(store, &r)).await;
    let (done, complete) = proxy
        .count(store.complete(&lease, &response("c"), MIN))
        .await;
    done.expect("complete");
    let ((), replay) = proxy.count(expect_replay(store, &r, &response("c"))).await;
    (begin, complete, replay)
}
