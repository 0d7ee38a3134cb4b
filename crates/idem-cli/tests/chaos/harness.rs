//! One store's run: its own server, the counting upstream, two proxies per
//! gateway, three gateways, the clients and the fault injector; then the
//! quiet period, the final pass and the checker.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::checker::{check, Report};
use super::clients::{make_keys, ClientMix, Clients};
use super::faults::{inject, Rates, Targets};
use super::gateways::Gateway;
use super::proxy::FaultProxy;
use super::servers::{StoreKind, StoreServer};
use super::upstream::{CountingUpstream, UpstreamChaos};

/// The gateways' lease (the shortest the gateway takes is 1 s; it must be
/// longer than the store timeout). Short, so that leases run out often;
/// not shorter, so that a busy machine's scheduling delays alone rarely
/// make them run out.
pub const LEASE: &str = "3s";
/// `--store-timeout`.
pub const STORE_TIMEOUT: &str = "1500ms";
/// `--upstream-timeout`: shorter than the slowest upstream answers.
pub const UPSTREAM_TIMEOUT: &str = "3s";
/// `--wait` of gateways 0 and 1 (gateway 2 answers 409 at once).
pub const WAIT: &str = "3s";
/// Gateways per store.
pub const GATEWAYS: usize = 3;

/// The size of a run.
#[derive(Debug, Clone, Copy)]
pub struct Size {
    /// Scoped keys per store.
    pub keys: usize,
    /// Over how long the keys' first requests are spread.
    pub spread: Duration,
    /// Key tasks at once.
    pub workers: usize,
    pub rates: Rates,
}

/// The quiet period before the final pass: longer than the lease plus
/// the bounds (upstream timeout, the slowest upstream answer, the
/// caller's part of a save), with a margin.
pub const QUIET: Duration = Duration::from_secs(12);

/// The upstream's own misbehaviour during the run.
pub const UPSTREAM_CHAOS: UpstreamChaos = UpstreamChaos {
    slow: 0.04,
    slow_ms: (1500, 4000),
    fail: 0.04,
    drop: 0.02,
};

/// The clients' behaviour.
pub const MIX: ClientMix = ClientMix {
    short_share: 0.25,
    short_timeout: Duration::from_millis(800),
    long_timeout: Duration::from_secs(8),
    dup_share: 0.15,
    again_share: 0.2,
    max_attempts: 10,
};

/// Runs one store; `dir` holds the gateways' logs (and the SQLite file).
pub async fn run_store(kind: StoreKind, size: Size, prefix: &str, dir: &Path) -> Report {
    let started = Instant::now();
    let epoch = Instant::now();
    let server = match kind {
        StoreKind::Sqlite => None,
        _ => Some(Arc::new(Mutex::new(
            tokio::task::spawn_blocking(move || match kind {
                StoreKind::Postgres => StoreServer::postgres(),
                StoreKind::Mariadb => StoreServer::mariadb(),
                _ => StoreServer::redis(),
            })
            .await
            .unwrap(),
        ))),
    };
    let upstream = CountingUpstream::start(GATEWAYS, epoch, UPSTREAM_CHAOS).await;
    let mut store_links = Vec::new();
    let mut upstream_links = Vec::new();
    for i in 0..GATEWAYS {
        upstream_links.push(FaultProxy::start(upstream.addrs[i]).await);
        if let Some(s) = &server {
            let port = s.lock().unwrap().port;
            store_links.push(FaultProxy::start(([127, 0, 0, 1], port).into()).await);
        }
    }
    let sqlite = dir.join("chaos.db");
    let store_url = |i: usize| -> String {
        match kind {
            StoreKind::Postgres => format!(
                "postgres://postgres@{}/postgres?idem_schema=chaos",
                store_links[i].addr
            ),
            StoreKind::Mariadb => format!("mysql://idem@{}/test", store_links[i].addr),
            StoreKind::Redis => format!("redis://{}/?idem_prefix=chaos", store_links[i].addr),
            StoreKind::Sqlite => format!("sqlite://{}", sqlite.display()),
        }
    };
    let mut gateways = Vec::new();
    for (i, up) in upstream_links.iter().enumerate() {
        let mut args: Vec<String> = [
            "--upstream",
            &format!("http://{}", up.addr),
            "--store",
            &store_url(i),
            "--lease",
            LEASE,
            "--store-timeout",
            STORE_TIMEOUT,
            "--upstream-timeout",
            UPSTREAM_TIMEOUT,
            "--ttl",
            "1h",
            "--store-pool-size",
            "4",
            "--admin-listen",
            "off",
        ]
        .map(str::to_owned)
        .to_vec();
        if i < 2 {
            args.extend(["--wait".to_owned(), WAIT.to_owned()]);
        }
        gateways.push(Gateway::new(
            dir,
            &format!("{}-gw{i}", kind.name()),
            i,
            args,
        ));
    }
    // The first gateway creates the tables; the others start after it.
    // Up is enough (on a busy machine the first store calls may time out
    // and the gateway say "not ready" for a while; the run copes).
    gateways[0].restart(Duration::from_secs(180)).await;
    for g in &mut gateways[1..] {
        g.restart(Duration::from_secs(180)).await;
    }
    let addrs: Vec<_> = gateways.iter().map(|g| g.addr).collect();
    let gateways: Vec<_> = gateways
        .into_iter()
        .map(|g| Arc::new(tokio::sync::Mutex::new(g)))
        .collect();
    let targets = Arc::new(Targets {
        gateways: gateways.clone(),
        store_links: store_links.clone(),
        upstream_links: upstream_links.clone(),
        server: server.clone(),
        epoch,
    });

    // The run: keys spread over `spread`, faults until the last key is done.
    let keys = make_keys(&format!("{prefix}-{}", kind.name()), size.keys, 0.1);
    let clients = Clients::new(addrs, keys, epoch);
    upstream.set_chaos(true);
    let stop = Arc::new(AtomicBool::new(false));
    let injector = tokio::spawn(inject(targets.clone(), size.rates, stop.clone()));
    let limit = Arc::new(tokio::sync::Semaphore::new(size.workers));
    let mut tasks = tokio::task::JoinSet::new();
    let step = size.spread / size.keys.max(1) as u32;
    let run_start = tokio::time::Instant::now();
    for k in 0..size.keys {
        tokio::time::sleep_until(run_start + step * k as u32).await;
        let permit = limit.clone().acquire_owned().await.unwrap();
        let c = clients.clone();
        tasks.spawn(async move {
            c.run_key(k, MIX).await;
            drop(permit);
        });
    }
    while tasks.join_next().await.is_some() {}
    stop.store(true, Ordering::SeqCst);
    let faults = injector.await.unwrap();
    upstream.set_chaos(false);

    // Quiet, then every key once more.
    tokio::time::sleep(QUIET).await;
    for g in &gateways {
        let mut g = g.lock().await;
        if g.stopped {
            g.signal("-CONT");
        }
    }
    let limit = Arc::new(tokio::sync::Semaphore::new(size.workers));
    for k in 0..size.keys {
        let permit = limit.clone().acquire_owned().await.unwrap();
        let c = clients.clone();
        tasks.spawn(async move {
            c.final_key(k).await;
            drop(permit);
        });
    }
    while tasks.join_next().await.is_some() {}

    let sent = std::mem::take(&mut *clients.sent.lock().unwrap());
    let mut report = check(kind.name(), &clients.keys, &sent, &upstream.log(), &faults);
    report.seconds = started.elapsed().as_secs_f64();
    // The fault log, kept beside the gateways' logs.
    let mut s = format!("{}: fault log:", kind.name());
    for f in &faults {
        s.push_str(&format!(
            "\n  {:>7}..{:>7}ms {:<18} gw{:?} {}",
            f.start_ms,
            f.end_ms,
            f.kind.name(),
            f.gw,
            f.detail
        ));
    }
    let _ = std::fs::write(dir.join(format!("{}-faults.txt", kind.name())), &s);
    if report.violation_count() > 0 {
        // The fault log and the gateways' last lines, for the report.
        for g in &gateways {
            let g = g.lock().await;
            s.push_str(&format!(
                "\n--- gateway {} log tail:\n{}",
                g.idx,
                g.tail(30)
            ));
        }
        report.violations.push(s);
    }
    report
}
