//! An in-process store: atomic per key, TTL expiry, caps on entries and bytes.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::Notify;

use crate::clock::{Clock, Millis, SharedClock, SystemClock};
use crate::error::StoreError;
use crate::store::{Begin, BeginRequest, Lease, Record, RecordState, Store};
use crate::{Fingerprint, IdempotencyKey, Scope, StoredResponse};

/// Bytes counted per record on top of its key, scope and response, for the byte cap.
const RECORD_OVERHEAD: usize = 96;

type RecordKey = (Scope, IdempotencyKey);

/// Limits of a [`MemoryStore`].
#[derive(Debug, Clone, Copy)]
pub struct MemoryLimits {
    /// Most records kept (default 1,000,000).
    pub max_entries: usize,
    /// Most bytes kept, counting keys, responses and a fixed overhead per
    /// record (default 512 MiB).
    pub max_bytes: usize,
    /// When the caps are reached and nothing has expired, evict live
    /// completed records, soonest to expire first (default `false`).
    ///
    /// Off, the store refuses new claims with [`StoreError::Full`] (HTTP 503
    /// `store-full` at the gateway) until records expire: a retry of a key
    /// whose result is still within its TTL is always replayed. On, the store
    /// stays available under any load, but a retry of an evicted key runs
    /// its operation AGAIN — acceptable for a cache, not for payments.
    pub evict_live_results: bool,
}

impl Default for MemoryLimits {
    fn default() -> Self {
        Self {
            max_entries: 1_000_000,
            max_bytes: 512 * 1024 * 1024,
            evict_live_results: false,
        }
    }
}

#[derive(Debug)]
enum State {
    InProgress {
        fence: u64,
        lease_until: Millis,
        waiters: Option<Arc<Notify>>,
    },
    Completed {
        response: StoredResponse,
        expires_at: Millis,
        seq: u64,
    },
}

#[derive(Debug)]
struct Entry {
    fingerprint: Fingerprint,
    state: State,
    size: usize,
}

#[derive(Debug, Default)]
struct Inner {
    map: HashMap<Arc<RecordKey>, Entry>,
    /// Completed records by (expiry, completion order): expired and oldest first.
    by_expiry: BTreeMap<(Millis, u64), Arc<RecordKey>>,
    /// In-flight records by (lease end, fence): the first ones are those
    /// whose lease ended, found without scanning the map.
    by_lease: BTreeMap<(Millis, u64), Arc<RecordKey>>,
    bytes: usize,
    next_fence: u64,
    next_seq: u64,
}

impl Inner {
    fn remove(&mut self, k: &RecordKey) -> Option<Entry> {
        let e = self.map.remove(k)?;
        self.bytes -= e.size;
        match &e.state {
            State::Completed {
                expires_at, seq, ..
            } => {
                self.by_expiry.remove(&(*expires_at, *seq));
            }
            State::InProgress {
                waiters,
                fence,
                lease_until,
            } => {
                self.by_lease.remove(&(*lease_until, *fence));
                if let Some(w) = waiters {
                    w.notify_waiters();
                }
            }
        }
        Some(e)
    }

    /// Inserts an in-flight record, indexing its lease end.
    fn insert_in_progress(
        &mut self,
        k: Arc<RecordKey>,
        fingerprint: Fingerprint,
        fence: u64,
        lease_until: Millis,
        size: usize,
    ) {
        self.bytes += size;
        self.by_lease.insert((lease_until, fence), k.clone());
        self.map.insert(
            k,
            Entry {
                fingerprint,
                state: State::InProgress {
                    fence,
                    lease_until,
                    waiters: None,
                },
                size,
            },
        );
    }

    /// Takes the first entry of the lease index that ended by `now` and
    /// removes its record if that record is still the same claim. `None` when
    /// no lease has ended; `Some(removed)` otherwise (the index always
    /// shrinks, so loops over this end).
    fn pop_stale_claim(&mut self, now: Millis) -> Option<bool> {
        let (&(until, fence), _) = self.by_lease.first_key_value()?;
        if until > now {
            return None;
        }
        let (_, k) = self.by_lease.pop_first()?;
        let same = matches!(
            self.map.get(&*k).map(|e| &e.state),
            Some(State::InProgress { fence: f, lease_until: u, .. }) if *f == fence && *u == until
        );
        if same {
            self.remove(&RecordKey::clone(&k));
        }
        Some(same)
    }

    /// Makes room for `extra` bytes and one more record, evicting in this
    /// order: expired completed records, in-flight records whose lease has
    /// ended, then the live completed records that expire soonest (oldest
    /// first for equal TTLs). Live in-flight records are never evicted: that
    /// would let a second execution start. Nothing is evicted when the new
    /// record could not fit even in an empty store.
    fn make_room(
        &mut self,
        now: Millis,
        extra: usize,
        limits: &MemoryLimits,
    ) -> Result<(), StoreError> {
        let full = |inner: &Self| StoreError::Full {
            detail: format!(
                "{} records, {} bytes held, {extra} bytes wanted; limits {} records, {} bytes",
                inner.map.len(),
                inner.bytes,
                limits.max_entries,
                limits.max_bytes
            ),
        };
        if extra > limits.max_bytes || limits.max_entries == 0 {
            return Err(full(self));
        }
        while self.map.len() + 1 > limits.max_entries || self.bytes + extra > limits.max_bytes {
            // 1. Expired completed records.
            if let Some((&(at, _), _)) = self.by_expiry.first_key_value() {
                if at <= now {
                    let (_, k) = self.by_expiry.pop_first().expect("checked non-empty");
                    self.remove(&RecordKey::clone(&k));
                    continue;
                }
            }
            // 2. In-flight records whose lease has ended.
            if self.pop_stale_claim(now).is_some() {
                continue;
            }
            // 3. Live completed records, soonest to expire first — only when
            //    the owner opted in: an evicted result would run again.
            if limits.evict_live_results {
                if let Some((_, k)) = self.by_expiry.pop_first() {
                    self.remove(&RecordKey::clone(&k));
                    continue;
                }
            }
            // Only live records remain: refuse rather than lose one.
            return Err(full(self));
        }
        Ok(())
    }
}

fn entry_size(k: &RecordKey, resp: Option<&StoredResponse>) -> usize {
    RECORD_OVERHEAD
        + k.0.as_str().len()
        + k.1.as_str().len()
        + resp.map_or(0, StoredResponse::stored_size)
}

/// An in-process [`Store`]: one lock around a hash map, so every step is
/// atomic; TTL expiry checked on access and by [`Store::purge_expired`];
/// caps on entries and bytes where expired results and claims whose lease
/// ended are evicted first. Live records are kept: when only they fill the
/// store, `begin` (and a `complete` that needs more room) fails with
/// [`StoreError::Full`], unless [`MemoryLimits::evict_live_results`] allows
/// evicting the live results that expire soonest. Live in-flight records are
/// never evicted.
///
/// Fences come from one store-wide counter, so they grow across expiry.
/// Nothing survives the process: use it for tests and single-process services.
///
/// ```
/// use idem_core::{MemoryStore, ManualClock};
/// let clock = ManualClock::starting_now();
/// let store = MemoryStore::new().with_clock(clock.clone());
/// ```
#[derive(Debug, Clone)]
pub struct MemoryStore {
    inner: Arc<Mutex<Inner>>,
    clock: SharedClock,
    limits: MemoryLimits,
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryStore {
    /// An empty store with [`MemoryLimits::default`] and the system clock.
    pub fn new() -> Self {
        Self {
            inner: Arc::new(Mutex::new(Inner {
                next_fence: 1,
                ..Inner::default()
            })),
            clock: Arc::new(SystemClock),
            limits: MemoryLimits::default(),
        }
    }

    /// Uses `clock` for leases and expiry (a [`crate::ManualClock`] in tests).
    pub fn with_clock(mut self, clock: impl Clock) -> Self {
        self.clock = Arc::new(clock);
        self
    }

    /// Sets the caps on entries and bytes.
    pub fn with_limits(mut self, limits: MemoryLimits) -> Self {
        self.limits = limits;
        self
    }

    /// Number of records held, expired ones included until purged.
    pub fn len(&self) -> usize {
        self.lock().map.len()
    }

    /// Whether the store holds no record.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes counted against [`MemoryLimits::max_bytes`].
    pub fn bytes(&self) -> usize {
        self.lock().bytes
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock cannot leave a half-applied step:
        // every step mutates only after all checks, so the data is consistent.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

fn lease_lost(fence: u64) -> StoreError {
    StoreError::LeaseLost { fence }
}

#[async_trait]
impl Store for MemoryStore {
    async fn begin(&self, req: &BeginRequest) -> Result<Begin, StoreError> {
        let now = self.clock.now();
        let mut g = self.lock();
        let k: RecordKey = (req.scope.clone(), req.key.clone());
        if let Some(e) = g.map.get(&k) {
            match &e.state {
                State::InProgress { lease_until, .. } if *lease_until > now => {
                    return Ok(if e.fingerprint == req.fingerprint {
                        Begin::InFlight {
                            retry_after: now.until(*lease_until),
                        }
                    } else {
                        Begin::Mismatch
                    });
                }
                State::Completed {
                    response,
                    expires_at,
                    ..
                } if *expires_at > now => {
                    return Ok(if e.fingerprint == req.fingerprint {
                        Begin::Replay(response.clone())
                    } else {
                        Begin::Mismatch
                    });
                }
                _ => {
                    g.remove(&k);
                }
            }
        }
        let size = entry_size(&k, None);
        let limits = self.limits;
        g.make_room(now, size, &limits)?;
        let fence = g.next_fence;
        g.next_fence += 1;
        let until = now.add(req.lease);
        g.insert_in_progress(Arc::new(k), req.fingerprint, fence, until, size);
        Ok(Begin::Acquired(Lease {
            scope: req.scope.clone(),
            key: req.key.clone(),
            fence,
            until,
        }))
    }

    async fn complete(
        &self,
        lease: &Lease,
        response: &StoredResponse,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        let now = self.clock.now();
        let mut g = self.lock();
        let k: RecordKey = (lease.scope.clone(), lease.key.clone());
        let (arc_key, fingerprint, lease_until) = match g.map.get_key_value(&k) {
            Some((ak, e)) => match e.state {
                State::InProgress {
                    fence, lease_until, ..
                } if fence == lease.fence => (ak.clone(), e.fingerprint, lease_until),
                _ => return Err(lease_lost(lease.fence)),
            },
            _ => return Err(lease_lost(lease.fence)),
        };
        let old = g.remove(&k).map(|e| e.size).unwrap_or(0);
        let size = entry_size(&k, Some(response));
        let limits = self.limits;
        if let Err(e) = g.make_room(now, size, &limits) {
            // Put the claim back so the key stays in flight: never freed for a
            // second run. Keep the store's lease end (the watchdog may have
            // extended it past `lease.until`).
            g.insert_in_progress(arc_key, fingerprint, lease.fence, lease_until, old);
            return Err(e);
        }
        let seq = g.next_seq;
        g.next_seq += 1;
        let expires_at = now.add(ttl);
        g.bytes += size;
        g.by_expiry.insert((expires_at, seq), arc_key.clone());
        g.map.insert(
            arc_key,
            Entry {
                fingerprint,
                state: State::Completed {
                    response: response.clone(),
                    expires_at,
                    seq,
                },
                size,
            },
        );
        Ok(())
    }

    async fn release(&self, lease: &Lease) -> Result<(), StoreError> {
        let mut g = self.lock();
        let k: RecordKey = (lease.scope.clone(), lease.key.clone());
        match g.map.get(&k) {
            Some(e) if matches!(e.state, State::InProgress { fence, .. } if fence == lease.fence) =>
            {
                g.remove(&k);
                Ok(())
            }
            _ => Err(lease_lost(lease.fence)),
        }
    }

    async fn extend(&self, lease: &Lease, lease_for: Duration) -> Result<Lease, StoreError> {
        let now = self.clock.now();
        let mut g = self.lock();
        let k: RecordKey = (lease.scope.clone(), lease.key.clone());
        let (ak, old_until) = match g.map.get_key_value(&k) {
            Some((ak, e)) => match e.state {
                State::InProgress {
                    fence, lease_until, ..
                } if fence == lease.fence => (ak.clone(), lease_until),
                _ => return Err(lease_lost(lease.fence)),
            },
            None => return Err(lease_lost(lease.fence)),
        };
        let until = now.add(lease_for);
        g.by_lease.remove(&(old_until, lease.fence));
        g.by_lease.insert((until, lease.fence), ak);
        if let Some(Entry {
            state: State::InProgress { lease_until, .. },
            ..
        }) = g.map.get_mut(&k)
        {
            *lease_until = until;
        }
        Ok(Lease {
            until,
            ..lease.clone()
        })
    }

    async fn get(&self, scope: &Scope, key: &IdempotencyKey) -> Result<Option<Record>, StoreError> {
        let now = self.clock.now();
        let g = self.lock();
        let k: RecordKey = (scope.clone(), key.clone());
        Ok(g.map.get(&k).and_then(|e| {
            let state = match &e.state {
                State::InProgress {
                    fence, lease_until, ..
                } if *lease_until > now => RecordState::InProgress {
                    fence: *fence,
                    lease_until: *lease_until,
                },
                State::Completed {
                    response,
                    expires_at,
                    ..
                } if *expires_at > now => RecordState::Completed {
                    response: response.clone(),
                    expires_at: *expires_at,
                },
                _ => return None,
            };
            Some(Record {
                fingerprint: e.fingerprint,
                state,
            })
        }))
    }

    async fn delete(&self, scope: &Scope, key: &IdempotencyKey) -> Result<bool, StoreError> {
        let mut g = self.lock();
        Ok(g.remove(&(scope.clone(), key.clone())).is_some())
    }

    async fn purge_expired(&self) -> Result<u64, StoreError> {
        let now = self.clock.now();
        let mut g = self.lock();
        let mut n = 0;
        while let Some((&(at, _), _)) = g.by_expiry.first_key_value() {
            if at > now {
                break;
            }
            let (_, k) = g.by_expiry.pop_first().expect("checked non-empty");
            let k = RecordKey::clone(&k);
            g.remove(&k);
            n += 1;
        }
        while let Some(removed) = g.pop_stale_claim(now) {
            n += u64::from(removed);
        }
        Ok(n)
    }

    async fn wait_for_change(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        max: Duration,
    ) -> Result<(), StoreError> {
        let k: RecordKey = (scope.clone(), key.clone());
        let (notify, fence) = {
            let mut g = self.lock();
            match g.map.get_mut(&k).map(|e| &mut e.state) {
                Some(State::InProgress { waiters, fence, .. }) => (
                    waiters
                        .get_or_insert_with(|| Arc::new(Notify::new()))
                        .clone(),
                    *fence,
                ),
                _ => return Ok(()),
            }
        };
        let notified = notify.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        // Re-check after registering: a change between the first look and
        // `enable` would otherwise be missed until `max`.
        let unchanged = {
            let g = self.lock();
            matches!(g.map.get(&k).map(|e| &e.state), Some(State::InProgress { fence: f, .. }) if *f == fence)
        };
        if unchanged {
            let _ = tokio::time::timeout(max, notified).await;
        }
        Ok(())
    }
}
