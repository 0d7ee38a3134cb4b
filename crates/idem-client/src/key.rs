//! Idempotency keys: fresh ones, caller-supplied ones, and how they are
//! written into the header.

use std::fmt;

use http::HeaderValue;

/// Longest key accepted, in bytes (the gateway's limit, and the common
/// one: Stripe's keys are at most 255 characters).
pub const MAX_KEY_LEN: usize = 255;

/// The idempotency key of a logical request.
///
/// As a **request extension** it is the key to use (instead of a fresh
/// one), e.g. one stored with a job so a worker restarted after a crash
/// sends the same key again. As a **response extension** it is the key
/// that was used, so a caller that loses the response body can resend
/// the same request with it.
///
/// Keys follow the IETF httpapi draft "The Idempotency-Key HTTP Header
/// Field": 1 to [`MAX_KEY_LEN`] (255) bytes of visible ASCII or space
/// (0x20–0x7E), not all spaces. Build one with [`IdempotencyKey::new`]
/// (checked) or [`IdempotencyKey::generate`] (a UUID v4).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct IdempotencyKey(String);

/// Why a key was refused ([`IdempotencyKey::new`]).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum InvalidKey {
    /// The key is empty or only spaces.
    #[error("the key is empty or blank")]
    Blank,
    /// The key is longer than [`MAX_KEY_LEN`] bytes.
    #[error("the key is {len} bytes long, more than {MAX_KEY_LEN}")]
    TooLong {
        /// The key's length in bytes.
        len: usize,
    },
    /// The key holds a character outside 0x20–0x7E.
    #[error("{ch:?} at byte {at} is not visible ASCII or a space")]
    Character {
        /// The character.
        ch: char,
        /// Its byte offset in the key.
        at: usize,
    },
    /// The request carries more than one key header field.
    #[error("the request has {count} `{header}` fields; send one")]
    Multiple {
        /// The header's name.
        header: String,
        /// How many fields it has.
        count: usize,
    },
    /// The request's key header is not visible ASCII.
    #[error("the request's `{header}` field is not visible ASCII")]
    Header {
        /// The header's name.
        header: String,
    },
}

impl IdempotencyKey {
    /// A checked key.
    ///
    /// # Errors
    /// [`InvalidKey::Blank`], [`InvalidKey::TooLong`] or
    /// [`InvalidKey::Character`] when `key` breaks the rules above.
    pub fn new(key: impl Into<String>) -> Result<Self, InvalidKey> {
        let key = key.into();
        if key.len() > MAX_KEY_LEN {
            return Err(InvalidKey::TooLong { len: key.len() });
        }
        if let Some((at, ch)) = key.char_indices().find(|(_, c)| !(' '..='~').contains(c)) {
            return Err(InvalidKey::Character { ch, at });
        }
        if key.bytes().all(|b| b == b' ') {
            return Err(InvalidKey::Blank);
        }
        Ok(Self(key))
    }

    /// A fresh random key: a UUID version 4 (RFC 9562 §5.4) in its
    /// lower-case hyphenated form, 122 random bits from the thread's
    /// CSPRNG (`rand::thread_rng`).
    pub fn generate() -> Self {
        let mut b: [u8; 16] = rand::random();
        b[6] = (b[6] & 0x0f) | 0x40; // version 4
        b[8] = (b[8] & 0x3f) | 0x80; // variant 10xx (RFC 9562)
        let hex: String = b.iter().map(|x| format!("{x:02x}")).collect();
        Self(format!(
            "{}-{}-{}-{}-{}",
            &hex[0..8],
            &hex[8..12],
            &hex[12..16],
            &hex[16..20],
            &hex[20..32]
        ))
    }

    /// The key.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The field value: the bare key, or with `quoted` an RFC 8941
    /// sf-string (`"key"`, `"` and `\` escaped), the draft's syntax.
    pub(crate) fn header_value(&self, quoted: bool) -> HeaderValue {
        let text = if quoted {
            let mut s = String::with_capacity(self.0.len() + 2);
            s.push('"');
            for c in self.0.chars() {
                if c == '"' || c == '\\' {
                    s.push('\\');
                }
                s.push(c);
            }
            s.push('"');
            s
        } else {
            self.0.clone()
        };
        // Checked in `new`/`generate`: visible ASCII and spaces only.
        HeaderValue::from_str(&text).unwrap_or_else(|_| HeaderValue::from_static("invalid"))
    }
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_keys_are_uuid_v4() {
        let a = IdempotencyKey::generate();
        let b = IdempotencyKey::generate();
        assert_ne!(a, b);
        let s = a.as_str();
        assert_eq!(s.len(), 36);
        let groups: Vec<_> = s.split('-').map(str::len).collect();
        assert_eq!(groups, [8, 4, 4, 4, 12]);
        assert_eq!(&s[14..15], "4", "{s}");
        assert!("89ab".contains(&s[19..20]), "{s}");
        assert!(s
            .bytes()
            .all(|c| c == b'-' || c.is_ascii_hexdigit() && !c.is_ascii_uppercase()));
        assert_eq!(IdempotencyKey::new(s).unwrap(), a);
    }

    #[test]
    fn checked_keys() {
        assert!(IdempotencyKey::new("order-7f3a").is_ok());
        assert!(IdempotencyKey::new("a b").is_ok());
        assert_eq!(IdempotencyKey::new(""), Err(InvalidKey::Blank));
        assert_eq!(IdempotencyKey::new("   "), Err(InvalidKey::Blank));
        assert_eq!(
            IdempotencyKey::new("x".repeat(256)),
            Err(InvalidKey::TooLong { len: 256 })
        );
        assert!(IdempotencyKey::new("x".repeat(255)).is_ok());
        assert_eq!(
            IdempotencyKey::new("abé"),
            Err(InvalidKey::Character { ch: 'é', at: 2 })
        );
        assert_eq!(
            IdempotencyKey::new("a\tb"),
            Err(InvalidKey::Character { ch: '\t', at: 1 })
        );
    }

    #[test]
    fn header_values() {
        let k = IdempotencyKey::new(r#"a"b\c"#).unwrap();
        assert_eq!(k.header_value(false), r#"a"b\c"#);
        assert_eq!(k.header_value(true), r#""a\"b\\c""#);
    }
}
