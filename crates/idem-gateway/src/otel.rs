//! OpenTelemetry traces: where they go (`--otlp-endpoint`), and, with the
//! Cargo feature `otel`, the `tracing` layer that exports the gateway's
//! spans over OTLP/HTTP (protobuf) and the W3C Trace Context propagation to
//! the upstream.
//!
//! Spans (all at `DEBUG` level, target `idem`, so the default log filter
//! neither records nor prints them; the OTel layer has a filter of its own
//! that takes the spans named `idem.*` and no events):
//!
//! | span | kind | made by | attributes |
//! |---|---|---|---|
//! | `idem.request` | server | the layer, per request of a guarded method | `http.request.method`, `url.path` (normalised, no query), `idem.key_hash`, `idem.outcome`, `http.response.status_code` |
//! | `idem.proxy` | server | the layer, per request of another method | `http.request.method`, `url.path`, `http.response.status_code` |
//! | `idem.store` | internal | the engine, per store call | `op` |
//! | `idem.upstream` | client | the proxy, per upstream call | `http.request.method`, `url.path`, `http.response.status_code`, `error.type` |
//!
//! The raw key, the scope and the values of scope headers (such as
//! `Authorization`) are never recorded: a key is named by
//! [`idem_core::key_hash`]. See docs/TRACING.md.

use std::fmt;

use http::Uri;

/// The OTLP signal path appended to `--otlp-endpoint`, as the OTel
/// specification appends it to `OTEL_EXPORTER_OTLP_ENDPOINT`.
pub const TRACES_PATH: &str = "/v1/traces";

/// The service name when `OTEL_SERVICE_NAME` is unset or empty.
pub const DEFAULT_SERVICE_NAME: &str = "idem-gateway";

/// Where traces are exported (`--otlp-endpoint`): the full OTLP/HTTP traces
/// URL, e.g. `http://127.0.0.1:4318/v1/traces`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OtlpEndpoint {
    traces: Uri,
}

impl OtlpEndpoint {
    /// The URL the spans are POSTed to.
    pub fn traces_url(&self) -> &Uri {
        &self.traces
    }
}

impl fmt::Display for OtlpEndpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.traces.fmt(f)
    }
}

/// Parses `--otlp-endpoint`: the collector's base URL, as the OTel
/// specification's `OTEL_EXPORTER_OTLP_ENDPOINT` (`http://host:4318`, or
/// with a path prefix `http://host/otel`), to which [`TRACES_PATH`] is
/// appended; a URL whose path already ends in `/v1/traces` is taken as
/// the full traces URL (as `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`).
///
/// ```
/// use idem_gateway::parse_otlp_endpoint;
/// let e = parse_otlp_endpoint("http://127.0.0.1:4318").unwrap();
/// assert_eq!(e.traces_url(), "http://127.0.0.1:4318/v1/traces");
/// let e = parse_otlp_endpoint("http://collector/otel/").unwrap();
/// assert_eq!(e.traces_url(), "http://collector/otel/v1/traces");
/// let e = parse_otlp_endpoint("http://collector:4318/v1/traces").unwrap();
/// assert_eq!(e.traces_url(), "http://collector:4318/v1/traces");
/// assert!(parse_otlp_endpoint("https://collector:4318").is_err());
/// assert!(parse_otlp_endpoint("collector:4318").is_err());
/// ```
///
/// # Errors
/// A message for a URL that does not parse, has no host, is not `http://`
/// (the exporter has no TLS: export to a collector on the same host or
/// network), or carries a query or fragment.
pub fn parse_otlp_endpoint(raw: &str) -> Result<OtlpEndpoint, String> {
    let raw = raw.trim();
    let uri: Uri = raw
        .parse()
        .map_err(|e| format!("{raw:?} is not a URL: {e}"))?;
    match uri.scheme_str() {
        Some("http") => {}
        Some("https") => {
            return Err(format!(
                "{raw:?}: https is not supported by the built-in OTLP exporter (it has no TLS); \
                 send to a collector over http, e.g. an OpenTelemetry Collector on the same host"
            ))
        }
        _ => {
            return Err(format!(
                "{raw:?} is not an http:// URL (e.g. http://127.0.0.1:4318)"
            ))
        }
    }
    let Some(authority) = uri.authority() else {
        return Err(format!("{raw:?} has no host"));
    };
    if uri.query().is_some() || raw.contains('#') {
        return Err(format!("{raw:?}: a query or fragment is not allowed"));
    }
    let base = uri.path().trim_end_matches('/');
    let path = if base.ends_with(TRACES_PATH) {
        base.to_owned()
    } else {
        format!("{base}{TRACES_PATH}")
    };
    let traces = Uri::builder()
        .scheme("http")
        .authority(authority.clone())
        .path_and_query(path)
        .build()
        .map_err(|e| format!("{raw:?}: {e}"))?;
    Ok(OtlpEndpoint { traces })
}

/// The service name spans are exported under: `OTEL_SERVICE_NAME` when set
/// and not blank, else [`DEFAULT_SERVICE_NAME`].
pub fn service_name() -> String {
    std::env::var("OTEL_SERVICE_NAME")
        .ok()
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| DEFAULT_SERVICE_NAME.to_owned())
}

#[cfg(feature = "otel")]
pub use export::{layer, OtelError, OtelGuard};

#[cfg(feature = "otel")]
pub(crate) use export::inject;

#[cfg(feature = "otel")]
mod export {
    use std::fmt;

    use http::{HeaderMap, HeaderName, HeaderValue};
    use opentelemetry::propagation::Injector;
    use opentelemetry::trace::TracerProvider as _;
    use opentelemetry::KeyValue;
    use opentelemetry_otlp::{Protocol, WithExportConfig};
    use opentelemetry_sdk::propagation::TraceContextPropagator;
    use opentelemetry_sdk::runtime::TokioCurrentThread;
    use opentelemetry_sdk::trace::span_processor_with_async_runtime::BatchSpanProcessor;
    use opentelemetry_sdk::trace::SdkTracerProvider;
    use opentelemetry_sdk::Resource;
    use tracing::Subscriber;
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    use tracing_subscriber::filter::{filter_fn, FilterFn};
    use tracing_subscriber::registry::LookupSpan;
    use tracing_subscriber::Layer;

    use super::{service_name, OtlpEndpoint};

    /// The exporter could not be set up.
    #[derive(Debug)]
    pub struct OtelError(String);

    impl fmt::Display for OtelError {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            write!(f, "cannot set up the OTLP trace exporter: {}", self.0)
        }
    }

    impl std::error::Error for OtelError {}

    /// Keeps the exporter alive; [`OtelGuard::shutdown`] (or dropping it)
    /// exports the spans still queued and stops the exporter's thread.
    #[derive(Debug)]
    pub struct OtelGuard {
        provider: Option<SdkTracerProvider>,
    }

    impl OtelGuard {
        /// Flushes the queued spans and stops the exporter, waiting for the
        /// collector at most the export timeout (10 s,
        /// `OTEL_EXPORTER_OTLP_TIMEOUT`). Call it outside the gateway's
        /// runtime or from a thread that may block.
        ///
        /// # Errors
        /// The exporter's error (the collector did not take the spans, or
        /// the exporter had stopped already), as text.
        pub fn shutdown(mut self) -> Result<(), String> {
            match self.provider.take() {
                Some(p) => p.shutdown().map_err(|e| e.to_string()),
                None => Ok(()),
            }
        }
    }

    impl Drop for OtelGuard {
        fn drop(&mut self) {
            if let Some(p) = self.provider.take() {
                let _ = p.shutdown();
            }
        }
    }

    /// Whether a callsite is one of the gateway's spans: the OTel layer
    /// takes spans named `idem.*` only, never events (a log line may name
    /// the raw key; a span never does).
    fn idem_spans() -> FilterFn<impl Fn(&tracing::Metadata<'_>) -> bool> {
        filter_fn(|m| m.is_span() && m.name().starts_with("idem."))
    }

    /// The `tracing` layer that exports the gateway's spans to `endpoint`
    /// over OTLP/HTTP (protobuf), batched on a thread of its own
    /// (`OTEL_BSP_SCHEDULE_DELAY`, default 5000 ms, and the other
    /// `OTEL_BSP_*` variables apply), under [`service_name`]; it also
    /// installs the W3C Trace Context propagator (`traceparent`,
    /// `tracestate`) as the global one. Keep the guard until the end and
    /// [`OtelGuard::shutdown`] it to flush.
    ///
    /// # Errors
    /// [`OtelError`] when the exporter cannot be built.
    #[allow(clippy::type_complexity)]
    pub fn layer<S>(
        endpoint: &OtlpEndpoint,
    ) -> Result<(Box<dyn Layer<S> + Send + Sync + 'static>, OtelGuard), OtelError>
    where
        S: Subscriber + for<'a> LookupSpan<'a> + Send + Sync,
    {
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_protocol(Protocol::HttpBinary)
            .with_endpoint(endpoint.traces_url().to_string())
            .build()
            .map_err(|e| OtelError(e.to_string()))?;
        let processor = BatchSpanProcessor::builder(exporter, TokioCurrentThread).build();
        let resource = Resource::builder()
            .with_service_name(service_name())
            .with_attribute(KeyValue::new("service.version", env!("CARGO_PKG_VERSION")))
            .build();
        let provider = SdkTracerProvider::builder()
            .with_span_processor(processor)
            .with_resource(resource)
            .build();
        let tracer = provider.tracer("idem");
        opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
        let layer = tracing_opentelemetry::layer()
            .with_tracer(tracer)
            .with_filter(idem_spans())
            .boxed();
        Ok((
            layer,
            OtelGuard {
                provider: Some(provider),
            },
        ))
    }

    /// Writes `span`'s context into `headers` as `traceparent` (and
    /// `tracestate`), replacing the client's, when the span is exported;
    /// otherwise (no `--otlp-endpoint`, or a disabled span) the headers are
    /// left as they are, so a client's `traceparent` passes through.
    pub(crate) fn inject(span: &tracing::Span, headers: &mut HeaderMap) {
        if span.is_disabled() {
            return;
        }
        let cx = span.context();
        opentelemetry::global::get_text_map_propagator(|p| {
            p.inject_context(&cx, &mut HeaderInjector(headers))
        });
    }

    struct HeaderInjector<'a>(&'a mut HeaderMap);

    impl Injector for HeaderInjector<'_> {
        fn set(&mut self, key: &str, value: String) {
            let (Ok(name), Ok(value)) = (
                HeaderName::from_bytes(key.as_bytes()),
                HeaderValue::from_str(&value),
            ) else {
                return;
            };
            if value.is_empty() {
                // An empty `tracestate` says nothing; the client's (if
                // any) goes with its trace, which was continued.
                self.0.remove(&name);
            } else {
                self.0.insert(name, value);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoint_urls() {
        let url = |s: &str| parse_otlp_endpoint(s).map(|e| e.traces_url().to_string());
        assert_eq!(url("http://h:4318").unwrap(), "http://h:4318/v1/traces");
        assert_eq!(url(" http://h:4318/ ").unwrap(), "http://h:4318/v1/traces");
        assert_eq!(url("http://h/a/b").unwrap(), "http://h/a/b/v1/traces");
        assert_eq!(url("http://h/v1/traces/").unwrap(), "http://h/v1/traces");
        for bad in [
            "",
            "h:4318",
            "ftp://h",
            "https://h",
            "http://h:4318?x=1",
            "http:///x",
        ] {
            assert!(url(bad).is_err(), "{bad:?} accepted");
        }
    }
}
