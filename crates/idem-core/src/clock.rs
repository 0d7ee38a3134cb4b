//! Injectable time, so lease and TTL tests never sleep.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// A point in time: milliseconds since the Unix epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Millis(pub u64);

impl Millis {
    /// This instant plus `d` (saturating).
    // Not `std::ops::Add`: saturating, and `Millis + Duration` would hide that.
    #[allow(clippy::should_implement_trait)]
    pub fn add(self, d: Duration) -> Self {
        Millis(self.0.saturating_add(duration_ms(d)))
    }

    /// How long from `self` until `later` (zero when `later` is not later).
    pub fn until(self, later: Millis) -> Duration {
        Duration::from_millis(later.0.saturating_sub(self.0))
    }
}

/// `d` in whole milliseconds, rounded up so a non-zero duration never becomes 0 ms,
/// saturating at `u64::MAX`.
pub fn duration_ms(d: Duration) -> u64 {
    let ms = d.as_millis() + u128::from(d.subsec_nanos() % 1_000_000 != 0);
    u64::try_from(ms).unwrap_or(u64::MAX)
}

/// A source of wall-clock time in milliseconds. Stores that keep time
/// themselves (SQL `now()`, Redis `TIME`) do not use one.
pub trait Clock: Send + Sync + std::fmt::Debug + 'static {
    /// The current time.
    fn now(&self) -> Millis;
}

/// The operating system's clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Millis {
        let d = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or(Duration::ZERO);
        Millis(u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
    }
}

/// A clock that moves only when told to, for tests. Clones share one time.
#[derive(Debug, Clone)]
pub struct ManualClock(Arc<AtomicU64>);

impl ManualClock {
    /// A clock standing at `start`.
    pub fn new(start: Millis) -> Self {
        Self(Arc::new(AtomicU64::new(start.0)))
    }

    /// A clock standing at the system's current time.
    pub fn starting_now() -> Self {
        Self::new(SystemClock.now())
    }

    /// Moves the clock forward by `d`.
    pub fn advance(&self, d: Duration) {
        self.0.fetch_add(duration_ms(d), Ordering::SeqCst);
    }

    /// Sets the clock to `t` (may move backwards, to test skew).
    pub fn set(&self, t: Millis) {
        self.0.store(t.0, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Millis {
        Millis(self.0.load(Ordering::SeqCst))
    }
}

/// A shared clock handle.
pub type SharedClock = Arc<dyn Clock>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sub_millisecond_durations_round_up() {
        assert_eq!(duration_ms(Duration::from_micros(1)), 1);
        assert_eq!(duration_ms(Duration::from_millis(1500)), 1500);
        assert_eq!(duration_ms(Duration::ZERO), 0);
        assert_eq!(duration_ms(Duration::MAX), u64::MAX);
    }

    #[test]
    fn manual_clock_moves_when_told() {
        let c = ManualClock::new(Millis(1000));
        c.advance(Duration::from_millis(1500));
        assert_eq!(c.now(), Millis(2500));
    }
}
