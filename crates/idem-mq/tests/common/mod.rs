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
use idem_mq::inbox::{Inbox, InboxOptions};
use idem_mq::{
    Dedup, DedupOptions, Message, MessageHandler, Outcome, Processor, SqlInbox, TxHandler,
};
use sqlx::Transaction;

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

#[async_trait]
impl TxHandler<sqlx::Sqlite> for Credit {
    async fn handle(
        &self,
        tx: &mut Transaction<'static, sqlx::Sqlite>,
        msg: &Message,
    ) -> Result<(), BoxError> {
        let id = payment_id(msg)?;
        sqlx::query(&format!(
            "INSERT INTO {} (payment_id, cents) VALUES (?1, 500)",
            self.table
        ))
        .bind(id)
        .execute(&mut **tx)
        .await?;
        if self.should_fail() {
            return Err("injected failure after the business write".into());
        }
        Ok(())
    }
}

#[async_trait]
impl TxHandler<sqlx::Postgres> for Credit {
    async fn handle(
        &self,
        tx: &mut Transaction<'static, sqlx::Postgres>,
        msg: &Message,
    ) -> Result<(), BoxError> {
        let id = payment_id(msg)?;
        sqlx::query(&format!(
            "INSERT INTO {} (payment_id, cents) VALUES ($1, 500)",
            self.table
        ))
        .bind(id)
        .execute(&mut **tx)
        .await?;
        if self.should_fail() {
            return Err("injected failure after the business write".into());
        }
        Ok(())
    }
}

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

async fn group_sqlite(pool: &sqlx::SqlitePool, table: &str) -> HashMap<String, i64> {
    let sql = format!("SELECT payment_id, count(*) FROM {table} GROUP BY payment_id");
    let rows: Vec<(String, i64)> = sqlx::query_as(&sql)
        .fetch_all(pool)
        .await
        .expect("count effects");
    rows.into_iter().collect()
}

async fn group_pg(pool: &sqlx::PgPool, table: &str) -> HashMap<String, i64> {
    let sql = format!("SELECT payment_id, count(*) FROM {table} GROUP BY payment_id");
    let rows: Vec<(String, i64)> = sqlx::query_as(&sql)
        .fetch_all(pool)
        .await
        .expect("count effects");
    rows.into_iter().collect()
}

#[async_trait]
impl Ledger for SqliteLedger {
    async fn effects(&self) -> HashMap<String, i64> {
        group_sqlite(self.inbox().pool(), &self.handler().table).await
    }
    fn fail_next(&self, n: u32) {
        self.handler().fail_first.store(n, Ordering::SeqCst);
    }
    async fn cleanup(&self) {}
}

#[async_trait]
impl Ledger for PgLedger {
    async fn effects(&self) -> HashMap<String, i64> {
        group_pg(self.inbox().pool(), &self.handler().table).await
    }
    fn fail_next(&self, n: u32) {
        self.handler().fail_first.store(n, Ordering::SeqCst);
    }
    async fn cleanup(&self) {
        let t = &self.handler().table;
        for table in [t.clone(), format!("{t}_inbox")] {
            sqlx::query(&format!("DROP TABLE IF EXISTS {table}"))
                .execute(self.inbox().pool())
                .await
                .expect("drop");
        }
    }
}

#[async_trait]
impl Ledger for MemoryLedger {
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

#[async_trait]
impl Ledger for RedisLedger {
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

pub async fn sqlite_ledger() -> SqliteLedger {
    use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
    let dir = Box::leak(Box::new(tempfile::tempdir().expect("tempdir")));
    let opts = SqliteConnectOptions::new()
        .filename(dir.path().join("ledger.db"))
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .busy_timeout(Duration::from_secs(10));
    let pool = SqlitePoolOptions::new()
        .max_connections(4)
        .connect_with(opts)
        .await
        .expect("sqlite");
    let table = format!("credits_{}", suffix());
    sqlx::query(&format!(
        "CREATE TABLE {table} (payment_id TEXT NOT NULL, cents INTEGER NOT NULL)"
    ))
    .execute(&pool)
    .await
    .unwrap();
    let inbox = Inbox::with_options(
        pool,
        InboxOptions::default().with_table(format!("{table}_inbox")),
    )
    .unwrap();
    inbox.migrate().await.unwrap();
    SqlInbox::new(inbox, Credit::new(table))
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
    let pool = pg_pool().await;
    let table = format!("credits_{}", suffix());
    sqlx::query(&format!(
        "CREATE TABLE {table} (payment_id TEXT NOT NULL, cents BIGINT NOT NULL)"
    ))
    .execute(&pool)
    .await
    .unwrap();
    let inbox = Inbox::with_options(
        pool,
        InboxOptions::default().with_table(format!("{table}_inbox")),
    )
    .unwrap();
    inbox.migrate().await.unwrap();
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
pub async fn eventually<F, Fut>(bound: Duration, mut cond: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let end = tokio::time::Instant::now() + bound;
    loop {
        if cond().await {
            return true;
        }
        if tokio::time::Instant::now() > end {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
