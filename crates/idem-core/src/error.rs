//! Error types.

use std::error::Error as StdError;

/// A boxed error from a store's backend, kept as the `source()`.
pub type BoxError = Box<dyn StdError + Send + Sync + 'static>;

/// An idempotency key or scope that failed validation.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// The key is empty or only blanks.
    #[error("idempotency key is empty or blank")]
    Empty,
    /// The key is longer than 255 characters.
    #[error("idempotency key is {len} characters long; the limit is 255")]
    TooLong {
        /// Its length in bytes.
        len: usize,
    },
    /// The key holds a character outside 0x20–0x7E.
    #[error("idempotency key has {ch:?} at byte {at}; only 0x20-0x7E are allowed")]
    InvalidChar {
        /// Byte offset of the character.
        at: usize,
        /// The character.
        ch: char,
    },
    /// The scope is longer than 255 bytes.
    #[error("scope is {len} bytes long; the limit is 255 (hash it first)")]
    ScopeTooLong {
        /// Its length in bytes.
        len: usize,
    },
}

/// The phase of a store call that failed, for logs and metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Phase {
    /// Opening or migrating the store.
    Connect,
    /// `begin`.
    Begin,
    /// `complete`.
    Complete,
    /// `release`.
    Release,
    /// `extend`.
    Extend,
    /// `hold`.
    Hold,
    /// `get`.
    Get,
    /// `delete`.
    Delete,
    /// Purging expired records.
    Purge,
    /// Listing records ([`crate::admin::KeyAdmin::list`]).
    List,
}

impl std::fmt::Display for Phase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Phase::Connect => "connect",
            Phase::Begin => "begin",
            Phase::Complete => "complete",
            Phase::Release => "release",
            Phase::Extend => "extend",
            Phase::Hold => "hold",
            Phase::Get => "get",
            Phase::Delete => "delete",
            Phase::Purge => "purge",
            Phase::List => "list",
        })
    }
}

/// A store call that failed. Refusals (`InFlight`, `Mismatch`, `Replay`) are
/// not errors; they are values of [`crate::Begin`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// `complete`, `release` or `extend` with a fence that is no longer the
    /// key's current one: the lease expired and another caller took the key
    /// over, or the record is gone. Nothing was written.
    #[error("lease lost: fence {fence} is no longer current for this key")]
    LeaseLost {
        /// The caller's stale fence.
        fence: u64,
    },
    /// The store could not be reached or answered with an error.
    #[error("store unavailable during {phase}")]
    Unavailable {
        /// Which call failed.
        phase: Phase,
        /// The backend's error.
        #[source]
        source: BoxError,
    },
    /// A store call did not finish in time. Its effect is unknown.
    #[error("store timed out during {phase}")]
    Timeout {
        /// Which call timed out.
        phase: Phase,
    },
    /// A stored record could not be decoded.
    #[error("corrupt record during {phase}: {detail}")]
    Corrupt {
        /// Which call found it.
        phase: Phase,
        /// What was wrong.
        detail: String,
    },
    /// The store is at its configured capacity and holds nothing it may
    /// evict (only in-flight records).
    #[error("store is full: {detail}")]
    Full {
        /// Which cap was hit.
        detail: String,
    },
    /// A configuration or input error (a bad store URL, a bad table name).
    #[error("invalid store configuration: {0}")]
    Config(String),
    /// A request the store cannot answer as asked (a list limit out of
    /// range, a cursor this store did not make). Nothing was read or written.
    #[error("invalid store request: {0}")]
    Invalid(String),
}

impl StoreError {
    /// Wraps a backend error as [`StoreError::Unavailable`].
    pub fn unavailable(phase: Phase, source: impl Into<BoxError>) -> Self {
        Self::Unavailable {
            phase,
            source: source.into(),
        }
    }

    /// A stored record (or a backend's answer about one) that could not be
    /// decoded, as [`StoreError::Corrupt`]: `phase` is the call that found
    /// it, `detail` says what was wrong (shown in the message).
    ///
    /// ```
    /// use idem_core::{Phase, StoreError};
    /// let e = StoreError::corrupt(Phase::Get, "fingerprint is 3 bytes, not 32");
    /// assert!(matches!(e, StoreError::Corrupt { phase: Phase::Get, .. }));
    /// ```
    pub fn corrupt(phase: Phase, detail: impl Into<String>) -> Self {
        Self::Corrupt {
            phase,
            detail: detail.into(),
        }
    }
}
