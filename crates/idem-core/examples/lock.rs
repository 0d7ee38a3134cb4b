//! The distributed lock in one file, on the in-process backend:
//! `run` under a lock, busy as a value, a dedup window, and a fenced
//! resource refusing a stale holder's late write (CASES G1/G3).
//!
//! `cargo run -p idem-core --example lock`
//!
//! Swap `MemoryLockBackend` for `idem_redis::RedisLockBackend`,
//! `idem_sql::LeaseLockBackend` or `idem_sql::PgAdvisoryLockBackend` to
//! lock across processes; the rest is unchanged.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem_core::lock::{Acquire, Lock, MemoryLockBackend, Run, RunOptions};
use idem_core::ManualClock;

/// A resource that checks fences, like `UPDATE … SET …, fence = $f WHERE id = $id AND fence < $f`.
#[derive(Default)]
struct Ledger {
    fence: u64,
    entries: Vec<String>,
}

impl Ledger {
    fn write(&mut self, fence: u64, entry: &str) -> Result<(), std::io::Error> {
        if fence <= self.fence {
            return Err(std::io::Error::other(format!(
                "refused {entry:?}: fence {fence} is not newer than {}",
                self.fence
            )));
        }
        self.fence = fence;
        self.entries.push(entry.to_owned());
        Ok(())
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let clock = ManualClock::starting_now();
    let lock = Lock::new(MemoryLockBackend::new(Arc::new(clock.clone())));
    let ledger = Arc::new(Mutex::new(Ledger::default()));
    let ttl = Duration::from_secs(10);

    // 1. Run an operation under the lock; it writes with its fence.
    let l = ledger.clone();
    let ran = lock
        .run("invoice:42", ttl, RunOptions::default(), |f| async move {
            l.lock().unwrap().write(f.fence, "charge 42")
        })
        .await?;
    println!("1. run: {ran:?}");

    // 2. While someone holds the name, `run` answers Busy (→ "operation in
    //    progress", HTTP 409 + Retry-After) and does not run.
    let Acquire::Held(holder) = lock.try_acquire("invoice:42", ttl).await? else {
        unreachable!("the name was released")
    };
    let busy = lock
        .run("invoice:42", ttl, RunOptions::default(), |_| async {
            Ok::<_, std::io::Error>("never")
        })
        .await?;
    match busy {
        Run::Busy { retry_after } => println!("2. busy, retry after {retry_after:?}"),
        Run::Done(_) => unreachable!("the name is held"),
    }
    holder.release().await?;

    // 3. keep_on_success: the lock stays until its TTL ends: a dedup window.
    let keep = RunOptions {
        keep_on_success: true,
        ..RunOptions::default()
    };
    let short = Duration::from_secs(2);
    let _ = lock
        .run("report:daily", short, keep, |_| async {
            Ok::<_, std::io::Error>(())
        })
        .await?;
    let again = lock.try_acquire("report:daily", short).await?;
    println!("3. right after: {}", label(&again));
    drop(again);
    clock.advance(short);
    let later = lock.try_acquire("report:daily", short).await?;
    println!("3. after the TTL: {}", label(&later));
    drop(later);

    // 4. A stale holder: A pauses past its lease (no renewal reaches the
    //    backend), B takes over and writes; A's late write is refused by
    //    the fence check, and A's release is a no-op.
    let Acquire::Held(a) = lock
        .try_acquire("invoice:7", Duration::from_secs(1))
        .await?
    else {
        unreachable!()
    };
    clock.advance(Duration::from_millis(1100)); // A's lease passed by the backend's clock
    let Acquire::Held(b) = lock.try_acquire("invoice:7", ttl).await? else {
        unreachable!("A's lease has passed")
    };
    ledger.lock().unwrap().write(b.fence(), "B: refund 7")?;
    let late = ledger.lock().unwrap().write(a.fence(), "A: refund 7");
    println!(
        "4. A (fence {}) after B (fence {}): {late:?}",
        a.fence(),
        b.fence()
    );
    println!("4. A's release: {} (no-op)", a.release().await?);
    b.release().await?;

    println!("ledger: {:?}", ledger.lock().unwrap().entries);
    Ok(())
}

fn label(a: &Acquire) -> &'static str {
    match a {
        Acquire::Held(_) => "acquired",
        Acquire::Busy { .. } => "busy",
    }
}
