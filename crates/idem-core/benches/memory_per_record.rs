//! Bytes the [`MemoryStore`] holds per record beyond the stored response.
//!
//! Stores 1,000,000 completed records (anonymous scope, a 36-character key,
//! a 200-byte body, no headers) and prints the heap bytes held per record
//! (counted by a global allocator that tallies every allocation), the same
//! minus the 200 response bytes, and the process RSS growth per record
//! (from `/proc/self/statm`, so it includes the allocator's own overhead).
//!
//! `cargo bench -p idem-core --bench memory_per_record` (`RECORDS=N` to change the count).

use std::alloc::System;
use std::time::{Duration, Instant};

use idem_core::{
    Begin, BeginRequest, Fingerprint, IdempotencyKey, MemoryLimits, MemoryStore, Scope, Store,
    StoredResponse,
};
use stats_alloc::{Region, StatsAlloc, INSTRUMENTED_SYSTEM};

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

const BODY: usize = 200;

fn rss_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = s.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * 4096)
}

fn main() {
    let n: usize = std::env::var("RECORDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1_000_000);
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("runtime");
    let store = MemoryStore::new().with_limits(MemoryLimits {
        max_entries: usize::MAX,
        max_bytes: usize::MAX,
        evict_live_results: false,
    });
    let scope = Scope::anonymous();
    let ttl = Duration::from_secs(3600);
    let lease = Duration::from_secs(30);
    let rss0 = rss_bytes();
    let region = Region::new(GLOBAL);
    let t0 = Instant::now();
    rt.block_on(async {
        for i in 0..n {
            let key = IdempotencyKey::new(format!("{i:08x}-1b2c-4d5e-9f00-123456789abc"))
                .expect("valid key");
            let req = BeginRequest {
                scope: scope.clone(),
                key,
                fingerprint: Fingerprint::of(&i.to_be_bytes()),
                lease,
            };
            let Ok(Begin::Acquired(l)) = store.begin(&req).await else {
                panic!("record {i}: not acquired");
            };
            let mut body = vec![b'x'; BODY];
            body[..8].copy_from_slice(&(i as u64).to_be_bytes());
            store
                .complete(&l, &StoredResponse::new(201, body), ttl)
                .await
                .expect("complete");
        }
    });
    let took = t0.elapsed();
    let stats = region.change();
    let held = stats.bytes_allocated as i64 - stats.bytes_deallocated as i64
        + stats.bytes_reallocated as i64;
    let per = held as f64 / n as f64;
    println!("records: {n}, response body: {BODY} bytes, no headers; stored in {took:.2?}");
    println!("heap held per record: {per:.1} bytes");
    println!(
        "heap per record beyond the response body: {:.1} bytes",
        per - BODY as f64
    );
    if let (Some(a), Some(b)) = (rss0, rss_bytes()) {
        let rss = (b as f64 - a as f64) / n as f64;
        println!(
            "RSS growth per record: {rss:.1} bytes ({:.1} beyond the body)",
            rss - BODY as f64
        );
    }
    assert_eq!(store.len(), n);
}
