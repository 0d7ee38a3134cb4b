//! JSON Pointer (RFC 6901): parsing, validation and lookup, shared by the
//! key taken from a body ([`crate::body_key`]) and the fingerprint's
//! excluded and included members ([`crate::fingerprint`]).

use serde_json::Value;

/// Checks that `p` is a JSON Pointer (RFC 6901 §3): empty (the whole
/// document), or `/` followed by reference tokens separated by `/`, where
/// `~` appears only as `~0` (a `~`) or `~1` (a `/`). Any other character
/// is allowed; a token is an array index when it is `0` or a decimal
/// without leading zeros (RFC 6901 §4).
///
/// ```
/// use idem_http::body_key::validate_pointer;
/// assert!(validate_pointer("").is_ok());
/// assert!(validate_pointer("/event_id").is_ok());
/// assert!(validate_pointer("/a~1b/~0c/items/0").is_ok());
/// assert!(validate_pointer("event_id").is_err());
/// assert!(validate_pointer("/a~2").is_err());
/// assert!(validate_pointer("/a~").is_err());
/// ```
///
/// # Errors
/// Why `p` is not a JSON Pointer, as a sentence fragment.
pub fn validate_pointer(p: &str) -> Result<(), String> {
    pointer_tokens(p).map(drop)
}

/// The reference tokens of the JSON Pointer `p`, unescaped (`~1` → `/`,
/// then `~0` → `~`); `""` has none.
///
/// # Errors
/// As [`validate_pointer`].
pub(crate) fn pointer_tokens(p: &str) -> Result<Vec<String>, String> {
    if p.is_empty() {
        return Ok(Vec::new());
    }
    let Some(rest) = p.strip_prefix('/') else {
        return Err("a JSON Pointer is empty or starts with '/'".to_owned());
    };
    rest.split('/')
        .map(|token| {
            if !token.contains('~') {
                return Ok(token.to_owned());
            }
            let mut out = String::with_capacity(token.len());
            let mut chars = token.chars();
            while let Some(c) = chars.next() {
                if c != '~' {
                    out.push(c);
                    continue;
                }
                match chars.next() {
                    Some('0') => out.push('~'),
                    Some('1') => out.push('/'),
                    other => {
                        return Err(format!(
                            "'~' must be followed by '0' or '1' (found {})",
                            other.map_or_else(|| "the end".to_owned(), |c| format!("{c:?}"))
                        ))
                    }
                }
            }
            Ok(out)
        })
        .collect()
}

/// The array index a reference token names (RFC 6901 §4: `0`, or digits
/// without a leading zero); `None` for `-` (past the end) and any other
/// token.
pub(crate) fn array_index(token: &str) -> Option<usize> {
    if token.is_empty()
        || !token.bytes().all(|b| b.is_ascii_digit())
        || (token.len() > 1 && token.starts_with('0'))
    {
        return None;
    }
    token.parse().ok()
}

/// The value the reference `tokens` find in `value`, if any.
pub(crate) fn lookup<'v>(value: &'v Value, tokens: &[String]) -> Option<&'v Value> {
    tokens.iter().try_fold(value, |v, t| match v {
        Value::Object(map) => map.get(t.as_str()),
        Value::Array(items) => items.get(array_index(t)?),
        _ => None,
    })
}
