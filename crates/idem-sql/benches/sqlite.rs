//! `SqliteStore` throughput on a file in a temporary directory (WAL,
//! `synchronous = FULL`): a claim and its completion (`begin` then
//! `complete` on a fresh key: two commits, each synced to disk), and a
//! replay (`begin` on a completed key: one read).
//!
//! `cargo bench -p idem-sql --bench sqlite`

// `criterion_group!` defines an undocumented `pub fn`.
#![allow(missing_docs)]

mod common;

use criterion::{criterion_group, criterion_main, Criterion};
use idem_sql::SqliteStore;

fn bench(c: &mut Criterion) {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("bench.db");
    let path = path.to_str().expect("utf-8 path");
    common::run(
        c,
        "sqlite",
        "open",
        || SqliteStore::open(path),
        |store| async move { store.close().await },
    );
}

criterion_group!(benches, bench);
criterion_main!(benches);
