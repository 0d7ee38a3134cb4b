//! The store conformance checks: one async fn per property of the key
//! protocol. Each takes a [`Harness`] and panics (fails the test) on a
//! violation. [`crate::conformance_tests!`] turns each into a `#[tokio::test]`.

use std::time::{Duration, Instant};

use idem_core::{
    Begin, HoldReason, IdempotencyKey, Lease, Record, RecordState, Scope, Store, StoreError,
    StoredResponse, MAX_KEY_LEN,
};

use crate::support::*;
use crate::Harness;

const SEC: Duration = Duration::from_secs(1);
const LONG: Duration = Duration::from_secs(60);

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn expect_lease_lost<T: std::fmt::Debug>(what: &str, r: Result<T, StoreError>, fence: u64) {
    match r {
        Err(StoreError::LeaseLost { fence: f }) => {
            assert_eq!(f, fence, "{what}: LeaseLost names the caller's fence")
        }
        other => panic!("{what} with a stale fence must fail with LeaseLost, got {other:?}"),
    }
}

/// Races `n` `begin`s of one key from spawned tasks released together;
/// returns their answers.
async fn race_begins<S: Store + Clone>(
    store: &S,
    req: &idem_core::BeginRequest,
    n: usize,
) -> Vec<Begin> {
    let answers = all_at_once(n, |_| {
        let (store, req) = (store.clone(), req.clone());
        async move { store.begin(&req).await }
    })
    .await;
    let mut out = Vec::with_capacity(n);
    for answer in answers {
        match answer {
            Ok(b) => out.push(b),
            Err(e) => panic!("a concurrent begin failed: {e} ({e:?})"),
        }
    }
    out
}

/// Claim once: the first `begin` acquires, the second is `InFlight` with a
/// retry-after in `(0, lease]`, and `get` shows the claim (CASES A2).
pub async fn claim_once<H: Harness>(h: &H) {
    let store = h.store();
    let (scope, key, r) = fresh_req("claim", 2 * SEC);
    let lease = acquire(&store, &r).await;
    assert!(lease.fence > 0, "fences are positive");
    expect_in_flight(&store, &r, 2 * SEC).await;
    let until = expect_in_progress(&store, &scope, &key, fp("a"), lease.fence).await;
    assert_eq!(
        until, lease.until,
        "get reports the lease end begin granted"
    );
    h.advance(ms(500)).await;
    // Still held half-way through; the retry-after shrinks with time.
    expect_in_flight(&store, &r, ms(1500)).await;
}

/// N = 32 concurrent `begin`s of one key from spawned tasks: exactly one
/// `Acquired`, the rest `InFlight` (CASES A1, I1).
pub async fn concurrent_begins_one_winner<H: Harness>(h: &H) {
    let store = h.store();
    let (scope, key, r) = fresh_req("race", 2 * SEC);
    let winner = one_winner(race_begins(&store, &r, 32).await, 2 * SEC);
    expect_in_progress(&store, &scope, &key, fp("a"), winner.fence).await;
}

/// `complete`, then every `begin` replays a byte-identical response: status
/// 201, repeated headers in order, a binary body (CASES C2, D1). A response
/// whose body was omitted round-trips too.
pub async fn complete_then_replay<H: Harness>(h: &H) {
    let store = h.store();
    let scope = fresh_scope();
    let key = fresh_key("replay");
    let r = req(&scope, &key, fp("a"), 2 * SEC);
    let lease = acquire(&store, &r).await;
    let resp = rich_response();
    store.complete(&lease, &resp, LONG).await.expect("complete");
    expect_replay(&store, &r, &resp).await;
    expect_replay(&store, &r, &resp).await;
    expect_completed(&store, &scope, &key, fp("a"), &resp).await;
    // A second completion with the same (now spent) fence is refused.
    expect_lease_lost(
        "complete twice",
        store.complete(&lease, &response("again"), LONG).await,
        lease.fence,
    );
    expect_replay(&store, &r, &resp).await;

    // 406 with a JSON body replays as 406 (CASES C2); an omitted body keeps its flag.
    let key2 = fresh_key("replay-406");
    let r2 = req(&scope, &key2, fp("b"), 2 * SEC);
    let lease2 = acquire(&store, &r2).await;
    let mut resp2 = StoredResponse::new(406, br#"{"error":"not acceptable"}"#.to_vec());
    resp2
        .headers
        .push(("content-type".into(), b"application/json".to_vec()));
    store
        .complete(&lease2, &resp2, LONG)
        .await
        .expect("complete 406");
    expect_replay(&store, &r2, &resp2).await;

    let key3 = fresh_key("replay-omitted");
    let r3 = req(&scope, &key3, fp("c"), 2 * SEC);
    let lease3 = acquire(&store, &r3).await;
    let resp3 = StoredResponse {
        body_omitted: true,
        ..StoredResponse::new(200, Vec::new())
    };
    store
        .complete(&lease3, &resp3, LONG)
        .await
        .expect("complete omitted");
    expect_replay(&store, &r3, &resp3).await;

    // The answer of a released failure (`Action::ReleaseWith`) keeps its
    // flag, so a duplicate knows it was shared, not stored.
    let key4 = fresh_key("replay-released");
    let r4 = req(&scope, &key4, fp("d"), 2 * SEC);
    let lease4 = acquire(&store, &r4).await;
    let resp4 = StoredResponse {
        released: true,
        ..StoredResponse::new(503, b"upstream down".to_vec())
    };
    store
        .complete(&lease4, &resp4, LONG)
        .await
        .expect("complete released");
    expect_replay(&store, &r4, &resp4).await;
}

/// A different fingerprint is `Mismatch` while the key is in flight and
/// after it completed (CASES E2); the original fingerprint still replays.
pub async fn mismatch_in_flight_and_after_completion<H: Harness>(h: &H) {
    let store = h.store();
    let (scope, key) = (fresh_scope(), fresh_key("mismatch"));
    let orig = req(&scope, &key, fp("POST /orders"), 2 * SEC);
    let other = req(&scope, &key, fp("POST /refunds"), 2 * SEC);
    let lease = acquire(&store, &orig).await;
    expect_mismatch(&store, &other).await;
    // The mismatching caller changed nothing.
    expect_in_progress(&store, &scope, &key, fp("POST /orders"), lease.fence).await;
    store
        .complete(&lease, &response("order"), LONG)
        .await
        .expect("complete");
    expect_mismatch(&store, &other).await;
    expect_replay(&store, &orig, &response("order")).await;
    expect_completed(&store, &scope, &key, fp("POST /orders"), &response("order")).await;
}

/// `release` frees the key at once; the next `begin` acquires it with a
/// larger fence; the released lease is dead (CASES C1).
pub async fn release_then_reclaim<H: Harness>(h: &H) {
    let store = h.store();
    let (scope, key, r) = fresh_req("release", 2 * SEC);
    let first = acquire(&store, &r).await;
    store.release(&first).await.expect("release");
    assert_eq!(
        get(&store, &scope, &key).await,
        None,
        "a released key is absent"
    );
    let second = acquire(&store, &r).await;
    assert!(
        second.fence > first.fence,
        "fence grows across release: {} then {}",
        first.fence,
        second.fence
    );
    expect_lease_lost("release twice", store.release(&first).await, first.fence);
    expect_lease_lost(
        "complete after release",
        store.complete(&first, &response("x"), LONG).await,
        first.fence,
    );
    expect_in_progress(&store, &scope, &key, fp("a"), second.fence).await;
    // After a release a different request may use the key.
    store.release(&second).await.expect("release");
    acquire(&store, &req(&scope, &key, fp("b"), 2 * SEC)).await;
}

/// A claim past its lease is taken over by exactly one of several
/// concurrent callers, with a larger fence (CASES A3, B1).
pub async fn lease_expiry_takeover_by_one<H: Harness>(h: &H) {
    let store = h.store();
    let (scope, key, r) = fresh_req("expiry", 2 * SEC);
    let first = acquire(&store, &r).await;
    h.advance(SEC).await;
    expect_in_flight(&store, &r, SEC).await;
    h.advance(ms(1100)).await;
    let winner = one_winner(race_begins(&store, &r, 8).await, 2 * SEC);
    assert!(
        winner.fence > first.fence,
        "takeover fence {} must exceed {}",
        winner.fence,
        first.fence
    );
    expect_in_progress(&store, &scope, &key, fp("a"), winner.fence).await;
    // A different request may take over neither a live claim nor an ended
    // one (the first's outcome is unknown): 422 both times; the same
    // request takes the ended claim over.
    let other = req(&scope, &key, fp("b"), 2 * SEC);
    expect_mismatch(&store, &other).await;
    h.advance(ms(2100)).await;
    expect_mismatch(&store, &other).await;
    let third = acquire(&store, &r).await;
    assert!(third.fence > winner.fence);
    assert!(third.took_over, "{third:?}");
}

/// An ended claim (in progress past its lease: the holder crashed or its
/// outcome is unknown) is taken over only by the same request: another
/// fingerprint gets `Mismatch` (422) at any time after the lease, until
/// the record is gone (released, deleted, purged); a result past its TTL is
/// replaced by any request.
pub async fn ended_claim_refuses_another_request<H: Harness>(h: &H) {
    let store = h.store();
    let (scope, key, r) = fresh_req("ended-other", SEC);
    let first = acquire(&store, &r).await;
    h.advance(ms(1200)).await;
    let other = req(&scope, &key, fp("b"), SEC);
    expect_mismatch(&store, &other).await;
    h.advance(ms(500)).await;
    expect_mismatch(&store, &other).await;
    // The record still names the first request; the same request takes over.
    let taken = acquire(&store, &r).await;
    assert!(taken.fence > first.fence && taken.took_over, "{taken:?}");
    // Released: the key is free for any request.
    store.release(&taken).await.expect("release");
    let b = acquire(&store, &other).await;
    // A result past its TTL is replaced by another request.
    store
        .complete(&b, &response("b"), SEC)
        .await
        .expect("complete");
    h.advance(ms(1200)).await;
    let c = acquire(&store, &req(&scope, &key, fp("c"), SEC)).await;
    assert!(!c.took_over && c.fence > b.fence, "{c:?}");
}

/// [`Lease::took_over`] is `true` only for a claim that took the key over
/// from a holder whose lease had ended (crash recovery): `false` for a
/// fresh key, after a release, after a delete and after a result's TTL
/// ended; `extend` keeps the value of the lease it renews.
pub async fn took_over_only_after_an_ended_claim<H: Harness>(h: &H) {
    let store = h.store();
    let (scope, key, r) = fresh_req("took-over", SEC);
    let fresh = acquire(&store, &r).await;
    assert!(!fresh.took_over, "a fresh key is not taken over: {fresh:?}");
    store.release(&fresh).await.expect("release");
    let after_release = acquire(&store, &r).await;
    assert!(
        !after_release.took_over,
        "a claim after a release is not a takeover"
    );
    // The holder "crashes": its lease ends without complete or release.
    h.advance(ms(1200)).await;
    let taken = acquire(&store, &r).await;
    assert!(
        taken.took_over,
        "a claim of a key whose holder's lease ended is a takeover: {taken:?}"
    );
    assert!(taken.fence > after_release.fence);
    let renewed = store.extend(&taken, SEC).await.expect("extend");
    assert!(renewed.took_over, "extend keeps took_over of the claim");
    // An ended result is not a crashed holder.
    store
        .complete(&renewed, &response("done"), SEC)
        .await
        .expect("complete");
    h.advance(ms(1200)).await;
    let after_ttl = acquire(&store, &r).await;
    assert!(
        !after_ttl.took_over,
        "a claim after the result's TTL ended is not a takeover"
    );
    assert!(store.delete(&scope, &key).await.expect("delete"));
    let after_delete = acquire(&store, &r).await;
    assert!(
        !after_delete.took_over,
        "a claim after a delete is not a takeover"
    );
    // A second key, taken over by exactly one of several racing callers:
    // only the winner says so.
    let (_, _, r2) = fresh_req("took-over-race", SEC);
    acquire(&store, &r2).await;
    h.advance(ms(1200)).await;
    let winner = one_winner(race_begins(&store, &r2, 8).await, SEC);
    assert!(
        winner.took_over,
        "the takeover winner reports it: {winner:?}"
    );
}

/// CASES B2: a lease of 1,500 ms is 1.5 s — held at 1,100 ms (so not cut
/// to 1 s), free at 1,600 ms (so not read as 1,500 s).
///
/// The "still held" checks leave at least 200 ms of slack, because with a
/// store that keeps real time (the sleeping harness) a stalled machine makes
/// more time pass than asked; the "free" checks cannot be hurt by that.
pub async fn sub_second_lease<H: Harness>(h: &H) {
    let store = h.store();
    let (scope, _, r) = fresh_req("b2", ms(1500));
    let first = acquire(&store, &r).await;
    h.advance(ms(1100)).await;
    expect_in_flight(&store, &r, ms(400)).await;
    h.advance(ms(500)).await;
    let second = acquire(&store, &r).await;
    assert!(second.fence > first.fence);

    // A 300 ms lease as well: held at 100 ms, free at 400 ms.
    let key = fresh_key("b2-short");
    let r = req(&scope, &key, fp("a"), ms(300));
    acquire(&store, &r).await;
    h.advance(ms(100)).await;
    expect_in_flight(&store, &r, ms(200)).await;
    h.advance(ms(300)).await;
    acquire(&store, &r).await;
}

/// A holder whose key was taken over gets `LeaseLost` from `complete`,
/// `release` and `extend`, and writes nothing (CASES G1, G3).
pub async fn stale_fence_rejected<H: Harness>(h: &H) {
    let store = h.store();
    let (scope, key, r) = fresh_req("stale", SEC);
    let old = acquire(&store, &r).await;
    h.advance(ms(1200)).await;
    let new = acquire(&store, &r).await;
    assert!(new.fence > old.fence);

    expect_lease_lost(
        "complete",
        store.complete(&old, &response("late"), LONG).await,
        old.fence,
    );
    expect_in_progress(&store, &scope, &key, fp("a"), new.fence).await;
    expect_lease_lost("release", store.release(&old).await, old.fence);
    expect_in_progress(&store, &scope, &key, fp("a"), new.fence).await;
    expect_lease_lost("extend", store.extend(&old, LONG).await, old.fence);
    let until = expect_in_progress(&store, &scope, &key, fp("a"), new.fence).await;
    assert_eq!(
        until, new.until,
        "a rejected extend must not move the new holder's lease"
    );

    // A made-up fence from the future is no better.
    let forged = Lease {
        fence: new.fence + 1_000_000,
        ..new.clone()
    };
    expect_lease_lost(
        "complete (forged fence)",
        store.complete(&forged, &response("forged"), LONG).await,
        forged.fence,
    );

    store
        .complete(&new, &response("new"), LONG)
        .await
        .expect("the current holder completes");
    expect_lease_lost(
        "complete after takeover and completion",
        store.complete(&old, &response("late"), LONG).await,
        old.fence,
    );
    expect_lease_lost(
        "extend of a completed key",
        store.extend(&new, LONG).await,
        new.fence,
    );
    expect_lease_lost(
        "release of a completed key",
        store.release(&new).await,
        new.fence,
    );
    expect_replay(&store, &r, &response("new")).await;
}

/// A lease that ran out but was not taken over is still current: a late
/// `complete` stores its result and duplicates replay it, instead of running
/// the operation a second time (docs/PROTOCOL.md, "Fences").
pub async fn late_complete_without_takeover_is_kept<H: Harness>(h: &H) {
    let store = h.store();
    let (_, _, r) = fresh_req("late", SEC);
    let lease = acquire(&store, &r).await;
    h.advance(ms(1500)).await;
    store
        .complete(&lease, &response("late but current"), LONG)
        .await
        .expect("a lease that ran out without a takeover may still complete");
    expect_replay(&store, &r, &response("late but current")).await;
}

/// `extend` moves the lease end: the key is still held where the old lease
/// would have ended, and frees itself when the new one ends.
pub async fn extend_moves_lease_end<H: Harness>(h: &H) {
    let store = h.store();
    let (scope, key, r) = fresh_req("extend", SEC);
    let lease = acquire(&store, &r).await;
    h.advance(ms(600)).await;
    let renewed = store.extend(&lease, 2 * SEC).await.expect("extend");
    assert_eq!(renewed.fence, lease.fence, "extend keeps the fence");
    assert_eq!((&renewed.scope, &renewed.key), (&scope, &key));
    assert!(
        renewed.until > lease.until,
        "extend moves the lease end: {:?} -> {:?}",
        lease.until,
        renewed.until
    );
    let until = expect_in_progress(&store, &scope, &key, fp("a"), lease.fence).await;
    assert_eq!(until, renewed.until);
    // t = 1.2 s: the old lease would have ended at 1 s.
    h.advance(ms(600)).await;
    expect_in_flight(&store, &r, 2 * SEC).await;
    // The extended lease (or the original one) still completes.
    let again = store.extend(&renewed, 2 * SEC).await.expect("extend again");
    assert!(again.until >= renewed.until);
    // t = 3.4 s: past the last lease end (1.2 s + 2 s).
    h.advance(ms(2200)).await;
    let next = acquire(&store, &r).await;
    assert!(next.fence > lease.fence);
}

/// CASES F1: a completed record is replayed until its TTL ends; then the
/// key is free and `begin` acquires it again.
pub async fn completed_record_expires_after_ttl<H: Harness>(h: &H) {
    let store = h.store();
    let (scope, key, r) = fresh_req("ttl", SEC);
    let first = acquire(&store, &r).await;
    store
        .complete(&first, &response("one"), 2 * SEC)
        .await
        .expect("complete");
    h.advance(SEC).await;
    expect_replay(&store, &r, &response("one")).await;
    h.advance(2 * SEC).await;
    assert_eq!(
        get(&store, &scope, &key).await,
        None,
        "an expired record reads as absent"
    );
    // Expired: a new execution, also for a different request.
    let second = acquire(&store, &req(&scope, &key, fp("b"), SEC)).await;
    assert!(second.fence > first.fence);
    store
        .complete(&second, &response("two"), 2 * SEC)
        .await
        .expect("complete");
    expect_replay(&store, &req(&scope, &key, fp("b"), SEC), &response("two")).await;
}

/// `get` reports each state; `delete` removes a record whatever its state
/// and says whether one existed; a deleted claim's lease is dead.
pub async fn get_and_delete<H: Harness>(h: &H) {
    let store = h.store();
    let (scope, key, r) = fresh_req("get", 2 * SEC);
    assert_eq!(get(&store, &scope, &key).await, None);
    assert!(
        !store.delete(&scope, &key).await.expect("delete"),
        "nothing to delete"
    );
    let first = acquire(&store, &r).await;
    expect_in_progress(&store, &scope, &key, fp("a"), first.fence).await;
    assert!(
        store.delete(&scope, &key).await.expect("delete"),
        "an in-flight record is deleted"
    );
    assert_eq!(get(&store, &scope, &key).await, None);
    expect_lease_lost(
        "complete after delete",
        store.complete(&first, &response("x"), LONG).await,
        first.fence,
    );
    assert_eq!(
        get(&store, &scope, &key).await,
        None,
        "a rejected complete writes nothing"
    );
    let second = acquire(&store, &r).await;
    assert!(second.fence > first.fence, "fence grows across delete");
    store
        .complete(&second, &response("done"), LONG)
        .await
        .expect("complete");
    expect_completed(&store, &scope, &key, fp("a"), &response("done")).await;
    assert!(
        store.delete(&scope, &key).await.expect("delete"),
        "a completed record is deleted"
    );
    assert!(
        !store.delete(&scope, &key).await.expect("delete"),
        "deleted once"
    );
    assert_eq!(get(&store, &scope, &key).await, None);
    acquire(&store, &r).await;
}

/// `purge_expired` removes completed records past their TTL and claims past
/// their lease, and leaves live ones (CASES F2).
pub async fn purge_expired_removes_only_expired<H: Harness>(h: &H) {
    let store = h.store();
    let scope = fresh_scope();
    let short = SEC;
    let (k_claim, k_done, k_live_claim, k_live_done) = (
        fresh_key("purge-claim"),
        fresh_key("purge-done"),
        fresh_key("purge-live-claim"),
        fresh_key("purge-live-done"),
    );
    let dead_claim = acquire(&store, &req(&scope, &k_claim, fp("a"), short)).await;
    let done = acquire(&store, &req(&scope, &k_done, fp("a"), short)).await;
    store
        .complete(&done, &response("done"), short)
        .await
        .expect("complete");
    let live_claim = acquire(&store, &req(&scope, &k_live_claim, fp("a"), LONG)).await;
    let live_done = acquire(&store, &req(&scope, &k_live_done, fp("a"), short)).await;
    store
        .complete(&live_done, &response("live"), LONG)
        .await
        .expect("complete");

    h.advance(ms(1500)).await;
    let n = store.purge_expired().await.expect("purge");
    // Other checks may share the backend, so more may go; never fewer.
    assert!(n >= 2, "purge removed {n} records; two had expired");
    assert!(
        !store.delete(&scope, &k_claim).await.expect("delete"),
        "the expired claim was purged"
    );
    assert!(
        !store.delete(&scope, &k_done).await.expect("delete"),
        "the expired result was purged"
    );
    expect_in_progress(&store, &scope, &k_live_claim, fp("a"), live_claim.fence).await;
    expect_completed(&store, &scope, &k_live_done, fp("a"), &response("live")).await;
    // The purged claim's holder lost it.
    expect_lease_lost(
        "complete after purge",
        store.complete(&dead_claim, &response("x"), LONG).await,
        dead_claim.fence,
    );
    // Nothing live was touched by a second purge either.
    store.purge_expired().await.expect("purge");
    expect_in_progress(&store, &scope, &k_live_claim, fp("a"), live_claim.fence).await;
    expect_completed(&store, &scope, &k_live_done, fp("a"), &response("live")).await;
}

/// Fences strictly grow for one key across release, expiry, purge, delete
/// and TTL expiry of a completed record.
pub async fn fence_grows_across_release_expiry_purge<H: Harness>(h: &H) {
    let store = h.store();
    let (scope, key, r) = fresh_req("fence", ms(500));
    let mut fences = vec![acquire(&store, &r).await];
    // release
    store
        .release(fences.last().expect("one"))
        .await
        .expect("release");
    fences.push(acquire(&store, &r).await);
    // lease expiry, taken over by begin
    h.advance(ms(600)).await;
    fences.push(acquire(&store, &r).await);
    // lease expiry, then purge
    h.advance(ms(600)).await;
    store.purge_expired().await.expect("purge");
    fences.push(acquire(&store, &r).await);
    // delete
    store.delete(&scope, &key).await.expect("delete");
    fences.push(acquire(&store, &r).await);
    // completed, expired, purged
    store
        .complete(fences.last().expect("one"), &response("x"), ms(500))
        .await
        .expect("complete");
    h.advance(ms(600)).await;
    store.purge_expired().await.expect("purge");
    fences.push(acquire(&store, &r).await);
    // completed, expired, taken over by begin without a purge
    store
        .complete(fences.last().expect("one"), &response("y"), ms(500))
        .await
        .expect("complete");
    h.advance(ms(600)).await;
    fences.push(acquire(&store, &r).await);
    for w in fences.windows(2) {
        assert!(
            w[1].fence > w[0].fence,
            "fences must strictly grow: {:?}",
            fences.iter().map(|l| l.fence).collect::<Vec<_>>()
        );
    }
}

/// `wait_for_change` wakes soon after the key completes (well before `max`);
/// a waiter then replays the result.
pub async fn wait_for_change_returns_early_on_complete<H: Harness>(h: &H) {
    let store = h.store();
    let (scope, key, r) = fresh_req("wait", LONG);
    let lease = acquire(&store, &r).await;
    let completer = {
        let store = store.clone();
        tokio::spawn(async move {
            tokio::time::sleep(ms(150)).await;
            store.complete(&lease, &response("waited"), LONG).await
        })
    };
    let started = Instant::now();
    let waited = tokio::time::timeout(5 * SEC, async {
        // Spurious early returns are allowed: wait until the answer changes.
        loop {
            store
                .wait_for_change(&scope, &key, 30 * SEC)
                .await
                .expect("wait_for_change");
            match begin(&store, &r).await {
                Begin::InFlight { .. } => continue,
                other => return other,
            }
        }
    })
    .await;
    match waited {
        Ok(Begin::Replay(resp)) => assert_eq!(resp, response("waited")),
        Ok(other) => panic!("after the wait expected Replay, got {other:?}"),
        Err(_) => {
            panic!("wait_for_change(max = 30 s) did not return within 5 s of the key completing")
        }
    }
    assert!(started.elapsed() < 5 * SEC);
    completer.await.expect("completer task").expect("complete");
}

/// `wait_for_change` returns by `max` when nothing changes, and promptly
/// for an absent key.
pub async fn wait_for_change_returns_by_max<H: Harness>(h: &H) {
    let store = h.store();
    let (scope, key, r) = fresh_req("wait-max", LONG);
    let lease = acquire(&store, &r).await;
    let started = Instant::now();
    tokio::time::timeout(3 * SEC, store.wait_for_change(&scope, &key, ms(300)))
        .await
        .expect("wait_for_change(max = 300 ms) must return within 3 s")
        .expect("wait_for_change");
    assert!(started.elapsed() < 3 * SEC);
    // Nothing changed meanwhile.
    expect_in_progress(&store, &scope, &key, fp("a"), lease.fence).await;
    let absent = fresh_key("wait-absent");
    tokio::time::timeout(3 * SEC, store.wait_for_change(&scope, &absent, ms(300)))
        .await
        .expect("wait_for_change on an absent key must return")
        .expect("wait_for_change");
}

/// `wait_for_change` with `max = Duration::MAX` (issue 16 item 7: SQL
/// stores panicked at `Instant + max`): no panic; prompt for an absent
/// key, and for a claimed key once it is released.
pub async fn wait_for_change_saturates_max<H: Harness>(h: &H) {
    let store = h.store();
    let (scope, key, r) = fresh_req("wait-dmax", LONG);
    let absent = fresh_key("wait-dmax-absent");
    tokio::time::timeout(
        3 * SEC,
        store.wait_for_change(&scope, &absent, Duration::MAX),
    )
    .await
    .expect("wait_for_change(Duration::MAX) on an absent key must return")
    .expect("wait_for_change");
    let lease = acquire(&store, &r).await;
    let releaser = {
        let store = store.clone();
        tokio::spawn(async move {
            tokio::time::sleep(ms(150)).await;
            store.release(&lease).await
        })
    };
    tokio::time::timeout(10 * SEC, store.wait_for_change(&scope, &key, Duration::MAX))
        .await
        .expect("wait_for_change(Duration::MAX) must return once the key is released")
        .expect("wait_for_change");
    releaser.await.expect("releaser task").expect("release");
}

/// Keys with spaces, quotes, SQL and glob metacharacters, keys of the
/// maximum length, keys that differ only in case or trailing blanks, and
/// scopes of 64 hex characters, 255 bytes, UTF-8 or empty all round-trip as
/// separate records.
pub async fn odd_keys_and_scopes_round_trip<H: Harness>(h: &H) {
    let store = h.store();
    let tag = random_hex(12);
    let max_len = {
        let mut k = format!("max-{tag}-");
        while k.len() < MAX_KEY_LEN {
            k.push(if k.len() % 2 == 0 { '~' } else { ' ' });
        }
        k.pop();
        k.push('z');
        k
    };
    let raw_keys = vec![
        format!("with space {tag}"),
        format!("\"quoted\" {tag}"),
        format!("it's {tag}"),
        format!("'; DROP TABLE idem_records; -- {tag}"),
        format!("back\\slash %_* ?[x] {{}} {tag}"),
        format!("Case-{tag}"),
        format!("case-{tag}"),
        format!("trail-{tag}"),
        format!("trail-{tag} "),
        format!(" lead-{tag}"),
        tag.clone(),
        format!("0{tag}"),
        max_len,
    ];
    let keys: Vec<IdempotencyKey> = raw_keys
        .iter()
        .map(|k| IdempotencyKey::new(k.clone()).expect("valid key"))
        .collect();
    assert_eq!(keys.last().map(|k| k.as_str().len()), Some(MAX_KEY_LEN));
    let long_scope = {
        let mut s = format!("scope-{tag}-");
        while s.len() < MAX_KEY_LEN {
            s.push('x');
        }
        s
    };
    let scopes = vec![
        Scope::hashed([tag.as_bytes()]),
        Scope::new(long_scope).expect("255-byte scope"),
        Scope::new(format!("tenant \"ü\" '{tag}'")).expect("UTF-8 scope"),
        Scope::new("").expect("the empty scope"),
    ];
    assert_eq!(scopes[0].as_str().len(), 64);
    for scope in &scopes {
        let mut leases = Vec::new();
        for key in &keys {
            let r = req(scope, key, fp(key.as_str()), LONG);
            leases.push(acquire(&store, &r).await);
        }
        for (key, lease) in keys.iter().zip(&leases) {
            let mut resp = response(key.as_str());
            resp.headers
                .push(("x-scope".into(), scope.as_str().as_bytes().to_vec()));
            store.complete(lease, &resp, LONG).await.expect("complete");
        }
        for key in &keys {
            let mut resp = response(key.as_str());
            resp.headers
                .push(("x-scope".into(), scope.as_str().as_bytes().to_vec()));
            expect_replay(&store, &req(scope, key, fp(key.as_str()), LONG), &resp).await;
            expect_completed(&store, scope, key, fp(key.as_str()), &resp).await;
        }
    }
    // Clean up the empty scope's records (it is shared by every run).
    for key in &keys {
        store.delete(&scopes[3], key).await.expect("delete");
    }
}

/// CASES E3: the same key in two scopes is two independent records: two
/// executions, each scope sees only its own result, and releasing or
/// deleting in one leaves the other alone.
pub async fn same_key_in_two_scopes_independent<H: Harness>(h: &H) {
    let store = h.store();
    let key = fresh_key("shared");
    let (alice, bob) = (fresh_scope(), fresh_scope());
    let ra = req(&alice, &key, fp("same body"), 2 * SEC);
    let rb = req(&bob, &key, fp("same body"), 2 * SEC);
    let la = acquire(&store, &ra).await;
    let lb = acquire(&store, &rb).await;
    store
        .complete(&la, &response("alice"), LONG)
        .await
        .expect("complete");
    expect_in_progress(&store, &bob, &key, fp("same body"), lb.fence).await;
    expect_in_flight(&store, &rb, 2 * SEC).await;
    store
        .complete(&lb, &response("bob"), LONG)
        .await
        .expect("complete");
    expect_replay(&store, &ra, &response("alice")).await;
    expect_replay(&store, &rb, &response("bob")).await;
    assert!(store.delete(&alice, &key).await.expect("delete"));
    expect_replay(&store, &rb, &response("bob")).await;
    assert_eq!(get(&store, &alice, &key).await, None);
    match get(&store, &bob, &key).await {
        Some(Record {
            state: RecordState::Completed { .. },
            ..
        }) => {}
        other => panic!("bob's record must survive alice's delete: {other:?}"),
    }
}

/// A held key ([`Store::hold`]: its outcome is unknown): the record is
/// marked with the reason, its lease end never moves back and moves to at
/// least now + `hold_for`; it answers as any in-flight record (the same
/// request `InFlight`, another `Mismatch`); only the current fence holds;
/// an operator settles it with `complete` or `release` under its fence;
/// once the hold ends the same request takes it over and the mark is gone.
pub async fn hold_marks_and_keeps_the_key<H: Harness>(h: &H) {
    let store = h.store();
    let (scope, key, r) = fresh_req("hold", SEC);
    let lease = acquire(&store, &r).await;
    let held = |rec: Option<Record>| match rec {
        Some(Record {
            state:
                RecordState::InProgress {
                    fence,
                    lease_until,
                    held,
                },
            ..
        }) => (fence, lease_until, held),
        other => panic!("expected a record in progress, got {other:?}"),
    };
    assert_eq!(
        held(get(&store, &scope, &key).await).2,
        None,
        "a new claim is not held"
    );
    // hold_for 0 marks the key and keeps its lease end.
    let kept = store
        .hold(&lease, HoldReason::Timeout, Duration::ZERO)
        .await
        .expect("hold");
    assert_eq!(
        (kept.fence, kept.until),
        (lease.fence, lease.until),
        "{kept:?}"
    );
    assert_eq!(
        held(get(&store, &scope, &key).await),
        (lease.fence, lease.until, Some(HoldReason::Timeout))
    );
    // A longer hold moves the end past the lease, with the newer reason.
    let longer = store
        .hold(&lease, HoldReason::SaveFailed, 3 * SEC)
        .await
        .expect("hold for 3 s");
    assert!(longer.until > lease.until, "{longer:?} vs {lease:?}");
    assert_eq!(
        held(get(&store, &scope, &key).await),
        (lease.fence, longer.until, Some(HoldReason::SaveFailed))
    );
    // A shorter one does not move it back.
    let again = store
        .hold(&lease, HoldReason::SaveFailed, ms(10))
        .await
        .expect("hold again");
    assert_eq!(again.until, longer.until, "a hold never shortens the lease");
    // Past the original lease: still in flight for the same request (retry
    // after at most the hold left), 422 for another.
    h.advance(ms(1200)).await;
    expect_in_flight(&store, &r, 3 * SEC).await;
    expect_mismatch(&store, &req(&scope, &key, fp("b"), SEC)).await;
    // Only the current fence holds.
    let stale = Lease {
        fence: lease.fence.wrapping_add(1),
        ..lease.clone()
    };
    expect_lease_lost(
        "hold",
        store.hold(&stale, HoldReason::Timeout, SEC).await,
        stale.fence,
    );
    // The operator's answer, under the record's fence, is replayed.
    store
        .complete(&lease, &response("settled"), LONG)
        .await
        .expect("complete a held key");
    expect_replay(&store, &r, &response("settled")).await;
    expect_lease_lost(
        "hold after complete",
        store.hold(&lease, HoldReason::Timeout, SEC).await,
        lease.fence,
    );

    // Released by an operator: gone, and the next claim is not held.
    let (scope2, key2, r2) = fresh_req("hold-release", SEC);
    let l2 = acquire(&store, &r2).await;
    store
        .hold(&l2, HoldReason::BrokenBody, Duration::ZERO)
        .await
        .expect("hold");
    store.release(&l2).await.expect("release a held key");
    assert!(get(&store, &scope2, &key2).await.is_none());
    let l3 = acquire(&store, &r2).await;
    assert_eq!(held(get(&store, &scope2, &key2).await).2, None);
    // A hold that ends is taken over by the same request; the mark is gone.
    store
        .hold(&l3, HoldReason::Cancelled, Duration::ZERO)
        .await
        .expect("hold");
    h.advance(ms(1200)).await;
    let l4 = acquire(&store, &r2).await;
    assert!(l4.took_over && l4.fence > l3.fence, "{l4:?}");
    assert_eq!(
        held(get(&store, &scope2, &key2).await),
        (l4.fence, l4.until, None),
        "a takeover clears the hold"
    );
}
