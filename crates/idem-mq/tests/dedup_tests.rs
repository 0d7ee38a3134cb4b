//! The store-based dedup ([`Dedup`]) without a broker: MemoryStore with a
//! ManualClock for lease expiry (H2, second half), and the real Redis store
//! (`IDEM_TEST_REDIS_URL`, default `redis://127.0.0.1:6379/`; unreachable →
//! the test fails naming the start command).

mod common;

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::{payment, redis_ledger, CountingCredit, Ledger};
use idem_core::{ManualClock, MemoryStore, Millis};
use idem_mq::{
    Dedup, DedupError, DedupOptions, DedupOutcome, Message, MessageKey, Outcome, Processor,
};

fn key(consumer: &str, id: &str) -> MessageKey {
    MessageKey::new(consumer, id).unwrap().with_stream("S")
}

fn msg(key: MessageKey) -> Message {
    let id = key.raw_id().to_owned();
    Message {
        key: Some(key),
        payload: payment(&id),
        delivery_attempt: 1,
    }
}

fn opts() -> DedupOptions {
    DedupOptions {
        lease: Duration::from_secs(30),
        retention: Duration::from_secs(3600),
    }
}

#[tokio::test]
async fn duplicate_is_skipped_and_failure_releases() {
    let dedup = Dedup::new(MemoryStore::new()).with_options(opts()).unwrap();
    let k = key("c", "m1");
    let runs = AtomicU32::new(0);
    let r: Result<DedupOutcome<()>, DedupError<&str>> = dedup
        .run(&k, || async {
            runs.fetch_add(1, Ordering::SeqCst);
            Err("fail")
        })
        .await;
    assert!(matches!(r, Err(DedupError::Handler("fail"))));
    // Released: the redelivery runs; after it, a duplicate does not.
    let run_ok = |v: i32| {
        let runs = &runs;
        dedup.run(&k, move || async move {
            runs.fetch_add(1, Ordering::SeqCst);
            Ok::<_, &str>(v)
        })
    };
    assert_eq!(run_ok(7).await.unwrap(), DedupOutcome::Applied(7));
    assert_eq!(run_ok(8).await.unwrap(), DedupOutcome::Duplicate);
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    assert!(dedup.is_processed(&k).await.unwrap());
}

/// H2 (second half): a claim whose holder crashed is in flight until its
/// lease ends (a duplicate then is left for redelivery, not run), and the
/// next delivery after the lease processes it. Then retention: past it, a
/// redelivery runs again (documented).
#[tokio::test]
async fn h2_expired_lease_is_processed_again_and_live_one_is_not() {
    let clock = ManualClock::new(Millis(1_000_000));
    let dedup = Dedup::new(MemoryStore::new().with_clock(clock.clone()))
        .with_options(DedupOptions {
            lease: Duration::from_secs(10),
            retention: Duration::from_secs(60),
        })
        .unwrap();
    let k = key("c", "crashy");
    // The first consumer claims and "crashes" inside its handler: the
    // future is dropped after begin, so neither complete nor release runs.
    let (started_tx, started_rx) = tokio::sync::oneshot::channel();
    let first = {
        let (dedup, k) = (dedup.clone(), k.clone());
        tokio::spawn(async move {
            dedup
                .run(&k, || async move {
                    let _ = started_tx.send(());
                    std::future::pending::<Result<(), &str>>().await
                })
                .await
        })
    };
    started_rx.await.unwrap();
    first.abort();
    let _ = first.await;
    // Lease live: in flight, the handler does not run.
    let r = dedup
        .run(&k, || async { Ok::<_, &str>("second") })
        .await
        .unwrap();
    assert!(matches!(r, DedupOutcome::InFlight { retry_after } if retry_after > Duration::ZERO));
    // Lease over: the next delivery processes it.
    clock.advance(Duration::from_secs(11));
    let r = dedup
        .run(&k, || async { Ok::<_, &str>("third") })
        .await
        .unwrap();
    assert_eq!(r, DedupOutcome::Applied("third"));
    assert_eq!(
        dedup
            .run(&k, || async { Ok::<_, &str>("x") })
            .await
            .unwrap(),
        DedupOutcome::Duplicate
    );
    // Past retention: forgotten, processed again.
    clock.advance(Duration::from_secs(61));
    assert_eq!(
        dedup
            .run(&k, || async { Ok::<_, &str>("y") })
            .await
            .unwrap(),
        DedupOutcome::Applied("y")
    );
}

/// The same id in two partitions, or for two consumers, is two messages.
#[tokio::test]
async fn partitions_and_consumers_scope_ids() {
    let dedup = Dedup::new(MemoryStore::new()).with_options(opts()).unwrap();
    let key = |consumer, partition| {
        MessageKey::new(consumer, "offset-5")
            .unwrap()
            .with_stream("orders")
            .with_partition(partition)
    };
    let (p0, p1, other) = (key("c", "0"), key("c", "1"), key("d", "0"));
    for k in [&p0, &p1, &other] {
        assert_eq!(
            dedup.run(k, || async { Ok::<_, &str>(()) }).await.unwrap(),
            DedupOutcome::Applied(())
        );
    }
    for k in [&p0, &p1, &other] {
        assert_eq!(
            dedup.run(k, || async { Ok::<_, &str>(()) }).await.unwrap(),
            DedupOutcome::Duplicate
        );
    }
}

/// As a Processor: a handler that fails twice then succeeds → one effect;
/// an id-less message let through (opt-in policy) runs without dedup.
#[tokio::test]
async fn processor_fails_twice_then_one_effect() {
    let handler = CountingCredit::default();
    handler.fail_first.store(2, Ordering::SeqCst);
    let p = Dedup::new(MemoryStore::new())
        .with_options(opts())
        .unwrap()
        .with_handler(handler);
    let m = msg(key("c", "pay-1"));
    let mut outcomes = Vec::new();
    for _ in 0..5 {
        outcomes.push(match p.process(&m).await {
            Outcome::Applied => "applied",
            Outcome::Duplicate => "duplicate",
            Outcome::Failed(_) => "failed",
            o => panic!("{o:?}"),
        });
    }
    assert_eq!(
        outcomes,
        ["failed", "failed", "applied", "duplicate", "duplicate"]
    );
    assert_eq!(p.handler().effects.lock().unwrap()["pay-1"], 1);
    let no_id = Message {
        key: None,
        payload: payment("pay-2"),
        delivery_attempt: 1,
    };
    assert!(matches!(p.process(&no_id).await, Outcome::Applied));
    assert!(matches!(p.process(&no_id).await, Outcome::Applied));
    assert_eq!(
        p.handler().effects.lock().unwrap()["pay-2"],
        2,
        "no dedup without an id, by choice"
    );
}

/// Redis: N distinct messages plus duplicates, delivered concurrently →
/// exactly N effects; every duplicate answered Duplicate or InFlight.
#[tokio::test]
async fn redis_n_messages_with_duplicates_give_n_effects() {
    let ledger = Arc::new(redis_ledger().await);
    let consumer = format!("c-{}", common::suffix());
    let n: usize = 25;
    let mut tasks = Vec::new();
    for copy in 0..3 {
        for i in 0..n {
            if copy > 0 && i % 2 == 1 {
                continue;
            }
            let (ledger, m) = (ledger.clone(), msg(key(&consumer, &format!("pay-{i}"))));
            tasks.push(tokio::spawn(async move { ledger.process(&m).await }));
        }
    }
    let (mut applied, mut skipped) = (0, 0);
    let mut retry = Vec::new();
    for t in tasks {
        match t.await.unwrap() {
            Outcome::Applied => applied += 1,
            Outcome::Duplicate => skipped += 1,
            Outcome::InFlight { .. } => retry.push(()),
            o => panic!("{o:?}"),
        }
    }
    assert_eq!(applied, n);
    assert_eq!(skipped + retry.len(), 2 * n.div_ceil(2));
    let effects = ledger.effects().await;
    assert_eq!(effects.len(), n);
    assert!(effects.values().all(|&v| v == 1), "{effects:?}");
    ledger.fail_next(0);
}

/// Issue 16 item 7: a zero retention (or lease) was accepted, so every
/// processed message was forgotten at once (every copy of it ran). Now the
/// options are refused with a typed error.
#[test]
fn zero_retention_and_lease_are_refused() {
    use idem_mq::{DedupOptionsError, MIN_RETENTION};
    for retention in [
        Duration::ZERO,
        Duration::from_nanos(1),
        Duration::from_millis(999),
    ] {
        let r = Dedup::new(MemoryStore::new()).with_options(DedupOptions {
            retention,
            ..opts()
        });
        assert_eq!(
            r.err(),
            Some(DedupOptionsError::RetentionTooShort {
                retention,
                min: MIN_RETENTION
            })
        );
    }
    for lease in [Duration::ZERO, Duration::from_nanos(1)] {
        let r = Dedup::new(MemoryStore::new()).with_options(DedupOptions { lease, ..opts() });
        assert!(matches!(
            r.err(),
            Some(DedupOptionsError::LeaseTooShort { .. })
        ));
    }
}

mod extremes {
    use super::*;
    use proptest::prelude::*;

    fn extreme() -> impl Strategy<Value = Duration> {
        prop_oneof![
            Just(Duration::ZERO),
            Just(Duration::from_nanos(1)),
            Just(Duration::from_secs(1)),
            Just(Duration::from_secs(30)),
            Just(Duration::from_secs(u64::MAX)),
            Just(Duration::MAX),
        ]
    }

    /// Any duration: the extremes above, or any seconds and nanoseconds.
    fn any_duration() -> impl Strategy<Value = Duration> {
        prop_oneof![
            extreme(),
            (any::<u64>(), 0..1_000_000_000u32).prop_map(|(s, n)| Duration::new(s, n)),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]

        /// Issue 16 item 7: the inbox (SQLite) at any purge age and retry
        /// count: no panic, no error; an age of an hour or more (up to
        /// `Duration::MAX`) keeps the row committed just now.
        #[test]
        fn inbox_purge_ages_and_retries_never_panic(age in any_duration(), retries in any::<u32>()) {
            use idem_mq::inbox::{Claim, Inbox, InboxOptions};
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            rt.block_on(async {
                let pool = sqlx::SqlitePool::connect("sqlite::memory:").await.unwrap();
                let inbox = Inbox::with_options(pool, InboxOptions::default().with_retries(retries)).unwrap();
                inbox.migrate().await.unwrap();
                match inbox.claim("c", "m").await.unwrap() {
                    Claim::New(tx) => tx.commit().await.unwrap(),
                    Claim::Duplicate => prop_assert!(false, "fresh inbox"),
                }
                let purged = inbox.purge_older_than(age).await;
                prop_assert!(purged.is_ok(), "{:?}: {:?}", age, purged);
                if age >= Duration::from_secs(3600) {
                    prop_assert_eq!(purged.unwrap(), 0);
                    prop_assert!(inbox.is_processed("c", "m").await.unwrap());
                }
                Ok(())
            })?;
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(36))]

        /// Issue 16 item 7: `DedupOptions` at extreme durations: no panic;
        /// refused with a typed error below 1 s, else a working dedup (runs
        /// once, then a duplicate).
        #[test]
        fn extreme_dedup_options_never_panic(lease in extreme(), retention in extreme()) {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            rt.block_on(async {
                let options = DedupOptions { lease, retention };
                let dedup = match Dedup::new(MemoryStore::new()).with_options(options) {
                    Ok(d) => d,
                    Err(e) => {
                        prop_assert!(lease < Duration::from_secs(1) || retention < Duration::from_secs(1), "{}", e);
                        return Ok(());
                    }
                };
                let k = key("c", "extreme");
                let first: Result<_, DedupError<()>> = dedup.run(&k, || async { Ok(1) }).await;
                prop_assert_eq!(first.unwrap(), DedupOutcome::Applied(1));
                let again: Result<_, DedupError<()>> = dedup.run(&k, || async { Ok(2) }).await;
                prop_assert_eq!(again.unwrap(), DedupOutcome::Duplicate);
                Ok(())
            })?;
        }
    }
}
