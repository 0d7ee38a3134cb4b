//! Idempotency keys taken from the JSON request body, by JSON Pointer
//! (RFC 6901): for senders that put the event's identity in the payload
//! (webhooks: `{"event_id": "evt_1", …}`) instead of a header.
//!
//! The body is parsed as strictly as the fingerprint parses it
//! ([`crate::fingerprint`]): an object with a duplicate member name
//! anywhere, a lone surrogate, nesting 128 levels deep or more or malformed JSON is
//! [`BodyKeyError::NotJson`], so no two readers of one body can find two
//! different keys in it. The member must be a string (a valid
//! [`IdempotencyKey`]) or an integer of magnitude below 2^53 (the key is its
//! decimal text: `{"id": 42}` and `{"id": "42"}` give one key); numbers
//! elsewhere in the body are not checked.

use idem_core::IdempotencyKey;
use serde_json::Value;

/// 2^53: integers from here on are not exact in a double, so two JSON
/// readers may disagree on them.
const EXACT_LIMIT: u64 = 1 << 53;

/// Why a key could not be taken from the body.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BodyKeyError {
    /// The body is not JSON (or not I-JSON: a duplicate member name, a
    /// lone surrogate, nesting 128 levels deep or more).
    #[error("the request body is not JSON")]
    NotJson,
    /// The member is there but is not a string or an integer (a float, a
    /// boolean, `null`, an object, an array, or an integer of magnitude
    /// 2^53 or more).
    #[error("the member at {pointer:?} is not a string or an integer")]
    NotAKey {
        /// The pointer.
        pointer: String,
    },
    /// The member's value is not a valid key (1 to 255 characters of
    /// 0x20-0x7E, not all blank).
    #[error("the member at {pointer:?} is not a valid idempotency key: {reason}")]
    Invalid {
        /// The pointer.
        pointer: String,
        /// Why.
        reason: String,
    },
    /// The pointer itself is not a JSON Pointer ([`validate_pointer`]); a
    /// configuration error, refused before any request when the routes are
    /// validated.
    #[error("{pointer:?} is not a JSON Pointer (RFC 6901): {reason}")]
    Pointer {
        /// The pointer.
        pointer: String,
        /// Why.
        reason: String,
    },
}

/// The key at `pointer` (RFC 6901) in the JSON `body`: `Ok(None)` when the
/// body is JSON but has no member there, or is empty (nothing but JSON
/// whitespace). A string member is the key as written (validated by
/// [`IdempotencyKey::new`]); an integer member of magnitude below 2^53 is
/// its decimal text (`-0`, `1.0` and `1e3` are not integers).
///
/// ```
/// use idem_http::body_key::{key_from_json, BodyKeyError};
/// let k = key_from_json(br#"{"event_id":"evt_1","n":2}"#, "/event_id").unwrap().unwrap();
/// assert_eq!(k.as_str(), "evt_1");
/// assert_eq!(key_from_json(br#"{"n":2}"#, "/event_id").unwrap(), None);
/// assert_eq!(key_from_json(br#"{"data":{"id":42}}"#, "/data/id").unwrap().unwrap().as_str(), "42");
/// assert_eq!(
///     key_from_json(br#"{"event_id":"a","event_id":"b"}"#, "/event_id"),
///     Err(BodyKeyError::NotJson)
/// );
/// ```
///
/// # Errors
/// [`BodyKeyError`]: `NotJson` (malformed or not I-JSON), `NotAKey` (the
/// member is not a string or an exact integer), `Invalid` (a string that is
/// not a valid key), `Pointer` (`pointer` is not RFC 6901).
pub fn key_from_json(body: &[u8], pointer: &str) -> Result<Option<IdempotencyKey>, BodyKeyError> {
    let tokens = pointer_tokens(pointer).map_err(|reason| BodyKeyError::Pointer {
        pointer: pointer.to_owned(),
        reason,
    })?;
    if body
        .iter()
        .all(|b| matches!(b, b' ' | b'\t' | b'\n' | b'\r'))
    {
        return Ok(None);
    }
    let value = crate::fingerprint::strict_structure(body).map_err(|_| BodyKeyError::NotJson)?;
    let not_a_key = || BodyKeyError::NotAKey {
        pointer: pointer.to_owned(),
    };
    let text = match lookup(&value, &tokens) {
        None => return Ok(None),
        Some(Value::String(s)) => s.clone(),
        Some(Value::Number(n)) => {
            let exact = n
                .as_i64()
                .filter(|i| i.unsigned_abs() < EXACT_LIMIT)
                .ok_or_else(not_a_key)?;
            exact.to_string()
        }
        Some(_) => return Err(not_a_key()),
    };
    IdempotencyKey::new(text)
        .map(Some)
        .map_err(|e| BodyKeyError::Invalid {
            pointer: pointer.to_owned(),
            reason: e.to_string(),
        })
}

pub use crate::json_pointer::validate_pointer;
use crate::json_pointer::{lookup, pointer_tokens};

#[cfg(test)]
mod tests {
    use super::*;
    use crate::json_pointer::array_index;

    fn key(body: &str, pointer: &str) -> Result<Option<String>, BodyKeyError> {
        key_from_json(body.as_bytes(), pointer).map(|k| k.map(|k| k.as_str().to_owned()))
    }

    fn some(s: &str) -> Result<Option<String>, BodyKeyError> {
        Ok(Some(s.to_owned()))
    }

    fn not_a_key(pointer: &str) -> Result<Option<String>, BodyKeyError> {
        Err(BodyKeyError::NotAKey {
            pointer: pointer.to_owned(),
        })
    }

    #[test]
    fn strings_and_integers_are_keys() {
        assert_eq!(key(r#"{"event_id":"evt_1"}"#, "/event_id"), some("evt_1"));
        assert_eq!(key(r#"{"event_id":42}"#, "/event_id"), some("42"));
        assert_eq!(key(r#"{"event_id":-42}"#, "/event_id"), some("-42"));
        assert_eq!(key(r#"{"event_id":0}"#, "/event_id"), some("0"));
        assert_eq!(
            key(r#"{"n":9007199254740991}"#, "/n"),
            some("9007199254740991")
        );
        assert_eq!(
            key(r#"{"n":-9007199254740991}"#, "/n"),
            some("-9007199254740991")
        );
        assert_eq!(key(r#""evt_9""#, ""), some("evt_9"));
        assert_eq!(key(r#"{"k":" a b "}"#, "/k"), some(" a b "));
    }

    #[test]
    fn other_values_are_not_keys() {
        for v in [
            "1.0",
            "1e3",
            "1.5",
            "-0",
            "true",
            "null",
            "{}",
            r#"{"id":"x"}"#,
            "[]",
            r#"["x"]"#,
            "9007199254740992",
            "-9007199254740992",
            "18446744073709551616",
        ] {
            assert_eq!(
                key(&format!(r#"{{"k":{v}}}"#), "/k"),
                not_a_key("/k"),
                "{v}"
            );
        }
    }

    #[test]
    fn invalid_strings_are_invalid_keys() {
        for s in ["", "   ", "caf\u{e9}", "a\\nb", &"x".repeat(256)] {
            let body = format!(r#"{{"k":"{s}"}}"#);
            assert!(
                matches!(key(&body, "/k"), Err(BodyKeyError::Invalid { ref pointer, .. }) if pointer == "/k"),
                "{body}: {:?}",
                key(&body, "/k")
            );
        }
        assert_eq!(
            key(&format!(r#"{{"k":"{}"}}"#, "x".repeat(255)), "/k")
                .unwrap()
                .unwrap()
                .len(),
            255
        );
    }

    #[test]
    fn missing_members_and_empty_bodies_are_none() {
        assert_eq!(key(r#"{"n":2}"#, "/event_id"), Ok(None));
        assert_eq!(key(r#"{"a":{"b":1}}"#, "/a/c"), Ok(None));
        assert_eq!(key(r#"{"a":"x"}"#, "/a/b"), Ok(None), "through a string");
        assert_eq!(key(r#"{"a":[1]}"#, "/a/1"), Ok(None));
        assert_eq!(key(r#"{"a":[1]}"#, "/a/-"), Ok(None));
        assert_eq!(key(r#"{"a":[1]}"#, "/a/00"), Ok(None), "leading zero");
        assert_eq!(key(r#"[1]"#, "/x"), Ok(None));
        assert_eq!(key("", "/event_id"), Ok(None));
        assert_eq!(key(" \r\n\t", "/event_id"), Ok(None));
        assert_eq!(key("null", "/event_id"), Ok(None));
    }

    #[test]
    fn strict_parsing() {
        // Two readers, two keys: refused, wherever the duplicate is.
        assert_eq!(
            key(r#"{"event_id":"a","event_id":"b"}"#, "/event_id"),
            Err(BodyKeyError::NotJson)
        );
        assert_eq!(
            key(r#"{"event_id":"a","x":{"y":1,"y":2}}"#, "/event_id"),
            Err(BodyKeyError::NotJson)
        );
        for body in [
            "{",
            "x",
            r#"{"a":1} x"#,
            r#"{"k":"\ud800"}"#,
            r#"{"$serde_json::private::RawValue":1}"#,
        ] {
            assert_eq!(key(body, "/k"), Err(BodyKeyError::NotJson), "{body}");
        }
        let deep = format!(r#"{}{{"k":"a"}}{}"#, "[".repeat(200), "]".repeat(200));
        assert_eq!(key(&deep, "/k"), Err(BodyKeyError::NotJson));
        // Numbers elsewhere are not the key's business.
        assert_eq!(
            key(
                r#"{"k":"a","big":18446744073709551617,"p":0.1000000000000000001}"#,
                "/k"
            ),
            some("a")
        );
    }

    #[test]
    fn pointer_escapes_and_array_indexes() {
        let body = r#"{"a/b":"slash","a~b":"tilde","~1":"lit","items":[{"id":"i0"},{"id":7}],"":{"":"empty"}}"#;
        assert_eq!(key(body, "/a~1b"), some("slash"));
        assert_eq!(key(body, "/a~0b"), some("tilde"));
        assert_eq!(key(body, "/~01"), some("lit"), "~0 then 1, not ~1");
        assert_eq!(key(body, "/items/0/id"), some("i0"));
        assert_eq!(key(body, "/items/1/id"), some("7"));
        assert_eq!(key(body, "/items/2/id"), Ok(None));
        assert_eq!(key(body, "//"), some("empty"));
        assert_eq!(key(body, "/a/b"), Ok(None));
        assert_eq!(
            key(r#"{"0":"zero"}"#, "/0"),
            some("zero"),
            "an index names a member too"
        );
        assert_eq!(key(r#"{"é":"accent"}"#, "/é"), some("accent"));
    }

    #[test]
    fn bad_pointers_are_errors() {
        for p in ["event_id", "/a~", "/a~2", "/~x", "#/a"] {
            assert!(validate_pointer(p).is_err(), "{p}");
            assert!(
                matches!(key(r#"{"a":"x"}"#, p), Err(BodyKeyError::Pointer { ref pointer, .. }) if pointer == p),
                "{p}"
            );
        }
        for p in ["", "/", "/a", "/a/0", "/~0~1", "/a b", "/%25"] {
            assert!(validate_pointer(p).is_ok(), "{p}");
        }
        assert_eq!(
            pointer_tokens("/a~1b/~0/x~01/").unwrap(),
            ["a/b", "~", "x~1", ""]
        );
        assert_eq!(pointer_tokens("").unwrap(), Vec::<String>::new());
    }

    #[test]
    fn array_indexes_follow_rfc_6901() {
        assert_eq!(array_index("0"), Some(0));
        assert_eq!(array_index("10"), Some(10));
        for t in [
            "",
            "-",
            "01",
            "+1",
            "-1",
            "1a",
            " 1",
            "99999999999999999999999",
        ] {
            assert_eq!(array_index(t), None, "{t:?}");
        }
    }

    #[test]
    fn a_one_mib_body() {
        let mut body = String::from(r#"{"items":["#);
        let mut i = 0;
        while body.len() < 1 << 20 {
            if i > 0 {
                body.push(',');
            }
            body.push_str(&format!(r#"{{"sku":"SKU-{i:08}","qty":{}}}"#, i % 9));
            i += 1;
        }
        body.push_str(r#"],"event_id":"evt_big"}"#);
        assert!(body.len() > 1 << 20);
        assert_eq!(key(&body, "/event_id"), some("evt_big"));
        assert_eq!(key(&body, "/items/1000/sku"), some("SKU-00001000"));
        // A duplicate at the very end is still found.
        let dup = format!("{}{}", &body[..body.len() - 1], r#","event_id":"evt_2"}"#);
        assert_eq!(key(&dup, "/event_id"), Err(BodyKeyError::NotJson));
    }
}
