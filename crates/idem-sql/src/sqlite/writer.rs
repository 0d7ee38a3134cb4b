//! Group commit: one writer task per [`SqliteStore`](super::SqliteStore)
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
//!   failure (the pool opens a fresh one), as a failed `COMMIT` can leave
//!   sqlx's transaction depth out of step with SQLite's.
//! - **A caller that left.** A claim whose caller stopped waiting (its
//!   future was dropped) before the answer came is released in the next
//!   batch, so a cancelled request never leaves its key claimed until the
//!   lease ends.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idem_core::{
    duration_ms, Begin, BeginRequest, HoldReason, IdempotencyKey, Lease, Phase, Scope, SharedClock,
    StoreError,
};
use sqlx::{SqliteConnection, SqlitePool};
use tokio::sync::{mpsc, oneshot};

use super::read_record;
use crate::common::{lease_kept, millis, to_i64, IN_PROGRESS};

/// Steps waiting for the writer before a caller's `send` waits too
/// (back-pressure instead of unbounded memory under overload).
const QUEUE: usize = 4096;

/// One write step, as a caller hands it to the writer.
#[derive(Debug)]
pub(super) enum Op {
    Claim(BeginRequest),
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
            Op::Claim(_) => Phase::Begin,
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

/// The handle callers submit steps through; the task ends when every
/// handle is dropped (after the steps already queued).
#[derive(Debug, Clone)]
pub(super) struct Writer {
    queue: mpsc::Sender<Job>,
    /// Transactions the writer committed (for tests of the batching).
    #[cfg_attr(not(test), allow(dead_code))]
    commits: Arc<AtomicU64>,
}

impl Writer {
    /// Starts the writer task on the current Tokio runtime, writing
    /// through `pool` (a pool of one connection for a file; the store's
    /// only pool for an in-memory database or [`super::SqliteStore::from_pool`]).
    pub(super) fn start(pool: SqlitePool, max_batch: usize) -> Self {
        let (queue, steps) = mpsc::channel(QUEUE);
        let commits = Arc::new(AtomicU64::new(0));
        tokio::spawn(run(steps, pool, max_batch.max(1), Arc::clone(&commits)));
        Self { queue, commits }
    }

    /// Transactions committed so far.
    #[cfg(test)]
    pub(super) fn commits(&self) -> u64 {
        self.commits.load(Ordering::Relaxed)
    }

    /// Steps queued and not yet taken by the writer.
    #[cfg(test)]
    pub(super) fn queued(&self) -> usize {
        self.queue.max_capacity() - self.queue.capacity()
    }

    /// Queues `op` and waits for its answer.
    ///
    /// # Errors
    /// The step's own error, or [`StoreError::Unavailable`] when the batch
    /// holding it could not be committed or the writer task is gone (its
    /// runtime shut down).
    pub(super) async fn submit(&self, op: Op, clock: &SharedClock) -> Result<Done, StoreError> {
        let phase = op.phase();
        let (reply, answer) = oneshot::channel();
        let job = Job {
            op,
            clock: Arc::clone(clock),
            reply: Some(reply),
        };
        self.queue.send(job).await.map_err(|_| stopped(phase))?;
        answer.await.map_err(|_| stopped(phase))?
    }
}

fn stopped(phase: Phase) -> StoreError {
    StoreError::unavailable(
        phase,
        std::io::Error::other("the SQLite writer task is gone (its Tokio runtime shut down)"),
    )
}

async fn run(
    mut steps: mpsc::Receiver<Job>,
    pool: SqlitePool,
    max_batch: usize,
    commits: Arc<AtomicU64>,
) {
    let mut jobs = Vec::with_capacity(max_batch);
    let mut orphans: Vec<(Lease, SharedClock)> = Vec::new();
    loop {
        if orphans.is_empty() {
            if steps.recv_many(&mut jobs, max_batch).await == 0 {
                return; // every handle dropped and the queue drained
            }
        } else {
            jobs.extend(orphans.drain(..).map(|(lease, clock)| Job {
                op: Op::Release(lease),
                clock,
                reply: None,
            }));
            while jobs.len() < max_batch {
                match steps.try_recv() {
                    Ok(job) => jobs.push(job),
                    Err(_) => break,
                }
            }
        }
        let results = commit(&pool, &jobs, &commits).await;
        for (job, result) in jobs.drain(..).zip(results) {
            let Some(reply) = job.reply else { continue };
            if let Err(Ok(Done::Begin(Begin::Acquired(lease)))) = reply.send(result) {
                orphans.push((lease, job.clock));
            }
        }
    }
}

/// Why a batch did not commit.
enum Failed {
    /// `BEGIN IMMEDIATE`, taking a connection, or `COMMIT` failed: nothing
    /// of the batch was written.
    Whole(sqlx::Error),
    /// One step's statement failed; the batch was rolled back.
    Step(sqlx::Error),
}

/// Commits `jobs` and gives one answer per job, in order.
async fn commit(
    pool: &SqlitePool,
    jobs: &[Job],
    commits: &AtomicU64,
) -> Vec<Result<Done, StoreError>> {
    match batch(pool, jobs, commits).await {
        Ok(results) => results,
        Err(Failed::Step(_)) if jobs.len() > 1 => {
            let mut results = Vec::with_capacity(jobs.len());
            for job in jobs {
                let alone = Box::pin(commit(pool, std::slice::from_ref(job), commits));
                results.extend(alone.await);
            }
            results
        }
        Err(Failed::Whole(e) | Failed::Step(e)) => {
            let e = Arc::new(e);
            jobs.iter()
                .map(|job| Err(StoreError::unavailable(job.op.phase(), Arc::clone(&e))))
                .collect()
        }
    }
}

async fn batch(
    pool: &SqlitePool,
    jobs: &[Job],
    commits: &AtomicU64,
) -> Result<Vec<Result<Done, StoreError>>, Failed> {
    let mut conn = pool.acquire().await.map_err(Failed::Whole)?;
    let outcome = async {
        let mut tx = sqlx::Connection::begin_with(&mut *conn, "BEGIN IMMEDIATE")
            .await
            .map_err(Failed::Whole)?;
        let mut results = Vec::with_capacity(jobs.len());
        for job in jobs {
            match apply(&mut tx, job).await {
                Ok(answer) => results.push(answer),
                Err(e) => {
                    tx.rollback().await.ok();
                    return Err(Failed::Step(e));
                }
            }
        }
        tx.commit().await.map_err(Failed::Whole)?;
        commits.fetch_add(1, Ordering::Relaxed);
        Ok(results)
    }
    .await;
    if outcome.is_err() {
        conn.close_on_drop();
    }
    outcome
}

/// Runs one step inside the batch's transaction. The outer error is a
/// failed statement (the batch is rolled back); the inner result is the
/// step's own answer.
async fn apply(
    conn: &mut SqliteConnection,
    job: &Job,
) -> Result<Result<Done, StoreError>, sqlx::Error> {
    let now = to_i64(job.clock.now().0);
    Ok(match &job.op {
        Op::Claim(req) => claim(conn, req, now).await?,
        Op::Complete { lease, blob, ttl } => {
            let expires = now.saturating_add(to_i64(duration_ms(*ttl)));
            let done = sqlx::query(
                "UPDATE idem_records SET state = 1, deadline = ?1, response = ?2 \
                 WHERE scope = ?3 AND key = ?4 AND state = 0 AND fence = ?5",
            )
            .bind(expires)
            .bind(blob.as_slice())
            .bind(lease.scope.as_str())
            .bind(lease.key.as_str())
            .bind(to_i64(lease.fence))
            .execute(&mut *conn)
            .await?;
            lease_kept(done.rows_affected() == 1, lease).map(|()| Done::Kept)
        }
        Op::Release(lease) => {
            let done = sqlx::query(
                "DELETE FROM idem_records \
                 WHERE scope = ?1 AND key = ?2 AND state = 0 AND fence = ?3",
            )
            .bind(lease.scope.as_str())
            .bind(lease.key.as_str())
            .bind(to_i64(lease.fence))
            .execute(&mut *conn)
            .await?;
            lease_kept(done.rows_affected() == 1, lease).map(|()| Done::Kept)
        }
        Op::Extend { lease, lease_for } => {
            let until = now.saturating_add(to_i64(duration_ms(*lease_for)));
            let done = sqlx::query(
                "UPDATE idem_records SET deadline = ?1 \
                 WHERE scope = ?2 AND key = ?3 AND state = 0 AND fence = ?4",
            )
            .bind(until)
            .bind(lease.scope.as_str())
            .bind(lease.key.as_str())
            .bind(to_i64(lease.fence))
            .execute(&mut *conn)
            .await?;
            lease_kept(done.rows_affected() == 1, lease).map(|()| {
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
            let until: Option<i64> = sqlx::query_scalar(
                "UPDATE idem_records SET deadline = MAX(deadline, ?1), response = ?2 \
                 WHERE scope = ?3 AND key = ?4 AND state = 0 AND fence = ?5 \
                 RETURNING deadline",
            )
            .bind(at_least)
            .bind(reason.as_str().as_bytes())
            .bind(lease.scope.as_str())
            .bind(lease.key.as_str())
            .bind(to_i64(lease.fence))
            .fetch_optional(&mut *conn)
            .await?;
            match until {
                Some(until) => Ok(Done::Lease(Lease {
                    until: millis(until),
                    ..lease.clone()
                })),
                None => Err(StoreError::LeaseLost { fence: lease.fence }),
            }
        }
        Op::Delete { scope, key } => {
            let done = sqlx::query("DELETE FROM idem_records WHERE scope = ?1 AND key = ?2")
                .bind(scope.as_str())
                .bind(key.as_str())
                .execute(&mut *conn)
                .await?;
            Ok(Done::Deleted(done.rows_affected() > 0))
        }
        Op::Purge { limit } => {
            let done = sqlx::query(
                "DELETE FROM idem_records WHERE (scope, key) IN \
                 (SELECT scope, key FROM idem_records WHERE deadline <= ?1 LIMIT ?2)",
            )
            .bind(now)
            .bind(*limit)
            .execute(&mut *conn)
            .await?;
            Ok(Done::Purged(done.rows_affected()))
        }
    })
}

/// The claim step of `begin`: re-reads the record under the write lock and
/// claims the key when it is absent or ended.
async fn claim(
    conn: &mut SqliteConnection,
    req: &BeginRequest,
    now: i64,
) -> Result<Result<Done, StoreError>, sqlx::Error> {
    const P: Phase = Phase::Begin;
    // An ended claim (in progress past its lease) of this same request is
    // taken over; an ended result is simply replaced.
    let mut took_over = false;
    match read_record(conn, &req.scope, &req.key, P).await? {
        Some(Err(corrupt)) => return Ok(Err(corrupt)),
        Some(Ok(row)) => match row.decides(req, now, P) {
            Ok(true) => return Ok(row.answer(req, now, P).map(Done::Begin)),
            Ok(false) => took_over = row.state == IN_PROGRESS,
            Err(corrupt) => return Ok(Err(corrupt)),
        },
        None => {}
    }
    let fence: i64 = sqlx::query_scalar(
        "INSERT INTO idem_fence (id, last) VALUES (1, ?1) \
         ON CONFLICT (id) DO UPDATE SET last = max(last + 1, excluded.last) \
         RETURNING last",
    )
    .bind(now.saturating_mul(1000))
    .fetch_one(&mut *conn)
    .await?;
    let Ok(fence) = u64::try_from(fence) else {
        return Ok(Err(StoreError::corrupt(
            P,
            format!("negative fence counter {fence}"),
        )));
    };
    let until = now.saturating_add(to_i64(duration_ms(req.lease)));
    sqlx::query(
        "INSERT INTO idem_records (scope, key, fingerprint, state, fence, deadline, response) \
         VALUES (?1, ?2, ?3, 0, ?4, ?5, NULL) \
         ON CONFLICT (scope, key) DO UPDATE SET fingerprint = excluded.fingerprint, \
         state = 0, fence = excluded.fence, deadline = excluded.deadline, response = NULL",
    )
    .bind(req.scope.as_str())
    .bind(req.key.as_str())
    .bind(req.fingerprint.as_bytes().as_slice())
    .bind(to_i64(fence))
    .bind(until)
    .execute(&mut *conn)
    .await?;
    Ok(Ok(Done::Begin(Begin::Acquired(Lease {
        scope: req.scope.clone(),
        key: req.key.clone(),
        fence,
        until: millis(until),
        took_over,
    }))))
}
