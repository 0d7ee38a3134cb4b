//! `MemoryStore` throughput: a claim and its completion (`begin` then
//! `complete` on a fresh key), and a replay (`begin` on a completed key).
//!
//! `cargo bench -p idem-testkit --bench memory`

// `criterion_group!` defines an undocumented `pub fn`.
#![allow(missing_docs)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion};
use idem_core::{
    Begin, BeginRequest, Fingerprint, IdempotencyKey, MemoryStore, Scope, Store, StoredResponse,
};

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
    let store = MemoryStore::new();
    let resp = StoredResponse::new(201, br#"{"id":42,"status":"paid"}"#.to_vec());
    let ttl = Duration::from_secs(3600);
    let n = AtomicU64::new(0);
    let mut group = c.benchmark_group("memory");
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
}

criterion_group!(benches, bench);
criterion_main!(benches);
