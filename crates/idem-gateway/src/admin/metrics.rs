//! `GET /metrics`: Prometheus text exposition (format 0.0.4) of every
//! series the gateway, the layer and the stores record through the
//! [`metrics`] facade (docs/OPERATIONS.md lists them).
//!
//! The recorder is installed once per process, by [`install`], when the
//! admin listener is on (`--admin-listen off`: no recorder, every series
//! costs a branch). It is installed before the store is opened and the
//! layer is built, since both register their handles when they are made.

use std::sync::OnceLock;
use std::time::Duration;

use http::{header, HeaderValue, Response, StatusCode};
use idem_http::{problem, BoxBody};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

/// The `Content-Type` of the exposition.
pub(crate) const CONTENT_TYPE: &str = "text/plain; version=0.0.4";

/// Bucket bounds of every `_seconds` histogram: 100 µs to 30 s (a memory
/// store call takes microseconds, an upstream call up to `--upstream-timeout`).
pub(crate) const BUCKETS: [f64; 17] = [
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0, 30.0,
];

/// Histogram of upstream calls, seconds: from sending the request to its
/// response head (or the error), recorded by the proxy.
pub(crate) const UPSTREAM_DURATION: &str = "idem_upstream_duration_seconds";

/// Gauge, always 1, labelled with the version (`version="0.1.0"`).
pub(crate) const BUILD_INFO: &str = "idem_build_info";

/// How often histogram samples are folded into their buckets between
/// two scrapes (they wait in a queue until then).
const UPKEEP: Duration = Duration::from_secs(5);

static HANDLE: OnceLock<Option<PrometheusHandle>> = OnceLock::new();

/// Installs the process's metrics recorder (once; later calls return the
/// same answer): the Prometheus recorder that [`render`] reads, combined
/// with the status page's recorder through a fanout, so every series
/// reaches both. Sets `idem_build_info{version} 1`. Needs a tokio runtime
/// (a task folds histogram samples every 5 s).
///
/// `None` when another recorder was installed first (an application that
/// embeds the gateway and brought its own); it is logged, and `/metrics`
/// answers 503.
pub(crate) fn install() -> Option<&'static PrometheusHandle> {
    HANDLE
        .get_or_init(|| {
            let builder = match PrometheusBuilder::new()
                .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), &BUCKETS)
            {
                Ok(b) => b,
                Err(e) => {
                    tracing::error!(error = %e, "metrics: bad histogram buckets; /metrics is off");
                    return None;
                }
            };
            let prometheus = builder.build_recorder();
            let handle = prometheus.handle();
            let fanout = metrics_util::layers::FanoutBuilder::default()
                .add_recorder(prometheus)
                .add_recorder(super::status::recorder())
                .build();
            if let Err(e) = metrics::set_global_recorder(fanout) {
                tracing::warn!(error = %e, "metrics: a recorder is installed already; /metrics is off");
                return None;
            }
            metrics::gauge!(BUILD_INFO, "version" => env!("CARGO_PKG_VERSION")).set(1.0);
            // Counters of rare events are exported from the start, at 0, so
            // `rate()` and alerts over them see a series before the first event.
            for name in [
                idem_core::instrument::LEASE_LOST,
                idem_core::instrument::SAVE_RETRIES,
                idem_core::instrument::LEASE_TAKEOVERS,
                idem_core::instrument::SAVES_GIVEN_UP,
                idem_http::observe::TOKENS_ISSUED,
            ] {
                metrics::counter!(name).increment(0);
            }
            for reason in idem_http::TokenRejection::ALL {
                metrics::counter!(idem_http::observe::TOKENS_REJECTED, "reason" => reason.as_str())
                    .increment(0);
            }
            let upkeep = handle.clone();
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                rt.spawn(async move {
                    let mut tick = tokio::time::interval(UPKEEP);
                    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                    loop {
                        tick.tick().await;
                        upkeep.run_upkeep();
                    }
                });
            }
            Some(handle)
        })
        .as_ref()
}

/// The current metrics as Prometheus text, `Content-Type: text/plain;
/// version=0.0.4`; 503 when no recorder of ours is installed.
pub(crate) fn render() -> Response<BoxBody> {
    let Some(handle) = HANDLE.get().and_then(Option::as_ref) else {
        return problem(
            StatusCode::SERVICE_UNAVAILABLE,
            "metrics-unavailable",
            "no metrics recorder of the gateway is installed in this process",
        );
    };
    let mut resp = Response::new(idem_http::full(handle.render()));
    let h = resp.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(CONTENT_TYPE));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    resp
}
