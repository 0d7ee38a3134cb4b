//! The stored result of an operation.

use bytes::Bytes;
use serde::{Deserialize, Serialize};

/// The result kept for a completed key and returned on every replay.
///
/// HTTP-shaped because HTTP is the main user; other operations store their
/// output as `body` (the engine's [`crate::Engine::once`] stores JSON with
/// status 200).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredResponse {
    /// HTTP status code (100–999).
    pub status: u16,
    /// Header fields in their original order, repeated names kept:
    /// an ordered multimap of (lowercase name, raw value bytes).
    pub headers: Vec<(String, Vec<u8>)>,
    /// The body, byte for byte.
    #[serde(with = "body_serde")]
    pub body: Bytes,
    /// `true` when the body was larger than the retention limit and was
    /// not kept: the operation ran and completed, but a replay cannot
    /// reproduce its body.
    #[serde(default)]
    pub body_omitted: bool,
    /// `true` for the answer of an execution that failed without effect and
    /// released its key ([`crate::Action::ReleaseWith`]): it is replayed
    /// only to the duplicates that waited for that execution; a later retry
    /// waits out [`crate::EngineConfig::share_failure`] and runs again.
    #[serde(default)]
    pub released: bool,
}

impl StoredResponse {
    /// A response with a status and body and no headers.
    pub fn new(status: u16, body: impl Into<Bytes>) -> Self {
        Self {
            status,
            headers: Vec::new(),
            body: body.into(),
            body_omitted: false,
            released: false,
        }
    }

    /// Approximate bytes this response takes when stored (names, values, body).
    pub fn stored_size(&self) -> usize {
        self.body.len()
            + self
                .headers
                .iter()
                .map(|(n, v)| n.len() + v.len() + 16)
                .sum::<usize>()
            + 32
    }

    /// Encodes the response for a store that keeps opaque bytes. The format is
    /// a versioned, length-prefixed binary layout (see [`Self::decode`]).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.stored_size() + 16);
        out.push(1u8); // format version
                       // Flags: bit 0 `body_omitted`, bit 1 `released`.
        out.push(u8::from(self.body_omitted) | (u8::from(self.released) << 1));
        out.extend_from_slice(&self.status.to_be_bytes());
        out.extend_from_slice(&(self.headers.len() as u32).to_be_bytes());
        for (n, v) in &self.headers {
            out.extend_from_slice(&(n.len() as u32).to_be_bytes());
            out.extend_from_slice(n.as_bytes());
            out.extend_from_slice(&(v.len() as u32).to_be_bytes());
            out.extend_from_slice(v);
        }
        out.extend_from_slice(&(self.body.len() as u64).to_be_bytes());
        out.extend_from_slice(&self.body);
        out
    }

    /// Decodes bytes made by [`Self::encode`].
    ///
    /// # Errors
    /// A description of what is malformed (unknown version, truncated data,
    /// a header name that is not UTF-8, trailing bytes).
    pub fn decode(mut buf: &[u8]) -> Result<Self, String> {
        fn take<'a>(buf: &mut &'a [u8], n: usize) -> Result<&'a [u8], String> {
            if buf.len() < n {
                return Err(format!("truncated: wanted {n} bytes, {} left", buf.len()));
            }
            let (a, b) = buf.split_at(n);
            *buf = b;
            Ok(a)
        }
        fn u32_(buf: &mut &[u8]) -> Result<usize, String> {
            let b = take(buf, 4)?;
            Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]) as usize)
        }
        let head = take(&mut buf, 4)?;
        if head[0] != 1 {
            return Err(format!("unknown response format version {}", head[0]));
        }
        if head[1] > 3 {
            return Err(format!("unknown response flags {:#04x}", head[1]));
        }
        let body_omitted = head[1] & 1 != 0;
        let released = head[1] & 2 != 0;
        let status = u16::from_be_bytes([head[2], head[3]]);
        let count = u32_(&mut buf)?;
        let mut headers = Vec::with_capacity(count.min(1024));
        for _ in 0..count {
            let n = u32_(&mut buf)?;
            let name = std::str::from_utf8(take(&mut buf, n)?)
                .map_err(|_| "header name is not UTF-8".to_owned())?
                .to_owned();
            let n = u32_(&mut buf)?;
            headers.push((name, take(&mut buf, n)?.to_vec()));
        }
        let b = take(&mut buf, 8)?;
        let len = u64::from_be_bytes(b.try_into().map_err(|_| "bad length")?);
        let len = usize::try_from(len).map_err(|_| "body length overflows")?;
        let body = Bytes::copy_from_slice(take(&mut buf, len)?);
        if !buf.is_empty() {
            return Err(format!("{} trailing bytes", buf.len()));
        }
        Ok(Self {
            status,
            headers,
            body,
            body_omitted,
            released,
        })
    }
}

mod body_serde {
    use bytes::Bytes;
    use serde::{Deserialize, Deserializer, Serializer};

    pub(super) fn serialize<S: Serializer>(b: &Bytes, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(b)
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Bytes, D::Error> {
        Ok(Bytes::from(Vec::<u8>::deserialize(d)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encode_round_trip_keeps_repeated_headers_and_binary_body() {
        let r = StoredResponse {
            status: 201,
            headers: vec![
                ("set-cookie".into(), b"a=1".to_vec()),
                ("location".into(), b"/orders/1".to_vec()),
                ("set-cookie".into(), b"b=2".to_vec()),
            ],
            body: Bytes::from_static(&[0, 159, 146, 150, 255]),
            body_omitted: false,
            released: false,
        };
        assert_eq!(StoredResponse::decode(&r.encode()).unwrap(), r);
        for (omitted, released) in [(true, false), (false, true), (true, true)] {
            let r = StoredResponse {
                body_omitted: omitted,
                released,
                ..r.clone()
            };
            assert_eq!(StoredResponse::decode(&r.encode()).unwrap(), r);
        }
    }

    #[test]
    fn decode_rejects_garbage() {
        assert!(StoredResponse::decode(b"").is_err());
        assert!(StoredResponse::decode(&[9, 0, 0, 200]).is_err());
        let mut ok = StoredResponse::new(200, "x").encode();
        ok.push(0);
        assert!(StoredResponse::decode(&ok).is_err());
        // Flags this version does not know are refused, not ignored.
        let mut flags = StoredResponse::new(200, "x").encode();
        flags[1] = 4;
        assert!(StoredResponse::decode(&flags).is_err());
    }
}
