//! `PostgresStore` throughput against the server at `IDEM_TEST_POSTGRES_URL`
//! (default `postgres://postgres@127.0.0.1:5432/test`), in a schema of its
//! own that is dropped at the end: a claim and its completion (`begin` then
//! `complete` on a fresh key: two statements, two commits), and a replay
//! (`begin` on a completed key: one read-only statement).
//!
//! `cargo bench -p idem-sql --bench postgres`

// `criterion_group!` defines an undocumented `pub fn`.
#![allow(missing_docs)]

use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion};
use idem_sql::{PostgresOptions, PostgresStore};
use idem_testkit::bench::begin_complete_and_replay;

const START: &str = "pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start";

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
    begin_complete_and_replay(c, &rt, "postgres", &store, Duration::from_secs(3600));
    rt.block_on(async {
        let _ = sqlx::raw_sql(&format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE"))
            .execute(store.pool())
            .await;
        store.close().await;
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
