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
//! duplicate member name, nesting 128 levels deep or more, or a number of magnitude
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
//!
//! ## Per-route fingerprints
//!
//! A route may say which parts count ([`FingerprintSpec`],
//! [`request_fingerprint_with`]): method, path, query (with parameters
//! left out by name), named headers, body (with JSON members left out, or
//! only some kept, by JSON Pointer, RFC 6901). The default spec is the
//! fingerprint above, bit for bit; any other spec hashes its own format tag
//! and a description of itself first, so two different specs never share a
//! fingerprint.

use std::borrow::Cow;
use std::fmt;

use http::{header, HeaderMap, HeaderName, Method, Uri};
use idem_core::{Fingerprint, FingerprintBuilder};
use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Number, Value};

use crate::json_pointer::{array_index, pointer_tokens};

mod jcs;

/// Tag of the fingerprint format, hashed first so a change of format never
/// collides with an older one.
const FORMAT: &[u8] = b"idem-http/fingerprint/1";

/// Tag of the format of a fingerprint under a non-default
/// [`FingerprintSpec`]; the spec's own description follows it.
const FORMAT_SPEC: &[u8] = b"idem-http/fingerprint/2";

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
    let content_types = content_types(&mut b, headers);
    let json = is_json_body(&content_types);
    whole_body(&mut b, json, body);
    b.finish()
}

/// Hashes every `Content-Type` field value (a count, then each as
/// received) and returns them.
fn content_types<'h>(b: &mut FingerprintBuilder, headers: &'h HeaderMap) -> Vec<&'h [u8]> {
    let content_types: Vec<&[u8]> = headers
        .get_all(header::CONTENT_TYPE)
        .iter()
        .map(|v| v.as_bytes())
        .collect();
    b.part(&(content_types.len() as u64).to_be_bytes());
    for ct in &content_types {
        b.part(ct);
    }
    content_types
}

/// Whether the body is read as JSON: exactly one `Content-Type` field, and
/// it names JSON ([`is_json_media_type`]).
fn is_json_body(content_types: &[&[u8]]) -> bool {
    matches!(content_types, [ct] if is_json_media_type(ct))
}

/// Hashes the whole body: its canonical form when it is a JSON body and
/// I-JSON, else its raw bytes.
fn whole_body(b: &mut FingerprintBuilder, json: bool, body: &[u8]) {
    let hashed = json
        && jcs::Canonicaliser::with_thread_buffers(|c| {
            let ok = c.canonicalise(body);
            if ok {
                b.part(b"jcs").part(c.output());
            }
            ok
        });
    if !hashed {
        b.part(b"raw").part(body);
    }
}

/// Which parts of a request count for its fingerprint (per route; see
/// [`crate::routes`]). The default is the fingerprint described in the
/// [module docs](self), bit for bit: [`request_fingerprint_with`] with
/// `FingerprintSpec::default()` (whatever its `route`) equals
/// [`request_fingerprint`].
///
/// Any other spec hashes a different format tag first
/// (`idem-http/fingerprint/2`), then a description of the spec itself
/// (which parts are on, the `ignore_query`, `headers`, `exclude` and
/// `include` lists), so a record made under one spec never matches a
/// request judged under another (a retry after the rules changed gets 422
/// `key-mismatch`, never another request's response). `route` is not part
/// of the description: it counts only when `path` is off, in place of the
/// path.
///
/// Check a spec with [`FingerprintSpec::validate`] when it is configured;
/// [`request_fingerprint_with`] never fails, whatever the spec.
///
/// ```
/// use idem_http::fingerprint::FingerprintSpec;
/// let spec = FingerprintSpec {
///     ignore_query: vec!["utm_source".into()],
///     exclude: vec!["/delivered_at".into()],
///     ..FingerprintSpec::default()
/// };
/// assert!(spec.validate().is_ok());
/// assert!(!spec.is_default());
/// assert!(FingerprintSpec { route: "payments".into(), ..Default::default() }.is_default());
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FingerprintSpec {
    /// The method counts (default true).
    pub method: bool,
    /// The normalised path counts (default true). Without it the route's
    /// name counts instead, so one key on two routes is still two requests.
    pub path: bool,
    /// The query counts (default true): its parameters (split on `&`), in
    /// the order received, each byte for byte. A query whose every
    /// parameter is ignored counts as no query; `/p?` (one empty
    /// parameter) differs from `/p`.
    pub query: bool,
    /// Query parameters left out, by name (default none): a parameter's
    /// name is its text before the first `=` (all of it without one),
    /// compared with each listed name byte for byte after percent-decoding
    /// (RFC 3986 §2.1; a malformed escape stays as written) and reading `+`
    /// as a space as `application/x-www-form-urlencoded` does (so
    /// `utm+source` and `utm%20source` are the name `utm source`; a
    /// literal `+` is matched by `%2B` only). Case-sensitive, as RFC 3986
    /// makes queries. The other parameters keep their order and bytes:
    /// `?a=1&utm_source=x` equals `?a=1`, `?a=1&b=2` differs from
    /// `?b=2&a=1`.
    pub ignore_query: Vec<String>,
    /// Request headers that count besides `Content-Type`, in this order,
    /// each with every field of it in the order received (default none). A
    /// missing header differs from one with an empty value.
    pub headers: Vec<HeaderName>,
    /// The body counts (default true).
    pub body: bool,
    /// JSON Pointers (RFC 6901) of members or array elements left out of a
    /// JSON body before it is canonicalised (default none). Every pointer
    /// is resolved against the body as received (so `/items/0` and
    /// `/items/1` leave out the first two elements, in either order); a
    /// pointer that finds nothing changes nothing; `""` leaves out the
    /// whole body. A body that is not JSON, or not I-JSON (see the
    /// [module docs](self)), is hashed raw, whole.
    pub exclude: Vec<String>,
    /// When not empty, only these JSON Pointers (RFC 6901) of a JSON body
    /// count, in this order, each as the canonical form (RFC 8785) of the
    /// value it finds; a missing one counts as absent, which differs from
    /// `null`. A body that is not JSON, or not I-JSON, is hashed raw,
    /// whole.
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

/// Why a [`FingerprintSpec`] is refused ([`FingerprintSpec::validate`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FingerprintSpecError {
    /// An `exclude` or `include` entry is not a JSON Pointer.
    #[error("fingerprint pointer {pointer:?} is not a JSON Pointer (RFC 6901): {reason}")]
    Pointer {
        /// The entry as given.
        pointer: String,
        /// Why (see [`crate::json_pointer::validate_pointer`]).
        reason: String,
    },
    /// Both `include` and `exclude` are set.
    #[error("fingerprint include and exclude are both set: use one of them")]
    IncludeAndExclude,
    /// `include` or `exclude` is set while the body does not count.
    #[error("fingerprint include/exclude are set but the body does not count (body = false)")]
    PointersWithoutBody,
    /// `ignore_query` is set while the query does not count.
    #[error("fingerprint ignore_query is set but the query does not count (query = false)")]
    IgnoreQueryWithoutQuery,
}

impl FingerprintSpec {
    /// Whether this is the default spec (`route` aside). Allocation-free:
    /// the layer asks on every guarded request.
    pub fn is_default(&self) -> bool {
        let Self {
            method,
            path,
            query,
            ignore_query,
            headers,
            body,
            exclude,
            include,
            route: _,
        } = self;
        *method
            && *path
            && *query
            && *body
            && ignore_query.is_empty()
            && headers.is_empty()
            && exclude.is_empty()
            && include.is_empty()
    }

    /// Checks the spec: every `exclude` and `include` entry is a JSON
    /// Pointer (RFC 6901: empty, or `/` followed by reference tokens in
    /// which `~` is only ever `~0` or `~1`); `include` and `exclude` are
    /// not both set; neither is set without `body`; `ignore_query` is not
    /// set without `query`.
    ///
    /// ```
    /// use idem_http::fingerprint::{FingerprintSpec, FingerprintSpecError};
    /// let bad = FingerprintSpec { exclude: vec!["delivered_at".into()], ..Default::default() };
    /// assert!(matches!(bad.validate(), Err(FingerprintSpecError::Pointer { .. })));
    /// let ok = FingerprintSpec { exclude: vec!["/a~1b/0".into()], ..Default::default() };
    /// assert!(ok.validate().is_ok());
    /// ```
    ///
    /// # Errors
    /// The first problem, as a [`FingerprintSpecError`].
    pub fn validate(&self) -> Result<(), FingerprintSpecError> {
        for p in self.exclude.iter().chain(&self.include) {
            crate::json_pointer::validate_pointer(p).map_err(|reason| {
                FingerprintSpecError::Pointer {
                    pointer: p.clone(),
                    reason,
                }
            })?;
        }
        if !self.exclude.is_empty() && !self.include.is_empty() {
            return Err(FingerprintSpecError::IncludeAndExclude);
        }
        let pointers = !self.exclude.is_empty() || !self.include.is_empty();
        if pointers && !self.body {
            return Err(FingerprintSpecError::PointersWithoutBody);
        }
        if !self.query && !self.ignore_query.is_empty() {
            return Err(FingerprintSpecError::IgnoreQueryWithoutQuery);
        }
        Ok(())
    }

    /// The description hashed after the format tag: the four switches,
    /// then each list (`ignore_query`, `headers`, `exclude`, `include`) as
    /// a count and its entries, each length-prefixed, so two specs that
    /// differ have different descriptions.
    fn describe(&self) -> Vec<u8> {
        fn list<'a>(d: &mut Vec<u8>, items: impl ExactSizeIterator<Item = &'a [u8]>) {
            d.extend_from_slice(&(items.len() as u64).to_be_bytes());
            for item in items {
                d.extend_from_slice(&(item.len() as u64).to_be_bytes());
                d.extend_from_slice(item);
            }
        }
        let mut d = Vec::with_capacity(64);
        d.extend_from_slice(&[
            u8::from(self.method),
            u8::from(self.path),
            u8::from(self.query),
            u8::from(self.body),
        ]);
        list(&mut d, self.ignore_query.iter().map(|s| s.as_bytes()));
        list(&mut d, self.headers.iter().map(|h| h.as_str().as_bytes()));
        list(&mut d, self.exclude.iter().map(|s| s.as_bytes()));
        list(&mut d, self.include.iter().map(|s| s.as_bytes()));
        d
    }
}

/// The fingerprint of a request under `spec` (see [`FingerprintSpec`]);
/// equal to [`request_fingerprint`] for the default spec, which returns
/// early (the hot path costs a few field checks more, no allocation).
///
/// Otherwise a SHA-256, every part length-prefixed, over: the tag
/// `idem-http/fingerprint/2`; the spec's description; the method (when
/// on); the path (when on, else `spec.route`); the query parameters left
/// after `ignore_query`, as a count and each in order (when on); for each
/// header of `headers`, its name, the count of its fields and each value;
/// every `Content-Type` value as [`request_fingerprint`] hashes them; the
/// body (when on): whole as [`request_fingerprint`] hashes it, or, with
/// `exclude` / `include` and a JSON body that is I-JSON, the RFC 8785
/// canonical form of what they leave (else the raw bytes, whole).
///
/// Never fails: a spec [`FingerprintSpec::validate`] would refuse gives a
/// fingerprint all the same (a pointer that is not RFC 6901 makes the body
/// count raw, whole).
///
/// ```
/// use http::{HeaderMap, Method, Uri};
/// use idem_http::fingerprint::{request_fingerprint_with, FingerprintSpec};
/// let spec = FingerprintSpec {
///     ignore_query: vec!["utm_source".into()],
///     exclude: vec!["/delivered_at".into()],
///     ..FingerprintSpec::default()
/// };
/// let mut h = HeaderMap::new();
/// h.insert("content-type", "application/json".parse().unwrap());
/// let fp = |uri: &str, body: &str| {
///     let uri: Uri = uri.parse().unwrap();
///     request_fingerprint_with(&spec, &Method::POST, &uri, &h, body.as_bytes())
/// };
/// assert_eq!(
///     fp("/hooks?a=1&utm_source=x", r#"{"id":1,"delivered_at":"x"}"#),
///     fp("/hooks?a=1", r#"{"delivered_at":"y","id":1}"#),
/// );
/// assert_ne!(fp("/hooks?a=1", r#"{"id":1}"#), fp("/hooks?a=1", r#"{"id":2}"#));
/// ```
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
    let mut b = FingerprintBuilder::new();
    b.part(FORMAT_SPEC);
    b.part(&spec.describe());
    if spec.method {
        b.part(method.as_str().as_bytes());
    }
    if spec.path {
        b.part(uri.path().as_bytes());
    } else {
        b.part(spec.route.as_bytes());
    }
    if spec.query {
        let params: Vec<&str> = match uri.query() {
            None => Vec::new(),
            Some(q) => q
                .split('&')
                .filter(|p| !ignored_param(p, &spec.ignore_query))
                .collect(),
        };
        b.part(&(params.len() as u64).to_be_bytes());
        for p in params {
            b.part(p.as_bytes());
        }
    }
    for name in &spec.headers {
        b.part(name.as_str().as_bytes());
        let values = headers.get_all(name);
        b.part(&(values.iter().count() as u64).to_be_bytes());
        for v in values {
            b.part(v.as_bytes());
        }
    }
    let content_types = content_types(&mut b, headers);
    if spec.body {
        let json = is_json_body(&content_types);
        if spec.exclude.is_empty() && spec.include.is_empty() {
            whole_body(&mut b, json, body);
        } else if !json || !selected_body(&mut b, spec, body) {
            b.part(b"raw").part(body);
        }
    }
    b.finish()
}

/// Hashes what `spec.include` or `spec.exclude` leave of a JSON `body`;
/// `false` (nothing hashed) when the body is not I-JSON or a pointer is not
/// RFC 6901: then the caller hashes it raw.
fn selected_body(b: &mut FingerprintBuilder, spec: &FingerprintSpec, body: &[u8]) -> bool {
    let Some(mut value) = strict_value(body) else {
        return false;
    };
    if !spec.include.is_empty() {
        // One part per pointer: absent, or the canonical form of its value.
        let mut parts: Vec<Option<Vec<u8>>> = Vec::with_capacity(spec.include.len());
        for p in &spec.include {
            let Ok(tokens) = pointer_tokens(p) else {
                return false;
            };
            match crate::json_pointer::lookup(&value, &tokens) {
                None => parts.push(None),
                Some(v) => match canonical_value(v) {
                    Some(c) => parts.push(Some(c)),
                    None => return false,
                },
            }
        }
        b.part(b"include");
        for part in parts {
            match part {
                None => b.part(b"absent"),
                Some(c) => b.part(b"jcs").part(&c),
            };
        }
        return true;
    }
    let mut pointers = Vec::with_capacity(spec.exclude.len());
    for p in &spec.exclude {
        let Ok(tokens) = pointer_tokens(p) else {
            return false;
        };
        pointers.push(tokens);
    }
    if pointers.iter().any(Vec::is_empty) {
        // `""` leaves out the whole document.
        b.part(b"excluded");
        return true;
    }
    let refs: Vec<&[String]> = pointers.iter().map(Vec::as_slice).collect();
    remove_pointers(&mut value, &refs);
    match canonical_value(&value) {
        Some(c) => {
            b.part(b"jcs").part(&c);
            true
        }
        None => false,
    }
}

/// Removes from `value` what each of `pointers` (reference tokens, none
/// empty) finds, every pointer resolved against `value` as it was before
/// any removal (so array indexes do not shift from one pointer to the
/// next).
fn remove_pointers(value: &mut Value, pointers: &[&[String]]) {
    match value {
        Value::Object(map) => {
            let mut done: Vec<&str> = Vec::new();
            for p in pointers {
                let first = p[0].as_str();
                if done.contains(&first) {
                    continue;
                }
                done.push(first);
                let same: Vec<&[String]> = pointers
                    .iter()
                    .filter(|q| q[0] == first)
                    .map(|q| &q[1..])
                    .collect();
                if same.iter().any(|rest| rest.is_empty()) {
                    map.remove(first);
                } else if let Some(member) = map.get_mut(first) {
                    remove_pointers(member, &same);
                }
            }
        }
        Value::Array(items) => {
            let mut gone: Vec<usize> = Vec::new();
            let mut done: Vec<usize> = Vec::new();
            for p in pointers {
                let Some(i) = array_index(&p[0]).filter(|&i| i < items.len()) else {
                    continue;
                };
                if done.contains(&i) {
                    continue;
                }
                done.push(i);
                let same: Vec<&[String]> = pointers
                    .iter()
                    .filter(|q| array_index(&q[0]) == Some(i))
                    .map(|q| &q[1..])
                    .collect();
                if same.iter().any(|rest| rest.is_empty()) {
                    gone.push(i);
                } else {
                    remove_pointers(&mut items[i], &same);
                }
            }
            gone.sort_unstable();
            for i in gone.into_iter().rev() {
                items.remove(i);
            }
        }
        _ => {}
    }
}

/// Whether the query parameter `param` (split at `&`) is one of `ignored`
/// by name (see [`FingerprintSpec::ignore_query`]).
///
/// A parameter with a `;` in it is never ignored: servers that also split
/// queries at `;` (Rack 2, Python's `parse_qs` before 3.9.2, Go before
/// 1.17) read `utm_source=x;amount=100` as two parameters, servers that do
/// not as one; left out, `…;amount=100` and `…;amount=999` would share a
/// fingerprint for the first kind. Kept whole, both kinds of server are
/// judged right.
fn ignored_param(param: &str, ignored: &[String]) -> bool {
    if ignored.is_empty() || param.contains(';') {
        return false;
    }
    let name = param.split_once('=').map_or(param, |(n, _)| n);
    let name = form_decode(name);
    ignored.iter().any(|i| i.as_bytes() == &*name)
}

/// `application/x-www-form-urlencoded` decoding of a name: `+` is a space,
/// `%XX` (two hex digits) is that byte, a malformed escape stays as written.
fn form_decode(s: &str) -> Cow<'_, [u8]> {
    let bytes = s.as_bytes();
    if !bytes.iter().any(|&c| c == b'%' || c == b'+') {
        return Cow::Borrowed(bytes);
    }
    let hex = |c: u8| char::from(c).to_digit(16);
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < bytes.len() => {
                match (hex(bytes[i + 1]), hex(bytes[i + 2])) {
                    (Some(h), Some(l)) => {
                        // Two hex digits: at most 0xFF.
                        out.push(u8::try_from(h * 16 + l).unwrap_or(b'%'));
                        i += 3;
                        continue;
                    }
                    _ => out.push(b'%'),
                }
            }
            c => out.push(c),
        }
        i += 1;
    }
    Cow::Owned(out)
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
/// magnitude 2^53 or more, nested 128 levels deep or more) or when a number is more
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
    let mut c = jcs::Canonicaliser::with_output_capacity(body.len());
    c.canonicalise(body).then(|| c.into_output())
}

/// [`canonical_json`] through a serde_json [`Value`]: [`strict_value`],
/// then `serde_json_canonicalizer`. The reference the single-pass
/// canonicaliser ([`jcs`]) matches byte for byte, and its fallback.
fn canonical_json_via_value(body: &[u8]) -> Option<Vec<u8>> {
    canonical_value(&strict_value(body)?)
}

/// The value of a JSON text that [`canonical_json`] accepts (I-JSON, every
/// number fits a double), else `None`.
fn strict_value(body: &[u8]) -> Option<Value> {
    let Strict::<true>(value) = serde_json::from_slice(body).ok()?;
    if !numbers_fit_doubles(body) {
        return None;
    }
    Some(value)
}

/// The RFC 8785 canonical form of a value [`strict_value`] gave (or a part
/// of one).
fn canonical_value(value: &Value) -> Option<Vec<u8>> {
    serde_json_canonicalizer::to_vec(value).ok()
}

/// The value of a JSON text parsed as strictly as [`canonical_json`] parses
/// it (duplicate member names, lone surrogates, nesting 128 levels deep or more,
/// serde_json's private member names are errors) except for numbers, which
/// are kept as serde_json reads them (an integer literal that fits 64 bits
/// exactly; any other number as a double). For [`crate::body_key`].
pub(crate) fn strict_structure(body: &[u8]) -> Result<Value, serde_json::Error> {
    let Strict::<false>(value) = serde_json::from_slice(body)?;
    Ok(value)
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
/// requests) and, when `EXACT`, numbers that a double cannot hold exactly
/// (without `EXACT`, numbers are kept as serde_json reads them).
struct Strict<const EXACT: bool>(Value);

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

impl<'de, const EXACT: bool> Deserialize<'de> for Strict<EXACT> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(StrictVisitor::<EXACT>)
    }
}

struct StrictVisitor<const EXACT: bool>;

impl<'de, const EXACT: bool> Visitor<'de> for StrictVisitor<EXACT> {
    type Value = Strict<EXACT>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E>(self, v: bool) -> Result<Strict<EXACT>, E> {
        Ok(Strict(Value::Bool(v)))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Strict<EXACT>, E> {
        if EXACT && v.unsigned_abs() >= EXACT_LIMIT {
            return Err(inexact());
        }
        Ok(Strict(Value::Number(v.into())))
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Strict<EXACT>, E> {
        if EXACT && v >= EXACT_LIMIT {
            return Err(inexact());
        }
        Ok(Strict(Value::Number(v.into())))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Strict<EXACT>, E> {
        if EXACT && v.abs() >= EXACT_LIMIT as f64 {
            return Err(inexact());
        }
        Number::from_f64(v)
            .map(|n| Strict(Value::Number(n)))
            .ok_or_else(|| E::custom("number out of range"))
    }

    fn visit_str<E>(self, v: &str) -> Result<Strict<EXACT>, E> {
        Ok(Strict(Value::String(v.to_owned())))
    }

    fn visit_string<E>(self, v: String) -> Result<Strict<EXACT>, E> {
        Ok(Strict(Value::String(v)))
    }

    fn visit_unit<E>(self) -> Result<Strict<EXACT>, E> {
        Ok(Strict(Value::Null))
    }

    fn visit_none<E>(self) -> Result<Strict<EXACT>, E> {
        Ok(Strict(Value::Null))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Strict<EXACT>, A::Error> {
        let mut out = Vec::new();
        while let Some(Strict::<EXACT>(v)) = seq.next_element()? {
            out.push(v);
        }
        Ok(Strict(Value::Array(out)))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Strict<EXACT>, A::Error> {
        let mut out = Map::new();
        while let Some(k) = map.next_key::<String>()? {
            if out.contains_key(&k) {
                return Err(de::Error::custom("duplicate member name"));
            }
            if k.starts_with(SERDE_JSON_PRIVATE) {
                return Err(de::Error::custom("serde_json's private member name"));
            }
            let Strict::<EXACT>(v) = map.next_value()?;
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

    #[test]
    fn form_decoding_of_query_names() {
        let d = |s: &str| form_decode(s).into_owned();
        assert_eq!(d("utm_source"), b"utm_source");
        assert_eq!(d("utm%5Fsource"), b"utm_source");
        assert_eq!(d("utm%5fsource"), b"utm_source");
        assert_eq!(d("a+b"), b"a b");
        assert_eq!(d("a%2Bb"), b"a+b");
        assert_eq!(d("%"), b"%");
        assert_eq!(d("%4"), b"%4");
        assert_eq!(d("a%4"), b"a%4");
        assert_eq!(d("%zz%41"), b"%zzA");
        assert_eq!(d("%FF"), [0xFF]);
        assert_eq!(d("%%41"), b"%A");
        assert!(matches!(form_decode("plain"), Cow::Borrowed(_)));
        assert!(ignored_param("a%20b=1", &["a b".into()]));
        assert!(ignored_param("utm", &["utm".into()]));
        assert!(!ignored_param("utm", &[]));
        assert!(!ignored_param("x=utm", &["utm".into()]));
    }

    #[test]
    fn pointers_are_removed_against_the_original() {
        let remove = |body: &str, ptrs: &[&str]| {
            let mut v: Value = serde_json::from_str(body).unwrap();
            let tokens: Vec<Vec<String>> = ptrs
                .iter()
                .map(|p| crate::json_pointer::pointer_tokens(p).unwrap())
                .collect();
            let refs: Vec<&[String]> = tokens.iter().map(Vec::as_slice).collect();
            remove_pointers(&mut v, &refs);
            serde_json::to_string(&v).unwrap()
        };
        assert_eq!(remove(r#"{"a":1,"b":2}"#, &["/a"]), r#"{"b":2}"#);
        assert_eq!(remove(r#"[0,1,2,3]"#, &["/2", "/0"]), "[1,3]");
        assert_eq!(remove(r#"[0,1,2,3]"#, &["/0", "/0"]), "[1,2,3]");
        assert_eq!(remove(r#"[0,1,2,3]"#, &["/4", "/-", "/01"]), "[0,1,2,3]");
        assert_eq!(
            remove(
                r#"{"a":{"b":1,"c":2},"d":[{"e":1,"f":2}]}"#,
                &["/a/b", "/d/0/e"]
            ),
            r#"{"a":{"c":2},"d":[{"f":2}]}"#
        );
        assert_eq!(remove(r#"{"a":{"b":1}}"#, &["/a/b", "/a"]), "{}");
        assert_eq!(remove(r#"{"a":"s"}"#, &["/a/b"]), r#"{"a":"s"}"#);
        assert_eq!(remove(r#"{"":1,"x":2}"#, &["/"]), r#"{"x":2}"#);
    }

    #[test]
    fn is_default_ignores_only_the_route() {
        assert!(FingerprintSpec::default().is_default());
        assert!(FingerprintSpec {
            route: "r".into(),
            ..Default::default()
        }
        .is_default());
        for s in [
            FingerprintSpec {
                method: false,
                ..Default::default()
            },
            FingerprintSpec {
                path: false,
                ..Default::default()
            },
            FingerprintSpec {
                query: false,
                ..Default::default()
            },
            FingerprintSpec {
                body: false,
                ..Default::default()
            },
            FingerprintSpec {
                ignore_query: vec![String::new()],
                ..Default::default()
            },
            FingerprintSpec {
                headers: vec![header::ACCEPT],
                ..Default::default()
            },
            FingerprintSpec {
                exclude: vec![String::new()],
                ..Default::default()
            },
            FingerprintSpec {
                include: vec![String::new()],
                ..Default::default()
            },
        ] {
            assert!(!s.is_default(), "{s:?}");
        }
    }

    #[test]
    fn canonical_json_is_the_canonical_form_of_the_strict_value() {
        for body in [
            r#"{"b":[1,2.50,{"d":null,"c":"\u00e9"}],"a":-0}"#,
            "[]",
            "1e2",
        ] {
            let v = strict_value(body.as_bytes()).unwrap();
            assert_eq!(canonical_json(body.as_bytes()), canonical_value(&v));
        }
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

    /// The single-pass canonical form of `body`, through the thread's
    /// reused buffers and through fresh ones, checked equal.
    fn single_pass(body: &[u8]) -> Option<Vec<u8>> {
        let reused = jcs::Canonicaliser::with_thread_buffers(|c| {
            c.canonicalise(body).then(|| c.output().to_vec())
        });
        assert_eq!(
            reused,
            canonical_json(body),
            "{:?}",
            String::from_utf8_lossy(body)
        );
        reused
    }

    #[test]
    fn single_pass_matches_the_value_path_at_the_edges() {
        let mut bodies: Vec<Vec<u8>> = Vec::new();
        for depth in 120..=132 {
            bodies.push(format!("{}{}", "[".repeat(depth), "]".repeat(depth)).into_bytes());
            bodies.push(format!("{}1{}", "[".repeat(depth), "]".repeat(depth)).into_bytes());
            bodies.push(format!("{}{}", r#"{"a":"#.repeat(depth), "}".repeat(depth)).into_bytes());
            bodies.push(
                format!(
                    "{}{{}}{}",
                    r#"{"a":["#.repeat(depth / 2),
                    "]}".repeat(depth / 2)
                )
                .into_bytes(),
            );
        }
        for text in [
            "",
            " ",
            "1",
            "-0",
            "-0.0",
            "0e5",
            "0e99999999999",
            "1e-400",
            "-1e-400",
            "1e400",
            "9007199254740991",
            "9007199254740992",
            "-9007199254740991",
            "-9007199254740992",
            "9007199254740991.0",
            "9007199254740992.0",
            "9.007199254740992e15",
            "-9007199254740992e0",
            "9007199254740991e0",
            "9007199254740991.5",
            "900719925474099.5",
            "18446744073709551616",
            "1234567890123456",
            "0.30000000000000004",
            "5e-324",
            "4.9406564584124654e-324",
            "1.7976931348623157e308",
            "1e21",
            "1e-7",
            "1E+2",
            "1.5e-7",
            "0.000001",
            "0.0000001",
            "-0.000001",
            "0.00000100",
            "0.0000012",
            "-0.00000999999999999",
            "0.000009999999999999",
            "-0.000",
            "12.50",
            "-3.0",
            "123456789012345.0",
            "0.123456789012345000",
            "123456789012345678901234567890e-30",
            "01",
            "1.",
            ".5",
            "+1",
            "-",
            "1e",
            "1e+",
            "--1",
            "0x10",
            "1.5.3",
            "NaN",
            "Infinity",
            "true",
            "false",
            "null",
            "tru",
            "nul",
            "truex",
            "[1,]",
            "[,1]",
            "{\"a\":1,}",
            "{,}",
            "{\"a\"}",
            "{\"a\":}",
            "{1:2}",
            "[1 2]",
            "{\"a\":1 \"b\":2}",
            "[1] x",
            "[1]\u{0}",
            "\u{feff}[1]",
            "[1]\x0c",
            r#""\u0000\u001f\u007f\u0080\u2028\u2029""#,
            r#""\ud83d\ude00""#,
            r#""\ud83d""#,
            r#""\ude00""#,
            r#""\ud83d\u0041""#,
            r#""\ud83d\n""#,
            r#""\ud83d\ud83d\ude00""#,
            r#""\uD83D\uDE00""#,
            r#""\u00E9""#,
            r#""\x""#,
            r#""\u12""#,
            r#""\u12g4""#,
            r#""a\/b\"c\\d\b\f\n\r\t""#,
            "\"tab\there\"",
            "\"\u{1}\"",
            "\"unterminated",
            r#"{"b":1,"a":2,"\u0061":3}"#,
            r#"{"a":1,"\u0061":2}"#,
            r#"{"é":1,"e\u0301":2}"#,
            "{\"\u{10000}\":1,\"\u{e000}\":2,\"\u{ffff}\":3,\"\u{d7ff}\":4}",
            "{\"\u{e000}\":1,\"\u{10ffff}\":2,\"\u{10000}\":3,\"\u{7f}\":4,\"\":5}",
            r#"{"$serde_json::private::RawValue":1}"#,
            r#"{"$serde_json::private":1}"#,
            r#"{"\u0024serde_json::private::Number":"1"}"#,
            r#"{"a":{"b":1,"a":2},"a ":[]}"#,
            r#"{"a":{"x":1,"x":1}}"#,
            r#"[{"b":1,"a":2},{"d":[3,{"f":1,"e":2}],"c":0}]"#,
        ] {
            bodies.push(text.as_bytes().to_vec());
        }
        bodies.push(b"\"\xff\"".to_vec());
        bodies.push(b"\"\xc3\"".to_vec());
        bodies.push(b"{\"\xed\xa0\x80\":1}".to_vec());
        bodies.push(b"[\"\xe2\x82\"]".to_vec());
        for body in bodies {
            assert_eq!(
                single_pass(&body),
                canonical_json_via_value(&body),
                "{:?}",
                String::from_utf8_lossy(&body)
            );
        }
    }

    /// A JSON number literal, or a near miss.
    fn arb_number() -> impl Strategy<Value = String> {
        prop_oneof![
            8 => "-?(0|[1-9][0-9]{0,5})(\\.[0-9]{1,4}0{0,2})?([eE][+-]?0?[0-9])?",
            1 => "-?(0|[1-9][0-9]{0,18})(\\.[0-9]{1,18})?([eE][+-]?[0-9]{1,3})?",
            2 => "-?0\\.0{0,8}[0-9]{0,6}0{0,2}",
            1 => any::<f64>().prop_map(|f| format!("{f}")),
            1 => any::<f64>().prop_map(|f| format!("{f:e}")),
            1 => any::<f64>().prop_map(|f| format!("{f:E}")),
            2 => any::<f64>()
                .prop_filter("finite", |f| f.is_finite())
                .prop_map(|f| serde_json_canonicalizer::to_string(&f).unwrap()),
            2 => (-1e15f64..1e15).prop_map(|f| serde_json_canonicalizer::to_string(&f).unwrap()),
            1 => any::<i64>().prop_map(|i| i.to_string()),
            1 => ((1i64 << 53) - 3..(1i64 << 53) + 3, any::<bool>())
                .prop_map(|(i, neg)| format!("{}{i}", if neg { "-" } else { "" })),
            1 => prop::sample::select(vec![
                "888888888888888.2",
                "888888888888888.3",
                "-1466536241731893.25",
                "1e-7",
                "0.1000000000000000001",
                "9007199254740992.0",
                "9.007199254740991e15",
                "5e-324",
                "2.2250738585072014e-308",
                "1e21",
                "-0",
                "01",
                "1.",
                "-",
                "1e",
                ".5",
                "0.0e0",
                "1E+21",
                "1e-400",
            ])
            .prop_map(String::from),
        ]
    }

    /// A JSON string literal (quotes included), with escapes, surrogates
    /// (paired or not), raw controls, now and then invalid.
    fn arb_string() -> impl Strategy<Value = String> {
        let piece = prop_oneof![
            16 => "\\PC{0,6}",
            4 => "[a-zA-Z\\u{e9}\\u{e000}\\u{ffff}\\u{10000}\\u{1f600}]{1,3}",
            8 => prop::sample::select(vec![
                "\\\"", "\\\\", "\\/", "\\b", "\\f", "\\n", "\\r", "\\t", "\\u0000",
                "\\u001F", "\\u007f", "\\u00e9", "\\u2028", "\\uD83D\\uDE00", "\\ud800\\udc00",
                "\\udbff\\udfff", "\\uE000", "\\uffff", "$serde_json::private::", "\\u0024",
            ])
            .prop_map(String::from),
            2 => any::<u16>().prop_map(|u| format!("\\u{u:04x}")),
            1 => prop::sample::select(vec![
                "\\ud800", "\\udc00", "\\ud800\\u0041", "\\ud800x", "\\x", "\\u12", "\u{1}",
                "\t", "\\", "\"",
            ])
            .prop_map(String::from),
        ];
        prop::collection::vec(piece, 0..4).prop_map(|ps| format!("\"{}\"", ps.concat()))
    }

    /// A member name: often one of a few (duplicates, names equal once
    /// decoded, names that sort differently in UTF-16 and in code points).
    fn arb_name() -> impl Strategy<Value = String> {
        prop_oneof![
            3 => prop::sample::select(vec![
                "\"a\"", "\"b\"", "\"\\u0061\"", "\"A\"", "\"\"", "\"a \"", "\"aa\"",
                "\"\u{e9}\"", "\"\\u00e9\"", "\"\u{e000}\"", "\"\u{ffff}\"", "\"\u{10000}\"",
                "\"\\ud800\\udc00\"", "\"\u{1f600}\"", "\"\u{7f}\"", "\"\\n\"",
                "\"$serde_json::private::RawValue\"",
            ])
            .prop_map(String::from),
            2 => arb_string(),
        ]
    }

    /// Whitespace, now and then something that is not JSON whitespace.
    fn arb_ws() -> impl Strategy<Value = &'static str> {
        prop_oneof![
            40 => prop::sample::select(vec!["", " ", "\n", "\t", "\r", " \t\r\n "]),
            1 => prop::sample::select(vec!["\u{c}", "\u{a0}", "\u{feff}", "\u{b}", "x"]),
        ]
    }

    /// A JSON text (or a near miss): nested objects and arrays with
    /// duplicate names, unicode and escaped strings, every kind of number,
    /// whitespace.
    fn arb_text() -> impl Strategy<Value = String> {
        let leaf = prop_oneof![
            3 => arb_number(),
            3 => arb_string(),
            2 => prop::sample::select(vec!["true", "false", "null"]).prop_map(String::from),
            1 => prop::sample::select(vec!["tru", "nulll", "[1,]", "{,}"]).prop_map(String::from),
        ];
        let tree = leaf.prop_recursive(5, 64, 6, |inner| {
            prop_oneof![
                prop::collection::vec((arb_ws(), inner.clone(), arb_ws()), 0..6).prop_map(
                    |items| {
                        let items: Vec<String> = items
                            .into_iter()
                            .map(|(a, v, b)| format!("{a}{v}{b}"))
                            .collect();
                        format!("[{}]", items.join(","))
                    }
                ),
                prop::collection::vec((arb_ws(), arb_name(), arb_ws(), inner), 0..6).prop_map(
                    |members| {
                        let members: Vec<String> = members
                            .into_iter()
                            .map(|(a, k, b, v)| format!("{a}{k}{b}:{a}{v}{b}"))
                            .collect();
                        format!("{{{}}}", members.join(","))
                    }
                ),
            ]
        });
        (arb_ws(), tree, arb_ws()).prop_map(|(a, t, b)| format!("{a}{t}{b}"))
    }

    /// One edit of a text: delete, insert or replace a byte.
    fn mutate(text: &[u8], edits: &[(u8, usize, u8)]) -> Vec<u8> {
        const BYTES: &[u8] = b"{}[],:\"\\ 0123456789.eE+-tfnu\x00\x1f\x7f\x80\xc3\xed\xff";
        let mut t = text.to_vec();
        for &(kind, at, byte) in edits {
            let byte = if byte < 128 {
                BYTES[usize::from(byte) % BYTES.len()]
            } else {
                byte
            };
            let at = if t.is_empty() { 0 } else { at % (t.len() + 1) };
            match kind % 3 {
                0 if at < t.len() => {
                    t.remove(at);
                }
                1 => t.insert(at, byte),
                _ if at < t.len() => t[at] = byte,
                _ => t.push(byte),
            }
        }
        t
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2048))]

        /// The single pass writes what the `Value` path writes, and refuses
        /// what it refuses, over generated JSON texts.
        #[test]
        fn single_pass_matches_the_value_path(text in arb_text()) {
            prop_assert_eq!(single_pass(text.as_bytes()), canonical_json_via_value(text.as_bytes()), "{}", text);
        }

        /// The same over mutated JSON texts.
        #[test]
        fn single_pass_matches_the_value_path_on_mutated_texts(
            text in arb_text(),
            edits in prop::collection::vec((any::<u8>(), any::<usize>(), any::<u8>()), 1..4),
        ) {
            let body = mutate(text.as_bytes(), &edits);
            prop_assert_eq!(single_pass(&body), canonical_json_via_value(&body), "{:?}", String::from_utf8_lossy(&body));
        }

        /// The same over arbitrary bytes, and over valid JSON values
        /// written plainly and with noise.
        #[test]
        fn single_pass_matches_the_value_path_on_bytes_and_values(
            bytes in prop::collection::vec(any::<u8>(), 0..48),
            v in arb_json(),
            noise in prop::collection::vec(any::<u8>(), 0..64),
        ) {
            prop_assert_eq!(single_pass(&bytes), canonical_json_via_value(&bytes));
            let plain = serde_json::to_vec(&v).unwrap();
            let mut noisy = String::new();
            write_noisy(&v, &mut noise.into_iter().cycle(), &mut noisy);
            for body in [&plain[..], noisy.as_bytes()] {
                let c = single_pass(body);
                prop_assert!(c.is_some());
                prop_assert_eq!(&c, &canonical_json_via_value(body));
            }
        }
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
