//! [`RedisStore`]: the key protocol as one Lua script per step.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use idem_core::{
    duration_ms, Begin, BeginRequest, Fingerprint, IdempotencyKey, Lease, Millis, Phase, Record,
    RecordState, Scope, Store, StoreError, StoredResponse,
};
use redis::cluster_routing::{MultipleNodeRoutingInfo, RoutingInfo, SingleNodeRoutingInfo};
use redis::Value;

use crate::conn::{self, bounded, Conn, ConnectSettings, NoPush};
use crate::keys::{record_pattern, RecordKeys};
use crate::notify::Notifier;
use crate::options::RedisOptions;
use crate::scripts::{self, Lua};
use crate::target::Target;

/// Leases, TTLs and `keep_expired` are clamped to this many milliseconds
/// (100 years), so deadlines stay exact in Lua's doubles and valid for
/// `PEXPIREAT`.
const MAX_MS: u64 = 100 * 365 * 24 * 3600 * 1000;

/// With pub/sub working, a waiter still re-reads the record this often.
const SAFETY_POLL: Duration = Duration::from_secs(1);

/// A [`Store`] on Redis 7 or later — one server or a Redis Cluster — where
/// every step is one Lua script: one round trip, atomic on the server.
///
/// See the [crate documentation](crate) for the record layout, how fences
/// grow, time, expiry, and what Redis can lose.
///
/// Clones share the connections.
///
/// ```no_run
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), idem_core::StoreError> {
/// use idem_redis::{RedisOptions, RedisStore};
/// let store = RedisStore::connect("redis://127.0.0.1:6379/").await?;
/// let cluster = RedisStore::connect_with(
///     "redis+cluster://10.0.0.1:7000,10.0.0.2:7000,10.0.0.3:7000",
///     RedisOptions::default().with_key_prefix("payments"),
/// )
/// .await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct RedisStore {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    conn: Conn,
    options: RedisOptions,
    notifier: Arc<Notifier>,
}

impl RedisStore {
    /// Connects to the Redis named by `url`, with [`RedisOptions::default`].
    ///
    /// | URL | what |
    /// |---|---|
    /// | `redis://[user:password@]host[:port][/db]` | one server (default port 6379, database 0) |
    /// | `rediss://…` | the same over TLS (needs the `tls` feature) |
    /// | `redis+unix:///path/redis.sock[?db=N]` | one server on a Unix socket |
    /// | `redis+cluster://[user:password@]host:port,host:port[,…]` | a Redis Cluster by any of its nodes (`rediss+cluster://` for TLS) |
    ///
    /// The connection is opened, the scripts are loaded (on every primary
    /// of a Cluster) and the server's `maxmemory-policy` is checked (a
    /// warning is logged unless it is `noeviction`), all before this
    /// returns. Afterwards the connection reconnects by itself.
    ///
    /// # Errors
    /// [`StoreError::Config`] for a malformed URL or unknown scheme;
    /// [`StoreError::Unavailable`] (phase `Connect`) when the server refuses
    /// the connection, authentication or `SCRIPT LOAD`;
    /// [`StoreError::Timeout`] (phase `Connect`) when that takes longer than
    /// the connection timeout plus the response timeout (2 s + 2 s by default).
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        Self::connect_with(url, RedisOptions::default()).await
    }

    /// Like [`Self::connect`], with explicit settings.
    ///
    /// # Errors
    /// As for [`Self::connect`]; [`StoreError::Config`] for invalid
    /// options ([`RedisOptions::validate`]).
    pub async fn connect_with(url: &str, options: RedisOptions) -> Result<Self, StoreError> {
        const P: Phase = Phase::Connect;
        options.validate()?;
        let target = Target::parse(url)?;
        let settings = ConnectSettings::new(&options);
        let mut conn = bounded(
            P,
            options.connection_timeout,
            conn::open(&target, &settings, None::<NoPush>),
        )
        .await?;
        bounded(P, options.response_timeout, async {
            for lua in scripts::all() {
                lua.script().prepare_invoke().load_async(&mut conn).await?;
            }
            Ok(())
        })
        .await?;
        check_eviction_policy(&mut conn, options.response_timeout).await;
        let notifier = Arc::new(Notifier::new(target, settings));
        Ok(Self {
            inner: Arc::new(Inner {
                conn,
                options,
                notifier,
            }),
        })
    }

    /// The settings in use.
    pub fn options(&self) -> &RedisOptions {
        &self.inner.options
    }

    /// Whether this store talks to a Redis Cluster.
    pub fn is_cluster(&self) -> bool {
        matches!(self.inner.conn, Conn::Cluster(_))
    }

    /// The Redis key of the record of (`scope`, `key`): a hash named
    /// `{<prefix>:<hex sha-256>}:r` (for operators and tests; see the
    /// [crate documentation](crate) for its fields).
    pub fn record_key(&self, scope: &Scope, key: &IdempotencyKey) -> String {
        self.keys(scope, key).record
    }

    fn keys(&self, scope: &Scope, key: &IdempotencyKey) -> RecordKeys {
        RecordKeys::new(&self.inner.options.key_prefix, scope, key)
    }

    fn keep_ms(&self) -> u64 {
        ms(self.inner.options.keep_expired)
    }

    /// Runs one script within the response timeout: `EVALSHA`, and on
    /// `NOSCRIPT` the same call as `EVAL` with the full source.
    async fn run(
        &self,
        phase: Phase,
        lua: &Lua,
        keys: &[&str],
        args: &[&[u8]],
    ) -> Result<Value, StoreError> {
        let mut conn = self.inner.conn.clone();
        bounded(
            phase,
            self.inner.options.response_timeout,
            scripts::eval(&mut conn, lua.hash(), lua.source(), keys, args),
        )
        .await
    }

    /// Reads a record and the server's time.
    async fn read(&self, keys: &RecordKeys, phase: Phase) -> Result<Read, StoreError> {
        let v = self.run(phase, &scripts::GET, &[&keys.record], &[]).await?;
        Read::decode(v, phase)
    }

    /// The live claim on a record: `(fence, time left on its lease)`.
    async fn live_claim(
        &self,
        keys: &RecordKeys,
        phase: Phase,
    ) -> Result<Option<(u64, Duration)>, StoreError> {
        let read = self.read(keys, phase).await?;
        Ok(match read.record(phase)? {
            Some(Record {
                state: RecordState::InProgress { fence, lease_until },
                ..
            }) => Some((fence, read.now.until(lease_until))),
            _ => None,
        })
    }

    /// Scans one node (`None`: the single server) for records and purges
    /// the ended ones.
    async fn purge_node(&self, node: Option<(String, u16)>) -> Result<u64, StoreError> {
        const P: Phase = Phase::Purge;
        let pattern = record_pattern(&self.inner.options.key_prefix);
        let mut cursor: u64 = 0;
        let mut purged = 0;
        loop {
            let mut scan = redis::cmd("SCAN");
            scan.arg(cursor)
                .arg("MATCH")
                .arg(&pattern)
                .arg("COUNT")
                .arg(self.inner.options.scan_count)
                .arg("TYPE")
                .arg("hash");
            let mut conn = self.inner.conn.clone();
            let reply = bounded(P, self.inner.options.response_timeout, async {
                match (&mut conn, &node) {
                    (Conn::Cluster(c), Some((host, port))) => {
                        c.route_command(
                            scan,
                            RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress {
                                host: host.clone(),
                                port: *port,
                            }),
                        )
                        .await
                    }
                    _ => scan.query_async::<Value>(&mut conn).await,
                }
            })
            .await?;
            let (next, found) = decode_scan(reply).map_err(|d| StoreError::corrupt(P, d))?;
            let results = futures::future::join_all(found.iter().map(|record| {
                let channel = RecordKeys::channel_of(record);
                async move {
                    self.run(P, &scripts::PURGE, &[record], &[channel.as_bytes()])
                        .await
                }
            }))
            .await;
            for r in results {
                if int(&r?) == Some(1) {
                    purged += 1;
                }
            }
            cursor = next;
            if cursor == 0 {
                return Ok(purged);
            }
        }
    }

    /// The primaries of the Cluster, as (host, port).
    async fn primaries(&self) -> Result<Vec<(String, u16)>, StoreError> {
        const P: Phase = Phase::Purge;
        let Conn::Cluster(c) = &self.inner.conn else {
            return Ok(Vec::new());
        };
        let mut c = c.clone();
        let reply = bounded(
            P,
            self.inner.options.response_timeout,
            c.route_command(
                redis::cmd("PING"),
                RoutingInfo::MultiNode((MultipleNodeRoutingInfo::AllMasters, None)),
            ),
        )
        .await?;
        let Value::Map(nodes) = reply else {
            return Err(StoreError::corrupt(
                P,
                format!("unexpected answer to PING on all primaries: {reply:?}"),
            ));
        };
        nodes
            .into_iter()
            .map(|(addr, _)| {
                let addr = text(&addr)
                    .and_then(|a| std::str::from_utf8(a).ok())
                    .ok_or_else(|| StoreError::corrupt(P, "node address is not text"))?;
                let (host, port) = addr
                    .rsplit_once(':')
                    .and_then(|(h, p)| Some((h.to_owned(), p.parse().ok()?)))
                    .ok_or_else(|| StoreError::corrupt(P, format!("bad node address {addr:?}")))?;
                Ok((host, port))
            })
            .collect()
    }
}

#[async_trait]
impl Store for RedisStore {
    /// `begin.lua` in one round trip: reads the record and the server's
    /// `TIME`, then answers from a live record or claims the key
    /// (`HSET` + `PEXPIREAT`, fence counter `SET … PXAT`).
    async fn begin(&self, req: &BeginRequest) -> Result<Begin, StoreError> {
        const P: Phase = Phase::Begin;
        let keys = self.keys(&req.scope, &req.key);
        let lease = ms(req.lease).to_string();
        let keep = self.keep_ms().to_string();
        let reply = self
            .run(
                P,
                &scripts::BEGIN,
                &[&keys.record, &keys.fence],
                &[
                    req.fingerprint.as_bytes(),
                    lease.as_bytes(),
                    keep.as_bytes(),
                ],
            )
            .await?;
        let items = array(reply, P)?;
        let tag = items.first().and_then(text).unwrap_or_default();
        match tag {
            b"acquired" => {
                let fence = items
                    .get(1)
                    .and_then(int)
                    .and_then(|f| u64::try_from(f).ok());
                let until = items
                    .get(2)
                    .and_then(int)
                    .and_then(|u| u64::try_from(u).ok());
                let took_over = items.get(3).and_then(int);
                match (fence, until, took_over) {
                    (Some(fence), Some(until), Some(took_over @ (0 | 1))) => {
                        Ok(Begin::Acquired(Lease {
                            scope: req.scope.clone(),
                            key: req.key.clone(),
                            fence,
                            until: Millis(until),
                            took_over: took_over == 1,
                        }))
                    }
                    _ => Err(StoreError::corrupt(
                        P,
                        format!("bad answer from begin.lua: {items:?}"),
                    )),
                }
            }
            b"in_flight" => {
                let left = items
                    .get(1)
                    .and_then(int)
                    .and_then(|l| u64::try_from(l).ok())
                    .ok_or_else(|| {
                        StoreError::corrupt(P, format!("bad answer from begin.lua: {items:?}"))
                    })?;
                Ok(Begin::InFlight {
                    retry_after: Duration::from_millis(left.max(1)),
                })
            }
            b"replay" => {
                let blob = items
                    .get(1)
                    .and_then(text)
                    .ok_or_else(|| StoreError::corrupt(P, "completed record without a response"))?;
                StoredResponse::decode(blob)
                    .map(Begin::Replay)
                    .map_err(|e| StoreError::corrupt(P, format!("stored response: {e}")))
            }
            b"mismatch" => Ok(Begin::Mismatch),
            b"corrupt" => Err(StoreError::corrupt(P, lossy(items.get(1)))),
            _ => Err(StoreError::corrupt(
                P,
                format!("unexpected answer from begin.lua: {items:?}"),
            )),
        }
    }

    /// `complete.lua`: stores the result only while the record is in
    /// progress with exactly `lease.fence`, sets its expiry with
    /// `PEXPIREAT` (milliseconds) and publishes on the key's channel.
    ///
    /// Retrying after a [`StoreError::Timeout`] never writes twice: if the
    /// first call landed, the retry finds the record completed and answers
    /// [`StoreError::LeaseLost`]; if not, it stores the result.
    async fn complete(
        &self,
        lease: &Lease,
        response: &StoredResponse,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        const P: Phase = Phase::Complete;
        let keys = self.keys(&lease.scope, &lease.key);
        let fence = lease.fence.to_string();
        let ttl = ms(ttl).to_string();
        let keep = self.keep_ms().to_string();
        let blob = response.encode();
        let reply = self
            .run(
                P,
                &scripts::COMPLETE,
                &[&keys.record, &keys.fence],
                &[
                    fence.as_bytes(),
                    &blob,
                    ttl.as_bytes(),
                    keep.as_bytes(),
                    keys.channel.as_bytes(),
                ],
            )
            .await?;
        done_or_lost(&reply, lease.fence, P)
    }

    /// `release.lua`: deletes the record only while it is in progress with
    /// exactly `lease.fence` (the fence counter stays) and publishes.
    async fn release(&self, lease: &Lease) -> Result<(), StoreError> {
        const P: Phase = Phase::Release;
        let keys = self.keys(&lease.scope, &lease.key);
        let fence = lease.fence.to_string();
        let reply = self
            .run(
                P,
                &scripts::RELEASE,
                &[&keys.record, &keys.fence],
                &[fence.as_bytes(), keys.channel.as_bytes()],
            )
            .await?;
        done_or_lost(&reply, lease.fence, P)
    }

    /// `extend.lua`: moves `lease_until` to server time + `lease_for` only
    /// while the record is in progress with exactly `lease.fence`.
    async fn extend(&self, lease: &Lease, lease_for: Duration) -> Result<Lease, StoreError> {
        const P: Phase = Phase::Extend;
        let keys = self.keys(&lease.scope, &lease.key);
        let fence = lease.fence.to_string();
        let lease_ms = ms(lease_for).to_string();
        let keep = self.keep_ms().to_string();
        let reply = self
            .run(
                P,
                &scripts::EXTEND,
                &[&keys.record, &keys.fence],
                &[fence.as_bytes(), lease_ms.as_bytes(), keep.as_bytes()],
            )
            .await?;
        match int(&reply) {
            Some(-1) => Err(StoreError::LeaseLost { fence: lease.fence }),
            Some(until) if until >= 0 => Ok(Lease {
                until: Millis(until.unsigned_abs()),
                ..lease.clone()
            }),
            _ => Err(StoreError::corrupt(
                P,
                format!("unexpected answer from extend.lua: {reply:?}"),
            )),
        }
    }

    async fn get(&self, scope: &Scope, key: &IdempotencyKey) -> Result<Option<Record>, StoreError> {
        const P: Phase = Phase::Get;
        self.read(&self.keys(scope, key), P).await?.record(P)
    }

    /// `delete.lua`: `DEL` of the record (the fence counter stays, so fences
    /// keep growing) and a publish when one existed. A record past its end
    /// that Redis still keeps counts as existing.
    async fn delete(&self, scope: &Scope, key: &IdempotencyKey) -> Result<bool, StoreError> {
        const P: Phase = Phase::Delete;
        let keys = self.keys(scope, key);
        let reply = self
            .run(
                P,
                &scripts::DELETE,
                &[&keys.record],
                &[keys.channel.as_bytes()],
            )
            .await?;
        match int(&reply) {
            Some(n) => Ok(n > 0),
            None => Err(StoreError::corrupt(
                P,
                format!("unexpected answer from delete.lua: {reply:?}"),
            )),
        }
    }

    /// Redis drops ended records by itself, [`RedisOptions::keep_expired`]
    /// after their end. This removes them sooner: it `SCAN`s the keyspace
    /// (every primary of a Cluster) for this prefix's records, `COUNT`
    /// [`RedisOptions::scan_count`] at a time, and runs `purge.lua` on each,
    /// which deletes the record only if it has ended by the server's clock.
    /// Returns how many it removed.
    ///
    /// Cost: `SCAN` walks the whole keyspace of each node, including keys
    /// that are not idem's; on a large shared Redis call it seldom, or not
    /// at all (nothing depends on it).
    async fn purge_expired(&self) -> Result<u64, StoreError> {
        if !self.is_cluster() {
            return self.purge_node(None).await;
        }
        let mut purged = 0;
        for node in self.primaries().await? {
            purged += self.purge_node(Some(node)).await?;
        }
        Ok(purged)
    }

    /// Waits on Redis pub/sub: `complete`, `release`, `delete` and purging
    /// publish on the key's channel `{<prefix>:<hex>}:chg` (plain `PUBLISH`,
    /// which a Cluster forwards to every node). One shared subscriber
    /// connection per store carries every waiter's subscription.
    ///
    /// Returns at once when the key is not a live claim; otherwise on a
    /// message, when the holder's lease ends (it may be taken over then), or
    /// after `max`. When pub/sub is unavailable (the subscriber connection
    /// cannot be opened, `SUBSCRIBE` is refused) it polls the record every
    /// [`RedisOptions::poll_interval`] instead; with pub/sub it still
    /// re-reads once a second in case a message was lost.
    ///
    /// # Errors
    /// Availability errors of the first read of the record. Later failures
    /// end the wait early without an error: the caller's next `begin`
    /// reports them.
    async fn wait_for_change(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        max: Duration,
    ) -> Result<(), StoreError> {
        const P: Phase = Phase::Get;
        let started = tokio::time::Instant::now();
        let keys = self.keys(scope, key);
        let Some((fence, left)) = self.live_claim(&keys, P).await? else {
            return Ok(());
        };
        let until = started + max.min(left + Duration::from_millis(5));
        let reg = self.inner.notifier.join(&keys.channel);
        let notified = reg.notify().notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        let budget = until
            .saturating_duration_since(tokio::time::Instant::now())
            .min(self.inner.options.response_timeout);
        let subscribed = self.inner.notifier.subscribe(&reg, budget).await;
        let poll = if subscribed {
            SAFETY_POLL
        } else {
            self.inner.options.poll_interval
        };
        loop {
            // Re-read after subscribing (a change before it would be missed)
            // and on every poll tick.
            match self.live_claim(&keys, P).await {
                Ok(Some((f, _))) if f == fence => {}
                _ => return Ok(()),
            }
            let now = tokio::time::Instant::now();
            if now >= until {
                return Ok(());
            }
            let tick = (now + poll).min(until);
            tokio::select! {
                () = &mut notified => return Ok(()),
                () = tokio::time::sleep_until(tick) => {}
            }
        }
    }
}

/// A `get.lua` answer: the server's time and the raw record.
#[derive(Debug)]
struct Read {
    now: Millis,
    raw: Option<Vec<Value>>,
}

impl Read {
    fn decode(v: Value, phase: Phase) -> Result<Self, StoreError> {
        let mut items = array(v, phase)?.into_iter();
        let now = items
            .next()
            .as_ref()
            .and_then(int)
            .and_then(|n| u64::try_from(n).ok())
            .ok_or_else(|| StoreError::corrupt(phase, "get.lua answered without the time"))?;
        let rest: Vec<Value> = items.collect();
        if rest.is_empty() {
            return Ok(Self {
                now: Millis(now),
                raw: None,
            });
        }
        if rest.first().and_then(text) != Some(b"hash") {
            return Err(StoreError::corrupt(
                phase,
                format!("record key holds a {}, not a hash", lossy(rest.first())),
            ));
        }
        Ok(Self {
            now: Millis(now),
            raw: Some(rest.into_iter().skip(1).collect()),
        })
    }

    /// The record as of the server's time; `None` when absent or ended.
    fn record(&self, phase: Phase) -> Result<Option<Record>, StoreError> {
        let Some(raw) = &self.raw else {
            return Ok(None);
        };
        let field = |i: usize| raw.get(i).and_then(text);
        let number = |i: usize, name: &str| -> Result<u64, StoreError> {
            field(i)
                .and_then(|b| std::str::from_utf8(b).ok())
                .and_then(|s| s.parse::<u64>().ok())
                .ok_or_else(|| {
                    StoreError::corrupt(phase, format!("{name} is missing or not a number"))
                })
        };
        let fingerprint = field(1)
            .and_then(|f| <[u8; 32]>::try_from(f).ok())
            .map(Fingerprint)
            .ok_or_else(|| StoreError::corrupt(phase, "fingerprint is missing or not 32 bytes"))?;
        let state = match field(0) {
            Some(b"in_progress") => {
                let lease_until = Millis(number(3, "lease_until")?);
                let fence = number(2, "fence")?;
                if lease_until <= self.now {
                    return Ok(None);
                }
                RecordState::InProgress { fence, lease_until }
            }
            Some(b"completed") => {
                let expires_at = Millis(number(4, "expires_at")?);
                if expires_at <= self.now {
                    return Ok(None);
                }
                let blob = field(5).ok_or_else(|| {
                    StoreError::corrupt(phase, "completed record without a response")
                })?;
                let response = StoredResponse::decode(blob)
                    .map_err(|e| StoreError::corrupt(phase, format!("stored response: {e}")))?;
                RecordState::Completed {
                    response,
                    expires_at,
                }
            }
            other => {
                return Err(StoreError::corrupt(
                    phase,
                    format!(
                        "unknown record state {:?}",
                        other.map(String::from_utf8_lossy)
                    ),
                ))
            }
        };
        Ok(Some(Record { fingerprint, state }))
    }
}

/// A duration in whole milliseconds (rounded up), at most [`MAX_MS`].
fn ms(d: Duration) -> u64 {
    duration_ms(d).min(MAX_MS)
}

fn array(v: Value, phase: Phase) -> Result<Vec<Value>, StoreError> {
    match v {
        Value::Array(items) | Value::Set(items) => Ok(items),
        other => Err(StoreError::corrupt(
            phase,
            format!("expected an array, got {other:?}"),
        )),
    }
}

fn text(v: &Value) -> Option<&[u8]> {
    match v {
        Value::BulkString(b) => Some(b),
        Value::SimpleString(s) => Some(s.as_bytes()),
        _ => None,
    }
}

fn int(v: &Value) -> Option<i64> {
    match v {
        Value::Int(n) => Some(*n),
        Value::BulkString(b) => std::str::from_utf8(b).ok()?.parse().ok(),
        _ => None,
    }
}

fn lossy(v: Option<&Value>) -> String {
    v.and_then(text)
        .map(|b| String::from_utf8_lossy(b).into_owned())
        .unwrap_or_else(|| format!("{v:?}"))
}

fn done_or_lost(reply: &Value, fence: u64, phase: Phase) -> Result<(), StoreError> {
    match int(reply) {
        Some(1) => Ok(()),
        Some(0) => Err(StoreError::LeaseLost { fence }),
        _ => Err(StoreError::corrupt(
            phase,
            format!("unexpected script answer: {reply:?}"),
        )),
    }
}

/// `[cursor, [key, …]]` from `SCAN`.
fn decode_scan(v: Value) -> Result<(u64, Vec<String>), String> {
    let Value::Array(mut parts) = v else {
        return Err(format!("unexpected SCAN answer: {v:?}"));
    };
    if parts.len() != 2 {
        return Err(format!("SCAN answered {} parts, not 2", parts.len()));
    }
    let keys = parts.pop().unwrap_or(Value::Nil);
    let cursor = int(&parts[0]).and_then(|c| u64::try_from(c).ok());
    let Some(cursor) = cursor.or_else(|| {
        text(&parts[0])
            .and_then(|b| std::str::from_utf8(b).ok())
            .and_then(|s| s.parse().ok())
    }) else {
        return Err(format!("bad SCAN cursor {:?}", parts[0]));
    };
    let Value::Array(keys) = keys else {
        return Err(format!("bad SCAN key list {keys:?}"));
    };
    let keys = keys
        .iter()
        .filter_map(text)
        .filter_map(|k| std::str::from_utf8(k).ok().map(str::to_owned))
        .collect();
    Ok((cursor, keys))
}

/// Logs a warning unless every node evicts nothing (`noeviction`): an
/// evicting policy may drop a live claim or result, and a key would run
/// twice. Best effort: `CONFIG` may be disabled on managed services.
async fn check_eviction_policy(conn: &mut Conn, limit: Duration) {
    let mut get = redis::cmd("CONFIG");
    get.arg("GET").arg("maxmemory-policy");
    let reply = tokio::time::timeout(limit, get.query_async::<Value>(conn)).await;
    let Ok(Ok(reply)) = reply else {
        tracing::debug!("cannot read maxmemory-policy; make sure it is noeviction");
        return;
    };
    let mut words = Vec::new();
    collect_text(&reply, &mut words);
    let policies: Vec<&String> = words
        .iter()
        .filter(|w| w.as_str() != "maxmemory-policy" && !w.contains(':'))
        .collect();
    if policies.iter().any(|p| p.as_str() != "noeviction") {
        tracing::warn!(
            ?policies,
            "Redis maxmemory-policy is not noeviction: under memory pressure Redis may evict \
             idempotency records, and a key could then run twice"
        );
    }
}

fn collect_text(v: &Value, out: &mut Vec<String>) {
    match v {
        Value::Array(items) | Value::Set(items) => items.iter().for_each(|i| collect_text(i, out)),
        Value::Map(pairs) => pairs.iter().for_each(|(k, v)| {
            collect_text(k, out);
            collect_text(v, out);
        }),
        other => {
            if let Some(t) = text(other) {
                out.push(String::from_utf8_lossy(t).into_owned());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ms_rounds_up_and_clamps() {
        assert_eq!(ms(Duration::from_millis(1500)), 1500);
        assert_eq!(ms(Duration::from_micros(1)), 1);
        assert_eq!(ms(Duration::MAX), MAX_MS);
        // Deadlines stay exact in Lua doubles: now (~1.7e12 ms) + 3 × MAX_MS < 2^53.
        const { assert!(2_000_000_000_000 + 3 * MAX_MS < 1 << 53) };
    }

    #[test]
    fn scan_answers_decode() {
        let v = Value::Array(vec![
            Value::BulkString(b"17".to_vec()),
            Value::Array(vec![Value::BulkString(b"{idem:x}:r".to_vec())]),
        ]);
        assert_eq!(
            decode_scan(v).expect("decode"),
            (17, vec!["{idem:x}:r".to_owned()])
        );
        assert!(decode_scan(Value::Nil).is_err());
    }

    #[test]
    fn corrupt_records_are_errors() {
        let now = Millis(1_000);
        let rec = |fields: Vec<Value>| Read {
            now,
            raw: Some(fields),
        };
        let b = |s: &[u8]| Value::BulkString(s.to_vec());
        let fp = [7u8; 32];
        // state, fingerprint, fence, lease_until, expires_at, response
        let cases = vec![
            vec![
                b(b"weird"),
                b(&fp),
                b(b"1"),
                b(b"2000"),
                Value::Nil,
                Value::Nil,
            ],
            vec![
                b(b"in_progress"),
                b(b"short"),
                b(b"1"),
                b(b"2000"),
                Value::Nil,
                Value::Nil,
            ],
            vec![
                b(b"in_progress"),
                b(&fp),
                b(b"x"),
                b(b"2000"),
                Value::Nil,
                Value::Nil,
            ],
            vec![
                b(b"completed"),
                b(&fp),
                b(b"1"),
                Value::Nil,
                b(b"2000"),
                b(b"\x09junk"),
            ],
            vec![
                b(b"completed"),
                b(&fp),
                b(b"1"),
                Value::Nil,
                b(b"2000"),
                Value::Nil,
            ],
        ];
        for fields in cases {
            assert!(
                matches!(
                    rec(fields.clone()).record(Phase::Get),
                    Err(StoreError::Corrupt { .. })
                ),
                "{fields:?}"
            );
        }
        let ok = rec(vec![
            b(b"in_progress"),
            b(&fp),
            b(b"5"),
            b(b"2000"),
            Value::Nil,
            Value::Nil,
        ]);
        assert!(matches!(
            ok.record(Phase::Get),
            Ok(Some(Record {
                state: RecordState::InProgress { fence: 5, .. },
                ..
            }))
        ));
        let ended = rec(vec![
            b(b"in_progress"),
            b(&fp),
            b(b"5"),
            b(b"1000"),
            Value::Nil,
            Value::Nil,
        ]);
        assert!(matches!(ended.record(Phase::Get), Ok(None)));
    }
}
