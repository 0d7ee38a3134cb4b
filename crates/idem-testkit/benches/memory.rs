//! `MemoryStore` throughput: a claim and its completion (`begin` then
//! `complete` on a fresh key), and a replay (`begin` on a completed key).
//!
//! `cargo bench -p idem-testkit --features bench --bench memory`

// `criterion_group!` defines an undocumented `pub fn`.
#![allow(missing_docs)]

use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion};
use idem_core::{MemoryLimits, MemoryStore};
use idem_testkit::bench::begin_complete_and_replay;

fn bench(c: &mut Criterion) {
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    // A run makes millions of fresh keys: past the default cap of 1,000,000
    // records the store would refuse them (it never evicts a live result
    // unless told to), so this bench lets it evict, as a cache would.
    let store = MemoryStore::new().with_limits(MemoryLimits {
        evict_live_results: true,
        ..MemoryLimits::default()
    });
    begin_complete_and_replay(c, &rt, "memory", &store, Duration::from_secs(3600));
}

criterion_group!(benches, bench);
criterion_main!(benches);
