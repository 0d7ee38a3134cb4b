//! `SqliteStore` throughput on a file in a temporary directory (WAL,
//! `synchronous = FULL`): a claim and its completion (`begin` then
//! `complete` on a fresh key: two commits, each synced to disk), and a
//! replay (`begin` on a completed key: one read).
//!
//! `cargo bench -p idem-sql --bench sqlite`

// `criterion_group!` defines an undocumented `pub fn`.
#![allow(missing_docs)]

use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion};
use idem_sql::SqliteStore;
use idem_testkit::bench::begin_complete_and_replay;

fn bench(c: &mut Criterion) {
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("bench.db");
    let store = rt
        .block_on(SqliteStore::open(path.to_str().expect("utf-8 path")))
        .expect("open");
    begin_complete_and_replay(c, &rt, "sqlite", &store, Duration::from_secs(3600));
    rt.block_on(store.close());
}

criterion_group!(benches, bench);
criterion_main!(benches);
