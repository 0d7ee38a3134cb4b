#![doc = include_str!("../README.md")]

mod conn;
mod keys;
mod lock;
mod notify;
mod options;
mod persistence;
mod scripts;
mod store;
mod target;
mod tls_files;
mod url;

pub use lock::RedisLockBackend;
#[cfg(feature = "tls")]
pub use options::TlsClientIdentity;
pub use options::{RedisOptions, MAX_PREFIX_LEN};
pub use persistence::{check_persistence, Persistence};
pub use store::RedisStore;
pub use url::RedisUrl;
