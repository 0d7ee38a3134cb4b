//! An in-process lock backend on an injectable clock.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;

use super::{new_owner_token, LockBackend, LockError, LockLease, TryAcquire};
use crate::clock::{Millis, SharedClock, SystemClock};

#[derive(Debug, Default)]
struct Slot {
    /// The current (or last) holder's owner token; `None` after release.
    owner: Option<String>,
    /// The last fence granted for this name (0 = never granted).
    fence: u64,
    until: Millis,
}

/// A lock backend inside one process: a map from name to lease, on a
/// [`Clock`](crate::Clock) that tests can move ([`crate::ManualClock`]). Clones share the
/// locks. Atomic per step (one mutex). Useful for tests and single-process
/// services; it excludes nothing across processes.
///
/// Every name ever granted keeps a small entry (its fence counter), so
/// fences keep growing across release and expiry; memory grows with the
/// number of distinct names.
#[derive(Debug, Clone)]
pub struct MemoryLockBackend {
    clock: SharedClock,
    slots: Arc<Mutex<HashMap<String, Slot>>>,
}

impl Default for MemoryLockBackend {
    /// A backend on the system clock.
    fn default() -> Self {
        Self::new(Arc::new(SystemClock))
    }
}

impl MemoryLockBackend {
    /// A backend on `clock` (for tests: `Arc::new(ManualClock::starting_now())`).
    pub fn new(clock: SharedClock) -> Self {
        Self {
            clock,
            slots: Arc::new(Mutex::new(HashMap::new())),
        }
    }

    fn slots(&self) -> MutexGuard<'_, HashMap<String, Slot>> {
        // A panic while holding the lock cannot leave a slot half-written
        // (each step assigns whole fields), so a poisoned map is still valid.
        self.slots.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[async_trait]
impl LockBackend for MemoryLockBackend {
    async fn try_acquire(&self, name: &str, ttl: Duration) -> Result<TryAcquire, LockError> {
        let now = self.clock.now();
        let mut slots = self.slots();
        let slot = slots.entry(name.to_owned()).or_default();
        if slot.owner.is_some() && slot.until > now {
            return Ok(TryAcquire::Busy {
                retry_after: now.until(slot.until),
            });
        }
        let owner = new_owner_token();
        slot.fence += 1;
        slot.owner = Some(owner.clone());
        slot.until = now.add(ttl);
        Ok(TryAcquire::Acquired(LockLease {
            name: name.to_owned(),
            owner,
            fence: slot.fence,
            until: slot.until,
        }))
    }

    async fn extend(
        &self,
        lease: &LockLease,
        ttl: Duration,
    ) -> Result<Option<LockLease>, LockError> {
        let now = self.clock.now();
        let mut slots = self.slots();
        match slots.get_mut(&lease.name) {
            Some(slot) if slot.owner.as_deref() == Some(&lease.owner) && slot.until > now => {
                slot.until = now.add(ttl);
                Ok(Some(LockLease {
                    until: slot.until,
                    ..lease.clone()
                }))
            }
            _ => Ok(None),
        }
    }

    async fn release(&self, lease: &LockLease) -> Result<bool, LockError> {
        let now = self.clock.now();
        let mut slots = self.slots();
        match slots.get_mut(&lease.name) {
            Some(slot) if slot.owner.as_deref() == Some(&lease.owner) => {
                let live = slot.until > now;
                slot.owner = None;
                slot.until = Millis(0);
                Ok(live)
            }
            _ => Ok(false),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ManualClock;

    #[tokio::test]
    async fn grants_expire_by_the_clock_and_fences_grow() {
        let clock = ManualClock::new(Millis(1_000_000));
        let b = MemoryLockBackend::new(Arc::new(clock.clone()));
        let ttl = Duration::from_millis(1000);
        let TryAcquire::Acquired(a) = b.try_acquire("n", ttl).await.unwrap() else {
            panic!("free name must be granted")
        };
        assert_eq!(a.fence, 1);
        assert_eq!(
            b.try_acquire("n", ttl).await.unwrap(),
            TryAcquire::Busy {
                retry_after: Duration::from_millis(1000)
            }
        );
        clock.advance(Duration::from_millis(1000));
        let TryAcquire::Acquired(c) = b.try_acquire("n", ttl).await.unwrap() else {
            panic!("an expired lease must be taken over")
        };
        assert_eq!(c.fence, 2);
        assert!(!b.release(&a).await.unwrap());
        assert!(b.extend(&a, ttl).await.unwrap().is_none());
        assert!(b.release(&c).await.unwrap());
    }
}
