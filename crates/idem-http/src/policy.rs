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

/// Which statuses are stored, released or held: [`default_policy`] (or
/// another base function) with per-status and per-class overrides on top,
/// the most specific first (an exact status, then its class such as `5xx`,
/// then the base).
///
/// ```
/// use http::StatusCode;
/// use idem_http::{Disposition, StatusPolicy};
/// let stripe = StatusPolicy::store_5xx();
/// assert_eq!(stripe.disposition(StatusCode::INTERNAL_SERVER_ERROR), Disposition::Store);
/// assert_eq!(stripe.disposition(StatusCode::GATEWAY_TIMEOUT), Disposition::Hold);
/// assert_eq!(stripe.disposition(StatusCode::CONFLICT), Disposition::Release);
/// let p: StatusPolicy = StatusPolicy::default().with("504", Disposition::Hold).unwrap();
/// assert_eq!(p.disposition(StatusCode::GATEWAY_TIMEOUT), Disposition::Hold);
/// assert_eq!(p.disposition(StatusCode::BAD_GATEWAY), Disposition::Release);
/// ```
#[derive(Clone)]
pub struct StatusPolicy {
    base: fn(StatusCode) -> Disposition,
    /// Exact statuses (100–999).
    exact: Vec<(u16, Disposition)>,
    /// By class: index 1 for `1xx` … 9 for `9xx`.
    class: [Option<Disposition>; 10],
}

impl std::fmt::Debug for StatusPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut m = f.debug_map();
        for (i, d) in self.class.iter().enumerate() {
            if let Some(d) = d {
                m.entry(&format_args!("{i}xx"), d);
            }
        }
        for (code, d) in &self.exact {
            m.entry(code, d);
        }
        m.finish()
    }
}

impl Default for StatusPolicy {
    /// [`default_policy`] with no override.
    fn default() -> Self {
        Self::from_fn(default_policy)
    }
}

impl From<fn(StatusCode) -> Disposition> for StatusPolicy {
    fn from(f: fn(StatusCode) -> Disposition) -> Self {
        Self::from_fn(f)
    }
}

/// Why a status override was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum StatusPatternError {
    /// Not a status (100-999) nor a class (`1xx`-`9xx`).
    #[error("{0:?} is not a status (100-999) nor a class (1xx-9xx)")]
    Pattern(String),
    /// A 2xx released or held: every successful request would run again
    /// when retried, the failure the layer exists to prevent.
    #[error("{0:?} would release or hold successful (2xx) answers, so every retry of a successful request would run again; 2xx answers are always stored")]
    Success(String),
}

impl StatusPolicy {
    /// `base` with no override.
    pub fn from_fn(base: fn(StatusCode) -> Disposition) -> Self {
        Self {
            base,
            exact: Vec::new(),
            class: [None; 10],
        }
    }

    /// Stripe's choice: 5xx answers are stored and replayed (a retry gets
    /// the same 500 instead of a second attempt), except 502 and 503, which
    /// the upstream sends before it acted (released), and 504, whose
    /// outcome is unknown (held until the lease ends). The rest as
    /// [`default_policy`].
    pub fn store_5xx() -> Self {
        let mut p = Self::default();
        p.class[5] = Some(Disposition::Store);
        p.exact = vec![
            (502, Disposition::Release),
            (503, Disposition::Release),
            (504, Disposition::Hold),
        ];
        p
    }

    /// This policy with `pattern` (a status such as `"504"` or a class
    /// such as `"5xx"`, case-insensitive) answered `disposition`; a later
    /// override of the same pattern replaces an earlier one.
    ///
    /// # Errors
    /// [`StatusPatternError::Pattern`] for anything else;
    /// [`StatusPatternError::Success`] for a 2xx status or the `2xx` class
    /// with anything but [`Disposition::Store`].
    pub fn with(
        mut self,
        pattern: &str,
        disposition: Disposition,
    ) -> Result<Self, StatusPatternError> {
        let err = || StatusPatternError::Pattern(pattern.to_owned());
        let success = || StatusPatternError::Success(pattern.to_owned());
        let p = pattern.trim().to_ascii_lowercase();
        if let Some(d) = p.strip_suffix("xx") {
            let class: usize = match d.as_bytes() {
                [c @ b'1'..=b'9'] => usize::from(c - b'0'),
                _ => return Err(err()),
            };
            if class == 2 && disposition != Disposition::Store {
                return Err(success());
            }
            self.class[class] = Some(disposition);
            return Ok(self);
        }
        let code: u16 = p.parse().map_err(|_| err())?;
        if !(100..=999).contains(&code) || p.len() != 3 {
            return Err(err());
        }
        if (200..300).contains(&code) && disposition != Disposition::Store {
            return Err(success());
        }
        self.exact.retain(|(c, _)| *c != code);
        self.exact.push((code, disposition));
        Ok(self)
    }

    /// What happens to a key whose run answered `status`.
    pub fn disposition(&self, status: StatusCode) -> Disposition {
        let code = status.as_u16();
        if let Some((_, d)) = self.exact.iter().find(|(c, _)| *c == code) {
            return *d;
        }
        if let Some(d) = self.class.get(usize::from(code / 100)).copied().flatten() {
            return d;
        }
        (self.base)(status)
    }

    /// The overrides, most specific first, as `(pattern, disposition)`:
    /// for showing the policy in force.
    pub fn overrides(&self) -> Vec<(String, Disposition)> {
        let mut out: Vec<(String, Disposition)> = self
            .exact
            .iter()
            .map(|(c, d)| (c.to_string(), *d))
            .collect();
        for (i, d) in self.class.iter().enumerate() {
            if let Some(d) = d {
                out.push((format!("{i}xx"), *d));
            }
        }
        out
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
            assert_eq!(
                StatusPolicy::default().disposition(status),
                want,
                "status {code}"
            );
        }
    }

    #[test]
    fn overrides_most_specific_first() {
        let p = StatusPolicy::default()
            .with("5xx", Disposition::Store)
            .unwrap()
            .with("504", Disposition::Hold)
            .unwrap()
            .with("4XX", Disposition::Release)
            .unwrap();
        let d = |c: u16| p.disposition(StatusCode::from_u16(c).unwrap());
        assert_eq!(d(500), Disposition::Store);
        assert_eq!(d(504), Disposition::Hold);
        assert_eq!(d(404), Disposition::Release);
        assert_eq!(d(201), Disposition::Store);
        for bad in ["", "5x", "0xx", "xx", "99", "1000", "5xxx", "+50", "050"] {
            assert!(
                StatusPolicy::default()
                    .with(bad, Disposition::Store)
                    .is_err(),
                "{bad}"
            );
        }
    }
}
