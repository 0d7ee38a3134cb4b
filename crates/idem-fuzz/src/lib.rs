//! # idem-fuzz
//!
//! The bodies of idem's coverage-guided fuzz targets. Each `pub fn` takes
//! the fuzzer's bytes, runs one parser or decoder on them and asserts its
//! properties (no panic, round trips, idempotence); a failed assertion is
//! a crash the fuzzer reports. The thin targets in `fuzz/fuzz_targets/`
//! call these functions, and `tests/corpus.rs` replays every file of
//! `fuzz/corpus/<target>/` through them, so `cargo test` checks the corpus
//! without a fuzzer. [`TARGETS`] lists them by name.

use std::time::Duration;

use http::{HeaderMap, HeaderName, HeaderValue, Method, Uri};
use idem_core::url::{redact, StoreUrl};
use idem_core::{IdempotencyKey, KeyError, Scope, StoredResponse, MAX_KEY_LEN};
use idem_http::fingerprint::{canonical_json, is_json_media_type, request_fingerprint};
use idem_http::key::parse_key;
use idem_http::ScopeBy;

/// A target's body: takes the fuzzer's bytes, panics on a broken property.
pub type Body = fn(&[u8]);

/// Every target: its name (the folder of its corpus) and its body.
pub const TARGETS: &[(&str, Body)] = &[
    ("key", key),
    ("core_key", core_key),
    ("scope", scope),
    ("json", json),
    ("fingerprint", fingerprint),
    ("duration", duration),
    ("size", size),
    ("upstream", upstream),
    ("store_url", store_url),
    ("response", response),
    ("path", path),
];

/// The bytes as text (lossy), for parsers that take `&str`.
fn text(data: &[u8]) -> String {
    String::from_utf8_lossy(data).into_owned()
}

/// `Idempotency-Key` field values ([`parse_key`]): never a panic; an
/// accepted key is a valid [`IdempotencyKey`], and it parses back to
/// itself when written as an RFC 8941 sf-string (`"…"`, with `\"` and
/// `\\`) and, when it has no surrounding blanks and no leading `"`, bare.
pub fn key(data: &[u8]) {
    let Ok(k) = parse_key(data) else {
        let _ = parse_key(data).map_err(|e| e.to_string());
        return;
    };
    let s = k.as_str();
    assert_eq!(IdempotencyKey::new(s).as_ref(), Ok(&k));
    let mut quoted = String::from("\"");
    for c in s.chars() {
        if c == '"' || c == '\\' {
            quoted.push('\\');
        }
        quoted.push(c);
    }
    quoted.push('"');
    assert_eq!(parse_key(quoted.as_bytes()).as_ref(), Ok(&k), "{quoted}");
    if !s.starts_with(['"', ' ']) && !s.ends_with(' ') {
        assert_eq!(parse_key(s.as_bytes()).as_ref(), Ok(&k), "{s}");
    }
}

/// [`IdempotencyKey::new`] and [`Scope::new`] against their documented
/// rule: a key is 1–255 characters of 0x20–0x7E, not all blank; a scope is
/// at most 255 bytes.
pub fn core_key(data: &[u8]) {
    let s = text(data);
    let valid = !s.is_empty()
        && s.len() <= MAX_KEY_LEN
        && s.chars().all(|c| (' '..='~').contains(&c))
        && s.chars().any(|c| c != ' ');
    match IdempotencyKey::new(s.as_str()) {
        Ok(k) => {
            assert!(valid, "{s:?} accepted");
            assert_eq!(k.as_str(), s);
            assert_eq!(k.to_string(), s);
            assert_eq!(s.parse::<IdempotencyKey>().as_ref(), Ok(&k));
        }
        Err(e) => {
            assert!(!valid, "{s:?} refused: {e}");
            if let KeyError::InvalidChar { at, ch } = e {
                assert_eq!(s[at..].chars().next(), Some(ch), "{s:?}");
            }
        }
    }
    assert_eq!(Scope::new(s.as_str()).is_ok(), s.len() <= MAX_KEY_LEN);
}

/// Splits `data` into header fields: `name NUL value NUL …`.
fn headers_of(data: &[u8]) -> (Vec<(HeaderName, HeaderValue)>, HeaderMap) {
    let mut fields = Vec::new();
    let mut parts = data.split(|&b| b == 0);
    while let (Some(n), Some(v)) = (parts.next(), parts.next()) {
        if let (Ok(n), Ok(v)) = (HeaderName::from_bytes(n), HeaderValue::from_bytes(v)) {
            fields.push((n, v));
        }
    }
    let mut map = HeaderMap::new();
    for (n, v) in &fields {
        map.append(n.clone(), v.clone());
    }
    (fields, map)
}

/// [`ScopeBy::scope_of`] over fuzzed header fields: the default scope is
/// anonymous without `Authorization` and otherwise exactly
/// [`Scope::hashed`] over (name, value) of its fields in order; it is
/// deterministic and ignores other fields.
pub fn scope(data: &[u8]) {
    let (fields, map) = headers_of(data);
    let by = ScopeBy::default();
    let s = by.scope_of(&map);
    assert_eq!(s, by.scope_of(&map));
    let auth: Vec<&[u8]> = fields
        .iter()
        .filter(|(n, _)| n == http::header::AUTHORIZATION)
        .flat_map(|(n, v)| [n.as_str().as_bytes(), v.as_bytes()])
        .collect();
    if auth.is_empty() {
        assert_eq!(s, Scope::anonymous());
    } else {
        assert_eq!(s, Scope::hashed(auth));
        assert_eq!(s.as_str().len(), 64);
    }
    let names: Vec<HeaderName> = fields.iter().map(|(n, _)| n.clone()).collect();
    let all = ScopeBy::Headers(names).scope_of(&map);
    assert!(Scope::new(all.as_str()).is_ok());
}

/// RFC 8785 canonicalisation ([`canonical_json`]): never a panic; a
/// canonical form is valid JSON, canonicalising it gives it back, and a
/// JSON request fingerprints the same with either body.
pub fn json(data: &[u8]) {
    let Some(c) = canonical_json(data) else {
        return;
    };
    assert!(serde_json::from_slice::<serde_json::Value>(&c).is_ok());
    assert_eq!(
        canonical_json(&c).as_deref(),
        Some(c.as_slice()),
        "not idempotent: {:?}",
        String::from_utf8_lossy(&c)
    );
    let mut h = HeaderMap::new();
    h.insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    let uri = Uri::from_static("/orders");
    assert_eq!(
        request_fingerprint(&Method::POST, &uri, &h, data),
        request_fingerprint(&Method::POST, &uri, &h, &c)
    );
}

/// [`request_fingerprint`] over a fuzzed request (`method NUL target NUL
/// content-type NUL body`): never a panic, deterministic, and
/// [`is_json_media_type`] never panics.
pub fn fingerprint(data: &[u8]) {
    let mut parts = data.splitn(4, |&b| b == 0);
    let method = parts.next().and_then(|m| Method::from_bytes(m).ok());
    let uri = parts.next().and_then(|u| Uri::try_from(u).ok());
    let ct = parts.next().unwrap_or_default();
    let body = parts.next().unwrap_or_default();
    let _ = is_json_media_type(ct);
    let mut h = HeaderMap::new();
    if let Ok(v) = HeaderValue::from_bytes(ct) {
        h.insert(http::header::CONTENT_TYPE, v);
    }
    let method = method.unwrap_or(Method::POST);
    let uri = uri.unwrap_or_else(|| Uri::from_static("/"));
    let a = request_fingerprint(&method, &uri, &h, body);
    assert_eq!(a, request_fingerprint(&method, &uri, &h, body));
}

/// [`idem_gateway::parse_duration`]: never a panic; a parsed duration
/// printed by humantime parses back to the same value, and one of whole
/// milliseconds printed by [`idem_gateway::show_duration`] too.
pub fn duration(data: &[u8]) {
    let s = text(data);
    let Ok(d) = idem_gateway::parse_duration(&s) else {
        return;
    };
    let shown = humantime::format_duration(d).to_string();
    assert_eq!(idem_gateway::parse_duration(&shown), Ok(d), "{shown}");
    if d.subsec_nanos() % 1_000_000 == 0 && d <= Duration::from_secs(u64::MAX / 1000) {
        let shown = idem_gateway::show_duration(d);
        assert_eq!(idem_gateway::parse_duration(&shown), Ok(d), "{shown}");
    }
}

/// [`idem_gateway::parse_size`]: never a panic; a parsed size printed by
/// [`idem_gateway::show_size`] parses back to the same value.
pub fn size(data: &[u8]) {
    let s = text(data);
    if let Ok(n) = idem_gateway::parse_size(&s) {
        let shown = idem_gateway::show_size(n);
        assert_eq!(idem_gateway::parse_size(&shown), Ok(n), "{shown}");
    }
}

/// [`idem_gateway::parse_upstream`]: never a panic; an accepted URL is
/// `http`, has a host, no user info and no query, and its printed form is
/// accepted as the same URL.
pub fn upstream(data: &[u8]) {
    let s = text(data);
    let Ok(u) = idem_gateway::parse_upstream(&s) else {
        return;
    };
    assert_eq!(u.scheme_str(), Some("http"));
    assert!(u.query().is_none());
    let auth = u.authority().expect("an authority");
    assert!(!auth.host().is_empty() && !auth.as_str().contains('@'));
    let again = idem_gateway::parse_upstream(&u.to_string()).expect("printed form accepted");
    assert_eq!(again, u);
}

/// Store URLs ([`StoreUrl`], [`redact`], and the Redis, SQLite,
/// PostgreSQL and MySQL readers): never a panic; redaction is idempotent
/// and keeps a URL without user info as it is; a driver URL that a reader
/// accepted is accepted again as itself.
pub fn store_url(data: &[u8]) {
    let s = text(data);
    let r = redact(&s);
    assert_eq!(redact(&r), r);
    if !s.contains('@') {
        assert_eq!(r, s);
    }
    if let Ok(u) = StoreUrl::parse(&s) {
        let _ = u.options("fuzz", &[]);
    }
    if let Ok(u) = idem_redis::RedisUrl::parse(&s) {
        let again = idem_redis::RedisUrl::parse(u.url.expose()).expect("driver URL accepted");
        assert_eq!(again.url, u.url);
        assert_eq!(again.cluster, u.cluster);
    }
    if let Ok(u) = idem_sql::url::SqliteUrl::parse(&s) {
        let again = idem_sql::url::SqliteUrl::parse(u.url.expose()).expect("driver URL accepted");
        assert_eq!(again, u);
    }
    if let Ok(o) = idem_sql::PostgresOptions::from_url(&s) {
        let again = idem_sql::PostgresOptions::from_url(&o.url).expect("driver URL accepted");
        assert_eq!(again.url, o.url);
    }
    if let Ok(o) = idem_sql::MySqlOptions::from_url(&s) {
        let again = idem_sql::MySqlOptions::from_url(&o.url).expect("driver URL accepted");
        assert_eq!(again.url, o.url);
    }
}

/// The stored-response format every store keeps ([`StoredResponse::decode`]):
/// never a panic; a decoded response re-encodes to the same bytes (the
/// `body_omitted` byte normalised to 0 or 1) and decodes again equal, and
/// [`idem_http::replay::replay_response`] answers it without a panic.
pub fn response(data: &[u8]) {
    let Ok(r) = StoredResponse::decode(data) else {
        return;
    };
    let bytes = r.encode();
    let mut expected = data.to_vec();
    expected[1] = u8::from(expected[1] != 0);
    assert_eq!(bytes, expected);
    assert_eq!(StoredResponse::decode(&bytes).as_ref(), Ok(&r));
    // A replay of any decodable record is an answer, never a panic (a
    // status outside 100-999 becomes a 500 problem).
    let _ = idem_http::replay::replay_response(&r);
}

/// [`idem_http::path::normalize_path`]: never a panic; a normalised path
/// starts with `/`, holds no `//`, `/./` or `/../`, does not end in `/.`
/// or `/..`, and normalising it again gives it back unchanged (borrowed).
pub fn path(data: &[u8]) {
    let s = text(data);
    let Ok(n) = idem_http::path::normalize_path(&s) else {
        return;
    };
    assert!(n.starts_with('/'), "{n}");
    for bad in ["//", "/./", "/../"] {
        assert!(!n.contains(bad), "{s:?} -> {n:?}");
    }
    assert!(!n.ends_with("/.") && !n.ends_with("/.."), "{s:?} -> {n:?}");
    let again = idem_http::path::normalize_path(&n).expect("a normalised path is accepted");
    assert!(
        matches!(again, std::borrow::Cow::Borrowed(_)),
        "{n:?} changed"
    );
    assert_eq!(again, n);
}
