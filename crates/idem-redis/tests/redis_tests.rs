//! [`RedisStore`] on one Redis server: the whole conformance suite against
//! the shared server (`IDEM_TEST_REDIS_URL`, default
//! `redis://127.0.0.1:6379/`, a random key prefix per run), plus what the
//! suite cannot see: script reloads after `SCRIPT FLUSH` and after a server
//! restart, races from two connections, corrupt records, an unreachable or
//! stalled server, millisecond expiry in Redis itself, fences without their
//! counter, and pub/sub wake-ups.
//!
//! `cargo test -p idem-redis --test redis_tests`. A server that cannot be
//! reached fails the tests with the command that starts it.

mod common;

use std::time::{Duration, Instant};

use common::{connect, raw, redis_url, shared_store, test_options, Server};
use idem_core::{Begin, Phase, Record, RecordState, Store, StoreError};
use idem_redis::RedisStore;
use idem_testkit::server_checks::{expect_corrupt, race_begins};
use idem_testkit::support::{
    acquire, expect_in_flight, expect_replay, fp, fresh_key, fresh_scope, get, req, response,
    rich_response,
};
use idem_testkit::SleepingHarness;
use redis::AsyncCommands;

idem_testkit::conformance_tests!(redis_tests, || async {
    SleepingHarness(connect(&redis_url(), common::check_options()).await)
});

const MIN: Duration = Duration::from_secs(60);

/// `got` is `Unavailable` or `Timeout` in `phase` (a server that is not
/// there), and came less than `within` after `started`; returns the error.
fn expect_down<T: std::fmt::Debug>(
    got: Result<T, StoreError>,
    phase: Phase,
    started: Instant,
    within: Duration,
) -> StoreError {
    let e =
        match got {
            Err(
                e @ (StoreError::Unavailable { phase: p, .. } | StoreError::Timeout { phase: p }),
            ) if p == phase => e,
            other => panic!("expected Unavailable or Timeout at {phase:?}, got {other:?}"),
        };
    assert!(
        started.elapsed() < within,
        "gave up after {:?}",
        started.elapsed()
    );
    e
}

mod redis_only {
    use super::*;

    /// `SCRIPT FLUSH` empties the server's script cache; every step still
    /// works (EVALSHA → NOSCRIPT → EVAL within one call). On a private
    /// server, so other tests' scripts on the shared one are not flushed.
    #[tokio::test]
    async fn steps_survive_script_flush() {
        let dir = tempfile::tempdir().expect("temp dir");
        let server = Server::start(common::free_port(), dir.path(), &[]);
        let store = connect(&server.url(), test_options()).await;
        let (scope, key) = (fresh_scope(), fresh_key("flush"));
        let r = req(&scope, &key, fp("a"), MIN);
        let flush = || assert_eq!(server.cli(&["script", "flush"]).trim(), "OK");
        flush();
        let lease = acquire(&store, &r).await;
        flush();
        let lease = store.extend(&lease, MIN).await.expect("extend after flush");
        flush();
        expect_in_flight(&store, &r, MIN).await;
        flush();
        store
            .complete(&lease, &rich_response(), MIN)
            .await
            .expect("complete after flush");
        flush();
        expect_replay(&store, &r, &rich_response()).await;
        flush();
        assert!(get(&store, &scope, &key).await.is_some());
        flush();
        assert!(store
            .delete(&scope, &key)
            .await
            .expect("delete after flush"));
        flush();
        store.purge_expired().await.expect("purge after flush");
        flush();
        acquire(&store, &req(&scope, &fresh_key("flush-2"), fp("a"), MIN)).await;
        // That EVAL cached the script again.
        assert_eq!(server.cli(&["script", "exists", &begin_sha()]).trim(), "1");
    }

    /// The SHA-1 of the `begin` script as the store sends it.
    fn begin_sha() -> String {
        let source = concat!(
            include_str!("../lua/lib.lua"),
            include_str!("../lua/begin.lua")
        );
        redis::Script::new(source).get_hash().to_owned()
    }

    /// 64 concurrent begins of one key, half through each of two stores
    /// (two separate connections): exactly one `Acquired`.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn sixty_four_begins_from_two_connections_one_winner() {
        let a = shared_store().await;
        let b = shared_store().await;
        let (scope, key) = (fresh_scope(), fresh_key("race64"));
        let r = req(&scope, &key, fp("a"), MIN);
        let won = race_begins(&a, &b, &r, 64).await;
        b.complete(&won, &response("won"), MIN)
            .await
            .expect("complete through the other connection");
        expect_replay(&a, &r, &response("won")).await;
    }

    /// Corrupt records are `Corrupt` errors from `begin` and `get` (never a
    /// panic, never overwritten); `delete` removes them and the key works again.
    #[tokio::test]
    async fn corrupt_records_are_corrupt_errors() {
        let store = shared_store().await;
        let mut admin = raw(&redis_url()).await;
        let scope = fresh_scope();
        type Corrupter = fn(&str) -> redis::Cmd;
        let corrupters: Vec<(&str, Corrupter)> = vec![
            ("unknown state", |k| {
                let mut c = redis::cmd("HSET");
                c.arg(k).arg("state").arg("weird");
                c
            }),
            ("short fingerprint", |k| {
                let mut c = redis::cmd("HSET");
                c.arg(k).arg("fingerprint").arg("abc");
                c
            }),
            ("undecodable response", |k| {
                let mut c = redis::cmd("HSET");
                c.arg(k).arg("response").arg(&b"\x09\x00garbage"[..]);
                c
            }),
            ("expiry not a number", |k| {
                let mut c = redis::cmd("HSET");
                c.arg(k).arg("expires_at").arg("soon");
                c
            }),
            ("missing response", |k| {
                let mut c = redis::cmd("HDEL");
                c.arg(k).arg("response");
                c
            }),
            ("not a hash", |k| {
                let mut c = redis::cmd("SET");
                c.arg(k).arg("a string");
                c
            }),
        ];
        for (what, corrupter) in corrupters {
            let key = fresh_key("corrupt");
            let r = req(&scope, &key, fp("a"), MIN);
            let lease = acquire(&store, &r).await;
            store
                .complete(&lease, &response("ok"), MIN)
                .await
                .expect("complete");
            let record = store.record_key(&scope, &key);
            if what == "not a hash" {
                let () = admin.del(&record).await.expect("DEL");
            }
            let () = corrupter(&record)
                .query_async(&mut admin)
                .await
                .expect("corrupt the record");
            expect_corrupt(&store, &r, what).await;
            // begin did not overwrite it: still corrupt.
            assert!(store.get(&scope, &key).await.is_err(), "{what}");
            assert!(store.delete(&scope, &key).await.expect("delete"), "{what}");
            let again = acquire(&store, &r).await;
            assert!(again.fence > lease.fence, "{what}: fences still grow");
        }
    }

    /// A port nobody listens on: `connect` fails with `Unavailable` (phase
    /// `Connect`) within the connection timeout, without hanging.
    #[tokio::test]
    async fn unreachable_server_is_unavailable_quickly() {
        let port = common::free_port();
        let started = Instant::now();
        let got = tokio::time::timeout(
            Duration::from_secs(10),
            RedisStore::connect_with(
                &format!("redis://127.0.0.1:{port}/"),
                test_options().with_connection_timeout(Duration::from_millis(500)),
            ),
        )
        .await
        .expect("connect must give up by itself");
        let e = expect_down(got, Phase::Connect, started, Duration::from_secs(2));
        if let StoreError::Unavailable { .. } = e {
            assert!(
                std::error::Error::source(&e).is_some(),
                "keeps the Redis error"
            );
        }
        let cluster = RedisStore::connect_with(
            &format!("redis+cluster://127.0.0.1:{port}"),
            test_options().with_connection_timeout(Duration::from_millis(500)),
        )
        .await;
        assert!(
            matches!(
                cluster,
                Err(StoreError::Unavailable { .. } | StoreError::Timeout { .. })
            ),
            "{cluster:?}"
        );
    }

    /// A private server goes away under a connected store: steps fail with
    /// `Unavailable`/`Timeout` within the response timeout (no hang). It
    /// comes back empty (no scripts, no data) on the same port: the store
    /// reconnects by itself and the steps work again.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn server_outage_then_restart() {
        let dir = tempfile::tempdir().expect("temp dir");
        let port = common::free_port();
        let mut server = Server::start(port, dir.path(), &[]);
        let store = connect(
            &server.url(),
            test_options().with_response_timeout(Duration::from_millis(500)),
        )
        .await;
        let scope = fresh_scope();
        acquire(&store, &req(&scope, &fresh_key("before"), fp("a"), MIN)).await;
        server.kill();
        for _ in 0..3 {
            let started = Instant::now();
            let got = store
                .begin(&req(&scope, &fresh_key("down"), fp("a"), MIN))
                .await;
            expect_down(got, Phase::Begin, started, Duration::from_millis(1500));
        }
        let _server = Server::start(port, dir.path(), &[]);
        let key = fresh_key("after");
        let r = req(&scope, &key, fp("a"), MIN);
        let deadline = Instant::now() + Duration::from_secs(10);
        let lease = loop {
            match store.begin(&r).await {
                Ok(Begin::Acquired(l)) => break l,
                Ok(other) => panic!("unexpected {other:?}"),
                Err(e) if Instant::now() < deadline => {
                    eprintln!("not back yet: {e}");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Err(e) => panic!("the store did not recover within 10 s: {e}"),
            }
        };
        store
            .complete(&lease, &response("back"), MIN)
            .await
            .expect("complete after restart");
        expect_replay(&store, &r, &response("back")).await;
    }

    /// A server that stalls (`CLIENT PAUSE`): the step fails with `Timeout`
    /// after the response timeout. Its effect is unknown — here the claim
    /// lands once the pause ends, so the key is in flight and nobody runs it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn stalled_server_times_out_and_the_effect_is_unknown() {
        let dir = tempfile::tempdir().expect("temp dir");
        let server = Server::start(common::free_port(), dir.path(), &[]);
        let store = connect(
            &server.url(),
            test_options().with_response_timeout(Duration::from_millis(300)),
        )
        .await;
        let (scope, key) = (fresh_scope(), fresh_key("stalled"));
        let r = req(&scope, &key, fp("a"), MIN);
        assert_eq!(server.cli(&["client", "pause", "1500", "all"]).trim(), "OK");
        let started = Instant::now();
        match store.begin(&r).await {
            Err(StoreError::Timeout {
                phase: Phase::Begin,
            }) => {}
            other => panic!("expected Timeout, got {other:?}"),
        }
        let took = started.elapsed();
        assert!(
            took >= Duration::from_millis(250) && took < Duration::from_millis(1000),
            "{took:?}"
        );
        tokio::time::sleep(Duration::from_millis(1500)).await;
        match store.begin(&r).await.expect("begin after the pause") {
            Begin::InFlight { .. } => {}
            other => panic!(
                "the timed-out claim landed after the pause: expected InFlight, got {other:?}"
            ),
        }
    }

    /// Redis itself expires records in milliseconds: the record's `PTTL` is
    /// its lease (or TTL) plus `keep_expired`, and the fence counter
    /// outlives it (CASES B2: 1,500 ms is 1.5 s, not 1,500 s).
    #[tokio::test]
    async fn redis_expiry_is_in_milliseconds() {
        let keep = Duration::from_secs(30);
        let store = connect(&redis_url(), test_options().with_keep_expired(keep)).await;
        let mut admin = raw(&redis_url()).await;
        let (scope, key) = (fresh_scope(), fresh_key("pttl"));
        let record = store.record_key(&scope, &key);
        let fence_key = format!("{}:f", record.strip_suffix(":r").expect(":r"));
        let lease = acquire(
            &store,
            &req(&scope, &key, fp("a"), Duration::from_millis(1500)),
        )
        .await;
        let pttl: i64 = admin.pttl(&record).await.expect("PTTL");
        assert!(
            (30_000..=31_500).contains(&pttl),
            "record PTTL {pttl} ms: lease 1,500 ms + keep 30,000 ms"
        );
        let fttl: i64 = admin.pttl(&fence_key).await.expect("PTTL");
        assert!(
            fttl > pttl + 25_000,
            "fence counter outlives the record: {fttl} vs {pttl}"
        );
        let stored: String = admin.get(&fence_key).await.expect("GET fence");
        assert_eq!(stored, lease.fence.to_string());
        store
            .complete(&lease, &response("x"), Duration::from_millis(2500))
            .await
            .expect("complete");
        let pttl: i64 = admin.pttl(&record).await.expect("PTTL");
        assert!((31_000..=32_500).contains(&pttl), "completed PTTL {pttl}");
        let state: String = admin.hget(&record, "state").await.expect("HGET");
        assert_eq!(state, "completed");
        let lease_until: Option<String> = admin.hget(&record, "lease_until").await.expect("HGET");
        assert_eq!(lease_until, None, "a completed record has no lease");
    }

    /// `keep_expired` bounds how long an ended claim stays current: within
    /// it a late `complete` lands; after it Redis has dropped the record,
    /// the late `complete` is `LeaseLost`, and the fence counter (kept
    /// longer) still makes the next fence larger.
    #[tokio::test]
    async fn keep_expired_bounds_late_completes() {
        let store = connect(
            &redis_url(),
            test_options().with_keep_expired(Duration::from_millis(400)),
        )
        .await;
        let scope = fresh_scope();
        let short = Duration::from_millis(200);
        let (k1, k2) = (fresh_key("late-in"), fresh_key("late-out"));
        let in_time = acquire(&store, &req(&scope, &k1, fp("a"), short)).await;
        let too_late = acquire(&store, &req(&scope, &k2, fp("a"), short)).await;
        tokio::time::sleep(Duration::from_millis(350)).await;
        store
            .complete(&in_time, &response("late"), MIN)
            .await
            .expect("ended 150 ms ago, kept for 400 ms: still current");
        tokio::time::sleep(Duration::from_millis(500)).await;
        match store.complete(&too_late, &response("too late"), MIN).await {
            Err(StoreError::LeaseLost { fence }) => assert_eq!(fence, too_late.fence),
            other => panic!("Redis dropped the record: expected LeaseLost, got {other:?}"),
        }
        let next = acquire(&store, &req(&scope, &k2, fp("a"), MIN)).await;
        assert!(next.fence > too_late.fence);
        expect_replay(&store, &req(&scope, &k1, fp("a"), MIN), &response("late")).await;
    }

    /// Fences keep growing even when the counter key is gone (its fallback
    /// is the server's clock in µs).
    #[tokio::test]
    async fn fences_grow_without_the_counter() {
        let store = shared_store().await;
        let mut admin = raw(&redis_url()).await;
        let (scope, key) = (fresh_scope(), fresh_key("nocounter"));
        let r = req(&scope, &key, fp("a"), MIN);
        let first = acquire(&store, &r).await;
        let now_us = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("clock")
            .as_micros() as u64;
        assert!(
            first.fence.abs_diff(now_us) < 60_000_000,
            "a fresh key's fence is the server time in µs: {} vs {now_us}",
            first.fence
        );
        store.release(&first).await.expect("release");
        let record = store.record_key(&scope, &key);
        let fence_key = format!("{}:f", record.strip_suffix(":r").expect(":r"));
        let () = admin.del(&fence_key).await.expect("DEL counter");
        let second = acquire(&store, &r).await;
        assert!(second.fence > first.fence);
        // With the counter, back-to-back claims still grow by at least one.
        store.release(&second).await.expect("release");
        let third = acquire(&store, &r).await;
        assert!(third.fence > second.fence);
    }

    /// `wait_for_change` is woken by pub/sub (well before the 1 s safety
    /// poll), also for several waiters on one key and after a release; a
    /// crashed holder's lease end wakes it too.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn wait_for_change_wakes_on_publish_and_lease_end() {
        // A poll interval of 10 s: only a message can wake the waiters early.
        let store = connect(
            &redis_url(),
            test_options().with_poll_interval(Duration::from_secs(10)),
        )
        .await;
        let (scope, key) = (fresh_scope(), fresh_key("pubsub"));
        let r = req(&scope, &key, fp("a"), MIN);
        for round in 0..2 {
            let lease = acquire(&store, &r).await;
            let waiters: Vec<_> = (0..3)
                .map(|_| common::spawn_waiter(&store, &scope, &key))
                .collect();
            tokio::time::sleep(Duration::from_millis(300)).await;
            if round == 0 {
                store.release(&lease).await.expect("release");
            } else {
                store
                    .complete(&lease, &response("done"), MIN)
                    .await
                    .expect("complete");
            }
            for w in waiters {
                let waited = w.await.expect("waiter");
                assert!(
                    waited < Duration::from_millis(900),
                    "round {round}: woke after {waited:?}"
                );
            }
        }
        // The last waiter gone, the channel is unsubscribed.
        let channel = format!(
            "{}:chg",
            store
                .record_key(&scope, &key)
                .strip_suffix(":r")
                .expect(":r")
        );
        let admin = raw(&redis_url()).await;
        let unsubscribed = idem_testkit::support::eventually(Duration::from_secs(3), || {
            let (mut admin, channel) = (admin.clone(), channel.clone());
            async move {
                let counts: Vec<(String, u64)> = redis::cmd("PUBSUB")
                    .arg("NUMSUB")
                    .arg(&channel)
                    .query_async(&mut admin)
                    .await
                    .expect("PUBSUB NUMSUB");
                counts.first().map(|c| c.1) == Some(0)
            }
        })
        .await;
        assert!(unsubscribed, "{channel} is still subscribed");
        // A holder that never finishes: the waiter returns at its lease end.
        let (scope, key) = (fresh_scope(), fresh_key("crashed"));
        acquire(
            &store,
            &req(&scope, &key, fp("a"), Duration::from_millis(400)),
        )
        .await;
        let waited = common::spawn_waiter(&store, &scope, &key)
            .await
            .expect("waiter");
        assert!(
            waited < Duration::from_millis(1000),
            "woke after {waited:?}"
        );
        match get(&store, &scope, &key).await {
            None => {}
            Some(Record {
                state: RecordState::InProgress { .. },
                ..
            }) => panic!("woke before the lease ended"),
            other => panic!("unexpected {other:?}"),
        }
    }

    /// Without pub/sub (the subscriber connection cannot be opened — here
    /// the server is gone for the subscriber but not for the data, which we
    /// emulate by a store whose pub/sub is refused via ACL), waiting polls.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn wait_for_change_polls_when_subscribe_is_refused() {
        let dir = tempfile::tempdir().expect("temp dir");
        let server = Server::start(common::free_port(), dir.path(), &[]);
        // A user that may run everything but pub/sub commands.
        assert_eq!(
            server
                .cli(&[
                    "acl",
                    "setuser",
                    "nosub",
                    "on",
                    ">pw",
                    "~*",
                    "&*",
                    "+@all",
                    "-subscribe",
                    "-psubscribe",
                    "-ssubscribe"
                ])
                .trim(),
            "OK"
        );
        let url = format!("redis://nosub:pw@127.0.0.1:{}/", server.port);
        let store = connect(
            &url,
            test_options().with_poll_interval(Duration::from_millis(20)),
        )
        .await;
        let (scope, key) = (fresh_scope(), fresh_key("poll"));
        let lease = acquire(&store, &req(&scope, &key, fp("a"), MIN)).await;
        let completer = {
            let store = store.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(300)).await;
                store.complete(&lease, &response("polled"), MIN).await
            })
        };
        let waited = common::spawn_waiter(&store, &scope, &key)
            .await
            .expect("waiter");
        assert!(
            waited >= Duration::from_millis(250) && waited < Duration::from_secs(3),
            "woke after {waited:?}"
        );
        completer.await.expect("task").expect("complete");
        expect_replay(
            &store,
            &req(&scope, &key, fp("a"), MIN),
            &response("polled"),
        )
        .await;
    }

    /// `rediss://` to a TLS-only server whose certificate chains to the CA
    /// given in the options: every step works, pub/sub too. Without that CA
    /// (the system's roots) the certificate is refused.
    #[cfg(feature = "tls")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn tls_with_a_private_ca() {
        let dir = tempfile::tempdir().expect("temp dir");
        let (server, ca) = Server::start_tls(common::free_port(), dir.path());
        let url = format!("rediss://127.0.0.1:{}/", server.port);
        let store = connect(&url, test_options().with_tls_root_cert_pem(ca)).await;
        let (scope, key) = (fresh_scope(), fresh_key("tls"));
        let r = req(&scope, &key, fp("a"), MIN);
        let lease = acquire(&store, &r).await;
        expect_in_flight(&store, &r, MIN).await;
        let completer = {
            let store = store.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(200)).await;
                store.complete(&lease, &rich_response(), MIN).await
            })
        };
        let t = Instant::now();
        store
            .wait_for_change(&scope, &key, Duration::from_secs(10))
            .await
            .expect("wait");
        assert!(
            t.elapsed() < Duration::from_millis(900),
            "{:?}",
            t.elapsed()
        );
        completer.await.expect("task").expect("complete");
        expect_replay(&store, &r, &rich_response()).await;
        match RedisStore::connect_with(&url, test_options()).await {
            Err(StoreError::Unavailable {
                phase: Phase::Connect,
                ..
            }) => {}
            other => panic!("an unknown CA must be refused, got {other:?}"),
        }
    }

    /// Bad URLs and options are `Config` errors before any I/O.
    #[tokio::test]
    async fn bad_urls_and_options_are_config_errors() {
        for url in [
            "memory://",
            "redis://",
            "redis+cluster://",
            "redis+cluster://h:1/2",
        ] {
            assert!(
                matches!(RedisStore::connect(url).await, Err(StoreError::Config(_))),
                "{url}"
            );
        }
        assert!(matches!(
            RedisStore::connect_with(&redis_url(), test_options().with_key_prefix("a{b}")).await,
            Err(StoreError::Config(_))
        ));
    }

    /// Listing with a tiny `SCAN` step (`COUNT 2`, so a call's 32 steps
    /// cover only part of the keyspace): pages may be short or empty, but
    /// following the cursors visits every record once. Records without
    /// their scope and key (written by an older idem) and undecodable ones
    /// are skipped, not errors.
    #[tokio::test]
    async fn listing_with_short_scan_steps_and_odd_records() {
        use idem_core::admin::{ListQuery, StateFilter};
        let options = common::check_options().with_scan_count(2);
        let store = connect(&redis_url(), options).await;
        let a = store.admin().expect("Redis lists");
        let scope = fresh_scope();
        let mut want = std::collections::BTreeSet::new();
        for i in 0..40 {
            let k = fresh_key(&format!("short-scan-{i}"));
            acquire(&store, &req(&scope, &k, fp("a"), MIN)).await;
            want.insert(k.as_str().to_owned());
        }
        let mut raw_conn = raw(&redis_url()).await;
        // An older record: no scope or key fields.
        let old = store.record_key(&scope, &fresh_key("old"));
        let _: () = redis::cmd("HSET")
            .arg(&old)
            .arg("state")
            .arg("in_progress")
            .arg("fingerprint")
            .arg(&[7u8; 32][..])
            .arg("fence")
            .arg("1")
            .arg("lease_until")
            .arg("99999999999999")
            .query_async(&mut raw_conn)
            .await
            .expect("HSET");
        // An undecodable one.
        let bad = store.record_key(&scope, &fresh_key("bad"));
        let _: () = redis::cmd("HSET")
            .arg(&bad)
            .arg("state")
            .arg("weird")
            .arg("scope")
            .arg(scope.as_str())
            .query_async(&mut raw_conn)
            .await
            .expect("HSET");
        let mut q = ListQuery {
            state: StateFilter::InFlight,
            scope: Some(scope.clone()),
            limit: 5,
            cursor: None,
        };
        let mut got = Vec::new();
        let mut pages = 0;
        loop {
            let p = a.list(&q).await.expect("list");
            assert!(p.records.len() <= 5);
            pages += 1;
            assert!(pages < 10_000, "the listing does not end");
            got.extend(p.records.into_iter().map(|r| r.key.as_str().to_owned()));
            match p.next {
                Some(c) => q.cursor = Some(c),
                None => break,
            }
        }
        let set: std::collections::BTreeSet<_> = got.iter().cloned().collect();
        assert_eq!(set.len(), got.len(), "each record once: {got:?}");
        assert_eq!(set, want);
        assert!(
            pages >= 8,
            "40 records by 5 take at least 8 pages, took {pages}"
        );
        for k in [old, bad] {
            let _: () = redis::cmd("DEL")
                .arg(&k)
                .query_async(&mut raw_conn)
                .await
                .expect("DEL");
        }
    }
}
