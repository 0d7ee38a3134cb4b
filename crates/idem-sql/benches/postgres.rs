//! `PostgresStore` throughput against the server at `IDEM_TEST_POSTGRES_URL`
//! (default `postgres://postgres@127.0.0.1:5432/test`), in a schema of its
//! own that is dropped at the end: a claim and its completion (`begin` then
//! `complete` on a fresh key: two statements, two commits), and a replay
//! (`begin` on a completed key: one read-only statement).
//!
//! `cargo bench -p idem-sql --bench postgres`

// `criterion_group!` defines an undocumented `pub fn`.
#![allow(missing_docs)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion};
use idem_core::{Begin, BeginRequest, Fingerprint, IdempotencyKey, Scope, Store, StoredResponse};
use idem_sql::{PostgresOptions, PostgresStore};

const START: &str = "pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start";

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
    let url = std::env::var("IDEM_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let schema = format!("idem_bench_{}", std::process::id());
    let store = rt
        .block_on(PostgresStore::connect_with(
            PostgresOptions::new(&url).with_schema(&schema),
        ))
        .unwrap_or_else(|e| panic!("PostgreSQL at {url}: {e}; start it with: {START}"));
    let resp = StoredResponse::new(201, br#"{"id":42,"status":"paid"}"#.to_vec());
    let ttl = Duration::from_secs(3600);
    let n = AtomicU64::new(0);
    let mut group = c.benchmark_group("postgres");
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
    rt.block_on(async {
        let _ = sqlx::raw_sql(&format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE"))
            .execute(store.pool())
            .await;
        store.close().await;
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
