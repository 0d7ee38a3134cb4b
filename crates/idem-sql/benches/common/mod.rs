//! The run every store's benchmark shares: open the store, measure
//! [`begin_complete_and_replay`], clean up.

use std::future::Future;
use std::time::Duration;

use criterion::Criterion;
use idem_core::{Store, StoreError};
use idem_testkit::bench::begin_complete_and_replay;

/// Opens a store with `open` (failing with `what` when it cannot), runs the
/// benchmark group `group` on it (results kept for an hour), then hands the
/// store to `done` (dropping its tables, closing its pool).
pub(crate) fn run<S, O, OF, D, DF>(c: &mut Criterion, group: &str, what: &str, open: O, done: D)
where
    S: Store,
    O: FnOnce() -> OF,
    OF: Future<Output = Result<S, StoreError>>,
    D: FnOnce(S) -> DF,
    DF: Future<Output = ()>,
{
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let store = rt
        .block_on(open())
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    begin_complete_and_replay(c, &rt, group, &store, Duration::from_secs(3600));
    rt.block_on(done(store));
}

/// Writes `main` for the benchmark of a store on a server: `$open` (with
/// `$url` the server's URL and `$name` a fresh schema or table name)
/// connects, `$drop` (`{0}` the name) drops what the store made.
#[allow(unused_macros)]
macro_rules! server_bench {
    ($group:literal, $what:literal, $server_url:path, $start:path,
     |$url:ident, $name:ident| $open:expr, drop: $drop:literal) => {
        fn bench(c: &mut criterion::Criterion) {
            let $url = $server_url();
            let $name = format!("idem_bench_{}", std::process::id());
            let what = format!("{} at {} (start it with: {})", $what, $url, $start);
            let drop = format!($drop, $name);
            common::run(
                c,
                $group,
                &what,
                || $open,
                |store| async move {
                    let _ = sqlx::raw_sql(&drop).execute(store.pool()).await;
                    store.close().await;
                },
            );
        }

        criterion::criterion_group!(benches, bench);
        criterion::criterion_main!(benches);
    };
}
#[allow(unused_imports)]
pub(crate) use server_bench;
