//! The memory budget for buffered request bodies, shared by every service of
//! one [`crate::IdempotencyLayer`].

use std::sync::Arc;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Bytes of guarded request bodies the services of one layer may hold in
/// memory at once ([`crate::Options::max_buffered`]). A semaphore of bytes:
/// a request reserves its `Content-Length` before its body is read (or each
/// chunk as it arrives when no length is declared) and gives the bytes back
/// when the buffered body is dropped.
#[derive(Debug, Clone)]
pub(crate) struct BodyBudget {
    bytes: Arc<Semaphore>,
}

impl BodyBudget {
    /// A budget of `max` bytes (capped at [`Semaphore::MAX_PERMITS`]).
    pub(crate) fn new(max: usize) -> Self {
        Self {
            bytes: Arc::new(Semaphore::new(max.min(Semaphore::MAX_PERMITS))),
        }
    }

    /// An empty reservation on this budget.
    pub(crate) fn reservation(&self) -> Reservation {
        Reservation {
            budget: self.bytes.clone(),
            held: None,
            len: 0,
        }
    }
}

/// Bytes reserved on a [`BodyBudget`]; given back when dropped.
#[derive(Debug)]
pub(crate) struct Reservation {
    budget: Arc<Semaphore>,
    held: Option<OwnedSemaphorePermit>,
    len: usize,
}

/// The budget has fewer bytes free than asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Exhausted;

impl Reservation {
    /// Makes sure at least `total` bytes are reserved, taking the missing
    /// ones at once or failing without waiting.
    pub(crate) fn grow_to(&mut self, total: usize) -> Result<(), Exhausted> {
        while self.len < total {
            let step = u32::try_from(total - self.len).unwrap_or(u32::MAX);
            let permit = self
                .budget
                .clone()
                .try_acquire_many_owned(step)
                .map_err(|_| Exhausted)?;
            match &mut self.held {
                Some(held) => held.merge(permit),
                None => self.held = Some(permit),
            }
            self.len += step as usize;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reserves_and_gives_back() {
        let b = BodyBudget::new(100);
        let mut r1 = b.reservation();
        r1.grow_to(60).unwrap();
        r1.grow_to(50).unwrap();
        let mut r2 = b.reservation();
        assert_eq!(r2.grow_to(41), Err(Exhausted));
        r2.grow_to(40).unwrap();
        drop(r1);
        r2.grow_to(100).unwrap();
        assert_eq!(b.reservation().grow_to(1), Err(Exhausted));
        drop(r2);
        b.reservation().grow_to(100).unwrap();
    }
}
