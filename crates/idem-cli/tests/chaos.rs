//! The chaos harness (issue 16, item 6): for each of PostgreSQL, MariaDB,
//! Redis and one shared SQLite file, three `idem gateway` processes on the
//! same store, each reaching the store and the upstream through its own
//! fault-injecting TCP proxy; a counting upstream that records every
//! execution (key, fence, body hash, gateway, start and end) and refuses
//! writes with a stale fence; clients with concurrent duplicates, retries
//! after timeouts over all gateways, key reuse with another body and two
//! scopes on the same key strings; faults at random (kill -9, SIGSTOP /
//! SIGCONT, store restarts, delay / blackhole / reset on every link). A
//! checker then reads the upstream's log and every answer and fails the
//! test on any violation. See docs/RELIABILITY.md.
//!
//! The stores' servers are the harness's own (free ports, temporary
//! folders), never the shared ones. The default run is short (≤ 3 min);
//! `IDEM_CHAOS_LONG=1` (scripts/chaos.sh) runs ≥ 10,000 keys and
//! `IDEM_CHAOS_REPORT=FILE` writes the figures there as markdown.
//! `IDEM_CHAOS_STORES=postgres,redis` runs only those stores;
//! `IDEM_CHAOS_KEEP=1` keeps the gateways' logs and the fault logs;
//! `IDEM_CHAOS_SEQUENTIAL=1` runs the stores one after another.

mod support;

#[path = "chaos/checker.rs"]
#[allow(unreachable_pub)]
mod checker;
#[path = "chaos/clients.rs"]
#[allow(unreachable_pub)]
mod clients;
#[path = "chaos/faults.rs"]
#[allow(unreachable_pub)]
mod faults;
#[path = "chaos/gateways.rs"]
#[allow(unreachable_pub)]
mod gateways;
#[path = "chaos/harness.rs"]
#[allow(unreachable_pub)]
mod harness;
#[path = "chaos/proxy.rs"]
#[allow(unreachable_pub)]
mod proxy;
#[path = "chaos/servers.rs"]
#[allow(unreachable_pub)]
mod servers;
#[path = "chaos/upstream.rs"]
#[allow(unreachable_pub)]
mod upstream;

use std::time::{Duration, Instant};

use faults::Rates;
use harness::Size;
use servers::StoreKind;

/// The stores of this run (`IDEM_CHAOS_STORES`, default all four).
fn stores() -> Vec<StoreKind> {
    let all = [
        StoreKind::Postgres,
        StoreKind::Mariadb,
        StoreKind::Redis,
        StoreKind::Sqlite,
    ];
    match std::env::var("IDEM_CHAOS_STORES") {
        Ok(v) if !v.trim().is_empty() => v
            .split(',')
            .map(|s| {
                *all.iter()
                    .find(|k| k.name() == s.trim())
                    .unwrap_or_else(|| panic!("IDEM_CHAOS_STORES: unknown store {s:?}"))
            })
            .collect(),
        _ => all.to_vec(),
    }
}

/// The short run (CI) or the long one (`IDEM_CHAOS_LONG=1`).
fn size() -> Size {
    let long = std::env::var("IDEM_CHAOS_LONG").is_ok_and(|v| v == "1");
    if long {
        Size {
            keys: 2600,
            spread: Duration::from_secs(240),
            workers: 48,
            rates: Rates {
                gap_ms: (300, 1200),
                at_once: 2,
            },
        }
    } else {
        Size {
            keys: 300,
            spread: Duration::from_secs(35),
            workers: 32,
            rates: Rates {
                gap_ms: (300, 1000),
                at_once: 2,
            },
        }
    }
}

/// Waits for every run in `runs`; a run that panicked fails the test.
async fn join_all(
    runs: &mut tokio::task::JoinSet<checker::Report>,
    reports: &mut Vec<checker::Report>,
) {
    while let Some(r) = runs.join_next().await {
        match r {
            Ok(r) => reports.push(r),
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            Err(e) => panic!("{e}"),
        }
    }
}

/// Every store's run at once (or one after another); the figures as a table; any violation
/// fails the test, printed with the key's executions, answers and the
/// fault log.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn exactly_once_under_faults() {
    let started = Instant::now();
    let size = size();
    let prefix = support::unique("chaos");
    let tmp = tempfile::Builder::new()
        .prefix("idem-chaos-")
        .tempdir()
        .unwrap();
    // IDEM_CHAOS_KEEP=1 keeps the gateways' logs and the fault logs.
    let (_tmp, dir_path) = if std::env::var("IDEM_CHAOS_KEEP").is_ok_and(|v| v == "1") {
        let path = tmp.keep();
        println!("logs kept in {}", path.display());
        (None, path)
    } else {
        let path = tmp.path().to_owned();
        (Some(tmp), path)
    };
    // IDEM_CHAOS_SEQUENTIAL=1 runs one store after another (less load on a
    // small machine; the long run does so).
    let sequential = std::env::var("IDEM_CHAOS_SEQUENTIAL").is_ok_and(|v| v == "1");
    let mut reports = Vec::new();
    let mut runs = tokio::task::JoinSet::new();
    for (i, kind) in stores().into_iter().enumerate() {
        let (prefix, dir) = (prefix.clone(), dir_path.clone());
        runs.spawn(async move {
            // Servers start one after another: the CPU is shared.
            tokio::time::sleep(Duration::from_millis(300 * i as u64)).await;
            harness::run_store(kind, size, &prefix, &dir).await
        });
        if sequential {
            join_all(&mut runs, &mut reports).await;
        }
    }
    join_all(&mut runs, &mut reports).await;
    reports.sort_by_key(|r| r.store.clone());
    let table = checker::table(&reports);
    println!(
        "\n{table}\nwall time: {:.0} s",
        started.elapsed().as_secs_f64()
    );
    if let Ok(path) = std::env::var("IDEM_CHAOS_REPORT") {
        if !path.is_empty() {
            std::fs::write(
                &path,
                format!(
                    "{table}\nwall time: {:.0} s; lease {}, wait {}, upstream timeout {}\n",
                    started.elapsed().as_secs_f64(),
                    harness::LEASE,
                    harness::WAIT,
                    harness::UPSTREAM_TIMEOUT
                ),
            )
            .unwrap();
        }
    }
    for r in &reports {
        for v in &r.superseded {
            println!("EXPLAINED {v}\n");
        }
    }
    let violations: usize = reports.iter().map(checker::Report::violation_count).sum();
    if violations > 0 {
        for r in &reports {
            for v in &r.violations {
                eprintln!("VIOLATION {v}\n");
            }
        }
        panic!("{violations} violations (see above)\n{table}");
    }
}
