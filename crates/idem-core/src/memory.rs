//! An in-process store: atomic per key, TTL expiry, caps on entries and bytes.
//!
//! Layout (chosen for memory per record and for flat tail latency):
//! - [`SHARDS`] shards, each a mutex around a `hashbrown` table; a key's shard
//!   is picked from its hash, so a table resize moves 1/64 of the records and
//!   callers on different keys rarely wait for each other.
//! - A completed record is ONE allocation: fingerprint, expiry, completion
//!   order, byte size, scope, key and the response (status, headers, body),
//!   length-prefixed. A replay's body shares that allocation (no copy).
//! - An in-flight record is a small box (the few live claims, mutable lease).
//! - Expiry: per shard, a binary heap of (expires_at, seq, hash), 24 bytes a
//!   record, with lazy deletion; leases: per shard, an ordered set of the
//!   in-flight records only.
//! - Caps: store-wide atomic counters, reserved before a record is added.

use std::cmp::Reverse;
use std::collections::{BTreeSet, BinaryHeap};
use std::fmt;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use hashbrown::{DefaultHashBuilder, HashTable};
use tokio::sync::Notify;

use crate::admin::{KeyAdmin, ListPage, ListQuery, ListedRecord, StateFilter};
use crate::clock::{Clock, Millis, SharedClock, SystemClock};
use crate::error::StoreError;
use crate::store::{Begin, BeginRequest, HoldReason, Lease, Record, RecordState, Store};
use crate::{Fingerprint, IdempotencyKey, Scope, StoredResponse};

/// Bytes counted per record on top of its key, scope and response, for the byte cap.
const RECORD_OVERHEAD: usize = 96;

/// Number of shards (a power of two).
const SHARDS: usize = 64;

/// Records each shard has room for before its first resize.
const SHARD_CAPACITY: usize = 512;

/// How often a step that found the store full makes room and tries again
/// before answering [`StoreError::Full`] (only concurrent callers taking the
/// room just made can use up more than one attempt).
const ATTEMPTS: usize = 4;

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

// ---- keys ---------------------------------------------------------------

/// A scoped key as bytes, for hashing and comparing without allocating.
#[derive(Clone, Copy, PartialEq, Eq)]
struct KeyRef<'a> {
    scope: &'a [u8],
    key: &'a [u8],
}

impl<'a> KeyRef<'a> {
    fn of(scope: &'a Scope, key: &'a IdempotencyKey) -> Self {
        Self {
            scope: scope.as_str().as_bytes(),
            key: key.as_str().as_bytes(),
        }
    }

    fn len(&self) -> usize {
        self.scope.len() + self.key.len()
    }

    /// Scope and key lengths as stored (both at most 255 bytes, checked by
    /// [`Scope::new`] and [`IdempotencyKey::new`]).
    fn lens(&self) -> (u8, u8) {
        (
            u8::try_from(self.scope.len()).unwrap_or(u8::MAX),
            u8::try_from(self.key.len()).unwrap_or(u8::MAX),
        )
    }
}

// ---- records ------------------------------------------------------------

/// Offsets in a completed record's bytes.
const FP: usize = 0;
const EXPIRES: usize = 32;
const SEQ: usize = 40;
const SIZE: usize = 48;
const SCOPE_LEN: usize = 56;
const KEY_LEN: usize = 57;
const HEAD: usize = 58;

/// A record in a shard's table.
enum Slot {
    /// Completed: one allocation, laid out as `[fingerprint 32][expires_at
    /// u64][seq u64][size u64][scope len u8][key len u8][scope][key]
    /// [status u16][flags u8: bit 0 body_omitted, bit 1 released][header count][(name len, name, value
    /// len, value)*][body]`, integers little-endian, counts and lengths LEB128.
    Done(Arc<[u8]>),
    /// In flight.
    Flight(Box<Flight>),
}

struct Flight {
    /// `[scope len u8][scope][key]`.
    key: Box<[u8]>,
    fingerprint: Fingerprint,
    fence: u64,
    lease_until: Millis,
    /// Set by [`Store::hold`].
    held: Option<HoldReason>,
    waiters: Option<Arc<Notify>>,
}

fn read_u64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

fn put_varint(out: &mut Vec<u8>, mut n: usize) {
    while n >= 0x80 {
        out.push((n as u8 & 0x7f) | 0x80);
        n >>= 7;
    }
    out.push(n as u8);
}

fn varint_len(mut n: usize) -> usize {
    let mut len = 1;
    while n >= 0x80 {
        n >>= 7;
        len += 1;
    }
    len
}

/// Reads the bytes this module wrote; `None` only if they were corrupted.
struct Cursor<'a> {
    buf: &'a [u8],
    at: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let s = self.buf.get(self.at..self.at.checked_add(n)?)?;
        self.at += n;
        Some(s)
    }

    fn varint(&mut self) -> Option<usize> {
        let mut n = 0usize;
        for shift in (0..64).step_by(7) {
            let b = *self.take(1)?.first()?;
            n |= usize::from(b & 0x7f).checked_shl(shift)?;
            if b < 0x80 {
                return Some(n);
            }
        }
        None
    }
}

fn entry_size(k: KeyRef<'_>, resp: Option<&StoredResponse>) -> usize {
    RECORD_OVERHEAD + k.len() + resp.map_or(0, StoredResponse::stored_size)
}

/// Encodes a completed record (see [`Slot::Done`]).
fn encode_done(
    fingerprint: &Fingerprint,
    expires_at: Millis,
    seq: u64,
    size: usize,
    k: KeyRef<'_>,
    resp: &StoredResponse,
) -> Arc<[u8]> {
    let headers: usize = resp
        .headers
        .iter()
        .map(|(n, v)| varint_len(n.len()) + n.len() + varint_len(v.len()) + v.len())
        .sum();
    let len = HEAD + k.len() + 3 + varint_len(resp.headers.len()) + headers + resp.body.len();
    let mut out = Vec::with_capacity(len);
    out.extend_from_slice(&fingerprint.0);
    out.extend_from_slice(&expires_at.0.to_le_bytes());
    out.extend_from_slice(&seq.to_le_bytes());
    out.extend_from_slice(&(size as u64).to_le_bytes());
    let (sl, kl) = k.lens();
    out.push(sl);
    out.push(kl);
    out.extend_from_slice(k.scope);
    out.extend_from_slice(k.key);
    out.extend_from_slice(&resp.status.to_le_bytes());
    out.push(u8::from(resp.body_omitted) | (u8::from(resp.released) << 1));
    put_varint(&mut out, resp.headers.len());
    for (n, v) in &resp.headers {
        put_varint(&mut out, n.len());
        out.extend_from_slice(n.as_bytes());
        put_varint(&mut out, v.len());
        out.extend_from_slice(v);
    }
    out.extend_from_slice(&resp.body);
    debug_assert_eq!(out.len(), len);
    Arc::from(out)
}

/// The response of a completed record; the body shares the record's allocation.
fn decode_response(rec: &Arc<[u8]>) -> StoredResponse {
    fn parse(rec: &Arc<[u8]>) -> Option<StoredResponse> {
        let at = HEAD + usize::from(rec[SCOPE_LEN]) + usize::from(rec[KEY_LEN]);
        let mut c = Cursor { buf: rec, at };
        let st = c.take(2)?;
        let status = u16::from_le_bytes([st[0], st[1]]);
        let flags = c.take(1)?[0];
        let (body_omitted, released) = (flags & 1 != 0, flags & 2 != 0);
        let count = c.varint()?;
        let mut headers = Vec::with_capacity(count.min(256));
        for _ in 0..count {
            let n = c.varint()?;
            let name = String::from_utf8(c.take(n)?.to_vec()).ok()?;
            let n = c.varint()?;
            headers.push((name, c.take(n)?.to_vec()));
        }
        let body = if c.at == rec.len() {
            Bytes::new()
        } else {
            Bytes::from_owner(Arc::clone(rec)).slice(c.at..)
        };
        Some(StoredResponse {
            status,
            headers,
            body,
            body_omitted,
            released,
        })
    }
    // The bytes were written by `encode_done` and never change afterwards.
    parse(rec).expect("a memory store record decodes as it was encoded")
}

impl Slot {
    fn key(&self) -> KeyRef<'_> {
        match self {
            Slot::Done(d) => {
                let sl = usize::from(d[SCOPE_LEN]);
                let kl = usize::from(d[KEY_LEN]);
                KeyRef {
                    scope: &d[HEAD..HEAD + sl],
                    key: &d[HEAD + sl..HEAD + sl + kl],
                }
            }
            Slot::Flight(f) => {
                let sl = usize::from(f.key[0]);
                KeyRef {
                    scope: &f.key[1..1 + sl],
                    key: &f.key[1 + sl..],
                }
            }
        }
    }

    fn fingerprint(&self) -> Fingerprint {
        match self {
            Slot::Done(d) => {
                let mut fp = [0u8; 32];
                fp.copy_from_slice(&d[FP..FP + 32]);
                Fingerprint(fp)
            }
            Slot::Flight(f) => f.fingerprint,
        }
    }

    /// Bytes counted against the byte cap.
    fn size(&self) -> usize {
        match self {
            Slot::Done(d) => usize::try_from(read_u64(d, SIZE)).unwrap_or(usize::MAX),
            Slot::Flight(f) => RECORD_OVERHEAD + f.key.len() - 1,
        }
    }

    /// The completion order of a completed record.
    fn done_seq(&self) -> Option<u64> {
        match self {
            Slot::Done(d) => Some(read_u64(d, SEQ)),
            Slot::Flight(_) => None,
        }
    }

    fn flight_fence(&self) -> Option<u64> {
        match self {
            Slot::Flight(f) => Some(f.fence),
            Slot::Done(_) => None,
        }
    }
}

// ---- shards -------------------------------------------------------------

#[derive(Default)]
struct Shard {
    table: HashTable<Slot>,
    /// Completed records by (expiry, completion order), soonest first. Lazy:
    /// an entry whose record was deleted or replaced stays until it reaches
    /// the top or the heap is compacted; `dead` counts those.
    expiry: BinaryHeap<Reverse<(Millis, u64, u64)>>,
    dead: usize,
    /// In-flight records by (lease end, fence, hash): exact.
    leases: BTreeSet<(Millis, u64, u64)>,
}

/// Keeps shards on separate cache lines.
#[repr(align(128))]
struct Padded(Mutex<Shard>);

struct Shared {
    shards: Box<[Padded]>,
    hasher: DefaultHashBuilder,
    /// Records held plus those being added (reserved).
    entries: AtomicUsize,
    /// Bytes held plus those being added (reserved).
    bytes: AtomicUsize,
    next_fence: AtomicU64,
    next_seq: AtomicU64,
    /// `idem_memory_store_records` and `idem_memory_store_bytes`.
    gauges: Gauges,
}

/// The gauges of [`MemoryStore::len`] and [`MemoryStore::bytes`]
/// (registered when the store is made), set after every step that can
/// change them. With several memory stores in one process the last step
/// of any of them sets the values.
struct Gauges {
    records: metrics::Gauge,
    bytes: metrics::Gauge,
}

/// Sets the gauges when a step ends, whichever way it returns.
struct Publish<'a>(&'a Shared);

impl Drop for Publish<'_> {
    fn drop(&mut self) {
        let sh = self.0;
        let g = &sh.gauges;
        g.records.set(sh.entries.load(Ordering::Relaxed) as f64);
        g.bytes.set(sh.bytes.load(Ordering::Relaxed) as f64);
    }
}

impl fmt::Debug for Shared {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Shared")
            .field("shards", &self.shards.len())
            .field("entries", &self.entries.load(Ordering::Relaxed))
            .field("bytes", &self.bytes.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl Shared {
    fn hash(&self, k: KeyRef<'_>) -> u64 {
        let mut h = self.hasher.build_hasher();
        h.write_usize(k.scope.len());
        h.write(k.scope);
        h.write(k.key);
        h.finish()
    }

    fn shard_of(&self, hash: u64) -> usize {
        // The table uses the low bits (bucket) and the top 7 (tag): take
        // others, or every record in a shard would share its low bits.
        (hash >> 40) as usize & (SHARDS - 1)
    }

    fn lock(&self, i: usize) -> MutexGuard<'_, Shard> {
        // A panic while holding the lock cannot leave a half-applied step:
        // every step mutates only after all checks, so the data is consistent.
        self.shards[i].0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes `entries` records and `bytes` bytes from the caps; `false` (and
    /// nothing taken) when they do not fit.
    fn try_reserve(&self, entries: usize, bytes: usize, limits: &MemoryLimits) -> bool {
        if entries > 0 {
            let held = self.entries.fetch_add(entries, Ordering::AcqRel);
            if held.saturating_add(entries) > limits.max_entries {
                self.entries.fetch_sub(entries, Ordering::AcqRel);
                return false;
            }
        }
        if bytes > 0 {
            let held = self.bytes.fetch_add(bytes, Ordering::AcqRel);
            if held.saturating_add(bytes) > limits.max_bytes {
                self.bytes.fetch_sub(bytes, Ordering::AcqRel);
                self.entries.fetch_sub(entries, Ordering::AcqRel);
                return false;
            }
        }
        true
    }

    fn has_room(&self, entries: usize, bytes: usize, limits: &MemoryLimits) -> bool {
        self.entries.load(Ordering::Acquire).saturating_add(entries) <= limits.max_entries
            && self.bytes.load(Ordering::Acquire).saturating_add(bytes) <= limits.max_bytes
    }

    fn full(&self, extra: usize, limits: &MemoryLimits) -> StoreError {
        StoreError::Full {
            detail: format!(
                "{} records, {} bytes held, {extra} bytes wanted; limits {} records, {} bytes",
                self.entries.load(Ordering::Relaxed),
                self.bytes.load(Ordering::Relaxed),
                limits.max_entries,
                limits.max_bytes
            ),
        }
    }

    /// Removes the record `(hash, k)` from shard `s`, releasing its entry and
    /// bytes and waking its waiters. `expired_top`: it is being removed
    /// through its expiry-heap entry (already popped), so no entry goes dead.
    fn remove(
        &self,
        s: &mut Shard,
        hash: u64,
        eq: impl FnMut(&Slot) -> bool,
        expired_top: bool,
    ) -> Option<Slot> {
        let (slot, _) = s.table.find_entry(hash, eq).ok()?.remove();
        self.entries.fetch_sub(1, Ordering::AcqRel);
        self.bytes.fetch_sub(slot.size(), Ordering::AcqRel);
        match &slot {
            Slot::Done(_) => {
                if !expired_top {
                    s.dead += 1;
                    self.compact(s);
                }
            }
            Slot::Flight(f) => {
                s.leases.remove(&(f.lease_until, f.fence, hash));
                if let Some(w) = &f.waiters {
                    w.notify_waiters();
                }
            }
        }
        Some(slot)
    }

    /// Rebuilds a shard's expiry heap once most of it is dead entries.
    fn compact(&self, s: &mut Shard) {
        if s.dead < 1024 || s.dead * 2 < s.expiry.len() {
            return;
        }
        let heap = std::mem::take(&mut s.expiry);
        let table = &s.table;
        s.expiry = heap
            .into_iter()
            .filter(|Reverse((_, seq, hash))| {
                table
                    .find(*hash, |sl| sl.done_seq() == Some(*seq))
                    .is_some()
            })
            .collect();
        s.dead = 0;
    }

    /// Pops dead entries off the top of a shard's expiry heap and returns
    /// the first live one (its record still completed with that seq).
    fn clean_top(&self, s: &mut Shard) -> Option<(Millis, u64, u64)> {
        while let Some(&Reverse(top)) = s.expiry.peek() {
            let (_, seq, hash) = top;
            if s.table
                .find(hash, |sl| sl.done_seq() == Some(seq))
                .is_some()
            {
                return Some(top);
            }
            s.expiry.pop();
            s.dead = s.dead.saturating_sub(1);
        }
        None
    }

    /// Removes the completed record that expires first in shard `s` if it
    /// has expired by `now` (or in any case when `live` is set). `None` when
    /// there is none.
    fn pop_completed(&self, s: &mut Shard, now: Millis, live: bool) -> Option<()> {
        let (at, seq, hash) = self.clean_top(s)?;
        if at > now && !live {
            return None;
        }
        s.expiry.pop();
        self.remove(s, hash, |sl| sl.done_seq() == Some(seq), true);
        Some(())
    }

    /// The first claim of shard `s` whose lease ended by `now`, skipping the
    /// claim with fence `keep`.
    fn first_stale(s: &Shard, now: Millis, keep: Option<u64>) -> Option<(Millis, u64, u64)> {
        s.leases
            .iter()
            .take_while(|(until, _, _)| *until <= now)
            .find(|(_, fence, _)| Some(*fence) != keep)
            .copied()
    }

    fn remove_claim(&self, s: &mut Shard, (until, fence, hash): (Millis, u64, u64)) -> bool {
        if !s.leases.contains(&(until, fence, hash)) {
            return false;
        }
        self.remove(s, hash, |sl| sl.flight_fence() == Some(fence), false)
            .is_some()
    }

    /// Makes room for `entries` more records and `bytes` more bytes,
    /// evicting in this order: expired completed records, in-flight records
    /// whose lease has ended (the oldest lease end first; never the claim
    /// with fence `keep`), then — only with
    /// [`MemoryLimits::evict_live_results`] — the live completed records that
    /// expire soonest (oldest first for equal expiry). Live in-flight
    /// records are never evicted: that would let a second execution start.
    ///
    /// Takes one shard lock at a time; the caller holds none.
    fn make_room(
        &self,
        now: Millis,
        entries: usize,
        bytes: usize,
        keep: Option<u64>,
        limits: &MemoryLimits,
    ) -> Result<(), StoreError> {
        let room = || self.has_room(entries, bytes, limits);
        // 1. Expired completed records, shard by shard.
        for i in 0..SHARDS {
            if room() {
                return Ok(());
            }
            let mut s = self.lock(i);
            while !room() && self.pop_completed(&mut s, now, false).is_some() {}
        }
        // 2. Claims whose lease ended, the oldest lease end store-wide first.
        while !room() {
            let oldest = (0..SHARDS)
                .filter_map(|i| Self::first_stale(&self.lock(i), now, keep).map(|c| (c, i)))
                .min();
            let Some((claim, i)) = oldest else { break };
            self.remove_claim(&mut self.lock(i), claim);
        }
        // 3. Live completed records, soonest to expire first — only when the
        //    owner opted in: an evicted result would run again.
        while limits.evict_live_results && !room() {
            let soonest = (0..SHARDS)
                .filter_map(|i| self.clean_top(&mut self.lock(i)).map(|t| (t, i)))
                .min();
            let Some(((_, seq, hash), i)) = soonest else {
                break;
            };
            let mut s = self.lock(i);
            if self.clean_top(&mut s).map(|(_, q, _)| q) == Some(seq) {
                s.expiry.pop();
                self.remove(&mut s, hash, |sl| sl.done_seq() == Some(seq), true);
            }
        }
        if room() {
            Ok(())
        } else {
            // Only live records remain: refuse rather than lose one.
            Err(self.full(bytes, limits))
        }
    }
}

/// An in-process [`Store`]: 64 shards, each a lock around a hash table, so
/// every step on a key is atomic; TTL expiry checked on access and by
/// [`Store::purge_expired`]; caps on entries and bytes where expired results
/// and claims whose lease ended are evicted first. Live records are kept:
/// when only they fill the store, `begin` (and a `complete` that needs more
/// room) fails with [`StoreError::Full`], unless
/// [`MemoryLimits::evict_live_results`] allows evicting the live results
/// that expire soonest. Live in-flight records are never evicted.
///
/// Fences come from one store-wide counter, so they grow across expiry.
/// Memory: a completed record is one allocation holding its key, fingerprint
/// and response, plus about 40 bytes of table and expiry index
/// (`cargo bench -p idem-core --bench memory_per_record` measures it).
/// Nothing survives the process: use it for tests and single-process services.
///
/// ```
/// use idem_core::{MemoryStore, ManualClock};
/// let clock = ManualClock::starting_now();
/// let store = MemoryStore::new().with_clock(clock.clone());
/// ```
#[derive(Debug, Clone)]
pub struct MemoryStore {
    inner: Arc<Shared>,
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
        let shards = (0..SHARDS)
            .map(|_| {
                Padded(Mutex::new(Shard {
                    table: HashTable::with_capacity(SHARD_CAPACITY),
                    ..Shard::default()
                }))
            })
            .collect();
        Self {
            inner: Arc::new(Shared {
                shards,
                hasher: DefaultHashBuilder::default(),
                entries: AtomicUsize::new(0),
                bytes: AtomicUsize::new(0),
                next_fence: AtomicU64::new(1),
                next_seq: AtomicU64::new(0),
                gauges: Gauges {
                    records: metrics::gauge!("idem_memory_store_records"),
                    bytes: metrics::gauge!("idem_memory_store_bytes"),
                },
            }),
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
        self.inner.entries.load(Ordering::Acquire)
    }

    /// Whether the store holds no record.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes counted against [`MemoryLimits::max_bytes`].
    pub fn bytes(&self) -> usize {
        self.inner.bytes.load(Ordering::Acquire)
    }
}

fn lease_lost(fence: u64) -> StoreError {
    StoreError::LeaseLost { fence }
}

fn owned_key(k: KeyRef<'_>) -> Box<[u8]> {
    let mut v = Vec::with_capacity(1 + k.len());
    v.push(k.lens().0);
    v.extend_from_slice(k.scope);
    v.extend_from_slice(k.key);
    v.into_boxed_slice()
}

#[async_trait]
impl Store for MemoryStore {
    async fn begin(&self, req: &BeginRequest) -> Result<Begin, StoreError> {
        let _publish = Publish(&self.inner);
        let now = self.clock.now();
        let sh = &*self.inner;
        let limits = &self.limits;
        let k = KeyRef::of(&req.scope, &req.key);
        let hash = sh.hash(k);
        let shard = sh.shard_of(hash);
        let size = entry_size(k, None);
        // Stays set across attempts: an ended claim removed in an attempt
        // that then found no room was still taken over.
        let mut took_over = false;
        for attempt in 1.. {
            {
                let mut s = sh.lock(shard);
                if let Some(slot) = s.table.find(hash, |sl| sl.key() == k) {
                    let same = slot.fingerprint() == req.fingerprint;
                    match slot {
                        // An ended claim is taken over only by the same
                        // request; for another it answers as a live one.
                        Slot::Flight(f) if f.lease_until > now || !same => {
                            return Ok(if same {
                                Begin::InFlight {
                                    retry_after: now.until(f.lease_until),
                                }
                            } else {
                                Begin::Mismatch
                            });
                        }
                        Slot::Done(d) if Millis(read_u64(d, EXPIRES)) > now => {
                            return Ok(if same {
                                Begin::Replay(decode_response(d))
                            } else {
                                Begin::Mismatch
                            });
                        }
                        _ => {
                            took_over |= matches!(slot, Slot::Flight(_));
                            sh.remove(&mut s, hash, |sl| sl.key() == k, false);
                        }
                    }
                }
                if size > limits.max_bytes || limits.max_entries == 0 {
                    return Err(sh.full(size, limits));
                }
                if sh.try_reserve(1, size, limits) {
                    let fence = sh.next_fence.fetch_add(1, Ordering::AcqRel);
                    let until = now.add(req.lease);
                    s.leases.insert((until, fence, hash));
                    let slot = Slot::Flight(Box::new(Flight {
                        key: owned_key(k),
                        fingerprint: req.fingerprint,
                        fence,
                        lease_until: until,
                        held: None,
                        waiters: None,
                    }));
                    s.table.insert_unique(hash, slot, |sl| sh.hash(sl.key()));
                    return Ok(Begin::Acquired(Lease {
                        scope: req.scope.clone(),
                        key: req.key.clone(),
                        fence,
                        until,
                        took_over,
                    }));
                }
            }
            if attempt >= ATTEMPTS {
                break;
            }
            sh.make_room(now, 1, size, None, limits)?;
        }
        Err(sh.full(size, limits))
    }

    async fn complete(
        &self,
        lease: &Lease,
        response: &StoredResponse,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        let _publish = Publish(&self.inner);
        let now = self.clock.now();
        let sh = &*self.inner;
        let limits = &self.limits;
        let k = KeyRef::of(&lease.scope, &lease.key);
        let hash = sh.hash(k);
        let shard = sh.shard_of(hash);
        let size = entry_size(k, Some(response));
        let ours = |sl: &Slot| sl.flight_fence() == Some(lease.fence) && sl.key() == k;
        for attempt in 1.. {
            let grow;
            {
                let mut s = sh.lock(shard);
                let Some(old) = s.table.find(hash, ours).map(Slot::size) else {
                    return Err(lease_lost(lease.fence));
                };
                if size > limits.max_bytes {
                    // Nothing could make room: the key stays in flight (never
                    // freed for a second run), with the lease the store holds.
                    return Err(sh.full(size, limits));
                }
                grow = size.saturating_sub(old);
                if sh.try_reserve(0, grow, limits) {
                    if old > size {
                        sh.bytes.fetch_sub(old - size, Ordering::AcqRel);
                    }
                    let seq = sh.next_seq.fetch_add(1, Ordering::AcqRel);
                    let expires_at = now.add(ttl);
                    let Shard { table, leases, .. } = &mut *s;
                    let Some(slot) = table.find_mut(hash, ours) else {
                        return Err(lease_lost(lease.fence));
                    };
                    let done = encode_done(&slot.fingerprint(), expires_at, seq, size, k, response);
                    if let Slot::Flight(f) = std::mem::replace(slot, Slot::Done(done)) {
                        leases.remove(&(f.lease_until, f.fence, hash));
                        if let Some(w) = &f.waiters {
                            w.notify_waiters();
                        }
                    }
                    s.expiry.push(Reverse((expires_at, seq, hash)));
                    return Ok(());
                }
            }
            if attempt >= ATTEMPTS {
                break;
            }
            sh.make_room(now, 0, grow, Some(lease.fence), limits)?;
        }
        Err(sh.full(size, limits))
    }

    async fn release(&self, lease: &Lease) -> Result<(), StoreError> {
        let _publish = Publish(&self.inner);
        let sh = &*self.inner;
        let k = KeyRef::of(&lease.scope, &lease.key);
        let hash = sh.hash(k);
        let mut s = sh.lock(sh.shard_of(hash));
        match sh.remove(
            &mut s,
            hash,
            |sl| sl.flight_fence() == Some(lease.fence) && sl.key() == k,
            false,
        ) {
            Some(_) => Ok(()),
            None => Err(lease_lost(lease.fence)),
        }
    }

    async fn extend(&self, lease: &Lease, lease_for: Duration) -> Result<Lease, StoreError> {
        let now = self.clock.now();
        let sh = &*self.inner;
        let k = KeyRef::of(&lease.scope, &lease.key);
        let hash = sh.hash(k);
        let mut s = sh.lock(sh.shard_of(hash));
        let Shard { table, leases, .. } = &mut *s;
        let until = now.add(lease_for);
        match table.find_mut(hash, |sl| sl.key() == k) {
            Some(Slot::Flight(f)) if f.fence == lease.fence => {
                leases.remove(&(f.lease_until, f.fence, hash));
                leases.insert((until, f.fence, hash));
                f.lease_until = until;
            }
            _ => return Err(lease_lost(lease.fence)),
        }
        Ok(Lease {
            until,
            ..lease.clone()
        })
    }

    async fn hold(
        &self,
        lease: &Lease,
        reason: HoldReason,
        hold_for: Duration,
    ) -> Result<Lease, StoreError> {
        let now = self.clock.now();
        let sh = &*self.inner;
        let k = KeyRef::of(&lease.scope, &lease.key);
        let hash = sh.hash(k);
        let mut s = sh.lock(sh.shard_of(hash));
        let Shard { table, leases, .. } = &mut *s;
        match table.find_mut(hash, |sl| sl.key() == k) {
            Some(Slot::Flight(f)) if f.fence == lease.fence => {
                let until = f.lease_until.max(now.add(hold_for));
                leases.remove(&(f.lease_until, f.fence, hash));
                leases.insert((until, f.fence, hash));
                f.lease_until = until;
                f.held = Some(reason);
                Ok(Lease {
                    until,
                    ..lease.clone()
                })
            }
            _ => Err(lease_lost(lease.fence)),
        }
    }

    async fn get(&self, scope: &Scope, key: &IdempotencyKey) -> Result<Option<Record>, StoreError> {
        let now = self.clock.now();
        let sh = &*self.inner;
        let k = KeyRef::of(scope, key);
        let hash = sh.hash(k);
        let s = sh.lock(sh.shard_of(hash));
        Ok(s.table.find(hash, |sl| sl.key() == k).and_then(|slot| {
            let state = match slot {
                Slot::Flight(f) if f.lease_until > now => RecordState::InProgress {
                    fence: f.fence,
                    lease_until: f.lease_until,
                    held: f.held,
                },
                Slot::Done(d) if Millis(read_u64(d, EXPIRES)) > now => RecordState::Completed {
                    response: decode_response(d),
                    expires_at: Millis(read_u64(d, EXPIRES)),
                },
                _ => return None,
            };
            Some(Record {
                fingerprint: slot.fingerprint(),
                state,
            })
        }))
    }

    async fn delete(&self, scope: &Scope, key: &IdempotencyKey) -> Result<bool, StoreError> {
        let _publish = Publish(&self.inner);
        let sh = &*self.inner;
        let k = KeyRef::of(scope, key);
        let hash = sh.hash(k);
        let mut s = sh.lock(sh.shard_of(hash));
        Ok(sh.remove(&mut s, hash, |sl| sl.key() == k, false).is_some())
    }

    async fn purge_expired(&self) -> Result<u64, StoreError> {
        let _publish = Publish(&self.inner);
        let now = self.clock.now();
        let sh = &*self.inner;
        let mut n = 0;
        for i in 0..SHARDS {
            let mut s = sh.lock(i);
            while sh.pop_completed(&mut s, now, false).is_some() {
                n += 1;
            }
            while let Some(claim) = Shared::first_stale(&s, now, None) {
                if sh.remove_claim(&mut s, claim) {
                    n += 1;
                } else {
                    // Cannot happen (the lease index is exact); never loop.
                    s.leases.remove(&claim);
                }
            }
        }
        Ok(n)
    }

    async fn wait_for_change(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        max: Duration,
    ) -> Result<(), StoreError> {
        let sh = &*self.inner;
        let k = KeyRef::of(scope, key);
        let hash = sh.hash(k);
        let shard = sh.shard_of(hash);
        let (notify, fence) = {
            let mut s = sh.lock(shard);
            match s.table.find_mut(hash, |sl| sl.key() == k) {
                Some(Slot::Flight(f)) => (
                    f.waiters
                        .get_or_insert_with(|| Arc::new(Notify::new()))
                        .clone(),
                    f.fence,
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
            let s = sh.lock(shard);
            s.table
                .find(hash, |sl| sl.flight_fence() == Some(fence) && sl.key() == k)
                .is_some()
        };
        if unchanged {
            let _ = tokio::time::timeout(max, notified).await;
        }
        Ok(())
    }

    fn admin(&self) -> Option<&dyn KeyAdmin> {
        Some(self)
    }
}

// ---- listing (KeyAdmin) -------------------------------------------------

/// Where a record sits in a listing: in-flight records first, newest claim
/// (highest fence) first, then completed ones, latest completion first.
/// Ordered so that the greatest comes first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum ListPos {
    /// A completed record by its completion order.
    Done(u64),
    /// An in-flight record by its fence.
    Flight(u64),
}

impl ListPos {
    /// The cursor naming the records after this one: `f<fence>` or `c<seq>`.
    fn cursor(self) -> String {
        match self {
            ListPos::Flight(f) => format!("f{f}"),
            ListPos::Done(s) => format!("c{s}"),
        }
    }

    fn parse(cursor: &str) -> Result<Self, StoreError> {
        let bad = || {
            StoreError::Invalid(format!(
                "list cursor {cursor:?} was not made by the memory store"
            ))
        };
        let (tag, n) = cursor.split_at_checked(1).ok_or_else(bad)?;
        if n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad());
        }
        let n: u64 = n.parse().map_err(|_| bad())?;
        match tag {
            "f" => Ok(ListPos::Flight(n)),
            "c" => Ok(ListPos::Done(n)),
            _ => Err(bad()),
        }
    }
}

/// A listed record as copied out of its shard (a completed record's bytes
/// are shared, not copied), decoded once the page is chosen.
enum Snapshot {
    Done(Arc<[u8]>),
    Flight {
        key: Box<[u8]>,
        fingerprint: Fingerprint,
        fence: u64,
        lease_until: Millis,
        held: Option<HoldReason>,
    },
}

struct Listed {
    pos: ListPos,
    snap: Snapshot,
}

impl PartialEq for Listed {
    fn eq(&self, other: &Self) -> bool {
        self.pos == other.pos
    }
}
impl Eq for Listed {}
impl PartialOrd for Listed {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Listed {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.pos.cmp(&other.pos)
    }
}

impl Listed {
    fn decode(self) -> Result<ListedRecord, StoreError> {
        let corrupt = |what: &str| StoreError::corrupt(crate::Phase::List, what.to_owned());
        let text = |b: &[u8], what: &str| {
            std::str::from_utf8(b)
                .map(str::to_owned)
                .map_err(|_| corrupt(what))
        };
        let (k, fingerprint, state) = match &self.snap {
            Snapshot::Done(d) => {
                let slot = Slot::Done(Arc::clone(d));
                let k = slot.key();
                let k = (k.scope.to_vec(), k.key.to_vec());
                (
                    k,
                    slot.fingerprint(),
                    RecordState::Completed {
                        response: decode_response(d),
                        expires_at: Millis(read_u64(d, EXPIRES)),
                    },
                )
            }
            Snapshot::Flight {
                key,
                fingerprint,
                fence,
                lease_until,
                held,
            } => {
                let sl = usize::from(key[0]);
                (
                    (key[1..1 + sl].to_vec(), key[1 + sl..].to_vec()),
                    *fingerprint,
                    RecordState::InProgress {
                        fence: *fence,
                        lease_until: *lease_until,
                        held: *held,
                    },
                )
            }
        };
        let scope =
            Scope::new(text(&k.0, "scope is not UTF-8")?).map_err(|e| corrupt(&e.to_string()))?;
        let key = IdempotencyKey::new(text(&k.1, "key is not UTF-8")?)
            .map_err(|e| corrupt(&e.to_string()))?;
        Ok(ListedRecord {
            scope,
            key,
            record: Record { fingerprint, state },
        })
    }
}

/// Lists records in-flight first (newest claim, i.e. highest fence, first),
/// then completed (latest completion first); the cursor is `f<fence>` or
/// `c<seq>`, the position of the last record of the page. In-flight records
/// whose lease has ended are listed (until a `begin` takes them over or a
/// purge removes them); completed records past their TTL are not.
///
/// Each page scans every shard (one lock at a time), whatever the limit:
/// with a million records a page took 55–95 ms in a release build on a
/// shared 2-core machine (limit 100 or 1,000, any state or in flight only),
/// each shard's lock held for about 1/64 of that.
#[async_trait]
impl KeyAdmin for MemoryStore {
    async fn list(&self, query: &ListQuery) -> Result<ListPage, StoreError> {
        query.validate()?;
        let after = query.cursor.as_deref().map(ListPos::parse).transpose()?;
        let now = self.clock.now();
        let sh = &*self.inner;
        let scope = query.scope.as_ref().map(|s| s.as_str().as_bytes());
        let want_flight = query.state != StateFilter::Completed;
        let want_done = query.state != StateFilter::InFlight;
        // The `limit + 1` greatest positions below the cursor (a min-heap:
        // its top is the smallest kept); the extra one says a next page exists.
        let keep = query.limit + 1;
        let mut best: BinaryHeap<Reverse<Listed>> = BinaryHeap::with_capacity(keep + 1);
        for i in 0..SHARDS {
            let s = sh.lock(i);
            for slot in s.table.iter() {
                if scope.is_some_and(|sc| slot.key().scope != sc) {
                    continue;
                }
                let pos = match slot {
                    Slot::Flight(f) if want_flight => ListPos::Flight(f.fence),
                    Slot::Done(d) if want_done && Millis(read_u64(d, EXPIRES)) > now => {
                        ListPos::Done(read_u64(d, SEQ))
                    }
                    _ => continue,
                };
                if after.is_some_and(|a| pos >= a) {
                    continue;
                }
                if best.len() == keep && best.peek().is_some_and(|Reverse(m)| pos <= m.pos) {
                    continue;
                }
                let snap = match slot {
                    Slot::Done(d) => Snapshot::Done(Arc::clone(d)),
                    Slot::Flight(f) => Snapshot::Flight {
                        key: f.key.clone(),
                        fingerprint: f.fingerprint,
                        fence: f.fence,
                        lease_until: f.lease_until,
                        held: f.held,
                    },
                };
                best.push(Reverse(Listed { pos, snap }));
                if best.len() > keep {
                    best.pop();
                }
            }
        }
        let mut picked: Vec<Listed> = best.into_iter().map(|Reverse(l)| l).collect();
        picked.sort_unstable_by_key(|l| Reverse(l.pos));
        let next = if picked.len() > query.limit {
            picked.truncate(query.limit);
            picked.last().map(|l| l.pos.cursor())
        } else {
            None
        };
        let records = picked
            .into_iter()
            .map(Listed::decode)
            .collect::<Result<_, _>>()?;
        Ok(ListPage { records, next })
    }

    /// In flight newest claim first, completed latest completion first.
    fn newest_first(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip_and_share_the_body() {
        let k = KeyRef {
            scope: b"tenant",
            key: b"k-1",
        };
        let resp = StoredResponse {
            status: 201,
            headers: vec![
                ("set-cookie".into(), b"a=1".to_vec()),
                ("x-long".into(), vec![b'v'; 300]),
                ("set-cookie".into(), b"b=2".to_vec()),
            ],
            body: Bytes::from_static(&[0, 159, 146, 150, 255]),
            body_omitted: true,
            released: true,
        };
        let fp = Fingerprint::of(b"x");
        let size = entry_size(k, Some(&resp));
        let rec = encode_done(&fp, Millis(7), 9, size, k, &resp);
        let slot = Slot::Done(rec.clone());
        assert_eq!(decode_response(&rec), resp);
        assert!(slot.key() == k);
        assert_eq!(slot.fingerprint(), fp);
        assert_eq!(slot.size(), size);
        assert_eq!(slot.done_seq(), Some(9));
        assert_eq!(read_u64(&rec, EXPIRES), 7);
        let empty = encode_done(&fp, Millis(1), 1, 0, k, &StoredResponse::new(204, ""));
        assert_eq!(decode_response(&empty), StoredResponse::new(204, ""));
    }

    #[test]
    fn varints_round_trip() {
        for n in [0usize, 1, 127, 128, 300, 16_383, 16_384, usize::MAX] {
            let mut out = Vec::new();
            put_varint(&mut out, n);
            assert_eq!(out.len(), varint_len(n));
            assert_eq!(Cursor { buf: &out, at: 0 }.varint(), Some(n));
        }
        assert_eq!(
            Cursor {
                buf: &[0x80],
                at: 0
            }
            .varint(),
            None
        );
    }

    #[test]
    fn slots_stay_small() {
        assert!(std::mem::size_of::<Slot>() <= 24);
    }
}

#[cfg(test)]
mod list_tests {
    use super::*;
    use crate::ManualClock;

    fn req(scope: &str, key: &str) -> BeginRequest {
        BeginRequest {
            scope: Scope::new(scope).unwrap(),
            key: IdempotencyKey::new(key).unwrap(),
            fingerprint: Fingerprint::of(key.as_bytes()),
            lease: Duration::from_secs(2),
        }
    }

    async fn claim(store: &MemoryStore, scope: &str, key: &str) -> Lease {
        match store.begin(&req(scope, key)).await.unwrap() {
            Begin::Acquired(l) => l,
            other => panic!("{other:?}"),
        }
    }

    fn keys(page: &ListPage) -> Vec<&str> {
        page.records.iter().map(|r| r.key.as_str()).collect()
    }

    async fn list(store: &MemoryStore, q: ListQuery) -> ListPage {
        store.admin().unwrap().list(&q).await.unwrap()
    }

    #[tokio::test]
    async fn in_flight_first_newest_first_then_completed_latest_first() {
        let clock = ManualClock::starting_now();
        let store = MemoryStore::new().with_clock(clock.clone());
        let a = claim(&store, "s", "a").await;
        let b = claim(&store, "s", "b").await;
        let _c = claim(&store, "t", "c").await;
        let _d = claim(&store, "s", "d").await;
        let ttl = Duration::from_secs(60);
        store
            .complete(&b, &StoredResponse::new(201, "bee"), ttl)
            .await
            .unwrap();
        store
            .complete(&a, &StoredResponse::new(200, "a"), ttl)
            .await
            .unwrap();

        let all = list(&store, ListQuery::default()).await;
        assert_eq!(keys(&all), ["d", "c", "a", "b"]);
        assert_eq!(all.next, None);
        match &all.records[3].record.state {
            RecordState::Completed { response, .. } => {
                assert_eq!((response.status, &response.body[..]), (201, &b"bee"[..]));
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(all.records[3].record.fingerprint, Fingerprint::of(b"b"));
        assert!(matches!(
            all.records[0].record.state,
            RecordState::InProgress { fence, .. } if fence == _d.fence
        ));

        let q = |state, scope: Option<&str>| ListQuery {
            state,
            scope: scope.map(|s| Scope::new(s).unwrap()),
            ..ListQuery::default()
        };
        assert_eq!(
            keys(&list(&store, q(StateFilter::InFlight, None)).await),
            ["d", "c"]
        );
        assert_eq!(
            keys(&list(&store, q(StateFilter::Completed, None)).await),
            ["a", "b"]
        );
        assert_eq!(
            keys(&list(&store, q(StateFilter::Any, Some("s"))).await),
            ["d", "a", "b"]
        );
        assert_eq!(
            keys(&list(&store, q(StateFilter::InFlight, Some("t"))).await),
            ["c"]
        );
        assert!(list(&store, q(StateFilter::Any, Some("u")))
            .await
            .records
            .is_empty());
    }

    #[tokio::test]
    async fn pages_follow_the_cursor_without_gaps_or_repeats() {
        let store = MemoryStore::new();
        let mut leases = Vec::new();
        for i in 0..25 {
            leases.push(claim(&store, "s", &format!("k{i:02}")).await);
        }
        for l in leases.iter().step_by(2) {
            store
                .complete(l, &StoredResponse::new(200, "x"), Duration::from_secs(60))
                .await
                .unwrap();
        }
        let mut seen = Vec::new();
        let mut cursor = None;
        let mut pages = 0;
        loop {
            let page = list(
                &store,
                ListQuery {
                    limit: 7,
                    cursor: cursor.take(),
                    ..ListQuery::default()
                },
            )
            .await;
            pages += 1;
            assert!(page.records.len() <= 7);
            seen.extend(page.records.iter().map(|r| r.key.as_str().to_owned()));
            match page.next {
                Some(n) => cursor = Some(n),
                None => break,
            }
        }
        assert_eq!(pages, 4);
        let mut sorted = seen.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(sorted.len(), 25, "{seen:?}");
        // In flight (odd, newest first), then completed (even, latest first).
        assert_eq!(seen[0], "k23");
        assert_eq!(seen[12], "k24");
        assert_eq!(seen[24], "k00");

        // A page that ends exactly at the last record has no next page.
        let exact = list(
            &store,
            ListQuery {
                limit: 25,
                ..ListQuery::default()
            },
        )
        .await;
        assert_eq!((exact.records.len(), exact.next), (25, None));
    }

    #[tokio::test]
    async fn expired_results_are_hidden_ended_leases_are_listed() {
        let clock = ManualClock::starting_now();
        let store = MemoryStore::new().with_clock(clock.clone());
        let done = claim(&store, "s", "done").await;
        store
            .complete(&done, &StoredResponse::new(200, ""), Duration::from_secs(1))
            .await
            .unwrap();
        let _stuck = claim(&store, "s", "stuck").await;
        clock.advance(Duration::from_secs(3));
        let page = list(&store, ListQuery::default()).await;
        assert_eq!(keys(&page), ["stuck"]);
        assert_eq!(store.purge_expired().await.unwrap(), 2);
        assert!(list(&store, ListQuery::default()).await.records.is_empty());
    }

    #[tokio::test]
    async fn bad_limits_and_foreign_cursors_are_invalid() {
        let store = MemoryStore::new();
        let admin = store.admin().unwrap();
        for q in [
            ListQuery {
                limit: 0,
                ..ListQuery::default()
            },
            ListQuery {
                limit: crate::admin::MAX_LIST_LIMIT + 1,
                ..ListQuery::default()
            },
            ListQuery {
                cursor: Some("x12".into()),
                ..ListQuery::default()
            },
            ListQuery {
                cursor: Some("f".into()),
                ..ListQuery::default()
            },
            ListQuery {
                cursor: Some("f+1".into()),
                ..ListQuery::default()
            },
            ListQuery {
                cursor: Some("c99999999999999999999999".into()),
                ..ListQuery::default()
            },
            ListQuery {
                cursor: Some(String::new()),
                ..ListQuery::default()
            },
        ] {
            match admin.list(&q).await {
                Err(StoreError::Invalid(_)) => {}
                other => panic!("{q:?}: {other:?}"),
            }
        }
        assert!(ListPos::parse("é").is_err());
        assert_eq!(
            ListPos::parse(&ListPos::Flight(7).cursor()).unwrap(),
            ListPos::Flight(7)
        );
        assert_eq!(
            ListPos::parse(&ListPos::Done(0).cursor()).unwrap(),
            ListPos::Done(0)
        );
    }
}
