//! Submit tokens: one-time tokens for forms and "pay" buttons.
//!
//! A server issues a token for a caller's [`Scope`] with a TTL (when the
//! form is rendered) and the client sends it back as the idempotency key of
//! the submit. The first submit runs the operation; a concurrent second
//! submit gets [`Outcome::InFlight`]; a later one gets the stored result,
//! never a second run; a token that was never issued (for this scope), or
//! whose TTL has passed before its first use, is refused with
//! [`TokenOutcome::TokenRejected`] and nothing runs.
//!
//! Built on the [`Store`] trait alone, so every store supports it with no
//! new atomic step:
//!
//! ```text
//! issue(scope, ttl):   marker = (marker_scope(scope), token)
//!                      begin(marker) → complete(marker, empty response, ttl)
//! execute(scope, token, …):
//!   token not in the issued format            → TokenRejected (store untouched)
//!   begin(scope, token) = Replay / InFlight / Mismatch → that answer (no marker read)
//!   begin(scope, token) = Acquired:
//!       get(marker) is a completed record     → run the operation as Engine::execute does;
//!                                               once its result is stored, delete the marker
//!       get(marker) is absent or in progress  → release the claim → TokenRejected
//! ```
//!
//! `marker_scope(scope)` is [`Scope::hashed`] over `"idem submit token"`
//! (a string with spaces, so never a header name) and the scope's name: a
//! scope no HTTP caller can derive from its headers, so a caller cannot
//! plant a marker by sending a request with a key of its own choosing. The
//! marker's key is the token itself.
//!
//! Consequences:
//! - A token used after its TTL, but while its result is still retained
//!   ([`EngineConfig::ttl`](crate::EngineConfig::ttl)), is replayed: the
//!   marker is only read when the key is free.
//! - Once a result is stored the marker is deleted, so a token never runs
//!   twice even after its result has been forgotten. A run whose key was
//!   released (a retryable failure) keeps the marker: the token may be
//!   retried until its TTL ends.
//! - The token TTL is capped at the result TTL, so a result is never
//!   forgotten while its token would still be accepted.
//! - A concurrent second use of an unknown token may see `InFlight` for
//!   the moment the first use holds the claim before it is released.
//!
//! A token is not authentication: whoever holds a live token can submit
//! once in its scope.

use std::future::Future;
use std::time::Duration;

use rand::RngCore;

use crate::engine::{Action, Engine, Outcome};
use crate::error::StoreError;
use crate::store::{Begin, BeginRequest, Lease, RecordState, Store};
use crate::{Fingerprint, IdempotencyKey, Scope, StoredResponse};

/// The prefix of every issued token.
pub const TOKEN_PREFIX: &str = "tok_";

/// Random bytes per token (128 bits), written as 32 lowercase hex digits.
const TOKEN_BYTES: usize = 16;

/// The length of an issued token in characters (`tok_` + 32 hex digits = 36).
pub const TOKEN_LEN: usize = TOKEN_PREFIX.len() + 2 * TOKEN_BYTES;

/// The fingerprint of every marker record.
const MARKER_FINGERPRINT: &[u8] = b"idem submit token marker";

/// A freshly issued token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IssuedToken {
    /// The token: `tok_` followed by 32 lowercase hex digits (128 random
    /// bits from the thread-local CSPRNG), 36 characters, URL-safe and a
    /// valid [`IdempotencyKey`].
    pub token: String,
    /// How long the token may be used for a first submit, from the moment
    /// the marker was stored (the TTL asked for, capped at the engine's
    /// result TTL; millisecond precision).
    pub expires_in: Duration,
}

impl IssuedToken {
    /// `expires_in` in whole seconds, rounded down (what the gateway reports).
    pub fn expires_in_secs(&self) -> u64 {
        self.expires_in.as_secs()
    }
}

/// Why [`SubmitTokens::issue`] failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum IssueError {
    /// A TTL of 0 was asked for.
    #[error("a submit token's TTL must be longer than 0")]
    ZeroTtl,
    /// The store failed while the marker was written; the token was not issued.
    #[error("the store failed while issuing a submit token")]
    Store(#[source] StoreError),
    /// Three freshly drawn tokens in a row were already taken (with 128
    /// random bits this means the random source is broken).
    #[error("three random tokens in a row were already issued; the random source looks broken")]
    Collision,
}

/// The result of [`SubmitTokens::execute`].
#[derive(Debug)]
pub enum TokenOutcome<T> {
    /// The key protocol's answer for a token that was live at its first
    /// use: [`Outcome::Executed`] (this call ran the operation),
    /// [`Outcome::Replayed`] (a stored result, even after the token's TTL),
    /// [`Outcome::InFlight`] (another use is running) or
    /// [`Outcome::Mismatch`] (the token was used for a different request).
    Keyed(Outcome<T>),
    /// The token was never issued for this scope, its TTL passed before its
    /// first use, or it is not in the issued format. Nothing ran and the
    /// store holds no record for it.
    TokenRejected,
}

/// Issues submit tokens and runs operations with them, over an [`Engine`].
///
/// ```
/// # tokio::runtime::Runtime::new().unwrap().block_on(async {
/// use std::time::Duration;
/// use idem_core::token::{SubmitTokens, TokenOutcome};
/// use idem_core::{Action, Fingerprint, MemoryStore, Outcome, Scope, StoredResponse};
///
/// let tokens = SubmitTokens::new(MemoryStore::new());
/// let scope = Scope::new("user-7").unwrap();
/// let issued = tokens.issue(&scope, Duration::from_secs(3600)).await.unwrap();
/// assert_eq!(issued.token.len(), 36);
///
/// let pay = |_lease| async { ("paid", Action::Store(StoredResponse::new(200, "paid"))) };
/// let first = tokens.execute(&scope, &issued.token, Fingerprint::of(b"pay 10"), pay).await.unwrap();
/// assert!(matches!(first, TokenOutcome::Keyed(Outcome::Executed { value: "paid", .. })));
/// let again = tokens.execute(&scope, &issued.token, Fingerprint::of(b"pay 10"), pay).await.unwrap();
/// assert!(matches!(again, TokenOutcome::Keyed(Outcome::Replayed(_))));
/// let forged = tokens.execute(&scope, "tok_00000000000000000000000000000000", Fingerprint::of(b"pay 10"), pay).await.unwrap();
/// assert!(matches!(forged, TokenOutcome::TokenRejected));
/// # });
/// ```
#[derive(Debug, Clone)]
pub struct SubmitTokens<S> {
    engine: Engine<S>,
}

impl<S: Store + Clone> SubmitTokens<S> {
    /// Tokens over `store` with the default [`EngineConfig`](crate::EngineConfig)
    /// (30 s lease, results retained 24 h).
    pub fn new(store: S) -> Self {
        Self::from_engine(Engine::new(store))
    }

    /// Tokens that run operations through `engine` (its lease, result TTL,
    /// wait, watchdog and cancellation settings apply).
    pub fn from_engine(engine: Engine<S>) -> Self {
        Self { engine }
    }

    /// The engine.
    pub fn engine(&self) -> &Engine<S> {
        &self.engine
    }

    /// Issues a token for `scope`, usable for a first submit during `ttl`
    /// (millisecond precision), capped at the engine's result TTL. Two
    /// store calls (`begin` and `complete` on the marker).
    ///
    /// # Errors
    /// [`IssueError::ZeroTtl`] for a zero `ttl`; [`IssueError::Store`] when
    /// the store fails (no token is handed out; a half-written marker is an
    /// in-progress record, which never makes a token valid);
    /// [`IssueError::Collision`] when the random source repeats itself.
    pub async fn issue(&self, scope: &Scope, ttl: Duration) -> Result<IssuedToken, IssueError> {
        if ttl.is_zero() {
            return Err(IssueError::ZeroTtl);
        }
        let ttl = ttl.min(self.engine.config().ttl);
        let store = self.engine.store();
        let marker_scope = marker_scope(scope);
        for _ in 0..3 {
            let token = new_token();
            let Ok(key) = IdempotencyKey::new(token.clone()) else {
                // `tok_` and hex digits are always a valid key.
                return Err(IssueError::Collision);
            };
            let req = BeginRequest {
                scope: marker_scope.clone(),
                key,
                fingerprint: Fingerprint::of(MARKER_FINGERPRINT),
                lease: ttl,
            };
            match store.begin(&req).await.map_err(IssueError::Store)? {
                Begin::Acquired(lease) => {
                    store
                        .complete(&lease, &StoredResponse::new(204, Vec::new()), ttl)
                        .await
                        .map_err(IssueError::Store)?;
                    return Ok(IssuedToken {
                        token,
                        expires_in: ttl,
                    });
                }
                Begin::InFlight { .. } | Begin::Replay(_) | Begin::Mismatch => continue,
            }
        }
        Err(IssueError::Collision)
    }

    /// Whether a token for `scope` is live right now (issued, TTL not
    /// passed, result not yet stored). One `get`. Informational only:
    /// [`SubmitTokens::execute`] decides atomically with its claim.
    ///
    /// # Errors
    /// The store's errors.
    pub async fn is_live(&self, scope: &Scope, token: &str) -> Result<bool, StoreError> {
        match parse_token(token) {
            Some(key) => marker_live(self.engine.store(), scope, &key).await,
            None => Ok(false),
        }
    }

    /// Runs `op` with `token` as the idempotency key of `scope`, as
    /// [`Engine::execute`] does, but only if the token is live at its first
    /// use (see the [module docs](self) for the exact steps). `op` gets the
    /// lease and returns its output and the [`Action`] to take.
    ///
    /// A token in another format than [`SubmitTokens::issue`] produces
    /// (`tok_` + 32 lowercase hex digits) is rejected without a store call.
    ///
    /// # Errors
    /// A store error from `begin`, or from the marker `get` (the claim is
    /// then released and the operation did not run). Errors while saving
    /// are reported in [`Outcome::Executed`]'s `saved`, as for the engine.
    pub async fn execute<T, F, Fut>(
        &self,
        scope: &Scope,
        token: &str,
        fingerprint: Fingerprint,
        op: F,
    ) -> Result<TokenOutcome<T>, StoreError>
    where
        F: FnOnce(Lease) -> Fut,
        Fut: Future<Output = (T, Action)>,
    {
        let Some(key) = parse_token(token) else {
            return Ok(TokenOutcome::TokenRejected);
        };
        let store = self.engine.store().clone();
        let gate_key = key.clone();
        let out = self
            .engine
            .execute(scope, &key, fingerprint, |lease| async move {
                match marker_live(&store, scope, &gate_key).await {
                    Ok(true) => {
                        let (value, action) = op(lease).await;
                        (Ok(value), action)
                    }
                    Ok(false) => (Err(None), Action::Release),
                    Err(e) => (Err(Some(e)), Action::Release),
                }
            })
            .await?;
        Ok(match out {
            Outcome::Executed {
                value: Ok(value),
                fence,
                saved,
            } => {
                if matches!(saved, crate::Saved::Stored) {
                    // The result now answers every reuse; the marker has no
                    // more use, and without it the token can never run
                    // again, even after its result is forgotten.
                    let store = self.engine.store();
                    if let Err(e) = store.delete(&marker_scope(scope), &key).await {
                        tracing::warn!(key = %key, error = %e, "could not delete a used submit token's marker; it expires with its TTL");
                    }
                }
                TokenOutcome::Keyed(Outcome::Executed {
                    value,
                    fence,
                    saved,
                })
            }
            Outcome::Executed {
                value: Err(None), ..
            } => TokenOutcome::TokenRejected,
            Outcome::Executed {
                value: Err(Some(e)),
                ..
            } => return Err(e),
            Outcome::Replayed(r) => TokenOutcome::Keyed(Outcome::Replayed(r)),
            Outcome::InFlight { retry_after } => {
                TokenOutcome::Keyed(Outcome::InFlight { retry_after })
            }
            Outcome::Mismatch => TokenOutcome::Keyed(Outcome::Mismatch),
        })
    }
}

/// The scope that holds the markers of tokens issued for `scope`: the hex
/// SHA-256 ([`Scope::hashed`]) of `["idem submit token", scope]`, 64
/// characters.
pub fn marker_scope(scope: &Scope) -> Scope {
    Scope::hashed([b"idem submit token".as_slice(), scope.as_str().as_bytes()])
}

/// Whether `token` has the issued format (`tok_` + 32 lowercase hex digits).
///
/// ```
/// use idem_core::token::is_token_format;
/// assert!(is_token_format("tok_0123456789abcdef0123456789abcdef"));
/// assert!(!is_token_format("tok_0123456789ABCDEF0123456789ABCDEF"));
/// assert!(!is_token_format("order-42"));
/// ```
pub fn is_token_format(token: &str) -> bool {
    token.len() == TOKEN_LEN
        && token.starts_with(TOKEN_PREFIX)
        && token[TOKEN_PREFIX.len()..]
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

fn parse_token(token: &str) -> Option<IdempotencyKey> {
    if !is_token_format(token) {
        return None;
    }
    IdempotencyKey::new(token).ok()
}

fn new_token() -> String {
    let mut bytes = [0u8; TOKEN_BYTES];
    rand::thread_rng().fill_bytes(&mut bytes);
    format!("{TOKEN_PREFIX}{}", hex::encode(bytes))
}

/// A completed marker record for `key` in `scope`'s marker scope.
async fn marker_live<S: Store>(
    store: &S,
    scope: &Scope,
    key: &IdempotencyKey,
) -> Result<bool, StoreError> {
    Ok(matches!(
        store.get(&marker_scope(scope), key).await?,
        Some(rec) if matches!(rec.state, RecordState::Completed { .. })
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_random_and_well_formed() {
        let a = new_token();
        let b = new_token();
        assert_ne!(a, b);
        assert!(is_token_format(&a), "{a}");
        assert_eq!(a.len(), TOKEN_LEN);
        assert!(IdempotencyKey::new(a).is_ok());
    }

    #[test]
    fn format_check() {
        assert!(!is_token_format(""));
        assert!(!is_token_format("tok_"));
        assert!(!is_token_format("tok_0123456789abcdef0123456789abcde"));
        assert!(!is_token_format("tok_0123456789abcdef0123456789abcdeg"));
        assert!(!is_token_format("xok_0123456789abcdef0123456789abcdef"));
        assert!(!is_token_format("tok_0123456789abcdef0123456789abcdef0"));
        assert!(!is_token_format("tok_0123456789abcdef0123456789abcd\u{e9}"));
    }

    #[test]
    fn marker_scopes_differ_per_scope() {
        let a = marker_scope(&Scope::new("a").unwrap());
        let b = marker_scope(&Scope::new("b").unwrap());
        assert_ne!(a, b);
        assert_ne!(a, Scope::new("a").unwrap());
        assert_eq!(a.as_str().len(), 64);
    }
}
