//! The admin token (`--admin-token-file`): a bearer token (RFC 6750)
//! compared in constant time.

use std::path::Path;

use http::{header, HeaderValue, Request, Response, StatusCode};
use idem_http::{problem, BoxBody};

/// Shortest admin token accepted: 16 bytes.
pub(crate) const MIN_TOKEN_LEN: usize = 16;

/// The admin API's bearer token, read once at start.
#[derive(Clone)]
pub(crate) struct AdminToken(Vec<u8>);

impl std::fmt::Debug for AdminToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AdminToken(***)")
    }
}

impl AdminToken {
    /// Reads the token from `path`: the file's contents without trailing
    /// whitespace (a final newline is usual); at least
    /// [`MIN_TOKEN_LEN`] bytes of visible ASCII (RFC 6750 `b64token`
    /// characters are a subset).
    ///
    /// # Errors
    /// A message naming the file and what is wrong with it.
    pub(crate) fn load(path: &Path) -> Result<Self, String> {
        let raw = std::fs::read(path)
            .map_err(|e| format!("cannot read --admin-token-file {}: {e}", path.display()))?;
        let end = raw
            .iter()
            .rposition(|b| !b.is_ascii_whitespace())
            .map_or(0, |i| i + 1);
        let token = &raw[..end];
        if token.len() < MIN_TOKEN_LEN {
            return Err(format!(
                "--admin-token-file {}: the token is {} bytes; at least {MIN_TOKEN_LEN} are needed",
                path.display(),
                token.len()
            ));
        }
        if !token.iter().all(u8::is_ascii_graphic) {
            return Err(format!(
                "--admin-token-file {}: the token must be visible ASCII (no spaces or control characters)",
                path.display()
            ));
        }
        Ok(Self(token.to_vec()))
    }

    /// Whether `given` is the token, in time independent of where they
    /// differ and of the given length: the SHA-256 digests of both are
    /// compared byte by byte without stopping early.
    pub(crate) fn matches(&self, given: &[u8]) -> bool {
        use sha2::{Digest, Sha256};
        let (want, got) = (Sha256::digest(&self.0), Sha256::digest(given));
        let diff = want
            .iter()
            .zip(got.iter())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b));
        std::hint::black_box(diff) == 0
    }
}

/// The credentials of `Authorization: Bearer <token>`; the scheme name is
/// case-insensitive (RFC 9110 §11.1), one space follows it (RFC 6750 §2.1).
fn bearer(value: &[u8]) -> Option<&[u8]> {
    let (scheme, rest) = value.split_at_checked(7)?;
    scheme.eq_ignore_ascii_case(b"bearer ").then_some(rest)
}

/// Checks the request's `Authorization: Bearer …` against `token`: `None`
/// when it may go on, otherwise the answer to send instead: 404 without a
/// configured token (the guarded paths do not exist), 401 with
/// `WWW-Authenticate: Bearer` for a missing or wrong one.
pub(crate) fn denied<B>(req: &Request<B>, token: Option<&AdminToken>) -> Option<Response<BoxBody>> {
    let Some(token) = token else {
        return Some(super::not_found());
    };
    let given = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| bearer(v.as_bytes()))
        .unwrap_or_default();
    if token.matches(given) {
        return None;
    }
    let mut resp = problem(
        StatusCode::UNAUTHORIZED,
        "admin-token",
        "this admin endpoint needs Authorization: Bearer <the token in --admin-token-file>",
    );
    resp.headers_mut().insert(
        header::WWW_AUTHENTICATE,
        HeaderValue::from_static("Bearer realm=\"idem-admin\""),
    );
    Some(resp)
}
