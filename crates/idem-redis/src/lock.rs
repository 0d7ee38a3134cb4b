//! [`RedisLockBackend`]: the lock steps of `idem_core::lock` as Lua scripts.

use std::sync::LazyLock;
use std::time::Duration;

use async_trait::async_trait;
use idem_core::lock::{new_owner_token, LockBackend, LockError, LockLease, LockOp, TryAcquire};
use idem_core::{duration_ms, Millis, StoreError};
use redis::Value;
use sha2::{Digest, Sha256};

use crate::conn::{self, Conn, ConnectSettings, NoPush};
use crate::options::RedisOptions;
use crate::scripts::{self, Lua};
use crate::target::Target;

static ACQUIRE: LazyLock<Lua> = LazyLock::new(|| Lua::new(include_str!("../lua/lock_acquire.lua")));
static EXTEND: LazyLock<Lua> = LazyLock::new(|| Lua::new(include_str!("../lua/lock_extend.lua")));
static RELEASE: LazyLock<Lua> = LazyLock::new(|| Lua::new(include_str!("../lua/lock_release.lua")));

/// A lock backend on Redis 7+ (one server or a Cluster): one Lua script per
/// step, atomic on the server, timed by the server's clock.
///
/// Per name, two keys share the hash tag `{<prefix>:lock:<hex sha-256 of
/// the name>}` (one Cluster slot; no user byte reaches a key name):
///
/// * `…:l` — the lock: a string holding the owner token, set with
///   `SET … PX ttl` when granted; gone when released or expired.
/// * `…:f` — the fence counter, `INCR`ed on every grant and never expiring
///   (so fences grow across expiry and release; one small key per name).
///
/// Acquire = `PTTL` the lock (busy with the time left when it exists),
/// else `INCR` the counter and `SET` the lock. Extend = `GET` equals our
/// token → `PEXPIRE`. Release = `GET` equals our token → `DEL`.
///
/// What Redis can lose: with asynchronous replication a failover can drop
/// the latest `SET`, so a second holder may be granted while the first
/// still works (CASES G4) — and a counter that went back would hand out a
/// fence again. Run Redis with AOF `appendfsync always` and no failover if
/// fences must never repeat, and in any case check fences in the database
/// that holds the data (`docs/patterns/lock.md`). Clones share the
/// connection.
#[derive(Debug, Clone)]
pub struct RedisLockBackend {
    conn: Conn,
    prefix: String,
    response_timeout: Duration,
}

fn config(e: StoreError) -> LockError {
    LockError::Config(e.to_string())
}

impl RedisLockBackend {
    /// Connects to `url` (the forms [`crate::RedisStore::connect`] takes)
    /// with [`RedisOptions::default`]: key prefix `idem`, 2 s timeouts.
    ///
    /// # Errors
    /// [`LockError::Config`] for a bad URL; [`LockError::Unavailable`] /
    /// [`LockError::Timeout`] (op `Connect`) when the server cannot be
    /// reached or refuses `SCRIPT LOAD`.
    pub async fn connect(url: &str) -> Result<Self, LockError> {
        Self::connect_with(url, RedisOptions::default()).await
    }

    /// Like [`Self::connect`], with explicit settings: `key_prefix` names
    /// the keys (`{<prefix>:lock:…}`), `response_timeout` bounds each step,
    /// `connection_timeout` the connect.
    ///
    /// # Errors
    /// As [`Self::connect`]; [`LockError::Config`] for invalid options.
    pub async fn connect_with(url: &str, options: RedisOptions) -> Result<Self, LockError> {
        const OP: LockOp = LockOp::Connect;
        options.validate().map_err(config)?;
        let target = Target::parse(url).map_err(config)?;
        let settings = ConnectSettings::new(&options);
        let mut conn = match tokio::time::timeout(
            options.connection_timeout,
            conn::open(&target, &settings, None::<NoPush>),
        )
        .await
        {
            Ok(Ok(c)) => c,
            Ok(Err(e)) => return Err(LockError::unavailable(OP, e)),
            Err(_) => {
                return Err(LockError::Timeout {
                    op: OP,
                    after: options.connection_timeout,
                })
            }
        };
        let loaded = tokio::time::timeout(options.response_timeout, async {
            for lua in [&ACQUIRE, &EXTEND, &RELEASE] {
                lua.script().prepare_invoke().load_async(&mut conn).await?;
            }
            Ok::<_, redis::RedisError>(())
        })
        .await;
        match loaded {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(LockError::unavailable(OP, e)),
            Err(_) => {
                return Err(LockError::Timeout {
                    op: OP,
                    after: options.response_timeout,
                })
            }
        }
        Ok(Self {
            conn,
            prefix: options.key_prefix,
            response_timeout: options.response_timeout,
        })
    }

    /// The Redis keys of `name`: (lock, fence counter).
    pub fn keys(&self, name: &str) -> (String, String) {
        keys_for(&self.prefix, name)
    }

    /// `EVALSHA`, and on `NOSCRIPT` (a restarted or flushed server) `EVAL`
    /// with the source; bounded by the response timeout.
    async fn run(
        &self,
        op: LockOp,
        lua: &Lua,
        keys: &[&str],
        args: &[&[u8]],
    ) -> Result<Value, LockError> {
        let mut conn = self.conn.clone();
        let fut = scripts::eval(&mut conn, lua.hash(), lua.source(), keys, args);
        match tokio::time::timeout(self.response_timeout, fut).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) if e.is_timeout() => Err(LockError::Timeout {
                op,
                after: self.response_timeout,
            }),
            Ok(Err(e)) => Err(LockError::unavailable(op, e)),
            Err(_) => Err(LockError::Timeout {
                op,
                after: self.response_timeout,
            }),
        }
    }
}

fn corrupt(op: LockOp, v: &Value) -> LockError {
    LockError::Corrupt {
        op,
        detail: format!("unexpected script answer {v:?}"),
    }
}

fn int(v: &Value) -> Option<i64> {
    match v {
        Value::Int(i) => Some(*i),
        _ => None,
    }
}

#[async_trait]
impl LockBackend for RedisLockBackend {
    async fn try_acquire(&self, name: &str, ttl: Duration) -> Result<TryAcquire, LockError> {
        const OP: LockOp = LockOp::Acquire;
        let (lock, fence_key) = self.keys(name);
        let owner = new_owner_token();
        let ttl_ms = duration_ms(ttl).to_string();
        let v = self
            .run(
                OP,
                &ACQUIRE,
                &[&lock, &fence_key],
                &[owner.as_bytes(), ttl_ms.as_bytes()],
            )
            .await?;
        let Value::Array(items) = &v else {
            return Err(corrupt(OP, &v));
        };
        match items
            .iter()
            .map(int)
            .collect::<Option<Vec<i64>>>()
            .as_deref()
        {
            Some([1, fence, until]) => Ok(TryAcquire::Acquired(LockLease {
                name: name.to_owned(),
                owner,
                fence: u64::try_from(*fence)
                    .ok()
                    .filter(|f| *f > 0)
                    .ok_or_else(|| corrupt(OP, &v))?,
                until: Millis(u64::try_from(*until).unwrap_or(0)),
            })),
            Some([0, left]) => Ok(TryAcquire::Busy {
                retry_after: Duration::from_millis(u64::try_from(*left).unwrap_or(1).max(1)),
            }),
            _ => Err(corrupt(OP, &v)),
        }
    }

    async fn extend(
        &self,
        lease: &LockLease,
        ttl: Duration,
    ) -> Result<Option<LockLease>, LockError> {
        const OP: LockOp = LockOp::Extend;
        let (lock, _) = self.keys(&lease.name);
        let ttl_ms = duration_ms(ttl).to_string();
        let v = self
            .run(
                OP,
                &EXTEND,
                &[&lock],
                &[lease.owner.as_bytes(), ttl_ms.as_bytes()],
            )
            .await?;
        match int(&v) {
            Some(-1) => Ok(None),
            Some(until) if until > 0 => Ok(Some(LockLease {
                until: Millis(u64::try_from(until).unwrap_or(0)),
                ..lease.clone()
            })),
            _ => Err(corrupt(OP, &v)),
        }
    }

    async fn release(&self, lease: &LockLease) -> Result<bool, LockError> {
        const OP: LockOp = LockOp::Release;
        let (lock, _) = self.keys(&lease.name);
        let v = self
            .run(OP, &RELEASE, &[&lock], &[lease.owner.as_bytes()])
            .await?;
        match int(&v) {
            Some(1) => Ok(true),
            Some(0) => Ok(false),
            _ => Err(corrupt(OP, &v)),
        }
    }
}

/// The keys of `name` under `prefix`: `{<prefix>:lock:<hex sha-256>}:l` and `…:f`.
fn keys_for(prefix: &str, name: &str) -> (String, String) {
    let tag = format!(
        "{{{prefix}:lock:{}}}",
        hex::encode(Sha256::digest(name.as_bytes()))
    );
    (format!("{tag}:l"), format!("{tag}:f"))
}

#[cfg(test)]
mod tests {
    #[test]
    fn keys_share_one_tag_and_hide_the_name() {
        let tag = |k: &str| k[k.find('{').unwrap()..=k.find('}').unwrap()].to_owned();
        let (l, f) = super::keys_for("idem", "order {7}");
        assert_eq!(tag(&l), tag(&f));
        assert!(!l.contains("order"));
        assert!(l.ends_with("}:l") && f.ends_with("}:f"));
    }
}
