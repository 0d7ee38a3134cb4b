//! The listing checks ([`idem_core::KeyAdmin`], behind `idem keys list`):
//! filters by state and scope, cursor paging, order, visibility as `get`,
//! bad limits and cursors. Each takes a [`Harness`] whose store offers
//! listing ([`Store::admin`] is `Some`) and panics on a violation.
//!
//! Every check works in scopes of its own and lists with the scope filter,
//! so records of other checks sharing a server database never enter the
//! comparison; the one listing without a scope filter only asks that its
//! own records appear among whatever else is there.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use idem_core::admin::{ListPage, ListQuery, ListedRecord, StateFilter, MAX_LIST_LIMIT};
use idem_core::{IdempotencyKey, KeyAdmin, Millis, Record, RecordState, Scope, Store, StoreError};

use crate::support::*;
use crate::Harness;

const SEC: Duration = Duration::from_secs(1);
const LONG: Duration = Duration::from_secs(60);

/// Most pages one listing in these checks may take before it is a failure
/// (a cursor that never ends).
const MAX_PAGES: usize = 10_000;

/// The store's listing capability, or a failed check.
fn admin<S: Store>(store: &S) -> &dyn KeyAdmin {
    store
        .admin()
        .expect("the store offers no listing: Store::admin() returned None")
}

/// One page, failing the check on an error.
async fn page(a: &dyn KeyAdmin, q: &ListQuery) -> ListPage {
    match a.list(q).await {
        Ok(p) => {
            assert!(
                p.records.len() <= q.limit,
                "a page holds at most `limit` ({}) records, got {}",
                q.limit,
                p.records.len()
            );
            p
        }
        Err(e) => panic!("list({q:?}) failed: {e} ({e:?})"),
    }
}

/// Every record of a listing, page by page (`limit` per page), in the
/// order listed.
async fn list_all(
    a: &dyn KeyAdmin,
    state: StateFilter,
    scope: Option<&Scope>,
    limit: usize,
) -> Vec<ListedRecord> {
    let mut q = ListQuery {
        state,
        scope: scope.cloned(),
        limit,
        cursor: None,
    };
    let mut out = Vec::new();
    for _ in 0..MAX_PAGES {
        let p = page(a, &q).await;
        for r in &p.records {
            if let Some(scope) = scope {
                assert_eq!(
                    &r.scope, scope,
                    "the scope filter lets only its scope through"
                );
            }
            match (&r.record.state, state) {
                (RecordState::InProgress { .. }, StateFilter::Completed)
                | (RecordState::Completed { .. }, StateFilter::InFlight) => {
                    panic!("the {state:?} filter let {r:?} through")
                }
                _ => {}
            }
        }
        out.extend(p.records);
        match p.next {
            Some(next) => q.cursor = Some(next),
            None => return out,
        }
    }
    panic!("the listing did not end within {MAX_PAGES} pages")
}

/// The keys of a listing (in order).
fn keys(records: &[ListedRecord]) -> Vec<IdempotencyKey> {
    records.iter().map(|r| r.key.clone()).collect()
}

fn key_set(keys: &[IdempotencyKey]) -> BTreeSet<String> {
    keys.iter().map(|k| k.as_str().to_owned()).collect()
}

/// Asserts `got` holds exactly the keys `want`, each once.
fn assert_exactly(what: &str, got: &[ListedRecord], want: &[IdempotencyKey]) {
    let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
    for r in got {
        *counts.entry(r.key.as_str()).or_default() += 1;
    }
    let twice: Vec<_> = counts.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "{what}: listed more than once: {twice:?}");
    assert_eq!(
        counts
            .keys()
            .map(|k| (*k).to_owned())
            .collect::<BTreeSet<_>>(),
        key_set(want),
        "{what}: the listed keys"
    );
}

/// The listed record of `key`, compared with what `get` returns.
async fn assert_as_get<S: Store>(store: &S, listed: &ListedRecord) {
    let got = get(store, &listed.scope, &listed.key).await;
    match (&listed.record.state, got) {
        (_, Some(r)) => assert_eq!(&listed.record, &r, "a listed record is what get returns"),
        // get hides a claim past its lease; the listing shows it.
        (RecordState::InProgress { .. }, None) => {}
        (RecordState::Completed { .. }, None) => {
            panic!("a completed record get does not return was listed: {listed:?}")
        }
    }
}

/// The in-progress record's fence and lease end.
fn claim_of(r: &Record) -> (u64, Millis) {
    match &r.state {
        RecordState::InProgress {
            fence, lease_until, ..
        } => (*fence, *lease_until),
        other => panic!("expected an in-progress record, got {other:?}"),
    }
}

/// In flight and completed records are told apart by the state filter,
/// other scopes by the scope filter; each listed record is what `get`
/// returns; a listing without a scope filter includes every scope.
pub async fn list_filters_by_state_and_scope<H: Harness>(h: &H) {
    let store = h.store();
    let a = admin(&store);
    let (s1, s2) = (fresh_scope(), fresh_scope());
    let mut flying = Vec::new();
    let mut done = Vec::new();
    for (scope, n) in [(&s1, 2), (&s2, 1)] {
        for _ in 0..n {
            let k = fresh_key("list-flight");
            acquire(&store, &req(scope, &k, fp("a"), LONG)).await;
            flying.push((scope.clone(), k));
            let k = fresh_key("list-done");
            let l = acquire(&store, &req(scope, &k, fp("b"), LONG)).await;
            store
                .complete(&l, &rich_response(), LONG)
                .await
                .expect("complete");
            done.push((scope.clone(), k));
        }
    }
    let of = |v: &[(Scope, IdempotencyKey)], s: &Scope| -> Vec<IdempotencyKey> {
        v.iter()
            .filter(|(sc, _)| sc == s)
            .map(|(_, k)| k.clone())
            .collect()
    };
    let s1_flying = of(&flying, &s1);
    let s1_done = of(&done, &s1);
    let any = list_all(a, StateFilter::Any, Some(&s1), 100).await;
    assert_exactly(
        "scope 1, any state",
        &any,
        &[s1_flying.clone(), s1_done.clone()].concat(),
    );
    for r in &any {
        assert_as_get(&store, r).await;
        let want_fp = if s1_flying.contains(&r.key) {
            fp("a")
        } else {
            fp("b")
        };
        assert_eq!(r.record.fingerprint, want_fp, "{r:?}");
    }
    assert_exactly(
        "scope 1, in flight",
        &list_all(a, StateFilter::InFlight, Some(&s1), 100).await,
        &s1_flying,
    );
    let completed = list_all(a, StateFilter::Completed, Some(&s1), 100).await;
    assert_exactly("scope 1, completed", &completed, &s1_done);
    for r in &completed {
        match &r.record.state {
            RecordState::Completed { response, .. } => {
                assert_eq!(response, &rich_response(), "the listed response")
            }
            other => panic!("{other:?}"),
        }
    }
    assert_exactly(
        "scope 2, any state",
        &list_all(a, StateFilter::Any, Some(&s2), 100).await,
        &[of(&flying, &s2), of(&done, &s2)].concat(),
    );
    assert_exactly(
        "an unused scope",
        &list_all(a, StateFilter::Any, Some(&fresh_scope()), 100).await,
        &[],
    );
    // Without a scope filter: every scope (other checks' records too, when
    // the backend is shared), ours among them.
    let every = list_all(a, StateFilter::Any, None, MAX_LIST_LIMIT).await;
    let mine: Vec<_> = every
        .iter()
        .filter(|r| r.scope == s1 || r.scope == s2)
        .cloned()
        .collect();
    assert_exactly(
        "every scope",
        &mine,
        &[keys_of(&flying), keys_of(&done)].concat(),
    );
}

fn keys_of(v: &[(Scope, IdempotencyKey)]) -> Vec<IdempotencyKey> {
    v.iter().map(|(_, k)| k.clone()).collect()
}

/// 25 records (every third one in flight), listed 7 at a time: every
/// record exactly once, pages of at most 7, the last page says there is no
/// next one; a store that claims order ([`KeyAdmin::newest_first`]) lists
/// each state newest first.
pub async fn list_pages_visit_every_record_once<H: Harness>(h: &H) {
    let store = h.store();
    let a = admin(&store);
    let scope = fresh_scope();
    let mut flying = Vec::new();
    let mut done = Vec::new();
    for i in 0..25 {
        let k = fresh_key(&format!("page-{i:02}"));
        let l = acquire(&store, &req(&scope, &k, fp("a"), LONG)).await;
        if i % 3 == 0 {
            flying.push(k);
        } else {
            store
                .complete(&l, &response(&format!("r{i}")), LONG)
                .await
                .expect("complete");
            done.push(k);
        }
    }
    let all = [flying.clone(), done.clone()].concat();
    let pages = {
        let mut q = ListQuery {
            state: StateFilter::Any,
            scope: Some(scope.clone()),
            limit: 7,
            cursor: None,
        };
        let mut n = 0;
        let mut got = Vec::new();
        loop {
            let p = page(a, &q).await;
            n += 1;
            assert!(n <= MAX_PAGES, "the listing does not end");
            got.extend(p.records);
            match p.next {
                Some(c) => q.cursor = Some(c),
                None => break,
            }
        }
        assert_exactly("25 records by 7", &got, &all);
        n
    };
    assert!(
        pages >= 4,
        "25 records by 7 take at least 4 pages, took {pages}"
    );
    for (state, want) in [
        (StateFilter::InFlight, &flying),
        (StateFilter::Completed, &done),
    ] {
        let got = list_all(a, state, Some(&scope), 3).await;
        assert_exactly(&format!("{state:?} by 3"), &got, want);
        if a.newest_first() {
            let newest_first: Vec<_> = want.iter().rev().cloned().collect();
            assert_eq!(
                keys(&got),
                newest_first,
                "{state:?}: newest first (the store claims order)"
            );
        }
    }
    // A limit of one walks the same records.
    let ones = list_all(a, StateFilter::Any, Some(&scope), 1).await;
    assert_exactly("25 records by 1", &ones, &all);
}

/// A completed record past its TTL is not listed (as `get` does not return
/// it); a claim past its lease is listed as in flight (the key a crashed
/// holder left), with its ended lease; once taken over it is listed with the
/// new claim's fence.
pub async fn list_hides_expired_results_shows_ended_claims<H: Harness>(h: &H) {
    let store = h.store();
    let a = admin(&store);
    let scope = fresh_scope();
    let (k_claim, k_done, k_live) = (
        fresh_key("ended-claim"),
        fresh_key("expired-result"),
        fresh_key("live-result"),
    );
    let claim = acquire(&store, &req(&scope, &k_claim, fp("a"), SEC)).await;
    let d = acquire(&store, &req(&scope, &k_done, fp("a"), SEC)).await;
    store
        .complete(&d, &response("short"), SEC)
        .await
        .expect("complete");
    let l = acquire(&store, &req(&scope, &k_live, fp("a"), SEC)).await;
    store
        .complete(&l, &response("long"), LONG)
        .await
        .expect("complete");
    h.advance(Duration::from_millis(1300)).await;

    let any = list_all(a, StateFilter::Any, Some(&scope), 10).await;
    assert_exactly(
        "after the TTL and the lease ended",
        &any,
        &[k_claim.clone(), k_live.clone()],
    );
    let flying = list_all(a, StateFilter::InFlight, Some(&scope), 10).await;
    assert_exactly(
        "in flight past its lease",
        &flying,
        std::slice::from_ref(&k_claim),
    );
    let (fence, until) = claim_of(&flying[0].record);
    assert_eq!(fence, claim.fence, "the ended claim's fence");
    assert_eq!(until, claim.until, "the ended claim's lease end");
    assert_eq!(
        get(&store, &scope, &k_claim).await,
        None,
        "get hides the ended claim; the listing shows it"
    );
    assert_exactly(
        "completed, not expired",
        &list_all(a, StateFilter::Completed, Some(&scope), 10).await,
        std::slice::from_ref(&k_live),
    );

    let taken = acquire(&store, &req(&scope, &k_claim, fp("a"), LONG)).await;
    let flying = list_all(a, StateFilter::InFlight, Some(&scope), 10).await;
    assert_exactly(
        "after the takeover",
        &flying,
        std::slice::from_ref(&k_claim),
    );
    assert_eq!(
        claim_of(&flying[0].record),
        (taken.fence, taken.until),
        "listed with the new claim"
    );
}

/// A deleted record is not listed, in flight or completed; the others are.
pub async fn list_after_delete<H: Harness>(h: &H) {
    let store = h.store();
    let a = admin(&store);
    let scope = fresh_scope();
    let ks: Vec<_> = (0..4).map(|i| fresh_key(&format!("del-{i}"))).collect();
    for (i, k) in ks.iter().enumerate() {
        let l = acquire(&store, &req(&scope, k, fp("a"), LONG)).await;
        if i % 2 == 1 {
            store
                .complete(&l, &response("x"), LONG)
                .await
                .expect("complete");
        }
    }
    assert_exactly(
        "before",
        &list_all(a, StateFilter::Any, Some(&scope), 10).await,
        &ks,
    );
    for k in &ks[..2] {
        assert!(store.delete(&scope, k).await.expect("delete"));
    }
    assert_exactly(
        "after deleting one in flight and one completed",
        &list_all(a, StateFilter::Any, Some(&scope), 10).await,
        &ks[2..],
    );
    for k in &ks[2..] {
        assert!(store.delete(&scope, k).await.expect("delete"));
    }
    assert_exactly(
        "after deleting all",
        &list_all(a, StateFilter::Any, Some(&scope), 10).await,
        &[],
    );
}

/// A limit of 0 or above [`MAX_LIST_LIMIT`] and a cursor the store did not
/// make are [`StoreError::Invalid`]; `MAX_LIST_LIMIT` itself is accepted.
pub async fn list_refuses_bad_limits_and_cursors<H: Harness>(h: &H) {
    let store = h.store();
    let a = admin(&store);
    let scope = fresh_scope();
    for i in 0..3 {
        acquire(
            &store,
            &req(&scope, &fresh_key(&format!("bad-{i}")), fp("a"), LONG),
        )
        .await;
    }
    let q = |limit: usize, cursor: Option<&str>| ListQuery {
        state: StateFilter::Any,
        scope: Some(scope.clone()),
        limit,
        cursor: cursor.map(str::to_owned),
    };
    let invalid = |what: &str, r: Result<ListPage, StoreError>| match r {
        Err(StoreError::Invalid(msg)) => assert!(!msg.is_empty(), "{what}: say why"),
        other => panic!("{what} must be Invalid, got {other:?}"),
    };
    invalid("limit 0", a.list(&q(0, None)).await);
    invalid(
        "limit MAX_LIST_LIMIT + 1",
        a.list(&q(MAX_LIST_LIMIT + 1, None)).await,
    );
    invalid("limit usize::MAX", a.list(&q(usize::MAX, None)).await);
    for bad in [
        "",
        "garbage",
        "0",
        "-1",
        "\u{0}",
        "🦀",
        &"f".repeat(10_000),
        "sql1-ffffffffffffffff-00000000",
    ] {
        invalid(
            &format!("cursor {:?}", bad.chars().take(40).collect::<String>()),
            a.list(&q(10, Some(bad))).await,
        );
    }
    assert_eq!(
        list_all(a, StateFilter::Any, Some(&scope), MAX_LIST_LIMIT)
            .await
            .len(),
        3,
        "the largest limit is accepted"
    );
    // A real cursor, then mangled: still refused, never a panic. (A store
    // that scans, such as Redis, may answer a page with fewer records than
    // asked and a cursor; walk on until one record has been listed.)
    let mut listed = Vec::new();
    let mut cursor = None;
    for _ in 0..MAX_PAGES {
        let p = page(a, &q(1, cursor.as_deref())).await;
        listed.extend(p.records);
        cursor = p.next;
        if !listed.is_empty() || cursor.is_none() {
            break;
        }
    }
    assert_eq!(listed.len(), 1, "a page of one");
    let cursor = cursor.expect("three records by one: a next page");
    let mut mangled = cursor.clone();
    mangled.push('x');
    invalid(
        "a cursor with a byte added",
        a.list(&q(1, Some(&mangled))).await,
    );
    let mut rest = Vec::new();
    let mut next = Some(cursor);
    for _ in 0..MAX_PAGES {
        let Some(c) = next.take() else { break };
        let p = page(a, &q(1, Some(&c))).await;
        rest.extend(p.records);
        next = p.next;
    }
    assert_eq!(rest.len(), 2, "the cursor leads on to the other two");
    assert!(!rest.iter().any(|r| r.key == listed[0].key));
}
