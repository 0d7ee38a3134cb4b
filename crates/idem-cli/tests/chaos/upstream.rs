//! The counting upstream: one HTTP listener per gateway (so each
//! execution is known by the link it came through), one shared log of
//! executions, and a fence check as a real service would do it.
//!
//! `POST /pay` records an execution — scoped key (the `Authorization`
//! value and the `Idempotency-Key`), `Idempotency-Fence`, SHA-256 of the
//! body, gateway, start and end — and answers `201` with a body unique to
//! the execution. While [`CountingUpstream::set_chaos`] is on, it answers
//! at random slowly (longer than some client timeouts and than the
//! gateway's upstream timeout), `500` without effect, or does the work and
//! drops the connection without an answer.
//!
//! The fence: the highest fence seen per scoped key is remembered and a
//! request with a lower one is refused (`409`, problem type
//! `urn:chaos:stale-fence`) without effect.

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use http_body_util::{BodyExt, Full};
use hyper::body::{Bytes, Incoming};
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use rand::Rng;
use sha2::{Digest, Sha256};
use tokio::net::TcpListener;

/// What an execution did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Effect done, `201` sent (or attempted).
    Ok,
    /// Effect done after a long pause, then `201`.
    Slow,
    /// No effect, `500`.
    Fail,
    /// Effect done, connection dropped without an answer.
    Dropped,
    /// Refused: the fence was lower than one seen before (no effect).
    StaleFence,
    /// Refused: no `Idempotency-Fence` on a guarded request (no effect).
    NoFence,
}

impl Kind {
    /// Whether the execution had an effect (the service's write happened).
    pub fn effect(self) -> bool {
        matches!(self, Kind::Ok | Kind::Slow | Kind::Dropped)
    }
}

/// One request the upstream received.
#[derive(Debug, Clone)]
pub struct Exec {
    /// Unique over the run (also in the answer's body), drawn at the
    /// fence check: ids are in the order the upstream applied the writes.
    pub id: u64,
    /// The `Authorization` value (the scope).
    pub scope: String,
    pub key: String,
    pub fence: Option<u64>,
    /// The first 16 hex digits of the body's SHA-256.
    pub body_hash: String,
    /// Index of the gateway whose link it came through.
    pub gw: usize,
    /// When the request's head arrived, in milliseconds since the run's
    /// epoch.
    pub start_ms: u64,
    /// When the handler finished (`None`: it was dropped, e.g. the
    /// gateway closed the connection).
    pub end_ms: Option<u64>,
    pub kind: Kind,
}

/// Probabilities and pauses of the upstream's own misbehaviour.
#[derive(Debug, Clone, Copy)]
pub struct UpstreamChaos {
    /// Share of answers that are slow, and how slow (uniform in the range).
    pub slow: f64,
    pub slow_ms: (u64, u64),
    /// Share of `500` answers (no effect).
    pub fail: f64,
    /// Share of executions whose connection is dropped after the work.
    pub drop: f64,
}

/// What the listeners share.
struct State {
    epoch: Instant,
    next: AtomicU64,
    chaos_on: AtomicBool,
    chaos: UpstreamChaos,
    log: Mutex<Vec<Exec>>,
    highest: Mutex<HashMap<(String, String), u64>>,
}

/// The upstream of one store's gateways.
pub struct CountingUpstream {
    /// One address per gateway (gateway `i` reaches the upstream through
    /// its proxy to `addrs[i]`).
    pub addrs: Vec<SocketAddr>,
    state: Arc<State>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl CountingUpstream {
    /// Starts `gateways` listeners sharing one log; chaos is off until
    /// [`CountingUpstream::set_chaos`].
    pub async fn start(gateways: usize, epoch: Instant, chaos: UpstreamChaos) -> Self {
        let state = Arc::new(State {
            epoch,
            next: AtomicU64::new(1),
            chaos_on: AtomicBool::new(false),
            chaos,
            log: Mutex::new(Vec::new()),
            highest: Mutex::new(HashMap::new()),
        });
        let mut addrs = Vec::new();
        let mut tasks = Vec::new();
        for gw in 0..gateways {
            let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
            addrs.push(listener.local_addr().unwrap());
            let state = state.clone();
            tasks.push(tokio::spawn(async move {
                loop {
                    let Ok((stream, _)) = listener.accept().await else {
                        continue;
                    };
                    tokio::spawn(serve_conn(stream, gw, state.clone()));
                }
            }));
        }
        Self {
            addrs,
            state,
            tasks,
        }
    }

    /// Turns the random slow / 500 / drop answers on or off.
    pub fn set_chaos(&self, on: bool) {
        self.state.chaos_on.store(on, Ordering::SeqCst);
    }

    /// Every execution so far.
    pub fn log(&self) -> Vec<Exec> {
        self.state.log.lock().unwrap().clone()
    }
}

impl Drop for CountingUpstream {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// Serves one connection; a handler that asks for a drop closes it
/// without an answer.
async fn serve_conn(stream: tokio::net::TcpStream, gw: usize, state: Arc<State>) {
    let kill = Arc::new(tokio::sync::Notify::new());
    let k = kill.clone();
    let service = hyper::service::service_fn(move |req| handle(req, gw, state.clone(), k.clone()));
    let conn = hyper::server::conn::http1::Builder::new()
        .keep_alive(true)
        // A request whose bytes a blackhole held arrives after the gateway
        // gave up and closed its side: it is still served, as a service
        // that read it would (the late write the fence must refuse).
        .half_close(true)
        .serve_connection(TokioIo::new(stream), service);
    tokio::select! {
        _ = conn => {}
        _ = kill.notified() => {}
    }
}

/// Milliseconds since the run's epoch.
fn ms(state: &State) -> u64 {
    state.epoch.elapsed().as_millis() as u64
}

/// A request field as text (empty when absent).
fn header(req: &Request<Incoming>, name: &str) -> String {
    req.headers()
        .get(name)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned()
}

/// Sets the end of execution `id` when dropped (also when the handler is
/// dropped mid-sleep: then the end stays `None`).
struct Finish {
    state: Arc<State>,
    idx: usize,
    done: bool,
}

impl Drop for Finish {
    fn drop(&mut self) {
        if self.done {
            let end = ms(&self.state);
            self.state.log.lock().unwrap()[self.idx].end_ms = Some(end);
        }
    }
}

/// One request: the fence check and the effect, then the answer the
/// upstream's chaos draws.
async fn handle(
    req: Request<Incoming>,
    gw: usize,
    state: Arc<State>,
    kill: Arc<tokio::sync::Notify>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let scope = header(&req, "authorization");
    let key = header(&req, "idempotency-key");
    let fence_raw = header(&req, "idempotency-fence");
    let fence = fence_raw.parse::<u64>().ok();
    let start_ms = ms(&state);
    let body = match req.into_body().collect().await {
        Ok(b) => b.to_bytes(),
        Err(_) => Bytes::new(),
    };
    let hash: String = Sha256::digest(&body)
        .iter()
        .take(8)
        .map(|b| format!("{b:02x}"))
        .collect();
    let chaos = state.chaos_on.load(Ordering::SeqCst);
    let (kind, pause) = {
        let mut rng = rand::thread_rng();
        let c = state.chaos;
        let roll: f64 = rng.gen();
        if !chaos {
            (Kind::Ok, Duration::from_millis(rng.gen_range(2..20)))
        } else if roll < c.fail {
            (Kind::Fail, Duration::from_millis(rng.gen_range(2..30)))
        } else if roll < c.fail + c.drop {
            (Kind::Dropped, Duration::from_millis(rng.gen_range(2..50)))
        } else if roll < c.fail + c.drop + c.slow {
            (
                Kind::Slow,
                Duration::from_millis(rng.gen_range(c.slow_ms.0..=c.slow_ms.1)),
            )
        } else {
            (Kind::Ok, Duration::from_millis(rng.gen_range(2..40)))
        }
    };
    // The fence check and the effect are one step, as one row update in a
    // real service would be.
    let (id, idx, kind) = {
        let mut highest = state.highest.lock().unwrap();
        let kind = match fence {
            None => Kind::NoFence,
            Some(f) => {
                let h = highest.entry((scope.clone(), key.clone())).or_insert(0);
                if f < *h {
                    Kind::StaleFence
                } else {
                    if kind.effect() {
                        *h = f;
                    }
                    kind
                }
            }
        };
        let id = state.next.fetch_add(1, Ordering::SeqCst);
        let mut log = state.log.lock().unwrap();
        log.push(Exec {
            id,
            scope: scope.clone(),
            key: key.clone(),
            fence,
            body_hash: hash.clone(),
            gw,
            start_ms,
            end_ms: None,
            kind,
        });
        (id, log.len() - 1, kind)
    };
    let mut finish = Finish {
        state: state.clone(),
        idx,
        done: false,
    };
    let problem = |status: u16, kind: &str| {
        Response::builder()
            .status(status)
            .header("content-type", "application/problem+json")
            .body(Full::new(Bytes::from(format!(
                "{{\"type\":\"urn:chaos:{kind}\",\"exec\":{id}}}"
            ))))
            .unwrap()
    };
    match kind {
        Kind::StaleFence => {
            finish.done = true;
            return Ok(problem(409, "stale-fence"));
        }
        Kind::NoFence => {
            finish.done = true;
            return Ok(problem(400, "no-fence"));
        }
        _ => {}
    }
    tokio::time::sleep(pause).await;
    finish.done = true;
    match kind {
        Kind::Fail => Ok(problem(500, "failed")),
        Kind::Dropped => {
            drop(finish);
            kill.notify_one();
            // The connection task drops this future with the connection.
            std::future::pending::<()>().await;
            unreachable!()
        }
        _ => Ok(Response::builder()
            .status(201)
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(format!(
                "{{\"exec\":{id},\"scope\":{scope:?},\"key\":{key:?},\"body\":\"{hash}\",\"fence\":{}}}",
                fence.unwrap_or(0)
            ))))
            .unwrap()),
    }
}
