//! The bookkeeping of a finished request, in one place: its metrics, its
//! one log line, and the fields of the current trace span.
//!
//! The layer calls its observer once per request it handled
//! (guarded or passed through). Series, recorded through the [`metrics`]
//! facade (whatever recorder the process installed; none: a branch each):
//!
//! | series | type | labels |
//! |---|---|---|
//! | `idem_requests_total` | counter | `outcome` ([`RequestOutcome`]), `route` ([`crate::routes`]: the matched route's name, else `default`) |
//! | `idem_request_duration_seconds` | histogram, seconds | `outcome`, `route` |
//! | `idem_in_flight` | gauge | — guarded requests being handled now |
//! | `idem_tokens_issued_total` | counter | — |
//! | `idem_tokens_rejected_total` | counter | `reason` ([`TokenRejection`]) |
//!
//! The handles are registered when the layer is made
//! ([`crate::IdempotencyLayer::new`]): install the metrics recorder before.
//!
//! The log line (target `idem`, level INFO) carries `outcome`, `status`,
//! `duration_ms`, `key` (the key as the client sent it), `key_hash`
//! ([`idem_core::key_hash`] of the scope and key: how `idem keys`, traces
//! and logs name a key), `method`, `path` (normalised), `route`, `saved`.
//! A passed-through request gets a line (message `request`) only with
//! [`crate::Options::access_log`].
//!
//! On [`tracing::Span::current()`] the layer records `idem.outcome`,
//! `http.response.status_code` and `idem.key_hash`; a span that does not
//! declare these fields ignores them.

use std::time::Duration;

use http::{Method, StatusCode};
use idem_core::{key_hash, IdempotencyKey, Scope};
use metrics::{Counter, Gauge, Histogram};

/// The route name of requests no route matches ([`crate::routes`]): `default`.
pub const DEFAULT_ROUTE: &str = "default";
/// Counter of handled requests, by `outcome` and `route`.
pub const REQUESTS: &str = "idem_requests_total";
/// Histogram of the time from a request's arrival at the layer to its
/// response head, seconds, by `outcome` and `route`.
pub const REQUEST_DURATION: &str = "idem_request_duration_seconds";
/// Gauge of guarded requests being handled now (from the parsed key to
/// the answer; a run whose client left counts until it is saved).
pub const IN_FLIGHT: &str = "idem_in_flight";
/// Counter of submit tokens issued.
pub const TOKENS_ISSUED: &str = "idem_tokens_issued_total";
/// Counter of submit tokens refused, by `reason`.
pub const TOKENS_REJECTED: &str = "idem_tokens_rejected_total";

/// How the layer handled a request: the `outcome` label and log field.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RequestOutcome {
    /// The inner service ran for a claimed key and the key now holds its
    /// outcome: the response was stored for replay, or the key is held
    /// until its lease ends (outcome unknown: a 504, a body that broke, a
    /// save that failed), or a newer run took the key over.
    Executed,
    /// The inner service was called for a claimed key and the key was then
    /// released, so a retry runs again: an answer the policy does not keep
    /// (5xx, 408, 409, 425, 429 by default), an upstream the gateway could
    /// not reach (502 `upstream-unreachable`: nothing was sent), a 1xx, or
    /// the inner service's error.
    Released,
    /// Answered from the store: the stored response of an earlier run
    /// (also a 410 `response-not-retained`).
    Replayed,
    /// 409 `in-flight`: another run holds the key.
    InFlight,
    /// 422 `key-mismatch`: the key was used for a different request.
    Mismatch,
    /// Refused by the layer before any store or inner work: a bad, missing
    /// or repeated key or token (400, 403, 428), a body too large, too slow
    /// or unreadable (413, 408, 400), an ambiguous path or a method in the
    /// wrong case (400), or no room to buffer the body (503 `overloaded`).
    Rejected,
    /// The store failed before the run and the request was not run: 503
    /// `store-unavailable` / `store-full`, 500 `corrupt-record`.
    StoreError,
    /// Not guarded: a method the layer does not guard, or a guarded method
    /// without a key (when keys are optional); forwarded untouched.
    Passthrough,
    /// The store was unavailable and fail-open forwarded the request
    /// without protection (`Idempotency-Status: unprotected`).
    FailedOpen,
}

impl RequestOutcome {
    /// Every outcome, in label order.
    pub const ALL: [RequestOutcome; 9] = [
        RequestOutcome::Executed,
        RequestOutcome::Released,
        RequestOutcome::Replayed,
        RequestOutcome::InFlight,
        RequestOutcome::Mismatch,
        RequestOutcome::Rejected,
        RequestOutcome::StoreError,
        RequestOutcome::Passthrough,
        RequestOutcome::FailedOpen,
    ];

    /// The label value: `executed`, `released`, `replayed`, `in_flight`,
    /// `mismatch`, `rejected`, `store_error`, `passthrough`, `failed_open`.
    ///
    /// ```
    /// assert_eq!(idem_http::RequestOutcome::InFlight.as_str(), "in_flight");
    /// ```
    pub const fn as_str(self) -> &'static str {
        match self {
            RequestOutcome::Executed => "executed",
            RequestOutcome::Released => "released",
            RequestOutcome::Replayed => "replayed",
            RequestOutcome::InFlight => "in_flight",
            RequestOutcome::Mismatch => "mismatch",
            RequestOutcome::Rejected => "rejected",
            RequestOutcome::StoreError => "store_error",
            RequestOutcome::Passthrough => "passthrough",
            RequestOutcome::FailedOpen => "failed_open",
        }
    }
}

/// Why a submit token was refused: the `reason` label of
/// `idem_tokens_rejected_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum TokenRejection {
    /// 428 `token-required`: a token route without an `Idempotency-Key`.
    Missing,
    /// 403 `token-unknown`: the key is not a live token of the caller
    /// (never issued to it, or expired before its first use).
    Unknown,
    /// Issuing refused: the caller sent none of the scope headers (400
    /// `scope-required`).
    ScopeRequired,
    /// Issuing refused: a cap on live tokens (429 `too-many-tokens`).
    TooMany,
}

impl TokenRejection {
    /// Every reason, in label order.
    pub const ALL: [TokenRejection; 4] = [
        TokenRejection::Missing,
        TokenRejection::Unknown,
        TokenRejection::ScopeRequired,
        TokenRejection::TooMany,
    ];

    /// The label value: `missing`, `unknown`, `scope_required`, `too_many`.
    pub fn as_str(self) -> &'static str {
        match self {
            TokenRejection::Missing => "missing",
            TokenRejection::Unknown => "unknown",
            TokenRejection::ScopeRequired => "scope_required",
            TokenRejection::TooMany => "too_many",
        }
    }
}

/// Adds one to `idem_tokens_rejected_total{reason}` (rare: looked up each time).
pub(crate) fn token_rejected(reason: TokenRejection) {
    metrics::counter!(TOKENS_REJECTED, "reason" => reason.as_str()).increment(1);
}

/// A finished request, as [`Observer::finished`] takes it.
#[derive(Debug)]
pub(crate) struct Finished<'a> {
    pub(crate) outcome: RequestOutcome,
    /// `None`: the inner service failed (its error is returned as is).
    pub(crate) status: Option<StatusCode>,
    pub(crate) elapsed: Duration,
    pub(crate) method: &'a Method,
    /// The normalised path.
    pub(crate) path: &'a str,
    /// The route's name ([`crate::routes`]; `default` when none matched).
    pub(crate) route: &'a str,
    /// The key as it goes in the log (`None`: no key).
    pub(crate) key: Option<&'a str>,
    /// The scoped key, for `key_hash`.
    pub(crate) scoped: Option<(&'a Scope, &'a IdempotencyKey)>,
    /// What happened to the key after a run (`stored`, `released`, …).
    pub(crate) saved: Option<&'static str>,
    /// Whether to write the log line.
    pub(crate) log: bool,
}

/// The metric handles of one route (registered once per layer and route).
pub(crate) struct Observer {
    /// The `route` label.
    route: metrics::SharedString,
    /// One per [`RequestOutcome::ALL`], in that order: the request counter
    /// and its duration histogram, registered when the observer is made
    /// for the default route (so every series shows, at 0) and on first
    /// use for a named route (so a route that never sees a request, or one
    /// replaced by a reload, adds no series).
    handles: [std::sync::OnceLock<(Counter, Histogram)>; 9],
    in_flight: Gauge,
    tokens_issued: Counter,
}

impl std::fmt::Debug for Observer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Observer")
            .field("route", &self.route)
            .finish_non_exhaustive()
    }
}

impl Observer {
    /// The handles of the route `route` with the current recorder (those
    /// of the default route registered now).
    pub(crate) fn for_route(route: &str) -> Self {
        let o = Self {
            route: metrics::SharedString::from(route.to_owned()),
            handles: std::array::from_fn(|_| std::sync::OnceLock::new()),
            in_flight: metrics::gauge!(IN_FLIGHT),
            tokens_issued: metrics::counter!(TOKENS_ISSUED),
        };
        if route == DEFAULT_ROUTE {
            for i in 0..RequestOutcome::ALL.len() {
                o.handles(i);
            }
        }
        o
    }

    /// The counter and histogram of outcome `i`.
    fn handles(&self, i: usize) -> &(Counter, Histogram) {
        self.handles[i].get_or_init(|| {
            let outcome = RequestOutcome::ALL[i].as_str();
            let route = self.route.clone();
            (
                metrics::counter!(REQUESTS, "outcome" => outcome, "route" => route.clone()),
                metrics::histogram!(REQUEST_DURATION, "outcome" => outcome, "route" => route),
            )
        })
    }

    /// Counts a guarded request as running until the guard is dropped.
    pub(crate) fn running(&self) -> Running {
        self.in_flight.increment(1.0);
        Running(self.in_flight.clone())
    }

    /// Adds one to `idem_tokens_issued_total`.
    pub(crate) fn token_issued(&self) {
        self.tokens_issued.increment(1);
    }

    /// Records a finished request: its counter and duration, its log line
    /// (when `f.log`), and its outcome, status and key hash on the current
    /// span.
    pub(crate) fn finished(&self, f: &Finished<'_>) {
        let (requests, duration) = self.handles(f.outcome as usize);
        requests.increment(1);
        duration.record(f.elapsed);
        let span = tracing::Span::current();
        let log = f.log && tracing::enabled!(target: "idem", tracing::Level::INFO);
        // SHA-256 of the scoped key only when someone reads it.
        let hash = f
            .scoped
            .filter(|_| log || !span.is_disabled())
            .map(|(scope, key)| key_hash(scope, key));
        if !span.is_disabled() {
            span.record("idem.outcome", f.outcome.as_str());
            if let Some(status) = f.status {
                span.record("http.response.status_code", status.as_u16());
                // OTel: a server span with a 5xx answer failed.
                if status.is_server_error() {
                    span.record("otel.status_code", "error");
                }
            }
            if let Some(h) = &hash {
                span.record("idem.key_hash", h.as_str());
            }
        }
        if !log {
            return;
        }
        let duration_ms = u64::try_from(f.elapsed.as_millis()).unwrap_or(u64::MAX);
        let status = f.status.map(|s| s.as_u16());
        if f.outcome == RequestOutcome::Passthrough {
            tracing::info!(
                target: "idem",
                outcome = f.outcome.as_str(),
                status,
                duration_ms,
                method = %f.method,
                path = %f.path,
                route = f.route,
                "request"
            );
            return;
        }
        tracing::info!(
            target: "idem",
            outcome = f.outcome.as_str(),
            status,
            inner_error = f.status.is_none().then_some(true),
            duration_ms,
            key = f.key.unwrap_or("-"),
            key_hash = hash.as_deref().unwrap_or("-"),
            method = %f.method,
            path = %f.path,
            route = f.route,
            saved = f.saved.unwrap_or("-"),
            "idempotency-key request"
        );
    }
}

/// A guarded request counted in `idem_in_flight`; dropped when it is done.
#[derive(Debug)]
pub(crate) struct Running(Gauge);

impl Drop for Running {
    fn drop(&mut self) {
        self.0.decrement(1.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_values_are_distinct_and_in_order() {
        let names: Vec<&str> = RequestOutcome::ALL.iter().map(|o| o.as_str()).collect();
        let mut sorted = names.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), names.len());
        for (i, o) in RequestOutcome::ALL.iter().enumerate() {
            assert_eq!(*o as usize, i, "{o:?} indexes the handle arrays");
        }
    }
}
