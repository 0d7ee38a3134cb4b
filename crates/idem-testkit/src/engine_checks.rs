//! Engine-level checks run over any store: [`Engine::execute`] under
//! concurrency, after a release, when its future is dropped mid-flight,
//! when saving fails, with the lease watchdog, and in wait mode.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idem_core::{
    Action, Begin, Engine, EngineConfig, HoldReason, Outcome, Record, RecordState, Saved, Store,
    StoreError, StoredResponse,
};

use crate::faulty::{Fault, FaultyStore, Op};
use crate::support::*;
use crate::Harness;

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn config(lease: Duration, on_cancel: Action) -> EngineConfig {
    EngineConfig {
        lease,
        ttl: Duration::from_secs(60),
        wait: Duration::ZERO,
        watchdog: true,
        on_cancel,
        ..EngineConfig::default()
    }
}

/// What happened to the result of an execution; panics on any other outcome.
fn saved<T: std::fmt::Debug>(out: &Outcome<T>) -> &Saved {
    match out {
        Outcome::Executed { saved, .. } => saved,
        other => panic!("expected an execution, got {other:?}"),
    }
}

/// CASES A1: 16 concurrent `execute`s of one key run the operation once;
/// the others get `InFlight` (or the replay, if they came after it ended).
pub async fn engine_runs_once_under_concurrency<H: Harness>(h: &H) {
    let engine = Engine::with_config(
        h.store(),
        config(Duration::from_secs(30), Action::Hold(HoldReason::Cancelled)),
    );
    let (scope, key) = (fresh_scope(), fresh_key("engine-race"));
    let runs = Arc::new(AtomicUsize::new(0));
    let outcomes = all_at_once(16, |_| {
        let (engine, scope, key, runs) = (engine.clone(), scope.clone(), key.clone(), runs.clone());
        async move {
            let op = |_lease| async move {
                runs.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(ms(200)).await;
                ((), Action::Store(response("paid")))
            };
            engine.execute(&scope, &key, fp("pay 10"), op).await
        }
    })
    .await;
    let mut executed = 0;
    for outcome in outcomes {
        match outcome.expect("execute") {
            Outcome::Executed { saved, .. } => {
                executed += 1;
                assert!(matches!(saved, Saved::Stored), "saved: {saved:?}");
            }
            Outcome::InFlight { retry_after } => assert!(retry_after > Duration::ZERO),
            Outcome::Replayed(r) => assert_eq!(r, response("paid")),
            Outcome::Mismatch => panic!("same fingerprint cannot mismatch"),
        }
    }
    assert_eq!(executed, 1, "exactly one execute runs the operation");
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the operation ran once");
    let again = engine
        .execute(&scope, &key, fp("pay 10"), |_| async {
            panic!("must not run again")
        })
        .await
        .expect("execute");
    assert!(
        matches!(again, Outcome::<()>::Replayed(ref r) if *r == response("paid")),
        "{again:?}"
    );
}

/// CASES C1: an operation that releases (an upstream 500) is run again by
/// the retry, exactly once more; then the stored result is replayed.
pub async fn engine_release_lets_retry_run<H: Harness>(h: &H) {
    let engine = Engine::with_config(
        h.store(),
        config(Duration::from_secs(30), Action::Hold(HoldReason::Cancelled)),
    );
    let (scope, key) = (fresh_scope(), fresh_key("engine-release"));
    let runs = AtomicUsize::new(0);
    let run = |action: Action| {
        let (engine, scope, key, runs) = (&engine, &scope, &key, &runs);
        async move {
            let op = |_| async move {
                runs.fetch_add(1, Ordering::SeqCst);
                ((), action)
            };
            engine
                .execute(scope, key, fp("a"), op)
                .await
                .expect("execute")
        }
    };
    let first = run(Action::Release).await;
    assert!(matches!(saved(&first), Saved::Released), "{first:?}");
    let second = run(Action::Store(response("ok"))).await;
    assert!(matches!(saved(&second), Saved::Stored), "{second:?}");
    let third = run(Action::Store(response("twice?"))).await;
    assert!(
        matches!(third, Outcome::Replayed(ref r) if *r == response("ok")),
        "{third:?}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

/// Starts `execute` with an operation that never finishes, waits until it
/// runs, then drops the future. Returns the fence the operation held.
async fn run_and_drop<S: idem_core::Store + Clone>(
    engine: &Engine<S>,
    scope: &idem_core::Scope,
    key: &idem_core::IdempotencyKey,
) -> u64 {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let fut = engine.execute(scope, key, fp("a"), |lease| async move {
        let _ = tx.send(lease.fence);
        std::future::pending::<()>().await;
        ((), Action::Store(response("never")))
    });
    let mut fut: Pin<Box<dyn Future<Output = _> + Send + '_>> = Box::pin(fut);
    let fence = tokio::select! {
        r = &mut fut => panic!("the operation never finishes, yet execute returned {r:?}"),
        f = rx => f.expect("the operation started"),
    };
    drop(fut);
    fence
}

/// A handler dropped mid-flight with `on_cancel = Hold` leaves the key in
/// flight until its lease ends (its effect is unknown), and no longer: the
/// watchdog stopped, so the key is acquirable once the lease has passed.
pub async fn engine_cancel_hold_keeps_key_until_lease_end<H: Harness>(h: &H) {
    let store = h.store();
    let lease = Duration::from_secs(1);
    let engine = Engine::with_config(
        store.clone(),
        config(lease, Action::Hold(HoldReason::Cancelled)),
    );
    let (scope, key) = (fresh_scope(), fresh_key("cancel-hold"));
    let fence = run_and_drop(&engine, &scope, &key).await;
    let r = req(&scope, &key, fp("a"), lease);
    expect_in_flight(&store, &r, lease).await;
    expect_in_progress(&store, &scope, &key, fp("a"), fence).await;
    h.advance(lease + ms(300)).await;
    let next = acquire(&store, &r).await;
    assert!(
        next.fence > fence,
        "the key was taken over with a larger fence"
    );
}

/// A handler dropped mid-flight with `on_cancel = Release` frees the key at
/// once (the release is spawned, so poll for it briefly), without waiting
/// for the lease.
pub async fn engine_cancel_release_frees_key<H: Harness>(h: &H) {
    let store = h.store();
    let engine = Engine::with_config(
        store.clone(),
        config(Duration::from_secs(30), Action::Release),
    );
    let (scope, key) = (fresh_scope(), fresh_key("cancel-release"));
    let fence = run_and_drop(&engine, &scope, &key).await;
    let freed = eventually(Duration::from_secs(3), || async {
        get(&store, &scope, &key).await.is_none()
    })
    .await;
    assert!(
        freed,
        "a cancelled operation with on_cancel = Release must free the key promptly"
    );
    let next = acquire(&store, &req(&scope, &key, fp("a"), Duration::from_secs(30))).await;
    assert!(next.fence > fence);
}

/// CASES A1: when saving the result fails (outage or timeout) and the
/// engine is told not to retry, the key stays in flight — never released for
/// a second run — until its lease ends. A failed release also leaves it held.
pub async fn engine_failed_save_holds_key<H: Harness>(h: &H) {
    let faulty = FaultyStore::new(h.store());
    let lease = Duration::from_secs(1);
    let engine = Engine::with_config(
        faulty.clone(),
        EngineConfig {
            save_wait: Duration::ZERO,
            save_retry: Duration::ZERO,
            ..config(lease, Action::Hold(HoldReason::Cancelled))
        },
    );
    let scope = fresh_scope();
    let cases = [
        (
            Op::Complete,
            Fault::Unavailable,
            Action::Store(response("lost")),
        ),
        (
            Op::Complete,
            Fault::Timeout,
            Action::Store(response("lost")),
        ),
        (Op::Release, Fault::Unavailable, Action::Release),
    ];
    for (op, fault, action) in cases {
        let key = fresh_key("failed-save");
        faulty.set(op, fault);
        let releases_before = faulty.calls(Op::Release);
        let out = engine
            .execute(&scope, &key, fp("a"), |lease| async move {
                (lease.fence, action)
            })
            .await
            .expect("execute");
        let fence = match out {
            Outcome::Executed {
                value,
                fence,
                saved: Saved::Failed(e),
            } => {
                assert_eq!(value, fence);
                match fault {
                    Fault::Timeout => {
                        assert!(matches!(e, StoreError::Timeout { .. }), "{e:?}")
                    }
                    _ => assert!(matches!(e, StoreError::Unavailable { .. }), "{e:?}"),
                }
                fence
            }
            other => panic!("{op:?} {fault:?}: expected Saved::Failed, got {other:?}"),
        };
        if op != Op::Release {
            assert_eq!(
                faulty.calls(Op::Release),
                releases_before,
                "{op:?} {fault:?}: a failed save must not release the key"
            );
        }
        faulty.clear_all();
        let store = h.store();
        let r = req(&scope, &key, fp("a"), lease);
        expect_in_flight(&store, &r, lease).await;
        expect_in_progress(&store, &scope, &key, fp("a"), fence).await;
        // Held, not stuck: free once the lease has passed.
        h.advance(lease + ms(300)).await;
        let next = acquire(&store, &r).await;
        assert!(next.fence > fence);
        store.release(&next).await.expect("release");
    }
}

/// The watchdog renews the lease while a long operation runs: with a 300 ms
/// lease and an operation that lets 1 s pass (by the store's clock), every
/// duplicate during the run is refused and the result is stored.
pub async fn engine_watchdog_keeps_lease_alive<H: Harness>(h: &H) {
    let store = h.store();
    let lease = ms(300);
    let engine = Engine::with_config(
        store.clone(),
        config(lease, Action::Hold(HoldReason::Cancelled)),
    );
    let (scope, key, r) = fresh_req("watchdog", lease);
    let out = engine
        .execute(&scope, &key, fp("a"), |held| {
            let (store, scope, key, r) = (store.clone(), scope.clone(), key.clone(), r.clone());
            async move {
                let mut last = held.until;
                for step in 0..10 {
                    h.advance(ms(100)).await;
                    // Wait (real time, bounded) for the watchdog to renew past
                    // the lease end seen before this step.
                    let deadline = tokio::time::Instant::now() + Duration::from_secs(3);
                    loop {
                        let rec = get(&store, &scope, &key).await;
                        match rec {
                            Some(Record { state: RecordState::InProgress { fence, lease_until, .. }, .. })
                                if fence == held.fence && lease_until > last =>
                            {
                                last = lease_until;
                                break;
                            }
                            _ if tokio::time::Instant::now() >= deadline => panic!(
                                "step {step}: the watchdog did not renew the lease past {last:?} (record: {rec:?})"
                            ),
                            _ => tokio::time::sleep(ms(5)).await,
                        }
                    }
                    match store.begin(&r).await.expect("begin") {
                        Begin::InFlight { .. } => {}
                        other => panic!("step {step}: a duplicate during the run got {other:?}"),
                    }
                }
                (held.fence, Action::Store(response("long")))
            }
        })
        .await
        .expect("execute");
    match out {
        Outcome::Executed {
            saved: Saved::Stored,
            ..
        } => {}
        other => panic!("expected the long operation to be stored, got {other:?}"),
    }
    expect_replay(&store, &r, &response("long")).await;
}

/// Wait mode: a duplicate that arrives while the original runs waits for it
/// (woken by `wait_for_change`) and replays its result; its own operation
/// never runs.
pub async fn engine_wait_mode_replays<H: Harness>(h: &H) {
    let store = h.store();
    let first = Engine::with_config(
        store.clone(),
        config(Duration::from_secs(30), Action::Hold(HoldReason::Cancelled)),
    );
    let waiting = Engine::with_config(
        store.clone(),
        EngineConfig {
            wait: Duration::from_secs(10),
            ..config(Duration::from_secs(30), Action::Hold(HoldReason::Cancelled))
        },
    );
    let (scope, key) = (fresh_scope(), fresh_key("wait-mode"));
    let (started_tx, started_rx) = tokio::sync::oneshot::channel();
    let (go_tx, go_rx) = tokio::sync::oneshot::channel::<()>();
    let original = {
        let (scope, key) = (scope.clone(), key.clone());
        tokio::spawn(async move {
            first
                .execute(&scope, &key, fp("a"), |_| async move {
                    let _ = started_tx.send(());
                    let _ = go_rx.await;
                    ((), Action::Store(response("original")))
                })
                .await
        })
    };
    started_rx.await.expect("the original started");
    let duplicate = {
        let (scope, key) = (scope.clone(), key.clone());
        tokio::spawn(async move {
            waiting
                .execute(&scope, &key, fp("a"), |_| async {
                    panic!("the duplicate must not run")
                })
                .await
        })
    };
    tokio::time::sleep(ms(100)).await;
    assert!(
        !duplicate.is_finished(),
        "the duplicate waits while the original runs"
    );
    let _ = go_tx.send(());
    let out = tokio::time::timeout(Duration::from_secs(5), duplicate)
        .await
        .expect("the waiting duplicate must finish soon after the original")
        .expect("task")
        .expect("execute");
    match out {
        Outcome::<()>::Replayed(r) => assert_eq!(r, response("original")),
        other => panic!("expected the duplicate to replay, got {other:?}"),
    }
    let orig = original.await.expect("task").expect("execute");
    assert!(
        matches!(
            orig,
            Outcome::Executed {
                saved: Saved::Stored,
                ..
            }
        ),
        "{orig:?}"
    );
}

/// A save whose `complete` applied but whose answer was lost (a client-side
/// timeout cut it off): the retry's `extend` then finds the key no longer
/// in flight under the fence. That is the run's own result, not a newer
/// run: the outcome is [`Saved::Stored`], never a false [`Saved::LeaseLost`]
/// (which would count and log a second run that never happened), and the
/// key replays. A result replaced by another run's still reads as lost.
pub async fn engine_save_whose_answer_was_lost_is_stored<H: Harness>(h: &H) {
    let faulty = FaultyStore::new(h.store());
    let lease = Duration::from_secs(5);
    let engine = Engine::with_config(
        faulty.clone(),
        config(lease, Action::Hold(HoldReason::Cancelled)),
    );
    let (scope, key, r) = fresh_req("answer-lost", lease);
    faulty.set_times(Op::Complete, Fault::TimeoutAfterApply, 1);
    let out = engine
        .execute(&scope, &key, fp("a"), |_| async move {
            ((), Action::Store(response("saved once")))
        })
        .await
        .expect("execute");
    match out {
        Outcome::Executed {
            saved: Saved::Stored,
            ..
        } => {}
        other => panic!("expected Saved::Stored, got {other:?}"),
    }
    assert_eq!(
        faulty.calls(Op::Complete),
        1,
        "no second complete was needed"
    );
    expect_replay(&h.store(), &r, &response("saved once")).await;

    // The same lost answer, but the key now holds another run's result.
    let (scope, key, r) = fresh_req("answer-lost-other", lease);
    let store = h.store();
    let other = store.clone();
    let other_key = (scope.clone(), key.clone());
    faulty.set_times(Op::Complete, Fault::TimeoutAfterApply, 1);
    let out = engine
        .execute(&scope, &key, fp("a"), |lease| async move {
            // Another run takes the key over and stores its own result
            // (as after this run's lease ended).
            other.release(&lease).await.expect("release");
            let theirs = acquire(&other, &req(&other_key.0, &other_key.1, fp("a"), ms(5000))).await;
            other
                .complete(&theirs, &response("theirs"), Duration::from_secs(60))
                .await
                .expect("complete theirs");
            ((), Action::Store(response("ours")))
        })
        .await
        .expect("execute");
    match out {
        Outcome::Executed {
            saved: Saved::LeaseLost,
            ..
        } => {}
        other => panic!("expected Saved::LeaseLost, got {other:?}"),
    }
    expect_replay(&store, &r, &response("theirs")).await;
}

/// CASES A1, the default: a save that fails is retried (in the background
/// after `save_wait`) while the lease is renewed, so a duplicate sees
/// `InFlight` — never a second run — and gets the replay once the store
/// takes the result.
pub async fn engine_failed_save_is_retried_until_it_lands<H: Harness>(h: &H) {
    let faulty = FaultyStore::new(h.store());
    let engine = Engine::with_config(
        faulty.clone(),
        EngineConfig {
            save_wait: ms(50),
            save_retry: Duration::from_secs(20),
            ..config(Duration::from_secs(2), Action::Hold(HoldReason::Cancelled))
        },
    );
    let (scope, key) = (fresh_scope(), fresh_key("save-retry"));
    faulty.set(Op::Complete, Fault::Unavailable);
    let out = engine
        .execute(&scope, &key, fp("a"), |_lease| async move {
            ((), Action::Store(response("paid")))
        })
        .await
        .expect("execute");
    assert!(
        matches!(
            out,
            Outcome::Executed {
                saved: Saved::Failed(_),
                ..
            }
        ),
        "{out:?}"
    );
    let store = h.store();
    let r = req(&scope, &key, fp("a"), Duration::from_secs(2));
    expect_in_flight(&store, &r, Duration::from_secs(2)).await;
    faulty.clear_all();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        match store.begin(&r).await.expect("begin") {
            Begin::Replay(resp) => {
                assert_eq!(resp.status, response("paid").status);
                assert!(
                    resp.body == response("paid").body || resp.body_omitted,
                    "the replay is the result, or the result without its body"
                );
                break;
            }
            Begin::InFlight { .. } => {}
            other => panic!("a retried save must never free the key for a second run: {other:?}"),
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the retried save did not land within 10 s"
        );
        tokio::time::sleep(ms(20)).await;
    }
}

/// Issue 16, waiters share the outcome they waited for: 20 concurrent
/// duplicates in wait mode, whose original does its work and then fails
/// without effect ([`Action::ReleaseWith`], an upstream 500), run the
/// operation once — every waiter gets the original's failure replayed,
/// marked `released` — where each waiter used to wake to a free key and run
/// it again in turn (16 to 17 executions). Another request reusing the key
/// within the window is `Mismatch`; a later retry of the same request (one
/// that did not wait for the execution) is not given the failure: it waits
/// out [`EngineConfig::share_failure`] and then runs again.
pub async fn engine_waiters_share_a_released_failure<H: Harness>(h: &H) {
    let window = Duration::from_secs(1);
    let cfg = |wait| EngineConfig {
        wait,
        share_failure: window,
        ..config(Duration::from_secs(30), Action::Hold(HoldReason::Cancelled))
    };
    let waiting = Engine::with_config(h.store(), cfg(Duration::from_secs(10)));
    let (scope, key) = (fresh_scope(), fresh_key("share-failure"));
    let failure = StoredResponse::new(500, b"upstream failed".to_vec());
    let runs = Arc::new(AtomicUsize::new(0));
    let outcomes = all_at_once(20, |_| {
        let (engine, scope, key, runs, failure) = (
            waiting.clone(),
            scope.clone(),
            key.clone(),
            runs.clone(),
            failure.clone(),
        );
        async move {
            let op = |_lease| async move {
                runs.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(ms(200)).await;
                ((), Action::ReleaseWith(failure))
            };
            engine.execute(&scope, &key, fp("pay 10"), op).await
        }
    })
    .await;
    let shared = StoredResponse {
        released: true,
        ..failure.clone()
    };
    let (mut executed, mut replayed) = (0, 0);
    for outcome in outcomes {
        match outcome.expect("execute") {
            Outcome::Executed { saved, .. } => {
                executed += 1;
                assert!(matches!(saved, Saved::Released), "saved: {saved:?}");
            }
            Outcome::Replayed(r) => {
                replayed += 1;
                assert_eq!(r, shared, "a waiter gets the failure it waited for");
            }
            other => panic!("a waiter must get the shared failure, got {other:?}"),
        }
    }
    assert_eq!(
        runs.load(Ordering::SeqCst),
        1,
        "one execution for 20 duplicates"
    );
    assert_eq!((executed, replayed), (1, 19));

    // Within the window another request on the key is refused, and a
    // later retry (one that did not wait for the execution) is not given
    // the failure: it waits out the window, then runs, once.
    let no_wait = Engine::with_config(h.store(), cfg(Duration::ZERO));
    let other = no_wait
        .execute(&scope, &key, fp("pay 99"), |_| async {
            panic!("another request must not run on a shared failure");
            #[allow(unreachable_code)]
            ((), Action::Release)
        })
        .await
        .expect("execute");
    assert!(matches!(other, Outcome::<()>::Mismatch), "{other:?}");
    let retry = tokio::spawn({
        let (engine, scope, key, runs) =
            (no_wait.clone(), scope.clone(), key.clone(), runs.clone());
        async move {
            engine
                .execute(&scope, &key, fp("pay 10"), |_| async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    ((), Action::Store(response("paid")))
                })
                .await
        }
    });
    tokio::time::sleep(ms(150)).await;
    assert!(
        !retry.is_finished(),
        "a later retry must wait out the window, not get the shared failure"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    h.advance(window + ms(100)).await;
    let retry = retry.await.expect("join").expect("execute");
    assert!(
        matches!(
            retry,
            Outcome::Executed {
                saved: Saved::Stored,
                ..
            }
        ),
        "{retry:?}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

/// [`Action::ReleaseWith`] with [`EngineConfig::share_failure`] 0 is a
/// plain release: the next duplicate runs at once.
pub async fn engine_share_failure_zero_releases_at_once<H: Harness>(h: &H) {
    let engine = Engine::with_config(
        h.store(),
        EngineConfig {
            share_failure: Duration::ZERO,
            ..config(Duration::from_secs(30), Action::Hold(HoldReason::Cancelled))
        },
    );
    let (scope, key) = (fresh_scope(), fresh_key("share-zero"));
    let runs = AtomicUsize::new(0);
    for _ in 0..2 {
        let out = engine
            .execute(&scope, &key, fp("a"), |_| async {
                runs.fetch_add(1, Ordering::SeqCst);
                (
                    (),
                    Action::ReleaseWith(StoredResponse::new(503, Vec::new())),
                )
            })
            .await
            .expect("execute");
        assert!(matches!(saved(&out), Saved::Released), "{out:?}");
    }
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

/// [`Action::Hold`] marks the key held with its reason and keeps it at
/// least [`EngineConfig::hold_for`] past its lease (a duplicate then gets
/// `InFlight`, not a second run); a save given up holds the key as
/// [`HoldReason::SaveFailed`].
pub async fn engine_hold_marks_the_key_with_its_reason<H: Harness>(h: &H) {
    let faulty = FaultyStore::new(h.store());
    let lease = Duration::from_secs(1);
    let engine = Engine::with_config(
        faulty.clone(),
        EngineConfig {
            save_wait: Duration::ZERO,
            save_retry: Duration::ZERO,
            hold_for: Duration::from_secs(3),
            ..config(lease, Action::Hold(HoldReason::Cancelled))
        },
    );
    let scope = fresh_scope();
    let held = |rec: Option<Record>| match rec {
        Some(Record {
            state: RecordState::InProgress { held, .. },
            ..
        }) => held,
        other => panic!("expected a record in progress, got {other:?}"),
    };
    let key = fresh_key("hold-timeout");
    let out = engine
        .execute(&scope, &key, fp("a"), |_| async {
            ((), Action::Hold(HoldReason::Timeout))
        })
        .await
        .expect("execute");
    assert!(matches!(saved(&out), Saved::Held), "{out:?}");
    let store = h.store();
    assert_eq!(
        held(get(&store, &scope, &key).await),
        Some(HoldReason::Timeout)
    );
    // Past the lease, within the hold: a duplicate does not run.
    h.advance(Duration::from_millis(1500)).await;
    let again = engine
        .execute(&scope, &key, fp("a"), |_| async {
            panic!("a held key ran again within its hold");
            #[allow(unreachable_code)]
            ((), Action::Release)
        })
        .await
        .expect("execute");
    assert!(matches!(again, Outcome::InFlight { .. }), "{again:?}");

    let key = fresh_key("hold-save-failed");
    faulty.set(Op::Complete, Fault::Unavailable);
    let out = engine
        .execute(&scope, &key, fp("a"), |_| async {
            ((), Action::Store(response("lost")))
        })
        .await
        .expect("execute");
    faulty.clear_all();
    assert!(matches!(saved(&out), Saved::Failed(_)), "{out:?}");
    assert_eq!(
        held(get(&store, &scope, &key).await),
        Some(HoldReason::SaveFailed)
    );
}
