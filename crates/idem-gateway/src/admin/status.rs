//! The live status page on the admin listener: `GET /` (the page),
//! `GET /status.js`, `GET /status.css` (its script and style) and
//! `GET /status.json` (the data, admin token required).
//!
//! The data comes from a [`metrics::Recorder`] of its own ([`recorder`]),
//! installed next to the Prometheus one (a fan-out), that keeps in atomics
//! what the page shows: requests by outcome, request latency by outcome and
//! store-call latency by operation in small fixed-bucket histograms, store
//! errors by operation, the in-flight gauge. A sampler thread
//! ([`start_sampler`]) reads them every [`SAMPLE_EVERY`] into a ring buffer
//! of [`HISTORY_POINTS`] points (15 minutes), the charts' data.
//!
//! The page itself carries no data and needs no token: it asks for the
//! token in a form, keeps it in the tab's `sessionStorage` and sends it as
//! `Authorization: Bearer` on every `fetch` of `/status.json`, which answers
//! 401 without it. Without `--admin-token-file` all four paths answer 404.
//! Every answer has `Cache-Control: no-store`, `X-Content-Type-Options:
//! nosniff` and a Content-Security-Policy that allows only this origin's
//! script and style (no inline script, no other origin, no framing).
//!
//! The JSON shape is documented in `docs/STATUS_PAGE.md`.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex, Once};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use idem_core::admin::{ListQuery, StateFilter};
use idem_core::{key_hash, RecordState};
use idem_http::BoxBody;
use metrics::{
    Counter, CounterFn, Gauge, GaugeFn, Histogram, HistogramFn, Key, KeyName, Metadata,
    SharedString, Unit,
};
use serde_json::{json, Map, Value};

use super::AdminState;

/// How often the sampler adds a point to the history: 5 s.
pub(crate) const SAMPLE_EVERY: Duration = Duration::from_secs(5);

/// Points kept: 180 (15 minutes at [`SAMPLE_EVERY`]).
pub(crate) const HISTORY_POINTS: usize = 180;

/// The window of the "last minute" numbers: 60 s (up to one
/// [`SAMPLE_EVERY`] more while the sampler has not ticked).
const MINUTE: Duration = Duration::from_secs(60);

/// How long a store probe and an in-flight listing are reused: 1 s.
const PROBE_CACHE: Duration = Duration::from_secs(1);

/// In-flight keys listed: 20.
const LISTED_KEYS: usize = 20;

/// The `outcome` label values of `idem_requests_total` and
/// `idem_request_duration_seconds` the page keeps; others are ignored.
pub(crate) const OUTCOMES: [&str; idem_http::RequestOutcome::ALL.len()] = {
    let all = idem_http::RequestOutcome::ALL;
    let mut names = [""; idem_http::RequestOutcome::ALL.len()];
    let mut i = 0;
    while i < all.len() {
        names[i] = all[i].as_str();
        i += 1;
    }
    names
};

/// The `op` label values of the store series the page keeps.
pub(crate) const OPS: [&str; 5] = ["begin", "complete", "release", "extend", "get"];

const REQUESTS_TOTAL: &str = "idem_requests_total";
const REQUEST_DURATION: &str = "idem_request_duration_seconds";
const IN_FLIGHT: &str = "idem_in_flight";
const STORE_DURATION: &str = "idem_store_operation_duration_seconds";
const STORE_ERRORS: &str = "idem_store_errors_total";

// ------------------------------------------------------------- histogram

/// Buckets of a [`Hist`]: 64.
const BUCKETS: usize = 64;
/// Upper bound of bucket 0: 50 µs.
const BUCKET_BASE: f64 = 50e-6;
/// Each bucket's upper bound is this times the previous one's: bucket `i`
/// holds values in `(BASE·1.25^(i-1), BASE·1.25^i]`, so a percentile read
/// as a bucket's upper bound is at most 25 % above the true value. The last
/// bucket (from 52 s) takes everything larger.
const BUCKET_FACTOR: f64 = 1.25;

/// A histogram of durations in seconds: 64 atomic counters.
struct Hist {
    buckets: [AtomicU64; BUCKETS],
}

impl Hist {
    fn new() -> Self {
        Self {
            buckets: std::array::from_fn(|_| AtomicU64::new(0)),
        }
    }

    fn bucket(seconds: f64) -> usize {
        if seconds.is_nan() || seconds <= BUCKET_BASE {
            return 0;
        }
        let i = ((seconds / BUCKET_BASE).ln() / BUCKET_FACTOR.ln()).ceil();
        if i >= (BUCKETS - 1) as f64 {
            BUCKETS - 1
        } else {
            // In 1..BUCKETS-1: the float is a small positive integer.
            #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
            let i = i as usize;
            i
        }
    }

    fn read(&self) -> [u64; BUCKETS] {
        std::array::from_fn(|i| self.buckets[i].load(Ordering::Relaxed))
    }
}

impl HistogramFn for Hist {
    fn record(&self, value: f64) {
        self.buckets[Self::bucket(value)].fetch_add(1, Ordering::Relaxed);
    }
}

/// The upper bound of bucket `i`, in seconds.
fn bucket_bound(i: usize) -> f64 {
    // i < 64: fits an i32.
    #[allow(clippy::cast_possible_truncation, clippy::cast_possible_wrap)]
    let i = i as i32;
    BUCKET_BASE * BUCKET_FACTOR.powi(i)
}

/// The `q` quantile (0 < q ≤ 1) of bucket counts, in seconds (the upper
/// bound of the bucket that holds it); `None` without any value.
fn quantile(counts: &[u64; BUCKETS], q: f64) -> Option<f64> {
    let total: u64 = counts.iter().sum();
    if total == 0 {
        return None;
    }
    #[allow(
        clippy::cast_precision_loss,
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss
    )]
    let rank = ((q * total as f64).ceil() as u64).clamp(1, total);
    let mut seen = 0;
    for (i, c) in counts.iter().enumerate() {
        seen += c;
        if seen >= rank {
            return Some(bucket_bound(i));
        }
    }
    Some(bucket_bound(BUCKETS - 1))
}

fn sub(a: &[u64; BUCKETS], b: &[u64; BUCKETS]) -> [u64; BUCKETS] {
    std::array::from_fn(|i| a[i].saturating_sub(b[i]))
}

fn add(a: &mut [u64; BUCKETS], b: &[u64; BUCKETS]) {
    for (x, y) in a.iter_mut().zip(b) {
        *x += y;
    }
}

// -------------------------------------------------------- counter, gauge

struct Count(AtomicU64);

impl CounterFn for Count {
    fn increment(&self, value: u64) {
        self.0.fetch_add(value, Ordering::Relaxed);
    }

    fn absolute(&self, value: u64) {
        self.0.fetch_max(value, Ordering::Relaxed);
    }
}

/// An `f64` gauge in an atomic's bits.
struct Level(AtomicU64);

impl Level {
    fn get(&self) -> f64 {
        f64::from_bits(self.0.load(Ordering::Relaxed))
    }

    fn update(&self, f: impl Fn(f64) -> f64) {
        let _ = self
            .0
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |bits| {
                Some(f(f64::from_bits(bits)).to_bits())
            });
    }
}

impl GaugeFn for Level {
    fn increment(&self, value: f64) {
        self.update(|v| v + value);
    }

    fn decrement(&self, value: f64) {
        self.update(|v| v - value);
    }

    fn set(&self, value: f64) {
        self.0.store(value.to_bits(), Ordering::Relaxed);
    }
}

// ------------------------------------------------------------------ data

/// Everything the recorder keeps: process-wide, as the `metrics` recorder
/// is.
struct Data {
    started: Instant,
    requests: [Arc<Count>; OUTCOMES.len()],
    latency: [Arc<Hist>; OUTCOMES.len()],
    in_flight: Arc<Level>,
    store: [Arc<Hist>; OPS.len()],
    store_errors: [Arc<Count>; OPS.len()],
    samples: Mutex<Samples>,
}

/// Cumulative values read at one instant.
#[derive(Clone)]
struct Snap {
    at: Instant,
    requests: [u64; OUTCOMES.len()],
    latency: [[u64; BUCKETS]; OUTCOMES.len()],
    store: [[u64; BUCKETS]; OPS.len()],
    store_errors: [u64; OPS.len()],
}

impl Snap {
    fn zero(at: Instant) -> Self {
        Self {
            at,
            requests: [0; OUTCOMES.len()],
            latency: [[0; BUCKETS]; OUTCOMES.len()],
            store: [[0; BUCKETS]; OPS.len()],
            store_errors: [0; OPS.len()],
        }
    }
}

/// One point of the history: what happened between two samples.
#[derive(Clone, Debug, PartialEq)]
struct Point {
    /// When it was taken, ms since the Unix epoch.
    t_ms: u64,
    /// Requests per second by outcome (the order of [`OUTCOMES`]).
    rates: [f64; OUTCOMES.len()],
    /// p50, p95, p99 of every request's duration in the interval, seconds.
    latency: [Option<f64>; 3],
    /// The in-flight gauge when the point was taken.
    in_flight: f64,
    /// p99 of every store call in the interval, seconds.
    store_p99: Option<f64>,
    /// Store errors per second.
    store_errors: f64,
}

/// The sampler's state.
struct Samples {
    /// The last snapshot taken (the start of the next point's interval).
    last: Snap,
    /// Snapshots of the last minute and a bit, oldest first: the baseline
    /// of the "last minute" numbers.
    recent: VecDeque<Snap>,
    /// The history, oldest first, at most [`HISTORY_POINTS`].
    history: VecDeque<Point>,
}

static DATA: LazyLock<Data> = LazyLock::new(|| {
    let started = Instant::now();
    Data {
        started,
        requests: std::array::from_fn(|_| Arc::new(Count(AtomicU64::new(0)))),
        latency: std::array::from_fn(|_| Arc::new(Hist::new())),
        in_flight: Arc::new(Level(AtomicU64::new(0f64.to_bits()))),
        store: std::array::from_fn(|_| Arc::new(Hist::new())),
        store_errors: std::array::from_fn(|_| Arc::new(Count(AtomicU64::new(0)))),
        samples: Mutex::new(Samples {
            last: Snap::zero(started),
            recent: VecDeque::from([Snap::zero(started)]),
            history: VecDeque::with_capacity(HISTORY_POINTS),
        }),
    }
});

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

fn seconds_between(a: Instant, b: Instant) -> f64 {
    b.saturating_duration_since(a).as_secs_f64()
}

impl Data {
    fn snap(&self) -> Snap {
        Snap {
            at: Instant::now(),
            requests: std::array::from_fn(|i| self.requests[i].0.load(Ordering::Relaxed)),
            latency: std::array::from_fn(|i| self.latency[i].read()),
            store: std::array::from_fn(|i| self.store[i].read()),
            store_errors: std::array::from_fn(|i| self.store_errors[i].0.load(Ordering::Relaxed)),
        }
    }

    /// Adds one point to the history (the sampler's tick).
    fn tick(&self) {
        let now = self.snap();
        let in_flight = self.in_flight.get();
        let mut s = self
            .samples
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let point = point_between(&s.last, &now, unix_ms(), in_flight);
        if s.history.len() == HISTORY_POINTS {
            s.history.pop_front();
        }
        s.history.push_back(point);
        s.last = now.clone();
        s.recent.push_back(now);
        // Keep the newest snapshot at least a minute old, and all after it.
        while s.recent.len() > 1
            && s.recent
                .get(1)
                .is_some_and(|n| s.last.at.saturating_duration_since(n.at) >= MINUTE)
        {
            s.recent.pop_front();
        }
    }
}

fn point_between(a: &Snap, b: &Snap, t_ms: u64, in_flight: f64) -> Point {
    let secs = seconds_between(a.at, b.at).max(1e-3);
    #[allow(clippy::cast_precision_loss)]
    let rate = |n: u64| n as f64 / secs;
    let mut all = [0u64; BUCKETS];
    for i in 0..OUTCOMES.len() {
        add(&mut all, &sub(&b.latency[i], &a.latency[i]));
    }
    let mut store = [0u64; BUCKETS];
    for i in 0..OPS.len() {
        add(&mut store, &sub(&b.store[i], &a.store[i]));
    }
    let errors: u64 = (0..OPS.len())
        .map(|i| b.store_errors[i].saturating_sub(a.store_errors[i]))
        .sum();
    Point {
        t_ms,
        rates: std::array::from_fn(|i| rate(b.requests[i].saturating_sub(a.requests[i]))),
        latency: [
            quantile(&all, 0.5),
            quantile(&all, 0.95),
            quantile(&all, 0.99),
        ],
        in_flight,
        store_p99: quantile(&store, 0.99),
        store_errors: rate(errors),
    }
}

// -------------------------------------------------------------- recorder

/// The status page's [`metrics::Recorder`]: keeps the series the page
/// shows ([`OUTCOMES`] of `idem_requests_total` and
/// `idem_request_duration_seconds`, `idem_in_flight`, [`OPS`] of
/// `idem_store_operation_duration_seconds` and `idem_store_errors_total`)
/// in process-wide atomics; every other series is a no-op. Cheap to
/// register (a match on the name, a look at one label, an `Arc` clone) and
/// to record (one relaxed atomic add; a histogram adds a logarithm).
///
/// [`super::metrics::install`] installs it next to the Prometheus recorder
/// (`metrics_util::layers::FanoutBuilder`).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct StatusRecorder;

/// The status page's recorder (see [`StatusRecorder`]). Every value is
/// process-wide: two recorders feed the same page.
pub(crate) fn recorder() -> StatusRecorder {
    StatusRecorder
}

fn label_index(key: &Key, label: &str, values: &[&str]) -> Option<usize> {
    let value = key.labels().find(|l| l.key() == label)?.value();
    values.iter().position(|v| *v == value)
}

impl metrics::Recorder for StatusRecorder {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}

    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        let d = &*DATA;
        let slot = match key.name() {
            REQUESTS_TOTAL => label_index(key, "outcome", &OUTCOMES).map(|i| &d.requests[i]),
            STORE_ERRORS => label_index(key, "op", &OPS).map(|i| &d.store_errors[i]),
            _ => None,
        };
        slot.map_or_else(Counter::noop, |c| Counter::from_arc(c.clone()))
    }

    fn register_gauge(&self, key: &Key, _: &Metadata<'_>) -> Gauge {
        if key.name() == IN_FLIGHT {
            Gauge::from_arc(DATA.in_flight.clone())
        } else {
            Gauge::noop()
        }
    }

    fn register_histogram(&self, key: &Key, _: &Metadata<'_>) -> Histogram {
        let d = &*DATA;
        let slot = match key.name() {
            REQUEST_DURATION => label_index(key, "outcome", &OUTCOMES).map(|i| &d.latency[i]),
            STORE_DURATION => label_index(key, "op", &OPS).map(|i| &d.store[i]),
            _ => None,
        };
        slot.map_or_else(Histogram::noop, |h| Histogram::from_arc(h.clone()))
    }
}

/// Starts the sampler (once per process; later calls do nothing): a thread
/// that adds a point to the history every [`SAMPLE_EVERY`]. A thread, not a
/// task: the recorder is process-wide and outlives any one runtime.
pub(crate) fn start_sampler() {
    static STARTED: Once = Once::new();
    STARTED.call_once(|| {
        LazyLock::force(&DATA);
        let spawned = std::thread::Builder::new()
            .name("idem-status-sampler".into())
            .spawn(|| loop {
                std::thread::sleep(SAMPLE_EVERY);
                DATA.tick();
            });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "status page: cannot start the sampler; its charts stay empty");
        }
    });
}

// ---------------------------------------------------------- store health

/// What the page caches per gateway: the last store probe and in-flight
/// listing, reused for [`PROBE_CACHE`].
#[derive(Debug, Default)]
pub(crate) struct PageState {
    cached: tokio::sync::Mutex<Option<(Instant, Value, Value)>>,
}

/// The gateway's readiness check (the same canary write and 1 s cache as
/// `/_idem/ready`): `ready` of the JSON.
async fn probe(state: &AdminState) -> Value {
    let started = Instant::now();
    let checked_ms = unix_ms();
    let (ok, reason, detail) = match state.health.readiness().await {
        crate::health::Readiness::Ready => (true, None, None),
        crate::health::Readiness::NotReady { reason, detail } => {
            (false, Some(reason.as_str()), Some(detail))
        }
    };
    let probe_ms = started.elapsed().as_secs_f64() * 1e3;
    json!({
        "ok": ok,
        "reason": reason,
        "detail": detail,
        "checked_ms": checked_ms,
        "probe_ms": probe_ms,
    })
}

/// Up to [`LISTED_KEYS`] in-flight records: `in_flight_keys` of the JSON.
async fn in_flight_keys(state: &AdminState) -> Value {
    let Some(admin) = state.store.admin() else {
        return json!({ "supported": false, "records": [], "error": null });
    };
    let query = ListQuery {
        state: StateFilter::InFlight,
        scope: None,
        limit: LISTED_KEYS,
        cursor: None,
    };
    match tokio::time::timeout(state.store_timeout, admin.list(&query)).await {
        Ok(Ok(page)) => {
            let records: Vec<Value> = page
                .records
                .iter()
                .filter_map(|r| match &r.record.state {
                    RecordState::InProgress {
                        fence,
                        lease_until,
                        held,
                    } => Some(json!({
                        "key_hash": key_hash(&r.scope, &r.key),
                        "fence": fence,
                        "lease_until_ms": lease_until.0,
                        "held": held.map(|h| h.as_str()),
                    })),
                    RecordState::Completed { .. } => None,
                })
                .collect();
            json!({ "supported": true, "records": records, "more": page.next.is_some(), "error": null })
        }
        Ok(Err(e)) => {
            json!({ "supported": true, "records": [], "error": crate::proxy::error_chain(&e) })
        }
        Err(_) => {
            json!({ "supported": true, "records": [], "error": "no answer within the store timeout" })
        }
    }
}

async fn store_view(state: &AdminState) -> (Value, Value) {
    let mut cached = state.status.cached.lock().await;
    if let Some((at, ready, keys)) = &*cached {
        if at.elapsed() < PROBE_CACHE {
            return (ready.clone(), keys.clone());
        }
    }
    let ready = probe(state).await;
    let keys = in_flight_keys(state).await;
    *cached = Some((Instant::now(), ready.clone(), keys.clone()));
    (ready, keys)
}

// ------------------------------------------------------------------ JSON

fn ms(seconds: Option<f64>) -> Value {
    seconds.map_or(Value::Null, |s| json!(s * 1e3))
}

fn by_outcome<T: Into<Value> + Copy>(values: &[T; OUTCOMES.len()]) -> Value {
    let map: Map<String, Value> = OUTCOMES
        .iter()
        .zip(values)
        .map(|(o, v)| ((*o).to_owned(), (*v).into()))
        .collect();
    Value::Object(map)
}

fn point_json(p: &Point) -> Value {
    json!({
        "t_ms": p.t_ms,
        "rates": by_outcome(&p.rates),
        "p50_ms": ms(p.latency[0]),
        "p95_ms": ms(p.latency[1]),
        "p99_ms": ms(p.latency[2]),
        "in_flight": p.in_flight,
        "store_p99_ms": ms(p.store_p99),
        "store_errors_per_s": p.store_errors,
    })
}

/// The metrics part of `/status.json` (everything but the store probe and
/// the listing).
fn metrics_json() -> Value {
    let d = &*DATA;
    let now = d.snap();
    let (base, newest, history) = {
        let s = d
            .samples
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let base = s
            .recent
            .iter()
            .rev()
            .find(|n| now.at.saturating_duration_since(n.at) >= MINUTE)
            .or_else(|| s.recent.front())
            .cloned()
            .unwrap_or_else(|| Snap::zero(d.started));
        let history: Vec<Value> = s.history.iter().map(point_json).collect();
        (base, s.history.back().cloned(), history)
    };
    let window = seconds_between(base.at, now.at);
    let rates = newest.map_or([0.0; OUTCOMES.len()], |p| p.rates);
    let mut all = [0u64; BUCKETS];
    let outcomes: Map<String, Value> = OUTCOMES
        .iter()
        .enumerate()
        .map(|(i, o)| {
            let lat = sub(&now.latency[i], &base.latency[i]);
            add(&mut all, &lat);
            let minute = now.requests[i].saturating_sub(base.requests[i]);
            (
                (*o).to_owned(),
                json!({
                    "total": now.requests[i],
                    "last_minute": minute,
                    "rate": rates[i],
                    "p50_ms": ms(quantile(&lat, 0.5)),
                    "p99_ms": ms(quantile(&lat, 0.99)),
                }),
            )
        })
        .collect();
    let ops: Map<String, Value> = OPS
        .iter()
        .enumerate()
        .map(|(i, op)| {
            let lat = sub(&now.store[i], &base.store[i]);
            (
                (*op).to_owned(),
                json!({
                    "calls": now.store[i].iter().sum::<u64>(),
                    "errors": now.store_errors[i],
                    "last_minute_calls": lat.iter().sum::<u64>(),
                    "last_minute_errors": now.store_errors[i].saturating_sub(base.store_errors[i]),
                    "p99_ms": ms(quantile(&lat, 0.99)),
                }),
            )
        })
        .collect();
    json!({
        "uptime_s": seconds_between(d.started, now.at),
        "sample_every_s": SAMPLE_EVERY.as_secs(),
        "history_points": HISTORY_POINTS,
        "minute_window_s": window,
        "outcomes": outcomes,
        "latency_ms": {
            "count": all.iter().sum::<u64>(),
            "p50": ms(quantile(&all, 0.5)),
            "p95": ms(quantile(&all, 0.95)),
            "p99": ms(quantile(&all, 0.99)),
        },
        "in_flight": d.in_flight.get(),
        "store_ops": ops,
        "history": history,
    })
}

async fn status_json(state: &AdminState) -> Value {
    let mut v = metrics_json();
    let (ready, keys) = store_view(state).await;
    if let Value::Object(m) = &mut v {
        m.insert("version".into(), json!(env!("CARGO_PKG_VERSION")));
        m.insert("now_ms".into(), json!(unix_ms()));
        m.insert(
            "store".into(),
            json!({ "kind": state.kind, "ready": ready }),
        );
        m.insert("in_flight_keys".into(), keys);
    }
    v
}

// ------------------------------------------------------------------ HTTP

const PAGE_HTML: &str = include_str!("status/status.html");
const PAGE_JS: &str = include_str!("status/status.js");
const PAGE_CSS: &str = include_str!("status/status.css");

/// The Content-Security-Policy of every answer: this origin's script,
/// style and `fetch` only; no inline script, no plugins, no framing, no
/// form posts.
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; \
                   connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

/// Whether `path` is one of the page's static parts (served without the
/// token: they hold no data).
pub(crate) fn is_page_asset(path: &str) -> bool {
    matches!(path, "/" | "/status.js" | "/status.css")
}

fn respond(status: StatusCode, content_type: &'static str, body: BoxBody) -> Response<BoxBody> {
    let mut resp = Response::new(body);
    *resp.status_mut() = status;
    let h = resp.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    secure(h);
    resp
}

/// The headers every status answer carries.
fn secure(h: &mut http::HeaderMap) {
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CSP),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
}

fn method_ok<B>(req: &Request<B>) -> Option<Response<BoxBody>> {
    if req.method() == Method::GET || req.method() == Method::HEAD {
        return None;
    }
    let mut resp = super::method_not_allowed();
    resp.headers_mut()
        .insert(header::ALLOW, HeaderValue::from_static("GET, HEAD"));
    secure(resp.headers_mut());
    Some(resp)
}

fn body_for<B>(req: &Request<B>, text: impl Into<bytes::Bytes>) -> BoxBody {
    if req.method() == Method::HEAD {
        idem_http::full(bytes::Bytes::new())
    } else {
        idem_http::full(text)
    }
}

/// Answers `GET /`, `/status.js`, `/status.css` (the page: no data, no
/// token needed once a token is configured).
pub(crate) fn asset<B>(req: &Request<B>) -> Response<BoxBody> {
    if let Some(resp) = method_ok(req) {
        return resp;
    }
    let (text, content_type) = match req.uri().path() {
        "/status.js" => (PAGE_JS, "text/javascript; charset=utf-8"),
        "/status.css" => (PAGE_CSS, "text/css; charset=utf-8"),
        _ => (PAGE_HTML, "text/html; charset=utf-8"),
    };
    respond(StatusCode::OK, content_type, body_for(req, text))
}

/// Answers `GET /status.json` (already authorised).
pub(crate) async fn handle<B>(req: Request<B>, state: &AdminState) -> Response<BoxBody> {
    if let Some(resp) = method_ok(&req) {
        return resp;
    }
    let v = status_json(state).await;
    respond(
        StatusCode::OK,
        "application/json",
        body_for(&req, v.to_string()),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_cover_the_range_in_order() {
        assert_eq!(Hist::bucket(0.0), 0);
        assert_eq!(Hist::bucket(-1.0), 0);
        assert_eq!(Hist::bucket(f64::NAN), 0);
        assert_eq!(Hist::bucket(BUCKET_BASE), 0);
        assert_eq!(Hist::bucket(BUCKET_BASE * 1.1), 1);
        assert_eq!(Hist::bucket(1e9), BUCKETS - 1);
        let mut last = 0;
        for i in 0..10_000 {
            let v = f64::from(i) * 1e-3;
            let b = Hist::bucket(v);
            assert!(b >= last, "bucket of {v} went down");
            assert!(v <= bucket_bound(b) * (1.0 + 1e-9) || b == BUCKETS - 1);
            if b > 0 {
                assert!(v > bucket_bound(b - 1) * (1.0 - 1e-9), "{v} in {b}");
            }
            last = b;
        }
    }

    #[test]
    fn quantiles_are_within_a_bucket() {
        let h = Hist::new();
        assert_eq!(quantile(&h.read(), 0.5), None);
        for i in 1..=1000 {
            h.record(f64::from(i) * 1e-3); // 1 ms .. 1 s
        }
        let counts = h.read();
        for (q, want) in [(0.5, 0.5), (0.95, 0.95), (0.99, 0.99)] {
            let got = quantile(&counts, q).unwrap();
            assert!(
                got >= want && got <= want * BUCKET_FACTOR,
                "q{q}: {got} for {want}"
            );
        }
    }

    #[test]
    fn points_give_rates_and_percentiles_of_their_interval() {
        let t0 = Instant::now();
        let a = Snap::zero(t0);
        let mut b = Snap::zero(t0 + Duration::from_secs(5));
        b.requests[0] = 10; // executed
        b.requests[1] = 5; // replayed
        b.latency[0][Hist::bucket(0.010)] = 10;
        b.store[0][Hist::bucket(0.002)] = 10;
        b.store_errors[0] = 1;
        let p = point_between(&a, &b, 1, 2.0);
        assert!((p.rates[0] - 2.0).abs() < 1e-9);
        assert!((p.rates[1] - 1.0).abs() < 1e-9);
        let p99 = p.latency[2].unwrap();
        assert!((0.010..0.0125).contains(&p99), "{p99}");
        assert!((p.store_errors - 0.2).abs() < 1e-9);
        assert!(p.store_p99.is_some());
        assert_eq!(p.in_flight, 2.0);
    }

    #[test]
    fn the_recorder_keeps_known_series_and_ignores_others() {
        metrics::with_local_recorder(&recorder(), || {
            let before = DATA.snap();
            let in_flight = DATA.in_flight.get();
            metrics::counter!(REQUESTS_TOTAL, "outcome" => "replayed").increment(3);
            metrics::counter!(REQUESTS_TOTAL, "outcome" => "no-such-outcome").increment(3);
            metrics::counter!("something_else_total").increment(1);
            metrics::histogram!(REQUEST_DURATION, "outcome" => "replayed").record(0.004);
            metrics::histogram!(STORE_DURATION, "op" => "begin").record(0.001);
            metrics::counter!(STORE_ERRORS, "op" => "begin", "kind" => "timeout").increment(1);
            metrics::gauge!(IN_FLIGHT).increment(2.0);
            metrics::gauge!(IN_FLIGHT).decrement(1.0);
            let after = DATA.snap();
            let r = OUTCOMES.iter().position(|o| *o == "replayed").unwrap();
            // Other tests in this process may record too: at least ours.
            assert!(after.requests[r] >= before.requests[r] + 3);
            assert!(after.latency[r].iter().sum::<u64>() > before.latency[r].iter().sum::<u64>());
            assert!(after.store[0].iter().sum::<u64>() > before.store[0].iter().sum::<u64>());
            assert!(after.store_errors[0] > before.store_errors[0]);
            assert!((DATA.in_flight.get() - in_flight - 1.0).abs() < 1e-9);
            metrics::gauge!(IN_FLIGHT).decrement(1.0);
        });
    }

    #[test]
    fn the_json_names_every_outcome_and_op() {
        DATA.tick();
        let v = metrics_json();
        for o in OUTCOMES {
            assert!(v["outcomes"][o]["total"].is_u64(), "{o}: {v}");
        }
        for op in OPS {
            assert!(v["store_ops"][op]["calls"].is_u64(), "{op}");
        }
        assert!(!v["history"].as_array().unwrap().is_empty());
        assert!(v["history"][0]["rates"]["executed"].is_number());
    }

    #[test]
    fn the_page_sends_no_inline_script() {
        assert!(PAGE_HTML.contains("<script src=\"/status.js\""));
        let inline = PAGE_HTML.matches("<script").count();
        assert_eq!(inline, PAGE_HTML.matches("<script src=").count());
        for handler in [
            "onclick=",
            "onload=",
            "onsubmit=",
            "onerror=",
            "javascript:",
        ] {
            assert!(!PAGE_HTML.contains(handler), "inline handler {handler}");
        }
        assert!(!PAGE_HTML.contains("style=\""));
    }
}
