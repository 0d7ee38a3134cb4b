//! When to retry, and how long to wait before the next attempt.

use std::time::Duration;

use http::StatusCode;
use rand::Rng;

/// Default [`RetryPolicy::with_max_attempts`]: 5 attempts in all.
pub const DEFAULT_MAX_ATTEMPTS: u32 = 5;
/// Default [`RetryPolicy::with_deadline`]: 30 s for all attempts and waits.
pub const DEFAULT_DEADLINE: Duration = Duration::from_secs(30);
/// Default [`RetryPolicy::with_attempt_timeout`]: 10 s for one attempt's
/// response headers.
pub const DEFAULT_ATTEMPT_TIMEOUT: Duration = Duration::from_secs(10);
/// Default [`RetryPolicy::with_base_delay`]: 100 ms.
pub const DEFAULT_BASE_DELAY: Duration = Duration::from_millis(100);
/// Default [`RetryPolicy::with_max_delay`]: 5 s.
pub const DEFAULT_MAX_DELAY: Duration = Duration::from_secs(5);
/// Default [`RetryPolicy::with_max_retry_after`]: 10 s.
pub const DEFAULT_MAX_RETRY_AFTER: Duration = Duration::from_secs(10);

/// How many attempts, how long, and how far apart.
///
/// Defaults: [`DEFAULT_MAX_ATTEMPTS`] (5) attempts, within a
/// [`DEFAULT_DEADLINE`] (30 s) for everything, each attempt allowed
/// [`DEFAULT_ATTEMPT_TIMEOUT`] (10 s) for its response headers; between
/// attempts a full-jitter exponential backoff from [`DEFAULT_BASE_DELAY`]
/// (100 ms) capped at [`DEFAULT_MAX_DELAY`] (5 s), or the server's
/// `Retry-After` bounded by [`DEFAULT_MAX_RETRY_AFTER`] (10 s).
///
/// ```
/// use std::time::Duration;
/// use idem_client::RetryPolicy;
///
/// let policy = RetryPolicy::default()
///     .with_max_attempts(3)
///     .with_deadline(Duration::from_secs(5))
///     .with_attempt_timeout(Duration::from_secs(2));
/// assert_eq!(policy.max_attempts(), 3);
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RetryPolicy {
    max_attempts: u32,
    deadline: Duration,
    attempt_timeout: Option<Duration>,
    base_delay: Duration,
    max_delay: Duration,
    max_retry_after: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            max_attempts: DEFAULT_MAX_ATTEMPTS,
            deadline: DEFAULT_DEADLINE,
            attempt_timeout: Some(DEFAULT_ATTEMPT_TIMEOUT),
            base_delay: DEFAULT_BASE_DELAY,
            max_delay: DEFAULT_MAX_DELAY,
            max_retry_after: DEFAULT_MAX_RETRY_AFTER,
        }
    }
}

/// What one attempt's outcome asks of the retry loop.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// A final answer: hand it to the caller as it is.
    Final,
    /// Worth another attempt, after the backoff or the server's `Retry-After`.
    Retry,
}

impl RetryPolicy {
    /// Attempts in all, the first one included (default 5). `0` is taken as
    /// `1` (one attempt, no retry): a request is always sent once.
    pub fn with_max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = attempts.max(1);
        self
    }

    /// The time all attempts and the waits between them may take, from the
    /// call (default 30 s). No attempt starts, and no wait is begun, that
    /// would end after it; an attempt in progress is cut at it.
    pub fn with_deadline(mut self, deadline: Duration) -> Self {
        self.deadline = deadline;
        self
    }

    /// The time one attempt may take until its response headers arrive
    /// (default 10 s; always also bounded by what is left of the deadline).
    /// An attempt that takes longer is dropped and counts as a retryable
    /// failure ([`crate::Failure::Timeout`]). The response body is not
    /// covered: once the headers are in, the caller reads it.
    pub fn with_attempt_timeout(mut self, timeout: Duration) -> Self {
        self.attempt_timeout = Some(timeout);
        self
    }

    /// No per-attempt timeout: only the deadline bounds an attempt.
    pub fn without_attempt_timeout(mut self) -> Self {
        self.attempt_timeout = None;
        self
    }

    /// The backoff's first bound (default 100 ms): the wait before retry
    /// `n` (1 for the second attempt) is uniform in
    /// `[0, min(max_delay, base_delay × 2^(n−1))]` ("full jitter").
    pub fn with_base_delay(mut self, delay: Duration) -> Self {
        self.base_delay = delay;
        self
    }

    /// The backoff's largest bound (default 5 s).
    pub fn with_max_delay(mut self, delay: Duration) -> Self {
        self.max_delay = delay;
        self
    }

    /// The longest `Retry-After` honoured (default 10 s): a longer one is
    /// waited for this long, then the request is retried (the gateway's
    /// `Retry-After` on 409 is an upper bound, the lease left, not the
    /// expected duration).
    pub fn with_max_retry_after(mut self, max: Duration) -> Self {
        self.max_retry_after = max;
        self
    }

    /// Attempts in all, at least 1.
    pub fn max_attempts(&self) -> u32 {
        self.max_attempts
    }

    /// The total time allowed.
    pub fn deadline(&self) -> Duration {
        self.deadline
    }

    /// The per-attempt timeout, if any.
    pub fn attempt_timeout(&self) -> Option<Duration> {
        self.attempt_timeout
    }

    /// The longest `Retry-After` honoured.
    pub fn max_retry_after(&self) -> Duration {
        self.max_retry_after
    }

    /// The backoff's bound before retry `retry` (1 for the second attempt):
    /// `min(max_delay, base_delay × 2^(retry−1))`, saturating; `retry` 0 is
    /// taken as 1.
    pub fn backoff_bound(&self, retry: u32) -> Duration {
        let exp = retry.saturating_sub(1).min(63);
        let factor = 1u64 << exp;
        let nanos = self
            .base_delay
            .as_nanos()
            .saturating_mul(u128::from(factor));
        let nanos = u64::try_from(nanos).unwrap_or(u64::MAX);
        Duration::from_nanos(nanos).min(self.max_delay)
    }

    /// A jittered wait before retry `retry`: uniform in
    /// `[0, backoff_bound(retry)]`.
    pub fn backoff(&self, retry: u32) -> Duration {
        jitter(self.backoff_bound(retry), &mut rand::thread_rng())
    }

    /// The wait before the next attempt: the server's `Retry-After` when
    /// it sent one, bounded by [`Self::max_retry_after`], else the backoff.
    pub(crate) fn wait(&self, retry: u32, retry_after: Option<Duration>) -> Duration {
        match retry_after {
            Some(asked) => asked.min(self.max_retry_after),
            None => self.backoff(retry),
        }
    }
}

/// Uniform in `[0, bound]`, at microsecond resolution.
pub(crate) fn jitter(bound: Duration, rng: &mut impl Rng) -> Duration {
    let micros = u64::try_from(bound.as_micros()).unwrap_or(u64::MAX);
    Duration::from_micros(rng.gen_range(0..=micros))
}

/// Whether a response with `status` is final or worth retrying with the
/// same key.
///
/// Retried: 409 (the same key still in flight; draft "The
/// Idempotency-Key HTTP Header Field" §2.6), 429 (RFC 6585 §4), and every
/// 5xx (502, 503, 504 included) except 501 Not Implemented and 505 HTTP
/// Version Not Supported, which a retry cannot change. Everything else is
/// final: 2xx and 3xx, 400 (a malformed key or request), 422 (the key was
/// used for another request), and every other 4xx.
///
/// The service retries a 409 only when it says to come back: see
/// [`is_retryable_response`].
pub fn is_retryable(status: StatusCode) -> bool {
    match status.as_u16() {
        409 | 429 => true,
        501 | 505 => false,
        s => (500..600).contains(&s),
    }
}

/// [`is_retryable`] for a whole response head: a 409 is retried only when
/// it carries `Retry-After` (what an idempotency layer sends for a key
/// still in flight: idem's `urn:idem:problem:in-flight`, Stripe's
/// concurrent-request error) — a 409 without it is the service's own
/// business conflict (a duplicate username, a version clash), final like
/// any other 4xx, never resent.
pub fn is_retryable_response(status: StatusCode, headers: &http::HeaderMap) -> bool {
    if status == StatusCode::CONFLICT {
        return headers.contains_key(http::header::RETRY_AFTER);
    }
    is_retryable(status)
}

pub(crate) fn verdict(status: StatusCode, headers: &http::HeaderMap) -> Verdict {
    if is_retryable_response(status, headers) {
        Verdict::Retry
    } else {
        Verdict::Final
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use rand::SeedableRng;

    #[test]
    fn backoff_doubles_up_to_the_cap() {
        let p = RetryPolicy::default()
            .with_base_delay(Duration::from_millis(100))
            .with_max_delay(Duration::from_secs(1));
        let bounds: Vec<_> = (1..=6).map(|n| p.backoff_bound(n).as_millis()).collect();
        assert_eq!(bounds, [100, 200, 400, 800, 1000, 1000]);
        assert_eq!(p.backoff_bound(0), Duration::from_millis(100));
        assert_eq!(p.backoff_bound(u32::MAX), Duration::from_secs(1));
    }

    #[test]
    fn a_409_is_retried_only_with_retry_after() {
        let mut h = http::HeaderMap::new();
        assert!(!is_retryable_response(StatusCode::CONFLICT, &h));
        h.insert(
            http::header::RETRY_AFTER,
            http::HeaderValue::from_static("1"),
        );
        assert!(is_retryable_response(StatusCode::CONFLICT, &h));
        assert!(is_retryable_response(
            StatusCode::SERVICE_UNAVAILABLE,
            &http::HeaderMap::new()
        ));
        assert!(!is_retryable_response(StatusCode::UNPROCESSABLE_ENTITY, &h));
    }

    #[test]
    fn retryable_statuses() {
        for s in [409, 429, 500, 502, 503, 504, 507, 599] {
            assert!(is_retryable(StatusCode::from_u16(s).unwrap()), "{s}");
        }
        for s in [
            200, 201, 204, 301, 304, 400, 401, 403, 404, 408, 410, 413, 422, 428, 501, 505,
        ] {
            assert!(!is_retryable(StatusCode::from_u16(s).unwrap()), "{s}");
        }
    }

    #[test]
    fn retry_after_is_bounded_and_preferred() {
        let p = RetryPolicy::default().with_max_retry_after(Duration::from_secs(2));
        assert_eq!(
            p.wait(1, Some(Duration::from_secs(1))),
            Duration::from_secs(1)
        );
        assert_eq!(
            p.wait(1, Some(Duration::from_secs(30))),
            Duration::from_secs(2)
        );
        assert_eq!(p.wait(9, Some(Duration::ZERO)), Duration::ZERO);
        assert!(p.wait(1, None) <= p.backoff_bound(1));
    }

    #[test]
    fn zero_attempts_is_one() {
        assert_eq!(
            RetryPolicy::default().with_max_attempts(0).max_attempts(),
            1
        );
    }

    #[test]
    fn jitter_spreads() {
        // Full jitter is not a constant: 200 draws from [0, 1 s] cover both halves.
        let mut rng = rand::rngs::StdRng::seed_from_u64(17);
        let draws: Vec<_> = (0..200)
            .map(|_| jitter(Duration::from_secs(1), &mut rng))
            .collect();
        assert!(draws.iter().any(|d| *d < Duration::from_millis(500)));
        assert!(draws.iter().any(|d| *d > Duration::from_millis(500)));
    }

    proptest! {
        #[test]
        fn backoff_stays_within_its_bound(
            base_ms in 0u64..10_000,
            max_ms in 0u64..100_000,
            retry in any::<u32>(),
            seed in any::<u64>(),
        ) {
            let p = RetryPolicy::default()
                .with_base_delay(Duration::from_millis(base_ms))
                .with_max_delay(Duration::from_millis(max_ms));
            let bound = p.backoff_bound(retry);
            prop_assert!(bound <= Duration::from_millis(max_ms));
            let exp = retry.saturating_sub(1).min(63);
            let exact = u128::from(base_ms) << exp;
            prop_assert!(bound.as_millis() <= exact);
            // Not below the exponential step unless the cap cut it.
            prop_assert!(bound == Duration::from_millis(max_ms) || bound.as_millis() == exact);
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
            prop_assert!(jitter(bound, &mut rng) <= bound);
        }

        #[test]
        fn bounds_never_shrink(base_ms in 0u64..10_000, max_ms in 0u64..100_000, retry in 1u32..100) {
            let p = RetryPolicy::default()
                .with_base_delay(Duration::from_millis(base_ms))
                .with_max_delay(Duration::from_millis(max_ms));
            prop_assert!(p.backoff_bound(retry) <= p.backoff_bound(retry + 1));
        }
    }
}
