//! The criterion benchmark every store runs (feature `bench`): a claim and
//! its completion (`begin` then `complete` on a fresh key), and a replay
//! (`begin` on a completed key).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use criterion::Criterion;
use idem_core::{Begin, BeginRequest, Fingerprint, IdempotencyKey, Scope, Store, StoredResponse};
use tokio::runtime::Runtime;

fn request(key: &str) -> BeginRequest {
    BeginRequest {
        scope: Scope::anonymous(),
        key: IdempotencyKey::new(key).expect("key"),
        fingerprint: Fingerprint::of(b"POST /orders {\"amount\":1000}"),
        lease: Duration::from_secs(30),
    }
}

/// Benchmarks `begin_complete` and `replay` on `store` in a criterion group
/// named `group`; results are kept for `ttl`. Returns the replayed request,
/// so the caller can delete its record.
///
/// # Panics
/// When the store fails or answers other than a fresh store would (a
/// benchmark has nothing better to do with an error).
pub fn begin_complete_and_replay<S: Store>(
    c: &mut Criterion,
    rt: &Runtime,
    group: &str,
    store: &S,
    ttl: Duration,
) -> BeginRequest {
    let resp = StoredResponse::new(201, br#"{"id":42,"status":"paid"}"#.to_vec());
    let n = AtomicU64::new(0);
    let mut g = c.benchmark_group(group);
    g.bench_function("begin_complete", |b| {
        b.to_async(rt).iter(|| async {
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
    g.bench_function("replay", |b| {
        b.to_async(rt).iter(|| async {
            let got = store.begin(&done).await.expect("begin");
            assert!(matches!(got, Begin::Replay(_)));
        })
    });
    g.finish();
    done
}
