//! `RedisStore` latency against one Redis server (`IDEM_TEST_REDIS_URL`,
//! default `redis://127.0.0.1:6379/`), one caller at a time: a claim and its
//! completion (`begin` then `complete` on a fresh key: two scripts, two round
//! trips), and a replay (`begin` on a completed key: one round trip).
//!
//! `cargo bench -p idem-redis --bench redis`
//!
//! Keys use a random prefix and a 60 s TTL, so the bench leaves nothing
//! behind for long.

// `criterion_group!` defines an undocumented `pub fn`.
#![allow(missing_docs)]

use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion};
use idem_core::Store;
use idem_redis::{RedisOptions, RedisStore};
use idem_testkit::bench::begin_complete_and_replay;

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
    // Records expire from the shared server within a minute (long enough for
    // the replay measurement to find its record).
    let done = begin_complete_and_replay(c, &rt, "redis", &store, Duration::from_secs(60));
    rt.block_on(async {
        store
            .delete(&done.scope, &done.key)
            .await
            .expect("clean up");
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
