//! Group commit: one writer thread per [`SqliteStore`](super::SqliteStore)
//! takes the write steps (claims, completes, releases, extends, holds,
//! deletes, purge rounds) of every concurrent caller and commits them
//! together in one `BEGIN IMMEDIATE … COMMIT`, so N steps cost one fsync
//! instead of N (`synchronous = FULL`: a step is answered only after the
//! commit that holds it is on disk).
//!
//! - **No added wait.** The writer takes whatever is queued when it is free
//!   (at least one step, at most [`SqliteOptions::max_batch`](super::SqliteOptions::max_batch));
//!   it never waits for more. An idle store commits a lone step at once;
//!   under load, steps queue while the previous batch commits and go into
//!   the next one.
//! - **Each step keeps its semantics.** Steps run in arrival order on one
//!   connection inside one transaction, each seeing the ones before it (two
//!   claims of one key in one batch: the second sees the first's claim).
//!   Each reads the time from its store's clock when it runs, after the
//!   write lock is held. A step's own answer (a lost lease, a corrupt row)
//!   is that step's alone; only a failed statement or commit touches the
//!   batch.
//! - **Failures.** When `BEGIN IMMEDIATE` or `COMMIT` fails (a busy
//!   database past the busy timeout, a full disk), nothing of the batch was
//!   written and every step in it gets that error as
//!   [`StoreError::Unavailable`]. When one statement fails, the batch is
//!   rolled back and its steps are run again one per transaction, so one
//!   bad step cannot fail the others. The connection is closed after any
//!   failure and opened afresh for the next batch.
//! - **Its own connection.** The writer opens one rusqlite connection to
//!   the store's file (WAL, `synchronous = FULL`, the store's busy
//!   timeout) and runs every statement on its own thread: no driver round
//!   trip per statement, and none of the work on the callers' runtime.
//!   Statements are prepared once and cached.
//! - **A caller that left.** A claim whose caller stopped waiting (its
//!   future was dropped) before the answer came is released in the next
//!   batch, so a cancelled request never leaves its key claimed until the
//!   lease ends.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idem_core::{
    duration_ms, Begin, BeginRequest, HoldReason, IdempotencyKey, Lease, Phase, Scope, SharedClock,
    StoreError,
};
use rusqlite::{params, OptionalExtension, TransactionBehavior};
use tokio::sync::{mpsc, oneshot};

use super::conn::{is_decode, open, read_record, Target};
use crate::common::{lease_kept, millis, to_i64, IN_PROGRESS};

/// Steps waiting for the writer before a caller's `send` waits too
/// (back-pressure instead of unbounded memory under overload).
const QUEUE: usize = 4096;

/// One write step, as a caller hands it to the writer.
#[derive(Debug)]
pub(super) enum Op {
    /// `absent`: the caller's read just before found no record, so the
    /// claim first tries a plain insert (one statement).
    Claim {
        req: BeginRequest,
        absent: bool,
    },
    Complete {
        lease: Lease,
        blob: Vec<u8>,
        ttl: Duration,
    },
    Release(Lease),
    Extend {
        lease: Lease,
        lease_for: Duration,
    },
    Hold {
        lease: Lease,
        reason: HoldReason,
        hold_for: Duration,
    },
    Delete {
        scope: Scope,
        key: IdempotencyKey,
    },
    /// Removes at most `limit` expired records.
    Purge {
        limit: i64,
    },
}

impl Op {
    fn phase(&self) -> Phase {
        match self {
            Op::Claim { .. } => Phase::Begin,
            Op::Complete { .. } => Phase::Complete,
            Op::Release(_) => Phase::Release,
            Op::Extend { .. } => Phase::Extend,
            Op::Hold { .. } => Phase::Hold,
            Op::Delete { .. } => Phase::Delete,
            Op::Purge { .. } => Phase::Purge,
        }
    }
}

/// What a step came to.
#[derive(Debug)]
pub(super) enum Done {
    Begin(Begin),
    /// `complete` or `release` kept its lease.
    Kept,
    /// `extend` or `hold`: the lease with its new end.
    Lease(Lease),
    Deleted(bool),
    Purged(u64),
}

type Reply = oneshot::Sender<Result<Done, StoreError>>;

#[derive(Debug)]
struct Job {
    op: Op,
    clock: SharedClock,
    /// `None` for a step the writer queued itself (an orphan's release).
    reply: Option<Reply>,
}

/// The handle callers submit steps through; the thread ends when every
/// handle is dropped (after the steps already queued).
#[derive(Debug, Clone)]
pub(super) struct Writer {
    queue: mpsc::Sender<Job>,
    /// Set by [`Self::close`]: later steps fail at once.
    closed: Arc<AtomicBool>,
    /// What the writer did (for tests of the batching).
    #[cfg_attr(not(test), allow(dead_code))]
    counts: Arc<Counts>,
}

/// Counters of the writer's work.
#[derive(Debug, Default)]
struct Counts {
    /// Steps taken from the queue.
    taken: AtomicU64,
    /// Transactions committed.
    commits: AtomicU64,
}

impl Writer {
    /// Starts the writer on a thread of its own, writing to `target`
    /// (opened when the first step comes, and again after a failure). The
    /// thread ends once every handle is dropped and the queue is drained.
    ///
    /// # Errors
    /// [`StoreError::Unavailable`] (phase `Connect`) when the thread cannot
    /// be started.
    pub(super) fn start(target: Target, max_batch: usize) -> Result<Self, StoreError> {
        let (queue, steps) = mpsc::channel(QUEUE);
        let counts = Arc::new(Counts::default());
        let closed = Arc::new(AtomicBool::new(false));
        let (counted, shut) = (Arc::clone(&counts), Arc::clone(&closed));
        std::thread::Builder::new()
            .name("idem-sqlite-writer".into())
            .spawn(move || run(steps, &target, max_batch.max(1), &counted, &shut))
            .map_err(|e| StoreError::unavailable(Phase::Connect, e))?;
        Ok(Self {
            queue,
            closed,
            counts,
        })
    }

    /// Queues `op` and waits for its answer.
    ///
    /// # Errors
    /// The step's own error, or [`StoreError::Unavailable`] when the batch
    /// holding it could not be committed, the store was closed, or the
    /// writer thread is gone.
    pub(super) async fn submit(&self, op: Op, clock: &SharedClock) -> Result<Done, StoreError> {
        let phase = op.phase();
        if self.closed.load(Ordering::Acquire) {
            return Err(closed(phase));
        }
        let (reply, answer) = oneshot::channel();
        let job = Job {
            op,
            clock: Arc::clone(clock),
            reply: Some(reply),
        };
        self.queue.send(job).await.map_err(|_| stopped(phase))?;
        answer.await.map_err(|_| stopped(phase))?
    }

    /// Refuses later steps; the writer closes its connection once the steps
    /// already queued are answered (with [`StoreError::Unavailable`]).
    pub(super) fn close(&self) {
        self.closed.store(true, Ordering::Release);
    }

    /// Transactions committed so far.
    #[cfg(test)]
    pub(super) fn commits(&self) -> u64 {
        self.counts.commits.load(Ordering::Relaxed)
    }

    /// Steps handed to the writer so far: taken by it, or still queued.
    #[cfg(test)]
    pub(super) fn submitted(&self) -> u64 {
        let queued = self.queue.max_capacity() - self.queue.capacity();
        self.counts.taken.load(Ordering::Relaxed) + queued as u64
    }
}

fn stopped(phase: Phase) -> StoreError {
    StoreError::unavailable(
        phase,
        std::io::Error::other("the SQLite writer thread is gone"),
    )
}

fn closed(phase: Phase) -> StoreError {
    StoreError::unavailable(phase, std::io::Error::other("the SQLite store is closed"))
}

fn run(
    mut steps: mpsc::Receiver<Job>,
    target: &Target,
    max_batch: usize,
    counts: &Counts,
    closed: &AtomicBool,
) {
    let mut jobs = Vec::with_capacity(max_batch);
    let mut orphans: Vec<(Lease, SharedClock)> = Vec::new();
    let mut conn: Option<rusqlite::Connection> = None;
    loop {
        if orphans.is_empty() {
            match steps.blocking_recv() {
                Some(job) => jobs.push(job),
                None => return, // every handle dropped and the queue drained
            }
        } else {
            jobs.extend(orphans.drain(..).map(|(lease, clock)| Job {
                op: Op::Release(lease),
                clock,
                reply: None,
            }));
        }
        while jobs.len() < max_batch {
            match steps.try_recv() {
                Ok(job) => jobs.push(job),
                Err(_) => break,
            }
        }
        counts.taken.fetch_add(jobs.len() as u64, Ordering::Relaxed);
        let results = if closed.load(Ordering::Acquire) {
            conn = None;
            jobs.iter().map(|job| Err(closed_err(job))).collect()
        } else {
            let started = std::time::Instant::now();
            let results = commit(&mut conn, target, &jobs, counts);
            tracing::trace!(
                steps = jobs.len(),
                took_us = u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX),
                "SQLite group commit"
            );
            results
        };
        for (job, result) in jobs.drain(..).zip(results) {
            let Some(reply) = job.reply else { continue };
            if let Err(Ok(Done::Begin(Begin::Acquired(lease)))) = reply.send(result) {
                orphans.push((lease, job.clock));
            }
        }
    }
}

fn closed_err(job: &Job) -> StoreError {
    closed(job.op.phase())
}

/// Why a batch did not commit.
enum Failed {
    /// Opening the connection, `BEGIN IMMEDIATE` or `COMMIT` failed:
    /// nothing of the batch was written.
    Whole(rusqlite::Error),
    /// One step's statement failed; the batch was rolled back.
    Step(rusqlite::Error),
}

/// Commits `jobs` and gives one answer per job, in order.
fn commit(
    conn: &mut Option<rusqlite::Connection>,
    target: &Target,
    jobs: &[Job],
    counts: &Counts,
) -> Vec<Result<Done, StoreError>> {
    let outcome = batch(conn, target, jobs);
    if outcome.is_err() {
        // Open afresh for the next batch.
        *conn = None;
    }
    match outcome {
        Ok(results) => {
            counts.commits.fetch_add(1, Ordering::Relaxed);
            results
        }
        Err(Failed::Step(_)) if jobs.len() > 1 => jobs
            .iter()
            .flat_map(|job| commit(conn, target, std::slice::from_ref(job), counts))
            .collect(),
        Err(Failed::Whole(e) | Failed::Step(e)) => {
            let e = Arc::new(e);
            jobs.iter()
                .map(|job| Err(StoreError::unavailable(job.op.phase(), Arc::clone(&e))))
                .collect()
        }
    }
}

fn batch(
    conn: &mut Option<rusqlite::Connection>,
    target: &Target,
    jobs: &[Job],
) -> Result<Vec<Result<Done, StoreError>>, Failed> {
    let conn = match conn {
        Some(conn) => conn,
        None => conn.insert(open(target).map_err(Failed::Whole)?),
    };
    let tx = conn
        .transaction_with_behavior(TransactionBehavior::Immediate)
        .map_err(Failed::Whole)?;
    let mut fences = Fences::default();
    let steps = (|| {
        let results = jobs
            .iter()
            .map(|job| apply(&tx, job, &mut fences))
            .collect::<Result<Vec<_>, _>>()?;
        fences.save(&tx)?;
        Ok(results)
    })();
    match steps {
        Ok(results) => {
            tx.commit().map_err(Failed::Whole)?;
            Ok(results)
        }
        Err(e) => Err(Failed::Step(e)), // dropping `tx` rolls back
    }
}

/// Runs one step inside the batch's transaction. The outer error is a
/// failed statement (the batch is rolled back); the inner result is the
/// step's own answer.
fn apply(
    tx: &rusqlite::Transaction<'_>,
    job: &Job,
    fences: &mut Fences,
) -> Result<Result<Done, StoreError>, rusqlite::Error> {
    let now = to_i64(job.clock.now().0);
    Ok(match &job.op {
        Op::Claim { req, absent } => claim(tx, req, *absent, now, fences)?,
        Op::Complete { lease, blob, ttl } => {
            let expires = now.saturating_add(to_i64(duration_ms(*ttl)));
            let changed = tx
                .prepare_cached(
                    "UPDATE idem_records SET state = 1, deadline = ?1, response = ?2 \
                     WHERE scope = ?3 AND key = ?4 AND state = 0 AND fence = ?5",
                )?
                .execute(params![
                    expires,
                    blob.as_slice(),
                    lease.scope.as_str(),
                    lease.key.as_str(),
                    to_i64(lease.fence)
                ])?;
            lease_kept(changed == 1, lease).map(|()| Done::Kept)
        }
        Op::Release(lease) => {
            let changed = tx
                .prepare_cached(
                    "DELETE FROM idem_records \
                     WHERE scope = ?1 AND key = ?2 AND state = 0 AND fence = ?3",
                )?
                .execute(params![
                    lease.scope.as_str(),
                    lease.key.as_str(),
                    to_i64(lease.fence)
                ])?;
            lease_kept(changed == 1, lease).map(|()| Done::Kept)
        }
        Op::Extend { lease, lease_for } => {
            let until = now.saturating_add(to_i64(duration_ms(*lease_for)));
            let changed = tx
                .prepare_cached(
                    "UPDATE idem_records SET deadline = ?1 \
                     WHERE scope = ?2 AND key = ?3 AND state = 0 AND fence = ?4",
                )?
                .execute(params![
                    until,
                    lease.scope.as_str(),
                    lease.key.as_str(),
                    to_i64(lease.fence)
                ])?;
            lease_kept(changed == 1, lease).map(|()| {
                Done::Lease(Lease {
                    until: millis(until),
                    ..lease.clone()
                })
            })
        }
        Op::Hold {
            lease,
            reason,
            hold_for,
        } => {
            let at_least = now.saturating_add(to_i64(duration_ms(*hold_for)));
            let until = tx
                .prepare_cached(
                    "UPDATE idem_records SET deadline = MAX(deadline, ?1), response = ?2 \
                     WHERE scope = ?3 AND key = ?4 AND state = 0 AND fence = ?5 \
                     RETURNING deadline",
                )?
                .query_row(
                    params![
                        at_least,
                        reason.as_str().as_bytes(),
                        lease.scope.as_str(),
                        lease.key.as_str(),
                        to_i64(lease.fence)
                    ],
                    |row| row.get::<_, i64>(0),
                )
                .optional();
            match until {
                Ok(Some(until)) => Ok(Done::Lease(Lease {
                    until: millis(until),
                    ..lease.clone()
                })),
                Ok(None) => Err(StoreError::LeaseLost { fence: lease.fence }),
                Err(e) if is_decode(&e) => Err(StoreError::corrupt(Phase::Hold, e.to_string())),
                Err(e) => return Err(e),
            }
        }
        Op::Delete { scope, key } => {
            let changed = tx
                .prepare_cached("DELETE FROM idem_records WHERE scope = ?1 AND key = ?2")?
                .execute(params![scope.as_str(), key.as_str()])?;
            Ok(Done::Deleted(changed > 0))
        }
        Op::Purge { limit } => {
            let changed = tx
                .prepare_cached(
                    "DELETE FROM idem_records WHERE (scope, key) IN \
                     (SELECT scope, key FROM idem_records WHERE deadline <= ?1 LIMIT ?2)",
                )?
                .execute(params![now, limit])?;
            Ok(Done::Purged(changed as u64))
        }
    })
}

/// The store-wide fence counter (`idem_fence`) within one batch: read once
/// at the first claim, handed out in memory, written back once before
/// `COMMIT` (the batch holds the write lock throughout, so no other
/// process can draw a fence in between).
#[derive(Default)]
struct Fences {
    /// The highest fence granted so far (`None`: not read yet).
    last: Option<i64>,
    dirty: bool,
}

impl Fences {
    /// The next fence: `max(last + 1, now_ms × 1000)`.
    fn next(&mut self, tx: &rusqlite::Transaction<'_>, now: i64) -> Result<i64, rusqlite::Error> {
        let last = match self.last {
            Some(last) => last,
            None => tx
                .prepare_cached("SELECT last FROM idem_fence WHERE id = 1")?
                .query_row([], |row| row.get::<_, i64>(0))
                .optional()?
                .unwrap_or(0),
        };
        let fence = last.saturating_add(1).max(now.saturating_mul(1000));
        self.last = Some(fence);
        self.dirty = true;
        Ok(fence)
    }

    fn save(&self, tx: &rusqlite::Transaction<'_>) -> Result<(), rusqlite::Error> {
        if let (true, Some(last)) = (self.dirty, self.last) {
            tx.prepare_cached(
                "INSERT INTO idem_fence (id, last) VALUES (1, ?1) \
                 ON CONFLICT (id) DO UPDATE SET last = max(last, excluded.last)",
            )?
            .execute([last])?;
        }
        Ok(())
    }
}

/// The claim step of `begin`. When the caller's read found no record, a
/// plain `INSERT … ON CONFLICT DO NOTHING` claims the key in one statement;
/// otherwise (or when a record appeared since) the record is re-read under
/// the write lock and the key claimed when it is absent or ended.
fn claim(
    tx: &rusqlite::Transaction<'_>,
    req: &BeginRequest,
    absent: bool,
    now: i64,
    fences: &mut Fences,
) -> Result<Result<Done, StoreError>, rusqlite::Error> {
    const P: Phase = Phase::Begin;
    let until = now.saturating_add(to_i64(duration_ms(req.lease)));
    let acquired = |fence: i64, took_over: bool| {
        Ok(Done::Begin(Begin::Acquired(Lease {
            scope: req.scope.clone(),
            key: req.key.clone(),
            fence: u64::try_from(fence).unwrap_or(0),
            until: millis(until),
            took_over,
        })))
    };
    let row = params![
        req.scope.as_str(),
        req.key.as_str(),
        req.fingerprint.as_bytes().as_slice(),
    ];
    if absent {
        let fence = fences.next(tx, now)?;
        let inserted = tx
            .prepare_cached(
                "INSERT INTO idem_records \
                 (scope, key, fingerprint, state, fence, deadline, response) \
                 VALUES (?1, ?2, ?3, 0, ?4, ?5, NULL) ON CONFLICT (scope, key) DO NOTHING",
            )?
            .execute(params![row[0], row[1], row[2], fence, until])?;
        if inserted == 1 {
            return Ok(acquired(fence, false));
        }
        // Claimed meanwhile (a step before this one, or another
        // process): decide from the record as it is now. The fence drawn
        // stays unused; fences only need to grow.
    }
    // An ended claim (in progress past its lease) of this same request is
    // taken over; an ended result is simply replaced.
    let mut took_over = false;
    match read_record(tx, &req.scope, &req.key, P)? {
        Some(Err(corrupt)) => return Ok(Err(corrupt)),
        Some(Ok(found)) => match found.decides(req, now, P) {
            Ok(true) => return Ok(found.answer(req, now, P).map(Done::Begin)),
            Ok(false) => took_over = found.state == IN_PROGRESS,
            Err(corrupt) => return Ok(Err(corrupt)),
        },
        None => {}
    }
    let fence = fences.next(tx, now)?;
    tx.prepare_cached(
        "INSERT INTO idem_records (scope, key, fingerprint, state, fence, deadline, response) \
         VALUES (?1, ?2, ?3, 0, ?4, ?5, NULL) \
         ON CONFLICT (scope, key) DO UPDATE SET fingerprint = excluded.fingerprint, \
         state = 0, fence = excluded.fence, deadline = excluded.deadline, response = NULL",
    )?
    .execute(params![row[0], row[1], row[2], fence, until])?;
    Ok(acquired(fence, took_over))
}
