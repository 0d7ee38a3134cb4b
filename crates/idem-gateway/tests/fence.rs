//! `Idempotency-Fence`: every guarded request reaches the upstream with the
//! fencing token of the lease it runs under, a later run of the same key
//! with a greater one, and no fence a client sent ever reaches the
//! upstream.

mod common;

use common::*;
use reqwest::Method;

/// The fence the upstream saw on its last request, if any.
fn fence_seen(up: &TestUpstream) -> Option<u64> {
    let seen = up.last_seen();
    let all: Vec<_> = seen.headers.get_all("idempotency-fence").iter().collect();
    assert!(all.len() <= 1, "one fence at most: {all:?}");
    all.first().map(|v| {
        v.to_str()
            .unwrap()
            .parse()
            .unwrap_or_else(|e| panic!("fence {v:?}: {e}"))
    })
}

#[tokio::test]
async fn a_guarded_request_carries_its_lease_fence_and_a_rerun_a_greater_one() {
    let rig = rig(|_| {}).await;
    let k = key("fence");
    // A 500 is released: the retry runs again, under a new claim.
    let url = rig.gw.url("/status/500");
    let headers = [
        ("idempotency-key", k.as_str()),
        ("content-type", "application/json"),
    ];
    let run = || send(&rig.c, Method::POST, &url, &headers, "{}");
    let first = run().await;
    assert_eq!(first.status, 500);
    let f1 = fence_seen(&rig.up).expect("the first run has a fence");
    let again = run().await;
    assert_eq!(again.status, 500);
    assert_eq!(rig.up.hits(), 2);
    let f2 = fence_seen(&rig.up).expect("the rerun has a fence");
    assert!(f2 > f1, "the rerun's fence {f2} must exceed {f1}");
}

#[tokio::test]
async fn a_client_cannot_send_a_fence() {
    let rig = rig(|_| {}).await;
    let forged = [("idempotency-fence", "18446744073709551615")];
    // Guarded: the client's value is replaced by the lease's.
    let k = key("forged");
    let got = send(
        &rig.c,
        Method::POST,
        &rig.gw.url("/orders"),
        &[
            ("idempotency-key", &k),
            ("content-type", "application/json"),
            forged[0],
            ("idempotency-fence", "7"),
        ],
        "{}",
    )
    .await;
    assert!(got.status < 300, "{}", got.status);
    let f = fence_seen(&rig.up).expect("a guarded request has a fence");
    assert!(
        f != u64::MAX && f != 7,
        "the client's fence reached the upstream: {f}"
    );
    // Unguarded (a GET; a POST without a key): no fence at all.
    call(&rig.c, Method::GET, &rig.gw.url("/echo"), &forged).await;
    assert_eq!(rig.up.hits(), 2);
    assert_eq!(fence_seen(&rig.up), None);
    send(&rig.c, Method::POST, &rig.gw.url("/echo"), &forged, "{}").await;
    assert_eq!(rig.up.hits(), 3);
    assert_eq!(fence_seen(&rig.up), None);
}
