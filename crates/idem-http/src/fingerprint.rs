//! Request fingerprints: what makes two requests with one key "the same".
//!
//! The fingerprint is a SHA-256 ([`FingerprintBuilder`], every part
//! length-prefixed) over, in this order: a format tag, the method, the
//! path, the query (absent and empty differ), every `Content-Type` field
//! value as received, and the body.
//!
//! A body whose (single) `Content-Type` is `application/json` or any
//! `*/*+json` type (parameters such as `charset` are ignored for this check,
//! case-insensitive) is first canonicalised with the JSON Canonicalization
//! Scheme (RFC 8785), so key order and insignificant whitespace do not
//! matter, while array order does. Numbers compare by their IEEE 754 double
//! value as RFC 8785 says (`1.0`, `1` and `1e0` are the same). A body that
//! is not I-JSON (RFC 7493) is hashed as raw bytes, without an error:
//! malformed JSON, a lone surrogate, an object with a duplicate member name,
//! nesting deeper than 128, or a number of magnitude 2^53 or more (where
//! doubles no longer hold every integer, so two different large amounts
//! could otherwise share a fingerprint). Other bodies are hashed as raw
//! bytes.

use std::fmt;

use http::{header, HeaderMap, Method, Uri};
use idem_core::{Fingerprint, FingerprintBuilder};
use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Number, Value};

/// Tag of the fingerprint format, hashed first so a change of format never
/// collides with an older one.
const FORMAT: &[u8] = b"idem-http/fingerprint/1";

/// The fingerprint of a request (see the [module docs](self)).
///
/// ```
/// use http::{HeaderMap, Method, Uri};
/// use idem_http::fingerprint::request_fingerprint;
/// let mut h = HeaderMap::new();
/// h.insert("content-type", "application/json".parse().unwrap());
/// let uri: Uri = "/orders?x=1".parse().unwrap();
/// let a = request_fingerprint(&Method::POST, &uri, &h, br#"{"a":1,"b":[1,2]}"#);
/// let b = request_fingerprint(&Method::POST, &uri, &h, br#"{ "b": [1, 2], "a": 1.0 }"#);
/// let c = request_fingerprint(&Method::POST, &uri, &h, br#"{"a":1,"b":[2,1]}"#);
/// assert_eq!(a, b);
/// assert_ne!(a, c);
/// ```
pub fn request_fingerprint(
    method: &Method,
    uri: &Uri,
    headers: &HeaderMap,
    body: &[u8],
) -> Fingerprint {
    let mut b = FingerprintBuilder::new();
    b.part(FORMAT);
    b.part(method.as_str().as_bytes());
    b.part(uri.path().as_bytes());
    match uri.query() {
        None => b.part(b"-"),
        Some(q) => b.part(b"?").part(q.as_bytes()),
    };
    let content_types: Vec<&[u8]> = headers
        .get_all(header::CONTENT_TYPE)
        .iter()
        .map(|v| v.as_bytes())
        .collect();
    b.part(&(content_types.len() as u64).to_be_bytes());
    for ct in &content_types {
        b.part(ct);
    }
    let canonical = match content_types.as_slice() {
        [ct] if is_json_media_type(ct) => canonical_json(body),
        _ => None,
    };
    match canonical {
        Some(c) => b.part(b"jcs").part(&c),
        None => b.part(b"raw").part(body),
    };
    b.finish()
}

/// Whether a `Content-Type` value names JSON: `application/json` or a type
/// with the `+json` structured syntax suffix (RFC 6839), ignoring case,
/// parameters and surrounding whitespace.
///
/// ```
/// use idem_http::fingerprint::is_json_media_type;
/// assert!(is_json_media_type(b"application/json; charset=utf-8"));
/// assert!(is_json_media_type(b"Application/Problem+JSON"));
/// assert!(!is_json_media_type(b"text/plain"));
/// assert!(!is_json_media_type(b"application/jsonx"));
/// ```
pub fn is_json_media_type(content_type: &[u8]) -> bool {
    let Ok(s) = std::str::from_utf8(content_type) else {
        return false;
    };
    let essence = s
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    let Some((ty, subtype)) = essence.split_once('/') else {
        return false;
    };
    let token = |t: &str| !t.is_empty() && t.bytes().all(|c| c.is_ascii_graphic() && c != b'/');
    if !token(ty) || !token(subtype) {
        return false;
    }
    (ty == "application" && subtype == "json")
        || (subtype.len() > "+json".len() && subtype.ends_with("+json"))
}

/// The RFC 8785 canonical form of a JSON text, or `None` when it is not
/// I-JSON (malformed, duplicate member names, a lone surrogate, a number of
/// magnitude 2^53 or more, nested deeper than 128).
///
/// ```
/// use idem_http::fingerprint::canonical_json;
/// assert_eq!(canonical_json(br#"{ "b": 1.0, "a": [true, null] }"#).unwrap(), br#"{"a":[true,null],"b":1}"#);
/// assert_eq!(canonical_json(br#"{"a":1,"a":2}"#), None);
/// assert_eq!(canonical_json(b"{"), None);
/// ```
pub fn canonical_json(body: &[u8]) -> Option<Vec<u8>> {
    let Strict(value) = serde_json::from_slice(body).ok()?;
    serde_json_canonicalizer::to_vec(&value).ok()
}

/// A JSON value that refuses what RFC 7493 (I-JSON) excludes and RFC 8785
/// relies on: duplicate member names (two parsers may read two different
/// requests) and numbers that a double cannot hold exactly.
struct Strict(Value);

/// 2^53: from here on, doubles skip integers.
const EXACT_LIMIT: u64 = 1 << 53;

fn inexact<E: de::Error>() -> E {
    E::custom("number of magnitude 2^53 or more")
}

impl<'de> Deserialize<'de> for Strict {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(StrictVisitor)
    }
}

struct StrictVisitor;

impl<'de> Visitor<'de> for StrictVisitor {
    type Value = Strict;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E>(self, v: bool) -> Result<Strict, E> {
        Ok(Strict(Value::Bool(v)))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Strict, E> {
        if v.unsigned_abs() >= EXACT_LIMIT {
            return Err(inexact());
        }
        Ok(Strict(Value::Number(v.into())))
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Strict, E> {
        if v >= EXACT_LIMIT {
            return Err(inexact());
        }
        Ok(Strict(Value::Number(v.into())))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Strict, E> {
        if v.abs() >= EXACT_LIMIT as f64 {
            return Err(inexact());
        }
        Number::from_f64(v)
            .map(|n| Strict(Value::Number(n)))
            .ok_or_else(|| E::custom("number out of range"))
    }

    fn visit_str<E>(self, v: &str) -> Result<Strict, E> {
        Ok(Strict(Value::String(v.to_owned())))
    }

    fn visit_string<E>(self, v: String) -> Result<Strict, E> {
        Ok(Strict(Value::String(v)))
    }

    fn visit_unit<E>(self) -> Result<Strict, E> {
        Ok(Strict(Value::Null))
    }

    fn visit_none<E>(self) -> Result<Strict, E> {
        Ok(Strict(Value::Null))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Strict, A::Error> {
        let mut out = Vec::new();
        while let Some(Strict(v)) = seq.next_element()? {
            out.push(v);
        }
        Ok(Strict(Value::Array(out)))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Strict, A::Error> {
        let mut out = Map::new();
        while let Some(k) = map.next_key::<String>()? {
            if out.contains_key(&k) {
                return Err(de::Error::custom("duplicate member name"));
            }
            let Strict(v) = map.next_value()?;
            out.insert(k, v);
        }
        Ok(Strict(Value::Object(out)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;
    use proptest::prelude::*;

    fn json_headers(ct: &'static str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(header::CONTENT_TYPE, HeaderValue::from_static(ct));
        h
    }

    fn fp(ct: Option<&'static str>, body: &[u8]) -> Fingerprint {
        let h = ct.map(json_headers).unwrap_or_default();
        request_fingerprint(&Method::POST, &"/orders".parse().unwrap(), &h, body)
    }

    fn json(body: &str) -> Fingerprint {
        fp(Some("application/json"), body.as_bytes())
    }

    #[test]
    fn key_order_and_whitespace_do_not_matter() {
        assert_eq!(json(r#"{"a":1,"b":2}"#), json(r#"{"b":2,"a":1}"#));
        assert_eq!(
            json(r#"{"a":1,"b":2}"#),
            json(" {\n\t\"a\" : 1 ,\r\n \"b\":2 }\n")
        );
        assert_eq!(
            json(r#"{"x":{"b":[{"d":1,"c":2}],"a":null}}"#),
            json(r#"{"x":{"a":null,"b":[{"c":2,"d":1}]}}"#)
        );
    }

    #[test]
    fn array_order_and_values_matter() {
        assert_ne!(json("[1,2]"), json("[2,1]"));
        assert_ne!(json(r#"{"a":1}"#), json(r#"{"a":2}"#));
        assert_ne!(json(r#"{"a":"1"}"#), json(r#"{"a":1}"#));
        assert_ne!(json(r#"{"a":1}"#), json(r#"{"A":1}"#));
    }

    #[test]
    fn numbers_follow_rfc_8785() {
        assert_eq!(json(r#"{"n":1}"#), json(r#"{"n":1.0}"#));
        assert_eq!(json(r#"{"n":1}"#), json(r#"{"n":1e0}"#));
        assert_eq!(json(r#"{"n":100}"#), json(r#"{"n":1E2}"#));
        assert_eq!(json(r#"{"n":0}"#), json(r#"{"n":-0.0}"#));
        assert_eq!(json(r#"{"n":0.5}"#), json(r#"{"n":5e-1}"#));
        assert_ne!(json(r#"{"n":1}"#), json(r#"{"n":1.5}"#));
        // Large numbers are never merged through f64: such bodies are hashed raw.
        assert_ne!(
            json(r#"{"n":9007199254740993}"#),
            json(r#"{"n":9007199254740992}"#)
        );
        assert_ne!(
            json(r#"{"n":18446744073709551617}"#),
            json(r#"{"n":18446744073709551616}"#)
        );
        assert_ne!(
            json(r#"{"n":9007199254740992}"#),
            json(r#"{"n":9007199254740992.0}"#)
        );
        assert_eq!(canonical_json(b"-9007199254740992"), None);
        assert_eq!(canonical_json(b"1e30"), None);
        assert_eq!(
            canonical_json(b"9007199254740991").unwrap(),
            b"9007199254740991"
        );
        assert_eq!(
            canonical_json(br#"[4.50, 0.002, 1E-7, -0, 1e21]"#),
            None,
            "1e21 is beyond 2^53"
        );
        assert_eq!(
            canonical_json(br#"[4.50, 0.002, 1E-7, -0, 1e15]"#).unwrap(),
            b"[4.5,0.002,1e-7,0,1000000000000000]"
        );
    }

    #[test]
    fn string_escapes_are_canonical() {
        assert_eq!(json(r#"{"s":"\u00e9\u0041"}"#), json(r#"{"s":"éA"}"#));
        assert_eq!(json(r#"{"s":"\/"}"#), json(r#"{"s":"/"}"#));
    }

    #[test]
    fn json_media_types() {
        for ct in [
            "application/json",
            "application/json; charset=utf-8",
            "APPLICATION/JSON",
            "application/merge-patch+json",
            "application/vnd.api+json;v=2",
            " application/problem+json ",
        ] {
            assert!(is_json_media_type(ct.as_bytes()), "{ct}");
        }
        for ct in [
            "text/plain",
            "application/jsonp",
            "application/+json",
            "json",
            "application/x-www-form-urlencoded",
            "",
        ] {
            assert!(!is_json_media_type(ct.as_bytes()), "{ct}");
        }
        let a = fp(
            Some("application/vnd.x+json; charset=utf-8"),
            br#"{"a":1,"b":2}"#,
        );
        let b = fp(
            Some("application/vnd.x+json; charset=utf-8"),
            br#"{"b":2,"a":1}"#,
        );
        assert_eq!(a, b);
        assert_ne!(a, fp(Some("application/vnd.x+json"), br#"{"a":1,"b":2}"#));
    }

    #[test]
    fn non_json_bodies_are_hashed_raw() {
        assert_ne!(
            fp(Some("text/plain"), br#"{"a":1,"b":2}"#),
            fp(Some("text/plain"), br#"{"b":2,"a":1}"#)
        );
        assert_ne!(fp(None, br#"{"a":1}"#), fp(None, br#"{ "a":1}"#));
        assert_eq!(fp(None, b"\x00\xff"), fp(None, b"\x00\xff"));
    }

    #[test]
    fn broken_json_is_hashed_raw_without_error() {
        let broken = br#"{"a":1,"#;
        assert_eq!(canonical_json(broken), None);
        let raw = request_fingerprint(
            &Method::POST,
            &"/orders".parse().unwrap(),
            &json_headers("application/json"),
            broken,
        );
        assert_eq!(raw, json(r#"{"a":1,"#));
        assert_ne!(raw, json(r#"{"a":1, "#));
        assert_eq!(canonical_json(b""), None);
        assert_eq!(canonical_json(br#""\ud800""#), None);
        assert_eq!(canonical_json(b"1e400"), None);
        assert_eq!(canonical_json(b"[1] x"), None);
        assert_eq!(canonical_json("[".repeat(200).as_bytes()), None);
    }

    #[test]
    fn duplicate_member_names_are_hashed_raw() {
        assert_eq!(canonical_json(br#"{"a":1,"a":2}"#), None);
        assert_ne!(json(r#"{"a":1,"a":2}"#), json(r#"{"a":2}"#));
        assert_ne!(json(r#"{"a":1,"a":2}"#), json(r#"{"a":1, "a":2}"#));
    }

    #[test]
    fn request_line_and_content_type_count() {
        let h = json_headers("application/json");
        let body = br#"{"a":1}"#;
        let base = request_fingerprint(&Method::POST, &"/orders".parse().unwrap(), &h, body);
        for (m, u) in [
            (Method::PATCH, "/orders"),
            (Method::POST, "/refunds"),
            (Method::POST, "/orders?"),
            (Method::POST, "/orders?a=1"),
        ] {
            assert_ne!(
                base,
                request_fingerprint(&m, &u.parse().unwrap(), &h, body),
                "{m} {u}"
            );
        }
        assert_ne!(
            request_fingerprint(&Method::POST, &"/o?a=1".parse().unwrap(), &h, body),
            request_fingerprint(&Method::POST, &"/o?a=2".parse().unwrap(), &h, body),
        );
        assert_ne!(
            base,
            request_fingerprint(
                &Method::POST,
                &"/orders".parse().unwrap(),
                &json_headers("text/json"),
                body
            )
        );
        assert_ne!(
            base,
            request_fingerprint(
                &Method::POST,
                &"/orders".parse().unwrap(),
                &HeaderMap::new(),
                body
            )
        );
        // An absolute-form target fingerprints like its origin form.
        assert_eq!(
            base,
            request_fingerprint(&Method::POST, &"http://h/orders".parse().unwrap(), &h, body)
        );
    }

    /// A JSON value of bounded size (no duplicate keys: objects are maps).
    fn arb_json() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            (-(1i64 << 53) + 1..(1i64 << 53)).prop_map(Value::from),
            any::<f64>()
                .prop_filter("finite, below 2^53", |f| f.is_finite()
                    && f.abs() < (1u64 << 53) as f64)
                .prop_map(Value::from),
            "\\PC{0,12}".prop_map(Value::String),
        ];
        leaf.prop_recursive(4, 48, 6, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
                prop::collection::btree_map("\\PC{0,8}", inner, 0..6)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    /// Writes `v` as JSON text with whitespace and member order drawn from
    /// `noise`.
    fn write_noisy(v: &Value, noise: &mut impl Iterator<Item = u8>, out: &mut String) {
        const WS: [&str; 5] = ["", " ", "\n", "\t", "\r\n  "];
        let ws = |out: &mut String, noise: &mut dyn Iterator<Item = u8>| {
            out.push_str(WS[usize::from(noise.next().unwrap_or(0)) % WS.len()]);
        };
        match v {
            Value::Array(items) => {
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    ws(out, noise);
                    write_noisy(item, noise, out);
                    ws(out, noise);
                }
                out.push(']');
            }
            Value::Object(m) => {
                let mut members: Vec<(&String, &Value)> = m.iter().collect();
                // Shuffle by the noise (Fisher–Yates).
                for i in (1..members.len()).rev() {
                    let j = usize::from(noise.next().unwrap_or(0)) % (i + 1);
                    members.swap(i, j);
                }
                out.push('{');
                for (i, (k, val)) in members.into_iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    ws(out, noise);
                    out.push_str(&serde_json::to_string(k).unwrap());
                    ws(out, noise);
                    out.push(':');
                    ws(out, noise);
                    write_noisy(val, noise, out);
                    ws(out, noise);
                }
                out.push('}');
            }
            other => out.push_str(&serde_json::to_string(other).unwrap()),
        }
    }

    proptest! {
        #[test]
        fn reordered_and_respaced_json_fingerprints_the_same(
            v in arb_json(),
            noise in prop::collection::vec(any::<u8>(), 0..256),
        ) {
            let plain = serde_json::to_vec(&v).unwrap();
            let mut noisy = String::new();
            let mut it = noise.into_iter().cycle();
            write_noisy(&v, &mut it, &mut noisy);
            let a = fp(Some("application/json"), &plain);
            let b = fp(Some("application/json"), noisy.as_bytes());
            prop_assert_eq!(a, b);
            prop_assert!(canonical_json(noisy.as_bytes()).is_some());
            prop_assert_eq!(canonical_json(&plain), canonical_json(noisy.as_bytes()));
        }
    }
}
