//! The orders service over real sockets, on SQLite (temp file) and
//! PostgreSQL (random schema): nobody is charged twice.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{fresh_key, start, Backend, Server};
use idem_core::lock::{LockBackend, TryAcquire};
use idem_sql::patterns::SqlValue;
use orders::{lock_name, provider_key, status, ChargeOutcome, Error, Fenced, KeyFence, Simulate};
use serde_json::Value;

on_both!(
    lost_response_then_retry_with_the_same_key_charges_once,
    twenty_concurrent_pays_with_one_key_charge_once,
    twenty_concurrent_pays_with_different_keys_charge_once,
    declined_then_retry_with_a_new_key_charges_once,
    client_gone_during_a_slow_pay_then_retry_charges_once,
    two_concurrent_submits_of_one_key_give_one_2xx,
    sixteen_concurrent_creates_make_one_row,
    a_stale_lock_holder_cannot_write_late,
    bad_input_is_a_problem_never_a_panic,
    a_lower_idempotency_fence_after_a_higher_one_writes_nothing,
    the_layer_fence_is_recorded_per_key,
);

fn assert_one_charge(s: &Server, charges: &[Value], id: i64) {
    assert_eq!(
        charges.len(),
        1,
        "{:?}: expected exactly one charge for order {id}: {charges:#?}",
        s.backend
    );
    assert_eq!(charges[0]["order_id"], id);
}

/// Pays order `id` with `key`, expects it PAID with exactly one charge;
/// returns the reply and the charges.
async fn expect_paid_once(s: &Server, id: i64, key: &str) -> (common::Reply, Vec<Value>) {
    let r = s.pay(id, key, None).await;
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(r.body["status"], status::PAID);
    let charges = s.charges(id).await;
    assert_one_charge(s, &charges, id);
    (r, charges)
}

/// The story: the provider charges, its answer is lost, the service
/// answers 504 and leaves the order PAYING; the client retries with the
/// same key, the service calls the provider with the same derived key and
/// finds the charge: PAID, one charge.
async fn lost_response_then_retry_with_the_same_key_charges_once(b: Backend) {
    let s = start(b).await;
    let id = s.new_order(1999).await;
    let key = fresh_key("lost");

    let first = s.pay(id, &key, Some("lose-response")).await;
    assert_eq!(first.status, 504, "{first:?}");
    assert!(first.is_problem(), "{first:?}");
    assert_eq!(
        first.body["type"], "urn:orders:problem:payment-outcome-unknown",
        "{first:?}"
    );
    let order = s.order(id).await;
    assert_eq!(order["status"], status::PAYING, "{order}");
    // The provider did charge: the service just could not know.
    assert_eq!(s.charges(id).await.len(), 1);

    // The client retries the very same request.
    let retry = s.pay(id, &key, Some("lose-response")).await;
    assert_eq!(retry.status, 200, "{retry:?}");
    assert!(
        !retry.replayed,
        "the 504 was released, not stored: {retry:?}"
    );
    assert_eq!(retry.body["status"], status::PAID, "{retry:?}");
    let charges = s.charges(id).await;
    assert_one_charge(&s, &charges, id);
    assert_eq!(charges[0]["provider_key"], provider_key(id, 1));
    assert_eq!(retry.body["charge_id"], charges[0]["id"]);

    // And once more: the stored answer.
    let again = s.pay(id, &key, Some("lose-response")).await;
    assert_eq!(again.status, 200);
    assert!(again.replayed, "{again:?}");
    assert_eq!(again.body, retry.body);
    assert_eq!(s.charges(id).await.len(), 1);
    s.finish().await;
}

async fn concurrent_pays(s: &Arc<Server>, id: i64, keys: Vec<String>) -> Vec<common::Reply> {
    let barrier = Arc::new(tokio::sync::Barrier::new(keys.len()));
    let mut tasks = tokio::task::JoinSet::new();
    for key in keys {
        let (s, barrier) = (s.clone(), barrier.clone());
        tasks.spawn(async move {
            barrier.wait().await;
            s.pay(id, &key, None).await
        });
    }
    let mut replies = Vec::new();
    while let Some(r) = tasks.join_next().await {
        replies.push(r.expect("task"));
    }
    replies
}

async fn twenty_concurrent_pays_with_one_key_charge_once(b: Backend) {
    let s = Arc::new(start(b).await);
    let id = s.new_order(500).await;
    let key = fresh_key("same");
    let replies = concurrent_pays(&s, id, vec![key.clone(); 20]).await;
    let originals = replies
        .iter()
        .filter(|r| r.status == 200 && !r.replayed)
        .count();
    assert!(originals <= 1, "{replies:#?}");
    for r in &replies {
        assert!(
            (r.status == 200 && r.body["status"] == status::PAID) || r.status == 409,
            "unexpected answer {r:?}"
        );
        if r.status == 409 {
            assert!(r.is_problem() && r.retry_after.is_some(), "{r:?}");
        }
    }
    // Whatever the answers, the order is paid once.
    expect_paid_once(&s, id, &key).await;
    Arc::try_unwrap(s).ok().expect("sole owner").finish().await;
}

async fn twenty_concurrent_pays_with_different_keys_charge_once(b: Backend) {
    let s = Arc::new(start(b).await);
    let id = s.new_order(700).await;
    let keys = (0..20).map(|i| fresh_key(&format!("k{i}"))).collect();
    let replies = concurrent_pays(&s, id, keys).await;
    let paid = replies
        .iter()
        .filter(|r| r.status == 200 && r.body["status"] == status::PAID)
        .count();
    assert!(paid >= 1, "nobody paid: {replies:#?}");
    for r in &replies {
        if r.status == 409 {
            // The lock said "operation in progress".
            assert_eq!(
                r.body["type"], "urn:orders:problem:operation-in-progress",
                "{r:?}"
            );
            assert!(r.retry_after.is_some(), "{r:?}");
        } else {
            assert_eq!(r.status, 200, "{r:?}");
            assert_eq!(r.body["status"], status::PAID, "{r:?}");
        }
    }
    expect_paid_once(&s, id, &fresh_key("late")).await;
    Arc::try_unwrap(s).ok().expect("sole owner").finish().await;
}

async fn declined_then_retry_with_a_new_key_charges_once(b: Backend) {
    let s = start(b).await;
    let id = s.new_order(1234).await;
    let declined = s.pay(id, &fresh_key("fail"), Some("fail")).await;
    assert_eq!(declined.status, 200, "{declined:?}");
    assert_eq!(declined.body["status"], status::PAYMENT_FAILED);
    assert!(s.charges(id).await.is_empty());

    let (retry, charges) = expect_paid_once(&s, id, &fresh_key("retry")).await;
    assert_eq!(retry.body["attempt"], 2, "a new attempt after a decline");
    assert_eq!(charges[0]["provider_key"], provider_key(id, 2));
    assert_eq!(charges[0]["amount_cents"], 1234);

    // Paying a paid order answers the order and charges nothing.
    let again = s.pay(id, &fresh_key("again"), None).await;
    assert_eq!(again.status, 200);
    assert_eq!(again.body["status"], status::PAID);
    assert_eq!(s.charges(id).await.len(), 1);
    s.finish().await;
}

/// The client gives up before the (slow) answer; the service finishes the
/// pay anyway (the idempotency layer runs it detached) and a retry with the
/// same key gets its result.
async fn client_gone_during_a_slow_pay_then_retry_charges_once(b: Backend) {
    let s = start(b).await;
    let id = s.new_order(4200).await;
    let key = fresh_key("slow");
    let gone = s
        .pay_request(id, &key, Some("slow"))
        .timeout(Duration::from_millis(300))
        .send()
        .await;
    assert!(
        gone.as_ref().is_err_and(|e| e.is_timeout()),
        "the slow pay answered within 300 ms: {gone:?}"
    );
    // Retry until the answer is there (409 in-flight while it runs).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let done = loop {
        let r = s.pay(id, &key, Some("slow")).await;
        if r.status == 200 {
            break r;
        }
        assert_eq!(r.status, 409, "{r:?}");
        assert!(tokio::time::Instant::now() < deadline, "still 409: {r:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(done.body["status"], status::PAID, "{done:?}");
    let charges = s.charges(id).await;
    assert_one_charge(&s, &charges, id);
    s.finish().await;
}

/// CASES I1: two concurrent submits with one key: exactly one 2xx original;
/// the other is 409 or the replay.
async fn two_concurrent_submits_of_one_key_give_one_2xx(b: Backend) {
    let s = Arc::new(start(b).await);
    for round in 0..3 {
        let id = s.new_order(100 + round).await;
        let key = fresh_key("i1");
        let replies = concurrent_pays(&s, id, vec![key.clone(), key.clone()]).await;
        let originals: Vec<_> = replies
            .iter()
            .filter(|r| r.status == 200 && !r.replayed)
            .collect();
        assert_eq!(originals.len(), 1, "{replies:#?}");
        for r in &replies {
            assert!(
                r.status == 409 || (r.status == 200 && r.body == originals[0].body),
                "{r:?}"
            );
        }
        assert_eq!(s.charges(id).await.len(), 1);
    }
    Arc::try_unwrap(s).ok().expect("sole owner").finish().await;
}

async fn sixteen_concurrent_creates_make_one_row(b: Backend) {
    let s = Arc::new(start(b).await);
    let no = fresh_key("ext");
    let barrier = Arc::new(tokio::sync::Barrier::new(16));
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..16 {
        let (s, barrier, no) = (s.clone(), barrier.clone(), no.clone());
        tasks.spawn(async move {
            barrier.wait().await;
            s.create(&no, 2500).await
        });
    }
    let mut replies = Vec::new();
    while let Some(r) = tasks.join_next().await {
        replies.push(r.expect("task"));
    }
    let created = replies.iter().filter(|r| r.status == 201).count();
    let existing = replies.iter().filter(|r| r.status == 200).count();
    assert_eq!((created, existing), (1, 15), "{replies:#?}");
    let id = replies[0].body["id"].clone();
    assert!(replies.iter().all(|r| r.body["id"] == id), "{replies:#?}");
    let rows: i64 = match s.app.db() {
        orders::Db::Sqlite(p) => {
            sqlx::query_scalar("SELECT COUNT(*) FROM orders WHERE outer_order_no = $1")
                .bind(&no)
                .fetch_one(p)
                .await
        }
        orders::Db::Postgres(p) => {
            sqlx::query_scalar("SELECT COUNT(*) FROM orders WHERE outer_order_no = $1")
                .bind(&no)
                .fetch_one(p)
                .await
        }
    }
    .expect("count");
    assert_eq!(rows, 1);

    // The same number with another amount is refused.
    let other = s.create(&no, 2600).await;
    assert_eq!(other.status, 409, "{other:?}");
    assert!(other.is_problem());
    Arc::try_unwrap(s).ok().expect("sole owner").finish().await;
}

/// A holder paused past its lease: it took the lock and moved the order to
/// PAYING, then stalled; its lease lapsed, a second holder paid; the first
/// holder's late ledger write and PAID transition are refused by the fence.
async fn a_stale_lock_holder_cannot_write_late(b: Backend) {
    let s = start(b).await;
    let id = s.new_order(900).await;
    let backend = s.app.lock().backend();
    let lease = match backend
        .try_acquire(&lock_name(id), Duration::from_millis(300))
        .await
        .expect("acquire")
    {
        TryAcquire::Acquired(lease) => lease,
        other => panic!("the free lock was busy: {other:?}"),
    };
    let stale_fence = i64::try_from(lease.fence).expect("fence fits");
    // The first holder starts the attempt...
    let started = s
        .app
        .orders()
        .transition(id, stale_fence, &[status::PENDING], status::PAYING, &[])
        .await
        .expect("transition");
    assert!(matches!(started, Fenced::Done(_)), "{started:?}");
    // ...and pauses past its lease (no renewal: the backend, not a guard).
    tokio::time::sleep(Duration::from_millis(1200)).await;

    // A second holder pays through the service (resumes attempt 1).
    let paid = s.pay(id, &fresh_key("second"), None).await;
    assert_eq!(paid.status, 200, "{paid:?}");
    assert_eq!(paid.body["status"], status::PAID);
    let newer = paid.body["fence"].as_i64().expect("fence");
    assert!(newer > stale_fence, "{newer} <= {stale_fence}");

    // The first holder wakes up and writes: the ledger refuses its fence,
    // also for a key nobody has used...
    for attempt in [1, 2] {
        let late = s
            .app
            .provider()
            .charge(
                id,
                900,
                &provider_key(id, attempt),
                stale_fence,
                Simulate::Normal,
            )
            .await
            .expect("charge");
        assert_eq!(
            late,
            ChargeOutcome::StaleFence { current: newer },
            "attempt {attempt}"
        );
    }
    // ...and so does the order's compare-and-set.
    let late = s
        .app
        .orders()
        .transition(
            id,
            stale_fence,
            &[status::PAYING, status::PAID],
            status::PAYMENT_FAILED,
            &[("charge_id", SqlValue::Null)],
        )
        .await
        .expect("transition");
    assert_eq!(late, Fenced::Stale { current: newer });
    let via_flow = s
        .app
        .pay_with_fence(id, stale_fence, Simulate::Normal)
        .await;
    assert!(via_flow.is_ok_and(|o| o.status == status::PAID));

    let order = s.order(id).await;
    assert_eq!(order["status"], status::PAID);
    let charges = s.charges(id).await;
    assert_one_charge(&s, &charges, id);
    assert_eq!(charges[0]["fence"], newer);
    // The stale lease's release is a no-op.
    assert!(!backend.release(&lease).await.expect("release"));
    s.finish().await;
}

async fn bad_input_is_a_problem_never_a_panic(b: Backend) {
    let s = start(b).await;
    // Made before the oversized upload below, which may leave the client a
    // closed connection that a POST is not retried on.
    let first = s.new_order(10).await;
    assert_eq!(s.get(&format!("/orders/{first}")).await.status, 200);
    let long = "x".repeat(65);
    for body in [
        String::new(),
        "{".to_owned(),
        "[1]".to_owned(),
        r#"{"outer_order_no":"a"}"#.to_owned(),
        r#"{"outer_order_no":"","amount_cents":5}"#.to_owned(),
        format!(r#"{{"outer_order_no":"{long}","amount_cents":5}}"#),
        r#"{"outer_order_no":"a","amount_cents":0}"#.to_owned(),
        r#"{"outer_order_no":"a","amount_cents":-1}"#.to_owned(),
        r#"{"outer_order_no":"a","amount_cents":1e40}"#.to_owned(),
        r#"{"outer_order_no":"a","amount_cents":9223372036854775808}"#.to_owned(),
        r#"{"outer_order_no":"a","amount_cents":5,"amount_cents":7}"#.to_owned(),
    ] {
        let r = s.post_json("/orders", &body).await;
        assert!(r.status == 400 || r.status == 422, "{body}: {r:?}");
        assert!(r.is_problem(), "{body}: {r:?}");
        assert_eq!(r.body["status"], r.status, "{r:?}");
    }
    // A body over axum's 2 MiB limit: 413, still a problem. The server may
    // answer and close before the upload ends, so the client can also see
    // a reset instead of the answer; an answer must be the problem.
    // On a client of its own: the server closes that connection, and a
    // pooled client could pick the dead connection for the next request
    // (hyper `IncompleteMessage`).
    let big = reqwest::Client::new()
        .post(format!("{}/orders", s.base))
        .header("content-type", "application/json")
        .body("x".repeat(3 << 20))
        .send()
        .await;
    match big {
        Ok(resp) => {
            let r = common::reply(resp).await;
            assert_eq!(r.status, 413, "{r:?}");
            assert!(r.is_problem(), "{r:?}");
        }
        Err(e) => assert!(e.is_request() || e.is_body(), "{e:?}"),
    }
    for path in [
        "/orders/999999".to_owned(),
        "/orders/abc".to_owned(),
        "/orders/-1".to_owned(),
        "/orders/1/x".to_owned(),
        format!("/orders/+{first}"),
        format!("/orders/0{first}"),
        format!("/orders/0{first}/charges"),
    ] {
        let r = s.get(&path).await;
        assert_eq!(r.status, 404, "{path}: {r:?}");
        assert!(r.is_problem(), "{path}: {r:?}");
    }
    // A non-canonical id is no order: a key cannot pay order `first` again
    // as a "different request" on `/orders/0{first}/pay`.
    for path in [
        format!("/orders/0{first}/pay"),
        format!("/orders/+{first}/pay"),
    ] {
        let r = common::reply(
            s.client
                .post(format!("{}{path}", s.base))
                .header("Idempotency-Key", fresh_key("alias"))
                .send()
                .await
                .expect("pay"),
        )
        .await;
        assert_eq!(r.status, 404, "{path}: {r:?}");
        assert!(r.is_problem(), "{path}: {r:?}");
    }
    assert_eq!(s.order(first).await["status"], status::PENDING);
    assert!(s.charges(first).await.is_empty());
    let r = s.pay(999_999, &fresh_key("none"), None).await;
    assert_eq!(r.status, 404, "{r:?}");
    let id = s.new_order(10).await;
    let r = s.pay(id, &fresh_key("sim"), Some("explode")).await;
    assert_eq!(r.status, 400, "{r:?}");
    assert!(r.is_problem());
    // A pay without an Idempotency-Key is refused by the edge layer.
    let r = common::reply(
        s.client
            .post(format!("{}/orders/{id}/pay", s.base))
            .send()
            .await
            .expect("pay"),
    )
    .await;
    assert_eq!(r.status, 400, "{r:?}");
    assert!(r.is_problem());
    assert_eq!(s.order(id).await["status"], status::PENDING);
    assert!(s.charges(id).await.is_empty());
    s.finish().await;
}

/// An unreachable PostgreSQL fails (never skips) with the start command.
#[tokio::test]
async fn an_unreachable_postgres_names_the_start_command() {
    let config = orders::Config::new("postgres://postgres@127.0.0.1:1/test");
    use futures::FutureExt;
    let outcome = std::panic::AssertUnwindSafe(common::connect(Backend::Postgres, config))
        .catch_unwind()
        .await;
    let panic = outcome.expect_err("connecting to port 1 succeeded");
    let message = panic.downcast::<String>().map(|s| *s).unwrap_or_default();
    assert!(
        message.contains(common::PG_START) && message.contains("not reachable"),
        "{message}"
    );
}

/// docs/PROTOCOL.md "Fences": the service keeps the highest
/// `Idempotency-Fence` per key and refuses a write with a lower one. A run
/// of key K with fence 7 is declined (the order becomes PAYMENT_FAILED);
/// then a run of K with fence 3 — the older run that lost its key after an
/// unknown outcome, still going — would start attempt 2 and charge: it is
/// refused with `StaleFence` and writes nothing (no charge, the order
/// unchanged). A newer run (fence 9) pays, once.
async fn a_lower_idempotency_fence_after_a_higher_one_writes_nothing(b: Backend) {
    let s = start(b).await;
    let id = s.new_order(700).await;
    let key = fresh_key("fenced");
    let scope = s.app.key_scope(&http::HeaderMap::new());
    let run = |fence: i64| KeyFence {
        scope: scope.clone(),
        key: key.clone(),
        fence,
    };
    let declined = s
        .app
        .pay_as(id, Some(run(7)), Simulate::Fail)
        .await
        .expect("first run");
    assert_eq!(declined.status, status::PAYMENT_FAILED);
    let before = s.order(id).await;

    let stale = s.app.pay_as(id, Some(run(3)), Simulate::Normal).await;
    assert!(
        matches!(
            stale,
            Err(Error::StaleFence {
                fence: 3,
                current: 7
            })
        ),
        "{stale:?}"
    );
    assert_eq!(s.order(id).await, before, "the stale run wrote nothing");
    assert!(s.charges(id).await.is_empty(), "and charged nothing");
    // Also a stale run that holds the order's lock itself (a fresh lock
    // fence): the key's fence alone refuses it.
    let stale = s
        .app
        .pay_with_fences(id, i64::MAX / 2, Some(&run(6)), Simulate::Normal)
        .await;
    assert!(
        matches!(stale, Err(Error::StaleFence { current: 7, .. })),
        "{stale:?}"
    );
    assert!(s.charges(id).await.is_empty());
    let order = s.order(id).await;
    assert_eq!(order["status"], status::PAYMENT_FAILED);
    assert_eq!(order["attempt"], 1);

    let newer = s
        .app
        .pay_as(id, Some(run(9)), Simulate::Normal)
        .await
        .expect("newer run");
    assert_eq!(newer.status, status::PAID);
    assert_one_charge(&s, &s.charges(id).await, id);
    // Other keys' fences are not compared with this one's.
    let other = KeyFence {
        key: fresh_key("other"),
        ..run(1)
    };
    let paid = s.app.pay_as(id, Some(other), Simulate::Normal).await;
    assert!(paid.is_ok_and(|o| o.status == status::PAID));
    assert_one_charge(&s, &s.charges(id).await, id);
    s.finish().await;
}

/// A pay through the idempotency layer records the fence the layer put in
/// the request's extensions under its (scope, key); a direct run of that
/// key with a lower fence is then refused.
async fn the_layer_fence_is_recorded_per_key(b: Backend) {
    let s = start(b).await;
    let id = s.new_order(300).await;
    let key = fresh_key("layer");
    // Declined, so a later run would write (start attempt 2).
    let r = s.pay(id, &key, Some("fail")).await;
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(r.body["status"], status::PAYMENT_FAILED);
    let scope = s.app.key_scope(&http::HeaderMap::new());
    let sql = "SELECT fence FROM key_fences WHERE scope = $1 AND idem_key = $2";
    let recorded: i64 = match s.app.db() {
        orders::Db::Sqlite(pool) => sqlx::query_scalar(sql)
            .bind(&scope)
            .bind(&key)
            .fetch_one(pool)
            .await
            .expect("key fence"),
        orders::Db::Postgres(pool) => sqlx::query_scalar(sql)
            .bind(&scope)
            .bind(&key)
            .fetch_one(pool)
            .await
            .expect("key fence"),
    };
    assert!(recorded > 0, "{recorded}");
    let stale = s
        .app
        .pay_as(
            id,
            Some(KeyFence {
                scope,
                key,
                fence: recorded - 1,
            }),
            Simulate::Normal,
        )
        .await;
    assert!(
        matches!(stale, Err(Error::StaleFence { current, .. }) if current == recorded),
        "{stale:?}"
    );
    assert!(s.charges(id).await.is_empty());
    s.finish().await;
}
