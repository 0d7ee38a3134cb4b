//! Checks shared by the PostgreSQL and MySQL test files: what the
//! conformance suite cannot see (two pools racing, corrupt rows,
//! unreachable servers, notification wake-ups, round trips).

#![allow(dead_code, unreachable_pub)]

#[path = "../servers/mod.rs"]
pub mod servers;

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use idem_core::{IdempotencyKey, Phase, Scope, Store, StoreError};
use idem_testkit::support::{
    acquire, expect_in_progress, expect_replay, fp, fresh_key, fresh_scope, req, response,
};
use idem_testkit::KeptHarness;
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

/// A store on a database server (PostgreSQL, MySQL), for the checks both
/// servers share: its pool, its table, and how one record is selected.
#[async_trait]
pub trait ServerStore: Store + Clone + 'static {
    /// The server's sqlx database.
    type Db: sqlx::Database;
    /// The server's port when the URL names none.
    const DEFAULT_PORT: u16;
    /// A `WHERE` condition selecting one record: the scope is the first
    /// bound value, the key the second.
    const BY_KEY: &'static str;
    /// The store's pool.
    fn pool(&self) -> &sqlx::Pool<Self::Db>;
    /// The store's table, as it is written in SQL.
    fn table(&self) -> &str;
}

/// Writes what a server's store test file needs: `impl ServerStore for
/// $store` (over its own `pool()` and `table()`, on `$server`'s default
/// port); `url()`, the server's; `connect(opts)`, which fails the test
/// (naming the command that starts it) when the server is down;
/// `options_at(url, name)` (a pool of 8, `$with(name)`) and
/// `options(name)`; `harness_with(f)` and `harness()`, a [`ServerHarness`]
/// on a fresh name whose `$drop` (`{0}` the name) runs when the check ends;
/// and `name_of(h)`, that name.
#[allow(unused_macros)]
macro_rules! server_backend {
    ($store:ident, $opts:ident, $db:ty, $server:expr,
     by_key: $by_key:literal, $with:ident, drop: $drop:literal) => {
        impl $crate::common::ServerStore for $store {
            type Db = $db;
            const DEFAULT_PORT: u16 = $server.port();
            const BY_KEY: &'static str = $by_key;

            fn pool(&self) -> &sqlx::Pool<$db> {
                $store::pool(self)
            }

            fn table(&self) -> &str {
                $store::table(self)
            }
        }

        fn url() -> String {
            $server.url()
        }

        async fn connect(opts: $opts) -> $store {
            match $store::connect_with(opts).await {
                Ok(s) => s,
                Err(e) => {
                    $crate::common::connect_failed($server.what(), &url(), &e, $server.start())
                }
            }
        }

        /// A pool of 8 on the server at `url`, on `name`.
        fn options_at(url: &str, name: &str) -> $opts {
            $opts::new(url).$with(name).with_max_connections(8)
        }

        fn options(name: &str) -> $opts {
            options_at(&url(), name)
        }

        /// The check's schema or table (`idem_t_<random>`).
        fn name_of(h: &$crate::common::ServerHarness<$store>) -> &str {
            h.kept.name()
        }

        async fn harness_with(
            f: impl FnOnce($opts) -> $opts,
        ) -> $crate::common::ServerHarness<$store> {
            let cleanup = |name: &str| {
                $crate::common::servers::Cleanup::new($server, name, format!($drop, name))
            };
            $crate::common::fresh_harness(cleanup, |name| connect(f(options(name)))).await
        }

        async fn harness() -> $crate::common::ServerHarness<$store> {
            harness_with(|o| o).await
        }
    };
}
#[allow(unused_imports)]
pub(crate) use server_backend;

/// The checks both servers run the same way, as `#[tokio::test]`s (inside
/// the file's `<store>_tests` module, after [`server_backend!`]): two pools
/// racing, corrupt rows (`corrupt`: the `SET` clauses that corrupt the
/// response, null it, corrupt the fingerprint), an unreachable server
/// (`unreachable`: the URL, `{}` a closed port), and the round trips on the
/// wire of one warmed-up connection (`round_trips`: the test, and the
/// expected `(begin, complete, replay)`).
#[allow(unused_macros)]
macro_rules! server_checks {
    ($store:ident, corrupt: $sets:expr, unreachable: $url:literal,
     round_trips: $(#[$doc:meta])* $round_trips:ident => $expected:expr) => {
        $(#[$doc])*
        #[tokio::test]
        async fn $round_trips() {
            let h = harness().await;
            let (begin, complete, replay) =
                $crate::common::round_trips_via_proxy(&url(), |via| {
                    connect(options_at(&via, name_of(&h)).with_max_connections(1))
                })
                .await;
            assert_eq!(
                (begin, complete, replay),
                $expected,
                "round trips (begin, complete, replay)"
            );
        }

        /// 64 concurrent begins of one key from two stores with separate pools:
        /// exactly one `Acquired`; then 64 racing takeovers of an expired claim:
        /// exactly one winner, with a larger fence.
        #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
        async fn sixty_four_begins_from_two_pools_one_winner() {
            let h = harness().await;
            let other = connect(options(name_of(&h))).await;
            $crate::common::sixty_four_begins_from_two_pools(&h.store, &other).await;
        }

        /// Corrupt rows are `Corrupt`, never a panic.
        #[tokio::test]
        async fn corrupt_rows_are_corrupt_errors() {
            let h = harness().await;
            $crate::common::corrupt_rows_by_sql(&h.store, $sets).await;
        }

        /// A closed port: `Unavailable` at connect, quickly, with the source kept.
        #[tokio::test]
        async fn unreachable_server_is_unavailable_quickly() {
            let port = $crate::common::closed_port();
            $crate::common::unreachable_fails_fast($store::connect(&format!($url, port))).await;
        }
    };
}
#[allow(unused_imports)]
pub(crate) use server_checks;

/// A harness on a fresh name `idem_t_<random>` (a schema, or a table):
/// `connect(name)` makes the store; `cleanup(name)` drops what it made
/// when the check ends.
pub async fn fresh_harness<S, Fut>(
    cleanup: impl FnOnce(&str) -> servers::Cleanup,
    connect: impl FnOnce(&str) -> Fut,
) -> ServerHarness<S>
where
    Fut: Future<Output = S>,
{
    let name = format!("idem_t_{}", suffix());
    let guard = cleanup(&name);
    let store = connect(&name).await;
    KeptHarness::sleeping(store, guard)
}

/// A store under test on a server, with the guard that drops its schema or
/// tables when the check ends.
pub type ServerHarness<S> = KeptHarness<S, servers::Cleanup>;

/// Runs `sql` with the record's scope and key bound (as bytes).
pub async fn run_keyed<'c, DB, E>(ex: E, sql: &str, scope: &Scope, key: &IdempotencyKey)
where
    DB: sqlx::Database,
    E: sqlx::Executor<'c, Database = DB>,
    for<'q> &'q [u8]: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    for<'q> <DB as sqlx::Database>::Arguments<'q>: sqlx::IntoArguments<'q, DB>,
{
    sqlx::query::<DB>(sql)
        .bind(scope.as_str().as_bytes())
        .bind(key.as_str().as_bytes())
        .execute(ex)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
}

/// 64 concurrent begins of one key from stores `a` and `b` (separate
/// pools), three times: one winner each; then 64 racing takeovers of an
/// expired claim: one winner, with a larger fence.
pub async fn sixty_four_begins_from_two_pools<S: Store + Clone + 'static>(a: &S, b: &S) {
    for _ in 0..3 {
        race_two_pools(a, b, 64).await;
    }
    race_takeover_two_pools(a, b, 64).await;
}

/// [`corrupt_rows`] by SQL: `sets` are the `SET` clauses that corrupt the
/// response, null it, and corrupt the fingerprint.
pub async fn corrupt_rows_by_sql<S>(store: &S, sets: [&'static str; 3])
where
    S: ServerStore,
    for<'q> &'q [u8]: sqlx::Encode<'q, S::Db> + sqlx::Type<S::Db>,
    for<'q> <S::Db as sqlx::Database>::Arguments<'q>: sqlx::IntoArguments<'q, S::Db>,
    for<'c> &'c mut <S::Db as sqlx::Database>::Connection: sqlx::Executor<'c, Database = S::Db>,
{
    let pool = store.pool().clone();
    let table = store.table().to_owned();
    corrupt_rows(store, |scope, key, what| {
        let set = match what {
            "response" => sets[0],
            "null-response" => sets[1],
            _ => sets[2],
        };
        let sql = format!("UPDATE {table} SET {set} WHERE {}", S::BY_KEY);
        let pool = pool.clone();
        async move { run_keyed(&pool, &sql, &scope, &key).await }
    })
    .await;
}

/// A step blocked by another transaction's row lock fails with `Timeout`
/// (`store` has a short statement / lock-wait timeout) within `within`, and
/// writes nothing: once unblocked, the claim is still in progress and
/// completes.
pub async fn blocked_step_is_timeout<S>(store: &S, within: Duration)
where
    S: ServerStore,
    for<'q> &'q [u8]: sqlx::Encode<'q, S::Db> + sqlx::Type<S::Db>,
    for<'q> <S::Db as sqlx::Database>::Arguments<'q>: sqlx::IntoArguments<'q, S::Db>,
    for<'c> &'c mut <S::Db as sqlx::Database>::Connection: sqlx::Executor<'c, Database = S::Db>,
{
    let (scope, key) = (fresh_scope(), fresh_key("timeout"));
    let lease = acquire(store, &req(&scope, &key, fp("a"), MIN)).await;
    let mut blocker = store.pool().begin().await.expect("tx");
    let lock = format!(
        "SELECT 1 FROM {} WHERE {} FOR UPDATE",
        store.table(),
        S::BY_KEY
    );
    run_keyed(&mut *blocker, &lock, &scope, &key).await;
    let started = Instant::now();
    match store.complete(&lease, &response("x"), MIN).await {
        Err(StoreError::Timeout {
            phase: Phase::Complete,
        }) => {}
        other => panic!("expected Timeout, got {other:?}"),
    }
    assert!(started.elapsed() < within);
    blocker.rollback().await.expect("unlock");
    expect_in_progress(store, &scope, &key, fp("a"), lease.fence).await;
    store
        .complete(&lease, &response("x"), MIN)
        .await
        .expect("complete once unblocked");
}

/// Round trips on the wire of a store made by `connect` from a URL that
/// goes through a [`RoundTripProxy`] to the server at `url`; see
/// [`count_round_trips`].
pub async fn round_trips_via_proxy<S, F, Fut>(url: &str, connect: F) -> (usize, usize, usize)
where
    S: ServerStore,
    F: FnOnce(String) -> Fut,
    Fut: Future<Output = S>,
{
    let parsed = url::Url::parse(url).expect("url");
    let upstream = format!(
        "{}:{}",
        parsed.host_str().expect("host"),
        parsed.port().unwrap_or(S::DEFAULT_PORT)
    );
    let proxy = RoundTripProxy::start(upstream).await;
    let mut via = parsed.clone();
    via.set_host(Some("127.0.0.1")).expect("host");
    via.set_port(Some(proxy.port)).expect("port");
    let store = connect(via.to_string()).await;
    count_round_trips(&store, &proxy).await
}

/// `purge_expired` deletes in batches: `seed(scope)` writes 2,500 expired
/// records in `scope`, one `purge_expired` call removes them all, and a live
/// claim stays. Returns the live claim's lease.
pub async fn purge_in_batches<S, F, Fut>(store: &S, seed: F) -> idem_core::Lease
where
    S: Store,
    F: FnOnce(Scope) -> Fut,
    Fut: Future<Output = ()>,
{
    let scope = fresh_scope();
    let live = acquire(store, &req(&scope, &fresh_key("live"), fp("a"), MIN)).await;
    seed(scope.clone()).await;
    assert_eq!(store.purge_expired().await.expect("purge"), 2500);
    expect_in_progress(store, &scope, &live.key, fp("a"), live.fence).await;
    live
}

/// Schema and table names are checked before anything is sent: `connect`
/// fails with `Config`, within a second.
pub async fn refused_as_config<T: std::fmt::Debug>(
    what: &str,
    connect: impl Future<Output = Result<T, StoreError>>,
) {
    let started = Instant::now();
    let got = connect.await;
    assert!(matches!(got, Err(StoreError::Config(_))), "{what}: {got:?}");
    assert!(started.elapsed() < Duration::from_secs(1));
}

/// `n` concurrent `begin`s of one key, alternating between stores `a` and
/// `b` (two separate pools), released together: exactly one `Acquired`,
/// every other answer `InFlight`. Returns the winner's lease.
pub async fn race_two_pools<S: Store + Clone + 'static>(
    a: &S,
    b: &S,
    n: usize,
) -> idem_core::Lease {
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
pub async fn race_takeover_two_pools<S: Store + Clone + 'static>(a: &S, b: &S, n: usize) {
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

async fn race<S: Store + Clone + 'static>(
    a: &S,
    b: &S,
    r: &idem_core::BeginRequest,
    n: usize,
) -> idem_core::Lease {
    idem_testkit::server_checks::race_begins(a, b, r, n).await
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
        idem_testkit::server_checks::expect_corrupt(store, &req(&scope, &key, fp("a"), MIN), what)
            .await;
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

/// Copies `from` to `to` until either ends, noting in `flights` when bytes
/// passed (and, `up` = client → server, when a client flight began); shuts
/// `to` down at the end.
async fn pump(
    from: &mut tokio::net::tcp::OwnedReadHalf,
    to: &mut tokio::net::tcp::OwnedWriteHalf,
    flights: Arc<Mutex<Flights>>,
    up: bool,
) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        {
            let mut g = flights.lock().expect("lock");
            g.last_seen = Some(Instant::now());
            if up && !g.client_last {
                g.starts.push(Instant::now());
            }
            g.client_last = up;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
    let _ = to.shutdown().await;
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
                    let up = pump(&mut cr, &mut sw, f.clone(), true);
                    let down = pump(&mut sr, &mut cw, f, false);
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
