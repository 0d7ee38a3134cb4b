//! `MySqlStore` throughput against the server at `IDEM_TEST_MYSQL_URL`
//! (default `mysql://root@127.0.0.1:3306/test`), on tables of its own that
//! are dropped at the end: a claim and its completion (`begin` then
//! `complete` on a fresh key: a read, the claim transaction, one update),
//! and a replay (`begin` on a completed key: one read).
//!
//! `cargo bench -p idem-sql --bench mysql`

// `criterion_group!` defines an undocumented `pub fn`.
#![allow(missing_docs)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion};
use idem_core::{Begin, BeginRequest, Fingerprint, IdempotencyKey, Scope, Store, StoredResponse};
use idem_sql::{MySqlOptions, MySqlStore};

const START: &str = "start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd";

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
    let url = std::env::var("IDEM_TEST_MYSQL_URL")
        .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into());
    let table = format!("idem_bench_{}", std::process::id());
    let store = rt
        .block_on(MySqlStore::connect_with(
            MySqlOptions::new(&url).with_table(&table),
        ))
        .unwrap_or_else(|e| panic!("MySQL at {url}: {e}; start it with: {START}"));
    let resp = StoredResponse::new(201, br#"{"id":42,"status":"paid"}"#.to_vec());
    let ttl = Duration::from_secs(3600);
    let n = AtomicU64::new(0);
    let mut group = c.benchmark_group("mysql");
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
        let _ = sqlx::raw_sql(&format!("DROP TABLE IF EXISTS `{table}`, `{table}_fence`"))
            .execute(store.pool())
            .await;
        store.close().await;
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
