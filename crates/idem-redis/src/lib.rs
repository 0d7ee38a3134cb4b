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
mod url;

pub use lock::RedisLockBackend;
pub use options::{RedisOptions, MAX_PREFIX_LEN};
pub use persistence::{check_persistence, Persistence};
pub use store::RedisStore;
pub use url::RedisUrl;
