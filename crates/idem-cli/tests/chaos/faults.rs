//! Faults injected at random while the clients run, each logged with its
//! kind, target and interval.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rand::Rng;

use super::gateways::Gateway;
use super::proxy::{FaultProxy, Mode};
use super::servers::StoreServer;

/// The kinds of fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum FaultKind {
    /// SIGKILL of a gateway, restarted on the same port.
    GatewayKill,
    /// SIGSTOP of a gateway, SIGCONT after a pause (sometimes longer than
    /// the lease).
    GatewayPause,
    /// The store server killed and started again (every gateway).
    StoreRestart,
    /// Gateway ↔ store: each chunk delayed.
    StoreDelay,
    /// Gateway ↔ store: nothing forwarded for a while.
    StoreBlackhole,
    /// Gateway ↔ store: open connections reset, new ones refused a while.
    StoreReset,
    /// Gateway ↔ upstream: each chunk delayed.
    UpstreamDelay,
    /// Gateway ↔ upstream: nothing forwarded for a while.
    UpstreamBlackhole,
    /// Gateway ↔ upstream: open connections reset, new ones refused.
    UpstreamReset,
}

impl FaultKind {
    /// Every kind, in table order.
    pub const ALL: [FaultKind; 9] = [
        FaultKind::GatewayKill,
        FaultKind::GatewayPause,
        FaultKind::StoreRestart,
        FaultKind::StoreDelay,
        FaultKind::StoreBlackhole,
        FaultKind::StoreReset,
        FaultKind::UpstreamDelay,
        FaultKind::UpstreamBlackhole,
        FaultKind::UpstreamReset,
    ];

    /// Short name for tables and logs.
    pub fn name(self) -> &'static str {
        match self {
            FaultKind::GatewayKill => "kill -9",
            FaultKind::GatewayPause => "SIGSTOP",
            FaultKind::StoreRestart => "store restart",
            FaultKind::StoreDelay => "store delay",
            FaultKind::StoreBlackhole => "store blackhole",
            FaultKind::StoreReset => "store reset",
            FaultKind::UpstreamDelay => "upstream delay",
            FaultKind::UpstreamBlackhole => "upstream blackhole",
            FaultKind::UpstreamReset => "upstream reset",
        }
    }

    /// Relative weight of the kind when one is drawn.
    fn weight(self, store_faults: bool) -> u32 {
        match self {
            FaultKind::GatewayKill | FaultKind::GatewayPause => 12,
            FaultKind::StoreRestart if store_faults => 6,
            FaultKind::StoreDelay | FaultKind::StoreBlackhole | FaultKind::StoreReset
                if store_faults =>
            {
                8
            }
            FaultKind::UpstreamDelay | FaultKind::UpstreamBlackhole | FaultKind::UpstreamReset => 8,
            _ => 0,
        }
    }
}

/// One injected fault.
#[derive(Debug, Clone)]
pub struct Fault {
    pub kind: FaultKind,
    /// The gateway it touched; `None`: the store (every gateway).
    pub gw: Option<usize>,
    pub start_ms: u64,
    /// When it was healed (the gateway healthy again, the link passing, the
    /// store answering).
    pub end_ms: u64,
    /// E.g. the pause or delay.
    pub detail: String,
}

impl Fault {
    /// Whether the fault touched gateway `gw` at some time in `[from, to]`.
    /// (The bounds may come in either order.)
    pub fn touches(&self, gw: usize, from: u64, to: u64) -> bool {
        let (from, to) = (from.min(to), from.max(to));
        self.gw.is_none_or(|g| g == gw) && self.start_ms <= to && self.end_ms >= from
    }
}

/// What the injector acts on.
pub struct Targets {
    pub gateways: Vec<Arc<tokio::sync::Mutex<Gateway>>>,
    pub store_links: Vec<Arc<FaultProxy>>,
    pub upstream_links: Vec<Arc<FaultProxy>>,
    pub server: Option<Arc<Mutex<StoreServer>>>,
    pub epoch: Instant,
}

/// The injector's timing.
#[derive(Debug, Clone, Copy)]
pub struct Rates {
    /// Gap between two faults (uniform, ms).
    pub gap_ms: (u64, u64),
    /// Faults at once, at most.
    pub at_once: usize,
}

/// Injects faults until `stop` is set, then waits for the running ones to
/// heal; returns the log.
pub async fn inject(targets: Arc<Targets>, rates: Rates, stop: Arc<AtomicBool>) -> Vec<Fault> {
    let log = Arc::new(Mutex::new(Vec::new()));
    let busy: Arc<Mutex<HashSet<Option<usize>>>> = Arc::default();
    let mut running = tokio::task::JoinSet::new();
    let store_faults = !targets.store_links.is_empty();
    let total: u32 = FaultKind::ALL.iter().map(|k| k.weight(store_faults)).sum();
    while !stop.load(Ordering::SeqCst) {
        let (gap, roll, gw) = {
            let mut rng = rand::thread_rng();
            (
                rng.gen_range(rates.gap_ms.0..=rates.gap_ms.1),
                rng.gen_range(0..total),
                rng.gen_range(0..targets.gateways.len()),
            )
        };
        tokio::time::sleep(Duration::from_millis(gap)).await;
        while let Some(done) = running.try_join_next() {
            // A fault that could not be healed ends the run.
            if let Err(e) = done {
                if e.is_panic() {
                    std::panic::resume_unwind(e.into_panic());
                }
            }
        }
        if running.len() >= rates.at_once || stop.load(Ordering::SeqCst) {
            continue;
        }
        let mut acc = 0;
        let kind = FaultKind::ALL
            .into_iter()
            .find(|k| {
                acc += k.weight(store_faults);
                roll < acc
            })
            .unwrap();
        let target = (kind != FaultKind::StoreRestart).then_some(gw);
        {
            let mut b = busy.lock().unwrap();
            // One fault per gateway at a time; a store restart only when
            // no other store restart runs.
            if b.contains(&target) {
                continue;
            }
            b.insert(target);
        }
        let (targets, log, busy) = (targets.clone(), log.clone(), busy.clone());
        running.spawn(async move {
            // Logged before it is applied, as lasting to the end of the
            // run: a fault whose healing fails still explains what follows.
            let start_ms = targets.epoch.elapsed().as_millis() as u64;
            let idx = {
                let mut log = log.lock().unwrap();
                log.push(Fault {
                    kind,
                    gw: target,
                    start_ms,
                    end_ms: u64::MAX,
                    detail: "not healed".into(),
                });
                log.len() - 1
            };
            let detail = apply(&targets, kind, target).await;
            let end_ms = targets.epoch.elapsed().as_millis() as u64;
            {
                let mut log = log.lock().unwrap();
                log[idx].end_ms = end_ms;
                log[idx].detail = detail;
            }
            busy.lock().unwrap().remove(&target);
        });
    }
    while let Some(done) = running.join_next().await {
        if let Err(e) = done {
            if e.is_panic() {
                std::panic::resume_unwind(e.into_panic());
            }
        }
    }
    let mut v = std::mem::take(&mut *log.lock().unwrap());
    v.sort_by_key(|f| f.start_ms);
    v
}

/// A duration drawn uniformly in `lo..=hi` ms.
fn ms_range(lo: u64, hi: u64) -> Duration {
    Duration::from_millis(rand::thread_rng().gen_range(lo..=hi))
}

/// Applies one fault and heals it; returns its detail.
async fn apply(t: &Targets, kind: FaultKind, gw: Option<usize>) -> String {
    let i = gw.unwrap_or(0);
    match kind {
        FaultKind::GatewayKill => {
            let down = ms_range(100, 800);
            let mut g = t.gateways[i].lock().await;
            g.kill9();
            tokio::time::sleep(down).await;
            g.restart(Duration::from_secs(300)).await;
            format!("down {down:?} before the restart")
        }
        FaultKind::GatewayPause => {
            // A third of the pauses are longer than the 3 s lease.
            let pause = if rand::thread_rng().gen_bool(1.0 / 3.0) {
                ms_range(3500, 5000)
            } else {
                ms_range(200, 1500)
            };
            let mut g = t.gateways[i].lock().await;
            g.signal("-STOP");
            tokio::time::sleep(pause).await;
            g.signal("-CONT");
            format!("paused {pause:?}")
        }
        FaultKind::StoreRestart => {
            let down = ms_range(200, 1500);
            let server = t.server.clone().expect("a server to restart");
            let s = server.clone();
            tokio::task::spawn_blocking(move || s.lock().unwrap().kill())
                .await
                .unwrap();
            tokio::time::sleep(down).await;
            tokio::task::spawn_blocking(move || server.lock().unwrap().start())
                .await
                .unwrap();
            format!("down {down:?} before the start")
        }
        FaultKind::StoreDelay | FaultKind::UpstreamDelay => {
            let link = link(t, kind, i);
            let d = ms_range(50, 600);
            let span = ms_range(1000, 4000);
            link.set(Mode::Delay(d));
            tokio::time::sleep(span).await;
            link.set(Mode::Pass);
            format!("{d:?} per chunk for {span:?}")
        }
        FaultKind::StoreBlackhole | FaultKind::UpstreamBlackhole => {
            let link = link(t, kind, i);
            // A third of the upstream blackholes outlast the upstream
            // timeout and the lease: the held request arrives after the
            // key was taken over (a stale fence).
            let long =
                kind == FaultKind::UpstreamBlackhole && rand::thread_rng().gen_bool(1.0 / 3.0);
            let span = if long {
                ms_range(6000, 9000)
            } else {
                ms_range(300, 3500)
            };
            link.set(Mode::Blackhole);
            tokio::time::sleep(span).await;
            link.set(Mode::Pass);
            format!("for {span:?}")
        }
        FaultKind::StoreReset | FaultKind::UpstreamReset => {
            let link = link(t, kind, i);
            let span = ms_range(50, 800);
            link.set(Mode::Refuse);
            link.reset_all();
            tokio::time::sleep(span).await;
            link.set(Mode::Pass);
            format!("new connections refused for {span:?}")
        }
    }
}

/// The link of gateway `i` that `kind` acts on.
fn link(t: &Targets, kind: FaultKind, i: usize) -> Arc<FaultProxy> {
    match kind {
        FaultKind::StoreDelay | FaultKind::StoreBlackhole | FaultKind::StoreReset => {
            t.store_links[i].clone()
        }
        _ => t.upstream_links[i].clone(),
    }
}
