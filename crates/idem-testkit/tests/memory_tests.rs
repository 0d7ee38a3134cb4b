//! The conformance suite on [`MemoryStore`], plus memory-only tests: the
//! entry and byte caps (CASES F2), and a property test comparing the store
//! with a small model of the key protocol.

mod memory_tests {
    use std::collections::HashMap;
    use std::time::Duration;

    use idem_core::{
        Begin, BeginRequest, Fingerprint, IdempotencyKey, Lease, ManualClock, MemoryLimits,
        MemoryStore, Millis, Record, RecordState, Scope, Store, StoreError, StoredResponse,
    };
    use idem_testkit::support::{acquire, expect_in_flight, expect_replay, fp, req, response};
    use idem_testkit::{Harness, MemoryHarness, SleepingHarness};
    use proptest::prelude::*;

    idem_testkit::conformance_tests!(conformance, || async { MemoryHarness::new() });

    // The suite once more on the system clock, letting time pass by sleeping,
    // as it runs for stores that keep time themselves (PostgreSQL, Redis):
    // proves its leases and TTLs are short and its timing holds up.
    idem_testkit::conformance_tests!(conformance_real_time, || async {
        SleepingHarness(MemoryStore::new())
    });

    fn key(name: &str) -> IdempotencyKey {
        IdempotencyKey::new(name).expect("valid key")
    }

    const SEC: Duration = Duration::from_secs(1);
    const MIN: Duration = Duration::from_secs(60);

    /// The `begin` request for key `name` (anonymous scope, fingerprint of `name`).
    fn named(name: &str, lease: Duration) -> BeginRequest {
        req(&Scope::anonymous(), &key(name), fp(name), lease)
    }

    async fn claim(store: &MemoryStore, name: &str, lease: Duration) -> Result<Begin, StoreError> {
        store.begin(&named(name, lease)).await
    }

    /// Expects `begin` of `name` to be refused with `Full`.
    async fn refused_full(store: &MemoryStore, name: &str) {
        match claim(store, name, MIN).await {
            Err(StoreError::Full { .. }) => {}
            other => panic!("expected Full, got {other:?}"),
        }
    }

    /// Expects `begin` of `name` to claim it.
    async fn acquires(store: &MemoryStore, name: &str, lease: Duration) {
        let got = claim(store, name, lease).await;
        assert!(matches!(got, Ok(Begin::Acquired(_))), "{name}: {got:?}");
    }

    /// A store capped at `max_entries` records and `max_bytes` bytes that
    /// may evict live results (`evict_live_results`), and its harness.
    fn evicting(max_entries: usize, max_bytes: usize) -> (MemoryHarness, MemoryStore) {
        let h = MemoryHarness::with_limits(MemoryLimits {
            max_entries,
            max_bytes,
            evict_live_results: true,
        });
        let store = h.store();
        (h, store)
    }

    async fn done(store: &MemoryStore, name: &str, ttl: Duration) {
        let lease = acquire(store, &named(name, MIN)).await;
        store
            .complete(&lease, &response(name), ttl)
            .await
            .expect("complete");
    }

    async fn present(store: &MemoryStore, name: &str) -> bool {
        // `delete` tells whether a record (even an expired one) is still held;
        // put nothing back: callers check records they are done with.
        store
            .delete(&Scope::anonymous(), &key(name))
            .await
            .expect("delete")
    }

    async fn replays(store: &MemoryStore, name: &str) {
        expect_replay(store, &named(name, MIN), &response(name)).await;
    }

    async fn in_flight(store: &MemoryStore, name: &str) {
        expect_in_flight(store, &named(name, MIN), MIN).await;
    }

    /// CASES F2 with the default limits: a store full of live results refuses
    /// new claims with `Full` rather than evicting a result, so a retry of any
    /// key within its TTL is still replayed (an evicted result would run again).
    /// Expired records still make room.
    #[tokio::test]
    async fn default_caps_refuse_instead_of_evicting_a_live_result() {
        let h = MemoryHarness::with_limits(MemoryLimits {
            max_entries: 2,
            ..MemoryLimits::default()
        });
        let store = h.store();
        done(&store, "a", MIN).await;
        done(&store, "b", 2 * SEC).await;
        refused_full(&store, "c").await;
        replays(&store, "a").await;
        replays(&store, "b").await;
        // b expires: now there is room, and a is still replayed.
        h.advance(3 * SEC).await;
        acquires(&store, "c", MIN).await;
        replays(&store, "a").await;
        in_flight(&store, "c").await;
    }

    /// CASES F2 with `evict_live_results`: with an entry cap, expired records go first, then claims whose
    /// lease ended, then the completed record that expires soonest; a live
    /// in-flight record is never evicted, and when only those fill the store
    /// `begin` fails with `Full`.
    #[tokio::test]
    async fn entry_cap_evicts_expired_then_stale_then_oldest_completed_never_in_flight() {
        let (h, store) = evicting(3, usize::MAX);
        done(&store, "a", SEC).await;
        done(&store, "b", MIN).await;
        done(&store, "c", MIN).await;
        assert_eq!(store.len(), 3);

        // a expired: it goes, b and c stay.
        h.advance(2 * SEC).await;
        acquires(&store, "d", MIN).await;
        assert_eq!(store.len(), 3);
        replays(&store, "b").await;
        replays(&store, "c").await;
        in_flight(&store, "d").await;

        // Full of live records: b is the oldest completed one.
        acquires(&store, "e", SEC).await;
        assert_eq!(store.len(), 3);
        replays(&store, "c").await;
        in_flight(&store, "d").await;
        in_flight(&store, "e").await;

        // e's lease ends: a stale claim goes before the live result c.
        h.advance(2 * SEC).await;
        acquires(&store, "f", MIN).await;
        replays(&store, "c").await;
        in_flight(&store, "d").await;
        in_flight(&store, "f").await;

        // Then c, the last completed record.
        acquires(&store, "g", MIN).await;
        in_flight(&store, "d").await;
        in_flight(&store, "f").await;
        in_flight(&store, "g").await;

        // Only live claims remain: refuse rather than evict one.
        refused_full(&store, "h").await;
        in_flight(&store, "d").await;
        in_flight(&store, "f").await;
        in_flight(&store, "g").await;
        assert!(!present(&store, "a").await);
        assert!(!present(&store, "b").await);
        assert!(!present(&store, "c").await);
        assert!(!present(&store, "e").await);
        assert!(!present(&store, "h").await);
    }

    /// The byte cap evicts the same way, and a result too large for the whole
    /// store fails with `Full` without evicting anything; its key stays in
    /// flight with the lease the store held (extended ones included).
    #[tokio::test]
    async fn byte_cap_evicts_oldest_completed_and_refuses_oversized_results() {
        let (h, store) = evicting(usize::MAX, 2_000);
        let big = |name: &str| StoredResponse::new(200, vec![name.as_bytes()[0]; 600]);
        for name in ["a", "b"] {
            let lease = acquire(&store, &named(name, MIN)).await;
            store
                .complete(&lease, &big(name), MIN)
                .await
                .expect("complete");
        }
        let two = store.bytes();
        assert!(two <= 2_000, "{two} bytes");
        // A third big result does not fit next to a and b: a (the oldest) goes.
        let lease = acquire(&store, &named("c", MIN)).await;
        store
            .complete(&lease, &big("c"), MIN)
            .await
            .expect("complete");
        assert!(store.bytes() <= 2_000);
        expect_replay(&store, &named("b", MIN), &big("b")).await;
        expect_replay(&store, &named("c", MIN), &big("c")).await;
        assert!(!present(&store, "a").await, "a was evicted");

        // A result larger than the whole store: Full, nothing evicted, the key
        // still held until the (extended) lease the store granted.
        let lease = acquire(&store, &named("huge", SEC)).await;
        let extended = store.extend(&lease, MIN).await.expect("extend");
        let huge = StoredResponse::new(200, vec![0u8; 5_000]);
        match store.complete(&lease, &huge, MIN).await {
            Err(StoreError::Full { .. }) => {}
            other => panic!("expected Full, got {other:?}"),
        }
        expect_replay(&store, &named("b", MIN), &big("b")).await;
        expect_replay(&store, &named("c", MIN), &big("c")).await;
        h.advance(2 * SEC).await; // past the original 1 s lease, inside the extended one
        match store
            .get(&Scope::anonymous(), &key("huge"))
            .await
            .expect("get")
        {
            Some(Record {
                state:
                    RecordState::InProgress {
                        fence, lease_until, ..
                    },
                ..
            }) => {
                assert_eq!(fence, lease.fence);
                assert_eq!(lease_until, extended.until);
            }
            other => panic!("the key must stay in flight, got {other:?}"),
        }
        in_flight(&store, "huge").await;
        // The holder can still store a result that fits.
        store
            .complete(&lease, &response("huge"), MIN)
            .await
            .expect("a smaller result fits");
        replays(&store, "huge").await;
    }

    /// A claim whose lease was extended is live: at capacity it is never
    /// evicted as stale at its old lease end (that would let a second run start).
    #[tokio::test]
    async fn extended_claim_is_not_evicted_at_its_old_lease_end() {
        let (h, store) = evicting(2, usize::MAX);
        let Ok(Begin::Acquired(lease)) = claim(&store, "long", SEC).await else {
            panic!("acquire");
        };
        store.extend(&lease, MIN).await.expect("extend");
        done(&store, "result", MIN).await;
        h.advance(2 * SEC).await; // past the claim's first lease end
                                  // Full: the live result goes, never the extended claim.
        acquires(&store, "next", MIN).await;
        in_flight(&store, "long").await;
        refused_full(&store, "more").await;
        in_flight(&store, "long").await;
        store
            .complete(&lease, &response("long"), MIN)
            .await
            .expect("the extended claim still completes");
        // Once its extended lease has ended a claim is stale again.
        h.advance(2 * MIN).await;
        assert_eq!(store.purge_expired().await.expect("purge"), 2);
        assert_eq!(store.len(), 0);
    }

    /// The byte cap with only in-flight records: `begin` is refused with `Full`
    /// and no claim is evicted; the byte count goes back to zero when all is gone.
    #[tokio::test]
    async fn byte_cap_full_of_claims_refuses_and_accounting_returns_to_zero() {
        let h = MemoryHarness::with_limits(MemoryLimits {
            max_entries: usize::MAX,
            max_bytes: 400,
            ..MemoryLimits::default()
        });
        let store = h.store();
        let mut held = Vec::new();
        let mut refused = false;
        for i in 0..10 {
            match claim(&store, &format!("k{i}"), MIN).await {
                Ok(Begin::Acquired(l)) => held.push(l),
                Err(StoreError::Full { .. }) => {
                    refused = true;
                    break;
                }
                other => panic!("unexpected {other:?}"),
            }
        }
        assert!(refused, "400 bytes cannot hold 10 claims");
        assert!(!held.is_empty());
        for l in &held {
            in_flight(&store, l.key.as_str()).await;
        }
        for l in &held {
            store.release(l).await.expect("release");
        }
        assert_eq!(store.len(), 0);
        assert_eq!(store.bytes(), 0);
        done(&store, "x", SEC).await;
        h.advance(2 * SEC).await;
        assert_eq!(store.purge_expired().await.expect("purge"), 1);
        assert_eq!(store.bytes(), 0);
    }

    // ---- property test: MemoryStore against a model of the state machine ----

    #[derive(Debug, Clone)]
    enum Op {
        Begin {
            rec: usize,
            fp: u8,
            lease_ms: u64,
        },
        Complete {
            lease: prop::sample::Index,
            ttl_ms: u64,
            body: u8,
        },
        Release {
            lease: prop::sample::Index,
        },
        Extend {
            lease: prop::sample::Index,
            ms: u64,
        },
        Advance {
            ms: u64,
        },
        Purge,
        Delete {
            rec: usize,
        },
        Get {
            rec: usize,
        },
    }

    fn op() -> impl Strategy<Value = Op> {
        let rec = 0..4usize;
        prop_oneof![
            4 => (rec.clone(), 0..2u8, 1..3_000u64).prop_map(|(rec, fp, lease_ms)| Op::Begin { rec, fp, lease_ms }),
            3 => (any::<prop::sample::Index>(), 1..3_000u64, any::<u8>()).prop_map(|(lease, ttl_ms, body)| Op::Complete { lease, ttl_ms, body }),
            1 => any::<prop::sample::Index>().prop_map(|lease| Op::Release { lease }),
            1 => (any::<prop::sample::Index>(), 1..3_000u64).prop_map(|(lease, ms)| Op::Extend { lease, ms }),
            3 => (0..2_500u64).prop_map(|ms| Op::Advance { ms }),
            1 => Just(Op::Purge),
            1 => rec.clone().prop_map(|rec| Op::Delete { rec }),
            2 => rec.prop_map(|rec| Op::Get { rec }),
        ]
    }

    #[derive(Debug, Clone, PartialEq)]
    enum Model {
        InProgress {
            fp: Fingerprint,
            fence: u64,
            until: u64,
        },
        Completed {
            fp: Fingerprint,
            resp: StoredResponse,
            expires: u64,
        },
    }

    impl Model {
        fn deadline(&self) -> u64 {
            match self {
                Model::InProgress { until, .. } => *until,
                Model::Completed { expires, .. } => *expires,
            }
        }
    }

    /// Two scopes × two keys, with the same key name in both scopes.
    fn target(rec: usize) -> (Scope, IdempotencyKey) {
        let scope = Scope::new(if rec < 2 { "s1" } else { "s2" }).expect("scope");
        (scope, key(if rec % 2 == 0 { "k" } else { "k " }))
    }

    fn rec_of(lease: &Lease) -> usize {
        (0..4)
            .find(|&r| target(r) == (lease.scope.clone(), lease.key.clone()))
            .expect("a known record")
    }

    async fn run_model(ops: Vec<Op>) -> Result<(), TestCaseError> {
        const T0: u64 = 1_700_000_000_000;
        let clock = ManualClock::new(Millis(T0));
        let store = MemoryStore::new().with_clock(clock.clone());
        let mut now = T0;
        let mut model: HashMap<usize, Model> = HashMap::new();
        let mut leases: Vec<Lease> = Vec::new();
        let mut last_fence: HashMap<usize, u64> = HashMap::new();
        for op in ops {
            match op {
                Op::Begin {
                    rec,
                    fp: f,
                    lease_ms,
                } => {
                    let (scope, k) = target(rec);
                    let fpr = fp(&format!("fp{f}"));
                    let got = store
                        .begin(&req(&scope, &k, fpr, Duration::from_millis(lease_ms)))
                        .await
                        .map_err(|e| TestCaseError::fail(format!("begin: {e}")))?;
                    // What answers instead of a claim: a live record, or an
                    // ended claim of another request (taken over only by
                    // the same fingerprint).
                    let live = model
                        .get(&rec)
                        .filter(|m| {
                            m.deadline() > now
                                || matches!(m, Model::InProgress { fp, .. } if *fp != fpr)
                        })
                        .cloned();
                    match (live, got) {
                        (
                            Some(Model::InProgress { fp: mf, until, .. }),
                            Begin::InFlight { retry_after },
                        ) => {
                            prop_assert_eq!(mf, fpr);
                            prop_assert_eq!(retry_after, Duration::from_millis(until - now));
                        }
                        (Some(Model::Completed { fp: mf, resp, .. }), Begin::Replay(r)) => {
                            prop_assert_eq!(mf, fpr);
                            prop_assert_eq!(r, resp);
                        }
                        (Some(m), Begin::Mismatch) => {
                            let mf = match m {
                                Model::InProgress { fp, .. } | Model::Completed { fp, .. } => fp,
                            };
                            prop_assert_ne!(mf, fpr);
                        }
                        (None, Begin::Acquired(l)) => {
                            prop_assert_eq!(l.until, Millis(now + lease_ms));
                            let prev = last_fence.get(&rec).copied().unwrap_or(0);
                            prop_assert!(l.fence > prev, "fence {} after {}", l.fence, prev);
                            last_fence.insert(rec, l.fence);
                            model.insert(
                                rec,
                                Model::InProgress {
                                    fp: fpr,
                                    fence: l.fence,
                                    until: now + lease_ms,
                                },
                            );
                            leases.push(l);
                        }
                        (m, got) => {
                            prop_assert!(false, "model {:?} but store answered {:?}", m, got)
                        }
                    }
                }
                Op::Complete {
                    lease,
                    ttl_ms,
                    body,
                } => {
                    if leases.is_empty() {
                        continue;
                    }
                    let l = lease.get(&leases).clone();
                    let rec = rec_of(&l);
                    let resp = StoredResponse::new(200, vec![body; 3]);
                    let got = store
                        .complete(&l, &resp, Duration::from_millis(ttl_ms))
                        .await;
                    match model.get(&rec).cloned() {
                        Some(Model::InProgress { fp, fence, .. }) if fence == l.fence => {
                            prop_assert!(got.is_ok(), "complete: {:?}", got);
                            model.insert(
                                rec,
                                Model::Completed {
                                    fp,
                                    resp,
                                    expires: now + ttl_ms,
                                },
                            );
                        }
                        _ => prop_assert!(
                            matches!(got, Err(StoreError::LeaseLost { fence }) if fence == l.fence),
                            "complete: {:?}",
                            got
                        ),
                    }
                }
                Op::Release { lease } => {
                    if leases.is_empty() {
                        continue;
                    }
                    let l = lease.get(&leases).clone();
                    let rec = rec_of(&l);
                    let got = store.release(&l).await;
                    match model.get(&rec) {
                        Some(Model::InProgress { fence, .. }) if *fence == l.fence => {
                            prop_assert!(got.is_ok(), "release: {:?}", got);
                            model.remove(&rec);
                        }
                        _ => prop_assert!(
                            matches!(got, Err(StoreError::LeaseLost { .. })),
                            "release: {:?}",
                            got
                        ),
                    }
                }
                Op::Extend { lease, ms } => {
                    if leases.is_empty() {
                        continue;
                    }
                    let l = lease.get(&leases).clone();
                    let rec = rec_of(&l);
                    let got = store.extend(&l, Duration::from_millis(ms)).await;
                    match model.get_mut(&rec) {
                        Some(Model::InProgress { fence, until, .. }) if *fence == l.fence => {
                            let renewed =
                                got.map_err(|e| TestCaseError::fail(format!("extend: {e}")))?;
                            prop_assert_eq!(renewed.until, Millis(now + ms));
                            prop_assert_eq!(renewed.fence, l.fence);
                            *until = now + ms;
                        }
                        _ => prop_assert!(
                            matches!(got, Err(StoreError::LeaseLost { .. })),
                            "extend: {:?}",
                            got
                        ),
                    }
                }
                Op::Advance { ms } => {
                    clock.advance(Duration::from_millis(ms));
                    now += ms;
                }
                Op::Purge => {
                    let n = store
                        .purge_expired()
                        .await
                        .map_err(|e| TestCaseError::fail(e.to_string()))?;
                    let before = model.len();
                    model.retain(|_, m| m.deadline() > now);
                    prop_assert_eq!(n, (before - model.len()) as u64);
                }
                Op::Delete { rec } => {
                    let (scope, k) = target(rec);
                    let existed = store
                        .delete(&scope, &k)
                        .await
                        .map_err(|e| TestCaseError::fail(e.to_string()))?;
                    prop_assert_eq!(existed, model.remove(&rec).is_some());
                }
                Op::Get { rec } => {
                    let (scope, k) = target(rec);
                    let got = store
                        .get(&scope, &k)
                        .await
                        .map_err(|e| TestCaseError::fail(e.to_string()))?;
                    let want =
                        model
                            .get(&rec)
                            .filter(|m| m.deadline() > now)
                            .map(|m| match m.clone() {
                                Model::InProgress { fp, fence, until } => Record {
                                    fingerprint: fp,
                                    state: RecordState::InProgress {
                                        fence,
                                        lease_until: Millis(until),
                                        held: None,
                                    },
                                },
                                Model::Completed { fp, resp, expires } => Record {
                                    fingerprint: fp,
                                    state: RecordState::Completed {
                                        response: resp,
                                        expires_at: Millis(expires),
                                    },
                                },
                            });
                    prop_assert_eq!(got, want);
                }
            }
            prop_assert_eq!(
                store.len(),
                model.len(),
                "records held (expired ones until purged)"
            );
        }
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        /// Random sequences of begin / complete / release / extend / advance /
        /// purge / delete / get give the answers a model of the protocol gives.
        #[test]
        fn memory_store_matches_model(ops in prop::collection::vec(op(), 1..80)) {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_time()
                .build()
                .expect("runtime");
            rt.block_on(run_model(ops))?;
        }
    }
}
