//! `MySqlStore` throughput against the server at `IDEM_TEST_MYSQL_URL`
//! (default `mysql://root@127.0.0.1:3306/test`), on tables of its own that
//! are dropped at the end: a claim and its completion (`begin` then
//! `complete` on a fresh key: a read, the claim transaction, one update),
//! and a replay (`begin` on a completed key: one read).
//!
//! `cargo bench -p idem-sql --bench mysql`

// `criterion_group!` defines an undocumented `pub fn`.
#![allow(missing_docs)]

use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion};
use idem_sql::{MySqlOptions, MySqlStore};
use idem_testkit::bench::begin_complete_and_replay;

const START: &str = "start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd";

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
    begin_complete_and_replay(c, &rt, "mysql", &store, Duration::from_secs(3600));
    rt.block_on(async {
        let _ = sqlx::raw_sql(&format!("DROP TABLE IF EXISTS `{table}`, `{table}_fence`"))
            .execute(store.pool())
            .await;
        store.close().await;
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
