//! Request fingerprinting throughput (bytes/s) for a raw body and a JSON body
//! that is canonicalised first (RFC 8785), at 1 KiB and 64 KiB, through
//! `request_fingerprint`, through `request_fingerprint_with` and the default
//! spec (the hot path: it must cost the same), and with a spec that leaves a
//! JSON member out (RFC 6901); and key parsing (`Idempotency-Key` header
//! value → key, `IdempotencyKey::new`, and a key from a JSON body).
//!
//! `cargo bench -p idem-http --bench fingerprint`

// `criterion_group!` defines an undocumented `pub fn`.
#![allow(missing_docs)]

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use http::{HeaderMap, HeaderValue, Method, Uri};
use idem_core::IdempotencyKey;
use idem_http::body_key::key_from_json;
use idem_http::fingerprint::{
    canonical_json, request_fingerprint, request_fingerprint_with, FingerprintSpec,
};
use idem_http::key::{key_from_headers, parse_key};

/// A JSON order document of about `size` bytes: an object with an array of
/// line items (strings, integers, decimals, booleans), whitespace and
/// member order as a client might send them.
fn json_body(size: usize) -> Vec<u8> {
    let mut s = String::from("{ \"customer\": \"c-000123\", \"currency\": \"EUR\", \"items\": [");
    let mut i = 0;
    while s.len() + 90 < size {
        if i > 0 {
            s.push_str(", ");
        }
        s.push_str(&format!(
            "{{\"sku\": \"SKU-{i:06}\", \"qty\": {}, \"price\": {}.{:02}, \"gift\": {}}}",
            i % 7 + 1,
            i * 13 % 1000,
            i % 100,
            i % 2 == 0
        ));
        i += 1;
    }
    s.push_str("], \"note\": \"");
    while s.len() + 3 < size {
        s.push('x');
    }
    s.push_str("\" }");
    s.into_bytes()
}

fn fingerprints(c: &mut Criterion) {
    let uri: Uri = "/orders?region=eu".parse().expect("uri");
    let mut json = HeaderMap::new();
    json.insert("content-type", HeaderValue::from_static("application/json"));
    let mut raw = HeaderMap::new();
    raw.insert(
        "content-type",
        HeaderValue::from_static("application/octet-stream"),
    );
    let default_spec = FingerprintSpec {
        route: "orders".into(),
        ..FingerprintSpec::default()
    };
    let exclude = FingerprintSpec {
        exclude: vec!["/note".into(), "/items/0/gift".into()],
        ignore_query: vec!["utm_source".into()],
        ..FingerprintSpec::default()
    };
    let mut g = c.benchmark_group("fingerprint");
    // A small order, as most proxied requests carry.
    let small: &[u8] = br#"{"item":"book","qty":1,"price":12.5,"gift":true}"#;
    assert!(canonical_json(small).is_some(), "the small body is I-JSON");
    g.throughput(Throughput::Bytes(small.len() as u64));
    g.bench_with_input(BenchmarkId::new("json", small.len()), small, |b, body| {
        b.iter(|| request_fingerprint(&Method::POST, &uri, &json, black_box(body)))
    });
    g.bench_with_input(
        BenchmarkId::new("canonical_json", small.len()),
        small,
        |b, body| b.iter(|| canonical_json(black_box(body))),
    );
    for size in [1024usize, 64 * 1024] {
        let body = json_body(size);
        assert!(canonical_json(&body).is_some(), "the JSON body is I-JSON");
        g.throughput(Throughput::Bytes(body.len() as u64));
        g.bench_with_input(BenchmarkId::new("raw", size), &body, |b, body| {
            b.iter(|| request_fingerprint(&Method::POST, &uri, &raw, black_box(body)))
        });
        g.bench_with_input(BenchmarkId::new("json", size), &body, |b, body| {
            b.iter(|| request_fingerprint(&Method::POST, &uri, &json, black_box(body)))
        });
        g.bench_with_input(
            BenchmarkId::new("json default spec", size),
            &body,
            |b, body| {
                b.iter(|| {
                    request_fingerprint_with(
                        &default_spec,
                        &Method::POST,
                        &uri,
                        &json,
                        black_box(body),
                    )
                })
            },
        );
        g.bench_with_input(BenchmarkId::new("json exclude", size), &body, |b, body| {
            b.iter(|| {
                request_fingerprint_with(&exclude, &Method::POST, &uri, &json, black_box(body))
            })
        });
    }
    g.finish();
}

fn keys(c: &mut Criterion) {
    let uuid = "8e0c6a7e-1b2c-4d5e-9f00-123456789abc";
    let quoted = format!("\"{uuid}\"");
    let mut headers = HeaderMap::new();
    headers.insert(
        "idempotency-key",
        HeaderValue::from_str(&quoted).expect("value"),
    );
    let mut g = c.benchmark_group("key");
    g.bench_function("core IdempotencyKey::new (uuid)", |b| {
        b.iter(|| IdempotencyKey::new(black_box(uuid)).expect("valid"))
    });
    g.bench_function("http parse_key (quoted uuid)", |b| {
        b.iter(|| parse_key(black_box(quoted.as_bytes())).expect("valid"))
    });
    g.bench_function("http key_from_headers (quoted uuid)", |b| {
        b.iter(|| key_from_headers(black_box(&headers)).expect("valid"))
    });
    // The order document, its final ` }` replaced by one more member.
    let mut webhook = json_body(1024);
    webhook.truncate(webhook.len() - 2);
    webhook.extend_from_slice(br#", "event_id": "evt_8e0c6a7e1b2c" }"#);
    assert!(
        matches!(key_from_json(&webhook, "/event_id"), Ok(Some(_))),
        "the webhook body has its key"
    );
    g.bench_function("body key_from_json (1 KiB)", |b| {
        b.iter(|| key_from_json(black_box(&webhook), "/event_id").expect("valid"))
    });
    g.finish();
}

criterion_group!(benches, fingerprints, keys);
criterion_main!(benches);
