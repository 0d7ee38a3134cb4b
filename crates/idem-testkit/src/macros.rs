//! The `conformance_tests!` macro.

/// Writes a module `$module` (e.g. `conformance`, inside a module named
/// `<store>_tests`) with one `#[tokio::test]` per check of
/// [`store_checks`](crate::store_checks),
/// [`admin_checks`](crate::admin_checks) (the store must offer listing:
/// [`Store::admin`](idem_core::Store::admin) is `Some`),
/// [`engine_checks`](crate::engine_checks) and
/// [`token_checks`](crate::token_checks).
///
/// `$make` is called once per test and returns a future of a
/// [`Harness`](crate::Harness): a path to an `async fn` or a closure
/// returning an `async` block. The calling crate needs `tokio` (with the
/// `macros` and `rt-multi-thread` features) among its dev-dependencies.
///
/// ```no_run
/// mod memory_tests {
///     idem_testkit::conformance_tests!(conformance, || async { idem_testkit::MemoryHarness::new() });
/// }
/// ```
///
/// `conformance_tests!(@core module, make)` writes only the core subset (one
/// check of each kind of step), for a store reached a second way (over
/// TLS, say) whose full suite runs elsewhere; `@module module, make;
/// store_checks: [..] admin_checks: [..] engine_checks: [..]
/// token_checks: [..]` names the checks one by one.
///
/// The tests run on a multi-threaded runtime (4 workers), so concurrency
/// checks race for real.
#[macro_export]
macro_rules! conformance_tests {
    ($module:ident, $make:expr) => {
        $crate::conformance_tests!(@module $module, $make;
            store_checks: [
                claim_once,
                concurrent_begins_one_winner,
                complete_then_replay,
                mismatch_in_flight_and_after_completion,
                release_then_reclaim,
                lease_expiry_takeover_by_one,
                took_over_only_after_an_ended_claim,
                ended_claim_refuses_another_request,
                sub_second_lease,
                stale_fence_rejected,
                late_complete_without_takeover_is_kept,
                extend_moves_lease_end,
                hold_marks_and_keeps_the_key,
                completed_record_expires_after_ttl,
                get_and_delete,
                purge_expired_removes_only_expired,
                fence_grows_across_release_expiry_purge,
                wait_for_change_returns_early_on_complete,
                wait_for_change_returns_by_max,
                wait_for_change_saturates_max,
                odd_keys_and_scopes_round_trip,
                same_key_in_two_scopes_independent,
            ]
            admin_checks: [
                list_filters_by_state_and_scope,
                list_pages_visit_every_record_once,
                list_hides_expired_results_shows_ended_claims,
                list_after_delete,
                list_refuses_bad_limits_and_cursors,
            ]
            engine_checks: [
                engine_runs_once_under_concurrency,
                engine_release_lets_retry_run,
                engine_cancel_hold_keeps_key_until_lease_end,
                engine_cancel_release_frees_key,
                engine_failed_save_holds_key,
                engine_hold_marks_the_key_with_its_reason,
                engine_failed_save_is_retried_until_it_lands,
                engine_save_whose_answer_was_lost_is_stored,
                engine_watchdog_keeps_lease_alive,
                engine_wait_mode_replays,
                engine_waiters_share_a_released_failure,
                engine_share_failure_zero_releases_at_once,
            ]
            token_checks: [
                token_issue_use_replay,
                token_concurrent_use_runs_once,
                token_unknown_rejected_store_clean,
                token_expired_rejected,
                token_bound_to_its_scope,
                token_reuse_after_ttl_replays,
                token_retry_after_release_runs,
                token_never_runs_twice_after_result_expiry,
            ]
        );
    };
    // The core subset: one check of each kind of step (claim, race,
    // complete and replay, mismatch, release, fence, get/delete, wait,
    // odd bytes, listing, the engine, a token), for a store reached a
    // second way (e.g. over TLS) whose steps the full suite already covers.
    (@core $module:ident, $make:expr) => {
        $crate::conformance_tests!(@module $module, $make;
            store_checks: [
                claim_once,
                concurrent_begins_one_winner,
                complete_then_replay,
                mismatch_in_flight_and_after_completion,
                release_then_reclaim,
                stale_fence_rejected,
                get_and_delete,
                wait_for_change_returns_early_on_complete,
                odd_keys_and_scopes_round_trip,
            ]
            admin_checks: [list_filters_by_state_and_scope]
            engine_checks: [engine_runs_once_under_concurrency]
            token_checks: [token_issue_use_replay]
        );
    };
    (@module $module:ident, $make:expr;
        store_checks: [$($store_check:ident),* $(,)?]
        admin_checks: [$($admin_check:ident),* $(,)?]
        engine_checks: [$($engine_check:ident),* $(,)?]
        token_checks: [$($token_check:ident),* $(,)?]
    ) => {
        mod $module {
            #[allow(unused_imports)]
            use super::*;
            $(
                #[::tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $store_check() {
                    let harness = ($make)().await;
                    $crate::store_checks::$store_check(&harness).await;
                }
            )*
            $(
                #[::tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $admin_check() {
                    let harness = ($make)().await;
                    $crate::admin_checks::$admin_check(&harness).await;
                }
            )*
            $(
                #[::tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $engine_check() {
                    let harness = ($make)().await;
                    $crate::engine_checks::$engine_check(&harness).await;
                }
            )*
            $(
                #[::tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $token_check() {
                    let harness = ($make)().await;
                    $crate::token_checks::$token_check(&harness).await;
                }
            )*
        }
    };
}
