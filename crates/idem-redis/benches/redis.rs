//! `RedisStore` latency against one Redis server (`IDEM_TEST_REDIS_URL`,
//! default `redis://127.0.0.1:6379/`), one caller at a time: a claim and its
//! completion (`begin` then `complete` on a fresh key: two scripts, two round
//! trips), and a replay (`begin` on a completed key: one round trip).
//!
//! `cargo bench -p idem-redis --bench redis`
//!
//! Keys use a random prefix and a 10 s TTL, so the bench leaves nothing
//! behind for long.

// `criterion_group!` defines an undocumented `pub fn`.
#![allow(missing_docs)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion};
use idem_core::{Begin, BeginRequest, Fingerprint, IdempotencyKey, Scope, Store, StoredResponse};
use idem_redis::{RedisOptions, RedisStore};

fn request(key: &str) -> BeginRequest {
    BeginRequest {
        scope: Scope::anonymous(),
        key: IdempotencyKey::new(key).expect("key"),
        fingerprint: Fingerprint::of(b"POST /orders {\"amount\":1000}"),
        lease: Duration::from_secs(30),
    }
}

fn bench(c: &mut Criterion) {
    let url = std::env::var("IDEM_TEST_REDIS_URL")
        .unwrap_or_else(|_| "redis://127.0.0.1:6379/".to_owned());
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let prefix = format!("idem-bench-{}", std::process::id());
    let store = rt
        .block_on(RedisStore::connect_with(
            &url,
            RedisOptions::default()
                .with_key_prefix(prefix)
                .with_keep_expired(Duration::from_secs(5)),
        ))
        .unwrap_or_else(|e| {
            panic!(
                "cannot reach Redis at {url}: {e}. Start it with: redis-server --daemonize yes \
                 --bind 127.0.0.1 -::1 --port 6379 --save \"\" --appendonly no \
                 --dir /var/lib/redis --logfile /var/log/redis/ci.log"
            )
        });
    let resp = StoredResponse::new(201, br#"{"id":42,"status":"paid"}"#.to_vec());
    let ttl = Duration::from_secs(10);
    let n = AtomicU64::new(0);
    let mut group = c.benchmark_group("redis");
    group.bench_function("begin_complete", |b| {
        b.to_async(&rt).iter(|| async {
            let req = request(&format!("order-{}", n.fetch_add(1, Ordering::Relaxed)));
            let Ok(Begin::Acquired(lease)) = store.begin(&req).await else {
                panic!("a fresh key is acquired");
            };
            store.complete(&lease, &resp, ttl).await.expect("complete");
        })
    });
    let done = request("replayed");
    rt.block_on(async {
        let Ok(Begin::Acquired(lease)) = store.begin(&done).await else {
            panic!("acquire");
        };
        store
            .complete(&lease, &resp, Duration::from_secs(600))
            .await
            .expect("complete");
    });
    group.bench_function("replay", |b| {
        b.to_async(&rt).iter(|| async {
            let got = store.begin(&done).await.expect("begin");
            assert!(matches!(got, Begin::Replay(_)));
        })
    });
    group.finish();
    rt.block_on(async {
        store
            .delete(&done.scope, &done.key)
            .await
            .expect("clean up");
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
