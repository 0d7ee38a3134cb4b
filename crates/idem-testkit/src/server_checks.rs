//! Checks that stores on a real server (SQL, Redis) run besides the
//! conformance suite: one key raced through two separate connections or
//! pools, and corrupt records reported as `Corrupt`.

use idem_core::{BeginRequest, Lease, Phase, Store, StoreError};

use crate::support::{all_at_once, one_winner};

/// `n` concurrent `begin(r)`s, alternating between stores `a` and `b` (two
/// separate pools or connections on one backend), released together by a
/// barrier: exactly one `Acquired`, every other answer `InFlight` with a
/// `retry_after` in `(0, r.lease]`. Returns the winner's lease.
///
/// # Panics
/// When the answers are not one winner and `n - 1` in flight, or a
/// `begin` fails.
pub async fn race_begins<S: Store + Clone + 'static>(
    a: &S,
    b: &S,
    r: &BeginRequest,
    n: usize,
) -> Lease {
    let answers = all_at_once(n, |i| {
        let store = if i % 2 == 0 { a.clone() } else { b.clone() };
        let r = r.clone();
        async move { store.begin(&r).await }
    })
    .await;
    let answers = answers.into_iter().map(|a| a.expect("begin")).collect();
    one_winner(answers, r.lease)
}

/// The record of `r` is corrupt: `begin` reports `Corrupt` (phase `Begin`,
/// with a detail) and `get` reports `Corrupt` (phase `Get`); `what` names
/// the corruption in the panic message.
///
/// # Panics
/// When either answer is anything else.
pub async fn expect_corrupt<S: Store + ?Sized>(store: &S, r: &BeginRequest, what: &str) {
    match store.begin(r).await {
        Err(StoreError::Corrupt {
            phase: Phase::Begin,
            detail,
        }) => assert!(!detail.is_empty()),
        other => panic!("{what}: begin must report Corrupt, got {other:?}"),
    }
    match store.get(&r.scope, &r.key).await {
        Err(StoreError::Corrupt {
            phase: Phase::Get, ..
        }) => {}
        other => panic!("{what}: get must report Corrupt, got {other:?}"),
    }
}
