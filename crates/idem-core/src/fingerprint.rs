//! Request fingerprints: a SHA-256 over the parts that make two requests "the same".

use std::fmt;

use sha2::{Digest, Sha256};

/// A SHA-256 digest identifying a request. A key reused with another
/// fingerprint is a [`crate::Begin::Mismatch`].
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint(pub [u8; 32]);

impl Fingerprint {
    /// Fingerprint of a single byte string (for library callers that already
    /// have a canonical form of their request).
    pub fn of(bytes: &[u8]) -> Self {
        let mut b = FingerprintBuilder::new();
        b.part(bytes);
        b.finish()
    }

    /// The 32 digest bytes.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// Lowercase hex, 64 characters.
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }

    /// Parses 64 hex characters.
    pub fn from_hex(s: &str) -> Option<Self> {
        let mut out = [0u8; 32];
        hex::decode_to_slice(s, &mut out).ok()?;
        Some(Self(out))
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({})", &self.to_hex()[..16])
    }
}

/// Builds a [`Fingerprint`] from parts. Each part is length-prefixed, so
/// moving bytes from one part into the next changes the digest.
#[derive(Debug, Clone, Default)]
pub struct FingerprintBuilder(Sha256);

impl FingerprintBuilder {
    /// An empty builder.
    pub fn new() -> Self {
        Self(Sha256::new())
    }

    /// Adds one part.
    pub fn part(&mut self, bytes: &[u8]) -> &mut Self {
        self.0.update((bytes.len() as u64).to_be_bytes());
        self.0.update(bytes);
        self
    }

    /// The digest.
    pub fn finish(self) -> Fingerprint {
        Fingerprint(self.0.finalize().into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_are_delimited() {
        let mut a = FingerprintBuilder::new();
        a.part(b"ab").part(b"c");
        let mut b = FingerprintBuilder::new();
        b.part(b"a").part(b"bc");
        assert_ne!(a.finish(), b.finish());
    }

    #[test]
    fn hex_round_trip() {
        let f = Fingerprint::of(b"x");
        assert_eq!(Fingerprint::from_hex(&f.to_hex()), Some(f));
        assert_eq!(Fingerprint::from_hex("zz"), None);
    }
}
