//! `SqliteStore` throughput on a file in a temporary directory (WAL,
//! `synchronous = FULL`): a claim and its completion (`begin` then
//! `complete` on a fresh key: two commits, each synced to disk), and a
//! replay (`begin` on a completed key: one read).
//!
//! `cargo bench -p idem-sql --bench sqlite`

// `criterion_group!` defines an undocumented `pub fn`.
#![allow(missing_docs)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion};
use idem_core::{Begin, BeginRequest, Fingerprint, IdempotencyKey, Scope, Store, StoredResponse};
use idem_sql::SqliteStore;

fn request(key: &str) -> BeginRequest {
    BeginRequest {
        scope: Scope::anonymous(),
        key: IdempotencyKey::new(key).expect("key"),
        fingerprint: Fingerprint::of(b"POST /orders {\"amount\":1000}"),
        lease: Duration::from_secs(30),
    }
}

fn bench(c: &mut Criterion) {
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("bench.db");
    let store = rt
        .block_on(SqliteStore::open(path.to_str().expect("utf-8 path")))
        .expect("open");
    let resp = StoredResponse::new(201, br#"{"id":42,"status":"paid"}"#.to_vec());
    let ttl = Duration::from_secs(3600);
    let n = AtomicU64::new(0);
    let mut group = c.benchmark_group("sqlite");
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
        store.complete(&lease, &resp, ttl).await.expect("complete");
    });
    group.bench_function("replay", |b| {
        b.to_async(&rt).iter(|| async {
            let got = store.begin(&done).await.expect("begin");
            assert!(matches!(got, Begin::Replay(_)));
        })
    });
    group.finish();
    rt.block_on(store.close());
}

criterion_group!(benches, bench);
criterion_main!(benches);
