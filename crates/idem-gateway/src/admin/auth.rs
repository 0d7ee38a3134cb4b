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

    /// Whether `given` is the token, in time independent of where they differ.
    pub(crate) fn matches(&self, given: &[u8]) -> bool {
        if given.len() != self.0.len() {
            return false;
        }
        let diff = self
            .0
            .iter()
            .zip(given)
            .fold(0u8, |acc, (a, b)| acc | (a ^ b));
        std::hint::black_box(diff) == 0
    }
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
        .and_then(|v| v.as_bytes().strip_prefix(b"Bearer "))
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
