//! OpenTelemetry traces from a real `idem gateway` process
//! (`--otlp-endpoint`) to an in-test OTLP/HTTP receiver that decodes the
//! real protobuf `ExportTraceServiceRequest`s, in front of an upstream that
//! records the `traceparent` it receives.
//!
//! - A guarded request carrying a client `traceparent` is continued: the
//!   `idem.request` span is in the client's trace with the client's span
//!   as parent, carries outcome, status and the 16-hex key hash (never the
//!   raw key or the `Authorization` value), has store and `idem.upstream`
//!   children, and the upstream gets a `traceparent` whose parent is the
//!   `idem.upstream` span. Its replay gets a span with outcome `replayed`.
//! - An unguarded request is continued and propagated too (`idem.proxy`).
//! - A 5xx marks the request and upstream spans as failed.
//! - An unsampled client trace (`-00`) is not exported; the upstream still
//!   gets a `traceparent` of that trace, unsampled, naming the gateway.
//! - Without `--otlp-endpoint` the client's `traceparent` reaches the
//!   upstream untouched.
//! - SIGTERM exports the spans still queued (a 60 s batch delay).

mod support;

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::{get, post};
use axum::Router;
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::{any_value, AnyValue, KeyValue};
use opentelemetry_proto::tonic::trace::v1::span::SpanKind;
use opentelemetry_proto::tonic::trace::v1::status::StatusCode as Code;
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message;
use support::*;

// ---------------------------------------------------------------- receiver

/// One span as received, with its resource's attributes.
#[derive(Clone, Debug)]
struct GotSpan {
    resource: Vec<KeyValue>,
    span: Span,
}

#[derive(Default)]
struct Received {
    spans: Mutex<Vec<GotSpan>>,
    /// `content-type` of every export request.
    content_types: Mutex<Vec<String>>,
}

/// An OTLP/HTTP receiver: `POST /v1/traces` with a protobuf body.
struct Receiver {
    url: String,
    got: Arc<Received>,
    _task: tokio::task::JoinHandle<()>,
}

impl Receiver {
    async fn start() -> Self {
        let got = Arc::new(Received::default());
        let app = Router::new()
            .route(
                "/v1/traces",
                post(
                    |State(r): State<Arc<Received>>, h: HeaderMap, body: Bytes| async move {
                        let ct = h
                            .get("content-type")
                            .and_then(|v| v.to_str().ok())
                            .unwrap_or("")
                            .to_owned();
                        r.content_types.lock().unwrap().push(ct);
                        let Ok(req) = ExportTraceServiceRequest::decode(body) else {
                            return (StatusCode::BAD_REQUEST, Vec::new());
                        };
                        let mut spans = r.spans.lock().unwrap();
                        for rs in req.resource_spans {
                            let resource = rs.resource.map(|r| r.attributes).unwrap_or_default();
                            for ss in rs.scope_spans {
                                for span in ss.spans {
                                    spans.push(GotSpan {
                                        resource: resource.clone(),
                                        span,
                                    });
                                }
                            }
                        }
                        (
                            StatusCode::OK,
                            ExportTraceServiceResponse::default().encode_to_vec(),
                        )
                    },
                ),
            )
            .with_state(got.clone());
        let (url, task) = serve(app).await;
        Self {
            url,
            got,
            _task: task,
        }
    }

    /// The spans received so far of trace `trace_id` (32 hex).
    fn spans_of(&self, trace_id: &str) -> Vec<GotSpan> {
        self.got
            .spans
            .lock()
            .unwrap()
            .iter()
            .filter(|g| hex(&g.span.trace_id) == trace_id)
            .cloned()
            .collect()
    }

    /// Waits (at most 20 s) until the spans of `trace_id` satisfy `done`.
    async fn wait_for(
        &self,
        trace_id: &str,
        what: &str,
        done: impl Fn(&[GotSpan]) -> bool,
    ) -> Vec<GotSpan> {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let spans = self.spans_of(trace_id);
            if done(&spans) {
                return spans;
            }
            assert!(
                Instant::now() < deadline,
                "no {what} within 20 s; spans of the trace: {:#?}",
                spans.iter().map(|g| summary(&g.span)).collect::<Vec<_>>()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

// ---------------------------------------------------------------- upstream

/// What the upstream saw of one request.
#[derive(Clone, Debug)]
struct Seen {
    path: String,
    traceparent: Option<String>,
    tracestate: Option<String>,
}

/// An upstream that records the trace headers it receives: `POST /pay`
/// answers 201, `GET /thing` 200.
struct TraceUpstream {
    url: String,
    seen: Arc<Mutex<Vec<Seen>>>,
    _task: tokio::task::JoinHandle<()>,
}

impl TraceUpstream {
    async fn start() -> Self {
        let seen: Arc<Mutex<Vec<Seen>>> = Arc::default();
        fn record(seen: &Mutex<Vec<Seen>>, path: &str, h: &HeaderMap) {
            let header = |n: &str| h.get(n).and_then(|v| v.to_str().ok()).map(str::to_owned);
            seen.lock().unwrap().push(Seen {
                path: path.to_owned(),
                traceparent: header("traceparent"),
                tracestate: header("tracestate"),
            });
        }
        let app = Router::new()
            .route(
                "/pay",
                post(
                    |State(s): State<Arc<Mutex<Vec<Seen>>>>, h: HeaderMap| async move {
                        record(&s, "/pay", &h);
                        (
                            StatusCode::CREATED,
                            [("content-type", "application/json")],
                            format!("{{\"payment\":{}}}", rand::random::<u32>()),
                        )
                    },
                ),
            )
            .route(
                "/fail",
                post(
                    |State(s): State<Arc<Mutex<Vec<Seen>>>>, h: HeaderMap| async move {
                        record(&s, "/fail", &h);
                        (StatusCode::INTERNAL_SERVER_ERROR, "boom")
                    },
                ),
            )
            .route(
                "/thing",
                get(
                    |State(s): State<Arc<Mutex<Vec<Seen>>>>, h: HeaderMap| async move {
                        record(&s, "/thing", &h);
                        "thing"
                    },
                ),
            )
            .with_state(seen.clone());
        let (url, task) = serve(app).await;
        Self {
            url,
            seen,
            _task: task,
        }
    }

    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }
}

// ----------------------------------------------------------------- helpers

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn random_hex(bytes: usize) -> String {
    hex(&(0..bytes).map(|_| rand::random::<u8>()).collect::<Vec<_>>())
}

fn value_text(v: &AnyValue) -> String {
    match &v.value {
        Some(any_value::Value::StringValue(s)) => s.clone(),
        Some(any_value::Value::IntValue(i)) => i.to_string(),
        Some(any_value::Value::BoolValue(b)) => b.to_string(),
        Some(any_value::Value::DoubleValue(d)) => d.to_string(),
        other => format!("{other:?}"),
    }
}

/// The attribute `key` of `attrs` as text.
fn attr(attrs: &[KeyValue], key: &str) -> Option<String> {
    attrs
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| kv.value.as_ref())
        .map(value_text)
}

fn summary(s: &Span) -> String {
    let attrs: Vec<String> = s
        .attributes
        .iter()
        .map(|kv| {
            format!(
                "{}={}",
                kv.key,
                kv.value.as_ref().map(value_text).unwrap_or_default()
            )
        })
        .collect();
    format!(
        "{} id={} parent={} kind={} [{}]",
        s.name,
        hex(&s.span_id),
        hex(&s.parent_span_id),
        s.kind,
        attrs.join(", ")
    )
}

/// Every text a span carries: name, attribute keys and values, event
/// names and attributes, status message, and its resource's attributes.
fn all_text(g: &GotSpan) -> Vec<String> {
    let mut out = vec![g.span.name.clone(), g.span.trace_state.clone()];
    let mut kvs: Vec<&KeyValue> = g.span.attributes.iter().collect();
    kvs.extend(g.resource.iter());
    for e in &g.span.events {
        out.push(e.name.clone());
        kvs.extend(e.attributes.iter());
    }
    for l in &g.span.links {
        kvs.extend(l.attributes.iter());
    }
    if let Some(st) = &g.span.status {
        out.push(st.message.clone());
    }
    for kv in kvs {
        out.push(kv.key.clone());
        if let Some(v) = &kv.value {
            out.push(value_text(v));
        }
    }
    out
}

fn named<'a>(spans: &'a [GotSpan], name: &str) -> Vec<&'a Span> {
    spans
        .iter()
        .filter(|g| g.span.name == name)
        .map(|g| &g.span)
        .collect()
}

/// A gateway on `memory://` in front of `upstream`, exporting to
/// `receiver` (if any) with a 100 ms batch delay unless `delay_ms` says
/// otherwise, under `service`.
async fn gateway(
    dir: &Path,
    upstream: &str,
    receiver: Option<&str>,
    service: &str,
    delay_ms: u64,
) -> GatewayProc {
    let mut args = vec!["--upstream", upstream, "--store", "memory://"];
    if let Some(r) = receiver {
        args.extend(["--otlp-endpoint", r]);
    }
    let service = service.to_owned();
    GatewayProc::start_with(dir, "gw", &args, move |cmd| {
        for (name, _) in std::env::vars_os() {
            if name.to_string_lossy().starts_with("OTEL_") {
                cmd.env_remove(name);
            }
        }
        cmd.env("OTEL_SERVICE_NAME", service)
            .env("OTEL_BSP_SCHEDULE_DELAY", delay_ms.to_string());
    })
    .await
}

/// POSTs `/pay` with `key`, `authorization` and trace headers.
async fn pay_traced(
    c: &reqwest::Client,
    gw: &GatewayProc,
    key: &str,
    authorization: &str,
    traceparent: &str,
) -> (u16, bool) {
    let r = c
        .post(gw.url("/pay"))
        .header("idempotency-key", key)
        .header("authorization", authorization)
        .header("content-type", "application/json")
        .header("traceparent", traceparent)
        .header("tracestate", "vendor=opaque")
        .body(r#"{"amount":10}"#)
        .send()
        .await
        .unwrap();
    let replayed = r
        .headers()
        .get("idempotent-replayed")
        .is_some_and(|v| v == "true");
    let status = r.status().as_u16();
    let _ = r.bytes().await;
    (status, replayed)
}

/// The key's hash as the gateway names it (default scope: the
/// `Authorization` field).
fn expected_key_hash(key: &str, authorization: &str) -> String {
    let mut h = http::HeaderMap::new();
    h.insert("authorization", authorization.parse().unwrap());
    let scope = idem_http::ScopeBy::authorization().scope_of(&h);
    idem_core::key_hash(&scope, &idem_core::IdempotencyKey::new(key).unwrap())
}

// ------------------------------------------------------------------- tests

#[tokio::test]
async fn a_guarded_request_continues_the_clients_trace_and_propagates_it() {
    let dir = tempfile::tempdir().unwrap();
    let receiver = Receiver::start().await;
    let upstream = TraceUpstream::start().await;
    let service = unique("idem-otel");
    let gw = gateway(
        dir.path(),
        &upstream.url,
        Some(&receiver.url),
        &service,
        100,
    )
    .await;
    let c = reqwest::Client::new();

    let trace_id = random_hex(16);
    let client_span = random_hex(8);
    let retry_span = random_hex(8);
    let key = unique("otel-raw-key");
    let authorization = format!("Bearer {}", unique("sekrit-token"));

    let (status, replayed) = pay_traced(
        &c,
        &gw,
        &key,
        &authorization,
        &format!("00-{trace_id}-{client_span}-01"),
    )
    .await;
    assert_eq!((status, replayed), (201, false));
    let (status, replayed) = pay_traced(
        &c,
        &gw,
        &key,
        &authorization,
        &format!("00-{trace_id}-{retry_span}-01"),
    )
    .await;
    assert_eq!((status, replayed), (201, true));

    let spans = receiver
        .wait_for(&trace_id, "request, replay and upstream spans", |s| {
            named(s, "idem.request").len() == 2 && !named(s, "idem.upstream").is_empty()
        })
        .await;
    let summaries: Vec<String> = spans.iter().map(|g| summary(&g.span)).collect();
    let requests = named(&spans, "idem.request");
    let executed = requests
        .iter()
        .find(|s| attr(&s.attributes, "idem.outcome").as_deref() == Some("executed"))
        .unwrap_or_else(|| panic!("no executed request span: {summaries:#?}"));
    let replay = requests
        .iter()
        .find(|s| attr(&s.attributes, "idem.outcome").as_deref() == Some("replayed"))
        .unwrap_or_else(|| panic!("no replayed request span: {summaries:#?}"));

    // The request spans continue the client's spans.
    assert_eq!(hex(&executed.parent_span_id), client_span, "{summaries:#?}");
    assert_eq!(hex(&replay.parent_span_id), retry_span, "{summaries:#?}");
    let hash = expected_key_hash(&key, &authorization);
    assert_eq!(hash.len(), 16);
    for (span, outcome) in [(executed, "executed"), (replay, "replayed")] {
        assert_eq!(span.kind, SpanKind::Server as i32, "{}", summary(span));
        let a = &span.attributes;
        assert_eq!(attr(a, "idem.outcome").as_deref(), Some(outcome));
        assert_eq!(attr(a, "http.response.status_code").as_deref(), Some("201"));
        assert_eq!(attr(a, "idem.key_hash").as_deref(), Some(hash.as_str()));
        assert_eq!(attr(a, "http.request.method").as_deref(), Some("POST"));
        assert_eq!(attr(a, "url.path").as_deref(), Some("/pay"));
        assert_eq!(span.trace_state, "vendor=opaque");
    }
    let g = &spans[0];
    assert_eq!(attr(&g.resource, "service.name"), Some(service.clone()));

    // Children of the executed request: its store steps and the upstream
    // call (none for the replay but its own store read).
    let upstream_spans = named(&spans, "idem.upstream");
    assert_eq!(upstream_spans.len(), 1, "{summaries:#?}");
    let up = upstream_spans[0];
    assert_eq!(hex(&up.parent_span_id), hex(&executed.span_id));
    assert_eq!(up.kind, SpanKind::Client as i32);
    assert_eq!(
        attr(&up.attributes, "http.response.status_code").as_deref(),
        Some("201")
    );
    let ops_under = |parent: &Span| -> Vec<String> {
        named(&spans, "idem.store")
            .into_iter()
            .filter(|s| s.parent_span_id == parent.span_id)
            .filter_map(|s| attr(&s.attributes, "op"))
            .collect()
    };
    let ops = ops_under(executed);
    for op in ["begin", "complete"] {
        assert!(
            ops.iter().any(|o| o == op),
            "no store {op} under the request: {summaries:#?}"
        );
    }
    assert!(
        ops_under(replay).iter().any(|o| o == "begin"),
        "no store begin under the replay: {summaries:#?}"
    );

    // The upstream continues from the gateway's client span.
    let seen = upstream.seen();
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert_eq!(
        seen[0].traceparent.as_deref(),
        Some(format!("00-{trace_id}-{}-01", hex(&up.span_id)).as_str()),
        "{seen:?}"
    );
    assert_eq!(seen[0].tracestate.as_deref(), Some("vendor=opaque"));

    // Never the raw key, nor the credentials, anywhere in what was sent.
    let secret = authorization.trim_start_matches("Bearer ");
    for g in receiver.got.spans.lock().unwrap().iter() {
        for text in all_text(g) {
            assert!(
                !text.contains(&key) && !text.contains(secret),
                "a span carries the raw key or the credentials: {text:?} in {}",
                summary(&g.span)
            );
        }
    }
    for ct in receiver.got.content_types.lock().unwrap().iter() {
        assert_eq!(ct, "application/x-protobuf");
    }
}

#[tokio::test]
async fn an_unguarded_request_is_continued_and_propagated_too() {
    let dir = tempfile::tempdir().unwrap();
    let receiver = Receiver::start().await;
    let upstream = TraceUpstream::start().await;
    let gw = gateway(
        dir.path(),
        &upstream.url,
        Some(&receiver.url),
        "idem-gateway",
        100,
    )
    .await;
    let trace_id = random_hex(16);
    let client_span = random_hex(8);
    let r = reqwest::Client::new()
        .get(gw.url("/thing?q=private"))
        .header("traceparent", format!("00-{trace_id}-{client_span}-01"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);

    let spans = receiver
        .wait_for(&trace_id, "proxy and upstream spans", |s| {
            !named(s, "idem.proxy").is_empty() && !named(s, "idem.upstream").is_empty()
        })
        .await;
    let proxy = named(&spans, "idem.proxy")[0];
    let up = named(&spans, "idem.upstream")[0];
    assert_eq!(hex(&proxy.parent_span_id), client_span);
    assert_eq!(proxy.kind, SpanKind::Server as i32);
    assert_eq!(
        attr(&proxy.attributes, "url.path").as_deref(),
        Some("/thing")
    );
    assert_eq!(
        attr(&proxy.attributes, "http.response.status_code").as_deref(),
        Some("200")
    );
    assert_eq!(hex(&up.parent_span_id), hex(&proxy.span_id));
    assert!(named(&spans, "idem.request").is_empty());
    for g in &spans {
        for text in all_text(g) {
            assert!(
                !text.contains("private"),
                "the query reached a span: {text:?}"
            );
        }
    }
    let seen = upstream.seen();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].path, "/thing");
    assert_eq!(
        seen[0].traceparent.as_deref(),
        Some(format!("00-{trace_id}-{}-01", hex(&up.span_id)).as_str())
    );
    assert_eq!(
        attr(&spans[0].resource, "service.name").as_deref(),
        Some("idem-gateway")
    );
}

#[tokio::test]
async fn an_unsampled_trace_is_not_exported_but_still_handed_on() {
    let dir = tempfile::tempdir().unwrap();
    let receiver = Receiver::start().await;
    let upstream = TraceUpstream::start().await;
    let gw = gateway(
        dir.path(),
        &upstream.url,
        Some(&receiver.url),
        "idem-gateway",
        100,
    )
    .await;
    let c = reqwest::Client::new();
    let unsampled = random_hex(16);
    let client_span = random_hex(8);
    let sampled = random_hex(16);
    for traceparent in [
        format!("00-{unsampled}-{client_span}-00"),
        format!("00-{sampled}-{}-01", random_hex(8)),
    ] {
        let r = c
            .get(gw.url("/thing"))
            .header("traceparent", traceparent)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
    }
    // The sampled trace arriving means the batch holding both was sent.
    receiver
        .wait_for(&sampled, "the sampled trace", |s| {
            !named(s, "idem.upstream").is_empty()
        })
        .await;
    assert!(receiver.spans_of(&unsampled).is_empty());
    let seen = upstream.seen();
    let tp = seen[0].traceparent.clone().unwrap();
    let parts: Vec<&str> = tp.split('-').collect();
    assert_eq!(parts.len(), 4, "{tp}");
    assert_eq!(
        (parts[0], parts[1], parts[3]),
        ("00", unsampled.as_str(), "00"),
        "{tp}"
    );
    assert_ne!(
        parts[2], client_span,
        "the gateway names itself as the parent: {tp}"
    );
}

#[tokio::test]
async fn a_5xx_marks_the_request_and_upstream_spans_as_failed() {
    let dir = tempfile::tempdir().unwrap();
    let receiver = Receiver::start().await;
    let upstream = TraceUpstream::start().await;
    let gw = gateway(
        dir.path(),
        &upstream.url,
        Some(&receiver.url),
        "idem-gateway",
        100,
    )
    .await;
    let trace_id = random_hex(16);
    let r = reqwest::Client::new()
        .post(gw.url("/fail"))
        .header("idempotency-key", unique("k"))
        .header("traceparent", format!("00-{trace_id}-{}-01", random_hex(8)))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 500);
    let spans = receiver
        .wait_for(&trace_id, "request and upstream spans", |s| {
            !named(s, "idem.request").is_empty() && !named(s, "idem.upstream").is_empty()
        })
        .await;
    let req = named(&spans, "idem.request")[0];
    let up = named(&spans, "idem.upstream")[0];
    // The 5xx is not kept: the key is released.
    assert_eq!(
        attr(&req.attributes, "idem.outcome").as_deref(),
        Some("released")
    );
    assert_eq!(
        attr(&req.attributes, "http.response.status_code").as_deref(),
        Some("500")
    );
    assert_eq!(
        attr(&up.attributes, "error.type").as_deref(),
        Some("http-status")
    );
    for s in [req, up] {
        let code = s.status.as_ref().map(|st| st.code);
        assert_eq!(code, Some(Code::Error as i32), "{}", summary(s));
    }
}

#[tokio::test]
async fn without_an_endpoint_the_clients_traceparent_passes_untouched() {
    let dir = tempfile::tempdir().unwrap();
    let upstream = TraceUpstream::start().await;
    let gw = gateway(dir.path(), &upstream.url, None, "unused", 100).await;
    let c = reqwest::Client::new();
    let traceparent = format!("00-{}-{}-01", random_hex(16), random_hex(8));
    let (status, _) = pay_traced(&c, &gw, &unique("k"), "Bearer x", &traceparent).await;
    assert_eq!(status, 201);
    let r = c
        .get(gw.url("/thing"))
        .header("traceparent", &traceparent)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let seen = upstream.seen();
    assert_eq!(seen.len(), 2);
    for s in &seen {
        assert_eq!(
            s.traceparent.as_deref(),
            Some(traceparent.as_str()),
            "{s:?}"
        );
    }
    assert_eq!(seen[0].tracestate.as_deref(), Some("vendor=opaque"));
}

#[tokio::test]
async fn sigterm_exports_the_queued_spans() {
    let dir = tempfile::tempdir().unwrap();
    let receiver = Receiver::start().await;
    let upstream = TraceUpstream::start().await;
    // A batch delay far longer than the test: only the shutdown flush
    // can deliver the spans in time.
    let mut gw = gateway(
        dir.path(),
        &upstream.url,
        Some(&receiver.url),
        "idem-gateway",
        600_000,
    )
    .await;
    let trace_id = random_hex(16);
    let (status, _) = pay_traced(
        &reqwest::Client::new(),
        &gw,
        &unique("k"),
        "Bearer y",
        &format!("00-{trace_id}-{}-01", random_hex(8)),
    )
    .await;
    assert_eq!(status, 201);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        receiver.spans_of(&trace_id).is_empty(),
        "exported before the delay"
    );
    gw.signal("-TERM");
    let exit = gw.wait_exit(Duration::from_secs(30)).await;
    assert!(exit.success(), "{exit}:\n{}", gw.logs());
    receiver
        .wait_for(&trace_id, "spans flushed at shutdown", |s| {
            named(s, "idem.request").len() == 1 && named(s, "idem.upstream").len() == 1
        })
        .await;
}
