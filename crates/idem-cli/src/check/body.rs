//! Variants of the request body: the same JSON with its members in
//! another order or other whitespace (the same request), and another body
//! (a different request).

use serde_json::Value;

/// The object member names of a JSON text in document order (with their
/// quotes, as written), and the text without insignificant whitespace.
fn scan(text: &str) -> (Vec<String>, String) {
    let mut names = Vec::new();
    let mut compact = String::with_capacity(text.len());
    let mut in_string = false;
    let mut escaped = false;
    let mut current = String::new();
    let mut last_string: Option<String> = None;
    for c in text.chars() {
        if in_string {
            compact.push(c);
            current.push(c);
            if escaped {
                escaped = false;
            } else if c == '\\' {
                escaped = true;
            } else if c == '"' {
                in_string = false;
                last_string = Some(std::mem::take(&mut current));
            }
            continue;
        }
        match c {
            '"' => {
                in_string = true;
                current = String::from('"');
                compact.push(c);
            }
            ' ' | '\t' | '\n' | '\r' => {}
            ':' => {
                if let Some(name) = last_string.take() {
                    names.push(name);
                }
                compact.push(c);
            }
            other => {
                last_string = None;
                compact.push(other);
            }
        }
    }
    (names, compact)
}

/// `compact` (no insignificant whitespace) with a space after every `:`
/// and `,` outside strings, a leading space and a trailing newline.
fn spaced(compact: &str) -> String {
    let mut out = String::from(" ");
    let mut in_string = false;
    let mut escaped = false;
    for c in compact.chars() {
        out.push(c);
        if in_string {
            if escaped {
                escaped = false;
            } else if c == '\\' {
                escaped = true;
            } else if c == '"' {
                in_string = false;
            }
        } else if c == '"' {
            in_string = true;
        } else if c == ':' || c == ',' {
            out.push(' ');
        }
    }
    out.push('\n');
    out
}

/// `v` as compact JSON with the members of every object in ascending
/// (`descending = false`) or descending order of their names.
fn emit(v: &Value, descending: bool, out: &mut String) {
    match v {
        Value::Object(map) => {
            let mut names: Vec<&String> = map.keys().collect();
            names.sort();
            if descending {
                names.reverse();
            }
            out.push('{');
            for (i, name) in names.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&Value::String(name.clone()).to_string());
                out.push(':');
                emit(&map[name], descending, out);
            }
            out.push('}');
        }
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                emit(item, descending, out);
            }
            out.push(']');
        }
        scalar => out.push_str(&scalar.to_string()),
    }
}

/// One variant of a JSON body that means the same request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Variant {
    /// What changed ("members in another order", "other whitespace").
    pub(crate) what: &'static str,
    pub(crate) body: String,
}

/// The variants of a JSON body that a fingerprint should treat as the same
/// request: its object members in another order (when it has an object
/// with two or more members), and other whitespace. None when `text` is
/// not a JSON object or array.
pub(crate) fn same_request_variants(text: &str) -> Vec<Variant> {
    let Ok(value) = serde_json::from_str::<Value>(text) else {
        return Vec::new();
    };
    if !(value.is_object() || value.is_array()) {
        return Vec::new();
    }
    let (names, compact) = scan(text);
    let mut out = Vec::new();
    for descending in [false, true] {
        let mut body = String::new();
        emit(&value, descending, &mut body);
        if scan(&body).0 != names {
            out.push(Variant {
                what: "members in another order",
                body,
            });
            break;
        }
    }
    let body = if compact != text {
        compact.clone()
    } else {
        spaced(&compact)
    };
    out.push(Variant {
        what: "other whitespace",
        body,
    });
    out
}

/// Another body, a different request: in a JSON body the first value
/// (in name order) changed — a number plus one, a string with `-other`
/// appended, a boolean flipped; an empty object or array gets a member;
/// other bodies get `-other` appended; an empty body becomes
/// `idem-check-other`.
pub(crate) fn other_body(body: &[u8]) -> Vec<u8> {
    if let Ok(mut value) = serde_json::from_slice::<Value>(body) {
        if !change_first_leaf(&mut value) {
            match &mut value {
                Value::Object(m) => {
                    m.insert("idem_check_other".to_owned(), Value::Bool(true));
                }
                Value::Array(items) => items.push(Value::Bool(true)),
                _ => {}
            }
        }
        return value.to_string().into_bytes();
    }
    if body.is_empty() {
        return b"idem-check-other".to_vec();
    }
    let mut out = body.to_vec();
    out.extend_from_slice(b"-other");
    out
}

/// Changes the first scalar of `v`; false when it holds none.
fn change_first_leaf(v: &mut Value) -> bool {
    match v {
        Value::Object(m) => m.values_mut().any(change_first_leaf),
        Value::Array(items) => items.iter_mut().any(change_first_leaf),
        Value::Number(n) => {
            *v = if let Some(i) = n.as_i64() {
                Value::from(i.wrapping_add(1))
            } else if let Some(u) = n.as_u64() {
                Value::from(u.wrapping_add(1))
            } else {
                Value::from(n.as_f64().unwrap_or(0.0) + 1.0)
            };
            true
        }
        Value::String(s) => {
            s.push_str("-other");
            true
        }
        Value::Bool(b) => {
            *b = !*b;
            true
        }
        Value::Null => {
            *v = Value::String("other".to_owned());
            true
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn variants_reorder_members_and_change_whitespace() {
        let v = same_request_variants(r#"{"sku":"A-1","qty":1,"note":{"b":1,"a":"x:y, z"}}"#);
        assert_eq!(v.len(), 2, "{v:?}");
        assert_eq!(v[0].what, "members in another order");
        assert_eq!(
            v[0].body,
            r#"{"note":{"a":"x:y, z","b":1},"qty":1,"sku":"A-1"}"#
        );
        assert_eq!(v[1].what, "other whitespace");
        assert_eq!(
            v[1].body,
            " {\"sku\": \"A-1\", \"qty\": 1, \"note\": {\"b\": 1, \"a\": \"x:y, z\"}}\n"
        );
        // Already in ascending order: the variant is descending.
        let sorted = same_request_variants(r#"{"a":1,"b":2}"#);
        assert_eq!(sorted[0].body, r#"{"b":2,"a":1}"#);
        // A spaced body gets its compact form.
        let spaced = same_request_variants("{ \"a\": 1 }");
        assert_eq!(spaced.len(), 1, "one member: no order to change");
        assert_eq!(spaced[0].body, r#"{"a":1}"#);
        assert!(same_request_variants("not json").is_empty());
        assert!(same_request_variants("42").is_empty());
    }

    #[test]
    fn other_body_differs() {
        assert_eq!(
            other_body(br#"{"qty":1,"sku":"A"}"#),
            br#"{"qty":2,"sku":"A"}"#
        );
        assert_eq!(other_body(br#"{"sku":"A"}"#), br#"{"sku":"A-other"}"#);
        assert_eq!(other_body(b"{}"), br#"{"idem_check_other":true}"#);
        assert_eq!(other_body(b"a=1"), b"a=1-other");
        assert_eq!(other_body(b""), b"idem-check-other");
    }
}
