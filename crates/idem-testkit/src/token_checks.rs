//! Submit-token checks run over any store ([`idem_core::token`]): issue →
//! use → replay, one execution under 16 concurrent uses (CASES I1), unknown,
//! malformed and expired tokens rejected with the store left clean, tokens
//! bound to their scope, a reuse after the token's TTL replayed while the
//! result is retained, a retry after a released run, and no second run
//! once the result is forgotten.
//!
//! Expiry is driven by [`Harness::advance`]: instant on a manual clock
//! (memory, SQLite), a real sleep on stores that keep time themselves
//! (PostgreSQL, MySQL, Redis). Token TTLs there are 1 s and time is advanced
//! by 2.5 s, a margin of 1.5 s.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idem_core::token::{IssuedToken, SubmitTokens, TokenOutcome};
use idem_core::{Action, Engine, EngineConfig, IdempotencyKey, Outcome, Saved, Scope, Store};

use crate::support::*;
use crate::Harness;

/// The token TTL of the expiry checks.
const SHORT_TTL: Duration = Duration::from_secs(1);
/// How far time is moved past issue in the expiry checks (TTL + 1.5 s).
const PAST_TTL: Duration = Duration::from_millis(2500);

fn tokens<S: Store + Clone>(store: S, result_ttl: Duration) -> SubmitTokens<S> {
    SubmitTokens::from_engine(Engine::with_config(
        store,
        EngineConfig {
            lease: Duration::from_secs(30),
            ttl: result_ttl,
            ..EngineConfig::default()
        },
    ))
}

async fn use_token<S: Store + Clone>(
    t: &SubmitTokens<S>,
    scope: &idem_core::Scope,
    token: &str,
    runs: &AtomicUsize,
    body: &str,
) -> TokenOutcome<()> {
    t.execute(scope, token, fp("pay 10"), |_lease| async {
        let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
        ((), Action::Store(response(&format!("{body} {n}"))))
    })
    .await
    .expect("execute")
}

/// Tokens over `store` keeping results for `result_ttl`, a fresh scope,
/// and a token issued in it for `token_ttl`.
async fn issue_one<S: Store + Clone>(
    store: S,
    result_ttl: Duration,
    token_ttl: Duration,
) -> (SubmitTokens<S>, Scope, IssuedToken) {
    let t = tokens(store, result_ttl);
    let scope = fresh_scope();
    let issued = t.issue(&scope, token_ttl).await.expect("issue");
    (t, scope, issued)
}

/// The token's own record (as an idempotency key) in `scope`.
async fn token_record<S: Store>(store: &S, scope: &idem_core::Scope, token: &str) -> bool {
    let key = IdempotencyKey::new(token).expect("a token is a valid key");
    store.get(scope, &key).await.expect("get").is_some()
}

/// Issue, first use runs the operation and stores its result, a second use
/// replays it without running again; the issued shape is as documented.
pub async fn token_issue_use_replay<H: Harness>(h: &H) {
    let (t, scope, issued) =
        issue_one(h.store(), Duration::from_secs(60), Duration::from_secs(30)).await;
    assert_eq!(issued.token.len(), 36);
    assert!(issued.token.starts_with("tok_"));
    assert_eq!(issued.expires_in, Duration::from_secs(30));
    assert!(t.is_live(&scope, &issued.token).await.expect("is_live"));
    let runs = AtomicUsize::new(0);
    match use_token(&t, &scope, &issued.token, &runs, "paid").await {
        TokenOutcome::Keyed(Outcome::Executed { saved, .. }) => {
            assert!(matches!(saved, Saved::Stored), "saved: {saved:?}")
        }
        other => panic!("first use: {other:?}"),
    }
    assert!(
        !t.is_live(&scope, &issued.token).await.expect("is_live"),
        "a used token is no longer live"
    );
    match use_token(&t, &scope, &issued.token, &runs, "paid").await {
        TokenOutcome::Keyed(Outcome::Replayed(r)) => assert_eq!(r, response("paid 1")),
        other => panic!("reuse: {other:?}"),
    }
    // Another request with the same token is a mismatch, not a new run.
    let other = t
        .execute(&scope, &issued.token, fp("pay 99"), |_| async {
            panic!("must not run")
        })
        .await
        .expect("execute");
    assert!(
        matches!(other, TokenOutcome::<()>::Keyed(Outcome::Mismatch)),
        "{other:?}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// CASES I1: 16 concurrent uses of one token run the operation once; the
/// others get `InFlight` or the replay.
pub async fn token_concurrent_use_runs_once<H: Harness>(h: &H) {
    let (t, scope, issued) =
        issue_one(h.store(), Duration::from_secs(60), Duration::from_secs(30)).await;
    let runs = Arc::new(AtomicUsize::new(0));
    let outcomes = all_at_once(16, |_| {
        let (t, scope, token, runs) =
            (t.clone(), scope.clone(), issued.token.clone(), runs.clone());
        async move {
            let op = |_lease| async move {
                runs.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(200)).await;
                ((), Action::Store(response("paid")))
            };
            t.execute(&scope, &token, fp("pay 10"), op).await
        }
    })
    .await;
    let (mut executed, mut in_flight, mut replayed) = (0, 0, 0);
    for outcome in outcomes {
        match outcome.expect("execute") {
            TokenOutcome::Keyed(Outcome::Executed { saved, .. }) => {
                assert!(matches!(saved, Saved::Stored), "saved: {saved:?}");
                executed += 1;
            }
            TokenOutcome::Keyed(Outcome::InFlight { retry_after }) => {
                assert!(retry_after > Duration::ZERO);
                in_flight += 1;
            }
            TokenOutcome::Keyed(Outcome::Replayed(r)) => {
                assert_eq!(r, response("paid"));
                replayed += 1;
            }
            other => panic!("unexpected: {other:?}"),
        }
    }
    assert_eq!(executed, 1, "exactly one use runs");
    assert_eq!(executed + in_flight + replayed, 16);
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the operation ran once");
}

/// A token that was never issued (well-formed or not) is rejected, nothing
/// runs, and the store holds no record for it afterwards.
pub async fn token_unknown_rejected_store_clean<H: Harness>(h: &H) {
    let store = h.store();
    let t = tokens(store.clone(), Duration::from_secs(60));
    let scope = fresh_scope();
    let unknown = format!("tok_{}", random_hex(32));
    let runs = AtomicUsize::new(0);
    for token in [unknown.as_str(), "order-42", "tok_XYZ", ""] {
        let out = use_token(&t, &scope, token, &runs, "paid").await;
        assert!(
            matches!(out, TokenOutcome::TokenRejected),
            "{token:?}: {out:?}"
        );
    }
    assert_eq!(runs.load(Ordering::SeqCst), 0, "nothing ran");
    assert!(
        !token_record(&store, &scope, &unknown).await,
        "the claim on an unknown token is released"
    );
    assert!(
        !token_record(&store, &scope, "order-42").await,
        "a malformed token never touches the store"
    );
    // Rejected again, not in flight: the claim is gone.
    let again = use_token(&t, &scope, &unknown, &runs, "paid").await;
    assert!(matches!(again, TokenOutcome::TokenRejected), "{again:?}");
}

/// A token whose TTL passed before its first use is rejected and leaves no
/// record.
pub async fn token_expired_rejected<H: Harness>(h: &H) {
    let store = h.store();
    let (t, scope, issued) = issue_one(store.clone(), Duration::from_secs(60), SHORT_TTL).await;
    assert_eq!(issued.expires_in, SHORT_TTL);
    h.advance(PAST_TTL).await;
    assert!(!t.is_live(&scope, &issued.token).await.expect("is_live"));
    let runs = AtomicUsize::new(0);
    let out = use_token(&t, &scope, &issued.token, &runs, "paid").await;
    assert!(matches!(out, TokenOutcome::TokenRejected), "{out:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 0);
    assert!(!token_record(&store, &scope, &issued.token).await);
}

/// A token issued for scope A is unknown in scope B, and stays usable in A.
pub async fn token_bound_to_its_scope<H: Harness>(h: &H) {
    let store = h.store();
    let t = tokens(store.clone(), Duration::from_secs(60));
    let (a, b) = (fresh_scope(), fresh_scope());
    let issued = t.issue(&a, Duration::from_secs(30)).await.expect("issue");
    let runs = AtomicUsize::new(0);
    let in_b = use_token(&t, &b, &issued.token, &runs, "paid").await;
    assert!(matches!(in_b, TokenOutcome::TokenRejected), "{in_b:?}");
    assert!(!token_record(&store, &b, &issued.token).await);
    let in_a = use_token(&t, &a, &issued.token, &runs, "paid").await;
    assert!(
        matches!(in_a, TokenOutcome::Keyed(Outcome::Executed { .. })),
        "{in_a:?}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// Used within its TTL, reused after it (the result still retained): the
/// reuse gets the stored result, nothing runs again.
pub async fn token_reuse_after_ttl_replays<H: Harness>(h: &H) {
    let (t, scope, issued) = issue_one(h.store(), Duration::from_secs(60), SHORT_TTL).await;
    let runs = AtomicUsize::new(0);
    let first = use_token(&t, &scope, &issued.token, &runs, "paid").await;
    assert!(
        matches!(first, TokenOutcome::Keyed(Outcome::Executed { .. })),
        "{first:?}"
    );
    h.advance(PAST_TTL).await;
    match use_token(&t, &scope, &issued.token, &runs, "paid").await {
        TokenOutcome::Keyed(Outcome::Replayed(r)) => assert_eq!(r, response("paid 1")),
        other => panic!("reuse after the token's TTL: {other:?}"),
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// A run that releases its key (a retryable failure) leaves the token live:
/// a retry runs, and its result is then replayed.
pub async fn token_retry_after_release_runs<H: Harness>(h: &H) {
    let (t, scope, issued) =
        issue_one(h.store(), Duration::from_secs(60), Duration::from_secs(30)).await;
    let failed = t
        .execute(&scope, &issued.token, fp("pay 10"), |_| async {
            ((), Action::Release)
        })
        .await
        .expect("execute");
    match failed {
        TokenOutcome::Keyed(Outcome::Executed { saved, .. }) => {
            assert!(matches!(saved, Saved::Released), "{saved:?}")
        }
        other => panic!("{other:?}"),
    }
    assert!(t.is_live(&scope, &issued.token).await.expect("is_live"));
    let runs = AtomicUsize::new(0);
    let retry = use_token(&t, &scope, &issued.token, &runs, "paid").await;
    assert!(
        matches!(retry, TokenOutcome::Keyed(Outcome::Executed { .. })),
        "{retry:?}"
    );
    let again = use_token(&t, &scope, &issued.token, &runs, "paid").await;
    assert!(
        matches!(again, TokenOutcome::Keyed(Outcome::Replayed(_))),
        "{again:?}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// The token TTL is capped at the result TTL, and once a result is stored
/// the token is spent: after the result is forgotten, the token is rejected
/// rather than run a second time.
pub async fn token_never_runs_twice_after_result_expiry<H: Harness>(h: &H) {
    let (t, scope, issued) =
        issue_one(h.store(), Duration::from_secs(2), Duration::from_secs(3600)).await;
    assert_eq!(
        issued.expires_in,
        Duration::from_secs(2),
        "capped at the result TTL"
    );
    let runs = AtomicUsize::new(0);
    let first = use_token(&t, &scope, &issued.token, &runs, "paid").await;
    assert!(
        matches!(first, TokenOutcome::Keyed(Outcome::Executed { .. })),
        "{first:?}"
    );
    h.advance(Duration::from_millis(3500)).await;
    let late = use_token(&t, &scope, &issued.token, &runs, "paid").await;
    assert!(matches!(late, TokenOutcome::TokenRejected), "{late:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}
