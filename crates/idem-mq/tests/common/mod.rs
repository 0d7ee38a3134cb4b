//! Shared by the broker tests: the payment handler in its three forms
//! (SQLite inbox, PostgreSQL inbox, Redis/memory store dedup), counters, and
//! server URLs with their start commands.

#![allow(dead_code, unreachable_pub)]

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use idem_core::BoxError;
use idem_mq::{
    Dedup, DedupOptions, Message, MessageHandler, MessageKey, Outcome, Processor, Report, SqlInbox,
};

pub const START_PG: &str =
    "pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start";
pub const START_NATS: &str = "start-stop-daemon --start --oknodo --background --exec /usr/sbin/nats-server -- -a 127.0.0.1 -p 4222 -js -sd /var/lib/nats-server -l /var/log/nats-server.log";
pub const START_RABBIT: &str = "rabbitmq-server -detached";
pub const START_REDIS: &str = "redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save \"\" --appendonly no --dir /var/lib/redis --logfile /var/log/redis/ci.log";

pub fn env_url(var: &str, default: &str) -> String {
    std::env::var(var).unwrap_or_else(|_| default.to_owned())
}

pub fn suffix() -> String {
    idem_testkit::support::random_hex(10)
}

/// Fails (never skips) naming the command that starts the server.
pub fn unreachable(what: &str, url: &str, err: &dyn std::fmt::Display, start: &str) -> ! {
    panic!(
        "{what} at {url} is not reachable ({err}).\nThese tests need the real server. Start it with:\n    {start}\n\
         (or point the URL variable at another server)"
    )
}

/// `{"payment_id": id, "account": "acct-1", "amount_cents": 500}`
pub fn payment(id: &str) -> Vec<u8> {
    serde_json::to_vec(
        &serde_json::json!({"payment_id": id, "account": "acct-1", "amount_cents": 500}),
    )
    .expect("json")
}

fn payment_id(msg: &Message) -> Result<String, BoxError> {
    let v: serde_json::Value = serde_json::from_slice(&msg.payload)?;
    Ok(v["payment_id"].as_str().ok_or("no payment_id")?.to_owned())
}

/// Credits a payment: one row per effect in `table` (no unique key: a
/// second effect would show). Fails its first `fail_first` calls after
/// writing (H3: the write must not survive).
#[derive(Debug, Default)]
pub struct Credit {
    pub table: String,
    pub fail_first: AtomicU32,
    pub calls: AtomicU64,
}

impl Credit {
    pub fn new(table: String) -> Self {
        Self {
            table,
            ..Self::default()
        }
    }

    fn should_fail(&self) -> bool {
        self.calls.fetch_add(1, Ordering::SeqCst);
        self.fail_first
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
    }
}

// `TxHandler` for each database: the insert puts `(payment_id, 500)` into
// the handler's table.
idem_mq::tx_handler!(Credit, |this, tx, msg, insert| {
    let id = payment_id(msg)?;
    sqlx::query(&insert(&this.table))
        .bind(id)
        .execute(&mut **tx)
        .await?;
    if this.should_fail() {
        return Err("injected failure after the business write".into());
    }
    Ok(())
},
    sqlx::Sqlite => |t: &str| format!("INSERT INTO {t} (payment_id, cents) VALUES (?1, 500)"),
    sqlx::Postgres => |t: &str| format!("INSERT INTO {t} (payment_id, cents) VALUES ($1, 500)"),
);

/// The store-dedup handler: effects counted in memory per payment id.
#[derive(Debug, Default)]
pub struct CountingCredit {
    pub effects: Mutex<HashMap<String, u32>>,
    pub fail_first: AtomicU32,
}

#[async_trait]
impl MessageHandler for CountingCredit {
    async fn handle(&self, msg: &Message) -> Result<(), BoxError> {
        if self
            .fail_first
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
        {
            return Err("injected failure".into());
        }
        let id = payment_id(msg)?;
        *self.effects.lock().unwrap().entry(id).or_default() += 1;
        Ok(())
    }
}

/// A processor whose effects the tests can count and whose data they drop.
#[async_trait]
pub trait Ledger: Processor + Send + Sync + 'static {
    /// Effects per payment id.
    async fn effects(&self) -> HashMap<String, i64>;
    /// Makes the handler fail its next `n` calls.
    fn fail_next(&self, n: u32);
    async fn cleanup(&self);
}

pub type SqliteLedger = SqlInbox<sqlx::Sqlite, Credit>;
pub type PgLedger = SqlInbox<sqlx::Postgres, Credit>;
pub type RedisLedger = Dedup<idem_redis::RedisStore, CountingCredit>;
pub type MemoryLedger = Dedup<Arc<idem_core::MemoryStore>, CountingCredit>;

/// `impl Ledger for SqlInbox<$db, Credit>`; `$drop` drops the credits and
/// inbox tables at the end (a temporary SQLite file needs nothing).
macro_rules! sql_ledger {
    ($db:ty, drop_tables: $drop:expr) => {
        #[async_trait]
        impl Ledger for SqlInbox<$db, Credit> {
            async fn effects(&self) -> HashMap<String, i64> {
                let table = &self.handler().table;
                let sql = format!("SELECT payment_id, count(*) FROM {table} GROUP BY payment_id");
                let rows: Vec<(String, i64)> = sqlx::query_as(&sql)
                    .fetch_all(self.inbox().pool())
                    .await
                    .expect("count effects");
                rows.into_iter().collect()
            }
            fn fail_next(&self, n: u32) {
                self.handler().fail_first.store(n, Ordering::SeqCst);
            }
            async fn cleanup(&self) {
                if !$drop {
                    return;
                }
                let t = &self.handler().table;
                for table in [t.clone(), format!("{t}_inbox")] {
                    sqlx::query(&format!("DROP TABLE IF EXISTS {table}"))
                        .execute(self.inbox().pool())
                        .await
                        .expect("drop");
                }
            }
        }
    };
}

sql_ledger!(sqlx::Sqlite, drop_tables: false);
sql_ledger!(sqlx::Postgres, drop_tables: true);

/// The store dedup, on any store: effects counted in memory.
#[async_trait]
impl<S: idem_core::Store + Send + Sync + 'static> Ledger for Dedup<S, CountingCredit> {
    async fn effects(&self) -> HashMap<String, i64> {
        self.handler()
            .effects
            .lock()
            .unwrap()
            .iter()
            .map(|(k, v)| (k.clone(), i64::from(*v)))
            .collect()
    }
    fn fail_next(&self, n: u32) {
        self.handler().fail_first.store(n, Ordering::SeqCst);
    }
    async fn cleanup(&self) {}
}

/// A credits table `credits_<random>` (made by `$credits`, `{}` the name)
/// and its inbox `<credits>_inbox`, migrated, on `$pool`: `(table, inbox)`.
#[allow(unused_macros)]
macro_rules! inbox_on {
    ($pool:expr, $credits:literal) => {{
        let pool = $pool;
        let table = format!("credits_{}", $crate::common::suffix());
        sqlx::query(&format!($credits, table))
            .execute(&pool)
            .await
            .unwrap();
        let inbox = idem_mq::inbox::Inbox::with_options(
            pool,
            idem_mq::inbox::InboxOptions::default().with_table(format!("{table}_inbox")),
        )
        .unwrap();
        inbox.migrate().await.unwrap();
        (table, inbox)
    }};
}
#[allow(unused_imports)]
pub(crate) use inbox_on;

pub async fn sqlite_ledger() -> SqliteLedger {
    let dir = Box::leak(Box::new(tempfile::tempdir().expect("tempdir")));
    let (table, inbox) = inbox_on!(
        sqlite_pool(&dir.path().join("ledger.db")).await,
        "CREATE TABLE {} (payment_id TEXT NOT NULL, cents INTEGER NOT NULL)"
    );
    SqlInbox::new(inbox, Credit::new(table))
}

/// A pool of 4 on the SQLite file `path` (created), WAL, 10 s busy timeout.
pub async fn sqlite_pool(path: &std::path::Path) -> sqlx::SqlitePool {
    use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
    let opts = SqliteConnectOptions::new()
        .filename(path)
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .busy_timeout(Duration::from_secs(10));
    SqlitePoolOptions::new()
        .max_connections(4)
        .connect_with(opts)
        .await
        .expect("sqlite")
}

pub fn pg_url() -> String {
    env_url(
        "IDEM_TEST_POSTGRES_URL",
        "postgres://postgres@127.0.0.1:5432/test",
    )
}

pub async fn pg_pool() -> sqlx::PgPool {
    let url = pg_url();
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(8)
        .acquire_timeout(Duration::from_secs(10))
        .connect(&url)
        .await
        .unwrap_or_else(|e| unreachable("PostgreSQL", &url, &e, START_PG))
}

pub async fn pg_ledger() -> PgLedger {
    let (table, inbox) = inbox_on!(
        pg_pool().await,
        "CREATE TABLE {} (payment_id TEXT NOT NULL, cents BIGINT NOT NULL)"
    );
    SqlInbox::new(inbox, Credit::new(table))
}

pub async fn redis_store() -> idem_redis::RedisStore {
    let url = env_url("IDEM_TEST_REDIS_URL", "redis://127.0.0.1:6379/");
    idem_redis::RedisStore::connect(&url)
        .await
        .unwrap_or_else(|e| unreachable("Redis", &url, &e, START_REDIS))
}

pub async fn redis_ledger() -> RedisLedger {
    Dedup::new(redis_store().await)
        .with_options(DedupOptions {
            lease: Duration::from_secs(30),
            retention: Duration::from_secs(600),
        })
        .unwrap()
        .with_handler(CountingCredit::default())
}

/// Wraps a processor, counting calls.
#[derive(Debug)]
pub struct Counted<P> {
    pub inner: Arc<P>,
    pub calls: Arc<AtomicU64>,
}

#[async_trait]
impl<P: Processor> Processor for Counted<P> {
    async fn process(&self, msg: &Message) -> Outcome {
        let o = self.inner.process(msg).await;
        self.calls.fetch_add(1, Ordering::SeqCst);
        o
    }
}

/// Waits (bounded) until `cond` holds.
#[allow(unused_imports)]
pub use idem_testkit::support::eventually;

/// A broker under test.
#[async_trait]
pub trait Broker: Sync {
    /// Publishes [`payment`]`(payment_id)`, with `id` as its message id.
    async fn publish(&self, id: Option<&str>, payment_id: &str);
}

/// Publishes `pay-{i}` with the id `pay-{i}` for every `i` in `ids`.
pub async fn publish_payments<B: Broker>(broker: &B, ids: impl Iterator<Item = usize>) {
    for i in ids {
        let id = format!("pay-{i}");
        broker.publish(Some(&id), &id).await;
    }
}

/// `pay-0` … `pay-{n-1}`; then, after `pause`, every third of them again.
pub async fn publish_with_duplicates<B: Broker>(broker: &B, n: usize, pause: Duration) {
    publish_payments(broker, 0..n).await;
    tokio::time::sleep(pause).await;
    publish_payments(broker, (0..n).step_by(3)).await;
}

/// After [`publish_with_duplicates`] and a consumer that committed 4 and
/// died: exactly `n` effects, one each, and `n - 4` applied by `report`.
pub async fn assert_each_once<L: Ledger>(ledger: &L, report: &Report, n: usize) {
    let effects = ledger.effects().await;
    assert_eq!(effects.len(), n, "{report:?}");
    assert!(effects.values().all(|&v| v == 1), "{effects:?}");
    assert_eq!(report.applied, n as u64 - 4, "{report:?}");
}

/// The crash windows' end: "after-commit" (committed, ack lost) came again
/// as a duplicate, "before-commit" (no commit) was applied; one effect each.
pub async fn assert_crash_windows<L: Ledger>(ledger: &L, report: &Report) {
    assert_eq!((report.applied, report.duplicates), (1, 1), "{report:?}");
    let effects = ledger.effects().await;
    assert_eq!(effects.get("after-commit"), Some(&1));
    assert_eq!(effects.get("before-commit"), Some(&1));
}

/// `id` was processed before by this consumer, from `stream`.
pub async fn processed_before<L: Ledger>(ledger: &L, stream: &str, id: &str) {
    let key = MessageKey::new("payments", id).unwrap().with_stream(stream);
    let earlier = Message {
        key: Some(key),
        payload: payment(id),
        delivery_attempt: 1,
    };
    assert!(matches!(ledger.process(&earlier).await, Outcome::Applied));
}

/// A module `$scenario` with one `#[tokio::test]` per ledger, each
/// `$scenario(common::ledger().await)`: `all` the ledgers (the SQL inboxes
/// and Redis store dedup), or only the `sql` inboxes.
#[allow(unused_macros)]
macro_rules! per_ledger {
    ($scenario:ident: all) => {
        $crate::common::per_ledger!(@tests $scenario:
            sqlite_inbox = sqlite_ledger,
            postgres_inbox = pg_ledger,
            redis_dedup = redis_ledger,
        );
    };
    ($scenario:ident: sql) => {
        $crate::common::per_ledger!(@tests $scenario:
            sqlite_inbox = sqlite_ledger,
            postgres_inbox = pg_ledger,
        );
    };
    (@tests $scenario:ident: $($name:ident = $ledger:ident),* $(,)?) => {
        mod $scenario {$(
            #[tokio::test]
            async fn $name() {
                super::$scenario($crate::common::$ledger().await).await;
            }
        )*}
    };
}
#[allow(unused_imports)]
pub(crate) use per_ledger;
