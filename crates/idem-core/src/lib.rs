//! # idem-core
//!
//! The key protocol of idem: validated [`IdempotencyKey`]s and [`Scope`]s,
//! request [`Fingerprint`]s, the [`Store`] trait with its atomic steps
//! (`begin`, `complete`, `release`, `extend`, `get`, `delete`,
//! `purge_expired`), the [`Engine`] that runs any async operation at most
//! once per key, and the in-process [`MemoryStore`].
//!
//! No HTTP and no database here: `idem-http` adds the tower layer,
//! `idem-sql` the SQL stores.
//!
//! Record states and transitions (see `docs/PROTOCOL.md`):
//!
//! ```text
//!  (absent) --begin--> InProgress{fingerprint, fence, lease_until}
//!  InProgress --complete(fence)--> Completed{fingerprint, response, expires_at}
//!  InProgress --release(fence)---> (absent)
//!  InProgress --lease expired, begin--> InProgress{larger fence}
//!  Completed --expires_at passed--> (absent)
//! ```

mod clock;
mod engine;
mod error;
mod fingerprint;
pub mod instrument;
mod key;
pub mod lock;
mod memory;
mod response;
mod store;
pub mod token;
pub mod url;

pub use admin::{key_hash, KeyAdmin};
pub use clock::{duration_ms, Clock, ManualClock, Millis, SharedClock, SystemClock};
pub use engine::{
    Action, Engine, EngineConfig, EngineConfigError, Once, OnceError, Outcome, Saved,
    DEFAULT_HOLD_FOR, DEFAULT_LEASE, DEFAULT_ON_CANCEL, DEFAULT_SAVE_RETRY, DEFAULT_SAVE_WAIT,
    DEFAULT_SHARE_FAILURE, DEFAULT_TTL, DEFAULT_WAIT, DEFAULT_WATCHDOG, MAX_SHARE_FAILURE,
    MIN_LEASE,
};
pub use error::{BoxError, KeyError, Phase, StoreError};
pub use fingerprint::{Fingerprint, FingerprintBuilder};
pub use instrument::InstrumentedStore;
pub use key::{IdempotencyKey, Scope, MAX_KEY_LEN};
pub use memory::{MemoryLimits, MemoryStore};
pub use response::StoredResponse;
pub use store::admin;
pub use store::{Begin, BeginRequest, DynStore, HoldReason, Lease, Record, RecordState, Store};
pub use url::RedactedUrl;
