//! Parsing the `Idempotency-Key` header field.
//!
//! The IETF httpapi draft "The Idempotency-Key HTTP Header Field" defines
//! the field as an RFC 8941 Item whose value is a String (`"abc"`). Many
//! clients send a bare value (`abc`, a UUID), so both are accepted:
//!
//! - a value starting with `"` is parsed as an RFC 8941 sf-string (section
//!   4.2.5): printable ASCII, the only escapes `\"` and `\\`, then optional
//!   RFC 8941 parameters, which are checked and ignored;
//! - any other value is the key as it stands (the loose syntax).
//!
//! Either way the key must be 1–255 characters of 0x20–0x7E, not all blank
//! ([`IdempotencyKey::new`]). Optional whitespace (SP, HTAB) around the field
//! value is not part of it (RFC 9110, section 5.5); for the same reason a
//! quoted key may not start or end with a space (`" abc"`): forwarded bare
//! ([`key_header_value`]), the space would be lost and two keys would reach
//! the upstream as one.
//!
//! A character outside 0x20–0x7E is named as the character it is (UTF-8
//! decoded: `'é' at byte 2`), or as a byte (`0xFF`) when the bytes are not
//! UTF-8.

use http::{HeaderMap, HeaderName, HeaderValue};
use idem_core::{IdempotencyKey, KeyError};

/// `Idempotency-Key` (IETF httpapi draft).
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// `Idempotent-Replayed`: `true` on every replayed response, never on a
/// first execution.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// `Idempotency-Status: unprotected`: marks an answer given without
/// idempotency protection, by fail-open ([`crate::Options::fail_open`]).
pub const IDEMPOTENCY_STATUS: HeaderName = HeaderName::from_static("idempotency-status");

/// Why an `Idempotency-Key` header was refused (the layer answers 400).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyHeaderError {
    /// The request carries more than one `Idempotency-Key` field.
    #[error("the request has {count} Idempotency-Key fields; send exactly one")]
    Multiple {
        /// How many fields.
        count: usize,
    },
    /// The value starts with `"` but is not a valid RFC 8941 sf-string item.
    #[error("Idempotency-Key is not a valid structured-field string: {reason}")]
    BadString {
        /// What is wrong.
        reason: &'static str,
    },
    /// The key itself is not valid (empty, blank, too long, or a
    /// character outside 0x20–0x7E).
    #[error("invalid Idempotency-Key: {0}")]
    Invalid(#[from] KeyError),
    /// The value holds a byte that does not start a UTF-8 character (so it
    /// cannot be named as one).
    #[error("invalid Idempotency-Key: byte 0x{byte:02X} at byte {at} is not UTF-8; only 0x20-0x7E are allowed")]
    InvalidByte {
        /// Byte offset in the field value (surrounding whitespace removed).
        at: usize,
        /// The byte.
        byte: u8,
    },
}

/// The one form in which a key is handed on (to the inner service, and by
/// the gateway to the upstream): the bare key, `abc` for each of `"abc"`,
/// `abc` and `"abc";p=1`. `None` never happens for a key from
/// [`parse_key`] (0x20–0x7E, no space at either end).
///
/// ```
/// use idem_http::key::{key_header_value, parse_key};
/// for sent in [&b"\"abc\""[..], b"abc", b"\"abc\";p=1"] {
///     assert_eq!(key_header_value(&parse_key(sent).unwrap()).unwrap(), "abc");
/// }
/// ```
pub fn key_header_value(key: &IdempotencyKey) -> Option<HeaderValue> {
    HeaderValue::from_str(key.as_str()).ok()
}

/// The key of a request: `Ok(None)` without an `Idempotency-Key` field,
/// `Ok(Some(key))` with exactly one valid field.
///
/// ```
/// use http::HeaderMap;
/// use idem_http::key::key_from_headers;
/// let mut h = HeaderMap::new();
/// assert_eq!(key_from_headers(&h), Ok(None));
/// h.insert("idempotency-key", "\"8e0c-\\\"q\\\"\"".parse().unwrap());
/// assert_eq!(key_from_headers(&h).unwrap().unwrap().as_str(), "8e0c-\"q\"");
/// h.append("idempotency-key", "other".parse().unwrap());
/// assert!(key_from_headers(&h).is_err());
/// ```
///
/// # Errors
/// [`KeyHeaderError::Multiple`] for two or more fields; otherwise the errors
/// of [`parse_key`].
pub fn key_from_headers(headers: &HeaderMap) -> Result<Option<IdempotencyKey>, KeyHeaderError> {
    key_from_header(headers, &IDEMPOTENCY_KEY)
}

/// The key of a request from the header `name`, parsed as the
/// `Idempotency-Key` field ([`key_from_headers`]); for routes whose key
/// comes in another header ([`crate::KeySource::Header`]).
///
/// # Errors
/// As [`key_from_headers`].
pub fn key_from_header(
    headers: &HeaderMap,
    name: &http::HeaderName,
) -> Result<Option<IdempotencyKey>, KeyHeaderError> {
    let mut values = headers.get_all(name).iter();
    let Some(first) = values.next() else {
        return Ok(None);
    };
    let more = values.count();
    if more > 0 {
        return Err(KeyHeaderError::Multiple { count: more + 1 });
    }
    parse_key(first.as_bytes()).map(Some)
}

/// Parses one `Idempotency-Key` field value: an RFC 8941 sf-string
/// (`"abc"`, escapes `\"` and `\\` only, parameters allowed and ignored) or
/// a bare value (`abc`). Both name the key `abc`.
///
/// ```
/// use idem_http::key::parse_key;
/// assert_eq!(parse_key(b"\"abc\"").unwrap().as_str(), "abc");
/// assert_eq!(parse_key(b"abc").unwrap().as_str(), "abc");
/// assert!(parse_key(b"\"\"").is_err());
/// assert!(parse_key(b"\"abc").is_err());
/// ```
///
/// # Errors
/// [`KeyHeaderError::BadString`] for a malformed sf-string (or one whose
/// string starts or ends with a space),
/// [`KeyHeaderError::Invalid`] for an empty, blank or too long key or one
/// with a character outside 0x20–0x7E, [`KeyHeaderError::InvalidByte`]
/// for a byte that is not UTF-8.
pub fn parse_key(value: &[u8]) -> Result<IdempotencyKey, KeyHeaderError> {
    let value = trim_ows(value);
    let raw = if value.first() == Some(&b'"') {
        parse_sf_string_item(value)?
    } else {
        ascii_string(value)?
    };
    Ok(IdempotencyKey::new(raw)?)
}

fn trim_ows(mut v: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = v {
        v = rest;
    }
    while let [rest @ .., b' ' | b'\t'] = v {
        v = rest;
    }
    v
}

/// The bytes as a String when they are all 0x20–0x7E; the first bad
/// character otherwise ([`invalid_at`]).
fn ascii_string(v: &[u8]) -> Result<String, KeyHeaderError> {
    if let Some(at) = v.iter().position(|b| !(0x20..=0x7e).contains(b)) {
        return Err(invalid_at(v, at));
    }
    Ok(v.iter().map(|&b| char::from(b)).collect())
}

/// The error for the bad byte at `at`: the UTF-8 character that starts
/// there ([`KeyError::InvalidChar`]), or the byte itself when none does
/// ([`KeyHeaderError::InvalidByte`]).
fn invalid_at(v: &[u8], at: usize) -> KeyHeaderError {
    let ch = v[at..]
        .utf8_chunks()
        .next()
        .and_then(|chunk| chunk.valid().chars().next());
    match ch {
        Some(ch) => KeyError::InvalidChar { at, ch }.into(),
        None => KeyHeaderError::InvalidByte { at, byte: v[at] },
    }
}

fn bad(reason: &'static str) -> KeyHeaderError {
    KeyHeaderError::BadString { reason }
}

/// RFC 8941 section 4.2.3 (an Item) restricted to a String bare item:
/// sf-string, then parameters, then nothing.
fn parse_sf_string_item(v: &[u8]) -> Result<String, KeyHeaderError> {
    let (s, rest) = parse_sf_string(v)?;
    let rest = parse_parameters(rest)?;
    if !rest.is_empty() {
        return Err(bad("unexpected characters after the string"));
    }
    if s.trim_matches(' ').len() != s.len() && !s.trim_matches(' ').is_empty() {
        return Err(bad(
            "the string starts or ends with a space, which would be lost when the key is forwarded",
        ));
    }
    Ok(s)
}

/// RFC 8941 section 4.2.5. `v` starts with `"`; returns the string and the rest.
fn parse_sf_string(v: &[u8]) -> Result<(String, &[u8]), KeyHeaderError> {
    let mut out = String::new();
    let mut i = 1;
    loop {
        let Some(&c) = v.get(i) else {
            return Err(bad("missing closing quote"));
        };
        i += 1;
        match c {
            b'\\' => match v.get(i) {
                Some(&n @ (b'"' | b'\\')) => {
                    out.push(char::from(n));
                    i += 1;
                }
                Some(_) => return Err(bad("only \\\" and \\\\ escapes are allowed")),
                None => return Err(bad("missing closing quote")),
            },
            b'"' => return Ok((out, &v[i..])),
            0x20..=0x7e => out.push(char::from(c)),
            _ => return Err(invalid_at(v, i - 1)),
        }
    }
}

/// RFC 8941 section 4.2.3.2: `*( ";" *SP key [ "=" bare-item ] )`.
/// Returns what follows the parameters.
fn parse_parameters(mut v: &[u8]) -> Result<&[u8], KeyHeaderError> {
    while let [b';', rest @ ..] = v {
        v = rest;
        while let [b' ', rest @ ..] = v {
            v = rest;
        }
        v = parse_param_key(v)?;
        if let [b'=', rest @ ..] = v {
            v = parse_bare_item(rest)?;
        }
    }
    Ok(v)
}

/// RFC 8941 section 4.2.3.3: `( lcalpha / "*" ) *( lcalpha / DIGIT / "_" / "-" / "." / "*" )`.
fn parse_param_key(v: &[u8]) -> Result<&[u8], KeyHeaderError> {
    match v.first() {
        Some(b'a'..=b'z' | b'*') => {}
        _ => return Err(bad("a parameter name must start with a-z or *")),
    }
    let n = v
        .iter()
        .position(|c| !matches!(c, b'a'..=b'z' | b'0'..=b'9' | b'_' | b'-' | b'.' | b'*'))
        .unwrap_or(v.len());
    Ok(&v[n..])
}

fn is_tchar(c: u8) -> bool {
    c.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&c)
}

/// RFC 8941 section 4.2.3.1, for a parameter value. Returns the rest.
fn parse_bare_item(v: &[u8]) -> Result<&[u8], KeyHeaderError> {
    match v.first() {
        Some(b'-' | b'0'..=b'9') => parse_number(v),
        Some(b'"') => parse_sf_string(v).map(|(_, rest)| rest),
        Some(b':') => {
            let body = &v[1..];
            let n = body
                .iter()
                .position(|c| !(c.is_ascii_alphanumeric() || b"+/=".contains(c)))
                .unwrap_or(body.len());
            match body.get(n) {
                Some(b':') => Ok(&body[n + 1..]),
                _ => Err(bad("unterminated byte sequence parameter")),
            }
        }
        Some(b'?') => match v.get(1) {
            Some(b'0' | b'1') => Ok(&v[2..]),
            _ => Err(bad("a boolean parameter must be ?0 or ?1")),
        },
        Some(c) if c.is_ascii_alphabetic() || *c == b'*' => {
            let n = v[1..]
                .iter()
                .position(|&c| !(is_tchar(c) || c == b':' || c == b'/'))
                .map_or(v.len(), |p| p + 1);
            Ok(&v[n..])
        }
        _ => Err(bad("a parameter value is not a valid bare item")),
    }
}

/// RFC 8941 section 4.2.4: integers of up to 15 digits, decimals of up to
/// 12 integer and 1–3 fraction digits.
fn parse_number(v: &[u8]) -> Result<&[u8], KeyHeaderError> {
    let mut i = usize::from(v.first() == Some(&b'-'));
    let start = i;
    while v.get(i).is_some_and(u8::is_ascii_digit) {
        i += 1;
    }
    let int_digits = i - start;
    if int_digits == 0 {
        return Err(bad("a number parameter has no digits"));
    }
    if v.get(i) != Some(&b'.') {
        return if int_digits <= 15 {
            Ok(&v[i..])
        } else {
            Err(bad("an integer parameter has more than 15 digits"))
        };
    }
    i += 1;
    let frac_start = i;
    while v.get(i).is_some_and(u8::is_ascii_digit) {
        i += 1;
    }
    let frac_digits = i - frac_start;
    if int_digits > 12 || !(1..=3).contains(&frac_digits) {
        return Err(bad("a decimal parameter is out of range"));
    }
    Ok(&v[i..])
}

/// Where a route's idempotency key comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeySource {
    /// A request header (default `Idempotency-Key`), parsed as the
    /// `Idempotency-Key` field is (IETF httpapi draft: an RFC 8941
    /// sf-string or a bare token of 1 to 255 characters).
    Header(HeaderName),
    /// A member of the JSON request body, by JSON Pointer (RFC 6901), e.g.
    /// `/event_id` for `{"event_id": "evt_1"}`: a string (the key as it is)
    /// or an integer (its decimal digits). The body is read first (up to
    /// the route's `max_body`). A body without it is passed through, or
    /// refused with 400 `key-required` when the route requires a key.
    JsonPointer(String),
}

impl Default for KeySource {
    /// The `Idempotency-Key` header.
    fn default() -> Self {
        Self::Header(IDEMPOTENCY_KEY)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn key(v: &[u8]) -> Result<String, KeyHeaderError> {
        parse_key(v).map(|k| k.as_str().to_owned())
    }

    #[test]
    fn sf_string_and_bare_token_name_the_same_key() {
        assert_eq!(key(b"\"abc\"").unwrap(), "abc");
        assert_eq!(key(b"abc").unwrap(), "abc");
        assert_eq!(key(b"  \"abc\"\t").unwrap(), "abc");
        assert_eq!(key(b" abc ").unwrap(), "abc");
    }

    #[test]
    fn loose_bare_values() {
        for k in [
            "8e0c6a7e-1b2c-4d5e-9f00-123456789abc",
            "123",
            "with space",
            "a,b",
            "~!@#$%^&*()",
            "ab\"c",
        ] {
            assert_eq!(key(k.as_bytes()).unwrap(), k);
        }
        assert_eq!(key("x".repeat(255).as_bytes()).unwrap().len(), 255);
    }

    #[test]
    fn escapes() {
        assert_eq!(key(br#""a\"b""#).unwrap(), "a\"b");
        assert_eq!(key(br#""a\\b""#).unwrap(), "a\\b");
        assert_eq!(key(br#""\\\"""#).unwrap(), "\\\"");
        assert!(matches!(
            key(br#""a\nb""#),
            Err(KeyHeaderError::BadString { .. })
        ));
        assert!(matches!(
            key(br#""a\"#),
            Err(KeyHeaderError::BadString { .. })
        ));
    }

    #[test]
    fn parameters_are_allowed_and_ignored() {
        assert_eq!(key(b"\"abc\";a=1").unwrap(), "abc");
        assert_eq!(
            key(b"\"abc\"; a=1;b;*c=?0;d=\"x\";e=tok/en:1;f=:aGk=:;g=-1.5").unwrap(),
            "abc"
        );
        for bad_params in [
            &b"\"abc\";"[..],
            b"\"abc\";A=1",
            b"\"abc\";a=",
            b"\"abc\";a=?2",
            b"\"abc\";a=1234567890123456",
            b"\"abc\";a=1.2345",
            b"\"abc\";a=:aGk",
            b"\"abc\" ;a=1",
        ] {
            assert!(
                matches!(key(bad_params), Err(KeyHeaderError::BadString { .. })),
                "{:?}",
                String::from_utf8_lossy(bad_params)
            );
        }
    }

    #[test]
    fn bad_values_are_rejected() {
        for v in [
            &b""[..],
            b"   ",
            b"\"\"",
            b"\"   \"",
            b"\"abc",
            b"\"abc\"x",
            b"\"abc\" \"def\"",
            b"\"abc\", \"def\"",
            b"\"a\tb\"",
            b"\"\xc3\xa9\"",
            b"\xc3\xa9",
            b"a\x7fb",
            b"a\tb",
        ] {
            assert!(
                key(v).is_err(),
                "{:?} should be rejected",
                String::from_utf8_lossy(v)
            );
        }
        assert_eq!(key(b""), Err(KeyHeaderError::Invalid(KeyError::Empty)));
        assert_eq!(
            key(b"\"  \""),
            Err(KeyHeaderError::Invalid(KeyError::Empty))
        );
        assert_eq!(
            key("x".repeat(256).as_bytes()),
            Err(KeyHeaderError::Invalid(KeyError::TooLong { len: 256 }))
        );
        let quoted = format!("\"{}\"", "x".repeat(256));
        assert!(matches!(
            key(quoted.as_bytes()),
            Err(KeyHeaderError::Invalid(KeyError::TooLong { .. }))
        ));
    }

    #[test]
    fn bad_characters_are_named_as_they_are() {
        assert_eq!(
            key("ab\u{e9}".as_bytes()),
            Err(KeyHeaderError::Invalid(KeyError::InvalidChar {
                at: 2,
                ch: '\u{e9}'
            }))
        );
        assert_eq!(
            key("\"ab\u{e9}\"".as_bytes()),
            Err(KeyHeaderError::Invalid(KeyError::InvalidChar {
                at: 3,
                ch: '\u{e9}'
            }))
        );
        let e = key("pay-\u{e9}t\u{e9}".as_bytes()).unwrap_err().to_string();
        assert!(e.contains("'\u{e9}' at byte 4"), "{e}");
        assert!(!e.contains('\u{c3}'), "{e}");
        assert_eq!(
            key(b"ab\xff"),
            Err(KeyHeaderError::InvalidByte { at: 2, byte: 0xff })
        );
        assert!(key(b"ab\xff").unwrap_err().to_string().contains("0xFF"));
        assert_eq!(
            key(b"a\x7fb"),
            Err(KeyHeaderError::Invalid(KeyError::InvalidChar {
                at: 1,
                ch: '\u{7f}'
            }))
        );
    }

    #[test]
    fn quoted_keys_with_outer_spaces_are_refused() {
        for v in [&b"\" abc\""[..], b"\"abc \"", b"\" abc \";p=1"] {
            assert!(
                matches!(key(v), Err(KeyHeaderError::BadString { .. })),
                "{v:?}"
            );
        }
        assert_eq!(key(b"\"a b\"").unwrap(), "a b");
        assert_eq!(key(b"a b").unwrap(), "a b");
    }

    #[test]
    fn two_fields_are_rejected() {
        let mut h = HeaderMap::new();
        h.append(&IDEMPOTENCY_KEY, HeaderValue::from_static("a"));
        h.append(&IDEMPOTENCY_KEY, HeaderValue::from_static("a"));
        assert_eq!(
            key_from_headers(&h),
            Err(KeyHeaderError::Multiple { count: 2 })
        );
        let mut one = HeaderMap::new();
        one.insert(&IDEMPOTENCY_KEY, HeaderValue::from_static("\"a\""));
        assert_eq!(key_from_headers(&one).unwrap().unwrap().as_str(), "a");
        assert_eq!(key_from_headers(&HeaderMap::new()), Ok(None));
    }
}
