//! Record reads on threads of their own: `begin`'s first read, `get` and
//! `wait_for_change`'s polls go to a few reader threads, each with its own
//! rusqlite connection (prepared statement cached), instead of through the
//! sqlx pool on the callers' runtime. Under WAL a read never waits for the
//! writer; each read is one statement in its own implicit transaction, so
//! it sees every commit answered before it was asked.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use idem_core::{IdempotencyKey, Phase, Scope, StoreError};
use tokio::sync::{mpsc, oneshot};

use super::conn::{open, read_record, Target};
use crate::common::RawRecord;

/// Reads waiting for a reader thread before a caller's `send` waits too.
const QUEUE: usize = 4096;

type Answer = Result<Option<RawRecord>, StoreError>;

struct Read {
    scope: Scope,
    key: IdempotencyKey,
    phase: Phase,
    reply: oneshot::Sender<Answer>,
}

/// The handle callers send reads through; the threads end when every
/// handle is dropped.
#[derive(Debug, Clone)]
pub(super) struct Readers {
    queue: mpsc::Sender<Read>,
    /// Set by [`Self::close`]: later reads fail at once.
    closed: Arc<AtomicBool>,
}

impl std::fmt::Debug for Read {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Read")
            .field("scope", &self.scope)
            .field("key", &self.key)
            .finish_non_exhaustive()
    }
}

impl Readers {
    /// Starts `threads` reader threads (at least 1) on `target`; each opens
    /// its connection at its first read, and again after a failed one.
    ///
    /// # Errors
    /// [`StoreError::Unavailable`] (phase `Connect`) when a thread cannot be
    /// started.
    pub(super) fn start(target: &Target, threads: usize) -> Result<Self, StoreError> {
        let (queue, reads) = mpsc::channel(QUEUE);
        let reads = Arc::new(Mutex::new(reads));
        for n in 0..threads.max(1) {
            let (reads, target) = (Arc::clone(&reads), target.clone());
            std::thread::Builder::new()
                .name(format!("idem-sqlite-reader-{n}"))
                .spawn(move || run(&reads, &target))
                .map_err(|e| StoreError::unavailable(Phase::Connect, e))?;
        }
        Ok(Self {
            queue,
            closed: Arc::new(AtomicBool::new(false)),
        })
    }

    /// Refuses later reads (with [`StoreError::Unavailable`]).
    pub(super) fn close(&self) {
        self.closed.store(true, Ordering::Release);
    }

    /// Reads the record of `key` in `scope`.
    ///
    /// # Errors
    /// [`StoreError::Unavailable`] when the statement fails or the reader
    /// threads are gone; [`StoreError::Corrupt`] (for `phase`) for an
    /// undecodable row.
    pub(super) async fn read(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        phase: Phase,
    ) -> Result<Option<RawRecord>, StoreError> {
        if self.closed.load(Ordering::Acquire) {
            return Err(StoreError::unavailable(
                phase,
                std::io::Error::other("the SQLite store is closed"),
            ));
        }
        let (reply, answer) = oneshot::channel();
        let read = Read {
            scope: scope.clone(),
            key: key.clone(),
            phase,
            reply,
        };
        self.queue.send(read).await.map_err(|_| gone(phase))?;
        answer.await.map_err(|_| gone(phase))?
    }
}

fn gone(phase: Phase) -> StoreError {
    StoreError::unavailable(
        phase,
        std::io::Error::other("the SQLite reader threads are gone"),
    )
}

fn run(reads: &Mutex<mpsc::Receiver<Read>>, target: &Target) {
    let mut conn: Option<rusqlite::Connection> = None;
    loop {
        // One thread at a time waits on the queue; the others wait for it.
        let next = match reads.lock() {
            Ok(mut queue) => queue.blocking_recv(),
            Err(_) => return,
        };
        let Some(read) = next else { return };
        let phase = read.phase;
        let answer = (|| {
            let c = match &mut conn {
                Some(c) => c,
                None => conn.insert(open(target)?),
            };
            read_record(c, &read.scope, &read.key, phase)
        })();
        let answer = match answer {
            Ok(found) => found.transpose(),
            Err(e) => {
                conn = None; // open afresh for the next read
                Err(StoreError::unavailable(phase, e))
            }
        };
        // A caller that left needs no answer.
        let _ = read.reply.send(answer);
    }
}
