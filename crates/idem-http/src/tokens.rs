//! The budget of live submit tokens: a cap per scope and a cap in all, so
//! that issuing tokens cannot fill the store that holds the results.
//!
//! Every token issued by [`crate::IdempotencyLayer::issue_token`] is a
//! record in the store (its marker) until it is used or its TTL ends. The
//! budget counts, per layer (shared by its clones and the services it
//! makes), the tokens it issued that are still *live*: not expired, and not
//! consumed — a submit with the token stored its result (the marker is
//! then deleted), or found the token already used or not live any more.
//! Counts are kept in this process only: with several gateway instances
//! each has its own budget, so the store holds at most
//! `instances × max_live_tokens` markers.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use idem_core::token::IssueError;
use idem_core::Scope;

/// Most live submit tokens per scope by default: 100.
pub const DEFAULT_TOKENS_PER_SCOPE: usize = 100;
/// Most live submit tokens per layer (per gateway instance) by default: 100,000.
pub const DEFAULT_MAX_LIVE_TOKENS: usize = 100_000;

/// Which cap refused a token ([`TokenIssueError::TooMany`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum TokenCap {
    /// [`crate::Options::tokens_per_scope`]: this caller holds that many live tokens.
    PerScope(usize),
    /// [`crate::Options::max_live_tokens`]: the layer holds that many live tokens.
    Total(usize),
}

/// Why [`crate::IdempotencyLayer::issue_token`] issued no token.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TokenIssueError {
    /// The request carries none of the scope headers
    /// ([`crate::Options::scope`]) and anonymous tokens are off
    /// ([`crate::Options::anonymous_tokens`]).
    #[error("a submit token needs a caller: the request carries none of the scope headers")]
    ScopeRequired,
    /// A cap on live tokens is reached; one is free again after `retry_after`
    /// at the latest (the oldest counted token expires), or sooner when a
    /// token is used.
    #[error("too many live submit tokens ({cap:?}); retry after {retry_after:?}")]
    TooMany {
        /// The cap that was reached.
        cap: TokenCap,
        /// When the oldest counted token expires (at least 1 s).
        retry_after: Duration,
    },
    /// Issuing failed in the store (or the TTL is 0).
    #[error(transparent)]
    Issue(#[from] IssueError),
}

/// One counted token: its expiry and a sequence number (unique).
type Slot = (Instant, u64);

#[derive(Debug, Default)]
struct PerScope {
    live: BTreeSet<Slot>,
    pending: usize,
}

#[derive(Debug, Default)]
struct State {
    /// Live tokens by (scope, token).
    tokens: HashMap<(Scope, Box<str>), Slot>,
    /// The same tokens by expiry.
    expiry: BTreeMap<Slot, (Scope, Box<str>)>,
    scopes: HashMap<Scope, PerScope>,
    /// Tokens being issued (counted, not yet known).
    pending: usize,
    seq: u64,
}

impl State {
    fn prune(&mut self, now: Instant) {
        while let Some(entry) = self.expiry.first_entry() {
            if entry.key().0 > now {
                break;
            }
            let (slot, id) = entry.remove_entry();
            self.tokens.remove(&id);
            self.forget(&id.0, slot);
        }
    }

    fn forget(&mut self, scope: &Scope, slot: Slot) {
        if let Some(s) = self.scopes.get_mut(scope) {
            s.live.remove(&slot);
            if s.live.is_empty() && s.pending == 0 {
                self.scopes.remove(scope);
            }
        }
    }
}

/// The live tokens a layer issued (see the [module docs](self)).
#[derive(Debug, Default)]
pub(crate) struct TokenBudget {
    state: Mutex<State>,
}

/// `d` rounded up to whole seconds, at least 1 s.
fn whole_secs(d: Duration) -> Duration {
    let s = d.as_secs() + u64::from(d.subsec_nanos() > 0);
    Duration::from_secs(s.max(1))
}

impl TokenBudget {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // A panic while the lock is held leaves counts that are still
        // consistent enough to go on with.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Counts one token for `scope` about to be issued, or refuses it when
    /// `per_scope` or `total` would be exceeded. Dropping the reservation
    /// without [`Reservation::commit`] gives the room back.
    pub(crate) fn reserve(
        &self,
        scope: &Scope,
        now: Instant,
        per_scope: usize,
        total: usize,
    ) -> Result<Reservation<'_>, TokenIssueError> {
        let mut st = self.lock();
        st.prune(now);
        let soonest = |slots: Option<&Slot>| {
            whole_secs(slots.map_or(Duration::ZERO, |s| s.0.saturating_duration_since(now)))
        };
        let (held, oldest) = st.scopes.get(scope).map_or((0, None), |s| {
            (s.live.len() + s.pending, s.live.first().copied())
        });
        if held >= per_scope {
            return Err(TokenIssueError::TooMany {
                cap: TokenCap::PerScope(per_scope),
                retry_after: soonest(oldest.as_ref()),
            });
        }
        if st.tokens.len() + st.pending >= total {
            return Err(TokenIssueError::TooMany {
                cap: TokenCap::Total(total),
                retry_after: soonest(st.expiry.keys().next()),
            });
        }
        st.pending += 1;
        st.scopes.entry(scope.clone()).or_default().pending += 1;
        Ok(Reservation {
            budget: self,
            scope: scope.clone(),
            done: false,
        })
    }

    /// The token `token` of `scope` is no longer live (its result is
    /// stored, it was found used, or the store no longer knows it). A token
    /// this budget does not count is ignored.
    pub(crate) fn consume(&self, scope: &Scope, token: &str) {
        let mut st = self.lock();
        let id = (scope.clone(), Box::<str>::from(token));
        if let Some(slot) = st.tokens.remove(&id) {
            st.expiry.remove(&slot);
            st.forget(scope, slot);
        }
    }

    /// Live tokens counted now (pending ones included), in all and for `scope`.
    #[cfg(test)]
    fn counts(&self, scope: &Scope, now: Instant) -> (usize, usize) {
        let mut st = self.lock();
        st.prune(now);
        let per = st.scopes.get(scope).map_or(0, |s| s.live.len() + s.pending);
        (st.tokens.len() + st.pending, per)
    }
}

/// Room for one token, counted until it is committed or dropped.
#[derive(Debug)]
pub(crate) struct Reservation<'a> {
    budget: &'a TokenBudget,
    scope: Scope,
    done: bool,
}

impl Reservation<'_> {
    /// The token was issued: count it as live until `expires`.
    pub(crate) fn commit(mut self, token: &str, expires: Instant) {
        self.done = true;
        let mut st = self.budget.lock();
        st.pending = st.pending.saturating_sub(1);
        st.seq += 1;
        let slot = (expires, st.seq);
        let id = (self.scope.clone(), Box::<str>::from(token));
        st.tokens.insert(id.clone(), slot);
        st.expiry.insert(slot, id);
        let s = st.scopes.entry(self.scope.clone()).or_default();
        s.pending = s.pending.saturating_sub(1);
        s.live.insert(slot);
    }
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let mut st = self.budget.lock();
        st.pending = st.pending.saturating_sub(1);
        if let Some(s) = st.scopes.get_mut(&self.scope) {
            s.pending = s.pending.saturating_sub(1);
            if s.live.is_empty() && s.pending == 0 {
                st.scopes.remove(&self.scope);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scope(s: &str) -> Scope {
        Scope::new(s).unwrap()
    }

    #[test]
    fn caps_per_scope_and_in_all() {
        let b = TokenBudget::default();
        let t0 = Instant::now();
        let ttl = Duration::from_secs(10);
        for i in 0..3 {
            b.reserve(&scope("a"), t0, 3, 5)
                .unwrap()
                .commit(&format!("a{i}"), t0 + ttl);
        }
        match b.reserve(&scope("a"), t0, 3, 5) {
            Err(TokenIssueError::TooMany {
                cap: TokenCap::PerScope(3),
                retry_after,
            }) => assert_eq!(retry_after, ttl),
            other => panic!("{other:?}"),
        }
        for i in 0..2 {
            b.reserve(&scope("b"), t0, 3, 5)
                .unwrap()
                .commit(&format!("b{i}"), t0 + ttl);
        }
        assert!(matches!(
            b.reserve(&scope("c"), t0, 3, 5),
            Err(TokenIssueError::TooMany {
                cap: TokenCap::Total(5),
                ..
            })
        ));
        // A used token frees its room; a foreign scope cannot consume it.
        b.consume(&scope("c"), "a0");
        assert_eq!(b.counts(&scope("a"), t0), (5, 3));
        b.consume(&scope("a"), "a0");
        assert_eq!(b.counts(&scope("a"), t0), (4, 2));
        b.reserve(&scope("c"), t0, 3, 5)
            .unwrap()
            .commit("c0", t0 + ttl);
        // Expired tokens stop counting.
        assert_eq!(b.counts(&scope("a"), t0 + ttl), (0, 0));
        assert!(b.lock().scopes.is_empty() && b.lock().expiry.is_empty());
    }

    #[test]
    fn a_dropped_reservation_gives_its_room_back() {
        let b = TokenBudget::default();
        let t0 = Instant::now();
        let r = b.reserve(&scope("a"), t0, 1, 10).unwrap();
        assert!(b.reserve(&scope("a"), t0, 1, 10).is_err(), "pending counts");
        drop(r);
        assert_eq!(b.counts(&scope("a"), t0), (0, 0));
        assert!(b.reserve(&scope("a"), t0, 1, 10).is_ok());
    }

    #[test]
    fn retry_after_is_whole_seconds_and_at_least_one() {
        assert_eq!(whole_secs(Duration::ZERO), Duration::from_secs(1));
        assert_eq!(
            whole_secs(Duration::from_millis(1500)),
            Duration::from_secs(2)
        );
        assert_eq!(whole_secs(Duration::from_secs(3)), Duration::from_secs(3));
    }
}
