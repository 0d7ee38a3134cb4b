//! [`RedisStore`] on a real 3-primary Redis Cluster that this test binary
//! starts itself, on free loopback ports with its files in a temporary
//! folder: the whole conformance suite against `redis+cluster://…`, plus
//! slot placement, purging across every primary, and script reloads on
//! every primary.
//!
//! The cluster is started once per test binary (a shared fixture) and its
//! three `redis-server` processes are stopped by their PIDs: by the
//! fixture's `Drop` when it is dropped (a failed start), and — since a
//! `static` is never dropped — by a small watchdog process that kills exactly
//! those PIDs once this test process has exited, however it exited.
//!
//! Needs `redis-server` and `redis-cli` (`apt-get install -y redis-server
//! redis-tools`). `cargo test -p idem-redis --test cluster_tests`.

mod common;

use std::collections::BTreeSet;
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use common::{cli, connect, need_program, test_options, Server};
use idem_core::Store;
use idem_redis::RedisStore;
use idem_testkit::support::{acquire, expect_replay, fp, fresh_key, fresh_scope, req, response};
use idem_testkit::SleepingHarness;

/// Three primaries, no replicas.
struct Cluster {
    servers: Vec<Server>,
    watchdog: Option<Child>,
    _dir: tempfile::TempDir,
}

impl Drop for Cluster {
    /// Runs only when a start failed (the shared fixture is a `static`):
    /// stops the watchdog; the servers are then killed by their own `Drop`.
    fn drop(&mut self) {
        if let Some(mut w) = self.watchdog.take() {
            let _ = w.kill();
            let _ = w.wait();
        }
    }
}

impl Cluster {
    fn start() -> Self {
        need_program("redis-server");
        need_program("redis-cli");
        let dir = tempfile::Builder::new()
            .prefix("idem-redis-cluster-")
            .tempdir()
            .expect("temp dir");
        let mut servers = Vec::new();
        let mut used = BTreeSet::new();
        while servers.len() < 3 {
            let port = common::free_port();
            if !used.insert(port) {
                continue;
            }
            let conf = format!("nodes-{port}.conf");
            servers.push(Server::start(
                port,
                dir.path(),
                &["--cluster-enabled", "yes", "--cluster-config-file", &conf],
            ));
        }
        let mut cluster = Self {
            servers,
            watchdog: None,
            _dir: dir,
        };
        cluster.watchdog = Some(cluster.spawn_watchdog());
        let nodes: Vec<String> = cluster
            .servers
            .iter()
            .map(|s| format!("127.0.0.1:{}", s.port))
            .collect();
        common::run_ok(
            Command::new("redis-cli")
                .args(["--cluster", "create"])
                .args(&nodes)
                .args(["--cluster-replicas", "0", "--cluster-yes"]),
            "redis-cli --cluster create",
        );
        let deadline = Instant::now() + Duration::from_secs(30);
        for s in &cluster.servers {
            loop {
                let info = s.cli(&["cluster", "info"]);
                if info.contains("cluster_state:ok") && info.contains("cluster_known_nodes:3") {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "node {} did not reach cluster_state:ok within 30 s:\n{info}",
                    s.port
                );
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        cluster
    }

    /// Kills exactly this cluster's server PIDs once this test process is
    /// gone (statics are never dropped), then removes the cluster's
    /// temporary folder. Checks each PID still runs a redis-server on our
    /// port before killing it.
    fn spawn_watchdog(&self) -> Child {
        let me = std::process::id();
        let targets: Vec<String> = self
            .servers
            .iter()
            .map(|s| format!("{}:{}", s.pid(), s.port))
            .collect();
        let script = format!(
            "while kill -0 {me} 2>/dev/null; do sleep 1; done; \
             for t in {targets}; do p=${{t%%:*}}; port=${{t##*:}}; \
               if tr '\\0' ' ' < /proc/$p/cmdline 2>/dev/null | grep -q \"redis-server.*$port\"; \
               then kill -9 $p; fi; \
             done; rm -rf '{dir}'",
            targets = targets.join(" "),
            dir = self._dir.path().display()
        );
        Command::new("sh")
            .args(["-c", &script])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn the cluster watchdog")
    }

    fn url(&self) -> String {
        let nodes: Vec<String> = self
            .servers
            .iter()
            .map(|s| format!("127.0.0.1:{}", s.port))
            .collect();
        format!("redis+cluster://{}", nodes.join(","))
    }
}

fn cluster() -> &'static Cluster {
    static CLUSTER: OnceLock<Cluster> = OnceLock::new();
    CLUSTER.get_or_init(Cluster::start)
}

async fn cluster_store() -> RedisStore {
    let url = tokio::task::spawn_blocking(|| cluster().url())
        .await
        .expect("start the cluster");
    connect(&url, test_options()).await
}

idem_testkit::conformance_tests!(cluster_tests, || async {
    let url = tokio::task::spawn_blocking(|| cluster().url())
        .await
        .expect("start the cluster");
    SleepingHarness(connect(&url, common::check_options()).await)
});

const MIN: Duration = Duration::from_secs(60);

mod cluster_only {
    use super::*;

    /// The slot ranges of each primary: (start, end, port).
    fn slot_ranges(port: u16) -> Vec<(u16, u16, u16)> {
        // `CLUSTER NODES`: one line per node, its slot ranges at the end.
        let nodes = cli(port, &["cluster", "nodes"]);
        let mut ranges = Vec::new();
        for line in nodes.lines() {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() < 9 || !f[2].contains("master") {
                continue;
            }
            let node_port: u16 = f[1]
                .split('@')
                .next()
                .and_then(|a| a.rsplit_once(':'))
                .and_then(|(_, p)| p.parse().ok())
                .expect("node port");
            for r in &f[8..] {
                let (a, b) = r.split_once('-').unwrap_or((r, r));
                ranges.push((
                    a.parse().expect("slot"),
                    b.parse().expect("slot"),
                    node_port,
                ));
            }
        }
        ranges
    }

    fn slot_of(port: u16, key: &str) -> u16 {
        cli(port, &["cluster", "keyslot", key])
            .trim()
            .parse()
            .expect("CLUSTER KEYSLOT")
    }

    /// A record's keys share one slot; records spread over every primary;
    /// `purge_expired` scans every primary and removes them all.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn records_spread_over_primaries_and_purge_finds_them_all() {
        let store = cluster_store().await;
        let port = cluster().servers[0].port;
        let ranges = slot_ranges(port);
        assert!(ranges.len() >= 3, "three primaries own slots: {ranges:?}");
        let scope = fresh_scope();
        let mut owners = BTreeSet::new();
        let keys: Vec<_> = (0..30).map(|i| fresh_key(&format!("spread-{i}"))).collect();
        for key in &keys {
            acquire(
                &store,
                &req(&scope, key, fp("a"), Duration::from_millis(300)),
            )
            .await;
            let record = store.record_key(&scope, key);
            let tag = record.strip_suffix(":r").expect(":r");
            let slot = slot_of(port, &record);
            assert_eq!(
                slot,
                slot_of(port, &format!("{tag}:f")),
                "record and fence share a slot"
            );
            assert_eq!(slot, slot_of(port, &format!("{tag}:chg")));
            let owner = ranges
                .iter()
                .find(|(a, b, _)| (*a..=*b).contains(&slot))
                .map(|r| r.2)
                .expect("an owner");
            owners.insert(owner);
        }
        assert_eq!(owners.len(), 3, "30 records land on all three primaries");
        tokio::time::sleep(Duration::from_millis(500)).await;
        let n = store.purge_expired().await.expect("purge");
        assert!(n >= 30, "purged {n}; 30 had ended");
        for key in &keys {
            assert!(
                !store.delete(&scope, key).await.expect("delete"),
                "purged on every primary"
            );
        }
    }

    /// Waiters are woken by pub/sub on a Cluster too (a plain `PUBLISH`
    /// reaches every node): well before the 1 s safety poll, with polling
    /// set to 10 s so only a message can wake them.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn wait_for_change_wakes_by_pubsub() {
        let url = tokio::task::spawn_blocking(|| cluster().url())
            .await
            .expect("cluster");
        let store = connect(
            &url,
            test_options().with_poll_interval(Duration::from_secs(10)),
        )
        .await;
        let scope = fresh_scope();
        for i in 0..6 {
            let key = fresh_key(&format!("wake-{i}"));
            let lease = acquire(&store, &req(&scope, &key, fp("a"), MIN)).await;
            let waiter = common::spawn_waiter(&store, &scope, &key);
            tokio::time::sleep(Duration::from_millis(300)).await;
            store
                .complete(&lease, &response("done"), MIN)
                .await
                .expect("complete");
            let waited = waiter.await.expect("waiter");
            assert!(
                waited < Duration::from_millis(900),
                "key {i}: woke after {waited:?}"
            );
        }
    }

    /// `SCRIPT FLUSH` on every primary: the steps still work (NOSCRIPT →
    /// load on the node that owns the key → EVALSHA).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn steps_survive_script_flush_on_every_primary() {
        let store = cluster_store().await;
        let flush = || {
            for s in &cluster().servers {
                assert_eq!(s.cli(&["script", "flush"]).trim(), "OK");
            }
        };
        let scope = fresh_scope();
        for i in 0..6 {
            let key = fresh_key(&format!("flush-{i}"));
            let r = req(&scope, &key, fp("a"), MIN);
            flush();
            let lease = acquire(&store, &r).await;
            flush();
            store
                .complete(&lease, &response("ok"), MIN)
                .await
                .expect("complete after flush");
            flush();
            expect_replay(&store, &r, &response("ok")).await;
        }
    }
}
