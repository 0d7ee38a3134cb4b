//! Idempotency keys and scopes.

use std::fmt;

use crate::error::KeyError;

/// The longest idempotency key accepted, in characters (= bytes, keys are ASCII).
pub const MAX_KEY_LEN: usize = 255;

/// A validated idempotency key: 1 to [`MAX_KEY_LEN`] characters in 0x20–0x7E
/// (visible ASCII and space), not all blank.
///
/// This is the loose syntax of the IETF httpapi draft "The Idempotency-Key
/// HTTP Header Field": UUIDs, ULIDs and keys starting with a digit are fine.
/// The HTTP layer strips a structured-field string's quotes before it gets here.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct IdempotencyKey(String);

impl IdempotencyKey {
    /// Validates `raw` as a key.
    ///
    /// # Errors
    /// [`KeyError::Empty`] for an empty or all-blank key, [`KeyError::TooLong`]
    /// past 255 characters, [`KeyError::InvalidChar`] for a character outside
    /// 0x20–0x7E.
    pub fn new(raw: impl Into<String>) -> Result<Self, KeyError> {
        let raw = raw.into();
        if raw.len() > MAX_KEY_LEN {
            return Err(KeyError::TooLong { len: raw.len() });
        }
        if let Some((at, ch)) = raw.char_indices().find(|&(_, c)| !(' '..='~').contains(&c)) {
            return Err(KeyError::InvalidChar { at, ch });
        }
        if raw.trim_matches(' ').is_empty() {
            return Err(KeyError::Empty);
        }
        Ok(Self(raw))
    }

    /// The key as given.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// `Debug` as `Name("value")` and `Display` as the bare value, for this
/// module's string newtypes.
macro_rules! string_newtype_fmt {
    ($($ty:ident),*) => {$(
        impl fmt::Debug for $ty {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, concat!(stringify!($ty), "({:?})"), self.0)
            }
        }

        impl fmt::Display for $ty {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }
    )*};
}

string_newtype_fmt!(IdempotencyKey, Scope);

impl std::str::FromStr for IdempotencyKey {
    type Err = KeyError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::new(s)
    }
}

/// Who a key belongs to. Two scopes never see each other's records.
///
/// The HTTP layer derives it from the caller's credentials (by default a
/// SHA-256 of the `Authorization` fields); library users pick any stable
/// string such as a tenant id. At most 255 bytes; a longer scope should be
/// hashed first ([`Scope::hashed`]).
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Scope(String);

impl Scope {
    /// The scope shared by every caller that presents no identity.
    pub const ANONYMOUS: &'static str = "anonymous";

    /// A scope with the given name.
    ///
    /// # Errors
    /// [`KeyError::ScopeTooLong`] past 255 bytes.
    pub fn new(name: impl Into<String>) -> Result<Self, KeyError> {
        let name = name.into();
        if name.len() > MAX_KEY_LEN {
            return Err(KeyError::ScopeTooLong { len: name.len() });
        }
        Ok(Self(name))
    }

    /// The anonymous scope ([`Scope::ANONYMOUS`]).
    pub fn anonymous() -> Self {
        Self(Self::ANONYMOUS.to_owned())
    }

    /// A scope named by the hex SHA-256 of `parts`, each length-prefixed so
    /// `["ab","c"]` and `["a","bc"]` differ. 64 characters.
    pub fn hashed<'a>(parts: impl IntoIterator<Item = &'a [u8]>) -> Self {
        use sha2::{Digest, Sha256};
        let mut h = Sha256::new();
        for p in parts {
            h.update((p.len() as u64).to_be_bytes());
            h.update(p);
        }
        Self(hex::encode(h.finalize()))
    }

    /// The scope's name.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_names_the_type_and_display_is_the_bare_value() {
        let k = IdempotencyKey::new("a\"b").unwrap();
        assert_eq!(format!("{k:?}"), r#"IdempotencyKey("a\"b")"#);
        assert_eq!(k.to_string(), "a\"b");
        let s = Scope::new("tenant-1").unwrap();
        assert_eq!(format!("{s:?}"), r#"Scope("tenant-1")"#);
        assert_eq!(s.to_string(), "tenant-1");
    }

    #[test]
    fn accepts_loose_syntax() {
        for k in [
            "a",
            "8e0c6a7e-1b2c-4d5e-9f00-123456789abc",
            "with space",
            "~!@#",
        ] {
            assert_eq!(IdempotencyKey::new(k).unwrap().as_str(), k);
        }
        assert!(IdempotencyKey::new("x".repeat(255)).is_ok());
    }

    #[test]
    fn rejects_bad_keys() {
        assert_eq!(IdempotencyKey::new(""), Err(KeyError::Empty));
        assert_eq!(IdempotencyKey::new("   "), Err(KeyError::Empty));
        assert_eq!(
            IdempotencyKey::new("x".repeat(256)),
            Err(KeyError::TooLong { len: 256 })
        );
        assert!(matches!(
            IdempotencyKey::new("a\tb"),
            Err(KeyError::InvalidChar { at: 1, .. })
        ));
        assert!(matches!(
            IdempotencyKey::new("é"),
            Err(KeyError::InvalidChar { at: 0, .. })
        ));
        assert!(IdempotencyKey::new("a\u{7f}").is_err());
    }

    #[test]
    fn hashed_scopes_are_length_prefixed() {
        let a = Scope::hashed([b"ab".as_slice(), b"c"]);
        let b = Scope::hashed([b"a".as_slice(), b"bc"]);
        assert_ne!(a, b);
        assert_eq!(a.as_str().len(), 64);
    }
}
