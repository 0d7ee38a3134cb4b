//! [`KeptHarness`]: a store, how its time passes, and what must live as
//! long as the check (a temporary folder, a clean-up guard).

use std::time::Duration;

use async_trait::async_trait;
use idem_core::ManualClock;

use crate::Harness;

/// A [`Harness`] over any store that also keeps `kept` alive until the check
/// ends (a `tempfile::TempDir`, a guard that drops the check's tables).
///
/// Time passes on a [`ManualClock`] when the store was built on one
/// ([`KeptHarness::on_clock`]), and by sleeping otherwise
/// ([`KeptHarness::sleeping`]: a database or Redis that keeps time itself).
#[derive(Debug)]
pub struct KeptHarness<S, K = ()> {
    /// The store under test.
    pub store: S,
    /// Dropped with the harness, after the check.
    pub kept: K,
    clock: Option<ManualClock>,
}

impl<S, K> KeptHarness<S, K> {
    /// `advance` sleeps: the store keeps its own time.
    pub fn sleeping(store: S, kept: K) -> Self {
        Self {
            store,
            kept,
            clock: None,
        }
    }

    /// `advance` moves `clock`, the store's clock.
    pub fn on_clock(store: S, clock: ManualClock, kept: K) -> Self {
        Self {
            store,
            kept,
            clock: Some(clock),
        }
    }

    /// The store's [`ManualClock`], if it runs on one.
    pub fn clock(&self) -> Option<&ManualClock> {
        self.clock.as_ref()
    }
}

#[async_trait]
impl<S, K> Harness for KeptHarness<S, K>
where
    S: idem_core::Store + Clone,
    K: Send + Sync,
{
    type S = S;

    fn store(&self) -> S {
        self.store.clone()
    }

    async fn advance(&self, d: Duration) {
        match &self.clock {
            Some(clock) => clock.advance(d),
            None => tokio::time::sleep(d).await,
        }
    }
}
