//! The run every store's benchmark shares: open the store, measure
//! [`begin_complete_and_replay`], clean up; and the servers the tests use.

use std::future::Future;
use std::time::Duration;

use criterion::Criterion;
use idem_core::{Store, StoreError};
use idem_testkit::bench::begin_complete_and_replay;

#[cfg(any(feature = "postgres", feature = "mysql"))]
#[path = "../../tests/servers/mod.rs"]
pub(crate) mod servers;

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

/// Writes `main` for the benchmark `$group` of a store on `$server` (a
/// [`servers::Server`]): `$open` (with `$url` the server's URL and `$name` a
/// fresh schema or table name) connects, `$drop` (`{0}` the name) drops what
/// the store made.
#[allow(unused_macros)]
macro_rules! server_bench {
    ($group:literal, $server:expr, |$url:ident, $name:ident| $open:expr, drop: $drop:literal) => {
        fn bench(c: &mut criterion::Criterion) {
            let server = $server;
            let $url = server.url();
            let $name = format!("idem_bench_{}", std::process::id());
            let what = format!(
                "{} at {} (start it with: {})",
                server.what(),
                $url,
                server.start()
            );
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

        // `criterion_group!` defines an undocumented `pub fn`.
        #[allow(missing_docs)]
        mod group {
            criterion::criterion_group!(benches, super::bench);
        }
        criterion::criterion_main!(group::benches);
    };
}
#[allow(unused_imports)]
pub(crate) use server_bench;
