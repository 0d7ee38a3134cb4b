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
//! value as RFC 8785 says (`1.0`, `1`, `1e0` and `100`, `1E2` are the
//! same). A body that is not I-JSON (RFC 7493) is hashed as raw bytes,
//! without an error: malformed JSON, a lone surrogate, an object with a
//! duplicate member name, nesting deeper than 128, or a number of magnitude
//! 2^53 or more (where doubles no longer hold every integer, so two
//! different large amounts could otherwise share a fingerprint).
//!
//! For the same reason a body is hashed raw when one of its numbers is more
//! precise than a double: when the number's decimal value differs from the
//! shortest decimal that round-trips its double (trailing zeros, leading
//! zeros and exponent notation aside). `0.1` and `0.10` are kept,
//! `0.1000000000000000001` (the same double as `0.1`) is not, so the two
//! amounts never share a fingerprint. Every number with at most 15
//! significant digits in the normal double range is kept, and so is
//! nearly every number written by a shortest-round-trip formatter
//! (JavaScript, serde_json, Python's `repr`), such as
//! `0.30000000000000004`. The exception is a 17-digit double exactly
//! halfway between two shortest candidates (`1466536241731893.25` may be
//! written `…893.2` or `…893.3`): only the one the canonical form writes
//! (RFC 8785, ECMAScript's `Number::toString`) is kept, the other is hashed
//! raw, so two different amounts still never meet and the canonical form
//! of a kept body is kept again. Other bodies are hashed as raw bytes.

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

/// Which parts of a request count for its fingerprint (per route; see
/// [`crate::routes`]). The default is the fingerprint described in the
/// [module docs](self), bit for bit: [`request_fingerprint_with`] with
/// `FingerprintSpec::default()` equals [`request_fingerprint`].
///
/// Any other spec hashes a different format tag first, so a record made
/// under one spec never matches a request judged under another (a retry
/// after the rules changed gets 422 `key-mismatch`, never another
/// request's response).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FingerprintSpec {
    /// The method counts (default true).
    pub method: bool,
    /// The normalised path counts (default true). Without it the route's
    /// name counts instead, so one key on two routes is still two requests.
    pub path: bool,
    /// The query counts (default true).
    pub query: bool,
    /// Query parameters left out, by name (percent-decoded, case-sensitive
    /// as RFC 3986 makes them); the other parameters keep their order.
    pub ignore_query: Vec<String>,
    /// Request headers that count besides `Content-Type`, every field of
    /// each in the order received (default none).
    pub headers: Vec<http::HeaderName>,
    /// The body counts (default true).
    pub body: bool,
    /// JSON Pointers (RFC 6901) of members left out of a JSON body before it
    /// is canonicalised (default none). A body that is not JSON is hashed
    /// raw, whole.
    pub exclude: Vec<String>,
    /// When not empty, only these JSON Pointers of a JSON body count (a
    /// missing one counts as absent, which differs from `null`).
    pub include: Vec<String>,
    /// The route's name, hashed when `path` is false.
    pub route: String,
}

impl Default for FingerprintSpec {
    fn default() -> Self {
        Self {
            method: true,
            path: true,
            query: true,
            ignore_query: Vec::new(),
            headers: Vec::new(),
            body: true,
            exclude: Vec::new(),
            include: Vec::new(),
            route: String::new(),
        }
    }
}

impl FingerprintSpec {
    /// Whether this is the default spec (route name aside).
    pub fn is_default(&self) -> bool {
        *self
            == Self {
                route: self.route.clone(),
                ..Self::default()
            }
    }
}

/// The fingerprint of a request under `spec`; equal to
/// [`request_fingerprint`] for the default spec.
pub fn request_fingerprint_with(
    spec: &FingerprintSpec,
    method: &Method,
    uri: &Uri,
    headers: &HeaderMap,
    body: &[u8],
) -> Fingerprint {
    if spec.is_default() {
        return request_fingerprint(method, uri, headers, body);
    }
    // TODO(fp helper): the parts of `spec`.
    request_fingerprint(method, uri, headers, body)
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
/// magnitude 2^53 or more, nested deeper than 128) or when a number is more
/// precise than a double (see the [module docs](self)).
///
/// ```
/// use idem_http::fingerprint::canonical_json;
/// assert_eq!(canonical_json(br#"{ "b": 1.0, "a": [true, null] }"#).unwrap(), br#"{"a":[true,null],"b":1}"#);
/// assert_eq!(canonical_json(br#"{"a":1,"a":2}"#), None);
/// assert_eq!(canonical_json(b"{"), None);
/// assert_eq!(canonical_json(br#"{"amount":0.1000000000000000001}"#), None);
/// ```
pub fn canonical_json(body: &[u8]) -> Option<Vec<u8>> {
    let Strict(value) = serde_json::from_slice(body).ok()?;
    if !numbers_fit_doubles(body) {
        return None;
    }
    serde_json_canonicalizer::to_vec(&value).ok()
}

/// Whether every number literal of `json` (a valid JSON text) has the
/// decimal value of the shortest decimal that round-trips its double, so
/// that no two different numbers can meet in one double.
///
/// Correct because the shortest round-trip decimal is a function of the
/// double: two accepted literals with one double have one decimal value.
fn numbers_fit_doubles(json: &[u8]) -> bool {
    let mut i = 0;
    while i < json.len() {
        match json[i] {
            b'"' => {
                // Skip the string; the text is valid JSON, so it ends.
                i += 1;
                while i < json.len() && json[i] != b'"' {
                    i += if json[i] == b'\\' { 2 } else { 1 };
                }
                i += 1;
            }
            b'-' | b'0'..=b'9' => {
                let start = i;
                while i < json.len()
                    && matches!(json[i], b'-' | b'+' | b'.' | b'e' | b'E' | b'0'..=b'9')
                {
                    i += 1;
                }
                // ASCII by construction.
                let Ok(text) = std::str::from_utf8(&json[start..i]) else {
                    return false;
                };
                if !fits_double(text) {
                    return false;
                }
            }
            _ => i += 1,
        }
    }
    true
}

/// Whether the JSON number `text` has the decimal value of the shortest
/// round-trip decimal of its double as the canonical form writes it
/// (RFC 8785 §3.2.2.3, ECMAScript's `Number::toString`). Where two shortest
/// decimals tie, the canonical form's choice is the one kept, so the
/// canonical form of an accepted body is itself accepted (canonicalising
/// twice gives the same bytes).
fn fits_double(text: &str) -> bool {
    if short_plain_decimal(text) {
        return true;
    }
    let Ok(double) = text.parse::<f64>() else {
        return false;
    };
    if !double.is_finite() {
        return false;
    }
    let Ok(canonical) = serde_json_canonicalizer::to_string(&double) else {
        return false;
    };
    match (Decimal::parse(text), Decimal::parse(&canonical)) {
        (Some(written), Some(shortest)) => written == shortest,
        _ => false,
    }
}

/// Fast path of [`fits_double`]: a literal without exponent, at most 64
/// characters, with at most 15 significant digits (leading zeros aside,
/// trailing zeros included). Its magnitude is between 1e-64 and 1e15, in
/// the normal double range, and 15 digits is `f64::DIGITS`: two different
/// decimals of at most 15 significant digits never share a double, so the
/// shortest round-trip decimal of its double is its own value. Covers the
/// integers and prices of nearly every body without formatting a double.
fn short_plain_decimal(text: &str) -> bool {
    let t = text.strip_prefix('-').unwrap_or(text);
    if t.is_empty() || t.len() > 64 {
        return false;
    }
    let mut significant = 0u32;
    let mut dots = 0;
    for b in t.bytes() {
        match b {
            b'0' if significant == 0 => {}
            b'0'..=b'9' => significant += 1,
            b'.' => dots += 1,
            _ => return false,
        }
    }
    let b = t.as_bytes();
    dots <= 1
        && significant <= f64::DIGITS
        && b[0].is_ascii_digit()
        && b[b.len() - 1].is_ascii_digit()
}

/// A decimal number as significant digits (no leading or trailing zeros)
/// times a power of ten; zero is no digits, exponent 0, either sign.
#[derive(Debug, PartialEq, Eq)]
struct Decimal {
    negative: bool,
    digits: Vec<u8>,
    exponent: i64,
}

impl Decimal {
    /// Parses `-?digits[.digits][(e|E)[+-]digits]`.
    fn parse(text: &str) -> Option<Self> {
        let (negative, rest) = match text.strip_prefix('-') {
            Some(r) => (true, r),
            None => (false, text),
        };
        let (mantissa, exp) = match rest.find(['e', 'E']) {
            Some(at) => (&rest[..at], Some(&rest[at + 1..])),
            None => (rest, None),
        };
        let (int, frac) = mantissa.split_once('.').unwrap_or((mantissa, ""));
        if int.is_empty() || !int.bytes().chain(frac.bytes()).all(|b| b.is_ascii_digit()) {
            return None;
        }
        let mut exponent: i64 = match exp {
            None => 0,
            Some(e) => {
                let (sign, digits) = match e.as_bytes().first() {
                    Some(b'-') => (-1, &e[1..]),
                    Some(b'+') => (1, &e[1..]),
                    _ => (1, e),
                };
                if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
                    return None;
                }
                // Saturates: such exponents are far outside any double.
                let magnitude = digits.bytes().fold(0i64, |acc, b| {
                    acc.saturating_mul(10).saturating_add(i64::from(b - b'0'))
                });
                sign * magnitude
            }
        };
        exponent = exponent.saturating_sub(i64::try_from(frac.len()).ok()?);
        let mut digits: Vec<u8> = int.bytes().chain(frac.bytes()).map(|b| b - b'0').collect();
        while digits.last() == Some(&0) {
            digits.pop();
            exponent = exponent.saturating_add(1);
        }
        let leading = digits.iter().take_while(|&&d| d == 0).count();
        digits.drain(..leading);
        if digits.is_empty() {
            // -0 and 0 are one double, serialised as 0 (RFC 8785).
            return Some(Self {
                negative: false,
                digits,
                exponent: 0,
            });
        }
        Some(Self {
            negative,
            digits,
            exponent,
        })
    }
}

/// A JSON value that refuses what RFC 7493 (I-JSON) excludes and RFC 8785
/// relies on: duplicate member names (two parsers may read two different
/// requests) and numbers that a double cannot hold exactly.
struct Strict(Value);

/// Member names serde_json reserves for its own tokens (with its
/// `raw_value` or `arbitrary_precision` features, which other crates of a
/// build may turn on): an object with such a member is serialised as a raw
/// value or a number, not as an object, so its canonical form would be
/// neither the object nor valid JSON. Such bodies are hashed raw (found by
/// the `json` fuzz target: `{"$serde_json::private::RawValue":1.0}`).
const SERDE_JSON_PRIVATE: &str = "$serde_json::private::";

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
            if k.starts_with(SERDE_JSON_PRIVATE) {
                return Err(de::Error::custom("serde_json's private member name"));
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
    fn numbers_beyond_double_precision_are_hashed_raw() {
        // One double, two amounts: never the same request.
        assert_eq!(0.1f64, "0.1000000000000000001".parse::<f64>().unwrap());
        assert_ne!(
            json(r#"{"amount": 0.1}"#),
            json(r#"{"amount": 0.1000000000000000001}"#)
        );
        assert_eq!(canonical_json(br#"{"amount":0.1000000000000000001}"#), None);
        assert_ne!(json("[1]"), json("[1.00000000000000000001]"));
        assert_ne!(json("[0]"), json("[1e-400]"), "underflows to 0");
        assert_ne!(json("[0]"), json("[-1e-400]"));
        assert_ne!(
            json("[5e-324]"),
            json("[4.9406564584124654e-324]"),
            "the same subnormal"
        );
        // A string that looks like such a number is just a string.
        assert!(canonical_json(br#"{"a":"0.1000000000000000001\"1e-400"}"#).is_some());
        // RFC 8785 equivalence is kept for every number a double holds.
        assert_eq!(json(r#"{"n":1.0}"#), json(r#"{"n":1}"#));
        assert_eq!(json(r#"{"n":1e2}"#), json(r#"{"n":100}"#));
        assert_eq!(json(r#"{"n":0.10}"#), json(r#"{"n":1E-1}"#));
        assert_eq!(json(r#"{"n":-0}"#), json(r#"{"n":0.000e5}"#));
        assert_eq!(
            json(r#"{"amount":0.1,"currency":"EUR"}"#),
            json(r#"{"currency":"EUR", "amount":0.1}"#)
        );
        // Shortest round-trip output of 17 significant digits is kept.
        assert_eq!(
            canonical_json(b"[0.30000000000000004, 5e-324, 1.7976931348623157e-300]").unwrap(),
            b"[0.30000000000000004,5e-324,1.7976931348623157e-300]"
        );
        // A tie between two shortest forms: only the canonical form's
        // choice is kept, so the canonical form is canonical again (found by
        // the `json` fuzz target: `[888888888888888.3]` was kept and
        // written `[888888888888888.2]`, which was then refused).
        for (kept, refused) in [
            ("-1466536241731893.2", "-1466536241731893.3"),
            ("888888888888888.2", "888888888888888.3"),
        ] {
            assert!(fits_double(kept), "{kept}");
            assert!(!fits_double(refused), "{refused}");
            let body = format!("[{kept}]");
            let canonical = canonical_json(body.as_bytes()).unwrap();
            assert_eq!(canonical, body.as_bytes());
            assert_eq!(canonical_json(&canonical).unwrap(), canonical);
            assert_eq!(canonical_json(format!("[{refused}]").as_bytes()), None);
            assert_ne!(json(&body), json(&format!("[{refused}]")));
        }
        // 15 significant digits always fit.
        assert!(
            canonical_json(b"[123456789012345, 0.123456789012345, 9.99999999999999e-300]")
                .is_some()
        );
    }

    #[test]
    fn decimals_normalise() {
        let d = |s: &str| Decimal::parse(s).unwrap();
        assert_eq!(d("100"), d("1e2"));
        assert_eq!(d("1.500"), d("15E-1"));
        assert_eq!(d("-0.0"), d("0"));
        assert_eq!(d("0.001"), d("1e-3"));
        assert_ne!(d("-1"), d("1"));
        assert_ne!(d("0.1"), d("0.1000000000000000001"));
        assert_eq!(d("1e99999999999999999999999").exponent, i64::MAX);
        assert!(!fits_double("1e400"));
        assert!(fits_double("123.456"));
        assert!(!fits_double("123.4560000000000000001"));
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
    fn serde_json_private_member_names_are_hashed_raw() {
        for body in [
            r#"{"$serde_json::private::RawValue":1.0,"a88":[80.12,0.1]}"#,
            r#"{"$serde_json::private::Number":"1"}"#,
            r#"[{"a":{"$serde_json::private::RawValue":"x"}}]"#,
        ] {
            assert_eq!(canonical_json(body.as_bytes()), None, "{body}");
        }
        assert!(canonical_json(br#"{"$serde_json":1,"$other::private::":2}"#).is_some());
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
                // Ties between two shortest forms (see the module docs).
                .prop_filter("written as the canonical form writes it", |f| fits_double(
                    &serde_json_canonicalizer::to_string(f).unwrap()
                ))
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

    /// The slow path of `fits_double`, without the fast path.
    fn fits_double_slow(text: &str) -> bool {
        let Ok(double) = text.parse::<f64>() else {
            return false;
        };
        double.is_finite()
            && matches!(
                (Decimal::parse(text), Decimal::parse(&format!("{double:e}"))),
                (Some(w), Some(s)) if w == s
            )
    }

    #[test]
    fn fast_path_is_limited_to_short_plain_decimals() {
        for t in [
            "0",
            "-0",
            "0.0",
            "1999",
            "-12.5",
            "0.1",
            "0.10",
            "123456789012345",
            "0.000000000000001",
        ] {
            assert!(short_plain_decimal(t), "{t}");
            assert!(fits_double_slow(t), "{t}");
        }
        for t in [
            "1e2",
            "1E2",
            "1234567890123456",
            "0.1000000000000000001",
            "1.",
            "-",
            "",
            "1.2.3",
        ] {
            assert!(!short_plain_decimal(t), "{t}");
        }
        assert!(!short_plain_decimal(&format!("0.{}1", "0".repeat(70))));
    }

    proptest! {
        /// Wherever the fast path answers, the slow path agrees.
        #[test]
        fn fast_path_agrees_with_the_slow_path(
            neg in any::<bool>(),
            int in "(0|[1-9][0-9]{0,15})",
            frac in prop::option::of("[0-9]{1,16}"),
        ) {
            let text = format!("{}{int}{}", if neg { "-" } else { "" }, frac.map(|f| format!(".{f}")).unwrap_or_default());
            if short_plain_decimal(&text) {
                prop_assert!(fits_double_slow(&text), "{}", text);
            }
        }

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
