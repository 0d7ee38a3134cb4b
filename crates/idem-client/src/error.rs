//! What a call can fail with.

use std::time::Duration;

use http::StatusCode;

use crate::key::{IdempotencyKey, InvalidKey};

/// A boxed error of the inner service or of a request body.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Why a call through [`crate::IdempotentService`] failed.
///
/// Responses that are final ([`crate::is_retryable`] false: 2xx, 3xx,
/// 400, 422, …) are never errors: they are returned as they are.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The request body could not be read (before any attempt: nothing was sent).
    #[error("the request body could not be read; nothing was sent")]
    Body(#[source] BoxError),
    /// The request body is larger than
    /// [`crate::IdempotentLayer::with_max_body`]; nothing was sent.
    #[error("the request body is larger than the {limit}-byte limit; nothing was sent")]
    BodyTooLarge {
        /// The limit, in bytes.
        limit: usize,
    },
    /// The caller's key (request extension or header) is invalid; nothing was sent.
    #[error("invalid idempotency key; nothing was sent")]
    InvalidKey(#[source] InvalidKey),
    /// Every allowed attempt failed with a retryable outcome
    /// ([`crate::RetryPolicy::with_max_attempts`]).
    #[error("gave up after {attempts} attempt(s): {last}")]
    AttemptsExhausted {
        /// Attempts made.
        attempts: u32,
        /// The key every attempt carried (`None` for a method sent without one).
        key: Option<IdempotencyKey>,
        /// The last attempt's outcome.
        #[source]
        last: Failure,
    },
    /// The deadline ([`crate::RetryPolicy::with_deadline`]) passed, or the
    /// next wait would have ended after it.
    #[error("deadline of {deadline:?} reached after {attempts} attempt(s){}", last_text(.last))]
    DeadlineExceeded {
        /// Attempts made (0 when the deadline is zero).
        attempts: u32,
        /// The key every attempt carried (`None` for a method sent without one).
        key: Option<IdempotencyKey>,
        /// The deadline.
        deadline: Duration,
        /// The last attempt's outcome, if an attempt was made.
        #[source]
        last: Option<Failure>,
    },
}

fn last_text(last: &Option<Failure>) -> String {
    match last {
        Some(f) => format!(": {f}"),
        None => String::new(),
    }
}

impl Error {
    /// Attempts made before the error (0 for errors found before sending).
    pub fn attempts(&self) -> u32 {
        match self {
            Error::AttemptsExhausted { attempts, .. }
            | Error::DeadlineExceeded { attempts, .. } => *attempts,
            Error::Body(_) | Error::BodyTooLarge { .. } | Error::InvalidKey(_) => 0,
        }
    }

    /// The last attempt's outcome, if an attempt was made.
    pub fn last(&self) -> Option<&Failure> {
        match self {
            Error::AttemptsExhausted { last, .. } => Some(last),
            Error::DeadlineExceeded { last, .. } => last.as_ref(),
            _ => None,
        }
    }

    /// The last status received, if the last attempt got a response.
    pub fn last_status(&self) -> Option<StatusCode> {
        match self.last() {
            Some(Failure::Status { status, .. }) => Some(*status),
            _ => None,
        }
    }

    /// The key the attempts carried: resend with it later (as a request
    /// extension) to get the original's outcome instead of a second run.
    pub fn key(&self) -> Option<&IdempotencyKey> {
        match self {
            Error::AttemptsExhausted { key, .. } | Error::DeadlineExceeded { key, .. } => {
                key.as_ref()
            }
            _ => None,
        }
    }
}

/// The outcome of one retryable attempt.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Failure {
    /// A retryable response: 409, 429 or a 5xx (its body was dropped).
    #[error("status {status}{}", retry_after_text(.retry_after))]
    Status {
        /// The status.
        status: StatusCode,
        /// Its `Retry-After`, if it sent a valid one.
        retry_after: Option<Duration>,
    },
    /// No response headers within the per-attempt timeout (or what was
    /// left of the deadline).
    #[error("no response within {0:?}")]
    Timeout(Duration),
    /// The inner service failed: a connection refused or reset, or closed
    /// before the response (its outcome unknown).
    #[error("transport error: {0}")]
    Transport(#[source] BoxError),
}

fn retry_after_text(retry_after: &Option<Duration>) -> String {
    match retry_after {
        Some(d) => format!(" (Retry-After {}s)", d.as_secs()),
        None => String::new(),
    }
}
