//! The clients: every scoped key is one task that sends its request until
//! it gets a 2xx (retrying after timeouts, errors, 409s and 5xx, on any
//! gateway, sometimes as concurrent duplicates), sometimes asks again for
//! the replay, and sometimes reuses the key with another body. Every
//! answer is recorded for the checker.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rand::seq::SliceRandom;
use rand::Rng;

/// One scoped key: the same key string is used by two scopes.
#[derive(Debug, Clone)]
pub struct ScopedKey {
    /// The `Authorization` value.
    pub scope: String,
    pub key: String,
    /// The request body the key is for.
    pub body: String,
    /// Another body, sent on the same key to check the 422.
    pub other: String,
    /// Whether the key is reused with `other`.
    pub reuse: bool,
}

/// What a request got.
#[derive(Debug, Clone)]
pub enum Outcome {
    /// An answer read to its end.
    Answer {
        status: u16,
        replayed: bool,
        /// The problem type for `application/problem+json`.
        problem: String,
        body: String,
    },
    /// The client gave up waiting.
    Timeout,
    /// Connection refused, reset, closed early.
    Error(String),
}

/// Which part of the run a request belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    Run,
    Final,
}

/// One request and its outcome.
#[derive(Debug, Clone)]
pub struct Sent {
    /// Index into the run's keys.
    pub key: usize,
    /// Sent with the key's other body.
    pub other: bool,
    pub gw: usize,
    pub sent_ms: u64,
    pub done_ms: u64,
    pub timeout: Duration,
    pub phase: Phase,
    pub outcome: Outcome,
}

impl Sent {
    /// The 2xx body, if any.
    pub fn ok_body(&self) -> Option<&str> {
        match &self.outcome {
            Outcome::Answer { status, body, .. } if (200..300).contains(status) => Some(body),
            _ => None,
        }
    }
}

/// The client side of one store's run.
pub struct Clients {
    pub gateways: Vec<SocketAddr>,
    pub keys: Arc<Vec<ScopedKey>>,
    pub epoch: Instant,
    http: reqwest::Client,
    pub sent: Mutex<Vec<Sent>>,
}

/// How the clients behave.
#[derive(Debug, Clone, Copy)]
pub struct ClientMix {
    /// Share of requests with the short timeout, and the two timeouts.
    pub short_share: f64,
    pub short_timeout: Duration,
    pub long_timeout: Duration,
    /// Share of attempts sent as 2–3 concurrent copies.
    pub dup_share: f64,
    /// Share of acknowledged keys asked again (a replay).
    pub again_share: f64,
    /// Most attempts per key in the run phase.
    pub max_attempts: usize,
}

/// Makes `n` scoped keys: `n / 2` key strings, each used by two scopes.
pub fn make_keys(prefix: &str, n: usize, reuse_share: f64) -> Vec<ScopedKey> {
    let mut rng = rand::thread_rng();
    let mut v = Vec::with_capacity(n);
    for i in 0..n {
        let key = format!("{prefix}-k{}", i / 2);
        let scope = format!("Bearer {prefix}-scope-{}", ["a", "b"][i % 2]);
        let amount: u32 = rng.gen_range(1..100_000);
        v.push(ScopedKey {
            body: format!("{{\"amount\":{amount},\"scope\":{scope:?},\"key\":{key:?}}}"),
            other: format!(
                "{{\"amount\":{},\"scope\":{scope:?},\"key\":{key:?}}}",
                amount + 1
            ),
            reuse: rng.gen_bool(reuse_share),
            scope,
            key,
        });
    }
    v
}

impl Clients {
    /// Clients of `gateways` for `keys`, timing from `epoch`.
    pub fn new(gateways: Vec<SocketAddr>, keys: Vec<ScopedKey>, epoch: Instant) -> Arc<Self> {
        Arc::new(Self {
            gateways,
            keys: Arc::new(keys),
            epoch,
            http: reqwest::Client::builder()
                .pool_max_idle_per_host(64)
                .pool_idle_timeout(Duration::from_millis(800))
                .build()
                .unwrap(),
            sent: Mutex::new(Vec::new()),
        })
    }

    /// Milliseconds since the run's epoch.
    fn ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// Sends one request for key `k` to gateway `gw` and records it.
    pub async fn send(
        &self,
        k: usize,
        other: bool,
        gw: usize,
        timeout: Duration,
        phase: Phase,
    ) -> Outcome {
        let sk = &self.keys[k];
        let body = if other { &sk.other } else { &sk.body };
        let sent_ms = self.ms();
        let req = self
            .http
            .post(format!("http://{}/pay", self.gateways[gw]))
            .header("authorization", &sk.scope)
            .header("idempotency-key", &sk.key)
            .header("content-type", "application/json")
            .body(body.clone())
            .timeout(timeout);
        let outcome = match req.send().await {
            Ok(r) => {
                let status = r.status().as_u16();
                let replayed = r
                    .headers()
                    .get("idempotent-replayed")
                    .is_some_and(|v| v == "true");
                match r.text().await {
                    Ok(body) => {
                        let problem = serde_json::from_str::<serde_json::Value>(&body)
                            .ok()
                            .and_then(|v| v["type"].as_str().map(str::to_owned))
                            .unwrap_or_default();
                        Outcome::Answer {
                            status,
                            replayed,
                            problem,
                            body,
                        }
                    }
                    Err(e) if e.is_timeout() => Outcome::Timeout,
                    Err(e) => Outcome::Error(format!("body: {e}")),
                }
            }
            Err(e) if e.is_timeout() => Outcome::Timeout,
            Err(e) => Outcome::Error(e.to_string()),
        };
        self.sent.lock().unwrap().push(Sent {
            key: k,
            other,
            gw,
            sent_ms,
            done_ms: self.ms(),
            timeout,
            phase,
            outcome: outcome.clone(),
        });
        outcome
    }

    /// The run phase of key `k`.
    pub async fn run_key(self: Arc<Self>, k: usize, mix: ClientMix) {
        let n = self.gateways.len();
        let mut acked = false;
        for _ in 0..mix.max_attempts {
            let (copies, gws, timeouts) = {
                let mut rng = rand::thread_rng();
                let copies = if rng.gen_bool(mix.dup_share) {
                    rng.gen_range(2..=3)
                } else {
                    1
                };
                let mut gws: Vec<usize> = (0..n).collect();
                gws.shuffle(&mut rng);
                let timeouts: Vec<Duration> = (0..copies)
                    .map(|_| {
                        if rng.gen_bool(mix.short_share) {
                            mix.short_timeout
                        } else {
                            mix.long_timeout
                        }
                    })
                    .collect();
                (copies, gws, timeouts)
            };
            let mut tasks = tokio::task::JoinSet::new();
            for c in 0..copies {
                let me = self.clone();
                let (gw, t) = (gws[c % n], timeouts[c]);
                tasks.spawn(async move { me.send(k, false, gw, t, Phase::Run).await });
            }
            let mut wait = Duration::from_millis(rand::thread_rng().gen_range(100..600));
            while let Some(o) = tasks.join_next().await {
                match o.unwrap() {
                    Outcome::Answer { status, .. } if (200..300).contains(&status) => {
                        acked = true;
                    }
                    Outcome::Answer { status: 409, .. } => {
                        wait = Duration::from_millis(rand::thread_rng().gen_range(300..1200));
                    }
                    _ => {}
                }
            }
            if acked {
                break;
            }
            tokio::time::sleep(wait).await;
        }
        if !acked {
            return;
        }
        let (again, reuse, gw, gw2) = {
            let mut rng = rand::thread_rng();
            (
                rng.gen_bool(mix.again_share),
                self.keys[k].reuse,
                rng.gen_range(0..n),
                rng.gen_range(0..n),
            )
        };
        if again {
            tokio::time::sleep(Duration::from_millis(200)).await;
            self.send(k, false, gw, mix.long_timeout, Phase::Run).await;
        }
        if reuse {
            self.send(k, true, gw2, mix.long_timeout, Phase::Run).await;
        }
    }

    /// The final pass of key `k`, after the quiet period: the key's own
    /// request until an answer that is not a 5xx, a timeout or an error
    /// (a 409 is recorded and tried again once later, to tell a slow key
    /// from a stuck one), then the other body when the key is reused.
    pub async fn final_key(self: Arc<Self>, k: usize) {
        let n = self.gateways.len();
        let mut in_flight_seen = false;
        for attempt in 0..8 {
            let gw = (k + attempt) % n;
            match self
                .send(k, false, gw, Duration::from_secs(10), Phase::Final)
                .await
            {
                Outcome::Answer { status: 409, .. } if !in_flight_seen => {
                    in_flight_seen = true;
                    tokio::time::sleep(Duration::from_secs(2)).await;
                }
                Outcome::Answer { status, .. } if status < 500 => break,
                _ => tokio::time::sleep(Duration::from_millis(500)).await,
            }
        }
        if self.keys[k].reuse {
            for attempt in 0..8 {
                let gw = (k + attempt) % n;
                match self
                    .send(k, true, gw, Duration::from_secs(10), Phase::Final)
                    .await
                {
                    Outcome::Answer { status, .. } if status < 500 => break,
                    _ => tokio::time::sleep(Duration::from_millis(500)).await,
                }
            }
        }
    }
}
