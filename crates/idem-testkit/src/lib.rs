//! # idem-testkit
//!
//! The conformance suite every idem [`Store`](idem_core::Store) runs against
//! a real backend, plus an engine-level suite (cancellation, failed saves,
//! the lease watchdog) run over any store.
//!
//! A store's test file is a handful of lines: implement [`Harness`] (a store
//! and a way to let time pass) and expand [`conformance_tests!`] inside a
//! module named after the store (`<store>_tests`, so `cargo test
//! sqlite_tests` runs one store). The macro writes one `#[tokio::test]` per
//! check into a submodule:
//!
//! ```no_run
//! // tests/memory_tests.rs
//! mod memory_tests {
//!     idem_testkit::conformance_tests!(conformance, || async { idem_testkit::MemoryHarness::new() });
//!     // store-specific tests go here
//! }
//! ```
//!
//! ## Time
//! Checks never sleep through a lease or a TTL themselves: they call
//! [`Harness::advance`]. Stores with an injectable clock (memory, SQLite)
//! move a [`ManualClock`]; a store that keeps time itself (PostgreSQL
//! `now()`, Redis `TIME`) sleeps instead, which is why every lease and TTL
//! in the suite is short (300 ms to 2 s) and no check advances time by more
//! than a few seconds.
//!
//! ## Isolation
//! Every check uses its own random scope and keys, so checks may share one
//! backend and run in parallel. A harness built on a [`ManualClock`] must
//! not share its backend with other checks, though: moving one check's
//! clock (and `purge_expired`) would expire another check's live records.
//! The macro calls the harness factory once per check, so give each call
//! its own store (a fresh [`MemoryStore`], a fresh SQLite file).
//!
//! | module | what it checks |
//! |---|---|
//! | [`store_checks`] | the key protocol: claims, concurrency, replay, mismatch, release, lease expiry (CASES A3, B1, B2) and `Lease::took_over`, stale fences, extend, TTL expiry (F1), get/delete, purge, fences, `wait_for_change`, odd keys and scopes (E3) |
//! | [`admin_checks`] | listing ([`idem_core::KeyAdmin`]): state and scope filters, cursor paging (every record once), newest first where the store claims it, expired results hidden and ended claims shown, delete, bad limits and cursors |
//! | [`engine_checks`] | [`Engine`](idem_core::Engine) over the store: once under concurrency (A1), release then retry (C1), cancellation with `Hold` and `Release`, failed saves hold the key, the watchdog, wait mode |
//! | [`token_checks`] | submit tokens ([`idem_core::token`]): issue, use, replay, one run under 16 concurrent uses (I1), unknown / expired / other-scope tokens rejected, reuse after the TTL replayed |
//! | [`faulty`] | [`FaultyStore`]: wraps any store; per operation it fails, hangs or delays, always or the next `n` calls, counting calls |

pub mod admin_checks;
#[cfg(feature = "bench")]
pub mod bench;
pub mod engine_checks;
pub mod faulty;
mod kept;
pub mod lock_checks;
mod macros;
#[cfg(feature = "pki")]
pub mod pki;
pub mod server_checks;
pub mod store_checks;
pub mod support;
pub mod token_checks;

use std::time::Duration;

use async_trait::async_trait;
pub use faulty::{Fault, FaultyStore};
use idem_core::{ManualClock, MemoryLimits, MemoryStore};
pub use kept::KeptHarness;

/// What the suite needs from a store under test: the store, and a way to let
/// time pass without the check sleeping when the store's clock can be moved.
#[async_trait]
pub trait Harness: Send + Sync {
    /// The store under test.
    type S: idem_core::Store + Clone;

    /// A handle on the store (clones share its records).
    fn store(&self) -> Self::S;

    /// Lets `d` pass by the store's clock: moves a [`ManualClock`], or sleeps
    /// for a store that keeps time itself. Returns once the time has passed.
    async fn advance(&self, d: Duration);
}

/// A [`MemoryStore`] on a [`ManualClock`]: `advance` moves the clock.
#[derive(Debug, Clone)]
pub struct MemoryHarness {
    store: MemoryStore,
    clock: ManualClock,
}

impl MemoryHarness {
    /// A fresh store with [`MemoryLimits::default`], its clock at the current time.
    pub fn new() -> Self {
        Self::with_limits(MemoryLimits::default())
    }

    /// A fresh store with the given caps.
    pub fn with_limits(limits: MemoryLimits) -> Self {
        let clock = ManualClock::starting_now();
        let store = MemoryStore::new()
            .with_clock(clock.clone())
            .with_limits(limits);
        Self { store, clock }
    }

    /// The store's clock.
    pub fn clock(&self) -> &ManualClock {
        &self.clock
    }
}

impl Default for MemoryHarness {
    fn default() -> Self {
        Self::new()
    }
}

#[async_trait]
impl Harness for MemoryHarness {
    type S = MemoryStore;

    fn store(&self) -> MemoryStore {
        self.store.clone()
    }

    async fn advance(&self, d: Duration) {
        self.clock.advance(d);
    }
}

/// A [`Harness`] for stores that keep time themselves: `advance` sleeps.
#[derive(Debug, Clone)]
pub struct SleepingHarness<S>(pub S);

#[async_trait]
impl<S: idem_core::Store + Clone> Harness for SleepingHarness<S> {
    type S = S;

    fn store(&self) -> S {
        self.0.clone()
    }

    async fn advance(&self, d: Duration) {
        tokio::time::sleep(d).await;
    }
}
