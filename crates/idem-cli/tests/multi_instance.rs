//! Several `idem gateway` processes sharing one PostgreSQL, MariaDB or
//! Redis store run each key exactly once, and in wait mode a duplicate on
//! one instance gets the replay of an original running on another.
//!
//! Needs the shared servers of /work/shared/SERVICES.md (URLs from
//! `IDEM_TEST_POSTGRES_URL`, `IDEM_TEST_MYSQL_URL`, `IDEM_TEST_REDIS_URL`);
//! a test whose server is unreachable fails and names the command that
//! starts it. Each test keeps its data apart — its own PostgreSQL schema,
//! MySQL table or Redis key prefix — and removes it afterwards.

mod support;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use support::*;

/// Keys, copies of each, requests in flight at once.
const KEYS: usize = 100;
const COPIES: usize = 16;
const IN_FLIGHT: usize = 64;

/// Runs `f` on drop (cleanup that also happens when the test panics).
struct OnDrop<F: FnMut()>(F);
impl<F: FnMut()> Drop for OnDrop<F> {
    fn drop(&mut self) {
        (self.0)();
    }
}

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .pool_max_idle_per_host(IN_FLIGHT)
        .build()
        .unwrap()
}

fn gateway_args<'a>(up: &'a Upstream, store: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut v = vec![
        "--upstream",
        &up.url,
        "--store",
        store,
        "--lease",
        "10s",
        "--ttl",
        "1h",
        "--store-pool-size",
        "8",
        "--upstream-timeout",
        "10s",
    ];
    v.extend_from_slice(extra);
    v
}

/// 3 gateways on `store`; `KEYS` keys × `COPIES` concurrent copies spread
/// over them, `IN_FLIGHT` at a time → one execution per key, every other
/// answer a 409 or a byte-identical replay.
///
/// `records`, when given, counts the records in this test's own table or
/// key prefix: the gateway's `idem_*` URL options must have put them there.
async fn each_key_runs_once_across_instances(
    store: &str,
    kind: &str,
    records: Option<&dyn Fn() -> usize>,
) {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let args = gateway_args(&up, store, &[]);
    let gateways = Arc::new(vec![
        GatewayProc::start(dir.path(), "a", &args).await,
        GatewayProc::start(dir.path(), "b", &args).await,
        GatewayProc::start(dir.path(), "c", &args).await,
    ]);
    let c = client();
    for g in gateways.iter() {
        let (status, body) = g.health(&c).await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["store"], kind, "{body}");
    }
    let logs = |gs: &[GatewayProc]| {
        gs.iter()
            .map(|g| format!("--- {}:\n{}", g.addr, tail(&g.logs(), 40)))
            .collect::<Vec<_>>()
            .join("\n")
    };

    let run = unique("mi");
    let started = Instant::now();
    let limit = Arc::new(tokio::sync::Semaphore::new(IN_FLIGHT));
    let mut tasks = tokio::task::JoinSet::new();
    // Half the copies of a key are sent back to back, so they race each
    // other on different instances (409s); the other half go out after
    // every key had its turn, mostly once the original is done (replays).
    let half = COPIES / 2;
    for (k, copy) in (0..2).flat_map(|phase| {
        (0..KEYS).flat_map(move |k| (phase * half..(phase + 1) * half).map(move |c| (k, c)))
    }) {
        {
            let permit = limit.clone().acquire_owned().await.unwrap();
            let (c, gateways) = (c.clone(), gateways.clone());
            let key = format!("{run}-k{k}");
            tasks.spawn(async move {
                let g = &gateways[(k + copy) % gateways.len()];
                let got = pay(&c, &g.url("/pay"), &key).await;
                drop(permit);
                (key, got)
            });
        }
    }
    let mut by_key: HashMap<String, Vec<Got>> = HashMap::new();
    while let Some(done) = tasks.join_next().await {
        let (key, got) = done.unwrap();
        let got = got.unwrap_or_else(|e| panic!("{key}: {e}\n{}", logs(&gateways)));
        by_key.entry(key).or_default().push(got);
    }
    let took = started.elapsed();

    let mut conflicts = 0;
    let mut replays = 0;
    for (key, answers) in &by_key {
        assert_eq!(answers.len(), COPIES);
        assert_eq!(
            up.of_key(key),
            1,
            "{key} ran {} times\n{}",
            up.of_key(key),
            logs(&gateways)
        );
        let originals: Vec<&Got> = answers
            .iter()
            .filter(|g| g.status == 201 && !g.replayed)
            .collect();
        assert_eq!(originals.len(), 1, "{key}: {answers:#?}");
        let original = &originals[0].body;
        for a in answers {
            match a.status {
                201 if a.replayed => {
                    replays += 1;
                    assert_eq!(
                        &a.body, original,
                        "{key}: a replay differs from the original"
                    );
                }
                201 => {}
                409 => {
                    conflicts += 1;
                    assert_eq!(a.problem_type(), "urn:idem:problem:in-flight", "{a:?}");
                }
                _ => panic!("{key}: unexpected answer {a:?}\n{}", logs(&gateways)),
            }
        }
    }
    assert_eq!(by_key.len(), KEYS);
    assert_eq!(up.total(), KEYS, "executions in all");
    assert!(
        conflicts > 0 && replays > 0,
        "{conflicts} × 409, {replays} replays: not both seen"
    );
    eprintln!(
        "{kind}: {} requests over 3 instances in {took:?}: {KEYS} executions, {replays} replays, \
         {conflicts} × 409",
        KEYS * COPIES
    );

    // Afterwards every instance replays every key (a sample), byte for byte.
    for k in (0..KEYS).step_by(10) {
        let key = format!("{run}-k{k}");
        let original = by_key[&key]
            .iter()
            .find(|g| !g.replayed && g.status == 201)
            .unwrap()
            .body
            .clone();
        for g in gateways.iter() {
            let r = pay(&c, &g.url("/pay"), &key).await.unwrap();
            assert!(r.replayed && r.status == 201, "{key}: {r:?}");
            assert_eq!(r.body, original);
        }
    }
    assert_eq!(up.total(), KEYS);
    if let Some(count) = records {
        assert_eq!(count(), KEYS, "records in the test's own table / prefix");
    }
}

/// Two gateways in wait mode: copies sent to B (and A) while the original
/// runs on A wait for it and get its replay, not 409.
async fn wait_mode_replays_across_instances(store: &str) {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let args = gateway_args(&up, store, &["--wait", "5s"]);
    let a = GatewayProc::start(dir.path(), "wa", &args).await;
    let b = GatewayProc::start(dir.path(), "wb", &args).await;
    let c = client();
    let run = unique("wait");

    for round in 0..3 {
        let key = format!("{run}-{round}");
        let original = tokio::spawn({
            let (c, url, key) = (c.clone(), a.url("/pay?ms=1200"), key.clone());
            async move {
                let r = pay(&c, &url, &key).await;
                (r, Instant::now())
            }
        });
        let deadline = Instant::now() + Duration::from_secs(10);
        while up.of_key(&key) == 0 {
            assert!(
                Instant::now() < deadline,
                "the original never reached the upstream"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let mut copies = tokio::task::JoinSet::new();
        for i in 0..6 {
            let url = if i < 4 {
                b.url("/pay?ms=1200")
            } else {
                a.url("/pay?ms=1200")
            };
            let (c, key) = (c.clone(), key.clone());
            copies.spawn(async move {
                let r = pay(&c, &url, &key).await;
                (r, Instant::now())
            });
        }
        let (first, first_at) = original.await.unwrap();
        let first = first.unwrap();
        assert_eq!(first.status, 201, "{first:?}\n{}", a.logs());
        assert!(!first.replayed);
        let mut lag = Duration::ZERO;
        while let Some(done) = copies.join_next().await {
            let (r, at) = done.unwrap();
            let r = r.unwrap();
            assert!(
                r.status == 201 && r.replayed,
                "a waiting copy did not get the replay: {r:?}\nA:\n{}\nB:\n{}",
                tail(&a.logs(), 30),
                tail(&b.logs(), 30)
            );
            assert_eq!(r.body, first.body);
            lag = lag.max(at.saturating_duration_since(first_at));
        }
        assert_eq!(up.of_key(&key), 1);
        // Woken by the store's notification (or its polling), well before
        // the 5 s wait runs out.
        assert!(
            lag < Duration::from_millis(2500),
            "copies answered {lag:?} after the original"
        );
        eprintln!("wait mode round {round}: copies answered at most {lag:?} after the original");
    }
}

/// The two multi-instance tests on one backend: `$store(label)` gives the
/// gateway's store URL, the server's URL, the name of the test's own
/// schema / table / prefix and its cleanup (run when the test ends);
/// `$count(server, name)` counts the records there.
macro_rules! backend_tests {
    ($once:ident, $wait:ident: $store:ident($label:literal, $wait_label:literal),
     $count:ident, $kind:literal) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $once() {
            let (store, base, name, drop_it) = $store($label);
            let _cleanup = OnDrop(drop_it);
            let count = || $count(&base, &name);
            each_key_runs_once_across_instances(&store, $kind, Some(&count)).await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $wait() {
            let (store, _, _, drop_it) = $store($wait_label);
            let _cleanup = OnDrop(drop_it);
            wait_mode_replays_across_instances(&store).await;
        }
    };
}

/// What `program args` prints, as a count.
fn count_of(program: &str, args: &[&str]) -> usize {
    stdout_of(program, args).parse().unwrap()
}

fn tail(s: &str, lines: usize) -> String {
    let v: Vec<&str> = s.lines().collect();
    v[v.len().saturating_sub(lines)..].join("\n")
}

// ------------------------------------------------------------- PostgreSQL

/// Counts the rows of `"schema"."records"`.
fn postgres_rows(base: &str, schema: &str) -> usize {
    let count = format!("SELECT count(*) FROM \"{schema}\".\"records\"");
    count_of("psql", &[base, "-Atc", &count])
}

fn postgres_store(label: &str) -> (String, String, String, impl FnMut()) {
    let base = POSTGRES.require();
    let schema = unique(label);
    let url = with_param(
        &with_param(&base, "idem_schema", &schema),
        "idem_table",
        "records",
    );
    let (b, sc) = (base.clone(), schema.clone());
    let drop_it = move || {
        cleanup(
            &format!("schema {schema}"),
            "psql",
            &[
                &base,
                "-q",
                "-v",
                "ON_ERROR_STOP=1",
                "-c",
                &format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE"),
            ],
        )
    };
    (url, b, sc, drop_it)
}

backend_tests!(
    postgres_three_instances_run_each_key_once,
    postgres_wait_mode_replays_across_instances:
    postgres_store("mi_pg", "mi_pgw"), postgres_rows, "postgres"
);

// ---------------------------------------------------------------- MariaDB

/// Counts the rows of `table`.
fn mysql_rows(base: &str, table: &str) -> usize {
    let mut args = mariadb_args(base);
    args.extend([
        "-N".into(),
        "-e".into(),
        format!("SELECT COUNT(*) FROM `{table}`"),
    ]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    count_of("mariadb", &args)
}

fn mysql_store(label: &str) -> (String, String, String, impl FnMut()) {
    let base = MYSQL.require();
    let table = unique(label);
    let url = with_param(&base, "idem_table", &table);
    let (b, t) = (base.clone(), table.clone());
    let drop_it = move || {
        let mut args = mariadb_args(&base);
        args.push("-e".into());
        args.push(format!("DROP TABLE IF EXISTS `{table}`, `{table}_fence`"));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        cleanup(&format!("table {table}"), "mariadb", &args)
    };
    (url, b, t, drop_it)
}

// MySQL has no notifications: in the wait-mode test, waiters poll (every 25 ms).
backend_tests!(
    mariadb_three_instances_run_each_key_once,
    mariadb_wait_mode_replays_across_instances:
    mysql_store("mi_my", "mi_myw"), mysql_rows, "mysql"
);

// ------------------------------------------------------------------ Redis

/// Counts the record hashes under `prefix`.
fn redis_records(base: &str, prefix: &str) -> usize {
    let (host, port) = redis_host_port(base);
    let pattern = format!("{{{prefix}:*}}:r");
    let count = "return #redis.call('KEYS', ARGV[1])";
    count_of(
        "redis-cli",
        &["-h", &host, "-p", &port, "EVAL", count, "0", &pattern],
    )
}

fn redis_store(label: &str) -> (String, String, String, impl FnMut()) {
    let base = REDIS.require();
    let prefix = unique(label);
    let url = with_param(&base, "idem_prefix", &prefix);
    let (b, p) = (base.clone(), prefix.clone());
    let drop_it = move || cleanup_redis_prefix(&base, &prefix);
    (url, b, p, drop_it)
}

backend_tests!(
    redis_three_instances_run_each_key_once,
    redis_wait_mode_replays_across_instances:
    redis_store("mi_rd", "mi_rdw"), redis_records, "redis"
);

// ---------------------------------------------------------- Redis Cluster

/// A 3-primary cluster this test starts itself (free ports, its own
/// folder), killed when the test ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_three_instances_run_each_key_once_and_wait_across_them() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = RedisCluster::start(dir.path());
    let store = with_param(&cluster.url(), "idem_prefix", &unique("mi_rc"));
    each_key_runs_once_across_instances(&store, "redis-cluster", None).await;
    wait_mode_replays_across_instances(&store).await;
}
