//! Which responses are stored, released or held.

use http::StatusCode;

/// What happens to a key once the inner service has answered.
///
/// The layer asks [`crate::Options::policy`] (default [`default_policy`])
/// for the response's status. An inner service may put a `Disposition` in
/// its response's extensions to override the policy for that response (the
/// gateway marks a 502 for an unreachable upstream `Release` and a 504 for a
/// timeout `Hold`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Disposition {
    /// Store and replay this response.
    Store,
    /// Free the key; a retry runs again.
    Release,
    /// Keep the key in flight until its lease ends (outcome unknown).
    Hold,
}

/// The default storage policy (IETF httpapi draft "The Idempotency-Key HTTP
/// Header Field", section 2.6, and Stripe's published behaviour):
///
/// | status                          | disposition |
/// |---------------------------------|-------------|
/// | 2xx, 3xx                        | `Store`     |
/// | 4xx except 408, 409, 425, 429   | `Store`     |
/// | 408, 409, 425, 429              | `Release` (the request may succeed when retried) |
/// | 5xx and above                   | `Release`   |
///
/// A 1xx final answer never reaches the policy: the layer answers it with
/// 502 `upstream-protocol` and releases the key, whatever the policy says.
///
/// ```
/// use http::StatusCode;
/// use idem_http::{default_policy, Disposition};
/// assert_eq!(default_policy(StatusCode::CREATED), Disposition::Store);
/// assert_eq!(default_policy(StatusCode::NOT_ACCEPTABLE), Disposition::Store);
/// assert_eq!(default_policy(StatusCode::TOO_MANY_REQUESTS), Disposition::Release);
/// assert_eq!(default_policy(StatusCode::BAD_GATEWAY), Disposition::Release);
/// ```
pub fn default_policy(status: StatusCode) -> Disposition {
    match status.as_u16() {
        408 | 409 | 425 | 429 => Disposition::Release,
        100..=499 => Disposition::Store,
        _ => Disposition::Release,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policy_table() {
        let cases = [
            (100, Disposition::Store),
            (200, Disposition::Store),
            (201, Disposition::Store),
            (204, Disposition::Store),
            (301, Disposition::Store),
            (303, Disposition::Store),
            (400, Disposition::Store),
            (401, Disposition::Store),
            (404, Disposition::Store),
            (406, Disposition::Store),
            (408, Disposition::Release),
            (409, Disposition::Release),
            (410, Disposition::Store),
            (422, Disposition::Store),
            (425, Disposition::Release),
            (429, Disposition::Release),
            (499, Disposition::Store),
            (500, Disposition::Release),
            (502, Disposition::Release),
            (503, Disposition::Release),
            (504, Disposition::Release),
            (599, Disposition::Release),
            (999, Disposition::Release),
        ];
        for (code, want) in cases {
            let status = StatusCode::from_u16(code).unwrap();
            assert_eq!(default_policy(status), want, "status {code}");
        }
    }
}
