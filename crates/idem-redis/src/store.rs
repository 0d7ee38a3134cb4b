//! [`RedisStore`]: the key protocol as one Lua script per step.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use idem_core::admin::{ListPage, ListQuery, ListedRecord, StateFilter};
use idem_core::{
    duration_ms, Begin, BeginRequest, Fingerprint, HoldReason, IdempotencyKey, KeyAdmin, Lease,
    Millis, Phase, Record, RecordState, Scope, Store, StoreError, StoredResponse,
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
    /// Over TLS the server's certificate must chain to
    /// `RedisOptions::tls_root_cert_pem` (feature `tls`; default: the system's roots) and
    /// name the URL's host. The URL's `idem_*` parameters are not read here
    /// (see [`RedisUrl`](crate::RedisUrl), which turns `idem_tls_ca` and the
    /// like into options).
    ///
    /// # Errors
    /// [`StoreError::Config`] for a malformed URL, an unknown scheme or a
    /// `#fragment` (redis-rs's `#insecure`, which would check no
    /// certificate, is refused);
    /// [`StoreError::Unavailable`] (phase `Connect`) when the server refuses
    /// the connection, authentication, the TLS handshake (its certificate
    /// included) or `SCRIPT LOAD`;
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

    /// A handle on the store's connection (shared, multiplexed).
    pub(crate) fn connection(&self) -> Conn {
        self.inner.conn.clone()
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
                state:
                    RecordState::InProgress {
                        fence, lease_until, ..
                    },
                ..
            }) => Some((fence, read.now.until(lease_until))),
            _ => None,
        })
    }

    /// One `SCAN` step on one node (`None`: the single server) from
    /// `cursor`: the next cursor and the record keys of this prefix found.
    async fn scan_step(
        &self,
        phase: Phase,
        node: Option<&(String, u16)>,
        cursor: u64,
    ) -> Result<(u64, Vec<String>), StoreError> {
        let pattern = record_pattern(&self.inner.options.key_prefix);
        let mut scan = redis::cmd("SCAN");
        scan.arg(cursor)
            .arg("MATCH")
            .arg(&pattern)
            .arg("COUNT")
            .arg(self.inner.options.scan_count)
            .arg("TYPE")
            .arg("hash");
        let mut conn = self.inner.conn.clone();
        let reply = bounded(phase, self.inner.options.response_timeout, async {
            match (&mut conn, node) {
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
        decode_scan(reply).map_err(|d| StoreError::corrupt(phase, d))
    }

    /// Scans one node (`None`: the single server) for records and purges
    /// the ended ones.
    async fn purge_node(&self, node: Option<(String, u16)>) -> Result<u64, StoreError> {
        const P: Phase = Phase::Purge;
        let mut cursor: u64 = 0;
        let mut purged = 0;
        loop {
            let (next, found) = self.scan_step(P, node.as_ref(), cursor).await?;
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

    /// The primaries of the Cluster, as (host, port), sorted.
    async fn primaries(&self, phase: Phase) -> Result<Vec<(String, u16)>, StoreError> {
        let Conn::Cluster(c) = &self.inner.conn else {
            return Ok(Vec::new());
        };
        let mut c = c.clone();
        let reply = bounded(
            phase,
            self.inner.options.response_timeout,
            c.route_command(
                redis::cmd("PING"),
                RoutingInfo::MultiNode((MultipleNodeRoutingInfo::AllMasters, None)),
            ),
        )
        .await?;
        let Value::Map(nodes) = reply else {
            return Err(StoreError::corrupt(
                phase,
                format!("unexpected answer to PING on all primaries: {reply:?}"),
            ));
        };
        nodes
            .into_iter()
            .map(|(addr, _)| {
                let addr = text(&addr)
                    .and_then(|a| std::str::from_utf8(a).ok())
                    .ok_or_else(|| StoreError::corrupt(phase, "node address is not text"))?;
                let (host, port) = addr
                    .rsplit_once(':')
                    .and_then(|(h, p)| Some((h.to_owned(), p.parse().ok()?)))
                    .ok_or_else(|| {
                        StoreError::corrupt(phase, format!("bad node address {addr:?}"))
                    })?;
                Ok((host, port))
            })
            .collect::<Result<Vec<_>, StoreError>>()
            .map(|mut nodes| {
                nodes.sort();
                nodes
            })
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
                    req.scope.as_str().as_bytes(),
                    req.key.as_str().as_bytes(),
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
        lease_end_or_lost(&reply, lease, P)
    }

    /// `hold.lua`: writes the reason into the record's `response` field and
    /// moves `lease_until` to at least server time + `hold_for`, only while
    /// the record is in progress with exactly `lease.fence`.
    async fn hold(
        &self,
        lease: &Lease,
        reason: HoldReason,
        hold_for: Duration,
    ) -> Result<Lease, StoreError> {
        const P: Phase = Phase::Hold;
        let keys = self.keys(&lease.scope, &lease.key);
        let fence = lease.fence.to_string();
        let hold_ms = ms(hold_for).to_string();
        let keep = self.keep_ms().to_string();
        let reply = self
            .run(
                P,
                &scripts::HOLD,
                &[&keys.record, &keys.fence],
                &[
                    fence.as_bytes(),
                    hold_ms.as_bytes(),
                    keep.as_bytes(),
                    reason.as_str().as_bytes(),
                ],
            )
            .await?;
        lease_end_or_lost(&reply, lease, P)
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
        for node in self.primaries(Phase::Purge).await? {
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

    fn admin(&self) -> Option<&dyn KeyAdmin> {
        Some(self)
    }
}

/// Most `SCAN` steps one [`KeyAdmin::list`] call takes (each asks a node for
/// [`RedisOptions::scan_count`] keys, default 500): a page may hold fewer
/// records than asked for, with a cursor to go on from.
const LIST_SCAN_STEPS: usize = 32;

/// Records read at once (one `get.lua` each) while listing.
const LIST_READ_CHUNK: usize = 64;

/// Listing: Redis cannot order its keyspace, so a listing walks it with
/// `SCAN` (every primary of a Cluster in turn, sorted by address), reads
/// each record of this prefix found (`get.lua`, one round trip each, up to
/// 64 at once) and keeps those matching the filters. No order: see
/// [`KeyAdmin::newest_first`].
///
/// Cost: `SCAN` visits every key of every node, idem's or not, and the
/// scope and state filters are applied after reading each record (the key
/// names are hashes); one call takes at most 32 `SCAN` steps, so a page may
/// hold fewer records than the limit (even none) with a cursor to go on
/// from. Consistency as `SCAN`'s: a record present for the whole listing is
/// listed; one may appear twice when Redis resized its table between pages
/// (a page itself never repeats a record). Records written before the
/// record kept its scope and key (`scope`, `key` fields) are not listed;
/// they end within their lease or TTL. An undecodable record is skipped
/// with a warning, so one bad record cannot stop a listing.
///
/// Cursor: the node's address, the `SCAN` cursor of the step being read,
/// and the last record of that step already listed (steps are read in key
/// order), so a step cut short by the limit resumes where it stopped.
#[async_trait]
impl KeyAdmin for RedisStore {
    async fn list(&self, query: &ListQuery) -> Result<ListPage, StoreError> {
        const P: Phase = Phase::List;
        query.validate()?;
        let tag = ListCursor::tag(&self.inner.options.key_prefix, query);
        let nodes: Vec<Option<(String, u16)>> = if self.is_cluster() {
            self.primaries(P).await?.into_iter().map(Some).collect()
        } else {
            vec![None]
        };
        let mut at = match &query.cursor {
            None => ListCursor::default(),
            Some(text) => ListCursor::parse(text, &tag)?,
        };
        let mut node_i = match &at.node {
            _ if query.cursor.is_none() => 0,
            None if !self.is_cluster() => 0,
            Some(addr) => nodes
                .iter()
                .position(|n| n.as_ref().map(node_name).as_deref() == Some(addr.as_str()))
                .ok_or_else(|| {
                    StoreError::Invalid(format!(
                        "cursor names node {addr}, which is no longer a primary of this \
                         Cluster; start the listing again"
                    ))
                })?,
            None => {
                return Err(StoreError::Invalid(
                    "cursor was made on a single Redis, not this Cluster".into(),
                ))
            }
        };
        let mut records: Vec<ListedRecord> = Vec::new();
        let mut seen = std::collections::HashSet::new();
        let mut steps = 0;
        loop {
            let Some(node) = nodes.get(node_i) else {
                return Ok(ListPage {
                    records,
                    next: None,
                });
            };
            if records.len() >= query.limit || steps == LIST_SCAN_STEPS {
                at.node = node.as_ref().map(node_name);
                return Ok(ListPage {
                    records,
                    next: Some(at.encode(&tag)),
                });
            }
            steps += 1;
            let (next, mut found) = self.scan_step(P, node.as_ref(), at.scan).await?;
            found.sort_unstable();
            found.dedup();
            if let Some(skip) = &at.after {
                found.retain(|k| record_hash_of(k).is_some_and(|h| h > skip.as_str()));
            }
            let mut stopped = false;
            'batch: for chunk in found.chunks(LIST_READ_CHUNK) {
                let reads = futures::future::join_all(
                    chunk
                        .iter()
                        .map(|k| async move { self.run(P, &scripts::GET, &[k], &[]).await }),
                )
                .await;
                for (k, read) in chunk.iter().zip(reads) {
                    if records.len() >= query.limit {
                        stopped = true;
                        break 'batch;
                    }
                    at.after = record_hash_of(k).map(str::to_owned);
                    if let Some(r) = listed(k, read?, query) {
                        if seen.insert(k.clone()) {
                            records.push(r);
                        }
                    }
                }
            }
            if !stopped {
                // This step is done: on to the next one, or the next node.
                at.after = None;
                at.scan = next;
                if next == 0 {
                    node_i += 1;
                }
            }
        }
    }
}

/// The listed record of record key `k` from its `get.lua` answer, when it
/// matches `query`; `None` otherwise (gone, expired, filtered out, without
/// its scope and key, or undecodable — logged).
fn listed(k: &str, reply: Value, query: &ListQuery) -> Option<ListedRecord> {
    const P: Phase = Phase::List;
    let read = match Read::decode(reply, P) {
        Ok(r) => r,
        Err(e) => {
            tracing::warn!(record = k, error = %e, "listing skips an undecodable record");
            return None;
        }
    };
    let record = match read.record_at(P, true) {
        Ok(Some(r)) => r,
        Ok(None) => return None,
        Err(e) => {
            tracing::warn!(record = k, error = %e, "listing skips an undecodable record");
            return None;
        }
    };
    let Some((scope, key)) = read.names() else {
        tracing::debug!(
            record = k,
            "listing skips a record without its scope and key (written by an older idem)"
        );
        return None;
    };
    let state_ok = matches!(
        (&record.state, query.state),
        (_, StateFilter::Any)
            | (RecordState::InProgress { .. }, StateFilter::InFlight)
            | (RecordState::Completed { .. }, StateFilter::Completed)
    );
    if !state_ok || query.scope.as_ref().is_some_and(|s| *s != scope) {
        return None;
    }
    Some(ListedRecord { scope, key, record })
}

/// `host:port` of a Cluster node.
fn node_name(n: &(String, u16)) -> String {
    format!("{}:{}", n.0, n.1)
}

/// The 64 hex digits that name a record key `{<prefix>:<hex>}:r`.
fn record_hash_of(k: &str) -> Option<&str> {
    let body = k.strip_suffix("}:r")?;
    let h = body.get(body.len().checked_sub(64)?..)?;
    h.bytes().all(|b| b.is_ascii_hexdigit()).then_some(h)
}

/// Where a Redis listing goes on; as text
/// `redis1.<node, hex of host:port, or empty>.<scan cursor>.<last record hash or empty>.<tag>`.
#[derive(Debug, Default, PartialEq, Eq)]
struct ListCursor {
    node: Option<String>,
    scan: u64,
    after: Option<String>,
}

impl ListCursor {
    const PREFIX: &'static str = "redis1.";

    /// Ties a cursor to one listing: the key prefix and the filters.
    fn tag(prefix: &str, query: &ListQuery) -> String {
        use sha2::{Digest, Sha256};
        let state = match query.state {
            StateFilter::Any => "any",
            StateFilter::InFlight => "in-flight",
            StateFilter::Completed => "completed",
        };
        let mut h = Sha256::new();
        for part in [
            prefix,
            state,
            query.scope.as_ref().map_or("\u{1}every", Scope::as_str),
        ] {
            h.update((part.len() as u64).to_be_bytes());
            h.update(part.as_bytes());
        }
        hex::encode(&h.finalize()[..4])
    }

    fn encode(&self, tag: &str) -> String {
        format!(
            "{}{}.{}.{}.{tag}",
            Self::PREFIX,
            self.node.as_deref().map(hex::encode).unwrap_or_default(),
            self.scan,
            self.after.as_deref().unwrap_or_default()
        )
    }

    /// # Errors
    /// [`StoreError::Invalid`] for text [`Self::encode`] did not make with
    /// this `tag`.
    fn parse(text: &str, tag: &str) -> Result<Self, StoreError> {
        let bad = || {
            StoreError::Invalid(format!(
                "cursor {text:?} was not made by this store's listing"
            ))
        };
        let rest = text.strip_prefix(Self::PREFIX).ok_or_else(bad)?;
        let parts: Vec<&str> = rest.split('.').collect();
        let [node, scan, after, t] = parts.as_slice() else {
            return Err(bad());
        };
        if *t != tag {
            return Err(StoreError::Invalid(format!(
                "cursor {text:?} belongs to another listing (other prefix, state or scope)"
            )));
        }
        let lower_hex = |s: &str| s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
        let node = match *node {
            "" => None,
            n if lower_hex(n) && n.len() <= 600 => Some(
                hex::decode(n)
                    .ok()
                    .and_then(|b| String::from_utf8(b).ok())
                    .ok_or_else(bad)?,
            ),
            _ => return Err(bad()),
        };
        if scan.is_empty() || scan.len() > 20 || !scan.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad());
        }
        let scan = scan.parse().map_err(|_| bad())?;
        let after = match *after {
            "" => None,
            a if a.len() == 64 && lower_hex(a) => Some(a.to_owned()),
            _ => return Err(bad()),
        };
        Ok(Self { node, scan, after })
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
        self.record_at(phase, false)
    }

    /// Like [`Self::record`]; with `ended_claims`, a claim past its lease
    /// too (what a listing shows as in flight).
    fn record_at(&self, phase: Phase, ended_claims: bool) -> Result<Option<Record>, StoreError> {
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
                if lease_until <= self.now && !ended_claims {
                    return Ok(None);
                }
                let held = field(5)
                    .map(|b| {
                        HoldReason::parse(b).ok_or_else(|| {
                            StoreError::corrupt(
                                phase,
                                "in-progress record with an unknown hold reason",
                            )
                        })
                    })
                    .transpose()?;
                RecordState::InProgress {
                    fence,
                    lease_until,
                    held,
                }
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

    /// The scope and key kept in the record (fields `scope`, `key`);
    /// `None` for a record written before they were kept, or a value that
    /// is not a valid scope or key.
    fn names(&self) -> Option<(Scope, IdempotencyKey)> {
        let raw = self.raw.as_ref()?;
        let field = |i: usize| {
            raw.get(i)
                .and_then(text)
                .and_then(|b| std::str::from_utf8(b).ok())
        };
        let scope = Scope::new(field(6)?).ok()?;
        let key = IdempotencyKey::new(field(7)?).ok()?;
        Some((scope, key))
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

/// The answer of `extend.lua` and `hold.lua`: the new lease end (ms since
/// the epoch), or -1 when the fence is not current.
fn lease_end_or_lost(reply: &Value, lease: &Lease, phase: Phase) -> Result<Lease, StoreError> {
    match int(reply) {
        Some(-1) => Err(StoreError::LeaseLost { fence: lease.fence }),
        Some(until) if until >= 0 => Ok(Lease {
            until: Millis(until.unsigned_abs()),
            ..lease.clone()
        }),
        _ => Err(StoreError::corrupt(
            phase,
            format!("unexpected answer from the {phase} script: {reply:?}"),
        )),
    }
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
    fn list_cursors_round_trip_and_refuse_strangers() {
        let q = ListQuery::default();
        let tag = ListCursor::tag("idem", &q);
        let c = ListCursor {
            node: Some("127.0.0.1:7000".into()),
            scan: 12345,
            after: Some("ab".repeat(32)),
        };
        let text = c.encode(&tag);
        assert_eq!(ListCursor::parse(&text, &tag).expect("ours"), c);
        let plain = ListCursor::default();
        assert_eq!(
            ListCursor::parse(&plain.encode(&tag), &tag).expect("ours"),
            plain
        );
        let other = ListQuery {
            state: StateFilter::Completed,
            ..ListQuery::default()
        };
        assert_ne!(ListCursor::tag("idem", &other), tag);
        assert_ne!(ListCursor::tag("idem2", &q), tag);
        for bad in [
            String::new(),
            "redis1.".into(),
            "redis1...".into(),
            format!("redis1..x.{}.{tag}", ""),
            format!("redis1..1.{}.{tag}", "AB".repeat(32)),
            format!("redis1..1.abc.{tag}"),
            format!("redis1.zz.1..{tag}"),
            format!("redis1..1..{tag}.x"),
            format!("redis1..99999999999999999999999.{tag}"),
            format!("sql1-000000000000002a-{tag}"),
            format!("redis1..1..{}", ListCursor::tag("idem", &other)),
        ] {
            assert!(
                matches!(ListCursor::parse(&bad, &tag), Err(StoreError::Invalid(_))),
                "{bad:?}"
            );
        }
        let k = RecordKeys::new(
            "idem",
            &Scope::new("s").expect("scope"),
            &IdempotencyKey::new("k").expect("key"),
        );
        assert_eq!(record_hash_of(&k.record).map(str::len), Some(64));
        assert_eq!(record_hash_of("{idem:short}:r"), None);
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
