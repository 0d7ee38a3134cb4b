//! Small helpers the checks share: fresh keys and scopes, sample responses,
//! and `begin` wrappers that fail the check with a clear message.

use std::time::Duration;

use bytes::Bytes;
use idem_core::{
    Begin, BeginRequest, Fingerprint, IdempotencyKey, Lease, Record, RecordState, Scope, Store,
    StoredResponse,
};
use rand::Rng;

/// A random lowercase hex string of `n` characters.
pub fn random_hex(n: usize) -> String {
    let mut rng = rand::thread_rng();
    (0..n)
        .map(|_| char::from_digit(rng.gen_range(0..16), 16).unwrap_or('0'))
        .collect()
}

/// A scope no other check uses.
pub fn fresh_scope() -> Scope {
    Scope::new(format!("testkit-{}", random_hex(16))).expect("a short scope is valid")
}

/// A key no other check uses, starting with `label`.
pub fn fresh_key(label: &str) -> IdempotencyKey {
    IdempotencyKey::new(format!("{label}-{}", random_hex(16))).expect("a short key is valid")
}

/// A fingerprint named by `label`.
pub fn fp(label: &str) -> Fingerprint {
    Fingerprint::of(label.as_bytes())
}

/// A `begin` request.
pub fn req(
    scope: &Scope,
    key: &IdempotencyKey,
    fingerprint: Fingerprint,
    lease: Duration,
) -> BeginRequest {
    BeginRequest {
        scope: scope.clone(),
        key: key.clone(),
        fingerprint,
        lease,
    }
}

/// Runs `n` futures made by `task` (given their index, `0..n`) at once:
/// each is spawned, and all are released together by a barrier. Returns
/// their outputs in spawn order.
///
/// # Panics
/// When a task panicked.
pub async fn all_at_once<F, Fut>(n: usize, task: F) -> Vec<Fut::Output>
where
    F: Fn(usize) -> Fut,
    Fut: std::future::Future + Send + 'static,
    Fut::Output: Send + 'static,
{
    let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(n));
    let handles: Vec<_> = (0..n)
        .map(|i| {
            let (barrier, fut) = (barrier.clone(), task(i));
            tokio::spawn(async move {
                barrier.wait().await;
                fut.await
            })
        })
        .collect();
    let mut outputs = Vec::with_capacity(n);
    for h in handles {
        outputs.push(h.await.expect("task"));
    }
    outputs
}

/// Splits race answers into the one winner's lease and asserts every other
/// answer is `InFlight` with a retry-after in `(0, lease]`.
pub(crate) fn one_winner(answers: Vec<Begin>, lease: Duration) -> Lease {
    let mut winners = Vec::new();
    for a in answers {
        match a {
            Begin::Acquired(l) => winners.push(l),
            Begin::InFlight { retry_after } => {
                assert!(
                    retry_after > Duration::ZERO && retry_after <= lease,
                    "retry_after {retry_after:?} outside (0, {lease:?}]"
                );
            }
            other => panic!("a concurrent begin answered {other:?}"),
        }
    }
    assert_eq!(
        winners.len(),
        1,
        "exactly one concurrent begin may acquire: {winners:?}"
    );
    winners.pop().expect("one winner")
}

/// A fresh scope and a fresh key starting with `label`, and the `begin`
/// request for them with fingerprint `fp("a")` and `lease`.
pub fn fresh_req(label: &str, lease: Duration) -> (Scope, IdempotencyKey, BeginRequest) {
    let (scope, key) = (fresh_scope(), fresh_key(label));
    let r = req(&scope, &key, fp("a"), lease);
    (scope, key, r)
}

/// A response that exercises the encoding: status 201, repeated and binary
/// header values, a body that is not UTF-8.
pub fn rich_response() -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![
            ("location".into(), b"/orders/42".to_vec()),
            ("set-cookie".into(), b"a=1; Path=/".to_vec()),
            ("etag".into(), b"\"v1\"".to_vec()),
            ("set-cookie".into(), b"b=2".to_vec()),
            ("x-binary".into(), vec![0x00, 0xff, 0x80, b'"', b'\'']),
            ("x-empty".into(), Vec::new()),
        ],
        body: Bytes::from_static(&[0x00, 0x9f, 0x92, 0x96, 0xff, 0xfe, b'{', b'}', 0x00]),
        body_omitted: false,
        released: false,
    }
}

/// A plain response with `body`.
pub fn response(body: &str) -> StoredResponse {
    StoredResponse::new(200, body.as_bytes().to_vec())
}

/// Calls `begin`, failing the check on a store error.
pub async fn begin<S: Store + ?Sized>(store: &S, req: &BeginRequest) -> Begin {
    match store.begin(req).await {
        Ok(b) => b,
        Err(e) => panic!("begin({:?}) failed: {e} ({e:?})", req.key),
    }
}

/// Calls `begin` and expects [`Begin::Acquired`].
pub async fn acquire<S: Store + ?Sized>(store: &S, req: &BeginRequest) -> Lease {
    match begin(store, req).await {
        Begin::Acquired(l) => {
            assert_eq!(&l.scope, &req.scope, "the lease names the scope");
            assert_eq!(&l.key, &req.key, "the lease names the key");
            l
        }
        other => panic!("expected Acquired for {:?}, got {other:?}", req.key),
    }
}

/// Calls `begin` and expects [`Begin::InFlight`] with a retry-after in
/// `(0, max]`; returns it.
pub async fn expect_in_flight<S: Store + ?Sized>(
    store: &S,
    req: &BeginRequest,
    max: Duration,
) -> Duration {
    match begin(store, req).await {
        Begin::InFlight { retry_after } => {
            assert!(
                retry_after > Duration::ZERO,
                "retry_after must be positive, got {retry_after:?}"
            );
            assert!(
                retry_after <= max,
                "retry_after {retry_after:?} exceeds {max:?}"
            );
            retry_after
        }
        other => panic!("expected InFlight for {:?}, got {other:?}", req.key),
    }
}

/// Calls `begin` and expects [`Begin::Replay`] of exactly `want`.
pub async fn expect_replay<S: Store + ?Sized>(
    store: &S,
    req: &BeginRequest,
    want: &StoredResponse,
) {
    match begin(store, req).await {
        Begin::Replay(got) => assert_eq!(&got, want, "the replay must be byte-identical"),
        other => panic!("expected Replay for {:?}, got {other:?}", req.key),
    }
}

/// Calls `begin` and expects [`Begin::Mismatch`].
pub async fn expect_mismatch<S: Store + ?Sized>(store: &S, req: &BeginRequest) {
    match begin(store, req).await {
        Begin::Mismatch => {}
        other => panic!("expected Mismatch for {:?}, got {other:?}", req.key),
    }
}

/// Calls `get`, failing the check on a store error.
pub async fn get<S: Store + ?Sized>(
    store: &S,
    scope: &Scope,
    key: &IdempotencyKey,
) -> Option<Record> {
    match store.get(scope, key).await {
        Ok(r) => r,
        Err(e) => panic!("get({key:?}) failed: {e} ({e:?})"),
    }
}

/// Expects the record to be in progress with `fence`; returns its lease end.
pub async fn expect_in_progress<S: Store + ?Sized>(
    store: &S,
    scope: &Scope,
    key: &IdempotencyKey,
    fingerprint: Fingerprint,
    fence: u64,
) -> idem_core::Millis {
    match get(store, scope, key).await {
        Some(Record {
            fingerprint: f,
            state:
                RecordState::InProgress {
                    fence: got,
                    lease_until,
                    ..
                },
        }) => {
            assert_eq!(f, fingerprint, "the record keeps the claimer's fingerprint");
            assert_eq!(got, fence, "the record's fence");
            lease_until
        }
        other => panic!("expected {key:?} in progress with fence {fence}, got {other:?}"),
    }
}

/// Expects the record to be completed with exactly `response`.
pub async fn expect_completed<S: Store + ?Sized>(
    store: &S,
    scope: &Scope,
    key: &IdempotencyKey,
    fingerprint: Fingerprint,
    response: &StoredResponse,
) {
    match get(store, scope, key).await {
        Some(Record {
            fingerprint: f,
            state: RecordState::Completed { response: got, .. },
        }) => {
            assert_eq!(f, fingerprint, "the record keeps the claimer's fingerprint");
            assert_eq!(&got, response, "the stored response");
        }
        other => panic!("expected {key:?} completed, got {other:?}"),
    }
}

/// Polls `cond` every 10 ms (real time) until it holds or `bound` passes;
/// returns whether it held.
pub async fn eventually<F, Fut>(bound: Duration, mut cond: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + bound;
    loop {
        if cond().await {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
